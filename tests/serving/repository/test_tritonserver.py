"""The real Triton Inference Server (bundled by nvidia-pytriton) serves our repository, started
as ``serving/repository/tritonserver.py`` says."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from serving.repository.repository import ModelRepository
from serving.repository.tritonserver import TritonUnavailable, triton_launch

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]  # a real tritonserver process

MODEL = "demo"
USERS = np.arange(6)
_DTYPES = {np.dtype(np.int64): "INT64", np.dtype(np.float32): "FP32", np.dtype(np.int32): "INT32"}


@dataclass
class Triton:
    grpc_url: str
    http_url: str
    log: Path
    repo: ModelRepository

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


@pytest.fixture(scope="module")
def triton(tiny, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Triton]:
    tmp = tmp_path_factory.mktemp("triton")
    repo = ModelRepository(tmp / "repo")
    repo.publish(MODEL, tiny.build(7), parameters={"torch_threads": "1"})
    repo.publish(MODEL, tiny.model, parameters={"torch_threads": "1"})  # latest: Triton serves 2
    try:
        launch = triton_launch(repo.root, tmp)
    except TritonUnavailable as e:
        pytest.skip(str(e))
    cmd, grpc_port, http_port = launch.cmd, launch.grpc_port, launch.http_port
    log = tmp / "tritonserver.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, env=launch.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    server = Triton(f"127.0.0.1:{grpc_port}", f"127.0.0.1:{http_port}", log, repo)
    try:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"tritonserver exited with {proc.returncode}:\n{server.log_tail()}")
            try:
                if client.is_server_ready() and client.is_model_ready(MODEL):
                    break
            except InferenceServerException:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"tritonserver not ready after 120 s:\n{server.log_tail()}")
            time.sleep(0.2)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):  # backend stubs that outlived it
            os.killpg(proc.pid, signal.SIGKILL)


def _grpc_inputs(arrays: dict[str, np.ndarray]) -> list[grpcclient.InferInput]:
    out = []
    for name, a in arrays.items():
        t = grpcclient.InferInput(name, list(a.shape), _DTYPES.get(a.dtype, "BYTES"))
        t.set_data_from_numpy(a)
        out.append(t)
    return out


def test_grpc_answers_like_the_model_in_process(tiny, triton: Triton) -> None:
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    meta = client.get_model_metadata(MODEL)
    assert list(meta.versions) == ["2"]
    got = client.infer(MODEL, _grpc_inputs(tiny.inputs(USERS, k=10)))
    want_ids, want_scores = tiny.expected(tiny.model, USERS, 10)
    np.testing.assert_array_equal(got.as_numpy("item_ids"), want_ids)
    np.testing.assert_allclose(got.as_numpy("scores"), want_scores, rtol=1e-5, atol=1e-6)
    assert got.get_response().model_version == "2"


def test_grpc_filters_match(tiny, triton: Triton) -> None:
    filters = ["available", "", "not available", "available and language != 'en'", "", ""]
    arrays = tiny.inputs(USERS, k=8)
    arrays["filter"] = np.array([[f.encode()] for f in filters], dtype=object)
    got = grpcclient.InferenceServerClient(triton.grpc_url).infer(MODEL, _grpc_inputs(arrays))
    want = tiny.expected(tiny.model, USERS, 8, [f or None for f in filters])[0]
    np.testing.assert_array_equal(got.as_numpy("item_ids"), want)


def test_http_answers_like_the_model_in_process(tiny, triton: Triton) -> None:
    client = httpclient.InferenceServerClient(triton.http_url)
    inputs = []
    for name, a in tiny.inputs(USERS, k=5).items():
        t = httpclient.InferInput(name, list(a.shape), _DTYPES[a.dtype])
        t.set_data_from_numpy(a)
        inputs.append(t)
    got = client.infer(MODEL, inputs)
    np.testing.assert_array_equal(got.as_numpy("item_ids"), tiny.expected(tiny.model, USERS, 5)[0])


def test_concurrent_requests_are_batched_correctly(tiny, triton: Triton) -> None:
    client = grpcclient.InferenceServerClient(triton.grpc_url)

    def one(user: int) -> np.ndarray:
        k = 3 + user % 5
        got = client.infer(MODEL, _grpc_inputs(tiny.inputs(np.array([user]), k=k)))
        return got.as_numpy("item_ids")

    users = list(range(24))
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, users))
    for user, ids in zip(users, answers, strict=True):
        want = tiny.expected(tiny.model, np.array([user]), 3 + user % 5)[0]
        np.testing.assert_array_equal(ids, want)
    stats = client.get_inference_statistics(MODEL, "2").model_stats[0]
    assert stats.inference_count >= stats.execution_count  # several requests per execute: batched
    print(f"inferences {stats.inference_count}, executions {stats.execution_count}")


def test_bad_inputs_get_errors_naming_the_tensor(tiny, triton: Triton) -> None:
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    arrays = tiny.inputs(USERS[:2], k=10)
    with pytest.raises(InferenceServerException, match="k: must be in"):
        client.infer(MODEL, _grpc_inputs(dict(arrays, k=np.zeros((2, 1), np.int32))))
    bad_filter = np.array([[b"colour = red"], [b""]], dtype=object)
    with pytest.raises(InferenceServerException, match="filter: unknown attribute 'colour'"):
        client.infer(MODEL, _grpc_inputs(dict(arrays, filter=bad_filter)))
    missing = {k: v for k, v in arrays.items() if k != "categorical"}
    with pytest.raises(InferenceServerException, match="categorical"):
        client.infer(MODEL, _grpc_inputs(missing))  # Triton's own check
    assert client.is_model_ready(MODEL)


def test_versions_still_verify_after_triton_loaded_them(triton: Triton) -> None:
    """The stub's import of model.py may leave __pycache__/ in the version; it is not 'extra'."""
    assert triton.repo.load(MODEL).version == 2
