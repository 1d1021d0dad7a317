"""Streaming writer for PyTorch Distributed Checkpoint directories.

`DcpWriter` writes a checkpoint in the exact on-disk format of
``torch.distributed.checkpoint.FileSystemWriter`` (what ``dcp.save`` produces), one item at
a time, so memory stays bounded by the largest single item:

- data files ``__{rank}_0.distcp``, created lazily (a rank with no items gets no file).
  Each item (one chunk of one tensor, or one object) is its own ``torch.save`` archive
  at a byte range reserved at the end of its rank's file; its location is ``(file,
  offset, length)``. Tensor chunks are framed by `reshard.storage.checkpoints.archive` (the archive
  ``torch.save`` writes, built around the tensor's bytes, no pickling of data); objects
  go through ``torch.save``. Writes are positional (``pwritev``): `reserve_chunk` /
  `filled` let callers fill reserved items from several threads in any order, and the
  layout depends only on the order of reservations.
- checksums: the CRC-32 of every item as written (`checksums`), for the manifest's
  ``integrity`` record.
- ``.metadata``, a pickle that loads as a real ``torch.distributed.checkpoint.metadata.Metadata``
  (written by `reshard.storage.pickles.metadata_pickle` without importing torch):
  ``state_dict_metadata`` (global shape, dtype and chunk list per tensor; a
  ``BytesStorageMetadata`` per object), ``storage_data`` (``MetadataIndex`` ->
  ``_StorageInfo``), ``planner_data`` (flat key -> path in the nested state dict) and
  ``version``. It is written last, via ``.metadata.tmp`` + fsync + rename: a directory
  without ``.metadata`` is an uncommitted checkpoint, exactly as with DCP.

About ``planner_data``: stock ``dcp.load`` with a caller-provided state dict never needs it;
only tools that rebuild the nested state dict from the checkpoint alone (e.g.
``format_utils.dcp_to_torch_save``) use it. It is a hint. When no path is given it is
derived by splitting the key on ".", which nests *every* dotted component — a model
state dict saved by DCP as ``{"model": {"layers.0.w": t}}`` has the path
``("model", "layers.0.w")``, so callers that know the source's path should pass it on.

The writer only ever touches files inside the directory it was given (normally a
temporary directory from `reshard.storage.files.atomic.atomic_directory`).

Linked items (`link_chunk`, `link_object`): ``reshard convert --data link`` puts the
source's data files into the output directory as reflinks or hard links
(`reshard.storage.files.linkfs`) and declares their items here by location, unchanged (file,
offset, length and storage transforms); the writer never opens those files and records
no checksum for them. Its own files then need names no linked file has: ``file_name``
(rank -> name) replaces DCP's ``__{rank}_0.distcp``.

Resuming (``journal``, a `reshard.storage.files.journal.Journal`): every item written gets a journal
line, and a rerun of an interrupted conversion reopens the data files the journal names. A
journaled item is a candidate, never kept on the journal's word: an item whose bytes the
writer is handed (`write_chunk`, objects, blobs) is kept only when the bytes on disk equal
them (one read, compared byte for byte); a reserved item (`reserve_chunk`) stays pending and
`candidate` tells the caller to prove it (`reshard.engine.resume.prove_spliced`) and report
`proven` or `unproven`. The kept items' checksums are those of the bytes read in this run,
so `checksums` and ``.metadata`` are what an uninterrupted run produces.

Faults: an ``OSError`` from the file system (ENOSPC, EFBIG, EIO, ...) reaches the caller as
that ``OSError`` with its errno, also when it happens inside ``torch.save`` (which would
otherwise wrap it in a RuntimeError). Every item written and the ``.metadata`` commit are
write events for `reshard.storage.files.atomic.fault_point` (a test hook).
"""
from __future__ import annotations

import io
import os
import pickle
import sys
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any

from typing import TYPE_CHECKING

from reshard.errors import ReshardError
from reshard.model.dtypes import DType, from_torch
from reshard.model.geometry import Box, coverage_problems
from reshard.model.tensor_values import ArrayTensor
from reshard.storage.files.atomic import fault_point, fsync_dir
from reshard.model.checkpoint import ItemLocation
from reshard.storage.checkpoints.dcp import METADATA_FILE
from reshard.storage.pickles.metadata_pickle import ObjectMeta, TensorMeta, metadata_bytes
from reshard.storage.files.fileio import ALIGN, open_direct, read_exact, start_writeback, write_exact, crc32

if TYPE_CHECKING:
    import torch

    from reshard.storage.checkpoints.archive import Framing

