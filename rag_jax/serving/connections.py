"""Deadlines on what a client sends, and one framing per request: uvicorn's h11 protocol, closing
a connection whose request head or body arrives too slowly, or whose request gives two framings;
and the server's listening socket, bound before anything heavy is loaded (`bind`).

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
"""

import asyncio
import errno
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
    `error` keeps the latest protocol error (uvicorn answers 400 without it)."""

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
        return event


class TimedH11Protocol(H11Protocol):
    """uvicorn's `H11Protocol` with a deadline on the request head and one on the body (see the
    module docstring); `protocol()` makes a subclass with the deadlines set."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    on_timeout: Callable[[str], None] | None = None  # called with "headers" or "body"

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        size = config.h11_max_incomplete_event_size  # as uvicorn's own connection has it
        limits = {} if size is None else {"max_incomplete_event_size": size}
        self.conn = FramedConnection(h11.SERVER, **limits)
        self._phase: str | None = None  # "headers", "body", or None: nothing awaited from them
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._watch()

    def connection_lost(self, exc) -> None:
        self._enter(None)
        super().connection_lost(exc)

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
) -> type[TimedH11Protocol]:
    """A `TimedH11Protocol` class with these deadlines, for `uvicorn.Config(http=...)`.

    Args:
      header_timeout_s: seconds a request head may take to arrive whole.
      body_timeout_s: seconds a request body may take, from the head's end.
      on_timeout: called on the event loop with "headers" or "body" for each connection closed.

    Raises:
      ValueError: a deadline that is not a positive, finite number of seconds (named).
    """
    for name, value in (("header_timeout_s", header_timeout_s), ("body_timeout_s", body_timeout_s)):
        if not 0 < value < math.inf:
            raise ValueError(f"{name} must be a positive number of seconds, got {value}")
    attributes = {
        "header_timeout_s": float(header_timeout_s),
        "body_timeout_s": float(body_timeout_s),
        # A plain function stored on a class would be bound to the protocol as a method.
        "on_timeout": None if on_timeout is None else staticmethod(on_timeout),
    }
    return type("TimedH11Protocol", (TimedH11Protocol,), attributes)


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
