"""The analytic FLOP count of a train step with a causal (Llama) generator,
`benchmarks.aot.causal_train_flops`, against an independent count: the matmuls (`dot_general`) in
the jaxpr of the trainer's own loss and of its gradient, with tiny distinct dimensions (grouped
key/value heads, an untied head), all of it trained, the bottom layers frozen, or the generator
frozen whole."""

import functools

import jax
import numpy as np
import pytest

from benchmarks import aot, floor
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
    counted = aot.step_flops(cfg.question_encoder, cfg.generator, B, frozen=frozen, **shapes)
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
