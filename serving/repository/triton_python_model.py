"""Triton Python backend of a recserve model; every published version holds a copy as ``model.py``.

Triton's stub process imports this file from ``<repo>/<model>/<version>/model.py``;
:meth:`TritonPythonModel.initialize` loads the artifact beside it (``<version>/model/``) with
:func:`retrieval.artifact.load_model`. The stub therefore needs recserve importable:

* the stub runs the first ``python3`` on ``PATH`` (put the venv's ``bin`` first) and inherits
  ``tritonserver``'s environment, so either install recserve into that venv (``pip install -e .``)
  or set ``PYTHONPATH=<recserve checkout>`` when starting ``tritonserver``;
* ``LD_LIBRARY_PATH`` must hold libpython's folder and ``site-packages/nvidia_pytriton.libs``;
* numpy < 2 (with numpy 2 the bundled stub returns empty outputs).

Tensors (``[B, ...]``, one request may carry several rows)::

    history int64 [B, H'] (any H'; cut / -1-padded to the model's history_len)
    categorical int64 [B, F], dense float32 [B, Dd], k int32 [B, 1], filter bytes [B, 1] (optional)
    seen int64 [B, S] (optional): every item the user consumed, never recommended (-1 pads)
    -> item_ids int64 [B, K], scores float32 [B, K]   K = the largest k of the request's rows

A model with id maps (``RetrievalModel.id_maps``) takes ``raw_history bytes [B, H']`` (the user's
own item ids, ``b""`` pads) instead of ``history``, ``raw_seen bytes [B, S]`` instead of ``seen``,
and answers ``raw_item_ids bytes [B, K]`` too (``serving/raw_ids.py``: an unknown raw id is
refused naming it; ``b""`` for a pad).

:meth:`TritonPythonModel.execute` checks each request on its own (a bad one gets an error
response naming the tensor; the others still run), then runs all good rows as ONE forward with
``K = max k`` and slices each request's share. Rows asking for fewer than their request's K get
``-1`` / ``-inf`` past their own k. Config ``parameters``: ``torch_threads`` (optional int).

The module imports without Triton (``triton_python_backend_utils`` is imported in
``initialize``), so :func:`check_inputs` and :func:`run_rows` are tested directly.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from retrieval.artifact import load_model
from retrieval.features import UserBatch
from retrieval.filters import parse_filter
from retrieval.model import RetrievalModel
from serving.raw_ids import decode_text, dense_history, raw_item_ids
from serving.types import RequestError

ARTIFACT_DIR = "model"
INPUTS = (
    "history", "categorical", "dense", "k", "filter", "seen", "raw_history", "raw_seen", "user"
)  # fmt: skip


class InputError(ValueError):
    """A request the backend refuses; the message starts with the tensor's name."""


@dataclass
class Rows:
    """One request's checked inputs (B rows)."""

    history: np.ndarray
    """``int64 [B, H]``, H = the model's history_len, ``-1`` pads."""
    categorical: np.ndarray
    """``int64 [B, F]``."""
    dense: np.ndarray
    """``float32 [B, Dd]``."""
    k: np.ndarray
    """``int64 [B]``."""
    filters: list[str | None]
    """One filter text per row (None: no filter)."""
    seen: np.ndarray | None = None
    """``int64 [B, S]`` items never recommended, ``-1`` pads (None: the history window only)."""
    user: np.ndarray | None = None
    """``int64 [B]`` users whose stored seen items are excluded (``-1``: none), for a model
    with a seen store (None: none named)."""


def _check_array(
    name: str, a: np.ndarray | None, dtype: Any, width: int | None, b: int
) -> np.ndarray:
    if a is None:
        raise InputError(f"{name}: missing")
    if a.ndim != 2 or a.shape[0] != b or (width is not None and a.shape[1] != width):
        want = f"[{b}, {width if width is not None else 'n'}]"
        raise InputError(f"{name}: expected shape {want}, got {list(a.shape)}")
    if a.dtype != dtype:
        raise InputError(f"{name}: expected {np.dtype(dtype)}, got {a.dtype}")
    return a


