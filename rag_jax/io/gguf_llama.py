"""GGUF files (llama.cpp's format) of Llama-architecture models to `models.llama`.

`hf.load_llama(path.gguf)` comes here. The file is read with `gguf.GGUFReader` (a memory map; no
torch): the config from its metadata (`llama.*` keys, token ids from `tokenizer.ggml.*`), the
tensors from their llama.cpp names, dequantised to float32 with `gguf.quants.dequantize`.

Layout differences from a `save_pretrained` folder, undone here:

- GGUF lists a tensor's shape innermost first (`[in, out]` for a weight whose bytes are the
  row-major `[out, in]` of PyTorch's `Linear.weight`); the dequantised array is `[out, in]`.
- llama.cpp's converter (`LlamaModel.permute` in convert_hf_to_gguf.py) reorders the rows of the
  query and key projections, per head, from HF's rotate-half layout (the two halves of a head)
  to interleaved pairs: `w.reshape(heads, 2, d / 2, in).swapaxes(1, 2)`. `unpermute` inverts it
  (query heads for `attn_q`, key/value heads for `attn_k`).
- A tied model has no `output.weight`.
- Llama 3's frequency scaling is not in the metadata: the converter writes the per-frequency
  divisors as a tensor `rope_freqs.weight` [d / 2]. It is read back as `rope_type="llama3"` with
  the converter's constants (low/high frequency factors 1 and 4, an original context of 8192
  unless `llama.rope.scaling.original_context_length` says otherwise) and accepted only if it
  equals what `llama.rope_frequencies` then computes; any other `rope_freqs.weight` is refused.

Loading is strict as `hf.py`'s: metadata that changes the model in a way not implemented, a
tensor type outside `SUPPORTED_TYPES`, and missing or unexpected tensors are refused by name.
"""

import pathlib
import re

import jax
import numpy as np

from rag_jax.io import hf_format
from rag_jax.models import llama

# Tensor types dequantised here (`gguf.GGMLQuantizationType` names); any other is refused.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
ROPE_FREQS = "rope_freqs.weight"

# Our per-layer parameter -> its GGUF name under `blk.{i}.` (all `.weight`).
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn_q_proj": "attn_q",
    "self_attn_k_proj": "attn_k",
    "self_attn_v_proj": "attn_v",
    "self_attn_o_proj": "attn_output",
    "mlp_gate_proj": "ffn_gate",
    "mlp_up_proj": "ffn_up",
    "mlp_down_proj": "ffn_down",
}
# Metadata that changes a llama model and is not implemented: key -> the value computed here.
_UNSUPPORTED = {
    "llama.expert_count": 0,  # Mixtral-style mixture of experts
    "llama.expert_used_count": 0,
    "llama.logit_scale": 1.0,
    "llama.attention.max_alibi_bias": 0.0,
    "llama.attention.clamp_kqv": 0.0,
}
# llama.cpp's convert_hf_to_gguf.py defaults for the Llama 3 frequency factors it writes.
_LLAMA3 = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_MISSING = object()


def gguf_name(ours: str) -> str:
    """GGUF name of a Llama parameter ('layers_3/mlp_up_proj/kernel' -> 'blk.3.ffn_up.weight')."""
    top = {
        "embed_tokens/embedding": "token_embd.weight",
        "norm/scale": "output_norm.weight",
        "lm_head/kernel": "output.weight",
    }
    if ours in top:
        return top[ours]
    match = re.fullmatch(r"layers_(\d+)/(\w+)/(kernel|scale)", ours)
    if not match or match.group(2) not in _LAYER:
        return f"<unmapped {ours}>"
    return f"blk.{match.group(1)}.{_LAYER[match.group(2)]}.weight"


def open_gguf(path):
    """A `gguf.GGUFReader` of `path` (memory-mapped, read-only); unreadable files are refused."""
    import gguf

    path = pathlib.Path(path)
    if not path.is_file():
        raise hf_format.CheckpointError(f"no GGUF file at {path}")
    try:
        return gguf.GGUFReader(str(path), "r")
    except Exception as e:  # Bad magic, truncated file, ...: say which file.
        raise hf_format.CheckpointError(f"cannot read {path} as a GGUF file: {e}") from e


