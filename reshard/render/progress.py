"""Progress for people at a terminal and for schedulers: a first line at once, then each long
phase by bytes, with its throughput and an ETA from bytes.

Why it exists: a conversion, a verification or an export of a real checkpoint reads and
writes gigabytes, and a command silent for half a minute looks hung. Counting keys or
chunks says little (one embedding can be a third of the bytes), so every phase counts bytes,
whose totals the index knows before the work starts (`Entry.nbytes` per key); its rate is
the bytes done over the time since the phase began, and its ETA the bytes left at that rate.

Why it looks like this: the commands hold a `Progress` and open a `Phase` per long step
(``with progress.phase("writing", total) as bar``); the layers below (storage, engine)
receive only the phase, an object with ``update(nbytes)``, so they import neither this
module nor tqdm. A phase counts its bytes (``done``) even when nothing is shown, which lets
a test check the totals without a terminal. Each phase belongs to one of the stages an
operator follows (`STAGES`): ``copy`` (writing, linking), ``verify`` (comparing, checking,
verifying), ``commit`` (the fsync and rename that make the output appear) and, for an output
bound for object storage, ``upload`` (the objects sent; `.metadata` last commits it there).

Three modes (``--progress``):

* ``auto`` (the default): a bar per phase on a terminal; nothing when stderr is not a
  terminal (a pipe, a file, CI), under ``--json`` (a script reads the output) or ``--quiet``;
* ``json``: one JSON object per line on stderr, whatever stderr is, for schedulers and
  dashboards: ``{"event": "start"|"progress"|"end", "phase": "copy"|"verify"|"commit"|"upload",
  "step": NAME, "bytes_done", "bytes_total", "rate" (bytes/s), "eta_s", "elapsed_s"}``,
  ``{"event": "message", "text": LINE}`` for the lines a terminal shows, at least once a
  second while a phase is open (so a stalled copy is visible as a stalled count);
* ``none``: nothing (``--quiet``).

Between the lines and the bars, work with no bytes to count (reading an index, planning,
importing torch, starting training ranks) would leave a terminal still for seconds: a command
wraps it in ``with progress.waiting():``, and while the block runs, whenever neither a line
nor a bar has moved for `TICK` seconds, a row under the last line shows the seconds since that
line (``  … 3 s``), redrawn in place every `TICK` and cleared before the next line, bar or the
block's end (so the command's result on stdout never lands on it). Terminal only: a pipe, a
file and ``--progress json`` see nothing more than before.

The row is drawn by a thread, and a Python thread cannot run while another holds the GIL in
one long C call: loading torch's libraries (0.15 s of CPU at rest, seconds on a loaded
machine), a big array operation. So while a waiting block is open on a real terminal, a small
forked process, which needs no GIL of this one, watches too (`_Watchdog`): when neither a line,
a bar nor the row has moved for `LATE` (a little over `TICK`), it draws the row itself. Both draw under one
lock (a token in a pipe, `_TermLock`) and read one state (the last draw, the last line, the
row's width: `_TermState`, in shared memory), so a line never lands on a half-drawn row.

``on_estimate``: where the preflight's size and time estimate goes the moment it is known
(`estimated`), before the first byte is written: `reshard convert` prints it on stdout there,
so a pipe reads the estimate before the result, not after it.

This module imports nothing heavy, so the first line can be printed before torch is imported.
"""
from __future__ import annotations

import json
import mmap
import os
import select
import signal
import struct
import sys
import threading
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, TextIO

from reshard.units import human_bytes

__all__ = ["MODES", "STAGES", "Phase", "Progress", "describe_bytes", "end_commit", "phase_of", "stage_of", "start_commit",
           "waiting"]

MODES = ("auto", "json", "none")
# the stage of each phase name a command opens (`stage_of`: names starting "checking" verify)
STAGES = {"writing": "copy", "linking": "copy", "comparing": "verify", "verifying": "verify", "commit": "commit",
          "uploading": "upload"}
TICK = 1.0  # seconds between two refreshes of an open phase (a json event, or the bar redrawn)
LATE = 1.25 * TICK  # still for this long: the watchdog (`_Watchdog`) draws the waiting row, the thread could not


