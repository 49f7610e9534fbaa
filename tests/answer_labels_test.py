"""Answer labels (`inputs.answer_labels`): an answer cut to fit T gets no EOS, for BART as for a
causal generator, so a long answer never teaches the generator to stop early."""

import numpy as np
import pytest
import transformers

from rag_jax import rag
from rag_jax.model_inputs import answer_labels
from rag_jax.models import bart, bert, llama

WORDS = ["one", "two", "three", "four", "five", "six", "seven"]
PAD, BOS, EOS, START = 1, 0, 2, 2  # BART's ids; the words are 5..11


@pytest.fixture(scope="module")
def tokenizer():
    vocab = ["<s>", "<pad>", "</s>", "[UNK]", "[MASK]", *WORDS]
    return transformers.BertTokenizer(vocab={w: i for i, w in enumerate(vocab)})


def _cfg(generator):
    return rag.RagConfig(question_encoder=bert.BertConfig(), generator=generator, bos_token_id=BOS)


def _words(n: int) -> str:
    return " ".join(WORDS[:n])


def test_a_bart_answer_that_does_not_fit_keeps_its_first_tokens_and_no_eos(tokenizer):
    cfg = _cfg(bart.BartConfig(pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS))
    T = 6  # decoder start, BOS and 4 more
    labels = answer_labels(tokenizer, [_words(2), _words(3), _words(4), _words(7)], cfg, T)
    ids = lambda n: list(range(5, 5 + n))  # noqa: E731
    np.testing.assert_array_equal(
        labels,
        [
            [START, BOS, *ids(2), EOS, PAD],
            [START, BOS, *ids(3), EOS],  # fits exactly, EOS included
            [START, BOS, *ids(4)],  # its EOS does not fit: cut, no EOS
            [START, BOS, *ids(4)],  # a long answer: its first T - 2 tokens, no EOS
        ],
    )
    assert labels.dtype == np.int32 and labels.shape == (4, T)


def test_a_causal_answer_that_does_not_fit_keeps_its_first_tokens_and_no_eos(tokenizer):
    generator = llama.LlamaConfig(vocab_size=12, pad_token_id=PAD, eos_token_id=EOS)
    cfg = _cfg(generator).replace(bos_token_id=None)
    labels = answer_labels(tokenizer, [_words(2), _words(4), _words(7)], cfg, 4)
    np.testing.assert_array_equal(labels, [[5, 6, EOS, PAD], [5, 6, 7, 8], [5, 6, 7, 8]])
