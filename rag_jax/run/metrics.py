"""Answer metrics (exact match, F1) and retrieval metrics (answer recall@k, gold recall@k).

Legend: B batch (questions), N retrieved passages per question.

Answers are compared after the SQuAD v1.1 normalisation of the official evaluation script
(`evaluate-v1.1.py`, Rajpurkar et al. 2016), applied in this order:

1. lower-case with `str.lower()` (full Unicode case mapping: "É" -> "é"; accents are kept);
2. delete every character of `string.punctuation`, which is the 32 ASCII punctuation characters
   ``!"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~`` and nothing else: curly quotes, dashes, "¿", "«", CJK and
   full-width punctuation ("，", "。", "！") and symbols such as "°" or "€" are kept;
3. replace each whole word "a", "an" or "the" by a space (`\\b(a|an|the)\\b` on `str`, so word
   boundaries are Unicode-aware: "the" inside "théa" or "日the" is not a word and stays);
4. split on any Unicode whitespace (`str.split()`) and re-join with single spaces.

Exact match is 1.0 when the normalised prediction equals a normalised gold answer. F1 is the
harmonic mean of precision and recall of the bag of normalised whitespace tokens; as in v1.1 (and
unlike SQuAD 2.0) it is 0.0 when either side has no tokens, even when both are empty. Both take
the maximum over the gold answers; an empty list of gold answers is an error, never a silent 0.

Metrics come back as `{name: (sum, count)}` pairs, merged over batches with `merge_metrics` and
reduced with `reduce_metrics` only when logged, so means over uneven or padded batches are exact.
"""

import collections
import re
import string
from collections.abc import Mapping, Sequence

import numpy as np

Metrics = dict[str, tuple[float, int]]

