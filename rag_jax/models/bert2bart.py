"""A BART generator warm-started from a BERT checkpoint (Rothe, Narayan & Severyn 2020,
"Leveraging Pre-trained Checkpoints for Sequence Generation Tasks").

A BERT layer (self-attention, add & norm, GELU feed-forward, add & norm) is exactly a post-LN BART
encoder layer, so the mapping onto `models.bart.Bart` is:

- the shared token embedding (encoder, decoder and the tied LM head) <- BERT's word embeddings,
  and, for a generator whose encoder is fixed (`frozen_encoder_layers > 0`), the encoder's own
  copy (`encoder/embed_tokens`) <- the same word embeddings;
- both position tables <- BERT's position embeddings with BART's offset of 2 (row p + 2 holds
  BERT's position p; the two offset rows are never read) and BERT's token-type-0 embedding folded
  in (BERT adds it to every token; BART has no token types);
- both `layernorm_embedding`s <- BERT's embedding LayerNorm;
- encoder layer i <- BERT layer i, for the first `encoder_layers` layers;
- decoder layer j <- BERT layer j's self-attention and feed-forward (with their LayerNorms), its
  cross-attention fresh (`decoder_init="bert"`, Rothe et al.'s choice) or a copy of the same
  self-attention (`"bert_cross"`), or the whole decoder layer fresh (`"random"`);
- `final_logits_bias` zeros (HF's BART buffer).

The encoder then computes BERT's hidden states exactly (`tests/models/bert2bart_test.py` checks
against HF `BertModel`). BERT's pooler (and DPR's projection) have no place in BART and are left
out; any other tensor that does not map, or one that is missing, is refused by name.

Legend: H hidden width, V vocab, P positions.
"""

import jax
import jax.numpy as jnp
import numpy as np

from rag_jax.models import bart, bert

DECODER_INITS = ("bert", "bert_cross", "random")
# decoder_init="bert_cross": a decoder layer's cross-attention (and its LayerNorm) start as a copy
# of the BERT layer's self-attention: queries and keys already live in one space (both sides
# are BERT states), so from step 0 a decoder position attends to related passage tokens.
_CROSS_FROM = {"cross_attn": "self_attn", "cross_attn_ln": "self_attn_ln"}
# BERT parameters with no place in BART: the [CLS] pooler and DPR's projection.
_LEFT_OUT = ("pooler", "projection")


class MappingError(ValueError):
    """A BERT parameter tree that does not map onto the BART asked for."""


def bart_config(
    bert_cfg: bert.BertConfig,
    *,
    encoder_layers: int = 0,
    decoder_layers: int = 0,
    special_ids: dict,
    **overrides,
) -> bart.BartConfig:
    """The BartConfig whose encoder is `bert_cfg`'s first `encoder_layers` layers (0 = all).

    Args:
      bert_cfg: the BERT checkpoint's config.
      encoder_layers, decoder_layers: layers of each stack (0 = as many as BERT has).
      special_ids: the generator's bos/eos/pad/decoder-start/forced ids (its tokenizer's).
      **overrides: other BartConfig fields (dropout, dtype, remat, ...); the widths, heads,
        vocabulary, positions, activation and LayerNorm epsilon are BERT's and may not be
        overridden with other values.
    """
    layers = bert_cfg.num_hidden_layers
    encoder_layers, decoder_layers = (
        encoder_layers or layers,
        decoder_layers or encoder_layers or layers,
    )
    for name, count in (("encoder_layers", encoder_layers), ("decoder_layers", decoder_layers)):
        if not 1 <= count <= layers:
            raise MappingError(f"{name}={count}: the BERT checkpoint has {layers} layers")
    fixed = dict(
        vocab_size=bert_cfg.vocab_size,
        d_model=bert_cfg.hidden_size,
        encoder_attention_heads=bert_cfg.num_attention_heads,
        decoder_attention_heads=bert_cfg.num_attention_heads,
        encoder_ffn_dim=bert_cfg.intermediate_size,
        decoder_ffn_dim=bert_cfg.intermediate_size,
        max_position_embeddings=bert_cfg.max_position_embeddings,
        activation_function=bert_cfg.hidden_act,
        layer_norm_eps=bert_cfg.layer_norm_eps,
    )
    clashes = {k: (v, fixed[k]) for k, v in overrides.items() if k in fixed and v != fixed[k]}
    if clashes:
        listed = ", ".join(f"{k}={v!r} (BERT's {b!r})" for k, (v, b) in sorted(clashes.items()))
        raise MappingError(
            f"the generator config does not fit the BERT checkpoint it starts from: {listed}"
        )
    values = dict(overrides, **fixed)
    values.update(
        encoder_layers=encoder_layers, decoder_layers=decoder_layers, scale_embedding=False
    )
    values.update(init_std=values.get("init_std", bert_cfg.initializer_range))
    return bart.BartConfig(**values, **special_ids)


def _flat(tree, prefix=()):
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) or hasattr(value, "items"):
            out.update(_flat(value, prefix + (key,)))
        else:
            out[prefix + (key,)] = np.asarray(value)
    return out


