"""The trainer's programs compiled by the TPU compiler for a 2x2 v5e topology, on this CPU host:
the report's invariants on a tiny config (memory parts add up and match the arguments, XLA's
FLOPs agree with the analytic count, the in-step search moves nothing to the host, fsdp splits
the state), the same for a tiny causal (Llama) generator planned from a config.json alone, what
an unfittable config reports, and the command line's one-line errors.

Needs `libtpu` (`pip install 'rag_jax[tpu]'`); CI installs it and sets RAG_JAX_REQUIRE_LIBTPU=1
so that these tests cannot silently skip there.
"""

import gzip
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

from benchmarks import aot, attention_traffic, hbm_fit, tpu_topology
from benchmarks.flops import causal_train_flops
from rag_jax.devices import device_memory, sharding
from rag_jax.training import loop
from tiny_runs import tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOPOLOGY = "v5e:2x2"

if not tpu_topology.has_libtpu():
    if os.environ.get("RAG_JAX_REQUIRE_LIBTPU") == "1":
        raise RuntimeError("RAG_JAX_REQUIRE_LIBTPU=1 but libtpu is not installed")
    pytest.skip("libtpu is not installed (pip install 'rag_jax[tpu]')", allow_module_level=True)


def _config(**overrides):
    return tiny_config(**{"train.batch_size": 8, "eval.batch_size": 8, **overrides})


@pytest.fixture(scope="module")
def target():
    return tpu_topology.target(TOPOLOGY)


@pytest.fixture(scope="module")
def rows(target):
    """Train steps: host index replicated and fsdp, in-step index replicated; generation."""
    out = {}
    for layout in ("replicated", "fsdp"):
        p = aot.plan(_config(**{"train.param_sharding": layout}))
        out[layout] = aot.train_row(p, target, 8, in_step=False)
        if layout == "replicated":
            out["in_step"] = aot.train_row(p, target, 8, in_step=True)
            out["generate"] = aot.generate_row(p, target, 8, "token", num_beams=4)
            out["plan"] = p
    return out


def test_the_topology(target):
    assert target.chips == 4 and target.kind == "TPU v5 lite" and target.hosts == 1
    assert 15 * 2**30 < target.hbm_bytes <= 16 * 2**30  # v5e: 16 GiB, less what XLA keeps
    assert target.peaks["tflops"] == 197.0 and target.peaks["gbps"] == 819.0


@pytest.mark.parametrize("name", ["replicated", "fsdp", "in_step", "generate"])
def test_memory_parts_add_up_and_match_the_arguments(rows, name):
    row = rows[name]
    memory = row["memory"]
    assert row["fits"] and memory["total"] == sum(v for k, v in memory.items() if k != "total")
    assert all(v >= 0 for v in memory.values()), memory
    # XLA's argument bytes are the named arguments plus the rest (the step counter, the padding
    # of arrays to (8, 128) tiles): never less; unsplit 64-wide arrays at most double.
    named = sum(row["arguments"].values())
    assert memory["other arguments"] >= 0
    if name != "fsdp":  # fsdp's 16-wide shards pad far more, in this tiny model only
        assert memory["other arguments"] <= named
    p = rows["plan"]
    whole = device_memory.tree_bytes(p.params)
    if name == "generate":  # generation reads the question tower and the generator only
        whole = sum(device_memory.tree_bytes(p.params[k]) for k in aot.GENERATION_PARAMS)
    if name == "fsdp":  # every array with a dimension 4 divides is split four ways
        assert row["arguments"]["parameters"] < 0.3 * whole
    else:
        assert row["arguments"]["parameters"] == whole


def test_xla_flops_agree_with_the_analytic_count(rows):
    for name in ("replicated", "fsdp", "in_step"):
        flops = rows[name]["flops"]
        assert flops["agree_within_10pct"], flops
        assert 0.9 <= flops["xla"] / flops["analytic_as_xla_counts"] <= 1.1
    assert rows["in_step"]["flops"]["search"] > 0


def test_the_in_step_search_moves_nothing_to_the_host(rows):
    row = rows["in_step"]
    assert row["host_transfers"] == []
    p = rows["plan"]
    rows_per_chip = math.ceil(p.index["rows"] / 4)
    assert row["arguments"]["index shard"] == rows_per_chip * p.index["dim"] * 4  # float32


