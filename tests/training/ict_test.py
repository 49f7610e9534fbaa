"""ICT warm start: sentence splitting, batches, loss, training effect, determinism, bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rag_jax.models import bert
from rag_jax.retrieval import encode
from rag_jax.retrieval.index import ExactIndex
from rag_jax.run import synthetic
from rag_jax.training import ict

Q, P = 20, 36  # query and passage lengths; the 30-entity world's passages are <= 34 tokens
K = 5  # recall@K


@pytest.fixture(scope="module")
def world():
    return synthetic.make_world(synthetic.WorldConfig(num_entities=30))


@pytest.fixture(scope="module")
def tok(world):
    return synthetic.tokenizer(world)


@pytest.fixture(scope="module")
def cfg(tok):
    return bert.BertConfig(
        vocab_size=len(tok),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )


@pytest.fixture(scope="module")
def tiny_cfg(cfg):
    """For the loop's bookkeeping tests: compiles in a fraction of the time of `cfg`."""
    small = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    return cfg.replace(**small)


def _init(cfg, seed):
    ids = jnp.zeros((1, 4), jnp.int32)
    return bert.BertEncoder(cfg).init(jax.random.key(seed), ids, jnp.ones_like(ids))["params"]


def _pairs(world, rows=None):
    passages = world.passages if rows is None else [world.passages[i] for i in rows]
    return [(p.title, p.text) for p in passages]


def _padded(rows, length, pad_id):
    """Independent of the module's padding: ids, and a mask built from the row lengths."""
    ids = np.full((len(rows), length), pad_id, np.int32)
    mask = np.zeros((len(rows), length), np.int32)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    return ids, mask


# ---------------------------------------------------------------------------------------------
# Sentences, data, batches, loss


@pytest.mark.parametrize(
    "text, sentences",
    [
        ("a b . c d .", ["a b .", "c d ."]),
        (
            "where was x born ? the records were lost . x is known .",
            ["where was x born ?", "the records were lost .", "x is known ."],
        ),
        ("Hello world! Bye.", ["Hello world!", "Bye."]),
        ("no final mark", ["no final mark"]),
        ("  padded .   spaces  ", ["padded .", "spaces"]),
        ("3.5 stays whole .", ["3.5 stays whole ."]),
        ("", []),
        ("   ", []),
    ],
)
def test_split_sentences(text, sentences):
    assert ict.split_sentences(text) == sentences


def test_prepare_ict_data_matches_the_tokenizer(world, tok):
    # The first world passage has two sentences; a second passage with a single sentence (no
    # final mark inside) checks that its query and positive are the whole text.
    first = world.passages[0]
    fact, filler = ict.split_sentences(first.text)
    single = (first.title, fact)
    for passage_format in ("pair", "single"):
        data = ict.prepare_ict_data(
            tok,
            [(first.title, first.text), single],
            query_length=Q,
            passage_length=P,
            passage_format=passage_format,
        )
        np.testing.assert_array_equal(data.num_sentences, [2, 1])
        np.testing.assert_array_equal(data.first_sentence, [0, 2])

        def passage(title, text, passage_format=passage_format):
            if passage_format == "pair":
                return tok(title, text, truncation=True, max_length=P)["input_ids"]
            return tok(f"{title} {text}", truncation=True, max_length=P)["input_ids"]

        queries = [tok(s, truncation=True, max_length=Q)["input_ids"] for s in (fact, filler, fact)]
        contexts = [passage(first.title, filler), passage(first.title, fact), passage(*single)]
        whole = [passage(first.title, first.text), passage(*single)]
        for got, got_mask, rows, length in (
            (data.query_ids, data.query_mask, queries, Q),
            (data.context_ids, data.context_mask, contexts, P),
            (data.passage_ids, data.passage_mask, whole, P),
        ):
            ids, mask = _padded(rows, length, tok.pad_token_id)
            np.testing.assert_array_equal(got, ids)
            np.testing.assert_array_equal(got_mask, mask)


