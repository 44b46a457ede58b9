"""A server process's life around its signals: SIGTERM / SIGINT end a process that is still
starting (:func:`exit_on_signals`), make a serving one drain (:class:`StopSignals`,
:func:`serve_until_signal`, :func:`serve_then_stop`), and a drain that never ends is cut short
(:func:`exit_if_stuck`).

Why a stop signal only sets a flag: Python runs a handler in the main thread between two
bytecodes, wherever that thread is. A handler that calls ``threading.Event.set()`` takes the
event's lock, a plain non-reentrant one; when the signal lands while the main thread itself holds
that lock (inside its own ``event.wait(0.5)``), the handler waits on it forever and the process
is deaf to SIGTERM (CI saw an embedding server outlive its drain's watchdog that way).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from common.ready import ReadyLine, print_ready

log = logging.getLogger(__name__)

EXIT_MARGIN_S = 5.0
"""Seconds a server may take past its drain's grace before :func:`exit_if_stuck` ends it."""

POLL_S = 0.1
"""How often :meth:`StopSignals.wait` looks at its flags: the most a stop waits to be seen."""


def _exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # the shell's status for "ended by signal N"


def exit_on_signals(*signals: signal.Signals) -> None:
    """Until the caller installs other handlers, each of ``signals`` ends the process: the main
    thread raises ``SystemExit(128 + signal)`` wherever it is, a kernel build or a wait for
    another process's build lock included (``common/cpp_extension.py``). For start-up, when
    there is nothing to drain yet: a handler that only sets an event would leave a starting
    process deaf until it is ready, forever when it waits on a build that never ends."""
    for sig in signals:
        signal.signal(sig, _exit)


class StopSignals:
    """Stop signals a serving process's main thread waits for, taking no lock in the handler
    (see the module's docstring)::

        stop = StopSignals(signal.SIGTERM)   # installs the handler
        stop.wait(also=parent_gone)          # returns on SIGTERM or once parent_gone is set

    ``received`` lists the signals seen; a list append is one atomic step under the GIL.
    """

    def __init__(self, *signals: signal.Signals) -> None:
        self.received: list[int] = []
        for sig in signals:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.received.append(signum)  # no lock: see the module's docstring

    def wait(self, also: threading.Event | None = None) -> None:
        """Blocks until a stop signal arrives, or until ``also`` (set by another thread: a
        parent's end) is set. Sleeps between looks: ``time.sleep`` holds no lock a handler
        could need, and ``Event.is_set`` takes none."""
        while not self.received and not (also is not None and also.is_set()):
            time.sleep(POLL_S)


def serve_until_signal(start: Callable[[], ReadyLine]) -> None:
    """Runs ``start()`` (which returns the ready line), prints it on stdout (a parent process
    waits for it: ``common/ready.py``), and blocks until SIGTERM or SIGINT. A signal
    during ``start()`` ends the start-up at once (:func:`exit_on_signals`); once started, it
    makes this function return (the caller drains)."""
    exit_on_signals(signal.SIGTERM, signal.SIGINT)
    line = start()
    stop = StopSignals(signal.SIGTERM, signal.SIGINT)
    print_ready(line)
    stop.wait()


def serve_then_stop(
    start: Callable[[], ReadyLine], stop: Callable[[float], None], grace: float
) -> None:
    """:func:`serve_until_signal`, then ``stop(grace)`` (the server drains), bounded by
    :func:`exit_if_stuck` at ``grace`` + :data:`EXIT_MARGIN_S`: a shard or embedding server's
    life as a process."""
    serve_until_signal(start)
    exit_if_stuck(grace + EXIT_MARGIN_S)
    stop(grace)


def exit_if_stuck(after_s: float, what: str = "the drain") -> None:
    """Ends the process with status 1 when it is still alive ``after_s`` seconds from now: a
    drain stuck in gRPC's shutdown, or the interpreter's exit waiting on a handler thread that
    never returns, would otherwise leave a server deaf to SIGTERM until a SIGKILL. Before
    exiting it logs every thread's stack (where it was stuck). Call it when the drain starts."""

    def watchdog() -> None:
        time.sleep(after_s)
        log.error("%s did not finish within %.1f s; exiting anyway (stacks follow)", what, after_s)
        faulthandler.dump_traceback(sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(1)

    threading.Thread(target=watchdog, name="exit-watchdog", daemon=True).start()
