"""What every checkpoint reader offers, declared once: `CheckpointReader`.

Four readers turn files into the model's entries and chunks (DCP: `reshard.storage.checkpoints.index.CheckpointIndex`;
torch's safetensors-backed DCP: `reshard.storage.checkpoints.hf_dcp.HfDcpIndex`; a safetensors export:
`reshard.storage.checkpoints.safetensors_format.ExportIndex`; reshard's per-rank safetensors:
`reshard.storage.checkpoints.local_format.LocalIndex`), and every layer above asks them the same questions
without asking which format a checkpoint is in. Declaring those questions here (each reader
subclasses this Protocol) makes the agreement a checked fact (`tests/test_typed_seams.py`)
instead of four classes that happen to spell the same methods; the bounds check they share is
`reshard.model.checkpoint.checked_box`.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, ContextManager, Iterable, Iterator, Protocol, runtime_checkable

from reshard.model.checkpoint import Entry, Finding
from reshard.model.geometry import Box

if TYPE_CHECKING:
    import torch


@runtime_checkable
class CheckpointReader(Protocol):
    """An opened checkpoint, read-only: its entries and findings, and the bytes of each item on demand."""

    root: Path
    version: str | None
    trust_pickle: bool
    entries: dict[str, Entry]
    findings: list[Finding]
    file_sizes: dict[str, int]

    @property
    def complete(self) -> bool:
        """No finding is an error: every byte range the entries name is present."""
        ...

    def entry(self, key: str) -> Entry:
        """The entry of ``key``, or BadInput naming the checkpoint."""
        ...

    def tensors(self) -> Iterator[Entry]: ...

    def item_count(self) -> int: ...

    def data_files(self) -> list[str]: ...

    def writer_ranks(self) -> list[int]: ...

    def reading_ahead(self, keys: Iterable[str]) -> ContextManager[object]: ...

    def read_object(self, key: str) -> object: ...

    def read_plain(self, key: str) -> object:
        """A small item's value, decoded without torch where the reader can."""
        ...

    def read_tensor(self, key: str) -> "torch.Tensor": ...

    def read_box(self, key: str, box: Box) -> "torch.Tensor":
        """One box of a tensor in global coordinates, checked by `checked_box` first."""
        ...

    def deep_check(self, progress: object = None) -> list[Finding]:
        """Read every item: the findings of what could not be read."""
        ...


READER_METHODS = ("entry", "tensors", "item_count", "data_files", "writer_ranks", "reading_ahead", "read_object",
                  "read_plain", "read_tensor", "read_box", "deep_check")
"""The methods of `CheckpointReader`, for the check that each reader defines them itself or by `EntryQueries`."""

__all__ = ["CheckpointReader", "READER_METHODS"]
