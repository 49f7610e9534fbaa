"""What the retriever learns from its reader: the objectives that train the question encoder.

RAG (Lewis et al. 2020) trains the retriever through the generator's own loss, the marginal
likelihood over the top k passages. Later work trains it with an objective of its own, the
reader's judgement of each candidate held constant (the reader trains, if at all, by RAG's
marginal). Per question, with candidates k = 1..K, doc scores `s_k` (the question encoder's,
differentiable), the reader's answer-token log-probabilities `log p(y_t | x, z_k, y_<t)` under
candidate k alone (constants here: `stop_gradient`), its sequence log-likelihood
`l_k = sum_t log p(y_t | x, z_k, y_<t)` over the scored positions, the retriever's distribution
`q = softmax(s / tau_s)` and `KL(p || q) = sum_k p_k (log p_k - log q_k)`:

  marginal       RAG's own (the default): `-log sum_k q_k p_LM(y | x, z_k)` for RAG-Sequence,
                 and per token for RAG-Token (`rag_math.nll_from_token_logprobs`), over the K.
  emdr2          EMDR^2 as the papers write it (Sachan et al. 2021, the retriever's term of the
                 objective; Atlas, Izacard et al. 2022, §2.2): `-log sum_k q_k exp(l_k)`, the
                 sequence-level marginal whatever the variant. With a frozen reader and
                 RAG-Sequence it is `marginal` (same gradient; a test holds it).
  emdr2_token    EMDR^2 as both papers' codes compute it (Sachan et al.'s
                 `get_loss_and_retriever_utility`, Atlas' `Atlas.logprob`), token by token:
                 `-sum_t log sum_k q_k p(y_t | x, z_k, y_<t)` over the answer's scored tokens,
                 whatever the variant (with a frozen reader and RAG-Token it is `marginal`).
                 The codes divide the batch's sum by its count of answer tokens, here each
                 question's sum is its loss (the trainer averages over questions): the same
                 gradient direction within a batch, scaled by the batch's mean answer length.
                 Atlas' code also divides the reader's logits by its target temperature before
                 the vocabulary softmax; here the reader's log-probabilities are read as they
                 are (no tau_g in either EMDR^2 form).
  pdist          Perplexity distillation (Atlas' PDist; REPLUG's LSR, Shi et al. 2023):
                 `KL(softmax(r / tau_g) || q)` with `r_k` the reader's score of candidate k alone
                 (`train.retriever_lm_score`, below): the retriever matches the reader's
                 posterior over the candidates, sharpened by `tau_g` (REPLUG: 0.1).
  loop           Leave-one-out perplexity distillation (Atlas' LOOP, §2.2): the target weights
                 candidate k by how much the reader's likelihood of the answer falls when k is
                 left out, `KL(softmax(-r_-k / tau_g) || q)`, no retriever weight in the target.
                 Atlas' reader is Fusion-in-Decoder, which reads the other K-1 passages jointly
                 (`Atlas.loop_score`: one pass with passage k masked out). The readers here read
                 one passage at a time (RAG-Sequence's per-candidate likelihoods, the memo's),
                 so what stands in for FiD reading the others is their uniform mixture,
                 `l_-k = log (1/(K-1)) sum_{j != k} exp(l_j)`: the likelihood of RAG-Sequence
                 reading the K-1 others with equal doc probabilities. (For RAG-Token's reader
                 the same sequence-level mixture is used, not a per-token one.) Needs K >= 2.
  loop_weighted  What `loop` was before (the `loop_k16` rows of docs/training.md ran it): the
                 same target with the mixture over the others weighted by the retriever's own
                 distribution renormalised over them, `l_-k = log sum_{j != k} q'_j exp(l_j)`,
                 `q'_j = q_j / sum_{i != k} q_i` (a constant). A candidate the retriever ranks
                 low weighs little in the others' mixtures, so the reader's best candidate ranked
                 low gets less of the target than under `loop` (a test shows it). Not Atlas'.

The reader's score `r` (`train.retriever_lm_score`, pdist and both loops) is `sum` (the
default), the answer's log-likelihood itself, `r_k = l_k` and `r_-k = l_-k`: the whole output's
likelihood, as REPLUG's LSR scores it (Shi et al. 2023). Or it is `mean`, the same divided by the
question's count T_b of scored answer tokens, `r_k = l_k / T_b` and `r_-k = l_-k / T_b`, as
Atlas' code scores both (`perplexity_score`, `loop_score`: the mean token log-likelihood of the
reader's pass). For a loop the division comes after the mixture: it is the per-token mean of the
reader-without-k's log-likelihood, as Atlas' code takes it of FiD's. Per question, `mean` is
`sum` at the temperature `tau_g * T_b`.

And one that does not learn from the reader, the supervised ceiling of a study's comparison:

  gold           DPR's loss (Karpukhin et al. 2020): the question's gold passage against the
                 other questions' gold passages (in-batch negatives; one that is its own gold
                 passage too is left out) and its own K candidates that are neither gold nor
                 hold its answer (hard negatives, as DPR's hold none),
                 `-log softmax([q.g_1..q.g_B, s_k...] / tau_s)[own gold]`.

For RAG-Token's reader `l_k` is the same per-candidate likelihood as for RAG-Sequence's. Every
objective here is per question ([B]); the trainer weights and averages them as it does the NLL.

Legend: B batch, K candidates per question (train.retriever_candidates, K >= N, plus any
random negatives), N docs the generator reads (rag.n_docs), T answer length.
"""

