"""The answer memo of a frozen causal generator: its likelihoods equal the generator's own, the
joint loss and the question encoder's gradient from them equal those from the contexts, pairs are
computed once, and a memo of another generator is never read."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from transformers import BertTokenizer

from rag_jax import rag_math
from rag_jax.training import memo, step
from tests.training.causal_step_test import B, N, T, _setup


def _tokenizer(extra=""):
    return BertTokenizer(vocab={t: i for i, t in enumerate(["[PAD]", "[UNK]", "a", "b" + extra])})


def _memo_batch(cfg, params, batch, answer_memo):
    flat = lambda x: np.asarray(x).reshape(-1, x.shape[-1])  # noqa: E731
    lp = answer_memo.logprobs(
        params["generator"],
        flat(batch["context_input_ids"]),
        flat(batch["context_attention_mask"]),
        batch["labels"],
    )
    memo_batch = {k: v for k, v in batch.items() if not k.startswith("context_")}
    return dict(memo_batch, answer_logprobs=jnp.asarray(lp))


@pytest.mark.parametrize("variant", ["sequence", "token"])
def test_nll_from_token_logprobs_equals_the_nll_from_logits(variant):
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(B * N, T, 11)) * 3, jnp.float32)
    scores = jnp.asarray(rng.normal(size=(B, N)), jnp.float32)
    target = jnp.asarray(rng.integers(0, 11, size=(B, T)), jnp.int32)
    scored = jnp.asarray([[1, 1, 1, 0], [1, 0, 0, 0]], bool)
    common = dict(pad_token_id=0, n_docs=N, aligned=True, target_mask=scored)
    if variant == "sequence":
        expected = rag_math.rag_sequence_nll(logits, scores, target, bos_token_id=None, **common)
    else:
        expected = rag_math.rag_token_nll(logits, scores, target, **common)
    logp = jax.nn.log_softmax(logits, -1).reshape(B, N, T, 11)
    token_lp = jnp.take_along_axis(logp, target[:, None, :, None], -1)[..., 0]
    got = rag_math.nll_from_token_logprobs(token_lp, scores, scored, variant)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"must be \[B, N, T\]"):
        rag_math.nll_from_token_logprobs(token_lp[:, :1], scores, scored, variant)


@pytest.mark.parametrize("variant", ["sequence", "token"])
def test_the_memoised_loss_and_gradient_equal_the_generators(variant, tmp_path):
    cfg, params, batch = _setup()
    answer_memo = memo.AnswerMemo(cfg, params["generator"], _tokenizer(), tmp_path)
    memo_batch = _memo_batch(cfg, params, batch, answer_memo)
    assert "context_input_ids" not in memo_batch
    loss_fn = step.joint_loss_fn(cfg, variant, frozen="^(passage_encoder/|generator/)")
    value_and_grad = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, b, None)[0]))
    (loss, grads), (memo_loss, memo_grads) = (
        value_and_grad(params, batch),
        value_and_grad(params, memo_batch),
    )
    np.testing.assert_allclose(memo_loss, loss, rtol=1e-5)
    assert float(loss) > 0
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
        memo_grads["question_encoder"],
        grads["question_encoder"],
    )
    assert max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(grads["question_encoder"]))


def test_pairs_are_computed_once_and_read_back_exactly(tmp_path):
    cfg, params, batch = _setup()
    tok = _tokenizer()
    first = memo.AnswerMemo(cfg, params["generator"], tok, tmp_path)
    lp = _memo_batch(cfg, params, batch, first)["answer_logprobs"]
    assert (first.computed, first.reused) == (B * N, 0)
    again = _memo_batch(cfg, params, batch, first)["answer_logprobs"]
    assert (first.computed, first.reused) == (B * N, B * N)
    np.testing.assert_array_equal(again, lp)
    # Scored positions hold the generator's log-probs (< 0), the rest 0.
    scored = np.asarray(batch["labels"]) != 0
    scored[:, 2] = True  # the first EOS is scored (pad 0 != EOS 2 here)
    assert (np.asarray(lp)[np.broadcast_to(scored[:, None], lp.shape)] < 0).all()
    assert (np.asarray(lp)[~np.broadcast_to(scored[:, None], lp.shape)] == 0).all()
    first.save()
    reread = memo.AnswerMemo(cfg, params["generator"], tok, tmp_path)
    assert len(reread) == B * N
    np.testing.assert_array_equal(_memo_batch(cfg, params, batch, reread)["answer_logprobs"], lp)
    assert (reread.computed, reread.reused) == (0, B * N)
    # A pair whose prompt or answer differs is another pair.
    changed = dict(
        batch, labels=batch["labels"].at[0, 0].set(5 if batch["labels"][0, 0] != 5 else 6)
    )
    partly = _memo_batch(cfg, params, changed, reread)["answer_logprobs"]
    assert reread.computed == N  # question 0's N prompts with its new answer, in a call of 4
    # Computed in a call of 4 or of 8 (as with another prompt width), within float32 rounding.
    whole = memo.AnswerMemo(cfg, params["generator"], tok, tmp_path / "whole")
    np.testing.assert_allclose(
        partly, _memo_batch(cfg, params, changed, whole)["answer_logprobs"], rtol=1e-5
    )


def test_calls_pad_a_short_last_call_to_a_power_of_two_only():
    assert list(memo.calls([], 8)) == []
    assert list(memo.calls([5], 8)) == [([5], [5])]
    assert list(memo.calls([1, 2, 3], 8)) == [([1, 2, 3], [1, 2, 3, 1])]
    got = list(memo.calls(list(range(11)), 4))
    assert got == [([0, 1, 2, 3],) * 2, ([4, 5, 6, 7],) * 2, ([8, 9, 10], [8, 9, 10, 8])]
    assert list(memo.calls(list(range(5)), 6)) == [([0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 0])]


def test_a_memo_of_another_generator_or_tokenizer_is_never_read(tmp_path):
    cfg, params, batch = _setup()
    tok = _tokenizer()
    written = memo.AnswerMemo(cfg, params["generator"], tok, tmp_path)
    _memo_batch(cfg, params, batch, written)
    written.save()
    other_params = jax.tree.map(lambda x: x * 1.01, params["generator"])
    for g, t in ((other_params, tok), (params["generator"], _tokenizer("x"))):
        other = memo.AnswerMemo(cfg, g, t, tmp_path)
        assert other.path != written.path and len(other) == 0
        # Even the file put in its place is refused: it holds the other fingerprint.
        other.path.write_bytes(written.path.read_bytes())
        with pytest.raises(ValueError, match="not of this run's"):
            memo.AnswerMemo(cfg, g, t, tmp_path)
        other.path.unlink()


def test_refuses_what_it_cannot_memoise(tmp_path):
    cfg, params, _ = _setup()
    with pytest.raises(ValueError, match="label_smoothing=0"):
        memo.AnswerMemo(
            cfg.replace(label_smoothing=0.1), params["generator"], _tokenizer(), tmp_path
        )
    broken = tmp_path / f"{memo.fingerprint(cfg, params['generator'], _tokenizer())}.npz"
    broken.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="unreadable answer memo"):
        memo.AnswerMemo(cfg, params["generator"], _tokenizer(), tmp_path)
