"""The causal reader trained at its top on its lower layers' cached states (`train.reader_trunk`).

With `model.generator_trained_layers = k` the reader's embedding and its bottom F = L - k layers
are frozen (`LlamaConfig.frozen_layers = F`, `train.freeze`); with
`train.retriever_fixed_candidates` every training question's candidates are fixed before training
(its random negatives with them: a function of the question and its candidates), and with
`data.target = "first"` its labels. Every (prompt, labels) row a train step's reader reads is then
known before the first step, and so are the states its real tokens enter layer F with.

`build` lays those rows out as `Batcher.train_batch` does (each candidate's prompt as the store
assembles it, its real tokens only; the question's labels at the full `data.answer_length`, which
the batches then keep, untrimmed), and computes their trunk states once
(`reader_trunk.open_or_build`, under `<retrieval.cache_dir or workdir>/reader_trunk`, keyed by
the trunk's fingerprint, F, the compute dtype, the rows and `layout`). A batch then carries
`ReaderStates.arrays`' "reader_states" / "reader_mask" [B, C, S + T(, H)] in place of its context
tokens, S = `rag.max_combined_length` whatever its prompts' widths (one compiled step), and the
step runs only the layers from F up on them (`causal.reader_inputs`): the whole reader's loss and
gradients, to float32 rounding (`tests/training/reader_trunk_step_test.py`). Evaluation and
decoding read the tokens with the whole reader, as without the cache.

Legend: Q training questions, K fixed candidates each, C = K + R with R random negatives, S prompt
width, T label width, H hidden.
"""

import dataclasses
import json
import pathlib
import re

import jax
import numpy as np

from rag_jax.devices import distributed, sharding
from rag_jax.model_inputs import answer_labels
from rag_jax.retrieval.tokenizer_id import tokenizer_fingerprint
from rag_jax.run import data
from rag_jax.training import reader_trunk
from rag_jax.training.batcher import Batcher
from rag_jax.training.step import searched_count

CHUNK = 256  # questions whose rows are laid out at a time


@dataclasses.dataclass(frozen=True)
class ReaderStates:
    """The trunk states of every training question's C candidates' rows, row q * C + c."""

    trunk: reader_trunk.ReaderTrunk
    doc_ids: np.ndarray  # [Q, C] int64 passage rows: the K fixed candidates, then R negatives
    searched: int  # K
    prompt_width: int  # S, the prompt width of every batch (`rag.max_combined_length`)

    @property
    def first_layer(self) -> int:
        return self.trunk.first_layer

    @property
    def candidates(self) -> np.ndarray:
        """[Q, K] the fixed candidates (`Batcher.fixed_candidates`), searched once by `build`."""
        return self.doc_ids[:, : self.searched]

    def arrays(self, questions, doc_ids) -> dict[str, np.ndarray]:
        """A batch's "reader_states" [b, C, S + T, H] float32 and "reader_mask" [b, C, S + T]
        int32 of training questions `questions` [b], whose candidates are `doc_ids` [b, C]
        (checked: the rows' own)."""
        questions = np.asarray(questions, np.int64).reshape(-1)
        count = self.doc_ids.shape[1]
        if not np.array_equal(np.asarray(doc_ids), self.doc_ids[questions]):
            raise ValueError(
                f"the batch's candidates {np.asarray(doc_ids).tolist()} of training questions "
                f"{questions.tolist()} are not the ones whose reader states are cached "
                f"{self.doc_ids[questions].tolist()} (config.train.reader_trunk needs the fixed "
                "candidates it was built for)"
            )
        rows = (questions[:, None] * count + np.arange(count)).reshape(-1)
        states, mask = self.trunk.gather(rows, self.prompt_width)
        return {
            "reader_states": states.reshape(len(questions), count, *states.shape[1:]),
            "reader_mask": mask.reshape(len(questions), count, -1),
        }

    def check_restored(self, cfg, generator_params) -> None:
        """Raises unless a restored reader's trunk (`generator_params`, arrays on the devices,
        replicated or split: a collective on several processes) is the one these states are of."""
        trunk = reader_trunk.trunk_of(generator_params, self.first_layer)
        self.trunk.check_trunk(cfg, distributed.state_to_host(trunk))


def root(config, workdir) -> pathlib.Path:
    """Where a run's reader trunk caches are kept: `<retrieval.cache_dir or workdir>/reader_trunk`
    (shared by the runs that share a cache_dir)."""
    r = config.retrieval
    return pathlib.Path(r.cache_dir or workdir) / "reader_trunk"


