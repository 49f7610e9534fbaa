"""rag.loss_fn, its gradients and rag.generate on a `data` mesh of 8 fake CPU devices.

Data parallelism as the trainer runs it: parameters replicated, every batch array split over
`data` along its leading dimension (contexts `[B * N, S]` split into the same questions' rows as
`[B, ...]` arrays), one jitted function, XLA inserting the gradient all-reduce. The results must
equal one device running the whole batch. Weights come from a tiny random HF RAG checkpoint (std
0.3, through `hf.load_rag`) so outputs depend strongly on every input.

Legend: B questions, N docs, S context length, T target length, Q question length, D vector width.
"""

import functools

import jax
import numpy as np
import pytest
import transformers
from jax.sharding import PartitionSpec as P

import hf_fixtures
from rag_jax import rag
from rag_jax.devices import sharding
from rag_jax.io import hf

NUM_DEVICES = 8  # conftest.py's fake devices: the `mesh` fixture
B, N, S, T, Q, D = 16, 3, 11, 7, 6, 8
GEN = dict(max_length=8, min_length=2, no_repeat_ngram_size=2, num_beams=3)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("rag")
    question = transformers.DPRConfig(**hf_fixtures.bert_config(projection_dim=D).to_dict())
    generator = hf_fixtures.bart_config(forced_bos_token_id=0)
    config = transformers.RagConfig.from_question_encoder_generator_configs(
        question, generator, n_docs=N
    )
    hf_fixtures.randomize_(transformers.RagTokenForGeneration(config), seed=3).save_pretrained(path)
    return hf.load_rag(path)


def _batch(cfg, seed=0):
    """A batch with padded contexts, questions and labels, and two padding rows (weight 0)."""
    rng = np.random.default_rng(seed)
    vocab = cfg.generator.vocab_size
    ctx, ctx_mask = hf_fixtures.padded_batch(rng, rng.integers(3, S + 1, B * N).tolist(), vocab, 1)
    q_ids, q_mask = hf_fixtures.padded_batch(
        rng, rng.integers(2, Q + 1, B).tolist(), cfg.question_encoder.vocab_size
    )
    labels = rng.integers(3, vocab, size=(B, T))
    labels[:, 0] = cfg.generator.decoder_start_token_id
    labels[:, 1] = cfg.bos_token_id
    lengths = rng.integers(3, T + 1, B)
    labels[np.arange(T)[None, :] >= lengths[:, None]] = cfg.pad_token_id
    weights = np.ones(B, np.float32)
    weights[-2:] = 0.0
    return {
        "question_input_ids": q_ids,
        "question_attention_mask": q_mask,
        "doc_vectors": rng.normal(size=(B, N, D)).astype(np.float32),
        "context_input_ids": ctx,
        "context_attention_mask": ctx_mask,
        "labels": labels,
        "weights": weights,
    }


def _on_one_device(tree):
    return jax.device_put(tree, jax.devices()[0])


def _assert_grads_close(ours, ref, rtol):
    """Leaf by leaf, relative to each leaf's largest magnitude (gradients span many scales).

    Attention key biases are the exception: they shift every score of a query by the same
    amount, which the softmax cancels, so their true gradient is zero and both sides hold only
    rounding noise; those must be zero up to `rtol` of the largest gradient of the model.
    """
    paths = jax.tree_util.tree_leaves_with_path(ref)
    largest = max(float(np.abs(g).max()) for g in jax.tree.leaves(ref))
    checked = 0
    for (path, expected), got in zip(paths, jax.tree.leaves(ours), strict=True):
        name = jax.tree_util.keystr(path)
        expected, got = np.asarray(expected), np.asarray(got)
        if "['key']['bias']" in name:
            np.testing.assert_allclose(got, 0.0, atol=rtol * largest, err_msg=name)
            np.testing.assert_allclose(expected, 0.0, atol=rtol * largest, err_msg=name)
            continue
        scale = np.abs(expected).max()
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=rtol * scale, err_msg=name)
        checked += 1
    assert checked > 40


# Each case compiles two programs (1 and 8 devices) of ~5-10 s of CPU each, so the default run
# keeps one variant per test; the other variants run with `-m slow`.
@pytest.mark.parametrize("variant", ["sequence", pytest.param("token", marks=pytest.mark.slow)])
def test_loss_and_grads_on_8_devices_equal_1_device(mesh, model, variant):
    cfg, params = model
    batch = _batch(cfg)
    grad_fn = jax.jit(
        jax.value_and_grad(functools.partial(rag.loss_fn, cfg, variant=variant), has_aux=True)
    )
    (ref_loss, ref_aux), ref_grads = grad_fn(_on_one_device(params), _on_one_device(batch))

    sharded_batch = jax.device_put(batch, sharding.batch_sharded(mesh))
    for name in ("context_input_ids", "labels"):  # each device holds its questions' rows
        shard_rows = sharded_batch[name].sharding.shard_shape(sharded_batch[name].shape)[0]
        assert shard_rows == batch[name].shape[0] // NUM_DEVICES
    replicated = sharding.replicate(mesh, params)
    compiled = grad_fn.lower(replicated, sharded_batch).compile()
    assert "all-reduce" in compiled.as_text()  # the gradients are summed across devices
    (loss, aux), grads = compiled(replicated, sharded_batch)

    assert aux["nll"].sharding.is_equivalent_to(sharding.batch_sharded(mesh), 1)
    for leaf in jax.tree.leaves(grads):
        assert leaf.sharding.is_fully_replicated
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(aux["nll"], ref_aux["nll"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(aux["doc_scores"], ref_aux["doc_scores"], rtol=1e-5, atol=1e-5)
    _assert_grads_close(grads, ref_grads, rtol=1e-5)
    # The loss is not trivially small and reaches the question encoder.
    assert float(ref_loss) > 0.1
    q_grad = max(float(np.abs(g).max()) for g in jax.tree.leaves(ref_grads["question_encoder"]))
    assert q_grad > 1e-4


@pytest.mark.parametrize("variant", ["token", pytest.param("sequence", marks=pytest.mark.slow)])
def test_generate_on_8_devices_equals_1_device(mesh, model, variant):
    cfg, params = model
    batch = _batch(cfg, seed=1)
    rows = NUM_DEVICES * N  # one question per device
    contexts = {
        "context_input_ids": batch["context_input_ids"][:rows],
        "context_attention_mask": batch["context_attention_mask"][:rows],
        "doc_scores": np.random.default_rng(2).normal(size=(NUM_DEVICES, N)).astype(np.float32),
    }
    generate = jax.jit(functools.partial(rag.generate, cfg, variant=variant, **GEN))
    ref = generate(_on_one_device(params), **_on_one_device(contexts))

    sharded = jax.device_put(contexts, sharding.batch_sharded(mesh))
    assert sharded["doc_scores"].sharding.spec == P(sharding.DATA_AXIS)
    out = generate(sharding.replicate(mesh, params), **sharded)
    assert out.shape == ref.shape == (NUM_DEVICES, GEN["max_length"])
    np.testing.assert_array_equal(out, ref)
    # Different questions get different answers, so rows cannot have been mixed up unnoticed.
    assert len({tuple(r) for r in np.asarray(ref).tolist()}) > NUM_DEVICES // 2
