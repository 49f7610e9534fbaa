"""Evaluation with more passages at test time than in training (`eval.n_docs`), as the paper
tests RAG-Sequence with 50 and RAG-Token with 15 after training with 5."""

import jax
import numpy as np
import pytest
import transformers

from rag_jax import rag
from rag_jax.devices import sharding
from rag_jax.model_inputs import question_tokens
from rag_jax.run import model_setup, settings, validation
from rag_jax.training import evaluation, experiment
from tiny_runs import tiny_config


@pytest.fixture(scope="module")
def exp(tmp_path_factory):
    config = tiny_config(**{"warm_start.method": "none", "warm_start.reader_steps": 0})
    return experiment.build(config, tmp_path_factory.mktemp("eval_n_docs"))


def test_eval_n_docs_retrieves_the_top_k_of_a_brute_force_search(exp):
    mesh = sharding.data_mesh(jax.devices()[:1])
    examples = exp.eval[:8]
    exp.config.eval.n_docs = 7  # training retrieves rag.n_docs = 5
    try:
        metrics, predictions = evaluation.evaluate(
            exp, exp.params, examples, mesh=mesh, variant="sequence"
        )
    finally:
        exp.config.eval.n_docs = 0
    assert [len(p["retrieved"]) for p in predictions] == [7] * len(examples)
    # The retrieved passages: the 7 best of every stored vector by inner product (numpy).
    fields = question_tokens(
        exp.question_tokenizer, [e.question for e in examples], exp.config.data.question_length
    )
    q = np.asarray(
        rag.question_embeddings(
            exp.rag_cfg, exp.params, fields["question_input_ids"], fields["question_attention_mask"]
        )
    )
    scores = q @ np.asarray(exp.retriever.vectors, np.float32).T  # -> [B, C]
    # Compared by score, not by id: passages whose scores tie to float32 rounding may come in
    # either order (the search's and numpy's matmuls round differently).
    row_of = {pid: r for r, pid in enumerate(exp.store.ids)}
    got = np.array(
        [[scores[b, row_of[pid]] for pid in p["retrieved"]] for b, p in enumerate(predictions)]
    )  # -> [B, 7]
    want = -np.sort(-scores, axis=1)[:, :7]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)  # float32 op tolerance
    assert all(len(set(p["retrieved"])) == 7 for p in predictions)
    assert 0.0 <= metrics["exact_match"] <= 1.0


def test_recalls_alone_reach_beyond_the_passages_the_generator_reads(exp):
    """Recall@k for a k above eval.n_docs, when only the question tower runs: the top k of the
    same search (recall@k never falls as k grows, and equals the deeper search's own)."""
    mesh = sharding.data_mesh(jax.devices()[:1])
    examples = exp.eval[:16]
    exp.config.eval.n_docs = 2  # the generator would read 2
    try:
        shallow, _ = evaluation.evaluate(
            exp, exp.params, examples, mesh=mesh, variant="sequence", ks=(1, 2, 5), generate=False
        )
    finally:
        exp.config.eval.n_docs = 0
    deep, _ = evaluation.evaluate(
        exp, exp.params, examples, mesh=mesh, variant="sequence", ks=(1, 2, 5), generate=False
    )  # eval.n_docs = rag.n_docs = 5
    assert set(shallow) >= {"gold_recall@5", "answer_recall@5"}
    assert shallow == deep
    assert shallow["gold_recall@1"] <= shallow["gold_recall@2"] <= shallow["gold_recall@5"]


def test_an_answering_evaluation_reports_recalls_beyond_the_passages_it_reads(exp):
    """ks above eval.n_docs with answers: the recalls of the deeper search, the answers and
    the recalls within n_docs of the passages the generator reads, per question too."""
    mesh = sharding.data_mesh(jax.devices()[:1])
    examples = exp.eval[:8]
    exp.config.eval.n_docs = 2
    try:
        common = dict(mesh=mesh, variant="sequence", ks=(1, 2, 5))
        records = []
        both, predictions = evaluation.evaluate(
            exp, exp.params, examples, per_question=records, **common
        )
        recalls, _ = evaluation.evaluate(exp, exp.params, examples, generate=False, **common)
        answers, _ = evaluation.evaluate(
            exp, exp.params, examples, mesh=mesh, variant="sequence", ks=(1, 2)
        )
    finally:
        exp.config.eval.n_docs = 0
    assert {k: both[k] for k in recalls} == recalls
    assert (both["exact_match"], both["f1"]) == (answers["exact_match"], answers["f1"])
    assert [len(p["retrieved"]) for p in predictions] == [2] * len(examples)
    assert [r["id"] for r in records] == [e.id for e in examples]
    assert all({"gold_recall@5", "exact_match", "f1"} <= set(r) for r in records)


def test_eval_n_docs_defaults_to_the_training_k(exp):
    cfg = evaluation.eval_rag_config(exp.rag_cfg, exp.config)
    assert cfg.n_docs == exp.config.rag.n_docs == 5
    assert exp.retriever.with_n_docs(5) is exp.retriever


