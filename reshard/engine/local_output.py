"""`reshard convert --output-format local`: the ``reshard-local`` files written from a plan.

The format (one safetensors file per target rank, its objects files and ``local-index.json``)
is described, and read back, in `reshard.storage.checkpoints.local_format`; this module knows the plan
(which rank holds which box, which keys are per-rank state) and writes those files, as the
`LocalOutput` step of `reshard.engine.pipeline.run_conversion`.
"""
from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from reshard.model.plan import KeyAction, Plan, TensorPlan
from reshard.engine.pipeline import Output, Run, writing_bytes
from reshard.errors import BadInput, Infeasible
from reshard.model.geometry import Box, whole
from reshard.model.layout import Placement, local_box, mesh_coords
from reshard.model.tensor_values import as_torch
from reshard.storage.checkpoints.index import CheckpointIndex
from reshard.storage.checkpoints.safetensors_format import PACKED, SAFETENSORS_NAMES, sort_header_metadata
from reshard.storage.checkpoints.local_format import (FORMAT, FORMAT_VERSION, INDEX_FILE, SHARED_OBJECTS, dtype_name, rank_file,
                                          rank_objects_file, index_dtype)

TRANSFORM_CACHE_BYTES = 256 << 20
PER_RANK_ROLES = ("rng", "data")
_RANK_IN_KEY = re.compile(r"(?:rank_|dp_rank_)(\d+)")

def _normalized(p: Placement) -> Placement:
    """A placement whose ``dp_shard`` is a real bool (a stray truthy string means 'not FSDP-sharded')."""
    return Placement(dp_shard=p.dp_shard is True, tp_dim=p.tp_dim, stage=p.stage)


def _per_rank_index(key: str, role: str) -> int | None:
    if role not in PER_RANK_ROLES:
        return None
    m = _RANK_IN_KEY.search(key)
    return int(m.group(1)) if m else None


def _per_rank_holders(key: str, role: str, owner: int | None, topo) -> list[int] | None:
    """Ranks that hold a per-rank key (None: not per-rank state)."""
    n = _per_rank_index(key, role)
    if n is None:
        return None
    world = topo.world_size
    if role == "rng":
        r = owner if owner is not None else n
        return [r] if 0 <= r < world else []
    out = []  # data: the key's number is a data-parallel index; all ranks of that index read it
    for r in range(world):
        c = mesh_coords(topo, r)
        if c["dp_replicate"] * topo.dp_shard + c["dp_shard"] == n:
            out.append(r)
    return out or ([owner] if owner is not None and 0 <= owner < world else [])


def _tensor_holders(t: "TensorPlan", action, topo) -> dict[int, Box]:
    """rank -> the box that rank holds locally (non-empty boxes only)."""
    placement = _normalized(t.placement)
    shape = tuple(t.shape)
    owner = action.rank if action is not None and action.rank is not None else (t.chunks[0][0] if t.chunks else None)
    per_rank = _per_rank_holders(t.key, t.role, owner, topo)
    out: dict[int, Box] = {}
    if per_rank is not None:
        for r in per_rank:
            out[r] = whole(shape)
        return {r: b for r, b in out.items() if not (shape and b.is_empty())}
    for r in range(topo.world_size):
        box = local_box(shape, placement, topo, r)
        if box is None or (shape and box.is_empty()):
            continue
        out[r] = box
    return out


class _Collector:
    """Stands in for DcpWriter: keeps the chunks ``write_transformed`` cuts (same bytes as the DCP output)."""

    def __init__(self) -> None:
        self.chunks: list[tuple[Box, torch.Tensor]] = []
        self.nbytes = 0

    def write_chunk(self, rank: int, key: str, offsets, tensor: torch.Tensor) -> None:
        t = tensor.detach().contiguous().clone()
        self.chunks.append((Box(tuple(offsets), tuple(t.shape)), t))
        self.nbytes += t.numel() * t.dtype.itemsize

    def box(self, box: Box, dtype: torch.dtype) -> torch.Tensor:
        for b, t in self.chunks:
            if b == box:
                return t
        out = torch.empty(box.sizes, dtype=dtype)
        filled = 0
        for b, t in self.chunks:
            inter = b.intersect(box) if box.sizes else (b if not b.offsets else None)
            if inter is None:
                continue
            out[inter.relative_to(box).slices()] = t[inter.relative_to(b).slices()]
            filled += inter.numel
        if filled != box.numel:
            raise Infeasible(f"transformed chunks cover {filled} of {box.numel} elements of a local box",
                             hint="This is a bug in reshard; please report it.")
        return out


def _transformed(ix: CheckpointIndex, t: "TensorPlan") -> _Collector:
    from reshard.semantics.transforms import write_transformed

    c = _Collector()
    write_transformed(ix, c, t, source_key=t.copy_from)
    return c