def test_ict_batch_is_a_pure_function_of_seed_and_step(world, tok):
    data = ict.prepare_ict_data(tok, _pairs(world), query_length=Q, passage_length=P)
    b, c = 32, data.num_passages
    batch = lambda seed, step, keep=0.1: ict.ict_batch(
        data, seed=seed, step=step, batch_size=b, keep_prob=keep
    )
    first = batch(3, 7)
    again = batch(3, 7)
    for name in first:
        np.testing.assert_array_equal(first[name], again[name], err_msg=name)
    assert not np.array_equal(first["passage_rows"], batch(4, 7)["passage_rows"])
    assert first["query_ids"].shape == (b, Q) and first["passage_ids"].shape == (b, P)

    # An epoch visits C // B batches of distinct passages.
    per_epoch = c // b
    rows = np.concatenate([batch(3, s)["passage_rows"] for s in range(per_epoch)])
    assert len(set(rows.tolist())) == per_epoch * b
    assert not np.array_equal(batch(3, 0)["passage_rows"], batch(3, per_epoch)["passage_rows"])

    kept = 0
    for step in range(40):
        x = batch(3, step)
        first_row = data.first_sentence[x["passage_rows"]]
        offset = x["sentence_rows"] - first_row
        assert ((offset >= 0) & (offset < data.num_sentences[x["passage_rows"]])).all()
        np.testing.assert_array_equal(x["query_ids"], data.query_ids[x["sentence_rows"]])
        whole = data.passage_ids[x["passage_rows"]]
        context = data.context_ids[x["sentence_rows"]]
        np.testing.assert_array_equal(x["passage_ids"][x["kept"]], whole[x["kept"]])
        np.testing.assert_array_equal(x["passage_ids"][~x["kept"]], context[~x["kept"]])
        kept += int(x["kept"].sum())
    # 1280 Bernoulli(0.1) draws: mean 128, standard deviation ~10.7.
    assert 80 < kept < 176, kept
    assert not batch(3, 0, keep=0.0)["kept"].any()
    assert batch(3, 0, keep=1.0)["kept"].all()
    with pytest.raises(ValueError, match=f"batch_size={c + 1} must be in \\[1, {c}\\]"):
        ict.ict_batch(data, seed=0, step=0, batch_size=c + 1, keep_prob=0.1)


