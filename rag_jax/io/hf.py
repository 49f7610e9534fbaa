"""Import of Hugging Face checkpoints: BERT / DPR encoders, BART, and their tokenizers.

A checkpoint is a directory written by `save_pretrained` (`config.json` plus `model.safetensors`,
sharded safetensors with an index, or `pytorch_model.bin`), or a hub id when the network allows.
Loading is strict: every checkpoint tensor must be used and every parameter filled, otherwise the
error lists the missing and the unexpected names. PyTorch's `Linear.weight` is [out, in]; Flax's
`Dense.kernel` is [in, out], hence the transposes.

This module is the public face of the transformers interchange: besides its loaders it names
the export (`save_rag`, `save_dpr`, `save_bart`, `save_passages` from `hf_export`), the
Llama-family causal LMs (`load_llama`, `save_llama`, ... from `hf_llama`, GGUF files through
`gguf_llama`) and the checkpoint-folder reading they share (`hf_format`).
"""

import json
import re

import jax
import numpy as np

from rag_jax import rag
from rag_jax.io import hf_format
from rag_jax.io.hf_export import ExportError, save_bart, save_dpr, save_passages, save_rag
from rag_jax.io.hf_format import (
    CheckpointError,
    bart_name,
    bert_name,
    read_config,
    read_state_dict,
    resolve,
    tensor_names,
)
from rag_jax.io.hf_llama import (
    llama_config_from_hf,
    load_llama,
    load_llama_tokenizer,
    save_llama,
    smollm2_path,
)
from rag_jax.models import bart, bert, layers

# `from rag_jax.io import hf` reaches the whole interchange: the loaders below, the export
# (`hf_export`), the Llama family (`hf_llama`, GGUF through `gguf_llama`) and the checkpoint
# reading they share (`hf_format`).
__all__ = [
    "CheckpointError",
    "ExportError",
    "bart_architecture",
    "bart_config_from_hf",
    "bart_name",
    "bart_params_from_state",
    "bert_architecture",
    "bert_config_from_hf",
    "bert_name",
    "bert_params_from_state",
    "llama_config_from_hf",
    "load_bart",
    "load_bert",
    "load_dpr",
    "load_llama",
    "load_llama_tokenizer",
    "load_rag",
    "load_rag_tokenizers",
    "load_tokenizer",
    "rag_architecture",
    "rag_config_from_hf",
    "read_config",
    "read_state_dict",
    "resolve",
    "save_bart",
    "save_dpr",
    "save_llama",
    "save_passages",
    "save_rag",
    "smollm2_path",
    "tensor_names",
]

# ---------------------------------------------------------------------------------------------
# BERT / DPR


# HF config fields that change what a model computes and that rag_jax does not implement, with
# the value under which the model is the one rag_jax computes. A checkpoint that sets another
# value is refused rather than loaded as a different model; fields that only concern training
# bookkeeping, caching or other heads are not listed.
_BERT_UNSUPPORTED = {
    "position_embedding_type": "absolute",
    "is_decoder": False,
    "add_cross_attention": False,
}
_BART_UNSUPPORTED = {
    "normalize_before": False,  # mBART's pre-LN layers
    "add_final_layer_norm": False,  # mBART
    "normalize_embedding": True,  # old BART configs: layernorm_embedding is always applied here
    "static_position_embeddings": False,
    "add_bias_logits": False,
    "tie_word_embeddings": True,
}


def _refuse_unsupported(config: dict, unsupported: dict, what: str) -> None:
    for field, supported in unsupported.items():
        if config.get(field) is not None and config[field] != supported:
            raise CheckpointError(
                f"{what} config field {field}={config[field]!r} changes the model and is not "
                f"supported (only {field}={supported!r}); it is refused rather than loaded as "
                "another model"
            )


