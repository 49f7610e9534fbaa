"""`train.retriever_fixed_candidates`: each training question's K candidates are its top K under
the initial question encoder and index, searched once; the step's doc scores stay the current
encoder's, so later batches differ from a fresh search only in which passages they carry."""

import dataclasses
import types

import jax
import numpy as np
import pytest

from rag_jax.run import settings, validation
from rag_jax.training import experiment, loop
from rag_jax.training.batcher import Batcher
from tiny_runs import tiny_config


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    config = tiny_config(
        **{
            "train.retriever_loss": "pdist",
            "train.retriever_candidates": 8,
            "train.retriever_fixed_candidates": True,
        }
    )
    exp = experiment.build(config, tmp_path_factory.mktemp("fixed"))
    return config, exp


def _batch_rows(batcher, exp, params, step):
    """The passage rows batch `step` carries, found from its stored vectors."""
    state = types.SimpleNamespace(params=params, next_doc_ids=None)
    vectors = batcher.train_batch(state, step, exp.retriever).arrays["doc_vectors"]  # [B, K, D]
    stored = np.asarray(exp.retriever.vectors, np.float32)
    flat = vectors.reshape(-1, vectors.shape[-1])
    rows = [int(np.argmin(np.abs(stored - v).sum(axis=1))) for v in flat]
    np.testing.assert_array_equal(stored[rows], flat)  # every vector is a stored row's
    return np.array(rows).reshape(vectors.shape[:2])


def test_batches_carry_the_initial_search_whatever_the_encoder(built):
    config, exp = built
    mesh = loop.device_mesh(config)
    fixed = Batcher(exp, mesh)
    again = settings.override(
        config.copy_and_resolve_references(), {"train.retriever_fixed_candidates": False}
    )  # a copy: override changes the config it is given
    searched = Batcher(dataclasses.replace(exp, config=again), mesh)  # searching every step
    table = fixed.fixed_candidates()
    assert table.shape == (len(exp.train), 8)
    moved = jax.tree.map(lambda x: x, exp.params)
    noise = jax.random.normal(jax.random.PRNGKey(3), ())
    moved["question_encoder"] = jax.tree.map(
        lambda p: p + 0.5 * noise * jax.random.normal(jax.random.PRNGKey(p.size), p.shape),
        exp.params["question_encoder"],
    )
    differs = False
    for step in range(3):
        idx = fixed._examples(step)[0]
        # Under the initial encoder both are the same search.
        np.testing.assert_array_equal(_batch_rows(fixed, exp, exp.params, step), table[idx])
        np.testing.assert_array_equal(_batch_rows(searched, exp, exp.params, step), table[idx])
        # Under another encoder the fixed batch keeps them; a search finds others.
        np.testing.assert_array_equal(_batch_rows(fixed, exp, moved, step), table[idx])
        differs |= not np.array_equal(_batch_rows(searched, exp, moved, step), table[idx])
    assert differs


def test_fixed_candidates_need_a_host_search():
    config = tiny_config(**{"train.retriever_fixed_candidates": True, "rag.closed_book": True})
    with pytest.raises(ValueError, match="retriever_fixed_candidates .*not rag.closed_book"):
        validation.validate(config, 1, paths=False)
    config = tiny_config(**{"train.retriever_fixed_candidates": True, "retrieval.index": "device"})
    with pytest.raises(ValueError, match="retriever_fixed_candidates .*search_in_step"):
        validation.validate(config, 1, paths=False)
