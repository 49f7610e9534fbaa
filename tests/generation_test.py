"""rag_jax.generation (behind `rag.generate`) against HF, on the points where it must not differ:

- RAG-Sequence thorough rescoring decides BOS exclusion once per question, over all of its
  distinct candidates, as HF does (not per chunk of candidates);
- the fast-decoding scores undo the length penalty with the true length, whatever tokens the
  model emitted;
- the masked candidate path (`mask_candidate_contexts=True`, the default) equals HF's procedure
  run with the context attention mask given explicitly, on contexts with real padding.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from rag_test import GEN, HF_IDS, B, N, T, _assert_same_tokens, inputs, models, save_rag

import hf_fixtures
from rag_jax import generation, rag, sequence_candidates
from rag_jax.devices import progress
from rag_jax.io import hf
from rag_jax.models import bart

__all__ = ["models"]  # the module-scoped RAG fixture, shared with rag_test

NO_BOS_GEN = {k: v for k, v in GEN.items() if k != "forced_bos_token_id"}


@pytest.mark.parametrize("deduplicate", [True, False])
def test_thorough_rescoring_scores_each_distinct_candidate_once(models, deduplicate):
    """`rescore` (distinct candidates first, a chunked loop that stops after the last distinct
    one) against `_thorough_nll` over every candidate in one pass."""
    variant, _, cfg, params = models
    if variant != "sequence":
        pytest.skip(reason="thorough rescoring is a RAG-Sequence mode")
    cfg = cfg.replace(do_deduplication=deduplicate)
    x = inputs(cfg, seed=8)
    encoded = generation._encode(cfg, params, x["context_input_ids"], x["context_attention_mask"])
    rng = np.random.default_rng(9)
    distinct = rng.integers(3, cfg.generator.vocab_size, size=(B, 4, T))
    # Question 0 has 2 distinct candidates among its 7 and question 1 has 4; repeats interleaved.
    picks = np.array([[0, 1, 0, 0, 1, 1, 0], [0, 1, 0, 2, 3, 1, 3]])
    candidates = jnp.asarray(np.take_along_axis(distinct, picks[:, :, None], axis=1))
    mask = jnp.asarray(x["context_attention_mask"])
    doc_scores = jnp.asarray(x["doc_scores"])
    first = np.array(
        [[picks[b, :m].tolist().count(picks[b, m]) == 0 for m in range(7)] for b in range(B)]
    )
    counted = jnp.asarray(first if deduplicate else np.ones_like(first))
    use_bos = sequence_candidates.candidates_start_with_bos(candidates, cfg.bos_token_id, counted)
    want = np.asarray(
        generation._thorough_nll(cfg, params, encoded, mask, doc_scores, candidates, use_bos)
    )
    for chunk in (1, 2, 3, 7):
        got = np.asarray(
            generation.rescore(
                cfg, candidates, _thorough(cfg, params, encoded, mask, doc_scores), chunk=chunk
            )
        )
        scored = first if deduplicate else np.ones_like(first)
        np.testing.assert_allclose(got[scored], want[scored], rtol=1e-5, atol=1e-5)
        assert np.all(np.isinf(got[~scored])) and np.all(got[~scored] > 0), chunk


# ---------------------------------------------------------------------------------------------
# BOS exclusion, decided per question


@pytest.fixture(scope="module")
def no_forced_bos(tmp_path_factory):
    """A RAG-Sequence model that does not force BOS: its candidates may or may not start with it."""
    path = tmp_path_factory.mktemp("no_bos")
    question = transformers.DPRConfig(**hf_fixtures.bert_config().to_dict())
    generator = hf_fixtures.bart_config(forced_bos_token_id=None)
    config = transformers.RagConfig.from_question_encoder_generator_configs(
        question, generator, n_docs=N
    )
    model = hf_fixtures.randomize_(transformers.RagSequenceForGeneration(config), 21)
    model.save_pretrained(path)
    cfg, params = hf.load_rag(path)
    return model, cfg, params, path


def _hf_rescoring_loss(model, x, b, candidates):
    """HF's thorough rescoring of question b's candidates, all at once, as its generate does."""
    ids = torch.tensor(x["context_input_ids"][b * N : (b + 1) * N])
    mask = torch.tensor(x["context_attention_mask"][b * N : (b + 1) * N])
    count = len(candidates)
    with torch.no_grad():
        out = model(
            context_input_ids=ids.repeat(count, 1),
            context_attention_mask=mask.repeat(count, 1),
            doc_scores=torch.tensor(x["doc_scores"][b : b + 1]).repeat(count, 1),
            labels=torch.tensor(np.asarray(candidates)),
            exclude_bos_score=True,
        )
    return out.loss.numpy()


def test_bos_exclusion_is_decided_once_per_question_like_hf(no_forced_bos):
    """Candidates that mix BOS and non-BOS starts, rescored a few at a time: each candidate's
    score equals HF's, which rescores all of the question's candidates together (a chunk of
    BOS-led candidates alone must not get its BOS score left out)."""
    model, cfg, params, _ = no_forced_bos
    x = inputs(cfg, seed=12)
    rng = np.random.default_rng(13)
    candidates = rng.integers(3, cfg.generator.vocab_size, size=(B, 6, T))
    candidates[:, :, 0] = cfg.generator.decoder_start_token_id
    # Question 0: BOS-led candidates first, then two without BOS; question 1: all BOS-led.
    candidates[0, :4, 1] = cfg.bos_token_id
    candidates[1, :, 1] = cfg.bos_token_id
    candidates = jnp.asarray(candidates)
    encoded = generation._encode(cfg, params, x["context_input_ids"], x["context_attention_mask"])
    mask, scores = jnp.asarray(x["context_attention_mask"]), jnp.asarray(x["doc_scores"])
    for chunk in (2, 3, 6):
        got = np.asarray(
            generation.rescore(
                cfg,
                jnp.asarray(candidates),
                _thorough(cfg, params, encoded, mask, scores),
                chunk=chunk,
            )
        )
        for b in range(B):
            want = _hf_rescoring_loss(model, x, b, np.asarray(candidates[b]))
            np.testing.assert_allclose(got[b], want, rtol=1e-4, atol=1e-4, err_msg=f"chunk {chunk}")
    # The two decisions differ: question 0 keeps its BOS scores, question 1 leaves them out.
    assert sequence_candidates.candidates_start_with_bos(
        jnp.asarray(candidates), cfg.bos_token_id
    ).tolist() == [
        False,
        True,
    ]


def _hf_thorough(model, x, num_beams, gen, mask_candidates: bool):
    """HF's RagSequenceForGeneration.generate procedure, question by question, with the context
    mask given to the candidates' beam search when `mask_candidates` (HF itself passes none)."""
    out = []
    for b in range(len(x["doc_scores"])):
        ids = torch.tensor(x["context_input_ids"][b * N : (b + 1) * N])
        mask = torch.tensor(x["context_attention_mask"][b * N : (b + 1) * N])
        with torch.no_grad():
            hyps = model.generator.generate(
                ids,
                attention_mask=mask if mask_candidates else None,
                num_beams=num_beams,
                num_return_sequences=num_beams,
                **gen,
                **HF_IDS,
            )
        hyps = torch.stack(list({str(h.tolist()): h for h in hyps}.values()))  # deduplicate
        loss = _hf_rescoring_loss(model, x, b, hyps.numpy())
        out.append(hyps[int(np.argmin(loss))].numpy())
    width = max(len(o) for o in out)
    return np.stack([np.pad(o, (0, width - len(o)), constant_values=1) for o in out])


