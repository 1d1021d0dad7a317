"""The conversion run: a plan executed, stream by stream, into a checkpoint that appears atomically.

`convert` is what every caller runs, the command (`reshard.commands.convert`), the
rehearsal and the demo alike: it refuses an infeasible plan, a destination overlapping the
source, a ``--data`` mode the output cannot take and a destination lacking the space
(`reshard.engine.space`), then writes the output into a temporary directory beside the
destination, verifies it against the source in global terms, and only then renames it into
place; an interrupted run leaves nothing that looks like a checkpoint. This module chooses
the output (`reshard.engine.copy.CopyOutput`, a DCP output; `reshard.engine.local_output.LocalOutput`,
one safetensors file per target rank; `reshard.engine.link.LinkOutput`, ``--data link``) and
hands it to `reshard.engine.pipeline.run_conversion`, the one order every conversion follows
(space check, staging, items, sidecars, manifest, verification, reports, refusal, commit). A
distributed run (`reshard.engine.distributed.DistributedOutput`) follows the same order, its
steps divided among the workers.

Faults
------
* **Killed** (SIGKILL, OOM, power): ``dst`` is untouched (absent, or the previous output
  with ``--overwrite``); at most a hidden temporary directory and the lock file remain
  beside it, with the journal of the items written (`reshard.storage.files.journal`). The next
  run into ``dst`` with the same plan, source and options continues in that directory: it
  keeps every journaled item whose bytes still have their CRC-32 and writes the rest
  (``--restart``, or any change of the resume key: it deletes the directory and starts
  over, saying why). Running the same command again gives the same bytes either way.
* **Out of space** (ENOSPC, EFBIG, EDQUOT): `BadInput` (exit 2) naming the destination
  and the estimated bytes needed (`reshard.storage.files.integrity.estimate_output_bytes`); nothing is
  committed and the temporary directory is removed. `reshard.storage.files.integrity.space_check`
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
`reshard.storage.files.atomic.fault_point` counts them; environment variables act on them:

* ``RESHARD_FAULT_COUNT=PATH``: append ``"N LABEL"`` per event (an uninterrupted run's
  last line is the total);
* ``RESHARD_FAULT_KILL_AT=N``: SIGKILL the process right after event N;
* ``RESHARD_FAULT_SLEEP_AT=N:SECONDS``: sleep right after event N (to hold the lock); a label
  instead of N (``rename:30``) names the first event so called (after ``rename`` the output is
  committed: a Ctrl-C there must leave it complete, exit 0).

``tests/test_faults.py`` and ``scripts/soak_faults.py`` use them; they do nothing unset.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from reshard.errors import BadInput
from reshard.model.kinds import DataMode, OutputFormat
from reshard.model.plan import Plan
from reshard.planning import linking
from reshard.storage.source import Source
from reshard.engine.copy import CopyOutput, IOOptions
from reshard.engine.link import LinkOutput
from reshard.engine.pipeline import Output, run_conversion


def convert(plan: Plan, src: Path | Source, dst: Path, *, overwrite: bool = False, progress: Any = None,
            output_format: str = "dcp", io: IOOptions | None = None, data: str = "copy",
            force: bool = False, restart: bool = False) -> dict[str, Any]:
    """Write the plan's checkpoint to ``dst``; returns the conversion report.

    ``src``: the `Source` a command opened, or a checkpoint directory on this machine.
    A DCP copy is resumable (`reshard.storage.files.journal`): a run into ``dst`` that was killed
    leaves its journaled items, and this run keeps the ones still right (``report["resume"]``)
    unless the resume key differs or ``restart``.

    ``data``: ``"copy"`` writes every tensor byte new; ``"link"`` shares the source's data
    files with the output (`LinkOutput`) and writes only what changes.
    ``progress``: a `reshard.render.progress.Progress` (or None): the phases "writing" and
    "verifying", by bytes.
    ``force``: go ahead when the destination lacks the space (`reshard.engine.space.preflight`
    refuses before anything is written otherwise; its figures are the report's ``estimate``).
    """
    output = output_for(dst, overwrite=overwrite, progress=progress, output_format=output_format, io=io, data=data,
                        force=force, restart=restart)
    source = src if isinstance(src, Source) else Source.local(src, trust_pickle=plan.options.trust_pickle)
    return run_conversion(plan, source, output)


def output_for(dst: Path, *, overwrite: bool = False, progress: Any = None, output_format: str = "dcp",
               io: IOOptions | None = None, data: str = "copy", force: bool = False,
               restart: bool = False) -> Output:
    """The output a single process writes for these options (refused first when they cannot go together)."""
    check_data_mode(data, output_format=output_format)
    if data == DataMode.LINK:
        return LinkOutput(Path(dst), overwrite=overwrite, progress=progress)
    if output_format == OutputFormat.LOCAL:
        from reshard.engine.local_output import LocalOutput  # imports torch: only when asked for

        return LocalOutput(Path(dst), overwrite=overwrite, force=force, progress=progress)
    return CopyOutput(Path(dst), overwrite=overwrite, force=force, progress=progress, io=io or IOOptions(),
                      restart=restart)


def check_data_mode(data: str, *, output_format: str = "dcp", workers: int | None = None,
                    distributed: bool = False) -> None:
    """``--data copy|link`` and the options it cannot go with, refused before any work."""
    if data not in linking.DATA_MODES:
        raise BadInput(f"unknown --data '{data}'", hint="Use copy (write every byte new, the default) or link "
                                                        "(share the source's tensor files by reflink or hard link).")
    if data != DataMode.LINK:
        return
    if output_format != OutputFormat.DCP:
        raise BadInput(f"--data link writes a DCP checkpoint whose items are the source's; --output-format "
                       f"{output_format} is another format, whose files hold new bytes",
                       hint="Use --data copy with --output-format local.")
    if distributed or (workers is not None and workers != 1):
        raise BadInput("--data link runs in one process: it writes only metadata and the keys that change, so "
                       "there is nothing to divide among workers",
                       hint="Drop --workers (or run it without torchrun), or use --data copy to divide a copy.")

