"""How much a conversion writes, and whether it fits where it goes: from the plan and the
source's metadata only, so `reshard plan --dst` can warn before any byte is written and
`convert` can name the size when a disk fills up."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable
import shutil

from reshard.storage import dcp_writer
from reshard.storage.index import CheckpointIndex
from reshard.storage.integrity import nearest_existing
from reshard.units import human_bytes


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

    Tensor chunks: elements x element size + the ``torch.save`` overhead per item (+ one
    block of alignment padding for storages the writer aligns). Carried
    objects: their stored size in the source. Rewritten and added objects: their pickled
    size + overhead. ``.metadata``: the source's (it scales with the number of items).
    ``manifest.json`` (~100 bytes per item checksum) and the reports (~400 bytes per key)
    plus a fixed 16 KiB.
    """
    import pickle

    import torch

    ix = index if index is not None else CheckpointIndex.open(plan.source["path"], trust_pickle=plan.options.trust_pickle)
    over = _save_overhead()
    total = items = 0
    for t in plan.tensors:
        size = torch.empty((), dtype=getattr(torch, t.dtype)).element_size()
        for _rank, _offsets, sizes in t.chunks:
            nbytes = _numel(sizes) * size
            # a storage this large starts block-aligned: up to one block of padding before it
            total += nbytes + over + (dcp_writer.ALIGN if nbytes >= dcp_writer.ALIGN_FROM else 0)
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


def space_check(plan: Any, dst: str | os.PathLike, *, needed: int | None = None) -> dict[str, Any]:
    """Will the converted checkpoint fit where ``dst`` will be? Reads metadata only.

    Returns ``{"destination", "checked" (the existing directory whose file system was
    asked), "needed_bytes", "free_bytes", "enough", "warning"}``; ``warning`` is one
    paragraph (or None when there is enough space). With ``--overwrite`` the old output is
    removed only after the new one is in place, so the full amount is needed either way.
    """
    dst = Path(os.path.abspath(os.fspath(dst)))
    probe = nearest_existing(dst.parent if not dst.is_dir() else dst)
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
