"""The conversion run: a plan executed, stream by stream, into a checkpoint that appears atomically.

`convert` is what every caller runs, the command (`reshard.commands.convert`), the
rehearsal and the demo alike: it refuses an infeasible plan, a destination overlapping the
source, a ``--data`` mode the output cannot take and a destination lacking the space
(`reshard.engine.space`), then writes the output into a temporary directory beside the
destination, verifies it against the source in global terms, and only then renames it into
place; an interrupted run leaves nothing that looks like a checkpoint. The items are
written by `reshard.engine.copy` (a DCP output), `reshard.engine.local_output` (one
safetensors file per target rank) or shared by `reshard.engine.link` (``--data link``);
every run ends as `reshard.engine.outcome` says (verification, reports, refusal). A
distributed run (`reshard.engine.distributed`) shares this module's preparation and resume
key and divides the copy among its workers.

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
* ``RESHARD_FAULT_SLEEP_AT=N:SECONDS``: sleep right after event N (to hold the lock); a label
  instead of N (``rename:30``) names the first event so called (after ``rename`` the output is
  committed: a Ctrl-C there must leave it complete, exit 0).

``tests/test_faults.py`` and ``scripts/soak_faults.py`` use them; they do nothing unset.
"""
from __future__ import annotations

import threading
import time as _time
from pathlib import Path
from typing import Any


from reshard.errors import BadInput, Infeasible
from reshard.units import now_text
from reshard.planning.plan import source_index
from reshard.storage import remote
from reshard.storage.index import CheckpointIndex
from reshard.storage.hf_dcp import open_source
from reshard.engine.space import conversion_preflight
from reshard.storage.integrity import is_space_error, out_of_space
from reshard.storage.integrity import record as integrity_record
from reshard.storage.atomic import atomic_directory, check_destination, fault_point
from reshard.storage.replaceable import why_not_replaceable
from reshard.storage.dcp_writer import CHECKSUM_ALGORITHM, DcpWriter
from reshard.storage.journal import Journal
from reshard.engine.resume import resume_key
from reshard.semantics.manifest import write_manifest
from reshard.planning import linking
from reshard.model.plan import Plan
from reshard.semantics.transition import output_manifest
from reshard.render.progress import describe_bytes, end_commit, phase_of, start_commit
from reshard.engine.copy import IOOptions, WriteChecks, write_items, writing_bytes
from reshard.engine.link import convert_link
from reshard.engine.outcome import (build_report, carry_sidecars, refuse_if_different, source_manifest, verify_output,
                                    write_reports)


def prepare_conversion(plan: Plan, src: Path, dst: Path) -> tuple[Path, Path, CheckpointIndex]:
    """Refuse infeasible plans and destinations that overlap the source; open the source."""
    if not plan.feasible:
        raise Infeasible("the plan is infeasible: " + "; ".join(plan.reasons), where=str(src),
                         hint="Run `reshard plan` to see the choices.")
    src, dst = Path(src), Path(dst)
    check_destination(src, dst)
    # a DCP checkpoint, or torch's safetensors-backed DCP (HuggingFaceStorageWriter): the output is DCP either way
    return src, dst, source_index(plan, src) or open_source(src, trust_pickle=plan.options.trust_pickle)


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


def _convert_dcp(plan: Plan, src: Path, dst: Path, ix: CheckpointIndex, *, overwrite: bool, progress: Any,
                 io: IOOptions, estimate: dict[str, Any] | None = None, restart: bool = False) -> dict[str, Any]:
    started = _time.time()
    stamp = now_text()
    journal = Journal(resume_key(plan, src, rc=getattr(ix, "remote", None)), restart=restart)
    with atomic_directory(dst, overwrite=overwrite, replaceable=why_not_replaceable, reuse=journal.choose) as tmp:
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
        verification["b"] = remote.output_name(dst) or str(dst)  # what was verified is what appears at dst (its URL)
        report = build_report(plan, src, dst, tmp, verification, manifest.to_dict(), w.checksums(), _time.time() - started)
        report["sidecars"] = carried
        report["estimate"] = estimate
        report["resume"] = journal.summary()
        write_reports(tmp, report)
        refuse_if_different(verification, dst, "the converted checkpoint")
        remote.check_unchanged(src)  # a source in a store: what was read is still what is listed
        commit = start_commit(progress, tmp)  # the fsync and rename as the block exits
    end_commit(progress, commit)
    return report


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


def convert_local(plan: Plan, src: Path, dst: Path, *, overwrite: bool = False, progress: Any = None) -> dict[str, Any]:
    """`--output-format local`: one safetensors file per target rank with exactly its local tensors."""
    return convert(plan, src, dst, overwrite=overwrite, progress=progress, output_format="local")


def _convert_local(plan: Plan, src: Path, dst: Path, ix: CheckpointIndex, *, overwrite: bool, progress: Any,
                   estimate: dict[str, Any] | None = None) -> dict[str, Any]:
    from reshard.engine.local_output import write_local

    started = _time.time()
    with atomic_directory(dst, overwrite=overwrite, replaceable=why_not_replaceable) as tmp:
        with phase_of(progress, "writing", writing_bytes(plan, ix)) as bar:
            info = write_local(plan, ix, tmp, progress=bar, total_bytes=writing_bytes(plan, ix))
        carried = carry_sidecars(plan, ix, src, tmp)
        manifest = output_manifest(plan, source_manifest(src), time=now_text())
        write_manifest(tmp, manifest)
        fault_point("manifest")
        verification = verify_output(src, tmp, plan, progress=progress)
        verification["b"] = remote.output_name(dst) or str(dst)
        report = build_report(plan, src, dst, tmp, verification, manifest.to_dict(), {}, _time.time() - started)
        report["output_format"] = "local"
        report["files"] = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.suffix == ".safetensors"}
        report["bytes_written"] = sum(report["files"].values())
        report["local"] = info
        report["sidecars"] = carried
        report["estimate"] = estimate
        write_reports(tmp, report)
        refuse_if_different(verification, dst, "the local output")
        remote.check_unchanged(src)
        commit = start_commit(progress, tmp)
    end_commit(progress, commit)
    return report
