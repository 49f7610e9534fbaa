"""rag_jax.retrieval.edits: an edited index answers as a fresh exact index of the edited vectors.

The edits are made to matter: replaced passages are queries' true neighbours (their old vectors
must vanish) and new vectors sit next to queries (they must come first).
"""

import numpy as np
import pytest

from rag_jax.retrieval import index, scann_index
from rag_jax.retrieval.edits import EditedIndex, LiveRowIndex

C, D, E = 2_003, 24, 37  # C prime, distinct sizes


def _unit(shape, seed):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _fresh(vectors, deleted, queries, k):
    """Exact search of `vectors` without the `deleted` rows, ids in `vectors`' numbering."""
    kept = np.setdiff1d(np.arange(len(vectors)), deleted)
    scores, rows = index.ExactIndex(vectors[kept]).search(queries, k)
    return scores, kept[rows]


def _edits(vectors, queries, seed):
    """E ids (a third of them queries' top-1s) and new vectors near queries."""
    rng = np.random.default_rng(seed)
    tops = np.unique(index.ExactIndex(vectors).search(queries, 1)[1][:, 0])[: E // 3]
    others = rng.choice(np.setdiff1d(np.arange(len(vectors)), tops), E - len(tops), replace=False)
    ids = np.concatenate([tops, others])
    near = queries[rng.integers(len(queries), size=E)] + 0.3 * _unit((E, vectors.shape[1]), seed)
    return ids, near / np.linalg.norm(near, axis=1, keepdims=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_edited_exact_index_equals_a_fresh_build(dtype):
    vectors, queries = _unit((C, D), 0).astype(dtype), _unit((19, D), 1)
    ids, new = _edits(vectors, queries, 2)
    added = _unit((3, D), 3)  # new passages C, C + 1, C + 2
    deleted = np.setdiff1d([5, 77, 1500], ids)  # base rows, none edited
    edited = EditedIndex(
        index.ExactIndex(vectors),
        np.concatenate([ids, [C, C + 1, C + 2]]),
        np.concatenate([new, added]).astype(dtype),
        deleted,
    )
    assert edited.count == C + 3
    full = np.concatenate([vectors, added.astype(dtype)])
    full[ids] = new.astype(dtype)
    for k in (1, 10, 40):
        want_scores, want_ids = _fresh(full, deleted, queries, k)
        scores, got = edited.search(queries, k)
        np.testing.assert_array_equal(got, want_ids)
        np.testing.assert_allclose(scores, want_scores, rtol=0, atol=1e-5)
    # The edits changed the answers (so the equality above says something): most queries' top 10
    # differ from the base's, and an edited passage comes first for some.
    base_ids = index.ExactIndex(vectors).search(queries, 10)[1]
    got = edited.search(queries, 10)[1]
    assert (got != base_ids).any(axis=1).mean() > 0.5
    assert np.isin(got[:, 0], ids).any()


def test_edits_compose_and_leave_the_base_and_earlier_edits_unchanged():
    vectors, queries = _unit((C, D), 4), _unit((11, D), 5)
    base = index.ExactIndex(vectors)
    ids, new = _edits(vectors, queries, 6)
    first = EditedIndex(base, ids[:20], new[:20])
    before = first.search(queries, 10)
    # Second edit: re-edits 5 of the first's ids, edits 17 more, deletes 3 (one edited before).
    second = first.edit(ids[15:], new[15:] * -1, deleted_ids=[ids[0], 1000, 1001])
    full = vectors.copy()
    full[ids[:20]] = new[:20]
    full[ids[15:]] = -new[15:]
    want = _fresh(full, [ids[0], 1000, 1001], queries, 10)
    # Third: a new passage C near a query, then deleted again; C + 1 added after it keeps its id.
    third = second.edit([C], queries[:1]).edit([C + 1], -queries[:1], deleted_ids=[C])
    assert third.count == C + 2 and C not in third.search(queries[:1], 10)[1]
    assert (third.search(-queries[:1], 1)[1] == C + 1).all()
    for got, exp in zip(second.search(queries, 10), want):
        np.testing.assert_allclose(got, exp, rtol=0, atol=1e-6)
    for got, exp in zip(first.search(queries, 10), before):
        np.testing.assert_array_equal(got, exp)
    assert second.base is base and np.array_equal(base.vectors, vectors)


def test_masked_ids_crowding_the_top_are_searched_past():
    # Every one of the 300 replaced rows is near the query: the base's first asks see only them.
    vectors, query = _unit((C, D), 7), _unit((1, D), 8)
    crowd = np.arange(300)
    vectors[crowd] = query + 0.01 * _unit((300, D), 9)
    edited = EditedIndex(index.ExactIndex(vectors), crowd, _unit((300, D), 10) * 0 - query)
    full = vectors.copy()
    full[crowd] = -query
    for got, exp in zip(edited.search(query, 10), _fresh(full, [], query, 10)):
        np.testing.assert_allclose(got, exp, rtol=0, atol=1e-6)


def test_bad_edits_are_refused():
    base = index.ExactIndex(_unit((C, D), 11))
    with pytest.raises(ValueError, match=f"ids {C}, {C + 1}, ... in a row"):
        EditedIndex(base, [C + 1], _unit((1, D), 12))
    with pytest.raises(ValueError, match=f"deleted id {C + 1} is not below C={C + 1}"):
        EditedIndex(base, [C], _unit((1, D), 12), [C + 1])
    with pytest.raises(ValueError, match=r"\[E, D\] = \(2, 24\)"):
        EditedIndex(base, [3, 4], _unit((1, D), 12))
    with pytest.raises(ValueError, match="repeat an id"):
        EditedIndex(base, [3, 3], _unit((2, D), 12))
    with pytest.raises(ValueError, match="above the 1 passages left"):
        EditedIndex(index.ExactIndex(_unit((3, D), 13)), [], np.zeros((0, D)), [0, 1]).search(
            _unit((1, D), 14), 2
        )


def test_edited_scann_index_recall_and_every_edited_neighbour_found():
    pytest.importorskip("scann")
    count, dim = 30_000, 64
    rng = np.random.default_rng(15)
    centres = rng.standard_normal((150, dim), dtype=np.float32)
    data = centres[rng.integers(150, size=count + 300)] + rng.standard_normal(
        (count + 300, dim), dtype=np.float32
    )
    data /= np.linalg.norm(data, axis=1, keepdims=True)
    vectors, queries = data[:count].astype(np.float16), data[count:]
    ix = index.ScannIndex.build(vectors, build="sample", num_leaves=173, training_sample_size=9000)
    ix = ix.with_search_settings(num_leaves_to_search=60)
    ids, new = _edits(vectors, queries, 16)
    edited = EditedIndex(ix, ids, new)
    full = vectors.astype(np.float32)
    full[ids] = new
    true_ids = _fresh(full, [], queries, 10)[1]
    scores, got = edited.search(queries, 10)
    assert scann_index.recall_at_k(got, true_ids) >= 0.95
    wanted = np.isin(true_ids, ids)
    assert wanted.any()
    assert all(np.isin(t[w], g).all() for t, w, g in zip(true_ids, wanted, got))
    # An edited id is scored by its new vector, never its old one.
    row_of = {int(i): r for r, i in enumerate(ids)}
    for q, s, g in zip(queries, scores, got):
        for score, i in zip(s, g):
            if int(i) in row_of:
                assert abs(score - q @ new[row_of[int(i)]]) < 1e-5


def test_live_rows_are_the_rows_of_a_store_without_the_deleted_passages():
    """`LiveRowIndex` after three store edits (replace in place, delete, append) answers as an
    exact index over the store's rows built fresh, and `ids_of` inverts `rows_of`."""
    vectors, queries = _unit((C, D), 20), _unit((13, D), 21)
    live = LiveRowIndex(EditedIndex(index.ExactIndex(vectors), [], []))
    store = vectors.copy()  # row r of the store after each edit, rebuilt the plain way
    rng = np.random.default_rng(22)
    for step in range(3):
        count = len(store)
        replaced = rng.choice(count, 7, replace=False)
        deleted = rng.choice(np.setdiff1d(np.arange(count), replaced), 5, replace=False)
        replaced_vectors, new = _unit((7, D), 30 + step), _unit((4, D), 40 + step)
        # The replaced rows hold a query's best passage next: their edit must be searched.
        replaced_vectors[0] = queries[step]
        live = live.edit(replaced, replaced_vectors, new, deleted)
        store[replaced] = replaced_vectors
        store = np.concatenate([np.delete(store, deleted, axis=0), new])
        assert live.count == len(store)
        for k in (1, 10):
            want_scores, want_rows = index.ExactIndex(store).search(queries, k)
            scores, rows = live.search(queries, k)
            np.testing.assert_array_equal(rows, want_rows)
            np.testing.assert_allclose(scores, want_scores, rtol=0, atol=1e-6)
    every = np.arange(live.count)
    np.testing.assert_array_equal(live.rows_of(live.ids_of(every)), every)
    ids = live.ids_of(every)
    assert (np.diff(ids) > 0).all() and not np.isin(ids, live.edited.deleted_ids).any()
    with pytest.raises(ValueError, match=rf"rows must be in \[0, {live.count}\)"):
        live.ids_of([live.count])
