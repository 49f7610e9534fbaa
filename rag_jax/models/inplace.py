"""Fused attention that reads the projections' layout in place: `model.attention_impl="inplace"`.

jax's TPU kernels (`models.flash`, `models.splash`) take head-major [B, h, T, d] arrays, lengths
padded to their 128-wide blocks, and write softmax statistics broadcast over 128 lanes. Around
the paper's step on a TPU that interface costs more HBM traffic than the attention itself: q, k,
v and the output copied between [B, T, h, d] and [B, h, T, d], every input padded from 300 to
384 and every output sliced back, the statistics sliced to one lane and broadcast again
(tpu/README.md, "Remat policies and splash attention"). This module's Pallas kernels read q, k
and v as the projections write them, [rows, T, h * d], and write the output and the gradients in
the same layout; nothing is padded, copied or kept beside them.

- Whole rows: one grid step holds a row's whole query and key lengths for a block of heads in
  VMEM (`heads_per_block` query heads, whose key/value lanes are a multiple of 128, or all
  heads), so its softmax needs no running statistics and lengths need no padding to a block
  size (a block equal to the array's dimension may have any length). The [T, S] scores of one
  head live in VMEM only. This suits the short sequences of retrieval-augmented generation
  (contexts of 300, questions of 64, targets of 32); a length whose scores do not fit VMEM is
  refused by name (use "splash").
- Heads inside a block are read from the 128-lane tiles that hold them; a head narrower than a
  tile (d = 64: two heads per tile) is selected by zeroing the tile's other lanes in the operand
  of each product (q of q k^T, v of p v, and so on), so no lane of a head in its own tile is
  shifted. On a TPU the matrix unit contracts 128 lanes at a time, so the zeros cost no
  matrix-unit time that a 64-wide head would not already waste. A head that straddles two tiles
  (d = 48, 96) joins them into one tile.
- Nothing is saved for the backward pass but q, k and v: the backward kernel recomputes each
  head's probabilities in both orientations, [T, S] for dQ and [S, T] for dK and dV, each
  softmax from its own scores, and the softmax's gradient from p * (dp - sum(p * dp)) (the
  form XLA differentiates the XLA path's softmax to), so no log-sum-exp and no rowsum(dO * O)
  crosses HBM. Two calls per attention: forward and backward (a remat policy that does not keep
  the output, `remat.ATTENTION`, runs the forward again for the output projection's gradient).
- The logits' scale (d^-0.5) is applied inside, to the float32 logits: the query projection's
  output goes in as it is, and no scaled copy of it is written (the layers pass it unscaled).
- Masks as in the XLA path (`layers.Attention`): a key-padding mask and, for decoder
  self-attention, the causal mask, applied as `where(allowed, logits, MASK_VALUE)`, so even a
  row with no key to read (every key padding) gets the XLA path's output and gradients (uniform
  weights), and padded queries read the real keys.
- Attention-probability dropout cannot be applied: `layers.Attention` refuses it in training
  (`flash.check_no_dropout`).
- Grouped key/value heads (Llama: h query heads over g key/value heads, r = h / g) are read as
  the projections write them, [rows, S, g * d]: a block of query heads is whole groups, and its
  keys and values are the block of the same index in [rows, S, g * d] (r times narrower), so no
  key or value is repeated in HBM. A query head whose key/value head lies elsewhere in its tile
  than the query head in its own (d = 64, r > 1: about half of the query heads) reads it
  sliced from its tile and placed at its own lanes between zeros (lane shifts of [S, 128]
  arrays on the vector units, k and v in each kernel, and the head's dK and dV back to the
  key/value head's lanes); the backward kernel sums dK and dV over each group's query heads in
  float32 in VMEM and writes them at [rows, S, g * d].
- Under a mesh (`jax.set_mesh`) the kernels run in `jax.shard_map` over the rows
  (`flash.on_rows`); without one they run as they are. On CPU they run in Pallas's interpreter,
  inside `with flash.interpreted():` (as the tests do).

Legend: R rows, T query length, S key length, h heads, g key/value heads, r = h / g, d head
width, H = h * d, G = g * d.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from rag_jax.models import flash

LANES = 128
# What one grid step may hold in VMEM (estimated by `_vmem_bytes`): below the 16 MiB a Mosaic
# kernel may use by default on v4 and v5e.
VMEM_BUDGET = 12 * 2**20
_MASK_VALUE = float(jnp.finfo(jnp.float32).min)  # layers.MASK_VALUE
_NT = (((1,), (1,)), ((), ()))  # a @ b^T: both operands' lanes contracted


def _tiles(heads: int, width: int) -> list[tuple[int, int, list[int]]]:
    """The 128-lane tiles of a block of `heads` heads of `width` lanes: (first lane, end lane,
    the heads they hold); a head wider than a tile spans whole tiles, and a head that straddles
    two tiles (a width that neither divides 128 nor is a multiple of it, e.g. 48 or 96) joins
    them into one, so that no two tiles share a lane."""
    lanes = heads * width
    tiles = []
    for head in range(heads):
        start = head * width // LANES * LANES
        end = min(-(-(head + 1) * width // LANES) * LANES, lanes)
        if tiles and start < tiles[-1][1]:
            first, last, held = tiles[-1]
            tiles[-1] = first, max(last, end), [*held, head]
        else:
            tiles.append((start, end, [head]))
    return tiles


def _tile_of(heads: int, width: int) -> dict[int, tuple[int, int]]:
    """Each head's tile in `_tiles(heads, width)`: (first lane, end lane)."""
    return {head: (start, end) for start, end, held in _tiles(heads, width) for head in held}


