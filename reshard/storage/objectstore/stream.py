"""Data files streamed into a store while they are written: multipart uploads that follow the writer.

Why: a checkpoint of terabytes converted by many workers cannot be staged whole on local disk
and uploaded afterwards (`reshard.storage.objectstore.upload.Publisher` does that for one
machine). Here each data file a worker owns is written, as ever, by
`reshard.storage.checkpoints.dcp_writer.DcpWriter` into a local *spill* file; this module watches
the writer (`SpillStreamer` is its observer: items reserved, items filled) and, as soon as a part's
worth of the file's prefix is final (every item before that point filled), reads that part back,
checks it, sends it as one part of the file's multipart upload and punches the part out of the
spill file (``fallocate(PUNCH_HOLE)``), so local disk holds only what is written and not yet sent.
When unsent bytes exceed the budget the writer waits (`SpillStreamer.filled` blocks while the
sender has parts to send), so peak local disk stays near the budget whatever the checkpoint's size.

What each part is checked against, before it leaves: every item it ends is CRC-32'd over the bytes
read back from the spill file (the bytes sent) and compared with the CRC-32 the writer recorded as
it wrote them (`DcpWriter.checksums`, itself checked against the source items' records by the
copy); the gaps between items must read as zeros. The MD5 of every part is kept, so the ETag the
store computes for the object can be checked (`reshard.storage.objectstore.upload.etag_verdict`).

Parts holding an item that was not spliced (objects, rewritten values, transformed tensors) are sent
but kept on disk: the conversion's verification reads those items from the spill file afterwards.

Resuming: a killed run leaves unfinished multipart uploads. `SpillStreamer` continues the most recent
one of each object it is handed (`resume_from`): a part the store already holds is kept only when
its size and its ETag (the MD5 the store computed) equal those of the bytes this run would send in
its place, computed now; otherwise it is sent again. Nothing else is trusted.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

__all__ = ["MIN_PART", "StreamedObject", "SpillStreamer", "part_size_for", "punch_hole", "unfinished_uploads",
           "abort_uploads", "uploads_to_continue"]

#: The smallest part a store takes (but for the last).
MIN_PART = 5 << 20
#: Items up to this size spliced into a file are kept aside as written (`SpillStreamer.unspliced`).
SMALL_ITEM = 16 << 10
#: Parts being sent at once by one worker.
IN_FLIGHT = 4
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_ALIGN = 1 << 20


def part_size_for(budget: int, files: int, largest_file: int) -> int:
    """The part size of a worker streaming ``files`` files within ``budget`` bytes of local disk:
    each file holds at most one part unsent (plus the parts in flight), so a part is about
    ``budget / (files + IN_FLIGHT)``, never under `MIN_PART` and large enough that 9,000 parts
    hold ``largest_file``; MiB-aligned so holes are punched whole."""
    want = max(MIN_PART, budget // max(1, files + IN_FLIGHT), -(-largest_file // 9000))
    return -(-want // _ALIGN) * _ALIGN


_libc: Any = None


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Free the disk blocks of ``[offset, offset + length)`` of ``fd`` (the file keeps its size and
    reads zeros there); False where the file system cannot."""
    global _libc
    if length <= 0:
        return True
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
        return _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) == 0
    except (OSError, AttributeError):
        return False


def unfinished_uploads(fs: Any, bucket: str, prefix: str) -> dict[str, list[dict[str, Any]]]:
    """The multipart uploads under ``prefix`` not completed nor aborted: key -> uploads, newest last."""
    from fsspec.asyn import sync

    out: dict[str, list[dict[str, Any]]] = {}
    kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
    while True:
        got = sync(fs.loop, fs._call_s3, "list_multipart_uploads", **kwargs)
        for u in got.get("Uploads", []) or []:
            out.setdefault(u["Key"], []).append(u)
        if not got.get("IsTruncated"):
            break
        kwargs.update(KeyMarker=got.get("NextKeyMarker"), UploadIdMarker=got.get("NextUploadIdMarker"))
    for uploads in out.values():
        uploads.sort(key=lambda u: str(u.get("Initiated", "")))
    return out


