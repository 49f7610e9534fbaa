#!/usr/bin/env bash
# Runs on each TPU worker (tpu/run.sh calls it over ssh).
#
#   bash rag_jax/tpu/worker_run.sh start --run-id ID [--coordinator HOST:PORT] -- 'COMMAND LINE'
#   bash rag_jax/tpu/worker_run.sh follow --run-id ID
#
# `start` launches the command line with bash in ~/rag_jax, detached from the ssh session (so a
# dropped connection does not kill the job), with the venv of tpu/setup.sh on PATH and
# JAX_COORDINATOR_ADDRESS set when given; output goes to ~/rag_jax_runs/ID/log, the process id
# to .../pid and, when it ends, the exit status to .../rc. `follow` prints the log as it grows
# until the process ends, then exits with its status.
set -euo pipefail

usage() {
  echo "usage: worker_run.sh start --run-id ID [--coordinator HOST:PORT] -- 'COMMAND LINE'" >&2
  echo "       worker_run.sh follow --run-id ID" >&2
  exit 2
}

(($#)) || usage
ACTION="$1"
shift
RUN_ID=""
COORDINATOR=""
COMMAND=""
while (($#)); do
  case "$1" in
    --run-id) RUN_ID="${2:-}"; shift 2 || usage ;;
    --coordinator) COORDINATOR="${2:-}"; shift 2 || usage ;;
    --) shift; COMMAND="$*"; break ;;
    *) usage ;;
  esac
done
[[ "$RUN_ID" =~ ^[A-Za-z0-9._-]+$ ]] || usage

SRC="${RAG_JAX_SRC:-$HOME/rag_jax}"
VENV="${RAG_JAX_VENV:-$HOME/rag_jax_venv}"
DIR="$HOME/rag_jax_runs/$RUN_ID"

case "$ACTION" in
  start)
    [[ -n "$COMMAND" ]] || usage
    if [[ -f "$DIR/pid" ]] && kill -0 "$(cat "$DIR/pid")" 2>/dev/null; then
      echo "$(hostname): run $RUN_ID is still running (pid $(cat "$DIR/pid"))" >&2
      exit 1
    fi
    mkdir -p "$DIR"
    rm -f "$DIR/rc"
    if [[ -x "$VENV/bin/python" ]]; then
      export VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH"
    else
      echo "$(hostname): warning: no venv at $VENV (run tpu/setup.sh); using PATH as is" >&2
    fi
    if [[ -n "$COORDINATOR" ]]; then
      export JAX_COORDINATOR_ADDRESS="$COORDINATOR"
    fi
    {
      echo "# run $RUN_ID on $(hostname) at $(date -u +%FT%TZ)"
      echo "# JAX_COORDINATOR_ADDRESS=${JAX_COORDINATOR_ADDRESS:-}"
      echo "# \$ $COMMAND"
    } >"$DIR/log"
    cd "$SRC"
    # setsid: its own session, so the end of the ssh session does not signal it. The command line
    # runs in an inner bash so that an `exit` in it still lets the outer one record the status.
    # shellcheck disable=SC2016 # $CMD and $RC_FILE expand in the detached shell, not here
    CMD="$COMMAND" RC_FILE="$DIR/rc" setsid bash -c 'bash -c "$CMD"; echo "$?" >"$RC_FILE"' \
      </dev/null >>"$DIR/log" 2>&1 &
    echo "$!" >"$DIR/pid"
    echo "$(hostname): started run $RUN_ID (pid $!), log $DIR/log"
    ;;
  follow)
    for _ in $(seq 60); do
      [[ -f "$DIR/pid" ]] && break
      sleep 1
    done
    [[ -f "$DIR/pid" ]] || { echo "$(hostname): no run $RUN_ID in $DIR" >&2; exit 1; }
    tail -n +1 -F --pid="$(cat "$DIR/pid")" "$DIR/log" 2>/dev/null
    for _ in $(seq 10); do # the rc file is written just before the process exits
      [[ -f "$DIR/rc" ]] && exit "$(cat "$DIR/rc")"
      sleep 1
    done
    echo "$(hostname): run $RUN_ID ended without an exit status (killed?)" >&2
    exit 1
    ;;
  *) usage ;;
esac
