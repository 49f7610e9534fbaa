"""RAG: the question encoder and the generator, joined through differentiable doc scores.

`params = {"question_encoder": <BertEncoder params>, "generator": <Bart params>}`. Retrieval itself
(index search, context assembly) happens outside these functions; what comes in is the retrieved
candidates' stored vectors and the generator's context tokens, and everything that depends on
parameters — the question embedding, the doc scores `q · d`, the generator's likelihood and the
marginal over docs — is computed here, inside one jitted function, so the answer loss trains the
question encoder.

HF transformers' `RagSequenceForGeneration` / `RagTokenForGeneration` define the semantics (see
`rag_math` for the loss details); `hf.load_rag` converts their checkpoints.

The public entry points (`question_embeddings`, `passage_embeddings`, `doc_scores`, `nll`,
`generate`) are fast when called plainly: each is jitted inside, with the configuration and the
decoding settings static, and its compiled programs are cached, so a second call with the same
shapes runs the program it compiled the first time (`trace_counts()` says how often each was
traced). Inside a caller's own `jax.jit` they trace into the caller's program as usual.

Legend: B batch, N docs per question, S context length, T target length, V vocab, D embedding
width, K beams, M candidates per question, L generated length. `flat_` arrays are `[B * N, ...]`
with rows ordered `b * N + n`.
"""

import collections
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rag_jax import causal, generation, rag_math
from rag_jax.devices import progress
from rag_jax.models import bart, bert, llama
from rag_jax.rag_config import GenerationConfig, RagConfig  # noqa: F401 - rag.RagConfig

# HF's ignore index for labels (its seq2seq losses skip these positions).
IGNORE_INDEX = causal.IGNORE_INDEX
_TRACES: collections.Counter = collections.Counter()


def trace_counts() -> dict[str, int]:
    """How many times each public entry point has been traced (compiled) in this process."""
    return dict(_TRACES)


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


@functools.partial(jax.jit, static_argnames="scale")
def _doc_scores(question_emb, doc_emb, scale):
    _TRACES["doc_scores"] += 1
    return rag_math.doc_scores(question_emb, doc_emb, scale)


def doc_scores(question_emb: jax.Array, doc_emb: jax.Array, scale: float = 1.0) -> jax.Array:
    """The retrieval scores `scale * q · d`: [B, D] x [B, N, D] -> [B, N]
    (`rag_math.doc_scores`; a model's scale is `RagConfig.doc_score_scale`)."""
    rag_math.check_doc_shapes(jnp.shape(question_emb), jnp.shape(doc_emb))
    return _doc_scores(question_emb, doc_emb, float(scale))


def init_params(cfg: RagConfig, rng: jax.Array) -> dict:
    """Random parameters for both halves (shapes only depend on the configs)."""
    q_rng, g_rng = jax.random.split(rng)
    ids = jnp.zeros((1, 2), jnp.int32)
    if cfg.causal:
        generator = llama.init_params(cfg.generator, g_rng)
    else:
        generator = bart.Bart(cfg.generator).init(g_rng, ids, ids, ids)["params"]
    return {
        "question_encoder": bert.BertEncoder(cfg.question_encoder).init(q_rng, ids, ids)["params"],
        "generator": generator,
    }


def question_embeddings(
    cfg: RagConfig,
    params: dict,
    input_ids: jax.Array,
    attention_mask: jax.Array,
    dropout_rng: jax.Array | None = None,
) -> jax.Array:
    """The question encoder's retrieval vectors.

    Args:
      cfg: the RAG config.
      params: RAG parameters.
      input_ids: [B, Q] question tokens (question-encoder tokenizer).
      attention_mask: [B, Q].
      dropout_rng: enables dropout when given.

    Returns:
      [B, D] float32.
    """
    return _pooled_jit(
        cfg.question_encoder, params["question_encoder"], input_ids, attention_mask, dropout_rng
    )


def passage_embeddings(
    passage_cfg: bert.BertConfig,
    params: dict,
    input_ids: jax.Array,
    attention_mask: jax.Array,
    dropout_rng: jax.Array | None = None,
) -> jax.Array:
    """The passage encoder's retrieval vectors (as the index stores them), differentiable.

    Args:
      passage_cfg: the passage encoder's config.
      params: RAG parameters with "passage_encoder".
      input_ids: [M, P] passage tokens (passage-encoder tokenizer, `encode.tokenize_passages`).
      attention_mask: [M, P].
      dropout_rng: enables dropout when given.

    Returns:
      [M, D] float32.
    """
    return _pooled_jit(
        passage_cfg, params["passage_encoder"], input_ids, attention_mask, dropout_rng
    )


