"""The inplace kernel (`models.inplace`, run here in Pallas's interpreter) in its own [R, T, h * d]
layout against a float64 numpy reference, outputs and gradients (logits scaled inside): heads
narrower than a 128-lane tile (two heads of 64 per tile, eight of 4 in one), heads of 128,
heads that straddle tiles (48, 96), grouped key/value heads read at their own width
[R, S, g * d] (SmolLM2's 9 over 3, Llama's 4 per group, one key/value head, heads of 16 and 32,
several blocks), causal and key padding, a row with no key to read; the blocks of heads it
picks and what it refuses; the kernel under a mesh (`jax.shard_map`); the remat policies'
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
    _check(2, 6, 10, 4, 128, 2, False, [10, 3], seed=5)  # a key/value tile per two query heads


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize(
    "heads, groups, width",
    [(9, 3, 64), (8, 2, 64), (6, 1, 64), (8, 2, 16), (12, 4, 32)],
    ids=["smollm2-9-over-3", "llama-4-per-group", "one-key-value-head", "d16", "d32"],
)
def test_grouped_key_value_heads_read_at_their_width(heads, groups, width, causal):
    """k and v [R, S, g * d] as they are, dK and dV at that width, summed over each group: 9 query
    heads over 3 (SmolLM2: a 192-lane key/value block, its last tile half full, as the queries'
    576 lanes), 4 query heads per key/value head (Llama-3.2-1B), one key/value head read by 6,
    heads of 16 and 32 lanes (key/value heads placed anywhere in a tile); the third row has no
    key to read."""
    length, source = (11, 11) if causal else (7, 12)
    lengths = [source, source - 4, 0] if not causal else [source, 6, 0]
    _check(3, length, source, heads, width, groups, causal, lengths, seed=heads + width)


def test_heads_that_straddle_tiles():
    """Heads of 48 lanes (and 96: three heads over 288 lanes) straddle 128-lane tiles, which then
    join into one."""
    _check(2, 5, 7, 4, 48, 4, False, [7, 3], seed=8)
    _check(2, 6, 6, 6, 48, 2, True, [6, 2], seed=9)
    _check(2, 5, 5, 3, 96, 3, True, [5, 4], seed=10)


def test_grouped_heads_in_several_blocks(monkeypatch):
    """Under a VMEM budget for half the heads, 8 query heads over 4 key/value heads run as two
    blocks of 4 query heads (256 lanes) reading key/value blocks of 2 (128 lanes) each."""
    budget = inplace._vmem_bytes(9, 9, 4 * 64, 2 * 64, 4)
    monkeypatch.setattr(inplace, "VMEM_BUDGET", budget)
    assert inplace.heads_per_block(8, 4, 64, 9, 9, 4) == 4
    _check(2, 9, 9, 8, 64, 4, True, [9, 5], seed=7)


def test_blocks_of_heads_and_what_is_refused():
    # BART-large's contexts (16 heads of 64, T = S = 300, bfloat16): all heads in one step.
    assert inplace.heads_per_block(16, 16, 64, 300, 300, 2) == 16
    # Longer rows: fewer heads per step, their lanes a multiple of 128.
    assert inplace.heads_per_block(16, 16, 64, 512, 512, 2) == 2
    # BERT-base's 12 heads can only be split into blocks whose lanes are multiples of 128.
    assert inplace.heads_per_block(12, 12, 64, 64, 64, 2) == 12
    # Llama-3.2-1B's prompts (32 heads over 8 of 64, T = S = 332): whole groups, key/value lanes
    # a multiple of 128 (16 query heads, 1,024 lanes, over 4 key/value heads, 256 lanes).
    assert inplace.heads_per_block(32, 8, 64, 332, 332, 2) == 16
    # SmolLM2's 9 over 3: 192 key/value lanes cannot be split, so the whole width or nothing.
    assert inplace.heads_per_block(9, 3, 64, 300, 300, 2) == 9
    with pytest.raises(ValueError, match=r"queries of 2048 and keys of 2048 .* use attention_impl"):
        inplace.heads_per_block(16, 16, 64, 2048, 2048, 2)
    with pytest.raises(ValueError, match=r"9 heads \(3 key/value heads\) of 64"):
        inplace.heads_per_block(9, 3, 64, 1024, 1024, 2)
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
