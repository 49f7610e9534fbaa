"""Answer log-probabilities of many (prompt, answer) pairs whose prompts share a prefix.

The passage store lays a causal generator's prompt out passage first (prefix tokens, title,
passage text, doc_sep, then the question and the answer cue: `retrieval.store.context_tokens`),
so every pair whose prompt starts with the same passage tokens has the same keys and values
there, in every layer: under causal attention a token's keys depend on the tokens before it only.
`logprob_calls` computes each shared prefix's keys and values once (`llama.Llama.hidden` over
several prefixes in one call), then scores each pair's own tokens, the rest of its prompt and
then its answer, as rows that read their prefix's cache as a `llama.Prefix`: the attention
decoding uses for a prompt shared by beams (`causal.py`), one softmax over the prefix's keys and
the row's own. The values are those of the full forward pass (`memo.pair_logprobs`,
`causal.answer_logits`) within float32 rounding: same tokens, same positions, same masks.

Which pairs share what (`group_by_prefix`): prompts sorted by their tokens put every set of
prompts with a common prefix side by side; a run of them shares the longest common prefix of its
members (a passage cut shorter for a longer question shares the tokens it keeps), less at least
one token, the last prompt token, whose output predicts the first answer token.

Shapes are bucketed so that a few programs serve a whole fill (SmolLM2 compiles each in seconds;
a simulated 48,000-pair SQuAD fill needs 12 prefix and 54 row programs): prefixes are
computed at multiples of `PREFIX_BUCKET` tokens and their cache read at a power of two; rows pad
to multiples of `ROW_BUCKET` (a row's tokens are each pair's own cost, so they pad finely), the
answer positions scored to a power of two; a short last call of prefixes or of rows pads to a
power of two with copies of its first item (`memo.calls`' rule).

Legend: M pairs, U prefixes in a call, P prefix width, R rows in a call, W row width, T answer
length, H hidden, V vocab, g key/value heads, d head width.
"""

import collections
import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rag_jax import rag_math
from rag_jax.models import llama

PREFIX_BUCKET = 32  # prefix widths computed: multiples of this (the cache's: a power of two)
ROW_BUCKET = 8  # row widths (rest of prompt + answer): multiples of this; scored: 8, 16, 32, ..
PREFIXES_PER_CALL = 8  # U: shared prefixes computed in one call
ROWS_PER_CALL = 16  # R: pairs scored in one call

_TRACES: collections.Counter = collections.Counter()  # program -> traces (compilations)


def trace_counts() -> dict[str, int]:
    """How many times each of this module's programs ("prefix", "rows") has been traced."""
    return dict(_TRACES)


@dataclasses.dataclass(frozen=True)
class Group:
    """Pairs whose prompts share their first `shared` tokens (fewer than any of them has)."""

    pairs: tuple[int, ...]  # indices into the prompts
    shared: int


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def group_by_prefix(prompts: Sequence[np.ndarray]) -> list[Group]:
    """Groups pairs by the prefix their prompts share, every pair in exactly one group.

    Prompts are sorted by their tokens and taken in that order: a prompt joins the group before
    it when that costs fewer tokens than it saves, i.e. when the group's prefix shortened to what
    the prompt shares with it, times the group's size, loses fewer tokens than the shortened
    prefix (a group of its own would compute again). Identical prompts and a passage cut at
    different lengths group together; prompts sharing only a short head (a chat template's
    system turn, a title) do not.

    Args:
      prompts: M arrays [S_m] int, each prompt's real tokens (at least one).

    Returns:
      The groups; a group's `shared` is less than each of its prompts' lengths.
    """
    prompts = [np.asarray(p, np.int32) for p in prompts]
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one real token")
    # Byte order of int32 tokens is not token order, but a set of prompts with a common token
    # prefix has a common byte prefix, so it still lies in one run of the sorted order.
    order = sorted(range(len(prompts)), key=lambda i: prompts[i].tobytes())
    runs: list[tuple[list[int], int]] = []
    for i in order:
        if runs:
            members, shared = runs[-1]
            joined = min(shared, _common(prompts[members[-1]], prompts[i]))
            if (shared - joined) * len(members) < joined:
                runs[-1] = (members + [i], joined)
                continue
        runs.append(([i], len(prompts[i])))
    return [
        Group(tuple(members), min(shared, min(len(prompts[i]) for i in members) - 1))
        for members, shared in runs
    ]


