"""experiments/feedback_loop.py end to end on a tiny world: rows, curves, hot-swap, results."""

import json
import pathlib

import feedback_loop
import pytest

import feedback_study
from rag_jax.run import paired, settings
from rag_jax.training import loop

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _tiny(quick=False):
    config = feedback_loop.feedback_config.default.get_config()
    config.data.num_entities = 12
    config.train.steps = 4
    config.train.batch_size = 8
    config.train.warmup_steps = 1
    config.train.retriever_delay_steps = 0
    config.train.log_every = 2
    config.warm_start.steps = 3
    config.warm_start.reader_steps = 2
    config.warm_start.reader_entities = 4
    config.warm_start.batch_size = 8
    config.eval.every = 2
    config.eval.batch_size = 8
    config.eval.max_length = 6
    config.rag.max_combined_length = 32
    config.retrieval.passage_max_length = 32
    return config


@pytest.mark.slow  # three tiny training runs and two re-indexings: ~60 s on 2 cores
def test_rows_curves_and_hot_swap(tmp_path, monkeypatch):
    monkeypatch.setattr(feedback_loop.feedback_config, "get_config", _tiny)
    results = feedback_loop.main(
        ["--out", str(tmp_path), "--quick", "--no-plot", "--rows", "closed_book,frozen_sequence"]
    )
    assert set(results["rows"]) == {"closed_book", "frozen_sequence"}
    written = json.loads((tmp_path / "results.json").read_text())
    assert set(written["rows"]) == set(results["rows"])

    closed = results["rows"]["closed_book"]
    assert "gold_recall@5" not in closed["final"] and "hot_swap" not in closed
    frozen = results["rows"]["frozen_sequence"]
    assert [c["step"] for c in frozen["curve"]] == [0, 2, 4]  # before, every 2 steps, after
    swap = frozen["hot_swap"]
    assert swap["edited_facts"] == 3  # 25% of the 12 facts of the 3 held-out entities
    for key in ("em_edited", "em_unedited", "gold_recall@5_edited", "gold_recall@5_unedited"):
        assert 0.0 <= swap[key] <= 1.0
    # The hot-swap index was built from the edited corpus, not the trained one.
    assert (tmp_path / "frozen_sequence" / "hot_swap_passages" / "manifest.json").is_file()

    # Run again into the same folder: the finished rows are kept, not trained or evaluated again.
    metrics = (tmp_path / "frozen_sequence" / "metrics.jsonl").read_text()
    again = feedback_loop.main(
        ["--out", str(tmp_path), "--quick", "--no-plot", "--rows", "closed_book,frozen_sequence"]
    )
    assert again["rows"] == written["rows"]
    assert (tmp_path / "frozen_sequence" / "metrics.jsonl").read_text() == metrics


def test_unknown_row_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        feedback_loop.main(["--out", str(tmp_path), "--quick", "--rows", "joint_sequnce"])


SEEDS = (0, 1, 2)


def test_joint_training_beats_the_frozen_retriever(tmp_path):
    """Rows 2 and 3 of `--quick` (200 entities, 160 steps) at three seeds: the question encoder
    trained through the answer likelihood alone, no gold ids, lifts held-out gold recall@5 over
    the frozen retriever, pooled over the seeds' 600 held-out questions with a paired bootstrap
    interval that excludes 0.

    One seed is not a claim a machine can keep: its gain moves with the CPU's floating-point
    kernels, which the warm starts amplify (at 80 steps seed 0 measured +0.25 on one machine and
    +0.045 on another Xeon, and the three seeds pooled +0.03 [-0.012, +0.072] on a CI machine,
    from a frozen 0.355 where this one starts at 0.43). Measured on a 2-core AMD EPYC
    (2026-12-07, 8 fake devices) at 160 steps: seeds 0, 1, 2 gain +0.255, +0.095 and +0.085
    (0.44 -> 0.695, 0.425 -> 0.52, 0.425 -> 0.51), pooled +0.145 [+0.103, +0.188]; seeds 3 and 4
    +0.14 and +0.28; at 500 steps on the full world (`feedback_loop.py`), +0.33 to +0.59 on
    seeds 0-4. Required: a pooled gain of at least 3 points whose 95% interval excludes 0, and a
    pooled EM gain. Kept in the default run (~4-5 min on 2 cores) because the feedback loop is the
    property the project exists for.
    """
    records = {"frozen_sequence": {}, "joint_sequence": {}}
    before = {}
    for seed in SEEDS:
        base = settings.override(
            feedback_loop.feedback_config.get_config(quick=True), {"seed": seed}
        )
        for name, overrides in feedback_study.rows(quick=True, refresh_every=0).items():
            if name == "closed_book":
                continue
            config = feedback_study.row_config(base, overrides, str(tmp_path / f"cache{seed}"))
            workdir = tmp_path / f"seed{seed}" / name
            summary = loop.train_and_evaluate(config, workdir)
            # Both rows start from the same warm-started retriever.
            assert before.setdefault(seed, summary["recall_at_5_before"]) == before[seed], seed
            for key, record in paired.read_per_question(workdir / "per_question.jsonl").items():
                records[name][f"{seed}/{key}"] = record
    recall = paired.paired_difference(
        records["frozen_sequence"], records["joint_sequence"], "gold_recall@5"
    )
    em = paired.paired_difference(
        records["frozen_sequence"], records["joint_sequence"], "exact_match"
    )
    assert recall["questions"] == 200 * len(SEEDS)
    assert recall["difference"] >= 0.03 and recall["low"] > 0, paired.describe(recall)
    assert em["difference"] > 0, paired.describe(em)


@pytest.mark.slow  # the full experiment: ~10 min on 2 cores
def test_the_full_experiment_meets_the_feedback_loop_thresholds(tmp_path):
    """`experiments/feedback_loop.py` as the README runs it: on held-out entities, joint beats
    frozen by >= 20 points of gold recall@5 for both variants with higher EM, closed-book EM is
    near zero, and hot-swap EM on edited facts is >= 80% of that on unedited ones."""
    results = feedback_loop.main(["--out", str(tmp_path), "--no-plot"])
    rows = results["rows"]
    final = {name: row["final"] for name, row in rows.items()}
    assert final["closed_book"]["exact_match"] < 0.1, final["closed_book"]
    for variant in ("sequence", "token"):
        joint, frozen = final[f"joint_{variant}"], final[f"frozen_{variant}"]
        assert joint["gold_recall@5"] >= frozen["gold_recall@5"] + 0.20, (joint, frozen)
        assert joint["exact_match"] >= frozen["exact_match"] + 0.10, (joint, frozen)
    for name in ("joint_sequence", "joint_token", "joint_refresh"):
        swap = rows[name]["hot_swap"]
        assert swap["em_edited"] >= 0.8 * swap["em_unedited"], (name, swap)
    assert results["seconds"] < 20 * 60
