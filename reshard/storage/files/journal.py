"""Resume an interrupted conversion: a journal of the items written, kept beside the output.

A conversion killed at 95 % of a terabyte would otherwise start again from zero. Its hidden
temporary directory (`reshard.storage.files.atomic.atomic_directory`) still holds every item it
wrote, and the layout of the output depends only on the plan (`DcpWriter` reserves items in
one fixed order), so a rerun with the same plan reserves every item at the same offset. This
module records which items were written and lets the rerun keep the ones whose bytes are
still right.

What is recorded (in ``journal_dir(tmp)``, a sibling of the temporary directory, so the
output itself never contains it):

* ``key.json``, written before the first data byte: the resume key, i.e. the plan's
  fingerprint, the source's identity (every file's relative path, size and ``mtime_ns``:
  what ``make`` and ``rsync`` trust, read with one ``stat`` per file) and the options that
  change the bytes without being part of the plan (output format, reshard and torch
  versions). I/O options (threads, window, direct or buffered I/O, number of workers) are
  not in it: they never change a byte.
* ``<data file>.jsonl``, one line per item once its bytes are written (offset, length and
  CRC-32 of exactly those bytes). Lines are appended with one ``write`` each (a SIGKILL never
  tears one) and the journal is fsynced at most every `SYNC_SECONDS` and when the writer closes.

A rerun into the same destination (`Journal.choose`) reuses the interrupted run's
temporary directory only when its key equals the rerun's; otherwise it starts over and says
why (the source changed, the plan changed, an option changed, the journal is unreadable or
holds something that is not a plain file of its own, such as a symlink; ``--restart``: on
purpose). A reused directory loses everything but its journaled data files
(`Journal.prepare`), and every journal file is opened with ``O_NOFOLLOW``: a symlink planted
in the journal directory is never followed, so nothing outside it is read or written.

The key is a hint, not a proof: sizes and mtimes are what ``cp -p``, ``touch -r`` and
``rsync -t`` carry over to other bytes, and a journal line is a file anyone who can write the
directory can edit. So a journaled item is only a *candidate* (`Journal.claim`): the writer
keeps it only once this run has shown that its bytes on disk now are exactly the bytes this
run would write from the source as it is now (`reshard.storage.checkpoints.dcp_writer.DcpWriter`, and
`reshard.engine.resume.prove_spliced` for items spliced from source bytes). The recorded
CRC-32 is never evidence; it only tells, for the report, an item changed since its line was
written ("damaged") from one whose line still matches but whose bytes are not this source's.
Every candidate not shown equal is rewritten, so the output is byte-identical to an
uninterrupted run's whatever happened to the source or the directory in between.

Distributed runs: the data files are divided among the workers; each worker opens and
proves the items journaled for the files it writes. The decision to resume or start over is
made once, by the worker that holds the destination's lock, and sent to every worker.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # handed down with the source
    from reshard.storage.objectstore.remote import RemoteCheckpoint
from reshard.storage.files.atomic import fsync_dir, journal_dir

__all__ = ["KEY_FILE", "SYNC_SECONDS", "Journal", "ResumeKey", "describe", "merge_summaries", "source_identity"]

KEY_FILE = "key.json"
SYNC_SECONDS = 2.0  # how stale the journal may be on disk after a power cut (a SIGKILL loses nothing)
LINE_MAX = 64 << 10   # a journal line is about 60 bytes: a longer one is not this writer's (skipped, its item rewritten)
KEY_MAX = 256 << 20   # the key lists every source file (about 60 bytes each)
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_HEX = frozenset("0123456789abcdef")


def source_identity(root: Path, rc: RemoteCheckpoint | None = None) -> dict[str, list[int]]:
    """Every regular file under ``root`` -> ``[size, mtime_ns]`` (relative POSIX paths, symlinks by their target).

    One ``stat`` per file: a source rewritten in place with the same size within the same
    nanosecond goes unnoticed, as it does for ``make`` and ``rsync``. ``rc``: the store ``root``
    stands for (a staged directory), handed down with the source: its objects are the identity.
    """
    if rc is not None:  # a checkpoint in a store, staged: its objects by the one listing (size, version tag)
        return rc.identity()
    out: dict[str, list[int]] = {}
    root = Path(root)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            p = Path(dirpath) / name
            try:
                st = p.stat()
            except OSError:
                continue
            out[p.relative_to(root).as_posix()] = [int(st.st_size), int(st.st_mtime_ns)]
    return out


@dataclass(frozen=True)
class ResumeKey:
    """What must be equal for a rerun to keep an interrupted run's bytes."""

    plan: str                       # the plan's fingerprint
    source: dict[str, list[int]]    # `source_identity`
    options: dict[str, str]         # options that change the bytes and are not in the plan

    def to_dict(self) -> dict[str, Any]:
        return {"version": 1, "plan": self.plan, "source": self.source, "options": self.options}

    @classmethod
    def from_dict(cls, d: Any) -> "ResumeKey":
        if not isinstance(d, dict) or d.get("version") != 1:
            raise ValueError("unknown journal version")
        src = {str(k): [int(x) for x in v] for k, v in dict(d["source"]).items()}
        return cls(str(d["plan"]), src, {str(k): str(v) for k, v in dict(d["options"]).items()})

    def why_not(self, old: "ResumeKey") -> str | None:
        """Why an interrupted run with key ``old`` cannot be resumed under this key (None: it can)."""
        if old.source != self.source:
            return "the source changed since the interrupted run (" + _first_change(old.source, self.source) + ")"
        if old.plan != self.plan:
            return f"the plan changed since the interrupted run (fingerprint {old.plan}, now {self.plan})"
        for name in sorted(set(old.options) | set(self.options)):
            if old.options.get(name) != self.options.get(name):
                return (f"an option that changes the bytes changed since the interrupted run ({name}: "
                        f"{old.options.get(name)}, now {self.options.get(name)})")
        return None


