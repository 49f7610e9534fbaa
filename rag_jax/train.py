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

from rag_jax import checkpoints, data, experiment, metrics, rag, rag_math, sharding


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # [] int32: optimizer steps taken
    params: Any  # {"question_encoder", "generator", "passage_encoder"}
    opt_state: Any


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
    # The question encoder may learn more slowly than the generator: early in training the
    # generator does not yet read its contexts, so the retriever's gradient is mostly noise, and
    # Adam turns small noisy gradients into full-size steps.
    retriever = optax.chain(tx, optax.scale(tc.retriever_lr_factor))
    labels = path_labels(params, tc.freeze, "frozen", "train")
    labels = jax.tree.map(
        lambda label, q: "retriever" if label == "train" and q == "q" else label,
        labels,
        path_labels(params, r"^question_encoder/", "q", "-"),
    )
    tx = optax.multi_transform(
        {"train": tx, "retriever": retriever, "frozen": optax.set_to_zero()}, labels
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


def make_train_step(rag_cfg: rag.RagConfig, variant: str, tx, dropout_rng, deterministic: bool):
    """`train_step(state, batch) -> (state, metrics)`, jitted with the state donated."""

    def train_step(state: TrainState, batch):
        rng = None if deterministic else jax.random.fold_in(dropout_rng, state.step)

        # Contexts travel as [B, N, S] so every leaf shards over B; the loss takes [B * N, S].
        flat = dict(batch)
        for key in ("context_input_ids", "context_attention_mask"):
            flat[key] = batch[key].reshape(-1, batch[key].shape[-1])  # -> [B * N, S]

        def loss(params):
            return rag.loss_fn(rag_cfg, params, flat, variant, rng)

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
        return TrainState(state.step + 1, params, opt_state), step_metrics

    return jax.jit(train_step, donate_argnums=0)


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
    """Host-side batch assembly: tokens, labels and retrieval, deterministic in (seed, step)."""

    def __init__(self, exp: experiment.Experiment, mesh):
        self.exp, self.mesh = exp, mesh
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
        """Encodes with the current question encoder and retrieves; returns host arrays."""
        ids, mask = sharding.shard_batch(
            self.mesh, (fields["question_input_ids"], fields["question_attention_mask"])
        )
        q = jax.device_get(self.embed(params, ids, mask))  # -> [B, D]
        return self.exp.retriever(q, pieces)

    def train_batch(self, params, step: int):
        c = self.exp.config
        idx = data.batch_indices(len(self.exp.train), c.train.batch_size, c.seed, step)
        examples = [self.exp.train[i] for i in idx]
        targets = [
            data.pick_target(e.answers, c.data.target, c.seed, step, int(i))
            for e, i in zip(examples, idx)
        ]
        fields, pieces = self.questions(examples)
        hits = self.retrieve(params, fields, pieces)
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
        recall = metrics.answer_recall(
            [e.answers for e in examples],
            [[self.exp.store.text(int(j)) for j in row] for row in hits.doc_ids],
            [self.exp.rag_cfg.n_docs],
        )
        return batch, recall


# ---------------------------------------------------------------------------------------------
# Evaluation


def evaluate(exp: experiment.Experiment, params, examples, *, mesh, variant: str, ks=(1, 5)):
    """EM/F1 of generated answers and retrieval recall@k over `examples` (none dropped).

    Returns:
      (metrics as floats, predictions: one dict per example with the answer and retrieved ids).
    """
    c = exp.config
    batch_size = c.eval.batch_size
    sharding.check_batch_divisible(batch_size, mesh.size, "eval batch")
    batcher = Batcher(exp, mesh)
    gen = _generate_fn(exp.rag_cfg, variant, c.eval.sequence_decoding)
    ks = [k for k in ks if k <= exp.rag_cfg.n_docs]
    totals, predictions = {}, []
    for idx, mask in data.eval_batches(len(examples), batch_size):
        batch_examples = [examples[i] for i in idx]
        fields, pieces = batcher.questions(batch_examples)
        hits = batcher.retrieve(params, fields, pieces)
        q_ids, q_mask, vecs, ctx, ctx_mask = sharding.shard_batch(
            mesh,
            (
                fields["question_input_ids"],
                fields["question_attention_mask"],
                hits.doc_vectors,
                hits.context_input_ids.reshape(batch_size, -1, hits.context_input_ids.shape[-1]),
                hits.context_attention_mask.reshape(
                    batch_size, -1, hits.context_input_ids.shape[-1]
                ),
            ),
        )
        tokens = np.asarray(jax.device_get(gen(params, q_ids, q_mask, vecs, ctx, ctx_mask)))
        answers = exp.generator_tokenizer.batch_decode(tokens, skip_special_tokens=True)
        answers = [a.strip() for a in answers]
        gold_answers = [e.answers for e in batch_examples]
        texts = [[exp.store.text(int(j)) for j in row] for row in hits.doc_ids]
        ids = [[exp.store.ids[int(j)] for j in row] for row in hits.doc_ids]
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
                        "retrieved": ids[row],
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


def _init_state(exp: experiment.Experiment, tx, mesh) -> TrainState:
    params = sharding.replicate(mesh, exp.params)
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))


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
    with checkpoints.Checkpointer(workdir, read_only=True) as ckpt:
        restored = ckpt.restore_latest(jax.eval_shape(init))
    if restored is None:
        raise FileNotFoundError(f"no checkpoint in {checkpoints.checkpoint_dir(workdir)}")
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


