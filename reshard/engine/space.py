"""How much a conversion writes, whether it fits where it goes, and about how long it takes.

The size comes from the plan and the source's metadata only, so `reshard plan --dst` can
warn and `convert`, `export` and `import` can refuse (exit 2, both figures named) before any
byte is written: a terabyte conversion that fills a shared disk after an hour harms more
than the run. ``--force`` goes ahead anyway (a full disk then stops it with nothing
committed). The time is an estimate from the bytes to move and two short probes (a read of
the source, a write beside the destination, removed after), recorded with its basis.
``RESHARD_FREE_BYTES`` overrides the free space the file system reports (`free_bytes`).
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import time
from dataclasses import dataclass
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
from reshard.model.kinds import Action


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
        if a.key in tensor_keys or a.action == Action.DROPPED:
            continue
        items += 1
        if a.action in (Action.REWRITTEN, Action.ADDED) and a.key in plan.new_values:
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
                        probe=probe, stores=_stores(ix))
    if not figures["enough"]:
        figures["warning"] = (
            f"{figures['destination']}: the destination's file system has {human_bytes(figures['free_bytes'])} "
            f"({figures['free_bytes']} bytes) free at {figures['checked']}, but the converted checkpoint needs about "
            f"{human_bytes(need)} ({need} bytes); convert would refuse it (exit 2) unless given --force. Free space "
            "there or choose another destination.")
    return figures


def conversion_read_bytes(plan: Any, ix: Any) -> int:
    """The source bytes a conversion reads: the logical bytes of every key the plan keeps (what
    convert's "writing" phase counts, `reshard.engine.copy.writing_bytes`)."""
    dropped = {a.key for a in plan.keys if a.action == Action.DROPPED}
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
                        stores=_stores(ix), publish_to=publish_to)
    if kept is not None:
        figures["read_cache_bytes"] = kept
    return figures


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
PROBE_BYTES = 4 << 20  # what the read and write probes move: long enough to time, short enough to be free
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


def largest_file(paths: Iterable[str | os.PathLike]) -> Path | None:
    """The largest regular file among ``paths`` (directories: the files directly in them), for the read probe."""
    best: tuple[int, Path] | None = None
    for p in paths:
        p = Path(p)
        for f in (sorted(p.iterdir()) if p.is_dir() else [p]):
            try:
                if f.is_file() and not f.is_symlink():
                    size = f.stat().st_size
                    if best is None or size > best[0]:
                        best = (size, f)
            except OSError:
                continue
    return best[1] if best else None


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


