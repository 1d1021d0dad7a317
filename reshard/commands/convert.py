"""`reshard convert`: execute a plan, stream by stream, into a checkpoint that appears atomically.

Per tensor, each target chunk is assembled from the source chunks that intersect it (a
source chunk whose box is exactly the target's is copied byte for byte), so memory is
bounded by the largest chunk involved, not by the checkpoint. Objects are validated with
the safe loader and copied verbatim. The output is written into a temporary directory
beside the destination, verified against the source in global terms, and only then
renamed into place; an interrupted run leaves nothing that looks like a checkpoint.

Faults
------
* **Killed** (SIGKILL, OOM, power): ``dst`` is untouched (absent, or the previous output
  with ``--overwrite``); at most a hidden temporary directory and the lock file remain
  beside it, with the journal of the items written (`reshard.storage.journal`). The next
  run into ``dst`` with the same plan, source and options continues in that directory: it
  keeps every journaled item whose bytes still have their CRC-32 and writes the rest
  (``--restart``, or any change of the resume key: it deletes the directory and starts
  over, saying why). Running the same command again gives the same bytes either way.
* **Out of space** (ENOSPC, EFBIG, EDQUOT): `BadInput` (exit 2) naming the destination
  and the estimated bytes needed (`reshard.storage.integrity.estimate_output_bytes`); nothing is
  committed and the temporary directory is removed. `reshard.storage.integrity.space_check`
  warns before a run.
* **Integrity**: the manifest records the CRC-32 of every item written
  (``manifest["integrity"]``); `inspect --deep` and `verify` check it.
* **Reproducible outputs**: with ``SOURCE_DATE_EPOCH`` set, every time written is that
  time and the reports record ``"seconds": null``, so two runs of the same command give
  byte-identical directories (``.metadata``, data files, ``manifest.json`` and both
  reports; the returned report still carries the measured seconds). The verification
  result in the report names ``dst``, not the temporary directory.

Test hook: fault injection
--------------------------
Write events of a DCP conversion, numbered 1, 2, ... in order: every item the
`DcpWriter` writes (``item FILE:OFFSET``), the ``.metadata`` commit (``metadata``),
``manifest.json`` (``manifest``), ``reshard-report.json`` (``report.json``),
``reshard-report.md`` (``report.md``) and the rename into place (``rename``, the last).
`reshard.storage.atomic.fault_point` counts them; environment variables act on them:

* ``RESHARD_FAULT_COUNT=PATH``: append ``"N LABEL"`` per event (an uninterrupted run's
  last line is the total);
* ``RESHARD_FAULT_KILL_AT=N``: SIGKILL the process right after event N;
* ``RESHARD_FAULT_SLEEP_AT=N:SECONDS``: sleep right after event N (to hold the lock).

``tests/test_faults.py`` and ``scripts/soak_faults.py`` use them; they do nothing unset.
"""
from __future__ import annotations

import json
import threading
import time as _time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from reshard.errors import BadInput, Infeasible
from reshard.units import now_text, reproducible
from reshard.model.geometry import Box
from reshard.storage.index import CheckpointIndex
from reshard.engine.space import conversion_preflight
from reshard.storage.integrity import is_space_error, out_of_space
from reshard.storage.integrity import record as integrity_record
from reshard.storage import archive, fastread, sidecars
from reshard.engine import bands, splice
from reshard.storage import dcp as dcp_io
from reshard.semantics.transforms import write_transformed
from reshard.storage.atomic import atomic_directory, check_destination, fault_point
from reshard.storage.crcledger import StorageRecord
from reshard.storage.dcp_writer import CHECKSUM_ALGORITHM, DcpWriter
from reshard.storage.journal import Journal, ResumeKey, source_identity
from reshard.engine.splice import run_jobs
from reshard.semantics.manifest import write_manifest
from reshard.planning import linking
from reshard.model.plan import Plan
from reshard.semantics.transition import output_manifest
from reshard.render.conversion import conversion_markdown
from reshard.render.progress import describe_bytes, end_commit, phase_of, start_commit

REPORT_JSON = "reshard-report.json"
REPORT_MD = "reshard-report.md"


@dataclass(frozen=True)
class IOOptions:
    """How a conversion reads and writes: pool size, memory window, and whether to splice bytes."""

    threads: int = field(default_factory=splice.default_threads)
    window: int = field(default_factory=splice.default_window)
    splice: bool = True
    direct: bool = True  # spliced bytes bypass the page cache (O_DIRECT) where the file systems allow


