"""Positional file I/O shared by the byte paths (splice, compare, writer, fast reader).

Reads and writes take an explicit offset (``preadv``/``pwritev``), so several threads can
use one descriptor at once; `FdCache` keeps one read-only descriptor per file for a run.

Direct I/O (``O_DIRECT``) moves file bytes between the disk and this process's buffers
without the page cache. A conversion reads and writes every byte once, so caching them
only costs: the kernel copies each page once more, allocates and later reclaims page
cache for gigabytes that are never read again, and (on virtual machines) pays a
hypervisor fault per freshly touched page. Direct transfers need the file offset, the
length and the buffer address aligned to `ALIGN`; `aligned_buffer` gives such memory
and `open_direct` says (by returning None) when a file system does not support it.
"""
from __future__ import annotations

import errno
import mmap
import os
import threading
from typing import Any

from reshard import safefs

__all__ = ["ALIGN", "HUGE_FROM", "STAGE_BYTES", "FdCache", "ShortRead", "ThreadBuffers", "aligned_buffer", "copy_crc",
           "copy_then_crc", "crc32", "open_direct", "read_at", "read_direct", "read_exact", "start_writeback", "write_exact",
           "write_placed"]

# ``crc32(data, value=0)``: zlib.crc32's values. Every byte path checksums through it, so the bytes
# a conversion moves are checksummed at memory speed where the native module was built (carry-less
# multiplication, about 3.4x zlib 1.2.13's speed here: reshard/storage/files/fastcrc.c).
try:
    from reshard.storage.files.fastcrc import crc32
except ImportError:  # built without a C compiler: the same values, slower
    from zlib import crc32


def copy_then_crc(dst: Any, src: Any, value: int = 0) -> int:
    """``dst[:] = src``, then ``crc32(dst, value)``: `copy_crc` where the native module was not built."""
    memoryview(dst).cast("B")[:] = memoryview(src).cast("B")
    return crc32(dst, value)


# ``copy_crc(dst, src, value=0)``: copies ``src`` into ``dst`` (same length) and returns ``crc32(src,
# value)``, natively in one pass over the bytes (the CRC of each block taken while it is in the
# first-level caches, the copy written past the caches: fastcrc.c).
try:
    from reshard.storage.files.fastcrc import copy_crc
except ImportError:
    copy_crc = copy_then_crc

ALIGN = 4096  # direct I/O alignment used for offsets, lengths and buffers (a page; enough for 4Kn disks)
_O_DIRECT = getattr(os, "O_DIRECT", 0)


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


