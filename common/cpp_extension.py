"""Build-once loading of this project's C++ extensions: torch's loader, one folder per build key,
our own lock.

Where a kernel builds: ``<root>/<name>-<key>``, with ``root`` = ``$RECSERVE_BUILD_DIR`` (default
``~/.cache/recserve``) and ``key`` = 16 hex digits of a SHA-256 over everything the binary
depends on: the source's bytes (an extension of several files is a folder: the bytes and names of
every file in it, headers included), the compiler flags, the torch and Python versions, the compiler
(``$CXX`` or ``c++``, and the first line of its ``--version``) and the machine (with its CPU
flags when the flags say ``-march=native``). Same inputs, same folder: a second checkout of the
same sources loads the first one's build without compiling; a changed source builds into a new
folder (old folders are never touched; delete them by hand). The module is named
``<name>_<key>``, so one process may hold two builds of one extension (torch refuses to load two
modules of one name).

How it builds: at most once per key, under ``fcntl.flock`` on ``<folder>/build.lock``, a lock the
OS releases when its holder dies, even by SIGKILL. The holder writes its pid into that file, so a
process that waits longer than ``$RECSERVE_BUILD_LOCK_TIMEOUT_S`` (default 600 s) gets an error
naming the file and the pid. Under the lock, two leftovers of a builder killed mid-build are
cleared before building: torch's own lock file ``<folder>/lock`` (torch waits forever while it
exists; only a flock holder builds this key, so a leftover one is stale) and the build tools
the killed builder started (ninja and its compilers outlive it: they are waited for). A finished
build leaves ``<folder>/key.json`` (what the key hashes); with it, loading takes no lock and
runs no compiler.

Signals: neither the wait nor the build blocks them. A SIGTERM handler that raises (see
``common.grpc_util.exit_on_signals``) ends both at once; a build ended so also stops the
compilers it started.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import json
import logging
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from common.config import MAX_WAIT_S, ConfigError

BUILD_DIR_ENV = "RECSERVE_BUILD_DIR"
"""Root of the build folders; default ``~/.cache/recserve``."""
MARCH_ENV = "RECSERVE_KERNEL_MARCH"
"""Compiles the kernels for this CPU level in place of the building machine's own
(``-march=native``): ``x86-64-v3`` (AVX2) for hosts whose oldest CPU has no AVX-512, or
``haswell`` to test an AVX2-only build on an AVX-512 machine. Read at a kernel's first load in a
process; a level changes the build key (its own folder)."""
LOCK_TIMEOUT_ENV = "RECSERVE_BUILD_LOCK_TIMEOUT_S"
"""Longest wait, in seconds, for another process's build of the same kernel."""
DEFAULT_LOCK_TIMEOUT_S = 600.0
"""A build takes about a minute; ten leave room for a busy machine building all four."""
KEY_FORMAT = 1
"""Hashed into every key: bump it when the way we build changes what a folder holds."""

_POLL_S = 0.1  # lock and leftover polls: short sleeps keep the main thread responsive to signals

log = logging.getLogger(__name__)
_lock = threading.Lock()
_loaded: dict[tuple[Any, ...], ModuleType] = {}


class BuildLockTimeout(TimeoutError):
    """Another process held a kernel's build lock (or its build tools still ran) for longer than
    the lock timeout; the message names the lock file and the holder's pid."""


@dataclass(frozen=True)
class KernelBuild:
    """Where and as what one extension builds (:func:`plan_build`)."""

    name: str
    """The extension's name, as the caller gives it (``recserve_ivf_scan``)."""
    key: str
    """16 hex digits of the SHA-256 of :attr:`inputs`."""
    folder: Path
    """``<root>/<name>-<key>``: build files, ``build.lock``, ``key.json``, the library."""
    inputs: dict[str, Any]
    """Everything the key hashes (written to ``key.json`` once built)."""

    @property
    def module(self) -> str:
        """The Python module's name, unique per key: ``<name>_<key>``."""
        return f"{self.name}_{self.key}"

    @property
    def library(self) -> Path:
        return self.folder / f"{self.module}.so"

    @property
    def lock_file(self) -> Path:
        return self.folder / "build.lock"

    @property
    def done_file(self) -> Path:
        return self.folder / "key.json"


def load_extension(
    name: str, source: Path, cflags: tuple[str, ...] = ("-O3",), ldflags: tuple[str, ...] = ()
) -> ModuleType:
    """The compiled module ``name`` built from ``source``, one C++ file or a folder whose
    ``*.cpp`` files compile into one module (built on first use of its key, thread-safe; later
    calls in the process are one dict lookup: kernels call this per op)."""
    module = _loaded.get((name, source, cflags, ldflags))  # the per-op path: no Path built
    if module is not None:
        return module
    args = (name, Path(source), _marched(cflags), tuple(ldflags))
    with _lock:
        if args not in _loaded:
            _loaded[args] = _load(plan_build(*args), *args[1:])
        _loaded[(name, source, cflags, ldflags)] = _loaded[args]
        return _loaded[args]


