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
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tqdm

from rag_jax.devices import device_memory, distributed, preemption, sharding
from rag_jax.io import bundle
from rag_jax.models import flash
from rag_jax.retrieval import files, passage_trunk
from rag_jax.retrieval.device_index import DeviceIndex
from rag_jax.retrieval.retriever import Retriever
from rag_jax.run import checkpoints, metrics, settings, validation
from rag_jax.training import experiment, refresh
from rag_jax.training.batcher import Batcher
from rag_jax.training.evaluation import evaluate, summary_metrics
from rag_jax.training.optim import make_optimizer
from rag_jax.training.step import (
    TrainState,
    init_state,
    make_train_step,
    retriever_objective,
    search_ids,
    searched_count,
)

# ---------------------------------------------------------------------------------------------
# The loop


def _with_width(
    inputs: tuple, context_width: int, label_width: int, passage_width: int = 0
) -> tuple:
    """The train step's arguments as abstract values, with the contexts `context_width`, the
    labels `label_width` and the passage states `passage_width` columns wide."""

    def widen(name, x):
        shape = x.shape
        if name.startswith("context_"):
            shape = x.shape[:-1] + (context_width,)
        elif name in ("labels", "answer_logprobs"):
            shape = x.shape[:-1] + (label_width,)
        elif name == "passage_states":  # [B, K, P, H]
            shape = x.shape[:2] + (passage_width, x.shape[3])
        elif name == "passage_attention_mask" and "passage_states" in inputs[0]:
            shape = x.shape[:2] + (passage_width,)
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=x.sharding)

    batch = {name: widen(name, x) for name, x in inputs[0].items()}
    return (batch, *inputs[1:])


def _check_memory(compiled, state: TrainState, exp: experiment.Experiment, mesh) -> None:
    """Prints what the compiled train step needs per device (XLA's own accounting) and raises
    before the first step runs when that exceeds the device's memory."""
    index = getattr(exp.retriever, "index", None)  # None: closed book
    shard = -(-index.nbytes // mesh.size) if isinstance(index, DeviceIndex) else 0
    host_index = getattr(exp.retriever, "vectors", np.zeros(0)).nbytes if not shard else 0
    layout = exp.config.train.param_sharding
    parts = device_memory.compiled_memory(
        compiled,
        {
            f"parameters ({layout})": device_memory.per_device_bytes(state.params),
            "optimizer state": device_memory.per_device_bytes(state.opt_state),
            "index shard": shard,
        },
        rest="batch and the rest of the arguments",
    )
    need = parts["total"]
    limit = device_memory.device_memory_limit(mesh.devices.flat[0])
    human = device_memory.human_bytes
    rows = [*parts.items(), ("device memory", limit), ("host index (RAM of each host)", host_index)]
    if jax.process_index() == 0:
        print(f"train step memory per device, from XLA ({mesh.size} devices):", flush=True)
        for name, value in rows:
            print(f"  {name:<40} {'unknown' if value is None else human(value):>12}", flush=True)
    if limit is not None and need > limit:
        raise ValueError(
            f"the train step needs {human(need)} per device but the device has {human(limit)} "
            f"({human(parts['temporaries'])} of it temporaries for "
            f"{exp.config.train.batch_size // mesh.size} examples per device): lower "
            "config.train.batch_size (with grad_accum to keep the global batch), set "
            "config.model.remat=True or config.model.dtype='bfloat16', "
            "config.train.param_sharding='fsdp', or keep the index on the host "
            "(config.retrieval.index exact or scann)"
        )


def _init_state(exp: experiment.Experiment, retriever, batcher: Batcher, tx, mesh) -> TrainState:
    """The state before the first step; with an in-step search, it carries the first batch's
    passages (each later step searches for the next)."""
    where = sharding.param_sharding(mesh, exp.params, exp.config.train.param_sharding)
    params = jax.device_put(exp.params, where)
    search = functools.partial(_first_search, exp.rag_cfg, searched_count(exp.config), params)
    first = lambda: distributed.shard_batch(mesh, batcher.question_fields(0))  # noqa: E731
    return init_state(params, tx, retriever.initial_doc_ids(search, first, mesh))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _first_search(rag_cfg, n_docs, params, index, questions):
    return search_ids(rag_cfg, params, index, questions, n_docs)


def state_sharding(config: ml_collections.ConfigDict, mesh, state: TrainState) -> TrainState:
    """Where each part of a train state lives: parameters and optimizer state as
    `config.train.param_sharding` says, the step and the in-step search's ids replicated."""
    mode, whole = config.train.param_sharding, sharding.replicated(mesh)
    return TrainState(
        whole,
        sharding.param_sharding(mesh, state.params, mode),
        sharding.param_sharding(mesh, state.opt_state, mode),
        None if state.next_doc_ids is None else whole,
    )


def abstract_state(config: ml_collections.ConfigDict, params, tx, mesh, in_step: bool):
    """The shapes of the train state placed over `mesh` (`state_sharding`): the target of a
    restore, and the state a compile without any array is made for (`benchmarks.aot`).

    `jax.eval_shape` drops placements; without them a restore lands on one local device, and on
    several hosts each process would hold its own unreplicated copy.

    Args:
      params: the parameters, arrays or `jax.ShapeDtypeStruct`s.
      in_step: the state carries the next batch's passages (`TrainState.next_doc_ids`).
    """
    next_ids = None
    if in_step:
        next_ids = jax.ShapeDtypeStruct(
            (config.train.batch_size, searched_count(config)), jnp.int32
        )
    shapes = jax.eval_shape(lambda: init_state(params, tx, next_ids))
    where = state_sharding(config, mesh, shapes)
    to_struct = lambda s, w: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=w)  # noqa: E731
    return jax.tree.map(to_struct, shapes, where)


