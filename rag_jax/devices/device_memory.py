"""What arrays and programs need of each device's memory, and the check before training.

`per_device_bytes` reads a pytree's placement (`rag_jax.devices.sharding`) for the bytes one
device holds;
`compiled_memory` splits a compiled program's need (XLA's memory analysis) into parts that add up;
`memory_plan` estimates a training step's need from the parameters, optimizer state, activations
and index, and `check_fits` refuses a plan over the device's limit, naming a batch that would fit.

Legend: B batch (global unless named `per_device_`), C index rows, D embedding width.
"""

import math
from typing import Any

import jax
import numpy as np
from absl import logging


def per_device_bytes(tree: Any, shardings: Any = None) -> int:
    """Bytes one device holds of a pytree: each leaf's largest shard under its sharding (the
    leaf's own, or the matching leaf of `shardings`)."""
    leaves = jax.tree.leaves(tree)
    where = [None] * len(leaves) if shardings is None else jax.tree.leaves(shardings)
    total = 0
    for leaf, place in zip(leaves, where, strict=True):
        place = place or getattr(leaf, "sharding", None)
        shape = place.shard_shape(leaf.shape) if place is not None else leaf.shape
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def compiled_memory(compiled, arguments: dict[str, int], rest: str = "other arguments") -> dict:
    """What a compiled program needs per device, from XLA's memory analysis, in parts that add up
    to `total`.

    Args:
      compiled: a `jax.stages.Compiled`.
      arguments: named parts of its arguments, bytes per device (e.g. parameters, optimizer
        state); the rest of XLA's argument bytes is reported as `rest` (the batch, small leaves,
        the padding of arrays to the device's tiles).
      rest: the name of that remainder.

    Returns:
      {name: bytes}: the named arguments, `rest`, "outputs (not donated)", "temporaries",
      "generated code" and "total" (their sum, what the device must hold at the peak).
    """
    stats = compiled.memory_analysis()
    parts = dict(arguments)
    parts[rest] = stats.argument_size_in_bytes - sum(arguments.values())
    # Outputs that reuse a donated argument's buffer (the updated train state) cost nothing more.
    parts["outputs (not donated)"] = stats.output_size_in_bytes - stats.alias_size_in_bytes
    parts["temporaries"] = stats.temp_size_in_bytes
    parts["generated code"] = stats.generated_code_size_in_bytes
    parts["total"] = sum(parts.values())
    return parts


