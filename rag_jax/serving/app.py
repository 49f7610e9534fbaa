"""The HTTP server of a bundle: a versioned JSON API, its OpenAPI schema, and a page at `/`.

`make_app(model, config)` builds a FastAPI (Starlette) app around a loaded `bundle.Bundle`;
`serve(config)` loads the bundle and runs it under uvicorn. Routes:

- `POST /v1/answer` {"questions": [...], "variant"?, "num_beams"?, "n_docs"?}: per question the
  answer, its log-likelihood, the passages with prior p(z|x) and posterior p(z|x,y), and for
  RAG-Token each token's passage posteriors (`Bundle.answer`, via the `batching.Batcher`).
- `GET /v1/passages/{id}`; with `allow_edits`, `PUT` (add or replace) and `DELETE`
  (`Bundle.edit`: persisted atomically, seen by the next request; edits run one at a time).
  Without it they answer 403.
- `GET /v1/info` (the bundle, the server's limits, each setting's compiled (bucket, width)
  shapes), `GET /healthz` (200 once the warmed settings' first programs are compiled, 503
  before; the other shapes compile in the background, and `"compiled"` says when they are).
- `GET /metrics`: the counters in the Prometheus text format (requests by route template and
  status, latency and batch histograms, the queue, compiles, each setting's state, edits,
  timeouts); `GET /v1/metrics`: the same server as a JSON snapshot (`metrics.Metrics`).

Every error is a JSON body {"error": {"status", "message", "details"?}} with its status; a bug
answers 500 with the exception's type, its traceback only in the server's log, and a server
error's message names no folder of the server's (`api.redact`: the log keeps it whole). Every
response says `nosniff`, the page also its Content-Security-Policy (its own files only) and
that no other site may frame it; HEAD is answered on every GET route. A response over
`max_response_bytes` is refused (422) before a byte of it is sent (`ResponseLimit`); the
answers are rendered off the event loop. Swagger UI (`/docs`) only with `api_docs`, under a
policy as strict (its script from its CDN, its inline one by hash, never framed); no `/redoc`.

Hostile input is refused before it costs the server anything: a `Host` header not in
`allowed_hosts` (400: a DNS-rebinding page cannot reach a loopback server), a body over
`max_body_bytes` (413, from its Content-Length or while it streams, never kept whole; read
and thrown away up to 4 times the limit so that a client still writing it reads the 413), a
request giving both Content-Length and Transfer-Encoding (400, and the connection closes: a
request smuggled in its body is never answered), more questions than `max_batch` (413, from
the list's length in the schema: one error, not one per item), a JSON body repeating a key or
holding unknown fields (422, checked in a worker thread), a question over
`max_question_chars`, holding text UTF-8 cannot encode, or nothing visible (zero-width
characters, NUL: 413 / 422, before it is batched or tokenised), a passage text or id over its
limit (413).
A setting (variant, num_beams, n_docs) not compiled yet is compiled off the serving path, at
most `max_cold_settings` of them: its requests answer 503 with `Retry-After` until its first
shape is ready, and the warmed settings' traffic never waits on a compile; its other shapes
compile once it has traffic (`cold_fill_after` requests), and it is evicted after `cold_idle_s`
without a request served, or `cold_claim_s` after its compile if it served none (a request it
does not serve never renews it); one client starts one at a time, until it serves a request
(429 meanwhile). A warmed setting's probe answer with a non-finite number keeps `/healthz` 503
(its "reason" names the field); such an answer past ready is a 500 naming it. The serving path
never compiles: a batch runs at the cheapest (bucket, width) shape compiled that holds it
(`state.ServerState`). The batcher prepares the next batch (tokens, question vectors, passages,
contexts) while the current one generates; a failing merged batch is answered again one request
at a time (`batching.Batcher`), so one client's request never fails another's; a client whose
connection is lost (reset) before its batch starts is dropped (one that only closed its side,
FIN, may be waiting for the answer: a half-close). A slow client cannot hold a connection: a
request head not whole within `header_timeout_s` of the connection's opening (or of its first
byte after a keep-alive wait), or a body not whole within `body_timeout_s` after it, closes the
connection (`connections.TimedH11Protocol`); an idle kept-alive one closes after `keep_alive_s`;
a response not out of the server's buffer `send_timeout_s` after it began (its client does not
read) is dropped with its connection. A chunked body's framing counts against `max_body_bytes`.
One client address holds at most `max_connections_per_client` connections (closed on arrival
beyond), and at `max_connections` a client holding fewer than another takes one of its slots:
however many addresses slow clients use, they cannot make every other client's request answer
503. A client that half-closes after its request still reads the response; the connection
closes after it.
"""

