"""Hugging Face checkpoint folders and parameter names: the reading every import builds on.

A checkpoint is a directory written by `save_pretrained` (`config.json` plus `model.safetensors`,
sharded safetensors with an index, or `pytorch_model.bin`), or a hub id when the network allows.
`bert_name` / `bart_name` map a parameter path of ours to the tensor name HF writes; `fill` builds
a parameter tree from a state dict by such a map, and `strict` refuses a state dict with missing or
unexpected names. `hf` (BERT, DPR, BART, RAG), `hf_llama` and `gguf_llama` load through it;
`hf_export` writes the same names back.
"""

import json
import os
import pathlib
import re

import jax
import numpy as np
from safetensors.numpy import save_file

# The process's umask, read once at import (os.umask can only be read by setting it).
_UMASK = os.umask(0o022)
os.umask(_UMASK)

# Tensors a checkpoint may carry that are not parameters (non-persistent buffers in newer versions).
IGNORED = re.compile(r"(^|\.)(position_ids|token_type_ids)$")

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


def check_type(config: dict, expected: tuple[str, ...], path: pathlib.Path) -> None:
    found = config.get("model_type")
    if found not in expected:
        raise CheckpointError(
            f"{path / 'config.json'} has model_type {found!r}; expected one of {expected} "
            f"(architectures: {config.get('architectures')})"
        )


# ---------------------------------------------------------------------------------------------
# Name mapping


def normalise(name: str) -> str:
    """Old BERT checkpoints name LayerNorm parameters gamma/beta."""
    return re.sub(
        r"LayerNorm\.gamma$",
        "LayerNorm.weight",
        re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", name),
    )


def fill(shapes, name_of, state: dict[str, np.ndarray], param_dtype, what: str):
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


def strict(missing: list[str], unexpected: list[str], path) -> None:
    if missing or unexpected:
        lines = [f"checkpoint {path} does not match the model:"]
        if missing:
            lines.append(f"  missing ({len(missing)}): " + ", ".join(sorted(missing)))
        if unexpected:
            lines.append(f"  unexpected ({len(unexpected)}): " + ", ".join(sorted(unexpected)))
        raise CheckpointError("\n".join(lines))


def find_prefix(state: dict, suffix: str, path) -> str:
    hits = sorted(k[: -len(suffix)] for k in state if k.endswith(suffix))
    if len(hits) != 1:
        raise CheckpointError(
            f"expected exactly one tensor ending in {suffix!r} in {path}, found {hits or 'none'}"
        )
    return hits[0]


def save_safetensors(path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """Writes `tensors` to the safetensors file `path` with the permissions any file the process
    writes gets (0644 under the usual umask): the safetensors library writes 0600, which made
    an exported model unreadable to every other user of a shared machine."""
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~_UMASK)
