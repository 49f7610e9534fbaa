"""Fault injection: each guarantee of the README's "Reliability" section, proven.

Preemption and crashes at any moment, corrupted or truncated checkpoints, indexes, vector shards and
token stores, index/corpus/encoder mismatches, a non-finite loss, a full disk, and config errors.
Trainer runs use a tiny world and model (`tiny_config`) and share a persistent compilation cache,
so only the first run of the module compiles; they are marked slow (run them with `-m slow`), and
the same guarantees are also proven on the checkpoint and file layers by the default tests.
"""

import errno
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_fixtures
from experiments.configs import default as default_config
from rag_jax.devices import preemption
from rag_jax.io import hf
from rag_jax.retrieval import encode, encoder_id, files, index
from rag_jax.retrieval.corpus import Passage
from rag_jax.retrieval.store import PassageStore
from rag_jax.retrieval.vectors import load_vectors
from rag_jax.run import checkpoints, settings, validation
from rag_jax.run.index_build import build_index, load_passage_encoder
from rag_jax.training import experiment, ict, loop
from rag_jax.training.batcher import Batcher

ROOT = pathlib.Path(__file__).resolve().parents[1]

STEPS = 8
# The tiny run: a small synthetic world, one-layer towers and BART, a 2-step warm start, no eval.
TINY = {
    "data.num_entities": 12,
    "train.steps": STEPS,
    "train.batch_size": 8,
    "train.log_every": 4,
    "train.save_every": 2,
    "train.keep_checkpoints": 10,
    "train.warmup_steps": 2,
    "eval.enabled": False,
    "rag.n_docs": 5,
    "rag.max_combined_length": 32,
    "retrieval.passage_max_length": 32,
    "warm_start.steps": 2,
    "warm_start.batch_size": 8,
    "warm_start.reader_steps": 2,
    "warm_start.reader_entities": 4,
    "model.question_encoder.hidden_size": 16,
    "model.question_encoder.num_hidden_layers": 1,
    "model.question_encoder.num_attention_heads": 2,
    "model.question_encoder.intermediate_size": 32,
    "model.generator.d_model": 16,
    "model.generator.encoder_layers": 1,
    "model.generator.decoder_layers": 1,
    "model.generator.encoder_attention_heads": 2,
    "model.generator.decoder_attention_heads": 2,
    "model.generator.encoder_ffn_dim": 32,
    "model.generator.decoder_ffn_dim": 32,
}


def tiny_config(**overrides):
    return settings.override(default_config.get_config(), {**TINY, **overrides})


def _flat(tree):
    return {
        jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(tree)
    }


def _assert_bitwise_equal(got, want, context=""):
    got, want = _flat(got), _flat(want)
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=f"{context} {key}")


@pytest.fixture(scope="module")
def compilation_cache(tmp_path_factory):
    """A persistent compilation cache for this module's trainer runs (restored afterwards)."""
    from jax.experimental.compilation_cache import compilation_cache as cache

    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    before = {name: getattr(jax.config, name) for name in names}
    jax.config.update(names[0], str(tmp_path_factory.mktemp("jax_cache")))
    jax.config.update(names[1], 0)
    jax.config.update(names[2], 0)
    cache.reset_cache()
    yield
    for name, value in before.items():
        jax.config.update(name, value)
    cache.reset_cache()


@pytest.fixture
def stop_flag(monkeypatch):
    """The trainer's SIGTERM handler and stop flag, fresh for the test and restored after it."""
    previous = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(preemption, "_STOP_REQUESTED", threading.Event())
    yield preemption._STOP_REQUESTED
    signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, compilation_cache):
    """An uninterrupted tiny run: its workdir (checkpoints at 1, 2, 4, 6, 8) and restore_step."""
    workdir = tmp_path_factory.mktemp("straight")
    loop.train_and_evaluate(tiny_config(), workdir)
    exp, state, step = loop.restore(workdir)
    assert step == STEPS

    def restore_step(directory, step):
        with checkpoints.Checkpointer(directory, read_only=True) as ckpt:
            return ckpt.restore(step, state)

    return types.SimpleNamespace(workdir=workdir, exp=exp, state=state, restore_step=restore_step)


# ---------------------------------------------------------------------------------------------
# Preemption and crashes


