"""A consolidated safetensors export (`reshard export`, or any Hugging Face-style safetensors
checkpoint) as a read-only index with the `CheckpointIndex` interface, so that
`reshard inspect` and `reshard verify` (and `reshard import`) read it like a checkpoint.

What is recognised (:func:`is_export`):

* a single ``*.safetensors`` file;
* a directory with ``model.safetensors.index.json`` (``weight_map``: name -> shard file;
  a shard name with ``/`` is a file in a subdirectory; every shard named must exist inside
  the directory);
* a directory with ``model.safetensors``, or with ``*.safetensors`` files and no index
  (all files are read); a directory holding DCP's ``.metadata`` or reshard's
  ``local-index.json`` is never taken for an export.

Every tensor is one entry with one chunk (the whole tensor); :meth:`ExportIndex.read_box`
reads just the rows of dim 0 the box spans, with plain reads (not ``safe_open``'s mmap,
whose touched pages would count as resident memory). There are no objects.

Keys (``keys=``):

* ``"source"`` (default; what `verify` against the DCP source needs): the source DCP key
  recorded by `reshard export` in each shard's ``export_map`` header field (so a renamed
  ``model.embed_tokens.weight`` reads as ``model.tok_embeddings.weight`` again, and
  ``optim.<name>.exp_avg`` as ``optim.state.<fqn>.exp_avg``); tied copies (header field
  ``tied``) appear under each copy's source key too, read from the one stored tensor.
* ``"reshard"`` (what `import` writes): the reshard key convention, ``model.<fqn>`` and
  ``optim.state.<fqn>.<moment>``, from the recorded map and the source's key convention
  (header ``source_convention``), or, for a file reshard did not write, from the stored
  name: ``optim.X`` -> ``optim.state.X``, anything else -> ``model.<name>``, after the
  inverse of ``rename`` rules when given.
* ``"stored"``: the names as stored.

Every file is opened through `reshard.safefs` under the source directory: a shard or an
index that is a symlink out of it, a FIFO or a device is refused by name before a byte is
read, and the index JSON is capped in size and depth. Opening validates the headers (8-byte
length, JSON, dtype known, byte ranges consistent with shape x dtype and inside the file, no
overlaps) and accounts for every name against the index (:func:`check_shard_listed`,
:func:`check_index_found`): each
shard holds exactly the tensors the index lists for it, so a listed name no shard holds and a
stored tensor the index does not list are both errors naming the index, the name and the
shard, never a weight silently dropped or added. A problem raises `BadInput` (missing file:
`Incomplete`) naming the file. `reshard import` reads torch indexes
(``pytorch_model.bin.index.json``) with the same three functions.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from reshard.errors import BadInput, Incomplete
from reshard.model.geometry import Box, whole
from reshard.model.checkpoint import Chunk, Entry, EntryQueries, Finding, ItemLocation, checked_box
from reshard.model.reader import CheckpointReader
from reshard.model.dtypes import DTYPES, DType, from_torch
from reshard.storage.files.fileio import ShortRead, read_exact
from reshard import safefs

FORMAT = "safetensors-export"
FORMAT_VERSION = 1
ST_INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_HEADER_BYTES = 100 << 20   # safetensors' own limit for the JSON header
if TYPE_CHECKING:
    import torch

MAX_INT = (1 << 63) - 1
"""The largest size, offset or byte count torch holds (int64). A header integer past it was written by
no torch writer (and no safetensors library: its sizes are ``usize``, torch's ``int64``), and reshard's
chunk tables are int64 arrays that it would overflow, so every shape a header gives is checked against
it (byte offsets are bounded tighter still, by the file's own size)."""
FORGED_HINT = ("No torch writer records such a value: the file is corrupt or was edited. Save the checkpoint "
               "again, or restore the file from a good copy.")
INDEX_HINT = ("Fix or regenerate the index so that it lists every tensor of every shard, each in the shard "
              "that holds it, and names only shard files inside the source directory.")


SAFETENSORS_DTYPES: dict[str, DType] = {  # the format's dtype names (safetensors 0.8)
    name: DTYPES[torch_name] for name, torch_name in (
        ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"), ("I64", "int64"),
        ("I32", "int32"), ("I16", "int16"), ("I8", "int8"), ("U8", "uint8"), ("BOOL", "bool"), ("C64", "complex64"),
        ("U64", "uint64"), ("U32", "uint32"), ("U16", "uint16"), ("F8_E4M3", "float8_e4m3fn"),
        ("F8_E5M2", "float8_e5m2"), ("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
        ("F8_E8M0", "float8_e8m0fnu"), ("F4", "float4_e2m1fn_x2"))
}
"""Every dtype the format names; torch's others (complex32, complex128, the bits dtypes) it cannot store."""
SAFETENSORS_NAMES: dict[DType, str] = {dt: name for name, dt in SAFETENSORS_DTYPES.items()}
PACKED: dict[DType, int] = {DTYPES["float4_e2m1fn_x2"]: 2}
"""Dtypes whose torch element holds several of the format's: ``F4`` counts 4-bit values, two per
byte, so its header's last dimension is twice torch's (what ``safetensors.torch`` itself writes)."""


def header_shape(dtype: DType | "torch.dtype", shape: tuple[int, ...]) -> list[int]:
    """The shape a safetensors header records for a torch tensor of ``dtype`` and ``shape``."""
    dtype = from_torch(dtype)
    out = list(shape)
    if dtype in PACKED and out:
        out[-1] *= PACKED[dtype]
    return out


def torch_shape(dtype: DType, shape: list[int]) -> tuple[int, ...] | None:
    """The torch shape of a header's ``dtype`` and ``shape`` (None: a packed dtype whose last
    dimension does not divide into whole torch elements, or that has none)."""
    n = PACKED.get(dtype)
    if n is None:
        return tuple(shape)
    if not shape or not isinstance(shape[-1], int) or shape[-1] % n:
        return None
    return (*shape[:-1], shape[-1] // n)


def past_int64(values: list[int] | tuple[int, ...]) -> int | None:
    """The first of ``values`` torch's int64 cannot hold (see `MAX_INT`), or None when all fit."""
    return next((v for v in values if v > MAX_INT), None)


def is_export(path: str | Path) -> bool:
    """True for a ``.safetensors`` file or a directory of safetensors weights (not DCP, not reshard-local)."""
    p = Path(path)
    if p.is_file():
        return p.suffix == ".safetensors"
    if not p.is_dir():
        return False
    if (p / ".metadata").exists() or (p / "local-index.json").exists():
        return False
    if os.path.lexists(p / ST_INDEX) or os.path.lexists(p / SINGLE):
        return True  # present, whatever it is: reading it refuses a FIFO or a link out by name, never skips it
    return any(c.suffix == ".safetensors" for c in p.iterdir())


def _json_field(meta: dict[str, str], name: str, default: Any, where: str) -> Any:
    """A JSON-valued ``__metadata__`` field, of the same JSON type as ``default`` (depth capped)."""
    v = meta.get(name)
    if v is None:
        return default
    try:
        out = safefs.loads_json(v, where=where, what=f"safetensors metadata field '{name}'")
    except BadInput:
        raise BadInput(f"safetensors metadata field '{name}' is not JSON (or nests too deep)", where=where) from None
    if not isinstance(out, type(default)):
        raise BadInput(f"safetensors metadata field '{name}' is a {type(out).__name__}, not a {type(default).__name__}",
                       where=where)
    return out


def index_shard_name(name: str, file: Any, *, index: str) -> str:
    """The shard file an index entry names, as a path relative to the source directory.

    A name with ``/`` is a file in a subdirectory of the source and is fine; one that is
    empty, absolute, or climbs out with ``..`` is refused naming the entry (exit 2). Where a
    name that stays lexically inside really points (a symlink out) is checked when the file
    is opened (`reshard.safefs.open_read` under the source root).
    """
    if not isinstance(file, str) or not file:
        raise BadInput(f"index entry '{name}' names no shard file ({file!r})", where=index, hint=INDEX_HINT)
    if "\x00" in file:
        raise BadInput(f"index entry '{name}' names a shard file with a NUL byte ({file!r})", where=index,
                       hint=INDEX_HINT)
    if os.path.isabs(file) or ".." in Path(file).parts:
        raise safefs.UnsafeFile(f"index entry '{name}' names the shard '{file}', outside the source directory",
                                where=index, hint="Refusing to read files outside the source. " + INDEX_HINT)
    return os.path.normpath(file)


def read_index(path: str | Path, *, root: str | Path, what: str = "weight map index") -> tuple[dict[str, Any], dict[str, str]]:
    """An index file (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``, ...) and its ``weight_map``.

    Read through `reshard.safefs.read_json` (a regular file inside ``root``, capped in size
    and depth). Returns the index and its weight map with every shard name checked and
    normalised by :func:`index_shard_name`.
    """
    where = str(path)
    try:
        ix = safefs.read_json(path, root=root, what=what)
    except FileNotFoundError:
        raise BadInput(f"the {what} is a dangling link", where=where, hint=INDEX_HINT) from None
    except OSError as exc:
        raise BadInput(f"unreadable {what} ({exc.strerror or exc})", where=where) from None
    wm = ix.get("weight_map") if isinstance(ix, dict) else None
    if not isinstance(wm, dict):
        raise BadInput(f"the {what} has no 'weight_map' object (tensor name -> shard file)", where=where, hint=INDEX_HINT)
    if "metadata" in ix and ix["metadata"] is not None and not isinstance(ix["metadata"], dict):
        raise BadInput(f"the {what}'s 'metadata' is not an object", where=where, hint=INDEX_HINT)
    return ix, {name: index_shard_name(name, f, index=where) for name, f in wm.items()}


def check_shard_listed(index: str, shard: str, held: set[str] | list[str], weight_map: dict[str, str]) -> None:
    """Every tensor ``shard`` holds is listed by the index for that shard, or an error names the first that is not.

    Called as each shard is read; :func:`check_index_found` then checks the other way, once
    every shard has been read. A tensor the index does not list (or lists in another shard)
    would otherwise be imported although the index says it is not there, or in another file.
    """
    extra = sorted(n for n in held if weight_map.get(n) != shard)
    if extra:
        n = extra[0]
        other = weight_map.get(n)
        listed = f"the index lists it in '{other}'" if other is not None else "the index does not list it"
        more = f" (and {len(extra) - 1} more the index does not list there)" if len(extra) > 1 else ""
        raise BadInput(f"shard '{shard}' holds tensor '{n}', but {listed}{more}", where=index, hint=INDEX_HINT)


def check_index_found(index: str, weight_map: dict[str, str], found: set[str] | dict[str, Any]) -> None:
    """Every name the index lists was found (in the shard it is listed in), or an error names the first that was not.

    ``found``: the names read from the shards, each already checked by
    :func:`check_shard_listed` to be in the shard the index lists it in. A listed name no shard
    holds would otherwise be dropped from the import without a word.
    """
    lost = sorted(n for n in weight_map if n not in found)
    if lost:
        n = lost[0]
        more = f" (and {len(lost) - 1} more listed names no shard holds: {lost[1:4]})" if len(lost) > 1 else ""
        raise BadInput(f"the index lists tensor '{n}' in shard '{weight_map[n]}', which does not hold it{more}",
                       where=index, hint=INDEX_HINT)


def read_header(fd: int, *, size: int, where: str) -> tuple[dict[str, Any], int]:
    """The safetensors JSON header of the open file ``fd`` (``size`` bytes) and where its data starts.

    Read with ``pread`` from a descriptor `reshard.safefs.open_read` returned, so what is
    read is the regular file that was checked, never more than the length the file can hold.
    """
    head = os.pread(fd, 8, 0)
    if len(head) != 8:
        raise BadInput("not a safetensors file (shorter than 8 bytes)", where=where)
    (n,) = struct.unpack("<Q", head)
    if n > size - 8 or n > MAX_HEADER_BYTES:
        raise BadInput(f"not a safetensors file (header length {n}, file {size} bytes)", where=where)
    parts, got = [], 0
    while got < n:
        b = os.pread(fd, n - got, 8 + got)
        if not b:
            raise Incomplete(f"the safetensors header needs {n} bytes but the file ends earlier", where=where)
        parts.append(b)
        got += len(b)
    header = safefs.loads_json(b"".join(parts), where=where, what="safetensors header")
    if not isinstance(header, dict):
        raise BadInput("safetensors header is not a JSON object", where=where)
    return header, 8 + n


def sort_header_metadata(path: str | Path) -> None:
    """Rewrite, in place and at the same length, a safetensors file's ``__metadata__`` with its keys sorted.

    ``safetensors`` serialises the metadata from a hash map, whose order changes from process
    to process, so the same tensors and metadata give different bytes on each run. Sorting
    the keys makes files written with ``safetensors.torch.save_file`` reproducible; the
    header's length and every data offset stay as they were.
    """
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        raw = f.read(n)
        header = json.loads(raw)
        meta = header.get("__metadata__")
        if not isinstance(meta, dict) or len(meta) < 2:
            return
        ordered = {"__metadata__": dict(sorted(meta.items()))}
        ordered.update((k, v) for k, v in header.items() if k != "__metadata__")
        new = json.dumps(ordered, separators=(",", ":"), ensure_ascii=False).encode()
        body = raw.rstrip(b" ")
        if len(new) != len(body):  # a serialisation this does not reproduce exactly: leave the file as written
            return
        f.seek(8)
        f.write(new + raw[len(body):])


def default_key(name: str) -> str:
    """The reshard key for a stored name nobody recorded a source key for."""
    if name.startswith("optim."):
        rest = name[len("optim."):]
        return name if rest.startswith("state.") else "optim.state." + rest
    return "model." + name


def read_span(fd: int, start: int, n: int, *, name: str, path: Path, hint: str | None = None) -> bytearray:
    """``n`` bytes of tensor ``name`` at ``start`` of an open shard (closed here): a file that ends
    early is `Incomplete`, a failed read `BadInput`, both naming the tensor and the file."""
    buf = bytearray(n)
    try:
        read_exact(fd, buf, start)
    except ShortRead:
        raise Incomplete(f"'{name}' needs bytes {start}..{start + n} but the file ends earlier", where=str(path),
                         hint=hint) from None
    except OSError as exc:
        raise BadInput(f"cannot read '{name}' ({exc.strerror or exc})", where=str(path)) from None
    finally:
        os.close(fd)
    return buf


class ExportIndex(EntryQueries, CheckpointReader):
    """The read-only global view of a safetensors export (the CheckpointIndex interface)."""

    def __init__(self, path: str | Path, *, keys: str = "source", rename: Any = None, trust_pickle: bool = False,
                 source_key: Callable[[str, str], str] | None = None):
        """``source_key(convention, key)``: in ``keys="source"`` mode, the name a source key is read
        under (`reshard.semantics.conventions.reshard_key`: a parameter as ``model.<fqn>``); the
        storage layer knows no convention, so the caller that does passes it (None: the key as exported)."""
        if keys not in ("source", "reshard", "stored"):
            raise ValueError(f"keys must be source, reshard or stored, got {keys!r}")
        p = Path(path)
        self.path = p
        # the root every shard must lie in: the directory, or the real directory of a file named
        # on the command line (a file or root that is itself a symlink is the user's choice)
        self.root = safefs.resolve_root(p) if p.is_dir() else safefs.resolve_root(p).parent
        self.trust_pickle = trust_pickle
        self.version = f"{FORMAT}/{FORMAT_VERSION}"
        self.entries: dict[str, Entry] = {}
        self.findings: list[Finding] = []
        self.file_sizes: dict[str, int] = {}
        self.metadata: dict[str, str] = {}      # the first shard's __metadata__
        self.index: dict[str, Any] | None = None
        self.stored: dict[str, tuple[str, str]] = {}  # key -> (file, stored name)
        self.names: dict[str, str] = {}               # key -> stored name it reads (tied copies: the stored one)
        self.tied: list[list[str]] = []
        self._handles: dict[str, Any] = {}
        self._keys = keys
        self._rename = rename
        self._source_key = source_key
        self._load()

    # ------------------------------------------------------------------ validation
    def _bad(self, message: str, file: str | None = None) -> BadInput:
        where = str(self.root / file) if file else str(self.path)
        return BadInput(message, where=where, hint="The safetensors export is corrupt or incomplete.")

    def _files(self) -> tuple[list[str], dict[str, str] | None]:
        """The shard files to read (relative to the root) and the index's weight map, if any.

        An index, once present (whatever it is), is the only list: a FIFO or a link out named
        ``model.safetensors.index.json`` is refused, never skipped in favour of a directory scan.
        """
        p = self.path
        if p.is_file():
            return [safefs.resolve_root(p).name], None
        if not p.is_dir():
            raise BadInput("no such file or directory", where=str(p))
        ip = p / ST_INDEX
        if os.path.lexists(ip):
            ix, wm = read_index(self.root / ST_INDEX, root=self.root, what="safetensors index")
            self.index = ix
            return sorted(set(wm.values())), wm
        if os.path.lexists(p / SINGLE):
            return [SINGLE], None
        files = sorted(c.name for c in p.iterdir() if c.suffix == ".safetensors")
        if not files:
            raise BadInput("no .safetensors files", where=str(p))
        return files, None

    def _open_shard(self, fname: str) -> int:
        """A descriptor of shard ``fname``: a regular file inside the root (`reshard.safefs`)."""
        fpath = self.root / fname
        try:
            return safefs.open_read(fpath, root=self.root)
        except FileNotFoundError:
            if self.index is not None:
                names = sorted(n for n, f in self._weight_map.items() if f == fname)
                raise Incomplete(f"shard '{fname}' named by the index is missing; {len(names)} tensors lose their "
                                 f"bytes (first: {names[:3]})", where=str(self.root / ST_INDEX),
                                 hint="Copy the missing shard in, or " + INDEX_HINT[0].lower() + INDEX_HINT[1:]) from None
            raise Incomplete("shard file is missing", where=str(fpath)) from None
        except OSError as exc:
            raise BadInput(f"cannot open shard '{fname}' ({exc.strerror or exc})", where=str(fpath)) from None

    def _load(self) -> None:
        self._weight_map: dict[str, str] = {}
        files, weight_map = self._files()
        self._weight_map = weight_map or {}
        index_path = str(self.root / ST_INDEX)
        dtypes = SAFETENSORS_DTYPES
        located: dict[str, tuple[str, tuple[int, ...], DType, int, int]] = {}
        export_map: dict[str, str] = {}
        tied: list[list[str]] = []
        for fname in files:
            fpath = self.root / fname
            fd = self._open_shard(fname)
            try:
                size = os.fstat(fd).st_size
                header, data_start = read_header(fd, size=size, where=str(fpath))
            except OSError as exc:
                raise BadInput(f"cannot read shard '{fname}' ({exc.strerror or exc})", where=str(fpath)) from None
            finally:
                os.close(fd)
            self.file_sizes[fname] = size
            meta = header.pop("__metadata__", None) or {}
            if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
                raise self._bad("__metadata__ must map strings to strings", fname)
            if not self.metadata:
                self.metadata = dict(meta)
            export_map.update({k: v for k, v in _json_field(meta, "export_map", {}, str(fpath)).items()
                               if isinstance(v, str)})
            for g in _json_field(meta, "tied", [], str(fpath)):
                if isinstance(g, list) and all(isinstance(n, str) for n in g) and g not in tied:
                    tied.append(g)
            ranges = []
            for name, h in header.items():
                if not isinstance(h, dict):
                    raise self._bad(f"header entry '{name}' is not an object", fname)
                dt = dtypes.get(h.get("dtype"))
                shape = h.get("shape")
                offs = h.get("data_offsets")
                if dt is None:
                    raise self._bad(f"tensor '{name}' has unknown dtype {h.get('dtype')!r}", fname)
                if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
                    raise self._bad(f"tensor '{name}' has a bad shape {shape!r:.80}", fname)
                if (big := past_int64(shape)) is not None:  # an empty tensor's other dims: no byte bounds them
                    raise BadInput(f"tensor '{name}' has a dimension of {big} in its shape, past torch's int64 "
                                   f"sizes (at most {MAX_INT})", where=str(fpath), hint=FORGED_HINT, keys=[name])
                if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)):
                    raise self._bad(f"tensor '{name}' has bad data_offsets {offs!r}", fname)
                shape = torch_shape(dt, shape)
                if shape is None:
                    raise self._bad(f"tensor '{name}' is {h['dtype']} of shape {h.get('shape')!r}: its last dimension "
                                    f"does not hold whole pairs of 4-bit values", fname)
                numel = 1
                for s in shape:
                    numel *= s
                begin, end = offs
                if end - begin != numel * dt.itemsize or begin < 0:
                    raise self._bad(f"tensor '{name}': {end - begin} bytes for {h['dtype']}{shape}", fname)
                if data_start + end > size:
                    raise Incomplete(f"tensor '{name}' ends at byte {data_start + end} but the file has {size} bytes",
                                     where=str(fpath))
                if name in located:
                    raise self._bad(f"tensor '{name}' is stored in both {located[name][0]} and {fname}", fname)
                located[name] = (fname, tuple(shape), dt, data_start + begin, end - begin)
                ranges.append((begin, end, name))
            ranges.sort()
            for (b0, e0, n0), (b1, e1, n1) in zip(ranges, ranges[1:]):
                if b1 < e0:
                    raise self._bad(f"tensors '{n0}' and '{n1}' overlap", fname)
            if weight_map is not None:  # every tensor of the shard listed by the index for it
                check_shard_listed(index_path, fname, [n for _, _, n in ranges], weight_map)
        if weight_map is not None:  # and every name the index lists found (in the shard it is listed in)
            check_index_found(index_path, weight_map, located)
            rmeta = ((self.index or {}).get("metadata") or {}).get("reshard") or {}
            if isinstance(rmeta, dict) and isinstance(rmeta.get("export_map"), dict):
                export_map = {**{k: v for k, v in rmeta["export_map"].items() if isinstance(v, str)}, **export_map}
        self.tied = [list(g) for g in tied if isinstance(g, list)]

        keys = {name: self._key(name, export_map) for name in located}
        for g in self.tied:  # copies: the stored tensor under each copy's key
            stored = next((n for n in g if n in located), None)
            if stored is None:
                continue
            for n in g:
                if n not in located:
                    keys[n] = self._key(n, export_map, copy_of=stored)
        seen: dict[str, str] = {}
        for name, key in keys.items():
            if key in seen:
                raise self._bad(f"'{seen[key]}' and '{name}' both read as '{key}'")
            seen[key] = name
            real = name if name in located else next(n for g in self.tied if name in g for n in g if n in located)
            fname, shape, dt, start, length = located[real]
            e = Entry(key, "tensor", shape=shape, dtype=dt,
                      chunks=[Chunk(whole(shape), ItemLocation(fname, start, length))])
            self.entries[key] = e
            self.stored[key] = (fname, real)
            self.names[key] = name

    def _key(self, name: str, export_map: dict[str, str], copy_of: str | None = None) -> str:
        if self._keys == "stored":
            return name
        src_key = export_map.get(name)  # recorded for stored tensors and their tied copies alike
        if self._keys == "source":
            return src_key if src_key is not None else default_key(self._unrename(name))
        if src_key is not None and self._rename is None:
            if self._source_key is None:
                return src_key
            return self._source_key(self.metadata.get("source_convention") or "reshard", src_key)
        return default_key(self._unrename(name))

    def _unrename(self, name: str) -> str:
        if self._rename is None:
            return name
        if name.startswith("optim."):
            body, _, moment = name[len("optim."):].rpartition(".")
            return f"optim.{self._rename.apply(body)}.{moment}"
        return self._rename.apply(name)

    # ------------------------------------------------------------------ queries (CheckpointIndex interface)
    def data_files(self) -> list[str]:
        return sorted(self.file_sizes)

    def writer_ranks(self) -> list[int]:
        return [0]

    def entry(self, key: str) -> Entry:
        try:
            return self.entries[key]
        except KeyError:
            raise BadInput(f"no entry '{key}' in the export", where=str(self.path)) from None

    def item_count(self) -> int:
        return len({(e.chunks[0].location.file, e.chunks[0].location.offset) for e in self.entries.values()})

    def source_essentials(self) -> dict[str, Any]:
        """The manifest essentials `reshard export` recorded (JSON-decoded where they are JSON)."""
        out: dict[str, Any] = {}
        for k, v in self.metadata.items():
            if k in ("export_map",):
                continue
            try:
                out[k] = json.loads(v)
            except (ValueError, RecursionError):  # nested past the stack: kept as the text it is
                out[k] = v
        return out

    # ------------------------------------------------------------------ reading bytes
    def _read_rows(self, key: str, first: int, rows: int) -> "torch.Tensor":
        """Rows ``first .. first+rows`` along dim 0 (the whole tensor for 0-d), read with pread.

        Plain reads, not ``safe_open``'s mmap: pages of a memory-mapped file that were touched
        count as resident memory of this process, so a pass over a large export through
        mmap handles grows the RSS with the export's size.
        """
        import torch

        e = self.entry(key)
        fname, stored = self.stored[key]
        loc = e.chunks[0].location
        esize = e.dtype.itemsize
        shape = tuple(e.shape)
        row_elems = 1
        for s in shape[1:]:
            row_elems *= s
        if shape:
            start, n = loc.offset + first * row_elems * esize, rows * row_elems * esize
            out_shape = (rows, *shape[1:])
        else:
            start, n, out_shape = loc.offset, esize, ()
        buf = read_span(self._open_shard(fname), start, n, name=stored, path=self.root / fname)
        if n == 0:
            return torch.empty(out_shape, dtype=e.dtype.torch)
        return torch.frombuffer(buf, dtype=e.dtype.torch).reshape(out_shape)

    def read_object(self, key: str) -> Any:
        e = self.entry(key)
        return self.read_tensor(e.key)

    def read_tensor(self, key: str) -> "torch.Tensor":
        return self.read_box(key, whole(self.entry(key).shape))

    def read_box(self, key: str, box: Box) -> "torch.Tensor":
        e = checked_box(self.entry(key), box, where=str(self.path))
        if not e.shape:
            return self._read_rows(key, 0, 1)
        t = self._read_rows(key, box.offsets[0], box.sizes[0])
        if tuple(t.shape) != box.sizes:
            t = t[(slice(None), *box.slices()[1:])].contiguous()
        return t

    def deep_check(self, progress: Any = None, integrity: Any = None) -> list[Finding]:
        found: list[Finding] = []
        for key, e in self.entries.items():
            try:
                self.read_tensor(key)
            except Exception as exc:  # noqa: BLE001
                found.append(Finding("error", "unreadable_item", str(exc), file=self.stored[key][0], keys=(key,)))
            if progress is not None:  # by bytes: the key's logical bytes
                progress.update(e.nbytes)
        self.findings.extend(found)
        return found


def open_export(path: str | Path, *, keys: str = "source", rename: Any = None, trust_pickle: bool = False,
                source_key: Callable[[str, str], str] | None = None) -> ExportIndex:
    """Open and validate a safetensors export (see the module docstring for ``keys``, `ExportIndex` for ``source_key``)."""
    return ExportIndex(path, keys=keys, rename=rename, trust_pickle=trust_pickle, source_key=source_key)

