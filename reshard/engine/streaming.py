"""A distributed conversion written straight into object storage: each worker streams its own files.

Run as ``reshard convert SRC s3://DST --to SPEC --workers M`` or under ``torchrun --nnodes N
--nproc-per-node M -m reshard convert SRC s3://DST ...``. It is `reshard.engine.distributed`'s
protocol (the same plan on every worker, every item reserved in the same order, the data file of
target rank ``r`` written by worker ``r mod W``, every step taken together through one
`reshard.engine.distributed.Collective`) with a store for a destination and no shared file system:

1. worker 0 opens the destination as a single process does (`upload.staged_output`: empty, or an
   unfinished upload of its own, or ``--overwrite`` of a checkpoint); once the plan is known feasible
   and the destination's checks have passed, it puts the upload marker and records every data object this output will have as its own *before* any worker puts one (so a
   rerun from this machine may replace them, and nothing else); unfinished multipart uploads of
   those objects are handed to the workers that own them, to continue;
2. each worker writes its files into a local *spill* folder through the usual writer, which a
   `reshard.storage.objectstore.stream.SpillStreamer` watches: parts are sent as soon as they are
   final, checked item by item (CRC-32 of the bytes sent against the writer's record) and punched
   out of the spill file. Local disk and memory per worker stay near ``--buffer-memory`` (half for
   the copy's buffers, half for parts not yet sent), whatever the checkpoint's size. From a source in
   a store, each worker fetches only the byte ranges its files are cut from, into sparse files beside
   its spill folder, within a share of the buffer, and punches them once spliced
   (`reshard.storage.objectstore.window.RangeWindow`, through `reshard.engine.copy`);
3. every worker reports its objects (size, the MD5 of each part, CRC-32); worker 0 checks the source
   storages split between workers (as on a shared file system), then lists the store and checks
   that every object is there with the size and ETag its worker reported, and writes `.metadata`,
   the sidecars and the manifest into its own spill folder and hands those files to every worker;
4. each worker verifies its files against the source: the items spliced from the source were
   checked as they were written and as they were sent; every other item (objects, rewritten
   values, transformed tensors) is still in its spill file (never punched) and compared there;
5. worker 0 writes the reports and commits: the small files, then `.metadata` (DCP's commit), then
   the marker removed. A failure anywhere, or a lost worker, commits nothing; the rerun resumes.

Resuming: the marker and the recorded names make the leftovers this machine's; every finished part
of an interrupted upload is kept only if its MD5 (the store's ETag of the part) equals the MD5 of the
bytes this run would send in its place (`SpillStreamer`), every other part is sent again.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from reshard.engine.distributed import DistributedOutput
from reshard.engine.pipeline import Output, Run, file_bytes_bound, target_ranks

__all__ = ["StreamedStoreOutput"]

#: The part of ``--buffer-memory`` the copy's buffers take; the rest bounds the bytes written and not yet sent.
COPY_SHARE = 0.5
#: From a source in a store, the part of ``--buffer-memory`` first set aside for the source rows fetched and
#: not yet spliced (`reshard.storage.objectstore.window.RangeWindow`); the rest is split as above. The share
#: grows to hold the rows of this worker's largest target item and their slack (a job's rows are fetched
#: whole before it runs), up to half the buffer.
READ_SHARE = 0.25
#: What the read share holds beyond the rows of one item: a block of rounding at each end of a range and
#: the heads and tails of the items being located (`reshard.storage.objectstore.window.LOCATING`).
READ_SLACK = 1 << 20


@dataclass
class StreamedStoreOutput(DistributedOutput):
    """One worker's part of a conversion streamed into the store at ``url`` (module docstring).
    ``dst`` is unused but for messages; ``window`` the ``--buffer-memory`` bytes."""

    window: int = 256 << 20
    _stage: Any = field(default=None, init=False, repr=False)
    _publisher: Any = field(default=None, init=False, repr=False)
    _streamer: Any = field(default=None, init=False, repr=False)
    _objects: list[dict[str, Any]] = field(default_factory=list, init=False, repr=False)
    _resumable: dict[str, list[dict[str, Any]]] = field(default_factory=dict, init=False, repr=False)
    _spill: Optional[Path] = field(default=None, init=False, repr=False)
    _peaks: list[dict[str, Any]] = field(default_factory=list, init=False, repr=False)
    _checked_store: int = 0
    _listed: dict[str, dict[str, Any]] = field(default_factory=dict, init=False, repr=False)
    _unspliced: list[tuple[str, int, bytes]] = field(default_factory=list, init=False, repr=False)

    # -- the whole run: worker 0 holds the destination -------------------------------------------
    def around(self, plan: Any, source: Any, convert: Callable[[Output], Optional[dict[str, Any]]]) -> Optional[dict[str, Any]]:
        from reshard.storage.objectstore import upload

        c = self.collective
        with contextlib.ExitStack() as stack:
            def open_destination() -> bool:  # the lock and the foreign check; nothing is put yet
                self._stage = stack.enter_context(upload.staged_output(self.url, overwrite=self.overwrite))
                self._publisher = upload.Publisher(self._stage)
                return True

            c.from_lead("opening the destination", open_destination)
            return convert(self)

    def _prepare(self, plan: Any) -> dict[str, list[dict[str, Any]]]:
        """Worker 0, once the plan is known feasible and just before any byte is sent: the marker put and
        the output's data objects claimed (`_claim`)."""
        self._publisher.begin()
        return self._claim(plan)

    def _claim(self, plan: Any) -> dict[str, list[dict[str, Any]]]:
        """Worker 0: every data object of this output recorded as this machine's before any is put, and
        the unfinished multipart uploads of those names (to continue); those of other names are not ours."""
        from reshard.storage.checkpoints.dcp_writer import data_file_name
        from reshard.storage.objectstore.stream import uploads_to_continue

        names = [data_file_name(r) for r in target_ranks(plan)]
        with open(self._stage.uploads, "a") as log:
            for n in names:
                log.write(json.dumps({"name": n, "intent": True}) + "\n")
            log.flush()
            os.fsync(log.fileno())
        fs, base = self._publisher.fs, self._publisher.base
        bucket, prefix = base.split("/", 1)
        recorded = self._stage.recorded()
        return uploads_to_continue(fs, bucket, prefix, {n for n in names if recorded.get(n)}, restart=self.restart)

    # -- the steps ---------------------------------------------------------------------------------
    def preflight(self, run: Run) -> dict[str, Any]:
        """Worker 0: the local disk its spill folder needs (about ``--buffer-memory``), unless ``force``;
        the output's own size is the store's to hold."""
        from reshard.errors import BadInput
        from reshard.storage.objectstore.upload import staging_root
        from reshard.units import human_bytes

        root = staging_root()
        while not root.exists() and root != root.parent:
            root = root.parent
        free = shutil.disk_usage(root).free
        if free < self.window and not self.force:
            raise BadInput(f"the local staging folder has {human_bytes(free)} free; each worker's spill folder needs "
                           f"about --buffer-memory ({human_bytes(self.window)})", where=str(staging_root()),
                           hint="Pass a smaller --buffer-memory, set RESHARD_STAGING_DIR to a folder with room, "
                                "or --force.")
        return {"needed_bytes": self.window, "free_bytes": free, "streamed": True,
                "basis": "streamed into the store: local disk per worker bounded by --buffer-memory"}

    def step(self, run: Run, name: str, fn: Callable[[], Any]) -> Any:
        if name == "commit":  # worker 0 alone comes this far (the others stop after the verification)
            return self._commit(run)
        return super().step(run, name, fn)

    @contextlib.contextmanager
    def staging(self, run: Run) -> Iterator[Path]:
        """Each worker's spill folder on its own machine, emptied first (a killed run's is of no use:
        what it sent is in the store) and removed at the end."""
        from reshard.storage.objectstore import upload

        spill = upload.stage_folder(self.url) / f"spill-{self.collective.rank}"
        reads = spill.parent / f"reads-{self.collective.rank}"  # a store source's read window (`write`)
        for folder in (spill, reads):
            shutil.rmtree(folder, ignore_errors=True)
        spill.mkdir(parents=True)
        self._spill = spill
        try:
            yield spill
        finally:
            if self._streamer is not None and self._streamer.thread.is_alive():
                self._streamer.stop()
            for folder in (spill, reads):
                shutil.rmtree(folder, ignore_errors=True)

    def write(self, run: Run) -> None:
        """2. each worker writes and streams its files; 3. worker 0 checks the split storages and the
        store's listing, then writes `.metadata`."""
        from dataclasses import replace

        from reshard.engine.copy import write_items
        from reshard.engine.pipeline import writing_bytes
        from reshard.render.progress import phase_of
        from reshard.storage.checkpoints.dcp_writer import DcpWriter
        from reshard.storage.files.atomic import fault_point
        from reshard.storage.objectstore import upload
        from reshard.storage.objectstore.stream import SpillStreamer, part_size_for
        from reshard.engine.distributed import check_split_storages

        c = self.collective
        self._resumable = c.from_lead("preparing the destination", lambda: self._prepare(run.plan), own=run.own)
        # a source in a store: only the byte ranges this worker's files are cut from, fetched into sparse files
        # beside its spill folder and punched once spliced, within a share of --buffer-memory (`RangeWindow`)
        remote = getattr(run.ix, "remote", None)
        read_window = 0
        if remote is not None:
            read_window = min(self.window // 2, max(int(self.window * READ_SHARE),
                                                    _largest_item(run.plan, self._owns) + READ_SLACK))
        fs, base = upload.destination(self.url)
        bucket, prefix = base.split("/", 1)
        mine = [r for r in target_ranks(run.plan) if self._owns(r)]
        largest = file_bytes_bound(run.plan, run.ix)
        copy_window = max(1 << 20, int((self.window - read_window) * COPY_SHARE))
        budget = self.window - read_window - copy_window
        part = part_size_for(budget, len(mine), largest)
        self._streamer = streamer = SpillStreamer(fs, bucket, prefix, run.tmp, part=part, budget=budget,
                                                  resume_from=self._resumable, on_part=fault_point)
        self._writer = w = DcpWriter(run.tmp, owned=self._owns, observer=streamer)
        streamer.checksum_of = w.checksum_of  # read when an item's last byte is sent, after the writer filled it
        io = replace(self.io, window=copy_window, ahead=copy_window, read_window=read_window,
                     read_folder=run.tmp.parent / f"reads-{c.rank}" if remote is not None else None)

        def own_files() -> dict[str, Any]:
            try:
                with phase_of(run.progress, self.phase, writing_bytes(run.plan, run.ix)) as bar:
                    write_items(run.plan, run.ix, w, bar, io=io, commit=False, checked=self._checked)
                w.sync_files()
                objects = streamer.finish()
                unspliced = streamer.unspliced()
                streamer.close_readers()
            except BaseException:
                streamer.stop()
                w.close()
                raise
            return {"checksums": w.checksums(), "split": _named_in_store(self._checked.ledger.partial(), remote),
                    "objects": [o.to_dict() for o in objects], "unspliced": unspliced,
                    "disk": {"peak_bytes": streamer.peak_disk, "kept_bytes": streamer.kept_on_disk,
                             "punched_bytes": streamer.punched, "most_unsent_bytes": streamer.most_unsent,
                             "part_bytes": part, "budget_bytes": budget,
                             "reads": _window_stats(remote)}}

        written = c.run("writing and sending its files", own_files, own=run.own)
        self._objects = [o for p in written for o in p["objects"]]
        self._unspliced = [u for p in written for u in p["unspliced"]]
        self._peaks = [dict(p["disk"], worker=i) for i, p in enumerate(written)]

        def metadata() -> dict[str, Any]:
            checked = check_split_storages([p["split"] for p in written],
                                           read=_store_crc(remote) if remote is not None else None)
            self._listed = upload.listing(fs, base, self.url)  # what was checked is what the commit records
            self._checked_store = _check_listing(self._listed, self.url, self._objects)
            merged: dict[str, str] = {}
            for p in written:
                merged.update(p["checksums"])
            w.adopt(merged)
            w.finish()
            return {"split": checked}

        if not c.lead:
            w.close()
        self._split_checked = c.from_lead("writing .metadata", metadata, own=run.own)["split"]
        self._checked.checked_elsewhere()  # the split storages are checked now, against the source's records

    def verify(self, run: Run) -> Optional[dict[str, Any]]:
        """4. worker 0's small files handed to every worker; each verifies its own files (module docstring)."""
        c = self.collective
        small = c.from_lead("sharing the metadata", lambda: _small_files(run.tmp))
        if not c.lead:
            for name, data in small.items():
                (run.tmp / name).parent.mkdir(parents=True, exist_ok=True)
                (run.tmp / name).write_bytes(data)
        _stand_ins(run.tmp, self._objects, self._unspliced)
        result = super().verify(run)
        if result is not None:
            result["sent"] = {"objects": len(self._objects),
                              "items_checked_as_sent": sum(o["items_checked"] for o in self._objects),
                              "objects_checked_by_etag": self._checked_store,
                              "note": "each item's bytes as sent to the store CRC-32'd against the bytes written; "
                                      "each object listed by the store with the size and ETag its worker sent"}
        return result

    def describe(self, run: Run, report: dict[str, Any]) -> None:
        super().describe(run, report)
        files = {o["name"]: o["size"] for o in sorted(self._objects, key=lambda o: o["name"])}
        report["files"] = files
        report["bytes_written"] = sum(files.values())
        report["streamed"] = {"workers": self._peaks,
                              "parts_sent": sum(o["parts_sent"] for o in self._objects),
                              "parts_kept_from_an_interrupted_upload": sum(o["parts_kept"] for o in self._objects),
                              "bytes_kept_from_an_interrupted_upload": sum(o["bytes_kept"] for o in self._objects)}

    def resume(self, run: Run) -> dict[str, Any]:
        """What this run kept of an interrupted upload (``resumed`` stays a local journal's word)."""
        from reshard.units import human_bytes

        kept = sum(o["parts_kept"] for o in self._objects)
        nbytes = sum(o["bytes_kept"] for o in self._objects)
        message = (f"resumed the upload: {kept} parts ({human_bytes(nbytes)}) an interrupted run had sent kept, each "
                   "proven by the MD5 of the bytes this run would send in its place" if self._resumable else None)
        return {"resumed": False, "upload_resumed": bool(self._resumable), "parts_kept": kept, "bytes_kept": nbytes,
                "message": message}

    # -- 5. the commit ---------------------------------------------------------------------------
    def _commit(self, run: Run) -> None:
        """Worker 0: every file but the data objects (sent by their workers) put, `.metadata` last, the
        objects of an earlier output (``--overwrite``) this one does not have deleted, the marker removed
        (`upload.Publisher.finish`); each data object recorded with the ETag the store listed."""
        from reshard.engine.distributed import launcher_alive
        from reshard.errors import ReshardError
        from reshard.storage.objectstore.remote import version_tag

        if not launcher_alive():
            raise ReshardError("the command that started these workers has died; nothing was committed",
                               where=self.url, hint="Run the conversion again.")
        pub = self._publisher
        with open(self._stage.uploads, "a") as log:
            for o in self._objects:
                log.write(json.dumps({"name": o["name"], "size": o["size"], "crc32": o["crc32"],
                                      "tag": version_tag(self._listed[o["name"]])}) + "\n")
        # as a single process's upload ends: an earlier output's objects this one lacks deleted, `.metadata` last
        pub.finish(run.tmp, sent_elsewhere=[o["name"] for o in self._objects])


