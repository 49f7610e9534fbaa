"""What a server counts, in two views: the Prometheus text format (`GET /metrics`, what
Prometheus and the tools that read its format scrape) and a JSON snapshot (`GET /v1/metrics`).

Counted as they happen: requests by route and status and their latencies; each merged call's
questions, requests and seconds; edits; connections cut for sending their request (or reading
their response) too slowly, those closed on arrival because their client address held its share
of the connections, and those cut to let a client holding fewer in.
Read from the server at each scrape (`Live`, through the function given to `watch`): readiness,
the batcher's queue, the bundle's trace count, each setting's compile state, the passages.

Every metric lives in the `Metrics` object's own `CollectorRegistry`, never prometheus_client's
process-wide one, so that several servers in one process count apart. Label values are bounded
whatever the clients send: a route is its template (`/v1/passages/{passage_id}`; `other` when
no route matched), never the raw path; a status is one the server answered; the settings are
the warmed ones and at most `max_cold_settings` more (the server compiles no others).

All counters are thread-safe (requests finish on the event loop, batches on the batcher's
thread). The JSON view's latency percentiles are over the last `WINDOW` answered requests.
"""

import collections
import dataclasses
import threading
import time
from collections.abc import Callable

import numpy as np
import prometheus_client
from prometheus_client import core

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST  # of `exposition()`
WINDOW = 10_000  # answer latencies kept for the JSON view's percentiles
# Seconds, for request and model-call latencies: a small model's batch takes milliseconds on an
# accelerator and tens to hundreds on a CPU; a queue behind a slow call or an edit, seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 30)
SETTING_STATES = ("ready", "compiling", "failed")
TIMEOUT_PHASES = ("headers", "body", "send")  # `connections.TimedH11Protocol`'s deadlines


@dataclasses.dataclass(frozen=True)
class Live:
    """The server at one moment, read at each scrape (the field names are the JSON view's)."""

    ready: bool  # the default setting's programs are compiled (`/healthz` answers 200)
    compiles: int  # how many times the answering programs were traced (`Bundle.traces`)
    # `compiles` once the warm-up compiled every program of the warmed settings; None before
    # (the warmed settings' traffic traces nothing more)
    compiles_at_ready: int | None
    passages: int  # in the bundle's store now
    queued_requests: int  # waiting in the batcher's queue for their model call
    queued_questions: int  # the questions of those requests
    # "ready" / "compiling" / "failed" -> the settings (variant, num_beams, n_docs) in that state
    settings: dict[str, list[tuple[str, int, int]]]


def size_buckets(max_batch: int) -> tuple[float, ...]:
    """Histogram buckets for counts of 1 to `max_batch`: the powers of two below it, and it."""
    sizes, size = {max_batch}, 1
    while size < max_batch:
        sizes.add(size)
        size *= 2
    return tuple(float(s) for s in sorted(sizes))


