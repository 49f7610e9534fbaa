"""Data parallelism over a device mesh: multi-host start-up, mesh, batch placement, memory plan.

One mesh axis, `data`, spans every device of every process. Parameters and optimizer state are
replicated over it, batches are split over it along their leading (batch) dimension, and a jitted
step over such inputs averages gradients across devices by itself (XLA inserts the all-reduce that
`pmean` made explicit under `pmap`). Code that must see its own device's shard (per-shard index
search, per-device dropout keys) runs under `jax.shard_map` over the same axis.

The same code runs on 1 CPU device, on 8 fake CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`), on a TPU VM, and on a multi-host pod,
where each process feeds only its own rows (`shard_batch`) after `maybe_initialize_distributed()`.

Legend: B batch (global unless named `local_` or `per_device_`), D embedding width.
"""

import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"

# Environment variables whose presence means this process is one of several launched together.
# They are read directly (rather than through JAX's cluster auto-detection) because detection
# of a Cloud TPU queries the metadata server, which hangs for a while on machines without one.
_COORDINATOR_VARS = ("JAX_COORDINATOR_ADDRESS", "MEGASCALE_COORDINATOR_ADDRESS")
_WORKER_LIST_VARS = ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES")
_PROCESS_COUNT_VARS = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


def _multi_process_env() -> str | None:
    """Names the environment variable that announces a multi-process run, or None."""
    for var in _COORDINATOR_VARS:
        if os.environ.get(var):
            return var
    for var in _WORKER_LIST_VARS:
        hosts = [h for h in os.environ.get(var, "").split(",") if h.strip()]
        if len(hosts) > 1:
            return var
    for var in _PROCESS_COUNT_VARS:
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 1:
            return var
    return None


def maybe_initialize_distributed(force: bool = False) -> bool:
    """Connects this process to the others of a multi-host run; a no-op on one host.

    Must run before anything touches a JAX backend (creating an array, `jax.devices()`), because
    `jax.distributed.initialize` can only configure backends that do not exist yet. Safe to call
    more than once. A multi-host run is recognised by `JAX_COORDINATOR_ADDRESS` /
    `MEGASCALE_COORDINATOR_ADDRESS`, by `TPU_PROCESS_ADDRESSES` / `TPU_WORKER_HOSTNAMES` listing
    several hosts, or by `SLURM_NTASKS` / `OMPI_COMM_WORLD_SIZE` above 1. On a Cloud TPU pod
    whose environment carries none of these, pass `force=True` on every worker: JAX then finds
    the coordinator itself (from the TPU metadata server).

    Args:
      force: initialise even when no multi-host environment variable is set.

    Returns:
      True when this process is (now or already) part of a distributed run.
    """
    if jax.distributed.is_initialized():
        return True
    reason = "force=True" if force else _multi_process_env()
    if reason is None:
        return False
    logging.info("Initialising jax.distributed (multi-host run detected by %s).", reason)
    jax.distributed.initialize()
    return True


def data_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh with axis `data` over `devices` (default: all devices of all processes).

    The mesh is built directly (not with `jax.make_mesh`, whose axes now default to the explicit
    type) so that sharding stays automatic: jit propagates it and inserts the collectives.
    """
    devices = jax.devices() if devices is None else list(devices)
    if not devices:
        raise ValueError("data_mesh needs at least one device; got an empty list")
    return Mesh(np.array(devices), (DATA_AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array (parameters, optimizer state, scalars)."""
    return NamedSharding(mesh, P())


def batch_sharded(mesh: Mesh) -> NamedSharding:
    """The leading (batch) dimension is split over `data`; other dimensions are whole."""
    return NamedSharding(mesh, P(DATA_AXIS))


