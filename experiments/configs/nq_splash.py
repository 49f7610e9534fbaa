r"""nq.py's paper setting with the splash attention kernel, a remat policy and the fused AdamW
update, planned for TPU.

`nq_flash.py` (`nq.py`: DPR question encoder + BART-large, k = 5, context 300, bfloat16 compute,
remat, hidden dropout on; the question encoder's attention-probability dropout at 0.0, which no
kernel can apply; the fused AdamW update) with `model.attention_impl = "splash"` (every
attention in jax's Pallas TPU splash kernel, whose backward pass reads one [h, T] log-sum-exp per
row where the flash kernel's reads two lane-broadcast statistics) and `model.remat_policy =
"attention"` (each layer keeps its query, key and value projections and the kernel's output and
log-sum-exp: the backward pass recomputes the output projection and the feed-forward layer, not
the attention). The compiled step differs from `nq_flash.py`'s in those two settings only.

    python experiments/tpu_compile.py --config experiments/configs/nq_splash.py \
        --topology v5e:2x4 --paths host --hlo_dir /tmp/hlo_d \
        --out tpu/compile_reports/v5e-2x4_replicated_remat-attention_host_splash_fused.json

Compiled on two shared CPU cores in 257 s: 14.46 GiB per chip of 15.75, 161.8 GB of HBM traffic
per chip per step, a 197.5 ms roofline step (memory-bound; compute 186.8 ms), an MFU ceiling of
79% (tpu/README.md, "Remat policies and splash attention"). Roofline estimates from the compile:
no TPU has run this step.
"""

import importlib.util
import pathlib

# Loaded by path, as nq_flash.py loads nq.py, so that `--config experiments/configs/nq_splash.py`
# works from any directory.
_spec = importlib.util.spec_from_file_location(
    "nq_flash", pathlib.Path(__file__).with_name("nq_flash.py")
)
nq_flash = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nq_flash)


def get_config():
    config = nq_flash.get_config()
    config.model.attention_impl = "splash"
    config.model.remat_policy = "attention"
    return config
