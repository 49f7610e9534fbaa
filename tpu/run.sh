#!/usr/bin/env bash
# Runs one command on every worker of a TPU VM as one multi-host JAX program, and streams worker
# 0's log until the command ends (exiting with worker 0's exit status).
#
#   tpu/run.sh --name rag-v4 --zone us-central2-b -- \
#       python experiments/train.py --config experiments/configs/nq.py --workdir gs://b/nq
#
# The words after `--` form one shell command line, run by bash in ~/rag_jax with the venv of
# tpu/setup.sh on PATH. On a slice of several hosts every worker gets JAX_COORDINATOR_ADDRESS
# (worker 0's internal IP and --port): that is what `rag_jax.devices.distributed.
# maybe_initialize_distributed()` looks for, and `jax.distributed.initialize()` takes the
# coordinator from it and the process id and count from the TPU metadata. The command runs
# detached (tpu/worker_run.sh); logs stay in ~/rag_jax_runs/RUN_ID/ on each worker, so a lost
# connection loses nothing: `tpu/run.sh ... --attach RUN_ID` streams worker 0's log again.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<EOF
usage: tpu/run.sh --name NAME --zone ZONE [--run-id ID] [--port PORT] [--no-follow]
                  [--project PROJECT] [--dry-run] -- COMMAND [ARGS...]
       tpu/run.sh --name NAME --zone ZONE --attach RUN_ID [--project PROJECT] [--dry-run]

  --name NAME        the TPU VM (from tpu/create.sh, set up by tpu/setup.sh)
  --zone ZONE        its zone
  --run-id ID        names the logs, ~/rag_jax_runs/ID on each worker (default: a timestamp)
  --port PORT        the jax.distributed coordinator port on worker 0 (default 8476)
  --no-follow        start the command and return without streaming worker 0's log
  --attach RUN_ID    only stream worker 0's log of an earlier run, until it ends
  --project PROJECT  Google Cloud project (default: gcloud's configured project)
  --dry-run          print the gcloud commands instead of running them
EOF
}

NAME="${TPU_NAME:-}"
ZONE="${TPU_ZONE:-}"
RUN_ID=""
PORT="8476"
FOLLOW=1
ATTACH=""
COMMAND=()
normalize_args "$@"
set -- "${ARGS[@]}"
while (($#)); do
  case "$1" in
    --name) need_value "$@"; NAME="$2"; shift 2 ;;
    --zone) need_value "$@"; ZONE="$2"; shift 2 ;;
    --run-id) need_value "$@"; RUN_ID="$2"; shift 2 ;;
    --port) need_value "$@"; PORT="$2"; shift 2 ;;
    --attach) need_value "$@"; ATTACH="$2"; shift 2 ;;
    --project) need_value "$@"; PROJECT="$2"; shift 2 ;;
    --no-follow) FOLLOW=0; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; COMMAND=("$@"); break ;;
    *) usage_error "unknown argument '$1' (the command goes after --)" ;;
  esac
done

check_name_and_zone
if ! [[ "$PORT" =~ ^[0-9]+$ ]] || ((PORT < 1 || PORT > 65535)); then
  usage_error "--port '$PORT' is not a port number"
fi
if [[ -n "$ATTACH" ]]; then
  ((${#COMMAND[@]} == 0)) || usage_error "--attach streams an earlier run; it takes no command"
  RUN_ID="$ATTACH"
else
  ((${#COMMAND[@]})) || usage_error "missing the command to run (after --)"
  RUN_ID="${RUN_ID:-$(date -u +%Y%m%d-%H%M%S)}"
fi
[[ "$RUN_ID" =~ ^[A-Za-z0-9._-]+$ ]] || usage_error "--run-id '$RUN_ID' may hold only A-Z a-z 0-9 . _ -"

follow() {
  tpu_vm ssh "$NAME" --zone="$ZONE" --worker=0 \
    --command="bash rag_jax/tpu/worker_run.sh follow --run-id $RUN_ID"
}

if [[ -n "$ATTACH" ]]; then
  follow
  exit
fi

# Worker 0's internal IP is the coordinator; one worker needs none.
DESCRIBE=(describe "$NAME" --zone="$ZONE" "--format=value(networkEndpoints[].ipAddress)")
if ((DRY_RUN)); then
  tpu_vm "${DESCRIBE[@]}"
  COORDINATOR="WORKER0_IP:$PORT"
else
  IPS="$(tpu_vm "${DESCRIBE[@]}")"
  IFS=';, ' read -r -a WORKER_IPS <<<"$IPS"
  ((${#WORKER_IPS[@]})) || { echo "error: TPU VM '$NAME' in $ZONE reports no workers" >&2; exit 1; }
  COORDINATOR=""
  ((${#WORKER_IPS[@]} == 1)) || COORDINATOR="${WORKER_IPS[0]}:$PORT"
  echo "$NAME: ${#WORKER_IPS[@]} worker(s)${COORDINATOR:+, coordinator $COORDINATOR}" >&2
fi

START="bash rag_jax/tpu/worker_run.sh start --run-id $RUN_ID"
START+="${COORDINATOR:+ --coordinator $COORDINATOR}"
START+=" -- $(print_cmd "${COMMAND[*]}")"
tpu_vm ssh "$NAME" --zone="$ZONE" --worker=all --command="$START"
if ((FOLLOW)); then
  follow
else
  echo "started run $RUN_ID; stream worker 0's log with: tpu/run.sh --name $NAME --zone $ZONE --attach $RUN_ID" >&2
fi
