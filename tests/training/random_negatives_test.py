"""`train.retriever_random_negatives`: R passages drawn uniformly from the corpus, fixed per
question, appended after its K candidates in the retriever's objective only."""

import numpy as np
import pytest

from rag_jax.run import data, validation
from rag_jax.training import experiment, loop
from rag_jax.training.batcher import Batcher, draw_negatives, no_negatives
from rag_jax.training.step import candidate_count, searched_count
from tiny_runs import first_batch, tiny_config

ROWS = 50


def test_draws_are_distinct_allowed_and_fixed_per_question():
    ids = ["q-a", "q-b", "q-c"]
    candidates = np.array([[0, 1, 2], [3, 4, 5], [0, 7, 9]])
    excluded = [{10}, set(), {11, 12}]
    drawn = draw_negatives(ids, candidates, excluded, 6, ROWS, seed=0)
    assert drawn.shape == (3, 6) and drawn.dtype == np.int64
    for b in range(3):
        assert len(set(drawn[b])) == 6 and all(0 <= j < ROWS for j in drawn[b])
        assert not set(drawn[b]) & (set(candidates[b]) | excluded[b])
    # The same question draws the same rows wherever it sits in a batch, alone or not.
    order = [2, 0, 1]
    moved = draw_negatives(
        [ids[i] for i in order], candidates[order], [excluded[i] for i in order], 6, ROWS, seed=0
    )
    np.testing.assert_array_equal(moved, drawn[order])
    alone = draw_negatives(ids[1:2], candidates[1:2], excluded[1:2], 6, ROWS, seed=0)
    np.testing.assert_array_equal(alone, drawn[1:2])
    # Another seed or another question draws others.
    assert not np.array_equal(draw_negatives(ids, candidates, excluded, 6, ROWS, 1), drawn)
    other = draw_negatives(["q-z"], candidates[:1], excluded[:1], 6, ROWS, seed=0)
    assert not np.array_equal(drawn[0], other[0])


def test_a_barred_row_moves_only_the_negative_it_takes():
    """Barring one more row (a candidate or gold passage) that was not drawn leaves the draws as
    they were; barring a drawn one skips it and takes the stream's next row."""
    candidates = np.array([[0, 1, 2]])
    drawn = draw_negatives(["q"], candidates, [set()], 4, ROWS, seed=3)[0]
    free = next(j for j in range(3, ROWS) if j not in set(drawn))
    same = draw_negatives(["q"], candidates, [{free}], 4, ROWS, seed=3)[0]
    np.testing.assert_array_equal(same, drawn)
    clash = draw_negatives(["q"], candidates, [{int(drawn[1])}], 4, ROWS, seed=3)[0]
    assert drawn[1] not in clash
    np.testing.assert_array_equal(clash[:3], drawn[[0, 2, 3]])


def test_a_corpus_too_small_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match="retriever_random_negatives=3 .* 5 passages has only 2"):
        draw_negatives(["q"], np.array([[0, 1]]), [{4}], 3, 5, seed=0)
    left = draw_negatives(["q"], np.array([[0, 1]]), [{4}], 2, 5, seed=0)
    assert sorted(left[0].tolist()) == [2, 3]  # exactly the two left


def test_the_setting_is_checked():
    with pytest.raises(ValueError, match="retriever_random_negatives must be >= 0"):
        validation.validate(tiny_config(**{"train.retriever_random_negatives": -1}), 1, paths=False)
    closed = tiny_config(**{"train.retriever_random_negatives": 2, "rag.closed_book": True})
    with pytest.raises(ValueError, match="random negatives 2\\) trains the retriever"):
        validation.validate(closed, 1, paths=False)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    config = tiny_config(
        **{
            "train.retriever_loss": "pdist",
            "train.retriever_candidates": 6,
            "train.retriever_fixed_candidates": True,
            "train.retriever_random_negatives": 3,
        }
    )
    return config, experiment.build(config, tmp_path_factory.mktemp("negatives"))


def test_batches_carry_the_candidates_then_the_negatives(built):
    config, exp = built
    assert (searched_count(config), candidate_count(config)) == (6, 9)
    batcher = Batcher(exp, loop.device_mesh(config))
    table = batcher.fixed_candidates()
    assert table.shape == (len(exp.train), 6)
    stored = np.asarray(exp.retriever.vectors, np.float32)
    rows = {exp.store.ids[i]: i for i in range(len(exp.store))}
    for step in range(2):
        idx, examples = batcher._examples(step)
        gold = [{rows[g] for g in e.gold_ids if g in rows} for e in examples]
        drawn = draw_negatives([e.id for e in examples], table[idx], gold, 3, len(exp.store), 0)
        expected = np.concatenate([table[idx], drawn], axis=1)  # -> [B, 9]
        arrays = first_batch(batcher, exp, step)
        np.testing.assert_array_equal(arrays["doc_vectors"], stored[expected])
        assert arrays["doc_vectors"].shape[:2] == (config.train.batch_size, 9)
    # The memo filled ahead asks for the same 9 pairs per question the batches read.
    prompts, answers = batcher.memo_pairs(exp.params, exp.train[:4], exp.retriever)
    assert len(prompts) == len(answers) == 4 * 9
    hits = exp.retriever.with_n_docs(6)
    fields, pieces = batcher.questions(exp.train[:4])
    found = batcher.with_negatives(exp.train[:4], hits.gather(table[:4], pieces), pieces, hits)
    for r in range(4 * 9):
        real = found.context_attention_mask[r] == 1
        np.testing.assert_array_equal(prompts[r], found.context_input_ids[r][real])


def test_gold_hard_negatives_hold_no_answer():
    """The gold objective's candidates that are no negative: a gold passage of the question, or
    any passage holding one of its answers as whole words (DPR's hard negatives hold none)."""
    ids = ["a_0", "a_1", "b_0", "b_1"]
    texts = [
        "the virus binds ACE2 receptors in the lung .",
        "Binding to the ACE2 receptors, the virus enters cells.",
        "masks reduce transmission",
        "the receptors of the lung are many",
    ]
    examples = [
        data.Example("what does it bind ?", ("ACE2 receptors",), "q0", ("a_0",)),
        data.Example("what reduces it ?", ("masks",), "q1", ("b_0",)),
    ]
    doc_ids = np.array([[0, 1, 2, 3], [3, 2, 1, 0]])
    got = no_negatives(examples, doc_ids, ids, texts.__getitem__)
    np.testing.assert_array_equal(got, [[True, True, False, False], [False, True, False, False]])
