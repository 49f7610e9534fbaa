"""benchmarks/accelerator_check.py: FLOP count and peaks (benchmarks.flops), batch search, and a
smoke run end to end (benchmarks.accelerator, benchmarks.search_check).

The analytic FLOP count is checked against an independent count: the matmuls (`dot_general`)
in the jaxpr of the very loss the step differentiates, with tiny distinct dimensions.
"""

import functools
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from benchmarks import accelerator as ac
from benchmarks import floor, flops
from rag_jax import rag
from rag_jax.models import bart, bert

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _matmul_flops(jaxpr) -> int:
    """2 x multiply-adds of every dot_general in a jaxpr, nested jaxprs included."""
    return sum(count * floor.flops(p) for p, count in floor.dot_generals(jaxpr).items())


def test_train_flops_counts_exactly_the_matmuls_of_the_loss():
    B, N, Q, S, T = 2, 3, 7, 11, 5
    q_cfg = bert.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                            num_attention_heads=2, intermediate_size=24)  # fmt: skip
    g_cfg = bart.BartConfig(vocab_size=37, d_model=8, encoder_layers=2, decoder_layers=3,
                            encoder_attention_heads=2, decoder_attention_heads=4,
                            encoder_ffn_dim=12, decoder_ffn_dim=20,
                            max_position_embeddings=32)  # fmt: skip
    cfg = rag.RagConfig(question_encoder=q_cfg, generator=g_cfg, n_docs=N)
    params = jax.eval_shape(functools.partial(rag.init_params, cfg), jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    batch = {
        "question_input_ids": rng.integers(3, 50, (B, Q)),
        "question_attention_mask": np.ones((B, Q), np.int32),
        "doc_vectors": rng.normal(size=(B, N, 16)).astype(np.float32),
        "context_input_ids": rng.integers(3, 37, (B * N, S)),
        "context_attention_mask": np.ones((B * N, S), np.int32),
        "labels": rng.integers(3, 37, (B, T)),
    }
    loss = lambda p: rag.loss_fn(cfg, p, batch, "sequence")[0]
    counted = flops.train_flops(q_cfg, g_cfg, B, n_docs=N, question=Q, context=S, target=T)

    assert counted["forward"] == _matmul_flops(jax.make_jaxpr(loss)(params).jaxpr)
    assert counted["train"] == 3 * counted["forward"]
    # Backward: two matmuls per forward one (input and weight gradients); only the doc vectors,
    # an input, get no gradient, so the whole step is within a hair of 3x forward.
    step = _matmul_flops(jax.make_jaxpr(jax.value_and_grad(loss))(params).jaxpr)
    assert 0.99 < step / counted["train"] <= 1.0
    assert (
        counted["question_encoder"] + counted["generator"] + counted["doc_scores"]
        == (counted["train"])
    )


def _fake_attempt(capacity: int, memory=lambda b: 1_000 + 100 * b, with_memory=True):
    tried = []

    def attempt(size):
        tried.append(size)
        if size > capacity:
            return None
        return {"batch": size, "memory_bytes": memory(size) if with_memory else None}

    return attempt, tried


def test_find_largest_batch_explicit_ladder_stops_at_the_first_failure():
    attempt, tried = _fake_attempt(capacity=6)
    best, model = ac.find_largest_batch(attempt, 2, explicit=[8, 2, 4, 16])
    assert best["batch"] == 4 and tried == [2, 4, 8] and model is None


def test_find_largest_batch_memory_model_then_shrinks_after_oom():
    # memory = 1000 + 100 B; 0.92 x 10000 fits B <= 82 -> 80 (multiple of 4), which the device
    # refuses (real capacity 70): 80 * 0.85 = 68 fits.
    attempt, tried = _fake_attempt(capacity=70)
    best, model = ac.find_largest_batch(attempt, 4, probe=8, limit=10_000)
    assert tried == [8, 16, 80, 68] and best["batch"] == 68
    assert model["bytes_per_example"] == 100 and model["fixed_bytes"] == 1_000
    assert model["predicted"] == 82


def test_find_largest_batch_doubles_without_memory_figures():
    attempt, tried = _fake_attempt(capacity=40, with_memory=False)
    best, _ = ac.find_largest_batch(attempt, 1, probe=8, limit=10_000)
    assert tried == [8, 16, 32, 64] and best["batch"] == 32


def test_find_largest_batch_when_nothing_fits():
    attempt, tried = _fake_attempt(capacity=1)
    assert ac.find_largest_batch(attempt, 2, probe=8) == (None, None) and tried == [8]


@pytest.mark.parametrize(
    "kind, tflops, gbps",
    [
        ("NVIDIA H200", 989.0, 4800.0),
        ("NVIDIA H100 80GB HBM3", 989.0, 3350.0),
        ("NVIDIA H100 PCIe", 756.0, 2000.0),
        ("NVIDIA A100-SXM4-80GB", 312.0, 2039.0),
        ("NVIDIA A100-SXM4-40GB", 312.0, 1555.0),
        ("TPU v4", 275.0, 1200.0),
        ("TPU v5 lite", 197.0, 819.0),
        ("TPU v5p", 459.0, 2765.0),
        ("TPU v6 lite", 918.0, 1638.0),
        ("cpu", None, None),
    ],
)
def test_device_peaks(kind, tflops, gbps):
    peaks = flops.device_peaks(kind)
    assert (peaks["tflops"], peaks["gbps"]) == (tflops, gbps)
    assert (peaks["source"] is None) == (tflops is None)


def test_device_peaks_overrides():
    assert flops.device_peaks("NVIDIA H200", gbps=4000.0)["gbps"] == 4000.0
    assert flops.device_peaks("NVIDIA H200", gbps=4000.0)["tflops"] == 989.0
    assert flops.device_peaks("cpu", 2.0, 30.0) == {
        "tflops": 2.0,
        "gbps": 30.0,
        "source": "command line",
    }


def test_is_oom():
    assert ac.is_oom(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate"))
    assert ac.is_oom(ac.SimulatedOOM("batch 8 needs 9 bytes > 8"))
    assert not ac.is_oom(ValueError("shapes (2, 3) and (4,) do not match"))


def test_smoke_run_end_to_end(tmp_path):
    out = tmp_path / "check.json"
    env = dict(
        os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2"
    )
    cmd = [sys.executable, "-m", "benchmarks.accelerator_check", "--smoke",
           "--batch-sizes=2", "--search-batches=1,8", "--peak-tflops=0.5", "--peak-gbps=20",
           f"--out={out}"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    summary = json.loads(proc.stdout.strip().splitlines()[-2])

    device = result["device"]
    assert (device["platform"], device["count"]) == ("cpu", 2)
    assert (device["peak_bf16_tflops"], device["peak_hbm_gbps"]) == (0.5, 20.0)

    tr = result["train"]
    assert "error" not in tr, tr.get("traceback")
    assert tr["batch"] == 2 and tr["per_device_batch"] == 1 and tr["step_s"] > 0
    assert tr["config"]["dtype"] == "bfloat16" and tr["config"]["n_docs"] == 5
    assert tr["mfu"] == pytest.approx(tr["model_flops"]["train"] / tr["step_s"] / (0.5e12 * 2))
    assert summary["mfu"] == pytest.approx(tr["mfu"])
    assert tr["meets_goal"] == (tr["mfu"] >= 0.4)
    # XLA also counts norms, softmax, dropout and AdamW, which the model FLOPs leave out.
    assert 0.5 < tr["analytic_over_xla"] <= 1.0

    se = result["search"]
    assert "error" not in se, se.get("traceback")
    assert se["count"] == 20_000 and se["vector_bytes"] == 20_000 * 768 * 2
    assert [r["batch"] for r in se["rows"]] == [1, 8]
    bound_s = se["vector_bytes"] / (20e9 * 2)
    for row in se["rows"]:
        assert row["index_ids_exact"] and row["index_scores_max_error"] < 1e-3
        assert row["ids_agree_with_reference"] > 0.9
        assert row["bound_s"] == pytest.approx(bound_s)
        assert row["index_fraction_of_bound"] == pytest.approx(bound_s / row["index_s"])
    assert se["best_fraction_of_bound"] == max(r["index_fraction_of_bound"] for r in se["rows"])
