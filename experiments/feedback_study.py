"""The feedback-loop experiment: does the answer loss teach the retriever what the generator needs?

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
rest. `experiments/feedback_loop.py` is the command line.
"""

import json
import pathlib
import time

import ml_collections

from rag_jax.devices import distributed
from rag_jax.retrieval import files
from rag_jax.retrieval.corpus import Passage
from rag_jax.run import data, settings, synthetic
from rag_jax.run.index_build import workdir_store
from rag_jax.training import evaluation, loop

FREEZE_RETRIEVER = r"^(passage_encoder/|question_encoder/|generator/final_logits_bias)"
FREEZE_GENERATOR_BIAS = r"^(generator/final_logits_bias)"

COLUMNS = ("gold_recall@1", "gold_recall@5", "answer_recall@5", "exact_match", "f1")


def rows(quick: bool, refresh_every: int) -> dict[str, dict]:
    """Row name -> config overrides (dotted keys); `quick`: rows 1-3, RAG-Sequence only."""
    out = {
        "closed_book": {
            "rag.closed_book": True,
            "rag.n_docs": 1,
            "train.freeze": FREEZE_RETRIEVER,
            "warm_start.method": "none",
        },
    }
    variants = ("sequence",) if quick else ("sequence", "token")
    for variant in variants:
        out[f"frozen_{variant}"] = {"rag.variant": variant, "train.freeze": FREEZE_RETRIEVER}
        out[f"joint_{variant}"] = {"rag.variant": variant}
    if not quick:
        out["joint_refresh"] = {
            "train.freeze": FREEZE_GENERATOR_BIAS,
            "retrieval.refresh_every": refresh_every,
        }
    return out


def row_config(base: ml_collections.ConfigDict, overrides: dict, cache_dir: str):
    """`base` with a row's overrides; every row shares the warm start cached in `cache_dir`."""
    config = settings.override(ml_collections.ConfigDict(base.to_dict()), overrides)
    config.warm_start.cache_dir = cache_dir  # rows share one warm start
    return config


def curves(workdir: pathlib.Path) -> list[dict]:
    """The eval/* lines of a run's metrics.jsonl, one per evaluated step (latest wins)."""
    by_step = {}
    with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            values = {k[5:]: v for k, v in record.items() if k.startswith("eval/")}
            if values:
                by_step[record["step"]] = values
    return [{"step": step, **values} for step, values in sorted(by_step.items())]


def hot_swap(workdir: pathlib.Path, fraction: float, seed: int) -> dict:
    """EM on edited held-out facts (new answers) vs unedited ones, after re-indexing only."""
    exp, state, _ = loop.restore(workdir)
    world, edited = synthetic.edit_facts(exp.world, fraction, seed, split="eval")
    cfg = exp.rag_cfg
    store = workdir_store(
        [Passage(p.id, p.title, p.text) for p in world.passages],
        exp.generator_tokenizer,
        workdir / "hot_swap_passages",
        {"prefix": cfg.prefix or "", "title_sep": cfg.title_sep, "doc_sep": cfg.doc_sep},
    )
    # The edited corpus, encoded by the trained passage encoder; no parameter changes.
    passage_params = distributed.replicated_to_host(state.params["passage_encoder"])
    retriever = exp.build_retriever(passage_params, store=store, save=False)
    examples = data.examples_from_world(world, "eval")
    edited_ids = {f"{f.entity.replace(' ', '_')}:{f.relation}" for f in edited}
    mesh = loop.device_mesh(exp.config)
    out = {"edited_facts": len(edited_ids)}
    for name, subset in (
        ("edited", [e for e in examples if e.id in edited_ids]),
        ("unedited", [e for e in examples if e.id not in edited_ids]),
    ):
        m, _ = evaluation.evaluate(
            exp,
            state.params,
            subset,
            mesh=mesh,
            variant=exp.config.rag.variant,
            retriever=retriever,
        )
        out[f"em_{name}"] = m["exact_match"]
        out[f"gold_recall@5_{name}"] = m.get("gold_recall@5", float("nan"))
    out["em_ratio"] = out["em_edited"] / out["em_unedited"] if out["em_unedited"] else float("nan")
    return out


