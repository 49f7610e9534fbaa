"""Export to transformers: HF checkpoints round-trip exactly, and the refusals name the reason."""

import copy
import dataclasses
import functools
import json
import types

import jax
import numpy as np
import pytest
import torch
import transformers
from rag_test import GEN, HF_IDS, inputs, save_rag
from safetensors import safe_open

import hf_fixtures
from rag_jax import rag
from rag_jax.io import bundle, hf
from rag_jax.model_inputs import answer_labels, question_tokens
from rag_jax.models import bart, bert

_CLASSES = {
    "sequence": transformers.RagSequenceForGeneration,
    "token": transformers.RagTokenForGeneration,
}


def _from_pretrained(cls, path):
    """The model and a check that loading used every tensor and filled every parameter."""
    model, info = cls.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info
    return model.eval()


def _assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name


def _assert_same_tokens(ours: np.ndarray, ref: np.ndarray, pad: int, what: str) -> None:
    width = max(ours.shape[1], ref.shape[1])
    ours, ref = (
        np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=pad) for a in (ours, ref)
    )
    np.testing.assert_array_equal(ours, ref, err_msg=what)


def _loss(model, x):
    with torch.no_grad():
        return model(
            context_input_ids=torch.tensor(x["context_input_ids"]),
            context_attention_mask=torch.tensor(x["context_attention_mask"]),
            doc_scores=torch.tensor(x["doc_scores"]),
            labels=torch.tensor(x["labels"]),
            reduce_loss=False,
        ).loss.numpy()


def _generate(model, x, **settings):
    with torch.no_grad():
        return model.generate(
            context_input_ids=torch.tensor(x["context_input_ids"]),
            context_attention_mask=torch.tensor(x["context_attention_mask"]),
            doc_scores=torch.tensor(x["doc_scores"]),
            **settings,
        ).numpy()


@pytest.mark.parametrize("variant", ["sequence", "token"])
def test_an_hf_rag_checkpoint_round_trips_exactly(tmp_path, variant):
    """HF -> hf.load_rag -> hf.save_rag -> from_pretrained: every tensor, the loss, the tokens."""
    original = save_rag(tmp_path / "hf", variant, seed=21, max_combined_length=11)
    cfg, params = hf.load_rag(tmp_path / "hf")
    summary = hf.save_rag(tmp_path / "out", cfg, params, variant=variant)
    assert summary["architecture"] == _CLASSES[variant].__name__
    # Readable as any file the process writes (the safetensors library alone writes 0600).
    (tmp_path / "plain").write_bytes(b"")
    mode = lambda p: p.stat().st_mode & 0o777  # noqa: E731
    assert mode(tmp_path / "out" / "model.safetensors") == mode(tmp_path / "plain")
    reloaded = _from_pretrained(_CLASSES[variant], tmp_path / "out")
    _assert_same_state(original, reloaded)

    cfg_again, params_again = hf.load_rag(tmp_path / "out")
    assert cfg_again == cfg  # n_docs, max_combined_length, separators, BOS, generation settings
    assert cfg.max_combined_length == 11
    flat, flat_again = (
        dict(jax.tree_util.tree_leaves_with_path(p)) for p in (params, params_again)
    )
    for path in flat:
        np.testing.assert_array_equal(flat[path], flat_again[path], err_msg=str(path))

    x = inputs(cfg, seed=3)
    np.testing.assert_array_equal(_loss(reloaded, x), _loss(original, x))
    settings = dict(num_beams=4, **GEN, **HF_IDS)
    np.testing.assert_array_equal(
        _generate(reloaded, x, **settings), _generate(original, x, **settings)
    )


