"""bench/serving.py's workload: the model, its data, the requests every system gets, and the
repository it is published into (with Triton's model instances)."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from bench_model import trained_model, user_inputs

from retrieval.filters import eligible
from retrieval.model import RetrievalModel
from retrieval.training.prepare import Prepared
from serving.protos import recommend_pb2

MODEL = "bench"

FILTERS: dict[str, str | None] = {
    "none": None,
    "50": "language in {en, fr} and available",
    "5": "language = es and age_rating = all and available",
    "0.5": "language = hi and age_rating = '16+' and available",
}
"""``--filter``: each request's eligibility filter by the share of the catalog (%) it is meant
to pass, over the synthetic catalog's independent attributes (``language`` 45 + 10 %,
``age_rating`` ``all`` 35 % / ``16+`` 12 %, ``available`` 90 %, ``retrieval/data/synthetic.py``);
the share each passes on the served catalog is measured (:meth:`Workload.passing`)."""


@dataclass
class Workload:
    """The model, its data, and the requests every system gets (one user per request)."""

    prep: Prepared
    model: RetrievalModel
    users: np.ndarray
    k: int
    filter: str | None = None
    """Every request's filter (None: unfiltered)."""

    def history(self, user: int) -> np.ndarray:
        """The user's recent items, newest first (pads dropped; ``[-1]`` when there are none)."""
        hist = user_inputs(self.prep, user)[0]
        return hist if len(hist) else np.array([-1], np.int64)

    def categorical(self, user: int) -> np.ndarray:
        return user_inputs(self.prep, user)[1]

    def dense(self, user: int) -> np.ndarray:
        return user_inputs(self.prep, user)[2]

    def recommend(self, user: int) -> bytes:
        """The serialized gRPC ``Recommend`` request of ``user``."""
        return recommend_pb2.RecommendRequest(
            user_id=str(user),
            history=self.history(user).tolist(),
            categorical=self.categorical(user).tolist(),
            dense=self.dense(user).tolist(),
            k=self.k,
            filter=self.filter or "",
        ).SerializeToString()

    def model_infer(self, user: int) -> bytes:
        """The serialized KServe v2 ``ModelInferRequest`` of ``user`` (one row, raw contents).
        History is -1-padded to the model's ``history_len`` so every request has the same shape:
        Triton's dynamic batcher stalls (~500 ms) on a queue of differently shaped requests."""
        from tritonclient.grpc import service_pb2

        req = service_pb2.ModelInferRequest(model_name=MODEL)
        hist = np.full((1, self.prep.config.history_len), -1, np.int64)  # -1 pads: one shape
        recent = self.history(user)[: hist.shape[1]]
        hist[0, : len(recent)] = recent
        tensors = {
            "history": ("INT64", hist),
            "categorical": ("INT64", self.categorical(user)[None, :]),
            "dense": ("FP32", self.dense(user)[None, :]),
            "k": ("INT32", np.array([[self.k]], np.int32)),
        }
        for name, (dtype, a) in tensors.items():
            req.inputs.add(name=name, datatype=dtype, shape=list(a.shape))
            req.raw_input_contents.append(np.ascontiguousarray(a).tobytes())
        if self.filter:  # BYTES [1, 1]: the text after its 4-byte little-endian length
            text = self.filter.encode()
            req.inputs.add(name="filter", datatype="BYTES", shape=[1, 1])
            req.raw_input_contents.append(len(text).to_bytes(4, "little") + text)
        for name in ("item_ids", "scores"):
            req.outputs.add(name=name)
        return req.SerializeToString()

    def payloads(self, protocol: str) -> list[bytes]:
        make = self.recommend if protocol == "recommend" else self.model_infer
        return [make(int(u)) for u in self.users]

    def expected_ids(self, users: np.ndarray) -> np.ndarray:
        """In-process ``model(batch, k)`` ids of ``users`` (one forward per user)."""
        filters = None if self.filter is None else [self.filter]
        schema = self.model.index.schema
        with torch.inference_mode():
            rows = [
                self.model(self.prep.user_batch(users[i : i + 1], filters, schema=schema), self.k)[
                    0
                ]
                for i in range(len(users))
            ]
        return torch.cat(rows).numpy()

    def passing(self) -> float:
        """The share of the served catalog the filter passes (1.0 unfiltered)."""
        if self.filter is None:
            return 1.0
        index = self.model.index
        fb = index.schema.compile([self.filter])
        return float(eligible(index.sig, fb.masks[0], fb.negate[0]).float().mean())


def build_workload(items: int, args: argparse.Namespace) -> tuple[Workload, float]:
    """The synthetic catalog and its model trained ``--epochs`` (``bench_model.trained_model``);
    returns the workload and build seconds."""
    t0 = time.perf_counter()
    prep, model = trained_model(args.users, items, args.epochs)
    work = Workload(prep, model, np.arange(args.request_users), args.k, FILTERS[args.filter])
    return work, time.perf_counter() - t0


def publish(work: Workload, root: Path, args: argparse.Namespace) -> Path:
    """Publishes the model as ``MODEL`` version 1 in a new repository at ``root``, with
    ``--processes`` model instances for Triton (``instance_group``: one Python backend stub
    process each), each with its share of the torch threads."""
    from tritonclient.grpc import model_config_pb2

    from serving.repository.config import read_config, write_config
    from serving.repository.repository import ModelRepository

    threads = str(threads_each(args))
    ModelRepository(root).publish(MODEL, work.model, parameters={"torch_threads": threads})
    path = root / MODEL / "config.pbtxt"
    cfg = read_config(path)
    cfg.instance_group.add(count=args.processes, kind=model_config_pb2.ModelInstanceGroup.KIND_CPU)
    write_config(path, cfg)
    return root


def threads_each(args: argparse.Namespace) -> int:
    """Torch threads of each of the ``--processes`` model processes (Triton's instances too)."""
    return max(1, args.threads // args.processes)
