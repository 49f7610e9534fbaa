r"""Exports a trained model: a bundle from any checkpoint step, or transformers' format.

    python experiments/export.py --workdir /tmp/rag_default --out /tmp/rag_bundle --step 300
    python experiments/export.py --workdir /tmp/rag_default --hf /tmp/rag_hf --variant token
    python experiments/export.py --bundle /tmp/rag_default/bundle --hf /tmp/rag_hf

`--out` writes a bundle (`rag_jax.io.bundle`: what `ask.py --bundle` and `evaluate.py --bundle`
open). `--hf` writes a `save_pretrained` folder that `RagSequenceForGeneration` /
`RagTokenForGeneration.from_pretrained` load, with the passages as a `datasets` dataset and a
faiss index for `RagRetriever.from_pretrained(D, index_name="custom", passages_path=...,
index_path=...)` (`hf_export.save_rag`). The source is a run's checkpoint (`--workdir`, newest
step unless `--step`) or a bundle. Prints a JSON summary.
"""

import json
import sys

from absl import app, flags, logging

from rag_jax.devices import distributed, host
from rag_jax.io import bundle
from rag_jax.training import loop

_WORKDIR = flags.DEFINE_string("workdir", None, "a training workdir (checkpoints + config)")
_STEP = flags.DEFINE_integer("step", None, "the checkpoint step (default: the newest)")
_BUNDLE = flags.DEFINE_string("bundle", None, "or a bundle folder as the source")
_OUT = flags.DEFINE_string("out", None, "write a bundle here")
_HF = flags.DEFINE_string("hf", None, "write transformers' save_pretrained format here")
_VARIANT = flags.DEFINE_enum("variant", None, ["sequence", "token"], "HF class; default: run's")
flags.mark_flags_as_mutual_exclusive(["workdir", "bundle"], required=True)


def say(line: str) -> None:
    """A phase's line on stderr (stdout holds the one JSON summary)."""
    print(line, file=sys.stderr, flush=True)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    if not (_OUT.value or _HF.value):
        raise app.UsageError("nothing to write: give --out (a bundle) and/or --hf")
    if _BUNDLE.value:
        model = bundle.load(_BUNDLE.value)
    else:
        say(f"restoring {_WORKDIR.value}: its experiment (data, warm starts, index) and checkpoint")
        exp, state, step = loop.restore(_WORKDIR.value, step=_STEP.value)
        params = distributed.replicated_to_host(state.params)
        model = bundle.Bundle.from_experiment(exp, params, step=step)
    summary = {"step": model.step, "passages": len(model.store)}
    if _OUT.value:
        say(f"writing the bundle to {_OUT.value}")
        model.save(_OUT.value)
        summary["bundle"] = _OUT.value
    if _HF.value:
        say(f"writing transformers' format to {_HF.value}: weights, passages, a faiss index")
        summary["hf"] = model.to_hf(_HF.value, variant=_VARIANT.value)
    print(json.dumps(summary, sort_keys=True))


if __name__ == "__main__":
    host.restart_with_host_settings()  # read only at process start: before any work
    app.run(main)
