"""A worker's share of a store's data objects, fetched by ranges into sparse local files, bounded.

A worker of a distributed conversion from a store (`reshard.engine.streaming`) needs only the byte
ranges its own target files are cut from. Fetching whole objects into a read cache (what one process
does, `reshard.storage.objectstore.remote.Mirror`) would cost local disk proportional to the worker's
share of the checkpoint; here local disk stays within a budget whatever the checkpoint's size:

- the bytes land in one sparse local file per object, at their own offsets, so the copy splices from
  those files exactly as from a local checkpoint (same reads, same checks against the writers' CRC-32s);
- what a reader needs is a *unit*: a list of ``(object, offset, length)`` ranges, registered in the
  order the copy will consume them (`need`), fetched when admitted, waited for (`wait`) and released
  once read (`release`), which punches the bytes out of the local file;
- the disk is kept in blocks of `BLOCK` bytes with a count of the units holding each, so two readers
  of the same bytes (a source row range feeding two target items) fetch them once and neither frees
  them under the other;
- each unit has its reader's place in the order the readers run (``seq``: a tensor's place in the copy);
  the lowest waiting unit is admitted when the blocks it adds fit the budget, or when no unit of a lower
  place is still held. The copy's jobs run in order on a FIFO pool, so the unit a job waits for is
  admitted once the jobs before it end, whatever was registered ahead of it: the window never deadlocks,
  and its peak disk is the budget or, above it, one tensor's units (a target item's source rows) plus
  what `fetch_now` holds while items are located;
- units admitted together have their new blocks fetched together: neighbouring ranges of one object,
  up to `MAX_GET` bytes, by one ranged GET;
- `fetch_now` fetches small ranges outside the budget at once (the head and the tail of an item, read to
  locate its storage), for a caller that releases them right after.

Every byte is the store's, read through `RemoteCheckpoint.read_range` (pinned to the version listed);
a fetch's error is raised where a reader waits. Nothing here knows what the bytes mean.
"""
from __future__ import annotations

import os
import shutil
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from reshard.storage.objectstore.stream import punch_hole

__all__ = ["BLOCK", "LOCATORS", "RangeWindow", "Unit"]

#: The window's unit of local disk: bytes fetched and freed in whole blocks (aligned to offset 0, so a
#: direct read's 4 KiB-aligned extension of a range lies in blocks fetched for it).
BLOCK = 64 << 10
#: Items located at once from a window (the locator's threads): each holds a block at each end while located.
LOCATORS = 2
#: What items being located hold at most (`fetch_now`).
LOCATING = LOCATORS * 2 * BLOCK
#: At most this many bytes in one ranged GET (contiguous blocks of one object are fetched together).
MAX_GET = 8 << 20


@dataclass
class Unit:
    """What one reader needs: its ranges as blocks ``(object, index)``; ``admitted`` once fetched or under way."""

    blocks: list[tuple[str, int]]
    seq: int = 0  # its place in the readers' order: units are admitted lowest first (`need`)
    parent: bool = False  # held for the other units of its ``seq`` and released after them (`need`)
    counted: bool = True  # False: `fetch_now`'s, outside the budget and the admission order
    admitted: bool = False
    released: bool = False


