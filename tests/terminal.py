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
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the line ``python -X importtime`` writes when torch (or a submodule) has been imported
TORCH_IMPORT = re.compile(r"^import time:.*\|\s*torch(\.|$)", re.M)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RESHARD_DEBUG", "WORLD_SIZE", "RANK")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_on_terminal(args: list[str], *, terminal: bool, importtime: bool = False, timeout: float = 300) -> dict:
    """``python -m reshard ARGS`` with stderr on a pseudo-terminal (``terminal``) or a pipe; stdout a pipe.

    Returns the exit code, stdout, stderr and, on a terminal, when each piece of stderr
    arrived (seconds after the start), read as it comes so the child never blocks.
    """
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "reshard", *args]
    if not terminal:
        p = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=_env(),
                           timeout=timeout, cwd=ROOT)
        return {"code": p.returncode, "out": p.stdout, "err": p.stderr, "pieces": []}
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a terminal of 160 columns
    pieces: list[tuple[float, str]] = []
    started = time.monotonic()
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave, env=_env(), cwd=ROOT)
    os.close(slave)

    def read() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer of the terminal has closed it
                return
            if not data:
                return
            pieces.append((time.monotonic() - started, data.decode(errors="replace")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        out, _ = p.communicate(timeout=timeout)
    finally:
        reader.join(timeout=10)
        os.close(master)
    return {"code": p.returncode, "out": out.decode(), "err": "".join(t for _, t in pieces), "pieces": pieces}


def first_line_seconds(r: dict, line: str) -> float:
    """When the piece of stderr that completed ``line`` arrived."""
    seen = ""
    for t, text in r["pieces"]:
        seen += text
        if line in seen:
            return t
    raise AssertionError(f"{line!r} never appeared on the terminal: {r['err'][-2000:]!r}")


