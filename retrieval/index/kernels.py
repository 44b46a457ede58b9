"""The index's C++ library (``csrc/ivf_scan/``, its files listed in ``ivf_scan.h``): the list
scan, the probe, the id lookup and the build's passes, built on first use with torch's C++
extension loader and cached on disk (``common/cpp_extension.py``). ``scan.py`` wraps its search
kernels; ``exclude.py`` its id lookup; ``build.py`` its build passes."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from common.cpp_extension import load_extension

_SRC = Path(__file__).parent / "csrc" / "ivf_scan"  # every .cpp of the folder, one module
_loaded: list[ModuleType] = []


def extension() -> ModuleType:
    """Builds (once per source version, cached on disk) and loads the C++ library; later calls
    are one list read (kernels call this per op)."""
    if not _loaded:
        _loaded.append(
            load_extension(
                "recserve_ivf_scan", _SRC, ("-O3", "-march=native", "-fopenmp"), ("-fopenmp",)
            )
        )
    return _loaded[0]
