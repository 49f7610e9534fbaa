"""Host-process settings that have to be in place when the process starts.

XLA:CPU allocates each execution's temporary buffer afresh (147 MB for the benchmark's tiny RAG
training step): glibc serves it with a new anonymous mapping, so every step touches tens of
thousands of new 4 KiB pages, and the step's working set thrashes the TLB (costly under a
hypervisor's nested paging). With glibc's `glibc.malloc.hugetlb=1` tunable, large allocations are
advised to transparent huge pages (2 MiB): the step's page faults fall from ~36,000 to ~120 and
the tiny training step of `benchmarks/train_step.py` went from 137-141 ms to 99-104 ms
(its two variants, without and with the tunable).

OpenBLAS (numpy's BLAS, which `ExactIndex` scores with) keeps its worker threads spinning for
2^28 cycles (~0.1 s) after each call, and on a small host they take the cores from the XLA step
that follows the search: the tiny RAG-Sequence step (contexts 80 wide, as in the `e2e` benchmark;
fastest of 12, processes alternating) took 65-68 ms alone and 87-90 ms right after a 100k-row
`ExactIndex` search. With `OPENBLAS_THREAD_TIMEOUT=4` (2^4 cycles) they sleep as soon as the call
ends: 62-67 ms after a search, the search itself no slower.

glibc reads its tunables, and OpenBLAS its settings, once, when the process starts and numpy is
first imported, so a running process cannot switch either on: `restart_with_host_settings`
re-executes the current command with them added to its environment. The experiment scripts call
it first thing; library users can call it at the top of their own scripts, or export the
variables themselves. A value already in the environment is kept (`OPENBLAS_THREAD_TIMEOUT=28` is
OpenBLAS's default), and `RAG_JAX_HUGE_PAGES=0` leaves huge pages off. On accelerators the step's
buffers live in device memory and these change only host-side work.

On a host with no accelerator, JAX still tries every backend it can load, and with the `[tpu]`
extra installed that means loading libtpu (a 300 MB library) and letting it look for a TPU: on
some hosts it prints five lines of start-up errors ("unexpected worker hostname") that look like
a failure. When the host has no TPU chip on its PCI bus and no GPU plugin of JAX is installed,
`JAX_PLATFORMS=cpu` is added too (a value already set is kept).
"""

import ctypes
import glob
import importlib.metadata
import os
import sys
import warnings

