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
        --topology v5e:2x4 --paths host --largest --largest_tries 1 \
        --out tpu/compile_reports/v5e-2x4_fsdp_remat_host_llama-3.2-1b.json
    python experiments/tpu_compile.py --config experiments/configs/llama_tpu.py \
        --topology v5e:2x4 --paths host --config.train.batch_size=48 \
        --out tpu/compile_reports/v5e-2x4_fsdp_remat_host_llama-3.2-1b_B48.json

What they produced on v5litepod-8 (8 x v5e, 15.75 GiB of HBM per chip for one program; details
in tpu/README.md, "A causal generator: Llama-3.2-1B's shapes"): B = 32 (4 per chip) fits in
14.27 GiB per chip (parameters 0.68, AdamW state 1.25, temporaries 11.74, code 0.60), a roofline
step (an estimate, not a measured time) of 259 ms, memory-bound by a hair over its 256 ms of
compute (50.47 TFLOP per chip, remat included; the compiled program's matmuls agree), MFU at
most 80%; attention moves 47% of the 212 GB of HBM traffic per chip, the feed-forward layers
29%. B = 48 fits too (15.09 GiB), but as a program with 12x the all-gathers and 3x the traffic
(a 791 ms roofline); B = 56 (16.35 GiB) and B = 64 (15.77) do not fit. Compiles took 264-434 s
each on two CPU cores.
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