def layout(config, rag_cfg, tokenizer) -> str:
    """What makes a row's tokens besides its passage, question and answer: the generator's
    tokenizer, the prompt around passage and question, the prompt and label widths."""
    return json.dumps(
        {
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "prompt": rag_cfg.context_layout,
            "max_combined_length": rag_cfg.max_combined_length,
            "keep_question": bool(config.rag.keep_question),
            "answer_length": config.data.answer_length,
            "target": config.data.target,
        },
        sort_keys=True,
    )


def check(config, rag_cfg, params) -> int:
    """F, the layer the cached states enter, after the checks `validation` cannot make before
    the models are built: a causal reader whose frozen layers are exactly the trunk, and every
    trunk parameter (the embedding too, the LM head of a tied-embedding reader) frozen by
    `train.freeze`."""
    k = config.model.generator_trained_layers
    if not rag_cfg.causal:
        raise ValueError(
            "config.train.reader_trunk caches a causal reader's lower layers' states, but the "
            f"generator is {type(rag_cfg.generator).__name__} (set config.model.generator_path "
            "to a Llama-family checkpoint)"
        )
    g_cfg = rag_cfg.generator
    first = g_cfg.frozen_layers
    if not k or first != g_cfg.num_hidden_layers - k:
        raise ValueError(
            f"config.train.reader_trunk needs config.model.generator_trained_layers=k in [1, "
            f"{g_cfg.num_hidden_layers - 1}] (got {k}; the reader's frozen_layers is {first})"
        )
    reader_trunk.check_first_layer(g_cfg, first)
    trunk = reader_trunk.trunk_of(params["generator"], first)
    regex = re.compile(config.train.freeze) if config.train.freeze else None
    paths = [
        "generator/" + "/".join(str(getattr(p, "key", p)) for p in path)
        for path, _ in jax.tree_util.tree_flatten_with_path(trunk)[0]
    ]
    trained = [p for p in paths if regex is None or not regex.search(p)]
    if trained:
        tied = g_cfg.tie_word_embeddings and any("/embed_tokens/" in p for p in trained)
        raise ValueError(
            f"config.train.reader_trunk computes the states of the reader's embedding and layers "
            f"0 to {first - 1} once, so they must stay frozen, but config.train.freeze="
            f"{config.train.freeze!r} leaves {trained[:3]} trainable"
            + (" (the tied embedding is the LM head too: it stays frozen)" if tied else "")
        )
    return first


def rows(exp, batcher: Batcher) -> tuple[list, np.ndarray]:
    """Every training question's rows, as `Batcher.train_batch` lays them out: ([(prompt's real
    tokens [p] int32, labels [T] int32)] row q * C + c, the candidates [Q, C])."""
    c, tokenizer = exp.config, exp.generator_tokenizer
    fixed = batcher.fixed_candidates()  # -> [Q, K], searched once
    retriever = exp.retriever.with_n_docs(searched_count(c))
    out, doc_ids = [], []
    for start in range(0, len(exp.train), CHUNK):
        part = exp.train[start : start + CHUNK]
        pieces = exp.store.tokenize_questions(tokenizer, [e.question for e in part])
        hits = retriever.gather(fixed[start : start + len(part)], pieces)
        hits = batcher.with_negatives(part, hits, pieces, retriever)  # -> [b, C]
        targets = [
            data.pick_target(e.answers, c.data.target, c.seed, 0, start + i)
            for i, e in enumerate(part)
        ]
        labels = answer_labels(tokenizer, targets, exp.rag_cfg, c.data.answer_length)
        count = hits.doc_ids.shape[1]
        for r, (ids, mask) in enumerate(zip(hits.context_input_ids, hits.context_attention_mask)):
            out.append((ids[mask == 1].astype(np.int32), labels[r // count]))
        doc_ids.append(hits.doc_ids)
    return out, np.concatenate(doc_ids).astype(np.int64)


def build(exp) -> ReaderStates:
    """The run's `ReaderStates` (`train.reader_trunk`): its training questions' fixed candidates
    searched by its initial question encoder and retriever, their rows' trunk states read from
    the cache, or computed there now."""
    config = exp.config
    first = check(config, exp.rag_cfg, exp.params)
    batcher = Batcher(exp, sharding.data_mesh(), train=False)
    table, doc_ids = rows(exp, batcher)
    trunk = reader_trunk.open_or_build(
        root(config, exp.workdir),
        exp.rag_cfg.generator,
        exp.params["generator"],
        first,
        table,
        layout(config, exp.rag_cfg, exp.generator_tokenizer),
    )
    return ReaderStates(trunk, doc_ids, searched_count(config), exp.rag_cfg.max_combined_length)
