"""The real Triton Inference Server (bundled by nvidia-pytriton) on one of our repositories.

Every version carries a Triton Python backend ``model.py``, so Triton serves a repository
unchanged. :func:`triton_launch` first repairs each model-level ``config.pbtxt`` that a killed
publish left behind its latest version (``ModelRepository.repair_config``), then builds what
runs it::

    LD_LIBRARY_PATH=<libpython dir>:<site-packages>/nvidia_pytriton.libs \\
    PATH=<venv>/bin:$PATH PYTHONPATH=<recserve checkout> \\
    <site-packages>/pytriton/tritonserver/bin/tritonserver --model-repository=<repo> \\
        --backend-directory=<tmp>/backends --http-address=127.0.0.1 --grpc-address=127.0.0.1 \\
        --metrics-address=127.0.0.1 --http-port=P --grpc-port=P --metrics-port=P \\
        --disable-auto-complete-config --exit-timeout-secs=5 \\
        --backend-config=python,shm-region-prefix-name=<unique>

``<tmp>/backends/python`` holds the bundled Python backend plus the stub built for this Python
version (pytriton ships one stub per version and assembles that folder the same way). Used by
the Triton test (``tests/serving/repository/test_tritonserver.py``) and ``bench/serving.py``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import sys
import sysconfig
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The recserve checkout: the Python backend stub imports ``serving`` and ``retrieval``."""


class TritonUnavailable(RuntimeError):
    """No tritonserver can run here (the message says why)."""


@dataclass(frozen=True)
class TritonLaunch:
    """A ready-to-run ``tritonserver`` on 127.0.0.1: ``Popen(cmd, env=env)``."""

    cmd: list[str]
    env: dict[str, str]
    grpc_port: int
    http_port: int
    metrics_port: int


def triton_launch(repo: Path, tmp: Path, prefix: str = "recserve") -> TritonLaunch:
    """``tritonserver`` serving ``repo`` on free loopback ports, its backends assembled under
    ``tmp``; ``prefix`` starts its shared-memory names. Raises :class:`TritonUnavailable`."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TritonUnavailable("nvidia-pytriton is not installed")
    pytriton = Path(next(iter(spec.submodule_search_locations)))
    dist = pytriton / "tritonserver"
    binary = dist / "bin" / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not binary.is_file() or not stub.is_file():
        raise TritonUnavailable(f"no tritonserver binary or Python {version} stub under {dist}")
    from serving.repository.repository import ModelRepository

    models = ModelRepository(repo)
    for name in models.models():  # Triton reads the model-level config: heal a killed publish's
        models.repair_config(name)
    backends = tmp / f"backends-{uuid.uuid4().hex[:6]}"
    shutil.copytree(dist / "backends", backends)
    shutil.copy2(stub, backends / "python" / "triton_python_backend_stub")
    env = dict(os.environ)
    libs = [str(sysconfig.get_config_var("LIBDIR")), str(pytriton.parent / "nvidia_pytriton.libs")]
    env["LD_LIBRARY_PATH"] = ":".join(libs + [p for p in [env.get("LD_LIBRARY_PATH")] if p])
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"  # the stub's python3
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
        f"--backend-config=python,shm-region-prefix-name={prefix}{os.getpid()}_{uuid.uuid4().hex[:8]}",
    ]
    return TritonLaunch(cmd, env, grpc_port, http_port, metrics_port)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
