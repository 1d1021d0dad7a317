"""Whether ``--overwrite`` may replace what is at an output path: a checkpoint, or an earlier reshard output.

``--overwrite`` swaps the old destination out as a whole and deletes it. Pointed by mistake at
a folder of notes, or at a checkpoint directory a user keeps other files in, it would delete
files reshard never wrote, without a word. So the destination is surveyed first, by the rule
in ``formats/replaceable.toml`` (anchors with their magic bytes, known checkpoint files, the
trainer sidecars of ``formats/sidecars.toml``), and `survey` says what would be lost when it
is anything else. The survey looks at names, file types and at most a few leading bytes of
the anchor files: it reads nothing else of the destination, follows no link inside it, and
stops after ``max_entries`` entries (a tree that large is no checkpoint).

This module knows files, not training: `why_not_replaceable` is the overwrite policy every
command hands `reshard.storage.files.atomic.atomic_directory` (its ``replaceable=`` parameter), which
applies whatever policy it is given and imports none: the rule of what a user's files are is
this module's, making a directory appear atomically is that one's.
"""
from __future__ import annotations

import fnmatch
import os
import stat
import struct
import tomllib
from typing import Callable, Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from reshard.errors import BadInput
from reshard.paths import formats_root

__all__ = ["Rule", "Survey", "rules", "survey", "is_replaceable", "why_not_replaceable", "survey_listing", "starts_as"]

NAMED = 5  # unrecognised files named in a refusal; the rest are counted
MAGICS = ("pickle", "json", "safetensors", "torch")


@dataclass(frozen=True)
class Rule:
    """``formats/replaceable.toml``: anchor patterns with their magic, other known file patterns, the walk's bounds."""

    anchors: tuple[tuple[str, str], ...]  # (pattern, magic)
    files: tuple[str, ...]
    max_depth: int
    max_entries: int


@dataclass
class Survey:
    """What is at a destination, as far as ``--overwrite`` is concerned."""

    path: Path
    anchor: str | None = None                                    # the first anchor found (relative path)
    unrecognised: list[str] = field(default_factory=list)        # the first `NAMED` of them (relative paths)
    count: int = 0                                               # how many files and entries are unrecognised
    why: str = ""                                                # set when the walk itself decides (too deep, too large, a link to nothing)

    @property
    def replaceable(self) -> bool:
        return self.anchor is not None and self.count == 0 and not self.why

    def add(self, rel: str, kind: str | None) -> None:
        """One file (``rel``, its relative path) classified as an anchor, a known file or None (unrecognised)."""
        if kind == "anchor" and self.anchor is None:
            self.anchor = rel
        elif kind is None:
            self.count += 1
            if len(self.unrecognised) < NAMED:
                self.unrecognised.append(rel)

    def describe(self) -> str:
        """One sentence: why the destination is not replaceable, naming what would be lost."""
        if self.why:
            return self.why
        if self.count:
            more = f" and {self.count - len(self.unrecognised)} more" if self.count > len(self.unrecognised) else ""
            noun = "file" if self.count == 1 else "files"
            return (f"it holds {self.count} {noun} that belong to no checkpoint and no reshard output "
                    f"({', '.join(self.unrecognised)}{more}), and replacing it would delete them")
        return ("it is not a checkpoint (no DCP .metadata, safetensors, torch.save file or reshard report in it), "
                "so --overwrite would delete files reshard never wrote")


@lru_cache(maxsize=1)
def rules() -> Rule:
    """``formats/replaceable.toml`` checked, plus the sidecar patterns of ``formats/sidecars.toml``."""
    from reshard.storage.checkpoints.sidecars import sidecar_rules  # imports torch: only when a destination is surveyed

    path = formats_root() / "replaceable.toml"
    try:
        with open(path, "rb") as f:
            spec = tomllib.load(f)
        anchors = tuple((str(a["pattern"]), str(a["magic"])) for a in spec["anchor"])
        for pattern, magic in anchors:
            if magic not in MAGICS:
                raise ValueError(f"anchor '{pattern}': unknown magic '{magic}' (known: {', '.join(MAGICS)})")
        files = tuple(str(f["pattern"]) for f in spec.get("file", ())) + tuple(r.pattern for r in sidecar_rules())
        return Rule(anchors, files, int(spec["max_depth"]), int(spec["max_entries"]))
    except (KeyError, ValueError, TypeError, tomllib.TOMLDecodeError) as exc:
        raise BadInput(f"invalid rule file: {exc}", where=str(path)) from None


def starts_as(head: bytes, magic: str) -> bool:
    """Whether a file whose first bytes are ``head`` (64 or fewer) starts the way ``magic`` says."""
    if magic == "pickle":
        return head[:1] == b"\x80"
    if magic == "json":
        return head.lstrip()[:1] == b"{"
    if magic == "safetensors":
        return len(head) >= 9 and struct.unpack_from("<Q", head)[0] >= 2 and head[8:9] == b"{"
    return head[:4] == b"PK\x03\x04" or head[:1] == b"\x80"  # torch


