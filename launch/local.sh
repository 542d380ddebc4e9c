#!/usr/bin/env bash
# N CPU processes of one run on this machine, over loopback (a multi-host rehearsal):
#   launch/local.sh N --config=configs/multi_pi.py --workdir=runs/local [--config.x=y ...]
# All processes share the workdir (checkpoints are written collectively; metrics.jsonl and
# eval.json by process 0). Env: INFJAX_LOCAL_DEVICES (CPU devices per process, default 1),
# INFJAX_PORT (coordinator port, default a free one), PYTHON (default python).
# Process i's output goes to WORKDIR/process_i.log.
set -euo pipefail
if [[ $# -lt 1 || ! "$1" =~ ^[0-9]+$ ]]; then
  echo "usage: $0 N <infjax.train flags>" >&2; exit 2
fi
N=$1; shift
PYTHON=${PYTHON:-python}
PORT=${INFJAX_PORT:-$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
WORKDIR=runs/local
for arg in "$@"; do [[ "$arg" == --workdir=* ]] && WORKDIR=${arg#--workdir=}; done
mkdir -p "$WORKDIR"
pids=()
for ((i = 0; i < N; i++)); do
  JAX_PLATFORMS=cpu \
  XLA_FLAGS="--xla_force_host_platform_device_count=${INFJAX_LOCAL_DEVICES:-1}" \
  INFJAX_COORDINATOR=127.0.0.1:$PORT INFJAX_NUM_PROCESSES=$N INFJAX_PROCESS_ID=$i \
    "$PYTHON" -m infjax.train "$@" >"$WORKDIR/process_$i.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
