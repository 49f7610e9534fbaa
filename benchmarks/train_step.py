"""Suite `train_step`: one RAG training step, rag_jax (jitted) vs transformers PyTorch (eager).

A step is what joint RAG training does per batch once the passages are retrieved: the question
encoder embeds the questions, the doc scores are the dot products with the retrieved passages'
stored vectors (so the gradient reaches the question encoder), the generator reads the N contexts,
the RAG-Sequence or RAG-Token loss is averaged over the batch, backpropagated, and AdamW updates
every parameter. rag_jax: the trainer's own step (`training.step.make_train_step`, one `jax.jit`
with the state donated) and optimizer (`training.optim.make_optimizer`, set as torch's AdamW
runs). Reference: HF `Rag*ForGeneration` forward with `doc_scores` computed from its own question
encoder (`torch.bmm`, as `RagModel` does), `loss.backward()`, `torch.optim.AdamW`.

Same configs, same weights (the HF model is saved and loaded with `hf.load_rag`), same inputs, same
AdamW hyperparameters, float32, dropout off on both sides, the benchmark's threads. After warm-up
(compilation for rag_jax; torch's allocator and kernel selection settle within 3-5 steps here) the
two sides alternate single steps, so load from other processes hits them alike, each after a
pause (`common.settle`) in which the other side's threads stop spinning. `speedup` is the
ratio of medians; `speedup_min` the ratio of the fastest steps, which is what to read on a busy
machine: torch's two OpenMP threads slow down ~10x whenever another process takes a core (its
workers wait at every op's barrier), far more than XLA's pool, so medians there favour rag_jax.
The first step of each side starts from the same weights: its loss is reported for both as a
check that they compute the same thing.

Roofline: the suite first measures this machine's float32 matmul peak on the same threads (a
2048^2 product, the faster of XLA and torch), then reports each side's model FLOP rate (matmul
FLOPs of forward and backward, `flops.train_flops`, over the fastest step) as a share of it,
and `goal_pct_of_peak`: the share a step meeting the goal (GOALS x the reference's fastest) would
have to sustain. Over 100% the goal is out of reach on this machine for any implementation.

Floor: a sharper bound from the step itself (`bench/floor.py`): every matmul of rag_jax's step,
each timed alone at its own shape by the fastest kernel at hand (XLA's or torch's), plus one AdamW
update alone, everything else free. `goal_ms` (the reference's fastest step over the goal) below
`floor_ms` means no implementation of the same arithmetic reaches the goal on this machine.

Legend: B questions, N docs, S context length, T target length, Q question length.
"""

import gc
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from benchmarks import common
from benchmarks import floor as step_floor
from benchmarks.flops import train_flops
from rag_jax import rag
from rag_jax.io import hf
from rag_jax.training.optim import make_optimizer, settings_for
from rag_jax.training.step import init_state, make_train_step

N_DOCS, CONTEXT, TARGET, QUESTION = 5, 128, 32, 16
# AdamW as both libraries spell it (torch's defaults; optax's weight decay default differs).
LEARNING_RATE, BETAS, EPS, WEIGHT_DECAY = 1e-4, (0.9, 0.999), 1e-8, 0.01
ADAMW = dict(lr=LEARNING_RATE, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)

# name -> (HF BertConfig kwargs for the DPR question encoder, HF BartConfig kwargs). The tiny
# models are initialised with a larger std than HF's 0.02: at width 64 that would leave the output
# distribution nearly uniform, and the loss check below would then hold for any model.
CONFIGS = {
    "tiny": (
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=256,
            initializer_range=0.2,
        ),
        dict(
            init_std=0.2,
            d_model=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=256,
            decoder_ffn_dim=256,
            vocab_size=1000,
        ),
    ),
    "base": (
        dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
        dict(
            d_model=768,
            encoder_layers=6,
            decoder_layers=6,
            encoder_attention_heads=12,
            decoder_attention_heads=12,
            encoder_ffn_dim=3072,
            decoder_ffn_dim=3072,
            vocab_size=50265,
        ),
    ),
}
# name -> (B, timed steps per side, torch warm-up steps); base steps take seconds, so a smaller
# batch, fewer steps, and fewer warm-up steps (their allocations are large enough to be reused
# from the second step on).
CASES = {"tiny": (8, 20, 5), "base": (2, 3, 3)}
QUICK_CASES = {"tiny": (2, 3, 5)}
GOALS = {"tiny": 2.0, "base": 1.2}  # the speedups over the reference this suite is held to


