"""Bytes per item of our index at its defaults against faiss IVF-SQ8 on the same data (issue 21's
"bytes per item at the default <= SQ8 + 10 %"), with no filter attributes: what an item costs
everywhere (codes, scale, id, the id -> row lookup) plus the per-list buffers over the catalog.

Ours: ``IVFIndex.memory_bytes()`` (every buffer, derived lookups included) / N. SQ8:
``faiss.serialize_index`` / N (codes, ids, centroids, SQ ranges), as ``bench/ann.py`` counts it.
Both are sizes, not timings: one run says them.

    .venv/bin/python bench/index_bytes.py --case 1000000x64:4096 --case 20000x784:128:unit
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import faiss
import torch
from ann_peers import build_faiss_ivfs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from retrieval.index import IVFConfig, build_ivf


def parse_case(text: str) -> tuple[int, int, int, bool]:
    """``NxD:nlist[:unit]`` -> (n, d, nlist, unit vectors)."""
    size, nlist, *rest = text.split(":")
    n, d = (int(v) for v in size.split("x"))
    return n, d, int(nlist), rest == ["unit"]


def measure(n: int, d: int, nlist: int, unit: bool, seed: int = 0) -> dict[str, object]:
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(seed))
    if unit:
        x = torch.nn.functional.normalize(x, dim=1)
    ours = build_ivf(x, IVFConfig(nlist=nlist, nprobe=32)).memory_bytes()
    builds, _ = build_faiss_ivfs(x.numpy(), nlist, train_size=256 * nlist)
    sq8 = len(faiss.serialize_index(builds["faiss-IVF-SQ8"].index)) / n
    per_item = sum(ours.values()) / n
    return {
        "n": n,
        "d": d,
        "nlist": nlist,
        "unit": unit,
        "ours_bytes_per_item": round(per_item, 2),
        "sq8_bytes_per_item": round(sq8, 2),
        "ratio": round(per_item / sq8, 4),
        "ours_by_buffer": {k: round(v / n, 3) for k, v in ours.items() if v},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--case", action="append", help="NxD:nlist[:unit], repeatable")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for case in args.case or ["100000x64:1024"]:
        row = measure(*parse_case(case))
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out is not None:
        args.out.write_text(json.dumps({"argv": sys.argv[1:], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
