"""Ahead-of-time compilation of the trainer's programs for a Cloud TPU topology, on a CPU host.

With `libtpu` installed (`pip install 'rag_jax[tpu]'`), `jax.experimental.topologies` describes
the devices of a TPU slice that is not there; a `Mesh` over them lowers and compiles the real
programs, and the compiled executables report XLA's own memory and cost analyses. Nothing runs:
the parameters, the index and the batches are shapes (`jax.ShapeDtypeStruct`), placed as the
trainer places them.

The programs are the trainer's own: the models of `experiment.model_shapes` (the config's
architectures, dtypes, remat), the optimizer of `training.optim.make_optimizer` (its freeze mask
included), the state placement of `training.loop.state_sharding` (`train.param_sharding`), the
step of `training.loop.make_step_fn` with the widest batch `training.batcher.batch_shapes`, and,
for the in-step search, a `DeviceIndex` of the config's planned size (`retrieval.index_rows`,
`retrieval.index_dtype`, or the index folder's manifest); generation is the evaluation's jitted
call (`evaluation.generate_fn`). For each program the report gives, per chip:

- memory: the arguments (parameters, optimizer state, index shard, batch, the rest), outputs
  that do not reuse a donated buffer, temporaries and code, summing to the total; against the
  HBM the TPU compiler has (probed: it refuses a larger program and names its capacity);
- FLOPs: XLA's count against the analytic count of `benchmarks.accelerator.train_flops`, or of
  `causal_train_flops` for a causal (Llama) generator (rematerialised layers and the in-step
  search added, loop bodies counted once as XLA does), and the matmul FLOPs of the compiled
  program itself with every loop iteration (`benchmarks.hlo`);
- bytes: XLA's "bytes accessed", the HBM traffic of the compiled program at fusion boundaries
  (`benchmarks.hlo.traffic`) and a lower bound from what must cross HBM once: parameters read
  and written, optimizer state read and written, gradients written and read, the activations the
  backward pass reads (the residuals of `jax.vjp`), the batch and the index shard;
- a roofline step time, max(FLOPs / peak, HBM bytes / bandwidth) with the `PEAKS` of
  `benchmarks.accelerator`, and the model-FLOPs utilisation it caps;
- the collectives (the gradient all-reduce, or the fsdp reduce-scatter and all-gathers) and any
  host transfer in the program;
- the largest global batch that fits, from a linear model of memory in the batch fitted to two
  compiles and verified by compiling it and the next multiple of the chip count.

Legend: B global batch, b per chip, N docs, S context length, T target length, Q question
length, C index rows, D vector width, n chips, P parameters.
"""

import dataclasses
import functools
import gzip
import importlib.util
import math
import os
import pathlib
import re
import time

import jax
import jax.numpy as jnp
import ml_collections

from benchmarks import hlo
from benchmarks.accelerator import device_peaks, train_flops
from rag_jax import evaluation, experiment, settings, sharding
from rag_jax.models import flash, llama
from rag_jax.retrieval import index as index_files
from rag_jax.retrieval.device_index import DeviceIndex
from rag_jax.training import loop
from rag_jax.training.batcher import batch_shapes
from rag_jax.training.optim import make_optimizer
from rag_jax.training.step import joint_loss_fn

# TPU generations this tool plans for (the keys of `benchmarks.accelerator.PEAKS` name their
# peaks), with what the topology description needs: v4 and v5p chips are one JAX device of two
# TensorCores ("megacore"), as Cloud TPU VMs present them.
GENERATIONS = {
    "v4": {"chip_config_name": "megacore"},
    "v5p": {"chip_config_name": "megacore"},
    "v5e": {},
    "v6e": {},
}
# Slices that are one VM of 8 chips (v5litepod-8, v6e-8); larger v5e/v6e slices have 4 per host.
SINGLE_HOST_8 = {"v5e:2x4", "v6e:2x4"}
EXAMPLES = "v4:2x2x1, v5e:2x4, v5p:2x2x1, v6e:2x4, v5e:4x4, v4:2x2x4"


# The parameters the evaluation's generation reads (`evaluation.generate_fn`).
GENERATION_PARAMS = ("question_encoder", "generator")


class PlanError(ValueError):
    """Input the tool cannot plan for; the message says what to do (one line)."""


# ---------------------------------------------------------------------------------------------
# The topology


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # e.g. "v5e:2x4"
    mesh: jax.sharding.Mesh  # the `data` mesh over every chip
    kind: str  # device_kind, e.g. "TPU v5 lite"
    hosts: int
    hbm_bytes: int  # what the TPU compiler lets one program use per chip
    peaks: dict  # benchmarks.accelerator.device_peaks

    @property
    def chips(self) -> int:
        return self.mesh.size

    def describe(self) -> dict:
        return {
            "topology": self.name,
            "kind": self.kind,
            "chips": self.chips,
            "hosts": self.hosts,
            "hbm_bytes_per_chip": self.hbm_bytes,
            "peak_bf16_tflops_per_chip": self.peaks["tflops"],
            "peak_hbm_gbps_per_chip": self.peaks["gbps"],
            "peak_source": self.peaks["source"],
        }


