"""BART encoder-decoder: RAG's generator.

Token embeddings shared by encoder, decoder and the tied LM head (optionally scaled by sqrt(H)),
learned positions with BART's offset of 2, `layernorm_embedding`, post-LN layers, and
`final_logits_bias` added to the logits. `encode()` and `decode()` are separate methods so the
encoder runs once per context and the decoder runs step by step with a key/value cache
(`init_cache` + `decode(..., decode=True)`), or over a whole target with teacher forcing.

A generator whose lower encoder is fixed (`frozen_encoder_layers > 0`) gives its encoder its own
token embedding, `encoder/embed_tokens`, which starts as a copy of the shared one
(`untie_encoder_embedding`): the shared table trains through the decoder and the LM head, and a
tied encoder input would move with it.

Legend: B batch, S source length, T target length, H hidden (d_model), V vocab.
"""

import dataclasses
import functools
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from rag_jax.models import layers, remat

# BART's learned position table has 2 extra leading rows (a fairseq legacy): position p is row p+2.
POSITION_OFFSET = 2


@dataclasses.dataclass(frozen=True)
class BartConfig:
    """Hyperparameters of BART (field names follow HF's `BartConfig`)."""

    vocab_size: int = 50265
    d_model: int = 1024
    encoder_layers: int = 12
    decoder_layers: int = 12
    encoder_attention_heads: int = 16
    decoder_attention_heads: int = 16
    encoder_ffn_dim: int = 4096
    decoder_ffn_dim: int = 4096
    max_position_embeddings: int = 1024
    activation_function: str = "gelu"
    scale_embedding: bool = False
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    # LayerDrop (Fan et al. 2019): in training (dropout on), each layer is skipped with this
    # probability, as HF's BART does; inference runs every layer.
    encoder_layerdrop: float = 0.0
    decoder_layerdrop: float = 0.0
    # No gradient flows into the encoder's first k layers: a generator whose lower encoder is a
    # fixed pretrained one (`models.bert2bart`) skips their backward pass. k = encoder_layers
    # fixes the whole encoder. k > 0 also gives the encoder its own input embedding
    # (`encoder/embed_tokens`, untied from the decoder's and the LM head's `shared`, which keep
    # training): the layers below the cut then compute a fixed function of the input ids.
    frozen_encoder_layers: int = 0
    init_std: float = 0.02
    layer_norm_eps: float = 1e-5
    pad_token_id: int = 1
    bos_token_id: int = 0
    eos_token_id: int = 2
    decoder_start_token_id: int = 2
    forced_bos_token_id: int | None = None
    forced_eos_token_id: int | None = 2
    # Compute and parameter dtypes ("float32" or "bfloat16"; "float64" under jax_enable_x64);
    # logits are float32 (float64 under float64 compute).
    dtype: str = "float32"
    param_dtype: str = "float32"
    # Recompute each layer's activations in the backward pass instead of storing them.
    remat: bool = False
    # What a rematerialised layer keeps (`models.remat`): full | attention | projections |
    # attention_and_projections | dots; read only with `remat`.
    remat_policy: str = "full"
    # Attention: "xla" (exact against HF) | "flash" | "splash" | "inplace" (Pallas TPU kernels,
    # `models.flash`, `models.splash`, `models.inplace`; no attention-probability dropout in
    # training; decoding with the cache stays on XLA).
    attention_impl: str = "xla"

    def __post_init__(self):
        remat.check_policy(self.remat_policy)

    def replace(self, **changes) -> "BartConfig":
        return dataclasses.replace(self, **changes)


def _check_ids(name: str, ids: jax.Array, max_positions: int) -> None:
    if ids.ndim != 2:
        raise ValueError(f"{name} must be [B, L] token ids, got shape {ids.shape}")
    if ids.shape[1] > max_positions:
        raise ValueError(
            f"{name} has length {ids.shape[1]} ({name} shape {ids.shape}) but the model allows at "
            f"most max_position_embeddings={max_positions}"
        )


