"""Which kind of job this process belongs to, and what to pass `jax.distributed.initialize`.

Both are read from the environment alone (no device is touched), so that every choice is a pure function of a
dictionary.

JAX detects clusters itself (`jax/_src/clusters/`), but for a GPU job it then gives each process ONE device,
the one numbered like its local task (`SLURM_LOCALID`, `OMPI_COMM_WORLD_LOCAL_RANK`): right for one task per
GPU, wrong for the common one task per node (8 GPUs, 1 used) and for tasks that SLURM binds to their own GPU
(task 3 sees one GPU, numbered 0). Here the layout comes from the scheduler's variables instead:

- SLURM, started by `srun`: the tasks on this node (`SLURM_STEP_TASKS_PER_NODE`), the GPUs this task sees
  (`CUDA_VISIBLE_DEVICES`), and its rank among the node's tasks (`SLURM_LOCALID`). One task per node takes
  every GPU it sees; k tasks sharing a node's list take a k-th of it each; a task bound to its own GPUs
  (`--gpus-per-task`) takes all of those.
- Open MPI's `mpirun` (< 5): the same from `OMPI_COMM_WORLD_LOCAL_SIZE` / `_LOCAL_RANK`.
- `INFJAX_COORDINATOR`, `INFJAX_NUM_PROCESSES`, `INFJAX_PROCESS_ID`: given explicitly (e.g. launch/local.sh);
  every device the process sees (`JAX_LOCAL_DEVICE_IDS` narrows it, read by JAX).
- TPU pods (a Cloud TPU VM): JAX detects the slice itself, from the metadata server or, on GKE, from
  `TPU_WORKER_HOSTNAMES` and `TPU_WORKER_ID`; a process always sees all of its host's chips.
- Otherwise one process.

The coordinator's address and port follow JAX's own rules (the first node of the step and a port from the job
id for SLURM, the launcher's host for Open MPI; `JAX_COORDINATOR_PORT` overrides the port), so that a job
started by hand next to one started by JAX agrees with it. What cannot work stops here, before any device is
used, with the change to make: a SLURM allocation of several tasks entered without `srun`, a GPU list that
does not split over the node's tasks, GPUs that SLURM lists while CUDA_VISIBLE_DEVICES is unset, a
`TPU_WORKER_HOSTNAMES` that is not a list of hosts. Every variable read here (and those JAX reads in
`jax.distributed.initialize`: JAX_LOCAL_DEVICE_IDS, JAX_COORDINATOR_*, JAX_PARTITION_INDEX) is checked where it is
read: an integer in its range, a coordinator as host:port, so that none fails later inside JAX.
"""
from __future__ import annotations

import dataclasses
import re

from infjax import errors

CUDA_VISIBLE = "CUDA_VISIBLE_DEVICES"
SLURM_GPUS = ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS")    # the GPUs SLURM allocated (its own numbers)
LAUNCH_ID = "INFJAX_LAUNCH_ID"      # one job's id where no scheduler gives one (launch/local.sh sets it)
TPU_HOST_LISTS = ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES")
# A host of a TPU host list: a name or an address, optionally "name:port:address" as libtpu accepts.
_HOST = re.compile(r"[A-Za-z0-9_.\-\[\]]+(:[0-9]+)?(:[A-Za-z0-9_.:\-\[\]]+)?")


class ClusterError(errors.UserError):
    """The environment describes a job that cannot start as it is; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """How this process joins its job."""

    kind: str                           # "SLURM", "Open MPI", "INFJAX_COORDINATOR", "GKE TPU", "Cloud TPU VM", ...
    detail: str = ""                    # how it was started, e.g. "srun, 8 tasks per node"
    distributed: bool = False           # whether to call jax.distributed.initialize
    coordinator: str | None = None      # host:port (None: JAX detects it, or one process)
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None   # given to JAX; None: every device the process sees
    allocated: int | None = None        # the devices the scheduler gave this process, where it says
    allocation: str = ""                # where `allocated` comes from, e.g. "CUDA_VISIBLE_DEVICES=0,1"
    launch: str = ""                    # the launcher's id of this job where it gives one, e.g. "SLURM job 4242 step 0"

    @property
    def jax_detects(self) -> bool:
        """JAX's own cluster detection fills in the coordinator, the process count and id (TPU pods)."""
        return self.distributed and self.coordinator is None

    def jax_arguments(self) -> dict:
        """The arguments of `jax.distributed.initialize` (without the timeouts)."""
        if self.jax_detects:
            return {}
        return dict(coordinator_address=self.coordinator, num_processes=self.num_processes,
                    process_id=self.process_id, local_device_ids=self.local_device_ids,
                    cluster_detection_method="deactivate")    # all given: no detector adds one-device-per-task

    def describe(self) -> str:
        return f"{self.kind} ({self.detail})" if self.detail else self.kind


