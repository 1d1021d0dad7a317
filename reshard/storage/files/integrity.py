"""Item checksums, destination space, and out-of-space errors.

**Checksums.** `reshard convert` records a checksum of every item it writes (each tensor
chunk and each object, exactly as its bytes lie in the data file) in the output's
``manifest.json``::

    "integrity": {"algorithm": "crc32", "items": {"__0_0.distcp:0": "<hex>", ...}}

Two algorithms are known (``ALGORITHMS``): ``"crc32"`` (``format(crc32(item), "08x")``,
8 hex digits; what convert writes now: it detects flipped bytes and runs at memory speed)
and ``"sha256"`` (``hashlib.sha256(item).hexdigest()``, 64 hex digits; older manifests).
A record with any other algorithm is refused (`BadInput`), never passed unchecked.
Items are named ``"{file}:{offset}"``, the byte range DCP's ``.metadata`` gives them; the
index maps a name back to its key. A flipped byte in a tensor's payload still loads (the
torch.save zip reader does not check CRCs) and may even be a plausible value, so without
checksums it is invisible; `inspect --deep` and `verify` check them when the manifest has
them (older manifests have none and stay valid) and name the first corrupt item by
(file, offset) order, with its key and file.

`check_items` reads the items in (file, offset) order with ``os.preadv`` into a few
reusable buffers (several small neighbouring items in one read, a large item in slabs),
and hashes in a small thread pool (``fileio.crc32``, native, and ``hashlib`` release the GIL on large
buffers), so memory stays at ``workers x slab`` whatever the checkpoint's size.

**Space.** `estimate_output_bytes(plan)` estimates what a conversion writes (tensor bytes
of every planned chunk plus the measured per-item ``torch.save`` overhead, object items,
``.metadata``); `space_check(plan, dst)` compares it with the free space of the file system
that will hold ``dst`` (the nearest existing ancestor; the temporary directory is created
beside ``dst``, so on the same file system). `out_of_space(...)` turns an ENOSPC / EFBIG /
EDQUOT ``OSError`` into a one-paragraph `BadInput` naming the destination and the bytes
needed.

This module only reads checkpoints (``reshard.storage.checkpoints.dcp``); it imports no other reshard layer
at import time, so `reshard.storage.checkpoints.index`, `reshard.verification.checkpoints` and `reshard.engine.conversion` can all use it.
"""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from reshard.errors import BadInput, Incomplete
from reshard.storage.files.fileio import FdCache, crc32

if TYPE_CHECKING:  # handed in with the index that reads it
    from reshard.storage.objectstore.remote import RemoteCheckpoint

ALGORITHM = "sha256"  # the default of `record` (kept for callers that name no algorithm)
ALGORITHMS = ("sha256", "crc32")
DIGEST_HEX_DIGITS = {"sha256": 64, "crc32": 8}  # length of a recorded value (lowercase hex)
SPACE_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
SLAB_BYTES = 16 << 20           # one read of check_items (per worker)
BATCH_ITEMS = 4096              # at most this many small items per read

__all__ = ["nearest_existing", "ALGORITHM", "ALGORITHMS", "DIGEST_HEX_DIGITS", "item_name", "record", "check_items", "hash_item",
           "digest", "new_hasher", "check_algorithm", "item_bytes", "IntegrityIssue", "describe", "first_issue_message",
           "is_space_error", "out_of_space"]


# ---------------------------------------------------------------------------- checksums
def item_name(file: str, offset: int) -> str:
    """The name of an item in ``integrity.items``: ``"{file}:{offset}"``."""
    return f"{file}:{int(offset)}"


def _split(name: str) -> tuple[str, int]:
    file, _, off = name.rpartition(":")
    try:
        return file, int(off)
    except ValueError:
        return name, -1


