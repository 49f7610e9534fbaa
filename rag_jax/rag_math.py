"""RAG math: doc scores, RAG-Sequence / RAG-Token likelihoods, thorough rescoring, posteriors.

Pure functions, arrays in and arrays out, jittable (the keyword arguments are Python values: bind
them with `functools.partial` or mark them static). The semantics are those of HF transformers'
`RagSequenceForGeneration` and `RagTokenForGeneration`, so a converted checkpoint gives the same
losses and the same rescored generations.

Legend: B batch, N docs per question, T target length, V vocab, D embedding width, K beams,
M candidate answers per question, L candidate length. Rows of every `flat_` array `[B * N, ...]`
are ordered `b * N + n`, as HF lays out `context_input_ids`.

What the loss is computed against
---------------------------------
The `target` passed to the NLL functions is the sequence the generator's decoder *read*: HF sets
`decoder_input_ids` to `labels` when only labels are given and shifts nothing right, so the labels
are the decoder inputs, first token included (HF's fine-tuning script passes the tokenised answer
`<s> ... </s>` as is; generated candidates begin with BART's decoder start token `</s>`, then
`<s>`). When both are given and differ, HF's RAG-Sequence scores `decoder_input_ids` and RAG-Token
scores `labels`. The logits at position t predict token t + 1, so the functions shift the target
one step left and append a pad:
`[y0, y1, ..., y_{T-1}]` becomes `[y1, ..., y_{T-1}, pad]`. Every position whose shifted target
equals `pad_token_id` contributes nothing (neither to the likelihood nor to the smoothing term);
the last decoder position is therefore never scored. Target ids must lie in `[0, V)`: pad is the
only ignored id here (`rag.nll` also takes HF's `-100` ignore index, read as pad, and refuses
other ids outside the vocabulary).

RAG-Sequence (`rag_sequence_nll`)
---------------------------------
`p(y|x) = sum_z p(z|x) prod_t p(y_t|x, z, y_<t)` with `p(z|x) = softmax(doc_scores)`. The log
prior `log p(z|x)` is added to the token log-probabilities of *shifted* position 1 only (the
second predicted token), whether or not the target has a BOS token. Consequences worth knowing:
when that position is a pad the prior is masked away with it, and when T = 1 it is never added,
so the result is then `-logsumexp` of the unweighted per-doc likelihoods.

BOS handling is batch-wide: only if *every* row's shifted position 0 (the caller's `labels[:, 1]`)
equals `bos_token_id` is the target considered to start with BOS. Then, and only if
`exclude_bos_score`, the log-probability of that BOS token is left out of the likelihood (HF's
thorough decoding rescores candidates this way). One row without BOS disables this for the whole
batch. The smoothing term always includes position 0.

RAG-Token (`rag_token_nll`)
---------------------------
`p(y|x) = prod_t sum_z p(z|x) p(y_t|x, z, y_<t)`: per position, the token distributions of the N
docs are mixed with the prior (`rag_token_marginalize`, also the next-token distribution used in
RAG-Token decoding), and the loss is the NLL of the mixture summed over positions. There is no BOS
handling and no `exclude_bos_score` for this variant.

Label smoothing
---------------
Both variants compute `loss = (1 - epsilon) * nll + (epsilon / V) * smooth`, with a smoothing term
that is not the usual mean cross-entropy against the uniform distribution:

- RAG-Token: `smooth = -sum_t sum_v log p_mix(v | t)` over unpadded positions.
- RAG-Sequence: per doc, `s_z = sum_t sum_v log p(v | x, z, t)` over unpadded positions, where the
  log-probabilities at position 1 include the prior, so `s_z` carries `V * log p(z|x)`; then
  `smooth = -logsumexp_z s_z`. The docs are marginalised on the summed smoothing scores just as on
  the likelihoods.

With `reduce=True` both terms are summed over the batch (not averaged) before being combined.
"""

import jax
import jax.numpy as jnp

from rag_jax.sequence_candidates import candidates_start_with_bos