def _int(env, key: str, what: str, low: int = 0, high: int | None = None, default: str | None = None) -> int:
    """The integer `env[key]` (`default` where unset), refused in one line unless low <= value (<= high)."""
    text = env.get(key, default)
    text = "" if text is None else text
    bound = f">= {low}" if high is None else f"from {low} to {high}"
    m = re.fullmatch(r"\s*(-?[0-9]+)\s*", text)
    if m is None or int(m.group(1)) < low or (high is not None and int(m.group(1)) > high):
        raise ClusterError(f"{key}={text!r}: {what} must be an integer {bound}")
    return int(m.group(1))


def _address(key: str, text: str) -> str:
    """A coordinator address host:port (IPv6 in brackets), refused in one line when it is a URL, has no port or
    a port outside 1-65535."""
    shown = f"{key}={text!r}"
    if "://" in text or "/" in text:
        raise ClusterError(f"{shown}: must be host:port (process 0's host and a free port), not a URL: e.g. "
                           f"{key}={_url_host(text)}")
    m = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(\d+)", text)
    if not m or not 1 <= int(m.group(2)) <= 65535:
        raise ClusterError(f"{shown}: must be host:port with a port from 1 to 65535 (process 0's host), "
                           f"e.g. 10.0.0.1:1234 or [fd00::1]:1234")
    return text


def _url_host(text: str) -> str:
    """"http://node1:1234/x" -> "node1:1234" (what a URL's user meant), or "host:port" where it says no port."""
    m = re.match(r"[A-Za-z][A-Za-z0-9+.\-]*://([^/?#]+)", text)
    return m.group(1) if m and re.search(r":\d+$", m.group(1)) else "host:port"


def _port(env, default: int) -> str:
    if not env.get("JAX_COORDINATOR_PORT"):
        return str(default)
    return str(_int(env, "JAX_COORDINATOR_PORT", "the coordinator's port", 1, 65535))


def _coordinator(env, host: str, default_port: int) -> str:
    """JAX_COORDINATOR_ADDRESS where given (checked), else host:port by the launcher's rule."""
    given = env.get("JAX_COORDINATOR_ADDRESS")
    if given:
        return _address("JAX_COORDINATOR_ADDRESS", given.strip())
    return f"{host}:{_port(env, default_port)}"


def check_jax_variables(env) -> None:
    """The variables JAX itself reads in `jax.distributed.initialize` with `int()` or as an address: refused here
    in one line rather than as JAX's traceback."""
    ids = env.get("JAX_LOCAL_DEVICE_IDS")
    if ids and not re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*", ids):
        raise ClusterError(f"JAX_LOCAL_DEVICE_IDS={ids!r}: must be local device numbers separated by commas "
                           f"(e.g. 0,1,2,3; not a range), or unset for every device the process sees")
    if ids and len(set(int(i) for i in ids.split(","))) != len(ids.split(",")):
        raise ClusterError(f"JAX_LOCAL_DEVICE_IDS={ids!r}: names a device twice")
    for key in ("JAX_PARTITION_INDEX", "JAX_SLICE_INDEX"):
        if env.get(key) is not None:
            _int(env, key, "the partition's index")
    bind = env.get("JAX_COORDINATOR_BIND_ADDRESS")
    if bind:
        _address("JAX_COORDINATOR_BIND_ADDRESS", bind.strip())
    if env.get("JAX_COORDINATOR_PORT"):
        _port(env, 0)


def expand_counts(text: str) -> list[int]:
    """SLURM's compressed counts per node: "8(x2),4" -> [8, 8, 4]. Raises ValueError on anything else."""
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ValueError(text)
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def first_host(node_list: str) -> str:
    """The first host of a SLURM host list: "gpu[003-006,9],login1" -> "gpu003", "a,b" -> "a",
    "rack[1-2]-ib" -> "rack1-ib" (zero padding kept, as SLURM writes the names)."""
    first = re.match(r"[^,\[]*(\[[^\]]*\][^,\[]*)*", node_list).group(0)
    return re.sub(r"\[([^\],\-]*)[^\]]*\]", r"\1", first)


