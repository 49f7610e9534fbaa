"""Transformer pieces shared by the BERT and BART modules.

Both models are post-LayerNorm transformers with biased projections, so one attention module (with
an optional decode cache), one MLP and one encoder layer serve both; the models differ only in their
embeddings and heads.

Legend: B batch, S source (key) length, T target (query) length, H hidden width, h heads,
d head width (H = h * d), F feed-forward width.
"""

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

# Large negative logit for masked attention positions; finite so that a fully masked row gives a
# uniform (not NaN) distribution, as in the PyTorch reference.
MASK_VALUE = jnp.finfo(jnp.float32).min

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": functools.partial(jax.nn.gelu, approximate=False),  # exact erf GELU (BERT, BART)
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "tanh": jnp.tanh,
}


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
    """Returns the activation function called `name` in HF configs (`hidden_act`)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def dense(features: int, init_std: float, dtype, param_dtype, name: str) -> nn.Dense:
    """A biased dense layer initialised like the PyTorch models (normal(init_std), zero bias)."""
    return nn.Dense(
        features,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=nn.initializers.normal(init_std),
        name=name,
    )


def padding_mask(query_mask: jax.Array | None, key_mask: jax.Array) -> jax.Array:
    """Boolean attention mask from padding masks.

    Args:
      query_mask: [B, T] (1 = real token) or None (all queries real; padded queries attend anyway).
      key_mask: [B, S] 1 = real token, 0 = padding.

    Returns:
      [B, 1, T or 1, S] bool, True where attention is allowed.
    """
    del query_mask  # Padded queries still attend (their outputs are ignored), as in the reference.
    return key_mask.astype(bool)[:, None, None, :]


def causal_mask(length: int) -> jax.Array:
    """[1, 1, T, T] bool lower-triangular mask."""
    return jnp.tril(jnp.ones((length, length), dtype=bool))[None, None]


class Attention(nn.Module):
    """Multi-head attention with biased q/k/v/out projections (BERT and BART layout).

    With `decode=True`, keys and values are kept in the `cache` collection:
    - self-attention (`cross=False`): a [B, L, h, d] buffer filled one chunk per call, L fixed by
      the query length of the call that creates the cache;
    - cross-attention (`cross=True`): the projected encoder keys and values, computed once when the
      cache is created and reused at every step (the encoder output is then ignored).
    Create the cache by calling the model once with `decode=True` and `mutable=["cache"]` on an
    input of the full decode length; that first call does not write to it.
    """

    num_heads: int
    hidden: int
    init_std: float
    dropout_rate: float = 0.0
    cross: bool = False
    decode: bool = False
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        kv: jax.Array | None,
        mask: jax.Array | None,
        deterministic: bool = True,
    ) -> jax.Array:
        """Attends from `x` to `kv` (self-attention when `kv` is None).

        Args:
          x: [B, T, H] queries' input.
          kv: [B, S, H] keys' and values' input, or None for self-attention.
          mask: bool, broadcastable to [B, h, T, S]; True = allowed. In self-attention decode mode
            it is ignored: the cache applies causal masking by position.
          deterministic: disables dropout.

        Returns:
          [B, T, H] in `dtype`.
        """
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.num_heads}")
        head_dim = self.hidden // self.num_heads
        proj = functools.partial(dense, self.hidden, self.init_std, self.dtype, self.param_dtype)
        batch, length = x.shape[:2]
        split = lambda y: y.reshape(y.shape[0], y.shape[1], self.num_heads, head_dim)  # noqa: E731

        query = split(proj("query")(x))  # -> [B, T, h, d]
        if self.cross and self.decode:
            key, value = self._cross_cache(kv, proj)
        else:
            source = x if kv is None else kv
            key = split(proj("key")(source))  # -> [B, S, h, d]
            value = split(proj("value")(source))
            if self.decode:
                key, value, mask = self._self_cache(key, value, batch, length)

        # Head-major batched matmuls: on CPU this layout runs about twice as fast as the
        # equivalent einsum over [B, T, h, d] (measured at B=32, S=256 in the encode benchmark).
        query = query.transpose(0, 2, 1, 3)  # -> [B, h, T, d]
        key = key.transpose(0, 2, 3, 1)  # -> [B, h, d, S]
        value = value.transpose(0, 2, 1, 3)  # -> [B, h, S, d]
        # Logits accumulate in float32 even under bfloat16 compute; softmax runs in float32.
        logits = jnp.matmul(query, key, preferred_element_type=jnp.float32)  # -> [B, h, T, S]
        logits = logits * (head_dim**-0.5)
        if mask is not None:
            logits = jnp.where(mask, logits, MASK_VALUE)
        probs = jax.nn.softmax(logits, axis=-1).astype(self.dtype)
        if not deterministic and self.dropout_rate > 0.0:
            probs = nn.Dropout(self.dropout_rate)(probs, deterministic=False)
        out = jnp.matmul(probs, value)  # -> [B, h, T, d]
        out = out.transpose(0, 2, 1, 3).reshape(batch, length, self.hidden)  # -> [B, T, H]
        return proj("out")(out)

    def _cross_cache(self, kv, proj):
        """Projected encoder keys/values: computed when the cache is created, then reused."""
        head_dim = self.hidden // self.num_heads

        def project(name):
            y = proj(name)(kv)
            return y.reshape(y.shape[0], y.shape[1], self.num_heads, head_dim)

        if self.has_variable("cache", "cross_key"):
            return self.get_variable("cache", "cross_key"), self.get_variable(
                "cache", "cross_value"
            )
        if kv is None:
            raise ValueError("cross-attention cache is not initialised and no encoder output given")
        key, value = project("key"), project("value")
        self.variable("cache", "cross_key", lambda: key)
        self.variable("cache", "cross_value", lambda: value)
        return key, value

    def _self_cache(self, key, value, batch, length):
        """Writes this call's keys/values at the cache index; returns the whole cache + mask."""
        initialised = self.has_variable("cache", "cached_key")
        cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
        index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        if not initialised:
            # The creating call sizes the cache and runs as plain causal self-attention.
            return key, value, causal_mask(length)
        max_length = cached_key.value.shape[1]
        start = index.value
        zero = jnp.array(0, jnp.int32)
        cached_key.value = jax.lax.dynamic_update_slice(
            cached_key.value, key.astype(cached_key.value.dtype), (zero, start, zero, zero)
        )
        cached_value.value = jax.lax.dynamic_update_slice(
            cached_value.value, value.astype(cached_value.value.dtype), (zero, start, zero, zero)
        )
        index.value = start + length
        # Query t (absolute position start + t) sees cached keys at positions <= start + t.
        query_pos = start + jnp.arange(length)
        mask = jnp.arange(max_length)[None, :] <= query_pos[:, None]  # -> [T, L]
        return cached_key.value, cached_value.value, mask[None, None]


