"""A checkpoint in global terms, as plain data: entries, their chunks, where each item's bytes
live, and findings about it.

Every reader (DCP, per-rank safetensors, Hugging Face exports) builds these same records, so
the commands above never ask which format a checkpoint is in. Nothing here reads a file.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ContextManager, Iterable, Iterator, Sequence, overload

import numpy as np

from reshard.errors import BadInput
from reshard.model.dtypes import DType
from reshard.model.kinds import EntryKind, Severity
from reshard.model.geometry import Box, whole

__all__ = ["Chunk", "ChunkTable", "Entry", "EntryQueries", "Finding", "ItemLocation", "checked_box"]


@dataclass(frozen=True, slots=True)
class ItemLocation:
    """Where one item's bytes live: a file inside the checkpoint and a byte range."""

    file: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()



@dataclass(frozen=True, slots=True)
class Chunk:
    """One stored piece of a tensor: its box in global coordinates and where its bytes are."""

    box: Box
    location: ItemLocation | None


class ChunkTable(Sequence[Chunk]):
    """One tensor's chunks held as arrays, each `Chunk` made only when it is asked for.

    Why: a frontier checkpoint has tens of millions of chunks (405B x 16,384 ranks: 56 M), and a
    `Chunk` with its `Box` and `ItemLocation` costs about a kilobyte as Python objects, 50-60 bytes
    as columns. Code that walks chunks one by one sees a sequence of `Chunk` as before; code that
    walks all of them (the index's checks, the topology's evidence) reads the arrays.

    ``offsets`` and ``sizes`` are int64 ``(n, ndim)``; per chunk ``file`` (an index into
    ``files``, -1 when the chunk has no storage location), ``start`` and ``length`` (its byte
    range) and ``transform`` (an index into ``transforms``, -1 for none).
    """

    __slots__ = ("offsets", "sizes", "file", "start", "length", "transform", "files", "transforms")

    def __init__(self, offsets: np.ndarray, sizes: np.ndarray, file: np.ndarray, start: np.ndarray,
                 length: np.ndarray, transform: np.ndarray, files: Sequence[str],
                 transforms: Sequence[tuple[str, ...]]) -> None:
        self.offsets, self.sizes = offsets, sizes
        self.file, self.start, self.length, self.transform = file, start, length, transform
        self.files, self.transforms = files, transforms

    @classmethod
    def of(cls, chunks: "Sequence[Chunk] | ChunkTable", ndim: int) -> "ChunkTable":
        """``chunks`` as a table: itself when it is one, else the arrays of a list of `Chunk`
        (the readers of small formats build lists), so array code has one input."""
        if isinstance(chunks, ChunkTable):
            return chunks
        n = len(chunks)
        files: dict[str, int] = {}
        transforms: dict[tuple[str, ...], int] = {}
        locs = [c.location for c in chunks]
        return cls(np.array([c.box.offsets for c in chunks], dtype=np.int64).reshape(n, ndim),
                   np.array([c.box.sizes for c in chunks], dtype=np.int64).reshape(n, ndim),
                   np.array([-1 if x is None else files.setdefault(x.file, len(files)) for x in locs], dtype=np.int32),
                   np.array([0 if x is None else x.offset for x in locs], dtype=np.int64),
                   np.array([0 if x is None else x.length for x in locs], dtype=np.int64),
                   np.array([-1 if x is None or not x.transforms else transforms.setdefault(x.transforms, len(transforms))
                             for x in locs], dtype=np.int32),
                   list(files), list(transforms))

    def __len__(self) -> int:
        return len(self.offsets)

    def _make(self, off: list[int], size: list[int], f: int, start: int, length: int, t: int) -> Chunk:
        loc = None if f < 0 else ItemLocation(self.files[f], start, length, self.transforms[t] if t >= 0 else ())
        return Chunk(Box(tuple(off), tuple(size)), loc)

    @overload
    def __getitem__(self, i: int) -> Chunk: ...
    @overload
    def __getitem__(self, i: slice) -> list[Chunk]: ...

    def __getitem__(self, i: int | slice) -> Chunk | list[Chunk]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("chunk index out of range")
        return self._make(self.offsets[i].tolist(), self.sizes[i].tolist(), int(self.file[i]), int(self.start[i]),
                          int(self.length[i]), int(self.transform[i]))

    def __iter__(self) -> Iterator[Chunk]:
        step = 4096  # Python lists of a few thousand rows at a time: C speed, bounded memory
        make = self._make
        for lo in range(0, len(self), step):
            hi = lo + step
            yield from map(make, self.offsets[lo:hi].tolist(), self.sizes[lo:hi].tolist(), self.file[lo:hi].tolist(),
                           self.start[lo:hi].tolist(), self.length[lo:hi].tolist(), self.transform[lo:hi].tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (ChunkTable, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ChunkTable({len(self)} chunks)"

    def located_files(self) -> set[str]:
        """The data files these chunks' bytes live in."""
        return {self.files[f] for f in np.unique(self.file).tolist() if f >= 0}


@dataclass
class Entry:
    """One flat key of the checkpoint."""

    key: str
    kind: EntryKind
    shape: tuple[int, ...] | None = None
    dtype: DType | None = None
    chunks: list[Chunk] | ChunkTable = field(default_factory=list)
    location: ItemLocation | None = None  # objects only
    path: tuple = ()

    @property
    def is_tensor(self) -> bool:
        return self.kind == "tensor"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape or ():
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """Logical bytes of the global tensor (objects: stored bytes)."""
        if self.is_tensor:
            return self.numel * self.dtype.itemsize  # no tensor made: complex32 would warn on every call
        return self.location.length if self.location else 0

    @property
    def dtype_name(self) -> str | None:
        return str(self.dtype).removeprefix("torch.") if self.dtype is not None else None

    def files(self) -> set[str]:
        if self.is_tensor:
            if isinstance(self.chunks, ChunkTable):
                return self.chunks.located_files()
            return {c.location.file for c in self.chunks if c.location}
        return {self.location.file} if self.location else set()


@dataclass(frozen=True)
class Finding:
    """Something wrong (or notable) about the checkpoint, with enough to act on it."""

    severity: Severity
    code: str
    message: str
    file: str | None = None
    keys: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"severity": self.severity, "code": self.code, "message": self.message,
                "file": self.file, "keys": list(self.keys)}


def checked_box(entry: Entry, box: Box, *, where: str) -> Entry:
    """``entry`` when ``box`` is a box of its tensor, else BadInput: the one bounds check of every
    reader's ``read_box`` (`reshard.model.reader.CheckpointReader`).

    Why one: a box comes from a plan or from a hostile file's chunk records, and a reader that
    trusted it would read or write outside the tensor; four copies of the check drifted in the
    order of their tests (one asked for containment before comparing the ranks, and so raised
    ValueError instead of BadInput for a box of another rank).
    """
    if not entry.is_tensor:
        raise BadInput(f"'{entry.key}' is an object, not a tensor", where=where)
    shape = entry.shape or ()
    if len(box.sizes) != len(shape) or not whole(shape).contains(box):
        raise BadInput(f"box {list(box.offsets)}+{list(box.sizes)} lies outside '{entry.key}' of shape {list(shape)}",
                       where=where)
    return entry


class EntryQueries:
    """Queries shared by every read-only view (DCP, local output, export): they only need
    ``entries``, ``findings`` and ``root``, so each reader implements just how bytes are found."""

    entries: dict[str, Entry]
    findings: list[Finding]
    root: Path

    def reading_ahead(self, keys: Iterable[str]) -> ContextManager[Any]:
        """A block during which the items of ``keys`` may be fetched ahead of their reads: nothing
        to do for files on this machine; a checkpoint in object storage overrides it
        (`reshard.storage.checkpoints.index.CheckpointIndex.reading_ahead`)."""
        return contextlib.nullcontext()

    @property
    def complete(self) -> bool:
        return not any(f.severity == "error" for f in self.findings)

    def tensors(self) -> Iterator[Entry]:
        return (e for e in self.entries.values() if e.is_tensor)

    def entry(self, key: str) -> Entry:
        try:
            return self.entries[key]
        except KeyError:
            raise BadInput(f"no entry '{key}' in the checkpoint", where=str(self.root)) from None

    def read_plain(self, key: str) -> Any:
        """A small item's value for a counter: what `read_object` gives, unless a reader decodes
        small items without torch (`reshard.storage.checkpoints.index.CheckpointIndex.read_plain`)."""
        return self.read_object(key)  # type: ignore[attr-defined]

    def item_count(self) -> int:
        return sum(len(e.chunks) if e.is_tensor else 1 for e in self.entries.values())
