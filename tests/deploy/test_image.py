"""deploy/Dockerfile and .dockerignore: the image installs the pinned CPU project as a non-root
user, exposes the ports the manifests use, and never receives data."""

from __future__ import annotations

import re
import tomllib

from deploy_files import (
    DEPLOY,
    ROOT,
    WORKLOADS,
    containers,
    of_kind,
    pod_spec,
)


# ---- the image -----------------------------------------------------------------------------------
def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    lines = [
        ln
        for ln in (DEPLOY / "Dockerfile").read_text().splitlines()
        if not ln.lstrip().startswith("#")
    ]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [
        (ln.split(None, 1)[0].upper(), ln.split(None, 1)[1])
        for ln in joined.splitlines()
        if ln.strip()
    ]


def test_dockerfile_installs_the_pinned_cpu_project_as_a_non_root_recserve() -> None:
    """python:3.11-slim; every pip call under constraints.txt (torch==2.13.0) with the CPU wheel
    index for the project; all packages and the lock copied in; the ports the manifests use
    exposed; `recserve` as entrypoint; the uid the pods run as."""
    steps = dockerfile()
    assert steps[0] == ("FROM", "python:3.11-slim")
    assert ("ENTRYPOINT", '["recserve"]') in steps
    exposed = {int(p) for op, a in steps if op == "EXPOSE" for p in a.split()}
    used = {p["containerPort"] for _, c in containers() for p in c["ports"]}
    assert used <= exposed
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text().splitlines()
    copied = {src for op, a in steps if op == "COPY" for src in a.split()[:-1]}
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {p.rstrip("*") for p in include["packages"]["find"]["include"]}
    assert (
        packages | {"pyproject.toml", "constraints.txt", "constraints-gpu.txt", "README.md"}
        <= copied
    )
    pips = [s for op, a in steps if op == "RUN" for s in a.split("&&") if "pip install" in s]
    locks = ("-c constraints.txt", "-c constraints-gpu.txt")
    assert pips and all(any(lock in s for lock in locks) for s in pips), pips
    assert any(
        "--extra-index-url https://download.pytorch.org/whl/cpu" in s and s.split()[-1] == "."
        for s in pips
    )
    (user,) = [a for op, a in steps if op == "USER"]
    uids = {pod_spec(w)["securityContext"]["runAsUser"] for w in of_kind(*WORKLOADS)}
    assert uids == {int(user.split(":")[0])}


def test_the_gpu_image_installs_the_cuda_builds_under_its_own_lock(tmp_path, monkeypatch) -> None:
    """`--build-arg VARIANT=gpu`: the lock is constraints.txt but for fbgemm-gpu's CUDA build;
    the requirements the Dockerfile writes are the project's dependencies with that swap (its
    own one-liner, run here); torch stays 2.13.0 (PyPI's wheel is the CUDA build) and triton is
    the version that wheel pins."""
    import contextlib
    import io

    cpu = [ln for ln in (ROOT / "constraints.txt").read_text().splitlines() if ln[:1] != "#"]
    gpu = [ln for ln in (ROOT / "constraints-gpu.txt").read_text().splitlines() if ln[:1] != "#"]
    swapped = ["fbgemm-gpu==1.8.0" if ln == "fbgemm_gpu-cpu==1.8.0" else ln for ln in cpu]
    assert gpu == swapped and "fbgemm-gpu==1.8.0" in gpu
    assert "torch==2.13.0" in gpu and "triton==3.7.1" in gpu
    (run,) = [a for op, a in dockerfile() if op == "RUN" and "VARIANT" in a]
    code = re.search(r'python -c "(.+?)" > /tmp/requirements-gpu.txt', run)
    assert code is not None, run
    monkeypatch.chdir(ROOT)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code[1], {})
    wanted = out.getvalue().split()
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "fbgemm-gpu==1.8.0" in wanted and "fbgemm-gpu-cpu==1.8.0" not in wanted
    assert len(wanted) == len(deps) and "triton==3.7.1" in wanted


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents wins."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    out = False
    for pat in patterns:
        negate, pat = pat.startswith("!"), pat.lstrip("!").strip("/")
        rx = (
            re.escape(pat)
            .replace(r"\*\*/", "(.*/)?")
            .replace(r"\*", "[^/]*")
            .replace(r"\?", "[^/]")
        )
        if any(re.fullmatch(rx, c) for c in candidates):
            out = not negate
    return out


def test_dockerignore_sends_sources_but_never_data() -> None:
    """The build context (repo root) carries the C++ kernel sources the pods compile, and never
    the venv, runs or MovieLens data (GroupLens forbids redistribution)."""
    text = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [ln.strip() for ln in text if ln.strip() and not ln.startswith("#")]
    for kept in (
        "pyproject.toml",
        "constraints.txt",
        "constraints-gpu.txt",
        "retrieval/index/csrc/ivf_scan/scan.cpp",
        "retrieval/index/csrc/ivf_scan/ivf_scan.h",
        "sharded_tables/csrc/idmap.cpp",
        "serving/app/config.py",
    ):
        assert not dockerignored(kept, patterns), kept
    for dropped in (
        ".venv/bin/python",
        "data/ml-100k/ml-100k.inter",
        "runs/demo/model/model.pt",
        "serving/__pycache__/config.cpython-311.pyc",
        ".git/HEAD",
    ):
        assert dockerignored(dropped, patterns), dropped
