"""deploy/k8s: the Kubernetes manifests agree with the code they run (the image: test_image.py).

There is no cluster here, so these checks read the files: every YAML parses and the kustomization
lists every file; Services, PodDisruptionBudgets and the HorizontalPodAutoscaler select or target
a real workload; probes hit ports and paths the servers serve; container args parse with the real
``recserve`` CLI; serve.toml agrees with the manifests (ports, shard and embedding-server
addresses) and loads with ``ServeConfig``. ``kubectl kustomize`` (or ``kustomize build``) renders
the base and the gpu overlay where a binary is installed.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any, cast

import pytest
import yaml
from deploy_files import (
    ADAPTER,
    BASE,
    COMPONENTS,
    GPU,
    K8S,
    POD_INDEX,
    ROOT,
    WORKLOADS,
    Doc,
    component,
    container,
    containers,
    flags,
    health_port,
    is_router,
    kustomization,
    load,
    mount_of,
    named,
    of_kind,
    pod_labels,
    pod_spec,
    port_number,
    quantity,
    selected,
    serve_toml,
    workload,
)


# ---- kustomize layout ----------------------------------------------------------------------------
def test_every_yaml_under_deploy_k8s_parses() -> None:
    """A YAML typo must fail here, not at `kubectl apply`; no file is skipped."""
    paths = sorted(K8S.rglob("*.yaml")) + sorted(K8S.rglob("*.yml"))
    assert {BASE / "kustomization.yaml", GPU / "kustomization.yaml", ADAPTER} <= set(paths)
    for path in paths:
        load(path)


def test_kustomizations_list_every_file_and_leave_out_the_adapter_rules() -> None:
    """No orphan manifest that never gets applied; the adapter values are not a resource."""
    for folder in (BASE, GPU):
        k = kustomization(folder)
        generated = [f for g in k.get("configMapGenerator", []) for f in g["files"]]
        patches = [p["path"] for p in k.get("patches", [])]
        local = [r for r in k["resources"] if not r.startswith("..")]
        listed = {"kustomization.yaml", *local, *generated, *patches}
        assert listed == {p.name for p in folder.iterdir()}, folder
        assert ADAPTER not in {(folder / r).resolve() for r in k["resources"]}


def test_workloads_are_labelled_and_their_selectors_do_not_overlap() -> None:
    """Each component is one workload; its selector picks its own pods and no other's."""
    ws = of_kind(*WORKLOADS)
    assert sorted(component(w) for w in ws) == sorted(COMPONENTS)
    for w in ws:
        assert pod_labels(w)["app.kubernetes.io/name"] == "recserve"
        assert w["metadata"]["labels"].items() <= pod_labels(w).items()
        assert selected(w["spec"]["selector"]["matchLabels"]) == [w]


# ---- Services, probes, ports ---------------------------------------------------------------------
def test_services_select_one_workload_and_its_ports() -> None:
    """A Service with no pods, or a targetPort the container does not open, never answers. The
    port equals the container's: headless Services (pod DNS) do not translate ports."""
    for svc in of_kind("Service"):
        (w,) = selected(svc["spec"]["selector"])
        (c,) = pod_spec(w)["containers"]
        for p in svc["spec"]["ports"]:
            assert port_number(c, p["targetPort"]) == p["port"], svc["metadata"]["name"]


def test_statefulsets_have_their_headless_service() -> None:
    """Pod DNS names (recserve-shard-0.recserve-shard) exist only through a headless Service
    named by the StatefulSet's serviceName."""
    for sts in of_kind("StatefulSet"):
        svc = named("Service", sts["spec"]["serviceName"])
        assert svc["spec"].get("clusterIP") == "None"
        assert selected(svc["spec"]["selector"]) == [sts]
        assert sts["spec"]["podManagementPolicy"] == "Parallel"


