"""A causal reader trained at its top only: its lower layers' states computed once, kept on disk.

With the reader's bottom F layers frozen (`LlamaConfig.frozen_layers`, `train.freeze` covering
its embedding and layers 0 .. F - 1) and each question's candidates fixed, the rows the reader
reads are fixed too: every (prompt, answer) row `causal.answer_rows` lays out, and so the states
its real tokens enter layer F with. `ReaderTrunk` computes them once (the embedding and layers
0 .. F - 1: the trunk, `llama.Llama.trunk`) and keeps them on disk, float32, for the real tokens
only. A train step then runs only layers F .. L - 1, the final norm and the LM head on them
(`causal.answer_logits_from_states`): the logits of `causal.answer_logits` for the same
parameters, in float32 to rounding, and the same gradients for the layers that train.

What a row is: `(prompt_ids, label_ids)`, the prompt's real tokens (no padding) and the labels
as the loss reads them (`answer_logits`' `labels` row: the answer, EOS, padding, with the pad id
in place of the ignore index). `answer_rows` counts every label column as a real token, so a
row's real tokens are its prompt and all its labels, contiguous; the positions the mask gives
them count from the prompt's first token whatever the prompt width, and no real token attends
to padding. Their states, computed for the row alone, are those of the row in any batch:
`gather` places them right-aligned in the batch's S + T columns, zeros before, and the head
recomputes the positions from the mask.

On disk, in `<root>/<key>/` (the key hashes everything the states depend on: the trunk's
fingerprint, the layer F, the compute dtype, the tokenizer and prompt layout the caller names,
the rows themselves): `states.f32` [tokens, H] float32, every row's real tokens in row order,
`offsets.npy` [R + 1] int64 (row i's states are `offsets[i]:offsets[i + 1]`), `prompts.npy`
[R] int64 each row's prompt length, and `manifest.json`, written last: a folder without it is
unfinished. A build saves its progress after every window of `WINDOW` rows (`progress.json`),
honours a stop request there, and the next build with the same key resumes after the last
window saved; rows are batched within their window only, so a resumed build writes the bytes an
uninterrupted one writes.

Size: tokens x H x 4 bytes, e.g. SmolLM2 (H 576) at 200 tokens a row is 460 KB a row, 3.7 GB
for 1,000 questions x 8 candidates.

Legend: R rows, S prompt width, T label width, H hidden, F the first layer the head runs.
"""

import functools
import hashlib
import io
import json
import pathlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rag_jax import causal
from rag_jax.devices import preemption
from rag_jax.devices.progress import Eta
from rag_jax.models import llama
from rag_jax.retrieval import encode, encoder_id, files

WINDOW = 1024  # rows between progress saves (and looks at a stop request)
BATCH = 8  # rows per trunk call
WIDTH_STEP = 16  # a trunk call's rows are padded to a multiple of this many tokens
# LlamaConfig fields that do not change the trunk's function (the layers above it, the head,
# initialisation, token ids, the gradient cut): set to their defaults before fingerprinting.
_OUTSIDE_TRUNK = (
    "tie_word_embeddings",
    "init_std",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "max_position_embeddings",
)


def trunk_names(first: int) -> tuple[str, ...]:
    """The reader's parameter names below layer `first`: the embedding and layers 0 .. F - 1."""
    return ("embed_tokens", *(f"layers_{i}" for i in range(first)))


def trunk_of(params: dict, first: int) -> dict:
    """The trunk's parameters (of the generator's tree)."""
    return {k: params[k] for k in trunk_names(first)}


def head_of(cfg: llama.LlamaConfig, params: dict, first: int) -> dict:
    """The parameters the head reads: layers F .. L - 1, the final norm, the LM head (the
    embedding when tied: then it is both, and frozen with the trunk)."""
    below = set(trunk_names(first)) - ({"embed_tokens"} if cfg.tie_word_embeddings else set())
    return {k: v for k, v in params.items() if k not in below}


