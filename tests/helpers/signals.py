"""Signal dispositions for a test: what a shell or `nohup` would have given the process, put back after."""
import contextlib
import signal


@contextlib.contextmanager
def dispositions(**wanted):
    """`dispositions(SIGHUP=signal.SIG_IGN)`: inside, each named signal has that handler (SIG_DFL, SIG_IGN or a
    function); after, what it had before. The test process may have either: one started under `nohup` ignores
    SIGHUP."""
    before = {signal.Signals[name]: signal.signal(signal.Signals[name], handler) for name, handler in wanted.items()}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
