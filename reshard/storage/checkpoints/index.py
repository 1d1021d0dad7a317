"""`CheckpointIndex`: a DCP checkpoint described in global terms.

Every entry (tensor or object) with its global shape, dtype and chunks, and for each chunk
where its bytes live. Building the index reads `.metadata` and stats the data files; it
never reads tensor bytes, so it is cheap enough to run on every command. Completeness is
judged here, once, as a list of findings that name files and keys.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import numpy as np

from reshard.errors import BadInput, Incomplete, ReshardError
from reshard.model.geometry import Box, coverage_problems, tiles_exactly_arrays, whole
from reshard import safefs
from reshard.gc_pause import paused_gc
from reshard.model.checkpoint import ChunkTable, Entry, EntryQueries, Finding, ItemLocation, checked_box
from reshard.model.reader import CheckpointReader
from reshard.storage.checkpoints import dcp
from reshard.storage.pickles.metadata_columns import OBJECT, MetadataColumns, check_save_plans, read_metadata_columns
from reshard.storage.checkpoints.fastread import check_item_crcs
from reshard.storage.pickles.plain_items import NotPlain, PlainTensor, contains_tensor, decode_item

if TYPE_CHECKING:
    import torch

    from reshard.storage.objectstore.remote import RemoteCheckpoint

RANK_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


def _missing(name: str) -> int:
    raise FileNotFoundError(name)


SHARED_PLAIN_BYTES = 1 << 16  # `CheckpointIndex.read_plains` compares items up to this size by their bytes


def _plain_location(e: Entry) -> tuple[ItemLocation | None, int | None]:
    """Where `CheckpointIndex.read_plain` reads a small item from, and the size its bytes may inflate to:
    an object's item, or the one chunk of a one-element tensor (None: read it through torch)."""
    if e.is_tensor:
        if isinstance(e.chunks, ColumnChunks):  # read from the index's columns, no `Chunk` made
            return e.chunks.sole_location(e.shape) if e.numel == 1 else None, dcp.tensor_item_limit(1, e.dtype.itemsize)
        c = e.chunks[0] if len(e.chunks) == 1 else None
        loc = c.location if c is not None and e.numel == 1 and c.box.sizes == tuple(e.shape) else None
        return loc, dcp.tensor_item_limit(1, e.dtype.itemsize)
    return e.location, None


def _paired_in_order(cols: MetadataColumns, row_key: np.ndarray, order: np.ndarray, ndims: np.ndarray,
                     first_row: np.ndarray, flat: np.ndarray) -> np.ndarray:
    """Per key, whether it is a tensor whose storage rows of its rank are exactly its chunks, in the
    chunks' own order and under the same offsets (`CheckpointIndex._pair`'s common case), shown for
    every key at once; a 0-d tensor counts when it has one chunk and one row. Those keys' chunks are
    located by one array assignment; every other key is paired one by one as before.

    Why: pairing a key costs a dozen numpy calls on a few rows (about 50 us), and a mixture of
    experts has hundreds of thousands of tensors.
    """
    nk = len(cols.keys)
    counts = np.asarray(cols.chunk_count, dtype=np.int64)
    tensor = cols.kinds != OBJECT
    rk = row_key[order]
    safe = np.maximum(rk, 0)
    mine = (rk >= 0) & tensor[safe] & (cols.st_ndim[order] == ndims[safe])  # a key's rows of its rank, in file order
    rows = order[mine]
    owner = rk[mine]
    have = np.bincount(owner, minlength=nk)[:nk]
    ok = tensor & (have == counts) & ((ndims > 0) | (counts == 1))
    # the offsets of those rows against the chunks', number by number, for the keys still in the running
    take = ok[owner]
    rows, owner = rows[take], owner[take]
    d = ndims[owner]
    st_start = cols.storage_offset_starts()
    reps = np.repeat(np.arange(len(rows)), d)
    within = np.arange(int(d.sum()), dtype=np.int64) - np.repeat(np.cumsum(d) - d, d)
    stored = cols.st_offsets[st_start[rows][reps] + within]
    ks = np.flatnonzero(ok)
    n = counts[ks] * ndims[ks]
    declared = cols.chunk_offsets[np.repeat(flat[ks], n) + np.arange(int(n.sum()), dtype=np.int64)
                                  - np.repeat(np.cumsum(n) - n, n)]
    same = np.ones(nk, dtype=bool)
    np.logical_and.at(same, owner[reps], stored == declared)
    return ok & same


def _first_short_all(cols: MetadataColumns, fast: np.ndarray, counts: np.ndarray, ndims: np.ndarray,
                     flat: np.ndarray, rows: np.ndarray) -> dict[int, tuple[str, int, int, str]]:
    """`CheckpointIndex._first_short` for the keys of `_paired_in_order` at once (``rows``: their chunks'
    storage rows, in order): key -> its first untransformed item shorter than its chunk's elements.
    Keys whose element counts may not be exact in int64 are judged one by one."""
    ks = np.flatnonzero(fast)
    out: dict[int, tuple[str, int, int, str]] = {}
    if not len(ks):
        return out
    n = counts[ks]
    owner = np.repeat(ks, n)
    itemsize = np.array([cols.dtypes[k].itemsize for k in ks.tolist()], dtype=np.int64)
    nd = ndims[ks] * n
    sizes = cols.chunk_sizes[np.repeat(flat[ks], nd) + np.arange(int(nd.sum()), dtype=np.int64) - np.repeat(np.cumsum(nd) - nd, nd)]
    chunk_of = np.repeat(np.arange(len(owner)), np.repeat(ndims[ks], n))
    elems = np.ones(len(owner), dtype=np.float64)
    np.multiply.at(elems, chunk_of, sizes.astype(np.float64))
    big = elems * np.repeat(itemsize, n) >= 2.0 ** 62
    exact = np.ones(len(owner), dtype=np.int64)
    np.multiply.at(exact, chunk_of, np.where(big[chunk_of], 1, sizes))
    need = exact * np.repeat(itemsize, n)
    length, tr = cols.st_length[rows], cols.st_transforms[rows]
    bad = np.flatnonzero(((need > length) & (tr < 0)) | big)
    for i in bad.tolist():
        k = int(owner[i])
        if k in out:
            continue
        if big[i]:  # exact in Python ints, as _first_short does
            d, c = int(ndims[k]), i - int(np.searchsorted(owner, k))
            row = cols.chunk_sizes[int(flat[k]) + c * d: int(flat[k]) + (c + 1) * d].tolist()
            need_i = prod(row) * cols.dtypes[k].itemsize
            if not (int(tr[i]) < 0 and int(length[i]) < need_i):
                continue
            out[k] = (cols.keys[k], need_i, int(length[i]), cols.files[int(cols.st_file[rows[i]])])
            continue
        out[k] = (cols.keys[k], int(need[i]), int(length[i]), cols.files[int(cols.st_file[rows[i]])])
    return out


