"""Checking stored bytes against the CRC-32 their writer recorded, piece by piece.

Every DCP item is a ``torch.save`` zip archive, and its central directory records the
CRC-32 of each member, the tensor's storage bytes included. That record is the only
witness of what the writer wrote: a flipped bit on a disk, a truncated copy patched by
hand or a stray writer all leave a storage whose bytes contradict it, and nothing else in
the checkpoint notices (``torch.load`` does not check CRCs). So every reader of item bytes
checks them against it, on the bytes it reads anyway, never by a second read:

* a reader that holds a whole item in memory checks every member at once
  (`reshard.storage.checkpoints.fastread.check_item_crcs`);
* a reader that sees a storage in pieces (a conversion copying parts of a source shard
  into several targets, a comparison cutting items along the other side's chunks) feeds
  each piece's CRC-32 to a `CrcLedger`, which combines them (``crc32_combine``, no bytes)
  once the pieces tile the storage and compares the result with the record.

A storage whose record is 0 (torch writes 0 when told not to compute CRCs) has no record:
it is counted as *unrecorded*, never as failed. A storage whose bytes contradict their
record is `CorruptItem` (bad input, exit 2), naming the file and the key.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from reshard.errors import BadInput
from reshard.storage.checkpoints.archive import crc32_combine

__all__ = ["CorruptItem", "CrcLedger", "StorageRecord", "combine_tiling"]

CORRUPT_HINT = ("The checkpoint is corrupt (a disk, a copy or a stray writer changed it after it was written); "
                "nothing was written from it. Restore it from a copy, or use another checkpoint.")


class CorruptItem(BadInput):
    """An item's stored bytes contradict the CRC-32 its writer recorded (exit 2)."""

    def __init__(self, key: str | None, file: str | Path, recorded: int, read: int, *, member: str | None = None,
                 changed: tuple[int, int] | None = None):
        self.key, self.file, self.recorded, self.read = key, str(file), recorded, read
        name = Path(file).name
        what = f"item '{key}'" if key is not None else "an item"
        part = f" (member {member})" if member and member != "storage" else ""
        if changed is not None:  # ``recorded``/``read``: the CRC-32s of two reads of the same bytes
            msg = (f"{what} in {name} changed while it was read: two reads of its storage bytes "
                   f"[{changed[0]}, {changed[1]}) have CRC-32 0x{recorded & 0xFFFFFFFF:08x} and 0x{read & 0xFFFFFFFF:08x}")
        else:
            msg = (f"{what} in {name}{part} fails its CRC-32 (recorded 0x{recorded & 0xFFFFFFFF:08x}, "
                   f"read 0x{read & 0xFFFFFFFF:08x})")
        super().__init__(msg, where=str(file), hint=CORRUPT_HINT)


@dataclass(frozen=True)
class StorageRecord:
    """One stored storage: where its bytes lie and the CRC-32 its writer recorded."""

    path: str            # data file
    key: str | None      # the checkpoint key the item belongs to (for messages)
    at: int              # file offset of the storage's first byte
    nbytes: int
    crc: int | None      # None (or 0 in the file): no record

    @property
    def recorded(self) -> bool:
        return bool(self.crc)

    @property
    def ident(self) -> tuple[str, int]:
        return (self.path, self.at)


def combine_tiling(parts: Iterable[tuple[int, int, int]], total: int) -> int | None:
    """The CRC-32 of bytes ``[0, total)`` from ``(offset, nbytes, crc)`` pieces that may
    repeat or overlap, or None when no chain of them tiles the range exactly.

    Readers that cut a storage along another layout read some rows more than once (the
    column blocks of a TP split each read the rows they span): any chain of pieces from 0
    to ``total``, each starting where the previous ends, gives the whole CRC-32.
    """
    if total <= 0:
        return 0
    starts: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for off, n, c in parts:
        if n > 0 and 0 <= off and off + n <= total:
            starts[off].append((n, c))
    prev: dict[int, tuple[int, int, int]] = {}
    todo = [0]
    seen = {0}
    while todo and total not in seen:
        p = todo.pop()
        for n, c in starts.get(p, ()):
            q = p + n
            if q not in seen:
                seen.add(q)
                prev[q] = (p, n, c)
                todo.append(q)
    if total not in seen:
        return None
    chain = []
    q = total
    while q:
        p, n, c = prev[q]
        chain.append((n, c))
        q = p
    crc = 0
    for n, c in reversed(chain):
        crc = crc32_combine(crc, c, n)
    return crc


