"""Tests for rag_jax.devices.device_memory: the memory plan's arithmetic and the check before
training."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rag_jax.devices import device_memory


def test_memory_plan_arithmetic():
    params = {"w": jax.ShapeDtypeStruct((10, 20), jnp.float32), "b": np.zeros(20, np.float32)}
    opt_state = {
        "mu": jax.ShapeDtypeStruct((10, 20), jnp.float32),
        "nu": jax.ShapeDtypeStruct((10, 20), jnp.bfloat16),
        "count": np.int32(0),
    }
    # params 220 * 4 = 880; opt 200 * 4 + 200 * 2 + 4 = 1204; activations 3 * 1000 = 3000.
    plan = device_memory.memory_plan(
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

    host = device_memory.memory_plan(params, opt_state, 1000, 3, index_bytes=10_001, num_devices=8)
    assert host["index_per_device"] == 0
    assert host["index_per_host"] == 10_001
    assert host["total_per_device"] == 880 + 880 + 1204 + 3000

    text = device_memory.format_memory_plan(plan)
    assert "memory plan over 8 devices" in text and "unknown" in text
    assert "7.05 KiB" in text  # total 7215 B


def test_check_fits(caplog):
    params = {"w": np.zeros(100, np.float32)}  # 400 B
    plan = device_memory.memory_plan(
        params, {}, activation_bytes_per_example=100, per_device_batch=4
    )
    assert plan["total_per_device"] == 400 + 400 + 400

    assert device_memory.check_fits(plan, device_memory_bytes=1200)
    # 1000 B leave 200 B for activations: at most 2 examples per device.
    expected = r"needs at least 1.17 KiB.*has 1000 B; use per_device_batch <= 2\."
    with pytest.raises(ValueError, match=expected):
        device_memory.check_fits(plan, device_memory_bytes=1000)
    with pytest.raises(ValueError, match="batch-independent part does not fit"):
        device_memory.check_fits(plan, device_memory_bytes=700)

    with caplog.at_level(logging.INFO):
        assert device_memory.check_fits(plan) is False
    assert "memory check skipped" in caplog.text
