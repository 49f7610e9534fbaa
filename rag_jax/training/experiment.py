"""Everything a run needs, built from its config: QA data, tokenizers, models, corpus, retrieval.

`build(config, workdir)` returns an `Experiment`; the trainer and the scripts in `experiments/` use
it so that every entry point sees the same data and the same models for the same config. An
`Experiment` is immutable once built: a refreshed index or a restored passage encoder is a new
retriever (`exp.with_retriever(...)`).

Model sources (`config.model.init`):
- "random": both towers and the generator from `config.model.question_encoder` /
  `config.model.generator` sizes (the synthetic world's default);
- "pretrained": question encoder from `question_encoder_path` (BERT or DPR checkpoint), passage
  encoder from `passage_encoder_path` (default: the same checkpoint), generator from
  `generator_path` (BART, or a Llama-family causal LM: a folder or a .gguf file) or random with
  `config.model.generator` sizes;
- "hf_rag": a full HF RAG checkpoint at `rag_path` (its question encoder also encodes passages
  unless `passage_encoder_path` is given).

Questions from files (`config.data.source = "files"`): `eval_path` holds the held-out questions;
when it is empty, whole articles of `train_path` are held out instead (`articles.split_by_title`, a
fraction `eval_fraction` of the gold passages' titles), so no article is in both splits.

Passages: by default `config.data.corpus_path` is stored (`run.index_build.workdir_store`) and
encoded with the passage encoder into an index saved in `<workdir>/index`, which a restore or a
sibling run with the same passage encoder reuses (`retrieval.retriever.build`).
`config.retrieval.index_dir` names a folder written by `experiments/build_index.py` instead (a
21M-passage index is built once, not per run); its store, vectors and index are used as they are,
after checking that they were encoded by this run's passage encoder (parameter fingerprint) from
the same corpus (checksum).
"""

import dataclasses
import pathlib
from typing import Any

import jax
import ml_collections
import numpy as np

from rag_jax import rag
from rag_jax.devices import sharding
from rag_jax.models import bert
from rag_jax.retrieval import documents, passage_trunk, sources
from rag_jax.retrieval import retriever as retrieval
from rag_jax.retrieval.corpus import Passage, json_objects, read_corpus
from rag_jax.retrieval.device_index import DeviceIndex
from rag_jax.retrieval.passage_trunk import TrunkStates
from rag_jax.retrieval.retriever import ClosedBook, Retriever
from rag_jax.retrieval.store import PassageStore
from rag_jax.run import articles, data, model_setup, settings, synthetic
from rag_jax.run.index_build import load_index_dir, workdir_store
from rag_jax.training import reader_states, warm_start
from rag_jax.training.reader_states import ReaderStates


@dataclasses.dataclass(frozen=True)
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
    retriever: Retriever | ClosedBook | None  # ClosedBook: config.rag.closed_book
    workdir: pathlib.Path
    world: synthetic.World | None = None
    # `retrieval.passage_head_layers`: the passage tower's frozen layers' states of the store.
    passage_trunk: TrunkStates | None = None
    # `train.reader_trunk`: the reader's frozen layers' states of every training question's
    # fixed candidates (built with the retriever: `build(retriever=True)`).
    reader_trunk: ReaderStates | None = None

    def passage_encoder(self, passage_params) -> retrieval.PassageEncoder:
        """This run's passage tower with `passage_params`, reading passages as the config says."""
        r = self.config.retrieval
        reading = dict(
            max_length=r.passage_max_length,
            input_format=r.passage_format,
            batch_size=r.encode_batch_size,
        )
        if self.passage_trunk is not None:  # the store's passages run the head on their states
            return passage_trunk.HeadEncoder(
                self.passage_cfg,
                passage_params,
                self.question_tokenizer,
                **reading,
                trunk=self.passage_trunk,
                store=self.store,
            )
        return retrieval.PassageEncoder(
            self.passage_cfg, passage_params, self.question_tokenizer, **reading
        )

    def build_retriever(self, passage_params, *, store=None, save: bool = True, mesh=None):
        """The retriever of this run's store (or `store`) encoded with `passage_params`.

        With `save`, the encoded corpus is saved in (and looked for in) `<workdir>/index`, or
        `config.retrieval.cache_dir` (shared by runs), keyed by the encoder and the corpus, so a
        restore or a sibling run with the same passage encoder does not encode it again. A device
        index spans `mesh` (default: every device of every process).
        """
        config = self.config
        if config.rag.closed_book:
            dim = self.rag_cfg.question_encoder.embedding_dim
            return ClosedBook(
                self.generator_tokenizer,
                dim,
                max_combined_length=self.rag_cfg.max_combined_length,
                prefix=model_setup.closed_book_prefix(self.rag_cfg),
            )
        r, store = config.retrieval, store or self.store
        common = dict(
            n_docs=self.rag_cfg.n_docs,
            max_combined_length=self.rag_cfg.max_combined_length,
            keep_question=config.rag.keep_question,
            source=sources.candidate_source(
                store, r.source, depth=r.fusion_depth, k1=r.bm25_k1, b=r.bm25_b
            ),
        )
        common["search_in_step"] = _asks_in_step(config)
        # A device index spans every device of every process: on a pod the corpus is split over
        # all accelerators, and the train step (one mesh over the same devices) can search it.
        pod = sharding.data_mesh() if mesh is None else mesh
        if r.index_dir:
            ix, vectors = load_index_dir(r.index_dir, store, self.passage_cfg, passage_params)
            if r.index == "device" and not isinstance(ix, DeviceIndex):
                provenance = retrieval.index_provenance(ix)
                ix = DeviceIndex(vectors, pod, storage=r.device_storage, **provenance)
            return Retriever(ix, store, vectors, **common)
        return retrieval.build(
            store,
            self.passage_encoder(passage_params),
            kind=r.index,
            mesh=pod,
            cache_dir=(pathlib.Path(r.cache_dir) if r.cache_dir else self.workdir / "index")
            if save
            else None,
            device_storage=r.device_storage,
            **common,
        )

    def searches_in_step(self, mesh) -> bool:
        """Whether the train step on `mesh` searches for the next batch itself: the retriever
        `build_retriever` makes would say so (`retrieval.searches_in_step`, one rule for both),
        known before any index is built."""
        return retrieval.searches_in_step(
            _asks_in_step(self.config), sharding.data_mesh(), sharding.DATA_AXIS, mesh
        )

    def with_retriever(self, passage_params, **options) -> "Experiment":
        """This experiment with the retriever of `passage_params` (`build_retriever`)."""
        return dataclasses.replace(self, retriever=self.build_retriever(passage_params, **options))