def test_gradients_are_all_reduced_or_reduce_scattered(rows):
    replicated, fsdp = rows["replicated"]["collectives"], rows["fsdp"]["collectives"]
    trainable = replicated["trainable_f32_bytes"]
    # One all-reduce of the trainable gradients (float32 here) and the metrics; XLA leaves out
    # the rows of the position tables no token reaches (their gradient is zero).
    assert 0.9 * trainable <= replicated["gradient_sync_bytes"] <= 1.1 * trainable
    assert set(replicated["by_dtype"]) == {"all-reduce f32"}
    # fsdp: the parameters all-gathered where the step uses them (in bfloat16 where the TPU's
    # matmuls round them anyway), the gradients summed back onto their shards.
    assert fsdp["all-gather"] >= 0.5 * trainable, fsdp
    assert 0.75 * trainable <= fsdp["gradient_sync_bytes"] <= 1.1 * trainable, fsdp


def test_roofline_is_the_slower_of_compute_and_memory(rows, target):
    roof = rows["replicated"]["roofline"]
    assert roof["step_s"] == max(roof["compute_s"], roof["memory_s"])
    flops = rows["replicated"]["flops"]
    assert roof["compute_s"] == pytest.approx(flops["executed"] / (197e12))


def test_the_traffic_outside_the_model_is_one_adamw_pass(rows):
    """The "optimizer and the rest" part, split by kind, adds up to it, and is mostly the AdamW
    update, which moves each trainable parameter in one pass: at most the float32 parameter,
    gradient and both moments read and the parameter and moments written, 28 bytes."""
    row = rows["replicated"]
    split, part = row["bytes"]["hbm_optimizer_and_the_rest"], row["bytes"]["hbm_by_part"]
    assert sum(split.values()) == part["optimizer and the rest"]
    assert max(split, key=split.get) == "optimizer update", split
    trainable = row["collectives"]["trainable_f32_bytes"] / 4
    assert 12 <= split["optimizer update"] / trainable <= 28, split


def test_a_config_that_cannot_fit_says_which_part_and_what_would(target):
    """An index of 2^30 float32 vectors of 64 (64 GiB per chip on 4) cannot sit in 16 GB."""
    p = aot.plan(_config(**{"retrieval.index_rows": 2**30, "retrieval.index_dtype": "float32"}))
    row = aot.train_row(p, target, 8, in_step=True)
    assert not row["fits"] and "xla_error" in row  # the compiler's refusal, as a result
    tips = hbm_fit.advice(row, target, [])
    assert tips["largest_part"] == "index shard"
    assert tips["over_by_bytes"] == tips["needed_bytes"] - target.hbm_bytes > 40 * 2**30
    assert tips["chips_needed_at_least"] >= 2**30 * 64 * 4 // target.hbm_bytes
    assert "more than the 15.75 GiB of HBM per chip" in tips["why"]


def test_an_int8_device_index_halves_the_bfloat16_shard_in_the_compiled_step(target):
    """The in-step search over 2^22 x 64 rows (2^20 a chip): int8 codes and a float32 scale a
    row take 68 bytes a row against bfloat16's 128, in the arguments and in the compiled
    program's own accounting, and the search reads them as int8."""
    rows = {}
    for storage in ("", "int8"):
        overrides = {"retrieval.index_rows": 2**22, "retrieval.index_dtype": "bfloat16"}
        p = aot.plan(_config(**overrides, **{"retrieval.device_storage": storage}))
        rows[storage] = aot.train_row(p, target, 8, in_step=True, detail=False)
    per_chip = 2**22 // target.chips
    assert rows[""]["arguments"]["index shard"] == per_chip * 64 * 2
    assert rows["int8"]["arguments"]["index shard"] == per_chip * (64 + 4)
    saved = rows[""]["memory"]["total"] - rows["int8"]["memory"]["total"]
    assert saved >= per_chip * (128 - 68) * 0.9, (rows[""]["memory"], rows["int8"]["memory"])


def _cli(*args):
    return subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "tpu_compile.py"),
         f"--config={ROOT / 'experiments' / 'configs' / 'default.py'}", *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_bad_input_ends_with_one_line():
    bad_batch = _cli(f"--topology={TOPOLOGY}", "--config.train.batch_size=6")
    assert bad_batch.returncode == 2
    line = bad_batch.stderr.strip().splitlines()[-1]
    assert line.startswith("error: config.train.batch_size 6 does not split over the 4 chips")
    assert "use a multiple of 4 (e.g. 4 or 8)" in line
    unknown = _cli("--topology=v5e:3x3")
    assert unknown.returncode == 2
    assert (
        unknown.stderr.strip()
        .splitlines()[-1]
        .startswith("error: libtpu refused TPU topology 'v5e:3x3'")
    )


