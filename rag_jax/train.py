"""Joint training of the question encoder and the generator, with retrieval in the loop.

Each step: encode the batch's questions with the *current* question encoder (jitted), search the
index on the host, gather the retrieved passages' stored vectors and generator contexts, then run
one jitted data-parallel step that recomputes the doc scores `q · d` from the question encoder, so
the RAG marginal likelihood's gradient reaches it. The host work of the next batch (tokenisation,
labels) overlaps the device step through JAX's asynchronous dispatch; retrieval waits for the
step's parameters so that a resumed run is bitwise identical to an uninterrupted one.

`params = {"question_encoder", "generator", "passage_encoder"}`. The passage encoder is frozen by
default (a regex freeze mask over parameter paths, `config.train.freeze`), as in the paper; the
stored vectors then stay valid for the whole run.

Legend: B batch, N docs, S context length, T target length, Q question length, D width.
"""

import difflib
import functools
import json
import pathlib
import re
import time
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import tqdm

from rag_jax import (
    checkpoints,
    data,
    encode,
    experiment,
    hf,
    metrics,
    rag,
    rag_math,
    refresh,
    retriever,
    sharding,
    vector_files,
)
from rag_jax.index import DeviceIndex


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # [] int32: optimizer steps taken
    params: Any  # {"question_encoder", "generator", "passage_encoder"}
    opt_state: Any
    # [B, N] int32, replicated: the passages of batch `step`, found by the previous step's
    # in-step search (see `step_index`); None when the search runs outside the step.
    next_doc_ids: Any = None


# ---------------------------------------------------------------------------------------------
# Optimizer


def schedule(tc: ml_collections.ConfigDict) -> optax.Schedule:
    """Linear warmup to `learning_rate`, then linear or polynomial decay to `end_learning_rate`."""
    warmup = optax.linear_schedule(0.0, tc.learning_rate, max(tc.warmup_steps, 1))
    decay_steps = max(tc.steps - tc.warmup_steps, 1)
    end = tc.learning_rate * tc.end_lr_factor
    if tc.decay == "linear":
        decay = optax.linear_schedule(tc.learning_rate, end, decay_steps)
    elif tc.decay == "polynomial":
        decay = optax.polynomial_schedule(tc.learning_rate, end, tc.decay_power, decay_steps)
    elif tc.decay == "constant":
        decay = optax.constant_schedule(tc.learning_rate)
    else:
        raise ValueError(f"config.train.decay must be linear, polynomial or constant: {tc.decay!r}")
    return optax.join_schedules([warmup, decay], [tc.warmup_steps])


def path_labels(params, pattern: str, matched: str, other: str):
    """A pytree of labels: `matched` where the '/'-joined parameter path matches `pattern`."""
    regex = re.compile(pattern) if pattern else None

    def label(path, _):
        name = "/".join(str(getattr(p, "key", p)) for p in path)
        return matched if regex is not None and regex.search(name) else other

    return jax.tree_util.tree_map_with_path(label, params)


def make_optimizer(tc: ml_collections.ConfigDict, params) -> optax.GradientTransformation:
    """AdamW (or SGD with momentum) with warmup + decay and clipping; frozen parameters get
    exactly zero updates.

    Freezing is a regex over parameter paths mapped to `optax.set_to_zero` (never a zero learning
    rate, which AdamW's weight decay would still move).
    """
    no_decay = path_labels(params, tc.no_decay, "no", "yes")
    if tc.optimizer == "adamw":
        base = optax.adamw(
            schedule(tc),
            b1=tc.adam_b1,
            b2=tc.adam_b2,
            eps=tc.adam_eps,
            weight_decay=tc.weight_decay,
            mask=jax.tree.map(lambda x: x == "yes", no_decay),
        )
    elif tc.optimizer == "sgd":
        base = optax.sgd(schedule(tc), momentum=tc.adam_b1)
    else:
        raise ValueError(f"config.train.optimizer must be adamw or sgd, got {tc.optimizer!r}")
    tx = optax.chain(optax.clip_by_global_norm(tc.grad_clip), base) if tc.grad_clip else base
    # The retriever towers (the question encoder, and the passage encoder when it trains) may
    # learn more slowly than the generator, and may wait: until the generator reads its contexts,
    # p(z|x,y) ~ p(z|x) and their gradient is mostly noise, which Adam turns into full-size steps
    # that undo the warm start.
    delay, factor = tc.get("retriever_delay_steps", 0), tc.retriever_lr_factor
    question_tx = optax.chain(
        tx,
        optax.scale_by_schedule(lambda step: jnp.where(step < delay, 0.0, factor)),
    )
    labels = path_labels(params, tc.freeze, "frozen", "train")
    labels = jax.tree.map(
        lambda label, q: "retriever" if label == "train" and q == "q" else label,
        labels,
        path_labels(params, r"^(question_encoder|passage_encoder)/", "q", "-"),
    )
    tx = optax.multi_transform(
        {"train": tx, "retriever": question_tx, "frozen": optax.set_to_zero()}, labels
    )
    if tc.grad_accum > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=tc.grad_accum)
    return tx


