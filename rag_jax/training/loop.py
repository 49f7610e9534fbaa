"""Joint training of the question encoder and the generator, with retrieval in the loop.

Each step: encode the batch's questions with the *current* question encoder (jitted), search the
index, gather the retrieved passages' stored vectors and generator contexts (`batches.Batcher`),
then run one jitted data-parallel step that recomputes the doc scores `q · d` from the question
encoder, so the RAG marginal likelihood's gradient reaches it. With the device index the step
itself searches for the next batch with the updated question encoder (`step_index`). The host
work of the next batch that needs no parameters (example choice, tokenisation, labels) runs
while the device runs the step; the search waits for the step's parameters, so a resumed run is
bitwise identical to an uninterrupted one.

`params = {"question_encoder", "generator", "passage_encoder"}`. The passage encoder is frozen by
default (a regex freeze mask over parameter paths, `config.train.freeze`), as in the paper; the
stored vectors then stay valid for the whole run.

Legend: B batch, N docs, S context length, T target length, Q question length, D width.
"""

import functools
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tqdm

from rag_jax import checkpoints, experiment, metrics, settings, sharding
from rag_jax.evaluation import evaluate, summary_metrics
from rag_jax.retrieval import files
from rag_jax.retrieval.device_index import DeviceIndex
from rag_jax.training import refresh
from rag_jax.training.batcher import Batcher
from rag_jax.training.optim import make_optimizer
from rag_jax.training.step import TrainState, make_train_step, search_ids


def step_index(config: ml_collections.ConfigDict, exp: experiment.Experiment, mesh):
    """The `DeviceIndex` the train step searches for the next batch, or None.

    The search runs inside the step when `config.retrieval.index` is "device",
    `config.retrieval.search_in_step` is on, the stored vectors never change (no refresh) and the
    index lives on the step's devices (training on all devices, of one process or of a pod);
    otherwise each batch is retrieved between the steps.
    """
    r = config.retrieval
    if r.index != "device" or not r.search_in_step or r.refresh_every:
        return None
    index = getattr(exp.retriever, "index", None)  # ClosedBook has none
    if not isinstance(index, DeviceIndex) or index.axis != sharding.DATA_AXIS:
        return None
    return index if list(index.mesh.devices.flat) == list(mesh.devices.flat) else None


# ---------------------------------------------------------------------------------------------
# The loop


def _with_width(inputs: tuple, context_width: int, label_width: int) -> tuple:
    """The train step's arguments as abstract values, with the contexts `context_width` and the
    labels `label_width` columns wide."""

    def widen(name, x):
        shape = x.shape
        if name.startswith("context_"):
            shape = x.shape[:-1] + (context_width,)
        elif name == "labels":
            shape = x.shape[:-1] + (label_width,)
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=x.sharding)

    batch = {name: widen(name, x) for name, x in inputs[0].items()}
    return (batch, *inputs[1:])


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
    config = settings.complete(config or checkpoints.load_config(workdir))
    exp = exp or experiment.build(config, workdir)
    mesh = device_mesh(config)
    init = functools.partial(_init_state, exp, make_optimizer(config.train), mesh)
    ckpt_root = config.train.checkpoint_dir or workdir  # e.g. gs://bucket/run
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


def device_mesh(config: ml_collections.ConfigDict):
    """The `data` mesh over the first `config.train.num_devices` devices (0 = all)."""
    devices = jax.devices()
    count = config.train.num_devices or len(devices)
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
    settings.validate(config, mesh.size)
    exp = experiment.build(config, workdir)
    tc, variant = config.train, config.rag.variant
    tx = make_optimizer(tc)
    rng = jax.random.PRNGKey(config.seed)
    dropout_rng = jax.random.fold_in(rng, 1)

    init_state = functools.partial(_init_state, exp, tx, mesh)
    checkpoints.install_preemption_handler()
    # Several hosts need checkpoints on storage they share: a gs:// bucket or a shared workdir.
    ckpt = checkpoints.Checkpointer(
        tc.checkpoint_dir or workdir,
        max_to_keep=tc.keep_checkpoints,
        save_interval_steps=tc.save_every,
    )
    state, restored = ckpt.restore_or_init(init_state, _abstract_state(init_state, mesh))
    state = sharding.replicate(mesh, state)
    start = int(restored or 0)
    if restored is not None:
        print(f"resumed from checkpoint step {restored} in {ckpt.directory}", flush=True)
    refresher = None
    if config.retrieval.refresh_every:  # a trainable passage encoder
        every = config.retrieval.refresh_every
        lag = config.retrieval.refresh_lag or max(1, every // 2)
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
            files.write_atomic(before_path, json.dumps(before).encode())
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
    step, compiled = start, {}  # (context width, label width) -> the train step compiled for it
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
            doc_ids = sharding.own_rows(state.next_doc_ids, mesh)  # -> [local B, N]
            host_batch, recall = batcher.train_batch(None, step, doc_ids)
            next_questions = sharding.shard_batch(mesh, batcher.question_fields(step + 1))
            inputs = (sharding.shard_batch(mesh, host_batch), (index, next_questions))
        # batches.context_width and batches.label_width
        width = (host_batch["context_input_ids"].shape[-1], host_batch["labels"].shape[-1])
        with jax.transfer_guard("disallow"):
            if not compiled:  # ahead of the first call: the widest step's memory is checked
                widest = (exp.rag_cfg.max_combined_length, config.data.answer_length)
                compiled[widest] = step_fn.lower(state, *_with_width(inputs, *widest)).compile()
                _check_memory(compiled[widest], state, exp, mesh)
            if width not in compiled:
                compiled[width] = step_fn.lower(state, *inputs).compile()
            state, step_metrics = compiled[width](state, *inputs)
        step += 1
        if step < tc.steps:  # the next batch's host work runs while the device runs this step
            batcher.prepare(step if index is None else step + 1)
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
        every = config.eval.every
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
        "search_in_step": index is not None,
        "eval": after,
    }
