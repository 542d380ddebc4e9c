"""infjax/runtime/clusters.py: the job's layout, chosen from the environment as each scheduler sets it (unit tests
over environment dictionaries, in milliseconds; the 2-process jobs through stand-in launchers: test_launchers.py)."""
import pytest

from infjax.runtime import clusters
from infjax.runtime.clusters import ClusterError
from tests.helpers.launchers import GPUS8, srun_env

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


@pytest.mark.parametrize("key", ["SLURM_STEP_GPUS", "SLURM_JOB_GPUS"])
def test_slurm_gpus_without_cuda_visible_devices_are_refused(key):
    """GPUs that SLURM allocated (SLURM_STEP_GPUS, SLURM_JOB_GPUS) without CUDA_VISIBLE_DEVICES (a container
    or wrapper dropped it) are refused in one line, with one task per node or several; given, they are
    used."""
    for env in (srun_env(gpus=None, **{key: "4,5,6,7"}),                                    # 1 task per node
                srun_env(ntasks=4, procid=3, localid=1, per_node="2(x2)", gpus=None, **{key: "4,5,6,7"}),
                {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "1", key: "4,5,6,7"}):              # no srun, 1 task
        with pytest.raises(ClusterError) as e:
            clusters.layout(env)
        assert str(e.value).startswith(f"SLURM allocated GPUs 4,5,6,7 to this task ({key}) but CUDA_VISIBLE_DEVICES "
                                       "is unset")
    assert clusters.layout(srun_env(**{key: "4,5,6,7"})).allocated == 8          # CUDA_VISIBLE_DEVICES given: used
