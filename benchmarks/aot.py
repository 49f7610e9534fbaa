"""Ahead-of-time compilation of the trainer's programs for a Cloud TPU topology, on a CPU host.

With `libtpu` installed (`pip install 'rag_jax[tpu]'`), `jax.experimental.topologies` describes
the devices of a TPU slice that is not there (`benchmarks.tpu_topology`); a `Mesh` over them
lowers and compiles the real programs, and the compiled executables report XLA's own memory and
cost analyses. Nothing runs: the parameters, the index and the batches are shapes
(`jax.ShapeDtypeStruct`), placed as the trainer places them.

The programs are the trainer's own: the models of `model_setup.model_shapes` (the config's
architectures, dtypes, remat), the optimizer of `training.optim.make_optimizer` (its freeze mask
included), the state placement of `training.loop.state_sharding` (`train.param_sharding`), the
step of `training.loop.make_step_fn` with the widest batch `training.batcher.batch_shapes`, and,
for the in-step search, a `DeviceIndex` of the config's planned size (`retrieval.index_rows`,
`retrieval.index_dtype`, or the index folder's manifest); generation is the evaluation's jitted
call (`evaluation.generate_fn`). For each program the report gives, per chip:

- memory: the arguments (parameters, optimizer state, index shard, batch, the rest), outputs
  that do not reuse a donated buffer, temporaries and code, summing to the total; against the
  HBM the TPU compiler has (probed: it refuses a larger program and names its capacity);
- FLOPs: XLA's count against the analytic count of `benchmarks.flops` (`train_flops`, or
  `causal_train_flops` for a causal (Llama) generator; rematerialised layers and the in-step
  search added, loop bodies counted once as XLA does), and the matmul FLOPs of the compiled
  program itself with every loop iteration (`benchmarks.hlo`);
- bytes: XLA's "bytes accessed", the HBM traffic of the compiled program at fusion boundaries
  (`benchmarks.hlo.traffic`; by part of the model, and what lies outside the differentiated
  function split into the optimizer update, gradient norms, casts, collectives and copies) and
  a lower bound from what must cross HBM once: parameters read
  and written, optimizer state read and written, gradients written and read, the activations the
  backward pass reads (the residuals of `jax.vjp`), the batch and the index shard;
- a roofline step time, max(FLOPs / peak, HBM bytes / bandwidth) with the `PEAKS` of
  `benchmarks.flops`, and the model-FLOPs utilisation it caps;
- the collectives (the gradient all-reduce, or the fsdp reduce-scatter and all-gathers) and any
  host transfer in the program;
- the largest global batch that fits, from a linear model of memory in the batch fitted to two
  compiles and verified by compiling it and the next multiple of the chip count, and for a
  program that does not fit, what would (`benchmarks.hbm_fit`).

Legend: B global batch, b per chip, N docs, S context length, T target length, Q question
length, C index rows, D vector width, n chips, P parameters.
"""

import dataclasses
import gzip
import math
import pathlib
import re
import time

import jax
import jax.numpy as jnp
import ml_collections

from benchmarks import hlo
from benchmarks.flops import step_flops
from benchmarks.hbm_fit import advice, largest_batch, needed_bytes
from benchmarks.tpu_topology import PlanError, Target, out_of_memory, target
from rag_jax.devices import device_memory, sharding
from rag_jax.models import flash
from rag_jax.retrieval import index_format
from rag_jax.retrieval.device_index import DeviceIndex
from rag_jax.run import model_setup, synthetic, validation
from rag_jax.training import evaluation, loop
from rag_jax.training.batcher import batch_shapes
from rag_jax.training.optim import make_optimizer
from rag_jax.training.step import joint_loss_fn