def _decode(name: str, value: Any) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise InputError(f"{name}: not UTF-8") from None
    if isinstance(value, str):
        return value
    raise InputError(f"{name}: expected bytes, got {type(value).__name__}")


def check_inputs(arrays: Mapping[str, np.ndarray | None], model: RetrievalModel) -> Rows:
    """One request's tensors -> :class:`Rows`; raises :class:`InputError` naming the tensor."""
    cfg = model.config
    hist = _history(arrays, model)
    if hist.ndim != 2 or hist.shape[0] < 1:
        raise InputError(f"history: expected shape [B, n] with B >= 1, got {list(hist.shape)}")
    b = int(hist.shape[0])
    _check_array("history", hist, np.int64, None, b)
    cat = _check_array(
        "categorical", arrays.get("categorical"), np.int64, len(cfg.user_features), b
    )
    dense = _check_array("dense", arrays.get("dense"), np.float32, cfg.dense_dim, b)
    k = _check_array("k", arrays.get("k"), np.int32, 1, b)[:, 0].astype(np.int64)
    if not np.isfinite(dense).all():
        raise InputError("dense: contains NaN or infinity")
    ntotal = model.index.ntotal
    bad_k = k[(k < 1) | (k > ntotal)]
    if bad_k.size:
        raise InputError(f"k: must be in [1, {ntotal}], got {int(bad_k[0])}")
    h = cfg.history_len
    history = np.full((b, h), -1, dtype=np.int64)  # [B, H], newest first
    history[:, : min(h, hist.shape[1])] = hist[:, :h]
    for field, feats in (
        ("history", {"history": torch.from_numpy(history)}),
        (
            "categorical",
            {
                f"user_{n}": torch.from_numpy(cat[:, j : j + 1])
                for j, n in enumerate(cfg.user_features)
            },
        ),
    ):
        try:
            model.tables.validate(feats)
        except ValueError as e:
            raise InputError(f"{field}: {e}") from None
    filters: list[str | None] = [None] * b
    raw = arrays.get("filter")
    if raw is not None:
        if raw.shape != (b, 1):
            raise InputError(f"filter: expected shape [{b}, 1], got {list(raw.shape)}")
        schema = model.index.schema
        for row in range(b):
            text = _decode("filter", raw[row, 0]).strip()
            if not text:
                continue
            try:
                schema.check(parse_filter(text))  # unknown attribute or value
            except ValueError as e:
                msg = str(e)
                raise InputError(msg if msg.startswith("filter") else f"filter: {msg}") from None
            filters[row] = text
    seen = _seen(arrays, model, b)
    return Rows(history, cat.copy(), dense.copy(), k, filters, seen, _user(arrays, model, b))


def _user(
    arrays: Mapping[str, np.ndarray | None], model: RetrievalModel, b: int
) -> np.ndarray | None:
    """``user`` ``[B, 1]`` -> ``[B] int64``; refused for a model without a seen store."""
    user = arrays.get("user")
    if user is None:
        return None
    if model.seen_store is None:
        raise InputError("user: the model keeps no seen store (model.seen_store): send seen")
    _check_array("user", user, np.int64, 1, b)
    if bool((user < -1).any()):
        raise InputError(f"user: a user index is >= 0 (-1: none), got {int(user.min())}")
    return user.reshape(b).copy()


