"""Fused attention: jax's Pallas TPU splash-attention kernel behind
`model.attention_impl="splash"`.

Like the flash kernel (`models.flash`), the kernel computes softmax(q k^T) v block by block in
VMEM, forward and backward (three TPU custom calls per attention: forward, dQ, dK/dV), so no
[B, h, T, S] score, probability or mask array reaches HBM. What it keeps for its backward pass is
what sets it apart: its output and one float32 log-sum-exp per query row and head, [h, T], where
the flash kernel keeps two float32 statistics per row broadcast over 128 lanes. Both are marked
with the remat name `remat.ATTENTION`, so that the remat policy "attention" can keep them and
the backward pass need not run the kernel's forward pass again (the flash kernel's statistics
cannot be kept by a policy: under remat its forward pass always runs again).

- The kernel attends one row at a time ([h, T, d] queries); it is vmapped over the rows (Mosaic
  adds the rows to its grid).
- Key padding: query ids are 1 everywhere, key ids 1 for a real token and 0 for padding, so a
  padded query reads the real keys, as in the XLA path (its output is ignored either way).
  Decoder self-attention adds the kernel's static causal mask ([T, S] once padded: query t reads
  keys s <= t, so no query reads a padded key through it either).
- The kernel's blocks: both lengths are padded inside to multiples of 128, the kernel's lane
  width (its dK/dV pass lays the queries' segment ids along lanes, so its query blocks are
  multiples of 128 too: a decoder's 32 target tokens run as 128); padded keys get id -2 and
  padded queries -1, so no real query
  reads a padded key and the padded rows are sliced off (their output gradient is zero, so they
  add nothing to dK and dV). A row that reads no key gets a finite, meaningless output (the
  kernel's masked logits are finite), as in the XLA path, but not the same one.
- Attention-probability dropout cannot be applied inside the kernel: `layers.Attention` refuses
  it in training (`flash.check_no_dropout`).
- Under a mesh (`jax.set_mesh`) the kernel runs inside `jax.shard_map` over the batch, split over
  every mesh axis (Mosaic kernels are not partitioned by XLA); without one it runs as it is.
- On CPU the kernel runs only in Pallas's interpreter, inside `with splash.interpreted():` (as
  the tests do). jax's TPU interpret mode (`force_tpu_interpret_mode`, which the flash tests
  use) does not accept the vmapped kernel (the grid gains the rows' axis, its dimension
  semantics do not) and cannot run under remat (its callbacks are effects).

Legend: B batch, h heads, T query length, S key length, d head width.
"""

import functools

import jax
from jax.experimental.pallas.ops.tpu import splash_attention as kernel

from rag_jax.models import flash, remat

# Key and query blocks of 128 (the lane width: the kernel's segment ids need multiples of it).
KEY_BLOCK = 128
QUERY_BLOCK = 128
# Kernels traced inside run in Pallas's interpreter (on CPU; shared with `models.inplace`).
interpreted = flash.interpreted


def _kernel(heads: int, length: int, source: int, causal: bool):
    """The kernel for (padded) lengths: 128-query and 128-key blocks; its output and
    log-sum-exp named `remat.ATTENTION`."""
    mask = kernel.CausalMask((length, source)) if causal else kernel.FullMask((length, source))
    bq = QUERY_BLOCK
    blocks = kernel.BlockSizes(
        block_q=bq,
        block_kv=KEY_BLOCK,
        block_kv_compute=KEY_BLOCK,
        block_q_dkv=bq,
        block_kv_dkv=KEY_BLOCK,
        block_kv_dkv_compute=KEY_BLOCK,
        block_q_dq=bq,
        block_kv_dq=KEY_BLOCK,
    )
    return kernel.make_splash_mha(
        kernel.MultiHeadMask([mask] * heads),
        block_sizes=blocks,
        head_shards=1,
        q_seq_shards=1,
        residual_checkpoint_name=remat.ATTENTION,
        interpret=flash.interpreting(),
    )


def _padded(query, key, value, key_mask, causal):
    """The kernel on one device's rows, lengths padded to its blocks and sliced back."""
    length = query.shape[2]
    query, key, value, q_ids, kv_ids = flash.padded_to_blocks(
        query, key, value, key_mask, QUERY_BLOCK, KEY_BLOCK
    )
    splash = _kernel(query.shape[1], query.shape[2], key.shape[2], causal)
    out = jax.vmap(splash)(query, key, value, kernel.SegmentIds(q_ids, kv_ids))
    return out[:, :, :length]


def attention(
    query: jax.Array, key: jax.Array, value: jax.Array, key_mask: jax.Array, causal: bool
) -> jax.Array:
    """softmax(query key^T, masked) value with the kernel.

    Args:
      query: [B, h, T, d], already scaled by d^-0.5.
      key: [B, g, S, d]: g key/value heads, each read by h / g query heads (g = h: plain
        multi-head attention).
      value: [B, g, S, d].
      key_mask: [B, S] bool or int, True / 1 = a real key.
      causal: query t reads only keys s <= t (T = S).

    Returns:
      [B, h, T, d] in the query's dtype.
    """
    if (
        key.ndim != 4
        or key.shape != value.shape
        or key.shape[:1] + key.shape[3:] != query.shape[:1] + query.shape[3:]
        or query.shape[1] % key.shape[1]
    ):
        raise ValueError(
            f"query {query.shape}, key {key.shape} and value {value.shape} must be [B, h, T, d], "
            "[B, g, S, d], [B, g, S, d] with g dividing h"
        )
    run = functools.partial(_padded, causal=causal)
    return flash.over_batch("splash", run, query, key, value, key_mask, causal)
