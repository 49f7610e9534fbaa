"""The warm starts a run's config asks for, each cached by a fingerprint of what it depends on.

- `retriever(...)`: both retriever towers after the inverse cloze task (`training.ict`) on the
  run's own passages, no QA pairs (`config.warm_start.method = "ict"`);
- `generator(...)`: the generator after reading on *another* synthetic world, or on files
  (`training.reader`, `config.warm_start.reader_steps`);
- `domain_reader(...)`: then its top layers fine-tuned on the run's own training questions with
  their gold passages (`config.warm_start.reader_domain_steps`): a reader trained apart.

A warm start is a deterministic function of what its key lists (seed, data, initial parameters,
settings), so it is stored in `<warm_start.cache_dir or workdir>/warm_start/<fingerprint>.msgpack`
and a resume, or another run sharing `cache_dir`, reuses it; any change recomputes it.
"""

import dataclasses
import functools
import hashlib
import json
import pathlib
import re

import flax.serialization
import jax

from rag_jax.retrieval import encoder_id, files
from rag_jax.retrieval.corpus import Passage, corpus_files, read_corpus
from rag_jax.retrieval.tokenizer_id import tokenizer_fingerprint
from rag_jax.run import checkpoints, data, settings, synthetic
from rag_jax.run.index_build import workdir_store
from rag_jax.training import gold_pairs, ict, reader, salient

# The reader warm start's world: another seed, so other entities and independently drawn facts.
READER_WORLD_SEED_OFFSET = 1_000_003


def cached(label: str, key: dict, template: dict, compute, directory) -> dict:
    """`compute(progress)` (parameter trees shaped like `template`), cached in
    `<directory>/<fingerprint of key>.msgpack`; a computation stopped midway (SIGTERM) keeps its
    state in `<fingerprint>.partial.msgpack` (`checkpoints.Progress`) and resumes from it.
    `compute` may return `(value, log)`: the log (JSON) is kept as `<fingerprint>.log.json`."""
    fingerprint = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    directory = pathlib.Path(directory)
    path = directory / f"{fingerprint}.msgpack"
    if path.is_file():
        try:
            value = flax.serialization.from_bytes(jax.device_get(template), path.read_bytes())
        except Exception as e:  # msgpack/structure errors name neither the file nor the cause
            raise ValueError(f"{path}: corrupt warm-start cache ({e}); delete it") from e
        print(f"{label}: reusing {path}", flush=True)
        return value
    progress = checkpoints.Progress(directory / f"{fingerprint}.partial.msgpack", label)
    value = compute(progress)
    value, log = value if isinstance(value, tuple) else (value, None)
    value = jax.device_get(value)
    if jax.process_index() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        if log is not None:
            record = {"label": label, "key": key, "log": log}
            files.write_atomic(directory / f"{fingerprint}.log.json", json.dumps(record).encode())
        files.write_atomic(path, flax.serialization.to_bytes(value))
    progress.clear()
    return value


def cache_dir(config, workdir) -> pathlib.Path:
    """Where the warm starts of a run are cached."""
    return pathlib.Path(config.warm_start.cache_dir or workdir) / "warm_start"


