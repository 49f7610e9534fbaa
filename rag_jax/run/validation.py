"""Start-up checks of a run's config: every error names the setting, its value and what would be
right, before anything is built.

`validate(config, num_devices)` checks the settings `rag_jax.run.settings.SCHEMA` declares: no
undeclared key, positive sizes, divisibility by the devices, choices, frozen parameters that the
optimizer would still move, paths that exist. `check_frozen_encoder` and `check_frozen_layers` are
also asked by the run builder once the generator's real config is known.
"""

import pathlib
import re

import ml_collections

from rag_jax import retriever_losses
from rag_jax.devices import sharding
from rag_jax.io import hf_format
from rag_jax.models import bart, flash, remat
from rag_jax.retrieval import sources
from rag_jax.run import metrics
from rag_jax.run.settings import SCHEMA, unknown_key_message


def _frozen_stub(layers: int) -> bart.BartConfig:
    """A tiny BART with the parameter names of a generator whose first `layers` encoder layers
    are fixed (the names below the cut do not depend on the widths), for start-up checks made
    before the generator is built."""
    return bart.BartConfig(
        vocab_size=2,
        d_model=2,
        encoder_layers=layers,
        decoder_layers=1,
        encoder_attention_heads=1,
        decoder_attention_heads=1,
        encoder_ffn_dim=2,
        decoder_ffn_dim=2,
        max_position_embeddings=2,
        frozen_encoder_layers=layers,
    )


def check_frozen_encoder(freeze: str, generator: bart.BartConfig, setting: int) -> None:
    """Raises unless `freeze` (`train.freeze`) freezes every generator parameter below the
    encoder's cut (`generator.frozen_encoder_layers`, from `generator_frozen_encoder_layers=
    setting`): the encoder's own input embedding, positions, embedding LayerNorm and layers, as
    `bart.frozen_encoder_paths` reads them from the parameter shapes. The stop-gradient keeps
    their gradient at zero, but the optimizer (weight decay, Adam's state) would still move
    them."""
    needed = [f"generator/{p}" for p in bart.frozen_encoder_paths(generator)]
    trained = [p for p in needed if not (freeze and re.search(freeze, p))]
    if trained:
        layers = generator.frozen_encoder_layers
        shown = ", ".join(trained[:4]) + (
            f" and {len(trained) - 4} more" if len(trained) > 4 else ""
        )
        raise ValueError(
            f"config.model.generator_frozen_encoder_layers={setting} stops the gradient at the "
            f"generator's encoder, but config.train.freeze={freeze!r} leaves {shown} trainable "
            f"(weight decay would still move them); freeze generator/encoder/ (embed_tokens, "
            f"positions, ln_embedding and layer_0 to layer_{layers - 1})"
        )


def check_frozen_layers(freeze: str, frozen: int, trained: int) -> None:
    """Raises unless `freeze` (`train.freeze`) freezes a causal generator's embedding and its
    first `frozen` layers, which `generator_trained_layers=trained` leaves fixed."""
    needed = ["generator/embed_tokens/embedding"]
    needed += [f"generator/layers_{i}/mlp_up_proj/kernel" for i in range(frozen)]
    if not (freeze and all(re.search(freeze, p) for p in needed)):
        layers = "|".join(str(i) for i in range(frozen))
        raise ValueError(
            f"config.model.generator_trained_layers={trained} fixes the generator's layers 0 to "
            f"{frozen - 1}, but config.train.freeze={freeze!r} leaves some of them or the "
            f"embedding trainable (weight decay would still move them); e.g. "
            f"'^(passage_encoder/|generator/(embed_tokens|layers_({layers}))/)'"
        )


