"""`GET /metrics` as Prometheus reads it: a real uvicorn server (in this process, so a test can
hold its batcher) over the tiny run's bundle, scraped over HTTP and parsed with
prometheus_client's own parser. Counts and histograms move by exactly what the requests did,
under bounded labels whatever paths clients ask; the gauges read the queue and the compile
state at scrape time; each app counts in its own registry."""

import concurrent.futures
import json
import shutil
import time
import uuid

import httpx
import prometheus_client
import pytest
from hostile_server_test import Gate, InProcess
from prometheus_client import parser

from rag_jax.io import bundle
from rag_jax.serving import app as serving
from rag_jax.serving import metrics

QUESTION = "where was resa nemobu born ?"
MAX_BATCH = 2


@pytest.fixture(scope="module")
def served(tiny_trained_run, tmp_path_factory):
    """A server with edits over a copy of the tiny run's bundle, ready at once (nothing
    compiled: these tests' answers never reach the model)."""
    directory = tmp_path_factory.mktemp("prometheus") / "bundle"
    shutil.copytree(tiny_trained_run[0] / "bundle", directory)
    config = serving.ServerConfig(str(directory), allow_edits=True, max_batch=MAX_BATCH)
    server = InProcess(bundle.load(directory), config, warm_up=False)
    try:
        server.wait_ready(60)
        yield server
    finally:
        server.stop()


