"""The supervised warm start of both towers (`warm_start.method = "gold"`): its batches, its loss
with shared gold passages left out, and what it teaches on the synthetic world."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rag_jax.models import bert
from rag_jax.retrieval import encode
from rag_jax.retrieval.index import ExactIndex
from rag_jax.run import synthetic
from rag_jax.training import gold_pairs

Q, P = 20, 36
SCALE = 20.0


@pytest.fixture(scope="module")
def world():
    return synthetic.make_world(synthetic.WorldConfig(num_entities=30))


@pytest.fixture(scope="module")
def tok(world):
    return synthetic.tokenizer(world)


@pytest.fixture(scope="module")
def cfg(tok):
    return bert.BertConfig(
        vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64, pooling="mean", normalize=True,
    )  # fmt: skip


def _facts(world, split):
    row = {p.id: i for i, p in enumerate(world.passages)}
    return [(f.question, row[f.gold_id]) for f in world.facts if f.split == split]


def test_batches_are_a_pure_function_of_seed_and_step_and_mark_shared_passages(world, tok):
    pairs = _facts(world, "train")
    rows = [r for _, r in pairs]
    rows[1] = rows[0]  # two questions of one passage
    passages = [(world.passages[r].title, world.passages[r].text) for r in rows]
    data = gold_pairs.prepare_pairs(
        tok, [q for q, _ in pairs], passages, rows, query_length=Q, passage_length=P
    )
    m, b = data.num_pairs, 16
    per_epoch = m // b
    seen = np.concatenate(
        [
            gold_pairs.pairs_batch(data, seed=0, step=s, batch_size=b)["pairs"]
            for s in range(per_epoch)
        ]
    )
    assert len(set(seen.tolist())) == per_epoch * b  # one epoch: no pair twice
    one = gold_pairs.pairs_batch(data, seed=0, step=3, batch_size=b)
    again = gold_pairs.pairs_batch(data, seed=0, step=3, batch_size=b)
    for k in one:
        np.testing.assert_array_equal(one[k], again[k])
    other = gold_pairs.pairs_batch(data, seed=1, step=3, batch_size=b)
    assert not np.array_equal(one["pairs"], other["pairs"])
    for s in range(2 * per_epoch):
        batch = gold_pairs.pairs_batch(data, seed=0, step=s, batch_size=b)
        want = np.array(rows)[batch["pairs"]]
        np.testing.assert_array_equal(batch["same"], want[:, None] == want[None, :])
        ids = tok([pairs[i][0] for i in batch["pairs"]], truncation=True, max_length=Q)
        for i, row in enumerate(ids["input_ids"]):
            np.testing.assert_array_equal(batch["query_ids"][i, : len(row)], row)
            assert batch["query_mask"][i].sum() == len(row)
    with pytest.raises(ValueError, match="batch_size=.* must be in"):
        gold_pairs.pairs_batch(data, seed=0, step=0, batch_size=m + 1)


def _gold_recall(cfg, tok, world, facts, q_params, p_params, k=5) -> float:
    encoder = bert.BertEncoder(cfg)
    run = jax.jit(lambda p, ids, mask: encoder.apply({"params": p}, ids, mask)[0])
    titles = [p.title for p in world.passages]
    texts = [p.text for p in world.passages]
    rows = encode.tokenize_passages(tok, titles, texts, max_length=P, input_format="pair")
    ids = np.full((len(rows), P), tok.pad_token_id, np.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    index = ExactIndex(np.asarray(run(p_params, ids, (ids != tok.pad_token_id).astype(np.int32))))
    q = tok([f for f, _ in facts], truncation=True, max_length=Q, padding="max_length")
    vectors = np.asarray(run(q_params, np.asarray(q["input_ids"]), np.asarray(q["attention_mask"])))
    top = index.search(vectors, k)[1]
    return float(np.mean([row in hits for (_, row), hits in zip(facts, top, strict=True)]))


@pytest.mark.slow  # ~30 s on 2 cores
def test_training_on_train_questions_finds_eval_questions_gold_passages(world, tok, cfg):
    """Trained on the train entities' questions with their gold passages, both towers find the
    gold passages of other entities' questions (the eval split's) far more often than before."""
    params = bert.BertEncoder(cfg).init(
        jax.random.key(0), jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4), jnp.int32)
    )["params"]
    train, held = _facts(world, "train"), _facts(world, "eval")
    before = _gold_recall(cfg, tok, world, held, params, params)
    passages = [(world.passages[r].title, world.passages[r].text) for _, r in train]
    q_params, p_params, log = gold_pairs.gold_warm_start(
        cfg, params, params, tok, [q for q, _ in train], passages, [r for _, r in train],
        steps=150, batch_size=32, learning_rate=1e-3, seed=0, query_length=Q, passage_length=P,
        scale=SCALE,
    )  # fmt: skip
    after = _gold_recall(cfg, tok, world, held, q_params, p_params)
    assert log[-1]["loss"] < 0.5 * log[0]["loss"]
    assert after > before + 0.2, (before, after)


def test_bad_input_names_the_value(world, tok, cfg):
    params = bert.BertEncoder(cfg).init(
        jax.random.key(0), jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4), jnp.int32)
    )["params"]
    args = (cfg, params, params, tok, ["q a", "q b"], [("t", "a"), ("t", "b")], [0, 1])
    common = dict(seed=0, query_length=Q, passage_length=P, learning_rate=1e-3)
    with pytest.raises(ValueError, match="batch_size=3 exceeds the 2 training pairs"):
        gold_pairs.gold_warm_start(*args, steps=1, batch_size=3, **common)
    with pytest.raises(ValueError, match="steps must be a positive int"):
        gold_pairs.gold_warm_start(*args, steps=0, batch_size=2, **common)
    with pytest.raises(ValueError, match="2 questions, 2 passages, 1 rows"):
        gold_pairs.prepare_pairs(tok, ["a", "b"], [("t", "a"), ("t", "b")], [0], query_length=Q,
                                 passage_length=P)  # fmt: skip
