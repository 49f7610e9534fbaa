"""The domain study (experiments/domain_study.py): its rows, its summary against three baselines,
and the whole study at toy size on COVID-QA's text (slow)."""

import json
import pathlib

import flax.serialization
import jax
import numpy as np
import pytest

import domain_study
from rag_jax.io import bundle, hf, hf_llama
from rag_jax.retrieval import documents
from rag_jax.run import paired, settings, validation
from rag_jax.training import experiment, memo, reader


def test_every_row_is_a_valid_config_differing_only_in_its_overrides():
    base = domain_study.CONFIGS["covidqa"].get_config()
    for name, overrides in domain_study.ROWS.items():
        config = settings.override(domain_study.CONFIGS["covidqa"].get_config(), overrides)
        validation.validate(config, 1, paths=False)
        changed = {
            f"{section}.{k}"
            for section, values in config.to_dict().items()
            if isinstance(values, dict)
            for k, v in values.items()
            if base.to_dict()[section].get(k) != v
        }
        assert changed <= set(overrides), (name, changed - set(overrides))
    assert set(domain_study.BASELINES) <= set(domain_study.ROWS)
    # The reader rows: what trains the reader is checked (a domain fine-tune needs its layers;
    # the trunk its frozen embedding and no answer memo).
    assert set(domain_study.READER_ROWS) <= set(domain_study.ROWS)
    for key, value, message in (
        ("model.generator_trained_layers", 0, "reader_domain_steps=720 fine-tunes"),
        ("train.answer_memo", True, "answer_memo holds a frozen"),
    ):
        row = "pipeline" if key.startswith("model") else "joint_reader"
        wrong = settings.override(base.copy_and_resolve_references(), domain_study.ROWS[row])
        with pytest.raises(ValueError, match=message):
            validation.validate(settings.override(wrong, {key: value}), 1, paths=False)


def test_the_covidqa_config_reads_its_splits(shared_data):
    if not (shared_data / "covidqa").is_dir():
        pytest.skip(reason=f"COVID-QA not found in {shared_data}")
    config = domain_study.CONFIGS["covidqa"].get_config()
    assert pathlib.Path(config.data.corpus_path).parent == shared_data / "covidqa"
    same = settings.override(config.copy_and_resolve_references(), {"data.eval_split": "train"})
    with pytest.raises(ValueError, match="must be two different splits"):
        validation.validate(same, 1, paths=True)
    unknown = settings.override(config.copy_and_resolve_references(), {"data.eval_split": "val"})
    with pytest.raises(ValueError, match=r"eval_split='val' is not one of data.splits"):
        validation.validate(unknown, 1, paths=True)


def test_holdout_evaluates_held_out_train_articles_and_never_dev(shared_data):
    if not (shared_data / "covidqa").is_dir():
        pytest.skip(reason=f"COVID-QA not found in {shared_data}")
    config = domain_study.CONFIGS["covidqa"].get_config()
    config = settings.override(config, domain_study.holdout(0.2))
    validation.validate(config, 1, paths=True)
    train, evals, passages, _ = experiment._load_data(config)
    lines = [json.loads(line) for line in open(config.data.train_path)]
    split = {q["id"]: q["split"] for q in lines}
    assert {split[e.id] for e in train + evals} == {"train"}
    assert len(train) + len(evals) == sum(s == "train" for s in split.values())
    title = {p.id: p.title for p in passages}
    held = {title[e.gold_ids[0]] for e in evals}
    assert held.isdisjoint(title[e.gold_ids[0]] for e in train)
    assert len(held) == round(0.2 * 103)  # a fifth of the 103 train articles
    with pytest.raises(ValueError, match="in \\(0, 1\\)"):
        domain_study.holdout(1.0)


def test_the_summary_pairs_each_row_with_every_baseline_of_its_seed(tmp_path):
    rng = np.random.default_rng(0)
    frozen = rng.random(300) < 0.4
    bm25 = frozen | (rng.random(300) < 0.4)
    hits = {
        "frozen": frozen,
        "bm25": bm25,
        "hybrid_frozen": bm25 | (rng.random(300) < 0.1),
        "pdist_k16_hybrid": bm25 | (rng.random(300) < 0.3),
    }
    results = {"rows": {}}
    for name, row in hits.items():
        folder = tmp_path / "seed0" / name
        folder.mkdir(parents=True)
        lines = [json.dumps({"id": f"q{i}", "gold_recall@5": float(h)}) for i, h in enumerate(row)]
        (folder / "per_question.jsonl").write_text("\n".join(lines) + "\n")
        results["rows"][name] = {"final": {"gold_recall@5": float(row.mean())}, "seconds": 1.0}
    (tmp_path / "seed0" / "results.json").write_text(json.dumps(results))
    table = domain_study.summary(tmp_path, [0])
    row = table["pdist_k16_hybrid"]
    for baseline in domain_study.BASELINES:
        d = row["versus_" + baseline]["seed0"]["gold_recall@5"]
        base = paired.read_per_question(tmp_path / "seed0" / baseline / "per_question.jsonl")
        want = np.mean([r["gold_recall@5"] for r in base.values()])
        assert d["a"] == pytest.approx(want) and d["questions"] == 300
    assert row["versus_frozen"]["seed0"]["gold_recall@5"]["low"] > 0
    assert "versus_bm25" not in table["bm25"]
    text = domain_study.markdown(table)
    for baseline in domain_study.BASELINES:
        assert f"Paired differences from {baseline}" in text


