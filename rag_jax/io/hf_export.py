"""Export to Hugging Face transformers: RAG, DPR and BART checkpoints that PyTorch loads.

`save_rag(directory, cfg, params, variant=...)` writes what `RagSequenceForGeneration` /
`RagTokenForGeneration.from_pretrained(directory)` reads:

- `config.json`: a `RagConfig` holding the DPR question encoder's and the BART generator's
  configs, n_docs, max_combined_length, the separators, prefix, label smoothing, BOS;
- `generation_config.json`: rag_jax's decoding defaults (`RagConfig.generation`) and the
  generator's special ids;
- `model.safetensors`: the tensors under the names HF's own `save_pretrained` writes (the tied
  copies of BART's shared embedding left out, as HF leaves them out), dtypes kept;
- with the tokenizers, `question_encoder_tokenizer/` and `generator_tokenizer/` (the layout of
  `RagTokenizer.save_pretrained`);
- with a passage store and its vectors, `passages/` (a `datasets` dataset: id, title, text,
  embeddings) and `passages.faiss` (an exact inner-product index, `faiss.IndexFlatIP`), for
  `RagRetriever.from_pretrained(directory, index_name="custom", passages_path=..., index_path=...)`,
  attached with `model.set_retriever(retriever)` (transformers 5.24's `from_pretrained(directory,
  retriever=...)` passes the retriever on to the saved generation config, which then fails).

`save_dpr` and `save_bart` write the halves (`DPRQuestionEncoder` / `DPRContextEncoder`,
`BartForConditionalGeneration`). Names are the inverse of `hf`'s import
(`hf_format.bert_name`, `hf_format.bart_name`), kernels transposed back to PyTorch's [out, in],
so `hf.load_rag` of an export returns the same parameters.

Refused, with the reason: a model HF's classes cannot compute (a question encoder that pools other
than by its [CLS] state, a generator whose LayerNorm eps is not BART's 1e-5 or whose encoder's own
token embedding differs from the shared one, parameters with no HF tensor, a BOS that HF's
`RagConfig` cannot express, a tokenizer without `save_pretrained`). A BERT pooler (a plain BERT
checkpoint as the question encoder) is left out with a warning: DPR has none, and the retrieval
vector never reads it.

Legend: C corpus size, D vector width, V vocab.
"""

import dataclasses
import pathlib

import flax
import numpy as np
import transformers
from absl import logging

from rag_jax import rag
from rag_jax.io import hf_format
from rag_jax.models import bart, bert

__all__ = ["ExportError", "save_bart", "save_dpr", "save_passages", "save_rag"]

# Fields of our configs that say how rag_jax runs a model, not which function it computes.
# Settings of how rag_jax runs or trains a tower, not of the model HF builds.
_RUNTIME = (
    "dtype",
    "param_dtype",
    "remat",
    "remat_policy",
    "with_pooler",
    "frozen_encoder_layers",
)
# HF's BART builds every LayerNorm with PyTorch's default eps and has no field to change it.
HF_BART_LAYER_NORM_EPS = 1e-5
_DPR_PREFIX = {"question": "question_encoder.", "context": "ctx_encoder."}
_DPR_CLASS = {"question": "DPRQuestionEncoder", "context": "DPRContextEncoder"}
_RAG_CLASS = {"sequence": "RagSequenceForGeneration", "token": "RagTokenForGeneration"}


class ExportError(ValueError):
    """A model (or part of one) that transformers' classes cannot represent."""


# ---------------------------------------------------------------------------------------------
# Tensors


def _flat(params) -> dict[str, np.ndarray]:
    flat = flax.traverse_util.flatten_dict(dict(params), sep="/")
    return {name: np.asarray(value) for name, value in flat.items()}


def _torch_layout(ours: str, value: np.ndarray) -> np.ndarray:
    if ours.endswith("kernel"):
        value = value.T  # Flax [in, out] -> PyTorch [out, in]
    return np.ascontiguousarray(value)


def _check_pooling(cfg: bert.BertConfig, what: str) -> None:
    # DPR's vector is the [CLS] state (projected); a config that pools otherwise has no HF class.
    if cfg.pooling != "cls":
        raise ExportError(
            f"the {what} pools its tokens by {cfg.pooling!r}; HF's DPR encoders return the [CLS] "
            "state (optionally projected), so this model has no HF equivalent"
        )
    if cfg.normalize:
        raise ExportError(
            f"the {what} L2-normalises its vectors; HF's DPR encoders do not, so this model has "
            "no HF equivalent"
        )


