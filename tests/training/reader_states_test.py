"""`train.reader_trunk`: a run whose causal reader trains its top layer on the cached states of its
frozen lower layer, for every training question's fixed candidates (`training.reader_states`).

The runs are the tiny synthetic job read by a tiny random Llama (2 layers, the top one trained)
and a tiny BERT question tower, both saved as checkpoints with the world's word-level tokenizer."""

import dataclasses

import jax
import numpy as np
import pytest

import hf_fixtures
from rag_jax import causal
from rag_jax.models import bart, llama
from rag_jax.run import settings, synthetic, validation
from rag_jax.training import experiment, loop, reader_states, reader_trunk
from rag_jax.training.batcher import Batcher, batch_shapes
from tiny_runs import first_batch, tiny_config

FREEZE = "^(passage_encoder/|generator/(embed_tokens|layers_0)/)"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(question tower, reader, another reader of the same shapes) checkpoint folders."""
    root = tmp_path_factory.mktemp("checkpoints")
    tok = synthetic.tokenizer(synthetic.world_of(tiny_config()))
    paths = root / "question", root / "reader", root / "other_reader"
    hf_fixtures.save_bert(paths[0], vocab_size=len(tok), max_position_embeddings=32)
    for seed, path in enumerate(paths[1:]):
        hf_fixtures.save_llama(
            path,
            seed=seed,
            vocab_size=len(tok),
            max_position_embeddings=64,
            bos_token_id=tok.cls_token_id,
            eos_token_id=tok.sep_token_id,
            pad_token_id=tok.pad_token_id,
        )
    for path in paths:
        tok.save_pretrained(path)
    return paths


def _config(checkpoints, reader=1, **overrides):
    return tiny_config(
        **{
            "model.init": "pretrained",
            "model.question_encoder_path": str(checkpoints[0]),
            "model.generator_path": str(checkpoints[reader]),
            "model.generator_trained_layers": 1,
            "train.freeze": FREEZE,
            "train.retriever_fixed_candidates": True,
            "train.reader_trunk": True,
            "train.steps": 2,
            "train.bundle": False,
            "warm_start.method": "none",
            "warm_start.reader_steps": 0,
            "eval.enabled": False,
            "rag.keep_question": True,
            "rag.max_combined_length": 48,  # some prompts shorter than S, most cut at S
            **overrides,
        }
    )


OBJECTIVES = {
    "marginal": {},  # the generator's N candidates alone
    "pdist_with_negatives": {  # K = 7 candidates and R = 2 random negatives: C = 9 rows each
        "train.retriever_loss": "pdist",
        "train.retriever_candidates": 7,
        "train.retriever_random_negatives": 2,
    },
}


@pytest.fixture(scope="module", params=OBJECTIVES)
def built(checkpoints, tmp_path_factory, request):
    config = _config(checkpoints, **OBJECTIVES[request.param])
    validation.validate(config, 8)
    return config, experiment.build(config, tmp_path_factory.mktemp("built"))


def test_batches_carry_the_states_of_the_rows_the_batcher_lays_out(built):
    config, exp = built
    states = exp.reader_trunk
    g_cfg, params = exp.rag_cfg.generator, exp.params
    first = states.first_layer
    assert first == g_cfg.frozen_layers == 1 and exp.rag_cfg.causal
    count = config.train.retriever_random_negatives + (
        config.train.retriever_candidates or config.rag.n_docs
    )  # C
    width = config.rag.max_combined_length  # S
    assert states.doc_ids.shape == (len(exp.train), count)
    assert states.candidates.shape[1] == count - config.train.retriever_random_negatives
    assert len(states.trunk) == count * len(exp.train)
    mesh = loop.device_mesh(config)
    # The batcher without the cache: the same fixed candidates, searched again.
    plain = Batcher(dataclasses.replace(exp, reader_trunk=None), mesh)
    np.testing.assert_array_equal(plain.fixed_candidates(), states.candidates)
    cached = Batcher(exp, mesh)
    prompts = set()
    for step in (0, 1):
        with_states, with_tokens = first_batch(cached, exp, step), first_batch(plain, exp, step)
        assert not {"context_input_ids", "context_attention_mask"} & set(with_states)
        shapes = batch_shapes(config, exp.rag_cfg, config.train.batch_size)
        assert {k: v.shape for k, v in with_states.items()} == {
            k: v.shape for k, v in shapes.items()
        }  # fixed widths: S + T whatever the prompts, T labels: one compiled step
        labels, t = with_states["labels"], with_tokens["labels"].shape[1]
        np.testing.assert_array_equal(labels[:, :t], with_tokens["labels"])
        assert (labels[:, t:] == g_cfg.pad_token_id).all()
        ids, mask = with_tokens["context_input_ids"], with_tokens["context_attention_mask"]
        prompts |= set(mask.sum(axis=-1).reshape(-1).tolist())
        want = causal.answer_logits(
            exp.rag_cfg,
            params,
            ids.reshape(-1, ids.shape[-1]),
            mask.reshape(-1, mask.shape[-1]),
            with_tokens["labels"],
        )  # -> [B * C, t, V], the whole reader from the batch's tokens
        reader = with_states["reader_states"]
        assert reader.shape[2:] == (width + config.data.answer_length, g_cfg.hidden_size)
        got = causal.answer_logits_from_states(
            exp.rag_cfg,
            params,
            reader.reshape(-1, *reader.shape[2:]),
            with_states["reader_mask"].reshape(-1, reader.shape[2]),
            labels.shape[1],
            first,
        )
        np.testing.assert_allclose(got[:, :t], want, atol=1e-5, rtol=1e-5)
    assert min(prompts) < width  # prompts of several widths, right-aligned in the same S
    with pytest.raises(ValueError, match="not the ones whose reader states are cached"):
        states.arrays([0, 1], states.doc_ids[[1, 0]])


def test_a_run_trains_the_top_layer_and_refuses_a_restore_with_another_trunk(checkpoints, tmp_path):
    config = _config(checkpoints)
    assert loop.train_and_evaluate(config, tmp_path / "w")["steps"] == 2
    (cache,) = (tmp_path / "w" / "reader_trunk").iterdir()
    exp, state, _ = loop.restore(tmp_path / "w", config)
    assert exp.reader_trunk is None  # a restore evaluates: the whole reader reads the tokens
    before, after = exp.params["generator"], jax.device_get(state.params["generator"])
    for name in after:
        same = all(
            np.array_equal(x, y)
            for x, y in zip(jax.tree.leaves(before[name]), jax.tree.leaves(after[name]))
        )
        assert same == (name in ("embed_tokens", "layers_0")), name  # the trunk stays
    # The trained reader's trunk is still the cache's ...
    trunk = reader_trunk.ReaderTrunk(cache)
    trunk.check_trunk(exp.rag_cfg.generator, after)
    # ... but a resumed run whose reader changed (its cache built beside the first) is refused
    # when the checkpoint's reader is restored, before its first step.
    other = _config(checkpoints, reader=2, **{"train.steps": 3})
    with pytest.raises(ValueError, match=r"reader states .*\(.*trunk_fingerprint.*differ\)"):
        loop.train_and_evaluate(other, tmp_path / "w")
    assert len(list((tmp_path / "w" / "reader_trunk").iterdir())) == 2


BAD = {
    "a BART generator": {"model.generator_path": ""},
    "the whole reader trained": {"model.generator_trained_layers": 0},
    "candidates searched every step": {"train.retriever_fixed_candidates": False},
    "searched in the step": {"retrieval.index": "device", "retrieval.search_in_step": True},
    "a sampled answer": {"data.target": "sample"},
    "the embedding trained": {"train.freeze": "^(passage_encoder/|generator/layers_0/)"},
    "a frozen reader's memo": {"train.answer_memo": True},
}


@pytest.mark.parametrize("bad", BAD)
def test_start_up_refuses_what_the_cache_cannot_serve(bad, checkpoints):
    validation.validate(_config(checkpoints), 8)  # the good config passes
    config = settings.override(_config(checkpoints), BAD[bad])
    with pytest.raises(ValueError, match=r"config\.train\.reader_trunk"):
        validation.validate(config, 8)


def test_the_built_reader_is_checked_too(built):
    """What only the built reader says: BART, or a trunk (a tied embedding: the LM head too)
    that `train.freeze` leaves trainable."""
    config, exp = built
    assert reader_states.check(config, exp.rag_cfg, exp.params) == 1
    bart_cfg = exp.rag_cfg.replace(generator=bart.BartConfig())
    with pytest.raises(ValueError, match=r"reader_trunk .* generator is BartConfig"):
        reader_states.check(config, bart_cfg, exp.params)
    tied = exp.rag_cfg.replace(generator=exp.rag_cfg.generator.replace(tie_word_embeddings=True))
    loose = settings.override(
        config.copy_and_resolve_references(), {"train.freeze": "^generator/layers_0/"}
    )
    with pytest.raises(ValueError, match=r"embed_tokens.*tied embedding is the LM head"):
        reader_states.check(loose, tied, exp.params)
    whole = tied.replace(generator=tied.generator.replace(frozen_layers=0))
    with pytest.raises(ValueError, match="generator_trained_layers=k"):
        reader_states.check(config, whole, exp.params)
    assert isinstance(exp.rag_cfg.generator, llama.LlamaConfig)
