"""The demo's serving step: publish -> start the server -> Recommend and tritonclient calls.

The server runs in this process on free 127.0.0.1 ports (``recserve serve`` runs the same
``Server`` as a process); the calls go over real gRPC sockets.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import tritonclient.grpc as triton
from rich.console import Console

from retrieval.model import RetrievalModel
from retrieval.training.prepare import Prepared
from serving.config import ServeConfig
from serving.main import Server
from serving.recommend_pb2 import RecommendRequest
from serving.recommend_pb2_grpc import RecommenderStub
from serving.repository import ModelRepository
from serving.requests import DATATYPES


def serve_and_query(
    model: RetrievalModel,
    prep: Prepared,
    repo_dir: Path,
    name: str,
    user: int,
    flt: str | None,
    console: Console,
    k: int = 10,
) -> list[int]:
    """Publishes ``model``, serves it, asks for ``user``'s top-``k`` twice; returns the ids."""
    repo = ModelRepository(repo_dir)
    version = repo.publish(name, model)
    console.print(f"published {name} v{version} to {repo.version_dir(name, version)}")
    server = Server(ServeConfig(model_repo=repo_dir, model=name, grpc_port=0, poll_s=0.0))
    addresses = server.start()
    console.print(server.announce_line())
    try:
        batch = prep.user_batch(np.array([user]))
        history = batch.history[0][batch.history[0] >= 0].tolist()
        categorical = batch.categorical[0].tolist()
        dense = batch.dense[0].tolist()
        with grpc.insecure_channel(addresses.grpc) as channel:
            reply = RecommenderStub(channel).Recommend(
                RecommendRequest(
                    user_id=str(user),
                    history=history,
                    categorical=categorical,
                    dense=dense,
                    k=k,
                    filter=flt or "",
                ),
                timeout=10.0,
            )
        console.print(
            f"Recommend(user {user}, k={k}, filter={flt!r}) -> {name} v{reply.version}: "
            f"{list(reply.item_ids)}"
        )
        client = triton.InferenceServerClient(addresses.grpc)
        inputs = []
        for tensor, values in (
            ("history", np.array([history], dtype=np.int64)),
            ("categorical", np.array([categorical], dtype=np.int64)),
            ("dense", np.array([dense], dtype=np.float32)),
            ("k", np.array([[k]], dtype=np.int32)),
        ):
            inputs.append(triton.InferInput(tensor, list(values.shape), DATATYPES[tensor]))
            inputs[-1].set_data_from_numpy(values)
        result = client.infer(name, inputs)
        ids = result.as_numpy("item_ids")[0].tolist()
        console.print(f"tritonclient ModelInfer(user {user}, k={k}) -> {ids}")
        client.close()
        return ids
    finally:
        server.drain_and_stop(timeout=10.0)
