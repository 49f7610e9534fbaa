r"""Answers questions from a trained checkpoint, showing the retrieved passages and their weights.

    python experiments/ask.py --workdir /tmp/rag_default --question "where was kori balepo born ?"

Prints, for each question, the N retrieved passages with p(z|x) = softmax(q · d) and the answer.
"""

import jax
import numpy as np
from absl import app, flags, logging

from rag_jax import data, evaluation, host, rag, sharding
from rag_jax.training import loop
from rag_jax.training.batcher import Batcher

_WORKDIR = flags.DEFINE_string("workdir", None, "a training workdir (checkpoints + config)")
_QUESTIONS = flags.DEFINE_multi_string("question", None, "a question (repeatable)")
flags.mark_flags_as_required(["workdir", "question"])


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    exp, state, _ = loop.restore(_WORKDIR.value)
    questions = [data.Example(q, ("",), f"q{i}") for i, q in enumerate(_QUESTIONS.value)]
    mesh = sharding.data_mesh(jax.devices()[:1])
    with exp.config.unlocked():
        exp.config.eval.batch_size = len(questions)
    batcher = Batcher(exp, mesh)
    fields, pieces = batcher.questions(questions)
    hits = batcher.retrieve(state.params, fields, pieces, exp.retriever)
    q = batcher.embed(state.params, fields["question_input_ids"], fields["question_attention_mask"])
    # p(z|x) as the model weighs the retrieved passages: softmax of scale * q · d over N docs.
    scores = rag.doc_scores(q, hits.doc_vectors, exp.rag_cfg.doc_score_scale)
    weights = np.asarray(jax.nn.softmax(scores, axis=-1))
    _, predictions = evaluation.evaluate(
        exp, state.params, questions, mesh=mesh, variant=exp.config.rag.variant
    )
    for b, example in enumerate(questions):
        print(f"\nQ: {example.question}")
        for n, row in enumerate(hits.doc_ids[b]):
            row = int(row)
            print(
                f"  {weights[b, n]:.3f}  [{exp.store.ids[row]}] {exp.store.title(row)}: "
                f"{exp.store.text(row)[:160]}"
            )
        print(f"A: {predictions[b]['prediction']}")


if __name__ == "__main__":
    host.restart_with_host_settings()  # read only at process start: before any work
    app.run(main)