def _asks_in_step(config) -> bool:
    """Whether a config asks the train step to search a device index itself: never while the
    stored vectors change under it (a refreshing index) or with no index (closed book)."""
    r = config.retrieval
    asked = r.index == "device" and r.search_in_step and not r.refresh_every
    return asked and not config.rag.closed_book and r.source == "dense"


def _load_data(config):
    """(train examples, eval examples, passages, world or None)."""
    d = config.data
    if d.source == "synthetic":
        world = synthetic.world_of(config)
        passages = [Passage(p.id, p.title, p.text) for p in world.passages]
        return (
            data.examples_from_world(world, "train"),
            data.examples_from_world(world, "eval"),
            passages,
            world,
        )
    fields = dict(d.fields or {}) or None
    if d.source not in ("files", "tfds"):
        raise ValueError(f"config.data.source must be synthetic, files or tfds, got {d.source!r}")
    # With a prebuilt index (`config.retrieval.index_dir`) the passages come from its store.
    # A folder as data.corpus_path holds plain .txt/.md documents, cut into 100-word passages.
    passages = None
    if not config.retrieval.index_dir:
        folder = bool(d.corpus_path) and pathlib.Path(d.corpus_path).is_dir()
        passages = (documents.read_documents if folder else read_corpus)(d.corpus_path)
    if d.source == "files":
        train = data.read_examples(d.train_path, fields, file_split(d, d.train_split))
        if d.eval_path:
            evals = data.read_examples(d.eval_path, fields, file_split(d, d.eval_split))
        elif passages is None:
            raise ValueError("config.data.eval_path is empty: splitting by article needs passages")
        else:  # hold out whole articles of train_path: the titles of their gold passages
            passages = list(passages)  # an iterator; used here and by the store
            titles = {p.id: p.title for p in passages}
            train, evals = articles.split_by_title(train, titles, d.eval_fraction, config.seed)
    else:
        train = data.read_tfds(d.tfds_name, d.train_split, d.tfds_data_dir or None)
        evals = data.read_tfds(d.tfds_name, d.eval_split, d.tfds_data_dir or None)
    if d.sample_by == "article":  # whole articles: the titles of the gold passages
        if passages is None:
            raise ValueError(
                "config.data.sample_by='article' reads the articles from the corpus' titles; "
                "set config.data.corpus_path (a prebuilt index_dir gives none)"
            )
        passages = list(passages)
        titles = {p.id: p.title for p in passages}
    else:
        titles = None
    train = _first_or_sample(train, d.max_train, d, titles)
    evals = _first_or_sample(evals, d.max_eval, d, titles)
    return train, evals, passages, None


def file_split(d, keep: str) -> data.Split | None:
    """The `data.Split` of questions files under `config.data` `d` (None without a
    `data.split_field`): the questions whose split is `keep` ('' = all of them)."""
    if not d.split_field:
        return None
    known = tuple(s.strip() for s in d.splits.split(",") if s.strip())
    return data.Split(d.split_field, keep, known)


def _first_or_sample(examples: list, count: int, d, titles=None) -> list:
    """`count` of `examples` (0 = all): the first ones, or a sample drawn with
    `data.sample_seed` (>= 0), kept in their order; of whole articles with `titles` (passage id
    -> title, `data.sample_by='article'`)."""
    if not count or count >= len(examples):
        return examples
    if d.sample_seed < 0:
        return examples[:count]
    if titles is not None:
        return articles.sample_articles(examples, titles, count, d.sample_seed)
    chosen = np.random.default_rng(d.sample_seed).choice(len(examples), count, replace=False)
    return [examples[i] for i in np.sort(chosen)]