def check_batch_divisible(batch_size: int, num_devices: int, what: str = "global batch") -> None:
    """Raises unless `batch_size` splits evenly over `num_devices`, suggesting sizes that would.

    Args:
      batch_size: number of examples (B) to split.
      num_devices: number of shards (devices, or processes for a per-host check).
      what: how the error names `batch_size` (e.g. "global batch", "config.train.batch_size").

    Raises:
      ValueError: e.g. "global batch 12 is not divisible by 8 devices; use 8 or 16".
    """
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1; got {num_devices}")
    if batch_size >= 1 and batch_size % num_devices == 0:
        return
    lower = (max(batch_size, 0) // num_devices) * num_devices
    upper = lower + num_devices
    use = f"{lower} or {upper}" if lower > 0 else f"{upper}"
    raise ValueError(
        f"{what} {batch_size} is not divisible by {num_devices} devices; use {use} "
        f"(a positive multiple of {num_devices})"
    )


def shard_batch(mesh: Mesh, local_batch: Any) -> Any:
    """Assembles each process's rows into global arrays split over `data`.

    Every process calls this with its own rows; on one host that is the whole batch. Rows keep
    their order: with P processes, process p's rows occupy global rows
    `[p * local_B, (p + 1) * local_B)` and device i of the mesh receives the i-th contiguous
    slice of `B / num_devices` rows.

    Args:
      mesh: the `data` mesh (see `data_mesh`).
      local_batch: pytree of numpy arrays, each `[local_B, ...]` with the same `local_B`.

    Returns:
      The same pytree of `jax.Array`s, each `[local_B * process_count, ...]`, sharded as
      `batch_sharded(mesh)`.

    Raises:
      ValueError: naming the leaf whose leading dimension is missing or differs, or when the
        global batch does not divide by the number of devices.
    """
    leaves = jax.tree_util.tree_leaves_with_path(local_batch)
    if not leaves:
        raise ValueError("shard_batch got an empty batch (a pytree without arrays)")
    sizes = {}
    for path, leaf in leaves:
        shape = np.shape(leaf)
        if not shape:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path)} is a scalar; every leaf needs a "
                "leading batch dimension"
            )
        sizes[jax.tree_util.keystr(path)] = shape[0]
    if len(set(sizes.values())) > 1:
        raise ValueError(f"batch leaves disagree on the leading (batch) dimension: {sizes}")
    local_rows = next(iter(sizes.values()))
    num_processes = jax.process_count()
    check_batch_divisible(local_rows * num_processes, mesh.size)
    sharding = batch_sharded(mesh)

    def put(leaf):
        leaf = np.asarray(leaf)
        global_shape = (leaf.shape[0] * num_processes, *leaf.shape[1:])
        return jax.make_array_from_process_local_data(sharding, leaf, global_shape)

    return jax.tree.map(put, local_batch)


def replicate(mesh: Mesh, tree: Any) -> Any:
    """Places a pytree (numpy or jax arrays, identical on every process) on every device."""
    return jax.device_put(tree, replicated(mesh))


def per_device_rng(rng: jax.Array, step: int | jax.Array) -> jax.Array:
    """A key that differs per step and per device; call it inside `jax.shard_map` over `data`.

    Folding in the step makes resumed runs draw the same numbers without any saved RNG state;
    folding in the device's position on `data` gives each shard its own dropout masks instead of
    the same mask repeated on every device.

    Args:
      rng: a key replicated over the mesh (e.g. the run's dropout key).
      step: the training step, int or int32 scalar.

    Returns:
      `fold_in(fold_in(rng, step), axis_index("data"))`, of the same key type as `rng`.
    """
    step_rng = jax.random.fold_in(rng, step)
    return jax.random.fold_in(step_rng, jax.lax.axis_index(DATA_AXIS))


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


def _human(num_bytes: int) -> str:
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
            f"{_human(plan['activation_bytes_per_example'])})",
            plan["activations"],
        ),
        ("index shard", plan["index_per_device"]),
        ("total per device", plan["total_per_device"]),
    ]
    lines = [f"memory plan over {plan['num_devices']} devices:"]
    lines += [f"  {name:<44} {_human(value):>12}" for name, value in rows]
    lines.append(f"  {'device memory':<44} {_human(limit) if limit is not None else 'unknown':>12}")
    lines.append(f"  {'index per host (RAM)':<44} {_human(plan['index_per_host']):>12}")
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
        f"training needs at least {_human(need)} per device but the device has {_human(limit)}; "
        f"{advice}.\n{format_memory_plan({**plan, 'device_memory': limit})}"
    )
