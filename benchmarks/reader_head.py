r"""A causal reader trained in its top layers: the whole reader's train step against its head's
on cached trunk states (`training.reader_trunk`), side by side in one process.

    python -m benchmarks.reader_head                  # SmolLM2-135M's shape, random weights
    python -m benchmarks.reader_head --rows 8 --tokens 256 --first 20 --repeats 3
    python -m benchmarks.reader_head --quick          # a tiny reader: a smoke run

Both sides compute the gradient of the answers' token NLL (the scored positions of
`causal.label_mask`) with respect to the parameters that train: layers F .. L - 1 and the final
norm (the embedding, which SmolLM2 ties to its LM head, and layers 0 .. F - 1 are constants,
as `model.generator_trained_layers` with its `train.freeze` makes them). The whole reader
(`frozen_layers = F`) runs `causal.answer_logits` from the tokens: all L layers forward, the top
L - F backward. The head runs `causal.answer_logits_from_states` on the rows' trunk states,
built once here by `reader_trunk.open_or_build` and gathered as a batch would carry them: the top
L - F layers forward and backward. So the head's share is about 3 (L - F) / (L + 2 (L - F)) of
the whole reader's layer work (0.6 at L 30, F 20), less the embedding lookup, plus the LM head,
which both compute on the answer positions only.

Rows: B questions x N prompts of S = tokens - T prompt columns, each prompt 3/4 S to S real
tokens (left padding), T = 32 label columns (an answer, EOS, padding). Random weights (init std
0.02), float32, jitted; after the first call (compilation) and `warmup` more, the sides alternate
`repeats` single timed calls (`common.compare`). Reported: each side's median seconds, the ratio
head / whole, the loss and the largest gradient difference between them (the same computation),
the compiled programs' FLOP ratio (XLA's cost analysis: what the ratio of times tends to on an
unloaded machine), the trunk build's seconds, and the cache's size: bytes per row (real tokens
x H x 4) and the states file's size.
"""

import argparse
import os
import tempfile

import numpy as np

COLUMNS = [
    "layers",
    "first",
    "rows",
    "tokens",
    "whole_s",
    "head_s",
    "head_over_whole",
    "expected_ratio",
    "flops_ratio",
    "loss_diff",
    "grad_max_diff",
    "build_s",
    "cache_kb_per_row",
    "states_file_mb",
]
LABELS = 32  # T, label columns per row


