"""kvpool's optional C extensions, imported in one place.

``kvpool._layersum`` (per-layer checksums computed while copying), ``kvpool._poll``
(socket polls without the GIL) and ``kvpool._index`` (the master's index and a same-host
arena's shared index probed in C) are built by ``setup.py`` where a C compiler is; without
them kvpool computes the same answers in Python, slower. A process running without them
says so once, in one log line naming what is missing and how to build it.
"""

from __future__ import annotations

import importlib
import logging
import threading
from types import ModuleType

log = logging.getLogger("kvpool")

EXTENSIONS = ("_layersum", "_poll", "_index")
_loaded: dict[str, ModuleType | None] | None = None
_lock = threading.Lock()


def extension(name: str) -> ModuleType | None:
    """The C extension ``kvpool.<name>``, or None where it is not built (the first call of a
    process logs one warning naming every extension missing)."""
    global _loaded
    with _lock:
        if _loaded is None:
            loaded: dict[str, ModuleType | None] = {}
            missing = []
            for ext in EXTENSIONS:
                try:
                    loaded[ext] = importlib.import_module(f"kvpool.{ext}")
                except ImportError as exc:
                    loaded[ext] = None
                    missing.append(f"kvpool.{ext} ({exc})")
            _loaded = loaded
            if missing:
                log.warning("kvpool runs without its C extensions %s: checksums, polls and index probes use "
                            "slower Python fallbacks; build them in place with `pip install -e .` (needs a C "
                            "compiler and the Python headers)", ", ".join(missing))
        return _loaded[name]
