"""A checkpoint in global terms, as plain data: entries, their chunks, where each item's bytes
live, and findings about it.

Every reader (DCP, per-rank safetensors, Hugging Face exports) builds these same records, so
the commands above never ask which format a checkpoint is in. Nothing here reads a file.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from reshard.errors import BadInput
from reshard.model.dtypes import DType
from reshard.model.geometry import Box

__all__ = ["Chunk", "Entry", "EntryQueries", "Finding", "ItemLocation"]


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


@dataclass
class Entry:
    """One flat key of the checkpoint."""

    key: str
    kind: str  # "tensor" | "object"
    shape: tuple[int, ...] | None = None
    dtype: DType | None = None
    chunks: list[Chunk] = field(default_factory=list)
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
            return {c.location.file for c in self.chunks if c.location}
        return {self.location.file} if self.location else set()


@dataclass(frozen=True)
class Finding:
    """Something wrong (or notable) about the checkpoint, with enough to act on it."""

    severity: str  # "error" (incomplete/unreadable) | "inconsistent" | "warning" | "info"
    code: str
    message: str
    file: str | None = None
    keys: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"severity": self.severity, "code": self.code, "message": self.message,
                "file": self.file, "keys": list(self.keys)}


class EntryQueries:
    """Queries shared by every read-only view (DCP, local output, export): they only need
    ``entries``, ``findings`` and ``root``, so each reader implements just how bytes are found."""

    entries: dict[str, Entry]
    findings: list[Finding]
    root: Path

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
        small items without torch (`reshard.storage.index.CheckpointIndex.read_plain`)."""
        return self.read_object(key)  # type: ignore[attr-defined]

    def item_count(self) -> int:
        return sum(len(e.chunks) if e.is_tensor else 1 for e in self.entries.values())
