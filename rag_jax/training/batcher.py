"""Host-side batch assembly for joint training: question tokens, answer labels and retrieval.

A batch is a pure function of `(seed, step)`: which training examples (`data.batch_indices`), which
target answer of each (`data.pick_target`), and the passages the question encoder retrieves for
them (searched with the parameters the step trains, or given by the previous step's in-step
search). On several hosts each process assembles only its own block of every global batch.

Legend: B batch, N docs, S context length, T target length, Q question length, P passage length.
"""

import functools

import jax
import numpy as np

from rag_jax import data, experiment, metrics, rag, sharding
from rag_jax.retrieval import encode, retriever
from rag_jax.retrieval.device_index import DeviceIndex
from rag_jax.training.inputs import answer_labels, context_width, label_width, question_tokens


class Batcher:
    """Host-side batch assembly: tokens, labels and retrieval, deterministic in (seed, step).

    On several hosts each process assembles only its block of every global batch (rows
    `sharding.process_block(mesh)`): its own questions, encoded in the global jitted call and
    searched in its own replica of a host index, or by all processes together in a `DeviceIndex`
    that spans the pod; `sharding.shard_batch` then joins the blocks.
    """

    def __init__(self, exp: experiment.Experiment, mesh):
        self.exp, self.mesh = exp, mesh
        self.block, self.blocks = sharding.process_block(mesh)
        self.embed = jax.jit(functools.partial(rag.question_embeddings, exp.rag_cfg))
        self._prepared: dict[int, tuple] = {}  # step -> its parameter-free host work

    def questions(self, examples):
        c = self.exp.config
        fields = question_tokens(
            self.exp.question_tokenizer, [e.question for e in examples], c.data.question_length
        )
        pieces = self.exp.store.tokenize_questions(
            self.exp.generator_tokenizer, [e.question for e in examples]
        )
        return fields, pieces

    def retrieve(self, params, fields, pieces):
        """Encodes with the current question encoder and retrieves; returns host arrays.

        `fields` and `pieces` hold this process's rows; so does the result. A `DeviceIndex`
        that spans processes is searched by all of them together with the global batch; any
        other index is this process's own and searched with its rows only.
        """
        ids, mask = sharding.shard_batch(
            self.mesh, (fields["question_input_ids"], fields["question_attention_mask"])
        )
        q = self.embed(params, ids, mask)  # -> [B, D], sharded over the batch
        index = getattr(self.exp.retriever, "index", None)  # ClosedBook has none
        if isinstance(index, DeviceIndex) and not index.vectors.is_fully_addressable:
            scores, doc_ids = index.search(q, self.exp.rag_cfg.n_docs)  # -> [B, N] replicated
            own = functools.partial(sharding.own_rows, mesh=self.mesh)
            return self.exp.retriever.gather(own(doc_ids), pieces, own(scores))
        return self.exp.retriever(sharding.local_rows(q), pieces)  # [local B, D] queries

    def contexts(self, hits: retriever.Retrieved) -> tuple[np.ndarray, np.ndarray]:
        """The generator inputs [local B * N, W] of `hits`, W = `context_width` of the global
        batch (a collective on several processes: every process pads to the longest of all)."""
        width = sharding.max_over_processes(
            context_width(
                hits.context_attention_mask,
                self.exp.rag_cfg.max_combined_length,
                self.exp.config.rag.context_pad_multiple,
            )
        )
        return hits.context_input_ids[:, :width], hits.context_attention_mask[:, :width]

    def passage_tokens(self, doc_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Passage-encoder inputs [B * N, P] of the retrieved passages, as the index reads them."""
        c, store = self.exp.config, self.exp.store
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

    def question_fields(self, step: int) -> dict[str, np.ndarray]:
        """Question-encoder inputs of batch `step` (this process's rows), for an in-step search."""
        self.prepare(step)
        return self._prepared[step][1]

    def train_batch(self, params, step: int, doc_ids: np.ndarray | None = None):
        """Batch `step` (this process's rows) and its answer recall over the global batch.

        The passages are retrieved with the question encoder in `params`, or are `doc_ids`
        [local B, N] when the previous step already searched for them (`params` unused).
        """
        c = self.exp.config
        self.prepare(step)
        examples, fields, pieces, labels = self._prepared[step]
        self._prepared = {k: v for k, v in self._prepared.items() if k > step}
        width = sharding.max_over_processes(  # every process pads to the global batch's longest
            label_width(
                labels,
                self.exp.rag_cfg.generator.pad_token_id,
                c.data.answer_length,
                c.data.answer_pad_multiple,
            )
        )
        labels = labels[:, :width]
        if doc_ids is None:
            hits = self.retrieve(params, fields, pieces)
        else:
            hits = self.exp.retriever.gather(doc_ids, pieces)
        shape = hits.doc_ids.shape + (-1,)  # -> [B, N, S]
        context_ids, context_mask = self.contexts(hits)
        batch = dict(
            fields,
            doc_vectors=hits.doc_vectors,
            context_input_ids=context_ids.reshape(shape),
            context_attention_mask=context_mask.reshape(shape),
            labels=labels,
        )
        if c.retrieval.refresh_every:  # a trainable passage encoder re-encodes them
            ids, mask = self.passage_tokens(hits.doc_ids)
            batch.update(
                passage_input_ids=ids.reshape(shape), passage_attention_mask=mask.reshape(shape)
            )
        recall = {}
        if not isinstance(self.exp.retriever, retriever.ClosedBook):
            recall = metrics.answer_recall(
                [e.answers for e in examples],
                [[self.exp.store.text(int(j)) for j in row] for row in hits.doc_ids],
                [self.exp.rag_cfg.n_docs],
            )
        return batch, sharding.sum_over_processes(recall)  # over the global batch
