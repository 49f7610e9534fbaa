"""A frozen generator's answer log-likelihoods, computed once per (passage, question, answer).

When joint training keeps the generator frozen (`train.freeze` covers `generator/`), the loss's
only trainable input is the doc scores: the log-probability of an answer's tokens after one
prompt (passage, question, answer cue) never changes between steps. `AnswerMemo` computes it the
first time a prompt and answer meet and reads it back afterwards, exactly: each value is the
generator's own forward pass of that pair (through a shared prefix, below: the same values within
float32 rounding, 1.7e-5 at most on SmolLM2), and the joint step combines the values with the doc
scores by the same arithmetic as from logits (`rag_math.nll_from_token_logprobs`). Training
several epochs over a question set then costs one generator pass per distinct pair.

Pairs whose prompts share a prefix (the passage: prompts are laid out passage first) are computed
through it (`causal_prefix`): the prefix's keys and values once, then each pair's own tokens, the
rest of its prompt and its answer; a pair that shares nothing takes the full forward pass
(`pair_logprobs`, the reference). `AnswerMemo.fill` computes a whole study's pairs ahead of time,
grouped by prefix across all of them.

Keys are the pair's tokens (the prompt's real tokens and the answer's scored tokens), so a
prompt layout, a question or an answer that changes is a new pair. A memo belongs to one generator
and one tokenizer: its file is named by their fingerprint and holds it, and a file whose
fingerprint differs is never read. Causal generators only (a seq2seq generator's loss would
need its decoder's own target handling).

Legend: B batch, N docs, S prompt length, T answer length, M pairs computed in one call.
"""

import functools
import hashlib
import io
import json
import pathlib
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rag_jax import causal, causal_prefix, rag_math
from rag_jax.devices import preemption
from rag_jax.retrieval import encoder_id, files
from rag_jax.retrieval.tokenizer_id import tokenizer_fingerprint

CHUNK = 8  # pairs per generator call: one compiled program per (prompt width, answer width)
PROGRESS_EVERY_S = 10.0  # `AnswerMemo.fill`: seconds between progress lines
SAVE_EVERY_S = 120.0  # `AnswerMemo.fill`: seconds between saves (what a kill can lose)


def print_flushed(line: str) -> None:
    """`AnswerMemo.fill`'s progress lines, flushed (a study's log shows them as they come)."""
    print(line, flush=True)


def calls(todo: list, size: int):
    """`todo` in calls of at most `size` items: (the items, the items a call computes). A last
    short call is padded with copies of its first item up to a power of two only (a step whose
    few new pairs are 1 of 8 computes 1, not 8), so at most log2(size) + 1 programs per shape."""
    for start in range(0, len(todo), size):
        chunk = todo[start : start + size]
        width = min(size, 1 << (len(chunk) - 1).bit_length())
        yield chunk, chunk + [chunk[0]] * (width - len(chunk))


