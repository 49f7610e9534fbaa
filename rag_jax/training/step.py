"""The one step builder, and the joint RAG train step made with it.

`make_step(loss_fn, tx)` is every training loop's step: the joint trainer's, both warm starts'
(`training.warm_start`) and the benchmarks'. It differentiates `loss_fn`, applies the optimizer
(`training.optim.make_optimizer`) and returns the next `TrainState` with the step's metrics, as one
jitted program with the state donated. `make_train_step` is the joint step: question encoder ->
doc scores -> RAG marginal likelihood -> update, and with an in-step search, the next batch's
passages found with the updated question encoder.

Legend: B batch, N docs, S context length, T target length, Q question length, D width.
"""

from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from rag_jax import rag
from rag_jax.training import optim


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # [] int32: optimizer steps taken
    params: Any  # the trainer's {"question_encoder", "generator", "passage_encoder"}
    opt_state: Any
    # [B, N] int32, replicated: the passages of batch `step`, found by the previous step's
    # in-step search (`Retriever.search_in_step`); None when the search runs outside the step.
    next_doc_ids: Any = None


def init_state(params, tx: optax.GradientTransformation, next_doc_ids=None) -> TrainState:
    """The state before the first step."""
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), next_doc_ids)


def make_step(
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    *,
    dropout_rng: jax.Array | None = None,
    metrics_fn: Callable | None = None,
    search_fn: Callable | None = None,
    state_sharding: Any = None,
):
    """`step(state, batch, retrieval=None) -> (state, metrics)`, jitted, the state donated.

    Args:
      loss_fn: `(params, batch, rng) -> (loss [], aux)`; `rng` is None without `dropout_rng`.
      tx: the optimizer.
      dropout_rng: the run's dropout key; each step uses `fold_in(dropout_rng, state.step)`, so
        a resumed run draws what an uninterrupted one does.
      metrics_fn: `(loss, aux, grads) -> metrics`; default `{"loss": loss}`.
      search_fn: `(params, retrieval) -> [B, N] ids`, run after the update with the new
        parameters; its result becomes `state.next_doc_ids` (the in-step search).
      state_sharding: the state's placement (`training.loop.state_sharding`), which the new
        state keeps. With split parameters (`param_sharding="fsdp"`) the loss sees them
        all-gathered once per step (in bfloat16 where the step only reads them rounded) and the
        gradients are summed back onto the parameters' split, so each device updates its own
        shard of the parameters and the optimizer state. Left to itself, XLA may gather a
        weight again at each use (forward, rematerialised forward, backward) and fuse the
        gathers into the matmuls.
    """
    gathered = split = None
    if state_sharding is not None:
        split = state_sharding.params
        leaves = jax.tree.leaves(split)
        if not all(s.is_fully_replicated for s in leaves):
            whole = NamedSharding(leaves[0].mesh, PartitionSpec())
            gathered = jax.tree.map(lambda _: whole, split)

    def step(state: TrainState, batch, retrieval=None):
        rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, state.step)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        params = state.params
        if gathered is not None:
            # One all-gather per step, kept for the forward and backward passes: without the
            # barrier XLA re-gathers each weight at every use and holds the copies longer.
            params = jax.lax.with_sharding_constraint(params, gathered)
            params = jax.lax.optimization_barrier(params)
        (loss, aux), grads = grad_fn(params, batch, rng)
        if gathered is not None:
            grads = jax.lax.with_sharding_constraint(grads, split)  # reduce-scatter
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss} if metrics_fn is None else metrics_fn(loss, aux, grads)
        next_ids = state.next_doc_ids if search_fn is None else search_fn(params, retrieval)
        new_state = TrainState(state.step + 1, params, opt_state, next_ids)
        if state_sharding is not None:
            new_state = jax.lax.with_sharding_constraint(new_state, state_sharding)
        return new_state, metrics

    return jax.jit(step, donate_argnums=0)


# ---------------------------------------------------------------------------------------------
# The joint RAG step


