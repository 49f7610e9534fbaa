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
when it is empty, whole articles of `train_path` are held out instead (`data.split_by_title`, a
fraction `eval_fraction` of the gold passages' titles), so no article is in both splits.

Passages: by default `config.data.corpus_path` is stored (`retrieval.build.workdir_store`) and
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

from rag_jax import data, gguf_llama, hf, hf_llama, rag, settings, sharding, synthetic
from rag_jax.models import bart, bert, bert2bart, llama
from rag_jax.retrieval import retriever as retrieval
from rag_jax.retrieval.build import load_index_dir, workdir_store
from rag_jax.retrieval.corpus import Passage, read_corpus
from rag_jax.retrieval.device_index import DeviceIndex
from rag_jax.retrieval.retriever import ClosedBook, Retriever
from rag_jax.retrieval.store import PassageStore
from rag_jax.training import warm_start


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

    def passage_encoder(self, passage_params) -> retrieval.PassageEncoder:
        """This run's passage tower with `passage_params`, reading passages as the config says."""
        r = self.config.retrieval
        return retrieval.PassageEncoder(
            self.passage_cfg,
            passage_params,
            self.question_tokenizer,
            max_length=r.passage_max_length,
            input_format=r.passage_format,
            batch_size=r.encode_batch_size,
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
                prefix=closed_book_prefix(self.rag_cfg),
            )
        r, store = config.retrieval, store or self.store
        common = dict(
            n_docs=self.rag_cfg.n_docs,
            max_combined_length=self.rag_cfg.max_combined_length,
            keep_question=config.rag.keep_question,
        )
        # The train step searches a device index itself unless the stored vectors change.
        common["search_in_step"] = r.index == "device" and r.search_in_step and not r.refresh_every
        # A device index spans every device of every process: on a pod the corpus is split over
        # all accelerators, and the train step (one mesh over the same devices) can search it.
        pod = sharding.data_mesh() if mesh is None else mesh
        if r.index_dir:
            ix, vectors = load_index_dir(r.index_dir, store, self.passage_cfg, passage_params)
            if r.index == "device" and not isinstance(ix, DeviceIndex):
                provenance = retrieval.index_provenance(ix)
                ix = DeviceIndex(vectors, pod, **provenance)
            return Retriever(ix, store, vectors, **common)
        return retrieval.build(
            store,
            self.passage_encoder(passage_params),
            kind=r.index,
            mesh=pod,
            cache_dir=(pathlib.Path(r.cache_dir) if r.cache_dir else self.workdir / "index")
            if save
            else None,
            **common,
        )

    def searches_in_step(self, mesh) -> bool:
        """Whether the train step on `mesh` searches for the next batch itself (as the retriever
        `build_retriever` makes would say: `Retriever.searches_in_step`)."""
        r = self.config.retrieval
        in_step = r.index == "device" and r.search_in_step and not r.refresh_every
        in_step = in_step and not self.config.rag.closed_book
        return in_step and list(sharding.data_mesh().devices.flat) == list(mesh.devices.flat)

    def with_retriever(self, passage_params, **options) -> "Experiment":
        """This experiment with the retriever of `passage_params` (`build_retriever`)."""
        return dataclasses.replace(self, retriever=self.build_retriever(passage_params, **options))


def _world(config) -> synthetic.World:
    d = config.data
    return synthetic.make_world(
        synthetic.WorldConfig(
            seed=config.seed,
            num_entities=d.num_entities,
            distractors_per_fact=d.distractors_per_fact,
            eval_fraction=d.eval_fraction,
        )
    )


def _load_data(config):
    """(train examples, eval examples, passages, world or None)."""
    d = config.data
    if d.source == "synthetic":
        world = _world(config)
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
    passages = None if config.retrieval.index_dir else read_corpus(d.corpus_path)
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
    train, evals = _first_or_sample(train, d.max_train, d), _first_or_sample(evals, d.max_eval, d)
    return train, evals, passages, None


def _first_or_sample(examples: list, count: int, d) -> list:
    """`count` of `examples` (0 = all): the first ones, or a sample drawn with
    `data.sample_seed` (>= 0), kept in their order."""
    if not count or count >= len(examples):
        return examples
    if d.sample_seed < 0:
        return examples[:count]
    chosen = np.random.default_rng(d.sample_seed).choice(len(examples), count, replace=False)
    return [examples[i] for i in np.sort(chosen)]


def _tokenizers(config, world):
    m = config.model
    if world is not None and m.init == "random":
        tok = synthetic.tokenizer(world)
        return tok, tok
    if m.init == "hf_rag":
        return hf.load_rag_tokenizers(m.rag_path)
    question = hf.load_tokenizer(m.question_encoder_path)
    if causal_generator(m.generator_path):
        generator = hf.load_llama_tokenizer(m.generator_path)
        if generator.pad_token_id is None:  # contexts are padded; the pad is never attended to
            generator.pad_token = generator.eos_token
        generator.padding_side = "right"  # the store's layout (left-aligned in `rag_jax.causal`)
        return question, generator
    path = m.generator_path or (m.generator_bert_path if m.generator_init == "bert" else "")
    generator = hf.load_tokenizer(path) if path else question
    return question, generator


def causal_generator(path) -> bool:
    """Whether `config.model.generator_path` names a Llama-family causal LM (a .gguf file, or a
    folder whose config.json says model_type llama)."""
    if not path:
        return False
    path = pathlib.Path(path)
    if path.suffix == ".gguf":
        return True
    config = path / "config.json"
    return config.is_file() and hf.read_config(path).get("model_type") == "llama"


# A causal generator's prompt around passage and question (`config.rag.prompt`): the store
# assembles prefix + title + title_sep + text + doc_sep + question + suffix.
PLAIN_PROMPT = {
    "prefix": "Context: ",
    "title_sep": " / ",
    "doc_sep": "\nQuestion: ",
    "suffix": "\nAnswer:",
}


def closed_book_prefix(rag_cfg) -> str:
    """The text before a closed-book question: for a causal generator its prompt's opening (the
    chat template's head) and the question's label ("Question:"), without the context; nothing
    for BART, which reads the question alone."""
    if not rag_cfg.causal:
        return ""
    head = rag_cfg.prefix.removesuffix(PLAIN_PROMPT["prefix"])
    return head + rag_cfg.doc_sep.rstrip(" ").lstrip("\n")


def prompt_layout(kind: str, tokenizer) -> dict:
    """The context layout of a causal generator's prompt: "plain" (`PLAIN_PROMPT`) or "chat"
    (the passage and question as the user's message in the tokenizer's chat template, the
    assistant's turn opened after it)."""
    layout = dict(PLAIN_PROMPT)
    if kind == "plain":
        return layout
    if kind != "chat":
        raise ValueError(f"config.rag.prompt must be plain or chat, got {kind!r}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"config.rag.prompt='chat' but the generator's tokenizer "
            f"{getattr(tokenizer, 'name_or_path', '')!r} has no chat template"
        )
    marker = "RAG_JAX_MESSAGE"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": marker}], add_generation_prompt=True, tokenize=False
    )
    head, found, tail = text.partition(marker)
    if not found:
        raise ValueError("the generator's chat template does not contain the user's message")
    return dict(layout, prefix=head + layout["prefix"], suffix=tail)


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