def validate(config: ml_collections.ConfigDict, num_devices: int) -> None:
    """Start-up checks of invariants, each error naming the value and what would be right."""
    tc = config.train
    sharding.check_batch_divisible(tc.batch_size, num_devices)
    if config.eval.enabled:
        sharding.check_batch_divisible(config.eval.batch_size, num_devices, "eval batch")
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
    ckpt = checkpoints.Checkpointer(
        workdir, max_to_keep=tc.keep_checkpoints, save_interval_steps=tc.save_every
    )
    state, restored = ckpt.restore_or_init(init_state)
    state = sharding.replicate(mesh, state)
    start = int(restored or 0)
    logger = _Logger(workdir)
    eval_examples = exp.eval[: config.eval.max_examples or None]

    before_path = workdir / "eval_before.json"
    if not config.eval.enabled:
        before = {}
    elif before_path.is_file():
        before = json.loads(before_path.read_text())
    else:
        before, _ = evaluate(exp, state.params, eval_examples, mesh=mesh, variant=variant)
        if jax.process_index() == 0:
            before_path.write_text(json.dumps(before))
        logger.write(start, before, "eval/")
    print(f"before training: {json.dumps(before)}", flush=True)

    step_fn = make_train_step(exp.rag_cfg, variant, tx, dropout_rng, config.model.deterministic)
    batcher = Batcher(exp, mesh)
    totals: dict = {}
    last_log = time.perf_counter()
    bar = tqdm.tqdm(total=tc.steps, initial=start, desc="train", disable=jax.process_index() != 0)
    step = start
    while step < tc.steps:
        if checkpoints.should_stop(step):
            ckpt.save(step, state, config, force=True)
            print(f"preempted: saved step {step}", flush=True)
            break
        host_batch, recall = batcher.train_batch(state.params, step)
        batch = sharding.shard_batch(mesh, host_batch)
        with jax.transfer_guard("disallow"):
            state, step_metrics = step_fn(state, batch)
        step += 1
        totals = metrics.merge_metrics(totals, recall, jax.device_get(step_metrics))
        bar.update(1)
        if step % tc.log_every == 0 or step == tc.steps:
            values = metrics.reduce_metrics(totals)
            if not np.isfinite(values["loss"]):
                raise FloatingPointError(
                    f"non-finite loss {values['loss']} at step {step}; the last good checkpoint "
                    f"(step {ckpt.latest_step()}) is kept in {workdir}"
                )
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
    bar.close()
    ckpt.close()

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
