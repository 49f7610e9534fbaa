"""BERT encoder as DPR uses it: the question and passage towers of RAG's retriever.

Embeddings (word + absolute position + token type, LayerNorm), post-LN transformer layers with exact
GELU, then the pooled vector: the [CLS] hidden state, projected when `projection_dim > 0` (DPR's
`encode_proj`). Plain BERT checkpoints that carry a pooler (dense + tanh on [CLS]) load too; the
pooler's output is returned in aux but is not the retrieval vector, exactly as in DPR.

Legend: B batch, S sequence length, H hidden width, D output (embedding) width.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from rag_jax.models import layers


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
    # Compute and parameter dtypes ("float32" or "bfloat16"; "float64" under jax_enable_x64);
    # outputs are float32 (float64 under float64 compute).
    dtype: str = "float32"
    param_dtype: str = "float32"
    # Recompute each layer's activations in the backward pass instead of storing them.
    remat: bool = False

    @property
    def embedding_dim(self) -> int:
        """D: width of the retrieval vector."""
        return self.projection_dim if self.projection_dim > 0 else self.hidden_size

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
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Encodes a padded batch.

        Args:
          input_ids: [B, S] int token ids.
          attention_mask: [B, S] 1 = token, 0 = padding.
          token_type_ids: [B, S] segment ids, or None for all zeros.
          deterministic: disables dropout (needs a `dropout` rng when False).

        Returns:
          pooled: [B, D] float32, the [CLS] hidden state (projected if `projection_dim > 0`).
          aux: {"hidden": [B, S, H] float32} plus {"pooler_output": [B, H]} with a pooler.
        """
        cfg = self.config
        if input_ids.ndim != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"input_ids {input_ids.shape} and attention_mask {attention_mask.shape} must both "
                "be [B, S]"
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
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        x = embed(cfg.vocab_size, name="word_embeddings")(input_ids)
        x = x + embed(cfg.max_position_embeddings, name="position_embeddings")(
            jnp.arange(length)[None, :]
        )
        x = x + embed(cfg.type_vocab_size, name="token_type_embeddings")(token_type_ids)
        x = nn.LayerNorm(
            epsilon=cfg.layer_norm_eps, dtype=dtype, param_dtype=param_dtype, name="embeddings_ln"
        )(x)
        if not deterministic and cfg.hidden_dropout_prob > 0.0:
            x = nn.Dropout(cfg.hidden_dropout_prob)(x, deterministic=False)

        mask = layers.padding_mask(None, attention_mask)  # -> [B, 1, 1, S]
        layer = layers.layer_class(cfg.remat)
        for i in range(cfg.num_hidden_layers):
            x = layer(
                num_heads=cfg.num_attention_heads,
                hidden=cfg.hidden_size,
                intermediate=cfg.intermediate_size,
                act=cfg.hidden_act,
                init_std=cfg.initializer_range,
                layer_norm_eps=cfg.layer_norm_eps,
                dropout=cfg.hidden_dropout_prob,
                attention_dropout=cfg.attention_probs_dropout_prob,
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
        if cfg.projection_dim > 0:
            cls = layers.dense(
                cfg.projection_dim, cfg.initializer_range, dtype, param_dtype, "projection"
            )(cls)
        return cls.astype(out_dtype), aux
