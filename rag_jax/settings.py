"""Every setting of a run, declared once: its default and what it does.

`defaults()` is the configuration every experiment config starts from (`experiments/configs/*.py`
change what differs and are locked, so a mistyped override fails); the defaults are those of the
default job, the synthetic world on a CPU. `validate(config, num_devices)` checks a config before
anything is built, each error naming the setting, its value and what would be right.
`check_overrides(argv)` refuses a mistyped `--config.x=...` flag in one line, with the closest
settings. Configs saved by an older version are completed with the defaults of the settings they
lack (`complete`).

`model.question_encoder`, `model.generator` and `data.fields` are open mappings: their keys are the
fields of `BertConfig`, of `BartConfig` and of the data readers, checked where they are used.
"""

import difflib
import pathlib
import re
import sys

import ml_collections

from rag_jax import hf, sharding

# section -> {key: (default, what it does)}; "" holds the top-level settings.
SCHEMA: dict[str, dict[str, tuple]] = {
    "": {
        "seed": (0, "the one seed: world, data split, init, dropout and batches derive from it"),
    },
    "data": {
        "source": ("synthetic", "where questions and passages come from: synthetic | files | tfds"),
        # Synthetic world.
        "num_entities": (
            400,
            "synthetic world size (facts = entities x 4 relations); 400: each training fact is "
            "seen ~7 times in 500 steps, too few to memorise before the retriever learns",
        ),
        "distractors_per_fact": (3, "synthetic passages per fact that repeat the question's words"),
        "eval_fraction": (
            0.25,
            "held out for evaluation: synthetic entities, or the articles of data.train_path "
            "when data.eval_path is empty (no article in both splits)",
        ),
        # Every source.
        "question_length": (24, "Q: question-encoder tokens per question"),
        "answer_length": (8, "T: label tokens (decoder start, BOS, answer, EOS, pads)"),
        "answer_pad_multiple": (
            8,
            "a training batch's labels: its longest, rounded up to this (0 = always T); exact, "
            "see training.inputs.label_width",
        ),
        "target": ("first", "which answer to train on: first | sample"),
        # Files.
        "train_path": ("", "training questions (.jsonl, .csv or .tsv; data.source='files')"),
        "eval_path": ("", "held-out questions; empty: whole articles of train_path are held out"),
        "corpus_path": ("", "passages (.tsv or .jsonl); not read with retrieval.index_dir"),
        "fields": ({}, "the files' key names where they differ from ours, e.g. gold_ids"),
        "max_train": (0, "use the first N training questions; 0 = all"),
        "max_eval": (0, "use the first N held-out questions; 0 = all"),
        # TFDS.
        "tfds_name": ("", "a TFDS builder (data.source='tfds'), e.g. natural_questions_open"),
        "train_split": ("train", "the TFDS training split"),
        "eval_split": ("validation", "the TFDS evaluation split"),
        "tfds_data_dir": ("", "where `tfds build` wrote the data; empty: TFDS's default"),
    },
    "model": {
        "init": (
            "random",
            "random (sizes below) | pretrained (checkpoint paths) | hf_rag (a whole HF RAG)",
        ),
        "dtype": ("float32", "compute dtype: float32 | bfloat16 (parameters stay float32)"),
        "remat": (False, "rematerialise layers in the backward pass"),
        "deterministic": (True, "no dropout (the tiny models underfit, not overfit)"),
        "question_encoder": (
            {
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "intermediate_size": 128,
                "max_position_embeddings": 128,
                "initializer_range": 0.02,
            },
            "BertConfig fields of both retriever towers with init='random' (H 64, 2 layers)",
        ),
        "generator": (
            {
                "d_model": 64,
                "encoder_layers": 2,
                "decoder_layers": 2,
                "encoder_attention_heads": 4,
                "decoder_attention_heads": 4,
                "encoder_ffn_dim": 128,
                "decoder_ffn_dim": 128,
                "max_position_embeddings": 128,
                "dropout": 0.0,
                # ~1/sqrt(d_model): BART's 0.02 (tuned for d_model 1024) leaves a 64-wide
                # generator on the answer prior for 300+ steps; 0.1 reads by step ~150.
                "init_std": 0.1,
            },
            "BartConfig fields of a generator trained from scratch (without generator_path)",
        ),
        "question_encoder_path": ("", "BERT or DPR checkpoint of the question tower (pretrained)"),
        "passage_encoder_path": ("", "the passage tower's checkpoint; empty: the question's"),
        "generator_path": ("", "BART checkpoint; empty: a new generator of model.generator's size"),
        "rag_path": ("", "an HF RAG checkpoint (init='hf_rag')"),
        "shared_towers": (True, "random init: both towers start from the same weights, as DPR"),
    },
    "warm_start": {
        "method": (
            "ict",
            "retriever warm start: ict (inverse cloze task on the passages, no QA pairs) | none",
        ),
        "steps": (800, "ICT steps"),
        "batch_size": (64, "ICT queries per step (B - 1 in-batch negatives each)"),
        "learning_rate": (3e-3, "ICT peak learning rate"),
        "keep_prob": (0.1, "how often the query sentence stays in its passage (ORQA: 0.1)"),
        "cache_dir": ("", "where warm starts are cached by fingerprint; empty: the workdir"),
        "reader_steps": (
            600,
            "generator warm start on *another* synthetic world (its questions with their answer "
            "passages), so it reads before joint training; 0 = none",
        ),
        "reader_entities": (400, "size of that other world"),
    },
    "rag": {
        "variant": ("sequence", "sequence (RAG-Sequence) | token (RAG-Token)"),
        "n_docs": (5, "N: passages per question"),
        "max_combined_length": (48, "S: generator context tokens (passage + question)"),
        "context_pad_multiple": (
            16,
            "a training batch's contexts: its longest, rounded up to this (one compiled step per "
            "width) instead of S as HF pads them; 0 = always S",
        ),
        "label_smoothing": (0.0, "HF RAG's label smoothing epsilon"),
        "exclude_bos_score": (False, "RAG-Sequence: leave the BOS log-prob out of the loss"),
        "closed_book": (False, "no retrieval: the question alone (needs n_docs=1)"),
    },
    "retrieval": {
        "index": ("exact", "exact | scann (host) | device (vectors sharded over the devices)"),
        "search_in_step": (
            True,
            "with the device index, the train step also searches for the next batch (no host "
            "round trip)",
        ),
        "passage_max_length": (48, "passage-encoder tokens per passage"),
        "passage_format": ("pair", "pair: title [SEP] text (DPR) | single: title + ' ' + text"),
        "encode_batch_size": (256, "passages per encoder call"),
        "index_dir": ("", "a folder of experiments/build_index.py: its store, vectors and index"),
        "refresh_every": (
            0,
            "a trainable passage encoder: re-encode and re-index every k steps in the background; "
            "0 = the stored vectors never change (the paper's setup)",
        ),
        "refresh_lag": (0, "steps until a refreshed index serves; 0 = refresh_every // 2"),
    },
    "train": {
        "steps": (500, "optimizer steps"),
        "batch_size": (16, "global batch; must divide by the device count"),
        "num_devices": (0, "data-parallel devices; 0 = all"),
        "optimizer": ("adamw", "adamw | sgd (momentum adam_b1)"),
        "learning_rate": (2e-3, "peak learning rate (the generator's)"),
        "warmup_steps": (30, "linear warmup from 0"),
        "decay": ("linear", "after warmup: linear | polynomial | constant"),
        "decay_power": (1.0, "for polynomial decay"),
        "end_lr_factor": (0.0, "final learning rate = learning_rate * this"),
        "retriever_lr_factor": (0.3, "retriever towers' learning rate / learning_rate"),
        "retriever_delay_steps": (
            0,
            "steps before the retriever towers train: until the generator reads, their gradient "
            "is noise that undoes the warm start",
        ),
        "weight_decay": (0.01, "AdamW decoupled weight decay"),
        "no_decay": (r"(bias|scale|ln|final_logits_bias)", "paths without weight decay (regex)"),
        "adam_b1": (0.9, "AdamW beta1 (SGD momentum)"),
        "adam_b2": (0.999, "AdamW beta2"),
        "adam_eps": (1e-8, "AdamW epsilon"),
        "grad_clip": (1.0, "global-norm clip; 0 = none"),
        "grad_accum": (1, "optimizer step every k batches"),
        "freeze": (
            r"^(passage_encoder/|generator/final_logits_bias)",
            "frozen parameter paths (regex): the passage encoder (stored vectors stay valid) "
            "and BART's final_logits_bias (a buffer in the reference)",
        ),
        "log_every": (25, "steps between logged training metrics"),
        "save_every": (100, "steps between checkpoints"),
        "keep_checkpoints": (2, "newest checkpoints kept"),
        "checkpoint_dir": ("", "empty: the workdir; gs://bucket/run for multi-host runs"),
        "bundle": (
            True,
            "at the end of a run, write <workdir>/bundle: the model, tokenizers, passages and the "
            "final passage encoder's index, all a user needs to answer (rag_jax.bundle)",
        ),
    },
    "eval": {
        "enabled": (True, "evaluate held-out questions before and after training"),
        "every": (0, "also every k steps (eval/* in metrics.jsonl); 0 = before/after only"),
        "batch_size": (32, "questions per evaluation batch"),
        "max_examples": (0, "the first N held-out questions; 0 = all"),
        "num_beams": (1, "1 = greedy"),
        "max_length": (8, "generated tokens, decoder start included"),
        "sequence_decoding": ("thorough", "thorough | fast (RAG-Sequence with beams > 1)"),
    },
}
# Settings whose value is a mapping of free keys (checked where they are used).
OPEN_MAPPINGS = ("model.question_encoder", "model.generator", "data.fields")


