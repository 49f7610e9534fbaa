"""A bundle's config.json: what it holds, and every value checked when it is read.

config.json holds the RagConfig (its question tower's BertConfig, its generator's BartConfig or
LlamaConfig, the decoding defaults), the passage tower's BertConfig and how it reads passages,
and the answering defaults (`Settings`). `read` refuses, naming `<bundle>/config.json` and the
field (`rag.generation.num_beams`), any value a model could load with and then fail on at its
first answer, or spend the machine on at its warm-up:

- a value of the wrong type (a string for a number, 1.5 for a count, NaN or inf) or a key the
  config does not have;
- a choice outside its options: variants, decodings, activations, poolings, attention kernels,
  remat policies, and dtypes outside `DTYPES`;
- a size that is not positive, a probability outside [0, 1), a token id outside the
  vocabulary, heads that do not divide the width;
- a length past what the model can place: the question and passage lengths past their tower's
  positions, the contexts (`max_combined_length`) and the answers (`generation.max_length`)
  past the generator's (a causal generator's contexts and answers together);
- more than `MAX_BEAMS` beams, `MAX_N_DOCS` passages per question (or more than the bundle
  holds), `MAX_ENCODE_BATCH` passages per encoding batch.

The widths, depths and vocabularies need no bound of their own: the parameters are checked
against the shapes they give (`bundle_format.read`) before anything is allocated, so they are
bounded by the bundle's own files.

Legend: none (no arrays here).
"""

import dataclasses
import json
import math
import pathlib
import types
import typing

import jax

from rag_jax import rag
from rag_jax.models import bart, bert, flash, layers, llama, remat
from rag_jax.retrieval import encode

# The most beams a bundle may decode with by default: a beam search holds every beam of every
# passage of every question of a batch (64 beams x 5 passages x 16 questions: 5,120 rows).
MAX_BEAMS = 64
MAX_N_DOCS = 256  # the most passages per question (N) a bundle may retrieve by default
MAX_ENCODE_BATCH = 8192  # the most passages an edit encodes in one batch
# Compute and parameter dtypes a bundle may hold; float64 only where JAX computes in it.
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Settings:
    """How a bundle answers by default (from the run's config)."""

    question_length: int  # Q: question-encoder tokens; longer questions are truncated
    variant: str  # "sequence" | "token"
    sequence_decoding: str  # "thorough" | "fast" (RAG-Sequence)
    context_pad_multiple: int  # contexts are padded to a multiple of this (0: always S)
    index: str  # "exact" | "scann": how the passage vectors are searched
    keep_question: bool = False  # contexts too long lose the passage's end, not the question


@dataclasses.dataclass(frozen=True)
class Config:
    """config.json, read and checked (`read`)."""

    rag_cfg: rag.RagConfig
    passage_cfg: bert.BertConfig
    passage: dict  # how the passage tower reads: {"max_length", "input_format", "batch_size"}
    settings: Settings


class _Refused(ValueError):
    """A value of config.json refused: `field` (dotted) and why."""

    def __init__(self, field: str, value, why: str):
        super().__init__(f"{field} = {value!r:.80}: {why}")


def read(path: pathlib.Path, *, count: int, index: str) -> Config:
    """Reads and checks config.json (see the module docstring).

    Args:
      path: `<bundle>/config.json`.
      count: the passages the bundle holds (its manifest's), which n_docs may not pass.
      index: the index kind its manifest names, which `settings.index` must be.

    Raises:
      ValueError naming `path` and the field.
    """
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not readable as JSON ({type(e).__name__}: {e})") from None
    try:
        config = _typed(config, dict.fromkeys(("rag", "passage_encoder", "settings"), dict), "")
        rag_cfg = _rag_config(config["rag"], count)
        passage_cfg, passage = _passage_encoder(config["passage_encoder"])
        settings = _settings(config["settings"], rag_cfg, index)
    except _Refused as e:
        raise ValueError(f"{path}: {e}") from None
    except (TypeError, ValueError) as e:  # a constructor's own check (e.g. Llama's heads)
        raise ValueError(f"{path}: {type(e).__name__}: {e}") from None
    return Config(rag_cfg, passage_cfg, passage, settings)


