"""Kernel builds: one folder per key (sources, flags, toolchain; never the checkout's path), a
build lock the OS releases when its holder dies, a bounded wait, and SIGTERM honoured while a
process waits for the lock or builds.

The extension is a one-function module written by the test (the Python C API only, so a build
takes about a second), built through torch's loader like our kernels. The compiler is a
wrapper ``c++`` that logs every compile and link (proof that a load ran no compiler) and, while the file
``slow`` exists beside it, waits before compiling (a build to interrupt mid-way)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from common.config import ConfigError
from common.cpp_extension import (
    BuildLockTimeout,
    KernelBuild,
    load_extension,
    lock_timeout_s,
    plan_build,
)

REPO = Path(__file__).resolve().parents[2]
NAME = "recserve_test_tiny"
WAIT_S = 60.0  # a child's start (torch import) on a busy machine; not a bound that is tested

TINY = """\
#include <Python.h>
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define STR_(a) #a
#define STR(a) STR_(a)
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(ANSWER); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, "ANSWER"}, {0, 0, 0, 0}};
static PyModuleDef def = {PyModuleDef_HEAD_INIT, STR(TORCH_EXTENSION_NAME), 0, -1, methods};
PyMODINIT_FUNC CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&def); }
"""

WRAPPER = """\
#!/bin/sh
case " $* " in *" -o "*) ;; *) exec {cxx} "$@";; esac  # not a compile or link: a probe
echo "$$ $*" >> {dir}/compiles.log
while [ -e {dir}/slow ]; do sleep 0.05; done
exec {cxx} "$@"
"""

CHILD = """\
import signal, sys
from pathlib import Path
from common.cpp_extension import load_extension
from common.stop_signals import exit_on_signals

exit_on_signals(signal.SIGTERM, signal.SIGINT)  # as serve_until_signal does around start()
module = load_extension(sys.argv[1], Path(sys.argv[2]))
print(module.__file__, module.answer(), flush=True)
signal.pause()
"""


@pytest.fixture
def kit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``tmp_path`` with ``tool/c++`` (the wrapper, as ``$CXX``), ``a/tiny.cpp`` and a build root
    (``$RECSERVE_BUILD_DIR``) of its own."""
    tool = tmp_path / "tool"
    tool.mkdir()
    cxx = tool / "c++"
    real = shutil.which("c++") or "c++"
    cxx.write_text(WRAPPER.format(cxx=real, dir=tool))
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("RECSERVE_BUILD_DIR", str(tmp_path / "builds"))
    write_source(tmp_path / "a", 42)
    yield tmp_path


def write_source(folder: Path, answer: int) -> Path:
    folder.mkdir(exist_ok=True)
    path = folder / "tiny.cpp"
    path.write_text(TINY.replace("ANSWER", str(answer)))
    return path


def compiles(kit: Path) -> list[str]:
    log = kit / "tool" / "compiles.log"
    return log.read_text().splitlines() if log.exists() else []


def plan(kit: Path, checkout: str = "a") -> KernelBuild:
    return plan_build(NAME, kit / checkout / "tiny.cpp", ("-O3",), ())


def start_child(kit: Path, checkout: str = "a") -> subprocess.Popen[str]:
    """A process that loads the tiny kernel as a server's start does (SIGTERM ends it), prints
    ``<library> <answer>`` and waits for a signal; stderr to ``kit/child.err``."""
    script = kit / "child.py"
    script.write_text(CHILD)
    err = (kit / "child.err").open("a")
    argv = [sys.executable, str(script), NAME, str(kit / checkout / "tiny.cpp")]
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True,
                            start_new_session=True)  # fmt: skip


def wait_for(what: str, check: Callable[[], object], timeout: float = WAIT_S) -> None:
    until = time.monotonic() + timeout
    while not check():
        if time.monotonic() > until:
            raise TimeoutError(f"no {what} within {timeout} s")  # child.err says why
        time.sleep(0.05)


def kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL to the child's process group (its build tools too, orphans included)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


@contextlib.contextmanager
def holding_lock(build: KernelBuild, pid: int) -> Iterator[None]:
    """Holds ``build``'s lock as another builder would, with ``pid`` written in it."""
    build.folder.mkdir(parents=True, exist_ok=True)
    with build.lock_file.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(f"{pid}\n")
        f.flush()
        yield


def test_the_key_follows_sources_flags_and_compiler_not_the_checkout(kit, monkeypatch):
    a = plan(kit)
    shutil.copytree(kit / "a", kit / "b")
    assert plan(kit, "b") == a  # another checkout, same bytes: the same folder
    assert a.folder.parent == kit / "builds" and a.folder.name == f"{NAME}-{a.key}"
    assert a.module == f"{NAME}_{a.key}"  # unique per key: one process may hold two builds

    write_source(kit / "b", 43)
    others = [
        plan(kit, "b"),
        plan_build(NAME, kit / "a" / "tiny.cpp", ("-O2",), ()),
        plan_build(NAME, kit / "a" / "tiny.cpp", ("-O3",), ("-lm",)),
    ]
    monkeypatch.setenv("CXX", shutil.which("c++") or "c++")
    others.append(plan(kit))
    assert len({a.key, *(o.key for o in others)}) == 5