def hosts_of(text: str) -> list[str] | None:
    """The hosts of a TPU host list ("h0,h1" or "h0:8470:10.0.0.2,..."), or None if `text` is not one
    (libtpu leaves a warning sentence in TPU_WORKER_HOSTNAMES where it cannot identify the machine)."""
    hosts = [h.strip() for h in text.split(",")]
    if not hosts or not all(_HOST.fullmatch(h) for h in hosts):
        return None
    return hosts


def _gpu_list(env) -> list[str] | None:
    """The GPUs the scheduler lets this task see (entries of CUDA_VISIBLE_DEVICES), None where it says none."""
    text = env.get(CUDA_VISIBLE)
    if text is None:
        return None
    entries = [e.strip() for e in text.split(",") if e.strip()]
    return entries or None


def check_slurm_gpus(env) -> None:
    """Refuse, with the fix, a SLURM job whose GPUs are allocated while CUDA_VISIBLE_DEVICES is missing.

    SLURM allocated GPUs (SLURM_STEP_GPUS / SLURM_JOB_GPUS) but CUDA_VISIBLE_DEVICES, which srun sets with them, is
    missing: a container or wrapper dropped it. SLURM's numbers are its own (the GPUs' order in gres.conf); CUDA
    numbers the GPUs it is shown from 0, in its own order, and where the job's cgroup hides the other GPUs it shows
    only these. Which CUDA devices are this task's cannot be told from here, and guessing takes GPUs of other jobs:
    refused, with the fix."""
    if env.get(CUDA_VISIBLE) is not None:
        return
    for key in SLURM_GPUS:
        listed = env.get(key, "").strip()
        if listed and listed.lower() not in ("none", "(null)"):
            raise ClusterError(
                f"SLURM allocated GPUs {listed} to this task ({key}) but {CUDA_VISIBLE} is unset (a container or "
                f"wrapper dropped it), so this task would use GPUs that are not its own: keep srun's "
                f"{CUDA_VISIBLE} in the task's environment (e.g. docker run -e {CUDA_VISIBLE}; apptainer and "
                f"enroot keep it unless told not to)")


def share_gpus(env, tasks_on_node: int, local_rank: int, per_task: int | None, scheduler: str
               ) -> tuple[tuple[int, ...] | None, int | None, str]:
    """(local device ids for JAX, the GPUs allocated to this task, where that comes from) for one task.

    The task is that of rank `local_rank` among `tasks_on_node` tasks on its node. Ids count the GPUs CUDA shows the
    process (CUDA_VISIBLE_DEVICES renumbers them from 0)."""
    gpus = _gpu_list(env)
    if gpus is None:
        if tasks_on_node == 1:
            return None, None, ""                   # every device it sees (a CPU job; GPUs not listed)
        # GPUs not listed by the scheduler: one per task, numbered by the task's rank on the node (JAX's rule)
        return (local_rank,), None, f"one device per task, by its rank on the node: {scheduler} lists no GPUs"
    shown = f"{CUDA_VISIBLE}={','.join(gpus)}"
    every = tuple(range(len(gpus)))
    if tasks_on_node == 1 or (per_task is not None and len(gpus) == per_task) or len(gpus) < tasks_on_node:
        return every, len(gpus), shown               # this task's own GPUs: all it sees
    if len(gpus) % tasks_on_node:
        raise ClusterError(
            f"{tasks_on_node} tasks on this node share {len(gpus)} GPUs ({shown}), which do not split evenly "
            f"among them: give each task its own GPUs (SLURM: --gpus-per-task=N; or a GPU count that "
            f"{tasks_on_node} divides), or start one task per node")
    m = len(gpus) // tasks_on_node
    return tuple(range(local_rank * m, (local_rank + 1) * m)), m, shown


