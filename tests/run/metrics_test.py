"""Tests for rag_jax.run.metrics: SQuAD v1.1 EM/F1 against the official logic, retrieval
recall@k."""

import re
import string
from collections import Counter

import numpy as np
import pytest

from rag_jax.run import metrics

# ---------------------------------------------------------------------------------------------
# The official SQuAD v1.1 evaluation logic (evaluate-v1.1.py), written out plainly as the reference.


def ref_normalize(s):
    def remove_articles(text):
        return re.sub(r"\b(a|an|the)\b", " ", text)

    def white_space_fix(text):
        return " ".join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)

    def lower(text):
        return text.lower()

    return white_space_fix(remove_articles(remove_punc(lower(s))))


def ref_f1(prediction, ground_truth):
    prediction_tokens = ref_normalize(prediction).split()
    ground_truth_tokens = ref_normalize(ground_truth).split()
    common = Counter(prediction_tokens) & Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / len(prediction_tokens)
    recall = 1.0 * num_same / len(ground_truth_tokens)
    return (2 * precision * recall) / (precision + recall)


def ref_exact_match(prediction, ground_truth):
    return ref_normalize(prediction) == ref_normalize(ground_truth)


def ref_max_over_ground_truths(metric_fn, prediction, ground_truths):
    return max(metric_fn(prediction, ground_truth) for ground_truth in ground_truths)


def ref_has_answer(answers, text):
    """Token-window search: some answer's token list equals a contiguous run of the text's."""
    tokens = ref_normalize(text).split()
    for answer in answers:
        wanted = ref_normalize(answer).split()
        for start in range(len(tokens) - len(wanted) + 1):
            if wanted and tokens[start : start + len(wanted)] == wanted:
                return True
    return False


# ---------------------------------------------------------------------------------------------
# Crafted strings


STRINGS = [
    "",
    "   ",
    "The Denver Broncos",
    "denver broncos",
    "Denver  Broncos!!",
    "the the cat cat",
    "An apple a day",
    "A.B.C.",
    "a-team",
    "the_end",
    "Café au lait",
    "CAFÉ",
    "cafe",
    "théa",
    "l'a maison",
    "l’a maison",
    "ＡＢＣ，ｄｅｆ！",
    "abc，def！",
    "“Hello” — world…",
    "¿Qué? «Sí»",
    "東京 the タワー",
    "東京タワー",
    "日the",
    "the\u3000answer\xa0is\tA\n",
    "answer is",
    "Straße",
    "İstanbul",
    "Ο Παρθενώνας",
    "$1,000.50",
    "1000 50",
    "the",
    "?!",
]


@pytest.mark.parametrize("text", STRINGS)
def test_normalize_matches_official(text):
    assert metrics.normalize_answer(text) == ref_normalize(text)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The Eiffel Tower!", "eiffel tower"),
        ("  an   apple  ", "apple"),
        ("A.B.C.", "abc"),  # punctuation goes first, so no article is left behind
        ("a-team", "ateam"),
        ("the_end", "theend"),  # "_" is in string.punctuation
        ("Café au lait", "café au lait"),  # accents are kept
        ("théa", "théa"),  # no word boundary inside "théa"
        ("l'a", "la"),  # ASCII apostrophe deleted, the words merge
        ("l’a", "l’"),  # curly apostrophe kept: a non-word char, so "a" is a whole word
        (
            "ＡＢＣ，ｄｅｆ！",
            "ａｂｃ，ｄｅｆ！",
        ),  # full-width letters lower-cased, punctuation kept
        ("“Hello” — world…", "“hello” — world…"),
        ("¿Qué? «Sí»", "¿qué «sí»"),
        ("東京 the タワー", "東京 タワー"),
        ("日the", "日the"),  # CJK characters are word characters for \b
        ("the\u3000answer\xa0is\tA\n", "answer is"),  # Unicode whitespace splits
        ("Straße", "straße"),
        ("the", ""),
        ("?!", ""),
    ],
)
def test_normalize_by_hand(text, expected):
    assert metrics.normalize_answer(text) == expected


def test_string_punctuation_is_ascii_only():
    """What the official normalisation strips: exactly the 32 ASCII punctuation characters."""
    assert len(string.punctuation) == 32 and all(ord(c) < 128 for c in string.punctuation)
    kept = "，。！？、「」“”‘’—–…¿¡«»°€·"
    assert metrics.normalize_answer(kept) == kept
    assert metrics.normalize_answer(string.punctuation) == ""


ANSWER_SETS = [
    ["Denver Broncos"],
    ["Carolina Panthers", "Denver Broncos", "the Broncos"],
    ["cat"],
    ["café"],
    ["abc，def！"],
    ["東京タワー", "Tokyo Tower"],
    ["answer is"],
    ["1000 50", "$1,000.50"],
    ["The"],
]


