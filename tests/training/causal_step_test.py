"""The joint step with a causal generator: frozen parameters are constants of the loss (no
backward through a frozen generator), top-k training, and the gradient that reaches the question
encoder."""

import jax
import jax.numpy as jnp
import numpy as np

from rag_jax import rag
from rag_jax.models import bert, llama
from rag_jax.training import step

B, N, S, T, Q = 2, 3, 12, 4, 5


def _setup(frozen_layers=0):
    g_cfg = llama.LlamaConfig(
        vocab_size=29,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        eos_token_id=2,
        pad_token_id=0,
        init_std=0.3,
        frozen_layers=frozen_layers,
    )
    q_cfg = bert.BertConfig(
        vocab_size=17, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=8, max_position_embeddings=8,
    )  # fmt: skip
    cfg = rag.RagConfig(question_encoder=q_cfg, generator=g_cfg, n_docs=N, bos_token_id=None)
    params = rag.init_params(cfg, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    mask = (np.arange(S)[None] < rng.integers(4, S + 1, size=(B * N, 1))).astype(np.int32)
    labels = np.zeros((B, T), np.int32)
    labels[:, :2] = rng.integers(3, 29, size=(B, 2))
    labels[:, 2] = 2
    batch = {
        "question_input_ids": jnp.asarray(rng.integers(1, 17, size=(B, Q)), jnp.int32),
        "question_attention_mask": jnp.ones((B, Q), jnp.int32),
        "doc_vectors": jnp.asarray(rng.normal(size=(B, N, 8)), jnp.float32),
        "context_input_ids": jnp.asarray(
            rng.integers(3, 29, size=(B, N, S)) * mask.reshape(B, N, S)
        ),
        "context_attention_mask": jnp.asarray(mask.reshape(B, N, S)),
        "labels": jnp.asarray(labels),
    }
    return cfg, params, batch


def _grad_fn(cfg, frozen):
    loss_fn = step.joint_loss_fn(cfg, "sequence", frozen=frozen)
    return jax.jit(jax.grad(lambda p, b: loss_fn(p, b, None)[0]))


def test_a_frozen_generator_is_a_constant_of_the_loss():
    cfg, params, batch = _setup()
    trained = _grad_fn(cfg, "^passage_encoder/")
    frozen = _grad_fn(cfg, "^(passage_encoder/|generator/)")
    g_all, g_frozen = trained(params, batch), frozen(params, batch)
    # The question encoder's gradient (through the doc scores) is the same either way.
    jax.tree.map(
        # Whole-model gradients from two differently compiled programs: the model tolerance.
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7),
        g_all["question_encoder"],
        g_frozen["question_encoder"],
    )
    assert max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g_frozen["question_encoder"]))
    assert not any(np.any(x) for x in jax.tree.leaves(g_frozen["generator"]))
    # ... and the frozen step does no backward pass through the generator: its compiled FLOPs
    # are those of about one forward pass, a third of forward + backward.
    flops = {
        name: fn.lower(params, batch).compile().cost_analysis()["flops"]
        for name, fn in (("trained", trained), ("frozen", frozen))
    }
    assert flops["frozen"] < 0.5 * flops["trained"], flops


def test_top_layers_training_stops_the_gradient_below_them():
    cfg, params, batch = _setup(frozen_layers=3)
    grads = _grad_fn(cfg, "^(passage_encoder/|generator/(embed_tokens|layers_[012])/)")(
        params, batch
    )
    generator = grads["generator"]
    for i in range(3):
        assert not any(np.any(x) for x in jax.tree.leaves(generator[f"layers_{i}"]))
    assert np.any(generator["layers_3"]["mlp_up_proj"]["kernel"])
    assert np.any(generator["norm"]["scale"])
    # The top layer's gradient is the one of the unfrozen model.
    full = _grad_fn(cfg.replace(generator=cfg.generator.replace(frozen_layers=0)), "")(
        params, batch
    )
    np.testing.assert_allclose(
        generator["layers_3"]["mlp_up_proj"]["kernel"],
        full["generator"]["layers_3"]["mlp_up_proj"]["kernel"],
        rtol=1e-4,
        atol=1e-5,  # a whole model's gradient, of two programs that round differently
    )
