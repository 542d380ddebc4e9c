"""The coordinator's port is one job's: process 0 claims it, and the others check who holds it.

JAX's coordination service binds its port with SO_REUSEPORT, so a second job's service would start on a port
already in use and the two jobs would mix. Process 0 claims the coordinator's port before it starts the
service and refuses one that is taken (`claim_coordinator_port`); a process on the coordinator's host asks who
holds the claim before it registers (`await_own_coordinator`). The claim is an abstract Unix socket named by
the port (one per network namespace, as the port is; gone with its process), whose holder answers who it is.
What the processes that met compare once connected is runtime/distributed.py's.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import threading
import time

from infjax.runtime import clusters

log = logging.getLogger("infjax.distributed")      # the lines of the job's start-up

_claim: list = []                   # the claim on the coordinator's port, held for the process's life
_starting = threading.Event()       # set while this process waits for the other processes of its job
_starting.set()
_PROCESS_ID = {"INFJAX_COORDINATOR": "INFJAX_PROCESS_ID", "SLURM": "SLURM_PROCID", "Open MPI": "OMPI_COMM_WORLD_RANK"}


def started() -> None:
    """This process has joined its job: a later process asking with its id no longer stops it."""
    _starting.clear()


def answers(address: str, timeout: float = 2.0) -> bool:
    """Whether something accepts TCP connections at host:port."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def port_fix(layout: clusters.Layout) -> str:
    """What to change where two jobs meet on one coordinator port, for this kind of launch."""
    if layout.kind == "INFJAX_COORDINATOR":
        return ("give each job its own port in INFJAX_COORDINATOR; with launch/local.sh, another INFJAX_PORT or none "
                "(a free one)")
    if layout.kind == "SLURM":
        return ("JAX derives the port from the SLURM job id, so jobs whose ids differ by a multiple of 4096 get the "
                "same one: set JAX_COORDINATOR_PORT to a free port for this job")
    return "set JAX_COORDINATOR_PORT to a free port for this job"


def _coordinator_port(layout: clusters.Layout, env) -> int | None:
    """The port process 0's coordination service binds, or None where JAX finds the coordinator itself.

    JAX binds that of JAX_COORDINATOR_BIND_ADDRESS, else the coordinator's.
    """
    address = env.get("JAX_COORDINATOR_BIND_ADDRESS") or layout.coordinator
    if layout.jax_detects or address is None:
        return None
    return int(address.rsplit(":", 1)[1])


def _claim_name(port: int) -> str:
    # An abstract Unix socket: one per network namespace (as the port is), gone when its process ends.
    return f"\0infjax/coordinator-port/{port}"


def _describe_job(identity: dict) -> str:
    for key in ("launch", "workdir", "arguments"):
        if identity.get(key):
            return f"{key} {identity[key]}"
    return "another job"


def claim_coordinator_port(layout: clusters.Layout, identity: dict, env, stop) -> None:
    """Process 0 only, before it starts the coordination service: claim the port, or refuse one that is taken.

    The gRPC server of JAX's service binds with SO_REUSEPORT, so a second job's service on the same port starts
    without an error, and the kernel then hands each connecting process to either service: two jobs become two
    mixed ones. This process holds a claim on the port for its life (an abstract Unix socket named by the port,
    which a second infjax process cannot bind); a second one asks the holder who it is and says which job holds
    the port, or that it was also started as process 0 of the same job (then the holder stops too, through
    `stop(line, exit_code)`: its job cannot start). A port held by anything else is found by binding it
    without SO_REUSEPORT.
    """
    port = _coordinator_port(layout, env)
    if port is None or layout.process_id != 0 or _claim:
        return
    me = {"pid": os.getpid(), "process_id": layout.process_id, "job": identity}
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        claim.bind(_claim_name(port))
    except OSError as e:
        claim.close()
        if e.errno != errno.EADDRINUSE:
            return                                   # no abstract sockets here (not Linux): the bind test below
        raise clusters.ClusterError(_taken(layout, port, _ask_holder(port, me), identity)) from None
    claim.listen(8)
    _claim.append(claim)
    threading.Thread(target=_answer_claims, args=(claim, me, layout, port, stop), name="infjax-port",
                     daemon=True).start()
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # a closed job's TIME_WAIT is free
                probe.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                release_coordinator_port()
                raise clusters.ClusterError(
                    f"process 0 of {layout.num_processes}: the coordinator port {port} is already in use on this "
                    f"host (by a process that is not infjax's, or another job's coordinator): "
                    f"{port_fix(layout)}") from None
            # no IPv6 (or IPv4) on this host: the other family decides