# ---------------------------------------------------------------------------------------------
# The step


def _entropy(scores: jax.Array) -> jax.Array:
    """[B, N] doc scores -> [B] entropy of the doc posterior p(z|x), in nats."""
    logp = jax.nn.log_softmax(scores, axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


_PER_DOC_TOKENS = (
    "context_input_ids",
    "context_attention_mask",
    "passage_input_ids",
    "passage_attention_mask",
)


def make_train_step(
    rag_cfg: rag.RagConfig,
    variant: str,
    tx,
    dropout_rng,
    deterministic: bool,
    passage_cfg=None,
    search_n_docs: int = 0,
):
    """`train_step(state, batch) -> (state, metrics)`, jitted with the state donated.

    `passage_cfg` is needed when batches carry passage tokens (a trainable passage encoder).

    With `search_n_docs` = N > 0 the step also retrieves for the next batch:
    `train_step(state, batch, index, next_questions)`, where `index` is a `DeviceIndex` on the
    step's mesh and `next_questions` the next batch's question-encoder inputs
    (`question_tokens`, batch-sharded). After the update it embeds them with the *updated*
    question encoder (the one the next step trains) and searches the index, so the next batch's
    passages are the same as a search between the steps would find, without a host round trip;
    they are returned in `state.next_doc_ids`.
    """

    def train_step(state: TrainState, batch):
        rng = None if deterministic else jax.random.fold_in(dropout_rng, state.step)

        # Token leaves travel as [B, N, L] so every leaf shards over B; the loss takes [B * N, L].
        flat = dict(batch)
        for key in _PER_DOC_TOKENS:
            if key in batch:
                flat[key] = batch[key].reshape(-1, batch[key].shape[-1])  # -> [B * N, L]

        def loss(params):
            return rag.loss_fn(rag_cfg, params, flat, variant, rng, passage_cfg)

        (_, aux), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        weights = aux["weights"]
        step_metrics = {
            "loss": (jnp.sum(aux["nll"] * weights), jnp.sum(weights)),
            "doc_entropy": (jnp.sum(_entropy(aux["doc_scores"]) * weights), jnp.sum(weights)),
            "grad_norm": (optax.tree.norm(grads), jnp.ones(())),
            "question_grad_norm": (optax.tree.norm(grads["question_encoder"]), jnp.ones(())),
        }
        return TrainState(state.step + 1, params, opt_state, state.next_doc_ids), step_metrics

    if not search_n_docs:
        return jax.jit(train_step, donate_argnums=0)

    def train_step_and_search(state: TrainState, batch, index, next_questions):
        state, step_metrics = train_step(state, batch)
        ids = search_ids(rag_cfg, state.params, index, next_questions, search_n_docs)
        return state.replace(next_doc_ids=ids), step_metrics

    return jax.jit(train_step_and_search, donate_argnums=0)


def search_ids(rag_cfg: rag.RagConfig, params, index, questions, n_docs: int) -> jax.Array:
    """[B, N] int32 passage rows for `questions` (`question_tokens`) from a `DeviceIndex`."""
    vectors = rag.question_embeddings(
        rag_cfg, params, questions["question_input_ids"], questions["question_attention_mask"]
    )  # -> [B, D]
    return index.search(vectors, n_docs)[1]


def step_index(config: ml_collections.ConfigDict, exp: experiment.Experiment, mesh):
    """The `DeviceIndex` the train step searches for the next batch, or None.

    The search runs inside the step when `config.retrieval.index` is "device",
    `config.retrieval.search_in_step` is on, the stored vectors never change (no refresh) and the
    index lives on the step's devices (one process training on all of its devices); otherwise
    each batch is retrieved between the steps.
    """
    r = config.retrieval
    if r.index != "device" or not r.get("search_in_step", True) or r.get("refresh_every", 0):
        return None
    index = getattr(exp.retriever, "index", None)  # ClosedBook has none
    if not isinstance(index, DeviceIndex) or index.axis != sharding.DATA_AXIS:
        return None
    return index if list(index.mesh.devices.flat) == list(mesh.devices.flat) else None


# ---------------------------------------------------------------------------------------------
# Batches


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


def answer_labels(tokenizer, answers, rag_cfg: rag.RagConfig, max_length: int) -> np.ndarray:
    """[B, T] labels laid out as generated sequences: decoder start, BOS, answer, EOS, pads.

    The RAG loss reads labels as decoder inputs (nothing is shifted right), so training targets
    take the exact form of what generation produces and rescoring scores.
    """
    gen = rag_cfg.generator
    out = np.full((len(answers), max_length), gen.pad_token_id, np.int32)
    for i, answer in enumerate(answers):
        ids = tokenizer(answer, add_special_tokens=False)["input_ids"][: max_length - 3]
        row = [gen.decoder_start_token_id, rag_cfg.bos_token_id, *ids, gen.eos_token_id]
        out[i, : len(row)] = row
    return out


class Batcher:
    """Host-side batch assembly: tokens, labels and retrieval, deterministic in (seed, step).

    On several hosts each process assembles only its block of every global batch (rows
    `sharding.process_block(mesh)`): its own questions, encoded in the global jitted call and
    searched in its own replica of the index; `sharding.shard_batch` then joins the blocks.
    """

    def __init__(self, exp: experiment.Experiment, mesh):
        self.exp, self.mesh = exp, mesh
        self.block, self.blocks = sharding.process_block(mesh)
        self.embed = jax.jit(functools.partial(rag.question_embeddings, exp.rag_cfg))

    def questions(self, examples):
        c = self.exp.config
        fields = question_tokens(
            self.exp.question_tokenizer, [e.question for e in examples], c.data.question_length
        )
        pieces = self.exp.store.tokenize_questions(
            self.exp.generator_tokenizer, [e.question for e in examples]
        )
        return fields, pieces

    def retrieve(self, params, fields, pieces):
        """Encodes with the current question encoder and retrieves; returns host arrays.

        `fields` and `pieces` hold this process's rows; so does the result.
        """
        ids, mask = sharding.shard_batch(
            self.mesh, (fields["question_input_ids"], fields["question_attention_mask"])
        )
        q = sharding.local_rows(self.embed(params, ids, mask))  # -> [local B, D]
        return self.exp.retriever(q, pieces)

    def passage_tokens(self, doc_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Passage-encoder inputs [B * N, P] of the retrieved passages, as the index reads them."""
        c, store = self.exp.config, self.exp.store
        rows = encode.tokenize_passages(
            self.exp.question_tokenizer,
            [store.title(int(j)) for j in doc_ids.reshape(-1)],
            [store.text(int(j)) for j in doc_ids.reshape(-1)],
            max_length=c.retrieval.passage_max_length,
            input_format=c.retrieval.passage_format,
        )
        length = c.retrieval.passage_max_length
        ids = np.full((len(rows), length), self.exp.question_tokenizer.pad_token_id, np.int32)
        mask = np.zeros((len(rows), length), np.int32)
        for i, row in enumerate(rows):
            ids[i, : len(row)], mask[i, : len(row)] = row, 1
        return ids, mask

    def _examples(self, step: int):
        """This process's rows of batch `step`: (their train-set indices, the examples)."""
        c = self.exp.config
        idx = data.batch_indices(
            len(self.exp.train),
            c.train.batch_size,
            c.seed,
            step,
            process_index=self.block,
            process_count=self.blocks,
        )  # -> [local B]: this process's rows of the global batch
        return idx, [self.exp.train[i] for i in idx]

    def question_fields(self, step: int) -> dict[str, np.ndarray]:
        """Question-encoder inputs of batch `step` (this process's rows), for an in-step search."""
        questions = [e.question for e in self._examples(step)[1]]
        return question_tokens(
            self.exp.question_tokenizer, questions, self.exp.config.data.question_length
        )

    def train_batch(self, params, step: int, doc_ids: np.ndarray | None = None):
        """Batch `step` (this process's rows) and its answer recall over the global batch.

        The passages are retrieved with the question encoder in `params`, or are `doc_ids`
        [local B, N] when the previous step already searched for them (`params` unused).
        """
        c = self.exp.config
        idx, examples = self._examples(step)
        targets = [
            data.pick_target(e.answers, c.data.target, c.seed, step, int(i))
            for e, i in zip(examples, idx)
        ]
        fields, pieces = self.questions(examples)
        if doc_ids is None:
            hits = self.retrieve(params, fields, pieces)
        else:
            hits = self.exp.retriever.gather(doc_ids, pieces)
        shape = hits.doc_ids.shape + (-1,)  # -> [B, N, S]
        batch = dict(
            fields,
            doc_vectors=hits.doc_vectors,
            context_input_ids=hits.context_input_ids.reshape(shape),
            context_attention_mask=hits.context_attention_mask.reshape(shape),
            labels=answer_labels(
                self.exp.generator_tokenizer, targets, self.exp.rag_cfg, c.data.answer_length
            ),
        )
        if c.retrieval.get("refresh_every", 0):  # a trainable passage encoder re-encodes them
            ids, mask = self.passage_tokens(hits.doc_ids)
            batch.update(
                passage_input_ids=ids.reshape(shape), passage_attention_mask=mask.reshape(shape)
            )
        recall = {}
        if not isinstance(self.exp.retriever, retriever.ClosedBook):
            recall = metrics.answer_recall(
                [e.answers for e in examples],
                [[self.exp.store.text(int(j)) for j in row] for row in hits.doc_ids],
                [self.exp.rag_cfg.n_docs],
            )
        return batch, sharding.sum_over_processes(recall)  # over the global batch


# ---------------------------------------------------------------------------------------------
# Evaluation


def evaluate(exp: experiment.Experiment, params, examples, *, mesh, variant: str, ks=(1, 5)):
    """EM/F1 of generated answers and retrieval recall@k over `examples` (none dropped).

    On several hosts every process calls this with the same `examples`: each retrieves and feeds
    its block of every batch, the generated tokens and retrieved ids of all blocks are gathered
    to every process, and each example is scored exactly once, so all processes return the same
    metrics and predictions (the trainer writes them from process 0).

    Returns:
      (metrics as floats, predictions: one dict per example with the answer and retrieved ids).
    """
    c = exp.config
    batch_size = c.eval.batch_size
    sharding.check_batch_divisible(batch_size, mesh.size, "eval batch")
    batcher = Batcher(exp, mesh)
    local = batch_size // batcher.blocks  # rows of each batch this process retrieves for
    mine = slice(batcher.block * local, (batcher.block + 1) * local)
    gen = _generate_fn(exp.rag_cfg, variant, c.eval.sequence_decoding)
    ks = [k for k in ks if k <= exp.rag_cfg.n_docs]
    totals, predictions = {}, []
    for idx, mask in data.eval_batches(len(examples), batch_size):
        batch_examples = [examples[i] for i in idx]
        fields, pieces = batcher.questions(batch_examples[mine])
        hits = batcher.retrieve(params, fields, pieces)
        q_ids, q_mask, vecs, ctx, ctx_mask, doc_ids = sharding.shard_batch(
            mesh,
            (
                fields["question_input_ids"],
                fields["question_attention_mask"],
                hits.doc_vectors,
                hits.context_input_ids.reshape(local, -1, hits.context_input_ids.shape[-1]),
                hits.context_attention_mask.reshape(local, -1, hits.context_input_ids.shape[-1]),
                hits.doc_ids.astype(np.int32),
            ),
        )
        # Every block's answers and retrieved rows, on every process: -> [B, L], [B, N].
        tokens, doc_ids = sharding.gather_to_host(
            (gen(params, q_ids, q_mask, vecs, ctx, ctx_mask), doc_ids)
        )
        answers = exp.generator_tokenizer.batch_decode(tokens, skip_special_tokens=True)
        answers = [a.strip() for a in answers]
        gold_answers = [e.answers for e in batch_examples]
        ids = []
        if isinstance(exp.retriever, retriever.ClosedBook):  # nothing retrieved: no recall
            totals = metrics.merge_metrics(totals, metrics.qa_metrics(answers, gold_answers, mask))
        else:
            texts = [[exp.store.text(int(j)) for j in row] for row in doc_ids]
            ids = [[exp.store.ids[int(j)] for j in row] for row in doc_ids]
            totals = metrics.merge_metrics(
                totals,
                metrics.qa_metrics(answers, gold_answers, mask),
                metrics.answer_recall(gold_answers, texts, ks, mask),
                metrics.gold_recall(ids, [e.gold_ids for e in batch_examples], ks, mask),
            )
        for row, keep in enumerate(mask):
            if keep:
                e = batch_examples[row]
                predictions.append(
                    {
                        "id": e.id,
                        "question": e.question,
                        "prediction": answers[row],
                        "answers": list(e.answers),
                        "retrieved": ids[row] if ids else [],
                    }
                )
    return metrics.reduce_metrics(totals), predictions


@functools.cache
def _generate_fn(rag_cfg: rag.RagConfig, variant: str, sequence_decoding: str):
    def fn(params, q_ids, q_mask, doc_vectors, ctx, ctx_mask):
        q = rag.question_embeddings(rag_cfg, params, q_ids, q_mask)
        scores = rag_math.doc_scores(q, doc_vectors)  # -> [B, N]
        flat = ctx.reshape(-1, ctx.shape[-1])  # -> [B * N, S]
        return rag.generate(
            rag_cfg,
            params,
            flat,
            ctx_mask.reshape(flat.shape),
            scores,
            variant=variant,
            sequence_decoding=sequence_decoding,
        )

    return jax.jit(fn)


def summary_metrics(m: dict) -> tuple[float, float]:
    """(recall@5, EM): gold-passage recall where gold ids exist, else answer recall."""
    recall = m.get("gold_recall@5", m.get("answer_recall@5", float("nan")))
    return recall, m.get("exact_match", float("nan"))


# ---------------------------------------------------------------------------------------------
# The loop


def _check_memory(compiled, state: TrainState, exp: experiment.Experiment, mesh) -> None:
    """Prints what the compiled train step needs per device (XLA's own accounting) and raises
    before the first step runs when that exceeds the device's memory."""
    stats = compiled.memory_analysis()
    need = (
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes  # the donated state is updated in place
        + stats.temp_size_in_bytes
    )
    params, opt = sharding.tree_bytes(state.params), sharding.tree_bytes(state.opt_state)
    index = getattr(exp.retriever, "index", None)  # None: closed book
    shard = -(-index.nbytes // mesh.size) if isinstance(index, DeviceIndex) else 0
    host_index = getattr(exp.retriever, "vectors", np.zeros(0)).nbytes if not shard else 0
    limit = sharding.device_memory_limit(mesh.devices.flat[0])
    human = sharding.human_bytes
    rows = [
        ("parameters (replicated)", params),
        ("optimizer state", opt),
        ("index shard", shard),
        ("batch and the rest of the arguments", stats.argument_size_in_bytes - params - opt),
        ("temporaries: activations, gradients", stats.temp_size_in_bytes),
        ("total per device", need),
        ("device memory", limit),
        ("host index (RAM of each host)", host_index),
    ]
    if jax.process_index() == 0:
        print(f"train step memory per device, from XLA ({mesh.size} devices):", flush=True)
        for name, value in rows:
            print(f"  {name:<40} {'unknown' if value is None else human(value):>12}", flush=True)
    if limit is not None and need > limit:
        raise ValueError(
            f"the train step needs {human(need)} per device but the device has {human(limit)} "
            f"({human(stats.temp_size_in_bytes)} of it temporaries for "
            f"{exp.config.train.batch_size // mesh.size} examples per device): lower "
            "config.train.batch_size (with grad_accum to keep the global batch), set "
            "config.model.remat=True or config.model.dtype='bfloat16', or keep the index on the "
            "host (config.retrieval.index exact or scann)"
        )


def _init_state(exp: experiment.Experiment, tx, mesh) -> TrainState:
    params = sharding.replicate(mesh, exp.params)
    next_ids = None
    if step_index(exp.config, exp, mesh) is not None:  # filled in before the first step
        shape = (exp.config.train.batch_size, exp.rag_cfg.n_docs)
        next_ids = sharding.replicate(mesh, np.zeros(shape, np.int32))
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), next_ids)


def _abstract_state(init_fn, mesh) -> TrainState:
    """The shapes of `init_fn()`, replicated over `mesh`, as the target of a restore.

    `jax.eval_shape` drops placements; without them a restore lands on one local device, and on
    several hosts each process would hold its own unreplicated copy.
    """
    where = sharding.replicated(mesh)
    to_struct = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where)
    return jax.tree.map(to_struct, jax.eval_shape(init_fn))


