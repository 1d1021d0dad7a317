"""Bitwise tensor comparison straight from two DCP checkpoints' data files (`reshard verify`'s fast path).

`reshard verify` compares, for every tensor key, the values of A and B in global
coordinates. Decoding every chunk with ``torch.load`` and comparing with torch ops costs
several times a plain copy of the checkpoint; this module compares the *stored bytes*
instead, which for a bitwise comparison is the same question (verify compares bit for bit:
NaN payloads must match, ``-0.0 != 0.0``).

`compare_tensors(ia, ib, keys)` takes keys whose entries have the same shape and dtype on
both sides, both sides being `reshard.storage.checkpoints.index.CheckpointIndex`. A key is compared here when
every chunk of it, on both sides, is a plain ``torch.save`` archive without storage
transforms whose layout `reshard.storage.checkpoints.fastread.item_layout` parses (torch's weights-only
unpickler over a meta storage: nothing from the file is executed) as a C-contiguous tensor
of the chunk's shape and the key's dtype, its elements inside the item's byte range.

The work is cut along B's chunks, so the result does not depend on either chunking: every
chunk of B is cut (`split_box`) into row-major pieces of at most ``slab_bytes``, each one
contiguous byte run in B, read with ``os.preadv`` into a reusable per-thread buffer; each
piece is compared with every chunk of A it intersects (``Box.intersect``):

* when the intersection is one contiguous run in both the piece and A's chunk
  (`contiguous_run`), A's run is read with ``os.preadv`` into a second buffer and the two
  byte ranges are compared as integers (numpy, memcmp speed, the GIL released);
* otherwise the intersection is compared as two numpy views, B's buffer shaped as the
  piece and A's bytes (read into the second buffer when contiguous there, else the rows of
  A's chunk the box spans, read as one run into a third buffer and sliced), as unsigned
  integers of the element size (or bytes with a trailing dimension), so the comparison is
  bitwise too.

With ``hash_b`` (B's manifest records item checksums), a chunk of B whose item checksum is
wanted is one task that reads its whole item in order (header, pieces, trailer) and hashes
it while comparing, so B's bytes are read once for both jobs (`CompareResult.digests`);
otherwise each piece is a task. Tasks run in a small thread pool (``workers``, default
4-8) with a bounded window in flight, so memory stays at about ``workers x (2 x slab_bytes
+ STAGE_BYTES)``, whatever the checkpoint's size. Pieces of ``DIRECT_FROM`` bytes or more
are read with direct I/O (``direct=True``, `reshard.storage.files.fileio`): a verify reads each byte
once, and on a cold checkpoint the page cache would only add CPU. The layouts of large
keys' items are parsed on a second small pool a bounded number of items ahead, after
asking the kernel to read their heads and zip directories (``posix_fadvise WILLNEED``; the
whole items, at most ``PREFETCH_BYTES`` ahead, when reading through the page cache), so the
small reads do not wait for the disk one by one. Small keys (at most
``SMALL_KEY_BYTES``; their cost is Python, not bytes) are compared whole, one after the
other, by the calling thread, between hand-offs to the pool. Each key gets a `KeyVerdict`:

* ``"equal"``: every piece compared equal (and A's chunks are covered by B's);
* ``"different"``: some piece differs: the caller decodes that key the slow way, so the
  reported difference (first differing global index, count, values) is exactly the slow
  path's;
* ``"fallback"``: the fast path does not apply (``reason`` says why: a transform, an
  unusual item, a read error, ...): the caller uses the slow path, which also reports any
  error in its own words.

``progress.update(nbytes)`` is called (from the calling thread) once per chunk of A whose
parts all compared equal, with that chunk's logical bytes (empty chunks at once, with none),
so a key's ticks add up to `Entry.nbytes`; `KeyVerdict.ticked` says how many bytes a key
already got, so a caller that falls back can skip that many.

**Every byte read is checked against its writer's record.** Each piece of B and each run
of A read for a comparison is checksummed where it lies in the buffer (``fileio.crc32``,
about memory speed, no second read) and fed to a `reshard.storage.checkpoints.crcledger.CrcLedger` under
its item's storage record (the CRC-32 in the item's zip central directory); once the
pieces of a storage tile it, their combined CRC-32 must equal the record. A storage whose
bytes contradict it is `CorruptItem` (bad input, exit 2, naming the file and the key),
raised by `compare_tensors` whatever the verdicts: a corrupt item is not a difference.
After the comparison, a storage read only in part (its view is smaller than its storage,
or rows of it were read by no piece) is completed by one read of what is missing, when its
key compared equal here; one of a key that differed or fell back is left to the decoding
path, which checks it (`reshard.storage.checkpoints.dcp.load_item`); one another worker of a distributed
run reads the rest of (``b_files``) is reported as not checked. `CompareResult.crc` counts
each kind, and storages without a record (written without CRCs) as ``unrecorded``.

`COUNTERS` counts keys and parts per path (``keys_equal``, ``keys_different``,
``keys_fallback``, ``parts_contiguous`` (buffer against buffer), ``parts_strided``
(shaped views), ``bytes``), for tests and benchmarks.
"""
from __future__ import annotations

