"""retrieval.synthetic_corpus: DPR's psgs_w100.tsv format, read back by the corpus reader."""

import collections
import hashlib

from rag_jax.retrieval import corpus, synthetic_corpus


def test_a_corpus_is_dprs_format_read_back_whole(tmp_path):
    path = tmp_path / "psgs.tsv"
    info = synthetic_corpus.write_dpr_tsv(path, 700, seed=3)
    assert path.read_text(encoding="utf-8").split("\n", 1)[0] == "id\ttext\ttitle"
    passages = list(corpus.read_tsv(path))
    assert [p.id for p in passages] == [str(i) for i in range(1, 701)]
    lengths = [len(p.text.split()) for p in passages]
    assert collections.Counter(lengths).most_common(1)[0][0] == 100  # DPR: 100-word passages
    assert min(lengths) >= 20 and max(lengths) == 100
    titles = [p.title for p in passages]
    runs = sum(1 for a, b in zip(titles, titles[1:]) if a != b) + 1
    assert info["articles"] >= runs > 700 / 10  # articles of a few passages each
    # Quoted words survive the TSV quoting (DPR doubles a quote inside a quoted field).
    assert any('"' in p.text for p in passages)
    assert all(p.title and p.text for p in passages)


def test_the_same_seed_writes_the_same_bytes(tmp_path):
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    synthetic_corpus.write_dpr_tsv(tmp_path / "a.tsv", 300, seed=1)
    synthetic_corpus.write_dpr_tsv(tmp_path / "b.tsv", 300, seed=1)
    synthetic_corpus.write_dpr_tsv(tmp_path / "c.tsv", 300, seed=2)
    assert digest(tmp_path / "a.tsv") == digest(tmp_path / "b.tsv") != digest(tmp_path / "c.tsv")
