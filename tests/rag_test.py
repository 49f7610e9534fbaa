"""rag_jax.rag against transformers' RagSequenceForGeneration / RagTokenForGeneration.

Both HF models are built locally from tiny random DPR + BART configs (weights std 0.3), saved with
`save_pretrained` and loaded with `hf.load_rag`, so the checkpoint conversion is under test too.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import hf_fixtures
from rag_jax import rag
from rag_jax.io import hf

B, N, S, T, Q = 2, 3, 9, 6, 5
# Settings passed identically to HF generate and to rag.generate (BART-large style forcing).
GEN = dict(
    max_length=9,
    min_length=3,
    length_penalty=0.8,
    early_stopping=False,
    no_repeat_ngram_size=2,
    forced_bos_token_id=0,
    forced_eos_token_id=2,
)
HF_IDS = dict(decoder_start_token_id=2, eos_token_id=2, pad_token_id=1, bos_token_id=0)


def save_rag(path, variant, seed=0, **rag_kwargs):
    question = transformers.DPRConfig(**hf_fixtures.bert_config(projection_dim=8).to_dict())
    generator = hf_fixtures.bart_config(forced_bos_token_id=0)
    config = transformers.RagConfig.from_question_encoder_generator_configs(
        question, generator, n_docs=N, **rag_kwargs
    )
    cls = {
        "sequence": transformers.RagSequenceForGeneration,
        "token": transformers.RagTokenForGeneration,
    }[variant]
    model = hf_fixtures.randomize_(cls(config), seed)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=["sequence", "token"])
def models(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"rag_{request.param}")
    torch_model = save_rag(path, request.param, seed=11)
    cfg, params = hf.load_rag(path)
    return request.param, torch_model, cfg, params


def inputs(cfg, seed=0, bos=True, pad_labels=True):
    rng = np.random.default_rng(seed)
    vocab = cfg.generator.vocab_size
    ctx, ctx_mask = hf_fixtures.padded_batch(
        rng, rng.integers(3, S + 1, B * N).tolist(), vocab, pad=1
    )
    ctx, ctx_mask = ctx[:, :S], ctx_mask[:, :S]
    q_ids, q_mask = hf_fixtures.padded_batch(rng, [Q, 3], cfg.question_encoder.vocab_size)
    doc_vectors = rng.normal(size=(B, N, cfg.question_encoder.embedding_dim)).astype(np.float32)
    labels = rng.integers(3, vocab, size=(B, T))
    labels[:, 0] = 2  # decoder start
    if bos:
        labels[:, 1] = 0
    if pad_labels:
        labels[1, T - 2 :] = 1
    doc_scores = rng.normal(size=(B, N)).astype(np.float32) * 2
    return dict(
        context_input_ids=ctx,
        context_attention_mask=ctx_mask,
        question_input_ids=q_ids,
        question_attention_mask=q_mask,
        doc_vectors=doc_vectors,
        doc_scores=doc_scores,
        labels=labels,
    )


def torch_nll(model, x, reduce, exclude_bos, epsilon):
    model.config.label_smoothing = epsilon
    kwargs = dict(
        context_input_ids=torch.tensor(x["context_input_ids"]),
        context_attention_mask=torch.tensor(x["context_attention_mask"]),
        doc_scores=torch.tensor(x["doc_scores"]),
        labels=torch.tensor(x["labels"]),
        reduce_loss=reduce,
    )
    if isinstance(model, transformers.RagSequenceForGeneration):
        kwargs["exclude_bos_score"] = exclude_bos
    with torch.no_grad():
        return model(**kwargs).loss.numpy()


@pytest.mark.parametrize("epsilon", [0.0, 0.1])
@pytest.mark.parametrize("reduce", [False, True])
@pytest.mark.parametrize("exclude_bos", [False, True])
def test_nll_matches_hf(models, epsilon, reduce, exclude_bos):
    variant, torch_model, cfg, params = models
    if variant == "token" and exclude_bos:
        pytest.skip(reason="exclude_bos_score is a RAG-Sequence option only")
    x = inputs(cfg, seed=1)
    ref = torch_nll(torch_model, x, reduce, exclude_bos, epsilon)
    ours = rag.nll(
        cfg.replace(label_smoothing=epsilon),
        params,
        x["context_input_ids"],
        x["context_attention_mask"],
        x["doc_scores"],
        x["labels"],
        variant,
        reduce=reduce,
        exclude_bos_score=exclude_bos if variant == "sequence" else None,
    )
    assert ours.shape == (() if reduce else (B,))
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)
    assert np.all(np.abs(ref) > 0.1)


def test_loss_without_bos_matches_hf(models):
    variant, torch_model, cfg, params = models
    x = inputs(cfg, seed=2, bos=False, pad_labels=False)
    ref = torch_nll(torch_model, x, False, True, 0.0)
    ours = rag.nll(
        cfg,
        params,
        x["context_input_ids"],
        x["context_attention_mask"],
        x["doc_scores"],
        x["labels"],
        variant,
        exclude_bos_score=True if variant == "sequence" else None,
    )
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)


def _torch_grads(torch_model, x):
    torch_model.zero_grad(set_to_none=True)
    torch_model.config.label_smoothing = 0.0
    q = torch_model.rag.question_encoder(
        torch.tensor(x["question_input_ids"]),
        attention_mask=torch.tensor(x["question_attention_mask"]),
    )[0]
    scores = torch.bmm(q.unsqueeze(1), torch.tensor(x["doc_vectors"]).transpose(1, 2)).squeeze(1)
    out = torch_model(
        context_input_ids=torch.tensor(x["context_input_ids"]),
        context_attention_mask=torch.tensor(x["context_attention_mask"]),
        doc_scores=scores,
        labels=torch.tensor(x["labels"]),
        reduce_loss=False,
    )
    out.loss.mean().backward()
    return {n: p.grad.numpy() for n, p in torch_model.named_parameters() if p.grad is not None}


_KEY_BIASES = ("k_proj.bias", "attention.self.key.bias")


def test_gradients_match_torch_autograd(models):
    variant, torch_model, cfg, params = models
    x = inputs(cfg, seed=3)
    ref = _torch_grads(torch_model, x)  # eval mode: autograd without dropout
    batch = {k: jnp.asarray(v) for k, v in x.items() if k != "doc_scores"}
    loss_fn = functools.partial(rag.loss_fn, cfg, variant=variant)
    grads = jax.jit(jax.grad(lambda p: loss_fn(p, batch)[0]))(params)

    q_prefix = "rag.question_encoder.question_encoder.bert_model."
    names = {
        "question_encoder": lambda o: hf.bert_name(o, q_prefix),
        "generator": lambda o: hf.bart_name(o, "rag.generator.model."),
    }
    global_scale = max(float(np.abs(v).max()) for v in ref.values())
    checked = 0
    for half, name_of in names.items():
        flat = jax.tree_util.tree_leaves_with_path(grads[half])
        for path, g in flat:
            ours_name = "/".join(p.key for p in path)
            name = name_of(ours_name)
            if name == "rag.generator.final_logits_bias":
                continue  # a buffer in torch, never trained
            expected = ref[name]
            g = np.asarray(g)
            if ours_name.endswith("kernel"):
                g = g.T
            if name.endswith(_KEY_BIASES):
                # Softmax is invariant to the key bias (it adds q . b_k to a whole row of
                # scores): its true gradient is 0, and torch's float32 value is rounding noise
                # (~1e-7), so both must be 0 to that rounding of the model's gradient scale.
                zero = 1e-6 * global_scale
                np.testing.assert_allclose(g, 0.0, atol=zero, rtol=0, err_msg=name)
                np.testing.assert_allclose(expected, 0.0, atol=zero, rtol=0, err_msg=name)
            else:
                scale = np.abs(expected).max()
                atol = 1e-4 * scale + 1e-7
                np.testing.assert_allclose(g, expected, atol=atol, rtol=0, err_msg=name)
            checked += 1
    assert checked > 40
    q_grad = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads["question_encoder"]))
    assert q_grad > 1e-4  # the answer loss reaches the retriever


@pytest.mark.parametrize("num_beams", [1, 4])
def test_rag_token_generation_matches_hf(tmp_path, num_beams):
    torch_model = save_rag(tmp_path, "token", seed=5)
    cfg, params = hf.load_rag(tmp_path)
    x = inputs(cfg, seed=4)
    with torch.no_grad():
        ref = torch_model.generate(
            context_input_ids=torch.tensor(x["context_input_ids"]),
            context_attention_mask=torch.tensor(x["context_attention_mask"]),
            doc_scores=torch.tensor(x["doc_scores"]),
            num_beams=num_beams,
            **GEN,
            **HF_IDS,
        ).numpy()
    ours = jax.jit(
        functools.partial(rag.generate, cfg, variant="token", num_beams=num_beams, **GEN)
    )(params, x["context_input_ids"], x["context_attention_mask"], x["doc_scores"])
    _assert_same_tokens(ours, ref, pad=1)


@pytest.mark.parametrize("masked", [False, True])
def test_rag_sequence_thorough_generation_matches_hf(tmp_path, masked):
    torch_model = save_rag(tmp_path, "sequence", seed=6)
    cfg, params = hf.load_rag(tmp_path)
    x = inputs(cfg, seed=5)
    if masked:
        # HF generates candidates without the context mask; with unpadded contexts the two agree.
        x["context_attention_mask"] = np.ones_like(x["context_attention_mask"])
        x["context_input_ids"] = np.where(x["context_input_ids"] == 1, 7, x["context_input_ids"])
    with torch.no_grad():
        ref = torch_model.generate(
            context_input_ids=torch.tensor(x["context_input_ids"]),
            context_attention_mask=torch.tensor(x["context_attention_mask"]),
            doc_scores=torch.tensor(x["doc_scores"]),
            num_beams=4,
            do_deduplication=True,
            **GEN,
            **HF_IDS,
        ).numpy()
    ours = jax.jit(
        functools.partial(
            rag.generate,
            cfg,
            variant="sequence",
            num_beams=4,
            mask_candidate_contexts=masked,
            **GEN,
        )
    )(params, x["context_input_ids"], x["context_attention_mask"], x["doc_scores"])
    _assert_same_tokens(ours, ref, pad=1)


def _assert_same_tokens(ours, ref, pad):
    ours = np.asarray(ours)
    assert ours.shape[0] == ref.shape[0]
    width = max(ours.shape[1], ref.shape[1])
    pad_to = lambda a: np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=pad)  # noqa: E731
    np.testing.assert_array_equal(pad_to(ours), pad_to(ref))


def test_fast_decoding_returns_beam_hypotheses(models):
    variant, _, cfg, params = models
    if variant != "sequence":
        pytest.skip(reason="fast decoding is a RAG-Sequence mode")
    x = inputs(cfg, seed=6)
    args = (x["context_input_ids"], x["context_attention_mask"], x["doc_scores"])
    generate = jax.jit(
        rag.generate,
        static_argnums=0,
        static_argnames=("variant", "sequence_decoding", "num_beams", "num_return_sequences", *GEN),
    )
    fast = generate(cfg, params, *args, variant="sequence", sequence_decoding="fast", **GEN)
    per_doc = generate(
        cfg, params, *args, variant="sequence", num_return_sequences=4, num_beams=4, **GEN
    )
    assert fast.shape == (B, GEN["max_length"])
    # Every fast answer is one of the thorough candidates (a beam hypothesis of some doc).
    for b in range(B):
        assert any(np.array_equal(fast[b], c) for c in np.asarray(per_doc[b]))


def test_bad_shapes_name_both(models):
    variant, _, cfg, params = models
    x = inputs(cfg)
    with pytest.raises(ValueError, match=r"context_input_ids \(6, \d+\).*doc_scores \(2, 2\)"):
        rag.nll(
            cfg.replace(n_docs=2),
            params,
            x["context_input_ids"],
            x["context_attention_mask"],
            x["doc_scores"][:, :2],
            x["labels"],
            variant,
        )
    long = np.full((B, cfg.generator.max_position_embeddings + 1), 5)
    with pytest.raises(ValueError, match=r"labels \(2, 25\).*max_position_embeddings=24"):
        rag.nll(
            cfg,
            params,
            x["context_input_ids"],
            x["context_attention_mask"],
            x["doc_scores"],
            long,
            variant,
        )
    with pytest.raises(ValueError, match="variant"):
        rag.nll(
            cfg,
            params,
            x["context_input_ids"],
            x["context_attention_mask"],
            x["doc_scores"],
            x["labels"],
            "thorough",
        )


def test_labels_take_hfs_ignore_index_and_refuse_other_ids_outside_the_vocabulary(models):
    """-100 (HF's ignore index) after a label's end is read as pad: the same loss as pad-padded
    labels, equal to HF's. An id outside the vocabulary is refused naming its position (or, under
    the caller's jit, gives that example a NaN loss instead of a finite, wrong one)."""
    variant, torch_model, cfg, params = models
    x = inputs(cfg, seed=20)
    args = (cfg, params, x["context_input_ids"], x["context_attention_mask"], x["doc_scores"])
    padded = rag.nll(*args, x["labels"], variant)
    ignored = np.where(x["labels"] == cfg.pad_token_id, rag.IGNORE_INDEX, x["labels"])
    assert (ignored == rag.IGNORE_INDEX).any()
    np.testing.assert_allclose(rag.nll(*args, ignored, variant), padded, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(padded, torch_nll(torch_model, x, False, False, 0.0), atol=1e-4)
    for bad in (-5, cfg.generator.vocab_size, 10**6):
        labels = x["labels"].copy()
        labels[1, 3] = bad
        with pytest.raises(ValueError, match=rf"labels\[1, 3\] = {bad} is outside the gen"):
            rag.nll(*args, labels, variant)
        traced = jax.jit(lambda lab: rag.nll(*args, lab, variant))(labels)  # noqa: B023
        assert np.isnan(traced[1]) and np.isfinite(traced[0])


def test_loss_fn_honours_reduce_loss(models):
    variant, _, cfg, params = models
    x = inputs(cfg, seed=21)
    batch = {k: jnp.asarray(v) for k, v in x.items() if k != "doc_scores"}
    batch["weights"] = jnp.asarray([1.0, 0.5])
    mean, aux = rag.loss_fn(cfg, params, batch, variant)
    total, _ = rag.loss_fn(cfg.replace(reduce_loss=True), params, batch, variant)
    weighted = np.sum(np.asarray(aux["nll"]) * [1.0, 0.5])
    np.testing.assert_allclose(total, weighted, rtol=1e-6)
    np.testing.assert_allclose(mean, weighted / 1.5, rtol=1e-6)


def test_doc_score_scale_multiplies_the_scores_the_likelihood_reads(models):
    """p(z|x) = softmax(scale * q . d): the loss equals `nll` given the scaled scores."""
    variant, _, cfg, params = models
    x = inputs(cfg, seed=22)
    batch = {k: jnp.asarray(v) for k, v in x.items() if k != "doc_scores"}
    scaled = cfg.replace(doc_score_scale=20.0)
    loss, aux = rag.loss_fn(scaled, params, batch, variant)
    q = rag.question_embeddings(
        cfg, params, batch["question_input_ids"], batch["question_attention_mask"]
    )
    want_scores = 20.0 * np.einsum("bd,bnd->bn", np.asarray(q), np.asarray(batch["doc_vectors"]))
    np.testing.assert_allclose(aux["doc_scores"], want_scores, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        rag.doc_scores(q, batch["doc_vectors"], 20.0), want_scores, rtol=1e-5, atol=1e-5
    )
    per_example = rag.nll(
        cfg,
        params,
        batch["context_input_ids"],
        batch["context_attention_mask"],
        jnp.asarray(want_scores, jnp.float32),
        batch["labels"],
        variant,
        reduce=False,
    )
    np.testing.assert_allclose(loss, np.mean(per_example), rtol=1e-5)
    unscaled, _ = rag.loss_fn(cfg, params, batch, variant)
    assert abs(float(unscaled) - float(loss)) > 1e-3  # the scale changes p(z|x)


def _log_softmax(x, axis):
    x = x - x.max(axis=axis, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=axis, keepdims=True))


def test_doc_posteriors_match_numpy_on_hf_per_doc_likelihoods(models):
    """p(z|x, y) and RAG-Token's p(z|x, y_<=t), in numpy from HF's per-doc generator logits."""
    variant, torch_model, cfg, params = models
    x = inputs(cfg, seed=7)
    with torch.no_grad():
        out = torch_model(
            context_input_ids=torch.tensor(x["context_input_ids"]),
            context_attention_mask=torch.tensor(x["context_attention_mask"]),
            doc_scores=torch.tensor(x["doc_scores"]),
            labels=torch.tensor(x["labels"]),
        )
    logits = out.logits.numpy().astype(np.float64)  # -> [B * N, T, V], one row per doc
    assert logits.shape[0] == B * N
    target = np.concatenate([x["labels"][:, 1:], np.full((B, 1), 1)], axis=1)  # pad = 1
    logprobs = _log_softmax(logits, -1).reshape(B, N, T, -1)
    per_doc = np.take_along_axis(logprobs, target[:, None, :, None], axis=-1)[..., 0]  # [B, N, T]
    scored = target != 1  # [B, T]
    per_doc = np.where(scored[:, None, :], per_doc, 0.0)
    prior = _log_softmax(x["doc_scores"].astype(np.float64), 1)  # [B, N]
    want = np.exp(_log_softmax(prior + per_doc.sum(axis=2), 1))
    want_tokens = np.exp(_log_softmax(prior[:, :, None] + per_doc, 1)).transpose(0, 2, 1)
    want_tokens = np.where(scored[:, :, None], want_tokens, 0.0)  # -> [B, T, N]

    posterior, tokens = rag.doc_posteriors(
        cfg,
        params,
        x["context_input_ids"],
        x["context_attention_mask"],
        x["doc_scores"],
        x["labels"],
    )
    assert posterior.shape == (B, N) and tokens.shape == (B, T, N)
    np.testing.assert_allclose(posterior, want, rtol=0, atol=1e-4)
    np.testing.assert_allclose(tokens, want_tokens, rtol=0, atol=1e-4)
    # Not the prior in disguise: the answer moves the weights, and differently per token.
    assert np.abs(want - np.exp(prior)).max() > 0.05
    assert np.abs(want_tokens[:, 0] - want_tokens[:, 1]).max() > 0.05
    np.testing.assert_allclose(np.asarray(tokens).sum(-1), scored.astype(float), atol=1e-5)
