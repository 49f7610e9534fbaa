"""attention_impl="flash" (the Pallas TPU kernel, run here in Pallas interpret mode) against the
XLA path: outputs and gradients with padding, for encoder self-attention, decoder causal
self-attention, cross-attention (keys shared by groups of query rows), whole BERT and BART
towers and the Llama decoder; lengths that are not multiples of the kernel's blocks; the kernel
under a mesh (`jax.shard_map`); dropout refused by name."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh

from rag_jax.models import bart, bert, flash, layers, llama

TOL = 1e-5  # float32, simple ops: relative to the largest magnitude of the XLA path's values
IMPLS = ("xla", "flash")  # splash has its own tests (splash_test.py)


def _close(got, want, tol=TOL):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g), np.asarray(w)
        scale = max(float(np.max(np.abs(w))), 1e-30)
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * scale)


def _mask(rng, rows, length, lengths=None):
    lengths = rng.integers(1, length + 1, rows) if lengths is None else np.asarray(lengths)
    return (np.arange(length)[None, :] < lengths[:, None]).astype(np.int32)  # right-padded


def _attention(impl, causal=False, cross=False):
    return layers.Attention(
        num_heads=2, hidden=8, init_std=0.3, cross=cross, impl=impl, causal=causal
    )


def _compare_attention(x, kv, mask, weights, causal=False, cross=False):
    """Output and gradients (parameters and inputs) of both paths; the loss weighs each output."""
    model = {impl: _attention(impl, causal, cross) for impl in IMPLS}
    params = model["xla"].init(jax.random.PRNGKey(0), x, kv, mask)

    def loss(impl, params, x, kv):
        out = model[impl].apply(params, x, kv, mask)
        return jnp.sum(out * weights), out

    results = {}
    with pltpu.force_tpu_interpret_mode():
        for impl in IMPLS:
            argnums = (0, 1) if kv is None else (0, 1, 2)
            fn = jax.value_and_grad(lambda *a, impl=impl: loss(impl, *a), argnums, has_aux=True)
            (_, out), grads = jax.jit(fn)(params, x, kv)
            results[impl] = (out, grads)
    _close(results["flash"], results["xla"])
    return results


def test_encoder_self_attention_with_key_padding():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, 5, 8)), jnp.float32)
    key_mask = _mask(rng, 3, 5, [5, 2, 4])
    weights = jnp.asarray(rng.normal(size=(3, 5, 8)), jnp.float32)
    _compare_attention(x, None, layers.padding_mask(None, jnp.asarray(key_mask)), weights)


def test_decoder_causal_self_attention_with_padding():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(2, 7, 8)), jnp.float32)
    target_mask = jnp.asarray(_mask(rng, 2, 7, [7, 3]))
    mask = layers.causal_mask(7) & target_mask.astype(bool)[:, None, None, :]
    weights = jnp.asarray(rng.normal(size=(2, 7, 8)), jnp.float32)
    _compare_attention(x, None, mask, weights, causal=True)
    # Without decoder padding the mask is [1, 1, T, T].
    _compare_attention(x, None, layers.causal_mask(7), weights, causal=True)


@pytest.mark.parametrize("kv_shape", [(6, 4, 8), (3, 4, 8), (1, 3, 4, 8)], ids=str)
def test_cross_attention_with_padding_and_shared_keys(kv_shape):
    """[B, S, H] keys, [B / k, S, H] read by k = 2 rows each, [G, m, S, H] with m = 3."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(6, 3, 8)), jnp.float32)
    kv = jnp.asarray(rng.normal(size=kv_shape), jnp.float32)
    key_mask = _mask(rng, int(np.prod(kv_shape[:-2])), kv_shape[-2]).reshape(kv_shape[:-1])
    mask = layers.padding_mask(None, jnp.asarray(key_mask))
    weights = jnp.asarray(rng.normal(size=(6, 3, 8)), jnp.float32)
    _compare_attention(x, kv, mask, weights, cross=True)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_lengths_past_one_block_against_numpy(causal):
    """T = S = 136: the kernel's query blocks of 128 and key blocks of 128, padded inside."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.normal(size=(2, 1, 136, 8)).astype(np.float32) for _ in range(3))
    key_mask = _mask(rng, 2, 136, [136, 61])
    with pltpu.force_tpu_interpret_mode():
        got = flash.attention(*map(jnp.asarray, (q, k, v)), jnp.asarray(key_mask), causal)
    logits = np.einsum("bhtd,bhsd->bhts", q.astype(np.float64), k)
    allowed = key_mask[:, None, None, :].astype(bool)
    if causal:
        allowed = allowed & np.tril(np.ones((136, 136), bool))
    logits = np.where(allowed, logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    want = np.einsum("bhts,bhsd->bhtd", probs / probs.sum(-1, keepdims=True), v)
    _close(got, want)


def test_the_kernel_under_a_mesh_equals_it_alone():
    """Under `jax.set_mesh` the kernel runs in `jax.shard_map` over the batch."""
    rng = np.random.default_rng(4)
    q, k, v = (jnp.asarray(rng.normal(size=(8, 2, 5, 8)), jnp.float32) for _ in range(3))
    key_mask = jnp.asarray(_mask(rng, 8, 5))
    fn = jax.jit(lambda *a: flash.attention(*a, key_mask, False))
    with pltpu.force_tpu_interpret_mode():
        alone = fn(q, k, v)
        with jax.set_mesh(Mesh(np.array(jax.devices()[:4]), ("data",))):
            assert "shard_map" in str(jax.make_jaxpr(fn)(q, k, v))
            sharded = fn(q, k, v)
    np.testing.assert_array_equal(np.asarray(sharded), np.asarray(alone))


@pytest.mark.slow  # about 40 s in interpret mode
def test_bert_and_bart_towers_with_flash_equal_xla():
    rng = np.random.default_rng(5)
    b_cfg = bert.BertConfig(
        vocab_size=13, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=12, max_position_embeddings=16, initializer_range=0.3,
    )  # fmt: skip
    g_cfg = bart.BartConfig(
        vocab_size=11, d_model=8, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=12, decoder_ffn_dim=12,
        max_position_embeddings=16, init_std=0.3,
    )  # fmt: skip
    ids = jnp.asarray(rng.integers(3, 11, (3, 6)), jnp.int32)
    mask = jnp.asarray(_mask(rng, 3, 6, [6, 3, 5]))
    target = jnp.asarray(rng.integers(3, 11, (3, 4)), jnp.int32)
    target_mask = jnp.asarray(_mask(rng, 3, 4, [4, 2, 3]))
    b_params = bert.BertEncoder(b_cfg).init(jax.random.PRNGKey(1), ids, mask)
    # A LayerNorm output's sum of squares is constant: weigh the pooled vector instead.
    weights = jnp.asarray(rng.normal(size=(3, 8)), jnp.float32)
    g_params = bart.Bart(g_cfg).init(jax.random.PRNGKey(2), ids, mask, target)

    def losses(impl, b_params, g_params):
        pooled, _ = bert.BertEncoder(b_cfg.replace(attention_impl=impl)).apply(b_params, ids, mask)
        logits, _ = bart.Bart(g_cfg.replace(attention_impl=impl)).apply(
            g_params, ids, mask, target, target_mask
        )
        logp = jax.nn.log_softmax(logits)  # the NLL over real target tokens
        nll = -jnp.sum(jnp.take_along_axis(logp, target[..., None], -1)[..., 0] * target_mask)
        return jnp.sum(pooled * weights) + nll, (pooled, logits * target_mask[..., None])

    results = {}
    with pltpu.force_tpu_interpret_mode():
        for impl in IMPLS:
            fn = jax.value_and_grad(lambda *a, impl=impl: losses(impl, *a), (0, 1), has_aux=True)
            results[impl] = jax.jit(fn)(b_params, g_params)
    _close(results["flash"], results["xla"])


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_llama_decoder_with_flash_equals_xla_on_real_tokens(kv_heads):
    rng = np.random.default_rng(6)
    cfg = llama.LlamaConfig(
        vocab_size=13, hidden_size=16, intermediate_size=20, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=32,
        init_std=0.3, tie_word_embeddings=False,
    )  # fmt: skip
    mask = np.ones((3, 7), np.int32)
    mask[1, :3] = mask[2, :1] = 0  # left-padded rows
    ids = jnp.asarray(rng.integers(0, 13, (3, 7)), jnp.int32)
    mask = jnp.asarray(mask)
    params = llama.init_params(cfg, jax.random.PRNGKey(3))

    def loss(impl, params):
        logits = llama.Llama(cfg.replace(attention_impl=impl)).apply({"params": params}, ids, mask)
        logits = logits * mask[..., None]  # padding tokens' outputs are meaningless
        return jnp.sum(jnp.sin(logits)), logits

    results = {}
    with pltpu.force_tpu_interpret_mode():
        for impl in IMPLS:
            fn = jax.value_and_grad(lambda p, impl=impl: loss(impl, p), has_aux=True)
            results[impl] = jax.jit(fn)(params)
    _close(results["flash"], results["xla"])


def test_flash_refuses_attention_dropout_in_training():
    x = jnp.ones((2, 3, 8))
    attention = functools.partial(layers.Attention, num_heads=2, hidden=8, init_std=0.3)
    params = attention().init(jax.random.PRNGKey(0), x, None, None)
    model = attention(dropout_rate=0.1, impl="flash")
    with pytest.raises(ValueError, match=r"attention_impl='flash' cannot apply .*=0\.1"):
        model.apply(params, x, None, None, False, rngs={"dropout": jax.random.PRNGKey(1)})
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        attention(impl="fused").init(jax.random.PRNGKey(0), x, None, None)
