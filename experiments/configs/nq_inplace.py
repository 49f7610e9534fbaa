r"""nq.py's paper setting with the inplace attention kernel, the "attention_and_projections" remat
policy and the fused AdamW update, planned for TPU.

`nq_flash.py` (`nq.py`: DPR question encoder + BART-large, k = 5, context 300, bfloat16 compute,
remat, hidden dropout on; the question encoder's attention-probability dropout at 0.0, which no
kernel can apply; the fused AdamW update) with `model.attention_impl = "inplace"` (every
attention in `rag_jax.models.inplace`'s Pallas kernels, which read q, k and v in the
projections' [rows, T, h * d] layout, unpadded, and keep nothing but them for the backward pass)
and `model.remat_policy = "attention_and_projections"` (each layer keeps its projections'
outputs, the feed-forward's hidden one excepted, and the attention's output: the backward pass
recomputes only the feed-forward's hidden activations). The compiled step differs from
`nq_flash.py`'s in those two settings only.

    python experiments/tpu_compile.py --config experiments/configs/nq_inplace.py \
        --topology v5e:2x4 --paths host --hlo_dir /tmp/hlo_f \
        --out v5e-2x4_replicated_remat-attention_and_projections_host_inplace_fused.json

(the report is in tpu/compile_reports/). Results: tpu/README.md, "The inplace kernel".
Roofline estimates from the compile: no TPU has run this step.
"""

import importlib.util
import pathlib

# Loaded by path, as nq_flash.py loads nq.py, so that `--config experiments/configs/nq_inplace.py`
# works from any directory.
_spec = importlib.util.spec_from_file_location(
    "nq_flash", pathlib.Path(__file__).with_name("nq_flash.py")
)
nq_flash = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nq_flash)


def get_config():
    config = nq_flash.get_config()
    config.model.attention_impl = "inplace"
    config.model.remat_policy = "attention_and_projections"
    return config
