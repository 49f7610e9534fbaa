"""The retriever's objectives (`rag_jax.retriever_losses`), each form against a float64 numpy
reference written from its paper's formula (loops where the formula has them) and the finite
differences of that reference: values, the gradient that reaches the doc scores (none reaches
the reader's likelihoods), each temperature's and the reader score's effect, and what `loop`
(Atlas' target) does that `loop_weighted` does not."""

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
    weighted_leave_one_out_loglik,
)
from rag_jax.run import settings, validation

B, K, T = 3, 5, 4
TAU_G, TAU_S = 0.7, 1.6  # neither 1: a temperature that is ignored changes the values


def _inputs(seed=0):
    """Scores [B, K], token log-probabilities [B, K, T] (any value where not scored: a missing
    mask changes the result) and the scored positions [B, T]."""
    rng = np.random.default_rng(seed)
    scores = rng.normal(scale=2.0, size=(B, K))
    token_lp = np.log(rng.uniform(0.05, 0.95, size=(B, K, T)))
    scored = np.ones((B, T), bool)
    scored[0, 3] = scored[1, 2:] = False  # answers of 3, 2 and 4 tokens
    return scores, token_lp, scored


# The references: plain float64, one question and one candidate at a time.


def _log_q(scores_b):
    """log softmax(s / tau_s) of one question's scores [K]."""
    x = scores_b / TAU_S
    return x - np.log(np.sum(np.exp(x - x.max()))) - x.max()


def _log_sum_exp(values):
    m = max(values)
    return m + np.log(sum(np.exp(v - m) for v in values))


def _loglik(token_lp, scored, b, k):
    """`l_k = sum_t log p(y_t | x, z_k, y_<t)` over question b's scored tokens."""
    return sum(token_lp[b, k, t] for t in range(T) if scored[b, t])


def _kl_to_q(target_logits, scores_b):
    """`KL(softmax(target_logits) || softmax(s / tau_s))` for one question."""
    p = np.exp(target_logits - _log_sum_exp(list(target_logits)))
    return float(np.sum(p * (np.log(p) - _log_q(scores_b))))


def _reader_score(value, scored, b, lm_score):
    """The reader's score: the log-likelihood, or per scored token (Atlas' code)."""
    return value if lm_score == "sum" else value / scored[b].sum()


def _reference(loss, scores, token_lp, scored, variant="sequence", lm_score="sum", target=None):
    """[B] the objective by its formula. The distillations' targets are computed from `target`
    scores (default `scores`): the objective holds them constant, so its gradient is the
    difference quotient with the target fixed (only `loop_weighted`'s depends on them)."""
    target = scores if target is None else target
    out = np.zeros(B)
    for b in range(B):
        log_q = _log_q(scores[b])
        ll = [_loglik(token_lp, scored, b, k) for k in range(K)]
        tokens = [t for t in range(T) if scored[b, t]]
        if loss == "emdr2" or (loss == "marginal" and variant == "sequence"):
            # -log sum_k q_k p(y | x, z_k)  (RAG-Sequence; EMDR² as the papers write it)
            out[b] = -_log_sum_exp([log_q[k] + ll[k] for k in range(K)])
        elif loss in ("emdr2_token", "marginal"):
            # -sum_t log sum_k q_k p(y_t | x, z_k, y_<t)  (RAG-Token; EMDR² as the codes do it)
            out[b] = -sum(_log_sum_exp([log_q[k] + token_lp[b, k, t] for k in range(K)])
                          for t in tokens)  # fmt: skip
        elif loss == "pdist":
            # KL(softmax(r_k / tau_g) || q)
            r = np.array([_reader_score(ll[k], scored, b, lm_score) for k in range(K)])
            out[b] = _kl_to_q(r / TAU_G, scores[b])
        elif loss == "loop":
            # l_-k = log (1/(K-1)) sum_{j != k} p(y | x, z_j); KL(softmax(-r_-k / tau_g) || q)
            without = np.zeros(K)
            for k in range(K):
                mixture = sum(np.exp(ll[j]) for j in range(K) if j != k) / (K - 1)
                without[k] = _reader_score(np.log(mixture), scored, b, lm_score)
            out[b] = _kl_to_q(-without / TAU_G, scores[b])
        elif loss == "loop_weighted":
            # l_-k = log sum_{j != k} q'_j p(y | x, z_j), q' = q renormalised over j != k
            q = np.exp(_log_q(target[b]))
            without = np.zeros(K)
            for k in range(K):
                others = sum(q[j] for j in range(K) if j != k)
                mixture = sum(q[j] / others * np.exp(ll[j]) for j in range(K) if j != k)
                without[k] = _reader_score(np.log(mixture), scored, b, lm_score)
            out[b] = _kl_to_q(-without / TAU_G, scores[b])
        else:
            raise ValueError(loss)
    return out


