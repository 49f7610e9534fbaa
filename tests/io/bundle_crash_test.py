"""A real crash mid-edit: a process SIGKILLed while `Bundle.edit` writes leaves a bundle that
loads whole, the one before the edit or the one after it, never a mix.

Each edit runs in a process of its own (`killed_edits.py`) that kills itself with SIGKILL just
before a chosen file operation of the edit (the n-th open, rename, link, mkdir, chmod or removal,
counted by Python's audit hook in that process: the same point every run). After each kill the
bundle is loaded with every file's sha256 checked, compared file for file with the bundle before
the edit and the bundle after it, searched, and edited again; that edit removes the folders the
killed write left beside the bundle. The default run kills at the moments the swap is exposed
(between `files.swap_dir`'s two renames, and as the set-aside bundle is removed, then a second
edit between its renames); the slow sweep kills at points spread over every phase of the write.
"""

import json
import os
import pathlib
import select
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from killed_edits import edit_of

from rag_jax.io import bundle
from rag_jax.retrieval import files
from rag_jax.retrieval.corpus import Passage, corpus_checksum

ROOT = pathlib.Path(__file__).resolve().parents[2]
ADDS = 300  # new passages per edit: the store and index written are 2.5 times the trained ones
# The second of `swap_dir`'s renames: killed before it, no bundle is at the path, the previous
# one is aside in `.bundle.old.*/bundle` and the edited one whole in `.bundle.new.*`.
SECOND_RENAME = ["os.rename", "<root>/.bundle.new.*", "<root>/bundle"]
# After the swap: the removal of the set-aside previous bundle.
REMOVAL = ["shutil.rmtree", "<root>/.bundle.old.*"]
JOB_TIMEOUT_S = 300


class Editor:
    """The `killed_edits.py` process: rag_jax imported once, each edit in a fork of it."""

    def __init__(self, workdir: pathlib.Path):
        self.workdir, self.jobs = workdir, 0
        self.log = open(workdir / "editor.log", "w")
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": f"{ROOT / 'tests'}:{ROOT}"}
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "killed_edits.py"), str(workdir / "cache")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            cwd=ROOT,
            start_new_session=True,  # its children too are ended by `close` if one hangs
        )
        self.ready = False  # it imports rag_jax while the test loads its references

    def _line(self) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], JOB_TIMEOUT_S)
        if not ready:
            self.close()
            pytest.fail(f"the editing process did not answer in {JOB_TIMEOUT_S} s")
        return self.proc.stdout.readline().strip()

    def output(self) -> str:
        self.log.flush()
        return (self.workdir / "editor.log").read_text()[-4000:]

    def edit(self, directory, tag: str, *, kill_at=None, kill_before=None) -> tuple[int, dict]:
        """Edits the bundle in `directory` in a new process, killed at operation `kill_at` (or
        before `kill_before`); (its exit code, its report: see `killed_edits`)."""
        if not self.ready:
            self.ready = self._line() == "ready"
            assert self.ready, self.output()
        self.jobs += 1
        report = self.workdir / f"report{self.jobs}.json"
        job = dict(
            bundle=str(directory),
            tag=tag,
            adds=ADDS,
            kill_at=kill_at,
            kill_before=kill_before,
            report=str(report),
        )
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self._line()
        assert line, f"the editing process ended: {self.output()}"
        code = json.loads(line)["exit"]
        assert report.is_file(), f"edit {job} reported nothing (exit {code}): {self.output()}"
        out = json.loads(report.read_text())
        assert "error" not in out, out["error"]
        return code, out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the group this test started
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def editor(tmp_path_factory):
    editor = Editor(tmp_path_factory.mktemp("editor"))
    yield editor
    editor.close()


@pytest.fixture(scope="module")
def before(tiny_trained_run):
    """The trainer's bundle: (its folder, never written: the tests edit copies; it loaded)."""
    directory = tiny_trained_run[0] / "bundle"
    return directory, bundle.load(directory)


