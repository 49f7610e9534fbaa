"""Fused attention: jax's Pallas TPU flash-attention kernel behind `model.attention_impl="flash"`.

The kernel computes softmax(q k^T) v block by block in VMEM, so the [B, h, T, S] scores,
probabilities and mask are never written to HBM, in the forward pass nor in its own backward
(three TPU custom calls: forward, dK/dV, dQ). What the XLA path (`layers.Attention`,
`llama._attend`) expresses as a dense mask, the kernel takes as segment ids: query t may read key
s when their ids are equal, and, with `causal`, when s <= t.

- Key padding: query ids are 1 everywhere, key ids 1 for a real token and 0 for padding, so a
  padded query reads the real keys, as in the XLA path (its output is ignored either way).
- The kernel's blocks: the key length is padded inside to a multiple of 128 (the kernel's lane
  width) and the query length to a multiple of 8 (or of 128 beyond 128); padded keys get id -2
  and padded queries -1, so no real query reads a padded key and the padded rows are sliced off
  (their output gradient is zero, so they add nothing to dK and dV).
- A row with no key to read (every key padding) gets a finite, meaningless output, as in the
  XLA path, but not the same one.
- Attention-probability dropout cannot be applied inside the kernel: `layers.Attention` refuses
  it in training (`check_no_dropout`).
- Under a mesh (`jax.set_mesh`) the kernel runs inside `jax.shard_map` over the batch, split over
  every mesh axis (Mosaic kernels are not partitioned by XLA); without one it runs as it is.
- On CPU the kernel runs only in Pallas interpret mode
  (`jax.experimental.pallas.tpu.force_tpu_interpret_mode()`, as the tests do).

Legend: B batch, h heads, T query length, S key length, d head width.
"""

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import flash_attention as kernel
from jax.sharding import PartitionSpec as P

# Every attention implementation (`model.attention_impl`): XLA's, and the Pallas TPU kernels of
# this module, of `models.splash` and of `models.inplace`.
IMPLS = ("xla", "flash", "splash", "inplace")
KERNELS = ("flash", "splash", "inplace")
# The kernel's key blocks hold 128 keys (its lane width; segment ids need a multiple of it).
KEY_BLOCK = 128
# Query blocks: the query length rounded up to 8 sublanes, at most 128 rows.
QUERY_BLOCK = 128
SUBLANES = 8
# Segment ids of the rows and keys padded to the kernel's blocks.
PAD_QUERY_ID = -1
PAD_KEY_ID = -2


# Whether kernels traced now run in Pallas's interpreter (`interpreted`).
_INTERPRET = contextvars.ContextVar("kernels_interpret", default=False)


@contextlib.contextmanager
def interpreted():
    """The splash and inplace kernels traced inside run in Pallas's interpreter, forward and
    backward (on CPU)."""
    token = _INTERPRET.set(True)
    try:
        yield
    finally:
        _INTERPRET.reset(token)


def interpreting() -> bool:
    return _INTERPRET.get()


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"attention_impl must be one of {IMPLS}, got {impl!r}")


def check_no_dropout(rate: float, deterministic: bool, setting: str, impl: str = "flash") -> None:
    """Refuses attention-probability dropout under a kernel (`impl`), which cannot apply it."""
    if not deterministic and rate > 0.0:
        raise ValueError(
            f"model.attention_impl={impl!r} cannot apply attention-probability dropout, but "
            f"{setting}={rate} in training: set it to 0.0, train with model.deterministic=True, "
            "or use model.attention_impl='xla'"
        )


def tracing_mesh(impl: str, mesh):
    """The context to trace a program in: the mesh (`jax.set_mesh`) when it holds the kernels
    (`impl` "flash" or "splash"), which then run in `jax.shard_map` over it, as XLA does not
    partition them; nothing for the XLA path, whose programs are traced as they always were."""
    return jax.set_mesh(mesh) if impl in KERNELS else contextlib.nullcontext()


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _block_sizes(query_len: int) -> kernel.BlockSizes:
    """Blocks for a (padded) query length: one query block of up to 128 rows, 128-key blocks."""
    bq = min(query_len, QUERY_BLOCK)
    return kernel.BlockSizes(
        block_q=bq,
        block_k_major=KEY_BLOCK,
        block_k=KEY_BLOCK,
        block_b=1,
        block_q_major_dkv=bq,
        block_k_major_dkv=KEY_BLOCK,
        block_k_dkv=KEY_BLOCK,
        block_q_dkv=bq,
        block_k_major_dq=KEY_BLOCK,
        block_k_dq=KEY_BLOCK,
        block_q_dq=bq,
    )