def test_ict_loss_matches_numpy():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(3, 5)).astype(np.float32)
    d = rng.normal(size=(3, 5)).astype(np.float32)
    d[2] = -q[2]  # query 2 misses its own passage
    loss, accuracy = ict.ict_loss(jnp.asarray(q), jnp.asarray(d))
    scores = q.astype(np.float64) @ d.T.astype(np.float64)
    top = scores.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(scores - top).sum(axis=1)) + top[:, 0]
    np.testing.assert_allclose(loss, np.mean(log_z - np.diag(scores)), rtol=1e-5)
    np.testing.assert_allclose(accuracy, np.mean(scores.argmax(axis=1) == np.arange(3)))
    assert accuracy < 1.0
    with pytest.raises(ValueError, match=r"\(3, 5\).*\(3, 4\)"):
        ict.ict_loss(jnp.asarray(q), jnp.asarray(d[:, :4]))
    # Scaled scores (the retriever's doc_score_scale), and passage 0 query 1's positive too.
    same = np.eye(3, dtype=bool)
    same[1, 0] = True
    scaled = 20.0 * scores
    scaled[1, 0] = -np.inf
    top = scaled.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(scaled - top).sum(axis=1)) + top[:, 0]
    loss, _ = ict.ict_loss(jnp.asarray(q), jnp.asarray(d), 20.0, jnp.asarray(same))
    np.testing.assert_allclose(loss, np.mean(log_z - np.diag(scaled)), rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# What ICT teaches, on the 30-entity world (480 passages, 16 per entity)

STEPS, BATCH, LR = 100, 32, 3e-3
HELD_OUT = 0.2  # fraction of passages kept out of ICT; their sentences are the test queries


@functools.cache
def _encode_fn(cfg):
    encoder = bert.BertEncoder(cfg)
    return jax.jit(lambda p, ids, mask: encoder.apply({"params": p}, ids, mask)[0])


def _retrieval(cfg, tok, world, held_out, question_params, passage_params) -> dict:
    """Retrieval metrics of a pair of towers over the whole corpus (ExactIndex, top K).

    Queries: every sentence of the `held_out` passages (target: its own passage, and passages of
    its entity) and the eval questions (target: passages titled with the question's entity, and
    the gold passage).
    """
    encode_fn = _encode_fn(cfg)
    pad_id = tok.pad_token_id
    titles, texts = zip(*_pairs(world), strict=True)
    rows = encode.tokenize_passages(tok, titles, texts, max_length=P, input_format="pair")
    ix = ExactIndex(np.asarray(encode_fn(passage_params, *_padded(rows, P, pad_id))))

    sentences = [(s, i) for i in held_out for s in ict.split_sentences(texts[i])]
    facts = [f for f in world.facts if f.split == "eval"]
    strings = [s for s, _ in sentences] + [f.question for f in facts]
    ids = tok(strings, truncation=True, max_length=Q)["input_ids"]
    queries = np.asarray(encode_fn(question_params, *_padded(ids, Q, pad_id)))
    top = ix.search(queries, K)[1]  # -> [M + F, K]
    hits, found = top[: len(sentences)], top[len(sentences) :]

    title_of = np.array(titles)
    owners = np.array([i for _, i in sentences])  # -> [M]
    entity = np.array([f.entity for f in facts])  # -> [F]
    row_of = {p.id: i for i, p in enumerate(world.passages)}
    gold = np.array([row_of[f.gold_id] for f in facts])  # -> [F]
    about = title_of[found] == entity[:, None]  # -> [F, K]
    return {
        "sentence_recall": float(np.mean((hits == owners[:, None]).any(axis=1))),
        "sentence_entity_precision": float(np.mean(title_of[hits] == title_of[owners][:, None])),
        "entity_hit": float(np.mean(about.any(axis=1))),
        "entity_precision": float(np.mean(about)),
        "gold_recall": float(np.mean((found == gold[:, None]).any(axis=1))),
    }


@pytest.fixture(scope="module")
def trained(world, tok, cfg):
    """Both towers from one random init (as `shared_towers` does), before and after ICT."""
    c = len(world.passages)
    held_out = np.sort(np.random.default_rng(0).permutation(c)[: round(c * HELD_OUT)])
    train_rows = np.setdiff1d(np.arange(c), held_out)
    params = _init(cfg, 0)
    before = _retrieval(cfg, tok, world, held_out, params, params)
    # Counts the traces of the step: `ict_loss` runs once per trace.
    traces = []
    loss_fn = ict.ict_loss
    ict._make_ict_step.cache_clear()  # a step compiled elsewhere would hide the trace
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ict, "ict_loss", lambda *args: traces.append(1) or loss_fn(*args))
        question_params, passage_params, log = ict.ict_warm_start(
            cfg, params, params, tok, _pairs(world, train_rows), steps=STEPS, batch_size=BATCH,
            learning_rate=LR, seed=0, query_length=Q, passage_length=P,
        )  # fmt: skip
    after = _retrieval(cfg, tok, world, held_out, question_params, passage_params)
    print(f"\nICT log {log}\nbefore {before}\nafter  {after}")
    return before, after, log, len(traces)


def test_the_step_compiles_once(trained):
    assert trained[3] == 1


def test_ict_loss_falls_and_in_batch_accuracy_rises(trained):
    _, _, log, _ = trained
    chance = 1.0 / BATCH
    assert [entry["step"] for entry in log] == list(range(10, STEPS + 1, 10))
    assert log[0]["loss"] > 0.9 * np.log(BATCH)  # starts near a uniform guess
    assert log[-1]["loss"] < 0.3 * log[0]["loss"]
    assert log[0]["in_batch_accuracy"] < 5 * chance
    assert log[-1]["in_batch_accuracy"] > 15 * chance


def test_held_out_sentences_find_their_own_passage_and_entity(trained, world):
    before, after, _, _ = trained
    # Towers that share one random init already match by token overlap, so own-passage recall
    # starts far above chance (0.60 here) and ICT, whose positive lacks the query sentence 90% of
    # the time, trades part of it for matching by context (0.24 after): 1 of an entity's 16
    # passages holds the sentence, all 16 its entity. Both are far above chance, and the share of
    # the top K that is about the sentence's entity rises clearly.
    chance = K / len(world.passages)
    assert after["sentence_recall"] > 10 * chance
    assert after["sentence_entity_precision"] > before["sentence_entity_precision"] + 0.2