@pytest.mark.slow  # the first trainer run of the module compiles: ~25 s
def test_preemption_at_a_random_step_saves_that_step_and_resumes_bitwise(
    tmp_path, straight, stop_flag, monkeypatch, capsys
):
    """SIGTERM while a random batch is prepared: the step it completes is saved, nothing lost."""
    batch_index = int(np.random.default_rng().integers(0, STEPS - 1))
    original = Batcher.train_batch

    def sigterm_at(self, state, step, retriever):
        if step == batch_index:
            os.kill(os.getpid(), signal.SIGTERM)  # the real signal, through the real handler
        return original(self, state, step, retriever)

    monkeypatch.setattr(Batcher, "train_batch", sigterm_at)
    config = tiny_config(**{"train.save_every": 1000})
    summary = loop.train_and_evaluate(config, tmp_path)
    out = capsys.readouterr().out
    stopped = batch_index + 1
    assert summary["steps"] == stopped and f"preempted: saved step {stopped}" in out, batch_index
    with checkpoints.Checkpointer(tmp_path, read_only=True) as ckpt:
        assert ckpt.latest_step() == stopped

    monkeypatch.setattr(Batcher, "train_batch", original)
    stop_flag.clear()
    assert loop.train_and_evaluate(config, tmp_path)["steps"] == STEPS
    assert f"resumed from checkpoint step {stopped} in" in capsys.readouterr().out
    _, resumed, _ = loop.restore(tmp_path, exp=straight.exp)
    _assert_bitwise_equal(resumed.params, straight.state.params, f"preempted at {stopped}:")
    _assert_bitwise_equal(resumed.opt_state, straight.state.opt_state, f"preempted at {stopped}:")


_SAVE_AND_DIE = textwrap.dedent(
    """
    import os, signal, sys
    import jax.numpy as jnp, numpy as np
    from orbax.checkpoint._src.path import async_path
    from rag_jax.run import checkpoints

    workdir, where = sys.argv[1], sys.argv[2]
    state = lambda s: {"w": jnp.asarray(np.random.default_rng(s).normal(size=(256, 256)),
                                        jnp.float32), "step": jnp.int32(s)}
    ckpt = checkpoints.Checkpointer(workdir)
    ckpt.save(1, state(1))
    ckpt.wait()

    async def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    # "write": while the arrays are being written (their metadata goes first, through this);
    # "commit": every file written, killed at the rename that would publish the step.
    setattr(async_path, {"write": "write_text", "commit": "rename"}[where], die)
    ckpt.save(2, state(2))
    ckpt.wait()
    print("not killed")
    """
)


def _state(seed):
    """A state whose array data is incompressible, so its largest file is its array's bytes."""
    rng = np.random.default_rng(seed)
    return {"w": jnp.asarray(rng.normal(size=(256, 256)), jnp.float32), "step": jnp.int32(seed)}


def test_killed_mid_save_restarts_from_the_last_complete_step_and_says_which(tmp_path, caplog):
    script = tmp_path / "save_and_die.py"
    script.write_text(_SAVE_AND_DIE)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    procs = {
        where: subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / where), where],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for where in ("write", "commit")
    }
    for where, proc in procs.items():
        out = proc.communicate(timeout=300)[0]
        assert proc.returncode == -signal.SIGKILL, out[-3000:]
        root = tmp_path / where / "checkpoints"
        assert [p.name for p in root.iterdir() if p.name.startswith("2")][0].startswith(
            "2.orbax-checkpoint-tmp"
        )  # the half-written step, never under its final name
        with caplog.at_level("INFO"):
            state, step = checkpoints.restore_or_init(
                tmp_path / where, lambda: None, jax.eval_shape(lambda: _state(0))
            )
        assert step == 1, where
        _assert_bitwise_equal(state, _state(1), where)
        assert "Resumed from checkpoint step 1" in caplog.text
        caplog.clear()
        with checkpoints.Checkpointer(tmp_path / where) as ckpt:  # the next run saves step 2
            assert ckpt.save(2, _state(2))
        assert sorted(p.name for p in root.iterdir()) == ["1", "2"]  # the leftover is gone


def _flip_largest_array_file(step_dir):
    files = [p for p in step_dir.rglob("*") if p.is_file() and p.parent.name == "d"]
    data = max(files, key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))


def _truncate_array_files(step_dir):
    for path in step_dir.rglob("*"):
        if path.is_file() and path.parent.name == "d":
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garble_metadata(step_dir):
    (step_dir / "state" / "_METADATA").write_text("{not json")


def _delete_state(step_dir):
    shutil.rmtree(step_dir / "state")


def _delete_checksums(step_dir):
    shutil.rmtree(step_dir / "checksums")  # the arrays intact, but nothing to verify them by