def _toy_domain(shared_data, folder: pathlib.Path, articles: int = 2) -> tuple:
    """COVID-QA's first `articles` articles as a folder of .txt documents (one per article, the
    passages' words in order), and their questions as train (the first) and dev (the rest), with
    gold ids of the folder's passages (`<article>_<window>`: the same windows)."""
    source = shared_data / "covidqa"
    passages = [json.loads(line) for line in (source / "passages.jsonl").open()]
    chosen = list(dict.fromkeys(p["id"].rsplit("_", 1)[0] for p in passages))[:articles]
    docs = folder / "docs"
    docs.mkdir(parents=True)
    for article in chosen:
        own = [p for p in passages if p["id"].rsplit("_", 1)[0] == article]
        text, title = " ".join(p["text"] for p in own), own[0]["title"]
        if text.startswith(title + " "):  # the title on a line of its own: the same words
            text = title + "\n" + text[len(title) + 1 :]
        (docs / f"{article}.txt").write_text(text + "\n", encoding="utf-8")
    questions = [json.loads(line) for line in (source / "questions.jsonl").open()]
    lines = []
    for q in questions:
        article = q["gold_passage_id"].rsplit("_", 1)[0]
        if article in chosen:
            split = "train" if article == chosen[0] else "dev"
            lines.append(json.dumps(dict(q, split=split)))
    path = folder / "questions.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return docs, path


@pytest.mark.slow  # SmolLM2 scores ~600 (question, passage) pairs and answers ~20 questions
def test_the_whole_study_at_toy_size(shared_data, tmp_path, monkeypatch):
    """Two COVID-QA articles as a folder of plain documents: the no-training rows and PDist over
    hybrid candidates, filled ahead, with SmolLM2 read zero-shot; every row writes per-question
    records with gold recall@1/5/20 and F1, and the summary pairs them; a later call adds the
    gold row, which trains without the reader."""
    if not (shared_data / "covidqa").is_dir():
        pytest.skip(reason=f"COVID-QA not found in {shared_data}")
    try:
        hf_llama.smollm2_path()
    except FileNotFoundError as e:
        pytest.skip(reason=str(e))
    docs, questions = _toy_domain(shared_data, tmp_path)
    # The folder's windows are COVID-QA's passages, so its gold ids hold.
    ids = {p.id.rsplit("/", 1)[-1] for p in documents.read_documents(docs)}
    gold = {json.loads(line)["gold_passage_id"] for line in questions.read_text().splitlines()}
    assert gold <= ids
    out = tmp_path / "study"
    sets = {
        "data.corpus_path": str(docs),
        "data.train_path": str(questions),
        "data.eval_path": str(questions),
        "warm_start.reader_steps": 0,
        "train.steps": 4,
        "train.warmup_steps": 1,
        "train.save_every": 1000,
        "eval.every": 0,
        "retrieval.fusion_depth": 20,
        "train.num_devices": 1,  # not the tests' 8 fake devices: one SmolLM2 copy, not eight
    }
    argv = ["--out", str(out), "--seeds", "0", "--fill_memo", "hybrid"]
    argv += ["--rows", "bm25,frozen,hybrid_frozen,pdist_k16_hybrid"]
    argv += [f"--set={k}={json.dumps(v)}" for k, v in sets.items()]
    domain_study.main(argv + ["--keep", str(tmp_path / "kept")])
    fill = json.loads((out / "memo_fill.json").read_text())
    assert fill["pairs"] == fill["questions"] * 16 and fill["computed"] > 0
    for row in ("bm25", "frozen", "hybrid_frozen", "pdist_k16_hybrid"):
        records = paired.read_per_question(out / "seed0" / row / "per_question.jsonl")
        assert records and all(
            {"gold_recall@1", "gold_recall@5", "gold_recall@20", "f1"} <= set(r)
            for r in records.values()
        )
    table = json.loads((out / "summary.json").read_text())
    assert "gold_recall@20" in table["pdist_k16_hybrid"]["versus_bm25"]["seed0"]
    assert (tmp_path / "kept" / "seed0" / "pdist_k16_hybrid.jsonl.gz").is_file()

    # The supervised ceiling reads no reader in training: the frozen generator's likelihoods
    # would train nothing (the reader still answers in its evaluation).
    def refuse(*args, **kwargs):
        raise AssertionError("the gold row asked the answer memo for the reader's likelihoods")

    monkeypatch.setattr(memo.AnswerMemo, "logprobs", refuse)
    domain_study.main([*argv[:4], "--rows", "gold_hybrid", *argv[8:]])
    records = paired.read_per_question(out / "seed0" / "gold_hybrid" / "per_question.jsonl")
    assert (
        records.keys()
        == paired.read_per_question(out / "seed0" / "frozen" / "per_question.jsonl").keys()
    )
    assert "gold_hybrid" in json.loads((out / "summary.json").read_text())

    # The passage tower's top layers trained by the reader (`*_passages`), in a study of its own
    # sharing the first one's caches (its memo: the same candidates, no new reader calls): the
    # index is re-encoded every 2 steps from the head's parameters, which moved, while the trunk's
    # are MiniLM's.
    monkeypatch.undo()
    second = tmp_path / "passages"
    head = ["--rows", "pdist_k16_hybrid_passages", "--set=retrieval.refresh_every=2"]
    domain_study.main(["--out", str(second), "--caches", str(out), *argv[2:4], *head, *argv[8:]])
    row = second / "seed0" / "pdist_k16_hybrid_passages"
    assert paired.read_per_question(row / "per_question.jsonl").keys() == records.keys()
    snapshot = (row / "index_refresh" / "step_2.msgpack").read_bytes()
    snapshot = flax.serialization.msgpack_restore(snapshot)
    minilm = domain_study.CONFIGS["covidqa"].get_config().model.question_encoder_path
    _, start = hf.load_bert(minilm)
    layers = {k for k in snapshot if k.startswith("layer_")}
    assert len(layers) == 6, sorted(snapshot)
    moved = lambda name: (
        not all(  # noqa: E731
            np.array_equal(a, b)
            for a, b in zip(jax.tree.leaves(snapshot[name]), jax.tree.leaves(start[name]))
        )
    )
    assert {name for name in layers if moved(name)} == {"layer_4", "layer_5"}