def retriever(config, rag_cfg, passage_cfg, params, tokenizer, store, workdir, train=()) -> dict:
    """`params` with both retriever towers after their warm start (`warm_start.method`): ICT on
    `store`'s passages, or `gold`, the `train` questions with their gold passages
    (`gold_pairs`)."""
    if passage_cfg != rag_cfg.question_encoder:
        raise ValueError("the retriever warm start needs both towers to share one architecture")
    w = config.warm_start
    names = ("question_encoder", "passage_encoder")
    towers = {k: params[k] for k in names}
    key = {
        "warm_start": {
            k: v for k, v in w.items() if k != "cache_dir" and not k.startswith("reader_")
        },
        "retrieval": {k: config.retrieval[k] for k in ("passage_max_length", "passage_format")},
        "question_length": config.data.question_length,
        "seed": settings.init_seed(config),
        "corpus": store.checksum,
        "question_encoder": encoder_id.encoder_fingerprint(passage_cfg, towers["question_encoder"]),
        "passage_encoder": encoder_id.encoder_fingerprint(passage_cfg, towers["passage_encoder"]),
        "score_scale": rag_cfg.doc_score_scale,
    }
    label = {"ict": "ICT warm start", "gold": "gold warm start"}[w.method]
    if w.method == "gold":
        rows = {store.ids[i]: i for i in range(len(store))}
        pairs = [(e.question, rows[g]) for e in train for g in e.gold_ids[:1] if g in rows]
        if not pairs:
            raise ValueError("warm_start.method='gold': no training question has a gold passage")
        key["pairs"] = hashlib.sha256(json.dumps(pairs).encode()).hexdigest()
        run = functools.partial(
            gold_pairs.gold_warm_start,
            questions=[q for q, _ in pairs],
            passages=[(store.title(r), store.text(r)) for _, r in pairs],
            rows=[r for _, r in pairs],
        )
        what = f" on {len(pairs)} questions"
    else:
        passages = [(store.title(i), store.text(i)) for i in range(len(store))]
        run = functools.partial(ict.ict_warm_start, passages=passages, keep_prob=w.keep_prob)
        what = ""

    def compute(progress):
        q_params, p_params, log = run(
            rag_cfg.question_encoder,
            params["question_encoder"],
            params["passage_encoder"],
            tokenizer,
            steps=w.steps,
            batch_size=w.batch_size,
            learning_rate=w.learning_rate,
            seed=settings.init_seed(config),
            query_length=config.data.question_length,
            passage_length=config.retrieval.passage_max_length,
            passage_format=config.retrieval.passage_format,
            scale=rag_cfg.doc_score_scale,
            progress=progress,
        )
        last = log[-1]
        print(
            f"{label}: {w.steps} steps{what}, loss {last['loss']:.3f}, in-batch accuracy "
            f"{last['in_batch_accuracy']:.3f}",
            flush=True,
        )
        towers = {"question_encoder": q_params, "passage_encoder": p_params}
        return towers, (log if w.method == "gold" else None)  # ICT's log is not kept

    warm = cached(label, key, towers, compute, cache_dir(config, workdir))
    return dict(params, **warm)


def generator(config, rag_cfg, params, tokenizer, workdir, own_world) -> dict:
    """`params` with the generator after `reader.reader_warm_start`: on another synthetic world
    (`warm_start.reader_data = "synthetic"`), or on files of questions and their gold passages,
    or salient spans of those passages (`"files"`, `_generator_on_files`).

    Facts about an entity whose name also occurs in `own_world` (the experiment's) are left out,
    so no name of the experiment's world is seen with an answer.
    """
    d, w = config.data, config.warm_start
    if w.reader_data == "files":
        return _generator_on_files(config, rag_cfg, params, tokenizer, workdir)
    if d.source != "synthetic":
        raise ValueError(
            "config.warm_start.reader_steps with reader_data='synthetic' needs "
            f"data.source='synthetic' (it reads another synthetic world); got {d.source!r}: set "
            "reader_steps=0, or reader_data='files' with reader_questions_path and "
            "reader_corpus_path"
        )
    world = synthetic.make_world(
        synthetic.WorldConfig(
            seed=settings.init_seed(config) + READER_WORLD_SEED_OFFSET,
            num_entities=w.reader_entities,
            distractors_per_fact=d.distractors_per_fact,
            eval_fraction=d.eval_fraction,
        )
    )
    own = {f.entity for f in own_world.facts}
    kept = {f.gold_id for f in world.facts if f.entity not in own}  # answer passages kept
    examples = [
        e
        for e in data.examples_from_world(world, "train") + data.examples_from_world(world, "eval")
        if e.gold_ids[0] in kept
    ]
    key = {
        "reader": {k: v for k, v in w.items() if _reads_first(k)},
        "world": dataclasses.asdict(world.config),
        "train": {k: config.train[k] for k in ("batch_size", "learning_rate")},
        "answer_length": d.answer_length,
        "examples": hashlib.sha256(" ".join(e.id for e in examples).encode()).hexdigest(),
        "rag": [rag_cfg.max_combined_length, rag_cfg.label_smoothing, rag_cfg.exclude_bos_score],
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "generator": _generator_fingerprint(rag_cfg.generator, params["generator"]),
        **_dropout_key(config, rag_cfg),
    }

    def compute(progress):
        passages = [Passage(p.id, p.title, p.text) for p in world.passages]
        layout = rag_cfg.context_layout
        store = workdir_store(passages, tokenizer, pathlib.Path(workdir) / "reader_world", layout)
        weights, log = reader.reader_warm_start(
            rag_cfg,
            params["generator"],
            tokenizer,
            store,
            examples,
            steps=w.reader_steps,
            batch_size=config.train.batch_size,
            learning_rate=config.train.learning_rate,
            seed=settings.init_seed(config),
            answer_length=d.answer_length,
            deterministic=config.model.deterministic,
            progress=progress,
        )
        print(
            f"reader warm start: {w.reader_steps} steps on {len(examples)} questions of another "
            f"world, loss {log[0]['loss']:.3f} -> {log[-1]['loss']:.3f}",
            flush=True,
        )
        return {"generator": weights}

    template = {"generator": params["generator"]}
    warm = cached("reader warm start", key, template, compute, cache_dir(config, workdir))
    return dict(params, **warm)


