"""The IVF list scan: a compiled CPU kernel registered as a torch op, and a torch reference.

``scan(...)`` takes the probed lists of each query and returns the best ``r`` items by approximate
score among those that pass the filter (positions in list-sorted order, ``-1`` where fewer exist).

* CPU: ``csrc/ivf_scan.cpp`` (list-major), built on first use with torch's C++ extension loader
  and registered as ``recserve::ivf_scan_*`` ops with fake (meta) implementations, so
  ``torch.compile`` traces through them. Its int8 dot products pick a path per call: AVX-512 VNNI,
  AVX2 or portable loops, the best the CPU runs unless ``$RECSERVE_SCAN_ISA`` forces one
  (:func:`int8_isa`); every path returns the same scores, bit for bit.
* CUDA: ``gpu_scan.py``, one Triton kernel (list-major int8/fp8 tensor-core scan, filter and
  exclusions in the same pass) and a radix top-r.
* ``reference=True``: :func:`scan_reference`, plain torch ops (gather, matmul, topk) over
  queries in chunks. It defines what both kernels must compute and they are tested against it.
"""

from __future__ import annotations

import os

import torch

from retrieval.index.codes import fp8_lut, quantize_query_int8
from retrieval.index.exclude import is_excluded
from retrieval.index.kernels import extension as _extension
from retrieval.index.tensors import IndexTensors, Lists, ProbeTable, ScanRows, ValuePostings

KERNEL_ENV = "RECSERVE_SCAN_KERNEL"
"""Forces the list scan's kernel: ``triton`` (also on CPU tensors, where it needs Triton's
interpreter, ``TRITON_INTERPRET=1``: how CI runs whole searches through it) or ``reference``
(:func:`scan_reference` on any device). ``auto`` or unset: C++ on the CPU, Triton on CUDA."""

ISA_ENV = "RECSERVE_SCAN_ISA"
"""Forces the int8 scan's path: ``portable``, ``avx2`` or ``vnni`` (``auto`` or unset: the best
this CPU runs). Read at every scan; a path the CPU cannot run is refused with an error."""


def int8_isa() -> str:
    """The path the next int8 scan takes: ``"vnni"``, ``"avx2"`` or ``"portable"``."""
    return str(_extension().int8_isa())