SPLIT_HEADER = "#pragma once\n#define ANSWER_BASE {base}\nlong answer_value();\n"
SPLIT_VALUE = '#include "tiny.h"\nlong answer_value() { return ANSWER_BASE + 2; }\n'


def write_split_source(folder: Path, base: int) -> Path:
    """The tiny kernel as a folder: ``main.cpp`` (the module) calls ``value.cpp``'s function,
    whose constant comes from the header ``tiny.h``."""
    folder.mkdir(exist_ok=True)
    main = TINY.replace("ANSWER", "answer_value()").replace("#include <Python.h>",
                                                            '#include <Python.h>\n#include "tiny.h"')  # fmt: skip
    (folder / "main.cpp").write_text(main)
    (folder / "value.cpp").write_text(SPLIT_VALUE)
    (folder / "tiny.h").write_text(SPLIT_HEADER.format(base=base))
    return folder


def test_a_folder_compiles_every_cpp_into_one_module_keyed_by_every_file(kit):
    """A kernel of several files is its folder: every ``.cpp`` is compiled into one module, and
    the key covers every file in it (a header, an added file, a rename), never its path."""
    split = write_split_source(kit / "split", 40)
    first = plan_build(NAME, split, ("-O3",), ())
    module = load_extension(NAME, split)
    assert module.answer() == 42
    compiled = [line for line in compiles(kit) if " -c " in f" {line} "]
    assert sorted(Path(line.split(" -c ")[1].split()[0]).name for line in compiled) == [
        "main.cpp",
        "value.cpp",
    ]
    shutil.copytree(split, kit / "copy")
    assert plan_build(NAME, kit / "copy", ("-O3",), ()).key == first.key  # another checkout

    keys = {first.key}
    write_split_source(kit / "copy", 41)  # the header alone changed
    keys.add(plan_build(NAME, kit / "copy", ("-O3",), ()).key)
    (kit / "copy" / "extra.h").write_text("#pragma once\n")  # a file added
    keys.add(plan_build(NAME, kit / "copy", ("-O3",), ()).key)
    (kit / "copy" / "value.cpp").rename(kit / "copy" / "value2.cpp")  # a file renamed
    keys.add(plan_build(NAME, kit / "copy", ("-O3",), ()).key)
    assert len(keys) == 4

    (kit / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"holds no \.cpp file"):
        load_extension(NAME, kit / "empty")


def test_a_failed_build_is_built_again_on_the_next_load_in_the_process(kit):
    """A build that fails (here a compile error; in a test, a timeout mid-build) is tried again by
    the next load of the same sources in the same process: torch's loader, left alone, would
    skip the build it thinks done and import a library that was never written."""
    broken = kit / "a" / "tiny.cpp"
    broken.write_text(TINY.replace("ANSWER", "not_declared"))
    for _ in range(2):
        with pytest.raises(RuntimeError, match="Error building extension"):
            load_extension(NAME, broken)
    assert len([line for line in compiles(kit) if " -c " in f" {line} "]) == 2  # built twice


def test_a_lock_held_too_long_names_the_lock_file_and_its_holder(kit, monkeypatch):
    monkeypatch.setenv("RECSERVE_BUILD_LOCK_TIMEOUT_S", "0.3")
    build = plan(kit)
    with holding_lock(build, 4242), pytest.raises(BuildLockTimeout) as err:
        load_extension(NAME, kit / "a" / "tiny.cpp")
    assert str(build.lock_file) in str(err.value) and "pid 4242" in str(err.value)
    assert compiles(kit) == []


@pytest.mark.parametrize("raw", ["soon", "-1", "nan", "1e9"])
def test_a_bad_lock_timeout_is_refused_by_name(monkeypatch, raw):
    monkeypatch.setenv("RECSERVE_BUILD_LOCK_TIMEOUT_S", raw)
    with pytest.raises(ConfigError, match="RECSERVE_BUILD_LOCK_TIMEOUT_S"):
        lock_timeout_s()