def _seen(
    arrays: Mapping[str, np.ndarray | None], model: RetrievalModel, b: int
) -> np.ndarray | None:
    """``seen`` ``[B, S]`` as given, or ``raw_seen`` mapped by the model's item map (``b""``
    pads -> ``-1``), ids checked against the catalog; None when neither is given."""
    seen, raw = arrays.get("seen"), arrays.get("raw_seen")
    if raw is not None:
        if seen is not None:
            raise InputError("raw_seen: give seen or raw_seen, not both")
        if model.id_maps is None:
            raise InputError("raw_seen: the model has no id maps: send seen, the dense ids")
        _check_array("raw_seen", raw, object, None, b)
        try:
            text = decode_text(raw, "raw_seen")  # [B, S] str
            rows = [dense_history(row, model.id_maps.items, "raw_seen") for row in text]
        except RequestError as e:
            raise InputError(str(e)) from None
        seen = np.stack(rows).reshape(raw.shape)  # [B, S] int64
    if seen is None:
        return None
    _check_array("seen", seen, np.int64, None, b)
    n = model.config.num_items
    bad = seen[(seen < -1) | (seen >= n)]
    if bad.size:
        raise InputError(f"seen: item id {int(bad[0])} is not in [0, {n})")
    return seen.copy()


def _user_batch(requests: Sequence[Rows]) -> torch.Tensor | None:
    """The requests' users as one ``[B] int64`` (``-1``: none); None when none names one."""
    if all(r.user is None for r in requests):
        return None
    parts = [r.user if r.user is not None else np.full(len(r.k), -1) for r in requests]
    return torch.from_numpy(np.concatenate(parts).astype(np.int64))


def _seen_batch(requests: Sequence[Rows]) -> torch.Tensor | None:
    """The requests' seen rows as one ``[B, S] int64`` (``-1`` padded to the widest); None
    when no request has any."""
    width = max((r.seen.shape[1] for r in requests if r.seen is not None), default=0)
    if width == 0:
        return None
    out = np.full((sum(len(r.k) for r in requests), width), -1, dtype=np.int64)  # [B, S]
    start = 0
    for r in requests:
        if r.seen is not None:
            out[start : start + len(r.k), : r.seen.shape[1]] = r.seen
        start += len(r.k)
    return torch.from_numpy(out)


def _history(arrays: Mapping[str, np.ndarray | None], model: RetrievalModel) -> np.ndarray:
    """``history`` as given, or ``raw_history`` ``[B, H']`` mapped to dense ids by the model's
    item map (``-1`` for ``b""`` pads); :class:`InputError` naming the tensor."""
    hist, raw = arrays.get("history"), arrays.get("raw_history")
    if raw is None:
        if hist is None:
            raise InputError("history: missing")
        return hist
    if hist is not None:
        raise InputError("raw_history: give history or raw_history, not both")
    if model.id_maps is None:
        raise InputError("raw_history: the model has no id maps: send history, the dense ids")
    if raw.ndim != 2 or raw.shape[0] < 1:
        raise InputError(f"raw_history: expected shape [B, n] with B >= 1, got {list(raw.shape)}")
    try:
        text = decode_text(raw)  # [B, H'] str
        rows = [dense_history(row, model.id_maps.items) for row in text]
    except RequestError as e:
        raise InputError(str(e)) from None
    return np.stack(rows).reshape(raw.shape)  # [B, H'] int64


def raw_outputs(model: RetrievalModel, ids: np.ndarray) -> np.ndarray | None:
    """``raw_item_ids`` of an answer ``ids [B, K]`` as UTF-8 ``bytes [B, K]``; None for a model
    without id maps (the output is not declared)."""
    if model.id_maps is None:
        return None
    text = raw_item_ids(ids, model.id_maps.items)
    return np.array([t.encode("utf-8") for t in text.reshape(-1)], dtype=object).reshape(ids.shape)