class _TermState:
    """What the drawers of a terminal share: when it last moved (a line, a bar, the row), when the last
    line was said (the row counts from it) and the width of the row drawn (0: none). In a bytearray,
    moved to shared memory (`share`) when a watchdog process starts, so both see every change."""

    _FIELDS = (("d", 0), ("d", 8), ("i", 16))  # last, line_at, row: each read and written alone

    def __init__(self) -> None:
        self._buf: bytearray | mmap.mmap = bytearray(20)
        self.line_at = time.monotonic()

    def share(self) -> None:
        shared = mmap.mmap(-1, len(self._buf))
        shared[:] = bytes(self._buf)
        self._buf = shared

    def _get(self, i: int) -> Any:
        fmt, offset = self._FIELDS[i]
        return struct.unpack_from(fmt, self._buf, offset)[0]

    def _set(self, i: int, value: Any) -> None:
        fmt, offset = self._FIELDS[i]
        struct.pack_into(fmt, self._buf, offset, value)

    last = property(lambda self: self._get(0), lambda self, v: self._set(0, float(v)))
    line_at = property(lambda self: self._get(1), lambda self, v: self._set(1, float(v)))
    row = property(lambda self: self._get(2), lambda self, v: self._set(2, int(v)))


class _TermLock:
    """The terminal's lock: re-entrant for this process's threads and, while a watchdog runs, held
    against it too (one byte in a pipe: whoever read it holds the terminal; blocking on it releases the GIL)."""

    def __init__(self) -> None:
        self._rlock = threading.RLock()
        self._depth = 0
        self._token: tuple[int, int] | None = None  # (read, write) ends of the token pipe, while a watchdog runs
        self._unowned = False  # the token was not there within a second (a watchdog stopped while holding it)

    def __enter__(self) -> "_TermLock":
        self._rlock.acquire()
        self._depth += 1
        if self._depth == 1 and self._token is not None:
            self._unowned = not select.select([self._token[0]], [], [], 1.0)[0]
            if not self._unowned:
                os.read(self._token[0], 1)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._depth == 1 and self._token is not None and not self._unowned:
            os.write(self._token[1], b"x")
        self._depth -= 1
        self._rlock.release()

    def share(self, token: tuple[int, int] | None) -> None:
        """Install (or remove, with None) the token pipe. Called holding the lock: its outermost release
        puts the first byte in (the byte read on entry, none yet, is the one a removal keeps)."""
        self._token, self._unowned = token, False


@dataclass
class _Watchdog:
    """A forked process that draws the waiting row when this one cannot (a thread holding the GIL).

    It reads `_TermState` in shared memory, takes `_TermLock`'s token to draw, ignores Ctrl-C
    (the command answers it) and leaves at once when ``stop`` closes its pipe or this process
    dies. Only Python that is already imported runs in it, and it ends with ``os._exit``: no
    atexit handler, no buffered stream of this process is touched there.
    """

    pid: int
    stop_w: int
    token: tuple[int, int]

    @classmethod
    def start(cls, fd: int, state: _TermState, lock: _TermLock) -> "_Watchdog | None":
        """Fork the watchdog of terminal ``fd`` (None where there is no fork); call holding ``lock``."""
        if not hasattr(os, "fork"):
            return None
        state.share()
        token = os.pipe()
        stop_r, stop_w = os.pipe()
        parent = os.getpid()
        try:
            pid = os.fork()
        except OSError:
            for x in (*token, stop_r, stop_w):
                os.close(x)
            return None
        if pid == 0:  # the child
            try:
                os.close(stop_w)
                _watch(fd, state, token, stop_r, parent)
            finally:
                os._exit(0)
        os.close(stop_r)
        lock.share(token)
        return cls(pid, stop_w, token)

    def stop(self, lock: _TermLock) -> None:
        """End the watchdog and wait for it (it leaves within a moment of its pipe closing); then
        ``lock`` is this process's alone again. Not called holding ``lock``: the watchdog may be waiting for it."""
        os.close(self.stop_w)
        deadline = time.monotonic() + 5
        while True:
            try:
                done, _ = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere
                break
            if done or time.monotonic() > deadline:
                if not done:
                    with suppress(ProcessLookupError):
                        os.kill(self.pid, signal.SIGKILL)
                    with suppress(ChildProcessError):
                        os.waitpid(self.pid, 0)
                break
            time.sleep(0.005)
        with lock:
            lock.share(None)
        for x in self.token:
            os.close(x)


