"""The kernels that run in Pallas's interpreter on CPU, attention_impl="splash" (jax's splash
kernel, `models.splash`) and "inplace" (`models.inplace`), against the XLA path: outputs and
gradients with padding, for encoder self-attention, decoder causal self-attention,
cross-attention (keys shared by groups of query rows), whole BERT and BART towers and the Llama
decoder (grouped key/value heads); dropout refused by name. Each kernel's own tests (its layout,
against numpy) are in splash_test.py and inplace_test.py; the flash kernel's, which runs in jax's
TPU interpret mode, in flash_test.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rag_jax.models import bart, bert, flash, layers, llama

TOL = 1e-5  # float32, simple ops: relative to the largest magnitude of the XLA path's values
KERNELS = ("splash", "inplace")


def close(got, want, tol=TOL):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g), np.asarray(w)
        scale = max(float(np.max(np.abs(w))), 1e-30)
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * scale)


def key_padding(rng, rows, length, lengths=None):
    lengths = rng.integers(1, length + 1, rows) if lengths is None else np.asarray(lengths)
    return (np.arange(length)[None, :] < lengths[:, None]).astype(np.int32)  # right-padded


def _attention(impl, causal=False, cross=False):
    return layers.Attention(
        num_heads=2, hidden=8, init_std=0.3, cross=cross, impl=impl, causal=causal
    )


def _compare_attention(kernel, x, kv, mask, weights, causal=False, cross=False):
    """Output and gradients (parameters and inputs) of the kernel and the XLA path; the loss weighs
    each output."""
    model = {impl: _attention(impl, causal, cross) for impl in ("xla", kernel)}
    params = model["xla"].init(jax.random.PRNGKey(0), x, kv, mask)

    def loss(impl, params, x, kv):
        out = model[impl].apply(params, x, kv, mask)
        return jnp.sum(out * weights), out

    results = {}
    with flash.interpreted():
        for impl in model:
            argnums = (0, 1) if kv is None else (0, 1, 2)
            fn = jax.value_and_grad(lambda *a, impl=impl: loss(impl, *a), argnums, has_aux=True)
            (_, out), grads = jax.jit(fn)(params, x, kv)
            results[impl] = (out, grads)
    close(results[kernel], results["xla"])
    return results


@pytest.fixture(params=KERNELS)
def kernel(request):
    return request.param


def test_encoder_self_attention_with_key_padding(kernel):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, 5, 8)), jnp.float32)
    key_mask = key_padding(rng, 3, 5, [5, 2, 4])
    weights = jnp.asarray(rng.normal(size=(3, 5, 8)), jnp.float32)
    _compare_attention(kernel, x, None, layers.padding_mask(None, jnp.asarray(key_mask)), weights)


def test_decoder_causal_self_attention_with_padding(kernel):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(2, 7, 8)), jnp.float32)
    target_mask = jnp.asarray(key_padding(rng, 2, 7, [7, 3]))
    mask = layers.causal_mask(7) & target_mask.astype(bool)[:, None, None, :]
    weights = jnp.asarray(rng.normal(size=(2, 7, 8)), jnp.float32)
    _compare_attention(kernel, x, None, mask, weights, causal=True)
    # Without decoder padding the mask is [1, 1, T, T].
    _compare_attention(kernel, x, None, layers.causal_mask(7), weights, causal=True)


@pytest.mark.parametrize("kv_shape", [(6, 4, 8), (3, 4, 8), (1, 3, 4, 8)], ids=str)
def test_cross_attention_with_padding_and_shared_keys(kernel, kv_shape):
    """[B, S, H] keys, [B / k, S, H] read by k = 2 rows each, [G, m, S, H] with m = 3."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(6, 3, 8)), jnp.float32)
    kv = jnp.asarray(rng.normal(size=kv_shape), jnp.float32)
    key_mask = key_padding(rng, int(np.prod(kv_shape[:-2])), kv_shape[-2]).reshape(kv_shape[:-1])
    mask = layers.padding_mask(None, jnp.asarray(key_mask))
    weights = jnp.asarray(rng.normal(size=(6, 3, 8)), jnp.float32)
    _compare_attention(kernel, x, kv, mask, weights, cross=True)


def test_bert_and_bart_towers_with_a_kernel_equal_xla(kernel):
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
    mask = jnp.asarray(key_padding(rng, 3, 6, [6, 3, 5]))
    target = jnp.asarray(rng.integers(3, 11, (3, 4)), jnp.int32)
    target_mask = jnp.asarray(key_padding(rng, 3, 4, [4, 2, 3]))
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
    with flash.interpreted():
        for impl in ("xla", kernel):
            fn = jax.value_and_grad(lambda *a, impl=impl: losses(impl, *a), (0, 1), has_aux=True)
            results[impl] = jax.jit(fn)(b_params, g_params)
    close(results[kernel], results["xla"])


def llama_config(kv_heads, **changes):
    fields = dict(
        vocab_size=13, hidden_size=16, intermediate_size=20, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=32,
        init_std=0.3, tie_word_embeddings=False,
    )  # fmt: skip
    return llama.LlamaConfig(**{**fields, **changes})


def llama_batch():
    rng = np.random.default_rng(6)
    mask = np.ones((3, 7), np.int32)
    mask[1, :3] = mask[2, :1] = 0  # left-padded rows
    return jnp.asarray(rng.integers(0, 13, (3, 7)), jnp.int32), jnp.asarray(mask)


def llama_loss(cfg, params, ids, mask):
    logits = llama.Llama(cfg).apply({"params": params}, ids, mask)
    logits = logits * mask[..., None]  # padding tokens' outputs are meaningless
    return jnp.sum(jnp.sin(logits)), logits


@pytest.mark.parametrize(
    "kv_heads, shape",
    [(2, {}), (4, {}), (3, dict(num_attention_heads=9, head_dim=64)),
     (2, dict(num_attention_heads=8, head_dim=64))],
    ids=["gqa", "mha", "smollm2-9-over-3-d64", "llama-4-per-group-d64"],
)  # fmt: skip
def test_llama_decoder_with_a_kernel_equals_xla_on_real_tokens(kernel, kv_heads, shape):
    """Grouped key/value heads through the decoder: heads of 4 lanes, and of 64 as SmolLM2 (9
    query heads over 3) and Llama-3.2-1B (4 query heads per key/value head) have them."""
    cfg = llama_config(kv_heads, **shape)
    ids, mask = llama_batch()
    params = llama.init_params(cfg, jax.random.PRNGKey(3))
    results = {}
    with flash.interpreted():
        for impl in ("xla", kernel):
            config = cfg.replace(attention_impl=impl)
            fn = jax.value_and_grad(lambda p, c=config: llama_loss(c, p, ids, mask), has_aux=True)
            results[impl] = jax.jit(fn)(params)
    close(results[kernel], results["xla"])


def test_a_kernel_refuses_attention_dropout_in_training(kernel):
    x = jnp.ones((2, 3, 8))
    attention = functools.partial(layers.Attention, num_heads=2, hidden=8, init_std=0.3)
    params = attention().init(jax.random.PRNGKey(0), x, None, None)
    model = attention(dropout_rate=0.1, impl=kernel)
    with pytest.raises(ValueError, match=rf"attention_impl='{kernel}' cannot apply .*=0\.1"):
        model.apply(params, x, None, None, False, rngs={"dropout": jax.random.PRNGKey(1)})