@pytest.mark.parametrize("bias", [0.0, 2.0, 3.5])
def test_thorough_generation_without_forced_bos_matches_hf(no_forced_bos, bias):
    """A model that does not force BOS, its BOS logit raised so that the docs' beams start with
    and without it: the same answers as HF's generate."""
    model, cfg, params, _ = no_forced_bos
    model.generator.final_logits_bias[0, cfg.bos_token_id] += bias
    try:
        params = jax.tree.map(lambda p: p, params)
        params["generator"] = dict(
            params["generator"],
            final_logits_bias=np.asarray(model.generator.final_logits_bias[0].numpy()),
        )
        x = inputs(cfg, seed=14)
        with torch.no_grad():
            ref = model.generate(
                context_input_ids=torch.tensor(x["context_input_ids"]),
                context_attention_mask=torch.tensor(x["context_attention_mask"]),
                doc_scores=torch.tensor(x["doc_scores"]),
                num_beams=3,
                do_deduplication=True,
                **NO_BOS_GEN,
                **HF_IDS,
            ).numpy()
        ours = rag.generate(
            cfg,
            params,
            x["context_input_ids"],
            x["context_attention_mask"],
            x["doc_scores"],
            variant="sequence",
            num_beams=3,
            mask_candidate_contexts=False,
            **NO_BOS_GEN,
        )
        _assert_same_tokens(ours, ref, pad=1)
    finally:
        model.generator.final_logits_bias[0, cfg.bos_token_id] -= bias


