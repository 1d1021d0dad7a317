"""The ``reshard-local`` output format: one safetensors file per target rank, holding its local shards.

`reshard convert --output-format local` writes it for trainers that load local shards
directly (no DCP planner, no collective): rank ``r`` opens its own file and gets, under
the global key, exactly the tensor its DTensor/FSDP2 parameter or optimizer state holds
locally (``to_local()``) on the target layout.

Format (version 1)
------------------
A directory holding::

    local-index.json                     # the index below (the format's commit marker)
    rank-00000-of-00004.safetensors      # one per target rank r = 0..W-1 (always present)
    ...
    objects.pt                           # shared non-tensor state (only when there is some)
    rank-00003-objects.pt                # per-rank non-tensor state (only for ranks that have some)
    manifest.json, reshard-report.json, reshard-report.md   # written by `reshard convert`

* **Tensors.** ``rank-{r:05d}-of-{W:05d}.safetensors`` is a flat safetensors dict
  ``global key -> local tensor``. For every tensor of the plan and every rank ``r`` where
  :func:`reshard.layout.local_box` (shape, placement, target topology, r) is not None and
  not empty, the file holds the slice of the (transformed, for fused/padded/tied keys)
  global tensor at that box. **Replicas are included**: every rank holds its own copy of
  what it holds locally (a replicated norm weight is in every file of its stage; each
  TP rank of a dp replica group has the same piece). The one exception is per-rank state
  (roles ``rng``/``data`` with a rank in the key, e.g. ``rng.rank_3.torch``): only the
  rank it belongs to holds it (for data-parallel-rank state such as
  ``dataloader.dp_rank_1``: every rank of that data-parallel index). The safetensors
  metadata header is ``{"reshard": "local", "rank": "<r>", "world_size": "<W>"}``.
* **Objects** (non-tensor items the plan carries, rewrites or adds; dropped keys are not
  written) are ``torch.save``-d dicts ``key -> object`` loadable with
  ``torch.load(path, weights_only=True)``. Shared objects (optimizer param groups,
  scheduler, counters, shared data-sampler state) are written **once**, in
  ``objects.pt``; every rank reads them from there. Per-rank objects go to
  ``rank-{r:05d}-objects.pt`` of each rank that holds them (see per-rank state above).
  A rank's non-tensor state is therefore ``objects.pt`` updated with its own
  ``rank-…-objects.pt`` (when present).
* **Index** ``local-index.json``::

      {"format": "reshard-local", "format_version": 1,
       "world_size": W,
       "topology": {"pp": .., "dp_replicate": .., "dp_shard": .., "cp": .., "tp": .., ...},
       "plan_fingerprint": "...",                       # the plan that wrote it
       "files": {"<r>": "rank-0000r-of-0000W.safetensors", ...},      # every rank
       "object_files": {"shared": "objects.pt" | null, "<r>": "rank-0000r-objects.pt", ...},
       "tensors": {key: {"global_shape": [...], "dtype": "float32",
                         "placement": "FSDP Shard(0) x TP Shard(1)",
                         "writers": [r, ...],  # one rank per distinct piece: their boxes tile the
                                               # global shape exactly (replica index 0, as DCP dedups)
                         "ranks": {"<r>": {"offsets": [...], "sizes": [...]}, ...}}},  # every holder
       "objects": {key: {"rank": r | "all", "file": "objects.pt" | "rank-…-objects.pt",
                         "ranks": [r, ...]}}}   # "all": shared, in objects.pt; otherwise the
                                                # plan's owner rank and every rank whose
                                                # per-rank objects file holds the key

  JSON object keys are strings, so ranks appear as ``"0"``, ``"1"``, ... there.

Reading it back
---------------
:func:`open_local` (and :func:`open_any`, which picks the DCP or local reader by the
presence of ``local-index.json``) returns a :class:`LocalIndex`, the read-only global view
`reshard inspect` and `reshard verify` use for DCP checkpoints: each tensor's chunks are the
writer ranks' boxes, read from their files with ``safe_open(...).get_slice``. Opening
validates strictly and raises :class:`~reshard.errors.BadInput` (exit 2) naming the file on
any inconsistency: a missing file, writer boxes that do not tile the global shape, a rank's
box outside the tensor, a safetensors header whose dtype or shape disagrees with the index,
tensors in a file the index does not name, an objects file that does not load with
``weights_only=True`` or lacks a key the index names.

Memory when writing: files are built and written one rank at a time (bounded by one rank's
file, which safetensors needs in memory), reading each needed box with
``CheckpointIndex.read_box``. Tensors whose target layout is a transform of a whole source
tensor (fused re-interleave, vocab re-pad, tied copies) go through the same code as the DCP
writer (``reshard.execute._write_transformed``) and are kept only until the last rank that
needs them, up to :data:`TRANSFORM_CACHE_BYTES`; past that they are recomputed per rank.
"""
from __future__ import annotations

