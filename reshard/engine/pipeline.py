"""The one order of a conversion, from the space check to the commit, whatever kind of output it writes.

Why one function: a conversion's end (the tied copies checked, the sidecars carried, the manifest,
the verification, the reports, the refusal of a difference, the commit) decides whether a user
gets a checkpoint they can trust. Written once per output kind, the copies drifted apart (one
skipped the commit's progress line, one named its refusal differently). Here it is written once,
in `run_conversion`; what differs between outputs is only *how* each step is done, which an
`Output` supplies:

==========================  ==========================================================
step (in this order)        who does it
==========================  ==========================================================
``preflight``               `Output.preflight`: the space check (a link checks it can link)
``staging``                 `Output.staging`: the hidden directory beside the destination
``tied copies``             here: tied keys the plan keeps once must be equal in the source
``writing``                 `Output.write`: the items, by the output's own writer
``sidecars``                here: the trainer's files beside the checkpoint, carried
``manifest``                here, with `Output.manifest` adding the output's own records
``verifying``               `Output.verify`: the output against the source, in global terms
``report``                  here, with `Output.describe` adding the output's own fields
``writing the reports``     here (`reshard.engine.outcome.write_reports`)
``refusing a difference``   here: nothing is committed when the output differs
``source unchanged``        here: a source in a store listed again
``commit``                  here: the rename into place (as the staging block exits)
==========================  ==========================================================

The kinds: `reshard.engine.copy.CopyOutput` (a DCP copy), `reshard.engine.link.LinkOutput`
(``--data link``), `reshard.engine.local_output.LocalOutput` (per-rank safetensors) and
`reshard.engine.distributed.DistributedOutput` (one torchrun worker's part of a DCP copy). Every
step goes through `Output.step`, so an output divided among processes runs each step where it
belongs (all workers, or worker 0 with the others told the outcome) without restating the order.
`Output.around` wraps the whole run: an output bound for a store
(`reshard.engine.publishing.StoreOutput`) stages it locally and publishes it afterwards.

Nothing heavy is imported at this module's top: `reshard.engine.distributed`, which the CLI imports
before any work, defines an `Output`.
"""
from __future__ import annotations

import contextlib
import time as _time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, ContextManager, Optional, TypeVar

if TYPE_CHECKING:
    from reshard.model.plan import Plan
    from reshard.model.reader import CheckpointReader
    from reshard.semantics.manifest import Manifest
    from reshard.storage.source import Source

__all__ = ["Output", "Run", "STEPS", "run_conversion", "writing_bytes"]

T = TypeVar("T")

STEPS = ("preflight", "staging", "tied copies", "writing", "sidecars", "manifest", "verifying", "report",
         "writing the reports", "refusing a difference", "source unchanged", "commit")
"""Every step of `run_conversion`, in its order (what `Output.step` is handed as ``name``)."""


@dataclass
class Run:
    """What one conversion knows as it goes: given at the start, each step adds its part."""

    plan: Plan
    source: Source
    dst: Path
    ix: CheckpointReader                       # the source's opened reader (`Source.reader`, the plan's own)
    progress: Any = None                       # shown by this process (None: another one shows it)
    started: float = field(default_factory=_time.time)
    stamp: str = ""                            # the time every output file records
    estimate: Optional[dict[str, Any]] = None  # the space check's figures (None: no check was made here)
    tmp: Optional[Path] = None                 # the hidden directory the output is made in
    carried: list[dict[str, Any]] = field(default_factory=list)
    manifest: Optional[Manifest] = None
    verification: Optional[dict[str, Any]] = None
    report: Optional[dict[str, Any]] = None

    def own(self, exc: BaseException) -> BaseException:
        """An error as this run reports it: a full disk names the destination and the bytes needed."""
        from reshard.storage.files.integrity import is_space_error, out_of_space

        if not is_space_error(exc):
            return exc
        if self.estimate is not None:
            needed = self.estimate["needed_bytes"]
        else:
            from reshard.engine.space import estimate_output_bytes

            needed = estimate_output_bytes(self.plan, self.ix)
        return out_of_space(self.dst, needed, exc)


