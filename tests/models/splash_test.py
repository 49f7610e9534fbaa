"""jax's Pallas TPU splash kernel (`models.splash`, run here in Pallas's interpreter) in its own
[B, h, T, d] layout: lengths that are not multiples of its blocks and grouped key/value heads
against numpy, the kernel under a mesh (`jax.shard_map`), bad shapes refused, the "attention"
remat policy keeping its residuals. Against the XLA path inside the models: kernels_test.py."""

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import Mesh

from rag_jax.models import llama, splash
from tests.models.kernels_test import close, key_padding, llama_batch, llama_config, llama_loss


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
    key_mask = key_padding(rng, 2, 136, [136, 61])
    with splash.interpreted():
        got = splash.attention(*map(jnp.asarray, (q, k, v)), jnp.asarray(key_mask), causal)
    close(got, _numpy_attention(q, k, v, key_mask, causal))


def test_grouped_key_value_heads_against_numpy():
    """h = 4 query heads over g = 2 key/value heads, read as they are (no repeat)."""
    rng = np.random.default_rng(7)
    q = rng.normal(size=(2, 4, 9, 8)).astype(np.float32)
    k, v = (rng.normal(size=(2, 2, 9, 8)).astype(np.float32) for _ in range(2))
    key_mask = key_padding(rng, 2, 9, [9, 4])
    with splash.interpreted():
        got = splash.attention(*map(jnp.asarray, (q, k, v)), jnp.asarray(key_mask), True)
    # Rows' padding tokens read nothing real in the reference; compare the real tokens.
    want = _numpy_attention(q, k, v, key_mask, True)
    real = key_mask.astype(bool)[:, None, :, None]
    close(np.where(real, got, 0.0), np.where(real, want, 0.0))


def test_the_kernel_under_a_mesh_equals_it_alone():
    """Under `jax.set_mesh` the kernel runs in `jax.shard_map` over the batch."""
    rng = np.random.default_rng(4)
    q, k, v = (jnp.asarray(rng.normal(size=(8, 2, 5, 8)), jnp.float32) for _ in range(3))
    key_mask = jnp.asarray(key_padding(rng, 8, 5))
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


def test_the_attention_policy_keeps_the_kernels_residuals():
    """Under remat with "attention" the backward pass reads the kernel's output and [h, T]
    log-sum-exp saved from the forward pass; with "projections" it runs the kernel again; either
    way the gradients are the gradients without remat."""
    cfg = llama_config(2, attention_impl="splash", num_hidden_layers=1)
    ids, mask = llama_batch()
    params = llama.init_params(cfg.replace(attention_impl="xla"), jax.random.PRNGKey(3))
    with splash.interpreted():
        plain = jax.jit(jax.grad(lambda p: llama_loss(cfg, p, ids, mask)[0]))(params)
    for policy, kept in (("attention", True), ("projections", False)):
        rematerialised = cfg.replace(remat=True, remat_policy=policy)
        printed = io.StringIO()
        with splash.interpreted():
            with contextlib.redirect_stdout(printed):
                print_saved_residuals(
                    lambda p, c=rematerialised: llama_loss(c, p, ids, mask)[0], params
                )
            got = jax.jit(jax.grad(lambda p, c=rematerialised: llama_loss(c, p, ids, mask)[0]))(
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
        close(got, plain, 1e-4)
