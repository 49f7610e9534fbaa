r"""SQuAD v1.1's official JSON -> the paragraphs and questions files the SQuAD configs read.

    python experiments/squad_jsonl.py --squad train-v1.1.json --out data/squad11_train
    python experiments/squad_jsonl.py --squad dev-v1.1.json --out data/squad11_dev

SQuAD v1.1 (Rajpurkar et al. 2016, CC BY-SA 4.0) is published as `train-v1.1.json` and
`dev-v1.1.json` on the SQuAD explorer site. Writes, in `--out`:

- `passages.jsonl`: one paragraph a line, `{"id": "<Title>_<paragraph index>", "title": "<Title
  with spaces>", "text": "<context>"}` (the retrieval corpus: `--config.data.corpus_path`,
  `--config.warm_start.reader_corpus_path`);
- `questions.jsonl`: one question a line, `{"id", "question", "answers": [distinct answer
  strings, in order], "gold_passage_id"}` (`--config.data.train_path` / `eval_path`,
  `--config.warm_start.reader_questions_path`).

Both files are written whole or not at all (atomic renames). A record missing a field, or an
answer that is not in its paragraph, is refused naming the file and where in it.
"""

import argparse
import json
import pathlib

from rag_jax.retrieval import files


def flatten(squad: dict, source: str) -> tuple[list[dict], list[dict]]:
    """(passages, questions) of an official SQuAD v1.1 JSON document (see the module docstring).

    Raises:
      ValueError: naming `source` and the record's place (`data[3].paragraphs[7].qas[2]`).
    """

    def field(record, key, where):
        if not isinstance(record, dict) or key not in record:
            raise ValueError(f"{source}: {where} has no {key!r}; is it SQuAD v1.1's JSON?")
        return record[key]

    passages, questions = [], []
    for a, article in enumerate(field(squad, "data", "the document")):
        where = f"data[{a}]"
        title = field(article, "title", where)
        for p, paragraph in enumerate(field(article, "paragraphs", where)):
            at = f"{where}.paragraphs[{p}]"
            context = field(paragraph, "context", at)
            passage_id = f"{title}_{p}"
            passages.append({"id": passage_id, "title": title.replace("_", " "), "text": context})
            for q, qa in enumerate(field(paragraph, "qas", at)):
                qat = f"{at}.qas[{q}]"
                answers = []
                for n, answer in enumerate(field(qa, "answers", qat)):
                    text = field(answer, "text", f"{qat}.answers[{n}]")
                    if text not in context:
                        raise ValueError(
                            f"{source}: {qat}.answers[{n}] {text!r} is not in its paragraph"
                        )
                    if text not in answers:
                        answers.append(text)
                if not answers:
                    raise ValueError(f"{source}: {qat} has no answer")
                questions.append(
                    {
                        "id": field(qa, "id", qat),
                        "question": field(qa, "question", qat),
                        "answers": answers,
                        "gold_passage_id": passage_id,
                    }
                )
    return passages, questions


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--squad", required=True, help="train-v1.1.json or dev-v1.1.json")
    parser.add_argument("--out", required=True, help="folder for passages.jsonl, questions.jsonl")
    args = parser.parse_args(argv)
    source = pathlib.Path(args.squad)
    try:
        document = json.loads(source.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise SystemExit(f"error: {source} is not JSON: {e}") from None
    try:
        passages, questions = flatten(document, str(source))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("passages.jsonl", passages), ("questions.jsonl", questions)):
        text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        files.write_atomic(out / name, text.encode("utf-8"))
    print(f"{len(passages)} paragraphs, {len(questions)} questions -> {out}")


if __name__ == "__main__":
    main()
