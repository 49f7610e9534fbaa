"""Data parallelism over a device mesh: multi-host start-up, mesh, batch placement, memory plan.

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

Multi-host (one process per host, all running the same program):

    maybe_initialize_distributed()          # before anything touches a JAX backend
    mesh = data_mesh()                      # every device of every process
    block, blocks = process_block(mesh)     # this process's share of every batch
    rows = data.batch_indices(n, B, seed, step, process_index=block, process_count=blocks)
    batch = shard_batch(mesh, host_arrays)  # [B / blocks, ...] per process -> [B, ...] global
    mine = local_rows(global_array)         # back to this process's rows (host retrieval)
    full = gather_to_host(global_array)     # the whole array on every process (evaluation)

Each process reads, tokenises and retrieves only its own rows; the jitted step sees one global
batch. Values every process must agree on (parameters, the step, the config) are computed
identically everywhere; host-side sums (e.g. retrieval recall) are combined with
`sum_over_processes`. Two local processes stand in for two hosts in the tests: each sets
`XLA_FLAGS=--xla_force_host_platform_device_count=4` and `JAX_PLATFORMS=cpu` and calls
`maybe_initialize_distributed(coordinator_address="127.0.0.1:<port>", num_processes=2,
process_id=i)`; CPU collectives across processes go through gloo (JAX's default).

Legend: B batch (global unless named `local_` or `per_device_`), D embedding width.
"""

import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils
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


def _env_int(var: str) -> int | None:
    value = os.environ.get(var, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"environment variable {var}={value!r} must be a non-negative integer")
    return int(value)


