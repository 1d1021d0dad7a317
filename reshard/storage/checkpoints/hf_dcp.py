"""torch's safetensors-backed DCP (``HuggingFaceStorageWriter(save_distributed=True)``) as a read-only
index with the `CheckpointIndex` interface, so that `reshard inspect`, `plan`, `convert` and
`verify` read it as the sharded checkpoint it is.

What torch writes (torch 2.13, ``torch/distributed/checkpoint/hf_storage.py`` and
``filesystem.py``): no ``.metadata`` and no index; each rank that saved something writes
``shard-{rank+1:05d}-model-{i:05d}-of-{n:05d}.safetensors`` (``i``/``n`` from
``fqn_to_index_mapping``, 1 of 1 without one), a plain safetensors file of its local chunks
under their global keys, whose ``__metadata__`` holds::

    {"DCP_SHARDING_INFO": "{\\"<key>\\": {\\"saved_offsets\\": [o0, o1, ...]}, ...}",
     "DCP_VERSION": "1.0", "format": "pt"}

``saved_offsets`` is where the chunk starts in the global tensor; its shape is the
safetensors shape. The format records no global shape: torch's ``HuggingFaceStorageReader``
takes, per dim, the largest ``offset + size`` of the chunks, and so does this reader (a lost
file that held a tensor's last rows therefore reads as a smaller tensor, as it does in torch;
a lost file that held any other rows is a gap, reported like DCP's). Only tensors are stored:
torch writes a non-tensor value (an optimizer's ``param_groups``) as pickled bytes in front of
the safetensors bytes, a file neither torch nor this reader can read.

Recognised (:func:`is_hf_dcp`): a directory without ``.metadata``, ``local-index.json`` or
``model.safetensors.index.json`` whose ``*.safetensors`` files carry ``DCP_SHARDING_INFO`` (a
name of torch's ``shard-...`` pattern is enough to be read as one, so that a damaged shard is
refused by name rather than taken for an export). The consolidated form
(``enable_consolidation=True``: full tensors in ``model-0000i-of-0000n.safetensors`` with
``model.safetensors.index.json``, the shards kept in ``sharded/``) is an export, read by
`reshard.storage.checkpoints.safetensors_format`; :func:`consolidated_shards` finds its ``sharded/``.

Every file is opened through `reshard.safefs` (a regular file inside the root, never a link
out, a FIFO or a device), headers are read by `reshard.storage.checkpoints.safetensors_format.read_header`
(length capped and inside the file, JSON depth capped) and validated strictly: dtype known,
shape and ``data_offsets`` consistent with each other and inside the file, no two tensors of a
file overlapping, every stored tensor with offsets of its rank, no offsets for a tensor the file
lacks, one dtype per key, no chunk stored twice. Every integer a header gives is bounded:
``data_offsets`` by the file's own size, and what no byte of the file bounds (a dimension of an
empty chunk, a saved offset whose neighbours may be in a lost file) by what torch holds
(`MAX_INT`, int64): each dimension, each saved offset, each chunk's ``offset + size`` and the
byte size of the global tensor the chunks imply. Past int64 no torch writer wrote the value and
reshard's chunk tables (numpy int64) would overflow, so the tensor and file are named instead of an
"unexpected OverflowError". A problem raises `BadInput` (a truncated file: `Incomplete`) naming
the file and the key; chunks that do not tile the tensor are findings (exit 2 from inspect,
refused by plan), as for DCP. safetensors records no checksums, so a flipped payload byte
cannot be detected in the source; `convert` compares its output with these bytes value for value.
"""
from __future__ import annotations

import os
import re
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, Any


from reshard import safefs
from reshard.errors import BadInput, Incomplete
from reshard.model.checkpoint import Chunk, Entry, EntryQueries, Finding, ItemLocation, checked_box
from reshard.model.reader import CheckpointReader
from reshard.model.geometry import Box, coverage_problems, whole
from reshard.storage.checkpoints.index import CheckpointIndex
from reshard.model.dtypes import DType
from reshard.storage.checkpoints.safetensors_format import (FORGED_HINT, MAX_INT, SAFETENSORS_DTYPES, ST_INDEX, past_int64,
                                                read_header, read_span, torch_shape)

