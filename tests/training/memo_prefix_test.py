"""Answer log-probabilities through shared prompt prefixes (`rag_jax.causal_prefix`): equal to the
full forward pass (`memo.pair_logprobs`) and to transformers' LlamaForCausalLM; the answer memo
filled through them (a batch's `logprobs`, a study's `fill`) holds the full pass's values under
the same keys; a second fill of same-shaped groups compiles nothing."""

import threading

import jax
import numpy as np
import pytest
import torch

import hf_fixtures
from rag_jax import causal_prefix, rag
from rag_jax.devices import preemption
from rag_jax.io import hf
from rag_jax.models import bert, llama
from rag_jax.training import memo
from tests.training.memo_test import _tokenizer

# Distinct widths (V 31, H 24, F 40, 3 layers, h 4 over g 2, d 6); a large init so outputs
# depend on every input token.
G_CFG = llama.LlamaConfig(
    vocab_size=31,
    hidden_size=24,
    intermediate_size=40,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=96,
    tie_word_embeddings=False,
    eos_token_id=2,
    pad_token_id=0,
    init_std=0.3,
)
Q_CFG = bert.BertConfig(
    vocab_size=17, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
    intermediate_size=8, max_position_embeddings=8,
)  # fmt: skip
BOS, DOC_SEP, SUFFIX = 1, [4], [5, 6]  # the store's layout: BOS passage doc_sep question suffix
T = 6


def _rag_cfg(n_docs=1):
    return rag.RagConfig(question_encoder=Q_CFG, generator=G_CFG, n_docs=n_docs, bos_token_id=None)


def _prompt(passage, question):
    return np.array([BOS, *passage, *DOC_SEP, *question, *SUFFIX], np.int32)


def _tokens(rng, n, vocab):
    return [int(t) for t in rng.integers(7, vocab, n)]


def _pairs(seed=0, vocab=G_CFG.vocab_size):
    """Prompts sharing passages (one cut shorter for a longer question, two identical, one
    alone) with answers of 1-4 tokens + EOS, as labels [M, T]."""
    rng = np.random.default_rng(seed)
    a, b, c, d = (_tokens(rng, n, vocab) for n in (14, 9, 20, 7))
    q = [_tokens(rng, n, vocab) for n in (3, 5, 6, 4)]
    prompts = [
        _prompt(a, q[0]),
        _prompt(a, q[1]),
        _prompt(a[:11], q[2]),  # the passage cut shorter: it shares 1 + 11 tokens
        _prompt(b, q[0]),
        _prompt(b, q[3]),
        _prompt(b, q[3]),  # the same prompt, another answer
        _prompt(c, q[1]),
        _prompt(d, q[2]),  # alone
        _prompt(c, q[2]),
    ]
    labels = np.zeros((len(prompts), T), np.int32)
    for m in range(len(prompts)):
        n = 1 + m % 4
        labels[m, :n] = rng.integers(7, vocab, n)
        labels[m, n] = G_CFG.eos_token_id
    return prompts, labels


def _padded(prompts, side, extra=2):
    """[M, S] prompts padded on `side` (S = the longest + `extra`) and their mask."""
    width = max(map(len, prompts)) + extra
    ids = np.zeros((len(prompts), width), np.int32)
    mask = np.zeros_like(ids)
    for m, p in enumerate(prompts):
        cols = slice(0, len(p)) if side == "right" else slice(width - len(p), width)
        ids[m, cols], mask[m, cols] = p, 1
    return ids, mask


