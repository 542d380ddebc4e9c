"""infjax/runtime/distributed.py: start-up, the wait for peers, agreement across processes and the peer watch."""
import threading

import pytest

from infjax.runtime import clusters, distributed
from infjax.runtime.clusters import ClusterError
from tests.helpers.launchers import EXPLICIT, srun_env


def test_timeouts_are_checked():
    for key in ("INFJAX_INIT_TIMEOUT", "INFJAX_PEER_TIMEOUT"):
        with pytest.raises(ClusterError, match=key):
            distributed.initialize({key: "0"})


def test_initialize_is_a_no_op_for_a_single_process():
    import jax

    info = distributed.initialize({})
    assert info["process_count"] == 1 and info["global_devices"] == jax.device_count()
    assert info["cluster"] == "one process"
    line = distributed.start_up_line(clusters.layout({}))
    assert line == "start-up: one process: process 0 of 1; local devices 0-7 (8 x cpu); 8 devices in all (cpu)"


def test_the_allocation_is_checked_against_what_jax_shows():
    lay = clusters.layout(srun_env(procid=1))
    distributed.check_allocation(lay, 8)
    with pytest.raises(ClusterError) as e:
        distributed.check_allocation(lay, 1)
    text = str(e.value)
    assert "gave this process 8 GPU(s) (CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7" in text and "JAX shows 1" in text
    assert "JAX runs on the CPU here" in text


def test_the_waiting_lines_say_what_each_process_can_tell():
    explicit = {"INFJAX_COORDINATOR": "127.0.0.1:1", "INFJAX_NUM_PROCESSES": "3"}
    w0 = distributed.Waiting(clusters.layout({**explicit, "INFJAX_PROCESS_ID": "0"}), 1800, probe=lambda a: True)
    assert w0.interval == 60
    assert w0.progress(61) == ("process 0 of 3 has waited 1 min 1 s of INFJAX_INIT_TIMEOUT=30 min for the other "
                               "processes of the job; this process hosts the coordinator on 127.0.0.1:1; JAX does not "
                               "say which of the other 2 have connected")
    assert "some of processes 1-2 (JAX does not say which) never connected" in w0.timed_out()
    w2 = distributed.Waiting(clusters.layout({**explicit, "INFJAX_PROCESS_ID": "2"}), 60, probe=lambda a: False)
    assert w2.interval == 15
    assert w2.progress(15).endswith("process 0's coordinator at 127.0.0.1:1 does not answer yet")
    assert "process 0 never answered at 127.0.0.1:1" in w2.timed_out()
    assert "raise INFJAX_INIT_TIMEOUT" in w2.timed_out()


class FakeClient:
    def __init__(self, store):
        self.store, self.fail = store, False

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.fail:
            raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")
        self.store[key] = value

    def key_value_dir_get(self, prefix):
        if self.fail:
            raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")
        return sorted((k, v) for k, v in self.store.items() if k.startswith(prefix))


def test_a_peer_that_stops_beating_is_found_and_one_that_finished_is_not():
    store, now = {}, [0.0]
    clock = lambda: now[0]          # noqa: E731
    watches = [distributed.PeerWatch(FakeClient(store), p, 3, 60, lost=None, clock=clock) for p in range(3)]
    for t in range(0, 50, 10):
        now[0] = t
        assert all(w.check() is None for w in watches)
    watches[2].finish()                                   # process 2 is done: quiet from now on, not lost
    for t in range(50, 200, 10):                          # process 1 is killed at t=50
        now[0] = t
        cause = watches[0].check()
        if cause:
            break
    assert cause == "process 1 of 3 gave no sign of life for 1 min" and 110 < now[0] <= 120
    watches[0].client.fail = True                         # the coordination service itself goes
    for t in range(200, 300, 10):
        now[0] = t
        cause = watches[0].check()
        if cause:
            break
    assert cause.startswith("the coordination service on process 0 has not answered for 1 min: UNAVAILABLE")