def test_eval_questions_retrieve_passages_about_their_entity(trained):
    before, after, _, _ = trained
    # On 30 entities a shared random init already has one passage about the entity in the top K
    # for most questions; what ICT adds is that most of the top K are (0.52 -> 0.86 here). The
    # gold passage's recall (0.28 -> 0.34) stays low: distractors share the question's words.
    assert after["entity_precision"] > before["entity_precision"] + 0.25
    assert after["entity_hit"] >= before["entity_hit"]


# ---------------------------------------------------------------------------------------------
# The training loop: determinism, one compilation, bad input


def _short_run(cfg, tok, passages, seed, params=None, **overrides):
    """Three steps with dropout; both towers start from `params` (default: a fresh init)."""
    params = _init(cfg, 0) if params is None else params
    kwargs = dict(steps=3, batch_size=8, learning_rate=1e-3, seed=seed, query_length=Q)
    kwargs = {**kwargs, "passage_length": P, "deterministic": False, **overrides}
    return ict.ict_warm_start(cfg, params, params, tok, passages, **kwargs)


def test_same_seed_gives_bitwise_same_params_and_leaves_the_inputs_alone(world, tok, tiny_cfg):
    passages = _pairs(world, range(40))
    params = _init(tiny_cfg, 0)
    before = jax.tree.map(np.array, params)
    runs = [_short_run(tiny_cfg, tok, passages, seed, params, log_every=2) for seed in (5, 5, 6)]
    same = lambda a, b: all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )
    for i in (0, 1):
        assert same(runs[0][i], runs[1][i])
        assert not same(runs[0][i], runs[2][i])
        assert not same(runs[0][i], before)
    assert runs[0][2] == runs[1][2]
    assert [entry["step"] for entry in runs[0][2]] == [2, 3]  # the last step is always logged
    for entry in runs[0][2]:
        assert set(entry) == {"step", "loss", "in_batch_accuracy"}
        assert np.isfinite(entry["loss"]) and 0.0 <= entry["in_batch_accuracy"] <= 1.0
    # The towers have their own parameters even when they start from one tree.
    assert not same(runs[0][0], runs[0][1])
    assert same(params, before)  # the caller's trees are copied, never donated or changed


@pytest.mark.parametrize(
    "passages, overrides, message",
    [
        ("none", {}, "passages is empty"),
        ("few", {"batch_size": 41}, "batch_size=41 exceeds the number of passages \\(40\\)"),
        ("few", {"steps": 0}, "steps must be a positive int, got 0"),
        ("few", {"steps": -2}, "steps must be a positive int, got -2"),
        ("few", {"batch_size": 1}, "batch_size must be an int >= 2.*got 1"),
        ("few", {"learning_rate": 0.0}, "learning_rate must be > 0, got 0.0"),
        ("few", {"keep_prob": 1.5}, "keep_prob must be in \\[0, 1\\], got 1.5"),
        ("few", {"query_length": 2}, "query_length=2 must be in \\[3, "),
        ("few", {"passage_length": 65}, "passage_length=65 must be in \\[3, .*=64\\]"),
        ("few", {"passage_format": "triple"}, "passage_format must be one of .* got 'triple'"),
        ("blank", {}, "passages\\[3\\] \\(title 'x'\\) has no text: ' '"),
    ],
)
def test_bad_input_names_the_value(world, tok, tiny_cfg, passages, overrides, message):
    few = _pairs(world, range(40))
    passages = {"none": [], "few": few, "blank": few[:3] + [("x", " ")] + few[4:]}[passages]
    with pytest.raises(ValueError, match=message):
        _short_run(tiny_cfg, tok, passages, 0, **overrides)


def test_an_encoder_smaller_than_the_tokenizer_is_refused(world, tok, tiny_cfg):
    small = tiny_cfg.replace(vocab_size=len(tok) - 5)
    params = _init(small, 0)
    with pytest.raises(ValueError, match=f"vocab_size is {len(tok) - 5}"):
        ict.ict_warm_start(
            small, params, params, tok, _pairs(world, range(40)), steps=1, batch_size=8,
            learning_rate=1e-3, seed=0, query_length=Q, passage_length=P,
        )  # fmt: skip
