"""RAG-Sequence greedy thorough decoding by a frozen causal generator, each prompt's work done once.

A frozen generator's greedy answer after one prompt (a passage and the question) never changes,
nor does the log-probability of any answer after it. RAG-Sequence thorough decoding with one
beam (`rag.generate`, variant "sequence") is a function of three things: the greedy candidate
of each of a question's N prompts, the log-probability of every candidate after every prompt,
and the doc scores. `GreedyMemo` keeps the first two and `sequence_answers` combines them with
the doc scores by the arithmetic of `rag.generate`'s rescoring (`rag_math.nll_from_token_logprobs`,
repeated candidates dropped, the best kept, ties to the first). A question any of whose values
is not held yet runs through the generator as `rag.generate` runs it
(`causal.greedy_thorough_parts`: each prompt's keys and values computed once, for its greedy
answer and for scoring every candidate of the question after it), a few questions at a time;
evaluations that share a frozen generator (the rows and seeds of a study, its hot swap) then pay
nothing for a question whose prompts and candidates are all known. The values are the
generator's own, computed for fewer questions at a time than `rag.generate` is given, so an
answer may differ from its answer only where two candidates' likelihoods tie to float32 rounding.

Legend: B questions, N docs, S prompt length, L answer length, E prompts.
"""

import hashlib
import json
import pathlib

import numpy as np

from rag_jax import causal, generation, rag_math, sequence_candidates
from rag_jax.training import memo

CHUNK = 8  # prompts per generator call (whole questions): one program per prompt width


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


class _CandidateScores(memo.MemoFile):
    """Answer-token log-probabilities of (prompt, candidate) pairs (`GreedyMemo.scores`)."""

    what = "candidate scores of generator/settings"
    dtype = np.float32


def _prompt_key(ids: np.ndarray, mask: np.ndarray) -> bytes:
    return hashlib.sha1(ids[mask == 1].astype(np.int32).tobytes()).digest()


def _pair_key(prompt: bytes, candidate: np.ndarray) -> bytes:
    return hashlib.sha1(prompt + b"|" + candidate.astype(np.int32).tobytes()).digest()


