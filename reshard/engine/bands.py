"""Re-cut a tensor whose target chunks take column blocks of source rows: one pass per source.

A TP split of dim 1 from FSDP2's row shards (``--to dp=2,tp=2`` from ``dp_shard=4``) makes
every target chunk a strided box of several source chunks, and every source chunk feed
several target chunks. Assembling target chunks one at a time (`reshard.engine.splice`) reads
each source row once per target that needs a part of it: cheap through the page cache,
but not with direct I/O. Here the unit of work is the source chunk instead:

* A `BandJob` reads one source chunk's storage once, in bands of whole rows, with direct
  I/O (`reshard.storage.files.fileio`), and takes the CRC-32 of every band; at the end the source's
  CRC-32 must equal the one its writer recorded (else `reshard.storage.checkpoints.crcledger.CorruptItem`,
  naming the file and the key: the source is corrupt), which checks every byte this job
  copies out of it.
* For every target chunk the band meets, the intersection is copied out of the band
  (NumPy, box arithmetic) into a buffer laid out like the file, and written at its place
  in the target item: whole 4 KiB blocks with direct I/O, the partial blocks at its edges
  through the page cache (an edge block may be shared with the neighbouring piece, which
  another job writes). The piece's CRC-32 is recorded on its `BandItem`.
* A target item is finished (`BandItem.finish`: pieces tile its storage, CRC-32 combined
  in offset order, tail written) by the caller once every job that feeds it is done.

Used when every intersection is one contiguous run of the *target* chunk (the source side
may be strided); otherwise `reshard.engine.splice` assembles target chunks row slab by row slab.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from reshard.model.geometry import Box, contiguous_run
from reshard.storage.checkpoints import archive
from reshard.storage.checkpoints.crcledger import CorruptItem
from reshard.storage.files.fileio import ALIGN, FdCache, write_exact, write_placed, crc32
from reshard.engine.splice import SourceChunk, SpliceMismatch, WorkerBuffers, as_array, read_piece, item_row_bytes, finish_item

__all__ = ["BandItem", "BandJob", "applies"]


def applies(sources: Sequence[SourceChunk], targets: Sequence[Box], itemsize: int) -> bool:
    """Whether every (source, target) intersection is one contiguous run of the target chunk
    and at least one is strided in its source (else `reshard.engine.splice`'s runs are better),
    and every source records its CRC-32 (the check of this path)."""
    strided = False
    for t in targets:
        for s in sources:
            inter = s.box.intersect(t)
            if inter is None or inter.is_empty():
                continue
            if contiguous_run(inter.relative_to(t), t.sizes) is None:
                return False
            if contiguous_run(inter.relative_to(s.box), s.box.sizes) is None:
                strided = True
    return strided and all(s.crc is not None for s in sources) and bool(targets) and all(t.sizes for t in targets)


@dataclass
class BandItem:
    """One target chunk's item, filled piece by piece by the band jobs of its sources."""

    box: Box
    itemsize: int
    framing: archive.Framing
    fd: int
    direct_fd: int | None
    at: int  # file offset of the item
    pieces: list[tuple[int, int, int]] = field(default_factory=list)  # (storage offset, nbytes, crc)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def storage_at(self) -> int:
        return self.at + self.framing.storage_offset

    def write_head(self) -> None:
        write_exact(self.fd, [self.framing.head], self.at)

    def add(self, offset: int, nbytes: int, crc: int) -> None:
        with self.lock:
            self.pieces.append((offset, nbytes, crc))

    def finish(self) -> int:
        """The pieces must tile the storage exactly; writes the tail, returns the item's CRC-32."""
        crc, end = 0, 0
        for off, n, c in sorted(self.pieces):
            if off != end:
                raise SpliceMismatch(f"the pieces of the item at offset {self.at} {'overlap' if off < end else 'leave a gap'} "
                                     f"at storage byte {min(off, end)}")
            crc = archive.crc32_combine(crc, c, n)
            end += n
        if end != self.framing.storage_nbytes:
            raise SpliceMismatch(f"the pieces of the item at offset {self.at} cover {end} of "
                                 f"{self.framing.storage_nbytes} storage bytes")
        return finish_item(self.framing, self.fd, self.storage_at, crc)


@dataclass
class BandJob:
    """Copy one source chunk's parts into the target items it feeds (see the module docstring)."""

    source: SourceChunk
    targets: list[BandItem]
    itemsize: int

    def run(self, buffers: WorkerBuffers, files: FdCache, slab_bytes: int) -> None:
        s, isz = self.source, self.itemsize
        row = item_row_bytes(s.box.sizes, isz)
        rows = s.box.sizes[0]
        per_band = max(1, slab_bytes // max(1, row))
        crc = 0
        for b0 in range(0, rows, per_band):
            b1 = min(rows, b0 + per_band)
            band = buffers.get((b1 - b0) * row)
            got = read_piece(files, s.path, band, s.storage_at + b0 * row, buffers, crc=0)  # CRC taken as it is read
            crc = archive.crc32_combine(crc, got, len(band))
            band_box = Box((s.box.offsets[0] + b0,) + tuple(s.box.offsets[1:]), (b1 - b0,) + tuple(s.box.sizes[1:]))
            src = as_array(band, band_box.sizes, isz)
            for t in self.targets:
                inter = band_box.intersect(t.box)
                if inter is None or inter.is_empty():
                    continue
                start = contiguous_run(inter.relative_to(t.box), t.box.sizes) * isz
                n = inter.numel * isz
                pos = t.storage_at + start
                lead = pos % ALIGN  # lay the piece out like the file, so its whole blocks are aligned in memory
                out = buffers.get_out(lead + n)
                piece = out[lead:lead + n]
                dst = as_array(piece, inter.sizes, isz)
                dst[...] = src[inter.relative_to(band_box).slices()]
                del dst
                t.add(start, n, crc32(piece))
                write_placed(t.fd, t.direct_fd, out, lead, pos, n)
            del src
        if crc != s.crc:
            raise CorruptItem(s.key, s.path, s.crc or 0, crc)