def test_probes_hit_ports_and_paths_the_servers_serve() -> None:
    """HTTP probes use routes of serving/frontends/kserve_http.py on the HTTP port; gRPC probes the port where
    grpc.health.v1 runs (router: serve.toml grpc_port; others: the port flag in their args)."""
    from serving.frontends.kserve_http import make_app

    routes = {getattr(r, "path", None) for r in make_app(cast(Any, None)).routes}
    for _, c in containers():
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c[kind]
            if "httpGet" in probe:
                assert is_router(c), f"{c['name']}: only the router serves HTTP"
                assert port_number(c, probe["httpGet"]["port"]) == serve_toml()["http_port"]
                assert probe["httpGet"]["path"] in routes, probe
            else:
                assert port_number(c, probe["grpc"]["port"]) == health_port(c), (c["name"], kind)
    router = container("router")
    assert router["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert router["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"


def test_serve_toml_agrees_with_the_router_pod() -> None:
    """serve.toml (the ConfigMap) binds the ports the pod declares, on all interfaces, and is
    mounted where `--config` looks; Prometheus scrapes the metrics port."""
    cfg, w, c = serve_toml(), workload("router"), container("router")
    assert cfg["host"] == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {
        "grpc": cfg["grpc_port"],
        "http": cfg["http_port"],
        "metrics": cfg["metrics_port"],
    }
    generators = {g["name"] for g in kustomization(BASE)["configMapGenerator"]}
    (config,) = [
        v for v in pod_spec(w)["volumes"] if v.get("configMap", {}).get("name") in generators
    ]
    assert flags(c["args"])["--config"] == mount_of(c, config)["mountPath"] + "/serve.toml"
    for w, c in containers():
        annotations = w["spec"]["template"]["metadata"].get("annotations", {})
        if "prometheus.io/port" in annotations:
            assert port_number(c, "metrics") == int(annotations["prometheus.io/port"])


def test_every_server_reads_the_model_repo_volume_read_only() -> None:
    """All three load the same model from the PVC, at the path their config or flags name."""
    claim = named("PersistentVolumeClaim", "recserve-model-repo")["metadata"]["name"]
    for w, c in containers():
        (vol,) = [v for v in pod_spec(w)["volumes"] if "persistentVolumeClaim" in v]
        assert vol["persistentVolumeClaim"] == {"claimName": claim, "readOnly": True}
        mount = mount_of(c, vol)
        assert mount["readOnly"] is True
        if is_router(c):
            repo, model = serve_toml()["model_repo"], serve_toml()["model"]
        else:
            repo, model = flags(c["args"])["--model-repo"], flags(c["args"])["--model"]
        assert (repo, model) == (mount["mountPath"], serve_toml()["model"]), c["name"]


def test_router_addresses_are_the_statefulset_pods() -> None:
    """[router].shards holds one list per shard, the i-th naming pod i of recserve-shard on its
    gRPC port; embedding_servers likewise; counts equal the StatefulSets' replicas; each pod takes
    its shard/slice number from its ordinal."""
    router = serve_toml()["router"]
    for key, name, ordinal_flag in (
        ("shards", "shard", "--shard"),
        ("embedding_servers", "embedding-server", "--index"),
    ):
        sts, c = workload(name), container(name)
        groups = router[key] if key == "shards" else [[a] for a in router[key]]
        assert len(groups) == sts["spec"]["replicas"], key
        base = f"{sts['metadata']['name']}-{{}}.{sts['spec']['serviceName']}:{health_port(c)}"
        assert groups == [[base.format(i)] for i in range(len(groups))], key
        var = re.fullmatch(r"\$\((\w+)\)", flags(c["args"])[ordinal_flag])
        assert var, f"{name}: {ordinal_flag} must be $(VAR) from the pod index"
        env = {e["name"]: e for e in c["env"]}
        assert env[var[1]]["valueFrom"]["fieldRef"]["fieldPath"] == POD_INDEX


# ---- the code's view of the config and the args --------------------------------------------------
def test_serve_toml_loads_and_validates_with_serve_config(tmp_path: Path) -> None:
    """`recserve serve` accepts the file: every key known and typed, [router] included, values
    valid; gRPC workers outnumber the batch, as ServeConfig.grpc_workers asks."""
    from serving.app.config import ServeConfig

    cfg = ServeConfig.from_toml(BASE / "serve.toml")
    (tmp_path / cfg.model).mkdir()
    (tmp_path / cfg.model / "config.pbtxt").touch()
    cfg.model_copy(update={"model_repo": tmp_path}).validate()
    assert cfg.router is not None and cfg.router.shards == serve_toml()["router"]["shards"]
    assert cfg.grpc_workers > (cfg.batching.max_batch_size or 0)


@pytest.mark.parametrize("name", sorted(COMPONENTS))
def test_container_args_parse_with_the_recserve_cli(name: str) -> None:
    """The args name a real subcommand and flags, with values click accepts (types, ranges,
    required options); `$(VAR)` refers to the container's env (else Kubernetes passes it as is)."""
    import typer

    from recserve.cli import app

    c = container(name)
    assert "command" not in c, "the image's ENTRYPOINT is recserve"
    env = {e["name"]: e.get("value", "0") for e in c["env"]}  # "0": an ordinal from the pod
    for var in re.findall(r"\$\((\w+)\)", " ".join(c["args"])):
        assert var in env, f"{name}: $({var}) is not in env"
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], a) for a in c["args"]]
    if not is_router(c):
        assert flags(args)["--host"] == "0.0.0.0"
    group = cast(Any, typer.main.get_command(app)).commands.get(args[0])
    cmd = group.commands.get(args[1]) if group is not None else None
    assert cmd is not None, f"no command `recserve {' '.join(args[:2])}`"
    unknown = set(args[2::2]) - {o for p in cmd.params for o in p.opts}
    assert not unknown, f"recserve {' '.join(args[:2])}: no {sorted(unknown)}"
    cmd.make_context(args[1], args[2:])