def read_probe(source: Path | None, nbytes: int = PROBE_BYTES) -> Rate:
    """Read up to ``nbytes`` of ``source`` (opened read-only; nothing in the source is changed).

    The range is first dropped from the page cache where the kernel allows (a hint that
    changes no byte), so the probe times the disk rather than memory when the source is not
    in use; on a file system without a page cache of its own (tmpfs) it times memory.
    """
    if source is None:
        return Rate("read", error="no source file to read")
    what = f"read of {source}"
    try:
        fd = os.open(source, os.O_RDONLY)
    except OSError as exc:
        return Rate(what, error=exc.strerror or str(exc))
    try:
        n = min(nbytes, os.fstat(fd).st_size)
        if n <= 0:
            return Rate(what, error="the file is empty")
        if hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(fd, 0, n, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
        t = time.perf_counter()
        got = 0
        while got < n:
            chunk = os.pread(fd, min(1 << 20, n - got), got)
            if not chunk:
                break
            got += len(chunk)
        return Rate(what, got, time.perf_counter() - t)
    except OSError as exc:
        return Rate(what, error=exc.strerror or str(exc))
    finally:
        os.close(fd)


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


def write_probe(folder: Path, nbytes: int = PROBE_BYTES) -> Rate:
    """Write ``nbytes`` to a hidden file in ``folder`` (an existing directory: nothing is created
    for the destination), fsync it, time it, and remove it, whatever happens."""
    what = f"write to {folder}"
    path = folder / f".reshard-probe-{os.getpid()}-{secrets.token_hex(4)}"
    block = secrets.token_bytes(min(nbytes, 1 << 20))  # not zeros: a compressing file system would time nothing
    try:
        t = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            done = 0
            while done < nbytes:
                done += os.write(fd, block[: nbytes - done])
            os.fsync(fd)
        finally:
            os.close(fd)
        return Rate(what, done, time.perf_counter() - t)
    except OSError as exc:
        return Rate(what, error=exc.strerror or str(exc))
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


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
              publish_to: str | None = None) -> dict[str, Any]:
    """Before the first byte: will the output fit at ``dst``, and about how long will it take?

    ``stores``: the sources in object storage (their `RemoteCheckpoint`), whose read is probed instead of a file's.
    ``publish_to``: the store URL an output made at ``dst`` is then uploaded to (its upload is probed too).

    Refuses (`BadInput`, exit 2) when the destination's file system has less free space than
    the output ``needed``, naming both figures, unless ``force``: nothing has been written
    then (no temporary directory, no probe). Otherwise times a read of the largest file of
    ``sources`` and a write (fsynced, then removed) beside the destination, and estimates
    the copy as ``read_bytes`` at the read rate plus ``needed`` at the write rate: an
    estimate, whose basis is recorded with it (caches, other users of the disks and the
    verification make the real time differ). With ``--overwrite`` the old output is removed
    only after the new one is in place, so the full amount is needed either way.

    Returns the figures (JSON data) that `plan --dst`, the first lines of a command and its
    report all show: ``destination, checked, needed_bytes, free_bytes, free_from, enough,
    forced, read_bytes, seconds, read, write, basis, warning``.
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
        "seconds": None, "read": None, "write": None, "basis": None, "warning": None}
    short = (f"destination {dst} has {human_bytes(free)} free ({free} bytes, from {free_from} at {checked}), "
             f"{what} writes about {human_bytes(need)} ({need} bytes)")
    if not enough:
        if not force:
            raise BadInput(short, hint="Nothing was written. Free space there, choose another destination (DST), or "
                                       "pass --force to go ahead anyway (a full disk then stops it with nothing "
                                       "committed)")
        figures["warning"] = short + "; going ahead (--force)"
    exact_seconds: float | None = None
    if probe:
        stores = list(stores)
        r = store_probe(stores[0]) if stores else read_probe(largest_file(sources))
        w = write_probe(checked, min(PROBE_BYTES, free // 8)) if free // 8 >= 64 << 10 else \
            Rate(f"write to {checked}", error="too little free space to probe")
        figures["read"] = {"bytes": r.nbytes, "seconds": round(r.seconds, 6), "error": r.error, "file": r.what}
        figures["write"] = {"bytes": w.nbytes, "seconds": round(w.seconds, 6), "error": w.error, "file": w.what}
        parts = []
        if r.per_second:
            parts.append(read_bytes / r.per_second)
        if w.per_second:
            parts.append(need / w.per_second)
        url = publish_to
        if url is not None:  # bound for a store: made here, then sent there
            u = upload_probe(url)
            figures["upload"] = {"bytes": u.nbytes, "seconds": round(u.seconds, 6), "error": u.error, "file": u.what}
            if u.per_second:
                parts.append(need / u.per_second)
        if parts:
            exact_seconds = sum(parts)
            figures["seconds"] = round(exact_seconds, 3)
        up = f"; {human_bytes(need)} to upload, {u.describe()}" if url is not None else ""
        figures["basis"] = (f"{human_bytes(read_bytes)} to read, {human_bytes(need)} to write, at the rates of "
                            f"{'three' if up else 'two'} probes ({r.describe()}; {w.describe()}{up}); the copy only, an estimate")
    if progress is not None:
        progress.say(space_line(figures))
        if hasattr(progress, "estimated"):  # the estimate printed before the work (convert: on stdout, even on a pipe)
            progress.estimated(figures)
        # the copy's ETA from its first second; from the unrounded estimate, which a small copy on a
        # fast disk would round to 0.0 s (and so lose its ETA)
        if exact_seconds is not None and hasattr(progress, "expect"):
            progress.expect("copy", read_bytes / max(exact_seconds, 1e-6))
    return figures


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