def hf_rag_config(name: str, n_docs: int = N_DOCS) -> transformers.RagConfig:
    """An HF RAG config (DPR question encoder + BART generator) of size `name`, dropout off."""
    bert_kwargs, bart_kwargs = CONFIGS[name]
    question = transformers.DPRConfig(
        **bert_kwargs, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    generator = transformers.BartConfig(
        **bart_kwargs, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0
    )
    return transformers.RagConfig.from_question_encoder_generator_configs(
        question, generator, n_docs=n_docs
    )


def save_hf_rag(name: str, path: str, seed: int = 0, n_docs: int = N_DOCS):
    """Writes a randomly initialised HF RAG-Sequence checkpoint; RAG-Token loads the same file."""
    torch.manual_seed(seed)
    transformers.RagSequenceForGeneration(hf_rag_config(name, n_docs)).save_pretrained(path)


def make_batch(cfg: rag.RagConfig, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Questions, retrieved passages' vectors, padded contexts and padded labels."""
    rng = np.random.default_rng(seed)
    g_vocab, q_vocab = cfg.generator.vocab_size, cfg.question_encoder.vocab_size
    rows = batch * N_DOCS

    def padded(count, width, low, vocab, pad, min_len):
        ids = rng.integers(low, vocab, size=(count, width))
        lengths = rng.integers(min_len, width + 1, count)
        mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)
        return np.where(mask == 1, ids, pad), mask

    q_ids, q_mask = padded(batch, QUESTION, 3, q_vocab, 0, QUESTION // 2)
    ctx, ctx_mask = padded(rows, CONTEXT, 3, g_vocab, cfg.pad_token_id, CONTEXT // 2)
    labels, _ = padded(batch, TARGET, 3, g_vocab, cfg.pad_token_id, TARGET // 2)
    labels[:, 0] = cfg.generator.decoder_start_token_id
    labels[:, 1] = cfg.bos_token_id
    width = cfg.question_encoder.embedding_dim
    return {
        "question_input_ids": q_ids,
        "question_attention_mask": q_mask,
        "doc_vectors": rng.normal(size=(batch, N_DOCS, width)).astype(np.float32),
        "context_input_ids": ctx,
        "context_attention_mask": ctx_mask,
        "labels": labels,
    }


def optimizer():
    """The trainer's optimizer (`training.optim.make_optimizer`) set as `torch.optim.AdamW` runs
    here: a constant rate, weight decay on every parameter, no clipping; BART's
    `final_logits_bias` frozen, a buffer in the reference."""
    return make_optimizer(
        settings_for(
            learning_rate=LEARNING_RATE,
            warmup_steps=0,
            decay="constant",
            adam_b1=BETAS[0],
            adam_b2=BETAS[1],
            adam_eps=EPS,
            weight_decay=WEIGHT_DECAY,
            no_decay="",
            grad_clip=0.0,
            retriever_lr_factor=1.0,
            freeze=r"^generator/final_logits_bias",
        )
    )


def _jax_train_step(cfg, variant):
    """(The trainer's jitted step `(state, batch) -> (state, metrics)`, `make_train_step`, its
    optimizer)."""
    tx = optimizer()
    return make_train_step(cfg, variant, tx, jax.random.PRNGKey(0), True), tx


def _jax_step_fn(cfg, params, batch, variant):
    """A no-argument closure running one donated, jitted step; returns the step's loss."""
    step, tx = _jax_train_step(cfg, variant)
    # Copies: the donated buffers must not alias arrays the caller keeps.
    state = {"state": init_state(jax.tree.map(jnp.array, params), tx)}
    batch = {k: jnp.asarray(v) for k, v in batch.items()}

    def run():
        state["state"], metrics = step(state["state"], batch)
        total, count = metrics["loss"]
        return float(total / count)  # blocks until the step (and the update it depends on) is done

    return run


def _torch_step_fn(model, batch):
    """A no-argument closure running one eager step; returns the step's loss."""
    model.train()  # dropout is 0: train mode only keeps autograd's bookkeeping
    opt = torch.optim.AdamW(
        model.parameters(), lr=LEARNING_RATE, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY
    )
    t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch.items()}

    def run():
        opt.zero_grad(set_to_none=True)
        q = model.rag.question_encoder(
            t["question_input_ids"], attention_mask=t["question_attention_mask"]
        )[0]
        doc_scores = torch.bmm(q.unsqueeze(1), t["doc_vectors"].transpose(1, 2)).squeeze(1)
        out = model(
            context_input_ids=t["context_input_ids"],
            context_attention_mask=t["context_attention_mask"],
            doc_scores=doc_scores,
            labels=t["labels"],
            reduce_loss=False,
        )
        loss = out.loss.mean()
        loss.backward()
        opt.step()
        return float(loss.detach())

    return run


def _compare(ours_fn, ref_fn, repeats: int, warmup: int) -> dict:
    """Side-by-side timings plus both sides' first losses."""
    timings, ours_loss, ref_loss = common.compare(ours_fn, ref_fn, repeats=repeats, warmup=warmup)
    return {
        **timings,
        "loss_ours": ours_loss,
        "loss_ref": ref_loss,
        "loss_rel_diff": abs(ours_loss - ref_loss) / abs(ref_loss),
    }


def _params_count(params) -> int:
    return sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))


def step_flops(
    cfg: rag.RagConfig, batch: int, context: int = CONTEXT, target: int = TARGET
) -> float:
    """Model FLOPs of one train step at this suite's shapes (`flops.train_flops`)."""
    return train_flops(
        cfg.question_encoder,
        cfg.generator,
        batch,
        n_docs=N_DOCS,
        question=QUESTION,
        context=context,
        target=target,
    )["train"]


def _roofline(cfg: rag.RagConfig, name: str, batch: int, result: dict, peak: float) -> dict:
    """Model FLOP rates of both sides' fastest steps, and what the goal would need.

    `goal_pct_of_peak` is the share of this machine's measured matmul peak that a step `goal`
    times faster than the reference's fastest would have to sustain: over 100 the goal is out of
    reach on this machine whatever the implementation.
    """
    flops = step_flops(cfg, batch)
    ours = flops / min(result["ours_runs_s"]) / 1e9
    ref = flops / min(result["ref_runs_s"]) / 1e9
    return {
        "model_gflop": flops / 1e9,
        "ours_gflop_s": ours,
        "ref_gflop_s": ref,
        "ours_pct_of_peak": 100 * ours / peak,
        "ref_pct_of_peak": 100 * ref / peak,
        "goal": GOALS[name],
        "goal_pct_of_peak": 100 * GOALS[name] * ref / peak,
    }


def floor(cfg: rag.RagConfig, params, batch: dict, variant: str, name: str, ref_min_s: float):
    """The step's floor on this machine (`floor.step_floor`) against the goal's step time."""
    train_step, tx = _jax_train_step(cfg, variant)
    state = jax.eval_shape(lambda: init_state(params, tx))  # tracing needs its shapes only
    out = step_floor.step_floor(train_step, (state, batch), params, ADAMW)
    return {
        "goal_ms": 1e3 * ref_min_s / GOALS[name],
        "floor_ms": out["ms"],
        "matmul_floor_ms": out["matmuls"]["ms"],
        "xla_matmul_floor_ms": out["matmuls"]["xla_ms"],
        "adamw_floor_ms": out["adamw"]["ms"],
        "floor": out,
    }


def run(quick: bool = False) -> dict:
    peak = common.matmul_peak(512 if quick else 2048)
    print(
        f"  float32 matmul peak ({peak['size']}^2): XLA {peak['xla_gflop_s']:.1f}, "
        f"torch {peak['torch_gflop_s']:.1f} GFLOP/s",
        flush=True,
    )
    rows = []
    for name, (batch_size, repeats, warmup) in (QUICK_CASES if quick else CASES).items():
        with tempfile.TemporaryDirectory() as tmp:
            save_hf_rag(name, tmp)
            cfg, params = hf.load_rag(tmp)
            batch = make_batch(cfg, batch_size)
            for variant, cls in (
                ("sequence", transformers.RagSequenceForGeneration),
                ("token", transformers.RagTokenForGeneration),
            ):
                model = cls.from_pretrained(tmp)
                result = _compare(
                    _jax_step_fn(cfg, params, batch, variant),
                    _torch_step_fn(model, batch),
                    repeats,
                    warmup,
                )
                rows.append(
                    {
                        "case": f"rag-{variant} {name} B={batch_size} N={N_DOCS} S={CONTEXT} "
                        f"T={TARGET}",
                        "params_M": _params_count(params) / 1e6,
                        **result,
                        "ours_ex_per_s": batch_size / result["ours_s"],
                        "ref_ex_per_s": batch_size / result["ref_s"],
                        **_roofline(cfg, name, batch_size, result, peak["peak_gflop_s"]),
                        **floor(cfg, params, batch, variant, name, min(result["ref_runs_s"])),
                    }
                )
                row = rows[-1]
                print(
                    f"  {row['case']}: ours {result['ours_s']:.4g}s, ref {result['ref_s']:.4g}s, "
                    f"x{result['speedup']:.3g}; the goal needs {row['goal_pct_of_peak']:.0f}% "
                    f"of the matmul peak, a {row['goal_ms']:.4g} ms step against a floor of "
                    f"{row['floor_ms']:.4g} ms (matmuls {row['matmul_floor_ms']:.4g}, AdamW "
                    f"{row['adamw_floor_ms']:.4g}; XLA's matmuls alone "
                    f"{row['xla_matmul_floor_ms']:.4g})",
                    flush=True,
                )
                del model
                gc.collect()
            del params
            gc.collect()
    return {
        "columns": [
            "case",
            "params_M",
            "ours_s",
            "ref_s",
            "speedup",
            "speedup_min",
            "ours_ex_per_s",
            "ref_ex_per_s",
            "ours_pct_of_peak",
            "ref_pct_of_peak",
            "goal_pct_of_peak",
            "goal_ms",
            "floor_ms",
            "compile_s",
            "loss_ours",
            "loss_ref",
            "loss_rel_diff",
        ],
        "rows": rows,
        "reference": f"transformers {transformers.__version__} PyTorch {torch.__version__} eager, "
        "torch.optim.AdamW",
        "ours": f"jax {jax.__version__}: the trainer's make_train_step (state donated) and "
        "make_optimizer (AdamW)",
        "threads": torch.get_num_threads(),
        "matmul_peak": peak,
        "backend": jax.default_backend(),
        "setup": {
            "n_docs": N_DOCS,
            "context_length": CONTEXT,
            "target_length": TARGET,
            "question_length": QUESTION,
            "adamw": ADAMW,
            "cases": {k: dict(zip(("B", "steps", "torch_warmup"), v)) for k, v in CASES.items()},
        },
    }
