"""The server's HTTP layer against a real uvicorn server (`serving.uvicorn_config`, in this
process, over the tiny run's bundle, nothing compiled: these tests ask no answers) and the real
`experiments/serve.py`: a request framed twice is refused and its connection closed, so a
request smuggled in its body is never answered; a client writing a body over the limit reads
the 413; HEAD is answered on GET routes; every response says nosniff and the page also its
Content-Security-Policy; a port in use stops `serve.py` at once, saying so."""

import html.parser
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import httpx
import pytest
from hostile_server_test import InProcess

from rag_jax.io import bundle
from rag_jax.serving import app as serving
from rag_jax.serving import connections

REPO = pathlib.Path(__file__).resolve().parents[2]
LIMIT = 1 << 20  # the default max_body_bytes
HOST = b"Host: 127.0.0.1\r\n"


@pytest.fixture(scope="module")
def server(tiny_trained_run, tmp_path_factory):
    """A server with edits of a copy of the tiny run's bundle, at the default limits."""
    directory = tmp_path_factory.mktemp("http") / "bundle"
    shutil.copytree(tiny_trained_run[0] / "bundle", directory)
    config = serving.ServerConfig(str(directory), allow_edits=True)
    server = InProcess(bundle.load(directory), config, warm_up=False)
    try:
        server.wait_ready(60)
        yield server
    finally:
        server.stop()