def _first_change(old: dict[str, list[int]], new: dict[str, list[int]]) -> str:
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name), new.get(name)
        if a == b:
            continue
        if a is None:
            return f"{name} was added"
        if b is None:
            return f"{name} was removed"
        if a[0] != b[0]:
            return f"{name}: {a[0]} bytes, now {b[0]}"
        return f"{name}: modified since (same size, another mtime)"
    return "?"  # pragma: no cover - called only when they differ


@dataclass
class Journal:
    """One process's side of a resumable conversion; a `reshard.storage.checkpoints.dcp_writer.DcpWriter` calls
    `open_file`, `claim`, `kept_item`, `rewritten` and `record`, the command calls `choose` (the
    lock holder), `begin` (every process, once the temporary directory is known) and `summary`.

    ``restart``: discard an interrupted run's work on purpose (``--restart``).
    """

    key: ResumeKey
    restart: bool = False
    resumed: bool = False
    message: str | None = None                # what the command says about the decision, or None
    directory: Path | None = None             # the temporary directory written into
    _candidates: dict[str, dict[tuple[int, int], str]] = field(default_factory=dict)  # file -> item -> recorded CRC
    _fds: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _synced: float = field(default_factory=time.monotonic)
    items_kept: int = 0                       # journaled items shown equal, in this run, to what it writes
    bytes_kept: int = 0
    items_written: int = 0
    items_damaged: int = 0                    # journaled items whose bytes no longer have their recorded CRC-32
    items_not_matching: int = 0               # ... that have it, but are not what this run writes from the source now
    files_kept: set[str] = field(default_factory=set)

    # ------------------------------------------------------------------ the decision (lock holder)
    def choose(self, candidates: list[Path]) -> Path | None:
        """The interrupted run's temporary directory to continue in, or None (start a new one).

        ``candidates``: the temporary directories earlier runs into the same destination left
        (`reshard.storage.files.atomic.stale_temporaries`); the newest one with a journal key is
        considered. Sets `resumed` and `message` (why not, when there was something to resume).
        """
        found: list[tuple[float, Path, ResumeKey | None, str | None]] = []
        for tmp in candidates:
            jd = journal_dir(tmp)
            try:
                st = os.lstat(jd / KEY_FILE) if stat.S_ISDIR(os.lstat(jd).st_mode) else os.lstat(jd)
            except FileNotFoundError:
                continue  # a run from before journals, or killed before its first byte: nothing to keep
            except OSError:
                continue
            old, why = None, _untrusted(tmp)
            if why is None:
                try:
                    old = ResumeKey.from_dict(_read_json(jd / KEY_FILE, KEY_MAX))
                except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
                    why = "the interrupted run's journal is unreadable"
            found.append((st.st_mtime, tmp, old, why))
        if not found:
            return None
        _when, tmp, old, why = max(found, key=lambda f: f[0])
        if self.restart:
            self.message = "starting over (--restart): the interrupted run's partial output is discarded"
            return None
        if why is None and old is not None:
            why = self.key.why_not(old)
        if why is not None:
            self.message = f"starting over: {why}; its partial output is discarded"
            return None
        self.resumed = True
        return tmp

    def prepare(self, tmp: Path) -> None:
        """A reused temporary directory back to its journaled data files (the lock holder, before anyone writes):
        ``.metadata``, the manifest, the reports, copied sidecars, unjournaled files and anything that is
        not a regular file with one link (a symlink or a hard link would be written through) go."""
        jd = journal_dir(tmp)
        with os.scandir(jd) as it:
            journaled = {e.name[:-len(".jsonl")] for e in it if e.name.endswith(".jsonl")}
        with os.scandir(tmp) as it:
            entries = list(it)
        for e in entries:
            if e.name in journaled and _own_file(e.stat(follow_symlinks=False)):
                continue
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(e.path, ignore_errors=True)
            else:
                os.unlink(e.path)
        fsync_dir(tmp)

    def begin(self, tmp: Path, *, lead: bool = True) -> None:
        """Start journaling into ``tmp`` (every process). A fresh run's lock holder first writes the key,
        durably, before any data byte exists: a directory without it is never resumed."""
        self.directory = Path(tmp)
        jd = journal_dir(tmp)
        if not lead:
            return
        if self.resumed:
            self.prepare(self.directory)
            return
        if os.path.islink(jd):
            os.unlink(jd)
        shutil.rmtree(jd, ignore_errors=True)
        jd.mkdir()
        part = jd / (KEY_FILE + ".tmp")
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
        try:
            os.write(fd, json.dumps(self.key.to_dict(), sort_keys=True).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(part, jd / KEY_FILE)
        fsync_dir(jd)

    # ------------------------------------------------------------------ the writer's side
    def open_file(self, name: str) -> bool:
        """Before the writer opens its data file ``name``: read the items journaled for it (resumed
        runs: the candidates the writer may keep once it has proven them) and open its journal for
        appending. Returns whether the file is reused (open it without creating it afresh).

        The journal is rewritten first (a new file renamed over the old name, so a symlink or a hard
        link planted there is replaced, never written through) with the readable lines only, then
        opened ``O_NOFOLLOW``; a line that is not this writer's (torn, too long, too deep, the
        wrong types) is dropped and its item rewritten."""
        assert self.directory is not None, "Journal.begin first"
        path = self.directory / name
        jpath = journal_dir(self.directory) / f"{name}.jsonl"
        reuse = False
        lines: dict[tuple[int, int], str] = {}
        if self.resumed:
            try:
                st = os.lstat(path)
                reuse = _own_file(st)
            except FileNotFoundError:
                pass
            if reuse:
                for (offset, length), crc in _read_lines(jpath).items():
                    if offset + length <= st.st_size:
                        lines[(offset, length)] = crc
                    else:
                        self.items_damaged += 1  # the file ends before the item: its bytes are lost
                self._candidates[name] = lines
        part = jpath.with_name(jpath.name + ".tmp")
        try:
            os.unlink(part)
        except FileNotFoundError:
            pass
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | _NOFOLLOW, 0o644)
        if lines:
            os.write(fd, b"".join(_line(o, n, c) for (o, n), c in sorted(lines.items())))
        os.replace(part, jpath)
        self._fds[name] = fd
        return reuse

    def claim(self, file: str, offset: int, length: int) -> str | None:
        """The CRC-32 recorded for the journaled item at ``file:offset`` of ``length`` bytes (a candidate
        the writer keeps only once it has proven it), or None: no line for it, write it."""
        with self._lock:
            return self._candidates.get(file, {}).pop((offset, length), None)

    def kept_item(self, file: str, length: int) -> None:
        """A claimed item was shown, in this run, to be exactly the bytes this run writes: kept."""
        with self._lock:
            self.items_kept += 1
            self.bytes_kept += length
            self.files_kept.add(file)

    def rewritten(self, recorded: str, found: str) -> None:
        """A claimed item was not what this run writes (its bytes as read now have CRC-32 ``found``;
        the journal said ``recorded``): counted by why, then written like any other item."""
        with self._lock:
            if found != recorded:
                self.items_damaged += 1
            else:
                self.items_not_matching += 1

    def record(self, file: str, offset: int, length: int, crc: str) -> None:
        """One item's bytes are written: its journal line (one append)."""
        os.write(self._fds[file], _line(offset, length, crc))
        self.items_written += 1
        now = time.monotonic()
        if now - self._synced > SYNC_SECONDS:
            self._synced = now
            self.sync()

    def sync(self) -> None:
        for fd in self._fds.values():
            os.fsync(fd)

    def close(self) -> None:
        """fsync and close the journals (idempotent; the writer's `close` calls it)."""
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            try:
                os.fsync(fd)
            except OSError:
                pass
            os.close(fd)

    # ------------------------------------------------------------------ the result
    def summary(self) -> dict[str, Any]:
        """What the report records of the resume (this process's files). Every kept item was
        compared in this run with what this run writes from the source as it is now."""
        return {"resumed": self.resumed, "items_kept": self.items_kept,
                "items": self.items_kept + self.items_written, "files_kept": len(self.files_kept),
                "bytes_not_rewritten": self.bytes_kept, "items_damaged": self.items_damaged,
                "items_not_matching_source": self.items_not_matching,
                "kept_items_checked": "compared in this run with the bytes it writes from the source as it is now",
                "message": self.message}


