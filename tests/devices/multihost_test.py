"""Multi-host runs with two local processes standing in for two hosts.

Each worker is this file run as a script
(`python tests/devices/multihost_test.py JOB PROCESS_ID PORT ARGS_JSON`): it joins a
`jax.distributed` run on 127.0.0.1 with 4 fake CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=4`, `JAX_PLATFORMS=cpu`; collectives across
the processes go through gloo, JAX's default on CPU), does one job, and writes what it computed
into the test's directory. The test itself runs in one process with the 8 fake devices of
conftest.py and compares the two processes' results with single-process references: the same
8 devices, split 4 + 4 over two processes, must give the same answers.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments.configs import default as default_config
from rag_jax import rag
from rag_jax.devices import distributed, sharding
from rag_jax.model_inputs import question_tokens
from rag_jax.retrieval import index
from rag_jax.retrieval.device_index import DeviceIndex
from rag_jax.run import checkpoints, data
from rag_jax.training import loop

ROOT = pathlib.Path(__file__).resolve().parents[2]

NUM_PROCESSES = 2
DEVICES_PER_PROCESS = 4
NUM_DEVICES = NUM_PROCESSES * DEVICES_PER_PROCESS


# ---------------------------------------------------------------------------------------------
# Launching workers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(job: str, out: pathlib.Path, timeout: float = 300, **kwargs) -> None:
    """Runs `job` in two processes of one distributed run; fails with their logs if one fails.

    A worker that dies leaves the other waiting in a collective, so the survivors are killed as
    soon as one exits with an error.
    """
    out.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}",
        # A worker runs this file as a script: it imports the configs as the tests do.
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    port, args = str(_free_port()), json.dumps({"out": str(out), **kwargs})
    logs = [out / f"{job}{i}.log" for i in range(NUM_PROCESSES)]
    procs = []
    for i, log in enumerate(logs):
        with open(log, "w") as f:
            cmd = [sys.executable, __file__, job, str(i), port, args]
            procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.poll() for p in procs):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    failures = [
        f"worker {i} exited with {p.returncode}; last lines of {logs[i]}:\n"
        + "\n".join(logs[i].read_text().splitlines()[-25:])
        for i, p in enumerate(procs)
        if p.returncode != 0
    ]
    if failures:
        pytest.fail("\n\n".join(failures))


def _main(argv: list[str]) -> None:
    """A worker: joins the distributed run, then runs `JOBS[job]`."""
    job, process_id, port, args = argv[1], int(argv[2]), argv[3], json.loads(argv[4])
    distributed.maybe_initialize_distributed(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=NUM_PROCESSES,
        process_id=process_id,
    )
    assert jax.process_index() == process_id, (jax.process_index(), process_id)
    assert (jax.device_count(), jax.local_device_count()) == (NUM_DEVICES, DEVICES_PER_PROCESS)
    out = pathlib.Path(args.pop("out"))
    JOBS[job](out, **args)


# ---------------------------------------------------------------------------------------------
# Batches, host helpers and the pod-sharded index


C, D, B, K = 37, 6, 16, 5  # corpus size (not a multiple of 8), width, query batch, neighbours


def _corpus():
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(C, D)).astype(np.float32)
    vectors[29] = vectors[3]  # a tie across shards: the lower id must come first
    queries = rng.normal(size=(B, D)).astype(np.float32)
    queries[0] = vectors[3]
    return vectors, queries


def _collectives_job(out: pathlib.Path) -> None:
    p = jax.process_index()
    mesh = sharding.data_mesh()
    block, blocks = distributed.process_block(mesh)
    local = np.arange(8 * 3, dtype=np.int32).reshape(8, 3) + 1000 * block  # -> [B / 2, 3]
    batch = distributed.shard_batch(mesh, {"x": local})
    x = batch["x"]
    assert not x.is_fully_addressable and x.shape == (16, 3), x.shape
    results = {
        "block": np.array([block, blocks]),
        "local_rows": distributed.local_rows(x),
        "gathered": distributed.gather_to_host(x),
        "column_sums": np.asarray(jax.jit(lambda a: a.sum(axis=0))(x)),
        "process_sum": np.array(distributed.sum_over_processes({"m": (p + 1.0, 2)})["m"]),
        "from_process0": np.array(distributed.from_process0(p == 0)),
    }

    vectors, queries = _corpus()
    ix = DeviceIndex(vectors, mesh)
    assert not ix.vectors.is_fully_addressable
    padded = np.concatenate([vectors, np.zeros((40 - C, D), np.float32)])
    for shard in ix.vectors.addressable_shards:  # each process placed only its own rows
        assert shard.device.process_index == p
        np.testing.assert_array_equal(np.asarray(shard.data), padded[shard.index])
    results["numpy_scores"], results["numpy_ids"] = ix.search(queries, K)
    # In-graph: every process feeds its block of the question batch; one collective program.
    rows = slice(block * B // blocks, (block + 1) * B // blocks)
    q = distributed.shard_batch(mesh, queries[rows])
    scores, ids = jax.jit(lambda ix, q: ix.search(q, K))(ix, q)
    results["graph_scores"], results["graph_ids"] = distributed.gather_to_host((scores, ids))
    results["own_ids"] = distributed.own_rows(ids, mesh)  # replicated result: this block's rows
    try:
        ix.search(queries + p, K)  # different queries on each process
    except AssertionError as e:
        results["mismatch_error"] = np.array(str(e)[:200])
    ix.save(str(out / "index"))  # collective gather; process 0 writes
    np.savez(out / f"collectives{p}.npz", **results)


@pytest.fixture(scope="module")
def collectives(tmp_path_factory):
    out = tmp_path_factory.mktemp("collectives")
    _run_workers("collectives", out)
    return out, [dict(np.load(out / f"collectives{p}.npz")) for p in range(NUM_PROCESSES)]


def test_batches_split_by_process_and_host_helpers(collectives):
    _, results = collectives
    whole = np.concatenate([np.arange(24).reshape(8, 3) + 1000 * b for b in range(2)])
    for p, r in enumerate(results):
        np.testing.assert_array_equal(r["block"], [p, 2])  # devices are numbered host by host
        np.testing.assert_array_equal(r["local_rows"], whole[8 * p : 8 * p + 8])
        np.testing.assert_array_equal(r["gathered"], whole)
        np.testing.assert_array_equal(r["column_sums"], whole.sum(axis=0))
        np.testing.assert_array_equal(r["process_sum"], [3.0, 4])
        assert r["from_process0"].item() is True


def test_device_index_across_two_processes_matches_exact(collectives):
    out, results = collectives
    vectors, queries = _corpus()
    want_scores, want_ids = index.ExactIndex(vectors).search(queries, K)
    assert want_ids[0, 0] == 3 and want_ids[0, 1] == 29  # the tie, lower id first
    for r in results:
        for path in ("numpy", "graph"):
            np.testing.assert_array_equal(r[f"{path}_ids"], want_ids, err_msg=path)
            np.testing.assert_allclose(r[f"{path}_scores"], want_scores, rtol=1e-5, atol=1e-5)
        assert "same queries on every process" in str(r["mismatch_error"])
    for p, r in enumerate(results):
        np.testing.assert_array_equal(r["own_ids"], want_ids[p * B // 2 : (p + 1) * B // 2])
    saved = index.ExactIndex.load(str(out / "index"))  # written by process 0 from all shards
    np.testing.assert_array_equal(saved.vectors, vectors)


# ---------------------------------------------------------------------------------------------
# Checkpoints between one and two processes


def _state(mesh, seed: int) -> dict:
    """A data-sharded table (each device holds rows of its own), a replicated bias and a step."""
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(16, 3)).astype(np.float32)
    sharded, replicated = NamedSharding(mesh, P(sharding.DATA_AXIS)), sharding.replicated(mesh)
    return {
        "table": jax.make_array_from_callback(table.shape, sharded, lambda i: table[i]),
        "bias": jax.device_put(rng.normal(size=(3,)).astype(np.float32), replicated),
        "step": jax.device_put(np.int32(seed), replicated),
    }


def _abstract(mesh) -> dict:
    sharded, replicated = NamedSharding(mesh, P(sharding.DATA_AXIS)), sharding.replicated(mesh)
    return {
        "table": jax.ShapeDtypeStruct((16, 3), np.float32, sharding=sharded),
        "bias": jax.ShapeDtypeStruct((3,), np.float32, sharding=replicated),
        "step": jax.ShapeDtypeStruct((), np.int32, sharding=replicated),
    }


def _checkpoint_job(out: pathlib.Path, one_process_dir: str) -> None:
    mesh = sharding.data_mesh()
    with checkpoints.Checkpointer(out / "two") as ckpt:
        ckpt.save(2, _state(mesh, seed=2), {"written_by": "two processes"})
    restored, step = checkpoints.restore_or_init(one_process_dir, lambda: None, _abstract(mesh))
    assert step == 1 and not restored["table"].is_fully_addressable
    np.savez(out / f"restored{jax.process_index()}.npz", **distributed.gather_to_host(restored))


def test_checkpoint_moves_between_one_and_two_processes(tmp_path):
    if jax.device_count() != NUM_DEVICES:
        pytest.skip(reason=f"needs {NUM_DEVICES} devices (see conftest.py)")
    mesh = sharding.data_mesh()
    with checkpoints.Checkpointer(tmp_path / "one") as ckpt:
        ckpt.save(1, _state(mesh, seed=1))
    _run_workers("checkpoint", tmp_path, one_process_dir=str(tmp_path / "one"))

    want = jax.tree.map(np.asarray, _state(mesh, seed=1))
    for p in range(NUM_PROCESSES):  # the one-process checkpoint, restored over two processes
        got = dict(np.load(tmp_path / f"restored{p}.npz"))
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"process {p}: {name}")
    # The two-process checkpoint, restored in one process onto the same 8 devices.
    restored, step = checkpoints.restore_or_init(tmp_path / "two", lambda: None, _abstract(mesh))
    assert step == 2
    assert checkpoints.load_config(tmp_path / "two").written_by == "two processes"
    for name, value in jax.tree.map(np.asarray, _state(mesh, seed=2)).items():
        np.testing.assert_array_equal(np.asarray(restored[name]), value, err_msg=name)
        target = _abstract(mesh)[name].sharding
        assert restored[name].sharding.is_equivalent_to(target, restored[name].ndim), name


# ---------------------------------------------------------------------------------------------
# Training: two processes of 4 devices against one process of 8


def _tiny_config(**overrides):
    """A few SGD steps on a small synthetic world, evaluation over a partial last batch."""
    config = default_config.get_config()
    settings = {
        "data.num_entities": 12,
        "warm_start.steps": 2,
        "warm_start.reader_steps": 2,
        "warm_start.reader_entities": 4,
        "warm_start.batch_size": 16,
        "train.steps": 3,
        "train.batch_size": 16,  # 2 rows per device
        "train.log_every": 3,
        "train.save_every": 3,
        "train.warmup_steps": 1,
        # SGD: Adam's first steps divide each gradient by its own magnitude, so a near-zero entry
        # whose last bits differ between reduction orders could flip the sign of its update.
        "train.optimizer": "sgd",
        "train.learning_rate": 0.1,
        "eval.batch_size": 8,
        "eval.max_examples": 11,  # two batches, the second padded with 5 masked rows
        "eval.max_length": 4,
        "rag.n_docs": 5,
        "rag.max_combined_length": 32,
        "retrieval.passage_max_length": 32,
        **overrides,
    }
    return settings.override(config, settings)


def _train_job(out: pathlib.Path, one_process_dir: str, overrides: dict) -> None:
    p = jax.process_index()
    config = _tiny_config(**overrides)
    config.train.checkpoint_dir = str(out / "ckpt")  # shared by both; the workdirs are not
    # The one-process run's warm starts: the same starting point, so that what is compared is the
    # training. (Warm starts computed on 4 devices per process and on 8 differ in the last bits.)
    config.warm_start.cache_dir = one_process_dir
    summary = loop.train_and_evaluate(config, out / f"work{p}")
    (out / f"summary{p}.json").write_text(json.dumps(summary))
    # The one-process run's checkpoint, restored over both processes.
    _, state, step = loop.restore(one_process_dir)
    assert step == 3
    np.savez(out / f"restored{p}.npz", **_flat(distributed.gather_to_host(state.params)))


def _flat(tree) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {jax.tree_util.keystr(path): np.asarray(v) for path, v in leaves}


def _two_runs(tmp_path_factory, **overrides):
    """(one-process workdir, two-process directory) after 3 steps each."""
    one = tmp_path_factory.mktemp("one_process")
    loop.train_and_evaluate(_tiny_config(**overrides), one)
    two = tmp_path_factory.mktemp("two_processes")
    _run_workers("train", two, timeout=900, one_process_dir=str(one), overrides=overrides)
    return one, two


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    return _two_runs(tmp_path_factory)


@pytest.fixture(scope="module")
def two_runs_pod_index(tmp_path_factory):
    """As `two_runs`, with the corpus sharded over all 8 devices and searched in the step."""
    return _two_runs(tmp_path_factory, **{"retrieval.index": "device"})


def _assert_trained_alike(one, two):
    """The two-process run ends where the one-process run does, and checkpoints move both ways.

    Returns (experiment, the two-process TrainState).
    """
    exp, state_one, step = loop.restore(one)
    assert step == 3
    want = _flat(state_one.params)
    # The two-process checkpoint restores in one process: the same parameters within 1e-5.
    config_two = checkpoints.load_config(two / "ckpt")
    _, state_two, step = loop.restore(two / "work0", config=config_two, exp=exp)
    assert step == 3
    got = _flat(state_two.params)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=1e-5, rtol=0, err_msg=name)
    initial = _flat(exp.params)
    moved = sum(not np.allclose(initial[k], want[k], atol=1e-4) for k in initial)
    assert moved > 10  # the steps moved parameters by far more than the tolerance
    # The one-process checkpoint restores over two processes, bit for bit.
    for p in range(NUM_PROCESSES):
        restored = dict(np.load(two / f"restored{p}.npz"))
        for name in want:
            np.testing.assert_array_equal(restored[name], want[name], err_msg=f"{p}: {name}")
    return exp, state_two


def _assert_top_by_score(exp, params, questions, retrieved, what):
    """Each row of `retrieved` (passage rows) holds the best-scoring passages under `params`.

    The processes encode their corpus replicas on their own devices, so their vectors differ from
    one process's in the last bits and near-tied passages may trade places: compare scores, not
    the order of ties.
    """
    tokens = question_tokens(exp.question_tokenizer, questions, exp.config.data.question_length)
    q = rag.question_embeddings(
        exp.rag_cfg, params, tokens["question_input_ids"], tokens["question_attention_mask"]
    )  # -> [E, D]
    scores = np.asarray(q) @ exp.retriever.vectors.T  # -> [E, C]
    for e, rows in enumerate(retrieved):
        got = scores[e, rows]
        top = np.sort(scores[e])[::-1][: len(got)]
        np.testing.assert_allclose(got, top, atol=1e-4, rtol=0, err_msg=f"{what} {e}")


@pytest.mark.slow
def test_two_processes_train_like_one_and_checkpoints_move_between_them(two_runs):
    _assert_trained_alike(*two_runs)


@pytest.mark.slow
def test_two_process_logs_and_evaluation_come_from_process_zero(two_runs):
    one, two = two_runs
    summaries = [json.loads((two / f"summary{p}.json").read_text()) for p in range(2)]
    assert summaries[0] == summaries[1]  # every process scored the gathered predictions
    assert json.loads((two / "work0" / "eval_before.json").read_text()) == json.loads(
        (one / "eval_before.json").read_text()
    )
    lines = (two / "work0" / "predictions.jsonl").read_text().splitlines()
    predictions = [json.loads(line) for line in lines]
    want = [json.loads(line) for line in (one / "predictions.jsonl").read_text().splitlines()]
    # Each of the 11 examples exactly once and in order, the padded last batch's included.
    assert [p["id"] for p in predictions] == [p["id"] for p in want] and len(want) == 11
    # The passages each host retrieved (from its own replica of the index) are the top 5.
    config_two = checkpoints.load_config(two / "ckpt")
    exp, _, _ = loop.restore(one)
    _, state_two, _ = loop.restore(two / "work0", config=config_two, exp=exp)
    examples = exp.eval[: config_two.eval.max_examples or None]
    row = {pid: i for i, pid in enumerate(exp.store.ids)}
    retrieved = [[row[pid] for pid in p["retrieved"]] for p in predictions]
    questions = [e.question for e in examples]
    _assert_top_by_score(exp, state_two.params, questions, retrieved, "eval example")
    logged = [
        json.loads(line) for line in (two / "work0" / "metrics.jsonl").read_text().splitlines()
    ]
    assert any("train/loss" in r for r in logged) and any("eval/exact_match" in r for r in logged)
    for name in ("metrics.jsonl", "tensorboard", "predictions.jsonl", "eval_before.json"):
        assert not (two / "work1" / name).exists(), name  # process 1 writes no logs


@pytest.mark.slow
def test_two_processes_search_a_pod_sharded_index_inside_the_step(two_runs_pod_index):
    """The corpus split over the 8 devices of both processes, searched inside the train step by
    both together: the same training as one process, and the right passages found."""
    one, two = two_runs_pod_index
    summaries = [json.loads((two / f"summary{p}.json").read_text()) for p in range(2)]
    assert all(s["search_in_step"] for s in summaries), summaries
    assert summaries[0] == summaries[1]
    exp, state_two = _assert_trained_alike(one, two)
    assert isinstance(exp.retriever.index, DeviceIndex)
    # The ids the last step searched for batch 3 are its questions' top 5 under the new params.
    c = exp.config
    rows = data.batch_indices(len(exp.train), c.train.batch_size, c.seed, 3)
    questions = [exp.train[i].question for i in rows]
    next_ids = np.asarray(state_two.next_doc_ids)
    _assert_top_by_score(exp, state_two.params, questions, next_ids, "batch 3 row")
    # Evaluation searched the pod-sharded index with the global batch: the top 5 as well.
    lines = (two / "work0" / "predictions.jsonl").read_text().splitlines()
    row = {pid: i for i, pid in enumerate(exp.store.ids)}
    retrieved = [[row[pid] for pid in json.loads(line)["retrieved"]] for line in lines]
    examples = exp.eval[: c.eval.max_examples or None]
    assert len(retrieved) == len(examples) == 11
    questions = [e.question for e in examples]
    _assert_top_by_score(exp, state_two.params, questions, retrieved, "eval example")


JOBS = {"collectives": _collectives_job, "checkpoint": _checkpoint_job, "train": _train_job}

if __name__ == "__main__":
    _main(sys.argv)