@dataclass
class Output:
    """Where and how a conversion writes: the steps that differ between output kinds.

    A subclass supplies `write` and, where its kind differs, `preflight`, `staging`, `manifest`,
    `verify`, `describe`; `step` and `around` are how a step and the whole run are carried out
    (here: in this process, as they come). The order of the steps is not an output's to choose.
    """

    dst: Path
    overwrite: bool = False
    force: bool = False      # go ahead when the space check finds too little room
    progress: Any = None
    url: Optional[str] = None  # the store URL ``dst`` is uploaded to (`StoreOutput` sets it): reports name it
    #: Called once the items are written, while the run goes on (`StoreOutput` starts the upload of the
    #: data files then, so it overlaps the verification); None: nothing.
    written: Optional[Callable[[Run], None]] = None
    #: Called as the items start being written: a watcher of the writer (its ``reserved`` and ``filled``
    #: items, `reshard.storage.checkpoints.dcp_writer.DcpWriter`'s observer) for an output that writes
    #: through one (`StoreOutput` sends each data file's parts as soon as they are written); None: nothing.
    watch: Optional[Callable[[Run], Any]] = None
    phase: ClassVar[str] = "writing"  # the progress phase of `write`

    # -- how steps run -------------------------------------------------------------------
    def step(self, run: Run, name: str, fn: Callable[[], T]) -> T:
        """Carry out one step of `run_conversion` (``name`` one of `STEPS`)."""
        return fn()

    def around(self, plan: Plan, source: Source,
               convert: Callable[[Output], Optional[dict[str, Any]]]) -> Optional[dict[str, Any]]:
        """The whole run, ``convert(output)``: here as it is; a wrapper (a store) acts before and after,
        and may hand ``convert`` another output (its inner one, made where it stages)."""
        return convert(self)

    @property
    def commits(self) -> bool:
        """Whether this process writes the reports and commits (one worker does, in a divided output)."""
        return True

    @property
    def shown(self) -> Any:
        """The progress this process shows (only one process of a divided output does)."""
        return self.progress

    # -- the output's own steps -----------------------------------------------------------
    def preflight(self, run: Run) -> Optional[dict[str, Any]]:
        """Refuse a destination without the space the output needs (unless ``force``); its figures."""
        from reshard.engine.space import conversion_preflight

        return conversion_preflight(run.plan, run.ix, self.dst, force=self.force, progress=run.progress,
                                    publish_to=self.url)

    def staging(self, run: Run) -> ContextManager[Path]:
        """The hidden directory beside ``dst`` the output is made in, renamed into place as the block exits."""
        from reshard.storage.files.atomic import atomic_directory
        from reshard.storage.files.replaceable import why_not_replaceable

        return atomic_directory(self.dst, overwrite=self.overwrite, replaceable=why_not_replaceable)

    def write(self, run: Run) -> None:
        """Every item of the plan into ``run.tmp``."""
        raise NotImplementedError(f"{type(self).__name__} writes no items")

    def manifest(self, run: Run, manifest: Manifest) -> None:
        """The output's own records in the manifest before it is written (item checksums, ...)."""

    def verify(self, run: Run) -> Optional[dict[str, Any]]:
        """The output compared with the source (`reshard.engine.outcome.verify_output`)."""
        from reshard.engine.outcome import verify_output

        return verify_output(run.source, run.tmp, run.plan, progress=run.progress)

    def checksums(self, run: Run) -> dict[str, str]:
        """The item checksums this output computed while writing (the report counts them)."""
        return {}

    def describe(self, run: Run, report: dict[str, Any]) -> None:
        """The output's own fields of the report, added after the common ones."""

    def resume(self, run: Run) -> Optional[dict[str, Any]]:
        """What a resumable output kept of an interrupted run (None: this kind does not resume)."""
        return None


def run_conversion(plan: Plan, source: Source, output: Output) -> Optional[dict[str, Any]]:
    """Convert ``source`` by ``plan`` into ``output``; the report (None on a worker that does not commit).

    Refuses an infeasible plan and a destination overlapping the source before anything else.
    """
    return output.around(plan, source, lambda out: _converted(plan, source, out))


def _converted(plan: Plan, source: Source, output: Output) -> Optional[dict[str, Any]]:
    from reshard.errors import Infeasible
    from reshard.planning.plan import plan_reader
    from reshard.storage.files.atomic import check_destination
    from reshard.units import now_text

    if not plan.feasible:
        raise Infeasible("the plan is infeasible: " + "; ".join(plan.reasons), where=str(source.root),
                         hint="Run `reshard plan` to see the choices.")
    check_destination(source.root, output.dst)
    ix = plan_reader(plan, source)
    run = Run(plan, source, Path(output.dst), ix, progress=output.shown, stamp=now_text())
    say_converting(run)
    try:
        return _steps(run, output)
    except OSError as exc:  # e.g. the commit itself (fsync, rename) on a full disk
        own = run.own(exc)
        if own is exc:
            raise
        raise own from None


