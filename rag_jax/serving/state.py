"""What a server's routes share: the bundle, the batcher, the counters, and which programs of
which settings are compiled (the warmed ones first, cold ones in the background).

Legend: B questions in one call.
"""

import concurrent.futures
import dataclasses
import logging
import math
import threading
import time

from rag_jax.io import answers, bundle, bundle_format
from rag_jax.retrieval.store_edit import IdLookup
from rag_jax.serving import batching, metrics
from rag_jax.serving.api import AnswerRequest, ApiError, ServerConfig, check_text, has_visible

log = logging.getLogger("rag_jax.serving")
# What a server asks each warmed setting before it reports ready (any question does: it checks
# that the answer's numbers are finite).
PROBE_QUESTION = "where was resa nemobu born ?"


def _name(setting: batching.Setting) -> str:
    return f"variant={setting.variant}, num_beams={setting.num_beams}, n_docs={setting.n_docs}"


def nonfinite_field(answer: answers.Answer, prefix: str) -> str | None:
    """The first number of `answer` that is NaN or infinite, named as a client reads it
    (`answers[0].log_likelihood`, with `prefix` "answers[0]"); None if every one is finite."""

    def walk(value, path: str) -> str | None:
        if isinstance(value, bool | int | str) or value is None:
            return None
        if isinstance(value, dict):
            items = ((f"{path}.{k}", v) for k, v in value.items())
        elif isinstance(value, list | tuple):
            items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
        else:  # a float, numpy's too
            return None if math.isfinite(value) else path
        for where, item in items:
            found = walk(item, where)
            if found is not None:
                return found
        return None

    return walk(answer.to_dict(), prefix)


def check_finite(answered: list[answers.Answer]) -> None:
    """Raises ApiError 500 naming the first non-finite number of `answered` (which JSON cannot
    carry), logging it: the model's outputs overflowed."""
    for i, answer in enumerate(answered):
        field = nonfinite_field(answer, f"answers[{i}]")
        if field is not None:
            log.error("%s is not finite (question %r)", field, answer.question)
            raise ApiError(500, f"{field} is not finite")


