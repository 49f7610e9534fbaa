"""Trainable passage encoder with index refresh; the closed-book baseline; warm-start cache."""

import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rag_jax import rag
from rag_jax.devices import distributed, preemption
from rag_jax.io import bundle
from rag_jax.retrieval import encoder_id, retriever
from rag_jax.run import synthetic, validation
from rag_jax.training import evaluation, experiment, loop, refresh
from rag_jax.training.batcher import Batcher
from tiny_runs import _flat, first_batch, tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[2]


def refresh_config(cache_dir, **overrides):
    return tiny_config(
        **{
            "train.steps": 7,
            "train.save_every": 100,
            "train.freeze": r"^(generator/final_logits_bias)",
            "retrieval.refresh_every": 2,
            "retrieval.refresh_lag": 1,
            "warm_start.steps": 4,
            "warm_start.batch_size": 8,
            "warm_start.cache_dir": str(cache_dir),
            "eval.enabled": False,
            **overrides,
        }
    )


@pytest.mark.slow  # three short training runs: ~60 s on 2 cores
def test_refresh_trains_the_passage_encoder_and_resumes_bitwise(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    config = refresh_config(cache)
    straight = tmp_path / "straight"
    loop.train_and_evaluate(config, straight)
    initial = experiment.build(config, tmp_path / "init").params

    # The same run, stopped before step 4 (a refresh pending: started at 2, serving from 3; and
    # the one of step 4 not yet started), then resumed in a fresh call.
    interrupted = tmp_path / "interrupted"
    monkeypatch.setattr(preemption, "should_stop", lambda step=None: step == 4)
    assert loop.train_and_evaluate(config, interrupted)["steps"] == 4
    monkeypatch.undo()
    assert loop.train_and_evaluate(config, interrupted)["steps"] == 7

    _, a, _ = loop.restore(straight)
    _, b, _ = loop.restore(interrupted)
    flat_a, flat_b = _flat(a.params), _flat(b.params)
    for key in flat_a:
        np.testing.assert_array_equal(flat_a[key], flat_b[key], err_msg=key)
    moved = jax.tree.map(
        lambda x, y: bool(np.any(np.asarray(x) != np.asarray(y))),
        initial["passage_encoder"],
        a.params["passage_encoder"],
    )
    assert any(jax.tree.leaves(moved)), "the passage encoder did not train"
    snapshots = sorted(p.name for p in (straight / "index_refresh").iterdir())
    assert snapshots == ["step_2.msgpack", "step_4.msgpack", "step_6.msgpack"]


def test_a_stopped_refresher_cancels_what_is_queued_and_does_not_wait(tmp_path):
    """A preempted run closes its refresher: a refresh still queued never starts, and the stop
    does not wait for one that is encoding."""
    started, release, builds = threading.Event(), threading.Event(), []

    class Run:  # the experiment as the refresher reads it; its build blocks until released
        retriever = "initial"
        params = {"passage_encoder": {"w": np.zeros(2, np.float32)}}

        def build_retriever(self, passage_params, save=False, mesh=None):
            builds.append(save)
            started.set()
            release.wait(30)
            return "refreshed"

    refresher = refresh.IndexRefresher(Run(), tmp_path, every=2, lag=2)
    refresher.at(2, Run.params)  # a refresh starts encoding
    assert started.wait(30)
    queued = refresher.pool.submit(Run().build_retriever, None)  # a second one behind it
    began = time.perf_counter()
    refresher.close()
    assert time.perf_counter() - began < 5, "close waited for the running refresh"
    assert queued.cancelled() and refresher.pending is None
    release.set()
    refresher.pool.shutdown(wait=True)
    assert builds == [False], builds  # the queued refresh never ran


def test_refresh_config_errors(tmp_path):
    frozen = refresh_config(tmp_path, **{"train.freeze": r"^(passage_encoder/)"})
    with pytest.raises(ValueError, match="refresh_every=2 is for a trainable passage encoder"):
        validation.validate(frozen, 1)
    stale = refresh_config(tmp_path, **{"retrieval.refresh_every": 0})
    with pytest.raises(ValueError, match="index would go stale"):
        validation.validate(stale, 1)


def test_missing_refresh_snapshot_is_named(tmp_path):
    config = refresh_config(tmp_path / "cache")
    exp = experiment.build(config, tmp_path / "w")
    from rag_jax.training import refresh

    refresher = refresh.IndexRefresher(exp, tmp_path / "w", every=2, lag=1)
    with pytest.raises(FileNotFoundError, match="step_2.msgpack is missing"):
        refresher.resume(5)


@pytest.mark.slow  # two compilations of the joint loss with gradients: ~40 s on 2 cores
def test_passage_tokens_path_equals_stored_vectors(tmp_path):
    """With unchanged parameters, re-encoding the retrieved passages in the step gives the same
    loss as the stored vectors, and the gradient reaches the passage encoder."""
    config = refresh_config(tmp_path / "cache", **{"warm_start.method": "none"})
    exp = experiment.build(config, tmp_path / "w")
    batcher = Batcher(exp, loop.device_mesh(config))
    batch = first_batch(batcher, exp)
    flat = dict(batch)
    for key in ("context_input_ids", "context_attention_mask"):
        flat[key] = batch[key].reshape(-1, batch[key].shape[-1])
    stored = {k: v for k, v in flat.items() if not k.startswith("passage_")}
    flat["passage_input_ids"] = batch["passage_input_ids"].reshape(
        -1, batch["passage_input_ids"].shape[-1]
    )
    flat["passage_attention_mask"] = batch["passage_attention_mask"].reshape(
        flat["passage_input_ids"].shape
    )

    def loss(params, b, passage_cfg=None):
        return rag.loss_fn(exp.rag_cfg, params, b, "sequence", None, passage_cfg)[0]

    want = loss(exp.params, stored)
    got, grads = jax.value_and_grad(loss)(exp.params, flat, exp.passage_cfg)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert float(jnp.max(jnp.abs(jax.flatten_util.ravel_pytree(grads["passage_encoder"])[0]))) > 0
    with pytest.raises(ValueError, match="no passage_cfg"):
        loss(exp.params, flat)


def test_closed_book_contexts_hold_only_the_question(tmp_path):
    config = tiny_config(**{"rag.closed_book": True, "rag.n_docs": 1, "warm_start.method": "none"})
    exp = experiment.build(config, tmp_path)
    assert isinstance(exp.retriever, retriever.ClosedBook)
    examples = exp.train[:3]
    pieces = exp.store.tokenize_questions(exp.generator_tokenizer, [e.question for e in examples])
    hits = exp.retriever(np.zeros((3, 4), np.float32), pieces)
    tok = exp.generator_tokenizer
    for row, mask, e in zip(hits.context_input_ids, hits.context_attention_mask, examples):
        assert tok.decode(row[mask == 1], skip_special_tokens=True) == e.question.replace(" ?", "?")
        assert row[0] == tok.cls_token_id and row[mask.sum() - 1] == tok.sep_token_id
    assert (hits.doc_ids == -1).all() and hits.doc_vectors.shape == (3, 1, exp.retriever.dim)
    with pytest.raises(ValueError, match="closed_book needs config.rag.n_docs=1"):
        experiment.build(tiny_config(**{"rag.closed_book": True}), tmp_path / "b")


def test_warm_start_is_cached_and_reused(tmp_path, capsys):
    config = tiny_config(**{"warm_start.steps": 3, "warm_start.batch_size": 8})
    first = experiment.build(config, tmp_path / "a").params
    config.warm_start.cache_dir = str(tmp_path / "a")
    second = experiment.build(config, tmp_path / "b").params
    assert "reusing" in capsys.readouterr().out
    flat_a, flat_b = _flat(first), _flat(second)
    for key in flat_a:
        np.testing.assert_array_equal(flat_a[key], flat_b[key], err_msg=key)
    # Another ICT setting is another ICT entry; the reader warm start's entry is shared by all.
    config.warm_start.steps = 4
    experiment.build(config, tmp_path / "c")
    assert "reader warm start: reusing" in capsys.readouterr().out
    assert len(list((tmp_path / "a" / "warm_start").glob("*.msgpack"))) == 2 + 1


def test_edit_facts_within_a_split():
    world = synthetic.make_world(synthetic.WorldConfig(num_entities=20))
    edited_world, edited = synthetic.edit_facts(world, 0.5, seed=3, split="eval")
    assert edited and all(f.split == "eval" for f in edited)
    assert len(edited) == round(0.5 * sum(f.split == "eval" for f in world.facts))
    texts = {p.id: p.text for p in edited_world.passages}
    for fact in edited:
        assert fact.answer in texts[fact.gold_id].split(" ")
    with pytest.raises(ValueError, match="split must be"):
        synthetic.edit_facts(world, 0.5, seed=3, split="test")


def test_device_index_serves_the_trainer_like_the_exact_index(tmp_path):
    """Same top-k scores; ids equal except where near-equal scores swap (summation order)."""
    config = tiny_config(**{"warm_start.method": "none"})
    hits = {}
    for kind in ("exact", "device"):
        config.retrieval.index = kind
        exp = experiment.build(config, tmp_path / kind)
        batcher = Batcher(exp, loop.device_mesh(config))
        fields, pieces = batcher.questions(exp.train[:8])
        hits[kind] = batcher.retrieve(exp.params, fields, pieces, exp.retriever)
    want, got = hits["exact"], hits["device"]
    np.testing.assert_allclose(got.index_scores, want.index_scores, rtol=1e-5, atol=1e-5)
    rows = (got.doc_ids == want.doc_ids).reshape(-1)  # where equal scores did not swap
    assert rows.mean() > 0.5
    np.testing.assert_array_equal(got.context_input_ids[rows], want.context_input_ids[rows])


# ---------------------------------------------------------------------------------------------
# A restore of a refreshed run: the trained passage encoder's index, never re-encoded


@pytest.fixture(scope="module")
def refreshed_run(tmp_path_factory):
    """A finished tiny run whose passage encoder trained, its index refreshed every 2 steps."""
    workdir = tmp_path_factory.mktemp("refreshed")
    config = refresh_config(
        workdir / "cache",
        **{"train.steps": 5, "eval.enabled": True, "eval.max_examples": 16},
    )
    return workdir, loop.train_and_evaluate(config, workdir)


def test_a_restore_searches_the_trained_passage_encoders_saved_index(refreshed_run, monkeypatch):
    workdir, summary = refreshed_run
    encodes = []
    encode_store = retriever.encode_store
    monkeypatch.setattr(retriever, "encode_store", lambda *a: encodes.append(1) or encode_store(*a))
    exp, state, step = loop.restore(workdir)
    assert step == 5 and encodes == []  # the run's final index was loaded, not encoded again
    trained = encoder_id.encoder_fingerprint(
        exp.passage_cfg, distributed.replicated_to_host(state.params["passage_encoder"])
    )
    initial = encoder_id.encoder_fingerprint(exp.passage_cfg, exp.params["passage_encoder"])
    assert trained != initial  # the passage encoder did train
    assert exp.retriever.index.encoder_fingerprint == trained  # and its vectors are searched
    mesh = loop.device_mesh(exp.config)
    got, _ = evaluation.evaluate(exp, state.params, exp.eval[:16], mesh=mesh, variant="sequence")
    assert got == summary["eval"]  # the trainer's own final evaluation, recall@5 included
    assert got["gold_recall@5"] == summary["recall_at_5_after"]


def test_the_bundle_of_a_refreshed_run_answers_as_its_final_evaluation(refreshed_run):
    """The trainer's bundle holds the index of the passage encoder it trained (not the initial
    one) and answers the held-out questions as the final evaluation did."""
    workdir, _ = refreshed_run
    model = bundle.load(workdir / "bundle")
    config = refresh_config(workdir / "cache")
    initial = experiment.build(config, workdir / "initial", retriever=False).params
    initial_fingerprint = encoder_id.encoder_fingerprint(
        model.encoder.cfg, initial["passage_encoder"]
    )
    assert model.manifest["encoder_fingerprint"] == model.encoder.fingerprint != initial_fingerprint
    assert model.retriever.index.encoder_fingerprint == model.encoder.fingerprint
    lines = (workdir / "predictions.jsonl").read_text().splitlines()
    predictions = [json.loads(line) for line in lines]
    answers = model.answer([p["question"] for p in predictions])
    assert [a.answer for a in answers] == [p["prediction"] for p in predictions]
    assert [[x.id for x in a.passages] for a in answers] == [p["retrieved"] for p in predictions]


@pytest.mark.slow  # a process restoring and evaluating: ~25 s
def test_the_evaluate_script_reports_the_trainers_final_evaluation(refreshed_run):
    workdir, summary = refreshed_run
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "experiments" / "evaluate.py"),
            f"--workdir={workdir}",
            "--max_examples=16",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reported = json.loads(result.stdout.strip().splitlines()[-1])
    assert reported["gold_recall@5"] == summary["recall_at_5_after"]
    assert {k: reported[k] for k in summary["eval"]} == summary["eval"]
