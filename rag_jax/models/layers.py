"""Transformer pieces shared by the BERT and BART modules.

Both models are post-LayerNorm transformers with biased projections, so one attention module (with
an optional decode cache), one MLP and one encoder layer serve both; the models differ only in their
embeddings and heads.

Legend: B batch, S source (key) length, T target (query) length, H hidden width, h heads,
d head width (H = h * d), F feed-forward width.
"""

import functools
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from rag_jax.models import flash, inplace, remat, splash

# Large negative logit for masked attention positions; finite so that a fully masked row gives a
# uniform (not NaN) distribution, as in the PyTorch reference.
MASK_VALUE = jnp.finfo(jnp.float32).min


def accumulation_dtype(dtype) -> jnp.dtype:
    """Logits, softmax and model outputs: float32 under bfloat16 or float32 compute, float64
    under float64 compute (`jax_enable_x64`, for exactness checks free of float32 rounding)."""
    return jnp.promote_types(dtype, jnp.float32)


def _gelu_erf(x: jax.Array) -> jax.Array:
    """Exact GELU in the reference's erf form; XLA's erf is cheaper than the erfc of jax.nn.gelu."""
    return x * 0.5 * (1.0 + jax.lax.erf(x * jnp.asarray(2.0**-0.5, x.dtype)))


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": _gelu_erf,  # exact erf GELU (BERT, BART)
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


class KeyDense(nn.Dense):
    """The attention key projection: a biased dense layer whose bias is kept but not applied.

    The key bias adds `q . b` to every logit of a query row, which the softmax cancels, so it
    changes nothing but rounding. Leaving it out saves work and makes its gradient exactly
    zero, as it is mathematically (computed, it would be rounding noise). The parameter stays in
    the tree, initialised as `nn.Dense` does, so checkpoints keep their layout.
    """

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        kernel = self.param(
            "kernel", self.kernel_init, (inputs.shape[-1], self.features), self.param_dtype
        )
        self.param("bias", self.bias_init, (self.features,), self.param_dtype)
        inputs, kernel = self.promote_dtype(inputs, kernel, dtype=self.dtype)
        return jax.lax.dot_general(inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())))


def padding_mask(query_mask: jax.Array | None, key_mask: jax.Array) -> jax.Array:
    """Boolean attention mask from padding masks.

    Args:
      query_mask: [B, T] (1 = real token) or None (all queries real; padded queries attend anyway).
      key_mask: [B, S] 1 = real token, 0 = padding; or [G, m, S] for keys shared by groups of
        query rows (see `Attention`).

    Returns:
      [B, 1, 1, S] (or [G, m, 1, 1, S]) bool, True where attention is allowed.
    """
    del query_mask  # Padded queries still attend (their outputs are ignored), as in the reference.
    return key_mask.astype(bool)[..., None, None, :]


def causal_mask(length: int) -> jax.Array:
    """[1, 1, T, T] bool lower-triangular mask."""
    return jnp.tril(jnp.ones((length, length), dtype=bool))[None, None]


