"""Tiny runs of the default job shared by the trainer's tests: a 12-entity world, steps in single
digits, contexts of 32 tokens."""

import types

import jax
import numpy as np

from experiments.configs import default as default_config
from rag_jax.run import settings


def tiny_config(**overrides):
    config = default_config.get_config()
    config.data.num_entities = 12
    config.train.steps = 6
    config.train.batch_size = 8
    config.train.log_every = 3
    config.train.save_every = 3
    config.train.warmup_steps = 2
    config.train.retriever_delay_steps = 0  # runs this short would never train the retriever
    config.eval.batch_size = 8
    config.eval.max_examples = 8
    config.eval.max_length = 6
    config.rag.n_docs = 5
    config.rag.max_combined_length = 32
    config.retrieval.passage_max_length = 32
    config.warm_start.steps = 200
    config.warm_start.reader_steps = 2
    config.warm_start.reader_entities = 4
    return settings.override(config, overrides)


def _flat(tree):
    return {
        jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(tree)
    }


def first_batch(batcher, exp, step: int = 0) -> dict:
    """Batch `step`'s host arrays, as the trainer assembles them from the experiment's
    parameters and retriever."""
    state = types.SimpleNamespace(params=exp.params, next_doc_ids=None)
    return batcher.train_batch(state, step, exp.retriever).arrays
