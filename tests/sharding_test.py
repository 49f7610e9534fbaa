"""Tests for rag_jax.sharding on 8 fake CPU devices (set up by conftest.py)."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from rag_jax import sharding

NUM_DEVICES = 8


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count() != NUM_DEVICES:
        pytest.skip(
            reason=f"needs {NUM_DEVICES} devices (see conftest.py); got {jax.device_count()}"
        )
    return sharding.data_mesh()


def test_data_mesh_spans_all_devices(mesh):
    assert mesh.axis_names == ("data",)
    assert mesh.shape == {"data": NUM_DEVICES}
    assert list(mesh.devices) == jax.devices()


def test_data_mesh_over_given_devices():
    mesh = sharding.data_mesh(jax.devices()[:1])
    assert mesh.size == 1
    with pytest.raises(ValueError, match="empty"):
        sharding.data_mesh([])


def test_shard_batch_places_contiguous_rows_on_each_device(mesh):
    # B=16 rows over 8 devices: device i must hold rows [2i, 2i + 2).
    x = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    y = np.arange(16, dtype=np.int32) * 10
    batch = sharding.shard_batch(mesh, {"x": x, "y": y})
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
        sharding.shard_batch(mesh, {"x": np.zeros((12, 2))})
    with pytest.raises(ValueError, match=r"disagree.*'x'.*16.*'y'.*8"):
        sharding.shard_batch(mesh, {"x": np.zeros((16, 2)), "y": np.zeros(8)})
    with pytest.raises(ValueError, match=r"\['s'\] is a scalar"):
        sharding.shard_batch(mesh, {"s": np.float32(1.0)})


def test_check_batch_divisible_messages():
    sharding.check_batch_divisible(16, 8)
    expected = "^global batch 12 is not divisible by 8 devices; use 8 or 16 "
    with pytest.raises(ValueError, match=expected):
        sharding.check_batch_divisible(12, 8)
    # Below the device count only the next multiple is a valid suggestion.
    with pytest.raises(ValueError, match="global batch 3 is not divisible by 8 devices; use 8 "):
        sharding.check_batch_divisible(3, 8)
    with pytest.raises(ValueError, match="^config.batch 0 is not divisible by 4 devices; use 4 "):
        sharding.check_batch_divisible(0, 4, what="config.batch")


def test_replicate_puts_whole_array_on_every_device(mesh):
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = sharding.replicate(mesh, {"w": w})["w"]
    assert len(out.addressable_shards) == NUM_DEVICES
    for shard in out.addressable_shards:
        np.testing.assert_array_equal(shard.data, w)


def _loss_fn(params, batch):
    pred = batch["x"] @ params["w"] + params["b"]  # -> [B]
    return jnp.mean((pred - batch["y"]) ** 2)


def _sgd_step(params, batch):
    loss, grads = jax.value_and_grad(_loss_fn)(params, batch)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss, grads


def test_data_parallel_step_equals_single_device(mesh):
    rng = np.random.default_rng(0)
    b, d = 16, 3
    x = rng.normal(size=(b, d)).astype(np.float32)
    y = rng.normal(size=(b,)).astype(np.float32)
    params = {"w": rng.normal(size=(d,)).astype(np.float32), "b": np.float32(0.5)}

    one_device = jax.devices()[0]
    single = jax.jit(_sgd_step)(
        jax.device_put(params, one_device), jax.device_put({"x": x, "y": y}, one_device)
    )

    step = jax.jit(
        _sgd_step,
        in_shardings=(sharding.replicated(mesh), sharding.batch_sharded(mesh)),
        out_shardings=sharding.replicated(mesh),
    )
    batch = sharding.shard_batch(mesh, {"x": x, "y": y})
    assert len({s.index[0].start for s in batch["x"].addressable_shards}) == NUM_DEVICES
    multi = step(sharding.replicate(mesh, params), batch)

    for got, want in zip(jax.tree.leaves(multi), jax.tree.leaves(single)):
        assert got.sharding.is_equivalent_to(sharding.replicated(mesh), got.ndim)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)

    # Independent reference for the gradient averaged over the whole batch (not per shard).
    resid = x @ params["w"] + params["b"] - y
    np.testing.assert_allclose(np.asarray(multi[2]["w"]), 2 * x.T @ resid / b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(multi[2]["b"]), 2 * resid.mean(), rtol=1e-5, atol=1e-5)


def test_per_device_rng_distinct_and_reproducible(mesh):
    rng = jax.random.key(42)
    step = 7

    @jax.jit
    def draw(rng, step):
        def per_shard(rng, step):
            return jax.random.key_data(sharding.per_device_rng(rng, step))[None]  # -> [1, 2]

        return jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), P()), out_specs=P("data"))(
            rng, step
        )

    got = np.asarray(draw(rng, jnp.int32(step)))  # -> [8, 2]
    assert len({tuple(row) for row in got}) == NUM_DEVICES
    step_rng = jax.random.fold_in(rng, step)
    want = np.stack(
        [jax.random.key_data(jax.random.fold_in(step_rng, i)) for i in range(NUM_DEVICES)]
    )
    np.testing.assert_array_equal(got, want)
    # Another step gives other keys on every device.
    other = np.asarray(draw(rng, jnp.int32(step + 1)))
    assert not np.any(np.all(other == got, axis=1))


def test_memory_plan_arithmetic():
    params = {"w": jax.ShapeDtypeStruct((10, 20), jnp.float32), "b": np.zeros(20, np.float32)}
    opt_state = {
        "mu": jax.ShapeDtypeStruct((10, 20), jnp.float32),
        "nu": jax.ShapeDtypeStruct((10, 20), jnp.bfloat16),
        "count": np.int32(0),
    }
    # params 220 * 4 = 880; opt 200 * 4 + 200 * 2 + 4 = 1204; activations 3 * 1000 = 3000.
    plan = sharding.memory_plan(
        params,
        opt_state,
        activation_bytes_per_example=1000,
        per_device_batch=3,
        index_bytes=10_001,
        index_on_device=True,
        num_devices=8,
        num_local_devices=4,
    )
    assert plan["params"] == 880
    assert plan["grads"] == 880
    assert plan["opt_state"] == 1204
    assert plan["activations"] == 3000
    assert plan["index_per_device"] == 1251  # ceil(10001 / 8)
    assert plan["index_per_host"] == 1251 * 4
    assert plan["total_per_device"] == 880 + 880 + 1204 + 3000 + 1251
    assert plan["device_memory"] is None  # The CPU backend reports no limit.

    host = sharding.memory_plan(params, opt_state, 1000, 3, index_bytes=10_001, num_devices=8)
    assert host["index_per_device"] == 0
    assert host["index_per_host"] == 10_001
    assert host["total_per_device"] == 880 + 880 + 1204 + 3000

    text = sharding.format_memory_plan(plan)
    assert "memory plan over 8 devices" in text and "unknown" in text
    assert "7.05 KiB" in text  # total 7215 B


def test_check_fits(caplog):
    params = {"w": np.zeros(100, np.float32)}  # 400 B
    plan = sharding.memory_plan(params, {}, activation_bytes_per_example=100, per_device_batch=4)
    assert plan["total_per_device"] == 400 + 400 + 400

    assert sharding.check_fits(plan, device_memory_bytes=1200)
    # 1000 B leave 200 B for activations: at most 2 examples per device.
    expected = r"needs at least 1.17 KiB.*has 1000 B; use per_device_batch <= 2\."
    with pytest.raises(ValueError, match=expected):
        sharding.check_fits(plan, device_memory_bytes=1000)
    with pytest.raises(ValueError, match="batch-independent part does not fit"):
        sharding.check_fits(plan, device_memory_bytes=700)

    with caplog.at_level(logging.INFO):
        assert sharding.check_fits(plan) is False
    assert "memory check skipped" in caplog.text


@pytest.fixture
def init_calls(monkeypatch):
    """Records jax.distributed.initialize calls in a clean (single-host) environment."""
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs or 1))
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: bool(calls))
    names = sharding._COORDINATOR_VARS + sharding._WORKER_LIST_VARS + sharding._PROCESS_COUNT_VARS
    names += ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
    for var in names:
        monkeypatch.delenv(var, raising=False)
    return calls


def test_maybe_initialize_distributed_is_noop_on_one_host(init_calls, monkeypatch):
    assert sharding.maybe_initialize_distributed() is False
    # A single-task SLURM job or a one-worker TPU host list is still one host.
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "localhost")
    assert sharding.maybe_initialize_distributed() is False
    assert init_calls == []
    assert sharding.maybe_initialize_distributed(force=True) is True
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
    assert sharding.maybe_initialize_distributed() is True
    assert sharding.maybe_initialize_distributed() is True  # Idempotent: initialises once.
    assert init_calls == [1]


def test_maybe_initialize_distributed_passes_explicit_settings(init_calls, monkeypatch):
    address = "127.0.0.1:4321"
    assert sharding.maybe_initialize_distributed(
        coordinator_address=address, num_processes=2, process_id=1
    )
    assert init_calls == [{"coordinator_address": address, "num_processes": 2, "process_id": 1}]


def test_maybe_initialize_distributed_reads_process_count_and_id(init_calls, monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")  # JAX reads this one itself
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    assert sharding.maybe_initialize_distributed() is True
    assert init_calls == [{"num_processes": 4, "process_id": 3}]


def test_maybe_initialize_distributed_rejects_bad_process_id(init_calls, monkeypatch):
    monkeypatch.setenv("JAX_PROCESS_ID", "first")
    with pytest.raises(ValueError, match=r"JAX_PROCESS_ID='first' must be a non-negative integer"):
        sharding.maybe_initialize_distributed()
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
    assert sharding.process_block(_FakeMesh(owners)) == block


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
        sharding.process_block(_FakeMesh(owners))


def test_single_process_host_helpers(mesh):
    x = np.arange(16 * 2, dtype=np.float32).reshape(16, 2)
    batch = sharding.shard_batch(mesh, x)
    assert sharding.process_block(mesh) == (0, 1)
    np.testing.assert_array_equal(sharding.local_rows(batch), x)
    gathered = sharding.gather_to_host({"x": batch, "s": jnp.float32(2.0)})
    np.testing.assert_array_equal(gathered["x"], x)
    assert isinstance(gathered["x"], np.ndarray) and gathered["s"] == 2.0
    assert sharding.sum_over_processes({"a": (1.5, 2)}) == {"a": (1.5, 2)}
    assert sharding.from_process0(True) is True
    # A replicated result (e.g. in-step search ids): one process owns every row.
    np.testing.assert_array_equal(sharding.own_rows(sharding.replicate(mesh, x), mesh), x)
    with pytest.raises(ValueError, match="needs a replicated array"):
        sharding.own_rows(batch, mesh)
