"""The HTTP server of a bundle: a versioned JSON API, its OpenAPI schema, and a page at `/`.

`make_app(model, config)` builds a FastAPI (Starlette) app around a loaded `bundle.Bundle`;
`serve(config)` loads the bundle and runs it under uvicorn. Routes:

- `POST /v1/answer` {"questions": [...], "variant"?, "num_beams"?, "n_docs"?}: per question the
  answer, its log-likelihood, the passages with prior p(z|x) and posterior p(z|x,y), and for
  RAG-Token each token's passage posteriors (`Bundle.answer`, via the `batching.Batcher`).
- `GET /v1/passages/{id}`; with `allow_edits`, `PUT` (add or replace) and `DELETE`
  (`Bundle.edit`: persisted atomically, seen by the next request; edits run one at a time).
  Without it they answer 403.
- `GET /v1/info` (the bundle and the server's limits), `GET /healthz` (200 once the programs of
  the default setting are compiled, 503 before), `GET /metrics` (`metrics.Metrics`).

Every error is a JSON body {"error": {"status", "message", "details"?}} with its status; a bug
answers 500 with the exception's type, its traceback only in the server's log.

Hostile input is refused before it costs the server anything: a `Host` header not in
`allowed_hosts` (400: a DNS-rebinding page cannot reach a loopback server), a body over
`max_body_bytes` (413, from its Content-Length or while it streams, never read whole), a body
repeating a JSON key (422), a question over `max_question_chars` or holding text UTF-8 cannot
encode (413 / 422, before it is batched or tokenised), a passage text or id over its limit (413).
A setting (variant, num_beams, n_docs) not compiled yet is compiled off the serving path, at most
`max_cold_settings` of them: its requests answer 503 with `Retry-After` until it is ready, and the
warmed settings' traffic never waits on a compile. A failing merged batch is answered again one
request at a time (`batching.Batcher`), so one client's request never fails another's; a client
that disconnects before its batch starts is dropped.
"""

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import importlib.resources
import json
import logging
import math
import os
import pathlib
import tempfile
import threading
import time
from typing import Literal

import fastapi
from fastapi import exceptions as fastapi_exceptions
from fastapi import responses, routing, staticfiles
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr
from starlette import concurrency
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware

from rag_jax import bundle, bundle_format
from rag_jax.retrieval import files
from rag_jax.retrieval.corpus import Passage, has_surrogate
from rag_jax.serving import batching, metrics

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


def _error(status: int, message: str, details=None, headers=None) -> responses.JSONResponse:
    body = {"status": status, "message": message}
    if details is not None:
        body["details"] = details
    return responses.JSONResponse({"error": body}, status_code=status, headers=headers)


def _check_text(field: str, text: str, limit: int, what: str) -> None:
    """ApiError naming `field` if `text` is over `limit` characters (413) or holds a lone
    surrogate, which UTF-8 cannot encode and tokenizers fail on (422)."""
    if len(text) > limit:
        raise ApiError(413, f"{field}: {len(text)} characters, at most {limit} in {what}")
    if has_surrogate(text):
        raise ApiError(
            422, f"{field}: holds a lone surrogate (e.g. \\ud800), which is not Unicode text"
        )


def _validation_details(errors) -> list[dict]:
    return [
        {"loc": [str(x) for x in e.get("loc", ())], "msg": e.get("msg", ""), "type": e.get("type")}
        for e in errors
    ]


