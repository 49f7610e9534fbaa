"""The TPU compile tool's parts that need no TPU compiler: the HLO traffic count, the compiler's
out-of-memory message, the largest-batch search, and the shapes it compiles for (the trainer's
models and batches, without weights or data)."""

import math
import pathlib
import re

import jax
import numpy as np
import pytest

from benchmarks import aot, hbm_fit, hlo, tpu_topology
from experiments.configs import nq
from rag_jax.devices import sharding
from rag_jax.run import model_setup
from rag_jax.training import experiment
from rag_jax.training.batcher import Batcher, batch_shapes
from tiny_runs import first_batch, tiny_config

F = 256 * 128 * 4  # bytes of f32[256,128]
W = 128 * 128 * 4  # bytes of f32[128,128]

PROGRAM = """HloModule m, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%fused_dot (p0: f32[256,128], p1: f32[128,128]) -> f32[256,128] {
  %p0 = f32[256,128]{1,0} parameter(0)
  %p1 = f32[128,128]{1,0:S(1)} parameter(1)
  ROOT %d = f32[256,128]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_tanh (q0: f32[256,128]) -> f32[256,128] {
  %q0 = f32[256,128]{1,0} parameter(0)
  ROOT %t = f32[256,128]{1,0} tanh(%q0)
}

%cond (c: (s32[], f32[256,128])) -> pred[] {
  %c = (s32[], f32[256,128]{1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  %limit = s32[] constant(3)
  ROOT %lt = pred[] compare(%ci, %limit), direction=LT
}

%body (t: (s32[], f32[256,128])) -> (s32[], f32[256,128]) {
  %t = (s32[], f32[256,128]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[256,128]{1,0} get-tuple-element(%t), index=1
  %y = f32[256,128]{1,0} fusion(%x), kind=kLoop, calls=%fused_tanh, metadata={op_name="jit(f)/jvp(model)/tanh"}
  ROOT %r = (s32[], f32[256,128]{1,0}) tuple(%i, %y)
}

ENTRY %main (a: f32[256,128], w: f32[128,128]) -> f32[256,128] {
  %a = f32[256,128]{1,0} parameter(0)
  %w = f32[128,128]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %copy-start = (f32[128,128]{1,0:S(1)}, f32[128,128]{1,0}, u32[]{:S(2)}) copy-start(%w)
  %copy-done = f32[128,128]{1,0:S(1)} copy-done(%copy-start)
  %f = f32[256,128]{1,0} fusion(%a, %copy-done), kind=kOutput, calls=%fused_dot, metadata={op_name="jit(f)/transpose(jvp(model))/dot"}
  %ar = f32[256,128]{1,0} all-reduce(%f), replica_groups={}, to_apply=%add
  %init = (s32[], f32[256,128]{1,0}) tuple(%zero, %ar)
  %loop = (s32[], f32[256,128]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %out = f32[256,128]{1,0} get-tuple-element(%loop), index=1
  %cb = () custom-call(%out), custom_call_target="xla_ffi_python_cpu_callback"
  ROOT %copy = f32[256,128]{1,0} copy(%out)
}
"""  # noqa: E501


def test_traffic_counts_fusion_boundaries_in_hbm_and_loops_by_trip_count():
    got = hlo.traffic(PROGRAM)
    expected = {
        "copy-start": W,  # reads w from HBM; its destination is VMEM (S(1))
        "dot fusion": F + F,  # reads a, writes f; w is read from VMEM
        "all-reduce": F + F,
        "tanh fusion x 3": 3 * (F + F),  # the loop body, as often as the loop runs
        "condition x 3": 3 * (4 + 4 + 1),
        "callback": F,
        "copy": F + F,
    }
    assert got.hbm_bytes == sum(expected.values())
    # The copy of w and the all-reduce have no op name: they count with the instruction they
    # serve (the backward's dot reads w; the all-reduce sums its result).
    assert got.by_scope["backward"] == W + 2 * F + 2 * F and got.by_scope["forward"] == 6 * F
    assert got.collectives == {"all-reduce": F} and got.collective_dtypes == {"all-reduce f32": F}
    assert got.loops == [("loop", 3)]
    assert got.host_transfers == ["custom-call cb (in main)"]
    assert (
        hlo.traffic(PROGRAM.replace("xla_ffi_python_cpu_callback", "Sharding")).host_transfers == []
    )


