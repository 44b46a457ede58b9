"""The CLI as a user runs it: a real process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import Result
from typer.testing import CliRunner

from recserve.cli import app
from retrieval.artifact import load_model


def run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "recserve", *args], capture_output=True, text=True, timeout=timeout
    )


def invoke(*args: str) -> Result:
    """The CLI in this process (typer's runner): for checks of its wiring that need no process
    of their own (``--help`` of each group, refused names), ~1 s less each than :func:`run`."""
    return CliRunner().invoke(app, list(args))


@pytest.mark.multiproc  # runs the CLI as a process
def test_help_lists_the_jobs_and_groups():
    out = run("--help")
    assert out.returncode == 0
    for job in ("demo", "train", "score", "serve", "cluster", "test", "bench", "data"):
        assert job in out.stdout
    groups = {
        "serve": ("model", "router", "shard", "embeddings"),
        "cluster": ("up", "status", "restart", "down"),
        "test": ("load", "soak"),
        "data": ("movielens",),
    }
    for group, commands in groups.items():
        res = invoke(group, "--help")
        assert res.exit_code == 0, res.output
        for command in commands:
            assert command in res.stdout, (group, command)


def test_old_command_names_are_gone():
    for old in ("shard-server", "embed-server", "loadtest", "soak", "bench-ann", "fetch-movielens"):
        res = invoke(old, "--help")
        assert res.exit_code == 2 and "No such command" in res.stderr, old


@pytest.mark.multiproc
def test_help_loads_no_torch():
    """`recserve --help` (and a group's) stays fast: commands import their work lazily."""
    code = (
        "import sys; from typer.testing import CliRunner; from recserve.cli import app; "
        "r = CliRunner(); "
        "assert all(r.invoke(app, a).exit_code == 0 for a in (['--help'], ['serve', 'router', "
        "'--help'], ['test', 'load', '--help'])); "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("args", "choices"),
    [
        (("score", "--model-repo", ".", "--users", "u", "--out", "o", "--engine", "spark"),
         "'local', 'ray'"),
        (("test", "load", "--target", "h:1", "--model-repo", ".", "--protocol", "ftp"),
         "'grpc', 'http'"),
    ],
)  # fmt: skip
def test_choices_are_refused_naming_them(args, choices):
    from typer.testing import CliRunner

    from recserve.cli import app

    out = CliRunner().invoke(app, list(args))
    text = " ".join(out.output.replace("│", " ").split())  # the error box wraps lines
    assert out.exit_code == 2 and f"is not one of {choices}" in text, out.output


def test_demo_data_names_what_it_accepts(tmp_path):
    """--data takes movielens, synthetic or an imported folder; anything else is refused
    before any work, naming the three."""
    from typer.testing import CliRunner

    from recserve.cli import app

    out = CliRunner().invoke(app, ["demo", "--data", str(tmp_path)])
    text = " ".join(out.output.split())
    assert out.exit_code == 2, out.output
    assert "is neither movielens, synthetic nor a data set folder" in text
    assert "recserve data import --out FOLDER" in text


@pytest.mark.multiproc  # recserve bench runs the script as a process
def test_bench_runs_a_script_of_the_current_directory(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from recserve.cli import app

    monkeypatch.chdir(tmp_path)
    out = CliRunner().invoke(app, ["bench", "ann"])
    assert out.exit_code == 2 and "no bench/ann.py here" in out.output
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "echo.py").write_text("import sys; sys.exit(len(sys.argv) - 1)")
    out = CliRunner().invoke(app, ["bench", "echo", "--a", "b", "c"])
    assert out.exit_code == 3, out.output


@pytest.mark.slow
@pytest.mark.multiproc
def test_demo_on_synthetic_data_trains_serves_and_saves(tmp_path: Path):
    out = run("demo", "--data", "synthetic", "--epochs", "1", "--quiet", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "recall@100" in out.stdout and "popularity baseline" in out.stdout
    assert "same results: True" in out.stdout
    model = load_model(tmp_path / "model")
    assert model.index.ntotal == 5000


@pytest.mark.multiproc
def test_demo_rejects_unknown_data():
    out = run("demo", "--data", "nope", "--quiet")
    assert out.returncode != 0 and "synthetic" in (out.stdout + out.stderr)


def test_server_flags_are_their_config_fields():
    """Each flag of `serve model | router | shard` sets the config field of its name, with the
    field's help and default: the CLI and the config cannot disagree."""
    import click
    import typer

    from common.security import SecurityConfig
    from recserve.cli import app
    from recserve.options import field_default, field_help
    from serving.app.config import ServeConfig
    from serving.sharding.config import RouterConfig, ShardServerConfig
    from sharded_tables.remote.config import EmbeddingServerConfig

    serve = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    configs = {
        "model": (ServeConfig, SecurityConfig),
        "router": (RouterConfig, ServeConfig, SecurityConfig),
        "shard": (ShardServerConfig, SecurityConfig),
        "embeddings": (EmbeddingServerConfig, SecurityConfig),
    }
    free = {"config", "help", "shards", "embedding_servers"}  # a file, or text parsed to a list
    for command, classes in configs.items():
        for param in serve.commands[command].params:
            if param.name in free or not isinstance(param, click.Option):
                continue
            cls = next((c for c in classes if param.name in c.model_fields), None)
            assert cls is not None, f"serve {command} {param.opts}: no config field"
            assert param.opts[0] == cls.flags[param.name].split("/")[0], (command, param.name)
            assert param.help == field_help(cls, param.name), (command, param.name)
            if cls in (ShardServerConfig, EmbeddingServerConfig):  # no file: the flag's default
                expected = field_default(cls, param.name)
                assert param.default == (None if expected is ... else expected), param.name
            else:  # flags override serve.toml: unset unless given; help shows the default
                assert param.default is None, (command, param.name)
    up = typer.main.get_command(app).commands["cluster"].commands["up"]  # type: ignore[attr-defined]
    deadline = next(p for p in up.params if p.name == "shard_deadline_ms")
    assert deadline.default == RouterConfig().shard_deadline_ms


def test_kernels_builds_every_kernel_and_names_the_scan_path():
    import re

    from typer.testing import CliRunner

    from recserve.cli import app

    result = CliRunner().invoke(app, ["kernels"])
    assert result.exit_code == 0, result.output
    for name in ("IVF scan", "pooled lookup", "id map"):
        assert f"{name}: ready" in result.output
    assert re.search(r"int8 scan path on this CPU: (vnni|avx2|portable)", result.output)