def _check_keys(config: ml_collections.ConfigDict) -> None:
    """Refuses a setting `SCHEMA` does not declare, naming it and the nearest declared ones."""
    for section, fields in SCHEMA.items():
        node = config if not section else config.get(section)
        if node is None:
            raise ValueError(
                f"config has no section config.{section}; start from "
                "rag_jax.run.settings.defaults()"
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
    sizes += [("eval.batch_size", config.eval.batch_size)]
    sizes += [("eval.num_beams", config.eval.num_beams)]
    sizes += [("eval.max_length", config.eval.max_length)]
    if config.warm_start.method in ("ict", "gold"):
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
        ("eval.answer_examples", config.eval.answer_examples),
        ("eval.answer_seed", config.eval.answer_seed),
        ("eval.every", config.eval.every),
        ("eval.every_max_examples", config.eval.every_max_examples),
        ("model.generator_encoder_layers", config.model.generator_encoder_layers),
        ("model.generator_decoder_layers", config.model.generator_decoder_layers),
        ("warm_start.reader_batch_size", config.warm_start.reader_batch_size),
        ("warm_start.reader_context_length", config.warm_start.reader_context_length),
        ("warm_start.reader_trained_layers", config.warm_start.reader_trained_layers),
        ("retrieval.refresh_every", config.retrieval.refresh_every),
        ("retrieval.refresh_lag", config.retrieval.refresh_lag),
        ("warm_start.reader_steps", config.warm_start.reader_steps),
        ("eval.n_docs", config.eval.n_docs),
        ("retrieval.index_rows", config.retrieval.index_rows),
        ("train.retriever_random_negatives", config.train.retriever_random_negatives),
    ]
    for key, value in counts:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"config.{key} must be >= 0 (an integer), got {value!r}")
    if config.retrieval.index_rows >= 2**31:  # passage ids are int32 in the step
        raise ValueError(
            f"config.retrieval.index_rows={config.retrieval.index_rows} but passage ids are "
            f"int32: use at most {2**31 - 1}, or split the corpus"
        )


def _check_choices(config: ml_collections.ConfigDict) -> None:
    choices = [
        ("data.source", config.data.source, ("synthetic", "files", "tfds")),
        ("data.target", config.data.target, ("first", "sample")),
        ("data.sample_by", config.data.sample_by, ("question", "article")),
        ("model.init", config.model.init, ("random", "pretrained", "hf_rag")),
        ("model.dtype", config.model.dtype, ("float32", "bfloat16")),
        ("warm_start.method", config.warm_start.method, ("ict", "gold", "none")),
        ("warm_start.reader_data", config.warm_start.reader_data, ("synthetic", "files")),
        ("warm_start.reader_task", config.warm_start.reader_task, ("qa", "ssm", "qa+ssm")),
        ("model.generator_init", config.model.generator_init, ("random", "bert")),
        ("rag.prompt", config.rag.prompt, ("plain", "chat")),
        (
            "model.generator_decoder_init",
            config.model.generator_decoder_init,
            ("bert", "bert_cross", "random"),
        ),
        ("model.pooling", config.model.pooling, ("cls", "mean")),
        ("rag.variant", config.rag.variant, ("sequence", "token")),
        ("retrieval.index", config.retrieval.index, ("exact", "scann", "device")),
        ("retrieval.passage_format", config.retrieval.passage_format, ("pair", "single")),
        ("train.optimizer", config.train.optimizer, ("adamw", "sgd")),
        ("train.retriever_loss", config.train.retriever_loss, retriever_losses.OBJECTIVES),
        ("train.retriever_lm_score", config.train.retriever_lm_score, retriever_losses.LM_SCORES),
        ("train.optimizer_impl", config.train.optimizer_impl, ("optax", "fused")),
        ("model.attention_impl", config.model.attention_impl, flash.IMPLS),
        ("model.remat_policy", config.model.remat_policy, remat.POLICIES),
        ("train.decay", config.train.decay, ("linear", "polynomial", "constant")),
        ("eval.sequence_decoding", config.eval.sequence_decoding, ("thorough", "fast")),
        ("train.param_sharding", config.train.param_sharding, ("replicated", "fsdp")),
        ("retrieval.index_dtype", config.retrieval.index_dtype, ("", "float32", "bfloat16")),
        ("retrieval.device_storage", config.retrieval.device_storage, ("", "int8")),
        ("retrieval.source", config.retrieval.source, sources.SOURCES),
    ]
    for key, value, allowed in choices:
        if value not in allowed:
            raise ValueError(f"config.{key} must be one of {' | '.join(allowed)}, got {value!r}")


