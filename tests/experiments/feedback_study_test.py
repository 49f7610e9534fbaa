"""The study's learning-curve plot: rows trained over steps are curves, one-step rows (nothing
trains in them) are levels, closed book is left out (it has no retrieval)."""

import json

import feedback_study


def test_plot_draws_curves_and_levels(tmp_path):
    results = {
        "rows": {
            "closed_book": {"curve": [{"step": 1, "exact_match": 0.01}]},
            "frozen": {"curve": [{"step": 1, "gold_recall@5": 0.769, "exact_match": 0.212}]},
            "joint": {
                "curve": [
                    {"step": 75, "gold_recall@5": 0.778, "exact_match": 0.216},
                    {"step": 150, "gold_recall@5": 0.779},  # recalls only at this step
                    {"step": 300, "gold_recall@5": 0.780, "exact_match": 0.220},
                ]
            },
            "joint_token": {  # EM at the end only: a point, not a level
                "curve": [
                    {"step": 75, "gold_recall@5": 0.778},
                    {"step": 300, "gold_recall@5": 0.776, "exact_match": 0.208},
                ]
            },
        }
    }
    path = tmp_path / "curves.png"
    drawn = feedback_study.plot(results, path)
    assert drawn == {
        "frozen": {"gold_recall@5": "level", "exact_match": "level"},
        "joint": {"gold_recall@5": "curve", "exact_match": "curve"},
        "joint_token": {"gold_recall@5": "curve", "exact_match": "curve"},
    }
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_hot_swap_runs_only_when_asked(tmp_path, monkeypatch):
    """`swap` (real text's) or a synthetic `hot_swap_fraction` runs a row's hot swap after it
    trains; with neither (`squad_study.py --swap_questions 0`) the row has none."""
    from rag_jax.run import settings
    from rag_jax.training import loop

    def fake_run(config, workdir):
        workdir.mkdir(parents=True)
        (workdir / "metrics.jsonl").write_text('{"step": 1, "eval/exact_match": 0.5}\n')
        return {"eval": {"exact_match": 0.5}}

    monkeypatch.setattr(loop, "train_and_evaluate", fake_run)
    base = settings.defaults()
    rows = {"frozen": {"train.retriever_lr_factor": 0.0}}
    swapped = []
    with_swap = feedback_study.run(
        base, tmp_path / "a", rows, swap=lambda w: swapped.append(w) or {"em": 1.0}, make_plot=False
    )
    assert with_swap["rows"]["frozen"]["hot_swap"] == {"em": 1.0}
    assert swapped == [tmp_path / "a" / "frozen"]
    without = feedback_study.run(base, tmp_path / "b", rows, make_plot=False)
    assert "hot_swap" not in without["rows"]["frozen"]
    assert without["rows"]["frozen"]["final"] == {"exact_match": 0.5}


def test_rows_are_kept_across_a_setting_added_at_its_default(tmp_path, monkeypatch):
    """A study resumed after the code gained a setting keeps its rows while the setting is at its
    default; moved from its default, or any setting changed or dropped, refuses the folder and
    names the settings."""

    import pytest

    from rag_jax.run import settings
    from rag_jax.training import loop

    ran = []

    def fake_run(config, workdir):
        ran.append(workdir.name)
        workdir.mkdir(parents=True)
        (workdir / "metrics.jsonl").write_text('{"step": 1, "eval/exact_match": 0.5}\n')
        return {"eval": {"exact_match": 0.5}}

    monkeypatch.setattr(loop, "train_and_evaluate", fake_run)
    rows = {"frozen": {"train.retriever_lr_factor": 0.0}}
    out = tmp_path / "study"
    feedback_study.run(settings.defaults(), out, rows, make_plot=False)
    assert ran == ["frozen"]
    path = out / "results.json"
    written = json.loads(path.read_text())
    del written["config"]["retrieval"]["passage_head_layers"]  # rows from before the setting
    path.write_text(json.dumps(written))

    kept = feedback_study.run(settings.defaults(), out, rows, make_plot=False)
    assert ran == ["frozen"] and kept["rows"]["frozen"]["final"] == {"exact_match": 0.5}

    moved = settings.override(settings.defaults(), {"retrieval.passage_head_layers": 1})
    with pytest.raises(ValueError, match=r"results\.json holds rows .*retrieval\.passage_head_"):
        feedback_study.run(moved, out, rows, make_plot=False)
    other = settings.override(settings.defaults(), {"train.learning_rate": 0.5})
    with pytest.raises(ValueError, match=r"changed default: train\.learning_rate\)"):
        feedback_study.run(other, out, rows, make_plot=False)
    written["config"]["retrieval"]["dropped_setting"] = 3
    path.write_text(json.dumps(written))
    with pytest.raises(ValueError, match=r"retrieval\.dropped_setting"):
        feedback_study.run(settings.defaults(), out, rows, make_plot=False)
    assert ran == ["frozen"]


def test_config_changes_names_each_differing_setting():
    from rag_jax.run import settings

    base = settings.defaults().to_dict()
    assert feedback_study.config_changes(base, base) == []
    changed = json.loads(json.dumps(base))
    changed["seed"] = base["seed"] + 1
    changed["train"]["learning_rate"] = 0.5
    assert feedback_study.config_changes(base, changed) == ["seed", "train.learning_rate"]
