"""Item checksums, destination space, and out-of-space errors.

**Checksums.** `reshard convert` records the sha256 of every item it writes (each tensor
chunk and each object, exactly as its bytes lie in the data file) in the output's
``manifest.json``::

    "integrity": {"algorithm": "sha256", "items": {"__0_0.distcp:0": "<hex>", ...}}

Items are named ``"{file}:{offset}"``, the byte range DCP's ``.metadata`` gives them; the
index maps a name back to its key. A flipped byte in a tensor's payload still loads (the
torch.save zip reader does not check CRCs) and may even be a plausible value, so without
checksums it is invisible; `inspect --deep` and `verify` check them when the manifest has
them (older manifests have none and stay valid) and name the first corrupt item by
(file, offset) order, with its key and file.

**Space.** `estimate_output_bytes(plan)` estimates what a conversion writes (tensor bytes
of every planned chunk plus the measured per-item ``torch.save`` overhead, object items,
``.metadata``); `space_check(plan, dst)` compares it with the free space of the file system
that will hold ``dst`` (the nearest existing ancestor; the temporary directory is created
beside ``dst``, so on the same file system). `out_of_space(...)` turns an ENOSPC / EFBIG /
EDQUOT ``OSError`` into a one-paragraph `BadInput` naming the destination and the bytes
needed.

This module only reads checkpoints (``reshard.io.dcp``); it imports no other reshard layer
at import time, so `reshard.index`, `reshard.verify` and `reshard.execute` can all use it.
"""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

from reshard.errors import BadInput

ALGORITHM = "sha256"
SPACE_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)

__all__ = ["ALGORITHM", "item_name", "record", "check_items", "IntegrityIssue", "first_issue_message",
           "estimate_output_bytes", "space_check", "is_space_error", "out_of_space"]


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


def record(checksums: dict[str, str]) -> dict[str, Any]:
    """The manifest's ``integrity`` value for a writer's ``checksums()``, items in (file, offset) order."""
    items = {k: checksums[k] for k in sorted(checksums, key=_split)}
    return {"algorithm": ALGORITHM, "items": items}


class IntegrityIssue(dict):
    """One finding: ``kind`` (``mismatch`` | ``unrecorded`` | ``unknown``), ``key``, ``file``,
    ``offset``, ``length``, ``expected``, ``actual`` (a dict, so it goes to JSON as is)."""


def _items(index: Any) -> Iterable[tuple[str, Any]]:
    """(key, location) of every stored item of a CheckpointIndex, in metadata order."""
    for e in index.entries.values():
        locs = [c.location for c in e.chunks] if e.is_tensor else [e.location]
        for loc in locs:
            if loc is not None:
                yield e.key, loc


def hash_item(root: Path, loc: Any, *, key: str) -> str:
    """sha256 of an item's stored bytes (still transformed: what the writer hashed)."""
    from reshard.io import dcp

    return hashlib.sha256(dcp.read_item_bytes(Path(root), loc, key=key)).hexdigest()


def check_items(index: Any, integrity: dict[str, Any] | None, *, progress: Any = None) -> list[IntegrityIssue]:
    """Hash every item the index names and compare with ``integrity`` (a manifest's field).

    Returns the issues sorted by (file, offset): ``mismatch`` first-class corruption,
    ``unrecorded`` (an item with no recorded checksum) and ``unknown`` (a checksum for a
    byte range the metadata does not name). An empty list when ``integrity`` is None.
    Raises the reader's error (Incomplete / BadInput) when an item's bytes are missing.
    """
    if not integrity:
        return []
    recorded: dict[str, str] = dict(integrity.get("items") or {})
    issues: list[IntegrityIssue] = []
    seen: set[str] = set()
    for key, loc in _items(index):
        name = item_name(loc.file, loc.offset)
        seen.add(name)
        want = recorded.get(name)
        base = {"key": key, "file": loc.file, "offset": int(loc.offset), "length": int(loc.length)}
        if want is None:
            issues.append(IntegrityIssue(kind="unrecorded", expected=None, actual=None, **base))
        else:
            got = hash_item(index.root, loc, key=key)
            if got != want:
                issues.append(IntegrityIssue(kind="mismatch", expected=want, actual=got, **base))
        if progress is not None:
            progress.update(1)
    for name in recorded:
        if name not in seen:
            file, off = _split(name)
            issues.append(IntegrityIssue(kind="unknown", key=None, file=file, offset=off, length=None,
                                         expected=recorded[name], actual=None))
    issues.sort(key=lambda i: (i["kind"] != "mismatch", i["file"], i["offset"]))
    return issues