def test_the_masked_candidate_path_matches_hf_given_the_mask(tmp_path):
    """`mask_candidate_contexts=True` on contexts with real padding: HF's procedure with the
    attention mask passed to the candidates' beam search gives the same answers."""
    model = save_rag(tmp_path, "sequence", seed=16)
    cfg, params = hf.load_rag(tmp_path)
    x = inputs(cfg, seed=17)
    assert (x["context_attention_mask"] == 0).any()  # real padding in the contexts
    ref = _hf_thorough(model, x, 4, GEN, mask_candidates=True)
    ours = rag.generate(
        cfg,
        params,
        x["context_input_ids"],
        x["context_attention_mask"],
        x["doc_scores"],
        variant="sequence",
        num_beams=4,
        **GEN,
    )
    _assert_same_tokens(ours, ref, pad=1)
    unmasked = _hf_thorough(model, x, 4, GEN, mask_candidates=False)
    with torch.no_grad():  # the procedure above is HF's own when the mask is left out
        hf_generate = model.generate(
            context_input_ids=torch.tensor(x["context_input_ids"]),
            context_attention_mask=torch.tensor(x["context_attention_mask"]),
            doc_scores=torch.tensor(x["doc_scores"]),
            num_beams=4,
            do_deduplication=True,
            **GEN,
            **HF_IDS,
        ).numpy()
    _assert_same_tokens(unmasked, hf_generate, pad=1)


# ---------------------------------------------------------------------------------------------
# Fast decoding's scores


def test_unnormalised_counts_every_generated_token_of_a_hypothesis_without_eos():
    """The length a hypothesis is penalised by: up to its first EOS, else all L - 1 generated
    tokens, even where the model emitted the pad id itself."""
    cfg = rag.RagConfig(question_encoder=None, generator=bart.BartConfig(pad_token_id=1))
    hyps = jnp.asarray(
        [
            [[2, 7, 5, 2, 1], [2, 7, 1, 1, 9]],  # EOS at position 3 | max length, pads emitted
            [[2, 1, 1, 1, 1], [2, 4, 2, 2, 1]],  # max length, all pads | EOS at position 2
        ]
    )
    scores = jnp.asarray([[-1.0, -2.0], [-3.0, -4.0]])
    got = generation.unnormalised(hyps, scores, {"length_penalty": 0.8}, cfg)
    lengths = np.array([[3, 4], [4, 2]], np.float32)
    np.testing.assert_allclose(got, np.asarray(scores) * lengths**0.8, rtol=1e-6)


