"""One way to open what a checkpoint names: inside its root, regular files only, bounded reads.

A checkpoint comes from a hub, a tarball or another team's file system, so the names inside
it are hostile until checked. A `.distcp` that is a symlink to another (private)
checkpoint's file, a `.metadata` that is a symlink to ``/dev/zero``, a FIFO named
``manifest.json``: none of these is a checkpoint file, and reading one either leaks bytes
that were never part of the input or never returns. Every reader of a source (DCP data
files, `.metadata`, sidecars, manifests, reports, safetensors shards, index files) opens
through this module, and so do the locks made beside a destination:

- the checkpoint *root* is resolved once (a root that is itself a symlink, such as
  ``latest -> step_80000``, is fine: that is how people name checkpoints);
- a file is opened by its real path, which must lie inside the real root (a symlink inside
  the checkpoint pointing inside it is followed; one pointing outside is refused), with
  ``O_NOFOLLOW`` on the last component and ``O_NONBLOCK`` so a FIFO cannot hang the open;
- the opened descriptor must be a regular file (``fstat``), else it is refused by name;
- a whole-file read stops at the smaller of its ``fstat`` size and the caller's limit.

Refusals are `UnsafeFile` (exit 2), naming the file and what it is.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from reshard.errors import BadInput

__all__ = ["MAX_JSON_BYTES", "MAX_JSON_DEPTH", "UnsafeFile", "check_depth", "check_name", "check_toml_nesting", "describe", "loads_json",
           "loads_toml", "open_read", "read_bounded", "read_json", "regular_size", "resolve_root", "too_deep"]

MAX_JSON_BYTES = 256 << 20   # manifests, reports and index files: real ones are well under 100 MiB
MAX_JSON_DEPTH = 64          # real ones nest under 10 levels

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


class UnsafeFile(BadInput):
    """A name inside a checkpoint is not a regular file inside it (symlink out, device, FIFO, socket)."""


def describe(mode: int) -> str:
    """What a file of this ``st_mode`` is, in words."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def resolve_root(path: str | os.PathLike) -> Path:
    """The real path of a checkpoint root (symlinks in it or to it resolved once)."""
    return Path(os.path.realpath(os.fspath(path)))


def check_name(name: str, *, where: str) -> None:
    """A stored file name that cannot name a file inside the checkpoint is bad input."""
    if "\x00" in name:
        raise BadInput(f"a stored file name contains a NUL byte ({name!r})", where=where,
                       hint="The checkpoint's metadata is corrupt or forged.")
    if os.path.isabs(name) or ".." in Path(name).parts:
        raise UnsafeFile(f"the stored file name '{name}' points outside the checkpoint", where=where,
                         hint="Refusing to read files outside the checkpoint directory.")


def _inside(path: Path, root: Path | None) -> tuple[Path, Path]:
    """(real path of ``path``, real root); refuses a path whose real location leaves the root."""
    p = Path(os.fspath(path))
    if "\x00" in str(p):
        raise BadInput(f"a file name contains a NUL byte ({str(p)!r})", where=str(p.parent),
                       hint="The checkpoint's metadata is corrupt or forged.")
    real_root = resolve_root(root if root is not None else p.parent)
    real = Path(os.path.realpath(p))
    if real != real_root and real_root not in real.parents:
        kind = "a symbolic link" if p.is_symlink() else "a path"
        raise UnsafeFile(f"{kind} to '{real}', outside the checkpoint ({real_root})", where=str(p),
                         hint="A checkpoint's files must lie inside its directory; copy the real files in "
                              "(cp -L) if you trust where the link points.")
    return real, real_root