def test_the_peer_watch_calls_lost_once_from_its_thread():
    store, got = {}, []
    done = threading.Event()
    watch = distributed.PeerWatch(FakeClient(store), 0, 2, silent_after=0.3,
                                  lost=lambda cause: (got.append(cause), done.set()), beat=0.05)
    threading.Thread(target=watch.run, daemon=True).start()
    assert done.wait(5) and got == ["process 1 of 2 gave no sign of life for 0 s"]


@pytest.mark.parametrize("key", ["INFJAX_INIT_TIMEOUT", "INFJAX_PEER_TIMEOUT"])
def test_timeouts_have_bounds_that_jax_can_take(key):
    """Above 2**31 s JAX's C++ binding raised a TypeError; a week is the most accepted (JAX is given it plus 120 s,
    as a C++ int)."""
    assert distributed._seconds({key: str(distributed.MAX_TIMEOUT_S)}, key, 1) == distributed.MAX_TIMEOUT_S
    assert distributed.MAX_TIMEOUT_S + 120 < 2**31
    for text in ("0", str(distributed.MAX_TIMEOUT_S + 1), str(2**31), "1e3", "-5", ""):
        with pytest.raises(ClusterError, match=f"{key}='{text}': expected a whole number of seconds from 1 to 604800"):
            distributed._seconds({key: text}, key, 1)


def test_processes_that_are_not_one_job_are_refused_naming_what_differs():
    lay = clusters.layout({**EXPLICIT, "INFJAX_PROCESS_ID": "0", "INFJAX_LAUNCH_ID": "a"})
    job = {"config": {"train": {"lr": 0.1, "steps": 2}, "seed": 1}, "workdir": "/runs/a"}
    mine = distributed.job_identity(lay, job)
    assert mine == {**job, "launch": "INFJAX_LAUNCH_ID=a", "INFJAX_NUM_PROCESSES": 2}
    assert distributed.disagreement({0: mine, 1: dict(mine)}, lay) is None
    other = {**mine, "workdir": "/runs/b", "launch": "INFJAX_LAUNCH_ID=b",
             "config": {"train": {"lr": 0.2, "steps": 2}, "seed": 1}}
    line = distributed.disagreement({0: mine, 1: other, 2: mine}, lay)
    assert line.startswith("the 3 processes that met at the coordinator at 127.0.0.1:1234 are not one job: they "
                           "differ in launch (process 0, 2: 'INFJAX_LAUNCH_ID=a'; process 1: 'INFJAX_LAUNCH_ID=b'), "
                           "workdir (process 0, 2: '/runs/a'; process 1: '/runs/b'), config.train.lr (process 0, 2: "
                           "0.1; process 1: 0.2). Either two jobs share the coordinator's port"), line
    assert "INFJAX_PORT" in line and "\n" not in line
    counts = distributed.disagreement({0: mine, 1: {**mine, "INFJAX_NUM_PROCESSES": 3}}, lay)
    assert "differ in INFJAX_NUM_PROCESSES (process 0: 2; process 1: 3)" in counts
    slurm = clusters.layout(srun_env(SLURM_STEP_ID="0"))
    ident = distributed.job_identity(slurm, None)
    assert ident["launch"] == "SLURM job 4242 step 0" and ident["SLURM_NTASKS"] == 2 and "arguments" in ident
    assert "jobs whose ids differ by a multiple of 4096" in distributed.disagreement(
        {0: ident, 1: {**ident, "launch": "SLURM job 8338 step 0"}}, slurm)


def test_unequal_device_counts_are_refused_naming_each_process():
    slurm = clusters.layout(srun_env(ntasks=3, procid=0, localid=0, per_node="2,1"))
    assert distributed.unequal_devices({0: 4, 1: 4, 2: 4}, slurm) is None
    line = distributed.unequal_devices({0: 4, 1: 4, 2: 8}, slurm)
    assert line == ("the processes of this job have unequal device counts (process 0, 1 have 4 device(s) each; "
                    "process 2 has 8 device(s)); every process takes an equal slice of each batch, so each needs the "
                    "same number of devices: give the same number of tasks on every node (--ntasks-per-node, not "
                    "--ntasks alone) and of GPUs per node, or --gpus-per-task")
