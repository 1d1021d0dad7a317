"""A streaming worker's share of a source in a store: which items it reads, fetched how, held how long.

A worker of a distributed conversion from a store into a store (`reshard.engine.streaming`) splices its
target items from sparse local copies of only the source bytes it needs, fetched by a
`reshard.storage.objectstore.window.RangeWindow` within a share of ``--buffer-memory``. This module
decides what the copy (`reshard.engine.copy`) asks that window for, and when it lets go:

- a source item the worker needs all of, up to `WHOLE_ITEM` bytes, or any item up to `TINY_ITEM`, is
  fetched whole, head and tail with its rows, by one ranged GET, as part of its tensor's *unit*: the copy
  registers it when it reaches the tensor (`Shares.begin`), the locator waits for it, and it is released
  when the tensor's last job ends (`TensorHold`);
- any other item has its head and tail fetched to locate it (`locating`: a few KiB, outside the budget,
  released once located), then each job's rows (`source_ranges`) as a unit of its own, held while the
  job runs (`held`).

Every unit carries its tensor's place in the copy (the order the pool runs the jobs), and the window
admits the lowest first, letting one in over its budget only when nothing of a lower place is held: so
it cannot deadlock, though the copy registers the next tensors' whole items ahead (`Shares`, `AHEAD`).
Why whole items: a ranged GET is a request, and the request rate is what bounds a store like S3 at scale
(docs/benchmarks.md, issue 46); an item needed whole costs one request instead of three.
"""
from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np

from reshard.errors import ReshardError
from reshard.model.checkpoint import ChunkTable
from reshard.model.geometry import Box

__all__ = ["AHEAD", "ITEM_END", "TINY_ITEM", "WHOLE_ITEM", "Shares", "TensorHold", "held", "item_reads", "locating",
           "read_window", "recut", "shares_of", "source_ranges"]

#: An item the worker needs all of, up to this size, is fetched whole with its tensor (one GET).
WHOLE_ITEM = 16 << 20
#: An item this small is fetched whole even when the worker needs only part of it.
TINY_ITEM = 256 << 10
#: What `locating` fetches of each end of an item: its zip headers and pickle lie in the first bytes, its
#: central directory in the last (`reshard.storage.checkpoints.fastread.item_layout` reads nothing else).
ITEM_END = 4096

Item = tuple[str, int, int]  # (data file, offset, length) of a source item


#: At most this many tensors' whole items registered ahead of the copy (within the window's budget too).
AHEAD = 64


class Shares:
    """A streaming worker's source items by tensor key (``items``, in the copy's order), those fetched whole
    with their tensor (``whole``), and the `RangeWindow` that fetches them.

    Each tensor's place in the copy is its units' ``seq`` (`RangeWindow.need`). The whole items of the
    next tensors are registered ahead of the copy (`AHEAD` tensors, at most ``ahead`` bytes), so the
    window fetches them while earlier tensors are spliced, and merges neighbouring items into one GET."""

    def __init__(self, items: dict[str, list[Item]], whole: dict[str, list[Item]], window: Any, ahead: int):
        self.items, self.whole, self.window, self.ahead = items, whole, window, ahead
        self.order = list(items)
        self.seq = {k: i for i, k in enumerate(self.order)}
        self.units: dict[str, tuple[Any, int]] = {}  # registered ahead, not begun yet: the unit, its bytes
        self.pending = 0                             # their bytes
        self.next = 0                    # the next tensor to register

    def begin(self, key: str) -> "TensorHold":
        """The copy's thread reaches tensor ``key``: the whole items of it and of the next tensors registered
        (in the copy's order), its own held until the copy and every job of the tensor are done."""
        here = self.seq[key]
        while self.next < len(self.order):
            k = self.order[self.next]
            size = sum(n for _f, _o, n in self.whole.get(k, ()))
            if self.next > here and (self.next - here > AHEAD or self.pending + size > self.ahead):
                break
            if size:
                self.units[k] = (self.window.need(self.whole[k], name=k, seq=self.seq[k], parent=True), size)
                self.pending += size
            self.next += 1
        unit, size = self.units.pop(key, (None, 0))
        self.pending -= size
        return TensorHold(key, here, self.window, unit)

    def partial(self, key: str, ranges: list[Item]) -> list[Item]:
        """``ranges`` less those inside items of ``key`` fetched whole (held by the tensor's unit already)."""
        whole = self.whole.get(key) or ()
        return [(f, o, n) for f, o, n in ranges
                if not any(f == wf and wo <= o and o + n <= wo + wn for wf, wo, wn in whole)]


