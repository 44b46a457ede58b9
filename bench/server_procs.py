"""The benchmarks' server processes: start one in its own process group with its output in a
log, wait for its ready line, stop it (SIGTERM, then SIGKILL for the group) -- and the real Triton
Inference Server (nvidia-pytriton's bundled ``tritonserver`` with our Python backend), started
as ``tests/serving/repository/test_tritonserver.py`` does."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


# ---- any server process ---------------------------------------------------------------------------
@dataclass
class Running:
    """A started server process (the leader of its own process group)."""

    proc: subprocess.Popen[bytes]
    log: Path
    address: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> Running:
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Running(proc, log)


def wait_for_line(run: Running, pattern: str, timeout_s: float) -> str:
    """The first group of ``pattern`` once it appears in the server's log."""
    until = time.monotonic() + timeout_s
    while time.monotonic() < until:
        if m := re.search(pattern, run.log.read_text(errors="replace")):
            return m.group(1)
        if run.proc.poll() is not None:
            raise RuntimeError(f"exited with {run.proc.returncode}:\n{run.log_tail()}")
        time.sleep(0.1)
    raise RuntimeError(f"not ready after {timeout_s:.0f} s:\n{run.log_tail()}")


def stop(run: Running, grace_s: float = 20.0) -> None:
    """SIGTERM the process group, SIGKILL it if still alive after ``grace_s``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(run.proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        run.proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):  # the leader or children that outlived it
        os.killpg(run.proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        run.proc.wait(timeout=10)


# ---- Triton ------------------------------
class Unavailable(RuntimeError):
    """A system that cannot run on this machine (the message says why)."""


def _pytriton_dir() -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable("nvidia-pytriton is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_triton(repo: Path, tmp: Path, log: Path) -> Running:
    """``tritonserver`` on ``repo`` with the bundled Python backend + this Python's stub."""
    pytriton = _pytriton_dir()
    dist = pytriton / "tritonserver"
    binary = dist / "bin" / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not binary.is_file() or not stub.is_file():
        raise Unavailable(f"no tritonserver binary or Python {version} stub under {dist}")
    backends = tmp / f"backends-{uuid.uuid4().hex[:6]}"
    shutil.copytree(dist / "backends", backends)
    shutil.copy2(stub, backends / "python" / "triton_python_backend_stub")
    env = dict(os.environ)
    libs = [str(sysconfig.get_config_var("LIBDIR")), str(pytriton.parent / "nvidia_pytriton.libs")]
    env["LD_LIBRARY_PATH"] = ":".join(libs + [p for p in [env.get("LD_LIBRARY_PATH")] if p])
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env["PYTHONPATH"] = ":".join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    grpc_port, http_port, metrics_port = _free_port(), _free_port(), _free_port()
    cmd = [
        str(binary),
        f"--model-repository={repo}",
        f"--backend-directory={backends}",
        "--http-address=127.0.0.1",
        "--grpc-address=127.0.0.1",
        "--metrics-address=127.0.0.1",
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
        "--disable-auto-complete-config",
        "--exit-timeout-secs=5",
        f"--backend-config=python,shm-region-prefix-name=bench{os.getpid()}_{uuid.uuid4().hex[:8]}",
    ]
    run = start(cmd, log, env)
    run.address = f"127.0.0.1:{grpc_port}"
    return run


def wait_triton(run: Running, model: str, timeout_s: float) -> None:
    """Until server and model are ready; records the model's instance groups and batching."""
    import tritonclient.grpc as grpcclient
    from google.protobuf.json_format import MessageToDict
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(run.address)
    until = time.monotonic() + timeout_s
    while True:
        if run.proc.poll() is not None:
            raise Unavailable(f"tritonserver exited with {run.proc.returncode}:\n{run.log_tail()}")
        with contextlib.suppress(InferenceServerException):
            if client.is_server_ready() and client.is_model_ready(model):
                break
        if time.monotonic() > until:
            raise Unavailable(f"tritonserver not ready after {timeout_s:.0f} s:\n{run.log_tail()}")
        time.sleep(0.25)
    cfg = MessageToDict(client.get_model_config(model).config)
    run.extra = {k: cfg.get(k) for k in ("instanceGroup", "dynamicBatching", "maxBatchSize")}
    client.close()


def triton_stats(address: str, model: str) -> dict[str, float]:
    """Triton's own account of the run: requests, executions (batches), and the mean time a
    request spent queued and in the backend (where a stall happened)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(address)
    st = client.get_inference_statistics(model).model_stats[0]
    client.close()
    n = max(st.inference_stats.success.count, 1)
    return {
        "inferences": st.inference_count,
        "executions": st.execution_count,
        "mean_queue_ms": st.inference_stats.queue.ns / n / 1e6,
        "mean_compute_input_ms": st.inference_stats.compute_input.ns / n / 1e6,
        "mean_compute_infer_ms": st.inference_stats.compute_infer.ns / n / 1e6,
        "mean_compute_output_ms": st.inference_stats.compute_output.ns / n / 1e6,
        "mean_request_ms": st.inference_stats.success.ns / n / 1e6,
    }


def processes_mentioning(marker: str) -> list[int]:
    """Pids of live processes whose command line contains ``marker`` (this run's temp paths)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker in cmdline and state != "Z":
            found.append(int(entry.name))
    return found
