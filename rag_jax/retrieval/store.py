"""The pre-tokenised passage store and exact assembly of the generator's contexts.

Legend: B batch, N docs per question, S context length (`max_length`), C corpus size.

`PassageStore` keeps a corpus on disk as memory-mapped arrays: the generator tokens of each
passage's part of the context, and the raw id, title and text as UTF-8 bytes. The generator's
input for question q and passage z is HF `RagRetriever.postprocess_docs`'s string

    (prefix + title' + title_sep + text + doc_sep + q + suffix).replace("  ", " ")

where title' is the title with one leading and one trailing `"` removed (HF strips the title only,
not the text; `suffix` is empty for BART and a causal generator's answer cue otherwise),
tokenised with special tokens, truncation to `max_length` and right padding.

Exact token assembly. The string is cut once, after the last non-space character of `doc_sep`
(" //" | " " + q for the default " // "); the left part (passage piece) is tokenised at build time,
the right part (question piece) once per question, and `context_tokens` concatenates the ids.
This equals tokenising the whole string because:
  1. `.replace("  ", " ")` rewrites each run of spaces on its own; the passage piece ends in a
     non-space character, so no run crosses the cut and the rewrite can be done per piece.
  2. No pre-tokenizer puts a non-space character and a following space into one pre-token:
     byte-level BPE's (GPT-2) regex attaches a space only to the word after it and has no
     look-behind, WordPiece splits at whitespace. So the pre-tokens on either side of the cut are
     the same with or without the other side, and BPE/WordPiece work within pre-tokens.
Everything that depends on the passage (quotes, trailing or doubled spaces, unicode, text that
spells a special token) lies inside the passage piece and is tokenised whole, so no input needs a
fallback. What could still break the argument, an added token that spans the cut or eats the
space after it, or a normaliser that is not local, is rejected at build time (explicit check plus
a probe against whole-string tokenisation). Truncation acts on tokens: HF keeps the first
`max_length - n_special` tokens and then adds the special tokens, so the trailing EOS survives.
"""

import array
import hashlib
import itertools
import operator
import pathlib
from collections.abc import Iterable, Sequence

import numpy as np

from rag_jax.retrieval import files
from rag_jax.retrieval.corpus import IdDigests, Passage, check_record, update_checksum
from rag_jax.retrieval.tokenizer_id import tokenizer_fingerprint

FORMAT = "rag_jax.passage_store"
VERSION = 2  # 2: the manifest carries its checksum
_FORMATS = {FORMAT: (1, 2)}
_COLUMNS = (("tokens", "<i4"), ("ids", "u1"), ("titles", "u1"), ("texts", "u1"))


def context_string(
    title: str,
    text: str,
    question: str,
    prefix: str = "",
    title_sep=" / ",
    doc_sep=" // ",
    suffix: str = "",
) -> str:
    """The generator input string HF's `RagRetriever.postprocess_docs` builds for one passage."""
    title = title.removeprefix('"').removesuffix('"')
    return (prefix + title + title_sep + text + doc_sep + question + suffix).replace("  ", " ")


def _passage_piece(passage: Passage, prefix: str, title_sep: str, sep_head: str) -> str:
    title = passage.title.removeprefix('"').removesuffix('"')
    return (prefix + title + title_sep + passage.text + sep_head).replace("  ", " ")


def _question_piece(question: str, sep_tail: str, suffix: str = "") -> str:
    return (sep_tail + question + suffix).replace("  ", " ")


def _split_doc_sep(doc_sep: str) -> tuple[str, str]:
    head = doc_sep.rstrip(" ")
    if not head or head[-1].isspace() or head == doc_sep:
        raise ValueError(
            f"doc_sep {doc_sep!r} must end in spaces after a non-whitespace character (like the "
            "default ' // ') so that question tokens can be appended exactly"
        )
    return head, doc_sep[len(head) :]


def _tokenize(tokenizer, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    encoded = tokenizer(
        texts,
        add_special_tokens=False,
        truncation=False,
        padding=False,
        return_attention_mask=False,
        return_token_type_ids=False,
        verbose=False,
    )
    return encoded["input_ids"]


def _check_tokenizer(
    tokenizer, pieces: list[str], sep_head: str, sep_tail: str, suffix: str = ""
) -> dict:
    """Checks that contexts can be assembled exactly; returns the special-token layout."""
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    if tokenizer.padding_side != "right" or tokenizer.truncation_side != "right":
        raise ValueError(f"tokenizer {name}: padding and truncation must be on the right")
    if tokenizer.pad_token_id is None:
        raise ValueError(f"tokenizer {name}: has no pad token to pad contexts to max_length")
    cut = sep_head[-1] + sep_tail[0]
    for token in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if cut in token.content or (token.rstrip and token.content.endswith(sep_head[-1])):
            raise ValueError(f"tokenizer {name}: added token {token.content!r} spans {cut!r}")
    specials = tokenizer("")["input_ids"]
    probe = tokenizer(pieces[0])["input_ids"]
    core = _tokenize(tokenizer, pieces[:1])[0]
    splits = [k for k in range(len(specials) + 1) if specials[:k] + core + specials[k:] == probe]
    if not splits:
        raise ValueError(f"tokenizer {name}: special tokens are not a fixed prefix and suffix")
    layout = {"prefix_ids": specials[: splits[0]], "suffix_ids": specials[splits[0] :]}
    questions = ["", "who wrote  it?", "  lead", "'s x", '"q" / // ', "naïve 中文 😀\tt\nn"]
    questions.append(" ".join(getattr(tokenizer, "all_special_tokens", [])))
    n_special = len(specials)
    # The argument in the module docstring covers BPE and WordPiece pipelines; this probe catches
    # a tokenizer outside it (e.g. a normaliser that strips or merges across the cut).
    for piece in pieces[:3]:
        for question in questions:
            q_piece = _question_piece(question, sep_tail, suffix)
            composed = _tokenize(tokenizer, [piece])[0] + _tokenize(tokenizer, [q_piece])[0]
            for kept in (len(composed), len(composed) // 2):
                whole = tokenizer(piece + q_piece, max_length=n_special + kept, truncation=True)
                expected = layout["prefix_ids"] + composed[:kept] + layout["suffix_ids"]
                if whole["input_ids"] != expected:
                    raise ValueError(
                        f"tokenizer {name}: tokenising {piece + q_piece!r} whole differs from "
                        "its passage and question parts; contexts cannot be assembled exactly"
                    )
    return layout


# ---------------------------------------------------------------------------------------------
# The store


class StringColumn(Sequence):
    """Read-only sequence of strings: memory-mapped UTF-8 bytes and `[C + 1] int64` offsets."""

    def __init__(self, data: np.ndarray, offsets: np.ndarray, path=None):
        self._data = data
        self._offsets = offsets
        self._path = path  # the bytes' file, for errors

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = operator.index(i)
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for {len(self)} strings")
        i %= len(self)
        try:
            return self._data[self._offsets[i] : self._offsets[i + 1]].tobytes().decode("utf-8")
        except UnicodeDecodeError as e:  # only reachable when opened with verify=False
            raise ValueError(
                f"{self._path}: string {i} is not valid UTF-8 ({e}); corrupted?"
            ) from None


class _ColumnWriter:
    """Appends variable-length items to `<name>.bin` and end offsets to `<name>.offsets.bin`."""

    def __init__(self, directory: pathlib.Path, name: str, dtype: str):
        self.name, self.dtype = name, np.dtype(dtype)
        self.paths = [directory / f"{name}.bin", directory / f"{name}.offsets.bin"]
        self._data, self._offsets = (open(p, "xb") for p in self.paths)
        self._hashes = [hashlib.sha256(), hashlib.sha256()]
        self._pending = array.array("q", [0])
        self._end = 0

    def append(self, data: bytes) -> None:
        self._data.write(data)
        self._hashes[0].update(data)
        self._end += len(data) // self.dtype.itemsize
        self._pending.append(self._end)
        if len(self._pending) >= 1 << 16:
            self._flush()

    def _flush(self) -> None:
        data = np.frombuffer(self._pending, np.int64).astype("<i8").tobytes()
        self._offsets.write(data)
        self._hashes[1].update(data)
        del self._pending[:]

    def close(self, count: int) -> dict:
        self._flush()
        self._data.close()
        self._offsets.close()
        data_sha, offsets_sha = (h.hexdigest() for h in self._hashes)
        return {
            self.paths[0].name: {"dtype": self.dtype.str, "length": self._end, "sha256": data_sha},
            self.paths[1].name: {"dtype": "<i8", "length": count + 1, "sha256": offsets_sha},
        }

    def abort(self) -> None:
        """Closes and deletes both files, whatever state they are in (a full disk makes `close`
        fail to flush: the error that matters is the one that got here, not this one)."""
        for f, path in zip((self._data, self._offsets), self.paths, strict=True):
            try:
                f.close()
            except OSError:
                pass
            path.unlink(missing_ok=True)


class PassageStore:
    """The corpus on disk, memory-mapped: generator tokens and raw strings of C passages.

    Files in the directory: `manifest.json`; `tokens.bin` `[*] int32` with `tokens.offsets.bin`
    `[C + 1] int64` (passage pieces, see the module docstring); `ids.bin`, `titles.bin`, `texts.bin`
    UTF-8 bytes with their `*.offsets.bin` `[C + 1] int64`. The manifest records the count, the
    corpus checksum (`corpus_checksum`), the tokenizer fingerprint, prefix and separators, the
    special-token layout and the length and sha256 of every file, all checked by `open`.
    """

    def __init__(self, directory: pathlib.Path, manifest: dict, arrays: dict[str, np.ndarray]):
        self.directory = directory
        self.manifest = manifest
        self._tokens = arrays["tokens.bin"]
        self._token_offsets = arrays["tokens.offsets.bin"]
        self.ids, self._titles, self._texts = (
            StringColumn(arrays[f"{name}.bin"], arrays[f"{name}.offsets.bin"], directory / name)
            for name in ("ids", "titles", "texts")
        )
        self._prefix_ids = np.asarray(manifest["prefix_ids"], np.int32)
        self._suffix_ids = np.asarray(manifest["suffix_ids"], np.int32)

    @classmethod
    def build(
        cls,
        records: Iterable[Passage],
        tokenizer,
        out_dir,
        prefix: str = "",
        title_sep: str = " / ",
        doc_sep: str = " // ",
        batch_size: int = 1024,
        suffix: str = "",
    ) -> "PassageStore":
        """Tokenises and writes a corpus, streaming; returns the store opened from disk.

        Args:
          records: `Passage` records (or `(id, title, text)` string triples), e.g. a reader.
          tokenizer: the generator tokenizer (HF, e.g. BART's byte-level BPE).
          out_dir: a new or empty directory (or the leftovers of a build that was killed: store
            files without a manifest, which are deleted).
          prefix: the generator's input prefix (HF `generator.prefix`; none for BART).
          title_sep, doc_sep: HF `RagConfig.title_sep` / `doc_sep`.
          batch_size: records tokenised per tokenizer call.
          suffix: text after the question (a causal generator's answer cue; none for BART).

        Raises:
          ValueError: a bad record (naming its index and field), a duplicate id, an empty corpus,
            a non-empty `out_dir`, or a tokenizer/`doc_sep` for which contexts cannot be assembled
            exactly. Nothing is left in `out_dir` then.
          OSError: `errno.ENOSPC` saying the disk is full (nothing is left in `out_dir` either).
        """
        sep_head, sep_tail = _split_doc_sep(doc_sep)
        out_dir = pathlib.Path(out_dir)
        ours = {f"{name}{end}" for name, _ in _COLUMNS for end in (".bin", ".offsets.bin")}
        if out_dir.is_dir() and not (out_dir / "manifest.json").exists():
            leftovers = [
                p
                for p in out_dir.iterdir()
                if p.name in ours or p.name.startswith("manifest.json.tmp")
            ]
            for path in leftovers:  # a build that was killed before its manifest was written
                path.unlink()
        if out_dir.exists() and any(out_dir.iterdir()):
            raise ValueError(f"{out_dir}: not empty; a passage store is built into a new directory")
        out_dir.mkdir(parents=True, exist_ok=True)
        writers = [_ColumnWriter(out_dir, name, dtype) for name, dtype in _COLUMNS]
        count, layout, checksum, digests = 0, None, hashlib.sha256(), IdDigests()
        try:
            records = iter(records)
            while batch := list(itertools.islice(records, batch_size)):
                passages = [check_record(r, count + i) for i, r in enumerate(batch)]
                pieces = [_passage_piece(p, prefix, title_sep, sep_head) for p in passages]
                if layout is None:
                    layout = _check_tokenizer(tokenizer, pieces, sep_head, sep_tail, suffix)
                tokens = _tokenize(tokenizer, pieces)
                for passage, token_ids in zip(passages, tokens, strict=True):
                    writers[0].append(np.asarray(token_ids, "<i4").tobytes())
                    for writer, value in zip(writers[1:], passage, strict=True):
                        writer.append(value.encode("utf-8"))
                    update_checksum(checksum, passage)
                    digests.add(passage.id, count)
                    count += 1
            if not count:
                raise ValueError("no passages: the records are empty")
            records = {}
            for writer in writers:
                records.update(writer.close(count))
            written = cls._map_all(out_dir, records)
            ids = StringColumn(written["ids.bin"], written["ids.offsets.bin"])
            repeat = digests.first_repeat(lambda wanted: {i: ids[i] for i in wanted})
            if repeat:
                raise ValueError(
                    f"record {repeat[1]}, field 'id': duplicate id {repeat[2]!r} (first at "
                    f"record {repeat[0]}, 0-based)"
                )
            manifest = {
                "format": FORMAT,
                "version": VERSION,
                "count": count,
                "checksum": checksum.hexdigest(),
                "tokenizer": {
                    "class": type(tokenizer).__name__,
                    "name": str(getattr(tokenizer, "name_or_path", "")),
                    "fingerprint": tokenizer_fingerprint(tokenizer),
                },
                "prefix": prefix,
                "title_sep": title_sep,
                "doc_sep": doc_sep,
                "suffix": suffix,
                "pad_id": tokenizer.pad_token_id,
                **layout,
                "files": records,
            }
            # Written last, atomically: a directory without it is no store.
            files.write_manifest(out_dir, manifest)
        except BaseException as e:
            for writer in writers:
                writer.abort()
            for leftover in out_dir.glob("manifest.json.tmp*"):
                leftover.unlink(missing_ok=True)
            if files.is_disk_full(e):
                raise files.disk_full_error(
                    f"the passage store in {out_dir}",
                    "its partial files were removed: free space and build it again",
                    e,
                ) from e
            raise
        return cls.open(out_dir)

    @classmethod
    def open(cls, directory, *, verify: bool = True) -> "PassageStore":
        """Memory-maps a store written by `build`, checking it against its manifest.

        Args:
          directory: written by `build`.
          verify: also check every file's sha256 (sizes and offsets are always checked); this
            reads the whole store once.

        Raises:
          FileNotFoundError / ValueError naming the file that is missing, truncated, corrupted
          or inconsistent with the manifest.
        """
        directory = pathlib.Path(directory)
        path = directory / "manifest.json"
        manifest = files.read_manifest(directory, _FORMATS, what="passage store")
        names = {f"{name}{suffix}" for name, _ in _COLUMNS for suffix in (".bin", ".offsets.bin")}
        if set(manifest.get("files", {})) != names:
            raise ValueError(f"{path}: files {sorted(manifest.get('files', {}))}, expected {names}")
        try:
            arrays = cls._map_all(directory, manifest["files"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"{path}: malformed file records ({type(e).__name__}: {e})") from None
        if verify:
            for name, spec in manifest["files"].items():
                _check_sha256(directory / name, spec.get("sha256"), path)
        for name, _ in _COLUMNS:
            data, offsets = arrays[f"{name}.bin"], arrays[f"{name}.offsets.bin"]
            if len(offsets) != manifest["count"] + 1 or offsets[0] != 0 or offsets[-1] != len(data):
                raise ValueError(f"{directory / name}.offsets.bin: offsets do not match {name}.bin")
            if np.any(np.diff(offsets) < 0):
                raise ValueError(f"{directory / name}.offsets.bin: offsets decrease (corrupted)")
        return cls(directory, manifest, arrays)

    @staticmethod
    def _map_all(directory: pathlib.Path, records: dict) -> dict[str, np.ndarray]:
        arrays = {}
        for name, spec in records.items():
            path, dtype = directory / name, np.dtype(spec["dtype"])
            if not path.is_file():
                raise FileNotFoundError(f"{path}: missing from the passage store")
            expected, actual = spec["length"] * dtype.itemsize, path.stat().st_size
            if actual != expected:
                raise ValueError(
                    f"{path}: {actual} bytes, the manifest says {expected} (truncated?)"
                )
            # mmap cannot map an empty file (e.g. every title empty).
            arrays[name] = (
                np.memmap(path, dtype=dtype, mode="r", shape=(spec["length"],))
                if expected
                else np.zeros(0, dtype)
            )
        return arrays

    def __len__(self) -> int:
        return self.manifest["count"]

    @property
    def checksum(self) -> str:
        """The corpus checksum (`corpus_checksum` of the records it was built from)."""
        return self.manifest["checksum"]

    def differences(self, checksum: str, tokenizer, **layout) -> list[str]:
        """What differs between this store and a build from a corpus with `checksum`, with
        `tokenizer` and with the given `prefix`, `title_sep` and `doc_sep` (those passed only)."""
        found = []
        if checksum != self.checksum:
            found.append("corpus_checksum")
        if tokenizer_fingerprint(tokenizer) != self.manifest["tokenizer"]["fingerprint"]:
            found.append("generator tokenizer")
        # Stores built before the suffix existed have none.
        found += [name for name, value in layout.items() if value != self.manifest.get(name, "")]
        return found

    def title(self, i: int) -> str:
        """The raw title of passage i, as read (quotes not stripped)."""
        return self._titles[i]

    def text(self, i: int) -> str:
        """The raw text of passage i, for answer-recall metrics and display."""
        return self._texts[i]

    def passage(self, i: int) -> Passage:
        """The raw record of passage i."""
        return Passage(self.ids[i], self._titles[i], self._texts[i])

    def passage_token_ids(self, i: int) -> np.ndarray:
        """`[L] int32` tokens of passage i's piece: prefix, title, title_sep, text, doc_sep head."""
        return np.asarray(self._tokens[self._token_offsets[i] : self._token_offsets[i + 1]])

    def tokenize_questions(self, tokenizer, questions: Sequence[str]) -> list[list[int]]:
        """Token ids of question pieces (`doc_sep`'s trailing spaces + question), for contexts.

        To reproduce HF exactly, pass the question strings HF would use (its retriever decodes
        them from the question encoder's token ids). `tokenizer` must be the one the store was
        built with (checked by fingerprint).
        """
        if isinstance(questions, str):
            raise ValueError("questions: expected a sequence of strings, got one string")
        if tokenizer_fingerprint(tokenizer) != self.manifest["tokenizer"]["fingerprint"]:
            raise ValueError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} is not the one the store "
                f"{self.directory} was built with ({self.manifest['tokenizer']['name']!r})"
            )
        sep_tail = _split_doc_sep(self.manifest["doc_sep"])[1]
        suffix = self.manifest.get("suffix", "")
        return _tokenize(tokenizer, [_question_piece(q, sep_tail, suffix) for q in questions])

    def context_tokens(
        self,
        passage_idx,
        question_token_ids,
        max_length: int,
        question_mask=None,
        keep_question: bool = False,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Generator inputs for every (question, retrieved passage) pair, as HF lays them out.

        Equal to tokenising `context_string(title, text, question, ...)` with the store's tokenizer,
        `max_length=max_length, truncation=True, padding="max_length"`: special tokens around the
        first `max_length - n_special` tokens of passage piece + question piece, then pad. HF's
        truncation cuts the string's end, which is the question: a passage longer than the
        context leaves none of it. `keep_question` cuts the passage's end instead, so the whole
        question piece (up to the context's room) always follows the passage.

        Args:
          passage_idx: `[B, N]` integer passage indices (rows of this store).
          question_token_ids: B question pieces from `tokenize_questions`: a list of B id lists,
            or a `[B, Q]` integer array together with `question_mask`.
          max_length: S, HF `max_combined_length`; at least the number of special tokens.
          question_mask: `[B, Q]` 0/1, which entries of a padded `question_token_ids` are real.
          keep_question: truncate the passage, not the question (see above).

        Returns:
          input_ids: `[B * N, S] int32`, row `b * N + n` for question b and its n-th passage.
          attention_mask: `[B * N, S] int32`, 1 on real tokens (a prefix of each row).
        """
        questions, flat_idx, starts, ends = self._cut(
            passage_idx, question_token_ids, max_length, question_mask, keep_question
        )
        batch, n_docs = np.shape(passage_idx)
        n_prefix, n_suffix = len(self._prefix_ids), len(self._suffix_ids)
        input_ids = np.full((batch * n_docs, max_length), self.manifest["pad_id"], np.int32)
        attention_mask = np.zeros((batch * n_docs, max_length), np.int32)
        input_ids[:, :n_prefix] = self._prefix_ids
        for row in range(batch * n_docs):
            p_end = n_prefix + ends[row] - starts[row]
            input_ids[row, n_prefix:p_end] = self._tokens[starts[row] : ends[row]]
            question = questions[row // n_docs][: max_length - n_suffix - p_end]
            q_end = p_end + len(question)
            input_ids[row, p_end:q_end] = question
            input_ids[row, q_end : q_end + n_suffix] = self._suffix_ids
            attention_mask[row, : q_end + n_suffix] = 1
        return input_ids, attention_mask

    def kept_passage_tokens(
        self,
        passage_idx,
        question_token_ids,
        max_length: int,
        question_mask=None,
        keep_question: bool = False,
    ) -> np.ndarray:
        """`[B * N] int64`: how many of each passage piece's tokens (`passage_token_ids`) the
        rows of `context_tokens(...)` with the same arguments keep."""
        _, _, starts, ends = self._cut(
            passage_idx, question_token_ids, max_length, question_mask, keep_question
        )
        return ends - starts

    def passage_piece(self, i: int) -> str:
        """The string passage i's tokens were made from (`passage_token_ids`): prefix, title
        (quotes stripped), title_sep, text and the head of doc_sep, double spaces rewritten."""
        m = self.manifest
        sep_head = _split_doc_sep(m["doc_sep"])[0]
        return _passage_piece(self.passage(i), m["prefix"], m["title_sep"], sep_head)

    def _cut(self, passage_idx, question_token_ids, max_length, question_mask, keep_question):
        """(question rows, flat passage rows [B * N], token starts, token ends) of each context's
        passage part: the arguments of `context_tokens`, checked."""
        passage_idx = np.asarray(passage_idx)
        if passage_idx.ndim != 2 or not np.issubdtype(passage_idx.dtype, np.integer):
            raise ValueError(
                f"passage_idx: expected [B, N] integers, got shape {passage_idx.shape} "
                f"dtype {passage_idx.dtype}"
            )
        batch, n_docs = passage_idx.shape
        questions = _question_rows(question_token_ids, question_mask)
        if len(questions) != batch:
            raise ValueError(
                f"passage_idx is [B, N] = {passage_idx.shape} but there are {len(questions)} "
                "questions; expected B"
            )
        if passage_idx.size and (passage_idx.min() < 0 or passage_idx.max() >= len(self)):
            bad = passage_idx[(passage_idx < 0) | (passage_idx >= len(self))][0]
            raise ValueError(f"passage_idx: {bad} is outside the store's {len(self)} passages")
        n_prefix, n_suffix = len(self._prefix_ids), len(self._suffix_ids)
        budget = max_length - n_prefix - n_suffix
        if budget < 0:
            raise ValueError(f"max_length {max_length} < {n_prefix + n_suffix} special tokens")
        flat_idx = passage_idx.reshape(-1)  # -> [B * N]
        starts = np.asarray(self._token_offsets[flat_idx])
        room = np.full(batch * n_docs, budget, np.int64)  # passage tokens each row may hold
        if keep_question:
            asked = np.array([min(len(q), budget) for q in questions], np.int64)
            room = room - np.repeat(asked, n_docs)
        ends = np.minimum(np.asarray(self._token_offsets[flat_idx + 1]), starts + room)
        return questions, flat_idx, starts, ends


def _check_sha256(path: pathlib.Path, expected: str | None, manifest: pathlib.Path) -> None:
    """Raises naming `path` when its sha256 is not `expected` (stores built before sha256s were
    recorded have none, and are checked by size and offsets only)."""
    if expected is not None and files.sha256_file(path) != expected:
        raise ValueError(f"{path}: corrupted: its sha256 differs from the one in {manifest}")


def _question_rows(question_token_ids, question_mask) -> list[np.ndarray]:
    """B question pieces as int32 rows, from ragged lists or a padded array plus mask."""
    if question_mask is not None:
        ids, mask = np.asarray(question_token_ids), np.asarray(question_mask)
        if ids.ndim != 2 or ids.shape != mask.shape:
            raise ValueError(
                f"question_token_ids {ids.shape} and question_mask {mask.shape}: expected the "
                "same [B, Q] shape"
            )
        return [
            row[keep.astype(bool)].astype(np.int32) for row, keep in zip(ids, mask, strict=True)
        ]
    if getattr(question_token_ids, "ndim", 1) != 1:
        raise ValueError(
            "question_token_ids: a padded [B, Q] array needs question_mask to say which ids are "
            "real; or pass a list of B id lists"
        )
    rows = []
    for b, row in enumerate(question_token_ids):
        row = np.asarray(row)
        if row.ndim != 1 or (row.size and not np.issubdtype(row.dtype, np.integer)):
            raise ValueError(f"question_token_ids[{b}]: expected a list of token ids, got {row!r}")
        rows.append(row.astype(np.int32))
    return rows
