"""The retriever's objectives (`rag_jax.retriever_losses`) against float64 numpy formulas and
their finite differences: values, the gradient that reaches the doc scores (none reaches the
reader's likelihoods), and each temperature's effect."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rag_jax import rag_math
from rag_jax.retriever_losses import (
    RetrieverObjective,
    gold,
    leave_one_out_loglik,
    retriever_loss,
)

B, K, T = 3, 5, 4
TAU_G, TAU_S = 0.7, 1.6  # neither 1: a temperature that is ignored changes the values


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    scores = rng.normal(scale=2.0, size=(B, K))
    token_lp = np.log(rng.uniform(0.05, 0.95, size=(B, K, T)))
    scored = np.ones((B, T), bool)
    scored[0, 3] = scored[1, 2:] = False  # answers of 3, 2 and 4 tokens
    return scores, token_lp, scored


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _logsumexp(x, axis=-1):
    m = x.max(axis, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(axis, keepdims=True))).squeeze(axis)


def _kl(p, log_q):
    return (p * (np.log(p) - log_q)).sum(-1)


def _reference(loss, scores, token_lp, scored, variant="sequence", target_scores=None):
    """[B] the objective by its formula, float64, loops where the formula has them. LOOP's
    target is computed from `target_scores` (default `scores`): the objective holds it
    constant, so its gradient is the difference quotient with the target fixed."""
    target_scores = scores if target_scores is None else target_scores
    ll = (token_lp * scored[:, None, :]).sum(-1)  # [B, K]
    log_q = _log_softmax(scores / TAU_S)
    if loss == "marginal" and variant == "sequence":
        return -_logsumexp(log_q + ll)
    if loss == "marginal":  # RAG-Token: the mixture at every scored token
        mixed = _logsumexp(log_q[:, :, None] + token_lp, axis=1)  # [B, T]
        return -(mixed * scored).sum(-1)
    if loss == "emdr2":
        return -_logsumexp(log_q + ll)
    if loss == "pdist":
        return _kl(np.exp(_log_softmax(ll / TAU_G)), log_q)
    without = np.zeros((B, K))
    for b in range(B):
        for k in range(K):
            keep = [j for j in range(K) if j != k]
            q_others = _log_softmax(target_scores[b, keep] / TAU_S)
            without[b, k] = _logsumexp(q_others + ll[b, keep])
    return _kl(np.exp(_log_softmax(-without / TAU_G)), log_q)


def _objective(loss):
    return RetrieverObjective(loss, K, lm_temperature=TAU_G, score_temperature=TAU_S)


CASES = [("marginal", "sequence"), ("marginal", "token"), ("emdr2", "sequence"),
         ("pdist", "sequence"), ("loop", "sequence"), ("pdist", "token")]  # fmt: skip


@pytest.mark.parametrize("loss,variant", CASES)
def test_values_equal_the_formula(loss, variant):
    scores, token_lp, scored = _inputs()
    got = retriever_loss(
        _objective(loss), jnp.asarray(scores, jnp.float32), jnp.asarray(token_lp, jnp.float32),
        jnp.asarray(scored), variant,
    )  # fmt: skip
    np.testing.assert_allclose(got, _reference(loss, scores, token_lp, scored, variant), rtol=1e-5)


@pytest.mark.parametrize("loss,variant", CASES)
def test_the_gradient_reaches_the_scores_as_finite_differences_say(loss, variant):
    """Central differences of the float64 formula, one score at a time; a stop_gradient on the
    scores would give zeros, an ignored temperature other values."""
    scores, token_lp, scored = _inputs(1)
    weights = np.array([1.0, 0.5, 2.0])  # distinct per question: a row mix-up shows

    def loss_fn(s):
        per = retriever_loss(_objective(loss), s, jnp.asarray(token_lp, jnp.float32),
                             jnp.asarray(scored), variant)  # fmt: skip
        return jnp.sum(per * weights)

    grad = np.asarray(jax.grad(loss_fn)(jnp.asarray(scores, jnp.float32)))
    expected = np.zeros_like(scores)
    eps = 1e-5
    for b in range(B):
        for k in range(K):
            up, down = scores.copy(), scores.copy()
            up[b, k] += eps
            down[b, k] -= eps
            diff = _reference(loss, up, token_lp, scored, variant, scores) - _reference(
                loss, down, token_lp, scored, variant, scores
            )
            expected[b, k] = (diff * weights).sum() / (2 * eps)
    assert np.abs(expected).max() > 1e-2  # the objective moves with the scores
    np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("loss", ["marginal", "emdr2", "pdist", "loop"])
def test_the_readers_likelihoods_are_constants(loss):
    scores, token_lp, scored = _inputs(2)
    grad = jax.grad(
        lambda lp: retriever_loss(
            _objective(loss), jnp.asarray(scores, jnp.float32), lp, jnp.asarray(scored), "sequence"
        ).sum()  # fmt: skip
    )(jnp.asarray(token_lp, jnp.float32))
    assert not np.any(np.asarray(grad))


def test_emdr2_is_rags_sequence_marginal_for_a_frozen_reader():
    scores, token_lp, scored = _inputs(3)
    args = (jnp.asarray(scores, jnp.float32), jnp.asarray(token_lp, jnp.float32))

    def total(loss, s):
        return retriever_loss(_objective(loss), s, args[1], jnp.asarray(scored), "sequence").sum()

    for fn in (lambda loss: total(loss, args[0]), lambda loss: jax.grad(total, 1)(loss, args[0])):
        np.testing.assert_allclose(fn("emdr2"), fn("marginal"), rtol=1e-6, atol=1e-7)


def test_the_marginal_at_tau_1_is_the_memoised_rag_nll():
    """`marginal` with tau_s = 1 is exactly the loss the trainer's memo path computes."""
    scores, token_lp, scored = _inputs(4)
    args = jnp.asarray(scores, jnp.float32), jnp.asarray(token_lp, jnp.float32)
    for variant in ("sequence", "token"):
        got = retriever_loss(RetrieverObjective(), *args, jnp.asarray(scored), variant)
        want = rag_math.nll_from_token_logprobs(args[1], args[0], jnp.asarray(scored), variant)
        np.testing.assert_array_equal(got, want)