class TensorHold:
    """A tensor's unit held until the copy has made every job of the tensor and each has ended: one
    reference for the copy's thread (`done`) and one per job (`take`, dropped by `held`)."""

    def __init__(self, key: str, seq: int, window: Any, unit: Any):
        self.key, self.seq, self.window, self.unit, self.count = key, seq, window, unit, 1
        self.lock = threading.Lock()

    def take(self) -> None:
        with self.lock:
            self.count += 1

    def drop(self) -> None:
        with self.lock:
            self.count -= 1
            last = self.count == 0
        if last and self.unit is not None:
            self.window.release(self.unit)

    def done(self) -> None:
        """The copy's thread has made every job of the tensor."""
        self.drop()


@contextlib.contextmanager
def read_window(rc: Any, items: dict[str, list[Item]], whole: dict[str, list[Item]], folder: Path, budget: int,
                streams: int) -> Iterator[Shares]:
    """The window open while the block runs, closed after it, its stats kept in the source's counters."""
    from reshard.storage.objectstore.window import RangeWindow

    window = RangeWindow(rc, folder, budget, streams=streams)
    try:
        window.prepare(sorted({f for its in items.values() for f, _o, _n in its}))
        yield Shares(items, whole, window, ahead=budget)
    finally:
        window.close()
        with rc.counters.lock:
            rc.counters.windows.append(window.stats())


@contextlib.contextmanager
def locating(shares: Shares, key: str) -> Iterator[None]:
    """While the items of tensor ``key`` are located from the window's files: its whole items waited for
    (registered by the copy's thread, `Shares.begin`), the head and tail of each other item fetched at
    once (outside the budget: a few KiB each) and released once located."""
    window = shares.window
    whole = shares.whole.get(key) or []
    if whole:
        window.wait(window.named(key))
    taken = set(whole)
    ends = []
    for f, o, n in shares.items[key]:
        if (f, o, n) not in taken:
            ends.append((f, o, min(n, ITEM_END)))
            ends.append((f, o + max(0, n - ITEM_END), min(n, ITEM_END)))
    unit = window.fetch_now(ends) if ends else None
    try:
        yield
    finally:
        if unit is not None:
            window.release(unit)


def recut(e: Any, t: Any) -> bool:
    """Whether the copy writes tensor entry ``e`` by splicing its source items' bytes (its plan ``t`` neither
    transforms, casts nor copies it from another key: those are written by `write_transformed`)."""
    return not (t.transform or t.copy_from or t.dtype != e.dtype_name)


def item_reads(e: Any, t: Any, mine: Callable[[Any], bool]) -> Iterator[tuple[Item, int, int]]:
    """For each target chunk of the re-cut tensor ``e`` (planned as ``t``) whose rank is ``mine``, the
    source items it reads, in order: ``(item, elements of it the chunk takes, elements of the item's
    chunk)``. One array comparison per target chunk, not a Box per pair."""
    if not e.shape:  # a 0-d tensor: its one item per target chunk
        for rank, _offsets, _sizes in t.chunks:
            if mine(rank):
                for c in e.chunks:
                    if not c.box.offsets and c.location is not None:
                        yield (c.location.file, c.location.offset, c.location.length), 1, 1
        return
    tab = ChunkTable.of(e.chunks, len(e.shape))
    lo, hi = tab.offsets, tab.offsets + tab.sizes
    for rank, offsets, sizes in t.chunks:
        if not mine(rank):
            continue
        o = np.asarray(offsets, dtype=np.int64)
        end = o + np.asarray(sizes, dtype=np.int64)
        hit = np.all((lo < end) & (hi > o), axis=1) & (tab.file >= 0)
        vol = np.clip(np.minimum(hi, end) - np.maximum(lo, o), 0, None).prod(axis=1)
        for i in np.flatnonzero(hit):
            yield (tab.files[tab.file[i]], int(tab.start[i]), int(tab.length[i])), int(vol[i]), int(tab.sizes[i].prod())