class Mlp(nn.Module):
    """Position-wise feed-forward: wo(dropout(act(wi(x))))."""

    hidden: int
    intermediate: int
    act: str
    init_std: float
    activation_dropout: float = 0.0
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
        """[B, T, H] -> [B, T, H]."""
        y = dense(self.intermediate, self.init_std, self.dtype, self.param_dtype, "wi")(x)
        y = activation(self.act)(y)
        if not deterministic and self.activation_dropout > 0.0:
            y = nn.Dropout(self.activation_dropout)(y, deterministic=False)
        return dense(self.hidden, self.init_std, self.dtype, self.param_dtype, "wo")(y)


class TransformerLayer(nn.Module):
    """Post-LN layer: x = LN(x + SelfAttn(x)); [x = LN(x + CrossAttn(x, enc))]; x = LN(x + MLP(x)).

    BERT layers and BART encoder layers are this with `cross=False`; BART decoder layers with
    `cross=True` and `decode` for incremental decoding.
    """

    num_heads: int
    hidden: int
    intermediate: int
    act: str
    init_std: float
    layer_norm_eps: float
    dropout: float = 0.0
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    cross: bool = False
    decode: bool = False
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        self_mask: jax.Array | None,
        encoded: jax.Array | None = None,
        cross_mask: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        """One layer.

        Args:
          x: [B, T, H].
          self_mask: bool broadcastable to [B, h, T, T] (ignored in decode mode).
          encoded: [B, S, H] encoder output for cross-attention (may be None in decode mode once
            the cross cache exists).
          cross_mask: bool broadcastable to [B, h, T, S].
          deterministic: disables dropout.

        Returns:
          [B, T, H].
        """
        attn = functools.partial(
            Attention,
            num_heads=self.num_heads,
            hidden=self.hidden,
            init_std=self.init_std,
            dropout_rate=self.attention_dropout,
            decode=self.decode,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )
        norm = functools.partial(
            nn.LayerNorm,
            epsilon=self.layer_norm_eps,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )
        drop = lambda y: (  # noqa: E731
            y
            if deterministic or self.dropout == 0.0
            else nn.Dropout(self.dropout)(y, deterministic=False)
        )

        x = norm(name="self_attn_ln")(
            x + drop(attn(name="self_attn")(x, None, self_mask, deterministic))
        )
        if self.cross:
            y = attn(cross=True, name="cross_attn")(x, encoded, cross_mask, deterministic)
            x = norm(name="cross_attn_ln")(x + drop(y))
        y = Mlp(
            self.hidden,
            self.intermediate,
            self.act,
            self.init_std,
            self.activation_dropout,
            self.dtype,
            self.param_dtype,
            name="mlp",
        )(x, deterministic)
        return norm(name="mlp_ln")(x + drop(y))


def layer_class(remat: bool) -> type[TransformerLayer]:
    """TransformerLayer, rematerialised in the backward pass when `remat` (saves activations)."""
    if not remat:
        return TransformerLayer
    # Argument 5 (counting self as 0) is `deterministic`, a Python bool.
    return nn.remat(TransformerLayer, static_argnums=(5,))
