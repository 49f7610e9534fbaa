"""Tests for rag_jax.run.checkpoints: round trips, keep-N, resume, corruption, crashes,
preemption."""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rag_jax.devices import sharding
from rag_jax.run import checkpoints


def _train_state(seed=0):
    """{params, opt_state, step} after one AdamW update, so every moment is non-trivial."""
    rng = np.random.default_rng(seed)
    params = {
        "dense": {"kernel": jnp.asarray(rng.normal(size=(8, 3)), jnp.float32)},
        "embed": jnp.asarray(rng.normal(size=(5, 2)), jnp.bfloat16),
    }
    tx = optax.adamw(1e-2)
    opt_state = tx.init(params)
    grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.5, params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return {"params": params, "opt_state": opt_state, "step": jnp.int32(seed + 1)}


def _assert_bitwise_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_round_trip_is_bitwise_with_config(tmp_path):
    state = _train_state()
    config = ml_collections.ConfigDict({"model": {"n_docs": 5}, "lr": 1e-3, "name": "nq"})
    with checkpoints.Checkpointer(tmp_path) as ckpt:
        assert ckpt.save(1, state, config)
        ckpt.wait()
        restored = ckpt.restore(1, jax.eval_shape(lambda: state))
    _assert_bitwise_equal(restored, state)
    # AdamW's state comes back as optax's named tuples, so the optimizer can use it directly.
    assert type(restored["opt_state"][0]) is type(state["opt_state"][0])
    loaded = checkpoints.load_config(tmp_path)
    assert loaded.to_dict() == config.to_dict()
    assert (tmp_path / "checkpoints" / "1" / "state").is_dir()


def test_flax_train_state_round_trip_in_relative_workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # Orbax needs absolute paths; the Checkpointer makes them so.

    def init_fn():
        params = {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3)}
        return train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adamw(1e-2))

    state = init_fn().apply_gradients(grads={"w": jnp.full((2, 3), 0.5)})
    with checkpoints.Checkpointer("run") as ckpt:
        ckpt.save(int(state.step), state)
    restored, step = checkpoints.restore_or_init("run", init_fn)
    assert step == 1 and isinstance(restored, train_state.TrainState)
    assert restored.tx is not None  # Static fields come from init_fn's structure.
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert (tmp_path / "run" / "checkpoints" / "1").is_dir()


def test_reading_a_writable_workdir_warns_of_nothing(tmp_path):
    """orbax logs "Given directory is read only" whenever a manager opens for reading; every
    restore here does so on a writable workdir, so the warning is dropped."""
    state = _train_state()
    with checkpoints.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, state, ml_collections.ConfigDict({"lr": 1e-3}))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    absl = logging.getLogger("absl")
    absl.addHandler(handler)
    try:
        with checkpoints.Checkpointer(tmp_path, read_only=True) as ckpt:
            assert ckpt.all_steps() == [1]
    finally:
        absl.removeHandler(handler)
    assert not [r for r in records if "read only" in r.getMessage()], records


def test_config_to_dict_accepts_mappings_and_rejects_others():
    assert checkpoints.config_to_dict({"a": {"b": 1}}) == {"a": {"b": 1}}
    with pytest.raises(TypeError, match="got list"):
        checkpoints.config_to_dict([1, 2])


def test_load_config_errors_name_the_place(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        checkpoints.load_config(tmp_path)
    with checkpoints.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(3, _train_state())
    with pytest.raises(FileNotFoundError, match="step 3 has no config"):
        checkpoints.load_config(tmp_path)


def test_keep_n_and_save_interval(tmp_path):
    state = _train_state()
    with checkpoints.Checkpointer(tmp_path, max_to_keep=2, save_interval_steps=2) as ckpt:
        saved = [step for step in range(1, 9) if ckpt.save(step, state)]
        assert saved == [1, 2, 4, 6, 8]  # The first save of an empty directory always writes.
        assert ckpt.save(9, state, force=True)
        assert not ckpt.save(9, state, force=True)  # Already on disk: not written twice.
        ckpt.wait()
        assert ckpt.all_steps() == [8, 9]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir()) == ["8", "9"]


