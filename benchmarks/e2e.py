"""Suite `e2e`: one full training step with retrieval in the loop, rag_jax vs the HF RAG pipeline.

A step is what joint RAG training does per batch: encode the questions with the current question
encoder, search the passage index, gather the hits' stored vectors and build the generator's
contexts (passage + question tokens), then the joint step (doc scores recomputed from the question
encoder, RAG-Sequence loss, backward, AdamW). Each phase is timed on its own, for both pipelines:

- rag_jax, as `rag_jax.training.loop` runs it: jitted `rag.question_embeddings` + `device_get`
  (encode), `ExactIndex.search` (search), stored vectors + `PassageStore.tokenize_questions` /
  `context_tokens` over the pre-tokenised passage store, padded to the batch's longest context
  rounded up to 16 (`context_width`, the trainer's default), and the labels to their
  longest rounded up to 8 (`label_width`) (gather), the trainer's
  jitted, donated `make_train_step` with the trainer's AdamW (step).
- HF, as `RagModel.forward` runs it with a retriever attached: the question encoder's forward with
  autograd on (encode; its backward is in the step), transformers `RagRetriever` over a custom
  faiss `IndexFlatIP` (a subclass of `retrieval_rag.Index`; exact search, as ours) (search),
  `get_doc_dicts` + decoding the question ids + `postprocess_docs`, which joins title, text and
  question strings and tokenises them, padded to `max_combined_length` (S = 128) (gather),
  `bmm` doc scores + `RagSequenceForGeneration` forward with the contexts + backward +
  `torch.optim.AdamW` (step). Its labels are trimmed to the batch's longest, as HF's RAG
  fine-tuning collator does (`trim_batch`; untimed, a data loader's work).

Same tiny models as the `train_step` suite (the HF model is saved and loaded with `hf.load_rag`),
same passages (random words of a 995-word vocabulary, C >= 100k), same passage vectors, same
questions and labels, float32, dropout off, the benchmark's threads for torch and faiss. The two
pipelines alternate single steps, each on the next batch of questions and each after a pause
(`common.settle`: the other side's threads stop spinning), after a warm-up (jit compilation for
rag_jax). The first batch checks that both retrieve the same passages, build the
same context tokens (HF's past rag_jax's width being padding only) and compute the same loss.
Contexts here are ~75 tokens (60-word passages, 8-word questions), so HF's layout is ~40%
padding, which its generator encodes and attends over; rag_jax's trainer drops the columns that
are padding in every row of the batch (the loss and gradients are unchanged; see
`tests/context_width_test.py`).

The floor (`bench/floor.py`): rag_jax's joint step's matmuls, each alone by the fastest kernel at
hand, plus one AdamW update alone, at the widest step's shapes. The goal leaves the step the
reference pipeline's fastest time over 2, less rag_jax's fastest encode + search + gather; below
the floor, no implementation of the same step reaches it on this machine.

Legend: B questions, N docs, S context length, T target length, Q question length, C passages,
D vector width.
"""

import itertools
import pathlib
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from transformers.models.rag import retrieval_rag

from benchmarks import common
from benchmarks import floor as step_floor
from benchmarks import train_step as ts
from rag_jax import rag
from rag_jax.io import hf
from rag_jax.model_inputs import answer_labels, context_width, label_width, question_tokens
from rag_jax.retrieval.corpus import Passage
from rag_jax.retrieval.index import ExactIndex
from rag_jax.retrieval.retriever import Retriever
from rag_jax.run.index_build import workdir_store
from rag_jax.training.step import init_state

N_DOCS, CONTEXT, TARGET, QUESTION = ts.N_DOCS, ts.CONTEXT, ts.TARGET, ts.QUESTION
PASSAGE_WORDS, QUESTION_WORDS = 60, 8
CONTEXT_PAD_MULTIPLE = 16  # the trainer's default (config.rag.context_pad_multiple)
LABEL_PAD_MULTIPLE = 8  # the trainer's default (config.data.answer_pad_multiple)
# (C passages, B questions, timed steps per pipeline, warm-up steps)
FULL = (100_000, 8, 20, 3)
QUICK = (10_000, 4, 3, 2)
# BART's special ids (bos 0, pad 1, eos 2) at the same rows of a WordPiece vocabulary.
SPECIALS = ["[CLS]", "[PAD]", "[SEP]", "[UNK]", "[MASK]"]
PAD_ID = SPECIALS.index("[PAD]")


