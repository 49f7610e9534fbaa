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

from rag_jax import causal, rag, rag_math, retriever_losses
from rag_jax.retriever_losses import RetrieverObjective, retriever_loss
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


_TOWERS = ("question_encoder", "passage_encoder")  # the retriever's parameters
_PER_DOC_TOKENS = (
    "context_input_ids",
    "context_attention_mask",
    "passage_input_ids",
    "passage_attention_mask",
    "passage_states",  # [B, N, P, H]: the passage tower's frozen layers' output
    "reader_states",  # [B, N, S + T, H]: the reader's frozen layers' output (reader_trunk)
    "reader_mask",  # [B, N, S + T]
)


def retriever_objective(config) -> RetrieverObjective:
    """The run's `RetrieverObjective` from its `train.retriever_*` settings."""
    return RetrieverObjective.from_config(config)


def candidate_count(config) -> int:
    """The passages a training batch carries per question: rag.n_docs, or more for the
    retriever's own objective (`train.retriever_candidates`, then its random negatives)."""
    return retriever_objective(config).count(config.rag.n_docs)


def searched_count(config) -> int:
    """K, the passages a training batch's search (or fixed table) finds per question: its
    candidates before any random negatives."""
    return retriever_objective(config).searched(config.rag.n_docs)


def rag_metrics(loss, aux, grads) -> dict:
    """(sum, count) pairs of the joint step: NLL (when a reader ran), doc entropy, gradient
    norms, and the retriever's own loss when it has one."""
    del loss
    weights = aux["weights"]
    extra = {}
    if "retriever_loss" in aux:
        extra["retriever_loss"] = (jnp.sum(aux["retriever_loss"] * weights), jnp.sum(weights))
    if "nll" in aux:  # not without a reader (the gold objective under a frozen generator)
        extra["loss"] = (jnp.sum(aux["nll"] * weights), jnp.sum(weights))
    return extra | {
        "doc_entropy": (jnp.sum(_entropy(aux["doc_scores"]) * weights), jnp.sum(weights)),
        "grad_norm": (optax.tree.norm(grads), jnp.ones(())),
        "question_grad_norm": (optax.tree.norm(grads["question_encoder"]), jnp.ones(())),
    }


def joint_loss_fn(
    rag_cfg: rag.RagConfig,
    variant: str,
    passage_cfg=None,
    frozen: str = "",
    objective: RetrieverObjective | None = None,
    passage_first_layer: int = 0,
) -> Callable:
    """The joint step's `loss_fn(params, batch, rng) -> (loss, aux)` over a training batch.

    The parameters whose paths match `frozen` (`train.freeze`) enter the loss as constants: the
    optimizer gives them zero updates anyway, and no gradient is computed for them (a frozen
    generator then costs a forward pass only: the doc scores' gradient needs only each
    passage's likelihood).

    `objective` (`train.retriever_*`, `retriever_losses`): by default RAG's marginal over the
    N passages trains both halves. When the retriever has a loss of its own
    (`RetrieverObjective.separate`), the batch carries K >= N candidates per question, best
    first; the generator's loss is RAG's marginal over the first N with the retriever's towers
    held constant, and the retriever's loss spans all K with the reader's likelihoods held
    constant; the step minimises their sum (each reaches only its own half).

    `passage_first_layer`: the layer a batch's "passage_states" enter the passage tower at
    (`retrieval.passage_trunk`). A batch's "reader_states" / "reader_mask" [B, N, S + T(, H)]
    (`train.reader_trunk`) replace its contexts: the causal reader's frozen layers' output,
    which its layers from `frozen_layers` up read (`causal.reader_inputs`)."""
    labels = optim.path_labels if frozen else None
    objective = objective or RetrieverObjective()
    separate = objective.separate(rag_cfg.n_docs)

    def loss_fn(params, batch, rng):
        if labels is not None:
            fixed = labels(params, frozen, True, False)
            params = jax.tree.map(lambda p, f: jax.lax.stop_gradient(p) if f else p, params, fixed)
        if objective.cut_gradient:  # the control: no gradient reaches the retriever
            params = {k: jax.lax.stop_gradient(v) if k in _TOWERS else v for k, v in params.items()}
        if separate:
            return _with_retriever_objective(
                rag_cfg, objective, variant, (passage_cfg, passage_first_layer), params, batch, rng
            )
        flat = _flat(batch)
        return rag.loss_fn(rag_cfg, params, flat, variant, rng, passage_cfg, passage_first_layer)

    return loss_fn


