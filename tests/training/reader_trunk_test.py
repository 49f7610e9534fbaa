"""The causal reader's top layers on its lower layers' states, computed once
(`training.reader_trunk`, `causal.answer_logits_from_states`, `llama.Llama.trunk` and
`hidden(first_layer=...)`). The reference is the whole reader run from the tokens,
`causal.answer_logits` (itself checked against HF's Llama in tests/io and tests/models)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rag_jax import causal, rag
from rag_jax.devices import preemption
from rag_jax.models import bert, llama
from rag_jax.training import reader_trunk

# Distinct sizes: B questions, N prompts each, S prompt width, T label width, V 31, H 24 (h 4 of
# d 6 over g 2), F 40, 4 layers of which the head runs the top 2.
B, N, S, T, V, LAYERS, FIRST = 2, 3, 9, 5, 31, 4, 2
EOS, PAD = 2, 0
LAYOUT = "tokenizer 0123 / passage // question answer:"
Q_CFG = bert.BertConfig(
    vocab_size=17, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
    intermediate_size=8, max_position_embeddings=8,
)  # fmt: skip


def _reader(tied: bool, frozen: int = 0, dtype: str = "float32"):
    g_cfg = llama.LlamaConfig(
        vocab_size=V,
        hidden_size=24,
        intermediate_size=40,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        eos_token_id=EOS,
        pad_token_id=PAD,
        init_std=0.3,  # outputs that depend on every input token
        frozen_layers=frozen,
        dtype=dtype,
    )
    return rag.RagConfig(question_encoder=Q_CFG, generator=g_cfg, n_docs=N, bos_token_id=None)


def _params(cfg, seed=0):
    return {"generator": llama.init_params(cfg.generator, jax.random.PRNGKey(seed))}


def _batch():
    """Prompts of 3 to 9 real tokens, right- and left-padded; labels with padding after EOS."""
    rng = np.random.default_rng(0)
    lengths = [3, 9, 6, 4, 7, 5]
    ids = np.zeros((B * N, S), np.int32)
    mask = np.zeros((B * N, S), np.int32)
    for row, length in enumerate(lengths):
        at = slice(0, length) if row % 2 else slice(S - length, S)  # right / left padding
        ids[row, at] = rng.integers(3, V, size=length)
        mask[row, at] = 1
    labels = np.array([[7, 11, EOS, PAD, PAD], [5, 13, 17, 19, EOS]], np.int32)
    return ids, mask, labels


def _rows(ids, mask, labels):
    """The cache's rows of a batch: each prompt's real tokens and its question's labels."""
    return [(ids[r][mask[r] == 1], labels[r // N]) for r in range(len(ids))]


@pytest.mark.parametrize("tied", [False, True])
def test_logits_from_cached_states_are_the_whole_readers(tied, tmp_path):
    cfg = _reader(tied)
    params = _params(cfg)
    ids, mask, labels = _batch()
    want = causal.answer_logits(cfg, params, ids, mask, labels)  # -> [B * N, T, V]
    trunk = reader_trunk.open_or_build(
        tmp_path, cfg.generator, params["generator"], FIRST, _rows(ids, mask, labels), LAYOUT
    )
    head = reader_trunk.head_of(cfg.generator, params["generator"], FIRST)
    assert not {"layers_0", "layers_1"} & set(head)  # the head runs without the trunk
    assert ("embed_tokens" in head) == tied
    for width in (S, S + 4):  # the batch's prompt width, or wider: the same logits
        states, state_mask = trunk.gather(np.arange(B * N), width)
        assert states.shape == (B * N, width + T, 24)
        got = causal.answer_logits_from_states(
            cfg, {"generator": head}, states, state_mask, T, FIRST
        )
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    # The stored states are each row's own real tokens: the trunk on the row alone, unpadded.
    # Compared at 1e-5 of the states' scale: at init 0.3 the residual stream reaches ~16 after
    # two layers, where float32 sums round at ~1e-5 absolute (the row alone is 9e-6 from a
    # float64 run); a misplaced or another row's state is off by O(1).
    model = llama.Llama(cfg.generator)
    for r, (prompt, row_labels) in enumerate(_rows(ids, mask, labels)):
        alone = np.concatenate([prompt, row_labels])[None]
        ones = np.ones_like(alone)
        expected = model.apply(
            {"params": params["generator"]},
            alone,
            ones,
            llama.positions_from_mask(ones),
            FIRST,
            method=model.trunk,
        )[0]
        stored = trunk.states[trunk.offsets[r] : trunk.offsets[r + 1]]
        # A model's output (FIRST decoder layers, states up to ~16 at init 0.3): the project's
        # model tolerance, 1e-4; the row batched with padding rounds differently from it alone.
        np.testing.assert_allclose(stored, expected, atol=1e-4, rtol=1e-4)


def _nll(logits, labels):
    """The answers' token NLL over the scored positions (`causal.label_mask`)."""
    flat_labels = jnp.repeat(labels, N, axis=0)  # -> [B * N, T]
    logp = jax.nn.log_softmax(logits, axis=-1)
    token = jnp.take_along_axis(logp, flat_labels[..., None], axis=-1)[..., 0]
    return -jnp.sum(token * causal.label_mask(flat_labels, EOS, PAD))


@pytest.mark.parametrize("tied", [False, True])
def test_the_head_gets_the_whole_readers_gradient_and_the_trunk_none(tied, tmp_path):
    cfg = _reader(tied, frozen=FIRST)
    params = _params(cfg)
    ids, mask, labels = _batch()
    trunk = reader_trunk.open_or_build(
        tmp_path, cfg.generator, params["generator"], FIRST, _rows(ids, mask, labels), LAYOUT
    )
    states, state_mask = trunk.gather(np.arange(B * N), S)

    def full(p):
        return _nll(causal.answer_logits(cfg, p, ids, mask, labels), labels)

    def cached(p):
        return _nll(causal.answer_logits_from_states(cfg, p, states, state_mask, T, FIRST), labels)

    want, want_grads = jax.value_and_grad(full)(params)
    got, got_grads = jax.value_and_grad(cached)(params)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    want_grads, got_grads = want_grads["generator"], got_grads["generator"]
    trained = set()
    for name in params["generator"]:
        for (path, w), g in zip(
            jax.tree_util.tree_flatten_with_path(want_grads[name])[0],
            jax.tree.leaves(got_grads[name]),
        ):
            key = f"{name}{jax.tree_util.keystr(path)}"
            np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5, err_msg=key)
            if np.any(g):
                trained.add(name)
    # The layers from F up, the final norm and the LM head train; the layers below do not, nor
    # the embedding unless it is the LM head (tied: the head's gradient only, as the full path).
    head = {f"layers_{i}" for i in range(FIRST, LAYERS)} | {"norm"}
    assert trained == head | ({"embed_tokens"} if tied else {"lm_head"}), trained


def test_the_decoder_reads_states_only_from_a_layer_above_zero():
    cfg = _reader(False).generator
    params = {"params": llama.init_params(cfg, jax.random.PRNGKey(0))}
    ids, mask = jnp.ones((2, 5), jnp.int32), jnp.ones((2, 5), jnp.int32)
    model, positions = llama.Llama(cfg), llama.positions_from_mask(mask)
    with pytest.raises(ValueError, match=r"\[R, T, H\] states"):
        model.apply(params, ids, mask, positions, first_layer=2, method=model.hidden)
    with pytest.raises(ValueError, match="first_layer 5 must be in"):
        model.apply(params, ids, mask, positions, first_layer=5, method=model.hidden)
    states = model.apply(params, ids, mask, positions, 2, method=model.trunk)
    past = llama.Past((jnp.zeros((2, 2, 8, 6)),) * LAYERS, (jnp.zeros((2, 2, 8, 6)),) * LAYERS)
    with pytest.raises(ValueError, match="a prefix or a past"):
        model.apply(params, states, mask, positions, past=past, first_layer=2, method=model.hidden)
    # States of layer F - 1 from the trunk, then the layers above: the whole decoder's output.
    whole, _ = model.apply(params, ids, mask, positions, method=model.hidden)
    top, kv = model.apply(params, states, mask, positions, first_layer=2, method=model.hidden)
    np.testing.assert_allclose(top, whole, atol=1e-5, rtol=1e-5)
    assert len(kv.keys) == LAYERS - 2


def test_a_stale_cache_is_refused_naming_what_differs(tmp_path):
    cfg = _reader(False)
    g_cfg, params = cfg.generator, _params(cfg)["generator"]
    ids, mask, labels = _batch()
    rows = _rows(ids, mask, labels)
    trunk = reader_trunk.open_or_build(tmp_path, g_cfg, params, FIRST, rows, LAYOUT)
    trunk.check(g_cfg, params, FIRST, rows, LAYOUT)  # its own reader and rows pass
    # A head that moved leaves the trunk's states valid (that is what trains).
    moved = dict(params, layers_3=jax.tree.map(lambda x: x * 1.3 + 0.01, params["layers_3"]))
    trunk.check(g_cfg, moved, FIRST, rows, LAYOUT)
    other_rows = list(rows)
    other_rows[4] = (rows[4][0], np.array([7, 11, 13, EOS, PAD], np.int32))
    embedding = dict(params, embed_tokens={"embedding": params["embed_tokens"]["embedding"] + 1e-3})
    stale = {
        "trunk_fingerprint": ((g_cfg, _params(cfg, seed=1)["generator"], FIRST, rows, LAYOUT),),
        "embedding": ((g_cfg, embedding, FIRST, rows, LAYOUT),),
        "first_layer": ((g_cfg, params, FIRST + 1, rows, LAYOUT),),
        "compute_dtype": ((g_cfg.replace(dtype="bfloat16"), params, FIRST, rows, LAYOUT),),
        "rows_checksum": ((g_cfg, params, FIRST, other_rows, LAYOUT),),
        "layout": ((g_cfg, params, FIRST, rows, "another tokenizer"),),
    }
    for what, (args,) in stale.items():
        named = "trunk_fingerprint" if what == "embedding" else what
        with pytest.raises(ValueError, match=rf"\(.*{named}.*differ\)") as error:
            trunk.check(*args)
        if what in ("compute_dtype", "rows_checksum", "layout"):  # that alone differs
            assert f"({named} differ)" in str(error.value), str(error.value)
    # Each is a cache of its own: another key, built beside the first.
    again = reader_trunk.open_or_build(tmp_path, g_cfg, params, FIRST, other_rows, LAYOUT)
    assert again.directory != trunk.directory
    with pytest.raises(ValueError, match="ignore index"):
        bad = [(rows[0][0], np.array([7, EOS, causal.IGNORE_INDEX, 1, 1]))]
        reader_trunk.open_or_build(tmp_path, g_cfg, params, FIRST, bad, LAYOUT)
    with pytest.raises(ValueError, match=r"must start at a layer in \[1, 3\]"):
        reader_trunk.open_or_build(tmp_path, g_cfg, params, LAYERS, rows, LAYOUT)
    with pytest.raises(ValueError, match="share a label width"):
        short = reader_trunk.open_or_build(
            tmp_path, g_cfg, params, FIRST, [*rows[:2], (rows[2][0], np.array([5, EOS]))], LAYOUT
        )
        short.gather([0, 2])


def _computed(monkeypatch):
    """Counts the rows the trunk computes."""
    computed, original = [], reader_trunk._trunk_states

    def counting(cfg, trunk, ids, mask, first):
        computed.append(len(ids))
        return original(cfg, trunk, ids, mask, first)

    monkeypatch.setattr(reader_trunk, "_trunk_states", counting)
    return computed


def test_a_stopped_build_resumes_to_the_same_bytes(tmp_path, monkeypatch):
    cfg = _reader(True)
    g_cfg, params = cfg.generator, _params(cfg)["generator"]
    ids, mask, labels = _batch()
    rows = _rows(ids, mask, labels) * 2  # 12 rows: windows of 5, 5 and 2
    monkeypatch.setattr(reader_trunk, "WINDOW", 5)
    build = lambda root: reader_trunk.open_or_build(  # noqa: E731
        root, g_cfg, params, FIRST, rows, LAYOUT, batch_size=2
    )
    looks = []
    monkeypatch.setattr(
        preemption, "should_stop", lambda step=None: looks.append(1) or len(looks) == 2
    )
    computed = _computed(monkeypatch)
    with pytest.raises(preemption.Preempted, match="5 of 12 rows"):
        build(tmp_path / "killed")
    (unfinished,) = (tmp_path / "killed").iterdir()
    assert not (unfinished / "manifest.json").exists()
    assert json.loads((unfinished / "progress.json").read_text())["done"] == 5
    with pytest.raises(FileNotFoundError, match="unfinished"):
        reader_trunk.ReaderTrunk(unfinished)
    assert sum(computed) == 5
    monkeypatch.setattr(preemption, "should_stop", lambda step=None: False)
    resumed = build(tmp_path / "killed")
    assert sum(computed) == 12  # the first window was not computed again
    assert resumed.directory == unfinished and not (unfinished / "progress.json").exists()
    straight = build(tmp_path / "straight")
    for name in ("states.f32", "offsets.npy", "prompts.npy", "manifest.json"):
        assert (unfinished / name).read_bytes() == (straight.directory / name).read_bytes(), name
    # A second open reads the states and computes none.
    monkeypatch.setattr(reader_trunk, "_trunk_states", _never)
    again = build(tmp_path / "straight")
    np.testing.assert_array_equal(again.states, straight.states)
    manifest = json.loads((again.directory / "manifest.json").read_text())
    assert manifest["rows"] == 12 and manifest["tokens"] == len(again.states)


def _never(*args):
    raise AssertionError("the trunk states were computed again")