# A failed read leaves orbax's other pending reads of that step unretrieved; Python reports them
# when the event loop is collected. They belong to the corrupted step, which is skipped.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(
    "damage",
    [_flip_largest_array_file, _truncate_array_files, _garble_metadata, _delete_state]
    + [_delete_checksums],
)
def test_damaged_checkpoint_falls_back_to_the_previous_step_with_a_warning(
    tmp_path, caplog, damage
):
    with checkpoints.Checkpointer(tmp_path) as ckpt:
        for step in (1, 2):
            ckpt.save(step, _state(step))
    damage(tmp_path / "checkpoints" / "2")
    abstract = jax.eval_shape(lambda: _state(0))
    with caplog.at_level("WARNING"):
        state, step = checkpoints.restore_or_init(tmp_path, lambda: None, abstract)
    assert step == 1  # never the damaged step's arrays, bitwise or otherwise
    _assert_bitwise_equal(state, _state(1))
    assert re.search(r"Checkpoint step 2 in .* is unreadable", caplog.text), caplog.text
    # The unreadable step is moved aside (not deleted), so it cannot shadow the run's new save of
    # step 2.
    assert [p.name.split("-")[0] for p in (tmp_path / "checkpoints").glob("2.*")] == [
        "2.unreadable"
    ]
    with checkpoints.Checkpointer(tmp_path) as ckpt:
        assert ckpt.all_steps() == [1]
        assert ckpt.save(2, _state(22))
    state, step = checkpoints.restore_or_init(tmp_path, lambda: None, abstract)
    assert step == 2
    _assert_bitwise_equal(state, _state(22))


def test_a_transient_read_error_stops_the_restore_and_moves_nothing(tmp_path, monkeypatch):
    """Storage failing for now (an I/O error) is not a broken step: falling back would redo the
    steps since, so the restore stops saying so, and every step stays where it is."""
    with checkpoints.Checkpointer(tmp_path) as ckpt:
        for step in (1, 2):
            ckpt.save(step, _state(step))
    restore = checkpoints.Checkpointer.restore

    def flaky(self, step, abstract_state):
        if step == 2:
            raise OSError(errno.EIO, "Input/output error", "checkpoints/2/state/d/0")
        return restore(self, step, abstract_state)

    monkeypatch.setattr(checkpoints.Checkpointer, "restore", flaky)
    abstract = jax.eval_shape(lambda: _state(0))
    with pytest.raises(RuntimeError, match=r"step 2 .* could not be read now .* nothing was moved"):
        checkpoints.restore_or_init(tmp_path, lambda: None, abstract)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1", "2"]
    state, step = checkpoints.restore_or_init(tmp_path, lambda: None, abstract)
    assert step == 2  # once the storage answers again
    _assert_bitwise_equal(state, _state(2))


@pytest.mark.slow  # the first trainer run of the module compiles: ~25 s
def test_non_finite_loss_stops_at_its_step_and_the_last_good_checkpoint_is_intact(
    tmp_path, straight, stop_flag, monkeypatch
):
    """A NaN at train step 5 of a run saving every 2 steps and logging every 100: the run stops
    at step 5 naming the metric, and step 4 (not a NaN step 6) is its newest checkpoint."""
    original = Batcher.train_batch

    def poisoned(self, state, step, retriever):
        batch = original(self, state, step, retriever)
        if step == 4:  # the batch of train step 5
            arrays = batch.arrays
            batch.arrays = dict(arrays, doc_vectors=np.full_like(arrays["doc_vectors"], np.nan))
        return batch

    monkeypatch.setattr(Batcher, "train_batch", poisoned)
    with pytest.raises(
        FloatingPointError,
        match=r"non-finite loss \(nan\) at train step 5 .* last good checkpoint, step 4,",
    ):
        loop.train_and_evaluate(tiny_config(**{"train.log_every": 100}), tmp_path)
    with checkpoints.Checkpointer(tmp_path, read_only=True) as ckpt:
        assert ckpt.all_steps() == [1, 2, 4]
    _, state, step = loop.restore(tmp_path, exp=straight.exp)
    assert step == 4
    _assert_bitwise_equal(state, straight.restore_step(straight.workdir, 4), "step 4:")


# ---------------------------------------------------------------------------------------------
# A full disk


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_small_state_files_are_replaced_whole_or_not_at_all(small_disk):
    # eval_before.json, warm-start caches and refresh snapshots are written this way.
    disk = small_disk.mount("64k")
    path = disk / "eval_before.json"
    files.write_atomic(path, b'{"em": 0.5}')
    assert path.read_bytes() == b'{"em": 0.5}'
    filler = small_disk.fill(disk)
    with pytest.raises(OSError, match=r"disk full while writing .*eval_before\.json") as raised:
        files.write_atomic(path, b'{"em": 0.75}' * 4096)
    assert raised.value.errno == errno.ENOSPC
    message = str(raised.value)
    assert "previous eval_before.json is intact" in message and "encod" not in message
    assert path.read_bytes() == b'{"em": 0.5}' and sorted(disk.iterdir()) == [filler, path]


