"""Model-agnostic beam search and greedy search with the results of Hugging Face `generate`.

Both searches run as one `jax.lax.while_loop` whose state holds the decoder cache, so a whole
generation is one XLA program; every setting is static (bind it with `functools.partial` before
`jax.jit`). The semantics are those of transformers 5.24 `GenerationMixin._beam_search` and
`_sample` (greedy) for the settings BART and RAG checkpoints use: log-softmax, then the logits
processors in HF's order (no-repeat n-gram, bad words, min length, forced BOS, forced EOS), the
top-(2K) candidate step, the length-penalised finished-hypothesis buffer, the early-stopping
heuristic and HF's stopping condition.

Conventions shared by both searches:
  * Output sequences have the fixed length L = `max_length`, start with `decoder_start_token_id`
    (as HF encoder-decoder output does) and count it: `max_length` and `min_length` include it,
    exactly as in HF. Positions after a hypothesis ends are filled (see each function).
  * `tokens_to_logits_fn(flat_ids, cache, step)` gets the last token of every hypothesis,
    `flat_ids: [B * K, 1] int32` (K = 1 for greedy), the cache, and `step: [] int32`, the position
    of `flat_ids` in the output sequence (0 for the decoder start token). It returns
    `(logits: [B * K, V], new_cache)` with `new_cache` of the same structure, shapes and dtypes.
    Log-probabilities are valid logits (RAG-Token's doc marginal): HF log-softmaxes them again.
  * Every cache leaf has a leading dimension that is a multiple of B * K, laid out (b, k, ...):
    `[B * K, ...]` for a plain decoder, `[B * K * N, ...]` for RAG-Token. The caller expands the
    cache to K beams; the search reorders it along that axis when beams are reselected.

Legend: B batch, K beams, R returned sequences per example, L max_length, V vocab, N docs.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

# HF masks beams by adding this finite value rather than -inf, so masked scores stay ordered and
# finite; the same constant gives the same rounding, selections and stopping decisions.
_BEAM_MASK = -1.0e9

TokensToLogitsFn = Callable[[jax.Array, Any, jax.Array], tuple[jax.Array, Any]]


@flax.struct.dataclass
class BeamState:
    """Loop state of `beam_search` (running and finished hypotheses, as in HF)."""

    cur_len: jax.Array  # [] int32: tokens in every running hypothesis, decoder start included
    running_seqs: jax.Array  # [B, K, L] int32: live hypotheses, fill value past cur_len
    running_scores: jax.Array  # [B, K] float32: summed processed log-probs, best first
    finished_seqs: jax.Array  # [B, K, L] int32: best finished hypotheses so far
    finished_scores: jax.Array  # [B, K] float32: length-penalised scores, best first
    finished_flags: jax.Array  # [B, K] bool: slot holds a finished hypothesis
    improvable: jax.Array  # [B] bool: running beams may still beat the finished ones
    done: jax.Array  # [] bool: HF's stopping condition for the whole batch
    cache: Any  # pytree, leaves [B * K * m, ...] laid out (b, k, ...)


@flax.struct.dataclass
class GreedyState:
    """Loop state of `greedy_search`."""

    cur_len: jax.Array  # [] int32: tokens in every sequence, decoder start included
    seqs: jax.Array  # [B, L] int32: pad_token_id past cur_len
    unfinished: jax.Array  # [B] bool: sequence has not produced EOS nor reached max_length
    cache: Any  # pytree, leaves [B * m, ...]


@flax.struct.dataclass
class BeamSearchOutput:
    """Result of `beam_search`, best hypothesis first."""

    sequences: jax.Array  # [B, R, L] int32
    scores: jax.Array  # [B, R] float32: HF's `sequences_scores`


@dataclasses.dataclass(frozen=True)
class _Processors:
    """Static settings of HF's logits processors."""

    max_length: int
    eos_ids: tuple[int, ...]
    no_repeat_ngram_size: int
    bad_words: tuple[tuple[int, ...], ...]
    min_length: int
    forced_bos_token_id: int | None
    forced_eos_ids: tuple[int, ...]


