#!/usr/bin/env bash
# Creates a Cloud TPU VM (one host or a multi-host slice) for rag_jax.
#
#   tpu/create.sh --name rag-v4 --zone us-central2-b --accelerator-type v4-8
#   tpu/create.sh --name rag-v6e --zone us-east5-b --accelerator-type v6e-8 --spot --dry-run
#
# The runtime version defaults to the one Cloud TPU documents for JAX on that TPU generation.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<EOF
usage: tpu/create.sh --name NAME --zone ZONE --accelerator-type TYPE [--version RUNTIME]
                     [--spot | --preemptible] [--project PROJECT] [--dry-run]

  --name NAME              TPU VM name (lower-case letters, digits, hyphens)
  --zone ZONE              a zone that offers TYPE, e.g. us-central2-b (v4), us-east5-b (v6e)
  --accelerator-type TYPE  $ACCELERATOR_HELP
  --version RUNTIME        TPU software version; default by generation: tpu-ubuntu2204-base (v4),
                           v2-alpha-tpuv5-lite (v5e), v2-alpha-tpuv5 (v5p), v2-alpha-tpuv6e (v6e)
  --spot                   Spot capacity: much cheaper, can be reclaimed at any time
  --preemptible            legacy preemptible capacity (stopped after at most 24 h)
  --project PROJECT        Google Cloud project (default: gcloud's configured project)
  --dry-run                print the gcloud command instead of running it
EOF
}

NAME="${TPU_NAME:-}"
ZONE="${TPU_ZONE:-}"
TYPE=""
VERSION=""
CAPACITY=""
normalize_args "$@"
set -- "${ARGS[@]}"
while (($#)); do
  case "$1" in
    --name) need_value "$@"; NAME="$2"; shift 2 ;;
    --zone) need_value "$@"; ZONE="$2"; shift 2 ;;
    --accelerator-type) need_value "$@"; TYPE="$2"; shift 2 ;;
    --version) need_value "$@"; VERSION="$2"; shift 2 ;;
    --project) need_value "$@"; PROJECT="$2"; shift 2 ;;
    --spot | --preemptible)
      [[ -z "$CAPACITY" || "$CAPACITY" == "$1" ]] || usage_error "--spot and --preemptible exclude each other"
      CAPACITY="$1"
      shift
      ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) usage_error "unknown argument '$1'" ;;
  esac
done

check_name_and_zone
[[ -n "$TYPE" ]] || usage_error "missing --accelerator-type"
is_accelerator_type "$TYPE" || usage_error "unknown accelerator type '$TYPE'"
VERSION="${VERSION:-$(runtime_version_for "$TYPE")}"

tpu_vm create "$NAME" --zone="$ZONE" --accelerator-type="$TYPE" --version="$VERSION" \
  ${CAPACITY:+"$CAPACITY"}
