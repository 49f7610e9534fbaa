"""Tests for rag_jax.devices.distributed in one process, on 8 fake CPU devices (set up by
conftest.py): start-up detection, the process block a mesh implies, and every host helper's
one-process case.
Two processes standing in for two hosts are tests/devices/multihost_test.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rag_jax.devices import distributed, sharding

NUM_DEVICES = 8  # conftest.py's fake devices: the `mesh` fixture


def test_shard_batch_places_contiguous_rows_on_each_device(mesh):
    # B=16 rows over 8 devices: device i must hold rows [2i, 2i + 2).
    x = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    y = np.arange(16, dtype=np.int32) * 10
    batch = distributed.shard_batch(mesh, {"x": x, "y": y})
    for name, local in (("x", x), ("y", y)):
        arr = batch[name]
        assert arr.shape == local.shape and arr.dtype == local.dtype
        assert arr.sharding.is_equivalent_to(sharding.batch_sharded(mesh), arr.ndim)
        by_device = {shard.device: shard for shard in arr.addressable_shards}
        for i, device in enumerate(mesh.devices):
            np.testing.assert_array_equal(by_device[device].data, local[2 * i : 2 * i + 2])
        np.testing.assert_array_equal(np.asarray(arr), local)


def test_shard_batch_rejects_bad_batches(mesh):
    with pytest.raises(ValueError, match="global batch 12 is not divisible by 8 devices; use 8 or"):
        distributed.shard_batch(mesh, {"x": np.zeros((12, 2))})
    with pytest.raises(ValueError, match=r"disagree.*'x'.*16.*'y'.*8"):
        distributed.shard_batch(mesh, {"x": np.zeros((16, 2)), "y": np.zeros(8)})
    with pytest.raises(ValueError, match=r"\['s'\] is a scalar"):
        distributed.shard_batch(mesh, {"s": np.float32(1.0)})


@pytest.fixture
def init_calls(monkeypatch):
    """Records jax.distributed.initialize calls in a clean (single-host) environment."""
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs or 1))
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: bool(calls))
    names = (
        distributed._COORDINATOR_VARS
        + distributed._WORKER_LIST_VARS
        + distributed._PROCESS_COUNT_VARS
    )
    names += ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
    for var in names:
        monkeypatch.delenv(var, raising=False)
    return calls


def test_maybe_initialize_distributed_is_noop_on_one_host(init_calls, monkeypatch):
    assert distributed.maybe_initialize_distributed() is False
    # A single-task SLURM job or a one-worker TPU host list is still one host.
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "localhost")
    assert distributed.maybe_initialize_distributed() is False
    assert init_calls == []
    assert distributed.maybe_initialize_distributed(force=True) is True
    assert init_calls == [1]


@pytest.mark.parametrize(
    "var, value",
    [
        ("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234"),
        ("TPU_WORKER_HOSTNAMES", "w0,w1"),
        ("SLURM_NTASKS", "4"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
    ],
)
def test_maybe_initialize_distributed_detects_multi_host(init_calls, monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    assert distributed.maybe_initialize_distributed() is True
    assert distributed.maybe_initialize_distributed() is True  # Idempotent: initialises once.
    assert init_calls == [1]


def test_maybe_initialize_distributed_passes_explicit_settings(init_calls, monkeypatch):
    address = "127.0.0.1:4321"
    assert distributed.maybe_initialize_distributed(
        coordinator_address=address, num_processes=2, process_id=1
    )
    assert init_calls == [{"coordinator_address": address, "num_processes": 2, "process_id": 1}]


def test_maybe_initialize_distributed_reads_process_count_and_id(init_calls, monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")  # JAX reads this one itself
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    assert distributed.maybe_initialize_distributed() is True
    assert init_calls == [{"num_processes": 4, "process_id": 3}]


def test_maybe_initialize_distributed_rejects_bad_process_id(init_calls, monkeypatch):
    monkeypatch.setenv("JAX_PROCESS_ID", "first")
    with pytest.raises(ValueError, match=r"JAX_PROCESS_ID='first' must be a non-negative integer"):
        distributed.maybe_initialize_distributed()
    assert init_calls == []


class _FakeDevice:
    def __init__(self, process_index):
        self.process_index = process_index


class _FakeMesh:
    """Only what `process_block` reads: the device array (its process indices) and the shape."""

    def __init__(self, owners):
        self.devices = np.array([_FakeDevice(p) for p in owners], dtype=object)
        self.shape = {"data": len(owners)}


@pytest.mark.parametrize(
    "owners, block",
    [([0, 0, 1, 1], (0, 2)), ([1, 1, 0, 0], (1, 2)), ([2, 0, 1], (1, 3))],
)
def test_process_block_reads_the_mesh_order(owners, block):
    # This process is process 0 (a single-process test run).
    assert distributed.process_block(_FakeMesh(owners)) == block


@pytest.mark.parametrize(
    "owners, message",
    [
        ([0, 1, 0, 1], "adjacent on the mesh"),
        ([0, 0, 0, 1], "equal in number"),
        ([1, 1, 2, 2], "process 0 has no device in the mesh"),
    ],
)
def test_process_block_errors(owners, message):
    with pytest.raises(ValueError, match=message):
        distributed.process_block(_FakeMesh(owners))


def test_single_process_host_helpers(mesh):
    x = np.arange(16 * 2, dtype=np.float32).reshape(16, 2)
    batch = distributed.shard_batch(mesh, x)
    assert distributed.process_block(mesh) == (0, 1)
    np.testing.assert_array_equal(distributed.local_rows(batch), x)
    gathered = distributed.gather_to_host({"x": batch, "s": jnp.float32(2.0)})
    np.testing.assert_array_equal(gathered["x"], x)
    assert isinstance(gathered["x"], np.ndarray) and gathered["s"] == 2.0
    assert distributed.sum_over_processes({"a": (1.5, 2)}) == {"a": (1.5, 2)}
    assert distributed.from_process0(True) is True
    # A replicated result (e.g. in-step search ids): one process owns every row.
    np.testing.assert_array_equal(distributed.own_rows(sharding.replicate(mesh, x), mesh), x)
    with pytest.raises(ValueError, match="needs a replicated array"):
        distributed.own_rows(batch, mesh)
