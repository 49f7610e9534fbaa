"""The dynamic batcher: concurrent requests merged into one call, settings kept apart, the
largest call bounded (with `overlap`, to half the questions in the batcher), a failed call
failing only the request at fault; its two stages as a pipeline: the next call prepared while
the current one runs, preparations merged into one call, each stage one call at a time."""

import threading
import time

import pytest

from rag_jax.serving.batching import Batcher, Setting

TOKEN = Setting("token", 1, 3)
SEQUENCE = Setting("sequence", 1, 3)


class _Model:
    """The two stages, recorded: `prepare` makes ("prepared", question) per question, `answer`
    answers each with (question, setting); either can be held, and each raises for a question
    named "boom" (answer) or "bad" (prepare)."""

    def __init__(self):
        self.calls, self.preparations = [], []  # questions of each call / preparation
        self.events = []  # ("prepare" | "answer", "start" | "end", questions), in time order
        self.release, self.prepare_release = threading.Event(), threading.Event()
        self.release.set()
        self.prepare_release.set()
        self.running = {"prepare": 0, "answer": 0}
        self.most = {"prepare": 0, "answer": 0}  # the most calls of a stage running at once
        self._lock = threading.Lock()

    def _enter(self, stage, questions):
        with self._lock:
            self.running[stage] += 1
            self.most[stage] = max(self.most[stage], self.running[stage])
            self.events.append((stage, "start", tuple(questions)))

    def _leave(self, stage, questions):
        with self._lock:
            self.running[stage] -= 1
            self.events.append((stage, "end", tuple(questions)))

    def prepare(self, questions, setting):
        self._enter("prepare", questions)
        try:
            self.prepare_release.wait()
            time.sleep(0.01)  # a stage takes time: an overlap would be seen
            self.preparations.append(tuple(questions))
            if "bad" in questions:
                raise ValueError("bad question")
            return [("prepared", q) for q in questions]
        finally:
            self._leave("prepare", questions)

    def answer(self, items, setting):
        questions = [q for tag, q in items]
        assert all(tag == "prepared" for tag, _ in items)
        self._enter("answer", questions)
        try:
            self.release.wait()
            time.sleep(0.01)
            self.calls.append(tuple(questions))
            if "boom" in questions:
                raise RuntimeError("boom")
            return [(q, setting) for q in questions]
        finally:
            self._leave("answer", questions)


def _batcher(model, **kwargs) -> Batcher:
    return Batcher(model.prepare, model.answer, **kwargs)


def _hold_first_call(model, batcher, setting=TOKEN):
    """Submits one request and returns its future once its call is running, held."""
    model.release.clear()
    first = batcher.submit(setting, ["held"])
    deadline = time.monotonic() + 5
    while ("answer", "start", ("held",)) not in model.events:
        assert time.monotonic() < deadline, model.events
        time.sleep(0.005)
    return first


def test_requests_queued_together_are_answered_in_one_call_in_order():
    model = _Model()
    batcher = _batcher(model, max_batch=8, max_wait_s=0.2)
    futures = [batcher.submit(TOKEN, [f"q{i}a", f"q{i}b"]) for i in range(3)]
    assert [f.result(5) for f in futures] == [
        [(f"q{i}a", TOKEN), (f"q{i}b", TOKEN)] for i in range(3)
    ]
    assert model.calls == [("q0a", "q0b", "q1a", "q1b", "q2a", "q2b")]
    assert model.preparations == model.calls  # prepared together, then answered together
    batcher.close()


def test_settings_go_in_separate_calls_and_a_call_holds_at_most_max_batch():
    model = _Model()
    batcher = _batcher(model, max_batch=4, max_wait_s=0.0)
    first = _hold_first_call(model, batcher)
    futures = [batcher.submit(s, [f"{s.variant}{i}"]) for i in range(5) for s in (TOKEN, SEQUENCE)]
    time.sleep(0.2)
    model.release.set()
    assert first.result(5) == [("held", TOKEN)]
    for f in futures:
        (answer,) = f.result(5)
        assert answer[1] == (TOKEN if answer[0].startswith("token") else SEQUENCE)
    sizes = sorted((len(qs), qs[0][:5]) for qs in model.calls[1:])
    assert sizes == [(1, "seque"), (1, "token"), (4, "seque"), (4, "token")]
    for questions in model.calls[1:]:
        assert len({q[:5] for q in questions}) == 1  # one setting per call
    for questions in model.preparations:
        assert len({q[:5] for q in questions}) == 1  # ... and per preparation
    batcher.close()


def test_a_request_waits_at_most_max_wait_for_company():
    model = _Model()
    batcher = _batcher(model, max_batch=64, max_wait_s=0.05)
    start = time.monotonic()
    assert batcher.submit(TOKEN, ["alone"]).result(5) == [("alone", TOKEN)]
    assert 0.04 < time.monotonic() - start < 1.0
    batcher.close()