def words(count: int, seed: int = 0) -> list[str]:
    """`count` distinct lowercase two-syllable words (each one WordPiece token)."""
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    pairs = ["".join(p) for p in itertools.product(syllables, repeat=2)]
    order = np.random.default_rng(seed).permutation(len(pairs))[:count]
    return [pairs[i] for i in order]


def tokenizer(vocab_words: list[str]) -> transformers.PreTrainedTokenizerBase:
    vocab = {token: i for i, token in enumerate(SPECIALS + vocab_words)}
    return transformers.BertTokenizer(vocab=vocab)


def make_corpus(vocab_words, count: int, seed: int = 1) -> list[Passage]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, len(vocab_words), size=(count, PASSAGE_WORDS + 2))
    return [
        Passage(
            str(i),
            " ".join(vocab_words[j] for j in row[:2]),
            " ".join(vocab_words[j] for j in row[2:]),
        )
        for i, row in enumerate(ids)
    ]


class FaissIndex(retrieval_rag.Index):
    """HF's index interface over a faiss exact inner-product index and in-memory passages."""

    def __init__(self, vectors: np.ndarray, passages: list[Passage]):
        import faiss

        self.vectors = vectors  # [C, D]
        self.titles = [p.title for p in passages]
        self.texts = [p.text for p in passages]
        self.index = faiss.IndexFlatIP(vectors.shape[1])
        self.index.add(vectors)

    def get_doc_dicts(self, doc_ids):
        return [
            {"title": [self.titles[i] for i in row], "text": [self.texts[i] for i in row]}
            for row in doc_ids
        ]

    def get_top_docs(self, question_hidden_states, n_docs=5):
        _, ids = self.index.search(np.ascontiguousarray(question_hidden_states, np.float32), n_docs)
        return ids, self.vectors[ids]  # [B, N], [B, N, D]

    def is_initialized(self):
        return True

    def init_index(self):
        pass


def _clock():
    return time.perf_counter()


class Ours:
    """rag_jax's step, phase by phase, as `rag_jax.training.loop` runs it (one device)."""

    def __init__(self, cfg, params, store, vectors, g_tok):
        self.cfg, self.store, self.g_tok = cfg, store, g_tok
        index = ExactIndex(vectors, corpus_checksum=store.checksum)
        self.retriever = Retriever(
            index, store, vectors, n_docs=N_DOCS, max_combined_length=CONTEXT
        )
        self.step_fn, tx = ts._jax_train_step(cfg, "sequence")  # the trainer's step, AdamW
        params = jax.tree.map(jnp.array, params)  # copies: the step donates them
        self.state = init_state(params, tx)
        self.embed = jax.jit(lambda p, ids, mask: rag.question_embeddings(cfg, p, ids, mask))
        self.widest = None  # the device batch of the widest step so far

    def step(self, batch) -> tuple[dict, float, dict]:
        t0 = _clock()
        q = jax.device_get(
            self.embed(
                self.state.params, batch["question_input_ids"], batch["question_attention_mask"]
            )
        )  # -> [B, D]
        t1 = _clock()
        _, ids = self.retriever.index.search(np.asarray(q, np.float32), N_DOCS)  # -> [B, N]
        t2 = _clock()
        ids = ids.astype(np.int64)
        doc_vectors = self.retriever.vectors[ids.reshape(-1)].reshape(
            ids.shape + (-1,)
        )  # [B, N, D]
        pieces = self.store.tokenize_questions(self.g_tok, batch["questions"])
        ctx, ctx_mask = self.store.context_tokens(ids, pieces, CONTEXT)  # -> [B * N, S]
        width = context_width(ctx_mask, CONTEXT, CONTEXT_PAD_MULTIPLE)
        ctx, ctx_mask = ctx[:, :width], ctx_mask[:, :width]  # as the trainer's Batcher does
        labels = batch["labels"]
        labels = labels[:, : label_width(labels, PAD_ID, TARGET, LABEL_PAD_MULTIPLE)]
        t3 = _clock()
        device_batch = {
            "question_input_ids": batch["question_input_ids"],
            "question_attention_mask": batch["question_attention_mask"],
            "doc_vectors": doc_vectors,
            "context_input_ids": ctx.reshape(ids.shape + (-1,)),  # -> [B, N, S]
            "context_attention_mask": ctx_mask.reshape(ids.shape + (-1,)),
            "labels": labels,
        }
        device_batch = jax.device_put(device_batch)
        if self.widest is None or width > self.widest["context_input_ids"].shape[-1]:
            self.widest = device_batch  # the floor is taken at the widest step
        self.state, metrics = self.step_fn(self.state, device_batch)
        loss_sum, count = jax.device_get(metrics["loss"])  # blocks until the step is done
        t4 = _clock()
        times = {"encode": t1 - t0, "search": t2 - t1, "gather": t3 - t2, "step": t4 - t3}
        out = {"doc_ids": ids, "context_input_ids": ctx, "label_width": labels.shape[-1]}
        return times, float(loss_sum / count), out


