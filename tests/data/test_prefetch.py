"""Prefetch: the steps built ahead (a thread, worker processes) are the steps built in line, in order, from any start;
a step's error reaches the loop as itself; the waits are counted."""
import os
import dataclasses

import numpy as np
import pytest

from infjax.data import batches, packing, prefetch, synthetic, token_store
from infjax.data.tokenize import TextFormat, Tokenizer
from tests.helpers.tiny import tiny_bert_path


@pytest.fixture(scope="module")
def build():
    """A packed builder over 2 shards (the shapes measured over its steps), on the synthetic records."""
    records = synthetic.make_train_records(64, seed=2)
    store = token_store.in_memory(records, tiny_bert_path(), token_store.Encoding(40, 40))
    plan = batches.BatchPlan(len(store), 8, seed=0)
    texts = batches.StepTexts(store, plan, 40, 40, True, batches.InstructionNegativeSampler(len(store.pool), 2, 0),
                              texts=batches.Texts(records, Tokenizer(tiny_bert_path()), TextFormat()))
    shapes = batches.measure_shapes(texts, range(12), 2, max_shapes=2)
    return batches.BatchBuilder(texts, batches.Packing(shapes, shards=2))


def _equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _equal(a[k], b[k])
        else:
            np.testing.assert_array_equal(a[k], b[k])


@pytest.mark.parametrize("workers", [0, 2])
def test_streamed_steps_are_the_steps_built_in_line_from_any_start(build, workers):
    stream = prefetch.StepStream(build, 3, 12, workers=workers, ahead=3)
    with stream as steps:
        seen = []
        for step, batch, info in steps:
            want, want_info = build.assemble(step)
            _equal(batch, want)
            assert info == want_info and set(info["texts"]) == {"q", "p", "n"}
            seen.append(step)
    assert seen == list(range(3, 12)) and stream.built == 9 and stream.waited > 0


@pytest.mark.parametrize("workers", [0, 2])
def test_an_error_building_a_step_reaches_the_loop_as_itself(build, workers):
    """A step that does not fit its capacity: the loop gets the PackingOverflow naming the step and the key to
    raise, after the steps before it."""
    shapes = build.packing.shapes
    one_row = {s: 1 for s in shapes.largest}                # every step in one shape of one row per side
    tight = dataclasses.replace(build, packing=dataclasses.replace(
        build.packing, shapes=dataclasses.replace(shapes, rows=(one_row,), largest=one_row,
                                                  of_step=np.zeros_like(shapes.of_step)),
        row_keys={"q": "data.pack_rows_query", "p": "data.pack_rows_passage", "n": "data.pack_rows_negatives"}))
    with prefetch.StepStream(tight, 5, 9, workers=workers) as steps:
        with pytest.raises(packing.PackingOverflow, match=r"step 5, side '\w+'.*raise data.pack_rows_"):
            next(steps)


def test_auto_takes_a_thread_unless_two_processes_would_build(build, monkeypatch):
    assert prefetch.choose_workers(build, 3, 0, 10) == (3, "data.step_workers=3")
    monkeypatch.setattr(prefetch, "cores", lambda: 16)
    for cost, workers in ((0.004, 0), (0.015, 2), (0.034, 4), (1.0, 15)):
        monkeypatch.setattr(prefetch, "step_cost", lambda b, steps, c=cost: c)
        assert prefetch.choose_workers(build, -1, 0, 10)[0] == workers
    monkeypatch.setattr(prefetch, "cores", lambda: 2)
    assert prefetch.choose_workers(build, -1, 0, 10)[0] == 0            # one process does no more than the thread


def test_a_worker_ends_when_the_process_that_started_it_is_killed(tmp_path):
    """A step worker ignores SIGINT and SIGTERM (the loop's process stops it), so it must notice that process
    die by -9: the middle process here starts a worker-like child running `_exit_with` on it, then is killed."""
    import signal
    import subprocess
    import sys
    import time

    marker = tmp_path / "child.pid"
    child = (f"import os; from infjax.data import prefetch; open({str(marker)!r}, 'w').write(str(os.getpid())); "
             f"prefetch._exit_with(os.getppid(), 0.05)")
    middle = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys, time; "
                               f"subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(600)"])
    deadline = time.time() + 60
    while not (marker.exists() and marker.read_text()) and time.time() < deadline:
        time.sleep(0.1)
    pid = int(marker.read_text())
    os.kill(pid, 0)                                       # alive while its parent is
    middle.send_signal(signal.SIGKILL)
    middle.wait()
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:          # ended, not yet reaped (a container's init may not)
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except (ProcessLookupError, FileNotFoundError):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the worker {pid} outlived its killed parent")