def restore(workdir, config: ml_collections.ConfigDict | None = None, exp=None):
    """The newest checkpoint in `workdir` (config read from beside it unless given).

    Returns:
      (experiment, TrainState, step).
    """
    workdir = pathlib.Path(workdir).absolute()
    config = config or checkpoints.load_config(workdir)
    exp = exp or experiment.build(config, workdir)
    mesh = device_mesh(config)
    init = functools.partial(_init_state, exp, make_optimizer(config.train, exp.params), mesh)
    ckpt_root = config.train.get("checkpoint_dir", "") or workdir  # e.g. gs://bucket/run
    with checkpoints.Checkpointer(ckpt_root, read_only=True) as ckpt:
        restored = ckpt.restore_latest(_abstract_state(init, mesh))
    if restored is None:
        raise FileNotFoundError(f"no checkpoint in {checkpoints.checkpoint_dir(ckpt_root)}")
    state, step = restored
    return exp, state, step


class _Logger:
    """stdout + JSONL + TensorBoard, written by process 0 only."""

    def __init__(self, workdir: pathlib.Path):
        self.active = jax.process_index() == 0
        if self.active:
            from tensorboardX import SummaryWriter

            self.jsonl = open(workdir / "metrics.jsonl", "a", encoding="utf-8")
            self.tb = SummaryWriter(str(workdir / "tensorboard"))

    def write(self, step: int, values: dict, prefix: str = "") -> None:
        if not self.active:
            return
        values = {f"{prefix}{k}": float(v) for k, v in values.items()}
        self.jsonl.write(json.dumps({"step": step, **values}) + "\n")
        self.jsonl.flush()
        for k, v in values.items():
            self.tb.add_scalar(k.replace("@", "_at_"), v, step)  # '@' is not a legal TB name
        self.tb.flush()

    def close(self):
        if self.active:
            self.jsonl.close()
            self.tb.close()


