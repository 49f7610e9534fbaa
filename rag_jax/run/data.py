"""QA examples from files and TFDS, and deterministic batching by `(seed, step)`.

Legend: B batch (global), C number of examples in a split.

Every reader returns a list of `Example` records in a fixed order. A malformed record is a
`ValueError` naming the file and 1-based line (or the TFDS dataset, split and record index) and
the field; nothing is skipped, and an empty file or split is an error too.

TFDS benchmarks are read with `tfds.data_source` from the `array_record` file format, which needs
neither TensorFlow nor network access. Preparing the data is a separate, one-off step on any
machine with internet access and TensorFlow (`pip install tensorflow tensorflow-datasets`; the
TriviaQA builder, for one, generates through `tf.io.gfile`):

    tfds build natural_questions_open --file_format=array_record --data_dir=$TFDS_DIR
    tfds build trivia_qa/unfiltered.nocontext --file_format=array_record --data_dir=$TFDS_DIR
    tfds build web_questions --file_format=array_record --data_dir=$TFDS_DIR

Then copy `$TFDS_DIR` to the training hosts and pass it as `data_dir` (or set `TFDS_DATA_DIR`).

Batches are pure functions of `(seed, step)` (`batch_indices`), so resuming from a checkpointed
step needs no iterator state; eval batches are padded and masked, never dropped (`eval_batches`).
"""

import ast
import csv
import dataclasses
import functools
import json
import pathlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from rag_jax.retrieval.corpus import SURROGATE_ERROR, has_surrogate, json_objects, text_lines

FIELDS = ("question", "answers", "id", "gold_ids")
# Field mappings for the two QA files in `../shared/data` (see their READMEs).
NQ_OPEN_FIELDS = {"answers": "answer"}
SQUAD_OPEN_FIELDS = {"gold_ids": "gold_passage_id"}
# Supported TFDS builders and the config read when the name gives none.
TFDS_DATASETS = {
    "natural_questions_open": None,
    "trivia_qa": "unfiltered.nocontext",
    "web_questions": None,
}
TARGET_MODES = ("first", "sample")

_MISSING = object()
# Undecodable bytes become lone surrogates under errors="surrogateescape"; valid UTF-8 never
# decodes to one, so finding one pins a bad line without losing the line count.


@dataclasses.dataclass(frozen=True)
class Split:
    """Which questions of a file to read by the value of a field of each line.

    Attributes:
      field: the file's key holding each question's split (COVID-QA's `split`).
      keep: the value whose questions are read; "" reads every question (each still checked).
      known: every value the field may take; a line with another one is refused, naming it.
    """

    field: str
    keep: str
    known: tuple[str, ...]

    def __post_init__(self):
        if not self.field or not self.known or "" in self.known:
            raise ValueError(f"Split: a field and non-empty split names, got {self}")
        if self.keep and self.keep not in self.known:
            raise ValueError(f"split {self.keep!r} is not one of the known splits {self.known}")


@dataclasses.dataclass(frozen=True)
class Example:
    """One QA example.

    Attributes:
      question: the question text, non-empty.
      answers: the acceptable answer strings, at least one, in source order; the first is the
        'first' training target.
      id: unique within its file or split.
      gold_ids: ids of passages known to hold the answer (SQuAD's paragraph); often empty.
    """

    question: str
    answers: tuple[str, ...]
    id: str
    gold_ids: tuple[str, ...] = ()


# ---------------------------------------------------------------------------------------------
# Files


