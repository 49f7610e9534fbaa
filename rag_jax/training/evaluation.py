"""Held-out evaluation: generated answers (EM/F1) and retrieval recall@k, no example dropped.

EM and F1 score a generated answer against the gold answers as the generator's tokenizer writes
them (`written_answers`): each gold answer encoded and decoded with that tokenizer, the path every
prediction takes (ids -> `batch_decode(skip_special_tokens=True)` -> strip). An uncased WordPiece
vocabulary (a BERT-initialised generator's) decodes "Levi's" as "levi ' s" and "Fédération" as
"federation", so raw gold answers would cap EM below 1 for a model that copies them perfectly
(0.888 for the first gold answer of each SQuAD v1.1 dev question with MiniLM's tokenizer); against
the tokenizer's own form of the gold answers, a perfect copy scores 1.0 on all 8,595 of them.
Byte-level BPE (BART's) and the synthetic world's word-level vocabulary decode their gold answers
unchanged, so their EM and F1 are the same either way. Answer recall reads the passages' raw text
and takes the raw gold answers.

Legend: B batch, N docs, S context length, L generated length.
"""

import functools
import time

import jax
import numpy as np

from rag_jax import rag, rag_math
from rag_jax.devices import distributed, sharding
from rag_jax.devices.progress import Eta
from rag_jax.model_inputs import context_width
from rag_jax.retrieval.retriever import ClosedBook
from rag_jax.run import data, metrics
from rag_jax.training import experiment, memo, memo_decoding
from rag_jax.training.batcher import Batcher, memo_directory


def written_answers(tokenizer, answers):
    """Gold answers as `tokenizer` writes them: each encoded (no special tokens) and decoded
    as a generated answer is (`batch_decode(skip_special_tokens=True)`, stripped).

    Args:
      tokenizer: the generator's tokenizer.
      answers: B lists of gold answer strings.

    Returns:
      B lists of strings, in the same order.
    """
    flat = [a for gold in answers for a in gold]
    if not flat:
        return [list(gold) for gold in answers]
    ids = tokenizer(flat, add_special_tokens=False)["input_ids"]
    written = iter(a.strip() for a in tokenizer.batch_decode(ids, skip_special_tokens=True))
    return [[next(written) for _ in gold] for gold in answers]


def answer_sample(count: int, size: int, seed: int) -> np.ndarray | None:
    """The sorted indices of `eval.answer_examples` questions among `size` (a seeded draw), or
    None when all of them are answered. The draws of one seed are nested: the sample of n is
    part of the sample of any larger count (the first of one seeded permutation), so a larger
    evaluation reuses what a smaller one decoded."""
    if not count or count >= size:
        return None
    return np.sort(np.random.default_rng(seed).permutation(size)[:count])


