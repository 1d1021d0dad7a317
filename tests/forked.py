"""Real `reshard` processes without a torch import each: forked from a server that imported it once.

Where the process is the point of a test (it is killed by SIGKILL, interrupted by SIGINT, its
file size limited, run concurrently with another, its exit status read from the OS), the test
needs a real process, not an in-process call. It does not need that process to spend 2-20 s
importing torch again: `python -m reshard` and a child forked here differ only in that import.

A child is forked by `multiprocessing`'s fork server, a single-threaded process started once
per test worker that has imported `reshard.cli` and torch (with no torch op run, so no thread
pool to break by forking). The child sets the environment it was given, redirects its
stdout/stderr to files, runs `reshard.cli.main(argv)` and exits with its code; a signal that
kills it shows as a negative return code, as with `subprocess`. Tests about the interpreter
itself (import order, `-X importtime`, `python -m reshard --help`, torchrun) keep `subprocess`.
"""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from reshard.train.launch import PRELOAD, default_start_method, main_not_reimported

# The fork server is one per process, shared with `reshard.train.launch`'s callers (whichever
# starts it first sets what it preloads), so this list holds what they all need.
_PRELOAD = (*PRELOAD, "numpy", "safetensors", "reshard.testing.synthetic", "reshard.reference.trainer", "reshard.cli")


def _open_for_writing(path: str) -> int:
    import stat

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOCTTY)
    if stat.S_ISREG(os.fstat(fd).st_mode):
        os.ftruncate(fd, 0)
    return fd


def _child(argv: list[str], env: dict[str, str], out: str, err: str, cwd: str | None,
           file_size_limit: int | None, new_session: bool) -> None:
    """In the forked child: become `python -m reshard ARGV` with this environment, then exit with its code."""
    if new_session:
        os.setsid()
    os.environ.clear()
    os.environ.update(env)
    import tempfile

    tempfile.tempdir = None  # as a new process would: TMPDIR of this environment, not the server's cached choice
    if cwd:
        os.chdir(cwd)
    # stdout/stderr: files, FIFOs or a pseudo-terminal's slave (never our controlling terminal)
    os.dup2(_open_for_writing(out), 1)
    os.dup2(_open_for_writing(err), 2)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    if file_size_limit is not None:  # writes past it fail with EFBIG instead of killing the child
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))
    sys.argv = ["reshard", *argv]
    code = 0
    try:
        from reshard.cli import main

        main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    except BaseException:  # noqa: BLE001 - as the interpreter would: a traceback and exit 1
        import traceback

        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


class ForkedCLI:
    """A `subprocess.Popen`-like handle on one forked `reshard` run (text mode, stdout/stderr captured)."""

    def __init__(self, args: list, env: dict[str, str] | None = None, cwd: str | Path | None = None,
                 file_size_limit: int | None = None, start_new_session: bool = False,
                 stdout: str | None = None, stderr: str | None = None) -> None:
        """``stdout``/``stderr``: a path the child writes that stream to (a FIFO, a terminal's
        slave); by default a file this handle reads back (`output`, `communicate`)."""
        self.args = [str(a) for a in args]
        self._dir = tempfile.mkdtemp(prefix="forked-cli-")
        self._out = stdout or os.path.join(self._dir, "out")
        self._err = stderr or os.path.join(self._dir, "err")
        with main_not_reimported(_child):  # the child would re-import pytest's __main__: pure cost
            self._proc = multiprocessing.get_context(default_start_method(_PRELOAD)).Process(
                target=_child, args=(self.args, dict(os.environ if env is None else env), self._out, self._err,
                                     str(cwd) if cwd else None, file_size_limit, start_new_session))
            self._proc.start()
        self.pid = self._proc.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self._proc.exitcode is not None:
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        self.returncode = self._proc.exitcode
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self._proc.kill()

    def output(self) -> tuple[str, str]:
        """What the child wrote to stdout and stderr so far."""
        read = (lambda p: Path(p).read_text(errors="replace") if os.path.exists(p) else "")
        return read(self._out), read(self._err)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait()
            raise
        out = self.output()
        import shutil

        shutil.rmtree(self._dir, ignore_errors=True)
        return out


def start(args: list, **kw) -> ForkedCLI:
    """Start `reshard ARGS` in a forked child (see the module's docstring); keywords as `ForkedCLI`."""
    return ForkedCLI(args, **kw)


def run(args: list, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """`reshard ARGS` in a forked child, to completion: a `CompletedProcess` like `subprocess.run`'s."""
    p = ForkedCLI(args, **kw)
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)

