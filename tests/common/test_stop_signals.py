"""common/stop_signals.py: a stop signal is seen wherever the main thread is, and a drain that
never ends is cut short."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SIGNAL_UNDER_LOCK = textwrap.dedent(
    """
    import os, signal, sys, threading
    from common.stop_signals import StopSignals

    if sys.argv[1] == "flag":
        stop = StopSignals(signal.SIGTERM)
        wait = stop.wait
    else:  # what the servers did before: the handler sets the event the main thread waits on
        event = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: event.set())
        wait = event.wait
    lock = event._cond if sys.argv[1] == "event" else threading.Lock()
    with lock:  # the handler runs here, at the next bytecode, while this thread holds the lock
        os.kill(os.getpid(), signal.SIGTERM)
        landed = True
    wait()
    print("stopped", flush=True)
    """
)


@pytest.mark.multiproc
@pytest.mark.parametrize("handler", ["flag", "event"])
def test_a_stop_signal_landing_while_the_main_thread_holds_a_lock_is_seen(handler: str):
    cmd = [sys.executable, "-c", SIGNAL_UNDER_LOCK, handler]
    if handler == "event":  # Event.set in the handler waits on the lock its own thread holds
        with pytest.raises(subprocess.TimeoutExpired):
            subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=3)
        return
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout == "stopped\n", out.stderr


def test_the_wait_also_ends_when_the_other_event_is_set():
    from common.stop_signals import StopSignals

    stop, gone = StopSignals(), threading.Event()
    threading.Timer(0.2, gone.set).start()
    stop.wait(also=gone)  # returns (the suite's timeout fails it otherwise)
    assert gone.is_set() and stop.received == []


STUCK_EXIT = textwrap.dedent(
    """
    import logging, sys, threading, time
    from common.stop_signals import exit_if_stuck
    logging.basicConfig()
    exit_if_stuck(0.3, "the test drain")

    def handler_that_never_returns():
        threading.Event().wait()

    if sys.argv[1] == "stuck":  # a non-daemon thread: the interpreter's exit waits on it
        threading.Thread(target=handler_that_never_returns).start()
    """
)


@pytest.mark.multiproc
@pytest.mark.parametrize("case", ["stuck", "clean"])
def test_a_stuck_exit_ends_with_status_1_and_the_stacks_in_the_log(case: str):
    out = subprocess.run(
        [sys.executable, "-c", STUCK_EXIT, case],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    if case == "clean":  # ended before the watchdog fired: its own status
        assert out.returncode == 0 and "did not finish" not in out.stderr
        return
    assert out.returncode == 1
    assert "the test drain did not finish within 0.3 s; exiting anyway" in out.stderr
    assert "handler_that_never_returns" in out.stderr  # where it was stuck