def _bert_state(cfg: bert.BertConfig, params, prefix: str, what: str) -> dict[str, np.ndarray]:
    """DPR tensors of a BertEncoder tree; `prefix` e.g. 'question_encoder.bert_model.'."""
    _check_pooling(cfg, what)
    state, dropped, unmapped = {}, [], []
    for ours, value in _flat(params).items():
        if ours.startswith("pooler/"):
            dropped.append(ours)
            continue
        name = hf_format.bert_name(ours, prefix)
        if name.startswith("<unmapped"):
            unmapped.append(ours)
            continue
        state[name] = _torch_layout(ours, value)
    if unmapped:
        raise ExportError(f"the {what}'s parameters {unmapped} have no DPR tensor")
    if dropped:
        logging.warning(
            "The %s's pooler (%s) is not exported: DPR encoders have none, and the retrieval "
            "vector (the [CLS] state) does not read it.",
            what,
            ", ".join(dropped),
        )
    return state


def _tied_bart(cfg: bart.BartConfig, params) -> dict:
    """`params` as HF's BART holds them, or `ExportError` where HF computes another function.

    HF's BART runs every LayerNorm at eps 1e-5 whatever its config says, and ties the encoder's
    and the decoder's token embeddings and the LM head to one table. A generator with its own
    encoder embedding (`frozen_encoder_layers > 0`, `models.bart`) exports exactly while that
    copy equals the shared table (e.g. when `generator/shared` is frozen too), and is refused
    once they differ.
    """
    if cfg.layer_norm_eps != HF_BART_LAYER_NORM_EPS:
        raise ExportError(
            f"the generator's LayerNorms use layer_norm_eps={cfg.layer_norm_eps!r} (e.g. BERT's, "
            f"for a generator initialised from BERT); HF's BART ignores that field and always "
            f"uses {HF_BART_LAYER_NORM_EPS}, so this model has no HF equivalent"
        )
    encoder = params["encoder"]
    if "embed_tokens" not in encoder:
        return params
    own, shared = encoder["embed_tokens"]["embedding"], params["shared"]["embedding"]
    if not np.array_equal(np.asarray(own), np.asarray(shared)):
        raise ExportError(
            "the generator's encoder reads its own token embedding (encoder/embed_tokens/"
            "embedding, untied from shared/embedding for its fixed layers, "
            f"frozen_encoder_layers={cfg.frozen_encoder_layers}), and the two now differ; HF's "
            "BART ties the encoder's embedding to the decoder's and the LM head's, so this "
            "model has no HF equivalent (it exports while both are equal: freeze "
            "generator/shared/ too)"
        )
    return dict(params, encoder={k: v for k, v in encoder.items() if k != "embed_tokens"})


def _bart_state(cfg: bart.BartConfig, params, prefix: str) -> dict[str, np.ndarray]:
    """BartForConditionalGeneration tensors of a Bart tree; `prefix` e.g. 'model.'."""
    params = _tied_bart(cfg, params)
    state, unmapped = {}, []
    for ours, value in _flat(params).items():
        name = hf_format.bart_name(ours, prefix)
        if name.startswith("<unmapped"):
            unmapped.append(ours)
            continue
        if ours == "final_logits_bias":
            value = value.reshape(1, cfg.vocab_size)  # a [1, V] buffer in HF
        state[name] = _torch_layout(ours, value)
    if unmapped:
        raise ExportError(f"the generator's parameters {unmapped} have no BART tensor")
    return state


def _write_tensors(directory: pathlib.Path, state: dict[str, np.ndarray]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    hf_format.save_safetensors(directory / "model.safetensors", state, {"format": "pt"})


# ---------------------------------------------------------------------------------------------
# Configs


def _fields(cfg) -> dict:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _RUNTIME}


def _dpr_config(cfg: bert.BertConfig, kind: str):
    values = {k: v for k, v in _fields(cfg).items() if k not in ("pooling", "normalize")}
    return transformers.DPRConfig(
        **values,
        position_embedding_type="absolute",
        dtype=cfg.param_dtype,
        architectures=[_DPR_CLASS[kind]],
    )