def _watch(fd: int, state: _TermState, token: tuple[int, int], stop_r: int, parent: int) -> None:
    """The watchdog's loop: each quarter `TICK`, if the terminal has been still for `LATE`, draw the row."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        if select.select([stop_r], [], [], TICK / 4)[0] or os.getppid() != parent:
            return
        if time.monotonic() - state.last < LATE:
            continue
        ready = select.select([token[0], stop_r], [], [], TICK)[0]
        if stop_r in ready or os.getppid() != parent:
            return
        if token[0] not in ready:
            continue
        os.read(token[0], 1)
        try:
            now = time.monotonic()
            if now - state.last >= LATE:
                text = f"  … {int(now - state.line_at)} s"
                os.write(fd, ("\r" + text.ljust(state.row)).encode())
                state.row, state.last = max(state.row, len(text)), now
        except OSError:  # the terminal is gone: nothing left to watch
            return
        finally:
            os.write(token[1], b"x")


def stage_of(name: str) -> str:
    """``copy``, ``verify`` or ``commit`` for a phase name (an unknown name is its own stage)."""
    if name in STAGES:
        return STAGES[name]
    return "verify" if name.startswith("checking") else name


@dataclass
class Phase:
    """One long step: ``update(nbytes)`` adds bytes done (and moves the bar, if one is shown)."""

    name: str
    total: int
    done: int = 0
    bar: Any = None  # a tqdm bar, or None when nothing is shown
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    owner: "Progress | None" = field(default=None, repr=False)

    @property
    def stage(self) -> str:
        return stage_of(self.name)

    def update(self, nbytes: int = 0) -> None:
        """``nbytes`` more bytes of this phase are done (zero or negative: nothing to show)."""
        if nbytes > 0:
            self.done += nbytes
            if self.owner is not None:
                self.owner.moved(self, nbytes)

    __call__ = update

    def elapsed(self) -> float:
        return (self.ended if self.ended is not None else time.monotonic()) - self.started

    def rate(self) -> float | None:
        """Bytes per second since the phase began (None before a measurable time has passed)."""
        t = self.elapsed()
        return self.done / t if t > 1e-3 and self.done else None

    def eta(self) -> float | None:
        """Seconds left: the bytes left at the phase's rate; before a byte is done, at the rate the
        preflight's probes predicted for this stage (`Progress.expect`), else None."""
        if self.done >= self.total:
            return 0.0
        r = self.rate() or self.expected()
        return (self.total - self.done) / r if r else None

    def expected(self) -> float | None:
        return self.owner.expected.get(self.stage) if self.owner is not None else None

    def event(self, kind: str) -> dict[str, Any]:
        """The JSON event of this phase (``--progress json``); ``eta_from``: ``bytes`` (the phase's
        own rate), ``probe`` (the preflight's estimate, before the first byte) or None."""
        rate, eta = self.rate(), self.eta()
        basis = "bytes" if rate else ("probe" if eta is not None and self.done < self.total else None)
        return {"event": kind, "phase": self.stage, "step": self.name, "bytes_done": self.done,
                "bytes_total": self.total, "rate": None if rate is None else round(rate, 1),
                "eta_s": None if eta is None else round(eta, 1), "eta_from": basis if kind != "end" else None,
                "elapsed_s": round(self.elapsed(), 3)}


