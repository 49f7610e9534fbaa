r"""The feedback loop, measured: does the answer loss teach the retriever what the generator needs?

    python experiments/feedback_loop.py --out /tmp/feedback            # the full experiment
    python experiments/feedback_loop.py --out /tmp/feedback_quick --quick

Rows 1-4 (closed book, frozen retriever, joint, joint with index refresh) and the hot-swap test are
described and run by `rag_jax.feedback`. Writes `<out>/results.json`, `<out>/curves.png` (held-out
gold recall@5 and EM against the step for rows 2-4) and prints a Markdown table. Each row's run
directory `<out>/<row>` keeps its checkpoints and `metrics.jsonl`; an interrupted experiment
resumes where it stopped.
"""

import argparse
import importlib.util
import os
import pathlib

import feedback_study
from rag_jax.devices import host

# Loaded by path, as `--config experiments/configs/feedback.py` would load it.
_SPEC = importlib.util.spec_from_file_location(
    "feedback_config", pathlib.Path(__file__).resolve().parent / "configs" / "feedback.py"
)
feedback_config = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(feedback_config)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for runs, results.json, curves.png")
    parser.add_argument("--quick", action="store_true", help="small world, rows 1-3 sequence")
    parser.add_argument("--rows", default="", help="comma-separated subset of rows to run")
    parser.add_argument("--no-plot", action="store_true", help="skip curves.png (no matplotlib)")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    base = feedback_config.get_config(quick=args.quick)
    selected = feedback_study.rows(args.quick, feedback_config.REFRESH_EVERY)
    if args.rows:
        unknown = set(args.rows.split(",")) - set(selected)
        if unknown:
            parser.error(f"unknown rows {sorted(unknown)}; choose from {sorted(selected)}")
        selected = {k: v for k, v in selected.items() if k in args.rows.split(",")}

    out = pathlib.Path(args.out).absolute()
    results = feedback_study.run(
        base,
        out,
        selected,
        hot_swap_fraction=feedback_config.HOT_SWAP_FRACTION,
        quick=args.quick,
        make_plot=not args.no_plot,
    )
    print("\n" + feedback_study.table(results))
    print(f"\nwrote {out / 'results.json'}" + ("" if args.no_plot else f", {out / 'curves.png'}"))
    print(f"total {results['seconds']:.0f} s")
    return results


if __name__ == "__main__":
    host.restart_with_host_settings()  # read only at process start: before any work
    main()
