"""experiments/feedback_loop.py end to end on a tiny world: rows, curves, hot-swap, results."""

import json
import pathlib

import feedback_loop
import pytest

import feedback_study
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


def test_joint_training_beats_the_frozen_retriever(tmp_path):
    """Rows 2 and 3 of `--quick` (200 entities, 80 steps): the question encoder trained through the
    answer likelihood alone, no gold ids, lifts held-out gold recall@5 over the frozen retriever.

    The full experiment measures +33 points at 500 steps; here +10 is required of a measured +24
    (0.355 -> 0.595 on 200 held-out questions; +16 with one device's rounding instead of eight's).
    The 60-entity world this test used before gained 5-8 points, and one machine's rounding moved
    it under +10. Kept in the default run (~90 s on 2 cores, over the usual 20 s for a regular
    test) because the feedback loop is the property the project exists for.
    """
    base = feedback_loop.feedback_config.get_config(quick=True)
    recall, em = {}, {}
    for name, overrides in feedback_study.rows(quick=True, refresh_every=0).items():
        if name == "closed_book":
            continue
        config = feedback_study.row_config(base, overrides, str(tmp_path / "cache"))
        summary = loop.train_and_evaluate(config, tmp_path / name)
        recall[name], em[name] = summary["recall_at_5_after"], summary["em_after"]
        assert summary["recall_at_5_before"] == recall.get("frozen_sequence", recall[name])
    assert recall["joint_sequence"] >= recall["frozen_sequence"] + 0.10, recall
    assert em["joint_sequence"] > em["frozen_sequence"], em


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
