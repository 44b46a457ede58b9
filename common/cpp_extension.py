"""Build-once loading of this project's C++ extensions (torch's loader, cached on disk).

Each extension builds into its own folder under ``$RECSERVE_BUILD_DIR`` (default
``~/.cache/recserve``): torch's loader writes a fixed-name ``build.ninja`` into its build folder,
so two extensions must not share one. A source change rebuilds; otherwise loading is instant.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import ModuleType

_lock = threading.Lock()
_loaded: dict[str, ModuleType] = {}


def load_extension(
    name: str, source: Path, cflags: tuple[str, ...] = ("-O3",), ldflags: tuple[str, ...] = ()
) -> ModuleType:
    """The compiled module ``name`` built from ``source`` (built on first use, thread-safe)."""
    with _lock:
        if name not in _loaded:
            from torch.utils.cpp_extension import load

            root = Path(os.environ.get("RECSERVE_BUILD_DIR", Path.home() / ".cache" / "recserve"))
            build_dir = root / name
            build_dir.mkdir(parents=True, exist_ok=True)
            _loaded[name] = load(
                name=name,
                sources=[str(source)],
                extra_cflags=list(cflags),
                extra_ldflags=list(ldflags),
                build_directory=str(build_dir),
                verbose=False,
            )
        return _loaded[name]
