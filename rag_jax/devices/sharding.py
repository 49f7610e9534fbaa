"""The device mesh and where arrays live on it: the `data` mesh, parameter and batch placements.

One mesh axis, `data`, spans every device of every process. Batches are split over it along their
leading (batch) dimension. Parameters and optimizer state are replicated over it, and a jitted
step over such inputs averages gradients across devices by itself (XLA inserts the all-reduce that
`pmean` made explicit under `pmap`); or, with `param_sharding(..., "fsdp")`, each of their arrays
is split over the same axis (ZeRO-3 / FSDP: XLA all-gathers a parameter where the step uses it and
reduce-scatters its gradient, so a device holds 1/n of the parameters and optimizer state).
Code that must see its own device's shard (per-shard index search, per-device dropout keys) runs
under `jax.shard_map` over the same axis.

The same code runs on 1 CPU device, on 8 fake CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`), on a TPU VM, and on a multi-host pod.
How each process's rows reach the mesh and come back on several hosts is
`rag_jax.devices.distributed`; what the placed arrays and a compiled program need of each
device's memory, `rag_jax.devices.device_memory`.

Legend: B batch (global unless named `local_` or `per_device_`), D embedding width.
"""

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"


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


PARAM_SHARDINGS = ("replicated", "fsdp")


def fsdp_spec(shape: Sequence[int], num_devices: int) -> P:
    """How `param_sharding="fsdp"` splits an array of `shape` over `data`: along its largest
    dimension that `num_devices` divides (the first of equals), whole when none does (scalars,
    odd sizes). Shape-only, so an optimizer moment is split as its parameter is."""
    dims = [i for i, size in enumerate(shape) if size % num_devices == 0 and size >= num_devices]
    if num_devices == 1 or not dims:
        return P()
    axis = max(dims, key=lambda i: (shape[i], -i))
    return P(*([None] * axis), DATA_AXIS)


def param_sharding(mesh: Mesh, tree: Any, param_sharding: str) -> Any:
    """The placement of every leaf of a pytree of parameters (or of optimizer state).

    Args:
      mesh: the `data` mesh.
      tree: pytree of arrays or `jax.ShapeDtypeStruct`s.
      param_sharding: "replicated" (every device holds every array) or "fsdp" (`fsdp_spec`).

    Returns:
      The same pytree of `NamedSharding`s.
    """
    if param_sharding not in PARAM_SHARDINGS:
        raise ValueError(
            f"param_sharding must be one of {' | '.join(PARAM_SHARDINGS)}, got {param_sharding!r}"
        )
    if param_sharding == "replicated":
        return jax.tree.map(lambda _: replicated(mesh), tree)
    return jax.tree.map(lambda x: NamedSharding(mesh, fsdp_spec(x.shape, mesh.size)), tree)


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
