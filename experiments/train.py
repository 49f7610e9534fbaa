r"""Trains RAG jointly (question encoder + generator, retrieval in the loop) and evaluates.

    python experiments/train.py --config experiments/configs/default.py --workdir /tmp/rag_default
    python experiments/train.py --config experiments/configs/default.py --workdir /tmp/w \
        --config.train.steps=50

Resumes from the checkpoints in --workdir. The last line printed is one JSON object with
`recall_at_5_before`, `recall_at_5_after`, `em_before`, `em_after` on held-out questions.
"""

import json

from absl import app, flags, logging
from ml_collections import config_flags

from rag_jax.devices import host
from rag_jax.run import settings
from rag_jax.training import loop

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "experiment config file", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "checkpoints, logs and caches go here")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    summary = loop.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
    print(json.dumps({k: v for k, v in summary.items() if k != "eval"}, sort_keys=True), flush=True)


if __name__ == "__main__":
    host.restart_with_host_settings()  # read only at process start: before any work
    settings.check_overrides()  # a mistyped --config.x: one line, not three tracebacks
    app.run(main)