def maybe_initialize_distributed(
    force: bool = False,
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> bool:
    """Connects this process to the others of a multi-host run; a no-op on one host.

    Must run before anything touches a JAX backend (creating an array, `jax.devices()`), because
    `jax.distributed.initialize` can only configure backends that do not exist yet. Safe to call
    more than once. A multi-host run is recognised by explicit arguments, by
    `JAX_COORDINATOR_ADDRESS` / `MEGASCALE_COORDINATOR_ADDRESS`, by `TPU_PROCESS_ADDRESSES` /
    `TPU_WORKER_HOSTNAMES` listing several hosts, or by `SLURM_NTASKS` / `OMPI_COMM_WORLD_SIZE`
    above 1. On a Cloud TPU pod JAX finds the coordinator, the process count and this process's
    id itself (from the TPU metadata server); pass `force=True` on every worker when the
    environment carries none of the variables above. Elsewhere (CPU or GPU hosts without SLURM
    or Open MPI) give all three of `coordinator_address`, `num_processes` and `process_id`, or
    set `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID` on every process.

    Args:
      force: initialise even when no multi-host environment variable is set.
      coordinator_address: "host:port" of process 0's coordinator service (every process gives
        the same address); default `JAX_COORDINATOR_ADDRESS` or JAX's cluster detection.
      num_processes: processes in the run; default `JAX_NUM_PROCESSES` or cluster detection.
      process_id: this process's id in [0, num_processes); default `JAX_PROCESS_ID` or cluster
        detection.

    Returns:
      True when this process is (now or already) part of a distributed run.
    """
    if jax.distributed.is_initialized():
        return True
    num_processes = _env_int("JAX_NUM_PROCESSES") if num_processes is None else num_processes
    process_id = _env_int("JAX_PROCESS_ID") if process_id is None else process_id
    explicit = {
        "coordinator_address": coordinator_address,
        "num_processes": num_processes,
        "process_id": process_id,
    }
    explicit = {name: value for name, value in explicit.items() if value is not None}
    if force:
        reason = "force=True"
    elif explicit:
        reason = "explicit " + ", ".join(explicit)
    else:
        reason = _multi_process_env()
    if reason is None:
        return False
    logging.info("Initialising jax.distributed (multi-host run detected by %s).", reason)
    jax.distributed.initialize(**explicit)
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


def process_block(mesh: Mesh) -> tuple[int, int]:
    """Which contiguous block of every global batch this process feeds, and how many blocks.

    Device i of the `data` mesh holds the i-th slice of `B / num_devices` rows, so a process owns
    the rows of its devices. Those form one contiguous block when the process's devices are
    adjacent on the mesh, which `data_mesh()` gives on CPU, GPU and TPU hosts (devices are
    numbered host by host). The block index is usually `jax.process_index()`, but it is read
    from the mesh so that the rows a process loads are always the rows its devices receive.

    Args:
      mesh: the `data` mesh; 1-D when it spans several processes.

    Returns:
      `(block, blocks)`: this process feeds global rows `[block * B / blocks,
      (block + 1) * B / blocks)` of a batch of B (pass them to `data.batch_indices` as
      `process_index` and `process_count`). `(0, 1)` on one process.

    Raises:
      ValueError: when the mesh spans processes unevenly or in interleaved order, or leaves this
        process out (e.g. `config.train.num_devices` below the device count on several hosts).
    """
    owners = [d.process_index for d in mesh.devices.flat]
    if len(set(owners)) == 1 and owners[0] == jax.process_index():
        return 0, 1
    if mesh.devices.ndim != 1:
        raise ValueError(
            f"a mesh spanning several processes must be 1-D over {DATA_AXIS!r} to split "
            f"batches by process; got axes {dict(mesh.shape)}"
        )
    runs = [owners[0]]  # process of each maximal run of adjacent devices
    for owner in owners[1:]:
        if owner != runs[-1]:
            runs.append(owner)
    counts = {p: owners.count(p) for p in sorted(set(owners))}
    if len(set(runs)) != len(runs) or len(set(counts.values())) != 1:
        raise ValueError(
            "each process's devices must be adjacent on the mesh and equal in number; got "
            f"devices per process {counts} in mesh order {owners}"
        )
    if jax.process_index() not in runs:
        raise ValueError(
            f"process {jax.process_index()} has no device in the mesh (mesh devices belong to "
            f"processes {sorted(set(runs))}); on several hosts the mesh must use devices of "
            "every process, e.g. config.train.num_devices = 0 (all)"
        )
    return runs.index(jax.process_index()), len(runs)


def shard_batch(mesh: Mesh, local_batch: Any) -> Any:
    """Assembles each process's rows into global arrays split over `data`.

    Every process calls this with its own rows; on one host that is the whole batch. Rows keep
    their order: this process's rows occupy global rows `[block * local_B, (block + 1) *
    local_B)` where `block, _ = process_block(mesh)` (normally the process index), and device i
    of the mesh receives the i-th contiguous slice of `B / num_devices` rows. On several
    processes this is a collective in effect: all of them must call it with equal `local_B`.

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
    local_size = next(iter(sizes.values()))
    _, blocks = process_block(mesh)
    check_batch_divisible(local_size * blocks, mesh.size)
    sharding = batch_sharded(mesh)

    def put(leaf):
        leaf = np.asarray(leaf)
        global_shape = (leaf.shape[0] * blocks, *leaf.shape[1:])
        return jax.make_array_from_process_local_data(sharding, leaf, global_shape)

    return jax.tree.map(put, local_batch)


def local_rows(x: jax.Array) -> np.ndarray:
    """This process's rows of a batch-sharded array, on the host: the inverse of `shard_batch`.

    Host-side work on a global batch (index search, tokenisation of results) runs on each
    process for its own rows only; this fetches them without any cross-process communication.

    Args:
      x: `[B, ...]` sharded over `data` along its leading dimension (e.g. the question vectors
        of a batch that `shard_batch` placed).

    Returns:
      `[B / blocks, ...]` numpy: global rows `[block * B / blocks, (block + 1) * B / blocks)`
      (see `process_block`); the whole array on one process.
    """
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    pieces = {}
    for shard in x.addressable_shards:  # Replicas along other mesh axes repeat a slice.
        pieces.setdefault(shard.index[0].start or 0, shard.data)
    starts = sorted(pieces)
    host = jax.device_get([pieces[start] for start in starts])
    stops = [start + len(piece) for start, piece in zip(starts, host)]
    if starts[1:] != stops[:-1]:
        raise ValueError(
            f"this process's rows of the {x.shape} array are not contiguous (slices starting at "
            f"{starts}); shard it with `shard_batch` over a `data_mesh`"
        )
    return np.concatenate(host)


def own_rows(x: jax.Array, mesh: Mesh) -> np.ndarray:
    """This process's rows of a replicated `[B, ...]` array, on the host, without communication.

    For results every device holds whole (e.g. the ids of an in-graph `DeviceIndex` search) of a
    batch whose rows `shard_batch` spread over `mesh`: the same rows `local_rows` gives for the
    batch-sharded inputs.
    """
    if not x.is_fully_replicated:
        raise ValueError(f"own_rows needs a replicated array; got sharding {x.sharding}")
    block, blocks = process_block(mesh)
    whole = np.asarray(x.addressable_data(0))  # -> [B, ...]
    if len(whole) % blocks:
        raise ValueError(f"{len(whole)} rows do not split into {blocks} process blocks")
    size = len(whole) // blocks
    return whole[block * size : (block + 1) * size]


def replicated_to_host(tree: Any) -> Any:
    """Host numpy copies of a pytree of replicated arrays (e.g. restored parameters), read from
    this process's own copy: no communication, on one process or several."""

    def host(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            if not x.is_fully_replicated:
                raise ValueError(f"replicated_to_host needs replicated arrays; got {x.sharding}")
            return np.asarray(x.addressable_data(0))
        return np.asarray(jax.device_get(x))

    return jax.tree.map(host, tree)


def state_to_host(tree: Any) -> Any:
    """Host numpy copies of a pytree of replicated or split (`param_sharding="fsdp"`) arrays.

    Replicated arrays are read from this process's own copy; split ones are gathered, a
    collective on several processes (all of them call this with the same tree).
    """

    def host(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            if x.is_fully_replicated:
                return np.asarray(x.addressable_data(0))
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    return jax.tree.map(host, tree)


def gather_to_host(tree: Any) -> Any:
    """The full value of every (global) array of a pytree, as numpy, on every process.

    On several processes this is a collective (every process must call it with arrays of the
    same global shapes): arrays spanning processes are gathered over the network. On one process
    it is `jax.device_get`.
    """
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, jax.device_get(tree))
    return multihost_utils.process_allgather(tree, tiled=True)


def from_process0(value: bool | int | float) -> bool | int | float:
    """Process 0's `value` on every process, for decisions all processes must take alike.

    A collective on several processes (e.g. whether a file exists on process 0's disk, when
    other hosts may not see it); `value` itself on one.
    """
    if jax.process_count() == 1:
        return value
    return type(value)(multihost_utils.broadcast_one_to_all(np.asarray(value)).item())


def sum_over_processes(metrics: dict[str, tuple[float, int]]) -> dict[str, tuple[float, int]]:
    """Adds `{name: (sum, count)}` metrics computed on the host by each process for its rows.

    A collective on several processes (all must pass the same names); unchanged on one.
    Sums travel as float32, exact for counts below 2**24.
    """
    if jax.process_count() == 1:
        return dict(metrics)
    names = sorted(metrics)
    local = np.array([[metrics[n][0], metrics[n][1]] for n in names], np.float32).reshape(-1, 2)
    total = np.asarray(multihost_utils.process_allgather(local)).sum(axis=0)  # -> [names, 2]
    return {n: (float(total[i, 0]), int(round(float(total[i, 1])))) for i, n in enumerate(names)}


def max_over_processes(value: int) -> int:
    """The largest of an integer every process computes for its rows (e.g. a batch's width).

    A collective on several processes; `value` itself on one.
    """
    if jax.process_count() == 1:
        return int(value)
    return int(np.asarray(multihost_utils.process_allgather(np.int32(value))).max())


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