class _State:
    """What the routes share: the bundle, the batcher, the counters, readiness."""

    def __init__(self, model: bundle.Bundle, config: ServerConfig):
        self.model, self.config = model, config
        self.metrics = metrics.Metrics()
        self.ready = threading.Event()
        self.edit_lock = threading.Lock()  # read-modify-write of a passage, one at a time
        self.rows: tuple = (None, {})  # (store, {id: row}) of the latest store looked up
        self.default = batching.Setting(
            model.settings.variant, model.rag_cfg.generation.num_beams, model.rag_cfg.n_docs
        )
        self.max_n_docs = config.max_n_docs or model.rag_cfg.n_docs
        self.batcher = batching.Batcher(
            self._answer,
            max_batch=config.max_batch,
            max_wait_s=config.max_wait_ms / 1e3,
            on_batch=self.metrics.batch,
        )
        self.compiled_traces = None  # the trace count once ready
        self.settings_lock = threading.Lock()
        self.warm: set[batching.Setting] = set()  # compiled: answered at once
        self.compiling: set[batching.Setting] = set()  # compiling in the background
        self.failed: dict[batching.Setting, str] = {}  # settings whose compile failed: why
        self.compile_s = 10.0  # how long the latest setting took to compile (Retry-After)
        self.compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compile")

    def _answer(self, questions, setting: batching.Setting):
        return self.model.answer(
            questions,
            variant=setting.variant,
            num_beams=setting.num_beams,
            n_docs=setting.n_docs,
        )

    def _compile(self, setting: batching.Setting) -> None:
        start = time.monotonic()
        self.model.compile(
            self.config.max_batch,
            variant=setting.variant,
            num_beams=setting.num_beams,
            n_docs=setting.n_docs,
        )
        with self.settings_lock:
            self.warm.add(setting)
            self.compile_s = time.monotonic() - start

    def warm_up(self) -> None:
        d = self.default
        try:
            for variant in self.config.warm_variants or (d.variant,):
                self._compile(batching.Setting(variant, d.num_beams, d.n_docs))
        except Exception:  # noqa: BLE001 - the server stays up, not ready, and says why
            log.exception("compiling the answering programs failed")
            return
        self.compiled_traces = self.model.traces
        self.ready.set()
        log.warning("ready: %d traces compiled", self.compiled_traces)

    def _compile_cold(self, setting: batching.Setting) -> None:
        try:
            self._compile(setting)
            log.warning("compiled %s", setting)
        except Exception as e:  # noqa: BLE001 - its requests answer why
            log.exception("compiling %s failed", setting)
            with self.settings_lock:
                self.failed[setting] = f"{type(e).__name__}: {e}"
        finally:
            with self.settings_lock:
                self.compiling.discard(setting)

    def check_warm(self, setting: batching.Setting) -> None:
        """Returns if `setting` is compiled; else starts compiling it in the background (at most
        `max_cold_settings` beyond the warmed ones) and raises ApiError: 503 with Retry-After
        while it compiles, 422 when no more settings are compiled, 500 if its compile failed."""
        with self.settings_lock:
            if setting in self.warm:
                return
            name = (
                f"variant={setting.variant}, num_beams={setting.num_beams}, n_docs={setting.n_docs}"
            )
            if setting in self.failed:
                raise ApiError(500, f"{name}: compiling it failed ({self.failed[setting]})")
            if setting not in self.compiling:
                warmed = len(self.config.warm_variants or (self.default.variant,))
                cold = len(self.warm) + len(self.compiling) + len(self.failed) - warmed
                if cold >= self.config.max_cold_settings:
                    served = sorted(dataclasses.astuple(s) for s in self.warm)
                    raise ApiError(
                        422,
                        f"{name}: this server compiles at most {self.config.max_cold_settings} "
                        f"settings beyond the warmed ones; it serves (variant, num_beams, "
                        f"n_docs) in {served}",
                    )
                self.compiling.add(setting)
                self.compiler.submit(self._compile_cold, setting)
            retry = max(1, math.ceil(self.compile_s))
        raise ApiError(
            503,
            f"{name}: compiling its programs; try again in {retry} s",
            headers={"Retry-After": str(retry)},
        )

    def settings_view(self) -> dict:
        with self.settings_lock:
            view = {"ready": self.warm, "compiling": self.compiling, "failed": self.failed}
            return {k: sorted(dataclasses.astuple(s) for s in v) for k, v in view.items()}

    def row_of(self, store, passage_id: str) -> int | None:
        """`passage_id`'s row in `store` (a store is immutable: its map is built once)."""
        cached, rows = self.rows
        if cached is not store:  # an edit made a new store
            rows = {store.ids[i]: i for i in range(len(store))}
            self.rows = (store, rows)
        return rows.get(passage_id)

    def passage(self, passage_id: str) -> dict:
        store = self.model.store
        row = self.row_of(store, passage_id)
        if row is None:
            raise ApiError(404, f"no passage with id {passage_id!r}")
        return {"id": passage_id, "title": store.title(row), "text": store.text(row)}

    def setting_of(self, request: AnswerRequest) -> batching.Setting:
        c, d = self.config, self.default
        if not request.questions:
            raise ApiError(422, "questions: expected 1 or more questions, got none")
        if len(request.questions) > c.max_batch:
            raise ApiError(
                413, f"questions: {len(request.questions)} questions, at most {c.max_batch}"
            )
        for i, q in enumerate(request.questions):
            _check_text(f"questions[{i}]", q, c.max_question_chars, "a question")
            if not q.strip():
                raise ApiError(422, f"questions[{i}]: expected a non-empty question")
        n_docs = d.n_docs if request.n_docs is None else request.n_docs
        top = min(self.max_n_docs, len(self.model.store))
        if not 1 <= n_docs <= top:
            raise ApiError(422, f"n_docs={n_docs}: this server retrieves 1 to {top} passages")
        beams = d.num_beams if request.num_beams is None else request.num_beams
        if not 1 <= beams <= c.max_beams:
            raise ApiError(422, f"num_beams={beams}: this server decodes 1 to {c.max_beams} beams")
        return batching.Setting(request.variant or d.variant, beams, n_docs)


