"""Checkpoints: an orbax `CheckpointManager` wrapper with restore-or-init and preemption handling.

Layout under a workdir (one directory per saved step, written by orbax)::

    <workdir>/checkpoints/<step>/state/    the training state pytree ({params, opt_state, step})
    <workdir>/checkpoints/<step>/config/   the run's config as JSON

Guarantees the trainer relies on:

- Atomic steps. On a POSIX filesystem orbax writes a step into `<step>.orbax-checkpoint-tmp-*`
  and renames it to `<step>` only once every file is written (on GCS it writes a
  `commit_success.txt` last instead). Listing and restoring only ever see finished steps; a
  leftover temporary directory from a crash is ignored and deleted when the next `Checkpointer`
  opens the directory.
- Keep-N. After each save only the newest `max_to_keep` steps remain.
- Verified. Each step stores a checksum of every array (`state_checksums`) beside the state, and
  `restore` recomputes them: a corrupted file is an error, never silently wrong parameters. A
  step without its checksums cannot be verified and is refused like a corrupted one.
- Disk full. A write that fails for lack of space raises `OSError` (`errno.ENOSPC`) saying so
  and naming the last complete step, which is left intact.
- Async. `save` returns once the arrays are copied off the devices (so the next step may donate
  or overwrite them); writing continues in the background. `wait()` blocks until it is on disk.
- Resume. `restore_or_init` restores the newest readable step into the shardings of the
  abstract state (so multi-device arrays come back sharded), falls back to older steps with a
  warning when the newest is unreadable (moving the unreadable newer steps aside to
  `<step>.unreadable-<time>`, where they no longer shadow the ones this run saves), and calls
  `init_fn` when there is none. Storage that fails for now (an I/O error, a timeout) is not an
  unreadable step: the restore stops saying so, and nothing is moved.
- Preemption. The loop polls `devices.preemption.should_stop(step)` and saves the step it
  says (the same step on every host); a warm start keeps its own loop's state in `Progress`.
- Multi-host. Every process makes the same calls (`save`, `restore_latest`, `close`): orbax
  writes each array's shards from the processes that hold them and synchronises the processes.
  The directory must be storage that every host sees: a `gs://` bucket (the URL reaches orbax
  unchanged: `checkpoint_dir("gs://b/run")` is `gs://b/run/checkpoints`) or a shared filesystem.
  A checkpoint restores onto any device layout given by the abstract state: one written by two
  processes restores in one, and the other way round.

The training loop looks like::

    preemption.install_preemption_handler()
    ckpt = Checkpointer(workdir, max_to_keep=3, save_interval_steps=1000)
    state, start = ckpt.restore_or_init(init_fn, abstract_state)
    step = start or 0
    while step < num_steps:
        if preemption.should_stop(step):
            ckpt.save(step, state, config, force=True)
            break
        state = train_step(state, batch(step))
        step += 1
        ckpt.save(step, state, config)  # Saves only every save_interval_steps.
    ckpt.close()  # Waits for the last write.
"""

import contextlib
import errno
import json
import logging as std_logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import flax.serialization
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from rag_jax.devices import preemption
from rag_jax.retrieval import files


