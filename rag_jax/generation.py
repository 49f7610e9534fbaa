"""RAG decoding: RAG-Token beam search over the doc marginal, RAG-Sequence thorough and fast.

The implementation behind `rag.generate` (which jits it with the configuration and the decoding
settings static, and caches the programs); see there for the contract. HF transformers'
`RagTokenForGeneration.generate` and `RagSequenceForGeneration.generate` define the results.

Legend: B batch, N docs per question, S context length, K beams, M candidates per question,
L generated length, V vocab. `flat_` arrays are `[B * N, ...]` with rows ordered `b * N + n`.
"""

import dataclasses

import flax
import jax
import jax.numpy as jnp

from rag_jax import decoding, rag_math, sequence_candidates
from rag_jax.models import bart


def _split_cache(cache: dict) -> tuple[dict, dict, tuple]:
    """Splits a Bart decode cache into what a search carries and what stays fixed.

    Returns:
      carried: the self-attention buffers, leaves [B * K * m, ...] (reordered with the beams).
      constants: flat {path: array} of the cross-attention keys/values, one copy per context:
        identical for every beam, so they stay out of the loop state as loop constants.
      scalars: paths of the scalar decode positions (the search tracks the step itself).
    """
    flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(cache))
    scalars = tuple(k for k, v in flat.items() if jnp.ndim(v) == 0)
    constants = {k: v for k, v in flat.items() if k[-1] in ("cross_key", "cross_value")}
    carried = {k: v for k, v in flat.items() if k not in constants and k not in scalars}
    return flax.traverse_util.unflatten_dict(carried), constants, scalars


def _generator_step_fn(
    cfg, params: dict, encoder_mask: jax.Array, constants: dict, scalars, reps: int
):
    """`(flat_ids [R, 1], cache, step) -> (logits [R * reps, V], cache)` for the searches."""
    model = bart.Bart(cfg.generator)

    def step_fn(flat_ids, cache, step):
        ids = jnp.repeat(flat_ids, reps, axis=0)  # -> [R * reps, 1]
        flat = flax.traverse_util.flatten_dict(cache)
        flat.update(constants)
        flat.update({k: jnp.asarray(step, jnp.int32) for k in scalars})
        logits, variables = model.apply(
            {"params": params["generator"], "cache": flax.traverse_util.unflatten_dict(flat)},
            ids,
            None,
            encoder_mask,
            None,
            True,
            method=bart.Bart.decode,
            mutable=["cache"],
        )
        return logits[:, 0], _split_cache(variables["cache"])[0]

    return step_fn


def _encode(cfg, params, flat_ids, flat_mask):
    """[B * N, S] contexts -> [B * N, S, H] generator encoder output."""
    return bart.Bart(cfg.generator).apply(
        {"params": params["generator"]}, flat_ids, flat_mask, method=bart.Bart.encode
    )


def _search(cfg, params, encoded, flat_mask, settings, *, batch, docs_per_row, post_fn=None):
    """Runs beam or greedy search over encoded contexts laid out [batch * docs_per_row, S, H].

    With `docs_per_row = N` and `post_fn` marginalising docs, this is RAG-Token decoding; with
    `docs_per_row = 1` it is plain BART decoding of every context (RAG-Sequence candidates). The
    decoder rows are laid out (b, k, n); each context's cross-attention keys/values are computed
    once and shared by its K beams.
    """
    beams = settings["num_beams"]
    model = bart.Bart(cfg.generator)
    mask = flat_mask
    if docs_per_row > 1 and beams > 1:
        # Decoder row (b, k, n) reads context (b, n): see `bart.Bart.decode`.
        encoded = encoded.reshape((batch, docs_per_row) + encoded.shape[1:])  # -> [B, N, S, H]
        mask = flat_mask.reshape(batch, docs_per_row, -1)  # -> [B, N, S]
    cache = bart.init_cache(
        model, params["generator"], encoded, mask, settings["max_length"], group_size=beams
    )
    cache, constants, scalars = _split_cache(cache)
    step_fn = _generator_step_fn(cfg, params, mask, constants, scalars, docs_per_row)
    if post_fn is not None:
        step_fn = post_fn(step_fn)
    common = {k: v for k, v in settings.items() if k not in ("num_beams", "num_return_sequences")}
    gen = cfg.generator
    return decoding.search(
        step_fn,
        cache,
        batch_size=batch,
        num_beams=beams,
        num_return_sequences=settings["num_return_sequences"],
        decoder_start_token_id=gen.decoder_start_token_id,
        eos_token_id=gen.eos_token_id,
        pad_token_id=gen.pad_token_id,
        **common,
    )