def open_read(path: str | os.PathLike, *, root: str | os.PathLike | None = None, flags: int = 0) -> int:
    """A read-only descriptor of the regular file ``path`` inside ``root`` (default: its directory).

    ``flags`` adds open flags (``O_DIRECT``). Raises FileNotFoundError when the file does not
    exist (callers say what that means for them), `UnsafeFile` when it is not a regular
    file inside the root.
    """
    p = Path(os.fspath(path))
    real, _ = _inside(p, Path(os.fspath(root)) if root is not None else None)
    try:
        fd = os.open(real, os.O_RDONLY | _CLOEXEC | _NOFOLLOW | _NONBLOCK | flags)
    except OSError as exc:
        if exc.errno == getattr(os, "ELOOP", 40):
            raise UnsafeFile("a symbolic link changed while it was opened", where=str(p)) from None
        if exc.errno in (6, 19):  # ENXIO / ENODEV: a socket or a device with no driver
            raise UnsafeFile("not a regular file (a socket or a device)", where=str(p)) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(f"{describe(st.st_mode)}, not a regular file", where=str(p),
                             hint="Refusing to read it: a checkpoint holds regular files only.")
        if _NONBLOCK:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def regular_size(path: str | os.PathLike, *, root: str | os.PathLike | None = None) -> int:
    """The size of a regular file inside ``root`` (``fstat`` of the opened file, not ``stat`` of the name)."""
    fd = open_read(path, root=root)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def read_bounded(path: str | os.PathLike, *, limit: int, root: str | os.PathLike | None = None,
                 what: str = "file") -> bytes:
    """The whole of a regular file, refused (not truncated) when it is larger than ``limit`` bytes."""
    fd = open_read(path, root=root)
    try:
        size = os.fstat(fd).st_size
        check_size(size, limit, path, what=what)
        chunks, got = [], 0
        while got <= size:
            b = os.pread(fd, min(size + 1 - got, 16 << 20), got)
            if not b:
                break
            chunks.append(b)
            got += len(b)
        data = b"".join(chunks)
        if len(data) > size:  # grew while read: never read past what fstat promised
            raise BadInput(f"the {what} changed size while it was read", where=str(path))
        return data
    finally:
        os.close(fd)


def check_size(size: int, limit: int, path: str | os.PathLike, *, what: str = "file") -> None:
    """Refuse (not truncate) a file larger than ``limit`` bytes, naming it."""
    if size > limit:
        raise BadInput(f"the {what} is {size:,} bytes, more than the {limit:,} reshard reads for it",
                       where=str(path), hint="Real ones are far smaller; this file is corrupt or forged.")


def _depth_ok(obj: Any, limit: int) -> bool:
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, (dict, list)):
            if d > limit:
                return False
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return True