TUNABLE = "glibc.malloc.hugetlb=1"
# Set to "0" to keep large allocations on small pages (e.g. to measure without huge pages).
OPT_OUT = "RAG_JAX_HUGE_PAGES"
# log2 of the cycles OpenBLAS's idle workers spin before they sleep (its range: 4-30).
OPENBLAS_TIMEOUT = ("OPENBLAS_THREAD_TIMEOUT", "4")
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"
# TPU chips are PCI devices of Google's vendor id (what JAX's own TPU start-up looks for).
GOOGLE_PCI_VENDOR = "0x1ae0"
PCI_VENDOR_FILES = "/sys/bus/pci/devices/*/vendor"
# Distributions of JAX's GPU backends (jax[cuda12] installs jax-cuda12-plugin, and so on).
GPU_PLUGIN_PREFIXES = ("jax-cuda", "jax_cuda", "jax-rocm", "jax_rocm")


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the C library when it is glibc, else None."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
    except (AttributeError, ValueError, OSError):
        return None
    if name != "glibc":
        return None
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def thp_mode(path: str = THP_MODE_FILE) -> str | None:
    """The kernel's transparent-huge-page mode ("always", "madvise", "never"), or None."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def huge_pages_tunable_set(environ=None) -> bool:
    """Whether `GLIBC_TUNABLES` in `environ` (default: this process's) already sets the tunable."""
    environ = os.environ if environ is None else environ
    entries = environ.get("GLIBC_TUNABLES", "").split(":")
    return any(entry.startswith("glibc.malloc.hugetlb=") for entry in entries)


def tunable_takes_effect() -> bool:
    """Whether this host honours the tunable: glibc 2.35 or newer (the first with
    `glibc.malloc.hugetlb`) and the kernel's THP mode `madvise` (with `always` large mappings get
    huge pages anyway; with `never`, or no THP, they cannot)."""
    version = glibc_version()
    return version is not None and version >= (2, 35) and thp_mode() == "madvise"


def has_tpu_chip() -> bool:
    """Whether a PCI device of Google's vendor id (a TPU chip) is on this host."""
    for path in glob.glob(PCI_VENDOR_FILES):
        try:
            with open(path, encoding="ascii") as f:
                if f.read().strip() == GOOGLE_PCI_VENDOR:
                    return True
        except OSError:
            continue
    return False


def has_gpu_plugin() -> bool:
    """Whether a GPU backend of JAX (CUDA or ROCm plugin) is installed."""
    names = (d.metadata["Name"] or "" for d in importlib.metadata.distributions())
    return any(name.lower().startswith(GPU_PLUGIN_PREFIXES) for name in names)


def startup_environment(environ=None) -> dict[str, str]:
    """The variables `restart_with_host_settings` would set in `environ` (default: this
    process's), with their new values; empty when nothing is missing.

    - `GLIBC_TUNABLES` gains the huge-page tunable where it takes effect (`tunable_takes_effect`),
      unless it is set already or `RAG_JAX_HUGE_PAGES` is 0;
    - `OPENBLAS_THREAD_TIMEOUT` is set to 4 unless it is set already;
    - `JAX_PLATFORMS=cpu` unless it is set already (empty counts as unset, as for JAX), or the
      host has a TPU chip or JAX a GPU plugin (`has_tpu_chip`, `has_gpu_plugin`).
    """
    environ = os.environ if environ is None else environ
    changes = {}
    if (
        environ.get(OPT_OUT, "1") != "0"
        and not huge_pages_tunable_set(environ)
        and tunable_takes_effect()
    ):
        changes["GLIBC_TUNABLES"] = ":".join(filter(None, (environ.get("GLIBC_TUNABLES"), TUNABLE)))
    name, value = OPENBLAS_TIMEOUT
    if name not in environ:
        changes[name] = value
    if not environ.get("JAX_PLATFORMS") and not has_tpu_chip() and not has_gpu_plugin():
        changes["JAX_PLATFORMS"] = "cpu"
    return changes


def restart_with_host_settings() -> None:
    """Re-executes this process (same interpreter, flags and arguments, same pid) with
    `startup_environment()` added to its environment, when that is not empty; otherwise returns.

    Call it before the process starts threads or does work worth keeping: nothing of the current
    process survives but its pid, environment and open descriptors.
    """
    changes = startup_environment()
    if not changes or not sys.executable:
        return
    env = {**os.environ, **changes}
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError as e:  # the process carries on as started, only slower on CPU
        settings = " ".join(f"{k}={v}" for k, v in changes.items())
        warnings.warn(
            f"could not restart {sys.executable} with {settings} ({e}); continuing without them",
            RuntimeWarning,
            stacklevel=2,
        )


def start_jax_leaving_a_core() -> int:
    """Starts JAX's backends with XLA's CPU thread pool one thread short of the CPUs this
    process may use; returns the pool's size (the one CPU of a one-CPU host).

    A server's host side (its event loop, its batcher's preparing thread) runs beside the model:
    with a pool thread on every core, a parallel XLA op waits for its part on a core the host
    side holds. XLA sizes its pool by the CPUs the thread that starts it may use, so that thread
    is held to all but one while the backends start, and every thread of the process may use
    them all again after (the pool's threads too: only their number stays). On 2 shared cores
    (back-to-back runs, load average 3-4.6) the default job's served calls of 16 questions took
    108-116 ms instead of 143-169 ms, and the server answered 16 clients of
    `benchmarks/serve_load.py` at about 65 requests/s instead of 52. Call it before anything
    starts JAX's backends; after, it changes nothing.
    """
    if not hasattr(os, "sched_getaffinity"):
        return os.cpu_count() or 1
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        return len(cpus)
    import jax

    os.sched_setaffinity(0, set(sorted(cpus)[:-1]))
    try:
        jax.devices()  # starts the backends: their pools' threads are made now
    finally:
        for thread in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(thread), cpus)
            except OSError:  # a thread that ended meanwhile
                pass
    return len(cpus) - 1


def release_free_memory() -> bool:
    """Returns the C heap's free pages to the kernel (glibc's `malloc_trim(0)`); True if it
    ran (glibc), False elsewhere.

    Memory that XLA frees (a dropped program's executable, its buffers) goes back to glibc's
    heap, not to the kernel: the process's RSS stays where it peaked. A server that evicts an
    idle setting's programs calls this after dropping them, so that the eviction shows in RSS.
    """
    if glibc_version() is None:
        return False
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True