FUSED_GATHER = """HloModule m, is_scheduled=true

%fused_gather (g0: bf16[64,128]) -> f32[256,128] {
  %g0 = bf16[64,128]{1,0} parameter(0)
  %ag = bf16[256,128]{1,0} all-gather(%g0), replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %cv = f32[256,128]{1,0} convert(%ag)
}

ENTRY %main (g: bf16[64,128]) -> f32[256,128] {
  %g = bf16[64,128]{1,0} parameter(0)
  ROOT %f = f32[256,128]{1,0} fusion(%g), kind=kLoop, calls=%fused_gather
}
"""


def test_traffic_counts_collectives_fused_into_their_consumers():
    got = hlo.traffic(FUSED_GATHER)
    gathered = 256 * 128 * 2
    assert got.collectives == {"all-gather": gathered}
    assert got.collective_dtypes == {"all-gather bf16": gathered}
    assert got.hbm_bytes == 64 * 128 * 2 + F  # the fusion's boundary: the shard in, f32 out


def test_shape_bytes_reads_dtypes_tuples_and_memory_spaces():
    shape = "(bf16[4,8]{1,0:T(8,128)(2,1)}, f32[3]{0:S(1)}, pred[5]{0}, u32[]{:S(2)})"
    assert hlo.shape_bytes(shape) == 4 * 8 * 2 + 5
    assert hlo.shape_bytes(shape, memory_space=1) == 12
    assert hlo.shape_bytes(shape, memory_space=None) == 64 + 12 + 5 + 4


def test_out_of_memory_messages_of_the_tpu_compiler():
    older = "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 20.50G of 15.75G hbm. Exceeded hbm capacity by 4.75G."  # noqa: E501
    newer = "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (18.00G) exceeds available HBM (15.75G)."  # noqa: E501
    out_of_memory = tpu_topology.out_of_memory
    assert out_of_memory(RuntimeError(older)) == (int(20.5 * 2**30), int(15.75 * 2**30))
    assert out_of_memory(RuntimeError(newer)) == (18 * 2**30, int(15.75 * 2**30))
    assert out_of_memory(RuntimeError("INVALID_ARGUMENT: shapes differ")) is None


@pytest.mark.parametrize(
    "fixed, per_example, wobble",
    [(5e9, 3e8, 0.0), (5e9, 3e8, 0.04), (1.5e10, 3e8, 0.0), (2e10, 1e8, 0.0)],
)
def test_largest_batch_finds_the_boundary(fixed, per_example, wobble):
    chips, hbm = 8, int(15.75 * 2**30)
    calls = []

    def need(batch):  # near-linear in the per-chip batch, a few percent off in places
        per_chip = batch // chips
        return int((fixed + per_example * per_chip) * (1 + wobble * math.sin(per_chip)))

    def measure(batch):
        calls.append(batch)
        return {"batch": batch, "fits": need(batch) <= hbm, "needed_bytes": need(batch),
                "compile_s": 0.0}  # fmt: skip

    truth = max((b for b in range(chips, 4096, chips) if need(b) <= hbm), default=None)
    found = hbm_fit.largest_batch(measure, chips, hbm, probes=(128, 256))
    assert found["batch"] == truth
    if truth:  # a batch that fits next to one that does not: compiled, not extrapolated
        assert found["proved"] and truth in calls and truth + chips in calls
    assert len(calls) <= 2 + 4


