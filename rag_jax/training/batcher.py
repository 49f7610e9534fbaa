"""Host-side batch assembly for joint training: question tokens, answer labels and retrieval.

A batch is a pure function of `(seed, step)`: which training examples (`data.batch_indices`), which
target answer of each (`data.pick_target`), and the passages the retriever gives them
(`Retriever.for_step`: searched with the parameters the step trains, or found by the previous
step's in-step search). On several hosts each process assembles only its own block of every
global batch.

Legend: B batch, N docs, S context length, T target length, Q question length, P passage length.
"""

import dataclasses
import functools
import pathlib
import zlib
from typing import Any

import jax
import numpy as np

from rag_jax import rag
from rag_jax.devices import distributed
from rag_jax.model_inputs import answer_labels, context_width, label_width, question_tokens
from rag_jax.retrieval import encode
from rag_jax.retrieval.retriever import ClosedBook, Retrieved
from rag_jax.run import data, metrics
from rag_jax.training import optim
from rag_jax.training.memo import AnswerMemo
from rag_jax.training.step import candidate_count, searched_count


def batch_shapes(config, rag_cfg: rag.RagConfig, batch_size: int, passage_cfg=None) -> dict:
    """The arrays of the widest training batch `Batcher.train_batch` makes (contexts S, labels T
    wide) for `batch_size` questions, as `jax.ShapeDtypeStruct`s: what the trainer compiles
    first, and what a compile without data is made for (`benchmarks.aot`)."""
    # K candidates per question (rag.n_docs unless the retriever has its own objective).
    n, q, d = (
        candidate_count(config),
        config.data.question_length,
        rag_cfg.question_encoder.embedding_dim,
    )
    shapes = {
        "question_input_ids": ((batch_size, q), np.int32),
        "question_attention_mask": ((batch_size, q), np.int32),
        "doc_vectors": ((batch_size, n, d), np.float32),  # `Retriever.gather`'s float32 rows
        "context_input_ids": ((batch_size, n, rag_cfg.max_combined_length), np.int32),
        "context_attention_mask": ((batch_size, n, rag_cfg.max_combined_length), np.int32),
        "labels": ((batch_size, config.data.answer_length), np.int32),
    }
    if config.train.reader_trunk:  # the reader's frozen layers' states, at fixed widths
        width = rag_cfg.max_combined_length + config.data.answer_length  # S + T
        hidden = rag_cfg.generator.hidden_size
        shapes["reader_states"] = ((batch_size, n, width, hidden), np.float32)
        shapes["reader_mask"] = ((batch_size, n, width), np.int32)
        del shapes["context_input_ids"], shapes["context_attention_mask"]
    if config.retrieval.refresh_every:  # a trainable passage encoder re-encodes the passages
        p = config.retrieval.passage_max_length
        shapes["passage_input_ids"] = shapes["passage_attention_mask"] = (
            (batch_size, n, p),
            np.int32,
        )
        if config.retrieval.passage_head_layers:  # its top layers, from its lower ones' states
            hidden = (passage_cfg or rag_cfg.question_encoder).hidden_size
            shapes["passage_states"] = ((batch_size, n, p, hidden), np.float32)
            del shapes["passage_input_ids"]
    return {k: jax.ShapeDtypeStruct(shape, dtype) for k, (shape, dtype) in shapes.items()}


def memo_directory(exp) -> pathlib.Path:
    """Where a run's memos of its frozen generator are kept: `<warm_start.cache_dir or
    workdir>/answer_memo` (shared by the runs that share a cache_dir)."""
    return pathlib.Path(exp.config.warm_start.cache_dir or exp.workdir) / "answer_memo"


def answer_memo(exp, mesh) -> AnswerMemo:
    """The run's `AnswerMemo` (`train.answer_memo`), checked: the whole generator frozen, and
    the passages found between steps (an in-step search gives the host no prompts to key)."""
    c = exp.config
    trained = [
        path
        for path, label in jax.tree_util.tree_flatten_with_path(
            optim.path_labels({"generator": exp.params["generator"]}, c.train.freeze, 0, 1)
        )[0]
        if label
    ]
    if trained:
        name = "/".join(str(getattr(k, "key", k)) for k in trained[0][0])
        raise ValueError(
            f"config.train.answer_memo needs the whole generator frozen, but "
            f"config.train.freeze={c.train.freeze!r} leaves {len(trained)} of its parameters "
            f"trainable, e.g. {name}"
        )
    if exp.retriever.searches_in_step(mesh):
        raise ValueError(
            "config.train.answer_memo keys the prompts the host assembles; the in-step search "
            "finds passages inside the step: use config.retrieval.index exact or scann"
        )
    directory = memo_directory(exp)
    memo = AnswerMemo(exp.rag_cfg, exp.params["generator"], exp.generator_tokenizer, directory)
    print(f"answer memo: {len(memo)} pairs read from {memo.path}", flush=True)
    return memo


