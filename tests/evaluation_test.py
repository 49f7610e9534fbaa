"""Evaluation with more passages at test time than in training (`eval.n_docs`), as the paper
tests RAG-Sequence with 50 and RAG-Token with 15 after training with 5."""

import jax
import numpy as np
import pytest

from rag_jax import evaluation, experiment, rag, settings, sharding
from rag_jax.training.inputs import question_tokens
from tiny_runs import tiny_config


@pytest.fixture(scope="module")
def exp(tmp_path_factory):
    config = tiny_config(**{"warm_start.method": "none", "warm_start.reader_steps": 0})
    return experiment.build(config, tmp_path_factory.mktemp("eval_n_docs"))


def test_eval_n_docs_retrieves_the_top_k_of_a_brute_force_search(exp):
    mesh = sharding.data_mesh(jax.devices()[:1])
    examples = exp.eval[:8]
    exp.config.eval.n_docs = 7  # training retrieves rag.n_docs = 5
    try:
        metrics, predictions = evaluation.evaluate(
            exp, exp.params, examples, mesh=mesh, variant="sequence"
        )
    finally:
        exp.config.eval.n_docs = 0
    assert [len(p["retrieved"]) for p in predictions] == [7] * len(examples)
    # The retrieved passages: the 7 best of every stored vector by inner product (numpy).
    fields = question_tokens(
        exp.question_tokenizer, [e.question for e in examples], exp.config.data.question_length
    )
    q = np.asarray(
        rag.question_embeddings(
            exp.rag_cfg, exp.params, fields["question_input_ids"], fields["question_attention_mask"]
        )
    )
    scores = q @ np.asarray(exp.retriever.vectors, np.float32).T  # -> [B, C]
    best = np.argsort(-scores, axis=1, kind="stable")[:, :7]
    want = [[exp.store.ids[int(j)] for j in row] for row in best]
    assert [p["retrieved"] for p in predictions] == want
    assert 0.0 <= metrics["exact_match"] <= 1.0


def test_eval_n_docs_defaults_to_the_training_k(exp):
    cfg = evaluation.eval_rag_config(exp.rag_cfg, exp.config)
    assert cfg.n_docs == exp.config.rag.n_docs == 5
    assert exp.retriever.with_n_docs(5) is exp.retriever


def test_closed_book_cannot_test_with_more_passages():
    config = tiny_config(**{"rag.closed_book": True, "rag.n_docs": 1, "eval.n_docs": 5})
    with pytest.raises(ValueError, match=r"config.eval.n_docs=5 but config.rag.closed_book"):
        settings.validate(config, 1)
