"""RAG: the question encoder and the generator, joined through differentiable doc scores.

`params = {"question_encoder": <BertEncoder params>, "generator": <Bart params>}`. Retrieval itself
(index search, context assembly) happens outside these functions; what comes in is the retrieved
candidates' stored vectors and the generator's context tokens, and everything that depends on
parameters — the question embedding, the doc scores `q · d`, the generator's likelihood and the
marginal over docs — is computed here, inside one jitted function, so the answer loss trains the
question encoder.

HF transformers' `RagSequenceForGeneration` / `RagTokenForGeneration` define the semantics (see
`rag_math` for the loss details); `hf.load_rag` converts their checkpoints.

Legend: B batch, N docs per question, S context length, T target length, V vocab, D embedding
width, K beams, M candidates per question, L generated length. `flat_` arrays are `[B * N, ...]`
with rows ordered `b * N + n`.
"""

import dataclasses
from typing import Any

import flax
import jax
import jax.numpy as jnp

from rag_jax import decoding, rag_math
from rag_jax.models import bart, bert


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """Decoding defaults (HF `generate` settings); `generate()` keyword arguments override them."""

    num_beams: int = 4
    max_length: int = 20
    min_length: int = 0
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    no_repeat_ngram_size: int = 0
    forced_bos_token_id: int | None = None
    forced_eos_token_id: int | None = None
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    num_return_sequences: int = 1


@dataclasses.dataclass(frozen=True)
class RagConfig:
    """A RAG model: its two halves and how they are joined (field names follow HF's RagConfig)."""

    question_encoder: bert.BertConfig
    generator: bart.BartConfig
    n_docs: int = 5  # N: passages retrieved per question
    max_combined_length: int = 300  # S: generator context length (passage + question)
    title_sep: str = " / "  # between a passage's title and text in the context string
    doc_sep: str = " // "  # between the passage and the question
    prefix: str | None = None  # prepended to every context string
    label_smoothing: float = 0.0
    exclude_bos_score: bool = False  # RAG-Sequence: leave the BOS log-prob out of the likelihood
    reduce_loss: bool = False  # `nll` sums over the batch instead of returning [B]
    do_deduplication: bool = True  # RAG-Sequence thorough decoding drops repeated candidates
    # Generator token ids as the RAG loss uses them (HF resolves BOS as
    # `rag.bos_token_id or generator.bos_token_id`; `hf.load_rag` does the same).
    bos_token_id: int | None = 0
    generation: GenerationConfig = GenerationConfig()

    @property
    def pad_token_id(self) -> int:
        return self.generator.pad_token_id

    def replace(self, **changes) -> "RagConfig":
        return dataclasses.replace(self, **changes)


# The retrieval score q · d: [B, D] x [B, N, D] -> [B, N] (re-exported for callers).
doc_scores = rag_math.doc_scores


