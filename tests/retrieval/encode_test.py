"""Corpus encoding: parity with BertEncoder and PyTorch, bucketing, devices, shards, resume."""

import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import Mesh

import hf_fixtures
from rag_jax.io import hf
from rag_jax.models import bert
from rag_jax.retrieval import encode, encoder_id, vectors
from rag_jax.retrieval.store import PassageStore
from rag_jax.run.index_build import build_index

MAX_LENGTH = 40
BUCKETS = (16, 32, 40)
WORDS = (
    "the river flows north through a valley of old stone towns where bakers sell bread at dawn "
    "and children count boats while a bell rings over quiet orchards near the harbour"
).split()


def _passages(count: int, seed: int = 0) -> list[tuple[str, str]]:
    """(title, text) pairs of varied length; every fifth title is empty, some exceed MAX_LENGTH."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        title = "" if i % 5 == 3 else " ".join(rng.choice(WORDS, rng.integers(1, 4)))
        text = " ".join(rng.choice(WORDS, int(rng.integers(1, 45))))
        out.append((title.title(), text))
    return out


class ListStore:
    """The store protocol of `encode_corpus` over a list; counts reads, can fail at one row."""

    def __init__(self, passages, fail_at: int | None = None):
        self.passages = list(passages)
        self.fail_at = fail_at
        self.reads: list[int] = []
        self.checksum = hashlib.sha256(json.dumps(self.passages).encode()).hexdigest()

    def __len__(self):
        return len(self.passages)

    def title(self, i):
        return self.passages[i][0]

    def text(self, i):
        if i == self.fail_at:
            raise RuntimeError(f"simulated interruption at passage {i}")
        self.reads.append(i)
        return self.passages[i][1]


def _mesh(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), ("data",))


@pytest.fixture(scope="module")
def tokenizer():
    return hf.load_tokenizer(hf_fixtures.minilm_path())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    """Tiny random BERT over MiniLM's vocabulary, saved with that tokenizer: (path, cfg, params)."""
    path = tmp_path_factory.mktemp("tiny_bert")
    hf_fixtures.save_bert(path, vocab_size=tokenizer.vocab_size, max_position_embeddings=48)
    tokenizer.save_pretrained(path)
    cfg, params = hf.load_bert(path)
    return path, cfg, params


def _direct(cfg, params, token_ids) -> np.ndarray:
    """Reference: one BertEncoder call on all passages in input order, padded to the longest."""
    width = max(len(t) for t in token_ids)
    ids = np.zeros((len(token_ids), width), np.int32)
    mask = np.zeros_like(ids)
    for row, t in enumerate(token_ids):
        ids[row, : len(t)], mask[row, : len(t)] = t, 1
    apply_fn = jax.jit(lambda p, i, m: bert.BertEncoder(cfg).apply({"params": p}, i, m)[0])
    return np.asarray(apply_fn(params, ids, mask))


def _encode(tiny, tokenizer, passages, **kwargs):
    _, cfg, params = tiny
    kwargs = {"max_length": MAX_LENGTH, "batch_size": 4, "buckets": BUCKETS, **kwargs}
    titles, texts = zip(*passages, strict=True)
    return encode.encode_passages(cfg, params, tokenizer, titles, texts, **kwargs)


def _corpus(tiny, tokenizer, store, out_dir, **kwargs):
    _, cfg, params = tiny
    kwargs = {
        "max_length": MAX_LENGTH,
        "batch_size": 4,
        "buckets": BUCKETS,
        "shard_size": 6,
        "sort_window": 4,
        "mesh": _mesh(8),
        "progress": False,
        **kwargs,
    }
    return encode.encode_corpus(store, cfg, params, tokenizer, out_dir, **kwargs)