def read_json(path: str | os.PathLike, *, root: str | os.PathLike | None = None, what: str = "JSON file",
              limit: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """A JSON document from a file inside a checkpoint, capped in size and nesting depth."""
    data = read_bounded(path, limit=limit, root=root, what=what)
    return loads_json(data, where=str(path), what=what, max_depth=max_depth)


def loads_json(data: bytes | str, *, where: str, what: str = "JSON file", max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse JSON text capped in nesting depth; malformed or too deep is bad input naming ``where``."""
    try:
        obj = json.loads(data)
    except RecursionError:
        raise too_deep(where, what, max_depth) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadInput(f"the {what} is not valid JSON ({exc})", where=where) from None
    return check_depth(obj, where=where, what=what, max_depth=max_depth)


_TOML_TOKEN = re.compile(r'"""|\'\'\'|["\'#\[\]{}.,=\n]')
_BASIC_END = re.compile(r'[\\"\n]')
_LITERAL_END = re.compile(r"['\n]")


def check_toml_nesting(text: str, *, where: str, what: str, max_depth: int = MAX_JSON_DEPTH) -> None:
    """`too_deep` unless ``text``'s arrays, inline tables and dotted keys nest at most ``max_depth`` levels.

    One linear scan outside strings and comments: the open ``[``/``{`` plus the dots of the key
    (or value) being read, reset at ``= , [ { ] }`` and line ends. It overcounts by at most two
    (a table header's brackets, a float's dot), never undercounts: strings end where TOML ends
    them (escapes in basic strings, a line end in single-line ones). What it bounds is what makes
    tomllib slow or recurse (one key's parts, one value's brackets); a table header's depth plus
    its keys' is the parsed document's, which `check_depth` measures after.
    """
    depth = dots = worst = 0
    pos, n = 0, len(text)
    while pos < n:
        m = _TOML_TOKEN.search(text, pos)
        if m is None:
            break
        t, pos = m.group(), m.end()
        if t in ('"""', "'''"):             # multi-line string: to its closing quotes (and up to 2 more)
            end = _closing(text, pos, t)
            pos = end + 3
            while pos < n and text[pos] == t[0] and pos < end + 5:
                pos += 1
        elif t == '"':                       # basic string: escapes, ends at " or a line end
            while True:
                e = _BASIC_END.search(text, pos)
                if e is None:
                    pos = n
                    break
                pos = e.end() + (1 if e.group() == "\\" else 0)
                if e.group() != "\\":
                    break
        elif t == "'":                       # literal string: no escapes
            e = _LITERAL_END.search(text, pos)
            pos = n if e is None else e.end()
        elif t == "#":
            e = text.find("\n", pos)
            pos = n if e < 0 else e
        elif t == ".":
            dots += 1
        else:
            depth += 1 if t in "[{" else -1 if t in "]}" else 0
            dots = 0
        worst = max(worst, depth + dots)
        if worst > max_depth:
            raise too_deep(where, what, max_depth)


def _closing(text: str, pos: int, quotes: str) -> int:
    """Where a multi-line string opened before ``pos`` closes (``len(text)`` if never)."""
    while True:
        i = text.find(quotes, pos)
        if i < 0:
            return len(text)
        if quotes == "'''":
            return i
        k = i                                # a basic one: the quotes must not be escaped
        while k > pos and text[k - 1] == "\\":
            k -= 1
        if (i - k) % 2 == 0:
            return i
        pos = i + 1


def too_deep(where: str, what: str, max_depth: int = MAX_JSON_DEPTH) -> BadInput:
    """The refusal of a document nested deeper than ``max_depth`` (its parser's recursion would not return)."""
    return BadInput(f"the {what} nests deeper than {max_depth} levels of objects/tables and arrays", where=where,
                    hint=f"Real ones nest a few levels: rewrite it flatter (at most {max_depth}); as it is, it is "
                         "corrupt or forged.")


def check_depth(obj: Any, *, where: str, what: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``obj`` (a parsed JSON or TOML document) if it nests at most ``max_depth`` levels, else `too_deep`.

    Measured iteratively: whatever reads the document later (hashing, copying, printing) may recurse.
    """
    if not _depth_ok(obj, max_depth):
        raise too_deep(where, what, max_depth)
    return obj


def read_small_text(path: str | os.PathLike, what: str, *, limit: int = 1 << 20, hint: str | None = None) -> bytes:
    """The bytes of a small regular UTF-8 file the user names (a convention, a profile, a trainer config).

    Not a checkpoint's file, but no more trusted: a path from a lineage comes from elsewhere.
    No FIFO, device or directory, a size cap (checked again on the bytes read: the file may
    grow between stat and read), UTF-8 text; each failure is BadInput naming the file.
    """
    where = str(path)
    try:
        st = os.stat(path)
    except OSError as exc:
        raise BadInput(f"cannot open the {what} ({exc.strerror or exc})", where=where, hint=hint) from None
    if not stat.S_ISREG(st.st_mode):
        raise BadInput(f"the {what} is not a regular file", where=where, hint=hint)
    if st.st_size > limit:
        raise BadInput(f"the {what} is larger than {limit} bytes", where=where, hint=hint)
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise BadInput(f"cannot read the {what} ({exc.strerror or exc})", where=where, hint=hint) from None
    if len(data) > limit:
        raise BadInput(f"the {what} is larger than {limit} bytes", where=where, hint=hint)
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        raise BadInput(f"the {what} is not UTF-8 text", where=where, hint=hint) from None
    return data


def read_small_toml(path: str | os.PathLike, what: str, *, limit: int = 1 << 20,
                    hint: str | None = None) -> tuple[dict[str, Any], bytes]:
    """A small TOML file the user names, parsed: (its tables, its bytes, for a hash). See `read_small_text`."""
    data = read_small_text(path, what, limit=limit, hint=hint)
    return loads_toml(data.decode("utf-8"), where=str(path), what=what), data


def loads_toml(text: str, *, where: str, what: str = "TOML file", max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """Parse TOML text capped in nesting depth; malformed or too deep is bad input naming ``where``.

    Measured before `tomllib` sees it (`check_toml_nesting`): tomllib recurses once per nested
    array or inline table, and a dotted key of n parts (``a.a.a... = 1``) costs it O(n^2) time and
    memory (10^4 parts: 2 s and 400 MB; 10^5 would exhaust the machine). The parsed tables are
    measured again, iteratively: whatever reads them later may recurse.
    """
    import tomllib

    check_toml_nesting(text, where=where, what=what, max_depth=max_depth)
    try:
        doc = tomllib.loads(text)
    except RecursionError:
        raise too_deep(where, what, max_depth) from None
    except tomllib.TOMLDecodeError as exc:
        raise BadInput(f"invalid {what}: {exc}", where=where) from None
    return check_depth(doc, where=where, what=what, max_depth=max_depth)