def _marched(cflags: Sequence[str]) -> tuple[str, ...]:
    """``cflags`` with ``-march=native`` replaced by ``$RECSERVE_KERNEL_MARCH``'s level, if set."""
    march = os.environ.get(MARCH_ENV, "").strip()
    if not march or march == "native":
        return tuple(cflags)
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", march):
        raise ConfigError(f"{MARCH_ENV}={march!r}: write a GCC -march level such as x86-64-v3")
    return tuple(f"-march={march}" if f == "-march=native" else f for f in cflags)


def plan_build(
    name: str, source: Path, cflags: Sequence[str], ldflags: Sequence[str], root: Path | None = None
) -> KernelBuild:
    """Where ``name`` built from ``source`` with these flags builds (nothing is built): the
    folder depends on the source's bytes, never on its path."""
    import torch

    inputs = {
        "format": KEY_FORMAT,
        "source_sha256": source_digest(Path(source)),
        "cflags": list(cflags),
        "ldflags": list(ldflags),
        "torch": torch.__version__,
        "python": sys.version,
        "compiler": compiler_id(os.environ.get("CXX", "c++")),
        "machine": machine_id(cflags),
    }
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    folder = (root or build_root()) / f"{name}-{key}"
    return KernelBuild(name, key, folder, inputs)


def source_digest(source: Path) -> str:
    """SHA-256 of a source file's bytes; of a folder, over the relative path and the bytes' hash
    of every file under it, in path order: a header, an added or a renamed file changes it."""
    if not source.is_dir():
        return hashlib.sha256(source.read_bytes()).hexdigest()
    digest = hashlib.sha256()
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        content = hashlib.sha256(path.read_bytes()).hexdigest()
        digest.update(f"{path.relative_to(source).as_posix()}\0{content}\n".encode())
    return digest.hexdigest()


def compiled_sources(source: Path) -> list[str]:
    """The files the compiler is given: ``source`` itself, or a folder's ``*.cpp`` (the headers
    they include are read through them)."""
    if not source.is_dir():
        return [str(source)]
    sources = sorted(str(p) for p in source.glob("*.cpp"))
    if not sources:
        raise FileNotFoundError(f"kernel source folder {source} holds no .cpp file")
    return sources


def build_root() -> Path:
    """``$RECSERVE_BUILD_DIR``, else ``~/.cache/recserve``."""
    return Path(os.environ.get(BUILD_DIR_ENV) or Path.home() / ".cache" / "recserve")


