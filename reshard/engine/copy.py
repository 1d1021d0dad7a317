"""A plan's items written into a new DCP checkpoint: the copy every conversion but ``--data link`` runs.

Per tensor, each target chunk is assembled from the source chunks that intersect it (a
source chunk whose box is exactly the target's is copied byte for byte), so memory is
bounded by the largest chunk involved, not by the checkpoint: re-cut tensors are spliced
as bytes on a bounded pool (`reshard.engine.splice`, TP column blocks by
`reshard.engine.bands`); rewritten, transformed or cast tensors and objects are written by
the calling thread in between, objects validated with the safe loader and copied verbatim.

It exists apart from the conversion run (`reshard.engine.conversion`) because two runs
share it: a single process writes every item, and each worker of a distributed run
(`reshard.engine.distributed`) reserves every item and fills only its own files. Both
record how each item was checked while written (`WriteChecks`, `PieceLedger`), so the
verification afterwards compares only what was not. A resumed run keeps an item an
interrupted run journaled only once it has proven it, in this run, against the source as
it is now (`reshard.engine.resume`): a kept spliced item was read and compared bitwise with
its source rows, whose CRC-32s went to the same ledger, and is counted as the copy that
would have written it counts it (`_count_kept`), so a resumed run reports what an
uninterrupted one does.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ContextManager, Optional

from reshard.model.geometry import Box
from reshard.model.dtypes import dtype_named
from reshard.model.tensor_values import is_tensor_value
from reshard.storage.checkpoints.index import CheckpointIndex
from reshard.storage.checkpoints import archive
from reshard.engine import bands, splice
from reshard.storage.checkpoints import dcp as dcp_io
from reshard.storage.checkpoints.dcp import check_loadable
from reshard.storage.checkpoints.crcledger import CrcLedger, StorageRecord
from reshard.storage.checkpoints.dcp_writer import DcpWriter
from reshard.storage.files.fileio import ALIGN, FdCache
from reshard.engine.resume import Resumed, prove_spliced, whole_storages
from reshard.engine.splice import run_jobs
from reshard.engine.shares import Shares, held, item_reads, locating, read_window, recut, shares_of, source_ranges
from reshard.engine.pipeline import Output, Run, writing_bytes
from reshard.model.kinds import Action
from reshard.model.plan import Plan

if TYPE_CHECKING:
    from reshard.semantics.manifest import Manifest
    from reshard.storage.files.journal import Journal


@dataclass(frozen=True)
class IOOptions:
    """How a conversion reads and writes: pool size, memory window, and whether to splice bytes."""

    threads: int = field(default_factory=splice.default_threads)
    window: int = field(default_factory=splice.default_window)
    splice: bool = True
    direct: bool = True  # spliced bytes bypass the page cache (O_DIRECT) where the file systems allow
    ahead: Optional[int] = None  # at most these bytes of items written ahead of the writer's bookkeeping (None: by count)
    # a worker streaming from a store: only the byte ranges its files are cut from, fetched into sparse files
    # in ``read_folder``, at most ``read_window`` bytes of them on local disk at once (`RangeWindow`); 0: off
    read_window: int = 0
    read_folder: Optional[Path] = None


class PieceLedger(splice.SourceLedger):
    """The copy's `reshard.storage.checkpoints.crcledger.CrcLedger` that also keeps the pieces of every storage
    it has not checked yet, so a worker of a distributed run can hand the storages it read only in
    part (the rest went to another worker) to the one that checks them against their records
    (`reshard.engine.distributed`). A storage's pieces are dropped once it is checked."""

    def __init__(self) -> None:
        super().__init__()
        self._pieces_lock = threading.Lock()
        self._pieces: dict[tuple[str, int], list[tuple[int, int, int]]] = {}

    def add(self, rec: StorageRecord, offset: int, nbytes: int, crc: int) -> bool:
        done = super().add(rec, offset, nbytes, crc)
        if rec.recorded and rec.nbytes and nbytes > 0:
            with self._pieces_lock:
                if self.verified(rec):
                    self._pieces.pop(rec.ident, None)
                else:
                    self._pieces.setdefault(rec.ident, []).append((offset, nbytes, crc))
        return done

    def partial(self) -> list[tuple[StorageRecord, list[tuple[int, int, int]]]]:
        """The recorded storages seen only in part, in (file, offset) order, each with its pieces
        ``(offset within the storage, nbytes, CRC-32)``."""
        with self._pieces_lock:
            return [(rec, list(self._pieces.get(rec.ident, ()))) for rec in self.pending()]


