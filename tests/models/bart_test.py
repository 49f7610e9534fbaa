"""Bart against transformers' PyTorch BartForConditionalGeneration, and cache consistency."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import hf_fixtures
from rag_jax.io import hf
from rag_jax.models import bart


@pytest.fixture(scope="module", params=[False, True], ids=["unscaled", "scaled_embedding"])
def tiny_bart(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("bart")
    torch_model = hf_fixtures.save_bart(path, seed=7, scale_embedding=request.param)
    cfg, params = hf.load_bart(path)
    assert cfg.scale_embedding == request.param
    return torch_model, cfg, params


def _inputs(cfg, seed=0):
    rng = np.random.default_rng(seed)
    ids, mask = hf_fixtures.padded_batch(rng, [9, 4, 6], cfg.vocab_size, pad=cfg.pad_token_id)
    dec = rng.integers(3, cfg.vocab_size, size=(3, 5))
    return ids, mask, dec


def test_bart_matches_pytorch(tiny_bart):
    torch_model, cfg, params = tiny_bart
    ids, mask, dec = _inputs(cfg)
    with torch.no_grad():
        ref = torch_model(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            decoder_input_ids=torch.tensor(dec),
        )
    logits, aux = bart.Bart(cfg).apply({"params": params}, ids, mask, dec)
    assert logits.shape == (3, 5, cfg.vocab_size) and logits.dtype == jnp.float32
    np.testing.assert_allclose(
        aux["encoded"], ref.encoder_last_hidden_state.numpy(), atol=1e-4, rtol=0
    )
    np.testing.assert_allclose(logits, ref.logits.numpy(), atol=1e-4, rtol=0)
    assert np.abs(ref.logits.numpy()).max() > 1.0


def test_decoder_padding_mask_matches_pytorch(tiny_bart):
    torch_model, cfg, params = tiny_bart
    ids, mask, dec = _inputs(cfg, seed=1)
    dec_mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    with torch.no_grad():
        ref = torch_model(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            decoder_input_ids=torch.tensor(dec),
            decoder_attention_mask=torch.tensor(dec_mask),
        )
    logits, _ = bart.Bart(cfg).apply({"params": params}, ids, mask, dec, dec_mask)
    real = dec_mask.astype(bool)  # padded query rows are don't-care in both implementations
    np.testing.assert_allclose(
        np.asarray(logits)[real], ref.logits.numpy()[real], atol=1e-4, rtol=0
    )


def test_incremental_decoding_equals_teacher_forcing(tiny_bart):
    _, cfg, params = tiny_bart
    ids, mask, dec = _inputs(cfg, seed=2)
    model = bart.Bart(cfg)
    full, aux = model.apply({"params": params}, ids, mask, dec)
    cache = bart.init_cache(model, params, aux["encoded"], mask, max_length=dec.shape[1] + 2)
    step = jax.jit(bart.decode_step_fn(model, params, mask))
    for t in range(dec.shape[1]):
        logits, cache = step(dec[:, t : t + 1], cache)
        np.testing.assert_allclose(logits[:, 0], full[:, t], atol=1e-5, rtol=0)
    # Feeding two tokens at once continues the same prefix.
    cache = bart.init_cache(model, params, aux["encoded"], mask, max_length=dec.shape[1])
    first, cache = step(dec[:, :2], cache)
    rest, cache = step(dec[:, 2:], cache)
    np.testing.assert_allclose(np.concatenate([first, rest], 1), full, atol=1e-5, rtol=0)


def test_shared_encoder_rows_equal_copies(tiny_bart):
    """Decoder rows sharing encoder rows (beams, rescored candidates) equal explicit copies.

    G = 2 groups of m = 3 contexts, k = 2 decoder rows per context; row (g, j, i) reads context
    (g, i) with a 4-D encoder output, and row (e, j) reads context e with a 3-D one. Checked
    teacher-forced and with the incremental cache.
    """
    _, cfg, params = tiny_bart
    (ids_a, mask_a, _), (ids_b, mask_b, _) = _inputs(cfg, seed=5), _inputs(cfg, seed=6)
    ids, mask = np.concatenate([ids_a, ids_b]), np.concatenate([mask_a, mask_b])  # -> [6, S]
    groups, contexts, k, length = 2, 3, 2, 5
    model = bart.Bart(cfg)
    encoded = model.apply({"params": params}, ids, mask, method=bart.Bart.encode)  # [6, S, H]
    rows = groups * k * contexts
    dec = np.random.default_rng(5).integers(3, cfg.vocab_size, size=(rows, length))
    g, j, i = np.unravel_index(np.arange(rows), (groups, k, contexts))
    layouts = {
        "grouped": (
            encoded.reshape((groups, contexts) + encoded.shape[1:]),
            mask.reshape(groups, contexts, -1),
            g * contexts + i,  # the context each decoder row reads
        ),
        "per_context": (encoded, mask, np.arange(rows) // k),
    }
    for name, (shared, shared_mask, source) in layouts.items():
        copies, copies_mask = encoded[source], mask[source]
        want = model.apply({"params": params}, dec, copies, copies_mask, method=bart.Bart.decode)
        got = model.apply({"params": params}, dec, shared, shared_mask, method=bart.Bart.decode)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=name)
        cache = bart.init_cache(model, params, shared, shared_mask, length, group_size=k)
        step = bart.decode_step_fn(model, params, shared_mask)
        for t in range(length):
            logits, cache = step(dec[:, t : t + 1], cache)
            np.testing.assert_allclose(logits[:, 0], want[:, t], atol=1e-5, rtol=0, err_msg=name)
    # The contexts differ, so reading the wrong one would show.
    assert not np.allclose(want[0], want[1], atol=1e-3)


def test_key_bias_gradient_is_exactly_zero(tiny_bart):
    """The softmax cancels the attention key bias (the parity tests above use random biases), so
    its gradient is zero; rag_jax returns exactly zero rather than rounding noise."""
    _, cfg, params = tiny_bart
    ids, mask, dec = _inputs(cfg, seed=7)
    model = bart.Bart(cfg)

    def loss(p):
        logits, _ = model.apply({"params": p}, ids, mask, dec)
        return jax.nn.log_softmax(logits)[..., 5].sum()

    grads = jax.grad(loss)(params)
    layer = ("decoder", "layer_0", "cross_attn", "key")
    bias_grad = grads
    for name in layer:
        bias_grad = bias_grad[name]
    np.testing.assert_array_equal(bias_grad["bias"], 0.0)
    assert np.abs(bias_grad["kernel"]).max() > 0.0


def test_bfloat16_compute_stays_close_to_float32(tiny_bart):
    """bfloat16 compute: log-probs within 0.1 nats of float32 (the model is tiny; errors small)."""
    _, cfg, params = tiny_bart
    ids, mask, dec = _inputs(cfg, seed=3)
    ref, _ = bart.Bart(cfg).apply({"params": params}, ids, mask, dec)
    low, aux = bart.Bart(cfg.replace(dtype="bfloat16")).apply({"params": params}, ids, mask, dec)
    assert low.dtype == jnp.float32 and aux["encoded"].dtype == jnp.bfloat16
    ref_lp = jax.nn.log_softmax(ref)
    low_lp = jax.nn.log_softmax(low)
    top = jnp.argmax(ref, -1)
    # Probable tokens are what decoding and the loss use; compare the top token's log-prob.
    err = jnp.abs(jnp.take_along_axis(ref_lp - low_lp, top[..., None], -1))
    assert float(err.max()) < 0.1, float(err.max())
    assert float(jnp.mean(jnp.argmax(low, -1) == top)) >= 0.8


def test_jitted_encode_and_decode_trace_once(tiny_bart):
    _, cfg, params = tiny_bart
    model = bart.Bart(cfg)
    traces = {"encode": 0, "step": 0}

    @jax.jit
    def encode(params, ids, mask):
        traces["encode"] += 1
        return model.apply({"params": params}, ids, mask, method=bart.Bart.encode)

    @jax.jit
    def step(params, ids, cache, mask):
        traces["step"] += 1
        return bart.decode_step_fn(model, params, mask)(ids, cache)

    for seed in range(3):
        ids, mask, dec = _inputs(cfg, seed)
        encoded = encode(params, ids, mask)
        cache = bart.init_cache(model, params, encoded, mask, max_length=4)
        for t in range(3):
            _, cache = step(params, dec[:, t : t + 1], cache, mask)
    assert traces == {"encode": 1, "step": 1}


def test_remat_gives_identical_gradients(tiny_bart):
    _, cfg, params = tiny_bart
    ids, mask, dec = _inputs(cfg, seed=4)

    def loss(p, config):
        logits, _ = bart.Bart(config).apply({"params": p}, ids, mask, dec)
        return jax.nn.log_softmax(logits)[..., 5].sum()

    g_plain = jax.jit(jax.grad(lambda p: loss(p, cfg)))(params)
    g_remat = jax.jit(jax.grad(lambda p: loss(p, cfg.replace(remat=True))))(params)
    for x, y in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_remat)):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5)


def test_bad_shapes_are_refused(tiny_bart):
    _, cfg, params = tiny_bart
    ids, mask, dec = _inputs(cfg)
    model = bart.Bart(cfg)
    with pytest.raises(ValueError, match=r"\(3, 8\).*\(3, 9\)"):
        model.apply({"params": params}, ids, mask[:, :8], dec)
    too_long = np.ones((3, cfg.max_position_embeddings + 1), np.int32)
    with pytest.raises(ValueError, match=r"decoder_input_ids.*max_position_embeddings=24"):
        model.apply({"params": params}, ids, mask, too_long)
    with pytest.raises(ValueError, match="batch"):
        model.apply({"params": params}, ids, mask, dec[:2])


@pytest.mark.parametrize("layerdrop", [0.0, 1.0])
def test_layerdrop_is_read_and_applied_as_pytorch_applies_it(tmp_path, layerdrop):
    """HF's LayerDrop in training mode (dropout off, so the only randomness is LayerDrop):
    probability 1 skips every layer of both stacks, probability 0 runs them all; both
    deterministic, so the PyTorch model's outputs are the reference. Inference ignores it."""
    overrides = dict(encoder_layerdrop=layerdrop, decoder_layerdrop=layerdrop)
    overrides.update(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    torch_model = hf_fixtures.save_bart(tmp_path, seed=3, **overrides)
    cfg, params = hf.load_bart(tmp_path)
    assert (cfg.encoder_layerdrop, cfg.decoder_layerdrop) == (layerdrop, layerdrop)
    ids, mask, dec = _inputs(cfg, seed=4)
    torch_model.train()
    with torch.no_grad():
        ref = torch_model(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            decoder_input_ids=torch.tensor(dec),
        )
    model = bart.Bart(cfg)
    rngs = {"dropout": jax.random.PRNGKey(0)}
    train, aux = model.apply({"params": params}, ids, mask, dec, None, False, rngs=rngs)
    np.testing.assert_allclose(aux["encoded"], ref.encoder_last_hidden_state, atol=1e-4, rtol=0)
    np.testing.assert_allclose(train, ref.logits.numpy(), atol=1e-4, rtol=0)
    torch_model.eval()
    with torch.no_grad():
        ref_eval = torch_model(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            decoder_input_ids=torch.tensor(dec),
        ).logits.numpy()
    inference, _ = model.apply({"params": params}, ids, mask, dec)
    np.testing.assert_allclose(inference, ref_eval, atol=1e-4, rtol=0)
    assert (layerdrop == 0.0) == np.allclose(train, inference, atol=1e-4)


def test_the_lm_head_accumulates_in_float32_under_bfloat16(tiny_bart):
    """bfloat16 compute: the logits are the float32 products of the bfloat16 decoder output and
    embedding, not those products rounded to bfloat16."""
    _, cfg, params = tiny_bart
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(3, 4, cfg.d_model)) * 4, jnp.bfloat16)
    embedding = jnp.asarray(params["shared"]["embedding"])
    bias = jnp.asarray(rng.normal(size=cfg.vocab_size), jnp.float32)
    logits = bart.lm_head(x, embedding, bias)
    assert logits.dtype == jnp.float32
    exact = np.asarray(x, np.float64) @ np.asarray(
        embedding.astype(jnp.bfloat16), np.float64
    ).T + np.asarray(bias)
    np.testing.assert_allclose(logits, exact, rtol=1e-5, atol=1e-4)
    rounded = np.asarray((x @ embedding.astype(jnp.bfloat16).T).astype(np.float32)) + bias
    assert np.max(np.abs(rounded - exact)) > 10 * np.max(np.abs(np.asarray(logits) - exact))