# Every setting the library and the experiment scripts read, by section. Anything else is a typo
# (or a setting of another version) that would be silently ignored, so `validate` refuses it. A
# new setting goes here too (tests/reliability_test.py checks that default.py validates).
# `model.question_encoder`, `model.generator` and `data.fields` are checked where they are used.
CONFIG_KEYS = {
    "": {"seed", "data", "model", "warm_start", "rag", "retrieval", "train", "eval"},
    "data": {
        "source", "num_entities", "distractors_per_fact", "eval_fraction", "question_length",
        "answer_length", "target", "train_path", "eval_path", "corpus_path", "fields",
        "max_train", "max_eval", "tfds_name", "train_split", "eval_split", "tfds_data_dir",
    },
    "model": {
        "init", "dtype", "remat", "deterministic", "question_encoder", "generator",
        "question_encoder_path", "passage_encoder_path", "generator_path", "rag_path",
        "shared_towers",
    },
    "warm_start": {"method", "steps", "batch_size", "learning_rate", "keep_prob", "cache_dir"},
    "rag": {
        "variant", "n_docs", "max_combined_length", "label_smoothing", "exclude_bos_score",
        "closed_book",
    },
    "retrieval": {
        "index", "passage_max_length", "passage_format", "encode_batch_size", "index_dir",
        "refresh_every", "refresh_lag", "search_in_step",
    },
    "train": {
        "steps", "batch_size", "num_devices", "optimizer", "learning_rate", "warmup_steps",
        "decay", "decay_power", "end_lr_factor", "retriever_lr_factor", "retriever_delay_steps",
        "weight_decay",
        "no_decay", "adam_b1", "adam_b2", "adam_eps", "grad_clip", "grad_accum", "freeze",
        "log_every", "save_every", "keep_checkpoints", "checkpoint_dir",
    },
    "eval": {
        "enabled", "batch_size", "max_examples", "num_beams", "max_length", "sequence_decoding",
        "every",
    },
}  # fmt: skip


