"""RAG-Sequence greedy thorough decoding by a frozen causal generator, each prompt's work done once.

A frozen generator's greedy answer after one prompt (a passage and the question) never changes,
nor does the log-probability of any answer after it. RAG-Sequence thorough decoding with one
beam (`rag.generate`, variant "sequence") is a function of three things: the greedy candidate
of each of a question's N prompts, the log-probability of every candidate after every prompt,
and the doc scores. `GreedyMemo` keeps the first, `training.memo.AnswerMemo` the second (the
memo the joint step reads), and `sequence_answers` combines them with the doc scores by the
arithmetic of `rag.generate`'s rescoring (`rag_math.nll_from_token_logprobs`, repeated
candidates dropped, the best kept, ties to the first). Evaluations that share a frozen
generator (the rows and seeds of a study, its hot swap) then pay one generator pass per prompt
none of them has seen; a question whose passages are all known costs no generator pass. The
values are the generator's own, computed a few prompts at a time rather than a question's N at
once, so an answer may differ from `rag.generate`'s only where two candidates' likelihoods tie
to float32 rounding.

Legend: B questions, N docs, S prompt length, L answer length, E prompts.
"""

import hashlib
import json
import pathlib

import numpy as np

from rag_jax import causal, generation, rag, rag_math, sequence_candidates
from rag_jax.training import memo

CHUNK = 8  # prompts per greedy call: one compiled program per prompt width


def check_supported(rag_cfg, variant: str, sequence_decoding: str) -> None:
    """Refuses what the memoised decoding does not compute: anything but greedy RAG-Sequence
    thorough decoding by a causal generator without label smoothing, one answer a question."""
    settings = generation.resolve_settings(rag_cfg, {})
    problems = []
    if not causal.is_causal(rag_cfg):
        problems.append("a causal generator (model.generator_path a Llama-family model)")
    if variant != "sequence" or sequence_decoding != "thorough":
        problems.append(
            f"rag.variant 'sequence' with thorough decoding (got {variant!r}, "
            f"{sequence_decoding!r})"
        )
    if settings["num_beams"] != 1 or settings["num_return_sequences"] != 1:
        problems.append(
            f"greedy decoding, one answer (got eval.num_beams {settings['num_beams']}, "
            f"{settings['num_return_sequences']} returned)"
        )
    if rag_cfg.label_smoothing:
        problems.append(f"rag.label_smoothing 0 (got {rag_cfg.label_smoothing})")
    if problems:
        raise ValueError("config.eval.answer_memo needs " + "; ".join(problems))


class GreedyMemo(memo.MemoFile):
    """Greedy answers of prompts under one frozen causal generator and decoding settings.

    `candidates(...)` returns them, generating those of prompts it has not seen; `save()` writes
    the memo atomically to `<directory>/<fingerprint>.greedy.npz`, named by and holding the
    fingerprint of the generator, its tokenizer and the decoding settings (another's is never
    read).
    """

    what = "greedy answers of generator/settings"
    dtype = np.int32

    def __init__(self, rag_cfg, generator_fingerprint: str, directory):
        """`generator_fingerprint`: `training.memo.fingerprint` of the generator and its
        tokenizer (the answer memo's, `AnswerMemo.fingerprint`)."""
        self.cfg = rag_cfg.replace(n_docs=1)
        key = {
            "generator": generator_fingerprint,
            "settings": generation.resolve_settings(rag_cfg, {}),
        }
        text = json.dumps(key, sort_keys=True, default=list)
        fp = hashlib.sha256(text.encode()).hexdigest()[:16]
        super().__init__(pathlib.Path(directory) / f"{fp}.greedy.npz", fp)

    def candidates(self, generator_params, context_ids, context_mask) -> np.ndarray:
        """[E, L] int32 greedy answers (padded after EOS) of E prompts [E, S], right- or
        left-padded, as `rag.generate` writes them."""
        context_ids, context_mask = np.asarray(context_ids), np.asarray(context_mask)
        keys = [
            hashlib.sha1(context_ids[r][context_mask[r] == 1].astype(np.int32).tobytes()).digest()
            for r in range(len(context_ids))
        ]
        missing = self._missing(keys)
        for start in range(0, len(missing), CHUNK):
            chunk = missing[start : start + CHUNK]
            take = chunk + [chunk[0]] * (CHUNK - len(chunk))  # padded with copies of its first
            tokens = rag.generate(
                self.cfg,
                {"generator": generator_params},
                context_ids[take],
                context_mask[take],
                np.zeros((CHUNK, 1), np.float32),
                variant="sequence",
                sequence_decoding="thorough",
            )
            tokens = np.asarray(tokens, np.int32)
            for i, r in enumerate(chunk):
                self.values[keys[r]] = tokens[i]
        return np.stack([self.values[k] for k in keys])


def sequence_answers(
    answers: memo.AnswerMemo,
    greedy: GreedyMemo,
    generator_params,
    context_ids,
    context_mask,
    doc_scores,
) -> np.ndarray:
    """[B, L] RAG-Sequence thorough greedy answers, as `rag.generate(variant="sequence")` returns
    them for the same prompts and doc scores (module doc).

    Args:
      answers: the frozen generator's answer log-probability memo.
      greedy: its greedy-answer memo (the same generator and tokenizer).
      generator_params: the frozen generator's parameters.
      context_ids: [B * N, S] prompts, row b * N + n.
      context_mask: [B * N, S].
      doc_scores: [B, N] retrieval scores (unnormalised).
    """
    doc_scores = np.asarray(doc_scores, np.float32)
    batch, n_docs = doc_scores.shape
    context_ids, context_mask = np.asarray(context_ids), np.asarray(context_mask)
    found = greedy.candidates(generator_params, context_ids, context_mask)  # -> [B * N, L]
    candidates = found.reshape(batch, n_docs, -1)  # one candidate per doc: -> [B, M = N, L]
    # Every candidate after every prompt of its question: row (b, m) holds candidate m, its
    # prompts those of question b.
    per_candidate = np.repeat(context_ids.reshape(batch, 1, n_docs, -1), n_docs, axis=1)
    per_mask = np.repeat(context_mask.reshape(batch, 1, n_docs, -1), n_docs, axis=1)
    width = context_ids.shape[-1]
    logprobs = answers.logprobs(
        generator_params,
        per_candidate.reshape(-1, width),
        per_mask.reshape(-1, width),
        found,  # the labels of rows (b, m): candidate m of question b
    )  # -> [B * M, N, L]
    g = greedy.cfg.generator
    scored = causal.label_mask(found, g.eos_token_id, greedy.cfg.pad_token_id)
    nll = rag_math.nll_from_token_logprobs(
        logprobs, np.repeat(doc_scores, n_docs, axis=0), scored, "sequence"
    ).reshape(batch, n_docs)
    if greedy.cfg.do_deduplication:  # repeats are not candidates (`generation.rescore`)
        nll = np.where(sequence_candidates.first_occurrence_mask(candidates), nll, np.inf)
    top, _ = sequence_candidates.select_top_candidates(
        candidates, -np.asarray(nll), 1, deduplicate=False
    )
    return np.asarray(top[:, 0])
