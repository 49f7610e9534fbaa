"""What the retriever learns from its reader: the objectives that train the question encoder.

RAG (Lewis et al. 2020) trains the retriever through the generator's own loss, the marginal
likelihood over the top k passages. Later work trains it with an objective of its own, the
reader's judgement of each candidate held constant (the reader trains, if at all, by RAG's
marginal). Per question, with candidates k = 1..K, doc scores `s_k` (the question encoder's,
differentiable), the reader's sequence log-likelihood `l_k = log p_LM(y | x, z_k)` (a constant
here: `stop_gradient`), the retriever's distribution `q = softmax(s / tau_s)` and
`KL(p || q) = sum_k p_k (log p_k - log q_k)`:

  marginal  RAG's own: `-log sum_k q_k p_LM(y | x, z_k)` for RAG-Sequence, and per token for
            RAG-Token (`rag_math.nll_from_token_logprobs`), over the K candidates.
  emdr2     EMDR^2 (Sachan et al. 2021; Atlas, Izacard et al. 2022, eq. 3):
            `-log sum_k q_k exp(l_k)`, the sequence-level marginal whatever the variant. With a
            frozen reader and RAG-Sequence it is `marginal` (same gradient; a test holds it).
  pdist     Perplexity distillation (Atlas' PDist; REPLUG's LSR, Shi et al. 2023):
            `KL(softmax(l / tau_g) || q)`: the retriever matches the reader's posterior over the
            candidates, sharpened by `tau_g` (REPLUG: 0.1).
  loop      Leave-one-out perplexity distillation (Atlas' LOOP): the reader's log-likelihood
            without candidate k, `l_-k = log sum_{j != k} q'_j exp(l_j)` (q' the retriever's
            distribution renormalised over the others; a constant), and
            `KL(softmax(-l_-k / tau_g) || q)`: a candidate whose removal hurts most gets most
            weight.

And one that does not learn from the reader, the supervised ceiling of a study's comparison:

  gold      DPR's loss (Karpukhin et al. 2020): the question's gold passage against the other
            questions' gold passages (in-batch negatives) and its own K candidates that are
            not gold (hard negatives), `-log softmax([q.g_1..q.g_B, s_k...] / tau_s)[own gold]`.

`l_k` is the sum of the answer tokens' log-probabilities under candidate k alone, as RAG-Sequence
scores it; for RAG-Token's reader it is the same per-candidate likelihood. Every objective here is
per question ([B]); the trainer weights and averages them as it does the NLL.

Legend: B batch, K candidates per question (train.retriever_candidates, K >= N, plus any
random negatives), N docs the generator reads (rag.n_docs), T answer length.
"""

import dataclasses

import jax
import jax.numpy as jnp

from rag_jax import rag_math

OBJECTIVES = ("marginal", "emdr2", "pdist", "loop", "gold")


@dataclasses.dataclass(frozen=True)
class RetrieverObjective:
    """How the retriever trains (`train.retriever_*`); the default is RAG's own loss.

    Attributes:
      loss: one of `OBJECTIVES`.
      candidates: K, the passages per question the objective spans; 0 = rag.n_docs. The
        generator reads the first rag.n_docs of them (the best) in its own loss.
      lm_temperature: tau_g, the reader side's temperature (pdist, loop).
      score_temperature: tau_s, the retriever side's: q = softmax(s / tau_s) (every objective).
      random_negatives: R passages drawn from the corpus appended after the K (the batcher's
        `random_negatives`): the objective spans K + R.
    """

    loss: str = "marginal"
    candidates: int = 0
    lm_temperature: float = 0.1
    score_temperature: float = 1.0
    random_negatives: int = 0

    def __post_init__(self):
        if self.loss not in OBJECTIVES:
            raise ValueError(
                f"config.train.retriever_loss must be one of {OBJECTIVES}, got {self.loss!r}"
            )
        if self.candidates < 0:
            raise ValueError(
                f"config.train.retriever_candidates must be >= 0 (0 = rag.n_docs), got "
                f"{self.candidates}"
            )
        if self.random_negatives < 0:
            raise ValueError(
                f"config.train.retriever_random_negatives must be >= 0, got {self.random_negatives}"
            )
        for name, value in (
            ("retriever_lm_temperature", self.lm_temperature),
            ("retriever_score_temperature", self.score_temperature),
        ):
            if not value > 0:
                raise ValueError(f"config.train.{name} must be > 0, got {value!r}")

    @classmethod
    def from_config(cls, config) -> "RetrieverObjective":
        """A run's objective from its `train.retriever_*` settings."""
        t = config.train
        return cls(
            t.retriever_loss,
            t.retriever_candidates,
            t.retriever_lm_temperature,
            t.retriever_score_temperature,
            t.retriever_random_negatives,
        )

    def searched(self, n_docs: int) -> int:
        """K, the candidates searched (or fixed) per question, for a generator reading
        `n_docs` passages."""
        return max(self.candidates, n_docs)

    def count(self, n_docs: int) -> int:
        """K + R, the passages per question the objective spans."""
        return self.searched(n_docs) + self.random_negatives

    def separate(self, n_docs: int) -> bool:
        """Whether the retriever has a loss of its own: another objective than RAG's marginal,
        or the marginal over more candidates than the generator reads. Otherwise the trainer's
        loss is RAG's as it always was, one marginal training both halves."""
        return self.loss != "marginal" or self.count(n_docs) > n_docs or self.score_temperature != 1


def sequence_loglik(token_logprobs: jax.Array, scored: jax.Array) -> jax.Array:
    """[B, K] `l_k = sum_t log p(y_t | x, z_k, y_<t)` over the scored positions.

    Args:
      token_logprobs: [B, K, T] the answer tokens' log-probabilities under each candidate.
      scored: [B, T] bool, the positions that count.
    """
    return jnp.where(scored[:, None, :], token_logprobs, 0.0).sum(axis=-1)


