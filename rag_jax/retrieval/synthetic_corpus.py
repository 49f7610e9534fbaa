"""Synthetic corpora in the exact format of DPR's Wikipedia, at any size, for tests and benchmarks.

DPR's `psgs_w100.tsv` (Karpukhin et al. 2020) has a header `id\ttext\ttitle`, then one passage a
line: an integer id counting from 1, a text of 100 words (an article's last passage shorter),
and the article's title, fields quoted where they hold a quote (`"`, doubled inside), as Python's
`csv` module writes tab-separated fields. Nothing of it can be downloaded here, so the scale
work (ingest, import, index, edit) runs on corpora written by `write_dpr_tsv`: the same format,
byte for byte in its conventions, with Wikipedia-like statistics:

- words drawn from a Zipfian vocabulary (exponent 1.07 over `VOCABULARY` words made of
  syllables, so tokenisers split them as they split rare names), a few quoted and a few
  capitalised;
- articles of a geometric number of passages (mean `MEAN_ARTICLE` = 3.4: 21,015,324 passages of
  about 6.2M articles in DPR's dump), each article's last passage shorter than 100 words.

A corpus is a fixed function of (passages, seed): the same file, byte for byte, on any machine,
written in bounded memory (one block of passages at a time). Measured: 100,000 passages in 8.5 s,
43 MB (430 bytes a passage; DPR's file has about 620: real words are longer), 99 MB peak RSS.
"""

import csv
import pathlib

import numpy as np

WORDS = 100  # words per passage (DPR's "w100")
VOCABULARY = 1 << 17  # distinct words
ZIPF = 1.07  # the rank-frequency exponent of English Wikipedia's words
MEAN_ARTICLE = 3.4  # passages per article, on average
BLOCK = 20_000  # passages generated at a time
_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]


def _vocabulary(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(words [VOCABULARY] str, cumulative probabilities [VOCABULARY]) of one seed."""
    rng = np.random.default_rng([seed, 1])
    lengths = np.clip(rng.poisson(1.6, VOCABULARY) + 1, 1, 5)
    pieces = rng.integers(0, len(_SYLLABLES), size=(VOCABULARY, 5))
    words = np.array(
        ["".join(_SYLLABLES[p] for p in row[:n]) for row, n in zip(pieces, lengths)], dtype=object
    )
    # The most frequent words are short ones, as in natural text ("of", "the"); the rest of the
    # ranks in no order of length (about 5.5 characters a word, weighted by frequency).
    by_length = np.argsort(lengths, kind="stable")
    order = np.concatenate([by_length[:256], rng.permutation(by_length[256:])])
    weights = 1.0 / np.arange(1, VOCABULARY + 1) ** ZIPF
    return words[order], np.cumsum(weights / weights.sum())


def write_dpr_tsv(path, passages: int, seed: int = 0) -> dict:
    """Writes a corpus of `passages` passages in DPR's `psgs_w100.tsv` format to `path`.

    Args:
      path: the .tsv file to write (replaced).
      passages: how many passages (>= 1).
      seed: the corpus' seed: the same (passages, seed) writes the same bytes.

    Returns:
      {"passages", "articles", "bytes"}.
    """
    if passages < 1:
        raise ValueError(f"passages must be >= 1, got {passages}")
    path = pathlib.Path(path)
    words, cdf = _vocabulary(seed)
    rng = np.random.default_rng([seed, 2])
    left, articles = 0, 0  # passages still to write of the current article; articles begun
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, delimiter="\t", lineterminator="\n", quoting=csv.QUOTE_MINIMAL)
        writer.writerow(["id", "text", "title"])
        for start in range(0, passages, BLOCK):
            count = min(BLOCK, passages - start)
            drawn = np.searchsorted(cdf, rng.random((count, WORDS)))  # -> [count, WORDS]
            drawn = np.minimum(drawn, VOCABULARY - 1)
            quoted = rng.random((count, WORDS)) < 0.004
            capital = rng.random((count, WORDS)) < 0.06
            for i in range(count):
                if left == 0:
                    articles += 1
                    left = int(rng.geometric(1.0 / MEAN_ARTICLE))
                    title_words = words[drawn[i, : 1 + articles % 3]]
                    title = " ".join(w.capitalize() for w in title_words)
                left -= 1
                n = WORDS if left else int(rng.integers(20, WORDS + 1))  # the last is shorter
                row = [
                    f'"{w}"' if q else (w.capitalize() if c else w)
                    for w, q, c in zip(words[drawn[i, :n]], quoted[i, :n], capital[i, :n])
                ]
                writer.writerow([start + i + 1, " ".join(row), title])
    return {"passages": passages, "articles": articles, "bytes": path.stat().st_size}