import itertools
import os
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from reshard.model.geometry import Box, contiguous_run
from reshard.storage.files.integrity import new_hasher
from reshard.storage.checkpoints.crcledger import CorruptItem, CrcLedger, StorageRecord
from reshard.storage.checkpoints.fastread import item_layout
from reshard.storage.files.fileio import FdCache, ThreadBuffers, read_at, read_exact, crc32

__all__ = [
    "COUNTERS",
    "SLAB_BYTES",
    "CompareResult",
    "KeyVerdict",
    "compare_tensors",
    "contiguous_run",
    "counters",
    "reset_counters",
    "split_box",
]

SLAB_BYTES = 16 << 20
LAYOUT_WORKERS = 4      # threads parsing item layouts (latency-bound when the cache is cold)
LAYOUT_AHEAD = 64       # items whose layouts may be parsed ahead of the comparison
PREFETCH_BYTES = 256 << 20   # item bytes the kernel may be asked to read ahead of the comparison
SMALL_KEY_BYTES = 1 << 20   # a key of at most this many bytes and SMALL_KEY_CHUNKS chunks (both sides)
SMALL_KEY_CHUNKS = 64       # is "small": compared whole by the calling thread, SMALL_BATCH_KEYS at a time
SMALL_BATCH_KEYS = 256
_SMALL = object()
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

COUNTERS: Counter = Counter()
_COUNTER_LOCK = threading.Lock()


def counters() -> dict[str, int]:
    """A copy of `COUNTERS` (cumulative over the process)."""
    with _COUNTER_LOCK:
        return dict(COUNTERS)


def reset_counters() -> None:
    with _COUNTER_LOCK:
        COUNTERS.clear()


def _count(**kw: int) -> None:
    with _COUNTER_LOCK:
        COUNTERS.update(kw)


@dataclass
class KeyVerdict:
    """The fast path's answer for one key (see the module docstring)."""

    key: str
    status: str                 # "equal" | "different" | "fallback"
    reason: str | None = None   # why "fallback"
    elements: int = 0           # A's elements compared (non-empty chunks), when "equal"
    nbytes: int = 0             # their logical bytes
    ticked: int = 0             # progress bytes already given for this key (A's chunks done)


