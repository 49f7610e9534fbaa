"""Reader warm starts: the generator learns to read before joint training starts.

The paper's generator is a pretrained BART, which reads before RAG training starts; a small
generator trained from scratch must learn to read inside the marginal over N retrieved passages,
which takes longer than it takes to memorise the training facts, and until it reads the
retriever's gradient carries no signal. A reader warm start trains the generator alone on
(question, the passage that answers it) -> answer, with p(z|x) = 1 over that one passage, on data
other than the evaluation's; the retriever towers are untouched.

Legend: B batch, S context length, T target length.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from rag_jax import rag
from rag_jax.devices.progress import Eta
from rag_jax.model_inputs import answer_labels, context_width
from rag_jax.run import checkpoints
from rag_jax.training.optim import make_optimizer, warm_start_settings
from rag_jax.training.step import init_state, make_step

_READER = 2  # the seed's stream for the reader's batches (ICT uses 0 and 1)
_DROPOUT = 3  # the seed's stream for the reader's dropout keys
# BartConfig's rates: the generator drops something in training when one of them is above 0.
_DROPOUT_RATES = (
    "dropout",
    "attention_dropout",
    "activation_dropout",
    "encoder_layerdrop",
    "decoder_layerdrop",
)


def uses_dropout(generator_cfg) -> bool:
    """Whether a generator config drops anything in training (a causal one has no rates)."""
    return any(getattr(generator_cfg, name, 0.0) > 0.0 for name in _DROPOUT_RATES)


def _passage_rows(store, *pools) -> dict:
    """{passage id: store row}, checked: every example of `pools` names a passage of `store`."""
    row = {pid: i for i, pid in enumerate(store.ids)}
    for pool in pools:
        missing = [e for e in pool if not e.gold_ids or e.gold_ids[0] not in row]
        if missing:
            first = missing[0]
            raise ValueError(
                f"{len(missing)} examples name no passage of the store, e.g. {first.id} (gold "
                f"passage {first.gold_ids[0] if first.gold_ids else None!r})"
            )
    return row


def answers_in_context(
    store, tokenizer, examples, context_length: int, keep_question: bool = False
) -> np.ndarray:
    """Which examples' answers the reader's context still shows: `[E] bool`.

    A context keeps the first tokens of the passage piece (`store.context_tokens`; with
    `keep_question` it cuts the passage to leave room for the whole question). The answer
    trained on (`answers[0]`) counts as shown when its first occurrence in the passage piece
    (title or text) ends, on the character level, within the characters of the kept tokens
    (the tokenizer's offsets). An answer that does not occur in the passage at all is not shown
    either.

    Args:
      store: the reader's `PassageStore`.
      tokenizer: its tokenizer (a fast one: the check reads its character offsets).
      examples: `data.Example`s; `gold_ids[0]` names each one's passage in `store`.
      context_length: S, the reader's context tokens.
      keep_question: as the reader's contexts are cut (`config.rag.keep_question`).

    Returns:
      [E] bool, True where the answer lies within the kept passage tokens.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"the answer check needs a tokenizer with character offsets (a fast one); "
            f"{type(tokenizer).__name__} has none"
        )
    if not examples:
        return np.zeros(0, bool)
    row = _passage_rows(store, examples)
    rows = np.array([[row[e.gold_ids[0]]] for e in examples])  # -> [E, 1]
    questions = store.tokenize_questions(tokenizer, [e.question for e in examples])
    kept = store.kept_passage_tokens(rows, questions, context_length, keep_question=keep_question)
    needed = sorted(set(rows[:, 0].tolist()))
    pieces = {i: store.passage_piece(i) for i in needed}
    encoded = tokenizer(
        [pieces[i] for i in needed],
        add_special_tokens=False,
        return_offsets_mapping=True,
        return_attention_mask=False,
        return_token_type_ids=False,
        verbose=False,
    )
    # The character where each passage's k-th token ends, k = 1..L (index 0: no token kept).
    ends = {
        i: np.concatenate([[0], np.asarray(offsets, np.int64).reshape(-1, 2)[:, 1]])
        for i, offsets in zip(needed, encoded["offset_mapping"], strict=True)
    }
    shown = np.zeros(len(examples), bool)
    for n, (e, passage, k) in enumerate(zip(examples, rows[:, 0], kept, strict=True)):
        answer = e.answers[0].replace("  ", " ")  # the piece's double spaces are rewritten
        at = pieces[passage].find(answer) if answer else -1
        shown[n] = at >= 0 and at + len(answer) <= ends[passage][k]
    return shown