def test_em_and_f1_match_official_on_all_pairs():
    for prediction in STRINGS:
        for answers in ANSWER_SETS:
            want_em = float(ref_max_over_ground_truths(ref_exact_match, prediction, answers))
            want_f1 = ref_max_over_ground_truths(ref_f1, prediction, answers)
            assert metrics.exact_match(prediction, answers) == want_em, (prediction, answers)
            assert metrics.f1(prediction, answers) == pytest.approx(want_f1, abs=1e-12, rel=0)


def test_em_and_f1_by_hand():
    assert metrics.exact_match("the Denver Broncos", ["Denver Broncos"]) == 1.0
    assert metrics.exact_match("Denver", ["Denver Broncos"]) == 0.0
    assert metrics.f1("Denver Broncos team", ["Denver Broncos"]) == pytest.approx(0.8)
    # The best of several answers: "Broncos" has P=1, R=1/2 against "Denver Broncos".
    assert metrics.f1("Broncos", ["Carolina Panthers", "Denver Broncos"]) == pytest.approx(2 / 3)
    # Bags of tokens: one shared "cat" of two predicted ones.
    assert metrics.f1("the the cat cat", ["cat"]) == pytest.approx(2 / 3)
    assert metrics.exact_match("ＡＢＣ", ["abc"]) == 0.0  # full-width letters are other letters
    assert metrics.exact_match("Café", ["CAFÉ"]) == 1.0
    assert metrics.exact_match("Cafe", ["Café"]) == 0.0


def test_empty_prediction():
    assert metrics.exact_match("", ["Paris"]) == 0.0
    assert metrics.f1("", ["Paris"]) == 0.0
    assert metrics.exact_match("  ", ["The"]) == 1.0  # both normalise to ""
    assert metrics.f1("  ", ["The"]) == 0.0  # v1.1: no tokens on either side scores 0


def test_empty_or_malformed_answers_raise():
    with pytest.raises(ValueError, match="at least one gold answer"):
        metrics.exact_match("Paris", [])
    with pytest.raises(ValueError, match="at least one gold answer"):
        metrics.f1("Paris", [])
    with pytest.raises(TypeError, match="sequence of strings"):
        metrics.exact_match("Paris", "Paris")  # a bare string would be scored letter by letter
    with pytest.raises(TypeError, match="must hold strings"):
        metrics.f1("Paris", [None])
    with pytest.raises(ValueError, match=r"answers\[1\]: .*at least one"):
        metrics.qa_metrics(["a", "b"], [["a"], []])


def test_qa_metrics_sums_counts_and_mask():
    predictions = ["Denver Broncos", "Broncos", "nothing", "padding"]
    answers = [["denver broncos"], ["Denver Broncos"], ["Paris"], ["padding"]]
    out = metrics.qa_metrics(predictions, answers)
    assert out["exact_match"] == (2.0, 4)
    assert out["f1"][1] == 4 and out["f1"][0] == pytest.approx(1 + 2 / 3 + 0 + 1)
    masked = metrics.qa_metrics(predictions, answers, mask=np.array([1, 1, 1, 0], bool))
    assert masked["exact_match"] == (1.0, 3)
    assert masked["f1"][0] == pytest.approx(1 + 2 / 3)
    with pytest.raises(ValueError, match="mask must be bool"):
        metrics.qa_metrics(predictions, answers, mask=np.ones(3, bool))
    with pytest.raises(ValueError, match="4 entries but answers has 3"):
        metrics.qa_metrics(predictions, answers[:3])


def test_merge_and_reduce():
    a = metrics.qa_metrics(["x", "y"], [["x"], ["z"]])
    b = metrics.qa_metrics(["z"], [["z"]])
    merged = metrics.merge_metrics(a, b, {"gold_recall@1": (0.0, 0)})
    assert merged["exact_match"] == (2.0, 3)
    reduced = metrics.reduce_metrics(merged)
    assert reduced["exact_match"] == pytest.approx(2 / 3)
    assert "gold_recall@1" not in reduced  # nothing was scored


# ---------------------------------------------------------------------------------------------
# Retrieval


PASSAGES = [
    "He ran to the start line.",
    "She lives in New York City, near the Hudson.",
    "The U.S. Army was founded in 1775.",
    "Denver-Broncos fans cheered.",
    "東京 タワー is in Minato.",
    "Nothing here at all.",
]


