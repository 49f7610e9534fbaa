"""Tests for rag_jax.rag_math against HF transformers' own RAG methods (PyTorch).

HF's `get_nll` and `marginalize` are called unbound on a stand-in `self` that carries only the
config fields they read, with the same random tensors as the JAX functions. Dimensions are small
and distinct (B=2, N=3, T=5, V=11, D=7) so a swapped axis fails.
"""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.rag.modeling_rag import (
    RagSequenceForGeneration,
    RagTokenForGeneration,
)

from rag_jax import rag_math, sequence_candidates

B, N, T, V, D = 2, 3, 5, 11, 7
BOS, PAD, EOS = 0, 1, 2
START = EOS  # BART's decoder start token
TOL = dict(rtol=1e-5, atol=1e-5)


def _hf_self(bos_token_id=BOS):
    """Stand-in `self` with the config fields HF's get_nll/marginalize read."""
    config = types.SimpleNamespace(
        n_docs=N,
        bos_token_id=None,
        generator=types.SimpleNamespace(pad_token_id=PAD, bos_token_id=bos_token_id),
    )
    stub = types.SimpleNamespace(config=config)
    stub.marginalize = functools.partial(RagTokenForGeneration.marginalize, stub)
    return stub


def _inputs(seed, batch=B, length=T):
    rng = np.random.default_rng(seed)
    seq_logits = rng.normal(size=(batch * N, length, V)).astype(np.float32)
    doc_scores = (2.0 * rng.normal(size=(batch, N))).astype(np.float32)
    return seq_logits, doc_scores


def _labels(kind, seed=0):
    """[B, T] decoder inputs (= labels): START, then BOS or not, answer tokens, EOS, pads."""
    rng = np.random.default_rng(seed)
    words = rng.integers(3, V, size=(B, T))  # never BOS, PAD or EOS
    rows = {
        "bos": [[START, BOS, *words[0, :2], EOS], [START, BOS, *words[1, :2], EOS]],
        "no_bos": [[START, *words[0, :3], EOS], [START, *words[1, :3], EOS]],
        "mixed": [[START, BOS, *words[0, :2], EOS], [START, *words[1, :3], EOS]],
        # Row 1 predicts a pad at shifted position 1, where the doc prior is added.
        "padded": [[START, BOS, words[0, 0], EOS, PAD], [START, BOS, PAD, PAD, PAD]],
    }[kind]
    return np.asarray(rows, np.int32)


def _hf_sequence(seq_logits, doc_scores, labels, *, bos=BOS, **kw):
    return RagSequenceForGeneration.get_nll(
        _hf_self(bos), seq_logits, doc_scores, torch.from_numpy(labels).long(), n_docs=N, **kw
    )


def _hf_token(seq_logits, doc_scores, labels, **kw):
    return RagTokenForGeneration.get_nll(
        _hf_self(), seq_logits, doc_scores, torch.from_numpy(labels).long(), n_docs=N, **kw
    )


# The comparisons run jitted: one compile per static configuration is much quicker than eager
# dispatch of every op; test_jit_gives_identical_results_and_traces_once checks jit against eager.
_sequence_nll = jax.jit(
    rag_math.rag_sequence_nll,
    static_argnames=("pad_token_id", "bos_token_id", "n_docs", "exclude_bos_score", "reduce"),
)
_token_nll = jax.jit(rag_math.rag_token_nll, static_argnames=("pad_token_id", "n_docs", "reduce"))
_thorough_nll = jax.jit(
    rag_math.rag_sequence_thorough_nll, static_argnames=("pad_token_id", "bos_token_id", "n_docs")
)
_select = jax.jit(
    sequence_candidates.select_top_candidates, static_argnames=("num_return", "deduplicate")
)


def _ours_sequence(seq_logits, doc_scores, labels, *, bos=BOS, **kw):
    return _sequence_nll(
        seq_logits, doc_scores, labels, pad_token_id=PAD, bos_token_id=bos, n_docs=N, **kw
    )


def _ours_token(seq_logits, doc_scores, labels, **kw):
    return _token_nll(seq_logits, doc_scores, labels, pad_token_id=PAD, n_docs=N, **kw)


KINDS = ["bos", "no_bos", "mixed", "padded"]