def _flat(batch: dict) -> dict:
    """Token leaves travel as [B, N, L] so every leaf shards over B; the loss takes [B * N, L]."""
    flat = dict(batch)
    for key in _PER_DOC_TOKENS:
        if key in batch:
            flat[key] = batch[key].reshape(-1, *batch[key].shape[2:])  # -> [B * N, L(, H)]
    return flat


def _first_docs(batch: dict, n_docs: int) -> dict:
    """The batch with only the first `n_docs` candidates of each question (the generator's)."""
    per_doc = (*_PER_DOC_TOKENS, "doc_vectors", "answer_logprobs")
    return {k: v[:, :n_docs] if k in per_doc else v for k, v in batch.items()}


def _with_retriever_objective(rag_cfg, objective, variant, passage, params, batch, rng):
    """`joint_loss_fn`'s loss when the retriever has an objective of its own (see there)."""
    n_docs, (passage_cfg, first_layer) = rag_cfg.n_docs, passage
    constant_towers = {
        k: jax.lax.stop_gradient(v) if k in _TOWERS else v for k, v in params.items()
    }
    first_docs = _flat(_first_docs(batch, n_docs))
    reader_inputs = ("answer_logprobs", "context_input_ids", "reader_states")
    reader_free = not any(name in batch for name in reader_inputs)
    if reader_free and objective.loss != "gold":
        raise ValueError(f"the {objective.loss!r} objective reads the reader: the batch has none")
    if reader_free:  # gold under a frozen generator: its loss would train nothing (`Batcher`)
        generator_loss = jnp.zeros(())
        weights = batch.get("weights", jnp.ones(batch["question_input_ids"].shape[:1]))
        aux = {"weights": weights}
    else:
        generator_loss, aux = rag.loss_fn(
            rag_cfg, constant_towers, first_docs, variant, rng, passage_cfg, first_layer
        )
    q_rng = None if rng is None else jax.random.split(rng)[0]  # the question's, as rag.loss_fn's
    q = rag.question_embeddings(
        rag_cfg, params, batch["question_input_ids"], batch["question_attention_mask"], q_rng
    )  # -> [B, D]
    if "passage_input_ids" in batch or "passage_states" in batch:  # a trainable passage
        # tower: its vectors of the K candidates, recomputed
        p_rng = None if q_rng is None else jax.random.fold_in(q_rng, 1)
        b, k = batch["passage_attention_mask"].shape[:2]
        docs = rag.batch_passage_vectors(
            passage_cfg, params, _flat(batch), b, k, p_rng, first_layer
        )  # -> [B, K, D]
    else:
        docs = batch["doc_vectors"]  # [B, K, D]
    scores = rag.doc_scores(q, docs, rag_cfg.doc_score_scale)  # -> [B, K]
    if objective.loss == "gold":  # the supervised control: gold passages, not the reader
        golds = batch["gold_vectors"]  # [B, D], every question's gold passage
        in_batch = rag.doc_scores(
            q, jnp.broadcast_to(golds[None], (q.shape[0], *golds.shape)), rag_cfg.doc_score_scale
        )  # -> [B, B]
        same = jnp.all(golds[:, None] == golds[None], axis=-1)  # -> [B, B], one stored vector
        per_question = retriever_losses.gold(
            in_batch, scores, batch["candidate_is_gold"], objective.score_temperature, same
        )
    else:
        token_lp, scored = candidate_token_logprobs(rag_cfg, params, batch)
        per_question = retriever_loss(objective, scores, token_lp, scored, variant)  # -> [B]
    weights = aux["weights"]
    total = jnp.sum(per_question * weights)
    mean = total if rag_cfg.reduce_loss else total / jnp.maximum(jnp.sum(weights), 1.0)
    aux = dict(aux, retriever_loss=per_question, candidate_scores=scores)
    aux.setdefault("doc_scores", scores[:, :n_docs])  # the reader-free gold row's top N
    return generator_loss + mean, aux


