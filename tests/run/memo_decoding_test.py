"""Memoised RAG-Sequence greedy thorough decoding: the answers `rag.generate` gives, each prompt's
greedy answer and likelihoods computed once, a memo of other settings never read."""

import dataclasses

import numpy as np
import pytest
from transformers import BertTokenizer

from rag_jax import rag
from rag_jax.run import memo_decoding
from rag_jax.training import memo
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


def _memos(cfg, params, directory, tokenizer=None):
    answers = memo.AnswerMemo(cfg, params["generator"], tokenizer or _tokenizer(), directory)
    return answers, memo_decoding.GreedyMemo(cfg, answers.fingerprint, directory)


def test_the_answers_are_rag_generates(tmp_path):
    cfg, params = _greedy_cfg()
    ids, mask, scores = _prompts()
    expected = np.asarray(
        rag.generate(
            cfg, params, ids, mask, scores, variant="sequence", sequence_decoding="thorough"
        )
    )
    answers, greedy = _memos(cfg, params, tmp_path)
    got = memo_decoding.sequence_answers(answers, greedy, params["generator"], ids, mask, scores)
    np.testing.assert_array_equal(got, expected)
    # The doc scores decide: some question's answer is not its top doc's own greedy answer.
    own = greedy.candidates(params["generator"], ids, mask).reshape(B, N, -1)
    top_doc = own[np.arange(B), np.argmax(scores, axis=1)]
    assert (got != top_doc).any(axis=1).any()
    # Each distinct prompt generated once; each distinct (prompt, candidate) scored once.
    distinct = len({(tuple(i[m == 1])) for i, m in zip(ids, mask, strict=True)})
    assert greedy.computed == distinct and greedy.reused == 2 * B * N - distinct
    # Other doc scores: the same prompts' work, nothing computed again.
    computed = answers.computed
    flipped = -scores
    again = memo_decoding.sequence_answers(answers, greedy, params["generator"], ids, mask, flipped)
    assert answers.computed == computed and greedy.computed == distinct
    np.testing.assert_array_equal(
        again,
        rag.generate(
            cfg, params, ids, mask, flipped, variant="sequence", sequence_decoding="thorough"
        ),
    )


def test_saved_memos_are_read_back_and_merged_and_another_settings_memo_is_not(tmp_path):
    cfg, params = _greedy_cfg()
    ids, mask, scores = _prompts()
    answers, greedy = _memos(cfg, params, tmp_path)
    first = memo_decoding.sequence_answers(answers, greedy, params["generator"], ids, mask, scores)
    # A second memo object on the same file, written meanwhile, is merged, not overwritten.
    other_ids, other_mask, _ = _prompts(seed=1)
    known = len(greedy)
    _, beside = _memos(cfg, params, tmp_path)
    beside.candidates(params["generator"], other_ids[[0, 2]], other_mask[[0, 2]])  # 2 new
    beside.save()
    greedy.save()
    answers.save()
    answers, reread = _memos(cfg, params, tmp_path)
    assert len(reread) == known + 2
    again = memo_decoding.sequence_answers(answers, reread, params["generator"], ids, mask, scores)
    np.testing.assert_array_equal(again, first)
    assert reread.computed == 0 and answers.computed == 0
    # Other decoding settings: another file, none of these answers read.
    longer, _ = _greedy_cfg(max_length=7)
    _, elsewhere = _memos(longer, params, tmp_path)
    assert elsewhere.path != greedy.path and len(elsewhere) == 0
    # A file of another fingerprint under this one's name is refused, named.
    reread.path.write_bytes(_elsewhere_bytes(elsewhere, params, ids, mask))
    with pytest.raises(ValueError, match="not read"):
        _memos(cfg, params, tmp_path)


def _elsewhere_bytes(greedy, params, ids, mask) -> bytes:
    greedy.candidates(params["generator"], ids[:1], mask[:1])
    greedy.save()
    return greedy.path.read_bytes()


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