def test_the_state_compiled_for_is_the_trainers(rows):
    """The compile's state placement is `loop.abstract_state`'s, the restore target."""
    p = rows["plan"]
    mesh = sharding.data_mesh(jax.devices()[:1])
    state = loop.abstract_state(p.config, p.params, p.tx, mesh, in_step=False)
    assert (
        device_memory.per_device_bytes(state.params)
        == rows["replicated"]["arguments"]["parameters"]
    )


# A tiny Llama architecture (grouped key/value heads, tied head): planning reads config.json only.
TINY_LLAMA = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}  # fmt: skip


@pytest.fixture(scope="module")
def causal(target, tmp_path_factory):
    """A causal generator's train step (fsdp, remat) and RAG-Sequence generation (the prompts'
    prefix cache shared by the beams, each beam's past, thorough rescoring)."""
    folder = tmp_path_factory.mktemp("tiny_llama")
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    settings = {"model.generator_path": str(folder), "rag.keep_question": True,
                "train.freeze": r"^passage_encoder/", "model.remat": True,
                "train.param_sharding": "fsdp"}  # fmt: skip
    p = aot.plan(_config(**settings))
    train = aot.train_row(p, target, 8, in_step=False)
    generate = aot.generate_row(p, target, 8, "sequence", num_beams=2)
    return p, train, generate


def test_a_causal_generator_compiles_and_its_report_adds_up(causal):
    p, train, generate = causal
    assert p.rag_cfg.causal and p.rag_cfg.generator.num_key_value_heads == 2
    assert "tiny_llama" in p.sources["generator"]  # its config.json, no weights
    for row in (train, generate):
        memory = row["memory"]
        assert row["fits"] and memory["total"] == sum(v for k, v in memory.items() if k != "total")
        assert all(v >= 0 for v in memory.values()), memory
        assert row["host_transfers"] == []
    whole = device_memory.tree_bytes(p.params)
    assert train["arguments"]["parameters"] < 0.3 * whole  # fsdp: split four ways
    collectives = train["collectives"]
    assert collectives["all-gather"] > 0 and collectives["gradient_sync_bytes"] > 0
    assert generate["loops"]  # the decoding loop


def test_a_causal_generators_flops_are_the_llama_count(causal):
    p, train, _ = causal
    config, b = p.config, train["per_chip_batch"]
    shapes = dict(
        n_docs=p.rag_cfg.n_docs,
        question=config.data.question_length,
        context=p.rag_cfg.max_combined_length,
        target=config.data.answer_length,
    )
    count = causal_train_flops(p.rag_cfg.question_encoder, p.rag_cfg.generator, b, **shapes)
    flops = train["flops"]
    assert flops["model"] == count["train"] and flops["recompute"] == count["recompute"] > 0
    assert flops["agree_within_10pct"], flops


def _score_arrays(text: str, heads: int, lengths: set[int]) -> list[str]:
    """Arrays [.., h, X, Y] with X and Y sequence lengths: attention scores, probabilities or
    masks, anywhere in the compiled program (fusion outputs and operands included)."""
    found = set()
    for shape in re.findall(r"(?:f32|bf16|pred)\[([\d,]+)\]", text):
        dims = [int(d) for d in shape.split(",")]
        if len(dims) >= 4 and dims[-3] == heads and {dims[-2], dims[-1]} <= lengths:
            found.add(shape)
    return sorted(found)


def test_flash_attention_runs_as_tpu_kernels(target, tmp_path):
    """model.attention_impl=flash (with the fused optimizer): every attention of the step is the
    Pallas kernel's three TPU custom calls (forward, dK/dV, dQ) and no [.., h, S, S] (or
    decoder [.., h, T, T], cross [.., h, T, S]) array is left in the program."""
    config = _config(**{"model.attention_impl": "flash", "train.optimizer_impl": "fused"})
    p = aot.plan(config)
    row = aot.train_row(p, target, 8, in_step=False, hlo_dir=tmp_path)
    assert row["fits"], row
    (path,) = tmp_path.glob("*.hlo.txt.gz")
    text = gzip.open(path, "rt").read()
    q, g = p.rag_cfg.question_encoder, p.rag_cfg.generator
    attentions = q.num_hidden_layers + g.encoder_layers + 2 * g.decoder_layers
    assert text.count('custom_call_target="tpu_custom_call"') == 3 * attentions
    assert q.num_attention_heads == g.encoder_attention_heads == g.decoder_attention_heads
    lengths = {p.rag_cfg.max_combined_length, config.data.answer_length}
    assert _score_arrays(text, q.num_attention_heads, lengths) == []


def _custom_calls(text: str) -> int:
    return text.count('custom_call_target="tpu_custom_call"')


