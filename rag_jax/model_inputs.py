"""Model inputs made on the host: question tokens, answer labels and the widths batches pad to.

Legend: B batch, S context length, T target length, Q question length.
"""

import numpy as np

from rag_jax import causal, rag


def question_tokens(tokenizer, questions, max_length: int) -> dict[str, np.ndarray]:
    """Question-encoder inputs [B, Q] (padded to `max_length`, so one compilation)."""
    enc = tokenizer(
        list(questions),
        max_length=max_length,
        truncation=True,
        padding="max_length",
        return_tensors="np",
    )
    return {
        "question_input_ids": enc["input_ids"].astype(np.int32),
        "question_attention_mask": enc["attention_mask"].astype(np.int32),
    }


def context_width(attention_mask: np.ndarray, max_length: int, multiple: int) -> int:
    """How many context columns a batch needs: its longest context rounded up to `multiple`.

    HF pads every context to `max_combined_length`; the columns past a batch's longest context
    are padding in every row, and dropping them leaves the step's loss and gradients unchanged
    (padded keys get zero attention weight, padded queries are read by nothing). Rounding up to
    `multiple` bounds how many step widths get compiled.

    Args:
      attention_mask: [rows, S] 0/1, each row's real tokens a prefix (`context_tokens`).
      max_length: S; the width when `multiple` is 0 and the cap otherwise.
      multiple: width granularity; 0 = always `max_length`.

    Returns:
      The width, in [min(multiple, S), S].
    """
    if not multiple:
        return max_length
    used = np.flatnonzero(np.asarray(attention_mask).any(axis=0))
    longest = int(used[-1]) + 1 if used.size else 0
    return min(max_length, max(multiple, -(-longest // multiple) * multiple))


def label_width(
    labels: np.ndarray, pad_id: int, max_length: int, multiple: int, eos_id: int | None = None
) -> int:
    """How many label columns a batch needs: its longest label rounded up to `multiple`.

    The columns past a batch's longest label are padding in every row. Dropping them leaves both
    RAG losses and their gradients unchanged: the loss masks padded targets (the last kept
    column's target, shifted in from the right, is padding either way) and the decoder is causal,
    so no kept position reads a dropped one. HF's RAG fine-tuning collator trims its targets the
    same way (`trim_batch`).

    Args:
      labels: [B, T] `answer_labels`.
      pad_id: the generator's pad id.
      max_length: T; the width when `multiple` is 0 and the cap otherwise.
      multiple: width granularity; 0 = always `max_length`.
      eos_id: a causal generator's EOS id, which may equal its pad id: every position up to a
        row's first EOS counts, that EOS included (`causal.label_mask`).
    """
    labels = np.asarray(labels)
    used = labels != pad_id
    if eos_id is not None:
        used = np.asarray(causal.label_mask(labels, eos_id, pad_id))
    return context_width(used, max_length, multiple)


def answer_labels(tokenizer, answers, rag_cfg: rag.RagConfig, max_length: int) -> np.ndarray:
    """[B, T] labels laid out as generated sequences: decoder start, BOS, answer, EOS, pads.

    The RAG loss reads labels as decoder inputs (nothing is shifted right), so training targets
    take the exact form of what generation produces and rescoring scores.

    A causal generator's labels are the answer tokens and EOS (what it generates after the
    prompt). Either way a row whose EOS does not fit in T is cut to its first T tokens and gets
    no EOS, so a cut answer never teaches the generator to stop early.
    """
    gen = rag_cfg.generator
    out = np.full((len(answers), max_length), gen.pad_token_id, np.int32)
    start = [] if rag_cfg.causal else [gen.decoder_start_token_id, rag_cfg.bos_token_id]
    for i, answer in enumerate(answers):
        ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
        row = [*start, *ids, gen.eos_token_id][:max_length]
        out[i, : len(row)] = row
    return out
