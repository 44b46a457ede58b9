"""The index kernels compiled for an AVX2-only CPU (``$RECSERVE_KERNEL_MARCH=haswell``: no
AVX-512 outside target-attributed functions, so the heap and ``keep_best``'s AVX2 selection and
rank sort in place of ``TopStream``, the portable float probe, ...) give the answers the int8
paths' property tests and the selection's ask for, each SIMD path this machine runs forced in
turn. An AVX-512 build never runs that code: this found the probe table reading a VNNI query
through the AVX2 kernel there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.cpp_extension import MARCH_ENV

REPO = Path(__file__).resolve().parents[3]
TESTS = [
    "tests/retrieval/index/test_scan_isa.py",
    "tests/retrieval/index/test_probe_table.py",
    "tests/retrieval/index/test_nearest_centroid.py",
    "tests/retrieval/index/test_ivf.py::test_topk_rows_matches_torch_topk",
    "tests/retrieval/index/test_ivf.py::test_topk_rows_keeps_the_lower_index_at_ties",
    "tests/retrieval/index/test_ivf.py::test_a_probes_few_top_lists_are_the_best_in_order",
    "tests/retrieval/index/test_ivf.py::test_a_scan_floor_leaves_out_only_what_scores_below_it",
    "tests/retrieval/index/test_build_steps.py::test_encoded_codes_equal_quantized_residuals",
]
BUILD_S = 600  # two -O3 builds, one per core, on a busy CI machine
KERNELS = (("kernels", "extension"), ("kmeans", "build_kernel"))
"""The index's two C++ libraries: the module and the call that builds each."""


def build(module: str, call: str, env: dict[str, str]) -> subprocess.Popen[str]:
    """A process that builds (or loads) ``retrieval.index.<module>``'s kernel under ``env``."""
    code = f"from retrieval.index.{module} import {call}; {call}()"
    return subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.multiproc
def test_an_avx2_only_build_passes_the_int8_paths_tests():
    env = {**os.environ, MARCH_ENV: "haswell"}
    builds = [build(module, call, env) for module, call in KERNELS]  # at once: one compiler each
    for proc in builds:
        out, _ = proc.communicate(timeout=BUILD_S)
        assert proc.returncode == 0, out[-3000:]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *TESTS],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=BUILD_S,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout
