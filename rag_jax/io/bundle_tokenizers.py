"""A bundle's tokenizer folders (`tokenizers/question/`, `tokenizers/generator/`, written by
`save_pretrained`): which tokenizer classes they may name, which files their configs may name,
and loading them so that transformers reads only the bundle's own files.

A tokenizer_config.json is handed to transformers, which opens the files its entries name: a
crafted `"fast_tokenizer_files": ["../../../outside/tokenizer.4.0.0.json"]` had a load read a
file outside the bundle, and a `vocab_file`, `merges_file` or `vocab` path is opened as given
(relative to the process's folder, not the tokenizer's). `load` reads the config first and
refuses, naming it and the key, every entry that names a file (`FILE_KEYS`) other than a file
of that tokenizer folder the bundle's manifest lists; those it keeps are handed to transformers
as paths inside the folder. The files transformers finds by their fixed names
(`tokenizer.json`, `special_tokens_map.json`, `additional_chat_templates/`) lie in the folder,
and a bundle holds no file its manifest does not list (`bundle_format.check_listed`).

Legend: none (no arrays here).
"""

import json
import pathlib

import transformers

# The tokenizer classes a bundle may name: the ones the trainer writes (WordPiece for the
# towers, BART's, the Llama family's and tokenizers' fast backends) and their kin. Any other
# transformers class named in a crafted tokenizer_config.json would run its own from_pretrained
# (a RagRetriever's tried to download wiki_dpr from the Hub).
TOKENIZER_CLASSES = frozenset(
    f"{name}{fast}"
    for name in (
        "Bert",
        "Bart",
        "Roberta",
        "GPT2",
        "Llama",
        "DPRQuestionEncoder",
        "DPRContextEncoder",
        "T5",
        "Gemma",
        "Qwen2",
    )  # fmt: skip
    for fast in ("Tokenizer", "TokenizerFast")
) | {"PreTrainedTokenizerFast", "TokenizersBackend"}
# What marks a tokenizer config's entry as naming files: its key's ending (`vocab_file`,
# `fast_tokenizer_files`, `spm_file`, ...), or the key itself where a string is a path and
# anything else is data (`vocab` and `merges` may hold the vocabulary and the merges inline).
FILE_KEY_ENDINGS = ("_file", "_files", "_path", "_dir")
PATH_IF_STRING = ("vocab", "merges")
CONFIG = "tokenizer_config.json"


def load(directory: pathlib.Path, listed: set[str]):
    """The tokenizer saved in `directory` (a bundle's tokenizer folder), by the class its config
    names: `AutoTokenizer` imports PyTorch when it is installed (seconds of a bundle's
    start-up), the class does not.

    Args:
      directory: the folder.
      listed: its files the bundle's manifest lists, relative to it ("tokenizer.json").

    Raises:
      ValueError naming the config and the entry or class refused.
    """
    path = directory / CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{directory}: no readable {CONFIG} ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    name = config.get("tokenizer_class")
    if name is not None and name not in TOKENIZER_CLASSES:
        raise ValueError(
            f"{path}: tokenizer_class {name!r} is not a tokenizer a bundle may hold (one of "
            f"{sorted(TOKENIZER_CLASSES)})"
        )
    inside = check_files(path, config, listed)
    cls = getattr(transformers, str(name), None)
    if cls is None:  # no class named (or one this transformers lacks): read the files alone
        cls = transformers.AutoTokenizer
    return cls.from_pretrained(str(directory), local_files_only=True, **inside)


def check_files(path: pathlib.Path, config: dict, listed: set[str]) -> dict[str, str]:
    """The entries of the tokenizer config `config` (read from `path`) that name files, each
    as the path of its file inside the folder, for `from_pretrained` to read in their place.

    Raises:
      ValueError naming `path` and the entry, when one names anything but a file of the
      folder that `listed` holds, or names files below the config's top level.
    """
    inside = {}
    for key, value in config.items():
        nested = _nested_file_key(value, f"{key}.")
        if nested is not None:  # e.g. sp_model_kwargs.model_file: handed on unchecked
            raise ValueError(
                f"{path}: {nested} names a file below the config's top level; a bundle's "
                "tokenizer config names its files at its top level only"
            )
        if not _names_files(key, value) or value is None:
            continue
        names = value if isinstance(value, list) else [value]
        for file in names:
            if not isinstance(file, str) or file not in listed or "/" in file or "\\" in file:
                raise ValueError(
                    f"{path}: {key} names {file!r:.120}, not a file of this tokenizer folder "
                    "that the bundle's manifest lists; a bundle's tokenizer reads only its own "
                    "files"
                )
        if isinstance(value, str):  # a path given as is would be read from the process's folder
            inside[key] = str(path.parent / value)
        elif key != "fast_tokenizer_files":  # which transformers reads from the folder
            raise ValueError(
                f"{path}: {key} names a list of files; a bundle's tokenizer config names one "
                "file per key but fast_tokenizer_files (which transformers reads from the folder)"
            )
    return inside


def _names_files(key: str, value) -> bool:
    return key.endswith(FILE_KEY_ENDINGS) or (key in PATH_IF_STRING and isinstance(value, str))


def _nested_file_key(value, where: str) -> str | None:
    """The first key below the top level of a config entry `value` that names files with a
    string (an inline vocabulary maps its tokens, whatever they read, to numbers)."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        paths = isinstance(item, str) or (isinstance(item, list) and item and all(
            isinstance(i, str) for i in item))  # fmt: skip
        if isinstance(key, str) and _names_files(key, item) and paths:
            return f"{where}{key}"
        found = _nested_file_key(item, f"{where}{key}.")
        if found is not None:
            return found
    return None
