"""Supervised warm start of both retriever towers on the training questions' gold passages.

The supervised ceiling with both towers trained, as a practitioner fine-tunes a bi-encoder for a
new domain (DPR, Karpukhin et al. 2020, with in-batch negatives only; sentence-transformers'
multiple-negatives ranking loss): question b's positive is its gold passage, the other questions'
gold passages of the batch are its negatives, except any that is its own gold passage too
(questions of one article often share one: left out, `ict.ict_loss`'s `same`). The scores are the
retriever's `doc_score_scale * q . d`, the loss, optimiser and loop `ict.train_towers`'.

Batches are a pure function of `(seed, step)`: epoch `e` visits the (question, gold passage)
pairs in the order of a permutation drawn from `(seed, e)`, the last `M mod B` of each skipped.
The question is tokenised as the question tower reads it (`[CLS] question [SEP]`, Q tokens), the
passage as the store's passages are encoded (`encode.tokenize_passages`, P tokens).

Legend: B batch, Q question tokens, P passage tokens, M pairs.
"""

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from rag_jax.models import bert
from rag_jax.retrieval import encode
from rag_jax.run import checkpoints
from rag_jax.training import ict

_DATA = 2  # the seed's stream for the pairs' order (ICT's are 0 and 1)


@dataclasses.dataclass(frozen=True)
class PairData:
    """The pairs tokenised once; `pairs_batch` only gathers rows."""

    query_ids: np.ndarray  # [M, Q] int32
    query_mask: np.ndarray  # [M, Q] int32
    passage_ids: np.ndarray  # [M, P] int32
    passage_mask: np.ndarray  # [M, P] int32
    passage_rows: np.ndarray  # [M] int64: each pair's passage, a corpus row

    @property
    def num_pairs(self) -> int:
        return self.query_ids.shape[0]


def prepare_pairs(
    tokenizer,
    questions: Sequence[str],
    passages: Sequence[tuple[str, str]],
    rows: Sequence[int],
    *,
    query_length: int,
    passage_length: int,
    passage_format: str = "pair",
) -> PairData:
    """Tokenises M (question, gold passage) pairs: `questions[m]` with `passages[m]` (title,
    text), the corpus row `rows[m]` (pairs of one row are each other's duplicates)."""
    if not len(questions) == len(passages) == len(rows):
        raise ValueError(f"{len(questions)} questions, {len(passages)} passages, {len(rows)} rows")
    pad_id = tokenizer.pad_token_id
    query_rows = tokenizer(list(questions), truncation=True, max_length=query_length)["input_ids"]
    query_ids, query_mask = ict._padded(query_rows, query_length, pad_id)
    tokens = encode.tokenize_passages(
        tokenizer,
        [title for title, _ in passages],
        [text for _, text in passages],
        max_length=passage_length,
        input_format=passage_format,
    )
    passage_ids, passage_mask = ict._padded(tokens, passage_length, pad_id)
    return PairData(query_ids, query_mask, passage_ids, passage_mask, np.asarray(rows, np.int64))


def pairs_batch(data: PairData, *, seed: int, step: int, batch_size: int) -> dict[str, np.ndarray]:
    """Batch `step`: {"query_ids", "query_mask" [B, Q], "passage_ids", "passage_mask" [B, P],
    "same" [B, B] bool (pairs c and b share their gold passage), "pairs" [B] int64}."""
    if not 1 <= batch_size <= data.num_pairs:
        raise ValueError(f"batch_size={batch_size} must be in [1, {data.num_pairs}] (pairs)")
    per_epoch = data.num_pairs // batch_size
    epoch, position = divmod(step, per_epoch)
    order = np.random.default_rng((seed, _DATA, epoch)).permutation(data.num_pairs)
    pairs = order[position * batch_size : (position + 1) * batch_size]  # -> [B]
    rows = data.passage_rows[pairs]
    return {
        "query_ids": data.query_ids[pairs],
        "query_mask": data.query_mask[pairs],
        "passage_ids": data.passage_ids[pairs],
        "passage_mask": data.passage_mask[pairs],
        "same": rows[:, None] == rows[None, :],
        "pairs": pairs,
    }


def gold_warm_start(
    cfg: bert.BertConfig,
    question_params,
    passage_params,
    tokenizer,
    questions: Sequence[str],
    passages: Sequence[tuple[str, str]],
    rows: Sequence[int],
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    seed: int,
    query_length: int,
    passage_length: int,
    passage_format: str = "pair",
    deterministic: bool = True,
    scale: float = 1.0,
    log_every: int = 10,
    progress: checkpoints.Progress | None = None,
) -> tuple[dict, dict, list[dict]]:
    """Trains both towers on the pairs (`prepare_pairs`' arguments); `ict.ict_warm_start`'s
    returns. `batch_size` in [2, M]; the other arguments as `ict.ict_warm_start`'s."""
    ict.check_schedule(steps, batch_size, learning_rate)
    if batch_size > len(questions):
        raise ValueError(f"batch_size={batch_size} exceeds the {len(questions)} training pairs")
    data = prepare_pairs(
        tokenizer,
        questions,
        passages,
        rows,
        query_length=query_length,
        passage_length=passage_length,
        passage_format=passage_format,
    )
    batches = functools.partial(pairs_batch, data, seed=seed, batch_size=batch_size)
    return ict.train_towers(
        "gold warm start", cfg, question_params, passage_params, batches, steps=steps,
        learning_rate=learning_rate, seed=seed, deterministic=deterministic, log_every=log_every,
        progress=progress, scale=scale, unit=f"{batch_size} questions",
    )  # fmt: skip
