"""The server's API contract: its settings, the request bodies, the error shape, and the checks
every request passes before it reaches the model (the `Host` header, the body's size, repeated
JSON keys, text limits, visible text), with each request counted by route template and status,
and the headers every response carries (`nosniff`; HEAD answered as GET without the body).

Legend: none (no arrays here).
"""

import dataclasses
import email.message
import json
import logging
import os
import re
import time
import unicodedata
from typing import Literal

import fastapi
import pydantic
from fastapi import exceptions as fastapi_exceptions
from fastapi import responses, routing
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr
from starlette import concurrency

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
    # A cold setting with no request for this long is evicted: its slot, and its compiled
    # programs, are freed (else a few odd requests held every slot for the server's lifetime).
    cold_idle_s: float = 300.0
    # A cold setting compiles its first shape only; its other shapes once it has served this
    # many requests (one odd request queued 15 compiles).
    cold_fill_after: int = 8
    # A cold setting that has served no request this long after its compile ended (its client
    # never came back, or it failed) is evicted: only served requests renew a slot.
    cold_claim_s: float = 60.0
    max_question_chars: int = 2_000  # a longer question is refused (413) before it is tokenised
    max_passage_chars: int = 100_000  # an edit's longest passage text or title (413 beyond)
    max_id_chars: int = 256  # an edit's longest passage id (413 beyond)
    max_body_bytes: int = 1 << 20  # a larger request body is refused (413) before it is read
    # Host headers answered (400 otherwise); () = localhost, 127.0.0.1, ::1 and `host`.
    allowed_hosts: tuple[str, ...] = ()
    keep_alive_s: float = 5.0  # an idle kept-alive connection is closed after this long
    max_connections: int = 256  # open connections beyond this answer 503 (uvicorn's limit)
    # Open connections of one client address (an IPv6 /64) beyond this are closed on arrival,
    # unread; at `max_connections` a newcomer takes a slot of the client holding the most
    # (`connections.TimedH11Protocol`). 0 = no cap of its own. Behind a proxy every client has
    # the proxy's address: raise it to max_connections there.
    max_connections_per_client: int = 16
    # A connection is closed when a request's head is not whole this long after the connection
    # opened (or after its first byte, following a keep-alive wait): slowloris, or nothing sent.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0  # ... or its body this long after the head (a trickled body)
    # A response still in the server's buffer this long after its first byte (its client does
    # not read) is dropped and its connection cut.
    send_timeout_s: float = 30.0
    max_response_bytes: int = 4 << 20  # a larger response is refused (422) before it is sent
    api_docs: bool = False  # serve Swagger UI at /docs (its scripts from a CDN)
    # Every file of the bundle is re-checked against its manifest this often (0: never); damage
    # found makes the server unready, /healthz naming the file (`Bundle.verify`).
    verify_every_s: float = 600.0


class AnswerRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    questions: list[StrictStr] = Field(description="the questions (1 to max_batch)")
    variant: Literal["sequence", "token"] | None = Field(None, description="default: the run's")
    num_beams: StrictInt | None = Field(None, description="1 = greedy; default: the run's")
    n_docs: StrictInt | None = Field(None, description="passages per question; default: the run's")


def answer_request(max_batch: int) -> type[AnswerRequest]:
    """`AnswerRequest` with at most `max_batch` questions in its schema (and its OpenAPI
    `maxItems`): pydantic refuses a longer list from its length alone, where the unbounded list
    made an error of every item that is not a string (a 1 MiB body of `0,`: 500,000 errors,
    seconds of validating and rendering on the event loop). The refusal answers 413
    (`validation_error`)."""
    questions = Field(max_length=max_batch, description=f"the questions (1 to {max_batch})")
    return pydantic.create_model(
        "AnswerRequest", __base__=AnswerRequest, questions=(list[StrictStr], questions)
    )


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


# Rendered as nothing: control, format (zero-width space and joiners, BOM, bidi marks),
# separator, surrogate and unassigned code points ...
_INVISIBLE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Cn", "Zs", "Zl", "Zp"})
# ... and the letters and marks Unicode makes Default_Ignorable (Hangul fillers, the combining
# grapheme joiner, Khmer inherent vowels, variation selectors), which their categories hide.
_IGNORABLE = frozenset(
    chr(c)
    for first, last in (
        (0x034F, 0x034F),
        (0x115F, 0x1160),
        (0x17B4, 0x17B5),
        (0x180B, 0x180F),
        (0x3164, 0x3164),
        (0xFE00, 0xFE0F),
        (0xFFA0, 0xFFA0),
        (0xE0100, 0xE01EF),
    )
    for c in range(first, last + 1)
)


def has_visible(text: str) -> bool:
    """Whether `text` holds a character that is drawn: a question of zero-width spaces or NULs
    alone is empty to a reader, and the model would answer it from nothing."""
    return any(
        c not in _IGNORABLE and unicodedata.category(c) not in _INVISIBLE_CATEGORIES for c in text
    )


