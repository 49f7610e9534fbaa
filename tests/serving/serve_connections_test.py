"""Connections against the real `experiments/serve.py` (a subprocess on 127.0.0.1, over the tiny
run's bundle), spoken to over raw sockets bound to distinct loopback source addresses (the whole
127.0.0.0/8 is loopback on Linux): one address trickling request heads on many connections holds
at most `--max_connections_per_client` of them, and the other addresses are answered meanwhile;
a client that half-closes its connection after its request (`shutdown(SHUT_WR)`) reads the
response, then the server closes."""

import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from rag_jax.serving import connections

REPO = pathlib.Path(__file__).resolve().parents[2]
MAX_CONNECTIONS = 32
PER_CLIENT = 8
ATTACKER, BYSTANDER = "127.0.0.2", "127.0.0.3"
HOST = b"Host: 127.0.0.1\r\n"
INFO = b"GET /v1/info HTTP/1.1\r\n" + HOST + b"\r\n"
# Long deadlines: a connection closed within seconds was refused or answered, not timed out.
FLAGS = [
    f"--max_connections={MAX_CONNECTIONS}",
    f"--max_connections_per_client={PER_CLIENT}",
    "--header_timeout_s=60",
    "--keep_alive_s=60",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_trained_run, tmp_path_factory):
    """(the port, the process) of `serve.py` over the tiny run's bundle, once it answers
    `/v1/info` (the warm-up compiles in the background: these tests need no answer)."""
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(
        "--xla_force_host_platform_device_count=8", ""
    )
    log_path = tmp_path_factory.mktemp("serve_connections") / "serve.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, str(REPO / "experiments" / "serve.py")]
            + ["--bundle", str(tiny_trained_run[0] / "bundle"), "--port", str(port), *FLAGS],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"serve.py did not start: {log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/info", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        yield port, process
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _connect(port: int, source: str, timeout: float = 20.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout, source_address=(source, 0))


def _read_to_close(sock: socket.socket, timeout: float = 20.0) -> bytes:
    """Every byte the server sends until it closes `sock`; fails if it is open `timeout` s on."""
    sock.settimeout(timeout)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except TimeoutError:
        pytest.fail(f"the server kept the connection open {timeout} s; it sent {got[:300]!r}")
    except ConnectionResetError:
        pass
    return got


def _closed(sock: socket.socket) -> bool:
    """Whether the server has closed `sock` (without sending anything: fails if it did)."""
    sock.settimeout(0.05)
    try:
        data = sock.recv(1)
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    assert data == b"", data
    return True


def _statuses(data: bytes) -> list[int]:
    """The statuses of the responses in `data` (a response follows the body before it)."""
    return [int(status) for status in re.findall(rb"HTTP/1\.1 (\d{3}) ", data)]


def _refused(port: int) -> int:
    """The server's count of connections closed on arrival (its client held its share)."""
    return httpx.get(f"http://127.0.0.1:{port}/v1/metrics", timeout=20).json()[
        "refused_connections"
    ]


def _trickle(socks: list[socket.socket], stop: threading.Event) -> None:
    """A byte of a header's value on each socket every 0.5 s (never a whole head) until `stop`."""
    while not stop.wait(0.5):
        for sock in socks:
            try:
                sock.send(b"a")
            except OSError:
                pass  # closed by the server


def test_one_address_trickling_heads_holds_its_share_and_the_others_are_answered(server):
    """36 connections from one address trickle their request heads (slowloris, under the
    60 s deadline): beyond --max_connections_per_client they are closed on arrival, unread, so
    the address holds 8 of the 32 slots, and 40 requests from another address all answer 200
    (they all answered 503: every connection counted against --max_connections). A request from
    the attacking address is refused meanwhile; once its connections close, it is answered."""
    port, _ = server
    refused_before = _refused(port)
    attack = [_connect(port, ATTACKER) for _ in range(36)]
    stop = threading.Event()
    thread = threading.Thread(target=_trickle, args=(attack, stop), daemon=True)
    try:
        for sock in attack:
            sock.sendall(b"GET /v1/info HTTP/1.1\r\n" + HOST + b"X-Slow: ")
        thread.start()
        deadline = time.monotonic() + 15
        refused = []
        while time.monotonic() < deadline:
            refused = [sock for sock in attack if _closed(sock)]
            if len(refused) >= len(attack) - PER_CLIENT:
                break
            time.sleep(0.2)
        held = [sock for sock in attack if sock not in refused]
        assert len(held) == PER_CLIENT, (len(held), len(refused))
        with httpx.Client(transport=httpx.HTTPTransport(local_address=BYSTANDER)) as client:
            statuses = [
                client.get(f"http://127.0.0.1:{port}/v1/info", timeout=20).status_code
                for _ in range(40)
            ]
        assert statuses == [200] * 40, statuses
        with _connect(port, ATTACKER) as sock:  # the attacking address: refused, unanswered
            try:
                sock.sendall(INFO)
            except OSError:
                pass  # already closed
            assert _read_to_close(sock) == b""
        assert not any(_closed(sock) for sock in held)  # the head's deadline is 60 s
        assert _refused(port) - refused_before == len(refused) + 1
    finally:
        stop.set()
        thread.join(10)
        for sock in attack:
            sock.close()
    deadline = time.monotonic() + 15  # the server counts the closes as it sees them
    while True:
        with _connect(port, ATTACKER) as sock:
            sock.sendall(INFO)
            got = sock.recv(65536)
        if got or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert _statuses(got) == [200], got[:300]


