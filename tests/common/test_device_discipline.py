"""The device-discipline mode fails on each op that would synchronise a GPU or give a shape from
data, names the op and the line that asked for it, and lets fixed-shape device code through."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from common.device_discipline import DeviceDiscipline, DeviceSyncError

X = torch.arange(10.0)

REFUSED: dict[str, Callable[[], object]] = {
    "_local_scalar_dense": lambda: X[0].item(),
    "bool": lambda: bool(X.sum() > 0),
    "int": lambda: int(X[3]),
    "equal": lambda: torch.equal(X, X),
    "tolist": lambda: X.tolist(),
    "numpy": lambda: X.numpy(),
    "array": lambda: np.asarray(X),
    "cpu": lambda: X.cpu(),
    "to cpu": lambda: X.to("cpu"),
    "torch.tensor": lambda: torch.tensor([1, 2]),
    "from_numpy": lambda: torch.from_numpy(np.zeros(2)),
    "nonzero": lambda: X.nonzero(),
    "argwhere": lambda: torch.argwhere(X),
    "bool index": lambda: X[X > 3],
    "bool index put": lambda: X.clone().__setitem__(X > 3, 0.0),
    "masked_select": lambda: X.masked_select(X > 1),
    "unique": lambda: X.unique(),
    "unique_consecutive": lambda: X.unique_consecutive(),
    "repeat_interleave": lambda: torch.repeat_interleave(X, torch.full((10,), 2)),
    "bincount": lambda: torch.bincount(X.long()),
}


@pytest.mark.parametrize("inference", [False, True])
@pytest.mark.parametrize("name", list(REFUSED))
def test_refuses_each_syncing_op(name: str, inference: bool) -> None:
    """Also under inference_mode, where the mode sees some ops before they decompose."""
    with (
        torch.inference_mode(inference),
        DeviceDiscipline(),
        pytest.raises(DeviceSyncError) as err,
    ):
        REFUSED[name]()
    assert __file__ in str(err.value)  # the frame of the line that asked, not torch's


def test_names_the_op_and_the_frame() -> None:
    def planted(x: torch.Tensor) -> float:
        return x.sum().item()

    with DeviceDiscipline(), pytest.raises(DeviceSyncError) as err:
        planted(X)
    msg = str(err.value)
    assert "aten._local_scalar_dense" in msg
    assert "in planted" in msg and f"{__file__}:" in msg


def test_fixed_shape_ops_pass_and_methods_come_back() -> None:
    with DeviceDiscipline():
        top = (X * 2).topk(3).values
        kept = torch.where(X > 3, X, torch.zeros_like(X))
        rep = torch.repeat_interleave(X, torch.full((10,), 2), output_size=20)
        same = X.to(X.device)
        idx = X.long()[torch.arange(3)]  # an integer index keeps its shape
        ints = torch.repeat_interleave(X, 2)
    assert top.tolist() == [18.0, 16.0, 14.0] and kept.shape == X.shape
    assert rep.shape == (20,) and same.shape == X.shape and idx.shape == (3,)
    assert ints.shape == (20,)
    assert X.numpy().shape == (10,) and torch.tensor([1]).item() == 1  # restored on exit
