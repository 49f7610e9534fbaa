"""BERT encoder as DPR uses it: the question and passage towers of RAG's retriever.

Embeddings (word + absolute position + token type, LayerNorm), post-LN transformer layers with exact
GELU, then the pooled vector: the [CLS] hidden state, projected when `projection_dim > 0` (DPR's
`encode_proj`). Plain BERT checkpoints that carry a pooler (dense + tanh on [CLS]) load too; the
pooler's output is returned in aux but is not the retrieval vector, exactly as in DPR.

Sentence-transformers' towers (all-MiniLM-L6-v2 among them) were trained on another vector: the
mean of the last layer's token states over the real tokens, L2-normalised (`pooling="mean"`,
`normalize=True`, as its `Pooling` and `Normalize` modules compute them).

Legend: B batch, S sequence length, H hidden width, D output (embedding) width.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from rag_jax.models import layers, remat


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Hyperparameters of a BERT encoder (field names follow HF's `BertConfig`)."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02
    pad_token_id: int = 0
    # DPR's linear projection of the [CLS] vector; 0 = none (the vector is the hidden state).
    projection_dim: int = 0
    # Whether the checkpoint's pooler (dense + tanh on [CLS]) is part of the parameters.
    with_pooler: bool = False
    # The retrieval vector: "cls" (the [CLS] state, DPR) or "mean" (the mean over real tokens,
    # sentence-transformers); then, with `normalize`, divided by its L2 norm.
    pooling: str = "cls"
    normalize: bool = False
    # Compute and parameter dtypes ("float32" or "bfloat16"; "float64" under jax_enable_x64);
    # outputs are float32 (float64 under float64 compute).
    dtype: str = "float32"
    param_dtype: str = "float32"
    # Recompute each layer's activations in the backward pass instead of storing them.
    remat: bool = False
    # What a rematerialised layer keeps (`models.remat`): full | attention | projections |
    # attention_and_projections | dots; read only with `remat`.
    remat_policy: str = "full"
    # Attention: "xla" (exact against HF) | "flash" | "splash" | "inplace" (Pallas TPU kernels,
    # `models.flash`, `models.splash`, `models.inplace`; no attention-probability dropout in
    # training).
    attention_impl: str = "xla"

    @property
    def embedding_dim(self) -> int:
        """D: width of the retrieval vector."""
        return self.projection_dim if self.projection_dim > 0 else self.hidden_size

    def __post_init__(self):
        remat.check_policy(self.remat_policy)

    def replace(self, **changes) -> "BertConfig":
        return dataclasses.replace(self, **changes)


class BertEncoder(nn.Module):
    """BERT encoder returning the retrieval vector and, in aux, the hidden states."""

    config: BertConfig

    @nn.compact
    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array,
        token_type_ids: jax.Array | None = None,
        deterministic: bool = True,
        first_layer: int = 0,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Encodes a padded batch.

        Args:
          input_ids: [B, S] int token ids; or, with `first_layer` > 0, [B, S, H] float the
            states layer `first_layer - 1` output (`aux["hidden"]` of the encoder cut to
            `first_layer` layers): the embeddings and the layers below are not run.
          attention_mask: [B, S] 1 = token, 0 = padding.
          token_type_ids: [B, S] segment ids, or None for all zeros.
          deterministic: disables dropout (needs a `dropout` rng when False).
          first_layer: the first layer run; 0 runs the whole encoder from token ids.

        Returns:
          pooled: [B, D] float32, the [CLS] hidden state or the mean over real tokens
            (`pooling`), projected if `projection_dim > 0`, L2-normalised with `normalize`.
          aux: {"hidden": [B, S, H] float32} plus {"pooler_output": [B, H]} with a pooler.
        """
        cfg = self.config
        if not 0 <= first_layer <= cfg.num_hidden_layers:
            raise ValueError(
                f"first_layer {first_layer} must be in [0, {cfg.num_hidden_layers}] (the layers)"
            )
        wanted = (2, "[B, S]") if first_layer == 0 else (3, "[B, S, H] states")
        if input_ids.ndim != wanted[0] or attention_mask.shape != input_ids.shape[:2]:
            raise ValueError(
                f"input_ids {input_ids.shape} must be {wanted[1]} and attention_mask "
                f"{attention_mask.shape} [B, S]"
            )
        length = input_ids.shape[1]
        if length > cfg.max_position_embeddings:
            raise ValueError(
                f"sequence length {length} exceeds max_position_embeddings "
                f"{cfg.max_position_embeddings}"
            )
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        embed = functools.partial(
            nn.Embed,
            features=cfg.hidden_size,
            dtype=dtype,
            param_dtype=param_dtype,
            embedding_init=nn.initializers.normal(cfg.initializer_range),
        )
        if first_layer:  # states of the layers below, computed elsewhere
            x = input_ids.astype(dtype)
        else:
            if token_type_ids is None:
                token_type_ids = jnp.zeros_like(input_ids)
            x = embed(cfg.vocab_size, name="word_embeddings")(input_ids)
            x = x + embed(cfg.max_position_embeddings, name="position_embeddings")(
                jnp.arange(length)[None, :]
            )
            x = x + embed(cfg.type_vocab_size, name="token_type_embeddings")(token_type_ids)
            x = nn.LayerNorm(
                epsilon=cfg.layer_norm_eps,
                dtype=dtype,
                param_dtype=param_dtype,
                name="embeddings_ln",
            )(x)
            if not deterministic and cfg.hidden_dropout_prob > 0.0:
                x = nn.Dropout(cfg.hidden_dropout_prob)(x, deterministic=False)

        mask = layers.padding_mask(None, attention_mask)  # -> [B, 1, 1, S]
        layer = layers.layer_class(cfg.remat, cfg.remat_policy)
        for i in range(first_layer, cfg.num_hidden_layers):
            x = layer(
                num_heads=cfg.num_attention_heads,
                hidden=cfg.hidden_size,
                intermediate=cfg.intermediate_size,
                act=cfg.hidden_act,
                init_std=cfg.initializer_range,
                layer_norm_eps=cfg.layer_norm_eps,
                dropout=cfg.hidden_dropout_prob,
                attention_dropout=cfg.attention_probs_dropout_prob,
                attention_impl=cfg.attention_impl,
                dtype=dtype,
                param_dtype=param_dtype,
                name=f"layer_{i}",
            )(x, mask, None, None, deterministic)

        cls = x[:, 0, :]  # -> [B, H]
        out_dtype = layers.accumulation_dtype(x.dtype)  # float32 unless computing in float64
        aux = {"hidden": x.astype(out_dtype)}
        if cfg.with_pooler:
            pooler = layers.dense(
                cfg.hidden_size, cfg.initializer_range, dtype, param_dtype, "pooler"
            )
            aux["pooler_output"] = jnp.tanh(pooler(cls)).astype(out_dtype)
        projection = None
        if cfg.projection_dim > 0:  # DPR's projection of the pooled vector
            projection = layers.dense(
                cfg.projection_dim, cfg.initializer_range, dtype, param_dtype, "projection"
            )
        return pool(cfg, x, attention_mask, cls, projection), aux


