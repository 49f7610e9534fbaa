"""The analytic model the benchmarks measure against: the matmul FLOPs of one RAG training step,
and the peak FLOP/s and HBM bandwidth of the chips it runs on.

`train_flops` counts the step with a BART generator, `causal_train_flops` with a causal (Llama)
one, and `step_flops` picks by the generator's config; both counts are checked against the matmuls
in the jaxpr of the trainer's own loss and gradient (tests/benchmarks/accelerator_check_test.py,
causal_flops_test.py). `PEAKS` holds vendor figures per device kind (`device_peaks`): the MFU of
`benchmarks.accelerator` and `benchmarks.train_step` and the roofline of `benchmarks.aot` divide
by them.

Legend: B batch, N docs, S context length, T target length, Q question length, L = S + T (a
causal generator's row), h heads, d head width.
"""

import re

import jax

from rag_jax.models import bart, bert, llama

# device: (dense bf16 TFLOP/s, HBM GB/s, source), per chip. Matched against `device_kind` in
# order (first hit wins), lower-cased.
PEAKS = {
    "h200 nvl": (835.0, 4800.0, "NVIDIA H200 NVL datasheet"),
    "h200": (989.0, 4800.0, "NVIDIA H200 SXM datasheet"),
    "h100 nvl": (835.0, 3900.0, "NVIDIA H100 NVL datasheet"),
    "h100 pcie": (756.0, 2000.0, "NVIDIA H100 PCIe datasheet"),
    "h100": (989.0, 3350.0, "NVIDIA H100 SXM datasheet"),
    "a100-sxm4-80gb": (312.0, 2039.0, "NVIDIA A100 80GB SXM datasheet"),
    "a100-pcie-80gb": (312.0, 1935.0, "NVIDIA A100 80GB PCIe datasheet"),
    "a100": (312.0, 1555.0, "NVIDIA A100 40GB datasheet"),
    "v6 lite": (918.0, 1638.0, "cloud.google.com/tpu/docs/v6e"),
    "v6e": (918.0, 1638.0, "cloud.google.com/tpu/docs/v6e"),
    "v5 lite": (197.0, 819.0, "cloud.google.com/tpu/docs/v5e"),
    "v5e": (197.0, 819.0, "cloud.google.com/tpu/docs/v5e"),
    "v5p": (459.0, 2765.0, "cloud.google.com/tpu/docs/v5p"),
    "tpu v5": (459.0, 2765.0, "cloud.google.com/tpu/docs/v5p"),
    "tpu v4": (275.0, 1200.0, "cloud.google.com/tpu/docs/v4"),
}

# Which parts of a layer's forward pass each `remat_policy` (`rag_jax.models.remat`) runs again
# in the backward pass: "qkv" the query, key and value projections (cross-attention's keys and
# values of the encoder output included), "core" the attention's score and mixing products (or
# a kernel's forward pass), "out" the attention's output projection, "ffn_in" the feed-forward's
# hidden activations (BART `wi`, Llama `gate_proj` and `up_proj`), "ffn_out" its last matrix.
RECOMPUTED = {
    "full": ("qkv", "core", "out", "ffn_in", "ffn_out"),
    "attention": ("core", "out", "ffn_in", "ffn_out"),
    "projections": ("core", "ffn_in"),
    "attention_and_projections": ("core", "ffn_in"),
    "dots": ("core",),
}
# The share of the attention core that the policies keeping the attention's output ("attention",
# "attention_and_projections") run again, by attention_impl: the
# XLA path its scores (the mixing's output is saved), the flash kernel its forward pass (for its
# softmax statistics, which no policy can keep), the splash kernel nothing (its residuals kept),
# the inplace kernel nothing (its backward pass reads q, k, v and recomputes the rest itself).
ATTENTION_POLICY_CORE = {"xla": 0.5, "flash": 1.0, "splash": 0.0, "inplace": 0.0}


def _recomputed(parts: dict, cfg) -> float:
    """The FLOPs of `parts` ({part: FLOPs}) that `cfg`'s remat (and remat_policy) runs again."""
    if not cfg.remat:
        return 0
    share = dict.fromkeys(RECOMPUTED[cfg.remat_policy], 1.0)
    if cfg.remat_policy in ("attention", "attention_and_projections"):
        share["core"] = ATTENTION_POLICY_CORE[cfg.attention_impl]
    return sum(parts[k] * v for k, v in share.items())


def _encoder_layer_parts(tokens: int, length: int, hidden: int, ffn: int) -> dict:
    """{part: forward FLOPs} of a post-LN encoder layer over `tokens` tokens of rows of `length`."""
    return {
        "qkv": tokens * 2 * 3 * hidden * hidden,
        "core": tokens * 2 * 2 * length * hidden,
        "out": tokens * 2 * hidden * hidden,
        "ffn_in": tokens * 2 * hidden * ffn,
        "ffn_out": tokens * 2 * hidden * ffn,
    }


def device_peaks(kind: str, tflops: float | None = None, gbps: float | None = None) -> dict:
    """Peak bf16 FLOP/s and HBM bandwidth of one device of `kind`, overrides first."""
    known = next((v for k, v in PEAKS.items() if k in kind.lower()), None)
    source = "command line" if tflops or gbps else None
    if known:
        tflops, gbps = tflops or known[0], gbps or known[1]
        source = known[2] if source is None else f"{source}, else {known[2]}"
    return {"tflops": tflops, "gbps": gbps, "source": source}