def _objective(loss, lm_score="sum"):
    return RetrieverObjective(
        loss, K, lm_temperature=TAU_G, score_temperature=TAU_S, lm_score=lm_score
    )


CASES = [
    ("marginal", "sequence", "sum"),
    ("marginal", "token", "sum"),
    ("emdr2", "sequence", "sum"),
    ("emdr2", "token", "sum"),  # sequence-level whatever the variant
    ("emdr2_token", "sequence", "sum"),  # token-level whatever the variant
    ("emdr2_token", "token", "sum"),
    ("pdist", "sequence", "sum"),
    ("pdist", "sequence", "mean"),
    ("pdist", "token", "sum"),
    ("loop", "sequence", "sum"),
    ("loop", "sequence", "mean"),
    ("loop_weighted", "sequence", "sum"),
    ("loop_weighted", "sequence", "mean"),
]


def _jax_loss(loss, variant, lm_score, scores, token_lp, scored):
    return retriever_loss(
        _objective(loss, lm_score), scores, jnp.asarray(token_lp, jnp.float32),
        jnp.asarray(scored), variant,
    )  # fmt: skip


@pytest.mark.parametrize("loss,variant,lm_score", CASES)
def test_values_equal_the_formula(loss, variant, lm_score):
    scores, token_lp, scored = _inputs()
    got = _jax_loss(loss, variant, lm_score, jnp.asarray(scores, jnp.float32), token_lp, scored)
    want = _reference(loss, scores, token_lp, scored, variant, lm_score)
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("loss,variant,lm_score", CASES)
def test_the_gradient_reaches_the_scores_as_finite_differences_say(loss, variant, lm_score):
    """Central differences of the float64 formula, one score at a time; a stop_gradient on the
    scores would give zeros, an ignored temperature other values."""
    scores, token_lp, scored = _inputs(1)
    weights = np.array([1.0, 0.5, 2.0])  # distinct per question: a row mix-up shows

    def loss_fn(s):
        return jnp.sum(_jax_loss(loss, variant, lm_score, s, token_lp, scored) * weights)

    grad = np.asarray(jax.grad(loss_fn)(jnp.asarray(scores, jnp.float32)))
    expected = np.zeros_like(scores)
    eps = 1e-5
    for b in range(B):
        for k in range(K):
            up, down = scores.copy(), scores.copy()
            up[b, k] += eps
            down[b, k] -= eps
            diff = _reference(loss, up, token_lp, scored, variant, lm_score, scores) - _reference(
                loss, down, token_lp, scored, variant, lm_score, scores
            )
            expected[b, k] = (diff * weights).sum() / (2 * eps)
    assert np.abs(expected).max() > 1e-2  # the objective moves with the scores
    np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("loss", ["pdist", "loop", "loop_weighted"])
def test_the_per_token_mean_is_not_the_sum(loss):
    """On answers of 3, 2 and 4 tokens the two reader scores give other targets (a setting
    that is ignored would give equal values)."""
    scores, token_lp, scored = _inputs(2)
    s = jnp.asarray(scores, jnp.float32)
    by_sum = _jax_loss(loss, "sequence", "sum", s, token_lp, scored)
    by_mean = _jax_loss(loss, "sequence", "mean", s, token_lp, scored)
    assert np.all(np.abs(np.asarray(by_sum - by_mean)) > 1e-3)


@pytest.mark.parametrize("loss", ["marginal", "emdr2", "emdr2_token", "pdist", "loop",
                                  "loop_weighted"])  # fmt: skip
def test_the_readers_likelihoods_are_constants(loss):
    scores, token_lp, scored = _inputs(2)
    grad = jax.grad(
        lambda lp: retriever_loss(
            _objective(loss), jnp.asarray(scores, jnp.float32), lp, jnp.asarray(scored), "sequence"
        ).sum()  # fmt: skip
    )(jnp.asarray(token_lp, jnp.float32))
    assert not np.any(np.asarray(grad))


