r"""The paper's Natural Questions setup: DPR-multiset retriever + BART-large over 21M passages, TPU.

Lewis et al. 2020 (arXiv:2005.11401), open-domain QA on NQ-open (Lee et al. 2019 splits): the
question encoder and BART-large train jointly on the RAG marginal likelihood with k = 5 retrieved
passages, the passage encoder and its 21M-passage Wikipedia index (DPR's psgs_w100, December 2018)
stay fixed. Not runnable on a laptop: it needs the prepared data below and a TPU pod slice
(BART-large x 5 contexts x 128 questions per step, bfloat16 with remat).

One-off preparation (a machine with internet access):

    tfds build natural_questions_open --file_format=array_record --data_dir=/data/tfds
    python experiments/build_index.py --corpus=/data/psgs_w100.tsv \
      --encoder=facebook/dpr-ctx_encoder-multiset-base \
      --generator_tokenizer=facebook/bart-large --out=/data/wiki_index --kind=scann

Training and evaluation on all workers of a TPU VM (tpu/README):

    tpu/run.sh --name rag-v4 --zone us-central2-b -- python experiments/train.py \
      --config experiments/configs/nq.py --workdir ~/rag_nq \
      --config.train.checkpoint_dir=gs://BUCKET/rag_nq \
      --config.data.tfds_data_dir=/data/tfds --config.retrieval.index_dir=/data/wiki_index

Every worker needs the prepared TFDS data and the index folder (~70 GB for 21M x 768 float32
vectors plus the ScaNN index) on local disk; checkpoints go to the bucket all workers share.

Add `--config.rag.variant=token` for RAG-Token. Evaluation is exact match on the 3,610 questions
of NQ-open's test set (TFDS `natural_questions_open` `validation`, the original NQ dev split).

Expected result (not run in this repository): the paper's Table 1 reports NQ test EM 44.5 for
RAG-Sequence and 44.1 for RAG-Token. Its test numbers use more passages at test time than in
training (its appendix: 50 for RAG-Sequence, 15 for RAG-Token); this config evaluates with 50
(`--config.eval.n_docs=15` for RAG-Token). Steps and batch are chosen for a pod slice, not
tuned here (7,000 steps of 128 is about 10 epochs of the 87,925 training questions). What fits
on which TPU, and the roofline step time: tpu/README.md, from

    python experiments/tpu_compile.py --config experiments/configs/nq.py --topology v5e:2x4
"""

import os
import pathlib

from rag_jax.run import settings


def get_config():
    config = settings.defaults()  # what is not set here: rag_jax/run/settings.py

    config.data.source = "tfds"
    config.data.tfds_name = "natural_questions_open"
    config.data.train_split = "train"
    config.data.eval_split = "validation"  # NQ-open test: the original NQ dev split
    # Where `tfds build ... --file_format=array_record` wrote the data (see rag_jax/run/data.py).
    config.data.tfds_data_dir = os.environ.get(
        "TFDS_DATA_DIR", str(pathlib.Path.home() / "tensorflow_datasets")
    )
    config.data.corpus_path = "/data/psgs_w100.tsv"  # read only when retrieval.index_dir is ""
    config.data.question_length = 64
    config.data.answer_length = 32

    config.model.init = "pretrained"
    # DPR trained on the union of NQ, TQA, WQ and CT ("multiset"), and BART-large, as in the
    # paper. `init = "hf_rag"` with `rag_path = "facebook/rag-sequence-base"` starts from the same
    # three checkpoints bundled by HF.
    config.model.question_encoder_path = "facebook/dpr-question_encoder-multiset-base"
    config.model.passage_encoder_path = "facebook/dpr-ctx_encoder-multiset-base"  # the index's
    config.model.generator_path = "facebook/bart-large"  # also the generator tokenizer
    # The checkpoints' architectures as their config.json give them, so that a run can be planned
    # (experiments/tpu_compile.py) on a machine without them; training loads the checkpoints.
    config.model.question_encoder = dict(  # bert-base-uncased, both DPR towers
        vocab_size=30522,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        max_position_embeddings=512,
        type_vocab_size=2,
        projection_dim=0,
    )
    config.model.generator = dict(  # facebook/bart-large
        vocab_size=50265,
        d_model=1024,
        encoder_layers=12,
        decoder_layers=12,
        encoder_attention_heads=16,
        decoder_attention_heads=16,
        encoder_ffn_dim=4096,
        decoder_ffn_dim=4096,
        max_position_embeddings=1024,
        dropout=0.1,
    )
    config.model.dtype = "bfloat16"  # compute dtype (parameters and optimizer stay float32)
    config.model.remat = True  # rematerialise layers: BART-large over B * N contexts of 300
    config.model.deterministic = False  # BART-large's dropout 0.1 on, as in fine-tuning

    config.warm_start.method = "none"  # DPR is already a trained retriever
    config.warm_start.steps = 0
    config.warm_start.reader_steps = 0

    config.rag.n_docs = 5  # k = 5 passages per question in training, as in the paper
    config.rag.max_combined_length = 300  # HF RagConfig's default context length
    # Batches padded to their longest context in steps of 128 (TPU lane width), not to 300.
    config.rag.context_pad_multiple = 128
    config.rag.label_smoothing = 0.1

    # The 21M-passage psgs_w100 store, vectors and index of `experiments/build_index.py` (see
    # above); checked against passage_encoder_path's weights and the corpus on load.
    config.retrieval.index_dir = "/data/wiki_index"
    config.retrieval.index = "scann"  # used only when index_dir is ""
    config.retrieval.passage_max_length = 256  # passage-encoder tokens (build_index's default)
    config.retrieval.encode_batch_size = 512
    # The size a device index of it has (the 21,015,300 vectors of HF's wiki_dpr; build_index
    # --dtype=bfloat16), for planning the in-step search before the index exists.
    config.retrieval.index_rows = 21_015_300
    config.retrieval.index_dtype = "bfloat16"

    # Optimisation as in the authors' released fine-tuning script (transformers'
    # examples/research_projects/rag/finetune_rag.sh): AdamW at 3e-5 with polynomial decay,
    # 500 warmup steps, weight decay 0.001, clipping at 0.1, label smoothing 0.1.
    config.train.steps = 7_000  # about 10 epochs of 87,925 questions
    config.train.batch_size = 128  # global batch over a TPU pod slice; divisible by its chips
    config.train.learning_rate = 3e-5
    config.train.warmup_steps = 500
    config.train.decay = "polynomial"
    config.train.retriever_lr_factor = 1.0  # question encoder at the generator's rate
    config.train.weight_decay = 0.001
    config.train.grad_clip = 0.1
    config.train.log_every = 50
    config.train.save_every = 1000
    config.train.keep_checkpoints = 3

    config.eval.batch_size = 128
    config.eval.n_docs = 50  # the paper's test-time k for RAG-Sequence (15 for RAG-Token)
    config.eval.num_beams = 1  # greedy: the paper found beam search no better for QA
    config.eval.max_length = 32
    return config
