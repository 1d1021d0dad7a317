"""Positional file I/O shared by the byte paths (splice, compare, writer, fast reader).

Reads and writes take an explicit offset (``preadv``/``pwritev``), so several threads can
use one descriptor at once; `FdCache` keeps one read-only descriptor per file for a run.
"""
from __future__ import annotations

import os
import threading
from typing import Any

__all__ = ["FdCache", "ShortRead", "read_exact", "write_exact"]


class ShortRead(OSError):
    """The file ended before the bytes asked for (a truncated or concurrently changed file)."""


def read_exact(fd: int, buf: Any, pos: int) -> None:
    """Fill ``buf`` (any writable bytes-like object) from ``fd`` at offset ``pos``, or raise `ShortRead`."""
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], pos + done)
        if n <= 0:
            raise ShortRead(f"the file ends {len(view) - done} bytes early (reading at offset {pos + done})")
        done += n


def write_exact(fd: int, parts: list[Any], at: int) -> int:
    """Write ``parts`` (bytes-like) contiguously at file offset ``at``; returns the bytes written.

    Positional, so items of one file can be written in any order (and by several threads)
    once their ranges are reserved.
    """
    views = [memoryview(p).cast("B") for p in parts if len(memoryview(p))]
    total = 0
    while views:
        n = os.pwritev(fd, views, at + total)
        if n <= 0:  # pragma: no cover - pwritev raises on errors
            raise OSError(f"short write at offset {at + total}")
        total += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return total


class FdCache:
    """Read-only descriptors of files, opened once per run and shared by threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fds: dict[Any, int] = {}

    def fd(self, path: Any) -> int:
        with self.lock:
            fd = self.fds.get(path)
            if fd is None:
                fd = self.fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            return fd

    def close(self) -> None:
        with self.lock:
            for fd in self.fds.values():
                os.close(fd)
            self.fds.clear()
