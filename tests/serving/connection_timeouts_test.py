"""Slow and silent clients against a real uvicorn server (`serving.uvicorn_config`, in this
process) over raw sockets on 127.0.0.1: a connection that sends nothing, a request head that
stalls or trickles (slowloris) and a body that trickles are closed at their deadline, without a
response; an idle kept-alive connection too; the other clients are answered meanwhile."""

import math
import re
import socket
import threading
import time

import httpx
import pytest
from hostile_server_test import InProcess

from rag_jax.io import bundle
from rag_jax.serving import app as serving
from rag_jax.serving import connections

# Every client here is 127.0.0.1: its share of the connections is more than all of them, so
# that the attack below meets uvicorn's limit (serve_connections_test: one address's share).
LIMITS = dict(
    header_timeout_s=1.0,
    body_timeout_s=1.0,
    keep_alive_s=1.0,
    max_connections=8,
    max_connections_per_client=16,
)
MARGIN = 1.5  # seconds past a deadline for the close to reach the client on 2 loaded cores
HOST = b"Host: 127.0.0.1\r\n"


@pytest.fixture(scope="module")
def server(tiny_trained_run):
    """A server of the tiny run's bundle with 1 s deadlines, ready at once (nothing compiled:
    these tests ask no answers)."""
    directory = tiny_trained_run[0] / "bundle"
    config = serving.ServerConfig(str(directory), **LIMITS)
    server = InProcess(bundle.load(directory), config, warm_up=False)
    try:
        server.wait_ready(60)
        yield server
    finally:
        server.stop()


def _connect(port) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _closed_at(sock, limit: float) -> tuple[float, bytes]:
    """(time.monotonic() when the server closed `sock`, the bytes it sent before); fails if it
    is still open `limit` seconds from now."""
    sock.settimeout(limit)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except TimeoutError:
        pytest.fail(f"the server kept the connection open for {limit} s more")
    except ConnectionResetError:
        pass
    return time.monotonic(), got


