"""A RAG model's configuration: its two halves, how they are joined, and its decoding defaults.

Frozen dataclasses, static under `jax.jit`; field names follow HF transformers' `RagConfig` and
`GenerationConfig`. Public as `rag.RagConfig` and `rag.GenerationConfig`.
"""

import dataclasses

from rag_jax.models import bart, bert, llama


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """Decoding defaults (HF `generate` settings); `generate()` keyword arguments override them."""

    num_beams: int = 4
    max_length: int = 20
    min_length: int = 0
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    no_repeat_ngram_size: int = 0
    forced_bos_token_id: int | None = None
    forced_eos_token_id: int | None = None
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    num_return_sequences: int = 1


@dataclasses.dataclass(frozen=True)
class RagConfig:
    """A RAG model: its two halves and how they are joined (field names follow HF's RagConfig)."""

    question_encoder: bert.BertConfig
    # BART (seq2seq), or a Llama-family causal LM (`rag_jax.causal`: left-padded prompt rows,
    # labels the answer tokens + EOS, the prior added once per sequence).
    generator: bart.BartConfig | llama.LlamaConfig
    n_docs: int = 5  # N: passages retrieved per question
    max_combined_length: int = 300  # S: generator context length (passage + question)
    title_sep: str = " / "  # between a passage's title and text in the context string
    doc_sep: str = " // "  # between the passage and the question
    prefix: str | None = None  # prepended to every context string
    suffix: str = ""  # after the question: a causal generator's answer cue (none for BART)
    label_smoothing: float = 0.0
    exclude_bos_score: bool = False  # RAG-Sequence: leave the BOS log-prob out of the likelihood
    reduce_loss: bool = False  # `nll` sums over the batch instead of returning [B]
    # p(z|x) = softmax(doc_score_scale * q . d): L2-normalised towers score in [-1, 1].
    doc_score_scale: float = 1.0
    do_deduplication: bool = True  # RAG-Sequence thorough decoding drops repeated candidates
    # Generator token ids as the RAG loss uses them (HF resolves BOS as
    # `rag.bos_token_id or generator.bos_token_id`; `hf.load_rag` does the same).
    bos_token_id: int | None = 0
    generation: GenerationConfig = GenerationConfig()

    @property
    def context_layout(self) -> dict:
        """How a context string is assembled: {"prefix", "title_sep", "doc_sep", "suffix"}
        (`retrieval.store.context_string`; a passage store records it)."""
        return {
            "prefix": self.prefix or "",
            "title_sep": self.title_sep,
            "doc_sep": self.doc_sep,
            "suffix": self.suffix,
        }

    @property
    def pad_token_id(self) -> int:
        return self.generator.pad_token_id

    @property
    def causal(self) -> bool:
        """Whether the generator is a causal (decoder-only) LM."""
        return isinstance(self.generator, llama.LlamaConfig)

    def replace(self, **changes) -> "RagConfig":
        return dataclasses.replace(self, **changes)
