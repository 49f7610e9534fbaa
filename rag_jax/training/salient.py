"""Salient-span examples for reader pretraining, from passages alone (no QA pairs).

REALM (Guu et al. 2020, section 3.4) masks salient spans, named entities and dates, so that
filling them in needs world knowledge rather than local syntax. Here the span is masked in one
sentence of a passage, the masked sentence is the question, the passage (which still holds the
sentence) is the context and the span is the answer: the generator learns to find the sentence the
question paraphrases and copy what fills the gap, which is the reading a QA generator needs.

Spans are found by rule, without a tagger: dates ("12 May 2008", "May 12, 2008", "May 2008"),
numbers ("69,197", "8.0", "40 percent", "3 million") and capitalised names of one to four words
that do not open the sentence ("Gustave Eiffel", "the Great Sichuan earthquake" -> "Great Sichuan").
Each qualifying sentence of a passage gives one example; which of its spans is masked is drawn
from `(seed, passage index, sentence index)`, so the examples are a pure function of the passages.
"""

import re
from collections.abc import Sequence

import numpy as np

from rag_jax.retrieval.corpus import Passage
from rag_jax.run.data import Example

_MONTH = (
    r"(?:January|February|March|April|May|June|July|August|September|October|November|December)"
)
_DATE = (
    rf"\b(?:\d{{1,2}} {_MONTH}(?:,? \d{{3,4}})?|{_MONTH} \d{{1,2}}(?:st|nd|rd|th)?(?:, \d{{3,4}})?"
    rf"|{_MONTH} \d{{4}})\b"
)
_NUMBER = (
    r"(?<![\w.,])\d+(?:,\d{3})*(?:\.\d+)?(?:\s?(?:%|percent|million|billion|thousand|km|kilometres|"
    r"kilometers|miles|metres|meters|feet|years|people))?(?![\w])"
)
_WORD = r"[A-Z][a-z]+(?:-[A-Z]?[a-z]+)*"
_NAME = rf"(?<![\w-]){_WORD}(?: (?:of |de |von |van |du |the )?{_WORD}){{0,3}}(?![\w-])"
_SALIENT = re.compile(rf"{_DATE}|{_NUMBER}|{_NAME}")
# A sentence ends at . ! or ? followed by a space and a capital letter, a digit or a quote.
_SENTENCE_END = re.compile(
    r"(?<=[.!?])(?<!\bSt\.)(?<!\bMr\.)(?<!\bDr\.)(?<!\bc\.)(?<!\b[A-Z]\.)\s+(?=[A-Z0-9\"'])"
)
MIN_SENTENCE_WORDS = 6
MASK = "[MASK]"


def sentences(text: str) -> list[tuple[int, str]]:
    """(start offset, sentence) of each sentence of `text`."""
    out, start = [], 0
    for match in _SENTENCE_END.finditer(text):
        out.append((start, text[start : match.start()]))
        start = match.end()
    out.append((start, text[start:]))
    return [(s, t) for s, t in out if t.strip()]


def spans(sentence: str) -> list[tuple[int, int]]:
    """(start, end) of the salient spans of `sentence`; a name opening the sentence is left out
    (its capital may only mark the sentence's start)."""
    found, pos, opening = [], 0, None
    while (match := _SALIENT.search(sentence, pos)) is not None:
        start, end = match.span()
        text = match.group()
        digits = any(c.isdigit() for c in text)
        if start == 0 and not digits:  # capitalised words opening the sentence: "On May 5, .."
            opening = match  # or a name ("Emmett Price, a professor"); look after the first word
            pos = len(text.split(" ")[0])
            continue
        if opening is not None and start == pos + 1 and not digits:
            pos, opening = opening.end(), None  # the opening words were one name: skip it all
            continue
        opening, pos = None, end
        if len(text) >= 2 and end - start < len(sentence) - 1:
            found.append((start, end))
    return found