@pytest.mark.slow
def test_a_second_checkout_loads_the_first_build_without_compiling(kit):
    first = load_extension(NAME, kit / "a" / "tiny.cpp")
    built = compiles(kit)
    assert first.answer() == 42 and built  # the wrapper compiled it
    assert Path(first.__file__) == plan(kit).library
    assert (plan(kit).folder / "key.json").exists()

    shutil.copytree(kit / "a", kit / "b")
    second = load_extension(NAME, kit / "b" / "tiny.cpp")
    assert Path(second.__file__) == Path(first.__file__) and second.answer() == 42
    assert compiles(kit) == built  # no compiler ran

    changed = load_extension(NAME, write_source(kit / "c", 7))
    assert changed.answer() == 7 and first.answer() == 42  # both loaded in one process
    assert Path(changed.__file__).parent != Path(first.__file__).parent


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("killed", ["builder", "builder and its tools"])
def test_a_builder_killed_mid_build_does_not_block_the_next(kit, killed):
    """SIGKILL leaves torch's lock file behind (and, when only the builder dies, its ninja and
    compilers running on): the next build neither hangs nor races them."""
    slow = kit / "tool" / "slow"
    slow.touch()
    build = plan(kit)
    victim = start_child(kit)
    try:
        wait_for("compile", lambda: compiles(kit))
        assert (build.folder / "lock").exists()  # torch's lock, which a dead builder leaves
        if killed == "builder":
            os.kill(victim.pid, signal.SIGKILL)
            victim.wait(10)
        else:
            kill_group(victim)
        nxt = start_child(kit)
        try:
            if killed == "builder":  # its tools still compile: the next build waits for them
                err = kit / "child.err"
                wait_for("wait", lambda: "left by an ended build" in err.read_text())
            slow.unlink()
            assert nxt.stdout is not None
            line = nxt.stdout.readline().split()  # a hang fails here, at pytest's timeout
            assert line == [str(build.library), "42"], (kit / "child.err").read_text()
        finally:
            kill_group(nxt)
    finally:
        slow.unlink(missing_ok=True)
        kill_group(victim)


@pytest.mark.slow
@pytest.mark.multiproc
def test_sigterm_ends_a_wait_for_the_build_lock(kit):
    build = plan(kit)
    err = kit / "child.err"
    with holding_lock(build, os.getpid()):
        proc = start_child(kit)
        try:
            wait_for("wait", lambda: err.exists() and "waiting for pid" in err.read_text())
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(5) == 128 + signal.SIGTERM
        finally:
            kill_group(proc)
    assert compiles(kit) == []


@pytest.mark.slow
@pytest.mark.multiproc
def test_sigterm_ends_a_build_and_its_compilers(kit):
    slow = kit / "tool" / "slow"
    slow.touch()
    build = plan(kit)
    proc = start_child(kit)
    try:
        wait_for("compile", lambda: compiles(kit))
        compiler = int(compiles(kit)[0].split()[0])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(5) == 128 + signal.SIGTERM
        wait_for("compiler's end", lambda: not alive(compiler), timeout=5)
        assert not (build.folder / "lock").exists() and not build.done_file.exists()
    finally:
        slow.unlink(missing_ok=True)
        kill_group(proc)


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie awaiting its reaper does not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def test_the_native_kernels_compile_for_a_cpu_without_avx512(tmp_path):
    """The kernels built with ``-march=native`` compile for an AVX2-only CPU (``-march=haswell``,
    at -O0, in parallel): their AVX-512 code sits in target-attributed functions or behind the
    build's macros. A lambda inside a target-attributed function does not inherit the target,
    and once broke exactly this build (an AVX-512 machine never noticed). The index's two
    kernels are also built that way and tested (``tests/retrieval/index/test_avx2_only_build.py``);
    this compile keeps the table kernel's check cheap."""
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    root = Path(__file__).resolve().parents[2]
    sources = [root / "sharded_tables/csrc/pooled_lookup.cpp"]
    includes = [f"-I{p}" for p in (*include_paths(), sysconfig.get_paths()["include"])]
    flags = ["-std=c++17", "-O0", "-march=haswell", "-fopenmp", "-DTORCH_EXTENSION_NAME=t"]
    builds = [
        subprocess.Popen(
            ["c++", *flags, *includes, "-c", str(src), "-o", str(tmp_path / f"{src.stem}.o")],
            stderr=subprocess.PIPE,
            text=True,
        )
        for src in sources
    ]
    for src, build in zip(sources, builds, strict=True):
        _, err = build.communicate(timeout=300)
        errors = [line for line in err.splitlines() if "error" in line]
        assert build.returncode == 0, f"{src.name}: {errors[:3]}"


def test_a_kernel_march_replaces_native_and_a_bad_one_is_refused(monkeypatch):
    from common.cpp_extension import MARCH_ENV, _marched

    flags = ("-O3", "-march=native", "-fopenmp")
    monkeypatch.delenv(MARCH_ENV, raising=False)
    assert _marched(flags) == flags
    monkeypatch.setenv(MARCH_ENV, "x86-64-v3")
    assert _marched(flags) == ("-O3", "-march=x86-64-v3", "-fopenmp")
    assert (
        plan_build("k", Path(__file__), _marched(flags), ()).key
        != plan_build("k", Path(__file__), flags, ()).key
    )  # its own build folder
    monkeypatch.setenv(MARCH_ENV, "haswell -fno-fast")
    with pytest.raises(ConfigError, match="RECSERVE_KERNEL_MARCH='haswell -fno-fast'"):
        _marched(flags)
