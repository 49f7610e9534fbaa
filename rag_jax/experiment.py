"""Everything a run needs, built from its config: QA data, tokenizers, models, corpus, index.

`build(config, workdir)` returns an `Experiment`; the trainer and the scripts in `experiments/` use
it so that every entry point sees the same data and the same models for the same config.

Model sources (`config.model.init`):
- "random": both towers and the generator from `config.model.question_encoder` /
  `config.model.generator` sizes (the synthetic world's default);
- "pretrained": question encoder from `question_encoder_path` (BERT or DPR checkpoint), passage
  encoder from `passage_encoder_path` (default: the same checkpoint), generator from
  `generator_path` or random with `config.model.generator` sizes;
- "hf_rag": a full HF RAG checkpoint at `rag_path` (its question encoder also encodes passages
  unless `passage_encoder_path` is given).

Questions from files (`config.data.source = "files"`): `eval_path` holds the held-out questions;
when it is empty, whole articles of `train_path` are held out instead (`data.split_by_title`, a
fraction `eval_fraction` of the gold passages' titles), so no article is in both splits.

Passages: by default `config.data.corpus_path` is stored, encoded with the passage encoder and
indexed in the workdir. `config.retrieval.index_dir` names a folder written by
`experiments/build_index.py` instead (a 21M-passage index is built once, not per run); its store,
vectors and index are used as they are, after checking that they were encoded by this run's
passage encoder (parameter fingerprint) from the same corpus (checksum).
"""

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import socket
from typing import Any

import flax.serialization
import jax
import ml_collections
import numpy as np

from rag_jax import data, hf, rag, sharding, synthetic
from rag_jax.models import bart, bert
from rag_jax.retrieval import encode, files
from rag_jax.retrieval.corpus import Passage, corpus_checksum, read_passages
from rag_jax.retrieval.device_index import DeviceIndex
from rag_jax.retrieval.index import ExactIndex, ScannIndex
from rag_jax.retrieval.retriever import ClosedBook, Retriever
from rag_jax.retrieval.store import PassageStore, tokenizer_fingerprint
from rag_jax.training import warm_start


@dataclasses.dataclass
class Experiment:
    """A run's data, tokenizers, models and retrieval."""

    config: ml_collections.ConfigDict
    rag_cfg: rag.RagConfig
    passage_cfg: bert.BertConfig
    params: dict  # {"question_encoder", "generator", "passage_encoder"}
    question_tokenizer: Any
    generator_tokenizer: Any
    train: list[data.Example]
    eval: list[data.Example]
    store: PassageStore
    retriever: Retriever | ClosedBook  # ClosedBook: config.rag.closed_book
    world: synthetic.World | None = None


def examples_from_world(world: synthetic.World, split: str) -> list[data.Example]:
    return [
        data.Example(q["question"], tuple(q["answers"]), q["id"], tuple(q["gold_ids"]))
        for q in world.questions(split)
    ]


def _load_data(config):
    """(train examples, eval examples, passages, world or None)."""
    d = config.data
    if d.source == "synthetic":
        world = synthetic.make_world(
            synthetic.WorldConfig(
                seed=config.seed,
                num_entities=d.num_entities,
                distractors_per_fact=d.distractors_per_fact,
                eval_fraction=d.eval_fraction,
            )
        )
        passages = [Passage(p.id, p.title, p.text) for p in world.passages]
        return (
            examples_from_world(world, "train"),
            examples_from_world(world, "eval"),
            passages,
            world,
        )
    fields = dict(d.fields or {}) or None
    if d.source not in ("files", "tfds"):
        raise ValueError(f"config.data.source must be synthetic, files or tfds, got {d.source!r}")
    # With a prebuilt index (`config.retrieval.index_dir`) the passages come from its store.
    passages = None if config.retrieval.index_dir else read_passages(d.corpus_path)
    if d.source == "files":
        train = data.read_examples(d.train_path, fields)
        if d.eval_path:
            evals = data.read_examples(d.eval_path, fields)
        elif passages is None:
            raise ValueError("config.data.eval_path is empty: splitting by article needs passages")
        else:  # hold out whole articles of train_path: the titles of their gold passages
            passages = list(passages)  # an iterator; used here and by the store
            titles = {p.id: p.title for p in passages}
            train, evals = data.split_by_title(train, titles, d.eval_fraction, config.seed)
    else:
        train = data.read_tfds(d.tfds_name, d.train_split, d.tfds_data_dir or None)
        evals = data.read_tfds(d.tfds_name, d.eval_split, d.tfds_data_dir or None)
    if d.max_train:
        train = train[: d.max_train]
    if d.max_eval:
        evals = evals[: d.max_eval]
    return train, evals, passages, None


