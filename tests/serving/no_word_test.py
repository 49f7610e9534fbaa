"""Text with a visible character but no word for the bundle's tokenizers (a combining accent, a
private-use or the replacement character alone: nothing, or `[UNK]`) is refused 422 naming the
field, before it is batched or written: it was answered 200 from nothing. A title is refused
only when read as nothing (or special tokens alone). Through a real server
(in this process, over the tiny run's bundle, nothing compiled: no answer is asked)."""

import shutil

import httpx
import pytest
from hostile_server_test import InProcess

from rag_jax.io import bundle
from rag_jax.serving import app as serving

# Words of the tiny run's vocabulary (225 tokens): one of its passages'.
WORDS = "the childhood home of tune tunisa stood in selby near the old mill ."
# Read as nothing (or special tokens alone) by the tiny run's tokenizer ...
NOTHING = ["\u0301", "\ue000", "\ufffd", "\u0301\ue000 \ufffd", "[SEP]"]
# ... and as the unknown token alone: no word for a question or a text, a title's label kept.
UNKNOWN_ONLY = ["[UNK]", "\xe9"]


@pytest.fixture(scope="module")
def server(tiny_trained_run, tmp_path_factory):
    """A server with edits over a copy of the tiny run's bundle, ready at once."""
    directory = tmp_path_factory.mktemp("no_word") / "bundle"
    shutil.copytree(tiny_trained_run[0] / "bundle", directory)
    config = serving.ServerConfig(str(directory), allow_edits=True)
    made = InProcess(bundle.load(directory), config, warm_up=False)
    made.wait_ready(60)
    yield made
    made.stop()


def _refused(response, *parts: str) -> str:
    assert response.status_code == 422, response.text
    message = response.json()["error"]["message"]
    for part in parts:
        assert part in message, message
    return message


@pytest.mark.parametrize("text", NOTHING + UNKNOWN_ONLY, ids=ascii)
def test_a_question_with_no_word_is_refused_naming_it_before_it_is_batched(server, text):
    before = httpx.get(f"{server.url}/v1/metrics").json()["batches"]["count"]
    body = {"questions": [WORDS, text]}
    response = httpx.post(f"{server.url}/v1/answer", json=body, timeout=60)
    message = _refused(response, "questions[1]: expected a question with a word in it")
    assert "the question encoder's tokenizer reads" in message
    assert httpx.get(f"{server.url}/v1/metrics").json()["batches"]["count"] == before


@pytest.mark.parametrize("text", NOTHING + UNKNOWN_ONLY, ids=ascii)
def test_a_passage_text_or_title_with_no_word_is_refused_naming_it_and_not_written(server, text):
    url = f"{server.url}/v1/passages/wordless"
    response = httpx.put(url, json={"text": text}, timeout=60)
    _refused(response, "upserts[0].text (id 'wordless'): expected a text with a word in it")
    if text in NOTHING:
        response = httpx.put(url, json={"text": WORDS, "title": text}, timeout=60)
        _refused(response, "upserts[0].title (id 'wordless'): expected a title with a word")
    assert httpx.get(url).status_code == 404  # nothing was written


def test_words_among_unknown_characters_are_answered_and_written(server):
    """A text holding a word is taken, whatever else it holds; a new text keeps its title."""
    url = f"{server.url}/v1/passages/worded"
    put = httpx.put(url, json={"text": f"\ue000 {WORDS} \u0301", "title": "Added"}, timeout=60)
    assert put.status_code == 201, put.text  # a title of words the vocabulary lacks: kept
    put = httpx.put(url, json={"text": WORDS}, timeout=60)
    assert put.status_code == 200 and put.json()["passage"]["title"] == "Added", put.text
    assert server.state.model.check_questions([f"\ufffd {WORDS}"]) is None
