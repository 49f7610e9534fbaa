"""`DeviceIndex(storage="int8")`: per-row int8 codes and scales, searched on 1 and 8 devices.

The quantisation against its formula in float64 numpy; the search against numpy brute force over
the same codes and scales (the ids are the quantised vectors' top-k, exactly); the recall of
those ids against exact search of the float vectors; the pytree inside `jax.jit`; save, load
and the abstract index a TPU compile uses.

Legend: B queries, C corpus size, D width, k neighbours (C prime: no device count divides it).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.index import clustered_vectors
from rag_jax.retrieval import index, scann_index
from rag_jax.retrieval.device_index import DeviceIndex, quantize_int8

B, C, D = 5, 103, 12


def _mesh(n):
    assert len(jax.devices()) >= n, "tests/conftest.py requests 8 fake CPU devices"
    return Mesh(np.array(jax.devices()[:n]), ("data",))


def _gaussian(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _quantised_top_k(vectors, queries, k):
    """Reference: float64 scores (q . codes) * scale of the numpy quantisation below, descending,
    lower id first on ties."""
    x = vectors.astype(np.float64)
    scale = np.abs(x).max(axis=1) / 127
    codes = np.clip(np.rint(x / np.where(scale > 0, scale, 1)[:, None]), -127, 127)
    scores = (queries.astype(np.float64) @ codes.T) * scale  # -> [B, C]
    ids = np.broadcast_to(np.arange(len(x)), scores.shape)
    order = np.lexsort((ids, -scores), axis=1)[:, :k]
    return np.take_along_axis(scores, order, axis=1), order


def test_quantize_int8_follows_its_formula_and_bounds_the_error():
    vectors = _gaussian((C, D), 1) * np.linspace(0.01, 30, C, dtype=np.float32)[:, None]
    vectors[7] = 0.0  # an all-zero row: scale 0, codes 0
    codes, scales = quantize_int8(vectors)
    assert codes.dtype == np.int8 and scales.dtype == np.float32
    assert codes.shape == (C, D) and scales.shape == (C,)
    want_scales = np.abs(vectors.astype(np.float64)).max(axis=1) / 127
    np.testing.assert_allclose(scales, want_scales, rtol=1e-6)
    assert scales[7] == 0 and not codes[7].any()
    # Each row's largest coordinate is +-127; every coordinate within half a step.
    assert (np.abs(codes).max(axis=1)[np.arange(C) != 7] == 127).all()
    error = np.abs(codes * scales[:, None].astype(np.float64) - vectors)
    assert (error <= scales[:, None] * (0.5 + 1e-6)).all()
    # Blocks: a corpus longer than one quantisation block gives the rows of one pass.
    long = _gaussian((70000, 4), 2)
    long_codes, long_scales = quantize_int8(long)
    np.testing.assert_array_equal(long_codes[-5:], quantize_int8(long[-5:])[0])
    np.testing.assert_array_equal(long_scales[-5:], quantize_int8(long[-5:])[1])


@pytest.mark.parametrize("k", [1, 6, 20])
@pytest.mark.parametrize("devices,block_rows", [(1, 65536), (8, 65536), (8, 4), (1, 10)])
def test_int8_search_is_the_top_k_of_the_quantised_scores(devices, block_rows, k):
    vectors, queries = _gaussian((C, D), 3), _gaussian((B, D), 4)
    ix = DeviceIndex(vectors, _mesh(devices), block_rows=block_rows, storage="int8")
    assert ix.vectors.dtype == jnp.int8 and ix.scales.dtype == jnp.float32
    assert ix.nbytes == ix.vectors.nbytes + ix.scales.nbytes
    scores, ids = ix.search(queries, k)
    want_scores, want_ids = _quantised_top_k(vectors, queries, k)
    assert scores.dtype == np.float32 and ids.dtype == np.int64
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-5)


def test_int8_recall_at_10_against_exact_search_of_the_float_vectors():
    # Unit vectors as the index benchmark draws them (C / 200 centres, noise as large): every
    # query's top 10 are near-ties among its centre's 200 points, a hard case for quantisation.
    vectors = clustered_vectors(20000, 256, 5)
    queries = clustered_vectors(20000 + 256, 256, 5)[20000:]
    _, true_ids = index.ExactIndex(vectors).search(queries, 10)
    _, ids = DeviceIndex(vectors, _mesh(8), storage="int8").search(queries, 10)
    recall = scann_index.recall_at_k(ids, true_ids)
    assert recall >= 0.98, recall  # measured 0.988 (bfloat16 storage: 0.994)


def test_int8_index_inside_jit_is_a_pytree_and_a_new_one_reuses_the_compilation():
    mesh, queries = _mesh(8), _gaussian((8, D), 5)
    traces = []

    @jax.jit
    def search(ix, q):
        traces.append(None)
        return ix.search(q, 4)

    on_devices = jax.device_put(queries, NamedSharding(mesh, P("data")))
    for seed in (6, 7):
        vectors = _gaussian((C, D), seed)
        scores, ids = search(DeviceIndex(vectors, mesh, storage="int8"), on_devices)
        want_scores, want_ids = _quantised_top_k(vectors, queries, 4)
        np.testing.assert_array_equal(np.asarray(ids), want_ids)
        np.testing.assert_allclose(np.asarray(scores), want_scores, rtol=1e-5, atol=1e-5)
    assert len(traces) == 1


def test_int8_loads_from_an_exact_index_and_refuses_to_save_its_codes(tmp_path):
    vectors, queries = _gaussian((C, D), 8).astype(np.float16), _gaussian((B, D), 9)
    index.ExactIndex(vectors, corpus_checksum="abc").save(tmp_path / "ix")
    loaded = DeviceIndex.load(tmp_path / "ix", _mesh(8), storage="int8")
    assert loaded.corpus_checksum == "abc" and loaded.storage == "int8"
    np.testing.assert_array_equal(
        loaded.search(queries, 5)[1], _quantised_top_k(vectors, queries, 5)[1]
    )
    with pytest.raises(ValueError, match="int8 DeviceIndex keeps only quantised codes"):
        loaded.save(tmp_path / "again")
    assert not (tmp_path / "again").exists()


def test_abstract_int8_index_has_the_shapes_of_a_built_one():
    mesh = _mesh(8)
    built = DeviceIndex(_gaussian((C, D), 10), mesh, storage="int8")
    abstract = DeviceIndex.abstract(C, D, jnp.bfloat16, mesh, storage="int8")
    for got, want in zip(jax.tree.leaves(abstract), jax.tree.leaves(built)):
        assert (got.shape, got.dtype, got.sharding) == (want.shape, want.dtype, want.sharding)
    lowered = jax.jit(lambda ix, q: ix.search(q, 3)).lower(abstract, jnp.zeros((B, D)))
    assert "tensor<104x12xi8>" in lowered.as_text()  # the padded codes enter as int8


def test_unknown_storage_is_refused():
    with pytest.raises(ValueError, match=r"storage must be one of \('', 'int8'\), got 'int4'"):
        DeviceIndex(_gaussian((C, D), 11), _mesh(1), storage="int4")
    with pytest.raises(ValueError, match="storage must be one of"):
        DeviceIndex.abstract(C, D, jnp.float32, _mesh(1), storage="fp8")