def record(checksums: dict[str, str], algorithm: str = ALGORITHM) -> dict[str, Any]:
    """The manifest's ``integrity`` value for a writer's ``checksums()`` (computed with
    ``algorithm``, one of ``ALGORITHMS``), items in (file, offset) order."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown checksum algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")
    items = {k: checksums[k] for k in sorted(checksums, key=_split)}
    return {"algorithm": algorithm, "items": items}


def check_algorithm(integrity: dict[str, Any], *, where: str | os.PathLike | None = None) -> str:
    """The ``algorithm`` of an ``integrity`` record, or `BadInput` when reshard does not know it."""
    alg = integrity.get("algorithm")
    if alg not in ALGORITHMS:
        raise BadInput(f"manifest.json records item checksums with algorithm {alg!r}, which reshard does not know "
                       f"(known: {', '.join(ALGORITHMS)}); the items cannot be checked",
                       where=None if where is None else str(where),
                       hint="Upgrade reshard, or remove the manifest's `integrity` field to skip the check.")
    return alg


class _Crc32:
    """`hashlib`-like running CRC-32 (``hexdigest()`` is ``format(crc, "08x")``)."""

    name = "crc32"

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = crc32(data, self.value)

    def hexdigest(self) -> str:
        return format(self.value & 0xFFFFFFFF, "08x")


def new_hasher(algorithm: str) -> Any:
    """A fresh incremental hasher (``update(bytes-like)``, ``hexdigest()``) for ``algorithm``."""
    if algorithm == "crc32":
        return _Crc32()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown checksum algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")


def digest(data: Any, algorithm: str) -> str:
    """The recorded form (lowercase hex) of ``algorithm`` over ``data`` (any bytes-like object)."""
    h = new_hasher(algorithm)
    h.update(data)
    return h.hexdigest()


class IntegrityIssue(dict):
    """One finding: ``kind`` (``mismatch`` | ``unrecorded`` | ``unknown``), ``key``, ``file``,
    ``offset``, ``length``, ``expected``, ``actual`` and ``algorithm`` (may be absent; a dict,
    so it goes to JSON as is)."""


def _items(index: Any) -> Iterable[tuple[str, Any]]:
    """(key, location) of every stored item of a CheckpointIndex, in metadata order."""
    for e in index.entries.values():
        locs = [c.location for c in e.chunks] if e.is_tensor else [e.location]
        for loc in locs:
            if loc is not None:
                yield e.key, loc


def item_bytes(index: Any) -> int:
    """The stored bytes of every item `check_items` reads (what its progress counts to)."""
    return sum(int(loc.length) for _, loc in _items(index))


def hash_item(root: Path, loc: Any, *, key: str, algorithm: str = ALGORITHM, rc: RemoteCheckpoint | None = None) -> str:
    """The checksum (``algorithm``, default sha256) of an item's stored bytes (still
    transformed: what the writer hashed); ``rc``: the store ``root`` stands for, which the bytes come from."""
    from reshard.storage.checkpoints import dcp

    return digest(dcp.read_item_bytes(Path(root), loc, key=key, rc=rc), algorithm)


def _default_workers() -> int:
    return max(2, min(4, os.cpu_count() or 2))


def _batches(todo: list[tuple[str, Any, str]], slab: int) -> Iterator[list[tuple[str, Any, str]]]:
    """Group (key, loc, want) sorted by (file, offset) into reads: neighbours of one file whose
    span fits in ``slab`` share a read; a larger item is a batch of its own (hashed in slabs)."""
    cur: list[tuple[str, Any, str]] = []
    start = 0
    for t in todo:
        loc = t[1]
        end = int(loc.offset) + int(loc.length)
        if cur and (loc.file != cur[0][1].file or end - start > slab or len(cur) >= BATCH_ITEMS
                    or int(loc.offset) < start):
            yield cur
            cur = []
        if not cur:
            start = int(loc.offset)
        cur.append(t)
    if cur:
        yield cur


def _read_into(fd: int, view: memoryview, pos: int) -> int:
    """Fill ``view`` from ``pos`` (several preadv calls if the kernel returns less); bytes read."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], pos + done)
        if n <= 0:
            break
        done += n
    return done