import io
import json
import re
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from reshard.io import safefs
from reshard.errors import BadInput, Incomplete, Infeasible
from reshard.geometry import Box, coverage_problems, whole
from reshard.index import CheckpointIndex, Chunk, Entry, EntryQueries, Finding
from reshard.io.dcp import ItemLocation
from reshard.layout import Placement, local_box, mesh_coords

if TYPE_CHECKING:  # pragma: no cover
    from reshard.plan import Plan, TensorPlan

FORMAT = "reshard-local"
FORMAT_VERSION = 1
INDEX_FILE = "local-index.json"
SHARED_OBJECTS = "objects.pt"
TRANSFORM_CACHE_BYTES = 256 << 20
PER_RANK_ROLES = ("rng", "data")
_RANK_IN_KEY = re.compile(r"(?:rank_|dp_rank_)(\d+)")

_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "C64": torch.complex64, "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def rank_file(rank: int, world: int) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.safetensors"


def rank_objects_file(rank: int) -> str:
    return f"rank-{rank:05d}-objects.pt"


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _torch_dtype(name: str) -> torch.dtype | None:
    dt = getattr(torch, str(name), None)
    return dt if isinstance(dt, torch.dtype) else None


# ====================================================================================== writing
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
    """Stands in for DcpWriter: keeps the chunks ``_write_transformed`` cuts (same bytes as the DCP output)."""

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
    from reshard.execute import _write_transformed

    c = _Collector()
    _write_transformed(ix, c, t, source_key=t.copy_from)
    return c


def write_local(plan: "Plan", ix: CheckpointIndex, directory: str | Path, *, progress: Any = None) -> dict[str, Any]:
    """Write ``plan``'s target state from ``ix`` into ``directory`` in the local format; return a summary."""
    from safetensors.torch import save_file

    from reshard.inspection import bitwise_equal

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
            if t.dtype and _dtype_name(x.dtype) != t.dtype:
                raise Infeasible(f"tensor '{t.key}' is {x.dtype} but the plan says {t.dtype}",
                                 hint="This is a bug in reshard; please report it.")
            if tuple(x.shape) != box.sizes:
                raise Infeasible(f"tensor '{t.key}': local piece {tuple(x.shape)}, box {list(box.sizes)}",
                                 hint="This is a bug in reshard; please report it.")
            index_tensors[t.key]["dtype"] = _dtype_name(x.dtype)
            local[t.key] = x
        name = rank_file(rank, world)
        save_file(local, str(out / name), metadata={"reshard": "local", "rank": str(rank), "world_size": str(world)})
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