def _copy(source: pathlib.Path, folder: pathlib.Path) -> pathlib.Path:
    folder.mkdir()
    shutil.copytree(source, folder / "bundle")
    return folder / "bundle"


def _snapshot(directory: pathlib.Path) -> dict[str, bytes]:
    return {rel: (directory / rel).read_bytes() for rel in files.files_under(directory)}


def _aside(folder: pathlib.Path) -> list[str]:
    """What a write left beside the bundle in `folder`."""
    return sorted(name for name in os.listdir(folder) if name != "bundle")


def _passages(model) -> list[Passage]:
    return [model.store.passage(i) for i in range(len(model.store))]


def _loads_as(directory: pathlib.Path, references: dict) -> tuple[str, bundle.Bundle]:
    """Loads `directory` (sha256 of every file checked, the manifest's seal too) and names the
    reference snapshot it equals byte for byte; fails naming the files that differ otherwise."""
    model = bundle.load(directory)
    snapshot = _snapshot(directory)
    for name, reference in references.items():
        if snapshot == reference:
            return name, model
    differ = {
        name: sorted(r for r in set(snapshot) | set(ref) if snapshot.get(r) != ref.get(r))
        for name, ref in references.items()
    }
    pytest.fail(f"{directory} loads but is neither bundle; files that differ: {differ}")


def _assert_is_the_edit(model, previous, tag: str) -> None:
    """`model` holds exactly `previous` edited by `edit_of(tag)`: the passages in order (replaced
    in place, deleted, added at the end), their checksum and count in the manifest, and the
    vectors of every passage the edit kept, bit for bit."""
    upserts, deletes = edit_of(previous.store, tag, ADDS)
    changed, want, kept = {p.id: p for p in upserts}, [], []
    for row, passage in enumerate(_passages(previous)):
        if passage.id not in deletes:
            if passage.id not in changed:
                kept.append((len(want), row))
            want.append(changed.pop(passage.id, passage))
    want += changed.values()
    assert _passages(model) == want
    assert model.manifest["count"] == len(want)
    assert model.manifest["corpus_checksum"] == corpus_checksum(want)
    new_rows, old_rows = (list(x) for x in zip(*kept, strict=True))
    np.testing.assert_array_equal(
        model.retriever.vectors[new_rows], previous.retriever.vectors[old_rows]
    )


def _edit_again_and_check_the_leftovers_go(model, folder: pathlib.Path) -> None:
    """A further edit succeeds and removes what the killed write left beside the bundle (once
    a minute old: a younger folder may be another process's write in progress)."""
    directory = folder / "bundle"
    count, last = len(model.store), model.store.ids[len(model.store) - 1]
    past = time.time() - 120
    for name in _aside(folder):
        os.utime(folder / name, (past, past))
    model.edit(deletes=[last])  # nothing to encode: no compile in this process
    assert _aside(folder) == []
    # Sealed and whole: every file on disk listed, each of its size and sha256.
    manifest = files.read_manifest(directory, {bundle.FORMAT: (bundle.VERSION,)}, what="bundle")
    assert set(files.files_under(directory)) == {*manifest["files"], files.MANIFEST}
    for rel, record in manifest["files"].items():
        files.check_file(directory / rel, record, verify=True)
    assert manifest["count"] == count - 1 == len(model.store)
    assert manifest["corpus_checksum"] == corpus_checksum(_passages(model))
    assert last not in {model.store.ids[i] for i in range(count - 1)}


