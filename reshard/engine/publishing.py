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

import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Optional

from reshard.engine.pipeline import Output
from reshard.engine.resume import resume_key
from reshard.planning.describe import inspect_checkpoint
from reshard.render.progress import phase_of
from reshard.storage.objectstore import upload
from reshard.storage.objectstore.stream import SpillStreamer, StreamedObject
from reshard.storage.files.atomic import fault_point
from reshard.storage.files.integrity import check_items, item_bytes

if TYPE_CHECKING:
    from reshard.model.plan import Plan
    from reshard.storage.source import Source

__all__ = ["StoreOutput", "EarlyUpload", "export_into_store"]

#: Parts of a single process's data files under way at once (`EarlyUpload.watch`): as many as
#: `upload.Publisher.send_all` had (`upload.UPLOADERS` objects of `upload.PARTS_IN_FLIGHT` parts).
STREAMED_IN_FLIGHT = 8


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
            publisher = upload.Publisher(stage, on_event=fault_point)
            early: Optional[EarlyUpload] = None
            if report is None:
                stage.discard_output()
                early = EarlyUpload(publisher, restart=self.restart) if type(self.inner).step is Output.step else None
                inner = replace(self.inner, dst=stage.out, overwrite=False, url=stage.url,
                                written=early.start if early is not None else None,
                                watch=early.watch if early is not None else None)
                try:
                    report = inner.around(plan, source, convert)
                except BaseException:
                    if early is not None:
                        early.join(abandon=True)  # the run's own error is the one raised
                    raise
                if early is not None:
                    early.join()
                if report is None or not (stage.out / ".metadata").exists():
                    return report  # a worker that does not commit: worker 0 uploads
                stage.record_converted(resume_key(plan, source).to_dict(), report)
            _upload(publisher, report, self.progress)
            if early is not None and early.objects:
                report["uploaded"]["streamed"] = early.summary()
        return report