class _Stack(nn.Module):
    """Embedding + layernorm_embedding + layers: BART's encoder (cross=False) or decoder.

    `shared` None: the stack has its own token embedding (`embed_tokens`).
    """

    config: BartConfig
    shared: nn.Embed | None
    cross: bool

    @nn.compact
    def __call__(self, ids, self_mask, encoded, cross_mask, decode, deterministic):
        cfg = self.config
        start = 0
        if decode:
            # The decode position lives in the cache; the creating call leaves it at 0.
            initialised = self.has_variable("cache", "position")
            position = self.variable("cache", "position", lambda: jnp.array(0, jnp.int32))
            if initialised:
                start = position.value
                position.value = start + ids.shape[1]
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        scale = cfg.d_model**0.5 if cfg.scale_embedding else 1.0
        positions = nn.Embed(
            cfg.max_position_embeddings + POSITION_OFFSET,
            cfg.d_model,
            dtype=dtype,
            param_dtype=param_dtype,
            embedding_init=nn.initializers.normal(cfg.init_std),
            name="positions",
        )
        tokens = self.shared
        if tokens is None:
            tokens = nn.Embed(
                cfg.vocab_size,
                cfg.d_model,
                dtype=dtype,
                param_dtype=param_dtype,
                embedding_init=nn.initializers.normal(cfg.init_std),
                name="embed_tokens",
            )
        pos = start + jnp.arange(ids.shape[1])[None, :] + POSITION_OFFSET
        x = tokens(ids) * jnp.asarray(scale, dtype) + positions(pos)
        x = nn.LayerNorm(
            epsilon=cfg.layer_norm_eps, dtype=dtype, param_dtype=param_dtype, name="ln_embedding"
        )(x)
        if not deterministic and cfg.dropout > 0.0:
            x = nn.Dropout(cfg.dropout)(x, deterministic=False)
        layer = layers.layer_class(cfg.remat, cfg.remat_policy)
        layerdrop = cfg.decoder_layerdrop if self.cross else cfg.encoder_layerdrop
        for i in range(cfg.decoder_layers if self.cross else cfg.encoder_layers):
            y = layer(
                num_heads=cfg.decoder_attention_heads
                if self.cross
                else cfg.encoder_attention_heads,
                hidden=cfg.d_model,
                intermediate=cfg.decoder_ffn_dim if self.cross else cfg.encoder_ffn_dim,
                act=cfg.activation_function,
                init_std=cfg.init_std,
                layer_norm_eps=cfg.layer_norm_eps,
                dropout=cfg.dropout,
                attention_dropout=cfg.attention_dropout,
                activation_dropout=cfg.activation_dropout,
                cross=self.cross,
                decode=decode,
                attention_impl=cfg.attention_impl,
                dtype=dtype,
                param_dtype=param_dtype,
                name=f"layer_{i}",
            )(x, self_mask, encoded, cross_mask, deterministic)
            if not deterministic and layerdrop > 0.0 and not decode:
                # HF draws one uniform per layer per forward pass and skips the layer below p.
                skip = jax.random.uniform(self.make_rng("dropout")) < layerdrop
                y = jnp.where(skip, x, y)
            x = y
            if not self.cross and i + 1 == cfg.frozen_encoder_layers:
                x = jax.lax.stop_gradient(x)  # the layers below are constants of the loss
        return x