# ------------------------------------------------------------------------------ geometry
def split_box(box: Box, itemsize: int, limit: int) -> Iterator[Box]:
    """Cut ``box`` into row-major pieces of at most ``limit`` bytes (at least one element each).

    The split dim ``d`` is the outermost one whose inner block (dims after it) fits in
    ``limit``; dims before it are taken one index at a time, dim ``d`` in steps. A piece of
    a contiguous run is therefore a contiguous run too.
    """
    sizes = box.sizes
    n = len(sizes)
    if n == 0 or box.numel * itemsize <= limit:
        yield box
        return
    inner = itemsize
    d = n - 1
    while d > 0 and inner * sizes[d] <= limit:
        inner *= sizes[d]
        d -= 1
    step = max(1, limit // inner)
    for lead in itertools.product(*(range(s) for s in sizes[:d])):
        for start in range(0, sizes[d], step):
            m = min(step, sizes[d] - start)
            offs = tuple(box.offsets[i] + lead[i] for i in range(d)) + (box.offsets[d] + start,) + box.offsets[d + 1:]
            yield Box(offs, (1,) * d + (m,) + sizes[d + 1:])


# ------------------------------------------------------------------------------ planning
@dataclass(frozen=True)
class _Side:
    """One chunk's item: ``base`` is the absolute file offset of its element [0, ..., 0]."""

    root: Path
    file: str
    base: int
    box: Box
    item_offset: int
    item_length: int
    rec: StorageRecord | None = None  # the item's storage and its recorded CRC-32
    elem: int = 0                     # offset of element [0, ..., 0] within the storage

    @property
    def path(self) -> Path:
        return self.root / self.file

    def feed(self, ledger: CrcLedger, elem_byte: int, data: Any) -> None:
        """The CRC-32 of ``data``, the chunk's element bytes from ``elem_byte``, to ``ledger``."""
        if self.rec is not None:
            ledger.add(self.rec, self.elem + elem_byte, len(data), crc32(data))


@dataclass(frozen=True)
class _Part:
    """The intersection of a piece of B with one chunk of A."""

    a_chunk: int
    box: Box                    # global coordinates
    a: _Side
    run_a: int | None           # flat element start in A's chunk when contiguous there, else None
    run_p: int | None           # flat element start within the piece when contiguous there, else None


@dataclass(frozen=True)
class _Piece:
    """A row-major run of at most one slab of a chunk of B (contiguous in B by construction)."""

    box: Box
    run_b: int                  # flat element start in B's chunk
    parts: tuple[_Part, ...]


@dataclass(frozen=True)
class _Task:
    """Consecutive pieces of one chunk of B; ``hashed``: all of its item, header to trailer, in order."""

    b: _Side
    pieces: tuple[_Piece, ...]
    hashed: bool
    a_parts: tuple[tuple[int, int], ...]   # (A chunk, number of parts) covered by this task


@dataclass
class _KeyState:
    verdict: KeyVerdict
    itemsize: int
    remaining: dict[int, int] = field(default_factory=dict)   # A chunk -> parts not yet compared
    stop: bool = False          # a part differed or failed: skip the rest


class _NotFast(Exception):
    """Internal: this key does not qualify for the fast path (message: why)."""


def _layout_job(ix: Any, chunk: Any) -> Any:
    """What `_side` needs from the file: the chunk's ItemLayout (None: unusual; raises _NotFast)."""
    loc = chunk.location
    if loc is None:
        raise _NotFast("a chunk has no storage location")
    if loc.transforms:
        raise _NotFast(f"storage transforms {list(loc.transforms)}")
    return item_layout(Path(ix.root) / loc.file, int(loc.offset), int(loc.length))


def _side(ix: Any, chunk: Any, dtype: Any, lay: Any, key: str | None = None) -> _Side:
    loc = chunk.location
    root = Path(ix.root)
    if lay is None:
        raise _NotFast(f"item {loc.file}:{loc.offset} is not a plain torch.save tensor")
    if lay.dtype != dtype or tuple(lay.shape) != tuple(chunk.box.sizes) or not lay.contiguous:
        raise _NotFast(f"item {loc.file}:{loc.offset} holds {lay.dtype} {list(lay.shape)} (stride {list(lay.stride)}), "
                       f"metadata says {dtype} {list(chunk.box.sizes)}")
    start = lay.storage_offset * lay.dtype.itemsize
    if lay.storage_offset < 0 or start + lay.nbytes > lay.storage_nbytes:
        raise _NotFast(f"item {loc.file}:{loc.offset} views outside its storage")
    base = lay.storage_file_offset + start
    if base < loc.offset or base + lay.nbytes > loc.offset + loc.length:
        raise _NotFast(f"item {loc.file}:{loc.offset}: elements outside the item's byte range")
    rec = StorageRecord(str(root / loc.file), key, lay.storage_file_offset, lay.storage_nbytes, lay.storage_crc)
    return _Side(root, loc.file, base, chunk.box, int(loc.offset), int(loc.length), rec, start)


def _check_key(ea: Any, eb: Any) -> int:
    """The element size of a key the fast path may compare (else _NotFast)."""
    if not (ea.is_tensor and eb.is_tensor) or ea.shape != eb.shape or ea.dtype != eb.dtype:
        raise _NotFast("not two tensors of the same shape and dtype")
    itemsize = int(ea.dtype.itemsize)
    if itemsize <= 0:
        raise _NotFast(f"dtype {ea.dtype} has no whole-byte element size")
    return itemsize


def _plan(ia: Any, ib: Any, key: str, slab: int, hash_names: Any, layout: Callable[[str, int], Any],
          b_files: Any = None) -> tuple[_KeyState, list[_Task]]:
    """The tasks comparing ``key`` (``layout(side, chunk index)``: that chunk's `_layout_job`).

    ``hash_names``: item names of B whose checksum is wanted (their chunk becomes one task
    that reads the whole item in order); other chunks of B are one task per piece.
    ``b_files``: only B's chunks stored in these files (the verdict's elements are theirs).
    """
    ea, eb = ia.entries[key], ib.entries[key]
    itemsize = _check_key(ea, eb)
    state = _KeyState(KeyVerdict(key, "equal"), itemsize)
    a_boxes = [(i, c) for i, c in enumerate(ea.chunks) if not c.box.is_empty()]
    a_sides: dict[int, _Side] = {}
    covered: dict[int, int] = {}
    tasks: list[_Task] = []
    for j, cb in enumerate(eb.chunks):
        if cb.box.is_empty() or (b_files is not None and (cb.location is None or cb.location.file not in b_files)):
            continue
        sb = _side(ib, cb, eb.dtype, layout("b", j), key)
        hits = []
        for i, ca in a_boxes:
            if ca.box.intersect(cb.box) is not None:
                if i not in a_sides:
                    a_sides[i] = _side(ia, ca, ea.dtype, layout("a", i), key)
                hits.append((i, ca))
        pieces = []
        for piece in split_box(cb.box, itemsize, slab):
            parts = []
            for i, ca in hits:
                inter = ca.box.intersect(piece)
                if inter is None:
                    continue
                parts.append(_Part(i, inter, a_sides[i], contiguous_run(inter.relative_to(ca.box), ca.box.sizes),
                                   contiguous_run(inter.relative_to(piece), piece.sizes)))
                covered[i] = covered.get(i, 0) + inter.numel
            run_b = contiguous_run(piece.relative_to(cb.box), cb.box.sizes)
            if run_b is None:  # pragma: no cover - split_box keeps pieces of a chunk contiguous
                raise _NotFast("a piece of a chunk of B is not contiguous")
            pieces.append(_Piece(piece, run_b, tuple(parts)))
        b_covered = sum(part.box.numel for p in pieces for part in p.parts)
        if b_covered != cb.box.numel:
            raise _NotFast(f"A's chunks cover {b_covered} of {cb.box.numel} elements of a chunk of B")
        if b_files is not None:
            state.verdict.elements += cb.box.numel
            state.verdict.nbytes += cb.box.numel * itemsize
        name = f"{cb.location.file}:{int(cb.location.offset)}"
        groups = [pieces] if name in hash_names else [[p] for p in pieces]
        for g in groups:
            counts: dict[int, int] = {}
            for p in g:
                for part in p.parts:
                    counts[part.a_chunk] = counts.get(part.a_chunk, 0) + 1
            tasks.append(_Task(sb, tuple(g), len(groups) == 1 and name in hash_names, tuple(counts.items())))
            for i, n in counts.items():
                state.remaining[i] = state.remaining.get(i, 0) + n
    if b_files is None:
        for i, ca in a_boxes:
            if covered.get(i, 0) != ca.box.numel:
                raise _NotFast(f"B's chunks cover {covered.get(i, 0)} of {ca.box.numel} elements of a chunk of A")
            state.verdict.elements += ca.box.numel
            state.verdict.nbytes += ca.box.numel * itemsize
    return state, tasks


# ------------------------------------------------------------------------------ reading
class _Files(FdCache):
    """Open data files (one fd each, shared) and per-thread buffers."""

    def __init__(self, slab: int, direct: bool = False):
        super().__init__()
        self.slab = slab
        self.direct_io = direct
        self.bufs = ThreadBuffers()
        self.ledger = CrcLedger(collect=True)  # every storage byte read, against its writer's record

    def stage(self, n: int) -> memoryview:
        """``n`` bytes of the calling thread's stage for unaligned direct reads."""
        return self.bufs.take("stage", n)

    def aux(self, n: int) -> np.ndarray:
        """``n`` bytes of the calling thread's third buffer (A's rows for strided boxes)."""
        return np.frombuffer(self.bufs.take("aux", max(n, 1)), dtype=np.uint8)[:n]

    def buffers(self) -> tuple[np.ndarray, np.ndarray]:
        """The calling thread's two slab buffers (B's bytes, A's bytes), page-aligned, so
        aligned direct reads land in them without a copy."""
        return tuple(np.frombuffer(self.bufs.take(name, self.slab), dtype=np.uint8) for name in ("b", "a"))


def _hash_range(fd: int, buf: np.ndarray, pos: int, n: int, h: Any) -> None:
    while n > 0:
        m = min(n, len(buf))
        x = buf[:m]
        read_exact(fd, x, pos)
        h.update(x)
        pos += m
        n -= m


def _equal_bytes(x: np.ndarray, y: np.ndarray) -> bool:
    if x.size % 8 == 0:
        return bool(np.array_equal(x.view(np.uint64), y.view(np.uint64)))
    return bool(np.array_equal(x, y))


def _shaped(buf: np.ndarray, sizes: tuple[int, ...], itemsize: int) -> np.ndarray:
    """A C-contiguous uint8 buffer as integers of the element size (bitwise-comparable), shaped ``sizes``."""
    if itemsize in _UINT:
        return buf.view(_UINT[itemsize]).reshape(sizes)
    return buf.reshape(sizes + (itemsize,))


def _strided_view(files: _Files, side: _Side, rel: Box, itemsize: int) -> np.ndarray:
    """The box ``rel`` of a chunk, from the chunk's rows it spans read as one run into a buffer.

    Plain reads rather than an mmap: mapped file pages would count as this process's memory
    (a verify of a TP checkpoint would look like it holds the checkpoint)."""
    sizes = side.box.sizes
    row = itemsize
    for s in sizes[1:]:
        row *= s
    first, count = rel.offsets[0], rel.sizes[0]
    buf = files.aux(count * row)
    read_exact(files.fd(side.path), buf, side.base + first * row)
    side.feed(files.ledger, first * row, buf)
    arr = _shaped(buf, (count,) + tuple(sizes[1:]), itemsize)
    return arr[(slice(0, count),) + rel.slices()[1:]]


_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None)


