"""`host.start_jax_leaving_a_core`: XLA's CPU pool started one thread short of the CPUs, every
thread free to use them all after. Each case runs in a fresh process (a pool is sized once)."""

import json
import os
import subprocess
import sys

import pytest

from rag_jax.devices import host

_PROBE = """
import json, os, sys
before = os.sched_getaffinity(0)
if sys.argv[1] == "leave":
    from rag_jax.devices import host
    size = host.start_jax_leaving_a_core()
else:
    import jax
    jax.devices()
    size = None
import jax, jax.numpy as jnp
x = jnp.ones((256, 256))
(x @ x).block_until_ready()  # runs on the pool
threads = os.listdir("/proc/self/task")
print(json.dumps({
    "size": size,
    "threads": len(threads),
    "cpus": sorted(before),
    "affinities": sorted({tuple(sorted(os.sched_getaffinity(int(t)))) for t in threads}),
}))
"""


def _probe(mode: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(
        "--xla_force_host_platform_device_count=8", ""
    )
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs a host with 2 or more CPUs this process may use",
)
def test_the_pool_is_one_thread_short_and_every_thread_may_use_every_cpu():
    plain, leaving = _probe("plain"), _probe("leave")
    assert leaving["size"] == len(leaving["cpus"]) - 1
    # XLA makes fewer threads when it starts on fewer CPUs: the pool shrank ...
    assert leaving["threads"] < plain["threads"], (leaving, plain)
    # ... and no thread, the pool's included, stays held to fewer CPUs than the process had.
    assert leaving["affinities"] == [leaving["cpus"]], leaving


def test_after_jax_started_it_changes_nothing():
    import jax

    jax.devices()
    threads = len(os.listdir("/proc/self/task"))
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    host.start_jax_leaving_a_core()
    assert len(os.listdir("/proc/self/task")) == threads
    if cpus is not None:
        assert os.sched_getaffinity(0) == cpus
