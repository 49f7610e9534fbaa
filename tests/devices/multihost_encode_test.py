"""Corpus encoding by two local processes standing in for two hosts (`encode_corpus` under
`jax.distributed`), against one-process runs.

Each worker is this file run as a script (`python tests/devices/multihost_encode_test.py
PROCESS_ID PORT ARGS_JSON`) with 4 fake CPU devices, as in multihost_test.py: it joins a run on
127.0.0.1, encodes its share of the corpus into a shared directory, and writes which passages it
read. The reference is one process encoding on a mesh of 4 of conftest.py's 8 fake devices: the
same per-device batch as each worker's, hence the same program and the same bytes. Against 8
devices (half the rows per device) the float rounding may differ, so that comparison is at the
float32 tolerance.
"""

import hashlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

NUM_PROCESSES, DEVICES_PER_PROCESS = 2, 4
COUNT, SHARD = 45, 6  # 8 shards, the last of 3 rows
KWARGS = dict(max_length=40, batch_size=4, buckets=(16, 32, 40), shard_size=SHARD, sort_window=4)
WORDS = "a river flows past old towns where bakers sell bread and bells ring at dawn".split()
ROOT = pathlib.Path(__file__).resolve().parents[2]


class Store:
    """The store protocol of `encode_corpus`; logs each row read, SIGKILLs itself at `kill_at`."""

    def __init__(self, passages, log: pathlib.Path | None = None, kill_at: int | None = None):
        self.passages, self.log, self.kill_at = passages, log, kill_at
        self.checksum = hashlib.sha256(json.dumps(passages).encode()).hexdigest()
        self.reads: list[int] = []

    def __len__(self):
        return len(self.passages)

    def title(self, i):
        return self.passages[i][0]

    def text(self, i):
        if i == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no exception: as a lost host
        self.reads.append(i)
        if self.log is not None:
            with open(self.log, "a") as f:  # read back even after a kill
                f.write(f"{i}\n")
        return self.passages[i][1]


def _passages() -> list[tuple[str, str]]:
    rng = np.random.default_rng(12)
    return [
        (" ".join(rng.choice(WORDS, 2)).title(), " ".join(rng.choice(WORDS, rng.integers(3, 40))))
        for _ in range(COUNT)
    ]


def _rows(shards) -> list[int]:
    return [r for s in sorted(shards) for r in range(SHARD * s, min(COUNT, SHARD * (s + 1)))]


def _files(directory: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


# ---------------------------------------------------------------------------------------------
# Workers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(out: pathlib.Path, model: pathlib.Path, tag: str, kill_at=(None, None), timeout=240):
    """Runs both workers; returns their exit codes. Once one exits with an error the other,
    left waiting at a barrier, is killed (a lost host ends the job)."""
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    port = str(_free_port())
    procs = []
    for p in range(NUM_PROCESSES):
        args = json.dumps({"out": str(out), "model": str(model), "tag": tag, "kill": kill_at[p]})
        with open(out / f"{tag}{p}.log", "w") as log:
            cmd = [sys.executable, __file__, str(p), port, args]
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() for p in procs):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return [p.returncode for p in procs]


def _logs(out: pathlib.Path, tag: str) -> str:
    return "\n".join(
        f"--- worker {p}:\n" + "\n".join((out / f"{tag}{p}.log").read_text().splitlines()[-25:])
        for p in range(NUM_PROCESSES)
    )


def _reads(out: pathlib.Path, tag: str) -> list[list[int]]:
    logs = [out / f"{tag}{p}.reads" for p in range(NUM_PROCESSES)]
    return [sorted(int(x) for x in f.read_text().split()) if f.exists() else [] for f in logs]


