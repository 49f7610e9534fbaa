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
answers 500 with the exception's type, its traceback only in the server's log.

Hostile input is refused before it costs the server anything: a `Host` header not in
`allowed_hosts` (400: a DNS-rebinding page cannot reach a loopback server), a body over
`max_body_bytes` (413, from its Content-Length or while it streams, never read whole), a body
repeating a JSON key (422), a question over `max_question_chars` or holding text UTF-8 cannot
encode (413 / 422, before it is batched or tokenised), a passage text or id over its limit (413).
A setting (variant, num_beams, n_docs) not compiled yet is compiled off the serving path, at most
`max_cold_settings` of them: its requests answer 503 with `Retry-After` until its first shape is
ready, and the warmed settings' traffic never waits on a compile. The serving path never compiles:
a batch runs at the cheapest (bucket, width) shape compiled that holds it (`_State`). The
batcher prepares the next batch (tokens, question vectors, passages, contexts) while the current
one generates; a failing merged batch is answered again one request at a time
(`batching.Batcher`), so one client's request never fails another's; a client that disconnects
before its batch starts is dropped. A slow client cannot hold a connection: a
request head not whole within `header_timeout_s` of the connection's opening (or of its first
byte after a keep-alive wait), or a body not whole within `body_timeout_s` after it, closes the
connection (`connections.TimedH11Protocol`); an idle kept-alive one closes after `keep_alive_s`.
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
from starlette.requests import ClientDisconnect

from rag_jax.io import bundle, bundle_format
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
    """What the routes share: the bundle, the batcher, the counters, readiness.

    A setting is served once its first (bucket, width) shape is compiled (`Bundle.compile_plan`:
    the top bucket at the widest width, which any batch pads up to); its other shapes then
    compile one by one on the compile thread while it is served, and answers run only at shapes
    compiled (`compiled_only`), padding up to the cheapest: the serving path never compiles.
    """

    def __init__(self, model: bundle.Bundle, config: ServerConfig, *, on_demand: bool = False):
        """Args:
        model, config: the bundle served and how.
        on_demand: answers compile the programs they need (nothing is compiled ahead: for a
          server whose answers never reach the model).
        """
        self.model, self.config, self.on_demand = model, config, on_demand
        self.metrics = metrics.Metrics(config.max_batch)
        self.ready = threading.Event()
        self.edit_lock = threading.Lock()  # read-modify-write of a passage, one at a time
        self.rows: tuple = (None, {})  # (store, {id: row}) of the latest store looked up
        self.default = batching.Setting(
            model.settings.variant, model.rag_cfg.generation.num_beams, model.rag_cfg.n_docs
        )
        self.max_n_docs = config.max_n_docs or model.rag_cfg.n_docs
        self.warmed = [  # the settings compiled before ready
            batching.Setting(v, self.default.num_beams, self.default.n_docs)
            for v in config.warm_variants or (self.default.variant,)
        ]
        # The batcher's two stages: the next batch is prepared (tokenised, encoded, retrieved)
        # on one thread while the current one generates on another.
        self.batcher = batching.Batcher(
            self._prepare,
            self._generate,
            max_batch=config.max_batch,
            max_wait_s=config.max_wait_ms / 1e3,
            on_batch=self.metrics.batch,
        )
        # The trace count once every shape of the warmed settings is compiled (None before):
        # their traffic traces nothing more.
        self.compiled_traces = None
        self.settings_lock = threading.Lock()
        self.warm: set[batching.Setting] = set()  # served: their first shape is compiled
        self.compiling: set[batching.Setting] = set()  # their first shape compiling: 503
        self.failed: dict[batching.Setting, str] = {}  # settings whose compile failed: why
        self.filling: set[batching.Setting] = set()  # served, other shapes still compiling
        self.compile_s = 10.0  # how long the latest first shape took to compile (Retry-After)
        self.compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compile")

    def _prepare(self, questions, setting: batching.Setting):
        return self.model.prepare(
            questions,
            variant=setting.variant,
            num_beams=setting.num_beams,
            n_docs=setting.n_docs,
            compiled_only=not self.on_demand,
        )

    def _generate(self, prepared, setting: batching.Setting):
        del setting  # each prepared question holds its own
        return self.model.generate(prepared, compiled_only=not self.on_demand)

    def _compile(self, setting: batching.Setting, shapes) -> None:
        self.model.compile(
            self.config.max_batch,
            variant=setting.variant,
            num_beams=setting.num_beams,
            n_docs=setting.n_docs,
            shapes=shapes,
        )

    def ready_shapes(self, setting: batching.Setting) -> tuple[tuple[int, int], ...]:
        """The (batch bucket, context width) shapes of `setting` compiled: answers run at the
        cheapest that holds them (`Bundle.ready_shapes`)."""
        key = bundle.AnswerSetting(
            setting.variant,
            setting.num_beams,
            setting.n_docs,
            self.model.settings.sequence_decoding,
        )
        return self.model.ready_shapes().get(key, ())

    def _compile_first(self, setting: batching.Setting) -> None:
        """Compiles `setting`'s first shape: it is served from then on."""
        start = time.monotonic()
        self._compile(setting, self.model.compile_plan(self.config.max_batch)[:1])
        with self.settings_lock:
            self.warm.add(setting)
            self.filling.add(setting)
            self.compile_s = time.monotonic() - start

    def _compile_next(self, setting: batching.Setting) -> None:
        """Compiles the next shape of `setting` not compiled yet, then queues the one after: one
        shape per task, so a cold setting's first shape waits behind one shape at most."""
        plan = self.model.compile_plan(self.config.max_batch)
        missing = [s for s in plan if s not in self.ready_shapes(setting)]
        try:
            self._compile(setting, missing[:1])
        except Exception:  # noqa: BLE001 - it is served with the shapes compiled
            log.exception("compiling %s at (bucket, width) %s failed", setting, missing[:1])
            missing = []
        if len(missing) > 1 and self._submit(self._compile_next, setting):
            return
        with self.settings_lock:
            self.filling.discard(setting)
            done = self.compiled_traces is None and not self.filling & set(self.warmed)
        if done:
            self.compiled_traces = self.model.traces
            log.warning("compiled every shape of %s: %d traces", self.warmed, self.model.traces)

    def _submit(self, fn, *args) -> bool:
        """Queues `fn(*args)` on the compile thread; False once the server is shutting down."""
        try:
            self.compiler.submit(fn, *args)
        except RuntimeError:  # the executor is shut down
            return False
        return True

    def warm_up(self) -> None:
        """Compiles each warmed setting's first shape and reports ready; their other shapes then
        compile in the background (the answers meanwhile pad up to the shapes compiled)."""
        try:
            for setting in self.warmed:
                self._compile_first(setting)
        except Exception:  # noqa: BLE001 - the server stays up, not ready, and says why
            log.exception("compiling the answering programs failed")
            return
        self.ready.set()
        log.warning("ready: %d traces compiled; the other shapes follow", self.model.traces)
        for setting in self.warmed:
            self._submit(self._compile_next, setting)

    def _compile_cold(self, setting: batching.Setting) -> None:
        try:
            self._compile_first(setting)
            log.warning("compiled %s; its other shapes follow", setting)
        except Exception as e:  # noqa: BLE001 - its requests answer why
            log.exception("compiling %s failed", setting)
            with self.settings_lock:
                self.failed[setting] = f"{type(e).__name__}: {e}"
        else:
            self._submit(self._compile_next, setting)
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
                cold = len(self.warm) + len(self.compiling) + len(self.failed) - len(self.warmed)
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

    def programs_view(self) -> list[dict]:
        """Per served setting, its (bucket, width) shapes compiled ("ready") and those still
        compiling in the background ("pending"), JSON-ready."""
        plan = self.model.compile_plan(self.config.max_batch)
        with self.settings_lock:
            served = sorted(self.warm, key=dataclasses.astuple)
        out = []
        for setting in served:
            ready = self.ready_shapes(setting)
            out.append(
                {
                    **dataclasses.asdict(setting),
                    "ready": [list(s) for s in ready],
                    "pending": [list(s) for s in plan if s not in ready],
                }
            )
        return out

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


