"""The scripts a user runs on a trained model, run as a user runs them: `ask.py --bundle`,
`evaluate.py --bundle` and `export.py --out/--hf` in their own processes, on the tiny trained
run's bundle, checked on what they print, write and exit with."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from rag_jax.devices import host
from rag_jax.io import bundle
from rag_jax.retrieval import files
from rag_jax.run import data, synthetic
from tiny_runs import tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Keys transformers writes into a saved tokenizer's config saying where it was loaded from.
_LOADED_FROM = ("is_local", "local_files_only")


@pytest.fixture(scope="module")
def run(tiny_trained_run, tmp_path_factory):
    """(the trainer's bundle, its final predictions, its summary, a function running a script).

    The scripts run on one CPU device, as a user's do (not the suite's 8 fake ones), sharing one
    fresh compilation cache so that later scripts load what the first compiled, with the host
    settings exported as `rag_jax.devices.host` says a user may (so no script restarts itself)."""
    workdir, summary = tiny_trained_run
    cache = tmp_path_factory.mktemp("script_compilation_cache")
    flags = os.environ.get("XLA_FLAGS", "").split()
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": " ".join(f for f in flags if "force_host_platform_device_count" not in f),
        "RAG_JAX_COMPILATION_CACHE": str(cache),
    }
    env.update(host.startup_environment(env))

    def script(name, *args):
        command = [sys.executable, str(ROOT / "experiments" / name), *map(str, args)]
        return subprocess.run(
            command, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT
        )

    lines = (workdir / "predictions.jsonl").read_text().splitlines()
    return workdir / "bundle", [json.loads(line) for line in lines], summary, script


def _ok(proc) -> str:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _refused(proc, *words) -> None:
    """Exited non-zero, the error naming each of `words`, with no Python traceback."""
    assert proc.returncode != 0, proc.stdout[-2000:]
    for word in words:
        assert word in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_ask_answers_from_a_bundle_as_the_trainer_evaluated(run):
    """Each answer JSON line: the trainer's final prediction and retrieved passages for that
    question; the plain output shows the same answer and passages."""
    path, predictions, _, script = run
    chosen = predictions[:3]
    questions = [a for p in chosen for a in ("--question", p["question"])]
    out = _ok(script("ask.py", "--bundle", path, "--json", *questions))
    answers = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [a["question"] for a in answers] == [p["question"] for p in chosen]
    assert [a["answer"] for a in answers] == [p["prediction"] for p in chosen]
    assert [[x["id"] for x in a["passages"]] for a in answers] == [p["retrieved"] for p in chosen]
    for a in answers:
        assert sum(x["prior"] for x in a["passages"]) == pytest.approx(1.0, abs=1e-5)
        assert sum(x["posterior"] for x in a["passages"]) == pytest.approx(1.0, abs=1e-5)


def test_ask_refuses_bad_arguments_naming_them(run, tmp_path):
    path, predictions, _, script = run
    _refused(script("ask.py", "--bundle", path), "--question")
    _refused(script("ask.py", "--bundle", path, "--question", "q", "--variant", "tokn"), "tokn")
    missing = tmp_path / "no_bundle"
    proc = script("ask.py", "--bundle", missing, "--question", predictions[0]["question"])
    assert proc.returncode != 0 and str(missing) in proc.stderr, proc.stderr[-2000:]


def test_evaluate_a_bundle_on_a_qa_file_prints_the_trainers_metrics(run, tmp_path):
    """The trainer's held-out questions as a QA file (with their gold passage ids): the report
    printed is the trainer's final evaluation, the predictions written are its answers."""
    path, predictions, summary, script = run
    c = tiny_config()
    world = synthetic.make_world(
        synthetic.WorldConfig(seed=c.seed, num_entities=c.data.num_entities)
    )
    examples = data.examples_from_world(world, "eval")[: len(predictions)]
    assert [e.question for e in examples] == [p["question"] for p in predictions]
    questions = tmp_path / "questions.jsonl"
    rows = [
        {
            "id": e.id,
            "question": e.question,
            "answers": list(e.answers),
            "gold_ids": list(e.gold_ids),
        }
        for e in examples
    ]
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    printed = _ok(
        script("evaluate.py", "--bundle", path, "--questions", questions, f"--predictions={out}")
    )
    report = json.loads(printed.splitlines()[-1])
    assert report["step"] == summary["steps"] == 6 and report["variant"] == "sequence"
    metrics = {k: v for k, v in report.items() if k not in ("step", "variant")}
    assert metrics == pytest.approx(summary["eval"], abs=1e-9)
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [w["prediction"] for w in written] == [p["prediction"] for p in predictions]
    assert [w["question"] for w in written] == [p["question"] for p in predictions]

    _refused(script("evaluate.py", "--bundle", path), "--bundle needs --questions")


def test_export_writes_the_bundle_and_the_hf_folder_the_library_writes(run, tmp_path):
    """`--out` copies the bundle file for file; `--hf` writes the files `Bundle.to_hf` writes
    (whose parity with transformers `hf_export_test` checks), and a summary naming both."""
    path, predictions, _, script = run
    out, hf_dir = tmp_path / "bundle", tmp_path / "hf"
    summary = json.loads(_ok(script("export.py", "--bundle", path, "--out", out, "--hf", hf_dir)))
    assert summary["step"] == 6 and summary["bundle"] == str(out)
    assert summary["hf"]["passages_path"].startswith(str(hf_dir))

    original = bundle.load(path)
    assert summary["passages"] == len(original.store)
    assert files.files_under(out) == files.files_under(path)
    for rel in files.files_under(path):
        if rel.endswith("tokenizer_config.json"):  # transformers adds where it was loaded from
            got, want = (json.loads((d / rel).read_text()) for d in (out, path))
            assert {k: v for k, v in got.items() if k not in _LOADED_FROM} == want, rel
        elif rel != "manifest.json":  # its checksum of those configs differs with them
            assert (out / rel).read_bytes() == (path / rel).read_bytes(), rel
    assert bundle.load(out).step == 6  # its manifest seals what it holds

    library = tmp_path / "library_hf"
    original.to_hf(library)
    assert sorted(files.files_under(hf_dir)) == sorted(files.files_under(library))
    for rel in files.files_under(library):
        # The config names its passages and index by their paths, in the folder written.
        got = (hf_dir / rel).read_bytes().replace(str(hf_dir).encode(), str(library).encode())
        assert got == (library / rel).read_bytes(), rel

    _refused(script("export.py", "--bundle", path), "nothing to write", "--out", "--hf")
