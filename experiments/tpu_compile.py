r"""Compiles a config's train step and generation for a Cloud TPU topology, on this (CPU) host.

    python experiments/tpu_compile.py --config experiments/configs/nq.py --topology v5e:2x4
    python experiments/tpu_compile.py --config experiments/configs/nq.py --topology v4:2x2x1 \
        --layouts replicated,fsdp --remat both --paths host,in_step --largest --generate
    python experiments/tpu_compile.py --config experiments/configs/llama_tpu.py \
        --topology v5e:2x4 --paths host --largest --largest_tries 1

The generator may be BART or a causal LM (a Llama folder whose config.json alone is enough to
plan: `llama_tpu.py`). Needs `libtpu` (`pip install 'rag_jax[tpu]'`); no TPU, checkpoint, index
or data. Topologies:
v4:2x2x1 (v4-8), v5e:2x4 (v5litepod-8), v5p:2x2x1 (v5p-8), v6e:2x4 (v6e-8), and slices of several
hosts such as v5e:4x4 or v4:2x2x4. Prints one line per compile and writes the report (per-chip
memory by part against HBM, XLA's FLOPs and bytes against the analytic count, roofline step time,
collectives, the largest batch that fits) as JSON to --out. A paper-scale compile takes minutes
on two CPU cores; `benchmarks/aot.py` says what each figure is.
"""

import json
import os
import pathlib
import sys

# Planning reads only what is on this machine (no checkpoint download); the programs compile for
# the topology's TPU devices, whatever this host's own backend.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/ (not installed)

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from benchmarks import aot, tpu_topology  # noqa: E402
from rag_jax.run import settings  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "experiment config file", lock_config=True
)
_TOPOLOGY = flags.DEFINE_string("topology", None, "TPU topology, e.g. v5e:2x4 or v4:2x2x1")
_OUT = flags.DEFINE_string("out", "tpu_compile.json", "JSON report path")
_LAYOUTS = flags.DEFINE_list("layouts", None, "param_sharding values; default: the config's")
_REMAT = flags.DEFINE_enum("remat", "config", ["config", "on", "off", "both"], "model.remat")
_PATHS = flags.DEFINE_list(
    "paths", ["host", "in_step"], "host: index on the host; in_step: searched in the step"
)
_LARGEST = flags.DEFINE_bool(
    "largest", False, "also find the largest batch that fits (more compiles)"
)
_TRIES = flags.DEFINE_integer(
    "largest_tries", 3, "compiles of the largest-batch search after its two probes"
)
_GENERATE = flags.DEFINE_bool("generate", False, "also compile generation at the eval batch")
_HLO_DIR = flags.DEFINE_string("hlo_dir", None, "also write each program's optimised HLO here")
flags.mark_flags_as_required(["config", "topology"])


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    config = _CONFIG.value
    remats = {"config": [config.model.remat], "on": [True], "off": [False]}.get(
        _REMAT.value, [True, False]
    )
    layouts = _LAYOUTS.value or [config.train.param_sharding]
    unknown = set(layouts) - {"replicated", "fsdp"} or set(_PATHS.value) - {"host", "in_step"}
    if unknown:
        raise SystemExit(f"error: unknown --layouts/--paths value {sorted(unknown)}; see --help")

    def report(out):
        with open(_OUT.value, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1, sort_keys=True, default=str)

    options = dict(
        largest=_LARGEST.value,
        generate=_GENERATE.value,
        hlo_dir=_HLO_DIR.value,
        largest_tries=_TRIES.value,
    )
    try:
        aot.run(config, _TOPOLOGY.value, layouts=layouts, remats=remats, paths=_PATHS.value,
                report=report, **options)  # fmt: skip
    except tpu_topology.PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {_OUT.value}", flush=True)
    return 0


if __name__ == "__main__":
    settings.check_overrides()
    app.run(lambda argv: sys.exit(main(argv)))
