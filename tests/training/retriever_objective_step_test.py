"""The joint step with the retriever's own objective (`train.retriever_*`): K candidates, the
generator's loss RAG's marginal over the first N, the retriever's over all K, each reaching only
its own half; for BART and a causal generator, trained or frozen, from logits or the memo."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rag_jax import rag
from rag_jax.models import bart, bert, llama
from rag_jax.retriever_losses import RetrieverObjective
from rag_jax.training import memo, step

B, N, K, S, T, Q, D = 2, 3, 5, 12, 4, 5, 8
TAU_G, TAU_S = 0.6, 1.5
TOWERS = ("question_encoder",)


def _q_cfg():
    return bert.BertConfig(
        vocab_size=17, hidden_size=D, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=8, max_position_embeddings=8, initializer_range=0.3,
    )  # fmt: skip


def _setup(kind: str):
    rng = np.random.default_rng(0)
    if kind == "causal":
        g_cfg = llama.LlamaConfig(
            vocab_size=29, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            tie_word_embeddings=True, eos_token_id=2, pad_token_id=0, init_std=0.3,
        )  # fmt: skip
        cfg = rag.RagConfig(question_encoder=_q_cfg(), generator=g_cfg, n_docs=N, bos_token_id=None)
        labels = np.zeros((B, T), np.int32)
        labels[:, :2] = rng.integers(3, 29, size=(B, 2))
        labels[0, 2], labels[1, 2:] = 5, 2  # answers of 3 and 2 tokens, then EOS
        labels[0, 3] = 2
    else:
        g_cfg = bart.BartConfig(
            vocab_size=29, d_model=16, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=24,
            decoder_ffn_dim=24, max_position_embeddings=32, dropout=0.0, init_std=0.3,
            pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
        )  # fmt: skip
        # The BOS scored (exclude_bos_score=False), as `rag.doc_posteriors` scores it.
        cfg = rag.RagConfig(question_encoder=_q_cfg(), generator=g_cfg, n_docs=N)
        labels = np.full((B, T + 1), 1, np.int32)
        labels[:, 0], labels[:, 1] = 2, 0  # decoder start, BOS
        labels[:, 2:4] = rng.integers(3, 29, size=(B, 2))
        labels[:, 4] = 2
    params = rag.init_params(cfg, jax.random.PRNGKey(0))
    lengths = rng.integers(5, S + 1, size=(B * K, 1))
    mask = (np.arange(S)[None] < lengths).astype(np.int32)  # left-aligned, as the store writes
    batch = {
        "question_input_ids": jnp.asarray(rng.integers(1, 17, size=(B, Q)), jnp.int32),
        "question_attention_mask": jnp.ones((B, Q), jnp.int32),
        "doc_vectors": jnp.asarray(rng.normal(size=(B, K, D)), jnp.float32),
        "context_input_ids": jnp.asarray(
            (rng.integers(3, 29, size=(B * K, S)) * mask + (1 - mask) * g_cfg.pad_token_id)
            .reshape(B, K, S)
            .astype(np.int32)
        ),
        "context_attention_mask": jnp.asarray(mask.reshape(B, K, S)),
        "labels": jnp.asarray(labels),
    }
    return cfg, params, batch


def _close(a, b):
    """Whole-model gradients of two differently compiled programs: the model tolerance (1e-4),
    an element near 0 held to 1e-5 of the largest."""
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.max(np.abs(b))))


def _loss_grads(cfg, objective, frozen, batch, params):
    loss_fn = step.joint_loss_fn(cfg, "sequence", frozen=frozen, objective=objective)
    return jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, b, None)[0]))(params, batch)


def _first(batch, n):
    return {k: v[:, :n] if v.ndim == 3 or k == "doc_vectors" else v for k, v in batch.items()}


def _flat(batch):
    return {k: v.reshape(-1, v.shape[-1]) if k.startswith("context") else v
            for k, v in batch.items()}  # fmt: skip


def _reader_posterior_logits(cfg, params, batch):
    """[B, K] `log p(z|x, y)` with equal doc scores: the reader's log-likelihood of each
    candidate up to a per-question constant, by `rag.doc_posteriors` (another path than the
    step's)."""
    flat = _flat(batch)
    posterior, _ = rag.doc_posteriors(
        cfg.replace(n_docs=K), params, flat["context_input_ids"], flat["context_attention_mask"],
        jnp.zeros((B, K)), batch["labels"],
    )  # fmt: skip
    return jnp.log(posterior)


def _reference_question_grads(cfg, params, batch, loss):
    """The question encoder's gradient of the objective alone, the reader's side from
    `rag.doc_posteriors`."""
    ll = _reader_posterior_logits(cfg, params, batch)  # constant up to a shift per question

    def objective(q_params):
        p = dict(params, question_encoder=q_params)
        q = rag.question_embeddings(cfg, p, batch["question_input_ids"],
                                    batch["question_attention_mask"])  # fmt: skip
        log_q = jax.nn.log_softmax(rag.doc_scores(q, batch["doc_vectors"]) / TAU_S, axis=-1)
        if loss == "emdr2":
            return -jnp.mean(jax.nn.logsumexp(log_q + ll, axis=-1))
        target = jax.nn.softmax(ll / TAU_G, axis=-1)
        return jnp.mean(jnp.sum(target * (jnp.log(target) - log_q), axis=-1))

    return jax.grad(objective)(params["question_encoder"])


@pytest.mark.parametrize("kind", ["causal", "bart"])
@pytest.mark.parametrize("loss", ["pdist", "emdr2"])
def test_each_loss_reaches_only_its_own_half(kind, loss):
    cfg, params, batch = _setup(kind)
    objective = RetrieverObjective(loss, K, lm_temperature=TAU_G, score_temperature=TAU_S)
    frozen = "^passage_encoder/"
    (_, grads) = _loss_grads(cfg, objective, frozen, batch, params)
    # The generator's: RAG's marginal over the first N candidates, as the default step has it.
    default = step.joint_loss_fn(cfg, "sequence", frozen=frozen)
    want = jax.grad(lambda p: default(p, _first(batch, N), None)[0])(params)
    jax.tree.map(
        _close,
        grads["generator"], want["generator"],
    )  # fmt: skip
    # The question encoder's: the objective over all K, the reader a constant.
    ref = _reference_question_grads(cfg, params, batch, loss)
    assert max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(ref)) > 1e-4
    jax.tree.map(
        _close,
        grads["question_encoder"], ref,
    )  # fmt: skip