def read_examples(
    path, fields: Mapping[str, str] | None = None, split: Split | None = None, **csv_options
) -> list[Example]:
    """Reads a `.jsonl`, `.csv` or `.tsv` QA file, any of them optionally gzipped (`.gz`).

    Args:
      path: the file; the format is taken from its suffix (`.tsv` is `read_csv` with tabs).
      fields: see `read_jsonl`.
      split: see `read_jsonl`.
      **csv_options: `delimiter` / `columns` for `read_csv`.

    Returns:
      The examples in file order.
    """
    suffixes = [s for s in pathlib.Path(path).suffixes if s != ".gz"]
    suffix = suffixes[-1] if suffixes else ""
    if suffix == ".jsonl" and not csv_options:
        return read_jsonl(path, fields, split)
    if suffix in (".csv", ".tsv"):
        csv_options.setdefault("delimiter", "\t" if suffix == ".tsv" else ",")
        return read_csv(path, fields, split, **csv_options)
    raise ValueError(
        f"{path}: unknown QA file format; expected .jsonl, .csv or .tsv (optionally .gz)"
        + (f", and csv options {sorted(csv_options)} only for .csv/.tsv" if csv_options else "")
    )


def read_jsonl(
    path, fields: Mapping[str, str] | None = None, split: Split | None = None
) -> list[Example]:
    """Reads JSON Lines, one object per line with `question`, `answers`, `id` and `gold_ids`.

    `question` is a non-empty string and `answers` a non-empty list of non-empty strings. `id` is
    a string or integer; when a line has none, the id is `"<file name>:<line number>"` (1-based,
    e.g. `"NQ-open.dev.jsonl:1"`), stable for a given file wherever it is stored. `gold_ids` is a
    list of strings or a single string; a line without it has none. Ids must be unique. Extra keys
    are ignored.

    Args:
      path: the file (`.gz` is decompressed).
      fields: maps our field names to the file's key names where they differ, e.g.
        `NQ_OPEN_FIELDS = {"answers": "answer"}` for NQ-open and
        `SQUAD_OPEN_FIELDS = {"gold_ids": "gold_passage_id"}` for the shared SQuAD questions. A
        field named here is required on every line, even `id` and `gold_ids`, so a mistyped name
        fails instead of silently dropping the field.
      split: read only the lines of one split (`Split`); every line must name a known one.

    Returns:
      The examples in file order (of the split asked, when one is).
    """
    names, required = _field_names(fields)
    parsed = []
    for line_no, record in json_objects(path):
        values = {ours: record.get(theirs, _MISSING) for ours, theirs in names.items()}
        if split is not None:
            values[_SPLIT] = record.get(split.field, _MISSING)
        parsed.append((line_no, values))
    return _examples(path, _of_split(path, parsed, split), names, required)


def read_csv(
    path,
    fields: Mapping[str, str] | None = None,
    split: Split | None = None,
    *,
    delimiter: str = ",",
    columns: Sequence[str] | None = None,
) -> list[Example]:
    """Reads a delimited QA file: a header row naming the columns, then one example per row.

    Fields are those of `read_jsonl`; the `answers` and `gold_ids` cells hold a JSON array of
    strings (`["Paris", "City of Paris"]`) or the Python list literal that DPR's `*.qa.csv` files
    hold (`['Paris', "Paris's"]`); an empty `gold_ids` cell means none. Quoting follows `csv`
    (`"` quotes, `""` inside is one quote, quoted cells may span lines; errors then name the line
    the row starts on).

    Args:
      path: the file (`.gz` is decompressed).
      fields: see `read_jsonl`.
      split: see `read_jsonl` (a column of the file).
      delimiter: the cell separator.
      columns: the column names of a file without a header row; DPR's QA files read as
        `read_csv(path, delimiter="\\t", columns=("question", "answers"))`.

    Returns:
      The examples in file order.
    """
    names, required = _field_names(fields)
    last_line = 0

    def counted():
        nonlocal last_line
        for line_no, line in text_lines(path):
            last_line = line_no  # where the current row ends
            yield line

    rows = csv.reader(counted(), delimiter=delimiter)
    parsed = []
    try:
        header = list(columns) if columns is not None else next(rows, None)
        if header is None:
            raise ValueError(f"{path}: empty file; expected a header row")
        if len(set(header)) != len(header):
            raise ValueError(f"{path}: repeated column name in {header}")
        start = last_line + 1
        for row in rows:
            if len(row) != len(header):
                raise ValueError(
                    f"{path}, line {start}: {len(row)} columns, expected {len(header)} ({header})"
                )
            cells = dict(zip(header, row))
            values = {}
            for ours, theirs in names.items():
                cell = cells.get(theirs, _MISSING)
                if ours in ("answers", "gold_ids") and cell is not _MISSING:
                    cell = _list_cell(cell, f"{path}, line {start}, field '{theirs}'")
                values[ours] = cell
            if split is not None:
                values[_SPLIT] = cells.get(split.field, _MISSING)
            parsed.append((start, values))
            start = last_line + 1
    except csv.Error as e:
        raise ValueError(f"{path}, line {last_line}: {e}") from None
    return _examples(path, _of_split(path, parsed, split), names, required)