def _check_gold_ids(config, train, evals, store) -> None:
    """Every gold passage id a question names is a passage of the corpus: a question whose gold
    passage is missing would count as a retrieval miss for a reason no model can change."""
    named = {g for e in (*train, *evals) for g in e.gold_ids}
    if not named:
        return
    known = {store.ids[i] for i in range(len(store))}
    for split, examples in (("train", train), ("eval", evals)):
        stray = [(e, g) for e in examples for g in e.gold_ids if g not in known]
        if stray:
            e, g = stray[0]
            source = config.retrieval.index_dir or config.data.corpus_path or "the passages"
            raise ValueError(
                f"{_where(config.data, split, e.id)}: gold passage id {g!r} of question {e.id!r} "
                f"is not in the corpus ({source}, {len(store)} passages; {len(stray)} gold ids "
                f"of the {split} questions are not)"
            )


def _where(d, split: str, question_id: str) -> str:
    """'<file>, line <n>, field <gold ids' key>' of a question of a questions file (the file
    alone where the line is not found: a .csv, or TFDS)."""
    path = d.train_path if split == "train" else (d.eval_path or d.train_path)
    if d.source != "files" or not path:
        return f"the {split} questions"
    fields = dict(d.fields or {})
    if path.endswith((".jsonl", ".jsonl.gz")):
        key = fields.get("id", "id")
        for line_no, record in json_objects(path):
            if str(record.get(key)) == question_id:
                return f"{path}, line {line_no}, field '{fields.get('gold_ids', 'gold_ids')}'"
    return str(path)


def build(config: ml_collections.ConfigDict, workdir, *, retriever: bool = True) -> Experiment:
    """Builds the experiment described by `config`, caching the passage store in `workdir`.

    Args:
      config: a validated config (`rag_jax.run.settings`).
      workdir: where the store, the warm starts and the encoded corpus are kept.
      retriever: also encode the corpus and index it with the (warm-started) passage encoder,
        and with `train.reader_trunk` search the fixed candidates and build the reader's trunk
        states; False leaves `retriever` None (a restore builds it from the checkpoint's
        encoder) and `reader_trunk` too.
    """
    if config.rag.closed_book and config.rag.n_docs != 1:
        raise ValueError(
            f"config.rag.closed_book needs config.rag.n_docs=1, got {config.rag.n_docs}"
        )
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    train, evals, passages, world = _load_data(config)
    if not train or not evals:
        raise ValueError(f"empty split: {len(train)} train and {len(evals)} eval examples")
    q_tok, g_tok = model_setup.tokenizers(config, world)
    model_rng = jax.random.fold_in(jax.random.PRNGKey(settings.init_seed(config)), 0)
    rag_cfg, p_cfg, params = model_setup.models(config, q_tok, g_tok, model_rng)
    if config.retrieval.index_dir:
        store = PassageStore.open(pathlib.Path(config.retrieval.index_dir) / "passages")
    else:
        store = workdir_store(passages, g_tok, workdir / "passages", rag_cfg.context_layout)
    _check_gold_ids(config, train, evals, store)
    if rag_cfg.n_docs > len(store):  # before any warm start runs
        raise ValueError(
            f"config.rag.n_docs={rag_cfg.n_docs} exceeds the corpus size {len(store)}; use at "
            f"most {len(store)}"
        )
    if config.warm_start.method in ("ict", "gold"):
        params = warm_start.retriever(config, rag_cfg, p_cfg, params, q_tok, store, workdir, train)
    if config.warm_start.reader_steps:
        params = warm_start.generator(config, rag_cfg, params, g_tok, workdir, world)
    if config.warm_start.reader_domain_steps:  # then on the run's own training questions
        params = warm_start.domain_reader(config, rag_cfg, params, g_tok, store, workdir, train)
    exp = Experiment(
        config, rag_cfg, p_cfg, params, q_tok, g_tok, train, evals, store, None, workdir, world
    )
    if config.retrieval.passage_head_layers:  # the frozen layers' states, computed once
        r = config.retrieval
        first = passage_trunk.check_freeze(config.train.freeze, p_cfg, r.passage_head_layers)
        root = (pathlib.Path(r.cache_dir) if r.cache_dir else workdir / "index") / "passage_trunk"
        trunk = passage_trunk.open_or_build(
            root, store, exp.passage_encoder(params["passage_encoder"]), first
        )
        exp = dataclasses.replace(exp, passage_trunk=trunk)
    if not retriever:  # a restore: its retriever is the checkpoint's (no reader trunk: it
        return exp  # evaluates, and evaluation reads the tokens with the whole reader)
    exp = exp.with_retriever(params["passage_encoder"])
    if config.train.reader_trunk:  # the reader's frozen layers' states of the fixed rows, once
        exp = dataclasses.replace(exp, reader_trunk=reader_states.build(exp))
    return exp