DCP_VERSION = "1.0.0"
"""The version stock DCP stamps into `.metadata` (``CURRENT_DCP_VERSION`` of torch 2.13's
filesystem writer; ``tests/test_no_torch.py`` checks it), stated here so that writing
`.metadata` needs no torch import."""

__all__ = ["DcpWriter", "WriterError", "data_file_name", "object_item"]

# Every torch.save blob is a zip archive (torch >= 1.6 default; DCP always uses it).
_ZIP_MAGIC = b"PK\x03\x04"


class WriterError(ReshardError):
    """The writer was asked for something a consistent checkpoint cannot hold.

    This is a caller bug (a plan producing a wrong chunk), not a property of the user's
    input; it names the key and what is wrong. Exit code 2, like any unusable output.
    """

    exit_code = 2


def data_file_name(rank: int) -> str:
    """DCP's name for a rank's (single) data file."""
    return f"__{rank}_0.distcp"


@dataclass
class _Tensor:
    shape: tuple[int, ...]
    dtype: DType
    path: tuple
    chunks: list[tuple[tuple[int, ...], tuple[int, ...], ItemLocation]] = field(default_factory=list)
    offsets_seen: set[tuple[int, ...]] = field(default_factory=set)


@dataclass
class _Object:
    path: tuple
    location: ItemLocation


CHECKSUM_ALGORITHM = "crc32"


def _crc_hex(crc: int) -> str:
    return format(crc & 0xFFFFFFFF, "08x")


def tensor_bytes(t: "torch.Tensor") -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    import torch

    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _default_path(key: str) -> tuple:
    return tuple(key.split("."))