def _largest_item(plan: Any, owns: Callable[[int], bool]) -> int:
    """Bytes of the largest tensor item a worker that ``owns`` these target ranks writes (the rows a splice job reads)."""
    from math import prod

    from reshard.model.dtypes import dtype_named

    return max((dtype_named(t.dtype).itemsize * prod(sizes) for t in plan.tensors
                for rank, _offsets, sizes in t.chunks if owns(rank)), default=0)


def _check_listing(listed: dict[str, dict[str, Any]], url: str, objects: list[dict[str, Any]]) -> int:
    """Every object the workers reported, in the store's ``listed`` entries with its size and the ETag of
    the parts sent; how many were checked by ETag (an ETag that is not an MD5 form cannot be)."""
    from reshard.errors import BadInput
    from reshard.storage.objectstore.upload import etag_verdict

    checked = 0
    for o in objects:
        info = listed.get(o["name"])
        if info is None or int(info.get("size") or -1) != o["size"]:
            raise BadInput(f"the store lists '{o['name']}' " + ("not at all" if info is None else
                           f"with {info.get('size')} bytes, not the {o['size']} sent"), where=f"{url}/{o['name']}",
                           hint="Nothing was committed; run the same command again.")
        same = etag_verdict([bytes.fromhex(d) for d in o["digests"]], o["multipart"], info)
        if same is False:
            raise BadInput(f"the store holds other bytes for '{o['name']}' than were sent (its ETag differs)",
                           where=f"{url}/{o['name']}", hint="Nothing was committed; run the same command again.")
        checked += same is True
    return checked