def batch_passage_vectors(
    passage_cfg, params, batch, questions: int, count: int, dropout_rng, first_layer: int = 0
) -> jax.Array:
    """[B, K, D] doc vectors of a batch's passages, recomputed by the trainable passage tower:
    from "passage_input_ids" [B * K, P], or from "passage_states" [B * K, P, H] entering layer
    `first_layer`; with "passage_attention_mask" [B * K, P]."""
    if passage_cfg is None:
        raise ValueError("the batch has the passages' inputs but the loss got no passage_cfg")
    name = "passage_states" if "passage_states" in batch else "passage_input_ids"
    inputs, first = batch[name], first_layer if name == "passage_states" else 0
    if name == "passage_states" and not first:
        raise ValueError("passage_states need the layer they enter (passage_first_layer > 0)")
    if inputs.shape[0] != questions * count:
        raise ValueError(
            f"{name} {tuple(inputs.shape)} must have B * K rows: B = {questions} questions, "
            f"K = {count} passages each"
        )
    mask = batch["passage_attention_mask"]
    docs = _pooled(passage_cfg, params["passage_encoder"], inputs, mask, dropout_rng, first)
    return docs.reshape(questions, count, -1)


def _pooled(cfg, params, input_ids, attention_mask, dropout_rng, first_layer=0) -> jax.Array:
    """A BERT tower's pooled output [M, D], from the states entering `first_layer` when > 0;
    dropout on when `dropout_rng` is given."""
    rngs = {} if dropout_rng is None else {"dropout": dropout_rng}
    deterministic = dropout_rng is None
    pooled, _ = bert.BertEncoder(cfg).apply(
        {"params": params}, input_ids, attention_mask, None, deterministic, first_layer, rngs=rngs
    )
    return pooled


@functools.partial(jax.jit, static_argnums=0)
def _pooled_jit(cfg, params, input_ids, attention_mask, dropout_rng):
    _TRACES["embeddings"] += 1
    return _pooled(cfg, params, input_ids, attention_mask, dropout_rng)


def _check_contexts(context_input_ids, context_attention_mask, doc_scores, n_docs):
    if context_input_ids.ndim != 2 or context_attention_mask.shape != context_input_ids.shape:
        raise ValueError(
            f"context_input_ids {tuple(context_input_ids.shape)} and context_attention_mask "
            f"{tuple(context_attention_mask.shape)} must both be [B * N, S]"
        )
    if doc_scores.ndim != 2 or doc_scores.shape[1] != n_docs:
        raise ValueError(f"doc_scores {tuple(doc_scores.shape)} must be [B, N] with N = {n_docs}")
    if context_input_ids.shape[0] != doc_scores.shape[0] * n_docs:
        raise ValueError(
            f"context_input_ids {tuple(context_input_ids.shape)} must have B * N = "
            f"{doc_scores.shape[0]} * {n_docs} rows for doc_scores {tuple(doc_scores.shape)}"
        )


def generator_logits(
    cfg: RagConfig,
    params: dict,
    flat_context_ids: jax.Array,
    flat_context_mask: jax.Array,
    decoder_input_ids: jax.Array,
    dropout_rng: jax.Array | None = None,
) -> jax.Array:
    """Teacher-forced generator logits of each question's target against each of its docs.

    Args:
      flat_context_ids: [B * N, S] context tokens, row b * N + n.
      flat_context_mask: [B * N, S].
      decoder_input_ids: [B, T]; repeated for each of the N docs (HF's `repeat_interleave`).
      dropout_rng: enables dropout when given.

    Returns:
      [B * N, T, V] float32. For a causal generator `decoder_input_ids` are the answer labels and
      position t predicts `decoder_input_ids[:, t]` (`causal.answer_logits`).
    """
    if cfg.causal:
        return causal.answer_logits(
            cfg, params, flat_context_ids, flat_context_mask, decoder_input_ids, dropout_rng
        )
    batch, length = decoder_input_ids.shape
    if flat_context_ids.shape[0] % batch:
        raise ValueError(
            f"context_input_ids {tuple(flat_context_ids.shape)} rows are not a multiple of the "
            f"batch of labels {tuple(decoder_input_ids.shape)}"
        )
    if length > cfg.generator.max_position_embeddings:
        raise ValueError(
            f"labels {tuple(decoder_input_ids.shape)} are longer than the generator allows "
            f"(max_position_embeddings={cfg.generator.max_position_embeddings})"
        )
    n_docs = flat_context_ids.shape[0] // batch
    flat_decoder_ids = jnp.repeat(decoder_input_ids, n_docs, axis=0)  # -> [B * N, T]
    rngs = {} if dropout_rng is None else {"dropout": dropout_rng}
    logits, _ = bart.Bart(cfg.generator).apply(
        {"params": params["generator"]},
        flat_context_ids,
        flat_context_mask,
        flat_decoder_ids,
        None,
        dropout_rng is None,
        rngs=rngs,
    )
    return logits