@dataclass
class Progress:
    """What a command shows while it works: `say` a line, `phase` a bar in bytes; nothing when disabled.

    ``enabled``: bars on ``stream`` (a terminal); ``json``: JSON events on ``stream`` instead.
    """

    enabled: bool = False
    stream: TextIO | None = None
    phases: list[Phase] = field(default_factory=list)  # every phase opened, in order (their byte counts)
    json: bool = False
    expected: dict[str, float] = field(default_factory=dict)  # stage -> bytes/s the preflight's probes predict
    on_estimate: Callable[[dict[str, Any]], None] | None = None  # the preflight's figures, as soon as known (`estimated`)
    _lock: _TermLock = field(default_factory=_TermLock, repr=False)
    # when the terminal last moved, when the last line was said (the row counts from it), and the width of
    # the waiting row (`waiting`) drawn on the stream's last row (0 when none is): shared with the watchdog
    _term: _TermState = field(default_factory=_TermState, repr=False)
    _waits: int = 0  # `waiting` blocks open
    _watchdog: _Watchdog | None = field(default=None, repr=False)

    _last = property(lambda self: self._term.last, lambda self, v: setattr(self._term, "last", v))
    _line_at = property(lambda self: self._term.line_at, lambda self, v: setattr(self._term, "line_at", v))
    _row = property(lambda self: self._term.row, lambda self, v: setattr(self._term, "row", v))

    @classmethod
    def for_terminal(cls, *, quiet: bool = False, json_out: bool = False, stream: TextIO | None = None,
                     mode: str = "auto") -> "Progress":
        """``mode`` auto: shown only on a terminal (stderr by default), never under ``--json`` or
        ``--quiet``; ``json``: JSON events on stderr (even beside ``--json``), not under ``--quiet``."""
        out = stream if stream is not None else sys.stderr
        if quiet or mode == "none":
            return cls(stream=out)
        if mode == "json":
            return cls(stream=out, json=True)
        return cls(enabled=not json_out and _is_terminal(out), stream=out)

    @property
    def active(self) -> bool:
        """Whether anything is shown at all (bars or events)."""
        return (self.enabled or self.json) and self.stream is not None

    def expect(self, stage: str, rate: float | None) -> None:
        """The rate (bytes/s) a stage is expected to move at, from a measurement made before it
        starts (`reshard.engine.space.preflight`): its ETA until its own bytes give one."""
        if rate:
            self.expected[stage] = float(rate)

    def say(self, line: str) -> None:
        """One line at once (the first thing a long command prints, before its heavy imports)."""
        if line and self.active:
            self._write(json.dumps({"event": "message", "text": line}, ensure_ascii=False) if self.json else line)

    def _write(self, line: str) -> None:
        with self._lock:
            self._clear_row()
            self.stream.write(line + "\n")
            self.stream.flush()
            self._line_at = self._last = time.monotonic()

    def estimated(self, figures: dict[str, Any]) -> None:
        """The preflight's size, free-space and time figures, known before the first byte: handed to
        `on_estimate` (with the waiting row cleared, since it may print on the same terminal)."""
        if self.on_estimate is not None:
            with self._lock:
                self._clear_row()
                self.on_estimate(figures)

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """While the block runs, a terminal is never still for much more than `TICK` seconds: when
        no line or bar has moved for that long, a row shows the seconds since the last line,
        redrawn every `TICK` (no bar is open then: a bar moves by itself). The row is cleared
        when the block ends. Nothing at all unless bars are shown (a terminal, not --quiet)."""
        if not (self.enabled and self.stream is not None):
            yield
            return
        with self._lock:
            self._waits += 1
            if self._waits == 1 and self._watchdog is None:
                fd = _terminal_fd(self.stream)
                if fd is not None:
                    self._watchdog = _Watchdog.start(fd, self._term, self._lock)
        stop = threading.Event()
        ticker = threading.Thread(target=self._wait_tick, args=(stop,), daemon=True, name="progress-waiting")
        ticker.start()
        try:
            yield
        finally:
            stop.set()
            ticker.join()
            with self._lock:
                self._waits -= 1
                watchdog = self._watchdog if not self._waits else None
                self._watchdog = None if not self._waits else self._watchdog
            if watchdog is not None:
                watchdog.stop(self._lock)
            with self._lock:
                if not self._waits:
                    with suppress(ValueError, OSError):
                        self._clear_row()

    def _wait_tick(self, stop: threading.Event) -> None:
        while not stop.wait(TICK / 4):
            with self._lock:
                now = time.monotonic()
                if now - self._last < TICK or any(p.bar is not None and p.ended is None for p in self.phases):
                    continue
                text = f"  … {int(now - self._line_at)} s"
                with suppress(ValueError, OSError):  # a stream closed at exit: the daemon ticker just stops
                    self.stream.write("\r" + text.ljust(self._row))
                    self.stream.flush()
                    self._row, self._last = max(self._row, len(text)), now

    @contextmanager
    def cleared(self) -> Iterator[None]:
        """A block that prints on the same terminal by other means (a result, a warning): the
        waiting row is erased first and not redrawn while the block runs."""
        with self._lock:
            with suppress(ValueError, OSError):
                self._clear_row()
            yield
            self._line_at = self._last = time.monotonic()

    def _clear_row(self) -> None:
        """Erase the waiting row, the cursor left at the start of the now empty row (spaces, not an
        escape sequence: any terminal, and a log of the terminal reads as the terminal showed it)."""
        if self._row:
            self.stream.write("\r" + " " * self._row + "\r")
            self.stream.flush()
            self._row = 0

    def moved(self, ph: Phase, nbytes: int) -> None:
        """A phase's bytes moved: the bar follows (within its 0.2 s: the terminal moves); a JSON event at
        most every `TICK` seconds."""
        if ph.bar is not None:
            with self._lock:
                ph.bar.update(nbytes)
                self._last = time.monotonic()
        elif self.json and time.monotonic() - self._last >= TICK:
            self._emit(ph, "progress")

    def _emit(self, ph: Phase, kind: str) -> None:
        self._last = time.monotonic()
        self._write(json.dumps(ph.event(kind)))

    @contextmanager
    def phase(self, name: str, total_bytes: int) -> Iterator[Phase]:
        """A bar of ``total_bytes`` named ``name`` while the block runs; the bar is removed after it."""
        ph = self.start(name, total_bytes)
        try:
            yield ph
        finally:
            self.end(ph)

    def start(self, name: str, total_bytes: int) -> Phase:
        """Open a phase that `end` closes (for a phase no ``with`` block can span, e.g. a commit)."""
        ph = Phase(name, max(0, int(total_bytes)), owner=self)
        self.phases.append(ph)
        if self.enabled and self.stream is not None:
            from tqdm import tqdm

            with self._lock:  # the bar takes the waiting row's place
                self._clear_row()
                # binary multiples, as `human_bytes` writes the first line (tqdm spells them k, M, G);
                # smoothing 0: the rate and ETA from all the bytes since the phase began, as the json events
                ph.bar = tqdm(total=ph.total, desc=name, unit="B", unit_scale=True, unit_divisor=1024, leave=False,
                              file=self.stream, dynamic_ncols=True, mininterval=0.2, smoothing=0)
                self._last = time.monotonic()
        elif self.json and self.stream is not None:
            self._emit(ph, "start")
        if self.active:
            ticker = threading.Thread(target=self._tick, args=(ph,), daemon=True, name=f"progress-{name}")
            ticker.start()
        return ph

    def end(self, ph: Phase) -> None:
        """Close a phase: its bar removed, or its ``end`` event written."""
        if ph.ended is not None:
            return
        ph.ended = time.monotonic()
        if ph.bar is not None:
            with self._lock:
                ph.bar.close()
                self._line_at = self._last = ph.ended  # a waiting row counts from the bar's end
        elif self.json and self.stream is not None:
            self._emit(ph, "end")

    def _tick(self, ph: Phase) -> None:
        """Refresh an open phase every `TICK` seconds, bytes or not: from its first second the
        elapsed time moves, and a stall shows as a stalled count rather than silence."""
        while ph.ended is None and ph is self.phases[-1]:  # a later phase supersedes one never ended (an error)
            time.sleep(TICK / 4)
            if ph.ended is not None or time.monotonic() - max(self._last, ph.started) < TICK:
                continue
            if ph.bar is not None:
                with self._lock:
                    if ph.ended is None:
                        ph.bar.refresh()
                self._last = time.monotonic()
            elif self.json:
                with suppress(ValueError, OSError):  # a stream closed at exit: the daemon ticker just stops
                    self._emit(ph, "progress")


