"""Errors that carry their exit code, so the CLI can stay a thin renderer.

Exit codes are part of the interface: 0 ok, 1 a check found a difference or a plan is
infeasible, 2 bad input (usage, incomplete, corrupt or unsafe checkpoint).
"""
from __future__ import annotations

import errno
import os


class ReshardError(Exception):
    """Base class: one clear paragraph saying what is wrong, where, and the way out."""

    exit_code = 2

    def __init__(self, message: str, *, where: str | None = None, hint: str | None = None,
                 keys: list[str] | None = None):
        self.message = message
        self.where = where
        self.hint = hint
        self.keys = list(keys or [])  # the checkpoint keys the error is about, for --json
        super().__init__(self.render())

    def render(self) -> str:
        """One paragraph: ``where: message.`` then the hint, each a sentence ending in a full stop."""
        head = f"{self.where}: {self.message}" if self.where else self.message
        return " ".join(sentence(p) for p in (head, self.hint) if p)


class BadInput(ReshardError):
    """Usage errors, incomplete/corrupt/unreadable checkpoints (exit 2)."""

    exit_code = 2


class UnsafeInput(BadInput):
    """The input asks us to run code (a pickle referencing a non-allow-listed global)."""


class Incomplete(BadInput):
    """The checkpoint was never committed or some of its bytes are gone."""


class Infeasible(ReshardError):
    """The check ran and found a difference, or a plan cannot be carried out (exit 1)."""

    exit_code = 1


def sentence(text: str) -> str:
    """``text`` ending in a full stop (or the ``?``/``!``/``:`` it already ends in), so parts read as sentences."""
    t = text.rstrip()
    return t if not t or t[-1] in ".?!:" else t + "."


_SPACE_ERRNOS = frozenset(e for e in (errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", None)) if e is not None)


def _name(filename: object) -> str:
    return os.fsdecode(filename) if isinstance(filename, (str, bytes, os.PathLike)) else str(filename)


def from_os_error(exc: OSError) -> BadInput:
    """An OSError no caller mapped, as one paragraph naming the file (exit 2).

    The last resort before "unexpected": a full disk (ENOSPC, EFBIG, EDQUOT), a permission
    (EACCES, EPERM) or a read-only file system (EROFS) met anywhere in a command is a fact
    about the user's files, not a bug in reshard, so it reads like every other error.
    """
    code = exc.errno
    name = errno.errorcode.get(code, "") if code is not None else ""
    reason = (exc.strerror or str(exc)) + (f", {name}" if name else "")
    where = None
    if exc.filename is not None:
        where = _name(exc.filename) + (f" -> {_name(exc.filename2)}" if exc.filename2 is not None else "")
    if code in _SPACE_ERRNOS:
        what, hint = (f"out of space ({reason})",
                      "Free space (or raise the limit) on that file system, or choose another destination, then run "
                      "the same command again.")
    elif code in (errno.EACCES, errno.EPERM):
        what, hint = (f"access refused ({reason})",
                      "Check the permissions of the file and of its directory, or choose another path.")
    elif code == errno.EROFS:
        what, hint = (f"cannot write here ({reason})", "Write the output to a writable file system.")
    else:
        what, hint = (f"the file system refused the operation ({reason})",
                      "Check the file and its file system, then run the same command again.")
    if where is None:
        what = f"a file operation failed, {what}"
    return BadInput(what, where=where, hint=hint)


def render_error(exc: BaseException) -> tuple[int, str]:
    """The exit code and the one paragraph a command prints for ``exc``, whoever raised it.

    One function for the CLI and for the workers of a distributed conversion, so an error
    reads the same (code and text) however the command ran. An OSError no caller mapped is
    `from_os_error`; anything else is a bug, said so.
    """
    if isinstance(exc, ReshardError):
        return exc.exit_code, exc.render()
    if isinstance(exc, OSError):
        return 2, from_os_error(exc).render()
    return 2, (f"unexpected {type(exc).__name__}: {exc}. Re-run with --debug for a traceback and report it.")


# The stable `code` of an error under --json, by class (most specific first).
_CODES = (("unsafe_input", "UnsafeInput"), ("incomplete", "Incomplete"), ("bad_input", "BadInput"),
          ("infeasible", "Infeasible"))


def error_object(exc: BaseException, code: int, paragraph: str, *, usage: bool = False) -> dict[str, object]:
    """The JSON object a command prints for an error under ``--json``: a script parses it like any report.

    ``error`` is the paragraph, ``code`` a stable name (usage, bad_input, incomplete,
    unsafe_input, infeasible, os_error, unexpected), ``exit_code`` the process's, ``file``
    where it happened (or null) and ``keys`` the checkpoint keys it names.
    """
    names = {c.__name__ for c in type(exc).__mro__}
    kind = next((k for k, cls in _CODES if cls in names), None)
    if kind is None:
        kind = "usage" if usage else "os_error" if isinstance(exc, OSError) else "unexpected"
    where = getattr(exc, "where", None)
    if where is None and isinstance(exc, OSError) and exc.filename is not None:
        where = _name(exc.filename)
    return {"error": paragraph, "code": kind, "exit_code": code, "file": where,
            "keys": list(getattr(exc, "keys", None) or [])}
