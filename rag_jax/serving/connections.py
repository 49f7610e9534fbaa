"""Deadlines on what a client sends, one framing per request, a share of the connections per
client, and answers to clients that half-close: uvicorn's h11 protocol, closing a connection
whose request head or body arrives too slowly, whose request gives two framings, or whose client
address holds its share already; and the server's listening socket, bound before anything heavy
is loaded (`bind`).

uvicorn times out only an idle kept-alive connection (`timeout_keep_alive`, armed when a
response ends). A client that opens a connection and sends nothing, sends its request head a
few bytes at a time (slowloris), or trickles its body would hold the connection, and one of the
server's `limit_concurrency` slots with it, for as long as it liked: a few hundred such clients
make every other request answer 503. `TimedH11Protocol` gives each phase of a request a
deadline:

- the head, from the connection's opening (or, on a kept-alive connection, from the first byte
  of its next request: the wait between requests is uvicorn's keep-alive) until it is parsed
  whole: `header_timeout_s`;
- the body, from the head's end until its last byte: `body_timeout_s`.

A deadline bounds the whole phase, not the gaps between bytes, so trickling does not extend it.
When one passes the connection is closed without a response (a client still sending its
request is not reading one); a handler waiting for the body sees the client disconnect. The
phase is read from h11's state of the client's side after every batch of bytes parsed and
every response, so pipelined requests are timed alike. Used through `protocol(...)` as
`uvicorn.Config(http=...)`, which also means the pure-Python h11 parser, never httptools.

A request with both Content-Length and Transfer-Encoding is answered 400 and its connection
closed (RFC 9112 section 6.3): h11 reads such a body by its chunks, and a proxy in front that
reads it by its length would take the bytes after the chunks for the next request, or the
other way round (request smuggling). A malformed request's 400 is JSON, as the app's errors.

One client address holds at most `max_per_client` open connections (`client_key`: an IPv4
address, an IPv6 /64); a connection beyond them is closed on arrival, unread and unanswered.
uvicorn's `limit_concurrency` counts every open connection, those still sending their head
included: without a share per client, one address trickling heads on as many connections as the
limit (reopening each before its deadline) made every other client's request answer 503.

A client may half-close its connection once its request is sent (`shutdown(SHUT_WR)`: "I will
send no more"). asyncio closed the connection at that end of input, so a request in flight was
answered to no one (the answer route saw the client gone: 499) and a pipelined one was never
read; now every request received whole is answered, and the connection closes after the last.
A half-close inside a request (its head or body cut short) closes the connection at once, as
before. A client that closes its socket whole looks the same until the server writes: its
request is answered too, and the write finds the connection reset.
"""

import asyncio
import collections
import errno
import ipaddress
import json
import math
import socket
from collections.abc import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

AMBIGUOUS_FRAMING = (
    "the request gives both Content-Length and Transfer-Encoding; send one (RFC 9112 6.3)"
)


class FramedConnection(h11.Connection):
    """h11's connection refusing, as a protocol error, a request that frames its body twice;
    `error` keeps the latest protocol error (uvicorn answers 400 without it). The client's
    half-close (`TimedH11Protocol.eof_received`) moves h11's state of their side to CLOSED
    but is never returned as an event: uvicorn's loop has no case for it and would ask again
    without end."""

    error: h11.RemoteProtocolError | None = None

    def next_event(self):
        try:
            event = super().next_event()
            if isinstance(event, h11.Request):
                names = {name for name, _ in event.headers}  # h11 lower-cases them
                if b"content-length" in names and b"transfer-encoding" in names:
                    raise h11.RemoteProtocolError(AMBIGUOUS_FRAMING, 400)
        except h11.RemoteProtocolError as e:
            self.error = e
            raise
        if isinstance(event, h11.ConnectionClosed):
            return h11.NEED_DATA  # nothing more will come
        return event


