"""Assemble target chunks from source chunks as bytes: no tensors, no pickling, bounded memory.

Resharding a tensor that is only re-cut (same dtype, no layout transform) is a byte copy:
each element of a target chunk sits somewhere in exactly one source chunk. This module
does that copy from the source's data files straight into the target's data file:

* A source item is located once (`reshard.storage.checkpoints.fastread.item_layout`: its zip directory and
  pickle, never its data), giving the file offset of its row-major storage bytes.
* A target chunk is produced in **slabs** of whole dim-0 rows (at most ``slab_bytes``, at
  least one row). For each source chunk meeting the slab, the intersection is either one
  contiguous byte run in both (FSDP2's dim-0 shards, the common case), read with
  ``os.preadv`` straight into the slab buffer, or a strided box (a TP split of dim 1),
  whose source rows are read as one run into a second buffer and the box copied out of
  them with NumPy. (No mmap: mapped file pages would count as the process's memory.)
  When the whole target chunk is such runs, from source storages whose CRC-32 their
  writer recorded, and its storage starts 4 KiB-aligned in the output file (the writer
  aligns storages of 1 MiB and more), the runs are copied with
  **direct I/O** (``O_DIRECT``, `reshard.storage.files.fileio`): read from the source's disk blocks
  into an aligned slab buffer and written from it, with no page cache on either side, so
  the copy costs the disk time and almost no CPU. The slab's CRC-32 is taken on the way
  and must equal the CRC-32s the source items' writer recorded (their zip records),
  combined in the target's order (`SpliceJob.recorded_crc`; parts of a source storage cut
  in two are combined per source by `SourceLedger` once all are in): that is the check of
  those items, and it also catches a source that changed on disk after it was written.
  Otherwise (``--buffered``, a file system without direct I/O) the runs go file to file in the kernel
  (``os.copy_file_range``) through the page cache instead, with the CRC-32 composed from
  the records, and every such item is read back and compared with the source (`check`).
  The read-back reads the source rows, so their CRC-32s go to the same ledger: a source
  storage whose bytes contradict its writer's record stops the conversion there too
  (`reshard.storage.checkpoints.crcledger.CorruptItem`, exit 2, naming the file and the key), whichever
  path copied it.
* The slab's CRC-32 is accumulated, the slab written with ``pwrite`` at its final place;
  the item's head (`reshard.storage.checkpoints.archive`) comes first and its tail, which needs the CRC,
  last. Memory per worker: one slab buffer.
* Items are independent: `run_jobs` fills them from a bounded thread pool (preadv,
  pwrite, CRC-32 and NumPy copies release the GIL), so reading, checksumming and writing
  overlap. The file layout is fixed before any byte is written (reservations), so the
  output is byte-identical whatever the order of completion or the number of workers.

Anything unusual (a storage transform such as zstd, an item this reader cannot parse, a
non-contiguous source storage, a dtype that differs) makes `source_chunks` return None and
the caller decodes that tensor the ordinary way.
"""
from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ContextManager

import numpy as np

from reshard.errors import ReshardError
from reshard.model.geometry import Box, contiguous_run
from reshard.storage.checkpoints import archive
from reshard.storage.checkpoints.crcledger import CorruptItem, CrcLedger, StorageRecord
from reshard.storage.checkpoints.fastread import item_layout
from reshard.storage.files.fileio import (ALIGN, FdCache, ThreadBuffers, crc32, read_at, read_exact, write_exact,
                                          write_placed)

__all__ = [
    "SourceChunk",
    "SourceLedger",
    "SpliceJob",
    "WorkerBuffers",
    "default_window",
    "slab_difference",
    "run_jobs",
    "source_chunks",
]

MIB = 1 << 20


