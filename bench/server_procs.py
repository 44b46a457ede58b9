"""The benchmarks' server processes: start one in its own process group with its output in a
log, wait for its ready line, stop it (SIGTERM, then SIGKILL for the group), all through the one
launcher (``common/process.py``) -- and the real Triton
Inference Server (nvidia-pytriton's bundled ``tritonserver`` with our Python backend), started
as ``tests/serving/repository/test_tritonserver.py`` does."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import process
from common.process import Proc
from common.ready import ReadyLine

ROOT = Path(__file__).resolve().parents[1]


# ---- any server process ---------------------------------------------------------------------------
@dataclass
class Running:
    """A started server process (``common/process.py``, the leader of its own process group)."""

    proc: Proc
    address: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def log(self) -> Path:
        return self.proc.log_path

    def log_tail(self, n: int = 30) -> str:
        return self.proc.tail(n)


def start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> Running:
    """Starts ``cmd`` in its own process group, its output in ``log``."""
    return Running(process.start(cmd, log_path=log, env=env, cwd=ROOT, new_session=True))


def wait_ready(run: Running, timeout_s: float) -> ReadyLine:
    """The server's ready line (``common/ready.py``); records its gRPC address. ``RuntimeError``
    with the log's tail when it exits first or is not ready in time."""
    ready = run.proc.wait_ready(timeout_s)
    run.address = ready.grpc or ""
    return ready


def stop(run: Running, grace_s: float = 20.0) -> None:
    """SIGTERM the process group, SIGKILL it if still alive after ``grace_s``."""
    run.proc.stop(grace_s)


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
        if not run.proc.alive():
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
