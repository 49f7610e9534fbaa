"""RAG with a causal generator against per-passage likelihoods of transformers' LlamaForCausalLM.

The reference never runs our model: for each (question, passage) it feeds HF's model the prompt's
real tokens followed by the answer, takes the answer tokens' log-probabilities, and marginalises
over passages in numpy (RAG-Sequence: the prior once per sequence; RAG-Token: per token).
RAG-Sequence candidates are compared with HF `generate` on each prompt alone, and the cached
decoding (prompt prefix shared by the beams) with a search that recomputes the whole sequence with
HF at every step.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import hf_fixtures
from rag_jax import decoding, rag, rag_math
from rag_jax.io import hf
from rag_jax.models import bert

B, N, S, T = 2, 3, 8, 5
V, PAD, EOS = 37, 0, 2


@pytest.fixture(scope="module", params=["pad", "pad_is_eos"])
def model(request, tmp_path_factory):
    """(RagConfig, params, HF model) with a tiny GQA Llama generator; pad = 0 or pad = EOS."""
    pad = EOS if request.param == "pad_is_eos" else PAD
    path = tmp_path_factory.mktemp(request.param)
    torch_model = hf_fixtures.save_llama(path, pad_token_id=pad)
    g_cfg, g_params = hf.load_llama(path)
    q_cfg = bert.BertConfig(
        vocab_size=11,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=8,
    )
    cfg = rag.RagConfig(question_encoder=q_cfg, generator=g_cfg, n_docs=N, bos_token_id=None)
    params = rag.init_params(cfg, jax.random.PRNGKey(0))
    params["generator"] = g_params
    return cfg, params, torch_model


def _batch(cfg, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, S + 1, size=B * N)
    lengths[0] = S
    ids, mask = hf_fixtures.left_padded_batch(rng, lengths, V, pad=cfg.pad_token_id)
    answer_lengths = [T - 1, 2]
    labels = np.full((B, T), cfg.pad_token_id, np.int64)
    for b, n in enumerate(answer_lengths):
        labels[b, :n] = rng.integers(3, V, size=n)
        labels[b, n] = EOS
    scores = rng.normal(size=(B, N)).astype(np.float32) * 2
    return ids, mask, labels, scores


def _hf_answer_logprobs(torch_model, ids, mask, labels):
    """[B, N, T, V] log p(. | prompt, answer prefix) of every answer position, from HF alone,
    and the [B, T] scored positions (answer tokens up to and including EOS)."""
    out = np.zeros((B, N, T, V), np.float64)
    for b in range(B):
        for n in range(N):
            row = b * N + n
            prompt = ids[row][mask[row] == 1]
            seq = np.concatenate([prompt, labels[b]])
            with torch.no_grad():
                logits = torch_model(input_ids=torch.tensor(seq[None])).logits[0].double()
            lp = torch.log_softmax(logits, -1).numpy()
            out[b, n] = lp[len(prompt) - 1 : len(prompt) - 1 + T]
    scored = np.zeros((B, T), bool)
    for b in range(B):
        end = int(np.argmax(labels[b] == EOS))
        scored[b, : end + 1] = True
    return out, scored


def _reference_nll(lp, scored, labels, doc_scores, variant, epsilon=0.0):
    prior = doc_scores - np.logaddexp.reduce(doc_scores, axis=1, keepdims=True)  # [B, N]
    tok = np.take_along_axis(lp, labels[:, None, :, None], axis=-1)[..., 0]  # [B, N, T]
    if variant == "sequence":
        ll = prior + np.where(scored[:, None], tok, 0).sum(-1)
        nll = -np.logaddexp.reduce(ll, axis=1)
        smooth_z = np.where(scored[:, None], lp.sum(-1), 0).sum(-1) + V * prior
        smooth = -np.logaddexp.reduce(smooth_z, axis=1)
    else:
        mix = np.logaddexp.reduce(lp + prior[:, :, None, None], axis=1)  # [B, T, V]
        tok_mix = np.take_along_axis(mix, labels[:, :, None], axis=-1)[..., 0]
        nll = -np.where(scored, tok_mix, 0).sum(-1)
        smooth = -np.where(scored, mix.sum(-1), 0).sum(-1)
    return (1 - epsilon) * nll + epsilon / V * smooth


@pytest.mark.parametrize("variant", ["sequence", "token"])
@pytest.mark.parametrize("epsilon", [0.0, 0.1])
def test_nll_equals_marginal_of_hf_per_passage_likelihoods(model, variant, epsilon):
    cfg, params, torch_model = model
    cfg = cfg.replace(label_smoothing=epsilon)
    ids, mask, labels, scores = _batch(cfg)
    lp, scored = _hf_answer_logprobs(torch_model, ids, mask, labels)
    want = _reference_nll(lp, scored, labels, scores, variant, epsilon)
    got = rag.nll(cfg, params, ids, mask, scores, labels, variant=variant)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
    # HF's ignore index in place of padding changes nothing.
    ignored = np.where(np.arange(T)[None] > np.argmax(labels == EOS, 1)[:, None], -100, labels)
    got = rag.nll(cfg, params, ids, mask, scores, ignored, variant=variant)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_doc_score_gradient_equals_finite_differences_of_the_reference(model):
    cfg, params, torch_model = model
    ids, mask, labels, scores = _batch(cfg, seed=1)
    lp, scored = _hf_answer_logprobs(torch_model, ids, mask, labels)
    grad = jax.grad(lambda s: rag.nll(cfg, params, ids, mask, s, labels, reduce=True))(
        jnp.asarray(scores)
    )
    eps = 1e-3
    for b, n in [(0, 0), (1, 2)]:
        up, down = scores.astype(np.float64).copy(), scores.astype(np.float64).copy()
        up[b, n] += eps
        down[b, n] -= eps
        fd = (
            _reference_nll(lp, scored, labels, up, "sequence").sum()
            - _reference_nll(lp, scored, labels, down, "sequence").sum()
        ) / (2 * eps)
        np.testing.assert_allclose(float(grad[b, n]), fd, rtol=1e-3, atol=1e-4)


def test_doc_posteriors_equal_the_reference(model):
    cfg, params, torch_model = model
    ids, mask, labels, scores = _batch(cfg, seed=2)
    lp, scored = _hf_answer_logprobs(torch_model, ids, mask, labels)
    prior = scores - np.logaddexp.reduce(scores, axis=1, keepdims=True)
    tok = np.where(scored[:, None], np.take_along_axis(lp, labels[:, None, :, None], -1)[..., 0], 0)
    want = np.exp(prior + tok.sum(-1))
    want /= want.sum(1, keepdims=True)
    per_token = np.exp(prior[:, :, None] + tok)
    per_token = np.where(scored[:, None], per_token / per_token.sum(1, keepdims=True), 0)
    post, tokens = rag.doc_posteriors(cfg, params, ids, mask, scores, labels)
    np.testing.assert_allclose(np.asarray(post), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(tokens), per_token.transpose(0, 2, 1), atol=1e-5)


def test_right_padded_prompts_score_as_left_padded_and_holes_are_refused(model):
    cfg, params, _ = model
    ids, mask, labels, scores = _batch(cfg)
    right_ids, right_mask = ids.copy(), mask.copy()
    for r in range(ids.shape[0]):  # the store's layout: real tokens first
        n = mask[r].sum()
        right_ids[r] = np.concatenate([ids[r][mask[r] == 1], np.full(S - n, cfg.pad_token_id)])
        right_mask[r] = np.arange(S) < n
    for variant in ("sequence", "token"):
        want = rag.nll(cfg, params, ids, mask, scores, labels, variant=variant)
        got = rag.nll(cfg, params, right_ids, right_mask, scores, labels, variant=variant)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    want = rag.generate(cfg, params, ids, mask, scores, variant="token", max_length=3)
    got = rag.generate(cfg, params, right_ids, right_mask, scores, variant="token", max_length=3)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    holed = mask.copy()
    holed[1, -2] = 0
    with pytest.raises(ValueError, match="row 1 is"):
        rag.nll(cfg, params, ids, holed, scores, labels)


GEN = dict(max_length=5, num_beams=3, length_penalty=0.7, min_length=1)


def _hf_candidates(torch_model, ids, mask, cfg, **settings):
    """HF generate on each prompt alone: [B * N, K, L] new tokens padded with pad."""
    k, length = settings["num_beams"], settings["max_length"]
    out = np.full((B * N, k, length), cfg.pad_token_id, np.int64)
    for row in range(B * N):
        prompt = torch.tensor(ids[row][mask[row] == 1][None])
        with torch.no_grad():
            seqs = torch_model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=length,
                min_new_tokens=settings.get("min_length", 0),
                num_beams=k,
                num_return_sequences=k,
                length_penalty=settings.get("length_penalty", 1.0),
                early_stopping=False,
                do_sample=False,
                eos_token_id=EOS,
                pad_token_id=cfg.pad_token_id,
            )[:, prompt.shape[1] :].numpy()
        out[row, :, : seqs.shape[1]] = seqs
    return _after_eos_padded(out, cfg.pad_token_id)


def _after_eos_padded(seqs, pad):
    """Positions after the first EOS set to pad (HF fills them with EOS when pad is 0)."""
    is_eos = seqs == EOS
    return np.where(np.cumsum(is_eos, -1) - is_eos > 0, pad, seqs)


def test_sequence_candidates_equal_hf_generate_per_prompt_and_rescoring_the_reference(model):
    cfg, params, torch_model = model
    ids, mask, _, scores = _batch(cfg, seed=3)
    beams, length = GEN["num_beams"], GEN["max_length"]
    want = _hf_candidates(torch_model, ids, mask, cfg, **GEN)
    got = rag.generate(
        cfg, params, ids, mask, scores, variant="sequence", num_return_sequences=beams, **GEN
    )  # [B, R, L]: the best R of the N * K candidates
    candidates = want.reshape(B, N * beams, length)
    # Rescoring: the RAG-Sequence NLL of each distinct candidate, from HF per-passage likelihoods.
    for b in range(B):
        seen, losses = [], []
        for c in candidates[b]:
            if any(np.array_equal(c, s) for s in seen):
                continue
            seen.append(c)
            labels = np.stack([c] * B)
            lp, scored = _hf_answer_logprobs(torch_model, ids, mask, labels)
            scored[:] = np.asarray(
                rag.causal.label_mask(jnp.asarray(labels), EOS, cfg.pad_token_id)
            )
            losses.append(_reference_nll(lp, scored, labels, scores, "sequence")[b])
        order = np.argsort(losses, kind="stable")[:beams]
        np.testing.assert_array_equal(np.asarray(got[b]), np.stack([seen[i] for i in order]))


def _hf_recompute_step_fn(torch_model, ids, mask, groups, reps):
    """A search step that runs HF on the whole prompt + prefix every step (no cache)."""
    prompts = [ids[r][mask[r] == 1] for r in range(ids.shape[0])]

    def step(tokens):  # tokens [rows, t] generated so far (slot 0 dropped)
        rows = []
        for r in range(tokens.shape[0]):
            prompt = prompts[(r // (groups * reps)) * reps + r % reps]
            seq = np.concatenate([prompt, tokens[r]]).astype(np.int64)
            with torch.no_grad():
                rows.append(torch_model(input_ids=torch.tensor(seq[None])).logits[0, -1].numpy())
        return np.stack(rows).astype(np.float32)

    return step


@pytest.mark.parametrize("beams", [1, 3])
def test_token_decoding_with_the_cache_equals_recomputation_with_hf(model, beams):
    cfg, params, torch_model = model
    ids, mask, _, scores = _batch(cfg, seed=4)
    length = 4
    got = rag.generate(
        cfg, params, ids, mask, scores, variant="token", num_beams=beams, max_length=length
    )
    hf_step = _hf_recompute_step_fn(torch_model, ids, mask, beams, N)
    beam_scores = jnp.repeat(jnp.asarray(scores), beams, axis=0)

    def step_fn(flat_ids, history, step):
        history = jax.lax.dynamic_update_slice_in_dim(history, flat_ids, step, axis=1)
        generated = jnp.repeat(history, N, axis=0)  # -> [B * K * N, L + 1]
        logits = jax.pure_callback(
            lambda h, s: hf_step(np.asarray(h)[:, 1 : int(s) + 1]),
            jax.ShapeDtypeStruct((generated.shape[0], V), jnp.float32),
            generated,
            step,
        )
        marginal = rag_math.rag_token_marginalize(logits[:, None], beam_scores, N)[:, 0]
        return marginal, history

    history = jnp.zeros((B * beams, length + 1), jnp.int32)
    common = dict(
        batch_size=B,
        max_length=length + 1,
        decoder_start_token_id=cfg.pad_token_id,
        eos_token_id=EOS,
        pad_token_id=cfg.pad_token_id,
    )
    if beams == 1:
        want = decoding.greedy_search(step_fn, history, **common)
    else:
        want = decoding.beam_search(step_fn, history, num_beams=beams, **common).sequences[:, 0]
    want = _after_eos_padded(np.asarray(want)[:, 1:], cfg.pad_token_id)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_fast_decoding_scores_candidates_from_their_beams(model):
    cfg, params, torch_model = model
    ids, mask, _, scores = _batch(cfg, seed=5)
    got = rag.generate(
        cfg, params, ids, mask, scores, variant="sequence", sequence_decoding="fast", **GEN
    )
    candidates = _hf_candidates(torch_model, ids, mask, cfg, **GEN)
    # The answer is the best of its question's per-passage beams by the paper's fast score,
    # `log sum_z p(z|x) p(y|x, z)` with p(y|x, z) from HF's forward pass where y is one of doc
    # z's beams and 0 where it is not.
    prior = np.asarray(jax.nn.log_softmax(jnp.asarray(scores), axis=-1))
    for b in range(B):
        found: dict[tuple, dict[int, float]] = {}
        for z in range(N):
            row = b * N + z
            for c in candidates[row]:
                found.setdefault(tuple(c), {})[z] = _hf_loglik(
                    torch_model, ids[row][mask[row] == 1], c
                )
        fast = {c: np.logaddexp.reduce([prior[b, z] + ll for z, ll in lls.items()])
                for c, lls in found.items()}  # fmt: skip
        ranked = sorted(fast, key=fast.get, reverse=True)
        assert fast[ranked[0]] - fast[ranked[1]] > 1e-4  # a clear best: the test can tell
        np.testing.assert_array_equal(np.asarray(got[b]), np.array(ranked[0]))


def _hf_loglik(torch_model, prompt, answer) -> float:
    """log p(answer | prompt) by HF's forward pass: the answer's tokens up to its first EOS."""
    answer = np.asarray(answer)
    ends = np.flatnonzero(answer == EOS)
    answer = answer[: ends[0] + 1] if len(ends) else answer
    seq = torch.tensor(np.concatenate([prompt, answer]).astype(np.int64)[None])
    with torch.no_grad():
        logp = torch.log_softmax(torch_model(input_ids=seq).logits[0].double(), -1).numpy()
    start = len(prompt) - 1  # the logits at position t predict token t + 1
    return float(sum(logp[start + t, tok] for t, tok in enumerate(answer)))


def test_generate_is_cached_and_refuses_ngram_blocking(model):
    cfg, params, _ = model
    ids, mask, _, scores = _batch(cfg)
    rag.generate(cfg, params, ids, mask, scores, variant="token", max_length=3, num_beams=2)
    before = rag.trace_counts()["generate"]
    rag.generate(cfg, params, ids, mask, scores, variant="token", max_length=3, num_beams=2)
    assert rag.trace_counts()["generate"] == before
    with pytest.raises(ValueError, match="no_repeat_ngram_size"):
        rag.generate(cfg, params, ids, mask, scores, no_repeat_ngram_size=2)