def abort_uploads(fs: Any, bucket: str, uploads: list[dict[str, Any]]) -> int:
    """Abort each of ``uploads`` (entries of `unfinished_uploads`); how many."""
    from fsspec.asyn import sync

    n = 0
    for u in uploads:
        try:
            sync(fs.loop, fs._call_s3, "abort_multipart_upload", Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
            n += 1
        except Exception:  # noqa: BLE001 - already gone: nothing of it is listed either way
            pass
    return n


def uploads_to_continue(fs: Any, bucket: str, prefix: str, ours: set[str], *,
                        restart: bool = False) -> dict[str, list[dict[str, Any]]]:
    """The unfinished multipart uploads under ``prefix`` of the object names ``ours`` (names under the
    prefix this machine recorded): key -> the newest one, to continue; every older one aborted, and with
    ``restart`` every one (none continued). Uploads of other names are not ours: left alone."""
    keep: dict[str, list[dict[str, Any]]] = {}
    for key, uploads in unfinished_uploads(fs, bucket, prefix + "/").items():
        if key[len(prefix) + 1:] not in ours:
            continue
        abort_uploads(fs, bucket, uploads if restart else uploads[:-1])
        if not restart:
            keep[key] = uploads[-1:]
    return keep


def _parts_of(fs: Any, bucket: str, key: str, upload_id: str) -> dict[int, dict[str, Any]]:
    """The parts an unfinished multipart upload holds: number -> {"ETag", "Size"}."""
    from fsspec.asyn import sync

    out: dict[int, dict[str, Any]] = {}
    kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key, "UploadId": upload_id}
    while True:
        got = sync(fs.loop, fs._call_s3, "list_parts", **kwargs)
        for p in got.get("Parts", []) or []:
            out[int(p["PartNumber"])] = {"ETag": str(p["ETag"]).strip('"').lower(), "Size": int(p["Size"])}
        if not got.get("IsTruncated"):
            return out
        kwargs["PartNumberMarker"] = got.get("NextPartNumberMarker")


@dataclass
class StreamedObject:
    """One data file streamed into the store: what was sent, as the worker reports it to the one that commits."""

    name: str
    size: int = 0
    digests: list[bytes] = field(default_factory=list)  # MD5 of each part, in order
    multipart: bool = True
    crc32: int = 0                  # of the whole object, as sent
    items_checked: int = 0          # items whose sent bytes' CRC-32 equals the writer's record
    parts_kept: int = 0             # parts an interrupted upload left, proven equal by their MD5 and kept
    bytes_kept: int = 0
    parts_sent: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "digests": [d.hex() for d in self.digests],
                "multipart": self.multipart, "crc32": self.crc32, "items_checked": self.items_checked,
                "parts_kept": self.parts_kept, "bytes_kept": self.bytes_kept, "parts_sent": self.parts_sent}


class _File:
    """One spill file and its upload: its items in offset order, the prefix sent so far."""

    def __init__(self, name: str, path: Path):
        self.name, self.path = name, path
        self.fd: Optional[int] = None
        self.items: list[list[int]] = []     # [offset, length, filled, spliced]
        self.next_item = 0                   # first item not yet known filled in order
        self.ready = 0                       # bytes from 0 that are final (every item before filled)
        self.queued = 0                      # bytes handed to the sender
        self.upload_id: Optional[str] = None
        self.old_parts: dict[int, dict[str, Any]] = {}
        self.done_parts: list[dict[str, Any]] = []
        self.obj = StreamedObject(name)
        self.check_item = 0                  # index of the item the sent-bytes check is in
        self.check_crc = 0
        self.closed = False
        self.declared = False                # its multipart upload declared CRC-32 (each part's checksum is sent)
        self.opened = False                  # its interrupted upload looked for (`SpillStreamer._open`)