def _check_keys(config: ml_collections.ConfigDict) -> None:
    """Refuses a key `CONFIG_KEYS` does not list, naming it and the nearest known key."""
    for section, known in CONFIG_KEYS.items():
        node = config if not section else config.get(section)
        if node is None:
            raise ValueError(f"config has no section config.{section}; add it (see default.py)")
        prefix = f"config.{section}." if section else "config."
        for key in node.keys():
            if key in known:
                continue
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"did you mean {prefix}{close[0]}?" if close else f"known: {sorted(known)}"
            raise ValueError(f"{prefix}{key} is not a setting rag_jax reads; {hint}")


def _check_paths(config: ml_collections.ConfigDict) -> None:
    """Every file or checkpoint the config names exists, before anything is built."""
    d, m = config.data, config.model
    files = []
    if d.source == "files":
        files = [("data.train_path", d.get("train_path"), True)]
        files.append(("data.eval_path", d.get("eval_path"), False))
        if not config.retrieval.get("index_dir"):
            files.append(("data.corpus_path", d.get("corpus_path"), True))
    for key, path, required in files:
        if required and not path:
            raise ValueError(f"config.{key} is not set; data.source='files' needs it")
        if path and not pathlib.Path(path).is_file():
            raise FileNotFoundError(f"config.{key}={path!r}: no such file; point it at the file")
    index_dir = config.retrieval.get("index_dir")
    if index_dir and not pathlib.Path(index_dir).is_dir():
        raise FileNotFoundError(
            f"config.retrieval.index_dir={index_dir!r}: no such directory; build one with "
            "experiments/build_index.py or unset it"
        )
    checkpoints_needed = {"pretrained": ["question_encoder_path"], "hf_rag": ["rag_path"]}
    for key in ("question_encoder_path", "passage_encoder_path", "generator_path", "rag_path"):
        path = m.get(key)
        if not path:
            if key in checkpoints_needed.get(m.init, []):
                raise ValueError(f"config.model.{key} is not set; model.init={m.init!r} needs it")
            continue
        if pathlib.Path(path).is_dir():
            continue
        try:
            hf.resolve(path)  # a hub id in the local cache (or reachable hub) is fine
        except Exception as e:
            raise FileNotFoundError(
                f"config.model.{key}={path!r} is not a checkpoint directory ({e}); set it to a "
                "directory holding config.json and the weights, or to a hub id"
            ) from None


