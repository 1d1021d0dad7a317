"""A checkpoint as one command reads it, opened once: the `Source` handed down to planning, the
engine and verification in place of a bare path.

Why: a source is a directory on this machine or a prefix in an object store, read by a reader
that costs seconds to open at a thousand ranks (its whole ``.metadata`` parsed), with a trust
setting for pickled objects. Asked again at every step ("is this path remote? is it already
open?"), the answer lived in global registries looked up at two dozen places. A `Source` carries
the answer instead: where it is (``root``, and for a store its ``url`` and `RemoteCheckpoint`),
how it may be read (``trust_pickle``), its reader, opened on first use and kept, and what a
description found (``inspection``, set by the planner).

`opened` is the one way a command turns what the user typed into a `Source`: a path is itself, a
URL (``s3://bucket/prefix``) is staged in a private directory for as long as the block runs
(`remote.staged`: `.metadata` and the sidecars fetched, data read by byte range).
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from reshard.storage.objectstore import remote
from reshard.storage.checkpoints.sidecars import fetched_to_describe

if TYPE_CHECKING:  # the readers import this module's layer-mates; typed here only
    from reshard.model.inspection import Inspection
    from reshard.storage.checkpoints.hf_dcp import HfDcpIndex
    from reshard.storage.checkpoints.index import CheckpointIndex
    from reshard.storage.objectstore.remote import RemoteCheckpoint

__all__ = ["Source", "opened", "is_url"]


def is_url(text: str | os.PathLike) -> bool:
    """Whether what the user typed names a store (``s3://...``) rather than a path: the one test of
    the kind outside the store output, used before a `Source` exists (argument checks)."""
    return remote.is_url(text)


@dataclass
class Source:
    """A checkpoint opened for one command.

    ``root``: the directory read (the checkpoint itself, or the private staged directory that
    stands for a store prefix); ``url`` and ``remote``: set for a store, every data byte read
    through ``remote``; ``trust_pickle``: whether objects torch pickled may be unpickled;
    ``inspection``: what describing it found, once the planner has described it.
    """

    root: Path
    url: str | None = None
    remote: RemoteCheckpoint | None = None
    trust_pickle: bool = False
    inspection: Inspection | None = None
    #: its readers by trust setting, opened on first use: this Source's own (two Sources share nothing)
    _readers: dict[bool, CheckpointIndex | HfDcpIndex] = field(default_factory=dict, init=False, repr=False,
                                                                compare=False)

    @classmethod
    def local(cls, path: str | os.PathLike, *, trust_pickle: bool = False) -> Source:
        """A checkpoint directory on this machine."""
        return cls(Path(path), trust_pickle=trust_pickle)

    @classmethod
    def of(cls, given: Source | str | os.PathLike, *, trust_pickle: bool = False) -> Source:
        """``given`` itself when it is a `Source`, else the checkpoint directory it names on this
        machine: what library callers and tests hand the planner. A store is opened by `opened`
        only, so a path never stands for a store here."""
        return given if isinstance(given, Source) else cls.local(given, trust_pickle=trust_pickle)

    @property
    def is_remote(self) -> bool:
        return self.remote is not None

    @property
    def display(self) -> str:
        """What a report names as the checkpoint: the URL, else the path as given."""
        if self.url is not None:
            return self.url
        return str(self.root)

    def __str__(self) -> str:
        """A Source in a message reads as what a report names it (`display`)."""
        return self.display

    @property
    def name(self) -> str:
        """What an output records as its source: the URL, else the resolved path."""
        return self.url if self.url is not None else str(self.root.resolve())

    def store_reads(self) -> dict | None:
        """What reading it from the store has cost so far (None for a local checkpoint)."""
        return self.remote.reads() if self.remote is not None else None

    def check_unchanged(self) -> None:
        """Before an output read from it is committed: a store prefix listed again (exit 2 naming
        an object that changed); nothing to do for a local checkpoint."""
        if self.remote is not None:
            self.remote.check_unchanged()

    def reader(self, *, trust_pickle: bool | None = None) -> CheckpointIndex | HfDcpIndex:
        """Its reader (DCP, or torch's safetensors-backed DCP), opened on first use and kept: every
        later step reads the same parsed ``.metadata``. The inspection's reader is taken when the
        trust setting is the same. A store's reader is handed its `RemoteCheckpoint`."""
        trust = self.trust_pickle if trust_pickle is None else trust_pickle
        if trust not in self._readers:
            from reshard.storage.checkpoints.hf_dcp import HfDcpIndex, open_source
            from reshard.storage.checkpoints.index import CheckpointIndex

            index = self.inspection.index if self.inspection is not None else None
            if type(index) in (CheckpointIndex, HfDcpIndex) and index.trust_pickle == trust \
                    and Path(index.root) == self.root:  # what describing it opened (not an export's reader)
                self._readers[trust] = index
            else:
                self._readers[trust] = open_source(self.root, trust_pickle=trust, remote=self.remote)
        return self._readers[trust]


@contextmanager
def opened(text: str | os.PathLike, *, trust_pickle: bool = False,
           fetch: Callable[[str], bool] | None = fetched_to_describe) -> Iterator[Source]:
    """The `Source` a command argument names, for as long as the block runs. For a URL the staged
    directory is removed afterwards, whatever happens. ``fetch``: which sidecars a store source
    fetches at once (`remote.staged`; by default those a reader may open by name, None for all)."""
    if is_url(text):
        with remote.staged(str(text), fetch=fetch) as (root, rc):
            yield Source(root, url=rc.url, remote=rc, trust_pickle=trust_pickle)
    else:
        yield Source.local(text, trust_pickle=trust_pickle)
