"""The accelerator check: train-step MFU, and DeviceIndex search against the bandwidth bound.

`benchmarks/accelerator_check.py` is the command line; this module holds its options, runs its
two phases in turn, and measures the first: the joint train step's MFU at the largest batch that
fits. The second phase is `benchmarks.search_check`; the model FLOPs and the devices' peak figures
are `benchmarks.flops`. See the script's docstring for what is measured and the goals.

Legend: B batch, N docs, S context length, T target length, Q question length, C index rows, D
vector width.
"""

import argparse
import functools
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.flops import device_peaks, train_flops
from benchmarks.search_check import search_check
from rag_jax import rag
from rag_jax.devices import distributed, sharding
from rag_jax.models import bart, bert
from rag_jax.training.optim import make_optimizer, settings_for
from rag_jax.training.step import TrainState, make_train_step

N_DOCS, CONTEXT, TARGET, QUESTION = 5, 128, 32, 32
SHAPES = ("n_docs", "question", "context", "target")  # the step's shape flags
MFU_GOAL = 0.40


def is_oom(error: BaseException) -> bool:
    text = str(error)
    return any(s in text for s in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM"))


class SimulatedOOM(RuntimeError):
    """The compiled step needs more than `--memory-limit-gb` (XLA's estimate): treated as OOM."""

    def __str__(self):
        return "RESOURCE_EXHAUSTED (estimated): " + super().__str__()


def xla_flops(compiled) -> float | None:
    """FLOPs of a compiled program per XLA's cost analysis (per device), or None."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else None
    return float(cost["flops"]) if cost and "flops" in cost else None


def memory_bytes(compiled) -> int | None:
    """Peak device bytes of a compiled program per XLA's memory analysis, or None."""
    try:
        m = compiled.memory_analysis()
        total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
        return int(total - m.alias_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None


# ---------------------------------------------------------------------------------------------
# The train step


def model_configs(smoke: bool, dtype: str, remat: bool, dropout: bool):
    """(BERT question-encoder config, BART generator config): base + large, or tiny."""
    q_drop = {} if dropout else dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    g_drop = dict(dropout=0.1) if dropout else dict(dropout=0.0)
    common = dict(dtype=dtype, remat=remat)
    if smoke:
        q = bert.BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=1,
                            num_attention_heads=4, intermediate_size=128,
                            **q_drop, **common)  # fmt: skip
        g = bart.BartConfig(vocab_size=1000, d_model=64, encoder_layers=1, decoder_layers=1,
                            encoder_attention_heads=4, decoder_attention_heads=4,
                            encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=256,
                            **g_drop, **common)  # fmt: skip
    else:  # the sizes of bert-base-uncased (DPR) and facebook/bart-large
        q = bert.BertConfig(**q_drop, **common)
        g = bart.BartConfig(**g_drop, **common)
    return q, g


def optimizer_config() -> ml_collections.ConfigDict:
    """AdamW as the trainer builds it for `nq.py` (clipping, warmup + linear decay, weight-decay
    mask), from `training.optim.settings_for`."""
    return settings_for(
        optimizer="adamw",
        learning_rate=3e-5,
        warmup_steps=500,
        steps=10_000,
        decay="linear",
        retriever_lr_factor=1.0,
        weight_decay=0.001,
        grad_clip=1.0,
        freeze=r"^generator/final_logits_bias",
    )


class StepBench:
    """Builds, compiles and times the train step for one batch size at a time."""

    def __init__(self, rag_cfg: rag.RagConfig, mesh, variant: str, deterministic: bool,
                 shapes: dict):  # fmt: skip
        self.cfg, self.mesh, self.shapes = rag_cfg, mesh, shapes
        self.replicated = NamedSharding(mesh, P())
        self.rows = NamedSharding(mesh, P(sharding.DATA_AXIS))
        abstract = jax.eval_shape(
            functools.partial(rag.init_params, rag_cfg), jax.random.PRNGKey(0)
        )
        self.tx = make_optimizer(optimizer_config())
        self.params_count = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract))
        self.step = make_train_step(rag_cfg, variant, self.tx, jax.random.PRNGKey(1), deterministic)

        def init(rng):
            params = rag.init_params(rag_cfg, rng)
            return TrainState(jnp.zeros((), jnp.int32), params, self.tx.init(params))

        self._init = jax.jit(init, out_shardings=self.replicated)

    def state(self):
        """A fresh TrainState made on the devices (a failed step may have consumed the last)."""
        return self._init(jax.random.PRNGKey(0))

    def batch(self, size: int) -> dict:
        """Random questions, doc vectors, contexts and labels of `size` rows, on the devices."""
        q, g = self.cfg.question_encoder, self.cfg.generator
        n_docs, question, context, target = (self.shapes[k] for k in SHAPES)

        def make(rng):
            k1, k2, k3, k4 = jax.random.split(rng, 4)
            labels = jax.random.randint(k4, (size, target), 3, g.vocab_size, jnp.int32)
            labels = labels.at[:, 0].set(g.decoder_start_token_id)
            return {
                "question_input_ids": jax.random.randint(
                    k1, (size, question), 3, q.vocab_size, jnp.int32
                ),
                "question_attention_mask": jnp.ones((size, question), jnp.int32),
                "doc_vectors": jax.random.normal(k2, (size, n_docs, q.embedding_dim)),
                "context_input_ids": jax.random.randint(
                    k3, (size, n_docs, context), 3, g.vocab_size, jnp.int32
                ),
                "context_attention_mask": jnp.ones((size, n_docs, context), jnp.int32),
                "labels": labels.at[:, 1].set(self.cfg.bos_token_id),
            }

        return jax.jit(make, out_shardings=self.rows)(jax.random.PRNGKey(size))

    def compile(self, size: int):
        """(compiled step, abstract inputs) for batch `size`; compiles without allocating."""
        state = jax.eval_shape(lambda: self.state())
        state = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.replicated), state
        )
        batch = jax.eval_shape(lambda: self.batch(size))
        batch = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.rows), batch
        )
        return self.step.lower(state, batch).compile()

    def time(self, compiled, size: int, warmup: int, repeats: int) -> list[float]:
        """Seconds per step over `repeats` steps after `warmup` steps."""
        state, batch = self.state(), self.batch(size)
        try:
            for _ in range(warmup):
                state, out = compiled(state, batch)
                jax.block_until_ready(out)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                state, out = compiled(state, batch)
                jax.block_until_ready(out)
                times.append(time.perf_counter() - t0)
            return times
        finally:
            del state, batch
            gc.collect()


