"""The TPU slice a compile is planned for, without its chips: the devices, the HBM per chip.

With `libtpu` installed (`pip install 'rag_jax[tpu]'`), `jax.experimental.topologies` describes
the devices of a TPU slice that is not there; `target(name)` lays the `data` mesh over them (the
mesh `benchmarks.aot` compiles for) and finds the HBM the TPU compiler lets one program use per
chip (`usable_hbm`: it compiles a program too large for any chip and reads the refusal, whose
message `out_of_memory` parses).

Legend: n chips.
"""

import dataclasses
import functools
import importlib.util
import os
import re

import jax
import jax.numpy as jnp

from benchmarks.flops import device_peaks
from rag_jax.devices import sharding

# TPU generations this tool plans for (the keys of `benchmarks.flops.PEAKS` name their
# peaks), with what the topology description needs: v4 and v5p chips are one JAX device of two
# TensorCores ("megacore"), as Cloud TPU VMs present them.
GENERATIONS = {
    "v4": {"chip_config_name": "megacore"},
    "v5p": {"chip_config_name": "megacore"},
    "v5e": {},
    "v6e": {},
}
# Slices that are one VM of 8 chips (v5litepod-8, v6e-8); larger v5e/v6e slices have 4 per host.
SINGLE_HOST_8 = {"v5e:2x4", "v6e:2x4"}
EXAMPLES = "v4:2x2x1, v5e:2x4, v5p:2x2x1, v6e:2x4, v5e:4x4, v4:2x2x4"


class PlanError(ValueError):
    """Input the tool cannot plan for; the message says what to do (one line)."""


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # e.g. "v5e:2x4"
    mesh: jax.sharding.Mesh  # the `data` mesh over every chip
    kind: str  # device_kind, e.g. "TPU v5 lite"
    hosts: int
    hbm_bytes: int  # what the TPU compiler lets one program use per chip
    peaks: dict  # benchmarks.flops.device_peaks

    @property
    def chips(self) -> int:
        return self.mesh.size

    def describe(self) -> dict:
        return {
            "topology": self.name,
            "kind": self.kind,
            "chips": self.chips,
            "hosts": self.hosts,
            "hbm_bytes_per_chip": self.hbm_bytes,
            "peak_bf16_tflops_per_chip": self.peaks["tflops"],
            "peak_hbm_gbps_per_chip": self.peaks["gbps"],
            "peak_source": self.peaks["source"],
        }


def has_libtpu() -> bool:
    """Whether the TPU compiler (`libtpu`, brought by `jax[tpu]`) is installed."""
    return importlib.util.find_spec("libtpu") is not None


def target(name: str) -> Target:
    """The devices of TPU topology `name` (e.g. "v5e:2x4") as a `data` mesh."""
    generation = name.partition(":")[0].lower()
    if generation not in GENERATIONS or not re.fullmatch(r"[a-z0-9]+:\d+(x\d+){1,2}", name):
        raise PlanError(
            f"unknown TPU topology {name!r}: give <generation>:<chips per axis>, generation one "
            f"of {', '.join(GENERATIONS)}, e.g. {EXAMPLES}"
        )
    if not has_libtpu():
        raise PlanError(
            "libtpu is not installed, so there is no TPU compiler: pip install 'rag_jax[tpu]' "
            f"(jax[tpu]=={jax.__version__}), best in a virtualenv of its own"
        )
    # Compiling needs no TPU, so several compiling processes may share libtpu (which otherwise
    # takes a lock for the process that owns the chips).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    options = dict(GENERATIONS[generation])
    if name in SINGLE_HOST_8:
        options["chips_per_host_bounds"] = (2, 4, 1)
    try:
        topology = topologies.get_topology_desc(topology_name=name, platform="tpu", **options)
    except Exception as e:  # noqa: BLE001 - libtpu's own message, on one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PlanError(f"libtpu refused TPU topology {name!r} ({first}); try {EXAMPLES}") from None
    devices = list(topology.devices)
    mesh = sharding.data_mesh(devices)
    kind = devices[0].device_kind
    return Target(
        name=name,
        mesh=mesh,
        kind=kind,
        hosts=len({d.process_index for d in devices}),
        hbm_bytes=usable_hbm(mesh),
        peaks=device_peaks(kind),
    )


_CAPACITY = re.compile(r"(?:available HBM|of) \(?([0-9.]+)([KMGT])\)?(?: hbm)?")
_NEEDED = [
    re.compile(r"Used ([0-9.]+)([KMGT]) of ([0-9.]+)([KMGT]) hbm"),
    re.compile(r"\(([0-9.]+)([KMGT])\) exceeds available HBM \(([0-9.]+)([KMGT])\)"),
]
_UNIT = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def out_of_memory(error: BaseException) -> tuple[int, int] | None:
    """(bytes needed, bytes available) from the TPU compiler's out-of-memory error, else None."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text and "memory" not in text.lower():
        return None
    for pattern in _NEEDED:
        found = pattern.search(text)
        if found:
            need, unit, have, have_unit = found.groups()
            return int(float(need) * _UNIT[unit]), int(float(have) * _UNIT[have_unit])
    return None


@functools.cache
def usable_hbm(mesh) -> int:
    """The HBM one program may use per chip, as the TPU compiler sees it: a program too large for
    any chip is compiled, and the refusal names the capacity."""
    huge = jax.ShapeDtypeStruct((2**40,), jnp.int8, sharding=sharding.replicated(mesh))
    try:
        jax.jit(lambda x: x + 1).lower(huge).compile()
    except Exception as e:  # noqa: BLE001 - the expected refusal
        found = out_of_memory(e)
        if found:
            return found[1]
        raise RuntimeError(f"the TPU compiler's refusal did not name its HBM: {e}") from e
    raise RuntimeError("the TPU compiler accepted a program of 1 TiB per chip")