def test_an_edit_killed_while_its_swap_is_exposed_leaves_the_old_or_the_new_bundle(
    editor, before, tmp_path
):
    source, old_model = before
    old = _snapshot(source)

    # Killed between the two renames: no bundle at the path; the load puts the old one back.
    directory = _copy(source, tmp_path / "between")
    code, report = editor.edit(directory, "a", kill_before=SECOND_RENAME)
    assert code == -signal.SIGKILL and report["event"] == SECOND_RENAME, report
    assert not directory.exists()
    name, model = _loads_as(directory, {"old": old})
    assert name == "old"
    _edit_again_and_check_the_leftovers_go(model, directory.parent)

    # Killed after the swap, before the set-aside old bundle is removed: the edited one.
    directory = _copy(source, tmp_path / "after")
    code, report = editor.edit(directory, "a", kill_before=REMOVAL)
    assert code == -signal.SIGKILL and report["event"] == REMOVAL, report
    (stale,) = [n for n in _aside(directory.parent) if n.startswith(".bundle.old.")]
    assert _snapshot(directory.parent / stale / "bundle") == old  # whole, aside
    model = bundle.load(directory)
    _assert_is_the_edit(model, old_model, "a")
    edited = _snapshot(directory)

    # Then a second edit killed between its renames: the load must put back the bundle that
    # edit set aside, not the older one the first kill left (whichever sorts first: `tempfile`
    # names are random, and this one is given the name that sorts first).
    os.rename(directory.parent / stale, directory.parent / ".bundle.old.00000000")
    code, report = editor.edit(directory, "b", kill_before=SECOND_RENAME)
    assert code == -signal.SIGKILL and report["event"] == SECOND_RENAME, report
    name, model = _loads_as(directory, {"before both edits": old, "edited": edited})
    assert name == "edited"
    _edit_again_and_check_the_leftovers_go(model, directory.parent)


@pytest.mark.slow  # 13 edits in processes of their own, 12 killed: 53-89 s, 2 cores at load 8
def test_kills_swept_over_an_edits_write_leave_the_old_or_the_new_bundle(editor, before, tmp_path):
    source, old_model = before
    old = _snapshot(source)
    # Every edit in the same folder: the passage store's manifest names the folder its tokenizer
    # was loaded from, so only bundles edited at one path are equal byte for byte.
    folder = tmp_path / "edited"
    directory = _copy(source, folder)
    code, report = editor.edit(directory, "a")
    assert code == 0 and _aside(folder) == []
    events = report["events"]
    new = _snapshot(directory)
    new_model = bundle.load(directory)
    _assert_is_the_edit(new_model, old_model, "a")
    # Queries: vectors of kept, replaced and added passages (rows of the edited bundle).
    queries = new_model.retriever.vectors[[0, 3, 20, 100, len(new_model.store) - 1]]
    found = {"old": _search(old_model, queries), "new": _search(new_model, queries)}
    assert found["old"] != found["new"]

    swap = events.index(SECOND_RENAME) + 1  # killed before operation `swap` or earlier: old
    index = next(i for i, e in enumerate(events) if e[1].endswith("/vectors.bin")) + 1
    inside_removal = events.index(REMOVAL) + 6  # the aside bundle partly removed
    spread = range(1, len(events) + 1, len(events) // 6)  # linking, the store, modes, hashing
    points = sorted({*spread, index, swap - 1, swap, swap + 1, inside_removal})
    outcomes = {"old": [], "new": []}
    for n in points:
        shutil.rmtree(folder)
        directory = _copy(source, folder)
        code, report = editor.edit(directory, "a", kill_at=n)
        assert code == -signal.SIGKILL and report == {"killed_at": n, "event": events[n - 1]}
        name, model = _loads_as(directory, {"old": old, "new": new})
        assert name == ("old" if n <= swap else "new"), (n, events[n - 1])
        outcomes[name].append(n)
        assert _search(model, queries) == found[name]
        _edit_again_and_check_the_leftovers_go(model, folder)
    assert len(outcomes["old"]) >= 5 and len(outcomes["new"]) >= 3, outcomes
    print(f"{len(points)} kills over the {len(events)} file operations of an edit: {outcomes}")


def _search(model, queries) -> list[list[str]]:
    """The ids of each query's top 5 passages in `model`'s index."""
    _, rows = model.retriever.index.search(queries, 5)  # -> [5, 5] rows of the store
    return [[model.store.ids[j] for j in row] for row in rows]
