"""Unsupervised warm start of both retriever towers with the inverse cloze task (ICT).

ICT (Lee et al. 2019, ORQA; also REALM's retriever pre-training) turns an unlabelled corpus into
retrieval training data: one sentence of a passage is the query, the rest of that passage is its
positive, and the other passages of the batch are the negatives. With probability `keep_prob`
(ORQA: 0.1) the sentence is left in its passage, so the towers also learn that a passage holding
the query's words verbatim is a match. The loss is the softmax cross-entropy over the in-batch
scores `q . d`, the same dot product RAG's retriever ranks by. Randomly initialised towers rank
by chance (separate inits) or by crude token overlap (one shared init); after ICT they rank the
passages that share a query's context (on the synthetic world: its entity) first, which gives
joint RAG training gold passages in the top-k to learn from.

Legend: B batch, Q query length, P passage length, D embedding width, C corpus size (passages),
M sentences over the whole corpus.

Sentences: a passage's text is split after every sentence-final punctuation mark (".", "?", "!")
that is followed by whitespace, i.e. on ". ", "? " and "! " (`split_sentences`). This is
deliberately simple: abbreviations ("Dr. Who") split too. A passage with a single sentence uses
its whole text as the query and keeps it in the positive (there is nothing else to keep).

Inputs are tokenised exactly as the rest of the project encodes them: a query is
`tokenizer(sentence)` truncated and padded to Q; a positive is what `encode.tokenize_passages`
makes of (title, text) with `input_format=passage_format` ("pair": `[CLS] title [SEP] text [SEP]`;
"single": `title + " " + text`), truncated and padded to P. Every batch has the same [B, Q] and
[B, P] shapes, so the step compiles once.

Batches are a pure function of `(seed, step)`: epoch `e` visits the passages in the order of a
permutation drawn from `(seed, e)` (the last `C mod B` passages of each permutation are skipped, so
batches never repeat a passage), and the sentence and the keep draw of each example come from
`(seed, step)`. Dropout keys are `fold_in(dropout_rng, step)`, from an "rbg" key (XLA's
RngBitGenerator: on CPU the step compiles in about half the time it takes with threefry, and
dropout needs no cross-backend reproducibility). Same seed and machine, same parameters, bitwise.

The tokenised corpus is held in memory (int32 ids and masks: 8 (Q + P) bytes per sentence plus
8 P per passage) and the step runs on the default device: this is a warm start for corpora of up
to some 1e5 passages, not a pre-training pipeline for Wikipedia.

Optimisation (`training.optim.WARM_START`): AdamW with linear warmup over the first tenth of the
steps and linear decay to zero (BERT's schedule), weight decay on matrices only (not on biases or
LayerNorm parameters) and gradient clipping at global norm 1, the usual recipe for fine-tuning BERT
towers.
"""

import dataclasses
import functools
import re
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rag_jax.devices.progress import EVERY_S, Eta
from rag_jax.models import bert
from rag_jax.retrieval import encode
from rag_jax.run import checkpoints
from rag_jax.training.optim import make_optimizer, warm_start_settings
from rag_jax.training.step import init_state, make_step

# A sentence ends at ".", "?" or "!" followed by whitespace (see the module docstring).
_SENTENCE_END = re.compile(r"(?<=[.?!])\s+")
_DATA, _DROPOUT = 0, 1  # named streams of the seed


def split_sentences(text: str) -> list[str]:
    """Splits `text` after every ".", "?" or "!" followed by whitespace.

    Args:
      text: passage text.

    Returns:
      The non-empty sentences, stripped, in order; [] for blank text.
    """
    return [s for s in (p.strip() for p in _SENTENCE_END.split(text.strip())) if s]