def _reads_first(setting: str) -> bool:
    """Whether a `warm_start` setting shapes the first reader warm start (`generator`), so its
    key: the `reader_*` ones but `reader_domain_steps`, the later warm start's own (a pipeline
    row shares the first one's cache with the rows that skip the second)."""
    return setting.startswith("reader_") and setting != "reader_domain_steps"


def _generator_fingerprint(g_cfg, generator_params) -> str:
    """The generator's fingerprint in a warm start's key: the function it computes, not where
    training cuts its gradient (a causal generator's `frozen_layers`, which
    `model.generator_trained_layers` sets), so rows training its top layers share the warm start
    of those that freeze it (the keys of `frozen_layers = 0` are those from before)."""
    if getattr(g_cfg, "frozen_layers", 0):
        g_cfg = g_cfg.replace(frozen_layers=0)
    return encoder_id.encoder_fingerprint(g_cfg, generator_params)


def _dropout_key(config, rag_cfg) -> dict:
    """The reader's dropout, for its cache key: nothing when it trains without (so the keys of
    runs without dropout are those from before dropout could be asked for)."""
    if config.model.deterministic or not reader.uses_dropout(rag_cfg.generator):
        return {}
    return {"dropout": True}


def _frozen_generator_paths(freeze: str, generator_params) -> str:
    """A regex over the generator's own parameter paths matching exactly those `freeze` (a
    `config.train.freeze` regex over `generator/...` paths) freezes in training."""
    if not freeze:
        return ""
    pattern = re.compile(freeze)
    paths = [
        "/".join(str(getattr(k, "key", k)) for k in path)
        for path, _ in jax.tree_util.tree_flatten_with_path(generator_params)[0]
    ]
    frozen = [p for p in paths if pattern.search(f"generator/{p}")]
    return "|".join(f"{re.escape(p)}$" for p in frozen)


def _reader_trained_layers(config, rag_cfg, generator_params, setting="reader_trained_layers"):
    """(the reader's RagConfig, a regex over the generator's paths it leaves fixed).

    `warm_start.reader_trained_layers = k` (or the `model.` `setting` named) trains a causal
    generator's top k layers and its final norm: the embedding (the tied head too) and the layers
    below are fixed and no gradient flows into them (`LlamaConfig.frozen_layers`). 0 leaves fixed
    what `train.freeze` freezes in joint training."""
    section = "model" if setting == "generator_trained_layers" else "warm_start"
    k = config[section][setting]
    if not k:
        return rag_cfg, _frozen_generator_paths(config.train.freeze, generator_params)
    layers = getattr(rag_cfg.generator, "num_hidden_layers", None)
    if layers is None or not 0 < k <= layers:
        raise ValueError(
            f"config.{section}.{setting}={k} needs a causal generator with at least "
            f"that many layers (its generator has {layers or 'none: BART'})"
        )
    below = "|".join(str(i) for i in range(layers - k))
    pattern = "embed_tokens/" + (f"|layers_({below})/" if below else "")
    reader_cfg = rag_cfg.replace(generator=rag_cfg.generator.replace(frozen_layers=layers - k))
    return reader_cfg, _frozen_generator_paths(f"^generator/({pattern})", generator_params)