POOLINGS = ("cls", "mean")


def pool(cfg: BertConfig, hidden, attention_mask, cls=None, projection=None) -> jax.Array:
    """The retrieval vector of the last layer's states: [CLS] or the masked mean (`cfg.pooling`),
    projected, normalised (`cfg.normalize`).

    Args:
      cfg: the encoder's config.
      hidden: [B, S, H] last-layer states (compute dtype).
      attention_mask: [B, S] 1 = token.
      cls: [B, H] the [CLS] state when only it was computed (`pooling="cls"`); default hidden[:, 0].
      projection: DPR's projection (a callable), or None.

    Returns:
      [B, D] in float32 (float64 under float64 compute).
    """
    if cfg.pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {cfg.pooling!r}")
    out_dtype = layers.accumulation_dtype(hidden.dtype)
    if cfg.pooling == "cls":
        vector = hidden[:, 0] if cls is None else cls
    else:  # sentence-transformers: sum of real tokens' states / their count (at least 1e-9)
        mask = attention_mask.astype(out_dtype)[:, :, None]
        total = jnp.sum(hidden.astype(out_dtype) * mask, axis=1)
        vector = total / jnp.maximum(jnp.sum(mask, axis=1), 1e-9)
    if projection is not None:
        vector = projection(vector.astype(hidden.dtype))
    vector = vector.astype(out_dtype)
    if cfg.normalize:  # sentence-transformers' Normalize: x / max(||x||, 1e-12)
        vector = vector / jnp.maximum(jnp.linalg.norm(vector, axis=-1, keepdims=True), 1e-12)
    return vector
