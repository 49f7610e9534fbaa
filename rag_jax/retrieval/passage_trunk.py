"""The passage tower trained at its top only: the lower layers' states computed once, kept on disk.

With `config.retrieval.passage_head_layers = H` the passage tower trains its top H layers (and
its pooler and projection, where it has them): the head. The embeddings and the L - H layers
below, the trunk, stay frozen, so the states every passage enters the head with are a constant of
the run. `TrunkStates` computes them once for the whole store and keeps them on disk, float32,
for the real tokens only. Then:

- a train step's doc vectors of its retrieved passages run only the head, on the passages'
  cached states (`rag.passage_embeddings(..., first_layer=L - H)`);
- an index refresh re-encodes the corpus the same way (`HeadEncoder`), about H / L of the
  whole tower's work.

Both equal the whole tower's vectors for the same parameters (in float32, to rounding: the
trunk's states do not depend on how the passages were padded).

Size: tokens x hidden width x 4 bytes, e.g. SQuAD's 20,963 paragraphs at MiniLM's 384 are about
3.6M tokens, 5.5 GB. It suits corpora of up to about a million passages; the paper's 21M (3 TB
at 768) trains its passage tower with the whole tower re-encoding (`refresh_every` alone).

On disk, in `<root>/<key>/` (the key hashes everything the states depend on: the trunk's
fingerprint, the corpus checksum, the tokenizer, how passages are read, the compute dtype):
`states.f32` [T, H] float32 rows of every passage's tokens in store order, `offsets.npy` [C + 1]
int64 (passage i's rows are `offsets[i]:offsets[i + 1]`), and `manifest.json`, written last: a
folder without it is unfinished. A build saves its progress after every window of `WINDOW`
passages (`progress.json`), honours a stop request there, and the next build with the same key
resumes after the last window saved.
"""

import dataclasses
import functools
import hashlib
import io
import json
import pathlib
import re

import jax
import numpy as np

from rag_jax.devices import preemption
from rag_jax.devices.progress import Eta
from rag_jax.models import bert
from rag_jax.retrieval import encode, encoder_id, files
from rag_jax.retrieval.retriever import PassageEncoder
from rag_jax.retrieval.store import PassageStore, tokenizer_fingerprint

WINDOW = 4096  # passages between progress saves (and looks at a stop request)
WIDTH_STEP = 64  # a train batch's states are padded to a multiple of this many tokens
TRUNK_NAMES = ("word_embeddings", "position_embeddings", "token_type_embeddings", "embeddings_ln")


def first_layer(cfg: bert.BertConfig, head_layers: int) -> int:
    """The head's first layer, L - H, after checking 1 <= H < L (the whole tower trains with
    `refresh_every` alone: the embeddings' output would save next to nothing)."""
    if not 1 <= head_layers < cfg.num_hidden_layers:
        raise ValueError(
            f"config.retrieval.passage_head_layers={head_layers} must be in "
            f"[1, {cfg.num_hidden_layers - 1}] (the passage tower has {cfg.num_hidden_layers} "
            "layers; 0 trains them all)"
        )
    return cfg.num_hidden_layers - head_layers


def trunk_names(first: int) -> tuple[str, ...]:
    """The passage tower's parameter names below layer `first`."""
    return (*TRUNK_NAMES, *(f"layer_{i}" for i in range(first)))


def trunk_pattern(first: int) -> str:
    """A `train.freeze` regex part matching exactly the trunk's parameters."""
    return "^passage_encoder/(" + "|".join(trunk_names(first)) + ")/"


def check_freeze(freeze: str, cfg: bert.BertConfig, head_layers: int) -> int:
    """The head's first layer, after checking that `freeze` (`train.freeze`) covers exactly the
    trunk of the passage tower: its states are computed once, so it must not train, and the
    head must."""
    first = first_layer(cfg, head_layers)
    regex = re.compile(freeze) if freeze else None
    frozen = lambda name: regex is not None and regex.search(f"passage_encoder/{name}/") is not None  # noqa: E731
    head = [f"layer_{i}" for i in range(first, cfg.num_hidden_layers)]
    trained = [n for n in trunk_names(first) if not frozen(n)]
    stuck = [n for n in head if frozen(n)]
    if trained or stuck:
        what = f"leaves {trained} trainable" if trained else f"freezes the head's {stuck}"
        raise ValueError(
            f"config.retrieval.passage_head_layers={head_layers}: config.train.freeze={freeze!r} "
            f"{what}; the passage tower's layers below layer {first} must be frozen and the "
            f"others trainable, e.g. with `{trunk_pattern(first)}` as a part of train.freeze"
        )
    return first