import asyncio
import base64
import contextlib
import dataclasses
import errno
import hashlib
import importlib.resources
import logging
import os
import pathlib
import re
import socket
import tempfile
import threading

import fastapi
from fastapi import exceptions as fastapi_exceptions
from fastapi import responses, staticfiles
from fastapi.openapi.docs import get_swagger_ui_html
from starlette import concurrency
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import ClientDisconnect

from rag_jax.devices import host
from rag_jax.io import answers, bundle, bundle_format
from rag_jax.retrieval import files
from rag_jax.retrieval.corpus import Passage
from rag_jax.serving import metrics
from rag_jax.serving.api import (
    DRAIN_FACTOR,
    ApiError,
    BodyLimit,
    HeadAsGet,
    NoSniff,
    PassageBody,
    RequestCounter,
    ServerConfig,
    StrictJsonRoute,
    allowed_hosts,
    answer_request,
    check_text,
    error_response,
    has_visible,
    redact,
    validation_error,
)
from rag_jax.serving.state import ServerState, check_finite, live_metrics

log = logging.getLogger("rag_jax.serving")

# The page's own files only (its script and style sheet are files of their own: nothing inline),
# and no other site may frame it (clickjacking an edit).
PAGE_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; base-uri 'none'; object-src 'none'; form-action 'self'; "
        "frame-ancestors 'none'"
    ),
    "x-frame-options": "DENY",
}
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
DOCS_CDN = "https://cdn.jsdelivr.net"  # where FastAPI's Swagger UI page loads its script and style


