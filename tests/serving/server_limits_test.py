"""The server's bounds against many clients and heavy ones, over a fake bundle (no model, nothing
compiled: fast), a real uvicorn server in this process spoken to over raw sockets from distinct
loopback addresses (the whole 127.0.0.0/8 is loopback on Linux):

- clients from many addresses filling every connection slot leave one for each new client;
- a cold setting's slot is renewed only by requests it serves, freed when its client never
  comes back, and one client starts one at a time;
- Swagger UI is off unless asked for, then under the page's security headers;
- a response over `max_response_bytes` is refused, and one its client does not read is dropped
  with its connection at `send_timeout_s`;
- a chunked body's framing (sizes, extensions) counts against `max_body_bytes`.
"""

import base64
import hashlib
import json
import re
import socket
import threading
import time

import pytest
from fastapi.testclient import TestClient
from hostile_server_test import InProcess
from server_health_test import Clock, FakeBundle, _asked, _drain

from rag_jax.io import answers
from rag_jax.serving import app as serving
from rag_jax.serving import batching, state

HOST = b"Host: 127.0.0.1\r\n"
INFO = b"GET /v1/info HTTP/1.1\r\n" + HOST + b"\r\n"
MARGIN = 2.0  # seconds past a deadline for a close to reach the client on 2 loaded cores


class BigPassages(FakeBundle):
    """`FakeBundle` whose passages hold `text_bytes` bytes of text each (as an edit may plant)."""

    def __init__(self, text_bytes: int):
        super().__init__()
        self.text = "x" * text_bytes

    def generate(self, prepared, *, compiled_only):
        passages = tuple(
            answers.RetrievedPassage(f"p{i}", "", self.text, 1.0, 0.5, post)
            for i, post in enumerate(self.posteriors)
        )
        return [
            answers.Answer(q, "violet", -1.5, False, variant, passages, None)
            for q, variant in prepared
        ]


def _connect(port: int, source: str = "127.0.0.1", timeout: float = 20.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout, source_address=(source, 0))


def _response(sock: socket.socket) -> tuple[int, bytes]:
    """(status, body) of one whole response read from `sock`."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {data[:300]!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: *(\d+)", head, re.IGNORECASE).group(1))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, f"closed mid-body: {head!r}"
        body += chunk
    return int(head.split()[1]), body


def _closed(sock: socket.socket) -> bool:
    """Whether the server has closed `sock` (it sent nothing: fails if it did)."""
    sock.settimeout(0.05)
    try:
        data = sock.recv(1)
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    assert data == b"", data
    return True


def _wait(predicate, timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------------
# Connections shared out between clients


@pytest.mark.parametrize(
    "max_connections, addresses", [(32, 4), (256, 16)], ids=["32_from_4", "256_from_16"]
)
def test_clients_filling_every_slot_leave_one_for_each_new_client(max_connections, addresses):
    """`addresses` clients, each holding as many connections as it may (request heads half
    sent, under a 60 s deadline), fill `max_connections`: every request from anyone else
    answered 503 (12 of 12, at 32 from 4 addresses and at 256). Now each of 12 new clients
    takes a slot of the clients holding the most, is answered, and keeps its connection
    (answered again on it); a filling client asking for more meets the limit's 503."""
    per = max_connections // addresses
    config = serving.ServerConfig(
        "unused",
        max_connections=max_connections,
        max_connections_per_client=per,
        header_timeout_s=60.0,
        keep_alive_s=60.0,
    )
    server = InProcess(FakeBundle(), config, warm_up=False)
    filling, innocents = [], []
    try:
        server.wait_ready(30, compiled=False)
        open_now = server.server.server_state.connections
        for a in range(addresses):
            for _ in range(per):
                sock = _connect(server.port, f"127.0.1.{a + 1}")
                sock.sendall(b"GET /v1/info HTTP/1.1\r\n" + HOST + b"X-Slow: ")
                filling.append(sock)
        _wait(lambda: len(open_now) == max_connections, what="the server took every connection")
        for i in range(12):
            sock = _connect(server.port, f"127.0.2.{i + 1}")
            sock.sendall(INFO)
            assert _response(sock)[0] == 200, i
            innocents.append(sock)
        for i, sock in enumerate(innocents):  # none of them lost its slot to a later one
            sock.sendall(INFO)
            assert _response(sock)[0] == 200, i
        cut = [sock for sock in filling if _closed(sock)]
        evicted = server.state.metrics.snapshot()["evicted_connections"]
        assert 12 <= len(cut) == evicted <= 13, (len(cut), evicted)  # the first took two
        with _connect(server.port, "127.0.1.1") as sock:  # a filling client: it holds the most
            sock.sendall(INFO)
            assert _response(sock)[0] == 503
        assert len(open_now) < max_connections + 1
    finally:
        for sock in filling + innocents:
            sock.close()
        server.stop()


