"""benchmarks/causal.py: the quick suite on a tiny random Llama and BERT, and its FLOP count.

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
from rag_jax import hf_llama


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("causal_bench")
    hf_fixtures.save_llama(root / "llama", pad_token_id=2)
    hf_fixtures.save_bert(root / "bert")
    return root / "llama", root / "bert"


@pytest.fixture(scope="module")
def result(folders):
    llama_path, bert_path = folders
    return causal.run(quick=True, llama_path=llama_path, bert_path=bert_path)


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
    for key in ("ours_tok_s", "ref_tok_s", "ours_step_tok_s", "ref_step_tok_s"):
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


def test_matmul_params_are_the_reference_models_linear_weights(folders):
    import transformers

    llama_path, _ = folders
    cfg, _ = hf_llama.load_llama(llama_path)
    model = transformers.LlamaForCausalLM.from_pretrained(llama_path)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert causal.matmul_params(cfg) == linear
    rows, length = 3, 5
    attention = 4 * length**2 * cfg.num_attention_heads * cfg.head_width
    want = 2 * linear * rows * length + attention * cfg.num_hidden_layers * rows
    assert causal.prefill_flops(cfg, rows, length) == want
