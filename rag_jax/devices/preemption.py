"""Preemption: a stop notice (SIGTERM, a TPU VM's preemption warning) turned into a step to stop at.

Every loop that runs long enough to be preempted polls the same flag: the training loop before
each step (it saves, then exits), the warm starts and the corpus encoding between their windows
(they save their progress, then raise `Preempted`). The contract:

- One process. `install_preemption_handler()` makes SIGTERM set a flag; `should_stop()` reports
  it. Nothing else happens in the signal handler, so a stop never interleaves with a step.
- Several processes. JAX's preemption service listens for SIGTERM itself (a Python handler would
  replace its listener, so none is installed): `should_stop(step)` asks it whether all hosts
  reached the agreed stop step, and returns True on every host at that same step, so every host
  saves the same step. JAX requires that every host asks at every step, from the same step on.

The training loop looks like::

    install_preemption_handler()             # after distributed.maybe_initialize_distributed()
    while step < num_steps:
        if should_stop(step):
            ...                              # save the state at `step`, then leave the loop
        state = train_step(state, batch(step))
        step += 1

`checkpoints.Checkpointer` saves that state; `checkpoints.Progress` keeps a warm start's.
"""

import signal
import threading

import jax
from absl import logging
from jax.experimental import multihost_utils

# Set from a signal handler, read by the training loop; an Event is safe across threads.
_STOP_REQUESTED = threading.Event()


class Preempted(Exception):
    """A stop (SIGTERM) honoured before the training loop had a state to save: the message says
    what was kept for the next run and what it will do again."""


def install_preemption_handler(signals: tuple[int, ...] = (signal.SIGTERM,)) -> bool:
    """Makes SIGTERM (a TPU VM's preemption notice) set the flag `should_stop` reports.

    Call from the main thread, after `distributed.maybe_initialize_distributed()`. On a
    multi-process run nothing is installed: JAX's preemption service already listens for SIGTERM
    and coordinates the stop step across hosts (see `should_stop`), and a Python handler would
    replace its listener.

    Returns:
      Whether a handler was installed.
    """
    if jax.distributed.is_initialized():
        logging.info("Multi-process run: preemption is coordinated by JAX's preemption service.")
        return False

    def handler(signum, frame):
        del frame
        # Only set a flag: saving from inside a signal handler could interleave with a step.
        _STOP_REQUESTED.set()
        logging.warning("Received %s; stopping at the next step.", signal.Signals(signum).name)

    for sig in signals:
        signal.signal(sig, handler)
    return True


def should_stop(step: int | None = None) -> bool:
    """Whether the loop should save at `step` and exit (a preemption notice arrived).

    On one process this reports the flag set by `install_preemption_handler`. On a multi-process
    run it also asks `multihost_utils.reached_preemption_sync_point(step)`: when any host is
    notified, all hosts agree on a step to stop at and this returns True on every host at that
    same step. JAX requires that every host call it at every step, starting from the same step.

    Args:
      step: the current training step; needed on multi-process runs, ignored otherwise.
    """
    if _STOP_REQUESTED.is_set():
        return True
    if step is None or not jax.distributed.is_initialized():
        return False
    try:
        return multihost_utils.reached_preemption_sync_point(step)
    except RuntimeError as e:
        # Raised only when the preemption service is disabled (`jax_enable_preemption_service`).
        logging.log_first_n(
            logging.WARNING, "Preemption sync unavailable (%s); relying on SIGTERM only.", 1, e
        )
        return False