@torch.library.custom_op("recserve::ivf_scan_int8", mutates_args=())
def ivf_scan_int8(
    q: torch.Tensor,
    probes: torch.Tensor,
    coarse: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    sig: torch.Tensor,
    fmask: torch.Tensor,
    fneg: torch.Tensor,
    fnone: torch.Tensor,
    excl: torch.Tensor,
    r: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(
        _extension().ivf_scan_int8(
            q, probes, coarse, codes, scales, offsets, sig, fmask, fneg, fnone, excl, r, _NO_FLOOR
        )
    )


@torch.library.custom_op("recserve::ivf_scan_fp8", mutates_args=())
def ivf_scan_fp8(
    q: torch.Tensor,
    codes_u8: torch.Tensor,
    lut: torch.Tensor,
    probes: torch.Tensor,
    coarse: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    sig: torch.Tensor,
    fmask: torch.Tensor,
    fneg: torch.Tensor,
    fnone: torch.Tensor,
    excl: torch.Tensor,
    r: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(
        _extension().ivf_scan_fp8(
            q, codes_u8, lut, probes, coarse, scales, offsets, sig, fmask, fneg, fnone, excl, r
        )
    )


@torch.library.custom_op("recserve::topk_rows", mutates_args=())
def _topk_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(_extension().topk_rows(x, k))


@_topk_rows.register_fake
def _(x, k):
    return x.new_empty((x.shape[0], k)), torch.empty(
        (x.shape[0], k), dtype=torch.int64, device=x.device
    )


def topk_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(x, k, dim=1)`` for ``x [B, M]`` (``k <= M``); a bounded heap on CPU, which is
    several times faster than torch's sort-based CPU topk when ``k << M``."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return x.topk(k, dim=1)
    if torch.compiler.is_compiling():
        return _topk_rows(x.contiguous(), k)
    return tuple(_extension().topk_rows(x.contiguous(), k))


_NO_HALF = torch.zeros(0)
_NO_FLOOR = torch.zeros(0)
_NO_SIZES = torch.zeros(0, dtype=torch.int64)
_NO_NONE = torch.zeros(0, dtype=torch.int64)
"""The kernels' ``fnone`` where no clause has a "none of these bits" part."""


def _none(fnone: torch.Tensor | None) -> torch.Tensor:
    return _NO_NONE if fnone is None else fnone.contiguous()


def list_bounds_cpu(
    ip: torch.Tensor,
    half: torch.Tensor | None,
    list_bits: torch.Tensor,
    masks: torch.Tensor,
    negate: torch.Tensor,
    sizes: torch.Tensor,
    nprobe: torch.Tensor,
    factor: torch.Tensor,
    radius: torch.Tensor,
    check: torch.Tensor,
    p: int,
    none: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A filtered plan's first-round lists and bounds in one C++ pass a row (``bound.py``'s
    ``_list_bounds`` after ``_may_hold`` gives the same): ``ip [B, L]`` = q·c, ``half [L]`` (the
    L2 probe's ``|c|^2 / 2``; None: inner product), ``list_bits [L, W]`` with each row's filter
    ``masks [B, C, W]`` / ``negate [B, C]`` (a checked row reaches the lists that may hold an
    item it admits), ``sizes [L]``, ``nprobe [B]``, ``factor [B]`` (slack x the query's norm
    bound), ``radius [L]``, ``check [B]`` -> ``(first [B, p]`` the best ``nprobe`` reachable
    non-empty lists, ``-1`` padded, ``bounds [B, L]`` = ip + factor x radius, ``-inf`` for lists
    probed first, out of reach, or rows without a check). ``none [B, C, W]``: the clauses'
    "none of these bits" parts (None: none; such a clause rules no list out)."""
    no_half = _NO_HALF if half is None else half
    ext = _extension()
    out = ext.list_bounds(
        ip, no_half, list_bits, masks, negate, _none(none), sizes, nprobe, factor, radius, check, p
    )
    return out[0], out[1]


def second_round_cpu(
    bounds: torch.Tensor, kth: torch.Tensor, sizes: torch.Tensor, budget: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``search.BoundCheck.second_round`` in one C++ pass a row (the same answer)."""
    return tuple(
        _extension().second_round_lists(
            bounds.contiguous(), kth.float().contiguous(), sizes.contiguous(), budget.contiguous()
        )
    )


@torch.library.custom_op("recserve::ivf_probe", mutates_args=())
def _ivf_probe(
    q: torch.Tensor, centroids_t: torch.Tensor, half: torch.Tensor, p: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(_extension().ivf_probe(q, centroids_t, half, p))


@_ivf_probe.register_fake
def _(q, centroids_t, half, p):
    b = q.shape[0]
    return q.new_empty((b, p)), torch.empty((b, p), dtype=torch.int64, device=q.device)


def probe_table_cpu(centroids_t: torch.Tensor) -> ProbeTable:
    """``centroids_t [D, nlist]`` (contiguous CPU float32) quantized to int8 for the probe of a
    few queries (:func:`probe_cpu`): a quarter of the float table's bytes, which one query's probe
    otherwise reads whole. The probe then scores exactly only the lists whose int8 error bounds
    reach its best: the same lists and coarse scores, bit for bit (AVX2 and VNNI CPUs; the
    portable path reads the floats)."""
    return tuple(_extension().probe_table(centroids_t))


def probe_cpu(
    q: torch.Tensor,
    centroids_t: torch.Tensor,
    half_norms: torch.Tensor | None,
    nprobe: int,
    table: ProbeTable | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`retrieval.index.probe.probe_lists` on the CPU in one C++ call: ``q [B, D]``,
    ``centroids_t [D, nlist]`` contiguous float32 -> ``(coarse [B, P], lists [B, P])``;
    ``table``: :func:`probe_table_cpu` of ``centroids_t``."""
    half = _NO_HALF if half_norms is None else half_norms.contiguous()
    if torch.compiler.is_compiling():
        return _ivf_probe(q, centroids_t, half, nprobe)
    return tuple(_extension().ivf_probe(q, centroids_t, half, nprobe, table))


def search_ids_cpu(
    t: IndexTensors,
    q: torch.Tensor,
    fmask: torch.Tensor,
    fneg: torch.Tensor,
    excl_ids: torch.Tensor,
    nprobe: int,
    r: int,
    least: int = 0,
    hold: torch.Tensor | None = None,
    fnone: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """A plain int8 search on the CPU keyed by item id, in one C++ call: the item ids each query
    excludes (``excl_ids [B, S]``, ``-1`` pads) mapped to rows through the index's id order
    (``exclude.IdOrder``), :func:`probe_cpu`'s ``nprobe`` lists, :func:`scan` under each row's
    filter (``fmask [B, C, W]``, ``fneg [B, C]``), and the rows found mapped to item ids ->
    ``(ids [B, r], scores [B, r], short)``, ``-1`` / ``-inf`` padded, ``short``: some row found
    fewer than ``r``. With ``hold [B] int64`` and ``least < nprobe`` each row keeps its best
    lists until they hold ``hold[b]`` items by the index's list sizes as built, at least
    ``least`` (``probe.lists_holding``); else every probed list. None where it does not apply
    (not int8, a forced kernel, inside a trace): the caller takes the step-by-step path, which
    gives the same answer. ``fnone [B, C, W]``: the clauses' "none of these bits" parts (None:
    none)."""
    lists = t.lists
    if lists.codes.dtype != torch.int8 or torch.compiler.is_compiling():
        return None
    half = t.probe_half
    half = _NO_HALF if half is None else half
    cut = hold is not None and least < nprobe and t.built_sizes.numel() > 0
    ids, scores, short = _extension().ivf_search_ids_int8(
        q, t.centroids_t, half, nprobe, lists.codes, lists.scales, lists.offsets, lists.sig,
        fmask, fneg, _none(fnone), excl_ids, t.id_order.item_ids, t.id_order.perm, r,
        t.built_sizes if cut else _NO_SIZES, least if cut else nprobe,
        hold if cut else _NO_SIZES, t.probe_table,
    )  # fmt: skip
    return None if ids is None else (ids, scores, short)  # None: $RECSERVE_SCAN_KERNEL forced


def _fake_out(probes: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    b = probes.shape[0]
    return probes.new_empty((b, r)), torch.empty((b, r), dtype=torch.float32, device=probes.device)


@ivf_scan_int8.register_fake
def _(q, probes, coarse, codes, scales, offsets, sig, fmask, fneg, fnone, excl, r):
    return _fake_out(probes, r)


@ivf_scan_fp8.register_fake
def _(q, codes_u8, lut, probes, coarse, scales, offsets, sig, fmask, fneg, fnone, excl, r):
    return _fake_out(probes, r)


def scan(
    lists: Lists, rows: ScanRows, r: int, *, reference: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Best ``r`` approximate scores of each row of ``rows`` over its probed ``lists``.

    Filter and exclusions apply inside the scan. ``rows.floor``: the CPU int8 kernel skips the
    candidates below it inside its selection; other paths return them, which merges to the same
    answer. ``reference``: :func:`scan_reference` (as ``$RECSERVE_SCAN_KERNEL=reference``).

    Returns ``positions [B, r] int64`` (``-1`` pads) and ``scores [B, r] float32`` (``-inf``
    pads), best first. The hot path trusts its inputs: the index validates at its public entry.
    """
    kernel = os.environ.get(KERNEL_ENV, "auto")
    reference = reference or kernel == "reference"
    q = rows.q
    if (q.device.type == "cuda" or kernel == "triton") and not reference:
        from retrieval.index.gpu_scan import scan_triton  # imports triton: only where it runs

        return scan_triton(lists, rows, r)
    if reference or q.device.type != "cpu":
        return scan_reference(lists, rows, r)
    # Eager callers skip the op dispatcher (its cost per call rivals a small scan); traced code
    # needs the ops.
    eager = not torch.compiler.is_compiling()
    excl, fnone = rows.excluded(), _none(rows.fnone)
    if lists.codes.dtype == torch.int8:
        args = (q, rows.probes, rows.coarse, lists.codes, lists.scales, lists.offsets, lists.sig)
        if not eager:
            return tuple(ivf_scan_int8(*args, rows.fmask, rows.fneg, fnone, excl, r))
        fl = _NO_FLOOR if rows.floor is None else rows.floor.float().contiguous()
        return tuple(_extension().ivf_scan_int8(*args, rows.fmask, rows.fneg, fnone, excl, r, fl))
    op8 = _extension().ivf_scan_fp8 if eager else ivf_scan_fp8
    codes_u8, probed = lists.codes.view(torch.uint8), (rows.probes, rows.coarse)
    tail = (lists.scales, lists.offsets, lists.sig, rows.fmask, rows.fneg, fnone, excl, r)
    return tuple(op8(q, codes_u8, _FP8_LUT, *probed, *tail))


_FP8_LUT = fp8_lut()


def centroid_dots_cpu(q: torch.Tensor, centroids_t: torch.Tensor) -> torch.Tensor:
    """``q [B, D]`` · every centroid -> ``[B, L]`` float32, as the probe computes it (``centroids_t
    [D, L]``), in one C++ call that starts no thread team for a few queries."""
    return _extension().centroid_dots(q.contiguous(), centroids_t)


def score_rows_cpu(
    q: torch.Tensor, pos: torch.Tensor, lists: Lists, coarse: torch.Tensor
) -> torch.Tensor:
    """``q [B, D]`` float32 scored against int8 rows ``pos [M]`` in one C++ pass ->
    ``[B, M]``: ``(q · code) * scale + coarse[:, list]`` with ``coarse [B, L]`` = q·centroids
    (``readout.scores_at`` without the gathered float copy of the codes)."""
    return _extension().score_rows_int8(
        q.contiguous(), pos.contiguous(), lists.codes, lists.scales, lists.offsets,
        coarse.contiguous(),
    )  # fmt: skip


def ids_of_positions_cpu(pos: torch.Tensor, item_ids: torch.Tensor) -> torch.Tensor:
    """``pos [B, k]`` int64 positions (-1 pads) -> item ids ``[B, k]`` (-1 pads) through
    ``item_ids [N]``, in one parallel C++ pass; a position past N raises."""
    return _extension().ids_of_positions(pos.contiguous(), item_ids.contiguous())


def bit_index_cpu(sig: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``sig [N, W]`` int64 -> ``(counts [W*64] int64, postings [nnz] int32)``: how many items set
    each bit, and the items of every bit, bit after bit, ascending (one C++ counting sort)."""
    counts, postings = _extension().bit_index(sig.cpu().contiguous())
    return counts, postings


def value_index_cpu(sig: torch.Tensor, layout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``sig [N, W]`` int64 -> ``(offsets [S + 1] int64, postings [M] int32)``: the items of each
    bucket of the values of the hashed attributes of ``layout [A, 4]``
    (``FilterSchema.value_layout``), ascending (one C++ counting sort)."""
    offsets, postings = _extension().value_index(sig.cpu().contiguous(), layout.contiguous())
    return offsets, postings


def value_drive_cpu(
    layout: torch.Tensor,
    offsets: torch.Tensor,
    fmask: torch.Tensor,
    fneg: torch.Tensor,
    fnone: torch.Tensor | None = None,
) -> tuple[int, torch.Tensor]:
    """The buckets of the hashed attributes' values (``layout [A, 4]``, ``offsets [S + 1]``,
    CPU) one filter (``fmask [C, W]``, ``fneg [C]``, ``fnone [C, W]``) reads: ``(items, slots
    [k] int64)`` of the attribute whose buckets hold the fewest, ``items`` -1 where none
    narrows it (what ``eligible_rows_cpu`` drives from)."""
    items, slots = _extension().value_drive(
        layout, offsets.contiguous(), fmask.contiguous(), fneg.contiguous(), _none(fnone)
    )
    return int(items), slots


def encode_int8_cpu(
    x: torch.Tensor, order: torch.Tensor, lists: torch.Tensor, centroids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The build's int8 codes in one C++ pass: row ``i`` is item ``order[i]`` of ``x [N, D]``
    float32, in list ``lists[i]``; its residual to ``centroids [L, D]`` quantized as
    ``codes.quantize_int8`` does, bit for bit -> ``(codes [N, D] int8, scales [N] bfloat16,
    norms [N] float32)``, ``norms`` = max(|residual|, |decoded residual|) rounded up (a bound:
    ``bound.residual_norms``'s figure, never below it by rounding)."""
    codes, scales, norms = _extension().encode_int8(
        x.contiguous(), order.contiguous(), lists.contiguous(), centroids.float().contiguous()
    )
    return codes, scales, norms


def filter_mask(
    sig: torch.Tensor, fmask: torch.Tensor, fneg: torch.Tensor, fnone: torch.Tensor | None = None
) -> torch.Tensor:
    """Items passing one request's filter: ``sig [N, W]``, ``fmask [C, W]``, ``fneg [C]``,
    ``fnone [C, W]`` (None: no "none of these bits" part) -> ``[N] bool`` (the kernel's rule,
    in one parallel pass on CPU)."""
    if sig.device.type != "cpu":
        from retrieval.filters import eligible

        return eligible(sig, fmask, fneg, fnone)
    return _extension().filter_mask(sig, fmask.contiguous(), fneg.contiguous(), _none(fnone))


def bit_slices_cpu(sig: torch.Tensor) -> torch.Tensor:
    """``sig [N, W]`` bit-sliced -> ``[W * 64, ceil(N / 64)] int64``: word ``j`` of bit ``b``
    holds bit ``b`` of items ``64 j .. 64 j + 63`` (item ``i`` at bit ``i % 64``)."""
    return _extension().bit_slices(sig.cpu().contiguous())


def sliced_mask_cpu(
    slices: torch.Tensor,
    fmask: torch.Tensor,
    fneg: torch.Tensor,
    n: int,
    fnone: torch.Tensor | None = None,
) -> torch.Tensor:
    """Items passing one filter (``fmask [C, W]``, ``fneg [C]``) read from the bit slices of
    :func:`bit_slices_cpu` -> ``[n] bool``, equal to :func:`filter_mask`: only the clauses'
    bits are read, 64 items a word, so the cost grows with the filter's bits, not the
    signature's width."""
    return _extension().sliced_mask(slices, fmask.contiguous(), fneg.contiguous(), _none(fnone), n)


def sliced_rows_cpu(
    slices: torch.Tensor,
    fmask: torch.Tensor,
    fneg: torch.Tensor,
    n: int,
    fnone: torch.Tensor | None = None,
) -> torch.Tensor:
    """The items of :func:`sliced_mask_cpu` as positions -> ``[M] int64`` ascending."""
    return _extension().sliced_rows(slices, fmask.contiguous(), fneg.contiguous(), _none(fnone), n)


def decode_rows_cpu(pos: torch.Tensor, lists: Lists, centroids_t: torch.Tensor) -> torch.Tensor:
    """Rows ``pos [M]`` of int8 codes decoded to ``[M, D]`` float32 (centroid + scale * code)
    in one C++ pass; ``centroids_t [D, L]``: the centroids in the probe's layout."""
    return _extension().decode_rows_int8(
        pos.contiguous(), lists.codes, lists.scales, lists.offsets, centroids_t
    )


def many_rows_cpu(
    q: torch.Tensor, pos: torch.Tensor, lists: Lists, centroids_t: torch.Tensor
) -> torch.Tensor:
    """Many queries ``q [B, D]`` scored against rows ``pos [M]`` of int8 codes -> ``[B, M]``
    float32. From 1024 rows and 128 dimensions, the list scan's scores (q·c of the row's list +
    scale x the quantized query's scale x the integer dot), every dot from one int8 GEMM
    (``torch._int_mm``: several times the float matmul of decoded rows); else the rows decoded
    and one float matmul."""
    return _extension().many_rows_int8(
        q.contiguous(), pos.contiguous(), lists.codes, lists.scales, lists.offsets, centroids_t
    )


def exact_search_ids_cpu(
    t: IndexTensors,
    q: torch.Tensor,
    fmask: torch.Tensor,
    fneg: torch.Tensor,
    k: int,
    few: int,
    max_scores: int,
    fnone: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Queries ``q [B, D]`` scanned exactly over the rows passing one filter (``fmask [C, W]``,
    ``fneg [C]``) in one C++ call -> ``(ids [B, k], scores [B, k])``, ``-1`` / ``-inf``
    padded: :func:`eligible_rows_cpu`, the scores as ``readout.scores_at`` computes them (up to
    ``few`` queries row by row, more by :func:`many_rows_cpu`), the top ``k`` as
    ``exact.exact_topk`` picks it, and the rows' item ids. None where ``B x M`` scores would
    pass ``max_scores`` (the caller scans in chunks)."""
    lists = t.lists
    ids, scores = _extension().exact_search_ids_int8(
        q.contiguous(), t.centroids_t, lists.codes, lists.scales, lists.offsets, lists.sig,
        fmask.contiguous(), fneg.contiguous(), _none(fnone), t.posting_counts, t.postings,
        t.values.layout, t.values.offsets, t.values.postings, t.item_ids, k, few,
        max_scores,
    )  # fmt: skip
    return None if ids is None else (ids, scores)


def eligible_rows_cpu(
    sig: torch.Tensor,
    fmask: torch.Tensor,
    fneg: torch.Tensor,
    bit_counts: torch.Tensor,
    postings: torch.Tensor,
    fnone: torch.Tensor | None = None,
    values: ValuePostings | None = None,
) -> torch.Tensor:
    """Rows passing one filter (``sig [N, W]``, ``fmask [C, W]``, ``fneg [C]``) -> ``[M]``
    int64 ascending, in one C++ call: the postings of the most selective clause, or of the
    buckets of a hashed attribute's values (``values``; None: none) its clauses leave, are the
    candidates (``eligible_scan.eligible_positions`` says how it chooses)."""
    v = values or _NO_VALUES
    return _extension().eligible_rows(
        sig, fmask.contiguous(), fneg.contiguous(), _none(fnone), bit_counts, postings,
        v.layout, v.offsets, v.postings,
    )  # fmt: skip


_NO_VALUES = ValuePostings(
    torch.zeros(0, 4, dtype=torch.int64),
    torch.zeros(0, dtype=torch.int64),
    torch.zeros(0, dtype=torch.int32),
)


def scan_reference(
    lists: Lists, rows: ScanRows, r: int, chunk: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`scan` with torch ops: gathers each query's candidates ``[b, P *
    max_list]``, scores them with one batched matmul, masks, and takes the top ``r``."""
    from retrieval.filters import eligible

    q, codes, scales, offsets, max_list = (
        rows.q, lists.codes, lists.scales, lists.offsets, lists.max_list,
    )  # fmt: skip
    outs_pos, outs_score = [], []
    steps = torch.arange(max(max_list, 1), device=q.device)
    for s in range(0, q.shape[0], chunk):
        part = rows.part(slice(s, s + chunk))
        pr, co, qc = part.probes, part.coarse, part.q
        listed = pr.clamp(min=0)
        start, end = offsets[listed], offsets[listed + 1]  # [b, P]
        pos = start.unsqueeze(-1) + steps  # [b, P, Lmax]
        valid = (pos < end.unsqueeze(-1)) & (pr >= 0).unsqueeze(-1)
        pos = torch.where(valid, pos, torch.zeros_like(pos)).flatten(1)  # [b, P*Lmax]
        if codes.dtype == torch.int8:  # the kernel's integer arithmetic: int8 query, exact int dot
            q8, q_scale = quantize_query_int8(qc.float())
            dots = (
                torch.einsum("bd,bmd->bm", q8.double(), codes[pos].double()).float()
                * q_scale[:, None]
            )
        else:
            dots = torch.einsum("bd,bmd->bm", qc.float(), codes[pos].float())
        coarse_rows = co.repeat_interleave(max(max_list, 1), dim=1)  # [b, P*Lmax]
        score = dots * scales[pos].float() + coarse_rows
        valid = valid.flatten(1)
        if part.fmask.shape[1] > 0:
            valid &= eligible(lists.sig[pos], part.fmask, part.fneg, part.fnone)
        if part.excl is not None:
            valid &= ~is_excluded(pos, part.excl)
        score = score.masked_fill(~valid, float("-inf"))
        kk = min(r, score.shape[1])
        top, idx = score.topk(kk, dim=1)
        tpos = torch.where(top > float("-inf"), pos.gather(1, idx), torch.full_like(idx, -1))
        if kk < r:
            tpos = torch.nn.functional.pad(tpos, (0, r - kk), value=-1)
            top = torch.nn.functional.pad(top, (0, r - kk), value=float("-inf"))
        outs_pos.append(tpos)
        outs_score.append(top)
    if not outs_pos:
        return rows.probes.new_empty((0, r)), torch.empty((0, r), device=q.device)
    return torch.cat(outs_pos), torch.cat(outs_score)
