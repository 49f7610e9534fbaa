r"""What the retriever learns from its reader, on real text: `squad_llama.py` at the study's size.

    python experiments/squad_study.py --config squad_objectives --out D --seeds 0 \
        --rows frozen,joint,marginal_k16,pdist_k16 --fill_memo

SQuAD v1.1 as `squad_llama.py` (the same warm-started SmolLM2 reader, frozen; MiniLM towers, the
passage tower frozen unless a row trains it), with 3,000 training questions drawn by article
(whole articles of SQuAD train in a seeded order: `data.sample_by`, nested in the count, so the
600 and 1,500 rows of the curve are part of it), 750 steps of 8 (two epochs) at a question-tower
rate of 5e-6 (chosen on a train slice), recalls over all
8,595 dev questions every 150 steps and EM/F1 over a seeded 1,000 of them (`eval.answer_seed`,
a draw nested in its size).
`experiments/squad_study.py` sets each row's objective (`train.retriever_*`,
`rag_jax/retriever_losses.py`); every row keeps the per-question records its paired intervals
come from (`<workdir>/per_question.jsonl`, `rag_jax.run.paired`).
"""

import importlib.util
import pathlib

_spec = importlib.util.spec_from_file_location(
    "squad_llama", pathlib.Path(__file__).with_name("squad_llama.py")
)
squad_llama = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(squad_llama)


def get_config(variant: str = ""):
    config = squad_llama.get_config(variant)
    config.data.max_train = 3000
    config.data.sample_by = "article"
    config.train.steps = 750  # two epochs of 3,000 at batch 8, in every row
    config.train.save_every = 150
    config.eval.every = 150  # the recalls' learning curve
    config.eval.answer_examples = 1000
    # The question tower's rate, chosen on a slice of SQuAD train (squad_study.py --write_slice;
    # docs/training.md): 5e-6 beat 2e-5 (squad_llama's) and 1e-4 for pdist there.
    config.train.retriever_lr_factor = 0.05
    return config