_SPLIT = "split"  # where a line's split value travels beside our fields (not an Example field)


def _of_split(path, parsed: list, split: Split | None) -> list:
    """The (line, values) pairs of `split.keep` (all of them for ""), each line's value checked
    against `split.known`; an empty selection of a non-empty file names the values found."""
    if split is None:
        return parsed
    kept, found = [], {}
    for line_no, values in parsed:
        value = values.pop(_SPLIT)
        where = f"{path}, line {line_no}, field '{split.field}'"
        if value is _MISSING:
            raise ValueError(f"{where}: missing (every question names its split)")
        if not isinstance(value, str) or value not in split.known:
            raise ValueError(
                f"{where}: {value!r:.80} is not a known split; expected one of {list(split.known)}"
            )
        found[value] = found.get(value, 0) + 1
        if not split.keep or value == split.keep:
            kept.append((line_no, values))
    if parsed and not kept:
        raise ValueError(
            f"{path}: no questions of split {split.keep!r} (field '{split.field}'; found "
            + ", ".join(f"{v}: {n}" for v, n in sorted(found.items()))
            + ")"
        )
    return kept


def _field_names(fields: Mapping[str, str] | None) -> tuple[dict[str, str], set[str]]:
    """(our name -> the file's name, the names that every record must have)."""
    fields = dict(fields or {})
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise ValueError(f"fields: unknown keys {unknown}; expected a subset of {list(FIELDS)}")
    return {name: fields.get(name, name) for name in FIELDS}, {"question", "answers", *fields}


def _list_cell(cell: str, where: str) -> Any:
    """A CSV list cell parsed as JSON, else as a Python literal; '' is the empty list."""
    if not cell.strip():
        return []
    try:
        return json.loads(cell)
    except (ValueError, RecursionError):  # not JSON, an integer of > 4300 digits, deep nesting
        pass
    try:
        return ast.literal_eval(cell)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        # TypeError: e.g. `{[1]: 2}`, a set of unhashable values.
        raise ValueError(
            f"{where}: expected a JSON array or Python list of strings, got {cell!r:.80}"
        ) from None


def _examples(path, parsed, names, required) -> list[Example]:
    """Examples from (line, {our name: raw value}) pairs; checks types and unique ids."""
    if not parsed:
        raise ValueError(f"{path}: no examples")
    examples, first_line = [], {}
    for line_no, values in parsed:
        where = f"{path}, line {line_no}"
        for name in required:
            if values[name] is _MISSING:
                raise ValueError(f"{where}, field '{names[name]}': missing")
        if values["id"] is _MISSING:
            values["id"] = f"{pathlib.Path(path).name}:{line_no}"
        if values["gold_ids"] is _MISSING:
            values["gold_ids"] = []
        example = _example(values, lambda name, where=where: f"{where}, field '{names[name]}'")
        if example.id in first_line:
            raise ValueError(
                f"{where}, field '{names['id']}': duplicate id {example.id!r} "
                f"(first at line {first_line[example.id]})"
            )
        first_line[example.id] = line_no
        examples.append(example)
    return examples