@dataclass(frozen=True)
class SourceChunk:
    """One stored chunk of a source tensor: its global box and where its bytes lie."""

    path: str           # data file
    storage_at: int     # file offset of the chunk's first element byte (row-major, C-contiguous)
    box: Box
    crc: int | None = None  # CRC-32 of exactly the chunk's element bytes, from its zip record (None: unknown)
    key: str | None = None  # the tensor's key (named when the source is corrupt)

    @property
    def ident(self) -> tuple[str, int]:
        """The storage's identity in a `CrcLedger`."""
        return (self.path, self.storage_at)

    def record(self, itemsize: int) -> StorageRecord:
        """The storage as a `CrcLedger` checks it (only meaningful when ``crc`` is known)."""
        return StorageRecord(self.path, self.key, self.storage_at, self.box.numel * itemsize, self.crc)


def source_chunks(root: Path, entry: Any, files: FdCache | None = None,
                  only: Callable[[Any], bool] | None = None) -> list[SourceChunk] | None:
    """The located chunks of a tensor entry of a `CheckpointIndex`, or None when any is unusual.
    ``files``: descriptors kept open across entries (a file is opened once, not once per item).
    ``only``: which item locations this process has (a worker of a divided output fetches from a
    store only the objects, or the items, its own files need); chunks elsewhere are left out."""
    out = []
    for c in entry.chunks:
        loc = c.location
        if only is not None and loc is not None and not only(loc):
            continue
        if loc is None or loc.transforms:
            return None
        path = str(Path(root) / loc.file)
        lay = item_layout(path, loc.offset, loc.length, fd=files.fd(path) if files is not None else None)
        if lay is None or not lay.contiguous or lay.dtype != entry.dtype or lay.shape != tuple(c.box.sizes):
            return None
        start = lay.storage_offset * lay.dtype.itemsize
        if start + lay.nbytes > lay.storage_nbytes:
            return None
        whole_storage = start == 0 and lay.nbytes == lay.storage_nbytes
        # a CRC of 0 is what torch writes when asked not to compute CRCs: treat it as unknown
        crc = lay.storage_crc if whole_storage and lay.storage_crc else None
        out.append(SourceChunk(path, lay.storage_file_offset + start, c.box, crc, entry.key))
    return out


def _located(root: Path, entry: Any, files: FdCache, ready: Callable[[Any], None] | None,
             only: Callable[[Any], bool] | None = None,
             hold: Callable[[Any], ContextManager[Any]] | None = None) -> list[SourceChunk] | None:
    if ready is not None:
        ready(entry)
    if hold is None:
        return source_chunks(root, entry, files, only)
    with hold(entry):
        return source_chunks(root, entry, files, only)


class Locator:
    """`source_chunks` of every tensor entry, started at once on a small pool, taken in order.

    Locating an item reads two small pieces of it (zip directory, pickle); on a cold cache
    each is a disk seek, so they are issued from several threads, ahead of the copy that
    needs them: the copy of the first tensor starts while later ones are still located.
    """

    def __init__(self, root: Path, entries: Iterable[Any], threads: int = 8,
                 ready: Callable[[Any], None] | None = None, only: Callable[[Any], bool] | None = None,
                 hold: Callable[[Any], ContextManager[Any]] | None = None):
        """``ready(entry)``, when given, returns once the entry's items are in ``root``'s files (a
        store's objects still arriving in the read cache: `reshard.storage.objectstore.remote.Mirror`).
        ``hold(entry)``, when given, is a context that has the bytes to locate the entry's items in
        ``root``'s files while it lasts (`reshard.storage.objectstore.window.RangeWindow`).
        ``only``: which item locations ``root`` holds when not all (`source_chunks`)."""
        self._files = FdCache()  # each data file opened once for every item located in it
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="reshard-locate")
        self._futures = {e.key: self._pool.submit(_located, root, e, self._files, ready, only, hold)
                         for e in entries if e.is_tensor}

    def get(self, key: str) -> list[SourceChunk] | None:
        fut = self._futures.get(key)
        return fut.result() if fut is not None else None

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._files.close()