@pytest.fixture(scope="module")
def kernel_programs(target, tmp_path_factory):
    """The train step (fused optimizer, remat) with attention_impl "splash" and "inplace", each
    with the remat policy "attention", which keeps the attention's output, and with
    "projections", which does not: {(impl, policy): (plan, config, row, optimised HLO)}."""
    out = {}
    for impl in ("splash", "inplace"):
        for policy in ("attention", "projections"):
            config = _config(**{"model.attention_impl": impl, "train.optimizer_impl": "fused",
                                "model.remat": True, "model.remat_policy": policy})  # fmt: skip
            p = aot.plan(config)
            folder = tmp_path_factory.mktemp(f"{impl}-{policy}")
            row = aot.train_row(p, target, 8, in_step=False, hlo_dir=folder)
            (path,) = folder.glob("*.hlo.txt.gz")
            out[impl, policy] = (p, config, row, gzip.open(path, "rt").read())
    return out


def test_splash_attention_runs_as_tpu_kernels(kernel_programs):
    """Every attention of the step is the splash kernel's TPU custom calls (forward, dQ, dK/dV),
    no [.., h, S, S] (or decoder [.., h, T, T], cross [.., h, T, S]) array is left in the
    program, and under remat the policy decides whether the forward kernel runs again in the
    backward pass: not with "attention" (its output and log-sum-exp kept), once more with
    "projections"."""
    for policy, forward_again in (("attention", 0), ("projections", 1)):
        p, config, row, text = kernel_programs["splash", policy]
        assert row["fits"] and row["remat_policy"] == policy, row
        q, g = p.rag_cfg.question_encoder, p.rag_cfg.generator
        attentions = q.num_hidden_layers + g.encoder_layers + 2 * g.decoder_layers
        assert _custom_calls(text) == (3 + forward_again) * attentions, policy
        assert q.num_attention_heads == g.encoder_attention_heads == g.decoder_attention_heads
        # As for flash, the lengths as the model has them: the kernel pads them to 128 inside, and
        # here its log-sum-exp, written broadcast over 128 lanes ([.., h, 128, 128] with the
        # padded length), cannot be told from a padded score array by its shape.
        lengths = {p.rag_cfg.max_combined_length, config.data.answer_length}
        assert _score_arrays(text, q.num_attention_heads, lengths) == [], policy
        # The attention's traffic split by kind adds up to the report's attention part.
        split = attention_traffic.split(text)
        assert sum(split.values()) == pytest.approx(row["bytes"]["hbm_by_part"]["attention"])
        assert split["kernel calls"] > 0 and split["projections"] > 0, split


def _kernel_arrays(text: str, name: str) -> set[tuple[int, ...]]:
    """The shapes of the operands and results of the custom calls named `name`."""
    shapes = set()
    for line in text.splitlines():
        if 'custom_call_target="tpu_custom_call"' in line and f"%{name}" in line.split("=")[0]:
            for shape in re.findall(r"(?:f32|bf16)\[([\d,]+)\]", line.split("backend_config")[0]):
                shapes.add(tuple(int(d) for d in shape.split(",")))
    return shapes


def test_inplace_attention_reads_the_projections_layout(kernel_programs):
    """Every attention of the step is the inplace kernel's two TPU custom calls (forward,
    backward), three with "projections" (whose backward pass needs the attention's output again,
    for the output projection's gradient); the calls read and write only [rows, L, hidden]
    arrays with L a length of the model (no head-major layout, no padding to a block), and no
    score array is left in the program."""
    for policy, forward_again in (("attention", 0), ("projections", 1)):
        p, config, row, text = kernel_programs["inplace", policy]
        assert row["fits"] and row["remat_policy"] == policy, row
        q, g = p.rag_cfg.question_encoder, p.rag_cfg.generator
        attentions = q.num_hidden_layers + g.encoder_layers + 2 * g.decoder_layers
        assert (
            text.count("inplace_attention_forward")
            and _custom_calls(text) == (2 + forward_again) * attentions
        ), policy
        lengths = {p.rag_cfg.max_combined_length, config.data.answer_length,
                   config.data.question_length}  # fmt: skip
        assert q.hidden_size == g.d_model
        for name in ("inplace_attention_forward", "inplace_attention_backward"):
            shapes = _kernel_arrays(text, name)
            assert shapes and all(
                len(s) == 3 and s[1] in lengths and s[2] == q.hidden_size for s in shapes
            ), (name, shapes)
        assert _score_arrays(text, q.num_attention_heads, lengths) == [], policy


