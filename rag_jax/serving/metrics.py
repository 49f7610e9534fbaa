"""What a server counts: requests by route and status, answer latencies, batch sizes, compiles.

All counters are thread-safe (requests finish on the event loop, batches on the batcher's
thread). Latency percentiles are over the last `WINDOW` answered requests.
"""

import collections
import threading
import time

import numpy as np

WINDOW = 10_000  # answer latencies kept for the percentiles


class Metrics:
    """Counters read by `GET /metrics` (`snapshot`)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._requests: collections.Counter = collections.Counter()  # (route, status) -> n
        self._latencies: collections.deque = collections.deque(maxlen=WINDOW)  # seconds
        self._batch_sizes: collections.Counter = collections.Counter()  # questions -> batches
        self._batch_seconds = 0.0
        self._edits = 0

    def request(self, route: str, status: int, seconds: float) -> None:
        with self._lock:
            self._requests[route, status] += 1
            if route == "/v1/answer" and status == 200:
                self._latencies.append(seconds)

    def batch(self, questions: int, requests: int, seconds: float) -> None:
        del requests
        with self._lock:
            self._batch_sizes[questions] += 1
            self._batch_seconds += seconds

    def edit(self) -> None:
        with self._lock:
            self._edits += 1

    def snapshot(self, **extra) -> dict:
        """JSON-ready counters; `extra` (e.g. the compile count) is added as given."""
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
                **extra,
            }
