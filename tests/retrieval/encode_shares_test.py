"""Corpus encoding over several processes, the parts one process can check: which shards each
process encodes, and how a run finishes from what killed processes left (the shard record files).

The two-process runs themselves are in tests/devices/multihost_encode_test.py (slow).
"""

import hashlib
import json
import pathlib

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import hf_fixtures
from rag_jax.devices import distributed
from rag_jax.io import hf
from rag_jax.retrieval import encode, vectors

MAX_LENGTH, BUCKETS, SHARD = 40, (16, 32, 40), 6
WORDS = "a river flows past old towns where bakers sell bread and bells ring at dawn".split()


class Store:
    """The store protocol of `encode_corpus` over a list; records the rows whose text it read."""

    def __init__(self, passages):
        self.passages = passages
        self.reads: list[int] = []
        self.checksum = hashlib.sha256(json.dumps(passages).encode()).hexdigest()

    def __len__(self):
        return len(self.passages)

    def title(self, i):
        return self.passages[i][0]

    def text(self, i):
        self.reads.append(i)
        return self.passages[i][1]


def _passages(count: int) -> list[tuple[str, str]]:
    rng = np.random.default_rng(11)
    return [
        (" ".join(rng.choice(WORDS, 2)).title(), " ".join(rng.choice(WORDS, rng.integers(3, 40))))
        for _ in range(count)
    ]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_bert")
    tokenizer = hf.load_tokenizer(hf_fixtures.minilm_path())
    hf_fixtures.save_bert(path, vocab_size=tokenizer.vocab_size, max_position_embeddings=48)
    cfg, params = hf.load_bert(path)
    return cfg, params, tokenizer


def _encode(tiny, store, out_dir):
    cfg, params, tokenizer = tiny
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    return encode.encode_corpus(
        store, cfg, params, tokenizer, out_dir, max_length=MAX_LENGTH, batch_size=4,
        buckets=BUCKETS, shard_size=SHARD, sort_window=4, mesh=mesh, progress=False,
    )  # fmt: skip


def _files(directory: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_process_shards_deal_every_unfinished_shard_to_one_process():
    todo = [0, 1, 2, 3, 4, 5, 6, 7]
    shares = [distributed.process_shards(todo, p, 3) for p in range(3)]
    assert shares == [[0, 3, 6], [1, 4, 7], [2, 5]]
    # A re-run after process 1 of 2 died having done shards 1 and 3 (process 0 all of its own):
    # what is left is dealt over both processes again, not left to process 1 alone.
    left = [5, 7]
    assert [distributed.process_shards(left, p, 2) for p in range(2)] == [[5], [7]]
    assert distributed.process_shards([4], 1, 2) == []  # more processes than shards: some idle
    assert distributed.process_shards(left, 0, 1) == left
    with pytest.raises(ValueError, match="process 2 is not one of 2"):
        distributed.process_shards(todo, 2, 2)


def test_a_run_finishes_from_the_records_killed_processes_left(tiny, tmp_path):
    """The directory two processes leave when killed: process 0's manifest of the run's fields
    (no shards yet), shards with their record files, a shard renamed but not recorded, a damaged
    record. One process finishes it: it encodes only the shards no intact record covers, and the
    directory ends byte for byte as a one-process run writes it, records gone."""
    passages = _passages(45)  # 8 shards of 6, the last of 3
    whole = _encode(tiny, Store(passages), tmp_path / "whole")
    assert [s["index"] for s in whole["shards"]] == list(range(8))

    part = tmp_path / "part"
    part.mkdir()
    vectors.write_manifest(part, {**whole, "shards": []})
    by_index = {s["index"]: s for s in whole["shards"]}
    for index in (0, 1, 3, 4, 6):  # finished and recorded, by either process
        (part / vectors.shard_name(index)).write_bytes(
            (tmp_path / "whole" / by_index[index]["file"]).read_bytes()
        )
        vectors.write_record(part, by_index[index])
    # Shard 4's record is damaged: it no longer matches its seal, so shard 4 is encoded again.
    record4 = part / vectors.record_name(4)
    sha4 = by_index[4]["sha256"]
    record4.write_text(record4.read_text().replace(sha4, sha4[::-1]))
    # Shard 5 was renamed into place by a process killed before its record: not trusted.
    (part / vectors.shard_name(5)).write_bytes(b"unrecorded")
    # Shard 6's record survived but its file was lost: encoded again.
    (part / vectors.shard_name(6)).unlink()
    (part / "vectors-00007.npy.tmp123").write_bytes(b"half")  # a write cut short

    store = Store(passages)
    finished = _encode(tiny, store, part)
    redone = [2, 4, 5, 6, 7]
    want = [r for s in redone for r in range(SHARD * s, min(45, SHARD * (s + 1)))]
    assert sorted(store.reads) == want
    assert finished == whole
    assert _files(part) == _files(tmp_path / "whole")  # no record files left, same bytes


def test_records_of_a_finished_shard_are_folded_into_the_manifest(tiny, tmp_path):
    """`prepare_dir` counts a shard as finished from its record as from the manifest's entry,
    and the manifest written after it lists the entry in shard order."""
    passages = _passages(15)  # shards of 6, 6, 3
    whole = _encode(tiny, Store(passages), tmp_path)
    header = {k: v for k, v in whole.items() if k != "shards"}
    vectors.write_manifest(tmp_path, {**header, "shards": whole["shards"][:1]})
    vectors.write_record(tmp_path, whole["shards"][2])
    manifest = {**header, "shards": []}
    done = vectors.prepare_dir(tmp_path, manifest, overwrite=False)
    assert done == {0, 2}
    assert manifest["shards"] == [whole["shards"][0], whole["shards"][2]]
    vectors.remove_records(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("vectors-*.json")) == []