def nll(
    cfg: RagConfig,
    params: dict,
    context_input_ids: jax.Array,
    context_attention_mask: jax.Array,
    doc_scores: jax.Array,
    labels: jax.Array,
    variant: str = "sequence",
    reduce: bool | None = None,
    exclude_bos_score: bool | None = None,
    dropout_rng: jax.Array | None = None,
) -> jax.Array:
    """The RAG negative log-likelihood of `labels`, as HF's forward computes `loss`.

    Label ids: every id must lie in `[0, V)`, except HF's ignore index `-100` (`IGNORE_INDEX`),
    which marks a position to leave out: it is read as the pad token, both as the decoder's input
    and as a target (so put it after a label's end, as HF's collators pad). Any other id outside
    the vocabulary is refused with its position (a `ValueError` for concrete labels; under the
    caller's own `jax.jit`, where ids are not known, that example's loss is NaN, which a trainer's
    non-finite check stops on) instead of being wrapped into a wrong, finite loss.

    Args:
      cfg: the RAG config (n_docs, label_smoothing, exclude_bos_score, reduce_loss, ids).
      params: RAG parameters.
      context_input_ids: [B * N, S] generator contexts, row b * N + n.
      context_attention_mask: [B * N, S].
      doc_scores: [B, N] retrieval scores (differentiable: computed from the question encoder).
      labels: [B, T] target tokens; they are also the decoder inputs (HF shifts nothing right),
        so they start with the decoder's first token.
      variant: "sequence" (RAG-Sequence) or "token" (RAG-Token).
      reduce: sum over the batch; defaults to `cfg.reduce_loss`.
      exclude_bos_score: RAG-Sequence only; defaults to `cfg.exclude_bos_score`.
      dropout_rng: enables dropout in the generator when given.

    Returns:
      [B] per-example NLL, or a scalar when reducing.
    """
    _check_contexts(context_input_ids, context_attention_mask, doc_scores, cfg.n_docs)
    if jnp.ndim(labels) != 2 or jnp.shape(labels)[0] != doc_scores.shape[0]:
        raise ValueError(
            f"labels {tuple(jnp.shape(labels))} must be [B, T] for doc_scores "
            f"{tuple(doc_scores.shape)}"
        )
    if variant not in ("sequence", "token"):
        raise ValueError(f"variant must be 'sequence' or 'token', got {variant!r}")
    if variant == "token" and exclude_bos_score:
        raise ValueError("exclude_bos_score applies to RAG-Sequence only")
    if cfg.causal:
        if exclude_bos_score:
            raise ValueError("exclude_bos_score applies to a seq2seq generator only")
        causal.check_prompts(context_attention_mask)
    if _is_concrete(labels):
        check_labels(np.asarray(labels), cfg.generator.vocab_size)
    reduce = cfg.reduce_loss if reduce is None else bool(reduce)
    exclude = cfg.exclude_bos_score if exclude_bos_score is None else bool(exclude_bos_score)
    return progress.announced("rag.nll", lambda: _TRACES["nll"], _nll_jit)(
        cfg,
        params,
        context_input_ids,
        context_attention_mask,
        doc_scores,
        labels,
        dropout_rng,
        variant=variant,
        reduce=reduce,
        exclude_bos_score=exclude and variant == "sequence",
    )