class CrcLedger:
    """CRC-32s of pieces of storages, checked against their records once the pieces tile them.

    ``add(record, offset, nbytes, crc)`` (thread-safe) records a piece read at ``offset``
    within the storage; when the pieces seen tile the storage, their combined CRC-32 must
    equal the record, else `CorruptItem`. The same bytes read twice with different CRC-32s
    (the file changed while it was read) are `CorruptItem` too. ``verified`` says whether a
    storage was checked; `pending` lists the ones seen only in part (read by another worker,
    or a key that stopped early), so the caller can check them by one read of what is
    missing (`missing`) or report them as not checked. Storages without a record are
    counted (`unrecorded`), never failed.

    ``collect=True``: a contradiction is kept instead of raised, and `raise_first` raises the
    first in (file, offset) order, so a reader whose pieces complete in any order (a thread
    pool) names the same item every run.
    """

    def __init__(self, *, collect: bool = False) -> None:
        self._lock = threading.Lock()
        self.collect = collect
        self.failures: list[CorruptItem] = []
        self._parts: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
        self._records: dict[tuple[str, int], StorageRecord] = {}
        self._covered: dict[tuple[str, int], int] = {}
        self._verified: set[tuple[str, int]] = set()
        self._unrecorded: set[tuple[str, int]] = set()

    def add(self, rec: StorageRecord, offset: int, nbytes: int, crc: int) -> bool:
        """Record one piece; returns True when this piece completed (and passed) the check."""
        ident = rec.ident
        if rec.nbytes == 0:  # nothing to contradict a record
            with self._lock:
                self._verified.add(ident)
            return False
        if not rec.recorded:
            with self._lock:
                self._unrecorded.add(ident)
            return False
        if nbytes <= 0:
            return False
        with self._lock:
            if ident in self._verified:
                return False
            parts = self._parts.setdefault(ident, [])
            self._records[ident] = rec
            for off, n, c in parts:
                if off == offset and n == nbytes:
                    if c != crc:
                        self._fail(rec, CorruptItem(rec.key, rec.path, c, crc, changed=(offset, offset + nbytes)))
                    return False
            parts.append((offset, nbytes, crc))
            self._covered[ident] = self._covered.get(ident, 0) + nbytes
            if self._covered[ident] < rec.nbytes:
                return False
            snapshot = list(parts)
        combined = combine_tiling(snapshot, rec.nbytes)
        if combined is None:  # overlapping pieces that do not chain up yet: wait for more
            return False
        ok = combined == rec.crc
        with self._lock:  # decided either way: no longer pending
            self._parts.pop(ident, None)
            self._covered.pop(ident, None)
            if ok:
                self._verified.add(ident)
        if not ok:
            self._fail(rec, CorruptItem(rec.key, rec.path, rec.crc or 0, combined))
        return ok

    def _fail(self, rec: StorageRecord, exc: CorruptItem) -> None:
        if not self.collect:
            raise exc
        exc.ident = rec.ident  # type: ignore[attr-defined]
        with self._lock:
            self.failures.append(exc)

    def raise_first(self) -> None:
        """Raise the collected contradiction first in (file, offset) order, if any."""
        with self._lock:
            first = min(self.failures, key=lambda e: e.ident, default=None)  # type: ignore[attr-defined]
        if first is not None:
            raise first

    def verified(self, rec: Any) -> bool:
        """Whether the storage (a `StorageRecord`, anything with its ``ident``, or the ident) was checked."""
        ident = getattr(rec, "ident", rec)
        with self._lock:
            return ident in self._verified

    def pending(self) -> list[StorageRecord]:
        """Recorded storages seen in part only, in (file, offset) order."""
        with self._lock:
            return sorted((self._records[i] for i in self._parts if i not in self._verified),
                          key=lambda r: r.ident)

    def missing(self, rec: StorageRecord) -> list[tuple[int, int]]:
        """``(offset, nbytes)`` ranges of the storage no piece covered (what one read must add)."""
        with self._lock:
            parts = sorted(self._parts.get(rec.ident, ()))
        out, end = [], 0
        for off, n, _c in parts:
            if off > end:
                out.append((end, off - end))
            end = max(end, off + n)
        if end < rec.nbytes:
            out.append((end, rec.nbytes - end))
        return out

    def summary(self) -> dict[str, int]:
        """``checked`` (storages whose pieces tiled them and matched), ``unrecorded`` (no record
        to check), ``partial`` (recorded, seen in part only: not checked)."""
        with self._lock:
            return {"checked": len(self._verified), "unrecorded": len(self._unrecorded),
                    "partial": sum(1 for i in self._parts if i not in self._verified)}
