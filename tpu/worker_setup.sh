#!/usr/bin/env bash
# Runs on each TPU worker (tpu/setup.sh calls it): builds ~/rag_jax_venv with jax[tpu] and the
# checkout in ~/rag_jax installed editable, then prints what JAX sees.
#
#   bash rag_jax/tpu/worker_setup.sh --python 3.11 --jax-version 0.10.2
#
# Idempotent: uv, the interpreter and the venv are reused when present, and `uv pip install`
# leaves satisfied requirements alone. TPU images ship Python 3.10 while current JAX needs 3.11 or
# newer, hence uv, which fetches a standalone interpreter for the venv.
set -euo pipefail

PYTHON_VERSION="3.11"
JAX_VERSION=""
while (($#)); do
  case "$1" in
    --python) PYTHON_VERSION="$2"; shift 2 ;;
    --jax-version) JAX_VERSION="$2"; shift 2 ;;
    *) echo "worker_setup.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done

SRC="${RAG_JAX_SRC:-$HOME/rag_jax}"
VENV="${RAG_JAX_VENV:-$HOME/rag_jax_venv}"
export PATH="$HOME/.local/bin:$PATH"

if ! command -v uv >/dev/null 2>&1; then
  # Ubuntu 24.04's pip refuses user installs without --break-system-packages; 22.04's pip does
  # not know that flag, so try the plain form first.
  python3 -m pip install --user --quiet uv ||
    python3 -m pip install --user --quiet --break-system-packages uv
fi
if [[ ! -x "$VENV/bin/python" ]]; then
  uv venv --python "$PYTHON_VERSION" "$VENV"
fi
uv pip install --python "$VENV/bin/python" "jax[tpu]${JAX_VERSION:+==$JAX_VERSION}" -e "$SRC"
# Versions only: touching the TPUs of a multi-host slice needs every worker in one distributed
# program (tpu/run.sh starts those).
"$VENV/bin/python" - <<'EOF'
import importlib.metadata, socket
def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "missing"
print(socket.gethostname(), *(f"{n}={version(n)}" for n in ("jax", "jaxlib", "libtpu", "rag_jax")))
EOF
