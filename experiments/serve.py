r"""Serves a trained bundle over HTTP: answers with their provenance, knowledge edits, a page.

    pip install -e '.[serve]'
    python experiments/serve.py --bundle /tmp/rag_default/bundle --allow_edits
    curl -s localhost:8000/v1/answer -H 'Content-Type: application/json' \
        -d '{"questions": ["where was resa nemobu born ?"], "variant": "token"}'

Binds to 127.0.0.1 unless `--host` says otherwise, first of all (a port in use: exit status 1 at
once, saying so); open http://127.0.0.1:8000/ for the page and /openapi.json for the API
(`--api_docs`: Swagger UI at /docs, its scripts from a CDN). `/healthz` answers 200 once the
first programs are compiled (the largest batch bucket at the widest context, which every batch
pads up to: 15-25 s from a cold start on 2 CPU cores); the other buckets and widths compile in
the background while it answers, and `/healthz` says `"compiled": true` once they all are;
`/metrics` is for Prometheus, `/v1/metrics` the same counters in JSON. The routes, the
batching, the errors, the limits and the timeouts: `rag_jax.serving.app`, `docs/serving.md`.
"""

import logging as std_logging
import sys

from absl import app, flags, logging

from rag_jax.devices import host

_BUNDLE = flags.DEFINE_string("bundle", None, "a bundle folder (<workdir>/bundle)", required=True)
_HOST = flags.DEFINE_string("host", "127.0.0.1", "address to bind (loopback by default)")
_PORT = flags.DEFINE_integer("port", 8000, "port to bind")
_EDITS = flags.DEFINE_bool("allow_edits", False, "allow PUT / DELETE /v1/passages/{id}")
_MAX_BATCH = flags.DEFINE_integer("max_batch", 16, "most questions per request and per call")
_MAX_WAIT = flags.DEFINE_float("max_wait_ms", 3.0, "how long a request waits for others")
_OVERLAP = flags.DEFINE_bool(
    "overlap_calls", True, "a call holds at most half the questions queued or running"
)
_MAX_N_DOCS = flags.DEFINE_integer("max_n_docs", 0, "largest n_docs; 0 = the bundle's")
_MAX_BEAMS = flags.DEFINE_integer("max_beams", 8, "largest num_beams a request may ask")
_WARM = flags.DEFINE_multi_enum(
    "warm_variant", [], ["sequence", "token"], "variants compiled before ready (the bundle's)"
)
_COLD = flags.DEFINE_integer(
    "max_cold_settings", 4, "settings compiled on demand beyond the warmed; 0 = warmed only"
)
_COLD_IDLE = flags.DEFINE_float("cold_idle_s", 300.0, "a cold setting idle this long is evicted")
_COLD_FILL = flags.DEFINE_integer(
    "cold_fill_after", 8, "requests before a cold setting compiles its other shapes"
)
_COLD_CLAIM = flags.DEFINE_float(
    "cold_claim_s", 60.0, "a cold setting serving no request this long after its compile is evicted"
)
_QUESTION_CHARS = flags.DEFINE_integer("max_question_chars", 2_000, "longest question (chars)")
_PASSAGE_CHARS = flags.DEFINE_integer("max_passage_chars", 100_000, "longest edited passage")
_ID_CHARS = flags.DEFINE_integer("max_id_chars", 256, "longest edited passage id (chars)")
_BODY = flags.DEFINE_integer("max_body_bytes", 1 << 20, "largest request body (bytes)")
_HOSTS = flags.DEFINE_multi_string(
    "allowed_host", [], "Host headers answered (default: localhost names and --host)"
)
_KEEP_ALIVE = flags.DEFINE_float("keep_alive_s", 5.0, "idle connections closed after (s)")
_CONNECTIONS = flags.DEFINE_integer("max_connections", 256, "open connections (503 beyond)")
_PER_CLIENT = flags.DEFINE_integer(
    "max_connections_per_client", 16, "open connections of one address; 0 = no cap of its own"
)
_HEADER_TIMEOUT = flags.DEFINE_float("header_timeout_s", 10.0, "request head deadline (s)")
_BODY_TIMEOUT = flags.DEFINE_float("body_timeout_s", 30.0, "request body deadline (s)")
_SEND_TIMEOUT = flags.DEFINE_float("send_timeout_s", 30.0, "deadline to read a response (s)")
_VERIFY_EVERY = flags.DEFINE_float(
    "verify_every_s", 600.0, "re-check every file of the bundle this often (s); 0: never"
)
_RESPONSE = flags.DEFINE_integer("max_response_bytes", 4 << 20, "largest response (bytes)")
_DOCS = flags.DEFINE_bool("api_docs", False, "serve Swagger UI at /docs (scripts from a CDN)")


def main(argv):
    del argv
    # Imported here, not above: `restart_with_host_settings` re-executes the process first, and
    # the server's imports (JAX, FastAPI) would otherwise be paid twice before it can start.
    from rag_jax.serving import connections

    logging.set_verbosity(logging.WARNING)  # the libraries' own INFO lines stay quiet
    # The server's start-up and lifecycle lines are news, not warnings: INFO, shown.
    std_logging.getLogger("rag_jax.serving").setLevel(std_logging.INFO)
    try:  # before JAX and the bundle load: a port in use fails at once, and cleanly
        sock = connections.bind(_HOST.value, _PORT.value)
    except OSError as e:
        logging.error("%s", e)
        sys.exit(1)
    from rag_jax.serving import app as serving

    serving.serve(
        serving.ServerConfig(
            bundle=_BUNDLE.value,
            host=_HOST.value,
            port=_PORT.value,
            allow_edits=_EDITS.value,
            max_batch=_MAX_BATCH.value,
            max_wait_ms=_MAX_WAIT.value,
            overlap_calls=_OVERLAP.value,
            max_n_docs=_MAX_N_DOCS.value,
            max_beams=_MAX_BEAMS.value,
            warm_variants=tuple(_WARM.value),
            max_cold_settings=_COLD.value,
            cold_idle_s=_COLD_IDLE.value,
            cold_fill_after=_COLD_FILL.value,
            cold_claim_s=_COLD_CLAIM.value,
            max_question_chars=_QUESTION_CHARS.value,
            max_passage_chars=_PASSAGE_CHARS.value,
            max_id_chars=_ID_CHARS.value,
            max_body_bytes=_BODY.value,
            allowed_hosts=tuple(_HOSTS.value),
            keep_alive_s=_KEEP_ALIVE.value,
            max_connections=_CONNECTIONS.value,
            max_connections_per_client=_PER_CLIENT.value,
            header_timeout_s=_HEADER_TIMEOUT.value,
            body_timeout_s=_BODY_TIMEOUT.value,
            send_timeout_s=_SEND_TIMEOUT.value,
            verify_every_s=_VERIFY_EVERY.value,
            max_response_bytes=_RESPONSE.value,
            api_docs=_DOCS.value,
        ),
        sock,
    )


if __name__ == "__main__":
    host.restart_with_host_settings()  # read only at process start: before any work
    app.run(main)
