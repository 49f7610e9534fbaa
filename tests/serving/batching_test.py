"""The dynamic batcher: concurrent requests merged into one call, settings kept apart, the
largest call bounded, a failed call failing only the request at fault."""

import threading
import time

import pytest

from rag_jax.serving.batching import Batcher, Setting

TOKEN = Setting("token", 1, 3)
SEQUENCE = Setting("sequence", 1, 3)


class _Model:
    """Records each call; answers a question with (question, setting); can be held."""

    def __init__(self):
        self.calls, self.release = [], threading.Event()
        self.release.set()

    def __call__(self, questions, setting):
        self.release.wait()
        self.calls.append((tuple(questions), setting))
        if "boom" in questions:
            raise RuntimeError("boom")
        return [(q, setting) for q in questions]


def test_requests_queued_together_are_answered_in_one_call_in_order():
    model = _Model()
    batcher = Batcher(model, max_batch=8, max_wait_s=0.2)
    futures = [batcher.submit(TOKEN, [f"q{i}a", f"q{i}b"]) for i in range(3)]
    assert [f.result(5) for f in futures] == [
        [(f"q{i}a", TOKEN), (f"q{i}b", TOKEN)] for i in range(3)
    ]
    assert model.calls == [(("q0a", "q0b", "q1a", "q1b", "q2a", "q2b"), TOKEN)]
    batcher.close()


def test_settings_go_in_separate_calls_and_a_call_holds_at_most_max_batch():
    model = _Model()
    model.release.clear()  # hold the worker on its first call while the queue fills
    batcher = Batcher(model, max_batch=4, max_wait_s=0.0)
    first = batcher.submit(TOKEN, ["held"])
    time.sleep(0.1)
    futures = [batcher.submit(s, [f"{s.variant}{i}"]) for i in range(5) for s in (TOKEN, SEQUENCE)]
    model.release.set()
    assert first.result(5) == [("held", TOKEN)]
    for f in futures:
        (answer,) = f.result(5)
        assert answer[1] == (TOKEN if answer[0].startswith("token") else SEQUENCE)
    sizes = [(len(qs), s) for qs, s in model.calls[1:]]
    assert sorted(sizes, key=str) == sorted(
        [(4, TOKEN), (1, TOKEN), (4, SEQUENCE), (1, SEQUENCE)], key=str
    )
    for questions, setting in model.calls:
        assert all(q.startswith(setting.variant) or q == "held" for q in questions)
    batcher.close()


def test_a_request_waits_at_most_max_wait_for_company():
    model = _Model()
    batcher = Batcher(model, max_batch=64, max_wait_s=0.05)
    start = time.monotonic()
    assert batcher.submit(TOKEN, ["alone"]).result(5) == [("alone", TOKEN)]
    assert 0.04 < time.monotonic() - start < 1.0
    batcher.close()


def test_a_failed_call_fails_only_the_request_at_fault_and_the_batcher_keeps_serving():
    """A merged call that raises is answered again request by request: the request whose
    questions fail gets the error, the others of its call their answers."""
    model = _Model()
    batches = []
    batcher = Batcher(
        model, max_batch=8, max_wait_s=0.05, on_batch=lambda *a: batches.append(a[:2])
    )
    before = batcher.submit(TOKEN, ["a", "b"])
    bad = batcher.submit(TOKEN, ["boom"])
    after = batcher.submit(TOKEN, ["x"])
    with pytest.raises(RuntimeError, match="boom"):
        bad.result(5)
    assert before.result(5) == [("a", TOKEN), ("b", TOKEN)] and after.result(5) == [("x", TOKEN)]
    assert [qs for qs, _ in model.calls] == [("a", "b", "boom", "x"), ("a", "b"), ("boom",), ("x",)]
    assert batches == [(2, 1), (1, 1)]  # the answered calls, one request each
    assert batcher.submit(TOKEN, ["fine"]).result(5) == [("fine", TOKEN)]
    with pytest.raises(ValueError, match=r"1 to 8 questions, got 9"):
        batcher.submit(TOKEN, ["q"] * 9)
    batcher.close()
    with pytest.raises(RuntimeError, match="closed"):
        batcher.submit(TOKEN, ["late"])


def test_a_cancelled_request_is_dropped_and_the_others_are_answered():
    """A client that goes away cancels its request (asyncio.wrap_future does): the worker drops
    it instead of failing to set its result."""
    model = _Model()
    model.release.clear()
    batcher = Batcher(model, max_batch=8, max_wait_s=0.0)
    held = batcher.submit(TOKEN, ["held"])
    time.sleep(0.1)
    gone, kept = batcher.submit(TOKEN, ["gone"]), batcher.submit(TOKEN, ["kept"])
    assert gone.cancel()
    model.release.set()
    assert held.result(5) == [("held", TOKEN)] and kept.result(5) == [("kept", TOKEN)]
    assert [qs for qs, _ in model.calls] == [("held",), ("kept",)]
    assert batcher.submit(TOKEN, ["later"]).result(5) == [("later", TOKEN)]
    batcher.close()
