"""The reader warm start (the generator reads another world first) and the warm-start cache."""

import functools

import jax
import numpy as np
import pytest

from rag_jax import data
from rag_jax.retrieval.store import PassageStore
from rag_jax.training import reader, warm_start

# ---------------------------------------------------------------------------------------------
# The reader warm start (the generator), and its place in experiment.build


@pytest.fixture(scope="module")
def reader_exp(tmp_path_factory):
    from rag_jax import experiment
    from tiny_runs import tiny_config

    config = tiny_config(**{"warm_start.reader_steps": 0})
    return experiment.build(config, tmp_path_factory.mktemp("reader"))


def test_reader_warm_start_learns_to_read_deterministically(reader_exp):
    exp = reader_exp
    train_generator = functools.partial(
        reader.reader_warm_start,
        exp.rag_cfg,
        exp.params["generator"],
        exp.generator_tokenizer,
        exp.store,
        exp.train,
        steps=40,
        batch_size=8,
        learning_rate=2e-3,
        seed=0,
        answer_length=exp.config.data.answer_length,
    )
    before = jax.tree.map(np.array, exp.params["generator"])
    generator, log = train_generator()
    assert [r["step"] for r in log] == list(range(4, 41, 4))
    assert log[-1]["loss"] < 0.5 * log[0]["loss"], log
    again, _ = train_generator()
    for a, b in zip(jax.tree.leaves(generator), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(exp.params["generator"]), jax.tree.leaves(before)):
        np.testing.assert_array_equal(np.asarray(a), b)  # the caller's tree is left alone

    with pytest.raises(ValueError, match="batch_size <= examples"):
        train_generator(steps=1, batch_size=len(exp.train) + 1)
    stray = data.Example("q ?", ("a",), "x", ("no_such_passage",))
    with pytest.raises(ValueError, match="name no passage of the store, e.g. x"):
        reader.reader_warm_start(
            exp.rag_cfg,
            exp.params["generator"],
            exp.generator_tokenizer,
            exp.store,
            [stray],
            steps=1,
            batch_size=1,
            learning_rate=1e-3,
            seed=0,
            answer_length=8,
        )


def test_experiment_reads_another_world_and_caches_it(tmp_path, reader_exp, capsys):
    from rag_jax import experiment
    from tiny_runs import tiny_config

    config = tiny_config(**{"warm_start.cache_dir": str(tmp_path / "cache")})
    exp = experiment.build(config, tmp_path / "a")
    assert "reader warm start: 2 steps" in capsys.readouterr().out
    # Only the generator moved; its world is another one (own entities left out).
    for name in ("question_encoder", "passage_encoder"):
        for a, b in zip(
            jax.tree.leaves(exp.params[name]), jax.tree.leaves(reader_exp.params[name])
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    moved = [
        not np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(
            jax.tree.leaves(exp.params["generator"]),
            jax.tree.leaves(reader_exp.params["generator"]),
        )
    ]
    assert sum(moved) > 10
    other = PassageStore.open(tmp_path / "a" / "reader_world")
    own_entities = {f.entity for f in exp.world.facts}
    assert not {other.title(i) for i in range(len(other))} & own_entities
    again = experiment.build(config, tmp_path / "b")  # another workdir, the same cache
    assert "reader warm start: reusing" in capsys.readouterr().out
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(exp.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    config.data.source = "files"
    with pytest.raises(ValueError, match="reader_steps needs data.source='synthetic'"):
        warm_start.generator(
            config, exp.rag_cfg, exp.params, exp.generator_tokenizer, tmp_path, exp.world
        )