_PUNCTUATION = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """SQuAD v1.1 answer normalisation (see the module docstring for the exact steps)."""
    if not isinstance(text, str):
        raise TypeError(f"expected a string to normalise, got {type(text).__name__}: {text!r:.80}")
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _gold(answers: Sequence[str]) -> list[str]:
    """`answers` checked: a non-empty sequence of strings (a bare string would be its letters)."""
    if isinstance(answers, (str, bytes)) or not isinstance(answers, (Sequence, np.ndarray)):
        raise TypeError(f"answers must be a sequence of strings, got {type(answers).__name__}")
    answers = list(answers)
    if not answers:
        raise ValueError("answers is empty: exact match and F1 need at least one gold answer")
    for answer in answers:
        if not isinstance(answer, str):
            raise TypeError(f"answers must hold strings, got {type(answer).__name__}: {answer!r}")
    return answers


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0.

    Args:
      prediction: the generated answer string.
      answers: the gold answer strings; must not be empty.
    """
    predicted = normalize_answer(prediction)
    return float(any(predicted == normalize_answer(answer) for answer in _gold(answers)))


def f1(prediction: str, answers: Sequence[str]) -> float:
    """Token F1 between the normalised prediction and the best-matching gold answer.

    Args:
      prediction: the generated answer string.
      answers: the gold answer strings; must not be empty.
    """
    predicted = collections.Counter(normalize_answer(prediction).split())
    best = 0.0
    for answer in _gold(answers):
        gold = collections.Counter(normalize_answer(answer).split())
        same = sum((predicted & gold).values())
        if same:
            precision = same / sum(predicted.values())
            recall = same / sum(gold.values())
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def _rows(mask, batch: int) -> list[int]:
    """Indices of the rows to score: all of them, or those where `mask` [B] is True."""
    if mask is None:
        return list(range(batch))
    mask = np.asarray(mask)
    if mask.shape != (batch,) or mask.dtype != np.bool_:
        raise ValueError(f"mask must be bool [B] = [{batch}], got {mask.dtype} {list(mask.shape)}")
    return np.flatnonzero(mask).tolist()


def qa_metrics(predictions: Sequence[str], answers: Sequence[Sequence[str]], mask=None) -> Metrics:
    """Exact match and F1 summed over a batch.

    Args:
      predictions: B predicted answer strings.
      answers: B lists of gold answer strings, each non-empty.
      mask: optional [B] bool; False rows (eval padding) are neither scored nor counted.

    Returns:
      `{"exact_match": (sum, count), "f1": (sum, count)}`.
    """
    if len(predictions) != len(answers):
        raise ValueError(
            f"predictions has {len(predictions)} entries but answers has {len(answers)}"
        )
    em_sum = f1_sum = 0.0
    rows = _rows(mask, len(predictions))
    for row in rows:
        if not isinstance(predictions[row], str):
            raise TypeError(
                f"predictions[{row}] must be a string, got {type(predictions[row]).__name__}"
            )
        try:
            em_sum += exact_match(predictions[row], answers[row])
            f1_sum += f1(predictions[row], answers[row])
        except (TypeError, ValueError) as e:
            raise type(e)(f"answers[{row}]: {e}") from None
    return {"exact_match": (em_sum, len(rows)), "f1": (f1_sum, len(rows))}


def has_answer(answers: Sequence[str], text: str) -> bool:
    """Whether any gold answer occurs in `text` as a whole-word span, after normalisation.

    Both sides get the SQuAD normalisation used by exact match, then a normalised answer must
    appear in the normalised text as a run of whole whitespace tokens ("art" is not found in
    "start", "new york" is found in "in new york city"). DPR's `has_answer` instead matches token
    sequences of its own uncased tokenizer, which keeps punctuation as tokens and keeps articles;
    reusing the EM normalisation makes answer recall and EM agree on what "contains the answer"
    means. An answer that normalises to nothing (e.g. "The", "?") can never be found.

    Args:
      answers: the gold answer strings; must not be empty.
      text: one passage's text.
    """
    padded_text = f" {normalize_answer(text)} "
    for answer in _gold(answers):
        normalized = normalize_answer(answer)
        if normalized and f" {normalized} " in padded_text:
            return True
    return False


def _check_ks(ks: Sequence[int], docs: int) -> None:
    if not ks:
        raise ValueError("ks is empty; expected at least one k")
    for k in ks:
        if not 1 <= k <= docs:
            raise ValueError(f"k={k} is out of range: each k must be in [1, N] = [1, {docs}]")


def answer_recall(
    answers: Sequence[Sequence[str]],
    passages: Sequence[Sequence[str]],
    ks: Sequence[int],
    mask=None,
) -> Metrics:
    """Answer recall@k: the fraction of questions with a gold answer in a top-k passage.

    Args:
      answers: B lists of gold answer strings, each non-empty.
      passages: [B, N] passage texts per question in rank order, best first (the text only, as
        DPR scores it, not the title). All rows must have the same N.
      ks: the cut-offs, each in [1, N].
      mask: optional [B] bool; False rows (eval padding) are neither scored nor counted.

    Returns:
      `{f"answer_recall@{k}": (sum, count)}` for each k (see `has_answer` for the matching rule).
    """
    if len(answers) != len(passages):
        raise ValueError(f"answers has {len(answers)} entries but passages has {len(passages)}")
    docs = len(passages[0]) if len(passages) else 0
    for row, texts in enumerate(passages):
        if isinstance(texts, str) or not hasattr(texts, "__len__") or len(texts) != docs:
            raise ValueError(f"passages[{row}] must be a list of N={docs} texts, got {texts!r:.80}")
        for n, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"passages[{row}][{n}] must be a string, got {type(text).__name__}")
    _check_ks(ks, docs)
    rows = _rows(mask, len(answers))
    first_hits = []  # rank of the first passage holding an answer; N when none does
    for row in rows:
        try:
            gold = _gold(answers[row])
        except (TypeError, ValueError) as e:
            raise type(e)(f"answers[{row}]: {e}") from None
        hits = (n for n, text in enumerate(passages[row]) if has_answer(gold, text))
        first_hits.append(next(hits, docs))
    first_hits = np.asarray(first_hits, np.int64)
    return {f"answer_recall@{k}": (float(np.sum(first_hits < k)), len(rows)) for k in ks}


def gold_recall(
    retrieved_ids, gold_ids: Sequence[Sequence], ks: Sequence[int], mask=None
) -> Metrics:
    """Gold-passage recall@k: the fraction of questions with a gold passage id in the top k.

    Only questions that have gold ids are scored and counted: NQ-open, for instance, has none,
    and then every count is 0 (the metric is undefined there, not zero).

    Args:
      retrieved_ids: [B, N] retrieved passage ids in rank order, best first; any comparable
        values (index rows as int64, or passage id strings) of the same kind as `gold_ids`.
      gold_ids: B lists of gold passage ids; an empty list leaves the question out.
      ks: the cut-offs, each in [1, N].
      mask: optional [B] bool; False rows (eval padding) are neither scored nor counted.

    Returns:
      `{f"gold_recall@{k}": (sum, count)}` for each k.
    """
    retrieved_ids = np.asarray(retrieved_ids)
    if retrieved_ids.ndim != 2 or retrieved_ids.shape[0] != len(gold_ids):
        raise ValueError(
            f"retrieved_ids must be [B, N] with B = len(gold_ids) = {len(gold_ids)}, got "
            f"{list(retrieved_ids.shape)}"
        )
    _check_ks(ks, retrieved_ids.shape[1])
    first_hits = []  # as in answer_recall, over the questions that have gold ids
    for row in _rows(mask, len(gold_ids)):
        if isinstance(gold_ids[row], (str, bytes)) or not isinstance(
            gold_ids[row], (Sequence, set, frozenset, np.ndarray)
        ):
            got = "the string " if isinstance(gold_ids[row], str) else ""
            raise TypeError(
                f"gold_ids[{row}] must be a list of ids, got {got}{gold_ids[row]!r:.80}"
            )
        gold = set(gold_ids[row])
        if gold:
            hits = (n for n, pid in enumerate(retrieved_ids[row].tolist()) if pid in gold)
            first_hits.append(next(hits, retrieved_ids.shape[1]))
    first_hits = np.asarray(first_hits, np.int64)
    return {f"gold_recall@{k}": (float(np.sum(first_hits < k)), len(first_hits)) for k in ks}


def merge_metrics(*metrics: Mapping[str, tuple[float, int]]) -> Metrics:
    """Adds (sum, count) pairs key by key; a key missing from some inputs counts as (0, 0)."""
    merged: Metrics = {}
    for batch in metrics:
        for name, (total, count) in batch.items():
            old_total, old_count = merged.get(name, (0.0, 0))
            merged[name] = (old_total + float(total), old_count + int(count))
    return merged


def reduce_metrics(metrics: Mapping[str, tuple[float, int]]) -> dict[str, float]:
    """Means `sum / count` for logging; keys with count 0 (nothing was scored) are left out."""
    return {name: total / count for name, (total, count) in metrics.items() if count}


def recall_ks(config) -> tuple[int, ...]:
    """`config.eval.recall_ks` as integers, ascending and distinct."""
    text = config.eval.recall_ks
    try:
        ks = sorted({int(k) for k in str(text).split(",") if k.strip()})
    except ValueError:
        raise ValueError(
            f"config.eval.recall_ks={text!r}: expected integers, e.g. '1,5,20'"
        ) from None
    if not ks or ks[0] < 1:
        raise ValueError(f"config.eval.recall_ks={text!r}: expected positive integers")
    return tuple(ks)