def _setup(quick: bool, rows: int, tokens: int, first: int):
    """(rag config, generator parameters, ids [R, S], mask [R, S], labels [B, T])."""
    import jax

    from rag_jax import rag
    from rag_jax.models import bert, llama

    if quick:
        g_cfg = llama.LlamaConfig(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2,
        )  # fmt: skip
        rows, tokens, first = 4, 64, 2
    else:  # SmolLM2-135M's shape (the LlamaConfig defaults)
        g_cfg = llama.LlamaConfig()
    g_cfg = g_cfg.replace(frozen_layers=first)
    q_cfg = bert.BertConfig(
        vocab_size=17, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=8, max_position_embeddings=8,
    )  # fmt: skip
    batch = 2 if rows % 2 == 0 else 1
    cfg = rag.RagConfig(
        question_encoder=q_cfg, generator=g_cfg, n_docs=rows // batch, bos_token_id=None
    )
    params = llama.init_params(g_cfg, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    width = tokens - LABELS
    ids = np.zeros((rows, width), np.int32)
    mask = np.zeros((rows, width), np.int32)
    for row, length in enumerate(rng.integers(3 * width // 4, width + 1, size=rows)):
        ids[row, width - length :] = rng.integers(3, g_cfg.vocab_size, size=length)
        mask[row, width - length :] = 1
    labels = np.full((batch, LABELS), g_cfg.pad_token_id, np.int32)
    for b, length in enumerate(rng.integers(LABELS // 4, LABELS - 1, size=batch)):
        labels[b, :length] = rng.integers(3, g_cfg.vocab_size, size=length)
        labels[b, length] = g_cfg.eos_token_id
    return cfg, params, ids, mask, labels, first


def run(
    quick: bool = False,
    rows: int = 8,
    tokens: int = 256,
    first: int = 20,
    repeats: int = 3,
    warmup: int = 1,
) -> dict:
    import jax
    import jax.numpy as jnp

    from benchmarks import common
    from rag_jax import causal
    from rag_jax.training import reader_trunk

    cfg, params, ids, mask, labels, first = _setup(quick, rows, tokens, first)
    g_cfg, (rows, width) = cfg.generator, ids.shape
    trained = {k: v for k, v in params.items() if k not in reader_trunk.trunk_names(first)}
    constant = reader_trunk.trunk_of(params, first)
    flat_labels = jnp.repeat(jnp.asarray(labels), rows // labels.shape[0], axis=0)
    scored = causal.label_mask(flat_labels, g_cfg.eos_token_id, g_cfg.pad_token_id)

    def nll(logits):  # [R, T, V] -> the answers' summed token NLL
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.sum(jnp.take_along_axis(logp, flat_labels[..., None], -1)[..., 0] * scored)

    def whole(trained, constant, ids, mask, labels):
        p = {"generator": {**constant, **trained}}
        return nll(causal.answer_logits(cfg, p, ids, mask, labels))

    def head(trained, constant, states, state_mask):
        p = {"generator": {**constant, **trained}}
        return nll(causal.answer_logits_from_states(cfg, p, states, state_mask, LABELS, first))

    with tempfile.TemporaryDirectory() as root:
        cache_rows = [
            (ids[r][mask[r] == 1], labels[r // (rows // len(labels))]) for r in range(rows)
        ]
        build_s, trunk = common.timed(
            lambda: reader_trunk.open_or_build(root, g_cfg, params, first, cache_rows, "bench")
        )
        states, state_mask = trunk.gather(np.arange(rows), width)
        states_mb = os.path.getsize(trunk.directory / "states.f32") / 2**20
        kb_per_row = trunk.manifest["tokens"] * g_cfg.hidden_size * 4 / rows / 1024
    whole_fn = jax.jit(jax.value_and_grad(whole))
    head_fn = jax.jit(jax.value_and_grad(head))
    args = jax.device_put((ids, mask, labels))
    cached = jax.device_put((states, state_mask))
    timings, (head_loss, head_grads), (whole_loss, whole_grads) = common.compare(
        lambda: jax.block_until_ready(head_fn(trained, constant, *cached)),
        lambda: jax.block_until_ready(whole_fn(trained, constant, *args)),
        repeats=repeats,
        warmup=warmup,
    )
    flops = [
        fn.lower(trained, constant, *inputs).compile().cost_analysis()["flops"]
        for fn, inputs in ((head_fn, cached), (whole_fn, args))
    ]
    diffs = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), head_grads, whole_grads)
    layers, head_layers = g_cfg.num_hidden_layers, g_cfg.num_hidden_layers - first
    row = {
        "layers": layers,
        "first": first,
        "rows": rows,
        "tokens": width + LABELS,
        "whole_s": timings["ref_s"],
        "head_s": timings["ours_s"],
        "head_over_whole": timings["ours_s"] / timings["ref_s"],
        "expected_ratio": 3 * head_layers / (layers + 2 * head_layers),
        "flops_ratio": flops[0] / flops[1],
        "loss_diff": abs(float(head_loss) - float(whole_loss)),
        "grad_max_diff": max(jax.tree.leaves(diffs)),
        "build_s": build_s,
        "cache_kb_per_row": kb_per_row,
        "states_file_mb": states_mb,
    }
    return {"columns": COLUMNS, "rows": [row], "timings": timings}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny reader: a smoke run")
    parser.add_argument("--rows", type=int, default=8, help="B * N prompt rows a step")
    parser.add_argument("--tokens", type=int, default=256, help="columns a row (prompt + 32)")
    parser.add_argument("--first", type=int, default=20, help="F, the head's first layer")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per side")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls after compiling")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from benchmarks import common

    result = run(args.quick, args.rows, args.tokens, args.first, args.repeats, args.warmup)
    common.print_table(result["rows"], result["columns"])


if __name__ == "__main__":
    main()