def _willneed(files: _Files, path: Path, pos: int, n: int) -> None:
    if _WILLNEED is None or n <= 0:
        return
    try:
        os.posix_fadvise(files.fd(path), pos, n, _WILLNEED)
    except OSError:  # a hint only (e.g. a missing file: the reader reports it)
        pass


DIRECT_FROM = 1 << 20  # pieces this large are read with direct I/O (when the files allow)


def _bytes_at(files: _Files, path: Path, buf: np.ndarray, pos: int, n: int) -> np.ndarray:
    """``n`` bytes of ``path`` at ``pos``, read into the start of ``buf``.

    Large pieces bypass the page cache (`reshard.storage.files.fileio`): a verify reads each byte once,
    and on a cold checkpoint that costs the disk time and almost no CPU.
    """
    x = buf[:n]
    read_at(files, path, memoryview(x), pos, files.stage, direct=files.direct_io and n >= DIRECT_FROM)
    return x


def _run_task(files: _Files, state: _KeyState, task: _Task, algorithm: str | None) -> tuple[bool, str | None, int, int]:
    """Compare a task's pieces (and hash its item): ``(equal, digest or None, contiguous parts, strided parts)``.

    Returns ``equal=True`` without work (and no digest) once the key has stopped.
    """
    itemsize = state.itemsize
    b = task.b
    fb = files.fd(b.path)
    bbuf, abuf = files.buffers()
    h = new_hasher(algorithm) if task.hashed and algorithm else None
    if h is not None:
        _hash_range(fb, bbuf, b.item_offset, b.base - b.item_offset, h)
    fast = slow = 0
    for piece in task.pieces:
        if state.stop:
            return True, None, fast, slow
        nb = piece.box.numel * itemsize
        xb = _bytes_at(files, b.path, bbuf, b.base + piece.run_b * itemsize, nb)
        b.feed(files.ledger, piece.run_b * itemsize, xb)
        if h is not None:
            h.update(xb)
        vb = None
        for part in piece.parts:
            if part.run_a is not None:
                na = part.box.numel * itemsize
                xa = _bytes_at(files, part.a.path, abuf, part.a.base + part.run_a * itemsize, na)
                part.a.feed(files.ledger, part.run_a * itemsize, xa)
                if part.run_p is not None:
                    same = _equal_bytes(xa, xb[part.run_p * itemsize:part.run_p * itemsize + na])
                    fast += 1
                else:
                    vb = _shaped(xb, piece.box.sizes, itemsize) if vb is None else vb
                    same = bool(np.array_equal(vb[part.box.relative_to(piece.box).slices()],
                                               _shaped(xa, part.box.sizes, itemsize)))
                    slow += 1
            else:
                vb = _shaped(xb, piece.box.sizes, itemsize) if vb is None else vb
                va = _strided_view(files, part.a, part.box.relative_to(part.a.box), itemsize)
                same = bool(np.array_equal(vb[part.box.relative_to(piece.box).slices()], va))
                del va
                slow += 1
            if not same:
                return False, None, fast, slow
    if h is None:
        return True, None, fast, slow
    end = b.base + b.box.numel * itemsize
    _hash_range(fb, bbuf, end, b.item_offset + b.item_length - end, h)
    return True, h.hexdigest(), fast, slow


