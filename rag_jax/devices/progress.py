"""Progress lines with a rate and a time left, for every phase that runs longer than a few seconds.

A user who starts a run should never watch minutes pass in silence: the warm starts, the corpus
encoding and the evaluations each print a line every `EVERY_S` seconds (and when they end) that
says how far they are, how fast they go and when they will be done. `Eta` imports nothing of the
package, so every layer may use it; only process 0 prints.
"""

import os
import sys
import threading
import time

import jax

EVERY_S = 30.0  # seconds between two lines of one phase
QUIET = "RAG_JAX_QUIET"  # set to 1: library calls say nothing of their compiles
FIRST_CALL_AFTER_S = 2.0  # a library call's compile shorter than this is not worth a line


def duration(seconds: float) -> str:
    """`seconds` as people read it: "42 s", "3 min 05 s", "2 h 07 min"."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


class Eta:
    """Prints `label: done of total unit (rate/s), time left` at most every `every_s` seconds.

    The rate is measured from the first `update` (work resumed from a saved state, `start`, is
    not counted as done in this process's time), so a phase that resumes halfway reports the
    time left of what remains.
    """

    def __init__(self, label: str, total: int, unit: str = "", start: int = 0, every_s=EVERY_S):
        self.label, self.total, self.unit, self.every_s = label, int(total), unit, every_s
        self.start, self.done = int(start), int(start)
        self.began = self.printed = time.monotonic()

    def line(self, done: int, extra: str = "") -> str:
        """The line for `done` of `total` (`extra` appended, e.g. a loss)."""
        elapsed = time.monotonic() - self.began
        rate = (done - self.start) / elapsed if elapsed > 0 else 0.0
        left = (self.total - done) / rate if rate > 0 else float("nan")
        unit = f" {self.unit}" if self.unit else ""
        when = "done" if done >= self.total else (
            f"{duration(left)} left" if left == left else "time left not known yet"
        )  # fmt: skip
        text = f"{self.label}: {done} of {self.total}{unit} ({rate:.3g}/s), {when}"
        return f"{text}, {extra}" if extra else text

    def update(self, done: int, extra: str = "", *, force: bool = False) -> None:
        """Records `done`; prints a line when `every_s` has passed, the phase ended, or `force`."""
        self.done = int(done)
        now = time.monotonic()
        if not (force or self.done >= self.total or now - self.printed >= self.every_s):
            return
        self.printed = now
        if jax.process_index() == 0:
            print(self.line(self.done, extra), flush=True)


class Compiling:
    """Says what is compiling while it compiles: one line with the count of programs first, then
    the seconds so far every `every_s` (XLA gives no finer progress), then the time it took.

        with Compiling(2, "answering programs (question encoder, RAG-Token decoding)"):
            model.answer(questions)   # the first call compiles

    Quiet on processes other than 0; `out` is where the lines go (stderr by default)."""

    def __init__(self, count: int, what: str, every_s: float = 10.0, out=None):
        import sys

        self.count, self.what, self.every_s = count, what, every_s
        self.out = sys.stderr if out is None else out
        self._stop = None

    def _say(self, text: str) -> None:
        if jax.process_index() == 0:
            print(text, file=self.out, flush=True)

    def __enter__(self):
        import threading

        self.began = time.monotonic()
        self._say(f"compiling {self.count} {self.what} (the first start only: later starts "
                  "read JAX's persistent cache)")  # fmt: skip
        self._stop = threading.Event()

        def tick():
            while not self._stop.wait(self.every_s):
                self._say(f"  compiling: {duration(time.monotonic() - self.began)} so far")

        self._thread = threading.Thread(target=tick, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        if exc[0] is None:
            self._say(f"compiled in {duration(time.monotonic() - self.began)}")
        return False


class FirstCall:
    """Says on stderr what a plain call of a library entry point is doing when it compiles for
    long: nothing for `after_s` seconds (a cached program, or a quick compile, says nothing),
    then, once the call has traced (`traced()`), `<label>: compiling ...`, the seconds so far
    every `every_s`, and the time it took when it returns.

        with FirstCall("rag.generate", lambda: traces() != before):
            out = _generate_jit(...)

    Quiet on processes other than 0 and when the environment sets `RAG_JAX_QUIET=1`."""

    def __init__(self, label: str, traced, after_s: float | None = None, every_s: float = 10.0):
        self.label, self.traced, self.every_s = label, traced, every_s
        self.after_s = FIRST_CALL_AFTER_S if after_s is None else after_s
        self.said = False
        self._stop = threading.Event()
        self._thread = None

    def _say(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def _watch(self) -> None:
        if self._stop.wait(self.after_s):
            return
        while not self.traced():  # a call running a cached program never traces: it ends first
            if self._stop.wait(0.01):
                return
        self.said = True
        self._say(f"{self.label}: compiling for new shapes or settings (once: later calls with "
                  f"them reuse the program; {QUIET}=1 silences this)")  # fmt: skip
        while not self._stop.wait(self.every_s):
            self._say(f"  {self.label}: {duration(time.monotonic() - self.began)} so far")

    def __enter__(self):
        self.began = time.monotonic()
        if os.environ.get(QUIET, "0") != "1" and jax.process_index() == 0:
            self._thread = threading.Thread(target=self._watch, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.said and exc[0] is None:
            self._say(f"{self.label}: compiled in {duration(time.monotonic() - self.began)}")
        return False


def announced(label: str, traces, jitted):
    """`jitted`, whose traces `traces()` counts, as a function that says what it does when a
    plain call compiles for long (`FirstCall`); under a caller's own `jax.jit` it only traces
    into the caller's program, and says nothing."""

    def call(*args, **kwargs):
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
            return jitted(*args, **kwargs)
        before = traces()
        with FirstCall(label, lambda: traces() != before):
            return jitted(*args, **kwargs)

    return call