def _rag_fields(config) -> dict:
    r = config.rag
    return dict(
        n_docs=r.n_docs,
        max_combined_length=r.max_combined_length,
        label_smoothing=r.label_smoothing,
        exclude_bos_score=r.exclude_bos_score,
        doc_score_scale=r.doc_score_scale,
    )


def _rag_config(config, q_cfg: bert.BertConfig, g_cfg, gen_ids: dict, layout=None):
    """The RagConfig of the two halves; `layout` (`prompt_layout`) for a causal generator."""
    return rag.RagConfig(
        question_encoder=q_cfg,
        generator=g_cfg,
        bos_token_id=gen_ids["bos_token_id"],
        generation=rag.GenerationConfig(
            num_beams=config.eval.num_beams,
            max_length=config.eval.max_length,
            forced_bos_token_id=gen_ids["forced_bos_token_id"],
            forced_eos_token_id=gen_ids["forced_eos_token_id"],
        ),
        **_rag_fields(config),
        **(layout or {}),
    )


# A causal generator: no BOS in its labels, nothing forced (it ends with its own EOS).
_CAUSAL_IDS = {"bos_token_id": None, "forced_bos_token_id": None, "forced_eos_token_id": None}


def _causal_generator(config, g_tok, dtype):
    """(LlamaConfig, params, context layout) of `config.model.generator_path`."""
    m = config.model
    if m.generator_init != "random" or m.generator_frozen_encoder_layers:
        raise ValueError(
            "config.model.generator_init and generator_frozen_encoder_layers are BART settings; "
            f"{m.generator_path} is a causal generator (use generator_trained_layers)"
        )
    if not config.rag.keep_question:
        raise ValueError(
            "a causal generator reads the question and the answer cue at the prompt's end: set "
            "config.rag.keep_question=True (a long passage loses its end, never the question)"
        )
    g_cfg, g_params = hf.load_llama(m.generator_path, **dtype)
    hf_llama.check_tokenizer(g_tok, g_cfg, m.generator_path)
    longest = config.rag.max_combined_length + max(
        config.data.answer_length, config.eval.max_length
    )
    if longest > g_cfg.max_position_embeddings:
        raise ValueError(
            f"config.rag.max_combined_length={config.rag.max_combined_length} plus the answer "
            f"(data.answer_length={config.data.answer_length}, eval.max_length="
            f"{config.eval.max_length}) exceeds the generator's max_position_embeddings="
            f"{g_cfg.max_position_embeddings}"
        )
    return g_cfg, g_params, prompt_layout(config.rag.prompt, g_tok)


