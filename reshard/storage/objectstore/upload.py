"""Outputs bound for object storage: made in a local stage, then published in DCP's commit order.

Why a module of its own: `reshard.storage.objectstore.remote` reads a checkpoint in a store by byte range;
this module writes one there, which a store without rename makes a different problem. The
output is made and verified in a local folder per destination URL (`Stage`, under
`staging_root`), then uploaded by `publish`: a marker object first, the data objects, the
other files, the files a loader opens first last (`ENTRY_FILES`: `.metadata`), the marker
removed. Each object is checked by the ETag the store computed (`etag_matches`) and recorded,
so a killed upload resumes by sending only what the store does not hold as recorded.
``--overwrite`` replaces only a checkpoint or an earlier reshard output, by the rule of
`formats/replaceable.toml` applied to the listing.

fsspec (and the store's filesystem, s3fs) come with the optional ``s3`` extra, imported only
when a URL is opened (`reshard.storage.objectstore.remote.no_fsspec` words the error otherwise).
"""
from __future__ import annotations

import os
import re
import shutil
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator

from reshard import safefs
from reshard.errors import BadInput, Incomplete, ReshardError
from reshard.storage.objectstore.remote import DATA_SUFFIX, METADATA_FILE, Counters, check_key_tail, open_store, store_error, version_tag

__all__ = ["destination", "listing", "UPLOAD_MARKER", "STAGING_ENV", "PROBE_PREFIX", "ENTRY_FILES", "Stage", "Published", "staging_root",
           "stage_folder", "staged_output", "committed_at", "timed_put", "tree_bytes", "upload_order", "etag_matches",
           "etag_verdict", "part_bytes", "crc_header", "Sent", "Publisher", "publish"]


#: Written first under a destination prefix and removed after `.metadata`: the prefix holds an
#: upload by reshard that may be unfinished, which a rerun may replace (nothing else it may).
UPLOAD_MARKER = ".reshard-uploading"

#: The destinations opened in this process, by URL and the environment that configures a store's client:
#: one client per destination rather than one per step (each costs its service model loaded and an
#: SSL context made: about 0.3 s of CPU; a forked child opens its own). Only destinations: a source's client is its own (its pin).
_DESTINATIONS: dict[tuple[str, ...], tuple[Any, str]] = {}
_DESTINATIONS_LOCK = threading.Lock()


def _open_destination(url: str) -> tuple[Any, str]:
    """The destination's filesystem and ``bucket/prefix``, by the one URL rule and with the store's bounds
    (`open_store`), opened once per process and configuration (`_DESTINATIONS`)."""
    ident = (str(os.getpid()), url.rstrip("/"), *sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith(("AWS_", "RESHARD_STORE_"))))
    with _DESTINATIONS_LOCK:
        got = _DESTINATIONS.get(ident)
        if got is None:
            got = _DESTINATIONS[ident] = _opened_destination(url)
    return got


def destination(url: str) -> tuple[Any, str]:
    """The destination's filesystem and ``bucket/prefix`` (opened once per process): for the uploads
    that do not go through a `Publisher` (`reshard.storage.objectstore.stream`)."""
    return _open_destination(url)


def _opened_destination(url: str) -> tuple[Any, str]:
    try:
        fs, base, _parsed, _limits = open_store(url, what="destination URL")
    except BadInput as exc:
        if "whole bucket" in exc.message:
            raise BadInput("an output is a prefix inside a bucket, not a whole bucket", where=exc.where,
                           hint="Give s3://bucket/prefix.") from None
        raise
    return fs, base


def listing(fs: Any, base: str, url: str) -> dict[str, dict[str, Any]]:
    """Every object under the destination prefix now (key tail -> its listing entry), fresh from the store."""
    try:
        fs.invalidate_cache(base)
        found = fs.find(base, detail=True)
    except FileNotFoundError:
        return {}
    except Exception as exc:  # noqa: BLE001 - the store's errors, in one paragraph
        raise store_error(exc, doing="cannot list the destination", where=url,
                          hint="Check the URL, the endpoint and the credentials' rights to list and write there.") from None
    return {p[len(base) + 1:]: info for p, info in sorted(found.items()) if p.startswith(base + "/")}


#: Where outputs bound for a store are made first (one folder per destination URL), unless set.
STAGING_ENV = "RESHARD_STAGING_DIR"