def trunk_fingerprint(cfg: llama.LlamaConfig, params: dict, first: int) -> str:
    """Which function the trunk computes: `encoder_id.encoder_fingerprint` of its config (cut to
    F layers, the fields outside it at their defaults) and its parameters alone."""
    defaults = llama.LlamaConfig()
    neutral = cfg.replace(
        num_hidden_layers=first,
        frozen_layers=0,
        **{name: getattr(defaults, name) for name in _OUTSIDE_TRUNK},
    )
    return encoder_id.encoder_fingerprint(neutral, trunk_of(params, first))


def rows_checksum(rows: Sequence[tuple]) -> str:
    """sha256 of the rows in order: each one's prompt and label lengths, then its int32 tokens
    (the lengths: no other split of the same tokens into rows, prompts and labels collides)."""
    sha = hashlib.sha256()
    for prompt, labels in rows:
        prompt, labels = np.asarray(prompt, "<i4"), np.asarray(labels, "<i4")
        sha.update(np.array([prompt.size, labels.size], "<i8").tobytes())
        sha.update(prompt.tobytes())
        sha.update(labels.tobytes())
    return sha.hexdigest()


def check_first_layer(cfg: llama.LlamaConfig, first: int) -> None:
    """Raises unless 1 <= F < L (F = L would leave only the final norm and the head)."""
    if not 1 <= first < cfg.num_hidden_layers:
        raise ValueError(
            f"the reader's head must start at a layer in [1, {cfg.num_hidden_layers - 1}] (it "
            f"has {cfg.num_hidden_layers} layers), got {first}"
        )


@functools.partial(jax.jit, static_argnums=(0, 4))
def _trunk_states(cfg, trunk, input_ids, attention_mask, first):
    positions = llama.positions_from_mask(attention_mask)
    states = llama.Llama(cfg).apply(
        {"params": trunk}, input_ids, attention_mask, positions, first, method=llama.Llama.trunk
    )
    return states.astype(jnp.float32)  # -> [R, W, H]; exact for bfloat16 states