_COUNTS = ("items_kept", "items", "files_kept", "bytes_not_rewritten", "items_damaged", "items_not_matching_source")


def merge_summaries(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The workers' `Journal.summary` as one (the decision and its message are the same on all)."""
    out = dict(parts[0])
    for k in _COUNTS:
        out[k] = sum(int(p.get(k, 0)) for p in parts)
    return out


def describe(summary: dict[str, Any]) -> str | None:
    """The line a conversion prints on stderr about resuming, or None when there was nothing to resume."""
    if summary.get("resumed"):
        from reshard.units import human_bytes

        line = (f"resumed: {summary['items_kept']:,} of {summary['items']:,} items kept "
                f"(in {summary['files_kept']} files, each compared with the source in this run), "
                f"{human_bytes(summary['bytes_not_rewritten'])} not rewritten")
        if summary.get("items_not_matching_source"):
            line += (f"; {summary['items_not_matching_source']:,} journaled items no longer matched the source "
                     "and were rewritten")
        if summary["items_damaged"]:
            line += (f"; {summary['items_damaged']:,} journaled items no longer had their recorded CRC-32 "
                     "(file damaged) and were rewritten")
        return line
    return summary.get("message")


def _own_file(st: os.stat_result) -> bool:
    """A regular file with no other name: writing it in place changes nothing outside the directory."""
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1


def _untrusted(tmp: Path) -> str | None:
    """Why an interrupted run's journal directory cannot be trusted (None: it can): it or an entry in it
    is a symlink, or an entry is not a regular file with one link. Such state is never followed:
    the rerun starts over."""
    jd = journal_dir(tmp)
    try:
        if not stat.S_ISDIR(os.lstat(tmp).st_mode):
            return f"the interrupted run's temporary directory {tmp.name} is not a directory (a symlink?), which is never followed"
        if not stat.S_ISDIR(os.lstat(jd).st_mode):
            return f"the interrupted run's journal directory {jd.name} is not a directory (a symlink?), which is never followed"
        with os.scandir(jd) as it:
            for e in it:
                if e.is_symlink():
                    return f"the interrupted run's journal holds a symlink ({e.name}), which is never followed"
                if not _own_file(e.stat(follow_symlinks=False)):
                    return f"the interrupted run's journal holds {e.name}, which is not a regular file of its own (a hard link?)"
    except OSError as exc:
        return f"the interrupted run's journal cannot be read ({exc.strerror or exc})"
    return None


def _open_regular(path: Path) -> int:
    """A read descriptor of ``path`` that is a regular file, never through a symlink (`OSError` otherwise)."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path.name} is not a regular file")
    return fd


def _read_json(path: Path, cap: int) -> Any:
    """A small JSON file read through `_open_regular`, at most ``cap`` bytes (larger: `ValueError`)."""
    fd = _open_regular(path)
    with os.fdopen(fd, "rb") as f:
        data = f.read(cap + 1)
    if len(data) > cap:
        raise ValueError(f"{path.name} is larger than {cap} bytes")
    return json.loads(data)


def _line(offset: int, length: int, crc: str) -> bytes:
    return (json.dumps({"o": offset, "n": length, "c": crc}, separators=(",", ":")) + "\n").encode()


def _read_lines(path: Path) -> dict[tuple[int, int], str]:
    """(offset, length) -> recorded CRC-32; a later line for the same item wins. A line that is not
    this writer's (torn, longer than `LINE_MAX`, nested too deep for the parser, the wrong types) is
    skipped, so its item is rewritten; a journal that is not a regular file (a symlink) yields nothing."""
    out: dict[tuple[int, int], str] = {}
    try:
        fd = _open_regular(path)
    except OSError:
        return out
    with os.fdopen(fd, "rb") as f:
        while True:
            ln = f.readline(LINE_MAX + 1)
            if not ln:
                break
            if len(ln) > LINE_MAX or not ln.endswith(b"\n"):
                while ln and not ln.endswith(b"\n"):  # the rest of an overlong line
                    ln = f.readline(LINE_MAX + 1)
                continue
            item = _parse_line(ln)
            if item is not None:
                out[item[0]] = item[1]
    return out


def _parse_line(ln: bytes) -> tuple[tuple[int, int], str] | None:
    try:
        d = json.loads(ln)
    except (ValueError, RecursionError):
        return None
    if not isinstance(d, dict):
        return None
    o, n, c = d.get("o"), d.get("n"), d.get("c")
    if type(o) is not int or type(n) is not int or o < 0 or n < 0:
        return None
    if not isinstance(c, str) or len(c) != 8 or not set(c) <= _HEX:
        return None
    return (o, n), c