@pytest.mark.slow  # ~4 min on 2 cores: SmolLM2's trunk states of 32 rows, 2 steps, 3 evaluations
def test_the_reader_rows_at_toy_size(shared_data, tmp_path, monkeypatch):
    """Two COVID-QA articles as documents, 8 training questions, 4 fixed candidates each: the
    bolt-on reader, the pipeline (its reader fine-tuned apart on the train split's questions
    only) and the joint reader (its top layers on cached trunk states, with the question tower)
    each write per-question records; the joint row moved the reader's top layers and the question
    tower, and nothing else of the reader."""
    if not (shared_data / "covidqa").is_dir():
        pytest.skip(reason=f"COVID-QA not found in {shared_data}")
    try:
        hf_llama.smollm2_path()
    except FileNotFoundError as e:
        pytest.skip(reason=str(e))
    docs, questions = _toy_domain(shared_data, tmp_path)
    split = {q["id"]: q["split"] for q in map(json.loads, questions.read_text().splitlines())}
    read = []  # the questions every reader warm start trains on
    warm_start = reader.reader_warm_start
    monkeypatch.setattr(
        reader,
        "reader_warm_start",
        lambda *args, **kwargs: read.extend(e.id for e in args[4]) or warm_start(*args, **kwargs),
    )
    out = tmp_path / "study"
    sets = {
        "data.corpus_path": str(docs),
        "data.train_path": str(questions),
        "data.eval_path": str(questions),
        "data.max_train": 8,
        "warm_start.reader_steps": 0,  # SmolLM2 as it is, then (pipeline) 2 steps on the domain
        "train.retriever_candidates": 4,
        "train.steps": 2,
        "train.warmup_steps": 1,
        "train.save_every": 1000,
        "eval.every": 0,
        "retrieval.fusion_depth": 20,
        "train.num_devices": 1,
    }
    pipeline = {**domain_study.ROWS["pipeline"], "warm_start.reader_domain_steps": 2}
    monkeypatch.setitem(domain_study.ROWS, "pipeline", pipeline)
    rows = ["frozen_reader", "pipeline", "joint_reader"]
    argv = ["--out", str(out), "--seeds", "0", "--rows", ",".join(rows)]
    domain_study.main(argv + [f"--set={k}={json.dumps(v)}" for k, v in sets.items()])
    for row in rows:
        records = paired.read_per_question(out / "seed0" / row / "per_question.jsonl")
        assert records and {split[q] for q in records} == {"dev"}
        assert all({"gold_recall@5", "f1"} <= set(r) for r in records.values())
    assert read and {split[q] for q in read} == {"train"}  # the pipeline's reader: no dev
    assert len(set(read)) <= 8  # what the run trains on (data.max_train), not the whole file

    def params(row):
        return bundle.load(out / "seed0" / row / "bundle", verify=False).params

    before, after = params("frozen_reader"), params("joint_reader")  # the first trains nothing
    flat = lambda tree: {  # noqa: E731
        jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }
    moved = set()
    for tower in ("question_encoder", "generator", "passage_encoder"):
        a, b = flat(before[tower]), flat(after[tower])
        moved |= {f"{tower}{k}" for k in a if not np.array_equal(a[k], b[k])}
    generator = {k.split("'")[1] for k in moved if k.startswith("generator")}
    assert generator == {"layers_28", "layers_29", "norm"}, sorted(generator)
    assert any(k.startswith("question_encoder") for k in moved)
    assert not any(k.startswith("passage_encoder") for k in moved)
