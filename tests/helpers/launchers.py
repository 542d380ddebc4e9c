"""Stand-ins for cluster launchers, to start a job on this CPU exactly as a cluster would: `sbatch` and `srun`
(SLURM), `mpirun` (Open MPI < 5) and `gcloud compute tpus tpu-vm ssh --worker=all` (a Cloud TPU VM pod with
its metadata server). Each sets the variables the real one sets and that JAX and infjax read
(../shared/notes/clusters.md; `jax/_src/clusters/*.py`); every task, rank or worker runs on this machine.

    bin = write_launchers(tmp_path / "bin")     # then PATH=bin:$PATH

What they cannot be: a real scheduler. sbatch runs the script at once, in the foreground (its exit status is
the script's); the nodes are all this machine ("localhost"); GPUs are only names in CUDA_VISIBLE_DEVICES (with
`JAX_PLATFORMS=cpu` and `--xla_force_host_platform_device_count=N` in XLA_FLAGS, each process has N CPU devices
in their place); a job id (SLURM) or job number (Open MPI) is chosen so that the port JAX derives from it is
free here; on the TPU stand-in, JAX's scan of the PCI bus finds 4 chips (a `sitecustomize` hook) and
`JAX_FORCE_TPU_INIT` stands for libtpu, and `JAX_COORDINATOR_PORT` replaces JAX's fixed 8482 with a free port.
"""
from __future__ import annotations

import os
import stat
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_COMMON = r'''
import os, random, signal, socket, subprocess, sys, time


def free_port_in(low, high):
    """A port in [low, high] that nothing listens on now."""
    ports = list(range(low, high + 1))
    random.shuffle(ports)
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise SystemExit("no free port")


def run_all(commands, kill_on_bad_exit=True):
    """Start every (argv, env) at once; wait; with kill_on_bad_exit, a failed one ends the others (as srun's
    --kill-on-bad-exit and mpirun do). The exit status: the first failure's, else 0."""
    procs = [subprocess.Popen(argv, env=env) for argv, env in commands]
    status = 0
    live = set(range(len(procs)))
    while live:
        for i in list(live):
            code = procs[i].poll()
            if code is None:
                continue
            live.discard(i)
            if code != 0 and status == 0:
                status = code if code > 0 else 128 - code
                if kill_on_bad_exit:
                    for j in live:
                        procs[j].send_signal(signal.SIGKILL)
        time.sleep(0.05)
    return status
'''

SBATCH = r'''
"""Stand-in sbatch: `sbatch [--opt=value ...] SCRIPT [ARGS]` runs SCRIPT now, in the foreground, with the job's
variables as sbatch sets them (from the script's #SBATCH lines; options given here win). The job id is one whose
port (by JAX's rule) is free here, or STANDIN_SLURM_JOB_ID."""
import re


def options(words):
    out = {}
    for w in words:
        m = re.fullmatch(r"--([\w-]+)(?:=(\S*))?", w)
        if m:
            out[m.group(1)] = m.group(2) if m.group(2) is not None else "1"
    return out


args = sys.argv[1:]
given = []
while args and args[0].startswith("-"):
    given.append(args.pop(0))
script, rest = args[0], args[1:]
opts = options(given)
for line in open(script):
    m = re.match(r"#SBATCH\s+(\S+)", line)
    if m:
        for k, v in options([m.group(1)]).items():
            opts.setdefault(k, v)
nodes = int(opts.get("nodes", 1))
per_node = int(opts.get("ntasks-per-node", 1))
job = free_port_in(61440, 65535) - 61440 + 4096 * random.randint(1, 200)    # JAX's port: job % 4096 + 61440
job = int(os.environ.get("STANDIN_SLURM_JOB_ID") or job)      # a given id (two jobs whose ports collide)
env = dict(os.environ)
env.update(SLURM_JOB_ID=str(job), SLURM_JOBID=str(job), SLURM_JOB_NAME=opts.get("job-name", os.path.basename(script)),
           SLURM_NNODES=str(nodes), SLURM_JOB_NUM_NODES=str(nodes), SLURM_NTASKS=str(nodes * per_node),
           SLURM_NPROCS=str(nodes * per_node), SLURM_NTASKS_PER_NODE=str(per_node),
           SLURM_TASKS_PER_NODE=f"{per_node}(x{nodes})" if nodes > 1 else str(per_node),
           SLURM_JOB_NODELIST="localhost", SLURM_NODELIST="localhost", SLURM_SUBMIT_DIR=os.getcwd(),
           SLURM_SUBMIT_HOST="localhost", SLURM_CLUSTER_NAME="standin", SLURMD_NODENAME="localhost")
if "cpus-per-task" in opts:
    env["SLURM_CPUS_PER_TASK"] = opts["cpus-per-task"]
gpus = 0
if "gpus-per-node" in opts:
    gpus = int(opts["gpus-per-node"])
    env["SLURM_GPUS_PER_NODE"] = opts["gpus-per-node"]
if "gpus-per-task" in opts:
    gpus = int(opts["gpus-per-task"]) * per_node
    env["SLURM_GPUS_PER_TASK"] = opts["gpus-per-task"]
if gpus:
    env["SLURM_GPUS_ON_NODE"] = str(gpus)
    env["SLURM_JOB_GPUS"] = env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(gpus)))
sys.exit(subprocess.call(["bash", script, *rest], env=env))
'''