def _slurm_tasks_on_node(env, ntasks: int) -> int:
    """The tasks of this step on this process's node."""
    for key in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(key):
            try:
                counts = expand_counts(env[key])
            except ValueError:
                raise ClusterError(f"{key}={env[key]!r}: not SLURM's tasks per node (e.g. 8(x2))") from None
            if len(set(counts)) == 1:
                return counts[0]
            node = _int(env, "SLURM_NODEID", "the node's index in the step", 0, len(counts) - 1, default="0")
            return counts[node]
    key = "SLURM_STEP_NUM_NODES" if env.get("SLURM_STEP_NUM_NODES") else "SLURM_NNODES"
    nodes = _int(env, key, "the number of nodes", 1, default="1")
    return max(1, ntasks // nodes)


def slurm(env) -> Layout:
    """A task that `srun` started (the step variables are set)."""
    ntasks = _int(env, "SLURM_NTASKS", "the number of tasks", 1)
    procid = _int(env, "SLURM_PROCID", "the task's rank", 0, ntasks - 1)
    per_node = _slurm_tasks_on_node(env, ntasks)
    localid = _int(env, "SLURM_LOCALID", "the task's rank on its node", 0, per_node - 1)
    per_task = _int(env, "SLURM_GPUS_PER_TASK", "the GPUs per task", 1) \
        if re.fullmatch(r"\s*[0-9]+\s*", env.get("SLURM_GPUS_PER_TASK", "")) else None   # also "a100:2": not a count
    check_slurm_gpus(env)
    ids, allocated, allocation = share_gpus(env, per_node, localid, per_task, "SLURM")
    detail = f"srun, {'1 task' if per_node == 1 else f'{per_node} tasks'} per node"
    if ntasks == 1:
        return Layout("SLURM", "srun, 1 task: one process", allocated=allocated, allocation=allocation)
    job = _int(env, "SLURM_JOB_ID", "the job id")
    coordinator = _coordinator(env, first_host(env["SLURM_STEP_NODELIST"]), job % 4096 + 61440)
    return Layout("SLURM", detail, True, coordinator, ntasks, procid, ids, allocated, allocation,
                  launch=f"SLURM job {job} step {env.get('SLURM_STEP_ID', env.get('SLURM_STEPID', '?'))}")


def open_mpi(env) -> Layout:
    """A rank that Open MPI's mpirun/mpiexec started (before Open MPI 5: OMPI_MCA_orte_hnp_uri is set)."""
    size = _int(env, "OMPI_COMM_WORLD_SIZE", "the number of ranks", 1)
    rank = _int(env, "OMPI_COMM_WORLD_RANK", "the rank", 0, size - 1)
    per_node = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "the ranks on this node", 1, size, default="1")
    local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "the rank on its node", 0, per_node - 1)
    ids, allocated, allocation = share_gpus(env, per_node, local_rank, None, "mpirun")
    detail = f"mpirun, {'1 rank' if per_node == 1 else f'{per_node} ranks'} per node"
    if size == 1:
        return Layout("Open MPI", "mpirun, 1 rank: one process", allocated=allocated, allocation=allocation)
    uri = env["OMPI_MCA_orte_hnp_uri"]
    m = re.search(r"tcp://(.+?)[,:]|tcp6://\[(.+?)[,\]]", uri)
    try:
        job = int(uri.split(".", 1)[0]) // 4096
    except ValueError:
        m = None
    if m is None:
        raise ClusterError(f"OMPI_MCA_orte_hnp_uri={uri!r}: not Open MPI's launcher address; start the ranks "
                           f"with mpirun, or set INFJAX_COORDINATOR, INFJAX_NUM_PROCESSES and INFJAX_PROCESS_ID")
    host = m.group(1) or f"[{m.group(2)}]"
    coordinator = _coordinator(env, host, job % 4096 + 61440)
    return Layout("Open MPI", detail, True, coordinator, size, rank, ids, allocated, allocation,
                  launch=f"Open MPI job {uri.split(';', 1)[0]}")


def explicit(env) -> Layout:
    coordinator = _address("INFJAX_COORDINATOR", env["INFJAX_COORDINATOR"].strip())
    for key in ("INFJAX_NUM_PROCESSES", "INFJAX_PROCESS_ID"):
        if key not in env:
            raise ClusterError(f"INFJAX_COORDINATOR is set but {key} is not: set INFJAX_NUM_PROCESSES (the "
                               f"processes of the job) and INFJAX_PROCESS_ID (0 .. N-1, this process's)")
    n = _int(env, "INFJAX_NUM_PROCESSES", "the number of processes", 1)
    i = _int(env, "INFJAX_PROCESS_ID", "this process's id")
    if i >= n:
        raise ClusterError(f"INFJAX_PROCESS_ID={i}: must be below INFJAX_NUM_PROCESSES={n}")
    launch = env.get(LAUNCH_ID, "").strip()
    return Layout("INFJAX_COORDINATOR", "", True, coordinator, n, i, launch=f"{LAUNCH_ID}={launch}" if launch else "")