# ---- scaling, disruption, resources --------------------------------------------------------------
def test_hpa_scales_the_router_on_the_adapter_metric() -> None:
    """The HPA targets the router Deployment (which leaves replicas to it) on the metric the
    adapter rule serves, computed from counters serving/engine/metrics.py really exports; its target is
    above the batcher's designed wait, or an idle router would scale to the maximum."""
    from serving.engine.metrics import ServingMetrics

    (hpa,) = of_kind("HorizontalPodAutoscaler")
    router = workload("router")
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", router["metadata"]["name"])
    assert "replicas" not in router["spec"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    target_us = quantity(metric["pods"]["target"]["averageValue"])
    assert target_us > serve_toml()["batching"]["max_queue_delay_ms"] * 1000
    (values,) = load(ADAPTER)
    (rule,) = [
        r for r in values["rules"]["custom"] if r["name"]["as"] == metric["pods"]["metric"]["name"]
    ]
    query = " ".join(rule["metricsQuery"].split())
    assert "rate(nv_inference_queue_duration_us{" in query
    assert "rate(nv_inference_request_success{" in query
    exported = {m.name for m in ServingMetrics("m").registry.collect()}
    assert {"nv_inference_queue_duration_us", "nv_inference_request_success"} <= exported
    (pdb,) = [
        p
        for p in of_kind("PodDisruptionBudget")
        if selected(p["spec"]["selector"]["matchLabels"]) == [router]
    ]
    assert hpa["spec"]["minReplicas"] > pdb["spec"]["maxUnavailable"]


def test_every_workload_has_one_pdb() -> None:
    pdbs = [selected(p["spec"]["selector"]["matchLabels"]) for p in of_kind("PodDisruptionBudget")]
    assert all(len(ws) == 1 for ws in pdbs)
    assert sorted(component(ws[0]) for ws in pdbs) == sorted(COMPONENTS)


def test_containers_have_resources_and_run_locked_down() -> None:
    """Requests and limits for CPU and memory; non-root, no privilege escalation, read-only root;
    the scan kernel's build dir and /tmp are writable emptyDirs (it compiles on first use)."""
    for w, c in containers():
        spec, res = pod_spec(w), c["resources"]
        for key in ("cpu", "memory"):
            assert quantity(res["requests"][key]) <= quantity(res["limits"][key]), c["name"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        sc = c["securityContext"]
        assert (sc["allowPrivilegeEscalation"], sc["readOnlyRootFilesystem"]) == (False, True)
        assert sc["capabilities"]["drop"] == ["ALL"]
        empty = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
        writable = {m["mountPath"] for m in c["volumeMounts"] if m["name"] in empty}
        build = {e["name"]: e.get("value") for e in c["env"]}["RECSERVE_BUILD_DIR"]
        assert {build, "/tmp"} <= writable, c["name"]


def test_router_grace_period_covers_the_drain() -> None:
    """SIGTERM comes after the preStop hook; the drain (drain_timeout_s) must end before SIGKILL."""
    c, spec = container("router"), pod_spec(workload("router"))
    pre = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    pre_s = float(pre[1]) if pre[:1] == ["sleep"] else 0.0
    assert spec["terminationGracePeriodSeconds"] > serve_toml()["drain_timeout_s"] + pre_s


def test_embedding_server_memory_budget_fits_its_memory() -> None:
    """The rows it may hold (--memory-budget) plus 1 GiB for the process fit the limit, and the
    request equals the limit (no overcommit of the tier's DRAM)."""
    from sharded_tables.remote.config import EmbeddingServerConfig

    c = container("embedding-server")
    budget = EmbeddingServerConfig(memory_budget=flags(c["args"])["--memory-budget"]).budget_bytes()
    mem = {k: quantity(c["resources"][k]["memory"]) for k in ("requests", "limits")}
    assert mem["requests"] == mem["limits"] >= budget + 2**30


# ---- gpu overlay and rendering -------------------------------------------------------------------
def gpus(c: Doc) -> int:
    return int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))