def padded_to_blocks(query, key, value, key_mask, query_multiple: int, key_multiple: int):
    """The kernels' inputs padded to their blocks: (query, key, value, query ids, key ids),
    lengths rounded up to `query_multiple` and `key_multiple`; real queries get id 1, real keys
    1 and key padding 0 (from `key_mask`), padded rows PAD_QUERY_ID and padded keys PAD_KEY_ID,
    so no query reads a padded key."""
    length, source = query.shape[2], key.shape[2]
    t_pad = _round_up(length, query_multiple) - length
    s_pad = _round_up(source, key_multiple) - source
    q_ids = jnp.ones(query.shape[:1] + (length,), jnp.int32)
    kv_ids = key_mask.astype(jnp.int32)
    if t_pad:
        query = jnp.pad(query, ((0, 0), (0, 0), (0, t_pad), (0, 0)))
        q_ids = jnp.pad(q_ids, ((0, 0), (0, t_pad)), constant_values=PAD_QUERY_ID)
    if s_pad:
        key = jnp.pad(key, ((0, 0), (0, 0), (0, s_pad), (0, 0)))
        value = jnp.pad(value, ((0, 0), (0, 0), (0, s_pad), (0, 0)))
        kv_ids = jnp.pad(kv_ids, ((0, 0), (0, s_pad)), constant_values=PAD_KEY_ID)
    return query, key, value, q_ids, kv_ids


def _padded(query, key, value, key_mask, causal):
    """The kernel on one device's rows, lengths padded to its blocks and sliced back."""
    length = query.shape[2]
    multiple = SUBLANES if length <= QUERY_BLOCK else QUERY_BLOCK
    query, key, value, q_ids, kv_ids = padded_to_blocks(
        query, key, value, key_mask, multiple, KEY_BLOCK
    )
    out = kernel.flash_attention(
        query,
        key,
        value,
        segment_ids=kernel.SegmentIds(q_ids, kv_ids),
        causal=causal,
        sm_scale=1.0,
        block_sizes=_block_sizes(query.shape[2]),
    )
    return out[:, :, :length]


def attention(
    query: jax.Array, key: jax.Array, value: jax.Array, key_mask: jax.Array, causal: bool
) -> jax.Array:
    """softmax(query key^T, masked) value with the kernel.

    Args:
      query: [B, h, T, d], already scaled by d^-0.5.
      key: [B, h, S, d].
      value: [B, h, S, d].
      key_mask: [B, S] bool or int, True / 1 = a real key.
      causal: query t reads only keys s <= t (T = S).

    Returns:
      [B, h, T, d] in the query's dtype.
    """
    if (
        key.shape != value.shape
        or key.shape[:2] + key.shape[3:] != query.shape[:2] + query.shape[3:]
    ):
        raise ValueError(
            f"query {query.shape}, key {key.shape} and value {value.shape} must be [B, h, T, d], "
            "[B, h, S, d], [B, h, S, d]"
        )
    return over_batch(
        "flash", functools.partial(_padded, causal=causal), query, key, value, key_mask, causal
    )


def over_batch(kernel_name: str, run, query, key, value, key_mask, causal: bool) -> jax.Array:
    """`run(query, key, value, key_mask)` after the checks both kernels share (the mask's shape,
    causal lengths), in `jax.shard_map` over the batch when a mesh is set (split over every mesh
    axis: XLA does not partition Mosaic kernels), as it is without one."""
    if key_mask.shape != key.shape[:1] + key.shape[2:3]:
        raise ValueError(f"key_mask {key_mask.shape} must be [B, S] for key {key.shape}")
    if causal and query.shape[2] != key.shape[2]:
        raise ValueError(f"causal attention needs T = S, got query {query.shape}, key {key.shape}")
    return on_rows(kernel_name, run, query, key, value, key_mask)


def on_rows(kernel_name: str, run, *arrays: jax.Array):
    """`run(*arrays)`, in `jax.shard_map` over the arrays' first axis (their rows) when a mesh is
    set, split over every mesh axis (XLA does not partition Mosaic kernels); as it is without."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return run(*arrays)
    if arrays[0].shape[0] % mesh.size:
        raise ValueError(
            f"{kernel_name} attention splits its batch of {arrays[0].shape[0]} rows over the "
            f"mesh's {mesh.size} devices: the rows must be a multiple of them"
        )
    rows = P(mesh.axis_names)
    return jax.shard_map(run, in_specs=(rows,) * len(arrays), out_specs=rows, check_vma=False)(
        *arrays
    )