@pytest.mark.parametrize("emdr2,variant", [("emdr2", "sequence"), ("emdr2_token", "token")])
def test_each_emdr2_is_rags_marginal_of_its_level_for_a_frozen_reader(emdr2, variant):
    scores, token_lp, scored = _inputs(3)
    args = (jnp.asarray(scores, jnp.float32), jnp.asarray(token_lp, jnp.float32))

    def total(loss, s):
        return retriever_loss(_objective(loss), s, args[1], jnp.asarray(scored), variant).sum()

    for fn in (lambda loss: total(loss, args[0]), lambda loss: jax.grad(total, 1)(loss, args[0])):
        np.testing.assert_allclose(fn(emdr2), fn("marginal"), rtol=1e-6, atol=1e-7)


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
    uniform = leave_one_out_loglik(jnp.asarray(ll))
    weighted = weighted_leave_one_out_loglik(jnp.asarray(scores), jnp.asarray(ll), TAU_S)
    for b in range(B):
        for k in range(K):
            keep = [j for j in range(K) if j != k]
            want = np.log(np.mean(np.exp(ll[b, keep])))
            np.testing.assert_allclose(uniform[b, k], want, rtol=1e-5)
            q = np.exp(scores[b, keep] / TAU_S)
            want = np.log((q / q.sum() * np.exp(ll[b, keep])).sum())
            np.testing.assert_allclose(weighted[b, k], want, rtol=1e-5)


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


def test_loop_gives_the_readers_best_passage_its_target_where_the_retriever_ranks_it_low():
    """The reader's best candidate (0) ranked last by the retriever: Atlas' LOOP target (the
    others' uniform mixture) puts nearly all its weight on it, as PDist does; the
    retriever-weighted mixture barely misses it, since the retriever weighs it little in the
    others' mixtures, and gives it about a third. The target is read off the gradient:
    `d KL(p || softmax(s / tau_s)) / ds = (softmax(s / tau_s) - p) / tau_s`."""
    scores = jnp.array([[-4.0, 4.0, 4.0]])
    token_lp = jnp.array([[[-1.0], [-6.0], [-6.0]]])  # one scored token: l = (-1, -6, -6)
    scored = jnp.ones((1, 1), bool)

    def target(loss):
        objective = RetrieverObjective(loss, 3, lm_temperature=1.0, score_temperature=1.0)
        grad = jax.grad(lambda s: retriever_loss(objective, s, token_lp, scored, "x").sum())
        return np.asarray(jax.nn.softmax(scores) - grad(scores))[0]

    pdist, atlas, weighted = target("pdist"), target("loop"), target("loop_weighted")
    np.testing.assert_allclose(pdist[0], 1 / (1 + 2 * np.exp(-5)), rtol=1e-5)
    without = np.log([np.exp(-6.0), (np.exp(-1) + np.exp(-6)) / 2, (np.exp(-1) + np.exp(-6)) / 2])
    np.testing.assert_allclose(atlas, np.exp(-without) / np.exp(-without).sum(), rtol=1e-5)
    assert atlas[0] > 0.97 and pdist[0] > 0.98  # the reader's best gets (nearly) all of it
    assert 0.3 < weighted[0] < 0.4  # loop_weighted: a third
    assert np.argmax(atlas) == np.argmax(pdist) == 0


def test_settings_are_checked_by_name():
    with pytest.raises(ValueError, match="retriever_loss must be one of"):
        RetrieverObjective("pdsit")
    with pytest.raises(ValueError, match="retriever_lm_temperature must be > 0"):
        RetrieverObjective("pdist", lm_temperature=0.0)
    with pytest.raises(ValueError, match="retriever_candidates must be >= 0"):
        RetrieverObjective(candidates=-4)
    with pytest.raises(ValueError, match="retriever_lm_score must be one of"):
        RetrieverObjective("pdist", lm_score="avg")
    with pytest.raises(ValueError, match="retriever_loss='emdr2' does not read it"):
        RetrieverObjective("emdr2", lm_score="mean")
    with pytest.raises(ValueError, match=r"token_logprobs \(3, 5, 4\) must be \[B, K, T\]"):
        retriever_loss(RetrieverObjective(), jnp.zeros((3, 4)), jnp.zeros((3, 5, 4)),
                       jnp.ones((3, 4), bool), "sequence")  # fmt: skip
    with pytest.raises(ValueError, match="leave-one-out needs K >= 2"):
        retriever_loss(RetrieverObjective("loop"), jnp.zeros((3, 1)), jnp.zeros((3, 1, 4)),
                       jnp.ones((3, 4), bool), "sequence")  # fmt: skip
    assert not RetrieverObjective().separate(4)  # the default: RAG's one loss, as always
    assert RetrieverObjective(candidates=16).separate(4)
    assert RetrieverObjective("pdist").separate(4) and RetrieverObjective().count(4) == 4


