"""`reshard convert --output-format local`: the ``reshard-local`` files written from a plan.

The format (one safetensors file per target rank, its objects files and ``local-index.json``)
is described, and read back, in `reshard.storage.local_format`; this module knows the plan
(which rank holds which box, which keys are per-rank state) and writes those files.
"""
from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import torch

from reshard.commands.plan import Plan, TensorPlan
from reshard.errors import BadInput, Infeasible
from reshard.model.geometry import Box, whole
from reshard.model.layout import Placement, local_box, mesh_coords
from reshard.storage.index import CheckpointIndex
from reshard.storage.safetensors_format import sort_header_metadata
from reshard.storage.local_format import (FORMAT, FORMAT_VERSION, INDEX_FILE, SHARED_OBJECTS, dtype_name, rank_file,
                                          rank_objects_file)

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
        self.nbytes += t.numel() * t.element_size()

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


def write_local(plan: "Plan", ix: CheckpointIndex, directory: str | Path, *, progress: Any = None) -> dict[str, Any]:
    """Write ``plan``'s target state from ``ix`` into ``directory`` in the local format; return a summary."""
    from safetensors.torch import save_file

    from reshard.commands.inspect import bitwise_equal

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    topo = plan.target
    world = topo.world_size
    actions = {a.key: a for a in plan.keys}

    # tied copies that the plan drops must really be equal (as the DCP writer checks)
    for key, equal_to in plan.checks.items():
        if not bitwise_equal(ix, key, equal_to):
            raise Infeasible(f"tied copies '{key}' and '{equal_to}' differ, so dropping one would lose state",
                             where=str(ix.root), hint="Inspect the source: tied weights and their optimizer state must be equal.")

    # ------------------------------------------------------------------ who holds what
    tensors: list[tuple["TensorPlan", dict[int, Box]]] = []
    index_tensors: dict[str, Any] = {}
    tensor_keys = set()
    for t in plan.tensors:
        a = actions.get(t.key)
        if a is not None and a.action == "dropped":
            continue
        holders = _tensor_holders(t, a, topo)
        writers = sorted({rk for rk, _, _ in t.chunks})
        for rk, offs, sizes in t.chunks:
            if holders.get(rk) != Box(tuple(offs), tuple(sizes)):
                raise Infeasible(f"tensor '{t.key}': the plan's writer rank {rk} writes {list(offs)}+{list(sizes)} "
                                 f"but holds {holders.get(rk)} locally", hint="This is a bug in reshard; please report it.")
        tensors.append((t, holders))
        tensor_keys.add(t.key)
        index_tensors[t.key] = {"global_shape": list(t.shape), "dtype": t.dtype,
                                "placement": _normalized(t.placement).describe(),
                                "writers": writers,
                                "ranks": {str(r): {"offsets": list(b.offsets), "sizes": list(b.sizes)}
                                          for r, b in sorted(holders.items())}}

    objects: list[tuple[str, Any, list[int] | None]] = []  # (key, action, ranks or None = shared)
    for a in plan.keys:
        if a.action == "dropped" or a.key in tensor_keys:
            continue
        holders = _per_rank_holders(a.key, a.role, a.rank, topo)
        if holders is not None and not holders:  # per-rank state of no target rank: keep it with its owner
            holders = [a.rank if a.rank is not None and 0 <= a.rank < world else 0]
        objects.append((a.key, a, holders))

    last_use: dict[str, int] = {}
    for t, holders in tensors:
        if (t.transform or t.copy_from) and holders:
            last_use[t.key] = max(holders)
    cache: dict[str, _Collector] = {}
    cached_bytes = 0

    def local_tensor(t: "TensorPlan", box: Box, rank: int) -> torch.Tensor:
        nonlocal cached_bytes
        if t.key in plan.new_values:
            v = plan.new_values[t.key]
            return (v[box.slices()] if v.dim() else v).contiguous().clone()
        if t.transform or t.copy_from:
            c = cache.get(t.key)
            if c is None:
                c = _transformed(ix, t)
                if cached_bytes + c.nbytes <= TRANSFORM_CACHE_BYTES and last_use[t.key] > rank:
                    cache[t.key] = c
                    cached_bytes += c.nbytes
            x = c.box(box, getattr(torch, t.dtype) if t.dtype else c.chunks[0][1].dtype).clone()
            if last_use[t.key] == rank and t.key in cache:
                cached_bytes -= cache.pop(t.key).nbytes
            return x
        return ix.read_box(t.key, box).contiguous()

    # ------------------------------------------------------------------ one rank at a time
    per_rank_info: dict[str, Any] = {}
    total_bytes = 0
    n_keys = len(plan.keys)
    obj_files: dict[str, Any] = {"shared": None}
    for rank in range(world):
        local: dict[str, torch.Tensor] = {}
        for t, holders in tensors:
            box = holders.get(rank)
            if box is None:
                continue
            x = local_tensor(t, box, rank)
            if t.dtype and dtype_name(x.dtype) != t.dtype:
                raise Infeasible(f"tensor '{t.key}' is {x.dtype} but the plan says {t.dtype}",
                                 hint="This is a bug in reshard; please report it.")
            if tuple(x.shape) != box.sizes:
                raise Infeasible(f"tensor '{t.key}': local piece {tuple(x.shape)}, box {list(box.sizes)}",
                                 hint="This is a bug in reshard; please report it.")
            index_tensors[t.key]["dtype"] = dtype_name(x.dtype)
            local[t.key] = x
        name = rank_file(rank, world)
        save_file(local, str(out / name), metadata={"reshard": "local", "rank": str(rank), "world_size": str(world)})
        sort_header_metadata(out / name)  # safetensors writes metadata in hash-map order: sorted, reproducible
        _chmod_like_umask(out / name)  # safetensors creates its files 0600
        nbytes = (out / name).stat().st_size
        total_bytes += nbytes
        per_rank_info[str(rank)] = {"file": name, "tensors": len(local), "bytes": nbytes}
        del local
        mine = {k: a for k, a, hs in objects if hs is not None and rank in hs}
        if mine:
            fname = rank_objects_file(rank)
            nb = _save_objects(out / fname, {k: _object_value(plan, ix, a) for k, a in mine.items()})
            per_rank_info[str(rank)].update(objects=len(mine), objects_file=fname, objects_bytes=nb)
            obj_files[str(rank)] = fname
            total_bytes += nb
        if progress is not None:
            step = (rank + 1) * n_keys // world - rank * n_keys // world
            if step:
                progress.update(step)
    cache.clear()

    shared = {k: a for k, a, hs in objects if hs is None}
    if shared:
        nb = _save_objects(out / SHARED_OBJECTS, {k: _object_value(plan, ix, a) for k, a in shared.items()})
        obj_files["shared"] = SHARED_OBJECTS
        total_bytes += nb

    index_objects: dict[str, Any] = {}
    for k, a, hs in objects:
        if hs is None:
            index_objects[k] = {"rank": "all", "file": SHARED_OBJECTS, "ranks": list(range(world))}
        else:
            owner = a.rank if a.rank is not None and a.rank in hs else (hs[0] if hs else 0)
            index_objects[k] = {"rank": owner, "file": rank_objects_file(owner), "ranks": sorted(hs)}
    index = {"format": FORMAT, "format_version": FORMAT_VERSION, "world_size": world,
             "topology": topo.to_dict(), "plan_fingerprint": plan.fingerprint(),
             "files": {str(r): rank_file(r, world) for r in range(world)},
             "object_files": obj_files,
             "tensors": index_tensors, "objects": index_objects}
    (out / INDEX_FILE).write_text(_index_json(index))
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "world_size": world, "index": INDEX_FILE,
            "ranks": per_rank_info, "shared_objects": len(shared), "shared_objects_file": obj_files["shared"],
            "tensor_keys": len(index_tensors), "object_keys": len(index_objects), "bytes": total_bytes}


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
    if a.action in ("rewritten", "added"):
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