class _Reader(FdCache):
    """Per-thread reusable buffer and open files for `check_items` (a missing file is `Incomplete`)."""

    def __init__(self, root: Path, slab: int):
        super().__init__()
        self.root, self.slab = root, slab
        self.local = threading.local()

    def buffer(self) -> memoryview:
        buf = getattr(self.local, "buf", None)
        if buf is None:
            buf = self.local.buf = memoryview(bytearray(self.slab))
        return buf

    def item_fd(self, file: str, key: str) -> int:
        """The descriptor of data file ``file``; a missing or unreadable file names ``key``."""
        try:
            return self.fd(self.root / file)
        except FileNotFoundError:
            raise Incomplete(f"data file '{file}' is missing (needed for '{key}')", where=str(self.root),
                             hint="The checkpoint is incomplete; restore the file or use another checkpoint.") from None
        except OSError as exc:
            raise BadInput(f"cannot read '{key}': {exc}", where=str(self.root / file)) from None

    def short(self, key: str, loc: Any, got_end: int) -> Incomplete:
        return Incomplete(f"'{key}' needs bytes [{loc.offset}, {loc.offset + loc.length}) but the file ends at {got_end}",
                          where=str(self.root / loc.file), hint="The data file is truncated; the checkpoint is incomplete.")

    def hash_batch(self, batch: list[tuple[str, Any, str]], algorithm: str) -> list[str]:
        """Checksums of the items of one batch (see `_batches`).

        An item whose checksum matches the manifest is also checked against the CRC-32s its
        zip records (`reshard.storage.checkpoints.fastread.check_item_crcs`, on the bytes already in the
        buffer): bytes that were corrupt before the manifest was written are `CorruptItem`.
        A checksum that does not match is left to the caller, which names it.
        """
        from reshard.storage.checkpoints.fastread import MemberCrcs, check_item_crcs, item_members_at

        key0, loc0, _ = batch[0]
        fd = self.item_fd(loc0.file, key0)
        buf = self.buffer()
        start = int(loc0.offset)
        span = max(int(loc.offset) + int(loc.length) for _, loc, _ in batch) - start
        try:
            if span <= len(buf):
                got = _read_into(fd, buf[:span], start)
                out = []
                for key, loc, want in batch:
                    a = int(loc.offset) - start
                    if a + int(loc.length) > got:
                        raise self.short(key, loc, start + got)
                    item = buf[a:a + int(loc.length)]
                    d = digest(item, algorithm)
                    if d == want and not loc.transforms:
                        check_item_crcs(item, key=key, where=str(self.root / loc.file))
                    out.append(d)
                return out
            (key, loc, want), = batch  # a single item larger than the buffer: hash it in slabs
            h = new_hasher(algorithm)
            pos, left = int(loc.offset), int(loc.length)
            members = None if loc.transforms else item_members_at(self.root / loc.file, pos, left, root=self.root)
            crcs = MemberCrcs(members, key=key, where=str(self.root / loc.file)) if members is not None else None
            while left:
                n = min(left, len(buf))
                got = _read_into(fd, buf[:n], pos)
                if got != n:
                    raise self.short(key, loc, pos + got)
                h.update(buf[:n])
                if crcs is not None:
                    crcs.update(pos - int(loc.offset), buf[:n])
                pos += n
                left -= n
            d = h.hexdigest()
            if crcs is not None and d == want:
                crcs.finish()
            return [d]
        except OSError as exc:
            raise BadInput(f"cannot read '{key0}': {exc}", where=str(self.root / loc0.file)) from None


def check_items(index: Any, integrity: dict[str, Any] | None, *, progress: Any = None,
                workers: int | None = None, slab_bytes: int = SLAB_BYTES,
                digests: dict[str, str] | None = None) -> list[IntegrityIssue]:
    """Hash every item the index names and compare with ``integrity`` (a manifest's field).

    The record's ``algorithm`` decides the checksum (``ALGORITHMS``: sha256 or crc32); an
    unknown one is `BadInput` (the items could not be checked; never a silent pass).
    Returns the issues sorted by (file, offset): ``mismatch`` first-class corruption,
    ``unrecorded`` (an item with no recorded checksum) and ``unknown`` (a checksum for a
    byte range the metadata does not name). An empty list when ``integrity`` is None.
    Raises Incomplete / BadInput when an item's bytes are missing or unreadable.

    Items are read in (file, offset) order with ``os.preadv`` into one reusable buffer of
    ``slab_bytes`` per worker thread (``workers``, default 2-4) and hashed there, so memory
    does not grow with the checkpoint. ``progress.update(nbytes)`` counts the items' stored
    bytes (`item_bytes` is the total), from the calling thread. ``digests`` (``"file:offset"`` -> checksum in the record's algorithm)
    are checksums some other pass already computed while reading those items (e.g.
    `reshard.verification.compare`); those items are not read again.
    """
    if not integrity:
        return []
    root = Path(index.root)
    algorithm = check_algorithm(integrity, where=root / "manifest.json")
    recorded: dict[str, str] = dict(integrity.get("items") or {})
    known = digests or {}
    issues: list[IntegrityIssue] = []
    seen: set[str] = set()
    todo: list[tuple[str, Any, str]] = []
    for key, loc in _items(index):
        name = item_name(loc.file, loc.offset)
        seen.add(name)
        want = recorded.get(name)
        if want is None:
            issues.append(IntegrityIssue(kind="unrecorded", expected=None, actual=None, algorithm=algorithm,
                                         **_base(key, loc)))
            if progress is not None:
                progress.update(int(loc.length))
        elif name in known:
            if known[name] != want:
                issues.append(IntegrityIssue(kind="mismatch", expected=want, actual=known[name], algorithm=algorithm,
                                             **_base(key, loc)))
            if progress is not None:
                progress.update(int(loc.length))
        else:
            todo.append((key, loc, want))
    todo.sort(key=lambda t: (t[1].file, int(t[1].offset)))
    nw = max(1, int(workers or _default_workers()))
    rc = getattr(index, "remote", None)  # the store the index reads, handed to it when it was opened
    if rc is not None:  # a checkpoint in object storage: each item's range fetched ahead (bounded), hashed here
        with rc.prefetching(((loc.file, int(loc.offset), int(loc.length)) for _k, loc, _w in todo), in_flight=nw,
                            memory=4 * nw * max(64, int(slab_bytes)), label="checksums"):
            for key, loc, want in todo:
                got = hash_item(root, loc, key=key, algorithm=algorithm, rc=rc)
                if got != want:
                    issues.append(IntegrityIssue(kind="mismatch", expected=want, actual=got, algorithm=algorithm,
                                                 **_base(key, loc)))
                if progress is not None:
                    progress.update(int(loc.length))
        todo = []
    reader = _Reader(root, max(64, int(slab_bytes)))
    try:
        with ThreadPoolExecutor(max_workers=nw, thread_name_prefix="reshard-integrity") as pool:
            # a bounded window of batches in flight: results are a few hex strings each
            batches = _batches(todo, reader.slab)
            window: list[tuple[list, Any]] = []

            def drain_one() -> None:
                batch, fut = window.pop(0)
                for (key, loc, want), got in zip(batch, fut.result()):
                    if got != want:
                        issues.append(IntegrityIssue(kind="mismatch", expected=want, actual=got, algorithm=algorithm,
                                                     **_base(key, loc)))
                if progress is not None:
                    progress.update(sum(int(t[1].length) for t in batch))

            try:
                for batch in batches:
                    window.append((batch, pool.submit(reader.hash_batch, batch, algorithm)))
                    if len(window) >= 4 * nw:
                        drain_one()
                while window:
                    drain_one()
            finally:
                for _, fut in window:
                    fut.cancel()
    finally:
        reader.close()
    for name in recorded:
        if name not in seen:
            file, off = _split(name)
            issues.append(IntegrityIssue(kind="unknown", key=None, file=file, offset=off, length=None,
                                         expected=recorded[name], actual=None, algorithm=algorithm))
    issues.sort(key=lambda i: (i["kind"] != "mismatch", i["file"], i["offset"]))
    return issues


