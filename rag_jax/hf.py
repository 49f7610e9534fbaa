"""Import of Hugging Face checkpoints: BERT / DPR encoders, BART, and their tokenizers.

A checkpoint is a directory written by `save_pretrained` (`config.json` plus `model.safetensors`,
sharded safetensors with an index, or `pytorch_model.bin`), or a hub id when the network allows.
Loading is strict: every checkpoint tensor must be used and every parameter filled, otherwise the
error lists the missing and the unexpected names. PyTorch's `Linear.weight` is [out, in]; Flax's
`Dense.kernel` is [in, out], hence the transposes.
"""

import json
import os
import pathlib
import re

import jax
import numpy as np

from rag_jax import rag
from rag_jax.models import bart, bert, layers

# Tensors a checkpoint may carry that are not parameters (non-persistent buffers in newer versions).
_IGNORED = re.compile(r"(^|\.)(position_ids|token_type_ids)$")

# Per transformer layer: our sub-path -> HF sub-name, for BERT and BART layouts.
_BERT_LAYER = {
    "self_attn/query": "attention.self.query",
    "self_attn/key": "attention.self.key",
    "self_attn/value": "attention.self.value",
    "self_attn/out": "attention.output.dense",
    "self_attn_ln": "attention.output.LayerNorm",
    "mlp/wi": "intermediate.dense",
    "mlp/wo": "output.dense",
    "mlp_ln": "output.LayerNorm",
}
_BART_LAYER = {
    "self_attn/query": "self_attn.q_proj",
    "self_attn/key": "self_attn.k_proj",
    "self_attn/value": "self_attn.v_proj",
    "self_attn/out": "self_attn.out_proj",
    "self_attn_ln": "self_attn_layer_norm",
    "cross_attn/query": "encoder_attn.q_proj",
    "cross_attn/key": "encoder_attn.k_proj",
    "cross_attn/value": "encoder_attn.v_proj",
    "cross_attn/out": "encoder_attn.out_proj",
    "cross_attn_ln": "encoder_attn_layer_norm",
    "mlp/wi": "fc1",
    "mlp/wo": "fc2",
    "mlp_ln": "final_layer_norm",
}
_LEAF = {"kernel": "weight", "bias": "bias", "scale": "weight", "embedding": "weight"}


class CheckpointError(ValueError):
    """A checkpoint that does not match the architecture it is loaded as."""


# ---------------------------------------------------------------------------------------------
# Files


def resolve(path: str | os.PathLike) -> pathlib.Path:
    """A local checkpoint directory, or the hub snapshot of `path` when it is a hub id."""
    local = pathlib.Path(path)
    if local.is_dir():
        return local
    if local.exists():
        raise CheckpointError(f"{local} is a file; expected a checkpoint directory")
    try:
        from huggingface_hub import snapshot_download

        return pathlib.Path(snapshot_download(str(path)))
    except Exception as e:  # Offline, unknown id, ...: say what was tried.
        raise CheckpointError(
            f"{path!r} is not a local directory and could not be fetched from the hub ({e})"
        ) from e


def read_config(path: pathlib.Path) -> dict:
    """The parsed `config.json` of a checkpoint directory."""
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(f"no config.json in {path}")
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from e


def read_state_dict(path: pathlib.Path) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint directory as float32/int numpy arrays, by HF name."""
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if single.is_file() or index.is_file():
        from safetensors.numpy import load_file

        files = (
            [single]
            if single.is_file()
            else sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
        )
        state = {}
        for f in files:
            try:
                state.update(load_file(str(f)))
            except Exception as e:
                raise CheckpointError(f"cannot read tensors from {f}: {e}") from e
        return state
    binary = path / "pytorch_model.bin"
    if binary.is_file():
        import torch

        try:
            tensors = torch.load(binary, map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(f"cannot read tensors from {binary}: {e}") from e
        return {
            k: v.float().numpy() if v.is_floating_point() else v.numpy() for k, v in tensors.items()
        }
    raise CheckpointError(
        f"no weights in {path}: expected model.safetensors, model.safetensors.index.json or "
        "pytorch_model.bin"
    )


def tensor_names(path: pathlib.Path) -> list[str]:
    """The tensor names of a checkpoint directory's weights, without reading any tensor."""
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), "numpy") as f:
            return list(f.keys())
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    binary = path / "pytorch_model.bin"
    if binary.is_file():
        import torch

        return list(torch.load(binary, map_location="cpu", weights_only=True, mmap=True))
    raise CheckpointError(
        f"no weights in {path}: expected model.safetensors, model.safetensors.index.json or "
        "pytorch_model.bin"
    )