def _bart_config(cfg: bart.BartConfig):
    # layer_norm_eps is no BartConfig field (HF's BART ignores it; `_tied_bart` checks ours).
    values = {k: v for k, v in _fields(cfg).items() if k != "layer_norm_eps"}
    return transformers.BartConfig(
        **values,
        tie_word_embeddings=True,
        dtype=cfg.param_dtype,
        architectures=["BartForConditionalGeneration"],
    )


def _generation_config(cfg: rag.RagConfig):
    """HF's GenerationConfig of rag_jax's decoding defaults and the generator's ids."""
    gen, g = cfg.generation, cfg.generator
    values = {k: v for k, v in dataclasses.asdict(gen).items() if k not in ("bad_words_ids",)}
    if gen.bad_words_ids:
        values["bad_words_ids"] = [list(w) for w in gen.bad_words_ids]
    return transformers.GenerationConfig(
        **values,
        decoder_start_token_id=g.decoder_start_token_id,
        bos_token_id=g.bos_token_id,
        eos_token_id=g.eos_token_id,
        pad_token_id=g.pad_token_id,
    )


def _rag_bos(cfg: rag.RagConfig) -> int | None:
    """The RagConfig `bos_token_id` HF resolves to ours: it reads `rag.bos or generator.bos`."""
    ours, generator = cfg.bos_token_id, cfg.generator.bos_token_id
    if ours == generator:
        return None
    if not ours:  # None or 0 falls through to the generator's in HF
        raise ExportError(
            f"bos_token_id={ours!r} with a generator BOS of {generator}: HF reads "
            "`rag.bos_token_id or generator.bos_token_id`, so it cannot be expressed"
        )
    return ours


def _save_tokenizer(tokenizer, directory: pathlib.Path, what: str) -> None:
    if not hasattr(tokenizer, "save_pretrained"):
        raise ExportError(f"the {what} ({type(tokenizer).__name__}) has no save_pretrained")
    tokenizer.save_pretrained(str(directory))


# ---------------------------------------------------------------------------------------------
# The halves


def save_dpr(directory, cfg: bert.BertConfig, params, *, kind: str = "question", tokenizer=None):
    """Writes a BertEncoder as a DPR encoder (`DPRQuestionEncoder` or `DPRContextEncoder`).

    Args:
      directory: the output folder (created).
      cfg, params: the encoder.
      kind: "question" or "context".
      tokenizer: written beside it when given.
    """
    if kind not in _DPR_PREFIX:
        raise ValueError(f"kind must be 'question' or 'context', got {kind!r}")
    directory = pathlib.Path(directory)
    state = _bert_state(cfg, params, f"{_DPR_PREFIX[kind]}bert_model.", f"{kind} encoder")
    _write_tensors(directory, state)
    _dpr_config(cfg, kind).save_pretrained(str(directory))
    if tokenizer is not None:
        _save_tokenizer(tokenizer, directory, "tokenizer")


def save_bart(directory, cfg: bart.BartConfig, params, *, tokenizer=None) -> None:
    """Writes a Bart as `BartForConditionalGeneration` (tied embeddings, final_logits_bias)."""
    directory = pathlib.Path(directory)
    _write_tensors(directory, _bart_state(cfg, params, "model."))
    _bart_config(cfg).save_pretrained(str(directory))
    if tokenizer is not None:
        _save_tokenizer(tokenizer, directory, "tokenizer")


# ---------------------------------------------------------------------------------------------
# RAG


def save_passages(directory, store, vectors: np.ndarray) -> tuple[str, str]:
    """The passages and their vectors in the form HF's `RagRetriever` reads (`index_name=
    "custom"`): `<directory>/passages` (a `datasets` dataset with columns id, title, text and
    embeddings, rows in store order) and `<directory>/passages.faiss` (exact inner product).

    Args:
      directory: the output folder.
      store: a `PassageStore` (C passages).
      vectors: [C, D] their vectors, the rows of the index.

    Returns:
      (passages_path, index_path), absolute.
    """
    import datasets  # here, not at the top: `datasets` and `faiss` are needed for this alone
    import faiss

    directory = pathlib.Path(directory).absolute()
    vectors = np.ascontiguousarray(vectors, np.float32)
    if vectors.ndim != 2 or len(vectors) != len(store):
        raise ValueError(
            f"vectors {vectors.shape} must be [C, D] with C = {len(store)} (the store's passages)"
        )
    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "title": datasets.Value("string"),
            "text": datasets.Value("string"),
            "embeddings": datasets.Sequence(datasets.Value("float32")),
        }
    )
    rows = range(len(store))
    dataset = datasets.Dataset.from_dict(
        {
            "id": [store.ids[i] for i in rows],
            "title": [store.title(i) for i in rows],
            "text": [store.text(i) for i in rows],
            "embeddings": list(vectors),
        },
        features=features,
    )
    passages, index_path = directory / "passages", directory / "passages.faiss"
    dataset.save_to_disk(str(passages))
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(vectors)
    faiss.write_index(index, str(index_path))
    return str(passages), str(index_path)