def test_groups_share_passages_and_leave_each_prompt_its_last_token():
    prompts, _ = _pairs()
    groups = causal_prefix.group_by_prefix(prompts)
    assert sorted(m for g in groups for m in g.pairs) == list(range(len(prompts)))
    by_pair = {m: g for g in groups for m in g.pairs}
    # Passage a with the copy cut to 11 tokens: they share BOS + those 11.
    assert set(by_pair[0].pairs) == {0, 1, 2} and by_pair[0].shared == 12
    # Passage b, the identical prompts included: at least BOS + b + doc_sep.
    assert set(by_pair[3].pairs) == {3, 4, 5} and by_pair[3].shared >= 11
    assert set(by_pair[6].pairs) == {6, 8} and by_pair[6].shared >= 22
    assert by_pair[7].pairs == (7,)
    for g in groups:
        assert g.shared < min(len(prompts[m]) for m in g.pairs)
        head = prompts[g.pairs[0]][: g.shared]
        assert all((prompts[m][: g.shared] == head).all() for m in g.pairs)
    # Identical prompts alone: all but the last token shared.
    same = causal_prefix.group_by_prefix([prompts[4], prompts[5]])
    assert same == [causal_prefix.Group((0, 1), len(prompts[4]) - 1)]
    # Prompts sharing a short head only (BOS + 2 tokens of 14) stay apart.
    rng = np.random.default_rng(3)
    x, y = [9, 9] + _tokens(rng, 12, 31), [9, 9] + _tokens(rng, 12, 31)
    y[2] = x[2] + 1 if x[2] < 30 else 7
    apart = causal_prefix.group_by_prefix([_prompt(x, [7]), _prompt(y, [7])])
    assert sorted(len(g.pairs) for g in apart) == [1, 1]
    with pytest.raises(ValueError, match="at least one real token"):
        causal_prefix.group_by_prefix([prompts[0], np.zeros(0, np.int32)])


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("per_call", [(8, 16), (2, 3)], ids=["one_call", "many_calls"])
def test_prefix_path_equals_the_full_forward_pass(side, per_call, monkeypatch):
    # (2, 3): groups span calls of rows, and short last calls are padded with copies.
    monkeypatch.setattr(causal_prefix, "PREFIXES_PER_CALL", per_call[0])
    monkeypatch.setattr(causal_prefix, "ROWS_PER_CALL", per_call[1])
    params = llama.init_params(G_CFG, jax.random.PRNGKey(0))
    prompts, labels = _pairs()
    ids, mask = _padded(prompts, side)
    want = np.asarray(memo.pair_logprobs(_rag_cfg(), params, ids, mask, labels))
    got = causal_prefix.pair_logprobs(G_CFG, params, prompts, labels)
    assert got.shape == want.shape == (len(prompts), T)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(want).max() > 1  # the model is far from uniform: a wrong context shows
    # Pairs of any answer length alone (no padding to a common T).
    pairs = list(range(len(prompts)))
    widths = [1 + m % 4 for m in pairs]
    calls = causal_prefix.logprob_calls(
        G_CFG, params, prompts, [labels[m, : widths[m]] for m in pairs]
    )
    by_call = {m: v for ms, vs in calls for m, v in zip(ms, vs)}
    for m in pairs:
        np.testing.assert_allclose(by_call[m], want[m, : widths[m]], rtol=1e-5, atol=1e-5)


def test_prefix_path_equals_hf_llama(tmp_path):
    torch_model = hf_fixtures.save_llama(tmp_path)  # GQA 4 over 2 heads, std 0.3, untied
    cfg, params = hf.load_llama(tmp_path)
    prompts, labels = _pairs(seed=1, vocab=cfg.vocab_size)
    got = causal_prefix.pair_logprobs(cfg, params, prompts, labels)
    for m, p in enumerate(prompts):
        ids = torch.tensor(np.concatenate([p, labels[m]])[None].astype(np.int64))
        with torch.no_grad():
            logits = torch_model(input_ids=ids).logits[0, len(p) - 1 : len(p) - 1 + T]
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(labels[m][:, None]).long())
        np.testing.assert_allclose(got[m], want[:, 0].numpy(), rtol=1e-4, atol=1e-4)


def _batch(seed=0):
    """B = 3 questions x N = 4 right-padded prompts from 5 passages (passage 4 read once), and
    their labels [B, T] (answers of 1-3 tokens, EOS, pads)."""
    rng = np.random.default_rng(seed)
    passages = [_tokens(rng, n, 31) for n in (12, 15, 9, 18, 10)]
    questions = [_tokens(rng, n, 31) for n in (4, 6, 3)]
    retrieved = [[0, 1, 2, 3], [1, 0, 3, 2], [2, 0, 1, 4]]
    prompts = [_prompt(passages[i], questions[b]) for b in range(3) for i in retrieved[b]]
    ids, mask = _padded(prompts, "right")
    labels = np.zeros((3, T), np.int32)
    for b in range(3):
        labels[b, : b + 1] = rng.integers(7, 31, b + 1)
        labels[b, b + 1] = G_CFG.eos_token_id
    return prompts, ids, mask, labels


