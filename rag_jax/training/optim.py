"""The one optimizer builder: the trainer's, the warm starts' and the benchmarks'.

AdamW (or SGD with momentum) with linear warmup and linear, polynomial or constant decay,
global-norm clipping, weight decay chosen by parameter path, a learning-rate factor (and delay) for
the retriever towers, and freezing. Freezing is a regex over parameter paths mapped to
`optax.set_to_zero`, never a zero learning rate, which AdamW's weight decay would still move
(big_vision's `optax.py`). Parameter paths are '/'-joined (`question_encoder/layer_0/...`).

The settings are those of `config.train` (`rag_jax.run.settings`); `settings_for(...)` gives
them for a loop that is not the trainer's (a warm start, a benchmark) from the defaults plus
overrides.

`train.optimizer_impl="fused"` builds the same AdamW as one transformation (`fused_adamw`): the
clipping, the moments, the bias correction, the weight decay and the learning rates of a
parameter in one elementwise expression, which reads its gradient, both moments and the weight
once and writes the moments and the update once (XLA fuses the update into `apply_updates`); the
global norm reads the gradients once more. The TPU compiler already fuses optax's chain the same
way (one multi-output fusion per parameter, tpu/README.md), so the two compile to the same bytes.
It computes optax's operations in optax's order (equal on CPU); its state is its own
(`FusedAdamWState`), so checkpoints do not cross between the two.
"""

import functools
import re
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax

from rag_jax.run import settings

# The towers a retriever learning-rate factor applies to.
RETRIEVER_PATHS = r"^(question_encoder|passage_encoder)/"
# BERT's fine-tuning recipe, the warm starts' optimizer: warmup over the first tenth of the steps,
# linear decay to zero, decoupled weight decay 0.01 on matrices (every 1-d parameter of BERT and
# BART is a bias or a LayerNorm scale) and clipping at global norm 1.
WARMUP_FRACTION = 0.1
WARM_START = dict(
    decay="linear",
    end_lr_factor=0.0,
    weight_decay=0.01,
    no_decay=r"(bias|scale)",
    grad_clip=1.0,
    freeze="",
    retriever_lr_factor=1.0,
    retriever_delay_steps=0,
    grad_accum=1,
    optimizer="adamw",
    adam_b1=0.9,
    adam_b2=0.999,
    adam_eps=1e-8,
)


def settings_for(**changes) -> ml_collections.ConfigDict:
    """`config.train` at its defaults (`rag_jax.run.settings`), with `changes` applied."""
    tc = settings.defaults().train
    for key, value in changes.items():
        tc[key] = value
    return tc


def warm_start_settings(
    learning_rate: float, steps: int, freeze: str = ""
) -> ml_collections.ConfigDict:
    """The warm starts' optimizer settings (`WARM_START`) for `steps` steps, `freeze` (a regex
    over parameter paths) left unchanged."""
    warmup = max(1, round(steps * WARMUP_FRACTION))
    options = dict(WARM_START, freeze=freeze)
    return settings_for(learning_rate=learning_rate, steps=steps, warmup_steps=warmup, **options)


def schedule(tc: ml_collections.ConfigDict) -> optax.Schedule:
    """Linear warmup to `learning_rate`, then linear or polynomial decay to `end_learning_rate`."""
    warmup = optax.linear_schedule(0.0, tc.learning_rate, max(tc.warmup_steps, 1))
    decay_steps = max(tc.steps - tc.warmup_steps, 1)
    end = tc.learning_rate * tc.end_lr_factor
    if tc.decay == "linear":
        decay = optax.linear_schedule(tc.learning_rate, end, decay_steps)
    elif tc.decay == "polynomial":
        decay = optax.polynomial_schedule(tc.learning_rate, end, tc.decay_power, decay_steps)
    elif tc.decay == "constant":
        decay = optax.constant_schedule(tc.learning_rate)
    else:
        raise ValueError(f"config.train.decay must be linear, polynomial or constant: {tc.decay!r}")
    return optax.join_schedules([warmup, decay], [tc.warmup_steps])


def path_labels(params, pattern: str, matched, other):
    """A pytree of labels: `matched` where the '/'-joined parameter path matches `pattern`."""
    regex = re.compile(pattern) if pattern else None

    def label(path, _):
        name = "/".join(str(getattr(p, "key", p)) for p in path)
        return matched if regex is not None and regex.search(name) else other

    return jax.tree_util.tree_map_with_path(label, params)


def _labels(tc, params):
    """ "frozen" (`tc.freeze`), "retriever" (the towers of `RETRIEVER_PATHS`) or "train"."""
    labels = path_labels(params, tc.freeze, "frozen", "train")
    towers = path_labels(params, RETRIEVER_PATHS, "q", "-")
    return jax.tree.map(
        lambda label, q: "retriever" if label == "train" and q == "q" else label, labels, towers
    )


class FusedAdamWState(NamedTuple):
    """`fused_adamw`'s state: optax's `ScaleByAdamState` fields, one step counter for all."""

    count: jax.Array  # [] int32, steps taken
    mu: optax.Updates  # first moments, like the parameters
    nu: optax.Updates  # second moments, like the parameters


