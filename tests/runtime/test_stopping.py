"""infjax/runtime/stopping.py: SIGTERM, SIGINT and SIGHUP set the stop flag, and a run held past the grace ends."""
import logging
import re

import pytest

from infjax import errors
from infjax.runtime import stopping
from tests.helpers.signals import dispositions


def test_a_signal_while_the_run_is_held_ends_it_after_the_grace_naming_where(monkeypatch, caplog):
    """SIGTERM sets the stop flag; a run that cannot get back to its loop (held in a write or a wait that does not
    end) exits 143 once train.stop_grace_s is over, naming where it was held; a second signal exits at once."""
    import signal
    import threading

    exits = []
    exited = threading.Event()
    monkeypatch.setattr(stopping.os, "_exit", lambda code: (exits.append(code), exited.set()))
    with caplog.at_level(logging.ERROR, logger="infjax.train"), dispositions(SIGINT=signal.default_int_handler):
        with stopping.Preemption(grace_s=0.5, expired=lambda: "the last complete checkpoint is C") as p:
            signal.raise_signal(signal.SIGTERM)
            assert p.received == "SIGTERM" and not exits           # the flag only: the loop stops at its step
            assert exited.wait(timeout=20)     # the main thread held here: only the watchdog can end the run
            exited.clear()
            signal.raise_signal(signal.SIGINT)                      # a second signal: at once
        p.disarm()
    assert exits == [143, 130]
    first, second = [r.getMessage() for r in caplog.records]
    assert re.fullmatch(r"stopped by SIGTERM, but the run did not reach its checkpoint within train.stop_grace_s=0.5 s "
                        r"\(held in wait \(threading.py:\d+\)\); exiting without saving; the last complete checkpoint "
                        r"is C", first), first
    assert re.fullmatch(r"stopped by a second SIGINT \(held in test_a_signal_while_the_run_is_held_ends_it_after_the_"
                        r"grace_naming_where \(test_stopping.py:\d+\)\); exiting without saving; the last complete "
                        r"checkpoint is C", second), second


def test_sighup_sets_the_stop_flag_as_sigterm_does():
    """SIGHUP (a closed terminal or SSH session) sets the stop flag as SIGTERM does, and the handler it had is
    put back after; the run then saves and exits 0 (tests/test_train.py closes a real terminal under one)."""
    import signal

    with dispositions(SIGHUP=signal.SIG_DFL):                  # a program started from a terminal
        with stopping.Preemption() as p:
            signal.raise_signal(signal.SIGHUP)
            assert p.received == "SIGHUP"
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL      # put back as it was


def test_under_nohup_sighup_stays_ignored_and_a_background_jobs_sigint_too():
    """A terminal signal ignored on entry stays ignored (SIGHUP under `nohup`, SIGINT in a shell's background
    job), in training and in an export's handler; SIGTERM, a scheduler's stop, is caught in any case."""
    import signal

    with dispositions(SIGHUP=signal.SIG_IGN, SIGINT=signal.SIG_IGN, SIGTERM=signal.SIG_IGN):
        with stopping.Preemption() as p:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            signal.raise_signal(signal.SIGHUP)
            signal.raise_signal(signal.SIGINT)
            assert p.received is None
            signal.raise_signal(signal.SIGTERM)
            assert p.received == "SIGTERM"
        assert [signal.getsignal(s) for s in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM)] == [signal.SIG_IGN] * 3
        with errors.sigterm_raises("during the test"):            # an export's handler: the same rule
            signal.raise_signal(signal.SIGHUP)
            with pytest.raises(errors.Terminated, match=r"terminated \(SIGTERM\) during the test"):
                signal.raise_signal(signal.SIGTERM)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN and signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


def test_without_a_signal_the_grace_never_ends_a_run(monkeypatch):
    import signal
    import time as time_lib

    monkeypatch.setattr(stopping.os, "_exit", lambda code: pytest.fail(f"exited {code}"))
    with stopping.Preemption(grace_s=0.1) as p:
        time_lib.sleep(0.3)
    assert p.received is None and signal.getsignal(signal.SIGTERM) is not p._handle
