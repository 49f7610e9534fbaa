"""BertEncoder against transformers' PyTorch BERT and DPR, and on the real MiniLM weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import hf_fixtures
from rag_jax.io import hf
from rag_jax.models import bert
from rag_jax.retrieval import encode, encoder_id

SENTENCES = [
    "Where was Marie Curie born?",
    "Marie Curie was born in Warsaw, in the Kingdom of Poland.",
    "The Eiffel Tower is a wrought-iron lattice tower in Paris.",
    "Photosynthesis converts light energy into chemical energy.",
    "Who wrote the novel Pride and Prejudice?",
    "Jane Austen published Pride and Prejudice in 1813.",
    "The mitochondria is the powerhouse of the cell.",
    "Mount Everest is Earth's highest mountain above sea level.",
    "What is the capital city of Australia?",
    "Canberra was selected as the capital as a compromise between Sydney and Melbourne.",
    "Water boils at 100 degrees Celsius at sea level.",
    "The Great Barrier Reef lies off the coast of Queensland.",
]


def _run(cfg, params, ids, mask, types=None):
    return bert.BertEncoder(cfg).apply({"params": params}, ids, mask, types)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    path = tmp_path_factory.mktemp("bert")
    torch_model = hf_fixtures.save_bert(path)
    cfg, params = hf.load_bert(path)
    return torch_model, cfg, params


def test_bert_matches_pytorch_on_padded_batch(tiny_bert):
    torch_model, cfg, params = tiny_bert
    assert cfg.with_pooler
    rng = np.random.default_rng(0)
    ids, mask = hf_fixtures.padded_batch(rng, [7, 4, 1], cfg.vocab_size)
    types = rng.integers(0, 2, ids.shape)
    with torch.no_grad():
        ref = torch_model(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            token_type_ids=torch.tensor(types),
        )
    pooled, aux = _run(cfg, params, ids, mask, types)
    hidden = ref.last_hidden_state.numpy()
    # Padded positions are computed too (they attend to the real tokens), so compare everywhere.
    np.testing.assert_allclose(aux["hidden"], hidden, atol=1e-4, rtol=0)
    np.testing.assert_allclose(pooled, hidden[:, 0], atol=1e-4, rtol=0)
    np.testing.assert_allclose(aux["pooler_output"], ref.pooler_output.numpy(), atol=1e-4, rtol=0)
    assert np.abs(hidden).max() > 0.5  # outputs are not trivially small


@pytest.mark.parametrize("kind,projection_dim", [("question", 6), ("context", 0)])
def test_dpr_matches_pytorch(tmp_path, kind, projection_dim):
    torch_model = hf_fixtures.save_dpr(tmp_path, kind, seed=3, projection_dim=projection_dim)
    cfg, params = hf.load_dpr(tmp_path)
    assert cfg.projection_dim == projection_dim and not cfg.with_pooler
    rng = np.random.default_rng(1)
    ids, mask = hf_fixtures.padded_batch(rng, [5, 8, 2, 6], cfg.vocab_size)
    with torch.no_grad():
        ref = torch_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
    pooled, _ = _run(cfg, params, ids, mask)
    assert pooled.shape == (4, cfg.embedding_dim)
    np.testing.assert_allclose(pooled, ref.pooler_output.numpy(), atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def minilm():
    path = hf_fixtures.minilm_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    batch = tokenizer(SENTENCES, padding=True, return_tensors="np")
    return path, batch


def test_minilm_real_weights_match_pytorch(minilm):
    path, batch = minilm
    cfg, params = hf.load_bert(path)
    assert cfg.hidden_size == 384 and cfg.num_hidden_layers == 6 and cfg.with_pooler
    torch_model = transformers.AutoModel.from_pretrained(str(path)).eval()
    with torch.no_grad():
        ref = torch_model(**{k: torch.tensor(v) for k, v in batch.items()})
    pooled, aux = _run(cfg, params, batch["input_ids"], batch["attention_mask"])
    np.testing.assert_allclose(pooled, ref.last_hidden_state[:, 0].numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(aux["pooler_output"], ref.pooler_output.numpy(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("normalize", [False, True])
def test_mean_pooling_matches_a_numpy_mean_of_pytorch_states(minilm, normalize):
    """sentence-transformers' vector (all-MiniLM-L6-v2's): the mean of HF `BertModel`'s last
    states over the real tokens (padding left out), then divided by its L2 norm."""
    path, batch = minilm
    cfg, params = hf.load_bert(path)
    cfg = cfg.replace(pooling="mean", normalize=normalize)
    torch_model = transformers.AutoModel.from_pretrained(str(path)).eval()
    with torch.no_grad():
        ref = torch_model(**{k: torch.tensor(v) for k, v in batch.items()})
    hidden = ref.last_hidden_state.numpy().astype(np.float64)
    mask = batch["attention_mask"].astype(np.float64)[:, :, None]
    assert mask.min() == 0  # the batch is padded: a plain mean would differ
    want = (hidden * mask).sum(1) / mask.sum(1)
    if normalize:
        want = want / np.linalg.norm(want, axis=-1, keepdims=True)
    pooled, _ = _run(cfg, params, batch["input_ids"], batch["attention_mask"])
    np.testing.assert_allclose(pooled, want, atol=1e-5 if normalize else 1e-4, rtol=0)
    if normalize:
        np.testing.assert_allclose(np.linalg.norm(pooled, axis=-1), 1.0, atol=1e-6)
    # The corpus encoder (which skips most of the last layer with [CLS] pooling) agrees.
    fast = encode.pooled_vectors(cfg, params, batch["input_ids"], batch["attention_mask"])
    np.testing.assert_allclose(fast, pooled, atol=1e-6, rtol=0)


def test_pooling_changes_the_encoder_fingerprint_only_when_set(tiny_bert):
    """An index encoded before the pooling options existed still matches its [CLS] encoder."""
    _, cfg, params = tiny_bert
    base = encoder_id.encoder_fingerprint(cfg, params)
    assert (
        encoder_id.encoder_fingerprint(cfg.replace(pooling="cls", normalize=False), params) == base
    )
    mean = encoder_id.encoder_fingerprint(cfg.replace(pooling="mean"), params)
    unit = encoder_id.encoder_fingerprint(cfg.replace(normalize=True), params)
    assert len({base, mean, unit}) == 3
    with pytest.raises(ValueError, match="pooling must be one of"):
        _run(
            cfg.replace(pooling="max"),
            params,
            *hf_fixtures.padded_batch(np.random.default_rng(0), [3], cfg.vocab_size),
        )


def test_bfloat16_compute_stays_close_to_float32(minilm):
    """bfloat16 compute (float32 params): [CLS] cosine ≥ 0.99 and error ≤ 5% of the vector scale."""
    path, batch = minilm
    cfg, params = hf.load_bert(path)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    ref, _ = _run(cfg, params, ids, mask)
    low, aux = _run(cfg.replace(dtype="bfloat16"), params, ids, mask)
    assert low.dtype == jnp.float32 and aux["hidden"].dtype == jnp.float32
    ref, low = np.asarray(ref), np.asarray(low)
    cosine = (ref * low).sum(-1) / np.linalg.norm(ref, axis=-1) / np.linalg.norm(low, axis=-1)
    assert cosine.min() >= 0.99, cosine
    assert np.abs(ref - low).max() <= 0.05 * np.abs(ref).max()


def test_jitted_encoder_traces_once(tiny_bert):
    _, cfg, params = tiny_bert
    traces = []

    @jax.jit
    def encode(params, ids, mask):
        traces.append(1)
        return _run(cfg, params, ids, mask)[0]

    rng = np.random.default_rng(2)
    for lengths in ([3, 5], [5, 2], [1, 5]):
        ids, mask = hf_fixtures.padded_batch(rng, lengths, cfg.vocab_size)
        encode(params, ids, mask).block_until_ready()
    assert len(traces) == 1


def test_dropout_and_remat(tiny_bert):
    _, cfg, params = tiny_bert
    rng = np.random.default_rng(4)
    ids, mask = hf_fixtures.padded_batch(rng, [6, 3], cfg.vocab_size)
    model = bert.BertEncoder(cfg)
    det, _ = model.apply({"params": params}, ids, mask)
    drop_rng = {"dropout": jax.random.PRNGKey(0)}
    a, _ = model.apply({"params": params}, ids, mask, None, False, rngs=drop_rng)
    b, _ = model.apply({"params": params}, ids, mask, None, False, rngs=drop_rng)
    np.testing.assert_array_equal(a, b)  # dropout is a function of the rng
    assert np.abs(np.asarray(a) - np.asarray(det)).max() > 1e-3

    def loss(p, config):
        return (bert.BertEncoder(config).apply({"params": p}, ids, mask)[0] ** 2).sum()

    g_plain = jax.jit(jax.grad(lambda p: loss(p, cfg)))(params)
    g_remat = jax.jit(jax.grad(lambda p: loss(p, cfg.replace(remat=True))))(params)
    for x, y in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_remat)):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5)


def test_bad_shapes_are_refused(tiny_bert):
    _, cfg, params = tiny_bert
    ids = np.ones((2, 5), np.int32)
    with pytest.raises(ValueError, match=r"\(2, 5\).*\(2, 4\)"):
        _run(cfg, params, ids, np.ones((2, 4), np.int32))
    long = np.ones((1, cfg.max_position_embeddings + 1), np.int32)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        _run(cfg, params, long, long)