def test_the_connection_cap_per_client_does_not_grow_with_the_server():
    for total in (32, 256, 4096):
        assert (
            serving.ServerConfig("unused", max_connections=total).max_connections_per_client == 16
        )


# ---------------------------------------------------------------------------------------------
# Cold settings: renewed only by requests served, freed when unclaimed, one per client


COLD = [batching.Setting("sequence", beams, 3) for beams in range(2, 8)]


@pytest.fixture
def cold():
    config = serving.ServerConfig(
        "unused", max_batch=4, max_cold_settings=4, cold_idle_s=300.0, cold_claim_s=60.0
    )
    server_state = state.ServerState(FakeBundle(), config)
    server_state.clock = Clock()
    server_state.warm_up()
    _drain(server_state)
    yield server_state
    server_state.compiler.shutdown(wait=True)


def _asked_by(server_state, setting, client) -> int:
    try:
        server_state.check_warm(setting, client)
    except serving.ApiError as e:
        return e.status
    return 200


def test_four_requests_never_served_free_their_slots_after_cold_claim_s(cold):
    """Four clients each ask a new setting and never come back: the four slots were held for
    cold_idle_s (300 s); now each is free cold_claim_s (60 s) after its compile."""
    for i, setting in enumerate(COLD[:4]):
        assert _asked_by(cold, setting, f"10.0.0.{i}") == 503
    _drain(cold)
    assert _asked_by(cold, COLD[4], "10.0.0.9") == 422  # every slot taken
    cold.clock.now += 59.0
    assert _asked_by(cold, COLD[4], "10.0.0.9") == 422
    cold.clock.now += 2.0
    assert _asked_by(cold, COLD[4], "10.0.0.9") == 503  # compiling in a freed slot
    assert cold.last_used.keys() == {COLD[4]}


def test_a_request_it_does_not_serve_never_renews_a_slot(cold):
    """A failed setting asked again and again (500 each time) held its slot as long as it was
    asked; now it is freed cold_claim_s after its failure whatever is asked of it."""
    inner = cold.model.compile

    def failing(*args, **kwargs):
        if kwargs["num_beams"] == COLD[0].num_beams:
            raise RuntimeError("out of memory")
        return inner(*args, **kwargs)

    cold.model.compile = failing
    assert _asked_by(cold, COLD[0], "10.0.0.1") == 503
    _drain(cold)
    for setting in COLD[1:4]:
        assert _asked_by(cold, setting, None) == 503
    _drain(cold)
    for _ in range(5):
        cold.clock.now += 10.0
        assert _asked_by(cold, COLD[0], "10.0.0.2") == 500
        for setting in COLD[1:4]:  # served: their traffic keeps them
            assert _asked_by(cold, setting, "10.0.0.2") == 200
    cold.clock.now += 10.0  # 60 s since the failure, asked every 10 s
    assert _asked_by(cold, COLD[4], "10.0.0.3") == 503  # in the failed one's slot
    assert COLD[0] not in cold.last_used and COLD[0] not in cold.failed


def test_a_served_slot_is_kept_against_demand_by_a_request_every_cold_claim_s(cold):
    for setting in COLD[:4]:
        assert _asked_by(cold, setting, None) == 503
    _drain(cold)
    for setting in COLD[:4]:
        assert _asked_by(cold, setting, None) == 200
    cold.clock.now += 59.0
    for setting in COLD[1:4]:
        assert _asked_by(cold, setting, None) == 200
    assert _asked_by(cold, COLD[4], "10.0.0.1") == 422  # all served within 60 s
    cold.clock.now += 2.0  # COLD[0] last served 61 s ago: its slot goes to the new setting
    assert _asked_by(cold, COLD[4], "10.0.0.1") == 503
    assert COLD[0] not in cold.last_used and set(cold.last_used) == set(COLD[1:5])
    _drain(cold)
    assert _asked_by(cold, COLD[5], "10.0.0.2") == 422  # the others served 2 s ago
    # With no demand, a served slot stays for cold_idle_s.
    cold.clock.now += 240.0
    assert _asked(cold, COLD[1]) == 200