def _as_ids(ids: int | Sequence[int] | None, name: str) -> tuple[int, ...]:
    if ids is None:
        return ()
    ids = (ids,) if isinstance(ids, int | np.integer) else tuple(ids)
    if not ids or any(not isinstance(i, int | np.integer) or i < 0 for i in ids):
        raise ValueError(f"{name} must be a non-negative int or a non-empty list of them: {ids}")
    return tuple(int(i) for i in ids)


def _make_processors(
    max_length,
    eos_token_id,
    min_length,
    forced_bos_token_id,
    forced_eos_token_id,
    bad_words_ids,
    no_repeat_ngram_size,
) -> _Processors:
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2 (decoder start + one token), got {max_length}")
    if min_length < 0 or no_repeat_ngram_size < 0:
        raise ValueError(
            f"min_length ({min_length}) and no_repeat_ngram_size ({no_repeat_ngram_size}) must "
            "be >= 0"
        )
    eos_ids = _as_ids(eos_token_id, "eos_token_id")
    if not eos_ids:
        raise ValueError("eos_token_id is required (one id or a list of ids)")
    if forced_bos_token_id is not None:
        _as_ids(forced_bos_token_id, "forced_bos_token_id")
    words = []
    for word in bad_words_ids:
        word = _as_ids(list(word), "each bad_words_ids entry")
        # HF drops single-token EOS entries and merges duplicates.
        if not (len(word) == 1 and word[0] in eos_ids) and word not in words:
            words.append(word)
    return _Processors(
        max_length=max_length,
        eos_ids=eos_ids,
        no_repeat_ngram_size=no_repeat_ngram_size,
        bad_words=tuple(words),
        min_length=min_length,
        forced_bos_token_id=forced_bos_token_id,
        forced_eos_ids=_as_ids(forced_eos_token_id, "forced_eos_token_id"),
    )


def _process_scores(
    scores: jax.Array, flat_seqs: jax.Array, cur_len: jax.Array, p: _Processors
) -> jax.Array:
    """Applies HF's logits processors.

    Args:
      scores: [M, V] float32 log-probs (beam search) or logits (greedy) for position cur_len.
      flat_seqs: [M, L] int32 hypotheses; only the first cur_len tokens are valid.
      cur_len: [] int32, HF's `input_ids.shape[-1]`.
      p: static processor settings.

    Returns:
      [M, V] float32 processed scores.
    """
    num_rows, vocab = scores.shape
    max_len = flat_seqs.shape[1]
    too_big = [i for i in p.eos_ids + p.forced_eos_ids + sum(p.bad_words, ()) if i >= vocab]
    if p.forced_bos_token_id is not None and p.forced_bos_token_id >= vocab:
        too_big.append(p.forced_bos_token_id)
    if too_big:
        raise ValueError(f"token ids {too_big} are outside the vocabulary of {vocab} logits")
    vocab_ids = jnp.arange(vocab)
    rows = jnp.arange(num_rows)[:, None]

    n = p.no_repeat_ngram_size
    if 0 < n < max_len:
        # A window of n tokens already in the sequence whose first n-1 tokens equal the current
        # (n-1)-token suffix bans its last token.
        starts = np.arange(max_len - n + 1)
        windows = flat_seqs[:, starts[:, None] + np.arange(n)]  # -> [M, L - n + 1, n]
        suffix = jax.lax.dynamic_slice_in_dim(flat_seqs, cur_len - (n - 1), n - 1, axis=1)
        matches = jnp.all(windows[:, :, :-1] == suffix[:, None, :], axis=-1)
        matches &= (starts + n <= cur_len)[None, :]  # whole window inside the sequence
        # Non-matching windows scatter into a spare column past the vocabulary.
        target = jnp.where(matches, jnp.minimum(windows[:, :, -1], vocab), vocab)
        banned = jnp.zeros((num_rows, vocab + 1), bool).at[rows, target].set(True)
        scores = jnp.where((cur_len >= n) & banned[:, :vocab], -jnp.inf, scores)

    if p.bad_words:
        banned = jnp.zeros((num_rows, vocab), bool)
        for word in p.bad_words:
            prefix_len = len(word) - 1
            if prefix_len == 0:
                banned = banned.at[:, word[0]].set(True)
                continue
            tail = jax.lax.dynamic_slice_in_dim(flat_seqs, cur_len - prefix_len, prefix_len, axis=1)
            hit = jnp.all(tail == jnp.asarray(word[:-1]), axis=1) & (cur_len >= prefix_len)
            banned = banned.at[:, word[-1]].set(banned[:, word[-1]] | hit)
        scores = jnp.where(banned, -jnp.inf, scores)

    if p.min_length > 0:
        is_eos = jnp.isin(vocab_ids, jnp.asarray(p.eos_ids))
        scores = jnp.where((cur_len < p.min_length) & is_eos[None, :], -jnp.inf, scores)

    if p.forced_bos_token_id is not None:
        forced = jnp.where(vocab_ids == p.forced_bos_token_id, 0.0, -jnp.inf)
        scores = jnp.where(cur_len == 1, forced[None, :], scores)

    if p.forced_eos_ids:
        forced = jnp.where(jnp.isin(vocab_ids, jnp.asarray(p.forced_eos_ids)), 0.0, -jnp.inf)
        scores = jnp.where(cur_len == p.max_length - 1, forced[None, :], scores)
    return scores