FORMAT = "hf-safetensors-dcp"
if TYPE_CHECKING:
    import torch

    from reshard.storage.objectstore.remote import RemoteCheckpoint

SHARDING_KEY = "DCP_SHARDING_INFO"   # torch's CUSTOM_METADATA_KEY
VERSION_KEY = "DCP_VERSION"
OFFSETS_KEY = "saved_offsets"
SUFFIX = ".safetensors"
SHARDED_DIR = "sharded"              # where enable_consolidation=True keeps the per-rank shards
SHARD_FILE = re.compile(r"^shard-(\d+)-model-(\d+)-of-(\d+)\.safetensors$")
HINT = "The safetensors shards are corrupt or incomplete: save the checkpoint again, or copy the missing files in."
ZIP_MAGIC = b"PK\x03\x04"  # a torch.save archive: what torch writes for a non-tensor value
NON_TENSOR_MESSAGE = ("the file starts with a torch.save archive, not a safetensors header: torch's "
                      "HuggingFaceStorageWriter wrote non-tensor values (an optimizer's param_groups, counters) in "
                      "front of the tensors, and neither torch's HuggingFaceStorageReader nor reshard can read such "
                      "a file")
NON_TENSOR_HINT = ("Save only tensors through HuggingFaceStorageWriter (the model's state dict) and the rest with "
                   "torch's default FileSystemWriter, which reshard reads as DCP.")

__all__ = ["FORMAT", "HfDcpIndex", "consolidated_shards", "export_note", "export_refusal", "is_hf_dcp", "open_hf_dcp",
           "open_source"]


def _shard_files(p: Path) -> list[str]:
    return sorted(c.name for c in p.iterdir() if c.name.endswith(SUFFIX))


def _carries_sharding_info(path: Path, root: Path) -> bool:
    """Whether one safetensors file's header names DCP_SHARDING_INFO; False when it cannot be read
    (the reader that takes the directory then names the problem)."""
    try:
        fd = safefs.open_read(path, root=root)
    except (OSError, BadInput):
        return False
    try:
        header, _ = read_header(fd, size=os.fstat(fd).st_size, where=str(path))
    except (OSError, BadInput):
        return False
    finally:
        os.close(fd)
    meta = header.get("__metadata__")
    return isinstance(meta, dict) and SHARDING_KEY in meta


def is_hf_dcp(path: str | Path) -> bool:
    """True for a directory of torch's safetensors-backed DCP shards (see the module docstring)."""
    p = Path(path)
    try:
        if not p.is_dir() or any(os.path.lexists(p / n) for n in (".metadata", "local-index.json", ST_INDEX)):
            return False
        files = _shard_files(p)
    except OSError:  # an unreadable directory: the DCP reader's refusal names it
        return False
    if not files:
        return False
    if any(SHARD_FILE.match(f) for f in files):
        return True
    return _carries_sharding_info(p / files[0], safefs.resolve_root(p))


def consolidated_shards(path: str | Path) -> Path | None:
    """``PATH/sharded`` when ``path`` is torch's consolidated output (``enable_consolidation=True``) and
    that folder holds its per-rank shards, which `reshard convert` reads directly; else None."""
    p = Path(path)
    sub = p / SHARDED_DIR
    try:
        return sub if p.is_dir() and sub.is_dir() and not sub.is_symlink() and is_hf_dcp(sub) else None
    except OSError:
        return None