def save_rag(
    directory,
    cfg: rag.RagConfig,
    params: dict,
    *,
    variant: str = "sequence",
    question_tokenizer=None,
    generator_tokenizer=None,
    store=None,
    vectors: np.ndarray | None = None,
) -> dict:
    """Writes a RAG model in transformers' `save_pretrained` format (see the module docstring).

    Args:
      directory: the output folder (created).
      cfg: the RAG config.
      params: {"question_encoder", "generator"} (other towers, e.g. the passage encoder, are not
        part of HF's RAG and are ignored: the passages go as vectors).
      variant: "sequence" (`RagSequenceForGeneration`) or "token" (`RagTokenForGeneration`).
      question_tokenizer, generator_tokenizer: written as `RagTokenizer` lays them out.
      store, vectors: a passage store and its [C, D] vectors, written for `RagRetriever`
        (`save_passages`); the RAG config then points at them (`index_name="custom"`).

    Returns:
      {"directory", "architecture", "tensors": count, "passages_path", "index_path"}.
    """
    if variant not in _RAG_CLASS:
        raise ValueError(f"variant must be 'sequence' or 'token', got {variant!r}")
    if cfg.causal:
        raise ExportError(
            "the generator is a causal LM: transformers' RAG takes only a seq2seq generator "
            "(RagSequenceForGeneration / RagTokenForGeneration wrap BART or T5); export the "
            "generator alone with hf.save_llama and the question encoder with hf.save_dpr"
        )
    if cfg.doc_score_scale != 1.0:
        raise ExportError(
            f"the model weighs passages by softmax({cfg.doc_score_scale} * q . d); HF's RAG "
            "takes softmax(q . d), so this model has no HF equivalent"
        )
    directory = pathlib.Path(directory)
    state = _bert_state(
        cfg.question_encoder,
        params["question_encoder"],
        "rag.question_encoder.question_encoder.bert_model.",
        "question encoder",
    )
    state.update(_bart_state(cfg.generator, params["generator"], "rag.generator.model."))
    retrieval = {}
    if store is not None:
        if vectors is None:
            raise ValueError("store given without its vectors")
        where = directory.absolute()
        retrieval = dict(
            index_name="custom",
            passages_path=str(where / "passages"),
            index_path=str(where / "passages.faiss"),
        )
    config = transformers.RagConfig.from_question_encoder_generator_configs(
        _dpr_config(cfg.question_encoder, "question"),
        _bart_config(cfg.generator),
        n_docs=cfg.n_docs,
        max_combined_length=cfg.max_combined_length,
        title_sep=cfg.title_sep,
        doc_sep=cfg.doc_sep,
        prefix=cfg.prefix,
        label_smoothing=cfg.label_smoothing,
        exclude_bos_score=cfg.exclude_bos_score,
        reduce_loss=cfg.reduce_loss,
        do_deduplication=cfg.do_deduplication,
        bos_token_id=_rag_bos(cfg),
        retrieval_vector_size=cfg.question_encoder.embedding_dim,
        architectures=[_RAG_CLASS[variant]],
        **retrieval,
    )
    generation = _generation_config(cfg)
    # Everything is checked by now: writing starts.
    _write_tensors(directory, state)
    config.save_pretrained(str(directory))
    generation.save_pretrained(str(directory))
    if store is not None:
        save_passages(directory, store, vectors)
    for tokenizer, sub in (
        (question_tokenizer, "question_encoder_tokenizer"),
        (generator_tokenizer, "generator_tokenizer"),
    ):
        if tokenizer is not None:
            _save_tokenizer(tokenizer, directory / sub, sub.replace("_", " "))
    return {
        "directory": str(directory),
        "architecture": _RAG_CLASS[variant],
        "tensors": len(state),
        **{k: retrieval.get(k) for k in ("passages_path", "index_path")},
    }