def _kernel_operands(text: str, name: str) -> list[tuple[list, list]]:
    """Each custom call named `name`: (its result shapes, its operand shapes in order, as its
    operand layout constraints give them)."""
    calls = []
    for line in text.splitlines():
        if 'custom_call_target="tpu_custom_call"' in line and f"%{name}" in line.split("=")[0]:
            results = line.split("=", 1)[1].split("custom-call(")[0]
            operands = line.split("operand_layout_constraints={", 1)[1].split("}}")[0]
            calls.append(tuple(
                [tuple(int(d) for d in shape.split(",")) for shape in
                 re.findall(r"(?:f32|bf16|s32)\[([\d,]+)\]", part)]
                for part in (results, operands)
            ))  # fmt: skip
    return calls


def test_inplace_attention_reads_grouped_key_value_heads(target, tmp_path):
    """The tiny Llama's attention (4 query heads over 2 key/value heads of 16) in the inplace
    kernel: every layer's forward call reads k and v at their own width, [rows, L, 2 * 16], its
    backward call writes dK and dV there, and no key or value repeated for the query heads (a
    [.., g, r, d] broadcast) is left in the program."""
    folder = tmp_path / "tiny_llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    settings = {"model.generator_path": str(folder), "rag.keep_question": True,
                "train.freeze": r"^passage_encoder/",
                "model.attention_impl": "inplace"}  # fmt: skip
    p = aot.plan(_config(**settings))
    row = aot.train_row(p, target, 8, in_step=False, hlo_dir=tmp_path)
    assert row["fits"], row
    (path,) = tmp_path.glob("*.hlo.txt.gz")
    text = gzip.open(path, "rt").read()
    g = p.rag_cfg.generator
    heads, groups, width = g.num_attention_heads, g.num_key_value_heads, g.head_width
    assert (heads, groups, width) == (4, 2, 16)
    rows = row["per_chip_batch"] * p.rag_cfg.n_docs  # the generator's rows; the questions': B
    forward = [c for c in _kernel_operands(text, "inplace_attention_forward") if c[1][1][0] == rows]
    assert len(forward) == g.num_hidden_layers, forward
    for results, (_, q, k, v) in forward:
        assert q[2] == heads * width and k == v == (rows, q[1], groups * width), (q, k, v)
        assert results == [q]
    backward = [
        c for c in _kernel_operands(text, "inplace_attention_backward") if c[1][2][0] == rows
    ]
    assert len(backward) == g.num_hidden_layers, backward
    for results, operands in backward:
        q, kv = operands[2], (rows, operands[2][1], groups * width)
        assert results == [q, kv, kv] and operands[2:] == [q, kv, kv, q], (results, operands)
    assert re.findall(rf"\[[\d,]*,{groups},{heads // groups},{width}\]", text) == []


@pytest.mark.parametrize("impl", ["splash", "inplace"])
def test_the_recompute_count_follows_the_remat_policy(kernel_programs, impl):
    """What "attention" recomputes beyond "projections" (the output projections and the
    feed-forward's last matrices), counted by hand from the shapes, against the compiled
    programs' own matmuls, and against `benchmarks.flops`' recompute counts, which also know
    that "projections" runs the kernel's forward pass again (its matmuls, inside a custom call,
    are not in the HLO)."""
    p, config, row, _ = kernel_programs[impl, "attention"]
    q, g, b = p.rag_cfg.question_encoder, p.rag_cfg.generator, row["per_chip_batch"]
    s, t, n = p.rag_cfg.max_combined_length, config.data.answer_length, p.rag_cfg.n_docs
    questions, contexts, targets = b * config.data.question_length, b * n * s, b * n * t
    h, d = q.hidden_size, g.d_model
    more = q.num_hidden_layers * questions * 2 * h * (h + q.intermediate_size)
    more += g.encoder_layers * contexts * 2 * d * (d + g.encoder_ffn_dim)
    more += g.decoder_layers * targets * 2 * d * (2 * d + g.decoder_ffn_dim)  # self, cross
    kernel_forward = q.num_hidden_layers * questions * 4 * config.data.question_length * h
    kernel_forward += g.encoder_layers * contexts * 4 * s * d
    kernel_forward += g.decoder_layers * targets * 4 * (t + s) * d
    attention, projections = (
        kernel_programs[impl, k][2]["flops"] for k in ("attention", "projections")
    )
    assert attention["model"] == projections["model"]
    assert attention["hlo_matmuls"] - projections["hlo_matmuls"] == pytest.approx(more, rel=1e-3)
    assert attention["recompute"] - projections["recompute"] == more - kernel_forward