SRUN = r'''
"""Stand-in srun (inside an allocation of the stand-in sbatch): starts the step's tasks with the step's
variables: SLURM_STEP_*, SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, and CUDA_VISIBLE_DEVICES as srun's GPU
binding sets it (with --gpus-per-task: each task its own GPUs; else every GPU of its node). `-n`/`--ntasks` that the
nodes do not divide are placed as SLURM's block distribution places them (3 on 2 nodes: 2 and 1). With
STANDIN_DEVICES=gpus, each task has as many CPU devices as it owns GPUs (its node's GPUs shared among the node's
tasks), as a GPU task sees once JAX is given its GPUs: nodes with unequal tasks give tasks unequal devices."""
args = sys.argv[1:]
opts = {}
while args and args[0].startswith("-"):
    word = args.pop(0)
    if word in ("-n", "-N"):
        opts[{"-n": "ntasks", "-N": "nodes"}[word]] = args.pop(0)
        continue
    key, _, value = word.lstrip("-").partition("=")
    opts[key] = value or "1"
if "SLURM_JOB_ID" not in os.environ:
    raise SystemExit("srun: error: no allocation (run inside the stand-in sbatch)")
nodes = int(opts.get("nodes", os.environ.get("SLURM_NNODES", "1")))
per_node = int(opts.get("ntasks-per-node", os.environ.get("SLURM_NTASKS_PER_NODE", "1")))
counts = [per_node] * nodes                      # the tasks on each node
if "ntasks" in opts:                             # SLURM's block distribution: the first nodes take one more
    n = int(opts["ntasks"])
    counts = [n // nodes + (node < n % nodes) for node in range(nodes)]
ntasks = sum(counts)
if len(set(counts)) == 1:
    step_counts = f"{counts[0]}(x{nodes})" if nodes > 1 else str(counts[0])
else:
    step_counts = ",".join(map(str, counts))
per_task = opts.get("gpus-per-task", os.environ.get("SLURM_GPUS_PER_TASK"))
node_gpus = int(os.environ.get("SLURM_GPUS_ON_NODE", "0"))
commands = []
for i in range(ntasks):
    node = next(k for k in range(nodes) if i < sum(counts[:k + 1]))
    local = i - sum(counts[:node])
    env = dict(os.environ)
    env.update(SLURM_STEP_ID="0", SLURM_STEPID="0", SLURM_STEP_NODELIST="localhost", SLURM_STEP_NUM_NODES=str(nodes),
               SLURM_STEP_NUM_TASKS=str(ntasks), SLURM_NTASKS=str(ntasks), SLURM_NPROCS=str(ntasks),
               SLURM_STEP_TASKS_PER_NODE=step_counts,
               SLURM_PROCID=str(i), SLURM_LOCALID=str(local), SLURM_NODEID=str(node), SLURM_TOPOLOGY_ADDR="localhost")
    owned = 0
    if per_task:
        mine = range(local * int(per_task), (local + 1) * int(per_task))
        env["CUDA_VISIBLE_DEVICES"] = env["SLURM_STEP_GPUS"] = ",".join(map(str, mine))
        owned = int(per_task)
    elif node_gpus:
        env["CUDA_VISIBLE_DEVICES"] = env["SLURM_STEP_GPUS"] = ",".join(map(str, range(node_gpus)))
        owned = node_gpus // counts[node]
    if os.environ.get("STANDIN_DEVICES") == "gpus" and owned:
        # each task's CPU devices stand for the GPUs it owns (a real GPU task sees those once JAX is given them)
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={owned}"
    commands.append((args, env))
sys.exit(run_all(commands, kill_on_bad_exit=opts.get("kill-on-bad-exit", "0") != "0"))
'''