class DcpWriter:
    """Write a DCP checkpoint item by item into an existing (normally empty) directory.

    Typical use::

        w = DcpWriter(tmp)
        w.declare_tensor("model.w", (10, 4), torch.float32)
        w.write_chunk(0, "model.w", (0, 0), t[:5])
        w.write_chunk(1, "model.w", (5, 0), t[5:])
        w.write_object(0, "step", 100)
        w.finish()   # checks coverage, writes .metadata last

    Not thread-safe. After `finish` (or `close`) no further writes are accepted.
    """

    def __init__(self, directory: Path, owned: Any = None, file_name: Any = None, journal: Any = None,
                 observer: Any = None):
        """``owned``: optional predicate on a rank's file; items of files it rejects are only
        reserved (their bytes are written by another process of a distributed conversion,
        which passes their checksums back through `adopt`). ``file_name``: optional
        rank -> file name of this writer's data files (default `data_file_name`).
        ``journal``: optional `reshard.storage.files.journal.Journal` (a resumable conversion).
        ``observer``: optional watcher of this writer's own items (`reshard.storage.objectstore.stream.SpillStreamer`,
        which streams the files into a store as they fill): ``reserved(file, offset, length)`` as each
        is placed, ``filled(file, offset, length, spliced)`` once its bytes are written (``spliced``:
        by a caller through `filled`, rather than by the writer itself)."""
        self.directory = Path(directory)
        self._journal = journal
        self._candidates: dict[tuple[str, int], str] = {}  # reserved journaled items to prove -> recorded CRC-32
        self._owned = owned
        self._file_name = file_name or data_file_name
        self._linked_files: set[str] = set()  # files whose items are declared by `link_chunk` / `link_object`
        if not self.directory.is_dir():
            raise WriterError("the output directory does not exist", where=str(self.directory))
        self._fds: dict[int, int] = {}          # rank -> open data file
        self._fd_of: dict[str, int] = {}        # file name -> the same descriptor
        self._direct: dict[int, int | None] = {}  # rank -> O_DIRECT descriptor of its file (None: unsupported)
        self._end: dict[int, int] = {}          # rank -> bytes reserved in its file so far
        self._gaps: dict[int, list[tuple[int, int]]] = {}  # rank -> (start, end) of the holes before aligned items
        self._reused: set[int] = set()          # ranks whose file a resumed run reopened
        self._pending: set[tuple[str, int]] = set()  # reserved items not yet filled
        self._foreign: set[tuple[str, int]] = set()  # items another process writes
        self._tensors: dict[str, _Tensor] = {}
        self._objects: dict[str, _Object] = {}
        self._order: list[str] = []  # keys in first-seen order: the order of state_dict_metadata
        self._checksums: dict[str, str] = {}
        self._unflushed: dict[str, tuple[int, int, int]] = {}  # file -> (start, end, bytes) filled since its last writeback
        self._closed = False
        self._observer = observer

    # ------------------------------------------------------------------ declarations
    def declare_tensor(self, key: str, shape: tuple[int, ...], dtype: "DType | torch.dtype",
                       path: tuple | None = None) -> None:
        """Announce a tensor's global shape and dtype; its chunks follow with `write_chunk`.

        Declaring the same key again with the same shape and dtype is a no-op.
        """
        self._check_open()
        self._check_key(key)
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise WriterError(f"tensor '{key}' declared with negative size {list(shape)}", where=str(self.directory))
        try:
            dtype = from_torch(dtype)
        except ValueError:
            raise WriterError(f"tensor '{key}' declared with {dtype!r}, not a dtype", where=str(self.directory)) from None
        if key in self._objects:
            raise WriterError(f"'{key}' was already written as an object", where=str(self.directory))
        old = self._tensors.get(key)
        if old is not None:
            if old.shape != shape or old.dtype != dtype:
                raise WriterError(f"tensor '{key}' declared twice: {old.dtype} {list(old.shape)} and {dtype} {list(shape)}",
                                  where=str(self.directory))
            return
        self._tensors[key] = _Tensor(shape, dtype, tuple(path) if path is not None else _default_path(key))
        self._order.append(key)

    # ------------------------------------------------------------------ tensors
    def write_chunk(self, rank: int, key: str, offsets: tuple[int, ...],
                    tensor: "torch.Tensor | ArrayTensor") -> ItemLocation:
        """Append one chunk of a declared tensor to rank ``rank``'s file.

        The chunk's sizes are ``tensor.shape``; dtype, rank (number of dims) and bounds are
        checked against the declaration. Views are saved compact (contiguous, own storage),
        so a slice never drags its whole base storage into the file. An `ArrayTensor` (a value
        made without torch, `reshard.model.tensor_values`) is written as the item of the tensor
        it stands for, byte for byte, without importing torch.
        """
        from reshard.storage.checkpoints import archive

        if isinstance(tensor, ArrayTensor):
            offsets, sizes = self._check_chunk(key, offsets, tensor.shape)
            decl = self._tensors[key]
            if tensor.dtype != decl.dtype:
                raise WriterError(f"chunk of '{key}' at {list(offsets)} is {tensor.dtype}, declared {decl.dtype}",
                                  where=str(self.directory))
            if not archive.fits(tensor.nbytes):  # pragma: no cover - a value a plan makes is small
                raise WriterError(f"chunk of '{key}' is a {tensor.nbytes}-byte array value; such a value is written "
                                  "as a torch tensor", where=str(self.directory))
            loc = self._write_framed(rank, archive.framing(tensor.dtype, tensor.shape), tensor.data())
            self._add_chunk(key, offsets, sizes, loc)
            return loc
        torch = sys.modules.get("torch")  # no tensor exists before torch is imported
        if torch is None or not isinstance(tensor, torch.Tensor):
            raise WriterError(f"chunk of '{key}' is a {type(tensor).__name__}, not a tensor", where=str(self.directory))
        t = tensor.detach()
        if type(t) is not torch.Tensor:
            raise WriterError(f"chunk of '{key}' is a {type(t).__name__}; pass the plain local tensor",
                              where=str(self.directory))
        offsets, sizes = self._check_chunk(key, offsets, tuple(t.shape))
        decl = self._tensors[key]
        if from_torch(t.dtype) != decl.dtype:
            raise WriterError(f"chunk of '{key}' at {list(offsets)} is {t.dtype}, declared {decl.dtype}",
                              where=str(self.directory))
        t = _compact(t)
        if archive.fits(t.numel() * t.element_size()):
            loc = self._write_framed(rank, archive.framing(t.dtype, tuple(t.shape)), tensor_bytes(t))
        else:  # a chunk of 4 GiB or more: torch.save writes the zip64 fields
            loc = self._write_blob(rank, _save_bytes(t))
        self._add_chunk(key, offsets, sizes, loc)
        return loc

    def _write_framed(self, rank: int, fr: "Framing", data: memoryview) -> ItemLocation:
        """One hand-framed tensor item (`reshard.storage.checkpoints.archive`) around storage bytes ``data``:
        reserved, and written unless another process owns the file (or a resumed run keeps it)."""
        loc = self._reserve(rank, *_storage_at(fr))
        if not self.owns(rank):
            self._foreign.add((loc.file, loc.offset))
            return loc
        scrc = crc32(data)
        tail = fr.tail(scrc)
        if not self._keep(loc, [fr.head, data, tail]):
            write_exact(self._fds[rank], [fr.head, data, tail], loc.offset)
            self._filled(loc, fr.item_crc(scrc, tail))
        return loc

    def write_chunk_bytes(self, rank: int, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], blob: bytes) -> ItemLocation:
        """Append an existing ``torch.save``'d chunk blob verbatim (no re-serialisation).

        Only the geometry is checked (the blob is not deserialised); the caller vouches that
        the blob holds a ``sizes``-shaped tensor of the declared dtype, with any storage
        transforms (zstd, ...) already undone.
        """
        offsets, sizes = self._check_chunk(key, offsets, tuple(int(s) for s in sizes))
        self._check_blob(blob, f"chunk of '{key}' at {list(offsets)}")
        loc = self._write_blob(rank, blob)
        self._add_chunk(key, offsets, sizes, loc)
        return loc

    # ------------------------------------------------------------------ objects
    def write_object(self, rank: int, key: str, obj: Any, path: tuple | None = None) -> ItemLocation:
        """Append a non-tensor item: ``torch.save(obj)``, as DCP does for BYTE_IO items (`object_item`)."""
        self._check_object_key(key)
        loc = self._write_blob(rank, object_item(obj))
        self._add_object(key, path, loc)
        return loc

    def write_object_bytes(self, rank: int, key: str, blob: bytes, path: tuple | None = None) -> ItemLocation:
        """Append an already ``torch.save``'d object blob verbatim."""
        self._check_object_key(key)
        self._check_blob(blob, f"object '{key}'")
        loc = self._write_blob(rank, blob)
        self._add_object(key, path, loc)
        return loc

    # ------------------------------------------------------------------ linked items
    def link_chunk(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], location: ItemLocation) -> None:
        """Declare a chunk of a declared tensor whose item already lies in this directory, in a
        file put there by the caller (a reflink or hard link of a source file): the ``.metadata``
        names ``location`` as it is (with its storage transforms). Nothing is written or checksummed.
        The geometry is checked as for written chunks, and `finish` checks the tiling."""
        offsets, sizes = self._check_chunk(key, offsets, tuple(int(s) for s in sizes))
        self._add_chunk(key, offsets, sizes, self._linked(location, f"chunk of '{key}'"))

    def link_object(self, key: str, location: ItemLocation, path: tuple | None = None) -> None:
        """Like `link_chunk`, for an object item."""
        self._check_object_key(key)
        self._add_object(key, path, self._linked(location, f"object '{key}'"))

    def _linked(self, loc: ItemLocation, what: str) -> ItemLocation:
        if not isinstance(loc, ItemLocation) or loc.length < 0 or loc.offset < 0:
            raise WriterError(f"{what}: invalid location {loc!r}", where=str(self.directory))
        if loc.file in self._fd_of:
            raise WriterError(f"{what}: '{loc.file}' is one of the writer's own files, not a linked one",
                              where=str(self.directory), hint="This is a bug in reshard; nothing was committed.")
        if not (self.directory / loc.file).is_file():
            raise WriterError(f"{what}: linked file '{loc.file}' is not in the output directory",
                              where=str(self.directory), hint="This is a bug in reshard; nothing was committed.")
        self._linked_files.add(loc.file)
        return loc

    # ------------------------------------------------------------------ reserved items
    def reserve_chunk(self, rank: int, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
                      length: int) -> ItemLocation:
        """Claim ``length`` bytes at the end of rank ``rank``'s file for one chunk; fill it later.

        The caller writes the item's bytes at the returned location (``os.pwrite`` on
        `fd`), from any thread and in any order, then calls `filled` with the CRC-32 of
        exactly those bytes. `finish` refuses to commit while a reserved item is unfilled.
        Reserving in a fixed order gives the same file layout whatever order the items
        are then filled in, which is what makes parallel and distributed conversions
        byte-identical to a sequential one.
        """
        offsets, sizes = self._check_chunk(key, offsets, tuple(int(s) for s in sizes))
        from reshard.storage.checkpoints import archive

        dtype = self._tensors[key].dtype
        fr = archive.framing(dtype, sizes) if archive.fits(prod(sizes) * dtype.itemsize) else None
        if fr is not None and fr.length == length:  # a hand-framed item: its storage may be aligned
            loc = self._reserve(rank, *_storage_at(fr))
        else:
            loc = self._reserve(rank, length)
        self._reserved(loc, rank)
        self._add_chunk(key, offsets, sizes, loc)
        return loc

    def reserve_object(self, rank: int, key: str, length: int, path: tuple | None = None) -> ItemLocation:
        """Like `reserve_chunk`, for an object item."""
        self._check_object_key(key)
        loc = self._reserve(rank, length)
        self._reserved(loc, rank)
        self._add_object(key, path, loc)
        return loc

    def _reserved(self, loc: ItemLocation, rank: int) -> None:
        if not self.owns(rank):
            self._foreign.add((loc.file, loc.offset))
            return
        self._pending.add((loc.file, loc.offset))
        recorded = self._journal.claim(loc.file, loc.offset, loc.length) if self._journal is not None else None
        if recorded is not None:
            self._candidates[(loc.file, loc.offset)] = recorded

    def needs(self, loc: ItemLocation) -> bool:
        """Whether this writer must still write (or, a `candidate`, prove) the bytes of the reserved
        item ``loc``: its file is this process's and it is not filled yet."""
        return (loc.file, loc.offset) in self._pending

    def candidate(self, loc: ItemLocation) -> bool:
        """Whether the reserved item ``loc`` is journaled by the interrupted run this one resumes: the
        caller may keep it by proving its bytes are the ones it would write (`proven`), else writes it
        and calls `unproven` then `filled`."""
        return (loc.file, loc.offset) in self._candidates

    def proven(self, loc: ItemLocation, crc: int) -> None:
        """The caller read the candidate ``loc`` in this run and found exactly the bytes it would write
        (CRC-32 ``crc``, of the bytes read): kept, not written, no write event."""
        name = (loc.file, loc.offset)
        if name not in self._pending or self._candidates.pop(name, None) is None:
            raise WriterError(f"item {loc.file}:{loc.offset} is not a journaled item to keep",
                              where=str(self.directory))
        self._pending.discard(name)
        self._checksums[f"{loc.file}:{loc.offset}"] = _crc_hex(crc)
        self._journal.kept_item(loc.file, loc.length)
        self._kept(loc)

    def unproven(self, loc: ItemLocation, crc: int) -> None:
        """The candidate ``loc`` was not what the caller writes (its bytes as read have CRC-32 ``crc``):
        counted as rewritten; the caller writes it and calls `filled`."""
        recorded = self._candidates.pop((loc.file, loc.offset), None)
        if recorded is not None:
            self._journal.rewritten(recorded, _crc_hex(crc))

    @property
    def owns_all(self) -> bool:
        """Whether this writer writes every file (not one worker's share of a divided output)."""
        return self._owned is None

    def owns(self, rank: int) -> bool:
        """Whether this writer writes rank ``rank``'s file (always, unless ``owned`` says otherwise)."""
        return self._owned is None or bool(self._owned(rank))

    @staticmethod
    def chunk_length(dtype: "DType | torch.dtype", sizes: tuple[int, ...]) -> int:
        """The length of the item `write_chunk` writes for a chunk of ``dtype`` and ``sizes``."""
        from reshard.storage.checkpoints import archive

        return archive.framing(dtype, tuple(sizes)).length

    def adopt(self, checksums: dict[str, str]) -> None:
        """Take the checksums of items other processes wrote (``checksums()`` of their writers)."""
        for file, off in sorted(self._foreign):
            name = f"{file}:{off}"
            if name not in checksums:
                raise WriterError(f"no worker reported writing item {name}", where=str(self.directory),
                                  hint="A worker of the distributed conversion did not finish; nothing was committed.")
            self._checksums[name] = checksums[name]
        self._foreign.clear()

    def sync_files(self) -> None:
        """fsync this writer's data files (a distributed worker, before it reports its part done)."""
        for fd in self._fds.values():
            os.fsync(fd)

    def fd(self, rank: int) -> int:
        """The open file descriptor of rank ``rank``'s data file (after a reservation in it)."""
        return self._fds[rank]

    def direct_fd(self, rank: int) -> int | None:
        """A second, ``O_DIRECT`` descriptor of rank ``rank``'s data file for `ALIGN`-aligned
        writes that bypass the page cache (`reshard.engine.splice`), or None where the file
        system has no direct I/O."""
        if rank not in self._direct:
            self._check_open()
            self._direct[rank] = open_direct(self.directory / self._file_name(rank), os.O_WRONLY)
        return self._direct[rank]

    def filled(self, loc: ItemLocation, crc: int) -> None:
        """Record that a reserved item's bytes are written, with their CRC-32 (a write event)."""
        name = (loc.file, loc.offset)
        if name not in self._pending:
            raise WriterError(f"item {loc.file}:{loc.offset} was not reserved or is already filled",
                              where=str(self.directory))
        self._pending.discard(name)
        self._filled(loc, crc, spliced=True)

    # ------------------------------------------------------------------ results
    def checksums(self) -> dict[str, str]:
        """``"{file}:{offset}"`` -> CRC-32 (8 hex digits) of that item's bytes exactly as written."""
        return dict(self._checksums)

    def checksum_of(self, file: str, offset: int) -> str | None:
        """The CRC-32 (8 hex digits) recorded for the item at ``offset`` of ``file``, None before it is filled."""
        return self._checksums.get(f"{file}:{offset}")

    def locations(self) -> dict[tuple[str, tuple[int, ...] | None], ItemLocation]:
        """(key, chunk offsets or None for objects) -> where the item was written."""
        out: dict[tuple[str, tuple[int, ...] | None], ItemLocation] = {}
        for key in self._order:
            if key in self._tensors:
                for offsets, _sizes, loc in self._tensors[key].chunks:
                    out[(key, offsets)] = loc
            else:
                out[(key, None)] = self._objects[key].location
        return out

    def finish(self, sync_data: bool = True) -> Path:
        """Make the data durable, check every tensor is tiled exactly, commit `.metadata`.

        ``sync_data=False`` leaves the data files' fsync to the caller (`reshard convert`
        runs it in the background while it verifies the output, and the atomic commit
        fsyncs the whole directory before the rename).

        Raises `WriterError` naming the key when a declared tensor's chunks leave a gap or
        overlap; no `.metadata` is written then (the directory stays uncommitted).
        Returns the path of `.metadata`.
        """
        self._check_open()
        if self._pending or self._foreign:
            file, off = min(self._pending | self._foreign)
            self.close()
            raise WriterError(f"{len(self._pending | self._foreign)} reserved items were never written (first: {file}:{off})",
                              where=str(self.directory), hint="This is a bug in reshard; the output was not committed.")
        for key in self._order:
            decl = self._tensors.get(key)
            if decl is None:
                continue
            probs = coverage_problems(decl.shape, (Box(o, s) for o, s, _ in decl.chunks))
            if probs:
                self.close()
                detail = "; ".join(p.detail for p in probs)
                raise WriterError(
                    f"tensor '{key}' is not tiled exactly by its written chunks ({probs[0].kind}: {detail})",
                    where=str(self.directory),
                    hint="This is a bug in the resharding plan; the output was not committed.",
                )
        if self._journal is not None and self._journal.resumed:
            for rank, fd in self._fds.items():  # a reused file ends where the last item ends, as a new one
                if os.fstat(fd).st_size != self._end[rank]:
                    os.ftruncate(fd, self._end[rank])
                if rank in self._reused:  # and its holes read as a new file's: zeros, whatever was put there
                    for a, b in self._gaps.get(rank, ()):
                        write_exact(fd, [bytes(b - a)], a)
        if sync_data:
            for fd in self._fds.values():
                os.fsync(fd)
        self.close()

        md = self._metadata()
        tmp = self.directory / (METADATA_FILE + ".tmp")
        final = self.directory / METADATA_FILE
        with open(tmp, "wb") as f:
            f.write(md)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(self.directory)
        fault_point("metadata")
        return final

    def close(self) -> None:
        """Close the data files (and the journal) without committing (idempotent). `finish` calls it."""
        self._closed = True
        if self._journal is not None:
            self._journal.close()
        fds, self._fds = self._fds, {}
        direct, self._direct = self._direct, {}
        for fd in list(fds.values()) + [d for d in direct.values() if d is not None]:
            try:
                os.close(fd)
            except OSError:  # pragma: no cover
                pass

    # ------------------------------------------------------------------ internals
    def _metadata(self) -> bytes:
        """`.metadata` as torch's ``pickle.dump`` of its ``Metadata`` would read back, written without
        torch (`reshard.storage.pickles.metadata_pickle`): the keys in first-declared order, each chunk with
        its storage record; ``checkpoint_id`` unset (the directory is normally renamed into place later)."""
        items: list[TensorMeta | ObjectMeta] = []
        for key in self._order:
            if key in self._tensors:
                d = self._tensors[key]
                items.append(TensorMeta(key, d.dtype.name, d.shape, d.chunks, d.path))
            else:
                ob = self._objects[key]
                items.append(ObjectMeta(key, ob.location, ob.path))
        return metadata_bytes(items, version=DCP_VERSION)

    def _check_open(self) -> None:
        if self._closed:
            raise WriterError("the writer is already finished or closed", where=str(self.directory))

    def _check_key(self, key: str) -> None:
        if not isinstance(key, str) or not key:
            raise WriterError(f"invalid key {key!r}", where=str(self.directory))

    def _check_object_key(self, key: str) -> None:
        self._check_open()
        self._check_key(key)
        if key in self._tensors:
            raise WriterError(f"'{key}' is declared as a tensor, cannot write it as an object", where=str(self.directory))
        if key in self._objects:
            raise WriterError(f"object '{key}' written twice", where=str(self.directory))

    def _check_chunk(self, key: str, offsets: Any, sizes: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        self._check_open()
        decl = self._tensors.get(key)
        if decl is None:
            raise WriterError(f"chunk for undeclared tensor '{key}' (call declare_tensor first)", where=str(self.directory))
        offsets = tuple(int(o) for o in offsets)
        shape = decl.shape
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise WriterError(f"chunk of '{key}' has offsets {list(offsets)} and sizes {list(sizes)}, "
                              f"but the tensor has {len(shape)} dims {list(shape)}", where=str(self.directory))
        if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(offsets, sizes, shape)):
            raise WriterError(f"chunk of '{key}' at {list(offsets)} size {list(sizes)} lies outside {list(shape)}",
                              where=str(self.directory))
        if offsets in decl.offsets_seen:
            raise WriterError(f"two chunks of '{key}' at the same offsets {list(offsets)}", where=str(self.directory))
        return offsets, sizes

    def _check_blob(self, blob: bytes, what: str) -> None:
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise WriterError(f"{what}: blob is a {type(blob).__name__}, not bytes", where=str(self.directory))
        if bytes(memoryview(blob)[:4]) != _ZIP_MAGIC:
            raise WriterError(f"{what}: blob is not a torch.save archive (transformed or corrupt bytes?)",
                              where=str(self.directory))

    def _reserve(self, rank: int, length: int, storage_offset: int | None = None) -> ItemLocation:
        """The next ``length`` bytes of rank ``rank``'s file; with ``storage_offset`` (a large
        tensor item's head length), first skip to where its storage starts `ALIGN`-aligned."""
        self._check_open()
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise WriterError(f"invalid rank {rank!r}", where=str(self.directory))
        if rank not in self._end:
            if self.owns(rank):
                # O_EXCL: never reuse or clobber a file that is already there (unless a resumed run's
                # journal names it: a regular file of its own, whose items are proven before they are kept).
                flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
                name = self._file_name(rank)
                if name in self._linked_files:
                    raise WriterError(f"data file '{name}' is a linked file; the writer never writes into one",
                                      where=str(self.directory), hint="This is a bug in reshard; nothing was committed.")
                if self._journal is not None and self._journal.open_file(name):
                    flags = os.O_RDWR | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
                    self._reused.add(rank)
                self._fds[rank] = os.open(self.directory / name, flags, 0o644)
                self._fd_of[name] = self._fds[rank]
            self._end[rank] = 0
        start = self._end[rank]
        if storage_offset is not None:
            skip = -(start + storage_offset) % ALIGN  # a hole of under 4 KiB that no item owns
            if skip:
                self._gaps.setdefault(rank, []).append((start, start + skip))
            start += skip
        self._end[rank] = start + int(length)
        loc = ItemLocation(self._file_name(rank), start, int(length))
        if self._observer is not None and self.owns(rank):
            self._observer.reserved(loc.file, loc.offset, loc.length)
        return loc

    def _filled(self, loc: ItemLocation, crc: int, spliced: bool = False) -> None:
        digest = self._checksums[f"{loc.file}:{loc.offset}"] = _crc_hex(crc)
        if self._observer is not None:
            self._observer.filled(loc.file, loc.offset, loc.length, spliced)
        self._write_back(loc)
        if self._journal is not None:
            self._journal.record(loc.file, loc.offset, loc.length, digest)
        fault_point(f"item {loc.file}:{loc.offset}")

    def _write_back(self, loc: ItemLocation) -> None:
        """Start the kernel's writeback of filled items (the fsync before the commit then finds less to
        do), `WRITEBACK_BATCH` bytes of a file at a time: one ``sync_file_range`` per item cost about
        0.5 ms of CPU each, a third of a small conversion's writing (297 items of a few KiB), for pages
        the final fsync writes anyway. An item of a batch or more goes at once, as before; smaller ones
        accumulate per file (the range spanning them, holes of unfilled items included: writeback
        skips clean pages) until they add up to a batch."""
        lo, hi, n = self._unflushed.get(loc.file, (loc.offset, loc.offset, 0))
        lo, hi, n = min(lo, loc.offset), max(hi, loc.offset + loc.length), n + loc.length
        if n >= WRITEBACK_BATCH:
            start_writeback(self._fd_of[loc.file], lo, hi - lo)
            self._unflushed.pop(loc.file, None)
        else:
            self._unflushed[loc.file] = (lo, hi, n)

    def _keep(self, loc: ItemLocation, parts: list[Any]) -> bool:
        """Whether a resumed run keeps this owned item, whose bytes are ``parts``: only when its journal
        names it and the bytes on disk now are exactly ``parts`` (read and compared in this run; the
        recorded CRC-32 is not evidence). Its checksum is then the bytes'."""
        if self._journal is None:
            return False
        recorded = self._journal.claim(loc.file, loc.offset, loc.length)
        if recorded is None:
            return False
        same, crc = _same_bytes(self._fd_of[loc.file], loc.offset, parts)
        if not same:
            self._journal.rewritten(recorded, _crc_hex(crc))
            return False
        self._checksums[f"{loc.file}:{loc.offset}"] = _crc_hex(crc)
        self._journal.kept_item(loc.file, loc.length)
        self._kept(loc)
        return True

    def _kept(self, loc: ItemLocation) -> None:
        """A journaled item kept (its bytes on disk proven): final, as a filled one is, for the observer."""
        if self._observer is not None:
            self._observer.filled(loc.file, loc.offset, loc.length, True)

    def _write_blob(self, rank: int, blob: Any) -> ItemLocation:
        loc = self._reserve(rank, len(blob))
        if not self.owns(rank):
            self._foreign.add((loc.file, loc.offset))
            return loc
        if self._keep(loc, [blob]):
            return loc
        write_exact(self._fds[rank], [blob], loc.offset)
        self._filled(loc, crc32(blob))
        return loc

    def _add_chunk(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], loc: ItemLocation) -> None:
        decl = self._tensors[key]
        decl.chunks.append((offsets, sizes, loc))
        decl.offsets_seen.add(offsets)

    def _add_object(self, key: str, path: tuple | None, loc: ItemLocation) -> None:
        self._objects[key] = _Object(tuple(path) if path is not None else _default_path(key), loc)
        self._order.append(key)


