"""Checkpoints in object storage (``s3://bucket/prefix``; `urls.SCHEMES`): read by byte range.

Why: a frontier checkpoint lives in an object store, and `inspect` or `plan` need only its
`.metadata` and the small files beside it, a conversion only the byte ranges it reads; a
download of terabytes first is the cost this module removes (issue 34).

How it meets the rest of reshard (the seam): every reader above works on a checkpoint
*directory*. `staged` makes a private local directory holding `.metadata` and the sidecars
(each fetched by byte range, bounded) and no data file, and yields it with its
`RemoteCheckpoint`; `reshard.storage.source.opened` keeps both in a `Source`, which hands the
`RemoteCheckpoint` to every reader it opens. The storage layer's few places that touch data
files are handed it (``rc``, ``CheckpointIndex.remote``): `dcp.read_item_bytes` fetches an
item's range from the store (then every reader checks it against its writer's CRC as on disk),
`dcp.metadata_cap` and `CheckpointIndex` take the data files' sizes from the one listing.
A data file is never created in the staged directory, so a reader that bypasses the seam
fails loudly (file missing) instead of reading something else. The local path pays one
empty-dict test per item read.

Safety: object keys are names inside the prefix. A data file name must be a plain name
(`dcp.check_relative_path`'s rules: no ``/``, no ``..``, not absolute); a sidecar's key tail
may have sub-folders but no ``..``, empty or absolute part; nothing outside the prefix is
ever requested, and a listed key that breaks these rules is refused (exit 2) rather than
skipped. Credentials come from the filesystem's own chain (for S3, botocore's: environment,
config files, instance roles); this module never reads, prints or records them, and the URL
it records is the one the user typed, minus any ``user:password@`` part (refused outright).

Against a store that changes or stalls (issue 42): every ranged GET of an S3 object carries
``If-Match`` with the ETag the one listing recorded (`RemoteCheckpoint.pin`), so bytes of a
version other than the one listed are never read, and `check_unchanged` lists the prefix again
before an output is committed: an object replaced, removed or rewritten since is exit 2 naming
it. Every request has a connect and a read timeout and a bounded number of attempts with
botocore's backoff (`StoreLimits`, from ``RESHARD_STORE_*``); a store that does not answer is
exit 2 within `StoreLimits.longest_wait`, which the error states. Zero-byte folder markers
(``logs/``, a ``.metadata/`` made by a console) are listed as markers, never as files.

fsspec and s3fs are the optional ``s3`` extra (``pip install 'reshard[s3]'``), imported only
when a URL is opened.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from reshard import safefs
from reshard.errors import BadInput, Incomplete, ReshardError
from reshard.storage.files import fileio
from reshard.storage.objectstore import urls

__all__ = ["is_url", "StoreLimits", "open_store", "store_error", "RemoteCheckpoint", "Counters", "staged", "open_remote",
           "version_tag", "ReadCache", "Mirror", "Prefetch",
           "check_key_tail", "no_fsspec", "METADATA_FILE", "DATA_SUFFIX"]

METADATA_FILE = ".metadata"
DATA_SUFFIX = ".distcp"
#: `dcp.MIN_METADATA_CAP` (this module sits below `dcp`, which imports it for the seam).
METADATA_FLOOR = 256 << 20
#: A request fetches at most this much (`.metadata` and sidecars are read in pieces of it).
PIECE = 64 << 20
#: The sidecars staged for inspect and plan together: reports, manifests, configs, a trainer's
#: small state; past this the prefix holds something no sidecar is, and it is said.
SIDECARS_CAP = 1 << 30
#: Objects beside the data objects (sidecars, reports, folder contents): more is not a checkpoint
#: (the bound `reshard.storage.checkpoints.sidecars.MAX_SIDECARS` puts on a local directory's files).
MAX_OBJECTS = 10_000
#: Sidecars fetched at once while a checkpoint is staged.
FETCHERS = 8
#: Data objects a `Mirror` fetches at once (each one streamed GET); a checkpoint's items are spread
#: over every rank's object, so all of them advance together rather than one after another.
MIRROR_STREAMS = 16
#: What one stream of a `Mirror` hands the read cache at a time (and holds in memory at most).
MIRROR_CHUNK = 4 << 20


def is_url(text: str | os.PathLike) -> bool:
    """Whether a command-line source names an object-store URL rather than a local path
    (`urls.looks_like_url`; `urls.parse` then decides whether reshard takes it)."""
    return urls.looks_like_url(text)


#: The environment variables that set `StoreLimits` (seconds, seconds, a count).
LIMIT_ENV = {"connect_timeout": "RESHARD_STORE_CONNECT_TIMEOUT", "read_timeout": "RESHARD_STORE_READ_TIMEOUT",
             "attempts": "RESHARD_STORE_ATTEMPTS"}


@dataclass(frozen=True)
class StoreLimits:
    """How long reshard waits for a store: each request's connect and read timeout (seconds; the
    read timeout bounds the silence between two packets) and the attempts of one request, with
    botocore's standard retry mode backing off between them (at most 2^i s, 20 s at most).

    Why bounded everywhere: a store that accepts the connection and never answers used to hang
    a conversion forever (issue 42: still silent at 1,303 s); now the request fails within
    `longest_wait`, said in the error."""

    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    attempts: int = 4

    @classmethod
    def from_env(cls) -> "StoreLimits":
        given: dict[str, Any] = {}
        for name, var in LIMIT_ENV.items():
            text = os.environ.get(var)
            if text is None or not text.strip():
                continue
            try:
                value = int(text) if name == "attempts" else float(text)
            except ValueError:
                value = -1
            if not 0 < value <= (100 if name == "attempts" else 3600):
                raise BadInput(f"{var}={text!r} is not a {'count of attempts from 1 to 100' if name == 'attempts' else 'number of seconds above 0 and at most 3600'}",
                               hint=f"Set {var} to such a value, or unset it (default {getattr(cls, name)}).")
            given[name] = value
        return cls(**given)

    def longest_wait(self) -> float:
        """Seconds one request may take at most before it is given up: every attempt's connect and
        read timeout and the backoff between attempts."""
        backoff = sum(min(20.0, 2.0 ** i) for i in range(self.attempts - 1))
        return self.attempts * (self.connect_timeout + self.read_timeout) + backoff

    def botocore(self) -> dict[str, Any]:
        """`botocore.config.Config` arguments (s3fs's ``config_kwargs``).

        Bodies are not signed with SHA-256 (``payload_signing_enabled`` False), over plain http as
        botocore already does over https when a checksum is sent: every body reshard puts carries its
        CRC-32 in a signed header (`reshard.storage.objectstore.upload.crc_header`, else botocore's own),
        which the store checks, and each object is then checked by the MD5 its ETag gives; signing
        cost another pass over every byte sent (0.6 s of CPU per GiB here)."""
        return {"connect_timeout": self.connect_timeout, "read_timeout": self.read_timeout,
                "retries": {"max_attempts": self.attempts, "mode": "standard"},
                "s3": {"payload_signing_enabled": False}}

    def to_dict(self) -> dict[str, Any]:
        return {"connect_timeout_s": self.connect_timeout, "read_timeout_s": self.read_timeout,
                "attempts": self.attempts, "longest_wait_s": round(self.longest_wait(), 1)}

    def said(self) -> str:
        return (f"{self.attempts} attempt{'s' if self.attempts != 1 else ''} of at most {self.connect_timeout:g} s to "
                f"connect and {self.read_timeout:g} s of silence each, {self.longest_wait():g} s in all")


def open_store(url: str, *, what: str = "URL") -> tuple[Any, str, urls.StoreURL, StoreLimits]:
    """``url`` parsed (`urls.parse`: the one rule) and opened through fsspec with the filesystem's
    own credential chain and `StoreLimits`: ``(fs, base, parsed, limits)``, ``base`` the
    filesystem's ``bucket/prefix``. A fresh filesystem instance every time (fsspec caches them
    by arguments), so what `RemoteCheckpoint.pin` registers on its client serves that
    checkpoint only."""
    parsed = urls.parse(url, what=what)
    if not parsed.key:
        raise BadInput("a checkpoint is a prefix inside a bucket, not a whole bucket", where=str(parsed),
                       hint=f"Give {parsed.scheme}://{parsed.bucket}/prefix.")
    limits = StoreLimits.from_env()
    try:
        from fsspec.core import url_to_fs
    except ImportError as exc:
        raise no_fsspec(str(parsed), exc) from None
    options: dict[str, Any] = {"skip_instance_cache": True}
    if parsed.family == "s3":
        options["config_kwargs"] = limits.botocore()
    try:
        fs, base = url_to_fs(str(parsed), **options)
    except (ImportError, ValueError, TypeError) as exc:
        raise no_fsspec(str(parsed), exc) from None
    if isinstance(getattr(fs, "retries", None), int):
        fs.retries = 1  # s3fs's own loop of 5 around botocore's: the attempts are botocore's, counted once
    return fs, base.rstrip("/"), parsed, limits


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def store_error(exc: BaseException, *, doing: str, where: str, limits: StoreLimits | None = None,
                hint: str = "Check the endpoint and the credentials' rights.") -> BadInput:
    """A store's exception as one paragraph (exit 2): an object that changed since it was listed
    (HTTP 412 to ``If-Match``) and a store that did not answer in time (with the bound that was
    waited) each in their own words, anything else with its type and message."""
    for e in _chain(exc):
        response = getattr(e, "response", None)
        code = str((response or {}).get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""
        status = (response or {}).get("ResponseMetadata", {}).get("HTTPStatusCode") if isinstance(response, dict) else None
        if code == "PreconditionFailed" or status == 412:
            return BadInput(f"{doing}: the object changed since the checkpoint was listed (its ETag is no longer the "
                            "one listed), so its bytes would be another version's", where=where,
                            hint="Nothing is committed. Run the command again once the writer has finished, or copy "
                                 "the checkpoint to a prefix no one writes.")
        if "Timeout" in type(e).__name__ or isinstance(e, TimeoutError):
            bound = f" ({limits.said()})" if limits is not None else ""
            return BadInput(f"{doing}: the store did not answer in time{bound}", where=where,
                            hint="Nothing is committed. Check the endpoint and the network; "
                                 f"{', '.join(LIMIT_ENV.values())} set other bounds.")
    return BadInput(f"{doing}: {type(exc).__name__}: {exc}", where=where, hint=hint)


@dataclass
class Counters:
    """Requests made and bytes requested, by kind (for the tests and the benchmark: what an
    inspect of a remote checkpoint costs, against the bytes the checkpoint holds)."""

    requests: int = 0
    bytes: int = 0
    listings: int = 0
    by_file: dict[str, int] = field(default_factory=dict)
    in_flight: int = 0          # requests under way now
    peak_in_flight: int = 0     # the most at once (a prefetch's parallelism, bounded by its ``in_flight``)
    peak_buffered: int = 0      # the most bytes fetched ahead and not yet taken (bounded by its ``memory``)
    prefetched: int = 0         # reads answered by the prefetch
    prefetches: list[dict[str, Any]] = field(default_factory=list)  # each finished prefetch: label, bounds, peaks
    windows: list[dict[str, Any]] = field(default_factory=list)  # each closed `RangeWindow`: budget, peak, bytes, requests
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, name: str, nbytes: int) -> None:
        with self.lock:
            self.requests += 1
            self.bytes += nbytes
            self.by_file[name] = self.by_file.get(name, 0) + nbytes

    def started(self) -> None:
        with self.lock:
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    def ended(self) -> None:
        with self.lock:
            self.in_flight -= 1

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "bytes": self.bytes, "listings": self.listings,
                "peak_in_flight": self.peak_in_flight, "peak_buffered": self.peak_buffered,
                "prefetched": self.prefetched, "prefetches": list(self.prefetches), "windows": list(self.windows),
                "by_file": dict(sorted(self.by_file.items()))}


def version_tag(info: dict[str, Any]) -> str:
    """What the store says identifies an object's content: its ETag (S3, GCS), else its modification time."""
    for k in ("ETag", "etag", "md5Hash", "LastModified", "mtime", "updated"):
        if info.get(k) is not None:
            return f"{k}={info[k]}"
    return ""


def no_fsspec(url: str, exc: Exception) -> BadInput:
    return BadInput(f"cannot open '{url}': {exc}", where=url,
                    hint="Object-store sources need the optional extra: pip install 'reshard[s3]' "
                         "(fsspec and s3fs; other protocols need their fsspec filesystem installed).")


def check_key_tail(tail: str, *, where: str) -> None:
    """A key under the prefix: relative, no empty, ``.`` or ``..`` part (it could name something outside)."""
    safefs.check_name(tail, where=where)
    parts = tail.split("/")
    if tail.startswith("/") or "\\" in tail or any(p in ("", ".", "..") for p in parts):
        raise safefs.UnsafeFile(f"the object key '{tail}' is not a name inside the checkpoint's prefix", where=where,
                                hint="Refusing to read objects outside the checkpoint's prefix.")


def _check_data_name(name: str, *, where: str) -> None:
    """A data file the metadata names: one plain name, as on disk (`dcp.check_relative_path`)."""
    safefs.check_name(name, where=where)
    if "/" in name or "\\" in name or name in ("", ".", ".."):
        raise safefs.UnsafeFile(f"the data file name '{name}' is not a plain name inside the checkpoint's prefix",
                                where=where, hint="Refusing to read objects outside the checkpoint's prefix.")


class RemoteCheckpoint:
    """One checkpoint prefix in an object store, read by byte ranges through fsspec.

    ``sizes`` is the one listing (every object under the prefix, key tail -> bytes), made when
    the checkpoint is opened; every read is a ranged GET counted in ``counters``.
    """

    def __init__(self, url: str, fs: Any, base: str, *, limits: StoreLimits | None = None, pin: bool = False):
        self.url = url.rstrip("/")
        self.fs = fs
        self.base = base.rstrip("/")
        self.limits = limits or StoreLimits()
        self.counters = Counters()
        self.ahead: Prefetch | None = None  # while `prefetching` runs: ranges fetched ahead of their reader
        self.kept: ReadCache | None = None  # after `keep_reads`: fetched ranges kept locally for a second reader
        self.mirror: Mirror | None = None  # while `mirroring` runs: whole data objects fetched into ``kept``
        self.cache_folder: Path | None = None  # where `keep_reads` keeps them (the staged directory's parent)
        self.tags: dict[str, str] = {}  # key tail -> the store's version tag (ETag, else modification time)
        self.etags: dict[str, str] = {}  # full "bucket/key" -> the ETag listed, which every GET is pinned to
        self.markers: list[str] = []  # zero-byte folder markers ("logs/"), listed and not taken for files
        self.deferred: dict[str, int] = {}  # sidecars `staged` listed without fetching (key tail -> bytes)
        self.sizes: dict[str, int] = self._list()
        self.pinned: Any = None  # the client whose GETs carry If-Match (`pin`)
        if pin:
            self.pin()

    def pin(self) -> None:
        """From now on every GET this filesystem's S3 client sends carries ``If-Match`` with the
        ETag the listing recorded for its key: the store answers 412 rather than another version's
        bytes (`store_error`). A botocore event handler, because s3fs's ranged read takes no
        per-call arguments; registered again if s3fs made a new client."""
        client = self.fs.s3  # s3fs connects on first use
        if client is self.pinned:
            return
        client.meta.events.register("before-parameter-build.s3.GetObject", self._if_match)
        self.pinned = client

    def _if_match(self, params: dict[str, Any], **_: Any) -> None:
        etag = self.etags.get(f"{params.get('Bucket')}/{params.get('Key')}")
        if etag:
            params["IfMatch"] = etag

    def where(self, name: str = "") -> str:
        """A user-facing place: the URL, or the URL of one object under it."""
        return f"{self.url}/{name}" if name else self.url

    def _find(self) -> dict[str, dict[str, Any]]:
        try:
            self.fs.invalidate_cache(self.base)
            found = self.fs.find(self.base, detail=True)
        except FileNotFoundError:
            found = {}
        except Exception as exc:  # noqa: BLE001 - a store's errors: permissions, endpoint, bucket
            raise store_error(exc, doing="cannot list the checkpoint", where=self.url, limits=self.limits,
                              hint="Check the URL, the endpoint and that the credentials in the standard chain "
                                   "(environment, config files, instance role) may list this prefix.") from None
        self.counters.listings += 1
        return found

    def _list(self) -> dict[str, int]:
        """Every object under the prefix, one listing (a paginated LIST on S3), each key checked.

        A zero-byte key ending in ``/`` is a folder marker (the S3 console's "create folder"):
        recorded in `markers`, never a file (``.metadata/`` is not `.metadata`). Every other key
        must map onto one local file name: plain parts of at most 255 bytes, no control
        character, and not both a file and a folder (``a`` beside ``a/b``)."""
        out: dict[str, int] = {}
        head = self.base + "/"
        for path, info in self._find().items():
            if not path.startswith(head) or info.get("type") == "directory":
                continue
            size = int(info.get("size") or 0)
            if path.endswith("/") and size == 0:
                self.markers.append(path[len(head):])
                continue
            tail = path[len(head):]
            if any(ord(ch) < 32 or ch == "\x7f" for ch in tail):
                raise safefs.UnsafeFile(f"the object key {tail!r} holds a control character (a newline, a tab), which "
                                        "would break every line that names it", where=self.url,
                                        hint="Rename the object, or give a prefix that holds only the checkpoint.")
            check_key_tail(tail, where=self.where(tail.rstrip("/")))
            if any(len(p.encode()) > 255 for p in tail.split("/")) or len(tail.encode()) > 1024:
                raise safefs.UnsafeFile("the object key has a part longer than 255 bytes (or is longer than 1,024), "
                                        "which no local file name can hold", where=self.url,
                                        hint="Rename the object, or give a prefix that holds only the checkpoint.")
            out[tail] = size
            self.tags[tail] = version_tag(info)
            etag = info.get("ETag") or info.get("etag")
            if etag:
                self.etags[path] = str(etag)
        if not out:
            raise BadInput("no such checkpoint: nothing is stored under this prefix", where=self.url,
                           hint="Check the bucket and prefix (a checkpoint is the prefix that holds `.metadata`).")
        folders = {"/".join(t.split("/")[:i]) for t in out for i in range(1, t.count("/") + 1)}
        both = sorted(folders & out.keys())
        if both:
            raise safefs.UnsafeFile(f"'{both[0]}' is both an object and a folder of objects under this prefix, which "
                                    "no local directory can hold", where=self.where(both[0]),
                                    hint="Rename one of them, or give a prefix that holds only the checkpoint.")
        return out

    def reads(self) -> dict[str, Any]:
        """What reading this checkpoint has cost so far: requests, bytes requested, listings, against
        the bytes its objects hold. Reports carry it so a user (and the benchmark) sees that an
        inspect fetched megabytes of a terabyte prefix."""
        return {"requests": self.counters.requests, "bytes_requested": self.counters.bytes,
                "listings": self.counters.listings, "bytes_stored": sum(self.sizes.values()),
                "objects_stored": len(self.sizes), "versions_pinned": self.pinned is not None,
                "limits": self.limits.to_dict(), **({"folder_markers": list(self.markers)} if self.markers else {}),
                **({"bytes_read_again_from_the_local_copy": self.kept.served} if self.kept is not None else {})}

    def check_unchanged(self) -> None:
        """Before an output read from this checkpoint is committed: the prefix listed again, and every
        object of the first listing there with its size and version tag, else exit 2 naming what
        changed (nothing committed)."""
        gone = self.changed()
        if gone:
            raise BadInput(f"{len(gone)} object{'s' if len(gone) != 1 else ''} of the source changed since it was listed: "
                           + ", ".join(gone[:5]) + (" ..." if len(gone) > 5 else ""), where=self.where(gone[0]),
                           hint="Nothing is committed: what was read may be of another version. Run the command again "
                                "once the writer has finished, or copy the checkpoint to a prefix no one writes.")

    def changed(self) -> list[str]:
        """The objects of the first listing that a new listing shows replaced (another size or
        version tag) or gone: what a reader may have read of another version."""
        now: dict[str, tuple[int, str]] = {}
        head = self.base + "/"
        for path, info in self._find().items():
            if path.startswith(head) and info.get("type") != "directory":
                now[path[len(head):]] = (int(info.get("size") or 0), version_tag(info))
        return sorted(t for t, n in self.sizes.items() if now.get(t) != (n, self.tags.get(t, "")))

    def identity(self) -> dict[str, list[int]]:
        """Every object -> ``[size, CRC-32 of its version tag]``: what `journal.source_identity`
        records of a local source by ``stat``, from the one listing. An object rewritten under
        the prefix gets a new ETag, so a rerun never keeps bytes read from what it replaced."""
        return {k: [n, zlib.crc32(self.tags.get(k, "").encode())] for k, n in sorted(self.sizes.items())}

    def data_files(self) -> list[str]:
        """Names of the DCP data files listed directly under the prefix."""
        return sorted(n for n in self.sizes if "/" not in n and n.endswith(DATA_SUFFIX))

    def data_bytes(self) -> int:
        """Bytes of every object except `.metadata` (what `dcp.metadata_cap` counts on disk)."""
        return sum(n for k, n in self.sizes.items() if k != METADATA_FILE)

    def read_range(self, name: str, offset: int, length: int, *, key: str | None = None) -> bytes:
        """``length`` bytes at ``offset`` of the data file ``name``: one ranged request (pieces
        of `PIECE` for a larger range), checked for length. A missing file or a short object is
        `Incomplete` (exit 2), worded as on disk."""
        _check_data_name(name, where=self.url)
        ahead = self.ahead  # first: a range the prefetch has under way is taken from it, or it waits forever
        if ahead is not None:
            data = ahead.take(name, offset, length)
            if data is not None:
                return data
        mirror = self.mirror
        if mirror is not None:
            mirror.wait(name, offset, length)  # on its way in the one whole-object fetch: not fetched twice
        kept = self.kept
        if kept is not None:
            data = kept.get(name, offset, length)
            if data is not None:
                return data
        return self._read(name, offset, length, key=key)

    def keep_reads(self, budget: int) -> None:
        """From now on, keep up to ``budget`` bytes of what is fetched in a local file per data
        object (`ReadCache`), so a second reader of the same ranges (a conversion's verification,
        after its copy) reads them here instead of fetching them again. The bytes are those the
        store returned in this run, checked by every reader against their writer's CRC-32 as on
        disk. Removed with the staged directory."""
        if budget > 0 and self.cache_folder is not None and self.kept is None:
            self.kept = ReadCache(self.cache_folder / "reads", budget)

    def can_mirror(self, names: list[str] | None = None) -> bool:
        """Whether the read cache may hold every data object (or those of ``names``) whole (`mirroring`)."""
        kept = self.kept
        wanted = self.data_files() if names is None else [n for n in names if n in self.sizes]
        return kept is not None and kept.budget >= sum(self.sizes[n] for n in wanted)

    @contextmanager
    def mirroring(self, names: list[str], *, streams: int = MIRROR_STREAMS) -> Iterator[Mirror]:
        """While the block runs, the data objects ``names`` (first needed first) are fetched whole
        into the read cache's local files (`Mirror`); `read_range` waits for them rather than
        fetching a range twice. Only when `can_mirror`."""
        mirror = Mirror(self, names, streams=streams)
        self.mirror = mirror
        try:
            yield mirror
        finally:
            self.mirror = None
            mirror.close()

    @contextmanager
    def prefetching(self, ranges: Iterable[tuple[str, int, int]], *, in_flight: int = 8,
                    memory: int = 256 << 20, label: str = "") -> Iterator["Prefetch"]:
        """While the block runs, the byte ranges ``(file, offset, length)`` are fetched ahead of
        their reader, in the order given, by at most ``in_flight`` requests at once and with at
        most ``memory`` bytes fetched and not yet read (a larger range alone); `read_range` takes
        them from there. A range read in another order, or not foreseen, is fetched as it is read:
        the order costs time, never correctness. Errors surface where the range is read."""
        ahead = Prefetch(self, ranges, in_flight=in_flight, memory=memory)
        self.ahead = ahead
        try:
            yield ahead
        finally:
            self.ahead = None
            ahead.close()
            with self.counters.lock:
                self.counters.prefetches.append({"label": label, "in_flight": in_flight, "memory": memory,
                                                 "peak_in_flight": ahead.peak_running, "peak_buffered": ahead.peak_buffered})

    def _read(self, name: str, offset: int, length: int, *, key: str | None) -> bytes:
        size = self.sizes.get(name)
        who = f" (needed for '{key}')" if key is not None else ""
        if size is None:
            raise Incomplete(f"data file '{name}' is missing{who}", where=self.url,
                             hint="The checkpoint is incomplete; restore the object or use another checkpoint.")
        if offset < 0 or length < 0 or offset + length > size:
            raise Incomplete(f"{'`' + key + '` needs' if key else 'reading'} bytes [{offset}, {offset + length}) "
                             f"but the object ends at {size}", where=self.where(name),
                             hint="The data object is truncated; the checkpoint is incomplete.")
        if self.pinned is not None:
            self.pin()  # the same client: one identity test
        parts, done = [], 0
        while done < length:
            n = min(PIECE, length - done)
            self.counters.started()
            try:
                b = self.fs.cat_file(f"{self.base}/{name}", start=offset + done, end=offset + done + n)
            except FileNotFoundError:
                raise Incomplete(f"data file '{name}' disappeared while it was read{who}", where=self.url,
                                 hint="Something deleted it under reshard; use another checkpoint.") from None
            except Exception as exc:  # noqa: BLE001 - a store's errors, in one paragraph
                raise store_error(exc, doing=f"cannot read bytes of '{name}'{who}", where=self.where(name),
                                  limits=self.limits, hint="Check the endpoint and the credentials' read rights.") from None
            finally:
                self.counters.ended()
            self.counters.add(name, n)
            if len(b) != n:
                raise Incomplete(f"the store returned {len(b)} of {n} bytes of '{name}' at {offset + done}",
                                 where=self.where(name), hint="The object changed or is truncated; retry or use another checkpoint.")
            parts.append(b)
            done += n
        data = b"".join(parts)
        kept = self.kept
        if kept is not None and name in self.sizes and name.endswith(DATA_SUFFIX):
            kept.put(name, offset, data)
        return data

    def fetch_to(self, tail: str, dst: Path, *, limit: int) -> int:
        """The object ``tail`` (a key under the prefix) copied into the local file ``dst`` by ranges, at most ``limit`` bytes."""
        check_key_tail(tail, where=self.url)
        size = self.sizes[tail]
        safefs.check_size(size, limit, self.where(tail), what=tail)
        dst.parent.mkdir(parents=True, exist_ok=True)
        with open(dst, "wb") as f:
            done = 0
            while done < size:
                n = min(PIECE, size - done)
                f.write(self._read(tail, done, n, key=None))
                done += n
        return size


class ReadCache:
    """Ranges of a remote checkpoint's data objects fetched in this run, kept in one sparse local
    file per object at their own offsets, with the spans held (merged, sorted) per object: a
    conversion's copy fetches nearly every byte in order, so a few spans per object stand for
    millions of items. At most ``budget`` bytes; past it, or on any write error, nothing more is
    kept (a later read fetches again: the cache costs disk, never correctness)."""

    def __init__(self, folder: Path, budget: int):
        self.folder, self.budget, self.used, self.served = folder, budget, 0, 0
        self.lock = threading.Lock()
        self.grown = threading.Condition(self.lock)  # notified whenever a span is added (`Mirror.wait`)
        self.fds: dict[str, int] = {}
        self.direct: dict[str, int | None] = {}  # a second descriptor of each file, for direct writes (None: none)
        self.spans: dict[str, list[list[int]]] = {}

    def covers(self, name: str, offset: int, length: int) -> bool:
        """Whether the range is kept here (a read of it would not go to the store)."""
        with self.lock:
            return self.covered(name, offset, length)

    def covered(self, name: str, offset: int, length: int) -> bool:
        """`covers`, for a caller that holds ``lock`` (a waiter on ``grown``)."""
        import bisect

        spans = self.spans.get(name)
        if not spans or name not in self.fds:
            return False
        i = bisect.bisect_right(spans, [offset, float("inf")]) - 1
        return i >= 0 and spans[i][1] >= offset + length

    def get(self, name: str, offset: int, length: int) -> bytes | None:
        if not self.covers(name, offset, length):
            return None
        with self.lock:
            fd = self.fds.get(name)
        if fd is None:
            return None
        try:
            data = os.pread(fd, length, offset)
        except OSError:
            return None
        if len(data) != length:
            return None
        with self.lock:
            self.served += length
        return data

    def put(self, name: str, offset: int, data: bytes | memoryview) -> bool:
        """Keep ``data`` at ``offset`` of the object ``name``; False when it is not kept (past the
        budget, or the local disk refused it). ``data`` in an aligned buffer (`fileio.aligned_buffer`)
        at an aligned offset (`Mirror`'s chunks) has its whole blocks written by direct I/O: a buffered
        write of a fetched object cost more CPU than its fetch (the kernel's copy into the page cache,
        about 1.3 s per GiB here), and the copy reads these files back by direct I/O anyway."""
        import bisect

        n = len(data)
        if self.covers(name, offset, n):
            return True  # read before (a duplicate): kept once
        with self.lock:
            new = n - self._overlap(name, offset, n)  # the disk holds each byte of an object once
            if not n or self.used + new > self.budget:
                return False
            self.used += new
            fd = self.fds.get(name)
            if fd is None:
                try:
                    self.folder.mkdir(parents=True, exist_ok=True)
                    fd = self.fds[name] = os.open(self.folder / name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                except OSError:
                    self.budget = 0
                    return False
        try:
            if isinstance(data, memoryview) and offset % fileio.ALIGN == 0 and not data.readonly:
                with self.lock:
                    if name not in self.direct:
                        self.direct[name] = fileio.open_direct(self.folder / name, os.O_WRONLY)
                    dfd = self.direct[name]
                fileio.write_placed(fd, dfd, data, 0, offset, n)
            else:
                done = 0
                while done < n:
                    done += os.pwrite(fd, memoryview(data)[done:], offset + done)
        except OSError:
            with self.lock:
                self.budget = 0  # a full disk: keep nothing more, fetch again instead
            return False
        with self.lock:
            spans = self.spans.setdefault(name, [])
            i = bisect.bisect_left(spans, [offset, offset])
            spans.insert(i, [offset, offset + n])
            j = max(i - 1, 0)  # merge with the neighbours that touch or overlap it
            while j + 1 < len(spans):
                if spans[j][1] >= spans[j + 1][0]:
                    spans[j][1] = max(spans[j][1], spans[j + 1][1])
                    del spans[j + 1]
                elif j < i:
                    j += 1
                else:
                    break
            self.grown.notify_all()
        return True

    def _overlap(self, name: str, offset: int, n: int) -> int:
        """Bytes of ``[offset, offset + n)`` already kept (the caller holds ``lock``)."""
        return sum(max(0, min(b, offset + n) - max(a, offset)) for a, b in self.spans.get(name, ()))

    def room(self) -> int:
        """Bytes it may still keep."""
        with self.lock:
            return max(0, self.budget - self.used)

    def path(self, name: str) -> Path:
        """The local file that holds the kept ranges of the data object ``name`` (at their own offsets)."""
        return self.folder / name

    def close(self) -> None:
        with self.lock:
            for fd in [*self.fds.values(), *(d for d in self.direct.values() if d is not None)]:
                os.close(fd)
            self.fds.clear()
            self.direct.clear()
            self.spans.clear()



class Mirror:
    """Every data object of a remote checkpoint fetched whole, once, into the local files of its
    `ReadCache` (`ReadCache.path`), up to `MIRROR_STREAMS` objects at once, each by one GET whose
    body is written into the cache as it arrives: a conversion splices its items from those files
    as it does from a local source (`reshard.engine.copy`), each item as soon as its byte range is
    there (`wait`, `ready`), and its verification reads the same files again, so every byte is
    fetched once and read from this machine after that.

    Why whole objects and not the copy's ranges: a conversion reads every byte of every data
    object, and a ranged GET costs a request each (on moto, a read of the whole object on the
    server per range: issue 45 measured it); one streamed GET per object moves each byte once,
    in order, and overlaps with the copy, which waits only for the items it has reached.

    The bytes are the store's, pinned to the ETag listed (`RemoteCheckpoint.pin`); every reader
    checks them against their writer's CRC-32s, as on disk. An error of any stream stops the
    others and is raised where an item waits for bytes that will not come."""

    def __init__(self, rc: RemoteCheckpoint, names: list[str], *, streams: int = MIRROR_STREAMS):
        assert rc.kept is not None
        self.rc, self.cache = rc, rc.kept
        self.names = [n for n in names if rc.sizes.get(n)]
        self.wanted = set(self.names)
        self.error: BaseException | None = None
        self.stopped = False
        self.fetched = 0
        self.thread = threading.Thread(target=self._run, args=(max(1, streams),), name="reshard-mirror", daemon=True)
        self.thread.start()

    @property
    def root(self) -> Path:
        """The folder of the local files (each named as its object)."""
        return self.cache.folder

    def _run(self, streams: int) -> None:
        try:
            if hasattr(self.rc.fs, "_call_s3") and getattr(self.rc.fs, "loop", None) is not None:
                from fsspec.asyn import sync

                sync(self.rc.fs.loop, self._streams, streams)
            else:  # another store's filesystem: the objects by ranges of `PIECE`, one after another
                for name in self.names:
                    self._by_ranges(name)
        except BaseException as exc:  # noqa: BLE001 - raised where an item waits (`wait`)
            with self.cache.grown:
                self.error = exc
                self.cache.grown.notify_all()

    async def _streams(self, streams: int) -> None:
        import asyncio

        todo = list(self.names)

        async def worker() -> None:
            buf = fileio.aligned_buffer(MIRROR_CHUNK)  # one per stream, reused: the chunks go to disk by direct I/O
            while todo and not self.stopped:
                await self._stream(todo.pop(0), buf)

        tasks = [asyncio.ensure_future(worker()) for _ in range(min(streams, len(todo)))]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            raise

    async def _stream(self, name: str, buf: memoryview) -> None:
        """One object by one GET, its body kept in the cache as it arrives, `MIRROR_CHUNK` at a time
        gathered in ``buf`` (an aligned buffer: `ReadCache.put` writes its whole blocks by direct I/O)."""
        rc, size = self.rc, self.rc.sizes[name]
        bucket, key, _version = rc.fs.split_path(f"{rc.base}/{name}")
        if rc.pinned is not None:
            rc.pin()
        rc.counters.started()
        try:
            try:
                resp = await rc.fs._call_s3("get_object", Bucket=bucket, Key=key, **rc.fs.req_kw)
            except FileNotFoundError:
                raise Incomplete(f"data file '{name}' disappeared while it was read", where=rc.url,
                                 hint="Something deleted it under reshard; use another checkpoint.") from None
            except Exception as exc:  # noqa: BLE001 - a store's errors, in one paragraph
                raise store_error(exc, doing=f"cannot read '{name}'", where=rc.where(name), limits=rc.limits,
                                  hint="Check the endpoint and the credentials' read rights.") from None
            body, done = resp["Body"], 0
            try:
                while done < size and not self.stopped:
                    got = 0
                    while got < MIRROR_CHUNK and done + got < size:
                        b = await body.read(min(1 << 20, MIRROR_CHUNK - got, size - done - got))
                        if not b:
                            break
                        buf[got:got + len(b)] = b
                        got += len(b)
                    if not got:
                        break
                    self._keep(name, done, buf[:got])
                    done += got
            except ReshardError:
                raise
            except Exception as exc:  # noqa: BLE001 - a stream cut: one paragraph, the command fails
                raise store_error(exc, doing=f"cannot read bytes of '{name}'", where=rc.where(name),
                                  limits=rc.limits, hint="Check the endpoint and the network; run the command again.") from None
            finally:
                body.close()
        finally:
            rc.counters.ended()
        rc.counters.add(name, done)
        if done != size and not self.stopped:
            raise Incomplete(f"the store returned {done} of {size} bytes of '{name}'", where=rc.where(name),
                             hint="The object changed or is truncated; retry or use another checkpoint.")

    def _by_ranges(self, name: str) -> None:
        size, done = self.rc.sizes[name], 0
        while done < size and not self.stopped:
            n = min(PIECE, size - done)
            self.rc._read(name, done, n, key=None)  # kept in the cache by `_read` (counted there)
            done += n

    def _keep(self, name: str, offset: int, data: bytes | memoryview) -> None:
        if not self.cache.put(name, offset, data):
            raise BadInput(f"cannot keep the bytes of '{name}' in the local read cache ({self.cache.folder}): "
                           "its disk is full or refused the write", where=self.rc.where(name),
                           hint="Free space there (the temporary folder: TMPDIR), or set RESHARD_READ_CACHE=0.")
        self.fetched += len(data)

    def wait(self, name: str, offset: int, length: int) -> None:
        """Until ``[offset, offset + length)`` of the object ``name`` is in the local file (at once for
        an object this mirror does not fetch); a stream's error is raised here."""
        if name not in self.wanted:
            return
        with self.cache.grown:
            while not self.cache.covered(name, offset, length):
                if self.error is not None:
                    raise self.error
                if self.stopped:
                    return
                self.cache.grown.wait(1.0)

    def ready(self, entry: Any) -> None:
        """Until every item of ``entry`` (a tensor of the index) is in the local files (`wait`)."""
        for c in entry.chunks:
            loc = c.location
            if loc is not None:
                self.wait(loc.file, loc.offset, loc.length)

    def stop(self) -> None:
        """No more waiting: the streams end after the chunk in hand, and a waiter returns at once."""
        with self.cache.grown:
            self.stopped = True
            self.cache.grown.notify_all()

    def close(self) -> None:
        """`stop`, and wait for the streams. What they had not fetched yet is fetched by range if a
        reader asks for it (`RemoteCheckpoint.read_range`)."""
        self.stop()
        self.thread.join()


class Prefetch:
    """Ranges of one remote checkpoint fetched ahead on a bounded pool (`RemoteCheckpoint.prefetching`).

    A feeder thread walks the ranges in order and submits each once the bytes fetched and not
    yet taken leave room for it (``memory``); the pool has ``in_flight`` threads, so no more
    requests run at once. `take` hands a range's bytes to its reader and frees its room. A
    range listed again while it is still pending is fetched once for all its readers (a source
    item that feeds several target chunks), and one the read cache already holds is not
    fetched at all (`ReadCache`: its readers read it there).
    """

    def __init__(self, rc: RemoteCheckpoint, ranges: Iterable[tuple[str, int, int]], *, in_flight: int, memory: int):
        from concurrent.futures import ThreadPoolExecutor

        self.rc = rc
        self.memory = max(1, memory)
        self.pool = ThreadPoolExecutor(max_workers=max(1, in_flight), thread_name_prefix="reshard-fetch")
        self.cond = threading.Condition()
        self.pending: dict[tuple[str, int, int], list[Any]] = {}  # range -> [its request, readers still to take it]
        self.buffered = self.peak_buffered = self.running = self.peak_running = 0
        self.skip: dict[tuple[str, int, int], int] = {}
        self.closed = False
        self.feeder = threading.Thread(target=self._feed, args=(iter(ranges),), name="reshard-prefetch", daemon=True)
        self.feeder.start()

    def _feed(self, ranges: Iterator[tuple[str, int, int]]) -> None:
        for name, offset, length in ranges:
            with self.cond:
                while not self.closed and self.buffered and self.buffered + length > self.memory:
                    self.cond.wait()
                if self.closed:
                    return
                key = (name, offset, length)
                if self.skip.get(key):  # its reader came first and fetched it itself
                    self.skip[key] -= 1
                    continue
                if key in self.pending:  # already under way for an earlier reader: one request for both
                    self.pending[key][1] += 1
                    continue
                kept = self.rc.kept
                if kept is not None and kept.covers(name, offset, length):
                    continue  # fetched before in this run: its reader reads the local copy
                self.buffered += length
                self.peak_buffered = max(self.peak_buffered, self.buffered)
                self.rc.counters.peak_buffered = max(self.rc.counters.peak_buffered, self.buffered)
                fut = self.pool.submit(self._fetch, name, offset, length)
                self.pending[key] = [fut, 1]
                self.cond.notify_all()

    def _fetch(self, name: str, offset: int, length: int) -> bytes:
        with self.cond:
            self.running += 1
            self.peak_running = max(self.peak_running, self.running)
        try:
            return self.rc._read(name, offset, length, key=None)
        finally:
            with self.cond:
                self.running -= 1

    def take(self, name: str, offset: int, length: int) -> bytes | None:
        """The range's bytes if it was foreseen (waiting for its request), else None."""
        key = (name, offset, length)
        with self.cond:
            entry = self.pending.get(key)
            if entry is None:  # not foreseen, or the feeder has not reached it: the reader fetches it, the feeder skips it
                self.skip[key] = self.skip.get(key, 0) + 1
                return None
            fut = entry[0]
            entry[1] -= 1
            last = entry[1] == 0
            if last:
                del self.pending[key]
        try:
            data = fut.result()
        finally:
            if last:  # its room is freed once its last reader has it
                with self.cond:
                    self.buffered -= length
                    self.cond.notify_all()
        with self.rc.counters.lock:
            self.rc.counters.prefetched += 1
        return data

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.feeder.join()
        self.pool.shutdown(wait=True, cancel_futures=True)


def open_remote(url: str) -> RemoteCheckpoint:
    """A URL opened through fsspec (`open_store`) and listed once; on S3 every read is pinned to
    the version listed (`RemoteCheckpoint.pin`)."""
    fs, base, parsed, limits = open_store(url)
    return RemoteCheckpoint(str(parsed), fs, base, limits=limits, pin=parsed.family == "s3")


@contextmanager
def staged(url: str, *, sidecars_cap: int = SIDECARS_CAP,
           fetch: Callable[[str], bool] | None = None) -> Iterator[tuple[Path, RemoteCheckpoint]]:
    """A private local directory standing for the checkpoint at ``url`` while the block runs, with
    the `RemoteCheckpoint` its data is read through: `.metadata` and the sidecars fetched by byte
    range (at most `FETCHERS` at once), no data file (their bytes are read through the
    `RemoteCheckpoint`, which `reshard.storage.source.Source` hands to its readers). The directory
    is removed afterwards, whatever happens.

    ``fetch(name)``: whether a sidecar is fetched now (a reader may open it by name: its format
    is known, or it is reshard's own); the others are `RemoteCheckpoint.deferred`, listed from
    the listing alone and fetched only when a conversion carries them (`sidecars.carry_sidecars`).
    Without it every sidecar is fetched. Before any request, the objects beside the data files
    are bounded in number (`MAX_OBJECTS`) and the fetched ones in bytes (``sidecars_cap``)."""
    rc = open_remote(url)
    tmp = Path(tempfile.mkdtemp(prefix="reshard-remote-"))
    root = tmp / "ckpt"
    root.mkdir()
    rc.cache_folder = tmp
    try:
        data = set(rc.data_files())
        side = {k: n for k, n in rc.sizes.items() if k != METADATA_FILE and k not in data}
        if len(side) > MAX_OBJECTS:
            raise BadInput(f"the prefix holds {len(side):,} objects besides the data objects, more than the "
                           f"{MAX_OBJECTS:,} a checkpoint's sidecars are (nothing was fetched)", where=rc.url,
                           hint="Give the checkpoint's own prefix (the one that holds `.metadata`), not a folder "
                                "of many things.")
        now = {k: n for k, n in side.items() if fetch is None or fetch(k)}
        rc.deferred = {k: n for k, n in side.items() if k not in now}
        if sum(now.values()) > sidecars_cap:
            raise BadInput(f"the files beside the data objects hold {sum(now.values()):,} bytes, more than the "
                           f"{sidecars_cap:,} reshard fetches to describe a checkpoint", where=rc.url,
                           hint="Something other than a checkpoint's sidecars is stored under this prefix; "
                                "give the checkpoint's own prefix.")
        if METADATA_FILE in rc.sizes:  # bounded as `dcp.metadata_cap` bounds it on disk (checked again there)
            rc.fetch_to(METADATA_FILE, root / METADATA_FILE, limit=max(METADATA_FLOOR, rc.data_bytes()))
        if now:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=FETCHERS, thread_name_prefix="reshard-sidecar") as pool:
                for done in [pool.submit(rc.fetch_to, t, root / t, limit=sidecars_cap) for t in sorted(now)]:
                    done.result()
        try:
            yield root, rc
        except ReshardError as exc:  # an error names the URL, never the private directory
            _name_the_url(exc, root, rc.url)
            raise
    finally:
        if rc.kept is not None:
            rc.kept.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _name_the_url(exc: ReshardError, root: Path, url: str) -> None:
    """``exc`` speaking of the URL wherever it names the private staged directory (its place and its message)."""
    for local in sorted({str(root), os.path.realpath(root)}, key=len, reverse=True):
        if exc.where and exc.where.startswith(local):
            exc.where = url + exc.where[len(local):]
        exc.message = exc.message.replace(local, url)
        if exc.hint:
            exc.hint = exc.hint.replace(local, url)
    exc.args = (exc.render(),)
