"""The joint step with the reader's top layers trained on its lower layers' cached states
(`train.reader_trunk`): the same loss and the same gradients as the step on the whole reader from
the tokens with the same layers frozen (`frozen_layers = F`), for every trained parameter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rag_jax import rag
from rag_jax.models import bert, llama
from rag_jax.retriever_losses import RetrieverObjective
from rag_jax.training import reader_trunk, step

# B questions, K candidates each (the generator reads the first N), S prompt width, T labels,
# Q question tokens; a 4-layer reader whose bottom F = 2 layers (and embedding) are frozen.
B, K, N, S, T, Q, V, LAYERS, FIRST = 2, 5, 3, 11, 5, 6, 31, 4, 2
EOS, PAD = 2, 0
LAYOUT = "test tokenizer / plain prompt / answer_length 5"
FREEZE = r"^(passage_encoder/|generator/(embed_tokens|layers_[01])/)"


def _cfg(tied: bool, n_docs: int, label_smoothing: float = 0.0) -> rag.RagConfig:
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
        frozen_layers=FIRST,
    )
    q_cfg = bert.BertConfig(
        vocab_size=17, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=8, max_position_embeddings=8,
    )  # fmt: skip
    return rag.RagConfig(
        question_encoder=q_cfg,
        generator=g_cfg,
        n_docs=n_docs,
        bos_token_id=None,
        label_smoothing=label_smoothing,
    )


def _params(cfg) -> dict:
    params = rag.init_params(cfg, jax.random.PRNGKey(0))
    # init std 0.3 in the question tower too: doc scores that depend on every question token
    leaves, tree = jax.tree.flatten(params["question_encoder"])
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    noisy = [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    return dict(params, question_encoder=jax.tree.unflatten(tree, noisy))


def _token_batch(count: int) -> dict:
    """A batch as the batcher lays it out: prompts right-padded (the store's layout) of 3 to S
    real tokens, labels with padding after EOS."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, S + 1, size=B * count)
    mask = (np.arange(S)[None] < lengths[:, None]).astype(np.int32)
    ids = rng.integers(3, V, size=(B * count, S)) * mask
    labels = np.array([[7, 11, EOS, PAD, PAD], [5, 13, 17, 19, EOS]], np.int32)
    return {
        "question_input_ids": rng.integers(1, 17, size=(B, Q)).astype(np.int32),
        "question_attention_mask": np.ones((B, Q), np.int32),
        "doc_vectors": rng.normal(size=(B, count, 8)).astype(np.float32),
        "context_input_ids": ids.reshape(B, count, S).astype(np.int32),
        "context_attention_mask": mask.reshape(B, count, S),
        "labels": labels,
    }


def _state_batch(cfg, params, batch: dict, root) -> dict:
    """The batch with the reader's cached states in place of its context tokens: its rows (each
    prompt's real tokens and its question's labels) through `reader_trunk`, gathered at the
    fixed prompt width the batcher uses (here S + 3)."""
    ids, mask = batch["context_input_ids"], batch["context_attention_mask"]
    count = ids.shape[1]
    rows = [
        (ids[b, n][mask[b, n] == 1], batch["labels"][b]) for b in range(B) for n in range(count)
    ]
    trunk = reader_trunk.open_or_build(
        root, cfg.generator, params["generator"], FIRST, rows, LAYOUT
    )
    states, state_mask = trunk.gather(np.arange(len(rows)), prompt_width=S + 3)
    out = {k: v for k, v in batch.items() if not k.startswith("context_")}
    out["reader_states"] = states.reshape(B, count, *states.shape[1:])
    out["reader_mask"] = state_mask.reshape(B, count, -1)
    return out


CASES = {
    # (variant, tied embedding, label smoothing, the retriever's objective)
    "sequence": ("sequence", False, 0.0, RetrieverObjective()),
    "token_tied_smoothed": ("token", True, 0.1, RetrieverObjective()),
    "pdist_over_K": ("sequence", False, 0.0, RetrieverObjective(loss="pdist", candidates=K)),
}


@pytest.mark.parametrize("case", CASES)
def test_a_step_on_cached_states_is_the_whole_readers_step(case, tmp_path):
    variant, tied, smoothing, objective = CASES[case]
    cfg = _cfg(tied, N, smoothing)
    params = _params(cfg)
    count = objective.count(N)
    tokens = _token_batch(count)
    states = _state_batch(cfg, params, tokens, tmp_path)
    loss_fn = step.joint_loss_fn(cfg, variant, frozen=FREEZE, objective=objective)
    grad_fn = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, b, None)[0]))
    want, want_grads = grad_fn(params, jax.tree.map(jnp.asarray, tokens))
    got, got_grads = grad_fn(params, jax.tree.map(jnp.asarray, states))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    trained = set()
    flat_want = jax.tree_util.tree_flatten_with_path(want_grads)[0]
    for (path, w), g in zip(flat_want, jax.tree.leaves(got_grads), strict=True):
        key = jax.tree_util.keystr(path)
        # 1e-5 of the gradient's scale: pdist's reader posterior softmax(r / 0.1) carries the
        # log-likelihoods' float32 rounding (~1e-6) tenfold into question-tower gradients of ~2
        scale = max(1.0, float(np.abs(w).max()))
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * scale, err_msg=key)
        if np.any(g):
            trained.add(key.split("'")[1] + "/" + key.split("'")[3])
    # Everything that trains got its gradient: the question tower, the reader's layers from F
    # up, its final norm and its LM head (the embedding, frozen, when tied); nothing below F.
    head = {f"generator/layers_{i}" for i in range(FIRST, LAYERS)} | {"generator/norm"}
    head |= set() if tied else {"generator/lm_head"}
    assert {k for k in trained if k.startswith("generator/")} == head, trained
    assert any(k.startswith("question_encoder/") for k in trained), trained


def test_one_train_step_moves_the_parameters_alike(tmp_path):
    """The jitted train step (`make_train_step`, SGD): the same metrics, the same new state."""
    import optax

    cfg = _cfg(False, N)
    params = _params(cfg)
    tokens = _token_batch(N)
    states = _state_batch(cfg, params, tokens, tmp_path)
    tx = optax.sgd(0.1)
    results = []
    for batch in (tokens, states):
        train_step = step.make_train_step(
            cfg, "sequence", tx, jax.random.PRNGKey(0), True, frozen=FREEZE
        )
        state = step.init_state(jax.tree.map(jnp.array, params), tx)
        results.append(train_step(state, jax.tree.map(jnp.asarray, batch)))
    (want_state, want_metrics), (got_state, got_metrics) = results
    jax.tree.map(
        lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5),
        got_metrics,
        want_metrics,
    )
    jax.tree.map(
        lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6),
        got_state.params,
        want_state.params,
    )


def test_states_need_a_causal_reader_with_frozen_layers(tmp_path):
    cfg = _cfg(False, N)
    params = _params(cfg)
    states = _state_batch(cfg, params, _token_batch(N), tmp_path)
    unfrozen = cfg.replace(generator=cfg.generator.replace(frozen_layers=0))
    loss_fn = step.joint_loss_fn(unfrozen, "sequence")
    with pytest.raises(ValueError, match="frozen_layers > 0"):
        loss_fn(params, jax.tree.map(jnp.asarray, states), None)