def _call_model(fn, flat_ids, cache, step, rows):
    logits, new_cache = fn(flat_ids, cache, step)
    if logits.ndim != 2 or logits.shape[0] != rows:
        raise ValueError(
            f"tokens_to_logits_fn returned logits {logits.shape}, expected [{rows}, V]"
        )
    # HF casts the model's logits to float32 before any processing.
    return logits.astype(jnp.float32), new_cache


def _check_cache(cache, rows: int, what: str):
    for path, leaf in jax.tree_util.tree_leaves_with_path(cache):
        if jnp.ndim(leaf) == 0 or leaf.shape[0] % rows:
            raise ValueError(
                f"init_cache leaf {jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)}; its "
                f"leading dimension must be a multiple of {what} = {rows}"
            )


def _reorder_cache(cache, beam_idx: jax.Array):
    """Gathers beams of every cache leaf along its leading axis.

    Args:
      cache: pytree, leaves [B * K * m, ...] laid out (b, k, ...).
      beam_idx: [B, K] int32, the old beam each new beam continues.
    """
    batch, beams = beam_idx.shape

    def gather(leaf):
        split = leaf.reshape((batch, beams, -1) + leaf.shape[1:])  # -> [B, K, m, ...]
        idx = beam_idx.reshape((batch, beams) + (1,) * (split.ndim - 2))
        return jnp.take_along_axis(split, idx, axis=1).reshape(leaf.shape)

    return jax.tree_util.tree_map(gather, cache)


def _penalty_table(max_length: int, length_penalty: float) -> np.ndarray:
    # HF divides a float32 tensor by the Python float `length ** length_penalty`, which torch
    # rounds to float32 first; a table indexed by length reproduces that bit for bit.
    return np.array(
        [1.0] + [float(n**length_penalty) for n in range(1, max_length + 1)], dtype=np.float32
    )  # -> [L + 1]


