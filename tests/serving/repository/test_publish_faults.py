"""Publishing under faults (hostile artifacts and names: ``test_hostile_artifacts.py``):

* kill -9 at random points of a publish (a forked child of ``publish_worker.py``), many rounds,
  with a host polling the repository and answering all along;
* a full disk (``disk_faults.DiskFull``: at every file a publish writes, where it starts, its
  middle and its last byte), and real kernel write failures (``RLIMIT_FSIZE`` in the child);
* a read-only model folder or repository.

What must hold after every fault: only complete versions are visible, numbered without gaps,
and each verifies against its manifest; the newest loads and answers like the published model; a
running ``ModelHost`` keeps serving; a failed publish raises :class:`PublishError` (an
``OSError``) naming the model, version and folder and leaves nothing behind; the next publish
removes what a killed one left.
"""

from __future__ import annotations

import errno
import os
import random
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from disk_faults import DiskFull, ReadOnly
from publish_worker import Worker

from retrieval.artifact import save_model
from retrieval.tiering import tier_model
from serving.engine.host import ModelHost
from serving.engine.runner import ModelRunner
from serving.repository.config import CONFIG_FILE
from serving.repository.manifest import verify
from serving.repository.repository import LOCK_FILE, LoadedModel, ModelRepository, PublishError
from serving.types import RecResult
from sharded_tables.placement import Budgets
from sharded_tables.specs import DType

NAME = "demo"
KEEP = 3
USERS = range(6)
WAIT = 60.0
KILL_ROUNDS = 40
KILL_BUDGET_S = 30.0
SEED = 20250117


# ---- fixtures and checks ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiered(tiny) -> tuple[Any, dict[str, torch.Tensor]]:
    """The tiny model with its tables on one embedding server: (model, remote rows)."""
    budgets = Budgets(device=0, host=1 << 12, remote_per_server=64 << 20, remote_servers=1)
    return tier_model(tiny.model, budgets, dtype=DType.FP32)


@pytest.fixture(scope="module")
def worker(tiny, tmp_path_factory) -> Any:
    folder = tmp_path_factory.mktemp("worker")
    w = Worker(save_model(tiny.model, folder / "model"), folder / "stderr.txt")
    yield w
    w.close()


def requests(tiny) -> list[Any]:
    return [tiny.request(u) for u in USERS]


def answers(runner: ModelRunner, reqs: list[Any]) -> list[np.ndarray]:
    out = runner.run(reqs)
    ids = [o.item_ids for o in out if isinstance(o, RecResult)]
    assert len(ids) == len(reqs), out
    return ids


def same(got: list[np.ndarray], want: list[np.ndarray]) -> bool:
    return all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))


def leftovers(mdir: Path) -> list[str]:
    return sorted(p.name for p in mdir.iterdir() if p.name.startswith(".") and p.name != LOCK_FILE)


def check_unchanged(repo: ModelRepository, host: ModelHost, config: bytes, want: Any) -> None:
    """Version 1 alone, nothing left behind, config.pbtxt as it was; it loads, verifies and
    answers; the host still serves it and finds nothing new."""
    mdir = repo.root / NAME
    assert sorted(p.name for p in repo.root.iterdir()) == [NAME]
    assert sorted(p.name for p in mdir.iterdir()) == sorted([LOCK_FILE, "1", CONFIG_FILE])
    assert (mdir / CONFIG_FILE).read_bytes() == config
    assert verify(mdir / "1").version == 1
    loaded = repo.load(NAME)
    assert loaded.version == 1
    assert same(answers(ModelRunner(loaded.model, NAME, 1), want.reqs), want.ids)
    assert host.poll_once() is None and host.version == 1
    with host.running() as runner:
        assert same(answers(runner, want.reqs), want.ids)


@pytest.fixture
def serving(tiny, repo: ModelRepository) -> Any:
    """Version 1 published and served by a host: (host, config bytes, expected answers)."""
    assert repo.publish(NAME, tiny.model) == 1
    host = ModelHost(repo, NAME, poll_s=0, warmup_sizes=(1,))
    assert host.start() == 1
    reqs = requests(tiny)
    want = SimpleNamespace(reqs=reqs, ids=answers(ModelRunner(tiny.model, NAME, 0), reqs))
    return SimpleNamespace(
        host=host, config=(repo.root / NAME / CONFIG_FILE).read_bytes(), want=want
    )


