"""One program on several processes (hosts): start-up, each process's rows, host collectives.

Multi-host (one process per host, all running the same program):

    maybe_initialize_distributed()          # before anything touches a JAX backend
    mesh = sharding.data_mesh()             # every device of every process
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
process_id=i)`; CPU collectives across processes go through gloo (JAX's default). On one process
every function here is the plain single-host operation, with no communication.

Legend: B batch (global unless named `local_`), blocks the processes feeding a batch.
"""

import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from rag_jax.devices.sharding import DATA_AXIS, batch_sharded, check_batch_divisible

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


def process_block(mesh: Mesh) -> tuple[int, int]:
    """Which contiguous block of every global batch this process feeds, and how many blocks.

    Device i of the `data` mesh holds the i-th slice of `B / num_devices` rows, so a process owns
    the rows of its devices. Those form one contiguous block when the process's devices are
    adjacent on the mesh, which `sharding.data_mesh()` gives on CPU, GPU and TPU hosts (devices are
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
      mesh: the `data` mesh (see `sharding.data_mesh`).
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
            f"{starts}); shard it with `shard_batch` over a `sharding.data_mesh`"
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


def process_shards(todo: Sequence[int], process: int, processes: int) -> list[int]:
    """The shards of a job one process of a multi-host run does (a corpus encoding's): every
    `processes`-th unfinished one.

    Dealt round-robin over the shards still to do (not over all shards), so that a re-run after
    a killed process spreads what is left over every process again; all processes read the
    same manifest, so they deal alike.

    Args:
      todo: ascending indices of the shards not yet finished.
      process, processes: `jax.process_index()`, `jax.process_count()`.

    Returns:
      `todo[process::processes]`.
    """
    if not 0 <= process < processes:
        raise ValueError(f"process {process} is not one of {processes} processes")
    return list(todo)[process::processes]


def on_every_process(ok: bool) -> bool:
    """Whether `ok` holds on every process: a collective, hence a barrier, on several."""
    if jax.process_count() == 1:
        return ok
    return max_over_processes(int(not ok)) == 0


def check_same_everywhere(record: dict, what: str) -> None:
    """Raises on every process unless `record` (JSON) is the same on every process; a
    collective. `what` says what differs, e.g. "encode another run than process 0 (...)"."""
    digest = hashlib.sha256(json.dumps(record, sort_keys=True).encode("utf-8")).digest()
    digests = np.asarray(
        multihost_utils.process_allgather(np.frombuffer(digest, np.uint8).astype(np.int32))
    )  # -> [processes, 32]
    differing = [p for p in range(len(digests)) if not np.array_equal(digests[p], digests[0])]
    if differing:
        raise ValueError(f"processes {differing} {what}")


def on_process_zero(fn, what: str):
    """Runs `fn()` on process 0 alone (None elsewhere) and raises on every process if it fails,
    so that no process is left waiting at a collective for one that gave up."""
    error, result = None, None
    if jax.process_index() == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, after the others learn of it
            error = e
    if not on_every_process(error is None):
        if error is not None:
            raise error
        raise RuntimeError(f"process 0 failed to {what}; its log says why")
    return result
