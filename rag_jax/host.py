"""Host-process settings that have to be in place when the process starts.

XLA:CPU allocates each execution's temporary buffer afresh (147 MB for the benchmark's tiny RAG
training step): glibc serves it with a new anonymous mapping, so every step touches tens of
thousands of new 4 KiB pages, and the step's working set thrashes the TLB (costly under a
hypervisor's nested paging). With glibc's `glibc.malloc.hugetlb=1` tunable, large allocations are
advised to transparent huge pages (2 MiB): the step's page faults fall from ~36,000 to ~120 and
the tiny training step of `experiments/bench/train_step.py` went from 137-141 ms to 99-104 ms
(its two variants, without and with the tunable).

glibc reads its tunables once, at process start, so a running process cannot switch this on:
`restart_with_huge_pages` re-executes the current command with the tunable added to
`GLIBC_TUNABLES`. The experiment scripts call it first thing; library users can call it at the top
of their own scripts, or export the variable themselves. On accelerators the step's buffers live
in device memory and this changes only host-side allocations.
"""

import os
import sys
import warnings

TUNABLE = "glibc.malloc.hugetlb=1"
# Set to "0" to keep the process as started (e.g. to measure without huge pages).
OPT_OUT = "RAG_JAX_HUGE_PAGES"
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


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


def restart_needed(environ=None) -> bool:
    """Whether `restart_with_huge_pages` would re-execute this process: the tunable takes effect
    here (`tunable_takes_effect`), is not set yet, and `RAG_JAX_HUGE_PAGES` is not 0."""
    environ = os.environ if environ is None else environ
    if environ.get(OPT_OUT, "1") == "0" or huge_pages_tunable_set(environ):
        return False
    return tunable_takes_effect()


def restart_with_huge_pages() -> None:
    """Re-executes this process (same interpreter, flags and arguments, same pid) with large
    allocations on transparent huge pages, when `restart_needed()`; otherwise returns.

    Call it before the process starts threads or does work worth keeping: nothing of the current
    process survives but its pid, environment and open descriptors.
    """
    if not restart_needed() or not sys.executable:
        return
    env = dict(os.environ)
    env["GLIBC_TUNABLES"] = ":".join(filter(None, (env.get("GLIBC_TUNABLES"), TUNABLE)))
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError as e:  # the process carries on as started, only slower on CPU
        warnings.warn(
            f"could not restart {sys.executable} with GLIBC_TUNABLES={env['GLIBC_TUNABLES']} "
            f"({e}); continuing without transparent huge pages",
            RuntimeWarning,
            stacklevel=2,
        )