class HfDcpIndex(EntryQueries, CheckpointReader):
    """The read-only global view of torch's safetensors-backed DCP (the CheckpointIndex interface)."""

    def __init__(self, root: str | Path, *, trust_pickle: bool = False):
        self.root = Path(root)
        self.trust_pickle = trust_pickle  # nothing here is pickled; kept for the interface
        self.remote: RemoteCheckpoint | None = None  # read from local files only; kept for the interface
        self.entries: dict[str, Entry] = {}
        self.findings: list[Finding] = []
        self.file_sizes: dict[str, int] = {}
        self.dcp_version: str | None = None
        self.version = FORMAT
        self._load()

    # ------------------------------------------------------------------ validation
    def _bad(self, message: str, file: str | None = None, *, hint: str = HINT, key: str | None = None) -> BadInput:
        return BadInput(message, where=str(self.root / file) if file else str(self.root), hint=hint,
                        keys=[key] if key is not None else None)

    def _forged(self, message: str, file: str, key: str) -> BadInput:
        """A header integer past what torch holds (`MAX_INT`): a value no writer made, named with its tensor."""
        return self._bad(message, file, hint=FORGED_HINT, key=key)

    def _load(self) -> None:
        if not self.root.is_dir():
            raise BadInput("no such checkpoint directory", where=str(self.root))
        real_root = safefs.resolve_root(self.root)
        files = _shard_files(self.root)
        if not files:
            raise BadInput("no .safetensors files", where=str(self.root))
        pieces: dict[str, list[tuple[Box, ItemLocation]]] = {}
        dtypes: dict[str, tuple[DType, str]] = {}
        for fname in files:
            for key, box, dt, loc in self._read_file(fname, real_root):
                if key in dtypes and dtypes[key][0] != dt:
                    raise self._bad(f"tensor '{key}' is {dt} here but {dtypes[key][0]} in '{dtypes[key][1]}'", fname)
                dtypes.setdefault(key, (dt, fname))
                pieces.setdefault(key, []).append((box, loc))
        for key in sorted(pieces):
            self._add_entry(key, dtypes[key][0], pieces[key])
        self.version = f"{FORMAT}/{self.dcp_version}" if self.dcp_version else FORMAT

    def _read_file(self, fname: str, real_root: Path) -> list[tuple[str, Box, DType, ItemLocation]]:
        """One shard's tensors: (key, global box, dtype, byte range), every header field checked."""
        fpath = self.root / fname
        try:
            fd = safefs.open_read(fpath, root=real_root)
        except FileNotFoundError:
            raise Incomplete("shard file is missing (it was listed a moment ago)", where=str(fpath)) from None
        try:
            size = os.fstat(fd).st_size
            try:
                header, data_start = read_header(fd, size=size, where=str(fpath))
            except BadInput:
                if os.pread(fd, len(ZIP_MAGIC), 0) == ZIP_MAGIC:
                    raise BadInput(NON_TENSOR_MESSAGE, where=str(fpath), hint=NON_TENSOR_HINT) from None
                raise
        except OSError as exc:
            raise self._bad(f"cannot read shard '{fname}' ({exc.strerror or exc})", fname) from None
        finally:
            os.close(fd)
        self.file_sizes[fname] = size
        offsets = self._sharding_info(header.pop("__metadata__", None), fname)
        out, ranges = [], []
        for name, h in header.items():
            dt, shape, begin, end = self._tensor_header(name, h, fname, data_start, size)
            at = offsets.pop(name, None)
            if at is None:
                raise self._bad(f"tensor '{name}' has no entry in {SHARDING_KEY}: its place in the global tensor "
                                "is unknown", fname)
            if len(at) != len(shape):
                raise self._bad(f"tensor '{name}' has {len(shape)} dims but {SHARDING_KEY} gives {len(at)} offsets "
                                f"({at!r:.80})", fname)
            ends = [o + n for o, n in zip(at, shape)]
            if (big := past_int64(ends)) is not None:
                raise self._forged(f"tensor '{name}' at {SHARDING_KEY} offsets {at!r:.80} with shape "
                                   f"{list(shape)!r:.80} ends at {big} along a dim, past torch's int64 sizes (at most "
                                   f"{MAX_INT})", fname, name)
            ranges.append((begin, end, name))
            out.append((name, Box(tuple(at), tuple(shape)), dt, ItemLocation(fname, data_start + begin, end - begin)))
        if offsets:
            raise self._bad(f"{SHARDING_KEY} names tensors the file does not hold: {sorted(offsets)[:5]}", fname)
        ranges.sort()
        for (_b0, e0, n0), (b1, _e1, n1) in zip(ranges, ranges[1:]):
            if b1 < e0:
                raise self._bad(f"tensors '{n0}' and '{n1}' overlap", fname)
        return out

    def _sharding_info(self, meta: Any, fname: str) -> dict[str, list[int]]:
        """``DCP_SHARDING_INFO`` of one shard: key -> ``saved_offsets`` (non-negative integers)."""
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise self._bad("__metadata__ must map strings to strings", fname)
        raw = meta.get(SHARDING_KEY)
        if raw is None:
            raise self._bad(f"no {SHARDING_KEY} in the header: where its tensors lie in the global tensors is "
                            "unknown (every shard torch's HuggingFaceStorageWriter writes carries it)", fname)
        version = meta.get(VERSION_KEY)
        if self.dcp_version is None:
            self.dcp_version = version
        elif version != self.dcp_version:
            raise self._bad(f"{VERSION_KEY} {version!r} differs from the other shards' {self.dcp_version!r}", fname)
        info = safefs.loads_json(raw, where=str(self.root / fname), what=f"{SHARDING_KEY} header field")
        if not isinstance(info, dict):
            raise self._bad(f"{SHARDING_KEY} is a {type(info).__name__}, not an object", fname)
        out: dict[str, list[int]] = {}
        for key, v in info.items():
            at = v.get(OFFSETS_KEY) if isinstance(v, dict) else None
            if not isinstance(at, list) or not all(type(o) is int and o >= 0 for o in at):
                raise self._bad(f"{SHARDING_KEY} of tensor '{key}' has no list of non-negative "
                                f"'{OFFSETS_KEY}' ({v!r:.80})", fname)
            if (big := past_int64(at)) is not None:
                raise self._forged(f"{SHARDING_KEY} of tensor '{key}' has the {OFFSETS_KEY} {big}, past torch's int64 "
                                   f"sizes (at most {MAX_INT})", fname, key)
            out[key] = at
        return out

    def _tensor_header(self, name: str, h: Any, fname: str, data_start: int,
                       size: int) -> tuple[DType, tuple[int, ...], int, int]:
        """A header entry's dtype, torch shape and byte range, checked against each other and the file."""
        if not isinstance(h, dict):
            raise self._bad(f"header entry '{name}' is not an object", fname)
        dt = SAFETENSORS_DTYPES.get(h.get("dtype"))
        shape, offs = h.get("shape"), h.get("data_offsets")
        if dt is None:
            raise self._bad(f"tensor '{name}' has unknown dtype {h.get('dtype')!r}", fname)
        if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
            raise self._bad(f"tensor '{name}' has a bad shape {shape!r:.80}", fname)
        if (big := past_int64(shape)) is not None:  # an empty chunk's other dims: no byte of the file bounds them
            raise self._forged(f"tensor '{name}' has a dimension of {big} in its shape, past torch's int64 sizes "
                               f"(at most {MAX_INT})", fname, name)
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)):
            raise self._bad(f"tensor '{name}' has bad data_offsets {offs!r:.80}", fname)
        stored, shape = shape, torch_shape(dt, shape)  # F4 headers count 4-bit values, two per torch element
        if shape is None:
            raise self._bad(f"tensor '{name}' is {h['dtype']} of shape {stored!r:.80}: its last dimension does not "
                            "hold whole pairs of 4-bit values", fname)
        begin, end = offs
        if end > MAX_INT:  # no file holds 2^63 bytes (off_t is int64): not a truncated file but a forged offset
            raise self._forged(f"tensor '{name}' has data_offsets ending at byte {end}, past what any file can hold "
                               f"(at most {MAX_INT} bytes)", fname, name)
        if begin < 0 or end - begin != prod(shape) * dt.itemsize:
            raise self._bad(f"tensor '{name}': {end - begin} bytes for {h['dtype']}{stored}", fname)
        if data_start + end > size:
            raise Incomplete(f"tensor '{name}' ends at byte {data_start + end} but the file has {size} bytes",
                             where=str(self.root / fname), hint=HINT)
        return dt, shape, begin, end

    def _add_entry(self, key: str, dtype: DType, pieces: list[tuple[Box, ItemLocation]]) -> None:
        """One key from its chunks; its global shape is their extent (the format records none, see the
        module docstring). A chunk stored twice is an error; gaps and overlaps are findings."""
        seen: dict[tuple[int, ...], str] = {}
        for box, loc in pieces:
            if box.offsets in seen:
                raise self._bad(f"tensor '{key}': the chunk at {list(box.offsets)} is stored in both "
                                f"'{seen[box.offsets]}' and '{loc.file}'", loc.file)
            seen[box.offsets] = loc.file
        ndim = len(pieces[0][0].sizes)
        if any(len(b.sizes) != ndim for b, _ in pieces):
            raise self._bad(f"tensor '{key}' is stored with different numbers of dims", pieces[0][1].file)
        shape = tuple(max(b.offsets[d] + b.sizes[d] for b, _ in pieces) for d in range(ndim))
        if prod(shape) * dtype.itemsize > MAX_INT:  # each extent fits (checked per chunk); their product may not
            far = max(pieces, key=lambda p: max(o + n for o, n in zip(p[0].offsets, p[0].sizes)))
            raise self._forged(f"tensor '{key}': its chunks make it {str(dtype).removeprefix('torch.')}{list(shape)}, "
                               f"{prod(shape) * dtype.itemsize} bytes, past the int64 byte counts torch holds (at "
                               f"most {MAX_INT}); the chunk of shape {list(far[0].sizes)} at {SHARDING_KEY} offsets "
                               f"{list(far[0].offsets)} reaches farthest", far[1].file, key)
        chunks = sorted((Chunk(b, loc) for b, loc in pieces), key=lambda c: c.box.offsets)
        self.entries[key] = Entry(key, "tensor", shape=shape, dtype=dtype, chunks=chunks)
        for p in coverage_problems(shape, (c.box for c in chunks)):
            self.findings.append(Finding("error", f"chunk_{p.kind}", f"tensor '{key}': {p.detail}",
                                         file=chunks[0].location.file, keys=(key,)))

    # ------------------------------------------------------------------ queries (CheckpointIndex interface)
    def data_files(self) -> list[str]:
        return _shard_files(self.root)

    def writer_of(self, file: str) -> int | None:
        """The rank that wrote a shard: torch numbers them ``shard-{rank + 1}`` (None for other names)."""
        m = SHARD_FILE.match(file)
        return int(m.group(1)) - 1 if m and int(m.group(1)) >= 1 else None

    def writer_ranks(self) -> list[int]:
        return sorted({r for f in self.file_sizes if (r := self.writer_of(f)) is not None})

    # ------------------------------------------------------------------ reading bytes
    def _read_rows(self, e: Entry, c: Chunk, first: int, rows: int) -> "torch.Tensor":
        """Rows ``first .. first+rows`` of one stored chunk (the whole chunk for 0-d), read with pread."""
        import torch

        sizes, esize = c.box.sizes, e.dtype.itemsize
        row = prod(sizes[1:]) * esize if sizes else esize
        start, n = c.location.offset + first * row, (rows * row if sizes else esize)
        out_shape = (rows, *sizes[1:]) if sizes else ()
        if n == 0:
            return torch.empty(out_shape, dtype=e.dtype.torch)
        path = self.root / c.location.file
        try:
            fd = safefs.open_read(path, root=safefs.resolve_root(self.root))
        except FileNotFoundError:
            raise Incomplete(f"shard file holding '{e.key}' is missing", where=str(path), hint=HINT) from None
        buf = read_span(fd, start, n, name=e.key, path=path, hint=HINT)
        return torch.frombuffer(buf, dtype=e.dtype.torch).reshape(out_shape)

    def read_object(self, key: str) -> Any:
        return self.read_tensor(key)  # every entry is a tensor

    def read_tensor(self, key: str) -> "torch.Tensor":
        return self.read_box(key, whole(self.entry(key).shape))

    def read_box(self, key: str, box: Box) -> "torch.Tensor":
        """One box of a tensor from the chunks it meets, reading only the rows of each that it spans."""
        import torch

        e = checked_box(self.entry(key), box, where=str(self.root))
        if not e.shape:
            return self._read_rows(e, e.chunks[0], 0, 1)
        out = torch.empty(box.sizes, dtype=e.dtype.torch)
        filled = 0
        for c in e.chunks:
            inter = c.box.intersect(box)
            if inter is None or inter.is_empty():
                continue
            rel = inter.relative_to(c.box)
            rows = self._read_rows(e, c, rel.offsets[0], rel.sizes[0])
            out[inter.relative_to(box).slices()] = rows[(slice(None), *rel.slices()[1:])]
            filled += inter.numel
        if filled != box.numel:
            raise Incomplete(f"the chunks of '{key}' cover {filled} of {box.numel} elements of the requested box",
                             where=str(self.root), hint=HINT)
        return out

    def deep_check(self, progress: Any = None, integrity: Any = None) -> list[Finding]:
        """Read every chunk (safetensors records no checksums: this proves the bytes are there and readable)."""
        found: list[Finding] = []
        for e in self.entries.values():
            for c in e.chunks:
                try:
                    self._read_rows(e, c, 0, c.box.sizes[0] if c.box.sizes else 1)
                except BadInput as exc:
                    found.append(Finding("error", "unreadable_item", exc.message, file=c.location.file, keys=(e.key,)))
            if progress is not None:
                progress.update(e.nbytes)
        self.findings.extend(found)
        return found


