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
"""

import asyncio
import contextlib
import dataclasses
import importlib.resources
import logging
import threading
import time
from typing import Literal

import fastapi
from fastapi import exceptions as fastapi_exceptions
from fastapi import responses, staticfiles
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr
from starlette import concurrency
from starlette.exceptions import HTTPException as StarletteHTTPException

from rag_jax import bundle
from rag_jax.retrieval.corpus import Passage
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
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _error(status: int, message: str, details=None) -> responses.JSONResponse:
    body = {"status": status, "message": message}
    if details is not None:
        body["details"] = details
    return responses.JSONResponse({"error": body}, status_code=status)


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

    def _answer(self, questions, setting: batching.Setting):
        return self.model.answer(
            questions,
            variant=setting.variant,
            num_beams=setting.num_beams,
            n_docs=setting.n_docs,
        )

    def warm_up(self) -> None:
        try:
            for variant in self.config.warm_variants or (self.default.variant,):
                self.model.compile(self.config.max_batch, variant=variant)
        except Exception:  # noqa: BLE001 - the server stays up, not ready, and says why
            log.exception("compiling the answering programs failed")
            return
        self.compiled_traces = self.model.traces
        self.ready.set()
        log.warning("ready: %d traces compiled", self.compiled_traces)

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


def make_app(model: bundle.Bundle, config: ServerConfig, *, warm_up: bool = True):
    """The FastAPI app serving `model` (see the module docstring); compiles in the background
    when `warm_up` (else it is ready at once)."""
    state = _State(model, config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if warm_up:
            threading.Thread(target=state.warm_up, name="warm-up", daemon=True).start()
        else:
            state.compiled_traces = model.traces
            state.ready.set()
        yield
        await asyncio.to_thread(state.batcher.close)

    app = fastapi.FastAPI(
        title="rag_jax",
        version="1",
        summary="Answers with their provenance from a trained RAG bundle; live knowledge edits.",
        lifespan=lifespan,
    )
    app.state.server = state

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return _error(e.status, e.message)

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

    app.add_middleware(_Count, metrics=state.metrics)

    @app.post("/v1/answer")
    async def answer(request: AnswerRequest):
        """Answers 1 to max_batch questions with their passages (prior and posterior) and, for
        RAG-Token, each token's passage posteriors."""
        setting = state.setting_of(request)
        if not state.ready.is_set():
            raise ApiError(503, "the server is still compiling its programs; try again")
        future = state.batcher.submit(setting, request.questions)
        try:
            answers = await asyncio.wrap_future(future)
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

    def _put(passage_id: str, body: PassageBody) -> tuple[dict, bool]:
        with state.edit_lock:  # the title lookup and the edit, together
            if not body.text.strip():
                raise ApiError(422, "text: the passage has no text")
            store = model.store
            row = state.row_of(store, passage_id)
            title = body.title
            if title is None:
                title = "" if row is None else store.title(row)
            try:
                report = model.edit(upserts=[Passage(passage_id, title, body.text)])
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
                report = model.edit(deletes=[passage_id])
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
        )

    static = importlib.resources.files("rag_jax.serving") / "static"

    @app.get("/", include_in_schema=False)
    async def page():
        return responses.HTMLResponse((static / "index.html").read_text(encoding="utf-8"))

    app.mount("/static", staticfiles.StaticFiles(directory=str(static)), name="static")
    return app


def serve(config: ServerConfig) -> None:
    """Loads the bundle and serves it until interrupted (uvicorn, one process)."""
    import uvicorn  # the [serve] extra

    bundle.enable_compilation_cache()
    model = bundle.load(config.bundle)
    app = make_app(model, config)
    log.warning("serving %s on http://%s:%d/", config.bundle, config.host, config.port)
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning", access_log=False)