def start_commit(progress: "Progress | None", folder: Any) -> "Phase | None":
    """Open the "commit" phase: the fsync of every file in ``folder`` (the atomic temporary
    directory) and its rename into place. Called as the last step inside the atomic block
    (the commit runs as the block exits), closed by `end_commit` after it; its bytes are the
    output's, counted done when the commit has returned."""
    if progress is None:
        return None
    from pathlib import Path

    total = sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file() and not f.is_symlink())
    return progress.start("commit", total)


def end_commit(progress: "Progress | None", ph: "Phase | None") -> None:
    """The commit has returned: its phase is done."""
    if progress is not None and ph is not None:
        ph.update(ph.total - ph.done)
        progress.end(ph)


def phase_of(progress: "Progress | None", name: str, total_bytes: int) -> Any:
    """``progress.phase(name, total_bytes)``, or a block yielding None when there is no progress
    (a library caller that passed none): the layers below accept None as "report nothing"."""
    from contextlib import nullcontext

    return nullcontext(None) if progress is None else progress.phase(name, total_bytes)


def waiting(progress: "Progress | None") -> Any:
    """``progress.waiting()``, or a block doing nothing when there is no progress (a library caller)."""
    from contextlib import nullcontext

    return nullcontext() if progress is None else progress.waiting()


def describe_bytes(nbytes: int, count: int, noun: str) -> str:
    """``1.2 GiB in 37 tensors``: the size of a command's work, for its first line after the index is read."""
    return f"{human_bytes(nbytes)} in {count} {noun}{'' if count == 1 else 's'}"


def _terminal_fd(stream: Any) -> int | None:
    """The file descriptor of ``stream`` when it is a real terminal a watchdog process can write to, else None."""
    try:
        fd = stream.fileno()
        return fd if os.isatty(fd) else None
    except (AttributeError, ValueError, OSError):  # no descriptor (a StringIO), or a closed stream
        return None


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