def check_labels(labels: np.ndarray, vocab_size: int) -> None:
    """Raises naming the first label id outside `[0, V)` that is not `IGNORE_INDEX`."""
    bad = ((labels < 0) & (labels != IGNORE_INDEX)) | (labels >= vocab_size)
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"labels[{row}, {col}] = {int(labels[row, col])} is outside the generator's "
            f"vocabulary [0, {vocab_size}) and is not the ignore index {IGNORE_INDEX}"
        )


@functools.partial(
    jax.jit, static_argnums=0, static_argnames=("variant", "reduce", "exclude_bos_score")
)
def _nll_jit(cfg, params, context_ids, context_mask, doc_scores, labels, dropout_rng, **options):
    _TRACES["nll"] += 1
    return _nll(cfg, params, context_ids, context_mask, doc_scores, labels, dropout_rng, **options)


def _nll(
    cfg,
    params,
    context_input_ids,
    context_attention_mask,
    doc_scores,
    labels,
    dropout_rng,
    *,
    variant: str,
    reduce: bool,
    exclude_bos_score: bool,
    first_layer: int = 0,
):
    """`nll` without the argument checks, traceable: the ignore index is read as pad, and an
    example with an id outside the vocabulary gets a NaN loss. With `first_layer` F > 0 the
    contexts are a causal generator's states entering layer F (`causal.reader_inputs`)."""
    labels = jnp.asarray(labels, jnp.int32)
    ignored = labels == IGNORE_INDEX
    invalid = ((labels < 0) & ~ignored) | (labels >= cfg.generator.vocab_size)
    common = dict(
        pad_token_id=cfg.pad_token_id, n_docs=cfg.n_docs, epsilon=cfg.label_smoothing, reduce=False
    )
    if cfg.causal:
        common.update(aligned=True, target_mask=_answer_mask(cfg, labels))
    labels = jnp.where(ignored, cfg.pad_token_id, labels)
    if first_layer:  # only the layers from F up run (`causal.answer_logits_from_states`)
        seq_logits = causal.answer_logits_from_states(
            cfg, params, context_input_ids, context_attention_mask, labels.shape[1], first_layer
        )
    else:
        seq_logits = generator_logits(
            cfg, params, context_input_ids, context_attention_mask, labels, dropout_rng
        )
    if variant == "sequence":
        per_example = rag_math.rag_sequence_nll(
            seq_logits,
            doc_scores,
            labels,
            bos_token_id=None if cfg.causal else cfg.bos_token_id,
            exclude_bos_score=exclude_bos_score,
            **common,
        )
    else:
        per_example = rag_math.rag_token_nll(seq_logits, doc_scores, labels, **common)
    per_example = jnp.where(jnp.any(invalid, axis=1), jnp.nan, per_example)
    return per_example.sum() if reduce else per_example


def _answer_mask(cfg: RagConfig, labels: jax.Array) -> jax.Array:
    """[B, T] the scored positions of a causal generator's labels (`causal.label_mask`)."""
    return causal.label_mask(labels, cfg.generator.eos_token_id, cfg.pad_token_id)