class ServerState:
    """What the routes share: the bundle, the batcher, the counters, readiness.

    A setting is served once its first (bucket, width) shape is compiled (`Bundle.compile_plan`:
    the top bucket at the widest width, which any batch pads up to); its other shapes then
    compile one by one on the compile thread while it is served, and answers run only at shapes
    compiled (`compiled_only`), padding up to the cheapest: the serving path never compiles.
    Before ready, each warmed setting answers a probe question, and a non-finite number in it
    keeps the server unready; `unhealthy` says why it is not ready (compiling, a failed
    compile, a probe answer not finite). A cold setting (not warmed) compiles its
    first shape on its first request, its other shapes once it has served `cold_fill_after`
    requests, and is evicted after `cold_idle_s` without one served (`cold_claim_s` after its
    compile if it served none; so too, when every slot is taken and another is asked for, the
    one served longest ago if that was `cold_claim_s` ago). A client starts one at a time.
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
        self.rows: tuple = (None, None)  # (store, IdLookup) of the latest store looked up
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
            overlap=config.overlap_calls,
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
        # Why the server is not ready (`/healthz`'s "reason"): its warm-up compiling, a compile
        # that failed, a probe answer that was not finite. None once ready.
        self.unhealthy: str | None = "starting: its answering programs are not compiled yet"
        self.clock = time.monotonic  # when a cold setting was last asked for (tests fake it)
        self.last_used: dict[batching.Setting, float] = {}  # cold settings: their last request
        self.served: dict[batching.Setting, int] = {}  # cold settings: requests since compiled
        self.started_by: dict[batching.Setting, str] = {}  # cold settings: the client asking first

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

    def _answer_setting(self, setting: batching.Setting) -> answers.AnswerSetting:
        return answers.AnswerSetting(
            setting.variant,
            setting.num_beams,
            setting.n_docs,
            self.model.settings.sequence_decoding,
        )

    def ready_shapes(self, setting: batching.Setting) -> tuple[tuple[int, int], ...]:
        """The (batch bucket, context width) shapes of `setting` compiled: answers run at the
        cheapest that holds them (`Bundle.ready_shapes`)."""
        return self.model.ready_shapes().get(self._answer_setting(setting), ())

    def _compile_first(self, setting: batching.Setting) -> None:
        """Compiles `setting`'s first shape: it is served from then on."""
        start = time.monotonic()
        self._compile(setting, self.model.compile_plan(self.config.max_batch)[:1])
        with self.settings_lock:
            self.warm.add(setting)
            self.compile_s = time.monotonic() - start

    def _compile_next(self, setting: batching.Setting) -> None:
        """Compiles the next shape of `setting` not compiled yet, then queues the one after: one
        shape per task, so a cold setting's first shape waits behind one shape at most."""
        with self.settings_lock:
            evicted = setting not in self.warm
        plan = self.model.compile_plan(self.config.max_batch)
        missing = [] if evicted else [s for s in plan if s not in self.ready_shapes(setting)]
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
            log.info("compiled every shape of %s: %d traces", self.warmed, self.model.traces)

    def _submit(self, fn, *args) -> bool:
        """Queues `fn(*args)` on the compile thread; False once the server is shutting down."""
        try:
            self.compiler.submit(fn, *args)
        except RuntimeError:  # the executor is shut down
            return False
        return True

    def verify_forever(self, stop: threading.Event) -> None:
        """Re-checks the bundle's files every `verify_every_s` until `stop` (a thread of its
        own); damage found turns the server unready for good, `unhealthy` naming the file."""
        every = self.config.verify_every_s
        while every > 0 and not stop.wait(every):
            try:
                self.model.verify()
            except bundle_format.DamagedBundleError as e:
                self.ready.clear()
                self.unhealthy = f"damaged: {e}"
                log.error("not ready: %s", self.unhealthy)
                return

    def warm_up(self) -> None:
        """Compiles each warmed setting's first shape and reports ready; their other shapes then
        compile in the background (the answers meanwhile pad up to the shapes compiled)."""
        with self.settings_lock:  # /metrics shows them compiling until served
            self.compiling.update(self.warmed)
        for setting in self.warmed:
            self.unhealthy = f"compiling the answering programs of {_name(setting)}"
            try:
                self._compile_first(setting)
            except Exception as e:  # noqa: BLE001 - the server stays up, not ready, and says why
                log.exception("compiling the answering programs of %s failed", setting)
                why = f"{type(e).__name__}: {e}"
                self.unhealthy = f"compiling the answering programs of {_name(setting)} failed"
                self.unhealthy += f" ({why:.500})"
                with self.settings_lock:
                    self.failed[setting] = why
                    self.compiling.difference_update(self.warmed)
                return
            finally:
                with self.settings_lock:
                    self.compiling.discard(setting)
        for setting in self.warmed:
            self.unhealthy = f"answering a probe question with {_name(setting)}"
            unusable = self._probe(setting)
            if unusable is not None:
                self.unhealthy = unusable
                log.error("not ready: %s", self.unhealthy)
                return
        self.ready.set()
        self.unhealthy = None
        log.info("ready: %d traces compiled; the other shapes follow", self.model.traces)
        with self.settings_lock:
            self.filling.update(self.warmed)
        for setting in self.warmed:
            self._submit(self._compile_next, setting)

    def _probe(self, setting: batching.Setting) -> str | None:
        """Answers `PROBE_QUESTION` with `setting` at its compiled shape: None if every number
        of the answer is finite, else why not. Parameters finite but huge (3e38 in a bias)
        load and compile fine and make every answer's numbers NaN or infinite."""
        try:
            (probe,) = self._generate(self._prepare([PROBE_QUESTION], setting), setting)
        except Exception as e:  # noqa: BLE001 - the server stays up, not ready, and says why
            log.exception("the probe answer of %s failed", setting)
            return f"the probe answer of {_name(setting)} failed ({type(e).__name__}: {e})"
        field = nonfinite_field(probe, "answer")
        if field is None:
            return None
        return (
            f"the probe answer of {_name(setting)}: {field} is not finite "
            "(the model's parameters give NaN or infinite outputs)"
        )

    def _compile_cold(self, setting: batching.Setting) -> None:
        """Compiles a cold setting's first shape alone: the others wait for its traffic
        (`check_warm`), so that one odd request costs one compile."""
        try:
            self._compile_first(setting)
            log.info("compiled %s; its other shapes follow its traffic", setting)
        except Exception as e:  # noqa: BLE001 - its requests answer why
            log.exception("compiling %s failed", setting)
            with self.settings_lock:
                self.failed[setting] = f"{type(e).__name__}: {e}"
        finally:
            with self.settings_lock:
                self.compiling.discard(setting)
                self.last_used[setting] = self.clock()  # idle from its compile's end
                self.served[setting] = 0

    def _unclaimed(self, setting: batching.Setting) -> bool:
        """Whether a cold setting has served no request since its compile (or it failed)."""
        return setting in self.compiling or setting in self.failed or not self.served.get(setting)

    def _idle(self) -> dict[batching.Setting, float]:
        """Each cold setting not compiling: seconds since its last request served (or since its
        compile ended, if none). Holds `settings_lock`."""
        now = self.clock()
        return {
            setting: now - last
            for setting, last in self.last_used.items()
            if setting not in self.compiling and setting not in self.filling
        }

    def _evict(self, setting: batching.Setting, idle_s: float) -> None:
        """Frees a cold setting's slot; its programs are dropped on the compile thread (after any
        compile running), never on the event loop. Holds `settings_lock`."""
        log.info("evicting %s: no request served for %.0f s", setting, idle_s)
        del self.last_used[setting]
        self.served.pop(setting, None)
        self.failed.pop(setting, None)
        self.started_by.pop(setting, None)
        if setting in self.warm:
            self.warm.discard(setting)
            self._submit(self.model.forget, self._answer_setting(setting))

    def _evict_idle(self) -> None:
        """Evicts the cold settings served by no request in the last `cold_idle_s`, and those
        that served none in the `cold_claim_s` after their compile ended (or failed)."""
        for setting, idle_s in self._idle().items():
            limit = self.config.cold_idle_s
            if self._unclaimed(setting):
                limit = min(limit, self.config.cold_claim_s)
            if idle_s >= limit:
                self._evict(setting, idle_s)

    def check_warm(self, setting: batching.Setting, client: str | None = None) -> None:
        """Returns if `setting` is compiled; else starts compiling it in the background (at most
        `max_cold_settings` beyond the warmed ones, one at a time per `client` until it serves a
        request) and raises ApiError: 503 with Retry-After while it compiles, 429 while the
        client's last one has served none, 422 when no more settings are compiled, 500 if its
        compile failed. Only a request served renews a cold setting's slot."""
        with self.settings_lock:
            self._evict_idle()
            if setting in self.warm:
                if setting in self.served:  # a cold setting: its traffic keeps it
                    self.last_used[setting] = self.clock()
                    self.served[setting] += 1
                    if self.served[setting] == self.config.cold_fill_after:
                        self.filling.add(setting)
                        self._submit(self._compile_next, setting)
                return
            name = _name(setting)
            if setting in self.failed:
                raise ApiError(500, f"{name}: compiling it failed ({self.failed[setting]})")
            retry = max(1, math.ceil(self.compile_s))
            if setting not in self.compiling:
                mine = [s for s, c in self.started_by.items() if client is not None and c == client]
                pending = [s for s in mine if self._unclaimed(s)]
                if pending:
                    raise ApiError(
                        429,
                        f"{name}: this client's last new setting ({_name(pending[0])}) has "
                        "served no request yet; ask for it first, or for a served setting",
                        headers={"Retry-After": str(retry)},
                    )
                cold = len(self.warm) + len(self.compiling) + len(self.failed) - len(self.warmed)
                # Every slot taken: the one served longest ago is reclaimed if no request was
                # served by it for cold_claim_s (a slot is kept against demand by its traffic).
                idle = self._idle()
                stale = max(idle, key=idle.get, default=None)
                if cold >= self.config.max_cold_settings and stale is not None:
                    if idle[stale] >= self.config.cold_claim_s:
                        self._evict(stale, idle[stale])
                        cold -= 1
                if cold >= self.config.max_cold_settings:
                    served = sorted(dataclasses.astuple(s) for s in self.warm)
                    raise ApiError(
                        422,
                        f"{name}: this server compiles at most {self.config.max_cold_settings} "
                        f"settings beyond the warmed ones; it serves (variant, num_beams, "
                        f"n_docs) in {served}",
                    )
                self.compiling.add(setting)
                self.last_used[setting] = self.clock()
                if client is not None:
                    self.started_by[setting] = client
                self.compiler.submit(self._compile_cold, setting)
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
            rows = IdLookup(store)
            self.rows = (store, rows)
        row = int(rows.rows([passage_id])[0])
        return None if row < 0 else row

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
            check_text(f"questions[{i}]", q, c.max_question_chars, "a question")
            if not has_visible(q):  # e.g. zero-width spaces or NULs alone: nothing to read
                raise ApiError(
                    422, f"questions[{i}]: expected a non-empty question (a visible character)"
                )
        try:  # e.g. a combining accent or a private-use character alone: no token but [UNK]
            self.model.check_questions(request.questions)
        except ValueError as e:
            raise ApiError(422, str(e)) from None
        n_docs = d.n_docs if request.n_docs is None else request.n_docs
        top = min(self.max_n_docs, len(self.model.store))
        if not 1 <= n_docs <= top:
            raise ApiError(422, f"n_docs={n_docs}: this server retrieves 1 to {top} passages")
        beams = d.num_beams if request.num_beams is None else request.num_beams
        if not 1 <= beams <= c.max_beams:
            raise ApiError(422, f"num_beams={beams}: this server decodes 1 to {c.max_beams} beams")
        return batching.Setting(request.variant or d.variant, beams, n_docs)


def live_metrics(state: ServerState) -> metrics.Live:
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