def _slabs_tile(cols: MetadataColumns, ndims: np.ndarray, flat: np.ndarray) -> np.ndarray:
    """Per key, whether its chunks are shown, for all keys at once, to tile its tensor exactly as
    slabs along dim 0 (FSDP's ``Shard(0)``, and a whole tensor in one chunk), or it is a 0-d
    tensor in one chunk; False for every other key, whose chunks the exact check
    (`reshard.model.geometry.tiles_exactly_arrays`, then `coverage_problems`) judges one by one.

    Why: that check costs about 0.1 ms a tensor in numpy calls on a few rows each, and a
    mixture of experts has hundreds of thousands of tensors. Shown here, over every chunk at once:
    each chunk spans every dim but the first whole, lies within dim 0 (empty pieces included:
    offsets and sizes not negative, ends within the shape), and the non-empty ones, ordered by
    offset, follow each other without gap or overlap from 0 to the shape's first dim. That is an
    exact tiling, so the exact check would find no problem.
    """
    nk = len(cols.keys)
    ok = np.zeros(nk, dtype=bool)
    counts = np.asarray(cols.chunk_count, dtype=np.int64)
    tensor = (cols.kinds != OBJECT) & (counts > 0)
    ok[np.flatnonzero(tensor & (ndims == 0) & (counts == 1))] = True
    for d in np.unique(ndims[tensor & (ndims > 0)]).tolist():
        ks = np.flatnonzero(tensor & (ndims == d))
        shp = np.array([s if max(s) < 1 << 62 and min(s) > 0 else (0,) * d for s in (cols.shapes[k] for k in ks.tolist())],
                       dtype=np.int64).reshape(len(ks), d)
        n = counts[ks]
        start = np.repeat(flat[ks], n * d)  # each key's numbers in the flat columns, one after another
        within = np.arange(int((n * d).sum()), dtype=np.int64) - np.repeat(np.cumsum(n * d) - n * d, n * d)
        offs = cols.chunk_offsets[start + within].reshape(-1, d)
        sizes = cols.chunk_sizes[start + within].reshape(-1, d)
        owner = np.repeat(np.arange(len(ks)), n)
        whole = shp[owner]
        good = (whole[:, 0] > 0) & (offs[:, 0] >= 0) & (sizes[:, 0] >= 0) & (offs[:, 0] <= whole[:, 0] - sizes[:, 0])
        if d > 1:
            good &= (offs[:, 1:] == 0).all(axis=1) & (sizes[:, 1:] == whole[:, 1:]).all(axis=1)
        key_good = np.ones(len(ks), dtype=bool)
        np.logical_and.at(key_good, owner, good)
        solid = np.flatnonzero(sizes[:, 0] > 0)  # the non-empty slabs, ordered by key then offset
        solid = solid[np.lexsort((offs[solid, 0], owner[solid]))]
        o, lo, hi = owner[solid], offs[solid, 0], offs[solid, 0] + sizes[solid, 0]
        first = np.r_[True, o[1:] != o[:-1]] if len(o) else np.zeros(0, dtype=bool)
        last = np.r_[o[1:] != o[:-1], True] if len(o) else np.zeros(0, dtype=bool)
        joined = np.where(first, lo == 0, lo == np.r_[0, hi[:-1]]) & np.where(last, hi == shp[o, 0], True)
        np.logical_and.at(key_good, o, joined)
        has_solid = np.zeros(len(ks), dtype=bool)
        has_solid[o] = True
        ok[ks] = key_good & has_solid
    return ok


@dataclass(frozen=True)
class ChunkColumns:
    """Every chunk of an index as columns, shared by its `ColumnChunks` tables: the boxes'
    numbers one key after another (``offsets``, ``sizes``: ``ndim`` per chunk) and per chunk its
    file, byte range and transforms (indices into ``files`` and ``transforms``, -1: none)."""

    offsets: np.ndarray
    sizes: np.ndarray
    file: np.ndarray
    start: np.ndarray
    length: np.ndarray
    transform: np.ndarray
    files: list[str]
    transforms: list[tuple[str, ...]]