def resolve_settings(cfg, overrides: dict) -> dict:
    """The decoding settings of `cfg.generation` with `overrides` applied (GenerationConfig
    field names; an unknown one is refused)."""
    unknown = set(overrides) - {f.name for f in dataclasses.fields(cfg.generation)}
    if unknown:
        raise ValueError(f"unknown generation settings {sorted(unknown)}")
    values = dataclasses.asdict(dataclasses.replace(cfg.generation, **overrides))
    values["bad_words_ids"] = tuple(tuple(w) for w in values["bad_words_ids"])
    if values["num_beams"] == 1:
        for k in ("length_penalty", "early_stopping"):
            values.pop(k)
    return values


def generate(
    cfg,
    params: dict,
    context_input_ids: jax.Array,
    context_attention_mask: jax.Array,
    doc_scores: jax.Array,
    *,
    variant: str,
    sequence_decoding: str,
    mask_candidate_contexts: bool,
    settings: dict,
) -> jax.Array:
    """Generates answers, batched over questions: `rag.generate`'s body, traced under its jit.

    The arguments are `rag.generate`'s, checked there, with `settings` the decoding settings
    already resolved (`resolve_settings`); the return value is the same.
    """
    n_docs = cfg.n_docs
    batch = doc_scores.shape[0]
    s = settings
    if variant == "token":
        beam_scores = jnp.repeat(doc_scores, s["num_beams"], axis=0)  # -> [B * K, N]

        def marginalise(step_fn):
            def fn(flat_ids, cache, step):
                logits, cache = step_fn(flat_ids, cache, step)  # [B * K * N, V]
                marginal = rag_math.rag_token_marginalize(logits[:, None], beam_scores, n_docs)
                return marginal[:, 0], cache

            return fn

        seqs, _ = _search(
            cfg,
            params,
            _encode(cfg, params, context_input_ids, context_attention_mask),
            context_attention_mask,
            s,
            batch=batch,
            docs_per_row=n_docs,
            post_fn=marginalise,
        )
        return seqs[:, 0] if seqs.shape[1] == 1 else seqs
    if variant != "sequence":
        raise ValueError(f"variant must be 'sequence' or 'token', got {variant!r}")
    if sequence_decoding not in ("thorough", "fast"):
        raise ValueError(
            f"sequence_decoding must be 'thorough' or 'fast', got {sequence_decoding!r}"
        )

    beams, num_return = s["num_beams"], s["num_return_sequences"]
    per_doc = dict(s, num_return_sequences=beams)
    encoded = _encode(cfg, params, context_input_ids, context_attention_mask)
    if mask_candidate_contexts:
        search_mask, search_encoded = context_attention_mask, encoded
    else:
        search_mask = jnp.ones_like(context_attention_mask)
        search_encoded = _encode(cfg, params, context_input_ids, search_mask)
    hyps, hyp_scores = _search(
        cfg,
        params,
        search_encoded,
        search_mask,
        per_doc,
        batch=batch * n_docs,
        docs_per_row=1,
    )  # -> [B * N, K, L]
    length = hyps.shape[-1]
    candidates = hyps.reshape(batch, n_docs * hyps.shape[1], length)  # -> [B, M, L]
    deduplicate = cfg.do_deduplication
    if sequence_decoding == "fast":
        if hyp_scores is None:
            raise ValueError("fast decoding needs num_beams > 1")
        scores = sequence_candidates.rag_sequence_fast_scores(
            hyps.reshape(batch, n_docs, beams, length),
            unnormalised(hyps, hyp_scores, s, cfg).reshape(batch, n_docs, beams),
            doc_scores,
        )
    else:
        score_fn = lambda part, use_bos: _thorough_nll(  # noqa: E731
            cfg, params, encoded, context_attention_mask, doc_scores, part, use_bos
        )
        scores = -rescore(cfg, candidates, score_fn, chunk=beams)
        deduplicate = False  # `rescore` already scored the repeats -inf
    top, _ = sequence_candidates.select_top_candidates(
        candidates, scores, num_return, deduplicate=deduplicate
    )
    return top[:, 0] if num_return == 1 else top


