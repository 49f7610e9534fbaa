"""Corpus encoding: passages -> passage-encoder vectors on disk (sharded, resumable) -> index.

Legend: B batch (global, over all devices), S padded length (a bucket), D embedding width,
C corpus size.

Passage input, as DPR's `generate_dense_embeddings.py` builds it (`input_format="pair"`): the
text pair `tokenizer(title, text.strip(), truncation=True, max_length=max_length)`, i.e.
`[CLS] title [SEP] text [SEP]`, with HF's default `longest_first` truncation (tokens are removed
from the longer of the two, in practice the text, and the final [SEP] is kept); a passage with an
empty title is `tokenizer(text)` alone. DPR's encoder config uses `sequence_length: 256`, hence
`DEFAULT_MAX_LENGTH` (HF's RAG examples leave it at the tokenizer's 512). Token type ids are all
zero, as in DPR (it passes `torch.zeros_like(ids)` as segments), and the attention mask covers the
real tokens. `input_format="single"` encodes `title + " " + text` as one text, for encoders trained
on single sentences (sentence-transformers' MiniLM).

Batching: passages are tokenised a window at a time (`sort_window` rows), sorted by token length
within the window, cut into batches of B and each batch padded to the smallest bucket length
that fits it (`default_buckets`: multiples of 16 and `max_length`), so at most one program per
bucket is compiled and little padding is computed. The batch is sharded over the `data` axis of a
mesh of this process's devices with the parameters replicated; B is rounded up to a multiple of
the device count and padding rows are never written. Vectors return to their original row
order. The encoder runs its last layer for the [CLS] position only (`pooled_vectors`), the only
one the vector needs.

On disk (`encode_corpus`): shards of `shard_size` rows plus a manifest, see
`rag_jax.retrieval.vectors`. The shard is the unit of work; a re-run with the same arguments skips
the shards already recorded and, since each shard is computed from its own rows only and batched
the same way, produces byte-identical files.

Several hosts (`encode_corpus` under `jax.distributed`): each process encodes with its own
devices (`data_mesh`, B rows per call on each process) the unfinished shards dealt to it
round-robin (`distributed.process_shards`); process 0 alone writes the manifest, before (the
run's fields) and after (every shard, from the record files the processes wrote,
`vectors.write_record`), with a barrier between. The finished directory is the one a single
process writes; its shards are byte-identical to it when the processes' meshes have the single
process's device count.
"""

import dataclasses
import functools
import pathlib
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rag_jax.devices import distributed
from rag_jax.models import bert, layers
from rag_jax.retrieval import vectors
from rag_jax.retrieval.encoder_id import encoder_fingerprint
from rag_jax.retrieval.files import DTYPES
from rag_jax.retrieval.tokenizer_id import tokenizer_fingerprint

DEFAULT_MAX_LENGTH = 256
INPUT_FORMATS = ("pair", "single")
# ---------------------------------------------------------------------------------------------
# Tokenisation and batching


def tokenize_passages(
    tokenizer,
    titles: Sequence[str],
    texts: Sequence[str],
    max_length: int = DEFAULT_MAX_LENGTH,
    input_format: str = "pair",
) -> list[list[int]]:
    """Token ids of passages as the passage encoder reads them (see the module docstring).

    Args:
      tokenizer: the encoder's HF tokenizer.
      titles: C titles ("" for none).
      texts: C texts.
      max_length: tokens per passage after truncation, special tokens included.
      input_format: "pair" (DPR: title [SEP] text) or "single" (title + " " + text).

    Returns:
      C lists of ids, each at most `max_length` long, special tokens included.
    """
    if input_format not in INPUT_FORMATS:
        raise ValueError(f"input_format must be one of {INPUT_FORMATS}, got {input_format!r}")
    if len(titles) != len(texts):
        raise ValueError(f"{len(titles)} titles but {len(texts)} texts; expected one of each")
    call = functools.partial(
        tokenizer,
        truncation=True,
        max_length=max_length,
        padding=False,
        return_attention_mask=False,
        return_token_type_ids=False,
    )
    if input_format == "single":
        strings = [f"{ti} {te}" if ti else te for ti, te in zip(titles, texts, strict=True)]
        return call(strings)["input_ids"] if strings else []
    texts = [text.strip() for text in texts]
    out: list = [None] * len(texts)
    titled = [i for i, title in enumerate(titles) if title]
    untitled = [i for i, title in enumerate(titles) if not title]
    if titled:
        ids = call([titles[i] for i in titled], [texts[i] for i in titled])["input_ids"]
        for i, row in zip(titled, ids, strict=True):
            out[i] = row
    if untitled:
        for i, row in zip(untitled, call([texts[i] for i in untitled])["input_ids"], strict=True):
            out[i] = row
    return out


