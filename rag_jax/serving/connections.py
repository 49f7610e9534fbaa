"""Deadlines on what a client sends and on what it reads, one framing per request, every byte
of a body counted, fair shares of the connections between clients, and answers to clients that
half-close: uvicorn's h11 protocol, closing a connection whose request head or body arrives too
slowly, whose response is not read in time, whose request gives two framings, or whose client
holds its share already; and the server's listening socket, bound before anything heavy is
loaded (`bind`).

uvicorn times out only an idle kept-alive connection (`timeout_keep_alive`, armed when a
response ends). A client that opens a connection and sends nothing, sends its request head a
few bytes at a time (slowloris), or trickles its body would hold the connection, and one of the
server's `limit_concurrency` slots with it, for as long as it liked: a few hundred such clients
make every other request answer 503. `TimedH11Protocol` gives each phase of a request a
deadline:

- the head, from the connection's opening (or, on a kept-alive connection, from the first byte
  of its next request: the wait between requests is uvicorn's keep-alive) until it is parsed
  whole: `header_timeout_s`;
- the body, from the head's end until its last byte: `body_timeout_s`;
- the response, from its first byte handed to the connection until its last has left the
  server's buffer for the kernel's: `send_timeout_s`. A client that never reads held its
  response in the server's memory for as long as it liked (the keep-alive's close waits for the
  buffer to drain); the connection is now cut (its unsent bytes dropped).

A deadline bounds the whole phase, not the gaps between bytes, so trickling does not extend it.
When a request's deadline passes the connection is closed without a response (a client still
sending its request is not reading one); a handler waiting for the body sees the client
disconnect. The phase is read from h11's state of the client's side after every batch of bytes
parsed and every response, so pipelined requests are timed alike. Used through `protocol(...)`
as `uvicorn.Config(http=...)`, which also means the pure-Python h11 parser, never httptools.

A request with both Content-Length and Transfer-Encoding is answered 400 and its connection
closed (RFC 9112 section 6.3): h11 reads such a body by its chunks, and a proxy in front that
reads it by its length would take the bytes after the chunks for the next request, or the
other way round (request smuggling). A malformed request's 400 is JSON, as the app's errors.

A body is counted as sent (`max_body_bytes`): a chunked body's size lines, chunk extensions,
CRLFs and trailers too, which the app never sees (it counts the data). A body whose framing
takes it over the limit is answered 413 and the connection closed; one over it by its data is
left to the app's 413, read at most to `max_body_read` bytes in all. Chunk extensions of up to
64 KiB a line, each carrying one byte of data, made one connection push 2.6 GB in 20 s.

Connections are shared out between clients (`client_key`: an IPv4 address, an IPv6 /64):

- one client holds at most `max_per_client` open connections; one beyond is closed on arrival,
  unread and unanswered;
- when the server holds `limit_concurrency` connections (uvicorn's limit: every request answers
  503 beyond it), a new connection takes the slot of one of the client holding the most, if
  that client holds more than the newcomer's client now does: its connection waiting the
  longest for a request (idle, or still sending its head), else still sending its body, else
  the oldest, is cut (`on_evicted`). So whatever the number of clients that fill the server,
  one with fewer connections than another is let in; a client holding as many as any other
  meets the limit's 503. uvicorn's limit counts every open connection, those still sending their
  head included: N clients with a fixed share each filled it whatever the share.

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
import http
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
# Why a body is refused for its framing (`FramedConnection.max_body_bytes`).
FRAMED_BODY = (
    "the request body is over {} bytes as sent, its chunked framing (sizes, extensions, "
    "trailers) counted (the server's max_body_bytes)"
)


class FramedConnection(h11.Connection):
    """h11's connection refusing, as a protocol error, a request that frames its body twice or
    whose body as sent (data and chunked framing) is over its limit; `error` keeps the latest
    protocol error (uvicorn answers 400 without it). It counts the bytes it sends (`written`)
    and tells `on_send` of each event sent. The client's half-close
    (`TimedH11Protocol.eof_received`) moves h11's state of their side to CLOSED but is never
    returned as an event: uvicorn's loop has no case for it and would ask again without end.

    Attributes:
      max_body_bytes: the most bytes of a body as sent (data and framing) while its data is
        within them (the app refuses more data itself); None: not counted.
      max_body_read: the most bytes of a body as sent, whatever its data (the app reads a body
        over its limit on, to answer its 413 to a client still writing); None: no limit.
    """

    error: h11.RemoteProtocolError | None = None

    def __init__(self, *args, max_body_bytes=None, max_body_read=None, on_send=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_body_bytes, self.max_body_read = max_body_bytes, max_body_read
        self.on_send = on_send  # called with each event sent
        self.written = 0  # bytes of every event sent
        self._body_sent = self._body_data = 0  # this request's body: bytes as sent, data bytes

    def next_event(self):
        in_body = self.their_state is h11.SEND_BODY
        buffered = len(self._receive_buffer)  # what a chunk's framing takes is read from it
        try:
            event = super().next_event()
            if isinstance(event, h11.Request):
                names = {name for name, _ in event.headers}  # h11 lower-cases them
                if b"content-length" in names and b"transfer-encoding" in names:
                    raise h11.RemoteProtocolError(AMBIGUOUS_FRAMING, 400)
                self._body_sent = self._body_data = 0
            elif in_body:
                self._count_body(buffered - len(self._receive_buffer), event)
        except h11.RemoteProtocolError as e:
            self.error = e
            raise
        if isinstance(event, h11.ConnectionClosed):
            return h11.NEED_DATA  # nothing more will come
        return event

    def _count_body(self, consumed: int, event) -> None:
        self._body_sent += consumed
        if isinstance(event, h11.Data):
            self._body_data += len(event.data)
        limit, most = self.max_body_bytes, self.max_body_read
        framed_over = limit is not None and self._body_sent > limit >= self._body_data
        if framed_over or (most is not None and self._body_sent > most):
            raise h11.RemoteProtocolError(FRAMED_BODY.format(limit or most), 413)

    def send(self, event):
        data = super().send(event)
        self.written += len(data or b"")
        if self.on_send is not None:
            self.on_send(event)
        return data


class TimedH11Protocol(H11Protocol):
    """uvicorn's `H11Protocol` with deadlines on the request head, the body and the response,
    bodies counted as sent, and connections shared out between clients (see the module
    docstring); `protocol()` makes a subclass with the limits set."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    send_timeout_s: float = 30.0
    on_timeout: Callable[[str], None] | None = None  # called with "headers", "body" or "send"
    max_per_client: int | None = None  # open connections of one `client_key`; None: no limit
    on_refused: Callable[[], None] | None = None  # called for each connection closed on arrival
    on_evicted: Callable[[], None] | None = None  # ... and cut to make room for another client
    max_body_bytes: int | None = None  # `FramedConnection`'s
    max_body_read: int | None = None
    # client key -> its open connections, oldest first (one dict per server)
    _clients: dict[str, dict["TimedH11Protocol", None]] | None = None

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        size = config.h11_max_incomplete_event_size  # as uvicorn's own connection has it
        limits = {} if size is None else {"max_incomplete_event_size": size}
        self.conn = FramedConnection(
            h11.SERVER,
            max_body_bytes=self.max_body_bytes,
            max_body_read=self.max_body_read,
            on_send=self._sent,
            **limits,
        )
        self._phase: str | None = None  # "headers", "body", or None: nothing awaited from them
        self._deadline: asyncio.TimerHandle | None = None
        self._client_key: str | None = None  # counted in `_clients` while open
        # Each response not yet out of the server's buffer: [loop time it began, `conn.written`
        # at its end (None until it ends)].
        self._responses: collections.deque[list] = collections.deque()
        self._send_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        key = client_key(transport.get_extra_info("peername"))
        if key is not None and self._clients is not None:
            held = self._clients.get(key, ())
            if self.max_per_client is not None and len(held) >= self.max_per_client:
                self.connections.discard(self)  # it takes no slot, not even until it is gone
                transport.close()  # unread: its request never reaches the app
                if self.on_refused is not None:
                    self.on_refused()
                return
            self._clients.setdefault(key, {})[self] = None
            self._client_key = key
            self._make_room()
        self._watch()

    def _make_room(self) -> None:
        """At uvicorn's limit (this connection's request would answer 503), cuts connections of
        the client holding the most while it holds more than this one's client now does."""
        limit = self.limit_concurrency
        while limit is not None and len(self.connections) >= limit:
            held = max(self._clients.values(), key=len)  # the first of the largest: any will do
            if len(held) <= len(self._clients[self._client_key]):
                return  # no client holds more than this one's: the limit's 503 stands
            victim = min(held, key=TimedH11Protocol._busy)  # the least busy, the oldest first
            victim._forget_client()
            victim.connections.discard(victim)  # its slot is free now, not once asyncio says so
            victim.transport.abort()  # nothing of it is worth sending: its bytes are dropped
            if self.on_evicted is not None:
                self.on_evicted()

    def _busy(self) -> int:
        """0: waiting for a request (idle, or its head still coming); 1: its body still
        coming; 2: its request is in, answered or being answered."""
        if self.conn.their_state is h11.IDLE and (
            self.cycle is None or self.cycle.response_complete
        ):
            return 0
        return 1 if self.conn.their_state is h11.SEND_BODY else 2

    def _forget_client(self) -> None:
        if self._client_key is not None:
            held = self._clients[self._client_key]
            del held[self]
            if not held:
                del self._clients[self._client_key]
            self._client_key = None

    def connection_lost(self, exc) -> None:
        self._forget_client()
        self._enter(None)
        if self._send_deadline is not None:
            self._send_deadline.cancel()
            self._send_deadline = None
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
        cut short: it may quote the request; 413 for a body over its limit as sent); the
        connection closes after it (at once where a response has begun)."""
        status, error = 400, self.conn.error
        if error is not None and str(error):
            status = error.error_status_hint
            msg = str(error)[:200] if status == 413 else f"malformed request: {str(error)[:200]}"
        body = json.dumps({"error": {"status": status, "message": msg}}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-content-type-options", b"nosniff"),
            (b"connection", b"close"),
        ]
        reason = http.HTTPStatus(status).phrase.encode()
        try:
            for event in (
                h11.Response(status_code=status, headers=headers, reason=reason),
                h11.Data(data=body),
                h11.EndOfMessage(),
            ):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:  # the app's response has begun: no other can be sent
            pass
        self.transport.close()
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # a handler reading the body sees its client gone
            self.cycle.message_event.set()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def _sent(self, event) -> None:
        """`conn.send`'s hook: times each response (`send_timeout_s`) from its first byte."""
        if isinstance(event, h11.Response):  # not an InformationalResponse (100 Continue)
            self._responses.append([self.loop.time(), None])
            if self._send_deadline is None:
                self._send_deadline = self.loop.call_later(self.send_timeout_s, self._check_sent)
        elif isinstance(event, h11.EndOfMessage) and self._responses:
            if self._responses[-1][1] is None:
                self._responses[-1][1] = self.conn.written

    def _check_sent(self) -> None:
        """At the oldest response's deadline: cuts the connection if it is still in the
        server's buffer, else waits for the next response's."""
        self._send_deadline = None
        out = self.conn.written - self.transport.get_write_buffer_size()  # handed to the kernel
        while (
            self._responses and self._responses[0][1] is not None and self._responses[0][1] <= out
        ):
            self._responses.popleft()
        if not self._responses:
            return
        due = self._responses[0][0] + self.send_timeout_s
        if self.loop.time() < due:
            self._send_deadline = self.loop.call_at(due, self._check_sent)
            return
        self._responses.clear()
        self.transport.abort()  # its buffer is dropped: connection_lost follows
        if self.on_timeout is not None:
            self.on_timeout("send")

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
    *,
    send_timeout_s: float = 30.0,
    on_evicted: Callable[[], None] | None = None,
    max_body_bytes: int | None = None,
    max_body_read: int | None = None,
) -> type[TimedH11Protocol]:
    """A `TimedH11Protocol` class with these deadlines, limits and shares of connections, for
    `uvicorn.Config(http=...)`; one class per server (it counts its connections).

    Args:
      header_timeout_s: seconds a request head may take to arrive whole.
      body_timeout_s: seconds a request body may take, from the head's end.
      on_timeout: called on the event loop with "headers", "body" or "send" for each
        connection closed at a deadline.
      max_per_client: open connections one client (`client_key`) may hold; a connection
        beyond them is closed on arrival. None: no cap (the fair share at the server's limit
        still holds).
      on_refused: called on the event loop for each connection so closed.
      send_timeout_s: seconds a response may take to leave the server's buffer, from its
        first byte.
      on_evicted: called on the event loop for each connection cut to let another client in.
      max_body_bytes, max_body_read: see `FramedConnection`.

    Raises:
      ValueError: a deadline that is not a positive, finite number of seconds, a
        `max_per_client` below 1, or a body limit below 1 (named).
    """
    deadlines = (
        ("header_timeout_s", header_timeout_s),
        ("body_timeout_s", body_timeout_s),
        ("send_timeout_s", send_timeout_s),
    )
    for name, value in deadlines:
        if not 0 < value < math.inf:
            raise ValueError(f"{name} must be a positive number of seconds, got {value}")
    if max_per_client is not None and max_per_client < 1:
        raise ValueError(f"max_connections_per_client must be >= 1, got {max_per_client}")
    for name, value in (("max_body_bytes", max_body_bytes), ("max_body_read", max_body_read)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    hook = lambda fn: None if fn is None else staticmethod(fn)  # noqa: E731
    # A plain function stored on a class would be bound to the protocol as a method.
    attributes = {
        "header_timeout_s": float(header_timeout_s),
        "body_timeout_s": float(body_timeout_s),
        "send_timeout_s": float(send_timeout_s),
        "on_timeout": hook(on_timeout),
        "max_per_client": max_per_client,
        "on_refused": hook(on_refused),
        "on_evicted": hook(on_evicted),
        "max_body_bytes": max_body_bytes,
        "max_body_read": max_body_read,
        "_clients": {},
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
