"""Tests for rag_jax.decoding: hand-built models with known best paths, and identity with HF.

The HF-identity tests drive transformers' `generate` on a small torch encoder-decoder whose
next-token logits come from random tables (a word table, a hashed bigram, a position term, a
per-example source term and per-doc terms marginalised RAG-Token style), and run `beam_search` /
`greedy_search` on a JAX twin of the same model that keeps its history in a cache of shape
[B * K * N] (so beam reordering is exercised with the RAG layout).

Legend: B batch, K beams, R returned sequences, L max_length, V vocab, N docs.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import NamedSharding, PartitionSpec
from transformers.modeling_outputs import BaseModelOutput, Seq2SeqLMOutput

from rag_jax import decoding

# ---------------------------------------------------------------------------------------------
# Torch models that HF `generate` drives: an encoder-decoder whose encoder passes each example's
# source id on and whose decoder maps (history, source id) to logits with fixed tables. Without a
# cache, every step sees the whole history, independently of how the JAX side keeps it.


class _TestConfig(transformers.PretrainedConfig):
    model_type = "decoding_test"


class _SourceEncoder(torch.nn.Module):
    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        return BaseModelOutput(last_hidden_state=input_ids[:, :, None].float())


class _TorchTableModel(transformers.PreTrainedModel, transformers.GenerationMixin):
    config_class = _TestConfig

    def __init__(self, tables: dict[str, np.ndarray], next_logits):
        super().__init__(_TestConfig(is_encoder_decoder=True))
        self.tables = torch.nn.ParameterDict(
            {
                k: torch.nn.Parameter(torch.from_numpy(v), requires_grad=False)
                for k, v in tables.items()
            }
        )
        self.next_logits = next_logits  # (tables, history [M, t], src [M]) -> [M, V]
        self.source_encoder = _SourceEncoder()

    def get_encoder(self):
        return self.source_encoder

    def forward(self, decoder_input_ids=None, encoder_outputs=None, **kwargs):
        src = encoder_outputs.last_hidden_state[:, 0, 0].long()
        logits = self.next_logits(self.tables, decoder_input_ids, src)
        return Seq2SeqLMOutput(logits=logits[:, None, :])


def _hf_generate(tables, next_logits, src, num_beams: int, **settings):
    model = _TorchTableModel(tables, next_logits).eval()
    settings = {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}
    if "bad_words_ids" in settings:
        settings["bad_words_ids"] = [list(w) for w in settings["bad_words_ids"]]
    with torch.no_grad():
        return model.generate(
            input_ids=torch.tensor(np.asarray(src))[:, None], num_beams=num_beams,
            do_sample=False, use_cache=False, output_scores=True, return_dict_in_generate=True,
            **settings,
        )  # fmt: skip


def _hf_beam_arrays(out, batch: int, length: int, fill: int):
    """HF beam output as [B, R, L] sequences padded with `fill`, and [B, R] scores."""
    seqs = out.sequences.numpy()
    seqs = np.pad(seqs, ((0, 0), (0, length - seqs.shape[1])), constant_values=fill)
    return seqs.reshape(batch, -1, length), out.sequences_scores.numpy().reshape(batch, -1)


# ---------------------------------------------------------------------------------------------
# Hand-built transition-table models with known best paths (each is also checked against HF).

START, PAD, EOS, A, B, C, D, E = range(8)
V_HAND = 8


def _table(rows: dict[int, dict[int, float]]) -> np.ndarray:
    """[V, V] float32 log-probs; the unspecified mass goes to the other tokens in unequal shares.

    Unequal shares keep every row free of ties, whose order torch.topk leaves unspecified.
    """
    table = np.zeros((V_HAND, V_HAND))
    for prev in range(V_HAND):
        row = rows.get(prev, {})
        rest = [t for t in range(V_HAND) if t not in row]
        shares = np.arange(1.0, len(rest) + 1.0)
        table[prev, rest] = (1.0 - sum(row.values())) * shares / shares.sum()
        for tok, p in row.items():
            table[prev, tok] = p
    assert np.all(table > 0) and np.allclose(table.sum(1), 1.0)
    return np.log(table).astype(np.float32)


def _path_logprob(table: np.ndarray, seq) -> float:
    return float(sum(table[p, t] for p, t in zip(seq[:-1], seq[1:], strict=True)))


# Greedy takes A (0.5) but every continuation of A is mediocre; B (0.4) leads to C (0.9).
GREEDY_TRAP = _table(
    {
        START: {A: 0.5, B: 0.4},
        A: {C: 0.32, D: 0.31, E: 0.30},
        B: {C: 0.9},
        C: {EOS: 0.9},
        D: {EOS: 0.9},
        E: {EOS: 0.9},
    }
)
# Ending at once scores -1.0; the long path START A B EOS scores about -1.43 over 3 tokens.
SHORT_OR_LONG = _table(
    {START: {EOS: np.exp(-1.0), A: 0.5}, A: {B: 0.8}, B: {EOS: 0.6}, C: {EOS: 0.9}}
)
# A and B want to alternate forever; EOS is unlikely everywhere.
CYCLE = _table({START: {A: 0.8}, A: {B: 0.9}, B: {A: 0.9}})
# With length_penalty 2, START C EOS (-0.458) and START EOS (-0.478) finish by step 2, when the
# running START A B (-2.07 / 2**2) looks hopeless to HF's heuristic, although START A B EOS
# would score -2.08 / 3**2 = -0.231.
GIVE_UP = _table({START: {EOS: 0.62, C: 0.2, A: 0.14}, C: {EOS: 0.8}, A: {B: 0.9}, B: {EOS: 0.99}})
# With EOS ids (EOS, D), all of the top 4 step-2 candidates end: only 3K candidates keep the
# continuations through B alive.
TWO_EOS = _table(
    {
        START: {A: 0.5, C: 0.4},
        A: {EOS: 0.46, D: 0.44, B: 0.09},
        C: {EOS: 0.43, D: 0.47, B: 0.09},
        B: {EOS: 0.99},
    }
)


def _torch_hand_logits(tables, history, src):
    return tables["t"][src, history[:, -1]]


def _hand_fn(tables: np.ndarray):
    tables = jnp.asarray(tables)  # [B, V, V]: one table per example
    return lambda flat_ids, cache, step: (tables[cache, flat_ids[:, 0]], cache)


def _hand_beam(tables, num_beams=2, max_length=6, num_return_sequences=1, **kw):
    """Beam search over per-example tables [B, V, V] (or one [V, V]); asserts HF agrees."""
    tables = np.reshape(tables, (-1, V_HAND, V_HAND))
    batch = len(tables)
    common = dict(max_length=max_length, decoder_start_token_id=START, pad_token_id=PAD,
                  num_return_sequences=num_return_sequences, **kw)  # fmt: skip
    common.setdefault("eos_token_id", EOS)
    out = decoding.beam_search(
        _hand_fn(tables), jnp.repeat(jnp.arange(batch), num_beams), batch_size=batch,
        num_beams=num_beams, **common,
    )  # fmt: skip
    hf = _hf_generate({"t": tables}, _torch_hand_logits, np.arange(batch), num_beams, **common)
    hf_seqs, hf_scores = _hf_beam_arrays(hf, batch, max_length, PAD)
    np.testing.assert_array_equal(out.sequences, hf_seqs)
    np.testing.assert_allclose(out.scores, hf_scores, rtol=0, atol=1e-5)
    return np.asarray(out.sequences), np.asarray(out.scores)


def _hand_greedy(table, max_length=6, **kw):
    """Greedy search over one table [V, V]; asserts HF agrees."""
    tables = np.reshape(table, (1, V_HAND, V_HAND))
    common = dict(max_length=max_length, decoder_start_token_id=START, eos_token_id=EOS,
                  pad_token_id=PAD, **kw)  # fmt: skip
    out = decoding.greedy_search(_hand_fn(tables), jnp.zeros((1,), int), batch_size=1, **common)
    hf = _hf_generate({"t": tables}, _torch_hand_logits, [0], 1, **common).sequences.numpy()
    np.testing.assert_array_equal(out[:, : hf.shape[1]], hf)
    assert np.all(out[:, hf.shape[1] :] == PAD)
    return np.asarray(out)


def test_beam_finds_the_path_greedy_misses():
    seqs, scores = _hand_beam(GREEDY_TRAP, num_return_sequences=2)
    assert seqs.shape == (1, 2, 6) and scores.shape == (1, 2)
    np.testing.assert_array_equal(seqs[0, 0], [START, B, C, EOS, PAD, PAD])
    np.testing.assert_array_equal(seqs[0, 1], [START, A, C, EOS, PAD, PAD])
    # Length 3 counts the generated tokens with EOS, not the decoder start token.
    expected = [_path_logprob(GREEDY_TRAP, s[:4]) / 3 for s in seqs[0]]
    np.testing.assert_allclose(scores[0], expected, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(_hand_greedy(GREEDY_TRAP)[0], [START, A, C, EOS, PAD, PAD])


def test_length_penalty_and_min_length_pick_the_winner():
    short, long = [START, EOS, PAD, PAD, PAD, PAD], [START, A, B, EOS, PAD, PAD]
    # Without a length penalty the one-token hypothesis wins (-1.0 > -1.43) ...
    seqs, scores = _hand_beam(SHORT_OR_LONG, length_penalty=0.0)
    np.testing.assert_array_equal(seqs[0, 0], short)
    np.testing.assert_allclose(scores[0, 0], -1.0, rtol=0, atol=1e-5)
    # ... dividing by the length makes the long one win (-0.48 > -1.0) ...
    seqs, scores = _hand_beam(SHORT_OR_LONG, length_penalty=1.0)
    np.testing.assert_array_equal(seqs[0, 0], long)
    np.testing.assert_allclose(scores[0, 0], _path_logprob(SHORT_OR_LONG, long[:4]) / 3, atol=1e-5)
    # ... and so does banning EOS while the sequence is shorter than 3 (start token included).
    seqs, _ = _hand_beam(SHORT_OR_LONG, length_penalty=0.0, min_length=3)
    np.testing.assert_array_equal(seqs[0, 0], long)
    np.testing.assert_array_equal(_hand_greedy(SHORT_OR_LONG, min_length=2)[0], long)


def test_early_stopping_modes_and_batch_independence():
    give_up, best = [START, C, EOS, PAD, PAD, PAD], [START, A, B, EOS, PAD, PAD]
    # False: HF's heuristic stops at step 2 and misses the better long hypothesis; True stops
    # once K hypotheses are finished; "never" bounds the running beams by max_length instead.
    for early_stopping, expected in [(False, give_up), (True, give_up), ("never", best)]:
        seqs, _ = _hand_beam(GIVE_UP, length_penalty=2.0, early_stopping=early_stopping)
        np.testing.assert_array_equal(seqs[0, 0], expected, err_msg=str(early_stopping))
    # Beside an example that runs to max_length, the first example must neither resume nor
    # admit the long hypothesis once it has stopped improving.
    seqs, scores = _hand_beam(np.stack([GIVE_UP, CYCLE]), length_penalty=2.0)
    np.testing.assert_array_equal(seqs[0, 0], give_up)
    np.testing.assert_allclose(scores[0, 0], _path_logprob(GIVE_UP, give_up[:3]) / 4, atol=1e-5)
    np.testing.assert_array_equal(seqs[1, 0], [START, A, B, A, B, A])


def test_several_eos_ids():
    seqs, scores = _hand_beam(
        TWO_EOS, length_penalty=2.0, early_stopping="never", eos_token_id=(EOS, D)
    )
    np.testing.assert_array_equal(seqs[0, 0], [START, A, B, EOS, PAD, PAD])
    np.testing.assert_allclose(
        scores[0, 0], _path_logprob(TWO_EOS, [START, A, B, EOS]) / 9, atol=1e-5
    )


def test_forced_bos_and_eos():
    seqs, _ = _hand_beam(GREEDY_TRAP, num_return_sequences=2, forced_bos_token_id=D)
    np.testing.assert_array_equal(seqs[0, :, 1], [D, D])
    # CYCLE never ends by itself, so every hypothesis runs to max_length and ends in forced EOS.
    seqs, scores = _hand_beam(CYCLE, num_return_sequences=2, max_length=5, forced_eos_token_id=EOS)
    np.testing.assert_array_equal(seqs[0, 0], [START, A, B, A, EOS])
    np.testing.assert_array_equal(seqs[0, :, -1], [EOS, EOS])
    # The forced step contributes log 1 = 0.
    expected = _path_logprob(CYCLE, [START, A, B, A]) / 4
    np.testing.assert_allclose(scores[0, 0], expected, rtol=0, atol=1e-5)
    greedy = _hand_greedy(CYCLE, max_length=5, forced_bos_token_id=B, forced_eos_token_id=EOS)
    np.testing.assert_array_equal(greedy[0], [START, B, A, B, EOS])


def _bigrams(seq) -> list[tuple[int, int]]:
    return list(zip(seq[:-1].tolist(), seq[1:].tolist(), strict=True))


def test_bad_words_and_no_repeat_ngram_are_never_generated():
    # Banning A alone and the bigram B C leaves START B {D or E} ...: B's best follower is gone.
    bad = [[A], [B, C]]
    seqs, _ = _hand_beam(GREEDY_TRAP, num_beams=3, num_return_sequences=3, bad_words_ids=bad)
    for seq in seqs[0]:
        assert A not in seq.tolist() and (B, C) not in _bigrams(seq), seq
    greedy = _hand_greedy(GREEDY_TRAP, bad_words_ids=bad)
    assert greedy[0, 1] == B and greedy[0, 2] != C

    seqs, _ = _hand_beam(CYCLE, num_return_sequences=2, max_length=8, no_repeat_ngram_size=2)
    greedy = _hand_greedy(CYCLE, max_length=8, no_repeat_ngram_size=2)
    for seq in list(seqs[0]) + [greedy[0]]:
        ends = seq.tolist().index(EOS) if EOS in seq else len(seq) - 1
        assert len(set(_bigrams(seq)[:ends])) == ends, seq  # no bigram repeats before the end
    # Without the ban the cycle repeats, so the test above is not vacuous.
    np.testing.assert_array_equal(_hand_greedy(CYCLE, max_length=6)[0], [START, A, B, A, B, A])


def test_cache_reordering_with_docs_per_beam():
    """A history in a [B * K * N] cache (RAG-Token layout) decodes exactly like one in [B * K]."""
    table, batch, beams = jnp.asarray(GREEDY_TRAP), 2, 3
    rng = np.random.default_rng(0)
    history = jnp.asarray(rng.normal(0.0, 1.5, (V_HAND, V_HAND)), jnp.float32)
    example_bias = jnp.asarray(np.repeat(rng.normal(0.0, 1.0, (batch, V_HAND)), beams, axis=0))

    def run(n_docs):
        def fn(flat_ids, cache, step):
            # The token before the current one, read from the last doc's copy only, so a beam
            # gathered with the wrong layout reads another beam's history.
            before = cache["before"].reshape(batch * beams, n_docs)[:, -1]
            logits = table[flat_ids[:, 0]] + history[before] + cache["bias"]
            return logits, {"before": jnp.repeat(flat_ids[:, 0], n_docs), "bias": cache["bias"]}

        cache = {"before": jnp.full((batch * beams * n_docs,), START), "bias": example_bias}
        return decoding.beam_search(
            fn, cache, batch_size=batch, num_beams=beams, max_length=7,
            decoder_start_token_id=START, eos_token_id=EOS, pad_token_id=PAD,
            num_return_sequences=3,
        )  # fmt: skip

    one, three = run(1), run(3)
    np.testing.assert_array_equal(one.sequences, three.sequences)
    np.testing.assert_array_equal(one.scores, three.scores)
    # The history and the examples matter: the two examples and the first-order table disagree.
    assert not np.array_equal(one.sequences[0], one.sequences[1])
    plain, _ = _hand_beam(np.stack([GREEDY_TRAP] * batch), num_beams=beams, max_length=7,
                          num_return_sequences=3)  # fmt: skip
    assert not np.array_equal(one.sequences, plain)


def test_jitted_search_traces_once():
    traces = []

    def fn(flat_ids, cache, step):
        traces.append(1)
        rows = jnp.arange(flat_ids.shape[0])
        return cache["w"][rows, flat_ids[:, 0]], cache  # cache["w"]: [B * K, V, V]

    search = jax.jit(
        functools.partial(
            decoding.beam_search, fn, batch_size=2, num_beams=3, max_length=7,
            decoder_start_token_id=START, eos_token_id=EOS, pad_token_id=PAD,
            no_repeat_ngram_size=2, num_return_sequences=2,
        )
    )  # fmt: skip
    w = jnp.broadcast_to(jnp.asarray(GREEDY_TRAP), (6, V_HAND, V_HAND))
    first = search({"w": w})
    assert len(traces) == 1
    second = search({"w": w * 2.0})  # same shapes, new values
    assert len(traces) == 1
    assert not np.array_equal(first.scores, second.scores)


def test_bad_settings_raise():
    with pytest.raises(ValueError, match="num_return_sequences"):
        _hand_beam(GREEDY_TRAP, num_beams=2, num_return_sequences=3)
    with pytest.raises(ValueError, match="leading dimension"):
        decoding.beam_search(
            _hand_fn(GREEDY_TRAP[None]), {"h": jnp.zeros((5, 3))}, batch_size=2, num_beams=2,
            max_length=5, decoder_start_token_id=START, eos_token_id=EOS, pad_token_id=PAD,
        )  # fmt: skip
    with pytest.raises(ValueError, match="outside the vocabulary"):
        _hand_beam(GREEDY_TRAP, forced_bos_token_id=V_HAND)
    with pytest.raises(ValueError, match="early_stopping"):
        _hand_beam(GREEDY_TRAP, early_stopping="sometimes")


# ---------------------------------------------------------------------------------------------
# HF identity on random tables: a word table, a hashed bigram, a position term, a per-example
# source term and per-doc terms, marginalised over N docs RAG-Token style when N > 1.

V_TWIN, HASH, N_SRC = 40, 37, 5
BOS_T, PAD_T, EOS_T = 0, 1, 2  # BART's ids; BART also starts decoding with EOS


def _twin_tables(seed: int, n_docs: int, max_length: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    pos = rng.normal(0.0, 0.5, (max_length, V_TWIN))
    pos[:, EOS_T] += np.linspace(0.0, 5.0, max_length)  # EOS grows likelier with length
    tables = dict(
        word=rng.normal(0.0, 2.0, (V_TWIN, V_TWIN)),
        pair=rng.normal(0.0, 1.0, (HASH, V_TWIN)),
        pos=pos,
        src=rng.normal(0.0, 1.0, (N_SRC, V_TWIN)),
        doc=rng.normal(0.0, 1.0, (N_SRC, n_docs, V_TWIN)),
        prior=rng.normal(0.0, 1.0, (N_SRC, n_docs)),
    )
    return {k: v.astype(np.float32) for k, v in tables.items()}


def _torch_twin_logits(t, history, src):
    p1 = history[:, -1]
    p2 = history[:, -2] if history.shape[1] > 1 else torch.full_like(p1, V_TWIN)
    base = t["word"][p1] + t["pair"][(p2 * 31 + p1) % HASH] + t["pos"][history.shape[1] - 1]
    per_doc = (base + t["src"][src])[:, None, :] + t["doc"][src]  # -> [M, N, V]
    if per_doc.shape[1] == 1:
        return per_doc[:, 0]
    # RAG-Token: log sum_n p(n | x) p(y | x, n), returned as the logits.
    doc_lp = torch.log_softmax(t["prior"][src], dim=-1)[:, :, None]
    return torch.logsumexp(torch.log_softmax(per_doc, dim=-1) + doc_lp, dim=1)


def _jax_twin_fn(t: dict[str, jax.Array], n_docs: int):
    def fn(flat_ids, cache, step):
        m = flat_ids.shape[0]
        p1, p2 = flat_ids[:, 0], cache["last"].reshape(m, n_docs)  # p2: one copy per doc
        src = cache["src"]
        # Same additions in the same order as the torch twin: bit-identical per-doc logits.
        base = t["word"][p1][:, None] + t["pair"][(p2 * 31 + p1[:, None]) % HASH] + t["pos"][step]
        per_doc = (base + t["src"][src][:, None]) + t["doc"][src]  # -> [M, N, V]
        if n_docs == 1:
            logits = per_doc[:, 0]
        else:
            doc_lp = jax.nn.log_softmax(t["prior"][src], axis=-1)[:, :, None]
            logits = jax.nn.logsumexp(jax.nn.log_softmax(per_doc, axis=-1) + doc_lp, axis=1)
        return logits, {"last": jnp.repeat(p1, n_docs), "src": src}

    return fn


def _twin_cache(src: np.ndarray, beams: int, n_docs: int):
    return {
        "last": jnp.full((len(src) * beams * n_docs,), V_TWIN, jnp.int32),  # no token yet
        "src": jnp.repeat(jnp.asarray(src, jnp.int32), beams),  # -> [B * K]
    }


@functools.cache
def _jitted(search: str, n_docs: int, settings: tuple):
    def run(tables, cache):
        fn = _jax_twin_fn(tables, n_docs)
        if search == "beam":
            return decoding.beam_search(fn, cache, **dict(settings))
        return decoding.greedy_search(fn, cache, **dict(settings))

    return jax.jit(run)


BART_LIKE = dict(decoder_start_token_id=EOS_T, eos_token_id=EOS_T, pad_token_id=PAD_T)
BEAM_SETTINGS = [  # (n_docs, settings); L = 12, B = 3 everywhere
    (1, dict(num_beams=4, num_return_sequences=2, length_penalty=1.0, early_stopping=False)),
    (3, dict(num_beams=4, num_return_sequences=2, length_penalty=2.0, early_stopping=True,
             min_length=5, forced_bos_token_id=BOS_T, forced_eos_token_id=EOS_T)),
    (1, dict(num_beams=4, num_return_sequences=2, length_penalty=0.5, early_stopping="never",
             no_repeat_ngram_size=2, bad_words_ids=((5,), (7, 8), (9, 10, 11), (EOS_T,)))),
    (3, dict(num_beams=4, num_return_sequences=1, length_penalty=-0.3, early_stopping=False,
             no_repeat_ngram_size=3, min_length=3)),
    (1, dict(num_beams=3, num_return_sequences=3, length_penalty=1.5, early_stopping="never",
             forced_eos_token_id=EOS_T, decoder_start_token_id=BOS_T, eos_token_id=(EOS_T, 6))),
    (3, dict(num_beams=4, num_return_sequences=2, length_penalty=0.0, early_stopping=True,
             no_repeat_ngram_size=1, pad_token_id=0, decoder_start_token_id=3)),
]  # fmt: skip
SEEDS_PER_SETTING = 4


@pytest.mark.parametrize("case", range(len(BEAM_SETTINGS)))
def test_beam_search_matches_hf(case):
    n_docs, settings = BEAM_SETTINGS[case]
    settings = {**BART_LIKE, "max_length": 12, **settings}
    k, length = settings["num_beams"], settings["max_length"]
    eos = np.atleast_1d(settings["eos_token_id"])
    # HF fills finished hypotheses with `pad_token_id or eos_token_id[0]`.
    fill = settings["pad_token_id"] or int(eos[0])
    search = _jitted("beam", n_docs, tuple(sorted({**settings, "batch_size": 3}.items())))
    ended_early = 0
    for seed in range(SEEDS_PER_SETTING):
        tables = _twin_tables(100 * case + seed, n_docs, length)
        src = np.random.default_rng(seed).integers(0, N_SRC, size=3)
        hf = _hf_generate(tables, _torch_twin_logits, src, **settings)
        hf_seqs, hf_scores = _hf_beam_arrays(hf, 3, length, fill)
        out = search(jax.tree.map(jnp.asarray, tables), _twin_cache(src, k, n_docs))
        np.testing.assert_array_equal(out.sequences, hf_seqs, err_msg=f"seed {seed}")
        np.testing.assert_allclose(out.scores, hf_scores, rtol=0, atol=1e-5, err_msg=f"seed {seed}")
        ended_early += int(np.isin(hf_seqs[:, :, 1:-1], eos).any(-1).sum())
    # Some hypotheses end before max_length, so EOS handling and padding are exercised.
    assert ended_early > 0 or "forced_eos_token_id" in settings


GREEDY_SETTINGS = [
    (1, dict()),
    (3, dict(min_length=6, forced_bos_token_id=BOS_T, no_repeat_ngram_size=2)),
    (1, dict(forced_eos_token_id=EOS_T, bad_words_ids=((5,), (7, 8)), no_repeat_ngram_size=3)),
]


@pytest.mark.parametrize("case", range(len(GREEDY_SETTINGS)))
def test_greedy_search_matches_hf(case):
    n_docs, settings = GREEDY_SETTINGS[case]
    settings = {**BART_LIKE, "max_length": 12, **settings}
    search = _jitted("greedy", n_docs, tuple(sorted({**settings, "batch_size": 3}.items())))
    for seed in range(SEEDS_PER_SETTING):
        tables = _twin_tables(1000 + 100 * case + seed, n_docs, settings["max_length"])
        src = np.random.default_rng(seed).integers(0, N_SRC, size=3)
        hf = _hf_generate(tables, _torch_twin_logits, src, num_beams=1, **settings).sequences
        seqs = np.asarray(search(jax.tree.map(jnp.asarray, tables), _twin_cache(src, 1, n_docs)))
        np.testing.assert_array_equal(seqs[:, : hf.shape[1]], hf.numpy(), err_msg=f"seed {seed}")
        assert np.all(seqs[:, hf.shape[1] :] == PAD_T)


def test_beam_search_sharded_over_devices_matches_one_device():
    if jax.device_count() < 8:
        pytest.skip(reason="needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    n_docs, settings = BEAM_SETTINGS[1]
    settings = {**BART_LIKE, "max_length": 12, **settings, "batch_size": 8}
    search = _jitted("beam", n_docs, tuple(sorted(settings.items())))
    tables = jax.tree.map(jnp.asarray, _twin_tables(7, n_docs, settings["max_length"]))
    cache = _twin_cache(np.arange(8) % N_SRC, settings["num_beams"], n_docs)
    single = search(tables, cache)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    # The batch (every cache leaf's leading axis) split over 8 devices, as in data parallelism.
    sharded = search(tables, jax.device_put(cache, NamedSharding(mesh, PartitionSpec("data"))))
    assert len(sharded.sequences.sharding.device_set) == 8
    np.testing.assert_array_equal(sharded.sequences, single.sequences)
    np.testing.assert_array_equal(sharded.scores, single.scores)