def shares_of(ix: Any, planned: dict, actions: dict, owns: Callable[[int], bool],
              cap: int) -> tuple[dict[str, list[Item]], dict[str, list[Item]]]:
    """The source items a worker that ``owns`` these target ranks reads, by tensor key (the tensors the
    copy splices: not left out, not rewritten, `recut`), and of those the items it fetches whole
    (`WHOLE_ITEM`, `TINY_ITEM`), at most ``cap`` bytes of them per tensor (a tensor's unit stays within
    the window's budget): an item is needed whole when the worker's target chunks together take every
    element of its chunk."""
    items: dict[str, list[Item]] = {}
    whole: dict[str, list[Item]] = {}
    for key, e in ix.entries.items():
        a = actions[key]
        if a.left_out or a.new_value or not e.is_tensor or not recut(e, planned[key]):
            continue
        taken: dict[Item, int] = {}
        numel: dict[Item, int] = {}
        for it, vol, n in item_reads(e, planned[key], lambda rank: owns(int(rank or 0))):
            if vol:
                taken[it] = taken.get(it, 0) + vol
                numel[it] = n
        if taken:
            items[key] = list(taken)
            w, room = [], cap
            for it in taken:
                if (it[2] <= TINY_ITEM or (it[2] <= WHOLE_ITEM and taken[it] >= numel[it])) and it[2] <= room:
                    w.append(it)
                    room -= it[2]
            if w:
                whole[key] = w
    return items, whole


def source_ranges(sources: list, box: Box, itemsize: int) -> list[Item]:
    """The bytes a splice job reads: for each source chunk that intersects ``box``, the span of its
    row-major storage from the intersection's first element to its last, as ``(file name, offset, length)``."""
    out = []
    for s in sources:
        x = s.box.intersect(box)
        if x is None or x.is_empty():
            continue
        rel = x.relative_to(s.box)
        first = int(np.ravel_multi_index(rel.offsets, s.box.sizes))
        last = int(np.ravel_multi_index(tuple(e - 1 for e in rel.ends), s.box.sizes))
        out.append((Path(s.path).name, s.storage_at + first * itemsize, (last - first + 1) * itemsize))
    return out


def held(shares: Shares, hold: TensorHold, ranges: list[Item], work: Callable[..., Any]) -> Callable[..., Any]:
    """``work`` (a pool job) run once its source rows are on local disk: those not held by its tensor's
    unit registered now as a unit of its own (the copy's thread calls this, in job order), released when
    the job ends (even on error), and the tensor's hold dropped."""
    window = shares.window
    rest = shares.partial(hold.key, ranges) if ranges else []
    unit: Optional[Any] = window.need(rest, seq=hold.seq) if rest else None
    hold.take()

    def run(buffers, files, slab):
        try:
            if unit is not None:
                window.wait(unit)
            if hold.unit is not None:
                window.wait(hold.unit)
            return work(buffers, files, slab)
        except ReshardError as exc:  # a corrupt source item: named by its object in the store, not the local copy
            root = str(window.root) + os.sep
            if isinstance(exc.where, str) and exc.where.startswith(root):
                exc.where = window.rc.where(exc.where[len(root):])
            raise
        finally:
            if unit is not None:
                window.release(unit)
            hold.drop()

    return run