@pytest.mark.slow  # the first trainer run of the module compiles: ~25 s
def test_disk_full_while_checkpointing_says_so_and_the_previous_step_survives(
    tmp_path, straight, stop_flag, monkeypatch
):
    from orbax.checkpoint._src.path import async_path

    write_text = async_path.write_text

    async def full_at_step_4(path, text):
        if "/4.orbax-checkpoint-tmp" in str(path):
            _disk_full()
        return await write_text(path, text)

    monkeypatch.setattr(async_path, "write_text", full_at_step_4)
    with pytest.raises(
        OSError,
        match=r"disk full while writing checkpoint step 4 .*the last complete checkpoint "
        r"\(step 2\) is intact",
    ) as raised:
        loop.train_and_evaluate(tiny_config(), tmp_path)
    assert raised.value.errno == errno.ENOSPC
    monkeypatch.setattr(async_path, "write_text", write_text)  # space freed
    _, state, step = loop.restore(tmp_path, exp=straight.exp)
    assert step == 2
    _assert_bitwise_equal(state, straight.restore_step(straight.workdir, 2), "step 2:")


def test_disk_full_on_a_real_small_filesystem_says_so(tmp_path):
    """A 700 KiB tmpfs: TensorStore's own write fails, and the error still says disk full."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=700k", "tmpfs", str(mount)], capture_output=True
    )
    if made.returncode:
        pytest.skip(reason=f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        ckpt = checkpoints.Checkpointer(mount, max_to_keep=5)
        with pytest.raises(
            OSError, match=r"disk full while writing checkpoint step 3 .*\(step 2\)"
        ):
            for step in (1, 2, 3):
                ckpt.save(step, _state(step))
                ckpt.wait()
        state, step = checkpoints.restore_or_init(
            mount, lambda: None, jax.eval_shape(lambda: _state(0))
        )
        assert step == 2
        _assert_bitwise_equal(state, _state(2))
    finally:
        subprocess.run(["umount", str(mount)], check=True)


# ---------------------------------------------------------------------------------------------
# Index, vectors and token store: damage and mismatches


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """`build_index` over a 10-passage corpus with a tiny BERT, plus a ScaNN index."""
    root = tmp_path_factory.mktemp("built")
    tokenizer_path = hf_fixtures.minilm_path()
    tokenizer = hf.load_tokenizer(tokenizer_path)
    encoder = root / "encoder"
    hf_fixtures.save_bert(encoder, vocab_size=tokenizer.vocab_size, max_position_embeddings=48)
    tokenizer.save_pretrained(encoder)
    words = "river stone bread dawn boats bell orchard harbour valley tower".split()
    corpus = root / "corpus.jsonl"
    corpus.write_text(
        "".join(
            json.dumps(
                {"id": f"p{i}", "title": w.title(), "text": f"the {w} by the {words[i - 1]}"}
            )
            + "\n"
            for i, w in enumerate(words)
        )
    )
    kwargs = dict(max_length=32, batch_size=4, shard_size=4, progress=False)
    result = build_index(corpus, encoder, tokenizer_path, root / "out", **kwargs)
    vectors = load_vectors(result["vectors"])
    provenance = {k: result[k] for k in ("encoder_fingerprint", "corpus_checksum")}
    index.ScannIndex.build(vectors, **provenance).save(str(root / "out" / "scann"))
    return types.SimpleNamespace(
        root=root, out=root / "out", corpus=corpus, encoder=encoder, tokenizer=tokenizer_path,
        kwargs=kwargs, result=result, vectors=vectors, provenance=provenance,
    )  # fmt: skip


LOADERS = {
    "passages": PassageStore.open,
    "vectors": load_vectors,
    "index": index.load,
    "scann": index.load,
}


def _artifact_files(built):
    return [
        (kind, name)
        for kind in LOADERS
        for name in sorted(p.name for p in (built.out / kind).iterdir() if p.is_file())
    ]


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_index_vectors_or_store_files_are_refused_naming_the_file(built, tmp_path, damage):
    files = _artifact_files(built)
    assert len(files) >= 14  # 8 store files, 3 shards, 3 manifests, ScaNN's files...
    for kind, name in files:
        directory = tmp_path / f"{kind}-{name}"
        shutil.copytree(built.out / kind, directory)
        path = directory / name
        raw = bytearray(path.read_bytes())
        if damage == "truncate":
            raw = raw[: len(raw) // 2]
        else:
            raw[len(raw) // 2] ^= 0x01
        path.write_bytes(bytes(raw))
        with pytest.raises((ValueError, FileNotFoundError)) as refused:
            LOADERS[kind](str(directory) if kind in ("index", "scann") else directory)
        assert str(path) in str(refused.value), (kind, name, str(refused.value))


def test_index_from_another_corpus_or_encoder_is_refused_naming_the_field(built, tmp_path):
    store = PassageStore.open(built.out / "passages")
    cfg, params = load_passage_encoder(built.encoder)
    tokenizer = hf.load_tokenizer(built.tokenizer)

    def expect(store, cfg, params):
        return {
            "corpus_checksum": store.checksum,
            "encoder_fingerprint": encoder_id.encoder_fingerprint(cfg, params),
        }

    for kind in ("index", "scann"):  # the matching corpus and encoder load
        assert index.load(str(built.out / kind), expect(store, cfg, params)).count == 10
    load_vectors(built.out / "vectors", expect(store, cfg, params))

    other_encoder = tmp_path / "other_encoder"
    hf_fixtures.save_bert(
        other_encoder, seed=1, vocab_size=tokenizer.vocab_size, max_position_embeddings=48
    )
    other_cfg, other_params = load_passage_encoder(other_encoder)
    records = [store.passage(i) for i in range(len(store))]
    records[3] = Passage(records[3].id, records[3].title, records[3].text + " changed")
    other_store = PassageStore.build(records, tokenizer, tmp_path / "s")
    for field, wrong in [
        ("encoder_fingerprint", expect(store, other_cfg, other_params)),
        ("corpus_checksum", expect(other_store, cfg, params)),
    ]:
        message = rf"field '{field}' is '[0-9a-f]{{64}}' in .* but the"
        for kind in ("index", "scann"):
            with pytest.raises(ValueError, match=message):
                index.load(str(built.out / kind), wrong)
        with pytest.raises(ValueError, match=message):
            load_vectors(built.out / "vectors", wrong)

    # Re-running the build over the same directory with another corpus is refused too.
    changed = tmp_path / "corpus.jsonl"
    changed.write_text(built.corpus.read_text().replace("the river", "a river"))
    shutil.copytree(built.out, tmp_path / "out")
    with pytest.raises(ValueError, match=r"differs: \['corpus_checksum'\]"):
        build_index(changed, built.encoder, built.tokenizer, tmp_path / "out", **built.kwargs)


def test_disk_full_while_writing_vectors_says_so_and_a_rerun_resumes(built, small_disk):
    store = PassageStore.open(built.out / "passages")
    cfg, params = load_passage_encoder(built.encoder)
    tokenizer = hf.load_tokenizer(built.tokenizer)
    disk = small_disk.mount("12k")  # three 4 KiB pages: the manifest and a shard or two fit
    out = disk / "vectors"
    with pytest.raises(OSError, match=r"disk full while writing .*vectors.*intact") as raised:
        encode.encode_corpus(store, cfg, params, tokenizer, out, **built.kwargs)
    assert raised.value.errno == errno.ENOSPC
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name]  # no half-written file
    with pytest.raises(ValueError, match="shards are finished"):
        load_vectors(out)
    small_disk.resize(disk, "1m")  # space freed
    encode.encode_corpus(store, cfg, params, tokenizer, out, **built.kwargs)
    for name in ("vectors-00000.npy", "vectors-00001.npy", "vectors-00002.npy"):
        assert (out / name).read_bytes() == (built.out / "vectors" / name).read_bytes(), name


def test_disk_full_while_saving_an_index_says_so_and_keeps_what_was_there(built, small_disk):
    disk = small_disk.mount("64k")
    target = disk / "index"
    shutil.copytree(built.out / "index", target)
    before = index.load(str(target))
    small_disk.fill(disk, leave=4096)
    bigger = np.concatenate([built.vectors] * 40)  # 400 rows: more than the space left
    with pytest.raises(OSError, match=r"disk full while writing the index .*previous index") as e:
        index.ExactIndex(bigger, **built.provenance).save(str(target))
    assert e.value.errno == errno.ENOSPC and "requested" not in str(e.value)
    after = index.load(str(target), {"corpus_checksum": built.provenance["corpus_checksum"]})
    np.testing.assert_array_equal(after.vectors, before.vectors)
    assert sorted(p.name for p in disk.iterdir()) == [".filler", "index"]  # nothing left over


def test_disk_full_while_building_a_store_says_so_and_leaves_nothing(built, small_disk):
    store = PassageStore.open(built.out / "passages")
    records = [store.passage(i) for i in range(len(store))] * 30  # ids repeat: never reached
    records = [Passage(f"{i}", p.title, p.text) for i, p in enumerate(records)]
    disk = small_disk.mount("16k")
    with pytest.raises(OSError, match=r"disk full while writing the passage store") as raised:
        PassageStore.build(records, hf.load_tokenizer(built.tokenizer), disk / "store")
    assert raised.value.errno == errno.ENOSPC
    assert "partial files were removed" in str(raised.value)
    assert not any((disk / "store").iterdir())  # the disk is free again


def test_a_store_build_killed_before_its_manifest_is_rebuilt(built, tmp_path):
    store = PassageStore.open(built.out / "passages")
    records = [store.passage(i) for i in range(len(store))]
    partial = tmp_path / "store"
    shutil.copytree(built.out / "passages", partial)
    (partial / "manifest.json").unlink()  # killed after the columns, before the manifest
    (partial / "texts.bin").write_bytes(b"half")
    rebuilt = PassageStore.build(records, hf.load_tokenizer(built.tokenizer), partial)
    assert rebuilt.checksum == store.checksum
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not a store file")
    with pytest.raises(ValueError, match="not empty"):
        PassageStore.build(records, hf.load_tokenizer(built.tokenizer), tmp_path / "mine")


# ---------------------------------------------------------------------------------------------
# Config errors at start-up


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        ({"train.save_evry": 10}, ValueError, r"config\.train\.save_evry is not a setting .* did "
         r"you mean config\.train\.save_every\?"),
        ({"trian": {}}, ValueError, r"config\.trian is not a setting .* config\.train\?"),
        ({"train.batch_size": 6}, ValueError, r"config\.train\.batch_size: global batch 6 is not "
         r"divisible by 8 devices; use 8"),
        ({"eval.enabled": True, "eval.batch_size": 12}, ValueError, r"config\.eval\.batch_size: "
         r"eval batch 12 is not divisible by 8 devices; use 8 or 16"),
        ({"data.source": "files", "data.train_path": "/no/such/train.jsonl"}, FileNotFoundError,
         r"config\.data\.train_path='/no/such/train\.jsonl': no such file"),
        ({"data.source": "files"}, ValueError, r"config\.data\.train_path is not set"),
        ({"model.init": "pretrained", "model.question_encoder_path": "/no/such/bert"},
         FileNotFoundError, r"config\.model\.question_encoder_path='/no/such/bert' is not a "
         r"checkpoint directory .* set it to a directory holding config\.json"),
        ({"model.init": "hf_rag"}, ValueError, r"config\.model\.rag_path is not set; "
         r"model\.init='hf_rag' needs it"),
        ({"retrieval.index_dir": "/no/such/index"}, FileNotFoundError,
         r"config\.retrieval\.index_dir='/no/such/index': no such directory"),
        ({"rag.doc_score_scale": 0.0}, ValueError,
         r"config\.rag\.doc_score_scale must be a positive number, got 0\.0"),
        ({"model.generator_frozen_encoder_layers": 2}, ValueError,
         r"generator_frozen_encoder_layers=2 stops the gradient .* freeze generator/encoder/ "
         r"\(embed_tokens, positions, ln_embedding and layer_0 to layer_1\)"),
        ({"warm_start.reader_data": "files"}, ValueError,
         r"config\.warm_start\.reader_questions_path is not set"),
        ({"model.pooling": "max"}, ValueError,
         r"config\.model\.pooling must be one of cls \| mean"),
        ({"warm_start.reader_task": "spans"}, ValueError,
         r"config\.warm_start\.reader_task must be one of qa \| ssm \| qa\+ssm"),
        ({"data.source": "files", "data.train_path": __file__, "data.corpus_path":
          f"{__file__},/no/such/dev.jsonl"}, FileNotFoundError,
         r"config\.data\.corpus_path='/no/such/dev\.jsonl': no such file"),
    ],
)  # fmt: skip
def test_config_errors_fail_at_start_up_naming_the_key_and_the_fix(overrides, error, message):
    config = tiny_config()
    with config.unlocked():
        settings.override(config, overrides)
    with pytest.raises(error, match=message):
        validation.validate(config, 8)


def test_config_defaults_and_the_tiny_config_pass_validation():
    validation.validate(default_config.get_config(), 8)
    validation.validate(tiny_config(), 1)


def test_n_docs_larger_than_the_corpus_fails_before_training(tmp_path, compilation_cache):
    with pytest.raises(ValueError, match=r"config\.rag\.n_docs=999 exceeds the corpus size "
                       r"\d+; use at most \d+"):  # fmt: skip
        loop.train_and_evaluate(
            tiny_config(**{"rag.n_docs": 999, "warm_start.method": "none"}), tmp_path
        )
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_n_docs_larger_than_the_corpus_fails_before_any_warm_start(tmp_path, capsys):
    """Both warm starts on: the corpus size is known once the store is built, before either."""
    config = tiny_config(**{"rag.n_docs": 999, "warm_start.steps": 50})
    with pytest.raises(ValueError, match=r"n_docs=999 exceeds the corpus size"):
        loop.train_and_evaluate(config, tmp_path)
    assert "warm start" not in capsys.readouterr().out
    assert not (tmp_path / "warm_start").exists()


@pytest.mark.parametrize(
    "key, value",
    [
        ("train.batch_size", -8),
        ("train.batch_size", 0),
        ("eval.batch_size", -4),
        ("rag.n_docs", 0),
        ("train.steps", -1),
        ("train.steps", 0),
    ],
)
def test_negative_or_zero_sizes_get_their_own_message(tmp_path, key, value):
    message = rf"^config\.{key} must be a positive integer, got {value}$"
    with pytest.raises(ValueError, match=message):
        validation.validate(tiny_config(**{key: value}), num_devices=1)


def test_sigterm_during_a_warm_start_saves_its_progress_and_the_rerun_resumes_it(
    tmp_path, stop_flag, monkeypatch, capsys
):
    """The handler is installed before anything is built: a SIGTERM during the ICT warm start
    (here at its step 4 of 12) ends the run with a message, its progress saved, and the next run
    resumes the warm start there, ending where an uninterrupted warm start ends, bit for bit."""
    config = tiny_config(
        **{"warm_start.steps": 12, "warm_start.batch_size": 8, "warm_start.reader_steps": 0}
    )
    original = ict.ict_batch

    def sigterm_at(data, *, step, **kwargs):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # the real signal, through the real handler
        return original(data, step=step, **kwargs)

    monkeypatch.setattr(ict, "ict_batch", sigterm_at)
    summary = loop.train_and_evaluate(config, tmp_path / "stopped")
    out = capsys.readouterr().out
    assert summary["steps"] == 0 and "ICT warm start at step 4 of 12" in summary["preempted"]
    assert "preempted before training: stopped during the ICT warm start at step 4" in out
    partial = list((tmp_path / "stopped" / "warm_start").glob("*.partial.msgpack"))
    assert len(partial) == 1 and str(partial[0]) in summary["preempted"]

    monkeypatch.setattr(ict, "ict_batch", original)
    stop_flag.clear()
    resumed = experiment.build(config, tmp_path / "stopped", retriever=False)
    assert "ICT warm start: resuming at step 4" in capsys.readouterr().out
    assert not partial[0].exists()  # done: only the finished warm start is kept
    straight = experiment.build(config, tmp_path / "straight", retriever=False)
    for name in ("question_encoder", "passage_encoder"):
        _assert_bitwise_equal(resumed.params[name], straight.params[name], name)


def test_a_warm_start_killed_without_a_signal_resumes_from_its_last_periodic_save(
    tmp_path, monkeypatch, capsys
):
    """No handler runs when a process is SIGKILLed or its machine is lost: the warm start's
    progress is also saved every `PROGRESS_SAVE_EVERY_S` (here: before every step), so a run that
    dies at step 6 of 12 without a signal resumes at 6 and ends bit for bit where an
    uninterrupted one ends."""
    config = tiny_config(
        **{"warm_start.steps": 12, "warm_start.batch_size": 8, "warm_start.reader_steps": 0}
    )
    monkeypatch.setattr(checkpoints, "PROGRESS_SAVE_EVERY_S", 0.0)
    original = ict.ict_batch

    class Killed(BaseException):  # nothing in the loop catches it, as nothing survives SIGKILL
        pass

    def killed_at(data, *, step, **kwargs):
        if step == 6:
            raise Killed
        return original(data, step=step, **kwargs)

    monkeypatch.setattr(ict, "ict_batch", killed_at)
    with pytest.raises(Killed):
        experiment.build(config, tmp_path / "killed", retriever=False)
    partial = list((tmp_path / "killed" / "warm_start").glob("*.partial.msgpack"))
    assert len(partial) == 1

    monkeypatch.setattr(ict, "ict_batch", original)
    monkeypatch.setattr(checkpoints, "PROGRESS_SAVE_EVERY_S", 600.0)
    capsys.readouterr()
    resumed = experiment.build(config, tmp_path / "killed", retriever=False)
    assert "ICT warm start: resuming at step 6" in capsys.readouterr().out
    assert not partial[0].exists()
    straight = experiment.build(config, tmp_path / "straight", retriever=False)
    for name in ("question_encoder", "passage_encoder"):
        _assert_bitwise_equal(resumed.params[name], straight.params[name], name)


def test_sigterm_in_the_training_loop_saves_the_step_it_finished(tmp_path, stop_flag, monkeypatch):
    """The trainer's own SIGTERM path, short: the step in flight finishes and is saved, the
    process returns normally, and the next start resumes there and finishes the run."""
    config = tiny_config(
        **{"train.steps": 3, "warm_start.method": "none", "warm_start.reader_steps": 0}
    )
    original = Batcher.train_batch

    def sigterm_at(self, state, step, retriever):
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, state, step, retriever)

    monkeypatch.setattr(Batcher, "train_batch", sigterm_at)
    summary = loop.train_and_evaluate(config, tmp_path)
    # Saved and returned at once: the evaluation is the resumed run's (a preempted host has
    # seconds, and a half-trained model's metrics would pass for the run's).
    assert summary == {"preempted": "saved step 2 of 3", "steps": 2}, summary
    assert not (tmp_path / "predictions.jsonl").exists()
    with checkpoints.Checkpointer(tmp_path, read_only=True) as ckpt:
        assert ckpt.latest_step() == 2
    monkeypatch.setattr(Batcher, "train_batch", original)
    stop_flag.clear()
    assert loop.train_and_evaluate(config, tmp_path)["steps"] == 3


def test_a_mistyped_command_line_override_fails_naming_it(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",  # which modules it imported before refusing: not JAX (20-60 s cold)
            str(ROOT / "experiments" / "train.py"),
            f"--config={ROOT / 'experiments' / 'configs' / 'default.py'}",
            f"--workdir={tmp_path}",
            "--config.train.save_evry=3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 2
    imported = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")]  # fmt: skip
    assert imported and not [m for m in imported if m.split(".")[0] in ("jax", "flax", "torch")]
    # One line naming the key and the closest settings, not a chain of tracebacks.
    assert [line for line in result.stderr.splitlines() if not line.startswith("import time:")] == [
        "error: config.train.save_evry is not a setting rag_jax reads; did you mean "
        "config.train.save_every?"
    ]
    assert not (tmp_path / "checkpoints").exists()  # refused before anything ran
    listing = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "train.py"), "--help"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert "--config.train.retriever_loss='marginal'" in listing.stdout


# ---------------------------------------------------------------------------------------------
# The soak: repeated kills at random moments, saves included


def _train_cmd(workdir, steps):
    return [
        sys.executable,
        str(ROOT / "experiments" / "train.py"),
        f"--config={ROOT / 'experiments' / 'configs' / 'default.py'}",
        f"--workdir={workdir}",
        *(f"--config.{key}={value}" for key, value in TINY.items() if key != "train.steps"),
        f"--config.train.steps={steps}",
        "--config.train.save_every=3",
        "--config.train.keep_checkpoints=2",
    ]


@pytest.mark.slow
def test_soak_of_kills_at_random_moments_ends_bitwise_equal(tmp_path):
    """Six SIGKILLs (three timed to land on a checkpoint write) and one SIGTERM, at random
    moments of a 150-step run; the run that finishes equals an uninterrupted one bit for bit."""
    steps = 150
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    straight = subprocess.run(
        _train_cmd(tmp_path / "straight", steps), capture_output=True, text=True, env=env
    )
    assert straight.returncode == 0, straight.stderr[-3000:]

    rng = np.random.default_rng()
    workdir = tmp_path / "killed"
    ckpt_dir = workdir / "checkpoints"
    plan = ["save", "random", "save", "random", "term", "save", "random"]
    log, during_save = [], 0

    def on_disk():
        return sorted(int(p.name) for p in ckpt_dir.glob("*") if p.name.isdigit())

    for action in plan:
        proc = subprocess.Popen(
            _train_cmd(workdir, steps),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        progress = [0]

        def follow(proc=proc, progress=progress):
            for line in proc.stderr:  # tqdm's "\r" updates arrive as lines (universal newlines)
                found = re.findall(rf"(\d+)/{steps} \[", line)
                progress[0] = int(found[-1]) if found else progress[0]

        threading.Thread(target=follow, daemon=True).start()
        # A random step a little past where this start resumes, then a random moment in it.
        target = (on_disk() or [0])[-1] + int(rng.integers(1, 12))
        deadline = time.monotonic() + 600
        while proc.poll() is None and progress[0] < target and time.monotonic() < deadline:
            time.sleep(0.01)
        if action == "save":  # kill while a step is being written (its temporary dir exists)
            while proc.poll() is None and time.monotonic() < deadline:
                if any(".orbax-checkpoint-tmp" in p.name for p in ckpt_dir.glob("*")):
                    break
                time.sleep(0.001)
        else:
            time.sleep(rng.uniform(0, 0.5))
        if proc.poll() is not None:
            log.append(f"{action}: finished before the kill")
            break
        reached = progress[0]  # steps finished when the signal is sent (tqdm lags, if at all)
        proc.send_signal(signal.SIGTERM if action == "term" else signal.SIGKILL)
        proc.wait(timeout=300)
        writing = any(".orbax-checkpoint-tmp" in p.name for p in ckpt_dir.glob("*"))
        during_save += action == "save" and writing
        log.append(f"{action} at step ~{reached}: {on_disk()}")
        # What a crash may lose: the steps since the last completed save, fewer than two save
        # intervals (the save being written plus the steps after it); a SIGTERM loses none.
        newest = (on_disk() or [0])[-1]
        assert newest >= (reached if action == "term" else reached - 2 * 3), log
    kills = sum(not line.endswith("kill") for line in log)
    assert kills >= 5 and during_save >= 1, log
    final = subprocess.run(_train_cmd(workdir, steps), capture_output=True, text=True, env=env)
    assert final.returncode == 0, final.stderr[-3000:]
    assert "resumed from checkpoint step" in final.stdout, (final.stdout, log)

    _, a, step_a = loop.restore(tmp_path / "straight")
    _, b, step_b = loop.restore(workdir)
    assert step_a == step_b == steps
    _assert_bitwise_equal(b, a, f"after {log}:")
