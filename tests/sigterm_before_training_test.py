"""A real SIGTERM, sent to a real training process, during the work before its first step: the
corpus encoding and the reader warm start each save what they did, and the next run resumes it
and ends bitwise where an uninterrupted one ends (the ICT warm start's own test is in
`reliability_test.py`; `encode_store`'s resume alone, quickly, in `retriever_test.py`)."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from rag_jax.retrieval import encode
from rag_jax.retrieval import retriever as retriever_lib
from rag_jax.training import experiment
from tiny_runs import tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
WINDOW = 16  # passages per encoding window: the tiny corpus spans several
NO_WARM_STARTS = {"warm_start.method": "none", "warm_start.reader_steps": 0}

# The trainer in a process of its own, paused at a chosen point (after the encoding's second
# window, or before the reader warm start's step 3) until the test's SIGTERM reaches its handler.
_DRIVER = textwrap.dedent(
    """
    import json, sys, time
    from rag_jax.devices import preemption
    from rag_jax.retrieval import encode, retriever
    from rag_jax.run import checkpoints
    from rag_jax.training import loop
    from tiny_runs import tiny_config

    where, workdir, overrides = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    retriever.ENCODE_WINDOW = {window}

    def pause(label):
        print(f"paused at {{label}}", flush=True)
        deadline = time.time() + 120
        while not preemption.should_stop() and time.time() < deadline:
            time.sleep(0.05)

    windows, encode_passages = [], encode.encode_passages
    def encoding(*args, **kwargs):
        out = encode_passages(*args, **kwargs)
        windows.append(len(out))
        if where == "encoding" and len(windows) == 2:
            pause("encoding window 2")
        return out
    encode.encode_passages = encoding

    stop_if_requested = checkpoints.Progress.stop_if_requested
    def at_step(self, state, step, total):
        if where == "reader" and self.label == "reader warm start" and step == 3:
            pause("reader step 3")
        return stop_if_requested(self, state, step, total)
    checkpoints.Progress.stop_if_requested = at_step

    summary = loop.train_and_evaluate(tiny_config(**overrides), workdir)
    print("SUMMARY " + json.dumps(summary), flush=True)
    """
).format(window=WINDOW)


def _terminated_at(where: str, workdir: pathlib.Path, overrides: dict) -> tuple[dict, str]:
    """Runs the trainer in a subprocess, sends it SIGTERM once it is paused at `where`, and
    returns its summary and output."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": f"{ROOT / 'tests'}:{ROOT}"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, where, str(workdir), json.dumps(overrides)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
    )
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("paused at"):
            proc.send_signal(signal.SIGTERM)
            break
    out = "".join(seen) + proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-4000:]
    assert any(line.startswith("paused at") for line in seen), out[-4000:]
    summary = [line for line in out.splitlines() if line.startswith("SUMMARY ")]
    return json.loads(summary[-1][len("SUMMARY ") :]), out


def _assert_bitwise_equal(a, b, what: str) -> None:
    flat_a = jax.tree_util.tree_leaves_with_path(a)
    flat_b = jax.tree_util.tree_leaves_with_path(b)
    assert [p for p, _ in flat_a] == [p for p, _ in flat_b], what
    for (path, x), (_, y) in zip(flat_a, flat_b):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, (what, path)
        assert x.tobytes() == y.tobytes(), f"{what}{jax.tree_util.keystr(path)}"


@pytest.mark.slow  # 32 s on a loaded 2-core machine
def test_sigterm_while_the_corpus_is_encoded_saves_the_rows_and_the_rerun_resumes_them(
    tmp_path, monkeypatch, capsys
):
    config_overrides = dict(NO_WARM_STARTS)
    summary, out = _terminated_at("encoding", tmp_path / "stopped", config_overrides)
    assert summary["steps"] == 0, out[-3000:]
    assert f"{2 * WINDOW} of " in summary["preempted"], summary
    partial = list((tmp_path / "stopped" / "index").glob("*.partial.npz"))
    assert len(partial) == 1 and str(partial[0]) in summary["preempted"], summary
    assert "preempted before training: stopped while encoding the corpus" in out

    # The rerun, in this process, with the same window: it encodes only the windows left.
    monkeypatch.setattr(retriever_lib, "ENCODE_WINDOW", WINDOW)
    windows, encode_passages = [], encode.encode_passages

    def counted(*args, **kwargs):
        windows.append(len(args[3]))
        return encode_passages(*args, **kwargs)

    monkeypatch.setattr(encode, "encode_passages", counted)
    config = tiny_config(**config_overrides)
    resumed = experiment.build(config, tmp_path / "stopped")
    assert f"corpus encoding: resuming at passage {2 * WINDOW} of " in capsys.readouterr().out
    count = len(resumed.store)
    assert count > 4 * WINDOW and sum(windows) == count - 2 * WINDOW
    assert not partial[0].exists()  # done: only the finished encoding is kept

    windows.clear()
    straight = experiment.build(config, tmp_path / "straight")
    assert sum(windows) == count
    _assert_bitwise_equal(resumed.retriever.vectors, straight.retriever.vectors, "vectors")


@pytest.mark.slow  # 50 s on a loaded 2-core machine
def test_sigterm_during_the_reader_warm_start_saves_it_and_the_rerun_resumes_it(tmp_path, capsys):
    config_overrides = {"warm_start.method": "none", "warm_start.reader_steps": 6}
    summary, out = _terminated_at("reader", tmp_path / "stopped", config_overrides)
    assert summary["steps"] == 0, out[-3000:]
    assert "reader warm start at step 3 of 6" in summary["preempted"], summary
    partial = list((tmp_path / "stopped" / "warm_start").glob("*.partial.msgpack"))
    assert len(partial) == 1 and str(partial[0]) in summary["preempted"], summary

    config = tiny_config(**config_overrides)
    resumed = experiment.build(config, tmp_path / "stopped", retriever=False)
    assert "reader warm start: resuming at step 3" in capsys.readouterr().out
    assert not partial[0].exists()
    straight = experiment.build(config, tmp_path / "straight", retriever=False)
    _assert_bitwise_equal(resumed.params["generator"], straight.params["generator"], "generator")
