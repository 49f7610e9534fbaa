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