def _generator_on_files(config, rag_cfg, params, tokenizer, workdir) -> dict:
    """The reader warm start on `reader_questions_path` with their gold passages from
    `reader_corpus_path` (task "qa"), on salient spans masked in those passages ("ssm",
    `training.salient`), or both on alternate steps ("qa+ssm"). Nothing of the run's evaluation
    data is read; only the generator trains, and what `config.train.freeze` freezes of it in
    training (the frozen layers of a `frozen_encoder_layers` generator) stays fixed here too.
    Examples whose answer the reader's context cuts off (`reader.answers_in_context`) are left
    out; the log beside the cache counts them per task (`answer_cut`)."""
    d, w = config.data, config.warm_start
    corpus = corpus_files(w.reader_corpus_path)
    passages = list(read_corpus(corpus))
    context_length = w.reader_context_length or rag_cfg.max_combined_length
    seed = settings.init_seed(config)
    tasks = w.reader_task.split("+")
    pools = []
    if "qa" in tasks:
        pools.append(data.read_examples(w.reader_questions_path, dict(d.fields or {}) or None))
    if "ssm" in tasks:
        mask = getattr(tokenizer, "mask_token", None) or salient.MASK
        # Sentences a context of `context_length` tokens still shows (~4 characters a token).
        limit = 4 * max(context_length - d.question_length, 16)
        pools.append(
            salient.salient_examples(passages, seed=seed, mask_token=mask, max_chars=limit)
        )
    for task, pool in zip(tasks, pools):
        if not pool:
            source = w.reader_questions_path if task == "qa" else w.reader_corpus_path
            raise ValueError(
                f"config.warm_start.reader_task={w.reader_task!r}: the {task} task found no "
                f"examples in {source}"
            )
    batch_size = w.reader_batch_size or config.train.batch_size
    learning_rate = w.reader_learning_rate or config.train.learning_rate
    reader_cfg, frozen = _reader_trained_layers(config, rag_cfg, params["generator"])
    reader_settings = {
        k: v
        for k, v in w.items()
        if _reads_first(k)
        and "path" not in k
        # 0 (what train.freeze leaves) keeps the keys of caches from before the setting
        and not (k == "reader_trained_layers" and not v)
    }
    key = {
        "reader": reader_settings,
        "files": [files.sha256_file(p) for p in [w.reader_questions_path, *corpus]],
        "fields": dict(d.fields or {}),
        "seed": seed,
        "batch_size": batch_size,
        "learning_rate": learning_rate,
        "answer_length": d.answer_length,
        "context_length": context_length,
        "keep_question": config.rag.keep_question,
        "frozen": frozen,
        "rag": [rag_cfg.label_smoothing, rag_cfg.exclude_bos_score, rag_cfg.prefix],
        # A causal generator's answer cue is part of its prompt (empty for BART: old keys hold).
        "layout": [rag_cfg.title_sep, rag_cfg.doc_sep]
        + ([rag_cfg.suffix] if rag_cfg.suffix else []),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "generator": _generator_fingerprint(rag_cfg.generator, params["generator"]),
        # Examples whose answer the context cuts off are left out (`reader.answers_in_context`).
        "answers": "within the kept context",
        **_dropout_key(config, rag_cfg),
    }

    def compute(progress):
        layout = rag_cfg.context_layout
        store = workdir_store(
            passages, tokenizer, pathlib.Path(workdir) / "reader_passages", layout
        )
        kept, cut = [], {}
        for task, pool in zip(tasks, pools):
            shown = reader.answers_in_context(
                store, tokenizer, pool, context_length, config.rag.keep_question
            )
            kept.append([e for e, ok in zip(pool, shown) if ok])
            cut[task] = int(len(pool) - shown.sum())
        weights, log = reader.reader_warm_start(
            reader_cfg,
            params["generator"],
            tokenizer,
            store,
            kept[0],
            alternate_with=kept[1] if len(kept) > 1 else None,
            steps=w.reader_steps,
            batch_size=batch_size,
            learning_rate=learning_rate,
            seed=seed,
            answer_length=d.answer_length,
            context_length=context_length,
            freeze=frozen,
            pad_multiple=config.rag.context_pad_multiple,
            keep_question=config.rag.keep_question,
            deterministic=config.model.deterministic,
            progress=progress,
        )
        sizes = " and ".join(f"{len(p)} {t} examples" for t, p in zip(tasks, kept))
        left_out = ", ".join(f"{cut[t]} {t}" for t in tasks)
        print(
            f"reader warm start: {w.reader_steps} steps on {sizes} ({left_out} left out: the "
            f"context cuts their answer off), loss {log[0]['loss']:.3f} -> {log[-1]['loss']:.3f}",
            flush=True,
        )
        examples = dict(zip(tasks, map(len, kept)))
        return {"generator": weights}, {"examples": examples, "answer_cut": cut, "log": log}

    template = {"generator": params["generator"]}
    warm = cached("reader warm start", key, template, compute, cache_dir(config, workdir))
    return dict(params, **warm)


