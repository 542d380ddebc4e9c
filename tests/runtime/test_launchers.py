"""Each supported way of starting a multi-process job, faked on this CPU as the cluster would start it: the launch
scripts run through stand-in `sbatch`/`srun`, `mpirun` and `gcloud` (tests/helpers/launchers.py) that set the
variables the real ones set. Each 2-process job checks what every process was given (its process id, the local
device ids handed to JAX, JAX's own "visible devices" line), and that its losses are a 1-process run's; the
refusals end in one line and exit status 2 or 3. The tiny random BERT keeps every job short. Those jobs are slow
tests; launch/local.sh's own checks (its arguments, variables and logs) are not."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from infjax import config as config_lib, train
from tests.helpers.launchers import serve_metadata, write_launchers
from tests.helpers.paths import ROOT
from tests.helpers.tiny import tiny_bert_path

RUN = {"data.synthetic.num_train": 48, "data.query_max_len": 48, "data.passage_max_len": 48,
       "loss.instruction_negatives": 2, "train.batch_size": 16, "train.steps": 2, "train.learning_rate": 1e-4,
       "log_every": 1, "checkpoint.every": 100, "eval.synthetic": False, "eval.canary": ""}


def _flags(workdir: str) -> list[str]:
    """`python -m infjax.train` flags of RUN on the tiny BERT."""
    return ["--config=configs/multi_pi.py", f"--workdir={workdir}", f"--config.model.checkpoint={tiny_bert_path()}",
            *[f"--config.{k}={v}" for k, v in RUN.items()]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """RUN by one process on 8 devices: the losses every 2-process job must give."""
    workdir = str(tmp_path_factory.mktemp("reference"))
    config = config_lib.override(config_lib.base_config("multi_pi"), {**RUN, "model.checkpoint": tiny_bert_path()})
    train.run(config, workdir)
    return _losses(workdir)


def _losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f) if "loss" in r]


def _env(tmp_path, devices: int, **extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "TPU_", "INFJAX_", "MEGASCALE_", "JAX_COORDINATOR"))}
    env.update(PATH=f"{write_launchers(tmp_path / 'bin')}{os.pathsep}{os.environ['PATH']}", PYTHON=sys.executable,
               JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               **extra)
    return env


def _run(argv, env, timeout=600) -> tuple[int, str]:
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def _start_up(out: str) -> dict[int, str]:
    """{process id: its start-up line}."""
    lines = [line.split("INFO ", 1)[1] for line in out.splitlines() if "infjax.distributed INFO start-up:" in line]
    return {int(re.search(r": process (\d+) of", line).group(1)): line for line in lines}


def _visible(out: str) -> list[str]:
    """What JAX says it set as jax_cuda_visible_devices, one entry per process that was given devices."""
    return sorted(re.findall(r"JAX distributed initialized with visible devices: (\S+)", out))


def _both_started(code: int, out: str) -> dict[int, str]:
    """The start-up lines of a 2-process job that ended with exit status 0, one from each process."""
    lines = _start_up(out)
    print(code, "\n".join(lines.values()))
    assert code == 0, out[-4000:]
    assert sorted(lines) == [0, 1]
    return lines


def _same_losses(workdir, reference):
    got = _losses(workdir)
    print("2 processes:", got, "\n1 process:  ", reference)
    assert [s for s, _ in got] == [s for s, _ in reference]
    np.testing.assert_allclose([v for _, v in got], [v for _, v in reference], rtol=1e-5)


@pytest.mark.slow
def test_slurm_one_task_per_node_owns_every_gpu_of_its_node(tmp_path, reference):
    """sbatch launch/slurm_gpu.sbatch on 2 nodes of 2 GPUs each (JAX's default would give each task GPU 0 alone)."""
    workdir = str(tmp_path / "run")
    code, out = _run(["sbatch", "--gpus-per-node=2", "launch/slurm_gpu.sbatch", *_flags(workdir)], _env(tmp_path, 2))
    lines = _both_started(code, out)
    for i, line in lines.items():
        assert line.startswith(f"start-up: SLURM (srun, 1 task per node): process {i} of 2 (coordinator localhost:")
        assert "(2 x cpu; JAX given local_device_ids 0-1 of CUDA_VISIBLE_DEVICES=0,1)" in line
        assert line.endswith("4 devices in all (cpu)")
    assert _visible(out) == ["0,1", "0,1"]
    _same_losses(workdir, reference)


@pytest.mark.slow
def test_slurm_one_task_per_gpu_takes_the_gpu_srun_bound_it_to(tmp_path, reference):
    """sbatch launch/slurm_gpu_per_task.sbatch, 2 tasks on one node, one GPU each: task 1 sees only its GPU 1,
    which CUDA numbers 0 (JAX's default would ask for device 1)."""
    workdir = str(tmp_path / "run")
    code, out = _run(["sbatch", "--nodes=1", "--ntasks-per-node=2", "launch/slurm_gpu_per_task.sbatch",
                      *_flags(workdir)], _env(tmp_path, 1))
    lines = _both_started(code, out)
    for i, line in lines.items():
        assert line.startswith(f"start-up: SLURM (srun, 2 tasks per node): process {i} of 2")
        assert f"(1 x cpu; JAX given local_device_ids 0 of CUDA_VISIBLE_DEVICES={i})" in line
    assert _visible(out) == ["0", "0"]
    _same_losses(workdir, reference)


@pytest.mark.slow
def test_open_mpi_mpirun(tmp_path, reference):
    workdir = str(tmp_path / "run")
    code, out = _run(["mpirun", "-np", "2", sys.executable, "-m", "infjax.train", *_flags(workdir)], _env(tmp_path, 2))
    lines = _both_started(code, out)
    for i, line in lines.items():
        assert line.startswith(f"start-up: Open MPI (mpirun, 2 ranks per node): process {i} of 2 "
                               f"(coordinator 127.0.0.1:")
    assert _visible(out) == ["0", "1"]          # 2 ranks share a node: one device each (GPUs not listed)
    _same_losses(workdir, reference)


@pytest.mark.slow
def test_cloud_tpu_vm_pod_through_tpu_pod_sh(tmp_path, reference):
    """launch/tpu_pod.sh through a stand-in gcloud: 2 workers of a Cloud TPU VM slice, found by JAX through
    the metadata server, each start as a process of the pod and train as one process does."""
    workdir = str(tmp_path / "run")
    code, out = _run(["bash", "launch/tpu_pod.sh", "my-tpu", "us-central2-b", *_flags(workdir)],
                     _env(tmp_path, 4, INFJAX_DIR=ROOT))
    lines = _both_started(code, out)
    for i, line in lines.items():
        assert line.startswith(f"start-up: Cloud TPU VM (the pod from the metadata server): process {i} of 2 "
                               f"(coordinator 127.0.0.1:")
        assert line.endswith("(4 x cpu); 8 devices in all (cpu)")
    assert _visible(out) == []                  # JAX never narrows a TPU host's devices
    _same_losses(workdir, reference)


@pytest.mark.slow
def test_gke_tpu_pod_variables(tmp_path, reference):
    """Two workers of a GKE TPU pod (JobSet): TPU_WORKER_HOSTNAMES and TPU_WORKER_ID, as the TPU webhook sets them,
    and the node's metadata server (JAX reads its tpu-env for multislice settings)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = str(tmp_path / "run")
    env = _env(tmp_path, 2, TPU_WORKER_HOSTNAMES="localhost,localhost", JAX_FORCE_TPU_INIT="1",
               JAX_COORDINATOR_PORT=str(port),
               GCE_METADATA_IP=serve_metadata({"tpu-env": "ACCELERATOR_TYPE: 'v5e-8'\n"}))
    procs = [subprocess.Popen([sys.executable, "-m", "infjax.train", *_flags(workdir)], cwd=ROOT,
                              env=dict(env, TPU_WORKER_ID=str(i)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    lines = _start_up("\n".join(outs))
    print([p.returncode for p in procs], "\n".join(lines.values()))
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    for i, line in lines.items():
        assert line.startswith(f"start-up: GKE TPU (TPU_WORKER_HOSTNAMES, 2 hosts, worker {i}): process {i} of 2 "
                               f"(coordinator localhost:{port})")
    assert sorted(lines) == [0, 1]
    _same_losses(workdir, reference)


def _one_line_error(out: str) -> str:
    lines = [line for line in out.splitlines() if line.strip()]
    assert "Traceback" not in out and "Check failure" not in out, out[-3000:]
    return lines[-1]


@pytest.mark.slow
def test_what_cannot_start_stops_in_one_line(tmp_path):
    """A SLURM allocation of 2 tasks entered without srun (the sbatch's command typed by hand); a
    TPU_WORKER_HOSTNAMES holding libtpu's warning sentence; 8 GPUs given, 1 device shown by JAX."""
    workdir = str(tmp_path / "run")
    script = tmp_path / "no_srun.sbatch"
    script.write_text("#!/usr/bin/env bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --gpus-per-node=8\n"
                      f"{sys.executable} -m infjax.train \"$@\"\n")
    code, out = _run(["sbatch", str(script), *_flags(workdir)], _env(tmp_path, 8))
    last = _one_line_error(out)
    print(code, last)
    assert code == 2 and re.search(r"ERROR SLURM job \d+ has SLURM_NTASKS=2, but this process was not started by "
                                   r"srun .*start every task with `srun python -m infjax.train", last), out[-2000:]

    sentence = ("WARNING: could not determine TPU worker hostnames or IP addresses, please set env var "
                "`TPU_WORKER_HOSTNAMES` manually, otherwise libtpu.so may not properly initialize.")
    code, out = _run([sys.executable, "-m", "infjax.train", *_flags(workdir)],
                     _env(tmp_path, 8, TPU_WORKER_HOSTNAMES=sentence))
    last = _one_line_error(out)
    print(code, last)
    assert code == 2 and "TPU_WORKER_HOSTNAMES='WARNING: could not determine" in last and \
        "unset TPU_WORKER_HOSTNAMES" in last

    code, out = _run(["sbatch", "--nodes=1", "--gpus-per-node=8", "launch/slurm_gpu.sbatch", *_flags(workdir)],
                     _env(tmp_path, 1))
    last = _one_line_error(out)
    print(code, last)
    assert code == 2 and "gave this process 8 GPU(s) (CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7" in last and \
        "JAX shows 1 local device(s)" in last
    assert not os.path.exists(os.path.join(workdir, "checkpoints"))

    # SLURM allocated GPUs but a wrapper dropped CUDA_VISIBLE_DEVICES (before: "SLURM lists no GPUs", 1 of 8 each)
    script = tmp_path / "dropped.sbatch"
    script.write_text("#!/usr/bin/env bash\n#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=2\n#SBATCH --gpus-per-node=8\n"
                      "srun env -u CUDA_VISIBLE_DEVICES \"$PYTHON\" -m infjax.train \"$@\"\n")
    code, out = _run(["sbatch", str(script), *_flags(workdir)], _env(tmp_path, 4))
    last = _one_line_error(out)
    print(code, last)
    assert code == 2 and "ERROR SLURM allocated GPUs 0,1,2,3,4,5,6,7 to this task (SLURM_STEP_GPUS) but " \
        "CUDA_VISIBLE_DEVICES is unset" in last


@pytest.mark.slow
def test_a_missing_peer_is_waited_for_visibly_then_named(tmp_path):
    """Process 1 of 2 is never started: process 0 says every few seconds how long it has waited, then ends
    with one infjax line and exit status 3 at INFJAX_INIT_TIMEOUT (no silence, no runtime abort or C++ stack
    trace)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = _env(tmp_path, 1, INFJAX_COORDINATOR=f"127.0.0.1:{port}", INFJAX_NUM_PROCESSES="2", INFJAX_INIT_TIMEOUT="8")
    for i in range(2):        # alone, each one: process 0 hosts the coordinator; process 1 finds none
        code, out = _run([sys.executable, "-m", "infjax.train", *_flags(str(tmp_path / "run"))],
                         dict(env, INFJAX_PROCESS_ID=str(i)))
        waits = re.findall(rf"WARNING (process {i} of 2 has waited \d+ s of INFJAX_INIT_TIMEOUT=8 s .*)", out)
        last = _one_line_error(out)
        print(code, *waits, last, sep="\n")
        assert code == 3 and len(waits) >= 2
        assert f"ERROR process {i} of 2 gave up after INFJAX_INIT_TIMEOUT=8 s: " in last
        assert ("process 1 never connected" if i == 0 else f"process 0 never answered at 127.0.0.1:{port}") in last


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, proc, timeout: float = 120) -> None:
    """Until something accepts connections on 127.0.0.1:`port` (`proc`'s coordinator has started), or fail."""
    import socket
    import time

    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"nothing listens on port {port} (the process ended: {proc.poll()})")


def _by_hand(tmp_path, workdir, devices=1, **env):
    """`python -m infjax.train` started as launch/local.sh starts a process, with `env` (explicit variables)."""
    return subprocess.Popen([sys.executable, "-m", "infjax.train", *_flags(workdir)], cwd=ROOT,
                            env=_env(tmp_path, devices, **env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _ends(proc, timeout=120) -> tuple[int, str]:
    out = proc.communicate(timeout=timeout)[0]
    return proc.returncode, _one_line_error(out)


@pytest.mark.slow
def test_processes_that_are_not_one_job_refuse_after_connecting(tmp_path):
    """Two processes meet at one coordinator but were started with another workdir and another process count:
    both refuse in one line naming what differs, exit 2."""
    port = _free_port()
    explicit = dict(INFJAX_COORDINATOR=f"127.0.0.1:{port}", INFJAX_INIT_TIMEOUT="60", INFJAX_LAUNCH_ID="one")
    procs = [_by_hand(tmp_path, str(tmp_path / "a"), INFJAX_NUM_PROCESSES="2", INFJAX_PROCESS_ID="0", **explicit),
             _by_hand(tmp_path, str(tmp_path / "b"), INFJAX_NUM_PROCESSES="3", INFJAX_PROCESS_ID="1", **explicit)]
    ends = [_ends(p) for p in procs]
    print(*ends, sep="\n")
    for code, last in ends:
        assert code == 2 and re.search(
            rf"ERROR the 2 processes that met at the coordinator at 127\.0\.0\.1:{port} are not one job: they differ "
            rf"in workdir \(process 0: '{tmp_path}/a'; process 1: '{tmp_path}/b'\), INFJAX_NUM_PROCESSES \(process 0: "
            r"2; process 1: 3\)\. Either two jobs share", last), last


@pytest.mark.slow
def test_a_taken_coordinator_port_and_a_duplicate_process_id_are_said_at_once(tmp_path):
    """Two jobs on one coordinator port never mix, and a duplicate process id stops both processes at once.

    Job A's process 0 holds port P and waits for its process 1. Job B on P: its process 0 is refused the port,
    its process 1 refuses to register with A's coordinator. Then a second process 0 of job A: it and A's
    process 0 both stop at once, naming each other, without waiting out INFJAX_INIT_TIMEOUT."""
    import time

    port = _free_port()
    explicit = dict(INFJAX_COORDINATOR=f"127.0.0.1:{port}", INFJAX_NUM_PROCESSES="2", INFJAX_INIT_TIMEOUT="120")
    a0 = _by_hand(tmp_path, str(tmp_path / "a"), INFJAX_PROCESS_ID="0", INFJAX_LAUNCH_ID="job-a", **explicit)
    _wait_listening(port, a0)                                       # job A's coordinator first, on a loaded machine too
    b = [_by_hand(tmp_path, str(tmp_path / "b"), INFJAX_PROCESS_ID=str(i), INFJAX_LAUNCH_ID="job-b", **explicit)
         for i in range(2)]
    start = time.time()
    ends = [_ends(p) for p in b]
    print(*ends, sep="\n")
    assert time.time() - start < 60 and a0.poll() is None          # job A's process 0 still waits for its process 1
    assert ends[0][0] == 2 and f"ERROR process 0 of 2: the coordinator port {port} on this host is taken by another " \
        f"job (process {a0.pid}, launch INFJAX_LAUNCH_ID=job-a): give each job its own port" in ends[0][1]
    assert ends[1][0] == 2 and f"ERROR process 1 of 2: the coordinator port {port} on this host is held by another " \
        f"job (process {a0.pid}, launch INFJAX_LAUNCH_ID=job-a), not by this job's process 0" in ends[1][1]
    twin = _by_hand(tmp_path, str(tmp_path / "a"), INFJAX_PROCESS_ID="0", INFJAX_LAUNCH_ID="job-a", **explicit)
    ends = [_ends(twin), _ends(a0)]
    print(*ends, sep="\n")
    assert ends[0][0] == 2 and f"ERROR process 0 of 2: process {a0.pid} on this host was also started as process 0 " \
        "of this job and holds its coordinator port" in ends[0][1]
    assert ends[1][0] == 2 and f"ERROR process 0 of 2: process {twin.pid} on this host was also started as process " \
        "0 of this job (and was refused the coordinator port" in ends[1][1]
    assert time.time() - start < 100


@pytest.mark.slow
def test_unequal_device_counts_are_refused_in_one_line(tmp_path):
    """srun -n 3 on 2 nodes of 8 GPUs: two tasks share node 0 (4 GPUs each), one has node 1 (8). The
    job ends in one line naming each process's devices, exit 2."""
    script = tmp_path / "three.sbatch"
    script.write_text("#!/usr/bin/env bash\n#SBATCH --nodes=2\n#SBATCH --gpus-per-node=8\n"
                      "srun -n 3 --kill-on-bad-exit=1 \"$PYTHON\" -m infjax.train \"$@\"\n")
    code, out = _run(["sbatch", str(script), *_flags(str(tmp_path / "run"))], _env(tmp_path, 1, STANDIN_DEVICES="gpus"))
    last = _one_line_error(out)
    print(code, last)
    assert code == 2 and last.endswith(
        "ERROR the processes of this job have unequal device counts (process 0, 1 have 4 device(s) each; process 2 "
        "has 8 device(s)); every process takes an equal slice of each batch, so each needs the same number of "
        "devices: give the same number of tasks on every node (--ntasks-per-node, not --ntasks alone) and of GPUs "
        "per node, or --gpus-per-task"), out[-3000:]


@pytest.mark.parametrize("n", ["0", "00", "x"])
def test_local_sh_refuses_a_process_count_below_one(tmp_path, n):
    """`launch/local.sh N` with N not a whole number >= 1 is refused in one line, exit 2, before a workdir is
    created."""
    import subprocess

    from tests.helpers.paths import ROOT

    workdir = tmp_path / "run"
    p = subprocess.run(["bash", "launch/local.sh", n, "--config=configs/multi_pi.py", f"--workdir={workdir}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and f"N >= 1 processes; got {n}" in p.stderr and not workdir.exists()


@pytest.mark.parametrize("key, value, said", [
    ("INFJAX_LOCAL_DEVICES", "0", "the CPU devices per process must be a whole number >= 1"),
    ("INFJAX_LOCAL_DEVICES", "abc", "the CPU devices per process must be a whole number >= 1"),
    ("INFJAX_LOCAL_DEVICES", "-1", "the CPU devices per process must be a whole number >= 1"),
    ("INFJAX_PORT", "70000", "the coordinator's port must be a whole number from 1 to 65535"),
    ("INFJAX_PORT", "http://x:1", "the coordinator's port must be a whole number from 1 to 65535"),
])
def test_local_sh_checks_its_variables(tmp_path, key, value, said):
    """launch/local.sh refuses a bad INFJAX_LOCAL_DEVICES or INFJAX_PORT in one line naming it, exit 2, before
    it starts a process (XLA would crash on 0, print its flag list on abc, a traceback on -1)."""
    import os
    import subprocess

    from tests.helpers.paths import ROOT

    workdir = tmp_path / "run"
    p = subprocess.run(["bash", "launch/local.sh", "2", "--config=configs/multi_pi.py", f"--workdir={workdir}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60, env={**os.environ, key: value})
    assert p.returncode == 2 and p.stderr.startswith(f"launch/local.sh: {key}='{value}': {said}")
    assert p.stderr.count("\n") == 1 and not workdir.exists()


def _stub_python(tmp_path):
    """A stand-in for python that launch/local.sh starts: prints its process id and arguments, exits 0."""
    stub = tmp_path / "python"
    stub.write_text("#!/bin/bash\necho \"process $INFJAX_PROCESS_ID ran: $*\"\n")
    stub.chmod(0o755)
    return str(stub)


def test_local_sh_keeps_the_logs_of_every_launch_and_refuses_a_linked_log(tmp_path):
    env = dict(os.environ, PYTHON=_stub_python(tmp_path), INFJAX_PORT="12345")
    workdir = tmp_path / "run"
    for steps in (2, 4):                                 # a run, then its resumption (or a refused second launch)
        p = subprocess.run(["bash", "launch/local.sh", "2", f"--workdir={workdir}", f"--config.train.steps={steps}"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
    for i in (0, 1):
        lines = (workdir / f"process_{i}.log").read_text().splitlines()
        assert [re.sub(r"^==== \S+ \S+ ", "==== TIME ", line) for line in lines] == [
            f"==== TIME launch/local.sh: process {i} of 2 (pid {pid}): infjax.train --workdir={workdir} "
            f"--config.train.steps={steps}" if header else
            f"process {i} ran: -m infjax.train --workdir={workdir} --config.train.steps={steps}"
            for steps, pid in ((2, lines[0].split("(pid ")[1].split(")")[0]), (4, lines[2].split("(pid ")[1].split(")")[0]))
            for header in (True, False)]
    target = tmp_path / "precious.txt"
    target.write_text("precious data\n")
    (workdir / "process_1.log").unlink()
    os.symlink(target, workdir / "process_1.log")
    p = subprocess.run(["bash", "launch/local.sh", "2", f"--workdir={workdir}"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.strip() == (f"launch/local.sh: {workdir}/process_1.log is a symbolic link "
                                                      f"(to {target}); remove it")
    assert target.read_text() == "precious data\n" and len((workdir / "process_0.log").read_text().splitlines()) == 4