def has_libtpu() -> bool:
    """Whether the TPU compiler (`libtpu`, brought by `jax[tpu]`) is installed."""
    return importlib.util.find_spec("libtpu") is not None


def target(name: str) -> Target:
    """The devices of TPU topology `name` (e.g. "v5e:2x4") as a `data` mesh."""
    generation = name.partition(":")[0].lower()
    if generation not in GENERATIONS or not re.fullmatch(r"[a-z0-9]+:\d+(x\d+){1,2}", name):
        raise PlanError(
            f"unknown TPU topology {name!r}: give <generation>:<chips per axis>, generation one "
            f"of {', '.join(GENERATIONS)}, e.g. {EXAMPLES}"
        )
    if not has_libtpu():
        raise PlanError(
            "libtpu is not installed, so there is no TPU compiler: pip install 'rag_jax[tpu]' "
            f"(jax[tpu]=={jax.__version__}), best in a virtualenv of its own"
        )
    # Compiling needs no TPU, so several compiling processes may share libtpu (which otherwise
    # takes a lock for the process that owns the chips).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    options = dict(GENERATIONS[generation])
    if name in SINGLE_HOST_8:
        options["chips_per_host_bounds"] = (2, 4, 1)
    try:
        topology = topologies.get_topology_desc(topology_name=name, platform="tpu", **options)
    except Exception as e:  # noqa: BLE001 - libtpu's own message, on one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PlanError(f"libtpu refused TPU topology {name!r} ({first}); try {EXAMPLES}") from None
    devices = list(topology.devices)
    mesh = sharding.data_mesh(devices)
    kind = devices[0].device_kind
    return Target(
        name=name,
        mesh=mesh,
        kind=kind,
        hosts=len({d.process_index for d in devices}),
        hbm_bytes=usable_hbm(mesh),
        peaks=device_peaks(kind),
    )


