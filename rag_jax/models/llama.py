"""Llama-family decoder-only LM: a causal RAG generator (SmolLM2, Llama 2/3 shapes).

Pre-RMSNorm layers, rotary position embeddings (θ and Llama 3's frequency scaling), grouped-query
attention (h query heads read g = h / r key/value heads), a SwiGLU feed-forward, and a tied or
untied LM head. The parameter tree follows HF's `LlamaForCausalLM` names, so `hf.load_llama` maps
one onto the other name for name.

Rows may be left-padded: positions come from the attention mask (`positions_from_mask`), so a
padded row scores as the same row unpadded. Incremental decoding reads two caches:

- a *prefix* (`Prefix`): the keys and values of prompts, computed once and shared by groups of
  query rows (the K beams of a prompt, or the M candidate answers rescored against it), laid out
  `[G, m, g, P, d]`: query row `G_i * k * m + j * m + i` reads prefix row `(G_i, i)`, the layout
  `bart.Bart.decode` uses for shared encoder outputs;
- a *past* (`Past`): each row's own generated keys and values `[R, g, L, d]`, written at
  `past_index` and reordered with the beams.

Attention over the two is one softmax, computed blockwise (each block's maximum and sum, then
combined), so neither cache is ever copied per beam.

Legend: R query rows, T tokens per row, P prefix length, L past length, H hidden, h query heads,
g key/value heads, r = h / g, d head width, F feed-forward width, V vocab, G, m prefix groups.
"""

import dataclasses
import functools
import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from rag_jax.models import flash, inplace, layers, remat, splash