def beam_search(
    tokens_to_logits_fn: TokensToLogitsFn,
    init_cache: Any,
    *,
    batch_size: int,
    num_beams: int,
    max_length: int,
    decoder_start_token_id: int,
    eos_token_id: int | Sequence[int],
    pad_token_id: int,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    min_length: int = 0,
    forced_bos_token_id: int | None = None,
    forced_eos_token_id: int | Sequence[int] | None = None,
    bad_words_ids: Sequence[Sequence[int]] = (),
    no_repeat_ngram_size: int = 0,
    num_return_sequences: int = 1,
) -> BeamSearchOutput:
    """Beam search with the results of HF `generate(num_beams=K, do_sample=False)`.

    Each step log-softmaxes the model's logits, applies the processors, adds the running scores,
    keeps the top max(2, 1 + #EOS) * K continuations, moves the best K of those that end (EOS or
    `max_length`) into the finished buffer with score `sum_logprob / gen_len ** length_penalty`
    (gen_len counts generated tokens, EOS included, decoder start excluded) and continues the best
    K that do not end.

    Args:
      tokens_to_logits_fn: `(flat_ids [B * K, 1] int32, cache, step [] int32) ->
        (logits [B * K, V], new_cache)`; see the module docstring.
      init_cache: pytree, leaves [B * K * m, ...] laid out (b, k, ...), already expanded to K beams.
      batch_size: B.
      num_beams: K.
      max_length: L, total length including the decoder start token.
      decoder_start_token_id: first token of every sequence.
      eos_token_id: one id or several; any of them ends a hypothesis.
      pad_token_id: fills positions after a hypothesis ends. As in HF, EOS (the first id) is used
        instead when pad_token_id is 0 (HF fills with `pad_token_id or eos_token_id[0]`).
      length_penalty: exponent of the generated length dividing finished scores.
      early_stopping: all three stop an example when HF's heuristic says its best running beam
        cannot beat its worst finished hypothesis; the heuristic takes the beam at its current
        length, or for "never" with length_penalty > 0 at `max_length`. True also stops an
        example as soon as K hypotheses are finished.
      min_length: EOS is banned while the sequence (decoder start included) is shorter.
      forced_bos_token_id: token forced right after the decoder start token.
      forced_eos_token_id: token(s) forced at the last position (max_length - 1).
      bad_words_ids: token sequences that are never completed; single-token EOS entries are
        ignored, as in HF.
      no_repeat_ngram_size: n > 0 bans any n-gram (decoder start included) from repeating.
      num_return_sequences: R <= K best finished hypotheses to return.

    Returns:
      BeamSearchOutput with sequences [B, R, L] int32 (best first) and scores [B, R] float32,
      equal to HF's `sequences` (padded to L) and `sequences_scores`.
    """
    if num_beams < 1 or not 1 <= num_return_sequences <= num_beams:
        raise ValueError(
            f"need num_beams >= 1 and 1 <= num_return_sequences <= num_beams, got num_beams="
            f"{num_beams}, num_return_sequences={num_return_sequences}"
        )
    if early_stopping not in (True, False, "never"):
        raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
    procs = _make_processors(
        max_length,
        eos_token_id,
        min_length,
        forced_bos_token_id,
        forced_eos_token_id,
        bad_words_ids,
        no_repeat_ngram_size,
    )
    _check_cache(init_cache, batch_size * num_beams, "batch_size * num_beams")
    b, k, el = batch_size, num_beams, max_length
    # c = 2K candidates (more with several EOS ids), so that K of them do not end.
    num_cand = max(2, 1 + len(procs.eos_ids)) * k
    penalty = jnp.asarray(_penalty_table(max_length, length_penalty))
    stop_when_full = early_stopping is True
    optimistic_len = early_stopping == "never" and length_penalty > 0.0
    fill = pad_token_id or procs.eos_ids[0]

    seqs = jnp.full((b, k, el), fill, jnp.int32).at[:, :, 0].set(decoder_start_token_id)
    state = BeamState(
        cur_len=jnp.array(1, jnp.int32),
        running_seqs=seqs,
        # Only beam 0 is live at first, so the K beams do not pick the same first token.
        running_scores=jnp.zeros((b, k), jnp.float32).at[:, 1:].set(_BEAM_MASK),
        finished_seqs=seqs,
        finished_scores=jnp.full((b, k), _BEAM_MASK, jnp.float32),
        finished_flags=jnp.zeros((b, k), bool),
        improvable=jnp.ones((b,), bool),
        done=jnp.array(False),
        cache=init_cache,
    )

    def body(s: BeamState) -> BeamState:
        flat_ids = jax.lax.dynamic_slice_in_dim(s.running_seqs, s.cur_len - 1, 1, axis=2)
        logits, cache = _call_model(
            tokens_to_logits_fn, flat_ids.reshape(b * k, 1), s.cache, s.cur_len - 1, b * k
        )
        vocab = logits.shape[-1]
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        log_probs = _process_scores(log_probs, s.running_seqs.reshape(b * k, el), s.cur_len, procs)
        log_probs = log_probs.reshape(b, k, vocab) + s.running_scores[:, :, None]
        log_probs = log_probs.reshape(b, k * vocab)

        # Candidates: the best continuations over all beams of an example.
        cand_scores, cand_idx = jax.lax.top_k(log_probs, num_cand)  # -> [B, c]
        cand_beam, cand_tok = cand_idx // vocab, cand_idx % vocab
        cand_seqs = jnp.take_along_axis(s.running_seqs, cand_beam[:, :, None], axis=1)
        cand_seqs = jax.lax.dynamic_update_slice_in_dim(
            cand_seqs, cand_tok[:, :, None], s.cur_len, axis=2
        )  # -> [B, c, L]
        ends = (s.cur_len + 1 >= max_length) | jnp.isin(cand_tok, jnp.asarray(procs.eos_ids))

        # Running beams: the best K candidates that do not end.
        live_scores = cand_scores + jnp.where(ends, _BEAM_MASK, 0.0)
        _, keep = jax.lax.top_k(live_scores, k)  # -> [B, K]
        running_seqs = jnp.take_along_axis(cand_seqs, keep[:, :, None], axis=1)
        running_scores = jnp.take_along_axis(live_scores, keep, axis=1)
        cache = _reorder_cache(cache, jnp.take_along_axis(cand_beam, keep, axis=1))

        # Finished buffer: only candidates among the top K may enter, and only while the example
        # can still improve (HF adds the masks one after the other; the order fixes the rounding).
        just_ended = ends & (jnp.arange(num_cand) < k)[None, :]
        new_scores = cand_scores / penalty[s.cur_len]
        full = jnp.all(s.finished_flags, axis=1) & stop_when_full
        new_scores += jnp.where(full[:, None], _BEAM_MASK, 0.0)
        new_scores += jnp.where(~s.improvable[:, None], _BEAM_MASK, 0.0)
        new_scores += jnp.where(~just_ended, _BEAM_MASK, 0.0)
        merged_scores = jnp.concatenate([s.finished_scores, new_scores], axis=1)  # -> [B, K + c]
        merged_seqs = jnp.concatenate([s.finished_seqs, cand_seqs], axis=1)  # -> [B, K + c, L]
        merged_flags = jnp.concatenate([s.finished_flags, just_ended], axis=1)
        finished_scores, best = jax.lax.top_k(merged_scores, k)  # -> [B, K]
        finished_seqs = jnp.take_along_axis(merged_seqs, best[:, :, None], axis=1)
        finished_flags = jnp.take_along_axis(merged_flags, best, axis=1)

        cur_len = s.cur_len + 1
        # HF's heuristic: the best running beam, at its best plausible length, against the worst
        # finished hypothesis (or _BEAM_MASK while some slot is still empty).
        best_len = max_length - 1 if optimistic_len else cur_len - 1
        best_running = running_scores[:, :1] / penalty[best_len]
        worst = jnp.min(finished_scores, axis=1, keepdims=True)
        worst = jnp.where(finished_flags, worst, _BEAM_MASK)
        improvable = s.improvable & jnp.any(best_running > worst, axis=1)
        all_full = jnp.all(finished_flags) & stop_when_full
        go_on = jnp.any(improvable) & ~all_full & ~jnp.all(ends)
        return BeamState(
            cur_len=cur_len,
            running_seqs=running_seqs,
            running_scores=running_scores,
            finished_seqs=finished_seqs,
            finished_scores=finished_scores,
            finished_flags=finished_flags,
            improvable=improvable,
            done=~go_on,
            cache=cache,
        )

    final = jax.lax.while_loop(lambda s: ~s.done, body, state)
    return BeamSearchOutput(
        sequences=final.finished_seqs[:, :num_return_sequences],
        scores=final.finished_scores[:, :num_return_sequences],
    )


