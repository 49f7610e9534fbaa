"""The joint trainer end to end on tiny configs: learning, freezing, resume, devices, data paths."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from rag_jax.devices import device_memory
from rag_jax.run import checkpoints
from rag_jax.training import experiment, loop
from tiny_runs import _flat, tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _final_params(workdir):
    _, state, step = loop.restore(workdir)
    return step, state.params


@pytest.fixture(scope="module")
def fifty_steps(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("fifty")
    config = tiny_config(
        **{
            "train.steps": 50,
            "train.log_every": 10,
            "train.save_every": 50,
            "eval.every": 25,  # a learning-curve point at step 25: its recalls only
            "eval.every_answers": False,
        }
    )
    exp = experiment.build(config, workdir)
    summary = loop.train_and_evaluate(config, workdir)
    return workdir, exp.params, summary


def test_loss_falls_and_only_trainable_params_move(fifty_steps):
    workdir, initial, summary = fifty_steps
    assert summary["steps"] == 50
    logs = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in logs if "train/loss" in r]
    assert len(losses) == 5 and losses[-1] < 0.8 * losses[0], losses
    _, final = _final_params(workdir)
    before, after = _flat(initial), _flat(final)
    moved = {k for k in before if not np.array_equal(before[k], after[k])}
    assert all(
        any(k.startswith(f"['{half}']") for k in moved)
        for half in ("question_encoder", "generator")
    )
    frozen = [k for k in before if k.startswith("['passage_encoder']")]
    assert frozen and not moved & set(frozen)  # the frozen tower is bitwise unchanged
    assert "['generator']['final_logits_bias']" not in moved


def test_summary_line_and_outputs(fifty_steps):
    workdir, _, summary = fifty_steps
    for key in ("recall_at_5_before", "recall_at_5_after", "em_before", "em_after"):
        assert isinstance(summary[key], float) and 0.0 <= summary[key] <= 1.0
    predictions = (workdir / "predictions.jsonl").read_text().splitlines()
    assert len(predictions) == 8  # eval.max_examples, the last partial batch included
    # Every held-out question's own metrics (what run.paired compares), averaging to the run's.
    records = [
        json.loads(line) for line in (workdir / "per_question.jsonl").read_text().splitlines()
    ]
    assert [r["id"] for r in records] == [json.loads(p)["id"] for p in predictions]
    for key in ("exact_match", "f1", "gold_recall@1", "gold_recall@5", "answer_recall@5"):
        assert np.mean([r[key] for r in records]) == pytest.approx(summary["eval"][key]), key
    evals = {
        r["step"]: r
        for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())
        if any(k.startswith("eval/") for k in r)
    }
    assert sorted(evals) == [0, 25, 50]
    assert "eval/gold_recall@5" in evals[25] and "eval/exact_match" not in evals[25]
    assert {"eval/gold_recall@5", "eval/exact_match"} <= set(evals[50])
    assert (workdir / "tensorboard").is_dir()


def test_evaluations_without_answers_report_recalls_only(tmp_path):
    """`eval.answers=False`: the evaluations before and after training retrieve for every
    question and answer none (what choosing settings by gold recall on a slice reads)."""
    config = tiny_config(**{"train.steps": 2, "train.save_every": 2, "eval.answers": False})
    summary = loop.train_and_evaluate(config, tmp_path)
    before = json.loads((tmp_path / "eval_before.json").read_text())
    for metrics in (before, summary["eval"]):
        assert "gold_recall@5" in metrics and "exact_match" not in metrics and "f1" not in metrics
    assert np.isnan(summary["em_after"]) and 0.0 <= summary["recall_at_5_after"] <= 1.0
    records = [json.loads(r) for r in (tmp_path / "per_question.jsonl").read_text().splitlines()]
    assert len(records) == 8 and all("exact_match" not in r for r in records)
    assert all({"gold_recall@1", "gold_recall@5"} <= set(r) for r in records)


def _run_script(workdir, extra, env=None):
    cmd = [
        sys.executable,
        str(ROOT / "experiments" / "train.py"),
        f"--config={ROOT / 'experiments' / 'configs' / 'default.py'}",
        f"--workdir={workdir}",
        "--config.data.num_entities=12",
        "--config.train.batch_size=8",
        "--config.train.warmup_steps=2",
        "--config.eval.batch_size=8",
        "--config.eval.max_examples=8",
        "--config.eval.max_length=6",
        "--config.rag.n_docs=5",
        "--config.rag.max_combined_length=32",
        "--config.retrieval.passage_max_length=32",
        *extra,
    ]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env or os.environ
    )


def test_a_step_too_large_for_the_device_fails_before_it_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(device_memory, "device_memory_limit", lambda device=None: 2**20)  # 1 MiB
    config = tiny_config(**{"eval.enabled": False})
    with pytest.raises(ValueError, match=r"needs .* per device but the device has 1.00 MiB"):
        loop.train_and_evaluate(config, tmp_path)
    out = capsys.readouterr().out
    assert "train step memory per device, from XLA" in out and "temporaries" in out, out
    with checkpoints.Checkpointer(tmp_path, read_only=True) as ckpt:
        assert ckpt.latest_step() is None  # nothing ran, nothing was saved


@pytest.mark.slow
def test_sigterm_resume_is_bitwise_identical(tmp_path):
    steps = [
        "--config.train.steps=40",
        "--config.train.save_every=1000",
        "--config.train.log_every=5",
    ]
    straight = _run_script(tmp_path / "straight", steps)
    assert straight.wait(timeout=600) == 0, straight.stdout.read()

    interrupted = _run_script(tmp_path / "resumed", steps)
    deadline = time.time() + 600
    for line in interrupted.stdout:  # tqdm's "\r" updates arrive as lines (universal newlines)
        progress = re.search(r"(\d+)/40", line)
        if (progress and int(progress.group(1)) >= 10) or time.time() > deadline:
            break
    time.sleep(2.0)
    interrupted.send_signal(signal.SIGTERM)
    out = interrupted.communicate(timeout=600)[0]
    assert interrupted.returncode == 0, out
    assert "preempted: saved step" in out, out
    resumed = _run_script(tmp_path / "resumed", steps)
    assert resumed.wait(timeout=600) == 0, resumed.stdout.read()

    step_a, a = _final_params(tmp_path / "straight")
    step_b, b = _final_params(tmp_path / "resumed")
    assert step_a == step_b == 40
    fa, fb = _flat(a), _flat(b)
    for k in fa:
        np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)


@pytest.mark.slow  # ~77 s; the step's math on 8 devices: rag_multidevice_test
def test_eight_devices_equal_one(tmp_path):
    """The same run on a 1-device and an 8-device mesh ends with the same parameters.

    SGD, because Adam's first steps divide each gradient by its own magnitude: a gradient entry
    near zero whose last bits differ between reduction orders flips its update's sign, which says
    nothing about the data parallelism under test.
    """
    results = {}
    for devices in (1, 8):
        config = tiny_config(
            **{
                "train.steps": 3,
                "train.save_every": 3,
                "train.num_devices": devices,
                "train.optimizer": "sgd",
                "train.learning_rate": 0.1,
                "eval.enabled": False,
                "train.bundle": devices == 8,
            }
        )
        loop.train_and_evaluate(config, tmp_path / str(devices))
        results[devices] = _flat(_final_params(tmp_path / str(devices))[1])
    # train.bundle: the trainer writes <workdir>/bundle, or (False) nothing.
    assert (tmp_path / "8" / "bundle" / "manifest.json").is_file()
    assert not (tmp_path / "1" / "bundle").exists()
    moved = 0
    for k in results[1]:
        np.testing.assert_allclose(results[1][k], results[8][k], atol=1e-5, rtol=0, err_msg=k)
    initial = _flat(experiment.build(tiny_config(), tmp_path / "init").params)
    moved = sum(not np.allclose(initial[k], results[1][k], atol=1e-4) for k in initial)
    assert moved > 10  # the steps changed the parameters by far more than the tolerance


@pytest.mark.slow  # ~50 s
def test_fsdp_trains_to_the_replicated_parameters(tmp_path):
    """Parameters and optimizer state split over 8 devices (`train.param_sharding="fsdp"`) end
    at the parameters of the replicated run, and the checkpoint restores into either layout.

    SGD with momentum (optimizer state to split), for the reason `test_eight_devices_equal_one`
    gives: a reduce-scatter sums in another order than an all-reduce.
    """
    results, runs = {}, {}
    for layout in ("replicated", "fsdp"):
        runs[layout] = tiny_config(
            **{
                "train.steps": 3,
                "train.save_every": 3,
                "train.optimizer": "sgd",
                "train.learning_rate": 0.1,
                "train.param_sharding": layout,
                # Warm-started as the default job: from a random retriever, near-tied passages
                # swap places under rounding and the runs part by 1e-4 whatever the layout.
                "warm_start.cache_dir": str(tmp_path / "warm_starts"),  # built once, for both
                "eval.enabled": False,
            }
        )
        loop.train_and_evaluate(runs[layout], tmp_path / layout)
        _, state, step = loop.restore(tmp_path / layout)
        assert step == 3
        results[layout] = state
    # Every array with a dimension that 8 divides is split (the rest, e.g. a [V] bias of an odd
    # vocabulary, stays whole), and the split ones are most of the bytes.
    leaves = jax.tree.leaves((results["fsdp"].params, results["fsdp"].opt_state))
    for leaf in leaves:
        divisible = any(d % 8 == 0 for d in leaf.shape)
        assert ("data" in leaf.sharding.spec) == divisible, (leaf.shape, leaf.sharding.spec)
    whole = sum(leaf.nbytes for leaf in leaves)
    assert device_memory.per_device_bytes(leaves) < 0.2 * whole
    assert all(leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(results["replicated"]))
    replicated, fsdp = _flat(results["replicated"].params), _flat(results["fsdp"].params)
    # The momentum is the sum of the steps' gradients: far from zero, the parameters moved.
    momentum = _flat(results["fsdp"].opt_state)
    assert sum(np.abs(v).max() > 1e-3 for v in momentum.values()) > 10
    for k in replicated:
        np.testing.assert_allclose(fsdp[k], replicated[k], atol=1e-5, rtol=0, err_msg=k)
    # The fsdp run's checkpoint, restored into the replicated layout: the same values.
    _, state, _ = loop.restore(tmp_path / "fsdp", runs["replicated"])
    assert all(leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(state.params))
    for k, v in _flat(state.params).items():
        np.testing.assert_array_equal(v, fsdp[k], err_msg=k)


@pytest.mark.slow
def test_jsonl_data_path(tmp_path, shared_data):
    """A few steps on real QA files: SQuAD questions over their own passages."""
    questions = [
        json.loads(line) for line in open(shared_data / "squad11_dev" / "questions.jsonl")
    ][:40]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions[:32]))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions[32:]))
    gold = {q["gold_passage_id"] for q in questions}
    passages = [json.loads(line) for line in open(shared_data / "squad11_dev" / "passages.jsonl")]
    corpus = [p for p in passages if p["id"] in gold] + passages[:20]
    corpus = list({p["id"]: p for p in corpus}.values())
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(p) + "\n" for p in corpus))
    from hf_fixtures import minilm_path

    config = tiny_config(
        **{
            "data.source": "files",
            "model.init": "pretrained",
            "model.question_encoder_path": str(minilm_path()),
            "warm_start.method": "none",  # the pretrained towers are the retriever under test
            "train.steps": 2,
            "rag.max_combined_length": 64,
            "retrieval.passage_max_length": 64,
            "data.answer_length": 12,
            "data.question_length": 32,
        }
    )
    config.data.train_path = str(tmp_path / "train.jsonl")
    config.data.eval_path = str(tmp_path / "eval.jsonl")
    config.data.corpus_path = str(tmp_path / "corpus.jsonl")
    config.data.fields = {"gold_ids": "gold_passage_id"}
    config.model.generator.max_position_embeddings = 128
    summary = loop.train_and_evaluate(config, tmp_path / "work")
    assert summary["steps"] == 2
    assert summary["recall_at_5_before"] > 0.2  # real MiniLM retrieves real gold passages


def test_config_errors_name_the_value(tmp_path):
    with pytest.raises(ValueError, match=r"global batch 6 is not divisible by 8"):
        loop.train_and_evaluate(tiny_config(**{"train.batch_size": 6}), tmp_path / "a")
    with pytest.raises(ValueError, match=r"config.train.num_devices=9 but 8"):
        loop.train_and_evaluate(tiny_config(**{"train.num_devices": 9}), tmp_path / "a")
    with pytest.raises(ValueError, match=r"config.rag.variant"):
        loop.train_and_evaluate(tiny_config(**{"rag.variant": "both"}), tmp_path / "a")
    with pytest.raises(ValueError, match=r"n_docs=999 exceeds the corpus size"):
        experiment.build(tiny_config(**{"rag.n_docs": 999}), tmp_path / "b")
    with pytest.raises(ValueError, match=r"config.data.source"):
        experiment.build(tiny_config(**{"data.source": "web"}), tmp_path / "c")


@pytest.mark.slow
def test_tfds_data_path(tmp_path):
    """A few steps with QA data read through `tfds.data_source` (array_record, no TensorFlow).

    A local `natural_questions_open` builder (the real one with its download replaced) holds the
    synthetic world's questions; its passages are the corpus file and its word-level tokenizer is
    saved as a checkpoint tokenizer, so the test needs nothing outside the repository.
    """
    from etils import epath
    from tensorflow_datasets.datasets.natural_questions_open import (
        natural_questions_open_dataset_builder as nq,
    )

    from rag_jax.run import synthetic

    config = tiny_config(**{"train.steps": 3, "warm_start.method": "none"})
    world = synthetic.make_world(
        synthetic.WorldConfig(
            seed=config.seed,
            num_entities=config.data.num_entities,
            distractors_per_fact=config.data.distractors_per_fact,
            eval_fraction=config.data.eval_fraction,
        )
    )
    splits = {
        tfds_split: [
            {"question": q["question"], "answer": q["answers"]} for q in world.questions(s)
        ]
        for tfds_split, s in (("train", "train"), ("validation", "eval"))
    }

    class LocalNaturalQuestionsOpen(nq.Builder, skip_registration=True):
        name = "natural_questions_open"
        pkg_dir_path = epath.Path(nq.__file__).parent  # the real builder's metadata

        def _split_generators(self, dl_manager):
            return {split: enumerate(records) for split, records in splits.items()}

    tfds_dir = tmp_path / "tfds"
    LocalNaturalQuestionsOpen(
        data_dir=str(tfds_dir), file_format="array_record"
    ).download_and_prepare()
    assert list(tfds_dir.glob("natural_questions_open/*/*-train.array_record-*"))

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(
            json.dumps({"id": p.id, "title": p.title, "text": p.text}) + "\n"
            for p in world.passages
        )
    )
    synthetic.tokenizer(world).save_pretrained(tmp_path / "tokenizer")
    config.data.source = "tfds"
    config.data.tfds_name = "natural_questions_open"
    config.data.train_split = "train"
    config.data.eval_split = "validation"
    config.data.tfds_data_dir = str(tfds_dir)
    config.data.corpus_path = str(corpus)
    config.model.question_encoder_path = str(tmp_path / "tokenizer")  # random init: tokenizer only

    exp = experiment.build(config, tmp_path / "build")
    for examples, records in ((exp.train, splits["train"]), (exp.eval, splits["validation"])):
        got = sorted((e.question, e.answers) for e in examples)
        assert got == sorted((r["question"], tuple(r["answer"])) for r in records)
    assert exp.train[0].id.startswith("natural_questions_open/train/")
    summary = loop.train_and_evaluate(config, tmp_path / "work")
    assert summary["steps"] == 3
    logs = [
        json.loads(line) for line in (tmp_path / "work" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in logs if "train/loss" in r] == [3]
    assert all(np.isfinite(r["train/loss"]) for r in logs if "train/loss" in r)
    # Training moved the trainable towers away from the built experiment's initial parameters.
    _, final = _final_params(tmp_path / "work")
    before, after = _flat(exp.params), _flat(final)
    assert any(
        not np.array_equal(before[k], after[k]) for k in before if k.startswith("['generator']")
    )


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory):
    """One warm start for the tests that differ only after it."""
    return str(tmp_path_factory.mktemp("warm_start"))


@pytest.mark.slow  # two tiny runs with their warm start: ~40-90 s on 2 cores
@pytest.mark.parametrize(
    "overrides",
    [
        {"train.retriever_loss": "pdist", "train.retriever_candidates": 8},
        {"train.retriever_loss": "gold"},
        {
            "train.retriever_loss": "pdist",
            "train.retriever_candidates": 6,
            "train.retriever_random_negatives": 3,
        },
    ],
    ids=["pdist_k8", "gold", "pdist_k6_r3"],
)
def test_the_retrievers_own_objective_trains_through_the_loop(tmp_path, overrides, warm_cache):
    """K = 8 candidates for 5 read (pdist), or the gold passages (gold), or K = 6 and 3 random
    negatives (their batches 9 wide where the compile expects it): the step's retriever loss is
    logged and the question encoder moves while the passage encoder does not."""
    config = tiny_config(
        **{"train.steps": 4, "train.log_every": 2, "warm_start.cache_dir": warm_cache, **overrides}
    )
    exp = experiment.build(config, tmp_path)
    loop.train_and_evaluate(config, tmp_path)
    logs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/retriever_loss"] for r in logs if "train/retriever_loss" in r]
    assert len(losses) == 2 and all(np.isfinite(losses)) and losses[0] > 0
    _, final = _final_params(tmp_path)
    before, after = _flat(exp.params), _flat(final)
    moved = {k for k in before if not np.array_equal(before[k], after[k])}
    assert any(k.startswith("['question_encoder']") for k in moved)
    assert not any(k.startswith("['passage_encoder']") for k in moved)