def shuffled_candidates(answer_logprobs: np.ndarray, seed: int, step: int, block: int):
    """[B, K, T] `answer_logprobs` with each question's K candidates permuted (a fixed function
    of the seed, step and process block): the shuffled-reader control, where a retriever that
    gains learned from something other than the reader's judgement of each passage."""
    rng = np.random.default_rng([seed, step, block, 0x5EED])
    order = np.argsort(rng.random(answer_logprobs.shape[:2]), axis=1)  # -> [B, K]
    return np.take_along_axis(answer_logprobs, order[:, :, None], axis=1)


def draw_negatives(
    question_ids: list[str], candidates: np.ndarray, excluded: list[set], count: int, rows: int,
    seed: int,
) -> np.ndarray:  # fmt: skip
    """[B, R] passage rows drawn uniformly from `rows` for each question: R = `count` distinct rows,
    none of its `candidates` [B, K] nor its `excluded` (its gold rows). Each question reads its own
    stream, a function of `seed` and its id alone, skipping the rows it may not take: the same
    question draws the same negatives in every batch, epoch and process while its candidates are
    (a clash with a changed candidate is redrawn from the same stream)."""
    drawn = np.zeros((len(question_ids), count), np.int64)
    for b, qid in enumerate(question_ids):
        barred = set(excluded[b]) | {int(j) for j in candidates[b]}
        free = rows - sum(1 for j in barred if 0 <= j < rows)
        if free < count:
            raise ValueError(
                f"config.train.retriever_random_negatives={count} but the corpus of {rows} "
                f"passages has only {free} outside question {qid!r}'s candidates and gold "
                "passages"
            )
        rng = np.random.default_rng([seed, zlib.crc32(qid.encode()), 0x4E4547])
        taken: list[int] = []
        while len(taken) < count:
            for j in rng.integers(0, rows, size=2 * count + 8).tolist():
                if j not in barred and len(taken) < count:
                    taken.append(j)
                    barred.add(j)
        drawn[b] = taken
    return drawn


@dataclasses.dataclass
class TrainBatch:
    """One training batch, this process's rows."""

    arrays: dict  # host arrays, [local B, ...] (per-doc tokens [local B, N, L])
    retrieval: Any  # the train step's `retrieval` argument (`Retriever.for_step`)
    recall: dict  # answer recall@N over the global batch, as (sum, count)


def no_negatives(examples, doc_ids: np.ndarray, ids, text) -> np.ndarray:
    """[B, K] bool: which of each question's candidates `doc_ids` [B, K] the gold objective may
    not push away: a gold passage of it (`ids[j]` in its gold ids), or one whose `text(j)` holds
    one of its answers (`metrics.has_answer`; DPR's hard negatives hold none)."""
    return np.array(
        [
            [ids[int(j)] in e.gold_ids or metrics.has_answer(e.answers, text(int(j))) for j in row]
            for e, row in zip(examples, doc_ids, strict=True)
        ],
        bool,
    ).reshape(doc_ids.shape)


