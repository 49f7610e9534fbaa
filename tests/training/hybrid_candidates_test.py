"""`retrieval.source`: training candidates and evaluated rankings from BM25, or from BM25 and the
dense index fused; the doc scores stay the question tower's `q . d`, so the retriever's loss
trains it over candidates it did not choose."""

import dataclasses
import fractions

import jax
import numpy as np
import pytest

from rag_jax.retrieval import lexical, sources
from rag_jax.retriever_losses import RetrieverObjective
from rag_jax.run import settings, validation
from rag_jax.training import experiment, loop, step
from rag_jax.training.batcher import Batcher
from tiny_runs import first_batch, tiny_config

K = 8


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    config = tiny_config(
        **{
            "retrieval.source": "hybrid",
            "retrieval.fusion_depth": 12,
            "train.retriever_loss": "pdist",
            "train.retriever_candidates": K,
            "train.retriever_fixed_candidates": True,
        }
    )
    exp = experiment.build(config, tmp_path_factory.mktemp("hybrid"))
    return config, exp


def _dense_reference(exp, examples):
    """[B, C] every passage's score under the initial question tower, in float64."""
    batcher = Batcher(exp, loop.device_mesh(exp.config), train=False)
    fields, _ = batcher.questions(examples)
    q = np.asarray(
        batcher.embed(exp.params, fields["question_input_ids"], fields["question_attention_mask"]),
        np.float64,
    )
    return q @ np.asarray(exp.retriever.vectors, np.float64).T


def _agrees_with_brute_force(rows, scores, gap=1e-4):
    """Whether each row of [B, k] `rows` is a top k of [B, C] float64 `scores`, best first: the
    same ids as the reference wherever the reference's neighbouring scores differ by more than
    `gap` (passages closer than that may come in either order on another machine's kernels)."""
    for found, row_scores in zip(rows, scores, strict=True):
        order = np.argsort(-row_scores, kind="stable")
        k = len(found)
        got = row_scores[found]
        if np.any(np.diff(got) > gap):  # not descending beyond the rounding slack
            return False
        kth = row_scores[order[k - 1]]
        outside = np.delete(row_scores, found)
        if outside.size and outside.max() > kth + gap:  # a clearly better passage was left out
            return False
    return True


def _fused(rankings, k, c=60):
    """Reciprocal rank fusion written plainly: sum of 1 / (c + rank) over the lists holding a
    row; ties by its best rank, then the earlier list, then the lower row."""
    out = []
    for lists in zip(*rankings, strict=True):
        score, best = {}, {}
        for li, ranking in enumerate(lists):
            for rank, row in enumerate(ranking, start=1):
                row = int(row)
                score[row] = score.get(row, 0) + fractions.Fraction(1, c + rank)  # exact
                best[row] = min(best.get(row, (rank, li)), (rank, li))
        order = sorted(score, key=lambda r: (-score[r], *best[r], r))
        out.append(order[:k])
    return np.array(out)


def test_hybrid_candidates_are_the_fused_dense_and_bm25_rankings(built, monkeypatch):
    config, exp = built
    fused_inputs = []
    fuse = lexical.fuse
    monkeypatch.setattr(lexical, "fuse", lambda r, k: fused_inputs.append(r) or fuse(r, k))
    table = Batcher(exp, loop.device_mesh(config)).fixed_candidates()  # -> [len(train), K]
    source = exp.retriever.source
    assert isinstance(source, sources.CandidateSource) and source.kind == "hybrid"
    depth = 12
    dense = np.concatenate([r[0] for r in fused_inputs])  # what the index's search returned
    bm25 = np.concatenate([r[1] for r in fused_inputs])
    assert dense.shape == bm25.shape == (len(exp.train), depth)
    # The dense side is the tower's top 12 (a float64 brute force), BM25's its own search's.
    assert _agrees_with_brute_force(dense, _dense_reference(exp, exp.train))
    np.testing.assert_array_equal(bm25, source.bm25.search([e.question for e in exp.train], 12)[1])
    np.testing.assert_array_equal(table, _fused([dense, bm25], K))
    lexical_rows = bm25
    # Drawn from both sides: some candidates only BM25 ranks in its top 12, some only dense.
    only_bm25 = [set(t) - set(d) for t, d in zip(table, dense)]
    only_dense = [set(t) - set(b) for t, b in zip(table, lexical_rows)]
    assert any(only_bm25) and any(only_dense)
    assert all(len(set(row)) == K for row in table)  # deduplicated


def test_bm25_candidates_are_bm25s_top_k(built):
    config, exp = built
    again = settings.override(config.copy_and_resolve_references(), {"retrieval.source": "bm25"})
    bm25_exp = dataclasses.replace(exp, config=again).with_retriever(exp.params["passage_encoder"])
    table = Batcher(bm25_exp, loop.device_mesh(again)).fixed_candidates()
    _, want = bm25_exp.retriever.source.bm25.search([e.question for e in exp.train], K)
    np.testing.assert_array_equal(table, want)


def test_the_hybrid_step_trains_the_question_tower(built):
    """The candidates come from BM25 and the index, the doc scores from `q . d` inside the step:
    the objective's gradient reaches the question tower (and would not through a cut)."""
    config, exp = built
    batch = first_batch(Batcher(exp, loop.device_mesh(config)), exp)
    objective = RetrieverObjective.from_config(config)
    loss_fn = step.joint_loss_fn(
        exp.rag_cfg, "sequence", exp.passage_cfg, config.train.freeze, objective
    )
    grads = jax.grad(lambda p: loss_fn(p, batch, jax.random.PRNGKey(0))[0])(exp.params)
    norm = lambda tree: float(  # noqa: E731
        np.sqrt(sum(np.sum(np.square(np.asarray(x))) for x in jax.tree.leaves(tree)))
    )
    assert norm(grads["question_encoder"]) > 1e-6

    def cut(p, b):  # the same loss with the doc vectors' side cut: what the test must catch
        q = jax.tree.map(jax.lax.stop_gradient, p["question_encoder"])
        return loss_fn(dict(p, question_encoder=q), b, jax.random.PRNGKey(0))[0]

    assert norm(jax.grad(cut)(exp.params, batch)["question_encoder"]) == 0.0


def test_a_text_source_cannot_search_inside_the_step():
    config = tiny_config(**{"retrieval.source": "bm25", "retrieval.index": "device"})
    validation.validate(config, 1, paths=False)  # the device index is searched between steps
    assert not experiment._asks_in_step(config)
    with pytest.raises(ValueError, match="retrieval.source must be one of"):
        validation.validate(tiny_config(**{"retrieval.source": "sparse"}), 1, paths=False)


def test_a_text_source_needs_the_question_texts(built):
    _, exp = built
    pieces = exp.store.tokenize_questions(exp.generator_tokenizer, ["who?"])
    vectors = np.zeros((1, exp.retriever.index.dim), np.float32)
    with pytest.raises(ValueError, match="reads the question texts"):
        exp.retriever(vectors, pieces)
    hits = exp.retriever(vectors, pieces, ["who?"])
    assert hits.doc_ids.shape == (1, exp.retriever.n_docs)