def validate(config: ml_collections.ConfigDict, num_devices: int) -> None:
    """Start-up checks of invariants, each error naming the value and what would be right."""
    _check_keys(config)
    tc = config.train
    batches = {"train": ("global batch", tc.batch_size)}
    if config.eval.enabled:
        batches["eval"] = ("eval batch", config.eval.batch_size)
    for section, (what, size) in batches.items():
        try:
            sharding.check_batch_divisible(size, num_devices, what)
        except ValueError as e:
            raise ValueError(f"config.{section}.batch_size: {e}") from None
    if config.rag.variant not in ("sequence", "token"):
        raise ValueError(
            f"config.rag.variant must be sequence or token, got {config.rag.variant!r}"
        )
    if config.data.source not in ("synthetic", "files", "tfds"):
        raise ValueError(
            f"config.data.source must be synthetic, files or tfds, got {config.data.source!r}"
        )
    for key in ("steps", "batch_size", "log_every", "save_every", "grad_accum"):
        if tc[key] < 1:
            raise ValueError(f"config.train.{key} must be >= 1, got {tc[key]}")
    if tc.warmup_steps < 0:
        raise ValueError(f"config.train.warmup_steps must be >= 0, got {tc.warmup_steps}")
    refresh_every = config.retrieval.get("refresh_every", 0)
    passage_frozen = bool(tc.freeze) and re.search(tc.freeze, "passage_encoder/") is not None
    if refresh_every and passage_frozen:
        raise ValueError(
            f"config.retrieval.refresh_every={refresh_every} is for a trainable passage encoder, "
            f"but config.train.freeze={tc.freeze!r} freezes passage_encoder/; remove it there"
        )
    if not refresh_every and not passage_frozen:
        raise ValueError(
            f"config.train.freeze={tc.freeze!r} leaves the passage encoder trainable, but "
            "config.retrieval.refresh_every=0 never re-encodes the corpus, so the index would "
            "go stale; freeze passage_encoder/ or set refresh_every"
        )
    _check_paths(config)