# rope_scaling kinds computed here; any other is refused by name.
ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hyperparameters of a Llama-architecture decoder (field names follow HF's `LlamaConfig`)."""

    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    # (("rope_type", "llama3"), ("factor", 32.0), ...) as sorted items (hashable); None: default.
    rope_scaling: tuple | None = None
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    init_std: float = 0.02
    bos_token_id: int | None = 1
    eos_token_id: int = 2
    pad_token_id: int = 2
    # No gradient flows into the first k layers nor the input embedding below them: a generator
    # trained only in its top layers skips the backward pass of the bottom ones.
    frozen_layers: int = 0
    # Compute and parameter dtypes ("float32" or "bfloat16"); logits are float32.
    dtype: str = "float32"
    param_dtype: str = "float32"
    # Recompute each layer's activations in the backward pass instead of storing them.
    remat: bool = False
    # What a rematerialised layer keeps (`models.remat`): full | attention | projections |
    # attention_and_projections | dots; read only with `remat`.
    remat_policy: str = "full"
    # Attention: "xla" | "flash" | "splash" | "inplace" (Pallas TPU kernels, `models.flash`,
    # `models.splash`, `models.inplace`, for rows attending to themselves alone: teacher forcing
    # and prompts; with a prefix or a past it stays on XLA).
    attention_impl: str = "xla"

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        flash.check_impl(self.attention_impl)
        remat.check_policy(self.remat_policy)
        if not 0 <= self.frozen_layers <= self.num_hidden_layers:
            raise ValueError(
                f"frozen_layers {self.frozen_layers} must lie in [0, num_hidden_layers = "
                f"{self.num_hidden_layers}]"
            )
        rope_type = dict(self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_scaling rope_type {rope_type!r} is not supported; supported: {ROPE_TYPES}"
            )

    @property
    def head_width(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    # The generator-side names the RAG code reads from either generator kind.
    @property
    def max_length(self) -> int:
        return self.max_position_embeddings

    def replace(self, **changes) -> "LlamaConfig":
        return dataclasses.replace(self, **changes)


def rope_frequencies(cfg: LlamaConfig) -> np.ndarray:
    """[d / 2] float32 inverse frequencies, HF's `ROPE_INIT_FUNCTIONS` for the supported kinds."""
    dim = cfg.head_width
    inv_freq = 1.0 / (
        cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)
    )
    scaling = dict(cfg.rope_scaling or {})
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_context = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_context / low, old_context / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """HF's `apply_rotary_pos_emb` on [R, T, heads, d] with cos/sin [R, T, 1, d]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def positions_from_mask(attention_mask: jax.Array, start: jax.Array | int = 0) -> jax.Array:
    """[R, T] positions of left- (or right-) padded rows: the count of real tokens before each
    one, plus `start` (HF's `cumsum - 1`; padding positions get 0 + start)."""
    mask = attention_mask.astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0) + start


class Prefix(NamedTuple):
    """Prompt keys and values shared by groups of query rows (see the module docstring)."""

    keys: tuple  # per layer [G, m, g, P, d], rotated
    values: tuple  # per layer [G, m, g, P, d]
    mask: jax.Array  # [G, m, P] bool, True = a real prompt token


class Past(NamedTuple):
    """Each row's own cached keys and values (generated tokens)."""

    keys: tuple  # per layer [R, g, L, d], rotated
    values: tuple  # per layer [R, g, L, d]


def _block(query, key, value, mask):
    """One key block of a softmax: (unnormalised output, row maximum, row sum).

    query [.., Q, d] (pre-scaled), key/value [.., S, d], mask bool broadcastable to [.., Q, S].
    Masked keys get weight 0 exactly; a fully masked row returns sum 0 and a maximum of
    MASK_VALUE, which the combination in `_attend` then weighs by exp(MASK_VALUE - max) = 0.
    """
    logits = jnp.einsum(
        "...qd,...sd->...qs",
        query,
        key,
        preferred_element_type=layers.accumulation_dtype(query.dtype),
    )
    logits = jnp.where(mask, logits, layers.MASK_VALUE)
    peak = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    weights = jnp.where(mask, jnp.exp(logits - peak), 0.0)
    out = jnp.einsum(
        "...qs,...sd->...qd",
        weights.astype(value.dtype),
        value,
        preferred_element_type=layers.accumulation_dtype(value.dtype),
    )
    return out, peak, jnp.sum(weights, axis=-1, keepdims=True)


def _attend(query, own, prefix):
    """Grouped-query attention of `query` [R, T, h, d] over a row's own keys and a shared prefix.

    Args:
      query: [R, T, h, d], rotated, and scaled but for "inplace" (whose kernels scale logits).
      own: (keys [R, g, S, d], values [R, g, S, d], mask bool broadcastable to [R, 1, 1, T, S]).
      prefix: None, or (keys [G, m, g, P, d], values, mask [G, m, P]).

    Returns:
      [R, T, h * d].
    """
    rows, length, heads, width = query.shape
    key, value, mask = own
    groups = key.shape[1]
    q = query.reshape(rows, length, groups, heads // groups, width)
    q = q.transpose(0, 2, 3, 1, 4)  # -> [R, g, r, T, d]
    out, peak, total = _block(q, key[:, :, None], value[:, :, None], mask)
    if prefix is not None:
        p_key, p_value, p_mask = prefix
        outer, inner = p_key.shape[:2]
        k = rows // (outer * inner)
        if k * outer * inner != rows:
            raise ValueError(
                f"query rows {rows} are not a multiple of the prefix rows {p_key.shape[:2]}"
            )
        # Row (o, j, i) of the queries reads prefix row (o, i): the k rows of a group become extra
        # query positions of one matmul per prefix row.
        pq = q.reshape(outer, k, inner, groups, heads // groups, length, width)
        pq = pq.transpose(0, 2, 3, 1, 4, 5, 6)  # -> [G, m, g, k, r, T, d]
        pq = pq.reshape(outer, inner, groups, -1, width)  # -> [G, m, g, k * r * T, d]
        p_out, p_peak, p_total = _block(pq, p_key, p_value, p_mask[:, :, None, None, :])

        def as_rows(y):  # [G, m, g, k * r * T, e] -> [R, g, r, T, e]
            y = y.reshape(outer, inner, groups, k, heads // groups, length, y.shape[-1])
            return y.transpose(0, 3, 1, 2, 4, 5, 6).reshape(
                rows, groups, heads // groups, length, -1
            )

        p_out, p_peak, p_total = as_rows(p_out), as_rows(p_peak), as_rows(p_total)
        top = jnp.maximum(peak, p_peak)
        own_w, pre_w = jnp.exp(peak - top), jnp.exp(p_peak - top)
        out = out * own_w + p_out * pre_w
        total = total * own_w + p_total * pre_w
    out = out / total  # -> [R, g, r, T, d]
    return out.transpose(0, 3, 1, 2, 4).reshape(rows, length, heads * width)


def _fused(query, key, value, key_mask, impl):
    """Causal grouped-query attention of rows over their own keys in a kernel (`impl`: "flash",
    `models.flash`, which reads the key/value heads repeated for each query head; "splash",
    `models.splash`, which reads the g heads as they are; "inplace", `models.inplace`, which
    reads the queries as [R, T, h * d] and the g key/value heads as they are, [R, T, g * d]).

    Args:
      query: [R, T, h, d], rotated, and scaled but for "inplace" (whose kernels scale logits).
      key, value: [R, g, T, d]; each key/value head is read by its r = h / g query heads.
      key_mask: [R, T] bool, True = a real token.

    Returns:
      [R, T, h * d]. A real token's output is the XLA path's; a padding token's is not (the
      kernel lets it read the real keys before it, the XLA path only itself), and is ignored.
    """
    rows, length, heads, width = query.shape
    if impl == "inplace":  # [R, T, h * d] as it is; the keys and values back to [R, T, g * d]
        key, value = (y.transpose(0, 2, 1, 3).reshape(rows, length, -1) for y in (key, value))
        query = query.reshape(rows, length, heads * width)
        return inplace.attention(query, key, value, key_mask, heads, True, width**-0.5)
    if impl == "splash":
        out = splash.attention(query.transpose(0, 2, 1, 3), key, value, key_mask, causal=True)
        return out.transpose(0, 2, 1, 3).reshape(rows, length, heads * width)
    repeat = heads // key.shape[1]
    key, value = jnp.repeat(key, repeat, axis=1), jnp.repeat(value, repeat, axis=1)  # [R, h, T, d]
    out = flash.attention(query.transpose(0, 2, 1, 3), key, value, key_mask, causal=True)
    return out.transpose(0, 2, 1, 3).reshape(rows, length, heads * width)


class RMSNorm(nn.Module):
    """HF's `LlamaRMSNorm`: normalised in float32, cast back, then scaled."""

    eps: float
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        y = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + self.eps)
        return scale.astype(self.dtype) * y.astype(self.dtype)


def _dense(features: int, bias: bool, cfg: LlamaConfig, name: str) -> nn.Dense:
    return nn.Dense(
        features,
        use_bias=bias,
        dtype=jnp.dtype(cfg.dtype),
        param_dtype=jnp.dtype(cfg.param_dtype),
        kernel_init=nn.initializers.normal(cfg.init_std),
        name=name,
    )


class DecoderLayer(nn.Module):
    """x += Attn(RMSNorm(x)); x += SwiGLU(RMSNorm(x))."""

    config: LlamaConfig

    @nn.compact
    def __call__(self, x, cos, sin, own_mask, prefix, past, past_index):
        """One layer.

        Args:
          x: [R, T, H].
          cos, sin: [R, T, 1, d] rotary tables of the T tokens' positions.
          own_mask: bool broadcastable to [R, 1, 1, T, S]: which of the row's own keys each
            token sees (S = T without a past, L with one); with `attention_impl` a kernel, no
            prefix and no past, the key padding [R, T] (the kernel applies causality).
          prefix: None or this layer's (keys, values, mask) of the shared prefix.
          past: None or this layer's (keys [R, g, L, d], values); the T new keys and values are
            written at `past_index` before attending.
          past_index: [] int32, where the T tokens go in the past.

        Returns:
          (x [R, T, H], (keys [R, g, T or L, d], values)) the layer's own keys and values (the
          updated past when one is given).
        """
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        heads, groups, width = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_width
        norm = functools.partial(
            RMSNorm, cfg.rms_norm_eps, dtype=dtype, param_dtype=jnp.dtype(cfg.param_dtype)
        )
        rows, length = x.shape[:2]

        y = norm(name="input_layernorm")(x)
        attn = "self_attn"
        # The remat names mark the [.., H] projections (no head axis of width d padded to the
        # TPU's 128 lanes when a policy keeps them).
        query = _dense(heads * width, cfg.attention_bias, cfg, f"{attn}_q_proj")(y)
        key = _dense(groups * width, cfg.attention_bias, cfg, f"{attn}_k_proj")(y)
        value = _dense(groups * width, cfg.attention_bias, cfg, f"{attn}_v_proj")(y)
        query, key = remat.name(query, remat.QUERY), remat.name(key, remat.KEY)
        value = remat.name(value, remat.VALUE)
        query = _rotate(query.reshape(rows, length, heads, width), cos, sin)
        fused = cfg.attention_impl in flash.KERNELS and prefix is None and past is None
        if not (fused and cfg.attention_impl == "inplace"):  # that kernel scales its logits
            query = query * jnp.asarray(width**-0.5, dtype)
        key = _rotate(key.reshape(rows, length, groups, width), cos, sin).transpose(0, 2, 1, 3)
        value = value.reshape(rows, length, groups, width).transpose(0, 2, 1, 3)  # [R, g, T, d]
        if past is not None:
            zero = jnp.zeros((), jnp.int32)
            start = (zero, zero, past_index, zero)
            key = jax.lax.dynamic_update_slice(past[0], key.astype(past[0].dtype), start)
            value = jax.lax.dynamic_update_slice(past[1], value.astype(past[1].dtype), start)
        # Named scopes put the attention core and the gating in op names ("self_attn", "mlp"), as
        # the projections are (profiles; benchmarks/hlo.py attributes HBM traffic by them).
        with jax.named_scope(attn):
            if fused:
                out = _fused(query, key, value, own_mask, cfg.attention_impl).astype(dtype)
            else:
                out = _attend(query, (key, value, own_mask), prefix).astype(dtype)
        if not (fused and cfg.attention_impl == "splash"):  # splash names its own output
            out = remat.name(out, remat.ATTENTION)
        out = _dense(cfg.hidden_size, cfg.attention_bias, cfg, f"{attn}_o_proj")(out)
        x = x + remat.name(out, remat.ATTENTION_PROJECTION)

        y = norm(name="post_attention_layernorm")(x)
        gate = _dense(cfg.intermediate_size, cfg.mlp_bias, cfg, "mlp_gate_proj")(y)
        up = _dense(cfg.intermediate_size, cfg.mlp_bias, cfg, "mlp_up_proj")(y)
        with jax.named_scope("mlp"):
            y = layers.activation(cfg.hidden_act)(gate) * up
        y = _dense(cfg.hidden_size, cfg.mlp_bias, cfg, "mlp_down_proj")(y)
        return x + remat.name(y, remat.FFN_OUTPUT), (key, value)


class _Head(nn.Module):
    """The untied LM head `x @ kernel` [H, V], accumulated in float32 under bfloat16."""

    vocab_size: int
    init_std: float
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param(
            "kernel",
            nn.initializers.normal(self.init_std),
            (x.shape[-1], self.vocab_size),
            self.param_dtype,
        )
        out = layers.accumulation_dtype(x.dtype)
        return jnp.einsum("...h,hv->...v", x, kernel.astype(x.dtype), preferred_element_type=out)


class Llama(nn.Module):
    """`LlamaForCausalLM`: embeddings, decoder layers, final norm, LM head."""

    config: LlamaConfig

    def setup(self):
        cfg = self.config
        self.embed_tokens = nn.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=jnp.dtype(cfg.dtype),
            param_dtype=jnp.dtype(cfg.param_dtype),
            embedding_init=nn.initializers.normal(cfg.init_std),
        )
        layer = DecoderLayer
        if cfg.remat:
            policy = remat.checkpoint_policy(cfg.remat_policy)
            layer = (
                nn.remat(DecoderLayer) if policy is None else nn.remat(DecoderLayer, policy=policy)
            )
        self.layers = [layer(cfg, name=f"layers_{i}") for i in range(cfg.num_hidden_layers)]
        self.norm = RMSNorm(
            cfg.rms_norm_eps, dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype)
        )
        if not cfg.tie_word_embeddings:
            self.lm_head = _Head(cfg.vocab_size, cfg.init_std, jnp.dtype(cfg.param_dtype))

    def hidden(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array,
        positions: jax.Array,
        prefix: Prefix | None = None,
        past: Past | None = None,
        past_index: jax.Array | int = 0,
        first_layer: int = 0,
    ) -> tuple[jax.Array, Past]:
        """The final-norm hidden states of `input_ids` and each layer's keys and values.

        Without a past, each token sees the row's earlier real tokens (causal and key padding,
        plus itself, so a padding row is never fully masked) and the prefix. With a past, the T
        tokens are written at `past_index` and see the past slots before them and themselves.
        With `attention_impl` "flash" or "splash", no prefix and no past, the kernel computes it
        (a padding token then reads the real tokens before it instead of itself: its output
        differs, and is ignored).

        Args:
          input_ids: [R, T] int; or, with `first_layer` > 0, [R, T, H] the states layer
            `first_layer - 1` outputs (`trunk`): the embeddings and the layers below are not
            run. A real token's states do not depend on the padding around it, so states
            computed for the row alone serve it padded.
          attention_mask: [R, T] 1 = real token (key padding of these tokens).
          positions: [R, T] int rotary positions.
          prefix: shared prompt keys/values, or None (only with `first_layer` 0).
          past: the rows' cached keys/values, or None (only with `first_layer` 0).
          past_index: [] int, the past slot of the first of the T tokens.
          first_layer: the first layer run; 0 runs the whole decoder from token ids.

        Returns:
          hidden: [R, T, H] in the compute dtype.
          kv: `Past` of the layers' own keys and values ([R, g, T, d] each without a past, the
            updated past with one), of the layers run (from `first_layer`).
        """
        cfg = self.config
        if not 0 <= first_layer <= cfg.num_hidden_layers:
            raise ValueError(
                f"first_layer {first_layer} must be in [0, {cfg.num_hidden_layers}] (the layers)"
            )
        if first_layer and (prefix is not None or past is not None):
            raise ValueError("a prefix or a past needs every layer's keys (first_layer 0)")
        x, kv = self._layers(
            input_ids, attention_mask, positions, prefix, past, past_index, first_layer
        )
        return self.norm(x), kv

    def trunk(
        self, input_ids: jax.Array, attention_mask: jax.Array, positions: jax.Array, layers: int
    ) -> jax.Array:
        """The states layer `layers` - 1 outputs, before the final norm (what `hidden(...,
        first_layer=layers)` reads in its place): the embedding and layers 0 .. `layers` - 1 run.

        Args:
          input_ids: [R, T] int.
          attention_mask: [R, T] 1 = real token.
          positions: [R, T] int rotary positions.
          layers: F, in [0, num_hidden_layers].

        Returns:
          [R, T, H] in the compute dtype.
        """
        if not 0 <= layers <= self.config.num_hidden_layers:
            raise ValueError(
                f"layers {layers} must be in [0, {self.config.num_hidden_layers}] (the layers)"
            )
        return self._layers(input_ids, attention_mask, positions, None, None, 0, 0, layers)[0]

    def _layers(
        self, inputs, attention_mask, positions, prefix, past, past_index, first, stop=None
    ) -> tuple[jax.Array, Past]:
        """Layers `first` .. `stop` - 1 (default: the last) on token ids (`first` 0) or on the
        states layer `first` - 1 output: (x [R, T, H] before the final norm, their `Past`)."""
        cfg = self.config
        stop = cfg.num_hidden_layers if stop is None else stop
        wanted = (2, "[R, T] token ids") if first == 0 else (3, "[R, T, H] states")
        if inputs.ndim != wanted[0] or attention_mask.shape != inputs.shape[:2]:
            raise ValueError(
                f"input_ids {inputs.shape} must be {wanted[1]} and attention_mask "
                f"{attention_mask.shape} [R, T]"
            )
        if first and inputs.shape[2] != cfg.hidden_size:
            raise ValueError(
                f"states {inputs.shape} must be [R, T, H] with H = hidden_size {cfg.hidden_size}"
            )
        length = attention_mask.shape[1]
        angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_frequencies(cfg))
        angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # -> [R, T, 1, d]
        dtype = jnp.dtype(cfg.dtype)
        cos, sin = jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)
        query_pos = jnp.arange(length)
        if cfg.attention_impl in flash.KERNELS and prefix is None and past is None:
            own_mask = attention_mask.astype(bool)  # key padding; causality is the kernel's
        elif past is None:
            keys = attention_mask.astype(bool)[:, None, None, None, :]  # [R, 1, 1, 1, T]
            causal = query_pos[None, :] <= query_pos[:, None]  # [T, T]
            own_mask = (keys & causal) | jnp.eye(length, dtype=bool)
        else:
            slots = jnp.arange(past.keys[0].shape[2])
            own_mask = slots[None, :] <= past_index + query_pos[:, None]  # -> [T, L]
        # Cached states enter in the compute dtype (float32 storage of bfloat16 states is exact).
        x = self.embed_tokens(inputs) if first == 0 else inputs.astype(dtype)
        kv_keys, kv_values = [], []
        for i in range(first, stop):
            x, (k, v) = self.layers[i](
                x,
                cos,
                sin,
                own_mask,
                None if prefix is None else (prefix.keys[i], prefix.values[i], prefix.mask),
                None if past is None else (past.keys[i], past.values[i]),
                jnp.asarray(past_index, jnp.int32),
            )
            kv_keys.append(k)
            kv_values.append(v)
            if i + 1 == cfg.frozen_layers:
                x = jax.lax.stop_gradient(x)  # the layers below are constants of the loss
        return x, Past(tuple(kv_keys), tuple(kv_values))

    def head(self, x: jax.Array) -> jax.Array:
        """[..., H] -> [..., V] float32 logits (accumulated in float32 under bfloat16)."""
        if not self.config.tie_word_embeddings:
            return self.lm_head(x)
        table = self.embed_tokens.embedding.astype(x.dtype)
        out = layers.accumulation_dtype(x.dtype)
        return jnp.einsum("...h,vh->...v", x, table, preferred_element_type=out)

    def __call__(self, input_ids, attention_mask, positions=None):
        """Teacher-forced logits [R, T, V] float32 (positions from the mask by default)."""
        if positions is None:
            positions = positions_from_mask(attention_mask)
        x, _ = self.hidden(input_ids, attention_mask, positions)
        return self.head(x)