class SpillStreamer:
    """The observer of a `DcpWriter` whose owned data files are streamed into ``bucket/prefix``.

    Thread model: the writer's callbacks (`reserved`, `filled`) come from the copy's threads; one
    sender thread reads parts back, checks them, puts them on the store's event loop (at most
    `IN_FLIGHT` at once) and punches them out. ``checksum_of(file, offset)`` gives the writer's CRC-32
    of an item, read when the item's last byte is sent. ``on_part(label)``: a hook the tests use to
    kill a worker at a chosen part."""

    def __init__(self, fs: Any, bucket: str, prefix: str, directory: Path, *, part: int, budget: Optional[int],
                 resume_from: Optional[dict[str, list[dict[str, Any]]]] = None, on_part: Any = None,
                 punch: bool = True, in_flight: int = IN_FLIGHT, before_upload: Optional[Callable[[str], None]] = None,
                 skip: frozenset[str] = frozenset()):
        self.fs, self.bucket, self.prefix, self.directory = fs, bucket, prefix.rstrip("/"), Path(directory)
        self.part, self.budget, self.on_part = part, budget, on_part
        #: False: the files stay whole on disk (a single process's stage, committed locally and verified
        #: there): parts are sent behind the writer but never punched, and the writer never waits
        #: (``budget`` None)
        self.punch, self.in_flight = punch, in_flight
        #: called with a file's name before the first request that may leave an object or an upload of it in
        #: the store (the caller records the name as its own first, so a rerun may replace it)
        self.before_upload = before_upload
        #: files not followed (an interrupted upload's object the caller may keep whole): never sent here
        self.skip = skip
        #: ``(file, offset)`` -> the writer's CRC-32 of that item (`DcpWriter.checksum_of`), set once the
        #: writer this streamer watches exists
        self.checksum_of: Callable[[str, int], Optional[str]] = lambda _file, _offset: None
        self.resume_from = resume_from or {}
        self.files: dict[str, _File] = {}
        self.cond = threading.Condition()
        self.queue: deque[tuple[_File, int, int, bool]] = deque()
        self.unsent = 0            # bytes written (or reserved and filled) and not yet sent and punched
        self.peak_disk = 0         # the most local disk the spill files held, measured (st_blocks)
        self.punched = 0           # bytes punched out of the spill files after they were sent
        self.most_unsent = 0
        self.kept_on_disk = 0      # bytes of parts not punched (they hold items read again by the verification)
        self.error: Optional[BaseException] = None
        self.small: list[tuple[str, int, bytes]] = []
        self.readers: dict[str, int] = {}
        self.stopped = False
        self.finishing = False
        self._flying = 0           # parts the sender has under way (read by the writer's wait)
        self.thread = threading.Thread(target=self._sender, name="reshard-stream", daemon=True)
        self.thread.start()

    # -- the writer's side ---------------------------------------------------------------------
    def reserved(self, file: str, offset: int, length: int) -> None:
        if file in self.skip:
            return
        with self.cond:
            f = self.files.get(file)
            if f is None:  # opened now (read and write: `punch_hole` needs it): a local commit may rename the folder
                f = self.files[file] = _File(file, self.directory / file)
                f.fd = os.open(f.path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
            f.items.append([offset, length, 0, 0])

    def filled(self, file: str, offset: int, length: int, spliced: bool) -> None:
        """An item's bytes are on disk: the file's final prefix may grow by parts; the caller waits
        while more than the budget is unsent and the sender has parts to send."""
        if file in self.skip:
            return
        with self.cond:
            self._raise()
            f = self.files[file]
            for it in f.items[f.next_item:]:  # most often the next one; a few back at most
                if it[0] == offset:
                    it[2], it[3] = 1, int(spliced)
                    break
            else:
                return
            if self.punch and spliced and length <= SMALL_ITEM:  # read by every worker's verification: kept aside
                self.small.append((file, offset, os.pread(self._reader(f), length, offset)))
            self.unsent += length
            self.most_unsent = max(self.most_unsent, self.unsent)
            while f.next_item < len(f.items) and f.items[f.next_item][2]:
                f.next_item += 1
            f.ready = f.items[f.next_item][0] if f.next_item < len(f.items) else f.items[-1][0] + f.items[-1][1]
            while f.ready - f.queued >= self.part:
                self.queue.append((f, f.queued, f.queued + self.part, False))
                f.queued += self.part
            self.cond.notify_all()
            while (self.budget is not None and self.unsent > self.budget and (self.queue or self._flying)
                   and not self.error and not self.stopped):
                self.cond.wait(0.5)
            self._raise()

    def _reader(self, f: _File) -> int:
        fd = self.readers.get(f.name)
        if fd is None:
            fd = self.readers[f.name] = os.open(f.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        return fd

    # -- the end ---------------------------------------------------------------------------------
    def finish(self) -> list[StreamedObject]:
        """Every item is written: each file's last part sent, its upload completed; what was sent, by file."""
        with self.cond:
            self._raise()
            for f in self.files.values():
                end = f.items[-1][0] + f.items[-1][1] if f.items else 0
                if f.next_item != len(f.items):
                    raise RuntimeError(f"{f.name}: an item was never filled")
                self.queue.append((f, f.queued, end, True))
                f.queued = end
            self.finishing = True
            self.cond.notify_all()
            while (self.queue or self._flying or any(not f.closed for f in self.files.values())) and not self.error:
                self.cond.wait(0.5)
            self._raise()
        return [f.obj for _n, f in sorted(self.files.items())]

    def close_readers(self) -> None:
        for fd in self.readers.values():
            os.close(fd)
        self.readers.clear()

    def unspliced(self) -> list[tuple[str, int, bytes]]:
        """The items the writer wrote itself (objects, rewritten values, transformed tensors), read from
        the spill files (never punched), and the small items kept aside as they were written:
        ``(file, offset, bytes)``. The other workers' verifications read the objects and small
        items (step counters) of this worker's files from them."""
        out = list(self.small)
        for name, f in sorted(self.files.items()):
            out.extend((name, it[0], os.pread(self._reader(f), it[1], it[0])) for it in f.items if not it[3])
        return out

    def stop(self) -> None:
        """The run failed: no part more is sent; this run's unfinished uploads are left for the rerun
        (it keeps the parts it proves and aborts the rest)."""
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        self.thread.join(timeout=60)
        self.close_readers()
        for f in self.files.values():
            if f.fd is not None:
                os.close(f.fd)
                f.fd = None

    # -- the sender ------------------------------------------------------------------------------
    def _raise(self) -> None:
        """The sender's error, on the writer's thread: the store's own errors in one paragraph naming the prefix."""
        if self.error is None:
            return
        from reshard.errors import BadInput, ReshardError

        if isinstance(self.error, (ReshardError, OSError)):
            raise self.error
        raise BadInput(f"the upload failed: {type(self.error).__name__}: {self.error}",
                       where=f"s3://{self.bucket}/{self.prefix}",
                       hint="Nothing is committed there; run the same command again (it resumes).") from self.error

    def _sender(self) -> None:
        flying: deque[tuple[_File, int, int, Any, bool, int, str]] = deque()
        try:
            while True:
                with self.cond:
                    self._flying = len(flying)
                    self.cond.notify_all()
                    while not self.queue and not flying and not self.stopped:
                        if self.finishing and all(f.closed for f in self.files.values()):
                            return
                        self.cond.wait(0.5)
                    if self.stopped:
                        return
                    job = self.queue.popleft() if self.queue and len(flying) < self.in_flight else None
                    self._flying = len(flying) + (job is not None)
                if job is not None:
                    f, start, end, last = job
                    got = self._send(f, start, end, last)
                    if got is not None:
                        flying.append(got)
                    elif last:  # nothing more to send of it: completed once its parts in flight have landed
                        while any(fl[0] is f for fl in flying):
                            self._landed(*flying.popleft())
                        self._complete(f)
                    continue
                fl = flying.popleft()
                self._landed(*fl)
        except BaseException as exc:  # noqa: BLE001 - raised on the writer's thread
            with self.cond:
                self.error = exc if isinstance(exc, Exception) else RuntimeError(str(exc))
                self.cond.notify_all()
        finally:
            with self.cond:
                self._flying = 0
                self.cond.notify_all()

    def _open(self, f: _File) -> None:
        """Before ``f``'s first part: the upload an interrupted run left of it, to continue."""
        if not f.opened:
            f.opened = True
            key = f"{self.prefix}/{f.name}"
            earlier = self.resume_from.get(key)
            if earlier:
                f.upload_id = earlier[-1]["UploadId"]
                f.declared = earlier[-1].get("ChecksumAlgorithm") == "CRC32"
                try:
                    f.old_parts = _parts_of(self.fs, self.bucket, key, f.upload_id)
                except Exception:  # noqa: BLE001 - gone meanwhile: a new upload
                    f.upload_id, f.old_parts = None, {}

    def _upload_id(self, f: _File) -> str:
        from fsspec.asyn import sync

        if f.upload_id is None:
            if self.before_upload is not None:
                self.before_upload(f.name)
            # declared CRC-32, as each part's checksum is (`upload.crc_header`): the store keeps the parts' CRC-32s
            # rather than hashing the whole object again at the completion with an algorithm of its choosing
            f.upload_id = sync(self.fs.loop, self.fs._call_s3, "create_multipart_upload", Bucket=self.bucket,
                               Key=f"{self.prefix}/{f.name}", ChecksumAlgorithm="CRC32")["UploadId"]
            f.declared = True
        return f.upload_id

    def _check_sent(self, f: _File, start: int, data: memoryview) -> None:
        """Each item the bytes ``data`` (at ``start`` of the file) end: the CRC-32 of its bytes as sent
        equals the writer's record; gaps between items read as zeros."""
        from reshard.storage.files.fileio import crc32

        end = start + len(data)
        pos = start
        while pos < end and f.check_item < len(f.items):
            off, length = f.items[f.check_item][0], f.items[f.check_item][1]
            if pos < off:  # a gap before an aligned item: zeros
                upto = min(off, end)
                if any(data[pos - start:upto - start]):
                    raise ValueError(f"{f.name}: bytes between items at {pos} are not zeros as sent")
                pos = upto
                continue
            upto = min(off + length, end)
            f.check_crc = crc32(data[pos - start:upto - start], f.check_crc)
            pos = upto
            if pos == off + length:
                want = self.checksum_of(f.name, off)
                if want is None or int(want, 16) != f.check_crc & 0xFFFFFFFF:
                    raise ValueError(f"{f.name}: the item at {off} sent with CRC-32 {f.check_crc & 0xFFFFFFFF:08x}, "
                                     f"written with {want}")
                f.obj.items_checked += 1
                f.check_item += 1
                f.check_crc = 0

    def _send(self, f: _File, start: int, end: int, last: bool):
        import asyncio

        from fsspec.asyn import sync

        from reshard.storage.files.fileio import crc32

        from reshard.storage.checkpoints.archive import crc32_combine
        from reshard.storage.objectstore.upload import crc_header

        self._open(f)
        body = os.pread(f.fd, end - start, start) if end > start else b""
        data = memoryview(body)
        if len(data) != end - start:
            raise OSError(f"{f.path}: read {len(data)} of {end - start} bytes at {start}")
        self._check_sent(f, start, data)
        part_crc = crc32(data)  # the part's, for its request; the object's composed from it (no second pass)
        f.obj.crc32 = crc32_combine(f.obj.crc32, part_crc, len(data))
        f.obj.size = end
        said = crc_header(part_crc)
        if last and not f.obj.digests and end <= self.part and not f.old_parts:  # a small file: one PUT
            f.obj.multipart = False
            f.obj.digests.append(hashlib.md5(data).digest())
            if self.before_upload is not None:
                self.before_upload(f.name)
            sync(self.fs.loop, self.fs._call_s3, "put_object", Bucket=self.bucket, Key=f"{self.prefix}/{f.name}",
                 Body=body, **said)
            f.obj.parts_sent += 1
            self._sent(f, start, end, punch=False)
            return None
        if end == start and f.obj.digests:  # nothing after the last full part
            return None
        md5 = hashlib.md5(data).digest()
        f.obj.digests.append(md5)
        number = len(f.obj.digests)
        old = f.old_parts.get(number)
        if old is not None and old["Size"] == len(data) and old["ETag"] == md5.hex():
            f.done_parts.append({"PartNumber": number, "ETag": '"' + md5.hex() + '"', "ChecksumCRC32": said["ChecksumCRC32"]})
            f.obj.parts_kept += 1
            f.obj.bytes_kept += len(data)
            self._sent(f, start, end, punch=not last)
            return None
        upload_id = self._upload_id(f)
        fut = asyncio.run_coroutine_threadsafe(
            self.fs._call_s3("upload_part", Bucket=self.bucket, Key=f"{self.prefix}/{f.name}", UploadId=upload_id,
                             PartNumber=number, Body=body, **(said if f.declared else {})), self.fs.loop)
        del body, data
        return (f, start, end, fut, last, number, said["ChecksumCRC32"])

    def _landed(self, f: _File, start: int, end: int, fut: Any, last: bool, number: int, sent_crc: str) -> None:
        got = fut.result()
        f.done_parts.append({"PartNumber": number, "ETag": got["ETag"], "ChecksumCRC32": got.get("ChecksumCRC32") or sent_crc})
        f.obj.parts_sent += 1
        if self.on_part is not None:
            self.on_part(f"part {f.name} {number}")
        self._sent(f, start, end, punch=not last)
        if last:
            self._complete(f)

    def _complete(self, f: _File) -> None:
        from fsspec.asyn import sync

        if f.obj.multipart and f.upload_id is not None:
            parts = sorted(({k: v for k, v in p.items() if k != "ChecksumCRC32" or f.declared} for p in f.done_parts),
                           key=lambda p: p["PartNumber"])
            sync(self.fs.loop, self.fs._call_s3, "complete_multipart_upload", Bucket=self.bucket,
                 Key=f"{self.prefix}/{f.name}", UploadId=f.upload_id, MultipartUpload={"Parts": parts})
        if f.fd is not None:
            os.close(f.fd)
            f.fd = None
        with self.cond:
            f.closed = True
            self.cond.notify_all()

    def _sent(self, f: _File, start: int, end: int, *, punch: bool) -> None:
        """Part ``[start, end)`` is in the store: punched out of the spill file unless an item in it is
        read again by the verification (not spliced), or the files stay whole (``punch`` False)."""
        keep = any(not it[3] for it in f.items if it[0] < end and it[0] + it[1] > start)
        if self.punch:
            disk = self._disk()
            with self.cond:
                self.peak_disk = max(self.peak_disk, disk)
        punch = punch and self.punch
        if punch and not keep:
            if punch_hole(f.fd, start, end - start):
                self.punched += end - start
        elif keep:
            self.kept_on_disk += end - start
        with self.cond:
            self.unsent -= sum(min(end, it[0] + it[1]) - max(start, it[0])
                               for it in f.items if it[0] < end and it[0] + it[1] > start)
            self.cond.notify_all()

    def _disk(self) -> int:
        """Bytes the spill files hold on disk now (their allocated blocks)."""
        total = 0
        for f in list(self.files.values()):
            try:
                total += os.stat(f.path).st_blocks * 512
            except OSError:
                pass
        return total

    _sampled: float = 0.0

    def sample(self) -> None:
        """Measure the spill files' disk now, at most every 20 ms (the writer calls it as items are filled)."""
        import time

        now = time.monotonic()
        if now - self._sampled < 0.02:
            return
        self._sampled = now
        disk = self._disk()
        with self.cond:
            self.peak_disk = max(self.peak_disk, disk)
