r"""A domain the retriever never saw: COVID-QA, MiniLM towers, the SmolLM2 reader, frozen.

    python experiments/domain_study.py --config covidqa --out D --seeds 0 --fill_memo \
        --rows bm25,frozen,hybrid_frozen,joint,pdist_k16
    python experiments/train.py --config experiments/configs/covidqa.py --workdir /tmp/covid

Data (`../shared/data/covidqa`, its README gives the provenance): 5,903 DPR-style 100-word
passages of 145 COVID-19 papers, the retrieval corpus; the questions of `split` = "train" (103
articles) train, those of "dev" (21 other articles) are evaluated (`data.train_split`,
`data.eval_split`). Answers are long extractive spans (median 14 SmolLM2 tokens, 75% within 27):
labels keep 32 tokens and decoding writes up to 32, and answer F1 is the answer metric.

The models are `squad_llama.py`'s: both towers all-MiniLM-L6-v2 as sentence-transformers trained
it (the passage tower frozen unless a row trains it), and SmolLM2-135M-Instruct warm-started as a
reader on SQuAD train (question, gold paragraph) -> answer (never on COVID-QA), then frozen in
every row: its answer likelihoods are memoised (`train.answer_memo`, `eval.answer_memo`).

The step budget is the SQuAD study's per question: 1,417 training questions, 360 steps of 8 (two
epochs), the question tower at 5e-6 (`squad_objectives.py`'s rate, chosen there on a train slice;
a row's own rate is chosen here on train with `domain_study.py --holdout`, the questions of a fifth
of the train articles held out). Candidates: K = 16 per question
from the dense tower (`retrieval.candidates = "dense"`), or from BM25's and the dense tower's
top-k together (`"hybrid"`).

`--config experiments/configs/covidqa.py:docs` reads a folder of plain documents instead
(`data.corpus_path` a folder of .txt/.md files, cut into 100-word windows); questions then come
from `data.train_path` / `data.eval_path` as given on the command line.
"""

import importlib.util
import pathlib

_spec = importlib.util.spec_from_file_location(
    "squad_llama", pathlib.Path(__file__).with_name("squad_llama.py")
)
squad_llama = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(squad_llama)

DATA = squad_llama.squad_open.DATA_DIR / "covidqa"


def get_config(variant: str = ""):
    if variant not in ("", "docs"):
        raise ValueError(f"covidqa.py variants: '' or 'docs', got {variant!r}")
    config = squad_llama.get_config()  # models, reader warm start (on SQuAD train), prompt
    d = config.data
    d.fields = {"gold_ids": "gold_passage_id"}
    d.train_path = str(DATA / "questions.jsonl")
    d.eval_path = str(DATA / "questions.jsonl")
    d.split_field = "split"
    d.splits = "train,dev,test"  # test: the questions of articles kept aside
    d.train_split = "train"
    d.eval_split = "dev"
    d.corpus_path = str(DATA / "passages.jsonl")
    d.max_train = 0  # every training question
    d.sample_by = "question"
    d.answer_length = 32
    config.eval.max_length = 32
    config.eval.answer_examples = 0  # F1/EM over every dev question
    config.eval.recall_ks = "1,5,20"  # recall@20 from a search of 20; answers read the top 4
    config.train.steps = 360  # two epochs of 1,417 at batch 8
    config.train.warmup_steps = 30
    config.train.save_every = 60
    config.eval.every = 60
    config.train.retriever_lr_factor = 0.05  # 5e-6
    # The question tower trains with MiniLM's own dropout (0.1), so seeds differ in dropout and
    # batch order (the towers start from MiniLM: nothing is drawn at initialisation). The frozen
    # reader has no dropout: its warm start and memos are the same.
    config.model.deterministic = False
    if variant == "docs":
        d.corpus_path = ""  # a folder of .txt/.md documents: --config.data.corpus_path=DIR
        d.train_path = d.eval_path = ""  # --config.data.train_path=Q.jsonl (and eval_path)
        d.split_field = d.splits = ""
        d.train_split = d.eval_split = ""
    return config
