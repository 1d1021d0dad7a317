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
  :func:`reshard.model.layout.local_box` (shape, placement, target topology, r) is not None and
  not empty, the file holds the slice of the (transformed, for fused/padded/tied keys)
  global tensor at that box. **Replicas are included**: every rank holds its own copy of
  what it holds locally (a replicated norm weight is in every file of its stage; each
  TP rank of a dp replica group has the same piece). The one exception is per-rank state
  (roles ``rng``/``data`` with a rank in the key, e.g. ``rng.rank_3.torch``): only the
  rank it belongs to holds it (for data-parallel-rank state such as
  ``dataloader.dp_rank_1``: every rank of that data-parallel index). The safetensors
  metadata header is ``{"reshard": "local", "rank": "<r>", "world_size": "<W>"}``. Every dtype
  safetensors names is written as stored (float8, ``F4`` whose header counts 4-bit values,
  U16-U64, C64); the writer refuses complex32, complex128 and the bits dtypes by key before
  the first file (`reshard.engine.local_output`).
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
writer (``reshard.semantics.transforms.write_transformed``) and are kept only until the last rank that
needs them, up to ``reshard.engine.local_output.TRANSFORM_CACHE_BYTES``; past that they are recomputed
per rank. This module reads the format; `reshard.engine.local_output` writes it from a plan.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from reshard import safefs
from reshard.errors import BadInput, Incomplete
from reshard.model.geometry import Box, coverage_problems, whole
from reshard.model.checkpoint import Chunk, Entry, EntryQueries, Finding, ItemLocation, checked_box
from reshard.model.reader import CheckpointReader
from reshard.storage.checkpoints.index import CheckpointIndex
from reshard.model.dtypes import DType, lookup
from reshard.storage.checkpoints.safetensors_format import PACKED, SAFETENSORS_DTYPES, torch_shape

FORMAT = "reshard-local"
FORMAT_VERSION = 1
INDEX_FILE = "local-index.json"
SHARED_OBJECTS = "objects.pt"



def rank_file(rank: int, world: int) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.safetensors"


def rank_objects_file(rank: int) -> str:
    return f"rank-{rank:05d}-objects.pt"


if TYPE_CHECKING:
    import torch

    from reshard.storage.objectstore.remote import RemoteCheckpoint


def dtype_name(dt: "DType | torch.dtype") -> str:
    return str(dt).removeprefix("torch.")


def index_dtype(name: str) -> DType | None:
    """The dtype an index names, from a static table (never ``getattr(torch, name)`` on a file's name)."""
    return lookup(str(name))


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


class LocalIndex(EntryQueries, CheckpointReader):
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
            dtype = index_dtype(t["dtype"])
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
            if SAFETENSORS_DTYPES.get(h.get("dtype")) != dtype:
                raise self._bad(f"tensor '{key}' is {h.get('dtype')} but the index says {t['dtype']}", fname)
            if not isinstance(h.get("shape", []), list) or torch_shape(dtype, h.get("shape", [])) != box.sizes:  # F4: values
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
                    import torch  # the objects files are torch.save pickles: decoding them needs torch

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

    def read_local(self, rank: int, key: str) -> "torch.Tensor":
        """The tensor ``rank`` holds for ``key`` (its own file)."""
        return self._handle(self.files[rank]).get_tensor(key)

    def read_object(self, key: str) -> Any:
        e = self.entry(key)
        if e.is_tensor:
            return self.read_tensor(key)
        return self._objects[e.location.file][key]

    def read_tensor(self, key: str) -> "torch.Tensor":
        return self.read_box(key, whole(self.entry(key).shape))

    def read_box(self, key: str, box: Box) -> "torch.Tensor":
        import torch

        e = checked_box(self.entry(key), box, where=str(self.root))
        if not e.shape:
            c = e.chunks[0]
            return self._handle(c.location.file).get_tensor(key)
        out = torch.empty(box.sizes, dtype=e.dtype.torch)
        if box.is_empty():
            return out
        filled = 0
        for c in e.chunks:
            inter = c.box.intersect(box)
            if inter is None:
                continue
            if e.dtype in PACKED:  # safetensors 0.8's get_slice reshapes F4 by its value count and fails: the piece whole
                piece = self._handle(c.location.file).get_tensor(key)[inter.relative_to(c.box).slices()]
            else:
                piece = self._handle(c.location.file).get_slice(key)[inter.relative_to(c.box).slices()]
            if piece.dtype != e.dtype.torch or tuple(piece.shape) != inter.sizes:
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
                        if tuple(x.shape) != box.sizes or x.dtype != e.dtype.torch:
                            raise BadInput(f"holds {x.dtype}{tuple(x.shape)}, index says {e.dtype_name}{list(box.sizes)}")
                    except Exception as exc:  # noqa: BLE001
                        found.append(Finding("error", "unreadable_item", str(exc), file=self.files[r], keys=(e.key,)))
            if progress is not None:  # by bytes: the key's logical bytes once its copies are read
                progress.update(e.nbytes)
        self.findings.extend(found)
        return found


def is_local(path: str | Path) -> bool:
    return (Path(path) / INDEX_FILE).is_file()


def open_local(path: str | Path, *, trust_pickle: bool = False) -> LocalIndex:
    """Open and strictly validate a local-format directory (BadInput naming the file otherwise)."""
    return LocalIndex(Path(path), trust_pickle=trust_pickle)


def open_any(path: str | Path, *, trust_pickle: bool = False,
             source_key: Callable[[str, str], str] | None = None,
             remote: RemoteCheckpoint | None = None) -> CheckpointIndex | LocalIndex:
    """A DCP checkpoint's CheckpointIndex, or a LocalIndex when the directory holds ``local-index.json``,
    or an `HfDcpIndex` for torch's safetensors-backed DCP (`reshard.storage.checkpoints.hf_dcp.is_hf_dcp`),
    or an `ExportIndex` for a safetensors export (`reshard.storage.checkpoints.safetensors_format.is_export`),
    whose keys ``source_key`` names (`ExportIndex`). ``remote``: the store ``path`` stands for (a staged
    directory), handed to the DCP reader, whose item reads fetch from it."""
    if is_local(path):
        return open_local(path, trust_pickle=trust_pickle)
    from reshard.storage.checkpoints.hf_dcp import export_note, is_hf_dcp, open_hf_dcp

    if is_hf_dcp(path):  # torch's safetensors-backed DCP (HuggingFaceStorageWriter, save_distributed=True)
        return open_hf_dcp(path, trust_pickle=trust_pickle)  # type: ignore[return-value]
    from reshard.storage.checkpoints.safetensors_format import is_export, open_export

    if is_export(path):
        ex = open_export(path, trust_pickle=trust_pickle, source_key=source_key)
        ex.findings.append(export_note(path, url=remote.url if remote is not None else None))  # inspect names it, and the command that takes it (import)
        return ex  # type: ignore[return-value]
    return CheckpointIndex.open(path, trust_pickle=trust_pickle, remote=remote)
