"""Resume an interrupted conversion: a journal of the items written, kept beside the output.

A conversion killed at 95 % of a terabyte would otherwise start again from zero. Its hidden
temporary directory (`reshard.storage.atomic.atomic_directory`) still holds every item it
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
* ``<data file>.jsonl``, one line per item once its bytes are written (offset, length,
  CRC-32 of exactly those bytes, and how the item was checked against the source while it
  was written: the writer's ``check`` record, replayed by a rerun that keeps the item so its
  verification and report are the uninterrupted run's). Lines are appended with one ``write`` each (a SIGKILL never tears one)
  and the journal is fsynced at most every `SYNC_SECONDS` and when the writer closes.

A rerun into the same destination (`Journal.choose`) reuses the interrupted run's
temporary directory only when its key equals the rerun's; otherwise it starts over and says
why (the source changed, the plan changed, an option changed, the journal is unreadable;
``--restart``: on purpose). A reused directory loses everything but its journaled data files
(`Journal.prepare`). Each data file's journal is then checked before the file is reopened
(`Journal.open_file`): every journaled item is read back and kept only if its CRC-32 equals
the recorded one, so the journal alone is never trusted (a line whose bytes a power cut
lost, or a byte changed since, costs a rewrite, never a wrong byte). The writer skips the
kept items and writes every other one in place, so the output is byte-identical to an
uninterrupted run's.

A kept item's check is covered by the key: the same source files (size and mtime) and the
same bytes as when it was checked. A kept item with no check record is compared with the
source by the rerun's verification like any item written after the fact.

Distributed runs: the data files are divided among the workers; each worker opens and
checks the journals of the files it writes. The decision to resume or start over is made
once, by the worker that holds the destination's lock, and sent to every worker.
"""
from __future__ import annotations

import json
import os
import shutil
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reshard.storage.atomic import fsync_dir, fsync_file, journal_dir

__all__ = ["KEY_FILE", "SYNC_SECONDS", "Journal", "ResumeKey", "describe", "merge_summaries", "source_identity"]

KEY_FILE = "key.json"
SYNC_SECONDS = 2.0  # how stale the journal may be on disk after a power cut (a SIGKILL loses nothing)
_READ_SLAB = 8 << 20


def source_identity(root: Path) -> dict[str, list[int]]:
    """Every regular file under ``root`` -> ``[size, mtime_ns]`` (relative POSIX paths, symlinks by their target).

    One ``stat`` per file: a source rewritten in place with the same size within the same
    nanosecond goes unnoticed, as it does for ``make`` and ``rsync``.
    """
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
class _Kept:
    crc: str
    check: dict[str, Any] | None