def _example(values: Mapping[str, Any], where_fn) -> Example:
    """An `Example` from raw values; `where_fn(field)` prefixes errors with the location."""
    question = values["question"]
    if not isinstance(question, str) or not question.strip():
        raise ValueError(
            f"{where_fn('question')}: expected a non-empty string, got {question!r:.80}"
        )
    answers = values["answers"]
    if not isinstance(answers, list) or not answers:
        raise ValueError(
            f"{where_fn('answers')}: expected a non-empty list of strings, got {answers!r:.80}"
        )
    for answer in answers:
        if not isinstance(answer, str) or not answer.strip():
            raise ValueError(
                f"{where_fn('answers')}: expected non-empty strings, got {answer!r:.80} in "
                f"{answers!r:.80}"
            )
    example_id = values["id"]
    if isinstance(example_id, int) and not isinstance(example_id, bool):
        example_id = str(example_id)
    if not isinstance(example_id, str) or not example_id:
        raise ValueError(f"{where_fn('id')}: expected a non-empty string, got {example_id!r:.80}")
    gold_ids = values["gold_ids"]
    gold_ids = [gold_ids] if isinstance(gold_ids, str) else gold_ids
    if not isinstance(gold_ids, list) or not all(isinstance(g, str) and g for g in gold_ids):
        raise ValueError(
            f"{where_fn('gold_ids')}: expected a string or a list of non-empty strings, got "
            f"{values['gold_ids']!r:.80}"
        )
    for field, strings in (
        ("question", [question]),
        ("answers", answers),
        ("id", [example_id]),
        ("gold_ids", gold_ids),
    ):
        if any(has_surrogate(text) for text in strings):
            raise ValueError(f"{where_fn(field)}: {SURROGATE_ERROR}")
    return Example(question, tuple(answers), example_id, tuple(gold_ids))


def examples_from_world(world, split: str) -> list[Example]:
    """The questions of a synthetic world's split ("train" or "eval", `synthetic.World`)."""
    return [
        Example(q["question"], tuple(q["answers"]), q["id"], tuple(q["gold_ids"]))
        for q in world.questions(split)
    ]


# ---------------------------------------------------------------------------------------------
# TFDS


def read_tfds(name: str, split: str, data_dir=None) -> list[Example]:
    """Reads a prepared TFDS QA benchmark through `tfds.data_source` (array_record, no TF).

    Features mapped onto `Example` (as declared by the tensorflow_datasets builders):
      - `natural_questions_open`: `question`, `answer` (list) -> answers.
      - `trivia_qa` (config `unfiltered.nocontext` unless the name gives one, e.g.
        `trivia_qa/rc.nocontext`): `question`; answers are `answer/value` followed by
        `answer/aliases`, duplicates dropped (`normalized_aliases` only repeats the aliases in
        lower case); id is `question_id`. The test split has no answers and is refused.
      - `web_questions`: `question`, `answers`.
    Datasets without ids get `"<dataset>/<split>/<index>"`, the index being the record's position
    in the whole prepared split (TFDS fixes that order when it prepares the data), so a slice such
    as `validation[100:200]` gives the same ids as the full split. No gold ids.

    Args:
      name: a key of `TFDS_DATASETS`, optionally with `/config` and `:version`.
      split: a TFDS split, slices included (`"train"`, `"validation[:10%]"`).
      data_dir: where the data was prepared (see the module docstring); None reads TFDS's default
        (`$TFDS_DATA_DIR` or `~/tensorflow_datasets`).

    Returns:
      The examples in split order.
    """
    import tensorflow_datasets as tfds  # here: only TFDS users pay for the import

    base = name.split("/")[0].split(":")[0]
    if base not in TFDS_DATASETS:
        raise ValueError(
            f"TFDS dataset {name!r} is not supported; expected one of {list(TFDS_DATASETS)}"
        )
    full_name = name
    if TFDS_DATASETS[base] and "/" not in name:
        base_and_version = name.split(":")
        full_name = "/".join([base_and_version[0], TFDS_DATASETS[base]])
        full_name += "".join(":" + v for v in base_and_version[1:])
    prepare = (
        f"prepare it with `tfds build {full_name.split(':')[0]} --file_format=array_record "
        f"--data_dir=DIR` (see rag_jax.run.data)"
    )
    try:
        builder = tfds.builder(full_name, data_dir=data_dir)
    except (ValueError, AssertionError) as e:  # e.g. an unknown config or version
        raise ValueError(f"TFDS dataset {full_name!r}: {e}") from None
    if not builder.is_prepared():
        raise ValueError(
            f"TFDS dataset {full_name!r} is not prepared in {builder.data_dir}; {prepare}"
        )
    at_split = f"TFDS dataset {full_name!r}, split {split!r} in {builder.data_dir}"
    try:
        default_ids = _record_ids(tfds, builder, split, base)
    except ValueError as e:  # an unknown split or a malformed slice
        raise ValueError(
            f"{at_split}: {e} (prepared splits: {list(builder.info.splits)})"
        ) from None
    if not default_ids:
        raise ValueError(f"{at_split}: no examples")
    try:
        source = tfds.data_source(full_name, split=split, data_dir=data_dir, download=False)
    except NotImplementedError as e:  # prepared in a format without random access
        raise ValueError(f"{at_split}: {e}\n({prepare})") from None
    if len(default_ids) != len(source):  # both come from the same file instructions
        raise ValueError(
            f"{at_split}: {len(source)} records but its file instructions name {len(default_ids)}"
        )

    examples, first_index = [], {}
    chunk = 4096  # records per `__getitems__` call: batched reads, bounded memory
    for start in range(0, len(source), chunk):
        records = source.__getitems__(list(range(start, min(start + chunk, len(source)))))
        for index, record in enumerate(records, start=start):
            where = f"TFDS dataset {full_name!r}, split {split!r}, record {index}"
            example = _example(
                _tfds_values(base, record, default_ids[index], where),
                lambda field, where=where: f"{where}, field '{field}'",
            )
            if example.id in first_index:
                raise ValueError(
                    f"{where}: duplicate id {example.id!r} (first at record "
                    f"{first_index[example.id]})"
                )
            first_index[example.id] = index
            examples.append(example)
    return examples