class GreedyMemo(memo.MemoFile):
    """Greedy answers of prompts, and every candidate's log-probability after every prompt of
    its question, under one frozen causal generator and decoding settings.

    `fill(...)` computes what a batch of questions lacks; `save()` writes both memos
    atomically to `<directory>/<fingerprint>.greedy.npz` and `.scores.npz`, named by and holding
    the fingerprint of the generator, its tokenizer and the decoding settings (another's is
    never read). `computed` / `reused` count prompts run through the generator / answered from
    the memo.
    """

    what = "greedy answers of generator/settings"
    dtype = np.int32

    def __init__(self, rag_cfg, generator_fingerprint: str, directory):
        """`generator_fingerprint`: `training.memo.fingerprint` of the generator and its
        tokenizer."""
        self.cfg = rag_cfg
        self.settings = generation.resolve_settings(rag_cfg, {})
        key = {"generator": generator_fingerprint, "settings": self.settings}
        text = json.dumps(key, sort_keys=True, default=list)
        fp = hashlib.sha256(text.encode()).hexdigest()[:16]
        super().__init__(pathlib.Path(directory) / f"{fp}.greedy.npz", fp)
        self.scores = _CandidateScores(pathlib.Path(directory) / f"{fp}.scores.npz", fp)

    def save(self) -> None:
        super().save()
        self.scores.save()

    def _held(self, prompts: list[bytes]) -> bool:
        """Whether a question's prompts' greedy answers and every candidate's scores after
        every prompt are all held."""
        if any(p not in self.values for p in prompts):
            return False
        found = [self.values[p] for p in prompts]
        return all(_pair_key(p, c) in self.scores.values for p in prompts for c in found)

    def fill(self, generator_params, context_ids, context_mask, n_docs: int) -> list[bytes]:
        """Runs the generator on the questions of a batch whose values are not all held; returns
        the prompts' keys.

        Args:
          generator_params: the frozen generator's parameters (those of the fingerprint).
          context_ids: [B * N, S] prompts, row b * N + n, right- or left-padded.
          context_mask: [B * N, S].
          n_docs: N.
        """
        keys = [_prompt_key(i, m) for i, m in zip(context_ids, context_mask, strict=True)]
        questions = len(keys) // n_docs
        rows = lambda b: range(b * n_docs, (b + 1) * n_docs)  # noqa: E731
        todo = [b for b in range(questions) if not self._held([keys[r] for r in rows(b)])]
        cfg = self.cfg.replace(n_docs=n_docs)
        for chunk, take in memo.calls(todo, max(1, CHUNK // n_docs)):
            flat = [r for b in take for r in rows(b)]
            found, token_lp = causal.greedy_thorough_parts(
                cfg,
                {"generator": generator_params},
                context_ids[flat],
                context_mask[flat],
                self.settings,
            )
            found, token_lp = np.asarray(found, np.int32), np.asarray(token_lp, np.float32)
            scored = self.scored(found)
            for i, b in enumerate(chunk):
                prompts = [keys[r] for r in rows(b)]
                for n, p in enumerate(prompts):
                    self._store(p, found[i, n])
                for m, n in np.ndindex(n_docs, n_docs):
                    pair = _pair_key(prompts[n], found[i, m])
                    self.scores._store(pair, token_lp[i, m, n][scored[i, m]])
        self.computed += len(todo) * n_docs
        self.reused += (questions - len(todo)) * n_docs
        return keys

    def scored(self, answers: np.ndarray) -> np.ndarray:
        """[..., L] bool: the scored tokens of greedy answers (through the first EOS)."""
        g = self.cfg.generator
        return np.asarray(causal.label_mask(answers, g.eos_token_id, self.cfg.pad_token_id))

    def answers(self, keys: list[bytes]) -> np.ndarray:
        """[E, L] the held greedy answers of prompts by key."""
        return np.stack([self.values[k] for k in keys])

    def candidate_logprobs(self, keys: list[bytes], n_docs: int) -> np.ndarray:
        """[B * M, N, L] float32 the held log-probability of candidate m (the greedy answer of
        prompt (b, m)) after prompt (b, n), 0 where not scored."""
        found = self.answers(keys)
        scored = self.scored(found)
        questions, length = len(keys) // n_docs, found.shape[-1]
        out = np.zeros((questions, n_docs, n_docs, length), np.float32)
        for b, m, n in np.ndindex(questions, n_docs, n_docs):
            c = b * n_docs + m
            out[b, m, n, scored[c]] = self.scores.values[_pair_key(keys[b * n_docs + n], found[c])]
        return out.reshape(questions * n_docs, n_docs, length)


def sequence_answers(greedy: GreedyMemo, generator_params, context_ids, context_mask, doc_scores):
    """[B, L] RAG-Sequence thorough greedy answers, as `rag.generate(variant="sequence")` returns
    them for the same prompts and doc scores (module doc).

    Args:
      greedy: the frozen generator's greedy-answer memo.
      generator_params: the frozen generator's parameters.
      context_ids: [B * N, S] prompts, row b * N + n.
      context_mask: [B * N, S].
      doc_scores: [B, N] retrieval scores (unnormalised).
    """
    doc_scores = np.asarray(doc_scores, np.float32)
    batch, n_docs = doc_scores.shape
    context_ids, context_mask = np.asarray(context_ids), np.asarray(context_mask)
    keys = greedy.fill(generator_params, context_ids, context_mask, n_docs)
    found = greedy.answers(keys)  # -> [B * N, L]
    candidates = found.reshape(batch, n_docs, -1)  # one candidate per doc: -> [B, M = N, L]
    logprobs = greedy.candidate_logprobs(keys, n_docs)  # -> [B * M, N, L]
    scored = greedy.scored(found)
    nll = rag_math.nll_from_token_logprobs(
        logprobs, np.repeat(doc_scores, n_docs, axis=0), scored, "sequence"
    ).reshape(batch, n_docs)
    if greedy.cfg.do_deduplication:  # repeats are not candidates (`generation.rescore`)
        nll = np.where(sequence_candidates.first_occurrence_mask(candidates), nll, np.inf)
    top, _ = sequence_candidates.select_top_candidates(
        candidates, -np.asarray(nll), 1, deduplicate=False
    )
    return np.asarray(top[:, 0])