def staging_root() -> Path:
    """``$RESHARD_STAGING_DIR``, else the user's cache (``$XDG_CACHE_HOME`` or ``~/.cache``) ``/reshard/staging``."""
    given = os.environ.get(STAGING_ENV)
    if given:
        return Path(given)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "reshard" / "staging"


@dataclass
class Stage:
    """The local side of an output bound for a store: ``out`` (the conversion's local output,
    written by `atomic_directory` with its resumable temporaries and journal beside it), what
    the committed conversion recorded (``converted.json``: its resume key and report) and what
    the upload has sent (``uploaded.jsonl``). It lives in one folder per destination URL under
    `staging_root`, so a killed run's work waits for the same command, as beside a local
    destination; it is removed once the output is committed in the store."""

    url: str
    folder: Path
    #: Objects under the prefix that ``--overwrite`` checked as replaceable (`_check_replaceable`)
    #: before this run began: with the objects this machine's record names, all `publish` may delete.
    replaceable: frozenset[str] = frozenset()

    @property
    def out(self) -> Path:
        return self.folder / "out"

    @property
    def uploads(self) -> Path:
        return self.folder / "uploaded.jsonl"

    @property
    def probes(self) -> Path:
        return self.folder / "probes.jsonl"

    def recorded(self) -> dict[str, dict[str, Any]]:
        """What this machine's uploads to the URL recorded, by object name, the last line winning:
        ``{"name", "intent": True}`` written before an object is put (a kill between the put and its
        record leaves the object ours), then its size, times, CRC-32 and the ETag the store gave
        it; the marker's line (`UPLOAD_MARKER`) with its ETag; and each probe (`timed_put`)."""
        import json

        out: dict[str, dict[str, Any]] = {}
        for path in (self.uploads, self.probes):
            try:
                lines = path.read_text().splitlines() if path.is_file() else []
            except (OSError, UnicodeDecodeError):
                lines = []
            for line in lines:
                try:
                    r = json.loads(line)
                    out[str(r["name"])] = r
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut by the kill
        return out

    def foreign(self, there: dict[str, dict[str, Any]]) -> list[str]:
        """The objects listed under the prefix that are not this machine's to replace: neither named
        by its record (with the marker's ETag as recorded, when the marker is there) nor checked by
        ``--overwrite``. An upload marker no record of this machine matches makes everything foreign:
        it is someone else's unfinished upload, or a planted name."""
        mine = self.recorded()
        marker = there.get(UPLOAD_MARKER)
        said = mine.get(UPLOAD_MARKER, {})  # intent alone: killed between the put and its record
        ours_marker = marker is not None and bool(said) and said.get("tag") in (None, version_tag(marker))
        keep = set(self.replaceable)
        if marker is None or ours_marker:
            keep |= set(mine)
        return sorted(t for t in there if t not in keep)

    def converted(self) -> dict[str, Any] | None:
        """What the committed local conversion recorded (``key``, ``report``), or None (none committed)."""
        p = self.folder / "converted.json"
        if not (self.out / METADATA_FILE).is_file() or not p.is_file():
            return None
        try:
            got = safefs.read_json(p, root=self.folder, what="staged conversion record", limit=256 << 20)
        except (ReshardError, OSError, ValueError):
            return None
        return got if isinstance(got, dict) and {"key", "report"} <= got.keys() else None

    def record_converted(self, key: dict[str, Any], report: dict[str, Any]) -> None:
        """After the local commit: what a rerun compares its own resume key with before it uploads this output again."""
        import json

        tmp = self.folder / "converted.json.tmp"
        tmp.write_text(json.dumps({"key": key, "report": report}))
        os.replace(tmp, self.folder / "converted.json")

    def discard_output(self) -> None:
        """A committed local output this run does not take again: removed before a new one is made
        (the upload record stays: `publish` keeps an object only if the new file's bytes are the same)."""
        (self.folder / "converted.json").unlink(missing_ok=True)
        shutil.rmtree(self.out, ignore_errors=True)


#: Names of the objects `timed_put` writes and deletes under a destination prefix (a leftover of a
#: killed probe is one of reshard's own, replaced like an unfinished upload's).
PROBE_PREFIX = ".reshard-probe-"