def _check_splits(d: ml_collections.ConfigDict) -> None:
    """With `data.split_field`, the splits asked are known ones, and one file read for both
    training and evaluation is read as two different splits."""
    if not d.split_field:
        return
    known = [s.strip() for s in d.splits.split(",") if s.strip()]
    if not known:
        raise ValueError(
            f"config.data.split_field={d.split_field!r} needs config.data.splits, the values it "
            "may take (comma-separated, e.g. 'train,dev,test')"
        )
    for key in ("train_split", "eval_split"):
        if d[key] and d[key] not in known:
            raise ValueError(f"config.data.{key}={d[key]!r} is not one of data.splits {known}")
    same = (
        d.eval_path and pathlib.Path(d.eval_path).resolve() == pathlib.Path(d.train_path).resolve()
    )
    if same and (not d.train_split or not d.eval_split or d.train_split == d.eval_split):
        raise ValueError(
            f"config.data.train_path and eval_path are one file ({d.train_path}): train_split "
            f"({d.train_split!r}) and eval_split ({d.eval_split!r}) must be two different splits"
        )


def _check_paths(config: ml_collections.ConfigDict) -> None:
    """Every file or checkpoint the config names exists, before anything is built."""
    d, m = config.data, config.model
    paths = []
    if d.source == "files":
        paths = [("data.train_path", d.train_path, True), ("data.eval_path", d.eval_path, False)]
        if not config.retrieval.index_dir and not pathlib.Path(d.corpus_path).is_dir():
            # A folder is one of plain documents (retrieval.documents); else passage files.
            files = [f.strip() for f in d.corpus_path.split(",") if f.strip()] or [""]
            paths += [("data.corpus_path", f, True) for f in files]
        _check_splits(d)
    if config.warm_start.reader_steps and config.warm_start.reader_data == "files":
        w = config.warm_start
        paths += [("warm_start.reader_questions_path", w.reader_questions_path, True)]
        files = [f.strip() for f in w.reader_corpus_path.split(",") if f.strip()] or [""]
        paths += [("warm_start.reader_corpus_path", f, True) for f in files]
    for key, path, required in paths:
        if required and not path:
            raise ValueError(f"config.{key} is not set; the config reads it (data.source='files')")
        if path and not pathlib.Path(path).is_file():
            raise FileNotFoundError(f"config.{key}={path!r}: no such file; point it at the file")
    index_dir = config.retrieval.index_dir
    if index_dir and not pathlib.Path(index_dir).is_dir():
        raise FileNotFoundError(
            f"config.retrieval.index_dir={index_dir!r}: no such directory; build one with "
            "experiments/build_index.py or unset it"
        )
    checkpoints_needed = {"pretrained": ["question_encoder_path"], "hf_rag": ["rag_path"]}
    for key in (
        "question_encoder_path",
        "passage_encoder_path",
        "generator_path",
        "generator_bert_path",
        "rag_path",
    ):
        path = m[key]
        if not path:
            if key in checkpoints_needed.get(m.init, []):
                raise ValueError(f"config.model.{key} is not set; model.init={m.init!r} needs it")
            continue
        if pathlib.Path(path).is_dir():
            continue
        if key == "generator_path" and path.endswith(".gguf"):  # a causal LM in one file
            if not pathlib.Path(path).is_file():
                raise FileNotFoundError(f"config.model.generator_path={path!r}: no such file")
            continue
        try:
            hf_format.resolve(path)  # a hub id in the local cache (or reachable hub) is fine
        except Exception as e:
            raise FileNotFoundError(
                f"config.model.{key}={path!r} is not a checkpoint directory ({e}); set it to a "
                "directory holding config.json and the weights, or to a hub id"
            ) from None


