r"""nq.py's paper setting with a causal generator of Llama-3.2-1B's shapes, planned for TPU.

The Natural Questions setup of `nq.py` (DPR question and passage towers of BERT-base's shapes,
k = 5 passages, context 300, question 64, answer 32, bfloat16 compute with float32 parameters and
AdamW state, remat), its BART-large replaced by a Llama-architecture causal LM (`rag_jax.causal`):
vocab 128,256, hidden 2,048, SwiGLU 8,192, 16 layers, 32 query heads reading 8 key/value heads
of width 64, RMSNorm eps 1e-5, RoPE theta 500,000 with Llama 3's scaling (factor 32, low/high
frequency factors 1 and 4, original context 8,192), tied embeddings, 131,072 positions: the
public config.json of Meta's Llama-3.2-1B (1.24B parameters), kept in
`tpu/architectures/llama-3.2-1b/config.json` (the architecture only, no weights). The whole
generator and the question tower train; the passage tower stays frozen (its index stays
valid). Each passage and the question are one plain prompt ("Context: title / text",
"Question: q", "Answer:"), the answer and EOS follow; parameters and AdamW state are split over
the chips (`train.param_sharding = "fsdp"`).

Planning needs only the architecture (`experiments/tpu_compile.py` reads config.json, no weights
and no data); training needs the checkpoint: download meta-llama/Llama-3.2-1B (a gated model on
the HF hub: accept its license first) and pass its folder,
`--config.model.generator_path=/data/Llama-3.2-1B`. Build the index with the generator's
tokenizer (`experiments/build_index.py --generator_tokenizer=/data/Llama-3.2-1B`), as `nq.py`
describes. The schedule is nq.py's, not tuned for this generator.

    python experiments/tpu_compile.py --config experiments/configs/llama_tpu.py \
        --topology v5e:2x4 --paths host \
        --out tpu/compile_reports/v5e-2x4_fsdp_remat_host_llama-3.2-1b.json

What it compiled to (tpu/README.md, "A causal generator: Llama-3.2-1B's shapes"): see there.
"""

import importlib.util
import pathlib

import ml_collections

# nq.py holds the data, retriever and schedule; loaded by path so that
# `--config experiments/configs/llama_tpu.py` works from any directory.
_spec = importlib.util.spec_from_file_location("nq", pathlib.Path(__file__).with_name("nq.py"))
nq = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nq)

# Meta's Llama-3.2-1B config.json (architecture only): what planning reads.
ARCHITECTURE = pathlib.Path(__file__).resolve().parents[2] / "tpu/architectures/llama-3.2-1b"


def get_config():
    config = nq.get_config()
    config.model.generator_path = str(ARCHITECTURE)
    config.model.generator = ml_collections.ConfigDict()  # BART-large's sizes: not used
    config.rag.keep_question = True  # a causal generator reads the question at the prompt's end
    config.rag.prompt = "plain"  # Llama-3.2-1B (the base model) has no chat template
    config.train.freeze = r"^passage_encoder/"  # no final_logits_bias: BART's buffer
    config.train.param_sharding = "fsdp"
    config.train.batch_size = 32
    config.eval.batch_size = 32
    return config