def docs_page(title: str, openapi_url: str) -> responses.HTMLResponse:
    """Swagger UI (`ServerConfig.api_docs`) under a policy as strict as the page's: its script
    and style sheet from `DOCS_CDN` only, its inline script by its hash, never framed."""
    html = get_swagger_ui_html(
        openapi_url=openapi_url, title=title, oauth2_redirect_url=None, swagger_favicon_url="data:,"
    ).body.decode()
    hashes = " ".join(
        "'sha256-" + base64.b64encode(hashlib.sha256(script.encode()).digest()).decode() + "'"
        for script in re.findall(r"<script>(.*?)</script>", html, re.DOTALL)
    )
    policy = (
        f"default-src 'self'; script-src {DOCS_CDN} {hashes}; "
        f"style-src {DOCS_CDN} 'unsafe-inline'; img-src 'self' data:; base-uri 'none'; "
        "object-src 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    headers = {**PAGE_HEADERS, "content-security-policy": policy}
    return responses.HTMLResponse(html, headers=headers)


class ResponseLimit:
    """Answers 422 in place of a response whose Content-Length is over `limit` bytes, before a
    byte of it is sent (every response of this app has a length): an answer carrying passages
    planted by edits made a 527-byte request return 25.6 MB."""

    def __init__(self, app, limit: int):
        if limit < 1:
            raise ValueError(f"max_response_bytes must be >= 1, got {limit}")
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refused = False

        async def bounded(message):
            nonlocal refused
            if message["type"] == "http.response.start":
                length = dict(message.get("headers", ())).get(b"content-length", b"0")
                if int(length) > self.limit:
                    refused = True
                    log.warning("%s: a response of %s bytes refused", scope["path"], int(length))
                    message = (
                        f"the response would be {int(length)} bytes, over the server's "
                        f"max_response_bytes ({self.limit}); ask for less at once (fewer "
                        "questions, a smaller n_docs)"
                    )
                    return await error_response(422, message)(scope, receive, send)
            if not refused:
                await send(message)

        await self.app(scope, receive, bounded)


def _not_writable(error: BaseException | None) -> bool:
    """Whether `error`, or one it was raised from, says a folder may not be written."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in _NOT_WRITABLE:
            return True
        error = error.__cause__ or error.__context__
    return False


def check_writable(model: bundle.Bundle) -> None:
    """Raises ValueError when edits could never be written: `Bundle.edit` writes a new folder
    beside the bundle's and renames it in, so the bundle's parent folder must take a new one."""
    if model.directory is None:
        return
    directory = pathlib.Path(model.directory).absolute()
    try:
        probe = tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.probe.")
        os.rmdir(probe)
    except OSError as e:
        raise ValueError(
            f"--allow_edits: edits of {directory} are written in {directory.parent}, which takes "
            f"no new folder ({e}); serve it without --allow_edits or from a writable folder"
        ) from None


async def _disconnected(request: fastapi.Request) -> None:
    """Returns when the client has gone away (its body was read: the next message says so)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def make_app(model: bundle.Bundle, config: ServerConfig, *, warm_up: bool = True):
    """The FastAPI app serving `model` (see the module docstring); compiles in the background
    when `warm_up` (else it is ready at once and its answers compile what they need).

    Raises:
      ValueError: `allow_edits` for a bundle whose folder cannot be written.
    """
    if config.allow_edits:
        check_writable(model)
    state = ServerState(model, config, on_demand=not warm_up)
    state.metrics.watch(lambda: live_metrics(state))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if warm_up:
            threading.Thread(target=state.warm_up, name="warm-up", daemon=True).start()
        else:
            state.compiled_traces = model.traces
            state.warm.update(state.warmed)
            state.ready.set()
        stop = threading.Event()
        threading.Thread(
            target=state.verify_forever, args=(stop,), name="verify", daemon=True
        ).start()
        yield
        stop.set()
        await asyncio.to_thread(state.batcher.close)
        state.compiler.shutdown(wait=False, cancel_futures=True)

    from rag_jax.serving import connections  # the [serve] extra, as uvicorn

    app = fastapi.FastAPI(
        title="rag_jax",
        version="1",
        summary="Answers with their provenance from a trained RAG bundle; live knowledge edits.",
        lifespan=lifespan,
        docs_url=None,  # `api_docs` serves /docs under the page's headers; no /redoc
        redoc_url=None,
        swagger_ui_oauth2_redirect_url=None,
    )
    app.state.server = state
    app.router.route_class = StrictJsonRoute  # their JSON bodies: no repeated or unknown keys

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        message = e.message
        if e.status >= 500 and model.directory is not None:  # the server's, not the client's
            message = redact(message, [pathlib.Path(model.directory).absolute().parent])
        return error_response(e.status, message, headers=e.headers)

    @app.exception_handler(fastapi_exceptions.RequestValidationError)
    async def invalid(request, e):
        return validation_error(e.errors())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e):
        return error_response(e.status_code, str(e.detail), headers=e.headers)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request, e):  # e.g. its body timed out: no one reads an answer
        return responses.Response(status_code=499)  # nginx's "client closed request"

    @app.exception_handler(Exception)
    async def bug(request, e):
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(500, f"internal error ({type(e).__name__}); see the server's log")

    # Added last = outermost: the host is checked first, then the body's size, then counted
    # (the response's size refusal too); every response, refusals included, says nosniff.
    app.add_middleware(ResponseLimit, limit=config.max_response_bytes)
    app.add_middleware(RequestCounter, metrics=state.metrics)
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts(config))
    app.add_middleware(HeadAsGet)
    app.add_middleware(NoSniff)
    questions_model = answer_request(config.max_batch)  # its list bounded in the schema

    @app.post("/v1/answer")
    async def answer(request: questions_model, http: fastapi.Request):
        """Answers 1 to max_batch questions with their passages (prior and posterior) and, for
        RAG-Token, each token's passage posteriors."""
        setting = state.setting_of(request)
        if not state.ready.is_set():  # compiling, or found damaged (then it says which file)
            raise ApiError(503, state.unhealthy or "the server is still compiling; try again")
        peer = None if http.client is None else (http.client.host, http.client.port)
        state.check_warm(setting, connections.client_key(peer))
        future = state.batcher.submit(setting, request.questions)
        answered = asyncio.wrap_future(future)
        gone = asyncio.ensure_future(_disconnected(http))
        try:
            await asyncio.wait({answered, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not answered.done():  # the client went away: its request is dropped if not begun
            answered.cancel()
            return responses.Response(status_code=499)  # nginx's "client closed request"
        try:
            answers = answered.result()
        except ValueError as e:  # e.g. an edit left fewer passages than n_docs
            raise ApiError(422, str(e)) from e

        def rendered():  # off the event loop: an answer may carry megabytes of passages
            check_finite(answers)  # a named 500, not the JSON renderer's exception
            body = {
                "answers": [a.to_dict() for a in answers],
                "setting": dataclasses.asdict(setting),
                "question_token_limit": model.settings.question_length,
            }
            return responses.JSONResponse(body)  # plain data: no jsonable_encoder pass

        return await concurrency.run_in_threadpool(rendered)

    @app.get("/v1/passages/{passage_id:path}")
    async def get_passage(passage_id: str):
        """One passage of the bundle's store."""
        return state.passage(passage_id)

    def _check_edits():
        if not config.allow_edits:
            raise ApiError(403, "edits are off: start the server with --allow_edits")

    def _written(edit_fn):
        """`edit_fn()`'s report; a failed write answers what went wrong, the bundle unchanged."""
        try:
            return edit_fn()
        except bundle_format.DamagedBundleError as e:  # the server's fault, not the request's
            log.error("%s", e)
            raise ApiError(500, str(e)) from e
        except OSError as e:
            log.error("an edit failed: %s", e)  # whole: the client's message is redacted
            if files.is_disk_full(e):
                status, message = 507, f"the edit was not written ({e})"
            elif _not_writable(e):  # e.g. remounted read-only, or its owner changed
                status = 507
                message = (
                    "the edit was not written: the bundle's folder is not writable "
                    f"({e}); serve a writable copy, or without --allow_edits"
                )
            else:
                status, message = 500, f"the edit was not written ({e})"
            raise ApiError(status, f"{message}; the bundle is unchanged") from e

    def _put(passage_id: str, body: PassageBody) -> tuple[dict, bool]:
        check_text("id", passage_id, config.max_id_chars, "a passage id")
        check_text("text", body.text, config.max_passage_chars, "a passage")
        if body.title is not None:
            check_text("title", body.title, config.max_passage_chars, "a title")
        with state.edit_lock:  # the title lookup and the edit, together
            if not has_visible(body.text):
                raise ApiError(422, "text: the passage has no text (no visible character)")
            store = model.store
            row = state.row_of(store, passage_id)
            title = body.title
            if title is None:
                title = "" if row is None else store.title(row)
            try:
                passage = Passage(passage_id, title, body.text)
                report = _written(lambda: model.edit(upserts=[passage]))
            except ValueError as e:
                raise ApiError(422, str(e)) from e
            state.metrics.edit()
        passage = {"id": passage_id, "title": title, "text": body.text}
        return {"passage": passage, "created": row is None, "edit": report}, row is None

    def _delete(passage_id: str) -> dict:
        with state.edit_lock:
            if state.row_of(model.store, passage_id) is None:
                raise ApiError(404, f"no passage with id {passage_id!r}")
            try:
                report = _written(lambda: model.edit(deletes=[passage_id]))
            except ValueError as e:  # e.g. fewer passages than n_docs would be left
                raise ApiError(409, str(e)) from e
            state.metrics.edit()
        return {"deleted": passage_id, "edit": report}

    # A dependency runs before the body is checked (`StrictJsonRoute`) and validated: without
    # --allow_edits, 403 whatever the body holds (FastAPI's 400 first for one that is not JSON).
    edits = [fastapi.Depends(_check_edits)]

    @app.put("/v1/passages/{passage_id:path}", dependencies=edits)
    async def put_passage(passage_id: str, body: PassageBody):
        """Adds or replaces a passage (`--allow_edits`); the next request retrieves from it."""
        out, created = await concurrency.run_in_threadpool(_put, passage_id, body)
        return responses.JSONResponse(out, status_code=201 if created else 200)

    @app.delete("/v1/passages/{passage_id:path}", dependencies=edits)
    async def delete_passage(passage_id: str):
        """Deletes a passage (`--allow_edits`); no later request retrieves it."""
        return await concurrency.run_in_threadpool(_delete, passage_id)

    @app.get("/v1/info")
    async def info():
        """The bundle's defaults and the server's limits."""
        d = state.default
        return {
            "variant": d.variant,
            "num_beams": d.num_beams,
            "n_docs": d.n_docs,
            "max_n_docs": min(state.max_n_docs, len(model.store)),
            "max_beams": config.max_beams,
            "max_batch": config.max_batch,
            "question_token_limit": model.settings.question_length,
            "max_question_chars": config.max_question_chars,
            "max_passage_chars": config.max_passage_chars,
            "max_id_chars": config.max_id_chars,
            "max_body_bytes": config.max_body_bytes,
            "settings": state.settings_view(),
            "programs": state.programs_view(),
            "passages": len(model.store),
            "step": model.step,
            "allow_edits": config.allow_edits,
        }

    @app.get("/healthz")
    async def healthz():
        """200 once each warmed setting's first shape is compiled (then every answer can run);
        503 before, with a "reason" when a probe answer kept it unready (a non-finite number,
        named) or a file of the bundle was found damaged (`verify_every_s`). "compiled": every
        shape of the warmed settings is (none compiles later)."""
        ready = state.ready.is_set()
        compiled = state.compiled_traces is not None
        body = {"ready": ready, "compiled": compiled, "passages": len(model.store)}
        if not ready and state.unhealthy is not None:  # why; no folder of the server's named
            body["reason"] = (
                redact(state.unhealthy, [pathlib.Path(model.directory).absolute().parent])
                if model.directory is not None
                else state.unhealthy
            )
        return responses.JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics", response_class=responses.PlainTextResponse)
    async def prometheus_metrics():
        """The server's metrics in the Prometheus text format, for a Prometheus scrape."""
        return responses.Response(state.metrics.exposition(), media_type=metrics.CONTENT_TYPE)

    @app.get("/v1/metrics")
    async def json_metrics():
        """Requests by route and status, answer latency percentiles (ms), batch sizes, how many
        times the answering programs were traced (compiled), the queue, each setting's state."""
        return responses.JSONResponse(state.metrics.snapshot())

    if config.api_docs:

        @app.get("/docs", include_in_schema=False)
        async def swagger_ui():
            return docs_page(f"{app.title} API", app.openapi_url)

    static = importlib.resources.files("rag_jax.serving") / "static"

    @app.get("/", include_in_schema=False)
    async def page():
        html = (static / "index.html").read_text(encoding="utf-8")
        return responses.HTMLResponse(html, headers=PAGE_HEADERS)

    app.mount("/static", staticfiles.StaticFiles(directory=str(static)), name="static")
    return app


def uvicorn_config(app, config: ServerConfig):
    """uvicorn's settings for `app` (made by `make_app`): idle kept-alive connections closed
    after `keep_alive_s`, request heads and bodies that arrive too slowly after
    `header_timeout_s` / `body_timeout_s` and responses not read within `send_timeout_s`
    (counted in the app's metrics), bodies counted with their chunked framing against
    `max_body_bytes`, at most `max_connections` open (503 beyond), of which one client address
    holds at most `max_connections_per_client` (closed on arrival beyond, counted too) and at
    the limit a client holding fewer takes a slot of the one holding the most (counted), request
    heads of at most 64 KiB.

    Raises:
      ValueError: a timeout that is not a positive number of seconds, or a negative
        `max_connections_per_client` (named).
    """
    import uvicorn  # the [serve] extra

    from rag_jax.serving import connections  # uvicorn's protocol: the [serve] extra too

    if config.max_connections_per_client < 0:
        raise ValueError(
            "max_connections_per_client must be >= 0 (0: no cap of its own), got "
            f"{config.max_connections_per_client}"
        )
    counts = app.state.server.metrics
    http = connections.protocol(
        config.header_timeout_s,
        config.body_timeout_s,
        counts.timed_out,
        max_per_client=config.max_connections_per_client or None,
        on_refused=counts.refused,
        send_timeout_s=config.send_timeout_s,
        on_evicted=counts.evicted,
        max_body_bytes=config.max_body_bytes,
        max_body_read=DRAIN_FACTOR * config.max_body_bytes,  # as far as `BodyLimit` reads
    )
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        http=http,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=config.keep_alive_s,
        limit_concurrency=config.max_connections,
        h11_max_incomplete_event_size=64 << 10,
        timeout_graceful_shutdown=30,
    )


def serve(config: ServerConfig, sock: socket.socket | None = None) -> None:
    """Loads the bundle and serves it until interrupted (uvicorn, one process); first puts back
    a bundle an interrupted swap left aside and removes the folders interrupted writes left.

    Args:
      config: what to serve, and how.
      sock: the socket to listen on, bound (`connections.bind`); None: bound here to
        `config.host`/`config.port` before anything is loaded.

    Raises:
      OSError: the address cannot be bound (e.g. the port is in use: saying so).
    """
    import uvicorn  # the [serve] extra

    from rag_jax.serving import connections

    if sock is None:  # first: a port in use fails in a second, not after the bundle's load
        sock = connections.bind(config.host, config.port)
    # XLA's CPU pool one thread short of the cores: the event loop and the batcher's preparing
    # thread run beside the model without stalling its parallel ops.
    host.start_jax_leaving_a_core()
    answers.enable_compilation_cache()
    for removed in bundle_format.remove_stale(config.bundle):
        log.warning("removed %s, left by an interrupted write", removed)
    model = bundle.load(config.bundle)
    app = make_app(model, config)
    log.info("serving %s on http://%s:%d/", config.bundle, config.host, config.port)
    uvicorn.Server(uvicorn_config(app, config)).run(sockets=[sock])