def test_fsdp_splits_the_largest_divisible_dimension():
    assert aot.sharding.fsdp_spec((50265, 1024), 8) == jax.sharding.PartitionSpec(None, "data")
    assert sharding.fsdp_spec((4096, 1024), 8) == jax.sharding.PartitionSpec("data")
    assert sharding.fsdp_spec((50265,), 8) == jax.sharding.PartitionSpec()
    assert sharding.fsdp_spec((), 8) == jax.sharding.PartitionSpec()
    assert sharding.fsdp_spec((1024, 1024), 1) == jax.sharding.PartitionSpec()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    config = tiny_config(**{"warm_start.method": "none", "warm_start.reader_steps": 0})
    exp = experiment.build(config, tmp_path_factory.mktemp("tiny"))
    return config, exp


def test_model_shapes_are_the_built_experiments(tiny):
    config, exp = tiny
    rag_cfg, passage_cfg, shapes, sources = model_setup.model_shapes(config)
    assert rag_cfg == exp.rag_cfg and passage_cfg == exp.passage_cfg
    built = jax.tree.map(lambda x: (x.shape, np.dtype(x.dtype)), exp.params)
    assert jax.tree.map(lambda x: (x.shape, np.dtype(x.dtype)), shapes) == built
    assert sources["generator"] == "config.model.generator (random init)"


def test_model_shapes_take_the_settings_build_applies_after_loading(tmp_path):
    """Pooling, normalisation and a frozen generator encoder, applied after loading: the same
    configs, and the fixed encoder's own embedding (`encoder/embed_tokens`) in the shapes."""
    freeze = r"^(passage_encoder/|generator/final_logits_bias|generator/encoder/)"
    settings = {"warm_start.method": "none", "warm_start.reader_steps": 0, "train.freeze": freeze,
                "model.pooling": "mean", "model.normalize_embeddings": True,
                "model.generator_frozen_encoder_layers": -1}  # fmt: skip
    config = tiny_config(**settings)
    exp = experiment.build(config, tmp_path)
    rag_cfg, passage_cfg, shapes, _ = model_setup.model_shapes(config)
    assert rag_cfg == exp.rag_cfg and passage_cfg == exp.passage_cfg
    assert rag_cfg.question_encoder.pooling == passage_cfg.pooling == "mean"
    assert rag_cfg.generator.frozen_encoder_layers == rag_cfg.generator.encoder_layers
    built = jax.tree.map(lambda x: (x.shape, np.dtype(x.dtype)), exp.params)
    assert jax.tree.map(lambda x: (x.shape, np.dtype(x.dtype)), shapes) == built
    assert "embed_tokens" in shapes["generator"]["encoder"]


def test_batch_shapes_are_the_widest_batch_the_batcher_makes(tiny):
    config, exp = tiny
    mesh = sharding.data_mesh(jax.devices()[:1])
    real = first_batch(Batcher(exp, mesh), exp)
    planned = batch_shapes(config, exp.rag_cfg, config.train.batch_size)
    assert sorted(real) == sorted(planned)
    for name, array in real.items():
        want = planned[name]
        assert array.dtype == want.dtype, name
        assert array.shape[:-1] == want.shape[:-1] and array.shape[-1] <= want.shape[-1], name
    assert planned["context_input_ids"].shape[-1] == config.rag.max_combined_length
    assert planned["labels"].shape[-1] == config.data.answer_length


def test_paper_config_plans_without_its_checkpoints():
    """nq.py's towers, planned from the architectures the config gives (no checkpoint here),
    have the parameter counts of HF's own BART-large and DPR (built on the meta device)."""
    import torch
    from transformers import BartConfig, BartModel, DPRConfig, DPRQuestionEncoder

    config = nq.get_config()
    rag_cfg, _, shapes, sources = model_setup.model_shapes(config)
    assert "is not on this machine" in sources["generator"]
    count = lambda tree: sum(math.prod(x.shape) for x in jax.tree.leaves(tree))  # noqa: E731
    with torch.device("meta"):
        bart = BartModel(BartConfig(**config.model.generator.to_dict()))
        dpr = DPRQuestionEncoder(DPRConfig(**config.model.question_encoder.to_dict()))
    hf_bart = sum(p.numel() for p in bart.parameters())  # the encoder/decoder embeddings are tied
    hf_dpr = sum(p.numel() for name, p in dpr.named_parameters() if "pooler" not in name)
    vocab = config.model.generator.vocab_size  # our final_logits_bias is HF's buffer
    assert count(shapes["generator"]) == hf_bart + vocab
    assert count(shapes["question_encoder"]) == count(shapes["passage_encoder"]) == hf_dpr
    assert rag_cfg.generator.remat and rag_cfg.question_encoder.dtype == "bfloat16"


