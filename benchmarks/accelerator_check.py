r"""Accelerator check: train-step MFU and DeviceIndex search against the memory-bandwidth bound.

    python -m benchmarks.accelerator_check --out accelerator_check.json      # on a GPU or TPU
    python -m benchmarks.accelerator_check --smoke --out /tmp/check.json     # tiny, CPU, < 1 min

Two measurements, each written to the JSON as soon as it is done (so a run cut short keeps what
it measured), with the device, its peak figures and where they come from:

1. `train`: the joint RAG train step (`rag_jax.training.step.make_train_step`, AdamW from
   `make_optimizer`) of the paper's NQ configuration, BERT-base question encoder + BART-large
   generator, in bfloat16 (float32 parameters and optimizer state), k = 5 docs, context 128,
   target 32, data parallel over every local device. The batch is the largest that fits: two
   probe batches are compiled and their XLA memory analyses give a linear model of memory per
   example, the predicted largest batch is run, and on an out-of-memory error the batch shrinks
   by 15% and is retried (with no usable memory figures, batches double until one fails).
   Reported: step time, examples/s, model FLOPs per step counted analytically (matmuls of both
   models, attention included; backward = 2x forward; no rematerialisation), the same from
   `jit(...).lower(...).compile().cost_analysis()` as a cross-check, and model-FLOPs utilisation
   = analytic FLOPs / step time / (peak bf16 FLOP/s x devices). Goal: MFU >= 40%.
2. `search`: `rag_jax.retrieval.device_index.DeviceIndex.search` over `--index-size` (default
   10M) x 768 bfloat16 vectors generated on the devices (never on the host), for batches of 1 to 64
   queries, k = 5. The bound is reading every vector once per batch: bound time = vector bytes /
   (peak HBM bytes/s x devices); the fraction reported is bound time / measured time. A
   reference search (bfloat16 matmul with float32 accumulation, then top-k) is timed alongside,
   to tell the index's own overhead from the hardware's. Goal: >= 70% of the bound at batch <= 64.

`--question`, `--context`, `--target` and `--n-docs` change the step's shapes (the defaults are
the ones above; `experiments/configs/nq.py` trains with question 64 and context 300).
Peak figures come from `benchmarks.flops.PEAKS` by device kind (vendor datasheets);
`--peak-tflops` and `--peak-gbps` override them (per device), and without either MFU and bound
fractions are null.
`--smoke` runs tiny models and 20k vectors so the whole script runs on a CPU in under a minute.
Exit status 0 when every phase ran (goals met or not), 1 when one failed. The measurements live in
`benchmarks/accelerator.py` (options, train step) and `benchmarks/search_check.py` (search).
"""

import os
import sys

# On GPU let XLA's allocator take 90% of memory (default 75%) so "largest batch" means it. Set
# before JAX is imported.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")

from benchmarks import accelerator  # noqa: E402

if __name__ == "__main__":
    sys.exit(accelerator.main())