def init_params(cfg: RagConfig, rng: jax.Array) -> dict:
    """Random parameters for both halves (shapes only depend on the configs)."""
    q_rng, g_rng = jax.random.split(rng)
    ids = jnp.zeros((1, 2), jnp.int32)
    return {
        "question_encoder": bert.BertEncoder(cfg.question_encoder).init(q_rng, ids, ids)["params"],
        "generator": bart.Bart(cfg.generator).init(g_rng, ids, ids, ids)["params"],
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
    return _pooled(
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
    return _pooled(passage_cfg, params["passage_encoder"], input_ids, attention_mask, dropout_rng)


def _pooled(cfg: bert.BertConfig, params, input_ids, attention_mask, dropout_rng) -> jax.Array:
    """A BERT tower's pooled output [M, D]; dropout on when `dropout_rng` is given."""
    rngs = {} if dropout_rng is None else {"dropout": dropout_rng}
    pooled, _ = bert.BertEncoder(cfg).apply(
        {"params": params}, input_ids, attention_mask, None, dropout_rng is None, rngs=rngs
    )
    return pooled


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
      [B * N, T, V] float32.
    """
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
    if labels.ndim != 2 or labels.shape[0] != doc_scores.shape[0]:
        raise ValueError(
            f"labels {tuple(labels.shape)} must be [B, T] for doc_scores {tuple(doc_scores.shape)}"
        )
    reduce = cfg.reduce_loss if reduce is None else reduce
    labels = jnp.asarray(labels, jnp.int32)
    seq_logits = generator_logits(
        cfg, params, context_input_ids, context_attention_mask, labels, dropout_rng
    )
    common = dict(
        pad_token_id=cfg.pad_token_id,
        n_docs=cfg.n_docs,
        epsilon=cfg.label_smoothing,
        reduce=reduce,
    )
    if variant == "sequence":
        exclude = cfg.exclude_bos_score if exclude_bos_score is None else exclude_bos_score
        return rag_math.rag_sequence_nll(
            seq_logits,
            doc_scores,
            labels,
            bos_token_id=cfg.bos_token_id,
            exclude_bos_score=exclude,
            **common,
        )
    if variant == "token":
        if exclude_bos_score:
            raise ValueError("exclude_bos_score applies to RAG-Sequence only")
        return rag_math.rag_token_nll(seq_logits, doc_scores, labels, **common)
    raise ValueError(f"variant must be 'sequence' or 'token', got {variant!r}")


def loss_fn(
    cfg: RagConfig,
    params: dict,
    batch: dict[str, jax.Array],
    variant: str = "sequence",
    dropout_rng: jax.Array | None = None,
    passage_cfg: bert.BertConfig | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The joint training loss: question encoder → doc scores → marginal likelihood.

    Bind `cfg` and `variant` with `functools.partial`; the rest is `loss_fn(params, batch)`.

    Args:
      batch: {"question_input_ids": [B, Q], "question_attention_mask": [B, Q],
        "doc_vectors": [B, N, D] stored vectors of the retrieved passages,
        "context_input_ids": [B * N, S], "context_attention_mask": [B * N, S],
        "labels": [B, T], optional "weights": [B] (0 for padding rows)}. With a trainable
        passage encoder, "passage_input_ids" / "passage_attention_mask" [B * N, P] (its tokens of
        the retrieved passages) replace the stored vectors: the doc vectors are recomputed from
        `params["passage_encoder"]`, so the loss's gradient reaches it too.
      dropout_rng: enables dropout in both halves when given.
      passage_cfg: the passage encoder's config; needed with "passage_input_ids".

    Returns:
      loss: [] the weighted mean per-example NLL.
      aux: {"doc_scores": [B, N], "nll": [B], "weights": [B]}.
    """
    q_rng = g_rng = None
    if dropout_rng is not None:
        q_rng, g_rng = jax.random.split(dropout_rng)
    q = question_embeddings(
        cfg, params, batch["question_input_ids"], batch["question_attention_mask"], q_rng
    )
    if "passage_input_ids" in batch:
        if passage_cfg is None:
            raise ValueError("batch has passage_input_ids but loss_fn got no passage_cfg")
        ids = batch["passage_input_ids"]
        if ids.shape[0] != q.shape[0] * cfg.n_docs:
            raise ValueError(
                f"passage_input_ids {tuple(ids.shape)} must be [B * N, P] with B = "
                f"{q.shape[0]} questions and N = {cfg.n_docs}"
            )
        p_rng = None if q_rng is None else jax.random.fold_in(q_rng, 1)
        docs = passage_embeddings(passage_cfg, params, ids, batch["passage_attention_mask"], p_rng)
        docs = docs.reshape(q.shape[0], cfg.n_docs, -1)  # -> [B, N, D]
    else:
        docs = batch["doc_vectors"]
    if docs.shape[:2] != (q.shape[0], cfg.n_docs):
        raise ValueError(
            f"doc_vectors {tuple(docs.shape)} must be [B, N, D] with B = "
            f"{q.shape[0]} questions and N = {cfg.n_docs}"
        )
    scores = rag_math.doc_scores(q, docs)  # -> [B, N]
    per_example = nll(
        cfg,
        params,
        batch["context_input_ids"],
        batch["context_attention_mask"],
        scores,
        batch["labels"],
        variant,
        reduce=False,
        dropout_rng=g_rng,
    )
    weights = batch.get("weights", jnp.ones_like(per_example))
    loss = jnp.sum(per_example * weights) / jnp.maximum(jnp.sum(weights), 1.0)
    return loss, {"doc_scores": scores, "nll": per_example, "weights": weights}


# ---------------------------------------------------------------------------------------------
# Generation


def _split_cache(cache: dict) -> tuple[dict, dict, tuple]:
    """Splits a Bart decode cache into what a search carries and what stays fixed.

    Returns:
      carried: the self-attention buffers, leaves [B * K * m, ...] (reordered with the beams).
      constants: flat {path: array} of the cross-attention keys/values, one copy per context:
        identical for every beam, so they stay out of the loop state as loop constants.
      scalars: paths of the scalar decode positions (the search tracks the step itself).
    """
    flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(cache))
    scalars = tuple(k for k, v in flat.items() if jnp.ndim(v) == 0)
    constants = {k: v for k, v in flat.items() if k[-1] in ("cross_key", "cross_value")}
    carried = {k: v for k, v in flat.items() if k not in constants and k not in scalars}
    return flax.traverse_util.unflatten_dict(carried), constants, scalars


def _generator_step_fn(
    cfg: RagConfig, params: dict, encoder_mask: jax.Array, constants: dict, scalars, reps: int
):
    """`(flat_ids [R, 1], cache, step) -> (logits [R * reps, V], cache)` for the searches."""
    model = bart.Bart(cfg.generator)

    def step_fn(flat_ids, cache, step):
        ids = jnp.repeat(flat_ids, reps, axis=0)  # -> [R * reps, 1]
        flat = flax.traverse_util.flatten_dict(cache)
        flat.update(constants)
        flat.update({k: jnp.asarray(step, jnp.int32) for k in scalars})
        logits, variables = model.apply(
            {"params": params["generator"], "cache": flax.traverse_util.unflatten_dict(flat)},
            ids,
            None,
            encoder_mask,
            None,
            True,
            method=bart.Bart.decode,
            mutable=["cache"],
        )
        return logits[:, 0], _split_cache(variables["cache"])[0]

    return step_fn


def _encode(cfg, params, flat_ids, flat_mask):
    """[B * N, S] contexts -> [B * N, S, H] generator encoder output."""
    return bart.Bart(cfg.generator).apply(
        {"params": params["generator"]}, flat_ids, flat_mask, method=bart.Bart.encode
    )


def _search(cfg, params, encoded, flat_mask, settings, *, batch, docs_per_row, post_fn=None):
    """Runs beam or greedy search over encoded contexts laid out [batch * docs_per_row, S, H].

    With `docs_per_row = N` and `post_fn` marginalising docs, this is RAG-Token decoding; with
    `docs_per_row = 1` it is plain BART decoding of every context (RAG-Sequence candidates). The
    decoder rows are laid out (b, k, n); each context's cross-attention keys/values are computed
    once and shared by its K beams.
    """
    beams = settings["num_beams"]
    model = bart.Bart(cfg.generator)
    mask = flat_mask
    if docs_per_row > 1 and beams > 1:
        # Decoder row (b, k, n) reads context (b, n): see `bart.Bart.decode`.
        encoded = encoded.reshape((batch, docs_per_row) + encoded.shape[1:])  # -> [B, N, S, H]
        mask = flat_mask.reshape(batch, docs_per_row, -1)  # -> [B, N, S]
    cache = bart.init_cache(
        model, params["generator"], encoded, mask, settings["max_length"], group_size=beams
    )
    cache, constants, scalars = _split_cache(cache)
    step_fn = _generator_step_fn(cfg, params, mask, constants, scalars, docs_per_row)
    if post_fn is not None:
        step_fn = post_fn(step_fn)
    common = {k: v for k, v in settings.items() if k not in ("num_beams", "num_return_sequences")}
    gen = cfg.generator
    ids = dict(
        decoder_start_token_id=gen.decoder_start_token_id,
        eos_token_id=gen.eos_token_id,
        pad_token_id=gen.pad_token_id,
    )
    if beams == 1:
        seqs = decoding.greedy_search(step_fn, cache, batch_size=batch, **ids, **common)
        return seqs[:, None], None
    out = decoding.beam_search(
        step_fn,
        cache,
        batch_size=batch,
        num_beams=beams,
        num_return_sequences=settings["num_return_sequences"],
        **ids,
        **common,
    )
    return out.sequences, out.scores


def _settings(cfg: RagConfig, overrides: dict) -> dict:
    unknown = set(overrides) - {f.name for f in dataclasses.fields(GenerationConfig)}
    if unknown:
        raise ValueError(f"unknown generation settings {sorted(unknown)}")
    settings = dataclasses.asdict(dataclasses.replace(cfg.generation, **overrides))
    settings["bad_words_ids"] = tuple(tuple(w) for w in settings["bad_words_ids"])
    if settings["num_beams"] == 1:
        for k in ("length_penalty", "early_stopping"):
            settings.pop(k)
    return settings


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
      likelihood (BOS score excluded), best first (HF's RagSequenceForGeneration.generate, which
      loops over questions; here all questions run at once).
    - RAG-Sequence "fast": the paper's approximation — each candidate is scored from the beams
      alone, `p(y|x, z) = 0` for docs whose beam does not contain y, so no rescoring pass.

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
    n_docs = cfg.n_docs
    _check_contexts(context_input_ids, context_attention_mask, doc_scores, n_docs)
    batch = doc_scores.shape[0]
    s = _settings(cfg, settings)
    if variant == "token":
        beam_scores = jnp.repeat(doc_scores, s["num_beams"], axis=0)  # -> [B * K, N]

        def marginalise(step_fn):
            def fn(flat_ids, cache, step):
                logits, cache = step_fn(flat_ids, cache, step)  # [B * K * N, V]
                marginal = rag_math.rag_token_marginalize(logits[:, None], beam_scores, n_docs)
                return marginal[:, 0], cache

            return fn

        seqs, _ = _search(
            cfg,
            params,
            _encode(cfg, params, context_input_ids, context_attention_mask),
            context_attention_mask,
            s,
            batch=batch,
            docs_per_row=n_docs,
            post_fn=marginalise,
        )
        return seqs[:, 0] if seqs.shape[1] == 1 else seqs
    if variant != "sequence":
        raise ValueError(f"variant must be 'sequence' or 'token', got {variant!r}")
    if sequence_decoding not in ("thorough", "fast"):
        raise ValueError(
            f"sequence_decoding must be 'thorough' or 'fast', got {sequence_decoding!r}"
        )

    beams, num_return = s["num_beams"], s["num_return_sequences"]
    per_doc = dict(s, num_return_sequences=beams)
    encoded = _encode(cfg, params, context_input_ids, context_attention_mask)
    if mask_candidate_contexts:
        search_mask, search_encoded = context_attention_mask, encoded
    else:
        search_mask = jnp.ones_like(context_attention_mask)
        search_encoded = _encode(cfg, params, context_input_ids, search_mask)
    hyps, hyp_scores = _search(
        cfg,
        params,
        search_encoded,
        search_mask,
        per_doc,
        batch=batch * n_docs,
        docs_per_row=1,
    )  # -> [B * N, K, L]
    length = hyps.shape[-1]
    candidates = hyps.reshape(batch, n_docs * hyps.shape[1], length)  # -> [B, M, L]
    deduplicate = cfg.do_deduplication
    if sequence_decoding == "fast":
        if hyp_scores is None:
            raise ValueError("fast decoding needs num_beams > 1")
        scores = rag_math.rag_sequence_fast_scores(
            hyps.reshape(batch, n_docs, beams, length),
            _unnormalised(hyps, hyp_scores, s, cfg).reshape(batch, n_docs, beams),
            doc_scores,
        )
    else:
        scores = -_rescore(
            cfg, params, encoded, context_attention_mask, doc_scores, candidates, chunk=beams
        )
        deduplicate = False  # `_rescore` already scored the repeats -inf
    top, _ = rag_math.select_top_candidates(candidates, scores, num_return, deduplicate=deduplicate)
    return top[:, 0] if num_return == 1 else top


def _rescore(cfg, params, encoded, flat_mask, doc_scores, candidates, *, chunk: int):
    """[B, M] thorough NLL of each question's candidates, repeats left at +inf when deduplicating.

    HF rescores only the distinct candidates of a question. Here the distinct ones are moved to
    the front (in order of first occurrence) and rescored `chunk` candidates at a time in a loop
    that stops after the busiest question's last distinct candidate, so repeated hypotheses (the
    beams of different docs often agree) cost no decoder pass, and the [rows, L, V] logits exist
    for one chunk at a time.
    """
    batch, num_candidates, length = candidates.shape
    chunk = max(1, min(chunk, num_candidates))
    if cfg.do_deduplication:
        first = rag_math.first_occurrence_mask(candidates)  # -> [B, M]
        order = jnp.argsort(~first, axis=1, stable=True)  # distinct first, in their order
        needed = jnp.max(jnp.sum(first, axis=1))  # distinct candidates of the busiest question
    else:
        order = jnp.broadcast_to(jnp.arange(num_candidates), (batch, num_candidates))
        needed = num_candidates
    ranked = jnp.take_along_axis(candidates, order[:, :, None], axis=1)
    chunks = -(-num_candidates // chunk)
    pad = chunks * chunk - num_candidates  # the last chunk's padding rows repeat candidate 0
    ranked = jnp.concatenate([ranked, jnp.repeat(ranked[:, :1], pad, axis=1)], axis=1)

    def body(j, nll):  # nll: [B, chunks * chunk]
        part = jax.lax.dynamic_slice_in_dim(ranked, j * chunk, chunk, axis=1)
        value = _thorough_nll(cfg, params, encoded, flat_mask, doc_scores, part)
        return jax.lax.dynamic_update_slice_in_dim(nll, value.astype(nll.dtype), j * chunk, axis=1)

    nll = jnp.full((batch, chunks * chunk), jnp.inf, jnp.float32)
    nll = jax.lax.fori_loop(0, (needed + chunk - 1) // chunk, body, nll)[:, :num_candidates]
    nll = jnp.take_along_axis(nll, jnp.argsort(order, axis=1), axis=1)  # original order
    return jnp.where(first, nll, jnp.inf) if cfg.do_deduplication else nll


def _thorough_nll(cfg, params, encoded, flat_mask, doc_scores, candidates):
    """[B, M] RAG-Sequence NLL of every candidate against all its question's docs.

    `encoded` [B * N, S, H] is read by the M candidates of each question without copies: decoder
    row (b, m, n) attends to context (b, n) (see `bart.Bart.decode`).
    """
    batch, num_candidates, length = candidates.shape
    n_docs = cfg.n_docs
    encoded = encoded.reshape((batch, n_docs) + encoded.shape[1:])  # -> [B, N, S, H]
    mask = flat_mask.reshape(batch, n_docs, -1)  # -> [B, N, S]
    dec = jnp.repeat(candidates.reshape(batch * num_candidates, length), n_docs, axis=0)
    logits = bart.Bart(cfg.generator).apply(
        {"params": params["generator"]}, dec, encoded, mask, method=bart.Bart.decode
    )  # -> [B * M * N, L, V], rows (b, m, n)
    return rag_math.rag_sequence_thorough_nll(
        logits,
        doc_scores,
        candidates,
        pad_token_id=cfg.pad_token_id,
        bos_token_id=cfg.bos_token_id,
        n_docs=n_docs,
        epsilon=cfg.label_smoothing,
    )


def _unnormalised(hyps, scores, settings, cfg):
    """Undoes the beam search's length penalty: summed log-probs of each hypothesis [B*N, K]."""
    gen = cfg.generator
    fill = gen.pad_token_id or gen.eos_token_id
    # Generated tokens: everything after the decoder start up to and including the first EOS.
    body = hyps[..., 1:]
    is_eos = body == gen.eos_token_id
    first_eos = jnp.argmax(is_eos, axis=-1)
    ended = jnp.any(is_eos, axis=-1)
    gen_len = jnp.where(ended, first_eos + 1, jnp.sum(body != fill, axis=-1))
    return scores * gen_len.astype(jnp.float32) ** settings["length_penalty"]


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
    labels = jnp.asarray(labels, jnp.int32)
    seq_logits = generator_logits(cfg, params, context_input_ids, context_attention_mask, labels)
    return rag_math.doc_posteriors(
        seq_logits, doc_scores, labels, pad_token_id=cfg.pad_token_id, n_docs=cfg.n_docs
    )