class WriteChecks(set):
    """The keys whose every chunk written by this process was checked as it was written (a
    set, as `verify_checkpoints` takes it), how many items each kind of check covered, and
    the `PieceLedger` of the copies that take parts of source storages (direct, or read back)."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self.ledger = PieceLedger()
        self.against_source_crc = 0  # direct copies: CRC-32 equals the source items' records
        self.read_back = 0           # read back and compared bitwise with the source rows
        self.after_writing = 0       # not checked while written: compared with the source afterwards
        self._deferred: list[tuple[str, list]] = []
        self.later: list[str] = []   # keys `finalize` left to the comparison after writing

    def count(self, by_source_crc: bool) -> None:
        with self._lock:  # called from the pool's threads
            if by_source_crc:
                self.against_source_crc += 1
            else:
                self.read_back += 1

    def defer(self, key: str, sources: list) -> None:
        """An item whose source parts went to the ledger: decided by `finalize`."""
        with self._lock:
            self._deferred.append((key, sources))

    def finalize(self) -> None:
        """After every item is written: an item whose every source storage the ledger
        checked counts as checked against the records; otherwise (some part of a source was
        copied by another worker) its key leaves the set, so it is compared after writing."""
        for key, sources in self._deferred:
            if all(self.ledger.verified(s) for s in sources):
                self.against_source_crc += 1
            else:
                self.after_writing += 1
                self.discard(key)
                self.later.append(key)
        self._deferred.clear()

    def checked_elsewhere(self) -> None:
        """The keys `finalize` left to the comparison after writing were checked since, against the
        source's records, across workers (`reshard.engine.distributed.check_split_storages`)."""
        self.update(self.later)
        self.against_source_crc += len(self.later)
        self.after_writing -= len(self.later)
        self.later = []

    def summary(self) -> dict[str, int]:
        return {"items_against_source_crc": self.against_source_crc, "items_read_back": self.read_back,
                "items_compared_after_writing": self.after_writing}


def write_items(plan: Plan, ix: CheckpointIndex, w: DcpWriter, progress: Any, *,
                io: IOOptions | None = None, commit: bool = True, checked: set[str] | None = None) -> None:
    """Every item of the plan through the writer, then (``commit``) the `.metadata` commit.

    A source in a store (the reader's ``remote``, handed it by its `reshard.storage.source.Source`)
    has its items fetched by range ahead of their use; a source on this machine has its bytes spliced.

    Re-cut tensors are spliced as bytes on a bounded pool (`reshard.engine.splice`); the rest
    (rewritten, transformed or cast tensors, objects) are written by this thread in
    between. Items are reserved in one fixed order, so the files are the same bytes for
    any pool size, and in a distributed run each worker fills only the files it owns
    (``w.owns``) while reserving every item (`reshard.engine.distributed`).
    """
    io = io or IOOptions()

    def done(tok: Any, result: Any) -> None:  # in submission order, on this thread
        if isinstance(tok, _FinishItems):
            tok.done(w)
        elif isinstance(result, Resumed):  # a journaled item: proven and kept, or rewritten
            if result.kept:
                w.proven(tok, result.crc)
            else:
                w.unproven(tok, result.found)
                w.filled(tok, result.crc)
        else:
            w.filled(tok, result)

    with _read_window(plan, ix, w, io) as shares:  # open until the last job has read its rows
        run_jobs(_items(plan, ix, w, progress, io, checked if checked is not None else set(), shares),
                 threads=io.threads, window=io.window, on_done=done, ahead=io.ahead)
    if isinstance(checked, WriteChecks):
        checked.finalize()
    if commit:
        w.finish()