def _exchange(port: int, data: bytes, timeout: float = 10.0) -> tuple[bytes, bool]:
    """Sends `data` on a new connection; (every byte the server sent, whether it closed the
    connection within `timeout`)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except TimeoutError:
            return got, False
        except ConnectionResetError:
            pass
    return got, True


# ---------------------------------------------------------------------------------------------
# Framing


@pytest.mark.parametrize("chunked_first", [False, True], ids=["length_first", "chunked_first"])
def test_a_request_framed_twice_is_refused_and_what_it_smuggles_is_never_answered(
    server, chunked_first
):
    """Read by its chunks, the body below ends at once and the GET after it was answered as a
    second request: a proxy reading by Content-Length would have sent it as part of the body."""
    smuggled = b"GET /v1/info HTTP/1.1\r\n" + HOST + b"\r\n"
    body = b"0\r\n\r\n" + smuggled
    framings = [b"Content-Length: %d\r\n" % len(body), b"Transfer-Encoding: chunked\r\n"]
    if chunked_first:
        framings.reverse()
    head = b"POST /v1/answer HTTP/1.1\r\n" + HOST + b"Content-Type: application/json\r\n"
    got, closed = _exchange(server.port, head + b"".join(framings) + b"\r\n" + body)
    assert closed, got  # RFC 9112 6.3: the connection closes after the 400
    assert got.count(b"HTTP/1.1 ") == 1 and got.startswith(b"HTTP/1.1 400 "), got
    head, _, payload = got.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower() and b"nosniff" in head.lower(), head
    message = json.loads(payload)["error"]["message"]
    assert "Content-Length" in message and "Transfer-Encoding" in message, message
    assert httpx.get(f"{server.url}/healthz").status_code == 200  # the server goes on


# ---------------------------------------------------------------------------------------------
# Bodies over the limit


@pytest.mark.parametrize("size", [LIMIT + 1, 2 * LIMIT, 4 * LIMIT], ids=["+1", "x2", "x4"])
def test_a_client_writing_a_body_over_the_limit_reads_the_413(server, size):
    """urllib writes the whole body before it reads: the server answered from Content-Length
    and closed (urllib asks Connection: close) on bytes unread, which reset the connection
    under it ("connection reset" or "broken pipe", not the 413). It reads and drops up to 4
    times the limit first."""
    for _ in range(10):  # the reset came from how far the client had written: not every time
        request = urllib.request.Request(
            f"{server.url}/v1/answer", data=b" " * size, headers={"Content-Type": "text/plain"}
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 413
        assert "max_body_bytes" in json.loads(refused.value.read())["error"]["message"]


def test_a_body_over_the_limit_is_refused_before_it_is_sent_when_the_client_asks(server):
    """With `Expect: 100-continue` the client sends nothing until told to: it is told 413 at
    once, not 100, and the connection closes (no body follows to frame a next request)."""
    head = (
        b"POST /v1/answer HTTP/1.1\r\n" + HOST + b"Content-Type: application/json\r\n"
        b"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n" % (LIMIT + 1)
    )
    start = time.monotonic()
    got, closed = _exchange(server.port, head, timeout=10)
    assert closed and time.monotonic() - start < 5, got  # not at the body's 30 s deadline
    assert got.startswith(b"HTTP/1.1 413 ") and b"100 Continue" not in got, got


def test_a_drained_413_leaves_a_kept_alive_connection_usable(server):
    body = b" " * (LIMIT + 1)
    head = b"POST /v1/answer HTTP/1.1\r\n" + HOST + b"Content-Length: %d\r\n\r\n" % len(body)
    after = b"GET /healthz HTTP/1.1\r\n" + HOST + b"Connection: close\r\n\r\n"
    got, closed = _exchange(server.port, head + body + after)
    assert closed and got.startswith(b"HTTP/1.1 413 "), got[:200]
    assert got.count(b"HTTP/1.1 ") == 2 and b"HTTP/1.1 200 " in got, got


# ---------------------------------------------------------------------------------------------
# Headers and HEAD


class _PageParts(html.parser.HTMLParser):
    """What of a page a `default-src 'self'` policy would block: inline scripts and styles,
    event-handler attributes, and resources from other origins."""

    def __init__(self):
        super().__init__()
        self.blocked, self.sources, self._in_script = [], [], False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "style" or "style" in attrs or any(a.startswith("on") for a in attrs):
            self.blocked.append((tag, attrs))
        if tag == "script" and "src" not in attrs:
            self.blocked.append((tag, attrs))
        self._in_script = tag == "script"
        for key in ("src", "href"):
            if key in attrs and tag in ("script", "link", "img", "iframe"):
                self.sources.append(attrs[key])

    def handle_data(self, data):
        if self._in_script and data.strip():
            self.blocked.append(("script", data[:40]))

    def handle_endtag(self, tag):
        self._in_script = False


def test_the_page_sends_its_security_headers_and_keeps_to_what_they_allow(server):
    page = httpx.get(f"{server.url}/")
    assert page.status_code == 200
    policy = page.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "frame-ancestors 'none'" in policy, policy
    assert page.headers["x-frame-options"] == "DENY"
    assert page.headers["x-content-type-options"] == "nosniff"
    parts = _PageParts()
    parts.feed(page.text)
    assert parts.blocked == [], parts.blocked
    assert parts.sources and all(s.startswith("/static/") for s in parts.sources), parts.sources
    for source in parts.sources:  # the page's own files, served here (what 'self' allows)
        assert httpx.get(f"{server.url}{source}").status_code == 200, source


def test_every_response_says_nosniff(server):
    url = server.url
    answers = [
        httpx.get(f"{url}/healthz"),
        httpx.get(f"{url}/static/page.js"),
        httpx.get(f"{url}/v1/passages/no-such-id"),  # 404 from the route
        httpx.get(f"{url}/no/such/route"),  # 404 from the router
        httpx.get(f"{url}/healthz", headers={"Host": "attacker.example"}),  # 400, the host
        httpx.post(f"{url}/v1/answer", content=b"x" * (LIMIT + 1)),  # 413, the body's size
    ]
    assert [r.status_code for r in answers] == [200, 200, 404, 404, 400, 413]
    for response in answers:
        assert response.headers.get("x-content-type-options") == "nosniff", response.request.url


@pytest.mark.parametrize("path", ["/", "/healthz", "/v1/info", "/static/page.js", "/metrics"])
def test_head_is_answered_on_get_routes_without_a_body(server, path):
    """FastAPI routes GET alone: HEAD answered 405 (a monitor's HEAD /healthz failed)."""
    get = httpx.get(f"{server.url}{path}")
    head = httpx.head(f"{server.url}{path}")
    assert (get.status_code, head.status_code) == (200, 200), head.text
    assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"]
    if path in ("/", "/static/page.js"):  # the others' bodies change from one call to the next
        assert head.headers["content-length"] == get.headers["content-length"]


def test_head_on_a_post_route_is_still_405(server):
    response = httpx.head(f"{server.url}/v1/answer")
    assert response.status_code == 405 and response.content == b""


# ---------------------------------------------------------------------------------------------
# The listening socket


def test_serve_py_on_a_port_in_use_says_so_and_exits_1(tiny_trained_run):
    """It bound the port only after loading the bundle, logged "serving on ...", then died of
    uvicorn's bind error (exit 3, or 139 when the warm-up's compile thread was running)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = dict(os.environ, PYTHONPATH=str(REPO))
        start = time.monotonic()
        run = subprocess.run(
            [sys.executable, str(REPO / "experiments" / "serve.py")]
            + ["--bundle", str(tiny_trained_run[0] / "bundle"), "--port", str(port)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        took = time.monotonic() - start
    assert run.returncode == 1, (run.returncode, run.stderr[-2000:])
    assert f"127.0.0.1:{port}" in run.stderr and "in use" in run.stderr, run.stderr[-2000:]
    assert "serving" not in run.stderr, run.stderr[-2000:]  # nothing was loaded
    # Before JAX is imported (several seconds on 2 loaded cores): a second or two.
    assert took < 30, took


def test_bind_names_the_address_and_the_cause():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=rf"cannot listen on 127.0.0.1:{port}: port {port} is in"):
            connections.bind("127.0.0.1", port)
    with connections.bind("127.0.0.1", 0) as free:  # a free port binds
        assert free.getsockname()[1] > 0