def _only(x: jax.Array, start: int, head: int, width: int) -> jax.Array:
    """`x` [n, lanes of a tile starting at `start`] with every lane but `head`'s zeroed."""
    first = head * width - start
    if first == 0 and x.shape[1] == width:
        return x
    lane = lax.broadcasted_iota(jnp.int32, (1, x.shape[1]), 1)
    keep = (lane >= first) & (lane < first + width)
    return jnp.where(keep, x.astype(jnp.float32), 0.0).astype(x.dtype)


def _placed(x: jax.Array, start: int, head: int, width: int, at: int, lanes: int) -> jax.Array:
    """`head`'s lanes of `x` [n, lanes of a tile starting at `start`] at lane `at` of an
    [n, lanes] operand, zeros elsewhere; `x` as it is when the head already lies there (its other
    heads' lanes then kept: the caller selects the head as it does in its own tile)."""
    first = head * width - start
    if first == at and x.shape[1] == lanes:
        return x
    rows = x.shape[0]
    pieces = [jnp.zeros((rows, at), x.dtype), x[:, first : first + width]]
    pieces.append(jnp.zeros((rows, lanes - at - width), x.dtype))
    return jnp.concatenate([p for p in pieces if p.shape[1]], axis=1)


def _allowed(key_mask: jax.Array, shape: tuple[int, int], causal: bool, keys_axis: int):
    """Which (query, key) pairs may attend: [T, S] (`keys_axis` 1) or [S, T] (0), from the key
    mask laid along that axis ([1, S] or [S, 1]) and, with `causal`, key <= query."""
    allowed = jnp.broadcast_to(key_mask != 0, shape)
    if causal:
        key = lax.broadcasted_iota(jnp.int32, shape, keys_axis)
        query = lax.broadcasted_iota(jnp.int32, shape, 1 - keys_axis)
        allowed = allowed & (key <= query)
    return allowed