def prepare_conversion(plan: Plan, src: Path, dst: Path) -> tuple[Path, Path, CheckpointIndex]:
    """Refuse infeasible plans and destinations that overlap the source; open the source."""
    if not plan.feasible:
        raise Infeasible("the plan is infeasible: " + "; ".join(plan.reasons), where=str(src),
                         hint="Run `reshard plan` to see the choices.")
    src, dst = Path(src), Path(dst)
    check_destination(src, dst)
    return src, dst, CheckpointIndex.open(src, trust_pickle=plan.options.trust_pickle)


def convert(plan: Plan, src: Path, dst: Path, *, overwrite: bool = False, progress: Any = None,
            output_format: str = "dcp", io: IOOptions | None = None, data: str = "copy",
            force: bool = False, restart: bool = False) -> dict[str, Any]:
    """Write the plan's checkpoint to ``dst``; returns the conversion report.

    A DCP copy is resumable (`reshard.storage.journal`): a run into ``dst`` that was killed
    leaves its journaled items, and this run keeps the ones still right (``report["resume"]``)
    unless the resume key differs or ``restart``.

    ``data``: ``"copy"`` writes every tensor byte new; ``"link"`` shares the source's data
    files with the output (`convert_link`) and writes only what changes.
    ``progress``: a `reshard.render.progress.Progress` (or None): the phases "writing" and
    "verifying", by bytes.
    ``force``: go ahead when the destination lacks the space (`reshard.engine.space.preflight`
    refuses before anything is written otherwise; its figures are the report's ``estimate``).
    """
    check_data_mode(data, output_format=output_format)
    src, dst, ix = prepare_conversion(plan, src, dst)
    say_converting(progress, plan, ix)
    if data == "link":
        return convert_link(plan, src, dst, ix, overwrite=overwrite, progress=progress)
    estimate = conversion_preflight(plan, ix, dst, force=force, progress=progress)
    needed = estimate["needed_bytes"]
    try:
        if output_format == "local":
            return _convert_local(plan, src, dst, ix, overwrite=overwrite, progress=progress, estimate=estimate)
        return _convert_dcp(plan, src, dst, ix, overwrite=overwrite, progress=progress, io=io or IOOptions(),
                            estimate=estimate, restart=restart)
    except OSError as exc:
        if is_space_error(exc):
            raise out_of_space(dst, needed, exc) from None
        raise


def writing_bytes(plan: Plan, ix: CheckpointIndex) -> int:
    """What the "writing" phase counts to: the logical bytes of the source keys the plan keeps."""
    actions = {a.key: a.action for a in plan.keys}
    return sum(e.nbytes for key, e in ix.entries.items() if actions.get(key) != "dropped")


def say_converting(progress: Any, plan: Plan, ix: CheckpointIndex) -> None:
    """The first line once the source is read: how much is converted, into what."""
    if progress is not None:
        kept = {a.key for a in plan.keys if a.action != "dropped"}
        n = sum(1 for key, e in ix.entries.items() if e.is_tensor and key in kept)
        progress.say(f"converting {describe_bytes(writing_bytes(plan, ix), n, 'tensor')} to {plan.options.to} …")


def check_data_mode(data: str, *, output_format: str = "dcp", workers: int | None = None,
                    distributed: bool = False) -> None:
    """``--data copy|link`` and the options it cannot go with, refused before any work."""
    if data not in linking.DATA_MODES:
        raise BadInput(f"unknown --data '{data}'", hint="Use copy (write every byte new, the default) or link "
                                                        "(share the source's tensor files by reflink or hard link).")
    if data != "link":
        return
    if output_format != "dcp":
        raise BadInput(f"--data link writes a DCP checkpoint whose items are the source's; --output-format "
                       f"{output_format} is another format, whose files hold new bytes",
                       hint="Use --data copy with --output-format local.")
    if distributed or (workers is not None and workers != 1):
        raise BadInput("--data link runs in one process: it writes only metadata and the keys that change, so "
                       "there is nothing to divide among workers",
                       hint="Drop --workers (or run it without torchrun), or use --data copy to divide a copy.")


def refuse_if_different(verification: dict[str, Any], dst: Path, what: str) -> None:
    if not verification["equal"]:
        raise Infeasible(f"{what} does not match the source: "
                         + "; ".join(f"{d['key']}: {d['detail']}" for d in verification["differences"][:5]),
                         where=str(dst), hint="Nothing was committed. This is a bug in reshard; please report it.")


