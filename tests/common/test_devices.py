"""``--device`` values: checked at start, naming the field and what torch sees."""

from __future__ import annotations

import pytest
import torch

from common.devices import check_device

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


def test_cpu_is_always_there():
    assert check_device("cpu") == torch.device("cpu")


@no_gpu
@pytest.mark.parametrize("name", ["cuda", "cuda:1"])
def test_a_gpu_torch_cannot_see_is_refused_naming_the_field(name):
    with pytest.raises(
        ValueError, match=rf"^serve.device: {name} asked for, but torch .* sees no GPU"
    ):
        check_device(name, "serve.device")


@pytest.mark.gpu
def test_a_device_index_beyond_the_machine_is_refused():
    n = torch.cuda.device_count()
    assert check_device("cuda:0").type == "cuda"
    with pytest.raises(ValueError, match=f"sees {n} CUDA device"):
        check_device(f"cuda:{n}")


@no_gpu
@pytest.mark.parametrize(
    "args",
    [
        ("serve", "model", "--model-repo", "{repo}", "--device", "cuda"),
        (
            "serve",
            "router",
            "--model-repo",
            "{repo}",
            "--shards",
            "127.0.0.1:1",
            "--device",
            "cuda",
        ),
        ("serve", "shard", "--model-repo", "{repo}", "--shard", "0", "--device", "cuda"),
        (
            "score",
            "--model-repo",
            "{repo}",
            "--users",
            "u.parquet",
            "--out",
            "o",
            "--device",
            "cuda",
        ),
    ],
)
def test_every_device_flag_refuses_a_gpu_it_cannot_use_before_loading(args, tmp_path):
    from typer.testing import CliRunner

    from recserve.cli import app

    out = CliRunner().invoke(app, [a.format(repo=tmp_path) for a in args])
    text = " ".join(out.output.split())
    assert out.exit_code == 2, out.output
    assert "cuda asked for, but torch" in text and "sees no GPU" in text, text


def test_a_device_that_is_no_device_is_refused_by_the_config():
    from common.config import ConfigError
    from serving.app.config import ServeConfig

    with pytest.raises(ConfigError, match="device"):
        ServeConfig().with_overrides(device="gpu0")
