"""Test setup shared by every test module.

Eight fake CPU devices are requested before JAX initialises so that multi-device tests (a `data`
mesh of 8) run on any laptop; single-device tests are unaffected (they use device 0).
"""

import os

FAKE_DEVICES = 8
_FLAG = f"--xla_force_host_platform_device_count={FAKE_DEVICES}"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The settings the scripts give themselves at start (`host.restart_with_host_settings`: huge pages
# for large allocations, OpenBLAS's idle threads asleep), read by the worker processes pytest-xdist
# starts after this file: the README's command runs the tests as the scripts run.
from rag_jax.devices import host  # noqa: E402  (imports no JAX)

os.environ.update(host.startup_environment())

import gc  # noqa: E402
import pathlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

SHARED_DATA = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "data"


MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per CPU this process may use, at most `MAX_WORKERS`.

    Most of a test's time on CPU is tracing and compiling, which runs on one thread, so a second
    worker on a 2-core machine keeps the second core busy; past a few workers each one's own
    imports (JAX, torch, transformers: ~1 GB) and 8 fake devices cost more memory than they win.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cpus or 1, MAX_WORKERS))


@pytest.fixture(scope="module")
def mesh():
    """A `data` mesh over the 8 fake CPU devices (`sharding.data_mesh`); skips with fewer."""
    import jax

    from rag_jax.devices import sharding

    if jax.device_count() != FAKE_DEVICES:
        pytest.skip(
            reason=f"needs {FAKE_DEVICES} devices (see conftest.py); got {jax.device_count()}"
        )
    return sharding.data_mesh()


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """After each test file, JAX's compiled programs and traces are dropped and the freed heap
    returned to the kernel: a worker runs many files, and their programs (kept alive by
    module-level jitted functions) had grown each of two workers past 7 GB of the machine's 24."""
    yield
    jax = sys.modules.get("jax")
    if jax is None:
        return
    jax.clear_caches()
    gc.collect()
    from rag_jax.devices import host

    host.release_free_memory()


@pytest.fixture(scope="session")
def shared_data():
    """The real QA data in ../shared/data; skips with the reason when a clone has none."""
    if not SHARED_DATA.is_dir():
        pytest.skip(
            reason=f"real QA data not found at {SHARED_DATA} (only present beside the project)"
        )
    return SHARED_DATA


def _free_bytes(path) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


class SmallDisk:
    """Real, small filesystems for disk-full tests: tmpfs mounts made (and unmounted) by a test.

    A real full disk fails where a real disk fails (a write, a flush on close, a rename's new
    directory entry), which is what the code under test must survive; raising ENOSPC by hand at
    chosen points would not show that.
    """

    def __init__(self, root: pathlib.Path):
        self.root, self.mounts = root, []

    def mount(self, size: str) -> pathlib.Path:
        """A new tmpfs of `size` (e.g. "64k"); skips the test where mounting is not allowed."""
        point = self.root / f"disk{len(self.mounts)}"
        point.mkdir()
        made = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
            capture_output=True,
            text=True,
        )
        if made.returncode:
            pytest.skip(
                reason="cannot mount a small tmpfs here (disk-full tests need root): "
                + (made.stderr.strip() or f"mount exited {made.returncode}")
            )
        self.mounts.append(point)
        return point

    def resize(self, point: pathlib.Path, size: str) -> None:
        """Grows (or shrinks) a mount made by `mount`: space freed, or taken away."""
        subprocess.run(["mount", "-o", f"remount,size={size}", str(point)], check=True)

    def fill(self, point: pathlib.Path, leave: int = 0) -> pathlib.Path:
        """Takes all but about `leave` bytes of the mount's free space with a filler file."""
        filler = point / ".filler"
        with open(filler, "ab") as f:
            need = _free_bytes(point) - leave
            while need > 0:
                try:
                    f.write(b"\0" * min(need, 1 << 16))
                    f.flush()
                except OSError:
                    break
                need = _free_bytes(point) - leave
        return filler

    def unmount_all(self) -> None:
        for point in reversed(self.mounts):
            subprocess.run(["umount", "-l", str(point)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    """`SmallDisk` under the test's tmp_path; every mount is gone after the test."""
    disks = SmallDisk(tmp_path)
    try:
        yield disks
    finally:
        disks.unmount_all()


@pytest.fixture(scope="session")
def tiny_trained_run(tmp_path_factory):
    """One finished tiny run of the default job (6 steps, shortened warm starts) and its summary:
    its workdir holds the trainer's bundle and predictions. Shared by the bundle and export tests
    (~30 s)."""
    from rag_jax.training import loop
    from tiny_runs import tiny_config

    workdir = tmp_path_factory.mktemp("tiny_trained")
    config = tiny_config(**{"warm_start.steps": 60, "eval.max_examples": 16})
    return workdir, loop.train_and_evaluate(config, workdir)