def _tokenizers(config, world):
    m = config.model
    if world is not None and m.init == "random":
        tok = synthetic.tokenizer(world)
        return tok, tok
    if m.init == "hf_rag":
        return hf.load_rag_tokenizers(m.rag_path)
    question = hf.load_tokenizer(m.question_encoder_path)
    generator = hf.load_tokenizer(m.generator_path) if m.generator_path else question
    return question, generator


def _generator_ids(tokenizer) -> dict:
    """BART special ids from a tokenizer: BOS = [CLS]/<s>, EOS = [SEP]/</s> = decoder start."""
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.cls_token_id
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    return dict(
        bos_token_id=bos,
        eos_token_id=eos,
        decoder_start_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
        forced_bos_token_id=bos,
        forced_eos_token_id=eos,
    )


def _models(config, q_tok, g_tok, rng):
    """(RagConfig, passage BertConfig, params)."""
    m, r = config.model, config.rag
    dtype = dict(dtype=m.dtype, remat=m.remat)
    rag_fields = dict(
        n_docs=r.n_docs,
        max_combined_length=r.max_combined_length,
        label_smoothing=r.label_smoothing,
        exclude_bos_score=r.exclude_bos_score,
    )
    q_rng, p_rng, g_rng = jax.random.split(rng, 3)
    if m.init == "hf_rag":
        cfg, params = hf.load_rag(m.rag_path, **dtype)
        cfg = cfg.replace(**rag_fields)
    else:
        if m.init == "pretrained":
            q_cfg, q_params = _load_encoder(m.question_encoder_path, dtype)
        elif m.init == "random":
            q_cfg = bert.BertConfig(vocab_size=len(q_tok), **dict(m.question_encoder), **dtype)
            q_params = _init_bert(q_cfg, q_rng)
        else:
            raise ValueError(f"config.model.init must be random, pretrained or hf_rag: {m.init!r}")
        if m.generator_path:
            g_cfg, g_params = hf.load_bart(m.generator_path, **dtype)
        else:
            g_cfg = bart.BartConfig(
                vocab_size=len(g_tok), **dict(m.generator), **_generator_ids(g_tok), **dtype
            )
            g_params = bart.Bart(g_cfg).init(g_rng, *(np.zeros((1, 2), np.int32),) * 3)["params"]
        gen_ids = _generator_ids(g_tok)
        cfg = rag.RagConfig(
            question_encoder=q_cfg,
            generator=g_cfg,
            bos_token_id=gen_ids["bos_token_id"],
            generation=rag.GenerationConfig(
                num_beams=config.eval.num_beams,
                max_length=config.eval.max_length,
                forced_bos_token_id=gen_ids["forced_bos_token_id"],
                forced_eos_token_id=gen_ids["forced_eos_token_id"],
            ),
            **rag_fields,
        )
        params = {"question_encoder": q_params, "generator": g_params}
    if m.passage_encoder_path:
        p_cfg, p_params = _load_encoder(m.passage_encoder_path, dtype)
    elif m.init == "random" and not m.shared_towers:
        p_cfg, p_params = cfg.question_encoder, _init_bert(cfg.question_encoder, p_rng)
    else:
        # Both towers start from the same weights (DPR initialises both from one BERT).
        p_cfg, p_params = cfg.question_encoder, jax.tree.map(np.array, params["question_encoder"])
    params = dict(params, passage_encoder=p_params)
    return cfg, p_cfg, params


def _load_encoder(path, dtype):
    config = hf.read_config(hf.resolve(path))
    loader = hf.load_dpr if config.get("model_type") == "dpr" else hf.load_bert
    return loader(path, **dtype)


