r"""The paper's TriviaQA setup: DPR-multiset retriever + BART-large over 21M passages, TPU.

Lewis et al. 2020 (arXiv:2005.11401), open-domain QA on TriviaQA (the unfiltered questions without
their evidence documents, `trivia_qa/unfiltered.nocontext`): the question encoder and BART-large
train jointly on the RAG marginal likelihood with k = 5 retrieved passages, the passage encoder
and its 21M-passage Wikipedia index (DPR's psgs_w100, December 2018) stay fixed. Not runnable on a
laptop: it needs the prepared data below and a TPU pod slice (bfloat16 with remat).

One-off preparation (a machine with internet access and TensorFlow; the TriviaQA builder
generates through `tf.io.gfile`):

    tfds build trivia_qa/unfiltered.nocontext --file_format=array_record --data_dir=/data/tfds
    python experiments/build_index.py --corpus=/data/psgs_w100.tsv \
      --encoder=facebook/dpr-ctx_encoder-multiset-base \
      --generator_tokenizer=facebook/bart-large --out=/data/wiki_index --kind=scann

Training and evaluation on all workers of a TPU VM (tpu/README):

    tpu/run.sh --name rag-v4 --zone us-central2-b -- python experiments/train.py \
      --config experiments/configs/tqa.py --workdir ~/rag_tqa \
      --config.train.checkpoint_dir=gs://BUCKET/rag_tqa \
      --config.data.tfds_data_dir=/data/tfds --config.retrieval.index_dir=/data/wiki_index

Every worker needs the prepared TFDS data and the index folder (~70 GB for 21M x 768 float32
vectors plus the ScaNN index) on local disk; checkpoints go to the bucket all workers share.

Add `--config.rag.variant=token` for RAG-Token. Evaluation is exact match against the answer and
its aliases on the 11,313 questions of the unfiltered dev split (TFDS `validation`), the set that
open-domain QA papers since ORQA/DPR report as TriviaQA test.

Expected result (not run in this repository): the paper's Table 1 reports TQA test EM 56.8 for
RAG-Sequence and 55.2 for RAG-Token. Its test numbers use more passages at test time than in
training (its appendix: 50 for RAG-Sequence, 15 for RAG-Token); this config evaluates with the
k = 5 it trains with, so expect somewhat less. Steps and batch are chosen for a pod slice, not
tuned here (7,000 steps of 128 is about 10 epochs of the 87,622 training questions).
"""

import importlib.util
import pathlib

# nq.py holds the shared setup; loaded by path so `--config experiments/configs/tqa.py` works.
_spec = importlib.util.spec_from_file_location("nq", pathlib.Path(__file__).with_name("nq.py"))
nq = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nq)


def get_config():
    config = nq.get_config()  # the paper's models, index, optimisation and decoding
    config.data.tfds_name = "trivia_qa/unfiltered.nocontext"
    config.data.train_split = "train"
    config.data.eval_split = "validation"  # open-domain TQA test: unfiltered dev
    config.train.steps = 7_000  # about 10 epochs of 87,622 questions
    return config