@pytest.mark.parametrize("reduce", [False, True])
@pytest.mark.parametrize("exclude_bos_score", [False, True])
@pytest.mark.parametrize("epsilon", [0.0, 0.1])
@pytest.mark.parametrize("kind", KINDS)
def test_rag_sequence_nll_matches_hf(kind, epsilon, exclude_bos_score, reduce):
    seq_logits, doc_scores = _inputs(1)
    labels = _labels(kind)
    want = _hf_sequence(
        torch.from_numpy(seq_logits),
        torch.from_numpy(doc_scores),
        labels,
        epsilon=epsilon,
        exclude_bos_score=exclude_bos_score,
        reduce_loss=reduce,
    ).numpy()
    got = _ours_sequence(
        seq_logits,
        doc_scores,
        labels,
        epsilon=epsilon,
        exclude_bos_score=exclude_bos_score,
        reduce=reduce,
    )
    assert got.shape == (() if reduce else (B,))
    np.testing.assert_allclose(got, want, **TOL)


def test_rag_sequence_bos_exclusion_is_batch_wide():
    # Excluding the BOS score must change the loss of an all-BOS batch, and must not change it
    # once one row lacks BOS, even for the rows that have it.
    seq_logits, doc_scores = _inputs(2)
    for kind, changes in [("bos", True), ("mixed", False)]:
        base = _ours_sequence(seq_logits, doc_scores, _labels(kind))
        excl = _ours_sequence(seq_logits, doc_scores, _labels(kind), exclude_bos_score=True)
        assert bool(np.all(np.abs(np.asarray(base - excl)) > 1e-3)) == changes, kind


def test_rag_sequence_nll_without_bos_token_and_short_targets():
    # bos_token_id None (T5-style generators), and T = 1 and 2, where HF's prior slot at position
    # 1 is absent or a pad.
    for length, bos in [(T, None), (1, BOS), (2, BOS)]:
        seq_logits, doc_scores = _inputs(3, length=length)
        labels = _labels("bos")[:, :length]
        want = _hf_sequence(
            torch.from_numpy(seq_logits),
            torch.from_numpy(doc_scores),
            labels,
            bos=bos,
            epsilon=0.1,
            exclude_bos_score=True,
        ).numpy()
        got = _ours_sequence(
            seq_logits, doc_scores, labels, bos=bos, epsilon=0.1, exclude_bos_score=True
        )
        np.testing.assert_allclose(got, want, **TOL, err_msg=f"T={length} bos={bos}")


@pytest.mark.parametrize("reduce", [False, True])
@pytest.mark.parametrize("epsilon", [0.0, 0.1])
@pytest.mark.parametrize("kind", KINDS)
def test_rag_token_nll_matches_hf(kind, epsilon, reduce):
    seq_logits, doc_scores = _inputs(4)
    labels = _labels(kind)
    want = _hf_token(
        torch.from_numpy(seq_logits),
        torch.from_numpy(doc_scores),
        labels,
        epsilon=epsilon,
        reduce_loss=reduce,
    ).numpy()
    got = _ours_token(seq_logits, doc_scores, labels, epsilon=epsilon, reduce=reduce)
    assert got.shape == (() if reduce else (B,))
    np.testing.assert_allclose(got, want, **TOL)


def test_rag_token_marginalize_matches_hf():
    seq_logits, doc_scores = _inputs(5)
    want = RagTokenForGeneration.marginalize(
        _hf_self(), torch.from_numpy(seq_logits), torch.from_numpy(doc_scores), n_docs=N
    ).numpy()
    got = jax.jit(rag_math.rag_token_marginalize, static_argnames="n_docs")(
        seq_logits, doc_scores, n_docs=N
    )
    assert got.shape == (B, T, V)
    np.testing.assert_allclose(got, want, **TOL)
    np.testing.assert_allclose(np.exp(np.asarray(got, np.float64)).sum(-1), 1.0, atol=1e-5)


