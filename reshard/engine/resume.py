"""Resume: when a rerun may keep what an interrupted conversion already wrote.

A killed conversion leaves its hidden output directory and a journal of the items it wrote
(`reshard.storage.files.journal`, which knows files and CRCs and nothing of plans). A rerun
continues in that directory only under the same resume key: the same plan (its
fingerprint), the same source files by size and mtime, and the same writer (output format,
reshard and torch versions), made here for the single process (`reshard.engine.conversion`)
and the torchrun workers (`reshard.engine.distributed`) alike.

The key only decides where to look. Sizes and mtimes are carried to other bytes by
``cp -p``, ``touch -r`` and ``rsync -t``, and a journal line can be edited by anyone who can
write the directory, so neither is evidence that a journaled item is right. An item is kept
only when this run proves it is exactly the bytes it would write from the source as it is
now; everything else is rewritten:

* items whose bytes the writer is handed (objects, rewritten or transformed tensors):
  the bytes on disk are compared with them (`reshard.storage.checkpoints.dcp_writer.DcpWriter`);
* items spliced from source bytes (`prove_spliced`): the item is read and compared with
  what `reshard.engine.splice.SpliceJob.run` writes from the current source: its head equal
  to the framing's, its storage equal bitwise to the source rows it is cut from (read now,
  and fed to the run's CRC ledger, so a source contradicting its own records still stops
  the run), its tail equal to the framing's tail for the storage's CRC-32.

This is the simplest exact proof: one read of the kept item and of the source bytes it
comes from, no write. The alternative, composing the CRC-32s of source pieces the journal
lists, would trust the journal to name the right pieces and a CRC-32 to stand for bytes.
A kept spliced item is thereby compared bitwise with the source in this run and its source
rows checked against their records; the write checks count it as the copy that would have
written it (`reshard.engine.copy`), and the resume summary says that every kept item was
compared in this run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from reshard.engine.splice import SpliceJob, WorkerBuffers, item_row_bytes, slab_difference
from reshard.model.geometry import contiguous_run
from reshard.model.plan import Plan
from reshard.storage.checkpoints.crcledger import CrcLedger
from reshard.storage.files.fileio import FdCache, crc32, read_exact  # crc32: the copy's (native where built)
from reshard.storage.files.journal import ResumeKey, source_identity
from reshard.storage.source import Source

__all__ = ["Proof", "Resumed", "prove_spliced", "resume_key", "whole_storages"]


def resume_key(plan: Plan, source: Source, output_format: str = "dcp") -> ResumeKey:
    """What a rerun must share with an interrupted conversion to look at its bytes (`reshard.storage.files.journal`):
    the plan's fingerprint, the source files as they are (on disk, or as a store lists them), and what
    else decides the bytes written."""
    from reshard.semantics.manifest import torch_version
    from reshard.version import __version__

    # torch's version from its installed metadata (what torch.__version__ says) without importing it
    return ResumeKey(plan=plan.fingerprint(), source=source_identity(source.root, source.remote),
                     options={"output_format": output_format, "reshard": __version__, "torch": torch_version()})


@dataclass(frozen=True)
class Proof:
    """The outcome of comparing a journaled item with what this run writes."""

    equal: bool   # byte for byte what this run writes from the source now
    crc: int      # CRC-32 of the item's bytes as read now (its checksum when kept)


@dataclass(frozen=True)
class Resumed:
    """What a copy job that had a journaled item to prove returns to the writer's bookkeeping:
    ``kept`` (``crc``: the bytes read), or rewritten (``found``: the CRC-32 of the bytes it replaced,
    ``crc``: of the bytes written)."""

    kept: bool
    found: int
    crc: int


def prove_spliced(job: SpliceJob, fd: int, at: int, buffers: WorkerBuffers, files: FdCache, slab_bytes: int,
                  ledger: Any = None) -> Proof:
    """Whether the item at ``fd:at`` is exactly what ``job.run`` would write there now (module docstring).

    Reads the item once, slab by slab (at most `CHECK_WINDOW` of target and of source rows at a
    time), and the source rows each slab is cut from. The source is checked against its own
    records as a copy would check it: when the item is made of whole recorded source storages
    laid end to end (`whole_storages`), the storage CRC-32 of the item, equal bitwise to those
    storages, must equal their records combined (else the item is rewritten, and the copy names
    the corrupt source); otherwise the source rows' CRC-32s go to ``ledger`` (a `CrcLedger`), as
    in `SpliceJob.check`. After a difference only the item is read on, for its CRC-32.
    """
    fr, box, isz = job.framing, job.box, job.itemsize
    recorded = job.recorded_crc() if whole_storages(job) else None
    ledger = None if recorded is not None else (ledger if ledger is not None else CrcLedger())
    head = bytearray(len(fr.head))
    read_exact(fd, head, at)
    equal = bytes(head) == fr.head
    crc = crc32(head)
    scrc = 0
    pos = at + fr.storage_offset
    sizes = box.sizes
    if not sizes:  # a 0-d tensor: one element
        view = buffers.get(isz)
        read_exact(fd, view, pos)
        scrc, crc = crc32(view), crc32(view, crc)
        src = job.sources[0]
        other = buffers.get_aux(isz)
        read_exact(files.fd(src.path), other, src.storage_at)
        if src.crc is not None and ledger is not None:
            ledger.add(src.record(isz), 0, isz, crc32(other))
        equal = equal and bytes(view) == bytes(other)
    elif sizes[0] and item_row_bytes(sizes, isz):
        row = item_row_bytes(sizes, isz)
        meeting, slabs = job.check_slabs(slab_bytes)
        for r0, slab in slabs:
            out = buffers.get(slab.numel * isz)
            read_exact(fd, out, pos + r0 * row)
            scrc = crc32(out, scrc)
            crc = crc32(out, crc)
            if equal:
                bad, seen = slab_difference(out, slab, meeting, isz, files, buffers, ledger)
                equal = bad is None and seen == slab.numel
    if equal and recorded is not None and scrc != recorded:
        equal = False  # equal to a source that contradicts its records: rewritten, and the copy names it
    tail = bytearray(fr.tail_nbytes)
    read_exact(fd, tail, pos + fr.storage_nbytes)
    equal = equal and bytes(tail) == fr.tail(scrc)
    return Proof(equal, crc32(tail, crc))


def whole_storages(job: SpliceJob) -> bool:
    """Whether every source piece of the job's target chunk is one contiguous run on both sides
    (dim-0 re-cuts, the common case) and they cover it: the condition under which
    `reshard.engine.splice.SpliceJob.run` copies runs and may check them by the source records."""
    box = job.box
    covered = 0
    for s in job.sources:
        inter = s.box.intersect(box) if box.sizes else s.box
        if inter is None or inter.is_empty():
            continue
        if contiguous_run(inter.relative_to(s.box), s.box.sizes) is None \
                or contiguous_run(inter.relative_to(box), box.sizes) is None:
            return False
        covered += inter.numel
    return covered == box.numel