def make_step_fn(config: ml_collections.ConfigDict, rag_cfg, passage_cfg, tx, in_step: bool,
                 state_where) -> Callable:  # fmt: skip
    """The trainer's jitted train step for `config` (`step.make_train_step`), keeping the state
    where `state_where` puts it; `in_step`: it also searches a `DeviceIndex` for the next batch."""
    dropout_rng = jax.random.fold_in(jax.random.PRNGKey(config.seed), 1)
    head = config.retrieval.passage_head_layers  # only the passage tower's top layers train
    return make_train_step(
        rag_cfg,
        config.rag.variant,
        tx,
        dropout_rng,
        config.model.deterministic,
        passage_cfg if config.retrieval.refresh_every else None,
        search_n_docs=searched_count(config) * in_step,
        state_sharding=state_where,
        frozen=config.train.freeze,
        objective=retriever_objective(config),
        passage_first_layer=head and passage_trunk.first_layer(passage_cfg, head),
    )


def restore(workdir, config: ml_collections.ConfigDict | None = None, exp=None, step=None):
    """The newest checkpoint in `workdir` (or checkpoint `step`; config read from beside it
    unless given), with the experiment whose retriever is the checkpoint's passage encoder's:
    its index is loaded from `<workdir>/index` when the run saved it (a frozen passage encoder,
    or the final index of a refreshing run), encoded otherwise.

    Returns:
      (experiment, TrainState, step).
    """
    workdir = pathlib.Path(workdir).absolute()
    if config is None:
        with checkpoints.Checkpointer(workdir, read_only=True) as ckpt:
            config = ckpt.load_config(_checked_step(ckpt, step))
    config = settings.complete(config)
    exp = exp or experiment.build(config, workdir, retriever=False)
    mesh = device_mesh(config)
    ckpt_root = config.train.checkpoint_dir or workdir  # e.g. gs://bucket/run
    tx, in_step = make_optimizer(config.train), exp.searches_in_step(mesh)
    abstract = abstract_state(config, exp.params, tx, mesh, in_step)
    with checkpoints.Checkpointer(ckpt_root, read_only=True) as ckpt:
        if step is None:
            restored = ckpt.restore_latest(abstract)
        else:
            restored = ckpt.restore(_checked_step(ckpt, step), abstract), step
    if restored is None:
        raise FileNotFoundError(f"no checkpoint in {checkpoints.checkpoint_dir(ckpt_root)}")
    state, step = restored
    passage_params = distributed.state_to_host(state.params["passage_encoder"])
    return exp.with_retriever(passage_params), state, step