def assert_names_the_publish(
    err: BaseException, repo: ModelRepository, version: int | None
) -> None:
    msg = str(err)
    assert isinstance(err, PublishError), repr(err)
    assert f"model {NAME!r}" in msg and str(repo.root / NAME) in msg, msg
    assert version is None or f"version {version}" in msg, msg


# ---- kill -9 ------------------------------------------------------------------------------------
class WatchedRepository(ModelRepository):
    """Checks every version a host loads: it verified (``load`` does) and answers right."""

    def __init__(self, root: Path, want: Any):
        super().__init__(root)
        self.want = want
        self.loaded: list[int] = []
        self.wrong: list[int] = []
        self.refused: list[tuple[int | None, str]] = []

    def load(self, name: str, version: int | None = None, *args: Any, **kw: Any) -> LoadedModel:
        try:
            loaded = super().load(name, version, *args, **kw)
        except Exception as e:
            self.refused.append((version, repr(e)))
            raise
        runner = ModelRunner(loaded.model, name, loaded.version)
        ok = same(answers(runner, self.want.reqs), self.want.ids)
        (self.loaded if ok else self.wrong).append(loaded.version)
        return loaded


def keep_asking(host: ModelHost, want: Any, done: threading.Event, tally: dict[str, Any]) -> None:
    while not done.wait(0.002):
        try:
            with host.running() as runner:
                tally["ok" if same(answers(runner, want.reqs), want.ids) else "wrong"] += 1
        except Exception as e:
            tally["errors"].append(repr(e))


LEFTOVER_KINDS = (".staging-", ".deleted-", f".{CONFIG_FILE}.")


def check_after_kill(root: Path, before: int, want: Any) -> int:
    """A fresh repository sees complete versions only, numbered without gaps, each verifying;
    at most one leftover of each kind (so the publishes clean up); a restarted host serves the
    newest and answers right. Returns the newest version."""
    repo, mdir = ModelRepository(root), root / NAME
    versions = repo.versions(NAME)
    assert sorted(int(p.name) for p in mdir.iterdir() if p.name.isdigit()) == versions
    assert versions == list(range(versions[0], versions[-1] + 1)), versions
    assert versions[-1] in (before, before + 1) and len(versions) <= KEEP + 1, versions
    for v in versions:
        m = verify(mdir / str(v))
        assert (m.model, m.version) == (NAME, v)
    left = leftovers(mdir)
    for kind in LEFTOVER_KINDS:
        assert len([n for n in left if n.startswith(kind)]) <= 1, left
    assert all(n.startswith(LEFTOVER_KINDS) for n in left), left
    restarted = ModelHost(repo, NAME, poll_s=0, warmup_sizes=(1,))
    assert restarted.start() == versions[-1]
    with restarted.running() as runner:
        assert same(answers(runner, want.reqs), want.ids)
    return versions[-1]


def where(lines: list[list[str]], grew: bool, staged: bool) -> str:
    """Where the kill landed, from what the child said and what it left."""
    said = {words[0] for words in lines}
    assert "error" not in said, lines
    if "done" in said:
        return "after publish returned"
    if "start" not in said:
        return "before publish began"
    if grew:
        return "mid-publish: after the rename"
    return "mid-publish: while staging" if staged else "mid-publish: before staging"