def _record_ids(tfds, builder, split: str, base: str) -> list[str]:
    """`"<base>/<split>/<index in the whole split>"` for each record of `split`, slices included.

    The data source reads the split's file instructions (shard, skip, take) in order; an
    instruction's records start at the lengths of the shards before it plus its skip.
    """
    ids = []
    for instruction in builder.info.splits[split].file_instructions:
        shard = tfds.core.naming.FilenameInfo.from_str(pathlib.Path(instruction.filename).name)
        lengths = builder.info.splits[shard.split].shard_lengths
        first = sum(lengths[: shard.shard_index]) + instruction.skip
        ids += [f"{base}/{shard.split}/{i}" for i in range(first, first + instruction.take)]
    return ids


def _text(value) -> str:
    """A TFDS text feature (bytes without TF) as str."""
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _tfds_values(base: str, record: Mapping[str, Any], default_id: str, where: str) -> dict:
    """Raw `Example` values of one decoded TFDS record of builder `base`."""
    values = {"question": _text(record["question"]), "id": default_id, "gold_ids": []}
    if base == "natural_questions_open":
        values["answers"] = [_text(a) for a in record["answer"]]
    elif base == "web_questions":
        values["answers"] = [_text(a) for a in record["answers"]]
    else:  # trivia_qa
        answer = record["answer"]
        value = _text(answer["value"])
        aliases = [_text(a) for a in answer["aliases"]]
        if value == "<unk>" and not aliases:  # what the builder writes for a missing answer
            raise ValueError(
                f"{where}, field 'answer/value': no answer (TriviaQA's test split has none)"
            )
        values["answers"] = list(dict.fromkeys([value, *aliases]))
        values["id"] = _text(record["question_id"])
    return values


# ---------------------------------------------------------------------------------------------
# Batching