def device_memory_limit(device) -> int | None:
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - CPU and some plugins have none
        return None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def train_check(args, mesh, peaks: dict, report) -> dict:
    """Finds the largest batch that fits, times the step there, and computes MFU."""
    q_cfg, g_cfg = model_configs(args.smoke, args.dtype, args.remat, not args.no_dropout)
    shapes = {k: getattr(args, k) for k in SHAPES}
    rag_cfg = rag.RagConfig(question_encoder=q_cfg, generator=g_cfg, n_docs=args.n_docs,
                            max_combined_length=args.context)  # fmt: skip
    bench = StepBench(rag_cfg, mesh, args.variant, args.no_dropout, shapes)
    n = mesh.size
    limit = int(args.memory_limit_gb * 2**30) if args.memory_limit_gb else None
    limit = limit or device_memory_limit(mesh.devices.flat[0])
    out = {
        "config": {
            "question_encoder": "bert-base" if not args.smoke else "tiny bert",
            "generator": "bart-large" if not args.smoke else "tiny bart",
            "params": bench.params_count,
            "dtype": args.dtype,
            "param_dtype": "float32",
            "remat": args.remat,
            "dropout": not args.no_dropout,
            "variant": args.variant,
            **shapes,
        },
        "memory_limit_bytes": limit,
        "trials": [],
    }
    report(out)

    def trial(size: int, timed: bool) -> dict:
        t0 = time.perf_counter()
        compiled = bench.compile(size)
        row = {"batch": size, "compile_s": time.perf_counter() - t0}
        row["memory_bytes"] = memory_bytes(compiled)
        row["xla_flops_per_device"] = xla_flops(compiled)
        if limit and row["memory_bytes"] and row["memory_bytes"] > limit:
            raise SimulatedOOM(f"batch {size} needs {row['memory_bytes']} bytes > {limit}")
        if timed:
            times = bench.time(compiled, size, args.warmup, args.repeats)
            row.update(step_s=statistics.median(times), step_times_s=times)
        return row

    def attempt(size: int, timed: bool = True) -> dict | None:
        print(f"train: batch {size} ...", flush=True)
        try:
            row = trial(size, timed)
        except Exception as e:  # noqa: BLE001 - OOM is an expected outcome; the rest re-raised
            if not is_oom(e):
                raise
            out["trials"].append({"batch": size, "oom": str(e).splitlines()[0][:300]})
            print(f"train: batch {size} does not fit", flush=True)
            report(out)
            return None
        out["trials"].append(row)
        print(f"train: batch {size}: {json.dumps(_short(row))}", flush=True)
        report(out)
        return row

    best, model = find_largest_batch(
        attempt,
        n,
        explicit=args.batch_sizes,
        probe=args.probe_batch,
        limit=limit,
        headroom=args.memory_headroom,
        max_batch=args.max_batch,
        max_retries=args.max_retries,
    )
    if best is None:
        raise RuntimeError(f"no batch fits (tried {[t['batch'] for t in out['trials']]})")
    out["memory_model"] = model
    flops = train_flops(q_cfg, g_cfg, best["batch"], **shapes)
    step_s = best["step_s"]
    out.update(
        batch=best["batch"],
        per_device_batch=best["batch"] // n,
        step_s=step_s,
        examples_per_s=best["batch"] / step_s,
        model_flops=flops,
        achieved_tflops=flops["train"] / step_s / 1e12,
    )
    xla = best.get("xla_flops_per_device")
    if xla:
        out["xla_flops"] = xla * n
        out["analytic_over_xla"] = flops["train"] / (xla * n)
    for row in out["trials"]:
        if "step_s" in row and peaks["tflops"]:
            row["mfu"] = (
                train_flops(q_cfg, g_cfg, row["batch"], **shapes)["train"]
                / row["step_s"]
                / (peaks["tflops"] * 1e12 * n)
            )
    if peaks["tflops"]:
        out["mfu"] = flops["train"] / step_s / (peaks["tflops"] * 1e12 * n)
        out["mfu_goal"] = MFU_GOAL
        out["meets_goal"] = out["mfu"] >= MFU_GOAL
    report(out)
    return out


