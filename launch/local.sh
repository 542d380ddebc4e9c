#!/usr/bin/env bash
# N CPU processes of one job on this machine, over loopback (a multi-host rehearsal):
#   launch/local.sh N --config=configs/multi_pi.py --workdir=runs/local [--config.x=y ...]   (infjax.train)
#   launch/local.sh N infjax.evaluate --model=runs/local --dataset=synthetic [--out=DIR]    (any infjax module)
# Training: all processes share the workdir (checkpoints are written collectively; metrics.jsonl and
# eval.json by process 0). Evaluation: every process computes, process 0 prints and writes --out.
# Env: INFJAX_LOCAL_DEVICES (CPU devices per process, default 1), INFJAX_PORT (coordinator port,
# default a free one), PYTHON (default python), INFJAX_LOG_DIR (where process_i.log goes; default
# the --workdir when it is local, else runs/local: never an evaluation's --out, which belongs to infjax.evaluate).
# Each launch appends to the logs after a line of its own (the time, the process, the command): the logs of
# earlier launches (a resumed run, a launch refused because the workdir is in use) are kept.
set -euo pipefail
if [[ $# -lt 1 || ! "$1" =~ ^[0-9]+$ || $((10#$1)) -lt 1 ]]; then
  echo "usage: $0 N [infjax.MODULE] <flags>   (N >= 1 processes${1:+; got $1})" >&2; exit 2
fi
N=$((10#$1)); shift
# The variables read below, checked here: XLA aborts (a segfault, or its whole flag list) on a bad device count.
if [[ ! "${INFJAX_LOCAL_DEVICES:-1}" =~ ^[0-9]+$ || $((10#${INFJAX_LOCAL_DEVICES:-1})) -lt 1 ]]; then
  echo "$0: INFJAX_LOCAL_DEVICES='${INFJAX_LOCAL_DEVICES}': the CPU devices per process must be a whole number >= 1" >&2
  exit 2
fi
export INFJAX_LOCAL_DEVICES=$((10#${INFJAX_LOCAL_DEVICES:-1}))
if [[ -n "${INFJAX_PORT:-}" && ( ! "$INFJAX_PORT" =~ ^[0-9]+$ || $((10#$INFJAX_PORT)) -lt 1 || $((10#$INFJAX_PORT)) -gt 65535 ) ]]; then
  echo "$0: INFJAX_PORT='${INFJAX_PORT}': the coordinator's port must be a whole number from 1 to 65535 (unset: a free one)" >&2
  exit 2
fi
# One id for the processes of this launch: processes of another job that reach this job's coordinator are refused.
export INFJAX_LAUNCH_ID=${INFJAX_LAUNCH_ID:-local-${HOSTNAME:-host}-$$-$(date +%s%N)}
MODULE=infjax.train
if [[ $# -gt 0 && "$1" == infjax.* ]]; then MODULE=$1; shift; fi
PYTHON=${PYTHON:-python}
PORT=${INFJAX_PORT:+$((10#$INFJAX_PORT))}
PORT=${PORT:-$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
LOG_DIR=runs/local
for arg in "$@"; do [[ "$arg" == --workdir=* ]] && LOG_DIR=${arg#--workdir=}; done
if [[ "$LOG_DIR" == *://* ]]; then LOG_DIR=runs/local; fi   # an object-store workdir: the logs stay here
LOG_DIR=${INFJAX_LOG_DIR:-$LOG_DIR}
mkdir -p "$LOG_DIR"
for ((i = 0; i < N; i++)); do
  if [[ -L "$LOG_DIR/process_$i.log" ]]; then   # appending would write into whatever it points to
    echo "$0: $LOG_DIR/process_$i.log is a symbolic link (to $(readlink "$LOG_DIR/process_$i.log")); remove it" >&2
    exit 2
  fi
done
pids=()
for ((i = 0; i < N; i++)); do
  echo "==== $(date '+%Y-%m-%d %H:%M:%S') launch/local.sh: process $i of $N (pid $$): $MODULE $*" \
    >>"$LOG_DIR/process_$i.log"
  JAX_PLATFORMS=cpu \
  XLA_FLAGS="--xla_force_host_platform_device_count=${INFJAX_LOCAL_DEVICES:-1}" \
  INFJAX_COORDINATOR=127.0.0.1:$PORT INFJAX_NUM_PROCESSES=$N INFJAX_PROCESS_ID=$i \
    "$PYTHON" -m "$MODULE" "$@" >>"$LOG_DIR/process_$i.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
