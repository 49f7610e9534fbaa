"""Small real-text data for tests: the questions and paragraphs of a few SQuAD articles."""

import itertools
import json


def squad_subset(shared_data, directory, articles: int = 3, per_passage: int = 2):
    """The questions (at most `per_passage` a paragraph) and paragraphs of the first `articles`
    articles of SQuAD dev, as `questions.jsonl` and `passages.jsonl` in `directory`.

    Returns:
      (questions path, passages path, {passage id: title}).
    """
    squad = shared_data / "squad11_dev"
    passages = [json.loads(line) for line in open(squad / "passages.jsonl", encoding="utf-8")]
    keep = list(dict.fromkeys(p["title"] for p in passages))[:articles]
    corpus = [p for p in passages if p["title"] in keep]
    ids = {p["id"] for p in corpus}
    with open(squad / "questions.jsonl", encoding="utf-8") as f:
        questions = [q for q in map(json.loads, f) if q["gold_passage_id"] in ids]
    # A few questions per paragraph keep it small while every article stays represented.
    grouped = itertools.groupby(questions, key=lambda q: q["gold_passage_id"])
    questions = [q for _, group in grouped for q in itertools.islice(group, per_passage)]
    for name, rows in (("questions.jsonl", questions), ("passages.jsonl", corpus)):
        (directory / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return (
        directory / "questions.jsonl",
        directory / "passages.jsonl",
        {p["id"]: p["title"] for p in corpus},
    )