@dataclasses.dataclass(frozen=True)
class IctData:
    """The corpus tokenised once for ICT; `ict_batch` only gathers rows of these arrays.

    Sentence rows of passage c are `first_sentence[c] : first_sentence[c] + num_sentences[c]`.
    """

    query_ids: np.ndarray  # [M, Q] int32: each sentence as a query, padded
    query_mask: np.ndarray  # [M, Q] int32: 1 = token
    context_ids: np.ndarray  # [M, P] int32: the passage without that sentence (or whole if single)
    context_mask: np.ndarray  # [M, P] int32
    passage_ids: np.ndarray  # [C, P] int32: the whole passage (the `keep_prob` positive)
    passage_mask: np.ndarray  # [C, P] int32
    first_sentence: np.ndarray  # [C] int64: row of the passage's first sentence
    num_sentences: np.ndarray  # [C] int64: sentences of the passage (>= 1)

    @property
    def num_passages(self) -> int:
        return self.passage_ids.shape[0]


def _padded(rows: list[list[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Token id lists (each at most `length` long) -> ([R, length] ids, [R, length] mask)."""
    ids = np.full((len(rows), length), pad_id, np.int32)
    mask = np.zeros((len(rows), length), np.int32)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    return ids, mask


def prepare_ict_data(
    tokenizer,
    passages: Sequence[tuple[str, str]],
    *,
    query_length: int,
    passage_length: int,
    passage_format: str = "pair",
    vocab_size: int | None = None,
) -> IctData:
    """Splits and tokenises every passage for ICT.

    Args:
      tokenizer: the retriever's HF tokenizer (both towers share it, as in DPR).
      passages: C (title, text) pairs; every text must hold at least one sentence.
      query_length: Q, tokens per query after truncation, special tokens included.
      passage_length: P, tokens per passage after truncation, special tokens included.
      passage_format: "pair" or "single", as `encode.tokenize_passages`' `input_format`.
      vocab_size: when given, every token id must be below it (the encoder's vocabulary).

    Returns:
      The padded arrays (see `IctData`).
    """
    if passage_format not in encode.INPUT_FORMATS:
        raise ValueError(
            f"passage_format must be one of {encode.INPUT_FORMATS}, got {passage_format!r}"
        )
    if not passages:
        raise ValueError("passages is empty: ICT needs at least two passages")
    titles, queries, context_titles, contexts, counts = [], [], [], [], []
    for c, record in enumerate(passages):
        if not isinstance(record, (tuple, list)) or len(record) != 2:
            raise ValueError(f"passages[{c}] must be a (title, text) pair, got {record!r}")
        title, text = record
        sentences = split_sentences(text)
        if not sentences:
            raise ValueError(f"passages[{c}] (title {title!r}) has no text: {text!r}")
        titles.append(title)
        counts.append(len(sentences))
        queries += sentences
        if len(sentences) == 1:
            contexts.append(text)
        else:
            for j in range(len(sentences)):
                contexts.append(" ".join(sentences[:j] + sentences[j + 1 :]))
        context_titles += [title] * len(sentences)
    texts = [text for _, text in passages]
    pad_id = tokenizer.pad_token_id
    query_rows = tokenizer(queries, truncation=True, max_length=query_length)["input_ids"]
    tokenize = functools.partial(
        encode.tokenize_passages, max_length=passage_length, input_format=passage_format
    )
    query_ids, query_mask = _padded(query_rows, query_length, pad_id)
    context_rows = tokenize(tokenizer, context_titles, contexts)
    context_ids, context_mask = _padded(context_rows, passage_length, pad_id)
    passage_ids, passage_mask = _padded(tokenize(tokenizer, titles, texts), passage_length, pad_id)
    if vocab_size is not None:
        for name, ids in (("query", query_ids), ("passage", passage_ids), ("context", context_ids)):
            if ids.max() >= vocab_size:
                raise ValueError(
                    f"the tokenizer produced {name} token id {ids.max()} but the encoder's "
                    f"vocab_size is {vocab_size}; use the encoder's own tokenizer"
                )
    counts = np.asarray(counts, np.int64)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return IctData(
        query_ids, query_mask, context_ids, context_mask, passage_ids, passage_mask, first, counts
    )


def ict_batch(
    data: IctData, *, seed: int, step: int, batch_size: int, keep_prob: float
) -> dict[str, np.ndarray]:
    """The ICT batch of `step`, a pure function of `(seed, step)` (see the module docstring).

    Args:
      data: the tokenised corpus.
      seed: the run's seed.
      step: the 0-based step.
      batch_size: B, at most C.
      keep_prob: probability that the query sentence stays in its positive.

    Returns:
      {"query_ids", "query_mask": [B, Q] int32, "passage_ids", "passage_mask": [B, P] int32,
       "passage_rows": [B] int64 corpus rows, "sentence_rows": [B] int64 query rows of `data`,
       "kept": [B] bool whether the positive is the whole passage}.
    """
    if not 1 <= batch_size <= data.num_passages:
        raise ValueError(f"batch_size={batch_size} must be in [1, {data.num_passages}] (passages)")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    per_epoch = data.num_passages // batch_size
    epoch, position = divmod(step, per_epoch)
    order = np.random.default_rng((seed, _DATA, 0, epoch)).permutation(data.num_passages)
    rows = order[position * batch_size : (position + 1) * batch_size]  # -> [B]
    rng = np.random.default_rng((seed, _DATA, 1, step))
    counts = data.num_sentences[rows]
    sentence_rows = data.first_sentence[rows] + rng.integers(0, counts)  # -> [B]
    # A single-sentence passage's context already is the whole passage.
    kept = (rng.random(batch_size) < keep_prob) | (counts == 1)
    return {
        "query_ids": data.query_ids[sentence_rows],
        "query_mask": data.query_mask[sentence_rows],
        "passage_ids": np.where(
            kept[:, None], data.passage_ids[rows], data.context_ids[sentence_rows]
        ),
        "passage_mask": np.where(
            kept[:, None], data.passage_mask[rows], data.context_mask[sentence_rows]
        ),
        "passage_rows": rows,
        "sentence_rows": sentence_rows,
        "kept": kept,
    }


def ict_loss(
    query_vectors: jax.Array,
    passage_vectors: jax.Array,
    scale: float = 1.0,
    same: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """In-batch softmax cross-entropy: query b's positive is passage b, the others are negatives.

    Args:
      query_vectors: [B, D] float32.
      passage_vectors: [B, D] float32.
      scale: the scores are `scale * q . d`, as the retriever ranks (`rag.doc_score_scale`:
        L2-normalised towers score cosines in [-1, 1], which a softmax at scale 1 barely tells
        apart).
      same: [B, B] bool, whether passage c is query b's positive too (a batch of questions that
        share a gold passage): left out of b's negatives. None: every other passage is one.

    Returns:
      (mean loss, fraction of queries whose own passage scores highest), both [] float32.
    """
    if query_vectors.ndim != 2 or query_vectors.shape != passage_vectors.shape:
        raise ValueError(
            f"query_vectors {query_vectors.shape} and passage_vectors {passage_vectors.shape} "
            "must both be [B, D]"
        )
    scores = scale * jnp.einsum("bd,cd->bc", query_vectors, passage_vectors)  # -> [B, B]
    if same is not None:
        scores = jnp.where(same & ~jnp.eye(scores.shape[0], dtype=bool), -jnp.inf, scores)
    labels = jnp.arange(scores.shape[0])
    loss = optax.softmax_cross_entropy_with_integer_labels(scores, labels).mean()
    accuracy = (jnp.argmax(scores, axis=-1) == labels).mean()
    return loss, accuracy


@functools.cache
def _make_ict_step(cfg: bert.BertConfig, learning_rate: float, steps: int, deterministic: bool,
                   seed: int, scale: float = 1.0):  # fmt: skip
    """(optimizer, the jitted ICT step `(state, batch) -> (state, metrics)`), made by
    `training.step.make_step`. Cached, so warm starts with the same settings share one compiled
    step."""
    encoder = bert.BertEncoder(cfg)
    tx = make_optimizer(warm_start_settings(learning_rate, steps))

    def loss_fn(params, batch, step_rng):
        q_rng, p_rng = jax.random.split(step_rng)
        q, _ = encoder.apply(
            {"params": params["question"]},
            batch["query_ids"],
            batch["query_mask"],
            deterministic=deterministic,
            rngs={"dropout": q_rng},
        )  # -> [B, D]
        d, _ = encoder.apply(
            {"params": params["passage"]},
            batch["passage_ids"],
            batch["passage_mask"],
            deterministic=deterministic,
            rngs={"dropout": p_rng},
        )  # -> [B, D]
        loss, accuracy = ict_loss(q, d, scale, batch.get("same"))
        return loss, accuracy

    # An "rbg" key (XLA's RngBitGenerator): on CPU the step compiles in about half the time.
    dropout_rng = jax.random.fold_in(jax.random.key(seed, impl="rbg"), _DROPOUT)
    metrics_fn = lambda loss, accuracy, grads: {"loss": loss, "in_batch_accuracy": accuracy}
    return tx, make_step(loss_fn, tx, dropout_rng=dropout_rng, metrics_fn=metrics_fn)


def ict_warm_start(
    cfg: bert.BertConfig,
    question_params,
    passage_params,
    tokenizer,
    passages: Sequence[tuple[str, str]],
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    seed: int,
    query_length: int,
    passage_length: int,
    keep_prob: float = 0.1,
    passage_format: str = "pair",
    deterministic: bool = True,
    log_every: int = 10,
    progress: checkpoints.Progress | None = None,
    scale: float = 1.0,
) -> tuple[dict, dict, list[dict]]:
    """Trains the question and passage towers with ICT on `passages`.

    The towers share `cfg` but not parameters: each starts from its own argument (which may be the
    same tree; the arguments are copied, never modified).

    Args:
      cfg: the encoders' configuration.
      question_params: initial question-tower `BertEncoder` parameters.
      passage_params: initial passage-tower `BertEncoder` parameters.
      tokenizer: the retriever's HF tokenizer.
      passages: C (title, text) pairs, the corpus; C >= batch_size.
      steps: training steps, >= 1.
      batch_size: B, queries per step (B - 1 in-batch negatives each), in [2, C].
      learning_rate: peak AdamW learning rate, > 0.
      seed: determines the batches, the keep draws and dropout.
      query_length: Q, tokens per query.
      passage_length: P, tokens per passage.
      keep_prob: probability that the query sentence stays in its positive, in [0, 1].
      passage_format: "pair" (title [SEP] text) or "single" (title + " " + text).
      deterministic: no dropout; when False, dropout at `cfg`'s rates with keys drawn from `seed`.
      log_every: steps per log entry; the last step is always logged.
      progress: where the warm start saves its state when stopped (SIGTERM) and resumes it from.
      scale: the scores' scale (`ict_loss`), the retriever's `rag.doc_score_scale`.

    Returns:
      (question_params, passage_params, log), where each log entry is {"step": steps done,
      "loss", "in_batch_accuracy": means over the steps since the previous entry}.

    Raises:
      ValueError: an argument out of range, naming it.
      FloatingPointError: a non-finite loss, naming the step.
    """
    check_schedule(steps, batch_size, learning_rate)
    if not len(passages):
        raise ValueError("passages is empty: ICT needs at least batch_size passages")
    if batch_size > len(passages):
        raise ValueError(
            f"batch_size={batch_size} exceeds the number of passages ({len(passages)}); "
            f"use batch_size <= {len(passages)}"
        )
    if not 0.0 <= keep_prob <= 1.0:
        raise ValueError(f"keep_prob must be in [0, 1], got {keep_prob!r}")
    for name, length in (("query_length", query_length), ("passage_length", passage_length)):
        if not 3 <= length <= cfg.max_position_embeddings:
            raise ValueError(
                f"{name}={length} must be in [3, max_position_embeddings="
                f"{cfg.max_position_embeddings}]"
            )
    if log_every < 1:
        raise ValueError(f"log_every must be >= 1, got {log_every!r}")
    data = prepare_ict_data(
        tokenizer,
        passages,
        query_length=query_length,
        passage_length=passage_length,
        passage_format=passage_format,
        vocab_size=cfg.vocab_size,
    )

    batches = functools.partial(
        ict_batch, data, seed=seed, batch_size=batch_size, keep_prob=keep_prob
    )
    return train_towers(
        "ICT warm start", cfg, question_params, passage_params, batches, steps=steps,
        learning_rate=learning_rate, seed=seed, deterministic=deterministic, log_every=log_every,
        progress=progress, scale=scale, unit=f"{batch_size} passages",
    )  # fmt: skip


def check_schedule(steps, batch_size, learning_rate) -> None:
    """Refuses, naming the value, what no in-batch warm start can run: steps < 1, a batch of
    fewer than 2 (no negative), a rate <= 0."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 2:
        raise ValueError(f"batch_size must be an int >= 2 (in-batch negatives), got {batch_size!r}")
    if not learning_rate > 0.0:
        raise ValueError(f"learning_rate must be > 0, got {learning_rate!r}")


def train_towers(
    label: str,
    cfg: bert.BertConfig,
    question_params,
    passage_params,
    batches: Callable[..., dict],
    *,
    steps: int,
    learning_rate: float,
    seed: int,
    deterministic: bool,
    log_every: int,
    progress: checkpoints.Progress | None,
    scale: float,
    unit: str,
) -> tuple[dict, dict, list[dict]]:
    """Both towers trained on `batches(step=k)` (query and passage ids and masks [B, L], and
    optionally `same` [B, B]) by the in-batch loss (`ict_loss`); `ict_warm_start`'s returns."""
    tx, step_fn = _make_ict_step(cfg, float(learning_rate), steps, deterministic, seed, scale)
    # Copies: the state is donated to the step, and the caller keeps its own trees intact.
    params = jax.tree.map(jnp.array, {"question": question_params, "passage": passage_params})
    state = init_state(params, tx)
    if progress is not None:  # a warm start stopped midway goes on from where it stopped
        state = progress.load(state) or state

    log, window = [], []
    queued = None  # the previous step's loss, while the device may still run it
    eta = Eta(label, steps, "steps", start=int(state.step))
    if jax.process_index() == 0:  # the first step compiles: say so rather than wait in silence
        print(f"{label}: {steps} steps of {unit}; compiling the step, then a line every "
              f"{EVERY_S:.0f} s", flush=True)  # fmt: skip
    for step in range(int(state.step), steps):
        if progress is not None:
            progress.stop_if_requested(state, step, steps)
        batch = batches(step=step)
        keys = ("query_ids", "query_mask", "passage_ids", "passage_mask", "same")
        inputs = {k: batch[k] for k in keys if k in batch}
        state, metrics = step_fn(state, jax.device_put(inputs))
        window.append(metrics)
        # At most one step dispatched behind the running one: a stop request (SIGTERM) is
        # honoured within about a step, not after every step the host had queued ahead.
        if queued is not None:
            queued.block_until_ready()
        queued = metrics["loss"]
        if (step + 1) % log_every == 0 or step + 1 == steps:
            values = jax.device_get(window)
            loss = float(np.mean([m["loss"] for m in values]))
            if not np.isfinite(loss):
                raise FloatingPointError(
                    f"non-finite {label} loss {loss} in steps {step + 2 - len(values)}..{step + 1}"
                )
            accuracy = float(np.mean([m["in_batch_accuracy"] for m in values]))
            log.append({"step": step + 1, "loss": loss, "in_batch_accuracy": accuracy})
            window = []
            eta.update(step + 1, f"loss {loss:.3f}, in-batch accuracy {accuracy:.2f}")
    return state.params["question"], state.params["passage"], log