def test_a_checkpoint_absent_without_an_architecture_is_an_error():
    config = nq.get_config()
    config.model.generator = dict(d_model=64)  # no vocab_size: nothing to plan from
    with pytest.raises(ValueError, match=r"facebook/bart-large.* is not on this machine.*"
                       r"config\.model\.generator"):  # fmt: skip
        model_setup.model_shapes(config)


def test_missing_libtpu_says_what_to_install(monkeypatch):
    monkeypatch.setattr(tpu_topology, "has_libtpu", lambda: False)
    with pytest.raises(
        tpu_topology.PlanError, match=r"libtpu is not installed.*pip install 'rag_jax\[tpu\]'"
    ):
        tpu_topology.target("v5e:2x2")


def test_unknown_topology_names_the_forms_it_takes():
    with pytest.raises(tpu_topology.PlanError, match=r"unknown TPU topology 'v9:2x2'.*v5e:2x4"):
        tpu_topology.target("v9:2x2")


def test_the_tpu_extra_is_at_the_jax_pin():
    root = pathlib.Path(__file__).resolve().parents[2]
    pins = dict(
        line.split("  #")[0].strip().split("==")
        for line in (root / "requirements-ci.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    extra = re.search(r'"tpu": \["jax\[tpu\]==([0-9.]+)"\]', (root / "setup.py").read_text())
    assert extra and extra.group(1) == pins["jax"] == jax.__version__
    assert pins["libtpu"].startswith("0.0.")


def test_an_index_of_more_rows_than_int32_ids_is_refused():
    config = tiny_config(**{"retrieval.index_rows": 2**31})
    with pytest.raises(
        tpu_topology.PlanError, match=r"index_rows=2147483648 but passage ids are int32"
    ):
        aot.plan(config)


@pytest.mark.parametrize("largest", [False, True])
def test_each_compile_is_logged_once_and_again_with_its_largest_batch(monkeypatch, largest):
    """`experiments/tpu_compile.py` printed every row twice; a row is logged again only when the
    largest-batch search adds to it."""
    mesh = sharding.data_mesh(jax.devices()[:4])
    target = tpu_topology.Target(
        "v5e:2x2", mesh, "TPU v5 lite", 1, 16 << 30, {"tflops": 197, "gbps": 819, "source": "test"}
    )
    monkeypatch.setattr(aot, "target", lambda name: target)
    monkeypatch.setattr(
        aot, "plan", lambda config: aot.Plan(config, None, None, None, {}, None, {})
    )

    def fake_row(p, t, batch, in_step, detail=True, hlo_dir=None):
        used = {"total": batch << 27}  # 128 MiB a question: fits up to B = 128 of 16 GiB
        return {"program": "train_step", "batch": batch, "per_chip_batch": batch // t.chips,
                "index": "in_step" if in_step else "host", "remat": False,
                "param_sharding": "replicated", "fits": batch <= 128, "compile_s": 0.0,
                "memory": used}  # fmt: skip

    monkeypatch.setattr(aot, "train_row", fake_row)
    lines = []
    config = tiny_config(**{"train.batch_size": 8})
    aot.run(config, "v5e:2x2", layouts=["replicated"], remats=[False], paths=["host", "in_step"],
            largest=largest, generate=False, log=lines.append, largest_tries=3)  # fmt: skip
    rows = [line for line in lines if line.startswith("train_step")]
    if not largest:
        assert len(rows) == 2 and "largest" not in " ".join(rows), lines
    else:  # each row, then the same row with its largest batch
        assert len(rows) == 4 and all("largest B=" in r for r in rows[1::2]), lines
