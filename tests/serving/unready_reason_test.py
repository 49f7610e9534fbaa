"""An unready server says why in `/healthz`'s "reason": its warm-up compiling (which setting), a
compile that failed (which setting, and the error: a warm-up allocating more memory than the
machine has said 503 and nothing more), a probe answer not finite. Over the fake bundle of
`server_health_test` (no model, so fast)."""

import threading

import httpx
from hostile_server_test import InProcess
from server_health_test import FakeBundle, _health

from rag_jax.serving import app as serving

SETTING = "variant=token, num_beams=1, n_docs=3"  # the fake bundle's default


class Compiles(FakeBundle):
    """A fake bundle whose compile waits for `release`, then raises `error` (if any)."""

    def __init__(self, error: Exception | None = None):
        super().__init__()
        self.error, self.entered, self.release = error, threading.Event(), threading.Event()

    def compile(self, max_batch, **kwargs):
        self.entered.set()
        self.release.wait(30)
        if self.error is not None:
            raise self.error
        super().compile(max_batch, **kwargs)


def test_a_server_compiling_says_so_and_which_setting():
    model = Compiles()
    server = InProcess(model, serving.ServerConfig("unused", max_batch=4))
    try:
        assert model.entered.wait(30)
        health = _health(server, lambda h: h.status_code == 503)
        assert health.json()["reason"] == f"compiling the answering programs of {SETTING}"
        model.release.set()
        health = _health(server, lambda h: h.status_code == 200)
        assert "reason" not in health.json(), health.text
    finally:
        model.release.set()
        server.stop()


def test_a_failed_warm_up_compile_keeps_the_server_unready_saying_why():
    error = MemoryError("RESOURCE_EXHAUSTED: Out of memory allocating 4.1TB")
    model = Compiles(error)
    model.release.set()
    server = InProcess(model, serving.ServerConfig("unused", max_batch=4))
    try:
        health = _health(server, lambda h: "failed" in h.json().get("reason", ""))
        assert health.status_code == 503 and health.json()["ready"] is False
        assert health.json()["reason"] == (
            f"compiling the answering programs of {SETTING} failed (MemoryError: "
            "RESOURCE_EXHAUSTED: Out of memory allocating 4.1TB)"
        )
        response = httpx.post(f"{server.url}/v1/answer", json={"questions": ["why ?"]})
        assert response.status_code == 503  # refused, not attempted
    finally:
        server.stop()