def test_a_half_closed_client_reads_its_response_then_the_connection_closes(server):
    """The client sends its request, then shuts its side's writing: the server answered nothing
    and closed. Now each request received whole is answered (two pipelined ones too), and the
    server closes after the last (its keep-alive is 60 s: it closes because the client can send
    no more)."""
    port, _ = server
    for requests in (INFO, INFO + INFO):
        with _connect(port, BYSTANDER) as sock:
            sock.sendall(requests)
            sock.shutdown(socket.SHUT_WR)
            got = _read_to_close(sock)
        assert _statuses(got) == [200] * requests.count(b"GET "), got[:300]
        assert got.rstrip().endswith(b"}"), got[-300:]  # the JSON body whole
    body = b'{"text": "a half-closed edit ."}'
    put = (
        b"PUT /v1/passages/p HTTP/1.1\r\n" + HOST + b"Content-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    with _connect(port, BYSTANDER) as sock:  # a request with a body: its route's answer
        sock.sendall(put)
        sock.shutdown(socket.SHUT_WR)
        got = _read_to_close(sock)
    assert _statuses(got) == [403] and b"--allow_edits" in got, got[:300]


@pytest.mark.slow  # waits for the server's warm-up compile (a minute on 2 loaded cores)
def test_a_half_closed_client_reads_its_answer(server):
    """The answer route watches for its client going away, to drop a request not begun: the
    half-close read as that (a 499, nothing sent). Now the answer is sent, then the close."""
    port, _ = server
    deadline = time.monotonic() + 300
    while httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=20).status_code != 200:
        assert time.monotonic() < deadline, "not ready in 300 s"
        time.sleep(0.5)
    body = b'{"questions": ["where was resa nemobu born ?"]}'
    post = (
        b"POST /v1/answer HTTP/1.1\r\n" + HOST + b"Content-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    with _connect(port, BYSTANDER) as sock:
        sock.sendall(post)
        sock.shutdown(socket.SHUT_WR)
        got = _read_to_close(sock, timeout=60)
    assert _statuses(got) == [200], got[:300]
    head, _, payload = got.partition(b"\r\n\r\n")
    assert json.loads(payload)["answers"][0]["question"] == "where was resa nemobu born ?"


def test_a_client_that_half_closes_inside_its_request_head_is_closed_at_once(server):
    """Nothing to answer: the connection closes now, not at the head's 60 s deadline."""
    port, _ = server
    with _connect(port, BYSTANDER) as sock:
        sock.sendall(b"GET /v1/info HTTP/1.1\r\n" + HOST)
        sock.shutdown(socket.SHUT_WR)
        assert _read_to_close(sock) == b""


@pytest.mark.parametrize(
    "peer, key",
    [
        (("10.1.2.3", 5000), "10.1.2.3"),
        (("2001:db8:1:2:aaaa::1", 5000, 0, 0), "2001:db8:1:2::/64"),
        (("2001:db8:1:2:bbbb::9", 6000, 0, 0), "2001:db8:1:2::/64"),  # the same host's /64
        (("::ffff:10.1.2.3", 5000, 0, 0), "10.1.2.3"),  # an IPv4 client of a dual-stack socket
        (("fe80::1%eth0", 5000, 0, 2), "fe80::/64"),
        ("/run/serve.sock", None),  # a Unix socket: no address to count by
        (None, None),
    ],
)
def test_a_client_is_counted_by_its_ipv4_address_or_its_ipv6_slash_64(peer, key):
    assert connections.client_key(peer) == key