def doc_scores(question_emb: jax.Array, doc_emb: jax.Array, scale: float = 1.0) -> jax.Array:
    """Inner products between each question and its retrieved docs, times `scale`.

    The doc vectors are cast to the question's dtype first, as HF does, so the scores come out in
    the question encoder's dtype. The product runs at full precision: the TPU default rounds
    float32 operands to bfloat16, and the softmax over docs turns score errors into relative
    errors of the doc weights of the same size.

    Args:
      question_emb: [B, D] question encoder outputs.
      doc_emb: [B, N, D] stored vectors of the retrieved docs.
      scale: the scores' temperature inverse (`RagConfig.doc_score_scale`): unit vectors score
        in [-1, 1], which a softmax over the top k turns into nearly uniform weights.

    Returns:
      [B, N] scores `scale * question_emb[b] . doc_emb[b, n]`, dtype of `question_emb`.
    """
    check_doc_shapes(question_emb.shape, doc_emb.shape)
    doc_emb = doc_emb.astype(question_emb.dtype)
    scores = jnp.einsum("bd,bnd->bn", question_emb, doc_emb, precision=jax.lax.Precision.HIGHEST)
    return scores if scale == 1.0 else scores * jnp.asarray(scale, scores.dtype)


def check_doc_shapes(question_shape, doc_shape) -> None:
    """Raises unless the doc vectors are [B, N, D] for question vectors [B, D]."""
    if (
        len(question_shape) != 2
        or len(doc_shape) != 3
        or (doc_shape[0], doc_shape[2]) != tuple(question_shape)
    ):
        raise ValueError(
            f"doc_emb {tuple(doc_shape)} must be [B, N, D] for question_emb "
            f"{tuple(question_shape)} [B, D]"
        )


def _check_logits_and_scores(seq_logits: jax.Array, doc_scores: jax.Array, n_docs: int) -> None:
    """Checks that seq_logits is [B * N, T, V] for doc_scores [B, N] with N = n_docs."""
    if doc_scores.ndim != 2 or doc_scores.shape[1] != n_docs:
        raise ValueError(f"doc_scores {tuple(doc_scores.shape)} must be [B, N] with N = {n_docs}")
    if seq_logits.ndim != 3 or seq_logits.shape[0] != doc_scores.shape[0] * n_docs:
        raise ValueError(
            f"seq_logits {tuple(seq_logits.shape)} must be [B * N, T, V]: its batch is "
            f"inconsistent with doc_scores {tuple(doc_scores.shape)} [B, N]"
        )


def _check_nll_inputs(
    seq_logits: jax.Array, doc_scores: jax.Array, target: jax.Array, n_docs: int
) -> tuple[int, int, int, int]:
    """Validates the shapes shared by the NLL functions; returns (B, N, T, V)."""
    _check_logits_and_scores(seq_logits, doc_scores, n_docs)
    batch = doc_scores.shape[0]
    _, length, vocab = seq_logits.shape
    if target.shape != (batch, length):
        raise ValueError(
            f"target {tuple(target.shape)} must be [B, T] = {(batch, length)} for seq_logits "
            f"{tuple(seq_logits.shape)} and doc_scores {tuple(doc_scores.shape)}"
        )
    if not jnp.issubdtype(target.dtype, jnp.integer):
        raise ValueError(f"target must hold integer token ids, got dtype {target.dtype}")
    return batch, n_docs, length, vocab


def _shift_left(target: jax.Array, pad_token_id: int) -> jax.Array:
    """[B, T] decoder inputs -> [B, T] tokens they predict (the last one is a pad)."""
    pad = jnp.full((target.shape[0], 1), pad_token_id, target.dtype)
    return jnp.concatenate([target[:, 1:], pad], axis=1)


def _scored(target: jax.Array, pad_token_id: int, target_mask: jax.Array | None) -> jax.Array:
    """[B, T] bool: the positions that count, `target_mask` or else those not predicting pad."""
    if target_mask is None:
        return target != pad_token_id
    if target_mask.shape != target.shape:
        raise ValueError(
            f"target_mask {tuple(target_mask.shape)} must be [B, T] = {tuple(target.shape)}"
        )
    return target_mask.astype(bool)