def _run_small_keys(files: _Files, ia: Any, ib: Any, keys: list[str], slab: int, names: set[str],
                    algorithm: str | None, b_files: Any = None) -> list[tuple[KeyVerdict, dict[str, str], int, int, int]]:
    """Small keys, one after the other in the calling thread (layouts, plan, comparison):
    ``(verdict, digests, contiguous parts, strided parts, bytes)`` per key, so a checkpoint
    of many small tensors pays no thread hand-off per key."""
    out = []
    for key in keys:
        ea, eb = ia.entries[key], ib.entries[key]
        digests: dict[str, str] = {}
        fast = slow = 0
        def layout(side: str, i: int, ea: Any = ea, eb: Any = eb) -> Any:
            return _layout_job(ia, ea.chunks[i]) if side == "a" else _layout_job(ib, eb.chunks[i])

        try:
            state, tasks = _plan(ia, ib, key, slab, names, layout, b_files)
            for task in tasks:
                same, dig, f, sl = _run_task(files, state, task, algorithm)
                fast, slow = fast + f, slow + sl
                if dig is not None:
                    digests[f"{task.b.file}:{task.b.item_offset}"] = dig
                if not same:
                    state.verdict.status = "different"
                    break
            v = state.verdict
        except _NotFast as exc:
            v = KeyVerdict(key, "fallback", str(exc))
        except CorruptItem:
            raise  # bad input, not a difference
        except Exception as exc:  # noqa: BLE001 - the slow path reports it in its own words
            v = KeyVerdict(key, "fallback", _error_reason(exc))
        out.append((v, digests, fast, slow, v.nbytes if v.status == "equal" else 0))
    return out


# ------------------------------------------------------------------------------ driver
def _default_workers() -> int:
    return max(4, min(8, os.cpu_count() or 4))  # direct reads mostly wait on the disk: keep it busy


@dataclass
class CompareResult:
    """`compare_tensors`' answer: a verdict per key, and the checksums of B's items it read whole."""

    verdicts: dict[str, KeyVerdict]
    digests: dict[str, str]      # "file:offset" of B -> checksum (``hash_b``'s algorithm)
    # item storages by how their writer's CRC-32 was checked: "checked" (by the pieces read),
    # "checked_by_extra_read" (the rest read once), "unrecorded" (no record), "left_to_decoding"
    # (their key differed or fell back: the decoding path checks them), "not_checked" (read in
    # part: another worker of a distributed run read the rest)
    crc: dict[str, int] = field(default_factory=dict)