def bert_config_from_hf(config: dict, **overrides) -> bert.BertConfig:
    """Our BertConfig from an HF BERT or DPR config dict; fields that change the model and are
    not implemented are refused (`_BERT_UNSUPPORTED`), the others are read or do not matter."""
    _refuse_unsupported(config, _BERT_UNSUPPORTED, "BERT")
    if config.get("hidden_act", "gelu") not in layers.ACTIVATIONS:
        raise CheckpointError(
            f"BERT config field hidden_act={config['hidden_act']!r} is not supported (one of "
            f"{sorted(layers.ACTIVATIONS)})"
        )
    fields = {f for f in bert.BertConfig.__dataclass_fields__}
    values = {k: v for k, v in config.items() if k in fields}
    values.update(overrides)
    return bert.BertConfig(**values)


def bert_params_from_state(
    cfg: bert.BertConfig, state: dict[str, np.ndarray], prefix: str, path="<state dict>"
):
    """Maps the BERT tensors under `prefix` onto a BertEncoder tree, consuming them from `state`."""
    model = bert.BertEncoder(cfg)
    ids = np.zeros((1, 2), np.int32)
    shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), ids, ids)["params"])
    return hf_format.fill(
        shapes, lambda o: bert_name(o, prefix), state, np.dtype(cfg.param_dtype), "BERT"
    )


def load_bert(path, *, dtype: str = "float32", param_dtype: str = "float32", remat: bool = False):
    """Loads a BERT-family encoder (BertModel or a BertFor* head model; the head is refused).

    Returns:
      (BertConfig, params). `with_pooler` is set when the checkpoint has a pooler.
    """
    path = resolve(path)
    config = read_config(path)
    hf_format.check_type(config, ("bert",), path)
    state = {
        hf_format.normalise(k): v
        for k, v in read_state_dict(path).items()
        if not hf_format.IGNORED.search(k)
    }
    prefix = hf_format.find_prefix(state, "embeddings.word_embeddings.weight", path)
    with_pooler = f"{prefix}pooler.dense.weight" in state
    cfg = bert_config_from_hf(
        config,
        with_pooler=with_pooler,
        projection_dim=0,
        dtype=dtype,
        param_dtype=param_dtype,
        remat=remat,
    )
    params, missing = bert_params_from_state(cfg, state, prefix, path)
    hf_format.strict(missing, sorted(state), path)
    return cfg, params


def load_dpr(path, *, dtype: str = "float32", param_dtype: str = "float32", remat: bool = False):
    """Loads a DPR question or context encoder (`DPRQuestionEncoder` / `DPRContextEncoder`).

    Returns:
      (BertConfig, params); `projection_dim` as in the checkpoint's config.
    """
    path = resolve(path)
    config = read_config(path)
    hf_format.check_type(config, ("dpr",), path)
    state = {
        hf_format.normalise(k): v
        for k, v in read_state_dict(path).items()
        if not hf_format.IGNORED.search(k)
    }
    prefix = hf_format.find_prefix(state, "bert_model.embeddings.word_embeddings.weight", path)
    prefix += "bert_model."
    if not re.fullmatch(r"(question_encoder|ctx_encoder)\.bert_model\.", prefix):
        raise CheckpointError(
            f"{path} holds a DPR model with tensors under {prefix!r}; expected a question encoder "
            "('question_encoder.bert_model.') or a context encoder ('ctx_encoder.bert_model.')"
        )
    cfg = bert_config_from_hf(
        config, with_pooler=False, dtype=dtype, param_dtype=param_dtype, remat=remat
    )
    params, missing = bert_params_from_state(cfg, state, prefix, path)
    hf_format.strict(missing, sorted(state), path)
    return cfg, params


def bert_architecture(path, **overrides) -> bert.BertConfig:
    """The BertConfig `load_bert` or `load_dpr` returns for `path`, from its config.json and
    tensor names alone (no tensor is read): for planning memory before loading."""
    path = resolve(path)
    config = read_config(path)
    hf_format.check_type(config, ("bert", "dpr"), path)
    if config["model_type"] == "dpr":
        return bert_config_from_hf(config, with_pooler=False, **overrides)
    with_pooler = any(
        hf_format.normalise(n).endswith("pooler.dense.weight") for n in tensor_names(path)
    )
    return bert_config_from_hf(config, with_pooler=with_pooler, projection_dim=0, **overrides)


# ---------------------------------------------------------------------------------------------
# BART