_CAPACITY = re.compile(r"(?:available HBM|of) \(?([0-9.]+)([KMGT])\)?(?: hbm)?")
_NEEDED = [
    re.compile(r"Used ([0-9.]+)([KMGT]) of ([0-9.]+)([KMGT]) hbm"),
    re.compile(r"\(([0-9.]+)([KMGT])\) exceeds available HBM \(([0-9.]+)([KMGT])\)"),
]
_UNIT = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def out_of_memory(error: BaseException) -> tuple[int, int] | None:
    """(bytes needed, bytes available) from the TPU compiler's out-of-memory error, else None."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text and "memory" not in text.lower():
        return None
    for pattern in _NEEDED:
        found = pattern.search(text)
        if found:
            need, unit, have, have_unit = found.groups()
            return int(float(need) * _UNIT[unit]), int(float(have) * _UNIT[have_unit])
    return None


@functools.cache
def usable_hbm(mesh) -> int:
    """The HBM one program may use per chip, as the TPU compiler sees it: a program too large for
    any chip is compiled, and the refusal names the capacity."""
    huge = jax.ShapeDtypeStruct((2**40,), jnp.int8, sharding=sharding.replicated(mesh))
    try:
        jax.jit(lambda x: x + 1).lower(huge).compile()
    except Exception as e:  # noqa: BLE001 - the expected refusal
        found = out_of_memory(e)
        if found:
            return found[1]
        raise RuntimeError(f"the TPU compiler's refusal did not name its HBM: {e}") from e
    raise RuntimeError("the TPU compiler accepted a program of 1 TiB per chip")


# ---------------------------------------------------------------------------------------------
# The run's models and index, as shapes


@dataclasses.dataclass(frozen=True)
class Plan:
    config: ml_collections.ConfigDict
    rag_cfg: object
    passage_cfg: object
    params: dict  # of jax.ShapeDtypeStruct
    sources: dict  # where each architecture came from
    tx: object
    index: dict  # rows, dim, dtype, source

    def with_batch(self, batch: int) -> ml_collections.ConfigDict:
        config = ml_collections.ConfigDict(self.config.to_dict())
        config.train.batch_size = batch
        return config


def plan(config: ml_collections.ConfigDict) -> Plan:
    """The models, optimizer and index size of `config`, without weights or data."""
    try:
        settings.validate(config, 1, paths=False)
        rag_cfg, passage_cfg, params, sources = experiment.model_shapes(config)
    except ValueError as e:  # a setting or a checkpoint at fault: the message names it
        raise PlanError(str(e)) from None
    return Plan(
        config,
        rag_cfg,
        passage_cfg,
        params,
        sources,
        make_optimizer(config.train),
        _index_size(config, passage_cfg.embedding_dim),
    )


def _index_size(config, dim: int) -> dict:
    r = config.retrieval
    folder = pathlib.Path(r.index_dir) / "index" if r.index_dir else None
    if folder is not None and (folder / index_files.MANIFEST).is_file():
        manifest = index_files.read_manifest(str(folder), None, kinds=("exact", "scann"))
        return {
            "rows": manifest["count"],
            "dim": manifest["dim"],
            "dtype": manifest["dtype"],
            "source": f"{folder} (manifest)",
        }
    if r.index_rows:
        return {
            "rows": r.index_rows,
            "dim": dim,
            "dtype": r.index_dtype or "float32",
            "source": "config.retrieval.index_rows, index_dtype",
        }
    if config.data.source == "synthetic":
        rows = len(experiment._world(config).passages)
        return {
            "rows": rows,
            "dim": dim,
            "dtype": r.index_dtype or "float32",
            "source": "the synthetic world's passages",
        }
    raise PlanError(
        "the index is not on this machine: set config.retrieval.index_rows (and index_dtype) to "
        "the size it will have, or config.retrieval.index_dir to its folder"
    )


# ---------------------------------------------------------------------------------------------
# Model FLOPs


def causal_train_flops(q, g: llama.LlamaConfig, batch: int, *, n_docs: int, question: int,
                       context: int, target: int, frozen: str = "") -> dict:  # fmt: skip
    """Matmul FLOPs of one RAG training step whose generator is causal (`rag_jax.causal`), at 2
    FLOPs per multiply-add, with the keys of `benchmarks.accelerator.train_flops`.

    The question encoder and the doc scores are counted as `train_flops` counts them (backward =
    2x forward). The generator reads B * N rows of the S prompt tokens followed by the T answer
    tokens, L = S + T per row, in one causal pass: per layer and token the q and o projections
    (h heads of width d), k and v (the g key/value heads), SwiGLU's gate, up and down matrices,
    and attention's scores and mixing over the whole row (full L x L squares, as computed); the
    LM head (tied or not: the same product) on the T answer positions only. Embedding lookups,
    norms, rotary tables, softmax and the optimizer are not model FLOPs.

    Backward, as autodiff runs it with the trainer's frozen parameters (`frozen`, the regex of
    `train.freeze`, entering the loss as constants) and `frozen_layers` (no gradient below the
    top `generator_trained_layers`): a layer whose parameters train costs 2x its forward (input
    and weight gradients); a frozen layer the gradient must cross to reach a trainable one below
    it, its projections once (input gradients) and its attention products twice; a frozen layer
    with nothing trainable below it, nothing. The head: its weight gradient if its matrix trains
    (the embedding when tied), its input gradient if anything below it trains. With remat, every
    layer the backward pass enters runs its forward a second time ("recompute"), all but the down
    projection (its output only joins the residual stream, which the backward pass never reads).

    Returns:
      {"question_encoder", "generator", "doc_scores", "train", "recompute"} FLOPs (forward and
      backward), "forward" (forward only); "generator_forward" and "generator_backward".
    """
    rows, length = batch * n_docs, context + target
    hidden, width = g.hidden_size, g.head_width
    heads, kv_heads, ffn = g.num_attention_heads, g.num_key_value_heads, g.intermediate_size
    projections = 2 * hidden * width * (2 * heads + 2 * kv_heads) + 3 * 2 * hidden * ffn
    projections *= rows * length  # q, o; k, v; gate, up, down: per layer
    products = rows * 2 * 2 * heads * length * length * width  # scores and mixing, per layer
    layer_fwd = projections + products
    # Remat recomputes what the backward pass reads: all but the down projection, whose output
    # only joins the residual stream (pre-norm layers).
    layer_recompute = layer_fwd - rows * length * 2 * hidden * ffn
    head_fwd = 2 * rows * target * hidden * g.vocab_size

    def trains(path: str) -> bool:
        return not (frozen and re.search(frozen, f"generator/{path}"))

    paths = ["/".join(k.key for k in path) for path, _ in
             jax.tree_util.tree_leaves_with_path(llama.param_shapes(g))]  # fmt: skip
    bottom = g.frozen_layers  # stop_gradient above layer bottom - 1: nothing below gets one
    layer_trains = [
        i >= bottom and any(trains(p) for p in paths if p.startswith(f"layers_{i}/"))
        for i in range(g.num_hidden_layers)
    ]
    embedding = trains("embed_tokens/embedding")
    below = bottom == 0 and embedding  # a gradient is needed below the current layer
    backward, recompute = 0, 0
    for i in range(g.num_hidden_layers):
        if layer_trains[i]:
            backward += 2 * layer_fwd
        elif below:
            backward += projections + 2 * products
        if layer_trains[i] or below:
            recompute += layer_recompute * g.remat
        below = below or layer_trains[i]
    head_weight = embedding if g.tie_word_embeddings else trains("lm_head/kernel")
    head_input = below or trains("norm/scale")
    backward += head_fwd * (head_weight + head_input)
    generator_fwd = g.num_hidden_layers * layer_fwd + head_fwd

    h, f = q.hidden_size, q.intermediate_size
    tokens = batch * question
    per_token = 2 * (4 * h * h + 2 * h * f) + 2 * 2 * question * h
    question_layers = tokens * q.num_hidden_layers * per_token
    question_fwd = question_layers
    if q.projection_dim:
        question_fwd += 2 * batch * h * q.projection_dim
    if q.with_pooler:
        question_fwd += 2 * batch * h * h
    scores = 2 * rows * q.embedding_dim
    out = {
        "question_encoder": 3 * question_fwd,
        "generator": generator_fwd + backward,
        "doc_scores": 3 * scores,
        "forward": question_fwd + generator_fwd + scores,
        "generator_forward": generator_fwd,
        "generator_backward": backward,
        "recompute": question_layers * q.remat + recompute,
    }
    out["train"] = out["question_encoder"] + out["generator"] + out["doc_scores"]
    return out


def step_flops(q, g, batch: int, *, frozen: str = "", **shapes) -> dict:
    """The analytic FLOPs of one training step: `causal_train_flops` for a causal generator,
    else `benchmarks.accelerator.train_flops` (BART)."""
    if isinstance(g, llama.LlamaConfig):
        return causal_train_flops(q, g, batch, frozen=frozen, **shapes)
    return train_flops(q, g, batch, **shapes)


# ---------------------------------------------------------------------------------------------
# One compile


def _struct(x, where):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where)


def _placed(tree, where):
    return jax.tree.map(lambda x: _struct(x, where), tree)


def check_batch(batch: int, t: Target, what: str) -> None:
    if batch < 1 or batch % t.chips:
        lower, upper = max(batch // t.chips * t.chips, t.chips), (batch // t.chips + 1) * t.chips
        raise PlanError(
            f"{what} {batch} does not split over the {t.chips} chips of {t.name}: use a multiple "
            f"of {t.chips} (e.g. {lower} or {upper})"
        )


def _kernel_mesh(config, mesh):
    """`flash.tracing_mesh` for `config.model.attention_impl`."""
    return flash.tracing_mesh(config.model.attention_impl, mesh)


def _compile(lowered_fn) -> tuple[object | None, dict]:
    """(compiled or None, {compile_s, and the needed/available bytes when it does not fit})."""
    t0 = time.perf_counter()
    try:
        compiled = lowered_fn().compile()
    except Exception as e:  # noqa: BLE001 - out of memory is a result; the rest is raised
        found = out_of_memory(e)
        if found is None:
            raise
        return None, {
            "compile_s": time.perf_counter() - t0,
            "fits": False,
            "needed_bytes": found[0],
            "xla_error": str(e).strip().splitlines()[0][:400],
        }
    return compiled, {"compile_s": time.perf_counter() - t0}


def _costs(compiled) -> dict:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    return {"flops": float(cost.get("flops", 0.0)), "bytes": float(cost.get("bytes accessed", 0.0))}


def _roofline(flops: float, hbm_bytes: float, model_flops: float, t: Target) -> dict:
    peak, bandwidth = t.peaks["tflops"] * 1e12, t.peaks["gbps"] * 1e9
    compute_s, memory_s = flops / peak, hbm_bytes / bandwidth
    step_s = max(compute_s, memory_s)
    return {
        "step_s": step_s,
        "compute_s": compute_s,
        "memory_s": memory_s,
        "bound": "compute" if compute_s >= memory_s else "memory",
        "mfu_ceiling": model_flops / (step_s * peak) if step_s else None,
    }


def _residual_bytes(p: Plan, config, per_chip: int) -> float:
    """Bytes of the activations the backward pass reads from the forward (the residuals of
    `jax.vjp` of the step's loss) for `per_chip` examples. The residuals that do not grow with
    the batch are the parameters and their bfloat16 copies, already counted as parameters read
    (and, under fsdp, gathered), so they are left out."""
    passage_cfg = p.passage_cfg if config.retrieval.refresh_every else None
    loss_fn = joint_loss_fn(p.rag_cfg, config.rag.variant, passage_cfg, config.train.freeze)
    rng = None if config.model.deterministic else jax.random.PRNGKey(0)

    def residuals(batch: int) -> int:
        def vjp(params, arrays):
            return jax.vjp(lambda q: loss_fn(q, arrays, rng)[0], params)[1]

        saved = jax.eval_shape(vjp, p.params, batch_shapes(config, p.rag_cfg, batch))
        return sharding.tree_bytes(saved)

    return per_chip * (residuals(2) - residuals(1))


def train_row(p: Plan, t: Target, batch: int, in_step: bool, *, detail: bool = True,
              hlo_dir=None) -> dict:  # fmt: skip
    """Compiles the train step for `batch` questions on `t` and reports what it needs (with
    `detail`, FLOPs, bytes, roofline and collectives too; the optimised HLO goes to `hlo_dir`)."""
    check_batch(batch, t, "config.train.batch_size")
    config, mesh = p.with_batch(batch), t.mesh
    state = loop.abstract_state(config, p.params, p.tx, mesh, in_step)
    where = jax.tree.map(lambda s: s.sharding, state)
    step_fn = loop.make_step_fn(config, p.rag_cfg, p.passage_cfg, p.tx, in_step, where)
    arrays = _placed(batch_shapes(config, p.rag_cfg, batch), sharding.batch_sharded(mesh))
    retrieval, shard = None, 0
    if in_step:
        ix = p.index
        device_index = DeviceIndex.abstract(ix["rows"], ix["dim"], jnp.dtype(ix["dtype"]), mesh)
        questions = {k: v for k, v in arrays.items() if k.startswith("question_")}
        retrieval = (device_index, questions)
        shard = sharding.per_device_bytes(device_index.vectors)
    row = {
        "program": "train",
        "batch": batch,
        "per_chip_batch": batch // t.chips,
        "index": "in step" if in_step else "host",
        "remat": config.model.remat,
        "param_sharding": config.train.param_sharding,
        "arguments": {  # per chip, known before compiling
            "parameters": sharding.per_device_bytes(state.params),
            "optimizer state": sharding.per_device_bytes(state.opt_state),
            "index shard": shard,
            "batch": sharding.per_device_bytes((arrays, retrieval[1] if in_step else None)),
        },
        "parameters_by_tower": _by_tower(state.params),
    }
    with _kernel_mesh(config, mesh):
        compiled, result = _compile(lambda: step_fn.lower(state, arrays, retrieval))
    row.update(result)
    if compiled is None:
        return row
    memory = sharding.compiled_memory(compiled, row["arguments"], rest="other arguments")
    row.update(memory=memory, fits=memory["total"] <= t.hbm_bytes)
    if not detail:
        return row
    row.update(_train_costs(p, t, config, _hlo(compiled, t, row, hlo_dir), row, state, in_step))
    return row


def _by_tower(params: dict) -> dict:
    """{tower: {"count": parameters, "bytes_per_chip": ...}} of a placed parameter tree: the
    split of the "parameters" argument."""
    return {
        k: {
            "count": sum(math.prod(x.shape) for x in jax.tree.leaves(v)),
            "bytes_per_chip": sharding.per_device_bytes(v),
        }
        for k, v in params.items()
    }


def _hlo(compiled, t: Target, row: dict, hlo_dir) -> tuple:
    """(compiled, its optimised HLO text), the text also saved gzipped in `hlo_dir`."""
    text = compiled.as_text()
    if hlo_dir is not None:
        keys = (t.name, row["program"], row.get("index", ""), f"B{row['batch']}",
                f"remat{int(row['remat'])}", row["param_sharding"])  # fmt: skip
        name = "_".join(re.sub(r"[^\w]+", "-", str(k)) for k in keys if k) + ".hlo.txt.gz"
        pathlib.Path(hlo_dir).mkdir(parents=True, exist_ok=True)
        with gzip.open(pathlib.Path(hlo_dir) / name, "wt", encoding="utf-8") as f:
            f.write(text)
    return compiled, text


def _train_costs(p: Plan, t: Target, config, compiled_text, row, state, in_step) -> dict:
    compiled, text = compiled_text
    q, g, n = p.rag_cfg.question_encoder, p.rag_cfg.generator, t.chips
    b = row["per_chip_batch"]
    shapes = dict(
        n_docs=p.rag_cfg.n_docs,
        question=config.data.question_length,
        context=p.rag_cfg.max_combined_length,
        target=config.data.answer_length,
    )
    model = step_flops(q, g, b, frozen=config.train.freeze, **shapes)
    analytic = {"model": model["train"], "recompute": model["recompute"], "search": 0.0}
    if in_step:  # the next batch's questions embedded, then scored against this chip's shard
        question_fwd = model["question_encoder"] / 3
        shard_rows = -(-p.index["rows"] // n)
        analytic["search"] = question_fwd + 2 * row["batch"] * p.index["dim"] * shard_rows
    executed = analytic["model"] + analytic["recompute"] + analytic["search"]
    traffic = hlo.traffic(text)
    # XLA's cost analysis counts a loop body once: the matmuls of the later iterations (of the
    # in-step search's blocks, of fsdp's windowed matmuls), read from the HLO, are left out.
    uncounted = traffic.matmul_flops - traffic.matmul_flops_loops_once
    as_counted = executed - uncounted
    xla = _costs(compiled)
    ratio = xla["flops"] / as_counted if as_counted else None
    flops = {
        "xla": xla["flops"],
        "analytic_as_xla_counts": as_counted,
        "xla_over_analytic": ratio,
        "executed": executed,
        **analytic,
        "loop_iterations_xla_leaves_out": uncounted,
        # An independent check of the analytic count: the compiled program's own matmuls.
        "hlo_matmuls": traffic.matmul_flops,
        "hlo_matmuls_over_executed": traffic.matmul_flops / executed if executed else None,
    }
    flops["agree_within_10pct"] = ratio is not None and abs(ratio - 1) <= 0.10
    if not flops["agree_within_10pct"]:
        flops["why"] = f"XLA counts {ratio:.2f}x the analytic matmul FLOPs: " + (
            "it also counts elementwise work (softmax, norms, dropout, the optimizer), "
            "which rivals the matmuls when they are small"
            if ratio > 1
            else "it counts a loop body once, and drops work whose result is unused"
        )
    trainable = sum(
        math.prod(x.shape) * 4
        for path, x in jax.tree_util.tree_leaves_with_path(state.params)
        if not re.search(config.train.freeze or "$^", "/".join(k.key for k in path))
    )
    collectives = dict(traffic.collectives, by_dtype=traffic.collective_dtypes)
    sync = collectives.get("all-reduce", 0.0) + collectives.get("reduce-scatter", 0.0)
    collectives.update(gradient_sync_bytes=sync, trainable_f32_bytes=trainable)
    params, opt = row["memory"]["parameters"], row["memory"]["optimizer state"]
    # What must cross HBM at least once per step for arrays too large to stay on chip (VMEM is
    # tens of MiB): the sizes of the arguments, of the collectives' results as compiled, and of
    # the residuals of `jax.vjp` (the activations the backward pass reads).
    lower = {
        "parameters read": params,
        "parameters written": params * trainable / max(sharding.tree_bytes(state.params), 1),
        "optimizer state read and written": 2 * opt,
        "gradients written and read (as summed)": 2 * sync,
        "gathered parameters written and read (fsdp)": 2 * collectives.get("all-gather", 0.0),
        "activations saved for the backward pass, written and read": 2
        * _residual_bytes(p, config, b),
        "batch read": row["memory"]["batch"],
        "index shard read": row["memory"]["index shard"],
    }
    lower["total"] = sum(lower.values())
    bytes_ = {
        "xla_bytes_accessed": xla["bytes"],
        "hbm_at_fusion_boundaries": traffic.hbm_bytes,
        "hbm_by_scope": traffic.by_scope,
        "hbm_by_part": traffic.by_part,
        "hbm_lower_bound": lower,
    }
    roofline = _roofline(executed, traffic.hbm_bytes, analytic["model"], t)
    roofline["with_lower_bound_bytes_s"] = _roofline(executed, lower["total"], 0, t)["step_s"]
    roofline["with_xla_bytes_s"] = _roofline(executed, xla["bytes"], 0, t)["step_s"]
    return {
        "shapes": shapes,  # per row: N docs, Q question, S context, T target tokens
        "flops": flops,
        "bytes": bytes_,
        "roofline": roofline,
        "collectives": collectives,
        "host_transfers": traffic.host_transfers,
        "loops": traffic.loops,
    }


def generate_row(p: Plan, t: Target, batch: int, variant: str, num_beams: int,
                 hlo_dir=None) -> dict:  # fmt: skip
    """Compiles the evaluation's generation for `batch` questions on `t` (`eval.n_docs`
    passages each, `num_beams` beams) and reports its memory and XLA's costs."""
    check_batch(batch, t, "config.eval.batch_size")
    config, mesh = p.config, t.mesh
    rag_cfg = evaluation.eval_rag_config(p.rag_cfg, config)
    rag_cfg = rag_cfg.replace(
        generation=dataclasses.replace(rag_cfg.generation, num_beams=num_beams)
    )
    fn = evaluation.generate_fn(rag_cfg, variant, "thorough")
    # The towers generation reads (the passage encoder's would be dropped from the program).
    params = {k: p.params[k] for k in GENERATION_PARAMS}
    params = jax.tree.map(
        _struct, params, sharding.param_sharding(mesh, params, config.train.param_sharding)
    )
    n, q, s = rag_cfg.n_docs, config.data.question_length, rag_cfg.max_combined_length
    d = rag_cfg.question_encoder.embedding_dim
    rows = sharding.batch_sharded(mesh)
    inputs = [
        jax.ShapeDtypeStruct((batch, q), jnp.int32, sharding=rows),
        jax.ShapeDtypeStruct((batch, q), jnp.int32, sharding=rows),
        jax.ShapeDtypeStruct((batch, n, d), jnp.float32, sharding=rows),
        jax.ShapeDtypeStruct((batch, n, s), jnp.int32, sharding=rows),
        jax.ShapeDtypeStruct((batch, n, s), jnp.int32, sharding=rows),
    ]
    row = {
        "program": f"generate {variant}",
        "batch": batch,
        "per_chip_batch": batch // t.chips,
        "n_docs": n,
        "num_beams": num_beams,
        "max_length": rag_cfg.generation.max_length,
        "remat": config.model.remat,
        "param_sharding": config.train.param_sharding,
        "arguments": {
            "parameters": sharding.per_device_bytes(params),
            "batch": sharding.per_device_bytes(inputs),
        },
        "parameters_by_tower": _by_tower(params),
    }
    with _kernel_mesh(config, mesh):
        compiled, result = _compile(lambda: fn.lower(params, *inputs))
    row.update(result)
    if compiled is None:
        return row
    memory = sharding.compiled_memory(compiled, row["arguments"], rest="other arguments")
    traffic = hlo.traffic(_hlo(compiled, t, row, hlo_dir)[1])
    row.update(
        memory=memory,
        fits=memory["total"] <= t.hbm_bytes,
        xla=_costs(compiled),  # loop bodies counted once: per decoding step, not per call
        hbm_at_fusion_boundaries=traffic.hbm_bytes,  # loops counted as often as they run
        loops=traffic.loops,
        host_transfers=traffic.host_transfers,
    )
    return row