def _value(reader, key: str, default=_MISSING):
    """The scalar (or string) metadata value of `key`; `default` when absent, else refused."""
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise hf_format.CheckpointError(f"GGUF metadata key {key!r} is missing")
        return default
    value = field.contents()
    if isinstance(value, list):
        raise hf_format.CheckpointError(
            f"GGUF metadata {key} is a per-layer list ({value[:4]}...); only one value for all "
            "layers is supported"
        )
    return value


def _f32(value) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-5, not 9.99e-06)."""
    return float(str(np.float32(value)))


def dequantize(tensor) -> np.ndarray:
    """A `ReaderTensor` as float32 in numpy order (GGUF's shape reversed: `[out, in]` for a
    weight), a copy that does not hold the file's memory map; unsupported types refused."""
    import gguf

    kind = gguf.GGMLQuantizationType(tensor.tensor_type).name
    if kind not in SUPPORTED_TYPES:
        raise hf_format.CheckpointError(
            f"GGUF tensor {tensor.name} has type {kind}, which is not supported (supported: "
            f"{', '.join(SUPPORTED_TYPES)})"
        )
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    value = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return np.array(value, np.float32).reshape(shape)  # np.array copies the F32 view


def unpermute(w: np.ndarray, heads: int, name: str = "tensor") -> np.ndarray:
    """Inverse of llama.cpp's query/key row permutation: [heads * d, in] -> [heads * d, in]."""
    rows = w.shape[0]
    if rows % (2 * heads):
        raise hf_format.CheckpointError(
            f"{name} has {rows} rows, not a multiple of 2 * {heads} heads"
        )
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope(reader, cfg: llama.LlamaConfig, path) -> llama.LlamaConfig:
    """`cfg` with the rope scaling of the metadata (and `rope_freqs.weight`, checked) applied."""
    kind = str(_value(reader, "llama.rope.scaling.type", "none"))
    legacy = _f32(_value(reader, "llama.rope.scale_linear", 1.0))  # older files' linear factor
    if kind == "none" and legacy != 1.0:
        kind = "linear"
    if kind == "linear":
        factor = _f32(_value(reader, "llama.rope.scaling.factor", legacy))
        cfg = cfg.replace(rope_scaling=(("factor", factor), ("rope_type", "linear")))
    elif kind != "none":
        raise hf_format.CheckpointError(
            f"{path} uses rope scaling {kind!r} (llama.rope.scaling.type); only linear and "
            "Llama 3's (rope_freqs.weight) are supported"
        )
    tensor = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if tensor is None:
        return cfg
    divisors = dequantize(tensor)
    if kind == "none" and not np.all(divisors == 1.0):
        context = int(_value(reader, "llama.rope.scaling.original_context_length", 8192))
        scaling = dict(_LLAMA3, factor=_f32(divisors.max()), rope_type="llama3")
        scaling.update(original_max_position_embeddings=context)
        cfg = cfg.replace(rope_scaling=tuple(sorted(scaling.items())))
    # The divisors llama.cpp applies on top of θ (a linear factor is applied separately).
    base = llama.rope_frequencies(cfg.replace(rope_scaling=None))
    expected = base / llama.rope_frequencies(cfg) if kind == "none" else np.ones_like(base)
    if divisors.shape != expected.shape or not np.allclose(divisors, expected, rtol=1e-5, atol=0):
        raise hf_format.CheckpointError(
            f"{ROPE_FREQS} in {path} ({divisors.shape}: {divisors.tolist()[:8]}...) is not the "
            f"rope frequency scaling the config computes ({expected.tolist()[:8]}..., from "
            f"rope_scaling={cfg.rope_scaling}); refused rather than loaded as another model"
        )
    return cfg


