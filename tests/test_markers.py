"""The marker convention is a test: an unmarked test that starts a child process fails
(``support/child_guard.py``), so ``make test-fast`` (``-m "not slow and not multiproc"``) starts none."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys

import pytest

from support.child_guard import UnmarkedChildProcess, allowed, guard

# These tests call the guard directly (refusals happen before any child exists); the plugin's
# wiring into pytest is checked on an inner run with pytester at the end.


def test_subprocess_is_refused_in_an_unmarked_test() -> None:
    seen: list[str] = []
    with guard("t", seen.append):
        with pytest.raises(UnmarkedChildProcess, match="mark it multiproc"):
            subprocess.run([sys.executable, "-c", "pass"], check=True)
        with pytest.raises(UnmarkedChildProcess, match="mark it multiproc"):
            subprocess.run("echo hi", shell=True, check=True)
    assert len(seen) == 2 and seen[0].startswith("t started a child process (subprocess: ")


def test_multiprocessing_fork_and_spawn_are_refused_in_an_unmarked_test() -> None:
    with guard("t", lambda _: None):
        for method in ("fork", "spawn"):
            proc = multiprocessing.get_context(method).Process(target=print)
            with pytest.raises(UnmarkedChildProcess, match="multiprocessing"):
                proc.start()
        with pytest.raises(UnmarkedChildProcess, match=r"os\.fork"):
            os.fork()
        with pytest.raises(UnmarkedChildProcess, match=r"os\.posix_spawn"):
            os.posix_spawn(sys.executable, [sys.executable, "-c", "pass"], os.environ)
        with pytest.raises(UnmarkedChildProcess, match=r"os\.system"):
            os.system("true")


def test_the_compiler_toolchain_may_run_unmarked() -> None:
    # torch.utils.cpp_extension builds our kernels on first use: it runs c++ and ninja.
    for name in ("c++", "g++", "x86_64-linux-gnu-g++-12", "clang++-17", "/usr/bin/cc", "ninja"):
        assert allowed(name), name
    for name in ("python", "python3.11", "recserve", "torchrun", "locust", "tritonserver", "sh"):
        assert not allowed(name), name
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler on this machine")
    out = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True)
    assert out.stdout


@pytest.mark.multiproc
def test_a_marked_test_may_start_children() -> None:
    assert subprocess.run([sys.executable, "-c", "pass"], check=True).returncode == 0


def test_the_guard_fails_a_test_that_caught_the_error_and_covers_fixtures(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RECSERVE_CHILD_GUARD", raising=False)  # enforce, even in a survey run
    pytester.makeini(
        "[pytest]\nmarkers =\n    multiproc: starts more than one process\n"
        "    slow: takes more than a few seconds\n"
    )
    pytester.makeconftest('pytest_plugins = ["support.child_guard"]')
    pytester.makepyfile(
        """
        import subprocess, sys
        import pytest

        @pytest.fixture(scope="module")
        def server():
            return subprocess.Popen([sys.executable, "-c", "pass"])

        def test_swallows_the_error():
            try:
                subprocess.run([sys.executable, "-c", "pass"])
            except Exception:
                pass

        def test_fixture_starts_a_server(server):
            pass

        def test_in_process_only():
            assert sum(range(4)) == 6
        """
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1, errors=1)
    result.stdout.fnmatch_lines(["*test_swallows_the_error started a child process*multiproc*"])
    result.stdout.fnmatch_lines(["*test_fixture_starts_a_server started a child process*"])
