"""Training contexts padded to the batch's longest (`config.rag.context_pad_multiple`), not to S."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rag_jax import rag
from rag_jax.devices import sharding
from rag_jax.model_inputs import context_width
from rag_jax.run import validation
from rag_jax.training import evaluation, experiment, loop
from rag_jax.training.batcher import Batcher
from tiny_runs import _flat, first_batch, tiny_config


def _mask(lengths, width):
    return (np.arange(width)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)


@pytest.mark.parametrize(
    "lengths, multiple, expected",
    [
        ([5, 17, 3], 16, 32),  # the longest row, rounded up
        ([16, 2], 16, 16),  # already a multiple
        ([1, 1], 16, 16),  # never narrower than one multiple
        ([0, 0], 16, 16),  # no real tokens at all
        ([60, 3], 16, 64),  # capped at S
        ([64], 16, 64),
        ([5, 17, 3], 0, 64),  # 0: HF's layout, always S
        ([5, 17, 3], 7, 21),
        ([5, 17, 3], 128, 64),  # a multiple wider than S: S
    ],
)
def test_width_is_the_longest_context_rounded_up(lengths, multiple, expected):
    assert context_width(_mask(lengths, 64), 64, multiple) == expected


def test_a_negative_multiple_is_refused():
    with pytest.raises(ValueError, match="context_pad_multiple must be >= 0"):
        validation.validate(tiny_config(**{"rag.context_pad_multiple": -16}), 1)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A tiny experiment whose S (64) is wider than any of its contexts."""
    workdir = tmp_path_factory.mktemp("wide")
    config = tiny_config(**{"rag.max_combined_length": 64, "warm_start.method": "none"})
    return experiment.build(config, workdir)


def _batch(exp, multiple):
    exp.config.rag.context_pad_multiple = multiple
    batcher = Batcher(exp, sharding.data_mesh(jax.devices()[:1]))
    batch = first_batch(batcher, exp)
    return batch


@pytest.mark.slow  # ~44 s
def test_trimmed_contexts_train_exactly_like_full_width_ones(wide):
    """The batch drops only columns that are padding in every row, and the step's loss and
    gradients with the trimmed contexts equal those with HF's full-width layout."""
    full, trimmed = _batch(wide, 0), _batch(wide, 16)
    width = trimmed["context_input_ids"].shape[-1]
    assert full["context_input_ids"].shape[-1] == 64 and width < 64, width
    mask = full["context_attention_mask"]
    assert width == context_width(mask.reshape(-1, 64), 64, 16)
    np.testing.assert_array_equal(
        trimmed["context_input_ids"], full["context_input_ids"][..., :width]
    )
    np.testing.assert_array_equal(trimmed["context_attention_mask"], mask[..., :width])
    assert not mask[..., width:].any()  # only padding was dropped
    assert mask[..., width - 16 :].any()  # and not a whole multiple more than needed

    def loss_and_grads(batch):
        batch = {k: jnp.asarray(v) for k, v in batch.items()}
        for key in ("context_input_ids", "context_attention_mask"):
            batch[key] = batch[key].reshape(-1, batch[key].shape[-1])  # -> [B * N, S]
        fn = jax.value_and_grad(lambda p: rag.loss_fn(wide.rag_cfg, p, batch)[0])
        return fn(wide.params)

    (loss_full, g_full), (loss_trim, g_trim) = loss_and_grads(full), loss_and_grads(trimmed)
    np.testing.assert_allclose(loss_trim, loss_full, rtol=1e-5)
    for name, value in _flat(g_full).items():
        scale = np.abs(value).max() + 1e-12
        np.testing.assert_allclose(_flat(g_trim)[name], value, atol=1e-5 * scale, err_msg=name)


def test_evaluation_with_trimmed_contexts_generates_the_full_width_answers(wide):
    """Evaluation pads its contexts as training does; the decoded answers and retrieved ids are
    those of HF's full-width layout."""
    mesh = sharding.data_mesh(jax.devices()[:1])
    out = {}
    for multiple in (0, 16):
        wide.config.rag.context_pad_multiple = multiple
        out[multiple] = evaluation.evaluate(
            wide, wide.params, wide.eval[:8], mesh=mesh, variant="sequence"
        )
    assert out[16] == out[0]


@pytest.mark.slow  # two training runs: ~40 s on 2 cores
def test_training_with_trimmed_contexts_ends_where_full_width_training_does(tmp_path):
    """Six steps end to end (every batch's contexts and labels trimmed, one compiled step per
    pair of widths) against the same run at HF's full widths."""
    params = {}
    for multiple in (0, 16):
        config = tiny_config(
            **{
                "rag.max_combined_length": 64,
                "rag.context_pad_multiple": multiple,
                "data.answer_length": 16,
                "data.answer_pad_multiple": multiple // 4,  # 0 or 4
                "warm_start.method": "none",
            }
        )
        config.eval.enabled = False
        workdir = tmp_path / str(multiple)
        loop.train_and_evaluate(config, workdir)
        _, state, _ = loop.restore(workdir)
        params[multiple] = _flat(state.params)
    for name, value in params[0].items():
        np.testing.assert_allclose(params[16][name], value, atol=1e-5, err_msg=name)