@dataclass
class Journal:
    """One process's side of a resumable conversion; a `reshard.storage.dcp_writer.DcpWriter` calls
    `open_file`, `kept`, `vouch` and `record`, the command calls `choose` (the lock holder),
    `begin` (every process, once the temporary directory is known) and `summary`.

    ``restart``: discard an interrupted run's work on purpose (``--restart``).
    """

    key: ResumeKey
    restart: bool = False
    resumed: bool = False
    message: str | None = None                # what the command says about the decision, or None
    directory: Path | None = None             # the temporary directory written into
    _kept: dict[str, dict[tuple[int, int], _Kept]] = field(default_factory=dict)
    _fds: dict[str, int] = field(default_factory=dict)
    _vouched: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _synced: float = field(default_factory=time.monotonic)
    items_kept: int = 0
    bytes_kept: int = 0
    items_written: int = 0
    items_damaged: int = 0
    files_kept: set[str] = field(default_factory=set)

    # ------------------------------------------------------------------ the decision (lock holder)
    def choose(self, candidates: list[Path]) -> Path | None:
        """The interrupted run's temporary directory to continue in, or None (start a new one).

        ``candidates``: the temporary directories earlier runs into the same destination left
        (`reshard.storage.atomic.stale_temporaries`); the newest whose journal key is readable
        is considered. Sets `resumed` and `message` (why not, when there was something to resume).
        """
        found: list[tuple[float, Path, ResumeKey | None]] = []
        for tmp in candidates:
            kf = journal_dir(tmp) / KEY_FILE
            try:
                old: ResumeKey | None = ResumeKey.from_dict(json.loads(kf.read_text()))
                when = kf.stat().st_mtime
            except FileNotFoundError:
                continue  # a run from before journals, or killed before its first byte: nothing to keep
            except (OSError, ValueError, KeyError, TypeError):
                old, when = None, 0.0
            found.append((when, tmp, old))
        if not found:
            return None
        _when, tmp, old = max(found, key=lambda f: f[0])
        if self.restart:
            self.message = "starting over (--restart): the interrupted run's partial output is discarded"
            return None
        why = "the interrupted run's journal is unreadable" if old is None else self.key.why_not(old)
        if why is not None:
            self.message = f"starting over: {why}; its partial output is discarded"
            return None
        self.resumed = True
        return tmp

    def prepare(self, tmp: Path) -> None:
        """A reused temporary directory back to its journaled data files (the lock holder, before anyone writes):
        ``.metadata``, the manifest, the reports, copied sidecars and unjournaled files go."""
        jd = journal_dir(tmp)
        journaled = {p.name[:-len(".jsonl")] for p in jd.glob("*.jsonl")}
        with os.scandir(tmp) as it:
            entries = list(it)
        for e in entries:
            if e.name in journaled and e.is_file(follow_symlinks=False):
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
        shutil.rmtree(jd, ignore_errors=True)
        jd.mkdir()
        part = jd / (KEY_FILE + ".tmp")
        part.write_text(json.dumps(self.key.to_dict(), sort_keys=True))
        fsync_file(part)
        os.replace(part, jd / KEY_FILE)
        fsync_dir(jd)

    # ------------------------------------------------------------------ the writer's side
    def open_file(self, name: str) -> bool:
        """Before the writer opens its data file ``name``: check the items journaled for it (resumed
        runs) and open its journal for appending. Returns whether the file is reused (open it
        without creating it afresh)."""
        assert self.directory is not None, "Journal.begin first"
        path = self.directory / name
        jpath = journal_dir(self.directory) / f"{name}.jsonl"
        reuse = self.resumed and path.is_file()
        if reuse:
            self._kept[name] = self._check(path, _read_lines(jpath))
            if self._kept[name]:
                self.files_kept.add(name)
        else:
            try:
                jpath.unlink()
            except FileNotFoundError:
                pass
        self._fds[name] = os.open(jpath, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0), 0o644)
        return reuse

    def _check(self, path: Path, lines: dict[tuple[int, int], tuple[str, Any]]) -> dict[tuple[int, int], _Kept]:
        """The journaled items of ``path`` whose bytes still have their recorded CRC-32 (read back, in offset order)."""
        kept: dict[tuple[int, int], _Kept] = {}
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            size = os.fstat(fd).st_size
            buf = bytearray(_READ_SLAB)
            for (offset, length), (crc, check) in sorted(lines.items()):
                if offset + length > size or _crc_at(fd, offset, length, buf) != crc:
                    self.items_damaged += 1
                    continue
                kept[(offset, length)] = _Kept(crc, check)
        finally:
            os.close(fd)
        return kept

    def kept(self, file: str, offset: int, length: int) -> tuple[str, dict[str, Any] | None] | None:
        """(recorded CRC-32 hex, the check record it was written with, or None) of a kept item, or
        None (write it). Counts the item as kept."""
        k = self._kept.get(file, {}).pop((offset, length), None)
        if k is None:
            return None
        self.items_kept += 1
        self.bytes_kept += length
        return k.crc, k.check

    def vouch(self, file: str, offset: int, check: dict[str, Any]) -> None:
        """How the item at ``file:offset`` was checked against the source as it was written (any
        thread; plain JSON data, the writer's caller decides what it holds)."""
        with self._lock:
            self._vouched[(file, offset)] = check

    def record(self, file: str, offset: int, length: int, crc: str) -> None:
        """One item's bytes are written: its journal line (one append)."""
        with self._lock:
            check = self._vouched.pop((file, offset), None)
        line = json.dumps({"o": offset, "n": length, "c": crc, "v": check}, separators=(",", ":")) + "\n"
        os.write(self._fds[file], line.encode())
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
        """What the report records of the resume (this process's files)."""
        return {"resumed": self.resumed, "items_kept": self.items_kept,
                "items": self.items_kept + self.items_written, "files_kept": len(self.files_kept),
                "bytes_not_rewritten": self.bytes_kept, "items_damaged": self.items_damaged,
                "message": self.message}


def merge_summaries(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The workers' `Journal.summary` as one (the decision and its message are the same on all)."""
    out = dict(parts[0])
    for k in ("items_kept", "items", "files_kept", "bytes_not_rewritten", "items_damaged"):
        out[k] = sum(int(p[k]) for p in parts)
    return out


def describe(summary: dict[str, Any]) -> str | None:
    """The line a conversion prints on stderr about resuming, or None when there was nothing to resume."""
    if summary.get("resumed"):
        from reshard.units import human_bytes

        line = (f"resumed: {summary['items_kept']:,} of {summary['items']:,} items kept "
                f"(in {summary['files_kept']} files), {human_bytes(summary['bytes_not_rewritten'])} not rewritten")
        if summary["items_damaged"]:
            line += (f"; {summary['items_damaged']:,} journaled items no longer had their recorded CRC-32 "
                     "(file damaged) and were rewritten")
        return line
    return summary.get("message")


def _read_lines(path: Path) -> dict[tuple[int, int], tuple[str, Any]]:
    """(offset, length) -> (crc, check record); a later line for the same item wins; a torn last line is ignored."""
    out: dict[tuple[int, int], tuple[str, Any]] = {}
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return out
    for ln in text.splitlines():
        try:
            d = json.loads(ln)
            key = (int(d["o"]), int(d["n"]))
            crc = str(d["c"])
            check = d.get("v")
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        if key[0] < 0 or key[1] < 0 or not (check is None or isinstance(check, dict)):
            continue
        out[key] = (crc, check)
    return out


def _crc_at(fd: int, offset: int, length: int, buf: bytearray) -> str:
    view = memoryview(buf)
    crc, pos, left = 0, offset, length
    while left > 0:
        n = os.preadv(fd, [view[:min(left, len(view))]], pos)
        if n <= 0:
            return ""  # shorter than recorded
        crc = zlib.crc32(view[:n], crc)
        pos += n
        left -= n
    return format(crc & 0xFFFFFFFF, "08x")
