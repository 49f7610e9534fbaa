r"""Serves a trained bundle over HTTP: answers with their provenance, knowledge edits, a page.

    pip install -e '.[serve]'
    python experiments/serve.py --bundle /tmp/rag_default/bundle --allow_edits
    curl -s localhost:8000/v1/answer -H 'Content-Type: application/json' \
        -d '{"questions": ["where was resa nemobu born ?"], "variant": "token"}'

Binds to 127.0.0.1 unless `--host` says otherwise; open http://127.0.0.1:8000/ for the page and
/docs or /openapi.json for the API. `/healthz` answers 200 once the programs are compiled (a few
seconds to a minute: every batch bucket up to `--max_batch`, every context width). The routes,
the batching and the errors: `rag_jax.serving.app`.
"""

from absl import app, flags, logging

from rag_jax import host
from rag_jax.serving import app as serving

_BUNDLE = flags.DEFINE_string("bundle", None, "a bundle folder (<workdir>/bundle)", required=True)
_HOST = flags.DEFINE_string("host", "127.0.0.1", "address to bind (loopback by default)")
_PORT = flags.DEFINE_integer("port", 8000, "port to bind")
_EDITS = flags.DEFINE_bool("allow_edits", False, "allow PUT / DELETE /v1/passages/{id}")
_MAX_BATCH = flags.DEFINE_integer("max_batch", 16, "most questions per request and per call")
_MAX_WAIT = flags.DEFINE_float("max_wait_ms", 3.0, "how long a request waits for others")
_MAX_N_DOCS = flags.DEFINE_integer("max_n_docs", 0, "largest n_docs; 0 = the bundle's")
_MAX_BEAMS = flags.DEFINE_integer("max_beams", 8, "largest num_beams a request may ask")
_WARM = flags.DEFINE_multi_enum(
    "warm_variant", [], ["sequence", "token"], "variants compiled before ready (the bundle's)"
)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    serving.serve(
        serving.ServerConfig(
            bundle=_BUNDLE.value,
            host=_HOST.value,
            port=_PORT.value,
            allow_edits=_EDITS.value,
            max_batch=_MAX_BATCH.value,
            max_wait_ms=_MAX_WAIT.value,
            max_n_docs=_MAX_N_DOCS.value,
            max_beams=_MAX_BEAMS.value,
            warm_variants=tuple(_WARM.value),
        )
    )


if __name__ == "__main__":
    host.restart_with_host_settings()  # read only at process start: before any work
    app.run(main)