def find_largest_batch(attempt, n: int, *, explicit=None, probe: int = 8, limit=None,
                       headroom: float = 0.92, max_batch: int = 4096,
                       max_retries: int = 4):  # fmt: skip
    """The largest global batch (a multiple of `n` devices) whose step fits in memory.

    Args:
      attempt: `attempt(batch) -> row | None`; None when the batch does not fit (out of memory).
        Rows carry "batch" and "memory_bytes" (XLA's estimate, or None).
      n: devices; every batch tried is a multiple of it.
      explicit: batches to try in ascending order, stopping at the first that does not fit.
      probe: without `explicit`, the first of two probe batches (the second is twice as large).
        With a memory `limit` and memory figures for both, memory(B) = fixed + B * per_example
        predicts the largest batch within `headroom * limit`, which is tried, shrinking by 15%
        after each failure (at most `max_retries` tries); without them, batches double from the
        second probe until one fails or `max_batch` is passed.

    Returns:
      (row of the largest batch that fit or None, the memory model or None).
    """
    best = model = None
    if explicit:
        for size in sorted(_round(s, n) for s in explicit):
            row = attempt(size)
            if row is None:
                break
            best = row
        return best, model
    probes = [_round(probe, n), _round(2 * probe, n)]
    rows = [attempt(probes[0])]
    if rows[0] is None:
        return None, model
    rows.append(attempt(probes[1]))
    best = rows[0] if rows[1] is None else rows[1]
    if rows[1] is None:
        return best, model
    if limit and all(r.get("memory_bytes") for r in rows):
        per_example = (rows[1]["memory_bytes"] - rows[0]["memory_bytes"]) / (probes[1] - probes[0])
        fixed = rows[0]["memory_bytes"] - per_example * probes[0]
        predicted = int((headroom * limit - fixed) / max(per_example, 1.0))
        model = {"fixed_bytes": fixed, "bytes_per_example": per_example, "predicted": predicted}
        size = _round_down(min(predicted, max_batch), n)
        for _ in range(max_retries):
            if size <= best["batch"]:
                break
            row = attempt(size)
            if row is not None:
                return row, model
            size = _round_down(int(size * 0.85), n)
        return best, model
    size = probes[1] * 2
    while size <= max_batch:
        row = attempt(size)
        if row is None:
            break
        best, size = row, size * 2
    return best, model