def plot(results: dict, path: pathlib.Path) -> dict[str, dict[str, str]]:
    """Held-out gold recall@5 and EM against the training step, one line per row (rows 2-4).

    A row run for one step (one where nothing trains, so one step stands for any number) is
    drawn as a level across the plot; a metric evaluated once at the end of a longer run, as one
    point. Returns what was drawn: row -> metric -> "curve" (one point or more) or "level".
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    rows = [(n, r) for n, r in results["rows"].items() if n != "closed_book"]
    drawn = {}
    for i, (name, row) in enumerate(rows):
        color = colors[i % len(colors)]  # a row's colour on both plots
        for ax, key in zip(axes, ("gold_recall@5", "exact_match")):
            # The points that have the metric (`eval.every_answers=False`: recalls only).
            points = [(c["step"], c[key]) for c in row["curve"] if key in c]
            if len(points) == 1 and points[0][0] <= 1:  # a one-step row: nothing trains in it
                step, value = points[0]
                style = ("--", ":", "-.")[len(ax.lines) % 3]  # equal levels stay apart
                ax.axhline(value, linestyle=style, color=color, label=f"{name} (step {step})")
                drawn.setdefault(name, {})[key] = "level"
            elif points:
                ax.plot(*zip(*points, strict=True), marker=".", color=color, label=name)
                drawn.setdefault(name, {})[key] = "curve"
    for ax, title in zip(axes, ("held-out gold-passage recall@5", "held-out exact match")):
        ax.set_title(title)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)  # the axis fits the values, so that a point's gain shows
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return drawn


def table(results: dict) -> str:
    """The final held-out metrics and the hot-swap EMs of every row, as a Markdown table."""
    lines = [
        "| row | " + " | ".join(COLUMNS) + " | hot-swap EM edited / unedited |",
        "|---" * (len(COLUMNS) + 2) + "|",
    ]
    for name, row in results["rows"].items():
        cells = [f"{row['final'][k]:.3f}" if k in row["final"] else "-" for k in COLUMNS]
        swap = row.get("hot_swap")
        swap_cell = f"{swap['em_edited']:.3f} / {swap['em_unedited']:.3f}" if swap else "-"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {swap_cell} |")
    return "\n".join(lines)


def _flat(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_changes(earlier: dict, config: dict) -> list[str]:
    """The settings in which `config` differs from the `earlier` rows' config (both as JSON keeps
    them), sorted. A setting the earlier config lacks counts only away from its default: a setting
    added since leaves the rows it did not exist for as they were. One the earlier had and `config`
    lacks always counts (the rows were run with something this code cannot repeat)."""
    earlier = _flat(earlier)
    config = _flat(json.loads(json.dumps(config)))
    default = _flat(json.loads(json.dumps(settings.defaults().to_dict())))
    changed = []
    for key in sorted(set(earlier) | set(config)):
        if key not in earlier:
            if key not in default or config[key] != default[key]:
                changed.append(key)
        elif key not in config or config[key] != earlier[key]:
            changed.append(key)
    return changed


def run(
    base: ml_collections.ConfigDict,
    out: pathlib.Path,
    selected: dict[str, dict],
    *,
    hot_swap_fraction: float = 0.0,
    swap=None,
    cache_dir=None,
    quick: bool = False,
    make_plot: bool = True,
) -> dict:
    """Trains and evaluates every row of `selected` (see `rows`) into `out/<row>`.

    Rows already in `out/results.json` with the same overrides (and base config: rows of another
    are refused, not mixed in) are kept, not run again, so an
    interrupted experiment resumes where it stopped: a row preempted (SIGTERM) saves its training
    and ends the study there (returned with `"preempted": row`), without evaluating it. Writes
    `out/results.json` after every row and `out/curves.png` at the end.

    Args:
      base: the experiment's config; `selected`: row name -> overrides.
      hot_swap_fraction: the synthetic world's hot swap (`hot_swap`) of every row but closed
        book, when `swap` is None; none when it is 0 too.
      swap: `swap(row workdir) -> dict`, another hot swap (real text's), instead.
      cache_dir: where the rows' warm starts are shared (default `out/cache`).

    Returns:
      {"config", "quick", "rows": {row: {"overrides", "final", "curve", "seconds",
      "hot_swap"}}, "seconds"}.
    """
    out = pathlib.Path(out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    results = {"config": base.to_dict(), "quick": quick, "rows": {}}
    previous = out / "results.json"
    if previous.is_file():  # rows run earlier into the same folder, from the same config, are kept
        earlier = json.loads(previous.read_text())
        changed = config_changes(earlier.get("config", {}), results["config"])
        if changed:
            raise ValueError(
                f"{previous} holds rows of another base config (another --config, --variant or "
                f"seed, or a changed default: {', '.join(changed)}); use another --out, or delete "
                "it to run them again"
            )
        results["rows"] = earlier.get("rows", {})
    start = time.perf_counter()
    for name, overrides in selected.items():
        if name in results["rows"] and results["rows"][name]["overrides"] == overrides:
            print(f"\n== {name} == (done: kept from {previous})", flush=True)
            continue
        print(f"\n== {name} ==", flush=True)
        t0 = time.perf_counter()
        config = row_config(base, overrides, str(cache_dir or out / "cache"))
        summary = loop.train_and_evaluate(config, out / name)
        if "preempted" in summary:  # saved; running the study again resumes this row
            done = sorted(results["rows"])
            print(f"{name} preempted ({summary['preempted']}); rows done: {done}", flush=True)
            results["preempted"] = name
            return results
        row = {
            "overrides": overrides,
            "final": summary["eval"],
            "curve": curves(out / name),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        if name != "closed_book" and (swap or hot_swap_fraction):
            row["hot_swap"] = (
                swap(out / name) if swap else hot_swap(out / name, hot_swap_fraction, base.seed)
            )
        results["rows"][name] = row
        print(json.dumps({name: {"final": row["final"], "hot_swap": row.get("hot_swap")}}))
        files.write_atomic(previous, json.dumps(results, indent=1, sort_keys=True).encode())
    results["seconds"] = round(time.perf_counter() - start, 1)
    files.write_atomic(previous, json.dumps(results, indent=1, sort_keys=True).encode())
    if make_plot:
        plot(results, out / "curves.png")
    return results