class _ReadOnlyNotice(std_logging.Filter):
    """Drops orbax's "Given directory is read only" warning: it is logged whenever a manager is
    opened for reading, which every restore and evaluation here does on a writable workdir by
    design (`Checkpointer(read_only=True)`); a user took it for a fault."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Given directory is read only")


logging.get_absl_logger().addFilter(_ReadOnlyNotice())

CHECKPOINT_SUBDIR = "checkpoints"
_STATE = "state"
_CONFIG = "config"
_CHECKSUMS = "checksums"


def checkpoint_dir(workdir: epath.PathLike) -> epath.Path:
    """Where `Checkpointer(workdir)` keeps its step directories (absolute, as orbax requires).

    A local path is made absolute; a URL such as `gs://bucket/run` stays as it is (etils'
    `epath`, unlike `pathlib`, keeps the scheme).
    """
    path = epath.Path(workdir)
    return (path if path.is_absolute() else path.absolute()) / CHECKPOINT_SUBDIR


def config_to_dict(config: Any) -> dict[str, Any]:
    """A JSON-ready dict of a ConfigDict or a nested mapping.

    Values JSON cannot hold become strings, as `ConfigDict.to_json_best_effort` makes them.
    """
    if isinstance(config, Mapping) and not isinstance(config, ml_collections.ConfigDict):
        config = ml_collections.ConfigDict(dict(config))
    if not isinstance(config, ml_collections.ConfigDict):
        raise TypeError(f"config must be a ConfigDict or a mapping; got {type(config).__name__}")
    return json.loads(config.to_json_best_effort())


def _abstract(tree: Any) -> Any:
    """`jax.ShapeDtypeStruct`s with shardings for every leaf of `tree`.

    Leaves that carry a sharding (arrays, structs from `jax.eval_shape` of a function jitted with
    `out_shardings`) keep it; the others get the first local device, where JAX would place a
    freshly created array.
    """
    default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def to_struct(leaf):
        sharding = getattr(leaf, "sharding", None) or default
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(
                leaf.shape, leaf.dtype, sharding=sharding, weak_type=leaf.weak_type
            )
        leaf = leaf if hasattr(leaf, "dtype") else jnp.asarray(leaf)
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    return jax.tree.map(to_struct, tree)


def _leaf_checksum(x: jax.Array) -> jax.Array:
    """[2] uint32: the sum of `x`'s raw bits and their sum weighted by odd position numbers.

    Integer sums wrap modulo 2**32, so they are exact whatever the device layout or reduction
    order; any change of a single byte changes the weighted sum (an odd weight times a change
    below 2**32 is never a multiple of 2**32).
    """
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    else:
        unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
        bits = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)  # 8 bytes: [..., 2]
    position = jnp.zeros(bits.shape, jnp.uint32)
    for axis in range(bits.ndim):  # row-major position, without a reshape of a sharded array
        stride = int(np.prod(bits.shape[axis + 1 :], dtype=np.uint64) % 2**32)
        position = position + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis) * stride
    total = jnp.sum(bits, dtype=jnp.uint32)
    return jnp.stack([total, jnp.sum(bits * (2 * position + 1), dtype=jnp.uint32)])


@jax.jit
def _checksums_fn(leaves: list) -> list:
    return [_leaf_checksum(x) for x in leaves]


def state_checksums(state: Any) -> dict[str, list[int]]:
    """{leaf path: [sum, weighted sum]} of a state's arrays (see `_leaf_checksum`).

    Computed on the devices where the arrays live (one small transfer back), so it costs one
    read of the state per save; every process of a multi-host run must call it.
    """
    paths_and_leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    leaves = [jnp.asarray(leaf) for _, leaf in paths_and_leaves]
    sums = jax.device_get(_checksums_fn(leaves))
    return {
        jax.tree_util.keystr(path): [int(v) for v in value]
        for (path, _), value in zip(paths_and_leaves, sums, strict=True)
    }


class CorruptCheckpointError(ValueError):
    """A checkpoint step whose contents cannot be trusted (a checksum differs or is missing)."""


# errno values of storage that failed for now rather than of a step that is broken.
_TRANSIENT_ERRNOS = {
    errno.EIO,
    errno.EAGAIN,
    errno.EBUSY,
    errno.EINTR,
    errno.ETIMEDOUT,
    errno.ENETDOWN,
    errno.ENETUNREACH,
    errno.ECONNRESET,
    errno.ECONNREFUSED,
    errno.EHOSTUNREACH,
    errno.ESTALE,
}
# The same, as TensorStore and GCS report them.
_TRANSIENT_TEXT = ("DEADLINE_EXCEEDED", "UNAVAILABLE", "Input/output error", "timed out")


def is_transient(error: BaseException | None) -> bool:
    """Whether `error`, or one it was raised from, is storage failing for now (an I/O error, a
    timeout, an unreachable bucket) rather than a checkpoint that is broken."""
    while error is not None:
        if isinstance(error, CorruptCheckpointError):
            return False
        if isinstance(error, OSError) and error.errno in _TRANSIENT_ERRNOS:
            return True
        if isinstance(error, TimeoutError | ConnectionError):
            return True
        if any(text in str(error) for text in _TRANSIENT_TEXT):
            return True
        error = error.__cause__ or error.__context__
    return False


def _first_line(error: BaseException, limit: int = 300) -> str:
    text = str(error).strip().splitlines()
    text = text[0] if text else ""
    return f"{type(error).__name__}: {text[:limit]}"


class Checkpointer:
    """Saves and restores a training-state pytree plus the run config under a workdir.

    Args:
      workdir: the run's directory, local or `gs://...`; checkpoints go to
        `<workdir>/checkpoints`. On several hosts, storage that all of them see.
      max_to_keep: how many of the newest steps to keep (None keeps all).
      save_interval_steps: `save(step, ...)` writes only when `step` is a multiple of this, when
        the directory holds no step yet, with `force=True`, or at a multi-host preemption sync
        point.
      async_save: write in a background thread (`wait()` to block until written).
      read_only: open without creating, cleaning up or deleting anything (for inspection).
    """

    def __init__(
        self,
        workdir: epath.PathLike,
        *,
        max_to_keep: int | None = 3,
        save_interval_steps: int = 1,
        async_save: bool = True,
        read_only: bool = False,
    ):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None; got {max_to_keep}")
        if save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be >= 1; got {save_interval_steps}")
        self.directory = checkpoint_dir(workdir)
        if read_only:
            if not self.directory.exists():
                raise FileNotFoundError(f"no checkpoint directory at {self.directory}")
            options = ocp.CheckpointManagerOptions(
                read_only=True, save_interval_steps=0, create=False
            )
        else:
            options = ocp.CheckpointManagerOptions(
                save_interval_steps=save_interval_steps,
                preservation_policy=ocp.checkpoint_managers.LatestN(n=max_to_keep),
                enable_async_checkpointing=async_save,
                # A crash mid-save leaves a `<step>.orbax-checkpoint-tmp-*` directory as big as a
                # checkpoint; it is never read, so remove it rather than let crashes pile up.
                cleanup_tmp_directories=True,
                create=True,
            )
        self._manager = ocp.CheckpointManager(
            self.directory, item_names=(_STATE, _CONFIG, _CHECKSUMS), options=options
        )
        self._read_only = read_only
        self._writing: int | None = None  # the step of the last save started

    def all_steps(self) -> list[int]:
        """Finished steps on disk, ascending."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest finished step, or None when there is none."""
        return self._manager.latest_step()

    def save(self, step: int, state: Any, config: Any = None, *, force: bool = False) -> bool:
        """Saves `state` (and `config` as JSON) as `step` when the save interval says so.

        Args:
          step: the training step the state is at (number of updates applied).
          state: pytree of arrays, e.g. a `TrainState` with params, opt_state and step.
          config: optional ConfigDict or mapping, stored as JSON beside the state.
          force: save regardless of `save_interval_steps` (final or preemption saves).

        Returns:
          Whether a save was started. A step that is already on disk is not written again
          (e.g. a preemption right after resuming from it).

        Raises:
          OSError: `errno.ENOSPC` when the disk is full (this save's or the previous one's).
        """
        if step in self._manager.all_steps():
            logging.info(
                "Checkpoint step %d already exists in %s; not saving.", step, self.directory
            )
            return False
        if not force and not self._manager.should_save(step):
            return False
        self.wait()  # The previous save's errors are its own (orbax would wait here anyway).
        items = {_STATE: ocp.args.StandardSave(state)}
        if config is not None:
            items[_CONFIG] = ocp.args.JsonSave(config_to_dict(config))
        self._writing = step
        with self._disk_full_names():
            items[_CHECKSUMS] = ocp.args.JsonSave(state_checksums(state))
            # Decided above; orbax's own decision would ask the preemption service again.
            saved = self._manager.save(step, args=ocp.args.Composite(**items), force=True)
        if saved:
            logging.info("Saving checkpoint step %d to %s.", step, self.directory)
        return saved

    @contextlib.contextmanager
    def _disk_full_names(self):
        """Turns a failed write for lack of space into an `OSError` that says so."""
        try:
            yield
        except Exception as e:
            if not files.is_disk_full(e):
                raise
            steps = [int(p.name) for p in self.directory.iterdir() if p.name.isdigit()]
            kept = f"step {max(steps)}" if steps else "none"
            raise OSError(
                errno.ENOSPC,
                f"disk full while writing checkpoint step {self._writing} to {self.directory} "
                f"({_first_line(e)}); the last complete checkpoint ({kept}) is intact: free "
                "space and restart to resume from it",
            ) from e

    def wait(self) -> None:
        """Blocks until every started save is on disk; raises if a background write failed."""
        with self._disk_full_names():
            self._manager.wait_until_finished()

    def restore(self, step: int, abstract_state: Any) -> Any:
        """Restores `step` into the structure, dtypes and shardings of `abstract_state`.

        Args:
          step: a step in `all_steps()`.
          abstract_state: pytree of `jax.ShapeDtypeStruct`s (e.g. `jax.eval_shape(init_fn)`) or
            of arrays; a leaf's sharding, where it has one, is where the restored array goes.

        Returns:
          The state, a pytree of `jax.Array`s with the structure of `abstract_state`.

        Raises:
          ValueError: naming the step and array when an array differs from its stored checksum.
        """
        if not (epath.Path(self._manager.directory) / str(step) / _CHECKSUMS).exists():
            # Without its checksums a step cannot be verified: damaged or partial, it would
            # restore silently wrong parameters.
            raise CorruptCheckpointError(
                f"checkpoint step {step} in {self.directory} has no {_CHECKSUMS} item, so its "
                "arrays cannot be verified (a damaged or partly deleted step); refusing it"
            )
        items = {
            _STATE: ocp.args.StandardRestore(_abstract(abstract_state)),
            _CHECKSUMS: ocp.args.JsonRestore(),
        }
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        actual = state_checksums(restored[_STATE])
        for path, expected in restored[_CHECKSUMS].items():
            if actual.get(path) != expected:
                raise CorruptCheckpointError(
                    f"checkpoint step {step} in {self.directory}: array {path} does not "
                    "match its stored checksum (the files are corrupted)"
                )
        return restored[_STATE]

    def restore_latest(self, abstract_state: Any) -> tuple[Any, int] | None:
        """Restores the newest readable step, falling back to older ones.

        Every process of a multi-host run must call this. The fallback assumes that all of them
        see the same files (a shared filesystem or bucket), so that they agree on the step.

        Returns:
          `(state, step)`, or None when the directory holds no finished step.

        Raises:
          RuntimeError: naming the directory and each step's error when no step can be read.
        """
        self._manager.reload()  # Another process (a previous run) may have written steps.
        steps = self.all_steps()
        errors = []
        for step in reversed(steps):
            try:
                state = self.restore(step, abstract_state)
            except Exception as e:  # A step that cannot be read: an older one may be.
                if is_transient(e):
                    # The storage failed, not the step: falling back would redo the steps since
                    # and leave the newer step to shadow the saves that redo them.
                    raise RuntimeError(
                        f"checkpoint step {step} in {self.directory} could not be read now "
                        f"({_first_line(e)}): the storage failed, which may pass; nothing was "
                        "moved or deleted, start again to resume from it"
                    ) from e
                errors.append(f"step {step}: {_first_line(e)}")
                logging.warning(
                    "Checkpoint step %d in %s is unreadable (%s); trying the previous step.",
                    step,
                    self.directory,
                    _first_line(e),
                )
                continue
            unreadable = [s for s in steps if s > step]
            if unreadable and not self._read_only:
                # Left in place they would shadow this run's saves of the same steps; moved aside
                # (not deleted), the files stay for a look.
                for bad in unreadable:
                    moved = self._quarantine(bad)
                    logging.warning("Unreadable checkpoint step %d moved to %s.", bad, moved)
            return state, step
        if steps:
            raise RuntimeError(
                f"no readable checkpoint in {self.directory} (steps {steps}); errors:\n  "
                + "\n  ".join(errors)
            )
        return None

    def _quarantine(self, step: int) -> epath.Path:
        """Renames an unreadable step's directory out of the steps orbax lists."""
        source = epath.Path(self._manager.directory) / str(step)
        target = source.parent / f"{step}.unreadable-{time.strftime('%Y%m%dT%H%M%S')}"
        source.rename(target)
        self._manager.reload()
        return target

    def restore_or_init(
        self, init_fn: Callable[[], Any], abstract_state: Any = None
    ) -> tuple[Any, int | None]:
        """Resumes from the newest readable checkpoint, or starts fresh with `init_fn()`.

        Args:
          init_fn: builds the initial state; called only when there is no checkpoint.
          abstract_state: the target structure and shardings; defaults to
            `jax.eval_shape(init_fn)` (jit `init_fn` with `out_shardings` to get sharded arrays).

        Returns:
          `(state, step)` where `step` is the restored step, or None after `init_fn()`.
        """
        self._manager.reload()
        if not self._manager.all_steps():
            logging.info("No checkpoint in %s; initialising a new state.", self.directory)
            return init_fn(), None
        if abstract_state is None:
            abstract_state = jax.eval_shape(init_fn)  # Traces init_fn; computes nothing.
        state, step = self.restore_latest(abstract_state)
        logging.info("Resumed from checkpoint step %d in %s.", step, self.directory)
        return state, step

    def load_config(self, step: int | None = None) -> ml_collections.ConfigDict:
        """The config saved with `step` (default: the newest step).

        Raises:
          FileNotFoundError: naming the directory when there is no step or the step has no config.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        config_path = epath.Path(self._manager.directory) / str(step) / _CONFIG
        if not config_path.exists():
            raise FileNotFoundError(f"checkpoint step {step} has no config at {config_path}")
        restored = self._manager.restore(
            step, args=ocp.args.Composite(**{_CONFIG: ocp.args.JsonRestore()})
        )
        return ml_collections.ConfigDict(restored[_CONFIG])

    def close(self) -> None:
        """Waits for pending saves and releases the manager's threads."""
        with self._disk_full_names():
            self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def restore_or_init(
    workdir: epath.PathLike, init_fn: Callable[[], Any], abstract_state: Any = None
) -> tuple[Any, int | None]:
    """`Checkpointer(workdir).restore_or_init(init_fn, abstract_state)`, closing it after."""
    with Checkpointer(workdir) as checkpointer:
        return checkpointer.restore_or_init(init_fn, abstract_state)


