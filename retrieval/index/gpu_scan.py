"""The IVF list scan on a GPU: one Triton kernel scores, filters, blanks and selects the probed lists.

Same contract as :func:`retrieval.index.scan.scan` (the CPU kernel and :func:`scan_reference`).
The work is list-major, as on the CPU: the batch's (query, probe) pairs are grouped by list, and
each program takes up to ``BQ`` queries that probe one list and walks its items in tiles of
``BN``, so a code tile is read once for all of them and scored as one int8 tensor-core product
(``tl.dot``, exact int32 sums). In the same pass it adds the list's coarse score, tests every
item's signature against each query's filter clauses and blanks the rows each query excludes
(a binary search in its sorted ``excl`` row). The grid is one program per chunk of pairs.

Selection happens in the kernel: for a best ``r`` of at most ``SELECT_MAX`` (= ``BN``), each
program keeps a running best ``R`` per query across its list's tiles (``R`` the power of two
``>= r``; int64 keys, the score's bits and the item, through a bitonic network written here
(``_sorted``): a tile's best ``R`` merged into the kept ones, a tile none of whose items beats
the worst kept skipped) and writes only the list's best ``min(r, size)`` (score, item within
the list) per query: no full score row. That is exact: the row's best ``r`` hold at most ``r`` items of any one list, and those are
among that list's best ``r``. For a larger ``r`` (up to any K: 10,000 and more), or where no
list is longer than ``r``, every passing item's score is written, as selecting keeps them all.
Either way the candidates land in a ``[B, width]`` buffer, each query's probed lists side by
side (``-inf`` where nothing passed; ``width``: the ``P`` longest lists, each capped at ``r``
where selecting, known on the host; never wider than the full rows), and the best ``r`` of each
row come from ``torch.topk`` over it (a radix select on CUDA, any ``r``: no 2,048 cap). Nothing
here waits for the GPU (but the first call on an index state, which reads its list sizes): the
grid is sized from shapes alone and the pair grouping is torch ops on the device, so a search
can be recorded as a CUDA graph (``cuda_graphs.py``).

FP8 codes are decoded through a 256-entry float16 table (exact: every e4m3 value is a float16)
and scored against the query split in two float16 halves (``q = hi + lo``), so the tensor cores
give float32-accurate sums.

CI runs the kernel on the CPU under ``TRITON_INTERPRET=1`` (``tests/conftest.py`` sets it where
no GPU is) against :func:`scan_reference`; tests marked ``gpu`` run it compiled.
"""

from __future__ import annotations

import bisect
import itertools
import operator
import weakref

import torch
import triton
import triton.language as tl
from triton.runtime.jit import constexpr_function

from retrieval.index.codes import fp8_lut, quantize_query_int8
from retrieval.index.tensors import Lists, ScanRows

BQ = 16
"""Queries a program scores together (``tl.dot`` needs 16 at least)."""
BN = 128
"""Items of a list a program scores at once (a tile)."""
BUFFER_FLOATS = 1 << 26
"""Score-buffer floats per call (256 MB): larger batches go through in query chunks."""
SELECT_MAX = BN
"""The largest best-``r`` the kernel selects itself (a running best of ``r`` per query held in
registers); above it every probed item's score is written (0: never select, the full rows)."""


_NONE: tl.constexpr = tl.constexpr(-(2**63))
"""The key of no candidate (filtered out, past the list's end): below every item's key."""


@triton.jit
def _key(score, within):
    """``[BQ, BN]`` float32 scores and ``[BN]`` int64 item indices within the list -> int64 keys
    ordered as the scores: the score's bits made order-preserving as an int32 (negative floats
    count down) in the high half, the index in the low half (so every key is distinct)."""
    bits = score.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | within[None, :]


