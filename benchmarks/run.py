r"""rag_jax vs its reference, side by side in one process, on the same threads.

    python -m benchmarks.run --suites models            # one suite
    python -m benchmarks.run --suites models,index --out bench_results

Each suite lives in `benchmarks/<suite>.py` and exposes `run(quick: bool) -> dict` returning
{"columns": [...], "rows": [...], ...}; rows carry absolute times and the ratio to the reference.
Results are printed as tables and written to `<out>/<suite>.json`; the `scale` suite also takes
its corpus sizes (`--scale_sizes 1000000,2000000`).

The script first restarts itself with `rag_jax.devices.host`'s settings: glibc's large
allocations on transparent huge pages and OpenBLAS's idle workers asleep (both sides share the
process and so the settings). `RAG_JAX_HUGE_PAGES=0` and `OPENBLAS_THREAD_TIMEOUT=28` measure
without them.
"""

import argparse
import importlib
import os

from rag_jax.devices import host

SUITES = ("models", "index", "encode", "train_step", "generate", "e2e", "causal", "memo", "scale")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suites", default="models", help=f"comma-separated, from {SUITES}")
    parser.add_argument("--out", default="bench_results", help="folder for <suite>.json")
    parser.add_argument(
        "--threads", type=int, default=2, help="torch CPU threads (match the cores XLA uses)"
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    parser.add_argument(
        "--scale_sizes", default="", help="scale suite: comma-separated corpus sizes (1M,2M,4M)"
    )
    parser.add_argument(
        "--scale_indexes",
        default="",
        help="scale suite: comma-separated subset of exact,scann,hnsw,ivfpq (default: all)",
    )
    args = parser.parse_args(argv)

    # XLA's CPU client uses every core of the machine (2 here); torch is given the same count.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import torch

    torch.set_num_threads(args.threads)

    from benchmarks import common

    os.makedirs(args.out, exist_ok=True)
    # Both sides share the process, so both run on the same host settings (`rag_jax.devices.host`).
    host_settings = {
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
        "transparent_huge_pages": host.thp_mode(),
        "openblas_thread_timeout": os.environ.get(host.OPENBLAS_TIMEOUT[0], "default (28)"),
    }
    print(f"host: {host_settings}")
    for name in args.suites.split(","):
        if name not in SUITES:
            parser.error(f"unknown suite {name!r}; choose from {SUITES}")
        try:
            suite = importlib.import_module(f"benchmarks.{name}")
        except ModuleNotFoundError as e:
            parser.error(f"suite {name!r} is not available yet ({e})")
        print(f"\n== {name} ==")
        if name == "scale":  # the one suite with sizes of its own
            sizes = [int(n) for n in args.scale_sizes.split(",") if n]
            indexes = [n for n in args.scale_indexes.split(",") if n] or None
            result = suite.run(quick=args.quick, sizes=sizes or None, out=args.out, indexes=indexes)
        else:
            result = suite.run(quick=args.quick)
        result["host"] = host_settings
        common.print_table(result["rows"], result["columns"])
        path = os.path.join(args.out, f"{name}.json")
        common.write_json(path, result)
        print(f"wrote {path}")


if __name__ == "__main__":
    host.restart_with_host_settings()  # read only at process start: before any work
    main()
