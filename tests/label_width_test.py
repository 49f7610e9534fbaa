"""Training labels padded to the batch's longest (`config.data.answer_pad_multiple`), not to T."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rag_jax import rag
from rag_jax.devices import sharding
from rag_jax.model_inputs import label_width
from rag_jax.run import validation
from rag_jax.training import experiment, loop
from rag_jax.training.batcher import Batcher
from tiny_runs import _flat, first_batch, tiny_config

PAD = 1


def _labels(lengths, width):
    """Rows of `length` non-pad ids (2 = BART's decoder start, then 0, 5, 6, ...), then pads."""
    out = np.full((len(lengths), width), PAD, np.int32)
    for i, n in enumerate(lengths):
        out[i, :n] = [2, 0, *range(5, 5 + max(0, n - 2))][:n]
    return out


@pytest.mark.parametrize(
    "lengths, multiple, expected",
    [
        ([5, 7, 3], 4, 8),  # the longest row, rounded up
        ([4, 2], 4, 4),  # already a multiple
        ([2, 2], 8, 8),  # never narrower than one multiple
        ([15, 3], 12, 16),  # capped at T
        ([5, 7, 3], 0, 16),  # 0: always T
        ([5, 7, 3], 3, 9),
    ],
)
def test_width_is_the_longest_label_rounded_up(lengths, multiple, expected):
    assert label_width(_labels(lengths, 16), PAD, 16, multiple) == expected


def test_a_negative_multiple_is_refused():
    with pytest.raises(ValueError, match="answer_pad_multiple must be >= 0"):
        validation.validate(tiny_config(**{"data.answer_pad_multiple": -8}), 1)


@pytest.fixture(scope="module")
def long_labels(tmp_path_factory):
    """A tiny experiment whose T (16) is longer than any of its answers' labels."""
    workdir = tmp_path_factory.mktemp("long_labels")
    config = tiny_config(**{"data.answer_length": 16, "warm_start.method": "none"})
    return experiment.build(config, workdir)


def _batch(exp, multiple):
    exp.config.data.answer_pad_multiple = multiple
    batcher = Batcher(exp, sharding.data_mesh(jax.devices()[:1]))
    batch = first_batch(batcher, exp)
    return batch


def _float64(cfg: rag.RagConfig, **changes) -> rag.RagConfig:
    wide = dict(dtype="float64", param_dtype="float64")
    return dataclasses.replace(
        cfg,
        question_encoder=dataclasses.replace(cfg.question_encoder, **wide),
        generator=dataclasses.replace(cfg.generator, **wide),
        **changes,
    )


@pytest.mark.parametrize("variant", ["sequence", "token"])
@pytest.mark.parametrize("smoothing, exclude_bos", [(0.0, False), (0.1, True)])
def test_trimmed_labels_train_exactly_like_full_length_ones(
    long_labels, variant, smoothing, exclude_bos
):
    """The batch drops only label columns that are padding in every row, and both losses and
    their gradients, with label smoothing and the BOS score excluded or not, equal those of the
    full-length labels.

    Compared in float64: the question encoder's gradient is a small difference of large terms
    (the docs' posterior against their prior), so float32 rounding of the generator's
    log-likelihoods, which changes with the decoder's matmul shapes, reaches 1e-3 of it in either
    layout. In float64 the two layouts agree to 1e-12.
    """
    exp = long_labels
    full, trimmed = _batch(exp, 0), _batch(exp, 4)
    width = trimmed["labels"].shape[-1]
    assert full["labels"].shape[-1] == 16 and width < 16, width
    np.testing.assert_array_equal(trimmed["labels"], full["labels"][:, :width])
    assert (full["labels"][:, width:] == PAD).all()  # only padding was dropped
    assert (full["labels"][:, width - 4 :] != PAD).any()  # and no whole multiple more
    for key in set(full) - {"labels"}:
        np.testing.assert_array_equal(trimmed[key], full[key])

    with jax.enable_x64(True):
        cfg = _float64(exp.rag_cfg, label_smoothing=smoothing, exclude_bos_score=exclude_bos)
        params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), exp.params)

        def loss_and_grads(batch):
            batch = {k: jnp.asarray(v) for k, v in batch.items()}
            batch["doc_vectors"] = batch["doc_vectors"].astype(jnp.float64)
            for key in ("context_input_ids", "context_attention_mask"):
                batch[key] = batch[key].reshape(-1, batch[key].shape[-1])  # -> [B * N, S]
            fn = jax.value_and_grad(lambda p: rag.loss_fn(cfg, p, batch, variant)[0])
            return fn(params)

        (loss_full, g_full), (loss_trim, g_trim) = loss_and_grads(full), loss_and_grads(trimmed)
        assert loss_full.dtype == jnp.float64
        np.testing.assert_allclose(loss_trim, loss_full, rtol=1e-12)
        for name, value in _flat(g_full).items():
            assert value.dtype == np.float64, name
            scale = np.abs(value).max() + 1e-300
            np.testing.assert_allclose(_flat(g_trim)[name], value, atol=1e-9 * scale, err_msg=name)


def test_the_first_compile_is_at_full_width():
    """The trainer checks memory on the widest step: contexts at S and labels at T."""
    x = jnp.zeros((2, 3, 5), jnp.int32)
    batch = {"context_input_ids": x, "labels": jnp.zeros((2, 4), jnp.int32), "doc_vectors": x}
    (wide, extra) = loop._with_width((batch, "index"), 9, 7)
    assert extra == "index"
    assert wide["context_input_ids"].shape == (2, 3, 9)
    assert wide["labels"].shape == (2, 7)
    assert wide["doc_vectors"].shape == (2, 3, 5)