def device(c: Doc) -> str | None:
    """The container's ``--device``, ``$(VAR)`` resolved from its env (None: no such flag)."""
    flag = flags(c["args"]).get("--device")
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    return re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], flag) if flag else None


def test_gpu_overlay_adds_gpus_to_router_and_shards() -> None:
    """The overlay builds on the base and patches existing containers: a GPU limit and the GPU
    taint's toleration for the router and the shards, nothing for the embedding servers; a
    process with a `--device` flag is switched to cuda (the base runs it on cpu)."""
    k = kustomization(GPU)
    assert k["resources"] == ["../../base"]
    with_gpu = set()
    for p in k["patches"]:
        (patch,) = load(GPU / p["path"])
        target = named(patch["kind"], patch["metadata"]["name"])
        by_name = {c["name"]: c for c in pod_spec(target)["containers"]}
        for c in pod_spec(patch)["containers"]:
            assert c["name"] in by_name, f"{p['path']}: no container {c['name']} in the base"
            base = by_name[c["name"]]
            env = {e["name"]: e for e in [*base.get("env", []), *c.get("env", [])]}
            assert device(base) in (None, "cpu")
            if gpus(c) >= 1:
                with_gpu.add(component(target))
                assert device({**base, "env": list(env.values())}) == "cuda", p["path"]
        keys = {t["key"] for t in pod_spec(patch).get("tolerations", [])}
        assert "nvidia.com/gpu" in keys, p["path"]
    assert with_gpu == {"router", "shard"}


def kustomize_cmd() -> list[str] | None:
    if exe := shutil.which("kustomize"):
        return [exe, "build"]
    if exe := shutil.which("kubectl"):
        return [exe, "kustomize"]
    return None


@pytest.mark.multiproc  # runs kubectl
@pytest.mark.parametrize("folder", [BASE, GPU], ids=["cpu-base", "gpu-overlay"])
def test_kustomize_renders_config_and_gpus(folder: Path) -> None:
    """The real renderer: the router mounts the generated (hash-named) ConfigMap holding
    serve.toml, and only the overlay asks for GPUs (router and shards) and runs on cuda."""
    cmd = kustomize_cmd()
    if cmd is None:
        pytest.skip("neither kustomize nor kubectl is installed")
    out = subprocess.run([*cmd, str(folder)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert cm["data"]["serve.toml"] == (BASE / "serve.toml").read_text()
    ws = [d for d in docs if d["kind"] in WORKLOADS]
    (router,) = [w for w in ws if component(w) == "router"]
    assert cm["metadata"]["name"] in json.dumps(pod_spec(router)["volumes"])
    with_gpu = {component(w) for w in ws for c in pod_spec(w)["containers"] if gpus(c)}
    assert with_gpu == ({"router", "shard"} if folder == GPU else set())
    for c in (c for w in ws for c in pod_spec(w)["containers"]):
        assert device(c) in ((None, "cpu") if not gpus(c) else ("cuda",)), c["name"]


def test_the_batch_scoring_rayjob_runs_a_real_score_command_on_the_pinned_ray() -> None:
    """The RayJob's entrypoint parses with the `recserve score` CLI; its Ray version is ours."""
    import shlex

    import typer

    from recserve.cli import app

    (job,) = load(K8S / "jobs" / "batch-scoring-rayjob.yaml")
    assert job["kind"] == "RayJob"
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["recserve", "score"]
    score = cast(Any, typer.main.get_command(app)).commands["score"]
    score.make_context("score", argv[2:])  # raises on an unknown flag or a missing option
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"ray[data]=={job['spec']['rayClusterSpec']['rayVersion']}" in deps