def test_the_halves_round_trip_and_bfloat16_stays_bfloat16(tmp_path):
    hf_fixtures.save_dpr(tmp_path / "ctx", "context", seed=3, projection_dim=6)
    cfg, params = hf.load_dpr(tmp_path / "ctx")
    hf.save_dpr(tmp_path / "ctx_out", cfg, params, kind="context")
    _assert_same_state(
        transformers.DPRContextEncoder.from_pretrained(tmp_path / "ctx"),
        _from_pretrained(transformers.DPRContextEncoder, tmp_path / "ctx_out"),
    )

    original = hf_fixtures.save_bart(tmp_path / "bart", seed=4)
    cfg, params = hf.load_bart(tmp_path / "bart", param_dtype="bfloat16")
    hf.save_bart(tmp_path / "bart_out", cfg, params)
    with safe_open(str(tmp_path / "bart_out" / "model.safetensors"), "np") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    reloaded = _from_pretrained(transformers.BartForConditionalGeneration, tmp_path / "bart_out")
    for name, tensor in original.state_dict().items():
        got = reloaded.state_dict()[name]
        assert got.dtype == torch.bfloat16 and torch.equal(got, tensor.to(torch.bfloat16)), name


def test_a_bert_question_encoder_exports_as_dpr_without_its_pooler(tmp_path, caplog):
    """A plain BERT (pooler and all) as the question tower: DPR computes the same vector."""
    torch_bert = hf_fixtures.save_bert(tmp_path / "bert", seed=8)
    cfg, params = hf.load_bert(tmp_path / "bert")
    assert cfg.with_pooler
    hf.save_dpr(tmp_path / "dpr", cfg, params)
    assert "pooler" in caplog.text and "not exported" in caplog.text
    dpr = _from_pretrained(transformers.DPRQuestionEncoder, tmp_path / "dpr")
    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(0), [7, 4], cfg.vocab_size)
    with torch.no_grad():
        want = dpr(torch.tensor(ids), attention_mask=torch.tensor(mask)).pooler_output.numpy()
        cls = torch_bert(torch.tensor(ids), attention_mask=torch.tensor(mask))[0][:, 0].numpy()
    ours, _ = bert.BertEncoder(cfg).apply({"params": params}, ids, mask)
    np.testing.assert_allclose(want, cls, rtol=0, atol=1e-6)  # DPR's vector: the [CLS] state
    np.testing.assert_allclose(ours, want, rtol=1e-4, atol=1e-4)


def test_models_without_an_hf_equivalent_are_refused(tmp_path):
    hf_fixtures.save_dpr(tmp_path / "q", "question", seed=1)
    cfg, params = hf.load_dpr(tmp_path / "q")

    mean = dataclasses.replace(cfg, pooling="mean")
    with pytest.raises(hf.ExportError, match=r"pools its tokens by 'mean'.*no HF equivalent"):
        hf.save_dpr(tmp_path / "mean", mean, params)
    normalised = dataclasses.replace(cfg, normalize=True)
    with pytest.raises(hf.ExportError, match=r"L2-normalises its vectors.*no HF equivalent"):
        hf.save_dpr(tmp_path / "normalised", normalised, params)
    extra = dict(params, adapter={"kernel": np.zeros((2, 2), np.float32)})
    with pytest.raises(hf.ExportError, match=r"\['adapter/kernel'\] have no DPR tensor"):
        hf.save_dpr(tmp_path / "extra", cfg, extra)

    save_rag(tmp_path / "rag", "token", seed=2)
    rag_cfg, rag_params = hf.load_rag(tmp_path / "rag")
    odd_bos = rag_cfg.replace(bos_token_id=None)
    with pytest.raises(hf.ExportError, match=r"bos_token_id=None.*cannot be expressed"):
        hf.save_rag(tmp_path / "bos", odd_bos, rag_params)
    assert not (tmp_path / "bos" / "config.json").exists()  # refused before anything is written
    scaled = rag_cfg.replace(doc_score_scale=20.0)
    with pytest.raises(hf.ExportError, match=r"softmax\(20.0 \* q . d\).*no HF equivalent"):
        hf.save_rag(tmp_path / "scaled", scaled, rag_params)
    assert not (tmp_path / "scaled").exists()
    assert json.loads((tmp_path / "rag" / "config.json").read_text())["model_type"] == "rag"