def _stand_ins(folder: Path, objects: list[dict[str, Any]], unspliced: list[tuple[str, int, bytes]]) -> None:
    """The other workers' data files, as sparse files of their size holding only the items their
    writers wrote themselves (objects, rewritten values): every worker's verification compares
    objects in full, and tensor values only in its own files (whose spliced parts were checked as
    written and as sent)."""
    for o in objects:
        path = folder / o["name"]
        if path.exists():
            continue
        with open(path, "wb") as f:
            f.truncate(o["size"])
            for name, off, data in unspliced:
                if name == o["name"]:
                    f.seek(off)
                    f.write(data)


def _small_files(folder: Path) -> dict[str, bytes]:
    """Worker 0's files but the data: `.metadata`, the manifest, the sidecars (what a verification reads)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.is_symlink() and not p.name.endswith(".distcp")}


def _window_stats(remote: Any) -> Optional[dict[str, Any]]:
    """What this worker's read window fetched and held (None from a local source): its budget, the
    most bytes on local disk at once, the bytes and ranged requests fetched."""
    if remote is None or not remote.counters.windows:
        return None
    return dict(remote.counters.windows[-1])


def _named_in_store(split: list[tuple[Any, list[tuple[int, int, int]]]], remote: Any) -> list[tuple[Any, list]]:
    """A worker's storages read in part, named by their objects in the store rather than by this worker's
    local read window (whose folder is its own), so that worker 0 combines every worker's pieces of one
    storage (`check_split_storages`); unchanged from a local source (one path for every worker)."""
    if remote is None:
        return split
    from dataclasses import replace

    return [(replace(rec, path=remote.where(Path(rec.path).name)), pieces) for rec, pieces in split]


def _store_crc(remote: Any) -> Callable[[Any, int, int], int]:
    """The CRC-32 of ``nbytes`` of a storage at ``offset``, read from its object in the store by ranges
    (what no worker's pieces covered; `check_split_storages`)."""
    from reshard.storage.files.fileio import crc32

    def crc_of(rec: Any, offset: int, nbytes: int) -> int:
        name, crc, done = rec.path.rsplit("/", 1)[-1], 0, 0
        while done < nbytes:
            n = min(8 << 20, nbytes - done)
            crc = crc32(remote.read_range(name, rec.at + offset + done, n, key=rec.key), crc)
            done += n
        return crc

    return crc_of