def init_params(cfg: LlamaConfig, rng: jax.Array) -> dict:
    """Random parameters (normal(init_std) matrices, unit norms)."""
    ids = jnp.zeros((1, 2), jnp.int32)
    return Llama(cfg).init(rng, ids, jnp.ones_like(ids))["params"]


@functools.cache
def param_shapes(cfg: LlamaConfig):
    """Shapes of the parameter tree (no allocation), for converters and memory plans."""
    ids = jnp.zeros((1, 2), jnp.int32)
    return jax.eval_shape(lambda: Llama(cfg).init(jax.random.PRNGKey(0), ids, ids + 1)["params"])


@functools.partial(jax.jit, static_argnums=0)
def _logits_jit(cfg, params, input_ids, attention_mask):
    return Llama(cfg).apply({"params": params}, input_ids, attention_mask)


def logits(
    cfg: LlamaConfig, params: dict, input_ids: jax.Array, attention_mask: jax.Array | None = None
) -> jax.Array:
    """Teacher-forced logits of (left- or right-padded) rows, jitted and cached inside.

    Args:
      cfg: the model's config.
      params: its parameters (`hf.load_llama`, `init_params`).
      input_ids: [R, T] int token ids.
      attention_mask: [R, T] 1 = real token; None: all real. Positions count real tokens, so a
        left-padded row gets the logits of the same row unpadded.

    Returns:
      [R, T, V] float32 (the values at padding positions are meaningless).
    """
    input_ids = jnp.asarray(input_ids, jnp.int32)
    if attention_mask is None:
        attention_mask = jnp.ones_like(input_ids)
    if input_ids.ndim != 2 or jnp.shape(attention_mask) != input_ids.shape:
        raise ValueError(
            f"input_ids {input_ids.shape} and attention_mask {jnp.shape(attention_mask)} must "
            "both be [R, T]"
        )
    if input_ids.shape[1] > cfg.max_position_embeddings:
        raise ValueError(
            f"input_ids of length {input_ids.shape[1]} exceed the model's "
            f"max_position_embeddings={cfg.max_position_embeddings}"
        )
    return _logits_jit(cfg, params, input_ids, jnp.asarray(attention_mask, jnp.int32))