def test_bart_generators_hf_cannot_compute_are_refused(tmp_path):
    """HF's BART runs its LayerNorms at eps 1e-5 whatever the config says (a BERT-initialised
    generator's 1e-12 would change its logits), and ties the encoder's token embedding to the
    shared one: an untied copy exports while it equals the shared table, and is refused once
    they differ. Nothing is written before a refusal."""
    torch_model = hf_fixtures.save_bart(tmp_path / "bart", seed=9)
    cfg, params = hf.load_bart(tmp_path / "bart")
    bert_eps = cfg.replace(layer_norm_eps=1e-12)
    with pytest.raises(hf.ExportError, match=r"layer_norm_eps=1e-12 .*always uses 1e-05"):
        hf.save_bart(tmp_path / "eps", bert_eps, params)
    assert not (tmp_path / "eps").exists()
    save_rag(tmp_path / "rag", "token", seed=3)
    rag_cfg, rag_params = hf.load_rag(tmp_path / "rag")
    eps_rag = rag_cfg.replace(generator=rag_cfg.generator.replace(layer_norm_eps=1e-12))
    with pytest.raises(hf.ExportError, match=r"layer_norm_eps=1e-12"):
        hf.save_rag(tmp_path / "eps_rag", eps_rag, rag_params)
    assert not (tmp_path / "eps_rag").exists()

    # A fixed encoder's own embedding, still equal to the shared one: the export is exact.
    frozen = cfg.replace(frozen_encoder_layers=cfg.encoder_layers)
    untied = bart.untie_encoder_embedding(params)
    hf.save_bart(tmp_path / "untied", frozen, untied)
    reloaded = _from_pretrained(transformers.BartForConditionalGeneration, tmp_path / "untied")
    _assert_same_state(reloaded, torch_model)
    # ... and refused once the shared table has moved without it.
    moved = copy.deepcopy(untied)
    moved["shared"]["embedding"][3, 0] += 1e-3
    refused = (
        r"own token embedding \(encoder/embed_tokens/embedding.*frozen_encoder_layers="
        rf"{cfg.encoder_layers}\), and the two now differ"
    )
    with pytest.raises(hf.ExportError, match=refused):
        hf.save_bart(tmp_path / "moved", frozen, moved)
    assert not (tmp_path / "moved").exists()


# ---------------------------------------------------------------------------------------------
# A model trained by rag_jax, exported


@pytest.fixture(scope="module")
def exported(tiny_trained_run, tmp_path_factory):
    """The trainer's bundle exported as both HF classes, each with a RagRetriever over the
    exported faiss index, and rag_jax's own retrieval for 3 held-out questions."""
    workdir, _ = tiny_trained_run
    model = bundle.load(workdir / "bundle")
    cfg, params, store = model.rag_cfg, model.params, model.store
    predictions = [json.loads(line) for line in (workdir / "predictions.jsonl").open()][:3]
    questions = [p["question"] for p in predictions]
    fields = question_tokens(model.question_tokenizer, questions, model.settings.question_length)
    q_ids, q_mask = fields["question_input_ids"], fields["question_attention_mask"]
    q = np.asarray(jax.jit(functools.partial(rag.question_embeddings, cfg))(params, q_ids, q_mask))
    pieces = store.tokenize_questions(model.generator_tokenizer, questions)
    hits = model.retriever(q, pieces)  # contexts [B * N, S], padded to S as HF pads them
    hf_models = {}
    for variant in ("token", "sequence"):
        out = tmp_path_factory.mktemp(f"hf_{variant}")
        summary = model.to_hf(out, variant=variant)
        retriever = transformers.RagRetriever.from_pretrained(
            out,
            index_name="custom",
            passages_path=summary["passages_path"],
            index_path=summary["index_path"],
        )
        hf_models[variant] = _from_pretrained(_CLASSES[variant], out)
        hf_models[variant].set_retriever(retriever)
    return types.SimpleNamespace(
        model=model,
        cfg=cfg,
        params=params,
        hits=hits,
        q=q,
        scores=rag.doc_scores(q, hits.doc_vectors),
        torch_q=dict(input_ids=torch.tensor(q_ids), attention_mask=torch.tensor(q_mask)),
        answers=[p["answers"][0] for p in predictions],
        hf=hf_models,
    )