class Reference:
    """HF's step, phase by phase, as `RagModel.forward` runs it with its retriever."""

    def __init__(self, model, retriever, q_tok):
        self.model, self.retriever, self.q_tok = model, retriever, q_tok
        model.train()  # dropout is 0: train mode only keeps autograd's bookkeeping
        self.opt = torch.optim.AdamW(
            model.parameters(),
            lr=ts.LEARNING_RATE,
            betas=ts.BETAS,
            eps=ts.EPS,
            weight_decay=ts.WEIGHT_DECAY,
        )

    def step(self, batch) -> tuple[dict, float, dict]:
        q_ids = torch.from_numpy(batch["question_input_ids"].astype(np.int64))
        q_mask = torch.from_numpy(batch["question_attention_mask"].astype(np.int64))
        labels = batch["labels"]
        labels = labels[:, (labels != PAD_ID).any(axis=0)]  # HF's fine-tuning collator's trim_batch
        labels = torch.from_numpy(labels.astype(np.int64))
        self.opt.zero_grad(set_to_none=True)
        t0 = _clock()
        q = self.model.rag.question_encoder(q_ids, attention_mask=q_mask)[0]  # -> [B, D]
        t1 = _clock()
        ids, doc_embeds = self.retriever._main_retrieve(q.detach().numpy(), N_DOCS)
        t2 = _clock()
        docs = self.retriever.index.get_doc_dicts(ids)
        strings = self.q_tok.batch_decode(q_ids, skip_special_tokens=True)
        ctx, ctx_mask = self.retriever.postprocess_docs(
            docs, strings, None, N_DOCS, return_tensors="pt"
        )
        doc_embeds = torch.from_numpy(doc_embeds)
        t3 = _clock()
        doc_scores = torch.bmm(q.unsqueeze(1), doc_embeds.transpose(1, 2)).squeeze(1)  # [B, N]
        out = self.model(
            context_input_ids=ctx,
            context_attention_mask=ctx_mask,
            doc_scores=doc_scores,
            labels=labels,
            reduce_loss=False,
        )
        loss = out.loss.mean()
        loss.backward()
        self.opt.step()
        loss = float(loss.detach())
        t4 = _clock()
        times = {"encode": t1 - t0, "search": t2 - t1, "gather": t3 - t2, "step": t4 - t3}
        out = {"doc_ids": ids, "context_input_ids": ctx.numpy(), "label_width": labels.shape[-1]}
        return times, loss, out