def timed_put(url: str, data: bytes) -> float:
    """Seconds to put ``data`` as one probe object under the destination prefix ``url`` (then deleted):
    the store's upload rate, for the estimate a conversion bound for it prints first."""
    import secrets
    import time

    import json

    fs, base = _open_destination(url)
    name = f"{PROBE_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    key = f"{base}/{name}"
    stage = Stage(url.rstrip("/"), stage_folder(url))
    stage.folder.mkdir(parents=True, exist_ok=True)  # the probe is recorded before it is put: a kill leaves it ours
    with open(stage.probes, "a") as log:
        log.write(json.dumps({"name": name, "probe": True}) + "\n")
    try:
        t = time.perf_counter()
        fs.pipe_file(key, data)
        return time.perf_counter() - t
    finally:
        try:
            fs.rm_file(key)
        except Exception:  # noqa: BLE001 - a probe left behind is replaced by the upload (`staged_output`)
            pass


def tree_bytes(local: Path) -> int:
    """Bytes of every regular file under ``local`` (what `publish` sends at most)."""
    return sum(p.stat().st_size for p in local.rglob("*") if p.is_file())


def stage_folder(url: str) -> Path:
    """The local folder of the output bound for ``url`` (`staged_output`): one per destination URL."""
    import hashlib

    return staging_root() / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:20]


def committed_at(url: str) -> bool:
    """Whether ``url`` holds a committed output now: objects listed and no upload marker among them
    (`publish` removes it after the last object, `.metadata` for DCP)."""
    fs, base = _open_destination(url)
    probes = {k for k, r in Stage(url.rstrip("/"), stage_folder(url)).recorded().items() if r.get("probe")}
    listed = {k for k in listing(fs, base, url) if k not in probes}
    return bool(listed) and UPLOAD_MARKER not in listed


def _names(tails: list[str], most: int = 8) -> str:
    return ", ".join(tails[:most]) + (f" and {len(tails) - most} more" if len(tails) > most else "")


def _check_replaceable(fs: Any, base: str, url: str, there: dict[str, dict[str, Any]]) -> None:
    """``--overwrite`` into a store: what the prefix holds must be a checkpoint or an earlier reshard
    output by `formats/replaceable.toml`'s rule (`replaceable.survey_listing`, each anchor's first
    bytes fetched), or nothing is replaced."""
    from reshard.storage.files.replaceable import survey_listing

    def head(tail: str) -> bytes:
        try:
            return fs.cat_file(f"{base}/{tail}", start=0, end=min(64, int(there[tail].get("size") or 0)))
        except Exception:  # noqa: BLE001 - unreadable: not recognised as what its name says
            return b""

    found = survey_listing([t for t in there if t != UPLOAD_MARKER], head, url)
    if not found.replaceable:
        raise BadInput(f"--overwrite refuses to replace what the prefix holds: {found.describe()}", where=url,
                       hint="Choose another prefix, or remove those objects yourself.")