class TimedH11Protocol(H11Protocol):
    """uvicorn's `H11Protocol` with a deadline on the request head and one on the body (see the
    module docstring); `protocol()` makes a subclass with the deadlines set."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    on_timeout: Callable[[str], None] | None = None  # called with "headers" or "body"
    max_per_client: int | None = None  # open connections of one `client_key`; None: no limit
    on_refused: Callable[[], None] | None = None  # called for each connection it closes
    _clients: collections.Counter | None = None  # client key -> open connections (per server)

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        size = config.h11_max_incomplete_event_size  # as uvicorn's own connection has it
        limits = {} if size is None else {"max_incomplete_event_size": size}
        self.conn = FramedConnection(h11.SERVER, **limits)
        self._phase: str | None = None  # "headers", "body", or None: nothing awaited from them
        self._deadline: asyncio.TimerHandle | None = None
        self._client_key: str | None = None  # counted in `_clients` while open

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        key = client_key(transport.get_extra_info("peername"))
        if key is not None and self.max_per_client is not None and self._clients is not None:
            if self._clients[key] >= self.max_per_client:
                transport.close()  # unread: its request never reaches the app
                if self.on_refused is not None:
                    self.on_refused()
                return
            self._clients[key] += 1
            self._client_key = key
        self._watch()

    def connection_lost(self, exc) -> None:
        if self._client_key is not None:
            self._clients[self._client_key] -= 1
            if not self._clients[self._client_key]:
                del self._clients[self._client_key]
            self._client_key = None
        self._enter(None)
        super().connection_lost(exc)

    def eof_received(self) -> bool:
        """The client will send no more (a half-close, or its socket closed whole). Returns
        whether the connection stays open: while a request received whole awaits its response
        (the connection then closes after it), else it closes now (asyncio closes it)."""
        conn = self.conn
        if conn.their_state is h11.CLOSED:  # seen already (reading paused and resumed since)
            return True
        if conn.their_state not in (h11.DONE, h11.MUST_CLOSE):
            return False  # idle between requests, or inside one: nothing to answer
        conn.receive_data(b"")  # h11 reads the requests buffered (pipelined), then the close
        if not conn.trailing_data[0]:
            conn.next_event()  # their side CLOSED: once our response ends, ours MUST_CLOSE
        self._watch()
        return True

    def handle_events(self) -> None:  # after each batch of bytes, and after a response
        super().handle_events()
        self._watch()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a malformed request, as JSON saying what is wrong (h11's reason,
        cut short: it may quote the request); the connection closes after it."""
        if self.conn.error is not None and str(self.conn.error):
            msg = f"malformed request: {str(self.conn.error)[:200]}"
        body = json.dumps({"error": {"status": 400, "message": msg}}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-content-type-options", b"nosniff"),
            (b"connection", b"close"),
        ]
        for event in (
            h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def _watch(self) -> None:
        """Arms the deadline of what the client is sending now, or clears it."""
        if self.transport.is_closing():
            phase = None
        elif self.conn.their_state is h11.IDLE:
            # The next request's head is due, unless the connection waits under the keep-alive
            # timer (set when a response ends, cleared by the next byte that arrives).
            phase = "headers" if self.timeout_keep_alive_task is None else None
        elif self.conn.their_state is h11.SEND_BODY:
            phase = "body"
        else:  # DONE: the request is in (ours to answer), or the connection is closing
            phase = None
        self._enter(phase)

    def _enter(self, phase: str | None) -> None:
        if phase == self._phase:
            return  # the running deadline stands: trickled bytes do not extend it
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = phase
        if phase is not None:
            seconds = self.header_timeout_s if phase == "headers" else self.body_timeout_s
            self._deadline = self.loop.call_later(seconds, self._expire, phase)

    def _expire(self, phase: str) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        self.transport.close()  # connection_lost follows: h11's state and the handler learn it
        if self.on_timeout is not None:
            self.on_timeout(phase)


def protocol(
    header_timeout_s: float,
    body_timeout_s: float,
    on_timeout: Callable[[str], None] | None = None,
    max_per_client: int | None = None,
    on_refused: Callable[[], None] | None = None,
) -> type[TimedH11Protocol]:
    """A `TimedH11Protocol` class with these deadlines and this share of connections per
    client, for `uvicorn.Config(http=...)`; one class per server (it counts its connections).

    Args:
      header_timeout_s: seconds a request head may take to arrive whole.
      body_timeout_s: seconds a request body may take, from the head's end.
      on_timeout: called on the event loop with "headers" or "body" for each connection closed.
      max_per_client: open connections one client address (`client_key`) may hold; a
        connection beyond them is closed on arrival. None: no limit.
      on_refused: called on the event loop for each connection so closed.

    Raises:
      ValueError: a deadline that is not a positive, finite number of seconds, or a
        `max_per_client` below 1 (named).
    """
    for name, value in (("header_timeout_s", header_timeout_s), ("body_timeout_s", body_timeout_s)):
        if not 0 < value < math.inf:
            raise ValueError(f"{name} must be a positive number of seconds, got {value}")
    if max_per_client is not None and max_per_client < 1:
        raise ValueError(f"max_connections_per_client must be >= 1, got {max_per_client}")
    # A plain function stored on a class would be bound to the protocol as a method.
    attributes = {
        "header_timeout_s": float(header_timeout_s),
        "body_timeout_s": float(body_timeout_s),
        "on_timeout": None if on_timeout is None else staticmethod(on_timeout),
        "max_per_client": max_per_client,
        "on_refused": None if on_refused is None else staticmethod(on_refused),
        "_clients": collections.Counter(),
    }
    return type("TimedH11Protocol", (TimedH11Protocol,), attributes)


def client_key(peer) -> str | None:
    """What a client's connections are counted by, from the peer address of its socket: an
    IPv4 address; an IPv6 address's /64 (a host is commonly given a whole /64, and would
    otherwise hold a share per address); an IPv4-mapped IPv6 address as its IPv4 address. None
    where the peer has no IP address (a Unix socket)."""
    if not isinstance(peer, tuple) or not peer or not isinstance(peer[0], str):
        return None
    try:
        address = ipaddress.ip_address(peer[0].partition("%")[0])  # without an IPv6 zone
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (`host`, `port`) for the server to listen on, as uvicorn binds one
    (SO_REUSEADDR: a port left in TIME_WAIT by a server just stopped is taken again).

    Raises:
      OSError: the address cannot be bound; a port in use or one needing privileges says so.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        address = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        if e.errno == errno.EADDRINUSE:
            reason = f"port {port} is in use (another server?); pick another with --port"
        elif e.errno == errno.EACCES:
            reason = f"port {port} needs privileges; pick one above 1023 with --port"
        else:
            reason = e.strerror or str(e)
        raise OSError(e.errno, f"cannot listen on {address}: {reason}") from None
    sock.set_inheritable(True)
    return sock