def _entropy(scores: jax.Array) -> jax.Array:
    """[B, N] doc scores -> [B] entropy of the doc posterior p(z|x), in nats."""
    logp = jax.nn.log_softmax(scores, axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


_PER_DOC_TOKENS = (
    "context_input_ids",
    "context_attention_mask",
    "passage_input_ids",
    "passage_attention_mask",
)


def rag_metrics(loss, aux, grads) -> dict:
    """(sum, count) pairs of the joint step: NLL, doc entropy, gradient norms."""
    del loss
    weights = aux["weights"]
    return {
        "loss": (jnp.sum(aux["nll"] * weights), jnp.sum(weights)),
        "doc_entropy": (jnp.sum(_entropy(aux["doc_scores"]) * weights), jnp.sum(weights)),
        "grad_norm": (optax.tree.norm(grads), jnp.ones(())),
        "question_grad_norm": (optax.tree.norm(grads["question_encoder"]), jnp.ones(())),
    }


def joint_loss_fn(
    rag_cfg: rag.RagConfig, variant: str, passage_cfg=None, frozen: str = ""
) -> Callable:
    """The joint step's `loss_fn(params, batch, rng) -> (loss, aux)` over a training batch.

    The parameters whose paths match `frozen` (`train.freeze`) enter the loss as constants: the
    optimizer gives them zero updates anyway, and no gradient is computed for them (a frozen
    generator then costs a forward pass only: the doc scores' gradient needs only each
    passage's likelihood)."""
    labels = optim.path_labels if frozen else None

    def loss_fn(params, batch, rng):
        if labels is not None:
            fixed = labels(params, frozen, True, False)
            params = jax.tree.map(lambda p, f: jax.lax.stop_gradient(p) if f else p, params, fixed)
        # Token leaves travel as [B, N, L] so every leaf shards over B; the loss takes [B * N, L].
        flat = dict(batch)
        for key in _PER_DOC_TOKENS:
            if key in batch:
                flat[key] = batch[key].reshape(-1, batch[key].shape[-1])  # -> [B * N, L]
        return rag.loss_fn(rag_cfg, params, flat, variant, rng, passage_cfg)

    return loss_fn


def make_train_step(
    rag_cfg: rag.RagConfig,
    variant: str,
    tx,
    dropout_rng,
    deterministic: bool,
    passage_cfg=None,
    search_n_docs: int = 0,
    state_sharding=None,
    frozen: str = "",
):
    """The joint step `train_step(state, batch, retrieval=None) -> (state, metrics)`.

    `frozen` (`train.freeze`): those parameters are constants of the loss (`joint_loss_fn`).

    `passage_cfg` is needed when batches carry passage tokens (a trainable passage encoder).
    `state_sharding` is the state's placement, kept by the new state (`make_step`).

    With `search_n_docs` = N > 0 the step also retrieves for the next batch: `retrieval` is
    `(index, next_questions)`, a `DeviceIndex` on the step's mesh and the next batch's
    question-encoder inputs (`question_tokens`, batch-sharded). After the update it embeds them
    with the *updated* question encoder (the one the next step trains) and searches the index, so
    the next batch's passages are the same as a search between the steps would find, without a
    host round trip; they are returned in `state.next_doc_ids`.
    """

    loss_fn = joint_loss_fn(rag_cfg, variant, passage_cfg, frozen)
    search_fn = None
    if search_n_docs:

        def search_fn(params, retrieval):
            index, next_questions = retrieval
            return search_ids(rag_cfg, params, index, next_questions, search_n_docs)

    return make_step(
        loss_fn,
        tx,
        dropout_rng=None if deterministic else dropout_rng,
        metrics_fn=rag_metrics,
        search_fn=search_fn,
        state_sharding=state_sharding,
    )


def search_ids(rag_cfg: rag.RagConfig, params, index, questions, n_docs: int) -> jax.Array:
    """[B, N] int32 passage rows for `questions` (`question_tokens`) from a `DeviceIndex`."""
    vectors = rag.question_embeddings(
        rag_cfg, params, questions["question_input_ids"], questions["question_attention_mask"]
    )  # -> [B, D]
    return index.search(vectors, n_docs)[1]
