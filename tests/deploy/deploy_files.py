"""Reading deploy/: the manifests, serve.toml and their parts, for the deploy tests."""

from __future__ import annotations

import functools
import re
import tomllib
from pathlib import Path
from typing import Any, cast

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
BASE = K8S / "base"
GPU = K8S / "overlays" / "gpu"
ADAPTER = K8S / "prometheus-adapter-rules.yaml"
WORKLOADS = ("Deployment", "StatefulSet")
COMPONENTS = {"router", "shard", "embedding-server"}
POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"
_UNITS = {"": 1.0, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 2.0**10, "Mi": 2.0**20}
_UNITS |= {"Gi": 2.0**30, "Ti": 2.0**40}

Doc = dict[str, Any]


# ---- reading the files ---------------------------------------------------------------------------
def load(path: Path) -> list[Doc]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path}: no YAML documents"
    assert all(isinstance(d, dict) for d in docs), f"{path}: a document is not a mapping"
    return docs


@functools.cache
def kustomization(folder: Path) -> Doc:
    (doc,) = load(folder / "kustomization.yaml")
    return doc


@functools.cache
def resources() -> tuple[Doc, ...]:
    return tuple(d for name in kustomization(BASE)["resources"] for d in load(BASE / name))


@functools.cache
def serve_toml() -> dict[str, Any]:
    return tomllib.loads((BASE / "serve.toml").read_text())


def of_kind(*kinds: str) -> list[Doc]:
    return [d for d in resources() if d["kind"] in kinds]


def named(kind: str, name: str) -> Doc:
    (doc,) = [d for d in of_kind(kind) if d["metadata"]["name"] == name]
    return doc


def pod_labels(w: Doc) -> dict[str, str]:
    return w["spec"]["template"]["metadata"]["labels"]


def pod_spec(w: Doc) -> Doc:
    return w["spec"]["template"]["spec"]


def component(w: Doc) -> str:
    return pod_labels(w)["app.kubernetes.io/component"]


def selected(selector: dict[str, str]) -> list[Doc]:
    """The workloads whose pods carry every label of ``selector``."""
    return [w for w in of_kind(*WORKLOADS) if selector.items() <= pod_labels(w).items()]


def workload(name: str) -> Doc:
    (w,) = [w for w in of_kind(*WORKLOADS) if component(w) == name]
    return w


def container(name: str) -> Doc:
    (c,) = pod_spec(workload(name))["containers"]
    return c


def containers() -> list[tuple[Doc, Doc]]:
    return [(w, c) for w in of_kind(*WORKLOADS) for c in pod_spec(w)["containers"]]


def port_number(c: Doc, port: int | str) -> int:
    """A probe's or Service's port, by name or number, as one of ``c``'s container ports."""
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    number = ports.get(port) if isinstance(port, str) else port
    assert number in ports.values(), f"{c['name']}: port {port!r} is not a container port"
    return cast(int, number)


def flags(args: list[str]) -> dict[str, str]:
    """``--flag value`` pairs after the command (``serve router``: every flag we pass takes a
    value)."""
    assert len(args) % 2 == 0 and all(a.startswith("--") for a in args[2::2]), args
    return dict(zip(args[2::2], args[3::2], strict=True))


def is_router(c: Doc) -> bool:
    """``recserve serve router``: configured by serve.toml, not by flags."""
    return c["args"][:2] == ["serve", "router"]


def quantity(q: str | int) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([A-Za-z]*)", str(q))
    assert m and m[2] in _UNITS, f"not a Kubernetes quantity: {q!r}"
    return float(m[1]) * _UNITS[m[2]]


def health_port(c: Doc) -> int:
    """The port where the container's process serves grpc.health.v1."""
    if is_router(c):
        return serve_toml()["grpc_port"]
    return int(flags(c["args"])["--grpc-port"])  # every server's gRPC port flag


def mount_of(c: Doc, volume: Doc) -> Doc:
    (m,) = [m for m in c["volumeMounts"] if m["name"] == volume["name"]]
    return m