def check_text(field: str, text: str, limit: int, what: str) -> None:
    """ApiError naming `field` if `text` is over `limit` characters (413) or holds a lone
    surrogate, which UTF-8 cannot encode and tokenizers fail on (422)."""
    if len(text) > limit:
        raise ApiError(413, f"{field}: {len(text)} characters, at most {limit} in {what}")
    if has_surrogate(text):
        raise ApiError(
            422, f"{field}: holds a lone surrogate (e.g. \\ud800), which is not Unicode text"
        )


MAX_LISTED_ERRORS = 10  # schema errors listed in a response's details; the rest counted


def validation_details(errors) -> list[dict]:
    return [
        {"loc": [str(x) for x in e.get("loc", ())], "msg": e.get("msg", ""), "type": e.get("type")}
        for e in errors[:MAX_LISTED_ERRORS]
    ]


def validation_error(errors: list) -> responses.JSONResponse:
    """The answer to a request its schema refuses (FastAPI's `RequestValidationError.errors()`):
    400 for a body that is not JSON; 413 naming the field for a list over its `max_length`
    (more questions than max_batch); else 422. The first `MAX_LISTED_ERRORS` errors are listed,
    the others counted: the response stays small whatever the body holds."""
    if any(e.get("type") == "json_invalid" for e in errors):
        return error_response(400, "the body is not valid JSON", validation_details(errors))
    for e in errors:
        if e.get("type") == "too_long":
            field = ".".join(str(x) for x in e.get("loc", ())[1:])  # after "body"
            ctx = e.get("ctx") or {}
            message = f"{field}: {ctx.get('actual_length')} items, at most {ctx.get('max_length')}"
            return error_response(413, message)
    message = "the request does not match its schema"
    if len(errors) > MAX_LISTED_ERRORS:
        message += f" ({len(errors)} errors; the first {MAX_LISTED_ERRORS} are listed)"
    return error_response(422, message, validation_details(errors))


