"""A server turns ready before its programs are all compiled: a real uvicorn server (in this
process, so a test can hold its background compile) over the tiny run's bundle. Ready once the
first (bucket, width) shape is compiled, it answers batches of every size at once, as a fully
compiled bundle answers them, without compiling on the serving path; once the background compile
is done, traffic of every size traces nothing more."""

import concurrent.futures
import json
import shutil
import threading

import httpx
import pytest
from hostile_server_test import InProcess

from rag_jax.io import answers, bundle
from rag_jax.serving import app as serving

# The tiny run and six shapes compiled, twice over (~1-3 min on 2 cores): run with -m slow.
pytestmark = pytest.mark.slow

MAX_BATCH = 4


class CompileGate:
    """Wraps the served bundle's `compile`: the first call (the warm-up's first shape) runs,
    later ones (the background compile) wait until `open` is set; records each call's shapes."""

    def __init__(self, model):
        self.model, self.inner = model, model.compile
        self.calls, self.open = [], threading.Event()

    def __call__(self, *args, shapes=None, **kwargs):
        self.calls.append(list(shapes))
        if len(self.calls) > 1:
            self.open.wait(600)
        return self.inner(*args, shapes=shapes, **kwargs)

    def __enter__(self):
        self.model.compile = self
        return self

    def __exit__(self, *exc):
        self.open.set()


def _ask(url, questions: list[str]) -> list[dict]:
    response = httpx.post(f"{url}/v1/answer", json={"questions": questions}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["answers"]


def _traffic(url, questions) -> list[tuple[list[str], list[dict]]]:
    """Requests of 1 to MAX_BATCH questions, one after another, then 12 at once (merged into
    calls of every size): [(questions, answers)]."""
    asks = [questions[:n] for n in range(1, MAX_BATCH + 1)]
    out = [(qs, _ask(url, qs)) for qs in asks]
    asks = asks + [[q] for q in questions]
    with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:
        out += zip(asks, pool.map(lambda qs: _ask(url, qs), asks), strict=True)
    return out


def _same(got: dict, want: answers.Answer) -> None:
    """An HTTP answer equals `Bundle.answer`'s: text, passages and tokens exactly, numbers to
    1e-4 (a batch padded to another bucket or width rounds differently)."""
    w = want.to_dict()
    assert (got["question"], got["answer"], got["truncated"]) == (
        w["question"],
        w["answer"],
        w["truncated"],
    )
    assert [p["id"] for p in got["passages"]] == [p["id"] for p in w["passages"]]
    assert got["log_likelihood"] == pytest.approx(w["log_likelihood"], abs=1e-4)
    for g, x in zip(got["passages"], w["passages"], strict=True):
        assert g["text"] == x["text"]
        assert (g["prior"], g["posterior"]) == pytest.approx((x["prior"], x["posterior"]), abs=1e-4)


def test_ready_before_every_shape_is_compiled_answers_right_and_never_compiles_when_done(
    tiny_trained_run, tmp_path
):
    workdir = tiny_trained_run[0]
    directory = tmp_path / "bundle"
    shutil.copytree(workdir / "bundle", directory)
    lines = (workdir / "predictions.jsonl").read_text().splitlines()
    questions = [json.loads(line)["question"] for line in lines[: MAX_BATCH + 4]]
    model = bundle.load(directory)
    plan = model.compile_plan(MAX_BATCH)
    assert plan[0] == (MAX_BATCH, max(w for _, w in plan)) and len(plan) > 2
    config = serving.ServerConfig(str(directory), max_batch=MAX_BATCH, max_wait_ms=20.0)
    with CompileGate(model) as gate:
        server = InProcess(model, config)
        try:
            server.wait_ready(compiled=False)
            url, state = server.url, server.state
            # Ready with the first shape alone; the rest waits for the gate.
            health = httpx.get(f"{url}/healthz").json()
            assert health["ready"] is True and health["compiled"] is False
            (programs,) = httpx.get(f"{url}/v1/info").json()["programs"]
            assert programs["ready"] == [list(plan[0])]
            assert programs["pending"] == [list(s) for s in plan[1:]]
            assert gate.calls[0] == plan[:1]
            traces = model.traces
            # Every batch size is answered now, padded up to the compiled shape: nothing traces.
            early = _traffic(url, questions)
            assert model.traces == traces
            assert state.batcher.waiting() == (0, 0)
            gate.open.set()
            server.wait_ready(compiled=True)
            assert httpx.get(f"{url}/healthz").json()["compiled"] is True
            (programs,) = httpx.get(f"{url}/v1/info").json()["programs"]
            assert programs["pending"] == [] and sorted(map(tuple, programs["ready"])) == sorted(
                plan
            )
            assert [c for c in gate.calls[1:]] == [[s] for s in plan[1:]]  # one shape per task
            compiled = model.traces
            assert compiled > traces and state.compiled_traces == compiled
            # Steady traffic of every size, once all is compiled: nothing traces.
            late = _traffic(url, questions)
            assert model.traces == compiled
        finally:
            server.stop()
    # The answers are those of a bundle that compiled every shape before answering.
    reference = bundle.load(directory)
    reference.compile(MAX_BATCH)
    for asked, got in early + late:
        for g, w in zip(got, reference.answer(asked), strict=True):
            _same(g, w)
    assert len(early) == len(late) == 2 * MAX_BATCH + len(questions)