def _is_local(host: str) -> bool:
    """Whether `host` names an address of this host (in this network namespace): one that a socket can bind."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    for family, _, _, _, address in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.bind((address[0], 0))
                return True
        except OSError:
            continue
    return False


def await_own_coordinator(layout: clusters.Layout, identity: dict, env, timeout: int, clock=time.monotonic) -> None:
    """A process other than 0 whose coordinator is on its own host: wait for the port's claim, refuse another's.

    Before registering with the coordinator, wait until an infjax process holds the port's claim, and refuse
    where it belongs to another launch (another SLURM job, another launch/local.sh) or already has a process of
    this job with this id on this host. A process that registers with another job's coordinator is taken there
    for a restarted process of that job, and JAX's coordination service then aborts every process of that job.
    Everything else (the coordinator on another host, processes of one launch started with different flags) is
    for the check after connecting (runtime/distributed.py), which every process makes and which refuses all
    of them alike.
    """
    if layout.jax_detects or layout.process_id == 0 or env.get("JAX_COORDINATOR_BIND_ADDRESS") or \
            not _is_local(layout.coordinator.rsplit(":", 1)[0]):
        return
    port = int(layout.coordinator.rsplit(":", 1)[1])
    me = {"pid": os.getpid(), "process_id": layout.process_id, "job": identity}
    deadline = clock() + timeout
    while clock() < deadline:
        holder = _ask_holder(port, me)
        if holder is not None:
            if holder.get("claimed_by") is not None:
                variable = _PROCESS_ID.get(layout.kind, "process id")
                raise clusters.ClusterError(
                    f"process {layout.process_id} of {layout.num_processes}: process {holder['claimed_by']} on this "
                    f"host was also started as process {layout.process_id} of this job: give each process its own "
                    f"{variable} (0 .. {layout.num_processes - 1})")
            if _other_launch((holder.get("job") or {}).get("launch"), identity.get("launch")):
                raise clusters.ClusterError(
                    f"process {layout.process_id} of {layout.num_processes}: the coordinator port {port} on this "
                    f"host is held by another job (process {holder.get('pid')}, {_describe_job(holder.get('job') or {})}"
                    f"), not by this job's process 0: {port_fix(layout)}")
            return
        if answers(layout.coordinator, timeout=0.5):
            return          # served, but by no infjax process of this network namespace: JAX's own checks decide
        time.sleep(0.2)


def release_coordinator_port() -> None:
    """Give up this process's claim on the coordinator's port (it ends with the process anyway)."""
    while _claim:
        with contextlib.suppress(OSError):
            sock = _claim.pop()
            sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def _taken(layout: clusters.Layout, port: int, holder: dict | None, identity: dict) -> str:
    n = layout.num_processes
    if holder is not None and holder.get("job") == identity:
        variable = _PROCESS_ID.get(layout.kind, "the process id")
        return (f"process 0 of {n}: process {holder['pid']} on this host was also started as process 0 of this job "
                f"and holds its coordinator port {port}: give each process its own {variable} (0 .. {n - 1})")
    who = f"process {holder['pid']}, {_describe_job(holder['job'])}" if holder else "an infjax process"
    return (f"process 0 of {n}: the coordinator port {port} on this host is taken by another job ({who}): "
            f"{port_fix(layout)}")


def _read_line(conn: socket.socket, limit: int = 1 << 22) -> dict | None:
    data = b""
    while not data.endswith(b"\n") and len(data) < limit:
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    try:
        return json.loads(data)
    except ValueError:
        return None


def _ask_holder(port: int, me: dict) -> dict | None:
    """The holder of the port's claim: its pid, process id and job (None where it does not answer)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(5)
            conn.connect(_claim_name(port))
            conn.sendall(json.dumps(me, sort_keys=True, default=str).encode() + b"\n")
            return _read_line(conn)
    except OSError:
        return None


def _other_launch(a: str | None, b: str | None) -> bool:
    """Whether two launch ids say two jobs (both given and different)."""
    return bool(a and b and a != b)


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError, TypeError):
        return False
    return True


def _answer_claims(claim: socket.socket, me: dict, layout: clusters.Layout, port: int, stop) -> None:
    """The holder's side: say who holds the port, and whether this job's process with that id already asked.

    A second process 0 of this job, or two live processes on this host with one id (while this one still
    waits for the others), mean that the job cannot start: this process stops too (`stop`), naming them.
    """
    asked: dict[int, int] = {}          # process id -> pid of this job's processes on this host that asked
    variable = _PROCESS_ID.get(layout.kind, "process id")
    n = layout.num_processes
    while True:
        try:
            conn, _ = claim.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(5)
            try:
                other = _read_line(conn) or {}
                same = other.get("job") == me["job"]
                pid, i = other.get("pid"), other.get("process_id")
                first = asked.get(i) if same and i is not None else None
                twice = first is not None and first != pid and _alive(first)
                conn.sendall(json.dumps(dict(me, claimed_by=first if twice else None), sort_keys=True,
                                        default=str).encode() + b"\n")
            except OSError:
                continue
        if not other:
            continue
        if same and i == me["process_id"] and _starting.is_set():
            stop(f"process 0 of {n}: process {pid} on this host was also started as process 0 of this job (and "
                      f"was refused the coordinator port {port}): give each process its own {variable} (0 .. {n - 1})",
                      clusters.ClusterError.exit_code)
        elif twice and _starting.is_set():
            stop(f"process 0 of {n}: processes {first} and {pid} on this host were both started as process {i} "
                      f"of this job: give each process its own {variable} (0 .. {n - 1})",
                      clusters.ClusterError.exit_code)
        elif same and i is not None and not twice:
            asked[i] = pid
        elif _other_launch((other.get("job") or {}).get("launch"), me["job"].get("launch")):
            log.warning("a process of another job (process %s, %s) looked for its coordinator on this job's port %d "
                        "and was refused", pid, _describe_job(other.get("job") or {}), port)