def _generate_both(x, variant: str, num_beams: int) -> tuple[np.ndarray, np.ndarray]:
    """(rag_jax's tokens, HF's tokens) from the question tokens, HF retrieving end to end."""
    hf_model, cfg = x.hf[variant], x.cfg
    with torch.no_grad():
        max_length = cfg.generation.max_length
        want = hf_model.generate(**x.torch_q, num_beams=num_beams, max_length=max_length)
    unmasked = {} if variant == "token" else dict(mask_candidate_contexts=False)
    generate = functools.partial(
        rag.generate, cfg, variant=variant, num_beams=num_beams, **unmasked
    )
    ctx, ctx_mask = x.hits.context_input_ids, x.hits.context_attention_mask
    return np.asarray(jax.jit(generate)(x.params, ctx, ctx_mask, x.scores)), want.numpy()


@pytest.mark.parametrize("variant", ["token", "sequence"])
def test_a_trained_model_exported_to_hf_retrieves_and_scores_as_rag_jax(exported, variant):
    """HF's question encoder + RagRetriever over the exported faiss index + generator, end to end
    from the question tokens: the bundle's passages and contexts, and its loss within 1e-4."""
    x, hf_model = exported, exported.hf[variant]
    store, cfg = x.model.store, x.cfg
    with torch.no_grad():
        hf_q = hf_model.question_encoder(**x.torch_q)[0].numpy()
    np.testing.assert_allclose(hf_q, x.q, rtol=1e-4, atol=1e-4)
    _, _, docs = hf_model.retriever.retrieve(hf_q, cfg.n_docs)
    assert [d["id"] for d in docs] == [[store.ids[int(j)] for j in row] for row in x.hits.doc_ids]
    built = hf_model.retriever(x.torch_q["input_ids"].numpy(), hf_q, return_tensors="np")
    np.testing.assert_array_equal(built["context_input_ids"], x.hits.context_input_ids)

    labels = answer_labels(x.model.generator_tokenizer, x.answers, cfg, 8)
    with torch.no_grad():
        want = hf_model(**x.torch_q, labels=torch.tensor(labels), reduce_loss=False).loss.numpy()
    nll = jax.jit(functools.partial(rag.nll, cfg, variant=variant, reduce=False))
    ctx, ctx_mask = x.hits.context_input_ids, x.hits.context_attention_mask
    np.testing.assert_allclose(
        nll(x.params, ctx, ctx_mask, x.scores, labels), want, rtol=1e-4, atol=1e-4
    )
    if variant == "token":
        got, want = _generate_both(x, "token", num_beams=1)
        _assert_same_tokens(got, want, cfg.pad_token_id, "RAG-Token greedy")


@pytest.mark.parametrize("variant", ["token", "sequence"])
def test_a_trained_model_exported_to_hf_beam_searches_as_rag_jax(exported, variant):
    """4 beams; RAG-Sequence thorough decoding with HF's unmasked candidates."""
    got, want = _generate_both(exported, variant, num_beams=4)
    _assert_same_tokens(got, want, exported.cfg.pad_token_id, f"{variant}, 4 beams")


def test_a_bundle_whose_contexts_keep_the_question_is_refused(exported, tmp_path):
    """HF's RagRetriever cuts a long context's end, question included: no HF equivalent."""
    kept = copy.copy(exported.model)
    kept.settings = dataclasses.replace(kept.settings, keep_question=True)
    with pytest.raises(hf.ExportError, match=r"keep the question.*no HF equivalent"):
        kept.to_hf(tmp_path / "kept")
    assert not (tmp_path / "kept").exists()