# ---------------------------------------------------------------------------------------------
# The parts


def _passage_encoder(values) -> tuple[bert.BertConfig, dict]:
    where = "passage_encoder."
    declared = {"config": dict, "max_length": int, "input_format": str, "batch_size": int}
    values = _typed(values, declared, where)
    cfg = _bert(values.pop("config"), f"{where}config.")
    _check(values, where, {
        "max_length": _between(1, cfg.max_position_embeddings, "the passage tower's positions"),
        "batch_size": _between(1, MAX_ENCODE_BATCH, "bundle_config.MAX_ENCODE_BATCH"),
        "input_format": _one_of(encode.INPUT_FORMATS),
    })  # fmt: skip
    return cfg, values


def _settings(values, rag_cfg: rag.RagConfig, index: str) -> Settings:
    where = "settings."
    values = _fields(Settings, values, where)
    q_positions = rag_cfg.question_encoder.max_position_embeddings
    _check(values, where, {
        "question_length": _between(1, q_positions, "the question tower's positions"),
        "context_pad_multiple": _between(0, rag_cfg.max_combined_length, "max_combined_length"),
        "variant": _one_of(("sequence", "token")),
        "sequence_decoding": _one_of(("thorough", "fast")),
        "index": _one_of((index,), "the index the manifest names"),
    })  # fmt: skip
    return Settings(**values)


def _rag_config(values, count: int) -> rag.RagConfig:
    where = "rag."
    towers = ("question_encoder", "generator", "generation")
    raw, values = values, _fields(rag.RagConfig, values, where, skip=towers)
    parts = {k: raw[k] for k in towers if k in raw}
    parts = _typed(parts, dict.fromkeys(towers, dict), where)
    q_cfg = _bert(parts["question_encoder"], f"{where}question_encoder.")
    causal = "num_hidden_layers" in parts["generator"]  # a LlamaConfig's, not a BartConfig's
    g_cfg = _llama(parts["generator"]) if causal else _bart(parts["generator"])
    positions, vocab = g_cfg.max_position_embeddings, g_cfg.vocab_size
    held = f"bundle_config.MAX_N_DOCS, and the {count} passages it holds"
    _check(values, where, {
        "n_docs": _between(1, min(MAX_N_DOCS, count), held),
        "max_combined_length": _between(1, positions, "the generator's positions"),
        "label_smoothing": _probability,
        "doc_score_scale": _positive,
        "bos_token_id": _token(vocab, optional=True),
    })  # fmt: skip
    # A causal generator places the context and the answer in one sequence of its positions.
    room = positions - values["max_combined_length"] if causal else positions
    generation = _generation(parts["generation"], room, vocab, causal)
    return rag.RagConfig(q_cfg, g_cfg, generation=generation, **values)


def _generation(values, room: int, vocab: int, causal: bool) -> rag.GenerationConfig:
    where = "rag.generation."
    values = _fields(rag.GenerationConfig, values, where)
    positions = "the generator's positions" + (" after max_combined_length" if causal else "")
    _check(values, where, {"num_beams": _between(1, MAX_BEAMS, "bundle_config.MAX_BEAMS")})
    _check(values, where, {"max_length": _between(1, room, positions)})
    _check(values, where, {
        "min_length": _between(0, values["max_length"], "max_length"),
        "no_repeat_ngram_size": _between(0, values["max_length"], "max_length"),
        "num_return_sequences": _between(1, values["num_beams"], "num_beams"),
        "early_stopping": _one_of((True, False, "never")),
        "forced_bos_token_id": _token(vocab, optional=True),
        "forced_eos_token_id": _token(vocab, optional=True),
        "bad_words_ids": _id_lists(vocab),
    })  # fmt: skip
    values["bad_words_ids"] = tuple(tuple(w) for w in values["bad_words_ids"])
    return rag.GenerationConfig(**values)


