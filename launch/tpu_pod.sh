#!/usr/bin/env bash
# One infjax run on every worker of a Cloud TPU VM pod slice (JAX detects the pod):
#   launch/tpu_pod.sh TPU_NAME ZONE --config=configs/multi_pi.py:e5-base-v2 --workdir=gs://bucket/runs/x
# Assumes the repository and its environment are at the same path on every worker
# (INFJAX_DIR, default ~/infjax; PYTHON, default python3), installed with the gcs extra
# (`pip install -e ".[gcs]"`). The workdir must be shared: a gs:// URL (README, "Object stores").
set -euo pipefail
if [[ $# -lt 2 ]]; then echo "usage: $0 TPU_NAME ZONE <infjax.train flags>" >&2; exit 2; fi
TPU=$1; ZONE=$2; shift 2
DIR=${INFJAX_DIR:-'~/infjax'}
PYTHON=${PYTHON:-python3}
printf -v FLAGS '%q ' "$@"
gcloud compute tpus tpu-vm ssh "$TPU" --zone="$ZONE" --worker=all \
  --command="cd $DIR && $PYTHON -m infjax.train $FLAGS"
