"""experiments/squad_jsonl.py: SQuAD v1.1's official JSON -> the files the SQuAD configs read,
run as a user runs it, and read back by the project's own readers."""

import json
import pathlib
import re
import subprocess
import sys

import pytest

from rag_jax.retrieval.corpus import read_passages
from rag_jax.run import data

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "squad_jsonl.py"

# The official layout: data[].title / paragraphs[].context / qas[].{id, question, answers[].text}.
OFFICIAL = {
    "version": "1.1",
    "data": [
        {
            "title": "Super_Bowl_50",
            "paragraphs": [
                {
                    "context": "Super Bowl 50 was won by the Denver Broncos in Santa Clara.",
                    "qas": [
                        {
                            "id": "q1",
                            "question": "Who won Super Bowl 50?",
                            "answers": [
                                {"answer_start": 29, "text": "Denver Broncos"},
                                {"answer_start": 29, "text": "Denver Broncos"},
                                {"answer_start": 25, "text": "the Denver Broncos"},
                            ],
                        }
                    ],
                },
                {
                    "context": "The game was played on February 7, 2016.",
                    "qas": [
                        {
                            "id": "q2",
                            "question": "When was the game played?",
                            "answers": [{"answer_start": 23, "text": "February 7, 2016"}],
                        }
                    ],
                },
            ],
        },
        {
            "title": "Warsaw",
            "paragraphs": [
                {
                    "context": "Warsaw is the capital of Poland.",
                    "qas": [
                        {
                            "id": "q3",
                            "question": "What is the capital of Poland?",
                            "answers": [{"answer_start": 0, "text": "Warsaw"}],
                        }
                    ],
                }
            ],
        },
    ],
}


def _convert(tmp_path, document) -> subprocess.CompletedProcess:
    source = tmp_path / "squad.json"
    source.write_text(json.dumps(document))
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--squad", str(source), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


def test_official_json_becomes_the_files_the_configs_read(tmp_path):
    done = _convert(tmp_path, OFFICIAL)
    assert done.returncode == 0, done.stderr
    assert "3 paragraphs, 3 questions" in done.stdout
    passages = list(read_passages(tmp_path / "out" / "passages.jsonl"))
    assert [(p.id, p.title) for p in passages] == [
        ("Super_Bowl_50_0", "Super Bowl 50"),
        ("Super_Bowl_50_1", "Super Bowl 50"),
        ("Warsaw_0", "Warsaw"),
    ]
    assert passages[2].text == "Warsaw is the capital of Poland."
    # Read as the SQuAD configs read them (squad_open.py's data.fields).
    examples = data.read_jsonl(
        tmp_path / "out" / "questions.jsonl", {"gold_ids": "gold_passage_id"}
    )
    assert [e.question for e in examples] == [
        "Who won Super Bowl 50?",
        "When was the game played?",
        "What is the capital of Poland?",
    ]
    assert examples[0].answers == ("Denver Broncos", "the Denver Broncos")  # distinct, in order
    assert [e.gold_ids for e in examples] == [
        ("Super_Bowl_50_0",),
        ("Super_Bowl_50_1",),
        ("Warsaw_0",),
    ]


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: d.pop("data"), r"the document has no 'data'"),
        (
            lambda d: d["data"][1]["paragraphs"][0]["qas"][0].pop("question"),
            r"data\[1\]\.paragraphs\[0\]\.qas\[0\] has no 'question'",
        ),
        (
            lambda d: d["data"][0]["paragraphs"][1]["qas"][0]["answers"][0].update(text="1999"),
            r"data\[0\]\.paragraphs\[1\]\.qas\[0\]\.answers\[0\] '1999' is not in its paragraph",
        ),
    ],
)
def test_a_malformed_record_is_refused_naming_the_file_and_place(tmp_path, damage, message):
    document = json.loads(json.dumps(OFFICIAL))
    damage(document)
    done = _convert(tmp_path, document)
    assert done.returncode != 0
    assert "squad.json" in done.stderr
    assert re.search(message, done.stderr), done.stderr
    assert not (tmp_path / "out" / "questions.jsonl").exists()  # nothing half written
