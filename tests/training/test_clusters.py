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


# ---- every variable read is checked where it is read: one line naming it, not JAX's traceback later ----------

@pytest.mark.parametrize("env, named", [
    (srun_env(procid=2), "SLURM_PROCID='2': the task's rank must be an integer from 0 to 1"),
    (srun_env(localid=1), "SLURM_LOCALID='1': the task's rank on its node must be an integer from 0 to 0"),
    (srun_env(ntasks=3, per_node="2,1", SLURM_NODEID="x"), "SLURM_NODEID='x'"),
    (srun_env(SLURM_STEP_TASKS_PER_NODE="", SLURM_STEP_NUM_NODES="two"), "SLURM_STEP_NUM_NODES='two'"),
    (srun_env(JAX_COORDINATOR_PORT="70000"), "JAX_COORDINATOR_PORT='70000': the coordinator's port must be an "
                                             "integer from 1 to 65535"),
    (srun_env(JAX_COORDINATOR_ADDRESS="http://gpu003:1234"), "JAX_COORDINATOR_ADDRESS='http://gpu003:1234': must "
                                                             "be host:port (process 0's host and a free port), not a "
                                                             "URL: e.g. JAX_COORDINATOR_ADDRESS=gpu003:1234"),
    ({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "a"}, "OMPI_COMM_WORLD_LOCAL_SIZE='a'"),
    ({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "2",
      "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, "OMPI_COMM_WORLD_RANK='2': the rank must be an integer from 0 to 1"),
    ({"JAX_LOCAL_DEVICE_IDS": "0-3"}, "JAX_LOCAL_DEVICE_IDS='0-3': must be local device numbers separated by commas"),
    ({"JAX_LOCAL_DEVICE_IDS": "0,0"}, "JAX_LOCAL_DEVICE_IDS='0,0': names a device twice"),
    ({"JAX_PARTITION_INDEX": "first"}, "JAX_PARTITION_INDEX='first'"),
    ({"JAX_COORDINATOR_BIND_ADDRESS": "[::]"}, "JAX_COORDINATOR_BIND_ADDRESS='[::]': must be host:port"),
    ({"INFJAX_COORDINATOR": "http://10.0.0.1:1234", "INFJAX_NUM_PROCESSES": "2", "INFJAX_PROCESS_ID": "0"},
     "INFJAX_COORDINATOR='http://10.0.0.1:1234': must be host:port (process 0's host and a free port), not a URL: "
     "e.g. INFJAX_COORDINATOR=10.0.0.1:1234"),
    ({"INFJAX_COORDINATOR": "10.0.0.1:0", "INFJAX_NUM_PROCESSES": "2", "INFJAX_PROCESS_ID": "0"}, "port from 1 to 65535"),
])
def test_every_launcher_variable_is_checked_where_it_is_read(env, named):
    with pytest.raises(ClusterError) as e:
        clusters.layout(env)
    assert named in str(e.value) and "\n" not in str(e.value)


def test_the_values_jax_fails_on_are_the_ones_refused():
    """The checks match JAX's own reading: JAX_LOCAL_DEVICE_IDS (`int` of each comma-separated entry) and
    TPU_WORKER_ID (a process id below the number of hosts) fail there exactly where they are refused here."""
    for ids in ("0-3", "0;1", "0,1", " 2 , 3"):
        try:
            [int(x) for x in ids.split(",")]                 # jax/_src/distributed.py
            jax_fails = False
        except ValueError:
            jax_fails = True
        refused = False
        try:
            clusters.layout({"JAX_LOCAL_DEVICE_IDS": ids})
        except ClusterError:
            refused = True
        assert refused == jax_fails, ids
    hosts = {"TPU_WORKER_HOSTNAMES": "h0,h1"}
    assert clusters.layout({**hosts, "TPU_WORKER_ID": "1"}, on_tpu_vm=True).distributed
    with pytest.raises(ClusterError, match=r"TPU_WORKER_ID='5': this worker's index among the 2 hosts of "
                                           r"TPU_WORKER_HOSTNAMES must be an integer from 0 to 1"):
        clusters.layout({**hosts, "TPU_WORKER_ID": "5"}, on_tpu_vm=True)
    assert clusters.layout({"INFJAX_COORDINATOR": "[fd00::1]:1234", "INFJAX_NUM_PROCESSES": "2",
                            "INFJAX_PROCESS_ID": "1"}).coordinator == "[fd00::1]:1234"


@pytest.mark.parametrize("key", ["INFJAX_INIT_TIMEOUT", "INFJAX_PEER_TIMEOUT"])
def test_timeouts_have_bounds_that_jax_can_take(key):
    """Above 2**31 s JAX's C++ binding raised a TypeError; a week is the most accepted (JAX is given it plus 120 s,
    as a C++ int)."""
    assert distributed._seconds({key: str(distributed.MAX_TIMEOUT_S)}, key, 1) == distributed.MAX_TIMEOUT_S
    assert distributed.MAX_TIMEOUT_S + 120 < 2**31
    for text in ("0", str(distributed.MAX_TIMEOUT_S + 1), str(2**31), "1e3", "-5", ""):
        with pytest.raises(ClusterError, match=f"{key}='{text}': expected a whole number of seconds from 1 to 604800"):
            distributed._seconds({key: text}, key, 1)


@pytest.mark.parametrize("key", ["SLURM_STEP_GPUS", "SLURM_JOB_GPUS"])
def test_slurm_gpus_without_cuda_visible_devices_are_refused(key):
    """SLURM allocated GPUs, but a container or wrapper dropped CUDA_VISIBLE_DEVICES: before, the task took one
    device by its rank ("SLURM lists no GPUs"), or every GPU of the node with one task per node."""
    for env in (srun_env(gpus=None, **{key: "4,5,6,7"}),                                    # 1 task per node
                srun_env(ntasks=4, procid=3, localid=1, per_node="2(x2)", gpus=None, **{key: "4,5,6,7"}),
                {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "1", key: "4,5,6,7"}):              # no srun, 1 task
        with pytest.raises(ClusterError) as e:
            clusters.layout(env)
        assert str(e.value).startswith(f"SLURM allocated GPUs 4,5,6,7 to this task ({key}) but CUDA_VISIBLE_DEVICES "
                                       "is unset")
    assert clusters.layout(srun_env(**{key: "4,5,6,7"})).allocated == 8          # CUDA_VISIBLE_DEVICES given: used


# ---- one job is one job -----------------------------------------------------------------------------------

EXPLICIT = {"INFJAX_COORDINATOR": "127.0.0.1:1234", "INFJAX_NUM_PROCESSES": "2"}


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


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@pytest.fixture
def claimed():
    """This process as process 0 of an explicit 2-process job holding a free port's claim; released after."""
    port = _free_port()
    lay = clusters.layout({**EXPLICIT, "INFJAX_COORDINATOR": f"127.0.0.1:{port}", "INFJAX_PROCESS_ID": "0",
                           "INFJAX_LAUNCH_ID": "a"})
    ident = distributed.job_identity(lay, {"workdir": "/runs/a"})
    distributed.claim_coordinator_port(lay, ident, {})
    yield port, ident
    distributed.release_coordinator_port()


def test_a_taken_coordinator_port_is_refused_naming_its_holder(claimed):
    import os
    import socket

    port, ident = claimed
    env = {**EXPLICIT, "INFJAX_COORDINATOR": f"127.0.0.1:{port}"}
    other = clusters.layout({**env, "INFJAX_PROCESS_ID": "0", "INFJAX_LAUNCH_ID": "b"})
    holder = distributed._ask_holder(port, {"pid": 1, "process_id": 0, "job": {"workdir": "/runs/b"}})
    assert holder["pid"] == os.getpid() and holder["job"] == ident and holder["claimed_by"] is None
    line = distributed._taken(other, port, holder, distributed.job_identity(other, {"workdir": "/runs/b"}))
    assert line == (f"process 0 of 2: the coordinator port {port} on this host is taken by another job (process "
                    f"{os.getpid()}, launch INFJAX_LAUNCH_ID=a): give each job its own port in INFJAX_COORDINATOR; "
                    f"with launch/local.sh, another INFJAX_PORT or none (a free one)")
    # process 1 of another launch, whose coordinator is this port on this host, refuses before it registers
    one = clusters.layout({**env, "INFJAX_PROCESS_ID": "1", "INFJAX_LAUNCH_ID": "b"})
    with pytest.raises(ClusterError, match=rf"process 1 of 2: the coordinator port {port} on this host is held by "
                                           rf"another job \(process {os.getpid()}, launch INFJAX_LAUNCH_ID=a\)"):
        distributed.await_own_coordinator(one, distributed.job_identity(one, {"workdir": "/runs/a"}), {}, 5)
    same = clusters.layout({**env, "INFJAX_PROCESS_ID": "1", "INFJAX_LAUNCH_ID": "a"})
    distributed.await_own_coordinator(same, distributed.job_identity(same, {"workdir": "/runs/b"}), {}, 5)  # goes on:
    # one launch's processes with different flags are refused after connecting, all of them alike
    # a port that something else listens on (no claim): refused by the bind test
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        busy = listener.getsockname()[1]
        lay = clusters.layout({**env, "INFJAX_COORDINATOR": f"127.0.0.1:{busy}", "INFJAX_PROCESS_ID": "0"})
        distributed.release_coordinator_port()
        with pytest.raises(ClusterError, match=f"process 0 of 2: the coordinator port {busy} is already in use on this "
                                               "host"):
            distributed.claim_coordinator_port(lay, ident, {})
        assert not distributed._claim                              # the claim is given up with the refusal


@pytest.mark.parametrize("key, value, said", [
    ("INFJAX_LOCAL_DEVICES", "0", "the CPU devices per process must be a whole number >= 1"),
    ("INFJAX_LOCAL_DEVICES", "abc", "the CPU devices per process must be a whole number >= 1"),
    ("INFJAX_LOCAL_DEVICES", "-1", "the CPU devices per process must be a whole number >= 1"),
    ("INFJAX_PORT", "70000", "the coordinator's port must be a whole number from 1 to 65535"),
    ("INFJAX_PORT", "http://x:1", "the coordinator's port must be a whole number from 1 to 65535"),
])
def test_local_sh_checks_its_variables(tmp_path, key, value, said):
    """Before: INFJAX_LOCAL_DEVICES=0 crashed XLA with a segfault, abc with its 94-line flag list, -1 with a
    traceback, in every process."""
    import os
    import subprocess

    from tests.helpers.paths import ROOT

    workdir = tmp_path / "run"
    p = subprocess.run(["bash", "launch/local.sh", "2", "--config=configs/multi_pi.py", f"--workdir={workdir}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60, env={**os.environ, key: value})
    assert p.returncode == 2 and p.stderr.startswith(f"launch/local.sh: {key}='{value}': {said}")
    assert p.stderr.count("\n") == 1 and not workdir.exists()
