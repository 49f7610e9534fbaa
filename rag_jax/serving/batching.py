"""Dynamic batching: concurrent requests for answers merged into one call of the model, the next
call's host work done while the current one runs.

Requests arrive one by one (each with a few questions); answering them one call each would run
the jitted programs at batch 1 while the next request waits. A `Batcher` answers in two stages,
each on a thread of its own, as a small pipeline:

- its preparing thread takes queued requests of one setting (variant, num_beams, n_docs) and runs
  `prepare_fn` on their questions together: the host work (tokenising, encoding the questions,
  retrieving, assembling the contexts), one prepared item per question;
- its worker takes prepared requests of one setting, at most `max_batch` questions, and answers
  them in one `answer_fn` call (the generation programs, which pad the batch to a bucket).

So the next call's host work can run while the current call's programs do (a jitted program
runs with the GIL released), and the worker starts its next call as soon as that call is
prepared. When the preparing thread takes the queue:

- at once when it holds `max_batch` questions of a setting (the call is full);
- else once its oldest request has waited as long as a call of the queued size is expected to
  take (the running mean of recent calls of about that size; at least `max_wait_s`), counted from
  its arrival or, with the worker idle, from the end of the worker's last call, whichever is
  later: a request's wait for company at most doubles its latency, and under load the clients
  the last call answered have the time to send their next requests into this one;
- and, while the worker is busy, not before its expected end less the recent preparations' mean
  time, so that the preparation ends as the worker frees up.

With `overlap` (a server's default), "full" means half the questions the batcher held at its
recent peak (queued, prepared and in the running call), and the worker takes no more either:
clients that send their next request when answered then form two groups, one group's call
running while the other's answers cross the HTTP stack, its next requests arrive and are
prepared. Without it, every client waits for the same call and the model idles while their
round trips run (on the default job's model on 2 CPU cores a call of 16 questions took ~40 ms,
and the 16 clients' round trip about as long again).

Measured on 2 shared CPU cores with the 16 clients of `benchmarks/serve_load.py` (each sends its
next request when answered): waiting `max_wait_s` (3 ms) alone split them into calls of 1 to 16
questions (mean 5.5-5.7, a call of 16 taking only 1.2-1.5 times one of 8) and a p99 latency of
0.92-1.04 s; with this wait calls held 12-13 on average and the p99 was 0.54-0.58 s (two runs
each, load average 5-8; requests/s 4.0-4.6 and 4.2-4.8 times the transformers baseline's, within
the runs' noise). On a quiet machine (load average 1.2-1.8), `overlap` took the same 16 clients
from 186-213 to 264-291 requests/s, calls of 8 instead of 16 and p50 latency from 78-86 to
54-60 ms (one server, 2 x 1,000 requests, each setting twice). The worker merges the prepared
requests of a setting (several preparations) into one call, and waits for a preparation under way
that fits in it.

A call that raises is not handed to every request it merged: each of its requests is answered
again on its own (a preparation that raises: each prepared again on its own), so a request
whose questions make the model fail fails alone. A request cancelled before its call begins (its
client went away) is dropped, prepared or not.

Legend: B questions in one call.
"""

import concurrent.futures
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Sequence

# Weight of the latest call (or preparation) in the running means the preparing thread times its
# work by: recent enough to follow the load, smooth enough that one slow call does not rule.
_MEAN_WEIGHT = 0.25
# How fast the peak of questions in the batcher (`Batcher.overlap`) forgets, in seconds: long
# enough to span many calls, short enough to follow a change of load.
_PEAK_S = 2.0


@dataclasses.dataclass(frozen=True)
class Setting:
    """What a batch is answered with: requests of one setting share a call."""

    variant: str
    num_beams: int
    n_docs: int