def _check_type(config: dict, expected: tuple[str, ...], path: pathlib.Path) -> None:
    found = config.get("model_type")
    if found not in expected:
        raise CheckpointError(
            f"{path / 'config.json'} has model_type {found!r}; expected one of {expected} "
            f"(architectures: {config.get('architectures')})"
        )


# ---------------------------------------------------------------------------------------------
# Name mapping


def _normalise(name: str) -> str:
    """Old BERT checkpoints name LayerNorm parameters gamma/beta."""
    return re.sub(
        r"LayerNorm\.gamma$",
        "LayerNorm.weight",
        re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", name),
    )


def _fill(shapes, name_of, state: dict[str, np.ndarray], param_dtype, what: str):
    """Builds our parameter tree from `state`, given `name_of(our_path) -> hf_name`.

    Consumed names are removed from `state`; returns (params, missing).
    """
    missing = []

    def leaf(path, shape):
        ours = "/".join(p.key for p in path)
        name = name_of(ours)
        if name not in state:
            missing.append(f"{name} (for {what} {ours})")
            return np.zeros(shape.shape, param_dtype)
        value = state.pop(name)
        if ours.endswith("kernel"):
            value = value.T
        if ours.endswith("final_logits_bias"):
            value = value.reshape(-1)
        if value.shape != shape.shape:
            raise CheckpointError(
                f"tensor {name} has shape {value.shape}; {what} parameter {ours} needs "
                f"{shape.shape}"
            )
        return np.asarray(value, dtype=param_dtype)

    params = jax.tree_util.tree_map_with_path(leaf, shapes)
    return params, missing


def _layer_name(ours: str, table: dict[str, str], layer_prefix: str) -> str:
    """'layer_3/self_attn/query/kernel' -> f'{layer_prefix}3.<hf sub-name>.weight'."""
    match = re.fullmatch(r"layer_(\d+)/(.+)/(\w+)", ours)
    if not match or match.group(2) not in table:
        return f"<unmapped {ours}>"
    index, sub, leaf = match.groups()
    return f"{layer_prefix}{index}.{table[sub]}.{_LEAF[leaf]}"


def bert_name(ours: str, prefix: str, projection: str = "encode_proj") -> str:
    """HF name of a BertEncoder parameter, for a BERT whose tensors start with `prefix`."""
    head, _, leaf = ours.rpartition("/")
    top = {
        "word_embeddings": "embeddings.word_embeddings",
        "position_embeddings": "embeddings.position_embeddings",
        "token_type_embeddings": "embeddings.token_type_embeddings",
        "embeddings_ln": "embeddings.LayerNorm",
        "pooler": "pooler.dense",
    }
    if head == "projection":
        # DPR's projection sits beside the BERT model, not inside it.
        return f"{prefix.rsplit('bert_model.', 1)[0]}{projection}.{_LEAF[leaf]}"
    if head in top:
        return f"{prefix}{top[head]}.{_LEAF[leaf]}"
    return _layer_name(ours, _BERT_LAYER, f"{prefix}encoder.layer.")


def bart_name(ours: str, prefix: str) -> str:
    """HF name of a Bart parameter, for a BART whose tensors start with `prefix` (e.g. 'model.')."""
    if ours == "final_logits_bias":
        return f"{prefix.rsplit('model.', 1)[0]}final_logits_bias"
    if ours == "shared/embedding":
        return f"{prefix}shared.weight"
    stack, _, rest = ours.partition("/")
    if rest == "positions/embedding":
        return f"{prefix}{stack}.embed_positions.weight"
    if rest.startswith("ln_embedding/"):
        return f"{prefix}{stack}.layernorm_embedding.{_LEAF[rest.rpartition('/')[2]]}"
    return _layer_name(rest, _BART_LAYER, f"{prefix}{stack}.layers.")


def _strict(missing: list[str], unexpected: list[str], path) -> None:
    if missing or unexpected:
        lines = [f"checkpoint {path} does not match the model:"]
        if missing:
            lines.append(f"  missing ({len(missing)}): " + ", ".join(sorted(missing)))
        if unexpected:
            lines.append(f"  unexpected ({len(unexpected)}): " + ", ".join(sorted(unexpected)))
        raise CheckpointError("\n".join(lines))


def _find_prefix(state: dict, suffix: str, path) -> str:
    hits = sorted(k[: -len(suffix)] for k in state if k.endswith(suffix))
    if len(hits) != 1:
        raise CheckpointError(
            f"expected exactly one tensor ending in {suffix!r} in {path}, found {hits or 'none'}"
        )
    return hits[0]


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
    return _fill(shapes, lambda o: bert_name(o, prefix), state, np.dtype(cfg.param_dtype), "BERT")