def test_closed_book_cannot_test_with_more_passages():
    config = tiny_config(**{"rag.closed_book": True, "rag.n_docs": 1, "eval.n_docs": 5})
    with pytest.raises(ValueError, match=r"config.eval.n_docs=5 but config.rag.closed_book"):
        validation.validate(config, 1)


# ---------------------------------------------------------------------------------------------
# EM/F1 against the gold answers as the generator's tokenizer writes them


ODD_ANSWERS = ["Levi's Stadium", "Fédération Internationale", "Beyoncé", "24–10", "the U.S."]


def test_a_perfect_copy_scores_em_1_with_an_uncased_wordpiece_generator(tmp_path, monkeypatch):
    """The oracle of a generator that writes each gold answer token for token: EM and F1 1.0,
    although its uncased WordPiece vocabulary decodes "Levi's" as "levi ' s" and drops accents
    (against the raw gold answers EM would be 0)."""
    import types

    import hf_fixtures
    from rag_jax.model_inputs import answer_labels
    from rag_jax.models import bart, bert
    from rag_jax.retrieval.store import PassageStore
    from rag_jax.run import data, metrics

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf_fixtures.minilm_path()))
    passages = [
        (f"p{i}", f"title {i}", f"It was {a} all along.") for i, a in enumerate(ODD_ANSWERS)
    ]
    store = PassageStore.build(passages, tokenizer, tmp_path / "store")
    ids = model_setup.generator_ids(tokenizer)
    generator = bart.BartConfig(vocab_size=len(tokenizer), **ids)
    rag_cfg = rag.RagConfig(
        question_encoder=bert.BertConfig(), generator=generator, bos_token_id=ids["bos_token_id"]
    )
    config = settings.defaults()
    config.eval.batch_size = 4  # two batches, the second padded
    exp = types.SimpleNamespace(
        config=config, rag_cfg=rag_cfg, store=store, generator_tokenizer=tokenizer
    )
    examples = [data.Example(f"what was {i}?", (a,), f"q{i}", (f"p{i}",)) for i, a in
                enumerate(ODD_ANSWERS)]  # fmt: skip
    batches = data.eval_batches(len(examples), config.eval.batch_size)

    def copy_the_gold_answer(cfg, params, ctx, ctx_mask, doc_scores, variant):
        idx, _ = next(batches)
        return answer_labels(tokenizer, [examples[i].answers[0] for i in idx], cfg, 16)

    monkeypatch.setattr(evaluation.rag, "generate", copy_the_gold_answer)
    scores, predictions = evaluation.oracle(exp, {"generator": None}, examples)
    assert scores == {"exact_match": 1.0, "f1": 1.0}
    written = [p["prediction"] for p in predictions]
    assert written[:2] == ["levi ' s stadium", "federation internationale"]
    assert [p["answers"] for p in predictions] == [[a] for a in ODD_ANSWERS]  # raw, as read
    raw = metrics.qa_metrics(written, [[a] for a in ODD_ANSWERS])
    assert raw["exact_match"] == (0.0, 5)  # "24 – 10", "the u. s.": none survives


def test_gold_answers_that_a_tokenizer_writes_unchanged_score_as_before(exp):
    """The default job's word-level vocabulary writes every gold answer of its world (and of the
    reader's) unchanged, so its EM and F1 are those of the raw gold answers."""
    from rag_jax.run import data, synthetic

    config = settings.defaults()
    for seed in (config.seed, config.seed + 1_000_003):
        world = synthetic.make_world(
            synthetic.WorldConfig(seed=seed, num_entities=config.data.num_entities)
        )
        tokenizer = synthetic.tokenizer(world)
        answers = [e.answers for e in data.examples_from_world(world, "train")]
        answers += [e.answers for e in data.examples_from_world(world, "eval")]
        assert evaluation.written_answers(tokenizer, answers) == [list(a) for a in answers]
    assert evaluation.written_answers(exp.generator_tokenizer, [[], ["x"]])[0] == []


def test_every_squad_dev_answer_copied_scores_em_1(shared_data):
    """The EM ceiling of the SQuAD reader (MiniLM's uncased WordPiece): each dev question's
    first gold answer, written by the tokenizer, against its gold answers so written."""
    import json

    import hf_fixtures
    from rag_jax.run import metrics

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf_fixtures.minilm_path()))
    path = shared_data / "squad11_dev" / "questions.jsonl"
    gold = [json.loads(line)["answers"] for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(gold) == 8595
    written = evaluation.written_answers(tokenizer, gold)
    copies = [w[0] for w in written]
    ceiling = metrics.reduce_metrics(metrics.qa_metrics(copies, written))
    assert ceiling == {"exact_match": 1.0, "f1": 1.0}
    raw = metrics.reduce_metrics(metrics.qa_metrics(copies, gold))["exact_match"]
    assert raw == pytest.approx(0.888, abs=1e-3)  # the cap of scoring against the raw answers
