"""What a server reports and keeps, over a small fake bundle (no model, nothing compiled, so
fast): a model whose outputs are not finite never turns ready and says which number; a
non-finite answer is a 500 naming its field; a cold setting compiles its first shape alone, its
other shapes only once it has traffic, and is evicted after `cold_idle_s` without a request
(time faked), freeing its slot and its programs."""

import logging
import math
import threading
import time
import types

import httpx
import pytest
from hostile_server_test import InProcess

from rag_jax.io import answers
from rag_jax.serving import app as serving
from rag_jax.serving import batching, state
from rag_jax.serving.api import ApiError

PLAN = [(4, 32), (4, 16), (1, 32), (1, 16), (2, 32), (2, 16)]  # the fake's (bucket, width)s
COLD = batching.Setting("sequence", 2, 3)
OTHER = batching.Setting("sequence", 1, 2)


class FakeBundle:
    """A bundle's serving surface: `compile` records its shapes, `generate` answers each
    question with `log_likelihood` and two passages whose posteriors are `posteriors`."""

    def __init__(self, log_likelihood=-1.5, posteriors=(0.75, 0.25)):
        self.log_likelihood, self.posteriors = log_likelihood, posteriors
        self.settings = types.SimpleNamespace(
            variant="token", sequence_decoding="thorough", question_length=24
        )
        self.rag_cfg = types.SimpleNamespace(
            n_docs=3, generation=types.SimpleNamespace(num_beams=1)
        )
        self.store = ["p0", "p1", "p2", "p3"]
        self.directory, self.step, self.traces = None, 7, 0
        self.compiled: list[tuple[answers.AnswerSetting, tuple]] = []  # (setting, shape)
        self.forgotten: list[answers.AnswerSetting] = []
        self._ready: dict[answers.AnswerSetting, set] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(variant, num_beams, n_docs):
        return answers.AnswerSetting(variant, num_beams, n_docs, "thorough")

    def compile_plan(self, max_batch):
        return list(PLAN)

    def compile(self, max_batch, *, variant, num_beams, n_docs, shapes):
        key = self._key(variant, num_beams, n_docs)
        with self._lock:
            for shape in shapes:
                self.compiled.append((key, shape))
                self._ready.setdefault(key, set()).add(shape)
                self.traces += 1

    def ready_shapes(self):
        with self._lock:
            return {k: tuple(sorted(v)) for k, v in self._ready.items()}

    def forget(self, key):
        with self._lock:
            self.forgotten.append(key)
            self._ready.pop(key, None)

    def check_questions(self, questions):
        pass  # each holds a word

    def prepare(self, questions, *, variant, num_beams, n_docs, compiled_only):
        return [(q, variant) for q in questions]

    def generate(self, prepared, *, compiled_only):
        passages = tuple(
            answers.RetrievedPassage(f"p{i}", "", "text", 1.0, 0.5, post)
            for i, post in enumerate(self.posteriors)
        )
        return [
            answers.Answer(q, "violet", self.log_likelihood, False, variant, passages, None)
            for q, variant in prepared
        ]