class WorkerBuffers(ThreadBuffers):
    """Buffers per worker thread (the target slab; source rows for strided copies or the
    stage of direct reads; pieces of band jobs), allocated on first use, so idle workers
    cost nothing."""

    def get(self, n: int) -> memoryview:
        """``n`` bytes of the slab buffer (page-aligned: direct I/O reads and writes it)."""
        return self.take("slab", n)

    def get_aux(self, n: int) -> memoryview:
        """``n`` bytes of the second buffer: source rows of strided copies, or the stage of direct reads."""
        return self.take("aux", n)

    def get_out(self, n: int) -> memoryview:
        """``n`` bytes of a third buffer, for the pieces `reshard.engine.bands` writes."""
        return self.take("out", n)


def as_array(buf: Any, shape: Sequence[int], itemsize: int, offset: int = 0) -> np.ndarray:
    """A byte-exact view ``shape + (itemsize,)`` of uint8 over ``buf`` (any dtype: bits are copied)."""
    return np.ndarray(tuple(shape) + (itemsize,), dtype=np.uint8, buffer=buf, offset=offset)


class SpliceMismatch(ReshardError):
    """A spliced item does not read back as its source (an I/O fault or a bug): nothing is committed."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(message, hint="Nothing was committed. Run the conversion again; if it happens again, check "
                                       "the disks and memory of this machine, or report it as a reshard bug.")


@dataclass
class SpliceJob:
    """Write one target chunk, assembled from ``sources``, at ``at`` of ``fd``."""

    box: Box
    itemsize: int
    framing: archive.Framing
    sources: list[SourceChunk]
    checked: bool = False   # set by `run`: checked against the source records while written
    ledgered: bool = False  # set by `run`: its source parts went to the ledger (checked when complete)
    ledger_sources: list[SourceChunk] = field(default_factory=list)  # ... from these source chunks
    ledger: CrcLedger | None = None  # set by `run`: where `check` also sends the source rows it reads

    def run(self, fd: int, at: int, buffers: WorkerBuffers, files: FdCache, slab_bytes: int,
            direct_fd: int | None = None, ledger: SourceLedger | None = None) -> int:
        """Returns the CRC-32 of the whole item as written.

        With ``direct_fd`` (an ``O_DIRECT`` descriptor of the same file), an aligned storage
        and contiguous runs from sources with recorded CRC-32s, the copy goes through
        `_direct_runs`. If every run is a whole source storage it is checked against those
        records at once (``self.checked``); if some are parts, each part's CRC-32 goes to
        ``ledger``, which checks a source once all its parts are in (``self.ledgered``).
        Either way `check` need not read the item back; without a direct copy it must.
        """
        self.checked = self.ledgered = False
        if ledger is not None:
            self.ledger = ledger
        write_exact(fd, [self.framing.head], at)
        pos = at + len(self.framing.head)
        runs = self._runs()
        # Direct only where the records can check the copy (a direct copy is not in the page
        # cache, so reading it back would go to the disk twice more).
        direct = (runs is not None and direct_fd is not None and pos % ALIGN == 0
                  and all(s.crc is not None for _d, s, _so, _n in runs))
        expected = self.recorded_crc() if direct else None
        if expected is not None or (direct and ledger is not None):
            crc = self._copy_direct(runs, expected, ledger, fd, direct_fd, at, pos, buffers, files, slab_bytes)
        elif runs is not None:
            crc = _copy_runs(runs, self.itemsize, fd, pos, buffers, files, slab_bytes)
        else:
            crc = self._copy_slabs(fd, pos, buffers, files, slab_bytes)
        return finish_item(self.framing, fd, pos, crc)

    def _copy_direct(self, runs: list, expected: int | None, ledger: SourceLedger | None, fd: int, direct_fd: int,
                     at: int, pos: int, buffers: WorkerBuffers, files: FdCache, slab_bytes: int) -> int:
        """`_direct_runs`, checked against ``expected`` (the records combined) or handed to ``ledger``."""
        crc, parts = _direct_runs(runs, self.framing.storage_nbytes, fd, direct_fd, pos, buffers, files, slab_bytes)
        if expected is not None:
            for (_d, s, _so, _n), c in zip(runs, parts):  # each run is a whole source storage: name the bad one
                if c != s.crc:
                    raise CorruptItem(s.key, s.path, s.crc or 0, c)
            if crc != expected:
                raise SpliceMismatch(
                    f"the bytes copied into the item at offset {at} do not have the CRC-32 their source items "
                    f"recorded: a source file changed after it was written, or was read wrong "
                    f"({', '.join(sorted({s.path for s in self.sources}))})")
            self.checked = True
        else:
            for (_d, s, so, n), c in zip(runs, parts):
                ledger.add(s.record(self.itemsize), so, n, c)
            self.ledgered = True
            self.ledger_sources = [s for _d, s, _so, _n in runs]
        return crc

    def _copy_slabs(self, fd: int, pos: int, buffers: WorkerBuffers, files: FdCache, slab_bytes: int) -> int:
        """Strided boxes: the storage assembled in slabs of whole rows; returns its CRC-32."""
        box, isz = self.box, self.itemsize
        crc = 0
        sizes = box.sizes
        rows = sizes[0] if sizes else 1
        row_bytes = item_row_bytes(sizes, isz)
        if rows and row_bytes:
            meeting = [s for s in self.sources if not sizes or s.box.intersect(box) is not None]
            widest = max([row_bytes] + [item_row_bytes(s.box.sizes, isz) for s in meeting])
            per_slab = max(1, slab_bytes // widest) if sizes else 1
            for r0 in range(0, rows, per_slab):
                r1 = min(rows, r0 + per_slab)
                if sizes:
                    slab = Box((box.offsets[0] + r0,) + tuple(box.offsets[1:]), (r1 - r0,) + tuple(sizes[1:]))
                else:
                    slab = box
                view = buffers.get(slab.numel * isz)
                filled = 0
                for s in meeting:
                    inter = s.box.intersect(slab) if sizes else s.box
                    if inter is None or inter.is_empty():
                        continue
                    filled += inter.numel
                    _copy_into(view, slab, s, inter, isz, files, buffers)
                if filled != slab.numel:
                    raise OSError(f"source chunks cover {filled} of {slab.numel} elements of a target slab")
                crc = crc32(view, crc)
                write_exact(fd, [view], pos)
                pos += len(view)
        return crc

    def check(self, path: str, fd: int, at: int, buffers: WorkerBuffers, files: FdCache, slab_bytes: int,
              ledger: CrcLedger | None = None) -> None:
        """Re-read the written item and compare it with the source; raise `SpliceMismatch` if it differs.

        The source rows read for the comparison are checksummed on the way and go to
        ``ledger`` (default: the one `run` was given, else one of this job's own), which
        checks each source storage against its writer's record once its rows tile it
        (`CorruptItem`): equal to the source is not enough when the source itself is corrupt.

        Independent of how `run` placed the bytes: the item is parsed back as a zip archive
        (`reshard.storage.checkpoints.fastread.item_layout`: members, pickle, dtype and shape must be the
        target chunk's), then, slab by slab, the target rows and the source rows they come
        from are read back and compared as NumPy views cut by box arithmetic alone, bitwise.
        Both sides are still in the page cache, and the check runs on the pool while other
        items are copied, so it overlaps the copy instead of following it.
        """
        lay = item_layout(path, at, self.framing.length, fd=fd)  # the writer's own descriptor: read and write
        if lay is None or lay.shape != tuple(self.box.sizes) or not lay.contiguous \
                or lay.storage_file_offset != at + self.framing.storage_offset or lay.dtype.itemsize != self.itemsize:
            raise SpliceMismatch(f"the item written at {path}:{at} does not read back as the planned chunk")
        box, isz = self.box, self.itemsize
        sizes = box.sizes
        ledger = ledger or self.ledger or CrcLedger()
        if not sizes:
            view = buffers.get(isz)
            read_exact(fd, view, lay.storage_file_offset)
            src = self.sources[0]
            other = buffers.get_aux(isz)
            read_exact(files.fd(src.path), other, src.storage_at)
            if src.crc is not None:
                ledger.add(src.record(isz), 0, isz, crc32(other))
            if bytes(view) != bytes(other):
                raise SpliceMismatch(f"the item written at {path}:{at} differs from the source")
            return
        row = item_row_bytes(sizes, isz)
        if not row or not sizes[0]:
            return
        meeting, slabs = self.check_slabs(slab_bytes)
        for r0, slab in slabs:
            out = _window(fd, lay.storage_file_offset + r0 * row, slab.numel * isz, buffers.get)
            bad, seen = slab_difference(out, slab, meeting, isz, files, buffers, ledger)
            if bad is not None:
                raise SpliceMismatch(f"the item written at {path}:{at} differs from the source in rows "
                                     f"{bad.offsets[0]}..{bad.offsets[0] + bad.sizes[0] - 1}")
            if seen != slab.numel:
                raise SpliceMismatch(f"the sources cover {seen} of {slab.numel} elements of the item at {path}:{at}")

    def check_slabs(self, slab_bytes: int) -> tuple[list, list[tuple[int, Box]]]:
        """How a check reads the target back: the source chunks that meet it, and its slabs of whole
        rows ``(first row, box)``, each at most `CHECK_WINDOW` (or ``slab_bytes``) on either side."""
        box, isz = self.box, self.itemsize
        sizes = box.sizes
        row = item_row_bytes(sizes, isz)
        meeting = [s for s in self.sources if s.box.intersect(box) is not None]
        widest = max([row] + [item_row_bytes(s.box.sizes, isz) for s in meeting])
        per_slab = max(1, min(slab_bytes, CHECK_WINDOW) // widest)
        slabs = []
        for r0 in range(0, sizes[0], per_slab):
            r1 = min(sizes[0], r0 + per_slab)
            slabs.append((r0, Box((box.offsets[0] + r0,) + tuple(box.offsets[1:]), (r1 - r0,) + tuple(sizes[1:]))))
        return meeting, slabs

    def recorded_crc(self) -> int | None:
        """The CRC-32 the target storage must have, from the source items' own zip records:
        the records of the source chunks it is made of, combined in row-major order of their
        global boxes (box arithmetic only, not `_runs`); None unless every piece is a whole
        source storage with a recorded CRC (a source cut in two has no record for a part)."""
        pieces = []
        for s in self.sources:
            inter = s.box.intersect(self.box) if self.box.sizes else s.box
            if inter is None or inter.is_empty():
                continue
            if s.crc is None or tuple(inter.offsets) != tuple(s.box.offsets) or tuple(inter.sizes) != tuple(s.box.sizes):
                return None
            pieces.append(s)
        if sum(s.box.numel for s in pieces) != self.box.numel:
            return None
        crc = 0
        for s in sorted(pieces, key=lambda s: tuple(s.box.offsets)):
            crc = archive.crc32_combine(crc, s.crc, s.box.numel * self.itemsize)
        return crc

    def _runs(self) -> list[tuple[int, SourceChunk, int, int]] | None:
            """``(target byte offset, source, source byte offset, nbytes)`` per source piece, in target
            order, when every piece is one contiguous run on both sides (dim-0 re-cuts); else None."""
            box, isz = self.box, self.itemsize
            runs = []
            covered = 0
            for s in self.sources:
                inter = s.box.intersect(box) if box.sizes else s.box
                if inter is None or inter.is_empty():
                    continue
                rel_src, rel_dst = inter.relative_to(s.box), inter.relative_to(box)
                src_run = contiguous_run(rel_src, s.box.sizes)
                dst_run = contiguous_run(rel_dst, box.sizes)
                if src_run is None or dst_run is None:
                    return None
                runs.append((dst_run * isz, s, src_run * isz, inter.numel * isz))
                covered += inter.numel
            if covered != box.numel:
                return None
            runs.sort(key=lambda r: r[0])
            return runs


def _copy_runs(runs: list[tuple[int, SourceChunk, int, int]], isz: int, fd: int, pos: int, buffers: WorkerBuffers,
               files: FdCache, slab_bytes: int) -> int:
    """Copy contiguous runs file to file in the kernel (``copy_file_range``); returns the storage CRC.

    A run that is a whole source storage takes its CRC from the source's zip record (no
    read); a partial run is read once, in slabs, to checksum it.
    """
    crc = 0
    for dst_off, s, src_off, n in runs:
        sfd = files.fd(s.path)
        _kernel_copy(sfd, s.storage_at + src_off, fd, pos + dst_off, n, buffers, slab_bytes)
        if s.crc is not None and src_off == 0 and n == s.box.numel * isz:
            part = s.crc
        else:
            part = 0
            done = 0
            while done < n:
                k = min(slab_bytes, n - done)
                view = buffers.get(k)
                read_exact(sfd, view, s.storage_at + src_off + done)
                part = crc32(view, part)
                done += k
        crc = archive.crc32_combine(crc, part, n)
    return crc


def finish_item(framing: archive.Framing, fd: int, storage_at: int, storage_crc: int) -> int:
    """Write an item's tail after its storage (it needs the storage's CRC-32); returns the
    CRC-32 of the whole item."""
    tail = framing.tail(storage_crc)
    write_exact(fd, [tail], storage_at + framing.storage_nbytes)
    return framing.item_crc(storage_crc, tail)


def _direct_runs(runs: list[tuple[int, SourceChunk, int, int]], nbytes: int, fd: int, direct_fd: int,
                 pos: int, buffers: WorkerBuffers, files: FdCache, slab_bytes: int) -> tuple[int, list[int]]:
    """Copy contiguous runs through this process with direct I/O on both sides; returns the
    storage's CRC-32 and the CRC-32 of each run's bytes.

    Slabs of the target storage (``pos`` is `ALIGN`-aligned) are filled by direct reads of
    the sources, checksummed, and written with one direct write each; the storage's last
    partial block, if any, is written through the page cache (the item's tail follows it
    there). No page of the copy passes through the page cache, and the bytes are in this
    process once, where their CRC-32 is taken (`SpliceJob.run` checks it): in the same pass
    that copies a source piece out of the direct read's stage (`read_piece`), so each byte
    crosses memory once on the way in and once on the way out.
    """
    slab = max(ALIGN, slab_bytes - slab_bytes % ALIGN)
    crc = 0
    parts = [0] * len(runs)
    for o in range(0, nbytes, slab):
        k = min(slab, nbytes - o)
        view = buffers.get(k)
        for i, (d, s, so, n) in enumerate(runs):  # in target order, so the pieces tile the slab in order
            lo, hi = max(o, d), min(o + k, d + n)
            if lo >= hi:
                continue
            c = read_piece(files, s.path, view[lo - o:hi - o], s.storage_at + so + (lo - d), buffers, crc=0)
            parts[i] = archive.crc32_combine(parts[i], c, hi - lo)
            crc = archive.crc32_combine(crc, c, hi - lo)
        write_placed(fd, direct_fd, view, 0, pos + o, k)
    return crc, parts


SourceLedger = CrcLedger
"""Checks copies that take parts of source storages (a shard cut in two, as in dp 2 -> 4),
for which no single target item can be checked against a record: every copy (direct, or
read back) reports each source part's CRC-32 (`SourceChunk.record`), and the ledger checks
a source storage once its parts tile it (`reshard.storage.checkpoints.crcledger.CrcLedger`). After the copy,
``verified(source)`` says whether it was checked (not, e.g., when another worker of a
distributed run copied the rest of it; the caller then compares those keys after writing)."""


def read_piece(files: FdCache, path: str, view: memoryview, pos: int, buffers: WorkerBuffers,
               crc: int | None = None) -> int | None:
    """Source bytes into ``view``: a direct read where the file system has one, else through the cache.
    With ``crc``, returns ``crc32(view, crc)``, taken as the bytes are copied out of the direct read's
    stage (`reshard.storage.files.fileio.read_direct`) rather than in a second pass over them."""
    return read_at(files, path, view, pos, buffers.get_aux, crc=crc)


def _kernel_copy(sfd: int, src_at: int, dfd: int, dst_at: int, n: int, buffers: WorkerBuffers, slab_bytes: int) -> None:
    """``n`` bytes from ``sfd@src_at`` to ``dfd@dst_at``: copy_file_range, else a buffered copy."""
    done = 0
    while done < n:
        k = 0
        if hasattr(os, "copy_file_range"):
            try:
                k = os.copy_file_range(sfd, dfd, n - done, src_at + done, dst_at + done)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                k = 0
        if k <= 0:
            k = min(slab_bytes, n - done)
            view = buffers.get(k)
            read_exact(sfd, view, src_at + done)
            write_exact(dfd, [view], dst_at + done)
        done += k


def _copy_into(view: memoryview, slab: Box, s: SourceChunk, inter: Box, isz: int, files: FdCache,
               buffers: WorkerBuffers) -> None:
    rel_src = inter.relative_to(s.box)
    rel_dst = inter.relative_to(slab)
    sf, df, n = contiguous_run(rel_src, s.box.sizes), contiguous_run(rel_dst, slab.sizes), inter.numel
    if sf is not None and df is not None:
        read_exact(files.fd(s.path), view[df * isz:(df + n) * isz], s.storage_at + sf * isz)
        return
    # Strided: read the source rows the box spans (one contiguous run), then copy the box.
    # (Plain reads, not mmap: mapped file pages would count as this process's memory.)
    first, count = rel_src.offsets[0], rel_src.sizes[0]
    row = item_row_bytes(s.box.sizes, isz)
    span = buffers.get_aux(count * row)
    read_exact(files.fd(s.path), span, s.storage_at + first * row)
    src = as_array(span, (count,) + tuple(s.box.sizes[1:]), isz)
    dst = as_array(view, slab.sizes, isz)
    dst[rel_dst.slices()] = src[(slice(0, count),) + rel_src.slices()[1:]]
    del src, dst


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
CHECK_WINDOW = 32 * MIB  # bytes per side the read-back check files at a time


def _window(fd: int, pos: int, n: int, fallback: Callable[[int], memoryview]) -> Any:
    """``n`` bytes of ``fd`` at ``pos`` for reading: a read-only mapping of just that window.

    Comparing page cache in place costs about half of copying it into a buffer first. The
    mapping lives as long as the returned array and its views (at most `CHECK_WINDOW`
    bytes per side and thread, so memory stays flat); a range the file does not fully
    cover (mapping it would fault) or a tiny one is read into a buffer instead.
    """
    if n >= MIB and os.fstat(fd).st_size >= pos + n:
        start = pos - pos % mmap.ALLOCATIONGRANULARITY
        mm = mmap.mmap(fd, n + pos - start, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=start)
        return np.frombuffer(mm, dtype=np.uint8, count=n, offset=pos - start)
    view = fallback(n)
    read_exact(fd, view, pos)
    return view


def slab_difference(out: Any, slab: Box, meeting: list, isz: int, files: FdCache, buffers: WorkerBuffers,
                    ledger: Any) -> tuple[Box | None, int]:
    """Target rows ``out`` (of box ``slab``) against the source rows they are cut from, read now:
    (the first intersection that differs, or None; the elements compared). The source rows'
    CRC-32s go to ``ledger`` (unless None), so a source contradicting its own records is caught
    by the same read. Used by the write check (`SpliceJob.check`) and the resume proof."""
    outv = as_array(out, slab.sizes, isz)
    seen = 0
    for s in meeting:
        inter = s.box.intersect(slab)
        if inter is None or inter.is_empty():
            continue
        rel = inter.relative_to(s.box)
        srow = item_row_bytes(s.box.sizes, isz)
        span = _window(files.fd(s.path), s.storage_at + rel.offsets[0] * srow, rel.sizes[0] * srow, buffers.get_aux)
        if s.crc is not None and ledger is not None:  # the source rows, checked against their writer's record
            ledger.add(s.record(isz), rel.offsets[0] * srow, rel.sizes[0] * srow, crc32(span))
        srcv = as_array(span, (rel.sizes[0],) + tuple(s.box.sizes[1:]), isz)
        if not bits_equal(outv[inter.relative_to(slab).slices()], srcv[(slice(0, rel.sizes[0]),) + rel.slices()[1:]]):
            return inter, seen
        seen += inter.numel
    return None, seen


def bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality of two ``(..., itemsize)`` uint8 views, compared as wide integers.

    ``np.array_equal`` builds a boolean per compared unit, so comparing bytes costs about
    ten times more than comparing 8-byte words; contiguous runs are compared as uint64,
    strided boxes as unsigned integers of the element size.
    """
    if a.shape != b.shape:
        return False
    if a.flags.c_contiguous and b.flags.c_contiguous:
        fa, fb = a.reshape(-1), b.reshape(-1)
        if fa.size % 8 == 0:
            return bool(np.array_equal(fa.view(np.uint64), fb.view(np.uint64)))
        return bool(np.array_equal(fa, fb))
    dt = _UINT.get(a.shape[-1]) if a.ndim else None
    if dt is not None and a.strides[-1] == 1 and b.strides[-1] == 1:
        return bool(np.array_equal(a.view(dt)[..., 0], b.view(dt)[..., 0]))
    return bool(np.array_equal(a, b))


