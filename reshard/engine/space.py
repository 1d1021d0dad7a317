"""How much a conversion writes, whether it fits where it goes, and about how long it takes.

The size comes from the plan and the source's metadata only, so `reshard plan --dst` can
warn and `convert`, `export` and `import` can refuse (exit 2, both figures named) before any
byte is written: a terabyte conversion that fills a shared disk after an hour harms more
than the run. ``--force`` goes ahead anyway (a full disk then stops it with nothing
committed). The time is a range, low to high, from the bytes to move at the rate of a short
probe of the copy's own path (direct reads of the source, CRC-32, direct writes beside the
destination, removed after; skipped for a small conversion), the items to write and the load,
recorded with what bounds it and its basis (`estimate_time`).
``RESHARD_FREE_BYTES`` overrides the free space the file system reports (`free_bytes`).
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from reshard.errors import BadInput, ReshardError
from reshard.model.dtypes import dtype_named
from reshard.render.space import space_line
from reshard.storage.checkpoints import dcp_writer
from reshard.storage.objectstore import remote, upload
from reshard.storage.files.atomic import reclaimable_bytes
from reshard.storage.files.integrity import nearest_existing
from reshard.units import human_bytes


SAVE_OVERHEAD = 1513
"""Bytes ``torch.save`` adds around a tensor's payload (zip records, pickle, alignment): the
length of ``torch.save(torch.empty(0))`` in torch 2.13 (``tests/test_no_torch.py`` checks it), stated
so that an estimate needs no torch import."""


def _numel(sizes: Iterable[int]) -> int:
    n = 1
    for s in sizes:
        n *= int(s)
    return n


def _reader(plan: Any) -> Any:
    """The reader of the plan's source when the caller hands none: the plan's own, else its checkpoint
    on this machine opened now (a source in a store is read through the reader its command opened)."""
    from reshard.planning.plan import plan_reader
    from reshard.storage.source import Source

    return plan_reader(plan, Source.local(plan.source["path"]))


def estimate_output_bytes(plan: Any, index: Any = None) -> int:
    """Bytes a conversion of ``plan`` writes: an estimate, usually within a few percent.

    Tensor chunks: elements x element size + the ``torch.save`` overhead per item (+ one
    block of alignment padding for storages the writer aligns). Carried
    objects: their stored size in the source. Rewritten and added objects: their pickled
    size + overhead. ``.metadata``: the source's (it scales with the number of items).
    ``manifest.json`` (~100 bytes per item checksum) and the reports (~400 bytes per key)
    plus a fixed 16 KiB.
    """
    import pickle

    ix = index if index is not None else _reader(plan)
    over = SAVE_OVERHEAD
    total = items = 0
    for t in plan.tensors:
        size = dtype_named(t.dtype).itemsize
        for _rank, _offsets, sizes in t.chunks:
            nbytes = _numel(sizes) * size
            # a storage this large starts block-aligned: up to one block of padding before it
            total += nbytes + over + (dcp_writer.ALIGN if nbytes >= dcp_writer.ALIGN_FROM else 0)
            items += 1
    tensor_keys = {t.key for t in plan.tensors}
    for a in plan.keys:
        if a.key in tensor_keys or a.left_out:
            continue
        items += 1
        if a.new_value and a.key in plan.new_values:
            v = plan.new_values[a.key]
            try:
                total += len(pickle.dumps(v, protocol=2)) + over
            except Exception:  # noqa: BLE001 - an estimate
                total += over
            continue
        e = ix.entries.get(a.key)
        if e is not None and not e.is_tensor and e.location is not None:
            total += e.location.length
    md = Path(ix.root) / ".metadata"
    try:
        total += md.stat().st_size
    except OSError:
        pass
    return total + 100 * items + 400 * len(plan.keys) + 16 * 1024


def space_check(plan: Any, dst: str | os.PathLike, *, needed: int | None = None, index: Any = None,
                probe: bool = False) -> dict[str, Any]:
    """Will the converted checkpoint fit where ``dst`` will be? Reads metadata only (and, with
    ``probe``, times a short read of the source and a write beside ``dst``: `preflight`).

    Returns `preflight`'s figures (``destination, checked, needed_bytes, free_bytes, enough,
    ..., warning``); ``warning`` is one paragraph, or None when there is enough space. Never
    refuses: `reshard plan --dst` warns, `convert` refuses (`conversion_preflight`).
    """
    ix = index if index is not None else _reader(plan)
    need = estimate_output_bytes(plan, ix) if needed is None else int(needed)
    figures = preflight(dst, needed=need, read_bytes=conversion_read_bytes(plan, ix), sources=[ix.root], force=True,
                        probe=probe, stores=_stores(ix), items=written_items(plan))
    if not figures["enough"]:
        figures["warning"] = (
            f"{figures['destination']}: the destination's file system has {human_bytes(figures['free_bytes'])} "
            f"({figures['free_bytes']} bytes) free at {figures['checked']}, but the converted checkpoint needs about "
            f"{human_bytes(need)} ({need} bytes); convert would refuse it (exit 2) unless given --force. Free space "
            "there or choose another destination.")
    return figures


def written_items(plan: Any) -> int:
    """The items a conversion of ``plan`` writes (a tensor chunk or an object each): the per-item part of its time."""
    tensor_keys = {t.key for t in plan.tensors}
    return (sum(len(t.chunks) for t in plan.tensors)
            + sum(1 for a in plan.keys if a.key not in tensor_keys and not a.left_out))


def conversion_read_bytes(plan: Any, ix: Any) -> int:
    """The source bytes a conversion reads: the logical bytes of every key the plan keeps (what
    convert's "writing" phase counts, `reshard.engine.copy.writing_bytes`)."""
    dropped = {a.key for a in plan.keys if a.left_out}
    return sum(e.nbytes for key, e in ix.entries.items() if key not in dropped)


def conversion_preflight(plan: Any, ix: Any, dst: str | os.PathLike, *, force: bool = False,
                         progress: Any = None, publish_to: str | None = None) -> dict[str, Any]:
    """`preflight` for `reshard convert`: the plan's output estimate against ``dst``'s free space.

    A source in object storage also gets its read cache here (`keep_remote_reads`), sized by the
    room the output leaves: the verification after the copy then reads the source's bytes from
    this machine instead of fetching them a second time."""
    read_bytes, needed = conversion_read_bytes(plan, ix), estimate_output_bytes(plan, ix)
    kept = keep_remote_reads(getattr(ix, "remote", None), dst, needed)  # before the probe, whose read is then kept too
    figures = preflight(dst, needed=needed, read_bytes=read_bytes, sources=[ix.root], force=force, progress=progress,
                        stores=_stores(ix), publish_to=publish_to, items=written_items(plan),
                        torch_needed=needs_torch(plan, ix))
    if kept is not None:
        figures["read_cache_bytes"] = kept
    return figures


def needs_torch(plan: Any, ix: Any) -> bool:
    """Whether converting by ``plan`` imports torch (1-3 s the estimate then counts): tensor arithmetic
    (a transform, a slice's renumbered copy, a cast) or a source read by decoding (one in a store, or
    not a DCP folder); a copy of bytes into the same layout family does not (issue 45)."""
    from reshard.storage.checkpoints.index import CheckpointIndex

    if getattr(ix, "remote", None) is not None or not isinstance(ix, CheckpointIndex):
        return True
    for t in plan.tensors:
        e = ix.entries.get(t.key)
        if t.transform or t.copy_from or e is None or t.dtype != e.dtype_name:
            return True
    return False


def _stores(ix: Any) -> list[Any]:
    """The store a reader reads (its `RemoteCheckpoint`, handed to it when its source was opened), as `preflight` takes it."""
    rc = getattr(ix, "remote", None)
    return [rc] if rc is not None else []


READ_CACHE_ENV = "RESHARD_READ_CACHE"  # at most this much of a remote source kept locally in a conversion (0: none)


def keep_remote_reads(rc: remote.RemoteCheckpoint | None, dst: str | os.PathLike, needed: int) -> int | None:
    """For a source in object storage (``rc``, its `RemoteCheckpoint`; None for a local one): turn on its local copy of what the run
    fetches (`RemoteCheckpoint.keep_reads`) with a budget: the bytes of its data objects, within half
    the space its folder's file system has left once the output (``needed`` bytes at ``dst``, when on
    the same file system) and 1 GiB are set aside, and within ``$RESHARD_READ_CACHE`` when set.
    Returns the budget (0: nothing kept)."""
    from reshard.units import parse_size

    if rc is None:
        return None
    folder = rc.cache_folder
    checked = nearest_existing(Path(os.path.abspath(os.fspath(dst))).parent)
    if folder is None:
        return 0
    try:
        free = shutil.disk_usage(folder).free
        same = os.stat(folder).st_dev == os.stat(checked).st_dev
    except OSError:
        return 0
    spare = free - (needed if same else 0) - (1 << 30)
    budget = min(rc.data_bytes(), max(0, spare // 2))
    cap = os.environ.get(READ_CACHE_ENV, "").strip()
    if cap:
        budget = 0 if cap == "0" else min(budget, parse_size(cap))
    rc.keep_reads(budget)
    return budget


# ---------------------------------------------------------------------------- before the first byte
FREE_BYTES_ENV = "RESHARD_FREE_BYTES"  # override of the free space reported for every destination (tests, operators)
PROBE_BYTES = 4 << 20  # what the store's read and upload probes move: one request each, its latency included
_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30,
          "t": 1 << 40, "tib": 1 << 40}


def free_bytes(path: str | os.PathLike) -> tuple[int, str]:
    """Free bytes of the file system holding ``path``, and where the figure came from.

    ``RESHARD_FREE_BYTES`` (bytes, or with a binary unit: ``60GiB``) replaces what the file
    system says, for every destination: a test can then check a terabyte-scale refusal
    without a terabyte disk, and an operator can keep a margin for other users of a shared
    disk (``RESHARD_FREE_BYTES`` set to what reshard may use).
    """
    text = os.environ.get(FREE_BYTES_ENV, "").strip()
    if text:
        t = text.lower().replace(" ", "")
        num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = t[len(num):]
        try:
            value = int(float(num) * _UNITS[unit.removesuffix("b") if unit not in _UNITS else unit])
        except (KeyError, ValueError):
            raise BadInput(f"{FREE_BYTES_ENV}={text!r} is not a size",
                           hint="Write a number of bytes, or e.g. 60GiB; unset it to ask the file system.") from None
        return max(0, value), f"{FREE_BYTES_ENV}={text}"
    return shutil.disk_usage(path).free, "the file system"


def data_files(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """The regular files among ``paths`` (directories: the files directly in them), largest first: what the
    copy probe reads (the largest files hold the tensors the copy moves)."""
    found: list[tuple[int, str, Path]] = []
    for p in paths:
        p = Path(p)
        for f in (sorted(p.iterdir()) if p.is_dir() else [p]):
            try:
                if f.is_file() and not f.is_symlink():
                    found.append((f.stat().st_size, str(f), f))
            except OSError:
                continue
    found.sort(key=lambda t: (-t[0], t[1]))
    return [f for _size, _name, f in found]


@dataclass
class Rate:
    """One probe: bytes moved in seconds (None and ``error`` when the probe could not run)."""

    what: str
    nbytes: int = 0
    seconds: float = 0.0
    error: str | None = None

    @property
    def per_second(self) -> float | None:
        return self.nbytes / max(self.seconds, 1e-6) if self.nbytes and self.error is None else None

    def describe(self) -> str:
        if self.error is not None:
            return f"{self.what}: not measured ({self.error})"
        return f"{self.what}: {human_bytes(self.nbytes)} in {self.seconds * 1000:.1f} ms ({human_bytes(self.per_second)}/s)"

    def figures(self) -> dict[str, Any]:
        """As the estimate's JSON holds a probe (``read``, ``write``, ``crc``, ``upload``)."""
        return {"bytes": self.nbytes, "seconds": round(self.seconds, 6), "error": self.error, "file": self.what}


# ---------------------------------------------------------------------------- the copy probe
PROBE_FROM = 64 << 20
"""A conversion that moves less than this (read + written) is not probed: its time is start-up and per-item
work, which no disk probe predicts, and a 1 MB checkpoint should pay nothing for the estimate."""
PROBE_SECONDS = 0.25  # the copy probe stops at its first block after this long (wall)
PROBE_CAP = 64 << 20  # ... or once it has moved this many bytes, whichever comes first
PROBE_BLOCK = 4 << 20  # one direct read, CRC and direct write of a stream: a slab of the copy, in small
SMALL_RATE = 100 << 20
"""Bytes/s assumed, unprobed, for a small conversion (stated in its basis): slower than any local disk this
project has met, so the estimate errs long, by at most the few milliseconds a small checkpoint moves."""


@dataclass
class Timed:
    """Bytes moved along the copy's path, and the thread-seconds each part took (a stream's, or all of them)."""

    nbytes: int = 0
    read_s: float = 0.0
    crc_s: float = 0.0
    write_s: float = 0.0
    direct_read: bool = False
    direct_write: bool = False
    error: str | None = None


@dataclass(kw_only=True)
class PathProbe(Timed):
    """The copy's path timed in small: ``streams`` threads (as many as the copy's pool) each read blocks of
    the source's largest data files with the copy's I/O mode (``O_DIRECT`` where the file system has it, else
    buffered with the range dropped from the page cache first), take their CRC-32 and write them with direct
    I/O to a hidden file beside the destination, fsynced at the end and removed, whatever happens.

    ``seconds`` is the wall time of the whole; ``read_s``, ``crc_s`` and ``write_s`` the thread-seconds each
    part took, which say what bounds the copy (`bound`). No source (a checkpoint in a store, whose reads are
    timed by `store_probe`): random blocks are written, and only the write is timed."""

    source: str
    folder: str
    streams: int = 0
    seconds: float = 0.0

    @property
    def per_second(self) -> float | None:
        """Bytes/s moved through read, CRC and write at once: the rate the copy's bytes are predicted at."""
        return self.nbytes / max(self.seconds, 1e-6) if self.nbytes and self.error is None else None

    def part(self, name: str) -> Rate:
        """One part alone (``read``, ``crc``, ``write``): the probe's bytes over its thread-seconds per stream."""
        secs = {"read": self.read_s, "crc": self.crc_s, "write": self.write_s}[name]
        where = {"read": f"read of {self.source}", "crc": "CRC-32 in this process", "write": f"write to {self.folder}"}[name]
        if self.error is not None or not self.nbytes:
            return Rate(where, error=self.error or "nothing moved")
        if name == "read" and not self.read_s:
            return Rate(where, error="not probed here")
        return Rate(where, self.nbytes, secs / max(1, self.streams))

    @property
    def bound(self) -> str | None:
        """The part that took the most time: ``read``, ``write`` or ``crc`` (CPU)."""
        if self.error is not None or not self.nbytes:
            return None
        return max((("read", self.read_s), ("crc", self.crc_s), ("write", self.write_s)), key=lambda t: t[1])[0]

    def figures(self) -> dict[str, Any]:
        return {"streams": self.streams, "bytes": self.nbytes, "seconds": round(self.seconds, 6),
                "direct_read": self.direct_read, "direct_write": self.direct_write, "error": self.error,
                "bound": self.bound}


@dataclass(kw_only=True)
class _Stream(Timed):
    """One stream of the copy probe: its source region, its own probe file, and what it has timed."""

    source: Path | None
    start: int
    end: int
    target: Path

    def run(self, deadline: float, cap: int) -> None:
        try:
            self._run(deadline, cap)
        except OSError as exc:
            self.error = f"{exc.filename or self.target}: {exc.strerror or exc}"

    def _run(self, deadline: float, cap: int) -> None:
        from reshard.storage.files.fileio import ALIGN, aligned_buffer, crc32, open_direct

        buf = aligned_buffer(PROBE_BLOCK)
        if self.source is None:
            buf[:] = secrets.token_bytes(len(buf))  # not zeros: a compressing file system would time nothing
        fd = wfd = rfd = None
        try:
            if self.source is not None:
                rfd = open_direct(self.source, os.O_RDONLY)
                self.direct_read = rfd is not None
                if rfd is None:
                    rfd = os.open(self.source, os.O_RDONLY)
                    if hasattr(os, "posix_fadvise"):  # time the disk, not memory, where the kernel allows
                        with contextlib.suppress(OSError):
                            os.posix_fadvise(rfd, self.start, self.end - self.start, os.POSIX_FADV_DONTNEED)
            fd = os.open(self.target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            wfd = open_direct(self.target, os.O_WRONLY)
            self.direct_write = wfd is not None
            out = wfd if wfd is not None else fd
            pos, at = self.start, 0
            while self.nbytes < cap and time.perf_counter() < deadline:
                n = PROBE_BLOCK
                if rfd is not None:
                    if pos + ALIGN > self.end:
                        pos = self.start  # wrap around in this stream's region
                    n = min(PROBE_BLOCK, (self.end - pos) // ALIGN * ALIGN)
                    t = time.perf_counter()
                    got = os.preadv(rfd, [buf[:n]], pos)
                    self.read_s += time.perf_counter() - t
                    n, pos = got // ALIGN * ALIGN, pos + got  # a short read at the end: its whole blocks
                    if n <= 0:
                        break
                t = time.perf_counter()
                crc32(buf[:n])  # the copy's own CRC (native where built), the one the probe predicts
                t2 = time.perf_counter()
                done = os.pwritev(out, [buf[:n]], at)
                t3 = time.perf_counter()
                self.crc_s += t2 - t
                self.write_s += t3 - t2
                self.nbytes += done
                at += done
            t = time.perf_counter()
            os.fsync(out)  # what the copy's commit waits for too
            self.write_s += time.perf_counter() - t
        finally:
            for d in (rfd, wfd, fd):
                if d is not None:
                    with contextlib.suppress(OSError):
                        os.close(d)


def path_probe(sources: list[Path], folder: Path, *, streams: int, seconds: float = PROBE_SECONDS,
               cap: int = PROBE_CAP) -> PathProbe:
    """Time the copy's path (`PathProbe`) for at most about ``seconds`` and ``cap`` bytes; never raises for I/O.

    ``sources``: the source's data files, largest first (empty: write only). Each stream reads its own
    region (the files' bytes cut in ``streams`` parts), so the streams do not share blocks."""
    import threading

    what = str(sources[0]) if sources else "(no local source)"
    probe = PathProbe(source=what, folder=str(folder), streams=max(1, streams))
    regions: list[tuple[Path | None, int, int]] = []
    from reshard.storage.files.fileio import ALIGN

    for i in range(probe.streams):
        if not sources:
            regions.append((None, 0, 0))
            continue
        f = sources[i % len(sources)]
        share = max(1, probe.streams // len(sources) + (1 if i % len(sources) < probe.streams % len(sources) else 0))
        k = i // len(sources)
        try:
            size = f.stat().st_size
        except OSError as exc:
            return PathProbe(source=what, folder=str(folder), error=exc.strerror or str(exc))
        lo = size * k // share // ALIGN * ALIGN
        hi = size * (k + 1) // share
        if hi - lo < ALIGN:
            lo, hi = 0, size
        if size < ALIGN:
            return PathProbe(source=what, folder=str(folder), error="the source's data files are too small to probe")
        regions.append((f, lo, hi))
    tag = f"{os.getpid()}-{secrets.token_hex(4)}"
    parts = [_Stream(source=src, start=lo, end=hi, target=folder / f".reshard-probe-{tag}-{i}")
             for i, (src, lo, hi) in enumerate(regions)]
    started = time.perf_counter()
    deadline = started + seconds
    threads = [threading.Thread(target=s.run, args=(deadline, max(PROBE_BLOCK, cap // len(parts))), daemon=True)
               for s in parts]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for s in parts:
            with contextlib.suppress(OSError):
                os.unlink(s.target)
    probe.seconds = time.perf_counter() - started
    errors = [s.error for s in parts if s.error]
    if errors:
        probe.error = errors[0]
        return probe
    probe.nbytes = sum(s.nbytes for s in parts)
    probe.read_s, probe.crc_s, probe.write_s = (sum(s.read_s for s in parts), sum(s.crc_s for s in parts),
                                                sum(s.write_s for s in parts))
    probe.direct_read = all(s.direct_read for s in parts) and bool(sources)
    probe.direct_write = all(s.direct_write for s in parts)
    return probe


def store_probe(rc: "remote.RemoteCheckpoint", nbytes: int = PROBE_BYTES) -> Rate:
    """Time a ranged read of up to ``nbytes`` of a remote checkpoint's largest data object: the
    store's throughput (with its latency) is what a conversion from it reads at."""
    sizes = {n: rc.sizes[n] for n in rc.data_files()}
    if not sizes:
        return Rate("read", error="no data object to read")
    name = max(sorted(sizes), key=sizes.__getitem__)
    what = f"read of {rc.where(name)}"
    n = min(nbytes, sizes[name])
    if n <= 0:
        return Rate(what, error="the object is empty")
    try:
        t = time.perf_counter()
        got = len(rc.read_range(name, 0, n))
        return Rate(what, got, time.perf_counter() - t)
    except ReshardError as exc:
        return Rate(what, error=exc.message)


def upload_probe(url: str, nbytes: int = PROBE_BYTES) -> Rate:
    """Time one put of ``nbytes`` (random, so a compressing store times something) under the
    destination prefix ``url``, deleted after: the rate an output bound for the store is sent at."""
    what = f"upload to {url}"
    try:
        return Rate(what, nbytes, upload.timed_put(url, secrets.token_bytes(nbytes)))
    except ReshardError as exc:
        return Rate(what, error=exc.message)
    except Exception as exc:  # noqa: BLE001 - the store's errors: the estimate says it is not measured
        return Rate(what, error=f"{type(exc).__name__}: {exc}")


def estimate_dcp_bytes(chunk_bytes: Iterable[int], keys: int) -> int:
    """What a DCP checkpoint of chunks of these sizes (and ``keys`` keys) takes on disk, as
    `estimate_output_bytes` counts it (``.metadata`` taken as ~400 bytes per chunk)."""
    over = SAVE_OVERHEAD
    total = items = 0
    for nbytes in chunk_bytes:
        total += nbytes + over + (dcp_writer.ALIGN if nbytes >= dcp_writer.ALIGN_FROM else 0)
        items += 1
    return total + 500 * items + 400 * keys + 16 * 1024


def _refuse_read_only(dst: Path, checked: Path) -> None:
    """A read-only file system reports free space it will never give: say what is wrong instead."""
    try:
        read_only = bool(os.statvfs(checked).f_flag & os.ST_RDONLY)
    except OSError:
        return  # the write itself will say what is wrong
    if read_only:
        raise BadInput(f"{dst}: cannot be written: the file system holding {checked} is mounted read-only (EROFS)",
                       hint="Nothing was written. Choose a destination on a writable file system.")


def preflight(dst: str | os.PathLike, *, needed: int, read_bytes: int, sources: Iterable[str | os.PathLike] = (),
              force: bool = False, what: str = "the conversion", progress: Any = None,
              probe: bool = True, stores: Iterable[remote.RemoteCheckpoint] = (),
              publish_to: str | None = None, items: int | None = None,
              torch_needed: bool = True) -> dict[str, Any]:
    """Before the first byte: will the output fit at ``dst``, and about how long will it take?

    ``stores``: the sources in object storage (their `RemoteCheckpoint`), whose read is probed instead of a file's.
    ``publish_to``: the store URL an output made at ``dst`` is then uploaded to (its upload is probed too).

    ``items``: the items written (`written_items`), whose per-item work is part of the time.

    Refuses (`BadInput`, exit 2) when the destination's file system has less free space than
    the output ``needed``, naming both figures, unless ``force``: nothing has been written
    then (no temporary directory, no probe). Otherwise estimates the time from here to the end
    as a range (`estimate_time`: the bytes at the rate of a short probe of the copy's own path,
    skipped for a small conversion, plus the per-item work, the torch import and the end, scaled
    by the load), with what bounds it and its basis recorded: an estimate (caches and other users of
    the disks and cores make the real time differ). With ``--overwrite`` the old output is removed
    only after the new one is in place, so the full amount is needed either way.

    Returns the figures (JSON data) that `plan --dst`, the first lines of a command and its
    report all show: ``destination, checked, needed_bytes, free_bytes, free_from, enough,
    forced, read_bytes, low_s, high_s, seconds, bound, parts, read, write, crc, probe, basis, load, warning``.
    """
    dst = Path(os.path.abspath(os.fspath(dst)))
    checked = nearest_existing(dst.parent if not dst.is_dir() else dst)
    _refuse_read_only(dst, checked)
    free, free_from = free_bytes(checked)
    reclaim = reclaimable_bytes(dst)
    if reclaim:  # an interrupted run's output: resumed into or deleted before the first byte
        free += reclaim
        free_from += f" + {human_bytes(reclaim)} held by an interrupted run into it"
    need = int(needed)
    enough = free >= need
    figures: dict[str, Any] = {
        "destination": str(dst), "checked": str(checked), "needed_bytes": need, "free_bytes": free,
        "free_from": free_from, "enough": enough, "forced": bool(force and not enough), "read_bytes": int(read_bytes),
        "low_s": None, "high_s": None, "seconds": None, "bound": None, "read": None, "write": None, "basis": None,
        "warning": None}
    short = (f"destination {dst} has {human_bytes(free)} free ({free} bytes, from {free_from} at {checked}), "
             f"{what} writes about {human_bytes(need)} ({need} bytes)")
    if not enough:
        if not force:
            raise BadInput(short, hint="Nothing was written. Free space there, choose another destination (DST), or "
                                       "pass --force to go ahead anyway (a full disk then stops it with nothing "
                                       "committed)")
        figures["warning"] = short + "; going ahead (--force)"
    copy_rate: float | None = None
    if probe:
        est = estimate_time(checked, free=free, needed=need, read_bytes=int(read_bytes), sources=sources,
                            stores=list(stores), publish_to=publish_to, items=items, torch_needed=torch_needed)
        figures.update(est.figures())
        copy_rate = est.copy_rate(int(read_bytes))
    if progress is not None:
        progress.say(space_line(figures))
        if hasattr(progress, "estimated"):  # the estimate printed before the work (convert: on stdout, even on a pipe)
            progress.estimated(figures)
        # the copy's ETA from its first second, from the estimate's parts that fall in the copy phase
        if copy_rate is not None and hasattr(progress, "expect"):
            progress.expect("copy", copy_rate)
    return figures


# ---------------------------------------------------------------------------- the time, as a range
ITEM_SECONDS = (0.0012, 0.0025)
"""CPU seconds per item written, on an idle core (low, high): the copy's Python work per item (locating it,
its head and tail, the journal), which dominates a checkpoint of many small items."""
TORCH_IMPORT_SECONDS = (1.2, 1.6)
"""Importing torch, which the copy does first when this process has not yet: 1.4 s on an idle core here."""
TAIL_SECONDS = (0.3, 0.8)
"""After the last byte: the verification's bookkeeping, the reports, the commit and the interpreter's exit."""
BYTES_SPREAD = (0.45, 1.5)
"""The copy's time over the probe's prediction of it (low, high): a quarter second of a long copy meets a
quieter or busier disk than the whole does, and the copy does more per byte than read, CRC and write."""


CPU_SLOWDOWN = (0.3, 0.9)
"""The CPU parts' slowdown over an idle core's, per unit of load average over the cores (low, high), never
under 1 (low) and 1.3 (high): measured on this project's 2-core machine at loads 11-21 (the torch import
of 1.4 s idle, and what comes with it before the copy's first byte, took 0.28-0.86 times the load per core
as long; docs/benchmarks.md). The load average counts processes waiting on disks too and lags by a minute,
hence the width."""


def cpu_slowdown() -> tuple[float, float, str]:
    """How many times longer than on an idle core this process's CPU work may take now (low, high), and from what.

    From the load average over the cores. Not from a probe of the CPU: one short enough to be free (tens of
    milliseconds) measured the scheduler's time slice more than the machine's load; nor from the kernel's CPU
    pressure, which on a busy 2-core machine stays near 90 % whether the work is slowed twice or seven times."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # pragma: no cover - not POSIX
        return 1.0, 4.0, "no load average: assumed"
    per_core = load / (os.cpu_count() or 1)
    return max(1.0, CPU_SLOWDOWN[0] * per_core), max(1.3, CPU_SLOWDOWN[1] * per_core), f"load {load:.1f}"


@dataclass
class TimeEstimate:
    """The conversion's time as a range, by part (seconds low, high), with the probes it rests on.

    ``parts``: ``bytes`` (the data at the probed rate: read, CRC-32 and write at once), ``items`` (per-item
    work), ``torch import`` (when this process has not imported it yet), ``after`` (verification's
    bookkeeping, reports, commit, exit). The CPU parts scale with `cpu_slowdown`. ``bound``: what bounds
    the bytes: ``read``, ``write``, ``crc`` (CPU), ``store`` or ``upload``; None when not probed."""

    parts: dict[str, tuple[float, float]]
    basis: str
    bound: str | None = None
    probes: dict[str, Any] = field(default_factory=dict)
    load: float | None = None
    cpu_slowdown: list[float] | None = None

    @property
    def low(self) -> float:
        return sum(lo for lo, _hi in self.parts.values())

    @property
    def high(self) -> float:
        return sum(hi for _lo, hi in self.parts.values())

    def copy_rate(self, read_bytes: int) -> float | None:
        """Bytes/s the copy phase is expected to move at (its ETA before its own bytes give one): every part
        but ``after``, at the middle of its range."""
        lo = sum(v[0] for k, v in self.parts.items() if k != "after")
        hi = sum(v[1] for k, v in self.parts.items() if k != "after")
        return read_bytes / max((lo * hi) ** 0.5, 1e-6) if read_bytes else None

    def figures(self) -> dict[str, Any]:
        """``low_s``, ``high_s``, ``seconds`` (the middle of the range, as earlier reports had it), ``bound``,
        ``parts``, ``basis``, ``load`` and the probes (``read``, ``write``, ``crc``, ``probe``, ``upload``)."""
        lo, hi = self.low, self.high
        return {"low_s": round(lo, 3), "high_s": round(hi, 3), "seconds": round((lo * hi) ** 0.5, 3),
                "bound": self.bound, "parts": {k: [round(a, 3), round(b, 3)] for k, (a, b) in self.parts.items()},
                "basis": self.basis, "load": self.load, "cpu_slowdown": self.cpu_slowdown, **self.probes}


def estimate_time(checked: Path, *, free: int, needed: int, read_bytes: int, sources: Iterable[str | os.PathLike],
                  stores: list[remote.RemoteCheckpoint], publish_to: str | None,
                  items: int | None, torch_needed: bool = True) -> TimeEstimate:
    """The time from now to the end of the conversion, as a range (`TimeEstimate`).

    A local source moving at least `PROBE_FROM` bytes is probed along the copy's own path (`path_probe`:
    direct reads of its largest files, CRC-32, direct writes beside the destination, several streams, at
    most about `PROBE_SECONDS`); a smaller one is not probed at all, its bytes taken at `SMALL_RATE`. A source
    in a store is probed by one ranged read (`store_probe`: its latency is most of a small checkpoint's
    time), the local write by `path_probe` without a source, and the upload of an output bound for a store
    by one put; those steps follow one another, so their times add."""
    import sys
    from reshard.engine.splice import default_threads

    cpu_lo, cpu_hi, slow_from = cpu_slowdown()
    parts: dict[str, tuple[float, float]] = {}
    probes: dict[str, Any] = {"read": None, "write": None, "crc": None, "probe": None}
    moved = max(read_bytes, needed)
    bound: str | None = None
    if stores or publish_to is not None or moved >= PROBE_FROM:
        room = free // 8 >= PROBE_BLOCK * 2
        files = [] if stores else data_files(sources)
        if room and (files or stores):
            pp = path_probe(files, checked, streams=default_threads(),
                            cap=min(PROBE_CAP, free // 8) if not stores else 8 * PROBE_BLOCK)
        else:
            pp = PathProbe(source=str(files[0]) if files else "(no local source)", folder=str(checked),
                           error="too little free space to probe" if not room else "no source file to read")
        probes["probe"] = pp.figures()
        probes["write"] = pp.part("write").figures()
        probes["crc"] = pp.part("crc").figures()
        text: list[str] = []
        if stores:
            r = store_probe(stores[0])
            probes["read"] = r.figures()
            w = pp.part("write")
            steps = [("store", read_bytes, r), ("write", needed, w)]
            text += [r.describe(), w.describe()]
        else:
            probes["read"] = pp.part("read").figures()
            steps = [(pp.bound or "copy", moved, Rate(f"copy of {pp.source} to {checked}", pp.nbytes, pp.seconds, pp.error))]
            text.append(f"{pp.streams} streams of direct reads, CRC-32 and direct writes moved "
                        f"{human_bytes(pp.nbytes)} in {pp.seconds * 1000:.0f} ms" if pp.error is None else
                        f"the copy probe: not measured ({pp.error})")
            if pp.error is None:
                text.append(", ".join(f"{n} {human_bytes(pp.part(n).per_second)}/s" for n in ("read", "crc", "write")))
        if publish_to is not None:  # bound for a store: made here, then sent there
            u = upload_probe(publish_to)
            probes["upload"] = u.figures()
            steps.append(("upload", needed, u))
            text.append(f"{human_bytes(needed)} to upload, {u.describe()}")
        measured = [(name, n / rate.per_second) for name, n, rate in steps if rate.per_second]
        if measured:
            t = sum(sec for _n, sec in measured)
            parts["bytes"] = (t * BYTES_SPREAD[0], t * BYTES_SPREAD[1])
            bound = max(measured, key=lambda m: m[1])[0]
        else:  # no probe worked: the fixed rate, said so
            parts["bytes"] = (0.0, moved / SMALL_RATE)
            text.append(f"no probe measured a rate: taken at {human_bytes(SMALL_RATE)}/s")
        basis = (f"{human_bytes(read_bytes)} to read, {human_bytes(needed)} to write; probed: " + "; ".join(text))
    else:
        parts["bytes"] = (0.0, moved / SMALL_RATE)
        basis = (f"{human_bytes(read_bytes)} to read, {human_bytes(needed)} to write: under "
                 f"{human_bytes(PROBE_FROM)}, so not probed; taken at a fixed {human_bytes(SMALL_RATE)}/s")
        probes["probe"] = {"skipped": f"under {human_bytes(PROBE_FROM)} to move"}
    if items:
        parts["items"] = (items * ITEM_SECONDS[0] * cpu_lo, items * ITEM_SECONDS[1] * cpu_hi)
    if torch_needed and "torch" not in sys.modules:
        parts["torch import"] = (TORCH_IMPORT_SECONDS[0] * cpu_lo, TORCH_IMPORT_SECONDS[1] * cpu_hi)
    parts["after"] = (TAIL_SECONDS[0] * cpu_lo, TAIL_SECONDS[1] * cpu_hi)
    basis += ((f"; {items} items" if items else "") + f"; CPU work x{cpu_lo:.1f}-{cpu_hi:.1f} an idle core's "
              f"({slow_from}); an estimate")
    try:
        load = round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover - not POSIX
        load = None
    return TimeEstimate(parts, basis, bound, probes, load, [round(cpu_lo, 2), round(cpu_hi, 2)])


@contextlib.contextmanager
def space_errors(dst: str | os.PathLike, needed: int, what: str) -> Iterator[None]:
    """A full destination inside the block reads as convert's (`reshard.storage.files.integrity.out_of_space`):
    destination, bytes needed, exit 2 (after ``--force``, or when the disk filled up meanwhile).

    Put it outside `atomic_directory`, so it sees the commit's own writes too and the temporary
    directory is already gone when the error is raised. ``torch.save`` reports a failed
    write as a RuntimeError whose cause is the OSError; that counts too.
    """
    from reshard.storage.files.integrity import is_space_error, out_of_space

    try:
        yield
    except (OSError, RuntimeError) as exc:
        cause = exc if isinstance(exc, OSError) else (exc.__cause__ or exc.__context__)
        if isinstance(cause, OSError) and is_space_error(cause):
            raise out_of_space(dst, needed, cause, what=what) from None
        raise