def _sync_file_range() -> Any:
    import ctypes
    import ctypes.util

    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux (or no such symbol): writeback is left to the kernel
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range() if os.name == "posix" else None
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the dirty pages in the range; do not wait for it


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``length`` bytes at ``offset`` of ``fd`` to disk, now.

    A conversion fsyncs every byte it writes before the commit. Left alone, the kernel
    starts writeback only once dirty pages pass its background threshold (10 % of memory),
    so a large conversion ends with gigabytes still to flush while nothing else runs; a
    hint per finished item spreads the disk writes over the copy instead. It is only a
    hint: it never waits, its errors are ignored (the fsync before the commit is what
    reports them), and where ``sync_file_range`` does not exist it does nothing.
    """
    if _SYNC_FILE_RANGE is not None and length > 0:
        _SYNC_FILE_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


HUGE_FROM = 2 << 20  # buffers of this size and more ask for transparent huge pages (the x86-64 PMD size)


def aligned_buffer(n: int) -> memoryview:
    """``n`` bytes (rounded up to `ALIGN`) of zeroed, page-aligned memory, usable for direct I/O.

    Private anonymous memory, not ``mmap``'s default shared mapping: shared anonymous memory is
    shmem, which gets no transparent huge pages unless the machine's ``shmem_enabled`` says so
    (``never`` by default), while private memory gets them where asked (``madvise``, the usual
    default). Why it matters: a direct read or write pins and maps the buffer's pages for the
    device once per request, per page, which was most of the copy's system time (a 1 GiB
    ``O_DIRECT`` read in 8 MiB requests, ``scripts/bench_copy_crc.py``: 0.04-0.09 s of sys with
    4 KiB pages, 0.007-0.013 s with 2 MiB pages). Only a hint: where the kernel has none, the pages
    are small.
    Such a buffer is mapped in whole huge pages (its length rounded up to `HUGE_FROM`): the kernel
    then places it on a huge-page boundary, where it can back all of it with them (a mapping of
    4 MiB + 8 KiB at an arbitrary address got one 2 MiB page here). The memory touched grows by
    less than one huge page per buffer.
    """
    size = max(ALIGN, -(-int(n) // ALIGN) * ALIGN)
    huge = size >= HUGE_FROM and hasattr(mmap, "MADV_HUGEPAGE")
    mapped = -(-size // HUGE_FROM) * HUGE_FROM if huge else size
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    buf = mmap.mmap(-1, mapped, flags=flags) if flags else mmap.mmap(-1, mapped)
    if huge:
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel built without transparent huge pages: small pages, as before
            pass
    return memoryview(buf)[:size]


class ThreadBuffers(threading.local):
    """Named, page-aligned buffers per thread that grow on demand and are reused: a pool's
    workers each keep their own, allocated on first use (an idle worker costs nothing)."""

    def __init__(self) -> None:
        self._bufs: dict[str, memoryview] = {}

    def take(self, name: str, n: int) -> memoryview:
        """``n`` bytes of this thread's buffer ``name``."""
        buf = self._bufs.get(name)
        if buf is None or len(buf) < n:
            self._bufs.pop(name, None)  # the old buffer goes before the new one is made
            buf = self._bufs[name] = aligned_buffer(n)
        return buf[:n]


def open_direct(path: Any, flags: int) -> int | None:
    """``os.open(path, flags | O_DIRECT)``, or None where the platform or file system has no direct I/O."""
    if not _O_DIRECT:
        return None
    try:
        return os.open(path, flags | _O_DIRECT | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):  # e.g. tmpfs, some FUSE
            return None
        raise


STAGE_BYTES = 8 << 20  # a stage buffer of this size serves direct reads of any length


