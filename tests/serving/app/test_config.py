"""ServeConfig: TOML + flags, typed, validated at start with the field named."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from serving.app.config import (
    DEFAULT_MAX_QUEUE_SIZE,
    BatchingConfig,
    ConfigError,
    ServeConfig,
)


@pytest.fixture
def repo_dir(tmp_path: Path) -> Path:
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "config.pbtxt").write_text('name: "demo"\n')
    return tmp_path


def test_toml_then_flags(tmp_path: Path, repo_dir: Path):
    path = tmp_path / "serve.toml"
    path.write_text(
        f'model_repo = "{repo_dir}"\ngrpc_port = 9001\npoll_s = 2\n'
        "[batching]\nmax_batch_size = 16\npreferred_batch_sizes = [4, 8]\n"
    )
    cfg = ServeConfig.from_toml(path).with_overrides(grpc_port=0, metrics_port=None, model=None)
    cfg.validate()
    assert cfg.model_repo == repo_dir and cfg.grpc_port == 0 and cfg.poll_s == 2.0
    assert cfg.metrics_port is None and cfg.model == "demo"  # the repository's only model
    policy = cfg.batching.policy()
    assert (policy.max_batch_size, policy.preferred_sizes) == (16, (4, 8))
    assert policy.max_queue_size == DEFAULT_MAX_QUEUE_SIZE


@pytest.mark.parametrize(
    ("toml", "field"),
    [
        ("grpc_port = 'x'", "grpc_port"),
        ("grpc_port = true", "grpc_port"),
        ("grpc_port = 70000", "grpc_port"),
        ("metrics_port = -1", "metrics_port"),
        ("drain_timeout_s = 0", "drain_timeout_s"),
        ("poll_s = -1", "poll_s"),
        ("colour = 'red'", "colour"),
        ("[batching]\nmax_batch_size = 0", "batching.max_batch_size"),
        ("[batching]\nmax_queue_delay_ms = -1", "batching.max_queue_delay_ms"),
        ("[batching]\nmax_batch_size = 4\npreferred_batch_sizes = [8]", "batching.preferred"),
        ("[batching]\nsize = 3", "batching.size"),
        ("model = 'other'", "model"),
    ],
)
def test_bad_values_name_the_field(tmp_path: Path, repo_dir: Path, toml: str, field: str):
    path = tmp_path / "serve.toml"
    head, _, tail = toml.partition("[batching]")
    path.write_text(f'model_repo = "{repo_dir}"\n{head}\n' + (f"[batching]{tail}" if tail else ""))
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        ServeConfig.from_toml(path).validate()


def test_missing_repo_and_ambiguous_model_are_refused(tmp_path: Path, repo_dir: Path):
    with pytest.raises(ConfigError, match=r"^model_repo"):
        ServeConfig().validate()
    with pytest.raises(ConfigError, match=r"^model_repo"):
        ServeConfig(model_repo=tmp_path / "nope").validate()
    (repo_dir / "other").mkdir()
    (repo_dir / "other" / "config.pbtxt").write_text("")
    with pytest.raises(ConfigError, match=r"^model: .* 2 models"):
        ServeConfig(model_repo=repo_dir).validate()
    with pytest.raises(ConfigError, match="not valid TOML"):
        bad = tmp_path / "bad.toml"
        bad.write_text("= 1")
        ServeConfig.from_toml(bad)


def test_unset_batching_keys_come_from_config_pbtxt():
    pbtxt = """
    name: "demo" max_batch_size: 64
    dynamic_batching {
      max_queue_delay_microseconds: 500 preferred_batch_size: [16, 32]
      default_queue_policy { max_queue_size: 100 }
    }"""
    mc = text_format.Parse(pbtxt, model_config_pb2.ModelConfig())
    p = BatchingConfig().policy(mc)
    assert (p.max_batch_size, p.max_queue_delay_s, p.max_queue_size) == (64, 0.0005, 100)
    assert p.preferred_sizes == (16, 32)
    p = BatchingConfig(max_batch_size=8, max_queue_size=5).policy(mc)  # the serve config wins
    assert (p.max_batch_size, p.max_queue_size, p.preferred_sizes) == (8, 5, ())


def test_cli_refuses_a_bad_config_naming_the_field(repo_dir: Path):
    from typer.testing import CliRunner

    from recserve.cli import app

    runner = CliRunner()
    out = runner.invoke(
        app, ["serve", "model", "--model-repo", str(repo_dir), "--grpc-port", "70000"]
    )
    assert out.exit_code == 2 and "grpc_port (--grpc-port): must be in [0, 65535]" in out.output


def test_front_ends_take_live_updates_but_not_a_group_or_a_router(repo_dir: Path):
    split = ServeConfig(model_repo=repo_dir, frontends=2, state_dir=repo_dir / "state")
    split.validate()  # one engine process: one copy, one update log writer
    with pytest.raises(ConfigError, match="frontends: not with processes"):
        ServeConfig(model_repo=repo_dir, frontends=2, processes=2).validate()
    with pytest.raises(ConfigError, match="processes: live updates"):
        ServeConfig(model_repo=repo_dir, processes=2, state_dir=repo_dir / "state").validate()
    with pytest.raises(ConfigError, match=r"frontends \(--frontends\): must be in \[0, 256\]"):
        ServeConfig(model_repo=repo_dir, frontends=-1).validate()