def compare_tensors(ia: Any, ib: Any, keys: Sequence[str], *, progress: Any = None, workers: int | None = None,
                    slab_bytes: int = SLAB_BYTES, hash_b: str | None = None,
                    hash_names: Any = (), prefetch: bool = True, b_files: Any = None,
                    direct: bool = True) -> CompareResult:
    """Compare the stored bytes of ``keys`` (tensors of the same shape and dtype on both
    sides) of two `CheckpointIndex` es; a `KeyVerdict` per key (see the module docstring).

    ``hash_b`` (an algorithm of `reshard.storage.files.integrity`) with ``hash_names`` (item names
    ``"file:offset"`` of B): each such item whose chunk takes part is read whole, in order,
    by one task that hashes it while comparing, so B's bytes are read once for both; its
    checksum lands in ``CompareResult.digests`` (items of keys that stopped early do not:
    hash those separately).

    ``b_files`` (a set of B's data file names): compare only B's chunks stored there (a
    distributed worker's part); a verdict's ``elements``/``nbytes`` are then those chunks'.

    ``prefetch``: ask the kernel (``posix_fadvise WILLNEED``) to read the items of the
    next keys whole (at most ``PREFETCH_BYTES`` ahead), so reading overlaps comparing and
    the layout parse's small reads do not wait for the disk one by one.

    ``direct``: read large pieces with direct I/O (``O_DIRECT``), bypassing the page cache.

    Never raises for a key's data: any error makes that key a ``"fallback"`` (its reason
    names it) so the caller's slow path reports it as it always did.
    """
    slab = max(64, int(slab_bytes))  # at least one element of any dtype
    nw = max(1, int(workers or _default_workers()))
    run = _Run(ia, ib, _Files(slab, direct), slab, set(hash_names) if hash_b else set(), hash_b, b_files,
               progress, prefetch, direct, limit=2 * nw)
    try:
        _compare_keys(run, keys, nw)
        crc = _settle_crcs(run.files, run.verdicts, b_files)
    finally:
        run.files.close()
    _count_verdicts(run.verdicts)
    return CompareResult(run.verdicts, run.digests, crc)


@dataclass
class _Run:
    """One `compare_tensors` call: its inputs and open files, what it has found so far (a
    verdict per key, B's item checksums) and the tasks in flight. One object, so the
    functions that plan, run and settle the comparison share it without closures."""

    ia: Any
    ib: Any
    files: _Files
    slab: int
    names: set[str]             # B's items whose checksum is wanted (``hash_names``, with ``hash_b``)
    hash_b: str | None
    b_files: Any
    progress: Any
    prefetch: bool
    direct: bool
    limit: int                  # tasks in flight at most, so memory stays bounded
    verdicts: dict[str, KeyVerdict] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)
    window: deque[tuple[_KeyState, _Task, Any]] = field(default_factory=deque)

    def tick(self, verdict: KeyVerdict, chunks: Sequence[int]) -> None:
        """Chunks ``chunks`` (indices) of A of ``verdict``'s key are done: progress by their
        bytes, and the verdict remembers them (a caller that falls back skips that many)."""
        e = self.ia.entries[verdict.key]
        n = sum(e.chunks[i].box.numel for i in chunks) * e.dtype.itemsize
        verdict.ticked += n
        if self.progress is not None and n:
            self.progress.update(n)


@dataclass
class _SmallBatch:
    """Small keys waiting for the calling thread, which compares them a batch at a time."""

    keys: list[str] = field(default_factory=list)
    nbytes: int = 0


def _compare_keys(run: _Run, keys: Sequence[str], nw: int) -> None:
    """Every key in order: small ones by this thread in batches, large ones as tasks on a pool
    of ``nw`` threads with a bounded window in flight; their layouts parsed ahead on a second pool."""
    with ThreadPoolExecutor(max_workers=nw, thread_name_prefix="reshard-compare") as pool, \
            ThreadPoolExecutor(max_workers=LAYOUT_WORKERS, thread_name_prefix="reshard-layout") as lpool:
        batch = _SmallBatch()
        try:
            for key, layouts in _layouts_ahead(run, keys, lpool):
                if layouts is _SMALL:
                    _add_small(run, batch, key)
                else:
                    _compare_large_key(run, pool, key, layouts)
            _flush_small(run, batch)
            _drain(run)
        finally:
            for _, _, fut in run.window:
                fut.cancel()


# ------------------------------------------------------------------------------ layouts ahead
def _layouts_ahead(run: _Run, keys: Sequence[str], lpool: ThreadPoolExecutor) -> Iterator[tuple[str, Any]]:
    """(key, its `_key_layouts`) in key order, started a bounded number of items (and bytes)
    ahead of the comparison, so the parse's small reads overlap it."""
    ahead: deque[tuple[str, Any, int, int]] = deque()
    items = nbytes = 0
    for key in keys:
        layouts, m, b = _key_layouts(run, key, lpool)
        ahead.append((key, layouts, m, b))
        items += m
        nbytes += b
        while len(ahead) > 1 and (items > LAYOUT_AHEAD or nbytes > PREFETCH_BYTES):
            k, f, m, b = ahead.popleft()
            items -= m
            nbytes -= b
            yield k, f
    while ahead:
        k, f, _, _ = ahead.popleft()
        yield k, f


