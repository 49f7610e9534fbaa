"""Crafted bundles, sealed again so that every checksum agrees: a load refuses, naming the file
and the field, a config.json value out of its type or range (`bundle_config`), a tokenizer
config naming a file outside its folder or not listed (`bundle_tokenizers`), and a file the
manifest does not list (`bundle_format.check_listed`), as an edit does; a question or an edited
passage in which the tokenizers read no word is refused naming its field (`content`)."""

import json
import os
import pathlib
import re
import shutil

import pytest
import transformers

from rag_jax.io import bundle, bundle_config, bundle_format
from rag_jax.retrieval import files
from rag_jax.retrieval.corpus import Passage

# Text the tiny run's vocabulary (225 tokens) reads: one of its passages' words.
WORDS = "the childhood home of tune tunisa stood in selby near the old mill ."
# A combining accent, a private-use character, the replacement character: visible (drawn) but
# the tiny run's tokenizer reads nothing in them; special tokens alone.
NOTHING = ["\u0301", "\ue000", "\ufffd", "\u0301\ue000\ufffd", "[CLS] [SEP]"]
# `[UNK]` itself, and "é" and "t" (out of the tiny vocabulary): the unknown token alone.
UNKNOWN_ONLY = ["[UNK]", "\xe9", "t"]


@pytest.fixture
def copy(tiny_trained_run, tmp_path) -> pathlib.Path:
    """A copy of the trainer's bundle, free to craft."""
    target = tmp_path / "bundle"
    shutil.copytree(tiny_trained_run[0] / "bundle", target)
    return target


def _manifest(directory: pathlib.Path) -> dict:
    return files.read_manifest(directory, {bundle.FORMAT: (bundle.VERSION,)}, what="bundle")


def _reseal(directory: pathlib.Path, *rels: str) -> None:
    """Records the files `rels` as they are now and seals the manifest again: consistent to
    every checksum, crafted in content."""
    manifest = _manifest(directory)
    records = {rel: files.file_record(directory / rel) for rel in rels}
    files.write_manifest(directory, {**manifest, "files": {**manifest["files"], **records}})


def _craft_json(directory: pathlib.Path, rel: str, change) -> None:
    """Rewrites the JSON file `rel` with `change(value)` applied, sealed again."""
    path = directory / rel
    value = json.loads(path.read_text())
    change(value)
    path.write_text(json.dumps(value))
    _reseal(directory, rel)


# ---------------------------------------------------------------------------------------------
# config.json


def _set(field: str, value):
    """A change to config.json setting the dotted `field` (deleting it when `value` is ...)."""

    def change(config):
        *parents, last = field.split(".")
        for key in parents:
            config = config[key]
        if value is ...:
            del config[last]
        else:
            config[last] = value

    return change


CRAFTED = [  # (field, value, what the refusal says)
    ("settings.question_length", -3, "must be in [1, 128]"),
    ("rag.generation.max_length", 10**7, "must be in [1, 128] (at most the generator's"),
    ("passage_encoder.max_length", 10**7, "must be in [1, 128] (at most the passage tower's"),
    ("rag.max_combined_length", 10**6, "at most the generator's positions"),
    ("rag.question_encoder.dtype", "complex128", "must be one of ['float32', 'bfloat16']"),
    ("rag.generator.param_dtype", "float64", "must be one of ['float32', 'bfloat16']"),
    ("rag.generation.num_beams", 100_000, f"must be in [1, {bundle_config.MAX_BEAMS}]"),
    ("rag.generation.num_beams", 0, "must be in [1, 64]"),
    ("rag.n_docs", 500, "MAX_N_DOCS, and the 192 passages"),
    ("passage_encoder.batch_size", 10**9, "bundle_config.MAX_ENCODE_BATCH"),
    ("settings.variant", "both", "must be one of ['sequence', 'token']"),
    ("settings.index", "scann", "must be one of ['exact'] (the index the manifest names)"),
    ("settings.question_length", 24.0, "expected int"),
    ("settings.keep_question", 0, "expected bool"),
    ("rag.generator.vocab_size", "225", "expected int"),
    ("rag.generation.length_penalty", float("nan"), "expected a finite float"),
    ("rag.doc_score_scale", float("inf"), "expected a finite float"),
    ("rag.generator.eos_token_id", 10**6, "expected a token id in [0, 225)"),
    ("rag.generation.forced_bos_token_id", -1, "expected a token id in [0, 225)"),
    ("rag.generation.bad_words_ids", [[]], "none empty"),
    ("rag.generation.min_length", 7, "must be in [0, 6] (at most max_length)"),
    ("rag.question_encoder.num_attention_heads", 3, "divide hidden_size (64)"),
    ("rag.question_encoder.hidden_dropout_prob", 1.5, "a probability in [0, 1)"),
    ("rag.generator.attention_impl", "magic", "must be one of ['xla', 'flash'"),
    ("rag.generator.frozen_encoder_layers", 3, "must be in [0, 2]"),
    ("rag.generator.shiny", 1, "not a field of BartConfig"),
    ("settings.question_length", ..., "missing"),
    ("passage_encoder.input_format", ..., "missing"),
    ("rag.generation", [], "expected an object"),
]