def reader_warm_start(
    rag_cfg,
    generator_params,
    tokenizer,
    store,
    examples,
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    seed: int,
    answer_length: int,
    progress: checkpoints.Progress | None = None,
    alternate_with: list | None = None,
    context_length: int = 0,
    freeze: str = "",
    pad_multiple: int = 0,
    keep_question: bool = False,
    deterministic: bool = True,
) -> tuple[dict, list[dict]]:
    """Trains the generator to read: each question with the one passage that answers it.

    The paper's generator is a pretrained BART, which reads before RAG training starts; a small
    generator trained from scratch must learn to read inside the marginal over N retrieved
    passages, which on the synthetic world takes longer than it takes to memorise the training
    facts, and until it reads the retriever's gradient carries no signal. This warm start gives it
    the skill on a *different* corpus (`examples` and `store` of another world: other entities,
    facts drawn independently; see `experiment.build`), the way BART learns language on other
    text. Only the generator trains; no question, passage or id of the experiment's own world is
    used.

    Args:
      rag_cfg: the RAG config (its generator; the context length `max_combined_length`).
      generator_params: initial generator parameters (copied, never modified).
      tokenizer: the generator's tokenizer.
      store: a `PassageStore` of the other world's passages.
      examples: `data.Example`s of the other world; `gold_ids[0]` names each one's passage.
      steps: training steps, >= 1.
      batch_size: questions per step.
      learning_rate: peak AdamW learning rate (warmup and decay as the ICT warm start's).
      seed: batches are a function of `(seed, step)`.
      answer_length: label tokens per answer (`config.data.answer_length`).
      progress: where the warm start saves its state when stopped (SIGTERM) and resumes it from.
      alternate_with: a second task's examples (salient spans, `training.salient`): odd steps
        draw their batch from it, even steps from `examples`.
      context_length: context tokens (passage + question); 0 = `rag_cfg.max_combined_length`.
      freeze: regex over the generator's parameter paths (`encoder/layer_0/...`) left unchanged,
        e.g. the frozen layers of a generator with `frozen_encoder_layers`.
      pad_multiple: contexts are cut to their longest, rounded up to this (one compiled step
        per width, `inputs.context_width`); 0 = always `context_length` wide.
      keep_question: a long passage loses its end, not the question (`context_tokens`).
      deterministic: no dropout (`config.model.deterministic`); when False and the generator has
        a dropout rate above 0 (`uses_dropout`), dropout at its rates, step `s` drawing with
        `fold_in(fold_in(PRNGKey(seed), 3), s)`, so a resumed warm start draws what an
        uninterrupted one does.

    Returns:
      (generator parameters, log every tenth of the steps: {"step", "loss" (the mean since the
      last record), "seconds" and "tokens" (real context tokens read) since this call began}).
    """
    pools = [examples] if alternate_with is None else [examples, alternate_with]
    smallest = min(len(pool) for pool in pools)
    if steps < 1 or not 1 <= batch_size <= smallest:
        raise ValueError(
            f"reader warm start needs steps >= 1 and 1 <= batch_size <= examples; got {steps}, "
            f"{batch_size} and {smallest} examples"
        )
    row = _passage_rows(store, *pools)
    one_doc = rag_cfg.replace(
        n_docs=1, max_combined_length=context_length or rag_cfg.max_combined_length
    )
    tx = make_optimizer(
        warm_start_settings(float(learning_rate), steps, freeze=freeze and f"^({freeze})")
    )

    dropout_rng = None
    if not deterministic and uses_dropout(rag_cfg.generator):
        dropout_rng = jax.random.fold_in(jax.random.PRNGKey(seed), _DROPOUT)

    def loss_fn(generator, batch, rng):  # rng: this step's dropout key, or None
        doc_scores = jnp.zeros((batch["labels"].shape[0], 1), jnp.float32)  # p(z|x) = 1
        per_example = rag.nll(
            one_doc,
            {"generator": generator},
            batch["context_input_ids"],
            batch["context_attention_mask"],
            doc_scores,
            batch["labels"],
            "sequence",
            reduce=False,
            dropout_rng=rng,
        )
        return jnp.mean(per_example), None

    step_fn = make_step(loss_fn, tx, dropout_rng=dropout_rng)
    state = init_state(jax.tree.map(jnp.array, generator_params), tx)
    if progress is not None:  # a warm start stopped midway goes on from where it stopped
        state = progress.load(state) or state
    log, window, every = [], [], max(1, steps // 10)
    queued = None  # the previous step's loss, while the device may still run it
    start, tokens = time.perf_counter(), 0
    eta = Eta("reader warm start", steps, "steps", start=int(state.step))
    for step in range(int(state.step), steps):
        if progress is not None:
            progress.stop_if_requested(state, step, steps)
        rng = np.random.default_rng((seed, _READER, step))
        pool = pools[step % len(pools)]
        chosen = [pool[i] for i in rng.choice(len(pool), batch_size, replace=False)]
        questions = [e.question for e in chosen]
        ids = np.array([[row[e.gold_ids[0]]] for e in chosen])  # -> [B, 1]
        context, mask = store.context_tokens(
            ids,
            store.tokenize_questions(tokenizer, questions),
            one_doc.max_combined_length,
            keep_question=keep_question,
        )
        if pad_multiple:
            width = context_width(mask, one_doc.max_combined_length, pad_multiple)
            context, mask = context[:, :width], mask[:, :width]
        labels = answer_labels(tokenizer, [e.answers[0] for e in chosen], one_doc, answer_length)
        batch = {"context_input_ids": context, "context_attention_mask": mask, "labels": labels}
        state, metrics = step_fn(state, jax.device_put(batch))
        window.append(metrics["loss"])
        # At most one step dispatched behind the running one: a stop request (SIGTERM) is
        # honoured within about a step, not after every step the host had queued ahead.
        if queued is not None:
            queued.block_until_ready()
        queued = metrics["loss"]
        tokens += int(mask.sum())
        if (step + 1) % every == 0 or step + 1 == steps:
            value = float(np.mean(jax.device_get(window)))
            if not np.isfinite(value):
                raise FloatingPointError(f"non-finite reader warm-start loss at step {step + 1}")
            seconds = round(time.perf_counter() - start, 2)  # this process's, since it (re)started
            log.append({"step": step + 1, "loss": value, "seconds": seconds, "tokens": tokens})
            window = []
            eta.update(step + 1, f"loss {value:.3f}", force=True)
        else:
            eta.update(step + 1)
    return state.params, log
