"""`.metadata` as columns: every chunk and every storage entry as rows of numbers.

Why columns: a DCP `.metadata` at frontier scale names tens of millions of chunks (Llama-3
405B saved from 16,384 ranks: a 9.4 GB pickle). Unpickled, each chunk and each storage entry
is a handful of Python objects that the pickle's memo keeps alive until the load ends: about
1.5 KB per entry, 12x the file. As columns the same facts take about 60 bytes per entry.

Two decoders fill the same `MetadataColumns`:

- the native one (`reshard/storage/pickles/metadecode.c`) walks the pickle's opcodes itself and keeps
  only numbers and the few distinct strings; it handles the vocabulary torch's DCP writers use
  and answers "not mine" (None) for anything else;
- the safe unpickler (`reshard.storage.pickles.safe_pickle` + `reshard.storage.checkpoints.dcp`), the reference,
  which takes every other pickle (and refuses hostile ones with their reasons).

Either way the checks `dcp` makes on decoded records (file names inside the checkpoint,
byte ranges, dtypes) are made here on the columns, so a pickle is judged the same whichever
decoder read it.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from reshard import safefs
from reshard.errors import BadInput
from reshard.model.checkpoint import ItemLocation
from reshard.model.dtypes import DTYPES, DType, dtype_named, unstorable_reason
from reshard.paths import formats_root
from reshard.storage.checkpoints import dcp, save_plans
from reshard.storage.pickles.safe_pickle import pickle_budget

if TYPE_CHECKING:
    from reshard.storage.objectstore.remote import RemoteCheckpoint

try:  # built by setup.py where a C compiler exists; the safe unpickler reads every file without it
    from reshard.storage.pickles import metadecode as native
except ImportError:  # pragma: no cover - depends on the install
    native = None

__all__ = ["MetadataColumns", "read_metadata_columns", "from_raw"]

TENSOR, OBJECT = 0, 1


@dataclass
class MetadataColumns:
    """`.metadata` decoded into columns, checked for shape (not for consistency: the index does that).

    Keys (``state_dict_metadata``, in file order): ``kinds`` (0 tensor, 1 object), ``dtypes``,
    ``shapes``, ``chunk_count``; key k's chunks are ``chunk_count[k]`` rows of ``len(shape)``
    numbers in ``chunk_offsets`` / ``chunk_sizes``, keys one after another.

    Storage entries (``storage_data``, in file order), one row each: ``st_fqn`` (into
    ``fqns``), ``st_ndim`` (how many offsets; -1 for an object's item, stored under no
    offsets), its offsets in ``st_offsets`` (rows one after another), ``st_file`` (into
    ``files``), the byte range ``st_offset`` / ``st_length``, ``st_transforms`` (into
    ``transforms``, -1 for none).
    """

    keys: list[str]
    kinds: np.ndarray
    dtypes: list[DType | None]
    shapes: list[tuple[int, ...] | None]
    chunk_count: np.ndarray
    chunk_offsets: np.ndarray
    chunk_sizes: np.ndarray
    fqns: list[str]
    files: list[str]
    transforms: list[tuple[str, ...]]
    st_fqn: np.ndarray
    st_ndim: np.ndarray
    st_offsets: np.ndarray
    st_file: np.ndarray
    st_offset: np.ndarray
    st_length: np.ndarray
    st_transforms: np.ndarray
    planner_paths: dict[str, tuple]
    version: str | None
    local_plans: Any = None  # `all_local_plans` as `save_plans.decode` gives it (Megatron's torch_dist); None: absent
    decoder: str = "safe"  # "native" | "safe": which decoder read it (for the benchmark and the tests)

    @property
    def storage_rows(self) -> int:
        return len(self.st_fqn)

    def storage_offset_starts(self) -> np.ndarray:
        """Where each storage row's offsets start in ``st_offsets``."""
        starts = np.zeros(len(self.st_ndim) + 1, dtype=np.int64)
        np.cumsum(np.maximum(self.st_ndim, 0), out=starts[1:])
        return starts

    def storage_locations(self) -> dict[tuple[str, tuple[int, ...] | None], ItemLocation]:
        """Every storage row as ``(key, offsets or None) -> location`` (the last row of a pair wins,
        as in a dict): for the save-plan check, which only Megatron's few-thousand-item files need."""
        starts = self.storage_offset_starts().tolist()
        offs = self.st_offsets.tolist()
        out: dict[tuple[str, tuple[int, ...] | None], ItemLocation] = {}
        for i, (f, nd, fi, o, n, t) in enumerate(zip(self.st_fqn.tolist(), self.st_ndim.tolist(), self.st_file.tolist(),
                                                     self.st_offset.tolist(), self.st_length.tolist(),
                                                     self.st_transforms.tolist())):
            key = (self.fqns[f], None if nd < 0 else tuple(offs[starts[i]:starts[i] + nd]))
            out[key] = ItemLocation(self.files[fi], o, n, self.transforms[t] if t >= 0 else ())
        return out