def _align(target, pad_token_id, aligned: bool):
    """The targets the logits predict: shifted left (decoder inputs), or as given (`aligned`)."""
    return target if aligned else _shift_left(target, pad_token_id)


def _smoothing(epsilon) -> bool:
    """Whether the label-smoothing term is needed (a Python 0 skips its [.., V] sums)."""
    return not (isinstance(epsilon, int | float) and epsilon == 0)


def token_logprobs(seq_logits: jax.Array, target: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Log-probabilities of the targets, without materialising the [.., V] log-softmax.

    Args:
      seq_logits: [B, N, T, V] logits.
      target: [B, T] token ids.

    Returns:
      token_lp: [B, N, T] `log softmax(seq_logits)[target]`.
      norm: [B, N, T] the log-normaliser `logsumexp(seq_logits)` over V.
    """
    batch, n_docs, length, _ = seq_logits.shape
    index = jnp.broadcast_to(target[:, None, :, None], (batch, n_docs, length, 1))
    picked = jnp.take_along_axis(seq_logits, index, axis=-1)[..., 0]  # -> [B, N, T]
    norm = jax.nn.logsumexp(seq_logits, axis=-1)  # [B, N, T]
    return picked - norm, norm


def _sequence_doc_terms(
    seq_logits: jax.Array,
    doc_scores: jax.Array,
    target: jax.Array,
    skip_first: jax.Array,
    pad_token_id: int,
    smoothing: bool = True,
    target_mask: jax.Array | None = None,
    prior_at: int = 1,
) -> tuple[jax.Array, jax.Array | None]:
    """Per-doc RAG-Sequence log-likelihood and smoothing sums.

    Args:
      seq_logits: [B * N, T, V] generator logits.
      doc_scores: [B, N].
      target: [B, T] shifted-left targets.
      skip_first: [B] bool, whether position 0 is left out of the likelihood of each row.
      pad_token_id: positions whose target is this id are masked (unless `target_mask` is given).
      smoothing: compute the smoothing sums (otherwise None is returned for them).
      target_mask: [B, T] bool, the scored positions, instead of `target != pad_token_id`.
      prior_at: the position whose log-probabilities carry the prior (BART: 1, as HF adds it);
        0: a causal generator's, added once per sequence whichever positions are scored.

    Returns:
      ll: [B, N] `log p(z|x) + sum_t log p(y_t|x, z, y_<t)` over scored positions (the prior
        only when position 1 is one of them).
      smooth: [B, N] sum over unpadded positions and the vocab of the prior-shifted log-probs,
        or None.
    """
    batch, n_docs = doc_scores.shape
    _, length, vocab = seq_logits.shape
    seq_logits = seq_logits.reshape(batch, n_docs, length, vocab)  # -> [B, N, T, V]
    # A causal generator's prior (prior_at 0) is the sequence's, added once whichever positions
    # are scored (labels may ignore position 0); BART's rides on position 1 as in HF.
    once = prior_at == 0
    prior = jnp.zeros((batch, n_docs, length)) if once else _prior(doc_scores, length, prior_at)
    doc_logprobs = jax.nn.log_softmax(doc_scores, axis=1) if once else 0.0  # [B, N]
    not_pad = _scored(target, pad_token_id, target_mask)[:, None, :]  # [B, 1, T]
    scored = not_pad & ~(skip_first[:, None, None] & (jnp.arange(length) == 0))  # [B, 1, T]
    if not smoothing:
        token_ll, _ = token_logprobs(seq_logits, target)  # -> [B, N, T]
        return _sequence_ll(token_ll, prior, scored) + doc_logprobs, None
    seq_logprobs = jax.nn.log_softmax(seq_logits, axis=-1)  # [B, N, T, V]
    token_ll = jnp.take_along_axis(
        seq_logprobs, jnp.broadcast_to(target[:, None, :, None], (batch, n_docs, length, 1)), -1
    )[..., 0]  # -> [B, N, T]
    ll = _sequence_ll(token_ll, prior, scored) + doc_logprobs
    # Summing the prior-shifted log-probs over the vocab adds V times the prior; adding it once,
    # scaled, avoids materialising a second [B, N, T, V] array.
    token_smooth = seq_logprobs.sum(axis=-1) + vocab * prior  # [B, N, T]
    smooth = jnp.where(not_pad, token_smooth, 0.0).sum(axis=2) + vocab * doc_logprobs
    return ll, smooth


def _prior(doc_scores, length: int, prior_at: int) -> jax.Array:
    """[B, N, T] `log p(z|x)` at position `prior_at`, 0 elsewhere. `where` rather than a
    multiplication by a one-hot keeps a doc scored -inf (masked out) from turning the other
    positions into NaN."""
    doc_logprobs = jax.nn.log_softmax(doc_scores, axis=1)  # [B, N]
    at_prior = (jnp.arange(length) == prior_at)[None, None, :]  # [1, 1, T]
    return jnp.where(at_prior, doc_logprobs[:, :, None], 0.0)


def _sequence_ll(token_ll, prior, scored) -> jax.Array:
    """[B, N] `log p(z|x) + sum_t log p(y_t|x, z, y_<t)` over the `scored` positions ([B, 1, T]
    or [B, N, T]) of the targets' log-probs `token_ll` [B, N, T], the prior (`_prior`) with them
    where its position is scored."""
    return jnp.where(scored, token_ll + prior, 0.0).sum(axis=2)


def _token_ll(token_ll, doc_scores, scored) -> jax.Array:
    """[B] RAG-Token `-sum_t log sum_z p(z|x) p(y_t|x, z, y_<t)` over the `scored` positions
    ([B, T]) of the targets' log-probs `token_ll` [B, N, T]."""
    doc_logprobs = jax.nn.log_softmax(doc_scores, axis=1)  # [B, N]
    mixed = jax.nn.logsumexp(token_ll + doc_logprobs[:, :, None], axis=1)  # -> [B, T]
    return -jnp.where(scored, mixed, 0.0).sum(axis=1)


def nll_from_token_logprobs(
    token_logprobs: jax.Array, doc_scores: jax.Array, scored: jax.Array, variant: str
) -> jax.Array:
    """[B] RAG-Sequence or RAG-Token NLL from the answer tokens' log-probabilities under each
    doc, without label smoothing: what `rag_sequence_nll` / `rag_token_nll` compute for an
    aligned (causal) target from its logits, the same arithmetic.

    A frozen generator's log-probabilities of a (question, passage, answer) never change, so
    they can be computed once (`training.memo`) while the doc scores train.

    Args:
      token_logprobs: [B, N, T] `log p(y_t|x, z_n, y_<t)` (any value where not scored).
      doc_scores: [B, N] retrieval scores (unnormalised).
      scored: [B, T] bool, the answer positions that count (`causal.label_mask`).
      variant: "sequence" (the prior added once per sequence) or "token".
    """
    if token_logprobs.shape[:2] != doc_scores.shape or token_logprobs.shape[::2] != scored.shape:
        raise ValueError(
            f"token_logprobs {tuple(token_logprobs.shape)} must be [B, N, T] for doc_scores "
            f"{tuple(doc_scores.shape)} [B, N] and scored {tuple(scored.shape)} [B, T]"
        )
    scored = scored.astype(bool)
    if variant == "sequence":  # the prior once, whichever positions are scored
        doc_logprobs = jax.nn.log_softmax(doc_scores, axis=1)  # [B, N]
        ll = jnp.where(scored[:, None, :], token_logprobs, 0.0).sum(axis=2) + doc_logprobs
        return -jax.nn.logsumexp(ll, axis=1)
    if variant == "token":
        return _token_ll(token_logprobs, doc_scores, scored)
    raise ValueError(f"variant must be 'sequence' or 'token', got {variant!r}")


def _combine(
    nll: jax.Array, smooth: jax.Array | None, epsilon: float, vocab: int, reduce: bool
) -> jax.Array:
    """HF's label-smoothed loss from the [B] NLL and smoothing terms (None: no smoothing)."""
    if smooth is None:
        return nll.sum() if reduce else nll
    if reduce:
        nll, smooth = nll.sum(), smooth.sum()
    return (1.0 - epsilon) * nll + (epsilon / vocab) * smooth


def rag_sequence_nll(
    seq_logits: jax.Array,
    doc_scores: jax.Array,
    target: jax.Array,
    *,
    pad_token_id: int,
    bos_token_id: int | None,
    n_docs: int,
    epsilon: float = 0.0,
    exclude_bos_score: bool = False,
    reduce: bool = False,
    aligned: bool = False,
    target_mask: jax.Array | None = None,
) -> jax.Array:
    """RAG-Sequence negative log-likelihood (HF `RagSequenceForGeneration.get_nll`).

    With `aligned` (a causal generator), `seq_logits[:, t]` predict `target[:, t]` itself (the
    answer tokens, no shift) and the prior is added once, at position 0; `target_mask` then says
    which positions are scored (a causal LM's pad id is often its EOS).

    Args:
      seq_logits: [B * N, T, V] generator logits (unnormalised; log-softmaxed here), row `b * N + n`
        conditioned on doc n of question b.
      doc_scores: [B, N] retrieval scores (unnormalised; softmaxed over N here).
      target: [B, T] int, the decoder input ids the logits were computed from; shifted left here.
      pad_token_id: generator pad id; positions predicting it are masked.
      bos_token_id: generator BOS id, or None when the generator has none (T5).
      n_docs: N.
      epsilon: label smoothing weight.
      exclude_bos_score: leave the BOS token's log-probability out of the likelihood, when every
        row's first predicted token is BOS.
      reduce: sum the loss over the batch.
      aligned: the logits predict the targets as given (see above).
      target_mask: [B, T] bool scored positions, instead of `target != pad_token_id`.

    Returns:
      [B] per-question loss, or a scalar sum when `reduce`.
    """
    batch, _, _, vocab = _check_nll_inputs(seq_logits, doc_scores, target, n_docs)
    target = _align(target, pad_token_id, aligned)
    if exclude_bos_score and aligned:
        raise ValueError("exclude_bos_score applies to a seq2seq generator's targets only")
    if exclude_bos_score and bos_token_id is not None:
        # Batch-wide: a single row not starting with BOS disables the exclusion for every row.
        use_bos = jnp.all(target[:, 0] == bos_token_id)
    else:
        use_bos = jnp.zeros((), bool)
    skip_first = jnp.broadcast_to(use_bos, (batch,))
    ll, smooth = _sequence_doc_terms(
        seq_logits,
        doc_scores,
        target,
        skip_first,
        pad_token_id,
        _smoothing(epsilon),
        target_mask,
        prior_at=0 if aligned else 1,
    )
    nll = -jax.nn.logsumexp(ll, axis=1)  # [B]
    if smooth is not None:
        smooth = -jax.nn.logsumexp(smooth, axis=1)
    return _combine(nll, smooth, epsilon, vocab, reduce)


def rag_token_marginalize(seq_logits: jax.Array, doc_scores: jax.Array, n_docs: int) -> jax.Array:
    """Per-position mixture of the docs' token distributions (HF RAG-Token `marginalize`).

    Args:
      seq_logits: [B * N, T, V] generator logits (unnormalised), row `b * N + n`.
      doc_scores: [B, N] retrieval scores (unnormalised).
      n_docs: N.

    Returns:
      [B, T, V] `log sum_z p(z|x) p(v|x, z, t)`, normalised over V.
    """
    _check_logits_and_scores(seq_logits, doc_scores, n_docs)
    batch = doc_scores.shape[0]
    _, length, vocab = seq_logits.shape
    seq_logprobs = jax.nn.log_softmax(seq_logits, axis=-1)
    seq_logprobs = seq_logprobs.reshape(batch, n_docs, length, vocab)  # -> [B, N, T, V]
    doc_logprobs = jax.nn.log_softmax(doc_scores, axis=1)  # [B, N]
    return jax.nn.logsumexp(seq_logprobs + doc_logprobs[:, :, None, None], axis=1)


def rag_token_nll(
    seq_logits: jax.Array,
    doc_scores: jax.Array,
    target: jax.Array,
    *,
    pad_token_id: int,
    n_docs: int,
    epsilon: float = 0.0,
    reduce: bool = False,
    aligned: bool = False,
    target_mask: jax.Array | None = None,
) -> jax.Array:
    """RAG-Token negative log-likelihood (HF `RagTokenForGeneration.get_nll`).

    `aligned` and `target_mask` as in `rag_sequence_nll` (a causal generator's answer tokens).

    Args:
      seq_logits: [B * N, T, V] generator logits (unnormalised), row `b * N + n`.
      doc_scores: [B, N] retrieval scores (unnormalised).
      target: [B, T] int, the decoder input ids the logits were computed from; shifted left here.
      pad_token_id: generator pad id; positions predicting it are masked.
      n_docs: N.
      epsilon: label smoothing weight.
      reduce: sum the loss over the batch.

    Returns:
      [B] per-question loss, or a scalar sum when `reduce`.
    """
    batch, _, length, vocab = _check_nll_inputs(seq_logits, doc_scores, target, n_docs)
    target = _align(target, pad_token_id, aligned)
    not_pad = _scored(target, pad_token_id, target_mask)
    if not _smoothing(epsilon):
        # Only the targets' mixture probabilities are needed: mix the N docs' [B, N, T] target
        # log-probs instead of whole [B, N, T, V] distributions.
        token_lp, _ = token_logprobs(seq_logits.reshape(batch, n_docs, length, vocab), target)
        return _combine(_token_ll(token_lp, doc_scores, not_pad), None, epsilon, vocab, reduce)
    rag_logprobs = rag_token_marginalize(seq_logits, doc_scores, n_docs)  # [B, T, V]
    token_ll = jnp.take_along_axis(rag_logprobs, target[:, :, None], axis=-1)[..., 0]  # -> [B, T]
    nll = -jnp.where(not_pad, token_ll, 0.0).sum(axis=1)  # [B]
    smooth = -jnp.where(not_pad, rag_logprobs.sum(axis=-1), 0.0).sum(axis=1)
    return _combine(nll, smooth, epsilon, vocab, reduce)


def rag_sequence_thorough_nll(
    flat_seq_logits: jax.Array,
    doc_scores: jax.Array,
    candidates: jax.Array,
    *,
    pad_token_id: int,
    bos_token_id: int | None,
    n_docs: int,
    epsilon: float = 0.0,
    use_bos: jax.Array | None = None,
    aligned: bool = False,
    target_mask: jax.Array | None = None,
) -> jax.Array:
    """Losses by which RAG-Sequence thorough decoding ranks candidates, for a batch of questions.

    With `aligned` (a causal generator) the candidates are answer tokens the logits predict as
    given, scored where `target_mask` [B, M, T] says, the prior once at position 0, no BOS rule.

    HF rescores all the (distinct) candidates of one question at once with
    `exclude_bos_score=True`; BOS detection is thus per question, over all of its candidates,
    which this function reproduces for all questions at once. When a question's candidates are
    scored a part at a time, pass `use_bos` decided over all of them
    (`candidates_start_with_bos`); otherwise it is decided over the M given here. Trailing pads
    beyond a question's own longest candidate change nothing.

    Args:
      flat_seq_logits: [B * M * N, T, V] generator logits of candidate c read against doc n of
        question b in row `(b * M + c) * N + n`.
      doc_scores: [B, N] retrieval scores of each question's docs (shared by its candidates).
      candidates: [B, M, T] int candidate token ids, as the generator produced them (decoder start
        token first), padded with `pad_token_id`.
      pad_token_id: generator pad id.
      bos_token_id: generator BOS id, or None.
      n_docs: N.
      epsilon: label smoothing weight (HF applies the model's configured label smoothing here too).
      use_bos: [B] bool, whether each question's candidates all start with BOS (so its score is
        left out); None decides it over the `candidates` given.

    Returns:
      [B, M] loss of each candidate; lower ranks first.
    """
    if candidates.ndim != 3 or candidates.shape[0] != doc_scores.shape[0]:
        raise ValueError(
            f"candidates {tuple(candidates.shape)} must be [B, M, T] for doc_scores "
            f"{tuple(doc_scores.shape)} [B, N]"
        )
    batch, num_candidates, length = candidates.shape
    flat_doc_scores = jnp.repeat(doc_scores, num_candidates, axis=0)  # -> [B * M, N]
    flat_target = candidates.reshape(batch * num_candidates, length)  # -> [B * M, T]
    _, _, _, vocab = _check_nll_inputs(flat_seq_logits, flat_doc_scores, flat_target, n_docs)
    flat_target = _align(flat_target, pad_token_id, aligned)
    flat_mask = None if target_mask is None else target_mask.reshape(flat_target.shape)
    if aligned:
        use_bos = jnp.zeros((batch,), bool)
    elif use_bos is None:
        use_bos = candidates_start_with_bos(candidates, bos_token_id)  # [B]
    elif use_bos.shape != (batch,):
        raise ValueError(f"use_bos {tuple(use_bos.shape)} must be [B] = [{batch}]")
    skip_first = jnp.repeat(use_bos, num_candidates)  # -> [B * M]
    ll, smooth = _sequence_doc_terms(
        flat_seq_logits,
        flat_doc_scores,
        flat_target,
        skip_first,
        pad_token_id,
        _smoothing(epsilon),
        flat_mask,
        prior_at=0 if aligned else 1,
    )
    nll = -jax.nn.logsumexp(ll, axis=1)  # [B * M]
    if smooth is not None:
        smooth = -jax.nn.logsumexp(smooth, axis=1)
    return _combine(nll, smooth, epsilon, vocab, reduce=False).reshape(batch, num_candidates)


def doc_posteriors(
    seq_logits: jax.Array,
    doc_scores: jax.Array,
    target: jax.Array,
    *,
    pad_token_id: int,
    n_docs: int,
    aligned: bool = False,
    target_mask: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Which retrieved doc an answer, and each of its tokens, came from (the paper's provenance).

    With `aligned` (a causal generator), `target` holds the answer tokens the logits predict as
    given and row t of `token_posteriors` is that of `target[:, t]`; `target_mask` the scored ones.

    - `posterior[b, z] = p(z|x, y) ∝ p(z|x) prod_t p(y_t|x, z, y_<t)`: RAG-Sequence's posterior
      of the one doc that produced the whole answer.
    - `token_posteriors[b, t, z] = p(z|x, y_<=t) ∝ p(z|x) p(y_t|x, z, y_<t)`: RAG-Token draws a
      doc per token, so the doc of token t is explained by that token alone (Lewis et al. 2020,
      figure 2).

    Every unpadded target position counts (BOS included); the prior is the softmax of the doc
    scores, as in the likelihoods above. `target` is read as the NLL functions read it: the
    decoder inputs, shifted one step left here.

    Args:
      seq_logits: [B * N, T, V] generator logits, row `b * N + n` conditioned on doc n.
      doc_scores: [B, N] retrieval scores (unnormalised).
      target: [B, T] int decoder input ids the logits were computed from.
      pad_token_id: generator pad id; positions predicting it are not scored.
      n_docs: N.

    Returns:
      posterior: [B, N], each row summing to 1.
      token_posteriors: [B, T, N]; row t is the posterior of the token `target[:, t + 1]` and
        sums to 1, or is all zeros where that token is a pad (the last row always is).
    """
    batch, _, length, vocab = _check_nll_inputs(seq_logits, doc_scores, target, n_docs)
    target = _align(target, pad_token_id, aligned)
    token_lp, _ = token_logprobs(seq_logits.reshape(batch, n_docs, length, vocab), target)
    scored = _scored(target, pad_token_id, target_mask)[:, None, :]  # [B, 1, T]
    token_lp = jnp.where(scored, token_lp, 0.0)  # -> [B, N, T]
    doc_logprobs = jax.nn.log_softmax(doc_scores.astype(token_lp.dtype), axis=1)  # [B, N]
    posterior = jax.nn.softmax(doc_logprobs + token_lp.sum(axis=2), axis=1)
    per_token = jax.nn.softmax(doc_logprobs[:, :, None] + token_lp, axis=1)  # [B, N, T]
    per_token = jnp.where(scored, per_token, 0.0)
    return posterior, jnp.transpose(per_token, (0, 2, 1))  # -> [B, T, N]
