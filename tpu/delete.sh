#!/usr/bin/env bash
# Deletes a TPU VM (all of its workers and their boot disks; data on them is lost).
#
#   tpu/delete.sh --name rag-v4 --zone us-central2-b          # gcloud asks for confirmation
#   tpu/delete.sh --name rag-v4 --zone us-central2-b --yes    # no question asked
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<USAGE
usage: tpu/delete.sh --name NAME --zone ZONE [--yes] [--project PROJECT] [--dry-run]

  --name NAME        the TPU VM to delete
  --zone ZONE        its zone
  --yes              do not ask for confirmation (gcloud --quiet)
  --project PROJECT  Google Cloud project (default: gcloud's configured project)
  --dry-run          print the gcloud command instead of running it
USAGE
}

NAME="${TPU_NAME:-}"
ZONE="${TPU_ZONE:-}"
QUIET=""
normalize_args "$@"
set -- "${ARGS[@]}"
while (($#)); do
  case "$1" in
    --name) need_value "$@"; NAME="$2"; shift 2 ;;
    --zone) need_value "$@"; ZONE="$2"; shift 2 ;;
    --project) need_value "$@"; PROJECT="$2"; shift 2 ;;
    --yes) QUIET="--quiet"; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) usage_error "unknown argument '$1'" ;;
  esac
done

check_name_and_zone
tpu_vm delete "$NAME" --zone="$ZONE" ${QUIET:+"$QUIET"}