def test_the_memo_path_equals_the_logits_path_for_a_frozen_causal_generator():
    cfg, params, batch = _setup("causal")
    objective = RetrieverObjective("loop", K, lm_temperature=TAU_G, score_temperature=TAU_S)
    frozen = "^(passage_encoder/|generator/)"
    flat = _flat(batch)
    labels = jnp.repeat(batch["labels"], K, axis=0)  # -> [B * K, T]
    lp = memo.pair_logprobs(cfg, params["generator"], flat["context_input_ids"],
                            flat["context_attention_mask"], labels)  # fmt: skip
    memo_batch = {k: v for k, v in batch.items() if not k.startswith("context")}
    memo_batch["answer_logprobs"] = lp.reshape(B, K, T)
    loss_logits, g_logits = _loss_grads(cfg, objective, frozen, batch, params)
    loss_memo, g_memo = _loss_grads(cfg, objective, frozen, memo_batch, params)
    np.testing.assert_allclose(loss_memo, loss_logits, rtol=1e-5)
    jax.tree.map(
        _close,
        g_memo["question_encoder"], g_logits["question_encoder"],
    )  # fmt: skip
    assert not any(np.any(x) for x in jax.tree.leaves(g_memo["generator"]))


def test_the_default_objective_is_rags_one_loss():
    """retriever_loss=marginal over N candidates: the step's loss and gradients are those of
    `rag.loss_fn`, bitwise (the objective adds nothing)."""
    cfg, params, batch = _setup("causal")
    batch = _first(batch, N)
    loss, grads = _loss_grads(cfg, RetrieverObjective(), "^passage_encoder/", batch, params)
    want_loss, want = jax.jit(
        jax.value_and_grad(lambda p: rag.loss_fn(cfg, p, _flat(batch), "sequence")[0])
    )(params)
    np.testing.assert_array_equal(loss, want_loss)
    jax.tree.map(np.testing.assert_array_equal, grads["question_encoder"], want["question_encoder"])


