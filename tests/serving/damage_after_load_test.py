"""Damage done on disk after a bundle is loaded: `Bundle.verify` re-checks every file against the
manifest, and a server re-checking every `verify_every_s` turns unready naming the file, instead
of quoting the damaged passages with `/healthz` at 200 until its next edit or start."""

import shutil
import time

import httpx
import numpy as np
import pytest
from hostile_server_test import InProcess
from server_health_test import _health

from rag_jax.io import bundle
from rag_jax.io.bundle_format import DamagedBundleError
from rag_jax.serving import app as serving


def _flip(path, offset: int = 3) -> None:
    """One byte of the live file changed in place (as a disk or another process would)."""
    live = np.memmap(path, np.uint8, mode="r+")
    live[offset] ^= 0xFF
    live.flush()
    del live


@pytest.fixture
def copied(tiny_trained_run, tmp_path):
    workdir, _ = tiny_trained_run
    shutil.copytree(workdir / "bundle", tmp_path / "bundle")
    return tmp_path / "bundle"


@pytest.mark.parametrize("rel", ["passages/texts.bin", "index/vectors.bin"])
def test_verify_names_a_file_changed_after_the_load(copied, rel):
    model = bundle.load(copied)
    model.verify()  # as loaded: fine
    _flip(copied / rel)
    with pytest.raises(DamagedBundleError, match=rf"{rel}.*restore the bundle from a good copy"):
        model.verify()


def test_a_server_finds_damage_between_edits_and_turns_unready_naming_the_file(copied):
    model = bundle.load(copied)
    config = serving.ServerConfig(str(copied), max_batch=4, verify_every_s=0.2)
    server = InProcess(model, config, warm_up=False)
    try:
        assert _health(server, lambda h: h.status_code == 200).json()["ready"]
        time.sleep(0.5)  # a few checks pass: nothing is damaged
        assert httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200
        _flip(copied / "passages" / "texts.bin")
        health = _health(server, lambda h: h.status_code == 503)
        reason = health.json()["reason"]
        assert reason.startswith("damaged: ") and "bundle/passages/texts.bin" in reason
        assert str(copied.parent) not in reason  # the server's folders are not named
        answer = httpx.post(f"{server.url}/v1/answer", json={"questions": ["who ?"]}, timeout=5)
        assert answer.status_code == 503  # its passages are not quoted any more
        assert "texts.bin" in answer.json()["error"]["message"]
    finally:
        server.stop()