def item_row_bytes(sizes: Sequence[int], isz: int) -> int:
    n = isz
    for x in sizes[1:]:
        n *= x
    return n


def default_window() -> int:
    """Bytes of slab buffers in flight: 1/16 of available memory, between 64 MiB and 1 GiB."""
    avail = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:  # pragma: no cover - not Linux
        pass
    if not avail:
        avail = 4 << 30
    return int(min(1 << 30, max(64 * MIB, avail // 16)))


def default_threads() -> int:
    return max(4, min(8, os.cpu_count() or 4))  # direct I/O threads mostly wait on the disk: keep it busy


def run_jobs(jobs: Iterable[tuple[Callable[..., int], Any]], *, threads: int, window: int,
             on_done: Callable[[Any, int], None], ahead: int | None = None) -> None:
    """Run ``(job.run-like callable, token)`` pairs on a bounded pool; ``on_done(token, crc)`` in submission order.

    Each callable is called as ``fn(buffers, files, slab_bytes)`` and returns a CRC-32.
    At most ``2 * threads`` jobs are queued ahead, so memory is ``threads`` slab buffers
    of ``window // threads`` bytes each. The first exception stops the run and is raised
    (after the in-flight jobs end); ``on_done`` is called in submission order so the
    caller's bookkeeping (and fault-injection events) is deterministic. ``ahead``: also at most
    this many bytes of items (a token's ``length``) queued ahead, so what the jobs write and the
    caller has not taken yet stays bounded on disk too (an output streamed into a store).
    """
    threads = max(1, int(threads))
    slab = max(MIB, int(window) // threads)
    buffers, files = WorkerBuffers(), FdCache()
    pending: list[tuple[Any, Any]] = []
    try:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="reshard-io") as pool:
            try:
                queued = 0
                for fn, token in jobs:
                    pending.append((pool.submit(fn, buffers, files, slab), token))
                    queued += getattr(token, "length", 0) if ahead is not None else 0
                    while len(pending) > 2 * threads or (ahead is not None and len(pending) > 1 and queued > ahead):
                        fut, tok = pending.pop(0)
                        queued -= getattr(tok, "length", 0) if ahead is not None else 0
                        on_done(tok, fut.result())
                while pending:
                    fut, tok = pending.pop(0)
                    on_done(tok, fut.result())
            except BaseException:
                for fut, _ in pending:
                    fut.cancel()
                raise
    finally:
        files.close()