def trunk_of(cfg: bert.BertConfig, params: dict, first: int) -> tuple[bert.BertConfig, dict]:
    """The trunk as an encoder of its own: (config, parameters)."""
    trunk_cfg = cfg.replace(num_hidden_layers=first, with_pooler=False, projection_dim=0)
    return trunk_cfg, {k: params[k] for k in trunk_names(first) if k in params}


def head_of(params: dict, first: int) -> dict:
    """The head's parameters: every one the trunk does not hold."""
    below = set(trunk_names(first))
    return {k: v for k, v in params.items() if k not in below}


def trunk_fingerprint(cfg: bert.BertConfig, params: dict, first: int) -> str:
    """Which function the trunk computes (`encoder_id.encoder_fingerprint` of it alone)."""
    return encoder_id.encoder_fingerprint(*trunk_of(cfg, params, first))


@functools.partial(jax.jit, static_argnums=0)
def _trunk_states(trunk_cfg, params, input_ids, attention_mask):
    return bert.BertEncoder(trunk_cfg).apply({"params": params}, input_ids, attention_mask)[1][
        "hidden"
    ]  # -> [B, S, H] float32


@functools.partial(jax.jit, static_argnums=(0, 4))
def _head_vectors(cfg, head, states, attention_mask, first):
    return bert.BertEncoder(cfg).apply({"params": head}, states, attention_mask, first_layer=first)[
        0
    ]  # -> [B, D] float32


