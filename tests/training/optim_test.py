"""training.optim: the fused AdamW update (`train.optimizer_impl="fused"`) against optax's chain as
`make_optimizer` builds it (schedule, weight-decay mask, clipping, the retriever's factor and
delay, freezing, gradient accumulation), step after step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rag_jax.training import optim

STEPS = 6


def _params(rng):
    shapes = {
        "question_encoder": {"layer_0": {"kernel": (3, 4), "bias": (4,)}, "ln": {"scale": (4,)}},
        "passage_encoder": {"layer_0": {"kernel": (3, 4), "bias": (4,)}},
        "generator": {"shared": {"embedding": (5, 4)}, "out": {"kernel": (4, 2), "bias": (2,)}},
    }
    return jax.tree.map(
        lambda s: jnp.asarray(rng.normal(size=s), jnp.float32),
        shapes,
        is_leaf=lambda s: isinstance(s, tuple),
    )


def _run(tc, params, grads):
    """The parameters after each step of `make_optimizer(tc)` on the gradient sequence."""
    tx = optim.make_optimizer(tc)

    @jax.jit
    def step(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state, trace = tx.init(params), []
    for g in grads:
        params, opt_state = step(params, opt_state, g)
        trace.append(params)
    return trace


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_fused_adamw_equals_the_optax_chain_step_by_step(grad_accum):
    rng = np.random.default_rng(0)
    params = _params(rng)
    # Gradients whose global norm lies above the clip at some steps and below it at others.
    grads = [
        jax.tree.map(lambda p, s=s: jnp.asarray(s * rng.normal(size=p.shape), jnp.float32), params)
        for s in (0.05, 3.0, 0.01, 2.0, 0.3, 1.5)[:STEPS]
    ]
    options = dict(
        steps=STEPS,
        warmup_steps=2,
        learning_rate=0.1,
        decay="polynomial",
        decay_power=2.0,
        end_lr_factor=0.1,
        weight_decay=0.3,
        no_decay=r"(bias|scale)",
        grad_clip=1.0,
        freeze="^passage_encoder/",
        retriever_lr_factor=0.5,
        retriever_delay_steps=2,
        grad_accum=grad_accum,
    )
    want = _run(optim.settings_for(**options), params, grads)
    got = _run(optim.settings_for(optimizer_impl="fused", **options), params, grads)
    moved = False
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=f"step {step}")
        moved |= not np.array_equal(w["question_encoder"]["layer_0"]["kernel"],
                                    params["question_encoder"]["layer_0"]["kernel"])  # fmt: skip
    assert moved  # the retriever's delay ended
    # Frozen parameters do not move at all.
    np.testing.assert_array_equal(
        got[-1]["passage_encoder"]["layer_0"]["kernel"],
        params["passage_encoder"]["layer_0"]["kernel"],
    )


def test_fused_is_adamw_only_and_named_settings_are_checked():
    with pytest.raises(ValueError, match="optimizer_impl='fused' is AdamW's"):
        optim.make_optimizer(optim.settings_for(optimizer="sgd", optimizer_impl="fused"))
    with pytest.raises(ValueError, match="optimizer_impl must be optax or fused"):
        optim.make_optimizer(optim.settings_for(optimizer_impl="adam"))