def test_the_next_call_is_prepared_while_the_current_one_runs():
    """The pipeline: a request queued while a call runs is prepared during that call, and its
    own call begins once that one ends, with nothing left to prepare."""
    model = _Model()
    batcher = _batcher(model, max_batch=8, max_wait_s=0.01)
    first = _hold_first_call(model, batcher)
    second = batcher.submit(TOKEN, ["next"])
    deadline = time.monotonic() + 5
    while ("prepare", "end", ("next",)) not in model.events:
        assert time.monotonic() < deadline, model.events
        time.sleep(0.005)
    assert ("answer", "end", ("held",)) not in model.events  # prepared while the call ran
    assert batcher.waiting() == (1, 1)  # prepared, not yet begun
    model.release.set()
    assert first.result(5) == [("held", TOKEN)] and second.result(5) == [("next", TOKEN)]
    held_end = model.events.index(("answer", "end", ("held",)))
    assert model.events[held_end + 1] == ("answer", "start", ("next",))
    assert batcher.waiting() == (0, 0)
    batcher.close()


def test_preparations_made_while_a_call_runs_are_merged_into_the_next_call():
    model = _Model()
    batcher = _batcher(model, max_batch=4, max_wait_s=0.0)
    first = _hold_first_call(model, batcher)
    futures = []
    for name in ("a", "b", "c"):  # each prepared on its own: the queue is empty between them
        futures.append(batcher.submit(TOKEN, [name]))
        deadline = time.monotonic() + 5
        while ("prepare", "end", (name,)) not in model.events:
            assert time.monotonic() < deadline, model.events
            time.sleep(0.005)
    model.release.set()
    assert [f.result(5) for f in [first, *futures]] == [[(q, TOKEN)] for q in "held a b c".split()]
    assert model.preparations == [("held",), ("a",), ("b",), ("c",)]
    assert model.calls == [("held",), ("a", "b", "c")]
    batcher.close()


def test_each_stage_runs_one_call_at_a_time_and_they_overlap():
    model = _Model()
    batcher = _batcher(model, max_batch=2, max_wait_s=0.0)
    futures, threads = [], []

    def client(i):
        for k in range(6):
            futures.append(batcher.submit(TOKEN if k % 2 else SEQUENCE, [f"c{i}-{k}"]))
            futures[-1].result(10)

    for i in range(6):
        threads.append(threading.Thread(target=client, args=(i,)))
        threads[-1].start()
    for t in threads:
        t.join(30)
    assert len(futures) == 36 and all(f.done() and not f.exception() for f in futures)
    assert model.most == {"prepare": 1, "answer": 1}
    # The stages did overlap: some preparation began while a call ran.
    running, overlapped = 0, False
    for stage, what, _ in model.events:
        if stage == "answer":
            running += 1 if what == "start" else -1
        elif what == "start" and running:
            overlapped = True
    assert overlapped
    assert sorted(q for c in model.calls for q in c) == sorted(
        f"c{i}-{k}" for i in range(6) for k in range(6)
    )
    batcher.close()


def test_a_failed_call_fails_only_the_request_at_fault_and_the_batcher_keeps_serving():
    """A merged call that raises is answered again request by request: the request whose
    questions fail gets the error, the others of its call their answers."""
    model = _Model()
    batches = []
    batcher = Batcher(
        model.prepare,
        model.answer,
        max_batch=8,
        max_wait_s=0.05,
        on_batch=lambda *a: batches.append(a[:2]),
    )
    before = batcher.submit(TOKEN, ["a", "b"])
    bad = batcher.submit(TOKEN, ["boom"])
    after = batcher.submit(TOKEN, ["x"])
    with pytest.raises(RuntimeError, match="boom"):
        bad.result(5)
    assert before.result(5) == [("a", TOKEN), ("b", TOKEN)] and after.result(5) == [("x", TOKEN)]
    assert model.calls == [("a", "b", "boom", "x"), ("a", "b"), ("boom",), ("x",)]
    assert model.preparations == [("a", "b", "boom", "x")]  # each retried from its preparation
    assert batches == [(2, 1), (1, 1)]  # the answered calls, one request each
    assert batcher.submit(TOKEN, ["fine"]).result(5) == [("fine", TOKEN)]
    with pytest.raises(ValueError, match=r"1 to 8 questions, got 9"):
        batcher.submit(TOKEN, ["q"] * 9)
    batcher.close()
    with pytest.raises(RuntimeError, match="closed"):
        batcher.submit(TOKEN, ["late"])