def _round(size: int, n: int) -> int:
    return max(n, -(-size // n) * n)


def _round_down(size: int, n: int) -> int:
    return max(n, size // n * n)


def _short(row: dict) -> dict:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
            if k != "step_times_s"}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="accelerator_check.json", help="JSON report path")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: runs on a CPU in < 1 min")
    p.add_argument("--phases", default="train,search", help="comma-separated: train, search")
    p.add_argument("--peak-tflops", type=float, help="per-device dense bf16 TFLOP/s")
    p.add_argument("--peak-gbps", type=float, help="per-device memory bandwidth, GB/s")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--variant", default="sequence", choices=("sequence", "token"))
    p.add_argument("--n-docs", type=int, default=N_DOCS, help="k: passages per question")
    p.add_argument("--question", type=int, default=QUESTION, help="question tokens")
    p.add_argument("--context", type=int, default=CONTEXT, help="context tokens per passage")
    p.add_argument("--target", type=int, default=TARGET, help="answer tokens")
    p.add_argument("--remat", action="store_true", help="rematerialise layers (bigger batches)")
    p.add_argument("--no-dropout", action="store_true", help="deterministic step")
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")],
                   help="global batches to try, ascending until one does not fit")  # fmt: skip
    p.add_argument("--probe-batch", type=int, help="first probe batch (global)")
    p.add_argument("--max-batch", type=int, default=4096)
    p.add_argument("--max-retries", type=int, default=4, help="shrink steps after an OOM")
    p.add_argument("--memory-headroom", type=float, default=0.92, help="fraction of the limit")
    p.add_argument("--memory-limit-gb", type=float, help="per device; default: the device's")
    p.add_argument("--warmup", type=int, help="untimed steps / searches")
    p.add_argument("--repeats", type=int, help="timed steps / searches (median reported)")
    p.add_argument("--index-size", type=int, help="vectors in the index")
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--k", type=int, default=N_DOCS)
    p.add_argument("--search-batches", type=lambda s: [int(x) for x in s.split(",")])
    args = p.parse_args(argv)
    smoke = args.smoke
    defaults = dict(
        probe_batch=2 if smoke else 8,
        warmup=1 if smoke else 2,
        repeats=2 if smoke else 5,
        index_size=20_000 if smoke else 10_000_000,
        search_batches=[1, 8, 64] if smoke else [1, 8, 16, 32, 64, 128],
    )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if smoke and args.batch_sizes is None and args.memory_limit_gb is None:
        args.batch_sizes = [2, 4]
    args.verify_exact = args.index_size * args.dim <= 50_000_000
    args.phases = [x for x in args.phases.split(",") if x]
    unknown = set(args.phases) - {"train", "search"}
    if unknown:
        p.error(f"--phases: unknown {sorted(unknown)}; use train and/or search")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:  # tiny programs: LLVM's optimisation would take most of the smoke run's time
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
        ).strip()
    distributed.maybe_initialize_distributed()
    mesh = sharding.data_mesh(jax.local_devices())
    device = mesh.devices.flat[0]
    peaks = device_peaks(device.device_kind, args.peak_tflops, args.peak_gbps)
    result = {
        "device": {
            "platform": device.platform,
            "kind": device.device_kind,
            "count": mesh.size,
            "peak_bf16_tflops": peaks["tflops"],
            "peak_hbm_gbps": peaks["gbps"],
            "peak_source": peaks["source"],
        },  # fmt: skip
        "jax": jax.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "smoke": args.smoke,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(f"device: {json.dumps(result['device'])}", flush=True)

    def report_to(key):
        def report(section):
            result[key] = section
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=2, sort_keys=True, default=str)

        return report

    failed = False
    for phase, fn in (("train", train_check), ("search", search_check)):
        if phase not in args.phases:
            continue
        t0 = time.perf_counter()
        report = report_to(phase)
        try:
            section = fn(args, mesh, peaks, report)
        except Exception as e:  # noqa: BLE001 - record it, run the other phase
            failed = True
            section = dict(result.get(phase, {}), error=f"{type(e).__name__}: {e}"[:2000],
                           traceback=traceback.format_exc()[-4000:])  # fmt: skip
            print(f"{phase}: FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        section["wall_s"] = time.perf_counter() - t0
        report(section)
        gc.collect()

    summary = {
        "device": f"{mesh.size} x {device.device_kind}",
        "train_batch": result.get("train", {}).get("batch"),
        "step_s": result.get("train", {}).get("step_s"),
        "mfu": result.get("train", {}).get("mfu"),
        "search_best_fraction_of_bound": result.get("search", {}).get("best_fraction_of_bound"),
    }
    print(json.dumps(summary, sort_keys=True, default=str), flush=True)
    print(f"wrote {args.out}", flush=True)
    return 1 if failed else 0
