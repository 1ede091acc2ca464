"""Filesystem probes of the nvme tier: memory filesystems, O_DIRECT support, the file size
limit, private directories."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import resource
from pathlib import Path
from typing import TYPE_CHECKING

from tiers.nvme.layout import ALIGN

if TYPE_CHECKING:
    pass


log = logging.getLogger("tiers.nvme")

def filesystem_type(path: Path) -> int | None:
    """statfs(2) f_type of ``path`` (None where it cannot be read)."""
    if ctypes.sizeof(ctypes.c_long) != 8:
        return None  # f_type is a long on the 64-bit Linux ABIs this reads
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if libc.statfs(os.fsencode(path), buf) != 0:
        return None
    return int(ctypes.c_long.from_buffer(buf).value)


def probe_direct_io(directory: Path) -> str | None:
    """None if O_DIRECT writes and reads work in ``directory``, else why not."""
    if not hasattr(os, "O_DIRECT"):
        return "this platform has no O_DIRECT"
    probe = directory / ".direct-io-probe"
    block = mmap.mmap(-1, ALIGN)  # page-aligned, as O_DIRECT requires
    try:
        fd = os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        block.close()
        return f"the filesystem refuses O_DIRECT at open ({errno.errorcode.get(exc.errno or 0, exc.errno)})"
    try:
        os.pwrite(fd, block, 0)
        os.preadv(fd, [block], 0)
    except OSError as exc:
        return f"O_DIRECT I/O failed ({errno.errorcode.get(exc.errno or 0, exc.errno)})"
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)
        block.close()
    return None


def file_size_limit() -> int | None:
    """This process's RLIMIT_FSIZE (None when unlimited): writes past it fail with EFBIG."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def make_private_dirs(path: Path) -> None:
    """``mkdir -p`` where every directory this creates (the data dir too, not only ``nvme/``)
    is 0700; directories that already exist keep their mode."""
    missing = []
    for folder in (path, *path.parents):
        if folder.is_dir():
            break
        missing.append(folder)
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            continue  # made meanwhile by another process: not ours to change
        os.chmod(folder, 0o700)  # mkdir's mode is masked by the umask


