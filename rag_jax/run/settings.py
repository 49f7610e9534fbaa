"""Every setting of a run, declared once: its default and what it does.

`defaults()` is the configuration every experiment config starts from (`experiments/configs/*.py`
change what differs and are locked, so a mistyped override fails); the defaults are those of the
default job, the synthetic world on a CPU (`rag_jax.run.validation.validate` checks a config before
anything is built).
`check_overrides(argv)` refuses a mistyped `--config.x=...` flag in one line, with the closest
settings. Configs saved by an older version are completed with the defaults of the settings they
lack (`complete`).

`model.question_encoder`, `model.generator` and `data.fields` are open mappings: their keys are the
fields of `BertConfig`, of `BartConfig` and of the data readers, checked where they are used.
"""

import difflib
import sys

import ml_collections

# section -> {key: (default, what it does)}; "" holds the top-level settings.
SCHEMA: dict[str, dict[str, tuple]] = {
    "": {
        "seed": (0, "the one seed: world, data split, init, dropout and batches derive from it"),
        "init_seed": (
            -1,
            "the initial parameters and the warm starts only; -1 = seed. Runs that differ only "
            "in seed then share their warm starts and initial model, and differ in batches and "
            "dropout",
        ),
    },
    "data": {
        "source": ("synthetic", "where questions and passages come from: synthetic | files | tfds"),
        # Synthetic world.
        "num_entities": (
            400,
            "synthetic world size (facts = entities x 4 relations); 400: each training fact is "
            "seen ~7 times in 500 steps, too few to memorise before the retriever learns",
        ),
        "distractors_per_fact": (3, "synthetic passages per fact that repeat the question's words"),
        "eval_fraction": (
            0.25,
            "held out for evaluation: synthetic entities, or the articles of data.train_path "
            "when data.eval_path is empty (no article in both splits)",
        ),
        # Every source.
        "question_length": (24, "Q: question-encoder tokens per question"),
        "answer_length": (8, "T: label tokens (decoder start, BOS, answer, EOS, pads)"),
        "answer_pad_multiple": (
            8,
            "a training batch's labels: its longest, rounded up to this (0 = always T); exact, "
            "see model_inputs.label_width",
        ),
        "target": ("first", "which answer to train on: first | sample"),
        # Files.
        "train_path": ("", "training questions (.jsonl, .csv or .tsv; data.source='files')"),
        "eval_path": ("", "held-out questions; empty: whole articles of train_path are held out"),
        "corpus_path": (
            "",
            "passages (.tsv or .jsonl; several files comma-separated); not read with "
            "retrieval.index_dir",
        ),
        "fields": ({}, "the files' key names where they differ from ours, e.g. gold_ids"),
        "max_train": (0, "use the first N training questions; 0 = all"),
        "max_eval": (0, "use the first N held-out questions; 0 = all"),
        "sample_seed": (
            -1,
            "max_train / max_eval take a seeded sample of N (kept in file order) instead of the "
            "first N; -1 = the first N",
        ),
        "sample_by": (
            "question",
            "what that seeded sample draws: question | article (whole articles of the gold "
            "passages' titles, in a seeded order, the last one cut; nested in N)",
        ),
        # TFDS.
        "tfds_name": ("", "a TFDS builder (data.source='tfds'), e.g. natural_questions_open"),
        "train_split": (
            "train",
            "the training split: TFDS's, or with data.split_field the value of train_path's "
            "questions to train on ('' = all)",
        ),
        "eval_split": (
            "validation",
            "the evaluation split: TFDS's, or with data.split_field the value of eval_path's "
            "questions to evaluate ('' = all)",
        ),
        "split_field": (
            "",
            "files: the key naming each question's split (COVID-QA's 'split'); '' = the files "
            "have none and every question is read",
        ),
        "splits": (
            "",
            "files with data.split_field: the comma-separated values it may take; a question "
            "of any other is refused, naming its file and line",
        ),
        "tfds_data_dir": ("", "where `tfds build` wrote the data; empty: TFDS's default"),
    },
    "model": {
        "init": (
            "random",
            "random (sizes below) | pretrained (checkpoint paths) | hf_rag (a whole HF RAG)",
        ),
        "dtype": ("float32", "compute dtype: float32 | bfloat16 (parameters stay float32)"),
        "remat": (False, "rematerialise layers in the backward pass"),
        "remat_policy": (
            "full",
            "with remat, what each layer keeps for the backward pass (rag_jax.models.remat): "
            "full (nothing: its whole forward recomputed) | attention (q, k, v and the attention "
            "output; under splash its residuals) | projections (every projection's output but "
            "the feed-forward's hidden one) | attention_and_projections (both) | dots (every "
            "projection's output)",
        ),
        "attention_impl": (
            "xla",
            "every tower's attention: xla (exact against HF) | flash | splash (Pallas TPU "
            "kernels, rag_jax.models.flash and rag_jax.models.splash; they refuse attention "
            "dropout in training)",
        ),
        "deterministic": (
            True,
            "no dropout in training, the joint steps' and the reader warm start's (the tiny "
            "models underfit, not overfit); False: the models' own dropout rates",
        ),
        "question_encoder": (
            {
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "intermediate_size": 128,
                "max_position_embeddings": 128,
                "initializer_range": 0.02,
            },
            "BertConfig fields of both retriever towers with init='random' (H 64, 2 layers); "
            "with a checkpoint, its architecture (vocab_size included) for planning a run before "
            "it is downloaded (experiments/tpu_compile.py reads it when the checkpoint is absent)",
        ),
        "generator": (
            {
                "d_model": 64,
                "encoder_layers": 2,
                "decoder_layers": 2,
                "encoder_attention_heads": 4,
                "decoder_attention_heads": 4,
                "encoder_ffn_dim": 128,
                "decoder_ffn_dim": 128,
                "max_position_embeddings": 128,
                "dropout": 0.0,
                # ~1/sqrt(d_model): BART's 0.02 (tuned for d_model 1024) leaves a 64-wide
                # generator on the answer prior for 300+ steps; 0.1 reads by step ~150.
                "init_std": 0.1,
            },
            "BartConfig fields of a generator trained from scratch (without generator_path); with "
            "a checkpoint, its architecture for planning, as model.question_encoder",
        ),
        "generator_init": (
            "random",
            "the generator without generator_path: random (model.generator's sizes) | bert "
            "(warm-started from a BERT checkpoint, Rothe et al. 2020: models/bert2bart.py)",
        ),
        "generator_bert_path": (
            "",
            "generator_init='bert': the BERT checkpoint; empty: question_encoder_path",
        ),
        "generator_encoder_layers": (0, "generator_init='bert': its first k layers; 0 = all"),
        "generator_decoder_layers": (
            0,
            "generator_init='bert': decoder layers; 0 = as many as the encoder",
        ),
        "generator_decoder_init": (
            "bert",
            "generator_init='bert': bert (self-attention and FFN from BERT's layers, "
            "cross-attention fresh) | bert_cross (cross-attention a copy of the self-attention) "
            "| random (the decoder fresh)",
        ),
        "generator_frozen_encoder_layers": (
            0,
            "the generator encoder's first k layers are fixed (-1: all): no gradient flows into "
            "them (cheaper steps); their parameters and the encoder's embeddings must be frozen "
            "too (train.freeze)",
        ),
        "pooling": (
            "cls",
            "the retriever towers' vector: cls (DPR) | mean (sentence-transformers, e.g. MiniLM)",
        ),
        "normalize_embeddings": (False, "L2-normalise the towers' vectors (sentence-transformers)"),
        "question_encoder_path": ("", "BERT or DPR checkpoint of the question tower (pretrained)"),
        "passage_encoder_path": ("", "the passage tower's checkpoint; empty: the question's"),
        "generator_path": (
            "",
            "BART checkpoint, or a Llama-family causal LM (a save_pretrained folder of model_type "
            "llama, or a .gguf file: rag_jax.causal); empty: a new BART of model.generator's size",
        ),
        "generator_trained_layers": (
            0,
            "a causal generator: only its top k layers (and final norm) train; the layers below "
            "are fixed, no gradient flows into them, and train.freeze must cover them and the "
            "embedding; 0 = all layers",
        ),
        "rag_path": ("", "an HF RAG checkpoint (init='hf_rag')"),
        "shared_towers": (True, "random init: both towers start from the same weights, as DPR"),
    },
    "warm_start": {
        "method": (
            "ict",
            "retriever warm start (both towers): ict (inverse cloze task on the passages, no QA "
            "pairs) | gold (the training questions with their gold passages, in-batch "
            "negatives: the supervised ceiling) | none",
        ),
        "steps": (800, "the retriever warm start's steps"),
        "batch_size": (64, "its queries per step (B - 1 in-batch negatives each)"),
        "learning_rate": (3e-3, "its peak learning rate"),
        "keep_prob": (0.1, "how often the query sentence stays in its passage (ORQA: 0.1)"),
        "cache_dir": ("", "where warm starts are cached by fingerprint; empty: the workdir"),
        "reader_steps": (
            600,
            "generator warm start on *another* synthetic world (its questions with their answer "
            "passages), so it reads before joint training; 0 = none",
        ),
        "reader_entities": (400, "size of that other world"),
        "reader_data": (
            "synthetic",
            "what the reader warm start reads: synthetic (another world) | files (questions with "
            "their gold passages: reader_questions_path, reader_corpus_path)",
        ),
        "reader_questions_path": ("", "reader_data='files': questions with gold_passage_id"),
        "reader_corpus_path": ("", "reader_data='files': their passages (.jsonl or .tsv)"),
        "reader_task": (
            "qa",
            "reader_data='files': qa (the questions) | ssm (salient spans of the passages masked, "
            "REALM's salient span masking: no QA pairs) | qa+ssm (alternating)",
        ),
        "reader_batch_size": (0, "questions per reader step; 0 = train.batch_size"),
        "reader_learning_rate": (0.0, "the reader's peak learning rate; 0 = train.learning_rate"),
        "reader_context_length": (0, "reader contexts' tokens; 0 = rag.max_combined_length"),
        "reader_trained_layers": (
            0,
            "a causal generator: the reader warm start trains only its top k layers and final "
            "norm (the embedding and the layers below fixed, no gradient into them), whatever "
            "train.freeze fixes in joint training; 0 = what train.freeze leaves trainable",
        ),
        "reader_domain_steps": (
            0,
            "then the top model.generator_trained_layers train on the run's own training questions "
            "with their gold passages (a pipeline's reader, trained apart); 0 = none",
        ),
    },
    "rag": {
        "variant": ("sequence", "sequence (RAG-Sequence) | token (RAG-Token)"),
        "n_docs": (5, "N: passages per question"),
        "max_combined_length": (48, "S: generator context tokens (passage + question)"),
        "context_pad_multiple": (
            16,
            "a training batch's contexts: its longest, rounded up to this (one compiled step per "
            "width) instead of S as HF pads them; 0 = always S",
        ),
        "keep_question": (
            False,
            "a context longer than max_combined_length loses the passage's end, not the "
            "question (HF cuts the string's end: the question)",
        ),
        "label_smoothing": (0.0, "HF RAG's label smoothing epsilon"),
        "exclude_bos_score": (False, "RAG-Sequence: leave the BOS log-prob out of the loss"),
        "doc_score_scale": (
            1.0,
            "p(z|x) = softmax(scale * q.d): unit vectors (model.normalize_embeddings) score in "
            "[-1, 1], nearly uniform over the top k at scale 1 (sentence-transformers trains "
            "at 20)",
        ),
        "closed_book": (False, "no retrieval: the question alone (needs n_docs=1)"),
        "prompt": (
            "plain",
            "a causal generator's prompt: plain ('Context: title / text', 'Question: q', "
            "'Answer:' on three lines) | chat (the same inside its tokenizer's chat template)",
        ),
    },
    "retrieval": {
        "index": ("exact", "exact | scann (host) | device (vectors sharded over the devices)"),
        "source": (
            "dense",
            "where training candidates and evaluated rankings come from: dense (the index) | "
            "bm25 (the passages' words) | hybrid (both, reciprocal rank fusion); the doc scores "
            "are the question tower's q . d whichever chose them (retrieval.sources)",
        ),
        "fusion_depth": (100, "hybrid: how deep each of the two rankings is read before fusion"),
        "bm25_k1": (0.9, "BM25's term-frequency saturation (Pyserini's default)"),
        "bm25_b": (0.4, "BM25's length normalisation (Pyserini's default)"),
        "device_storage": (
            "",
            "the device index's rows: empty = the vectors' dtype; int8 = int8 codes and a scale "
            "per row (half of bfloat16's memory; approximate ids, DeviceIndex)",
        ),
        "search_in_step": (
            True,
            "with the device index, the train step also searches for the next batch (no host "
            "round trip)",
        ),
        "passage_max_length": (48, "passage-encoder tokens per passage"),
        "passage_format": ("pair", "pair: title [SEP] text (DPR) | single: title + ' ' + text"),
        "encode_batch_size": (256, "passages per encoder call"),
        "cache_dir": (
            "",
            "where encoded corpora are saved, keyed by passage encoder and corpus, for runs "
            "that share them; empty: <workdir>/index",
        ),
        "index_dir": ("", "a folder of experiments/build_index.py: its store, vectors and index"),
        "refresh_every": (
            0,
            "a trainable passage encoder: re-encode and re-index every k steps in the background; "
            "0 = the stored vectors never change (the paper's setup)",
        ),
        "refresh_lag": (0, "steps until a refreshed index serves; 0 = refresh_every // 2"),
        "passage_head_layers": (
            0,
            "with refresh_every: only the passage tower's top H layers train, on its lower layers' "
            "states computed once (retrieval.passage_trunk; train.freeze must cover the rest); "
            "0 = the whole tower",
        ),
        # Read when planning a run before its index exists (experiments/tpu_compile.py).
        "index_rows": (0, "C planned: passages in the index; 0 = the index's own count"),
        "index_dtype": ("", "planned vector dtype: float32 | bfloat16; empty = the index's own"),
    },
    "train": {
        "steps": (500, "optimizer steps"),
        "batch_size": (16, "global batch; must divide by the device count"),
        "num_devices": (0, "data-parallel devices; 0 = all"),
        "optimizer": ("adamw", "adamw | sgd (momentum adam_b1)"),
        "optimizer_impl": (
            "optax",
            "adamw as optax's chain | fused: one elementwise update per parameter "
            "(training.optim.fused_adamw; its own optimizer state)",
        ),
        "learning_rate": (2e-3, "peak learning rate (the generator's)"),
        "warmup_steps": (30, "linear warmup from 0"),
        "decay": ("linear", "after warmup: linear | polynomial | constant"),
        "decay_power": (1.0, "for polynomial decay"),
        "end_lr_factor": (0.0, "final learning rate = learning_rate * this"),
        "retriever_lr_factor": (0.3, "retriever towers' learning rate / learning_rate"),
        "retriever_delay_steps": (
            0,
            "steps before the retriever towers train: until the generator reads, their gradient "
            "is noise that undoes the warm start",
        ),
        "retriever_loss": (
            "marginal",
            "what trains the question encoder (rag_jax.retriever_losses): marginal (RAG's own "
            "loss) | emdr2 (EMDR^2 as the papers write it, sequence-level) | emdr2_token "
            "(EMDR^2 as their codes compute it, token by token) | pdist (Atlas' PDist, REPLUG's "
            "LSR) | loop (Atlas' leave-one-out; the uniform mixture of the other candidates "
            "stands in for FiD reading them) | loop_weighted (that mixture weighted by the "
            "retriever: what loop was before, the loop_k16 rows) | gold (DPR's loss); the "
            "generator's loss stays RAG's marginal over rag.n_docs",
        ),
        "retriever_candidates": (
            0,
            "K, the passages per question the retriever's loss spans (the generator reads the "
            "best rag.n_docs of them); 0 = rag.n_docs",
        ),
        "retriever_random_negatives": (
            0,
            "R passages drawn uniformly from the corpus per training question, appended after "
            "its K candidates in the retriever's loss (never the generator's): fixed for the "
            "question (a function of the seed and its id), none of its gold passages and none "
            "of its candidates (a clash is redrawn). With a frozen reader a memo filled ahead "
            "holds their pairs too",
        ),
        "retriever_lm_temperature": (
            0.1,
            "tau_g of pdist and the loops: the reader's posterior softmax(r / tau_g)",
        ),
        "retriever_lm_score": (
            "sum",
            "r, the reader's score of a candidate in pdist and the loops: sum (the answer's "
            "log-likelihood, REPLUG's LSR) | mean (per scored answer token, as Atlas' code); "
            "the other objectives read the likelihoods themselves and need sum",
        ),
        "retriever_score_temperature": (
            1.0,
            "tau_s: the retriever's distribution softmax(doc score / tau_s) in its own loss "
            "(the doc scores are already scaled by rag.doc_score_scale)",
        ),
        "retriever_fixed_candidates": (
            False,
            "each training question's candidates (rag.n_docs, or train.retriever_candidates) are "
            "fixed before training: its top K under the initial question encoder and index, as "
            "RA-DIT scores a fixed top-k once by the reader, not searched again each step; the "
            "doc scores over them are the current question encoder's. With a frozen reader every "
            "pair is then one a memo filled ahead holds (squad_study.py --fill_memo)",
        ),
        "retriever_shuffle_reader": (
            False,
            "a control: each question's candidates get one another's reader likelihoods "
            "(permuted per step), so what the retriever learns is not the reader's feedback; "
            "needs train.answer_memo",
        ),
        "retriever_cut_gradient": (
            False,
            "a control: the retriever's towers enter every loss as constants (the doc scores' "
            "gradient cut), all else as the row; the optimizer still decays them",
        ),
        "weight_decay": (0.01, "AdamW decoupled weight decay"),
        "no_decay": (r"(bias|scale|ln|final_logits_bias)", "paths without weight decay (regex)"),
        "adam_b1": (0.9, "AdamW beta1 (SGD momentum)"),
        "adam_b2": (0.999, "AdamW beta2"),
        "adam_eps": (1e-8, "AdamW epsilon"),
        "grad_clip": (1.0, "global-norm clip; 0 = none"),
        "grad_accum": (1, "optimizer step every k batches"),
        "param_sharding": (
            "replicated",
            "parameters and optimizer state: replicated on every device | fsdp: each array split "
            "over the data axis along its largest divisible dimension (ZeRO-3, as t5x and "
            "MaxText partition), all-gathered where the step uses it",
        ),
        "answer_memo": (
            False,
            "a frozen causal generator: each (passage, question, answer)'s answer log-probs are "
            "computed once and reused exactly (training.memo, kept in warm_start.cache_dir); "
            "needs train.freeze to cover generator/, host-side retrieval, label_smoothing 0",
        ),
        "reader_trunk": (
            False,
            "a causal reader's top model.generator_trained_layers layers train on its frozen "
            "lower layers' states of every training question's fixed candidates, computed once "
            "(training.reader_states, in retrieval.cache_dir or the workdir); needs "
            "train.retriever_fixed_candidates, data.target='first'",
        ),
        "freeze": (
            r"^(passage_encoder/|generator/final_logits_bias)",
            "frozen parameter paths (regex): the passage encoder (stored vectors stay valid) "
            "and BART's final_logits_bias (a buffer in the reference)",
        ),
        "log_every": (25, "steps between logged training metrics"),
        "save_every": (100, "steps between checkpoints"),
        "keep_checkpoints": (2, "newest checkpoints kept"),
        "checkpoint_dir": ("", "empty: the workdir; gs://bucket/run for multi-host runs"),
        "bundle": (
            True,
            "at the end of a run, write <workdir>/bundle: the model, tokenizers, passages and the "
            "final passage encoder's index, all a user needs to answer (rag_jax.io.bundle)",
        ),
    },
    "eval": {
        "enabled": (True, "evaluate held-out questions before and after training"),
        "before": (True, "the evaluation before training too (eval_before.json)"),
        "answers": (
            True,
            "the evaluations before and after training answer questions (EM/F1) too; False: only "
            "their retrieval recalls, which run the question tower alone (e.g. choosing settings "
            "by gold recall on a slice of train)",
        ),
        "every": (0, "also every k steps (eval/* in metrics.jsonl); 0 = before/after only"),
        "recall_ks": (
            "1,5",
            "the k of gold and answer recall@k (comma-separated); a k above the passages read "
            "is measured from a deeper search wherever answers are sampled or not asked",
        ),
        "every_max_examples": (
            0,
            "the evaluations every k steps (learning curves) read the first N held-out "
            "questions; 0 = as many as before/after",
        ),
        "every_answers": (
            True,
            "the evaluations every k steps answer questions (EM/F1) too; False: only their "
            "retrieval recalls, which run the question tower alone",
        ),
        "batch_size": (32, "questions per evaluation batch"),
        "n_docs": (
            0,
            "N at test time: passages per question in evaluation; 0 = rag.n_docs (the paper tests "
            "with more than it trains with)",
        ),
        "max_examples": (0, "the first N held-out questions; 0 = all"),
        "answer_examples": (
            0,
            "answer (EM/F1) only a seeded sample of N of them, the retrieval recalls still over "
            "all (only the question tower runs); 0 = answer all",
        ),
        "answer_seed": (0, "the seed of that sample (the same for every row and seed of a study)"),
        "num_beams": (1, "1 = greedy"),
        "max_length": (8, "generated tokens, decoder start included"),
        "sequence_decoding": ("thorough", "thorough | fast (RAG-Sequence with beams > 1)"),
        "answer_memo": (
            False,
            "greedy RAG-Sequence thorough decoding by a causal generator from memos of each "
            "prompt's greedy answer and likelihoods (training.memo_decoding), kept beside "
            "train.answer_memo's and shared by every evaluation of the same generator",
        ),
    },
}
# Settings whose value is a mapping of free keys (checked where they are used).
OPEN_MAPPINGS = ("model.question_encoder", "model.generator", "data.fields")