ALIGN_FROM = 1 << 20  # storages this large start ALIGN-aligned in their file (padding < 0.4 %)
WRITEBACK_BATCH = 4 << 20  # `DcpWriter._write_back`: filled bytes of a file per writeback hint


def _storage_at(fr: Framing) -> tuple[int, int | None]:
    """``_reserve`` arguments for a hand-framed item: its length, and its head length when
    its storage is large enough to be written with direct I/O (`reshard.engine.splice`)."""
    return fr.length, (fr.storage_offset if fr.storage_nbytes >= ALIGN_FROM else None)


_COMPARE_SLAB = 8 << 20


def _same_bytes(fd: int, offset: int, parts: list[Any]) -> tuple[bool, int]:
    """Whether the bytes of ``fd`` at ``offset`` are exactly ``parts`` one after the other, and the
    CRC-32 of the bytes read (all of them, also after a difference: the journal's caller names why)."""
    same, crc, pos = True, 0, offset
    buf = bytearray(min(_COMPARE_SLAB, max(1, sum(len(memoryview(p).cast("B")) for p in parts))))
    for part in parts:
        mv = memoryview(part).cast("B")
        for i in range(0, len(mv), len(buf)):
            n = min(len(buf), len(mv) - i)
            view = memoryview(buf)[:n]
            read_exact(fd, view, pos)
            crc = crc32(view, crc)
            same = same and view.tobytes() == mv[i:i + n].tobytes()  # memcmp, not element by element
            pos += n
    return same, crc


