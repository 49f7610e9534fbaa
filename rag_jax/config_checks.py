"""Training configs: dotted-key overrides, and the start-up checks (unknown keys, inconsistent
settings, missing paths).

Each error names the setting, its value and what would be right, before anything is built.
"""

import difflib
import pathlib
import re

import ml_collections

from rag_jax import hf, sharding


def override(config: ml_collections.ConfigDict, settings: dict) -> ml_collections.ConfigDict:
    """Sets dotted keys (`{"train.steps": 50}`) in `config`, in place; returns it."""
    for key, value in settings.items():
        node = config
        *parents, leaf = key.split(".")
        for name in parents:
            node = node[name]
        node[leaf] = value
    return config


# Every setting the library and the experiment scripts read, by section. Anything else is a typo
# (or a setting of another version) that would be silently ignored, so `validate` refuses it. A
# new setting goes here too (tests/reliability_test.py checks that default.py validates).
# `model.question_encoder`, `model.generator` and `data.fields` are checked where they are used.
CONFIG_KEYS = {
    "": {"seed", "data", "model", "warm_start", "rag", "retrieval", "train", "eval"},
    "data": {
        "source", "num_entities", "distractors_per_fact", "eval_fraction", "question_length",
        "answer_length", "answer_pad_multiple", "target", "train_path", "eval_path",
        "corpus_path", "fields", "max_train", "max_eval", "tfds_name", "train_split",
        "eval_split", "tfds_data_dir",
    },
    "model": {
        "init", "dtype", "remat", "deterministic", "question_encoder", "generator",
        "question_encoder_path", "passage_encoder_path", "generator_path", "rag_path",
        "shared_towers",
    },
    "warm_start": {
        "method", "steps", "batch_size", "learning_rate", "keep_prob", "cache_dir",
        "reader_steps", "reader_entities",
    },
    "rag": {
        "variant", "n_docs", "max_combined_length", "context_pad_multiple", "label_smoothing",
        "exclude_bos_score", "closed_book",
    },
    "retrieval": {
        "index", "passage_max_length", "passage_format", "encode_batch_size", "index_dir",
        "refresh_every", "refresh_lag", "search_in_step",
    },
    "train": {
        "steps", "batch_size", "num_devices", "optimizer", "learning_rate", "warmup_steps",
        "decay", "decay_power", "end_lr_factor", "retriever_lr_factor", "retriever_delay_steps",
        "weight_decay",
        "no_decay", "adam_b1", "adam_b2", "adam_eps", "grad_clip", "grad_accum", "freeze",
        "log_every", "save_every", "keep_checkpoints", "checkpoint_dir",
    },
    "eval": {
        "enabled", "batch_size", "max_examples", "num_beams", "max_length", "sequence_decoding",
        "every",
    },
}  # fmt: skip


def _check_keys(config: ml_collections.ConfigDict) -> None:
    """Refuses a key `CONFIG_KEYS` does not list, naming it and the nearest known key."""
    for section, known in CONFIG_KEYS.items():
        node = config if not section else config.get(section)
        if node is None:
            raise ValueError(f"config has no section config.{section}; add it (see default.py)")
        prefix = f"config.{section}." if section else "config."
        for key in node.keys():
            if key in known:
                continue
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"did you mean {prefix}{close[0]}?" if close else f"known: {sorted(known)}"
            raise ValueError(f"{prefix}{key} is not a setting rag_jax reads; {hint}")


def _check_paths(config: ml_collections.ConfigDict) -> None:
    """Every file or checkpoint the config names exists, before anything is built."""
    d, m = config.data, config.model
    files = []
    if d.source == "files":
        files = [("data.train_path", d.get("train_path"), True)]
        files.append(("data.eval_path", d.get("eval_path"), False))
        if not config.retrieval.get("index_dir"):
            files.append(("data.corpus_path", d.get("corpus_path"), True))
    for key, path, required in files:
        if required and not path:
            raise ValueError(f"config.{key} is not set; data.source='files' needs it")
        if path and not pathlib.Path(path).is_file():
            raise FileNotFoundError(f"config.{key}={path!r}: no such file; point it at the file")
    index_dir = config.retrieval.get("index_dir")
    if index_dir and not pathlib.Path(index_dir).is_dir():
        raise FileNotFoundError(
            f"config.retrieval.index_dir={index_dir!r}: no such directory; build one with "
            "experiments/build_index.py or unset it"
        )
    checkpoints_needed = {"pretrained": ["question_encoder_path"], "hf_rag": ["rag_path"]}
    for key in ("question_encoder_path", "passage_encoder_path", "generator_path", "rag_path"):
        path = m.get(key)
        if not path:
            if key in checkpoints_needed.get(m.init, []):
                raise ValueError(f"config.model.{key} is not set; model.init={m.init!r} needs it")
            continue
        if pathlib.Path(path).is_dir():
            continue
        try:
            hf.resolve(path)  # a hub id in the local cache (or reachable hub) is fine
        except Exception as e:
            raise FileNotFoundError(
                f"config.model.{key}={path!r} is not a checkpoint directory ({e}); set it to a "
                "directory holding config.json and the weights, or to a hub id"
            ) from None


def validate(config: ml_collections.ConfigDict, num_devices: int) -> None:
    """Start-up checks of invariants, each error naming the value and what would be right."""
    _check_keys(config)
    tc = config.train
    batches = {"train": ("global batch", tc.batch_size)}
    if config.eval.enabled:
        batches["eval"] = ("eval batch", config.eval.batch_size)
    for section, (what, size) in batches.items():
        try:
            sharding.check_batch_divisible(size, num_devices, what)
        except ValueError as e:
            raise ValueError(f"config.{section}.batch_size: {e}") from None
    if config.rag.variant not in ("sequence", "token"):
        raise ValueError(
            f"config.rag.variant must be sequence or token, got {config.rag.variant!r}"
        )
    if config.rag.get("context_pad_multiple", 0) < 0:
        raise ValueError(
            "config.rag.context_pad_multiple must be >= 0 (0 = always max_combined_length), "
            f"got {config.rag.context_pad_multiple}"
        )
    if config.data.get("answer_pad_multiple", 0) < 0:
        raise ValueError(
            "config.data.answer_pad_multiple must be >= 0 (0 = always answer_length), "
            f"got {config.data.answer_pad_multiple}"
        )
    if config.data.source not in ("synthetic", "files", "tfds"):
        raise ValueError(
            f"config.data.source must be synthetic, files or tfds, got {config.data.source!r}"
        )
    for key in ("steps", "batch_size", "log_every", "save_every", "grad_accum"):
        if tc[key] < 1:
            raise ValueError(f"config.train.{key} must be >= 1, got {tc[key]}")
    if tc.warmup_steps < 0:
        raise ValueError(f"config.train.warmup_steps must be >= 0, got {tc.warmup_steps}")
    refresh_every = config.retrieval.get("refresh_every", 0)
    passage_frozen = bool(tc.freeze) and re.search(tc.freeze, "passage_encoder/") is not None
    if refresh_every and passage_frozen:
        raise ValueError(
            f"config.retrieval.refresh_every={refresh_every} is for a trainable passage encoder, "
            f"but config.train.freeze={tc.freeze!r} freezes passage_encoder/; remove it there"
        )
    if not refresh_every and not passage_frozen:
        raise ValueError(
            f"config.train.freeze={tc.freeze!r} leaves the passage encoder trainable, but "
            "config.retrieval.refresh_every=0 never re-encodes the corpus, so the index would "
            "go stale; freeze passage_encoder/ or set refresh_every"
        )
    _check_paths(config)