def _steps(run: Run, output: Output) -> Optional[dict[str, Any]]:
    """The order, written once."""
    from reshard.engine.outcome import carry_sidecars, refuse_if_different, write_reports
    from reshard.render.progress import end_commit, start_commit

    def step(name: str, fn: Callable[[], T]) -> T:
        return output.step(run, name, fn)

    run.estimate = step("preflight", lambda: output.preflight(run))
    with contextlib.ExitStack() as staged:
        run.tmp = step("staging", lambda: staged.enter_context(output.staging(run)))
        step("tied copies", lambda: check_tied_copies(run))
        step("writing", lambda: output.write(run))
        if output.written is not None:
            output.written(run)
        run.carried = step("sidecars", lambda: carry_sidecars(run.plan, run.ix, run.source.root, run.tmp))
        run.manifest = step("manifest", lambda: _write_manifest(run, output))
        run.verification = step("verifying", lambda: _verified(run, output))
        if not output.commits:
            return None
        run.report = step("report", lambda: _report(run, output))
        step("writing the reports", lambda: write_reports(run.tmp, run.report))
        step("refusing a difference", lambda: refuse_if_different(run.verification, output.dst))
        step("source unchanged", run.source.check_unchanged)  # a store's prefix: what was read is still listed
        commit = step("commit", lambda: start_commit(run.progress, run.tmp))  # fsync and rename as the block exits
    end_commit(run.progress, commit)
    return run.report


def say_converting(run: Run) -> None:
    """The first line once the source is read: how much is converted, into what."""
    if run.progress is None:
        return
    from reshard.render.progress import describe_bytes

    kept = {a.key for a in run.plan.keys if not a.left_out}
    n = sum(1 for key, e in run.ix.entries.items() if e.is_tensor and key in kept)
    run.progress.say(f"converting {describe_bytes(writing_bytes(run.plan, run.ix), n, 'tensor')} "
                     f"to {run.plan.options.to} …")


def writing_bytes(plan: Plan, ix: CheckpointReader) -> int:
    """What the "writing" phase counts to: the logical bytes of the source keys the plan keeps."""
    left_out = {a.key for a in plan.keys if a.left_out}
    return sum(e.nbytes for key, e in ix.entries.items() if key not in left_out)


def target_ranks(plan: Plan) -> list[int]:
    """The target ranks that hold a data file of the output (every rank of the target world)."""
    ranks = {int(r) for t in plan.tensors for r, _o, _s in t.chunks}
    ranks |= {int(a.rank or 0) for a in plan.keys if not a.left_out}
    return sorted(ranks)


def file_bytes_bound(plan: Plan, ix: CheckpointReader) -> int:
    """A bound on one data file's bytes, to size multipart uploads by (10,000 parts at most): twice the
    even share of the bytes written, with room for the skew between ranks, plus 1 MiB."""
    return writing_bytes(plan, ix) // max(1, len(target_ranks(plan))) * 2 + (1 << 20)


def check_tied_copies(run: Run) -> None:
    """Tied keys the plan writes once (`Plan.checks`) must be bitwise equal in the source: the target
    would otherwise keep one of them silently."""
    from reshard.errors import Infeasible
    from reshard.storage.checkpoints.index import bitwise_equal

    for key, equal_to in run.plan.checks.items():
        if not bitwise_equal(run.ix, key, equal_to):
            raise Infeasible(f"tied copies '{key}' and '{equal_to}' differ: the target would keep one of them silently",
                             where=str(run.source.root),
                             hint="Inspect the source: tied weights and their optimizer state must be equal.")


def _write_manifest(run: Run, output: Output) -> Manifest:
    from reshard.engine.outcome import source_manifest
    from reshard.semantics.manifest import write_manifest
    from reshard.semantics.transition import output_manifest
    from reshard.storage.files.atomic import fault_point

    manifest = output_manifest(run.plan, source_manifest(run.source.root), time=run.stamp)
    output.manifest(run, manifest)
    write_manifest(run.tmp, manifest)  # the verification reads the step and cursor from it
    fault_point("manifest")
    return manifest


def _verified(run: Run, output: Output) -> Optional[dict[str, Any]]:
    verification = output.verify(run)
    if verification is not None:  # what was verified is what appears at dst (a store output: its URL)
        verification["b"] = output.url or str(output.dst)
    return verification


def _report(run: Run, output: Output) -> dict[str, Any]:
    from reshard.engine.outcome import build_report

    report = build_report(run.plan, run.source, output.dst, run.tmp, run.verification, run.manifest.to_dict(),
                          output.checksums(run), _time.time() - run.started, published=output.url)
    output.describe(run, report)
    report["sidecars"] = run.carried
    if run.estimate is not None:
        report["estimate"] = run.estimate
    resumed = output.resume(run)
    if resumed is not None:
        report["resume"] = resumed
    return report
