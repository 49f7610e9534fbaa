r"""nq.py's paper setting with fused attention and the fused AdamW update, planned for TPU.

`nq.py` (DPR question encoder + BART-large, k = 5, context 300, bfloat16 compute, remat, dropout
on) with `model.attention_impl = "flash"` (every attention in the Pallas TPU flash-attention
kernel) and `train.optimizer_impl = "fused"` (AdamW as one transformation). The kernel cannot
apply attention-probability dropout, so the question encoder's (BERT's 0.1) is set to 0.0 here;
BART-large's attention dropout is already 0.0, and every other dropout (BERT's and BART-large's
0.1 on hidden states) stays on, so that the compiled step differs from `nq.py`'s only in those
three settings. `model.deterministic=True` would turn off all dropout instead.

The architecture fields set here are the ones planning reads when the DPR checkpoint is not on
the machine (`experiments/tpu_compile.py`); training from the checkpoint reads its config.json
(attention dropout 0.1), which the kernel refuses: train with `model.deterministic=True`, or
`model.attention_impl=xla`.

    python experiments/tpu_compile.py --config experiments/configs/nq_flash.py \
        --topology v5e:2x4 --paths host \
        --out tpu/compile_reports/v5e-2x4_replicated_remat_host_flash_fused.json
"""

import importlib.util
import pathlib

# Loaded by path, as llama_tpu.py does, so that `--config experiments/configs/nq_flash.py` works
# from any directory.
_spec = importlib.util.spec_from_file_location("nq", pathlib.Path(__file__).with_name("nq.py"))
nq = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nq)


def get_config():
    config = nq.get_config()
    config.model.attention_impl = "flash"
    config.train.optimizer_impl = "fused"
    config.model.question_encoder.attention_probs_dropout_prob = 0.0
    return config
