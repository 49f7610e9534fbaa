"""`remat_policy`: each policy's gradients equal the gradients without remat, for BERT, BART
(encoder, causal decoder, cross-attention) and the Llama decoder; each policy saves what it
says (the residuals `jax.ad_checkpoint.print_saved_residuals` lists); "full" is `nn.remat`
without a policy, as `remat=True` was; a bad value is refused by name."""

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from rag_jax.models import bart, bert, layers, llama, remat

TOL = 1e-4  # float32, whole models: relative to the largest magnitude of the reference's values

BERT = bert.BertConfig(
    vocab_size=13, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
    intermediate_size=12, max_position_embeddings=16, initializer_range=0.3,
)  # fmt: skip
BART = bart.BartConfig(
    vocab_size=11, d_model=8, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
    decoder_attention_heads=2, encoder_ffn_dim=12, decoder_ffn_dim=12,
    max_position_embeddings=16, init_std=0.3,
)  # fmt: skip
LLAMA = llama.LlamaConfig(
    vocab_size=13, hidden_size=16, intermediate_size=20, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, init_std=0.3,
    tie_word_embeddings=False,
)  # fmt: skip


def _close(got, want, tol=TOL):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g), np.asarray(w)
        scale = max(float(np.max(np.abs(w))), 1e-30)
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * scale)


def _mask(lengths, length):
    return jnp.asarray((np.arange(length)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32))


def _bert_loss():
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(3, 13, (3, 6)), jnp.int32)
    mask = _mask([6, 3, 5], 6)
    weights = jnp.asarray(rng.normal(size=(3, 8)), jnp.float32)
    params = bert.BertEncoder(BERT).init(jax.random.PRNGKey(1), ids, mask)

    def loss(cfg, params):
        pooled, aux = bert.BertEncoder(cfg).apply(params, ids, mask)
        return jnp.sum(pooled * weights) + jnp.sum(jnp.sin(aux["hidden"]) * mask[..., None])

    return BERT, params, loss


def _bart_loss():
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(3, 11, (3, 6)), jnp.int32)
    mask = _mask([6, 3, 5], 6)
    target = jnp.asarray(rng.integers(3, 11, (3, 4)), jnp.int32)
    target_mask = _mask([4, 2, 3], 4)
    params = bart.Bart(BART).init(jax.random.PRNGKey(2), ids, mask, target)

    def loss(cfg, params):
        logits, _ = bart.Bart(cfg).apply(params, ids, mask, target, target_mask)
        logp = jax.nn.log_softmax(logits)
        return -jnp.sum(jnp.take_along_axis(logp, target[..., None], -1)[..., 0] * target_mask)

    return BART, params, loss


def _llama_loss():
    rng = np.random.default_rng(2)
    mask = np.ones((3, 7), np.int32)
    mask[1, :3] = mask[2, :1] = 0  # left-padded rows
    ids = jnp.asarray(rng.integers(0, 13, (3, 7)), jnp.int32)
    mask = jnp.asarray(mask)
    params = {"params": llama.init_params(LLAMA, jax.random.PRNGKey(3))}

    def loss(cfg, params):
        logits = llama.Llama(cfg).apply(params, ids, mask)
        return jnp.sum(jnp.sin(logits) * mask[..., None])

    return LLAMA, params, loss


MODELS = {"bert": _bert_loss, "bart": _bart_loss, "llama": _llama_loss}


@pytest.mark.parametrize("policy", remat.POLICIES)
@pytest.mark.parametrize("model", MODELS)
def test_gradients_with_each_policy_equal_no_remat(model, policy):
    cfg, params, loss = MODELS[model]()
    plain = jax.jit(jax.value_and_grad(lambda p: loss(cfg, p)))(params)
    rematerialised = cfg.replace(remat=True, remat_policy=policy)
    got = jax.jit(jax.value_and_grad(lambda p: loss(rematerialised, p)))(params)
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(plain[1])) > 1e-3
    _close(got, plain)