def tree_bytes(tree: Any) -> int:
    """Bytes held by the array leaves of a pytree (arrays or `jax.ShapeDtypeStruct`s)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            total += math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
    return total


def device_memory_limit(device: jax.Device | None = None) -> int | None:
    """The memory XLA may use on `device` (default: the first local one), or None if unknown.

    Accelerators report `bytes_limit` through `memory_stats()`; the CPU backend reports nothing.
    """
    device = jax.local_devices()[0] if device is None else device
    try:
        stats = device.memory_stats()
    except (NotImplementedError, RuntimeError):
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"])


def memory_plan(
    params: Any,
    opt_state: Any,
    activation_bytes_per_example: int,
    per_device_batch: int,
    index_bytes: int = 0,
    device: jax.Device | None = None,
    *,
    index_on_device: bool = False,
    num_devices: int | None = None,
    num_local_devices: int | None = None,
) -> dict[str, Any]:
    """What one training step needs per device (and the index per host), in bytes.

    Parameters and optimizer state are replicated, so each device holds all of them, plus one
    gradient tree of the parameters' size that the step materialises. Activations scale with the
    per-device batch. A device index (`index_on_device=True`) is split evenly over all devices; a
    host index (ScaNN, exact) lives whole in every host's RAM and costs no device memory. The
    total is a lower bound: XLA's temporaries come on top.

    Args:
      params: pytree of arrays or `jax.ShapeDtypeStruct`s.
      opt_state: pytree of arrays or `jax.ShapeDtypeStruct`s.
      activation_bytes_per_example: activation memory kept for the backward pass per example.
      per_device_batch: examples per device per step (B / num_devices).
      index_bytes: bytes of the whole passage-vector index (C * D * itemsize).
      device: device whose memory limit is recorded (default: the first local device).
      index_on_device: whether the index is sharded over the devices (`DeviceIndex`).
      num_devices: devices the index is split over (default: `jax.device_count()`).
      num_local_devices: devices per host (default: `jax.local_device_count()`).

    Returns:
      A dict of ints (bytes unless named otherwise): `params`, `grads`, `opt_state`,
      `activations`, `index_per_device`, `total_per_device`, `index_per_host`,
      `per_device_batch`, `activation_bytes_per_example`, `num_devices`, and `device_memory`
      (the device's limit, None where the backend reports none).
    """
    if per_device_batch < 1:
        raise ValueError(f"per_device_batch must be >= 1; got {per_device_batch}")
    if activation_bytes_per_example < 0 or index_bytes < 0:
        raise ValueError(
            "byte counts must be >= 0; got activation_bytes_per_example="
            f"{activation_bytes_per_example}, index_bytes={index_bytes}"
        )
    num_devices = jax.device_count() if num_devices is None else num_devices
    num_local_devices = jax.local_device_count() if num_local_devices is None else num_local_devices
    params_bytes = tree_bytes(params)
    opt_bytes = tree_bytes(opt_state)
    activations = activation_bytes_per_example * per_device_batch
    if index_on_device:
        index_per_device = -(-index_bytes // num_devices)  # The largest shard, when uneven.
        index_per_host = index_per_device * num_local_devices
    else:
        index_per_device = 0
        index_per_host = index_bytes
    return {
        "params": params_bytes,
        "grads": params_bytes,
        "opt_state": opt_bytes,
        "activations": activations,
        "index_per_device": index_per_device,
        "total_per_device": 2 * params_bytes + opt_bytes + activations + index_per_device,
        "index_per_host": index_per_host,
        "per_device_batch": per_device_batch,
        "activation_bytes_per_example": activation_bytes_per_example,
        "num_devices": num_devices,
        "device_memory": device_memory_limit(device),
    }


def human_bytes(num_bytes: int) -> str:
    """`num_bytes` in GiB, MiB or KiB with two decimals (bytes below 1 KiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes} B"


def format_memory_plan(plan: dict[str, Any]) -> str:
    """A multi-line table of a `memory_plan`, for the training log."""
    limit = plan["device_memory"]
    rows = [
        ("params (replicated)", plan["params"]),
        ("gradients", plan["grads"]),
        ("optimizer state", plan["opt_state"]),
        (
            f"activations ({plan['per_device_batch']} examples x "
            f"{human_bytes(plan['activation_bytes_per_example'])})",
            plan["activations"],
        ),
        ("index shard", plan["index_per_device"]),
        ("total per device", plan["total_per_device"]),
    ]
    lines = [f"memory plan over {plan['num_devices']} devices:"]
    lines += [f"  {name:<44} {human_bytes(value):>12}" for name, value in rows]
    shown = human_bytes(limit) if limit is not None else "unknown"
    lines.append(f"  {'device memory':<44} {shown:>12}")
    lines.append(f"  {'index per host (RAM)':<44} {human_bytes(plan['index_per_host']):>12}")
    return "\n".join(lines)


def check_fits(plan: dict[str, Any], device_memory_bytes: int | None = None) -> bool:
    """Raises before training when the plan cannot fit in device memory.

    Args:
      plan: a `memory_plan`.
      device_memory_bytes: the limit to check against (default: the plan's `device_memory`).

    Returns:
      True when checked and it fits; False when no limit is known (the CPU backend reports none),
      in which case the check is skipped with a logged note.

    Raises:
      ValueError: naming the need, the limit, and the largest per-device batch that would fit.
    """
    limit = plan["device_memory"] if device_memory_bytes is None else device_memory_bytes
    if limit is None:
        logging.info("Device reports no memory limit (e.g. CPU); memory check skipped.")
        return False
    need = plan["total_per_device"]
    if need <= limit:
        return True
    fixed = need - plan["activations"]
    per_example = plan["activation_bytes_per_example"]
    if fixed >= limit:
        advice = (
            "even the batch-independent part does not fit: shard the index over devices, "
            "freeze or shrink parameters, or use a device with more memory"
        )
    else:  # Only the activations overflow, so per_example > 0.
        advice = f"use per_device_batch <= {(limit - fixed) // per_example}"
    raise ValueError(
        f"training needs at least {human_bytes(need)} per device but the device has "
        f"{human_bytes(limit)}; "
        f"{advice}.\n{format_memory_plan({**plan, 'device_memory': limit})}"
    )