def _models(config, q_tok, g_tok, rng):
    """(RagConfig, passage BertConfig, params)."""
    m = config.model
    dtype = dict(dtype=m.dtype, remat=m.remat)
    q_rng, p_rng, g_rng = jax.random.split(rng, 3)
    if m.init == "hf_rag":
        cfg, params = hf.load_rag(m.rag_path, **dtype)
        cfg = cfg.replace(**_rag_fields(config))
    else:
        if m.init == "pretrained":
            q_cfg, q_params = _load_encoder(m.question_encoder_path, dtype)
        elif m.init == "random":
            q_cfg = bert.BertConfig(vocab_size=len(q_tok), **dict(m.question_encoder), **dtype)
            q_params = _init_bert(q_cfg, q_rng)
        else:
            raise ValueError(f"config.model.init must be random, pretrained or hf_rag: {m.init!r}")
        layout, gen_ids = None, _generator_ids(g_tok)
        if causal_generator(m.generator_path):
            g_cfg, g_params, layout = _causal_generator(config, g_tok, dtype)
            gen_ids = _CAUSAL_IDS
        elif m.generator_path:
            g_cfg, g_params = hf.load_bart(m.generator_path, **dtype)
        elif m.generator_init == "bert":
            g_cfg, g_params = _bert_generator(m, g_tok, g_rng, dtype)
        else:
            g_cfg = bart.BartConfig(
                vocab_size=len(g_tok), **dict(m.generator), **_generator_ids(g_tok), **dtype
            )
            g_params = bart.Bart(g_cfg).init(g_rng, *(np.zeros((1, 2), np.int32),) * 3)["params"]
        cfg = _rag_config(config, q_cfg, g_cfg, gen_ids, layout)
        params = {"question_encoder": q_params, "generator": g_params}
    if m.passage_encoder_path:
        p_cfg, p_params = _load_encoder(m.passage_encoder_path, dtype)
    elif m.init == "random" and not m.shared_towers:
        p_cfg, p_params = cfg.question_encoder, _init_bert(cfg.question_encoder, p_rng)
    else:
        # Both towers start from the same weights (DPR initialises both from one BERT).
        p_cfg, p_params = cfg.question_encoder, jax.tree.map(np.array, params["question_encoder"])
    params = dict(params, passage_encoder=p_params)
    return _model_settings(config, cfg, p_cfg, params)


def _model_settings(config, cfg: rag.RagConfig, p_cfg: bert.BertConfig, params: dict):
    """(cfg, p_cfg, params) with the settings applied after loading: a causal generator's
    trained layers, both towers' pooling, every tower's attention implementation, and the
    generator's frozen encoder layers, whose encoder then reads its own copy of the token
    embedding (`bart.untie_encoder_embedding`; `params` may be arrays or
    `jax.ShapeDtypeStruct`s)."""
    m = config.model
    if m.generator_trained_layers:
        trained = m.generator_trained_layers
        layers = getattr(cfg.generator, "num_hidden_layers", None)
        if layers is None or not 0 < trained <= layers:
            raise ValueError(
                f"config.model.generator_trained_layers={trained} needs a causal generator "
                f"with at least that many layers (its generator has {layers or 'none: BART'})"
            )
        settings.check_frozen_layers(config.train.freeze, layers - trained, trained)
        cfg = cfg.replace(generator=cfg.generator.replace(frozen_layers=layers - trained))
    if m.generator_frozen_encoder_layers:
        setting, layers = m.generator_frozen_encoder_layers, cfg.generator.encoder_layers
        frozen = layers if setting == -1 else setting
        if frozen > layers:
            raise ValueError(
                f"config.model.generator_frozen_encoder_layers={setting} exceeds the generator's "
                f"{layers} encoder layers"
            )
        g_cfg = cfg.generator.replace(frozen_encoder_layers=frozen)
        settings.check_frozen_encoder(config.train.freeze, g_cfg, setting)
        cfg = cfg.replace(generator=g_cfg)
        generator = bart.untie_encoder_embedding(params["generator"])
        params = dict(params, generator=generator)
    # Both towers' vector: [CLS] (DPR) or the mean over tokens, normalised or not.
    pooling = dict(pooling=m.pooling, normalize=m.normalize_embeddings)
    impl = dict(attention_impl=m.attention_impl)  # one attention for every tower
    cfg = cfg.replace(
        question_encoder=cfg.question_encoder.replace(**pooling, **impl),
        generator=cfg.generator.replace(**impl),
    )
    return cfg, p_cfg.replace(**pooling, **impl), params