def _unflatten(flat):
    tree = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def map_params(
    cfg: bart.BartConfig,
    bert_params,
    *,
    decoder_init: str = "bert",
    rng: jax.Array,
) -> dict:
    """The `Bart(cfg)` parameter tree from a `BertEncoder` parameter tree (see the module doc).

    Args:
      cfg: from `bart_config` (its stacks no deeper than the BERT's).
      bert_params: `BertEncoder` parameters (`hf.load_bert`).
      decoder_init: "bert" (self-attention and feed-forward from BERT, cross-attention fresh),
        "bert_cross" (cross-attention too, copied from BERT's self-attention) or "random"
        (every decoder layer fresh).
      rng: draws the fresh parameters (BART's init: normal(init_std) kernels, zero biases, unit
        LayerNorms).

    Raises:
      MappingError: naming the BERT parameters that are missing, or that no BART parameter uses.
    """
    if decoder_init not in DECODER_INITS:
        raise MappingError(f"decoder_init must be one of {DECODER_INITS}, got {decoder_init!r}")
    source = _flat(bert_params)
    ids = np.zeros((1, 2), np.int32)
    fresh = _flat(jax.device_get(bart.Bart(cfg).init(rng, ids, ids, ids)["params"]))
    used, missing, out = set(), {}, {}  # missing: BERT path -> the BART paths it was for

    def take(bert_path, bart_path):
        if bert_path not in source:
            missing.setdefault("/".join(bert_path), []).append("/".join(bart_path))
            return
        used.add(bert_path)
        value = source[bert_path]
        want = fresh[bart_path].shape
        if value.shape != want:
            raise MappingError(
                f"BERT {'/'.join(bert_path)} has shape {value.shape}; BART {'/'.join(bart_path)} "
                f"needs {want}"
            )
        out[bart_path] = value.astype(fresh[bart_path].dtype)

    take(("word_embeddings", "embedding"), ("shared", "embedding"))
    if cfg.frozen_encoder_layers > 0:  # a fixed encoder reads its own copy (`models.bart`)
        take(("word_embeddings", "embedding"), ("encoder", "embed_tokens", "embedding"))
    position = ("position_embeddings", "embedding")
    token_type = ("token_type_embeddings", "embedding")
    for part in (position, token_type):
        if part in source:
            used.add(part)
        else:
            missing.setdefault("/".join(part), ["the position tables"])
    for stack, count in (("encoder", cfg.encoder_layers), ("decoder", cfg.decoder_layers)):
        if position in source and token_type in source:
            table = fresh[(stack, "positions", "embedding")].copy()
            table[bart.POSITION_OFFSET :] = source[position] + source[token_type][0]
            out[(stack, "positions", "embedding")] = table.astype(table.dtype)
        for leaf in ("scale", "bias"):
            take(("embeddings_ln", leaf), (stack, "ln_embedding", leaf))
        for i in range(count):
            for path in fresh:
                if path[:2] != (stack, f"layer_{i}"):
                    continue
                module = path[2]
                if stack == "encoder" or (decoder_init != "random" and module not in _CROSS_FROM):
                    take((f"layer_{i}",) + path[2:], path)
                elif decoder_init == "bert_cross":
                    take((f"layer_{i}", _CROSS_FROM[module]) + path[3:], path)
                else:
                    out[path] = fresh[path]
    # Parts of BERT the mapped BART does not use on purpose: the pooler/projection, and layers
    # past the stacks' depth (fewer layers asked for).
    deepest = max(cfg.encoder_layers, cfg.decoder_layers if decoder_init != "random" else 0)
    unexpected = []
    for path in source:
        if path in used or path[0] in _LEFT_OUT:
            continue
        if path[0].startswith("layer_") and int(path[0].split("_")[1]) >= deepest:
            continue
        unexpected.append("/".join(path))
    if missing or unexpected:
        lines = ["the BERT parameters do not map onto the BART generator:"]
        if missing:
            named = [f"{k} (for BART {', '.join(v)})" for k, v in sorted(missing.items())]
            lines.append(f"  missing ({len(missing)}): " + ", ".join(named))
        if unexpected:
            lines.append(f"  unexpected ({len(unexpected)}): " + ", ".join(sorted(unexpected)))
        raise MappingError("\n".join(lines))
    out[("final_logits_bias",)] = np.zeros_like(fresh[("final_logits_bias",)])
    left = sorted(set(fresh) - set(out))
    if left:  # every BART parameter is mapped or drawn fresh above
        raise MappingError(f"BART parameters left unset: {['/'.join(p) for p in left]}")
    return jax.tree.map(jnp.asarray, _unflatten(out))


def bart_from_bert(
    bert_cfg: bert.BertConfig,
    bert_params,
    *,
    special_ids: dict,
    rng: jax.Array,
    encoder_layers: int = 0,
    decoder_layers: int = 0,
    decoder_init: str = "bert",
    **overrides,
) -> tuple[bart.BartConfig, dict]:
    """(BartConfig, parameters) of a generator warm-started from BERT (see the module doc)."""
    cfg = bart_config(
        bert_cfg,
        encoder_layers=encoder_layers,
        decoder_layers=decoder_layers,
        special_ids=special_ids,
        **overrides,
    )
    return cfg, map_params(cfg, bert_params, decoder_init=decoder_init, rng=rng)
