"""A causal (decoder-only) generator behind RAG: answer likelihoods and decoding.

Each of a question's N contexts is a prompt row (passage, question and answer cue, as the
passage store lays them out), its real tokens contiguous: right-padded rows (the store's layout)
are left-aligned here (`left_align`), so that every row's last column is its last real token and
the answer follows it. `labels` are the answer tokens and EOS, padded (with the pad id or HF's
ignore index `-100`). Logits are aligned with the labels: position t of `answer_logits` predicts
`labels[:, t]`, the first one read off the prompt's last position.

Decoding keeps every prompt's keys and values once (`llama.Prefix`: the prompt less its last
token) and shares them with the K beams (or the M rescored candidates) that read it; each beam's
own tokens live in a `llama.Past` that the search reorders. The prompt's last token is fed at
step 0, so the first generated token is the model's prediction after the whole prompt. Output
sequences hold the generated tokens only: `max_length` and `min_length` count generated tokens
(HF's `max_new_tokens` and `min_new_tokens`).

Legend: B batch, N docs per question, S prompt length, T answer length, K beams, M candidates
per question, L generated length, V vocab, g key/value heads, d head width. `flat_` arrays are
`[B * N, ...]` with rows ordered `b * N + n`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rag_jax import decoding, generation, rag_math, sequence_candidates
from rag_jax.models import llama

IGNORE_INDEX = -100


def is_causal(cfg) -> bool:
    """Whether a RagConfig's generator is a causal LM (`RagConfig.causal`)."""
    return cfg.causal


def label_mask(labels: jax.Array, eos_token_id: int, pad_token_id: int) -> jax.Array:
    """[B, T] bool: the answer positions a causal generator is scored on.

    A position counts unless it is the ignore index, follows the first EOS, or is a pad that is
    not an EOS (a causal LM's pad id is often its EOS id: the first one is scored, the rest are
    padding).
    """
    is_eos = labels == eos_token_id
    after_eos = (jnp.cumsum(is_eos, axis=-1) - is_eos) > 0
    return (labels != IGNORE_INDEX) & ~after_eos & ~((labels == pad_token_id) & ~is_eos)


def check_prompts(context_attention_mask) -> None:
    """Refuses prompt rows whose real tokens are not one contiguous run starting or ending the
    row (checked when the mask is concrete)."""
    if isinstance(context_attention_mask, jax.core.Tracer):
        return
    mask = np.asarray(context_attention_mask).astype(bool)
    starts = np.diff(mask.astype(np.int8), axis=1, prepend=0, append=0)
    runs = (starts == 1).sum(axis=1)
    touches = mask[:, 0] | mask[:, -1]
    bad = (runs != 1) | ~touches
    if bad.any():
        row = int(np.argmax(bad))
        raise ValueError(
            f"context_attention_mask row {row} is {mask[row].astype(int).tolist()}: a causal "
            "generator's prompt must be one run of real tokens, padded on the left or the right"
        )


def check_generation(cfg, context_input_ids, context_attention_mask, settings: dict) -> None:
    """Refuses prompts and decoding settings a causal generator cannot generate from: prompts
    not one run of real tokens, prompt + `max_length` beyond its positions, n-gram blocking."""
    check_prompts(context_attention_mask)
    longest = context_input_ids.shape[1] + settings["max_length"]
    if longest > cfg.generator.max_position_embeddings:
        raise ValueError(
            f"prompts of {context_input_ids.shape[1]} tokens and max_length="
            f"{settings['max_length']} new tokens exceed the generator's "
            f"max_position_embeddings={cfg.generator.max_position_embeddings}"
        )
    if settings["no_repeat_ngram_size"]:
        raise ValueError(
            "no_repeat_ngram_size is not supported with a causal generator (HF counts the "
            "prompt's n-grams too)"
        )


