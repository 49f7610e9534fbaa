"""Tests for rag_jax.devices.preemption: a stop notice turned into the step every host stops at."""

import os
import signal
import threading

import jax

from rag_jax.devices import preemption


def test_install_preemption_handler_sets_flag(monkeypatch):
    previous = signal.getsignal(signal.SIGUSR1)
    monkeypatch.setattr(preemption, "_STOP_REQUESTED", threading.Event())
    try:
        assert preemption.install_preemption_handler(signals=(signal.SIGUSR1,))
        assert not preemption.should_stop(3)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption.should_stop(3) and preemption.should_stop()
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_multi_process_stop_follows_the_preemption_sync_point(monkeypatch):
    monkeypatch.setattr(preemption, "_STOP_REQUESTED", threading.Event())
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(
        preemption.multihost_utils, "reached_preemption_sync_point", lambda step: step == 7
    )
    # JAX's preemption service owns SIGTERM on multi-process runs.
    assert not preemption.install_preemption_handler()
    assert [preemption.should_stop(step) for step in (5, 6, 7)] == [False, False, True]
    assert not preemption.should_stop()  # Without a step there is no sync point to ask about.