import dataclasses

import jax
import jax.numpy as jnp

from rag_jax import rag_math

OBJECTIVES = ("marginal", "emdr2", "emdr2_token", "pdist", "loop", "loop_weighted", "gold")
LM_SCORES = ("sum", "mean")  # the reader's score r: the answer's log-likelihood, or per token
SCORED_BY_READER = ("pdist", "loop", "loop_weighted")  # the objectives `lm_score` applies to
LEAVE_ONE_OUT = ("loop", "loop_weighted")


@dataclasses.dataclass(frozen=True)
class RetrieverObjective:
    """How the retriever trains (`train.retriever_*`); the default is RAG's own loss.

    Attributes:
      loss: one of `OBJECTIVES`.
      candidates: K, the passages per question the objective spans; 0 = rag.n_docs. The
        generator reads the first rag.n_docs of them (the best) in its own loss.
      lm_temperature: tau_g, the reader side's temperature (pdist, loop, loop_weighted).
      score_temperature: tau_s, the retriever side's: q = softmax(s / tau_s) (every objective).
      random_negatives: R passages drawn from the corpus appended after the K (the batcher's
        `random_negatives`): the objective spans K + R.
      lm_score: the reader's score r of pdist and the loops, one of `LM_SCORES`: "sum" (the
        answer's log-likelihood) or "mean" (per scored answer token, as Atlas' code).
      cut_gradient: a control: the retriever's towers enter every loss as constants, so no
        gradient reaches them through the doc scores (the step still applies the optimizer's
        weight decay to them); what a row gains beyond this one came through the doc scores.
    """

    loss: str = "marginal"
    candidates: int = 0
    lm_temperature: float = 0.1
    score_temperature: float = 1.0
    random_negatives: int = 0
    lm_score: str = "sum"
    cut_gradient: bool = False

    def __post_init__(self):
        if self.loss not in OBJECTIVES:
            raise ValueError(
                f"config.train.retriever_loss must be one of {OBJECTIVES}, got {self.loss!r}"
            )
        if self.lm_score not in LM_SCORES:
            raise ValueError(
                f"config.train.retriever_lm_score must be one of {LM_SCORES}, got {self.lm_score!r}"
            )
        if self.lm_score != "sum" and self.loss not in SCORED_BY_READER:
            raise ValueError(
                f"config.train.retriever_lm_score={self.lm_score!r} is the reader's score of "
                f"{' | '.join(SCORED_BY_READER)}; retriever_loss={self.loss!r} does not read it: "
                "leave it 'sum'"
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
            t.retriever_lm_score,
            bool(t.retriever_cut_gradient),
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


def _distil(doc_scores, reader_score, lm_temperature, score_temperature):
    """[B] `KL(softmax(r / tau_g) || softmax(s / tau_s))`, `r` [B, K] made a constant."""
    target = jax.nn.softmax(jax.lax.stop_gradient(reader_score) / lm_temperature, axis=-1)
    return _kl(target, jax.nn.log_softmax(doc_scores / score_temperature, axis=-1))


def _per_token(score: jax.Array, answer_tokens: jax.Array | None) -> jax.Array:
    """`score` [B, K] divided by each question's scored answer tokens [B] (None: as it is)."""
    if answer_tokens is None:
        return score
    return score / jnp.maximum(answer_tokens, 1).astype(score.dtype)[:, None]


def emdr2(doc_scores: jax.Array, loglik: jax.Array, score_temperature: float) -> jax.Array:
    """[B] `-log sum_k softmax(s / tau_s)_k exp(l_k)`, the reader's `l` [B, K] a constant."""
    log_q = jax.nn.log_softmax(doc_scores / score_temperature, axis=-1)
    return -jax.nn.logsumexp(log_q + jax.lax.stop_gradient(loglik), axis=-1)


def emdr2_token(
    doc_scores: jax.Array, token_logprobs: jax.Array, scored: jax.Array, score_temperature: float
) -> jax.Array:
    """[B] `-sum_t log sum_k softmax(s / tau_s)_k p(y_t | x, z_k, y_<t)` over the scored
    positions, the reader's log-probabilities a constant.

    Args:
      doc_scores: [B, K].
      token_logprobs: [B, K, T] the answer tokens' log-probabilities under each candidate.
      scored: [B, T] bool, the positions that count.
      score_temperature: tau_s.
    """
    log_q = jax.nn.log_softmax(doc_scores / score_temperature, axis=-1)  # [B, K]
    lp = jax.lax.stop_gradient(token_logprobs)
    mixed = jax.nn.logsumexp(log_q[:, :, None] + lp, axis=1)  # -> [B, T]
    return -jnp.where(scored, mixed, 0.0).sum(axis=-1)


def pdist(
    doc_scores: jax.Array,
    loglik: jax.Array,
    lm_temperature: float,
    score_temperature: float,
    answer_tokens: jax.Array | None = None,
) -> jax.Array:
    """[B] `KL(softmax(r / tau_g) || softmax(s / tau_s))`, `r` the reader's `l` [B, K] (a
    constant), or `l / answer_tokens` ([B], the question's scored tokens) for the per-token
    mean."""
    return _distil(doc_scores, _per_token(loglik, answer_tokens), lm_temperature, score_temperature)


def _others(k: int) -> jax.Array:
    """[1, K (left out), K (kept)] bool: j != k. LOOP leaves one of K out, so K >= 2."""
    if k < 2:
        raise ValueError(f"leave-one-out needs K >= 2 candidates per question, got K = {k}")
    return ~jnp.eye(k, dtype=bool)[None]


def leave_one_out_loglik(loglik: jax.Array) -> jax.Array:
    """[B, K] `l_-k = log (1/(K-1)) sum_{j != k} exp(l_j)`: the answer's likelihood under the
    uniform mixture of the other K-1 candidates (what stands in for FiD reading them jointly).

    Args:
      loglik: [B, K] the reader's `l`.
    """
    k = loglik.shape[-1]
    kept = jnp.where(_others(k), loglik[:, None, :], -jnp.inf)  # -> [B, K, K]
    return jax.nn.logsumexp(kept, axis=-1) - jnp.log(k - 1.0)


def weighted_leave_one_out_loglik(
    doc_scores: jax.Array, loglik: jax.Array, score_temperature: float
) -> jax.Array:
    """[B, K] `l_-k = log sum_{j != k} q'_j exp(l_j)`, `q'` the retriever's distribution
    renormalised over the others (`loop_weighted`'s, not Atlas').

    Args:
      doc_scores: [B, K].
      loglik: [B, K] the reader's `l`.
      score_temperature: tau_s.
    """
    log_q = jax.nn.log_softmax(doc_scores / score_temperature, axis=-1)  # [B, K]
    others = _others(log_q.shape[-1])
    kept = lambda x: jnp.where(others, x[:, None, :], -jnp.inf)  # noqa: E731  -> [B, K, K]
    return jax.nn.logsumexp(kept(log_q + loglik), axis=-1) - jax.nn.logsumexp(kept(log_q), -1)


def loop(
    doc_scores: jax.Array,
    loglik: jax.Array,
    lm_temperature: float,
    score_temperature: float,
    answer_tokens: jax.Array | None = None,
) -> jax.Array:
    """[B] Atlas' LOOP, `KL(softmax(-r_-k / tau_g) || softmax(s / tau_s))`, `r_-k` the uniform
    mixture's `leave_one_out_loglik` (a constant), or that divided by `answer_tokens` [B]."""
    without = _per_token(leave_one_out_loglik(loglik), answer_tokens)
    return _distil(doc_scores, -without, lm_temperature, score_temperature)


def loop_weighted(
    doc_scores: jax.Array,
    loglik: jax.Array,
    lm_temperature: float,
    score_temperature: float,
    answer_tokens: jax.Array | None = None,
) -> jax.Array:
    """[B] `KL(softmax(-r_-k / tau_g) || softmax(s / tau_s))`, `r_-k` the retriever-weighted
    `weighted_leave_one_out_loglik` (a constant: the target does not move with the scores it is
    computed from), or that divided by `answer_tokens` [B]."""
    without = weighted_leave_one_out_loglik(doc_scores, loglik, score_temperature)
    without = _per_token(without, answer_tokens)
    return _distil(doc_scores, -without, lm_temperature, score_temperature)


def gold(
    in_batch_scores: jax.Array,
    doc_scores: jax.Array,
    candidate_is_gold: jax.Array,
    score_temperature: float,
    in_batch_duplicate: jax.Array | None = None,
) -> jax.Array:
    """[B] DPR's loss: question b's own gold passage among every question's gold passages and
    its candidates that are not gold.

    Args:
      in_batch_scores: [B, B] `score(question b, gold passage of question c)`.
      doc_scores: [B, K] the question's scores of its candidates.
      candidate_is_gold: [B, K] bool, candidates that are no negative of the question (left out):
        its gold passage (in the first block already), or one holding its answer.
      score_temperature: tau_s.
      in_batch_duplicate: [B, B] bool, whether question c's gold passage is question b's too (the
        same passage, or a copy of it): left out of b's negatives. The diagonal is never left out.
    """
    hard = jnp.where(candidate_is_gold, -jnp.inf, doc_scores)  # -> [B, K]
    b = in_batch_scores.shape[0]
    others = ~jnp.eye(b, dtype=bool)
    if in_batch_duplicate is not None:  # another question's gold that is this one's passage
        in_batch_scores = jnp.where(in_batch_duplicate & others, -jnp.inf, in_batch_scores)
    logits = jnp.concatenate([in_batch_scores, hard], axis=-1) / score_temperature
    own = jnp.diagonal(in_batch_scores) / score_temperature  # [B]
    return jax.nn.logsumexp(logits, axis=-1) - own


_BY_READER_SCORE = {"pdist": pdist, "loop": loop, "loop_weighted": loop_weighted}


def retriever_loss(
    objective: RetrieverObjective,
    doc_scores: jax.Array,
    token_logprobs: jax.Array,
    scored: jax.Array,
    variant: str,
) -> jax.Array:
    """[B] the retriever's loss per question; its gradient reaches only `doc_scores`.

    Args:
      objective: which objective, its temperatures and the reader's score.
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
    tau_s = objective.score_temperature
    if objective.loss == "gold":
        raise ValueError("the gold objective reads gold passages, not the reader: use gold()")
    if objective.loss == "marginal":
        return rag_math.nll_from_token_logprobs(token_logprobs, doc_scores / tau_s, scored, variant)
    if objective.loss == "emdr2_token":
        return emdr2_token(doc_scores, token_logprobs, scored, tau_s)
    loglik = sequence_loglik(token_logprobs, scored)
    if objective.loss == "emdr2":
        return emdr2(doc_scores, loglik, tau_s)
    answer_tokens = scored.sum(axis=-1) if objective.lm_score == "mean" else None  # -> [B]
    fn = _BY_READER_SCORE[objective.loss]
    return fn(doc_scores, loglik, objective.lm_temperature, tau_s, answer_tokens)