def _bucket(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def _power_of_two(n: int, least: int) -> int:
    return max(least, 1 << (n - 1).bit_length())


def _calls(todo: list, size: int):
    """`todo` in calls of at most `size`: (the items, the items computed, a short last call
    padded with copies of its first item to a power of two), as `memo.calls`."""
    for start in range(0, len(todo), size):
        chunk = todo[start : start + size]
        width = min(size, 1 << (len(chunk) - 1).bit_length())
        yield chunk, chunk + [chunk[0]] * (width - len(chunk))


class _Row(NamedTuple):
    """One pair's row in a call of rows; rows sort by what their call's shapes are cut to."""

    scored: int  # the call's scored width this row needs (`_power_of_two`)
    own: int  # its own tokens: the rest of its prompt, its labels but the last
    pair: int  # index into the prompts
    slot: int  # its prefix in the call of prefixes
    shared: int  # its prefix's length


@functools.partial(jax.jit, static_argnums=(0, 4))
def _prefix_kv(cfg: llama.LlamaConfig, params, ids, mask, width: int) -> llama.Past:
    """Every layer's keys and values [U, g, width, d] of U right-padded prefixes [U, P]: the P
    computed positions, then zeros up to `width` (masked out by the rows' prefix mask)."""
    _TRACES["prefix"] += 1
    # The last layer's feed-forward and the final norm feed nothing returned: XLA drops them.
    _, kv = llama.Llama(cfg).apply(
        {"params": params}, ids, mask, llama.positions_from_mask(mask), method=llama.Llama.hidden
    )
    pad = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, width - a.shape[2]), (0, 0)))  # noqa: E731
    return llama.Past(tuple(map(pad, kv.keys)), tuple(map(pad, kv.values)))


@functools.partial(jax.jit, static_argnums=0)
def _row_logprobs(cfg, params, kv, prefix_mask, slot, ids, mask, start, read, targets):
    """[R, T] log-probabilities of R rows' targets, row r after prefix `slot[r]` of `kv`.

    Args:
      kv: `llama.Past` of the U prefixes, [U, g, P, d] per layer; prefix_mask: [U, P].
      slot: [R] int, the prefix each row reads.
      ids, mask: [R, W] each row's own tokens (rest of prompt, answer but its last token),
        right-padded.
      start: [R] int, the position of each row's first token (its prefix's length).
      read: [R, T] int, the row position whose output predicts target t.
      targets: [R, T] int.
    """
    _TRACES["rows"] += 1
    # Each row gets its prefix's cache gathered ([R, 1, g, P, d]: k = m = 1 in `llama.Prefix`'s
    # layout) rather than rows of a group sharing one copy: groups differ in size, and the copy
    # costs a few percent of the rows' projections, padding rows to a common group size more.
    take = lambda a: a[slot][:, None]  # noqa: E731
    prefix = llama.Prefix(
        tuple(map(take, kv.keys)), tuple(map(take, kv.values)), take(prefix_mask.astype(bool))
    )
    positions = start[:, None] + jnp.arange(ids.shape[1])  # -> [R, W]
    model, variables = llama.Llama(cfg), {"params": params}
    hidden, _ = model.apply(variables, ids, mask, positions, prefix, method=llama.Llama.hidden)
    hidden = jnp.take_along_axis(hidden, read[:, :, None], axis=1)  # -> [R, T, H]
    logits = model.apply(variables, hidden, method=llama.Llama.head)  # -> [R, T, V]
    token_lp, _ = rag_math.token_logprobs(logits[:, None], targets)  # -> [R, 1, T]
    return token_lp[:, 0]