def defaults() -> ml_collections.ConfigDict:
    """A new config holding every setting at its default (the default job's)."""
    config = ml_collections.ConfigDict()
    for section, fields in SCHEMA.items():
        node = config
        if section:
            config[section] = ml_collections.ConfigDict()
            node = config[section]
        for key, (default, _) in fields.items():
            node[key] = ml_collections.ConfigDict(default) if isinstance(default, dict) else default
    return config


def describe(key: str) -> str:
    """What the setting `key` (e.g. "train.steps") does, as declared in `SCHEMA`."""
    section, _, name = key.rpartition(".")
    return SCHEMA[section][name][1]


def keys() -> list[str]:
    """Every setting's dotted name."""
    return [f"{s}.{k}" if s else k for s, fields in SCHEMA.items() for k in fields]


def complete(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`config` with the settings it lacks (a config saved by an older version) at their
    defaults; the settings it has are kept. Returns a new config."""
    full = defaults()
    for section, fields in SCHEMA.items():
        given = config if not section else config.get(section) or {}
        target = full if not section else full[section]
        for key in fields:
            if key in given:
                value = given[key]
                target[key] = (
                    ml_collections.ConfigDict(dict(value)) if hasattr(value, "items") else value
                )
    return full


def override(config: ml_collections.ConfigDict, changes: dict) -> ml_collections.ConfigDict:
    """Sets dotted keys (`{"train.steps": 50}`) in `config`, in place; returns it."""
    for key, value in changes.items():
        node = config
        *parents, leaf = key.split(".")
        for name in parents:
            node = node[name]
        node[leaf] = value
    return config


def closest(key: str) -> list[str]:
    """The declared settings nearest to `key` (for a mistyped one), best first."""
    section, _, leaf = key.rpartition(".")
    if section in SCHEMA:  # the section is right: compare names within it
        names = list(SCHEMA[section]) + ([s for s in SCHEMA if s] if not section else [])
        near = difflib.get_close_matches(leaf, names, n=3, cutoff=0.6)
        return [f"{section}.{n}" if section else n for n in near]
    return difflib.get_close_matches(key, keys(), n=3, cutoff=0.75)


def unknown_key_message(key: str) -> str:
    """One line naming an unknown setting and the closest declared ones."""
    near = closest(key)
    hint = f"did you mean {' or '.join(f'config.{n}' for n in near)}?" if near else ""
    section = key.rpartition(".")[0]
    if not hint:
        known = [n for n in keys() if n.rpartition(".")[0] == section]
        hint = f"the settings of config.{section} are {', '.join(known)}" if known else ""
    return f"config.{key} is not a setting rag_jax reads; {hint}".rstrip("; ")


def check_overrides(argv: list[str] | None = None) -> None:
    """Exits with one line (status 2) when a `--config.<key>=...` flag names no setting.

    ml_collections refuses such a flag too, but three chained tracebacks deep; this runs before
    flag parsing. Keys inside the open mappings (`OPEN_MAPPINGS`) are left to the config.
    """
    argv = sys.argv[1:] if argv is None else argv
    known = set(keys())
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        key = arg[len("--config.") :].split("=", 1)[0]
        if key in known or any(key.startswith(f"{m}.") for m in OPEN_MAPPINGS):
            continue
        print(f"error: {unknown_key_message(key)}", file=sys.stderr)
        raise SystemExit(2)


# ---------------------------------------------------------------------------------------------
# Start-up checks


def _check_keys(config: ml_collections.ConfigDict) -> None:
    """Refuses a setting `SCHEMA` does not declare, naming it and the nearest declared ones."""
    for section, fields in SCHEMA.items():
        node = config if not section else config.get(section)
        if node is None:
            raise ValueError(
                f"config has no section config.{section}; start from rag_jax.settings.defaults()"
            )
        for key in node.keys():
            if section == "" and key in SCHEMA:
                continue  # a section
            if key not in fields:
                raise ValueError(unknown_key_message(f"{section}.{key}" if section else key))


def _check_sizes(config: ml_collections.ConfigDict) -> None:
    """Counts that must be positive, each with its own message (before any divisibility)."""
    sizes = [
        ("train.steps", config.train.steps),
        ("train.batch_size", config.train.batch_size),
        ("train.log_every", config.train.log_every),
        ("train.save_every", config.train.save_every),
        ("train.grad_accum", config.train.grad_accum),
        ("rag.n_docs", config.rag.n_docs),
        ("rag.max_combined_length", config.rag.max_combined_length),
        ("data.question_length", config.data.question_length),
        ("data.answer_length", config.data.answer_length),
        ("retrieval.passage_max_length", config.retrieval.passage_max_length),
        ("retrieval.encode_batch_size", config.retrieval.encode_batch_size),
    ]
    if config.eval.enabled:
        sizes += [("eval.batch_size", config.eval.batch_size)]
        sizes += [("eval.num_beams", config.eval.num_beams)]
        sizes += [("eval.max_length", config.eval.max_length)]
    if config.warm_start.method == "ict":
        sizes += [("warm_start.steps", config.warm_start.steps)]
        sizes += [("warm_start.batch_size", config.warm_start.batch_size)]
    for key, value in sizes:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"config.{key} must be a positive integer, got {value!r}")
    counts = [
        ("train.num_devices", config.train.num_devices),
        ("train.warmup_steps", config.train.warmup_steps),
        ("train.retriever_delay_steps", config.train.retriever_delay_steps),
        ("rag.context_pad_multiple", config.rag.context_pad_multiple),
        ("data.answer_pad_multiple", config.data.answer_pad_multiple),
        ("data.max_train", config.data.max_train),
        ("data.max_eval", config.data.max_eval),
        ("eval.max_examples", config.eval.max_examples),
        ("eval.every", config.eval.every),
        ("retrieval.refresh_every", config.retrieval.refresh_every),
        ("retrieval.refresh_lag", config.retrieval.refresh_lag),
        ("warm_start.reader_steps", config.warm_start.reader_steps),
    ]
    for key, value in counts:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"config.{key} must be >= 0 (an integer), got {value!r}")


def _check_choices(config: ml_collections.ConfigDict) -> None:
    choices = [
        ("data.source", config.data.source, ("synthetic", "files", "tfds")),
        ("data.target", config.data.target, ("first", "sample")),
        ("model.init", config.model.init, ("random", "pretrained", "hf_rag")),
        ("model.dtype", config.model.dtype, ("float32", "bfloat16")),
        ("warm_start.method", config.warm_start.method, ("ict", "none")),
        ("rag.variant", config.rag.variant, ("sequence", "token")),
        ("retrieval.index", config.retrieval.index, ("exact", "scann", "device")),
        ("retrieval.passage_format", config.retrieval.passage_format, ("pair", "single")),
        ("train.optimizer", config.train.optimizer, ("adamw", "sgd")),
        ("train.decay", config.train.decay, ("linear", "polynomial", "constant")),
        ("eval.sequence_decoding", config.eval.sequence_decoding, ("thorough", "fast")),
    ]
    for key, value, allowed in choices:
        if value not in allowed:
            raise ValueError(f"config.{key} must be one of {' | '.join(allowed)}, got {value!r}")


def _check_paths(config: ml_collections.ConfigDict) -> None:
    """Every file or checkpoint the config names exists, before anything is built."""
    d, m = config.data, config.model
    paths = []
    if d.source == "files":
        paths = [("data.train_path", d.train_path, True), ("data.eval_path", d.eval_path, False)]
        if not config.retrieval.index_dir:
            paths.append(("data.corpus_path", d.corpus_path, True))
    for key, path, required in paths:
        if required and not path:
            raise ValueError(f"config.{key} is not set; data.source='files' needs it")
        if path and not pathlib.Path(path).is_file():
            raise FileNotFoundError(f"config.{key}={path!r}: no such file; point it at the file")
    index_dir = config.retrieval.index_dir
    if index_dir and not pathlib.Path(index_dir).is_dir():
        raise FileNotFoundError(
            f"config.retrieval.index_dir={index_dir!r}: no such directory; build one with "
            "experiments/build_index.py or unset it"
        )
    checkpoints_needed = {"pretrained": ["question_encoder_path"], "hf_rag": ["rag_path"]}
    for key in ("question_encoder_path", "passage_encoder_path", "generator_path", "rag_path"):
        path = m[key]
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
    _check_sizes(config)
    _check_choices(config)
    tc = config.train
    batches = {"train": ("global batch", tc.batch_size)}
    if config.eval.enabled:
        batches["eval"] = ("eval batch", config.eval.batch_size)
    for section, (what, size) in batches.items():
        try:
            sharding.check_batch_divisible(size, num_devices, what)
        except ValueError as e:
            raise ValueError(f"config.{section}.batch_size: {e}") from None
    refresh_every = config.retrieval.refresh_every
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