def run_rows(
    model: RetrievalModel, requests: Sequence[Rows], device: torch.device | str = "cpu"
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Checked requests -> ONE forward -> ``(item_ids int64 [B_i, K_i], scores float32 [B_i, K_i])``
    per request, ``K_i`` = the request's largest k (trusted: :func:`check_inputs` ran)."""
    history = np.concatenate([r.history for r in requests])  # [B, H]
    cat = np.concatenate([r.categorical for r in requests])  # [B, F]
    dense = np.concatenate([r.dense for r in requests])  # [B, Dd]
    k = np.concatenate([r.k for r in requests])  # [B]
    fb = model.index.schema.compile([f for r in requests for f in r.filters])
    batch = UserBatch(
        torch.from_numpy(history),
        torch.from_numpy(cat),
        torch.from_numpy(dense),
        fb.masks,
        fb.negate,
        _seen_batch(requests),
        user=_user_batch(requests),
        filter_none=fb.neg_masks,
        filter_verify=fb.verify,
    ).to(device)
    with torch.inference_mode():
        ids_t, scores_t = model(batch, int(k.max()))  # [B, K], [B, K]
    ids, scores = ids_t.cpu().numpy(), scores_t.cpu().numpy()
    out, start = [], 0
    for r in requests:
        rows = slice(start, start + len(r.k))
        width = int(r.k.max())
        ids_r, scores_r = ids[rows, :width].copy(), scores[rows, :width].copy()
        beyond = np.arange(width)[None, :] >= r.k[:, None]  # [B_i, K_i]: past the row's own k
        ids_r[beyond], scores_r[beyond] = -1, -np.inf
        out.append((ids_r, scores_r))
        start = rows.stop
    return out


class TritonPythonModel:
    """The Triton Python backend lifecycle: ``initialize`` / ``execute`` / ``finalize``."""

    def initialize(self, args: dict[str, str]) -> None:
        """Loads ``<model folder>/<version>/model/``; raises (Triton marks the model not ready)
        when the artifact does not load or cannot answer a warm-up request."""
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        if params.get("torch_threads"):
            torch.set_num_threads(int(params["torch_threads"]))
        self.device = (
            f"cuda:{args.get('model_instance_device_id', '0')}"
            if args.get("model_instance_kind") == "GPU" and torch.cuda.is_available()
            else "cpu"
        )
        version_dir = Path(args["model_repository"]) / args["model_version"]
        self.model = load_model(version_dir / ARTIFACT_DIR, map_location=self.device).eval()
        cfg = self.model.config
        warm = Rows(
            np.full((1, cfg.history_len), -1, np.int64),
            np.zeros((1, len(cfg.user_features)), np.int64),
            np.zeros((1, cfg.dense_dim), np.float32),
            np.ones(1, np.int64),
            [None],
        )
        run_rows(self.model, [warm], self.device)

    def execute(self, requests: list[Any]) -> list[Any]:
        """One response per request, in order; the good requests run as one forward."""
        pb = self.pb
        responses: list[Any] = [None] * len(requests)
        good: list[int] = []
        rows: list[Rows] = []
        for i, req in enumerate(requests):
            try:
                arrays = {}
                for name in INPUTS:
                    t = pb.get_input_tensor_by_name(req, name)
                    arrays[name] = None if t is None else t.as_numpy()
                rows.append(check_inputs(arrays, self.model))
                good.append(i)
            except InputError as e:
                responses[i] = pb.InferenceResponse(output_tensors=[], error=_error(pb, str(e)))
        if good:
            try:
                outs = run_rows(self.model, rows, self.device)
            except Exception as e:  # the batch failed as a whole: every request hears why
                err = f"internal: {type(e).__name__}: {e}"
                for i in good:
                    responses[i] = pb.InferenceResponse(
                        output_tensors=[], error=pb.TritonError(err)
                    )
                return responses
            for i, (ids, scores) in zip(good, outs, strict=True):
                tensors = [pb.Tensor("item_ids", ids), pb.Tensor("scores", scores)]
                raw = raw_outputs(self.model, ids)
                if raw is not None:
                    tensors.append(pb.Tensor("raw_item_ids", raw))
                responses[i] = pb.InferenceResponse(output_tensors=tensors)
        return responses

    def finalize(self) -> None:
        self.model = None  # type: ignore[assignment]


def _error(pb: Any, message: str) -> Any:
    """An INVALID_ARG ``TritonError`` where the backend has codes (Triton >= 23.xx)."""
    code = getattr(pb.TritonError, "INVALID_ARG", None)
    return pb.TritonError(message) if code is None else pb.TritonError(message, code)
