"""Plain document folders as a corpus: `.txt` and `.md` files cut into DPR's 100-word passages.

Legend: C corpus size (passages).

    passages = read_documents("notes/")                  # -> C `Passage` records
    write_passages_jsonl(passages, "notes.jsonl")         # then data.corpus_path=notes.jsonl

Every `.txt` and `.md` file below the folder (recursively; other files are ignored) is read as
UTF-8, in order of relative path. Its words (the text split at any whitespace) are cut into
consecutive non-overlapping windows of 100 words joined by single spaces, the last one shorter:
DPR's `psgs_w100` recipe (`corpus.split_documents`). A passage's id is the file's relative path
without its suffix, then `_` and the window's 0-based index (`guides/setup_0`, `guides/setup_1`);
its title is the file's first non-empty line without leading `#`s and spaces (a Markdown
heading), or the file name's stem where that leaves nothing. The heading's words stay in the
first window's text, as every word of the file does.
"""

import json
import os
import pathlib
from collections.abc import Iterable

from rag_jax.retrieval import files
from rag_jax.retrieval.corpus import Passage, check_record, split_documents, text_lines

SUFFIXES = (".txt", ".md")
WORDS = 100  # words per passage, as DPR's psgs_w100


def read_documents(folder) -> list[Passage]:
    """The passages of every `.txt` and `.md` file below `folder`.

    Args:
      folder: a directory; searched recursively (not into symlinked folders), files taken in
        order of relative path ("/"-separated). Suffixes are matched as written (`.TXT` is not
        read).

    Returns:
      C `Passage` records: each file's 100-word windows in order, files in path order.

    Raises:
      ValueError: naming the folder when it is not a directory or holds no `.txt`/`.md` file;
        naming the file (and line) when a file is not valid UTF-8 or holds no word; naming both
        files when two give the same id stem (`a.txt` and `a.md`).
    """
    root = pathlib.Path(folder)
    if not root.is_dir():
        raise ValueError(f"{folder}: not a folder; expected a directory of .txt and .md files")
    paths = []
    for directory, _, names in os.walk(root):  # symlinked folders are not entered (no loops)
        for name in names:
            path = pathlib.Path(directory, name)
            if path.suffix in SUFFIXES and path.is_file():
                paths.append(path.relative_to(root).as_posix())
    paths.sort()
    if not paths:
        raise ValueError(f"{folder}: no {' or '.join(SUFFIXES)} file in it or below it")
    stems: dict[str, str] = {}  # id stem -> the file that gave it
    passages = []
    for relative in paths:
        stem = relative[: -len(pathlib.PurePosixPath(relative).suffix)]
        if stem in stems:
            raise ValueError(
                f"{root / stems[stem]} and {root / relative}: both give passage ids "
                f"{stem!r}_<n>; rename one of them"
            )
        stems[stem] = relative
        passages += _file_passages(root / relative, stem)
    return passages


def _file_passages(path: pathlib.Path, stem: str) -> list[Passage]:
    """One file's windows, with ids `<stem>_<i>`."""
    text = "".join(line for _, line in text_lines(path))  # ValueError naming a non-UTF-8 line
    text = text.removeprefix("\ufeff")  # a byte-order mark (Windows editors) is no word
    if not text.split():
        raise ValueError(f"{path}: holds no word; remove the file or give it text")
    heading = next(line for line in text.split("\n") if line.strip())
    title = heading.strip().lstrip("#").strip() or pathlib.PurePosixPath(stem).name
    windows = split_documents([Passage(stem, title, text)], words=WORDS)
    return [Passage(f"{stem}_{i}", title, window.text) for i, window in enumerate(windows)]


def write_passages_jsonl(passages: Iterable[Passage], path) -> None:
    """Writes passages as JSON Lines, one `{"id", "title", "text"}` object a line, atomically
    (`files.write_atomic`): `corpus.read_corpus(path)` reads them back, so the file can be a
    run's `data.corpus_path`.

    Args:
      passages: records with string fields and distinct, non-empty ids; at least one.
      path: the file; must end in `.jsonl` (how `corpus.read_passages` knows the format).

    Raises:
      ValueError: naming the record index and field for a bad record, both indices for a
        repeated id, or the path for another suffix or no passage.
    """
    if not os.fspath(path).endswith(".jsonl"):
        raise ValueError(f"{path}: a passage file written here must end in .jsonl")
    lines, seen = [], {}
    for index, record in enumerate(passages):
        passage = check_record(record, index)
        if passage.id in seen:
            raise ValueError(
                f"record {index}, field 'id': duplicate id {passage.id!r} (first in record "
                f"{seen[passage.id]})"
            )
        seen[passage.id] = index
        lines.append(json.dumps(passage._asdict(), ensure_ascii=False) + "\n")
    if not lines:
        raise ValueError(f"{path}: no passages to write")
    files.write_atomic(path, "".join(lines).encode("utf-8"))