def bart_config_from_hf(config: dict, **overrides) -> bart.BartConfig:
    """Our BartConfig from an HF BART config dict (LayerDrop included); fields that change the
    model and are not implemented are refused (`_BART_UNSUPPORTED`)."""
    _refuse_unsupported(config, _BART_UNSUPPORTED, "BART")
    if config.get("activation_function", "gelu") not in layers.ACTIVATIONS:
        raise CheckpointError(
            f"BART config field activation_function={config['activation_function']!r} is not "
            f"supported (one of {sorted(layers.ACTIVATIONS)})"
        )
    # HF's BART has no LayerNorm eps field: a `layer_norm_eps` in its config changes nothing
    # there (every LayerNorm uses 1e-5), so it changes nothing here either.
    fields = {f for f in bart.BartConfig.__dataclass_fields__} - {"layer_norm_eps"}
    values = {k: v for k, v in config.items() if k in fields}
    values.update(overrides)
    return bart.BartConfig(**values)


def bart_params_from_state(cfg: bart.BartConfig, state: dict, prefix: str, path="<state dict>"):
    """Maps the BART tensors under `prefix` (e.g. 'model.') onto a Bart tree, consuming them.

    Tied copies of the shared embedding (encoder/decoder `embed_tokens`, `lm_head`) are checked
    to equal it and consumed.
    """
    shared = state.get(f"{prefix}shared.weight")
    head = prefix.rsplit("model.", 1)[0]
    for tied in (
        f"{prefix}encoder.embed_tokens.weight",
        f"{prefix}decoder.embed_tokens.weight",
        f"{head}lm_head.weight",
    ):
        if tied in state:
            value = state.pop(tied)
            if shared is None:
                state[f"{prefix}shared.weight"] = shared = value
            elif not np.array_equal(value, shared):
                raise CheckpointError(
                    f"{tied} in {path} differs from {prefix}shared.weight; untied embeddings are "
                    "not supported"
                )
    # The bias is a buffer that older checkpoints may omit; the reference then uses zeros.
    state.setdefault(f"{head}final_logits_bias", np.zeros((1, cfg.vocab_size), np.float32))
    shapes = bart.param_shapes(cfg)
    return hf_format.fill(
        shapes, lambda o: bart_name(o, prefix), state, np.dtype(cfg.param_dtype), "BART"
    )


def load_bart(path, *, dtype: str = "float32", param_dtype: str = "float32", remat: bool = False):
    """Loads BART (`BartForConditionalGeneration` or `BartModel`).

    Returns:
      (BartConfig, params).
    """
    path = resolve(path)
    config = read_config(path)
    hf_format.check_type(config, ("bart",), path)
    state = {k: v for k, v in read_state_dict(path).items() if not hf_format.IGNORED.search(k)}
    prefix = hf_format.find_prefix(state, "encoder.layernorm_embedding.weight", path)
    cfg = bart_config_from_hf(config, dtype=dtype, param_dtype=param_dtype, remat=remat)
    params, missing = bart_params_from_state(cfg, state, prefix, path)
    hf_format.strict(missing, sorted(state), path)
    return cfg, params


def bart_architecture(path, **overrides) -> bart.BartConfig:
    """The BartConfig `load_bart` returns for `path`, from its config.json alone."""
    path = resolve(path)
    config = read_config(path)
    hf_format.check_type(config, ("bart",), path)
    return bart_config_from_hf(config, **overrides)


