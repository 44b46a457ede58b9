"""A test mode that fails on every op which would synchronise a GPU or give a shape from data.

The device path of a served forward (tables, tower, search with its plan, scoring head, top-K)
must run on a GPU with no host synchronisation but the answer's copy back, and with shapes fixed
by the batch bucket, so that one CUDA graph records it. A machine without a GPU cannot capture
a graph, but it can run the same code on CPU tensors under :class:`DeviceDiscipline`, which
treats every tensor as if it lived on the device and raises :class:`DeviceSyncError` on:

* a read of tensor data into Python: ``aten._local_scalar_dense`` (``.item()``, ``int(t)``,
  ``bool(t)``, an ``if`` on a tensor), ``aten.equal`` / ``aten.is_nonzero``, ``.tolist()``,
  ``.numpy()``, ``__array__``;
* a copy to the host: ``.cpu()``, ``.to("cpu")`` named explicitly (``.to(x.device)`` is
  device-neutral and passes), and a host-made tensor entering the path (``torch.tensor``,
  ``torch.as_tensor``, ``torch.from_numpy``: a host-to-device copy);
* an op whose output shape depends on data: ``nonzero`` / ``argwhere``, ``masked_select``,
  boolean-mask indexing (``aten.index`` / ``index_put`` with a bool index), ``unique*``,
  ``repeat_interleave`` without ``output_size``, ``bincount``.

The error names the op and the innermost Python frame outside torch and this module (the line
of the path that asked for it). Usage::

    with DeviceDiscipline():
        ids, scores = model(batch, k)   # raises DeviceSyncError at the first offending op

``torch.compile(fullgraph=True)`` is the other half of the check (a graph break is an op the
trace cannot keep on the device); this mode also covers what dynamo would trace through.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten

SYNCING = {
    _aten._local_scalar_dense.default: "reads a tensor's value into Python (.item / int / bool)",
    # under inference_mode the mode sees .item() before it decomposes
    _aten.item.default: "reads a tensor's value into Python (.item / int / bool)",
    _aten.allclose.default: "returns a Python bool of tensor data",
    _aten.equal.default: "returns a Python bool of tensor data",
    _aten.is_nonzero.default: "returns a Python bool of tensor data",
    _aten.nonzero.default: "an output shape from data",
    _aten.nonzero_numpy.default: "an output shape from data",
    _aten.argwhere.default: "an output shape from data",
    _aten.masked_select.default: "an output shape from data",
    _aten._unique.default: "an output shape from data",
    _aten._unique2.default: "an output shape from data",
    _aten.unique_dim.default: "an output shape from data",
    _aten.unique_consecutive.default: "an output shape from data",
    _aten.unique_dim_consecutive.default: "an output shape from data",
    _aten.bincount.default: "an output shape from data",
}
"""Ops that fail whatever their arguments, with why."""

_BOOL_INDEXED = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default}
_REPEATS = {_aten.repeat_interleave.Tensor, _aten.repeat_interleave.self_Tensor}

_HOST_METHODS = ("tolist", "numpy", "cpu", "__array__")
_HOST_FACTORIES = ("tensor", "as_tensor", "from_numpy")
_HERE = os.path.abspath(__file__)
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


class DeviceSyncError(RuntimeError):
    """An op of the device path that would synchronise a GPU or give a shape from data."""


def caller_frame() -> str:
    """``file:line in function`` of the innermost frame outside torch and this module: the
    line of the device path that asked for the op."""
    for frame in reversed(traceback.extract_stack()):
        name = os.path.abspath(frame.filename)
        if name != _HERE and not name.startswith(_TORCH):
            return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return "<unknown frame>"


def _fail(op: str, why: str) -> DeviceSyncError:
    return DeviceSyncError(f"{op} {why}, at {caller_frame()}")


def _bool_index(indices: Any) -> bool:
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
        for i in (indices or ())
    )


def _check(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    why = SYNCING.get(func)
    if why is not None:
        raise _fail(str(func), why)
    if func in _BOOL_INDEXED and _bool_index(args[1] if len(args) > 1 else kwargs.get("indices")):
        raise _fail(str(func), "a boolean-mask index: an output shape from data")
    if func in _REPEATS and kwargs.get("output_size") is None:
        raise _fail(str(func), "without output_size: an output shape from data")


class DeviceDiscipline(TorchDispatchMode):
    """Raises :class:`DeviceSyncError` on the first op that would synchronise a GPU or give a
    shape from data (the module's docstring lists them); the host-reading tensor methods and
    host-made tensors fail the same way while the mode is on. Not re-entrant across threads:
    a test mode, one forward at a time."""

    def __init__(self) -> None:
        super().__init__()
        self._saved: list[tuple[Any, str, Any]] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        _check(func, args, kwargs)
        return func(*args, **kwargs)

    def __enter__(self) -> DeviceDiscipline:
        for name in _HOST_METHODS:
            self._patch(torch.Tensor, name, _refuse(f"Tensor.{name}", "copies to the host"))
        for name in _HOST_FACTORIES:
            self._patch(torch, name, _refuse(f"torch.{name}", "makes a tensor on the host"))
        self._patch(torch.Tensor, "to", _checked_to(torch.Tensor.to))
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for owner, name, old in reversed(self._saved):
            setattr(owner, name, old)
        self._saved.clear()

    def _patch(self, owner: Any, name: str, new: Callable[..., Any]) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)


def _refuse(op: str, why: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise _fail(op, why)

    return refuse


def _checked_to(to: Callable[..., Any]) -> Callable[..., Any]:
    """``Tensor.to`` failing where the host is named explicitly (``"cpu"`` as text)."""

    def checked(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, str) and target.startswith("cpu"):
            raise _fail('Tensor.to("cpu")', "copies to the host")
        return to(self, *args, **kwargs)

    return checked