def _init_bert(cfg: bert.BertConfig, rng) -> dict:
    ids = np.zeros((1, 2), np.int32)
    return bert.BertEncoder(cfg).init(rng, ids, ids)["params"]


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def build_store(passages, tokenizer, directory: pathlib.Path, rag_cfg: rag.RagConfig):
    """Opens the passage store in `directory`, or builds it there from `passages`.

    An existing store must hold exactly `passages`, tokenised the same way: a workdir reused with
    another corpus (a changed world size or seed) is refused, never silently trained on.

    Several processes may share `directory` (hosts of one run on a shared workdir): each builds
    into a private sibling folder and renames it into place, so a store appears whole, with its
    manifest, or not at all; a process that finds the place taken keeps the winner's store. A
    private folder left by a killed build of this host is removed by the next build.
    """
    directory, passages = pathlib.Path(directory), list(passages)
    layout = dict(prefix=rag_cfg.prefix or "", title_sep=rag_cfg.title_sep, doc_sep=rag_cfg.doc_sep)
    if not (directory / "manifest.json").is_file():
        if _build_into_place(passages, tokenizer, directory, layout):
            return PassageStore.open(directory)  # built from `passages` just now: nothing to check
    store = PassageStore.open(directory)
    stale = store.differences(corpus_checksum(passages), tokenizer, **layout)
    if stale:
        raise ValueError(
            f"{directory} holds a passage store built from another corpus or tokenizer "
            f"(differs: {stale}); use a fresh workdir or delete {directory}"
        )
    return store


def _build_into_place(passages, tokenizer, directory: pathlib.Path, layout: dict) -> bool:
    """Builds the store in a private sibling folder and renames it to `directory`.

    Returns:
      True when this build took the place; False when another process's store was there first.
    """
    host = socket.gethostname()
    for stale in directory.parent.glob(f"{directory.name}.building-{host}-*"):
        if not _process_alive(int(stale.name.rsplit("-", 1)[1])):  # a killed build
            shutil.rmtree(stale, ignore_errors=True)
    private = directory.with_name(f"{directory.name}.building-{host}-{os.getpid()}")
    shutil.rmtree(private, ignore_errors=True)
    PassageStore.build(passages, tokenizer, private, **layout)
    for _ in range(2):
        try:
            os.rename(private, directory)
            return True
        except OSError:
            if (directory / "manifest.json").is_file():
                shutil.rmtree(private)  # another process renamed its build first
                return False
            # No manifest: the leftovers of a build that wrote into place (older layouts).
            shutil.rmtree(directory)
    raise FileExistsError(f"could not move the passage store built in {private} to {directory}")


def encode_store(store, passage_cfg, passage_params, tokenizer, config) -> np.ndarray:
    """[C, D] float32 vectors of every passage in the store.

    Encoded on this process's devices: on several hosts each one encodes the whole corpus, for
    its own replica of a host index, or for its own devices' rows of a `DeviceIndex` (the
    encoder's default mesh refuses to span processes).
    """
    return encode.encode_passages(
        passage_cfg,
        passage_params,
        tokenizer,
        [store.title(i) for i in range(len(store))],
        [store.text(i) for i in range(len(store))],
        max_length=config.retrieval.passage_max_length,
        input_format=config.retrieval.passage_format,
        batch_size=config.retrieval.encode_batch_size,
        dtype="float32",
        mesh=sharding.data_mesh(jax.local_devices()),
    )


def _ict(config, rag_cfg, p_cfg, params, tokenizer, store) -> dict:
    """Both retriever towers after the inverse-cloze warm start (no QA supervision)."""
    if p_cfg != rag_cfg.question_encoder:
        raise ValueError("the ICT warm start needs both towers to share one architecture")
    w = config.warm_start
    q_params, p_params, log = warm_start.ict_warm_start(
        rag_cfg.question_encoder,
        params["question_encoder"],
        params["passage_encoder"],
        tokenizer,
        [(store.title(i), store.text(i)) for i in range(len(store))],
        steps=w.steps,
        batch_size=w.batch_size,
        learning_rate=w.learning_rate,
        seed=config.seed,
        query_length=config.data.question_length,
        passage_length=config.retrieval.passage_max_length,
        keep_prob=w.keep_prob,
        passage_format=config.retrieval.passage_format,
    )
    last = log[-1]
    print(
        f"ICT warm start: {w.steps} steps, loss {last['loss']:.3f}, in-batch accuracy "
        f"{last['in_batch_accuracy']:.3f}",
        flush=True,
    )
    return dict(params, question_encoder=q_params, passage_encoder=p_params)