def loss_fn(
    cfg: RagConfig,
    params: dict,
    batch: dict[str, jax.Array],
    variant: str = "sequence",
    dropout_rng: jax.Array | None = None,
    passage_cfg: bert.BertConfig | None = None,
    passage_first_layer: int = 0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The joint training loss: question encoder → doc scores → marginal likelihood.

    Bind `cfg` and `variant` with `functools.partial`; the rest is `loss_fn(params, batch)`.

    Args:
      batch: {"question_input_ids": [B, Q], "question_attention_mask": [B, Q],
        "doc_vectors": [B, N, D] stored vectors of the retrieved passages,
        "context_input_ids": [B * N, S], "context_attention_mask": [B * N, S],
        "labels": [B, T], optional "weights": [B] (0 for padding rows)}; a frozen causal
        generator's "answer_logprobs" [B, N, T] (`training.memo`) may replace the contexts:
        the loss then needs no generator pass; so may "reader_states" [B * N, S + T, H] and
        "reader_mask", its frozen layers' output (`training.reader_trunk`): only the layers
        above run. With a trainable passage encoder, "passage_input_ids" /
        "passage_attention_mask" [B * N, P] (its tokens of the retrieved passages) replace the
        stored vectors: the doc vectors are recomputed from `params["passage_encoder"]`, so the
        loss's gradient reaches it too.
      dropout_rng: enables dropout in both halves when given.
      passage_cfg: the passage encoder's config; needed with "passage_input_ids".
      passage_first_layer: the layer "passage_states" [B * N, P, H] enter when they replace the
        passage tokens (the frozen layers' output, `retrieval.passage_trunk`).

    Returns:
      loss: [] the weighted mean per-example NLL (the weighted sum with `cfg.reduce_loss`).
      aux: {"doc_scores": [B, N], "nll": [B], "weights": [B]}.
    """
    q_rng = g_rng = None
    if dropout_rng is not None:
        q_rng, g_rng = jax.random.split(dropout_rng)
    if variant not in ("sequence", "token"):
        raise ValueError(f"variant must be 'sequence' or 'token', got {variant!r}")
    q = _pooled(
        cfg.question_encoder,
        params["question_encoder"],
        batch["question_input_ids"],
        batch["question_attention_mask"],
        q_rng,
    )
    if "passage_input_ids" in batch or "passage_states" in batch:
        p_rng = None if q_rng is None else jax.random.fold_in(q_rng, 1)
        docs = batch_passage_vectors(
            passage_cfg, params, batch, q.shape[0], cfg.n_docs, p_rng, passage_first_layer
        )  # -> [B, N, D]
    else:
        docs = batch["doc_vectors"]
    if docs.shape[:2] != (q.shape[0], cfg.n_docs):
        raise ValueError(
            f"doc_vectors {tuple(docs.shape)} must be [B, N, D] with B = "
            f"{q.shape[0]} questions and N = {cfg.n_docs}"
        )
    scores = rag_math.doc_scores(q, docs, cfg.doc_score_scale)  # -> [B, N]
    if "answer_logprobs" in batch:  # a frozen causal generator's memoised likelihoods
        per_example = causal.memo_nll(
            cfg, batch["answer_logprobs"], scores, batch["labels"], variant
        )
    else:
        inputs, mask, first = causal.reader_inputs(cfg, batch)  # its tokens, or cached states
        if not first:
            _check_contexts(inputs, mask, scores, cfg.n_docs)
        per_example = _nll(
            cfg,
            params,
            inputs,
            mask,
            scores,
            batch["labels"],
            g_rng,
            variant=variant,
            reduce=False,
            exclude_bos_score=cfg.exclude_bos_score and variant == "sequence",
            first_layer=first,
        )
    weights = batch.get("weights", jnp.ones_like(per_example))
    total = jnp.sum(per_example * weights)
    # HF's `reduce_loss`: the loss is the batch's sum; otherwise the mean over weighted examples.
    loss = total if cfg.reduce_loss else total / jnp.maximum(jnp.sum(weights), 1.0)
    return loss, {"doc_scores": scores, "nll": per_example, "weights": weights}


# ---------------------------------------------------------------------------------------------
# Generation


def generate(
    cfg: RagConfig,
    params: dict,
    context_input_ids: jax.Array,
    context_attention_mask: jax.Array,
    doc_scores: jax.Array,
    variant: str = "token",
    sequence_decoding: str = "thorough",
    mask_candidate_contexts: bool = True,
    **settings: Any,
) -> jax.Array:
    """Generates answers, batched over questions.

    - RAG-Token: one beam search whose next-token distribution is the doc-marginal
      `log sum_z p(z|x) p(y_t|x, z, y_<t)` (HF's RagTokenForGeneration.generate).
    - RAG-Sequence "thorough": a beam search per doc returning K hypotheses each, repeated
      candidates dropped, every candidate rescored against all N docs with the RAG-Sequence
      likelihood (BOS score excluded when all of a question's candidates start with BOS), best
      first (HF's RagSequenceForGeneration.generate, which loops over questions; here all
      questions run at once).
    - RAG-Sequence "fast": the paper's approximation — each candidate is scored from the beams
      alone, `p(y|x, z) = 0` for docs whose beam does not contain y, so no rescoring pass.

    Jitted inside, the configuration and the settings static: a second call with the same shapes
    and settings reuses the compiled program.

    Args:
      cfg: the RAG config; `cfg.generation` holds the default settings.
      params: RAG parameters.
      context_input_ids: [B * N, S], row b * N + n.
      context_attention_mask: [B * N, S].
      doc_scores: [B, N].
      variant: "token" or "sequence".
      sequence_decoding: "thorough" or "fast" (RAG-Sequence only).
      mask_candidate_contexts: RAG-Sequence candidates are generated with the context padding
        masked. HF 5.x generates them without a mask (its encoder attends to padding) and only
        rescoring is masked; pass False to reproduce that exactly.
      **settings: GenerationConfig overrides (num_beams, max_length, min_length, ...).

    Returns:
      [B, R, L] int32 token ids (R = num_return_sequences), starting with the decoder start token
      and padded with the pad id; [B, L] when R = 1.
    """
    _check_contexts(context_input_ids, context_attention_mask, doc_scores, cfg.n_docs)
    if variant not in ("sequence", "token"):
        raise ValueError(f"variant must be 'sequence' or 'token', got {variant!r}")
    if sequence_decoding not in ("thorough", "fast"):
        raise ValueError(
            f"sequence_decoding must be 'thorough' or 'fast', got {sequence_decoding!r}"
        )
    resolved = generation.resolve_settings(cfg, settings)
    if cfg.causal:
        causal.check_generation(cfg, context_input_ids, context_attention_mask, resolved)
    if variant == "sequence" and sequence_decoding == "fast" and resolved["num_beams"] == 1:
        raise ValueError("fast decoding needs num_beams > 1")
    return progress.announced("rag.generate", lambda: _TRACES["generate"], _generate_jit)(
        cfg,
        params,
        context_input_ids,
        context_attention_mask,
        doc_scores,
        variant=variant,
        sequence_decoding=sequence_decoding if variant == "sequence" else "thorough",
        mask_candidate_contexts=bool(mask_candidate_contexts),
        settings=tuple(sorted(resolved.items())),
    )


@functools.partial(
    jax.jit,
    static_argnums=0,
    static_argnames=("variant", "sequence_decoding", "mask_candidate_contexts", "settings"),
)
def _generate_jit(cfg, params, context_ids, context_mask, doc_scores, *, settings, **options):
    _TRACES["generate"] += 1
    if cfg.causal:
        options.pop("mask_candidate_contexts")  # a causal prompt is always masked
        return causal.generate(
            cfg, params, context_ids, context_mask, doc_scores, settings=dict(settings), **options
        )
    return generation.generate(
        cfg, params, context_ids, context_mask, doc_scores, settings=dict(settings), **options
    )


# ---------------------------------------------------------------------------------------------
# Provenance


def doc_posteriors(
    cfg: RagConfig,
    params: dict,
    context_input_ids: jax.Array,
    context_attention_mask: jax.Array,
    doc_scores: jax.Array,
    labels: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Which retrieved passage an answer, and each of its tokens, came from.

    Teacher-forces `labels` (e.g. a generated answer) against each doc; see
    `rag_math.doc_posteriors` for the two posteriors.

    Args:
      cfg: the RAG config.
      params: RAG parameters.
      context_input_ids: [B * N, S] generator contexts, row b * N + n.
      context_attention_mask: [B * N, S].
      doc_scores: [B, N].
      labels: [B, T] decoder inputs, as `nll` reads them (`generate`'s output fits as is).

    Returns:
      posterior: [B, N] `p(z|x, y)`.
      token_posteriors: [B, T, N] `p(z|x, y_<=t)` of the token `labels[:, t + 1]` (zeros where it
        is a pad).
    """
    _check_contexts(context_input_ids, context_attention_mask, doc_scores, cfg.n_docs)
    announced = progress.announced("rag.doc_posteriors", lambda: _TRACES["doc_posteriors"],
                                   _doc_posteriors_jit)  # fmt: skip
    return announced(cfg, params, context_input_ids, context_attention_mask, doc_scores, labels)


@functools.partial(jax.jit, static_argnums=0)
def _doc_posteriors_jit(cfg, params, context_ids, context_mask, doc_scores, labels):
    _TRACES["doc_posteriors"] += 1
    labels = jnp.asarray(labels, jnp.int32)
    aligned = {}
    if cfg.causal:
        aligned = dict(aligned=True, target_mask=_answer_mask(cfg, labels))
        labels = jnp.where(labels == IGNORE_INDEX, cfg.pad_token_id, labels)
    seq_logits = generator_logits(cfg, params, context_ids, context_mask, labels)
    return rag_math.doc_posteriors(
        seq_logits, doc_scores, labels, pad_token_id=cfg.pad_token_id, n_docs=cfg.n_docs, **aligned
    )
