"""RAG-Sequence decoding's candidates: which start with BOS, fast scores, deduplication, the top.

Pure functions, arrays in and arrays out, jittable, with HF transformers' semantics (its
`RagSequenceForGeneration.generate`): the candidates are the beam hypotheses found against each
doc; thorough decoding rescores them with `rag_math.rag_sequence_thorough_nll`, fast decoding
(the paper's) with `rag_sequence_fast_scores`, and `select_top_candidates` keeps the best distinct
ones.

Legend: B batch, N docs per question, K beams, M candidate answers per question, L candidate
length, R answers returned per question.
"""

import jax
import jax.numpy as jnp


def candidates_start_with_bos(
    candidates: jax.Array, bos_token_id: int | None, counted: jax.Array | None = None
) -> jax.Array:
    """Whether every counted candidate of each question starts with BOS, HF's once-per-question
    decision to leave the BOS score out of thorough rescoring.

    Args:
      candidates: [B, M, T] int candidates as generated (decoder start token first), so position 1
        is the first predicted token.
      bos_token_id: generator BOS id, or None (then False).
      counted: [B, M] bool, the candidates HF rescores (the distinct ones when deduplicating);
        None counts them all.

    Returns:
      [B] bool.
    """
    if bos_token_id is None:
        return jnp.zeros(candidates.shape[:1], bool)
    starts = candidates[:, :, 1] == bos_token_id  # [B, M]
    if counted is not None:
        starts = starts | ~counted
    return jnp.all(starts, axis=1)


def rag_sequence_fast_scores(
    beam_tokens: jax.Array, beam_logprobs: jax.Array, doc_scores: jax.Array
) -> jax.Array:
    """RAG-Sequence "fast decoding" scores (Lewis et al. 2020, section 2.4; not in HF).

    Every beam hypothesis of every doc is a candidate. Its score is
    `log sum_z p(z|x) p(y|x, z)`, where `p(y|x, z)` is taken from the beams of doc z when y is
    among them and approximated by 0 otherwise, so no further forward pass is needed.

    Args:
      beam_tokens: [B, N, K, L] int hypotheses of the beam search run against each doc, padded
        identically after their end (two hypotheses are the same answer iff their rows are equal).
      beam_logprobs: [B, N, K] `log p(y|x, z)` of each hypothesis: the summed token
        log-probabilities, without length normalisation.
      doc_scores: [B, N] retrieval scores (unnormalised).

    Returns:
      [B, N * K] score of the candidate `beam_tokens[b, n, k]` at index `n * K + k`; duplicates
      score the same (pass the result to `select_top_candidates` to drop them).
    """
    if beam_tokens.ndim != 4 or beam_tokens.shape[:3] != beam_logprobs.shape:
        raise ValueError(
            f"beam_tokens {tuple(beam_tokens.shape)} must be [B, N, K, L] for beam_logprobs "
            f"{tuple(beam_logprobs.shape)} [B, N, K]"
        )
    if doc_scores.shape != beam_logprobs.shape[:2]:
        raise ValueError(
            f"doc_scores {tuple(doc_scores.shape)} must be [B, N] for beam_logprobs "
            f"{tuple(beam_logprobs.shape)} [B, N, K]"
        )
    batch, n_docs, num_beams, length = beam_tokens.shape
    candidates = beam_tokens.reshape(batch, n_docs * num_beams, length)  # -> [B, M, L]
    # found[b, c, z, k]: candidate c is hypothesis k of doc z.
    found = jnp.all(candidates[:, :, None, None, :] == beam_tokens[:, None], axis=-1)
    # A hypothesis found twice among one doc's beams has one probability under that doc: max, not
    # sum, over the matches.
    cand_doc_ll = jnp.max(
        jnp.where(found, beam_logprobs[:, None], -jnp.inf), axis=-1
    )  # -> [B, M, N]
    doc_logprobs = jax.nn.log_softmax(doc_scores, axis=1)  # [B, N]
    return jax.nn.logsumexp(cand_doc_ll + doc_logprobs[:, None, :], axis=-1)


def first_occurrence_mask(candidates: jax.Array) -> jax.Array:
    """Marks each question's candidates that equal no earlier candidate (HF's deduplication).

    Args:
      candidates: [B, M, L] int token ids, padded identically after their end.

    Returns:
      [B, M] bool, True for the first occurrence of each distinct row.
    """
    if candidates.ndim != 3:
        raise ValueError(f"candidates {tuple(candidates.shape)} must be [B, M, L]")
    num_candidates = candidates.shape[1]
    same = jnp.all(candidates[:, :, None, :] == candidates[:, None, :, :], axis=-1)  # [B, M, M]
    earlier = jnp.tril(jnp.ones((num_candidates, num_candidates), bool), k=-1)  # [c, c'] c' < c
    return ~jnp.any(same & earlier, axis=-1)


def select_top_candidates(
    candidates: jax.Array, scores: jax.Array, num_return: int, *, deduplicate: bool = True
) -> tuple[jax.Array, jax.Array]:
    """Best `num_return` candidates of each question (HF RAG-Sequence `generate`'s final step).

    HF drops repeated candidates before ranking (`do_deduplication`, on by default) and keeps the
    first occurrence; here repeats score -inf instead, so shapes stay static. Ties go to the lower
    index. When fewer than `num_return` distinct candidates exist, repeats fill the remaining
    slots with score -inf (HF raises instead).

    Args:
      candidates: [B, M, L] int token ids.
      scores: [B, M] higher is better: `-rag_sequence_thorough_nll(...)` or
        `rag_sequence_fast_scores(...)`.
      num_return: R, answers returned per question.
      deduplicate: drop repeated candidates before ranking.

    Returns:
      tokens: [B, R, L] the selected candidates, best first.
      top_scores: [B, R] their scores.
    """
    if candidates.ndim != 3 or candidates.shape[:2] != scores.shape:
        raise ValueError(
            f"candidates {tuple(candidates.shape)} must be [B, M, L] for scores "
            f"{tuple(scores.shape)} [B, M]"
        )
    if not 1 <= num_return <= candidates.shape[1]:
        raise ValueError(f"num_return={num_return} must be in [1, M={candidates.shape[1]}]")
    if deduplicate:
        scores = jnp.where(first_occurrence_mask(candidates), scores, -jnp.inf)
    top_scores, index = jax.lax.top_k(scores, num_return)  # -> [B, R]
    tokens = jnp.take_along_axis(candidates, index[:, :, None], axis=1)  # -> [B, R, L]
    return tokens, top_scores