class ColumnChunks(ChunkTable):
    """One tensor's chunks as a range of the index's `ChunkColumns`, its arrays made when asked for.

    Why not a `ChunkTable` holding its six arrays: each array is a numpy view of about a hundred
    bytes, and an MoE checkpoint of 180k keys held 100k tables of six views (78 MiB by tracemalloc,
    a fifth of ``reshard plan``'s peak; 13 MiB as these), most never read. Here a table is five numbers; each
    attribute is a view made on access (code that walks every chunk reads the index's columns
    or asks each table once). Pickled as the plain `ChunkTable` of its arrays."""

    __slots__ = ("_cols", "_n", "_d", "_r0", "_p")

    def __init__(self, cols: ChunkColumns, n: int, d: int, r0: int, p: int) -> None:  # no super(): the arrays are properties
        self._cols, self._n, self._d, self._r0, self._p = cols, n, d, r0, p

    @property  # type: ignore[override]
    def offsets(self) -> np.ndarray:
        return self._cols.offsets[self._p:self._p + self._n * self._d].reshape(self._n, self._d)

    @property  # type: ignore[override]
    def sizes(self) -> np.ndarray:
        return self._cols.sizes[self._p:self._p + self._n * self._d].reshape(self._n, self._d)

    @property  # type: ignore[override]
    def file(self) -> np.ndarray:
        return self._cols.file[self._r0:self._r0 + self._n]

    @property  # type: ignore[override]
    def start(self) -> np.ndarray:
        return self._cols.start[self._r0:self._r0 + self._n]

    @property  # type: ignore[override]
    def length(self) -> np.ndarray:
        return self._cols.length[self._r0:self._r0 + self._n]

    @property  # type: ignore[override]
    def transform(self) -> np.ndarray:
        return self._cols.transform[self._r0:self._r0 + self._n]

    @property  # type: ignore[override]
    def files(self) -> list[str]:
        return self._cols.files

    @property  # type: ignore[override]
    def transforms(self) -> list[tuple[str, ...]]:
        return self._cols.transforms

    def __len__(self) -> int:
        return self._n

    @property
    def columns(self) -> ChunkColumns:
        """The index's columns this table is a range of."""
        return self._cols

    @property
    def rows(self) -> slice:
        """This table's chunks as rows of ``columns.file`` (``start``, ``length``, ``transform``)."""
        return slice(self._r0, self._r0 + self._n)

    def ends(self) -> tuple:
        """(offsets, sizes) of the first and the last chunk as their int64 bytes, and (file, item
        length) of each (None: no location), read from the columns: what tells two tensors cut
        alike by one save (`reshard.planning.linking`), without the table's arrays made."""
        c, n, d, r, p = self._cols, self._n, self._d, self._r0, self._p
        if not n:
            return ()
        q = p + (n - 1) * d
        o, z = c.offsets, c.sizes
        rl = r + n - 1
        fa, fb = int(c.file[r]), int(c.file[rl])
        return (o[p:p + d].tobytes(), z[p:p + d].tobytes(), o[q:q + d].tobytes(), z[q:q + d].tobytes(),
                (c.files[fa], int(c.length[r])) if fa >= 0 else None, (c.files[fb], int(c.length[rl])) if fb >= 0 else None)

    def sole_location(self, shape: tuple[int, ...] | None) -> ItemLocation | None:
        """Where the table's only chunk lies when it holds the whole tensor of ``shape``, else None
        (``self[0].location`` when ``len(self) == 1 and self[0].box.sizes == tuple(shape)``)."""
        c, r, p = self._cols, self._r0, self._p
        if self._n != 1 or c.sizes[p:p + self._d].tolist() != list(shape or ()):
            return None
        f, t = int(c.file[r]), int(c.transform[r])
        return None if f < 0 else ItemLocation(c.files[f], int(c.start[r]), int(c.length[r]), c.transforms[t] if t >= 0 else ())

    def __reduce__(self) -> tuple[Any, ...]:
        return ChunkTable, (self.offsets, self.sizes, self.file, self.start, self.length, self.transform,
                            self.files, self.transforms)