def evaluate(
    exp: experiment.Experiment,
    params,
    examples,
    *,
    mesh,
    variant: str,
    ks=(1, 5),
    retriever=None,
    generate: bool = True,
    per_question: list | None = None,
):
    """EM/F1 of generated answers and retrieval recall@k over `examples` (none dropped).

    With `config.eval.answer_examples` = n below the number of examples, the retrieval recalls
    are over all of them (only the question tower runs) and the answers (EM/F1, predictions)
    over a fixed seeded sample of n (`eval.answer_seed`); the metrics then say both counts. A k
    of `ks` above the passages the generator reads is measured the same way: recalls from a
    search of that depth, answers from the passages it reads.
    `generate=False` computes the retrieval recalls only. Recalls computed alone (with
    `generate=False` or an answer sample) are at every k of `ks`, retrieving more passages than
    the generator reads where a k exceeds `eval.n_docs`; those of a call that answers every
    question come from the passages it reads (k up to `eval.n_docs`).

    On several hosts every process calls this with the same `examples`: each retrieves and feeds
    its block of every batch, the generated tokens and retrieved ids of all blocks are gathered
    to every process, and each example is scored exactly once, so all processes return the same
    metrics and predictions (the trainer writes them from process 0).

    `retriever` (default: the experiment's) finds the passages; a run whose index was refreshed
    passes the one serving its current step.

    `per_question`, a list, receives one record per example, in order: its id and its value of
    every metric it was scored on (`gold_recall@k`, `answer_recall@k`, and `exact_match`, `f1`
    for the answered ones), what paired comparisons of two runs read (`run.paired`).

    Returns:
      (metrics as floats, predictions: one dict per example with the answer and retrieved ids);
      EM/F1 against the gold answers as the generator's tokenizer writes them (module doc).
    """
    c = exp.config
    retriever = exp.retriever if retriever is None else retriever
    sample = answer_sample(c.eval.answer_examples, len(examples), c.eval.answer_seed)
    read = eval_rag_config(exp.rag_cfg, c).n_docs
    deeper = any(k > read for k in ks)  # a recall@k beyond the passages the generator reads
    if generate and (sample is not None or deeper) and not isinstance(retriever, ClosedBook):
        sample = np.arange(len(examples)) if sample is None else sample
        common = dict(mesh=mesh, variant=variant, retriever=retriever)
        records = [] if per_question is not None else None
        recall, _ = evaluate(
            exp, params, examples, generate=False, per_question=records, ks=ks, **common
        )
        qa_records = [] if per_question is not None else None
        answered, predictions = evaluate(
            exp,
            params,
            [examples[i] for i in sample],
            per_question=qa_records,
            ks=[k for k in ks if k <= read],
            **common,
        )
        if per_question is not None:  # the sample's answers joined to every question's recalls
            for i, record in zip(sample, qa_records):
                records[i].update(exact_match=record["exact_match"], f1=record["f1"])
            per_question += records
        qa = {k: answered[k] for k in ("exact_match", "f1")}
        counts = {"retrieval_examples": len(examples), "answer_examples": len(sample)}
        return dict(recall, **qa, **counts), predictions
    if generate and sample is not None:  # closed book: nothing to retrieve, answer the sample
        examples = [examples[i] for i in sample]
    rag_cfg = eval_rag_config(exp.rag_cfg, c)
    if not isinstance(retriever, ClosedBook):
        # Recalls alone (only the question tower runs) reach every k asked, beyond the passages
        # the generator reads.
        depth = rag_cfg.n_docs if generate else max(rag_cfg.n_docs, *ks)
        retriever = retriever.with_n_docs(depth)
    batch_size = c.eval.batch_size
    sharding.check_batch_divisible(batch_size, mesh.size, "eval batch")
    batcher = Batcher(exp, mesh, train=False)  # the training memo is not read here
    local = batch_size // batcher.blocks  # rows of each batch this process retrieves for
    mine = slice(batcher.block * local, (batcher.block + 1) * local)
    gen = generate_fn(rag_cfg, variant, c.eval.sequence_decoding)
    memos = _memos(exp, rag_cfg, variant, params) if generate and c.eval.answer_memo else None
    saved = time.monotonic()
    ks = [k for k in ks if not generate or k <= rag_cfg.n_docs]
    totals, predictions = {}, []
    what = "answering" if generate else "retrieving for"
    eta = Eta(f"evaluation: {what}", len(examples), "questions")
    for idx, mask in data.eval_batches(len(examples), batch_size):
        eta.update(int(idx[0]))
        batch_examples = [examples[i] for i in idx]
        fields, pieces = batcher.questions(batch_examples[mine])
        texts = [e.question for e in batch_examples[mine]]
        hits = batcher.retrieve(params, fields, pieces, retriever, texts)
        ctx, ctx_mask = batcher.contexts(hits)  # -> [local B * N, W], padded as for training
        q_ids, q_mask, vecs, ctx, ctx_mask, doc_ids = distributed.shard_batch(
            mesh,
            (
                fields["question_input_ids"],
                fields["question_attention_mask"],
                hits.doc_vectors,
                ctx.reshape(local, -1, ctx.shape[-1]),
                ctx_mask.reshape(local, -1, ctx.shape[-1]),
                hits.doc_ids.astype(np.int32),
            ),
        )
        # Every block's answers and retrieved rows, on every process: -> [B, L], [B, N].
        if memos is not None:  # one process: this block is the whole batch
            scores = doc_scores_fn(rag_cfg)(
                params, fields["question_input_ids"], fields["question_attention_mask"],
                hits.doc_vectors,
            )  # fmt: skip
            flat = lambda x: np.asarray(x).reshape(-1, x.shape[-1])  # noqa: E731 -> [B * N, S]
            tokens = memo_decoding.sequence_answers(*memos, flat(ctx), flat(ctx_mask), scores)
            doc_ids = hits.doc_ids
            if time.monotonic() - saved >= memo.SAVE_EVERY_S:  # a kill loses minutes at most
                memos[0].save()
                saved = time.monotonic()
        elif generate:
            tokens, doc_ids = distributed.gather_to_host(
                (gen(params, q_ids, q_mask, vecs, ctx, ctx_mask), doc_ids)
            )
        else:
            doc_ids = distributed.gather_to_host(doc_ids)
        gold_answers = [e.answers for e in batch_examples]
        ids, scored = [], []  # scored: per row, the metric functions' (sum, count) of that row
        if generate:
            answers = exp.generator_tokenizer.batch_decode(tokens, skip_special_tokens=True)
            answers = [a.strip() for a in answers]
            written = written_answers(exp.generator_tokenizer, gold_answers)
            totals = metrics.merge_metrics(totals, metrics.qa_metrics(answers, written, mask))
            scored.append(lambda r: metrics.qa_metrics([answers[r]], [written[r]]))  # noqa: B023
        if not isinstance(retriever, ClosedBook):  # nothing retrieved: no recall
            texts = [[retriever.store.text(int(j)) for j in row] for row in doc_ids]
            ids = [[retriever.store.ids[int(j)] for j in row] for row in doc_ids]
            golds = [e.gold_ids for e in batch_examples]
            totals = metrics.merge_metrics(
                totals,
                metrics.answer_recall(gold_answers, texts, ks, mask),
                metrics.gold_recall(ids, golds, ks, mask),
            )
            scored.append(
                lambda r: metrics.merge_metrics(
                    metrics.answer_recall([gold_answers[r]], [texts[r]], ks),  # noqa: B023
                    metrics.gold_recall([ids[r]], [golds[r]], ks),  # noqa: B023
                )
            )
        if per_question is not None:
            for r in np.flatnonzero(mask):
                values = metrics.merge_metrics({}, *(fn(int(r)) for fn in scored))
                per_question.append(
                    {"id": batch_examples[r].id}
                    | {k: total / count for k, (total, count) in values.items() if count}
                )
        if generate:
            predictions += [
                _prediction(e, answers[r], ids[r] if ids else [])
                for r, e in enumerate(batch_examples)
                if mask[r]
            ]
    if memos is not None:
        memos[0].save()
    if eta.printed != eta.began:  # it printed along the way: say it ended
        eta.update(len(examples))
    return metrics.reduce_metrics(totals), predictions