def resume_key(plan: Plan, src: Path, output_format: str = "dcp") -> ResumeKey:
    """What a rerun must share with an interrupted conversion to keep its bytes (`reshard.storage.journal`):
    the plan, the source files as they are on disk, and what else decides the bytes written."""
    from reshard import __version__

    return ResumeKey(plan=plan.fingerprint(), source=source_identity(src),
                     options={"output_format": output_format, "reshard": __version__, "torch": torch.__version__})


def _convert_dcp(plan: Plan, src: Path, dst: Path, ix: CheckpointIndex, *, overwrite: bool, progress: Any,
                 io: IOOptions, estimate: dict[str, Any] | None = None, restart: bool = False) -> dict[str, Any]:
    started = _time.time()
    stamp = now_text()
    journal = Journal(resume_key(plan, src), restart=restart)
    with atomic_directory(dst, overwrite=overwrite, reuse=journal.choose) as tmp:
        journal.begin(tmp)
        for key, equal_to in plan.checks.items():
            from reshard.storage.index import bitwise_equal

            if not bitwise_equal(ix, key, equal_to):
                raise Infeasible(f"tied copies '{key}' and '{equal_to}' differ: the target would keep one of them silently",
                                 where=str(src), hint="Inspect the source: tied weights and their optimizer state must be equal.")
        w = DcpWriter(tmp, journal=journal)
        try:
            checked = WriteChecks()
            with phase_of(progress, "writing", writing_bytes(plan, ix)) as bar:
                write_items(plan, ix, w, bar, io=io, commit=False, checked=checked)
            keep_checked_honest(checked, w)
            w.finish(sync_data=False)
        finally:
            w.close()  # idempotent; after an error it drops buffered bytes (no flush at GC time)
        carried = carry_sidecars(plan, ix, src, tmp)
        # The disk writes the data back while the output is verified (both in the page
        # cache); the commit waits for it and then fsyncs the whole directory anyway.
        syncer = _Syncer(sorted(tmp.glob("*.distcp")))
        try:
            src_manifest = source_manifest(src)
            manifest = output_manifest(plan, src_manifest, time=stamp)
            manifest.integrity = integrity_record(w.checksums(), algorithm=CHECKSUM_ALGORITHM)
            write_manifest(tmp, manifest)
            fault_point("manifest")
            verification = verify_output(src, tmp, plan, checked=checked, progress=progress)
        finally:
            syncer.join()
        verification["b"] = str(dst)  # what was verified is what appears at dst
        report = build_report(plan, src, dst, tmp, verification, manifest.to_dict(), w.checksums(), _time.time() - started)
        report["sidecars"] = carried
        report["estimate"] = estimate
        report["resume"] = journal.summary()
        write_reports(tmp, report)
        refuse_if_different(verification, dst, "the converted checkpoint")
        commit = start_commit(progress, tmp)  # the fsync and rename as the block exits
    end_commit(progress, commit)
    return report


class _PieceRecorder:
    """A copy job's view of the run's ledger that also keeps the pieces the job hands it, so the
    journal can record them and a resumed run that keeps the item hands them over again."""

    def __init__(self, ledger: Any) -> None:
        self.ledger = ledger
        self.pieces: list[list[Any]] = []

    def add(self, rec: StorageRecord, offset: int, nbytes: int, crc: int) -> bool:
        self.pieces.append([rec.path, rec.key, rec.at, rec.nbytes, rec.crc, offset, nbytes, crc])
        return self.ledger.add(rec, offset, nbytes, crc)


def replay_check(w: DcpWriter, loc: Any, key: str, checked: set[str]) -> None:
    """An item a resumed run kept, counted as the interrupted run checked it when it wrote it
    (`DcpWriter.kept_check`): the same counts, the same source pieces into the ledger, so the
    verification and the report are an uninterrupted run's."""
    c = w.kept_check(loc)
    if c is None or not isinstance(checked, WriteChecks):
        return
    for path, k, at, nbytes, crc, offset, n, piece in c.get("p") or ():
        checked.ledger.add(StorageRecord(path, k, int(at), int(nbytes), crc), int(offset), int(n), int(piece))
    if c.get("k") == "ledger":
        checked.defer(key, [tuple(s) for s in c.get("s") or ()])
    elif c.get("k") in ("crc", "read"):
        checked.count(by_source_crc=c["k"] == "crc")