class Metrics:
    """The server's counters: `exposition()` for `GET /metrics`, `snapshot()` for the JSON view.

    Attributes:
      registry: this server's own prometheus_client registry (every metric below is in it).
    """

    def __init__(self, max_batch: int = 16):
        """Args:
        max_batch: the most questions (and so requests) in one model call: the top bucket of
          the batch histograms.
        """
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._requests: collections.Counter = collections.Counter()  # (route, status) -> n
        self._latencies: collections.deque = collections.deque(maxlen=WINDOW)  # seconds
        self._batch_sizes: collections.Counter = collections.Counter()  # questions -> batches
        self._batch_seconds = 0.0
        self._edits = 0
        self._timed_out: collections.Counter = collections.Counter()  # phase -> connections
        self._refused = 0  # connections closed on arrival: their address held its share
        self._evicted = 0  # connections cut at the limit: their client held the most
        self._live_fn: Callable[[], Live] | None = None

        self.registry = prometheus_client.CollectorRegistry()
        r, sizes = self.registry, size_buckets(max_batch)
        self._http_requests = prometheus_client.Counter(
            "rag_jax_http_requests",
            "HTTP requests answered, by route template (other: no route matched) and status",
            ["route", "status"],
            registry=r,
        )
        self._http_seconds = prometheus_client.Histogram(
            "rag_jax_http_request_duration_seconds",
            "Seconds from a request's head to its response's end, by route template",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._batch_questions = prometheus_client.Histogram(
            "rag_jax_batch_questions",
            "Questions answered by one merged model call",
            buckets=sizes,
            registry=r,
        )
        self._batch_requests = prometheus_client.Histogram(
            "rag_jax_batch_requests",
            "Requests merged into one model call",
            buckets=sizes,
            registry=r,
        )
        self._batch_duration = prometheus_client.Histogram(
            "rag_jax_batch_duration_seconds",
            "Seconds one model call took (its sum: the batcher's busy time)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._edit_count = prometheus_client.Counter(
            "rag_jax_edits", "Passage edits written (PUT and DELETE)", registry=r
        )
        self._timeouts = prometheus_client.Counter(
            "rag_jax_connections_timed_out",
            "Connections closed for sending their request head (headers) or body, or reading "
            "their response (send), too slowly",
            ["phase"],
            registry=r,
        )
        for phase in TIMEOUT_PHASES:  # exported at 0 from the start, as a rate needs
            self._timeouts.labels(phase)
        self._refusals = prometheus_client.Counter(
            "rag_jax_connections_refused",
            "Connections closed on arrival, unread: their client address held "
            "max_connections_per_client open connections already",
            registry=r,
        )
        self._evictions = prometheus_client.Counter(
            "rag_jax_connections_evicted",
            "Connections cut at max_connections to let in a client holding fewer: their client "
            "held the most",
            registry=r,
        )
        r.register(_LiveCollector(self))

    def watch(self, live_fn: Callable[[], Live]) -> None:
        """Reads the server's `Live` state from `live_fn()` at each scrape and snapshot."""
        self._live_fn = live_fn

    def request(self, route: str, status: int, seconds: float) -> None:
        """One answered HTTP request; `route` must be a route template, never a raw path."""
        self._http_requests.labels(route, str(status)).inc()
        self._http_seconds.labels(route).observe(seconds)
        with self._lock:
            self._requests[route, status] += 1
            if route == "/v1/answer" and status == 200:
                self._latencies.append(seconds)

    def batch(self, questions: int, requests: int, seconds: float) -> None:
        """One model call of `questions` from `requests` requests (the batcher's `on_batch`)."""
        self._batch_questions.observe(questions)
        self._batch_requests.observe(requests)
        self._batch_duration.observe(seconds)
        with self._lock:
            self._batch_sizes[questions] += 1
            self._batch_seconds += seconds

    def edit(self) -> None:
        self._edit_count.inc()
        with self._lock:
            self._edits += 1

    def timed_out(self, phase: str) -> None:
        """A connection closed for sending its request's `phase` (`TIMEOUT_PHASES`) too slowly."""
        if phase not in TIMEOUT_PHASES:
            raise ValueError(f"phase must be one of {TIMEOUT_PHASES}, got {phase!r}")
        self._timeouts.labels(phase).inc()
        with self._lock:
            self._timed_out[phase] += 1

    def refused(self) -> None:
        """A connection closed on arrival: its client address held its share already."""
        self._refusals.inc()
        with self._lock:
            self._refused += 1

    def evicted(self) -> None:
        """A connection cut at the server's limit for a client holding fewer."""
        self._evictions.inc()
        with self._lock:
            self._evicted += 1

    def live(self) -> Live | None:
        """The server's state now (None before `watch`)."""
        return None if self._live_fn is None else self._live_fn()

    def exposition(self) -> bytes:
        """Every metric in the Prometheus text format (media type `CONTENT_TYPE`)."""
        return prometheus_client.generate_latest(self.registry)

    def snapshot(self) -> dict:
        """JSON-ready counters, and the `Live` state's fields."""
        live = self.live()
        with self._lock:
            latencies = np.asarray(self._latencies, np.float64) * 1e3
            sizes = dict(sorted(self._batch_sizes.items()))
            batches = sum(sizes.values())
            requests = collections.defaultdict(dict)
            for (route, status), n in sorted(self._requests.items()):
                requests[route][str(status)] = n
            percentiles = {}
            if latencies.size:
                p50, p90, p99 = np.percentile(latencies, [50, 90, 99])
                percentiles = {
                    "p50": round(float(p50), 3),
                    "p90": round(float(p90), 3),
                    "p99": round(float(p99), 3),
                    "mean": round(float(latencies.mean()), 3),
                    "max": round(float(latencies.max()), 3),
                }
            return {
                "uptime_s": round(time.monotonic() - self._started, 3),
                "requests": dict(requests),
                "answer_latency_ms": {"window": int(latencies.size), **percentiles},
                "batches": {
                    "count": batches,
                    "questions": sum(k * v for k, v in sizes.items()),
                    "mean_size": round(sum(k * v for k, v in sizes.items()) / batches, 3)
                    if batches
                    else 0.0,
                    "sizes": {str(k): v for k, v in sizes.items()},
                    "busy_s": round(self._batch_seconds, 3),
                },
                "edits": self._edits,
                "timed_out": {phase: self._timed_out[phase] for phase in TIMEOUT_PHASES},
                "refused_connections": self._refused,
                "evicted_connections": self._evicted,
                **(dataclasses.asdict(live) if live is not None else {}),
            }


class _LiveCollector:
    """The `Live` state as Prometheus metrics, read when the registry is collected."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def describe(self):
        """The metric names, for the registry's clash check (without reading the server)."""
        return self._families(Live(False, 0, None, 0, 0, 0, {}))

    def collect(self):
        live = self.metrics.live()
        return [] if live is None else self._families(live)

    def _families(self, live: Live) -> list:
        gauge, counter = core.GaugeMetricFamily, core.CounterMetricFamily
        families = [
            gauge(
                "rag_jax_ready",
                "1 once the default setting's programs are compiled (/healthz 200), else 0",
                value=float(live.ready),
            ),
            counter(
                "rag_jax_program_traces",
                "Times the answering programs were traced, each a compile",
                value=live.compiles,
            ),
            gauge(
                "rag_jax_program_traces_warmed",
                "The trace count once every program of the warmed settings was compiled (absent "
                "before); their traffic traces nothing more",
                value=live.compiles_at_ready,  # None: the family without a sample
            ),
            gauge("rag_jax_passages", "Passages in the bundle's store", value=live.passages),
            gauge(
                "rag_jax_queued_requests",
                "Requests in the batcher's queue, waiting for their model call",
                value=live.queued_requests,
            ),
            gauge(
                "rag_jax_queued_questions",
                "Questions of the requests in the batcher's queue",
                value=live.queued_questions,
            ),
        ]
        state = gauge(
            "rag_jax_setting_state",
            "1 for each state a setting (variant, num_beams, n_docs) is in, 0 for the others: "
            "ready (served), compiling (its first programs, in the background), failed (its "
            "compile raised); the warm-up's settings are compiling until served",
            labels=["variant", "num_beams", "n_docs", "state"],
        )
        states = list(dict.fromkeys([*SETTING_STATES, *live.settings]))  # fixed by the server
        member = collections.defaultdict(set)  # (variant, num_beams, n_docs) -> its states
        for name, settings in live.settings.items():
            for setting in settings:
                member[tuple(setting)].add(name)
        for (variant, num_beams, n_docs), names in sorted(member.items()):
            for name in states:
                labels = [variant, str(num_beams), str(n_docs), name]
                state.add_metric(labels, float(name in names))
        return [*families, state]
