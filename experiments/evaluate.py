r"""Evaluates a trained checkpoint on held-out questions: EM, F1, answer and gold recall@k.

    python experiments/evaluate.py --workdir /tmp/rag_default
    python experiments/evaluate.py --workdir /tmp/rag_default --variant token --num_beams 4

Restores the newest checkpoint and its config from --workdir, writes
`<workdir>/eval_predictions.jsonl` (answer, gold answers and retrieved passage ids per question) and
prints the metrics as JSON.
"""

import dataclasses
import json
import pathlib

from absl import app, flags, logging

from rag_jax import evaluation, host
from rag_jax.training import loop

_WORKDIR = flags.DEFINE_string("workdir", None, "a training workdir (checkpoints + config)")
_VARIANT = flags.DEFINE_enum("variant", None, ["sequence", "token"], "default: the config's")
_BEAMS = flags.DEFINE_integer("num_beams", None, "default: the config's eval.num_beams")
_DECODING = flags.DEFINE_enum("sequence_decoding", None, ["thorough", "fast"], "RAG-Sequence")
_MAX = flags.DEFINE_integer("max_examples", 0, "evaluate the first N questions (0 = all)")
flags.mark_flag_as_required("workdir")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    exp, state, step = loop.restore(_WORKDIR.value)
    config = exp.config
    variant = _VARIANT.value or config.rag.variant
    if _BEAMS.value or _DECODING.value:
        with config.unlocked():
            config.eval.num_beams = _BEAMS.value or config.eval.num_beams
            config.eval.sequence_decoding = _DECODING.value or config.eval.sequence_decoding
        generation = dataclasses.replace(exp.rag_cfg.generation, num_beams=config.eval.num_beams)
        exp = dataclasses.replace(exp, rag_cfg=exp.rag_cfg.replace(generation=generation))
    examples = exp.eval[: _MAX.value or None]
    metrics, predictions = evaluation.evaluate(
        exp, state.params, examples, mesh=loop.device_mesh(config), variant=variant
    )
    out = pathlib.Path(_WORKDIR.value) / "eval_predictions.jsonl"
    out.write_text("".join(json.dumps(p) + "\n" for p in predictions), encoding="utf-8")
    print(json.dumps({"step": step, "variant": variant, **metrics}, sort_keys=True))


if __name__ == "__main__":
    host.restart_with_host_settings()  # read only at process start: before any work
    app.run(main)