def read_direct(fd: int, view: memoryview, pos: int, stage: memoryview, crc: int | None = None) -> int | None:
    """Fill ``view`` from ``fd`` (opened with `open_direct`) at any offset ``pos``, or raise `ShortRead`.

    A request aligned on both sides is read straight into ``view``. Otherwise the aligned
    blocks enclosing it are read into ``stage`` (an `aligned_buffer` of at least two
    `ALIGN` blocks; `STAGE_BYTES` is plenty) and the range copied out, a stage-full at a
    time, so the stage bounds the memory whatever the length of the read.

    With ``crc`` (a CRC-32 to continue, 0 to start one), returns ``crc32(view, crc)`` of the
    bytes read, taken in the same pass as the copy out of the stage (`copy_crc`): the caller
    needs the checksum anyway, and a second pass would read the bytes from memory again.
    """
    n = len(view)
    if pos % ALIGN == 0 and n % ALIGN == 0 and _address(view) % ALIGN == 0:
        read_exact(fd, view, pos)
        return None if crc is None else crc32(view, crc)
    # bytes of ``view`` per round: m bytes at any offset span at most ceil(m / ALIGN) + 1 blocks
    cap = (len(stage) // ALIGN - 1) * ALIGN
    if cap <= 0:
        raise ValueError(f"stage buffer of {len(stage)} bytes is too small for direct reads")
    done = 0
    while done < n:
        m = min(cap, n - done)
        got = _read_direct_once(fd, view[done:done + m], pos + done, stage, crc)
        if crc is not None:
            crc = got
        done += m
    return crc


def _read_direct_once(fd: int, view: memoryview, pos: int, stage: memoryview, crc: int | None) -> int | None:
    n = len(view)
    start = pos - pos % ALIGN
    stop = -(-(pos + n) // ALIGN) * ALIGN
    got = 0
    want = pos + n - start  # bytes needed from ``start``; the file may end before ``stop``
    while got < want:
        k = os.preadv(fd, [stage[got:stop - start]], start + got)
        if k <= 0:
            raise ShortRead(f"the file ends {want - got} bytes early (reading at offset {start + got})")
        got += k
    if crc is None:
        view[:] = stage[pos - start:pos - start + n]
        return None
    return copy_crc(view, stage[pos - start:pos - start + n], crc)


def read_at(files: "FdCache", path: Any, view: memoryview, pos: int, stage: Any, direct: bool = True,
            crc: int | None = None) -> int | None:
    """Fill ``view`` from ``path`` at ``pos``: with a direct read where the file system has
    them (through ``stage(n)``, a caller's reusable `aligned_buffer`), else, or when the
    device refuses the alignment (EINVAL), through the page cache. With ``crc``, returns
    ``crc32(view, crc)`` of the bytes read (`read_direct`)."""
    dfd = files.direct(path) if direct else None
    if dfd is not None:
        try:
            return read_direct(dfd, view, pos, stage(min(STAGE_BYTES, len(view) + 2 * ALIGN)), crc)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    read_exact(files.fd(path), view, pos)
    return None if crc is None else crc32(view, crc)


def write_placed(fd: int, direct_fd: int | None, out: memoryview, lead: int, pos: int, n: int) -> None:
    """Write ``out[lead:lead + n]`` at file offset ``pos`` of a file open as ``fd`` and (or
    None) as ``direct_fd``: its whole `ALIGN` blocks with direct I/O, the partial blocks at
    either edge through the page cache (a neighbour may write the rest of such a block).

    ``out`` is an `aligned_buffer` laid out like the file (``lead == pos % ALIGN``), so the
    whole blocks are aligned in memory too. A file system that opens ``O_DIRECT`` but refuses
    the write (EINVAL) gets it through the page cache.
    """
    first = pos + (-pos % ALIGN)          # first block boundary at or after pos
    last = (pos + n) - (pos + n) % ALIGN  # last block boundary at or before the end
    if direct_fd is None or first >= last:
        write_exact(fd, [out[lead:lead + n]], pos)
        return
    if first > pos:
        write_exact(fd, [out[lead:lead + first - pos]], pos)
    view, at, done = out[lead + first - pos:lead + last - pos], first, 0
    try:
        while done < len(view):
            k = os.pwritev(direct_fd, [view[done:]], at + done)
            if k <= 0:  # pragma: no cover - pwritev raises on errors
                raise OSError(errno.EIO, f"short direct write at offset {at + done}")
            done += k
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        write_exact(fd, [view[done:]], at + done)
    if pos + n > last:
        write_exact(fd, [out[lead + last - pos:lead + n]], last)


def _address(view: memoryview) -> int:
    import ctypes

    if view.readonly:
        return 1  # never aligned: read through the stage buffer
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _open_direct_read(path: Any) -> int | None:
    """`open_direct` for reading, through `reshard.safefs` (a regular file inside its directory)."""
    if not _O_DIRECT:
        return None
    try:
        return safefs.open_read(path, flags=_O_DIRECT)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):  # e.g. tmpfs, some FUSE
            return None
        raise


class FdCache:
    """Read-only descriptors of files, opened once per run and shared by threads.

    Files are opened through `reshard.safefs`: each must be a regular file inside the
    directory it is named in (a checkpoint's files are flat), never a symlink out of it.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fds: dict[Any, int] = {}
        self.direct_fds: dict[Any, int | None] = {}

    def fd(self, path: Any) -> int:
        with self.lock:
            fd = self.fds.get(path)
            if fd is None:
                fd = self.fds[path] = safefs.open_read(path)
            return fd

    def direct(self, path: Any) -> int | None:
        """A read-only ``O_DIRECT`` descriptor of ``path``, or None when its file system has none."""
        with self.lock:
            if path not in self.direct_fds:
                self.direct_fds[path] = _open_direct_read(path)
            return self.direct_fds[path]

    def close(self) -> None:
        with self.lock:
            for fd in list(self.fds.values()) + [d for d in self.direct_fds.values() if d is not None]:
                os.close(fd)
            self.fds.clear()
            self.direct_fds.clear()