@pytest.mark.parametrize(("field", "value", "says"), CRAFTED, ids=lambda x: str(x)[:40])
def test_a_crafted_config_value_is_refused_at_load_naming_the_file_and_field(
    copy, field, value, says
):
    _craft_json(copy, "config.json", _set(field, value))
    with pytest.raises(ValueError) as refused:
        bundle.load(copy)
    message = str(refused.value)
    assert message.startswith(f"{copy / 'config.json'}: {field} = "), message
    assert says in message, message


def test_a_config_within_its_bounds_loads_and_missing_fields_take_their_defaults(copy):
    """The checks refuse nothing a run writes: an edge of each bound loads, and a field added
    since a bundle was written (absent from its config) takes its default."""
    _craft_json(copy, "config.json", _set("settings.keep_question", ...))
    _craft_json(copy, "config.json", _set("rag.generation.num_beams", bundle_config.MAX_BEAMS))
    _craft_json(copy, "config.json", _set("settings.question_length", 128))
    model = bundle.load(copy)
    assert model.settings.keep_question is False
    assert model.rag_cfg.generation.num_beams == 64 and model.settings.question_length == 128


def test_a_manifest_count_that_is_not_a_number_is_refused(copy):
    files.write_manifest(copy, {**_manifest(copy), "count": "192"})
    with pytest.raises(ValueError, match=r"manifest.json: count '192' is not a number"):
        bundle.load(copy)


# ---------------------------------------------------------------------------------------------
# Tokenizer configs


QUESTION = "tokenizers/question"
TOKENIZER_CONFIG = f"{QUESTION}/tokenizer_config.json"


def _outside_tokenizer(copy: pathlib.Path) -> pathlib.Path:
    """A tokenizer.json outside the bundle, the question tokenizer's with one token renamed
    "zzoutside": a tokenizer holding that token read it."""
    tokenizer = json.loads((copy / QUESTION / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["zzoutside"] = vocab.pop(max(vocab, key=vocab.get))
    outside = copy.parent / "outside" / "tokenizer.4.0.0.json"
    outside.parent.mkdir()
    outside.write_text(json.dumps(tokenizer))
    return outside


def test_fast_tokenizer_files_outside_the_bundle_are_refused_before_transformers_reads_them(
    copy,
):
    _outside_tokenizer(copy)
    entry = "../../../outside/tokenizer.4.0.0.json"
    _craft_json(copy, TOKENIZER_CONFIG, lambda c: c.update(fast_tokenizer_files=[entry]))
    # transformers alone reads it: the tokenizer it makes holds the outside file's token.
    read = transformers.BertTokenizer.from_pretrained(str(copy / QUESTION), local_files_only=True)
    assert "zzoutside" in read.get_vocab()
    with pytest.raises(ValueError) as refused:
        bundle.load(copy)
    assert str(refused.value) == (
        f"{copy / TOKENIZER_CONFIG}: fast_tokenizer_files names {entry!r}, not a file of this "
        "tokenizer folder that the bundle's manifest lists; a bundle's tokenizer reads only its "
        "own files"
    )


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("vocab_file", "/etc/passwd"),
        ("merges_file", "../generator/tokenizer.json"),  # in the bundle, not in its folder
        ("tokenizer_file", "vocab.txt"),  # a name in the folder, but no file it lists
        ("vocab", "../../params/generator.safetensors"),  # a string vocabulary is a path
        ("gguf_file", "model.gguf"),
        ("fast_tokenizer_files", ["tokenizer.json", "../x/tokenizer.9.0.0.json"]),
        ("vocab_files", ["tokenizer.json"]),  # listed, but a list only transformers' own
    ],
)
def test_a_tokenizer_config_entry_naming_a_file_not_listed_in_its_folder_is_refused(
    copy, key, value
):
    _craft_json(copy, TOKENIZER_CONFIG, lambda c: c.update({key: value}))
    with pytest.raises(ValueError, match=re.escape(f"{copy / TOKENIZER_CONFIG}: {key} names")):
        bundle.load(copy)


def test_a_file_named_below_a_tokenizer_configs_top_level_is_refused(copy):
    nested = {"model_file": "/etc/passwd"}
    _craft_json(copy, TOKENIZER_CONFIG, lambda c: c.update(sp_model_kwargs=nested))
    with pytest.raises(ValueError, match=r"sp_model_kwargs.model_file names a file below the"):
        bundle.load(copy)