MPIRUN = r'''
"""Stand-in mpirun of Open MPI 4 (ORTE): `mpirun -np N [--npernode K] COMMAND`, every rank on this machine,
with the variables ORTE sets: OMPI_MCA_orte_hnp_uri (the launcher's address), OMPI_COMM_WORLD_SIZE, _RANK,
_LOCAL_RANK, _LOCAL_SIZE, _NODE_RANK."""
args = sys.argv[1:]
n, per_node = 1, None
while args and args[0].startswith("-"):
    word = args.pop(0)
    if word in ("-np", "-n", "--np"):
        n = int(args.pop(0))
    elif word in ("-npernode", "--npernode"):
        per_node = int(args.pop(0))
    elif word in ("-x",):
        args.pop(0)
per_node = per_node or n
job = (free_port_in(61440, 65535) - 61440) * 4096          # JAX's port: (job // 4096) % 4096 + 61440
uri = f"{job}.0;tcp://127.0.0.1:{free_port_in(20000, 30000)}"
commands = []
for rank in range(n):
    env = dict(os.environ, OMPI_MCA_orte_hnp_uri=uri, OMPI_MCA_ess_base_jobid=str(job + 1),
               OMPI_MCA_ess_base_vpid=str(rank), OMPI_COMM_WORLD_SIZE=str(n), OMPI_COMM_WORLD_RANK=str(rank),
               OMPI_COMM_WORLD_LOCAL_RANK=str(rank % per_node), OMPI_COMM_WORLD_LOCAL_SIZE=str(per_node),
               OMPI_COMM_WORLD_NODE_RANK=str(rank % per_node), OMPI_UNIVERSE_SIZE=str(n), PMIX_RANK=str(rank))
    commands.append((args, env))
sys.exit(run_all(commands))
'''

GCLOUD = r'''
"""Stand-in `gcloud compute tpus tpu-vm ssh TPU --zone=Z --worker=all --command=CMD`: runs CMD (in bash) on
STANDIN_TPU_WORKERS workers (default 2), each with what a Cloud TPU VM worker offers JAX: a metadata server
(GCE_METADATA_IP, this worker's agent-worker-number, the slice's worker-network-endpoints and tpu-env), TPU
chips on the PCI bus (a sitecustomize hook in PYTHONPATH), libtpu (JAX_FORCE_TPU_INIT in its place)."""
args = sys.argv[1:]
if args[:4] != ["compute", "tpus", "tpu-vm", "ssh"]:
    raise SystemExit(f"gcloud stand-in: only `compute tpus tpu-vm ssh`, not {args[:4]}")
opts = dict(a.lstrip("-").partition("=")[::2] for a in args[5:] if a.startswith("--"))
if opts.get("worker") != "all" or "command" not in opts:
    raise SystemExit("gcloud stand-in: needs --worker=all and --command=...")
workers = int(os.environ.get("STANDIN_TPU_WORKERS", "2"))
endpoints = ",".join(f"{args[4]}-w-{i}:{i}:127.0.0.1" for i in range(workers))


sys.path.insert(0, REPO)
from tests.helpers.launchers import serve_metadata     # noqa: E402


def metadata(worker):
    return serve_metadata({"agent-worker-number": str(worker), "worker-network-endpoints": endpoints,
                           "tpu-env": f"ACCELERATOR_TYPE: 'v5litepod-{4 * workers}'\nWORKER_ID: '{worker}'\n"})


hook = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tpu_vm_site")
port = str(free_port_in(30000, 40000))
commands = []
for i in range(workers):
    env = dict(os.environ, GCE_METADATA_IP=metadata(i), JAX_FORCE_TPU_INIT="1", JAX_COORDINATOR_PORT=port,
               PYTHONPATH=os.pathsep.join(p for p in (hook, os.environ.get("PYTHONPATH", "")) if p))
    commands.append((["bash", "-c", opts["command"]], env))
sys.exit(run_all(commands))
'''

TPU_VM_SITE = r'''
"""On the stand-in TPU VM: JAX's scan of the PCI bus (jax._src.hardware_utils) finds 4 TPU chips."""
import importlib.abc
import importlib.machinery
import sys


class _Chips(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "jax._src.hardware_utils":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.num_available_tpu_chips_and_device_id = lambda: (4, None)
        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Chips())
'''


def serve_metadata(values: dict[str, str]) -> str:
    """A GCE metadata server on 127.0.0.1 answering `values` (instance attributes) for as long as this process
    lives; returns its address for GCE_METADATA_IP. (GKE TPU nodes have one too: JAX reads tpu-env there.)"""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            key = self.path.rsplit("/", 1)[-1]
            ok = self.path.startswith("/computeMetadata/v1/instance/attributes/") and key in values \
                and self.headers.get("Metadata-Flavor") == "Google"
            body = (values[key] if ok else "not found").encode()
            self.send_response(200 if ok else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"127.0.0.1:{server.server_address[1]}"


def write_launchers(folder) -> str:
    """Write the stand-ins into `folder` (created); returns it, for the front of PATH."""
    folder = str(folder)
    os.makedirs(os.path.join(folder, "tpu_vm_site"), exist_ok=True)
    for name, body in (("sbatch", SBATCH), ("srun", SRUN), ("mpirun", MPIRUN), ("gcloud", GCLOUD)):
        path = os.path.join(folder, name)
        with open(path, "w") as f:
            f.write(f"#!{sys.executable}\nREPO = {REPO!r}\n{_COMMON}\n{body}")
        os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    with open(os.path.join(folder, "tpu_vm_site", "sitecustomize.py"), "w") as f:
        f.write(TPU_VM_SITE)
    return folder


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


EXPLICIT = {"INFJAX_COORDINATOR": "127.0.0.1:1234", "INFJAX_NUM_PROCESSES": "2"}