def _response_head(sock) -> bytes:
    """Reads one whole response from `sock`; returns its status line and headers."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: *(\d+)", head, re.IGNORECASE).group(1))
    while len(body) < length:
        body += sock.recv(65536)
    return head


def _timed_out(server) -> dict:
    return dict(server.state.metrics.snapshot()["timed_out"])


def _trickle(sock, stop: threading.Event, every: float = 0.1) -> None:
    """Sends one byte every `every` seconds until `stop` or the server closes `sock`."""
    while not stop.wait(every):
        try:
            sock.sendall(b"a")
        except OSError:
            return


def test_stalled_trickled_and_silent_request_heads_are_closed_at_the_deadline(server):
    """Slowloris: 3 heads stalled mid-header, one trickled a byte per 0.1 s (its bytes do not
    extend the deadline), one connection that sends nothing. Each is closed header_timeout_s
    after it opened, with no response; a normal client is answered during the attack."""
    before = _timed_out(server)
    opened = time.monotonic()
    stalled = [_connect(server.port) for _ in range(3)]
    for sock in stalled:
        sock.sendall(b"GET /v1/info HTTP/1.1\r\n" + HOST + b"X-Slow: ")
    silent, trickled = _connect(server.port), _connect(server.port)
    trickled.sendall(b"GET /v1/info HTTP/1.1\r\n" + HOST + b"X-Slow: ")
    stop = threading.Event()
    thread = threading.Thread(target=_trickle, args=(trickled, stop), daemon=True)
    thread.start()
    try:
        time.sleep(0.2)
        info = httpx.get(f"{server.url}/v1/info", timeout=5)
        pid = server.state.model.store.ids[0]
        passage = httpx.get(f"{server.url}/v1/passages/{pid}", timeout=5)
        answered = time.monotonic()
        assert info.status_code == 200 and info.json()["passages"] > 0
        assert passage.status_code == 200 and passage.json()["id"] == pid
        assert answered - opened < LIMITS["header_timeout_s"]  # while the attack held on
        limit = LIMITS["header_timeout_s"] + MARGIN
        for sock in [*stalled, trickled, silent]:
            closed, got = _closed_at(sock, limit)
            assert got == b""  # closed, not answered
            assert 0.9 <= closed - opened <= limit, closed - opened
    finally:
        stop.set()
        thread.join(5)
        for sock in [*stalled, silent, trickled]:
            sock.close()
    after = _timed_out(server)
    assert after["headers"] - before["headers"] == 5
    assert after["body"] == before["body"]


def test_an_attack_holding_every_connection_slot_ends_at_the_header_timeout(server):
    """max_connections stalled heads make every other request answer 503 (uvicorn's limit):
    the deadline frees the slots, and the next request is answered."""
    opened = time.monotonic()
    attack = [_connect(server.port) for _ in range(LIMITS["max_connections"])]
    try:
        for sock in attack:
            sock.sendall(b"GET /healthz HTTP/1.1\r\n")
        time.sleep(0.3)  # the server has taken every connection
        refused = httpx.get(f"{server.url}/healthz", timeout=5)
        assert refused.status_code == 503, refused.text  # the attack bites
        for sock in attack:
            closed, _ = _closed_at(sock, LIMITS["header_timeout_s"] + MARGIN)
            assert closed - opened >= 0.9
    finally:
        for sock in attack:
            sock.close()
    time.sleep(0.2)  # the server has seen the closes
    assert httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200


def test_a_trickled_body_is_closed_at_the_deadline_and_counted_as_a_client_gone(server):
    """A body declared 200 bytes long, sent a byte per 0.1 s: closed body_timeout_s after its
    head; the route waiting for it counts a 499 (client closed), not a 500."""
    before = server.state.metrics.snapshot()
    head = (
        b"POST /v1/answer HTTP/1.1\r\n" + HOST + b"Content-Type: application/json\r\n"
        b"Content-Length: 200\r\n\r\n"
    )
    with _connect(server.port) as sock:
        sock.sendall(head + b'{"questions": ["')
        sent = time.monotonic()
        stop = threading.Event()
        thread = threading.Thread(target=_trickle, args=(sock, stop), daemon=True)
        thread.start()
        try:
            closed, got = _closed_at(sock, LIMITS["body_timeout_s"] + MARGIN)
        finally:
            stop.set()
            thread.join(5)
    assert got == b""
    assert 0.9 <= closed - sent, closed - sent
    after = before
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the handler learns of the close on the event loop
        after = server.state.metrics.snapshot()
        if after["requests"].get("/v1/answer", {}).get("499", 0) > 0:
            break
        time.sleep(0.05)
    answered = lambda m, s: m["requests"].get("/v1/answer", {}).get(s, 0)  # noqa: E731
    assert answered(after, "499") - answered(before, "499") == 1
    assert answered(after, "500") == answered(before, "500")
    assert after["timed_out"]["body"] - before["timed_out"]["body"] == 1
    assert after["timed_out"]["headers"] == before["timed_out"]["headers"]


def test_an_idle_kept_alive_connection_and_a_stalled_next_request_are_closed(server):
    """After a response the connection waits keep_alive_s for the next request; the first
    bytes of one stop that wait and start the head's deadline, which a stall then meets."""
    with _connect(server.port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\n" + HOST + b"\r\n")
        assert _response_head(sock).startswith(b"HTTP/1.1 200")
        answered = time.monotonic()
        closed, got = _closed_at(sock, LIMITS["keep_alive_s"] + MARGIN)
        assert got == b"" and 0.9 <= closed - answered, closed - answered
    before = _timed_out(server)
    with _connect(server.port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\n" + HOST + b"\r\n")
        assert _response_head(sock).startswith(b"HTTP/1.1 200")
        time.sleep(0.5)  # half the keep-alive wait
        sock.sendall(b"GET /healthz HTTP/1.1\r\n")  # the next request's head, then a stall
        started = time.monotonic()
        closed, got = _closed_at(sock, LIMITS["header_timeout_s"] + MARGIN)
        assert got == b"" and 0.9 <= closed - started, closed - started
    assert _timed_out(server)["headers"] - before["headers"] == 1


def test_a_deadline_must_be_a_positive_number_of_seconds():
    for header, body, name in [(0, 1, "header_timeout_s"), (1, -2, "body_timeout_s")]:
        with pytest.raises(ValueError, match=f"{name} must be a positive number of seconds"):
            connections.protocol(header, body)
    with pytest.raises(ValueError, match="body_timeout_s .* got nan"):
        connections.protocol(1, math.nan)
    timed = connections.protocol(2, 3)
    assert (timed.header_timeout_s, timed.body_timeout_s) == (2.0, 3.0)