def default_buckets(max_length: int, step: int = 16) -> tuple[int, ...]:
    """Padded lengths S a batch may take: multiples of `step` below `max_length`, and it."""
    return tuple(range(step, max_length, step)) + (max_length,)


def plan_batches(
    lengths: np.ndarray, batch_size: int, buckets: Sequence[int]
) -> list[tuple[np.ndarray, int]]:
    """Groups rows of similar length: sort by length, cut into batches, pick each one's bucket.

    Args:
      lengths: [C] token counts.
      batch_size: B, rows per batch (the last batch may have fewer).
      buckets: ascending padded lengths; the last must be >= max(lengths).

    Returns:
      [(rows [b] int64 indices into `lengths`, S)], b <= B, S the smallest bucket >= every
      length in the batch.
    """
    lengths = np.asarray(lengths)
    order = np.argsort(lengths, kind="stable")  # stable: equal lengths keep their row order
    plan = []
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        longest = int(lengths[rows[-1]])
        if longest > buckets[-1]:
            raise ValueError(f"a passage of {longest} tokens exceeds the largest bucket {buckets}")
        plan.append((rows.astype(np.int64), int(buckets[np.searchsorted(buckets, longest)])))
    return plan


def pooled_vectors(cfg: bert.BertConfig, params, input_ids, attention_mask) -> jax.Array:
    """`BertEncoder`'s pooled output; with [CLS] pooling the last layer runs for [CLS] only.

    Only [CLS] of the last layer reaches the retrieval vector, so that layer's queries, attention
    output, MLP and LayerNorms run on one position instead of S (its keys and values still cover
    all S): about 1/L of the encoder's FLOPs saved. Token type ids are zero, as DPR feeds its
    passage encoder.

    Args:
      cfg, params: the encoder (`BertEncoder` parameters).
      input_ids: [B, S] int token ids.
      attention_mask: [B, S] 1 = token, 0 = padding.

    Returns:
      [B, D] float32, equal to `BertEncoder(cfg).apply(...)[0]`.
    """
    if cfg.pooling != "cls":  # a mean reads every position of the last layer
        return bert.BertEncoder(cfg).apply({"params": params}, input_ids, attention_mask)[0]
    dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    last = cfg.num_hidden_layers - 1
    trunk_cfg = cfg.replace(num_hidden_layers=last, with_pooler=False, projection_dim=0)
    head = {f"layer_{last}", "pooler", "projection"}
    trunk = {name: value for name, value in params.items() if name not in head}
    _, aux = bert.BertEncoder(trunk_cfg).apply({"params": trunk}, input_ids, attention_mask)
    x = aux["hidden"].astype(dtype)  # -> [B, S, H], exact: the trunk computed it in `dtype`
    layer = params[f"layer_{last}"]
    attention = layers.Attention(
        num_heads=cfg.num_attention_heads,
        hidden=cfg.hidden_size,
        init_std=cfg.initializer_range,
        dtype=dtype,
        param_dtype=param_dtype,
    )
    norm = nn.LayerNorm(epsilon=cfg.layer_norm_eps, dtype=dtype, param_dtype=param_dtype)
    mlp = layers.Mlp(
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.hidden_act,
        cfg.initializer_range,
        dtype=dtype,
        param_dtype=param_dtype,
    )
    mask = layers.padding_mask(None, attention_mask)  # -> [B, 1, 1, S]
    cls = x[:, :1]  # -> [B, 1, H]: the query; keys and values come from all of x
    cls = norm.apply(
        {"params": layer["self_attn_ln"]},
        cls + attention.apply({"params": layer["self_attn"]}, cls, x, mask),
    )
    cls = norm.apply({"params": layer["mlp_ln"]}, cls + mlp.apply({"params": layer["mlp"]}, cls))
    cls = cls[:, 0]  # -> [B, H]
    projection = None
    if cfg.projection_dim > 0:
        dense = nn.Dense(cfg.projection_dim, dtype=dtype, param_dtype=param_dtype)
        projection = lambda v: dense.apply({"params": params["projection"]}, v)  # noqa: E731
    return bert.pool(cfg, x, attention_mask, cls, projection).astype(jnp.float32)