def device_mesh(config: ml_collections.ConfigDict):
    """The `data` mesh over the first `config.train.num_devices` devices (0 = all)."""
    devices = jax.devices()
    count = config.train.get("num_devices", 0) or len(devices)
    if not 1 <= count <= len(devices):
        raise ValueError(
            f"config.train.num_devices={count} but {len(devices)} devices are available"
        )
    return sharding.data_mesh(devices[:count])


def train_and_evaluate(config: ml_collections.ConfigDict, workdir) -> dict:
    """Trains per `config` in `workdir` (resuming from its checkpoints) and evaluates.

    Returns:
      The summary: held-out recall@5 and EM before and after training, plus final metrics.
    """
    workdir = pathlib.Path(workdir).absolute()
    sharding.maybe_initialize_distributed()
    mesh = device_mesh(config)
    validate(config, mesh.size)
    exp = experiment.build(config, workdir)
    tc, variant = config.train, config.rag.variant
    tx = make_optimizer(tc, exp.params)
    rng = jax.random.PRNGKey(config.seed)
    dropout_rng = jax.random.fold_in(rng, 1)

    init_state = functools.partial(_init_state, exp, tx, mesh)
    checkpoints.install_preemption_handler()
    # Several hosts need checkpoints on storage they share: a gs:// bucket or a shared workdir.
    ckpt = checkpoints.Checkpointer(
        tc.get("checkpoint_dir", "") or workdir,
        max_to_keep=tc.keep_checkpoints,
        save_interval_steps=tc.save_every,
    )
    state, restored = ckpt.restore_or_init(init_state, _abstract_state(init_state, mesh))
    state = sharding.replicate(mesh, state)
    start = int(restored or 0)
    if restored is not None:
        print(f"resumed from checkpoint step {restored} in {ckpt.directory}", flush=True)
    refresher = None
    if config.retrieval.get("refresh_every", 0):  # a trainable passage encoder
        every = config.retrieval.refresh_every
        lag = config.retrieval.get("refresh_lag", 0) or max(1, every // 2)
        refresher = refresh.IndexRefresher(exp, workdir, every, lag)
        refresher.resume(start)
    logger = _Logger(workdir)
    eval_examples = exp.eval[: config.eval.max_examples or None]

    before_path = workdir / "eval_before.json"
    if not config.eval.enabled:
        before = {}
    elif sharding.from_process0(before_path.is_file()):  # evaluate on all hosts or on none
        before = json.loads(before_path.read_text()) if before_path.is_file() else {}
    else:
        before, _ = evaluate(exp, state.params, eval_examples, mesh=mesh, variant=variant)
        if jax.process_index() == 0:
            vector_files.write_atomic(before_path, json.dumps(before).encode())
        logger.write(start, before, "eval/")
    print(f"before training: {json.dumps(before)}", flush=True)

    index = step_index(config, exp, mesh)
    step_fn = make_train_step(
        exp.rag_cfg,
        variant,
        tx,
        dropout_rng,
        config.model.deterministic,
        exp.passage_cfg if refresher else None,
        search_n_docs=exp.rag_cfg.n_docs if index is not None else 0,
    )
    batcher = Batcher(exp, mesh)
    if index is not None and restored is None:  # the first batch's passages; later steps search
        search = jax.jit(functools.partial(search_ids, exp.rag_cfg), static_argnums=3)
        first = sharding.shard_batch(mesh, batcher.question_fields(start))
        state = state.replace(next_doc_ids=search(state.params, index, first, exp.rag_cfg.n_docs))
    totals: dict = {}
    last_log = time.perf_counter()
    bar = tqdm.tqdm(total=tc.steps, initial=start, desc="train", disable=jax.process_index() != 0)
    step, compiled = start, None
    while step < tc.steps:
        if checkpoints.should_stop(step):
            ckpt.save(step, state, config, force=True)
            print(f"preempted: saved step {step}", flush=True)
            break
        if refresher:
            refresher.before_step(step, state.params)
        if index is None:
            host_batch, recall = batcher.train_batch(state.params, step)
            inputs = (sharding.shard_batch(mesh, host_batch),)
        else:
            doc_ids = np.asarray(jax.device_get(state.next_doc_ids))  # one process: all rows
            host_batch, recall = batcher.train_batch(None, step, doc_ids)
            next_questions = sharding.shard_batch(mesh, batcher.question_fields(step + 1))
            inputs = (sharding.shard_batch(mesh, host_batch), index, next_questions)
        with jax.transfer_guard("disallow"):
            if compiled is None:  # compiled ahead of the first call, to check its memory first
                compiled = step_fn.lower(state, *inputs).compile()
                _check_memory(compiled, state, exp, mesh)
            state, step_metrics = compiled(state, *inputs)
        step += 1
        step_values = jax.device_get(step_metrics)
        # Checked every step, before this state can be saved: a checkpoint is never non-finite.
        bad = [k for k, (total, _) in step_values.items() if not np.isfinite(total)]
        bad.sort(key=lambda k: k != "loss")  # the loss first: it is what the user watches
        if bad:
            ckpt.close()  # The last good checkpoint's write completes.
            raise FloatingPointError(
                f"non-finite {bad[0]} ({float(step_values[bad[0]][0])}) at train step {step} "
                f"(non-finite: {bad}); stopped without saving it. The last good checkpoint, step "
                f"{ckpt.latest_step()}, is kept in {ckpt.directory}"
            )
        totals = metrics.merge_metrics(totals, recall, step_values)
        bar.update(1)
        if step % tc.log_every == 0 or step == tc.steps:
            values = metrics.reduce_metrics(totals)
            elapsed = time.perf_counter() - last_log
            count = step % tc.log_every or tc.log_every
            values.update(
                steps_per_s=count / elapsed, examples_per_s=count * tc.batch_size / elapsed
            )
            logger.write(step, values, "train/")
            bar.set_postfix(
                loss=f"{values['loss']:.3f}",
                recall=f"{values.get(f'answer_recall@{exp.rag_cfg.n_docs}', 0):.2f}",
            )
            totals, last_log = {}, time.perf_counter()
        ckpt.save(step, state, config, force=step == tc.steps)
        every = config.eval.get("every", 0)
        if config.eval.enabled and every and step % every == 0 and step < tc.steps:
            during, _ = evaluate(exp, state.params, eval_examples, mesh=mesh, variant=variant)
            logger.write(step, during, "eval/")  # learning curves; the final eval follows
    bar.close()
    ckpt.close()
    if refresher:
        refresher.finish(state.params)  # evaluate against the final passage encoder's index

    after, predictions = {}, []
    if config.eval.enabled:
        after, predictions = evaluate(exp, state.params, eval_examples, mesh=mesh, variant=variant)
        logger.write(step, after, "eval/")
    logger.close()
    if jax.process_index() == 0 and config.eval.enabled:
        with open(workdir / "predictions.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(p) + "\n" for p in predictions)
    recall_before, em_before = summary_metrics(before)
    recall_after, em_after = summary_metrics(after)
    return {
        "recall_at_5_before": recall_before,
        "recall_at_5_after": recall_after,
        "em_before": em_before,
        "em_after": em_after,
        "steps": step,
        "eval": after,
    }