def test_a_tokenizer_config_naming_its_own_listed_file_loads_it_from_the_folder(
    copy, tmp_path, monkeypatch
):
    """A listed file named by a bare name is handed to transformers as the folder's: given as
    is, it would be opened from the process's folder, here holding another tokenizer.json."""
    _craft_json(copy, TOKENIZER_CONFIG, lambda c: c.update(tokenizer_file="tokenizer.json"))
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    shutil.copyfile(_outside_tokenizer(copy), elsewhere / "tokenizer.json")
    monkeypatch.chdir(elsewhere)
    model = bundle.load(copy)
    assert "zzoutside" not in model.question_tokenizer.get_vocab()
    assert model.question_tokenizer.get_vocab() == model.generator_tokenizer.get_vocab()


# ---------------------------------------------------------------------------------------------
# Files the manifest does not list


@pytest.mark.parametrize(
    "rel",
    [
        "params/notes.txt",
        "passages/extra.bin",
        f"{QUESTION}/special_tokens_map.json",  # transformers reads it by its name
        ".DS_Store",
    ],
)
def test_a_file_the_manifest_does_not_list_is_refused_at_load_and_by_an_edit(copy, rel):
    model = bundle.load(copy)
    (copy / rel).write_text("{}")
    with pytest.raises(ValueError, match=re.escape(f"{copy / rel} is not listed in {copy}/")):
        bundle.load(copy)
    # The bundle loaded before the file came: its edit refuses it too (and writes nothing).
    with pytest.raises(bundle_format.DamagedBundleError, match=re.escape(f"{copy / rel} is not")):
        model.edit(upserts=[Passage("new", "", WORDS)])
    (copy / rel).unlink()
    assert model.edit(upserts=[Passage("new", "", WORDS)])["count"] == 193
    assert bundle_format.unlisted(copy, _manifest(copy)) == []  # an edit leaves none
    assert len(bundle.load(copy).store) == 193


def test_a_link_to_a_folder_the_manifest_does_not_list_is_refused(copy, tmp_path):
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "default.jinja").write_text("{{ messages }}")
    # transformers reads every template of this folder by its name.
    os.symlink(templates, copy / QUESTION / "additional_chat_templates")
    with pytest.raises(ValueError, match=r"question/additional_chat_templates/ is not listed"):
        bundle.load(copy)


# ---------------------------------------------------------------------------------------------
# Text with no word for the tokenizers


@pytest.mark.parametrize("text", NOTHING + UNKNOWN_ONLY, ids=ascii)
def test_a_question_or_passage_text_with_no_word_is_refused_naming_its_field(copy, text):
    model = bundle.load(copy)
    with pytest.raises(ValueError, match=r"^questions\[1\]: expected a question with a word"):
        model.answer([WORDS, text])
    before = files.files_under(copy)
    with pytest.raises(ValueError, match=r"^upserts\[1\].text \(id 'b'\): expected a text"):
        model.edit(upserts=[Passage("a", "", WORDS), Passage("b", "", text)])
    assert files.files_under(copy) == before and len(model.store) == 192


def test_a_title_read_as_nothing_is_refused_and_one_of_unknown_words_kept(copy):
    """A title is a label beside a text with words: refused when the tokenizers read nothing
    (or special tokens alone) in it, kept when they read words their vocabulary lacks."""
    model = bundle.load(copy)
    for title in NOTHING:
        with pytest.raises(ValueError, match=r"^upserts\[0\].title \(id 'a'\): expected a title"):
            model.edit(upserts=[Passage("a", title, WORDS)])
    assert len(model.store) == 192
    model.edit(upserts=[Passage(f"u{i}", t, WORDS) for i, t in enumerate(UNKNOWN_ONLY)])
    assert [model.store.title(192 + i) for i in range(3)] == UNKNOWN_ONLY


def test_a_blank_title_or_the_one_a_passage_has_is_not_checked(copy):
    model = bundle.load(copy)
    model.edit(upserts=[Passage("blank", " ", WORDS)])  # a blank title is no title
    assert model.store.title(len(model.store) - 1) == " "  # appended last

    class Store:  # a passage whose title has no word: one an edit keeps as it is
        def title(self, row):
            return "\ue000"

    replaced = {"old": Passage("old", "\ue000", WORDS)}
    bundle._check_content(model._content, replaced, {"old": 0}, Store())  # kept: not checked
    with pytest.raises(ValueError, match=r"^upserts\[0\].title \(id 'old'\)"):
        bundle._check_content(model._content, replaced, {}, Store())  # a new passage's title