@pytest.mark.multiproc  # the publish worker process
def test_kill_9_during_publish_never_exposes_a_partial_version(tiny, tmp_path, worker) -> None:
    root = tmp_path / "repo"
    mdir = root / NAME
    repo = ModelRepository(root)
    assert repo.publish(NAME, tiny.model, keep=KEEP) == 1
    reqs = requests(tiny)
    want = SimpleNamespace(reqs=reqs, ids=answers(ModelRunner(tiny.model, NAME, 0), reqs))
    watched = WatchedRepository(root, want)
    host = ModelHost(watched, NAME, poll_s=0.005, warmup_sizes=(1,))
    assert host.start() == 1
    tally: dict[str, Any] = {"ok": 0, "wrong": 0, "errors": []}
    done = threading.Event()
    asker = threading.Thread(target=keep_asking, args=(host, want, done, tally), daemon=True)
    asker.start()
    counts: dict[str, int] = {}
    try:
        spans = []  # one whole publish as seen from here (fork and reap included)
        for _ in range(3):
            sent = time.monotonic()
            assert "done" in {w[0] for w in worker.run("publish", root, NAME, KEEP)}
            spans.append(time.monotonic() - sent)
        latest = check_after_kill(root, 3, want)
        span = sorted(spans)[1]
        rng = random.Random(SEED)
        started, rounds = time.monotonic(), 0
        while rounds < KILL_ROUNDS and time.monotonic() - started < KILL_BUDGET_S:
            staged_before = [n for n in leftovers(mdir) if n.startswith(".staging-")]
            lines = worker.run("publish", root, NAME, KEEP, kill_at=rng.uniform(0, span))
            rounds += 1
            now = check_after_kill(root, latest, want)
            staged = [n for n in leftovers(mdir) if n.startswith(".staging-")]
            at = where(lines, now > latest, bool(set(staged) - set(staged_before)))
            counts[at] = counts.get(at, 0) + 1
            latest = now
    finally:
        done.set()
        asker.join(WAIT)
    final = repo.publish(NAME, tiny.model, keep=KEEP)  # removes what the killed ones left
    assert final == latest + 1 and leftovers(mdir) == []
    give_up = time.monotonic() + WAIT
    while host.version != final and time.monotonic() < give_up:
        time.sleep(0.01)
    host.stop(WAIT)
    mid = sum(n for at, n in counts.items() if at.startswith("mid"))
    print(
        f"\nkill -9: {rounds} rounds (span {span * 1e3:.1f} ms), {mid} mid-publish: {counts}; "
        f"host loaded {len(watched.loaded)} versions, refused {watched.refused}; "
        f"{tally['ok']} batches answered, {tally['wrong']} wrong, {len(tally['errors'])} errors"
    )
    assert host.version == final
    assert tally["errors"] == [] and tally["wrong"] == 0 and tally["ok"] > 0
    assert watched.wrong == []
    # a refusal is only ever a version that retention had already removed
    assert all(v not in repo.versions(NAME) for v, _ in watched.refused), watched.refused
    assert rounds >= 25 and mid >= 5, counts


# ---- disk full ----------------------------------------------------------------------------------
def publish_args(layout: str, tiny: Any, tiered: Any) -> tuple[Any, dict[str, Any]]:
    if layout == "plain":
        return tiny.model, {}
    if layout == "sharded":
        return tiny.model, {"shards": 2}
    model, rows = tiered
    return model, {"remote_rows": rows}