def test_one_client_starts_one_cold_setting_at_a_time(cold):
    """One address asking four new settings took every slot; now it is told 429 (with
    Retry-After) until its setting has served a request, and other clients start theirs."""
    assert _asked_by(cold, COLD[0], "10.0.0.1") == 503
    for setting in COLD[1:4]:
        with pytest.raises(serving.ApiError) as refused:
            cold.check_warm(setting, "10.0.0.1")
        assert refused.value.status == 429 and "Retry-After" in refused.value.headers
        assert "num_beams=2" in refused.value.message  # the setting to ask for first
    assert _asked_by(cold, COLD[1], "10.0.0.2") == 503  # another client's
    _drain(cold)
    assert _asked_by(cold, COLD[2], "10.0.0.1") == 429  # compiled, but it served none yet
    assert _asked_by(cold, COLD[0], "10.0.0.1") == 200
    assert _asked_by(cold, COLD[2], "10.0.0.1") == 503


# ---------------------------------------------------------------------------------------------
# Swagger UI


def _client(config) -> TestClient:
    return TestClient(serving.make_app(FakeBundle(), config, warm_up=False), "http://127.0.0.1")


def test_swagger_ui_and_redoc_are_off_by_default():
    client = _client(serving.ServerConfig("unused"))
    for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        assert client.get(path).status_code == 404, path
    assert client.get("/openapi.json").json()["info"]["title"] == "rag_jax"


def test_swagger_ui_when_asked_for_carries_the_pages_security_headers():
    """Its script and style sheet from the CDN only, its one inline script by its hash (no
    'unsafe-inline' script), never framed, nosniff; no ReDoc, no OAuth2 redirect page."""
    client = _client(serving.ServerConfig("unused", api_docs=True))
    page = client.get("/docs")
    assert page.status_code == 200 and "SwaggerUIBundle" in page.text
    assert page.headers["x-frame-options"] == "DENY"
    assert page.headers["x-content-type-options"] == "nosniff"
    policy = dict(
        part.strip().split(" ", 1) for part in page.headers["content-security-policy"].split(";")
    )
    assert policy["frame-ancestors"] == "'none'" and policy["object-src"] == "'none'"
    (inline,) = re.findall(r"<script>(.*?)</script>", page.text, re.DOTALL)
    digest = base64.b64encode(hashlib.sha256(inline.encode()).digest()).decode()
    scripts = policy["script-src"].split()
    assert sorted(scripts) == sorted([serving.DOCS_CDN, f"'sha256-{digest}'"]), scripts
    sources = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert sources and all(s.startswith(serving.DOCS_CDN + "/") or s == "data:," for s in sources)
    for path in ("/redoc", "/docs/oauth2-redirect"):
        assert client.get(path).status_code == 404, path


# ---------------------------------------------------------------------------------------------
# Responses: their size, and a client that does not read them


def test_an_answer_over_max_response_bytes_is_refused_naming_the_limit():
    """Two passages of 100 kB per question: one question's answer (~200 kB) is sent, eight
    questions' (~1.6 MB) are refused with a 422 naming the limit, and counted."""
    config = serving.ServerConfig("unused", max_batch=8, max_response_bytes=1 << 20)
    with TestClient(
        serving.make_app(BigPassages(100_000), config, warm_up=False), "http://127.0.0.1"
    ) as client:
        one = client.post("/v1/answer", json={"questions": ["why ?"]})
        assert one.status_code == 200 and len(one.content) > 200_000
        eight = client.post("/v1/answer", json={"questions": ["why ?"] * 8})
        assert eight.status_code == 422, eight.text[:300]
        message = eight.json()["error"]["message"]
        assert "max_response_bytes (1048576)" in message and "fewer questions" in message
        assert eight.headers["x-content-type-options"] == "nosniff"
        counted = client.get("/v1/metrics").json()["requests"]["/v1/answer"]
        assert counted == {"200": 1, "422": 1}


SEND_S = 5.0


