"""Run ``python -m reshard`` with its stderr on a pseudo-terminal, recording when each piece arrives.

Shared by the tests of what a person at a terminal sees (tests/test_progress.py,
tests/test_first_line.py): the progress shown only on a terminal, the first line before
torch is imported, and silence on a pipe.
"""
from __future__ import annotations

import fcntl
import os
import pty
import re
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
    """``python -m reshard ARGS`` with stderr on a pseudo-terminal (``terminal``) or a pipe; stdout a pipe.

    Returns the exit code, stdout, stderr and when each piece of stderr arrived (seconds
    after the start), both read as they come so the child never blocks. ``stop_when(out,
    err)``: once it holds, the command and every process it started (its session) are
    killed: the beginning of a long command (the demo, a rehearsal) is enough to see what it
    shows first. ``stopped`` says whether that happened.
    """
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "reshard", *args]
    master = slave = None
    if terminal:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a terminal of 160 columns
    started = time.monotonic()
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=slave if terminal else subprocess.PIPE, env=_env(), cwd=ROOT, start_new_session=True)
    if slave is not None:
        os.close(slave)
    err_fd = master if terminal else p.stderr.fileno()
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
               threading.Thread(target=read, args=(p.stdout.fileno(), out_parts.append), daemon=True)]
    for r in readers:
        r.start()
    try:
        p.wait(timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        for r in readers:
            r.join(timeout=10)
        if master is not None:
            os.close(master)
        p.stdout.close()
        if p.stderr is not None:
            p.stderr.close()
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