def greedy_search(
    tokens_to_logits_fn: TokensToLogitsFn,
    init_cache: Any,
    *,
    batch_size: int,
    max_length: int,
    decoder_start_token_id: int,
    eos_token_id: int | Sequence[int],
    pad_token_id: int,
    min_length: int = 0,
    forced_bos_token_id: int | None = None,
    forced_eos_token_id: int | Sequence[int] | None = None,
    bad_words_ids: Sequence[Sequence[int]] = (),
    no_repeat_ngram_size: int = 0,
) -> jax.Array:
    """Greedy search with the results of HF `generate(num_beams=1, do_sample=False)`.

    The processors act on the raw logits (HF's greedy path does not log-softmax), then the
    arg-max (first index on ties, as torch) is taken. Sequences that have ended receive
    `pad_token_id`; the loop stops when all have ended or at `max_length`.

    Args:
      tokens_to_logits_fn: `(flat_ids [B, 1] int32, cache, step [] int32) ->
        (logits [B, V], new_cache)`; see the module docstring.
      init_cache: pytree, leaves [B * m, ...].
      batch_size: B.
      max_length, decoder_start_token_id, eos_token_id, pad_token_id, min_length,
        forced_bos_token_id, forced_eos_token_id, bad_words_ids, no_repeat_ngram_size: as in
        `beam_search`, except that every position past the end holds pad_token_id.

    Returns:
      [B, L] int32 sequences, HF's `sequences` padded to L with pad_token_id.
    """
    procs = _make_processors(
        max_length,
        eos_token_id,
        min_length,
        forced_bos_token_id,
        forced_eos_token_id,
        bad_words_ids,
        no_repeat_ngram_size,
    )
    _check_cache(init_cache, batch_size, "batch_size")
    b = batch_size
    seqs = jnp.full((b, max_length), pad_token_id, jnp.int32).at[:, 0].set(decoder_start_token_id)
    state = GreedyState(
        cur_len=jnp.array(1, jnp.int32),
        seqs=seqs,
        unfinished=jnp.ones((b,), bool),
        cache=init_cache,
    )

    def body(s: GreedyState) -> GreedyState:
        flat_ids = jax.lax.dynamic_slice_in_dim(s.seqs, s.cur_len - 1, 1, axis=1)  # -> [B, 1]
        logits, cache = _call_model(tokens_to_logits_fn, flat_ids, s.cache, s.cur_len - 1, b)
        scores = _process_scores(logits, s.seqs, s.cur_len, procs)
        tokens = jnp.argmax(scores, axis=-1).astype(jnp.int32)
        tokens = jnp.where(s.unfinished, tokens, pad_token_id)  # -> [B]
        seqs = jax.lax.dynamic_update_slice_in_dim(s.seqs, tokens[:, None], s.cur_len, axis=1)
        ended = (s.cur_len + 1 >= max_length) | jnp.isin(tokens, jnp.asarray(procs.eos_ids))
        return GreedyState(
            cur_len=s.cur_len + 1, seqs=seqs, unfinished=s.unfinished & ~ended, cache=cache
        )

    return jax.lax.while_loop(lambda s: jnp.any(s.unfinished), body, state).seqs


def search(
    tokens_to_logits_fn: TokensToLogitsFn,
    init_cache: Any,
    *,
    batch_size: int,
    num_beams: int,
    num_return_sequences: int = 1,
    **settings: Any,
) -> tuple[jax.Array, jax.Array | None]:
    """Greedy search when `num_beams` is 1, beam search otherwise, with one result layout.

    `settings` are the searches' other keyword arguments (`length_penalty` and `early_stopping`
    only for beams).

    Returns:
      sequences: [B, R, L] int32 (R = 1 for greedy).
      scores: [B, R] float32 beam scores, or None for greedy.
    """
    if num_beams == 1:
        seqs = greedy_search(tokens_to_logits_fn, init_cache, batch_size=batch_size, **settings)
        return seqs[:, None], None
    out = beam_search(
        tokens_to_logits_fn,
        init_cache,
        batch_size=batch_size,
        num_beams=num_beams,
        num_return_sequences=num_return_sequences,
        **settings,
    )
    return out.sequences, out.scores
