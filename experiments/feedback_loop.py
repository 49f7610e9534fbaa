r"""The feedback loop, measured: does the answer loss teach the retriever what the generator needs?

    python experiments/feedback_loop.py --out /tmp/feedback            # the full experiment
    python experiments/feedback_loop.py --out /tmp/feedback_quick --quick

Same seed, same world, same step budget for every row, all evaluated on held-out entities:
  1. closed_book       the generator alone, no retrieval (parametric memory only);
  2. frozen_<variant>  inverse-cloze retriever, then frozen; the generator trains (bolt-on RAG);
  3. joint_<variant>   the question encoder trains through the RAG marginal likelihood (the
                       passage encoder frozen: the paper's setting);
  4. joint_refresh     the passage encoder trains too, the index re-encoded every k steps.
Rows 2-3 run for RAG-Sequence and RAG-Token. No row uses gold passage ids in training.

Then the hot-swap test for rows 2-4: a sample of held-out facts get new answers in the corpus, the
index is rebuilt from the edited corpus with the trained passage encoder, no parameter changes,
and EM is measured against the new answers on the edited facts and against the old ones on the
rest.

The rows, the experiment and the hot-swap test are `rag_jax.feedback`. Writes
`<out>/results.json`, `<out>/curves.png` (held-out gold recall@5 and EM against the step for rows
2-4) and prints a Markdown table. Each row's run directory `<out>/<row>` keeps its
checkpoints and `metrics.jsonl`; an interrupted experiment resumes where it stopped.
"""

import argparse
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "configs"))
import feedback as feedback_config  # noqa: E402

from rag_jax import feedback  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for runs, results.json, curves.png")
    parser.add_argument("--quick", action="store_true", help="small world, rows 1-3 sequence")
    parser.add_argument("--rows", default="", help="comma-separated subset of rows to run")
    parser.add_argument("--no-plot", action="store_true", help="skip curves.png (no matplotlib)")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    base = feedback_config.get_config(quick=args.quick)
    selected = feedback.rows(args.quick, feedback_config.REFRESH_EVERY)
    if args.rows:
        unknown = set(args.rows.split(",")) - set(selected)
        if unknown:
            parser.error(f"unknown rows {sorted(unknown)}; choose from {sorted(selected)}")
        selected = {k: v for k, v in selected.items() if k in args.rows.split(",")}

    out = pathlib.Path(args.out).absolute()
    results = feedback.run(
        base,
        out,
        selected,
        hot_swap_fraction=feedback_config.HOT_SWAP_FRACTION,
        quick=args.quick,
        make_plot=not args.no_plot,
    )
    print("\n" + feedback.table(results))
    print(f"\nwrote {out / 'results.json'}" + ("" if args.no_plot else f", {out / 'curves.png'}"))
    print(f"total {results['seconds']:.0f} s")
    return results


if __name__ == "__main__":
    main()
