"""Salient-span examples (REALM's salient span masking) from passages alone."""

import pytest

from rag_jax.retrieval.corpus import Passage
from rag_jax.training import salient


def _spans(sentence):
    return [sentence[a:b] for a, b in salient.spans(sentence)]


@pytest.mark.parametrize(
    "sentence, want",
    [
        (
            "On February 5, 2010, the party registered 69,197 logos with Gustave Eiffel of Paris.",
            ["February 5, 2010", "69,197", "Gustave Eiffel of Paris"],
        ),
        # A capitalised word opening the sentence is not a name; a whole opening name is skipped.
        ("Emmett Price, a professor at Northeastern University, wrote in 2007.", [
            "Northeastern University", "2007"]),
        ("The tower is 324 metres tall and 40 percent of it is iron.", [
            "324 metres", "40 percent"]),
        ("It happened in 12 May 2008 and again in May 2009.", ["12 May 2008", "May 2009"]),
        ("nothing salient here at all.", []),
    ],
)  # fmt: skip
def test_spans_are_dates_numbers_and_names(sentence, want):
    assert _spans(sentence) == want


def test_sentences_keep_offsets_and_do_not_split_abbreviations():
    text = "He met St. John in c. 1200. Then he left! Mr. X came."
    got = salient.sentences(text)
    assert [s for _, s in got] == ["He met St. John in c. 1200.", "Then he left!", "Mr. X came."]
    assert all(text[offset : offset + len(s)] == s for offset, s in got)


def test_examples_mask_one_span_per_sentence_deterministically():
    passages = [
        Passage(
            "p0",
            "Eiffel Tower",
            "The tower was built by Gustave Eiffel for the 1889 World's Fair in Paris. "
            "It is 330 metres tall today. Short one. It was the tallest structure until 1930.",
        ),
        Passage("p1", "Empty", "no spans in this lower case sentence of many words."),
    ]
    examples = salient.salient_examples(passages, seed=0, mask_token="[MASK]")
    assert [e.id for e in examples] == ["p0:ssm0", "p0:ssm1", "p0:ssm3"]  # "Short one." too short
    for e in examples:
        assert e.gold_ids == ("p0",) and len(e.answers) == 1
        assert e.question.count("[MASK]") == 1
        # Filling the mask with the answer gives back the passage's sentence.
        assert e.question.replace("[MASK]", e.answers[0]) in passages[0].text
    assert salient.salient_examples(passages, seed=0, mask_token="[MASK]") == examples
    seeds = {
        tuple(e.answers[0] for e in salient.salient_examples(passages, seed=s)) for s in range(8)
    }
    assert len(seeds) > 1  # another seed masks other spans
    # Only sentences a truncated context still shows.
    short = salient.salient_examples(passages, seed=0, max_chars=80)
    assert [e.id for e in short] == ["p0:ssm0"]


def test_edit_answers_changes_one_span_of_the_same_kind_in_each_gold_passage():
    from rag_jax.run.data import Example

    passages = [
        Passage("a", "A", "The bridge opened in 1932 and cost 12 million dollars."),
        Passage("b", "B", "The mayor Anna Berg opened the library in 1901."),
        Passage("c", "C", "In 1950 Carl Nilsson painted the hall."),
        Passage("d", "D", "It rained on 3 May 1999 and on 3 May 1999 again."),  # twice: not chosen
    ]
    examples = [
        Example("When did the bridge open?", ("1932",), "qa", ("a",)),
        Example("Who opened the library?", ("Anna Berg",), "qb", ("b",)),
        Example("When was the hall painted?", ("1950",), "qc", ("c",)),
        Example("Who painted the hall?", ("Carl Nilsson",), "qc2", ("c",)),
        Example("When did it rain?", ("3 May 1999",), "qd", ("d",)),
        Example("What did it cost?", ("a lot",), "qe", ("a",)),  # not a salient span
    ]
    corpus, new, old = salient.edit_answers(passages, examples, count=10, seed=0)
    assert [p.id for p in corpus] == ["a", "b", "c", "d"] and corpus[3] == passages[3]
    chosen = {e.id for e in new}
    assert chosen <= {"qa", "qb", "qc", "qc2"} and not {"qc", "qc2"} <= chosen  # one per passage
    by_id = {p.id: p for p in corpus}
    for e_new, e_old in zip(new, old):
        assert e_new.id == e_old.id and e_new.question == e_old.question
        text = by_id[e_new.gold_ids[0]].text
        assert e_new.answers[0] in text and e_old.answers[0] not in text
        assert salient.span_kind(e_new.answers[0]) == salient.span_kind(e_old.answers[0])
    assert salient.edit_answers(passages, examples, count=10, seed=0) == (corpus, new, old)
    assert len(salient.edit_answers(passages, examples, count=1, seed=0)[1]) == 1
    assert salient.span_kind("3 May 1999") == "date" and salient.span_kind("a lot") is None
    assert salient.span_kind("1932") == "year" and salient.span_kind("12 million") == "number"