def left_align(flat_ids: jax.Array, flat_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Right-padded rows [E, S] rolled so that their padding is on the left (left-padded rows
    are kept as they are)."""
    width = flat_ids.shape[1]
    real = jnp.sum(flat_mask, axis=1)
    shift = jnp.where(flat_mask[:, -1] == 1, 0, width - real)  # -> [E]
    index = (jnp.arange(width)[None, :] - shift[:, None]) % width
    return (
        jnp.take_along_axis(flat_ids, index, axis=1),
        jnp.take_along_axis(flat_mask, index, axis=1),
    )


def _model(cfg) -> llama.Llama:
    return llama.Llama(cfg.generator)


def answer_logits(
    cfg, params: dict, flat_context_ids, flat_context_mask, labels, dropout_rng=None
) -> jax.Array:
    """Teacher-forced logits of each question's answer after each of its prompts.

    Args:
      cfg: the RAG config (its generator a `LlamaConfig`).
      params: RAG parameters.
      flat_context_ids: [B * N, S] prompts (padded on either side), row b * N + n.
      flat_context_mask: [B * N, S].
      labels: [B, T] answer token ids (pad in place of the ignore index).
      dropout_rng: unused (the Llama decoder has no dropout); accepted for one signature.

    Returns:
      [B * N, T, V] float32; position t predicts `labels[:, t]`.
    """
    del dropout_rng
    batch, length = labels.shape
    rows, prompt = flat_context_ids.shape
    if rows % batch:
        raise ValueError(
            f"context_input_ids {tuple(flat_context_ids.shape)} rows are not a multiple of the "
            f"batch of labels {tuple(labels.shape)}"
        )
    if prompt + length > cfg.generator.max_position_embeddings:
        raise ValueError(
            f"prompts of {prompt} tokens and labels of {length} exceed the generator's "
            f"max_position_embeddings={cfg.generator.max_position_embeddings}"
        )
    ids, mask = answer_rows(flat_context_ids, flat_context_mask, labels)
    model, variables = _model(cfg), {"params": params["generator"]}
    hidden, _ = model.apply(
        variables, ids, mask, llama.positions_from_mask(mask), method=llama.Llama.hidden
    )
    return model.apply(
        variables, hidden[:, prompt - 1 : prompt + length - 1], method=llama.Llama.head
    )


def answer_rows(flat_context_ids, flat_context_mask, labels) -> tuple[jax.Array, jax.Array]:
    """The rows `answer_logits` runs the decoder on: each prompt left-aligned, its question's
    labels after it.

    Every label column counts as a real token, padding included: label padding follows the
    answer, so causality keeps it away from every scored position. A row's real tokens are thus
    its prompt's and all T labels, contiguous at its end, and their positions (from the mask)
    count from the first prompt token: they are the same whatever the prompt width S.

    Args:
      flat_context_ids: [B * N, S] prompts (padded on either side), row b * N + n.
      flat_context_mask: [B * N, S].
      labels: [B, T] answer token ids (pad in place of the ignore index).

    Returns:
      (ids [B * N, S + T] int, mask [B * N, S + T] int).
    """
    rows, batch = flat_context_ids.shape[0], labels.shape[0]
    flat_context_ids, flat_context_mask = left_align(flat_context_ids, flat_context_mask)
    flat_labels = jnp.repeat(labels, rows // batch, axis=0)  # -> [B * N, T]
    ids = jnp.concatenate([flat_context_ids, flat_labels], axis=1)  # -> [B * N, S + T]
    mask = jnp.concatenate([flat_context_mask, jnp.ones_like(flat_labels)], axis=1)
    return ids, mask


def answer_logits_from_states(
    cfg, params: dict, flat_states, flat_mask, length: int, first_layer: int
) -> jax.Array:
    """`answer_logits` from the states the generator's first `first_layer` layers output: only
    the layers above, the final norm and the LM head run.

    The rows are `answer_rows`' (a prompt left-aligned in S columns, then the T labels), their
    states `llama.Llama.trunk`'s. Only the real tokens' states matter (no real token attends to
    padding, and positions come from the mask), so states computed for each row's real tokens
    alone and right-aligned in the S + T columns with zeros before them
    (`training.reader_trunk.ReaderTrunk.gather`) give `answer_logits`' logits.

    Args:
      cfg: the RAG config (its generator a `LlamaConfig`).
      params: RAG parameters; only the generator's layers from `first_layer` up, its final norm
        and its LM head (the embedding when tied) are read.
      flat_states: [B * N, S + T, H] float, layer `first_layer - 1`'s output.
      flat_mask: [B * N, S + T] 1 = a real token (`answer_rows`' mask).
      length: T, the labels' width.
      first_layer: F in [1, num_hidden_layers].

    Returns:
      [B * N, T, V] float32; position t predicts `labels[:, t]`.
    """
    if flat_states.ndim != 3 or flat_mask.shape != flat_states.shape[:2]:
        raise ValueError(
            f"flat_states {tuple(flat_states.shape)} must be [B * N, S + T, H] and flat_mask "
            f"{tuple(flat_mask.shape)} [B * N, S + T]"
        )
    prompt = flat_states.shape[1] - length
    if prompt < 1:
        raise ValueError(
            f"states of {flat_states.shape[1]} columns hold no prompt before {length} labels"
        )
    if first_layer < 1:  # layer 0 reads token ids (`answer_logits`)
        raise ValueError(f"first_layer {first_layer} must be at least 1 for cached states")
    model, variables = _model(cfg), {"params": params["generator"]}
    hidden, _ = model.apply(
        variables,
        flat_states,
        flat_mask,
        llama.positions_from_mask(flat_mask),
        first_layer=first_layer,
        method=llama.Llama.hidden,
    )
    return model.apply(
        variables, hidden[:, prompt - 1 : prompt + length - 1], method=llama.Llama.head
    )


def reader_inputs(cfg, batch: dict) -> tuple[jax.Array, jax.Array, int]:
    """What the generator reads in a training batch, and the layer it enters: a causal
    generator's cached states "reader_states" [..., S + T, H] and "reader_mask" [..., S + T]
    (its frozen layers' output, `training.reader_trunk`), entering layer `frozen_layers`; else
    "context_input_ids" and "context_attention_mask" [..., S], entering at the embedding (0).

    Returns:
      (inputs, mask, first_layer); `answer_logits_from_states` reads the states.
    """
    if "reader_states" not in batch:
        return batch["context_input_ids"], batch["context_attention_mask"], 0
    first = cfg.generator.frozen_layers if cfg.causal else 0
    if not first:
        raise ValueError(
            "reader_states are a causal generator's frozen layers' output: they need a causal "
            f"generator with frozen_layers > 0 (causal: {cfg.causal}, frozen_layers: "
            f"{getattr(cfg.generator, 'frozen_layers', None)})"
        )
    return batch["reader_states"], batch["reader_mask"], first


def memo_nll(cfg, answer_logprobs, scores, labels, variant: str) -> jax.Array:
    """[B] the NLL of a frozen causal generator's answer log-probs [B, N, T] (`training.memo`)
    under the doc scores [B, N], as `rag.loss_fn` computes it from the logits."""
    if not cfg.causal or cfg.label_smoothing:
        raise ValueError(
            "answer_logprobs (a memoised frozen generator) need a causal generator and "
            f"label_smoothing=0 (causal: {cfg.causal}, label_smoothing: {cfg.label_smoothing})"
        )
    labels = jnp.asarray(labels, jnp.int32)
    labels = jnp.where(labels == IGNORE_INDEX, cfg.pad_token_id, labels)
    scored = label_mask(labels, cfg.generator.eos_token_id, cfg.pad_token_id)
    return rag_math.nll_from_token_logprobs(answer_logprobs, scores, scored, variant)


class _Prompts:
    """The prompts' cached keys and values and their last tokens, for decoding and rescoring."""

    def __init__(self, cfg, params, flat_ids, flat_mask):
        model = _model(cfg)
        flat_ids, flat_mask = left_align(flat_ids, flat_mask)
        positions = llama.positions_from_mask(flat_mask)  # -> [E, S]
        _, self.kv = model.apply(
            {"params": params["generator"]},
            flat_ids[:, :-1],
            flat_mask[:, :-1],
            positions[:, :-1],
            method=llama.Llama.hidden,
        )  # keys/values [E, g, S - 1, d] per layer
        self.mask = flat_mask[:, :-1].astype(bool)
        self.last_ids = flat_ids[:, -1]  # [E]
        self.last_pos = positions[:, -1]  # [E]

    def prefix(self, outer: int, inner: int) -> llama.Prefix:
        """The cache laid out [G, m, ...] (E = G * m prompts)."""
        split = lambda a: a.reshape((outer, inner) + a.shape[1:])  # noqa: E731
        return llama.Prefix(
            tuple(map(split, self.kv.keys)), tuple(map(split, self.kv.values)), split(self.mask)
        )

    def per_row(self, values: jax.Array, outer: int, group: int, inner: int) -> jax.Array:
        """[E] per prompt -> [G * k * m] per query row (row (g, j, i) reads prompt (g, i))."""
        values = values.reshape(outer, 1, inner)
        return jnp.broadcast_to(values, (outer, group, inner)).reshape(-1)


def _step_fn(cfg, params, prompts: _Prompts, outer: int, group: int, inner: int):
    """`(flat_ids [R / m, 1], past, step) -> (logits [R, V], past)` for the searches, R = G*k*m."""
    model = _model(cfg)
    prefix = prompts.prefix(outer, inner)
    last_ids = prompts.per_row(prompts.last_ids, outer, group, inner)
    last_pos = prompts.per_row(prompts.last_pos, outer, group, inner)

    def step_fn(flat_ids, past, step):
        ids = jnp.repeat(flat_ids, inner, axis=0)[:, 0]  # -> [R]
        ids = jnp.where(step == 0, last_ids, ids)  # step 0 feeds each prompt's last token
        variables = {"params": params["generator"]}
        hidden, past = model.apply(
            variables,
            ids[:, None],
            jnp.ones((ids.shape[0], 1), jnp.int32),
            (last_pos + step)[:, None],
            prefix,
            past,
            step,
            method=llama.Llama.hidden,
        )
        return model.apply(variables, hidden[:, 0], method=llama.Llama.head), past

    return step_fn


def _empty_past(cfg, rows: int, length: int) -> llama.Past:
    g = cfg.generator
    shape = (rows, g.num_key_value_heads, length, g.head_width)
    zeros = tuple(jnp.zeros(shape, jnp.dtype(g.dtype)) for _ in range(g.num_hidden_layers))
    return llama.Past(zeros, zeros)


def _search_settings(settings: dict) -> dict:
    """Our settings (generated-token counts) as `decoding`'s (which count a start slot)."""
    s = {k: v for k, v in settings.items() if k not in ("num_beams", "num_return_sequences")}
    s["max_length"] = settings["max_length"] + 1
    s["min_length"] = settings["min_length"] + 1 if settings["min_length"] else 0
    return s


def _search(cfg, params, prompts, settings, *, outer, inner, post_fn=None):
    """Beam (or greedy) search over prompts laid out [outer * inner]: decoder rows (g, k, i).

    Returns (sequences [outer, R, L + 1] with the start slot, scores [outer, R] or None).
    """
    beams = settings["num_beams"]
    gen = cfg.generator
    step_fn = _step_fn(cfg, params, prompts, outer, beams, inner)
    if post_fn is not None:
        step_fn = post_fn(step_fn)
    past = _empty_past(cfg, outer * beams * inner, settings["max_length"] + 1)
    return decoding.search(
        step_fn,
        past,
        batch_size=outer,
        num_beams=beams,
        num_return_sequences=settings["num_return_sequences"],
        decoder_start_token_id=gen.pad_token_id,  # the start slot (dropped from the output)
        eos_token_id=gen.eos_token_id,
        pad_token_id=gen.pad_token_id,
        **_search_settings(settings),
    )


def _candidate_logits(cfg, params, prompts: _Prompts, candidates) -> jax.Array:
    """[B * M * N, L, V] teacher-forced logits of each question's M candidates [B, M, L] after
    each of its N prompts, rows (b, m, n), read off the prompts' cached keys and values."""
    model = _model(cfg)
    n_docs = cfg.n_docs
    batch, count, length = candidates.shape
    last_ids = prompts.per_row(prompts.last_ids, batch, count, n_docs)
    last_pos = prompts.per_row(prompts.last_pos, batch, count, n_docs)
    flat = jnp.repeat(candidates.reshape(batch * count, length), n_docs, axis=0)
    ids = jnp.concatenate([last_ids[:, None], flat[:, :-1]], axis=1)  # rows (b, m, n)
    variables = {"params": params["generator"]}
    hidden, _ = model.apply(
        variables,
        ids,
        jnp.ones_like(ids),
        last_pos[:, None] + jnp.arange(length),
        prompts.prefix(batch, n_docs),
        method=llama.Llama.hidden,
    )
    return model.apply(variables, hidden, method=llama.Llama.head)


def _thorough_fn(cfg, params, prompts: _Prompts, doc_scores):
    """`(candidates [B, M, L], use_bos) -> [B, M]` RAG-Sequence NLL against all N prompts."""
    gen = cfg.generator

    def score_fn(candidates, use_bos):
        del use_bos  # no BOS rule for a causal generator
        return rag_math.rag_sequence_thorough_nll(
            _candidate_logits(cfg, params, prompts, candidates),
            doc_scores,
            candidates,
            pad_token_id=gen.pad_token_id,
            bos_token_id=None,
            n_docs=cfg.n_docs,
            epsilon=cfg.label_smoothing,
            aligned=True,
            target_mask=label_mask(candidates, gen.eos_token_id, gen.pad_token_id),
        )

    return score_fn


def greedy_thorough_parts(cfg, params, context_input_ids, context_attention_mask, settings):
    """What RAG-Sequence greedy thorough decoding (`generate`) computes before the doc scores
    weigh it: each prompt's greedy answer, and the log-probability of every one of them after
    every prompt of its question, each prompt's keys and values computed once for both.

    Args:
      cfg: the RAG config (a causal generator; `cfg.n_docs` = N prompts a question).
      params: RAG parameters (the generator's).
      context_input_ids: [B * N, S] prompts, row b * N + n, padded on either side.
      context_attention_mask: [B * N, S].
      settings: greedy decoding settings (`generation.resolve_settings`; num_beams 1).

    Returns:
      candidates: [B, N, L] the greedy answer of prompt (b, n), padded after EOS.
      token_lp: [B, N, N, L] float32, `[b, m, n, t]` the log-probability of candidate m's token
        t after prompt n (any value after its EOS).
    """
    if settings["num_beams"] != 1 or settings["num_return_sequences"] != 1:
        raise ValueError(f"greedy_thorough_parts decodes greedily, one answer: got {settings}")
    check_generation(cfg, context_input_ids, context_attention_mask, settings)
    return _greedy_thorough_parts(
        cfg, params, context_input_ids, context_attention_mask, tuple(sorted(settings.items()))
    )


@functools.partial(jax.jit, static_argnums=(0, 4))
def _greedy_thorough_parts(cfg, params, context_input_ids, context_attention_mask, settings):
    s = dict(settings)
    n_docs = cfg.n_docs
    batch = context_input_ids.shape[0] // n_docs
    prompts = _Prompts(cfg, params, context_input_ids, context_attention_mask)
    hyps, _ = _search(cfg, params, prompts, s, outer=batch * n_docs, inner=1)  # [B * N, 1, L + 1]
    length = hyps.shape[-1] - 1
    candidates = hyps[..., 1:].reshape(batch, n_docs, length)  # -> [B, M = N, L]
    logits = _candidate_logits(cfg, params, prompts, candidates)  # -> [B * M * N, L, V]
    targets = jnp.repeat(candidates.reshape(batch * n_docs, length), n_docs, axis=0)
    token_lp, _ = rag_math.token_logprobs(logits[:, None], targets)  # -> [B * M * N, 1, L]
    return _padded(cfg, candidates), token_lp.reshape(batch, n_docs, n_docs, length)


def generate(
    cfg,
    params,
    context_input_ids,
    context_attention_mask,
    doc_scores,
    *,
    variant,
    sequence_decoding,
    settings: dict,
) -> jax.Array:
    """`rag.generate`'s body for a causal generator (traced under its jit); the arguments are
    `generation.generate`'s. Thorough rescoring shares `generation.rescore`'s loop (distinct
    candidates first, a chunk at a time).

    Returns:
      [B, L] (or [B, R, L]) generated token ids, padded after EOS.
    """
    n_docs, batch = cfg.n_docs, doc_scores.shape[0]
    s = settings
    prompts = _Prompts(cfg, params, context_input_ids, context_attention_mask)
    if variant == "token":
        beam_scores = jnp.repeat(doc_scores, s["num_beams"], axis=0)  # -> [B * K, N]

        def marginalise(step_fn):
            def fn(flat_ids, past, step):
                logits, past = step_fn(flat_ids, past, step)  # [B * K * N, V]
                marginal = rag_math.rag_token_marginalize(logits[:, None], beam_scores, n_docs)
                return marginal[:, 0], past

            return fn

        seqs, _ = _search(cfg, params, prompts, s, outer=batch, inner=n_docs, post_fn=marginalise)
        seqs = _padded(cfg, seqs[..., 1:])
        return seqs[:, 0] if seqs.shape[1] == 1 else seqs

    beams, num_return = s["num_beams"], s["num_return_sequences"]
    hyps, hyp_scores = _search(
        cfg, params, prompts, dict(s, num_return_sequences=beams), outer=batch * n_docs, inner=1
    )  # -> [B * N, K, L + 1]
    length = hyps.shape[-1] - 1
    candidates = hyps[..., 1:].reshape(batch, n_docs * hyps.shape[1], length)  # -> [B, M, L]
    deduplicate = cfg.do_deduplication
    if sequence_decoding == "fast":
        if hyp_scores is None:
            raise ValueError("fast decoding needs num_beams > 1")
        lengths_scores = generation.unnormalised(hyps, hyp_scores, s, cfg)
        scores = sequence_candidates.rag_sequence_fast_scores(
            hyps[..., 1:].reshape(batch, n_docs, beams, length),
            lengths_scores.reshape(batch, n_docs, beams),
            doc_scores,
        )
    else:
        score_fn = _thorough_fn(cfg, params, prompts, doc_scores)
        scores = -generation.rescore(cfg, candidates, score_fn, chunk=beams)
        deduplicate = False  # the rescoring already scored the repeats -inf
    top, _ = sequence_candidates.select_top_candidates(
        candidates, scores, num_return, deduplicate=deduplicate
    )
    top = _padded(cfg, top)
    return top[:, 0] if num_return == 1 else top


def _padded(cfg, seqs: jax.Array) -> jax.Array:
    """Every position after a sequence's first EOS holds the pad id (the searches fill with EOS
    where the pad id is 0, as HF does)."""
    gen = cfg.generator
    is_eos = seqs == gen.eos_token_id
    after = (jnp.cumsum(is_eos, axis=-1) - is_eos) > 0
    return jnp.where(after, gen.pad_token_id, seqs)