def test_restore_or_init_on_empty_dir_calls_init(tmp_path):
    calls = []

    def init_fn():
        calls.append(1)
        return {"w": jnp.zeros(3)}

    state, step = checkpoints.restore_or_init(tmp_path, init_fn)
    assert step is None and calls == [1]
    np.testing.assert_array_equal(state["w"], np.zeros(3))


def test_restore_or_init_resumes_latest_without_calling_init(tmp_path, caplog):
    with checkpoints.Checkpointer(tmp_path) as ckpt:
        for step in (1, 2):
            ckpt.save(step, _train_state(seed=step))

    def init_fn():
        raise AssertionError("init_fn must not run when a checkpoint exists")

    with caplog.at_level(logging.INFO):
        state, step = checkpoints.restore_or_init(
            tmp_path, init_fn, jax.eval_shape(lambda: _train_state())
        )
    assert step == 2
    _assert_bitwise_equal(state, _train_state(seed=2))
    assert "Resumed from checkpoint step 2" in caplog.text


def test_restore_into_sharded_abstract_state(tmp_path):
    if jax.device_count() != 8:
        pytest.skip(reason=f"needs 8 devices (see conftest.py); got {jax.device_count()}")
    mesh = sharding.data_mesh()
    rng = np.random.default_rng(1)
    state = {
        "table": jnp.asarray(rng.normal(size=(16, 3)), jnp.float32),
        "bias": jnp.asarray(rng.normal(size=(3,)), jnp.float32),
        "step": jnp.int32(4),
    }
    with checkpoints.Checkpointer(tmp_path) as ckpt:  # Saved from one device.
        ckpt.save(4, state)
    targets = {
        "table": NamedSharding(mesh, P("data")),
        "bias": sharding.replicated(mesh),
        "step": sharding.replicated(mesh),
    }
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, targets
    )
    restored, step = checkpoints.restore_or_init(tmp_path, lambda: None, abstract)
    assert step == 4
    for name, target in targets.items():
        arr = restored[name]
        assert arr.sharding.is_equivalent_to(target, arr.ndim), name
        np.testing.assert_array_equal(np.asarray(arr), np.asarray(state[name]))
    # Row block i of the table lives on device i only.
    for shard in restored["table"].addressable_shards:
        i = list(mesh.devices).index(shard.device)
        np.testing.assert_array_equal(shard.data, np.asarray(state["table"])[2 * i : 2 * i + 2])


# A failed read leaves orbax's other pending reads of that step unretrieved; Python reports them
# when the event loop is collected. They belong to the corrupted step, which is skipped.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_corrupted_latest_falls_back_to_previous_with_warning(tmp_path, caplog):
    with checkpoints.Checkpointer(tmp_path) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, _train_state(seed=step))
    # Truncate the array data of the newest step, as a disk-full or interrupted copy would.
    data_files = [p for p in (tmp_path / "checkpoints" / "3").rglob("*") if p.parent.name == "d"]
    assert data_files
    for path in data_files:
        path.write_bytes(b"")

    abstract = jax.eval_shape(lambda: _train_state())
    with caplog.at_level(logging.WARNING):
        state, step = checkpoints.restore_or_init(tmp_path, lambda: None, abstract)
    assert step == 2
    _assert_bitwise_equal(state, _train_state(seed=2))
    assert "step 3" in caplog.text and "unreadable" in caplog.text

    # With every step unreadable the error names the directory instead of starting afresh.
    for step_dir in ("1", "2"):
        (tmp_path / "checkpoints" / step_dir / "state" / "_METADATA").unlink()
    with pytest.raises(RuntimeError, match=rf"no readable checkpoint in {tmp_path}/checkpoints"):
        checkpoints.restore_or_init(tmp_path, lambda: None, abstract)