def candidate_token_logprobs(rag_cfg: rag.RagConfig, params, batch) -> tuple[jax.Array, jax.Array]:
    """The reader's answer-token log-probabilities under each of a batch's K candidates, as
    constants: ([B, K, T], the scored positions [B, T] bool).

    A frozen causal generator's come from its memo (`answer_logprobs`); otherwise the generator
    reads the K contexts once more, without gradient or dropout (its judgement of the
    candidates, not a training pass): from their tokens, or from its frozen layers' cached
    states of them ("reader_states", `training.reader_trunk`), running only the layers above.
    The scored positions are those of RAG-Sequence's likelihood: a causal generator's answer
    and EOS (`causal.label_mask`); BART's shifted targets that are not pad, less the BOS that
    `exclude_bos_score` leaves out.
    """
    labels = jnp.asarray(batch["labels"], jnp.int32)
    labels = jnp.where(labels == causal.IGNORE_INDEX, rag_cfg.pad_token_id, labels)
    pad = rag_cfg.pad_token_id
    if rag_cfg.causal:
        target = labels
        scored = causal.label_mask(labels, rag_cfg.generator.eos_token_id, pad)
    else:  # BART's logits at t predict labels[t + 1] (HF's RAG shifts the targets left)
        target = jnp.concatenate([labels[:, 1:], jnp.full_like(labels[:, :1], pad)], axis=1)
        scored = target != pad
        if rag_cfg.exclude_bos_score and rag_cfg.bos_token_id is not None:
            scored = scored.at[:, 0].set(scored[:, 0] & (target[:, 0] != rag_cfg.bos_token_id))
    if "answer_logprobs" in batch:
        return jax.lax.stop_gradient(batch["answer_logprobs"]), scored
    inputs, mask, first = causal.reader_inputs(rag_cfg, batch)  # [B, K, S] or [B, K, S + T, H]
    flat_inputs = inputs.reshape(-1, *inputs.shape[2:])
    flat_mask, constant = mask.reshape(-1, mask.shape[-1]), jax.lax.stop_gradient(params)
    if first:  # the layers from F up, on the cached states of the ones below
        seq_logits = causal.answer_logits_from_states(
            rag_cfg, constant, flat_inputs, flat_mask, labels.shape[1], first
        )  # -> [B * K, T, V]
    else:
        seq_logits = rag.generator_logits(rag_cfg, constant, flat_inputs, flat_mask, labels)
    seq_logits = seq_logits.reshape(inputs.shape[0], inputs.shape[1], *seq_logits.shape[1:])
    token_lp, _ = rag_math.token_logprobs(seq_logits, target)  # -> [B, K, T]
    return jax.lax.stop_gradient(token_lp), scored


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
    objective: RetrieverObjective | None = None,
    passage_first_layer: int = 0,
):
    """The joint step `train_step(state, batch, retrieval=None) -> (state, metrics)`.

    `frozen` (`train.freeze`): those parameters are constants of the loss (`joint_loss_fn`).
    `objective` (`train.retriever_*`): how the retriever trains (`joint_loss_fn`); with an
    in-step search, `search_n_docs` is then its K candidates.

    `passage_cfg` is needed when batches carry passage tokens (a trainable passage encoder), and
    `passage_first_layer` when they carry the states of its frozen layers instead.
    `state_sharding` is the state's placement, kept by the new state (`make_step`).

    With `search_n_docs` = N > 0 the step also retrieves for the next batch: `retrieval` is
    `(index, next_questions)`, a `DeviceIndex` on the step's mesh and the next batch's
    question-encoder inputs (`question_tokens`, batch-sharded). After the update it embeds them
    with the *updated* question encoder (the one the next step trains) and searches the index, so
    the next batch's passages are the same as a search between the steps would find, without a
    host round trip; they are returned in `state.next_doc_ids`.
    """

    loss_fn = joint_loss_fn(rag_cfg, variant, passage_cfg, frozen, objective, passage_first_layer)
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