class ReaderTrunk:
    """The trunk states of a list of rows, read from their folder (`open_or_build`)."""

    def __init__(self, directory):
        self.directory = pathlib.Path(directory)
        if not (self.directory / "manifest.json").is_file():
            raise FileNotFoundError(
                f"{self.directory} has no manifest.json: its reader states are unfinished "
                "(`open_or_build` resumes them)"
            )
        self.manifest = json.loads((self.directory / "manifest.json").read_text())
        self.offsets = np.load(self.directory / "offsets.npy")
        self.prompt_lengths = np.load(self.directory / "prompts.npy")
        count, hidden = int(self.offsets[-1]), self.manifest["hidden"]
        self.states = np.memmap(
            self.directory / "states.f32", np.float32, "r", shape=(count, hidden)
        )
        self.lengths = np.diff(self.offsets)
        self.label_lengths = self.lengths - self.prompt_lengths

    @property
    def first_layer(self) -> int:
        return self.manifest["first_layer"]

    def __len__(self) -> int:
        return len(self.lengths)

    def gather(self, rows, prompt_width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The states of rows `rows` [n] laid out as `causal.answer_rows` lays their tokens out.

        Args:
          rows: [n] int row indices (the order the rows were built in).
          prompt_width: S, the batch's prompt width; None: the longest prompt of these rows.

        Returns:
          (states [n, S + T, H] float32, mask [n, S + T] int32): each row's real tokens at the
          end, zeros and mask 0 before them. T is the rows' label width (one for all).
        """
        rows = np.asarray(rows, np.int64).reshape(-1)
        if rows.size == 0 or rows.min() < 0 or rows.max() >= len(self):
            shown = f"{rows.min()}..{rows.max()}" if rows.size else "none"
            raise IndexError(f"rows must be in [0, {len(self)}), got {shown}")
        labels = np.unique(self.label_lengths[rows])
        if len(labels) != 1:
            raise ValueError(f"rows gathered together must share a label width, got {labels}")
        prompts = self.prompt_lengths[rows]
        prompt_width = int(prompts.max()) if prompt_width is None else prompt_width
        if prompts.max() > prompt_width:
            raise ValueError(
                f"a prompt of {prompts.max()} tokens does not fit width {prompt_width}"
            )
        width = prompt_width + int(labels[0])
        states = np.zeros((len(rows), width, self.states.shape[1]), np.float32)
        mask = np.zeros((len(rows), width), np.int32)
        for slot, row in enumerate(rows):
            length = int(self.lengths[row])
            states[slot, width - length :] = self.states[self.offsets[row] : self.offsets[row + 1]]
            mask[slot, width - length :] = 1
        return states, mask

    def check(
        self, cfg: llama.LlamaConfig, params: dict, first: int, rows: Sequence[tuple], layout: str
    ) -> None:
        """Raises unless these states are the trunk's (`params`' layers below `first`, computed
        in `cfg.dtype`) of exactly `rows` under `layout`, naming what differs."""
        self._check(identity(cfg, params, first, rows, layout))

    def check_trunk(self, cfg: llama.LlamaConfig, params: dict) -> None:
        """Raises unless `params`' trunk, computed in `cfg.dtype`, is the one these states are
        of (the rows unread: `check` reads them too), e.g. a reader restored from a checkpoint.

        Args:
          cfg: the reader's config.
          params: the reader's parameters, or only its trunk's (`trunk_of`).
        """
        first = self.first_layer
        fingerprint = trunk_fingerprint(cfg, params, first)
        self._check({"trunk_fingerprint": fingerprint, "compute_dtype": cfg.dtype})

    def _check(self, expected: dict) -> None:
        stale = sorted(k for k, v in expected.items() if self.manifest.get(k) != v)
        if stale:
            raise ValueError(
                f"{self.directory}: the cached reader states are not this reader's trunk's of "
                f"these rows ({', '.join(stale)} differ); the reader's layers below its head "
                "and its embedding must stay frozen, and the rows (candidates, prompts, "
                "labels) fixed"
            )


def identity(
    cfg: llama.LlamaConfig, params: dict, first: int, rows: Sequence[tuple], layout: str
) -> dict:
    """What trunk states depend on (and what their folder's key hashes).

    Args:
      cfg: the reader's config (its `dtype` is the states' compute dtype).
      params: the reader's (generator's) parameter tree.
      first: F, the head's first layer.
      rows: [(prompt_ids [p] int, label_ids [t] int)] in order.
      layout: the caller's name for how its rows were made (e.g. its tokenizer's fingerprint
        and prompt format): rows of the same tokens under another layout are another cache.
    """
    return {
        "trunk_fingerprint": trunk_fingerprint(cfg, params, first),
        "first_layer": first,
        "compute_dtype": cfg.dtype,
        "layout": layout,
        "rows_checksum": rows_checksum(rows),
    }


def open_or_build(
    root,
    cfg: llama.LlamaConfig,
    params: dict,
    first: int,
    rows: Sequence[tuple],
    layout: str,
    batch_size: int = BATCH,
) -> ReaderTrunk:
    """The trunk states of `rows` under `params`' layers below `first`, from `<root>/<key>` when
    built before, else built there now (resuming a stopped build).

    Args:
      root: the folder of every cache (one subfolder per key).
      cfg: the reader's config.
      params: the reader's (generator's) parameters.
      first: F, the head's first layer, in [1, L - 1].
      rows: [(prompt_ids, label_ids)]: each prompt's real tokens and its labels as the loss
        reads them (pad, not the ignore index, after the answer).
      layout: the caller's tokenizer and prompt layout identity (see `identity`).
      batch_size: rows per trunk call (the same for a build and its resumption).
    """
    check_first_layer(cfg, first)
    if not len(rows):
        raise ValueError("no rows to compute the reader's trunk states of")
    for i, (prompt, labels) in enumerate(rows):
        prompt, labels = np.asarray(prompt), np.asarray(labels)
        if prompt.ndim != 1 or labels.ndim != 1 or not prompt.size or not labels.size:
            raise ValueError(
                f"row {i}: prompt {prompt.shape} and labels {labels.shape} must be 1-D"
            )
        if min(prompt.min(), labels.min()) < 0 or max(prompt.max(), labels.max()) >= cfg.vocab_size:
            raise ValueError(
                f"row {i}: token ids must be in [0, {cfg.vocab_size}) (the pad id in place of "
                f"the ignore index {causal.IGNORE_INDEX})"
            )
        if prompt.size + labels.size > cfg.max_position_embeddings:
            raise ValueError(
                f"row {i}: {prompt.size} + {labels.size} tokens exceed the reader's "
                f"max_position_embeddings={cfg.max_position_embeddings}"
            )
    ident = identity(cfg, params, first, rows, layout)
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    directory = pathlib.Path(root) / key
    if not (directory / "manifest.json").is_file():
        directory.mkdir(parents=True, exist_ok=True)
        _build(directory, cfg, params, first, rows, ident, batch_size)
    trunk = ReaderTrunk(directory)
    trunk._check(ident)
    return trunk


def _build(directory: pathlib.Path, cfg, params, first, rows, ident, batch_size) -> None:
    count, hidden = len(rows), cfg.hidden_size
    offsets_path, progress_path = directory / "offsets.npy", directory / "progress.json"
    states_path = directory / "states.f32"
    progress = json.loads(progress_path.read_text()) if progress_path.is_file() else {}
    if progress.get("identity") == ident and offsets_path.is_file() and states_path.is_file():
        offsets, done = np.load(offsets_path), progress["done"]
    else:  # a new build: the rows' offsets and prompt lengths first
        prompts = np.array([len(p) for p, _ in rows], np.int64)
        lengths = prompts + np.array([len(t) for _, t in rows], np.int64)
        offsets, done = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), 0
        files.write_atomic(directory / "prompts.npy", _npy(prompts))
        files.write_atomic(offsets_path, _npy(offsets))
        states_path.unlink(missing_ok=True)
    total, lengths = int(offsets[-1]), np.diff(offsets)
    print(
        f"reader trunk states: {count} rows, {total} tokens x {hidden} float32 "
        f"({total * hidden * 4 / 2**30:.2f} GiB) in {directory}",
        flush=True,
    )
    out = np.memmap(
        states_path, np.float32, "r+" if states_path.is_file() else "w+", shape=(total, hidden)
    )
    trunk = jax.device_put(trunk_of(params, first))
    longest = int(lengths.max())
    buckets = tuple(range(WIDTH_STEP, longest + WIDTH_STEP, WIDTH_STEP))
    eta = Eta("reader trunk states", count, "rows", start=done)
    for start in range(done, count, WINDOW):
        eta.update(start)
        if preemption.should_stop():
            raise preemption.Preempted(
                f"stopped while computing the reader trunk states in {directory}: {start} of "
                f"{count} rows are saved, and the next run resumes there"
            )
        window = range(start, min(count, start + WINDOW))
        for batch, width in encode.plan_batches(lengths[start : window.stop], batch_size, buckets):
            ids = np.full((len(batch), width), cfg.pad_token_id, np.int32)
            mask = np.zeros((len(batch), width), np.int32)
            for slot, row in enumerate(batch + start):  # left-padded, as `answer_rows` pads
                prompt, labels = rows[row]
                ids[slot, width - lengths[row] :] = np.concatenate([prompt, labels])
                mask[slot, width - lengths[row] :] = 1
            states = np.asarray(_trunk_states(cfg, trunk, ids, mask, first))
            for slot, row in enumerate(batch + start):
                out[offsets[row] : offsets[row + 1]] = states[slot, width - lengths[row] :]
        out.flush()
        done = window.stop
        files.write_atomic(progress_path, json.dumps({"identity": ident, "done": done}).encode())
    eta.update(count)
    del out
    manifest = {**ident, "hidden": hidden, "rows": count, "tokens": total}
    files.write_atomic(directory / "manifest.json", json.dumps(manifest, indent=1).encode())
    progress_path.unlink(missing_ok=True)


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()