def make_batches(vocab_words, q_tok, g_tok, cfg, count: int, batch: int, seed: int = 2) -> list:
    """`count` batches of B random questions (tokenised for the question encoder) and labels."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        questions = [
            " ".join(vocab_words[j] for j in rng.integers(0, len(vocab_words), QUESTION_WORDS))
            for _ in range(batch)
        ]
        answers = [
            " ".join(vocab_words[j] for j in rng.integers(0, len(vocab_words), rng.integers(1, 4)))
            for _ in range(batch)
        ]
        enc = question_tokens(q_tok, questions, QUESTION)
        out.append(
            dict(enc, questions=questions, labels=answer_labels(g_tok, answers, cfg, TARGET))
        )
    return out


def _check_same_work(ours_out, ref_out, ours_loss, ref_loss) -> dict:
    """The first batch: same retrieved passages, same context tokens, same loss."""
    np.testing.assert_array_equal(ours_out["doc_ids"], ref_out["doc_ids"])
    ours_ctx, ref_ctx = ours_out["context_input_ids"], ref_out["context_input_ids"]
    width = ours_ctx.shape[-1]  # ours: the batch's longest context; HF: always S
    np.testing.assert_array_equal(ours_ctx, ref_ctx[:, :width])
    if (ref_ctx[:, width:] != PAD_ID).any():
        raise AssertionError(f"the contexts were cut at {width} columns but are longer")
    rel = abs(ours_loss - ref_loss) / abs(ref_loss)
    if rel > 1e-4:
        raise AssertionError(f"first-step losses differ: ours {ours_loss}, HF {ref_loss}")
    return {"loss_ours": ours_loss, "loss_ref": ref_loss, "loss_rel_diff": rel}


def _floor(ours: Ours, ours_times, ref_times) -> dict:
    """rag_jax's joint step's floor (`floor.step_floor`, at the widest step's shapes) against the
    step time the goal leaves once rag_jax's other phases take their fastest measured times."""
    out = step_floor.step_floor(
        ours.step_fn, (ours.state, ours.widest), ours.state.params, ts.ADAMW
    )
    goal = min(sum(t.values()) for t in ref_times) / 2
    others = min(t["encode"] + t["search"] + t["gather"] for t in ours_times)
    result = {
        "goal_ms": 1e3 * goal,
        "ours_other_phases_min_ms": 1e3 * others,
        "goal_step_ms": 1e3 * (goal - others),
        "step_floor_ms": out["ms"],
        "floor": out,
    }
    print(
        f"  2x needs a {result['goal_ms']:.1f} ms pipeline: with rag_jax's encode + search + "
        f"gather at their fastest ({result['ours_other_phases_min_ms']:.1f} ms), a "
        f"{result['goal_step_ms']:.1f} ms step, against the step's floor of {out['ms']:.1f} ms "
        f"(matmuls {out['matmuls']['ms']:.1f}, AdamW {out['adamw']['ms']:.1f}; XLA's matmuls "
        f"alone {out['matmuls']['xla_ms']:.1f})",
        flush=True,
    )
    return result


def _roofline(cfg, batch: int, ours_times, ref_times, widths, quick: bool) -> dict:
    """Both joint steps' model FLOP rates against this machine's matmul peak, and the rate
    rag_jax's step would need for the whole pipeline to be 2x HF's with every other phase free.

    `widths`: {"context": rag_jax's context widths, "label": its label widths, "ref_label": HF's
    label widths}, one per timed step; each side's FLOPs are counted at its widest."""
    peak = common.matmul_peak(512 if quick else 2048)
    ours_flops = ts.step_flops(cfg, batch, max(widths["context"]), max(widths["label"]))
    ref_flops = ts.step_flops(cfg, batch, CONTEXT, max(widths["ref_label"]))
    ours_step = min(t["step"] for t in ours_times)
    ref_step = min(t["step"] for t in ref_times)
    ref_total = min(sum(t.values()) for t in ref_times)
    out = {
        "matmul_peak": peak,
        "ours_context_widths": sorted(set(widths["context"])),
        "ours_label_widths": sorted(set(widths["label"])),
        "ref_label_widths": sorted(set(widths["ref_label"])),
        "ours_step_gflop": ours_flops / 1e9,
        "ref_step_gflop": ref_flops / 1e9,
        "ours_step_gflop_s": ours_flops / ours_step / 1e9,
        "ref_step_gflop_s": ref_flops / ref_step / 1e9,
        "goal_step_gflop_s": ours_flops / (ref_total / 2) / 1e9,
    }
    for key in ("ours_step", "ref_step", "goal_step"):
        out[f"{key}_pct_of_peak"] = 100 * out[f"{key}_gflop_s"] / peak["peak_gflop_s"]
    print(
        f"  matmul peak {peak['peak_gflop_s']:.1f} GFLOP/s; steps at "
        f"{out['ours_step_pct_of_peak']:.0f}% (ours, S={max(widths['context'])}) and "
        f"{out['ref_step_pct_of_peak']:.0f}% (HF, S={CONTEXT}); 2x needs ours at "
        f"{out['goal_step_pct_of_peak']:.0f}% with every other phase free",
        flush=True,
    )
    return out


def run(quick: bool = False) -> dict:
    import faiss

    faiss.omp_set_num_threads(torch.get_num_threads())
    corpus_size, batch_size, repeats, warmup = QUICK if quick else FULL
    vocab_words = words(ts.CONFIGS["tiny"][1]["vocab_size"] - len(SPECIALS))
    tok = tokenizer(vocab_words)  # question encoder and generator read the same words
    with tempfile.TemporaryDirectory() as tmp:
        config = ts.hf_rag_config("tiny")
        config.max_combined_length = CONTEXT
        torch.manual_seed(0)
        model = transformers.RagSequenceForGeneration(config)
        model.save_pretrained(tmp)
        cfg, params = hf.load_rag(tmp)

        passages = make_corpus(vocab_words, corpus_size)
        vectors = np.random.default_rng(3).normal(
            size=(corpus_size, cfg.question_encoder.hidden_size)
        )
        vectors = vectors.astype(np.float32)  # [C, D]
        t0 = _clock()
        layout = {"prefix": cfg.prefix or "", "title_sep": cfg.title_sep, "doc_sep": cfg.doc_sep}
        store = workdir_store(passages, tok, pathlib.Path(tmp) / "store", layout)
        store_s = _clock() - t0
        t0 = _clock()
        retriever = transformers.RagRetriever(
            model.config, tok, tok, index=FaissIndex(vectors, passages), init_retrieval=False
        )
        faiss_s = _clock() - t0
        ours = Ours(cfg, params, store, vectors, tok)
        ref = Reference(model, retriever, tok)

        batches = make_batches(vocab_words, tok, tok, cfg, warmup + repeats, batch_size)
        ours_times, ref_times = [], []
        widths = {"context": [], "label": [], "ref_label": []}
        check = None
        for i, batch in enumerate(batches):
            common.settle()
            o_times, o_loss, o_out = ours.step(batch)
            common.settle()
            r_times, r_loss, r_out = ref.step(batch)
            if i == 0:
                check = _check_same_work(o_out, r_out, o_loss, r_loss)
                check["ours_first_s"] = sum(o_times.values())
            if i >= warmup:
                ours_times.append(o_times)
                ref_times.append(r_times)
                widths["context"].append(o_out["context_input_ids"].shape[-1])
                widths["label"].append(o_out["label_width"])
                widths["ref_label"].append(r_out["label_width"])
            print(
                f"  step {i}: ours {sum(o_times.values()):.3f}s, HF {sum(r_times.values()):.3f}s",
                flush=True,
            )

    rows = []
    for phase in ("encode", "search", "gather", "step", "total"):

        def series(times, phase=phase):
            return [sum(t.values()) if phase == "total" else t[phase] for t in times]

        o, r = series(ours_times), series(ref_times)
        rows.append(
            {
                "phase": phase,
                "ours_ms": 1e3 * statistics.median(o),
                "ref_ms": 1e3 * statistics.median(r),
                "speedup": statistics.median(r) / statistics.median(o),
                "ours_min_ms": 1e3 * min(o),
                "ref_min_ms": 1e3 * min(r),
                "speedup_min": min(r) / min(o),
            }
        )
    roofline = _roofline(cfg, batch_size, ours_times, ref_times, widths, quick)
    return {
        "roofline": roofline,
        "floor": _floor(ours, ours_times, ref_times),
        "columns": [
            "phase",
            "ours_ms",
            "ref_ms",
            "speedup",
            "ours_min_ms",
            "ref_min_ms",
            "speedup_min",
        ],
        "rows": rows,
        "check": check,
        "setup": {
            "passages": corpus_size,
            "batch": batch_size,
            "n_docs": N_DOCS,
            "context_length": CONTEXT,
            "target_length": TARGET,
            "question_length": QUESTION,
            "vector_dim": int(vectors.shape[1]),
            "timed_steps": repeats,
            "warmup_steps": warmup,
            "model": "train_step suite's tiny RAG-Sequence (DPR H=64 x2, BART d=64 2+2, V=1000)",
            "ours_store_build_s": store_s,
            "ref_faiss_build_s": faiss_s,
        },
        "reference": f"transformers {transformers.__version__} RagRetriever + faiss "
        f"{faiss.__version__} IndexFlatIP, PyTorch {torch.__version__} eager, torch.optim.AdamW",
        "ours": f"jax {jax.__version__}: jitted encode, ExactIndex, PassageStore, donated jit step",
        "threads": torch.get_num_threads(),
        "backend": jax.default_backend(),
    }