def survey_listing(tails: Iterable[str], head: Callable[[str], bytes], where: str) -> Survey:
    """`survey` of a prefix in object storage: its objects by key tail (``a/b`` below the prefix),
    an anchor's first bytes fetched by ``head(tail)``. A store has no links and no empty folders,
    so only the names, the depth and the magic decide."""
    out = Survey(Path(where))
    rule = rules()
    for n, tail in enumerate(sorted(tails)):
        if n >= rule.max_entries:
            out.why = f"it holds more than {rule.max_entries:,} objects, more than a checkpoint does"
            return out
        if tail.count("/") > rule.max_depth:
            out.why = f"it nests keys deeper than {rule.max_depth} levels ('{tail}')"
            return out
        name = tail.rsplit("/", 1)[-1]
        kind = None
        for pattern, magic in rule.anchors:
            if fnmatch.fnmatchcase(name, pattern):
                kind = "anchor" if starts_as(head(tail), magic) else None
                break
        if kind is None and any(fnmatch.fnmatchcase(name, p) for p in rule.files):
            kind = "file"
        out.add(tail, kind)
    return out


def _has_magic(path: str, magic: str) -> bool:
    """Whether the regular file at ``path`` (never a link: O_NOFOLLOW) starts the way ``magic`` says."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        head = os.pread(fd, 64, 0)
    except OSError:
        return False
    finally:
        os.close(fd)
    return starts_as(head, magic)


def _classify(name: str, path: str, is_file: bool, rule: Rule) -> str | None:
    """'anchor', 'file', or None (unrecognised), for one regular file (``is_file``) or symbolic link named ``name``.

    A link is never followed: deleting it loses nothing but the link, so a checkpoint file's name is
    enough; it never counts as an anchor. A regular file under an anchor's name must also have its magic.
    """
    for pattern, magic in rule.anchors:
        if fnmatch.fnmatchcase(name, pattern):
            if not is_file:
                return "file"
            if _has_magic(path, magic):
                return "anchor"
            break  # a checkpoint's name on something else (a note saved as model.pt): only a known file name helps
    for pattern in rule.files:
        if fnmatch.fnmatchcase(name, pattern):
            return "file"
    return None


def survey(dst: str | os.PathLike) -> Survey:
    """Walk what is at ``dst`` (without following links below it) and say whether it is a checkpoint."""
    dst = Path(os.path.abspath(os.fspath(dst)))
    out = Survey(dst)
    rule = rules()
    root = os.fspath(dst)
    if os.path.islink(root):
        if not os.path.exists(root):
            out.why = "it is a symbolic link to a path that does not exist"
            return out
        root = os.path.realpath(root)  # judged by what it points to; only the link itself is replaced
    try:
        st = os.stat(root)
    except OSError as exc:
        out.why = f"it cannot be examined ({exc.strerror})"
        return out
    if not stat.S_ISDIR(st.st_mode):
        if stat.S_ISREG(st.st_mode) and _classify(os.path.basename(root), root, True, rule) == "anchor":
            out.anchor = dst.name
        else:
            out.why = ("it is a file, and not a torch.save or safetensors checkpoint"
                       if stat.S_ISREG(st.st_mode) else "it is neither a regular file nor a directory")
        return out
    seen = 0
    stack: list[tuple[str, str, int]] = [(root, "", 0)]
    while stack:
        folder, prefix, depth = stack.pop()
        try:
            with os.scandir(folder) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            out.why = f"'{prefix or '.'}' in it cannot be listed ({exc.strerror})"
            return out
        for e in entries:
            seen += 1
            if seen > rule.max_entries:
                out.why = f"it holds more than {rule.max_entries:,} entries, more than a checkpoint does"
                return out
            rel = prefix + e.name
            try:
                mode = e.stat(follow_symlinks=False).st_mode
            except OSError:
                mode = 0
            if stat.S_ISDIR(mode):
                if depth + 1 > rule.max_depth:
                    out.why = f"it nests directories deeper than {rule.max_depth} levels ('{rel}')"
                    return out
                stack.append((e.path, rel + "/", depth + 1))
                continue
            kind = _classify(e.name, e.path, stat.S_ISREG(mode), rule) if stat.S_ISREG(mode) or stat.S_ISLNK(mode) else None
            out.add(rel, kind)
    return out


def is_replaceable(dst: str | os.PathLike) -> bool:
    """`survey` in one word."""
    return survey(dst).replaceable


def why_not_replaceable(dst: str | os.PathLike) -> str | None:
    """The overwrite policy (`reshard.storage.files.atomic.OverwritePolicy`) of every command's ``--overwrite``:
    None when ``dst`` is a checkpoint or an earlier reshard output, else the sentence naming what would be lost."""
    found = survey(dst)
    return None if found.replaceable else found.describe()