def describe(issue: IntegrityIssue) -> str:
    if issue["kind"] == "mismatch":
        return (f"item '{issue['key']}' ({issue['file']} bytes [{issue['offset']}, {issue['offset'] + issue['length']})) "
                f"does not match the sha256 recorded in manifest.json: its bytes changed after they were written")
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
def _save_overhead() -> int:
    """Bytes ``torch.save`` adds around a tensor's payload (zip records, pickle, alignment)."""
    import io

    import torch

    b = io.BytesIO()
    torch.save(torch.empty(0, dtype=torch.float32), b)
    return len(b.getvalue())


def _numel(sizes: Iterable[int]) -> int:
    n = 1
    for s in sizes:
        n *= int(s)
    return n


def estimate_output_bytes(plan: Any, index: Any = None) -> int:
    """Bytes a conversion of ``plan`` writes: an estimate, usually within a few percent.

    Tensor chunks: elements x element size + the ``torch.save`` overhead per item. Carried
    objects: their stored size in the source. Rewritten and added objects: their pickled
    size + overhead. ``.metadata``: the source's (it scales with the number of items).
    ``manifest.json`` (~100 bytes per item checksum) and the reports (~400 bytes per key)
    plus a fixed 16 KiB.
    """
    import pickle

    import torch

    from reshard.index import CheckpointIndex

    ix = index if index is not None else CheckpointIndex.open(plan.source["path"], trust_pickle=plan.options.trust_pickle)
    over = _save_overhead()
    total = items = 0
    for t in plan.tensors:
        size = torch.empty((), dtype=getattr(torch, t.dtype)).element_size()
        for _rank, _offsets, sizes in t.chunks:
            total += _numel(sizes) * size + over
            items += 1
    tensor_keys = {t.key for t in plan.tensors}
    for a in plan.keys:
        if a.key in tensor_keys or a.action == "dropped":
            continue
        items += 1
        if a.action in ("rewritten", "added") and a.key in plan.new_values:
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


def _nearest_existing(path: Path) -> Path:
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def space_check(plan: Any, dst: str | os.PathLike, *, needed: int | None = None) -> dict[str, Any]:
    """Will the converted checkpoint fit where ``dst`` will be? Reads metadata only.

    Returns ``{"destination", "checked" (the existing directory whose file system was
    asked), "needed_bytes", "free_bytes", "enough", "warning"}``; ``warning`` is one
    paragraph (or None when there is enough space). With ``--overwrite`` the old output is
    removed only after the new one is in place, so the full amount is needed either way.
    """
    from reshard.report import human_bytes

    dst = Path(os.path.abspath(os.fspath(dst)))
    probe = _nearest_existing(dst.parent if not dst.is_dir() else dst)
    need = estimate_output_bytes(plan) if needed is None else int(needed)
    free = shutil.disk_usage(probe).free
    enough = free >= need
    warning = None
    if not enough:
        warning = (f"{dst}: the destination's file system has {human_bytes(free)} ({free} bytes) free at {probe}, "
                   f"but the converted checkpoint needs about {human_bytes(need)} ({need} bytes); convert would stop "
                   "with nothing committed. Free space there or choose another destination.")
    return {"destination": str(dst), "checked": str(probe), "needed_bytes": need, "free_bytes": free,
            "enough": enough, "warning": warning}


def is_space_error(exc: BaseException) -> bool:
    """An OSError saying the destination is full (ENOSPC), over a size limit (EFBIG) or quota (EDQUOT)."""
    return isinstance(exc, OSError) and exc.errno in SPACE_ERRNOS


def out_of_space(dst: str | os.PathLike, needed: int, exc: OSError) -> BadInput:
    """The one-paragraph error for a conversion that ran out of space (exit 2)."""
    from reshard.report import human_bytes

    dst = Path(os.path.abspath(os.fspath(dst)))
    why = {errno.ENOSPC: "the file system is full",
           errno.EFBIG: "a file grew beyond the allowed size (the process file-size limit, `ulimit -f`, or the file system's maximum)",
           errno.EDQUOT: "the disk quota is exhausted"}.get(exc.errno, os.strerror(exc.errno or 0))
    try:
        free = f"; {human_bytes(shutil.disk_usage(_nearest_existing(dst.parent)).free)} are free there now"
    except OSError:
        free = ""
    return BadInput(
        f"out of space writing the converted checkpoint: {why} ({os.strerror(exc.errno or 0)}). "
        f"The output needs about {human_bytes(needed)} ({needed} bytes){free}.",
        where=str(dst),
        hint="Nothing was committed and the temporary directory was removed. Free space (or raise the limit) "
             "on the destination's file system, or choose another destination, then run the same command again; "
             "`reshard plan` estimates the space in advance.",
    )
