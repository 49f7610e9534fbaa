r"""Trains RAG jointly (question encoder + generator, retrieval in the loop) and evaluates.

    python experiments/train.py --config experiments/configs/default.py --workdir /tmp/rag_default
    python experiments/train.py --config experiments/configs/default.py --workdir /tmp/w \
        --config.train.steps=50

Resumes from the checkpoints in --workdir. The last line printed is one JSON object with
`recall_at_5_before`, `recall_at_5_after`, `em_before`, `em_after` on held-out questions.
"""

import json
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from rag_jax.devices import host
from rag_jax.run import settings

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "experiment config file", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "checkpoints, logs and caches go here")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    # Imported here, not above: JAX and the models take 20-60 s to import on a cold machine, and
    # a mistyped setting or --help should answer before that (see below).
    print("loading JAX and the models (20-60 s on a cold machine)", flush=True)
    from rag_jax.training import loop

    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    summary = loop.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
    print(json.dumps({k: v for k, v in summary.items() if k != "eval"}, sort_keys=True), flush=True)


if __name__ == "__main__":
    settings.check_overrides()  # a mistyped --config.x: one line, at once, not three tracebacks
    host.restart_with_host_settings()  # read only at process start: before any work
    if {"--help", "-h", "--helpfull"} & set(sys.argv[1:]):
        print(settings.listing() + "\n")  # then absl's flags
    app.run(main)
