"""The document shard's wire format (``serving/protos/shard.proto``): tensors <-> raw bytes.

The router encodes a request once per round and sends the same bytes to every shard; a shard
decodes it, checking that every size adds up (a bad message is a :class:`ValueError` naming the
field, answered INVALID_ARGUMENT), and encodes its :class:`Candidates`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from retrieval.filter_verify import FilterVerify
from retrieval.filters import FilterBatch
from retrieval.index.plan import SearchPlan, kinds
from retrieval.index.search import Candidates
from serving.protos import shard_pb2 as pb


def tensor_bytes(t: torch.Tensor, dtype: type) -> bytes:
    """A tensor as raw little-endian bytes of ``dtype`` (row-major)."""
    if t.is_cpu and not t.requires_grad:  # a served answer: no call it does not need
        return t.numpy().astype(dtype, copy=False).tobytes()  # tobytes: C order, any strides
    return t.detach().cpu().contiguous().numpy().astype(dtype, copy=False).tobytes()


def bytes_array(data: bytes, dtype: type, shape: tuple[int, ...], field: str) -> np.ndarray:
    """Raw bytes -> a read-only array ``shape`` of ``dtype`` over them (no copy); ``ValueError``
    naming ``field`` when the size is not that."""
    want = math.prod(shape) * np.dtype(dtype).itemsize  # not np.prod: it builds an array
    if len(data) != want:
        raise ValueError(f"{field}: expected {want} bytes for {list(shape)}, got {len(data)}")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def bytes_tensor(data: bytes, dtype: type, shape: tuple[int, ...], field: str) -> torch.Tensor:
    """Raw bytes -> a tensor ``shape`` of ``dtype`` (its own copy); ``ValueError`` naming
    ``field`` when the size is not that."""
    return torch.from_numpy(bytes_array(data, dtype, shape, field).copy())


def encode_request(
    model: str,
    version: int,
    q: torch.Tensor,
    fb: FilterBatch,
    plan: SearchPlan,
    with_vectors: bool,
    sequence: int = 0,
) -> pb.SearchRequest:
    """``q [B, D]``, the filter ``masks [B, C, W]`` / ``negate [B, C]`` / ``exclude [B, S]`` /
    ``neg_masks [B, C, W]`` (sent only where a clause has a "none of these bits" part)
    and the plan (its ``lists [B, P]`` and ``floor [B]`` when a second round gives them, its
    ``least`` and ``hold [B]`` when lists go by their sizes),
    against ``version`` after ``sequence`` live updates."""
    b, d = q.shape
    _, c, w = fb.masks.shape
    lists, ex, floor = plan.lists, fb.exclude, plan.floor
    return pb.SearchRequest(
        model=model,
        version=version,
        batch=b,
        dim=d,
        queries=tensor_bytes(q.float(), np.float32),
        k=plan.k,
        r=plan.r,
        nprobe=tensor_bytes(plan.nprobe, np.int64),
        exact=tensor_bytes(plan.exact, np.uint8),
        clauses=c,
        words=w,
        filter_masks=tensor_bytes(fb.masks, np.int64),
        filter_negate=tensor_bytes(fb.negate, np.uint8),
        with_vectors=with_vectors,
        sequence=sequence,
        list_width=0 if lists is None else int(lists.shape[1]),
        lists=b"" if lists is None else tensor_bytes(lists, np.int32),
        exclude_width=0 if ex is None else int(ex.shape[1]),
        exclude=b"" if ex is None else tensor_bytes(ex, np.int64),
        floor=b"" if floor is None else tensor_bytes(floor, np.float32),
        least=b"" if plan.least is None else tensor_bytes(plan.least, np.int64),
        hold=b"" if plan.hold is None else tensor_bytes(plan.hold, np.int64),
        filter_none=b"" if fb.neg_masks is None else tensor_bytes(fb.neg_masks, np.int64),
        **_verify_fields(fb.verify),
    )


def _verify_fields(v: FilterVerify | None) -> dict[str, Any]:
    """A batch's exact clauses as ``SearchRequest`` fields (none: no field set)."""
    if v is None:
        return {}
    _, c2, w2 = v.masks.shape
    _, a, s = v.atoms.shape
    return {
        "verify_rows": tensor_bytes(v.rows, np.uint8),
        "verify_clauses": c2,
        "verify_words": w2,
        "verify_masks": tensor_bytes(v.masks, np.int64),
        "verify_negate": tensor_bytes(v.negate, np.uint8),
        "verify_none": b"" if v.neg_masks is None else tensor_bytes(v.neg_masks, np.int64),
        "verify_atoms": a,
        "verify_values": s,
        "verify_codes": tensor_bytes(v.atoms, np.int64),
    }


def _decode_verify(msg: pb.SearchRequest, b: int) -> FilterVerify | None:
    """``SearchRequest``'s exact clauses (None: none); ``ValueError`` naming the field."""
    if not msg.verify_rows:
        return None
    c2, w2, a, s = msg.verify_clauses, msg.verify_words, msg.verify_atoms, msg.verify_values
    if min(c2, w2, a, s) < 0:
        raise ValueError(f"verify sizes: must be >= 0, got {c2}, {w2}, {a}, {s}")
    if w2 < msg.words:
        raise ValueError(f"verify_words: must be >= words={msg.words}, got {w2}")
    rows = bytes_flags(msg.verify_rows, (b,), "verify_rows")
    masks = bytes_tensor(msg.verify_masks, np.int64, (b, c2, w2), "verify_masks")
    negate = bytes_flags(msg.verify_negate, (b, c2), "verify_negate")
    none = None
    if msg.verify_none:
        none = bytes_tensor(msg.verify_none, np.int64, (b, c2, w2), "verify_none")
    atoms = bytes_tensor(msg.verify_codes, np.int64, (b, a, s), "verify_codes")
    if atoms.numel() and int(atoms.min()) < -1:
        raise ValueError("verify_codes: every entry must be a value code (>= 0) or -1")
    return FilterVerify(masks, negate, none, atoms, rows)