class EarlyUpload:
    """The data files of a conversion bound for a store, sent while they are written: each file's
    parts as soon as the writer has filled them (`watch`: a `SpillStreamer` that follows the writer
    and leaves the stage whole), then, once every item is written (`Output.written`, `start`), each
    file's last part and its upload completed, checked against the store's ETag and recorded
    (`upload.Publisher.landed`), and any data file not streamed so sent whole; all while the run
    verifies the output, writes its manifest and reports and commits it locally. By the time the local
    commit is made, the data is in the store, and `upload.Publisher.finish` sends only the small files
    and `.metadata` (the commit) after them.

    Why it is safe: the objects go to their final names under the upload marker (put before the
    first request, `_first_request`), each name recorded as this machine's before its first request (`Publisher.intend`),
    and `.metadata` goes only after the local output is verified and committed; a run refused,
    failed or killed meanwhile commits nothing in the store (no `.metadata`). Its unfinished
    multipart uploads are left for the rerun, which continues the newest of each recorded name
    (keeping only the parts whose MD5, the store's ETag of the part, equals that of the bytes it
    would send) and aborts the others. A data file is final once its items are filled (the
    verification only reads it), and each part's items are CRC-32'd as sent against the writer's
    record; a file changed after it was sent would be sent again (`Publisher.send` compares its size
    and modification time)."""

    def __init__(self, publisher: upload.Publisher, *, restart: bool = False):
        self.publisher, self.restart = publisher, restart  # restart: no interrupted upload continued
        self.streamer: Optional[SpillStreamer] = None
        self.objects: list[StreamedObject] = []  # the files streamed, once finished
        self.thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None

    def watch(self, run: Any) -> SpillStreamer:
        """The watcher of the writer of ``run`` (`Output.watch`), as the items start being written. The
        files an interrupted upload already put are not followed (`send` keeps them if their bytes are
        the same), and its unfinished uploads of names this machine recorded are continued."""
        from reshard.engine.pipeline import file_bytes_bound

        publisher = self.publisher
        publisher.look()
        bucket, prefix = publisher.base.split("/", 1)
        self.streamer = SpillStreamer(publisher.fs, bucket, prefix, run.tmp,
                                      part=upload.send_part(file_bytes_bound(run.plan, run.ix)),
                                      budget=None, punch=False, in_flight=STREAMED_IN_FLIGHT,
                                      resume_from=self._unfinished(bucket, prefix), on_part=fault_point,
                                      before_upload=self._first_request,
                                      skip=frozenset(t for t in publisher.recorded if publisher.may_keep(t)))
        return self.streamer

    def _first_request(self, name: str) -> None:
        """Before the streamer's first request for ``name`` (on its one sender thread, or on the thread
        of `_send` once the copy is over): the destination checked and the marker put on the first
        (`Publisher.begin`: nothing is put in the store before a part is ready), the name recorded."""
        self.publisher.begin()
        self.publisher.intend(name)

    def _unfinished(self, bucket: str, prefix: str) -> dict[str, list[dict[str, Any]]]:
        """The unfinished multipart uploads of the names this machine recorded (an interrupted run's):
        the newest of each, to continue; the older ones aborted, and all of them with ``--restart``.
        None where the store cannot list them (the rerun then starts each upload anew)."""
        from reshard.storage.objectstore.stream import uploads_to_continue

        try:
            return uploads_to_continue(self.publisher.fs, bucket, prefix, set(self.publisher.recorded),
                                       restart=self.restart)
        except Exception:  # noqa: BLE001 - a store without ListMultipartUploads: nothing to continue
            return {}

    def start(self, run: Any) -> None:
        """Every item is written: the streamed files finished and the rest of ``run.tmp``'s data files
        (`*.distcp`) sent, in the background."""
        # opened now: the local commit renames their folder while they are read
        files = [(p.name, open(p, "rb")) for p in sorted(Path(run.tmp).glob("*.distcp"))]
        self.thread = threading.Thread(target=self._send, args=(files,), name="reshard-early-upload", daemon=True)
        self.thread.start()

    def _send(self, files: list[tuple[str, BinaryIO]]) -> None:
        try:
            if self.streamer is not None:
                opened = dict(files)
                self.objects = objects = self.streamer.finish()  # its requests may begin the upload (`_first_request`)
                self.streamer.close_readers()
                for obj in objects:
                    f = opened.get(obj.name)
                    mtime = os.fstat(f.fileno()).st_mtime_ns if f is not None else 0
                    self.publisher.landed(obj.name, upload.Sent(obj.size, mtime, obj.digests, obj.multipart, obj.crc32))
            self.publisher.begin()
            self.publisher.send_all(files)  # what was not streamed (a streamed file is done: skipped)
        except BaseException as exc:  # noqa: BLE001 - raised by `join`, on the run's thread
            self.error = exc
        finally:
            for _name, f in files:
                f.close()

    def summary(self) -> dict[str, Any]:
        """What the report says of the files streamed behind the writer."""
        o = self.objects
        return {"objects": len(o), "parts_sent": sum(x.parts_sent for x in o),
                "parts_kept": sum(x.parts_kept for x in o), "bytes_kept": sum(x.bytes_kept for x in o),
                "items_checked_as_sent": sum(x.items_checked for x in o),
                "note": "each data file's parts sent while the copy wrote the rest, each item's bytes as sent CRC-32'd "
                        "against the writer's record; parts_kept: parts an interrupted run had sent, kept because "
                        "their MD5 (the store's ETag of the part) equals that of the bytes this run would send"}

    def join(self, *, abandon: bool = False) -> None:
        """Wait for it and raise its error; ``abandon`` (the run failed): no part or file more is begun,
        the puts under way end, and its error is not raised (the run's own is)."""
        if abandon:
            self.publisher.stopped = True
            if self.streamer is not None:
                self.streamer.stop()
        if self.thread is not None:
            self.thread.join()
        if self.error is not None and not abandon:
            raise self.error


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
        _upload(upload.Publisher(stage, on_event=fault_point), report, progress)
    return report


def _upload(publisher: upload.Publisher, report: dict[str, Any], progress: Any) -> None:
    """`upload.Publisher.finish` with progress by bytes (what an early upload sent counted at once);
    the report names the URL and what was sent or kept."""
    stage = publisher.stage
    with phase_of(progress, "uploading", upload.tree_bytes(stage.out)) as bar:
        publisher.progress.bar = bar
        publisher.progress.add(publisher.sent.bytes + publisher.kept.bytes)
        sent = publisher.finish()
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