def _memos(exp, rag_cfg, variant: str, params) -> tuple:
    """(greedy-answer memo, generator parameters on the host) of the generator `params` holds
    (`config.eval.answer_memo`), checked: what `memo_decoding` computes, on one process."""
    memo_decoding.check_supported(rag_cfg, variant, exp.config.eval.sequence_decoding)
    if jax.process_count() > 1:
        raise ValueError("config.eval.answer_memo evaluates on one process")
    generator = jax.device_get(params["generator"])
    fingerprint = memo.fingerprint(rag_cfg, generator, exp.generator_tokenizer)
    return memo_decoding.GreedyMemo(rag_cfg, fingerprint, memo_directory(exp)), generator


@functools.cache
def doc_scores_fn(rag_cfg: rag.RagConfig):
    """The jitted `fn(params, q_ids [B, Q], q_mask, doc_vectors [B, N, D]) -> [B, N]` doc
    scores of the evaluation call."""

    def fn(params, q_ids, q_mask, doc_vectors):
        q = rag.question_embeddings(rag_cfg, params, q_ids, q_mask)
        return rag_math.doc_scores(q, doc_vectors, rag_cfg.doc_score_scale)

    return jax.jit(fn)


def _prediction(e: data.Example, answer: str, retrieved: list) -> dict:
    return {
        "id": e.id,
        "question": e.question,
        "prediction": answer,
        "answers": list(e.answers),
        "retrieved": retrieved,
    }


def eval_rag_config(rag_cfg: rag.RagConfig, config) -> rag.RagConfig:
    """The model config evaluation generates with: `config.eval.n_docs` passages per question
    (0: as in training)."""
    return rag_cfg.replace(n_docs=config.eval.n_docs or rag_cfg.n_docs)


@functools.cache
def generate_fn(rag_cfg: rag.RagConfig, variant: str, sequence_decoding: str):
    """The jitted evaluation call: `fn(params, q_ids [B, Q], q_mask, doc_vectors [B, N, D],
    ctx [B, N, S], ctx_mask) -> [B, L]` generated tokens."""

    def fn(params, q_ids, q_mask, doc_vectors, ctx, ctx_mask):
        scores = doc_scores_fn(rag_cfg)(params, q_ids, q_mask, doc_vectors)  # -> [B, N]
        flat = ctx.reshape(-1, ctx.shape[-1])  # -> [B * N, S]
        return rag.generate(
            rag_cfg,
            params,
            flat,
            ctx_mask.reshape(flat.shape),
            scores,
            variant=variant,
            sequence_decoding=sequence_decoding,
        )

    return jax.jit(fn)