def bytes_flags(data: bytes, shape: tuple[int, ...], field: str) -> torch.Tensor:
    """Raw bytes of 0 / 1 -> a bool tensor ``shape`` (its own copy); ``ValueError`` naming
    ``field`` when the size is not that or a byte is neither."""
    if data.translate(None, b"\x00\x01"):
        raise ValueError(f"{field}: every byte must be 0 or 1")
    return torch.from_numpy(bytes_array(data, np.bool_, shape, field).copy())


def decode_request(msg: pb.SearchRequest) -> tuple[torch.Tensor, FilterBatch, SearchPlan]:
    """-> ``(q [B, D], filters, plan)``; ``ValueError`` naming the field when sizes disagree."""
    b, d, c, w = msg.batch, msg.dim, msg.clauses, msg.words
    for name, v in (("batch", b), ("dim", d), ("k", msg.k)):
        if v < 1:
            raise ValueError(f"{name}: must be >= 1, got {v}")
    if msg.r < msg.k:
        raise ValueError(f"r: must be >= k={msg.k}, got {msg.r}")
    if c < 0 or w < 0:
        raise ValueError(f"clauses, words: must be >= 0, got {c}, {w}")
    # checked as NumPy views of the bytes (for a few rows a NumPy check costs far less than a
    # torch op's dispatch), then
    # each copied once into its tensor
    q = bytes_tensor(msg.queries, np.float32, (b, d), "queries")
    nprobe = bytes_array(msg.nprobe, np.int64, (b,), "nprobe")
    if nprobe.min() < 1:
        raise ValueError("nprobe: every row must probe >= 1 list")
    exact = bytes_flags(msg.exact, (b,), "exact")
    masks = bytes_tensor(msg.filter_masks, np.int64, (b, c, w), "filter_masks")
    negate = bytes_flags(msg.filter_negate, (b, c), "filter_negate")
    none = None
    if msg.filter_none:
        none = bytes_tensor(msg.filter_none, np.int64, (b, c, w), "filter_none")
    lists = None
    if msg.list_width > 0:
        lists = bytes_array(msg.lists, np.int32, (b, msg.list_width), "lists")
        if lists.min() < -1:
            raise ValueError("lists: every entry must be a list id (>= 0) or -1")
    exclude = None
    if msg.exclude_width > 0:
        exclude = bytes_array(msg.exclude, np.int64, (b, msg.exclude_width), "exclude")
        if exclude.min() < -1:
            raise ValueError("exclude: every entry must be an item id (>= 0) or -1")
    floor = None
    if msg.floor:
        floor = bytes_array(msg.floor, np.float32, (b,), "floor")
        if np.isnan(floor).any():
            raise ValueError("floor: every row's floor must be a number (-inf: none)")
    least = hold = None
    if msg.least or msg.hold:
        least = bytes_array(msg.least, np.int64, (b,), "least")
        hold = bytes_array(msg.hold, np.int64, (b,), "hold")
        if least.min() < 1 or (least > nprobe).any():
            raise ValueError("least: every row's must be in [1, its nprobe]")
        if hold.min() < 0:
            raise ValueError("hold: every row's must be >= 0")
    plan = SearchPlan(
        msg.k,
        msg.r,
        torch.from_numpy(nprobe.copy()),
        kinds(exact),
        None if lists is None else torch.from_numpy(lists.astype(np.int64)),
        floor=None if floor is None else torch.from_numpy(floor.copy()),
        least=None if least is None else torch.from_numpy(least.copy()),
        hold=None if hold is None else torch.from_numpy(hold.copy()),
        exact_rows=exact,
    )
    ex_t = None if exclude is None else torch.from_numpy(exclude.copy())
    fb = FilterBatch(masks, negate, ex_t, none, _decode_verify(msg, b))
    return q, fb, plan


def encode_response(shard: int, version: int, c: Candidates) -> pb.SearchResponse:
    return pb.SearchResponse(
        shard=shard,
        version=version,
        width=c.width,
        ids=tensor_bytes(c.keys, np.int64),
        approx=tensor_bytes(c.approx, np.float32),
        scores=tensor_bytes(c.scores, np.float32),
        vectors=b"" if c.vectors is None else tensor_bytes(c.vectors, np.float32),
    )


def decode_response(msg: pb.SearchResponse, batch: int, dim: int) -> Candidates:
    """-> :class:`Candidates` ``[B, R]`` (with vectors when the shard sent them)."""
    shape = (batch, msg.width)
    vectors = None
    if msg.vectors:
        vectors = bytes_tensor(msg.vectors, np.float32, (*shape, dim), "vectors")
    return Candidates(
        bytes_tensor(msg.ids, np.int64, shape, "ids"),
        bytes_tensor(msg.approx, np.float32, shape, "approx"),
        bytes_tensor(msg.scores, np.float32, shape, "scores"),
        vectors,
    )
