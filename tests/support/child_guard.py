"""A test that starts a child process must be marked ``multiproc`` (a pytest plugin of
``tests/conftest.py``).

``make test-fast`` runs ``-m "not slow and not multiproc"``: the fast tier stays fast only if every
test that starts a process says so. While an unmarked test runs (its fixtures' setup and teardown
included, so a module fixture that starts a server counts against the first test that needs it),
starting a child through ``subprocess``, ``multiprocessing``, ``os.fork``, ``os.posix_spawn`` or
``os.system`` raises :class:`UnmarkedChildProcess`. The test also fails if the code under test
caught that error. In-process servers (gRPC threads) are fine.

Allowed without the mark: the C/C++ toolchain (compilers, ninja, ``ldconfig``), which
``torch.utils.cpp_extension`` runs to build our kernels on first use and ``ctypes.util`` runs to
find libraries. Imports that probe the machine with a child process (``numpy.testing`` runs
``lscpu``) happen when this plugin loads. ``torch.compile`` (inductor) starts compile workers: a
test that compiles with inductor is ``multiproc``.

``RECSERVE_CHILD_GUARD=report`` lets such children start and lists the tests at the end instead
(to survey a tree before marking it).
"""

from __future__ import annotations

import multiprocessing.process
import os
import posix
import re
import subprocess
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from typing import Any

import numpy.testing  # noqa: F401  (its import runs lscpu once: here, before any test)
import pytest

# A compiler or build tool, possibly with a target prefix or a version suffix
# (x86_64-linux-gnu-g++-12, clang++-17, ninja).
_TOOLCHAIN = re.compile(
    r"^([\w.]+-)*(c\+\+|g\+\+|gcc|cc|clang\+\+|clang|icpx|nvcc|ld|ninja|ldconfig|objdump)"
    r"(-[\d.]+)?$"
)
_report: list[str] = []


class UnmarkedChildProcess(RuntimeError):
    """Raised when a test not marked ``multiproc`` starts a child process."""


def allowed(argv0: str | bytes | os.PathLike[Any]) -> bool:
    """True for the toolchain programs an unmarked test may run (see the module docstring)."""
    name = os.path.basename(os.fsdecode(argv0))
    return bool(_TOOLCHAIN.match(name))


def _program(args: Any, executable: Any = None) -> str:
    if executable is not None:
        return os.fsdecode(executable)
    if isinstance(args, (str, bytes)):
        words = os.fsdecode(args).split()
        return words[0] if words else ""
    if isinstance(args, os.PathLike):
        return os.fsdecode(args)
    args = list(args)
    return os.fsdecode(args[0]) if args else ""


@contextmanager
def guard(what: str, on_violation: Callable[[str], None], enforce: bool = True) -> Iterator[None]:
    """While open, starting a child process (other than the toolchain) calls ``on_violation`` with a
    description and then raises :class:`UnmarkedChildProcess` (or, with ``enforce=False``, lets
    the child start); ``what`` names the test."""
    mp = pytest.MonkeyPatch()

    def refuse(how: str) -> None:
        message = f"{what} started a child process ({how}): mark it multiproc"
        on_violation(message)
        if enforce:
            raise UnmarkedChildProcess(message)

    execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def checked_execute_child(self: subprocess.Popen[Any], args: Any, executable: Any, *a: Any):
        program = _program(args, executable)
        if not allowed(program):
            refuse(f"subprocess: {_program(args)}")
        return execute_child(self, args, executable, *a)

    def spawner(name: str) -> Callable[..., Any]:
        original = getattr(os, name)

        def spawn(path: Any, argv: Any, *a: Any, **k: Any) -> Any:
            if not allowed(path):
                refuse(f"os.{name}: {os.fsdecode(path)}")
            return original(path, argv, *a, **k)

        return spawn

    def refusing(how: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            refuse(how)
            return original(*a, **k)

        return call

    process = multiprocessing.process.BaseProcess
    mp.setattr(subprocess.Popen, "_execute_child", checked_execute_child)
    mp.setattr(process, "start", refusing("multiprocessing", process.start))
    for name in ("posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            mp.setattr(os, name, spawner(name))
    for name in ("fork", "forkpty", "system"):
        if hasattr(os, name):
            original = getattr(os, name)
            call = refusing(f"os.{name}", original)
            # Pickles name os.system as posix.system (tests/serving/repository builds such
            # payloads): the stand-in takes its place under both names, so it pickles the same.
            call.__module__, call.__qualname__, call.__name__ = "posix", name, name
            mp.setattr(os, name, call)
            mp.setattr(posix, name, call)
    try:
        yield
    finally:
        mp.undo()


def _guarded(item: pytest.Item) -> Generator[None, Any, Any]:
    if item.get_closest_marker("multiproc") is not None:
        return (yield)
    violations: list[str] = []
    enforce = os.environ.get("RECSERVE_CHILD_GUARD") != "report"
    with guard(item.nodeid, violations.append, enforce):
        result = yield
    if enforce and violations:
        # The code under test caught the error; the test still broke the convention.
        raise UnmarkedChildProcess(violations[0])
    _report.extend(violations)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _guarded(item))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _report:
        terminalreporter.section("unmarked tests that started child processes")
        for line in dict.fromkeys(_report):
            terminalreporter.write_line(line)