def _full_pass(params, ids, mask, labels):
    """[B * N, T] the per-pair path's values of every prompt row (labels repeated)."""
    rows = np.repeat(np.arange(len(labels)), len(ids) // len(labels))
    return np.asarray(memo.pair_logprobs(_rag_cfg(), params, ids, mask, labels[rows]))


def test_the_memo_through_prefixes_holds_the_full_pass_values(tmp_path):
    params = llama.init_params(G_CFG, jax.random.PRNGKey(1))
    cfg, tok = _rag_cfg(n_docs=4), _tokenizer()
    prompts, ids, mask, labels = _batch()
    want = _full_pass(params, ids, mask, labels).reshape(3, 4, T)
    scored = np.zeros((3, T), bool)
    for b in range(3):
        scored[b, : b + 2] = True  # the answer and its EOS
    want = np.where(scored[:, None], want, 0)

    batch_memo = memo.AnswerMemo(cfg, params, tok, tmp_path / "batch")
    groups = causal_prefix.group_by_prefix(prompts)
    assert max(len(g.pairs) for g in groups) == 3 and min(len(g.pairs) for g in groups) == 1
    got = batch_memo.logprobs(params, ids, mask, labels)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert (batch_memo.computed, batch_memo.reused) == (12, 0)
    keys = {
        memo.pair_key(p, labels[r // 4][scored[r // 4]]): want[r // 4, r % 4][scored[r // 4]]
        for r, p in enumerate(prompts)
    }
    assert set(batch_memo.values) == set(keys)
    for key, value in keys.items():
        np.testing.assert_allclose(batch_memo.values[key], value, rtol=1e-5, atol=1e-5)

    # A study's fill: the same keys, the same values; a batch after it computes nothing.
    study = memo.AnswerMemo(cfg, params, tok, tmp_path / "study")
    answers = [labels[r // 4] for r in range(12)]
    assert study.fill(params, prompts, answers, progress=None) == 12
    assert set(study.values) == set(keys)
    for key, value in keys.items():
        np.testing.assert_allclose(study.values[key], value, rtol=1e-5, atol=1e-5)
    reread = memo.AnswerMemo(cfg, params, tok, tmp_path / "study")  # fill saved it
    np.testing.assert_allclose(
        reread.logprobs(params, ids, mask, labels), want, rtol=1e-5, atol=1e-5
    )
    assert (reread.computed, reread.reused) == (0, 12)
    # Rows given unpadded or with the ignore index after the EOS are the same pairs.
    short = [labels[r // 4][: r // 4 + 2] for r in range(12)]
    ignored = [np.where(np.arange(T) > r // 4 + 1, -100, labels[r // 4]) for r in range(12)]
    for rows in (short, ignored):
        assert study.fill(params, prompts, rows, progress=None) == 0


def test_fill_reports_progress_and_saves_as_it_goes(tmp_path, monkeypatch):
    monkeypatch.setattr(causal_prefix, "ROWS_PER_CALL", 4)  # 12 pairs: several calls
    monkeypatch.setattr(memo, "PROGRESS_EVERY_S", 0.0)
    params = llama.init_params(G_CFG, jax.random.PRNGKey(1))
    cfg, tok = _rag_cfg(n_docs=4), _tokenizer()
    prompts, _, _, labels = _batch()
    answer_memo = memo.AnswerMemo(cfg, params, tok, tmp_path)
    lines, on_disk = [], []

    def progress(line):
        lines.append(line)
        held = memo.AnswerMemo(cfg, params, tok, tmp_path) if answer_memo.path.is_file() else {}
        on_disk.append(len(held))

    answers = [labels[r // 4] for r in range(12)]
    assert answer_memo.fill(params, prompts, answers, progress=progress, save_every_s=0.0) == 12
    assert len(lines) >= 4 and "12/12 pairs computed" in lines[-1] and "pairs/s" in lines[0]
    # Each progress line comes before that call's save: the file lags one call, and grows.
    assert on_disk[0] == 0 and 0 < on_disk[1] < 12 and on_disk == sorted(on_disk)
    assert on_disk[-1] == 12


def test_a_second_fill_of_same_shaped_groups_does_not_recompile(tmp_path):
    params = llama.init_params(G_CFG, jax.random.PRNGKey(2))
    cfg, tok = _rag_cfg(n_docs=4), _tokenizer()

    def fill(seed, directory):
        prompts, _, _, labels = _batch(seed)
        answer_memo = memo.AnswerMemo(cfg, params, tok, tmp_path / directory)
        return answer_memo.fill(params, prompts, [labels[r // 4] for r in range(12)], progress=None)

    assert fill(0, "first") == 12
    traces = causal_prefix.trace_counts()
    assert traces["prefix"] >= 1 and traces["rows"] >= 1
    assert fill(1, "second") == 12  # other tokens, the same lengths and sharing
    assert causal_prefix.trace_counts() == traces


def test_a_stop_during_the_fill_saves_what_it_computed_and_the_rerun_does_the_rest(
    tmp_path, monkeypatch
):
    """A SIGTERM (the preemption flag) during a fill saves the pairs computed so far and raises
    Preempted; the same fill afterwards computes only the others (a study's memo fill had lost
    its work to a SIGTERM)."""
    monkeypatch.setattr(causal_prefix, "ROWS_PER_CALL", 4)  # 12 pairs: several calls
    monkeypatch.setattr(preemption, "_STOP_REQUESTED", threading.Event())
    params = llama.init_params(G_CFG, jax.random.PRNGKey(1))
    cfg, tok = _rag_cfg(n_docs=4), _tokenizer()
    prompts, _, _, labels = _batch()
    answers = [labels[r // 4] for r in range(12)]
    answer_memo = memo.AnswerMemo(cfg, params, tok, tmp_path)
    preemption._STOP_REQUESTED.set()
    with pytest.raises(preemption.Preempted, match=r"after \d+ of 12 pairs"):
        answer_memo.fill(params, prompts, answers, progress=None, save_every_s=1e9)
    kept = len(memo.AnswerMemo(cfg, params, tok, tmp_path))
    assert 0 < kept < 12
    preemption._STOP_REQUESTED.clear()
    resumed = memo.AnswerMemo(cfg, params, tok, tmp_path)
    assert resumed.fill(params, prompts, answers, progress=None) == 12 - kept
    assert len(memo.AnswerMemo(cfg, params, tok, tmp_path)) == 12
