"""The inplace kernel (`models.inplace`, run here in Pallas's interpreter) in its own [R, T, h * d]
layout against a float64 numpy reference, outputs and gradients (logits scaled inside): heads
narrower than a 128-lane tile (two heads of 64 per tile, eight of 4 in one), heads of 128,
grouped key/value heads, causal and key padding, a row with no key to read; the blocks of heads
it picks and what it refuses; the kernel under a mesh (`jax.shard_map`); the remat policies'
gradients. Against the XLA path inside the models: kernels_test.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from rag_jax.models import flash, inplace, llama
from tests.models.kernels_test import close, key_padding, llama_batch, llama_config, llama_loss

MASK_VALUE = np.finfo(np.float32).min


def _numpy(q, k, v, key_mask, heads, causal, d_out, scale):
    """float64 attention of [R, T, h * d] (logits scale q k^T) and its gradients (dQ, dK, dV)
    for the output gradient `d_out`, as the XLA path computes them: masked logits set to
    float32's lowest value (a row with no key to read weighs every key alike) and their
    gradients zeroed."""
    rows, length, lanes = q.shape
    source, width = k.shape[1], lanes // heads
    groups = k.shape[2] // width

    def split(x, n):  # [R, L, n * d] -> [R, n, L, d]
        return x.astype(np.float64).reshape(rows, x.shape[1], n, width).transpose(0, 2, 1, 3)

    qh, do = split(q, heads), split(d_out, heads)
    kh = np.repeat(split(k, groups), heads // groups, axis=1)
    vh = np.repeat(split(v, groups), heads // groups, axis=1)
    allowed = np.broadcast_to(key_mask[:, None, None, :].astype(bool), (rows, 1, length, source))
    if causal:
        allowed = allowed & np.tril(np.ones((length, source), bool))
    logits = np.where(allowed, scale * np.einsum("rhtd,rhsd->rhts", qh, kh), MASK_VALUE)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("rhts,rhsd->rhtd", probs, vh)
    dprobs = np.einsum("rhtd,rhsd->rhts", do, vh)
    dlogits = np.where(allowed, probs * (dprobs - (probs * dprobs).sum(-1, keepdims=True)), 0.0)
    dq = scale * np.einsum("rhts,rhsd->rhtd", dlogits, kh)
    dk = scale * np.einsum("rhts,rhtd->rhsd", dlogits, qh)
    dv = np.einsum("rhts,rhtd->rhsd", probs, do)

    def merge(x, n):  # [R, h, L, d] -> [R, L, n * d], repeated heads summed back to n
        x = x.reshape(rows, n, heads // n, x.shape[2], width).sum(2)
        return x.transpose(0, 2, 1, 3).reshape(rows, -1, n * width)

    return merge(out, heads), merge(dq, heads), merge(dk, groups), merge(dv, groups)


def _check(rows, length, source, heads, width, groups, causal, lengths=None, seed=0, scale=0.3):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(rows, length, heads * width)).astype(np.float32)
    k, v = (rng.normal(size=(rows, source, groups * width)).astype(np.float32) for _ in range(2))
    key_mask = key_padding(rng, rows, source, lengths)
    d_out = rng.normal(size=q.shape).astype(np.float32)

    def loss(q, k, v):
        out = inplace.attention(q, k, v, jnp.asarray(key_mask), heads, causal, scale)
        return jnp.sum(out * d_out), out

    with flash.interpreted():
        (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    want = _numpy(q, k, v, key_mask, heads, causal, d_out, scale)
    for name, got, expected in zip(("out", "dq", "dk", "dv"), (out, *grads), want, strict=True):
        assert got.shape == expected.shape, name
        close(got, expected)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_two_heads_of_64_per_tile_against_numpy(causal):
    """h = 4, d = 64: two 128-lane tiles of two heads each; lengths not multiples of 8."""
    _check(2, 13, 13 if causal else 21, 4, 64, 4, causal, [13, 5] if causal else [21, 9])


def test_narrow_heads_in_one_tile_and_a_row_with_no_key():
    """h = 8, d = 4 (32 lanes, one tile: the block is the whole width); the second row's keys
    are all padding, so it weighs every key alike, as the XLA path does."""
    _check(3, 5, 7, 8, 4, 8, False, [7, 0, 3], seed=1)


def test_heads_of_128_and_grouped_key_value_heads():
    _check(2, 9, 9, 2, 128, 2, True, [9, 4], seed=2, scale=1.0)  # one tile per head, unscaled
    _check(2, 9, 9, 4, 64, 2, True, [9, 6], seed=3)  # 4 query heads over 2 key/value heads


def test_blocks_of_heads_and_what_is_refused():
    # BART-large's contexts (16 heads of 64, T = S = 300, bfloat16): all heads in one step.
    assert inplace.heads_per_block(16, 64, 300, 300, 2) == 16
    # Longer rows: fewer heads per step, their lanes a multiple of 128.
    assert inplace.heads_per_block(16, 64, 512, 512, 2) == 2
    # BERT-base's 12 heads can only be split into blocks whose lanes are multiples of 128.
    assert inplace.heads_per_block(12, 64, 64, 64, 2) == 12
    with pytest.raises(ValueError, match=r"queries of 2048 and keys of 2048 .* use attention_impl"):
        inplace.heads_per_block(16, 64, 2048, 2048, 2)
    q = jnp.zeros((2, 5, 16))
    with pytest.raises(ValueError, match=r"with h = 4 and g dividing h"):
        inplace.attention(q, jnp.zeros((2, 5, 12)), jnp.zeros((2, 5, 12)), jnp.ones((2, 5)), 4, 0)
    with pytest.raises(ValueError, match=r"key_mask \(2, 4\) must be \[R, S\]"):
        inplace.attention(q, q, q, jnp.ones((2, 4)), 4, False)
    with pytest.raises(ValueError, match=r"causal attention needs T = S"):
        inplace.attention(q, q[:, :4], q[:, :4], jnp.ones((2, 4)), 4, True)


def test_the_kernel_under_a_mesh_equals_it_alone():
    """Under `jax.set_mesh` the kernels run in `jax.shard_map` over the rows."""
    rng = np.random.default_rng(4)
    q, k, v = (jnp.asarray(rng.normal(size=(8, 5, 16)), jnp.float32) for _ in range(3))
    key_mask = jnp.asarray(key_padding(rng, 8, 5))
    fn = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(inplace.attention(*a, key_mask, 2, False))))
    with flash.interpreted():
        alone = fn(q, k, v)
        with jax.set_mesh(Mesh(np.array(jax.devices()[:4]), ("data",))):
            assert "shard_map" in str(jax.make_jaxpr(fn)(q, k, v))
            sharded = fn(q, k, v)
    close(sharded, alone)


@pytest.mark.parametrize("policy", ["attention", "projections"])
def test_gradients_under_the_remat_policies(policy):
    """The kernel saves only its inputs for its backward pass: under remat with either policy the
    gradients are the gradients without remat."""
    cfg = llama_config(2, attention_impl="inplace", num_hidden_layers=1)
    ids, mask = llama_batch()
    params = llama.init_params(cfg.replace(attention_impl="xla"), jax.random.PRNGKey(3))
    rematerialised = cfg.replace(remat=True, remat_policy=policy)
    with flash.interpreted():
        plain = jax.jit(jax.grad(lambda p: llama_loss(cfg, p, ids, mask)[0]))(params)
        got = jax.jit(jax.grad(lambda p: llama_loss(rematerialised, p, ids, mask)[0]))(params)
    close(got, plain, 1e-4)