def defaults() -> ml_collections.ConfigDict:
    """A new config holding every setting at its default (the default job's)."""
    config = ml_collections.ConfigDict()
    for section, fields in SCHEMA.items():
        node = config
        if section:
            config[section] = ml_collections.ConfigDict()
            node = config[section]
        for key, (default, _) in fields.items():
            node[key] = ml_collections.ConfigDict(default) if isinstance(default, dict) else default
    return config


def describe(key: str) -> str:
    """What the setting `key` (e.g. "train.steps") does, as declared in `SCHEMA`."""
    section, _, name = key.rpartition(".")
    return SCHEMA[section][name][1]


def init_seed(config: ml_collections.ConfigDict) -> int:
    """The seed of the initial parameters and the warm starts (`init_seed`, else `seed`)."""
    return config.seed if config.init_seed < 0 else config.init_seed


def keys() -> list[str]:
    """Every setting's dotted name."""
    return [f"{s}.{k}" if s else k for s, fields in SCHEMA.items() for k in fields]


def complete(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`config` with the settings it lacks (a config saved by an older version) at their
    defaults; the settings it has are kept. Returns a new config."""
    full = defaults()
    for section, fields in SCHEMA.items():
        given = config if not section else config.get(section) or {}
        target = full if not section else full[section]
        for key in fields:
            if key in given:
                value = given[key]
                target[key] = (
                    ml_collections.ConfigDict(dict(value)) if hasattr(value, "items") else value
                )
    return full


def override(config: ml_collections.ConfigDict, changes: dict) -> ml_collections.ConfigDict:
    """Sets dotted keys (`{"train.steps": 50}`) in `config`, in place; returns it."""
    for key, value in changes.items():
        node = config
        *parents, leaf = key.split(".")
        for name in parents:
            node = node[name]
        node[leaf] = value
    return config


def closest(key: str) -> list[str]:
    """The declared settings nearest to `key` (for a mistyped one), best first."""
    section, _, leaf = key.rpartition(".")
    if section in SCHEMA:  # the section is right: compare names within it
        names = list(SCHEMA[section]) + ([s for s in SCHEMA if s] if not section else [])
        near = difflib.get_close_matches(leaf, names, n=3, cutoff=0.6)
        return [f"{section}.{n}" if section else n for n in near]
    return difflib.get_close_matches(key, keys(), n=3, cutoff=0.75)


def unknown_key_message(key: str) -> str:
    """One line naming an unknown setting and the closest declared ones."""
    near = closest(key)
    hint = f"did you mean {' or '.join(f'config.{n}' for n in near)}?" if near else ""
    section = key.rpartition(".")[0]
    if not hint:
        known = [n for n in keys() if n.rpartition(".")[0] == section]
        hint = f"the settings of config.{section} are {', '.join(known)}" if known else ""
    return f"config.{key} is not a setting rag_jax reads; {hint}".rstrip("; ")


def listing() -> str:
    """Every setting as `--config.<key>=<default>` and what it does, one per line, by section
    (what `experiments/train.py --help` prints before the flags)."""
    lines = ["Settings (override any as --config.<key>=<value>; rag_jax/run/settings.py):"]
    for section, entries in SCHEMA.items():
        for key, (default, what) in entries.items():
            name = f"{section}.{key}" if section else key
            lines.append(f"  --config.{name}={default!r}\n      {what}")
    return "\n".join(lines)


def check_overrides(argv: list[str] | None = None) -> None:
    """Exits with one line (status 2) when a `--config.<key>=...` flag names no setting.

    ml_collections refuses such a flag too, but three chained tracebacks deep; this runs before
    flag parsing. Keys inside the open mappings (`OPEN_MAPPINGS`) are left to the config.
    """
    argv = sys.argv[1:] if argv is None else argv
    known = set(keys())
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        key = arg[len("--config.") :].split("=", 1)[0]
        if key in known or any(key.startswith(f"{m}.") for m in OPEN_MAPPINGS):
            continue
        print(f"error: {unknown_key_message(key)}", file=sys.stderr)
        raise SystemExit(2)
