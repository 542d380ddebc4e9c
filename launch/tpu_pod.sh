#!/usr/bin/env bash
# One infjax run on every worker of a Cloud TPU VM pod slice:
#   launch/tpu_pod.sh TPU_NAME ZONE --config=configs/multi_pi.py:e5-base-v2 --workdir=gs://bucket/runs/x
# On a TPU VM infjax starts JAX's distributed runtime, which finds the slice's workers through the metadata
# server; each worker logs one line at start, e.g. "start-up: Cloud TPU VM (the pod from the metadata server):
# process 1 of 4 (coordinator 10.130.0.5:8482); local devices 4-7 (4 x TPU v5 lite); 16 devices in all (tpu)".
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