@pytest.mark.parametrize(
    "variant, kind, kw",
    [
        ("sequence", "bos", dict(epsilon=0.1, exclude_bos_score=True)),
        ("sequence", "padded", dict(epsilon=0.1)),
        ("sequence", "mixed", dict(exclude_bos_score=True, reduce=True)),
        ("token", "padded", dict(epsilon=0.1)),
        ("token", "bos", dict(reduce=True)),
    ],
)
def test_gradients_match_torch_autograd(variant, kind, kw):
    seq_logits, doc_scores = _inputs(6)
    labels = _labels(kind)
    # A random cotangent, so per-example outputs are checked with distinct weights.
    weights = np.random.default_rng(7).uniform(0.5, 2.0, size=() if kw.get("reduce") else (B,))
    hf_fn, ours_fn = {
        "sequence": (_hf_sequence, _ours_sequence),
        "token": (_hf_token, _ours_token),
    }[variant]
    hf_kw = {("reduce_loss" if k == "reduce" else k): v for k, v in kw.items()}

    t_logits = torch.tensor(seq_logits, requires_grad=True)
    t_scores = torch.tensor(doc_scores, requires_grad=True)
    (hf_fn(t_logits, t_scores, labels, **hf_kw) * torch.tensor(weights).float()).sum().backward()

    def weighted_loss(logits, scores):
        return jnp.sum(ours_fn(logits, scores, labels, **kw) * weights)

    got = jax.grad(weighted_loss, argnums=(0, 1))(seq_logits, doc_scores)
    for g, want in zip(got, (t_logits.grad.numpy(), t_scores.grad.numpy()), strict=True):
        assert np.abs(want).max() > 1e-3  # the loss depends on this input
        np.testing.assert_allclose(g, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_jit_gives_identical_results_and_traces_once():
    seq_logits, doc_scores = _inputs(8)
    labels = _labels("padded")
    fns = {
        "sequence": functools.partial(
            rag_math.rag_sequence_nll,
            pad_token_id=PAD,
            bos_token_id=BOS,
            n_docs=N,
            epsilon=0.1,
            exclude_bos_score=True,
        ),
        "token": functools.partial(rag_math.rag_token_nll, pad_token_id=PAD, n_docs=N, epsilon=0.1),
        "marginalize": lambda logits, scores, _: rag_math.rag_token_marginalize(logits, scores, N),
    }
    for name, fn in fns.items():
        traces = []

        def counted(*args, fn=fn, traces=traces):
            traces.append(None)
            return fn(*args)

        jitted = jax.jit(counted)
        np.testing.assert_array_equal(
            jitted(seq_logits, doc_scores, labels), fn(seq_logits, doc_scores, labels), name
        )
        other_logits, other_scores = _inputs(9)
        jitted(other_logits, other_scores, _labels("mixed"))
        assert len(traces) == 1, name


def test_doc_scores_matches_torch_bmm():
    rng = np.random.default_rng(10)
    question = rng.normal(size=(B, D)).astype(np.float32)
    docs = rng.normal(size=(B, N, D)).astype(np.float32)
    want = (
        torch.bmm(torch.from_numpy(question).unsqueeze(1), torch.from_numpy(docs).transpose(1, 2))
        .squeeze(1)
        .numpy()
    )
    got = rag_math.doc_scores(question, docs)
    assert got.shape == (B, N) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, **TOL)
    np.testing.assert_array_equal(jax.jit(rag_math.doc_scores)(question, docs), got)


def test_doc_scores_takes_the_question_dtype():
    # HF casts the retrieved doc vectors to the question encoder's dtype before the product.
    rng = np.random.default_rng(11)
    question = jnp.asarray(rng.normal(size=(B, D)), jnp.bfloat16)
    docs = rng.normal(size=(B, N, D)).astype(np.float32)
    got = rag_math.doc_scores(question, docs)
    assert got.dtype == jnp.bfloat16
    want = np.einsum(
        "bd,bnd->bn",
        np.asarray(question, np.float32),
        np.asarray(jnp.asarray(docs, jnp.bfloat16), np.float32),
    )
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-2)


def test_doc_scores_gradient_reaches_the_question():
    rng = np.random.default_rng(12)
    question = rng.normal(size=(B, D)).astype(np.float32)
    docs = rng.normal(size=(B, N, D)).astype(np.float32)
    weights = rng.normal(size=(B, N)).astype(np.float32)
    got = jax.grad(lambda q: jnp.sum(rag_math.doc_scores(q, docs) * weights))(question)
    np.testing.assert_allclose(got, np.einsum("bn,bnd->bd", weights, docs), **TOL)


