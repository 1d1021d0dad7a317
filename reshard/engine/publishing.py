"""A conversion or export whose output goes to object storage: made in a local stage, then published.

Why here (engine) and not in the command: what makes a rerun resume, the resume key of the
committed local output, the checksums checked before that output is taken again, and the
upload's own record, is execution, the same for any caller (`reshard convert`, a script).
The bytes of the upload itself are `reshard.storage.objectstore.upload.publish`'s. A conversion's is a
`StoreOutput`, which wraps the output that makes it (`reshard.engine.pipeline.Output.around`),
so the conversion runs once, in the stage, and is published after it: the command does not
call itself for a local destination.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from reshard.engine.pipeline import Output
from reshard.engine.resume import resume_key
from reshard.planning.describe import inspect_checkpoint
from reshard.render.progress import phase_of
from reshard.storage.objectstore import upload
from reshard.storage.files.atomic import fault_point
from reshard.storage.files.integrity import check_items, item_bytes

if TYPE_CHECKING:
    from reshard.model.plan import Plan
    from reshard.storage.source import Source

__all__ = ["StoreOutput", "export_into_store"]


@dataclass
class StoreOutput(Output):
    """A conversion bound for object storage: ``inner`` (any output) made in the local folder of the
    destination's `upload.Stage`, then, once it has committed (verified equal), uploaded to ``url``
    (this output's ``dst``): data objects first, `.metadata` last (`reshard.storage.objectstore.upload.publish`).
    A kill before the last upload leaves no `.metadata` there, so no loader takes the output. It
    wraps the whole run (`around`) and takes none of its steps: those are ``inner``'s.

    Resuming, as beside a local destination: a conversion killed before its local commit left its
    journal in the stage (``inner`` resumes from it); one killed during the upload left its
    committed local output, which a rerun whose resume key (the plan, the source's identity) is
    the same takes again instead of converting anew, after checking its files against the
    checksums its manifest records, and uploads what the store does not hold yet. ``overwrite``:
    a checkpoint or an earlier reshard output at the URL is replaced (`upload.staged_output`).
    """

    inner: Optional[Output] = None
    restart: bool = False

    def around(self, plan: Plan, source: Source,
               convert: Callable[[Output], Optional[dict[str, Any]]]) -> Optional[dict[str, Any]]:
        with upload.staged_output(str(self.dst), overwrite=self.overwrite) as stage:
            earlier = None if self.restart else stage.converted()
            if earlier is not None and earlier["key"] != resume_key(plan, source).to_dict():
                earlier = None  # another conversion (plan, source or versions differ) waits there: made anew
            report = _taken_again(stage, earlier["report"], self.progress) if earlier is not None else None
            if report is None:
                stage.discard_output()
                report = replace(self.inner, dst=stage.out, overwrite=False, url=stage.url).around(plan, source, convert)
                if report is None or not (stage.out / ".metadata").exists():
                    return report  # a worker that does not commit: worker 0 uploads
                stage.record_converted(resume_key(plan, source).to_dict(), report)
            _upload(stage, report, self.progress)
        return report


def export_into_store(url: str, run: Callable[[Path, str], dict[str, Any]], *, overwrite: bool = False,
                      progress: Any = None) -> dict[str, Any]:
    """``run(local, url)``, an export into the local output of the destination's `upload.Stage`
    (its report naming ``url``), then
    its upload (shards first; the index and ``config.json`` a loader opens first, last). A rerun
    after a killed upload exports again (an export keeps no journal) and sends only the objects
    whose bytes the store does not hold as recorded. ``overwrite`` as for `StoreOutput`."""
    with upload.staged_output(url, overwrite=overwrite) as stage:
        stage.discard_output()
        report = run(stage.out, stage.url)
        _upload(stage, report, progress)
    return report


def _upload(stage: upload.Stage, report: dict[str, Any], progress: Any) -> None:
    """`upload.publish` with progress by bytes; the report names the URL and what was sent or kept."""
    with phase_of(progress, "uploading", upload.tree_bytes(stage.out)) as bar:
        sent = upload.publish(stage, on_event=fault_point, bar=bar)
    report["destination"] = stage.url
    report["uploaded"] = {"objects": sent.sent.requests, "bytes": sent.sent.bytes,
                          "checked_by_etag": sent.checked, "not_checked": sent.unchecked,
                          "kept_from_an_interrupted_upload": {"objects": sent.kept.requests, "bytes": sent.kept.bytes}}


def _taken_again(stage: upload.Stage, report: dict[str, Any], progress: Any) -> Optional[dict[str, Any]]:
    """The report of a committed local output an interrupted run left in ``stage``, once every item
    is checked against the CRC-32 its manifest records (this run reads those bytes; the comparison
    with the source is the earlier run's, against a source whose identity is unchanged). None if
    any item differs or is unrecorded: the output is then made anew."""
    insp = inspect_checkpoint(stage.out)
    integrity = getattr(insp.manifest, "integrity", None)
    if not integrity or not insp.complete:
        return None
    with phase_of(progress, "checking the staged output's checksums", item_bytes(insp.index)) as bar:
        issues = check_items(insp.index, integrity, progress=bar)
    if issues:
        return None
    report = dict(report)
    report["taken_again"] = {"from": str(stage.out), "items_checked_now": len(integrity.get("items") or {}),
                             "note": "the local output an interrupted run committed and verified against this "
                                     "source (same plan, same source identity); its items checked against their "
                                     "recorded CRC-32 now; only its upload resumes"}
    return report