def scrape(url) -> dict:
    """{(sample name, sorted labels): value} of one `GET /metrics`, parsed as Prometheus does."""
    response = httpx.get(f"{url}/metrics", timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == prometheus_client.CONTENT_TYPE_LATEST
    samples = {}
    for family in parser.text_string_to_metric_families(response.text):
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            assert key not in samples, key
            samples[key] = sample.value
    return samples


def value(samples: dict, name: str, **labels) -> float:
    """One sample's value; 0 when the series does not exist (yet)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def series(samples: dict, name: str) -> list[dict]:
    return [dict(labels) for n, labels in samples if n == name]


def _post(url, body: dict, timeout=120) -> httpx.Response:
    return httpx.post(f"{url}/v1/answer", json=body, timeout=timeout)


def test_the_exposition_is_this_servers_own_registry_in_the_prometheus_format(served):
    samples = scrape(served.url)
    model, state = served.state.model, served.state
    assert value(samples, "rag_jax_ready") == 1
    assert value(samples, "rag_jax_passages") == len(model.store)
    assert value(samples, "rag_jax_program_traces_total") == model.traces
    assert value(samples, "rag_jax_program_traces_warmed") == state.compiled_traces
    d = state.default
    setting = dict(variant=d.variant, num_beams=str(d.num_beams), n_docs=str(d.n_docs))
    assert value(samples, "rag_jax_setting_state", **setting, state="ready") == 1
    assert value(samples, "rag_jax_setting_state", **setting, state="compiling") == 0
    assert value(samples, "rag_jax_setting_state", **setting, state="failed") == 0
    listed = {tuple(s[k] for k in setting) for s in series(samples, "rag_jax_setting_state")}
    assert listed == {tuple(setting.values())}  # the one warmed setting
    for phase in ("headers", "body"):  # exported before any connection timed out
        assert ("rag_jax_connections_timed_out_total", (("phase", phase),)) in samples
    assert value(samples, "rag_jax_queued_requests") == 0
    # The batch histograms' buckets: every size up to max_batch is told apart at the top.
    buckets = {labels["le"] for labels in series(samples, "rag_jax_batch_questions_bucket")}
    assert buckets == {"1.0", "2.0", "+Inf"}
    # Nothing in prometheus_client's process-wide registry; another app counts apart.
    assert not [m for m in prometheus_client.REGISTRY.collect() if m.name.startswith("rag_jax")]
    other = serving.make_app(model, serving.ServerConfig(served.state.config.bundle), warm_up=False)
    try:
        assert other.state.server.metrics.registry is not served.state.metrics.registry
        other.state.server.metrics.request("/v1/info", 200, 0.01)
        text = other.state.server.metrics.exposition().decode()
        assert 'rag_jax_http_requests_total{route="/v1/info",status="200"} 1.0' in text
    finally:
        other.state.server.batcher.close()
    again = scrape(served.url)
    info = dict(route="/v1/info", status="200")
    assert value(again, "rag_jax_http_requests_total", **info) == value(
        samples, "rag_jax_http_requests_total", **info
    )


def test_requests_are_counted_by_route_template_and_hostile_paths_add_no_series(served):
    """Each request moves its route's count and latency histogram by one; 404s of unknown
    passage ids count under the route's template, unknown paths under "other", a wrong method
    under its route: 80 distinct paths make no new series."""
    url, pid = served.url, served.state.model.store.ids[0]
    before = scrape(url)
    for _ in range(3):
        assert httpx.get(f"{url}/v1/info").status_code == 200
    for _ in range(2):
        assert httpx.get(f"{url}/v1/passages/{pid}").status_code == 200
    hostile = [uuid.uuid4().hex for _ in range(40)]
    for name in hostile[:30]:
        assert httpx.get(f"{url}/v1/passages/{name}").status_code == 404
    for name in hostile[30:]:
        assert httpx.get(f"{url}/{name}/x?y={name}").status_code == 404
    for _ in range(4):
        assert httpx.request("PATCH", f"{url}/v1/info").status_code == 405
    after = scrape(url)

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    count, latency = "rag_jax_http_requests_total", "rag_jax_http_request_duration_seconds_count"
    passage = "/v1/passages/{passage_id}"
    assert moved(count, route="/v1/info", status="200") == 3
    assert moved(count, route="/v1/info", status="405") == 4
    assert moved(count, route=passage, status="200") == 2
    assert moved(count, route=passage, status="404") == 30
    assert moved(count, route="other", status="404") == 10
    assert moved(count, route="/metrics", status="200") == 1  # the first scrape, once done
    assert moved(latency, route="/v1/info") == 7
    assert moved(latency, route=passage) == 32
    assert moved(latency, route="other") == 10
    assert moved("rag_jax_http_request_duration_seconds_sum", route=passage) > 0
    routes = {s["route"] for s in series(after, count)}
    templates = {getattr(r, "path_format", None) for r in served.app.routes}
    assert routes <= templates | {"other"}, routes - templates
    assert not any(name in str(key) for name in hostile for key in after)
    pairs = lambda samples: {(s["route"], s["status"]) for s in series(samples, count)}  # noqa: E731
    made = {("/v1/info", "200"), ("/v1/info", "405"), (passage, "200"), (passage, "404")}
    assert pairs(after) - pairs(before) <= made | {("other", "404"), ("/metrics", "200")}


def test_the_queue_gauges_read_the_batchers_queue_at_scrape_time(served):
    """One request held in its model call, three queued behind it (4 questions): the gauges
    say 3 and 4, then 0 once they are answered (here with the gate's error: no compile)."""
    url = served.url
    with Gate(served.state) as gate:
        gate.open.clear()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            held = pool.submit(_post, url, {"questions": ["poison held ?"]})
            assert gate.entered.wait(30)
            queued = [
                pool.submit(_post, url, {"questions": [f"poison {i} ?"] * n})
                for i, n in enumerate([1, 2, 1])
            ]
            samples, deadline = scrape(url), time.monotonic() + 30
            while value(samples, "rag_jax_queued_requests") < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
                samples = scrape(url)
            assert value(samples, "rag_jax_queued_requests") == 3
            assert value(samples, "rag_jax_queued_questions") == 4
            assert served.state.metrics.snapshot()["queued_questions"] == 4  # the JSON view
            gate.open.set()
            assert held.result().status_code == 500
            assert [f.result().status_code for f in queued] == [500] * 3
    samples = scrape(url)
    assert value(samples, "rag_jax_queued_requests") == 0
    assert value(samples, "rag_jax_queued_questions") == 0


def test_edits_are_counted_and_the_passage_gauge_follows_the_store(served):
    url = served.url
    before = scrape(url)
    put = httpx.put(f"{url}/v1/passages/counted", json={"text": "a counted passage ."}, timeout=120)
    assert put.status_code == 201, put.text
    mid = scrape(url)
    assert httpx.delete(f"{url}/v1/passages/counted", timeout=120).status_code == 200
    assert httpx.delete(f"{url}/v1/passages/counted", timeout=120).status_code == 404  # no edit
    after = scrape(url)
    assert value(mid, "rag_jax_passages") == value(before, "rag_jax_passages") + 1
    assert value(after, "rag_jax_passages") == value(before, "rag_jax_passages")
    assert value(after, "rag_jax_edits_total") - value(before, "rag_jax_edits_total") == 2


def test_size_buckets_end_at_max_batch():
    assert metrics.size_buckets(1) == (1.0,)
    assert metrics.size_buckets(16) == (1.0, 2.0, 4.0, 8.0, 16.0)
    assert metrics.size_buckets(12) == (1.0, 2.0, 4.0, 8.0, 12.0)


# ---------------------------------------------------------------------------------------------
# A compiling server: readiness, answers, merged calls, a cold setting


@pytest.fixture(scope="module")
def compiling(tiny_trained_run, tmp_path_factory):
    """(a server warming up over the tiny run's bundle, its first scrape, taken before it was
    ready); ready when handed over. ~1-3 min on 2 cores (its programs compile)."""
    directory = tiny_trained_run[0] / "bundle"
    config = serving.ServerConfig(
        str(directory), max_batch=MAX_BATCH, max_wait_ms=50.0, max_cold_settings=1
    )
    server = InProcess(bundle.load(directory, fast_compile=True), config)
    try:
        deadline = time.monotonic() + 30
        while True:  # the first scrape the server answers: its warm-up has just begun
            try:
                first = scrape(server.url)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the server never listened"
                time.sleep(0.05)
        server.wait_ready()
        yield server, first
    finally:
        server.stop()


@pytest.mark.slow
def test_readiness_answers_and_merged_calls_move_the_metrics_by_what_happened(compiling):
    server, first = compiling
    url, state = server.url, server.state
    assert value(first, "rag_jax_ready") == 0
    assert not series(first, "rag_jax_program_traces_warmed")
    before = scrape(url)
    assert value(before, "rag_jax_ready") == 1
    traces = value(before, "rag_jax_program_traces_total")
    assert traces > 0 and value(before, "rag_jax_program_traces_warmed") == traces
    # Three answers, one after another: each its own call of one question.
    for _ in range(3):
        assert _post(url, {"questions": [QUESTION]}).status_code == 200
    # Eight one-question requests at once, merged into calls of at most MAX_BATCH: the gate
    # records each call's questions and lets it through.
    with Gate(state) as gate, concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: _post(url, {"questions": [QUESTION]}), range(8)))
    assert [a.status_code for a in answers] == [200] * 8
    calls = [len(c) for c in gate.calls]
    assert sum(calls) == 8 and max(calls) <= MAX_BATCH
    after = scrape(url)

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("rag_jax_http_requests_total", route="/v1/answer", status="200") == 11
    assert moved("rag_jax_http_request_duration_seconds_count", route="/v1/answer") == 11
    assert moved("rag_jax_batch_questions_count") == 3 + len(calls)
    assert moved("rag_jax_batch_questions_sum") == 11
    assert moved("rag_jax_batch_requests_sum") == 11  # one question per request
    assert moved("rag_jax_batch_questions_bucket", le="1.0") == 3 + calls.count(1)
    assert moved("rag_jax_batch_questions_bucket", le="2.0") == 3 + len(calls)
    assert moved("rag_jax_batch_duration_seconds_count") == 3 + len(calls)
    assert value(after, "rag_jax_program_traces_total") == traces  # steady traffic: no compile
    # A cold setting: compiling in the background (its request answered 503), then ready.
    d = state.default
    cold = dict(variant=d.variant, num_beams=str(d.num_beams + 1), n_docs=str(d.n_docs))
    body = {"questions": [QUESTION], "num_beams": d.num_beams + 1}
    assert _post(url, body).status_code == 503
    samples = scrape(url)
    assert value(samples, "rag_jax_setting_state", **cold, state="compiling") == 1
    assert value(samples, "rag_jax_setting_state", **cold, state="ready") == 0
    deadline = time.monotonic() + 600
    while value(samples, "rag_jax_setting_state", **cold, state="compiling") == 1:
        assert time.monotonic() < deadline, "the cold setting never compiled"
        time.sleep(0.5)
        samples = scrape(url)
    assert value(samples, "rag_jax_setting_state", **cold, state="ready") == 1
    assert value(samples, "rag_jax_setting_state", **cold, state="failed") == 0
    assert value(samples, "rag_jax_program_traces_total") > traces
    assert _post(url, body).status_code == 200
    ready = json.loads(httpx.get(f"{url}/v1/metrics").text)["settings"]["ready"]
    assert [d.variant, d.num_beams + 1, d.n_docs] in ready  # the JSON view agrees