def _cached(label: str, key: dict, template: dict, compute, config, workdir) -> dict:
    """`compute()` (parameter trees shaped like `template`), cached in
    `<warm_start.cache_dir or workdir>/warm_start/<fingerprint of key>.msgpack`.

    A warm start is a deterministic function of what `key` lists (seed, data, initial parameters,
    settings), so a resume, or another run sharing `cache_dir`, reuses it and any change
    recomputes it.
    """
    fingerprint = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    directory = pathlib.Path(config.warm_start.cache_dir or workdir) / "warm_start"
    path = directory / f"{fingerprint}.msgpack"
    if path.is_file():
        try:
            cached = flax.serialization.from_bytes(jax.device_get(template), path.read_bytes())
        except Exception as e:  # msgpack/structure errors name neither the file nor the cause
            raise ValueError(f"{path}: corrupt warm-start cache ({e}); delete it") from e
        print(f"{label}: reusing {path}", flush=True)
        return cached
    value = jax.device_get(compute())
    if jax.process_index() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        files.write_atomic(path, flax.serialization.to_bytes(value))
    return value


def _cached_ict(config, rag_cfg, p_cfg, params, tokenizer, store, workdir) -> dict:
    """`_ict`, cached (see `_cached`)."""
    names = ("question_encoder", "passage_encoder")
    towers = {k: params[k] for k in names}
    key = {
        "warm_start": {
            k: v
            for k, v in config.warm_start.items()
            if k != "cache_dir" and not k.startswith("reader_")
        },
        "retrieval": {k: config.retrieval[k] for k in ("passage_max_length", "passage_format")},
        "question_length": config.data.question_length,
        "seed": config.seed,
        "corpus": store.checksum,
        "question_encoder": encode.encoder_fingerprint(p_cfg, towers["question_encoder"]),
        "passage_encoder": encode.encoder_fingerprint(p_cfg, towers["passage_encoder"]),
    }

    def compute():
        warm = _ict(config, rag_cfg, p_cfg, params, tokenizer, store)
        return {k: warm[k] for k in names}

    return dict(params, **_cached("ICT warm start", key, towers, compute, config, workdir))


# The reader warm start's world: another seed, so other entities and independently drawn facts.
READER_WORLD_SEED_OFFSET = 1_000_003


def _cached_reader(config, rag_cfg, params, tokenizer, workdir, own_world) -> dict:
    """The generator after `warm_start.reader_warm_start` on another synthetic world, cached.

    Facts about an entity whose name also occurs in `own_world` (the experiment's) are left out,
    so no name of the experiment's world is seen with an answer.
    """
    d, w = config.data, config.warm_start
    if d.source != "synthetic":
        raise ValueError(
            "config.warm_start.reader_steps needs data.source='synthetic' (it reads another "
            f"synthetic world); got {d.source!r}: set reader_steps=0"
        )
    world = synthetic.make_world(
        synthetic.WorldConfig(
            seed=config.seed + READER_WORLD_SEED_OFFSET,
            num_entities=w.reader_entities,
            distractors_per_fact=d.distractors_per_fact,
            eval_fraction=d.eval_fraction,
        )
    )
    own = {f.entity for f in own_world.facts}
    kept = {f.gold_id for f in world.facts if f.entity not in own}  # answer passages kept
    examples = [
        e
        for e in examples_from_world(world, "train") + examples_from_world(world, "eval")
        if e.gold_ids[0] in kept
    ]
    key = {
        "reader": {k: v for k, v in w.items() if k.startswith("reader_")},
        "world": dataclasses.asdict(world.config),
        "train": {k: config.train[k] for k in ("batch_size", "learning_rate")},
        "answer_length": d.answer_length,
        "examples": hashlib.sha256(" ".join(e.id for e in examples).encode()).hexdigest(),
        "rag": [rag_cfg.max_combined_length, rag_cfg.label_smoothing, rag_cfg.exclude_bos_score],
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "generator": encode.encoder_fingerprint(rag_cfg.generator, params["generator"]),
    }

    def compute():
        passages = [Passage(p.id, p.title, p.text) for p in world.passages]
        store = build_store(passages, tokenizer, pathlib.Path(workdir) / "reader_world", rag_cfg)
        generator, log = warm_start.reader_warm_start(
            rag_cfg,
            params["generator"],
            tokenizer,
            store,
            examples,
            steps=w.reader_steps,
            batch_size=config.train.batch_size,
            learning_rate=config.train.learning_rate,
            seed=config.seed,
            answer_length=d.answer_length,
        )
        print(
            f"reader warm start: {w.reader_steps} steps on {len(examples)} questions of another "
            f"world, loss {log[0]['loss']:.3f} -> {log[-1]['loss']:.3f}",
            flush=True,
        )
        return {"generator": generator}

    template = {"generator": params["generator"]}
    cached = _cached("reader warm start", key, template, compute, config, workdir)
    return dict(params, **cached)


