"""devices.progress: the lines long phases print, with their rate and the time left."""

import io
import time

import pytest

from rag_jax.devices import progress
from rag_jax.devices.progress import Compiling


def test_durations_read_as_people_read_them():
    assert [progress.duration(s) for s in (0.4, 42, 185, 7620)] == [
        "0 s",
        "42 s",
        "3 min 05 s",
        "2 h 07 min",
    ]


def test_a_line_every_interval_with_the_rate_and_time_left(monkeypatch, capsys):
    now = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    eta = progress.Eta("corpus encoding", 1000, "passages", start=200, every_s=30)
    now[0] = 110.0
    eta.update(300)  # 10 s in: too soon for a line
    assert capsys.readouterr().out == ""
    now[0] = 140.0
    eta.update(400, "loss 1.234")  # 40 s for 200 passages: 5/s, 600 left
    assert capsys.readouterr().out == (
        "corpus encoding: 400 of 1000 passages (5/s), 2 min 00 s left, loss 1.234\n"
    )
    now[0] = 141.0
    eta.update(1000)  # the end is always said
    assert "1000 of 1000 passages" in capsys.readouterr().out and eta.done == 1000


def test_compiling_says_what_then_the_seconds_then_how_long():
    out = io.StringIO()
    with Compiling(2, "answering programs", every_s=0.05, out=out):
        time.sleep(0.2)  # a compile that takes a while
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("compiling 2 answering programs")
    assert any(line.strip().startswith("compiling: ") for line in lines[1:-1])
    assert lines[-1].startswith("compiled in ")
    out = io.StringIO()
    with pytest.raises(RuntimeError), Compiling(1, "program", out=out):
        raise RuntimeError("the compile failed")
    assert not out.getvalue().splitlines()[-1].startswith("compiled in")  # a failure says no end


def test_first_call_speaks_only_for_a_call_that_traced_and_took_long(monkeypatch, capsys):
    def lines():
        return capsys.readouterr().err.splitlines()

    with progress.FirstCall("rag.generate", lambda: True, after_s=0.05, every_s=0.05):
        time.sleep(0.3)  # a long compile
    said = lines()
    assert said[0].startswith("rag.generate: compiling for new shapes or settings")
    assert any(line.strip().startswith("rag.generate: ") and "so far" in line for line in said)
    assert said[-1].startswith("rag.generate: compiled in ")
    with progress.FirstCall("rag.nll", lambda: False, after_s=0.05):
        time.sleep(0.2)  # long, but a cached program: it never traced
    with progress.FirstCall("rag.nll", lambda: True, after_s=5.0):
        pass  # traced, but over before after_s
    assert lines() == []
    monkeypatch.setenv(progress.QUIET, "1")
    with progress.FirstCall("rag.nll", lambda: True, after_s=0.0):
        time.sleep(0.2)
    assert lines() == []
