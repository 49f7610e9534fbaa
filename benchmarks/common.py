"""Timing and reporting shared by every benchmark suite.

Every suite times rag_jax and its reference in the same process on the same threads and reports
the ratio: absolute times on a shared machine move, ratios hold.
"""

import json
import statistics
import time
from collections.abc import Callable


def time_fn(fn: Callable[[], object], *, warmup: int = 3, repeats: int = 5) -> dict:
    """Runs `fn` `warmup` times untimed, then `repeats` times; returns seconds.

    `fn` must block until its result is ready (call `jax.block_until_ready` inside).

    Returns:
      {"first_s": time of the first (warm-up / compile) call, "median_s", "min_s", "runs"}.
    """
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    for _ in range(max(0, warmup - 1)):
        fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return {
        "first_s": first,
        "median_s": statistics.median(runs),
        "min_s": min(runs),
        "runs": runs,
    }


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    """(seconds, value) of one call."""
    t0 = time.perf_counter()
    value = fn()
    return time.perf_counter() - t0, value


# Untimed pause before each timed call of an alternating comparison. A library's worker threads
# spin for a while after its last op (PyTorch's OpenMP threads for milliseconds, XLA's and
# OpenBLAS's more briefly), and on 2 cores that spinning takes the other side's CPU: measured, a
# 10k-row exact search right after a torch matmul took 7.5 ms median against 0.9 ms right after a
# jax op. The pause lets each side start as it would in a process of its own.
SETTLE_S = 0.05


def settle() -> None:
    time.sleep(SETTLE_S)


def compare(ours_fn, ref_fn, *, repeats: int, warmup: int) -> tuple[dict, object, object]:
    """Times rag_jax against its reference: first calls (compile), warm-up, then alternating
    single timed calls, so both sides see the same machine load, each after `settle()`.

    Returns:
      (timings: medians, best-vs-best ratio, compile time and every run; ours' first value; the
      reference's first value).
    """
    ours_first_s, ours_out = timed(ours_fn)  # trace + compile + one call
    ref_first_s, ref_out = timed(ref_fn)
    ours_fn()
    for _ in range(warmup - 1):
        ref_fn()
    ours_runs, ref_runs = [], []
    for _ in range(repeats):
        settle()
        ours_runs.append(timed(ours_fn)[0])
        settle()
        ref_runs.append(timed(ref_fn)[0])
    ours_s, ref_s = statistics.median(ours_runs), statistics.median(ref_runs)
    timings = {
        "ours_s": ours_s,
        "ref_s": ref_s,
        "speedup": ref_s / ours_s,
        "speedup_min": min(ref_runs) / min(ours_runs),
        "compile_s": max(0.0, ours_first_s - ours_s),
        "ref_first_s": ref_first_s,
        "ours_runs_s": ours_runs,
        "ref_runs_s": ref_runs,
    }
    return timings, ours_out, ref_out


def matmul_peak(size: int = 2048, repeats: int = 5) -> dict:
    """This machine's float32 matmul throughput on the benchmark's threads: the fastest of
    `repeats` [size, size] @ [size, size] products, by XLA (jitted) and by torch.

    The ceiling for any model step on this machine: a step's model FLOPs divided by its time
    cannot exceed the better of the two (a step's matmuls are smaller, so they run below it).

    Returns:
      {"size", "xla_gflop_s", "torch_gflop_s", "peak_gflop_s"}.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    flops = 2 * size**3
    a = np.random.default_rng(0).standard_normal((size, size), dtype=np.float32)
    x = jnp.asarray(a)
    dot = jax.jit(jnp.dot)
    t = torch.from_numpy(a)
    xla = time_fn(lambda: dot(x, x).block_until_ready(), warmup=2, repeats=repeats)["min_s"]
    ref = time_fn(lambda: torch.mm(t, t), warmup=2, repeats=repeats)["min_s"]
    out = {"size": size, "xla_gflop_s": flops / xla / 1e9, "torch_gflop_s": flops / ref / 1e9}
    out["peak_gflop_s"] = max(out["xla_gflop_s"], out["torch_gflop_s"])
    return out


def print_table(rows: list[dict], columns: list[str]) -> None:
    """Prints `rows` as a fixed-width table with the given column order."""

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def write_json(path: str, payload: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