def _saved(model, policy):
    """{checkpoint name or "unnamed": count} of the residuals the backward pass reads."""
    cfg, params, loss = MODELS[model]()
    rematerialised = cfg.replace(remat=True, remat_policy=policy)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_saved_residuals(lambda p: loss(rematerialised, p), params)
    out = {}
    for why in printed.getvalue().splitlines():
        key = next((n for n in _NAMES if f"'{n}'" in why), "unnamed")
        out[key] = out.get(key, 0) + 1
    return out


_NAMES = (remat.QUERY, remat.KEY, remat.VALUE, remat.ATTENTION, remat.ATTENTION_PROJECTION,
          remat.FFN_OUTPUT)  # fmt: skip


@pytest.mark.parametrize("model", MODELS)
def test_each_policy_saves_what_it_says(model):
    # Attentions: BERT 2 layers; BART 2 encoder layers + 2 decoder layers of 2; Llama 2 layers.
    attentions = {"bert": 2, "bart": 6, "llama": 2}[model]
    # The feed-forward outputs the backward pass reads: post-LN layers (BERT, BART) read theirs
    # (their sum with the input is normalised); pre-norm Llama only adds it to the stream.
    ffn_outputs = {"bert": 2, "bart": 4, "llama": 0}[model]
    full, attention, projections = (_saved(model, p) for p in ("full", "attention", "projections"))
    assert set(full) == {"unnamed"}, full
    for name in (remat.QUERY, remat.KEY, remat.VALUE):
        assert attention[name] == projections[name] == attentions, (name, attention, projections)
    assert attention[remat.ATTENTION] == attentions and remat.ATTENTION not in projections
    assert remat.ATTENTION_PROJECTION not in attention and remat.FFN_OUTPUT not in attention
    assert projections[remat.ATTENTION_PROJECTION] == attentions
    assert projections.get(remat.FFN_OUTPUT, 0) == ffn_outputs
    both = _saved(model, "attention_and_projections")
    assert both == {**projections, remat.ATTENTION: attentions}, (both, projections)
    # "dots" saves matmul outputs, which carry no name; more arrays than "full" saves.
    dots = _saved(model, "dots")
    assert set(dots) == {"unnamed"} and dots["unnamed"] > full["unnamed"], (dots, full)


def test_full_is_nn_remat_without_a_policy():
    """ "full" is `nn.remat` with no policy, as `remat=True` was; the others pass theirs."""
    cfg, params, loss = _bart_loss()

    def policies(policy):
        """The policies of the `checkpoint` equations in the loss's jaxpr (one per layer)."""
        config = cfg.replace(remat=True, remat_policy=policy)
        found = []

        def walk(jaxpr):
            for eqn in jaxpr.eqns:
                if eqn.primitive.name in ("checkpoint", "remat2"):  # remat_p, by version
                    found.append(eqn.params["policy"])
                for v in eqn.params.values():
                    inner = getattr(v, "jaxpr", v)
                    if hasattr(inner, "eqns"):
                        walk(inner)

        walk(jax.make_jaxpr(lambda p: loss(config, p))(params).jaxpr)
        return found

    assert policies("full") == [None] * 4  # BART's 2 encoder and 2 decoder layers
    assert policies("dots") == [jax.checkpoint_policies.dots_with_no_batch_dims_saveable] * 4


@pytest.mark.parametrize(
    "make",
    [
        lambda: bert.BertConfig(remat_policy="some"),
        lambda: bart.BartConfig(remat_policy="some"),
        lambda: llama.LlamaConfig(remat_policy="some"),
        lambda: layers.layer_class(True, "some"),
    ],
    ids=["bert", "bart", "llama", "layer_class"],
)
def test_a_bad_policy_is_refused_by_name(make):
    with pytest.raises(ValueError, match=r"remat_policy must be one of full \| attention .*'some'"):
        make()