# ====================================================================================== reading
def _read_header(path: Path, root: Path | None = None) -> tuple[dict[str, Any], int]:
    """The safetensors JSON header of ``path`` (a regular file inside ``root``, default its
    directory) and the byte offset where its data starts."""
    where = str(path)
    try:
        with os.fdopen(safefs.open_read(path, root=root), "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise BadInput("not a safetensors file (shorter than 8 bytes)", where=where)
            (n,) = struct.unpack("<Q", head)
            size = os.fstat(f.fileno()).st_size
            if n > size - 8 or n > 100 << 20:
                raise BadInput(f"not a safetensors file (header length {n}, file {size} bytes)", where=where)
            header = safefs.loads_json(f.read(n), where=where, what="safetensors header")
    except FileNotFoundError:
        raise Incomplete("data file is missing", where=where) from None
    except (OSError, ValueError) as exc:
        raise BadInput(f"unreadable safetensors header ({exc})", where=where) from None
    if not isinstance(header, dict):
        raise BadInput("safetensors header is not a JSON object", where=where)
    return header, 8 + n


class LocalIndex(EntryQueries):
    """The global, read-only view of a ``reshard-local`` directory (the CheckpointIndex interface)."""

    def __init__(self, root: Path, *, trust_pickle: bool = False):
        self.root = Path(root)
        self.trust_pickle = trust_pickle
        self.version = f"{FORMAT}/{FORMAT_VERSION}"
        self.entries: dict[str, Entry] = {}
        self.findings: list[Finding] = []
        self.file_sizes: dict[str, int] = {}
        self._handles: dict[str, Any] = {}
        self._objects: dict[str, dict[str, Any]] = {}
        self._load()

    # ------------------------------------------------------------------ validation
    def _bad(self, message: str, file: str = INDEX_FILE) -> BadInput:
        return BadInput(message, where=str(self.root / file), hint="The local-format checkpoint is corrupt or was edited.")

    def _load(self) -> None:
        p = self.root / INDEX_FILE
        if not self.root.is_dir():
            raise BadInput("no such checkpoint directory", where=str(self.root))
        try:
            ix = safefs.read_json(p, root=self.root, what="local index")
        except FileNotFoundError:
            raise Incomplete("no local-index.json: not a committed local-format checkpoint", where=str(p)) from None
        except OSError as exc:
            raise self._bad(f"unreadable index ({exc})") from None
        if not isinstance(ix, dict) or ix.get("format") != FORMAT:
            raise self._bad(f"not a {FORMAT} index (format {ix.get('format') if isinstance(ix, dict) else None!r})")
        if ix.get("format_version") != FORMAT_VERSION:
            raise self._bad(f"format_version {ix.get('format_version')!r}, this reader knows {FORMAT_VERSION}")
        world = ix.get("world_size")
        if not isinstance(world, int) or isinstance(world, bool) or world < 1:
            raise self._bad(f"world_size {world!r} is not a positive integer")
        self.world_size = world
        self.topology = ix.get("topology") if isinstance(ix.get("topology"), dict) else None
        if self.topology is None or self.topology.get("world_size") != world:
            raise self._bad(f"topology {ix.get('topology')!r} does not describe world size {world}")
        files = ix.get("files")
        if not isinstance(files, dict) or set(files) != {str(r) for r in range(world)} \
                or not all(isinstance(v, str) and "/" not in v for v in files.values()):
            raise self._bad(f"'files' must name one file per rank 0..{world - 1}")
        self.files = {int(r): f for r, f in files.items()}
        for key in ("tensors", "objects"):
            if not isinstance(ix.get(key), dict):
                raise self._bad(f"'{key}' must be an object")

        headers: dict[int, tuple[dict[str, Any], int]] = {}
        for r in range(world):
            name = self.files[r]
            header, data_start = _read_header(self.root / name)
            meta = header.get("__metadata__") or {}
            if meta.get("reshard") != "local" or meta.get("rank") != str(r) or meta.get("world_size") != str(world):
                raise self._bad(f"safetensors metadata {meta!r} is not rank {r} of {world}", name)
            headers[r] = (header, data_start)
            self.file_sizes[name] = safefs.regular_size(self.root / name, root=self.root)

        named: dict[int, set[str]] = {r: set() for r in range(world)}
        for key, t in ix["tensors"].items():
            self._load_tensor(key, t, headers, named)
        for r in range(world):
            extra = sorted(set(headers[r][0]) - {"__metadata__"} - named[r])
            if extra:
                raise self._bad(f"holds tensors the index does not name for rank {r}: {extra[:5]}", self.files[r])
        self._load_objects(ix["objects"], ix.get("object_files"))

    def _load_tensor(self, key: str, t: Any, headers, named) -> None:
        try:
            shape = tuple(int(s) for s in t["global_shape"])
            dtype = _torch_dtype(t["dtype"])
            writers = [int(w) for w in t["writers"]]
            ranks = {int(r): Box(tuple(int(o) for o in b["offsets"]), tuple(int(s) for s in b["sizes"]))
                     for r, b in t["ranks"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise self._bad(f"tensor '{key}': malformed entry ({exc.__class__.__name__}: {exc})") from None
        if dtype is None:
            raise self._bad(f"tensor '{key}': unknown dtype {t['dtype']!r}")
        g = whole(shape)
        for r, box in ranks.items():
            if not 0 <= r < self.world_size:
                raise self._bad(f"tensor '{key}': rank {r} outside world size {self.world_size}")
            if len(box.offsets) != len(shape) or len(box.sizes) != len(shape) or not g.contains(box) \
                    or any(o < 0 or s < 0 for o, s in zip(box.offsets, box.sizes)):
                raise self._bad(f"tensor '{key}': rank {r}'s box {list(box.offsets)}+{list(box.sizes)} "
                                f"lies outside {list(shape)}")
            header, data_start = headers[r]
            h = header.get(key)
            fname = self.files[r]
            if not isinstance(h, dict):
                raise self._bad(f"tensor '{key}' is missing (the index says rank {r} holds it)", fname)
            if _ST_DTYPES.get(h.get("dtype")) != dtype:
                raise self._bad(f"tensor '{key}' is {h.get('dtype')} but the index says {t['dtype']}", fname)
            if tuple(h.get("shape", ())) != box.sizes:
                raise self._bad(f"tensor '{key}' has shape {h.get('shape')} but the index says {list(box.sizes)}", fname)
            named[r].add(key)
        missing = [w for w in writers if w not in ranks]
        if missing:
            raise self._bad(f"tensor '{key}': writer ranks {missing} hold no piece of it")
        boxes = [ranks[w] for w in writers]
        probs = coverage_problems(shape, boxes)
        if probs:
            raise self._bad(f"tensor '{key}': the writer ranks' boxes do not tile {list(shape)}: {probs[0].detail}")
        chunks = []
        for w in writers:
            header, data_start = headers[w]
            begin, end = header[key].get("data_offsets", (0, 0))
            chunks.append(Chunk(ranks[w], ItemLocation(self.files[w], data_start + int(begin), int(end) - int(begin))))
        e = Entry(key, "tensor", shape=shape, dtype=dtype, chunks=chunks)
        e.holders = ranks  # type: ignore[attr-defined] - every rank's local box, replicas included
        self.entries[key] = e

    def _load_objects(self, objects: dict[str, Any], object_files: Any) -> None:
        needed: dict[str, list[str]] = {}
        for key, o in objects.items():
            if key in self.entries:
                raise self._bad(f"'{key}' is listed both as a tensor and as an object")
            if not isinstance(o, dict) or not isinstance(o.get("file"), str) or "/" in o["file"]:
                raise self._bad(f"object '{key}': malformed entry {o!r}")
            r = o.get("rank")
            if not (r == "all" or (isinstance(r, int) and 0 <= r < self.world_size)):
                raise self._bad(f"object '{key}': rank {r!r} is neither 'all' nor a rank below {self.world_size}")
            files = [o["file"]]
            if r != "all":
                for rr in o.get("ranks", [r]):
                    if not isinstance(rr, int) or not 0 <= rr < self.world_size:
                        raise self._bad(f"object '{key}': rank {rr!r} outside world size {self.world_size}")
                    files.append(rank_objects_file(rr))
            for f in files:
                needed.setdefault(f, []).append(key)
            self.entries[key] = Entry(key, "object", location=ItemLocation(o["file"], 0, 0))
        for fname, keys in sorted(needed.items()):
            path = self.root / fname
            try:
                with os.fdopen(safefs.open_read(path, root=self.root), "rb") as fh:
                    objs = torch.load(fh, weights_only=True)
            except (FileNotFoundError, BadInput):
                if not os.path.lexists(path):
                    raise Incomplete(f"objects file is missing; {len(keys)} keys lose their values", where=str(path)) from None
                raise
            except FileNotFoundError:
                raise Incomplete(f"objects file is missing; {len(keys)} keys lose their values", where=str(path)) from None
            except Exception as exc:  # noqa: BLE001
                raise self._bad(f"objects file does not load with weights_only=True ({exc})", fname) from None
            if not isinstance(objs, dict):
                raise self._bad(f"objects file holds {type(objs).__name__}, not a dict", fname)
            lost = sorted(k for k in keys if k not in objs)
            if lost:
                raise self._bad(f"objects file lacks keys the index names: {lost[:5]}", fname)
            self._objects[fname] = objs
            self.file_sizes[fname] = safefs.regular_size(path, root=self.root)

    # ------------------------------------------------------------------ queries (CheckpointIndex interface)
    def data_files(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.suffix in (".safetensors", ".pt"))

    def writer_ranks(self) -> list[int]:
        return list(range(self.world_size))

    def holders(self, key: str) -> dict[int, Box]:
        """Every rank that holds ``key`` locally and its box (replicas included)."""
        return dict(getattr(self.entry(key), "holders", {}))

    # ------------------------------------------------------------------ reading bytes
    def _handle(self, name: str):
        h = self._handles.get(name)
        if h is None:
            from safetensors import safe_open

            safefs.regular_size(self.root / name, root=self.root)  # refuses a symlink out or a special file first
            try:
                h = safe_open(str(self.root / name), framework="pt")
            except Exception as exc:  # noqa: BLE001
                raise BadInput(f"cannot open safetensors file ({exc})", where=str(self.root / name)) from None
            self._handles[name] = h
        return h

    def read_local(self, rank: int, key: str) -> torch.Tensor:
        """The tensor ``rank`` holds for ``key`` (its own file)."""
        return self._handle(self.files[rank]).get_tensor(key)

    def read_object(self, key: str) -> Any:
        e = self.entry(key)
        if e.is_tensor:
            return self.read_tensor(key)
        return self._objects[e.location.file][key]

    def read_tensor(self, key: str) -> torch.Tensor:
        return self.read_box(key, whole(self.entry(key).shape))

    def read_box(self, key: str, box: Box) -> torch.Tensor:
        e = self.entry(key)
        if not e.is_tensor:
            raise BadInput(f"'{key}' is an object, not a tensor", where=str(self.root))
        if len(box.sizes) != len(e.shape) or not whole(e.shape).contains(box):
            raise BadInput(f"box {list(box.offsets)}+{list(box.sizes)} lies outside '{key}' of shape {list(e.shape)}",
                           where=str(self.root))
        if not e.shape:
            c = e.chunks[0]
            return self._handle(c.location.file).get_tensor(key)
        out = torch.empty(box.sizes, dtype=e.dtype)
        if box.is_empty():
            return out
        filled = 0
        for c in e.chunks:
            inter = c.box.intersect(box)
            if inter is None:
                continue
            sl = self._handle(c.location.file).get_slice(key)
            piece = sl[inter.relative_to(c.box).slices()]
            if piece.dtype != e.dtype or tuple(piece.shape) != inter.sizes:
                raise BadInput(f"'{key}' reads as {piece.dtype}{tuple(piece.shape)}, expected {e.dtype}{list(inter.sizes)}",
                               where=str(self.root / c.location.file))
            out[inter.relative_to(box).slices()] = piece
            filled += inter.numel
        if filled != box.numel:
            raise Incomplete(f"the pieces of '{key}' cover {filled} of {box.numel} elements of the requested box",
                             where=str(self.root / INDEX_FILE))
        return out

    def deep_check(self, progress: Any = None) -> list[Finding]:
        """Read every rank's every tensor (replicas too) and every object."""
        found: list[Finding] = []
        for e in self.entries.values():
            if e.is_tensor:
                for r, box in getattr(e, "holders", {}).items():
                    try:
                        x = self.read_local(r, e.key)
                        if tuple(x.shape) != box.sizes or x.dtype != e.dtype:
                            raise BadInput(f"holds {x.dtype}{tuple(x.shape)}, index says {e.dtype_name}{list(box.sizes)}")
                    except Exception as exc:  # noqa: BLE001
                        found.append(Finding("error", "unreadable_item", str(exc), file=self.files[r], keys=(e.key,)))
            if progress is not None:
                progress.update(len(e.chunks) if e.is_tensor else 1)
        self.findings.extend(found)
        return found


def is_local(path: str | Path) -> bool:
    return (Path(path) / INDEX_FILE).is_file()


def open_local(path: str | Path, *, trust_pickle: bool = False) -> LocalIndex:
    """Open and strictly validate a local-format directory (BadInput naming the file otherwise)."""
    return LocalIndex(Path(path), trust_pickle=trust_pickle)


def open_any(path: str | Path, *, trust_pickle: bool = False) -> CheckpointIndex | LocalIndex:
    """A DCP checkpoint's CheckpointIndex, or a LocalIndex when the directory holds ``local-index.json``,
    or an `ExportIndex` for a safetensors export (`reshard.io.safetensors_format.is_export`)."""
    if is_local(path):
        return open_local(path, trust_pickle=trust_pickle)
    from reshard.io.safetensors_format import is_export, open_export

    if is_export(path):
        return open_export(path, trust_pickle=trust_pickle)  # type: ignore[return-value]
    return CheckpointIndex.open(path, trust_pickle=trust_pickle)
