"""Damage done to a served bundle's live files while an edit runs is never sealed.

Against the real `experiments/serve.py --allow_edits` (a subprocess on 127.0.0.1, over a copy of
the tiny run's bundle), one byte of the live `passages/texts.bin` or `index/vectors.bin` is
flipped once the edit's new folder (`.bundle.new.*`) exists: after the edit's checks, before its
copy reads the file. The copy read the damaged byte, hashed the new file afresh and sealed it
(PUT 201, and a verified load accepted the bundle). Now the PUT answers 500 naming the file,
the server keeps answering, and the folder is the previous bundle (which a verified load
refuses until the byte is put back).

The window is held open by `held_serve.py` (the server waits, at its first write of the file's
copy, until the byte is flipped): the flip lands before the copy on every run."""

import concurrent.futures
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time
import types

import httpx
import numpy as np
import pytest

from rag_jax.io import bundle
from rag_jax.retrieval import files

# A trained run, a server start and three edits a test: ~1-2 minutes on 2 cores.
pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _until(found_fn, timeout: float, what: str):
    """`found_fn()` once it is truthy, polled every 2 ms."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := found_fn():
            return found
        time.sleep(0.002)
    raise TimeoutError(f"no {what} after {timeout} s")


def _flip(path: pathlib.Path) -> None:
    """Flips the lowest bit of `path`'s middle byte in place (the server's memory maps of the
    file see it; the file is never truncated under them)."""
    live = np.memmap(path, np.uint8, mode="r+")
    live[len(live) // 2] ^= 1
    live.flush()
    del live


@pytest.fixture(scope="module")
def served(tiny_trained_run, tmp_path_factory):
    """The server (`held_serve.py`) with edits over a copy of the tiny run's bundle, ready, and
    edited once: a loaded bundle reads its vectors into memory, an edited one maps them from
    the live file (as a served bundle's are after its first edit)."""
    root = tmp_path_factory.mktemp("damage_during_edit")
    directory, control = root / "bundle", root / "control"
    shutil.copytree(tiny_trained_run[0] / "bundle", directory)
    control.mkdir()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(
        "--xla_force_host_platform_device_count=8", ""
    )
    log_path = root / "serve.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "serving" / "held_serve.py"), str(control)]
            + ["--bundle", str(directory), "--port", str(port), "--allow_edits", "--max_batch=1"],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 400
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"serve.py did not get ready: {log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        first = httpx.put(f"{url}/v1/passages/first", json={"text": "a first text ."}, timeout=300)
        assert first.status_code == 201, first.text
        yield types.SimpleNamespace(url=url, directory=directory, control=control)
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _answers(url: str) -> None:
    response = httpx.post(f"{url}/v1/answer", json={"questions": ["who is it ?"]}, timeout=120)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("rel", ["passages/texts.bin", "index/vectors.bin"])
def test_a_byte_flipped_while_an_edit_copies_the_file_is_never_sealed(served, rel):
    url, directory, control = served.url, served.directory, served.control
    manifest = (directory / files.MANIFEST).read_bytes()
    live = directory / rel
    hold, go = control / f"hold-{live.name}", control / "go"
    hold.touch()
    pid = f"added-{live.name}"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        put = pool.submit(
            httpx.put, f"{url}/v1/passages/{pid}", json={"text": "an added text ."}, timeout=300
        )
        try:
            new = f".{directory.name}.new.*"
            _until(lambda: list(directory.parent.glob(new)), 240, f"{new} beside the bundle")
            _flip(live)
        finally:
            hold.unlink()
            go.touch()
        response = put.result()
    go.unlink()
    assert response.status_code == 500, response.text
    message = response.json()["error"]["message"]
    assert f"{rel} changed while it was read for the edit" in message, message
    # Nothing new was sealed: the folder holds the previous bundle and no other folder is left.
    assert (directory / files.MANIFEST).read_bytes() == manifest
    assert sorted(p.name for p in directory.parent.iterdir()) == ["bundle", "control", "serve.log"]
    with pytest.raises(ValueError, match=rf"{rel} is corrupted"):
        bundle.load(directory)
    # The server still serves the previous passages.
    assert httpx.get(f"{url}/v1/passages/{pid}").status_code == 404
    assert httpx.get(f"{url}/v1/passages/first").json()["text"] == "a first text ."
    _answers(url)
    # The byte put back, the bundle is whole again and takes the edit.
    _flip(live)
    again = httpx.put(f"{url}/v1/passages/{pid}", json={"text": "an added text ."}, timeout=300)
    assert again.status_code == 201, again.text
    edited = bundle.load(directory).store
    assert edited.text(len(edited) - 1) == "an added text ."
