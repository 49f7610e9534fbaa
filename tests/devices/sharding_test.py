"""Tests for rag_jax.devices.sharding on 8 fake CPU devices (set up by conftest.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from rag_jax.devices import distributed, sharding

NUM_DEVICES = 8  # conftest.py's fake devices: the `mesh` fixture


def test_data_mesh_spans_all_devices(mesh):
    assert mesh.axis_names == ("data",)
    assert mesh.shape == {"data": NUM_DEVICES}
    assert list(mesh.devices) == jax.devices()


def test_data_mesh_over_given_devices():
    mesh = sharding.data_mesh(jax.devices()[:1])
    assert mesh.size == 1
    with pytest.raises(ValueError, match="empty"):
        sharding.data_mesh([])


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
    batch = distributed.shard_batch(mesh, {"x": x, "y": y})
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
