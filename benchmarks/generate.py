"""Suite `generate`: RAG answer generation, rag_jax (`rag.generate`, called plainly) vs HF.

Two decoders, both with beam search (K = 4 beams) over the same retrieved contexts:
- RAG-Token: one beam search whose next-token distribution is marginalised over the N docs
  (HF `RagTokenForGeneration.generate`).
- RAG-Sequence "thorough": a beam search per doc, then every distinct candidate rescored against
  all N docs (HF `RagSequenceForGeneration.generate`, which loops over the questions; rag_jax runs
  the whole batch at once). rag_jax is called with `mask_candidate_contexts=False`, HF's behaviour.

Both sides get the same weights (the HF checkpoint loaded with `hf.load_rag`), the same contexts
(`context_input_ids`, `context_attention_mask`, `doc_scores`: what the retriever hands over), the
same settings, float32 and the benchmark's threads. After warm-up (compilation for rag_jax, a few
calls for torch) the sides alternate single calls; times are medians, `speedup_min` is the ratio
of the fastest calls (see `train_step` for why both). `same_output` says whether the two returned
identical token ids for every question.

Legend: B questions, N docs, S context length, K beams.
"""

import gc
import tempfile

import jax
import numpy as np
import torch
import transformers

from benchmarks import common
from benchmarks.train_step import save_hf_rag
from rag_jax import rag
from rag_jax.io import hf

N_DOCS, CONTEXT, BEAMS = 5, 128, 4
# Passed identically to HF `generate` and to `rag.generate` (BART's forced BOS/EOS, as RAG uses).
SETTINGS = dict(
    max_length=20,
    min_length=1,
    length_penalty=1.0,
    early_stopping=False,
    forced_bos_token_id=0,
    forced_eos_token_id=2,
)
HF_IDS = dict(decoder_start_token_id=2, eos_token_id=2, pad_token_id=1, bos_token_id=0)
# name -> (B, timed calls per side, torch warm-up calls)
CASES = {"tiny": (8, 7, 3), "base": (4, 2, 1)}
QUICK_CASES = {"tiny": (2, 3, 2)}


def make_contexts(cfg: rag.RagConfig, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    """[B * N, S] right-padded contexts (half to full length) and [B, N] doc scores."""
    rng = np.random.default_rng(seed)
    rows = batch * N_DOCS
    ids = rng.integers(3, cfg.generator.vocab_size, size=(rows, CONTEXT))
    lengths = rng.integers(CONTEXT // 2, CONTEXT + 1, rows)
    mask = (np.arange(CONTEXT)[None, :] < lengths[:, None]).astype(np.int64)
    ids[:, 0] = cfg.generator.bos_token_id
    ids[np.arange(rows), lengths - 1] = cfg.generator.eos_token_id
    return {
        "context_input_ids": np.where(mask == 1, ids, cfg.pad_token_id),
        "context_attention_mask": mask,
        "doc_scores": (rng.normal(size=(batch, N_DOCS)) * 2).astype(np.float32),
    }


def _jax_fn(cfg, params, contexts, variant):
    """`rag.generate` called plainly, as the README calls it: no jit of the caller's, the
    parameters as `hf.load_rag` returns them (numpy) and numpy inputs."""
    kwargs = dict(variant=variant, num_beams=BEAMS, **SETTINGS)
    if variant == "sequence":
        kwargs["mask_candidate_contexts"] = False
    names = ("context_input_ids", "context_attention_mask", "doc_scores")
    args = [contexts[k] for k in names]
    return lambda: np.asarray(rag.generate(cfg, params, *args, **kwargs))


def _torch_fn(model, contexts):
    t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in contexts.items()}

    def run():
        with torch.no_grad():
            return model.generate(**t, num_beams=BEAMS, **SETTINGS, **HF_IDS).numpy()

    return run


def _same(ours: np.ndarray, ref: np.ndarray, pad: int) -> bool:
    """Equal token ids per question, the shorter output padded with `pad` (HF trims to longest)."""
    if ours.shape[0] != ref.shape[0]:
        return False
    width = max(ours.shape[1], ref.shape[1])
    pad_to = lambda a: np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=pad)  # noqa: E731
    return bool(np.array_equal(pad_to(ours), pad_to(ref)))


def _compare(ours_fn, ref_fn, repeats, warmup, pad) -> dict:
    timings, ours_out, ref_out = common.compare(ours_fn, ref_fn, repeats=repeats, warmup=warmup)
    return {
        **timings,
        "same_output": _same(ours_out, ref_out, pad),
        "ours_tokens": ours_out.tolist(),
        "ref_tokens": ref_out.tolist(),
    }


def run(quick: bool = False) -> dict:
    rows = []
    for name, (batch_size, repeats, warmup) in (QUICK_CASES if quick else CASES).items():
        with tempfile.TemporaryDirectory() as tmp:
            save_hf_rag(name, tmp)
            cfg, params = hf.load_rag(tmp)
            contexts = make_contexts(cfg, batch_size)
            for variant, label, cls in (
                ("token", "rag-token beam", transformers.RagTokenForGeneration),
                ("sequence", "rag-sequence thorough", transformers.RagSequenceForGeneration),
            ):
                model = cls.from_pretrained(tmp).eval()
                result = _compare(
                    _jax_fn(cfg, params, contexts, variant),
                    _torch_fn(model, contexts),
                    repeats,
                    warmup,
                    cfg.pad_token_id,
                )
                rows.append(
                    {
                        "case": f"{label} {name} B={batch_size} N={N_DOCS} S={CONTEXT} K={BEAMS} "
                        f"L={SETTINGS['max_length']}",
                        **result,
                        "ours_q_per_s": batch_size / result["ours_s"],
                        "ref_q_per_s": batch_size / result["ref_s"],
                    }
                )
                print(
                    f"  {rows[-1]['case']}: ours {result['ours_s']:.4g}s, "
                    f"ref {result['ref_s']:.4g}s, x{result['speedup']:.3g}, "
                    f"same_output={result['same_output']}",
                    flush=True,
                )
                del model
                gc.collect()
            del params
            gc.collect()
    return {
        "columns": [
            "case",
            "ours_s",
            "ref_s",
            "speedup",
            "speedup_min",
            "ours_q_per_s",
            "ref_q_per_s",
            "compile_s",
            "same_output",
        ],
        "rows": rows,
        "reference": f"transformers {transformers.__version__} PyTorch {torch.__version__} eager "
        "generate",
        "ours": f"jax {jax.__version__}: rag.generate called plainly (jitted and cached inside)",
        "threads": torch.get_num_threads(),
        "backend": jax.default_backend(),
        "setup": {"n_docs": N_DOCS, "context_length": CONTEXT, "num_beams": BEAMS, **SETTINGS},
    }