def domain_reader(config, rag_cfg, params, tokenizer, store, workdir, train) -> dict:
    """`params` with the reader's top `model.generator_trained_layers` layers (and final norm)
    fine-tuned on the run's own training questions `train` with their gold passages of the run's
    `store` (`warm_start.reader_domain_steps`), starting from the generator `params` holds (after
    `generator`'s warm start, if any): the reader a pipeline trains apart from the retriever.

    `train` is what the run trains on (`data.train_split` of a split file, less the articles
    `data.eval_fraction` holds out), so no evaluation question is read. Examples whose answer
    the context cuts off are left out. Cached by fingerprint, keyed on the generator it starts
    from (so on the earlier warm start too)."""
    d, w = config.data, config.warm_start
    rows = {store.ids[i] for i in range(len(store))}
    pool = [e for e in train if e.gold_ids and e.gold_ids[0] in rows]
    if not pool:
        raise ValueError(
            "config.warm_start.reader_domain_steps: no training question has a gold passage"
        )
    context_length = w.reader_context_length or rag_cfg.max_combined_length
    seed = settings.init_seed(config)
    batch_size = w.reader_batch_size or config.train.batch_size
    learning_rate = w.reader_learning_rate or config.train.learning_rate
    reader_cfg, frozen = _reader_trained_layers(
        config, rag_cfg, params["generator"], "generator_trained_layers"
    )
    questions = [(e.id, e.question, e.answers[0], e.gold_ids[0]) for e in pool]
    key = {
        "domain_reader": {"steps": w.reader_domain_steps, "frozen": frozen},
        "questions": hashlib.sha256(json.dumps(questions).encode()).hexdigest(),
        "corpus": store.checksum,
        "seed": seed,
        "batch_size": batch_size,
        "learning_rate": learning_rate,
        "answer_length": d.answer_length,
        "context_length": context_length,
        "keep_question": config.rag.keep_question,
        "rag": [rag_cfg.label_smoothing, rag_cfg.exclude_bos_score, rag_cfg.context_layout],
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "generator": _generator_fingerprint(rag_cfg.generator, params["generator"]),
        **_dropout_key(config, rag_cfg),
    }

    def compute(progress):
        shown = reader.answers_in_context(
            store, tokenizer, pool, context_length, config.rag.keep_question
        )
        kept = [e for e, ok in zip(pool, shown) if ok]
        weights, log = reader.reader_warm_start(
            reader_cfg,
            params["generator"],
            tokenizer,
            store,
            kept,
            steps=w.reader_domain_steps,
            batch_size=batch_size,
            learning_rate=learning_rate,
            seed=seed,
            answer_length=d.answer_length,
            context_length=context_length,
            freeze=frozen,
            pad_multiple=config.rag.context_pad_multiple,
            keep_question=config.rag.keep_question,
            deterministic=config.model.deterministic,
            progress=progress,
        )
        print(
            f"domain reader: {w.reader_domain_steps} steps on {len(kept)} training questions "
            f"({len(pool) - len(kept)} left out: the context cuts their answer off), loss "
            f"{log[0]['loss']:.3f} -> {log[-1]['loss']:.3f}",
            flush=True,
        )
        record = {"questions": [e.id for e in kept], "answer_cut": len(pool) - len(kept)}
        return {"generator": weights}, {**record, "log": log}

    template = {"generator": params["generator"]}
    warm = cached("domain reader", key, template, compute, cache_dir(config, workdir))
    return dict(params, **warm)