def fingerprint(rag_cfg, generator_params, tokenizer) -> str:
    """The generator's and tokenizer's fingerprint, which names and guards a memo.

    The generator's compute dtype is part of it: the same parameters computed in bfloat16 give
    other log-probabilities than in float32, and a memo holds the values of one of them."""
    key = {
        "generator": encoder_id.encoder_fingerprint(rag_cfg.generator, generator_params),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "compute_dtype": str(rag_cfg.generator.dtype),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def pair_key(prompt_ids: np.ndarray, answer_ids: np.ndarray) -> bytes:
    """The 20-byte key of a (prompt, answer) pair: sha1 of the prompt's length, then the prompt's
    and the answer's int32 tokens (the length prefix: no other split of the same tokens into a
    prompt and an answer has the same key).

    Args:
      prompt_ids: [S'] the prompt's real tokens.
      answer_ids: [T'] the answer's scored tokens.
    """
    prompt_ids = np.asarray(prompt_ids, np.int32)
    return hashlib.sha1(
        np.int64(len(prompt_ids)).tobytes()
        + prompt_ids.tobytes()
        + np.asarray(answer_ids, np.int32).tobytes()
    ).digest()


@functools.partial(jax.jit, static_argnums=0)
def pair_logprobs(rag_cfg, generator_params, context_ids, context_mask, labels) -> jax.Array:
    """[M, T] `log p(labels[m, t] | prompt m, labels[m, :t])` of M (prompt, answer) pairs.

    Args:
      rag_cfg: the RAG config (a causal generator).
      generator_params: its parameters.
      context_ids: [M, S] prompts, right- or left-padded.
      context_mask: [M, S].
      labels: [M, T] answer tokens (pad in place of the ignore index).
    """
    one = rag_cfg.replace(n_docs=1)
    logits = causal.answer_logits(
        one, {"generator": generator_params}, context_ids, context_mask, labels
    )  # -> [M, T, V]
    token_lp, _ = rag_math.token_logprobs(logits[:, None], labels)  # -> [M, 1, T]
    return token_lp[:, 0]


class MemoFile:
    """1-D arrays by 20-byte key, kept in one `.npz` file named by and holding a fingerprint:
    the file handling `AnswerMemo` and `training.memo_decoding.GreedyMemo` (and its scores) share.

    Read at construction (a file of another fingerprint is refused, named); `save()` writes it
    atomically, merged with what another memo object or process wrote to it meanwhile.
    """

    what = "memo"  # for messages: what the file holds
    dtype = np.float32

    def __init__(self, path: pathlib.Path, fingerprint: str):
        self.fingerprint, self.path = fingerprint, path
        self.values: dict[bytes, np.ndarray] = {}
        self.computed = self.reused = 0  # values, since construction
        self._unsaved = 0
        if self.path.is_file():
            self.values.update(self._read())

    def __len__(self) -> int:
        return len(self.values)

    def _read(self) -> dict[bytes, np.ndarray]:
        try:
            with np.load(self.path, allow_pickle=False) as f:
                stored = str(f["fingerprint"])
                keys, offsets, values = f["keys"], f["offsets"], f["values"]
        except Exception as e:  # zip/npz errors name neither the file nor the cause
            raise ValueError(f"{self.path}: unreadable {self.what} ({e}); delete it") from e
        if stored != self.fingerprint:
            raise ValueError(
                f"{self.path} holds the {self.what} of {stored}, not of this run's "
                f"{self.fingerprint}; it is not read (delete it or use another "
                "warm_start.cache_dir)"
            )
        return {key.tobytes(): values[offsets[i] : offsets[i + 1]] for i, key in enumerate(keys)}

    def save(self) -> None:
        """Writes the memo, merged with what another memo object (an evaluation's, another
        process's) wrote to the same file meanwhile (only when it grew since the last write;
        process 0 only)."""
        if not self._unsaved or jax.process_index() != 0:
            return
        if self.path.is_file():
            for key, value in self._read().items():
                self.values.setdefault(key, value)
        keys = list(self.values)
        lengths = [len(self.values[k]) for k in keys]
        arrays = {
            "fingerprint": np.array(self.fingerprint),
            "keys": np.array([np.frombuffer(k, np.uint8) for k in keys], np.uint8).reshape(-1, 20),
            "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            "values": np.concatenate([self.values[k] for k in keys] or [np.zeros(0)]).astype(
                self.dtype
            ),
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        files.write_atomic(self.path, buffer.getvalue())
        self._unsaved = 0

    def _store(self, key: bytes, value: np.ndarray) -> None:
        """Holds `value` under `key` unless a value is held there already."""
        if key not in self.values:
            self.values[key] = np.asarray(value, self.dtype)
            self._unsaved += 1

    def _missing(self, keys: list[bytes]) -> list[int]:
        """The rows of `keys` to compute: each key not held yet, at its first row; counts them."""
        missing, new = [], set()
        for r, k in enumerate(keys):
            if k not in self.values and k not in new:
                new.add(k)
                missing.append(r)
        self.computed += len(missing)
        self.reused += len(keys) - len(missing)
        return missing


class AnswerMemo(MemoFile):
    """Answer log-probabilities of (prompt, answer) pairs under one frozen causal generator.

    `logprobs(...)` returns them for a batch, computing the pairs it has not seen; `fill(...)`
    computes a study's pairs ahead of time; `save()` writes the memo atomically to
    `<directory>/<fingerprint>.npz` (read back at construction).
    """

    what = "answer memo of generator/tokenizer"

    def __init__(self, rag_cfg, generator_params, tokenizer, directory):
        if not causal.is_causal(rag_cfg):
            raise ValueError(
                "config.train.answer_memo needs a causal generator (model.generator_path a "
                "Llama-family model); a seq2seq generator's likelihood is not memoised"
            )
        if rag_cfg.label_smoothing:
            raise ValueError(
                f"config.train.answer_memo memoises the answer tokens' log-probabilities, not "
                f"the label-smoothing sums: set config.rag.label_smoothing=0 (it is "
                f"{rag_cfg.label_smoothing})"
            )
        self.cfg = rag_cfg
        fp = fingerprint(rag_cfg, generator_params, tokenizer)
        super().__init__(pathlib.Path(directory) / f"{fp}.npz", fp)

    def logprobs(self, generator_params, context_ids, context_mask, labels) -> np.ndarray:
        """[B, N, T] float32 answer-token log-probabilities, 0 where not scored.

        Args:
          generator_params: the frozen generator's parameters (those of the fingerprint).
          context_ids: [B * N, S] prompts (row b * N + n), as the joint step reads them.
          context_mask: [B * N, S].
          labels: [B, T] answer labels (`model_inputs.answer_labels`).
        """
        context_ids, context_mask = np.asarray(context_ids), np.asarray(context_mask)
        labels = np.asarray(labels)
        batch, width = labels.shape
        n_docs = context_ids.shape[0] // batch
        g = self.cfg.generator
        labels = np.where(labels == causal.IGNORE_INDEX, self.cfg.pad_token_id, labels)
        scored = np.asarray(causal.label_mask(labels, g.eos_token_id, self.cfg.pad_token_id))
        rows = np.repeat(np.arange(batch), n_docs)  # the question of each prompt row
        keys = [
            pair_key(context_ids[r][context_mask[r] == 1], labels[b][scored[b]])
            for r, b in enumerate(rows)
        ]
        missing = self._missing(keys)
        prompts = [context_ids[r][context_mask[r] == 1] for r in missing]
        # Pairs whose prompts share a prefix (a passage other questions also retrieved) are
        # computed through it; a prompt that shares none takes the full forward pass, CHUNK a
        # call, at the batch's prompt width (one program, as before prefixes were shared).
        groups = causal_prefix.group_by_prefix(prompts)
        alone = [missing[group.pairs[0]] for group in groups if len(group.pairs) == 1]
        for chunk, take in calls(alone, CHUNK):
            values = np.asarray(
                pair_logprobs(
                    self.cfg,
                    generator_params,
                    jnp.asarray(context_ids[take]),
                    jnp.asarray(context_mask[take]),
                    jnp.asarray(labels[rows[take]]),
                )
            )
            for i, r in enumerate(chunk):
                self._store(keys[r], values[i][scored[rows[r]]])
        answers = [labels[rows[r]][: _scored_width(scored[rows[r]])] for r in missing]
        for pairs, values in causal_prefix.logprob_calls(
            g,
            generator_params,
            prompts,
            answers,
            [group for group in groups if len(group.pairs) > 1],
        ):
            for i, value in zip(pairs, values):
                r = missing[i]
                self._store(keys[r], value[scored[rows[r]][: len(value)]])
        out = np.zeros((batch * n_docs, width), np.float32)
        for r, (key, b) in enumerate(zip(keys, rows)):
            out[r, scored[b]] = self.values[key]
        return out.reshape(batch, n_docs, width)

    def fill(
        self,
        generator_params,
        prompts: Sequence[np.ndarray],
        answers: Sequence[np.ndarray],
        *,
        progress: Callable[[str], None] | None = print_flushed,
        save_every_s: float = SAVE_EVERY_S,
    ) -> int:
        """Computes every pair (prompts[m], answers[m]) the memo does not hold, ahead of training:
        grouped by shared prompt prefix across all of them (`causal_prefix`), every pair through
        its prefix. Saves every `save_every_s` seconds and at the end, so a kill loses at most
        that much work.

        Args:
          generator_params: the frozen generator's parameters (those of the fingerprint).
          prompts: M arrays [S_m] int, each prompt's real tokens (a `context_tokens` row where
            its mask is 1).
          answers: M label rows [T_m] int as the training batches hold them
            (`model_inputs.answer_labels` rows: answer, EOS, then pads or the ignore index).
          progress: called every `PROGRESS_EVERY_S` seconds and at the end with a line (pairs
            done, pairs/s, time left); None: silent.
          save_every_s: seconds between saves.

        Returns:
          How many pairs were computed (the distinct pairs not held before).
        """
        if len(prompts) != len(answers):
            raise ValueError(f"{len(prompts)} prompts and {len(answers)} answers")
        g = self.cfg.generator
        pad = self.cfg.pad_token_id
        # The rows as `logprobs` reads them (the ignore index as pad, then scored), padded here
        # with the ignore index so that the padding is never scored.
        labels = np.full((len(answers), max(map(len, answers), default=0)), causal.IGNORE_INDEX)
        for m, answer in enumerate(answers):
            answer = np.asarray(answer)
            labels[m, : len(answer)] = np.where(answer == causal.IGNORE_INDEX, pad, answer)
        scored = np.asarray(causal.label_mask(labels, g.eos_token_id, pad))
        prompts = [np.asarray(p, np.int32) for p in prompts]
        keys = [pair_key(p, labels[m][scored[m]]) for m, p in enumerate(prompts)]
        missing = self._missing(keys)
        start = noted = saved = time.monotonic()
        done = 0
        for pairs, values in causal_prefix.logprob_calls(
            g,
            generator_params,
            [prompts[m] for m in missing],
            [labels[m][: _scored_width(scored[m])] for m in missing],
        ):
            for i, value in zip(pairs, values):
                m = missing[i]
                self._store(keys[m], value[scored[m][: len(value)]])
            done += len(pairs)
            now = time.monotonic()
            if progress is not None and now - noted >= PROGRESS_EVERY_S:
                progress(_progress_line(done, len(missing), now - start))
                noted = now
            if now - saved >= save_every_s:
                self.save()
                saved = now
            if preemption.should_stop():
                self.save()
                raise preemption.Preempted(
                    f"stopped filling the answer memo after {done} of {len(missing)} pairs; "
                    f"they are saved in {self.path} and the same call computes only the rest"
                )
        self.save()
        if progress is not None:
            progress(_progress_line(done, len(missing), time.monotonic() - start))
        return len(missing)


def _scored_width(scored: np.ndarray) -> int:
    """How many leading labels of a row [T] to compute: up to its last scored one."""
    where = np.flatnonzero(scored)
    return int(where[-1]) + 1 if len(where) else 0


def _progress_line(done: int, total: int, seconds: float) -> str:
    rate = done / seconds if seconds > 0 else 0.0
    left = (total - done) / rate if rate > 0 else float("inf") if done < total else 0.0
    return (
        f"answer memo: {done}/{total} pairs computed, {rate:.2f} pairs/s, "
        f"{seconds / 60:.1f} min so far, {left / 60:.1f} min left"
    )
