"""A model's fingerprint: which function its architecture and parameters compute.

Vectors, indexes, warm starts and answer memos are kept by the fingerprint of the model that made
them (`encoder_fingerprint`), so that a changed model is never served another's results.
"""

import dataclasses
import hashlib
import json

import jax
import numpy as np

from rag_jax.models import bert

# BertConfig fields added after the first index format, with the values they had before.
_LATER_FIELDS = {
    "pooling": "cls",
    "normalize": False,
    # BartConfig's (a generator's fingerprint keys its reader warm start).
    "encoder_layerdrop": 0.0,
    "decoder_layerdrop": 0.0,
    "frozen_encoder_layers": 0,
}
# BertConfig fields that change how the encoder runs, not what it computes.
_RUNTIME_FIELDS = (
    "dtype",
    "param_dtype",
    "remat",
    "remat_policy",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "initializer_range",
)


def encoder_fingerprint(cfg: bert.BertConfig, params) -> str:
    """sha256 of the encoder's architecture and parameter bytes: which function it computes.

    Covers every `BertConfig` field except those that only change how it runs (compute dtype,
    remat, dropout, init); then, in sorted path order, each parameter's path, dtype, shape and
    little-endian bytes. The compute dtype is recorded beside it in the vectors manifest.

    Args:
      cfg: the encoder's config.
      params: its parameter tree (numpy or fully addressable jax arrays).

    Returns:
      64 hex digits.
    """
    sha = hashlib.sha256()
    arch = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _RUNTIME_FIELDS}
    # Fields added since the first index format count only when they change the function, so
    # that an index encoded before they existed still matches its encoder.
    for name, default in _LATER_FIELDS.items():
        if arch.get(name) == default:
            del arch[name]
    sha.update(json.dumps(arch, sort_keys=True).encode("utf-8"))
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    for path, leaf in sorted(leaves, key=lambda item: jax.tree_util.keystr(item[0])):
        value = np.asarray(leaf)
        value = np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("<"))
        header = f"{jax.tree_util.keystr(path)}|{value.dtype.name}|{value.shape}\n"
        sha.update(header.encode("utf-8"))
        sha.update(value.tobytes())
    return sha.hexdigest()