def tpu(env, on_tpu_vm: bool) -> Layout | None:
    """A TPU pod's process, one process, or None where no TPU variable is set. Refuses a host list that is
    not one, and one of several hosts where JAX finds no TPU."""
    named = [(k, env[k]) for k in TPU_HOST_LISTS if env.get(k) is not None]
    hosts = None
    if named:
        key, text = named[0]
        hosts = hosts_of(text)
        if hosts is None:
            raise ClusterError(
                f"{key}={text[:120]!r}{'...' if len(text) > 120 else ''} is not a list of hosts (libtpu writes such "
                f"a message where it cannot identify the machine, and child processes inherit it): unset {key} "
                f"(on a GKE TPU pod it lists the workers, e.g. host-0,host-1)")
    slices = env.get("MEGASCALE_NUM_SLICES", "1")
    if slices.strip():
        slices = str(_int(env, "MEGASCALE_NUM_SLICES", "the number of TPU slices", 1, default="1"))
    if not on_tpu_vm:
        if hosts is not None and len(hosts) > 1:
            raise ClusterError(f"{named[0][0]} names {len(hosts)} TPU hosts but JAX finds no TPU here (libtpu "
                               f"and TPU chips): install JAX for TPU (pip install -e \".[tpu]\") on a TPU VM, or "
                               f"unset {named[0][0]}")
        return None
    if hosts is not None:
        if len(hosts) == 1 and slices in ("", "1"):
            return Layout("GKE TPU", f"{named[0][0]} names 1 host: one process")
        if not re.fullmatch(r"\s*[0-9]+\s*", env.get("TPU_WORKER_ID", "")):
            raise ClusterError(f"{named[0][0]} names {len(hosts)} TPU hosts but TPU_WORKER_ID "
                               f"({env.get('TPU_WORKER_ID', 'unset')!r}) is not this worker's index")
        _int(env, "TPU_WORKER_ID", f"this worker's index among the {len(hosts)} hosts of {named[0][0]}", 0,
             len(hosts) - 1)
        return Layout("GKE TPU", f"{named[0][0]}, {len(hosts)} hosts, worker {env['TPU_WORKER_ID']}", True)
    if env.get("TPU_PROCESS_ADDRESSES_PATH"):
        return Layout("GKE TPU", "TPU_PROCESS_ADDRESSES_PATH", True)
    if env.get("TPU_SKIP_MDS_QUERY") is not None:
        return Layout("Cloud TPU VM", "TPU_SKIP_MDS_QUERY set: no pod metadata; one process")
    return Layout("Cloud TPU VM", "the pod from the metadata server", True)


def layout(env, on_tpu_vm: bool = False) -> Layout:
    """This process's layout, from `env` (the process environment) and whether JAX runs on a Cloud TPU VM.
    Raises ClusterError (one line: what to change) where the job cannot start as it is."""
    check_jax_variables(env)
    if "INFJAX_COORDINATOR" in env:
        return explicit(env)
    if "OMPI_MCA_orte_hnp_uri" in env:
        return open_mpi(env)
    if env.get("OMPI_COMM_WORLD_SIZE", "1") not in ("", "1"):
        raise ClusterError(
            f"OMPI_COMM_WORLD_SIZE={env['OMPI_COMM_WORLD_SIZE']} but no OMPI_MCA_orte_hnp_uri (Open MPI 5 or "
            f"another MPI): JAX cannot find the coordinator; set INFJAX_COORDINATOR=<rank 0's host>:<port>, "
            f"INFJAX_NUM_PROCESSES=$OMPI_COMM_WORLD_SIZE and INFJAX_PROCESS_ID=$OMPI_COMM_WORLD_RANK")
    if "SLURM_JOB_ID" in env:
        if all(k in env for k in ("SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")):
            return slurm(env)
        ntasks = env.get("SLURM_NTASKS", env.get("SLURM_NPROCS", "1")) or "1"
        if ntasks != "1":
            raise ClusterError(
                f"SLURM job {env['SLURM_JOB_ID']} has SLURM_NTASKS={ntasks}, but this process was not started by "
                f"srun (no SLURM_STEP_NODELIST/SLURM_PROCID): start every task with `srun python -m infjax.train "
                f"...` (sbatch launch/slurm_gpu.sbatch does), or run one process with `srun -n 1` or "
                f"SLURM_NTASKS unset")
    found = tpu(env, on_tpu_vm)
    if found is not None:
        return found
    if "SLURM_JOB_ID" in env:
        check_slurm_gpus(env)
        return Layout("SLURM", "no srun, 1 task: one process")
    return Layout("one process")