@triton.jit
def _score(ordered):
    """The float32 score of a key's high half (``_key`` undone: the flip is its own inverse)."""
    return (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@constexpr_function
def _log2(n: int) -> int:
    log = 0
    while n > 1:
        n >>= 1
        log += 1
    return log


# A bitonic sort / top-k of int64 keys along the last dim: ``tl.sort`` / ``tl.topk``'s network
# (``triton/language/standard.py``, 3.7) but for how a compare-and-swap finds its partner: the
# sum of the pair less itself (two's complement wraps, exactly), where Triton takes their xor.
# Both are a reduction over a size-2 axis held in one thread on a GPU; under the interpreter a
# sum is one numpy call and an xor is a Python loop per element (seconds a tile).


@triton.jit
def _indicator(n_dims: tl.constexpr, j: tl.constexpr):
    return tl.reshape(tl.arange(0, 2), [1] * (n_dims - j - 1) + [2] + [1] * j)


@triton.jit
def _compare_and_swap(x, flip, i: tl.constexpr):
    n_dims: tl.constexpr = _log2(x.numel)
    y = tl.sum(x, n_dims - 1 - i, keep_dims=True) - x  # the partner along hypercube axis i
    return tl.where((x > y) != (flip ^ _indicator(n_dims, i)), y, x)


@triton.jit
def _bitonic_merge(x, stage: tl.constexpr, order: tl.constexpr):
    """``stage`` rounds of compare-and-swap on the hypercube ``x``: order 0 ascending, 1
    descending, 2 alternating (sub-sequences of ``2 ** stage``)."""
    if order == 2:  # noqa: SIM108 (a static if, as in Triton's own sort: two types of flip)
        flip = _indicator(_log2(x.numel), stage)
    else:
        flip = order
    for i in tl.static_range(stage):
        x = _compare_and_swap(x, flip, stage - 1 - i)
    return x


@triton.jit
def _sorted(x, K: tl.constexpr, DESC: tl.constexpr, BITONIC: tl.constexpr):
    """The best ``K`` (a power of two) of each row of ``x [M, N]`` in order (``DESC``: largest
    first; ``K < N`` keeps the largest ``K`` when ``DESC``, else the smallest), as
    ``tl.topk``. ``BITONIC``: the rows are bitonic already (one merge sorts them)."""
    log_n: tl.constexpr = _log2(x.shape[1])
    log_k: tl.constexpr = _log2(K)
    n_dims: tl.constexpr = _log2(x.numel)
    h = tl.reshape(x, [2] * n_dims)
    if BITONIC:
        h = _bitonic_merge(h, log_n, DESC)
    else:
        for i in tl.static_range(1, log_k + 1):
            h = _bitonic_merge(h, i, 2 if i < log_n else DESC)
        for i in tl.static_range(log_k + 1, log_n + 1):  # halve: the better of each pair
            if DESC:
                h = tl.max(h, axis=_log2(h.numel) - 1 - log_k)
            else:
                h = tl.min(h, axis=_log2(h.numel) - 1 - log_k)
            h = _bitonic_merge(h, log_k, 2 if i < log_n else DESC)
    return tl.reshape(h, [x.shape[0], K])


@triton.jit
def _merge(run, key, R: tl.constexpr):
    """The best ``R`` of ``run [BQ, R]`` (ascending) and a tile's ``key [BQ, BN]`` per row,
    ascending. The best ``R`` of two sorted runs, one ascending and one descending, are their
    element-wise maximum, a bitonic sequence that one merge sorts."""
    return _sorted(tl.maximum(run, _sorted(key, R, 1, 0)), R, 0, 1)


@triton.jit
def _scan_kernel(
    q_ptr,  # [B, D] int8 queries, or float16 high halves (FP8)
    qlo_ptr,  # [B, D] float16 low halves (FP8; unused for INT8)
    qscale_ptr,  # [B] float32 query scales (INT8; unused for FP8)
    codes_ptr,  # [N, D] int8, or uint8 FP8 bit patterns
    lut_ptr,  # [256] float16 FP8 values
    scales_ptr,  # [N] bfloat16
    offsets_ptr,  # [nlist + 1] int64
    coarse_ptr,  # [B, P] float32
    col_ptr,  # [B, P] int64: where each probed list's scores start in its query's row
    pairs_ptr,  # [B * P] int64: (query * P + slot), grouped by list
    chunk_list_ptr,  # [G] int64: the list of each chunk of pairs, -1 none
    chunk_first_ptr,  # [G] int64: its first pair in pairs_ptr
    chunk_count_ptr,  # [G] int64: its pairs (<= BQ)
    sig_ptr,  # [N, W] int64
    fmask_ptr,  # [B, C, W] int64
    fneg_ptr,  # [B, C] int8
    fnone_ptr,  # [B, C, W] int64: "or none of these bits" (HAS_NONE; unused otherwise)
    excl_ptr,  # [B, S] int64, ascending, PAD padded
    out_ptr,  # [B, width] float32, -inf filled
    idx_ptr,  # [B, width] int32: each kept score's item within its list (SELECT; unused otherwise)
    D,
    P,
    width,
    C,
    W,
    S,
    EXCL_STEPS,
    KEEP,  # candidates kept per (query, list) (SELECT: r <= R; unused otherwise)
    FP8: tl.constexpr,
    HAS_NONE: tl.constexpr,
    SELECT: tl.constexpr,
    R: tl.constexpr,  # the running best's size: a power of two, KEEP <= R <= BLOCK_N
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    chunk = tl.program_id(0)
    lst = tl.load(chunk_list_ptr + chunk)
    if lst < 0:
        return
    first = tl.load(chunk_first_ptr + chunk)
    count = tl.load(chunk_count_ptr + chunk)
    list_start = tl.load(offsets_ptr + lst)
    list_end = tl.load(offsets_ptr + lst + 1)

    # this chunk's queries, loaded once for every tile of the list
    qi = tl.arange(0, BLOCK_Q)
    q_ok = qi < count
    pair = tl.load(pairs_ptr + first + qi, mask=q_ok, other=0)  # [BQ]
    b = pair // P
    slot = pair % P
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    qc_ok = q_ok[:, None] & d_ok[None, :]
    q_at = b[:, None] * D + d[None, :]
    if FP8:
        hi = tl.load(q_ptr + q_at, mask=qc_ok, other=0.0)
        lo = tl.load(qlo_ptr + q_at, mask=qc_ok, other=0.0)
        qs = tl.zeros((BLOCK_Q,), dtype=tl.float32)
    else:
        q8 = tl.load(q_ptr + q_at, mask=qc_ok, other=0)
        qs = tl.load(qscale_ptr + b, mask=q_ok, other=0.0)
    co = tl.load(coarse_ptr + b * P + slot, mask=q_ok, other=0.0)
    col = tl.load(col_ptr + b * P + slot, mask=q_ok, other=0)  # [BQ]
    run = tl.full((BLOCK_Q, R), _NONE, tl.int64)  # SELECT: each query's best R keys, ascending

    for tile in range(0, tl.cdiv(list_end - list_start, BLOCK_N)):
        items = list_start + tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] list-sorted
        i_ok = items < list_end
        c_at = codes_ptr + items[:, None] * D + d[None, :]
        cc_ok = i_ok[:, None] & d_ok[None, :]
        if FP8:
            bits = tl.load(c_at, mask=cc_ok, other=0).to(tl.int32)
            xt = tl.trans(tl.load(lut_ptr + bits))  # [BD, BN] float16, exact
            dots = tl.dot(hi, xt, out_dtype=tl.float32) + tl.dot(lo, xt, out_dtype=tl.float32)
        else:
            x8 = tl.load(c_at, mask=cc_ok, other=0)
            dots = tl.dot(q8, tl.trans(x8), out_dtype=tl.int32).to(tl.float32) * qs[:, None]
        sc = tl.load(scales_ptr + items, mask=i_ok, other=0.0).to(tl.float32)
        score = dots * sc[None, :] + co[:, None]  # [BQ, BN]

        ok = q_ok[:, None] & i_ok[None, :]
        for c in range(C):  # every clause: (any bit of the item in the clause's mask) != negate
            hit = tl.zeros((BLOCK_Q, BLOCK_N), dtype=tl.int1)
            held = tl.zeros((BLOCK_Q, BLOCK_N), dtype=tl.int1)  # any of the "none of" bits
            has = tl.zeros((BLOCK_Q,), dtype=tl.int1)  # the clause has a "none of" part
            for w in range(W):
                sw = tl.load(sig_ptr + items * W + w, mask=i_ok, other=0)
                mw = tl.load(fmask_ptr + (b * C + c) * W + w, mask=q_ok, other=0)
                hit = hit | ((sw[None, :] & mw[:, None]) != 0)
                if HAS_NONE:
                    nw = tl.load(fnone_ptr + (b * C + c) * W + w, mask=q_ok, other=0)
                    held = held | ((sw[None, :] & nw[:, None]) != 0)
                    has = has | (nw != 0)
            neg = tl.load(fneg_ptr + b * C + c, mask=q_ok, other=0) != 0
            ok = ok & ((hit != neg[:, None]) | (has[:, None] & ~held))
        if S > 0:  # lower bound of each item in its query's excluded rows
            lo_i = tl.zeros((BLOCK_Q, BLOCK_N), dtype=tl.int64)
            hi_i = tl.zeros((BLOCK_Q, BLOCK_N), dtype=tl.int64) + S
            for _ in range(EXCL_STEPS):
                mid = (lo_i + hi_i) // 2
                live = mid < hi_i
                v = tl.load(excl_ptr + b[:, None] * S + mid, mask=ok & live, other=0)
                right = v < items[None, :]
                lo_i = tl.where(right & live, mid + 1, lo_i)
                hi_i = tl.where(right | ~live, hi_i, mid)
            hit_ex = tl.load(excl_ptr + b[:, None] * S + lo_i, mask=ok & (lo_i < S), other=-1)
            ok = ok & (hit_ex != items[None, :])
        if SELECT:  # the tile's keys into the running best (only if one beats its worst)
            key = tl.where(ok, _key(score, items - list_start), _NONE)
            worst = tl.min(run, axis=1)  # [BQ]
            if tl.max((key > worst[:, None]).to(tl.int32)) > 0:
                run = _merge(run, key, R)
        else:
            at = col[:, None] + (items - list_start)[None, :]
            # within the row even if the host's bound were stale: candidates lost, never memory
            tl.store(out_ptr + b[:, None] * width + at, score, mask=ok & (at < width))

    if SELECT:  # the list's best min(KEEP, its length), best first, from column col
        rank = R - 1 - tl.arange(0, R)  # run is ascending
        at = col[:, None] + rank[None, :]
        keep = q_ok[:, None] & (rank[None, :] < KEEP) & (run > _NONE) & (at < width)
        hi = run >> 32
        tl.store(out_ptr + b[:, None] * width + at, _score(hi.to(tl.int32)), mask=keep)
        tl.store(idx_ptr + b[:, None] * width + at, (run - (hi << 32)).to(tl.int32), mask=keep)


def block_d(d: int) -> int:
    """The kernel's tile over the D dimensions: a power of two, 32 at least (an int8 ``tl.dot``
    compiled for a GPU needs K >= 32; the interpreter takes less, so this is tested directly);
    the padding is masked to zero."""
    return max(32, triton.next_power_of_2(d))


def _chunks(
    probes: torch.Tensor, nlist: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups the ``[B, P]`` (query, slot) pairs by list and cuts each list's group into chunks
    of :data:`BQ`. Returns ``pairs [B*P]`` (grouped) and per chunk ``list, first, count [G]``,
    ``G = ceil(B*P / BQ) + min(nlist, B*P)`` (a bound from shapes: no host sync)."""
    dev = probes.device
    flat = probes.flatten()
    n = flat.numel()
    key = torch.where(flat >= 0, flat, torch.full_like(flat, nlist))  # skipped slots last
    pairs = torch.argsort(key, stable=True)
    # [nlist]; a scatter, not torch.bincount, which reads the largest key back to the host
    counts = torch.zeros(nlist + 1, dtype=torch.int64, device=dev)
    counts = counts.scatter_add_(0, key, torch.ones_like(key))[:nlist]
    pair_start = torch.cumsum(counts, 0) - counts
    per_list = (counts + BQ - 1) // BQ
    chunk_end = torch.cumsum(per_list, 0)  # [nlist]
    g = (n + BQ - 1) // BQ + min(nlist, n)
    cid = torch.arange(g, device=dev)
    lst = torch.searchsorted(chunk_end, cid, right=True)  # [G]; nlist: beyond the last chunk
    real = lst < nlist
    at = lst.clamp(max=max(nlist - 1, 0))
    within = cid - (chunk_end[at] - per_list[at])
    first = pair_start[at] + within * BQ
    count = torch.clamp(counts[at] - within * BQ, 0, BQ)
    lst = torch.where(real, lst, torch.full_like(lst, -1))
    return pairs, lst, first, count


def _queries(q: torch.Tensor, fp8: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The query operands: INT8 codes and scales (as the CPU kernel quantizes them), or the
    float16 high and low halves of ``q``."""
    if fp8:
        hi = q.half()
        lo = (q - hi.float()).half()
        return hi.contiguous(), lo.contiguous(), q.new_zeros(0)
    q8, qs = quantize_query_int8(q.float())
    return q8.contiguous(), q8.new_zeros(0), qs.contiguous()


_LUTS: dict[torch.device, torch.Tensor] = {}


def _lut(device: torch.device) -> torch.Tensor:
    if device not in _LUTS:
        _LUTS[device] = fp8_lut(device).half()
    return _LUTS[device]


_SIZES: dict[int, tuple[weakref.ref[torch.Tensor], int, list[int], list[int]]] = {}


def _list_sizes(offsets: torch.Tensor) -> tuple[list[int], list[int]]:
    """``offsets``' list sizes, longest first, and their prefix sums (``[0, s0, s0 + s1, ...]``),
    as host numbers. Read once per index state (this ``offsets`` tensor at this version: one
    device sync then, none in later searches), so buffers are sized from host numbers alone."""
    held = _SIZES.get(id(offsets))
    if held is None or held[0]() is not offsets or held[1] != offsets._version:
        sizes = (offsets[1:] - offsets[:-1]).sort(descending=True).values.tolist()
        prefix = [0, *itertools.accumulate(sizes)]
        for key in [k for k, v in _SIZES.items() if v[0]() is None]:  # freed tensors
            del _SIZES[key]
        held = (weakref.ref(offsets), offsets._version, sizes, prefix)
        _SIZES[id(offsets)] = held
    return held[2], held[3]


def width_bound(offsets: torch.Tensor, p: int, keep: int | None = None) -> int:
    """Columns a query probing ``p`` lists can need when each list gives at most ``keep``
    candidates (None: all its items): the sum of ``min(keep, size)`` over the ``p`` longest
    lists (at least 1)."""
    sizes, prefix = _list_sizes(offsets)
    p = min(p, len(sizes))
    if keep is None:
        return max(prefix[p], 1)
    capped = min(p, bisect.bisect_left(sizes, -keep, key=operator.neg))  # the lists over keep
    return max(keep * capped + prefix[p] - prefix[capped], 1)


def kept_per_list(offsets: torch.Tensor, r: int) -> int | None:
    """Candidates the kernel keeps of each probed list for a best ``r``: ``r`` where it selects
    (``r <= SELECT_MAX`` and some list is longer than ``r``), None where it writes every item.
    Exact either way: a list's best ``r`` hold every one of its items in the row's best ``r``."""
    sizes, _ = _list_sizes(offsets)
    return r if 0 < r <= min(SELECT_MAX, BN) and sizes and sizes[0] > r else None


def scan_triton(lists: Lists, rows: ScanRows, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`retrieval.index.scan.scan` with the Triton kernel: ``lists.codes [N, D]`` int8 or
    float8_e4m3fn -> ``(positions [B, r] int64, scores [B, r] float32)``, best first, ``-1`` /
    ``-inf`` pads. Each row's buffer is :func:`width_bound` wide for :func:`kept_per_list`
    candidates a list (not ``lists.max_list``)."""
    b, p = rows.probes.shape
    keep = kept_per_list(lists.offsets, r)
    width = width_bound(lists.offsets, p, keep)
    step = max(1, BUFFER_FLOATS // width)
    full = ScanRows(
        rows.q, rows.probes, rows.coarse, rows.fmask, rows.fneg, rows.excluded(), None, rows.fnone
    )
    parts = [  # a bounded score buffer: the batch in query chunks
        _scan_batch(lists, full.part(sl), r, width, keep)
        for sl in (slice(s, s + step) for s in range(0, max(b, 1), step))  # B = 0: one empty
    ]
    if len(parts) == 1:
        return parts[0]
    return torch.cat([x[0] for x in parts]), torch.cat([x[1] for x in parts])


def _scan_batch(
    lists: Lists, rows: ScanRows, r: int, width: int, keep: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One bounded batch: each query's probed lists side by side in a row of ``width`` columns
    (``col [B, P]`` where each starts; ``min(keep, size)`` columns each), the kernel, then the
    best ``r`` of each row."""
    q, probes, coarse, excl = rows.q, rows.probes, rows.coarse, rows.excluded()
    codes, scales, offsets, sig = lists.codes, lists.scales, lists.offsets, lists.sig
    fmask = rows.fmask
    b, p = probes.shape
    dev = q.device
    nlist = offsets.numel() - 1
    fp8 = codes.dtype == torch.float8_e4m3fn
    listed = probes >= 0
    probed = probes.clamp(min=0)
    lens = torch.where(listed, offsets[probed + 1] - offsets[probed], 0)  # [B, P]
    if keep is not None:
        lens = lens.clamp(max=keep)
    col = torch.cumsum(lens, dim=1) - lens  # [B, P]
    out = torch.full((b, width), float("-inf"), device=dev)
    # the item of each kept score within its list (selecting; else its column says it)
    within = torch.empty((b, width) if keep is not None else (0,), dtype=torch.int32, device=dev)
    if b and p and nlist > 0:
        qa, qlo, qs = _queries(q, fp8)
        pairs, lst, first, count = _chunks(probes, nlist)
        s = excl.shape[1]
        _scan_kernel[(lst.numel(),)](
            qa,
            qlo if fp8 else qa,
            qs if not fp8 else coarse,
            codes.view(torch.uint8) if fp8 else codes,
            _lut(dev) if fp8 else scales,
            scales,
            offsets,
            coarse,
            col,
            pairs,
            lst,
            first,
            count,
            sig,
            fmask,
            rows.fneg.to(torch.int8),
            fmask if rows.fnone is None else rows.fnone.contiguous(),
            excl,
            out,
            within,
            q.shape[1],
            p,
            width,
            fmask.shape[1],
            sig.shape[1],
            s,
            max(s, 1).bit_length(),
            keep or 0,
            FP8=fp8,
            HAS_NONE=rows.fnone is not None,
            SELECT=keep is not None,
            R=run_size(keep),
            BLOCK_Q=BQ,
            BLOCK_N=BN,
            BLOCK_D=block_d(q.shape[1]),
        )
    kk = min(r, width)
    top, idx = out.topk(kk, dim=1)
    slot = (torch.searchsorted(col, idx, right=True) - 1).clamp(min=0)  # the list holding idx
    item = within.gather(1, idx).long() if keep is not None else idx - col.gather(1, slot)
    at = offsets[probed.gather(1, slot)] + item
    pos = torch.where(top > float("-inf"), at, torch.full_like(idx, -1))
    if kk < r:
        pos = torch.nn.functional.pad(pos, (0, r - kk), value=-1)
        top = torch.nn.functional.pad(top, (0, r - kk), value=float("-inf"))
    return pos, top


def run_size(keep: int | None) -> int:
    """The kernel's running best per query (``R``) for ``keep`` candidates a list: a power of
    two, 16 at least (small tiles are the shapes a GPU compile is least tried on), at most
    :data:`BN` (None: not selecting, the smallest)."""
    return min(BN, max(16, triton.next_power_of_2(keep or 1)))
