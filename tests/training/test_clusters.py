"""How a process joins its job, chosen from the environment as each scheduler sets it (infjax/runtime/clusters.py,
infjax/runtime/distributed.py): unit tests over environment dictionaries, in milliseconds. The 2-process jobs
started through stand-in launchers are in test_launchers.py."""
import threading

import pytest

from infjax.runtime import clusters, distributed
from infjax.runtime.clusters import ClusterError

GPUS8 = "0,1,2,3,4,5,6,7"


def srun_env(ntasks=2, procid=0, localid=0, per_node="1(x2)", gpus=GPUS8, job="4242", **extra):
    """A task's environment as srun sets it (one task per node by default, 8 GPUs on each node)."""
    env = {"SLURM_JOB_ID": job, "SLURM_NTASKS": str(ntasks), "SLURM_PROCID": str(procid),
           "SLURM_LOCALID": str(localid), "SLURM_STEP_NODELIST": "gpu[003-004]", "SLURM_STEP_NUM_NODES": "2",
           "SLURM_STEP_TASKS_PER_NODE": per_node, "SLURM_NODEID": "0", "SLURM_GPUS_ON_NODE": "8"}
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    env.update(extra)
    return env


def test_slurm_one_task_per_node_gives_the_task_every_gpu_of_its_node():
    lay = clusters.layout(srun_env(procid=1))
    assert (lay.kind, lay.distributed, lay.num_processes, lay.process_id) == ("SLURM", True, 2, 1)
    assert lay.local_device_ids == tuple(range(8)) and lay.allocated == 8
    assert lay.coordinator == f"gpu003:{4242 % 4096 + 61440}"          # JAX's rule: first node, port from the job
    assert lay.jax_arguments()["cluster_detection_method"] == "deactivate"
    assert "1 task per node" in lay.describe()


def test_slurm_one_task_per_gpu_bound_by_slurm_takes_its_own_gpu():
    # --ntasks-per-node=8 --gpus-per-task=1: srun binds each task to its GPU, which CUDA numbers 0
    lay = clusters.layout(srun_env(ntasks=16, procid=11, localid=3, per_node="8(x2)", gpus="3",
                                   SLURM_GPUS_PER_TASK="1"))
    assert (lay.num_processes, lay.process_id, lay.local_device_ids, lay.allocated) == (16, 11, (0,), 1)
    assert "8 tasks per node" in lay.describe()


def test_slurm_tasks_sharing_the_node_list_take_a_share_each():
    lay = clusters.layout(srun_env(ntasks=8, procid=5, localid=1, per_node="4(x2)"))
    assert (lay.local_device_ids, lay.allocated) == ((2, 3), 2)
    with pytest.raises(ClusterError, match="3 tasks on this node share 8 GPUs"):
        clusters.layout(srun_env(ntasks=6, procid=1, localid=1, per_node="3(x2)"))


def test_slurm_without_listed_gpus():
    one = clusters.layout(srun_env(gpus=None))           # a CPU job: every device the process sees
    assert one.local_device_ids is None and one.allocated is None
    many = clusters.layout(srun_env(ntasks=4, procid=3, localid=1, per_node="2(x2)", gpus=None))
    assert many.local_device_ids == (1,)                # JAX's rule, one device per task


def test_slurm_single_task_and_uneven_tasks_per_node():
    single = clusters.layout(srun_env(ntasks=1, per_node="1"))
    assert not single.distributed and single.allocated == 8 and single.describe() == "SLURM (srun, 1 task: one process)"
    uneven = clusters.layout(srun_env(ntasks=3, procid=2, localid=0, per_node="2,1", SLURM_NODEID="1", gpus="0,1"))
    assert uneven.local_device_ids == (0, 1)


def test_slurm_without_srun_is_refused_in_one_line():
    env = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu[1-2]", "CUDA_VISIBLE_DEVICES": GPUS8}
    with pytest.raises(ClusterError) as e:
        clusters.layout(env)
    assert "SLURM_NTASKS=2, but this process was not started by srun" in str(e.value) and "srun" in str(e.value)
    assert "\n" not in str(e.value)
    single = clusters.layout({"SLURM_JOB_ID": "77", "SLURM_NTASKS": "1"})
    assert single.describe() == "SLURM (no srun, 1 task: one process)"


def test_slurm_host_lists_and_ports():
    assert clusters.first_host("gpu[003-006,9],login1") == "gpu003"
    assert clusters.first_host("a,b") == "a" and clusters.first_host("rack[1-2]-ib") == "rack1-ib"
    assert clusters.expand_counts("8(x2),4") == [8, 8, 4]
    lay = clusters.layout(srun_env(JAX_COORDINATOR_PORT="1234"))
    assert lay.coordinator == "gpu003:1234"