class Attention(nn.Module):
    """Multi-head attention with biased q/k/v/out projections (BERT and BART layout).

    Keys and values may be shared by groups of query rows: with `kv` of shape [G, m, S, H] (or a
    cross cache made from one) and `x` of [G * k * m, T, H], query row (g, j, i) (laid out
    g * k * m + j * m + i) attends to kv row (g, i). This is how k beams, or k candidate answers,
    read the same encoder output without copying it k times: the k rows join the query axis of
    one head-major matmul. A 3-D `kv` [R, S, H] with `x` of [R * k, T, H] is the case m = 1.

    With `decode=True`, keys and values are kept in the `cache` collection, head-major:
    - self-attention (`cross=False`): `cached_key` [B, h, d, L] and `cached_value` [B, h, L, d],
      filled one chunk per call, L fixed by the query length of the call that creates the cache;
    - cross-attention (`cross=True`): the projected encoder keys `cross_key` [..., h, d, S] and
      values `cross_value` [..., h, S, d] (leading dims those of `kv`), computed once when the
      cache is created and reused at every step (the encoder output is then ignored). They never
      change, so a beam search can keep them out of the state it reorders.
    Create the cache by calling the model once with `decode=True` and `mutable=["cache"]` on an
    input of the full decode length; that first call does not write to it.

    With `impl="flash"`, `"splash"` or `"inplace"` the softmax and both matmuls run in a Pallas
    kernel (`models.flash`, `models.splash`, `models.inplace`; the last reads the projections'
    [.., H] layout as it is),
    forward and backward, except in decode mode (a cached query or a few reading the cache,
    where the scores are [.., h, 1, L] and the XLA path stays). The kernel reads `mask` as what
    the models build: a key-padding mask [.., 1, 1, S] (`padding_mask`), or, with `causal`,
    `causal_mask` and-ed with a key-padding mask ([1 or B, 1, T, T], whose last row is then the
    key padding). It cannot apply attention-probability dropout, which it refuses in training.
    """

    num_heads: int
    hidden: int
    init_std: float
    dropout_rate: float = 0.0
    cross: bool = False
    decode: bool = False
    # "xla" (the default, exact against HF) | "flash" | "splash" | "inplace" (Pallas TPU kernels,
    # see above).
    impl: str = "xla"
    # The mask is causal (decoder self-attention); only the kernel paths read this.
    causal: bool = False
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
          kv: [B, S, H] keys' and values' input, or [B / k, S, H] or [G, m, S, H] shared by
            groups of query rows (see the class docstring); None for self-attention.
          mask: bool, broadcastable to [B, h, T, S] (to [G, m, h, k * T, S] for a 4-D `kv`);
            True = allowed. In self-attention decode mode it is ignored: the cache applies
            causal masking by position.
          deterministic: disables dropout.

        Returns:
          [B, T, H] in `dtype`.
        """
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.num_heads}")
        proj = functools.partial(dense, self.hidden, self.init_std, self.dtype, self.param_dtype)
        batch, length = x.shape[:2]

        # Scaling the queries costs [B, T, H] multiplications instead of [B, h, T, S].
        scale = jnp.asarray((self.hidden // self.num_heads) ** -0.5, self.dtype)
        # The remat names mark the [.., H] projections (no head axis of width d padded to the
        # TPU's 128 lanes when a policy keeps them).
        query = remat.name(proj("query")(x), remat.QUERY)
        flash.check_impl(self.impl)
        if self.impl == "inplace" and not self.decode:  # the kernel scales its logits itself
            out = self._inplace(query, x, kv, proj, mask, deterministic)
            return self._project_out(proj, out)
        query = self._split(query * scale)  # -> [B, T, h, d]
        if self.cross and self.decode:
            key, value = self._cross_cache(kv, proj)
        else:
            source = x if kv is None else kv
            key, value = self._head_major(proj, source)  # -> [..., h, d, S], [..., h, S, d]
            if self.decode:
                key, value, mask = self._self_cache(key, value, length)
        if self.impl in flash.KERNELS and not self.decode:
            out = self._kernel(query, key, value, mask, deterministic)  # -> [B, T, h, d]
            return self._project_out(proj, out.reshape(batch, length, self.hidden))

        # Head-major batched matmuls: on CPU this layout runs about twice as fast as the
        # equivalent einsum over [B, T, h, d] (measured at B=32, S=256 in the encode benchmark).
        if key.ndim == 4 and key.shape[0] == batch:
            query = query.transpose(0, 2, 1, 3)  # -> [B, h, T, d]
        else:
            # Shared keys/values: the k query rows of a group become extra query positions.
            outer, inner = key.shape[:2] if key.ndim == 5 else (key.shape[0], 1)
            group = batch // (outer * inner)
            if group * outer * inner != batch:
                raise ValueError(
                    f"query rows {x.shape} are not a multiple of the key/value rows "
                    f"{key.shape[:-3]}"
                )
            query = query.reshape(outer, group, inner, length, self.num_heads, -1)
            query = query.transpose(0, 2, 4, 1, 3, 5)  # -> [G, m, h, k, T, d]
            query = query.reshape(outer, inner, self.num_heads, group * length, -1)
            key = key.reshape((outer, inner) + key.shape[-3:])  # -> [G, m, h, d, S]
            value = value.reshape((outer, inner) + value.shape[-3:])  # -> [G, m, h, S, d]
            if mask is not None and mask.ndim == 4:
                mask = mask[:, None]  # [G, 1, T, S] -> [G, 1, 1, T, S]
        # Logits accumulate in float32 even under bfloat16 compute; softmax runs in float32.
        logits = jnp.matmul(
            query, key, preferred_element_type=accumulation_dtype(query.dtype)
        )  # -> [.., h, T, S]
        if mask is not None:
            logits = jnp.where(mask, logits, MASK_VALUE)
        # Softmax with the normalisation deferred to after the value product: the division runs
        # over [.., T, d] instead of [.., T, S], and the [.., T, S] probabilities are never
        # written (about twice as fast, forward and backward, on CPU). Dropout of the
        # probabilities is dropout of the unnormalised weights, the sum staying undropped.
        peak = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
        weights = jnp.exp(logits - peak)
        total = jnp.sum(weights, axis=-1, keepdims=True)  # -> [.., h, T, 1]
        if not deterministic and self.dropout_rate > 0.0:
            weights = nn.Dropout(self.dropout_rate)(weights, deterministic=False)
        out = jnp.matmul(weights.astype(self.dtype), value)  # -> [B, h, T, d] or [G, m, h, kT, d]
        out = (out / total).astype(self.dtype)
        if out.ndim == 4:
            out = out.transpose(0, 2, 1, 3)  # -> [B, T, h, d]
        else:
            outer, inner = out.shape[:2]
            out = out.reshape(outer, inner, self.num_heads, -1, length, out.shape[-1])
            out = out.transpose(0, 3, 1, 4, 2, 5)  # -> [G, k, m, T, h, d]
        return self._project_out(proj, out.reshape(batch, length, self.hidden))  # -> [B, T, H]

    def _project_out(self, proj, out: jax.Array) -> jax.Array:
        """The output projection of the heads' outputs [B, T, H], both marked for the remat
        policies (the splash kernel marks its own output, which its backward pass reads)."""
        if self.impl != "splash" or self.decode:
            out = remat.name(out, remat.ATTENTION)
        return remat.name(proj("out")(out), remat.ATTENTION_PROJECTION)

    def _kernel(self, query, key, value, mask, deterministic) -> jax.Array:
        """The kernel's attention of `query` [B, T, h, d] (scaled) over `key` [..., h, d, S] and
        `value` [..., h, S, d] (leading dims [B], [B / k] or [G, m]); returns [B, T, h, d].
        """
        flash.check_no_dropout(
            self.dropout_rate,
            deterministic,
            "the attention dropout (attention_probs_dropout_prob, attention_dropout)",
            self.impl,
        )
        batch, length = query.shape[:2]
        lead, source = key.shape[:-3], key.shape[-1]
        rows, group = self._rows(batch, lead)
        key_mask = self._key_mask(mask, lead, source)
        # The k query rows of a group become extra query positions of their key/value row.
        inner = lead[1] if len(lead) == 2 else 1
        q = query.reshape(rows // inner, group, inner, length, self.num_heads, -1)
        q = q.transpose(0, 2, 4, 1, 3, 5)  # -> [G, m, h, k, T, d]
        q = q.reshape(rows, self.num_heads, group * length, -1)  # -> [G * m, h, k * T, d]
        k = jnp.swapaxes(key, -1, -2).reshape(rows, self.num_heads, source, -1)  # [G*m, h, S, d]
        v = value.reshape(rows, self.num_heads, source, -1)
        fused = splash.attention if self.impl == "splash" else flash.attention
        out = fused(q, k, v, key_mask, self.causal)  # -> [G * m, h, k * T, d]
        out = out.reshape(rows // inner, inner, self.num_heads, group, length, -1)
        out = out.transpose(0, 3, 1, 4, 2, 5)  # -> [G, k, m, T, h, d]
        return out.reshape(batch, length, self.num_heads, -1)

    def _inplace(self, query, x, kv, proj, mask, deterministic) -> jax.Array:
        """The inplace kernel's attention (`models.inplace`) of `query` [B, T, H] (not scaled)
        over the projections of `kv` (or `x`), all in the projections' [.., H] layout; returns
        [B, T, H]."""
        flash.check_no_dropout(
            self.dropout_rate,
            deterministic,
            "the attention dropout (attention_probs_dropout_prob, attention_dropout)",
            self.impl,
        )
        batch, length = query.shape[:2]
        key, value = self._key_value(proj, x if kv is None else kv)  # -> [..., S, H]
        lead, source = key.shape[:-2], key.shape[-2]
        rows, group = self._rows(batch, lead)
        key_mask = self._key_mask(mask, lead, source)
        # The k query rows of a group become extra query positions of their key/value row.
        inner = lead[1] if len(lead) == 2 else 1
        q = query.reshape(rows // inner, group, inner, length, self.hidden)
        q = q.transpose(0, 2, 1, 3, 4).reshape(rows, group * length, self.hidden)
        key, value = (y.reshape(rows, source, self.hidden) for y in (key, value))
        scale = (self.hidden // self.num_heads) ** -0.5
        out = inplace.attention(q, key, value, key_mask, self.num_heads, self.causal, scale)
        out = out.reshape(rows // inner, inner, group, length, self.hidden)
        return out.transpose(0, 2, 1, 3, 4).reshape(batch, length, self.hidden)

    def _rows(self, batch: int, lead: tuple) -> tuple[int, int]:
        """The key/value rows of leading dims `lead` and the query rows that share each."""
        rows = math.prod(lead)
        group = batch // rows
        if group * rows != batch:
            raise ValueError(
                f"query rows ({batch}) are not a multiple of the key/value rows {lead}"
            )
        if self.causal and group != 1:
            raise ValueError("causal attention reads its own keys: no key/value sharing")
        return rows, group

    def _key_mask(self, mask, lead: tuple, source: int) -> jax.Array:
        """The kernels' key-padding mask [rows, S] from the models' `mask`."""
        if mask is None:
            key_mask = jnp.ones(lead + (source,), bool)
        elif self.causal:
            key_mask = mask[..., 0, -1, :]  # the last query row of a causal mask: key padding
        elif mask.shape[-2] == 1 and mask.shape[-3] == 1:
            key_mask = mask[..., 0, 0, :]
        else:
            raise ValueError(
                f"attention_impl={self.impl!r} reads a key-padding mask [.., 1, 1, S] (or, causal, "
                f"causal_mask and-ed with one); got a mask of shape {mask.shape}"
            )
        return jnp.broadcast_to(key_mask, lead + (source,)).reshape(math.prod(lead), source)

    def _split(self, y: jax.Array) -> jax.Array:
        """[..., S, H] -> [..., S, h, d]."""
        return y.reshape(y.shape[:-1] + (self.num_heads, self.hidden // self.num_heads))

    def _key_value(self, proj, source: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Projected keys and values [..., S, H] of `source` [..., S, H], named for remat."""
        key_proj = KeyDense(
            self.hidden,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=nn.initializers.normal(self.init_std),
            name="key",
        )
        return (
            remat.name(key_proj(source), remat.KEY),
            remat.name(proj("value")(source), remat.VALUE),
        )

    def _head_major(self, proj, source: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Projected keys [..., h, d, S] and values [..., h, S, d] of `source` [..., S, H]."""
        lead = source.ndim - 2
        key, value = (self._split(y) for y in self._key_value(proj, source))  # [..., S, h, d]
        axes = tuple(range(lead))
        key = key.transpose(axes + (lead + 1, lead + 2, lead))  # -> [..., h, d, S]
        value = value.transpose(axes + (lead + 1, lead, lead + 2))  # -> [..., h, S, d]
        return key, value

    def _cross_cache(self, kv, proj):
        """Projected encoder keys/values: computed when the cache is created, then reused."""
        if self.has_variable("cache", "cross_key"):
            return self.get_variable("cache", "cross_key"), self.get_variable(
                "cache", "cross_value"
            )
        if kv is None:
            raise ValueError("cross-attention cache is not initialised and no encoder output given")
        key, value = self._head_major(proj, kv)
        self.variable("cache", "cross_key", lambda: key)
        self.variable("cache", "cross_value", lambda: value)
        return key, value

    def _self_cache(self, key, value, length):
        """Writes this call's keys/values at the cache index; returns the whole cache + mask.

        Args:
          key: [B, h, d, T]; value: [B, h, T, d] of this call's T positions.
          length: T.
        """
        initialised = self.has_variable("cache", "cached_key")
        cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
        index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        if not initialised:
            # The creating call sizes the cache and runs as plain causal self-attention.
            return key, value, causal_mask(length)
        max_length = cached_value.value.shape[2]
        start = index.value
        zero = jnp.array(0, jnp.int32)
        cached_key.value = jax.lax.dynamic_update_slice(
            cached_key.value, key.astype(cached_key.value.dtype), (zero, zero, zero, start)
        )
        cached_value.value = jax.lax.dynamic_update_slice(
            cached_value.value, value.astype(cached_value.value.dtype), (zero, zero, start, zero)
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
        y = dense(self.hidden, self.init_std, self.dtype, self.param_dtype, "wo")(y)
        return remat.name(y, remat.FFN_OUTPUT)


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
    # Attention.impl of every attention of the layer ("xla" | "flash" | "splash" | "inplace").
    attention_impl: str = "xla"
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
            impl=self.attention_impl,
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

        # A decoder layer's (cross=True) self-attention is causal.
        self_attn = attn(causal=self.cross, name="self_attn")
        x = norm(name="self_attn_ln")(x + drop(self_attn(x, None, self_mask, deterministic)))
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


def layer_class(rematerialise: bool, policy: str = "full") -> type[TransformerLayer]:
    """TransformerLayer, rematerialised in the backward pass when `rematerialise` (saves
    activations), keeping what `policy` says (`models.remat`; "full": nothing)."""
    remat.check_policy(policy)
    if not rematerialise:
        return TransformerLayer
    # Argument 5 (counting self as 0) is `deterministic`, a Python bool.
    saved = remat.checkpoint_policy(policy)
    if saved is None:
        return nn.remat(TransformerLayer, static_argnums=(5,))
    return nn.remat(TransformerLayer, static_argnums=(5,), policy=saved)