GENERATION_PARAMS = ("question_encoder", "generator")


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
        validation.validate(config, 1, paths=False)
        rag_cfg, passage_cfg, params, sources = model_setup.model_shapes(config)
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
    if folder is not None and (folder / index_format.MANIFEST).is_file():
        manifest = index_format.read_manifest(str(folder), None, kinds=("exact", "scann"))
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
        rows = len(synthetic.world_of(config).passages)
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
        return device_memory.tree_bytes(saved)

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
        device_index = DeviceIndex.abstract(
            ix["rows"],
            ix["dim"],
            jnp.dtype(ix["dtype"]),
            mesh,
            storage=config.retrieval.device_storage,
        )
        questions = {k: v for k, v in arrays.items() if k.startswith("question_")}
        retrieval = (device_index, questions)
        shard = sum(map(device_memory.per_device_bytes, jax.tree.leaves(device_index)))
    row = {
        "program": "train",
        "batch": batch,
        "per_chip_batch": batch // t.chips,
        "index": "in step" if in_step else "host",
        "remat": config.model.remat,
        "remat_policy": config.model.remat_policy,
        "param_sharding": config.train.param_sharding,
        "attention_impl": config.model.attention_impl,
        "optimizer_impl": config.train.optimizer_impl,
        "arguments": {  # per chip, known before compiling
            "parameters": device_memory.per_device_bytes(state.params),
            "optimizer state": device_memory.per_device_bytes(state.opt_state),
            "index shard": shard,
            "batch": device_memory.per_device_bytes((arrays, retrieval[1] if in_step else None)),
        },
        "parameters_by_tower": _by_tower(state.params),
    }
    with _kernel_mesh(config, mesh):
        compiled, result = _compile(lambda: step_fn.lower(state, arrays, retrieval))
    row.update(result)
    if compiled is None:
        return row
    memory = device_memory.compiled_memory(compiled, row["arguments"], rest="other arguments")
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
            "bytes_per_chip": device_memory.per_device_bytes(v),
        }
        for k, v in params.items()
    }


def _hlo(compiled, t: Target, row: dict, hlo_dir) -> tuple:
    """(compiled, its optimised HLO text), the text also saved gzipped in `hlo_dir`."""
    text = compiled.as_text()
    if hlo_dir is not None:
        keys = (t.name, row["program"], row.get("index", ""), f"B{row['batch']}",
                f"remat{int(row['remat'])}", row.get("remat_policy", "full"),
                row["param_sharding"])  # fmt: skip
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
        "parameters written": params * trainable / max(device_memory.tree_bytes(state.params), 1),
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
        # its "optimizer and the rest" by what the instructions do (`hlo._outside_part`)
        "hbm_optimizer_and_the_rest": traffic.outside_by_kind,
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
            "parameters": device_memory.per_device_bytes(params),
            "batch": device_memory.per_device_bytes(inputs),
        },
        "parameters_by_tower": _by_tower(params),
    }
    with _kernel_mesh(config, mesh):
        compiled, result = _compile(lambda: fn.lower(params, *inputs))
    row.update(result)
    if compiled is None:
        return row
    memory = device_memory.compiled_memory(compiled, row["arguments"], rest="other arguments")
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
# The report


def _settings(config, remat: bool, layout: str) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict(config.to_dict())
    config.model.remat, config.train.param_sharding = remat, layout
    return config


def _line(row: dict) -> str:
    """One line per compile for the log."""
    what = f"{row['program']:<20} B={row['batch']:<5} b={row['per_chip_batch']:<4}"
    what += f" {row.get('index', ''):<7} remat={int(row['remat'])} {row['param_sharding']:<10}"
    need = needed_bytes(row)
    fits = "fits" if row["fits"] else "DOES NOT FIT"
    text = f"{what} {device_memory.human_bytes(need):>10}/chip {fits:<12}"
    text += f" ({row['compile_s']:.0f} s)"
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
        f"{device_memory.human_bytes(t.hbm_bytes)} HBM per chip for one program")  # fmt: skip
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
                    log(_line(row))  # the row again, with its largest batch
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
