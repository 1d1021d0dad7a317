"""`--data link`: which conversions can keep the source's tensor bytes where they are, and what each target rank reads then.

DCP finds every item it loads through ``.metadata``: a key and a chunk's offsets name a
file, a byte range and the chunk's box, and the loader reads each saved chunk that
overlaps the box a rank asks for, whole, and narrows it to the overlap
(``FileSystemReader.read_data`` loads the item, then ``narrow_tensor_by_index``). A
checkpoint whose ``.metadata`` lists the *source's* chunks therefore loads at any layout
whose global view is the source's, whatever the new ranks' boxes are. A conversion that
changes no tensor's global values (a DP change, a plain TP or PP re-cut of tensors with a
TP-independent global view) can leave every tensor chunk in the source's data files, shared
into the output by reflink or hard link (`reshard.storage.files.linkfs`), and write new only
what changes: the rewritten and added keys (per-rank RNG and loader state, schedule
counters), ``.metadata`` and the manifest.

What needs new bytes is refused, each with its reason: a fused or padded layout
re-interleaved or re-padded for a new TP degree, a dtype cast (``--dtype``), a reduced copy
(``--only``: sharing the full files would not make it smaller), a tied copy the source did
not save, and ``--output-format local`` (another format). The plan shows the verdict
(`link_summary`) and, per target rank, the items, files and bytes its ``dcp.load`` reads
under link mode next to the bytes it keeps: with shards that are not re-cut, a target rank
whose box spans two saved chunks reads both whole (4 -> 3 ranks: rank 1 reads half of each
tensor to keep a third), where copy mode's rank reads its own chunk only.

This module comes before `plan` in the commands' order: it takes the plan and the source
index as plain objects (attributes ``keys``, ``tensors``, ``options``, ``target``) and
imports neither ``plan`` nor ``convert``, so both can call it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reshard.model.checkpoint import ChunkTable
from reshard.model.layout import rank_boxes
from reshard.model.kinds import DataMode
from reshard.storage.checkpoints.index import RANK_FILE, ColumnChunks

__all__ = ["DATA_MODES", "LinkLayout", "link_layout", "link_summary", "linked_name", "new_file_namer", "overlaps", "SHARED_NOTE"]

DATA_MODES = tuple(DataMode)
LINK_PREFIX = "linked"
SHARED_NOTE = ("data files are shared with the source: a hard link is the same inode (a later in-place write to "
               "the source's file changes this checkpoint too), a reflink is an independent copy-on-write clone; "
               "never modify the source in place (delete or rename it freely: a hard link keeps the bytes alive)")
_MAX_REASONS = 8


@dataclass
class LinkLayout:
    """What `--data link` does with each source key: tensors and objects whose items stay in
    the source's files (``linked``), keys written new (``new``), the source files the output
    needs (``files``), and why linking is refused (``reasons``; empty when available)."""

    reasons: list[str] = field(default_factory=list)
    linked_tensors: list[str] = field(default_factory=list)
    linked_objects: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)

    @property
    def available(self) -> bool:
        return not self.reasons


def linked_name(source_file: str) -> str:
    """The name of a shared source file inside the output.

    A DCP rank file (``__3_0.distcp``) is renamed (``linked__3_0.distcp``): its name would
    say that rank 3 wrote it, and a 2-rank output holding a rank-3 file reads as a topology
    mismatch. Other names (a shared file of an earlier ``--data link`` output) are kept.
    """
    return f"{LINK_PREFIX}{source_file}" if RANK_FILE.match(source_file) else source_file


def new_file_namer(taken: set[str]) -> Any:
    """rank -> the name of the output's own data file for that rank (``__reshard_N_<rank>.distcp``),
    with N the first number no shared file uses, so a chain of link conversions never collides."""
    pat = re.compile(r"^__reshard_(\d+)_\d+\.distcp$")
    used = {int(m.group(1)) for m in map(pat.match, taken) if m}
    n = next(i for i in range(len(used) + 1) if i not in used)
    return lambda rank: f"__reshard_{n}_{int(rank)}.distcp"


def link_layout(plan: Any, ix: Any, *, output_format: str = "dcp") -> LinkLayout:
    """Decide, key by key, what `--data link` shares and what it writes (see the module docstring)."""
    out = LinkLayout()
    opts = plan.options
    from reshard.storage.checkpoints.hf_dcp import HfDcpIndex

    if isinstance(ix, HfDcpIndex):  # its tensors are raw safetensors bytes, which no DCP item can point at
        out.reasons.append(f"the source is torch's safetensors-backed DCP ({ix.version}): its files hold no DCP "
                           "items to share")
    if output_format != "dcp":
        out.reasons.append(f"--output-format {output_format} writes another format: there are no DCP items to share")
    if getattr(opts, "dtype", None):
        out.reasons.append(f"--dtype {opts.dtype} casts tensors: every cast tensor needs new bytes")
    if getattr(opts, "only", None):
        out.reasons.append(f"--only {opts.only} asks for a reduced copy: sharing the source's full data files would "
                           "not make it smaller")
    planned = {t.key: t for t in plan.tensors}
    files: set[str] = set()
    in_columns: dict[int, tuple[Any, np.ndarray]] = {}  # id of an index's columns -> (them, which of their rows are linked)
    refused_keys: list[str] = []
    for a in plan.keys:
        if a.left_out:
            continue
        if a.new_value:
            t = planned.get(a.key)
            if t is not None and t.copy_from:
                refused_keys.append(f"'{a.key}' is a tied copy the source did not save (its values come from "
                                    f"'{t.copy_from}'): it needs new bytes")
            else:
                out.new.append(a.key)
            continue
        e = ix.entries[a.key]
        if not e.is_tensor:
            out.linked_objects.append(a.key)
            if e.location is not None:
                files.add(e.location.file)
            continue
        t = planned[a.key]
        why = _needs_new_bytes(t, e)
        if why:
            refused_keys.append(f"'{a.key}' {why}")
            continue
        out.linked_tensors.append(a.key)
        tab = e.chunks
        if isinstance(tab, ColumnChunks):  # its files with every other table's of the index, at the end
            got = in_columns.get(id(tab.columns))
            if got is None:
                got = in_columns[id(tab.columns)] = (tab.columns, np.zeros(len(tab.columns.file), dtype=bool))
            got[1][tab.rows] = True
        else:
            files.update(_data_files(e))
    for cols, rows in in_columns.values():
        files.update(cols.files[f] for f in np.unique(cols.file[rows]).tolist() if f >= 0)
    if refused_keys:
        more = len(refused_keys) - _MAX_REASONS
        out.reasons.extend(refused_keys[:_MAX_REASONS])
        if more > 0:
            out.reasons.append(f"... and {more} more tensors that need new bytes")
    out.files = sorted(files)
    return out


def _data_files(e: Any) -> set[str]:
    """``e.files()``: of a `ChunkTable`, its few file numbers as a Python set, not by ``np.unique``
    (a microsecond per tensor where numpy's call costs several: 102k tensors at 180k keys)."""
    tab = e.chunks
    if not isinstance(tab, ChunkTable):
        return e.files()
    return {tab.files[f] for f in set(tab.file.tolist()) if f >= 0}


def _needs_new_bytes(t: Any, e: Any) -> str | None:
    if t.transform:
        kind = t.transform.get("kind", "layout") if isinstance(t.transform, dict) else "layout"
        return (f"has a TP-dependent layout ({kind}) that is rewritten for the new TP degree: its global view changes, "
                "so the saved chunks cannot serve it")
    if t.dtype != (e.dtype_name or ""):
        return f"is cast from {e.dtype_name} to {t.dtype}: it needs new bytes"
    if tuple(t.shape) != tuple(e.shape):
        return f"changes shape {list(e.shape)} -> {list(t.shape)}: it needs new bytes"
    return None


# ---------------------------------------------------------------------------- what each rank reads
def link_summary(plan: Any, ix: Any) -> dict[str, Any]:
    """The plan's ``data_link`` section: available or why not, what is shared and written new,
    and (when available) what each target rank's ``dcp.load`` reads from the shared items."""
    lay = link_layout(plan, ix)
    sizes = getattr(ix, "file_sizes", {}) or {}
    d: dict[str, Any] = {
        "available": lay.available,
        "reasons": lay.reasons,
        "how": "reflink where the file system can, else hard links; DST on the source's file system",
        "shared_files": len(lay.files),
        "shared_bytes": int(sum(sizes.get(f, 0) for f in lay.files)),
        "linked_keys": len(lay.linked_tensors) + len(lay.linked_objects),
        "new_keys": len(lay.new),
        "note": SHARED_NOTE,
    }
    if lay.available:
        d["reads"] = _reads(plan, ix, lay.linked_tensors)
    return d


def _reads(plan: Any, ix: Any, keys: list[str]) -> dict[str, Any]:
    """Per target rank: read items, distinct files, bytes read (whole saved items, as DCP reads
    them), their tensor data and the tensor data kept (its local boxes), over every linked tensor.

    Computed once per distinct chunking and multiplied by the tensors that share it (like the
    plan's memory estimate per distinct shape): tensors of one shape, dtype and placement whose
    saved chunks agree in number and in their first and last box, file and item length are cut
    alike by one `dcp.save` (FSDP2 cuts every tensor of a shape the same way, each rank writes
    its pieces to its own file), so a plan over thousands of ranks does not walk every chunk of
    every tensor. Per distinct chunking: a few numpy arrays over its chunks, sums by ``bincount``.
    """
    world = int(plan.target.world_size)
    items = np.zeros(world, dtype=np.int64)
    read = np.zeros(world, dtype=np.float64)
    kept = np.zeros(world, dtype=np.float64)
    data = np.zeros(world, dtype=np.float64)
    file_ids: dict[str, int] = {}
    file_tables: dict[int, np.ndarray] = {}  # id of a ChunkTable's file-name list -> those names' ids
    kept_alive: list = []  # the lists whose ids key file_tables
    targets: dict[tuple, tuple] = {}  # (ids of a plan's first and last chunk tuple, ...) -> its target boxes
    pairs: list[np.ndarray] = []
    planned = {t.key: t for t in plan.tensors}
    groups: dict[tuple, list] = {}
    memo: dict = {}
    for key in keys:
        e, t = ix.entries[key], planned[key]
        groups.setdefault(_signature(e, t, memo), [key, 0])[1] += 1
    for key, times in groups.values():
        e, t = ix.entries[key], planned[key]
        same = (id(t.chunks[0]), id(t.chunks[-1]), len(t.chunks), tuple(t.shape), t.placement) if t.chunks else None
        boxes = targets.get(same) if same is not None else None
        if boxes is None:  # tensors placed alike share the layout's cached chunk tuples: their boxes once
            boxes = _target_boxes(t, plan.target)
            if same is not None:
                targets[same] = boxes
        tr, t_off, t_size = boxes
        tab = ChunkTable.of(e.chunks, len(e.shape))
        located = tab.file >= 0
        if not located.any() or not len(tr):
            continue
        s_off, s_size = tab.offsets[located], tab.sizes[located]
        ti, sj, ov = overlaps(t_off, t_size, s_off, s_size)
        if not len(ti):
            continue
        itemsize = int(e.dtype.itemsize)
        ranks = tr[ti]
        lengths = tab.length[located]
        ids = file_tables.get(id(tab.files))
        if ids is None:  # the index's tables share one list of file names: number it once
            ids = file_tables[id(tab.files)] = np.array([file_ids.setdefault(f, len(file_ids)) for f in tab.files],
                                                         dtype=np.int64)
            kept_alive.append(tab.files)
        fids = ids[tab.file[located]]
        numels = s_size.prod(axis=1)
        items += times * np.bincount(ranks, minlength=world)
        read += times * np.bincount(ranks, weights=lengths[sj].astype(np.float64), minlength=world)
        kept += times * np.bincount(ranks, weights=(ov * itemsize).astype(np.float64), minlength=world)
        data += times * np.bincount(ranks, weights=(numels[sj] * itemsize).astype(np.float64), minlength=world)
        pairs.append(np.unique(ranks * (1 << 32) + fids[sj]))
    files = np.zeros(world, dtype=np.int64)
    if pairs:
        files = np.bincount(np.unique(np.concatenate(pairs)) >> 32, minlength=world)
    per_rank = [{"rank": r, "items": int(items[r]), "files": int(files[r]), "bytes": int(read[r]),
                 "tensor_bytes": int(data[r]), "keeps": int(kept[r])} for r in range(world)]
    worst = int(read.argmax()) if world else 0
    return {"per_rank": per_rank, "max_bytes": int(read.max()) if world else 0,
            "max_files": int(files.max()) if world else 0, "max_rank": worst,
            "amplification": round(float(data.sum()) / float(kept.sum()), 3) if kept.sum() else None,
            "note": "bytes: whole saved items that overlap the rank's boxes (DCP loads each overlapping item whole "
                    "and narrows it), tensor_bytes: their tensor data, keeps: the tensor data of the rank's own boxes "
                    "(what copy mode's rank reads, plus framing); amplification: tensor_bytes / keeps over all ranks"}


def _signature(e: Any, t: Any, memo: dict | None = None) -> tuple:
    """What makes two tensors' reads the same (see `_reads`). ``memo``: the parts that follow from an
    object the tensors share (a placement's words, a dtype's name, the ranks of a shared local-shapes
    dict), kept across the calls of one `_reads` (100k tensors, a few dozen such objects)."""
    def ends(chunks: Any) -> tuple:
        """(offsets, sizes, file and item length or None) of the first and last chunk; of a
        `ChunkTable` read from its arrays, not as two `Chunk` objects made per tensor (180k keys:
        1.5 s of a plan's CPU)."""
        if not len(chunks):
            return ()
        if isinstance(chunks, ColumnChunks):  # the same, read from the index's columns
            return chunks.ends()
        if isinstance(chunks, ChunkTable):  # the boxes as their int64 bytes: equal bytes, equal boxes
            f, n = chunks.file, chunks.length
            o, z = chunks.offsets, chunks.sizes
            fa, fb = int(f[0]), int(f[-1])
            return (o[0].tobytes(), z[0].tobytes(), o[-1].tobytes(), z[-1].tobytes(),
                    (chunks.files[fa], int(n[0])) if fa >= 0 else None, (chunks.files[fb], int(n[-1])) if fb >= 0 else None)
        a, b = chunks[0], chunks[-1]
        la, lb = a.location, b.location
        return (a.box.offsets, a.box.sizes, b.box.offsets, b.box.sizes, la and (la.file, la.length),
                lb and (lb.file, lb.length))

    if memo is None:
        memo = {}
    pl = t.placement
    placement = memo.get(("placement", pl))
    if placement is None:
        placement = memo[("placement", pl)] = pl.describe() if hasattr(pl, "describe") else repr(pl)
    dtype = memo.get(("dtype", id(e.dtype)))
    if dtype is None:  # a DType is compared by identity: its id, alive in the index, names it
        dtype = memo[("dtype", id(e.dtype))] = (e.dtype_name,)
    local = getattr(t, "local", {}) or {}
    ranks = memo.get(("local", id(local)))
    if ranks is None:  # tensors of a shape and placement share one local-shapes dict (keys.fill_local_shapes)
        ranks = memo[("local", id(local))] = (tuple(sorted(local)) if len(local) < 64 else len(local), local)
    return (tuple(e.shape), dtype[0], len(e.chunks), ends(e.chunks), tuple(t.shape), placement, len(t.chunks),
            tuple(t.chunks[0]) if t.chunks else (), ranks[0])


def _target_boxes(t: Any, target: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ranks, offsets, sizes) of every target rank that holds a piece of ``t``: the plan's chunks
    (one per writing rank), then the ranks holding a replica of a piece they do not write
    (replicated tensors, dp_replicate), whose boxes come from the layout, all ranks at once
    (`reshard.model.layout.rank_boxes`; a Python call per rank was 8 M calls at 16,384 ranks)."""
    d = len(t.shape)
    ranks = np.array([int(r) for r, _o, _s in t.chunks], dtype=np.int64)
    offs = np.array([tuple(o) for _r, o, _s in t.chunks], dtype=np.int64).reshape(len(ranks), d)
    sizes = np.array([tuple(s) for _r, _o, s in t.chunks], dtype=np.int64).reshape(len(ranks), d)
    held, r_offs, r_sizes = rank_boxes(tuple(t.shape), t.placement, target)
    extra = held & (r_sizes.prod(axis=1) > 0)
    extra[ranks[(ranks >= 0) & (ranks < len(extra))]] = False
    idx = np.flatnonzero(extra)
    return (np.concatenate([ranks, idx]), np.concatenate([offs, r_offs[idx]]), np.concatenate([sizes, r_sizes[idx]]))


def overlaps(t_off: np.ndarray, t_size: np.ndarray, s_off: np.ndarray, s_size: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (target box i, saved chunk j) pair that overlaps, and its overlap in elements.

    Candidates come from a sweep along dim 0 (saved chunks sorted by their first row: those
    starting within one chunk height before the target's first row and before its end), so
    the work follows the pairs that can overlap, not targets x chunks; the other dims are
    checked on the candidates, all in numpy.
    """
    nt, d = t_off.shape
    ns = s_off.shape[0]
    if d == 0:  # 0-d tensors: one saved item, read whole by every holder
        ti = np.repeat(np.arange(nt), ns)
        return ti, np.tile(np.arange(ns), nt), np.ones(nt * ns, dtype=np.int64)
    order = np.argsort(s_off[:, 0], kind="stable")
    starts = s_off[order, 0]
    tallest = int(s_size[:, 0].max()) if ns else 0
    lo = np.searchsorted(starts, t_off[:, 0] - tallest, side="right")
    hi = np.searchsorted(starts, t_off[:, 0] + t_size[:, 0], side="left")
    counts = np.maximum(hi - lo, 0)
    total = int(counts.sum())
    if total == 0:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z
    ti = np.repeat(np.arange(nt), counts)
    first = np.repeat(lo - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
    sj = order[first + np.arange(total)]
    lo_b = np.maximum(t_off[ti], s_off[sj])
    hi_b = np.minimum(t_off[ti] + t_size[ti], s_off[sj] + s_size[sj])
    ov = np.prod(np.maximum(hi_b - lo_b, 0), axis=1)
    keep = ov > 0
    return ti[keep], sj[keep], ov[keep]