def fault_points(files: list[list[Any]]) -> list[int]:
    """Byte budgets: 0, and for each file written, where it starts, its middle, its last byte."""
    points, start = {0}, 0
    for _path, size in files:
        if size:
            points |= {start, start + size // 2, start + size - 1}
        start += size
    return sorted(points)


RANDOM_PARTS = (  # temporary names -> the same name in every publish
    (re.compile(r"^demo/\.staging-[^/]+/"), ""),
    # common.atomic's temp files (``.config.pbtxt.<uuid>.tmp``, ``model/.model.pt.<uuid>.tmp``)
    (re.compile(r"\.([^/]+)\.[0-9a-f]{32}\.tmp$"), r".\1.<uuid>.tmp"),
    (re.compile(r"\.server-(\d+)\.tmp-[^/]+"), r".server-\1.tmp-<random>"),
)


def written_as(path: str | None) -> str:
    """A file's path under the repository, without the random parts of temporary names."""
    out = str(path)  # None: a folder could not be made
    for pattern, repl in RANDOM_PARTS:
        out = pattern.sub(repl, out)
    return out


@pytest.mark.parametrize("layout", ["plain", "sharded", "remote"])
def test_disk_full_during_publish_fails_cleanly(
    tiny, tiered, repo, serving, tmp_path, monkeypatch, layout
) -> None:
    model, kw = publish_args(layout, tiny, tiered)
    scratch = ModelRepository(tmp_path / "scratch")  # what a publish writes, in order
    scratch.publish(NAME, tiny.model)
    with monkeypatch.context() as mp:
        measured = DiskFull(scratch.root, None)
        measured.install(mp)
        scratch.publish(NAME, model, **kw)
    points = fault_points(measured.files)
    hit = set()
    for budget in points:
        with monkeypatch.context() as mp:
            disk = DiskFull(repo.root, budget)
            disk.install(mp)
            with pytest.raises(OSError) as err:
                repo.publish(NAME, model, **kw)
        assert err.value.errno == errno.ENOSPC, repr(err.value)
        assert_names_the_publish(err.value, repo, 2)
        hit.add(written_as(disk.hit))
        check_unchanged(repo, serving.host, serving.config, serving.want)
    written = {written_as(p) for p, size in measured.files if size}
    print(f"\nENOSPC {layout}: {len(points)} points over {len(written)} files: {sorted(written)}")
    assert written <= hit  # every file was cut short at least once
    assert repo.publish(NAME, model, **kw) == 2  # and the number was not used up


@pytest.mark.multiproc  # the publish worker process
def test_real_write_failures_fail_cleanly(tiny, repo, serving, worker) -> None:
    """RLIMIT_FSIZE makes the kernel refuse writes past a size (EFBIG), torch's writer too."""
    size = (repo.root / NAME / "1" / "model" / "model.pt").stat().st_size
    limits = [0, 1, 4096, size // 2, size - 1]
    for limit in limits:
        lines = worker.run("fsize", repo.root, NAME, limit)
        errors = [w for w in lines if w[0] == "error"]
        assert len(errors) == 1, lines
        kind, msg = errors[0][2], errors[0][3]
        assert kind == "PublishError" and os.strerror(errno.EFBIG) in msg, errors
        assert f"model {NAME!r}" in msg and "version 2" in msg and str(repo.root) in msg, msg
        check_unchanged(repo, serving.host, serving.config, serving.want)
    print(f"\nRLIMIT_FSIZE: {len(limits)} limits refused cleanly: {limits}")
    said = [w for w in worker.run("fsize", repo.root, NAME, size * 4) if w[0] in ("done", "error")]
    assert len(said) == 1 and said[0][0] == "done" and said[0][2] == "2", said


# ---- read-only ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mode",
    ["chmod", "read-only file system", pytest.param("immutable", marks=pytest.mark.multiproc)],
)  # immutable: runs chattr
def test_read_only_repository_fails_cleanly(tiny, repo, serving, monkeypatch, mode) -> None:
    mdir = repo.root / NAME
    undo: list[Callable[[], object]] = []
    with monkeypatch.context() as mp:
        if mode == "chmod" and os.geteuid() != 0:
            os.chmod(mdir, 0o555)
            undo.append(lambda: os.chmod(mdir, 0o755))
        elif mode == "chmod":  # root ignores permissions: refuse what the kernel would
            ReadOnly(mdir, errno.EACCES).install(mp)
        elif mode == "read-only file system":
            ReadOnly(repo.root, errno.EROFS).install(mp)
        else:  # even root cannot add entries to an immutable folder
            if (
                not shutil.which("chattr")
                or subprocess.run(["chattr", "+i", str(mdir)], capture_output=True).returncode
            ):
                pytest.skip("chattr +i is not available here")
            undo.append(lambda: subprocess.run(["chattr", "-i", str(mdir)], check=True))
        try:
            with pytest.raises(OSError) as err:
                repo.publish(NAME, tiny.model)
        finally:
            for u in undo:
                u()
    assert err.value.errno in (errno.EACCES, errno.EPERM, errno.EROFS), repr(err.value)
    assert_names_the_publish(err.value, repo, None)
    check_unchanged(repo, serving.host, serving.config, serving.want)
    assert repo.publish(NAME, tiny.model) == 2