def train_flops(q: bert.BertConfig, g: bart.BartConfig, batch: int, *, n_docs: int,
                question: int, context: int, target: int) -> dict:  # fmt: skip
    """Matmul FLOPs of one RAG training step, forward and backward (= 2x forward).

    Counts every matmul the step performs on the model's behalf, at 2 FLOPs per multiply-add:
    projections, feed-forward layers, attention scores and mixing (full, unmasked squares, as
    computed), BART's cross-attention keys/values of the encoder output (once per decoder layer),
    the tied output projection onto the vocabulary, and the doc scores q . d. Embedding lookups,
    norms, softmax, dropout and the optimizer are not model FLOPs.

    Returns:
      {"question_encoder", "generator", "doc_scores", "forward", "train"}: FLOPs; and
      "recompute": the forward FLOPs of the transformer layers that rematerialisation
      (`remat=True` in the model configs) executes a second time in the backward pass: with
      `remat_policy="full"` all of them (not the pooler/projection nor the vocabulary
      projection, which sit outside the layers), with another policy its `RECOMPUTED` parts.
    """
    h, f = q.hidden_size, q.intermediate_size
    tokens = batch * question
    per_token = 2 * (4 * h * h + 2 * h * f) + 2 * 2 * question * h
    question_fwd = tokens * q.num_hidden_layers * per_token
    if q.projection_dim:
        question_fwd += 2 * batch * h * q.projection_dim
    if q.with_pooler:
        question_fwd += 2 * batch * h * h

    d, fg, v = g.d_model, g.encoder_ffn_dim, g.vocab_size
    rows = batch * n_docs
    enc = rows * context * g.encoder_layers * (2 * (4 * d * d + 2 * d * fg) + 4 * context * d)
    dec_token = 2 * (4 * d * d + 2 * d * g.decoder_ffn_dim) + 4 * target * d  # self-attention
    dec_token += 2 * 2 * d * d + 4 * context * d  # cross-attention: q, out; scores, mixing
    dec = rows * target * g.decoder_layers * dec_token
    cross_kv = rows * context * g.decoder_layers * 2 * 2 * d * d
    lm_head = 2 * rows * target * d * v
    generator_fwd = enc + dec + cross_kv + lm_head

    scores = 2 * rows * q.embedding_dim
    forward = question_fwd + generator_fwd + scores
    question_parts = _encoder_layer_parts(tokens, question, h, f)
    question_recompute = q.num_hidden_layers * _recomputed(question_parts, q)
    enc_parts = _encoder_layer_parts(rows * context, context, d, fg)
    dec_tokens = rows * target
    dec_parts = {  # self-attention, cross-attention (q; keys/values of the encoder output), FFN
        "qkv": dec_tokens * 2 * 4 * d * d + rows * context * 2 * 2 * d * d,
        "core": dec_tokens * 4 * (target + context) * d,
        "out": dec_tokens * 2 * 2 * d * d,
        "ffn_in": dec_tokens * 2 * d * g.decoder_ffn_dim,
        "ffn_out": dec_tokens * 2 * d * g.decoder_ffn_dim,
    }
    generator_recompute = g.encoder_layers * _recomputed(enc_parts, g)
    generator_recompute += g.decoder_layers * _recomputed(dec_parts, g)
    return {
        "question_encoder": 3 * question_fwd,
        "generator": 3 * generator_fwd,
        "doc_scores": 3 * scores,
        "forward": forward,
        "train": 3 * forward,
        "recompute": question_recompute + generator_recompute,
    }


def causal_train_flops(q, g: llama.LlamaConfig, batch: int, *, n_docs: int, question: int,
                       context: int, target: int, frozen: str = "") -> dict:  # fmt: skip
    """Matmul FLOPs of one RAG training step whose generator is causal (`rag_jax.causal`), at 2
    FLOPs per multiply-add, with the keys of `train_flops`.

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
    tokens = rows * length
    # Remat recomputes what the backward pass reads, of what its policy does not save: never the
    # down projection ("ffn_out"), whose output only joins the residual stream (pre-norm layers).
    layer_parts = {
        "qkv": tokens * 2 * hidden * width * (heads + 2 * kv_heads),
        "core": products,
        "out": tokens * 2 * hidden * width * heads,
        "ffn_in": tokens * 2 * 2 * hidden * ffn,
        "ffn_out": 0,
    }
    layer_recompute = _recomputed(layer_parts, g)
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
            recompute += layer_recompute
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
    question_recompute = q.num_hidden_layers * _recomputed(
        _encoder_layer_parts(tokens, question, h, f), q
    )
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
        "recompute": question_recompute + recompute,
    }
    out["train"] = out["question_encoder"] + out["generator"] + out["doc_scores"]
    return out


def step_flops(q, g, batch: int, *, frozen: str = "", **shapes) -> dict:
    """The analytic FLOPs of one training step: `causal_train_flops` for a causal generator,
    else `train_flops` (BART)."""
    if isinstance(g, llama.LlamaConfig):
        return causal_train_flops(q, g, batch, frozen=frozen, **shapes)
    return train_flops(q, g, batch, **shapes)