@functools.cache
def make_encode_fn(cfg: bert.BertConfig, mesh: Mesh, dtype: str):
    """The jitted encoder step: (params, input_ids [B, S], attention_mask [B, S]) -> [B, D].

    Runs `pooled_vectors`. Params are replicated over `mesh`, the batch is sharded over its
    `data` axis, the output is cast to the storage `dtype` on the devices. Cached per (cfg, mesh,
    dtype), so every call with the same bucket shape reuses one compilation.
    """
    batch = NamedSharding(mesh, P("data", None))

    def encode_fn(params, input_ids, attention_mask):
        pooled = pooled_vectors(cfg, params, input_ids, attention_mask)
        return pooled.astype(DTYPES[dtype])  # -> [B, D]

    return jax.jit(
        encode_fn, in_shardings=(NamedSharding(mesh, P()), batch, batch), out_shardings=batch
    )


def data_mesh() -> Mesh:
    """A 1-D mesh over this process's devices, axis `data` (explicit axis types left at their
    default): on a multi-host job each process encodes its own passages with its own chips."""
    return Mesh(np.array(jax.local_devices()), ("data",))


@dataclasses.dataclass(frozen=True)
class _Setup:
    """Checked encoding arguments shared by `encode_token_ids` and `encode_corpus`."""

    mesh: Mesh
    max_length: int
    format: str  # input format, see tokenize_passages
    batch_size: int  # B rows per call on this process's mesh, a multiple of its devices
    buckets: tuple[int, ...]
    dtype: str
    pad_id: int