def lock_timeout_s() -> float:
    """``$RECSERVE_BUILD_LOCK_TIMEOUT_S`` (default 600); ConfigError naming it when bad."""
    raw = os.environ.get(LOCK_TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_LOCK_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 <= value <= MAX_WAIT_S:  # NaN fails too
        raise ConfigError(f"{LOCK_TIMEOUT_ENV}: must be seconds, 0 to {MAX_WAIT_S:g}, got {raw!r}")
    return value


@functools.cache
def compiler_id(cxx: str) -> str:
    """``cxx`` and the first line of its ``--version`` (what torch's build runs: ``$CXX`` or
    ``c++``). A compiler that does not run is left for torch's build to report."""
    try:
        out = subprocess.run(
            [*shlex.split(cxx), "--version"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    return f"{cxx}: {(out.splitlines() or ['?'])[0]}"


def machine_id(cflags: Sequence[str]) -> str:
    """The architecture, and with ``-march=native`` the CPU's feature flags: a build for one CPU
    must not be loaded by another sharing the cache (a home folder on NFS)."""
    machine = platform.machine()
    if not any(f.startswith("-march=native") or f == "-mcpu=native" for f in cflags):
        return machine
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return f"{machine} {line.split(':', 1)[1].strip()}"
    return f"{machine} {platform.processor()}"


def _load(
    build: KernelBuild, source: Path, cflags: tuple[str, ...], ldflags: tuple[str, ...]
) -> ModuleType:
    """The module of ``build``: imported when built, else built under the lock first."""
    if build.done_file.exists():
        return _import(build)
    build.folder.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + lock_timeout_s()
    with _build_lock(build, deadline):
        if build.done_file.exists():  # another process built it while we waited
            return _import(build)
        return _build(build, source, cflags, ldflags, deadline)


def _import(build: KernelBuild) -> ModuleType:
    """Imports the built library (torch first: the library links against libtorch)."""
    import torch  # noqa: F401

    spec = importlib.util.spec_from_file_location(build.module, build.library)
    if spec is None or spec.loader is None:
        raise ImportError(f"kernel {build.name}: cannot load {build.library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _build_lock(build: KernelBuild, deadline: float) -> Iterator[None]:
    """Holds ``build.lock`` (flock: released by the OS when this process dies), with our pid
    written in it; :class:`BuildLockTimeout` past ``deadline``."""
    fd = os.open(build.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        said = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            holder = _holder(build.lock_file)
            if time.monotonic() >= deadline:
                raise BuildLockTimeout(
                    f"kernel {build.name}: timed out waiting for the build lock "
                    f"{build.lock_file}, held by {holder} (a build takes about a minute; set "
                    f"{LOCK_TIMEOUT_ENV} to wait longer)"
                )
            if not said:
                log.warning("kernel %s: waiting for %s to build it (lock %s)",
                            build.name, holder, build.lock_file)  # fmt: skip
                said = True
            time.sleep(_POLL_S)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock


def _holder(lock_file: Path) -> str:
    try:
        pid = lock_file.read_text().strip()
    except OSError:
        pid = ""
    return f"pid {pid}" if pid.isdigit() else "a process that has not written its pid yet"


def _build(
    build: KernelBuild,
    source: Path,
    cflags: tuple[str, ...],
    ldflags: tuple[str, ...],
    deadline: float,
) -> ModuleType:
    """Builds and imports ``build`` (the caller holds its lock), then marks it done."""
    from torch.utils.cpp_extension import load

    _wait_for_leftovers(build, deadline)
    # torch's lock file: only a flock holder builds this key, so one that exists now was left by
    # a builder that died; torch would wait for it forever
    (build.folder / "lock").unlink(missing_ok=True)
    log.warning("building kernel %s (first use, ~1 min) in %s", build.name, build.folder)
    try:
        module = load(
            name=build.module,
            sources=compiled_sources(Path(source)),
            extra_cflags=list(cflags),
            extra_ldflags=list(ldflags),
            build_directory=str(build.folder),
            verbose=False,
        )
    except BaseException:
        _stop_leftovers(build)  # an ended build (SIGTERM) takes its compilers with it
        _forget_attempt(build)
        raise
    tmp = build.done_file.with_suffix(".tmp")
    tmp.write_text(json.dumps({"module": build.module, **build.inputs}, indent=1) + "\n")
    os.replace(tmp, build.done_file)
    return module


def _forget_attempt(build: KernelBuild) -> None:
    """Makes torch's loader build ``build`` again on the next try in this process. It records
    each module's sources when it starts building them, and a second load of the same sources
    skips the build and imports the library, which a failed or interrupted build (a timeout, a
    compile error) never wrote."""
    from torch.utils.cpp_extension import JIT_EXTENSION_VERSIONER

    JIT_EXTENSION_VERSIONER.entries.pop(build.module, None)


def _processes_in(folder: Path) -> list[int]:
    """Other processes whose working folder is ``folder``: the build tools (ninja, its shells and
    compilers) of a build there, which outlive a builder killed by SIGKILL. Linux's ``/proc``;
    elsewhere none are found."""
    target, found = os.path.realpath(folder), []
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                with contextlib.suppress(OSError):  # gone, a zombie, or not ours to read
                    if os.readlink(f"/proc/{entry}/cwd") == target:
                        found.append(int(entry))
    return found


def _wait_for_leftovers(build: KernelBuild, deadline: float) -> None:
    """Waits until no build tool of an earlier (killed) builder works in the folder: two ninjas
    writing one object file can leave a corrupt one that later builds take as up to date."""
    said = False
    while pids := _processes_in(build.folder):
        if time.monotonic() >= deadline:
            raise BuildLockTimeout(
                f"kernel {build.name}: processes {pids} still work in {build.folder} (build "
                f"tools of a builder that died?); lock {build.lock_file}"
            )
        if not said:
            log.warning("kernel %s: waiting for processes %s left by an ended build in %s",
                        build.name, pids, build.folder)  # fmt: skip
            said = True
        time.sleep(_POLL_S)


def _stop_leftovers(build: KernelBuild) -> None:
    """Kills the build tools this process started in the folder: torch's ``subprocess.run``
    kills ninja on an exception, not the compilers ninja started. Ours are those of our session
    (ninja gives each command a process group of its own), less its leader (a login shell)."""
    session = os.getsid(0)
    for _ in range(20):  # again while any is left: a compiler driver may have started one more
        ours = []
        for pid in _processes_in(build.folder):
            with contextlib.suppress(OSError):
                if pid != session and os.getsid(pid) == session:
                    os.kill(pid, signal.SIGKILL)
                    ours.append(pid)
        if not ours:
            return
        time.sleep(0.05)
