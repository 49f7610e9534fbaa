#!/usr/bin/env bash
# Installs JAX for TPU and this checkout of rag_jax on every worker of a TPU VM.
#
#   tpu/setup.sh --name rag-v4 --zone us-central2-b
#
# Copies the checkout (tracked and untracked-but-not-ignored files) to ~/rag_jax on each worker,
# then runs tpu/worker_setup.sh there: a Python venv in ~/rag_jax_venv with jax[tpu] at the
# version CI pins (requirements-ci.txt) and rag_jax installed editable. Idempotent: run it again
# after changing the code; ~/rag_jax is replaced (keep data and workdirs outside it) and the
# venv is reused.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<EOF
usage: tpu/setup.sh --name NAME --zone ZONE [--python VERSION] [--jax-version VERSION]
                    [--project PROJECT] [--dry-run]

  --name NAME            the TPU VM (from tpu/create.sh)
  --zone ZONE            its zone
  --python VERSION       Python for the workers' venv (default 3.11; uv fetches it if needed)
  --jax-version VERSION  jax[tpu] version (default: the jax pin in requirements-ci.txt)
  --project PROJECT      Google Cloud project (default: gcloud's configured project)
  --dry-run              print the gcloud commands instead of running them
EOF
}

NAME="${TPU_NAME:-}"
ZONE="${TPU_ZONE:-}"
PYTHON_VERSION="3.11"
JAX_VERSION="$(sed -n 's/^jax==\([0-9.]*\)$/\1/p' "$REPO_ROOT/requirements-ci.txt" 2>/dev/null || true)"
normalize_args "$@"
set -- "${ARGS[@]}"
while (($#)); do
  case "$1" in
    --name) need_value "$@"; NAME="$2"; shift 2 ;;
    --zone) need_value "$@"; ZONE="$2"; shift 2 ;;
    --python) need_value "$@"; PYTHON_VERSION="$2"; shift 2 ;;
    --jax-version) need_value "$@"; JAX_VERSION="$2"; shift 2 ;;
    --project) need_value "$@"; PROJECT="$2"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) usage_error "unknown argument '$1'" ;;
  esac
done

check_name_and_zone
[[ "$PYTHON_VERSION" =~ ^3\.[0-9]+$ ]] || usage_error "--python '$PYTHON_VERSION' is not like 3.11"
[[ -z "$JAX_VERSION" || "$JAX_VERSION" =~ ^[0-9]+(\.[0-9]+)*$ ]] ||
  usage_error "--jax-version '$JAX_VERSION' is not a version number"

# The checkout as a tarball: what git would commit now, or the whole folder outside git.
if ((DRY_RUN)); then
  TARBALL="${TMPDIR:-/tmp}/rag_jax.tar.gz"
  echo "# pack $REPO_ROOT (git ls-files -co --exclude-standard) into $TARBALL"
else
  WORK="$(mktemp -d)"
  trap 'rm -rf "$WORK"' EXIT
  TARBALL="$WORK/rag_jax.tar.gz"
  if git -C "$REPO_ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git -C "$REPO_ROOT" ls-files -z -co --exclude-standard |
      tar -C "$REPO_ROOT" --null -T - -czf "$TARBALL"
  else
    tar -C "$REPO_ROOT" --exclude=.git --exclude=__pycache__ --exclude='*.egg-info' \
      -czf "$TARBALL" .
  fi
fi

# Relative paths: ssh and scp start in the remote home directory.
UNPACK="set -e; rm -rf rag_jax.new; mkdir rag_jax.new; tar -xzf rag_jax.tar.gz -C rag_jax.new"
UNPACK+="; rm -rf rag_jax; mv rag_jax.new rag_jax; rm rag_jax.tar.gz"
INSTALL="bash rag_jax/tpu/worker_setup.sh --python $PYTHON_VERSION"
INSTALL+="${JAX_VERSION:+ --jax-version $JAX_VERSION}"

tpu_vm scp "$TARBALL" "$NAME:rag_jax.tar.gz" --worker=all --zone="$ZONE"
tpu_vm ssh "$NAME" --zone="$ZONE" --worker=all --command="$UNPACK; $INSTALL"