@dataclass
class _HeldTensor:
    """A tensor of the output and the box each rank that holds it keeps locally."""

    plan: "TensorPlan"
    holders: dict[int, Box]


@dataclass
class _HeldObject:
    """A non-tensor key of the output and the ranks whose objects file holds it (None: the shared file)."""

    key: str
    action: "KeyAction"
    ranks: list[int] | None


def write_local(plan: "Plan", ix: CheckpointIndex, directory: str | Path, *, progress: Any = None,
                total_bytes: int = 0) -> dict[str, Any]:
    """Write ``plan``'s target state from ``ix`` into ``directory`` in the local format; return a summary.

    ``progress.update(nbytes)``: each rank's file advances it by its share of ``total_bytes``.

    One rank's file at a time, so memory is bounded by one rank's state (plus the transform cache).
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    world = plan.target.world_size
    tensors, index_tensors = _held_tensors(plan)
    _check_storable(tensors, ix)
    objects = _held_objects(plan, {h.plan.key for h in tensors})
    pieces = _Pieces(plan, ix, tensors)
    ranks: dict[str, Any] = {}
    for rank in range(world):
        ranks[str(rank)] = _write_rank_tensors(out, rank, world, tensors, pieces, index_tensors)
        ranks[str(rank)].update(_write_rank_objects(out, rank, plan, ix, objects))
        _advance(progress, rank, world, total_bytes)
    pieces.clear()
    shared = _object_values(plan, ix, [o for o in objects if o.ranks is None])
    shared_bytes = _save_objects(out / SHARED_OBJECTS, shared) if shared else 0
    object_files = {"shared": SHARED_OBJECTS if shared else None,
                    **{r: info["objects_file"] for r, info in ranks.items() if "objects_file" in info}}
    index_objects = _index_objects(objects, world)
    (out / INDEX_FILE).write_text(_index_json(_index(plan, object_files, index_tensors, index_objects)))
    total_bytes = sum(info["bytes"] + info.get("objects_bytes", 0) for info in ranks.values()) + shared_bytes
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "world_size": world, "index": INDEX_FILE,
            "ranks": ranks, "shared_objects": len(shared), "shared_objects_file": object_files["shared"],
            "tensor_keys": len(index_tensors), "object_keys": len(index_objects), "bytes": total_bytes}


def _check_storable(tensors: list[_HeldTensor], ix: CheckpointIndex) -> None:
    """Every kept tensor's dtype has a safetensors name, before the first file is written.

    The rank files are safetensors, which names float8 (all five), F4, U16-U64 and C64 but not
    complex32, complex128 or the bits dtypes (`reshard.storage.checkpoints.safetensors_format.SAFETENSORS_DTYPES`);
    a tensor of those is refused by key and dtype (exit 2) with the DCP output as the way out.
    """
    bad = []
    for h in tensors:
        dt = index_dtype(h.plan.dtype) if h.plan.dtype else None
        if dt is not None and (dt not in SAFETENSORS_NAMES or (dt in PACKED and not h.plan.shape)):
            bad.append((h.plan.key, h.plan.dtype))
    if bad:
        listed = ", ".join(f"'{k}' ({d})" for k, d in bad[:8]) + (" ..." if len(bad) > 8 else "")
        raise BadInput(f"--output-format local writes safetensors files, which cannot store {len(bad)} tensor(s) of "
                       f"this checkpoint: {listed}", where=str(ix.root), keys=[k for k, _ in bad],
                       hint="Convert to DCP (the default --output-format dcp stores every dtype); nothing was written.")


def _held_tensors(plan: "Plan") -> tuple[list[_HeldTensor], dict[str, Any]]:
    """Every tensor the plan keeps, with its holders, and its entry of the index (in the plan's order)."""
    actions = {a.key: a for a in plan.keys}
    held: list[_HeldTensor] = []
    index: dict[str, Any] = {}
    for t in plan.tensors:
        a = actions.get(t.key)
        if a is not None and a.left_out:
            continue
        holders = _checked_holders(t, a, plan.target)
        held.append(_HeldTensor(t, holders))
        index[t.key] = _tensor_index_entry(t, holders)
    return held, index


def _checked_holders(t: "TensorPlan", action, topo) -> dict[int, Box]:
    """The tensor's holders, proven to agree with the plan: each writer rank writes exactly the box it holds."""
    holders = _tensor_holders(t, action, topo)
    for rk, offs, sizes in t.chunks:
        if holders.get(rk) != Box(tuple(offs), tuple(sizes)):
            raise Infeasible(f"tensor '{t.key}': the plan's writer rank {rk} writes {list(offs)}+{list(sizes)} "
                             f"but holds {holders.get(rk)} locally", hint="This is a bug in reshard; please report it.")
    return holders


def _tensor_index_entry(t: "TensorPlan", holders: dict[int, Box]) -> dict[str, Any]:
    """The index's line for one tensor (its dtype is set again from the bytes actually written)."""
    return {"global_shape": list(t.shape), "dtype": t.dtype,
            "placement": _normalized(t.placement).describe(),
            "writers": sorted({rk for rk, _, _ in t.chunks}),
            "ranks": {str(r): {"offsets": list(b.offsets), "sizes": list(b.sizes)}
                      for r, b in sorted(holders.items())}}


def _held_objects(plan: "Plan", tensor_keys: set[str]) -> list[_HeldObject]:
    """Every non-tensor key the plan keeps and where it goes: per-rank state to its ranks, the rest shared."""
    world = plan.target.world_size
    objects: list[_HeldObject] = []
    for a in plan.keys:
        if a.left_out or a.key in tensor_keys:
            continue
        holders = _per_rank_holders(a.key, a.role, a.rank, plan.target)
        if holders is not None and not holders:  # per-rank state of no target rank: keep it with its owner
            holders = [a.rank if a.rank is not None and 0 <= a.rank < world else 0]
        objects.append(_HeldObject(a.key, a, holders))
    return objects


class _Pieces:
    """Each tensor's local piece for a rank: a new value sliced, a source box read, or a transformed tensor.

    A transformed tensor (or tied copy) is computed whole once; it is kept, up to
    ``TRANSFORM_CACHE_BYTES`` in all, until the last rank that holds it has taken its piece,
    and recomputed per rank past that bound.
    """

    def __init__(self, plan: "Plan", ix: CheckpointIndex, tensors: list[_HeldTensor]) -> None:
        self.plan = plan
        self.ix = ix
        self.last_use = {h.plan.key: max(h.holders) for h in tensors
                         if (h.plan.transform or h.plan.copy_from) and h.holders}
        self.cache: dict[str, _Collector] = {}
        self.cached_bytes = 0

    def piece(self, t: "TensorPlan", box: Box, rank: int) -> torch.Tensor:
        if t.key in self.plan.new_values:
            v = as_torch(self.plan.new_values[t.key])  # a value made without torch (ArrayTensor): as the tensor it stands for
            return (v[box.slices()] if v.dim() else v).contiguous().clone()
        if t.transform or t.copy_from:
            return self._transformed_piece(t, box, rank)
        return self.ix.read_box(t.key, box).contiguous()

    def _transformed_piece(self, t: "TensorPlan", box: Box, rank: int) -> torch.Tensor:
        c = self.cache.get(t.key)
        if c is None:
            c = _transformed(self.ix, t)
            if self.cached_bytes + c.nbytes <= TRANSFORM_CACHE_BYTES and self.last_use[t.key] > rank:
                self.cache[t.key] = c
                self.cached_bytes += c.nbytes
        x = c.box(box, getattr(torch, t.dtype) if t.dtype else c.chunks[0][1].dtype).clone()
        if self.last_use[t.key] == rank and t.key in self.cache:
            self.cached_bytes -= self.cache.pop(t.key).nbytes
        return x

    def clear(self) -> None:
        self.cache.clear()


def _rank_tensors(rank: int, tensors: list[_HeldTensor], pieces: _Pieces) -> dict[str, torch.Tensor]:
    """The pieces rank ``rank`` holds, each checked against the plan's dtype and local box."""
    local: dict[str, torch.Tensor] = {}
    for h in tensors:
        t, box = h.plan, h.holders.get(rank)
        if box is None:
            continue
        x = pieces.piece(t, box, rank)
        if t.dtype and dtype_name(x.dtype) != t.dtype:
            raise Infeasible(f"tensor '{t.key}' is {x.dtype} but the plan says {t.dtype}",
                             hint="This is a bug in reshard; please report it.")
        if tuple(x.shape) != box.sizes:
            raise Infeasible(f"tensor '{t.key}': local piece {tuple(x.shape)}, box {list(box.sizes)}",
                             hint="This is a bug in reshard; please report it.")
        local[t.key] = x
    return local


def _write_rank_tensors(out: Path, rank: int, world: int, tensors: list[_HeldTensor], pieces: _Pieces,
                        index_tensors: dict[str, Any]) -> dict[str, Any]:
    """Rank ``rank``'s safetensors file; its tensors' dtypes go to the index. Returns the rank's summary entry."""
    from safetensors.torch import save_file

    local = _rank_tensors(rank, tensors, pieces)
    for key, x in local.items():
        index_tensors[key]["dtype"] = dtype_name(x.dtype)
    name = rank_file(rank, world)
    save_file(local, str(out / name), metadata={"reshard": "local", "rank": str(rank), "world_size": str(world)})
    sort_header_metadata(out / name)  # safetensors writes metadata in hash-map order: sorted, reproducible
    _chmod_like_umask(out / name)  # safetensors creates its files 0600
    return {"file": name, "tensors": len(local), "bytes": (out / name).stat().st_size}


def _write_rank_objects(out: Path, rank: int, plan: "Plan", ix: CheckpointIndex,
                        objects: list[_HeldObject]) -> dict[str, Any]:
    """Rank ``rank``'s objects file if it holds per-rank objects; returns what its summary entry gains."""
    mine = [o for o in objects if o.ranks is not None and rank in o.ranks]
    if not mine:
        return {}
    fname = rank_objects_file(rank)
    values = _object_values(plan, ix, mine)
    nb = _save_objects(out / fname, values)
    return {"objects": len(values), "objects_file": fname, "objects_bytes": nb}


def _object_values(plan: "Plan", ix: CheckpointIndex, objects: list[_HeldObject]) -> dict[str, Any]:
    """Key -> the value an objects file holds for it (a key named twice: its last action)."""
    actions = {o.key: o.action for o in objects}
    return {k: _object_value(plan, ix, a) for k, a in actions.items()}


def _advance(progress: Any, rank: int, world: int, total: int) -> None:
    """Progress counts bytes: each rank's file advances it by its share of ``total``."""
    if progress is None:
        return
    step = (rank + 1) * total // world - rank * total // world
    if step:
        progress.update(step)


def _index_objects(objects: list[_HeldObject], world: int) -> dict[str, Any]:
    """The index's line for each object: the file that holds it and the ranks that load it."""
    index: dict[str, Any] = {}
    for o in objects:
        if o.ranks is None:
            index[o.key] = {"rank": "all", "file": SHARED_OBJECTS, "ranks": list(range(world))}
        else:
            a, hs = o.action, o.ranks
            owner = a.rank if a.rank is not None and a.rank in hs else (hs[0] if hs else 0)
            index[o.key] = {"rank": owner, "file": rank_objects_file(owner), "ranks": sorted(hs)}
    return index


def _index(plan: "Plan", object_files: dict[str, Any], index_tensors: dict[str, Any],
           index_objects: dict[str, Any]) -> dict[str, Any]:
    """``local-index.json``: the layout, the plan it came from, and where every key is."""
    world = plan.target.world_size
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "world_size": world,
            "topology": plan.target.to_dict(), "plan_fingerprint": plan.fingerprint(),
            "files": {str(r): rank_file(r, world) for r in range(world)},
            "object_files": object_files,
            "tensors": index_tensors, "objects": index_objects}