def _kl(target: jax.Array, log_q: jax.Array) -> jax.Array:
    """[B] `KL(target || q)` with `target` [B, K] a (constant) distribution, `log_q` [B, K]."""
    log_target = jnp.log(jnp.maximum(target, jnp.finfo(target.dtype).tiny))
    return jnp.sum(jnp.where(target > 0, target * (log_target - log_q), 0.0), axis=-1)


def emdr2(doc_scores: jax.Array, loglik: jax.Array, score_temperature: float) -> jax.Array:
    """[B] `-log sum_k softmax(s / tau_s)_k exp(l_k)`, the reader's `l` [B, K] a constant."""
    log_q = jax.nn.log_softmax(doc_scores / score_temperature, axis=-1)
    return -jax.nn.logsumexp(log_q + jax.lax.stop_gradient(loglik), axis=-1)


def pdist(
    doc_scores: jax.Array, loglik: jax.Array, lm_temperature: float, score_temperature: float
) -> jax.Array:
    """[B] `KL(softmax(l / tau_g) || softmax(s / tau_s))`, the reader's `l` [B, K] a constant."""
    target = jax.nn.softmax(jax.lax.stop_gradient(loglik) / lm_temperature, axis=-1)
    return _kl(target, jax.nn.log_softmax(doc_scores / score_temperature, axis=-1))


def leave_one_out_loglik(doc_scores: jax.Array, loglik: jax.Array, score_temperature: float):
    """[B, K] `l_-k = log sum_{j != k} q'_j exp(l_j)`: the marginal likelihood of the answer
    without candidate k, `q'` the retriever's distribution renormalised over the others.

    Args:
      doc_scores: [B, K].
      loglik: [B, K] the reader's `l`.
      score_temperature: tau_s.
    """
    log_q = jax.nn.log_softmax(doc_scores / score_temperature, axis=-1)  # [B, K]
    others = ~jnp.eye(log_q.shape[-1], dtype=bool)[None]  # [1, K (left out), K (kept)]
    kept = lambda x: jnp.where(others, x[:, None, :], -jnp.inf)  # noqa: E731  -> [B, K, K]
    return jax.nn.logsumexp(kept(log_q + loglik), axis=-1) - jax.nn.logsumexp(kept(log_q), -1)


def loop(
    doc_scores: jax.Array, loglik: jax.Array, lm_temperature: float, score_temperature: float
) -> jax.Array:
    """[B] `KL(softmax(-l_-k / tau_g) || softmax(s / tau_s))` (`leave_one_out_loglik`, a
    constant: the target does not move with the scores it is computed from)."""
    without = jax.lax.stop_gradient(leave_one_out_loglik(doc_scores, loglik, score_temperature))
    target = jax.nn.softmax(-without / lm_temperature, axis=-1)
    return _kl(target, jax.nn.log_softmax(doc_scores / score_temperature, axis=-1))


def gold(
    in_batch_scores: jax.Array,
    doc_scores: jax.Array,
    candidate_is_gold: jax.Array,
    score_temperature: float,
) -> jax.Array:
    """[B] DPR's loss: question b's own gold passage among every question's gold passages and
    its candidates that are not gold.

    Args:
      in_batch_scores: [B, B] `score(question b, gold passage of question c)`.
      doc_scores: [B, K] the question's scores of its candidates.
      candidate_is_gold: [B, K] bool, candidates that are the question's gold passage (left out:
        the gold passage is in the first block already).
      score_temperature: tau_s.
    """
    hard = jnp.where(candidate_is_gold, -jnp.inf, doc_scores)  # -> [B, K]
    logits = jnp.concatenate([in_batch_scores, hard], axis=-1) / score_temperature
    own = jnp.diagonal(in_batch_scores) / score_temperature  # [B]
    return jax.nn.logsumexp(logits, axis=-1) - own


def retriever_loss(
    objective: RetrieverObjective,
    doc_scores: jax.Array,
    token_logprobs: jax.Array,
    scored: jax.Array,
    variant: str,
) -> jax.Array:
    """[B] the retriever's loss per question; its gradient reaches only `doc_scores`.

    Args:
      objective: which objective, and its temperatures.
      doc_scores: [B, K] the question encoder's scores of the K candidates.
      token_logprobs: [B, K, T] the reader's answer-token log-probabilities under each candidate
        (made constants here).
      scored: [B, T] bool, the answer positions that count.
      variant: "sequence" or "token": RAG's marginal of that variant (`marginal` only).
    """
    if token_logprobs.shape[:2] != doc_scores.shape or token_logprobs.shape[::2] != scored.shape:
        raise ValueError(
            f"token_logprobs {tuple(token_logprobs.shape)} must be [B, K, T] for doc_scores "
            f"{tuple(doc_scores.shape)} [B, K] and scored {tuple(scored.shape)} [B, T]"
        )
    token_logprobs = jax.lax.stop_gradient(token_logprobs)
    scored = scored.astype(bool)
    scores = doc_scores / objective.score_temperature
    if objective.loss == "gold":
        raise ValueError("the gold objective reads gold passages, not the reader: use gold()")
    if objective.loss == "marginal":
        return rag_math.nll_from_token_logprobs(token_logprobs, scores, scored, variant)
    loglik = sequence_loglik(token_logprobs, scored)
    if objective.loss == "emdr2":
        return emdr2(doc_scores, loglik, objective.score_temperature)
    fn = pdist if objective.loss == "pdist" else loop
    return fn(doc_scores, loglik, objective.lm_temperature, objective.score_temperature)