def test_shape_errors_name_both_shapes():
    seq_logits, doc_scores = _inputs(13)
    labels = _labels("bos")
    with pytest.raises(ValueError, match=r"seq_logits \(4, 5, 11\).*doc_scores \(2, 3\)"):
        _ours_sequence(seq_logits[:4], doc_scores, labels)
    with pytest.raises(ValueError, match=r"target \(2, 4\).*seq_logits \(6, 5, 11\)"):
        _ours_token(seq_logits, doc_scores, labels[:, :4])
    with pytest.raises(ValueError, match=r"doc_scores \(2, 3\).*N = 2"):
        rag_math.rag_token_nll(seq_logits, doc_scores, labels, pad_token_id=PAD, n_docs=2)
    with pytest.raises(ValueError, match="integer"):
        _ours_token(seq_logits, doc_scores, labels.astype(np.float32))
    with pytest.raises(ValueError, match=r"doc_emb \(2, 3, 4\).*question_emb \(2, 5\)"):
        rag_math.doc_scores(np.zeros((2, 5)), np.zeros((2, 3, 4)))


def _candidates():
    """[B, M=4, T] generated candidates: question 0 all start with BOS, question 1 does not."""
    return np.asarray(
        [
            [
                [START, BOS, 5, EOS, PAD],
                [START, BOS, 6, 7, EOS],
                [START, BOS, 5, EOS, PAD],  # a repeat of candidate 0
                [START, BOS, EOS, PAD, PAD],
            ],
            [
                [START, BOS, 8, EOS, PAD],
                [START, 9, EOS, PAD, PAD],  # no BOS: BOS stays scored for question 1
                [START, BOS, 3, EOS, PAD],
                [START, BOS, 4, EOS, PAD],
            ],
        ],
        np.int32,
    )


@pytest.mark.parametrize("epsilon", [0.0, 0.1])
def test_rag_sequence_thorough_nll_matches_hf_per_question(epsilon):
    candidates = _candidates()
    num_candidates = candidates.shape[1]
    rng = np.random.default_rng(14)
    flat_seq_logits = rng.normal(size=(B * num_candidates * N, T, V)).astype(np.float32)
    doc_scores = (2.0 * rng.normal(size=(B, N))).astype(np.float32)
    got = _thorough_nll(
        flat_seq_logits,
        doc_scores,
        candidates,
        pad_token_id=PAD,
        bos_token_id=BOS,
        n_docs=N,
        epsilon=epsilon,
    )
    assert got.shape == (B, num_candidates)
    for b in range(B):
        # HF sees one question's candidates, padded only to that question's longest one.
        length = int(np.max(np.sum(candidates[b] != PAD, axis=1)))
        rows = flat_seq_logits[b * num_candidates * N : (b + 1) * num_candidates * N, :length]
        want = _hf_sequence(
            torch.from_numpy(rows),
            torch.from_numpy(doc_scores[b : b + 1]).repeat(num_candidates, 1),
            candidates[b, :, :length],
            epsilon=epsilon,
            exclude_bos_score=True,
        ).numpy()
        np.testing.assert_allclose(got[b], want, **TOL, err_msg=f"question {b}")
    # Question 1 has one candidate without BOS, so its BOS scores are kept: per question, not
    # batch-wide, detection is what makes this equal HF.
    batch_wide = _ours_sequence(
        flat_seq_logits,
        jnp.repeat(doc_scores, num_candidates, axis=0),
        candidates.reshape(B * num_candidates, T),
        exclude_bos_score=True,
        epsilon=epsilon,
    ).reshape(B, num_candidates)
    np.testing.assert_allclose(batch_wide[1], got[1], **TOL)
    assert np.all(np.abs(np.asarray(batch_wide[0] - got[0])) > 1e-3)


def test_select_top_candidates_matches_hf_dedup_and_topk():
    candidates = _candidates()
    scores = np.asarray([[-1.0, -3.0, -0.5, -2.0], [-4.0, -1.5, -2.5, -0.7]], np.float32)
    tokens, top = _select(candidates, scores, num_return=2)
    for b in range(B):
        # HF: dict keyed by the token list keeps the first occurrence's position, then topk.
        unique = {str(row.tolist()): i for i, row in reversed(list(enumerate(candidates[b])))}
        order = sorted(unique.values())
        _, best = torch.from_numpy(scores[b, order]).topk(2)
        want = candidates[b, [order[i] for i in best.tolist()]]
        np.testing.assert_array_equal(tokens[b], want)
        np.testing.assert_array_equal(top[b], scores[b, [order[i] for i in best.tolist()]])
    # Without deduplication the repeat (score -0.5) of candidate 0 is ranked too.
    tokens, top = _select(candidates, scores, num_return=2, deduplicate=False)
    np.testing.assert_array_equal(tokens[0], candidates[0, [2, 0]])