def _common(values: dict, where: str) -> None:
    """The fields every tower's config shares: its dtypes, kernels and padding id."""
    dtypes = DTYPES + (("float64",) if jax.config.jax_enable_x64 else ())
    _check(values, where, {
        "dtype": _one_of(dtypes, "bundle_config.DTYPES"),
        "param_dtype": _one_of(dtypes, "bundle_config.DTYPES"),
        "remat_policy": _one_of(remat.POLICIES),
        "attention_impl": _one_of(flash.IMPLS),
        "pad_token_id": _token(values["vocab_size"]),
    })  # fmt: skip


def _bert(values, where: str) -> bert.BertConfig:
    values = _fields(bert.BertConfig, values, where)
    sizes = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size")
    _check(values, where, {k: _positive for k in (*sizes, "max_position_embeddings")})
    _check(values, where, {
        "num_attention_heads": _divides(values["hidden_size"], "hidden_size"),
        "type_vocab_size": _positive,
        "projection_dim": _non_negative,
        "hidden_dropout_prob": _probability,
        "attention_probs_dropout_prob": _probability,
        "layer_norm_eps": _positive,
        "initializer_range": _non_negative,
        "hidden_act": _one_of(tuple(layers.ACTIVATIONS)),
        "pooling": _one_of(bert.POOLINGS),
    })  # fmt: skip
    _common(values, where)
    return bert.BertConfig(**values)


def _bart(values) -> bart.BartConfig:
    where = "rag.generator."
    values = _fields(bart.BartConfig, values, where)
    sizes = ("vocab_size", "d_model", "encoder_layers", "decoder_layers", "encoder_ffn_dim")
    _check(values, where, {k: _positive for k in (*sizes, "decoder_ffn_dim")})
    vocab, width = values["vocab_size"], values["d_model"]
    dropouts = ("dropout", "attention_dropout", "activation_dropout")
    ids = ("bos_token_id", "eos_token_id", "decoder_start_token_id")
    _check(values, where, {
        "max_position_embeddings": _positive,
        "encoder_attention_heads": _divides(width, "d_model"),
        "decoder_attention_heads": _divides(width, "d_model"),
        "frozen_encoder_layers": _between(0, values["encoder_layers"], "encoder_layers"),
        **{k: _probability for k in (*dropouts, "encoder_layerdrop", "decoder_layerdrop")},
        "init_std": _non_negative,
        "layer_norm_eps": _positive,
        **{k: _token(vocab) for k in ids},
        "forced_bos_token_id": _token(vocab, optional=True),
        "forced_eos_token_id": _token(vocab, optional=True),
        "activation_function": _one_of(tuple(layers.ACTIVATIONS)),
    })  # fmt: skip
    _common(values, where)
    return bart.BartConfig(**values)


def _llama(values) -> llama.LlamaConfig:
    where = "rag.generator."
    values = _fields(llama.LlamaConfig, values, where)
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    _check(values, where, {k: _positive for k in (*sizes, "max_position_embeddings")})
    vocab, heads = values["vocab_size"], values["num_attention_heads"]
    width = values["hidden_size"] if values["head_dim"] is None else heads
    _check(values, where, {
        "num_attention_heads": _divides(width, "hidden_size (no head_dim)"),
        "num_key_value_heads": _divides(heads, "num_attention_heads"),
        "head_dim": lambda v: None if v is None else _positive(v),
        "frozen_layers": _between(0, values["num_hidden_layers"], "num_hidden_layers"),
        "rms_norm_eps": _positive,
        "rope_theta": _positive,
        "rope_scaling": _pairs,
        "init_std": _non_negative,
        "bos_token_id": _token(vocab, optional=True),
        "eos_token_id": _token(vocab),
        "hidden_act": _one_of(tuple(layers.ACTIVATIONS)),
    })  # fmt: skip
    _common(values, where)
    scaling = values["rope_scaling"]
    values["rope_scaling"] = None if scaling is None else tuple(map(tuple, scaling))
    return llama.LlamaConfig(**values)


# ---------------------------------------------------------------------------------------------
# The checks