def _key_layouts(run: _Run, key: str, lpool: ThreadPoolExecutor) -> tuple[Any, int, int]:
    """What comparing ``key`` needs from its items, started: ``(layouts, items, bytes)``.

    ``layouts`` is ``_SMALL`` for a small key (its layouts are parsed when it is compared),
    the `_NotFast` for a key that does not qualify, else the futures of its chunks' layouts
    on ``lpool`` by (side, chunk index), with how many items and bytes they span."""
    ea, eb = run.ia.entries[key], run.ib.entries[key]
    try:
        _check_key(ea, eb)
        if _is_small(ea, eb, run.slab):
            return _SMALL, 0, 0
        chunks = _chunks_compared(run, ea, eb)
        if run.prefetch:
            _prefetch_heads(run, chunks)
        futs = {(side, i): lpool.submit(_layout_job, ix, c) for side, ix, i, c in chunks}
        nbytes = sum(int(c.location.length) for *_, c in chunks if c.location is not None)
        return futs, len(chunks), nbytes
    except _NotFast as exc:
        return exc, 0, 0


def _key_bytes(entry: Any) -> int:
    return entry.numel * int(entry.dtype.itemsize)


def _is_small(ea: Any, eb: Any, slab: int) -> bool:
    """A key whose cost is Python, not bytes (see ``SMALL_KEY_BYTES``)."""
    return _key_bytes(ea) <= min(slab, SMALL_KEY_BYTES) and len(ea.chunks) + len(eb.chunks) <= SMALL_KEY_CHUNKS


def _chunks_compared(run: _Run, ea: Any, eb: Any) -> list[tuple[str, Any, int, Any]]:
    """``(side, index, chunk index, chunk)`` of the non-empty chunks a key's comparison reads:
    with ``b_files``, only B's chunks stored there and A's chunks that meet them."""
    b_files = run.b_files
    bs = [(i, c) for i, c in enumerate(eb.chunks) if not c.box.is_empty() and
          (b_files is None or (c.location is not None and c.location.file in b_files))]
    as_ = [(i, c) for i, c in enumerate(ea.chunks) if not c.box.is_empty() and
           (b_files is None or any(c.box.intersect(d.box) is not None for _, d in bs))]
    return [("a", run.ia, i, c) for i, c in as_] + [("b", run.ib, i, c) for i, c in bs]


def _prefetch_heads(run: _Run, chunks: list[tuple[str, Any, int, Any]]) -> None:
    """Ask the kernel to read the chunks' items ahead (``posix_fadvise WILLNEED``): a huge item,
    or any read directly, only its head and its zip directory, which the layout parse reads."""
    cap = (64 << 10) if run.direct else PREFETCH_BYTES // 4
    for _, ix, _, c in chunks:
        if c.location is not None:
            path, off, n = Path(ix.root) / c.location.file, int(c.location.offset), int(c.location.length)
            _willneed(run.files, path, off, min(n, cap))
            if n > cap:
                _willneed(run.files, path, off + n - (64 << 10), 64 << 10)


# ------------------------------------------------------------------------------ small keys
def _add_small(run: _Run, batch: _SmallBatch, key: str) -> None:
    """Queue a small key; compare the batch once it holds a slab's bytes or ``SMALL_BATCH_KEYS`` keys."""
    batch.keys.append(key)
    batch.nbytes += _key_bytes(run.ia.entries[key])
    if batch.nbytes >= run.slab or len(batch.keys) >= SMALL_BATCH_KEYS:
        _flush_small(run, batch)


def _flush_small(run: _Run, batch: _SmallBatch) -> None:
    """Compare the queued small keys in this thread: they are mostly Python work (layouts,
    planning), which threads would only contend for, while the pool reads and compares large keys."""
    if batch.keys:
        _record_small(run, _run_small_keys(run.files, run.ia, run.ib, batch.keys, run.slab, run.names,
                                           run.hash_b, run.b_files))
        batch.keys, batch.nbytes = [], 0


def _record_small(run: _Run, results: list[tuple[KeyVerdict, dict[str, str], int, int, int]]) -> None:
    """A batch's `_run_small_keys` results: verdicts and digests kept, parts counted, and
    every chunk of A of an equal key ticked at once."""
    for v, dig, fast, slow, nbytes in results:
        run.verdicts[v.key] = v
        run.digests.update(dig)
        _count(parts_contiguous=fast, parts_strided=slow, bytes=nbytes)
        if v.status == "equal":
            run.tick(v, range(len(run.ia.entries[v.key].chunks)))


# ------------------------------------------------------------------------------ large keys
def _compare_large_key(run: _Run, pool: ThreadPoolExecutor, key: str, layouts: Any) -> None:
    """Plan a large key over its parsed layouts and hand its tasks to the pool (none once it stopped)."""
    planned = _plan_large_key(run, key, layouts)
    if planned is None:
        return
    state, tasks = planned
    run.verdicts[key] = state.verdict
    for task in tasks:
        if state.stop:
            break
        _submit(run, state, task, pool.submit(_run_task, run.files, state, task, run.hash_b))