class CheckpointIndex(EntryQueries, CheckpointReader):
    """The global view of one DCP checkpoint directory (read-only).

    ``remote``: the store prefix ``root`` stands for when ``root`` is a staged directory
    (`reshard.storage.objectstore.remote.staged`), handed in by whoever opened it: the data files' sizes come
    from its one listing and every item's bytes from it by range. None for a local checkpoint.
    """

    def __init__(self, root: Path, cols: MetadataColumns, *, trust_pickle: bool = False,
                 remote: RemoteCheckpoint | None = None):
        self.root = root
        self.remote = remote
        self.version = cols.version
        self.trust_pickle = trust_pickle
        self.decoder = cols.decoder
        self.entries: dict[str, Entry] = {}
        self.findings: list[Finding] = []
        self._build(cols)

    # ------------------------------------------------------------------ construction
    @classmethod
    def open(cls, path: str | Path, *, trust_pickle: bool = False,
             remote: RemoteCheckpoint | None = None) -> "CheckpointIndex":
        root = Path(path)
        with paused_gc():  # many small objects, no cycles: see reshard.gc_pause
            return cls(root, read_metadata_columns(root, remote), trust_pickle=trust_pickle, remote=remote)

    def _build(self, cols: MetadataColumns) -> None:
        """Entries from the decoded columns, each tensor's chunks a `ChunkTable` over arrays.

        Each storage row is paired with the chunk of its key at the same offsets (a key's rows
        usually come in its chunks' order, which one array comparison confirms; otherwise they
        are looked up by offsets, the last row of a pair winning as in a dict). What the checks
        need (the end of each file's last byte range, tensor items too short for their chunk,
        the tiling) is computed over the arrays: a 1,024-rank checkpoint has a million chunks,
        and a pass over them as Python objects costs seconds."""
        keys = cols.keys
        key_ix = {k: i for i, k in enumerate(keys)}
        rows_total = cols.storage_rows
        fq2key = np.array([key_ix.get(f, -1) for f in cols.fqns], dtype=np.int64)
        row_key = fq2key[cols.st_fqn] if rows_total else np.zeros(0, dtype=np.int64)
        orphans = sorted({cols.fqns[i] for i in np.unique(cols.st_fqn[row_key < 0]).tolist()})
        st_start = cols.storage_offset_starts()
        order = np.argsort(row_key, kind="stable")
        bounds = np.searchsorted(row_key[order], np.arange(len(keys) + 1), side="left")
        ndims = np.array([len(s) if s is not None else 0 for s in cols.shapes], dtype=np.int64)
        counts = cols.chunk_count
        first_row = np.zeros(len(keys) + 1, dtype=np.int64)
        np.cumsum(counts, out=first_row[1:])
        flat = np.zeros(len(keys) + 1, dtype=np.int64)
        np.cumsum(counts * ndims, out=flat[1:])
        n_chunks = int(first_row[-1])
        loc_file = np.full(n_chunks, -1, dtype=np.int32)
        loc_start = np.zeros(n_chunks, dtype=np.int64)
        loc_length = np.zeros(n_chunks, dtype=np.int64)
        loc_tr = np.full(n_chunks, -1, dtype=np.int32)
        missing_loc: list[str] = []
        short: list[tuple[str, int, int, str]] = []  # (key, bytes needed, item length, file): the first per key
        need = np.full(len(cols.files), -1, dtype=np.int64)
        fast = _paired_in_order(cols, row_key, order, ndims, first_row, flat)
        sl_all = np.flatnonzero(np.repeat(fast, counts))  # the chunks of those keys, and their rows in the same order
        rows_all = order[fast[np.maximum(row_key[order], 0)] & (row_key[order] >= 0)
                         & (cols.st_ndim[order] == ndims[np.maximum(row_key[order], 0)])]
        loc_file[sl_all] = cols.st_file[rows_all]
        loc_start[sl_all] = cols.st_offset[rows_all]
        loc_length[sl_all] = cols.st_length[rows_all]
        loc_tr[sl_all] = cols.st_transforms[rows_all]
        short_at = _first_short_all(cols, fast, counts, ndims, flat, rows_all)  # key -> its first short item
        columns = ChunkColumns(cols.chunk_offsets, cols.chunk_sizes, loc_file, loc_start, loc_length, loc_tr,
                               cols.files, cols.transforms)  # the tables of the keys paired in order read these
        for k, key in enumerate(keys):
            path = cols.planner_paths.get(key, ())
            if fast[k]:
                d, n, r0, p = int(ndims[k]), int(counts[k]), int(first_row[k]), int(flat[k])
                if k in short_at:
                    short.append(short_at[k])
                self.entries[key] = Entry(key, "tensor", shape=cols.shapes[k], dtype=cols.dtypes[k],
                                          chunks=ColumnChunks(columns, n, d, r0, p), path=path)
                continue
            rows = order[bounds[k]:bounds[k + 1]]
            if cols.kinds[k] == OBJECT:
                mine = rows[cols.st_ndim[rows] < 0]
                loc = None
                if len(mine):
                    i = int(mine[-1])
                    t = int(cols.st_transforms[i])
                    loc = ItemLocation(cols.files[cols.st_file[i]], int(cols.st_offset[i]), int(cols.st_length[i]),
                                       cols.transforms[t] if t >= 0 else ())
                    f = int(cols.st_file[i])
                    need[f] = max(int(need[f]), loc.offset + loc.length)
                else:
                    missing_loc.append(key)
                self.entries[key] = Entry(key, "object", location=loc, path=path)
                continue
            d, n, r0, p = int(ndims[k]), int(counts[k]), int(first_row[k]), int(flat[k])
            offs = cols.chunk_offsets[p:p + n * d].reshape(n, d)
            sizes = cols.chunk_sizes[p:p + n * d].reshape(n, d)
            idx = self._pair(cols, rows[cols.st_ndim[rows] == d], offs, st_start)
            got = idx >= 0
            if n and not got.all():
                missing_loc.append(key)
            sl = slice(r0, r0 + n)
            found = idx[got]
            loc_file[sl][got] = cols.st_file[found]
            loc_start[sl][got] = cols.st_offset[found]
            loc_length[sl][got] = cols.st_length[found]
            loc_tr[sl][got] = cols.st_transforms[found]
            if len(found):
                self._first_short(key, cols.dtypes[k].itemsize, sizes[got], cols.st_length[found],
                                  cols.st_transforms[found], cols.st_file[found], cols.files, short)
            table = ChunkTable(offs, sizes, loc_file[sl], loc_start[sl], loc_length[sl], loc_tr[sl],
                               cols.files, cols.transforms)
            self.entries[key] = Entry(key, "tensor", shape=cols.shapes[k], dtype=cols.dtypes[k], chunks=table, path=path)
        if missing_loc:
            self.findings.append(Finding("error", "no_storage", "metadata names chunks with no storage location",
                                         file=dcp.METADATA_FILE, keys=tuple(sorted(set(missing_loc)))))
        if orphans:
            self.findings.append(Finding("warning", "orphan_storage", "storage locations for keys the metadata does not declare",
                                         file=dcp.METADATA_FILE, keys=tuple(orphans[:50])))
        # The ranks of the save as its plans record them (Megatron's torch_dist), checked against what was stored
        self.save_plans = check_save_plans(cols, self.writer_of)
        located = loc_file >= 0  # the end of each file's last byte range, over every chunk at once
        if located.any():
            f = loc_file[located]
            ends = loc_start[located] + loc_length[located]
            order = np.argsort(f, kind="stable")
            f, ends = f[order], ends[order]
            first = np.flatnonzero(np.r_[True, f[1:] != f[:-1]])
            np.maximum.at(need, f[first], np.maximum.reduceat(ends, first))
        self._check_files({cols.files[f]: int(e) for f, e in enumerate(need.tolist()) if e >= 0})
        self._check_item_lengths(short)
        tiled = _slabs_tile(cols, ndims, flat)
        self._check_coverage({keys[k] for k in np.flatnonzero(tiled).tolist()})

    @staticmethod
    def _pair(cols: MetadataColumns, rows: np.ndarray, offs: np.ndarray, st_start: np.ndarray) -> np.ndarray:
        """For each chunk (its offsets a row of ``offs``), the storage row of its key stored under the
        same offsets (-1: none). ``rows`` are the key's storage rows of the same rank, in file order."""
        n, d = offs.shape
        if not len(rows):
            return np.full(n, -1, dtype=np.int64)
        if d == 0:  # a scalar's chunks are all stored under the empty offsets: the last row wins
            return np.full(n, int(rows[-1]), dtype=np.int64)
        st = cols.st_offsets[st_start[rows][:, None] + np.arange(d)]
        if len(rows) == n and np.array_equal(st, offs):  # the common case: the chunks' own order
            return rows.astype(np.int64, copy=False)
        by_offsets = dict(zip(map(tuple, st.tolist()), rows.tolist()))
        return np.array([by_offsets.get(o, -1) for o in map(tuple, offs.tolist())], dtype=np.int64)

    @staticmethod
    def _first_short(key: str, itemsize: int, sizes: np.ndarray, lengths: np.ndarray, transforms: np.ndarray,
                     files: np.ndarray, names: list[str], short: list[tuple[str, int, int, str]]) -> None:
        """Append the first plain (untransformed) item of ``key`` shorter than its chunk's elements."""
        if not len(sizes):
            return
        if np.prod(sizes.astype(np.float64), axis=1).max(initial=0.0) * itemsize < 2.0 ** 62:
            need = np.prod(sizes, axis=1) * itemsize
            bad = np.flatnonzero((need > lengths) & (transforms < 0))
            if len(bad):
                i = int(bad[0])
                short.append((key, int(need[i]), int(lengths[i]), names[int(files[i])]))
            return
        for row, n, t, f in zip(sizes.tolist(), lengths.tolist(), transforms.tolist(), files.tolist()):
            need_i = prod(row) * itemsize  # Python ints: a forged size beyond int64 is still compared exactly
            if t < 0 and n < need_i:
                short.append((key, need_i, n, names[f]))
                return

    def _keys_past(self, name: str, size: int | None) -> list[str]:
        """Keys with a byte range in file ``name`` ending past ``size`` (None: any range in it); only asked on a problem."""
        keys: set[str] = set()
        for e in self.entries.values():
            locs = [c.location for c in e.chunks] if e.is_tensor else [e.location]
            if any(loc is not None and loc.file == name and (size is None or loc.offset + loc.length > size) for loc in locs):
                keys.add(e.key)
        return sorted(keys)

    def _check_files(self, need: dict[str, int]) -> None:
        """Missing data files and files shorter than the byte ranges the metadata names."""
        self.file_sizes: dict[str, int] = {}
        rc = self.remote  # a remote checkpoint: the sizes of its one listing
        for name in sorted(need):
            p = self.root / name
            try:
                if rc is not None:
                    size = rc.sizes[name] if name in rc.sizes else _missing(name)
                else:
                    size = safefs.regular_size(p, root=self.root)  # a symlink out, a device or a FIFO is refused here
            except FileNotFoundError:
                keys = self._keys_past(name, None)
                self.findings.append(Finding("error", "missing_file", f"data file '{name}' is missing; {len(keys)} keys lose bytes",
                                             file=name, keys=tuple(keys)))
                continue
            self.file_sizes[name] = size
            if size < need[name]:
                keys = self._keys_past(name, size)
                self.findings.append(Finding(
                    "error", "truncated_file",
                    f"data file '{name}' has {size} bytes but the metadata needs {need[name]}; {len(keys)} keys lose bytes",
                    file=name, keys=tuple(keys)))

    def _check_item_lengths(self, short: list[tuple[str, int, int, str]]) -> None:
        """A tensor item shorter than the elements its chunk declares cannot hold them.

        Checked from metadata alone (``short``, collected by `_build`), so a forged `.metadata`
        declaring a 128 GiB tensor in 8 KiB items is refused here instead of when a later
        command allocates the tensor. Transformed (compressed) items are bounded when they are
        decoded instead.
        """
        if short:
            key, need, have, file = short[0]
            keys = tuple(dict.fromkeys(k for k, _n, _h, _f in short))
            self.findings.append(Finding(
                "error", "item_too_short",
                f"tensor '{key}' declares a chunk of {need:,} bytes stored in an item of {have:,} bytes in '{file}'"
                + (f" ({len(keys)} keys in all)" if len(keys) > 1 else ""),
                file=dcp.METADATA_FILE, keys=keys[:50]))

    def _check_coverage(self, tiled: set[str] | frozenset[str] = frozenset()) -> None:
        """Chunks that do not tile their tensor exactly, as findings; ``tiled``: keys already shown to (`_slabs_tile`)."""
        for e in self.entries.values():
            if not e.is_tensor or e.key in tiled:
                continue
            t = e.chunks
            if isinstance(t, ChunkTable) and tiles_exactly_arrays(tuple(e.shape), t.offsets, t.sizes):
                continue
            probs = coverage_problems(e.shape, (c.box for c in e.chunks))
            for p in probs:
                self.findings.append(Finding("error", f"chunk_{p.kind}", f"tensor '{e.key}': {p.detail}",
                                             file=dcp.METADATA_FILE, keys=(e.key,)))

    # ------------------------------------------------------------------ queries
    def data_files(self) -> list[str]:
        """Data files present in the directory (whether or not the metadata names them)."""
        rc = self.remote
        if rc is not None:
            return rc.data_files()
        return sorted(p.name for p in self.root.iterdir() if p.name.endswith(".distcp"))

    def writer_of(self, file: str) -> int | None:
        """The rank that wrote a data file, from DCP's `__{rank}_{n}.distcp` naming (None for other names)."""
        m = RANK_FILE.match(file)
        return int(m.group(1)) if m else None

    def writer_ranks(self) -> list[int]:
        """Ranks that wrote data files, from DCP's `__{rank}_{n}.distcp` naming."""
        ranks = set()
        for name in set(self.file_sizes) | set(self.data_files()):
            m = RANK_FILE.match(name)
            if m:
                ranks.add(int(m.group(1)))
        return sorted(ranks)

    # ------------------------------------------------------------------ reading bytes
    def reading_ahead(self, keys: Iterable[str], *, in_flight: int = 16, memory: int = 64 << 20,
                      label: str = "small items") -> Any:
        """A block during which the items of ``keys`` (an object's item, every chunk of a tensor, in
        that order: how `read_plain` and `read_tensor` read them) are fetched ahead in parallel when
        the checkpoint is in object storage (`remote.prefetching`): read one by one, each would wait
        a round trip. Nothing happens for a local checkpoint."""
        rc = self.remote
        if rc is None:
            return contextlib.nullcontext()

        def ranges() -> Iterator[tuple[str, int, int]]:
            for k in keys:
                e = self.entries.get(k)
                if e is None:
                    continue
                for loc in ([c.location for c in e.chunks] if e.is_tensor else [e.location]):
                    if loc is not None:
                        yield loc.file, int(loc.offset), int(loc.length)
        return rc.prefetching(ranges(), in_flight=in_flight, memory=memory, label=label)

    def read_object(self, key: str) -> Any:
        e = self.entry(key)
        if e.is_tensor:
            return self.read_tensor(key)
        if e.location is None:
            raise Incomplete(f"object '{key}' has no storage location", where=str(self.root / dcp.METADATA_FILE))
        return dcp.load_item(self.root, e.location, key=key, trust_pickle=self.trust_pickle, rc=self.remote)

    def read_plain(self, key: str) -> Any:
        """A small item's value (a step counter, a scheduler's count, Adam's ``step``) decoded
        without torch where `reshard.storage.pickles.plain_items` can: plain Python values, or a one-element
        tensor as a `PlainTensor`. Anything else (larger, other dtypes, other classes) is read
        through torch by `read_object`, which decides and raises as it always did.
        """
        e = self.entry(key)
        loc, limit = _plain_location(e)
        if loc is not None:
            where = str(self.root / loc.file)
            data = dcp.checked_item_bytes(self.root, loc, key=key, limit=limit, rc=self.remote)
            try:
                value = decode_item(data, key=key, where=where)
            except NotPlain:
                value = None
            else:
                if not e.is_tensor and not contains_tensor(value):
                    return value
                if e.is_tensor and isinstance(value, PlainTensor) and value.dtype == e.dtype \
                        and value.shape == tuple(e.shape):
                    return value
        return self.read_object(key)

    def read_plains(self, keys: Iterable[str]) -> list[tuple[str, Any, ReshardError | None]]:
        """`read_plain` of many small items, as (key, value, None) or (key, None, the error it raised),
        in the order of ``keys``.

        Why: a mixture of experts saves one ``step`` counter per parameter, tens of thousands of
        items of the same few bytes, and `read_plain` opens the data file inside the root (its
        checks cost about 0.2 ms) and decodes an archive (about 0.3 ms) for each. Here each data
        file is opened once, and an item stored as the same bytes (at the same dtype, shape and
        transforms) as one already read has the value `read_plain` gave for those bytes: what it
        decodes depends on nothing else. Immutable values only are shared; anything else, and a
        checkpoint in object storage, goes through `read_plain` item by item.
        """
        out: list[tuple[str, Any, ReshardError | None]] = []
        fds: dict[str, int] = {}
        seen: dict[tuple, Any] = {}
        try:
            for k in keys:
                try:
                    out.append((k, self._plain_alike(k, fds, seen), None))
                except ReshardError as exc:
                    out.append((k, None, exc))
        finally:
            for fd in fds.values():
                os.close(fd)
        return out

    def _plain_alike(self, key: str, fds: dict[str, int], seen: dict[tuple, Any]) -> Any:
        """`read_plain`'s value, shared with an item already read whose bytes are the same (`read_plains`)."""
        e = self.entry(key)
        loc, _ = _plain_location(e)
        if self.remote is not None or loc is None or loc.length > SHARED_PLAIN_BYTES:
            return self.read_plain(key)
        fd = fds.get(loc.file)
        if fd is None:
            try:
                fd = fds[loc.file] = safefs.open_read(self.root / loc.file, root=self.root)
            except OSError:
                return self.read_plain(key)  # which words the refusal
        raw = os.pread(fd, loc.length, loc.offset)
        alike = (raw, tuple(loc.transforms), e.is_tensor, e.dtype_name, tuple(e.shape or ()))
        if alike in seen:
            return seen[alike]
        value = self.read_plain(key)
        if isinstance(value, (PlainTensor, int, float, str, bytes, bool, type(None))):
            seen[alike] = value
        return value

    def object_bytes(self, key: str) -> bytes | None:
        """An object item's bytes as ``torch.load`` reads them (untransformed, CRC-checked), once
        proven to load safely (`reshard.storage.checkpoints.dcp.check_loadable`); None without a location."""
        e = self.entry(key)
        if e.is_tensor or e.location is None:
            return None
        data = dcp.checked_item_bytes(self.root, e.location, key=key, rc=self.remote)
        dcp.check_loadable(data, key=key, where=str(self.root / e.location.file), trust_pickle=self.trust_pickle)
        return data

    def same_object_bytes(self, other: Any, key: str) -> bool:
        """Whether object ``key`` is stored as the same bytes here and in ``other`` (both DCP), each
        proven loadable: then both load as the same value, and comparing needs no decoding."""
        if not isinstance(other, CheckpointIndex):
            return False
        a = self.object_bytes(key)
        return a is not None and a == other.object_bytes(key)

    def read_tensor(self, key: str) -> "torch.Tensor":
        e = self.entry(key)
        return self.read_box(key, whole(e.shape))

    def read_box(self, key: str, box: Box) -> "torch.Tensor":
        """Assemble one box of a tensor from the chunks that intersect it, reading only those.

        The box holds the stored bytes exactly: a bool byte other than 0x00 and 0x01, which torch's
        own copy would turn into 0x01, is kept, so that a conversion through here writes what it read
        and `verify`, which compares what this returns bit for bit, sees the byte the file holds."""
        import torch  # tensor bytes are decoded here, and only here of this module

        e = checked_box(self.entry(key), box, where=str(self.root))
        out = torch.empty(box.sizes, dtype=e.dtype.torch)
        filled = 0
        for c in e.chunks:
            inter = c.box.intersect(box) if e.shape else (c.box if not c.box.offsets else None)
            if inter is None:
                continue
            if c.location is None:
                raise Incomplete(f"a chunk of '{key}' has no storage location", where=str(self.root / dcp.METADATA_FILE))
            t = dcp.load_item(self.root, c.location, key=key, trust_pickle=False, rc=self.remote,
                              limit=dcp.tensor_item_limit(c.box.numel, e.dtype.itemsize), tensor=True)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != c.box.sizes:
                raise BadInput(f"chunk of '{key}' at {list(c.box.offsets)} holds {tuple(getattr(t, 'shape', ()))}, "
                               f"metadata says {list(c.box.sizes)}", where=str(self.root / c.location.file),
                               hint="The checkpoint is corrupt.")
            if t.dtype != e.dtype.torch:
                raise BadInput(f"chunk of '{key}' is {t.dtype}, metadata says {e.dtype}",
                               where=str(self.root / c.location.file), hint="The checkpoint is corrupt.")
            src = inter.relative_to(c.box).slices()
            dst = inter.relative_to(box).slices()
            if t.dtype == torch.bool:  # torch's bool copy writes 0x01 for any non-zero byte: copy the bytes as stored
                out.view(torch.uint8)[dst] = t.view(torch.uint8)[src]
            else:
                out[dst] = t[src]
            filled += inter.numel
        if filled != box.numel:
            raise Incomplete(f"the chunks of '{key}' cover {filled} of {box.numel} elements of the requested box",
                             where=str(self.root / dcp.METADATA_FILE))
        return out

    def deep_check(self, progress: Any = None, integrity: dict[str, Any] | None = None) -> list[Finding]:
        """Load every item; report the ones that fail (with --deep). ``progress.update(nbytes)``
        per item, its logical bytes (a key's add up to `Entry.nbytes`).

        ``integrity`` (a manifest's ``integrity`` field, see `reshard.storage.files.integrity`): each
        item's stored bytes are also hashed and compared with the recorded checksum (crc32 or
        sha256, as the record says); items
        that differ are reported first, in (file, offset) order, by one finding whose
        message names the first corrupt item (key and file) and whose keys list them all.
        """
        import torch

        from reshard.storage.files import integrity as integ

        found: list[Finding] = []
        algorithm = integ.check_algorithm(integrity, where=self.root / "manifest.json") if integrity is not None else None
        recorded = dict((integrity or {}).get("items") or {})
        mismatched: list[dict[str, Any]] = []
        unrecorded: list[tuple[str, str]] = []
        odd_bools: set[str] = set()  # bool keys already warned of (one warning per key, not per chunk)
        for e in self.entries.values():
            items = ([(c.location, c.box.sizes, c.box.offsets) for c in e.chunks] if e.is_tensor
                     else [(e.location, None, None)])
            for loc, sizes, c_offsets in items:
                if loc is None:
                    continue
                done = math.prod(sizes) * e.dtype.itemsize if sizes is not None else loc.length
                try:
                    raw = dcp.read_item_bytes(self.root, loc, key=e.key, rc=self.remote)
                    if integrity is not None:
                        want = recorded.pop(integ.item_name(loc.file, loc.offset), None)
                        if want is None:
                            unrecorded.append((e.key, loc.file))
                        elif integ.digest(raw, algorithm) != want:
                            mismatched.append({"kind": "mismatch", "key": e.key, "file": loc.file,
                                               "offset": loc.offset, "length": loc.length, "algorithm": algorithm})
                            if progress is not None:
                                progress.update(done)
                            continue
                    where = str(self.root / loc.file)
                    data = dcp.untransform(raw, loc.transforms, key=e.key, where=where,
                                           limit=dcp.tensor_item_limit(math.prod(sizes), e.dtype.itemsize) if sizes is not None else None)
                    check_item_crcs(data, key=e.key, where=where)  # against the writer's CRC-32s (CorruptItem)
                    obj = dcp.torch_load_item(data, key=e.key, where=where, trust_pickle=self.trust_pickle, tensor=sizes is not None)
                    if sizes is not None and (not isinstance(obj, torch.Tensor) or tuple(obj.shape) != sizes or obj.dtype != e.dtype.torch):
                        raise BadInput(f"item holds {type(obj).__name__} {tuple(getattr(obj, 'shape', ()))}, "
                                       f"metadata says {e.dtype_name} {list(sizes)}")
                    if sizes is not None and obj.dtype == torch.bool and e.key not in odd_bools:
                        odd = odd_bool_byte(obj)
                        if odd is not None:
                            odd_bools.add(e.key)
                            found.append(Finding("warning", "bool_bytes", _odd_bool_message(e.key, odd, sizes, c_offsets),
                                                 file=loc.file, keys=(e.key,)))
                except ReshardError as exc:
                    code = {"UnsafeInput": "unsafe_item", "CorruptItem": "crc_mismatch"}.get(type(exc).__name__,
                                                                                               "unreadable_item")
                    msg = f"{exc.message}. {exc.hint}" if exc.hint else exc.message
                    found.append(Finding("error", code, msg, file=loc.file, keys=(e.key,)))
                if progress is not None:
                    progress.update(done)
        if mismatched:
            mismatched.sort(key=lambda m: (m["file"], m["offset"]))
            first = mismatched[0]
            found.insert(0, Finding("error", "checksum_mismatch",
                                    integ.first_issue_message([integ.IntegrityIssue(**m) for m in mismatched]),
                                    file=first["file"], keys=tuple(dict.fromkeys(m["key"] for m in mismatched))))
        if unrecorded or recorded:
            what = [f"'{k}' ({f})" for k, f in unrecorded[:5]] + [f"{n} (not in .metadata)" for n in list(recorded)[:5]]
            found.append(Finding("warning", "checksum_unrecorded",
                                 f"{len(unrecorded) + len(recorded)} items and recorded checksums do not pair up "
                                 f"(.metadata changed after manifest.json was written?): {', '.join(what)}",
                                 file="manifest.json", keys=tuple(k for k, _ in unrecorded[:50])))
        self.findings.extend(found)
        return found


