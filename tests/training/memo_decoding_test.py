"""Memoised RAG-Sequence greedy thorough decoding: the answers `rag.generate` gives, each prompt's
greedy answer and likelihoods computed once, a memo of other settings never read."""

import dataclasses

import numpy as np
import pytest
from transformers import BertTokenizer

from rag_jax import rag
from rag_jax.training import memo, memo_decoding
from tests.training.causal_step_test import _setup

B, N, S = 6, 3, 12


def _tokenizer():
    return BertTokenizer(vocab={t: i for i, t in enumerate(["[PAD]", "[UNK]", "a", "b"])})


def _greedy_cfg(max_length=6):
    cfg, params, _ = _setup()
    generation = dataclasses.replace(cfg.generation, num_beams=1, max_length=max_length)
    return cfg.replace(generation=generation), params


def _prompts(seed=0):
    """B questions of N right-padded prompts; some prompts repeat, within a question (repeated
    candidates) and across questions (prompts the memo already holds)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, S + 1, size=B * N)
    mask = (np.arange(S)[None] < lengths[:, None]).astype(np.int32)
    ids = rng.integers(3, 29, size=(B * N, S)) * mask
    for dst, src in ((1, 0), (4, 3), (9, 0), (13, 7)):  # same question (1, 4), others (9, 13)
        ids[dst], mask[dst] = ids[src], mask[src]
    scores = rng.normal(size=(B, N)).astype(np.float32) * 2
    return ids.astype(np.int32), mask, scores


def _memo(cfg, params, directory, tokenizer=None):
    fingerprint = memo.fingerprint(cfg, params["generator"], tokenizer or _tokenizer())
    return memo_decoding.GreedyMemo(cfg, fingerprint, directory)


def _generate(cfg, params, ids, mask, scores):
    return np.asarray(
        rag.generate(
            cfg, params, ids, mask, scores, variant="sequence", sequence_decoding="thorough"
        )
    )


def test_the_answers_are_rag_generates(tmp_path):
    cfg, params = _greedy_cfg()
    ids, mask, scores = _prompts()
    greedy = _memo(cfg, params, tmp_path)
    got = memo_decoding.sequence_answers(greedy, params["generator"], ids, mask, scores)
    np.testing.assert_array_equal(got, _generate(cfg, params, ids, mask, scores))
    # The doc scores decide: some question's answer is not its top doc's own greedy answer.
    own = greedy.answers(greedy.fill(params["generator"], ids, mask, N)).reshape(B, N, -1)
    top_doc = own[np.arange(B), np.argmax(scores, axis=1)]
    assert (got != top_doc).any(axis=1).any()
    # Each distinct prompt's greedy answer held once; each distinct (prompt, candidate) once.
    prompts = {tuple(i[m == 1]) for i, m in zip(ids, mask, strict=True)}
    assert len(greedy) == len(prompts)
    pairs = {
        (tuple(ids[b * N + n][mask[b * N + n] == 1]), tuple(own[b, m]))
        for b, m, n in np.ndindex(B, N, N)
    }
    assert len(greedy.scores) == len(pairs)
    # The first call ran every question (each holds a prompt not seen before); the second
    # (above) none.
    assert greedy.computed == B * N and greedy.reused == B * N
    # Other doc scores: the same prompts' work, nothing computed again.
    flipped = -scores
    again = memo_decoding.sequence_answers(greedy, params["generator"], ids, mask, flipped)
    assert greedy.computed == B * N
    np.testing.assert_array_equal(again, _generate(cfg, params, ids, mask, flipped))
    # A question made of prompts seen in other questions: its candidates were never scored
    # after each other's prompts, so it runs; then it is answered from the memo.
    mixed = (
        np.concatenate([ids[[0, 3, 6]], ids[[0, 4, 8]]]),
        np.concatenate([mask[[0, 3, 6]], mask[[0, 4, 8]]]),
    )
    mixed_scores = scores[:2]
    got = memo_decoding.sequence_answers(greedy, params["generator"], *mixed, mixed_scores)
    np.testing.assert_array_equal(got, _generate(cfg, params, *mixed, mixed_scores))
    assert greedy.computed == B * N + 2 * N


def test_saved_memos_are_read_back_and_merged_and_another_settings_memo_is_not(tmp_path):
    cfg, params = _greedy_cfg()
    ids, mask, scores = _prompts()
    greedy = _memo(cfg, params, tmp_path)
    first = memo_decoding.sequence_answers(greedy, params["generator"], ids, mask, scores)
    # A second memo object on the same file, written meanwhile, is merged, not overwritten.
    other_ids, other_mask, _ = _prompts(seed=1)
    known, known_scores = len(greedy), len(greedy.scores)
    beside = _memo(cfg, params, tmp_path)
    beside.fill(params["generator"], other_ids[:N], other_mask[:N], N)  # one new question
    beside.save()
    greedy.save()
    reread = _memo(cfg, params, tmp_path)
    assert len(reread) == len(greedy.values.keys() | beside.values.keys()) > known
    merged = greedy.scores.values.keys() | beside.scores.values.keys()
    assert len(reread.scores) == len(merged) > known_scores
    again = memo_decoding.sequence_answers(reread, params["generator"], ids, mask, scores)
    np.testing.assert_array_equal(again, first)
    assert reread.computed == 0
    # Other decoding settings: other files, none of these answers read.
    longer, _ = _greedy_cfg(max_length=7)
    elsewhere = _memo(longer, params, tmp_path)
    assert elsewhere.path != greedy.path and len(elsewhere) == len(elsewhere.scores) == 0
    # A file of another fingerprint under this one's name is refused, named.
    elsewhere.fill(params["generator"], ids[:N], mask[:N], N)
    elsewhere.save()
    reread.path.write_bytes(elsewhere.path.read_bytes())
    with pytest.raises(ValueError, match="not read"):
        _memo(cfg, params, tmp_path)
    reread.path.write_bytes(b"")  # unreadable: refused, named
    with pytest.raises(ValueError, match="unreadable"):
        _memo(cfg, params, tmp_path)


def test_what_it_does_not_compute_is_refused():
    cfg, _ = _greedy_cfg()
    memo_decoding.check_supported(cfg, "sequence", "thorough")
    with pytest.raises(ValueError, match="variant 'sequence' with thorough decoding"):
        memo_decoding.check_supported(cfg, "token", "thorough")
    beams = cfg.replace(generation=dataclasses.replace(cfg.generation, num_beams=4))
    with pytest.raises(ValueError, match="greedy decoding"):
        memo_decoding.check_supported(beams, "sequence", "thorough")
    with pytest.raises(ValueError, match="label_smoothing 0"):
        memo_decoding.check_supported(cfg.replace(label_smoothing=0.1), "sequence", "thorough")