# An absolute path of two parts or more, in an error message.
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~/:-])/(?:[^\s'\"/:,;()]+/)+([^\s'\"/:,;()]*)")


def redact(message: str, directories) -> str:
    """`message` without the server's own folders, for a client: each of `directories` (and
    its resolved form) is cut from the paths it starts (a bundle file reads `bundle/params/...`
    from the bundle's parent), and any other absolute path is cut to its last part. The
    server's log keeps the message whole."""
    roots = set()
    for directory in directories:
        for root in (os.path.abspath(directory), os.path.realpath(directory)):
            if root != os.sep:
                roots.add(root.rstrip(os.sep) + os.sep)
    for root in sorted(roots, key=len, reverse=True):  # the deepest first
        message = message.replace(root, "")
    return _ABSOLUTE_PATH.sub(r"\1", message)


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


DRAIN_FACTOR = 4  # a body over the limit is read and thrown away up to this many times it


class BodyLimit:
    """Refuses a request body over `limit` bytes with 413, never keeping more than `limit` of it.

    A body whose Content-Length says it is over is refused at once, unread, when that length is
    over `DRAIN_FACTOR` times the limit or the client waits on `Expect: 100-continue` (it sends
    nothing until told to), and the connection closes after the 413. One up to that size, like
    one that streams past the limit, is read and thrown away first: a client that writes its
    whole body before it reads (urllib, requests) then reads the 413, where closing on bytes
    still unread would reset the connection under it. Past that size the refusal closes it.
    """

    def __init__(self, app, limit: int):
        self.app, self.limit, self.drain = app, limit, DRAIN_FACTOR * limit

    async def _discard(self, receive, seen: int) -> bool:
        """Reads and drops the rest of the body while it stays within `drain` bytes in all;
        whether it ended (or the client left) within them."""
        while seen <= self.drain:
            got = await receive()
            if got["type"] != "http.request" or not got.get("more_body", False):
                return True
            seen += len(got.get("body", b""))
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        message = f"the request body is over {self.limit} bytes (the server's max_body_bytes)"
        close = {"connection": "close"}  # the body's rest unread: no next request can follow
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length", b"").decode("latin-1").strip()
        if length.isdigit() and int(length) > self.limit:
            waiting = headers.get(b"expect", b"").lower() == b"100-continue"
            if waiting or int(length) > self.drain or not await self._discard(receive, 0):
                return await error_response(413, message, headers=close)(scope, receive, send)
            return await error_response(413, message)(scope, receive, send)
        seen, whole = 0, False

        async def counted():
            nonlocal seen, whole
            got = await receive()
            if whole:  # e.g. a route watching for the client to leave once its body is in
                return got
            if got["type"] == "http.disconnect":  # gone mid-body (its deadline, or it left)
                # FastAPI answers any other error while reading a body 400, "error parsing"; its
                # own HTTPException goes on as raised: counted as the client's leaving.
                raise fastapi.HTTPException(499, "the client left before its body was whole")
            if got["type"] == "http.request":
                seen += len(got.get("body", b""))
                whole = not got.get("more_body", False)
                if seen > self.limit:
                    ended = whole or await self._discard(receive, seen)
                    raise fastapi.HTTPException(413, message, headers=None if ended else close)
            return got

        await self.app(scope, counted, send)


class HeadAsGet:
    """Answers HEAD on a GET route as GET, without the body (FastAPI routes GET alone: HEAD was
    405); the headers, Content-Length included, are GET's."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)

        async def headers_only(message):
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        # A copy: the server's own scope says HEAD, and it sends no body for it either.
        await self.app({**scope, "method": "GET"}, receive, headers_only)


class NoSniff:
    """Adds `X-Content-Type-Options: nosniff` to every response: a browser takes each body as
    the type it is sent as (a JSON error is never run as a script or drawn as HTML)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def with_header(message):
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", ()), (b"x-content-type-options", b"nosniff")]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_header)


class _Duplicate(ValueError):
    pass


def _refuse_duplicates(pairs):
    """`json.loads`' object_pairs_hook: the object, or `_Duplicate(key)` naming its first
    repeated key. Linear in the keys: the dict is built in C and the keys are walked, once
    with a set, only when it holds fewer keys than the pairs."""
    obj = dict(pairs)
    if len(obj) < len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise _Duplicate(key)
            seen.add(key)
    return obj


def is_json(content_type: str | None, strict: bool = True) -> bool:
    """Whether FastAPI parses a body of this Content-Type as JSON (`fastapi.routing`'s rule):
    application/json or application/*+json; none only where the route is not strict
    (`strict_content_type`, FastAPI's default). Any other body reaches the model as bytes, and
    FastAPI answers 422 (not an object) without parsing it."""
    if not content_type:
        return not strict
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


MAX_LISTED_FIELDS = 10  # unknown body fields named in a 422's details


def check_json_body(body: bytes, fields: frozenset[str] | None) -> None:
    """Raises ApiError 422 naming the first repeated key of the JSON `body` (where `json.loads`
    keeps the last value without a word), or RequestValidationError naming the first
    `MAX_LISTED_FIELDS` top-level keys not in `fields` (the body model's, when it forbids others:
    pydantic would make an error of each one, and FastAPI a response of them all, on the event
    loop). A body that does not parse is left to FastAPI, which has parsed it already (400).

    Linear in the body's size (the parse is `json.loads`'); meant to run in a worker thread.
    """
    try:
        value = json.loads(body, object_pairs_hook=_refuse_duplicates)
    except _Duplicate as e:
        raise ApiError(
            422, f"the body repeats the key {e.args[0]!r}; each key may appear once"
        ) from None
    except (ValueError, RecursionError):
        return
    if fields is None or not isinstance(value, dict):
        return
    unknown = [key for key in value if key not in fields]
    if unknown:
        raise fastapi_exceptions.RequestValidationError(
            [
                {
                    "type": "extra_forbidden",
                    "loc": ("body", key),
                    "msg": "Extra inputs are not permitted",
                }
                for key in unknown[:MAX_LISTED_FIELDS]
            ]
        )


class StrictJsonRoute(routing.APIRoute):
    """A route whose JSON body may not repeat a key (422, where `json.loads` keeps the last
    value without a word) nor, when its model forbids unknown fields, hold one (422 naming the
    first few: pydantic's error list would grow with the body).

    The check is a dependency appended to the route's own, so they run first (the edits' 403
    before it), and after FastAPI has parsed the body (a body that is not JSON: FastAPI's 400;
    one whose Content-Type is not JSON is not parsed, and FastAPI answers 422: not an object).
    It parses the body again in a worker thread, in time linear in its size: the event loop
    (`/healthz` and every other request) goes on meanwhile.
    """

    def __init__(self, path: str, endpoint, **kwargs):
        async def strict_json(request: fastapi.Request):
            await self._check_body(request)

        kwargs["dependencies"] = [*(kwargs.get("dependencies") or ()), fastapi.Depends(strict_json)]
        super().__init__(path, endpoint, **kwargs)
        self._fields = None  # the body model's fields, when it forbids others
        model = getattr(getattr(self.body_field, "field_info", None), "annotation", None)
        if (
            isinstance(model, type)
            and issubclass(model, BaseModel)
            and model.model_config.get("extra") == "forbid"
            and not getattr(self, "_embed_body_fields", True)  # the body is the model itself
        ):
            self._fields = frozenset(f.alias or n for n, f in model.model_fields.items())

    async def _check_body(self, request: fastapi.Request) -> None:
        strict = getattr(self.strict_content_type, "value", self.strict_content_type)
        if self.body_field is None or not is_json(request.headers.get("content-type"), strict):
            return  # FastAPI reads no JSON here
        body = await request.body()  # read by FastAPI already: kept by the request
        if body:
            await concurrency.run_in_threadpool(check_json_body, body, self._fields)


def allowed_hosts(config: ServerConfig) -> list[str]:
    if config.allowed_hosts:
        return list(config.allowed_hosts)
    hosts = ["localhost", "127.0.0.1", "::1", "[::1]"]
    if config.host not in ("", "0.0.0.0", "::", *hosts):
        hosts.append(config.host)
    return hosts