def odd_bool_byte(t: "torch.Tensor") -> tuple[int, int] | None:
    """``(flat index, byte)`` of the first element of a bool tensor whose stored byte is neither 0x00 nor 0x01, or None.

    Such a byte is what a uint8 tensor saved through ``.view(torch.bool)`` holds; no bool operation writes one.
    torch reads it inconsistently (``t[i]`` is True, ``t.sum()`` counts the byte, a copy writes 0x01), so reshard
    carries and compares it as stored, and ``inspect --deep`` says where it is."""
    import torch

    raw = t.view(torch.uint8).reshape(-1)
    odd = torch.nonzero(raw > 1)
    if not len(odd):
        return None
    i = int(odd[0, 0])
    return i, int(raw[i])


def _odd_bool_message(key: str, odd: tuple[int, int], sizes: tuple[int, ...], offsets: tuple[int, ...]) -> str:
    """The warning of `odd_bool_byte`'s find in a chunk at ``offsets`` of ``sizes``: the element in global coordinates."""
    flat, byte = odd
    at = []
    for s in reversed(sizes):
        at.append(flat % s)
        flat //= s
    index = [o + i for o, i in zip(offsets, reversed(at))]
    return (f"bool tensor '{key}' holds a byte that is neither False (0x00) nor True (0x01): 0x{byte:02x} at {index}. "
            "torch reads it inconsistently (indexing says True, sum() counts the byte, a copy writes 0x01); reshard "
            "copies and compares it as stored, so a conversion keeps it and verify tells it from True. Was a uint8 "
            "tensor saved through .view(torch.bool)? Save t != 0 to store plain bools")