def test_leave_one_out_equals_brute_force():
    scores, token_lp, _ = _inputs(5)
    ll = token_lp.sum(-1)
    got = leave_one_out_loglik(jnp.asarray(scores), jnp.asarray(ll), TAU_S)
    for b in range(B):
        for k in range(K):
            keep = [j for j in range(K) if j != k]
            q = np.exp(scores[b, keep] / TAU_S)
            want = np.log((q / q.sum() * np.exp(ll[b, keep])).sum())
            np.testing.assert_allclose(got[b, k], want, rtol=1e-5)


def test_pdist_pulls_the_scores_toward_the_readers_posterior():
    """A few steps of gradient descent on the scores alone: the retriever's distribution moves
    to the reader's (the KL falls and the reader's best candidate becomes the retriever's)."""
    scores, token_lp, scored = _inputs(6)
    lp, mask = jnp.asarray(token_lp, jnp.float32), jnp.asarray(scored)
    objective = RetrieverObjective("pdist", K, lm_temperature=0.5)
    fn = jax.jit(jax.value_and_grad(lambda s: retriever_loss(objective, s, lp, mask, "x").sum()))
    s = jnp.asarray(scores, jnp.float32)
    first, _ = fn(s)
    for _ in range(300):
        value, g = fn(s)
        s = s - 0.5 * g
    assert value < 0.05 * first
    best = np.argmax((token_lp * scored[:, None]).sum(-1), axis=1)
    np.testing.assert_array_equal(np.argmax(np.asarray(s), axis=1), best)


def test_settings_are_checked_by_name():
    with pytest.raises(ValueError, match="retriever_loss must be one of"):
        RetrieverObjective("pdsit")
    with pytest.raises(ValueError, match="retriever_lm_temperature must be > 0"):
        RetrieverObjective("pdist", lm_temperature=0.0)
    with pytest.raises(ValueError, match="retriever_candidates must be >= 0"):
        RetrieverObjective(candidates=-4)
    with pytest.raises(ValueError, match=r"token_logprobs \(3, 5, 4\) must be \[B, K, T\]"):
        retriever_loss(RetrieverObjective(), jnp.zeros((3, 4)), jnp.zeros((3, 5, 4)),
                       jnp.ones((3, 4), bool), "sequence")  # fmt: skip
    assert not RetrieverObjective().separate(4)  # the default: RAG's one loss, as always
    assert RetrieverObjective(candidates=16).separate(4)
    assert RetrieverObjective("pdist").separate(4) and RetrieverObjective().count(4) == 4


def test_gold_is_dprs_loss_with_in_batch_and_hard_negatives():
    rng = np.random.default_rng(7)
    in_batch, scores = rng.normal(size=(B, B)), rng.normal(size=(B, K))
    is_gold = np.zeros((B, K), bool)
    is_gold[0, 1] = is_gold[2, 0] = True  # retrieved gold passages: not their own negatives

    def reference(ib):
        out = []
        for b in range(B):
            logits = np.concatenate([ib[b], scores[b][~is_gold[b]]]) / TAU_S
            out.append(_logsumexp(logits[None])[0] - ib[b, b] / TAU_S)
        return np.array(out)

    fn = lambda ib: gold(ib, jnp.asarray(scores), jnp.asarray(is_gold), TAU_S)  # noqa: E731
    np.testing.assert_allclose(fn(jnp.asarray(in_batch)), reference(in_batch), rtol=1e-5)
    grad = np.asarray(jax.grad(lambda ib: fn(ib).sum())(jnp.asarray(in_batch, jnp.float32)))
    eps, expected = 1e-5, np.zeros((B, B))
    for i in range(B):
        for j in range(B):
            up, down = in_batch.copy(), in_batch.copy()
            up[i, j] += eps
            down[i, j] -= eps
            expected[i, j] = (reference(up) - reference(down)).sum() / (2 * eps)
    np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-5)


def test_the_shuffled_reader_control_permutes_each_questions_candidates():
    from rag_jax.training.batcher import shuffled_candidates

    lp = np.arange(B * K * T, dtype=np.float32).reshape(B, K, T)
    once, again = shuffled_candidates(lp, 0, 3, 0), shuffled_candidates(lp, 0, 3, 0)
    np.testing.assert_array_equal(once, again)  # a function of (seed, step, block)
    assert not np.array_equal(once, shuffled_candidates(lp, 0, 4, 0))
    for b in range(B):  # a permutation of the question's own candidates, whole rows moved
        assert sorted(map(tuple, once[b])) == sorted(map(tuple, lp[b]))
