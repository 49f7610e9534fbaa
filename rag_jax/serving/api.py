"""The server's API contract: its settings, the request bodies, the error shape, and the checks
every request passes before it reaches the model (the `Host` header, the body's size, repeated
JSON keys, text limits), with each request counted by route template and status.

Legend: none (no arrays here).
"""

import dataclasses
import json
import logging
import time
from typing import Literal

import fastapi
from fastapi import responses, routing
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from rag_jax.retrieval.corpus import has_surrogate
from rag_jax.serving import metrics

log = logging.getLogger("rag_jax.serving")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """How a server runs (the flags of `experiments/serve.py`)."""

    bundle: str  # the bundle folder
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000
    allow_edits: bool = False  # PUT / DELETE passages (403 otherwise)
    max_batch: int = 16  # the most questions in one request and in one merged call
    max_wait_ms: float = 3.0  # how long the oldest queued request waits for others to join
    # A call holds at most half the questions recently queued or running (`batching.Batcher`'s
    # `overlap`): on CPU, one call's host work and HTTP round trip hide under the other's model.
    overlap_calls: bool = True
    max_n_docs: int = 0  # the largest n_docs a request may ask for; 0 = the bundle's n_docs
    max_beams: int = 8  # the largest num_beams a request may ask for
    warm_variants: tuple[str, ...] = ()  # variants compiled before ready; () = the bundle's
    # Settings (variant, num_beams, n_docs) beyond the warmed ones compiled on demand, in the
    # background (their requests answer 503 + Retry-After meanwhile); 0 = only the warmed ones.
    max_cold_settings: int = 4
    max_question_chars: int = 2_000  # a longer question is refused (413) before it is tokenised
    max_passage_chars: int = 100_000  # an edit's longest passage text or title (413 beyond)
    max_id_chars: int = 256  # an edit's longest passage id (413 beyond)
    max_body_bytes: int = 1 << 20  # a larger request body is refused (413) before it is read
    # Host headers answered (400 otherwise); () = localhost, 127.0.0.1, ::1 and `host`.
    allowed_hosts: tuple[str, ...] = ()
    keep_alive_s: float = 5.0  # an idle kept-alive connection is closed after this long
    max_connections: int = 256  # open connections beyond this answer 503 (uvicorn's limit)
    # A connection is closed when a request's head is not whole this long after the connection
    # opened (or after its first byte, following a keep-alive wait): slowloris, or nothing sent.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0  # ... or its body this long after the head (a trickled body)


class AnswerRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    questions: list[StrictStr] = Field(description="the questions (1 to max_batch)")
    variant: Literal["sequence", "token"] | None = Field(None, description="default: the run's")
    num_beams: StrictInt | None = Field(None, description="1 = greedy; default: the run's")
    n_docs: StrictInt | None = Field(None, description="passages per question; default: the run's")


class PassageBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: StrictStr = Field(description="the passage's text (non-empty)")
    title: StrictStr | None = Field(None, description="default: the current title, or ''")


class ApiError(Exception):
    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers


def error_response(status: int, message: str, details=None, headers=None) -> responses.JSONResponse:
    body = {"status": status, "message": message}
    if details is not None:
        body["details"] = details
    return responses.JSONResponse({"error": body}, status_code=status, headers=headers)


def check_text(field: str, text: str, limit: int, what: str) -> None:
    """ApiError naming `field` if `text` is over `limit` characters (413) or holds a lone
    surrogate, which UTF-8 cannot encode and tokenizers fail on (422)."""
    if len(text) > limit:
        raise ApiError(413, f"{field}: {len(text)} characters, at most {limit} in {what}")
    if has_surrogate(text):
        raise ApiError(
            422, f"{field}: holds a lone surrogate (e.g. \\ud800), which is not Unicode text"
        )


def validation_details(errors) -> list[dict]:
    return [
        {"loc": [str(x) for x in e.get("loc", ())], "msg": e.get("msg", ""), "type": e.get("type")}
        for e in errors
    ]


class RequestCounter:
    """Counts each HTTP request by route and status (a plain ASGI middleware: Starlette's
    `BaseHTTPMiddleware` costs a task and a stream per request)."""

    def __init__(self, app, metrics: metrics.Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.monotonic(), [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            # The route's template (set by the router), never the raw path: a client cannot
            # make new metric series by asking new paths.
            route = getattr(scope.get("route"), "path_format", "other")
            self.metrics.request(route, status[0], time.monotonic() - start)


class BodyLimit:
    """Refuses a request body over `limit` bytes with 413: at once when its Content-Length says
    so, else as soon as the bytes streamed in pass it (the body is never read whole)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        message = f"the request body is over {self.limit} bytes (the server's max_body_bytes)"
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length", b"").decode("latin-1")
        if length.strip().isdigit() and int(length) > self.limit:
            return await error_response(413, message)(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            got = await receive()
            if got["type"] == "http.request":
                seen += len(got.get("body", b""))
                if seen > self.limit:  # FastAPI hands its own HTTPException on, as raised
                    raise fastapi.HTTPException(413, message)
            return got

        await self.app(scope, counted, send)


class _Duplicate(ValueError):
    pass


def _refuse_duplicates(pairs):
    keys = [k for k, _ in pairs]
    for i, key in enumerate(keys):
        if key in keys[:i]:
            raise _Duplicate(key)
    return dict(pairs)


class StrictJsonRoute(routing.APIRoute):
    """A route whose JSON body may not repeat a key (422), where `json.loads` keeps the last
    value without a word; a body that is not JSON is left to FastAPI's own answer (400)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def checked(request: fastapi.Request):
            body = await request.body()  # kept by the request: FastAPI reads it from there
            if body:
                try:
                    json.loads(body, object_pairs_hook=_refuse_duplicates)
                except _Duplicate as e:
                    raise ApiError(
                        422, f"the body repeats the key {e.args[0]!r}; each key may appear once"
                    ) from None
                except (ValueError, RecursionError):
                    pass
            return await handler(request)

        return checked


def allowed_hosts(config: ServerConfig) -> list[str]:
    if config.allowed_hosts:
        return list(config.allowed_hosts)
    hosts = ["localhost", "127.0.0.1", "::1", "[::1]"]
    if config.host not in ("", "0.0.0.0", "::", *hosts):
        hosts.append(config.host)
    return hosts