def _setup(cfg, tokenizer, max_length, input_format, batch_size, buckets, dtype, mesh) -> _Setup:
    if input_format not in INPUT_FORMATS:
        raise ValueError(f"input_format must be one of {INPUT_FORMATS}, got {input_format!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if max_length > cfg.max_position_embeddings:
        raise ValueError(
            f"max_length {max_length} exceeds the encoder's max_position_embeddings "
            f"{cfg.max_position_embeddings}; pass max_length <= {cfg.max_position_embeddings}"
        )
    if tokenizer is not None:
        specials = tokenizer.num_special_tokens_to_add(pair=input_format == "pair")
        if max_length <= specials:
            raise ValueError(
                f"max_length {max_length} leaves no room for text next to {specials} special tokens"
            )
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    mesh = data_mesh() if mesh is None else mesh
    if "data" not in mesh.shape:
        raise ValueError(f"mesh has axes {tuple(mesh.shape)}; the batch is sharded over 'data'")
    foreign = [d for d in mesh.devices.flat if d.process_index != jax.process_index()]
    if foreign:
        raise ValueError(
            f"the mesh holds {len(foreign)} devices of other processes (e.g. {foreign[0]}); "
            "encoding runs on this process's devices: pass a mesh over jax.local_devices()"
        )
    devices = mesh.shape["data"]
    buckets = default_buckets(max_length) if buckets is None else tuple(int(b) for b in buckets)
    if list(buckets) != sorted(set(buckets)) or buckets[0] < 1 or buckets[-1] != max_length:
        raise ValueError(
            f"buckets {buckets} must be strictly increasing positive lengths ending at "
            f"max_length {max_length}"
        )
    pad_id = getattr(tokenizer, "pad_token_id", None)
    return _Setup(
        mesh=mesh,
        max_length=max_length,
        format=input_format,
        batch_size=-(-batch_size // devices) * devices,  # per-device batch padded up
        buckets=buckets,
        dtype=dtype,
        pad_id=cfg.pad_token_id if pad_id is None else int(pad_id),
    )


def _check_ids(token_ids, first_row: int, cfg: bert.BertConfig) -> np.ndarray:
    lengths = np.fromiter((len(t) for t in token_ids), np.int64, len(token_ids))
    for i, ids in enumerate(token_ids):
        if ids and max(ids) >= cfg.vocab_size:
            raise ValueError(
                f"passage {first_row + i}: token id {max(ids)} is outside the encoder's "
                f"vocabulary of {cfg.vocab_size}; is the tokenizer the encoder's?"
            )
        if not ids:
            raise ValueError(f"passage {first_row + i}: tokenised to no tokens")
    return lengths


def _dispatch(cfg, params, token_ids, setup: _Setup, first_row: int = 0):
    """Starts encoding `token_ids` (asynchronously); returns [(rows, [B, D] device array)]."""
    lengths = _check_ids(token_ids, first_row, cfg)
    encode_fn = make_encode_fn(cfg, setup.mesh, setup.dtype)
    pending = []
    for rows, length in plan_batches(lengths, setup.batch_size, setup.buckets):
        input_ids = np.full((setup.batch_size, length), setup.pad_id, np.int32)
        attention_mask = np.zeros((setup.batch_size, length), np.int32)
        for slot, row in enumerate(rows):
            input_ids[slot, : lengths[row]] = token_ids[row]
            attention_mask[slot, : lengths[row]] = 1
        # Padding rows (all-masked) get a uniform attention and are dropped in _collect. Placed
        # explicitly: on a multi-process run jit refuses numpy inputs with a non-trivial
        # sharding, even over this process's own devices.
        inputs = jax.device_put((input_ids, attention_mask), NamedSharding(setup.mesh, P("data")))
        pending.append((rows, encode_fn(params, *inputs)))
    return pending


def _collect(pending, out: np.ndarray, first_row: int = 0, bar=None) -> None:
    """Waits for `_dispatch`'s batches and writes their real rows into `out` [n, D]."""
    for rows, batch_vectors in pending:
        batch_vectors = np.asarray(batch_vectors)[: len(rows)]  # -> [b, D], padding rows dropped
        finite = np.isfinite(batch_vectors.astype(np.float32)).all(axis=1)
        if not finite.all():
            row = first_row + int(rows[np.argmin(finite)])
            raise ValueError(
                f"passage {row}: its vector is not finite in {out.dtype} (overflow "
                "in float16 storage? use float32)"
            )
        out[rows] = batch_vectors
        if bar is not None:
            bar.update(len(rows))


def _replicate(params, mesh: Mesh):
    return jax.device_put(params, NamedSharding(mesh, P()))


def _encode_all(cfg, params, token_ids, setup: _Setup) -> np.ndarray:
    """[C, D] vectors of `token_ids`, in input order, held in memory."""
    out = np.empty((len(token_ids), cfg.embedding_dim), DTYPES[setup.dtype])
    _collect(_dispatch(cfg, _replicate(params, setup.mesh), token_ids, setup), out)
    return out


def encode_token_ids(
    cfg: bert.BertConfig,
    params,
    token_ids: Sequence[Sequence[int]],
    *,
    batch_size: int = 128,
    dtype: str = "float32",
    buckets: Sequence[int] | None = None,
    mesh: Mesh | None = None,
) -> np.ndarray:
    """Encodes tokenised passages with length bucketing; rows come back in input order.

    Args:
      cfg: passage encoder config (`cfg.dtype` is the compute dtype).
      params: its parameters.
      token_ids: C id lists (special tokens included), each at most max(buckets) long.
      batch_size: B rows per encoder call, rounded up to a multiple of the mesh's `data` size.
      dtype: storage dtype of the result: float32, float16 or bfloat16.
      buckets: ascending padded lengths; default `default_buckets(cfg.max_position_embeddings)`.
      mesh: device mesh with a `data` axis; default this process's devices (`data_mesh`).

    Returns:
      [C, D] numpy array of `dtype`.
    """
    if buckets is None:
        buckets = default_buckets(cfg.max_position_embeddings)
    setup = _setup(cfg, None, max(buckets), "pair", batch_size, buckets, dtype, mesh)
    return _encode_all(cfg, params, token_ids, setup)


def encode_passages(
    cfg: bert.BertConfig,
    params,
    tokenizer,
    titles: Sequence[str],
    texts: Sequence[str],
    *,
    max_length: int = DEFAULT_MAX_LENGTH,
    input_format: str = "pair",
    batch_size: int = 128,
    dtype: str = "float32",
    buckets: Sequence[int] | None = None,
    mesh: Mesh | None = None,
) -> np.ndarray:
    """Encodes passages held in memory; see `encode_corpus` for corpora on disk.

    Args:
      cfg, params: the passage encoder.
      tokenizer: its HF tokenizer.
      titles, texts: C titles ("" for none) and texts.
      max_length, input_format: see `tokenize_passages`.
      batch_size, dtype, buckets, mesh: see `encode_token_ids` (default buckets:
        `default_buckets(max_length)`).

    Returns:
      [C, D] vectors of `dtype`, in input order.
    """
    setup = _setup(cfg, tokenizer, max_length, input_format, batch_size, buckets, dtype, mesh)
    token_ids = tokenize_passages(tokenizer, titles, texts, max_length, input_format)
    return _encode_all(cfg, params, token_ids, setup)


# ---------------------------------------------------------------------------------------------
# Sharded, resumable encoding of a corpus


def _encode_rows(store, start, stop, window, cfg, params, tokenizer, setup, bar) -> np.ndarray:
    """Vectors [stop - start, D] of passages start..stop-1 of `store`, a window at a time."""
    out = np.empty((stop - start, cfg.embedding_dim), DTYPES[setup.dtype])
    pending = []
    for lo in range(start, stop, window):
        hi = min(stop, lo + window)
        titles = [store.title(i) for i in range(lo, hi)]
        texts = [store.text(i) for i in range(lo, hi)]
        token_ids = tokenize_passages(tokenizer, titles, texts, setup.max_length, setup.format)
        # Dispatch is asynchronous: the next window is tokenised while this one runs.
        pending.append((lo, hi, _dispatch(cfg, params, token_ids, setup, first_row=lo)))
        while len(pending) > 1 or (pending and hi == stop):
            p_lo, p_hi, batches = pending.pop(0)
            _collect(batches, out[p_lo - start : p_hi - start], first_row=p_lo, bar=bar)
    return out


def _fold_records(out_dir: pathlib.Path, manifest: dict, overwrite: bool) -> set[int]:
    """`vectors.prepare_dir`, then the manifest written with every finished shard (record files
    included) and the record files deleted; returns the finished shards. Process 0's work."""
    done = vectors.prepare_dir(out_dir, manifest, overwrite)
    vectors.write_manifest(out_dir, manifest)
    vectors.remove_records(out_dir)  # after the manifest that lists them
    return done


def encode_corpus(
    store,
    cfg: bert.BertConfig,
    params,
    tokenizer,
    out_dir,
    *,
    max_length: int = DEFAULT_MAX_LENGTH,
    input_format: str = "pair",
    batch_size: int = 128,
    shard_size: int = 100_000,
    dtype: str = "float32",
    buckets: Sequence[int] | None = None,
    sort_window: int | None = None,
    mesh: Mesh | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Encodes every passage of `store` into sharded `.npy` files; resumes an interrupted run.

    On a multi-host job (`jax.process_count()` > 1) every process calls it with the same
    arguments and `out_dir` on a filesystem they all see (NFS, a GCS mount): process 0 prepares
    the directory and writes the manifest; each process encodes its share of the unfinished
    shards (`distributed.process_shards`) with its own devices (`data_mesh`), writing each shard
    and its record (`vectors.write_record`); after a barrier process 0 folds the records into the
    manifest. A killed process leaves its finished shards recorded: a re-run, with any number of
    processes, encodes only what is missing and ends with the files a one-process run writes
    (the shards byte for byte when each process's mesh has as many devices as the one process's:
    the per-device batch decides the float rounding).

    Args:
      store: C passages: `len(store)`, `store.title(i)`, `store.text(i)` and `store.checksum`
        (a `rag_jax.retrieval.store.PassageStore`).
      cfg, params: the passage encoder (`cfg.dtype`, float32 or bfloat16, is the compute dtype).
      tokenizer: the encoder's HF tokenizer.
      out_dir: the vectors directory: new, empty, or holding an unfinished run of the same
        arguments.
      max_length, input_format: see `tokenize_passages`.
      batch_size: B rows per encoder call of a process, rounded up to a multiple of the mesh's
        `data` size.
      shard_size: rows per `.npy` file (and per unit of resumable work).
      dtype: storage dtype: float32, float16 or bfloat16.
      buckets: padded lengths, ascending, ending at max_length; default `default_buckets`.
      sort_window: rows tokenised and length-sorted together (at most the shard); default 32 B.
      mesh: this process's device mesh with a `data` axis; default `data_mesh()`.
      overwrite: replace vectors of a different run in `out_dir` instead of refusing.
      progress: show a tqdm bar (passages/s) of this process's rows.

    Returns:
      The manifest (see the module docstring).

    Raises:
      ValueError: an empty corpus, max_length above the encoder's positions, a run of other
        arguments in `out_dir` (naming each differing field), a passage that cannot be encoded,
        processes that disagree on the run or do not share `out_dir`.
    """
    from tqdm.auto import tqdm

    count = len(store)
    if count == 0:
        raise ValueError("the corpus is empty: no passages to encode")
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    setup = _setup(cfg, tokenizer, max_length, input_format, batch_size, buckets, dtype, mesh)
    window = min(shard_size, 32 * setup.batch_size if sort_window is None else sort_window)
    if window < 1:
        raise ValueError(f"sort_window must be >= 1, got {sort_window}")
    out_dir = pathlib.Path(out_dir)
    manifest = {
        "format": vectors.FORMAT,
        "version": vectors.VERSION,
        "count": count,
        "dim": cfg.embedding_dim,
        "dtype": dtype,
        "compute_dtype": cfg.dtype,
        "encoder_fingerprint": encoder_fingerprint(cfg, params),
        "corpus_checksum": store.checksum,
        "tokenizer": getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__,
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "max_length": max_length,
        "input_format": input_format,
        "token_type_ids": "zeros",
        "shard_size": shard_size,
        # Batch composition decides the float rounding, so a resumed run must batch alike.
        "batch_size": setup.batch_size,
        "buckets": list(setup.buckets),
        "sort_window": window,
        "shards": [],
    }
    process, processes = jax.process_index(), jax.process_count()
    if processes > 1:
        distributed.check_same_everywhere(
            manifest,
            "encode another run than process 0 (other arguments, encoder parameters or corpus); "
            "every process must call encode_corpus alike",
        )
    header = {k: v for k, v in manifest.items() if k != "shards"}
    distributed.on_process_zero(
        lambda: _fold_records(out_dir, manifest, overwrite), f"prepare the vectors in {out_dir}"
    )
    if process > 0:  # the manifest process 0 wrote: on a shared filesystem, the same file
        try:
            written = vectors.read_manifest(out_dir)
        except (OSError, ValueError):
            written = None
        shared = written is not None and all(written.get(k) == v for k, v in header.items())
        if not distributed.on_every_process(shared):
            raise ValueError(
                f"process {process} does not see the manifest process 0 wrote in {out_dir}: "
                "the vectors directory must be on a filesystem every process shares"
            )
        manifest = {**header, "shards": written["shards"]}
    elif processes > 1:
        distributed.on_every_process(True)
    done = {s["index"] for s in manifest["shards"]}
    num_shards = -(-count // shard_size)
    todo = distributed.process_shards(
        [s for s in range(num_shards) if s not in done], process, processes
    )
    params = _replicate(params, setup.mesh)
    rows = sum(min(count, (s + 1) * shard_size) - s * shard_size for s in todo)
    bar = tqdm(total=rows, unit="passage", disable=not progress, smoothing=0.1)
    error = None
    try:
        for shard in todo:
            start, stop = shard * shard_size, min(count, (shard + 1) * shard_size)
            out = _encode_rows(store, start, stop, window, cfg, params, tokenizer, setup, bar)
            name = vectors.shard_name(shard)
            sha = vectors.write_shard(out_dir / name, out, dtype)
            record = {"index": shard, "file": name, "rows": stop - start, "sha256": sha}
            if processes > 1:  # process 0 alone writes the manifest, at the end
                vectors.write_record(out_dir, record)
                continue
            manifest["shards"].append(record)
            manifest["shards"].sort(key=lambda s: s["index"])
            vectors.write_manifest(out_dir, manifest)
    except Exception as e:  # noqa: BLE001 - raised once the other processes know of it
        if processes == 1:
            raise
        error = e
    finally:
        bar.close()
    if processes == 1:
        return manifest
    if not distributed.on_every_process(error is None):
        if error is not None:
            raise error
        raise RuntimeError("another process failed to encode its shards; its log says why")

    def finish():
        finished = {**header, "shards": []}
        done = _fold_records(out_dir, finished, overwrite=False)
        missing = sorted(set(range(num_shards)) - done)
        if missing:
            raise ValueError(f"{out_dir}: shards {missing[:10]} are missing after every process")
        return finished

    distributed.on_process_zero(finish, f"finish the manifest in {out_dir}")
    return vectors.read_manifest(out_dir)