def _checked_step(ckpt: checkpoints.Checkpointer, step: int | None) -> int | None:
    """`step` when the checkpoint directory holds it (None: the newest), else an error naming the
    steps it holds."""
    if step is not None and step not in ckpt.all_steps():
        raise FileNotFoundError(
            f"no checkpoint step {step} in {ckpt.directory}; its steps: {ckpt.all_steps()}"
        )
    return step


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


def _write_bundle(exp, state: TrainState, retriever, step: int, directory) -> None:
    """The run's bundle (`rag_jax.io.bundle`): the final parameters and index, written by
    process 0."""
    if not isinstance(retriever, Retriever):
        print(f"no bundle: a {type(retriever).__name__} run has no passages to bundle", flush=True)
        return
    if jax.process_index() == 0:
        params = distributed.replicated_to_host(state.params)  # this process's own copy
        written = bundle.save(directory, exp, params, retriever=retriever, step=step)
        size = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
        print(
            f"bundle: {directory} ({device_memory.human_bytes(size)}, "
            f"{len(written.store)} passages)",
            flush=True,
        )


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
    distributed.maybe_initialize_distributed()
    # First, before any work: a SIGTERM during the store build, the encoding or a warm start is a
    # preemption too, not an exit with nothing said.
    preemption.install_preemption_handler()
    mesh = device_mesh(config)
    validation.validate(config, mesh.size)
    try:
        exp = experiment.build(config, workdir)
    except preemption.Preempted as stopped:
        print(f"preempted before training: {stopped}", flush=True)
        return {"preempted": str(stopped), "steps": 0}
    tc, variant = config.train, config.rag.variant
    tx = make_optimizer(tc)
    batcher = Batcher(exp, mesh)

    init = functools.partial(_init_state, exp, exp.retriever, batcher, tx, mesh)
    # Several hosts need checkpoints on storage they share: a gs:// bucket or a shared workdir.
    ckpt = checkpoints.Checkpointer(
        tc.checkpoint_dir or workdir,
        max_to_keep=tc.keep_checkpoints,
        save_interval_steps=tc.save_every,
    )
    in_step = exp.retriever.searches_in_step(mesh)
    target = abstract_state(config, exp.params, tx, mesh, in_step)
    where = jax.tree.map(lambda s: s.sharding, target)
    state, restored = ckpt.restore_or_init(init, target)
    state = jax.device_put(state, where)
    start = int(restored or 0)
    if restored is not None:
        print(f"resumed from checkpoint step {restored} in {ckpt.directory}", flush=True)
        if exp.reader_trunk is not None:  # its cached states must be the restored reader's
            exp.reader_trunk.check_restored(exp.rag_cfg.generator, state.params["generator"])
    retrievers = refresh.schedule(exp, workdir, start)  # which retriever serves each step
    logger = _Logger(workdir)
    eval_examples = exp.eval[: config.eval.max_examples or None]

    def evaluate_now(params, retriever, examples=eval_examples, generate=None, per_question=None):
        generate = config.eval.answers if generate is None else generate
        return evaluate(
            exp, params, examples, mesh=mesh, variant=variant, retriever=retriever,
            generate=generate, per_question=per_question, ks=metrics.recall_ks(config),
        )  # fmt: skip

    before_path = workdir / "eval_before.json"
    if not (config.eval.enabled and config.eval.before):
        before = {}
    elif distributed.from_process0(before_path.is_file()):  # evaluate on all hosts or on none
        before = json.loads(before_path.read_text()) if before_path.is_file() else {}
    else:
        print(f"evaluating {len(eval_examples)} questions before training", flush=True)
        before, _ = evaluate_now(state.params, retrievers.retriever)
        if jax.process_index() == 0:
            files.write_atomic(before_path, json.dumps(before).encode())
        logger.write(start, before, "eval/")
    print(f"before training: {json.dumps(before)}", flush=True)

    step_fn = make_step_fn(config, exp.rag_cfg, exp.passage_cfg, tx, in_step, where)
    totals: dict = {}
    last_log = time.perf_counter()
    bar = tqdm.tqdm(total=tc.steps, initial=start, desc="train", disable=jax.process_index() != 0)
    step, compiled = start, {}  # (context width, label width) -> the train step compiled for it
    while step < tc.steps:
        if preemption.should_stop(step):
            ckpt.save(step, state, config, force=True)
            batcher.save_memo()
            print(f"preempted: saved step {step}", flush=True)
            break
        batch = batcher.train_batch(state, step, retrievers.at(step, state.params))
        inputs = (distributed.shard_batch(mesh, batch.arrays), batch.retrieval)
        # model_inputs.context_width and label_width
        # none with an answer memo or the reader's cached states (`train.reader_trunk`)
        contexts = batch.arrays.get("context_input_ids")
        states = batch.arrays.get("passage_states")  # [B, K, P, H], P as wide as they need
        width = (
            0 if contexts is None else contexts.shape[-1],
            batch.arrays["labels"].shape[-1],
            0 if states is None else states.shape[2],
        )
        # Pallas kernels (model.attention_impl "flash" or "splash") are split over the mesh they are
        # traced under.
        kernels = flash.tracing_mesh(config.model.attention_impl, mesh)
        with jax.transfer_guard("disallow"), kernels:
            if not compiled:  # ahead of the first call: the widest step's memory is checked
                passages = config.retrieval.passage_max_length * (states is not None)
                prompts = exp.rag_cfg.max_combined_length * (contexts is not None)
                widest = (prompts, config.data.answer_length, passages)
                compiled[widest] = step_fn.lower(state, *_with_width(inputs, *widest)).compile()
                _check_memory(compiled[widest], state, exp, mesh)
            if width not in compiled:
                compiled[width] = step_fn.lower(state, *inputs).compile()
            state, step_metrics = compiled[width](state, *inputs)
        step += 1
        if step < tc.steps:  # the next batches' host work runs while the device runs this step
            batcher.prepare_ahead(step)
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
        totals = metrics.merge_metrics(totals, batch.recall, step_values)
        bar.update(1)
        if step % tc.log_every == 0 or step == tc.steps:
            values = metrics.reduce_metrics(totals)
            elapsed = time.perf_counter() - last_log
            count = step % tc.log_every or tc.log_every
            values.update(
                steps_per_s=count / elapsed, examples_per_s=count * tc.batch_size / elapsed
            )
            logger.write(step, values, "train/")
            shown = "loss" if "loss" in values else "retriever_loss"  # a reader-free gold row
            bar.set_postfix(
                **{shown: f"{values[shown]:.3f}"},
                recall=f"{values.get(f'answer_recall@{exp.rag_cfg.n_docs}', 0):.2f}",
            )
            totals, last_log = {}, time.perf_counter()
        ckpt.save(step, state, config, force=step == tc.steps)
        if (tc.save_every and step % tc.save_every == 0) or step == tc.steps:
            batcher.save_memo()
        every = config.eval.every
        if config.eval.enabled and every and step % every == 0 and step < tc.steps:
            curve = eval_examples[: config.eval.every_max_examples or None]
            during, _ = evaluate_now(
                state.params, retrievers.retriever, curve, config.eval.every_answers
            )
            logger.write(step, during, "eval/")  # learning curves; the final eval follows
    bar.close()
    ckpt.close()
    if step < tc.steps:  # preempted, saved: the evaluation is the resumed run's to make
        retrievers.close()
        logger.close()
        return {"preempted": f"saved step {step} of {tc.steps}", "steps": step}
    retriever = retrievers.finish(state.params)  # the final passage encoder's index

    after, predictions = {}, []
    per_question = []  # every held-out question's metrics: what paired comparisons read
    if config.eval.enabled:
        after, predictions = evaluate_now(state.params, retriever, per_question=per_question)
        logger.write(step, after, "eval/")
    logger.close()
    if jax.process_index() == 0 and config.eval.enabled:
        for name, records in (("predictions", predictions), ("per_question", per_question)):
            text = "".join(json.dumps(p) + "\n" for p in records)
            files.write_atomic(workdir / f"{name}.jsonl", text.encode())
    if tc.bundle and step == tc.steps:
        _write_bundle(exp, state, retriever, step, workdir / "bundle")
    recall_before, em_before = summary_metrics(before)
    recall_after, em_after = summary_metrics(after)
    return {
        "recall_at_5_before": recall_before,
        "recall_at_5_after": recall_after,
        "em_before": em_before,
        "em_after": em_after,
        "steps": step,
        "search_in_step": in_step,
        "eval": after,
    }