def padded_width(longest: int, max_length: int) -> int:
    """The width a batch whose longest passage has `longest` tokens is padded to."""
    return min(max_length, -(-longest // WIDTH_STEP) * WIDTH_STEP)


class TrunkStates:
    """The trunk's states of every passage of a store, read from their folder (`open_or_build`)."""

    def __init__(self, directory):
        self.directory = pathlib.Path(directory)
        self.manifest = json.loads((self.directory / "manifest.json").read_text())
        self.offsets = np.load(self.directory / "offsets.npy")
        count, hidden = int(self.offsets[-1]), self.manifest["hidden"]
        self.states = np.memmap(
            self.directory / "states.f32", np.float32, "r", shape=(count, hidden)
        )
        self.lengths = np.diff(self.offsets)

    @property
    def first_layer(self) -> int:
        return self.manifest["first_layer"]

    def __len__(self) -> int:
        return len(self.lengths)

    def gather(self, rows, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The states of passages `rows` [n]: ([n, W, H] float32, [n, W] int32 mask), W `width`
        or the longest one's `padded_width`."""
        rows = np.asarray(rows, np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(
                f"passage rows must be in [0, {len(self)}), got {rows.min()}..{rows.max()}"
            )
        lengths = self.lengths[rows]
        longest = int(lengths.max()) if rows.size else 1
        width = padded_width(longest, self.manifest["max_length"]) if width is None else width
        if longest > width:
            raise ValueError(f"a passage of {longest} tokens does not fit width {width}")
        states = np.zeros((len(rows), width, self.states.shape[1]), np.float32)
        mask = np.zeros((len(rows), width), np.int32)
        for slot, (row, length) in enumerate(zip(rows, lengths)):
            states[slot, :length] = self.states[self.offsets[row] : self.offsets[row + 1]]
            mask[slot, :length] = 1
        return states, mask

    def check(self, encoder: PassageEncoder, store: PassageStore) -> None:
        """Raises unless these states are `encoder`'s trunk's of `store`."""
        expected = _identity(encoder, store, self.first_layer)
        stale = sorted(k for k, v in expected.items() if self.manifest.get(k) != v)
        if stale:
            raise ValueError(
                f"{self.directory}: the cached passage states are not this encoder's of this "
                f"corpus ({', '.join(stale)} differ); a head layer's training must leave the "
                f"layers below it frozen (`{trunk_pattern(self.first_layer)}` in train.freeze)"
            )


def _identity(encoder: PassageEncoder, store: PassageStore, first: int) -> dict:
    return {
        "trunk_fingerprint": trunk_fingerprint(encoder.cfg, encoder.params, first),
        "corpus_checksum": store.checksum,
        "tokenizer_fingerprint": tokenizer_fingerprint(encoder.tokenizer),
        "max_length": encoder.max_length,
        "input_format": encoder.input_format,
        "compute_dtype": encoder.cfg.dtype,
        "first_layer": first,
    }


def open_or_build(root, store: PassageStore, encoder: PassageEncoder, first: int) -> TrunkStates:
    """The trunk states of `store` under `encoder`'s trunk (its layers below `first`), from
    `<root>/<key>` when built before, else built there now (resuming a stopped build)."""
    identity = _identity(encoder, store, first)
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    directory = pathlib.Path(root) / key
    if (directory / "manifest.json").is_file():
        states = TrunkStates(directory)
        states.check(encoder, store)
        return states
    directory.mkdir(parents=True, exist_ok=True)
    _build(directory, store, encoder, first, identity)
    return TrunkStates(directory)


def _tokens(store: PassageStore, encoder: PassageEncoder, rows: range) -> list[list[int]]:
    return encode.tokenize_passages(
        encoder.tokenizer,
        [store.title(i) for i in rows],
        [store.text(i) for i in rows],
        max_length=encoder.max_length,
        input_format=encoder.input_format,
    )


def _build(directory: pathlib.Path, store, encoder: PassageEncoder, first: int, identity) -> None:
    count, hidden = len(store), encoder.cfg.hidden_size
    offsets_path, progress_path = directory / "offsets.npy", directory / "progress.json"
    progress = json.loads(progress_path.read_text()) if progress_path.is_file() else {}
    if progress.get("identity") == identity and offsets_path.is_file():
        offsets, done = np.load(offsets_path), progress["done"]
    else:  # a new build: every passage's token count first, for the rows' offsets
        lengths = np.zeros(count, np.int64)
        for start in range(0, count, WINDOW):
            window = range(start, min(count, start + WINDOW))
            lengths[start : window.stop] = [len(t) for t in _tokens(store, encoder, window)]
        offsets, done = np.concatenate([[0], np.cumsum(lengths)]), 0
        files.write_atomic(offsets_path, _npy(offsets))
        (directory / "states.f32").unlink(missing_ok=True)
    total = int(offsets[-1])
    print(
        f"passage trunk states: {count} passages, {total} tokens x {hidden} float32 "
        f"({total * hidden * 4 / 2**30:.2f} GiB) in {directory}",
        flush=True,
    )
    mode = "r+" if (directory / "states.f32").is_file() else "w+"
    out = np.memmap(directory / "states.f32", np.float32, mode, shape=(total, hidden))
    trunk_cfg, trunk = trunk_of(encoder.cfg, encoder.params, first)
    trunk = jax.device_put(trunk)
    buckets = encode.default_buckets(encoder.max_length)
    pad = encoder.tokenizer.pad_token_id
    eta = Eta("passage trunk states", count, "passages", start=done)
    for start in range(done, count, WINDOW):
        eta.update(start)
        if preemption.should_stop():
            raise preemption.Preempted(
                f"stopped while computing the passage trunk states in {directory}: {start} of "
                f"{count} passages are saved, and the next run resumes there"
            )
        window = range(start, min(count, start + WINDOW))
        tokens = _tokens(store, encoder, window)
        lengths = np.array([len(t) for t in tokens])
        for rows, width in encode.plan_batches(lengths, encoder.batch_size, buckets):
            ids = np.full((len(rows), width), pad, np.int32)
            mask = np.zeros((len(rows), width), np.int32)
            for slot, row in enumerate(rows):
                ids[slot, : lengths[row]], mask[slot, : lengths[row]] = tokens[row], 1
            hidden_states = np.asarray(_trunk_states(trunk_cfg, trunk, ids, mask))
            for slot, row in enumerate(rows):
                at = int(offsets[start + row])
                out[at : at + lengths[row]] = hidden_states[slot, : lengths[row]]
        out.flush()
        done = window.stop
        files.write_atomic(progress_path, json.dumps({"identity": identity, "done": done}).encode())
    eta.update(count)
    del out
    manifest = {**identity, "hidden": hidden, "passages": count, "tokens": total}
    files.write_atomic(directory / "manifest.json", json.dumps(manifest, indent=1).encode())
    progress_path.unlink(missing_ok=True)


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


@dataclasses.dataclass(frozen=True)
class HeadEncoder(PassageEncoder):
    """A passage encoder whose store passages run only the head, on `trunk`'s cached states.

    Other passages (`encode`: a bundle's edits) run the whole tower. The parameters' trunk must
    be the one the states were computed with (checked on construction)."""

    trunk: TrunkStates | None = None
    store: PassageStore | None = None

    def __post_init__(self):
        if self.trunk is None or self.store is None:
            raise ValueError("HeadEncoder needs the trunk states and their store")
        self.trunk.check(self, self.store)

    def encode_rows(self, store: PassageStore, rows: range) -> np.ndarray:
        """[n, D] float32 vectors of the store's passages `rows`, the head run on their states."""
        if store.checksum != self.store.checksum:
            return super().encode_rows(store, rows)
        first = self.trunk.first_layer
        head = jax.device_put(head_of(self.params, first))
        rows = np.arange(rows.start, rows.stop)
        out = np.empty((len(rows), self.cfg.embedding_dim), np.float32)
        buckets = [
            padded_width(b, self.max_length) for b in encode.default_buckets(self.max_length)
        ]
        buckets = sorted(set(buckets))
        for batch, width in encode.plan_batches(self.trunk.lengths[rows], self.batch_size, buckets):
            states, mask = self.trunk.gather(rows[batch], width)
            out[batch] = np.asarray(_head_vectors(self.cfg, head, states, mask, first))
        return out