def salient_examples(
    passages: Sequence[Passage],
    *,
    seed: int,
    mask_token: str = MASK,
    max_chars: int = 0,
) -> list[Example]:
    """One masked-span example per qualifying sentence of each passage (see the module doc).

    Args:
      passages: the corpus the generator learns to read.
      seed: which span of a sentence is masked is drawn from `(seed, passage, sentence)`.
      mask_token: what replaces the span in the question (the tokenizer's mask token).
      max_chars: only sentences ending within the passage's first `max_chars` characters (those
        a truncated context still shows); 0 = all.

    Returns:
      Examples with id `<passage id>:ssm<sentence>`, the masked sentence as question, the span as
      the one answer and the passage as the gold passage, in passage then sentence order.
    """
    out = []
    for p, passage in enumerate(passages):
        for s, (offset, sentence) in enumerate(sentences(passage.text)):
            if max_chars and offset + len(sentence) > max_chars:
                break
            if len(sentence.split()) < MIN_SENTENCE_WORDS:
                continue
            found = spans(sentence)
            if not found:
                continue
            rng = np.random.default_rng((seed, p, s))
            start, end = found[int(rng.integers(len(found)))]
            question = f"{sentence[:start]}{mask_token}{sentence[end:]}"
            out.append(
                Example(question, (sentence[start:end],), f"{passage.id}:ssm{s}", (passage.id,))
            )
    return out


# ---------------------------------------------------------------------------------------------
# Hot swap on real text: answers changed inside their gold passages

_KINDS = {
    "year": re.compile(r"1\d{3}|20\d{2}"),
    "date": re.compile(_DATE),
    "number": re.compile(_NUMBER),
    "name": re.compile(_NAME),
}


def span_kind(text: str) -> str | None:
    """The kind of salient span the whole of `text` is: "year", "date", "number" or "name" (a
    year is replaced by a year, not by any number), or None."""
    for kind, pattern in _KINDS.items():
        if pattern.fullmatch(text):
            return kind
    return None


def edit_answers(
    passages: Sequence[Passage], examples: Sequence[Example], count: int, seed: int
) -> tuple[list[Passage], list[Example], list[Example]]:
    """Changes the answer of `count` questions inside their gold passages (the hot-swap test).

    A question qualifies when its first answer is one salient span (a year, a date, a number or a
    name, `span_kind`) that occurs exactly once in its gold passage, and no other chosen question
    shares that passage. The answer is replaced by the answer of another qualifying question of
    the same kind that the passage does not contain, so the edit reads as naturally as the
    original.

    Args:
      passages: the corpus.
      examples: the questions to choose from (`gold_ids[0]` names each one's passage).
      count: how many to edit (fewer qualify: all of them).
      seed: which questions, and which replacements.

    Returns:
      (the corpus with the edited passages in place, the edited questions with their new answer
      as the only one, the same questions with their original answers), in the order chosen.
    """
    by_id = {p.id: p for p in passages}
    candidates = []
    for e in examples:
        passage = by_id.get(e.gold_ids[0]) if e.gold_ids else None
        answer = e.answers[0]
        kind = span_kind(answer)
        if passage is not None and kind and passage.text.count(answer) == 1:
            candidates.append((e, kind))
    rng = np.random.default_rng((seed, 7))
    order = rng.permutation(len(candidates))
    pools: dict[str, list[str]] = {}
    for e, kind in candidates:
        pools.setdefault(kind, []).append(e.answers[0])
    edited, new, old, used = dict(by_id), [], [], set()
    for j in order.tolist():
        if len(new) == count:
            break
        e, kind = candidates[j]
        pid = e.gold_ids[0]
        if pid in used:
            continue
        text = by_id[pid].text
        others = sorted({a for a in pools[kind] if a not in text and a != e.answers[0]})
        if not others:
            continue
        replacement = others[int(rng.integers(len(others)))]
        edited[pid] = Passage(pid, by_id[pid].title, text.replace(e.answers[0], replacement))
        used.add(pid)
        new.append(Example(e.question, (replacement,), e.id, e.gold_ids))
        old.append(e)
    return [edited[p.id] for p in passages], new, old