def _typed(values, declared: dict, where: str) -> dict:
    """`values` (a JSON object) holding exactly the keys of `declared`, each of its type."""
    if not isinstance(values, dict):
        raise _Refused(where.rstrip(".") or "config", values, "expected an object")
    for key in values:
        if key not in declared:
            raise _Refused(f"{where}{key}", values[key], "not a field of it")
    for key, kind in declared.items():
        if key not in values:
            raise _Refused(f"{where}{key}", None, "missing")
        if not _is(values[key], kind):
            raise _Refused(f"{where}{key}", values[key], f"expected {_name(kind)}")
    return dict(values)


def _fields(cls, values, where: str, skip: tuple[str, ...] = ()) -> dict:
    """`values` (a JSON object) as the fields of the dataclass `cls` but `skip`, each of its
    declared type: no unknown key; a missing one takes its default (a field added since the
    bundle was written), a missing one without a default is refused."""
    if not isinstance(values, dict):
        raise _Refused(where.rstrip("."), values, "expected an object")
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.name not in skip]
    names = {f.name for f in fields}
    for key in values:
        if key not in names and key not in skip:
            raise _Refused(f"{where}{key}", values[key], f"not a field of {cls.__name__}")
    out = {}
    for field in fields:
        if field.name in values:
            value = values[field.name]
            if not _is(value, hints[field.name]):
                expected = f"expected {_name(hints[field.name])}"
                raise _Refused(f"{where}{field.name}", value, expected)
            out[field.name] = value
        elif field.default is not dataclasses.MISSING:
            out[field.name] = field.default
        else:
            raise _Refused(f"{where}{field.name}", None, "missing")
    return out


def _is(value, hint) -> bool:
    """Whether a JSON `value` is of the declared type `hint`; a float is finite (JSON's NaN and
    Infinity are not numbers a config holds); a tuple is a JSON list, its items checked by its
    field's rule."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_is(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return number and math.isfinite(value)
    if hint is tuple or origin is tuple:
        return isinstance(value, list)
    return isinstance(value, hint)  # str, dict


def _name(hint) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_name(arg) for arg in typing.get_args(hint))
    names = {type(None): "null", tuple: "a list", dict: "an object", float: "a finite float"}
    if typing.get_origin(hint) is tuple:
        return "a list"
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def _check(values: dict, where: str, rules: dict) -> None:
    """Applies each rule (a value of its declared type -> why it is refused, or None) to its
    field of `values`."""
    for key, rule in rules.items():
        why = rule(values[key])
        if why is not None:
            raise _Refused(f"{where}{key}", values[key], why)


def _between(low, high, bound: str):
    def rule(value):
        if low <= value <= high:
            return None
        return f"must be in [{low}, {high}] (at most {bound})"

    return rule


def _positive(value):
    return None if value > 0 else "must be positive"


def _non_negative(value):
    return None if value >= 0 else "must be at least 0"


def _probability(value):
    return None if 0 <= value < 1 else "must be a probability in [0, 1)"


def _divides(total: int, what: str):
    def rule(value):
        if value < 1 or total % value:
            return f"must be positive and divide {what} ({total})"
        return None

    return rule


def _one_of(options: tuple, what: str | None = None):
    def rule(value):
        if any(type(value) is type(o) and value == o for o in options):
            return None
        return f"must be one of {list(options)}" + (f" ({what})" if what else "")

    return rule


def _token(vocab: int, optional: bool = False):
    def rule(value):
        if value is None and optional:
            return None
        if type(value) is not int or not 0 <= value < vocab:
            return f"expected a token id in [0, {vocab}) (the vocabulary)"
        return None

    return rule


def _id_lists(vocab: int):
    def rule(value):
        token = _token(vocab)
        ok = all(isinstance(w, list) and w and all(token(i) is None for i in w) for w in value)
        return None if ok else f"expected lists of token ids in [0, {vocab}), none empty"

    return rule


def _pairs(value):
    """rope_scaling: null, or [name, value] pairs, each value a string or a finite number."""
    if value is None:
        return None
    scalar = lambda v: isinstance(v, str) or _is(v, float)  # noqa: E731
    ok = all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and scalar(p[1])
             for p in value)  # fmt: skip
    return None if ok else "expected null or [name, value] pairs"