def _bert_generator(m, tokenizer, rng, dtype):
    """(BartConfig, params) of a generator warm-started from a BERT checkpoint (`bert2bart`)."""
    path = m.generator_bert_path or m.question_encoder_path
    if not path:
        raise ValueError(
            "config.model.generator_init='bert' needs config.model.generator_bert_path (or "
            "question_encoder_path) naming a BERT checkpoint"
        )
    bert_cfg, bert_params = hf.load_bert(path, **dtype)
    if len(tokenizer) != bert_cfg.vocab_size:
        raise ValueError(
            f"the generator's tokenizer has {len(tokenizer)} tokens but the BERT checkpoint "
            f"{path} has vocab_size {bert_cfg.vocab_size}: the generator must read BERT's "
            "vocabulary (leave config.model.generator_path empty)"
        )
    try:
        return bert2bart.bart_from_bert(
            bert_cfg,
            bert_params,
            special_ids=_generator_ids(tokenizer),
            rng=rng,
            encoder_layers=m.generator_encoder_layers,
            decoder_layers=m.generator_decoder_layers,
            decoder_init=m.generator_decoder_init,
            **dict(m.generator),
            **dtype,
        )
    except bert2bart.MappingError as e:
        raise bert2bart.MappingError(
            f"config.model.generator with generator_init='bert' from {path}: {e} (BERT fixes the "
            "widths, heads, vocabulary and positions; leave them out of config.model.generator)"
        ) from e