def _health(server, until, timeout=20.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    health = None
    while time.monotonic() < deadline:
        try:
            health = httpx.get(f"{server.url}/healthz", timeout=2)
        except httpx.TransportError:  # not listening yet
            continue
        if until(health):
            return health
        time.sleep(0.05)
    raise TimeoutError(health and health.text)


@pytest.mark.parametrize("log_likelihood", [math.inf, math.nan, -math.inf])
def test_a_model_with_non_finite_outputs_stays_unready_naming_the_field(log_likelihood, caplog):
    model = FakeBundle(log_likelihood=log_likelihood)
    server = InProcess(model, serving.ServerConfig("unused", max_batch=4))
    try:
        with caplog.at_level(logging.ERROR, logger="rag_jax.serving"):
            health = _health(server, lambda h: "not finite" in h.json().get("reason", ""))
        assert health.status_code == 503 and health.json()["ready"] is False
        assert "answer.log_likelihood is not finite" in health.json()["reason"]
        assert any("answer.log_likelihood is not finite" in r.message for r in caplog.records)
        # Compiled, yet unready: its answers are refused, not attempted.
        response = httpx.post(f"{server.url}/v1/answer", json={"questions": ["why ?"]})
        assert response.status_code == 503
    finally:
        server.stop()


def test_a_non_finite_answer_is_a_500_naming_the_field():
    model = FakeBundle()
    server = InProcess(model, serving.ServerConfig("unused", max_batch=4))
    try:
        assert _health(server, lambda h: h.status_code == 200).json()["ready"] is True
        asked = {"questions": ["why ?", "where ?"]}
        response = httpx.post(f"{server.url}/v1/answer", json=asked)
        assert response.status_code == 200 and response.json()["answers"][1]["answer"] == "violet"
        model.posteriors = (0.75, math.nan)  # e.g. an overflow on some questions only
        response = httpx.post(f"{server.url}/v1/answer", json=asked)
        assert response.status_code == 500
        message = response.json()["error"]["message"]
        assert message == "answers[0].passages[1].posterior is not finite"
        # The server keeps answering, and stays ready.
        model.posteriors = (0.75, 0.25)
        assert httpx.post(f"{server.url}/v1/answer", json=asked).status_code == 200
        assert httpx.get(f"{server.url}/healthz").status_code == 200
    finally:
        server.stop()


def test_nonfinite_field_names_the_first_non_finite_number_or_none():
    model = FakeBundle()
    (finite,) = model.generate([("q", "token")], compiled_only=True)
    assert state.nonfinite_field(finite, "answers[3]") is None
    token = answers.TokenSource("violet", 5, (0.5, math.inf))
    bad = answers.Answer("q", "violet", -1.0, False, "token", finite.passages, (token,))
    assert state.nonfinite_field(bad, "answers[3]") == "answers[3].tokens[0].posteriors[1]"


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _drain(server_state) -> None:
    """Until the compile thread has nothing queued (a setting's shapes queue one another)."""
    for _ in range(50):
        server_state.compiler.submit(lambda: None).result(300)
        if not server_state.filling and not server_state.compiling:
            server_state.compiler.submit(lambda: None).result(300)
            return
    raise TimeoutError(f"still filling {server_state.filling}")


def _asked(server_state, setting) -> int:
    """`check_warm`'s status for `setting`: 200 when it is served."""
    try:
        server_state.check_warm(setting)
    except ApiError as e:
        return e.status
    return 200


@pytest.fixture
def cold_state():
    model = FakeBundle()
    config = serving.ServerConfig(
        "unused", max_batch=4, max_cold_settings=1, cold_idle_s=60.0, cold_fill_after=3
    )
    server_state = state.ServerState(model, config)
    server_state.clock = Clock()
    server_state.warm_up()
    _drain(server_state)
    assert server_state.ready.is_set() and server_state.compiled_traces == len(PLAN)
    yield model, server_state
    server_state.compiler.shutdown(wait=True)


def _shapes(model, setting) -> list:
    key = model._key(setting.variant, setting.num_beams, setting.n_docs)
    return [shape for k, shape in model.compiled if k == key]


def test_a_cold_setting_compiles_its_other_shapes_only_once_it_has_traffic(cold_state):
    model, server_state = cold_state
    assert _asked(server_state, COLD) == 503  # its first request: the first shape compiles
    _drain(server_state)
    assert _shapes(model, COLD) == PLAN[:1]
    assert [_asked(server_state, COLD) for _ in range(2)] == [200, 200]
    _drain(server_state)
    assert _shapes(model, COLD) == PLAN[:1]  # two requests served: nothing more compiled
    assert _asked(server_state, COLD) == 200  # the third: its other shapes follow
    _drain(server_state)
    assert _shapes(model, COLD) == PLAN
    assert [_asked(server_state, COLD) for _ in range(5)] == [200] * 5
    _drain(server_state)
    assert _shapes(model, COLD) == PLAN  # each shape once


def test_an_idle_cold_setting_is_evicted_freeing_its_slot_and_programs(cold_state):
    model, server_state = cold_state
    clock = server_state.clock
    assert _asked(server_state, COLD) == 503
    _drain(server_state)
    assert _asked(server_state, COLD) == 200
    assert _asked(server_state, OTHER) == 422  # the one cold slot is taken
    clock.now += 59.0  # traffic within cold_idle_s keeps it
    assert _asked(server_state, COLD) == 200
    clock.now += 59.0
    assert _asked(server_state, OTHER) == 422
    clock.now += 2.0  # 61 s since COLD's last request: evicted, OTHER takes the slot
    assert _asked(server_state, OTHER) == 503
    _drain(server_state)
    cold_key = model._key(COLD.variant, COLD.num_beams, COLD.n_docs)
    assert model.forgotten == [cold_key] and cold_key not in model.ready_shapes()
    assert COLD not in server_state.warm and _asked(server_state, OTHER) == 200
    # The warmed setting is never evicted, however idle.
    clock.now += 3600.0
    assert _asked(server_state, server_state.default) == 200
    assert server_state.default in server_state.warm
    # An evicted setting asked again compiles again, in the freed slot.
    assert _asked(server_state, COLD) == 503
    _drain(server_state)
    assert _asked(server_state, COLD) == 200 and _shapes(model, COLD) == PLAN[:1] * 2


def test_a_failed_cold_setting_frees_its_slot_once_idle(cold_state):
    model, server_state = cold_state
    inner = model.compile

    def failing(*args, variant, **kwargs):
        if variant == "sequence" and kwargs["num_beams"] == 2:
            raise RuntimeError("out of memory")
        return inner(*args, variant=variant, **kwargs)

    model.compile = failing
    assert _asked(server_state, COLD) == 503
    _drain(server_state)
    assert _asked(server_state, COLD) == 500
    assert _asked(server_state, OTHER) == 422  # a failure holds its slot while recent...
    server_state.clock.now += 61.0
    assert _asked(server_state, OTHER) == 503  # ... and frees it once idle
    assert model.forgotten == []  # nothing of it was compiled


# ---------------------------------------------------------------------------------------------
# The same over the tiny run's bundle (its programs compiled: ~1-2 min on 2 cores).


@pytest.mark.slow
def test_a_bundle_with_a_huge_generator_bias_stays_unready_naming_the_field(
    tiny_trained_run, tmp_path
):
    import shutil

    import jax
    import numpy as np

    from rag_jax.io import bundle

    directory = tmp_path / "bundle"
    shutil.copytree(tiny_trained_run[0] / "bundle", directory)
    model = bundle.load(directory)
    leaves = jax.tree_util.tree_leaves_with_path(model._params["generator"])
    biases = [path for path, _ in leaves if "bias" in jax.tree_util.keystr(path)]
    assert biases

    # Finite, and loads as any parameter does. Every bias: 3e38 added to all logits alike
    # (the output bias alone) cancels in the softmax.
    def huge(path, leaf):
        return np.full_like(leaf, 3e38) if path in biases else leaf

    generator = jax.tree_util.tree_map_with_path(huge, model._params["generator"])
    model._params = {**model._params, "generator": jax.device_put(generator)}
    server = InProcess(model, serving.ServerConfig(str(directory), max_batch=2))
    try:
        health = _health(
            server, lambda h: "not finite" in h.json().get("reason", ""), timeout=400.0
        )
        assert health.status_code == 503, health.text
        assert "is not finite" in health.json()["reason"], health.text
        assert "answer." in health.json()["reason"]
    finally:
        server.stop()


@pytest.mark.slow
def test_an_evicted_setting_drops_its_compiled_programs(tiny_trained_run, tmp_path):
    from rag_jax.io import bundle

    model = bundle.load(tiny_trained_run[0] / "bundle")
    config = serving.ServerConfig("unused", max_batch=1, max_cold_settings=1, cold_idle_s=60.0)
    server_state = state.ServerState(model, config)
    server_state.clock = Clock()
    server_state.warm_up()
    cold = batching.Setting(server_state.default.variant, 2, server_state.default.n_docs)
    assert _asked(server_state, cold) == 503
    _drain(server_state)
    assert _asked(server_state, cold) == 200
    key = server_state._answer_setting(cold)
    assert model.ready_shapes()[key] == tuple(model.compile_plan(1)[:1])
    assert model._program(key)._cache_size() == 1
    server_state.clock.now += 61.0
    other = batching.Setting(server_state.default.variant, 3, server_state.default.n_docs)
    assert _asked(server_state, other) == 503  # `cold` is evicted, `other` takes its slot
    _drain(server_state)
    assert key not in model.ready_shapes() and model._program(key)._cache_size() == 0
    server_state.compiler.shutdown(wait=True)