def config_from_reader(reader, path="<gguf>", **overrides) -> llama.LlamaConfig:
    """Our LlamaConfig from a GGUF file's metadata (and tensor list: tied when there is no
    `output.weight`); other architectures and unsupported settings are refused by name."""
    architecture = _value(reader, "general.architecture", None)
    if architecture != "llama":
        raise hf_format.CheckpointError(
            f"{path} holds a {architecture!r} model (general.architecture); only 'llama' GGUF "
            "files are supported"
        )
    for key, value in _UNSUPPORTED.items():
        found = _value(reader, key, value)
        if found != value:
            raise hf_format.CheckpointError(
                f"GGUF metadata {key}={found!r} in {path} changes the model and is not supported "
                f"(only {value!r})"
            )
    get = lambda key, default=_MISSING: _value(reader, f"llama.{key}", default)  # noqa: E731
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // heads))
    for key in ("attention.value_length", "rope.dimension_count"):
        if int(get(key, head_dim)) != head_dim:
            raise hf_format.CheckpointError(
                f"GGUF metadata llama.{key}={get(key)} in {path} differs from the head width "
                f"{head_dim}; only full-width rotary heads of equal key and value widths are "
                "supported"
            )
    vocab = get("vocab_size", None)
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise hf_format.CheckpointError(
                f"{path} has neither llama.vocab_size nor tokenizer.ggml.tokens: no vocab size"
            )
        vocab = len(tokens.data)
    token = lambda kind: _value(reader, f"tokenizer.ggml.{kind}_token_id", None)  # noqa: E731
    eos = token("eos")
    eos = llama.LlamaConfig.eos_token_id if eos is None else int(eos)
    pad, bos = token("padding"), token("bos")
    cfg = llama.LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=int(get("context_length")),
        rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon")),
        rope_theta=_f32(get("rope.freq_base", 10000.0)),
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=eos,
        pad_token_id=eos if pad is None else int(pad),
    )
    return _rope(reader, cfg, path).replace(**overrides)


def read_config(path, **overrides) -> llama.LlamaConfig:
    """The LlamaConfig `load` returns for a .gguf file, from its metadata (no weight is read)."""
    return config_from_reader(open_gguf(path), pathlib.Path(path), **overrides)


def load(path, *, dtype: str = "float32", param_dtype: str = "float32", remat: bool = False):
    """Loads a Llama-architecture `.gguf` file.

    Tensors: `token_embd.weight` [V, H], per layer `blk.{i}.{attn_norm, ffn_norm}.weight` [H],
    `attn_q` [h d, H], `attn_k`, `attn_v` [g d, H], `attn_output` [H, h d], `ffn_gate`, `ffn_up`
    [F, H], `ffn_down` [H, F] (numpy order), `output_norm.weight` [H], and `output.weight` [V, H]
    unless tied; `rope_freqs.weight` [d / 2] when it matches the config (see the module docstring).

    Returns:
      (LlamaConfig, params), the pair `llama.logits` takes; float32 dequantised values cast to
      `param_dtype`.
    """
    path = pathlib.Path(path)
    reader = open_gguf(path)
    cfg = config_from_reader(reader, path, dtype=dtype, param_dtype=param_dtype, remat=remat)
    shapes = llama.param_shapes(cfg)
    leaves = jax.tree_util.tree_leaves_with_path(shapes)
    wanted = {gguf_name(ours): ours for ours in ("/".join(k.key for k in p) for p, _ in leaves)}
    # Names first (the reader refuses duplicates), so nothing is dequantised for a wrong file.
    tensors = {t.name: t for t in reader.tensors if t.name != ROPE_FREQS}
    missing = [f"{name} (for Llama {ours})" for name, ours in wanted.items() if name not in tensors]
    hf_format.strict(missing, [name for name in tensors if name not in wanted], path)

    state = {name: dequantize(t) for name, t in tensors.items()}
    for i in range(cfg.num_hidden_layers):
        for kind, heads in (("q", cfg.num_attention_heads), ("k", cfg.num_key_value_heads)):
            name = f"blk.{i}.attn_{kind}.weight"
            state[name] = unpermute(state[name], heads, name)
    params, missing = hf_format.fill(shapes, gguf_name, state, np.dtype(cfg.param_dtype), "Llama")
    hf_format.strict(missing, sorted(state), path)
    return cfg, params