def _base(key: str, loc: Any) -> dict[str, Any]:
    return {"key": key, "file": loc.file, "offset": int(loc.offset), "length": int(loc.length)}


def describe(issue: IntegrityIssue) -> str:
    if issue["kind"] == "mismatch":
        return (f"item '{issue['key']}' ({issue['file']} bytes [{issue['offset']}, {issue['offset'] + issue['length']})) "
                f"does not match the {issue.get('algorithm') or 'checksum'} recorded in manifest.json: "
                "its bytes changed after they were written")
    if issue["kind"] == "unrecorded":
        return (f"item '{issue['key']}' ({issue['file']} at offset {issue['offset']}) has no checksum in manifest.json, "
                "which records checksums for this checkpoint's items: .metadata no longer matches the manifest")
    return (f"manifest.json records a checksum for {issue['file']} at offset {issue['offset']}, "
            "an item .metadata does not name: .metadata no longer matches the manifest")


def first_issue_message(issues: list[IntegrityIssue]) -> str:
    """One sentence naming the first corrupt item (and how many more there are)."""
    bad = [i for i in issues if i["kind"] == "mismatch"] or issues
    more = f" ({len(bad) - 1} more item{'s' if len(bad) > 2 else ''} also fail{'s' if len(bad) == 2 else ''})" if len(bad) > 1 else ""
    return describe(bad[0]) + more


# ---------------------------------------------------------------------------- space
@lru_cache(maxsize=None)
def nearest_existing(path: Path) -> Path:
    """The path itself or its nearest ancestor that exists (where a new output's file system is asked)."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def is_space_error(exc: BaseException) -> bool:
    """An OSError saying the destination is full (ENOSPC), over a size limit (EFBIG) or quota (EDQUOT)."""
    return isinstance(exc, OSError) and exc.errno in SPACE_ERRNOS


def out_of_space(dst: str | os.PathLike, needed: int, exc: OSError, *, what: str = "the converted checkpoint") -> BadInput:
    """The one-paragraph error for a conversion (or an export: ``what``) that ran out of space (exit 2)."""
    from reshard.units import human_bytes

    dst = Path(os.path.abspath(os.fspath(dst)))
    why = {errno.ENOSPC: "the file system is full",
           errno.EFBIG: "a file grew beyond the allowed size (the process file-size limit, `ulimit -f`, or the file system's maximum)",
           errno.EDQUOT: "the disk quota is exhausted"}.get(exc.errno, os.strerror(exc.errno or 0))
    try:
        free = f"; {human_bytes(shutil.disk_usage(nearest_existing(dst.parent)).free)} are free there now"
    except OSError:
        free = ""
    return BadInput(
        f"out of space writing {what}: {why} ({os.strerror(exc.errno or 0)}). "
        f"The output needs about {human_bytes(needed)} ({needed} bytes){free}.",
        where=str(dst),
        hint="Nothing was committed and the temporary directory was removed. Free space (or raise the limit) "
             "on the destination's file system, or choose another destination, then run the same command again"
             + ("; `reshard plan` estimates the space in advance." if what == "the converted checkpoint" else "."),
    )
