"""Arenas left behind by dead owners: found and removed (``kvpool gc``)."""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tiers.cxl.arena import ARENA_NAME, SHM_DIR
from tiers.cxl.index import (
    index_path,
)

if TYPE_CHECKING:
    pass


log = logging.getLogger("tiers.cxl")

# -- stale arenas -------------------------------------------------------------------------

#: a temporary arena younger than this may belong to an owner still starting up
_TMP_GRACE_S = 60.0


def collect_stale_arenas(directory: str | os.PathLike[str] = SHM_DIR, grace_s: float = 0.0) -> list[Path]:
    """Remove kvpool arenas in ``directory`` whose owner is gone (nobody holds their lock),
    with their shared indexes; return the paths removed.

    ``grace_s``: spare an arena whose file changed less than this long ago. A live owner
    touches its arena with every heartbeat (:meth:`CxlTier.mark_in_use`), so this spares the arena
    of an owner that died moments ago: the master has a storage node rescue its objects once
    it declares the owner dead (``node.hand_off_s``), which a process starting on the host
    meanwhile must not pre-empt. ``kvpool gc`` collects at once.

    Safe against a live owner (its lock is held), a starting one (its fresh
    temporary file is spared for a grace period; a starter that loses its
    placeholder retries) and other processes collecting at the same time.
    Processes that still map a removed arena keep their (stale) memory until
    they notice; nothing is truncated under them.
    """
    removed: list[Path] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not ARENA_NAME.match(name):
            continue
        path = Path(directory) / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                continue
            if time.time() - st.st_mtime < (_TMP_GRACE_S if ".tmp-" in name else grace_s):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live owner (or a reader probing for a moment)
            try:
                if not os.path.samestat(st, os.stat(path)):
                    continue
            except FileNotFoundError:
                continue
            os.unlink(path)
            removed.append(path)
            if ".tmp-" not in name:
                _unlink_stale_index(index_path(path))
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d stale cxl arena(s) of dead owners: %s", len(removed),
                 ", ".join(p.name for p in removed))
    return removed


def _unlink_stale_index(path: Path) -> None:
    try:
        st = os.stat(path, follow_symlinks=False)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            os.unlink(path)
    except OSError:
        pass

