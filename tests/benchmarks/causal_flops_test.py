"""The TPU compile tool's parts for a causal (Llama) generator under fsdp that need no TPU
compiler: the analytic FLOP count of its train step, `benchmarks.flops.causal_train_flops`, against
an independent count (the matmuls, `dot_general`, in the jaxpr of the trainer's own loss and of
its gradient, with tiny distinct dimensions: grouped key/value heads, an untied head; all of it
trained, the bottom layers frozen, or the generator frozen whole); and what `benchmarks.hlo`
reads from a compiled program: the trip count of a loop XLA does not annotate (fsdp's windowed
matmuls), the FLOPs of a batched matmul written as a convolution, the parts of Llama's op names.
"""

import functools

import jax
import numpy as np
import pytest

from benchmarks import floor, flops, hlo
from rag_jax import rag
from rag_jax.models import bert, llama
from rag_jax.training.step import joint_loss_fn

B, N, Q, S, T = 2, 3, 7, 11, 5


def _matmul_flops(jaxpr) -> int:
    return sum(count * floor.flops(p) for p, count in floor.dot_generals(jaxpr).items())


def _setup(remat: bool, tied: bool, frozen_layers: int = 0):
    q_cfg = bert.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                            num_attention_heads=2, intermediate_size=24, remat=remat)  # fmt: skip
    g_cfg = llama.LlamaConfig(vocab_size=37, hidden_size=20, intermediate_size=28,
                              num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                              head_dim=4, max_position_embeddings=64, tie_word_embeddings=tied,
                              frozen_layers=frozen_layers, remat=remat)  # fmt: skip
    cfg = rag.RagConfig(question_encoder=q_cfg, generator=g_cfg, n_docs=N, bos_token_id=None)
    params = jax.eval_shape(functools.partial(rag.init_params, cfg), jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    batch = {
        "question_input_ids": rng.integers(3, 50, (B, Q)),
        "question_attention_mask": np.ones((B, Q), np.int32),
        "doc_vectors": rng.normal(size=(B, N, 16)).astype(np.float32),
        "context_input_ids": rng.integers(3, 37, (B, N, S)),
        "context_attention_mask": np.ones((B, N, S), np.int32),
        "labels": rng.integers(3, 37, (B, T)),
    }
    return cfg, params, batch


def _counts(cfg, params, batch, frozen: str):
    loss_fn = joint_loss_fn(cfg, "sequence", None, frozen)
    loss = lambda p: loss_fn(p, batch, None)[0]  # noqa: E731
    forward = _matmul_flops(jax.make_jaxpr(loss)(params).jaxpr)
    step = _matmul_flops(jax.make_jaxpr(jax.value_and_grad(loss))(params).jaxpr)
    shapes = dict(n_docs=N, question=Q, context=S, target=T)
    counted = flops.step_flops(cfg.question_encoder, cfg.generator, B, frozen=frozen, **shapes)
    return forward, step, counted


def _exact(step, counted) -> bool:
    """The gradient's matmuls are the count's, but for the doc scores' backward: the doc vectors
    are an input and get no gradient (one product of three)."""
    return step == counted["train"] + counted["recompute"] - counted["doc_scores"] // 3


PASSAGES = r"^passage_encoder/"


@pytest.mark.parametrize("tied", [True, False])
def test_the_whole_model_trained(tied):
    cfg, params, batch = _setup(remat=False, tied=tied)
    forward, step, counted = _counts(cfg, params, batch, PASSAGES)
    assert counted["forward"] == forward and counted["recompute"] == 0
    assert counted["generator"] == 3 * counted["generator_forward"]
    assert _exact(step, counted)


def test_remat_runs_every_layer_forward_again_but_its_down_projection():
    cfg, params, batch = _setup(remat=True, tied=True)
    forward, step, counted = _counts(cfg, params, batch, PASSAGES)
    assert counted["forward"] == forward
    assert counted["train"] == _counts(*_setup(remat=False, tied=True), PASSAGES)[2]["train"]
    assert 0 < counted["recompute"] < forward
    assert _exact(step, counted)


@pytest.mark.parametrize("remat", [False, True])
def test_only_the_top_layers_trained(remat):
    """generator_trained_layers=2 of 3: the bottom layer and the (tied) embedding frozen."""
    cfg, params, batch = _setup(remat=remat, tied=True, frozen_layers=1)
    frozen = r"^(passage_encoder/|generator/(embed_tokens|layers_0)/)"
    forward, step, counted = _counts(cfg, params, batch, frozen)
    assert counted["forward"] == forward
    g = counted["generator_forward"]
    assert g < counted["generator"] < 3 * g  # the bottom layer and the head's weight: no backward
    assert _exact(step, counted)


@pytest.mark.parametrize(
    "frozen, tied",
    [
        (r"^(passage_encoder/|generator/)", False),  # the generator frozen whole: forward only
        (r"^(passage_encoder/|generator/layers_1/)", True),  # crossed by the gradient
        (r"^(passage_encoder/|generator/(lm_head|norm|layers_2)/)", False),  # the top frozen
    ],
)
def test_frozen_parts_of_the_generator(frozen, tied):
    cfg, params, batch = _setup(remat=True, tied=tied)
    forward, step, counted = _counts(cfg, params, batch, frozen)
    assert counted["forward"] == forward
    if frozen.endswith("generator/)"):
        assert counted["generator_backward"] == 0
        assert counted["generator"] == counted["generator_forward"]
    assert _exact(step, counted)


WINDOWED = """HloModule m, is_scheduled=true

%fused_mm (q0: f32[8,16], q1: f32[16,16]) -> f32[8,16] {
  %q0 = f32[8,16]{1,0} parameter(0)
  %q1 = f32[16,16]{1,0} parameter(1)
  ROOT %d = f32[8,16]{1,0} dot(%q0, %q1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%cond (c: (s32[], f32[8,16], f32[16,16])) -> pred[] {
  %c = (s32[], f32[8,16]{1,0}, f32[16,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %limit = s32[] constant(LIMIT)
  ROOT %lt = pred[] compare(%i, %limit), direction=LT
}

%body (t: (s32[], f32[8,16], f32[16,16])) -> (s32[], f32[8,16], f32[16,16]) {
  %t = (s32[], f32[8,16]{1,0}, f32[16,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[8,16]{1,0} get-tuple-element(%t), index=1
  %w = f32[16,16]{1,0} get-tuple-element(%t), index=2
  %two = s32[] constant(2)
  %next = s32[] add(%i, %two)
  %y = f32[8,16]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_mm
  ROOT %r = (s32[], f32[8,16]{1,0}, f32[16,16]{1,0}) tuple(%next, %y, %w)
}

ENTRY %main (a: f32[8,16], w: f32[16,16]) -> f32[8,16] {
  %a = f32[8,16]{1,0} parameter(0)
  %w = f32[16,16]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %start = s32[] copy(%zero)
  %init = (s32[], f32[8,16]{1,0}, f32[16,16]{1,0}) tuple(%start, %a, %w)
  %loop = (s32[], f32[8,16]{1,0}, f32[16,16]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[8,16]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_a_loop_without_a_known_trip_count_runs_as_its_counter_says():
    """XLA's windowed matmuls (fsdp) are such loops: a counter from 0 by 2 (two shards an
    iteration, one each way round the ring) below the chip count."""
    mm = 2 * 8 * 16 * 16
    got = hlo.traffic(WINDOWED.replace("LIMIT", "7"))  # 0, 2, 4, 6
    assert got.loops == [("loop", 4)]
    assert got.matmul_flops == 4 * mm and got.matmul_flops_loops_once == mm
    fusion = (8 * 16 + 16 * 16 + 8 * 16) * 4
    assert got.hbm_bytes >= 4 * fusion
    unknown = hlo.traffic(WINDOWED.replace("constant(LIMIT)", "parameter(1)"))
    assert unknown.loops == [("loop", None)] and unknown.matmul_flops == mm  # counted once


def test_a_batched_matmul_written_as_a_convolution_counts_its_real_taps():
    """XLA on TPU writes [2, 3] batches of [5, 7] x [7, 11] as a convolution over the batch
    dimensions, the input dilated so that each output reads one tap of the window."""
    shapes = {"l": "bf16[2,3,5,7]{3,2,1,0}", "r": "bf16[2,3,11,7]{3,2,1,0}"}
    conv = hlo.Instruction(
        "c", "f32[2,3,5,11]{3,2,1,0}", "convolution", ["l", "r"],
        "window={size=2x3 stride=1x2 lhs_dilate=2x3}, dim_labels=01bf_01oi->01bf",
    )  # fmt: skip
    assert hlo.matmul_flops(conv, shapes) == 2 * 2 * 3 * 5 * 7 * 11
    plain = hlo.Instruction(
        "c", "bf16[20,332,8192]{2,1,0}", "convolution", ["x", "w"],
        "window={size=1}, dim_labels=0bf_io0->0bf",
    )  # fmt: skip
    shapes = {"x": "bf16[20,332,2048]{2,1,0}", "w": "bf16[2048,8192,1]{1,0,2}"}
    assert hlo.matmul_flops(plain, shapes) == 2 * 20 * 332 * 2048 * 8192


@pytest.mark.parametrize(
    "name, part",
    [
        ("jit(step)/jvp(Llama.hidden)/layers_3/self_attn_q_proj/dot_general", "attention"),
        (
            "jit(f)/transpose(jvp(Llama.hidden))/layers_3/self_attn/...qs,...sd->...qd/dot_general",
            "attention",
        ),
        ("jit(step)/jvp(Llama.hidden)/layers_3/mlp_down_proj/dot_general", "feed-forward"),
        ("jit(step)/jvp(Llama.hidden)/layers_3/mlp/mul", "feed-forward"),
        ("jit(step)/jvp(Llama.hidden)/layers_3/post_attention_layernorm/mul", "layer norms"),
        ("jit(step)/jvp(Llama.hidden)/norm/mul", "layer norms"),
        ("jit(step)/jvp(Llama.hidden)/layers_3/neg", "layers, other"),  # the rotary embedding
        (
            "jit(step)/jvp(Llama.head)/...h,vh->...v/dot_general",
            "embeddings, vocabulary logits and the loss",
        ),
        ("jit(step)/transpose(jvp(BertEncoder))/layer_1/self_attn_ln/reduce_sum", "layer norms"),
        ("jit(step)/jvp(BertEncoder)/layer_1/mlp_ln/mul", "layer norms"),
        ("jit(step)/add", "optimizer and the rest"),
    ],
)
def test_llama_op_names_are_attributed_to_their_parts(name, part):
    assert hlo._part(name) == part