def test_crash_mid_save_leaves_only_a_temporary_dir_that_is_ignored(tmp_path, monkeypatch):
    # Orbax finalises a step by renaming its temporary directory; failing that rename is a crash
    # after every file was written but before the commit.
    from orbax.checkpoint._src.path import async_path

    with checkpoints.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, _train_state(seed=1))

    async def crash(*args, **kwargs):
        raise OSError("simulated crash before the commit rename")

    root = tmp_path / "checkpoints"
    with monkeypatch.context() as patch:
        patch.setattr(async_path, "rename", crash)
        ckpt = checkpoints.Checkpointer(tmp_path, async_save=False)
        try:
            with pytest.raises(OSError, match="simulated crash"):
                ckpt.save(2, _train_state(seed=2))
        finally:
            ckpt.close()
    leftovers = [p.name for p in root.iterdir() if ".orbax-checkpoint-tmp" in p.name]
    assert len(leftovers) == 1 and leftovers[0].startswith("2.")
    assert not (root / "2").exists()  # Never visible under its final name.

    state, step = checkpoints.restore_or_init(
        tmp_path, lambda: None, jax.eval_shape(lambda: _train_state())
    )
    assert step == 1
    _assert_bitwise_equal(state, _train_state(seed=1))
    # The restarted run saves step 2 again; the leftover is gone by then (a new Checkpointer
    # deletes it in the background and its first save waits for that).
    with checkpoints.Checkpointer(tmp_path) as ckpt:
        assert ckpt.save(2, _train_state(seed=2))
        ckpt.wait()
        assert ckpt.all_steps() == [1, 2]
    assert sorted(p.name for p in root.iterdir()) == ["1", "2"]


_LOOP = textwrap.dedent(
    """
    import sys, time
    import jax.numpy as jnp
    from rag_jax.devices import preemption
    from rag_jax.run import checkpoints

    workdir, max_steps = sys.argv[1], int(sys.argv[2])
    preemption.install_preemption_handler()
    ckpt = checkpoints.Checkpointer(workdir, save_interval_steps=1000)
    init_fn = lambda: {"w": jnp.zeros(3), "step": jnp.int32(0)}
    state, resumed = ckpt.restore_or_init(init_fn)
    step = resumed or 0
    print(f"resumed {resumed} w {float(state['w'][0])}", flush=True)
    while step < max_steps:
        if preemption.should_stop(step):
            ckpt.save(step, state, {"max_steps": max_steps}, force=True)
            print(f"saved {step}", flush=True)
            break
        state = {"w": state["w"] + 1, "step": state["step"] + 1}
        step += 1
        print(f"step {step}", flush=True)
        time.sleep(0.02)
    ckpt.close()
    """
)


def test_sigterm_saves_final_checkpoint_and_restart_resumes(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(_LOOP)
    workdir = tmp_path / "work"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    cmd = [sys.executable, str(script), str(workdir)]

    proc = subprocess.Popen(
        [*cmd, "100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        lines = []
        deadline = time.monotonic() + 60
        while not any(line.startswith("step 5") for line in lines):
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, "loop never reached step 5"
            lines.append(line.strip())
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-2000:]
    lines += out.splitlines()
    saved = [line for line in lines if line.startswith("saved")]
    assert len(saved) == 1, lines
    final_step = int(saved[0].split()[1])
    # The final save is at the step the loop had reached, which is past the point of the signal.
    last_step = max(int(line.split()[1]) for line in lines if line.startswith("step "))
    assert final_step == last_step >= 5
    with checkpoints.Checkpointer(workdir, read_only=True) as ckpt:
        assert ckpt.all_steps() == [final_step]
    assert checkpoints.load_config(workdir).max_steps == 100000

    rerun = subprocess.run(
        [*cmd, str(final_step + 2)], capture_output=True, text=True, env=env, timeout=60
    )
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    rerun_lines = rerun.stdout.splitlines()
    assert rerun_lines[0] == f"resumed {final_step} w {float(final_step)}"
    assert rerun_lines[1:] == [f"step {final_step + 1}", f"step {final_step + 2}"]


def test_checkpoint_dir_keeps_gs_urls_whole(monkeypatch):
    """A gs:// location reaches orbax as a gs:// path (no network: orbax is replaced)."""
    seen = {}

    class FakeManager:
        def __init__(self, directory, **kwargs):
            seen["directory"], seen["kwargs"] = directory, kwargs

    monkeypatch.setattr(checkpoints.ocp, "CheckpointManager", FakeManager)
    assert str(checkpoints.checkpoint_dir("gs://bucket/run")) == "gs://bucket/run/checkpoints"
    checkpoints.Checkpointer("gs://bucket/run/")
    assert str(seen["directory"]) == "gs://bucket/run/checkpoints"
    assert os.fspath(seen["directory"]).startswith("gs://")
    local = checkpoints.checkpoint_dir("relative/run")
    assert local.is_absolute() and str(local).endswith("relative/run/checkpoints")