def keep_checked_honest(checked: set[str], w: DcpWriter) -> None:
    """A key with an item a resumed run kept without its having been checked against the source
    (the interrupted run was killed before verifying it) leaves the set: it is compared after writing."""
    for key in w.kept_unchecked():
        if key in checked:
            checked.discard(key)
            if isinstance(checked, WriteChecks):
                checked.after_writing += 1


def carry_sidecars(plan: Plan, ix: CheckpointIndex, src: Path, tmp: Path) -> list[dict[str, Any]]:
    """Every sidecar the plan listed, copied byte-identical into the output before it is committed.

    A trainer's own files beside the DCP part (Lightning's `meta.pt`, ...) are data: dropping
    them would leave an output the trainer cannot load (`reshard.storage.sidecars`).
    """
    return sidecars.carry_sidecars(src, tmp, sidecars.claimed_names(ix), plan.source.get("sidecars"))


class PieceLedger(splice.SourceLedger):
    """The copy's `reshard.storage.crcledger.CrcLedger` that also keeps the pieces of every storage
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
        self._deferred.clear()

    def summary(self) -> dict[str, int]:
        return {"items_against_source_crc": self.against_source_crc, "items_read_back": self.read_back,
                "items_compared_after_writing": self.after_writing}


class _Syncer:
    """fsync files in a background thread; `join` waits and re-raises its error."""

    def __init__(self, paths: list[Path]):
        self.error: BaseException | None = None
        self._t = threading.Thread(target=self._run, args=(paths,), name="reshard-fsync", daemon=True)
        self._t.start()

    def _run(self, paths: list[Path]) -> None:
        from reshard.storage.atomic import fsync_file

        try:
            for p in paths:
                fsync_file(p)
        except BaseException as exc:  # noqa: BLE001 - handed to the joining thread
            self.error = exc

    def join(self) -> None:
        self._t.join()
        if self.error is not None:
            raise self.error


def write_reports(tmp: Path, report: dict[str, Any]) -> None:
    """Both reports, each a write event; under SOURCE_DATE_EPOCH with no wall time in them."""
    # no measured figure under SOURCE_DATE_EPOCH: neither the wall time nor the estimate (free space, probes)
    on_disk = {**{k: v for k, v in report.items() if k != "estimate"}, "seconds": None} if reproducible() else report
    if reproducible() and "resume" in report:
        on_disk = {**on_disk, "resume": None}  # a resumed run writes the reports an uninterrupted one does
    (tmp / REPORT_JSON).write_text(json.dumps(on_disk, indent=2, default=str) + "\n")
    fault_point("report.json")
    (tmp / REPORT_MD).write_text(conversion_markdown(on_disk))
    fault_point("report.md")


def write_items(plan: Plan, ix: CheckpointIndex, w: DcpWriter, progress: Any, *, io: IOOptions | None = None,
                 commit: bool = True, checked: set[str] | None = None) -> None:
    """Every item of the plan through the writer, then (``commit``) the `.metadata` commit.

    Re-cut tensors are spliced as bytes on a bounded pool (`reshard.engine.splice`); the rest
    (rewritten, transformed or cast tensors, objects) are written by this thread in
    between. Items are reserved in one fixed order, so the files are the same bytes for
    any pool size, and in a distributed run each worker fills only the files it owns
    (``w.owns``) while reserving every item (`reshard.engine.distributed`).
    """
    io = io or IOOptions()
    run_jobs(_items(plan, ix, w, progress, io, checked if checked is not None else set()),
             threads=io.threads, window=io.window,
             on_done=lambda tok, crc: tok.done(w) if isinstance(tok, _FinishItems) else w.filled(tok, crc))
    if isinstance(checked, WriteChecks):
        checked.finalize()
    if commit:
        w.finish()


def _items(plan: Plan, ix: CheckpointIndex, w: DcpWriter, progress: Any, io: IOOptions, checked: set[str]):
    """Yields splice jobs for the pool; writes everything else itself, in plan order."""
    planned = {t.key: t for t in plan.tensors}
    actions = {a.key: a for a in plan.keys}
    locator = splice.Locator(ix.root, ix.entries.values()) if io.splice else None
    try:
        yield from _items_in_order(plan, ix, w, progress, planned, actions, locator, checked, io.direct)
    finally:
        if locator is not None:
            locator.close()


def _items_in_order(plan: Plan, ix: CheckpointIndex, w: DcpWriter, progress: Any, planned: dict, actions: dict,
                    locator: Any, checked: set[str], direct: bool = True):
    for key, e in ix.entries.items():
        a = actions[key]
        if a.action == "dropped":
            continue
        if e.is_tensor:
            t = planned[key]
            w.declare_tensor(key, t.shape, getattr(torch, t.dtype), path=e.path or None)
            if a.action == "rewritten" and not t.copy_from:
                w.write_chunk(t.chunks[0][0], key, t.chunks[0][1], plan.new_values[key])
            elif t.transform or t.copy_from or t.dtype != e.dtype_name:  # copy_from: a slice's renumbered key
                write_transformed(ix, w, t, source_key=t.copy_from)
            else:
                yield from _copy_tensor(ix, w, e, t, locator.get(key) if locator is not None else None, checked,
                                        direct)
        else:
            rank = a.rank or 0
            if a.action == "rewritten":
                w.write_object(rank, key, plan.new_values[key], path=e.path or None)
            else:
                raw = dcp_io.read_item_bytes(ix.root, e.location, key=key)
                raw = dcp_io.untransform(raw, e.location.transforms, key=key, where=str(ix.root / e.location.file))
                fastread.check_item_crcs(raw, key=key, where=str(ix.root / e.location.file))  # CorruptItem, exit 2
                dcp_io.torch_load_item(raw, key=key, where=str(ix.root / e.location.file), trust_pickle=plan.options.trust_pickle)
                w.write_object_bytes(rank, key, raw, path=e.path or None)
        if progress is not None:  # by bytes (`writing_bytes` is the total)
            progress.update(e.nbytes)
    for a in plan.keys:
        if a.action != "added":
            continue
        t = planned.get(a.key)
        if t is not None and t.copy_from:
            w.declare_tensor(a.key, t.shape, getattr(torch, t.dtype))
            write_transformed(ix, w, t, source_key=t.copy_from)
            continue
        v = plan.new_values[a.key]
        if isinstance(v, torch.Tensor):
            w.declare_tensor(a.key, tuple(v.shape), v.dtype)
            w.write_chunk(a.rank or 0, a.key, tuple(0 for _ in v.shape), v)
        else:
            w.write_object(a.rank or 0, a.key, v)


def _copy_tensor(ix: CheckpointIndex, w: DcpWriter, e, t, sources: list | None, checked: set[str],
                 direct: bool = True):
    """A re-cut tensor: each target chunk spliced from the source's bytes (yields pool jobs).

    Falls back to decoding (`CheckpointIndex.read_box`) when a source item is unusual
    (storage transforms, a layout `reshard.storage.fastread` does not parse) or a chunk is too
    large for the plain zip framing.
    """
    dtype = e.dtype
    targets = [(rank, Box(tuple(offsets), tuple(sizes))) for rank, offsets, sizes in t.chunks]
    if (direct and sources is not None and all(archive.fits(b.numel * dtype.itemsize) for _, b in targets)
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
            if w.needs(loc):  # this process's file, and not kept by a resumed run
                job = splice.SpliceJob(box, dtype.itemsize, fr, sources)
                fd, path = w.fd(rank), str(w.directory / loc.file)
                dfd = w.direct_fd(rank) if direct else None

                def work(buffers, files, slab, job=job, fd=fd, dfd=dfd, loc=loc, path=path, key=e.key):
                    seen = _PieceRecorder(ledger) if ledger is not None else None
                    crc = job.run(fd, loc.offset, buffers, files, slab, direct_fd=dfd, ledger=seen)
                    if job.ledgered:
                        checked.defer(key, job.ledger_sources)
                        w.vouch(loc, {"k": "ledger", "p": seen.pieces, "s": [list(s.ident) for s in job.ledger_sources]})
                        return crc
                    if not job.checked:
                        job.check(path, fd, loc.offset, buffers, files, slab)
                    if isinstance(checked, WriteChecks):
                        checked.count(by_source_crc=job.checked)
                    # how it was checked, for a resumed run that keeps it (`replay_check`)
                    w.vouch(loc, {"k": "crc" if job.checked else "read", "p": seen.pieces if seen else []})
                    return crc

                yield work, loc
            elif w.owns(rank):
                replay_check(w, loc, e.key, checked)
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
        if w.needs(loc):
            item = bands.BandItem(box, dtype.itemsize, fr, w.fd(rank), w.direct_fd(rank), loc.offset)
            item.write_head()
            items.append((loc, item))
        elif w.owns(rank):
            replay_check(w, loc, e.key, checked)
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
        for loc, item in self.items:
            w.vouch(loc, {"k": "crc", "p": []})  # its source bytes were checked against their records (a mismatch raised)
            w.filled(loc, item.finish())
            if isinstance(self.checked, WriteChecks):
                self.checked.count(by_source_crc=True)


def source_manifest(src: Path) -> dict[str, Any] | None:
    from reshard.semantics.manifest import read_manifest

    m = read_manifest(src)
    return m.to_dict() if m is not None else None


def verify_output(src: Path, out: Path, plan: Plan, b_files: set[str] | None = None,
            checked: set[str] | None = None, progress: Any = None) -> dict[str, Any]:
    """The post-write verification: the output against the source, in global terms.

    ``checked``: keys whose every written chunk was already checked against the source while
    the copy ran (`reshard.engine.splice`: CRC-32 against the source items' records, or read
    back and compared bitwise); their values are not compared a second time (keys, shapes,
    dtypes, objects and semantics still are).
    """
    from reshard.verification.checkpoints import check_transforms, verify_checkpoints

    expected = {a.key: f"{a.action}: {a.reason}" for a in plan.keys if a.action in ("rewritten", "dropped", "added")}
    src_dtypes = {k: e.dtype_name for k, e in CheckpointIndex.open(src).entries.items() if e.is_tensor}
    for t in plan.tensors:
        if t.transform:
            expected[t.key] = "TP-dependent layout rewritten (checked in canonical form)"
        elif src_dtypes.get(t.key) not in (None, t.dtype):
            expected[t.key] = f"cast to {t.dtype} for a reduced copy (checked equal to the source cast)"
    extra = {"b_files": b_files} if b_files is not None else {}
    # The output's item checksums were composed while writing (tests check them against a
    # full recomputation); here its bytes are compared with the source, and the source's own
    # checksums (if it records any) are checked.
    result = verify_checkpoints(src, out, expected_rewrites=expected, trust_pickle=plan.options.trust_pickle,
                                check_integrity="a", values_checked=checked, progress=progress, **extra)
    result["checked_while_writing"] = len(checked or ())
    if isinstance(checked, WriteChecks):
        result["write_checks"] = checked.summary()
    bad = check_transforms(src, out, plan, b_files=b_files)
    result["transforms_checked"] = sum(1 for t in plan.tensors if t.transform or t.copy_from)
    for k in bad:
        result["differences"].append({"key": k, "kind": "value", "detail": "canonical form differs from the source"})
        result["equal"] = False
    return result


def build_report(plan: Plan, src: Path, dst: Path, tmp: Path, verification: dict[str, Any], manifest: dict[str, Any],
            checksums: dict[str, str], seconds: float) -> dict[str, Any]:
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.name.endswith(".distcp")}
    return {
        "report_version": 1,
        "source": str(src.resolve()),
        "destination": str(dst.resolve()),
        "plan": plan.to_dict(tensors=False),
        "verification": verification,
        "manifest": {"experiment_id": manifest["experiment_id"], "continuity": manifest["continuity"],
                     "lineage_entry": manifest["lineage"][-1]},
        "files": files,
        "bytes_written": sum(files.values()),
        "item_checksums": len(checksums),
        "seconds": round(seconds, 3),
    }


def convert_local(plan: Plan, src: Path, dst: Path, *, overwrite: bool = False, progress: Any = None) -> dict[str, Any]:
    """`--output-format local`: one safetensors file per target rank with exactly its local tensors."""
    return convert(plan, src, dst, overwrite=overwrite, progress=progress, output_format="local")


def _convert_local(plan: Plan, src: Path, dst: Path, ix: CheckpointIndex, *, overwrite: bool, progress: Any,
                   estimate: dict[str, Any] | None = None) -> dict[str, Any]:
    from reshard.engine.local_output import write_local

    started = _time.time()
    with atomic_directory(dst, overwrite=overwrite) as tmp:
        with phase_of(progress, "writing", writing_bytes(plan, ix)) as bar:
            info = write_local(plan, ix, tmp, progress=bar, total_bytes=writing_bytes(plan, ix))
        carried = carry_sidecars(plan, ix, src, tmp)
        manifest = output_manifest(plan, source_manifest(src), time=now_text())
        write_manifest(tmp, manifest)
        fault_point("manifest")
        verification = verify_output(src, tmp, plan, progress=progress)
        verification["b"] = str(dst)
        report = build_report(plan, src, dst, tmp, verification, manifest.to_dict(), {}, _time.time() - started)
        report["output_format"] = "local"
        report["files"] = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.suffix == ".safetensors"}
        report["bytes_written"] = sum(report["files"].values())
        report["local"] = info
        report["sidecars"] = carried
        report["estimate"] = estimate
        write_reports(tmp, report)
        refuse_if_different(verification, dst, "the local output")
        commit = start_commit(progress, tmp)
    end_commit(progress, commit)
    return report


# ---------------------------------------------------------------------------- --data link
def convert_link(plan: Plan, src: Path, dst: Path, ix: CheckpointIndex, *, overwrite: bool = False,
                 progress: Any = None) -> dict[str, Any]:
    """``--data link``: the output's tensor items stay in the source's data files, shared into
    the output by reflink or hard link (`reshard.storage.linkfs`); ``.metadata``, the keys the
    plan rewrites or adds, the manifest and the reports are written new (`reshard.planning.linking`).

    Refused (`BadInput`, nothing written) when a tensor needs new bytes, or when the files
    cannot be shared with the destination (another file system, ...), each with its reason and
    ``--data copy`` as the way out. The output is built in the atomic temporary directory and
    verified against the source as a copy is (keys, shapes, dtypes, objects, rewritten state,
    semantics, the source's recorded checksums); the linked tensors' values are not read again:
    their items are the source's bytes at the source's offsets (one inode, or a clone the file
    system made), which the report and the lineage record.
    """
    started = _time.time()
    stamp = now_text()
    layout = linking.link_layout(plan, ix)
    if not layout.available:
        raise BadInput("--data link cannot be used for this conversion: " + "; ".join(layout.reasons),
                       where=str(src), hint="Use --data copy (the default), which writes every byte new.")
    with atomic_directory(dst, overwrite=overwrite) as tmp:
        for key, equal_to in plan.checks.items():
            from reshard.storage.index import bitwise_equal

            if not bitwise_equal(ix, key, equal_to):
                raise Infeasible(f"tied copies '{key}' and '{equal_to}' differ: the target would keep one of them silently",
                                 where=str(src), hint="Inspect the source: tied weights and their optimizer state must be equal.")
        shared = _share_files(src, dst, tmp, layout.files)
        names = {s.source.name: s.path.name for s in shared}
        w = DcpWriter(tmp, file_name=linking.new_file_namer(set(names.values())))
        try:
            with phase_of(progress, "linking", writing_bytes(plan, ix)) as bar:
                _link_items(plan, ix, w, names, bar)
            w.finish()
        finally:
            w.close()
        carried = carry_sidecars(plan, ix, src, tmp)
        src_manifest = source_manifest(src)
        manifest = output_manifest(plan, src_manifest, time=stamp)
        checksums, carried_records = _linked_checksums(w, src_manifest, names)
        manifest.integrity = integrity_record(checksums, algorithm=CHECKSUM_ALGORITHM) if checksums is not None else None
        data = _data_record(shared, names, layout, carried_records, w)
        manifest.lineage[-1].policies["data_files"] = {k: data[k] for k in ("mode", "method", "shared", "note")}
        write_manifest(tmp, manifest)
        fault_point("manifest")
        verification = verify_output(src, tmp, plan, checked=set(layout.linked_tensors), progress=progress)
        verification["linked_tensors_by_identity"] = len(layout.linked_tensors)
        verification["b"] = str(dst)
        report = build_report(plan, src, dst, tmp, verification, manifest.to_dict(), w.checksums(), _time.time() - started)
        report["files"] = {n: sz for n, sz in report["files"].items() if n not in set(names.values())}
        report["bytes_written"] = sum(report["files"].values())
        report["data"] = data
        report["sidecars"] = carried
        write_reports(tmp, report)
        refuse_if_different(verification, dst, "the linked checkpoint")
    return report


def _share_files(src: Path, dst: Path, tmp: Path, files: list[str]) -> list:
    from reshard.storage.linkfs import LinkRefused, share_file

    out = []
    for name in files:
        try:
            out.append(share_file(src / name, tmp / linking.linked_name(name), root=src))
        except LinkRefused as exc:
            where = "the destination's file system" if exc.cross_device else "this file system"
            raise BadInput(f"--data link cannot share the source's data file '{name}' with the destination "
                           f"({'; '.join(f'{m}: {r}' for m, r in exc.reasons.items())})", where=str(dst),
                           hint=f"Nothing was written. Sharing needs reflinks or hard links on {where}: put DST on "
                                "the source's file system (the same mount), or use --data copy.") from None
    return out


def _link_items(plan: Plan, ix: CheckpointIndex, w: DcpWriter, names: dict[str, str], progress: Any) -> None:
    """Every key of the plan through the writer, in the source's order: linked items declared
    where they lie (their file renamed as shared), rewritten and added keys written new."""
    from dataclasses import replace

    planned = {t.key: t for t in plan.tensors}
    actions = {a.key: a for a in plan.keys}
    for key, e in ix.entries.items():
        a = actions[key]
        if a.action == "dropped":
            continue
        if e.is_tensor:
            t = planned[key]
            w.declare_tensor(key, t.shape, getattr(torch, t.dtype), path=e.path or None)
            if a.action == "rewritten":
                w.write_chunk(t.chunks[0][0], key, t.chunks[0][1], plan.new_values[key])
            else:
                for c in e.chunks:
                    w.link_chunk(key, c.box.offsets, c.box.sizes, replace(c.location, file=names[c.location.file]))
        elif a.action == "rewritten":
            w.write_object(a.rank or 0, key, plan.new_values[key], path=e.path or None)
        else:  # checked as a copy checks it (CRC-32s of its zip, the safe loader), then shared as it is
            where = str(ix.root / e.location.file)
            raw = dcp_io.read_item_bytes(ix.root, e.location, key=key)
            raw = dcp_io.untransform(raw, e.location.transforms, key=key, where=where)
            fastread.check_item_crcs(raw, key=key, where=where)
            dcp_io.torch_load_item(raw, key=key, where=where, trust_pickle=plan.options.trust_pickle)
            w.link_object(key, replace(e.location, file=names[e.location.file]), path=e.path or None)
        if progress is not None:  # by bytes (`writing_bytes` is the total)
            progress.update(e.nbytes)
    for a in plan.keys:
        if a.action != "added":
            continue
        v = plan.new_values[a.key]
        if isinstance(v, torch.Tensor):
            w.declare_tensor(a.key, tuple(v.shape), v.dtype)
            w.write_chunk(a.rank or 0, a.key, tuple(0 for _ in v.shape), v)
        else:
            w.write_object(a.rank or 0, a.key, v)


def _linked_checksums(w: DcpWriter, src_manifest: dict[str, Any] | None,
                      names: dict[str, str]) -> tuple[dict[str, str] | None, int | None]:
    """The output's item checksums, or None when some shared item has none.

    The writer's own items have theirs; a shared item's is the source manifest's record (the
    same bytes at the same offset, its file renamed) when the source records CRC-32s. When
    the source records none for a shared item, the output records none at all (as a
    checkpoint from `dcp.save` records none): a record covering only some items would read as
    ``.metadata`` changed after the manifest, and hashing the shared items would read every
    byte the link saved. Each item's own zip CRC-32s still cover its bytes (`inspect --deep`).
    Returns (checksums or None, how many were taken from the source, or None).
    """
    from reshard.storage.integrity import item_name

    rec = (src_manifest or {}).get("integrity") or {}
    recorded = dict(rec.get("items") or {}) if rec.get("algorithm") == CHECKSUM_ALGORITHM else {}
    back = {new: old for old, new in names.items()}
    out = w.checksums()
    n = 0
    for loc in w.locations().values():
        if loc.file not in back:
            continue
        digest = recorded.get(item_name(back[loc.file], loc.offset))
        if digest is None:
            return None, None
        out[item_name(loc.file, loc.offset)] = digest
        n += 1
    return out, n


def _data_record(shared: list, names: dict[str, str], layout: linking.LinkLayout, carried_records: int,
                 w: DcpWriter) -> dict[str, Any]:
    methods = sorted({s.method for s in shared})
    method = methods[0] if len(methods) == 1 else ("mixed: " + ", ".join(methods) if methods else "none")
    return {
        "mode": "link",
        "method": method,
        "shared": [{"file": s.path.name, "source_file": s.source.name, "bytes": s.size, "method": s.method}
                   for s in shared],
        "shared_bytes": sum(s.size for s in shared),
        "linked_tensors": len(layout.linked_tensors),
        "linked_objects": len(layout.linked_objects),
        "written_keys": len(layout.new),
        "written_files": sorted({loc.file for loc in w.locations().values() if loc.file not in set(names.values())}),
        "item_checksums": ("none recorded: the source records none for the shared items (each item's zip CRC-32s "
                           "still cover its bytes)" if carried_records is None else
                           f"{carried_records} shared items' checksums taken from the source's manifest, "
                           f"{len(w.checksums())} computed for the items written"),
        "note": linking.SHARED_NOTE + (". A rewritten or dropped key's old bytes stay in the shared files; the new "
                                       ".metadata does not point at them"),
    }