def _check_answer_memo(config: ml_collections.ConfigDict) -> None:
    """`eval.answer_memo` decodes what `training.memo_decoding` memoises; refused at start-up, not
    after training (the causal generator is checked when the memo is built)."""
    if not (config.eval.enabled and config.eval.answer_memo):
        return
    wrong = [
        f"config.{key}={value!r}"
        for key, value, right in (
            ("rag.variant", config.rag.variant, "sequence"),
            ("eval.sequence_decoding", config.eval.sequence_decoding, "thorough"),
            ("eval.num_beams", config.eval.num_beams, 1),
            ("rag.label_smoothing", config.rag.label_smoothing, 0),
        )
        if value != right
    ]
    if wrong:
        raise ValueError(
            "config.eval.answer_memo memoises greedy RAG-Sequence thorough decoding without label "
            f"smoothing, but {', '.join(wrong)}; set config.eval.answer_memo=False to decode "
            "without it"
        )


def _check_retriever_objective(config: ml_collections.ConfigDict) -> None:
    """`train.retriever_*`: a valid objective (`retriever_losses.RetrieverObjective` names the
    value at fault), and candidates for it to span."""
    t = config.train
    objective = retriever_losses.RetrieverObjective.from_config(config)
    if t.retriever_shuffle_reader and not (t.answer_memo and objective.separate(config.rag.n_docs)):
        raise ValueError(
            "config.train.retriever_shuffle_reader permutes the memoised reader likelihoods the "
            "retriever's own objective reads: set config.train.answer_memo=True and a "
            "retriever_loss other than marginal (or retriever_candidates > rag.n_docs)"
        )
    if (
        t.retriever_loss in retriever_losses.LEAVE_ONE_OUT
        and objective.count(config.rag.n_docs) < 2
    ):
        raise ValueError(
            f"config.train.retriever_loss={t.retriever_loss!r} leaves one candidate out of K, "
            f"but K = {objective.count(config.rag.n_docs)} (rag.n_docs={config.rag.n_docs}, "
            f"retriever_candidates={t.retriever_candidates}, retriever_random_negatives="
            f"{t.retriever_random_negatives}): set train.retriever_candidates >= 2"
        )
    r = config.retrieval  # the step searches for itself (experiment._asks_in_step's rule)
    in_step = r.index == "device" and r.search_in_step and not r.refresh_every
    if t.retriever_fixed_candidates and (config.rag.closed_book or in_step):
        raise ValueError(
            "config.train.retriever_fixed_candidates fixes the passages a host search finds "
            "before training; it needs retrieval (not rag.closed_book) on the host (not "
            "retrieval.index='device' with retrieval.search_in_step)"
        )
    if objective.separate(config.rag.n_docs) and config.rag.closed_book:
        raise ValueError(
            f"config.train.retriever_loss={t.retriever_loss!r} (candidates "
            f"{t.retriever_candidates}, random negatives {t.retriever_random_negatives}) "
            "trains the retriever, but config.rag.closed_book "
            "retrieves nothing; leave the train.retriever_* settings at their defaults"
        )


def _check_reader_trunk(config: ml_collections.ConfigDict) -> None:
    """`train.reader_trunk` caches the reader's frozen layers' states of rows fixed before
    training: a causal reader trained in its top layers only, its embedding frozen, fixed
    candidates found by a host search, fixed labels (`training.reader_states` checks the rest
    once the reader is built)."""
    t, m, r = config.train, config.model, config.retrieval
    if not t.reader_trunk:
        return
    name = "config.train.reader_trunk"
    if m.init == "hf_rag" or not m.generator_path:
        raise ValueError(
            f"{name} caches a causal reader's lower layers' states, but the generator is BART "
            f"(model.init={m.init!r}, model.generator_path={m.generator_path!r}): set "
            "config.model.generator_path to a Llama-family checkpoint"
        )
    if not m.generator_trained_layers:
        raise ValueError(
            f"{name} trains the reader's top layers on its lower ones' cached states: set "
            "config.model.generator_trained_layers=k (the top k train, the rest stay frozen)"
        )
    if not t.retriever_fixed_candidates:
        raise ValueError(
            f"{name} computes the reader's states of each question's candidates before "
            "training: set config.train.retriever_fixed_candidates=True (candidates searched "
            "every step are not known ahead)"
        )
    if (r.index == "device" and r.search_in_step and not r.refresh_every) or config.rag.closed_book:
        raise ValueError(
            f"{name} needs each question's candidates fixed by a host search before training, "
            "not searched by the step (retrieval.index='device' with retrieval.search_in_step) "
            "nor closed book"
        )
    if config.data.target != "first":
        raise ValueError(
            f"{name} caches the states of each question's answer, but config.data.target="
            f"{config.data.target!r} changes it with the step: use 'first'"
        )
    if t.answer_memo:
        raise ValueError(
            f"{name} trains the reader's top layers; config.train.answer_memo holds a frozen "
            "reader's likelihoods: set one of them"
        )
    embedding = "generator/embed_tokens/embedding"
    if not (t.freeze and re.search(t.freeze, embedding)):
        raise ValueError(
            f"{name} computes the states of the reader's embedding and lower layers once, so the "
            f"embedding must stay frozen (a tied one is the LM head too: it then stays frozen), "
            f"but config.train.freeze={t.freeze!r} leaves {embedding} trainable"
        )