@dataclasses.dataclass
class _Request:
    setting: Setting
    questions: list[str]
    future: concurrent.futures.Future
    arrived: float  # time.monotonic()
    preparing: bool = False  # taken by the preparing thread
    prepared: Sequence | None = None  # prepare_fn's items, one per question, once prepared


def _mean(old: float | None, new: float) -> float:
    return new if old is None else old + _MEAN_WEIGHT * (new - old)


def _size_class(questions: int) -> int:
    """Calls of 1, 2-3, 4-7, 8-15, ... questions are timed together (padded to about one
    batch bucket, they take about as long)."""
    return questions.bit_length()


class Batcher:
    """Merges concurrent requests into calls of `answer_fn(prepare_fn(questions, setting))`,
    preparing the next call while the current one runs.

    Attributes:
      prepare_fn, answer_fn: the two stages (see `__init__`).
      max_batch: the most questions in one call (a request is never split).
      max_wait_s: how long the oldest queued request may wait for others to join it.
      overlap: calls sized to half the recent peak of questions in the batcher (see
        `__init__`).
    """

    def __init__(
        self,
        prepare_fn: Callable[[list[str], Setting], Sequence],
        answer_fn: Callable[[list, Setting], list],
        *,
        max_batch: int,
        max_wait_s: float,
        on_batch: Callable[[int, int, float], None] | None = None,
        overlap: bool = False,
    ):
        """Args:
        prepare_fn: (B questions of one setting, the setting) -> B prepared items, in order
          (runs on the preparing thread; calls never overlap each other).
        answer_fn: (B prepared items of one setting, from one or several `prepare_fn` calls,
          the setting) -> B answers, in order (runs on the worker; calls never overlap each
          other, and may overlap a `prepare_fn` call).
        max_batch, max_wait_s: see Attributes.
        on_batch: called after each answered call with (questions, requests, seconds the call
          took).
        overlap: a call holds at most half the questions recently in the batcher at once
          (queued, prepared or in the current call; at most `max_batch`), so that the clients
          form two groups: one group's call runs while the other's answers go out and its next
          requests come in and are prepared. Where a call costs about in proportion to its
          questions (the default job's model on CPU), two half calls take what one full call
          does and the host work of one hides under the other's model; where a call of B costs
          much less than two of B / 2 (an accelerator), leave it off.
        """
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.prepare_fn, self.answer_fn = prepare_fn, answer_fn
        self.max_batch, self.max_wait_s, self.overlap = max_batch, max_wait_s, overlap
        self._on_batch = on_batch
        self._cond = threading.Condition()
        # Every request not yet begun, oldest first: queued, being prepared or prepared.
        self._pending: list[_Request] = []
        self._closed = False
        # time.monotonic() the worker's current call began; None while it is idle.
        self._call_start: float | None = None
        self._idle_since = 0.0  # time.monotonic() the worker's last call ended
        self._call_size = 0  # questions in the worker's current call
        # Running means of the worker's calls (seconds) by size class (`_size_class`), and of
        # the preparations.
        self._call_s: dict[int, float] = {}
        self._prepare_s: float | None = None
        # The peak of questions in the batcher, decaying by _PEAK_S, and when it was last
        # updated (time.monotonic()): `overlap` sizes calls by it.
        self._peak, self._peak_at = 0.0, time.monotonic()
        self._threads = [
            threading.Thread(target=self._prepare_loop, name="batcher-prepare", daemon=True),
            threading.Thread(target=self._answer_loop, name="batcher", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, setting: Setting, questions: list[str]) -> concurrent.futures.Future:
        """Queues one request; the future's result is its answers, in order.

        Raises:
          ValueError: more questions than `max_batch`, or none.
        """
        if not 1 <= len(questions) <= self.max_batch:
            raise ValueError(
                f"a request holds 1 to {self.max_batch} questions, got {len(questions)}"
            )
        request = _Request(setting, list(questions), concurrent.futures.Future(), time.monotonic())
        with self._cond:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            self._pending.append(request)
            self._note_load()
            self._cond.notify_all()
        return request.future

    def waiting(self) -> tuple[int, int]:
        """(requests, questions) waiting for their call: queued or prepared, not yet begun."""
        with self._cond:
            return len(self._pending), sum(len(r.questions) for r in self._pending)

    def close(self) -> None:
        """Answers what is queued, then stops both threads."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()

    # -----------------------------------------------------------------------------------------
    # Preparing

    def _fitting(self, requests: list[_Request], setting: Setting) -> list[_Request]:
        """The oldest of `requests` of `setting` that fit in one call of `_call_limit()`
        questions (one that does not waits; the first is always taken: a request is never
        split)."""
        taken, count, limit = [], 0, self._call_limit()
        for r in requests:
            if r.setting == setting and (not taken or count + len(r.questions) <= limit):
                taken.append(r)
                count += len(r.questions)
        return taken

    def _note_load(self) -> None:
        """Updates the decaying peak of questions in the batcher (under the lock)."""
        now = time.monotonic()
        held = sum(len(r.questions) for r in self._pending)
        if self._call_start is not None:
            held += self._call_size
        decayed = self._peak * math.exp(-(now - self._peak_at) / _PEAK_S)
        self._peak, self._peak_at = max(decayed, float(held)), now

    def _call_limit(self) -> int:
        """The most questions one call takes: `max_batch`, or with `overlap` half the recent
        peak of questions in the batcher (at least 1)."""
        if not self.overlap:
            return self.max_batch
        peak = self._peak * math.exp(-(time.monotonic() - self._peak_at) / _PEAK_S)
        return max(1, min(self.max_batch, math.ceil(peak / 2 - 1e-9)))

    def _expected_s(self, questions: int) -> float:
        """How long a call of `questions` is expected to take: the running mean of recent calls
        of about that size (of the nearest smaller size seen; 0 before any)."""
        known = [c for c in self._call_s if c <= _size_class(questions)]
        return self._call_s[max(known)] if known else 0.0

    def _prepare_at(self, first: _Request, questions: int) -> float:
        """When to prepare the queue whose oldest request is `first`, `questions` of its
        setting queued (time.monotonic())."""
        # A batch waits for company as long as its own call is expected to take (at least
        # max_wait_s): its latency at most doubles, and under load the clients the current call
        # answers have the time to send their next requests into it.
        wait = max(self.max_wait_s, self._expected_s(questions))
        if self._call_start is None:  # idle: it will start with what this preparation makes
            return max(first.arrived, self._idle_since) + wait
        free_at = self._call_start + self._expected_s(self._call_size)
        return max(first.arrived + wait, free_at - (self._prepare_s or 0.0))

    def _next_group(self) -> list[_Request] | None:
        """Blocks until a preparation is due; takes its requests (None: closed and empty)."""
        with self._cond:
            while True:
                queued = [r for r in self._pending if not r.preparing]
                if not queued:
                    if self._closed:
                        return None
                    self._cond.wait()
                    continue
                first = queued[0]
                count = sum(len(r.questions) for r in queued if r.setting == first.setting)
                left = self._prepare_at(first, count) - time.monotonic()
                if self._closed or count >= self._call_limit() or left <= 0:
                    break
                self._cond.wait(left)  # woken early by arrivals and by the worker's calls
            group = self._fitting(queued, first.setting)
            for r in group:
                r.preparing = True
            return group

    def _prepare_loop(self) -> None:
        while (group := self._next_group()) is not None:
            setting = group[0].setting
            start = time.monotonic()
            prepared, together = {}, True  # id(request) -> its items
            try:
                items = self.prepare_fn([q for r in group for q in r.questions], setting)
                at = 0
                for r in group:
                    prepared[id(r)] = items[at : at + len(r.questions)]
                    at += len(r.questions)
            except Exception as e:  # noqa: BLE001 - handed to its request, or each tried alone
                together = False
                if len(group) == 1:
                    _fail(group[0], e)
                else:  # one request's questions may be what failed: prepare each on its own
                    for r in group:
                        try:
                            prepared[id(r)] = self.prepare_fn(r.questions, setting)
                        except Exception as e:  # noqa: BLE001 - handed to this request only
                            _fail(r, e)
            seconds = time.monotonic() - start
            with self._cond:
                if together:  # one call: a measure of the next
                    self._prepare_s = _mean(self._prepare_s, seconds)
                for r in group:
                    r.prepared = prepared.get(id(r))
                # A request that failed is answered (with its error): no longer pending.
                self._pending = [
                    r for r in self._pending if not r.preparing or r.prepared is not None
                ]
                self._cond.notify_all()

    # -----------------------------------------------------------------------------------------
    # Answering

    def _next_call(self) -> list[_Request] | None:
        """Blocks until prepared requests wait (and no preparation under way would join them);
        takes the oldest setting's, up to `max_batch` questions (None: closed and all done)."""
        with self._cond:
            while True:
                prepared = [r for r in self._pending if r.prepared is not None]
                if prepared:
                    first = prepared[0]
                    call = self._fitting(prepared, first.setting)
                    count = sum(len(r.questions) for r in call)
                    joining = sum(
                        len(r.questions)
                        for r in self._pending
                        if r.preparing and r.prepared is None and r.setting == first.setting
                    )
                    if not joining or count + joining > self._call_limit():
                        break
                elif self._closed and not self._pending:
                    return None
                self._cond.wait()
            taken = {id(r) for r in call}
            self._pending = [r for r in self._pending if id(r) not in taken]
            self._call_start = time.monotonic()
            self._call_size = sum(len(r.questions) for r in call)
            self._note_load()
            self._cond.notify_all()  # the preparing thread times its next group by this call
            return call

    def _answer_loop(self) -> None:
        while (call := self._next_call()) is not None:
            # A request whose client went away was cancelled: drop it. The others can no longer
            # be cancelled, so setting their results below cannot fail.
            call = [r for r in call if r.future.set_running_or_notify_cancel()]
            start = time.monotonic()
            if call:
                self._answer(call)
            with self._cond:
                self._idle_since = time.monotonic()
                if call:
                    size = _size_class(sum(len(r.questions) for r in call))
                    self._call_s[size] = _mean(self._call_s.get(size), self._idle_since - start)
                self._call_start = None
                self._cond.notify_all()

    def _answer(self, call: list[_Request]) -> None:
        setting = call[0].setting
        items = [x for r in call for x in r.prepared]
        start = time.monotonic()
        try:
            answers = self.answer_fn(items, setting)
        except Exception as e:  # noqa: BLE001 - handed to its request, or each tried alone
            if len(call) == 1:
                call[0].future.set_exception(e)
                return
            # One request's questions may be what failed: answer each request on its own, so
            # that only a failing one fails and the others get their answers.
            for r in call:
                self._answer_alone(r)
            return
        seconds = time.monotonic() - start
        at = 0
        for r in call:
            r.future.set_result(answers[at : at + len(r.questions)])
            at += len(r.questions)
        if self._on_batch is not None:
            self._on_batch(len(items), len(call), seconds)

    def _answer_alone(self, request: _Request) -> None:
        start = time.monotonic()
        try:
            answers = self.answer_fn(list(request.prepared), request.setting)
        except Exception as e:  # noqa: BLE001 - handed to this request only
            request.future.set_exception(e)
            return
        request.future.set_result(answers)
        if self._on_batch is not None:
            self._on_batch(len(request.questions), 1, time.monotonic() - start)


def _fail(request: _Request, error: Exception) -> None:
    """Hands `error` to `request`, unless its client went away (then it is dropped)."""
    if request.future.set_running_or_notify_cancel():
        request.future.set_exception(error)