def make_index(vectors: np.ndarray, kind: str, mesh: jax.sharding.Mesh | None = None):
    """The index `config.retrieval.index` names over `vectors` [C, D].

    "exact" and "scann" search on the host; "device" shards the vectors over the `data` axis of
    `mesh` (`DeviceIndex`; default: this process's devices) and searches there, one jitted
    program per batch. A mesh that spans processes splits the corpus over the whole pod; every
    process must then build it from the same vectors and search it together (see `DeviceIndex`).
    """
    if kind == "exact":
        return ExactIndex(vectors)
    if kind == "scann":
        return ScannIndex.build(vectors)
    if kind == "device":
        if mesh is None:
            mesh = sharding.data_mesh(jax.local_devices())
        return DeviceIndex(vectors, mesh)
    raise ValueError(f"config.retrieval.index must be exact, scann or device, got {kind!r}")


def load_index_dir(directory, store: PassageStore, passage_cfg, passage_params):
    """(index, [C, D] vectors) written by `experiments/build_index.py` into `directory`.

    Both are checked against this run's passage encoder (parameter fingerprint) and the store's
    corpus checksum, so an index encoded by another encoder or from another corpus is refused.
    """
    from rag_jax.retrieval import index as index_lib
    from rag_jax.retrieval.vectors import load_vectors

    directory = pathlib.Path(directory)
    expect = {
        "encoder_fingerprint": encode.encoder_fingerprint(passage_cfg, passage_params),
        "corpus_checksum": store.checksum,
    }
    ix = index_lib.load(str(directory / "index"), expect)
    if isinstance(ix, ExactIndex):
        return ix, ix.vectors  # one copy of the vectors, not two
    return ix, load_vectors(directory / "vectors", expect)


def build(config: ml_collections.ConfigDict, workdir) -> Experiment:
    """Builds the experiment described by `config`, caching the passage store in `workdir`."""
    if config.rag.closed_book and config.rag.n_docs != 1:
        raise ValueError(
            f"config.rag.closed_book needs config.rag.n_docs=1, got {config.rag.n_docs}"
        )
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    train, evals, passages, world = _load_data(config)
    if not train or not evals:
        raise ValueError(f"empty split: {len(train)} train and {len(evals)} eval examples")
    q_tok, g_tok = _tokenizers(config, world)
    model_rng = jax.random.fold_in(jax.random.PRNGKey(config.seed), 0)
    rag_cfg, p_cfg, params = _models(config, q_tok, g_tok, model_rng)
    index_dir = config.retrieval.index_dir
    if index_dir:
        store = PassageStore.open(pathlib.Path(index_dir) / "passages")
    else:
        store = build_store(passages, g_tok, workdir / "passages", rag_cfg)
    if config.warm_start.method == "ict":
        params = _cached_ict(config, rag_cfg, p_cfg, params, q_tok, store, workdir)
    elif config.warm_start.method != "none":
        raise ValueError(
            f"config.warm_start.method must be none or ict: {config.warm_start.method!r}"
        )
    if config.warm_start.reader_steps:
        params = _cached_reader(config, rag_cfg, params, g_tok, workdir, world)
    if rag_cfg.n_docs > len(store):
        raise ValueError(
            f"config.rag.n_docs={rag_cfg.n_docs} exceeds the corpus size {len(store)}; use at "
            f"most {len(store)}"
        )
    # A device index spans every device of every process: on a pod the corpus is split over
    # all accelerators, and the train step (one mesh over the same devices) can search it.
    pod = sharding.data_mesh()
    if index_dir:
        ix, vectors = load_index_dir(index_dir, store, p_cfg, params["passage_encoder"])
        if config.retrieval.index == "device" and not isinstance(ix, DeviceIndex):
            ix = DeviceIndex(
                vectors,
                pod,
                encoder_fingerprint=ix.encoder_fingerprint,
                corpus_checksum=ix.corpus_checksum,
            )
    else:
        vectors = encode_store(store, p_cfg, params["passage_encoder"], q_tok, config)
        ix = make_index(vectors, config.retrieval.index, pod)
    retriever = Retriever(
        ix,
        store,
        vectors,
        n_docs=rag_cfg.n_docs,
        max_combined_length=rag_cfg.max_combined_length,
    )
    if config.rag.closed_book:
        retriever = ClosedBook(
            g_tok, vectors.shape[1], max_combined_length=rag_cfg.max_combined_length
        )
    return Experiment(
        config, rag_cfg, p_cfg, params, q_tok, g_tok, train, evals, store, retriever, world
    )