def validate(config: ml_collections.ConfigDict, num_devices: int, *, paths: bool = True) -> None:
    """Start-up checks of invariants, each error naming the value and what would be right.

    `paths=False` skips the checks of files and checkpoints (planning a run on a machine that
    has none of them, `experiments/tpu_compile.py`)."""
    _check_keys(config)
    _check_sizes(config)
    _check_choices(config)
    metrics.recall_ks(config)  # at start-up, not when the first evaluation reads it
    tc = config.train
    batches = {"train": ("global batch", tc.batch_size)}
    if config.eval.enabled:
        batches["eval"] = ("eval batch", config.eval.batch_size)
    for section, (what, size) in batches.items():
        try:
            sharding.check_batch_divisible(size, num_devices, what)
        except ValueError as e:
            raise ValueError(f"config.{section}.batch_size: {e}") from None
    seed = config.data.sample_seed
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < -1:
        raise ValueError(f"config.data.sample_seed must be -1 (the first N) or >= 0, got {seed!r}")
    seed = config.init_seed
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < -1:
        raise ValueError(f"config.init_seed must be -1 (= seed) or a seed >= 0, got {seed!r}")
    scale = config.rag.doc_score_scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"config.rag.doc_score_scale must be a positive number, got {scale!r}")
    rate = config.warm_start.reader_learning_rate
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or rate < 0:
        raise ValueError(f"config.warm_start.reader_learning_rate must be >= 0, got {rate!r}")
    frozen = config.model.generator_frozen_encoder_layers
    if isinstance(frozen, bool) or not isinstance(frozen, int) or frozen < -1:
        raise ValueError(
            f"config.model.generator_frozen_encoder_layers must be -1 (all), 0 (none) or a "
            f"count of layers, got {frozen!r}"
        )
    if frozen:  # the last frozen layer is checked once the generator is built (experiment)
        check_frozen_encoder(tc.freeze, _frozen_stub(max(frozen, 1)), frozen)
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
    head = config.retrieval.passage_head_layers
    if isinstance(head, bool) or not isinstance(head, int) or head < 0:
        raise ValueError(f"config.retrieval.passage_head_layers must be >= 0, got {head!r}")
    if head and not refresh_every:
        raise ValueError(
            f"config.retrieval.passage_head_layers={head} trains the passage tower's top layers: "
            "set config.retrieval.refresh_every too, so the index follows them"
        )
    if config.rag.closed_book and config.eval.n_docs > 1:
        raise ValueError(
            f"config.eval.n_docs={config.eval.n_docs} but config.rag.closed_book retrieves "
            "nothing (one empty passage); use 0"
        )
    domain = config.warm_start.reader_domain_steps
    if domain and not config.model.generator_trained_layers:
        raise ValueError(
            f"config.warm_start.reader_domain_steps={domain} fine-tunes the reader's top layers: "
            "set config.model.generator_trained_layers=k (the top k train, the rest stay fixed)"
        )
    _check_reader_trunk(config)  # before the objective's checks: they name other settings
    _check_retriever_objective(config)
    _check_answer_memo(config)
    if paths:
        _check_paths(config)