def test_first_occurrence_mask():
    np.testing.assert_array_equal(
        sequence_candidates.first_occurrence_mask(_candidates()),
        [[True, True, False, True], [True, True, True, True]],
    )


def test_rag_sequence_fast_scores_match_brute_force():
    num_beams, length = 2, 4
    # Answers repeat across docs (5 and 7 in question 0, 3 in question 1) and, for answer 6 of
    # question 1, within one doc's beams, where it must count once.
    beam_tokens = np.asarray(
        [
            [
                [[5, 6, 2, 1], [7, 2, 1, 1]],
                [[7, 2, 1, 1], [8, 2, 1, 1]],
                [[5, 6, 2, 1], [9, 2, 1, 1]],
            ],
            [
                [[3, 2, 1, 1], [4, 2, 1, 1]],
                [[6, 2, 1, 1], [6, 2, 1, 1]],
                [[7, 2, 1, 1], [3, 2, 1, 1]],
            ],
        ],
        np.int32,
    )
    assert beam_tokens.shape == (B, N, num_beams, length)
    rng = np.random.default_rng(15)
    beam_logprobs = -rng.uniform(0.5, 4.0, size=(B, N, num_beams)).astype(np.float32)
    beam_logprobs[1, 1, 1] = beam_logprobs[1, 1, 0]  # one answer, one doc: one probability
    doc_scores = (2.0 * rng.normal(size=(B, N))).astype(np.float32)
    got = jax.jit(sequence_candidates.rag_sequence_fast_scores)(
        beam_tokens, beam_logprobs, doc_scores
    )
    assert got.shape == (B, N * num_beams)
    prior = np.exp(doc_scores - doc_scores.max(1, keepdims=True))
    prior /= prior.sum(1, keepdims=True)
    for b in range(B):
        by_doc = [
            {tuple(beam_tokens[b, z, k]): beam_logprobs[b, z, k] for k in range(num_beams)}
            for z in range(N)
        ]
        for c in range(N * num_beams):
            answer = tuple(beam_tokens[b, c // num_beams, c % num_beams])
            p = sum(prior[b, z] * np.exp(by_doc[z].get(answer, -np.inf)) for z in range(N))
            np.testing.assert_allclose(got[b, c], np.log(p), **TOL, err_msg=f"{b} {c}")


@pytest.mark.parametrize("epsilon", [0.0, 0.1])
def test_a_causal_sequence_prior_is_added_once_whatever_positions_are_scored(epsilon):
    """Labels that ignore position 0 (HF's -100 there) still carry log p(z|x): the NLL is
    -log sum_z p(z|x) prod_{t scored} p(y_t | x, z, y_<t), never a likelihood above 1."""
    rng = np.random.default_rng(11)
    batch, n_docs, length, vocab = 2, 3, 4, 7
    logits = rng.normal(size=(batch * n_docs, length, vocab))
    scores = rng.normal(size=(batch, n_docs))
    target = rng.integers(0, vocab, size=(batch, length))
    mask = np.array([[False, True, True, False], [True, True, True, True]])
    got = rag_math.rag_sequence_nll(
        jnp.asarray(logits, jnp.float32), jnp.asarray(scores, jnp.float32), jnp.asarray(target),
        pad_token_id=0, bos_token_id=None, n_docs=n_docs, epsilon=epsilon, aligned=True,
        target_mask=jnp.asarray(mask),
    )  # fmt: skip
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    logp = logp.reshape(batch, n_docs, length, vocab)
    prior = scores - np.log(np.exp(scores).sum(-1, keepdims=True))  # [B, N]
    picked = np.take_along_axis(logp, target[:, None, :, None], -1)[..., 0]  # [B, N, T]
    ll = (picked * mask[:, None]).sum(-1) + prior
    nll = -np.log(np.exp(ll).sum(-1))
    smooth = (logp.sum(-1) * mask[:, None]).sum(-1) + vocab * prior
    smooth = -np.log(np.exp(smooth).sum(-1))
    want = (1 - epsilon) * nll + epsilon / vocab * smooth if epsilon else nll
    np.testing.assert_allclose(got, want, rtol=1e-5)
    memo = rag_math.nll_from_token_logprobs(
        jnp.asarray(picked, jnp.float32), jnp.asarray(scores, jnp.float32), jnp.asarray(mask),
        "sequence",
    )  # fmt: skip
    np.testing.assert_allclose(memo, nll, rtol=1e-5)
