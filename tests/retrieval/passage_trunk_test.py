"""`retrieval.passage_head_layers`: the passage tower's top layers trained on its lower layers'
states, computed once (`retrieval.passage_trunk`). The reference is the whole tower run from the
tokens (itself checked against HF's BERT in tests/models)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rag_jax import rag
from rag_jax.devices import preemption
from rag_jax.models import bert
from rag_jax.retrieval import encode, passage_trunk, retriever
from rag_jax.run import validation
from rag_jax.training import experiment, loop
from rag_jax.training.batcher import Batcher
from tiny_runs import _flat, first_batch, tiny_config

HEAD = 1


def _tower(pooling: str, projection: int = 0):
    cfg = bert.BertConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=64,
        initializer_range=0.3,  # 0.02 would make every vector alike
        pooling=pooling,
        normalize=pooling == "mean",
        projection_dim=projection,
        with_pooler=projection > 0,
    )
    ids = np.array([[2, 5, 9, 11, 3, 0, 0], [2, 7, 3, 0, 0, 0, 0], [2, 4, 8, 15, 21, 30, 3]])
    mask = (ids > 0).astype(np.int32)
    params = bert.BertEncoder(cfg).init(jax.random.PRNGKey(0), ids, mask)["params"]
    return cfg, params, ids, mask


@pytest.mark.parametrize("pooling,projection", [("mean", 0), ("cls", 8)])
@pytest.mark.parametrize("head", [1, 2])
def test_the_head_on_the_trunk_states_is_the_whole_tower(pooling, projection, head):
    cfg, params, ids, mask = _tower(pooling, projection)
    first = passage_trunk.first_layer(cfg, head)
    want = bert.BertEncoder(cfg).apply({"params": params}, ids, mask)[0]
    trunk_cfg, trunk = passage_trunk.trunk_of(cfg, params, first)
    states = bert.BertEncoder(trunk_cfg).apply({"params": trunk}, ids, mask)[1]["hidden"]
    head_params = passage_trunk.head_of(params, first)
    assert not set(head_params) & set(trunk)
    got = bert.BertEncoder(cfg).apply({"params": head_params}, states, mask, first_layer=first)[0]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    # States padded wider than their batch give the same vectors: padding is masked.
    wide_states = jnp.pad(states, ((0, 0), (0, 5), (0, 0)))
    wide_mask = np.pad(mask, ((0, 0), (0, 5)))
    wide = bert.BertEncoder(cfg).apply(
        {"params": head_params}, wide_states, wide_mask, first_layer=first
    )[0]
    np.testing.assert_allclose(wide, want, atol=1e-5, rtol=1e-5)


def test_head_inputs_are_checked():
    cfg, params, ids, mask = _tower("mean")
    with pytest.raises(ValueError, match=r"\[B, S, H\] states"):
        bert.BertEncoder(cfg).apply({"params": params}, ids, mask, first_layer=2)
    with pytest.raises(ValueError, match="first_layer 4 must be in"):
        bert.BertEncoder(cfg).apply({"params": params}, ids, mask, first_layer=4)
    for head in (0, 3):
        with pytest.raises(ValueError, match=f"passage_head_layers={head} must be in"):
            passage_trunk.first_layer(cfg, head)


def test_the_gradient_reaches_the_head_only_and_equals_the_token_path():
    """The doc vectors' gradient from the states is the whole tower's with its trunk held
    constant; the trunk gets none."""
    cfg, params, ids, mask = _tower("mean")
    first = passage_trunk.first_layer(cfg, HEAD)
    trunk_cfg, trunk = passage_trunk.trunk_of(cfg, params, first)
    states = bert.BertEncoder(trunk_cfg).apply({"params": trunk}, ids, mask)[1]["hidden"]
    weights = jax.random.normal(jax.random.PRNGKey(1), (3, 16))
    frozen = set(passage_trunk.trunk_names(first))

    def objective(p, batch, first_layer):
        p = {k: jax.lax.stop_gradient(v) if k in frozen else v for k, v in p.items()}
        docs = rag.batch_passage_vectors(
            cfg, {"passage_encoder": p}, batch, 1, 3, None, first_layer
        )  # -> [1, 3, D]
        return jnp.sum(docs[0] * weights)

    by_tokens = {"passage_input_ids": ids, "passage_attention_mask": mask}
    by_states = {"passage_states": states, "passage_attention_mask": mask}
    want, want_grads = jax.value_and_grad(objective)(params, by_tokens, 0)
    got, got_grads = jax.value_and_grad(objective)(params, by_states, first)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    flat_want, flat_got = _flat(want_grads), _flat(got_grads)
    reached = set()
    for key, value in flat_want.items():
        np.testing.assert_allclose(flat_got[key], value, atol=1e-5, rtol=1e-4, err_msg=key)
        name = key.split("'")[1]  # the top-level parameter: "layer_2", "word_embeddings", ...
        if np.any(flat_got[key]):
            reached.add(name)
    # (a key bias has no gradient anywhere: attention's softmax ignores a shift per query)
    assert reached == set(passage_trunk.head_of(params, first)), reached
    with pytest.raises(ValueError, match="the layer they enter"):
        objective(params, by_states, 0)


def _head_config(cache, **overrides):
    """The tiny run with its passage tower's top layer trained (the tiny towers have 2)."""
    first = 2 - HEAD
    return tiny_config(
        **{
            "train.steps": 5,
            "train.save_every": 100,
            "train.freeze": r"^generator/final_logits_bias|" + passage_trunk.trunk_pattern(first),
            "retrieval.refresh_every": 2,
            "retrieval.refresh_lag": 1,
            "retrieval.passage_head_layers": HEAD,
            "warm_start.steps": 4,
            "warm_start.batch_size": 8,
            "warm_start.cache_dir": str(cache),
            "eval.enabled": False,
            **overrides,
        }
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("trunk")
    config = _head_config(root / "cache")
    return config, experiment.build(config, root / "w")


def _whole(exp, params) -> retriever.PassageEncoder:
    """The whole tower from the tokens, as a run without the trunk states encodes."""
    r = exp.config.retrieval
    return retriever.PassageEncoder(
        exp.passage_cfg,
        params,
        exp.question_tokenizer,
        max_length=r.passage_max_length,
        input_format=r.passage_format,
        batch_size=r.encode_batch_size,
    )


def test_the_cached_states_are_each_passages_own(built):
    config, exp = built
    assert exp.passage_cfg.num_hidden_layers == 2  # what _head_config's freeze assumes
    trunk = exp.passage_trunk
    assert len(trunk) == len(exp.store) and trunk.first_layer == 2 - HEAD
    rows = [0, 3, len(exp.store) - 1]
    states, mask = trunk.gather(rows)
    assert states.shape[1] % passage_trunk.WIDTH_STEP == 0 or states.shape[1] == 32
    p = exp.params["passage_encoder"]
    trunk_cfg, trunk_params = passage_trunk.trunk_of(exp.passage_cfg, p, trunk.first_layer)
    tokens = encode.tokenize_passages(
        exp.question_tokenizer,
        [exp.store.title(i) for i in rows],
        [exp.store.text(i) for i in rows],
        max_length=config.retrieval.passage_max_length,
        input_format=config.retrieval.passage_format,
    )
    for slot, ids in enumerate(tokens):  # each passage alone, unpadded
        alone = bert.BertEncoder(trunk_cfg).apply(
            {"params": trunk_params}, np.array([ids]), np.ones((1, len(ids)), np.int32)
        )[1]["hidden"][0]
        assert mask[slot].sum() == len(ids)
        np.testing.assert_allclose(states[slot, : len(ids)], alone, atol=1e-5, rtol=1e-5)
        assert not states[slot, len(ids) :].any()


def test_the_head_encoder_is_the_whole_tower_before_and_after_the_head_moves(built):
    config, exp = built
    p = exp.params["passage_encoder"]
    rows = range(len(exp.store))
    np.testing.assert_allclose(
        exp.passage_encoder(p).encode_rows(exp.store, rows),
        _whole(exp, p).encode_rows(exp.store, rows),
        atol=1e-5,
    )
    np.testing.assert_allclose(  # the run's first index too
        np.asarray(exp.retriever.vectors, np.float32),
        _whole(exp, p).encode_rows(exp.store, rows),
        atol=1e-5,
    )
    top = f"layer_{exp.passage_cfg.num_hidden_layers - 1}"
    moved = dict(p, **{top: jax.tree.map(lambda x: x * 1.3 + 0.01, p[top])})
    head = exp.passage_encoder(moved).encode_rows(exp.store, rows)
    np.testing.assert_allclose(head, _whole(exp, moved).encode_rows(exp.store, rows), atol=1e-5)
    assert np.abs(head - exp.passage_encoder(p).encode_rows(exp.store, rows)).max() > 1e-2
    # A trunk that moved is not the cached states' trunk.
    stale = dict(p, layer_0=jax.tree.map(lambda x: x + 0.01, p["layer_0"]))
    with pytest.raises(ValueError, match="not this encoder's of this corpus"):
        exp.passage_encoder(stale)


def test_a_second_build_reads_the_states_and_computes_none(built, tmp_path, monkeypatch):
    config, exp = built
    monkeypatch.setattr(passage_trunk, "_trunk_states", _never)
    again = passage_trunk.open_or_build(
        exp.passage_trunk.directory.parent,
        exp.store,
        _whole(exp, exp.params["passage_encoder"]),
        exp.passage_trunk.first_layer,
    )
    assert again.directory == exp.passage_trunk.directory
    manifest = json.loads((again.directory / "manifest.json").read_text())
    assert manifest["passages"] == len(exp.store) and manifest["tokens"] == len(again.states)


def _never(*args):
    raise AssertionError("the trunk states were computed again")


def test_a_stopped_build_resumes_to_the_same_bytes(built, tmp_path, monkeypatch):
    config, exp = built
    encoder = _whole(exp, exp.params["passage_encoder"])
    first = exp.passage_trunk.first_layer
    monkeypatch.setattr(passage_trunk, "WINDOW", 5)
    looks = []
    monkeypatch.setattr(
        preemption, "should_stop", lambda step=None: looks.append(1) or len(looks) == 3
    )
    with pytest.raises(preemption.Preempted, match="10 of"):
        passage_trunk.open_or_build(tmp_path, exp.store, encoder, first)
    (unfinished,) = tmp_path.iterdir()
    assert not (unfinished / "manifest.json").exists()
    assert json.loads((unfinished / "progress.json").read_text())["done"] == 10
    monkeypatch.setattr(preemption, "should_stop", lambda step=None: False)
    resumed = passage_trunk.open_or_build(tmp_path, exp.store, encoder, first)
    assert not (unfinished / "progress.json").exists()
    # An uninterrupted build batched alike (windows of 5) writes the same bytes.
    straight = passage_trunk.open_or_build(tmp_path / "straight", exp.store, encoder, first)
    np.testing.assert_array_equal(np.asarray(resumed.states), np.asarray(straight.states))
    np.testing.assert_array_equal(resumed.offsets, exp.passage_trunk.offsets)
    # Batched otherwise (the fixture's windows of 4,096), they agree to rounding.
    np.testing.assert_allclose(resumed.states, exp.passage_trunk.states, atol=1e-5)


def test_the_freeze_must_cover_exactly_the_trunk():
    cfg = bert.BertConfig(num_hidden_layers=6)
    assert passage_trunk.check_freeze("^generator/|" + passage_trunk.trunk_pattern(5), cfg, 1) == 5
    with pytest.raises(ValueError, match=r"leaves \['layer_4'\] trainable"):
        passage_trunk.check_freeze("^generator/|" + passage_trunk.trunk_pattern(4), cfg, 1)
    with pytest.raises(ValueError, match=r"freezes the head's \['layer_5'\]"):
        passage_trunk.check_freeze("^(generator|passage_encoder)/", cfg, 1)
    with pytest.raises(ValueError, match="refresh_every too"):
        validation.validate(tiny_config(**{"retrieval.passage_head_layers": 1}), 1)


def test_train_batches_carry_the_states_of_their_passages(built):
    config, exp = built
    batcher = Batcher(exp, loop.device_mesh(config))
    batch = first_batch(batcher, exp)
    assert "passage_input_ids" not in batch
    states, mask = batch["passage_states"], batch["passage_attention_mask"]
    b, n = config.train.batch_size, config.rag.n_docs
    assert states.shape[:2] == (b, n) and mask.shape == states.shape[:3]
    vectors = exp.passage_encoder(exp.params["passage_encoder"])
    first = exp.passage_trunk.first_layer
    head = passage_trunk.head_of(exp.params["passage_encoder"], first)
    got = bert.BertEncoder(exp.passage_cfg).apply(
        {"params": head}, states.reshape(b * n, *states.shape[2:]), mask.reshape(b * n, -1),
        first_layer=first,
    )[0]  # fmt: skip
    np.testing.assert_allclose(got.reshape(b, n, -1), batch["doc_vectors"], atol=1e-5)
    assert vectors.trunk is exp.passage_trunk


@pytest.mark.slow  # two short runs with refreshes and a final index: ~60 s on 2 cores
@pytest.mark.parametrize("objective", ["marginal", "pdist"])
def test_a_head_run_trains_the_head_alone_and_indexes_with_it(tmp_path, objective, monkeypatch):
    overrides = {}
    if objective == "pdist":  # the retriever's own objective over K candidates
        overrides = {
            "train.retriever_loss": "pdist",
            "train.retriever_candidates": 8,
            "train.retriever_fixed_candidates": True,
        }
    config = _head_config(tmp_path / "cache", **overrides)
    assert loop.train_and_evaluate(config, tmp_path / "w")["steps"] == 5
    monkeypatch.setattr(passage_trunk, "_trunk_states", _never)  # built once, by the run
    exp, state, _ = loop.restore(tmp_path / "w")
    before, after = exp.params["passage_encoder"], state.params["passage_encoder"]
    trunk = set(passage_trunk.trunk_names(exp.passage_trunk.first_layer))
    for name in after:
        pairs = zip(jax.tree.leaves(before[name]), jax.tree.leaves(after[name]))
        same = all(np.array_equal(x, np.asarray(y)) for x, y in pairs)
        assert same == (name in trunk), name  # the trunk unchanged, the head moved
    # The final index is the whole tower's encoding of the trained parameters.
    after = jax.device_get(after)
    whole = _whole(exp, after).encode_rows(exp.store, range(len(exp.store)))
    np.testing.assert_allclose(np.asarray(exp.retriever.vectors, np.float32), whole, atol=1e-5)