def _index_json(index: dict[str, Any]) -> str:
    """Readable and diff-friendly: the header indented, one line per tensor and per object."""
    head = {k: v for k, v in index.items() if k not in ("tensors", "objects")}
    parts = [json.dumps(head, indent=1)[:-2]]
    for name in ("tensors", "objects"):
        body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in index[name].items())
        parts.append(f',\n "{name}": {{' + (f"\n{body}\n }}" if body else "}"))
    return "".join(parts) + "\n}\n"


def _chmod_like_umask(path: Path) -> None:
    import os

    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def _object_value(plan: "Plan", ix: CheckpointIndex, a) -> Any:
    if a.new_value:
        return plan.new_values[a.key]
    return ix.read_object(a.key)


def _save_objects(path: Path, objs: dict[str, Any]) -> int:
    """torch.save ``objs``, proving first that it loads with ``weights_only=True``."""
    buf = io.BytesIO()
    torch.save(objs, buf)
    data = buf.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - report which object cannot be loaded safely
        raise BadInput(f"objects {sorted(objs)[:5]} cannot be loaded with torch.load(weights_only=True): {exc}",
                       where=str(path), hint="The local format only holds safely loadable objects.") from None
    path.write_bytes(data)
    return len(data)


@dataclass
class LocalOutput(Output):
    """``--output-format local``: one safetensors file per target rank with exactly its local tensors
    (`write_local`), verified against the source as a DCP output is."""

    _info: dict[str, Any] | None = field(default=None, init=False, repr=False)

    def write(self, run: Run) -> None:
        from reshard.render.progress import phase_of

        total = writing_bytes(run.plan, run.ix)
        with phase_of(run.progress, self.phase, total) as bar:
            self._info = write_local(run.plan, run.ix, run.tmp, progress=bar, total_bytes=total)

    def describe(self, run: Run, report: dict[str, Any]) -> None:
        """The rank files written in place of DCP's, and the local format's summary."""
        report["output_format"] = "local"
        report["files"] = {p.name: p.stat().st_size for p in sorted(run.tmp.iterdir()) if p.suffix == ".safetensors"}
        report["bytes_written"] = sum(report["files"].values())
        report["local"] = self._info