@functools.lru_cache(maxsize=4)
def _permutation(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    """The example order of one epoch: [C] int64, read-only (it is shared through the cache)."""
    order = np.random.default_rng((seed, epoch)).permutation(num_examples)
    order.flags.writeable = False
    return order


def _check_count(name: str, value, minimum: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def batch_indices(
    num_examples: int,
    batch_size: int,
    seed: int,
    step: int,
    *,
    process_index: int = 0,
    process_count: int = 1,
) -> np.ndarray:
    """The example indices of this host's share of global training batch `step`.

    The training stream is the concatenation of epochs, epoch `e` being the permutation
    `np.random.default_rng((seed, e)).permutation(num_examples)`; global batch `step` is positions
    `[step * B, (step + 1) * B)` of that stream. Each position's epoch is computed on its own, so a
    batch that crosses an epoch boundary ends one epoch and starts the next: every example appears
    exactly once per epoch, and the indices depend on `(seed, step)` only (resuming needs no
    iterator state). Host `p` of `P` takes the contiguous slice `[p * B / P, (p + 1) * B / P)`.

    Args:
      num_examples: C, the size of the training split.
      batch_size: B, the global batch size, divisible by `process_count`.
      seed: the data seed, >= 0.
      step: the training step, >= 0.
      process_index: this host (`jax.process_index()`).
      process_count: the number of hosts (`jax.process_count()`).

    Returns:
      [B // process_count] int64 indices into the split.
    """
    _check_count("num_examples", num_examples, 1)
    _check_count("batch_size", batch_size, 1)
    _check_count("seed", seed, 0)
    _check_count("step", step, 0)
    _check_count("process_count", process_count, 1)
    _check_count("process_index", process_index, 0)
    if batch_size % process_count:
        raise ValueError(
            f"batch_size {batch_size} is not divisible by process_count {process_count}; use a "
            f"multiple of {process_count}"
        )
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    local = batch_size // process_count
    start = step * batch_size + process_index * local  # Python ints: no overflow
    positions = np.arange(start, start + local, dtype=np.int64)  # -> [B / P]
    epochs, offsets = np.divmod(positions, num_examples)
    indices = np.empty(local, np.int64)
    for epoch in np.unique(epochs).tolist():
        here = epochs == epoch
        indices[here] = _permutation(num_examples, seed, epoch)[offsets[here]]
    return indices


def pick_target(answers: Sequence[str], mode: str, seed: int, step: int, example_index: int) -> str:
    """The answer string to train on for one example at one step.

    Args:
      answers: the example's gold answers, non-empty.
      mode: `"first"` (always `answers[0]`) or `"sample"` (uniform over the answers,
        drawn with `np.random.default_rng((seed, step, example_index))`, so a rerun
        or resume draws the same target and a different step may draw another).
      seed: the data seed, >= 0.
      step: the training step, >= 0.
      example_index: the example's index in the split (not its position in the batch).

    Returns:
      One of `answers`.
    """
    if mode not in TARGET_MODES:
        raise ValueError(f"mode must be one of {TARGET_MODES}, got {mode!r}")
    if isinstance(answers, str) or not len(answers):
        raise ValueError(f"answers must be a non-empty list of strings, got {answers!r}")
    if mode == "first":
        return answers[0]
    _check_count("seed", seed, 0)
    _check_count("step", step, 0)
    _check_count("example_index", example_index, 0)
    return answers[int(np.random.default_rng((seed, step, example_index)).integers(len(answers)))]


def eval_batches(num_examples: int, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """All of a split in order, in batches of exactly `batch_size`, the last one padded.

    Padding repeats index 0, a valid index, so callers gather and run the model unchanged and
    drop the padded rows with the mask (the metrics in `rag_jax.run.metrics` take it directly).

    Args:
      num_examples: C, the size of the split, >= 1.
      batch_size: B.

    Yields:
      (indices [B] int64, mask [B] bool), mask True on real examples; ceil(C / B) batches.
    """
    _check_count("num_examples", num_examples, 1)
    _check_count("batch_size", batch_size, 1)
    for start in range(0, num_examples, batch_size):
        real = min(batch_size, num_examples - start)
        indices = np.zeros(batch_size, np.int64)
        indices[:real] = np.arange(start, start + real)
        yield indices, np.arange(batch_size) < real
