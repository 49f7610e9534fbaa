"""The models a run's config names: tokenizers, model configs and initial parameters.

`tokenizers(config, world)` and `models(config, q_tok, g_tok, rng)` give what `experiment.build`
assembles: the question and passage towers (BERT or DPR checkpoints, or random), the generator
(BART from a checkpoint, from BERT weights (bert2bart), random, or a Llama-family causal LM from a
folder or a .gguf file) and the `rag.RagConfig` around them, with a causal generator's prompt
layout (`prompt_layout`, `closed_book_prefix`). `model_shapes(config)` gives the same configs and
parameter shapes without reading or initialising any weight (the TPU compile plans with it).
"""

import pathlib

import jax
import ml_collections
import numpy as np

from rag_jax import rag
from rag_jax.io import gguf_llama, hf, hf_llama
from rag_jax.models import bart, bert, bert2bart, llama
from rag_jax.run import synthetic, validation


def tokenizers(config, world):
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


def generator_ids(tokenizer) -> dict:
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


def models(config, q_tok, g_tok, rng):
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
        layout, gen_ids = None, generator_ids(g_tok)
        if causal_generator(m.generator_path):
            g_cfg, g_params, layout = _causal_generator(config, g_tok, dtype)
            gen_ids = _CAUSAL_IDS
        elif m.generator_path:
            g_cfg, g_params = hf.load_bart(m.generator_path, **dtype)
        elif m.generator_init == "bert":
            g_cfg, g_params = _bert_generator(m, g_tok, g_rng, dtype)
        else:
            g_cfg = bart.BartConfig(
                vocab_size=len(g_tok), **dict(m.generator), **generator_ids(g_tok), **dtype
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
        validation.check_frozen_layers(config.train.freeze, layers - trained, trained)
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
        validation.check_frozen_encoder(config.train.freeze, g_cfg, setting)
        cfg = cfg.replace(generator=g_cfg)
        generator = bart.untie_encoder_embedding(params["generator"])
        params = dict(params, generator=generator)
    # Both towers' vector: [CLS] (DPR) or the mean over tokens, normalised or not.
    pooling = dict(pooling=m.pooling, normalize=m.normalize_embeddings)
    # One attention and one remat policy for every tower.
    impl = dict(attention_impl=m.attention_impl, remat_policy=m.remat_policy)
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
            special_ids=generator_ids(tokenizer),
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
        world = synthetic.world_of(config) if config.data.source == "synthetic" else None
        q_tok, g_tok = tokenizers(config, world) if m.init == "random" else (None, None)
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
            gen_ids = generator_ids(g_tok)
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