@pytest.mark.parametrize("passage", PASSAGES)
@pytest.mark.parametrize(
    "answers",
    [
        ["art"],
        ["start line"],
        ["New York"],
        ["us army", "Boston"],
        ["Denver Broncos"],
        ["the"],
        ["東京 タワー"],
        ["タワー"],
        ["York City near"],
    ],
)
def test_has_answer_matches_token_window_reference(answers, passage):
    assert metrics.has_answer(answers, passage) == ref_has_answer(answers, passage)


def test_has_answer_by_hand():
    assert not metrics.has_answer(["art"], "He ran to the start line.")  # whole words only
    assert metrics.has_answer(["new york"], "She lives in New York City.")
    assert metrics.has_answer(["US army"], "The U.S. Army was founded")  # punctuation deleted
    assert not metrics.has_answer(["Denver Broncos"], "Denver-Broncos fans")  # "denverbroncos"
    assert not metrics.has_answer(["The"], "the the the")  # normalises to nothing
    with pytest.raises(ValueError, match="at least one"):
        metrics.has_answer([], "text")


def test_answer_recall_against_brute_force():
    answers = [["New York"], ["1775"], ["Minato"], ["absent"]]
    # [B=4, N=5] texts; first hits at ranks 1, 0, 4 and none.
    passages = [
        [PASSAGES[0], PASSAGES[1], PASSAGES[2], PASSAGES[3], PASSAGES[4]],
        [PASSAGES[2], PASSAGES[1], PASSAGES[0], PASSAGES[5], PASSAGES[5]],
        [PASSAGES[5], PASSAGES[0], PASSAGES[1], PASSAGES[2], PASSAGES[4]],
        PASSAGES[:5],
    ]
    ks = (1, 2, 5)
    out = metrics.answer_recall(answers, passages, ks)
    for k in ks:
        want = sum(any(ref_has_answer(a, t) for t in p[:k]) for a, p in zip(answers, passages))
        assert out[f"answer_recall@{k}"] == (float(want), 4)
    assert out == {
        "answer_recall@1": (1.0, 4),
        "answer_recall@2": (2.0, 4),
        "answer_recall@5": (3.0, 4),
    }
    masked = metrics.answer_recall(answers, passages, (5,), mask=np.array([1, 0, 1, 1], bool))
    assert masked == {"answer_recall@5": (2.0, 3)}


def test_answer_recall_bad_input():
    with pytest.raises(ValueError, match=r"k=6 is out of range.*\[1, 5\]"):
        metrics.answer_recall([["a"]], [PASSAGES[:5]], (6,))
    with pytest.raises(ValueError, match=r"k=0"):
        metrics.answer_recall([["a"]], [PASSAGES[:5]], (0,))
    with pytest.raises(ValueError, match=r"passages\[1\] must be a list of N=5"):
        metrics.answer_recall([["a"], ["b"]], [PASSAGES[:5], PASSAGES[:4]], (1,))
    with pytest.raises(ValueError, match=r"answers\[0\]: .*at least one"):
        metrics.answer_recall([[]], [PASSAGES[:5]], (1,))


def test_gold_recall():
    # [B=4, N=3] int64 index rows; question 2 has no gold ids and is not counted.
    ids = np.array([[7, 3, 9], [4, 5, 6], [1, 2, 3], [8, 0, 2]], np.int64)
    gold = [[3], [6, 40], [], [11]]
    out = metrics.gold_recall(ids, gold, (1, 2, 3))
    assert out == {"gold_recall@1": (0.0, 3), "gold_recall@2": (1.0, 3), "gold_recall@3": (2.0, 3)}
    masked = metrics.gold_recall(ids, gold, (3,), mask=np.array([0, 1, 1, 1], bool))
    assert masked == {"gold_recall@3": (1.0, 2)}
    # String passage ids, as `Example.gold_ids` holds them.
    str_ids = [["Super_Bowl_50_0", "Paris_3"], ["Paris_1", "Paris_2"]]
    assert metrics.gold_recall(str_ids, [["Paris_3"], ["Paris_1"]], (1,)) == {
        "gold_recall@1": (1.0, 2)
    }
    # No gold ids anywhere: nothing is counted (undefined, not zero).
    assert metrics.gold_recall(ids, [[]] * 4, (1,)) == {"gold_recall@1": (0.0, 0)}


def test_gold_recall_bad_input():
    ids = np.zeros((2, 3), np.int64)
    with pytest.raises(ValueError, match=r"\[B, N\] with B = len\(gold_ids\) = 3, got \[2, 3\]"):
        metrics.gold_recall(ids, [[1], [2], [3]], (1,))
    with pytest.raises(ValueError, match="k=4 is out of range"):
        metrics.gold_recall(ids, [[1], [2]], (4,))
    with pytest.raises(TypeError, match="the string 'Paris_1'"):
        metrics.gold_recall([["a", "b", "c"]], ["Paris_1"], (1,))