def load_bert(path, *, dtype: str = "float32", param_dtype: str = "float32", remat: bool = False):
    """Loads a BERT-family encoder (BertModel or a BertFor* head model; the head is refused).

    Returns:
      (BertConfig, params). `with_pooler` is set when the checkpoint has a pooler.
    """
    path = resolve(path)
    config = read_config(path)
    _check_type(config, ("bert",), path)
    state = {_normalise(k): v for k, v in read_state_dict(path).items() if not _IGNORED.search(k)}
    prefix = _find_prefix(state, "embeddings.word_embeddings.weight", path)
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
    _strict(missing, sorted(state), path)
    return cfg, params


def load_dpr(path, *, dtype: str = "float32", param_dtype: str = "float32", remat: bool = False):
    """Loads a DPR question or context encoder (`DPRQuestionEncoder` / `DPRContextEncoder`).

    Returns:
      (BertConfig, params); `projection_dim` as in the checkpoint's config.
    """
    path = resolve(path)
    config = read_config(path)
    _check_type(config, ("dpr",), path)
    state = {_normalise(k): v for k, v in read_state_dict(path).items() if not _IGNORED.search(k)}
    prefix = _find_prefix(state, "bert_model.embeddings.word_embeddings.weight", path)
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
    _strict(missing, sorted(state), path)
    return cfg, params


def bert_architecture(path, **overrides) -> bert.BertConfig:
    """The BertConfig `load_bert` or `load_dpr` returns for `path`, from its config.json and
    tensor names alone (no tensor is read): for planning memory before loading."""
    path = resolve(path)
    config = read_config(path)
    _check_type(config, ("bert", "dpr"), path)
    if config["model_type"] == "dpr":
        return bert_config_from_hf(config, with_pooler=False, **overrides)
    with_pooler = any(_normalise(n).endswith("pooler.dense.weight") for n in tensor_names(path))
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
    return _fill(shapes, lambda o: bart_name(o, prefix), state, np.dtype(cfg.param_dtype), "BART")


def load_bart(path, *, dtype: str = "float32", param_dtype: str = "float32", remat: bool = False):
    """Loads BART (`BartForConditionalGeneration` or `BartModel`).

    Returns:
      (BartConfig, params).
    """
    path = resolve(path)
    config = read_config(path)
    _check_type(config, ("bart",), path)
    state = {k: v for k, v in read_state_dict(path).items() if not _IGNORED.search(k)}
    prefix = _find_prefix(state, "encoder.layernorm_embedding.weight", path)
    cfg = bart_config_from_hf(config, dtype=dtype, param_dtype=param_dtype, remat=remat)
    params, missing = bart_params_from_state(cfg, state, prefix, path)
    _strict(missing, sorted(state), path)
    return cfg, params


def bart_architecture(path, **overrides) -> bart.BartConfig:
    """The BartConfig `load_bart` returns for `path`, from its config.json alone."""
    path = resolve(path)
    config = read_config(path)
    _check_type(config, ("bart",), path)
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
    _check_type(config, ("rag",), path)
    generation_file = path / "generation_config.json"
    generation = json.loads(generation_file.read_text()) if generation_file.is_file() else None
    cfg = rag_config_from_hf(config, generation, dtype=dtype, param_dtype=param_dtype, remat=remat)
    state = {_normalise(k): v for k, v in read_state_dict(path).items() if not _IGNORED.search(k)}
    q_prefix = _find_prefix(state, "bert_model.embeddings.word_embeddings.weight", path)
    q_params, q_missing = bert_params_from_state(
        cfg.question_encoder, state, q_prefix + "bert_model.", path
    )
    g_prefix = _find_prefix(state, "encoder.layernorm_embedding.weight", path)
    g_params, g_missing = bart_params_from_state(cfg.generator, state, g_prefix, path)
    _strict(q_missing + g_missing, sorted(state), path)
    return cfg, {"question_encoder": q_params, "generator": g_params}


def rag_architecture(path, **overrides) -> rag.RagConfig:
    """The RagConfig `load_rag` returns for `path`, from its config files alone."""
    path = resolve(path)
    config = read_config(path)
    _check_type(config, ("rag",), path)
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


# ---------------------------------------------------------------------------------------------
# Export: `rag_jax.hf_export` builds on the name maps above; `hf.save_rag` etc. are its functions.
# The two modules read each other's names only when called, so either may be imported first.

from rag_jax import hf_export, hf_llama  # noqa: E402

# Llama-family causal LMs (`rag_jax.hf_llama`): hf.load_llama, hf.save_llama, ...
_LLAMA = (
    "load_llama",
    "save_llama",
    "llama_config_from_hf",
    "load_llama_tokenizer",
    "smollm2_path",
)


def __getattr__(name: str):
    if name in hf_export.__all__:
        return getattr(hf_export, name)
    if name in _LLAMA:
        return getattr(hf_llama, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