def test_a_response_its_client_does_not_read_is_dropped_at_send_timeout_s():
    """A 16 MB answer to a client with a small receive buffer that never reads: the server held
    it (and the connection) for good; now the connection is cut send_timeout_s after the
    response began, counted, and the client finds it cut short. A client that reads gets it
    whole meanwhile."""
    # 5 s: the reading client takes the 16 MB within it even on a loaded machine (the server
    # shares this process and its GIL); at 1 s a CI run cut it short.
    config = serving.ServerConfig(
        "unused", send_timeout_s=SEND_S, max_response_bytes=64 << 20, keep_alive_s=60.0
    )
    server = InProcess(BigPassages(8 << 20), config, warm_up=False)
    try:
        server.wait_ready(30, compiled=False)
        body = b'{"questions": ["why ?"]}'
        post = (
            b"POST /v1/answer HTTP/1.1\r\n" + HOST + b"Content-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        with _connect(server.port) as reader:
            reader.sendall(post)
            status, whole = _response(reader)
        assert status == 200 and len(whole) > 16 << 20
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: it holds
        sock.settimeout(20)
        sock.connect(("127.0.0.1", server.port))
        with sock:
            sock.sendall(post)
            sent = time.monotonic()
            timed_out = lambda: server.state.metrics.snapshot()["timed_out"]["send"]  # noqa: E731
            _wait(lambda: timed_out() == 1, SEND_S + MARGIN + 10.0, "the response was not dropped")
            assert time.monotonic() - sent >= SEND_S
            got = b""
            try:
                while chunk := sock.recv(1 << 20):
                    got += chunk
            except ConnectionResetError:
                pass
        assert got.startswith(b"HTTP/1.1 200") and len(got) < len(whole), len(got)
        assert not server.server.server_state.connections
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------------
# Chunked bodies: every byte of the framing counted


@pytest.fixture(scope="module")
def small_body_server():
    server = InProcess(
        FakeBundle(), serving.ServerConfig("unused", max_body_bytes=4096), warm_up=False
    )
    try:
        server.wait_ready(30, compiled=False)
        yield server
    finally:
        server.stop()


def _chunked(chunks: list[bytes]) -> bytes:
    head = (
        b"POST /v1/answer HTTP/1.1\r\n" + HOST + b"Content-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    return head + b"".join(chunks) + b"0\r\n\r\n"


def test_a_chunked_body_with_small_extensions_is_answered(small_body_server):
    body = json.dumps({"questions": ["why ?"]}).encode()
    chunks = [
        b"%x;name=value\r\n%s\r\n" % (len(body[i : i + 5]), body[i : i + 5])
        for i in range(0, len(body), 5)
    ]
    with _connect(small_body_server.port) as sock:
        sock.sendall(_chunked(chunks))
        status, answer = _response(sock)
    assert status == 200 and json.loads(answer)["answers"][0]["answer"] == "violet"


def test_chunk_extensions_count_against_the_body_limit(small_body_server):
    """Five bytes of data, each in a chunk with a 1,000-byte extension: 5 kB as sent, over the
    4,096-byte limit though the data is not: 413 naming the framing, and the connection closed."""
    chunks = [b"1;e=" + b"a" * 1000 + b"\r\n" + b"x\r\n" for _ in range(5)]
    with _connect(small_body_server.port) as sock:
        sock.sendall(_chunked(chunks)[: -len(b"0\r\n\r\n")])  # the body not yet ended
        status, refusal = _response(sock)
        assert status == 413
        message = json.loads(refusal)["error"]["message"]
        assert "chunked framing" in message and "max_body_bytes" in message
        assert sock.recv(1) == b""  # closed


def test_a_flood_of_chunk_extensions_is_cut_at_the_body_limit(small_body_server):
    """One connection sending 60 kB chunk extensions, a byte of data each, as fast as it can:
    2.6 GB in 20 s went in, all parsed; now the server stops reading at the limit, and what
    the client could write before the close is what the kernels' buffers hold."""
    flood = b"1;e=" + b"a" * 60_000 + b"\r\nx\r\n"
    sent, stop = [0], threading.Event()

    def write(sock):
        try:
            sock.sendall(_chunked([])[: -len(b"0\r\n\r\n")])
            while not stop.is_set() and sent[0] < 1 << 30:
                sock.sendall(flood)
                sent[0] += len(flood)
        except OSError:
            pass  # the server closed

    with _connect(small_body_server.port, timeout=30) as sock:
        writer = threading.Thread(target=write, args=(sock,), daemon=True)
        writer.start()
        writer.join(30)
        stop.set()
        assert not writer.is_alive()
    assert sent[0] < 64 << 20, sent[0]
    assert _response_ok(small_body_server)


def _response_ok(server) -> bool:
    with _connect(server.port) as sock:
        sock.sendall(INFO)
        return _response(sock)[0] == 200
