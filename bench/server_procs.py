"""The benchmarks' server processes: start one in its own process group with its output in a
log, wait for its ready line, stop it (SIGTERM, then SIGKILL for the group) -- and the real Triton
Inference Server (nvidia-pytriton's bundled ``tritonserver`` with our Python backend), started
as ``tests/serving/repository/test_tritonserver.py`` does."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
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


def start_triton(repo: Path, tmp: Path, log: Path) -> Running:
    """``tritonserver`` on ``repo`` (``serving/repository/tritonserver.py``)."""
    from serving.repository.tritonserver import TritonUnavailable, triton_launch

    try:
        launch = triton_launch(repo, tmp, prefix="bench")
    except TritonUnavailable as e:
        raise Unavailable(str(e)) from None
    run = start(launch.cmd, log, launch.env)
    run.address = f"127.0.0.1:{launch.grpc_port}"
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