@contextlib.contextmanager
def _read_window(plan: Plan, ix: CheckpointIndex, w: DcpWriter, io: IOOptions):
    """For a worker streaming from a store (``io.read_window``): its `reshard.engine.shares.Shares`, the
    window open while the block runs; None otherwise."""
    rc = ix.remote if isinstance(ix, CheckpointIndex) else None
    if not (io.splice and rc is not None and io.read_window and io.read_folder is not None):
        yield None
        return
    items, whole = shares_of(ix, {t.key: t for t in plan.tensors}, {a.key: a for a in plan.keys}, w.owns,
                             cap=io.read_window // 2)  # two tensors' whole items in the window at once
    with read_window(rc, items, whole, io.read_folder, io.read_window, streams=max(2, io.threads)) as shares:
        yield shares


def _items(plan: Plan, ix: CheckpointIndex, w: DcpWriter, progress: Any, io: IOOptions, checked: set[str],
           shares: Optional[Shares] = None):
    """Yields splice jobs for the pool; writes everything else itself, in plan order. ``shares``: a
    streaming worker's items and read window (`_read_window`)."""
    planned = {t.key: t for t in plan.tensors}
    actions = {a.key: a for a in plan.keys}
    # bytes are spliced from DCP items only; another source (torch's safetensors shards) is read box by box.
    # A remote source whose read cache can hold it is fetched whole into that cache's files and spliced
    # from them as they arrive (`remote.Mirror`); otherwise its items are fetched by range and decoded.
    rc = ix.remote if isinstance(ix, CheckpointIndex) else None
    needed: list[str] = []
    mirrored = False
    if shares is None and io.splice and rc is not None and rc.kept is not None:  # a read cache to mirror into: which objects
        needed = (_first_needed(ix) if w.owns_all else  # a worker of a divided output: those its files need
                  list(dict.fromkeys(f for f, _o, _n in _remote_reads(ix, planned, actions, w.owns))))
        mirrored = rc.can_mirror(needed)
    with contextlib.ExitStack() as stack:
        if shares is not None:  # a streaming worker: its items' rows through its bounded window
            window = shares.window
            items = {(f, o) for its in shares.items.values() for f, o, _n in its}
            from reshard.storage.objectstore.window import LOCATORS

            locator = splice.Locator(window.root, [ix.entries[k] for k in shares.items], threads=LOCATORS,
                                     hold=lambda entry: locating(shares, entry.key),
                                     only=lambda loc: (loc.file, loc.offset) in items)
        elif mirrored:
            mirror = stack.enter_context(rc.mirroring(needed))
            wanted = frozenset(needed)
            locator = splice.Locator(mirror.root, ix.entries.values(), ready=mirror.ready,
                                     only=None if w.owns_all else (lambda loc: loc.file in wanted))
        elif io.splice and isinstance(ix, CheckpointIndex) and rc is None:
            locator = splice.Locator(ix.root, ix.entries.values())
        else:
            locator = None
        if rc is not None and not mirrored and shares is None:  # items fetched ahead, bounded in requests and bytes
            stack.enter_context(rc.prefetching(_remote_reads(ix, planned, actions, w.owns), in_flight=io.threads,
                                               memory=io.window, label="copy"))
        if locator is not None:
            stack.callback(locator.close)
        if mirrored:  # first on the way out: an item still waiting for its bytes stops waiting
            stack.callback(mirror.stop)
        try:
            yield from _items_in_order(plan, ix, w, progress, locator, checked, io.direct, shares)
        except BaseException:  # the copy failed (or was closed): locating threads waiting for tensors it will
            if shares is not None:  # not reach must end before the locator is closed
                shares.window.stop()
            raise


def _first_needed(ix: CheckpointIndex) -> list[str]:
    """The data files of ``ix`` in the order the copy first reads them (a remote source's mirror order)."""
    order: dict[str, None] = {}
    for e in ix.entries.values():
        for c in (e.chunks if e.is_tensor else ()):
            if c.location is not None:
                order.setdefault(c.location.file)
        if not e.is_tensor and e.location is not None:
            order.setdefault(e.location.file)
    return list(order) + sorted(set(ix.remote.data_files()) - order.keys())


def _remote_reads(ix: CheckpointIndex, planned: dict, actions: dict, owns: Any = None):
    """The byte ranges `_items_in_order` reads from a remote source, in its order: each copied
    object's item, and for each target chunk of a re-cut tensor the source items `read_box`
    reads (the prefetch's order; a range read otherwise is fetched when it is read). ``owns``
    (a worker of a divided output): only for the target ranks whose files it writes."""
    def mine(rank: Any) -> bool:
        return owns is None or bool(owns(int(rank or 0)))

    for key, e in ix.entries.items():
        a = actions[key]
        if a.left_out or a.new_value:  # nothing written, or not the source's bytes under this name
            continue
        if not e.is_tensor:
            if e.location is not None and mine(a.rank):
                yield e.location.file, e.location.offset, e.location.length
            continue
        t = planned[key]
        if not recut(e, t):
            continue  # read by `write_transformed`, its own way
        for item, _taken, _numel in item_reads(e, t, mine):
            yield item


def _items_in_order(plan: Plan, ix: CheckpointIndex, w: DcpWriter, progress: Any, locator: Any, checked: set[str],
                    direct: bool = True, shares: Optional[Shares] = None):
    for e, a, t in kept_items(plan, ix, w, progress):
        if t is not None:
            if not recut(e, t):  # transformed, cast, or copy_from: a slice's renumbered key
                # imported here, not above: tensor arithmetic imports torch (about 2 s of CPU), which a
                # conversion that only splices bytes never needs
                from reshard.semantics.transforms import write_transformed

                write_transformed(ix, w, t, source_key=t.copy_from)
            elif shares is not None and e.key in shares.items:  # its whole items registered first, in this order
                hold = shares.begin(e.key)
                try:
                    yield from _copy_tensor(ix, w, e, t, locator.get(e.key), checked, direct, (shares, hold))
                finally:
                    hold.done()
            else:
                yield from _copy_tensor(ix, w, e, t, locator.get(e.key) if locator is not None else None, checked,
                                        direct)
        elif not w.owns(a.rank or 0):  # another worker's file: the same place reserved, its bytes not read here
            w.reserve_object(a.rank or 0, e.key, e.location.length, path=e.path or None)
        else:
            w.write_object_bytes(a.rank or 0, e.key, checked_object(plan, ix, e), path=e.path or None)
    write_added(plan, ix, w)


def kept_items(plan: Plan, ix: CheckpointIndex, w: DcpWriter, progress: Any):
    """The source keys the plan keeps, in the source's order, as ``(entry, action, tensor plan or
    None for an object)``: each tensor declared in ``w`` and each rewritten value written here first,
    so a caller (a copy, a link) decides only how a kept item's bytes reach the output. ``progress``
    advances by each key's bytes once the caller is done with it (`writing_bytes` is the total)."""
    planned = {t.key: t for t in plan.tensors}
    actions = {a.key: a for a in plan.keys}
    for key, e in ix.entries.items():
        a = actions[key]
        if a.left_out:
            continue
        t = planned[key] if e.is_tensor else None
        if t is not None:
            w.declare_tensor(key, t.shape, dtype_named(t.dtype), path=e.path or None)
        if a.new_value and t is None:
            w.write_object(a.rank or 0, key, plan.new_values[key], path=e.path or None)
        elif a.new_value and not t.copy_from:
            w.write_chunk(t.chunks[0][0], key, t.chunks[0][1], plan.new_values[key])
        else:
            yield e, a, t
        if progress is not None:
            progress.update(e.nbytes)


def checked_object(plan: Plan, ix: CheckpointIndex, e: Any) -> bytes:
    """An object item's bytes as the source holds them, checked first: the CRC-32s of its zip
    (`CorruptItem`, exit 2) and the safe loader (nothing in it outside the allow-list unless trusted)."""
    raw = dcp_io.checked_item_bytes(ix.root, e.location, key=e.key, rc=getattr(ix, "remote", None))
    check_loadable(raw, key=e.key, where=str(ix.root / e.location.file), trust_pickle=plan.options.trust_pickle)
    return raw


def write_added(plan: Plan, ix: CheckpointIndex, w: DcpWriter) -> None:
    """The keys the plan adds, after every source key: a slice's renumbered tensor (renamed to a
    name the source lacks) cut from its source key, any other value written as the plan holds it."""
    planned = {t.key: t for t in plan.tensors}
    for a in plan.keys:
        if not (a.action == Action.ADDED or (a.action == Action.RENAMED and a.renamed_from is not None
                                             and a.key not in ix.entries)):
            continue
        t = planned.get(a.key)
        if t is not None and t.copy_from:
            from reshard.semantics.transforms import write_transformed  # tensor arithmetic: imports torch

            w.declare_tensor(a.key, t.shape, dtype_named(t.dtype))
            write_transformed(ix, w, t, source_key=t.copy_from)
            continue
        v = plan.new_values[a.key]
        if is_tensor_value(v):  # a torch.Tensor, or an ArrayTensor (a reseeded rank's RNG state, made without torch)
            w.declare_tensor(a.key, tuple(v.shape), v.dtype)
            w.write_chunk(a.rank or 0, a.key, tuple(0 for _ in v.shape), v)
        else:
            w.write_object(a.rank or 0, a.key, v)


def _copy_tensor(ix: CheckpointIndex, w: DcpWriter, e, t, sources: list | None, checked: set[str],
                 direct: bool = True, reads: Any = None):
    """A re-cut tensor: each target chunk spliced from the source's bytes (yields pool jobs).

    Falls back to decoding (`CheckpointIndex.read_box`) when a source item is unusual
    (storage transforms, a layout `reshard.storage.checkpoints.fastread` does not parse) or a chunk is too
    large for the plain zip framing. ``reads`` (a streaming worker's `reshard.engine.shares.Shares` and
    the tensor's `TensorHold`): each job's source rows are fetched for it and released after it (no band
    jobs, whose source chunks would each be held for every target item they feed).
    """
    dtype = e.dtype
    targets = [(rank, Box(tuple(offsets), tuple(sizes))) for rank, offsets, sizes in t.chunks]
    if (direct and reads is None and sources is not None and all(archive.fits(b.numel * dtype.itemsize) for _, b in targets)
            and bands.applies(sources, [b for r, b in targets if w.owns(r)], dtype.itemsize)):
        yield from _band_tensor(w, e, targets, sources, checked)
        return
    all_spliced = True
    ledger = checked.ledger if isinstance(checked, WriteChecks) else None
    for rank, offsets, sizes in t.chunks:
        box = Box(tuple(offsets), tuple(sizes))
        if sources is not None and archive.fits(box.numel * dtype.itemsize):
            fr = archive.framing(dtype, box.sizes)
            loc = w.reserve_chunk(rank, e.key, box.offsets, box.sizes, fr.length)
            if w.needs(loc):  # this process's file (a resumed run's journaled item: kept once proven)
                job = splice.SpliceJob(box, dtype.itemsize, fr, sources)
                fd, path = w.fd(rank), str(w.directory / loc.file)
                dfd = w.direct_fd(rank) if direct else None

                def work(buffers, files, slab, job=job, fd=fd, dfd=dfd, loc=loc, path=path, key=e.key,
                         journaled=w.candidate(loc)):
                    found = None
                    if journaled:
                        proof = prove_spliced(job, fd, loc.offset, buffers, files, slab, ledger)
                        if proof.equal:
                            _count_kept(job, checked, key, loc.offset + job.framing.storage_offset, dfd, ledger)
                            return Resumed(True, proof.crc, proof.crc)
                        found = proof.crc
                    crc = job.run(fd, loc.offset, buffers, files, slab, direct_fd=dfd, ledger=ledger)
                    if job.ledgered:
                        checked.defer(key, job.ledger_sources)
                    else:
                        if not job.checked:
                            job.check(path, fd, loc.offset, buffers, files, slab)
                        if isinstance(checked, WriteChecks):
                            checked.count(by_source_crc=job.checked)
                    return crc if found is None else Resumed(False, found, crc)

                if reads is not None:
                    work = held(*reads, source_ranges(sources, box, dtype.itemsize), work)
                yield work, loc
        elif w.owns(rank):
            all_spliced = False
            w.write_chunk(rank, e.key, box.offsets, ix.read_box(e.key, box))
        else:
            w.reserve_chunk(rank, e.key, box.offsets, box.sizes, w.chunk_length(dtype, box.sizes))
    if all_spliced:
        checked.add(e.key)  # every chunk this process wrote was checked against the source as it was written


def _band_tensor(w: DcpWriter, e, targets: list[tuple[int, Box]], sources: list, checked: set[str]):
    """A tensor whose target chunks take column blocks of source rows (`reshard.engine.bands`):
    one job per source chunk; each target item is finished by the last job that feeds it."""
    dtype = e.dtype
    items = []
    for rank, box in targets:  # the same reservations, in the same order, as `_copy_tensor`'s
        fr = archive.framing(dtype, box.sizes)
        loc = w.reserve_chunk(rank, e.key, box.offsets, box.sizes, fr.length)
        if w.needs(loc) and w.candidate(loc) \
                and _prove_here(w, rank, loc, splice.SpliceJob(box, dtype.itemsize, fr, sources), checked):
            continue  # a resumed run's journaled item, proven against the source now: kept
        if w.needs(loc):
            item = bands.BandItem(box, dtype.itemsize, fr, w.fd(rank), w.direct_fd(rank), loc.offset)
            item.write_head()
            items.append((loc, item))
    jobs = []
    for s in sources:
        feeds = [it for _loc, it in items if (x := s.box.intersect(it.box)) is not None and not x.is_empty()]
        if feeds:
            jobs.append(bands.BandJob(s, feeds, dtype.itemsize))
    last = {id(it): j for j, job in enumerate(jobs) for it in job.targets}
    for j, job in enumerate(jobs):
        def work(buffers, files, slab, job=job):
            job.run(buffers, files, slab)
            return 0

        yield work, _FinishItems([(loc, it) for loc, it in items if last.get(id(it)) == j], checked)
    checked.add(e.key)  # every source byte copied was checked against its writer's CRC-32 (a mismatch raises)


@dataclass
class _FinishItems:
    """The token of a band job: the target items it completes (their tails, written once every
    job feeding them is done, in submission order, so fault events stay deterministic)."""

    items: list
    checked: set[str]

    def done(self, w: DcpWriter) -> None:
        for loc, item in self.items:  # its source bytes were checked against their records (a mismatch raised)
            w.filled(loc, item.finish())
            if isinstance(self.checked, WriteChecks):
                self.checked.count(by_source_crc=True)


def _prove_here(w: DcpWriter, rank: int, loc: Any, job: splice.SpliceJob, checked: set[str]) -> bool:
    """A journaled item of a band tensor proven on this thread, before the band jobs are made (an item
    kept needs no job; `reshard.engine.resume.prove_spliced`); True when it is kept."""
    files = FdCache()
    try:
        ledger = checked.ledger if isinstance(checked, WriteChecks) else CrcLedger()
        proof = prove_spliced(job, w.fd(rank), loc.offset, splice.WorkerBuffers(), files,
                              splice.CHECK_WINDOW, ledger)
    finally:
        files.close()
    if not proof.equal:
        w.unproven(loc, proof.crc)
        return False
    w.proven(loc, proof.crc)
    if isinstance(checked, WriteChecks):
        checked.count(by_source_crc=True)  # as `_FinishItems` counts a band item: its source rows went to the ledger
    return True


def _count_kept(job: splice.SpliceJob, checked: set[str], key: str, storage_at: int, direct_fd: int | None,
                ledger: Any) -> None:
    """A proven kept item counted in `WriteChecks` as the copy that would have written it counts it, so
    the report of a resumed run is an uninterrupted run's. It is at least as checked: its bytes
    were compared bitwise with the source rows read in this run, and those bytes were checked
    against the source's records, combined or through the ledger (`reshard.engine.resume.prove_spliced`).

    A direct copy from whole recorded storages counts by the records; one from parts of them is
    deferred to the ledger (`WriteChecks.finalize`); anything else is read back. The decision is
    `reshard.engine.splice.SpliceJob.run`'s, from the same facts: contiguous runs on both sides, a
    direct descriptor, an aligned storage, recorded sources."""
    if not isinstance(checked, WriteChecks):
        return
    meeting = [s for s in job.sources if not job.box.sizes
               or ((x := s.box.intersect(job.box)) is not None and not x.is_empty())]
    direct = (whole_storages(job) and direct_fd is not None and storage_at % ALIGN == 0
              and all(s.crc is not None for s in meeting))
    if direct and job.recorded_crc() is not None:
        checked.count(by_source_crc=True)
    elif direct and ledger is not None:
        checked.defer(key, meeting)
    else:
        checked.count(by_source_crc=False)


@dataclass
class CopyOutput(Output):
    """A DCP checkpoint written new by this process (`write_items`), resumable: a run into ``dst``
    that was killed leaves its journaled items, and this one keeps those still right
    (`reshard.storage.files.journal`) unless the resume key differs or ``restart``."""

    io: IOOptions = field(default_factory=IOOptions)
    restart: bool = False
    _journal: Optional[Journal] = field(default=None, init=False, repr=False)
    _writer: Optional[DcpWriter] = field(default=None, init=False, repr=False)
    _checked: WriteChecks = field(default_factory=WriteChecks, init=False, repr=False)
    _syncer: Optional[Syncer] = field(default=None, init=False, repr=False)

    def staging(self, run: Run) -> ContextManager[Path]:
        from reshard.engine.resume import resume_key
        from reshard.storage.files.atomic import atomic_directory
        from reshard.storage.files.journal import Journal
        from reshard.storage.files.replaceable import why_not_replaceable

        self._journal = Journal(resume_key(run.plan, run.source), restart=self.restart)

        @contextlib.contextmanager
        def journaled():
            with atomic_directory(self.dst, overwrite=self.overwrite, replaceable=why_not_replaceable,
                                  reuse=self._journal.choose) as tmp:
                self._journal.begin(tmp)
                yield tmp

        return journaled()

    def write(self, run: Run) -> None:
        from reshard.render.progress import phase_of

        watcher = self.watch(run) if self.watch is not None else None
        self._writer = w = DcpWriter(run.tmp, journal=self._journal, observer=watcher)
        if watcher is not None:
            watcher.checksum_of = w.checksum_of  # read when an item's last byte is sent, after the writer filled it
        try:
            with phase_of(run.progress, self.phase, writing_bytes(run.plan, run.ix)) as bar:
                write_items(run.plan, run.ix, w, bar, io=self.io, commit=False,
                            checked=self._checked)
            w.finish(sync_data=False)
        finally:
            w.close()  # idempotent; after an error it drops buffered bytes (no flush at GC time)
        # The disk writes the data back while the output is verified (both in the page cache);
        # the commit waits for it (`verify`) and then fsyncs the whole directory anyway.
        self._syncer = Syncer(sorted(run.tmp.glob("*.distcp")))

    def manifest(self, run: Run, manifest: Manifest) -> None:
        from reshard.storage.checkpoints.dcp_writer import CHECKSUM_ALGORITHM
        from reshard.storage.files.integrity import record

        manifest.integrity = record(self._writer.checksums(), algorithm=CHECKSUM_ALGORITHM)

    def verify(self, run: Run) -> dict[str, Any]:
        from reshard.engine.outcome import verify_output

        try:
            return verify_output(run.source, run.tmp, run.plan, checked=self._checked, progress=run.progress,
                                 write_checks=self._checked.summary())
        finally:
            self._syncer.join()

    def checksums(self, run: Run) -> dict[str, str]:
        return self._writer.checksums()

    def resume(self, run: Run) -> dict[str, Any]:
        return self._journal.summary()


class Syncer:
    """fsync files in a background thread; `join` waits and re-raises its error."""

    def __init__(self, paths: list[Path]):
        self.error: BaseException | None = None
        self._t = threading.Thread(target=self._run, args=(paths,), name="reshard-fsync", daemon=True)
        self._t.start()

    def _run(self, paths: list[Path]) -> None:
        from reshard.storage.files.atomic import fsync_file

        try:
            for p in paths:
                fsync_file(p)
        except BaseException as exc:  # noqa: BLE001 - handed to the joining thread
            self.error = exc

    def join(self) -> None:
        self._t.join()
        if self.error is not None:
            raise self.error
