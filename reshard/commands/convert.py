"""`reshard convert`: execute a plan, reshard tensors, rewrite trainer state, verify, commit atomically.

The conversion itself is `reshard.engine.pipeline.run_conversion` (the rehearsal and the demo
run it through `reshard.engine.conversion.convert`); this command chooses its output and adds
what only the command line decides: the options from
a plan file (``--plan``, checked against the plan made again from the source) or from the
flags, ``--workers M`` (torchrun started on this machine, `reshard.engine.distributed`),
the I/O options (``--threads``, ``--buffer-memory``, ``--buffered``), and under torchrun the
worker's part of a distributed conversion (`reshard.engine.distributed.DistributedOutput`), and
a destination in a store (`reshard.engine.publishing.StoreOutput`, wrapping the output).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from reshard.gc_pause import frozen_heap
from reshard.errors import BadInput
from reshard.model.plan import Options
from reshard.engine.conversion import check_data_mode, output_for
from reshard.engine.copy import IOOptions
from reshard.engine.distributed import DistributedOutput, in_torchrun, launch_workers
from reshard.engine.pipeline import Output, run_conversion
from reshard.engine.publishing import StoreOutput
from reshard.planning.options import check_plan_matches, options_from_plan
from reshard.planning.plan import make_plan
from reshard.render.progress import waiting
from reshard.storage.source import Source
from reshard.storage.objectstore.urls import looks_like_url


@dataclass
class Converted:
    """What the command prints and how it exits: ``report`` (None when there is nothing to print:
    the workers it launched have printed theirs, or this process is a torchrun worker other than 0)."""

    report: Optional[dict[str, Any]]
    exit_code: int

    @property
    def resume_note(self) -> str:
        """Kept K of N items, or started over and why (`reshard.storage.files.journal.describe`); "" when not resumable."""
        from reshard.storage.files.journal import describe

        return (describe(self.report["resume"]) or "") if self.report and self.report.get("resume") else ""


def run_convert(source: Source, dst: Path | str, opts: Optional[Options], *, to: Optional[str] = None,
                plan_file: Optional[Path] = None, output_format: str = "dcp", data: str = "copy",
                workers: Optional[int] = None, threads: Optional[int] = None, window: Optional[int] = None,
                buffered: bool = False, overwrite: bool = False, restart: bool = False, force: bool = False,
                progress: Any = None, argv: Optional[list[str]] = None, debug: bool = False) -> Converted:
    """The conversion of ``source`` (the `Source` the interface opened, `reshard.storage.source.opened`)
    into ``dst`` the command line asks for.

    ``opts``: the plan options from the flags (`reshard.planning.options.build_options`), or None
    with ``plan_file`` (the options are the plan's) or without ``to`` (refused). ``window``: the
    copy buffers' memory in bytes (``--buffer-memory``). ``argv``: the command line, which
    ``--workers`` hands to each worker without ``--workers``. ``dst`` a URL (s3://bucket/prefix):
    the output is made and verified in a local directory, then published in DCP's commit order
    (`reshard.engine.publishing.StoreOutput`).
    """
    given = None
    if plan_file is not None:
        given = _plan_file(plan_file)
        opts = options_from_plan(given)
        if to is not None and to != opts.to:
            raise BadInput(f"--to {to} disagrees with the plan's target {opts.to}", where=str(plan_file))
    elif to is None:
        raise BadInput("convert needs --to SPEC or --plan PLAN.json")
    if output_format not in ("dcp", "local"):
        raise BadInput(f"unknown --output-format '{output_format}'", hint="Use dcp or local.")

    distributed = in_torchrun()
    check_data_mode(data, output_format=output_format, workers=workers, distributed=distributed)
    if workers is not None and workers != 1 and not distributed:
        if output_format != "dcp":
            raise BadInput("--workers writes DCP output only", hint="Drop --workers for --output-format local.")
        return Converted(None, launch_workers(workers, _without_workers(argv or []), debug=debug))
    if distributed and output_format != "dcp":
        raise BadInput("a distributed conversion writes DCP output only", hint="Run --output-format local in one process.")
    io = IOOptions(direct=not buffered,
                   **{k: v for k, v in (("threads", threads), ("window", window)) if v is not None})
    url = str(dst) if looks_like_url(str(dst)) else None  # a destination in a store, by its URL
    local = Path(dst) if url is None else Path(".")  # a store's output is made where its stage says (StoreOutput)
    if distributed and url is not None:  # each worker streams its own files into the store
        from reshard.engine.streaming import StreamedStoreOutput
        from reshard.engine.splice import default_window

        from reshard.storage.objectstore.upload import stage_folder

        # ``dst`` is where this machine's side lives (its spill folders), never the working directory:
        # the pipeline refuses a destination that overlaps the source
        output: Output = StreamedStoreOutput(stage_folder(url) / "out", overwrite=overwrite, force=force, progress=progress, io=io,
                                             restart=restart, url=url, window=window or default_window())
    elif distributed:
        output = DistributedOutput(local, overwrite=overwrite, force=force, progress=progress, io=io,
                                           restart=restart)
    else:
        output = output_for(local, overwrite=overwrite, progress=progress, output_format=output_format, io=io,
                            data=data, force=force, restart=restart)
    if url is not None and not distributed:
        output = StoreOutput(url, overwrite=overwrite, progress=progress, inner=output, restart=restart)
    if progress is not None:
        progress.say(f"planning the conversion to {opts.to} …")
    with waiting(progress):  # planning, the torch import, the index: seconds with no bytes to count
        p = make_plan(source, opts)
        if given is not None:
            check_plan_matches(given, p)
        with frozen_heap():  # the plan and the index are no garbage: reshard.gc_pause
            report = run_conversion(p, source, output)
    if report is None:  # a torchrun worker other than 0: worker 0 reports
        return Converted(None, 0)
    return Converted(report, 0 if report["verification"]["equal"] else 1)


def _plan_file(plan_file: Path) -> dict[str, Any]:
    from reshard.safefs import read_json

    try:  # a plan file comes from elsewhere too: a regular file, capped in size and depth
        return read_json(plan_file, root=plan_file.parent, what="plan file")
    except FileNotFoundError:
        raise BadInput("no such plan file", where=str(plan_file)) from None
    except OSError as exc:
        raise BadInput(f"cannot read the plan ({exc.strerror or exc})", where=str(plan_file)) from None


def _without_workers(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--workers":
            skip = True
            continue
        if a.startswith("--workers="):
            continue
        out.append(a)
    return out


def watch_output(dst: Path) -> tuple[int, int]:
    """What stands at ``dst`` as a ``--workers`` launcher starts (`reshard.storage.files.atomic.identity`):
    its worker 0 commits in another process, so after a Ctrl-C the launcher compares."""
    from reshard.storage.files.atomic import identity

    return identity(dst)


def interruption(dst: Path, before: Optional[tuple[int, int]] = None) -> tuple[str, int]:
    """The last line of a Ctrl-C during a command that writes ``dst`` through
    `reshard.storage.files.atomic.atomic_directory` (convert, export, import), and its exit code.

    Before the commit ``dst`` is unchanged: exit 130, saying when the same command resumes (a
    temporary directory and its journal wait beside ``dst``). After it (the rename into place
    happened, after the verification) the output is complete: exit 0, so a script does not take
    a finished conversion for a failed one. ``before``: `watch_output` of a ``--workers`` launcher.
    """
    from reshard.storage.objectstore import upload
    from reshard.storage.files.atomic import what_is_left

    if looks_like_url(str(dst)):  # an output bound for a store: committed once `.metadata` is uploaded
        try:
            if upload.committed_at(str(dst)):
                return f"interrupted after the commit: {dst} is complete", 0
        except Exception:  # noqa: BLE001 - the store unreachable now: say what is known locally
            pass
        return (f"interrupted: nothing committed in {dst}; the same command run again resumes from what waits in "
                f"{upload.stage_folder(str(dst))} (--restart starts over)"), 130
    left = what_is_left(dst, before=before)
    if left == "committed":
        return f"interrupted after the commit: {dst} is complete", 0
    line = f"interrupted: nothing committed; {dst} is unchanged"
    if left == "resumable":
        line += "; the same command run again resumes from the items already written (--restart starts over)"
    return line, 130
