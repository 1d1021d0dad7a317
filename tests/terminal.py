"""Run ``reshard`` with its stderr on a pseudo-terminal, recording when each piece arrives.

Shared by the tests of what a person at a terminal sees (tests/test_progress.py,
tests/test_first_line.py): the progress shown only on a terminal, the first line before
torch is imported, and silence on a pipe.
"""
from __future__ import annotations

import fcntl
import os
import pty
import re
import shutil
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the line ``python -X importtime`` writes when torch (or a submodule) has been imported
TORCH_IMPORT = re.compile(r"^import time:.*\|\s*torch(\.|$)", re.M)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RESHARD_DEBUG", "WORLD_SIZE", "RANK")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_on_terminal(args: list[str], *, terminal: bool, importtime: bool = False, timeout: float = 300,
                    stop_when: Callable[[str, str], bool] | None = None) -> dict:
    """``reshard ARGS`` with stderr on a pseudo-terminal (``terminal``) or a pipe; stdout a pipe.

    Returns the exit code, stdout, stderr and when each piece of stderr arrived (seconds
    after the start), both read as they come so the child never blocks. ``stop_when(out,
    err)``: once it holds, the command and every process it started (its session) are
    killed: the beginning of a long command (the demo, a rehearsal) is enough to see what it
    shows first. ``stopped`` says whether that happened.

    With ``importtime`` the command is a fresh ``python -X importtime -m reshard`` (what it
    prints before torch is imported is the point); otherwise it is forked from a server that
    imported torch once (`tests/forked.py`), stdout a FIFO and stderr the terminal's slave (or
    a FIFO) opened by name: the same process on the same terminal, without a torch import.
    """
    import tempfile

    import forked

    master, slave = _terminal() if terminal else (None, None)
    work = Path(tempfile.mkdtemp(prefix="terminal-"))
    held: list[int] = []  # writing ends this process holds until the child has exited (see `_stream`)
    started = time.monotonic()
    try:
        if importtime:
            p = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "reshard", *args], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=slave if terminal else subprocess.PIPE, env=_env(),
                                 cwd=ROOT, start_new_session=True)
            out_fd, err_fd = p.stdout.fileno(), (master if terminal else p.stderr.fileno())
            if slave is not None:
                os.close(slave)  # the child has its own copy
        else:
            out_fd = _fifo(work / "stdout", held)
            err_fd = master if terminal else _fifo(work / "stderr", held)
            if slave is not None:
                held.append(slave)
            p = forked.start(args, env=_env(), cwd=ROOT, start_new_session=True, stdout=str(work / "stdout"),
                             stderr=os.ttyname(slave) if terminal else str(work / "stderr"))
        return _stream(p, out_fd, err_fd, started, timeout, stop_when, held)
    finally:
        if master is not None:
            os.close(master)
        if importtime:
            p.stdout.close()
            if p.stderr is not None:
                p.stderr.close()
        else:
            for fd in {out_fd, err_fd} - {master}:
                os.close(fd)
        shutil.rmtree(work, ignore_errors=True)


def _terminal() -> tuple[int, int]:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a terminal of 160 columns
    return master, slave


def _fifo(path: Path, held: list[int]) -> int:
    """A FIFO at ``path``: its reading end, returned, and a writing end appended to ``held`` so
    that the reader sees no end of file before the child has opened it by name."""
    os.mkfifo(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    held.append(os.open(path, os.O_WRONLY))
    os.set_blocking(fd, True)
    return fd


def _stream(p, out_fd: int, err_fd: int, started: float, timeout: float,
            stop_when: Callable[[str, str], bool] | None, held: list[int]) -> dict:
    """Read both streams as they come until the process ends (or ``stop_when`` kills its session).

    ``held``: writing ends (a FIFO's, a terminal's slave) this process holds for a child that
    opens them by name; closed once the child has exited, so the readers drain what is left,
    then see the end.
    """
    pieces: list[tuple[float, str]] = []
    out_parts: list[str] = []
    stopped = threading.Event()

    def check() -> None:
        if stop_when is not None and not stopped.is_set() and stop_when("".join(out_parts),
                                                                          "".join(t for _, t in pieces)):
            stopped.set()
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def read(fd: int, into: Callable[[str], None]) -> None:
        while True:
            try:
                data = os.read(fd, 65536)
            except OSError:  # EIO: every writer of the terminal has closed it
                return
            if not data:
                return
            into(data.decode(errors="replace"))
            check()

    readers = [threading.Thread(target=read, args=(err_fd, lambda t: pieces.append((time.monotonic() - started, t))),
                                daemon=True),
               threading.Thread(target=read, args=(out_fd, out_parts.append), daemon=True)]
    for r in readers:
        r.start()
    try:
        p.wait(timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        for fd in held:
            os.close(fd)
        for r in readers:
            r.join(timeout=10)
    return {"code": p.returncode, "out": "".join(out_parts), "err": "".join(t for _, t in pieces), "pieces": pieces,
            "stopped": stopped.is_set()}


def first_line_seconds(r: dict, line: str) -> float:
    """When the piece of stderr that completed ``line`` arrived."""
    seen = ""
    for t, text in r["pieces"]:
        seen += text
        if line in seen:
            return t
    raise AssertionError(f"{line!r} never appeared on the terminal: {r['err'][-2000:]!r}")