@contextmanager
def staged_output(url: str, *, overwrite: bool = False) -> Iterator[Stage]:
    """The `Stage` of an output that `publish` uploads to ``url``, after checking that the
    destination takes it: an empty prefix, or the leftovers of an upload by reshard that never
    committed (`UPLOAD_MARKER` present), or with ``overwrite`` a checkpoint or an earlier reshard
    output (`_check_replaceable`), which `publish` then replaces: not atomically, as no store
    can rename a prefix, but never showing a mix: its `.metadata` (and an export's index and
    config) are deleted first, so no loader takes it while the new objects arrive, and the new
    `.metadata` is put last. One run at a time per destination (a lock in its folder). What runs in the stage is
    handed `Stage.url`, so its reports name the URL (no registry to look the folder up in). The folder is
    removed when the block ends with the output committed in the store (`.metadata` there and
    no marker), and kept otherwise, for the same command to resume."""
    import fcntl

    fs, base = _open_destination(url)
    url = url.rstrip("/")
    folder = stage_folder(url)
    there = listing(fs, base, url)
    foreign = Stage(url, folder).foreign(there)
    if foreign and not overwrite:
        if UPLOAD_MARKER in foreign:
            raise BadInput(f"the destination prefix holds an upload marker ({UPLOAD_MARKER}) that no upload recorded on "
                           f"this machine wrote, beside {len(foreign) - 1} other objects: "
                           + _names([t for t in foreign if t != UPLOAD_MARKER]), where=url,
                           hint="Those objects are not reshard's to replace. Resume that upload on the machine that "
                                "began it, choose an empty prefix, or pass --overwrite to replace a checkpoint or "
                                "an earlier reshard output there.")
        raise BadInput(f"the destination prefix already holds {len(foreign)} objects"
                       + (", a committed checkpoint" if METADATA_FILE in foreign else "") + ": " + _names(foreign),
                       where=url, hint="Choose an empty prefix, or pass --overwrite to replace a checkpoint or an "
                                       "earlier reshard output there.")
    if foreign:
        _check_replaceable(fs, base, url, {t: there[t] for t in foreign})
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "destination.txt").write_text(url + "\n")
        lock = os.open(folder / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise BadInput(f"cannot make the local staging folder {folder}: {exc.strerror or exc}", where=url,
                       hint=f"An output bound for a store is made locally first; set {STAGING_ENV} to a "
                            "folder with room for it.") from None
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BadInput("another reshard run is writing this destination", where=url,
                           hint="Wait for it to finish, or choose another prefix.") from None
        stage = Stage(url, folder, replaceable=frozenset(foreign))
        yield stage
        if committed_at(url):
            shutil.rmtree(folder, ignore_errors=True)
    finally:
        os.close(lock)


@dataclass
class Published:
    """What `publish` did: objects sent and objects an earlier, interrupted upload had already
    put there (proven by their size and the store's version tag, as recorded at their upload)."""

    sent: Counters
    kept: Counters
    checked: int = 0     # objects sent whose store ETag is the MD5 of the bytes sent (single or multipart form)
    unchecked: int = 0   # objects sent whose ETag is not an MD5 the client can recompute (an encrypted bucket, another store)


#: Uploaded last, in this order, when the output has them: the files a loader opens first (an
#: export's index and config, a DCP checkpoint's `.metadata`), so none is in the store before
#: everything it names.
ENTRY_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json", "config.json", METADATA_FILE)


def upload_order(names: list[str]) -> list[str]:
    """Data objects first (DCP's ``.distcp``, then every other file), `ENTRY_FILES` last."""
    rest = [n for n in names if n not in ENTRY_FILES]
    return ([n for n in rest if n.endswith(DATA_SUFFIX)] + [n for n in rest if not n.endswith(DATA_SUFFIX)]
            + [n for n in ENTRY_FILES if n in names])


def _file_crc(f: BinaryIO) -> int:
    """CRC-32 of an open file's bytes, from its start."""
    from reshard.storage.files.fileio import crc32

    crc = 0
    f.seek(0)
    while block := f.read(8 << 20):
        crc = crc32(block, crc)
    return crc


def crc_header(crc: int) -> dict[str, str]:
    """The request parameters that hand the store the CRC-32 of a request's body, as botocore sends it
    (``x-amz-checksum-crc32``, base64 of the big-endian value, and the algorithm's name): the store still
    checks the body against it, and botocore, finding the checksum given, does not compute it again."""
    import base64

    return {"ChecksumAlgorithm": "CRC32", "ChecksumCRC32": base64.b64encode(crc.to_bytes(4, "big")).decode("ascii")}


#: s3fs's multipart upload: parts of 50 MiB, larger when 10,000 would not hold the file.
PART_BYTES, MAX_PARTS = 50 << 20, 10_000
#: Objects `Publisher.send_all` uploads at once.
UPLOADERS = 4
#: reshard's own uploads (`Publisher.send`): one PUT up to this size, else parts of it (of more when
#: 10,000 would not hold the file), `PARTS_IN_FLIGHT` of them under way at once per object. Smaller
#: parts than s3fs's keep more requests going with as little memory (`UPLOADERS` x `PARTS_IN_FLIGHT`
#: parts at most); the ETag is checked from the digests of the parts sent, whatever their size.
SEND_PART, PARTS_IN_FLIGHT = 16 << 20, 4


def send_part(size: int) -> int:
    """The part size of reshard's multipart upload of ``size`` bytes (`SEND_PART`, larger when 10,000 would not hold it)."""
    import math

    return max(SEND_PART, math.ceil(size / MAX_PARTS))


def part_bytes(size: int) -> int:
    """The part size of a multipart upload of ``size`` bytes (`PART_BYTES` unless 10,000 parts would not hold it)."""
    import math

    return PART_BYTES if math.ceil(size / PART_BYTES) <= MAX_PARTS else math.ceil(size / MAX_PARTS)


def _etag_form(info: dict[str, Any]) -> tuple[str, int] | None:
    """The store's ETag as ``(md5 hex, parts)`` (0 parts: a single PUT), None if not an MD5 form."""
    etag = str(info.get("ETag") or info.get("etag") or "").strip().strip('"').lower()
    m = re.fullmatch(r"([0-9a-f]{32})(?:-(\d+))?", etag)
    return None if m is None else (m.group(1), int(m.group(2) or 0))


def etag_verdict(digests: list[bytes], multipart: bool, info: dict[str, Any]) -> bool | None:
    """Whether the store's ETag of an object is what the MD5s of the parts sent (``digests``, one for a
    single PUT) make: the MD5 itself for a single PUT, ``md5(md5(part) ...)-N`` for a multipart
    upload. None when the ETag is not of that form (server-side encryption with KMS, another
    store's tag) or of the other kind: the bytes are then not checked this way."""
    import hashlib

    form = _etag_form(info)
    if form is None or bool(form[1]) != multipart or (multipart and form[1] != len(digests)):
        return None
    want = hashlib.md5(b"".join(digests)).hexdigest() if multipart else digests[0].hex()
    return want == form[0]


def etag_matches(path: Path, info: dict[str, Any]) -> bool | None:
    """`etag_verdict` of the local file ``path`` (read here, in the parts s3fs sends, `part_bytes`):
    whether the store's ETag is the MD5 of its bytes, single or multipart form; None when the ETag
    is not of that form or counts other parts."""
    import hashlib
    import math

    form = _etag_form(info)
    if form is None:
        return None
    size = path.stat().st_size
    part = part_bytes(size)
    if form[1] and math.ceil(size / part) != form[1]:
        return None
    whole, digests = hashlib.md5(), []
    with open(path, "rb") as f:
        while block := f.read(part):
            (digests.append(hashlib.md5(block).digest()) if form[1] else whole.update(block))
    return etag_verdict(digests if form[1] else [whole.digest()], bool(form[1]), info)


@dataclass
class Sent:
    """One object put by `Publisher.send`: its local file as sent, and the digests taken from the
    bytes in hand while sending (no second read): the MD5 of each part, the CRC-32 of the whole."""

    size: int
    mtime_ns: int
    digests: list[bytes]
    multipart: bool
    crc32: int


def _put_digesting(fs: Any, f: BinaryIO, bucket: str, key: str, counted: Any) -> Sent:
    """The open file ``f`` put at ``bucket/key`` from its start, each block read once and digested
    as it goes (MD5 per part, CRC-32 of the whole): one PUT up to `SEND_PART`, else a multipart
    upload in parts of `send_part`, `PARTS_IN_FLIGHT` of them under way at once (the ETag
    `etag_verdict` recomputes from the digests in hand). An unfinished multipart upload is aborted.

    Each request carries the CRC-32 of its body taken here (`_crc_header`): the header botocore
    would otherwise compute from the same bytes a second time (its default, for every PUT), which
    also lets it leave the payload unsigned over https as before. Per part, the CRC-32 is the part's
    own and the whole file's is composed from the parts' (`crc32_combine`, no bytes read again)."""
    import asyncio
    import hashlib

    from fsspec.asyn import sync

    from reshard.storage.checkpoints.archive import crc32_combine
    from reshard.storage.files.fileio import crc32

    st = os.fstat(f.fileno())
    size, part = st.st_size, send_part(st.st_size)
    crc, digests = 0, []
    f.seek(0)
    if size <= SEND_PART:
        data = f.read()
        crc, digests = crc32(data), [hashlib.md5(data).digest()]
        sync(fs.loop, fs._call_s3, "put_object", Bucket=bucket, Key=key, Body=data, **crc_header(crc))
        counted.add(len(data))
        return Sent(size, st.st_mtime_ns, digests, False, crc)
    # declared CRC-32, as the parts' checksums are: the store then keeps the parts' CRC-32s (a composite
    # checksum) rather than hashing the whole object again at the end with an algorithm of its choosing
    mpu = sync(fs.loop, fs._call_s3, "create_multipart_upload", Bucket=bucket, Key=key, ChecksumAlgorithm="CRC32")
    flying: list[tuple[int, int, str, Any]] = []  # (part number, bytes, its CRC-32 as sent, its request on the filesystem's loop)
    parts: list[dict[str, Any]] = []

    def landed(i: int, n: int, sent_crc: str, fut: Any) -> None:
        got = fut.result()
        parts.append({"PartNumber": i, "ETag": got["ETag"], "ChecksumCRC32": got.get("ChecksumCRC32") or sent_crc})
        counted.add(n)

    try:
        while block := f.read(part):
            block_crc = crc32(block)  # the part's, for its request; the whole file's composed from it (no second pass)
            crc = crc32_combine(crc, block_crc, len(block))
            digests.append(hashlib.md5(block).digest())
            said = crc_header(block_crc)
            fut = asyncio.run_coroutine_threadsafe(
                fs._call_s3("upload_part", Bucket=bucket, Key=key, UploadId=mpu["UploadId"],
                            PartNumber=len(digests), Body=block, **said), fs.loop)
            flying.append((len(digests), len(block), said["ChecksumCRC32"], fut))
            del block
            while len(flying) >= PARTS_IN_FLIGHT:
                landed(*flying.pop(0))
        while flying:
            landed(*flying.pop(0))
        sync(fs.loop, fs._call_s3, "complete_multipart_upload", Bucket=bucket, Key=key,
             UploadId=mpu["UploadId"], MultipartUpload={"Parts": parts})
    except BaseException:
        for *_part, fut in flying:
            fut.cancel()
        try:
            sync(fs.loop, fs._call_s3, "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=mpu["UploadId"])
        except Exception:  # noqa: BLE001 - the store lists no object for it either way
            pass
        raise
    return Sent(size, st.st_mtime_ns, digests, True, crc)


class _Progress:
    """Bytes sent handed to a progress phase (or nothing), from any uploading thread."""

    def __init__(self, bar: Any):
        self.bar, self.lock = bar, threading.Lock()

    def add(self, n: int) -> None:
        if self.bar is not None and n:
            with self.lock:
                self.bar.update(n)


class Publisher:
    """One upload of a `Stage`'s output in DCP's commit order on a store with no rename, in three
    moves so that data objects can go while the rest of the output is still being made:

    - `begin`: the destination listed, nothing foreign there (`Stage.foreign`), `UPLOAD_MARKER`
      put and recorded, and the files a loader opens first (`ENTRY_FILES`) deleted, so nobody
      takes a half-replaced output while the new objects arrive;
    - `send` (thread-safe; `send_all` several at once): one finished file put at its final name,
      its bytes read once and digested as they go (`_put_digesting`), checked against the ETag
      the store computed and recorded for a rerun; an object an interrupted upload already put
      (same size and version tag as recorded, the same local bytes) is kept instead;
    - `finish`: what was not sent yet of the committed local output (`upload_order`), the
      objects of an earlier output it does not have deleted, `ENTRY_FILES` last (`.metadata`,
      the commit), the marker removed.

    ``on_event(label)`` after each object (the tests' fault-injection hook); ``bar.update(n)`` as
    bytes are sent or kept."""

    def __init__(self, stage: Stage, *, on_event: Callable[[str], Any] | None = None, bar: Any = None):
        self.stage, self.on_event, self.progress = stage, on_event, _Progress(bar)
        self.fs, self.base = _open_destination(stage.url)
        self.sent, self.kept = Counters(), Counters()
        self.checked = self.unchecked = 0
        self.done: dict[str, tuple[int, int]] = {}  # tail -> (size, mtime_ns) of the file sent or kept in this run
        self.lock = threading.Lock()
        self.there: dict[str, dict[str, Any]] = {}
        self.recorded: dict[str, dict[str, Any]] = {}
        self.begun = False
        self.stopped = False  # set from another thread: `send_all` begins no file more

    # -- the three moves ---------------------------------------------------------------------
    def begin(self) -> None:
        import json

        if self.begun:
            return
        url = self.stage.url
        self.look()
        foreign = self.stage.foreign(self.there)
        if foreign:  # appeared since `staged_output` looked, or a stage made elsewhere: not ours to delete or overwrite
            raise BadInput(f"the destination prefix holds {len(foreign)} objects no upload of this machine recorded "
                           "and --overwrite did not check: " + _names(foreign), where=url,
                           hint="Nothing was deleted. Choose an empty prefix, or remove those objects yourself.")
        with self._errors():
            with open(self.stage.uploads, "a") as log:  # the marker is ours once its ETag is recorded
                log.write(json.dumps({"name": UPLOAD_MARKER, "intent": True}) + "\n")
                log.flush()
                self.fs.pipe_file(f"{self.base}/{UPLOAD_MARKER}",
                                  b"reshard: an upload in progress; while this object is here, nothing under this "
                                  b"prefix is committed\n")
                self.fs.invalidate_cache(f"{self.base}/{UPLOAD_MARKER}")
                log.write(json.dumps({"name": UPLOAD_MARKER,
                                      "tag": version_tag(self.fs.info(f"{self.base}/{UPLOAD_MARKER}"))}) + "\n")
            for tail in sorted(self.there):  # what a loader opens first goes first: nobody takes a half-replaced output
                if tail.rsplit("/", 1)[-1] in ENTRY_FILES:
                    self.fs.rm_file(f"{self.base}/{tail}")
                    del self.there[tail]
        self.begun = True
        if self.on_event is not None:
            self.on_event(f"upload {UPLOAD_MARKER}")

    def look(self) -> None:
        """What the destination lists now (``there``) and what this machine's record names (``recorded``)."""
        self.there = listing(self.fs, self.base, self.stage.url)
        self.recorded = self.stage.recorded()

    def send_all(self, files: list[tuple[str, Path | BinaryIO]], *, at_once: int = UPLOADERS) -> None:
        """`send` of each ``(tail, path or open file)``, at most ``at_once`` at a time; the first error is raised."""
        def one(tail: str, path: Path | BinaryIO) -> None:
            if not self.stopped:
                self.send(tail, path)

        if at_once <= 1 or len(files) <= 1:
            for tail, path in files:
                one(tail, path)
            return
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=at_once, thread_name_prefix="reshard-upload") as pool:
            futures = [pool.submit(one, tail, path) for tail, path in files]
            try:
                for fut in futures:
                    fut.result()
            except BaseException:
                self.stopped = True
                raise

    def send(self, tail: str, path: Path | BinaryIO) -> None:
        """``path`` (a finished file of the output, or that file open: it may be renamed meanwhile, as
        the local commit renames its folder) at ``tail`` under the prefix: kept when an interrupted
        upload already put these bytes there, else put, checked by its ETag and recorded."""
        if isinstance(path, Path):
            with open(path, "rb") as f:
                return self.send(tail, f)
        check_key_tail(tail, where=self.stage.url)
        st = os.fstat(path.fileno())
        with self.lock:
            if self.done.get(tail) == (st.st_size, st.st_mtime_ns):
                return
        if self._unchanged(tail, path, st):
            self.kept.add(tail, st.st_size)
            self.progress.add(st.st_size)
            with self.lock:
                self.done[tail] = (st.st_size, st.st_mtime_ns)
            return
        with self._errors():
            self.intend(tail)  # a kill after the put leaves it ours
            bucket, obj, _v = self.fs.split_path(f"{self.base}/{tail}")
            self.landed(tail, _put_digesting(self.fs, path, bucket, obj, self.progress))

    def intend(self, tail: str) -> None:
        """Record ``tail`` as this machine's before any request that may leave its object (or an
        unfinished upload of it) in the store, so a rerun may replace it (thread-safe)."""
        import json

        with self._errors(), self.lock, open(self.stage.uploads, "a") as log:
            log.write(json.dumps({"name": tail, "intent": True}) + "\n")

    def landed(self, tail: str, got: Sent) -> None:
        """``got``, an object put at ``tail`` (by `send`, or streamed behind the writer by
        `reshard.storage.objectstore.stream.SpillStreamer`), checked against the ETag and size the store
        lists for it and recorded for a rerun (its local file's size, modification time and CRC-32,
        the store's version tag); a difference is an error, nothing committed (thread-safe)."""
        import json

        key, url = f"{self.base}/{tail}", self.stage.url
        with self._errors():
            self.sent.add(tail, got.size)
            self.fs.invalidate_cache(key)
            info = self.fs.info(key)
            same = etag_verdict(got.digests, got.multipart, info)
            if same is False or int(info.get("size") or -1) != got.size:
                if tail == METADATA_FILE:  # never leave a commit marker over bytes the store did not get
                    self.fs.rm_file(key)
                raise BadInput(f"the store holds other bytes for '{tail}' than were sent (its ETag or size "
                               "differs from the local file's)", where=f"{url}/{tail}",
                               hint="Nothing is committed there; run the same command again (it sends that object again).")
            with self.lock:
                self.checked, self.unchecked = self.checked + (same is True), self.unchecked + (same is None)
                self.done[tail] = (got.size, got.mtime_ns)
                if tail != METADATA_FILE:
                    with open(self.stage.uploads, "a") as log:
                        log.write(json.dumps({"name": tail, "size": got.size, "mtime_ns": got.mtime_ns,
                                              "crc32": got.crc32, "tag": version_tag(info)}) + "\n")
        if self.on_event is not None:
            self.on_event(f"upload {tail}")

    def finish(self, local: Path | None = None, sent_elsewhere: Iterable[str] = ()) -> Published:
        """Everything of the committed local output not sent yet, in `upload_order` (`ENTRY_FILES`
        last), the objects of an earlier output this one does not have deleted first, the marker
        removed: the output is committed in the store. ``local``: the folder the output's files are
        in (default the stage's); ``sent_elsewhere``: objects of the output other processes put
        (a streamed output's data files), neither sent from ``local`` nor deleted."""
        local = self.stage.out if local is None else local
        elsewhere = set(sent_elsewhere)
        names = sorted(t for t in (p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
                       if t not in elsewhere)
        if not names and not elsewhere:
            raise Incomplete("the output is empty: nothing committed to publish", where=str(local))
        for tail in names:
            check_key_tail(tail, where=self.stage.url)
        self.begin()
        order = upload_order(names)
        with self._errors():
            for tail in sorted(set(self.there) - set(names) - elsewhere - {UPLOAD_MARKER}):
                self.fs.rm_file(f"{self.base}/{tail}")  # an earlier output's object this one does not have
            entries = [t for t in order if t in ENTRY_FILES]
            self.send_all([(t, local / t) for t in order if t not in ENTRY_FILES], at_once=1)  # in order: a kill
            # leaves a prefix of it (the data objects of a conversion went at once, earlier: `EarlyUpload`)
            for tail in entries:
                self.send(tail, local / tail)
            self.fs.rm_file(f"{self.base}/{UPLOAD_MARKER}")
        return Published(self.sent, self.kept, self.checked, self.unchecked)

    # -- helpers -----------------------------------------------------------------------------
    def may_keep(self, tail: str) -> bool:
        """Whether an interrupted upload put ``tail`` and the store still lists it with the size and tag
        recorded (after `begin`): `send` then keeps it if the local file is the same. `.metadata` is
        always sent again (it is the commit)."""
        r, info = self.recorded.get(tail), self.there.get(tail)
        return not (r is None or info is None or tail == METADATA_FILE or r.get("tag") != version_tag(info)
                    or r.get("size") != int(info.get("size") or -1))

    def _unchanged(self, tail: str, f: BinaryIO, st: os.stat_result) -> bool:
        """An object an interrupted upload put (`may_keep`) from a local file of its size with the same
        modification time, else the same CRC-32 (an export made again writes the same bytes at a new time)."""
        if not self.may_keep(tail) or self.recorded[tail].get("size") != st.st_size:
            return False
        r = self.recorded[tail]
        return r.get("mtime_ns") == st.st_mtime_ns or r.get("crc32") == _file_crc(f)

    @contextmanager
    def _errors(self) -> Iterator[None]:
        """The store's and the record's errors, in one paragraph each (nothing is committed)."""
        url = self.stage.url
        try:
            yield
        except ReshardError:
            raise
        except OSError as exc:
            if exc.filename is not None and str(self.stage.folder) in str(exc.filename):
                raise BadInput(f"cannot record the upload in {self.stage.folder}: {exc.strerror or exc}",
                               where=url) from None
            raise BadInput(f"the upload failed: {type(exc).__name__}: {exc}", where=url,
                           hint="Nothing is committed there; run the same command again (it resumes).") from None
        except Exception as exc:  # noqa: BLE001 - the store's errors, in one paragraph
            raise BadInput(f"the upload failed: {type(exc).__name__}: {exc}", where=url,
                           hint="Nothing is committed there; run the same command again (it resumes).") from None


def publish(stage: Stage, *, on_event: Callable[[str], Any] | None = None, bar: Any = None) -> Published:
    """Upload the committed local output of ``stage`` in DCP's commit order, on a store with no
    rename (`Publisher`: `UPLOAD_MARKER` first, then the data objects at their final names, then
    every other file, `ENTRY_FILES` last (`.metadata` for DCP: the commit marker, a loader takes
    the output only once it is there), then the marker removed).

    Resuming: each object sent is recorded in ``stage.uploads`` with the local file's size,
    modification time and CRC-32 and the version tag (ETag) the store gave it. An object the
    record names is not sent again when the store still lists it with that size and tag and
    the local file is the same (its modification time, else its CRC-32: an export made again
    writes the same bytes at a new time); every other object under the prefix that is not part
    of the output is deleted. ``on_event(label)`` after each object (the fault-injection hook
    of the tests); ``bar.update(nbytes)`` as bytes are sent or kept (a progress phase, or None)."""
    return Publisher(stage, on_event=on_event, bar=bar).finish()
