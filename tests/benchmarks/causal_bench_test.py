"""benchmarks/causal.py: the quick suite (a tiny random Llama and BERT), and its FLOP count.

Timings are not checked (they depend on the machine); what is: every part returns its row with
the suite's columns, both sides compute the same thing (logits, loss, gradient norm), every
decoding step ran on both sides, and the analytic matmul weight count equals the reference
model's `nn.Linear` weights.
"""

import math

import pytest
import torch

import hf_fixtures
from benchmarks import causal
from rag_jax.io import hf_llama


@pytest.fixture(scope="module")
def result():
    return causal.run(quick=True)


def test_quick_suite_returns_one_row_per_part_with_its_columns(result):
    assert [row["case"].split()[0] for row in result["rows"]] == ["prefill", "decode", "joint"]
    assert result["columns"][0] == "case"
    assert set(result["part_s"]) == {"prefill", "decode", "joint"}
    for row in result["rows"]:
        for key in ("ours_s", "ref_s", "speedup", "speedup_min", "compile_s", "part_s"):
            assert math.isfinite(row[key]) and row[key] >= 0, (row["case"], key)
        assert row["speedup"] == pytest.approx(row["ref_s"] / row["ours_s"])
        assert len(row["ours_runs_s"]) == len(row["ref_runs_s"]) >= 1
    prefill, decode, joint = result["rows"]
    assert prefill["ours_gflop_s"] > 0 and prefill["ref_gflop_s"] > 0
    assert prefill["floor_gflop"] == pytest.approx(prefill["model_gflop"])
    assert 0 < prefill["floor_ms"] <= prefill["xla_floor_ms"]
    for key in ("ours_tok_s", "ref_tok_s", "ours_step_tok_s", "ref_step_tok_s", "step_speedup"):
        assert key in decode
    sizes = result["sizes"]["decode"]
    assert decode["decoder_rows"] == sizes["batch"] * sizes["n_docs"] * sizes["beams"]
    assert "loss_ours" in joint


def test_both_sides_compute_the_same_thing(result):
    prefill, decode, joint = result["rows"]
    assert prefill["max_abs_diff"] < 1e-3
    assert decode["all_steps"]
    assert joint["loss_rel_diff"] < 1e-4
    assert joint["grad_norm_ours"] == pytest.approx(joint["grad_norm_ref"], rel=1e-3)
    assert joint["grad_norm_ref"] > 0


@pytest.mark.parametrize("tied", [True, False])
def test_matmul_params_are_the_reference_models_linear_weights(tmp_path, tied):
    import transformers

    if tied:
        llama_path, _ = causal.save_tiny(tmp_path)
    else:
        llama_path = tmp_path / "untied"
        hf_fixtures.save_llama(llama_path)
    cfg, _ = hf_llama.load_llama(llama_path)
    model = transformers.LlamaForCausalLM.from_pretrained(llama_path)
    assert model.config.tie_word_embeddings == tied
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert causal.matmul_params(cfg) == linear
    rows, length = 3, 5
    attention = 4 * length**2 * cfg.num_attention_heads * cfg.head_width
    want = 2 * linear * rows * length + attention * cfg.num_hidden_layers * rows
    assert causal.prefill_flops(cfg, rows, length) == want


def test_prefill_flops_equal_the_products_of_llama_logits(tmp_path):
    import jax
    import jax.numpy as jnp

    from benchmarks import floor
    from rag_jax.models import llama

    llama_path, _ = causal.save_tiny(tmp_path)
    cfg, params = hf_llama.load_llama(llama_path)
    ids = jnp.ones((3, 7), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p, i: llama.logits(cfg, p, i, jnp.ones_like(i)))(params, ids)
    products = floor.dot_generals(jaxpr.jaxpr)
    assert sum(n * floor.flops(p) for p, n in products.items()) == causal.prefill_flops(cfg, 3, 7)