class Bart(nn.Module):
    """BART for conditional generation (encoder, decoder, tied LM head)."""

    config: BartConfig

    def setup(self):
        cfg = self.config
        self.shared = nn.Embed(
            cfg.vocab_size,
            cfg.d_model,
            dtype=jnp.dtype(cfg.dtype),
            param_dtype=jnp.dtype(cfg.param_dtype),
            embedding_init=nn.initializers.normal(cfg.init_std),
        )
        # A fixed lower encoder reads its own copy of the embedding (see BartConfig).
        own = cfg.frozen_encoder_layers > 0
        self.encoder = _Stack(cfg, None if own else self.shared, cross=False)
        self.decoder = _Stack(cfg, self.shared, cross=True)
        # A buffer in the PyTorch model (never trained there); kept with the parameters so that
        # checkpoints carry it. Freeze it in training to keep the reference's behaviour.
        self.final_logits_bias = self.param(
            "final_logits_bias", nn.initializers.zeros, (cfg.vocab_size,), jnp.float32
        )

    def encode(
        self, input_ids: jax.Array, attention_mask: jax.Array, deterministic: bool = True
    ) -> jax.Array:
        """Runs the encoder.

        Args:
          input_ids: [B, S] int.
          attention_mask: [B, S] 1 = token, 0 = padding.
          deterministic: disables dropout.

        Returns:
          [B, S, H] in the compute dtype.
        """
        _check_ids("input_ids", input_ids, self.config.max_position_embeddings)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask {attention_mask.shape} does not match input_ids {input_ids.shape}"
            )
        mask = layers.padding_mask(None, attention_mask)  # -> [B, 1, 1, S]
        return self.encoder(input_ids, mask, None, None, False, deterministic)

    def decode(
        self,
        decoder_input_ids: jax.Array,
        encoded: jax.Array | None,
        encoder_mask: jax.Array,
        decoder_mask: jax.Array | None = None,
        decode: bool = False,
        deterministic: bool = True,
    ) -> jax.Array:
        """Runs the decoder and the LM head.

        Teacher forcing (`decode=False`): all T positions at once with causal masking.
        Incremental (`decode=True`, `mutable=["cache"]`, cache from `init_cache`): the T new
        tokens continue the cached prefix; positions and causal masking come from the cache, and
        `encoded` may be None because the cross-attention keys/values are cached.

        Encoder outputs may be shared by groups of k decoder rows (beams, or candidate answers
        rescored against the same contexts), so their cross-attention keys and values are
        computed once: `encoded` [B / k, S, H] serves decoder rows laid out (r, j), and
        `encoded` [G, m, S, H] serves decoder rows laid out (g, j, i) (row g * k * m + j * m + i
        reads encoder row (g, i)); `encoder_mask` then has the leading dims of `encoded`.

        Args:
          decoder_input_ids: [B, T] int.
          encoded: [B, S, H] encoder output (or shared, see above), or None in incremental mode.
          encoder_mask: [B, S] 1 = token, 0 = padding (or the leading dims of `encoded`).
          decoder_mask: [B, T] optional decoder padding mask (teacher forcing only).
          decode: incremental decoding with the cache.
          deterministic: disables dropout.

        Returns:
          logits: [B, T, V] float32.
        """
        cfg = self.config
        _check_ids("decoder_input_ids", decoder_input_ids, cfg.max_position_embeddings)
        length = decoder_input_ids.shape[1]
        cross_mask = layers.padding_mask(None, encoder_mask)  # -> [B, 1, 1, S] or [G, m, 1, 1, S]
        self_mask = layers.causal_mask(length)  # -> [1, 1, T, T]
        if not decode and decoder_mask is not None:
            if decoder_mask.shape != decoder_input_ids.shape:
                raise ValueError(
                    f"decoder_mask {decoder_mask.shape} does not match decoder_input_ids "
                    f"{decoder_input_ids.shape}"
                )
            self_mask = self_mask & decoder_mask.astype(bool)[:, None, None, :]
        x = self.decoder(decoder_input_ids, self_mask, encoded, cross_mask, decode, deterministic)
        return lm_head(x, self.shared.embedding, self.final_logits_bias)

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array,
        decoder_input_ids: jax.Array,
        decoder_mask: jax.Array | None = None,
        deterministic: bool = True,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Teacher-forced forward pass.

        Args:
          input_ids: [B, S]; attention_mask: [B, S]; decoder_input_ids: [B, T];
          decoder_mask: optional [B, T]; deterministic: disables dropout.

        Returns:
          logits: [B, T, V] float32; aux: {"encoded": [B, S, H]}.
        """
        if decoder_input_ids.shape[0] != input_ids.shape[0]:
            raise ValueError(
                f"decoder_input_ids {decoder_input_ids.shape} and input_ids {input_ids.shape} "
                "have different batch sizes"
            )
        encoded = self.encode(input_ids, attention_mask, deterministic)
        logits = self.decode(
            decoder_input_ids, encoded, attention_mask, decoder_mask, False, deterministic
        )
        return logits, {"encoded": encoded}


def lm_head(x: jax.Array, embedding: jax.Array, bias: jax.Array) -> jax.Array:
    """The tied output projection `x @ embedding.T + bias`, accumulated in float32.

    Under bfloat16 compute the product's inputs are bfloat16 but its sums are not rounded to
    bfloat16 (about 0.4% of a logit of 30, straight into the NLL and the beam ranking): the
    logits come out in float32 (float64 under float64 compute).

    Args:
      x: [..., H] decoder output in the compute dtype.
      embedding: [V, H] the shared token embedding (parameter dtype).
      bias: [V] `final_logits_bias`.

    Returns:
      [..., V] logits.
    """
    out_dtype = layers.accumulation_dtype(x.dtype)
    logits = jnp.einsum(
        "...h,vh->...v", x, embedding.astype(x.dtype), preferred_element_type=out_dtype
    )
    return logits + bias.astype(out_dtype)


def init_cache(
    model: Bart,
    params,
    encoded: jax.Array,
    encoder_mask: jax.Array,
    max_length: int,
    group_size: int = 1,
) -> dict:
    """Creates the decode cache for `max_length` steps, cross-attention keys/values included.

    Args:
      model: the Bart module.
      params: its parameters (the `params` collection).
      encoded: [E, S, H] encoder output, or [G, m, S, H] (E = G * m); see `Bart.decode`.
      encoder_mask: [E, S] (or [G, m, S]).
      max_length: number of decoder positions the cache holds.
      group_size: k, decoder rows reading each encoder row (B = E * k decoder rows).

    Returns:
      The `cache` collection: per decoder layer head-major self-attention buffers
      (`cached_key` [B, h, d, max_length], `cached_value` [B, h, max_length, d]) and
      cross-attention keys/values (`cross_key` [..., h, d, S], `cross_value` [..., h, S, d] with
      the leading dims of `encoded`), plus the scalar decode positions.
    """
    rows = math.prod(encoded.shape[:-2]) * group_size
    dummy = jnp.zeros((rows, max_length), jnp.int32)
    _, variables = model.apply(
        {"params": params},
        dummy,
        encoded,
        encoder_mask,
        None,
        True,
        method=Bart.decode,
        mutable=["cache"],
    )
    return variables["cache"]


def decode_step_fn(model: Bart, params, encoder_mask: jax.Array):
    """`step_fn(ids [B, T], cache) -> (logits [B, T, V], cache)`: incremental decoding."""

    def step_fn(ids, cache):
        logits, variables = model.apply(
            {"params": params, "cache": cache},
            ids,
            None,
            encoder_mask,
            None,
            True,
            method=Bart.decode,
            mutable=["cache"],
        )
        return logits, variables["cache"]

    return step_fn


def untie_encoder_embedding(params) -> dict:
    """The parameters of a Bart with `frozen_encoder_layers > 0` from those of a tied one.

    The encoder's own embedding (`encoder/embed_tokens/embedding`) starts as a copy of the
    shared one, so the model computes what the tied model computes until `shared` trains.
    Arrays are copied, numpy as numpy and jax as jax (a train step donates its state, and one
    buffer must not be two leaves); `jax.ShapeDtypeStruct` leaves (planned shapes) are taken as
    they are.

    Args:
      params: a Bart tree without `encoder/embed_tokens` (as `frozen_encoder_layers=0` makes).

    Returns:
      A new tree (the input is left alone) with `encoder/embed_tokens/embedding` [V, H].
    """
    if "embed_tokens" in params["encoder"]:
        raise ValueError("the generator's encoder already has its own embedding (embed_tokens)")
    shared = params["shared"]["embedding"]
    if isinstance(shared, np.ndarray):
        shared = np.array(shared)
    elif not isinstance(shared, jax.ShapeDtypeStruct):
        shared = jnp.array(shared, copy=True)
    encoder = dict(params["encoder"], embed_tokens={"embedding": shared})
    return dict(params, encoder=encoder)


def frozen_encoder_paths(config: BartConfig) -> list[str]:
    """Every parameter path below the encoder's cut (`frozen_encoder_layers`), e.g.
    `encoder/embed_tokens/embedding`, `encoder/positions/embedding`, `encoder/layer_0/...`: what
    the stop-gradient leaves fixed, read from the parameter shapes."""
    frozen = config.frozen_encoder_layers
    if frozen <= 0:
        return []
    paths = []
    for path, _ in jax.tree_util.tree_flatten_with_path(param_shapes(config))[0]:
        names = [str(getattr(k, "key", k)) for k in path]
        if names[0] != "encoder":
            continue
        layer = re.fullmatch(r"layer_(\d+)", names[1])
        if layer is None or int(layer.group(1)) < frozen:
            paths.append("/".join(names))
    return sorted(paths)


@functools.cache
def param_shapes(config: BartConfig):
    """Shapes of the parameter tree (no allocation), for converters and memory plans."""
    model = Bart(config)
    ids = jnp.zeros((1, 2), jnp.int32)
    return jax.eval_shape(
        lambda: model.init(jax.random.PRNGKey(0), ids, jnp.ones_like(ids), ids)["params"]
    )