def bitwise_equal(ix: CheckpointIndex, a: str, b: str) -> bool:
    """Compare two tensors bit for bit, one stored chunk of ``a`` at a time (bounded memory).

    When both are stored in the same boxes as plain contiguous items (what DCP writes), their
    storage bytes are compared where they lie, each checked against its writer's CRC-32, with
    no tensor decoded (`same_stored_bytes`); otherwise each box is decoded and compared."""
    ea, eb = ix.entries[a], ix.entries[b]
    if ea.shape != eb.shape or ea.dtype != eb.dtype:
        return False
    same = same_stored_bytes(ix, ea, eb)
    if same is not None:
        return same
    import torch

    for c in ea.chunks:
        if c.box.is_empty():
            continue
        ta = ix.read_box(a, c.box)
        tb = ix.read_box(b, c.box)
        if not torch.equal(ta.reshape(-1).view(torch.uint8), tb.reshape(-1).view(torch.uint8)):
            return False
    return True


def same_stored_bytes(ix: CheckpointIndex, ea: Entry, eb: Entry) -> bool | None:
    """Whether two tensors stored chunk for chunk in the same boxes hold the same bytes, read in
    pieces of at most 64 MiB from where they lie; None when a chunk is transformed, unusual
    (`reshard.storage.checkpoints.fastread.item_layout`), or its storage fails its writer's CRC-32 (the
    decoding path then says what is wrong)."""
    import zlib

    from reshard.storage.checkpoints.fastread import item_layout

    if [c.box for c in ea.chunks] != [c.box for c in eb.chunks]:
        return None
    if getattr(ix, "remote", None) is not None:  # readers of other formats read local files only
        return None  # no data file here to read in place: each box is read by range and decoded instead
    for ca, cb in zip(ea.chunks, eb.chunks):
        if ca.box.is_empty():
            continue
        spans = []
        for c in (ca, cb):
            loc = c.location
            if loc is None or loc.transforms:
                return None
            lay = item_layout(ix.root / loc.file, loc.offset, loc.length)
            if lay is None or not lay.contiguous or lay.shape != c.box.sizes or lay.dtype != ea.dtype:
                return None
            start = lay.storage_offset * lay.dtype.itemsize
            if start + lay.nbytes > lay.storage_nbytes:
                return None
            spans.append((ix.root / loc.file, lay.storage_file_offset, lay.storage_nbytes, start, lay.nbytes,
                          lay.storage_crc))
        if spans[0][2:4] != spans[1][2:4]:  # storages of other sizes, or the tensor at another place in them
            return None
        equal = True
        crcs = [0, 0]
        fds = [safefs.open_read(p, root=ix.root) for p, *_ in spans]
        try:
            done, total = 0, spans[0][2]
            while done < total:  # the whole storage, for its CRC; the tensor's bytes are a range of it
                n = min(64 << 20, total - done)
                pieces = [os.pread(fd, n, s[1] + done) for fd, s in zip(fds, spans)]
                if any(len(x) != n for x in pieces):
                    return None
                crcs = [zlib.crc32(x, c) for x, c in zip(pieces, crcs)]
                lo, hi = max(done, spans[0][3]), min(done + n, spans[0][3] + spans[0][4])
                if lo < hi and pieces[0][lo - done:hi - done] != pieces[1][lo - done:hi - done]:
                    equal = False
                done += n
        finally:
            for fd in fds:
                os.close(fd)
        if any(want and got != want for got, want in zip(crcs, (spans[0][5], spans[1][5]))):
            return None
        if not equal:
            return False
    return True