def test_gold_under_a_frozen_generator_reads_no_reader():
    """The gold objective with the generator frozen: a batch without contexts or likelihoods
    (what the batcher sends) gives the question encoder the gradient of DPR's loss alone, by
    `retriever_losses.gold` on its own; the generator's loss, which trains nothing, is left out.
    Any other objective refuses such a batch."""
    cfg, params, batch = _setup("causal")
    rng = np.random.default_rng(3)
    gold = dict(
        gold_vectors=jnp.asarray(rng.normal(size=(B, D)), jnp.float32),
        candidate_is_gold=jnp.asarray([[False, True, False, False, False], [False] * K]),
    )
    frozen = "^(passage_encoder/|generator/)"
    objective = RetrieverObjective("gold", K, score_temperature=TAU_S)
    bare = {k: v for k, v in batch.items() if not k.startswith("context")} | gold
    loss, grads = _loss_grads(cfg, objective, frozen, bare, params)

    def dpr(q_params):
        p = dict(params, question_encoder=q_params)
        q = rag.question_embeddings(cfg, p, batch["question_input_ids"],
                                    batch["question_attention_mask"])  # fmt: skip
        in_batch = q @ gold["gold_vectors"].T  # -> [B, B]
        hard = jnp.where(gold["candidate_is_gold"], -jnp.inf,
                         jnp.einsum("bd,bkd->bk", q, batch["doc_vectors"]))  # fmt: skip
        logits = jnp.concatenate([in_batch, hard], axis=1) / TAU_S
        return -jnp.mean(jnp.diagonal(jax.nn.log_softmax(logits, axis=-1)))

    want_loss, want = jax.value_and_grad(dpr)(params["question_encoder"])
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(want)) > 1e-4
    jax.tree.map(_close, grads["question_encoder"], want)
    # With the contexts, the same gradient (the generator's loss adds none to the tower).
    _, with_reader = _loss_grads(cfg, objective, frozen, batch | gold, params)
    jax.tree.map(_close, grads["question_encoder"], with_reader["question_encoder"])
    with pytest.raises(ValueError, match="'pdist' objective reads the reader"):
        _loss_grads(cfg, RetrieverObjective("pdist", K), frozen, bare, params)


@pytest.mark.parametrize("loss", ["marginal", "pdist"])
def test_the_cut_control_reaches_no_tower_and_leaves_the_generator_as_it_was(loss):
    """`train.retriever_cut_gradient`: the retriever's towers get no gradient from the loss (RAG's
    marginal or an objective of its own), the generator exactly the gradient it gets without the
    cut, and the loss is unchanged."""
    cfg, params, batch = _setup("bart")
    candidates = N if loss == "marginal" else K
    batch = _first(batch, candidates)
    kwargs = dict(lm_temperature=TAU_G, score_temperature=TAU_S if loss != "marginal" else 1.0)
    frozen = "^passage_encoder/"
    loss_on, grads_on = _loss_grads(cfg, RetrieverObjective(loss, candidates, **kwargs), frozen,
                                    batch, params)  # fmt: skip
    cut = RetrieverObjective(loss, candidates, **kwargs, cut_gradient=True)
    loss_cut, grads_cut = _loss_grads(cfg, cut, frozen, batch, params)
    np.testing.assert_allclose(loss_cut, loss_on, rtol=1e-6)
    assert any(np.any(x) for x in jax.tree.leaves(grads_on["question_encoder"]))
    assert not any(np.any(x) for x in jax.tree.leaves(grads_cut["question_encoder"]))
    jax.tree.map(_close, grads_cut["generator"], grads_on["generator"])