def _softmax(logits: jax.Array, allowed: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """Masked logits' exp(logits - max) and their sum along `axis` (the keys)."""
    logits = jnp.where(allowed, logits, _MASK_VALUE)
    weights = jnp.exp(logits - jnp.max(logits, axis=axis, keepdims=True))
    return weights, jnp.sum(weights, axis=axis, keepdims=True)


def _key_value(k_ref, v_ref, loaded: dict, tile: tuple[int, int], group: int, width: int,
               at: int, lanes: int) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """k and v [S, lanes] of key/value head `group` at lane `at` (`_placed`), read from its `tile`
    (first lane, end lane) once into `loaded`."""
    if tile not in loaded:
        loaded[tile] = k_ref[0, :, tile[0] : tile[1]], v_ref[0, :, tile[0] : tile[1]]
    return tuple(_placed(x, tile[0], group, width, at, lanes) for x in loaded[tile])


def _forward_kernel(
    mask_ref, q_ref, k_ref, v_ref, o_ref, *, heads, groups, width, causal, scale
):  # fmt: skip
    """One row's block of heads: o = softmax(scale q k^T, masked) v, head by head."""
    length, source = q_ref.shape[1], k_ref.shape[1]
    allowed = _allowed(mask_ref[0], (length, source), causal, keys_axis=1)
    repeat, tile_of = heads // groups, _tile_of(groups, width)
    for start, end, held in _tiles(heads, width):
        q = q_ref[0, :, start:end]
        loaded = {}  # the key/value tiles this query tile reads
        out = jnp.zeros((length, end - start), jnp.float32)
        for head in held:
            group = head // repeat
            at, lanes = head * width - start, end - start
            k, v = _key_value(k_ref, v_ref, loaded, tile_of[group], group, width, at, lanes)
            logits = lax.dot_general(
                _only(q, start, head, width), k, _NT, preferred_element_type=jnp.float32
            )
            weights, total = _softmax(logits * scale, allowed, axis=1)
            mixed = jnp.dot(
                weights.astype(v.dtype),
                _only(v, start, head, width),
                preferred_element_type=jnp.float32,
            )
            out = out + mixed / total
        o_ref[0, :, start:end] = out.astype(o_ref.dtype)


def _backward_kernel(
    rows_ref, cols_ref, q_ref, k_ref, v_ref, do_ref, dq_ref, dk_ref, dv_ref, *, heads, groups,
    width, causal, scale,
):  # fmt: skip
    """One row's block of heads: dQ from the [T, S] orientation, dK and dV from [S, T], summed
    over each key/value head's query heads (in float32, in VMEM) and written once its last query
    tile is done."""
    length, source = q_ref.shape[1], k_ref.shape[1]
    allowed = _allowed(rows_ref[0], (length, source), causal, keys_axis=1)
    allowed_t = _allowed(cols_ref[0], (source, length), causal, keys_axis=0)
    f32 = jnp.float32
    repeat, tile_of = heads // groups, _tile_of(groups, width)
    q_tiles = _tiles(heads, width)
    last_reader = {tile_of[h // repeat]: n for n, (_, _, held) in enumerate(q_tiles) for h in held}
    sums = {}  # key/value tile -> its dK and dV so far, float32 [S, tile lanes]
    for n, (start, end, held) in enumerate(q_tiles):
        q, do = q_ref[0, :, start:end], do_ref[0, :, start:end]
        loaded = {}  # the key/value tiles this query tile reads
        dq = jnp.zeros((length, end - start), f32)
        for head in held:
            group, tile = head // repeat, tile_of[head // repeat]
            at, lanes = head * width - start, end - start
            k, v = _key_value(k_ref, v_ref, loaded, tile, group, width, at, lanes)
            qh, kh = _only(q, start, head, width), _only(k, start, head, width)
            doh = _only(do, start, head, width)
            # [T, S]: dQ = dS k, dS = p * (dp - sum(p * dp)), dp = dO v^T.
            weights, total = _softmax(
                lax.dot_general(qh, k, _NT, preferred_element_type=f32) * scale, allowed, axis=1
            )
            probs = weights / total
            dprobs = lax.dot_general(doh, v, _NT, preferred_element_type=f32)
            dlogits = probs * (dprobs - jnp.sum(probs * dprobs, axis=1, keepdims=True))
            dlogits = jnp.where(allowed, dlogits * scale, 0.0)  # the gradient of q k^T
            dq = dq + jnp.dot(dlogits.astype(k.dtype), kh, preferred_element_type=f32)
            # [S, T]: dV = p^T dO, dK = dS^T q, each from its own softmax over the queries' axis.
            weights, total = _softmax(
                lax.dot_general(kh, q, _NT, preferred_element_type=f32) * scale, allowed_t, axis=0
            )
            probs = weights / total
            dprobs = lax.dot_general(v, doh, _NT, preferred_element_type=f32)
            dlogits = probs * (dprobs - jnp.sum(probs * dprobs, axis=0, keepdims=True))
            dlogits = jnp.where(allowed_t, dlogits * scale, 0.0)
            dv = jnp.dot(probs.astype(do.dtype), doh, preferred_element_type=f32)
            dk = jnp.dot(dlogits.astype(q.dtype), qh, preferred_element_type=f32)
            # Summed at the key/value head's lanes of its tile (where they are without groups).
            at, lanes = group * width - tile[0], tile[1] - tile[0]
            sums[tile] = tuple(
                total + _placed(x, start, head, width, at, lanes)
                for total, x in zip(sums.get(tile, (0.0, 0.0)), (dk, dv), strict=True)
            )
        dq_ref[0, :, start:end] = dq.astype(dq_ref.dtype)
        for (first, last), reader in last_reader.items():
            if reader == n:  # this key/value tile's last query heads are done
                dk, dv = sums.pop((first, last))
                dk_ref[0, :, first:last] = dk.astype(dk_ref.dtype)
                dv_ref[0, :, first:last] = dv.astype(dv_ref.dtype)


def _vmem_bytes(
    length: int, source: int, lanes: int, kv_lanes: int, itemsize: int
) -> int:  # fmt: skip
    """One backward grid step's VMEM, the larger of the two kernels: its blocks double-buffered
    (q, dO, dQ of [T, lanes]; k, v, dK, dV of [S, kv_lanes]), one tile's float32 gradients, with
    grouped heads a tile's k and v placed at a query head's lanes and its float32 dK and dV
    contributions, and a head's float32 [T, S] arrays (about eight live at once)."""
    blocks = 2 * itemsize * (3 * length * lanes + 4 * source * kv_lanes)
    tile = 4 * LANES * (length + 2 * source)
    if kv_lanes != lanes:
        tile += LANES * source * (2 * itemsize + 2 * 4)
    return blocks + tile + 8 * 4 * length * source


def heads_per_block(
    heads: int, groups: int, width: int, length: int, source: int, itemsize: int
) -> int:  # fmt: skip
    """The most query heads one grid step holds: a divisor of `heads` made of whole groups of
    r = heads / groups (a key/value head's gradients are summed in one step), whose key/value
    lanes are a multiple of 128 (or all heads), within `VMEM_BUDGET`. Raises ValueError when no
    block fits."""
    repeat = heads // groups
    fits = [
        n
        for n in range(heads, 0, -repeat)
        if heads % n == 0
        and (n == heads or n // repeat * width % LANES == 0)
        and _vmem_bytes(length, source, n * width, n // repeat * width, itemsize) <= VMEM_BUDGET
    ]
    if not fits:
        smallest = min(heads * width, repeat * LANES), min(groups * width, LANES)
        raise ValueError(
            f"attention_impl='inplace' holds whole rows in VMEM: queries of {length} and keys of "
            f"{source} over {heads} heads ({groups} key/value heads) of {width} need about "
            f"{_vmem_bytes(length, source, *smallest, itemsize) / 2**20:.1f} MiB "
            f"per step, over its {VMEM_BUDGET / 2**20:.0f} MiB: use attention_impl='splash'"
        )
    return fits[0]


def _calls(
    heads: int, groups: int, width: int, length: int, source: int, dtype, causal: bool,
    scale: float,
):  # fmt: skip
    """The forward and backward `pallas_call`s for these shapes (rows are their grid's first
    axis, blocks of heads its second: query block j reads key/value block j)."""
    per_block = heads_per_block(heads, groups, width, length, source, jnp.dtype(dtype).itemsize)
    lanes, kv_lanes = per_block * width, per_block // (heads // groups) * width
    blocks = heads // per_block
    interpret = flash.interpreting()
    params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))
    statics = dict(
        heads=per_block, groups=kv_lanes // width, width=width, causal=causal, scale=scale
    )

    def spec(n, lanes):
        return pl.BlockSpec((1, n, lanes), lambda r, j: (r, 0, j))

    rows = pl.BlockSpec((1, 1, source), lambda r, j: (r, 0, 0))
    cols = pl.BlockSpec((1, source, 1), lambda r, j: (r, 0, 0))
    queries, keys = spec(length, lanes), spec(source, kv_lanes)

    def forward(mask, q, k, v):
        return pl.pallas_call(
            functools.partial(_forward_kernel, **statics),
            grid=(q.shape[0], blocks),
            in_specs=[rows, queries, keys, keys],
            out_specs=queries,
            out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
            compiler_params=params,
            interpret=interpret,
            name="inplace_attention_forward",
        )(mask, q, k, v)

    def backward(mask, q, k, v, do):
        return pl.pallas_call(
            functools.partial(_backward_kernel, **statics),
            grid=(q.shape[0], blocks),
            in_specs=[rows, cols, queries, keys, keys, queries],
            out_specs=[queries, keys, keys],
            out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)],
            compiler_params=params,
            interpret=interpret,
            name="inplace_attention_backward",
        )(mask, mask.reshape(mask.shape[0], source, 1), q, k, v, do)

    return forward, backward


def _shapes(query, key, heads):
    """`_calls`' shape arguments: heads, key/value heads, head width, lengths, dtype."""
    width = query.shape[2] // heads
    return heads, key.shape[2] // width, width, query.shape[1], key.shape[1], query.dtype


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attend(query, key, value, mask, heads, causal, scale):
    forward, _ = _calls(*_shapes(query, key, heads), causal, scale)
    return forward(mask, query, key, value)


def _attend_forward(query, key, value, mask, heads, causal, scale):
    return _attend(query, key, value, mask, heads, causal, scale), (query, key, value, mask)


def _attend_backward(heads, causal, scale, saved, d_out):
    query, key, value, mask = saved
    _, backward = _calls(*_shapes(query, key, heads), causal, scale)
    dq, dk, dv = backward(mask, query, key, value, d_out.astype(query.dtype))
    return dq, dk, dv, None


_attend.defvjp(_attend_forward, _attend_backward)


def attention(
    query: jax.Array, key: jax.Array, value: jax.Array, key_mask: jax.Array, heads: int,
    causal: bool, scale: float = 1.0,
) -> jax.Array:  # fmt: skip
    """softmax(scale query key^T, masked) value of every head, in the projections' layout.

    Args:
      query: [R, T, H] (H = heads * d): the query projection's output as it is (the kernels
        scale the float32 logits, so no scaled copy of the queries is written).
      key: [R, S, G] with G = g * d: g key/value heads, each read by heads / g query heads
        (g = heads: plain multi-head attention).
      value: [R, S, G].
      key_mask: [R, S] bool or int, True / 1 = a real key.
      heads: h, the query heads.
      causal: query t reads only keys s <= t (T = S).
      scale: the logits' scale (d^-0.5 for the models' attention).

    Returns:
      [R, T, H] in the query's dtype.
    """
    rows, length, lanes = query.shape
    if (
        query.ndim != 3
        or key.ndim != 3
        or key.shape != value.shape
        or key.shape[0] != rows
        or lanes % heads
        or key.shape[2] % (lanes // heads)
        or heads % (key.shape[2] // (lanes // heads))
    ):
        raise ValueError(
            f"query {query.shape}, key {key.shape} and value {value.shape} must be [R, T, h * d], "
            f"[R, S, g * d], [R, S, g * d] with h = {heads} and g dividing h"
        )
    source = key.shape[1]
    if key_mask.shape != (rows, source):
        raise ValueError(f"key_mask {key_mask.shape} must be [R, S] for key {key.shape}")
    if causal and length != source:
        raise ValueError(f"causal attention needs T = S, got query {query.shape}, key {key.shape}")
    width = lanes // heads
    groups = key.shape[2] // width
    key = key.astype(query.dtype)
    value = value.astype(query.dtype)
    # Refused here, by name.
    heads_per_block(heads, groups, width, length, source, query.dtype.itemsize)
    mask = key_mask.astype(jnp.int32).reshape(rows, 1, source)
    run = functools.partial(_attend, heads=heads, causal=causal, scale=float(scale))
    return flash.on_rows("inplace", run, query, key, value, mask)