def test_fast_decoding_scores_are_the_hypotheses_log_likelihoods(models):
    """Every doc's beam hypotheses, with their fast-decoding log-likelihoods, against the
    teacher-forced log-likelihood of the same tokens under the same doc; the model is made to
    emit the pad id inside hypotheses that run to max_length."""
    variant, _, cfg, params = models
    if variant != "sequence":
        pytest.skip(reason="fast decoding is a RAG-Sequence mode")
    gen = cfg.generator
    bias = np.asarray(params["generator"]["final_logits_bias"]).copy()
    bias[gen.pad_token_id] += 4.0  # pads appear inside hypotheses
    bias[gen.eos_token_id] -= 30.0  # and none ends before max_length
    params = dict(params, generator=dict(params["generator"], final_logits_bias=bias))
    x = inputs(cfg, seed=18)
    # No logits processor (forcing, minimum length, n-gram bans), so the beam search's sums of
    # log-probabilities are the model's own.
    plain = dict(forced_bos_token_id=None, forced_eos_token_id=None, min_length=0)
    plain.update(no_repeat_ngram_size=0, bad_words_ids=())
    settings = generation.resolve_settings(
        cfg, dict(num_beams=3, max_length=7, length_penalty=1.5, **plain)
    )
    ids, mask = jnp.asarray(x["context_input_ids"]), jnp.asarray(x["context_attention_mask"])
    encoded = generation._encode(cfg, params, ids, mask)
    per_doc = dict(settings, num_return_sequences=3)
    hyps, hyp_scores = generation._search(
        cfg, params, encoded, mask, per_doc, batch=B * N, docs_per_row=1
    )  # -> [B * N, K, L]
    assert (np.asarray(hyps)[:, :, 1:-1] == gen.pad_token_id).any()  # the case under test
    got = np.asarray(generation.unnormalised(hyps, hyp_scores, settings, cfg))  # [B * N, K]
    # Teacher forcing: log p(y | x, z) of each hypothesis read against its own doc.
    flat = np.asarray(hyps).reshape(B * N * 3, -1)
    logits = bart.Bart(gen).apply(
        {"params": params["generator"]},
        jnp.repeat(ids, 3, axis=0),
        jnp.repeat(mask, 3, axis=0),
        jnp.asarray(flat),
    )[0]
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = np.take_along_axis(np.asarray(logp)[:, :-1], flat[:, 1:, None], axis=-1)[..., 0]
    want = picked.sum(axis=1).reshape(B * N, 3)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_public_entry_points_compile_once_per_shape(models):
    """`rag.generate`, `rag.nll`, `rag.question_embeddings` and `rag.doc_scores` called plainly,
    as the README does: the second call with the same shapes runs the cached program."""
    variant, _, cfg, params = models
    x = inputs(cfg, seed=19)
    args = (x["context_input_ids"], x["context_attention_mask"], x["doc_scores"])

    def calls():
        q = rag.question_embeddings(
            cfg, params, x["question_input_ids"], x["question_attention_mask"]
        )
        rag.doc_scores(q, jnp.asarray(x["doc_vectors"]))
        rag.nll(cfg, params, *args, x["labels"], variant)
        rag.generate(cfg, params, *args, variant=variant, num_beams=2, **GEN)

    calls()
    before = rag.trace_counts()
    for _ in range(2):
        calls()
    assert rag.trace_counts() == before  # no retrace: one program each, cached
    rag.generate(cfg, params, *args, variant=variant, num_beams=3, **GEN)  # other settings
    assert rag.trace_counts()["generate"] == before["generate"] + 1


def test_a_plain_call_that_compiles_says_so_and_a_cached_one_says_nothing(models, monkeypatch,
                                                                          capfd):  # fmt: skip
    """A README-style call of `rag.generate` with new settings says on stderr that it compiles,
    then how long it took (the line comes after `FIRST_CALL_AFTER_S`, here 0); the same call
    again runs the cached program and says nothing; `RAG_JAX_QUIET=1` silences the first."""
    variant, _, cfg, params = models
    x = inputs(cfg, seed=23)
    args = (x["context_input_ids"], x["context_attention_mask"], x["doc_scores"])
    monkeypatch.setattr(progress, "FIRST_CALL_AFTER_S", 0.0)
    capfd.readouterr()
    rag.generate(cfg, params, *args, variant=variant, num_beams=5, **GEN)
    lines = capfd.readouterr().err.splitlines()
    assert lines[0].startswith("rag.generate: compiling for new shapes or settings"), lines
    assert lines[-1].startswith("rag.generate: compiled in "), lines
    rag.generate(cfg, params, *args, variant=variant, num_beams=5, **GEN)
    assert "rag.generate" not in capfd.readouterr().err
    monkeypatch.setenv(progress.QUIET, "1")
    traced = rag.trace_counts().get("nll", 0)
    rag.nll(cfg, params, *args, x["labels"][:, :3], variant)  # a new shape: compiles, quietly
    assert rag.trace_counts()["nll"] == traced + 1
    assert "rag.nll" not in capfd.readouterr().err


def _thorough(cfg, params, encoded, mask, doc_scores):
    """BART's thorough score function, as `generation.generate` hands it to `rescore`."""
    return lambda part, use_bos: generation._thorough_nll(
        cfg, params, encoded, mask, doc_scores, part, use_bos
    )
