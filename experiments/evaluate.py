r"""Evaluates a trained model on held-out questions: EM, F1, answer and gold recall@k.

    python experiments/evaluate.py --workdir /tmp/rag_default
    python experiments/evaluate.py --workdir /tmp/rag_default --variant token --num_beams 4
    python experiments/evaluate.py --bundle /tmp/rag_default/bundle --questions Q.jsonl

`--workdir` restores the newest checkpoint and its config, evaluates the run's held-out questions
and writes `<workdir>/eval_predictions.jsonl` (answer, gold answers and retrieved passage ids per
question). `--bundle` opens a bundle (`rag_jax.io.bundle`: no data files, warm starts or encoding)
and evaluates the questions of a QA file (.jsonl/.csv/.tsv: question, answers, optional gold_ids;
a run's `predictions.jsonl` reads as one); `--predictions` writes them. Prints the metrics as JSON.
"""

import dataclasses
import json
import pathlib

from absl import app, flags, logging

from rag_jax.devices import host
from rag_jax.io import answers, bundle
from rag_jax.run import data
from rag_jax.training import evaluation, loop

_WORKDIR = flags.DEFINE_string("workdir", None, "a training workdir (checkpoints + config)")
_BUNDLE = flags.DEFINE_string("bundle", None, "a bundle folder (<workdir>/bundle)")
_QUESTIONS = flags.DEFINE_string("questions", None, "with --bundle: the QA file to evaluate")
_OUT = flags.DEFINE_string("predictions", None, "where predictions go (default: the workdir's)")
_VARIANT = flags.DEFINE_enum("variant", None, ["sequence", "token"], "default: the config's")
_BEAMS = flags.DEFINE_integer("num_beams", None, "default: the config's eval.num_beams")
_DECODING = flags.DEFINE_enum("sequence_decoding", None, ["thorough", "fast"], "RAG-Sequence")
_MAX = flags.DEFINE_integer("max_examples", 0, "evaluate the first N questions (0 = all)")
flags.mark_flags_as_mutual_exclusive(["workdir", "bundle"], required=True)


def _from_workdir():
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
    return {"step": step, "variant": variant, **metrics}, predictions


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    if _BUNDLE.value:
        answers.enable_compilation_cache()
        if not _QUESTIONS.value:
            raise app.UsageError("--bundle needs --questions: a bundle holds no QA data")
        model = bundle.load(_BUNDLE.value)
        examples = data.read_examples(_QUESTIONS.value)[: _MAX.value or None]
        options = dict(variant=_VARIANT.value, num_beams=_BEAMS.value)
        metrics, predictions = evaluation.evaluate_bundle(
            model, examples, sequence_decoding=_DECODING.value, **options
        )
        report = {"step": model.step, "variant": _VARIANT.value or model.settings.variant}
        report.update(metrics)
        out = _OUT.value
    else:
        report, predictions = _from_workdir()
        out = _OUT.value or pathlib.Path(_WORKDIR.value) / "eval_predictions.jsonl"
    if out:
        pathlib.Path(out).write_text("".join(json.dumps(p) + "\n" for p in predictions))
    print(json.dumps(report, sort_keys=True))


if __name__ == "__main__":
    host.restart_with_host_settings()  # read only at process start: before any work
    app.run(main)