def model_shapes(config: ml_collections.ConfigDict):
    """The models `build` makes for `config`, as shapes: no weight is read, nothing allocated.

    Architectures come from what `build` would load: the random-init sizes of the config with the
    tokenizers' vocabularies, or each checkpoint's config files. A checkpoint that is not on this
    machine is planned from its architecture as the config gives it (`config.model.
    question_encoder` / `generator`, vocab_size included); without one that is an error.

    Returns:
      (RagConfig, passage BertConfig, params {"question_encoder", "generator",
      "passage_encoder"} of `jax.ShapeDtypeStruct`s, {part: where its architecture came from}).
    """
    m = config.model
    dtype = dict(dtype=m.dtype, remat=m.remat)
    sources = {}

    def planned(part, path, read, make):
        try:
            arch = read(path, **dtype)
            sources[part] = path
            return arch
        except hf.CheckpointError as e:
            key = "question_encoder" if part != "generator" else "generator"
            fields = dict(m[key])
            if "vocab_size" not in fields:
                raise ValueError(
                    f"config.model: {path!r} is not on this machine ({e}); download it (its "
                    f"config.json is enough), or give its architecture (vocab_size and the sizes "
                    f"of its config.json) in config.model.{key}"
                ) from None
            sources[part] = f"config.model.{key} ({path} is not on this machine)"
            return make(**fields, **dtype)

    if m.init == "hf_rag":

        def from_fields(**_):
            q = bert.BertConfig(**dict(m.question_encoder), **dtype)
            g = bart.BartConfig(**dict(m.generator), **dtype)
            return rag.RagConfig(question_encoder=q, generator=g)

        cfg = planned("question_encoder", m.rag_path, hf.rag_architecture, from_fields)
        sources["generator"] = sources["question_encoder"]
        cfg = cfg.replace(**_rag_fields(config))
    else:
        world = _world(config) if config.data.source == "synthetic" else None
        q_tok, g_tok = _tokenizers(config, world) if m.init == "random" else (None, None)
        if m.init == "pretrained":
            path = m.question_encoder_path
            q_cfg = planned("question_encoder", path, hf.bert_architecture, bert.BertConfig)
        else:
            q_cfg = bert.BertConfig(vocab_size=len(q_tok), **dict(m.question_encoder), **dtype)
            sources["question_encoder"] = "config.model.question_encoder (random init)"
        layout = None
        if causal_generator(m.generator_path):
            path = m.generator_path
            g_cfg = planned("generator", path, _llama_architecture, llama.LlamaConfig)
            gen_ids, layout = _CAUSAL_IDS, dict(PLAIN_PROMPT)
        elif m.generator_path:
            path = m.generator_path
            g_cfg = planned("generator", path, hf.bart_architecture, bart.BartConfig)
            gen_ids = {k: getattr(g_cfg, k) for k in ("bos_token_id", "forced_eos_token_id")}
            gen_ids["forced_bos_token_id"] = g_cfg.forced_bos_token_id
        elif m.generator_init == "bert":
            raise ValueError(
                "config.model.generator_init='bert': a BERT-initialised generator's shapes come "
                "from its checkpoint, which planning does not read; give the architecture as "
                "config.model.generator with generator_init='random' to plan it"
            )
        else:
            gen_ids = _generator_ids(g_tok)
            g_cfg = bart.BartConfig(vocab_size=len(g_tok), **dict(m.generator), **gen_ids, **dtype)
            sources["generator"] = "config.model.generator (random init)"
        cfg = _rag_config(config, q_cfg, g_cfg, gen_ids, layout)
    p_cfg = cfg.question_encoder
    sources["passage_encoder"] = sources["question_encoder"]
    if m.passage_encoder_path:
        path = m.passage_encoder_path
        p_cfg = planned("passage_encoder", path, hf.bert_architecture, bert.BertConfig)
    rng = jax.random.PRNGKey(0)
    params = jax.eval_shape(
        lambda: {
            "question_encoder": _init_bert(cfg.question_encoder, rng),
            "generator": rag.init_params(cfg, rng)["generator"],
            "passage_encoder": _init_bert(p_cfg, rng),
        }
    )
    return (*_model_settings(config, cfg, p_cfg, params), sources)


def _llama_architecture(path, **overrides) -> llama.LlamaConfig:
    """The LlamaConfig `hf.load_llama` returns for `path`, from its config alone."""
    if pathlib.Path(path).suffix == ".gguf":
        if not pathlib.Path(path).is_file():
            raise hf.CheckpointError(f"{path} is not a file")
        return gguf_llama.read_config(path, **overrides)
    return hf_llama.llama_config_from_hf(hf.read_config(hf.resolve(path)), **overrides)


def _load_encoder(path, dtype):
    config = hf.read_config(hf.resolve(path))
    loader = hf.load_dpr if config.get("model_type") == "dpr" else hf.load_bert
    return loader(path, **dtype)


def _init_bert(cfg: bert.BertConfig, rng) -> dict:
    ids = np.zeros((1, 2), np.int32)
    return bert.BertEncoder(cfg).init(rng, ids, ids)["params"]


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
                f"{len(stray)} gold passage ids of the {split} questions are not in the corpus "
                f"({source}, {len(store)} passages), e.g. question {e.id!r} names {g!r}"
            )


def build(config: ml_collections.ConfigDict, workdir, *, retriever: bool = True) -> Experiment:
    """Builds the experiment described by `config`, caching the passage store in `workdir`.

    Args:
      config: a validated config (`rag_jax.settings`).
      workdir: where the store, the warm starts and the encoded corpus are kept.
      retriever: also encode the corpus and index it with the (warm-started) passage encoder;
        False leaves `retriever` None (a restore builds it from the checkpoint's encoder).
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
    q_tok, g_tok = _tokenizers(config, world)
    model_rng = jax.random.fold_in(jax.random.PRNGKey(settings.init_seed(config)), 0)
    rag_cfg, p_cfg, params = _models(config, q_tok, g_tok, model_rng)
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
    if config.warm_start.method == "ict":
        params = warm_start.retriever(config, rag_cfg, p_cfg, params, q_tok, store, workdir)
    if config.warm_start.reader_steps:
        params = warm_start.generator(config, rag_cfg, params, g_tok, workdir, world)
    exp = Experiment(
        config, rag_cfg, p_cfg, params, q_tok, g_tok, train, evals, store, None, workdir, world
    )
    return exp.with_retriever(params["passage_encoder"]) if retriever else exp
