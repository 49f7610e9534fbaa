"""The device index searched inside the train step: same passages, same training, bitwise resume."""

import os
import signal
import threading
import types

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from rag_jax.devices import preemption
from rag_jax.retrieval import retriever
from rag_jax.retrieval.device_index import DeviceIndex
from rag_jax.retrieval.index import ExactIndex
from rag_jax.training import experiment, loop
from rag_jax.training.batcher import Batcher
from tiny_runs import _flat, tiny_config

STEPS = 6


def _config(search_in_step: bool):
    return tiny_config(
        **{
            "train.steps": STEPS,
            "train.save_every": 1000,
            "retrieval.index": "device",
            "retrieval.search_in_step": search_in_step,
            "eval.enabled": False,
        }
    )


def _run(config, workdir, monkeypatch):
    """Trains; returns the final state and the passages every batch was built from."""
    gathered = []
    original = retriever.Retriever.gather

    def record(self, doc_ids, *args, **kwargs):
        gathered.append(np.asarray(doc_ids))
        return original(self, doc_ids, *args, **kwargs)

    monkeypatch.setattr(retriever.Retriever, "gather", record)
    loop.train_and_evaluate(config, workdir)
    monkeypatch.setattr(retriever.Retriever, "gather", original)
    _, state, step = loop.restore(workdir)
    assert step == STEPS
    return state, gathered


@pytest.fixture(scope="module")
def between_steps(tmp_path_factory):
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _run(_config(False), tmp_path_factory.mktemp("between"), monkeypatch)


class _Store:
    """What a `Retriever` reads of a store when nothing is gathered."""

    checksum, directory = "corpus", "store"

    def __len__(self):
        return 20


def test_the_step_searches_only_a_fixed_device_index_on_its_own_devices():
    devices = jax.devices()
    vectors = np.random.default_rng(0).normal(size=(20, 4)).astype(np.float32)
    mesh = Mesh(np.array(devices), ("data",))
    index = DeviceIndex(vectors, mesh, corpus_checksum="corpus")

    def over(index, in_step):
        return retriever.Retriever(
            index, _Store(), vectors, n_docs=5, max_combined_length=8, search_in_step=in_step
        )

    assert over(index, True).searches_in_step(mesh)
    assert not over(index, False).searches_in_step(mesh)
    exact = ExactIndex(vectors, corpus_checksum="corpus")
    assert not over(exact, True).searches_in_step(mesh)  # a host index is searched on the host
    if len(devices) > 1:  # the index on other devices than the step's: searched between steps
        assert not over(index, True).searches_in_step(Mesh(np.array(devices[:1]), ("data",)))
    assert not retriever.ClosedBook.searches_in_step(None, mesh)
    # The configs whose experiment builds an in-step retriever (and whose state carries ids).
    in_step = lambda config, mesh=mesh: experiment.Experiment.searches_in_step(  # noqa: E731
        types.SimpleNamespace(config=config), mesh
    )
    assert in_step(_config(True)) and not in_step(_config(False))
    assert not in_step(tiny_config(**{"retrieval.index": "exact"}))
    refreshed = tiny_config(**{"retrieval.index": "device", "retrieval.refresh_every": 10})
    assert not in_step(refreshed)  # its vectors change under the step
    closed_book = _config(True)
    closed_book.rag.closed_book, closed_book.rag.n_docs = True, 1
    assert not in_step(closed_book)
    if len(devices) > 1:
        assert not in_step(_config(True), Mesh(np.array(devices[:1]), ("data",)))


@pytest.mark.slow  # two trainer runs: ~45 s
def test_the_in_step_search_finds_the_same_passages_and_trains_the_same(
    tmp_path, between_steps, monkeypatch
):
    state, gathered = _run(_config(True), tmp_path, monkeypatch)
    want_state, want_ids = between_steps
    assert want_state.next_doc_ids is None and state.next_doc_ids.shape == (8, 5)
    assert len(gathered) == len(want_ids) == STEPS
    for step, (got, want) in enumerate(zip(gathered, want_ids)):
        np.testing.assert_array_equal(got, want, err_msg=f"passages of batch {step}")
    got, want = _flat(state.params), _flat(want_state.params)
    moved = 0
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=1e-6, rtol=0, err_msg=key)
    initial = _flat(loop.restore(tmp_path)[0].params)
    moved = sum(not np.allclose(initial[k], want[k], atol=1e-4) for k in want)
    assert moved > 10  # the comparison is not between untrained parameters


@pytest.mark.slow  # three more trainer runs: ~40 s
def test_preempted_in_step_search_resumes_bitwise(tmp_path, monkeypatch):
    config = _config(True)
    loop.train_and_evaluate(config, tmp_path / "straight")
    _, straight, _ = loop.restore(tmp_path / "straight")

    monkeypatch.setattr(preemption, "_STOP_REQUESTED", threading.Event())
    previous = signal.getsignal(signal.SIGTERM)
    original = Batcher.train_batch
    stop_at = 3

    def sigterm_at(self, params, step, *args):
        if step == stop_at:
            os.kill(os.getpid(), signal.SIGTERM)  # through the trainer's real handler
        return original(self, params, step, *args)

    monkeypatch.setattr(Batcher, "train_batch", sigterm_at)
    try:
        assert loop.train_and_evaluate(config, tmp_path / "resumed")["steps"] == stop_at + 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    monkeypatch.setattr(Batcher, "train_batch", original)
    preemption._STOP_REQUESTED.clear()
    assert loop.train_and_evaluate(config, tmp_path / "resumed")["steps"] == STEPS
    _, resumed, _ = loop.restore(tmp_path / "resumed")
    for name in ("params", "opt_state", "next_doc_ids"):
        got, want = _flat(getattr(resumed, name)), _flat(getattr(straight, name))
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{name} {key}")
    assert jax.tree.leaves(resumed.next_doc_ids)  # the saved passages of the next batch