def load_config(workdir: epath.PathLike, step: int | None = None) -> ml_collections.ConfigDict:
    """The config saved with `step` (default: the newest) of the run in `workdir`."""
    with Checkpointer(workdir, read_only=True) as checkpointer:
        return checkpointer.load_config(step)


# A warm start's progress is also saved this often (seconds), not only when it is stopped.
PROGRESS_SAVE_EVERY_S = 600.0


class Progress:
    """Where a resumable loop before the training loop (a warm start) keeps its state when it is
    stopped midway, and finds it again: `<path>`, a msgpack of the loop's state, written
    atomically by process 0.

    The loop calls `load(state)` before its first step (the saved state, or None) and
    `stop_if_requested(state, step, total)` before each step; it raises `preemption.Preempted`
    after saving when a stop was requested. It also saves, without stopping, once `save_every_s`
    seconds have passed since the last save (or the loop's start), so a process killed without
    a signal it can catch (SIGKILL, a lost machine) loses at most that much work. A loop whose
    batches are functions of `(seed, step)` then ends bitwise where an uninterrupted one ends.
    """

    def __init__(self, path, label: str, save_every_s: float | None = None):
        self.path, self.label = epath.Path(path), label
        self.save_every_s = PROGRESS_SAVE_EVERY_S if save_every_s is None else float(save_every_s)
        self._saved = time.monotonic()

    def load(self, template):
        """The saved state, structured like `template` (on the devices), or None."""
        if not self.path.exists():
            return None
        try:
            value = flax.serialization.from_bytes(jax.device_get(template), self.path.read_bytes())
        except Exception as e:  # msgpack/structure errors name neither the file nor the cause
            raise ValueError(
                f"{self.path}: the saved progress of the {self.label} is unreadable ({e}); "
                "delete it to start the warm start over"
            ) from e
        print(f"{self.label}: resuming at step {int(value.step)} from {self.path}", flush=True)
        return jax.tree.map(jnp.asarray, value)

    def stop_if_requested(self, state, step: int, total: int) -> None:
        """Before step `step` of `total`, with the loop's `state`: saves it and raises
        `preemption.Preempted` when a stop was requested, saves it when `save_every_s` have
        passed since the last save, else does nothing."""
        if not preemption.should_stop():
            if time.monotonic() - self._saved >= self.save_every_s:
                self._save(state)
            return
        self._save(state)
        raise preemption.Preempted(
            f"stopped during the {self.label} at step {step} of {total}: its progress is saved in "
            f"{self.path}, and the next run resumes it there"
        )

    def _save(self, state) -> None:
        """`state` (the loop's before its next step) to `path`, atomically, by process 0."""
        if jax.process_index() == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            files.write_atomic(self.path, flax.serialization.to_bytes(jax.device_get(state)))
        self._saved = time.monotonic()

    def clear(self) -> None:
        if jax.process_index() == 0 and self.path.exists():
            self.path.unlink()