class _Count:
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
            path = getattr(scope.get("route"), "path", "other")  # set by the router
            self.metrics.request(path, status[0], time.monotonic() - start)


class _BodyLimit:
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
            return await _error(413, message)(scope, receive, send)
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


class _StrictJsonRoute(routing.APIRoute):
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


def _allowed_hosts(config: ServerConfig) -> list[str]:
    if config.allowed_hosts:
        return list(config.allowed_hosts)
    hosts = ["localhost", "127.0.0.1", "::1", "[::1]"]
    if config.host not in ("", "0.0.0.0", "::", *hosts):
        hosts.append(config.host)
    return hosts


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
    when `warm_up` (else it is ready at once).

    Raises:
      ValueError: `allow_edits` for a bundle whose folder cannot be written.
    """
    if config.allow_edits:
        check_writable(model)
    state = _State(model, config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if warm_up:
            threading.Thread(target=state.warm_up, name="warm-up", daemon=True).start()
        else:
            state.compiled_traces = model.traces
            state.warm.update(
                batching.Setting(v, state.default.num_beams, state.default.n_docs)
                for v in config.warm_variants or (state.default.variant,)
            )
            state.ready.set()
        yield
        await asyncio.to_thread(state.batcher.close)
        state.compiler.shutdown(wait=False, cancel_futures=True)

    app = fastapi.FastAPI(
        title="rag_jax",
        version="1",
        summary="Answers with their provenance from a trained RAG bundle; live knowledge edits.",
        lifespan=lifespan,
    )
    app.state.server = state
    app.router.route_class = _StrictJsonRoute  # the routes below refuse repeated JSON keys

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return _error(e.status, e.message, headers=e.headers)

    @app.exception_handler(fastapi_exceptions.RequestValidationError)
    async def invalid(request, e):
        errors = e.errors()
        if any(err.get("type") == "json_invalid" for err in errors):
            return _error(400, "the body is not valid JSON", _validation_details(errors))
        return _error(422, "the request does not match its schema", _validation_details(errors))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e):
        return _error(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def bug(request, e):
        log.exception("%s %s failed", request.method, request.url.path)
        return _error(500, f"internal error ({type(e).__name__}); see the server's log")

    # Added last = outermost: the host is checked first, then the body's size, then counted.
    app.add_middleware(_Count, metrics=state.metrics)
    app.add_middleware(_BodyLimit, limit=config.max_body_bytes)
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=_allowed_hosts(config))

    @app.post("/v1/answer")
    async def answer(request: AnswerRequest, http: fastapi.Request):
        """Answers 1 to max_batch questions with their passages (prior and posterior) and, for
        RAG-Token, each token's passage posteriors."""
        setting = state.setting_of(request)
        if not state.ready.is_set():
            raise ApiError(503, "the server is still compiling its programs; try again")
        state.check_warm(setting)
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
        body = {
            "answers": [a.to_dict() for a in answers],
            "setting": dataclasses.asdict(setting),
            "question_token_limit": model.settings.question_length,
        }
        return responses.JSONResponse(body)  # plain data: no jsonable_encoder pass

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
            log.error("an edit failed: %s", e)
            status = 507 if files.is_disk_full(e) else 500
            message = f"the edit was not written ({e}); the bundle is unchanged"
            raise ApiError(status, message) from e

    def _put(passage_id: str, body: PassageBody) -> tuple[dict, bool]:
        _check_text("id", passage_id, config.max_id_chars, "a passage id")
        _check_text("text", body.text, config.max_passage_chars, "a passage")
        if body.title is not None:
            _check_text("title", body.title, config.max_passage_chars, "a title")
        with state.edit_lock:  # the title lookup and the edit, together
            if not body.text.strip():
                raise ApiError(422, "text: the passage has no text")
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

    # A dependency runs before the body is validated: without --allow_edits, 403 whatever the body.
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
            "passages": len(model.store),
            "step": model.step,
            "allow_edits": config.allow_edits,
        }

    @app.get("/healthz")
    async def healthz():
        """200 once the default setting's programs are compiled; 503 before."""
        ready = state.ready.is_set()
        body = {"ready": ready, "passages": len(model.store)}
        return responses.JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def get_metrics():
        """Requests by route and status, answer latency percentiles (ms), batch sizes, and how
        many times the answering programs were traced (compiled)."""
        return state.metrics.snapshot(
            compiles=model.traces,
            compiles_at_ready=state.compiled_traces,
            ready=state.ready.is_set(),
            passages=len(model.store),
            settings=state.settings_view(),
        )

    static = importlib.resources.files("rag_jax.serving") / "static"

    @app.get("/", include_in_schema=False)
    async def page():
        return responses.HTMLResponse((static / "index.html").read_text(encoding="utf-8"))

    app.mount("/static", staticfiles.StaticFiles(directory=str(static)), name="static")
    return app


def uvicorn_config(app, config: ServerConfig):
    """uvicorn's settings for `app`: idle kept-alive connections closed after `keep_alive_s`, at
    most `max_connections` open (503 beyond), request heads of at most 64 KiB."""
    import uvicorn  # the [serve] extra

    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=config.keep_alive_s,
        limit_concurrency=config.max_connections,
        h11_max_incomplete_event_size=64 << 10,
        timeout_graceful_shutdown=30,
    )


def serve(config: ServerConfig) -> None:
    """Loads the bundle and serves it until interrupted (uvicorn, one process); first puts back
    a bundle an interrupted swap left aside and removes the folders interrupted writes left."""
    import uvicorn  # the [serve] extra

    bundle.enable_compilation_cache()
    for removed in bundle_format.remove_stale(config.bundle):
        log.warning("removed %s, left by an interrupted write", removed)
    model = bundle.load(config.bundle)
    app = make_app(model, config)
    log.warning("serving %s on http://%s:%d/", config.bundle, config.host, config.port)
    uvicorn.Server(uvicorn_config(app, config)).run()
