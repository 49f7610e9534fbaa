# shellcheck shell=bash
# Shared by tpu/create.sh, setup.sh, run.sh and delete.sh (sourced, never run): argument helpers,
# the accelerator types this project knows, and the dry-run switch.
#
# Every script parses and validates all of its arguments before it runs anything, so a mistake
# costs a usage message, never a half-created TPU. Commands go through `run`, which prints them
# (shell-quoted, ready to paste) and, unless DRY_RUN=1, executes them.

TPU_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck disable=SC2034 # read by the scripts that source this file
REPO_ROOT="$(cd "$TPU_DIR/.." && pwd)"
DRY_RUN=0
PROJECT=""

# Runtime (software) version for JAX per accelerator family, from the Cloud TPU "TPU software
# versions" page (cloud.google.com/tpu/docs/runtimes): v6e, v5p and v5e have their own images;
# v4 uses the plain Ubuntu 22.04 base.
runtime_version_for() {
  case "${1%%-*}" in
    v4) echo "tpu-ubuntu2204-base" ;;
    v5litepod) echo "v2-alpha-tpuv5-lite" ;;
    v5p) echo "v2-alpha-tpuv5" ;;
    v6e) echo "v2-alpha-tpuv6e" ;;
    *) return 1 ;;
  esac
}

# Accelerator types are `<family>-<size>`. v4 and v5p count TensorCores (2 per chip, 8 per host),
# in multiples of 8; v5litepod (v5e) and v6e count chips in the slice shapes Cloud TPU offers.
# shellcheck disable=SC2034 # read by the scripts that source this file
ACCELERATOR_HELP="v4-8 ... v4-4096, v5p-8 ... v5p-12288 (multiples of 8), \
v5litepod-{1,4,8,16,32,64,128,256}, v6e-{1,4,8,16,32,64,128,256}"

is_accelerator_type() {
  local family="${1%-*}" size="${1##*-}"
  [[ "$1" == *-* && "$size" =~ ^[0-9]+$ ]] || return 1
  size=$((10#$size))
  case "$family" in
    v4) ((size >= 8 && size <= 4096 && size % 8 == 0)) ;;
    v5p) ((size >= 8 && size <= 12288 && size % 8 == 0)) ;;
    v5litepod | v6e) [[ " 1 4 8 16 32 64 128 256 " == *" $size "* ]] ;;
    *) return 1 ;;
  esac
}

# Prints the usage (each script defines `usage`) after an error line, and exits 2.
usage_error() {
  echo "error: $*" >&2
  usage >&2
  exit 2
}

# Splits `--flag=value` into `--flag value` up to a `--`; the result is in the array ARGS.
normalize_args() {
  ARGS=()
  while (($#)); do
    if [[ "$1" == -- ]]; then
      ARGS+=("$@")
      return
    elif [[ "$1" == --*=* ]]; then
      ARGS+=("${1%%=*}" "${1#*=}")
    else
      ARGS+=("$1")
    fi
    shift
  done
}

# `need_value FLAG "$@"` (with "$@" starting at FLAG) fails unless FLAG is followed by a value.
need_value() {
  if (($# < 2)) || [[ -z "$2" || "$2" == --* ]]; then
    usage_error "$1 needs a value"
  fi
}

check_name_and_zone() {
  [[ -n "${NAME:-}" ]] || usage_error "missing --name (the TPU VM's name)"
  [[ "$NAME" =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] ||
    usage_error "--name '$NAME' must be lower-case letters, digits and hyphens, starting with a letter"
  [[ -n "${ZONE:-}" ]] || usage_error "missing --zone (e.g. us-central2-b for v4, us-east5-b for v6e)"
}

# Prints a command on one line, each word that needs it in single quotes, ready to paste.
print_cmd() {
  local word line="" q="'"
  for word in "$@"; do
    if [[ ! "$word" =~ ^[][A-Za-z0-9_./:=,@%+-]+$ ]]; then
      word="$q${word//$q/$q\\$q$q}$q"
    fi
    line+="${line:+ }$word"
  done
  echo "$line"
}

# Runs a command, printing it first; with --dry-run only prints it (on stdout).
run() {
  if ((DRY_RUN)); then
    print_cmd "$@"
  else
    echo "+ $(print_cmd "$@")" >&2
    "$@"
  fi
}

# `gcloud compute tpus tpu-vm SUBCOMMAND ...` with --project when one was given.
tpu_vm() {
  local sub="$1"
  shift
  run gcloud compute tpus tpu-vm "$sub" "$@" ${PROJECT:+"--project=$PROJECT"}
}