def test_a_failed_preparation_fails_only_the_request_at_fault():
    model = _Model()
    batcher = _batcher(model, max_batch=8, max_wait_s=0.05)
    good = batcher.submit(TOKEN, ["a", "b"])
    bad = batcher.submit(TOKEN, ["bad"])
    other = batcher.submit(TOKEN, ["c"])
    with pytest.raises(ValueError, match="bad question"):
        bad.result(5)
    assert good.result(5) == [("a", TOKEN), ("b", TOKEN)] and other.result(5) == [("c", TOKEN)]
    assert model.preparations == [("a", "b", "bad", "c"), ("a", "b"), ("bad",), ("c",)]
    assert "bad" not in {q for c in model.calls for q in c}  # never reached the model
    assert sorted(q for c in model.calls for q in c) == ["a", "b", "c"]
    assert batcher.waiting() == (0, 0)
    batcher.close()


def test_a_cancelled_request_is_dropped_and_the_others_are_answered():
    """A client that goes away cancels its request (asyncio.wrap_future does): the worker drops
    it instead of failing to set its result, prepared or not."""
    model = _Model()
    batcher = _batcher(model, max_batch=8, max_wait_s=0.0)
    held = _hold_first_call(model, batcher)
    gone, kept = batcher.submit(TOKEN, ["gone"]), batcher.submit(TOKEN, ["kept"])
    deadline = time.monotonic() + 5
    while not any(e[:2] == ("prepare", "end") and "gone" in e[2] for e in model.events):
        assert time.monotonic() < deadline, model.events
        time.sleep(0.005)
    assert gone.cancel()  # prepared, its call not begun: still cancellable
    model.prepare_release.clear()  # and one cancelled while its preparation is held
    late = batcher.submit(TOKEN, ["late"])
    deadline = time.monotonic() + 5
    while ("prepare", "start", ("late",)) not in model.events:
        assert time.monotonic() < deadline, model.events
        time.sleep(0.005)
    assert late.cancel()
    model.prepare_release.set()
    model.release.set()
    assert held.result(5) == [("held", TOKEN)] and kept.result(5) == [("kept", TOKEN)]
    assert batcher.submit(TOKEN, ["later"]).result(5) == [("later", TOKEN)]
    assert [qs for qs in model.calls] == [("held",), ("kept",), ("later",)]
    batcher.close()


def test_close_answers_what_is_queued():
    model = _Model()
    batcher = _batcher(model, max_batch=2, max_wait_s=10.0)  # nothing would be due for 10 s
    futures = [batcher.submit(TOKEN, [f"q{i}"]) for i in range(3)]
    start = time.monotonic()
    batcher.close()
    assert time.monotonic() - start < 5
    assert [f.result(0) for f in futures] == [[(f"q{i}", TOKEN)] for i in range(3)]


def _closed_loop(batcher, clients: int, requests: int, questions: int = 1) -> list:
    """`clients` threads, released together, each sending `requests` requests of `questions`
    questions, the next once the last is answered (as HTTP clients do); their futures."""
    futures, threads = [], []
    start = threading.Barrier(clients)

    def client(i):
        start.wait(5)
        for k in range(requests):
            futures.append(batcher.submit(TOKEN, [f"c{i}-{k}-{j}" for j in range(questions)]))
            futures[-1].result(10)

    for i in range(clients):
        threads.append(threading.Thread(target=client, args=(i,)))
        threads[-1].start()
    for t in threads:
        t.join(30)
    assert len(futures) == clients * requests and all(f.done() for f in futures)
    return futures


def test_overlap_holds_a_call_to_half_the_questions_in_the_batcher():
    """8 clients at once: without `overlap` their first requests wait for each other and share
    one call; with it no call holds more than 4 (half of the 8 questions the batcher can hold),
    so one half's call runs while the other half is prepared; requests are still merged."""
    model = _Model()
    batcher = _batcher(model, max_batch=8, max_wait_s=0.2)
    for f in _closed_loop(batcher, clients=8, requests=1):
        assert not f.exception()
    batcher.close()
    assert max(len(c) for c in model.calls) > 4, model.calls

    model = _Model()
    batcher = _batcher(model, max_batch=8, max_wait_s=0.2, overlap=True)
    for f in _closed_loop(batcher, clients=8, requests=6):
        assert not f.exception()
    batcher.close()
    sizes = [len(c) for c in model.calls]
    assert max(sizes) <= 4 and max(sizes) > 1, model.calls
    assert sorted(q for c in model.calls for q in c) == sorted(
        f"c{i}-{k}-0" for i in range(8) for k in range(6)
    )


def test_overlap_never_splits_a_request():
    """One client's requests of 3 questions: the batcher never holds more than 3, half of that
    is 2, and each request is still answered whole, in one call."""
    model = _Model()
    batcher = _batcher(model, max_batch=8, max_wait_s=0.0, overlap=True)
    futures = _closed_loop(batcher, clients=1, requests=4, questions=3)
    assert [f.result(0) for f in futures] == [
        [(f"c0-{k}-{j}", TOKEN) for j in range(3)] for k in range(4)
    ]
    assert [len(c) for c in model.calls] == [3] * 4
    batcher.close()
