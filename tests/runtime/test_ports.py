"""infjax/runtime/ports.py: the coordinator port claimed by one job, and refused to another naming its holder."""
import pytest

from infjax.runtime import clusters, distributed, ports
from infjax.runtime.clusters import ClusterError
from tests.helpers.launchers import EXPLICIT


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
    ports.claim_coordinator_port(lay, ident, {}, stop=distributed._stop_now)
    yield port, ident
    ports.release_coordinator_port()


def test_a_taken_coordinator_port_is_refused_naming_its_holder(claimed):
    import os
    import socket

    port, ident = claimed
    env = {**EXPLICIT, "INFJAX_COORDINATOR": f"127.0.0.1:{port}"}
    other = clusters.layout({**env, "INFJAX_PROCESS_ID": "0", "INFJAX_LAUNCH_ID": "b"})
    holder = ports._ask_holder(port, {"pid": 1, "process_id": 0, "job": {"workdir": "/runs/b"}})
    assert holder["pid"] == os.getpid() and holder["job"] == ident and holder["claimed_by"] is None
    line = ports._taken(other, port, holder, distributed.job_identity(other, {"workdir": "/runs/b"}))
    assert line == (f"process 0 of 2: the coordinator port {port} on this host is taken by another job (process "
                    f"{os.getpid()}, launch INFJAX_LAUNCH_ID=a): give each job its own port in INFJAX_COORDINATOR; "
                    f"with launch/local.sh, another INFJAX_PORT or none (a free one)")
    # process 1 of another launch, whose coordinator is this port on this host, refuses before it registers
    one = clusters.layout({**env, "INFJAX_PROCESS_ID": "1", "INFJAX_LAUNCH_ID": "b"})
    with pytest.raises(ClusterError, match=rf"process 1 of 2: the coordinator port {port} on this host is held by "
                                           rf"another job \(process {os.getpid()}, launch INFJAX_LAUNCH_ID=a\)"):
        ports.await_own_coordinator(one, distributed.job_identity(one, {"workdir": "/runs/a"}), {}, 5)
    same = clusters.layout({**env, "INFJAX_PROCESS_ID": "1", "INFJAX_LAUNCH_ID": "a"})
    ports.await_own_coordinator(same, distributed.job_identity(same, {"workdir": "/runs/b"}), {}, 5)  # goes on:
    # one launch's processes with different flags are refused after connecting, all of them alike
    # a port that something else listens on (no claim): refused by the bind test
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        busy = listener.getsockname()[1]
        lay = clusters.layout({**env, "INFJAX_COORDINATOR": f"127.0.0.1:{busy}", "INFJAX_PROCESS_ID": "0"})
        ports.release_coordinator_port()
        with pytest.raises(ClusterError, match=f"process 0 of 2: the coordinator port {busy} is already in use on this "
                                               "host"):
            ports.claim_coordinator_port(lay, ident, {}, stop=distributed._stop_now)
        assert not ports._claim                              # the claim is given up with the refusal