def load_tokenizer(path):
    """The tokenizer saved beside a checkpoint (`transformers.AutoTokenizer`)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve(path)))


# ---------------------------------------------------------------------------------------------
# RAG

_GENERATION_FIELDS = (
    "num_beams",
    "max_length",
    "min_length",
    "length_penalty",
    "early_stopping",
    "no_repeat_ngram_size",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "bad_words_ids",
    "num_return_sequences",
)


def rag_config_from_hf(config: dict, generation: dict | None = None, **overrides):
    """Our RagConfig from an HF RAG config dict (+ its `generation_config.json`, if any).

    Generation defaults come from `generation_config.json`, then the RAG config's own keys, then
    the generator's, then `rag.GenerationConfig`'s defaults.
    """
    question = config.get("question_encoder")
    generator = config.get("generator")
    if not isinstance(question, dict) or not isinstance(generator, dict):
        raise CheckpointError("RAG config needs 'question_encoder' and 'generator' sub-configs")
    if question.get("model_type", "dpr") not in ("dpr", "bert"):
        raise CheckpointError(
            f"question encoder model_type {question.get('model_type')!r} is not supported "
            "(expected 'dpr' or 'bert')"
        )
    if generator.get("model_type", "bart") != "bart":
        raise CheckpointError(
            f"generator model_type {generator.get('model_type')!r} is not supported (expected "
            "'bart')"
        )
    gen_overrides = {
        k: overrides.pop(k) for k in ("dtype", "param_dtype", "remat") if k in overrides
    }
    q_cfg = bert_config_from_hf(question, with_pooler=False, **gen_overrides)
    g_cfg = bart_config_from_hf(generator, **gen_overrides)
    sources = [generation or {}, config, generator]
    gen_values = {}
    for field in _GENERATION_FIELDS:
        for source in sources:
            if source.get(field) is not None:
                gen_values[field] = source[field]
                break
    if "bad_words_ids" in gen_values:
        gen_values["bad_words_ids"] = tuple(tuple(w) for w in gen_values["bad_words_ids"])
    fields = {
        k: config[k]
        for k in (
            "n_docs",
            "max_combined_length",
            "title_sep",
            "doc_sep",
            "prefix",
            "label_smoothing",
            "exclude_bos_score",
            "reduce_loss",
            "do_deduplication",
        )
        if k in config
    }
    # HF reads `config.bos_token_id or config.generator.bos_token_id` (a 0 falls through).
    bos = config.get("bos_token_id") or g_cfg.bos_token_id
    return rag.RagConfig(
        question_encoder=q_cfg,
        generator=g_cfg,
        bos_token_id=bos,
        generation=rag.GenerationConfig(**gen_values),
        **fields,
        **overrides,
    )


def load_rag(path, *, dtype: str = "float32", param_dtype: str = "float32", remat: bool = False):
    """Loads an HF RAG checkpoint (`RagSequenceForGeneration`, `RagTokenForGeneration`, `RagModel`).

    Returns:
      (RagConfig, params) with params {"question_encoder": ..., "generator": ...}.
    """
    path = resolve(path)
    config = read_config(path)
    hf_format.check_type(config, ("rag",), path)
    generation_file = path / "generation_config.json"
    generation = json.loads(generation_file.read_text()) if generation_file.is_file() else None
    cfg = rag_config_from_hf(config, generation, dtype=dtype, param_dtype=param_dtype, remat=remat)
    state = {
        hf_format.normalise(k): v
        for k, v in read_state_dict(path).items()
        if not hf_format.IGNORED.search(k)
    }
    q_prefix = hf_format.find_prefix(state, "bert_model.embeddings.word_embeddings.weight", path)
    q_params, q_missing = bert_params_from_state(
        cfg.question_encoder, state, q_prefix + "bert_model.", path
    )
    g_prefix = hf_format.find_prefix(state, "encoder.layernorm_embedding.weight", path)
    g_params, g_missing = bart_params_from_state(cfg.generator, state, g_prefix, path)
    hf_format.strict(q_missing + g_missing, sorted(state), path)
    return cfg, {"question_encoder": q_params, "generator": g_params}


def rag_architecture(path, **overrides) -> rag.RagConfig:
    """The RagConfig `load_rag` returns for `path`, from its config files alone."""
    path = resolve(path)
    config = read_config(path)
    hf_format.check_type(config, ("rag",), path)
    generation_file = path / "generation_config.json"
    generation = json.loads(generation_file.read_text()) if generation_file.is_file() else None
    return rag_config_from_hf(config, generation, **overrides)


def load_rag_tokenizers(path):
    """(question-encoder tokenizer, generator tokenizer) saved by HF's `RagTokenizer`."""
    path = resolve(path)
    tokenizers = []
    for sub in ("question_encoder_tokenizer", "generator_tokenizer"):
        if not (path / sub).is_dir():
            raise CheckpointError(f"no {sub}/ in {path} (saved by RagTokenizer.save_pretrained)")
        tokenizers.append(load_tokenizer(path / sub))
    return tuple(tokenizers)