class Batcher:
    """Host-side batch assembly: tokens, labels and retrieval, deterministic in (seed, step).

    On several hosts each process assembles only its block of every global batch (rows
    `distributed.process_block(mesh)`): its own questions, encoded in the global jitted call and
    searched in its own replica of a host index, or by all processes together in a `DeviceIndex`
    that spans the pod; `distributed.shard_batch` then joins the blocks.
    """

    def __init__(self, exp, mesh, train: bool = True):
        """Args:
        exp: the `experiment.Experiment` (config, tokenizers, store, training examples).
        mesh: the `data` mesh batches are sharded over.
        train: whether it makes training batches (with `train.answer_memo`, it then reads the
          answer memo); an evaluation's batcher only retrieves and assembles contexts.
        """
        self.exp, self.mesh = exp, mesh
        self.block, self.blocks = distributed.process_block(mesh)
        self.embed = jax.jit(functools.partial(rag.question_embeddings, exp.rag_cfg))
        self._prepared: dict[int, tuple] = {}  # step -> its parameter-free host work
        memoised = train and exp.config.train.answer_memo
        self.memo = answer_memo(exp, mesh) if memoised else None
        self._rows = None  # (store, passage id -> row): the gold objective's lookup
        self._fixed = None  # train.retriever_fixed_candidates: [len(train), K] rows

    def save_memo(self) -> None:
        """Writes the answer memo's new pairs (`train.answer_memo`; nothing without one)."""
        if self.memo is not None:
            self.memo.save()
            print(
                f"answer memo: {len(self.memo)} pairs ({self.memo.computed} computed, "
                f"{self.memo.reused} reused in this process)",
                flush=True,
            )

    def memo_pairs(self, params, examples, retriever, chunk: int = 256) -> tuple[list, list]:
        """The (prompt, answer) pairs training on `examples` asks the answer memo for while the
        question encoder is `params`': each example's K candidates (`step.candidate_count`), the
        prompt's real tokens and the target's labels as `train_batch` lays them out, for
        `AnswerMemo.fill` to compute ahead of training, grouped by shared passage.

        Args:
          params: the parameters whose question encoder retrieves (the run's initial ones:
            a frozen retriever's candidates, and a training one's first).
          examples: training examples (`data.target` must be "first": a sampled target
            changes with the step).
          retriever: the run's retriever.
          chunk: questions encoded and retrieved at a time.

        Returns:
          (prompts: M arrays [S_m] int32, answers: M label rows [T]), M = len(examples) * K.
        """
        c = self.exp.config
        if c.data.target != "first":
            raise ValueError(
                f"config.data.target={c.data.target!r}: a memo is filled ahead for the first "
                "answer only (a sampled target changes with the step)"
            )
        prompts, answers = [], []
        for part, hits, pieces in self._searched(params, examples, retriever, chunk):
            hits = self.with_negatives(part, hits, pieces, retriever)
            labels = answer_labels(
                self.exp.generator_tokenizer,
                [data.pick_target(e.answers, "first", c.seed, 0, 0) for e in part],
                self.exp.rag_cfg,
                c.data.answer_length,
            )
            k = hits.doc_ids.shape[1]
            for r in range(len(hits.context_input_ids)):
                real = hits.context_attention_mask[r] == 1
                prompts.append(hits.context_input_ids[r][real].astype(np.int32))
                answers.append(labels[r // k])
        return prompts, answers

    def _searched(self, params, examples, retriever, chunk: int):
        """(examples, their `Retrieved` K candidates under `params`' question encoder, their
        question pieces), `chunk` questions at a time, on this process's devices alone."""
        retriever = retriever.with_n_docs(searched_count(self.exp.config))
        for start in range(0, len(examples), chunk):
            part = examples[start : start + chunk]
            fields, pieces = self.questions(part)
            vectors = self.embed(
                params, fields["question_input_ids"], fields["question_attention_mask"]
            )  # -> [chunk, D], on one device: no batch to shard
            texts = [e.question for e in part]  # what a BM25 or hybrid source searches
            yield part, retriever(np.asarray(vectors), pieces, texts), pieces  # -> [chunk * K, S]

    def fixed_candidates(self, chunk: int = 256) -> np.ndarray:
        """[len(train), K] passage rows: every training question's top K under the run's
        initial question encoder and index (`train.retriever_fixed_candidates`), searched once
        (the same on a resumed run: a function of the initial parameters alone)."""
        if self._fixed is None and self.exp.reader_trunk is not None:  # searched at build
            self._fixed = self.exp.reader_trunk.candidates
        if self._fixed is None:
            exp = self.exp
            found = [
                h.doc_ids for _, h, _ in self._searched(exp.params, exp.train, exp.retriever, chunk)
            ]
            self._fixed = np.concatenate(found).astype(np.int64)
        return self._fixed

    def questions(self, examples):
        c = self.exp.config
        fields = question_tokens(
            self.exp.question_tokenizer, [e.question for e in examples], c.data.question_length
        )
        pieces = self.exp.store.tokenize_questions(
            self.exp.generator_tokenizer, [e.question for e in examples]
        )
        return fields, pieces

    def question_vectors(self, params, fields) -> jax.Array:
        """[B, D] question vectors of this process's rows `fields`, the global batch sharded
        over the mesh (a collective on several processes)."""
        ids, mask = distributed.shard_batch(
            self.mesh, (fields["question_input_ids"], fields["question_attention_mask"])
        )
        return self.embed(params, ids, mask)

    def retrieve(self, params, fields, pieces, retriever, questions=None) -> Retrieved:
        """Encodes with the question encoder in `params` and retrieves for this process's rows
        (`Retriever.retrieve`; `questions`, their texts, for a BM25 or hybrid source)."""
        vectors = self.question_vectors(params, fields)
        return retriever.retrieve(vectors, pieces, self.mesh, questions)

    def contexts(self, hits: Retrieved) -> tuple[np.ndarray, np.ndarray]:
        """The generator inputs [local B * N, W] of `hits`, W = `context_width` of the global
        batch (a collective on several processes: every process pads to the longest of all)."""
        width = distributed.max_over_processes(
            context_width(
                hits.context_attention_mask,
                self.exp.rag_cfg.max_combined_length,
                self.exp.config.rag.context_pad_multiple,
            )
        )
        return hits.context_input_ids[:, :width], hits.context_attention_mask[:, :width]

    def passage_tokens(self, doc_ids: np.ndarray, store) -> tuple[np.ndarray, np.ndarray]:
        """Passage-encoder inputs [B * N, P] of the retrieved passages, as the index reads them."""
        c = self.exp.config
        rows = encode.tokenize_passages(
            self.exp.question_tokenizer,
            [store.title(int(j)) for j in doc_ids.reshape(-1)],
            [store.text(int(j)) for j in doc_ids.reshape(-1)],
            max_length=c.retrieval.passage_max_length,
            input_format=c.retrieval.passage_format,
        )
        length = c.retrieval.passage_max_length
        ids = np.full((len(rows), length), self.exp.question_tokenizer.pad_token_id, np.int32)
        mask = np.zeros((len(rows), length), np.int32)
        for i, row in enumerate(rows):
            ids[i, : len(row)], mask[i, : len(row)] = row, 1
        return ids, mask

    def _row_lookup(self, store) -> dict:
        """Passage id -> row of `store` (kept for the store it was made for)."""
        if self._rows is None or self._rows[0] is not store:
            self._rows = (store, {store.ids[i]: i for i in range(len(store))})
        return self._rows[1]

    def with_negatives(self, examples, hits: Retrieved, pieces, retriever) -> Retrieved:
        """`hits` with each question's `train.retriever_random_negatives` rows (`draw_negatives`,
        none of its gold passages) appended after its candidates; `hits` itself without any."""
        count = self.exp.config.train.retriever_random_negatives
        if not count:
            return hits
        rows = self._row_lookup(retriever.store)
        gold = [{rows[g] for g in e.gold_ids if g in rows} for e in examples]
        drawn = draw_negatives(
            [e.id for e in examples], hits.doc_ids, gold, count, retriever.index.count,
            self.exp.config.seed,
        )  # fmt: skip
        ids = np.concatenate([hits.doc_ids, drawn], axis=1)  # -> [B, K + R]
        scores = np.concatenate([hits.index_scores, np.full(drawn.shape, np.nan)], axis=1)
        return retriever.with_n_docs(ids.shape[1]).gather(ids, pieces, scores)

    def gold_arrays(self, examples, doc_ids: np.ndarray, retriever) -> dict[str, np.ndarray]:
        """The `gold` objective's inputs: each question's (first) gold passage's stored vector
        [B, D] and which of its candidates [B, K] are no negative of it: a gold passage of it, or
        one that holds one of its answers (DPR's hard negatives hold none)."""
        store = retriever.store
        rows = self._row_lookup(store)
        gold = []
        for e in examples:
            known = [rows[g] for g in e.gold_ids if g in rows]
            if not known:
                raise ValueError(
                    f"config.train.retriever_loss='gold': question {e.id!r} has no gold passage "
                    f"in the corpus (gold_ids {list(e.gold_ids)})"
                )
            gold.append(known[0])
        is_gold = no_negatives(examples, doc_ids, store.ids, store.text)
        vectors = np.asarray(retriever.vectors[np.array(gold)], np.float32)  # -> [B, D]
        return {"gold_vectors": vectors, "candidate_is_gold": is_gold}

    def _examples(self, step: int):
        """This process's rows of batch `step`: (their train-set indices, the examples)."""
        c = self.exp.config
        idx = data.batch_indices(
            len(self.exp.train),
            c.train.batch_size,
            c.seed,
            step,
            process_index=self.block,
            process_count=self.blocks,
        )  # -> [local B]: this process's rows of the global batch
        return idx, [self.exp.train[i] for i in idx]

    def prepare(self, step: int) -> None:
        """Does batch `step`'s work that needs no parameters (example choice, question tokens,
        labels) now, e.g. while the device runs the previous step; `train_batch` then uses it."""
        if step in self._prepared:
            return
        c = self.exp.config
        idx, examples = self._examples(step)
        targets = [
            data.pick_target(e.answers, c.data.target, c.seed, step, int(i))
            for e, i in zip(examples, idx)
        ]
        fields, pieces = self.questions(examples)
        labels = answer_labels(
            self.exp.generator_tokenizer, targets, self.exp.rag_cfg, c.data.answer_length
        )
        self._prepared[step] = (examples, fields, pieces, labels)

    def prepare_ahead(self, step: int) -> None:
        """Prepares the batches the next `train_batch(step)` reads: `step`, and `step + 1` (whose
        questions an in-step search embeds)."""
        self.prepare(step)
        self.prepare(step + 1)

    def question_fields(self, step: int) -> dict[str, np.ndarray]:
        """Question-encoder inputs of batch `step` (this process's rows), for an in-step search."""
        self.prepare(step)
        return self._prepared[step][1]

    def train_batch(self, state, step: int, retriever) -> TrainBatch:
        """Batch `step` (this process's rows), its passages from `retriever` for the parameters
        of `state`, and its answer recall over the global batch."""
        c = self.exp.config
        self.prepare(step)
        examples, fields, pieces, labels = self._prepared[step]
        trunk = self.exp.reader_trunk  # its rows' labels are T wide: the batch's stay so
        if trunk is None:  # every process pads to the global batch's longest
            width = distributed.max_over_processes(
                label_width(
                    labels,
                    self.exp.rag_cfg.generator.pad_token_id,
                    c.data.answer_length,
                    c.data.answer_pad_multiple,
                    self.exp.rag_cfg.generator.eos_token_id if self.exp.rag_cfg.causal else None,
                )
            )
            labels = labels[:, :width]
        n_docs = self.exp.rag_cfg.n_docs
        if not isinstance(retriever, ClosedBook):  # K >= N candidates: the retriever's own loss
            retriever = retriever.with_n_docs(searched_count(c))
        if c.train.retriever_fixed_candidates:  # searched once, before training
            idx = self._examples(step)[0]
            hits, retrieval = retriever.gather(self.fixed_candidates()[idx], pieces), None
        else:
            hits, retrieval = retriever.for_step(
                state.next_doc_ids,
                lambda: self.question_vectors(state.params, fields),
                pieces,
                lambda: distributed.shard_batch(self.mesh, self.question_fields(step + 1)),
                self.mesh,
                [e.question for e in examples],
            )
        if not isinstance(retriever, ClosedBook):  # then any random negatives after them
            hits = self.with_negatives(examples, hits, pieces, retriever)
        self._prepared = {k: v for k, v in self._prepared.items() if k > step}
        shape = hits.doc_ids.shape + (-1,)  # -> [B, N, S]
        context_ids, context_mask = self.contexts(hits)
        arrays = dict(fields, doc_vectors=hits.doc_vectors, labels=labels)
        if self.memo is not None:  # the frozen generator's likelihoods replace its inputs,
            if c.train.retriever_loss != "gold":  # gold does not read them: they train nothing
                arrays["answer_logprobs"] = self.memo.logprobs(
                    state.params["generator"], context_ids, context_mask, labels
                )
        elif trunk is not None:  # the reader's frozen layers' states replace its inputs
            arrays.update(trunk.arrays(self._examples(step)[0], hits.doc_ids))
        else:
            arrays.update(
                context_input_ids=context_ids.reshape(shape),
                context_attention_mask=context_mask.reshape(shape),
            )
        if c.train.retriever_shuffle_reader:  # the control: the reader's judgement scrambled
            arrays["answer_logprobs"] = shuffled_candidates(
                arrays["answer_logprobs"], c.seed, step, self.block
            )
        if c.train.retriever_loss == "gold":  # the supervised control's gold passages
            arrays.update(self.gold_arrays(examples, hits.doc_ids, retriever))
        if self.exp.passage_trunk is not None:  # its top layers, from its lower ones' states
            states, mask = self.exp.passage_trunk.gather(hits.doc_ids.reshape(-1))
            per_doc = hits.doc_ids.shape  # [B, K]
            arrays.update(
                passage_states=states.reshape(*per_doc, *states.shape[1:]),
                passage_attention_mask=mask.reshape(*per_doc, -1),
            )
        elif c.retrieval.refresh_every:  # a trainable passage encoder re-encodes them
            ids, mask = self.passage_tokens(hits.doc_ids, retriever.store)
            arrays.update(
                passage_input_ids=ids.reshape(shape), passage_attention_mask=mask.reshape(shape)
            )
        recall = {}
        if not isinstance(retriever, ClosedBook):
            recall = metrics.answer_recall(
                [e.answers for e in examples],
                [[retriever.store.text(int(j)) for j in row[:n_docs]] for row in hits.doc_ids],
                [n_docs],
            )
        return TrainBatch(arrays, retrieval, distributed.sum_over_processes(recall))
