"""Paired comparisons of two evaluations on the same questions: a metric's difference with its
paired bootstrap interval.

Two rows of a study (say a frozen and a jointly trained retriever) answer the same held-out
questions; what separates them is the per-question difference, not the two means' own spreads.
`paired_difference` resamples the questions with replacement (Efron & Tibshirani 1993; the
paired bootstrap of Koehn 2004 for system comparisons) and reports the percentile interval of
the mean difference, computed from the per-question records the trainer writes
(`<workdir>/per_question.jsonl`, `training.evaluation.evaluate(per_question=...)`).

Legend: Q questions, R resamples.
"""

import gzip
import json
import pathlib
from collections.abc import Mapping, Sequence

import numpy as np

RESAMPLES = 10_000
_CHUNK = 500  # resamples drawn at a time: [chunk, Q] indices stay small at Q = 8,595


def read_per_question(path) -> dict[str, dict]:
    """The records of a `per_question.jsonl` (or `.jsonl.gz`), by question id (a repeated id or
    a line that is not a JSON object with an "id" is refused, naming the file and line)."""
    path = pathlib.Path(path)
    records: dict[str, dict] = {}
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not JSON ({e})") from None
            if not isinstance(record, dict) or "id" not in record:
                raise ValueError(f"{path}:{number}: expected an object with an 'id'")
            key = str(record["id"])
            if key in records:
                raise ValueError(f"{path}:{number}: question {key!r} appears twice")
            records[key] = record
    return records


def _values(records: Mapping[str, dict], metric: str, ids: Sequence[str]) -> np.ndarray:
    return np.array([float(records[i][metric]) for i in ids], np.float64)


def paired_difference(
    a: Mapping[str, dict],
    b: Mapping[str, dict],
    metric: str,
    *,
    resamples: int = RESAMPLES,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict:
    """The mean of `metric` in `b` minus in `a` over the questions both scored, with its paired
    bootstrap percentile interval.

    Both must have scored the same questions on `metric` (an answer sample of another size or
    seed, or another evaluation set, is refused, naming a question one lacks): a difference
    over different questions is not paired.

    Args:
      a, b: question id -> record (`read_per_question`); `b` is the row compared with `a`.
      metric: a record key, e.g. "gold_recall@5", "exact_match".
      resamples: R bootstrap resamples of the questions.
      confidence: the interval's coverage.
      seed: the resampling seed (the same questions are drawn for every metric of one seed).

    Returns:
      {"metric", "questions", "a", "b", "difference", "low", "high", "confidence",
      "resamples", "b_better", "a_better" (questions where one scored higher), "p_value"
      (two-sided: twice the share of resampled differences on the other side of 0, at most 1)}.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if resamples < 100:
        raise ValueError(f"resamples must be >= 100 for a percentile interval, got {resamples}")
    scored_a = {i for i, r in a.items() if r.get(metric) is not None}
    scored_b = {i for i, r in b.items() if r.get(metric) is not None}
    if scored_a != scored_b:
        only, where = (scored_a - scored_b, "the second") if scored_a - scored_b else (
            scored_b - scored_a, "the first"
        )  # fmt: skip
        raise ValueError(
            f"{metric}: the two evaluations scored different questions ({len(scored_a)} and "
            f"{len(scored_b)}); {where} lacks {len(only)}, e.g. {sorted(only)[0]!r}"
        )
    if not scored_a:
        raise ValueError(f"{metric}: no question has it in either evaluation")
    ids = sorted(scored_a)
    x, y = _values(a, metric, ids), _values(b, metric, ids)
    diff = y - x  # [Q]
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    for start in range(0, resamples, _CHUNK):
        count = min(_CHUNK, resamples - start)
        draws = rng.integers(0, len(ids), size=(count, len(ids)))  # -> [chunk, Q]
        means[start : start + count] = diff[draws].mean(axis=1)
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    observed = float(diff.mean())
    other_side = np.mean(means <= 0) if observed > 0 else np.mean(means >= 0)
    return {
        "metric": metric,
        "questions": len(ids),
        "a": float(x.mean()),
        "b": float(y.mean()),
        "difference": observed,
        "low": float(low),
        "high": float(high),
        "confidence": confidence,
        "resamples": resamples,
        "b_better": int(np.sum(diff > 0)),
        "a_better": int(np.sum(diff < 0)),
        "p_value": float(min(1.0, 2 * other_side)) if observed else 1.0,
    }


def describe(result: dict) -> str:
    """One line: `metric: a -> b, +d [low, high] (95%, Q questions)`."""
    return (
        f"{result['metric']}: {result['a']:.3f} -> {result['b']:.3f}, "
        f"{result['difference']:+.3f} [{result['low']:+.3f}, {result['high']:+.3f}] "
        f"({result['confidence']:.0%}, {result['questions']} questions)"
    )