class RangeWindow:
    """Ranges of the objects of ``rc`` (a `RemoteCheckpoint`) kept in sparse files under ``folder``,
    at most ``budget`` bytes of them at once but for one unit larger than that (module docstring)."""

    def __init__(self, rc: Any, folder: Path, budget: int, *, streams: int = 4):
        # the units' share: the budget less what `fetch_now` may hold (the locator's threads, two blocks each)
        self.rc, self.folder, self.budget = rc, Path(folder), max(BLOCK, int(budget) - LOCATING)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.cond = threading.Condition()
        self.refs: dict[tuple[str, int], int] = {}      # block -> units holding it
        self.present: set[tuple[str, int]] = set()     # blocks on disk
        self.fetching: set[tuple[str, int]] = set()    # blocks a GET is bringing
        self.queue: list[Unit] = []                    # units waiting for admission
        self.held: Counter[int] = Counter()            # admitted counted units not released yet, by seq
        self.held_children: Counter[int] = Counter()   # ... of them not parents
        self.order = 0                                 # the seq of a unit registered without one
        self.used = self.peak = self.fetched = self.requests = self.punched = 0
        self.error: BaseException | None = None
        self.closed = False
        self.fds: dict[str, int] = {}
        self.names: dict[str, Unit] = {}  # units registered under a name, until `named` takes them
        self.pool = ThreadPoolExecutor(max_workers=max(1, streams), thread_name_prefix="reshard-window")
        self.admitter = threading.Thread(target=self._admit, name="reshard-window-admit", daemon=True)
        self.admitter.start()

    @property
    def root(self) -> Path:
        """The folder of the local files (each named as its object and as large, sparse)."""
        return self.folder

    def prepare(self, names: Iterable[str]) -> None:
        """Create the local file of each object ``names`` (sparse, the object's size), so readers may open them first."""
        for name in names:
            self._fd(name)

    def _fd(self, name: str) -> int:
        with self.cond:
            fd = self.fds.get(name)
            if fd is None:
                fd = self.fds[name] = os.open(self.folder / name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                os.ftruncate(fd, self.rc.sizes[name])
            return fd

    # -- readers -----------------------------------------------------------------------------------
    def blocks_of(self, ranges: Iterable[tuple[str, int, int]]) -> list[tuple[str, int]]:
        """The blocks covering ``ranges`` (each once, in order)."""
        out: dict[tuple[str, int], None] = {}
        for name, offset, length in ranges:
            if length <= 0:
                continue
            for b in range(offset // BLOCK, (offset + length - 1) // BLOCK + 1):
                out.setdefault((name, b))
        return list(out)

    def need(self, ranges: Iterable[tuple[str, int, int]], *, name: str | None = None, seq: int | None = None,
             parent: bool = False) -> Unit:
        """Register a reader's ranges. ``seq``: its place in the order the readers run (a tensor's place
        in the copy); units are admitted lowest ``seq`` first, in registration order among equals, and
        one is let in over the budget only when no unit of a lower ``seq`` is held (so the lowest always
        comes in once the readers before it end: no deadlock, whatever was registered ahead). Without
        ``seq``: after every unit registered so far. ``parent``: the unit is released only after the other
        units of its ``seq`` (a tensor's whole items, held until its jobs end), so it never keeps them out;
        two other units of one ``seq`` come in one after the other when over the budget. ``name``: another
        thread may wait for the unit by it (`named`)."""
        with self.cond:
            if seq is None:
                seq = self.order + 1
            self.order = max(self.order, seq)
            unit = Unit(self.blocks_of(ranges), seq=seq, parent=parent)
            self.queue.append(unit)
            if name is not None:
                self.names[name] = unit
            self.cond.notify_all()
        return unit

    def named(self, name: str) -> Unit:
        """The unit registered under ``name``, once it is (a reader ahead of the registering thread waits)."""
        with self.cond:
            while name not in self.names:
                self._still_open()
                self.cond.wait(1.0)
            return self.names.pop(name)

    def fetch_now(self, ranges: Iterable[tuple[str, int, int]]) -> Unit:
        """Small ranges fetched at once, outside the budget and the order (an item's head and tail,
        read to locate it); waited for here. The caller releases the unit when done."""
        unit = Unit(self.blocks_of(ranges), counted=False)
        with self.cond:
            for name, first, n in _runs(self._take(unit)):
                self.pool.submit(self._get, name, first, n)
        self.wait(unit)
        return unit

    def wait(self, unit: Unit) -> None:
        """Until every block of ``unit`` is on local disk; a fetch's error is raised here."""
        with self.cond:
            while not (unit.admitted and all(blk in self.present for blk in unit.blocks)):
                self._still_open()
                self.cond.wait(1.0)

    def _still_open(self) -> None:
        """For a waiting reader (holding ``cond``): a fetch's error raised, or the window's closing."""
        if self.error is not None:
            raise self.error
        if self.closed:
            raise RuntimeError("the read window was closed while a reader waited")

    def release(self, unit: Unit) -> None:
        """``unit`` read: each block no other unit holds is punched out of its file. Idempotent."""
        with self.cond:
            if unit.released:
                return
            unit.released = True
            if not unit.admitted:  # never admitted (its job was cancelled): leave the queue
                try:
                    self.queue.remove(unit)
                except ValueError:
                    pass
                self.cond.notify_all()
                return
            if unit.counted:
                self.held[unit.seq] -= 1
                if not self.held[unit.seq]:
                    del self.held[unit.seq]
                if not unit.parent:
                    self.held_children[unit.seq] -= 1
                    if not self.held_children[unit.seq]:
                        del self.held_children[unit.seq]
            freed = []
            for blk in unit.blocks:
                self.refs[blk] -= 1
                if self.refs[blk] == 0:
                    del self.refs[blk]
                    if blk in self.present:
                        self.present.discard(blk)
                        freed.append(blk)
                    # a block still being fetched is freed when its GET ends (`_landed`)
            for name, b in freed:
                self._free(name, b)
            self.cond.notify_all()

    # -- the admission thread and the fetches ------------------------------------------------------
    def _admit(self) -> None:
        """Admit queued units, lowest ``seq`` first, as many as fit at once; their new blocks are fetched
        together, so neighbouring ranges of one object (consecutive items, of consecutive tensors) go
        by one GET."""
        with self.cond:
            while not self.closed:
                todo: list[tuple[str, int]] = []
                while self.queue and self.error is None:
                    unit = min(self.queue, key=lambda u: u.seq)  # the first registered among equals
                    new = sum(1 for blk in unit.blocks if blk not in self.refs)
                    before = (bool(self.held) and min(self.held) < unit.seq) or unit.seq in self.held_children
                    if before and new and self.used + new * BLOCK > self.budget:  # nothing new: no room needed
                        break  # room comes back as the readers before it end
                    self.queue.remove(unit)
                    todo += self._take(unit)
                    self.held[unit.seq] += 1
                    if not unit.parent:
                        self.held_children[unit.seq] += 1
                for name, first, n in _runs(todo):
                    self.pool.submit(self._get, name, first, n)
                self.cond.wait(1.0)

    def _take(self, unit: Unit) -> list[tuple[str, int]]:
        """Admit ``unit`` (the caller holds ``cond``): its blocks held; returns those to fetch (neither on
        disk nor on the way), which the caller fetches."""
        unit.admitted = True
        todo = []
        for blk in unit.blocks:
            if blk not in self.refs:
                self.refs[blk] = 0
                if blk not in self.fetching:  # else a GET still brings it: held again, not fetched twice
                    self.used += BLOCK
                    todo.append(blk)
            self.refs[blk] += 1
        self.peak = max(self.peak, self.used)
        self.fetching.update(todo)
        return todo

    def _get(self, name: str, first: int, n: int) -> None:
        size = self.rc.sizes[name]
        start, end = first * BLOCK, min((first + n) * BLOCK, size)
        try:
            if not self.closed and self.error is None:
                data = self.rc.read_range(name, start, end - start)
                fd = self._fd(name)
                done = 0
                while done < len(data):
                    done += os.pwrite(fd, memoryview(data)[done:], start + done)
                with self.cond:
                    self.fetched += len(data)
                    self.requests += 1
        except BaseException as exc:  # noqa: BLE001 - raised where a reader waits (`wait`)
            with self.cond:
                if self.error is None:
                    self.error = exc
                self.cond.notify_all()
            return
        with self.cond:
            self._landed(name, first, n)

    def _landed(self, name: str, first: int, n: int) -> None:
        for b in range(first, first + n):
            blk = (name, b)
            self.fetching.discard(blk)
            if blk in self.refs:
                self.present.add(blk)
            else:  # every unit holding it was released while it was fetched
                self._free(name, b)
        self.cond.notify_all()

    def _free(self, name: str, b: int) -> None:
        """Punch block ``b`` of ``name`` out of its file (the caller holds ``cond``)."""
        size = self.rc.sizes[name]
        start = b * BLOCK
        punch_hole(self.fds[name], start, min(BLOCK, size - start))
        self.used -= BLOCK
        self.punched += min(BLOCK, size - start)

    def stop(self) -> None:
        """No more waiting: every reader waiting (or to wait) raises, and nothing more is admitted. For a
        caller that is failing, so that threads waiting for units no one will register end."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def stats(self) -> dict[str, Any]:
        with self.cond:
            return {"budget_bytes": self.budget, "peak_bytes": self.peak, "fetched_bytes": self.fetched,
                    "requests": self.requests, "punched_bytes": self.punched, "block_bytes": BLOCK}

    def close(self) -> None:
        """Stop admitting and fetching, wait for the GETs under way, close and remove the local files."""
        self.stop()
        self.admitter.join()
        self.pool.shutdown(wait=True, cancel_futures=True)
        with self.cond:
            for fd in self.fds.values():
                os.close(fd)
            self.fds.clear()
        shutil.rmtree(self.folder, ignore_errors=True)


def _runs(blocks: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
    """Contiguous blocks of one object as ``(object, first, count)``, each at most `MAX_GET` bytes."""
    out: list[list[Any]] = []
    for name, b in sorted(blocks):
        last = out[-1] if out else None
        if last is not None and last[0] == name and last[1] + last[2] == b and (last[2] + 1) * BLOCK <= MAX_GET:
            last[2] += 1
        else:
            out.append([name, b, 1])
    return [(n, f, c) for n, f, c in out]