_PLAIN_TYPES = (type(None), bool, int, float, str, bytes)
_PLAIN_DEPTH = 32


def _plain(obj: Any, depth: int = 0) -> bool:
    """Whether ``obj`` is built only of None, bool, int, float, str, bytes and plain lists, tuples and
    dicts (exact types: a subclass pickles by its class), no deeper than `_PLAIN_DEPTH`."""
    t = type(obj)
    if t in _PLAIN_TYPES:
        return True
    if depth >= _PLAIN_DEPTH:
        return False
    if t is list or t is tuple:
        return all(_plain(v, depth + 1) for v in obj)
    if t is dict:
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in obj.items())
    return False


def object_item(obj: Any) -> bytes:
    """The item ``torch.save(obj)`` writes. A plain value (`_plain`: the ints, floats and lists a plan
    makes for a reseeded rank or a data position) is framed here without torch, byte for byte what torch
    writes (`reshard.storage.checkpoints.archive.object_archive`: torch pickles it with the standard
    protocol-2 pickler, which names nothing of torch); anything else goes through ``torch.save``."""
    if _plain(obj):
        from reshard.storage.checkpoints import archive

        return archive.object_archive(pickle.dumps(obj, protocol=2))
    return _save_bytes(obj)


def _save_bytes(obj: Any) -> bytes:
    """``torch.save(obj)`` in memory (objects are small; tensors take the framing path)."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _compact(t: "torch.Tensor") -> "torch.Tensor":
    """A CPU tensor that is contiguous and owns exactly its bytes (no offset, no excess), the bytes as they were."""
    import torch  # a tensor was given: torch is imported already

    if t.dtype == torch.bool:  # torch's bool copy writes 0x01 for any non-zero byte: compact the stored bytes instead
        return _compact(t.view(torch.uint8)).view(torch.bool)
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t