def _main(argv: list[str]) -> None:
    from rag_jax.devices import distributed
    from rag_jax.io import hf
    from rag_jax.retrieval import encode

    process, port, args = int(argv[1]), argv[2], json.loads(argv[3])
    distributed.maybe_initialize_distributed(
        coordinator_address=f"127.0.0.1:{port}", num_processes=NUM_PROCESSES, process_id=process
    )
    assert (jax.process_count(), jax.local_device_count()) == (2, DEVICES_PER_PROCESS)
    out = pathlib.Path(args["out"])
    store = Store(_passages(), out / f"{args['tag']}{process}.reads", args["kill"])
    cfg, params = hf.load_bert(args["model"])
    tokenizer = hf.load_tokenizer(args["model"])
    manifest = encode.encode_corpus(
        store, cfg, params, tokenizer, out / "vectors", progress=False, **KWARGS
    )
    (out / f"{args['tag']}{process}.manifest.json").write_text(json.dumps(manifest))


# ---------------------------------------------------------------------------------------------
# Tests


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import hf_fixtures
    from rag_jax.io import hf

    path = tmp_path_factory.mktemp("tiny_bert")
    tokenizer = hf.load_tokenizer(hf_fixtures.minilm_path())
    hf_fixtures.save_bert(path, vocab_size=tokenizer.vocab_size, max_position_embeddings=48)
    tokenizer.save_pretrained(path)
    return path


def _one_process(model, out_dir, devices: int) -> dict:
    from rag_jax.io import hf
    from rag_jax.retrieval import encode

    cfg, params = hf.load_bert(model)
    mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
    return encode.encode_corpus(
        Store(_passages()), cfg, params, hf.load_tokenizer(model), out_dir, mesh=mesh,
        progress=False, **KWARGS,
    )  # fmt: skip


@pytest.mark.slow
def test_two_processes_write_the_files_of_one_process(model, tmp_path):
    from rag_jax.retrieval import vectors

    codes = _run(tmp_path, model, "fresh")
    assert codes == [0, 0], _logs(tmp_path, "fresh")
    reads = _reads(tmp_path, "fresh")
    assert reads == [_rows([0, 2, 4, 6]), _rows([1, 3, 5, 7])]  # round-robin, no row twice
    one = _one_process(model, tmp_path / "one", devices=4)
    for p in range(NUM_PROCESSES):  # every process returns the finished manifest
        assert json.loads((tmp_path / f"fresh{p}.manifest.json").read_text()) == one
    assert _files(tmp_path / "vectors") == _files(tmp_path / "one")  # manifest and shards
    # On 8 devices each holds half as many rows of a batch: the same vectors to float32 rounding.
    _one_process(model, tmp_path / "eight", devices=8)
    np.testing.assert_allclose(
        vectors.load_vectors(tmp_path / "vectors"),
        vectors.load_vectors(tmp_path / "eight"),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.slow
def test_a_run_with_a_killed_process_is_finished_by_a_rerun(model, tmp_path):
    """Process 1 is SIGKILLed on the first row of its third shard (5); process 0, at a barrier
    or still encoding, is then killed too. The re-run by both encodes only what no record
    covers, dealt over both again, and ends with the one-process files."""
    from rag_jax.retrieval import vectors

    codes = _run(tmp_path, model, "killed", kill_at=(None, SHARD * 5))
    assert codes[1] == -signal.SIGKILL, _logs(tmp_path, "killed")
    part = tmp_path / "vectors"
    assert vectors.read_manifest(part)["shards"] == []  # process 0 writes them at the end
    recorded = sorted(int(p.name[8:13]) for p in part.glob("vectors-*.json"))
    assert {1, 3} <= set(recorded) and not {5, 7} & set(recorded), recorded
    with pytest.raises(ValueError, match="0 of 8 shards"):
        vectors.load_vectors(part)

    codes = _run(tmp_path, model, "rerun")
    assert codes == [0, 0], _logs(tmp_path, "rerun")
    left = [s for s in range(8) if s not in recorded]
    assert _reads(tmp_path, "rerun") == [_rows(left[0::2]), _rows(left[1::2])]
    _one_process(model, tmp_path / "one", devices=4)
    assert _files(part) == _files(tmp_path / "one")


if __name__ == "__main__":
    _main(sys.argv)