def test_the_run_settings_reach_the_objective_and_are_validated():
    config = settings.defaults()
    assert RetrieverObjective.from_config(config) == RetrieverObjective()  # one default each
    config.train.retriever_loss, config.train.retriever_lm_score = "loop", "mean"
    config.train.retriever_candidates = 6
    objective = RetrieverObjective.from_config(config)
    assert (objective.loss, objective.lm_score, objective.candidates) == ("loop", "mean", 6)
    validation.validate(config, 1, paths=False)
    config.train.retriever_lm_score = "avg"
    with pytest.raises(ValueError, match="retriever_lm_score must be one of sum | mean"):
        validation.validate(config, 1, paths=False)
    config.train.retriever_lm_score, config.train.retriever_candidates = "sum", 0
    config.rag.n_docs = 1
    with pytest.raises(ValueError, match="leaves one candidate out of K, but K = 1"):
        validation.validate(config, 1, paths=False)


def test_gold_is_dprs_loss_with_in_batch_and_hard_negatives():
    rng = np.random.default_rng(7)
    in_batch, scores = rng.normal(size=(B, B)), rng.normal(size=(B, K))
    is_gold = np.zeros((B, K), bool)
    is_gold[0, 1] = is_gold[2, 0] = True  # retrieved gold passages: not their own negatives

    def reference(ib, s):
        """-log softmax([q.g_1..q.g_B, hard negatives] / tau_s)[own gold], per question."""
        out = []
        for b in range(B):
            logits = [ib[b, c] / TAU_S for c in range(B)]
            logits += [s[b, k] / TAU_S for k in range(K) if not is_gold[b, k]]
            out.append(_log_sum_exp(logits) - ib[b, b] / TAU_S)
        return np.array(out)

    fn = lambda ib, s: gold(ib, s, jnp.asarray(is_gold), TAU_S)  # noqa: E731
    np.testing.assert_allclose(
        fn(jnp.asarray(in_batch), jnp.asarray(scores)), reference(in_batch, scores), rtol=1e-5
    )
    args = jnp.asarray(in_batch, jnp.float32), jnp.asarray(scores, jnp.float32)
    grads = jax.grad(lambda ib, s: fn(ib, s).sum(), argnums=(0, 1))(*args)
    eps = 1e-5
    for i, x in enumerate((in_batch, scores)):
        expected = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            up, down = [in_batch.copy(), scores.copy()], [in_batch.copy(), scores.copy()]
            up[i][idx] += eps
            down[i][idx] -= eps
            expected[idx] = (reference(*up) - reference(*down)).sum() / (2 * eps)
        assert np.abs(expected).max() > 1e-2
        np.testing.assert_allclose(grads[i], expected, rtol=1e-4, atol=1e-5)
    assert not np.any(np.asarray(grads[1])[is_gold])  # a retrieved gold is no negative


def test_gold_leaves_out_another_questions_gold_that_is_its_own():
    """Questions 0 and 2 share a gold passage: neither is the other's negative (DPR masks such
    duplicates), question 1 still is; without the mask, the same loss as before."""
    rng = np.random.default_rng(8)
    in_batch, scores = rng.normal(size=(B, B)), rng.normal(size=(B, K))
    is_gold = np.zeros((B, K), bool)
    same = np.eye(B, dtype=bool)
    same[0, 2] = same[2, 0] = True

    def reference(ib, s):
        out = []
        for b in range(B):
            logits = [ib[b, c] / TAU_S for c in range(B) if c == b or not same[b, c]]
            logits += [s[b, k] / TAU_S for k in range(K)]
            out.append(_log_sum_exp(logits) - ib[b, b] / TAU_S)
        return np.array(out)

    args = jnp.asarray(in_batch), jnp.asarray(scores), jnp.asarray(is_gold), TAU_S
    got = np.asarray(gold(*args, jnp.asarray(same)))
    np.testing.assert_allclose(got, reference(in_batch, scores), rtol=1e-5)
    unmasked = np.asarray(gold(*args))
    assert not np.allclose(got[[0, 2]], unmasked[[0, 2]])
    np.testing.assert_allclose(got[1], unmasked[1], rtol=1e-6)


def test_the_shuffled_reader_control_permutes_each_questions_candidates():
    from rag_jax.training.batcher import shuffled_candidates

    lp = np.arange(B * K * T, dtype=np.float32).reshape(B, K, T)
    once, again = shuffled_candidates(lp, 0, 3, 0), shuffled_candidates(lp, 0, 3, 0)
    np.testing.assert_array_equal(once, again)  # a function of (seed, step, block)
    assert not np.array_equal(once, shuffled_candidates(lp, 0, 4, 0))
    for b in range(B):  # a permutation of the question's own candidates, whole rows moved
        assert sorted(map(tuple, once[b])) == sorted(map(tuple, lp[b]))
