"""A consolidated safetensors export (`reshard export`, or any Hugging Face-style safetensors
checkpoint) as a read-only index with the `CheckpointIndex` interface, so that
`reshard inspect` and `reshard verify` (and `reshard import`) read it like a checkpoint.

What is recognised (:func:`is_export`):

* a single ``*.safetensors`` file;
* a directory with ``model.safetensors.index.json`` (``weight_map``: name -> shard file,
  every shard named in it must exist);
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

Opening validates the headers (8-byte length, JSON, dtype known, byte ranges consistent
with shape x dtype and inside the file, no overlaps) and the index (every name mapped
exactly once, each to a file that holds it); a problem raises `BadInput` (missing file:
`Incomplete`) naming the file.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from reshard.errors import BadInput, Incomplete
from reshard.geometry import Box, whole
from reshard.index import Chunk, Entry, EntryQueries, Finding
from reshard.io.dcp import ItemLocation

FORMAT = "safetensors-export"
FORMAT_VERSION = 1
ST_INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _st_dtypes() -> dict[str, torch.dtype]:
    from reshard.io.local_format import _ST_DTYPES

    return _ST_DTYPES


def is_export(path: str | Path) -> bool:
    """True for a ``.safetensors`` file or a directory of safetensors weights (not DCP, not reshard-local)."""
    p = Path(path)
    if p.is_file():
        return p.suffix == ".safetensors"
    if not p.is_dir():
        return False
    if (p / ".metadata").exists() or (p / "local-index.json").exists():
        return False
    if (p / ST_INDEX).is_file() or (p / SINGLE).is_file():
        return True
    return any(c.suffix == ".safetensors" for c in p.iterdir())


def _json_field(meta: dict[str, str], name: str, default: Any, where: str) -> Any:
    v = meta.get(name)
    if v is None:
        return default
    try:
        return json.loads(v)
    except ValueError:
        raise BadInput(f"safetensors metadata field '{name}' is not JSON", where=where) from None


def default_key(name: str) -> str:
    """The reshard key for a stored name nobody recorded a source key for."""
    if name.startswith("optim."):
        rest = name[len("optim."):]
        return name if rest.startswith("state.") else "optim.state." + rest
    return "model." + name


class ExportIndex(EntryQueries):
    """The read-only global view of a safetensors export (the CheckpointIndex interface)."""

    def __init__(self, path: str | Path, *, keys: str = "source", rename: Any = None, trust_pickle: bool = False):
        if keys not in ("source", "reshard", "stored"):
            raise ValueError(f"keys must be source, reshard or stored, got {keys!r}")
        p = Path(path)
        self.path = p
        self.root = p if p.is_dir() else p.parent
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
        self._load()

    # ------------------------------------------------------------------ validation
    def _bad(self, message: str, file: str | None = None) -> BadInput:
        where = str(self.root / file) if file else str(self.path)
        return BadInput(message, where=where, hint="The safetensors export is corrupt or incomplete.")

    def _files(self) -> tuple[list[str], dict[str, str] | None]:
        p = self.path
        if p.is_file():
            return [p.name], None
        if not p.is_dir():
            raise BadInput("no such file or directory", where=str(p))
        ip = p / ST_INDEX
        if ip.is_file():
            try:
                ix = json.loads(ip.read_text())
            except (OSError, ValueError) as exc:
                raise self._bad(f"unreadable index ({exc})", ST_INDEX) from None
            wm = ix.get("weight_map") if isinstance(ix, dict) else None
            if not isinstance(wm, dict) or not all(isinstance(v, str) and "/" not in v for v in wm.values()):
                raise self._bad("'weight_map' must map names to file names in the directory", ST_INDEX)
            self.index = ix
            return sorted(set(wm.values())), wm
        if (p / SINGLE).is_file():
            return [SINGLE], None
        files = sorted(c.name for c in p.iterdir() if c.suffix == ".safetensors")
        if not files:
            raise BadInput("no .safetensors files", where=str(p))
        return files, None

    def _load(self) -> None:
        from reshard.io.local_format import _read_header

        files, weight_map = self._files()
        dtypes = _st_dtypes()
        located: dict[str, tuple[str, tuple[int, ...], torch.dtype, int, int]] = {}
        export_map: dict[str, str] = {}
        tied: list[list[str]] = []
        for fname in files:
            fpath = self.root / fname
            if not fpath.is_file():
                names = sorted(n for n, f in (weight_map or {}).items() if f == fname)
                raise Incomplete(f"shard file is missing; {len(names)} tensors lose their bytes", where=str(fpath))
            header, data_start = _read_header(fpath)
            size = fpath.stat().st_size
            self.file_sizes[fname] = size
            meta = header.pop("__metadata__", None) or {}
            if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
                raise self._bad("__metadata__ must map strings to strings", fname)
            if not self.metadata:
                self.metadata = dict(meta)
            export_map.update(_json_field(meta, "export_map", {}, str(fpath)))
            for g in _json_field(meta, "tied", [], str(fpath)):
                if g not in tied:
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
                    raise self._bad(f"tensor '{name}' has a bad shape {shape!r}", fname)
                if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)):
                    raise self._bad(f"tensor '{name}' has bad data_offsets {offs!r}", fname)
                numel = 1
                for s in shape:
                    numel *= s
                begin, end = offs
                if end - begin != numel * torch.empty((), dtype=dt).element_size() or begin < 0:
                    raise self._bad(f"tensor '{name}': {end - begin} bytes for {h['dtype']}{shape}", fname)
                if data_start + end > size:
                    raise Incomplete(f"tensor '{name}' ends at byte {data_start + end} but the file has {size} bytes",
                                     where=str(fpath))
                if name in located:
                    raise self._bad(f"tensor '{name}' is stored in both {located[name][0]} and {fname}", fname)
                if weight_map is not None and weight_map.get(name) != fname:
                    raise self._bad(f"tensor '{name}' is in {fname} but the index maps it to {weight_map.get(name)!r}", fname)
                located[name] = (fname, tuple(shape), dt, data_start + begin, end - begin)
                ranges.append((begin, end, name))
            ranges.sort()
            for (b0, e0, n0), (b1, e1, n1) in zip(ranges, ranges[1:]):
                if b1 < e0:
                    raise self._bad(f"tensors '{n0}' and '{n1}' overlap", fname)
        if weight_map is not None:
            lost = sorted(n for n in weight_map if n not in located)
            if lost:
                raise self._bad(f"the index names {len(lost)} tensors no shard holds: {lost[:5]}", ST_INDEX)
            rmeta = ((self.index or {}).get("metadata") or {}).get("reshard") or {}
            if isinstance(rmeta.get("export_map"), dict):
                export_map = {**rmeta["export_map"], **export_map}
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
            from reshard.conventions import get_convention

            conv = self.metadata.get("source_convention") or "reshard"
            r = get_convention(conv).classify(src_key, "tensor")
            if r.role == "parameter" and r.param:
                return "model." + r.param
            if r.role in ("optimizer_moment", "optimizer_step") and r.param:
                return f"optim.state.{r.param}.{r.name or 'step'}"
            return src_key
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
            except ValueError:
                out[k] = v
        return out

    # ------------------------------------------------------------------ reading bytes
    def _read_rows(self, key: str, first: int, rows: int) -> torch.Tensor:
        """Rows ``first .. first+rows`` along dim 0 (the whole tensor for 0-d), read with pread.

        Plain reads, not ``safe_open``'s mmap: pages of a memory-mapped file that were touched
        count as resident memory of this process, so a pass over a large export through
        mmap handles grows the RSS with the export's size.
        """
        e = self.entry(key)
        fname, stored = self.stored[key]
        loc = e.chunks[0].location
        esize = torch.empty((), dtype=e.dtype).element_size()
        shape = tuple(e.shape)
        row_elems = 1
        for s in shape[1:]:
            row_elems *= s
        if shape:
            start, n = loc.offset + first * row_elems * esize, rows * row_elems * esize
            out_shape = (rows, *shape[1:])
        else:
            start, n, out_shape = loc.offset, esize, ()
        buf = bytearray(n)
        path = self.root / fname
        try:
            with open(path, "rb", buffering=0) as f:
                got = f.readinto(memoryview(buf)) if f.seek(start) == start else 0
        except OSError as exc:
            raise BadInput(f"cannot read '{stored}' ({exc})", where=str(path)) from None
        if got != n:
            raise Incomplete(f"'{stored}' needs bytes {start}..{start + n} but the file ends earlier", where=str(path))
        if n == 0:
            return torch.empty(out_shape, dtype=e.dtype)
        return torch.frombuffer(buf, dtype=e.dtype).reshape(out_shape)

    def read_object(self, key: str) -> Any:
        e = self.entry(key)
        return self.read_tensor(e.key)

    def read_tensor(self, key: str) -> torch.Tensor:
        return self.read_box(key, whole(self.entry(key).shape))

    def read_box(self, key: str, box: Box) -> torch.Tensor:
        e = self.entry(key)
        if len(box.sizes) != len(e.shape) or not whole(e.shape).contains(box):
            raise BadInput(f"box {list(box.offsets)}+{list(box.sizes)} lies outside '{key}' of shape {list(e.shape)}",
                           where=str(self.path))
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
            if progress is not None:
                progress.update(1)
        self.findings.extend(found)
        return found


def open_export(path: str | Path, *, keys: str = "source", rename: Any = None, trust_pickle: bool = False) -> ExportIndex:
    """Open and validate a safetensors export (see the module docstring for ``keys``)."""
    return ExportIndex(path, keys=keys, rename=rename, trust_pickle=trust_pickle)


def export_rewrites(a: str | Path, b: str | Path) -> dict[str, str]:
    """For `reshard verify DCP EXPORT`: what an export leaves out on purpose, as ``expected_rewrites``.

    Every source key `reshard export` did not write (``export-report.json`` beside the
    export: trainer state, optimizer state with ``--only model``, objects) with the reason,
    plus the semantics ``step`` and ``tokens_seen`` (an export has no trainer counters).
    Empty when neither side is an export.
    """
    out: dict[str, str] = {}
    for side in (Path(a), Path(b)):
        if not is_export(side):
            continue
        rp = (side if side.is_dir() else side.parent) / "export-report.json"
        try:
            rep = json.loads(rp.read_text())
            for k in rep.get("keys", []):
                if k.get("action") == "dropped":
                    out[k["key"]] = f"not exported: {k.get('reason', '')}"
        except (OSError, ValueError, TypeError, KeyError):
            pass
        out.setdefault("step", "an export carries no trainer counters")
        out.setdefault("tokens_seen", "an export carries no trainer counters")
    return out
