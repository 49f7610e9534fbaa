"""Dynamic batching: concurrent requests for answers merged into one call of the model.

Requests arrive one by one (each with a few questions); answering them one call each would run
the jitted programs at batch 1 while the next request waits. A `Batcher` keeps a queue: its one
worker thread takes the oldest request, waits until `max_wait_s` after that request arrived or
after its own previous call ended, whichever is later (or until `max_batch` questions of the
same setting are queued), and answers every queued request of that setting in one `answer_fn`
call, which pads the batch to a bucket (`bundle.BATCH_BUCKETS`). Requests of another (variant,
num_beams, n_docs) wait for their own batch. Waiting from the end of the previous call lets the
clients just answered send their next requests into the coming batch instead of the one after:
under load, batches fill instead of alternating between two half-full groups.

A call that raises is not handed to every request it merged: each of its requests is answered
again on its own, so a request whose questions make the model fail fails alone. A request
cancelled before its call begins (its client went away) is dropped.

Legend: B questions in one call.
"""

import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable


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


class Batcher:
    """Merges concurrent requests into calls of `answer_fn(questions, setting) -> answers`.

    Attributes:
      max_batch: the most questions in one call (a request is never split).
      max_wait_s: how long the oldest queued request may wait for others to join it.
    """

    def __init__(
        self,
        answer_fn: Callable[[list[str], Setting], list],
        *,
        max_batch: int,
        max_wait_s: float,
        on_batch: Callable[[int, int, float], None] | None = None,
    ):
        """Args:
        answer_fn: answers B questions of one setting, in order (runs on the worker thread).
        max_batch, max_wait_s: see Attributes.
        on_batch: called after each call with (questions, requests, seconds the call took).
        """
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.answer_fn, self.max_batch, self.max_wait_s = answer_fn, max_batch, max_wait_s
        self._on_batch = on_batch
        self._pending: list[_Request] = []
        self._cond = threading.Condition()
        self._closed = False
        self._idle_since = 0.0  # time.monotonic() when the last call ended
        self._thread = threading.Thread(target=self._run, name="batcher", daemon=True)
        self._thread.start()

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
            self._cond.notify()
        return request.future

    def close(self) -> None:
        """Answers what is queued, then stops the worker."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _queued(self, setting: Setting) -> int:
        return sum(len(r.questions) for r in self._pending if r.setting == setting)

    def _next_batch(self) -> list[_Request] | None:
        """Blocks until a batch is due; takes it off the queue (None: closed and empty)."""
        with self._cond:
            while not self._pending:
                if self._closed:
                    return None
                self._cond.wait()
            first = self._pending[0]
            deadline = max(first.arrived, self._idle_since) + self.max_wait_s
            while not self._closed and self._queued(first.setting) < self.max_batch:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            batch, rest, count = [], [], 0
            for r in self._pending:  # oldest first; a request that does not fit waits
                if r.setting == first.setting and count + len(r.questions) <= self.max_batch:
                    batch.append(r)
                    count += len(r.questions)
                else:
                    rest.append(r)
            self._pending = rest
            return batch

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            # A request whose client went away was cancelled: drop it. The others can no longer
            # be cancelled, so setting their results below cannot fail.
            batch = [r for r in batch if r.future.set_running_or_notify_cancel()]
            if not batch:
                continue
            questions = [q for r in batch for q in r.questions]
            start = time.monotonic()
            try:
                answers = self.answer_fn(questions, batch[0].setting)
            except Exception as e:  # noqa: BLE001 - handed to its request, or each tried alone
                if len(batch) == 1:
                    self._idle_since = time.monotonic()
                    batch[0].future.set_exception(e)
                    continue
                # One request's questions may be what failed: answer each request on its own,
                # so that only a failing one fails and the others get their answers.
                for r in batch:
                    self._answer_alone(r)
                self._idle_since = time.monotonic()
                continue
            self._idle_since = time.monotonic()
            seconds = self._idle_since - start
            at = 0
            for r in batch:
                r.future.set_result(answers[at : at + len(r.questions)])
                at += len(r.questions)
            if self._on_batch is not None:
                self._on_batch(len(questions), len(batch), seconds)

    def _answer_alone(self, request: _Request) -> None:
        start = time.monotonic()
        try:
            answers = self.answer_fn(request.questions, request.setting)
        except Exception as e:  # noqa: BLE001 - handed to this request only
            request.future.set_exception(e)
            return
        request.future.set_result(answers)
        if self._on_batch is not None:
            self._on_batch(len(request.questions), 1, time.monotonic() - start)