def rescore(cfg, candidates, score_fn, *, chunk: int):
    """[B, M] thorough NLL of each question's candidates, repeats left at +inf when deduplicating.

    `score_fn(part [B, chunk, L], use_bos [B]) -> [B, chunk]` scores a chunk of candidates
    against all of their question's docs (`_thorough_nll` for BART; `causal` has its own).

    HF rescores only the distinct candidates of a question. Here the distinct ones are moved to
    the front (in order of first occurrence) and rescored `chunk` candidates at a time in a loop
    that stops after the busiest question's last distinct candidate, so repeated hypotheses (the
    beams of different docs often agree) cost no decoder pass, and the [rows, L, V] logits exist
    for one chunk at a time.
    """
    batch, num_candidates, length = candidates.shape
    chunk = max(1, min(chunk, num_candidates))
    if cfg.do_deduplication:
        first = sequence_candidates.first_occurrence_mask(candidates)  # -> [B, M]
        order = jnp.argsort(~first, axis=1, stable=True)  # distinct first, in their order
        needed = jnp.max(jnp.sum(first, axis=1))  # distinct candidates of the busiest question
    else:
        first = jnp.ones((batch, num_candidates), bool)
        order = jnp.broadcast_to(jnp.arange(num_candidates), (batch, num_candidates))
        needed = num_candidates
    # HF leaves the BOS score out when *all* of a question's rescored candidates start with BOS:
    # decided once per question, not per chunk (a chunk's filler rows and its share of the
    # candidates would decide otherwise).
    use_bos = sequence_candidates.candidates_start_with_bos(
        candidates, cfg.bos_token_id, first
    )  # [B]
    ranked = jnp.take_along_axis(candidates, order[:, :, None], axis=1)
    chunks = -(-num_candidates // chunk)
    pad = chunks * chunk - num_candidates  # the last chunk's padding rows repeat candidate 0
    ranked = jnp.concatenate([ranked, jnp.repeat(ranked[:, :1], pad, axis=1)], axis=1)

    def body(j, nll):  # nll: [B, chunks * chunk]
        part = jax.lax.dynamic_slice_in_dim(ranked, j * chunk, chunk, axis=1)
        value = score_fn(part, use_bos)
        return jax.lax.dynamic_update_slice_in_dim(nll, value.astype(nll.dtype), j * chunk, axis=1)

    nll = jnp.full((batch, chunks * chunk), jnp.inf, jnp.float32)
    nll = jax.lax.fori_loop(0, (needed + chunk - 1) // chunk, body, nll)[:, :num_candidates]
    nll = jnp.take_along_axis(nll, jnp.argsort(order, axis=1), axis=1)  # original order
    return jnp.where(first, nll, jnp.inf) if cfg.do_deduplication else nll


def _thorough_nll(cfg, params, encoded, flat_mask, doc_scores, candidates, use_bos):
    """[B, M] RAG-Sequence NLL of every candidate against all its question's docs; `use_bos` [B]
    says whether each question's BOS score is left out.

    `encoded` [B * N, S, H] is read by the M candidates of each question without copies: decoder
    row (b, m, n) attends to context (b, n) (see `bart.Bart.decode`).
    """
    batch, num_candidates, length = candidates.shape
    n_docs = cfg.n_docs
    encoded = encoded.reshape((batch, n_docs) + encoded.shape[1:])  # -> [B, N, S, H]
    mask = flat_mask.reshape(batch, n_docs, -1)  # -> [B, N, S]
    dec = jnp.repeat(candidates.reshape(batch * num_candidates, length), n_docs, axis=0)
    logits = bart.Bart(cfg.generator).apply(
        {"params": params["generator"]}, dec, encoded, mask, method=bart.Bart.decode
    )  # -> [B * M * N, L, V], rows (b, m, n)
    return rag_math.rag_sequence_thorough_nll(
        logits,
        doc_scores,
        candidates,
        pad_token_id=cfg.pad_token_id,
        bos_token_id=cfg.bos_token_id,
        n_docs=n_docs,
        epsilon=cfg.label_smoothing,
        use_bos=use_bos,
    )


def unnormalised(hyps, scores, settings, cfg):
    """Undoes the beam search's length penalty: summed log-probs of each hypothesis [B*N, K].

    A finished hypothesis ends at its first EOS or at `max_length`: its generated tokens are
    those after the decoder start up to and including the first EOS, or all L - 1 of them. (The
    tokens themselves cannot tell the length otherwise: a model may emit the pad id that also
    fills the positions after an end.)
    """
    body = hyps[..., 1:]  # -> [..., L - 1] the generated positions
    is_eos = body == cfg.generator.eos_token_id
    first_eos = jnp.argmax(is_eos, axis=-1)
    gen_len = jnp.where(jnp.any(is_eos, axis=-1), first_eos + 1, body.shape[-1])
    return scores * gen_len.astype(jnp.float32) ** settings["length_penalty"]