def test_frozen_encoder_layers_get_no_gradient_and_compute_the_same(tiny_bart):
    """`frozen_encoder_layers=k`: the same outputs; no gradient reaches the encoder's own
    embedding or its first k layers, and the paths that get none are `frozen_encoder_paths`
    (the decoder's path to the shared embedding still trains it)."""
    _, cfg, params = tiny_bart
    ids, mask, dec = _inputs(cfg, seed=6)

    def loss(p, c):
        logits, _ = bart.Bart(c).apply({"params": p}, ids, mask, dec)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 3])

    frozen, untied = cfg.replace(frozen_encoder_layers=1), bart.untie_encoder_embedding(params)
    assert "embed_tokens" not in params["encoder"]  # the caller's tree is left alone
    np.testing.assert_array_equal(loss(untied, frozen), loss(params, cfg))
    grads, free = jax.grad(loss)(untied, frozen), jax.grad(loss)(params, cfg)
    for name in ("layer_0", "positions", "ln_embedding"):
        assert any(np.asarray(g).any() for g in jax.tree.leaves(free["encoder"][name]))
    # A key bias never gets a gradient (softmax ignores a shift shared by all keys): left out.
    zero = sorted(
        "/".join(str(k.key) for k in path)
        for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]
        if not np.asarray(g).any() and not jax.tree_util.keystr(path).endswith("['key']['bias']")
    )
    below = [p for p in bart.frozen_encoder_paths(frozen) if not p.endswith("key/bias")]
    assert zero == below
    assert "encoder/embed_tokens/embedding" in zero and "encoder/layer_0/mlp/wi/kernel" in zero
    for a, b in zip(
        jax.tree.leaves(grads["encoder"]["layer_1"]), jax.tree.leaves(free["encoder"]["layer_1"])
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # above the cut: unchanged
    assert np.asarray(grads["shared"]["embedding"]).any()
    whole = cfg.replace(frozen_encoder_layers=cfg.encoder_layers)
    everything = jax.grad(loss)(untied, whole)
    assert not any(np.asarray(g).any() for g in jax.tree.leaves(everything["encoder"]))
    assert len(bart.frozen_encoder_paths(whole)) == len(jax.tree.leaves(params["encoder"])) + 1
    assert bart.frozen_encoder_paths(cfg) == []


def test_a_frozen_encoder_stays_fixed_while_the_shared_embedding_trains(tiny_bart):
    """Adam on every parameter but the encoder's (as `train.freeze` of generator/encoder/): the
    decoder and the LM head move the shared table by about the learning rate per step, and the
    fixed encoder, which reads its own copy, computes bitwise what it did."""
    _, cfg, params = tiny_bart
    cfg = cfg.replace(frozen_encoder_layers=cfg.encoder_layers)
    params = bart.untie_encoder_embedding(params)
    ids, mask, dec = _inputs(cfg, seed=8)
    model = bart.Bart(cfg)

    def loss(p):
        logits, _ = model.apply({"params": p}, ids, mask, dec)
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 3])

    labels = {k: "frozen" if k in ("encoder", "final_logits_bias") else "train" for k in params}
    tx = optax.multi_transform({"train": optax.adam(1e-2), "frozen": optax.set_to_zero()}, labels)
    state, trained = tx.init(params), params
    for _ in range(5):
        updates, state = tx.update(jax.grad(loss)(trained), state, trained)
        trained = optax.apply_updates(trained, updates)
    moved = np.abs(np.asarray(trained["shared"]["embedding"] - params["shared"]["embedding"]))
    assert moved.max() > 1e-2  # the shared table trained
    encode = lambda p: model.apply({"params": p}, ids, mask, method=bart.Bart.encode)  # noqa: E731
    np.testing.assert_array_equal(encode(trained), encode(params))


def test_untie_encoder_embedding_copies_arrays_and_keeps_planned_shapes(tiny_bart):
    _, cfg, params = tiny_bart
    untied = bart.untie_encoder_embedding(params)
    own, shared = untied["encoder"]["embed_tokens"]["embedding"], untied["shared"]["embedding"]
    np.testing.assert_array_equal(own, shared)
    assert isinstance(own, np.ndarray) and not np.shares_memory(own, shared)
    on_device = bart.untie_encoder_embedding(jax.tree.map(jnp.asarray, params))
    own, shared = (
        on_device["encoder"]["embed_tokens"]["embedding"],
        on_device["shared"]["embedding"],
    )
    np.testing.assert_array_equal(own, shared)
    assert own.unsafe_buffer_pointer() != shared.unsafe_buffer_pointer()
    frozen = cfg.replace(frozen_encoder_layers=1)
    planned = bart.untie_encoder_embedding(bart.param_shapes(cfg))
    assert jax.tree.map(lambda x: x.shape, planned) == jax.tree.map(
        lambda x: x.shape, bart.param_shapes(frozen)
    )
    with pytest.raises(ValueError, match="already has its own embedding"):
        bart.untie_encoder_embedding(untied)