def _plan_large_key(run: _Run, key: str, layouts: Any) -> tuple[_KeyState, list[_Task]] | None:
    """`_plan` over the layouts parsed ahead; None, with a ``"fallback"`` verdict recorded,
    when the key does not qualify or one of its items cannot be read (the slow path says so)."""
    try:
        if isinstance(layouts, Exception):
            raise layouts
        return _plan(run.ia, run.ib, key, run.slab, run.names, lambda side, i: layouts[(side, i)].result(),
                     run.b_files)
    except _NotFast as exc:
        run.verdicts[key] = KeyVerdict(key, "fallback", str(exc))
    except Exception as exc:  # noqa: BLE001 - unreadable item: the slow path says so
        run.verdicts[key] = KeyVerdict(key, "fallback", _error_reason(exc))
    return None


def _submit(run: _Run, state: _KeyState, task: _Task, fut: Any) -> None:
    """Put a task in flight; settle the oldest while the window is full, so memory stays bounded."""
    run.window.append((state, task, fut))
    while len(run.window) >= run.limit:
        _finish_task(run, *run.window.popleft())


def _drain(run: _Run) -> None:
    """Settle every task still in flight, oldest first."""
    while run.window:
        _finish_task(run, *run.window.popleft())


def _finish_task(run: _Run, state: _KeyState, task: _Task, fut: Any) -> None:
    """A task's outcome into its key's state: its digest kept, the key stopped on a difference
    or an error, else its parts counted and each chunk of A whose parts are all done ticked."""
    try:
        same, dig, fast, slow = fut.result()
    except CorruptItem:
        raise  # bad input, not a difference
    except Exception as exc:  # noqa: BLE001 - the slow path reports it in its own words
        _stop_key(state, "fallback", _error_reason(exc))
        return
    if dig is not None:
        run.digests[f"{task.b.file}:{task.b.item_offset}"] = dig
    if not same:
        _stop_key(state, "different", None)
        return
    if state.stop:
        return
    _count(parts_contiguous=fast, parts_strided=slow,
           bytes=sum(p.box.numel for p in task.pieces) * state.itemsize)
    for i, n in task.a_parts:
        state.remaining[i] -= n
        if not state.remaining[i]:
            run.tick(state.verdict, (i,))


def _stop_key(state: _KeyState, status: str, reason: str | None) -> None:
    """The first task of a key that differs or fails decides its verdict; its other tasks are skipped."""
    if not state.stop:
        state.stop = True
        state.verdict.status, state.verdict.reason = status, reason


def _error_reason(exc: BaseException) -> str:
    """A fallback's reason for an error (the slow path reports the error itself in its own words)."""
    return f"{type(exc).__name__}: {str(exc)[:200]}"


def _count_verdicts(verdicts: dict[str, KeyVerdict]) -> None:
    for v in verdicts.values():
        _count(**{f"keys_{v.status}": 1})


def _settle_crcs(files: _Files, verdicts: dict[str, KeyVerdict], b_files: Any) -> dict[str, int]:
    """After the comparison: the storages the pieces did not tile (see the module docstring),
    each completed by one read of what is missing, left to the decoding path, or counted as
    not checked; returns `CompareResult.crc`."""
    ledger = files.ledger
    ledger.raise_first()  # the first corrupt storage in (file, offset) order, whatever order the pool took
    extra = left = unchecked = 0
    for rec in ledger.pending():
        v = verdicts.get(rec.key) if rec.key is not None else None
        if v is None or v.status != "equal":
            left += 1  # the slow path decodes this key, and `dcp.load_item` checks every item it reads
        elif b_files is not None:
            unchecked += 1  # another worker reads the rest of it
        else:
            _read_rest(files, rec)
            extra += 1
    summary = ledger.summary()
    return {"checked": summary["checked"] - extra, "checked_by_extra_read": extra,
            "unrecorded": summary["unrecorded"], "left_to_decoding": left, "not_checked": unchecked}


def _read_rest(files: _Files, rec: StorageRecord) -> None:
    """Read the bytes of ``rec`` no piece covered, once, into the ledger (which checks it);
    the whole storage when the pieces overlap without chaining up."""
    fd = files.fd(Path(rec.path))
    buf, _ = files.buffers()
    for off, n in files.ledger.missing(rec):
        files.ledger.add(rec, off, n, _crc_range(fd, buf, rec.at + off, n))
    if not files.ledger.verified(rec) and not files.ledger.failures:
        files.ledger.add(rec, 0, rec.nbytes, _crc_range(fd, buf, rec.at, rec.nbytes))
    files.ledger.raise_first()


def _crc_range(fd: int, buf: np.ndarray, pos: int, n: int) -> int:
    crc = 0
    while n > 0:
        m = min(n, len(buf))
        x = buf[:m]
        read_exact(fd, x, pos)
        crc = crc32(x, crc)
        pos += m
        n -= m
    return crc