def logprob_calls(
    cfg: llama.LlamaConfig,
    params,
    prompts: Sequence[np.ndarray],
    labels: Sequence[np.ndarray],
    groups: Sequence[Group] | None = None,
) -> Iterator[tuple[list[int], list[np.ndarray]]]:
    """Computes `log p(labels[m][t] | prompts[m], labels[m][:t])` a call at a time.

    Groups are taken shortest prefix first, `PREFIXES_PER_CALL` at a time: one call computes
    their prefixes' keys and values, then their pairs, sorted by their answer's and their own
    length, are scored in calls of `ROWS_PER_CALL` rows.

    Args:
      cfg: the generator's config (a Llama-family causal LM).
      params: its parameters.
      prompts: M arrays [S_m] int, each prompt's real tokens.
      labels: M arrays [T_m] int, the tokens scored after each prompt (pad, not the ignore
        index; T_m may be 0).
      groups: which pairs to compute, by shared prefix (`group_by_prefix`, its default over all
        pairs).

    Yields:
      (pairs, values) after each call of rows: the indices of the pairs it computed and for
      each its [T_m] float32 log-probabilities.
    """
    prompts = [np.asarray(p, np.int32) for p in prompts]
    labels = [np.asarray(t, np.int32) for t in labels]
    if len(prompts) != len(labels):
        raise ValueError(f"{len(prompts)} prompts and {len(labels)} label rows")
    longest = max((len(p) + len(t) for p, t in zip(prompts, labels)), default=0)
    if longest > cfg.max_position_embeddings:
        raise ValueError(
            f"a prompt and its labels of {longest} tokens exceed the generator's "
            f"max_position_embeddings={cfg.max_position_embeddings}"
        )
    if groups is None:
        groups = group_by_prefix(prompts)
    for batch, computed in _calls(sorted(groups, key=lambda g: g.shared), PREFIXES_PER_CALL):
        width = _bucket(max(g.shared for g in computed), PREFIX_BUCKET)
        ids = np.full((len(computed), width), cfg.pad_token_id, np.int32)
        mask = np.zeros((len(computed), width), np.int32)
        for u, g in enumerate(computed):
            ids[u, : g.shared] = prompts[g.pairs[0]][: g.shared]
            mask[u, : g.shared] = 1
        # The rows' programs read the cache at a power-of-two width, so that they are not
        # compiled again for every prefix width (the extra keys are masked: a few percent of
        # the rows' work, in their attention only).
        cache_width = _power_of_two(width, PREFIX_BUCKET)
        kv = _prefix_kv(cfg, params, jnp.asarray(ids), jnp.asarray(mask), cache_width)
        prefix_mask = jnp.asarray(np.pad(mask, ((0, 0), (0, cache_width - width))))
        rows = sorted(
            _Row(
                _power_of_two(len(labels[m]), ROW_BUCKET),
                # The rest of the prompt and the labels but the last: nothing follows it.
                len(prompts[m]) - g.shared + max(len(labels[m]), 1) - 1,
                m,
                u,
                g.shared,
            )
            for u, g in enumerate(batch)
            for m in g.pairs
        )
        for chunk, take in _calls(rows, ROWS_PER_CALL):
            values = _score_rows(cfg, params, kv, prefix_mask, take, prompts, labels)
            yield [row.pair for row in chunk], values[: len(chunk)]


def _score_rows(cfg, params, kv, prefix_mask, rows: list[_Row], prompts, labels):
    """The [T_m] log-probabilities of `rows`, in one call."""
    width = _bucket(max(row.own for row in rows), ROW_BUCKET)
    scored = max(row.scored for row in rows)
    ids = np.full((len(rows), width), cfg.pad_token_id, np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    read = np.zeros((len(rows), scored), np.int32)
    targets = np.full((len(rows), scored), cfg.pad_token_id, np.int32)
    for r, row in enumerate(rows):
        rest, answer = prompts[row.pair][row.shared :], labels[row.pair]
        ids[r, : row.own] = np.concatenate([rest, answer[:-1]]) if len(answer) else rest
        mask[r, : row.own] = 1
        # Position len(rest) - 1 + t predicts answer token t; past the answer, any position.
        read[r] = np.minimum(len(rest) - 1 + np.arange(scored), width - 1)
        targets[r, : len(answer)] = answer
    values = np.asarray(
        _row_logprobs(
            cfg,
            params,
            kv,
            prefix_mask,
            jnp.asarray(np.array([row.slot for row in rows], np.int32)),
            jnp.asarray(ids),
            jnp.asarray(mask),
            jnp.asarray(np.array([row.shared for row in rows], np.int32)),
            jnp.asarray(read),
            jnp.asarray(targets),
        )
    )
    return [values[r, : len(labels[row.pair])] for r, row in enumerate(rows)]


def pair_logprobs(
    cfg: llama.LlamaConfig, params, prompts: Sequence[np.ndarray], labels
) -> np.ndarray:
    """[M, T] `log p(labels[m, t] | prompts[m], labels[m, :t])`, through shared prefixes: the
    values of `memo.pair_logprobs` on the same pairs padded into a batch.

    Args:
      cfg: the generator's config.
      params: its parameters.
      prompts: M arrays [S_m] int, each prompt's real tokens.
      labels: [M, T] int answer tokens (pad in place of the ignore index).
    """
    labels = np.asarray(labels)
    if labels.ndim != 2 or len(labels) != len(prompts):
        raise ValueError(f"labels {labels.shape}: expected [M = {len(prompts)}, T]")
    out = np.zeros(labels.shape, np.float32)
    for pairs, values in logprob_calls(cfg, params, prompts, list(labels)):
        out[pairs] = values
    return out