def _live(state: _State) -> metrics.Live:
    """The server's state for a metrics scrape."""
    queued_requests, queued_questions = state.batcher.waiting()
    return metrics.Live(
        ready=state.ready.is_set(),
        compiles=state.model.traces,
        compiles_at_ready=state.compiled_traces,
        passages=len(state.model.store),
        queued_requests=queued_requests,
        queued_questions=queued_questions,
        settings=state.settings_view(),
    )


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
            # The route's template (set by the router), never the raw path: a client cannot
            # make new metric series by asking new paths.
            route = getattr(scope.get("route"), "path_format", "other")
            self.metrics.request(route, status[0], time.monotonic() - start)


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
    when `warm_up` (else it is ready at once and its answers compile what they need).

    Raises:
      ValueError: `allow_edits` for a bundle whose folder cannot be written.
    """
    if config.allow_edits:
        check_writable(model)
    state = _State(model, config, on_demand=not warm_up)
    state.metrics.watch(lambda: _live(state))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if warm_up:
            threading.Thread(target=state.warm_up, name="warm-up", daemon=True).start()
        else:
            state.compiled_traces = model.traces
            state.warm.update(state.warmed)
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

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request, e):  # e.g. its body timed out: no one reads an answer
        return responses.Response(status_code=499)  # nginx's "client closed request"

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
            "programs": state.programs_view(),
            "passages": len(model.store),
            "step": model.step,
            "allow_edits": config.allow_edits,
        }

    @app.get("/healthz")
    async def healthz():
        """200 once each warmed setting's first shape is compiled (then every answer can run);
        503 before. "compiled": every shape of the warmed settings is (none compiles later)."""
        ready = state.ready.is_set()
        compiled = state.compiled_traces is not None
        body = {"ready": ready, "compiled": compiled, "passages": len(model.store)}
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

    static = importlib.resources.files("rag_jax.serving") / "static"

    @app.get("/", include_in_schema=False)
    async def page():
        return responses.HTMLResponse((static / "index.html").read_text(encoding="utf-8"))

    app.mount("/static", staticfiles.StaticFiles(directory=str(static)), name="static")
    return app


def uvicorn_config(app, config: ServerConfig):
    """uvicorn's settings for `app` (made by `make_app`): idle kept-alive connections closed
    after `keep_alive_s`, request heads and bodies that arrive too slowly after
    `header_timeout_s` / `body_timeout_s` (counted in the app's metrics), at most
    `max_connections` open (503 beyond), request heads of at most 64 KiB.

    Raises:
      ValueError: a timeout that is not a positive number of seconds (named).
    """
    import uvicorn  # the [serve] extra

    from rag_jax.serving import connections  # uvicorn's protocol: the [serve] extra too

    http = connections.protocol(
        config.header_timeout_s, config.body_timeout_s, app.state.server.metrics.timed_out
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
