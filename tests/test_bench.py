"""Every benchmark flag is checked before the work: one line naming the flag, exit 2."""
import os
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT


@pytest.mark.parametrize("flag,says", [("--sweep_rows=abc", "--sweep_rows='abc': comma-separated"),
                                       ("--sweep_rows=96,0", "each >= 1"), ("--steps=-1", "--steps=-1: must be >= 1"),
                                       ("--warmup=-2", "--warmup=-2: must be >= 0"),
                                       ("--peak_flops=-5", "--peak_flops=-5.0: must be >= 0")])
def test_bad_bench_train_flags_are_one_line_before_any_work(flag, says):
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", XLA_FLAGS="")
    p = subprocess.run([sys.executable, "-m", "infjax.bench", "train", "--config=configs/multi_pi.py", flag],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and says in lines[0], p.stderr
    assert "devices:" not in p.stdout                 # nothing was loaded or compiled