def _files(directory: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


# ---------------------------------------------------------------------------------------------
# Input format


def test_pair_format_is_dprs(tokenizer):
    long_text = " ".join(WORDS * 3)
    ids = encode.tokenize_passages(
        tokenizer, ["Old Towns", "", "Old Towns"], ["  bakers sell bread ", "bakers", long_text], 16
    )
    tokens = [tokenizer.convert_ids_to_tokens(row) for row in ids]
    assert tokens[0] == ["[CLS]", "old", "towns", "[SEP]", "baker", "##s", "sell", "bread", "[SEP]"]
    assert tokens[1] == ["[CLS]", "baker", "##s", "[SEP]"]  # no title: the text alone, as DPR
    # Truncation keeps the title and the final [SEP], and cuts the text.
    assert len(tokens[2]) == 16
    assert tokens[2][:4] == ["[CLS]", "old", "towns", "[SEP]"] and tokens[2][-1] == "[SEP]"
    single = encode.tokenize_passages(tokenizer, ["Old Towns"], ["bakers"], 16, "single")
    expected = ["[CLS]", "old", "towns", "baker", "##s", "[SEP]"]  # title + " " + text
    assert tokenizer.convert_ids_to_tokens(single[0]) == expected


# ---------------------------------------------------------------------------------------------
# Numerics


def test_vectors_equal_direct_encoder_outputs(tiny, tokenizer):
    _, cfg, params = tiny
    passages = _passages(21)
    vectors = _encode(tiny, tokenizer, passages, mesh=_mesh(8))
    titles, texts = zip(*passages, strict=True)
    token_ids = encode.tokenize_passages(tokenizer, titles, texts, MAX_LENGTH)
    lengths = {len(t) for t in token_ids}
    assert max(lengths) == MAX_LENGTH and min(lengths) < BUCKETS[0]  # lengths span the buckets
    assert vectors.shape == (21, cfg.hidden_size) and vectors.dtype == np.float32
    np.testing.assert_allclose(vectors, _direct(cfg, params, token_ids), atol=1e-5, rtol=1e-5)
    assert np.abs(vectors).max() > 0.5


def test_vectors_equal_pytorch_on_real_minilm(tokenizer):
    path = hf_fixtures.minilm_path()
    cfg, params = hf.load_bert(path)
    passages = [
        ("Marie Curie", "Marie Curie was born in Warsaw, in the Kingdom of Poland."),
        (
            "Canberra",
            "Canberra was chosen as the capital as a compromise between Sydney and "
            "Melbourne, the two largest cities of Australia, and became the seat of government.",
        ),
        ("", "Water boils at 100 degrees Celsius at sea level."),
        ("Great Barrier Reef", "The Great Barrier Reef lies off the coast of Queensland. " * 6),
    ]
    titles, texts = zip(*passages, strict=True)
    ours = encode.encode_passages(
        cfg,
        params,
        tokenizer,
        titles,
        texts,
        max_length=64,
        batch_size=3,
        buckets=(64,),
        mesh=_mesh(1),
    )
    model = transformers.BertModel.from_pretrained(str(path)).eval()
    for row, (title, text) in enumerate(passages):
        args = (title, text) if title else (text,)
        ids = tokenizer(*args, truncation=True, max_length=64, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            ref = model(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                token_type_ids=torch.zeros_like(ids),  # DPR's passage segments
            ).last_hidden_state[0, 0]
        np.testing.assert_allclose(ours[row], ref.numpy(), atol=1e-4, rtol=0)


def test_dpr_context_encoder_with_projection_matches_pytorch(tokenizer, tmp_path):
    # One layer: the [CLS]-only last layer then follows the embeddings directly.
    torch_model = hf_fixtures.save_dpr(
        tmp_path,
        "context",
        vocab_size=tokenizer.vocab_size,
        max_position_embeddings=48,
        num_hidden_layers=1,
        projection_dim=5,
    )
    cfg, params = hf.load_dpr(tmp_path)
    passages = _passages(6, seed=11)
    ours = _encode((tmp_path, cfg, params), tokenizer, passages, mesh=_mesh(8))
    titles, texts = zip(*passages, strict=True)
    token_ids = encode.tokenize_passages(tokenizer, titles, texts, MAX_LENGTH)
    assert ours.shape == (6, 5)
    np.testing.assert_allclose(ours, _direct(cfg, params, token_ids), atol=1e-5, rtol=1e-5)
    for row, ids in enumerate(token_ids):
        ids = torch.tensor([ids])
        with torch.no_grad():
            ref = torch_model(input_ids=ids, token_type_ids=torch.zeros_like(ids)).pooler_output
        np.testing.assert_allclose(ours[row], ref[0].numpy(), atol=1e-4, rtol=0)


def test_bucketing_keeps_results_and_order_and_compiles_once_per_bucket(tiny, tokenizer):
    _, cfg, params = tiny
    passages = _passages(21, seed=1)
    titles, texts = zip(*passages, strict=True)
    lengths = [len(t) for t in encode.tokenize_passages(tokenizer, titles, texts, MAX_LENGTH)]
    plan = encode.plan_batches(np.array(lengths), 8, BUCKETS)
    used = {length for _, length in plan}
    assert len(plan) > len(used) > 1  # some bucket serves several batches
    encode.make_encode_fn.cache_clear()
    bucketed = _encode(tiny, tokenizer, passages, mesh=_mesh(8), batch_size=8)
    assert encode.make_encode_fn(cfg, _mesh(8), "float32")._cache_size() == len(used)
    unbucketed = _encode(tiny, tokenizer, passages, mesh=_mesh(8), buckets=(MAX_LENGTH,))
    np.testing.assert_allclose(bucketed, unbucketed, atol=1e-5, rtol=1e-5)
    # Reversing the input reverses the output: rows are written back in input order.
    reversed_ = _encode(tiny, tokenizer, passages[::-1], mesh=_mesh(8))
    np.testing.assert_allclose(reversed_[::-1], bucketed, atol=1e-5, rtol=1e-5)


def test_plan_batches_covers_every_row_once_with_the_smallest_bucket():
    lengths = np.array([5, 40, 17, 16, 3, 33, 32, 9, 1])
    plan = encode.plan_batches(lengths, 4, BUCKETS)
    rows = np.concatenate([r for r, _ in plan])
    assert sorted(rows.tolist()) == list(range(len(lengths)))
    assert [len(r) for r, _ in plan] == [4, 4, 1]
    for batch_rows, length in plan:
        longest = lengths[batch_rows].max()
        assert length == min(b for b in BUCKETS if b >= longest)
    assert [s for _, s in plan] == [16, 40, 40]
    with pytest.raises(ValueError, match="41 tokens exceeds"):
        encode.plan_batches(np.array([41]), 4, BUCKETS)


def test_eight_devices_equal_one_device(tiny, tokenizer):
    assert len(jax.devices()) == 8
    passages = _passages(21, seed=2)
    one = _encode(tiny, tokenizer, passages, mesh=_mesh(1), batch_size=8)
    # 5 is rounded up to 8 rows (one per device); the 21 rows leave padding rows to drop.
    eight = _encode(tiny, tokenizer, passages, mesh=_mesh(8), batch_size=5)
    assert eight.shape == one.shape == (21, 12)
    np.testing.assert_allclose(eight, one, atol=1e-5, rtol=1e-5)


def test_storage_dtypes(tiny, tokenizer, tmp_path):
    passages = _passages(9, seed=3)
    one_bucket = {"mesh": _mesh(8), "buckets": (MAX_LENGTH,)}
    full = _encode(tiny, tokenizer, passages, **one_bucket)
    half = _encode(tiny, tokenizer, passages, dtype="float16", **one_bucket)
    assert half.dtype == np.float16
    # Rounding to the storage dtype is the only difference: within half an ulp (+ float32 noise).
    np.testing.assert_allclose(half.astype(np.float32), full, rtol=2**-11, atol=1e-6)
    _corpus(tiny, tokenizer, ListStore(passages), tmp_path, dtype="bfloat16", **one_bucket)
    loaded = vectors.load_vectors(tmp_path)
    assert loaded.dtype == ml_dtypes.bfloat16
    np.testing.assert_allclose(loaded.astype(np.float32), full, rtol=2**-8, atol=1e-6)
    assert not np.array_equal(loaded.astype(np.float32), full)  # it was rounded


def test_encoder_fingerprint(tiny):
    _, cfg, params = tiny
    fingerprint = encoder_id.encoder_fingerprint(cfg, params)
    assert fingerprint == encoder_id.encoder_fingerprint(cfg.replace(dtype="bfloat16"), params)
    changed = jax.tree_util.tree_map(np.copy, params)
    changed["layer_1"]["mlp"]["wo"]["bias"][3] += 1e-6
    assert encoder_id.encoder_fingerprint(cfg, changed) != fingerprint
    assert encoder_id.encoder_fingerprint(cfg.replace(layer_norm_eps=1e-6), params) != fingerprint


# ---------------------------------------------------------------------------------------------
# Shards, manifest, resume


def test_corpus_shards_and_manifest(tiny, tokenizer, tmp_path):
    _, cfg, params = tiny
    passages = _passages(21, seed=4)
    store = ListStore(passages)
    manifest = _corpus(tiny, tokenizer, store, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "manifest.json",
        *(f"vectors-{i:05d}.npy" for i in range(4)),
    ]
    assert [s["rows"] for s in manifest["shards"]] == [6, 6, 6, 3]
    assert manifest["count"] == 21 and manifest["dim"] == 12 and manifest["dtype"] == "float32"
    assert manifest["corpus_checksum"] == store.checksum
    assert manifest["encoder_fingerprint"] == encoder_id.encoder_fingerprint(cfg, params)
    assert manifest["max_length"] == MAX_LENGTH and manifest["input_format"] == "pair"
    written = json.loads((tmp_path / "manifest.json").read_text())
    assert written.pop("manifest_sha256") and written == manifest  # sealed with its checksum
    assert np.load(tmp_path / "vectors-00003.npy").shape == (3, 12)
    loaded = vectors.load_vectors(tmp_path, expect={"corpus_checksum": store.checksum})
    np.testing.assert_allclose(loaded, _encode(tiny, tokenizer, passages, mesh=_mesh(8)), atol=1e-5)


def test_resume_after_interruption_is_byte_identical(tiny, tokenizer, tmp_path):
    passages = _passages(21, seed=5)
    _corpus(tiny, tokenizer, ListStore(passages), tmp_path / "whole")

    part = tmp_path / "part"
    with pytest.raises(RuntimeError, match="interruption at passage 14"):
        _corpus(tiny, tokenizer, ListStore(passages, fail_at=14), part)  # inside shard 2
    manifest = json.loads((part / "manifest.json").read_text())
    assert [s["index"] for s in manifest["shards"]] == [0, 1]
    with pytest.raises(ValueError, match="2 of 4 shards"):
        vectors.load_vectors(part)
    # What a kill can leave besides: a half-written temp file and a renamed but unrecorded shard.
    (part / "vectors-00002.npy.tmp").write_bytes(b"half")
    (part / "vectors-00003.npy").write_bytes(b"unrecorded")

    store = ListStore(passages)
    _corpus(tiny, tokenizer, store, part)
    assert sorted(store.reads) == list(range(12, 21))  # shards 0 and 1 were not recomputed
    assert _files(part) == _files(tmp_path / "whole")


def test_resume_after_sigkill_is_byte_identical(tiny, tokenizer, tmp_path):
    path, _, _ = tiny
    passages = _passages(21, seed=6)
    (tmp_path / "passages.json").write_text(json.dumps(passages))
    script = textwrap.dedent(
        f"""
        import json, time
        from jax.sharding import Mesh
        import jax, numpy as np
        from rag_jax.io import hf
        from rag_jax.retrieval import encode

        class SlowStore:
            def __init__(self, passages):
                self.passages, self.checksum = passages, {ListStore(passages).checksum!r}
            def __len__(self):
                return len(self.passages)
            def title(self, i):
                return self.passages[i][0]
            def text(self, i):
                time.sleep(0.1)
                return self.passages[i][1]

        cfg, params = hf.load_bert({str(path)!r})
        encode.encode_corpus(
            SlowStore(json.load(open({str(tmp_path / "passages.json")!r}))), cfg, params,
            hf.load_tokenizer({str(path)!r}), {str(tmp_path / "part")!r},
            max_length={MAX_LENGTH}, batch_size=4, buckets={BUCKETS}, shard_size=6,
            sort_window=4, mesh=Mesh(np.array(jax.devices()), ("data",)), progress=False)
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    child = subprocess.Popen([sys.executable, "-c", script], env=env)
    manifest_path = tmp_path / "part" / "manifest.json"
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            if manifest_path.is_file():
                recorded = json.loads(manifest_path.read_text())["shards"]
                if recorded:
                    break
            assert child.poll() is None, "the child finished before it could be killed"
            time.sleep(0.01)
        child.send_signal(signal.SIGKILL)
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
    recorded = json.loads(manifest_path.read_text())["shards"]
    assert 1 <= len(recorded) < 4

    store = ListStore(passages)
    _corpus(tiny, tokenizer, store, tmp_path / "part")
    finished_rows = sum(s["rows"] for s in recorded)
    assert sorted(store.reads) == list(range(finished_rows, 21))
    _corpus(tiny, tokenizer, ListStore(passages), tmp_path / "whole")
    assert _files(tmp_path / "part") == _files(tmp_path / "whole")


def test_other_encoder_or_corpus_is_refused_with_the_field_named(tiny, tokenizer, tmp_path):
    passages = _passages(9, seed=7)
    _corpus(tiny, tokenizer, ListStore(passages), tmp_path)
    with pytest.raises(ValueError, match="'corpus_checksum' is"):
        _corpus(tiny, tokenizer, ListStore(_passages(9, seed=8)), tmp_path)
    with pytest.raises(ValueError, match="'max_length' is 40 there, 32 now"):
        _corpus(tiny, tokenizer, ListStore(passages), tmp_path, max_length=32, buckets=(16, 32))
    other = tmp_path.parent / "other_bert"
    hf_fixtures.save_bert(
        other, seed=1, vocab_size=tokenizer.vocab_size, max_position_embeddings=48
    )
    cfg, params = hf.load_bert(other)
    other_tiny = (other, cfg, params)
    with pytest.raises(ValueError, match="'encoder_fingerprint' is"):
        _corpus(other_tiny, tokenizer, ListStore(passages), tmp_path)
    _corpus(other_tiny, tokenizer, ListStore(passages), tmp_path, overwrite=True)
    expected = _encode(other_tiny, tokenizer, passages, mesh=_mesh(8))
    fingerprint = encoder_id.encoder_fingerprint(cfg, params)
    loaded = vectors.load_vectors(tmp_path, expect={"encoder_fingerprint": fingerprint})
    np.testing.assert_allclose(loaded, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="field 'corpus_checksum' is"):
        vectors.load_vectors(tmp_path, expect={"corpus_checksum": "another corpus"})


def test_damaged_shards_fail_naming_the_file(tiny, tokenizer, tmp_path):
    _corpus(tiny, tokenizer, ListStore(_passages(21, seed=9)), tmp_path)
    shard = tmp_path / "vectors-00001.npy"
    good = shard.read_bytes()
    shard.write_bytes(good[:-5] + bytes([good[-5] ^ 1]) + good[-4:])
    with pytest.raises(ValueError, match=r"vectors-00001\.npy is corrupted"):
        vectors.load_vectors(tmp_path)
    vectors.load_vectors(tmp_path, verify=False)  # sizes and headers still agree
    shard.write_bytes(good[:-4])
    with pytest.raises(ValueError, match=r"vectors-00001\.npy has \d+ bytes.*truncated"):
        vectors.load_vectors(tmp_path, verify=False)
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=r"vectors-00001\.npy is missing"):
        vectors.load_vectors(tmp_path)


@pytest.mark.parametrize("offset", range(10, 80, 7))
def test_a_damaged_npy_header_is_refused_naming_the_shard(tiny, tokenizer, tmp_path, offset):
    """A flipped byte in a shard's `.npy` header (its dtype, shape or padding): numpy's header
    parser may raise anything (`tokenize.TokenError`, `SyntaxError`, ...), which is never what
    reaches the caller. With checksums on, the file is reported corrupted before it is parsed;
    with them off, the header is refused naming the file."""
    _corpus(tiny, tokenizer, ListStore(_passages(8, seed=2)), tmp_path)
    shard = tmp_path / "vectors-00000.npy"
    raw = bytearray(shard.read_bytes())
    assert offset < raw[8] + 10  # inside the header (its length is at bytes 8-9)
    raw[offset] ^= 0x5A
    shard.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"vectors-00000\.npy is corrupted"):
        vectors.load_vectors(tmp_path)
    with pytest.raises(ValueError, match=r"vectors-00000\.npy"):
        vectors.load_vectors(tmp_path, verify=False)


def test_bad_inputs_fail_clearly(tiny, tokenizer, tmp_path):
    _, cfg, params = tiny
    with pytest.raises(ValueError, match="corpus is empty"):
        _corpus(tiny, tokenizer, ListStore([]), tmp_path / "empty")
    with pytest.raises(ValueError, match="max_length 64 exceeds the encoder's max_position"):
        _corpus(tiny, tokenizer, ListStore(_passages(3)), tmp_path / "long", max_length=64)
    with pytest.raises(ValueError, match="input_format"):
        _encode(tiny, tokenizer, _passages(3), input_format="triple", mesh=_mesh(1))
    with pytest.raises(ValueError, match="buckets"):
        _encode(tiny, tokenizer, _passages(3), buckets=(32, 16), mesh=_mesh(1))
    small_vocab = (None, cfg.replace(vocab_size=100), params)
    with pytest.raises(ValueError, match="passage 0: token id .* outside the encoder's vocab"):
        _encode(small_vocab, tokenizer, _passages(3), mesh=_mesh(1))
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.tmp").write_text("mine")
    with pytest.raises(FileExistsError, match="not encoded vectors"):
        _corpus(tiny, tokenizer, ListStore(_passages(3)), tmp_path / "foreign")
    assert (tmp_path / "foreign" / "notes.tmp").read_text() == "mine"  # left alone


# ---------------------------------------------------------------------------------------------
# Corpus file -> store, vectors, index


def test_build_index_from_a_corpus_file(tiny, tokenizer, tmp_path):
    from rag_jax.retrieval import index

    path, cfg, params = tiny
    passages = _passages(7, seed=10)
    corpus_file = tmp_path / "corpus.jsonl"
    corpus_file.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "title": t, "text": x}) + "\n"
            for i, (t, x) in enumerate(passages)
        )
    )
    out = tmp_path / "out"
    kwargs = {"max_length": MAX_LENGTH, "batch_size": 4, "shard_size": 3, "progress": False}
    result = build_index(corpus_file, path, hf_fixtures.minilm_path(), out, **kwargs)
    store = PassageStore.open(out / "passages")
    assert len(store) == 7 and store.text(4) == passages[4][1]
    expect = {"encoder_fingerprint": encoder_id.encoder_fingerprint(cfg, params)}
    expect["corpus_checksum"] = store.checksum
    assert {k: result[k] for k in expect} == expect
    ix = index.ExactIndex.load(str(out / "index"), expect=expect)
    direct = _encode(tiny, tokenizer, passages, buckets=None, mesh=_mesh(8))
    np.testing.assert_allclose(ix.vectors, direct, atol=1e-5, rtol=1e-5)
    # A second run reuses the store and the finished vectors.
    before = _files(out / "vectors")
    build_index(corpus_file, path, hf_fixtures.minilm_path(), out, **kwargs)
    assert _files(out / "vectors") == before