def read_metadata_columns(ckpt: Path, rc: RemoteCheckpoint | None = None) -> MetadataColumns:
    """`.metadata` of ``ckpt`` as columns: the native decoder when it is built and the pickle is
    in its vocabulary, else the safe unpickler. The same refusals as `dcp.read_raw_metadata`. ``rc``: the
    store ``ckpt`` stands for (a staged directory), whose listing bounds `.metadata`."""
    path = dcp.committed_metadata(ckpt, rc)
    where = str(path)
    if native is not None:
        fd = safefs.open_read(path, root=ckpt)
        try:
            size = os.fstat(fd).st_size
            safefs.check_size(size, dcp.metadata_cap(ckpt, rc), path, what=".metadata")
            out = native.decode(fd, size, _native_roles(), frozenset(DTYPES), pickle_budget(size))
        finally:
            os.close(fd)
        if out is not None:
            return _checked(_from_native(out, where), where)
    return from_raw(dcp.read_raw_metadata(ckpt, rc), where)


@lru_cache(maxsize=1)
def _native_roles() -> dict[tuple[str, str], str]:
    """The allow list of `formats/dcp_metadata.toml` as (module, name) -> role, for the native decoder:
    a record's role is its class name; other kinds are their kind ("size", "dtype", ...)."""
    import tomllib

    with open(formats_root() / "dcp_metadata.toml", "rb") as f:
        spec = tomllib.load(f)
    return {(a["module"], a["name"]): (a["name"] if a["kind"] == "record" else a["kind"]) for a in spec["allow"]}


def _from_native(out: dict[str, Any], where: str) -> MetadataColumns:
    dtypes: list[DType | None] = []
    for name in out["dtypes"]:
        dtypes.append(None if name is None else dtype_named(name))
    i64 = np.dtype("<i8")
    return MetadataColumns(
        keys=out["keys"], kinds=np.frombuffer(out["kinds"], dtype=np.uint8), dtypes=dtypes,
        shapes=[None if s is None else tuple(s) for s in out["shapes"]],
        chunk_count=np.frombuffer(out["chunk_count"], dtype=i64),
        chunk_offsets=np.frombuffer(out["chunk_offsets"], dtype=i64),
        chunk_sizes=np.frombuffer(out["chunk_sizes"], dtype=i64),
        fqns=out["fqns"], files=out["files"], transforms=[tuple(t) for t in out["transforms"]],
        st_fqn=np.frombuffer(out["st_fqn"], dtype="<i4"), st_ndim=np.frombuffer(out["st_ndim"], dtype=np.int8),
        st_offsets=np.frombuffer(out["st_offsets"], dtype=i64), st_file=np.frombuffer(out["st_file"], dtype="<i4"),
        st_offset=np.frombuffer(out["st_offset"], dtype=i64), st_length=np.frombuffer(out["st_length"], dtype=i64),
        st_transforms=np.frombuffer(out["st_transforms"], dtype="<i4"),
        planner_paths=_planner_paths(out.get("planner_data")),
        version=out.get("version") if isinstance(out.get("version"), str) else None,
        decoder="native")


def _planner_paths(planner: Any) -> dict[str, tuple]:
    paths: dict[str, tuple] = {}
    if isinstance(planner, dict):
        for k, v in planner.items():
            if isinstance(k, str) and isinstance(v, (tuple, list)):
                paths[k] = tuple(v)
    return paths