def oracle(
    exp: experiment.Experiment,
    params,
    examples,
    *,
    store=None,
    batch_size: int = 0,
    context_length: int = 0,
) -> tuple[dict, list[dict]]:
    """EM/F1 with each question's gold passage given alone (p(z|x) = 1): does the generator read?

    Retrieval plays no part: the context is the question's first gold passage, laid out as in
    training, and the answer is generated by beam search (`config.eval` settings).

    Args:
      exp: the experiment (its generator config, tokenizer and eval settings).
      params: RAG parameters (only the generator's are read).
      examples: questions with `gold_ids`; one whose gold passage is not in `store` is refused.
      store: the passages (default: the experiment's).
      batch_size: questions per batch (default `config.eval.batch_size`).
      context_length: context tokens (default `rag.max_combined_length`).

    Returns:
      ({"exact_match", "f1"}, predictions as `evaluate` returns them); EM/F1 against the gold
      answers as the generator's tokenizer writes them (`written_answers`).
    """
    store = exp.store if store is None else store
    c = exp.config
    cfg = exp.rag_cfg.replace(
        n_docs=1, max_combined_length=context_length or exp.rag_cfg.max_combined_length
    )
    row = {store.ids[i]: i for i in range(len(store))}
    stray = [e for e in examples if not e.gold_ids or e.gold_ids[0] not in row]
    if stray:
        raise ValueError(
            f"{len(stray)} questions have no gold passage in the store ({len(store)} passages), "
            f"e.g. {stray[0].id!r} (gold ids {list(stray[0].gold_ids)})"
        )
    tokenizer = exp.generator_tokenizer
    generator = {"generator": params["generator"]}
    totals, predictions = {}, []
    for idx, mask in data.eval_batches(len(examples), batch_size or c.eval.batch_size):
        chosen = [examples[i] for i in idx]
        ids = np.array([[row[e.gold_ids[0]]] for e in chosen])  # -> [B, 1]
        questions = store.tokenize_questions(tokenizer, [e.question for e in chosen])
        ctx, ctx_mask = store.context_tokens(
            ids, questions, cfg.max_combined_length, keep_question=c.rag.keep_question
        )
        width = context_width(ctx_mask, cfg.max_combined_length, c.rag.context_pad_multiple)
        tokens = rag.generate(
            cfg,
            generator,
            ctx[:, :width],
            ctx_mask[:, :width],
            np.zeros((len(chosen), 1), np.float32),
            variant="token",
        )
        tokens = np.asarray(tokens)  # -> [B, L]
        answers = [a.strip() for a in tokenizer.batch_decode(tokens, skip_special_tokens=True)]
        gold = written_answers(tokenizer, [e.answers for e in chosen])
        totals = metrics.merge_metrics(totals, metrics.qa_metrics(answers, gold, mask))
        predictions += [
            _prediction(e, answers[r], [e.gold_ids[0]]) for r, e in enumerate(chosen) if mask[r]
        ]
    return metrics.reduce_metrics(totals), predictions


def summary_metrics(m: dict) -> tuple[float, float]:
    """(recall@5, EM): gold-passage recall where gold ids exist, else answer recall."""
    recall = m.get("gold_recall@5", m.get("answer_recall@5", float("nan")))
    return recall, m.get("exact_match", float("nan"))


def evaluate_bundle(model, examples, *, batch_size: int = 32, ks=(1, 5), **answer_options):
    """EM/F1 and retrieval recall@k of a bundle's answers (`Bundle.answer`) over `examples`.

    Args:
      model: a `bundle.Bundle`.
      examples: `data.Example`s (gold answers; gold passage ids where known).
      batch_size: questions per `answer` call.
      ks: recall cut-offs (those above n_docs are left out).
      **answer_options: `Bundle.answer`'s (variant, num_beams, n_docs, sequence_decoding).

    Returns:
      (metrics, predictions), as `evaluate` returns them.
    """
    n_docs = answer_options.get("n_docs") or model.rag_cfg.n_docs
    ks = [k for k in ks if k <= n_docs]
    totals, predictions = {}, []
    for start in range(0, len(examples), batch_size):
        batch = examples[start : start + batch_size]
        answers = model.answer([e.question for e in batch], **answer_options)
        texts = [a.answer for a in answers]
        gold = [e.answers for e in batch]
        ids = [[p.id for p in a.passages] for a in answers]
        totals = metrics.merge_metrics(
            totals,
            metrics.qa_metrics(texts, written_answers(model.generator_tokenizer, gold)),
            metrics.answer_recall(gold, [[p.text for p in a.passages] for a in answers], ks),
            metrics.gold_recall(ids, [e.gold_ids for e in batch], ks),
        )
        predictions += [
            {
                "id": e.id,
                "question": e.question,
                "prediction": a.answer,
                "answers": list(e.answers),
                "retrieved": row,
            }
            for e, a, row in zip(batch, answers, ids, strict=True)
        ]
    return metrics.reduce_metrics(totals), predictions