def open_hf_dcp(path: str | Path, *, trust_pickle: bool = False) -> HfDcpIndex:
    """Open and validate torch's safetensors-backed DCP (BadInput naming the file otherwise)."""
    return HfDcpIndex(Path(path), trust_pickle=trust_pickle)


def open_source(path: str | Path, *, trust_pickle: bool = False,
                remote: RemoteCheckpoint | None = None) -> CheckpointIndex | HfDcpIndex:
    """What `convert` reads: a DCP checkpoint, or torch's safetensors-backed DCP, the same sharded state
    in other files. Anything else is opened as DCP, whose refusal says what the directory lacks.
    ``remote``: the store ``path`` stands for (a staged directory), handed to the DCP reader."""
    if is_hf_dcp(path):
        return open_hf_dcp(path, trust_pickle=trust_pickle)
    return CheckpointIndex.open(path, trust_pickle=trust_pickle, remote=remote)


def _export_way_out(path: str | Path, to: str, url: str | None = None) -> str:
    """The commands that take a consolidated export further: import, and for torch's consolidated
    output the convert of its per-rank shards. ``url``: the store ``path`` stands for."""
    if url is not None:  # import reads local files: name the URL, never the private staged folder
        return (f"`reshard import DIR DST --to {to}` on a local copy of {url} makes a DCP "
                "checkpoint of it (a warm start of the weights)")
    out = f"`reshard import {path} DST --to {to}` makes a DCP checkpoint of it (a warm start of the weights)"
    shards = consolidated_shards(path)
    if shards is not None:
        out += (f"; its per-rank shards in {shards} are torch's safetensors-backed DCP, which "
                f"`reshard convert {shards} DST --to {to}` reads directly")
    return out


def export_note(path: str | Path, url: str | None = None) -> Finding:
    """What inspect says of a consolidated safetensors export: what it is, and which command takes it."""
    what = ("torch's consolidated safetensors (HuggingFaceStorageWriter with enable_consolidation=True)"
            if consolidated_shards(path) is not None else "a consolidated safetensors export")
    return Finding("info", "consolidated_export",
                   f"{what}: full tensors, not a sharded checkpoint, so plan and convert do not take it; "
                   + _export_way_out(path, "SPEC", url))


def export_refusal(path: str | Path, to: str, url: str | None = None) -> BadInput:
    """What plan and convert raise for a consolidated export (both, so they accept the same sources)."""
    return BadInput("a consolidated safetensors export (full tensors), not a sharded checkpoint: plan and convert "
                    "lay out a DCP checkpoint's shards", where=str(path),
                    hint=_export_way_out(path, to, url)[0].upper() + _export_way_out(path, to, url)[1:] + ".")