def _checked(cols: MetadataColumns, where: str) -> MetadataColumns:
    """What `dcp._decode` checks of each record, made on the columns (the native decoder only
    guarantees that they are faithful)."""
    unwritable = [(k, d) for k, d in zip(cols.keys, cols.dtypes) if d is not None and unstorable_reason(d) is not None]
    if unwritable:
        raise dcp.unwritable_dtypes(where, unwritable)
    for k, kind, d in zip(cols.keys, cols.kinds.tolist(), cols.dtypes):
        if kind == TENSOR and d is None:
            raise dcp.bad_metadata(where, f"tensor '{k}' has no valid dtype")
    for name in cols.files:
        dcp.check_relative_path(name, where=where, key=None)
    bad = np.flatnonzero((cols.st_offset < 0) | (cols.st_length < 0))
    if len(bad):
        raise dcp.bad_metadata(where, f"storage of '{cols.fqns[int(cols.st_fqn[bad[0]])]}' has an invalid byte range")
    return cols


def from_raw(raw: dcp.RawMetadata, where: str) -> MetadataColumns:
    """The safe unpickler's records as columns (its checks were made as it decoded)."""
    try:
        return _columns(raw)
    except OverflowError:
        raise BadInput("a chunk's offsets or sizes, or a byte range, do not fit in 64 bits", where=where,
                       hint="No real checkpoint has them; the file is corrupt or forged.") from None


def _columns(raw: dcp.RawMetadata) -> MetadataColumns:
    keys = list(raw.entries)
    kinds, dtypes, shapes, counts = [], [], [], []
    for e in raw.entries.values():
        if isinstance(e, dcp.RawObject):
            kinds.append(OBJECT), dtypes.append(None), shapes.append(None), counts.append(0)
        else:
            kinds.append(TENSOR), dtypes.append(e.dtype), shapes.append(tuple(e.shape)), counts.append(len(e.chunks))
    tensors = [e for e in raw.entries.values() if not isinstance(e, dcp.RawObject)]
    chain = itertools.chain.from_iterable
    chunk_offsets = np.fromiter(chain(o for e in tensors for o, _s in e.chunks), dtype=np.int64)
    chunk_sizes = np.fromiter(chain(s for e in tensors for _o, s in e.chunks), dtype=np.int64)
    fqn_ix: dict[str, int] = {}
    file_ix: dict[str, int] = {}
    tr_ix: dict[tuple[str, ...], int] = {}
    st_fqn, st_ndim, st_offs, st_file, st_off, st_len, st_tr = [], [], [], [], [], [], []
    for (fqn, offsets), loc in raw.locations.items():
        st_fqn.append(fqn_ix.setdefault(fqn, len(fqn_ix)))
        st_ndim.append(-1 if offsets is None else len(offsets))
        if offsets:
            st_offs.extend(offsets)
        st_file.append(file_ix.setdefault(loc.file, len(file_ix)))
        st_off.append(loc.offset)
        st_len.append(loc.length)
        st_tr.append(tr_ix.setdefault(loc.transforms, len(tr_ix)) if loc.transforms else -1)
    return MetadataColumns(
        keys=keys, kinds=np.array(kinds, dtype=np.uint8), dtypes=dtypes, shapes=shapes,
        chunk_count=np.array(counts, dtype=np.int64), chunk_offsets=chunk_offsets, chunk_sizes=chunk_sizes,
        fqns=list(fqn_ix), files=list(file_ix), transforms=list(tr_ix),
        st_fqn=np.array(st_fqn, dtype=np.int32), st_ndim=np.array(st_ndim, dtype=np.int8),
        st_offsets=np.array(st_offs, dtype=np.int64), st_file=np.array(st_file, dtype=np.int32),
        st_offset=np.array(st_off, dtype=np.int64), st_length=np.array(st_len, dtype=np.int64),
        st_transforms=np.array(st_tr, dtype=np.int32), planner_paths=raw.planner_paths, version=raw.version,
        local_plans=raw.local_plans)


def check_save_plans(cols: MetadataColumns, writer_of: Any) -> save_plans.SavePlans | None:
    """`save_plans.check` of the plans `.metadata` records, against its storage rows."""
    if cols.local_plans is None:
        return None
    return save_plans.check(cols.local_plans, cols.storage_locations(), writer_of)
