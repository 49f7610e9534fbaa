"""rag_jax.devices.host: the restart with huge pages and sleeping OpenBLAS workers, in real child
processes."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from rag_jax.devices import host

# A child that restarts, then reports its pid, its tunables and how much of a freshly malloc'd
# and touched 64 MiB block the kernel backs with huge pages (glibc serves a block that large
# with its own mapping; numpy is avoided: it advises huge pages for its arrays by itself).
CHILD = textwrap.dedent(
    """
    import ctypes, json, os, sys
    from rag_jax.devices import host
    print(json.dumps({"stage": "before", "pid": os.getpid()}), flush=True)
    host.restart_with_host_settings()
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    size = 64 << 20
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    start, end = block, block + size
    huge_kb = 0
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low < end and start < high
            elif inside and head == "AnonHugePages:":
                huge_kb += int(line.split()[1])
    print(json.dumps({"stage": "after", "pid": os.getpid(), "argv": sys.argv[1:],
                      "tunables": os.environ.get("GLIBC_TUNABLES", ""), "huge_kb": huge_kb,
                      "openblas": os.environ.get("OPENBLAS_THREAD_TIMEOUT")}))
    """
)

needs_thp = pytest.mark.skipif(
    not host.tunable_takes_effect(),
    reason="needs glibc >= 2.35 and the kernel's transparent huge pages in madvise mode "
    f"(glibc {host.glibc_version()}, THP mode {host.thp_mode()})",
)


# A child that reports the CPU time its threads burn while the main thread sleeps 0.3 s right
# after a multi-threaded BLAS product: OpenBLAS's idle workers spinning, or not.
SPIN_CHILD = textwrap.dedent(
    """
    import json, resource, time
    from rag_jax.devices import host
    host.restart_with_host_settings()
    import numpy as np

    def cpu_s():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    x = np.ones((512, 512), np.float32)
    burnt = []
    for _ in range(3):
        x @ x
        start = cpu_s()
        time.sleep(0.3)
        burnt.append(1e3 * (cpu_s() - start))
    print(json.dumps({"burnt_ms": burnt}))
    """
)


def _run_child(env_updates: dict[str, str], child: str = CHILD) -> list[dict]:
    env = dict(os.environ)
    for name in ("GLIBC_TUNABLES", host.OPT_OUT, host.OPENBLAS_TIMEOUT[0]):
        env.pop(name, None)
    env.update(env_updates)
    proc = subprocess.run(
        [sys.executable, "-c", child, "--flag", "value"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


@needs_thp
def test_restart_puts_large_allocations_on_huge_pages_and_keeps_pid_and_arguments():
    lines = _run_child({})
    # The child printed "before" twice: once as started, once after re-executing itself.
    assert [line["stage"] for line in lines] == ["before", "before", "after"]
    assert len({line["pid"] for line in lines}) == 1
    after = lines[-1]
    assert after["tunables"] == host.TUNABLE
    assert after["argv"] == ["--flag", "value"]
    assert after["huge_kb"] >= 32 << 10  # at least half the block on 2 MiB pages


@needs_thp
def test_without_the_restart_the_same_block_stays_on_small_pages():
    lines = _run_child({host.OPT_OUT: "0", "OPENBLAS_THREAD_TIMEOUT": "28"})
    assert [line["stage"] for line in lines] == ["before", "after"]
    assert lines[-1]["tunables"] == ""
    assert lines[-1]["huge_kb"] == 0


def test_the_restart_sets_the_openblas_timeout_even_with_huge_pages_opted_out():
    lines = _run_child({host.OPT_OUT: "0"})
    assert [line["stage"] for line in lines] == ["before", "before", "after"]
    assert lines[-1]["openblas"] == "4" and lines[-1]["tunables"] == ""


def test_an_openblas_timeout_already_set_is_kept():
    lines = _run_child({host.OPT_OUT: "0", "OPENBLAS_THREAD_TIMEOUT": "20"})
    assert [line["stage"] for line in lines] == ["before", "after"]
    assert lines[-1]["openblas"] == "20"


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="OpenBLAS runs one thread on one core")
def test_after_the_restart_openblas_workers_sleep_instead_of_spinning():
    # As started (OpenBLAS's default 2^28 cycles) the workers burn ~0.1 s of CPU after every
    # product; that is the time they take from an XLA step that follows a search.
    # (The spinning shows in the round that gets a free core: another process on the cores,
    # such as a second test worker, can take the others'.)
    spinning = _run_child({"OPENBLAS_THREAD_TIMEOUT": "28", host.OPT_OUT: "0"}, SPIN_CHILD)
    assert max(spinning[-1]["burnt_ms"]) > 20
    sleeping = _run_child({host.OPT_OUT: "0"}, SPIN_CHILD)
    assert max(sleeping[-1]["burnt_ms"]) < 10


@needs_thp
def test_existing_tunables_are_kept():
    lines = _run_child({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"})
    assert lines[-1]["tunables"] == f"glibc.malloc.arena_max=4:{host.TUNABLE}"


def test_nothing_changes_when_set_or_refused():
    blas = {"OPENBLAS_THREAD_TIMEOUT": "28", "JAX_PLATFORMS": "cpu,tpu"}
    assert host.startup_environment({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0", **blas}) == {}
    assert host.startup_environment({"GLIBC_TUNABLES": f"x=1:{host.TUNABLE}", **blas}) == {}
    assert host.startup_environment({host.OPT_OUT: "0", **blas}) == {}
    platforms = {"JAX_PLATFORMS": "tpu"}
    assert host.startup_environment({host.OPT_OUT: "0", **platforms}) == {
        "OPENBLAS_THREAD_TIMEOUT": "4"
    }


def test_jax_is_kept_off_libtpu_where_there_is_no_accelerator(monkeypatch, tmp_path):
    """With no TPU chip and no GPU plugin, JAX_PLATFORMS=cpu; else JAX picks as it would."""
    blas = {"OPENBLAS_THREAD_TIMEOUT": "28", host.OPT_OUT: "0"}
    for name in ("0000:00:04.0", "0000:00:05.0"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "vendor").write_text("0x1af4\n")  # virtio devices
    monkeypatch.setattr(host, "PCI_VENDOR_FILES", str(tmp_path / "*" / "vendor"))
    monkeypatch.setattr(host, "has_gpu_plugin", lambda: False)
    assert host.startup_environment(blas) == {"JAX_PLATFORMS": "cpu"}
    assert host.startup_environment({**blas, "JAX_PLATFORMS": "cuda"}) == {}
    (tmp_path / "0000:00:05.0" / "vendor").write_text("0x1ae0\n")  # a TPU chip
    assert host.startup_environment(blas) == {}
    (tmp_path / "0000:00:05.0" / "vendor").write_text("0x1af4\n")
    monkeypatch.setattr(host, "has_gpu_plugin", lambda: True)
    assert host.startup_environment(blas) == {}


def test_thp_mode_reads_the_bracketed_entry(tmp_path):
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert host.thp_mode(str(path)) == "madvise"
    path.write_text("[never]\n")
    assert host.thp_mode(str(path)) == "never"
    assert host.thp_mode(str(tmp_path / "missing")) is None


def test_a_failed_restart_warns_and_carries_on(monkeypatch):
    monkeypatch.setattr(host, "startup_environment", lambda: {"OPENBLAS_THREAD_TIMEOUT": "4"})

    def refuse(*args):
        raise PermissionError("exec refused")

    monkeypatch.setattr(host.os, "execve", refuse)
    with pytest.warns(RuntimeWarning, match="OPENBLAS_THREAD_TIMEOUT=4 .*exec refused"):
        host.restart_with_host_settings()


LIBTPU_CHILD = textwrap.dedent(
    """
    import json, os
    import jax
    from rag_jax.devices import host
    host.restart_with_host_settings()
    jax.devices()
    with open("/proc/self/maps") as f:
        mapped = "libtpu" in f.read()
    print(json.dumps({"platforms": os.environ.get("JAX_PLATFORMS"), "libtpu": mapped}))
    """
)


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None or host.has_tpu_chip() or host.has_gpu_plugin(),
    reason="needs libtpu installed (the [tpu] extra) on a host with no TPU chip or GPU plugin",
)
def test_a_script_on_a_host_without_accelerators_never_loads_libtpu():
    """Plain `import jax; jax.devices()` loads libtpu when it is installed (its start-up errors
    printed on some hosts); a script that restarts with the host settings does not."""
    env = {"JAX_PLATFORMS": ""}  # as a user's shell has it: unset
    lines = _run_child(env, LIBTPU_CHILD)
    assert lines[-1] == {"platforms": "cpu", "libtpu": False}


TRIM_CHILD = textwrap.dedent(
    """
    import ctypes, json
    from rag_jax.devices import host

    def rss_kb():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    # 4,000 blocks of 64 KiB (under glibc's mmap threshold: on the heap), touched, then freed
    # except the last, which keeps the heap's top from shrinking by itself.
    blocks = [libc.malloc(64 << 10) for _ in range(4000)]
    for b in blocks:
        ctypes.memset(b, 1, 64 << 10)
    before = rss_kb()
    for b in blocks[:-1]:
        libc.free(b)
    freed = rss_kb()
    ran = host.release_free_memory()
    print(json.dumps({"before": before, "freed": freed, "trimmed": rss_kb(), "ran": ran}))
    """
)


@pytest.mark.skipif(host.glibc_version() is None, reason="malloc_trim is glibc's")
def test_freed_heap_memory_returns_to_the_kernel():
    """Freed memory stays in the process until trimmed (an evicted program's executable does
    the same): ~250 MB freed, RSS falls only after `release_free_memory`."""
    out = _run_child({host.OPT_OUT: "0", "OPENBLAS_THREAD_TIMEOUT": "28"}, TRIM_CHILD)[-1]
    assert out["ran"]
    assert out["freed"] > out["before"] - 50_000, out  # free alone returns little
    assert out["trimmed"] < out["before"] - 200_000, out  # the trim returns most of 250 MB