def fused_adamw(
    learning_rate: optax.Schedule,
    *,
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float,
    mask: Callable,
    max_norm: float = 0.0,
    factor: optax.Schedule | None = None,
) -> optax.GradientTransformation:
    """`chain(clip_by_global_norm(max_norm), adamw(...), scale_by_schedule(factor))` as one
    elementwise update per parameter.

    Args:
      learning_rate: the schedule of the step count (before the step).
      b1, b2, eps: Adam's (optax's `eps_root` is 0).
      weight_decay: decoupled weight decay, on the parameters `mask(params)` marks True.
      mask: `params -> pytree of bool`.
      max_norm: clip the gradients to this global norm; 0 = no clipping.
      factor: a schedule of the step count multiplying the update (the retriever's factor and
        delay), or None.

    Returns:
      The transformation; its updates equal the chain's on CPU (the same operations in the
      same order).
    """

    def init_fn(params):
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)  # noqa: E731
        return FusedAdamWState(jnp.zeros([], jnp.int32), zeros(), zeros())

    def update_fn(grads, state, params=None):
        if params is None:
            raise ValueError("fused_adamw needs the parameters (weight decay)")
        count = optax.safe_increment(state.count)
        # What optax's chain computes once per step, scalars.
        correct1, correct2 = 1 - b1**count, 1 - b2**count
        step_size = -learning_rate(state.count)
        scale = None if factor is None else factor(state.count)
        if max_norm:
            norm = optax.tree.norm(grads)
            keep = jnp.squeeze(norm < max_norm)

        def leaf(g, m, v, p, decayed):
            if max_norm:
                g = jax.lax.select(keep, g, (g / norm.astype(g.dtype)) * max_norm)
            m = (1 - b1) * g + b1 * m
            v = (1 - b2) * (g**2) + b2 * v
            u = (m / correct1.astype(m.dtype)) / (jnp.sqrt(v / correct2.astype(v.dtype)) + eps)
            if decayed:
                u = u + weight_decay * p
            u = jnp.array(step_size, dtype=u.dtype) * u
            if scale is not None:
                u = jnp.array(scale, dtype=u.dtype) * u
            return u, m, v

        out = jax.tree.map(leaf, grads, state.mu, state.nu, params, mask(params))
        pick = lambda i: jax.tree.map(lambda _, o: o[i], grads, out)  # noqa: E731
        return pick(0), FusedAdamWState(count, pick(1), pick(2))

    return optax.GradientTransformation(init_fn, update_fn)


def make_optimizer(tc: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """The optimizer `tc` (`config.train`, or `settings_for(...)`) describes; frozen parameters
    get exactly zero updates. The masks are functions of the parameter tree, so one optimizer
    serves any tree (the trainer's three towers, a warm start's one or two)."""
    decayed = lambda params: path_labels(params, tc.no_decay, False, True)  # noqa: E731
    adam = dict(
        b1=tc.adam_b1, b2=tc.adam_b2, eps=tc.adam_eps, weight_decay=tc.weight_decay, mask=decayed
    )
    # The retriever towers (the question encoder, and the passage encoder when it trains) may
    # learn more slowly than the generator, and may wait: until the generator reads its contexts,
    # p(z|x,y) ~ p(z|x) and their gradient is mostly noise, which Adam turns into full-size steps
    # that undo the warm start.
    delay, factor = tc.retriever_delay_steps, tc.retriever_lr_factor
    retriever_scale = lambda step: jnp.where(step < delay, 0.0, factor)  # noqa: E731
    if tc.optimizer_impl not in ("optax", "fused"):
        raise ValueError(
            f"config.train.optimizer_impl must be optax or fused: {tc.optimizer_impl!r}"
        )
    if tc.optimizer_impl == "fused":
        if tc.optimizer != "adamw":
            raise ValueError(
                f"config.train.optimizer_impl='fused' is AdamW's; config.train.optimizer="
                f"{tc.optimizer!r} needs optimizer_impl='optax'"
            )
        fused = functools.partial(fused_adamw, schedule(tc), **adam, max_norm=tc.grad_clip)
        return _by_label(tc, fused(), fused(factor=retriever_scale))
    if tc.optimizer == "adamw":
        base = optax.adamw(schedule(tc), **adam)
    elif tc.optimizer == "sgd":
        base = optax.sgd(schedule(tc), momentum=tc.adam_b1)
    else:
        raise ValueError(f"config.train.optimizer must be adamw or sgd, got {tc.optimizer!r}")
    tx = optax.chain(optax.clip_by_global_norm(tc.grad_clip), base) if tc.grad_clip else base
    return _by_label(tc, tx, optax.chain(tx, optax.scale_by_schedule(retriever_scale)))


def _by_label(tc, tx, retriever_tx) -> optax.GradientTransformation:
    """`tx` for the trained parameters, `retriever_tx` for the retriever towers, zero updates for
    the frozen ones (each group clipped by its own norm); accumulated over `tc.grad_accum`."""
    tx = optax.multi_transform(
        {"train": tx, "retriever": retriever_tx, "frozen": optax.set_to_zero()},
        lambda params: _labels(tc, params),
    )
    if tc.grad_accum > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=tc.grad_accum)
    return tx
