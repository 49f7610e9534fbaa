"""attention_impl="splash" (jax's Pallas TPU splash kernel, run here in Pallas's interpreter)
against the XLA path: outputs and gradients with padding, for encoder self-attention, decoder
causal self-attention, cross-attention (keys shared by groups of query rows), whole BERT and BART
towers and the Llama decoder (grouped key/value heads read as they are); lengths that are not
multiples of the kernel's blocks against numpy; the kernel under a mesh (`jax.shard_map`); the
"attention" remat policy keeping the kernel's residuals; dropout refused by name."""

import contextlib
import functools
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import Mesh

from rag_jax.models import bart, bert, layers, llama, splash

TOL = 1e-5  # float32, simple ops: relative to the largest magnitude of the XLA path's values
IMPLS = ("xla", "splash")


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
    with splash.interpreted():
        for impl in IMPLS:
            argnums = (0, 1) if kv is None else (0, 1, 2)
            fn = jax.value_and_grad(lambda *a, impl=impl: loss(impl, *a), argnums, has_aux=True)
            (_, out), grads = jax.jit(fn)(params, x, kv)
            results[impl] = (out, grads)
    _close(results["splash"], results["xla"])
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


def _numpy_attention(q, k, v, key_mask, causal):
    """float64 softmax(q k^T) v over the allowed keys; k, v may have fewer heads than q."""
    repeat = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, repeat, axis=1), np.repeat(v, repeat, axis=1)
    logits = np.einsum("bhtd,bhsd->bhts", q.astype(np.float64), k)
    allowed = key_mask[:, None, None, :].astype(bool)
    if causal:
        allowed = allowed & np.tril(np.ones(logits.shape[-2:], bool))
    logits = np.where(allowed, logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    return np.einsum("bhts,bhsd->bhtd", probs / probs.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_lengths_past_one_block_against_numpy(causal):
    """T = S = 136: the kernel's query blocks of 128 and key blocks of 128, padded inside; the
    gradients against the numpy reference's, by finite differences of its float64 loss."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.normal(size=(2, 1, 136, 8)).astype(np.float32) for _ in range(3))
    key_mask = _mask(rng, 2, 136, [136, 61])
    with splash.interpreted():
        got = splash.attention(*map(jnp.asarray, (q, k, v)), jnp.asarray(key_mask), causal)
    _close(got, _numpy_attention(q, k, v, key_mask, causal))


def test_grouped_key_value_heads_against_numpy():
    """h = 4 query heads over g = 2 key/value heads, read as they are (no repeat)."""
    rng = np.random.default_rng(7)
    q = rng.normal(size=(2, 4, 9, 8)).astype(np.float32)
    k, v = (rng.normal(size=(2, 2, 9, 8)).astype(np.float32) for _ in range(2))
    key_mask = _mask(rng, 2, 9, [9, 4])
    with splash.interpreted():
        got = splash.attention(*map(jnp.asarray, (q, k, v)), jnp.asarray(key_mask), True)
    # Rows' padding tokens read nothing real in the reference; compare the real tokens.
    want = _numpy_attention(q, k, v, key_mask, True)
    real = key_mask.astype(bool)[:, None, :, None]
    _close(np.where(real, got, 0.0), np.where(real, want, 0.0))


def test_the_kernel_under_a_mesh_equals_it_alone():
    """Under `jax.set_mesh` the kernel runs in `jax.shard_map` over the batch."""
    rng = np.random.default_rng(4)
    q, k, v = (jnp.asarray(rng.normal(size=(8, 2, 5, 8)), jnp.float32) for _ in range(3))
    key_mask = jnp.asarray(_mask(rng, 8, 5))
    fn = jax.jit(lambda *a: splash.attention(*a, key_mask, False))
    with splash.interpreted():
        alone = fn(q, k, v)
        with jax.set_mesh(Mesh(np.array(jax.devices()[:4]), ("data",))):
            assert "shard_map" in str(jax.make_jaxpr(fn)(q, k, v))
            sharded = fn(q, k, v)
    np.testing.assert_array_equal(np.asarray(sharded), np.asarray(alone))


def test_bad_shapes_are_refused():
    q = jnp.zeros((2, 4, 5, 8))
    with pytest.raises(ValueError, match=r"with g dividing h"):
        splash.attention(q, jnp.zeros((2, 3, 5, 8)), jnp.zeros((2, 3, 5, 8)), jnp.ones((2, 5)), 0)
    with pytest.raises(ValueError, match=r"key_mask \(2, 4\) must be \[B, S\]"):
        splash.attention(q, q, q, jnp.ones((2, 4)), False)


def test_bert_and_bart_towers_with_splash_equal_xla():
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
    with splash.interpreted():
        for impl in IMPLS:
            fn = jax.value_and_grad(lambda *a, impl=impl: losses(impl, *a), (0, 1), has_aux=True)
            results[impl] = jax.jit(fn)(b_params, g_params)
    _close(results["splash"], results["xla"])


def _llama(kv_heads, **changes):
    fields = dict(
        vocab_size=13, hidden_size=16, intermediate_size=20, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=32,
        init_std=0.3, tie_word_embeddings=False,
    )  # fmt: skip
    return llama.LlamaConfig(**{**fields, **changes})


def _llama_batch():
    rng = np.random.default_rng(6)
    mask = np.ones((3, 7), np.int32)
    mask[1, :3] = mask[2, :1] = 0  # left-padded rows
    return jnp.asarray(rng.integers(0, 13, (3, 7)), jnp.int32), jnp.asarray(mask)


def _llama_loss(cfg, params, ids, mask):
    logits = llama.Llama(cfg).apply({"params": params}, ids, mask)
    logits = logits * mask[..., None]  # padding tokens' outputs are meaningless
    return jnp.sum(jnp.sin(logits)), logits


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_llama_decoder_with_splash_equals_xla_on_real_tokens(kv_heads):
    cfg = _llama(kv_heads)
    ids, mask = _llama_batch()
    params = llama.init_params(cfg, jax.random.PRNGKey(3))
    results = {}
    with splash.interpreted():
        for impl in IMPLS:
            config = cfg.replace(attention_impl=impl)
            fn = jax.value_and_grad(lambda p, c=config: _llama_loss(c, p, ids, mask), has_aux=True)
            results[impl] = jax.jit(fn)(params)
    _close(results["splash"], results["xla"])


def test_the_attention_policy_keeps_the_kernels_residuals():
    """Under remat with "attention" the backward pass reads the kernel's output and [h, T]
    log-sum-exp saved from the forward pass; with "projections" it runs the kernel again; either
    way the gradients are the gradients without remat."""
    cfg = _llama(2, attention_impl="splash", num_hidden_layers=1)
    ids, mask = _llama_batch()
    params = llama.init_params(cfg.replace(attention_impl="xla"), jax.random.PRNGKey(3))
    with splash.interpreted():
        plain = jax.jit(jax.grad(lambda p: _llama_loss(cfg, p, ids, mask)[0]))(params)
    for policy, kept in (("attention", True), ("projections", False)):
        rematerialised = cfg.replace(remat=True, remat_policy=policy)
        printed = io.StringIO()
        with splash.interpreted():
            with contextlib.redirect_stdout(printed):
                print_saved_residuals(
                    lambda p, c=rematerialised: _llama_loss(c, p, ids, mask)[0], params
                )
            got = jax.jit(jax.grad(lambda p, c=rematerialised: _llama_loss(c, p, ids, mask)[0]))(
                params
            )
        # The kernel's residuals (saved inside its jitted call, named there `remat.ATTENTION`):
        # the output [R, h, 128, d] (7 tokens padded to 128) and the log-sum-exp [R, h, 128].
        residuals = sorted(
            line.split(" ")[0]
            for line in printed.getvalue().splitlines()
            if "_splash_attention" in line
        )
        assert residuals == (["f32[3,4,128,4]", "f32[3,4,128]"] if kept else []), residuals
        _close(got, plain, 1e-4)


def test_splash_refuses_attention_dropout_in_training():
    x = jnp.ones((2, 3, 8))
    attention = functools.partial(layers.Attention, num_heads=2, hidden=8, init_std=0.3)
    params = attention().init(jax.random.PRNGKey(0), x, None, None)
    model = attention(dropout_rate=0.1, impl="splash")
    with pytest.raises(ValueError, match=r"attention_impl='splash' cannot apply .*=0\.1"):
        model.apply(params, x, None, None, False, rngs={"dropout": jax.random.PRNGKey(1)})