def test_open_mpi():
    env = {"OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    lay = clusters.layout(env)
    assert (lay.kind, lay.num_processes, lay.process_id, lay.local_device_ids) == ("Open MPI", 4, 3, (2, 3))
    assert lay.coordinator == f"10.96.0.1:{1531576320 // 4096 % 4096 + 61440}"      # as JAX parses it
    # mpirun inside a SLURM allocation: Open MPI's variables win, as in JAX
    assert clusters.layout({**env, **srun_env()}).kind == "Open MPI"
    with pytest.raises(ClusterError, match="no OMPI_MCA_orte_hnp_uri"):
        clusters.layout({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"})


def test_explicit_variables():
    lay = clusters.layout({"INFJAX_COORDINATOR": "10.0.0.1:1234", "INFJAX_NUM_PROCESSES": "4",
                           "INFJAX_PROCESS_ID": "2", **srun_env()})        # explicit wins over SLURM
    assert (lay.kind, lay.coordinator, lay.num_processes, lay.process_id, lay.local_device_ids) == \
        ("INFJAX_COORDINATOR", "10.0.0.1:1234", 4, 2, None)
    for env, why in (({"INFJAX_COORDINATOR": "x:1"}, "INFJAX_NUM_PROCESSES"),
                     ({"INFJAX_COORDINATOR": "x", "INFJAX_NUM_PROCESSES": "2", "INFJAX_PROCESS_ID": "0"}, "host:port"),
                     ({"INFJAX_COORDINATOR": "x:1", "INFJAX_NUM_PROCESSES": "2", "INFJAX_PROCESS_ID": "2"}, "below"),
                     ({"INFJAX_COORDINATOR": "x:1", "INFJAX_NUM_PROCESSES": "two", "INFJAX_PROCESS_ID": "0"},
                      "integer")):
        with pytest.raises(ClusterError, match=why):
            clusters.layout(env)


SENTENCE = ("WARNING: could not determine TPU worker hostnames or IP addresses, please set env var "
            "`TPU_WORKER_HOSTNAMES` manually, otherwise libtpu.so may not properly initialize.")


def test_tpu_pods():
    gke = clusters.layout({"TPU_WORKER_HOSTNAMES": "host-0,host-1,host-2,host-3", "TPU_WORKER_ID": "2"},
                          on_tpu_vm=True)
    assert gke.kind == "GKE TPU" and gke.distributed and gke.jax_detects and gke.jax_arguments() == {}
    vm = clusters.layout({}, on_tpu_vm=True)                      # launch/tpu_pod.sh: the metadata server
    assert (vm.kind, vm.distributed, vm.local_device_ids) == ("Cloud TPU VM", True, None)
    assert not clusters.layout({"TPU_SKIP_MDS_QUERY": "1"}, on_tpu_vm=True).distributed
    assert not clusters.layout({"TPU_WORKER_HOSTNAMES": "localhost"}, on_tpu_vm=True).distributed
    assert clusters.layout({"TPU_WORKER_HOSTNAMES": "w0:8470:10.0.0.2,w1:8470:10.0.0.3", "TPU_WORKER_ID": "0"},
                           on_tpu_vm=True).distributed
    with pytest.raises(ClusterError, match="TPU_WORKER_ID"):
        clusters.layout({"TPU_WORKER_HOSTNAMES": "h0,h1"}, on_tpu_vm=True)
    with pytest.raises(ClusterError, match="JAX finds no TPU here"):
        clusters.layout({"TPU_WORKER_HOSTNAMES": "h0,h1", "TPU_WORKER_ID": "0"})
    assert clusters.layout({"TPU_WORKER_HOSTNAMES": "localhost"}).kind == "one process"   # bench compile's


@pytest.mark.parametrize("on_tpu_vm", [False, True])
def test_a_warning_sentence_in_tpu_worker_hostnames_is_refused(on_tpu_vm):
    with pytest.raises(ClusterError) as e:
        clusters.layout({"TPU_WORKER_HOSTNAMES": SENTENCE}, on_tpu_vm=on_tpu_vm)
    assert "is not a list of hosts" in str(e.value) and "unset TPU_WORKER_HOSTNAMES" in str(e.value)


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


@pytest.mark.parametrize("n", ["0", "00", "x"])
def test_local_sh_refuses_a_process_count_below_one(tmp_path, n):
    """Before: `launch/local.sh 0 ...` started nothing, created an empty --workdir and exited 0."""
    import subprocess

    from tests.helpers.paths import ROOT

    workdir = tmp_path / "run"
    p = subprocess.run(["bash", "launch/local.sh", n, "--config=configs/multi_pi.py", f"--workdir={workdir}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and f"N >= 1 processes; got {n}" in p.stderr and not workdir.exists()
