"""deploy/k8s against Kubernetes' published JSON schemas (the OpenAPI of each release, as
``kubernetes-validate`` bundles them: offline, pinned with the package), strict: a field
Kubernetes does not know is an error, not silently dropped by ``kubectl apply``.

Checked at :data:`VERSIONS`: the oldest release the manifests need (the pod-index label of
StatefulSet pods, ``deploy/README.md``) and the newest the pinned package knows. The base's
resources as they are; the gpu overlay's patches merged into them as kustomize's strategic
merge does for these fields (maps merged, lists of named items merged by ``name``, other lists
replaced); the RayJob's pod templates (RayJob itself is KubeRay's CRD, outside Kubernetes'
schemas). ``prometheus-adapter-rules.yaml`` holds Helm values, not a resource.
"""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest
from deploy_files import GPU, K8S, Doc, kustomization, load, resources

VERSIONS = ("1.28.0", "1.37.0")
"""The oldest Kubernetes the manifests need, and the newest the pinned schemas cover."""


def check(doc: Doc, version: str) -> None:
    """Strict validation of one resource; the failure names the resource and the field."""
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        where = "/".join(str(p) for p in e.path)
        pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {where}: {e.message}")


def merge(base: Any, patch: Any) -> Any:
    """``patch`` over ``base`` as kustomize's strategic merge treats these manifests' fields."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = merge(base[k], v) if k in base else copy.deepcopy(v)
        return out
    named = isinstance(base, list) and isinstance(patch, list)
    if named and all(isinstance(x, dict) and "name" in x for x in [*base, *patch]):
        by_name = {x["name"]: x for x in base}
        out = [merge(x, next((p for p in patch if p["name"] == x["name"]), {})) for x in base]
        return out + [copy.deepcopy(p) for p in patch if p["name"] not in by_name]
    return copy.deepcopy(patch)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_base_resource_is_valid(version):
    docs = resources()
    assert {d["kind"] for d in docs} >= {"Deployment", "StatefulSet", "Service"}
    for doc in docs:
        check(doc, version)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_gpu_overlay_gives_valid_resources(version):
    patches = [load(GPU / p["path"])[0] for p in kustomization(GPU)["patches"]]
    assert patches
    base = {(d["kind"], d["metadata"]["name"]): d for d in resources()}
    for patch in patches:
        key = (patch["kind"], patch["metadata"]["name"])
        assert key in base, f"{GPU}: a patch of {key}, which the base does not have"
        check(merge(base[key], patch), version)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_rayjobs_pod_templates_are_valid(version):
    (job,) = load(K8S / "jobs" / "batch-scoring-rayjob.yaml")
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(job, version, strict=True)  # a CRD: not Kubernetes'
    spec = job["spec"]["rayClusterSpec"]
    groups = [("head", spec["headGroupSpec"])]
    groups += [(g["groupName"], g) for g in spec["workerGroupSpecs"]]
    for name, group in groups:
        template = {"apiVersion": "v1", "kind": "PodTemplate"}
        template |= {"metadata": {"name": f"rayjob-{name}"}, "template": group["template"]}
        check(template, version)


def test_a_field_kubernetes_does_not_know_fails():
    """The check can fail: a misspelt field in a real manifest is reported, naming it."""
    doc = copy.deepcopy(next(d for d in resources() if d["kind"] == "StatefulSet"))
    doc["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError, match="imagePullPolcy"):
        kubernetes_validate.validate(doc, VERSIONS[0], strict=True)
