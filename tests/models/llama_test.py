"""models.llama against transformers' LlamaForCausalLM (PyTorch), and its caches against
recomputation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import hf_fixtures
from rag_jax.io import hf
from rag_jax.models import llama

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}


def _load(tmp_path, **overrides):
    torch_model = hf_fixtures.save_llama(tmp_path, **overrides)
    cfg, params = hf.load_llama(tmp_path)
    return torch_model, cfg, params


def _hf_logits(torch_model, ids, mask):
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    with torch.no_grad():
        return torch_model(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions),
        ).logits.numpy()


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # GQA, untied
        {"num_key_value_heads": 4, "tie_word_embeddings": True},  # MHA, tied
        {"num_key_value_heads": 1, "head_dim": 6},  # MQA, head_dim not hidden / heads
        {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0},
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    ],
    ids=["gqa", "mha_tied", "mqa_head_dim", "llama3_rope", "linear_rope"],
)
def test_logits_equal_hf_on_left_padded_rows(tmp_path, overrides):
    torch_model, cfg, params = _load(tmp_path, **overrides)
    rng = np.random.default_rng(0)
    ids, mask = hf_fixtures.left_padded_batch(rng, [9, 4, 7], cfg.vocab_size)
    got = np.asarray(llama.logits(cfg, params, ids, mask))
    want = _hf_logits(torch_model, ids, mask)
    real = mask == 1
    np.testing.assert_allclose(got[real], want[real], rtol=1e-4, atol=1e-4)
    # A left-padded row scores as the same row unpadded.
    alone = np.asarray(llama.logits(cfg, params, ids[1:2, -4:], mask[1:2, -4:]))
    np.testing.assert_allclose(got[1, -4:], alone[0], rtol=1e-5, atol=1e-5)


def test_unsupported_rope_scaling_is_refused_by_name():
    with pytest.raises(ValueError, match="'yarn'"):
        llama.LlamaConfig(rope_scaling=(("factor", 4.0), ("rope_type", "yarn")))


def test_decoding_with_prefix_and_past_equals_full_recomputation(tmp_path):
    """Prompts cached once as a prefix shared by k rows each, tokens fed one at a time into a
    past: every step's logits equal the teacher-forced forward of prompt + tokens."""
    _, cfg, params = _load(tmp_path)
    model = llama.Llama(cfg)
    rng = np.random.default_rng(1)
    prompts, prompt_mask = hf_fixtures.left_padded_batch(rng, [6, 3], cfg.vocab_size)
    group, steps = 3, 4
    tokens = rng.integers(3, cfg.vocab_size, size=(2 * group, steps))  # rows (e, j)
    variables = {"params": params}
    positions = llama.positions_from_mask(jnp.asarray(prompt_mask))
    _, kv = model.apply(
        variables, prompts, prompt_mask, positions, method=llama.Llama.hidden
    )  # [E, g, S, d] per layer
    split = lambda a: a[:, None]  # noqa: E731  [E, ...] -> [G = E, m = 1, ...]
    prefix = llama.Prefix(
        tuple(map(split, kv.keys)), tuple(map(split, kv.values)), split(prompt_mask == 1)
    )
    shape = (2 * group, cfg.num_key_value_heads, steps, cfg.head_width)
    past = llama.Past(*(tuple(jnp.zeros(shape) for _ in range(cfg.num_hidden_layers)),) * 2)
    start = np.repeat(np.asarray(positions[:, -1]) + 1, group)  # [R]
    for t in range(steps):
        hidden, past = model.apply(
            variables,
            tokens[:, t : t + 1],
            np.ones((2 * group, 1), np.int32),
            (start + t)[:, None],
            prefix,
            past,
            t,
            method=llama.Llama.hidden,
        )
        got = model.apply(variables, hidden[:, 0], method=llama.Llama.head)
        full_ids = np.concatenate([np.repeat(prompts, group, 0), tokens[:, : t + 1]], 1)
        full_mask = np.concatenate(
            [np.repeat(prompt_mask, group, 0), np.ones_like(tokens[:, : t + 1])], 1
        )
        want = np.asarray(llama.logits(cfg, params, full_ids, full_mask))[:, -1]
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5, err_msg=f"step {t}")


def test_remat_bfloat16_and_frozen_layers(tmp_path):
    _, cfg, params = _load(tmp_path)
    rng = np.random.default_rng(2)
    ids, mask = hf_fixtures.left_padded_batch(rng, [5, 7], cfg.vocab_size)

    def loss(c, p):
        return jnp.sum(jax.nn.log_softmax(llama.Llama(c).apply({"params": p}, ids, mask))[..., 3])

    grads = jax.grad(lambda p: loss(cfg, p))(params)
    remat = jax.grad(lambda p: loss(cfg.replace(remat=True), p))(params)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads, remat
    )
    frozen = jax.grad(lambda p: loss(cfg.replace(frozen_layers=1), p))(params)
    assert not np.any(frozen["layers_0"]["mlp_up_proj"]["kernel"])
    assert np.any(frozen["layers_1"]["mlp_up_proj"]["kernel"])
    np.testing.assert_allclose(
        frozen["layers_1"]["mlp_up_proj"]["kernel"],
        grads["layers_1"]["mlp_up_proj"]["kernel"],
        rtol=1e-5,
        atol=1e-6,
    )
    # bfloat16 compute over float32 parameters: float32 logits within bfloat16 rounding.
    bf16 = cfg.replace(dtype="bfloat16")
    got = np.asarray(llama.logits(bf16, params, ids, mask))
    want = np.asarray(llama.logits(cfg, params, ids, mask))
    assert got.dtype == np.float32
    real = mask == 1
    assert np.max(np.abs(got[real] - want[real])) < 0.05 * np.max(np.abs(want[real]))


def test_logits_is_jitted_and_cached(tmp_path):
    _, cfg, params = _load(tmp_path)
    ids = np.ones((2, 5), np.int32)
    llama.logits(cfg, params, ids)
    size = llama._logits_jit._cache_size()
    llama.logits(cfg, params, ids + 1)
    assert llama._logits_jit._cache_size() == size
    with pytest.raises(ValueError, match="max_position_embeddings"):
        llama.logits(cfg, params, np.ones((1, cfg.max_position_embeddings + 1), np.int32))