# ---------------------------------------------------------------------------------------------
# The largest batch


def _needed(row: dict) -> int | None:
    return row["memory"]["total"] if "memory" in row else row.get("needed_bytes")


def largest_batch(measure, chips: int, hbm: int, probes: tuple[int, int], max_tries: int = 4):
    """The largest global batch (a multiple of `chips`) whose program fits in `hbm` per chip.

    Memory is close to linear in the batch: the two measured batches nearest the limit give
    fixed + per-example bytes, which predict the largest batch; it is compiled, and so is the
    next multiple of `chips`, until a batch that fits sits next to one that does not (at most
    `max_tries` compiles after the `probes`; `proved` says whether that was reached).

    Args:
      measure: `measure(batch) -> row` (`train_row` / `generate_row`); a row has "fits" and the
        memory needed ("memory"["total"], or "needed_bytes" when the compiler refused it).

    Returns:
      {"batch", "per_chip", "proved", "bytes_per_example", "fixed_bytes", "rows"}, "batch" None
      when not even `chips` examples fit.
    """
    rows = {b: measure(b) for b in sorted(set(probes))}
    model = {}

    def bounds():
        fit = [b for b, r in rows.items() if r["fits"]]
        lo = max(fit, default=0)
        return lo, min((b for b, r in rows.items() if not r["fits"] and b > lo), default=None)

    def predict():
        points = sorted((b, _needed(r)) for b, r in rows.items() if _needed(r))
        under = [pt for pt in points if pt[1] <= hbm]
        over = [pt for pt in points if pt[1] > hbm]
        pair = (under[-1], over[0]) if under and over else tuple(points[-2:])
        if len(pair) < 2 or pair[1][0] == pair[0][0]:
            return None
        (b1, m1), (b2, m2) = pair
        slope = (m2 - m1) / (b2 - b1)  # bytes per chip per global example
        if slope <= 0:
            return None
        model.update(bytes_per_example=slope * chips, fixed_bytes=m1 - slope * b1)
        return int((hbm - m1) / slope + b1) // chips * chips

    for _ in range(max_tries):
        lo, hi = bounds()
        if hi is not None and hi - lo <= chips:
            break
        guess = predict()
        if guess is None or guess <= lo:
            guess = lo + chips if hi is not None or guess is not None else max(2 * lo, chips)
        if hi is not None and guess >= hi:
            guess = hi - chips
        if guess in rows:
            break
        rows[guess] = measure(guess)
    lo, hi = bounds()
    return {"batch": lo or None, "per_chip": (lo // chips) if lo else None,
            "proved": hi is not None and hi - lo <= chips, **model,
            "rows": [_brief(rows[b]) for b in sorted(rows)]}  # fmt: skip


def _brief(row: dict) -> dict:
    return {
        "batch": row["batch"],
        "fits": row["fits"],
        "needed_bytes": _needed(row),
        "compile_s": round(row["compile_s"], 1),
    }


# ---------------------------------------------------------------------------------------------
# Advice for a program that does not fit


def advice(row: dict, t: Target, others: list[dict]) -> dict:
    """For a program that does not fit: which part is over, by how much, and what would fit
    (another setting, a smaller batch, more chips), from this row and `others` (the same program
    compiled in other settings)."""
    need, hbm, args = _needed(row), t.hbm_bytes, row["arguments"]
    parts = {k: v for k, v in row.get("memory", args).items() if k != "total"}
    fixed = sum(v for k, v in args.items() if k != "batch")  # independent of the batch
    out = {"needed_bytes": need, "hbm_bytes": hbm, "over_by_bytes": need - hbm,
           "largest_part": max(parts, key=parts.get), "batch_independent_bytes": fixed,
           "fits_with": []}  # fmt: skip
    keys = ("remat", "param_sharding", "index")
    for other in [*others, row]:
        changed = {k: other[k] for k in keys if k in other and other[k] != row.get(k)}
        if other.get("fits") and other is not row:
            out["fits_with"].append({**changed, "batch": other["batch"]})
        if (other.get("largest") or {}).get("batch"):
            out["fits_with"].append({**changed, "batch": other["largest"]["batch"]})
    if fixed >= hbm:  # no batch fits: what does not shrink with the batch must split
        split = args.get("index shard", 0)
        if row.get("param_sharding") == "fsdp":
            split += args["parameters"] + args.get("optimizer state", 0)
        room = hbm - (fixed - split)  # the rest of the fixed parts stay whole on every chip
        if room > 0 and split:
            out["chips_needed_at_least"] = math.ceil(split * t.chips / room)
        out["why"] = (
            f"the parts independent of the batch need {sharding.human_bytes(fixed)} ("
            + ", ".join(f"{k} {sharding.human_bytes(v)}" for k, v in args.items() if k != "batch")
            + f"), more than the {sharding.human_bytes(hbm)} of HBM per chip"
        )
    return out


# ---------------------------------------------------------------------------------------------
# The report


def _settings(config, remat: bool, layout: str) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict(config.to_dict())
    config.model.remat, config.train.param_sharding = remat, layout
    return config


def _line(row: dict) -> str:
    """One line per compile for the log."""
    what = f"{row['program']:<20} B={row['batch']:<5} b={row['per_chip_batch']:<4}"
    what += f" {row.get('index', ''):<7} remat={int(row['remat'])} {row['param_sharding']:<10}"
    need = _needed(row)
    fits = "fits" if row["fits"] else "DOES NOT FIT"
    text = f"{what} {sharding.human_bytes(need):>10}/chip {fits:<12} ({row['compile_s']:.0f} s)"
    if "roofline" in row:
        roof = row["roofline"]
        text += f" roofline {roof['step_s'] * 1e3:.3g} ms ({roof['bound']}-bound)"
    if "largest" in row and row["largest"]["batch"]:
        text += f"; largest B={row['largest']['batch']}"
    return text


def run(config, topology: str, *, layouts, remats, paths, largest: bool, generate: bool,
        report=lambda out: None, log=print, hlo_dir=None,
        largest_tries: int = 3) -> dict:  # fmt: skip
    """Compiles `config`'s train step (and generation) for `topology` in every combination of
    `layouts` (param_sharding), `remats` and `paths` ("host", "in_step") asked for; with
    `largest`, also finds the largest batch of each (`largest_tries` compiles after the two
    probes; fewer leave the boundary unproved). `report(out)` is called after each compile
    (so a long run keeps what it measured)."""
    t = target(topology)
    check_batch(config.train.batch_size, t, "config.train.batch_size")
    if generate:
        check_batch(config.eval.batch_size, t, "config.eval.batch_size")
    out = {"target": t.describe(), "train": [], "generate": []}
    log(f"{t.name}: {t.chips} x {t.kind} on {t.hosts} host(s), "
        f"{sharding.human_bytes(t.hbm_bytes)} HBM per chip for one program")  # fmt: skip
    plans = {}
    for remat in remats:
        for layout in layouts:
            p = plans[remat, layout] = plan(_settings(config, remat, layout))
            out.setdefault("models", {**p.sources, "index": p.index})
            for path in paths:
                in_step = path == "in_step"
                batch = config.train.batch_size
                row = train_row(p, t, batch, in_step, hlo_dir=hlo_dir)
                out["train"].append(row)
                log(_line(row))
                report(out)  # kept should the largest-batch search be stopped
                if largest:
                    known = {batch: row}
                    other = (
                        batch * 2 if row["fits"] else max(batch // 2 // t.chips * t.chips, t.chips)
                    )

                    def measure(b, p=p, in_step=in_step, known=known):
                        return known.get(b) or train_row(p, t, b, in_step, detail=False)

                    row["largest"] = largest_batch(
                        measure, t.chips, t.hbm_bytes, (batch, other), largest_tries
                    )
                log(_line(row))
                report(out)
    for row in out["train"]:
        if not row["fits"]:
            same = [r for r in out["train"] if r.get("index") == row.get("index")]
            row["advice"] = advice(row, t, same)
    if generate:
        remat, layout = remats[0], layouts[0]
        p = plans[remat, layout]
        for variant in ("token", "sequence"):
            row = generate_row(p, t, config.eval.batch_size, variant, 4, hlo_dir=hlo_dir)
            if largest:
                batch = config.eval.batch_size
                other = batch * 2 if row["fits"] else max(batch // 2 // t.chips * t.chips, t.chips)
                known = {batch: row}

                def measure(b, variant=variant, known=known):
                    return known.get(b) or generate_row(p, t, b, variant, num_beams=4)

                row["largest"] = largest_batch(
                    measure, t.chips, t.hbm_bytes, (batch, other), largest_tries
                )
            if not row["fits"]:
                row["advice"] = advice(row, t, out["generate"])
            out["generate"].append(row)
            log(_line(row))
            report(out)
    return out
