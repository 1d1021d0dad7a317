"""Share a file's bytes under a second name without copying them: reflink, else hard link.

`reshard convert --data link` keeps the source's tensor bytes where they are: the output's
data files are the source's files under new names inside the output directory, and only
what changes (metadata, per-rank state, manifest) is written. This module is the file-system
half of that and knows nothing of checkpoints or training.

Two ways, tried in this order by `share_file`:

- **reflink** (``ioctl(dst, FICLONE, src)``; btrfs, XFS with reflink, bcachefs, OCFS2, ZFS
  2.2+ ...): a new inode whose extents are the source's, copy-on-write. Later writes to
  either file do not show in the other, so the output is independent of the source from
  the start;
- **hard link** (``linkat``): a second name for the *same inode*. Nothing is copied and
  nothing is independent: a later in-place write to the source's file (truncate and
  rewrite, ``dd conv=notrunc``, a trainer saving again into the same directory) changes the
  output's file too. Renaming or deleting the source's file does not (the inode lives as
  long as one name does).

Where neither works (the destination on another file system, a file system without hard
links or refusing them, ``fs.protected_hardlinks`` for a file this user does not own) the
caller gets a `LinkRefused` with each way's reason, so the error can say why and what to do.

The source file is opened once, through `reshard.safefs` (inside its checkpoint root, a
regular file, no FIFO or symlink out), and that open descriptor is what is shared: the
reflink clones it, and the hard link, made to the file's real path, must then be that
descriptor's inode (else it is removed and refused), so the inode shared is the one checked.
The source is only read: its contents, size and mtime are unchanged (a hard link changes
its link count and ctime, which is what a link is).
"""
from __future__ import annotations

import errno
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from reshard import safefs

__all__ = ["FICLONE", "LINK_METHODS", "LinkRefused", "SharedFile", "share_file", "shares_inode"]

FICLONE = 0x40049409  # _IOW(0x94, 9, int): linux/fs.h, the clone ioctl every reflink file system implements
LINK_METHODS = ("reflink", "hardlink")

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

_WHY = {
    errno.EXDEV: "the destination is on another file system than the source",
    errno.EOPNOTSUPP: "the file system does not support it",
    errno.ENOTTY: "the file system does not support it",
    errno.EINVAL: "the file system does not support it",
    errno.EPERM: "not permitted (fs.protected_hardlinks, or a file system that refuses it)",
    errno.EACCES: "permission denied",
    errno.EMLINK: "the source file has the most hard links its file system allows",
    errno.EROFS: "the destination is read-only",
}
if hasattr(errno, "ENOTSUP"):
    _WHY.setdefault(errno.ENOTSUP, "the file system does not support it")


class LinkRefused(OSError):
    """Neither a reflink nor a hard link could be made; ``reasons`` maps each way to why not."""

    def __init__(self, src: Path, dst: Path, reasons: dict[str, str]):
        super().__init__(errno.EXDEV if "another file system" in " ".join(reasons.values()) else errno.EOPNOTSUPP,
                         "; ".join(f"{m}: {r}" for m, r in reasons.items()))
        self.src, self.dst, self.reasons = src, dst, reasons

    @property
    def cross_device(self) -> bool:
        return self.errno == errno.EXDEV


@dataclass(frozen=True)
class SharedFile:
    """One file shared: where from, where to, how (``reflink`` or ``hardlink``) and its size."""

    source: Path
    path: Path
    method: str
    size: int


def _why(exc: OSError) -> str:
    return _WHY.get(exc.errno or 0, exc.strerror or str(exc))


def _reflink(src_fd: int, dst: Path) -> None:
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC | _NOFOLLOW, 0o644)
    try:
        fcntl.ioctl(fd, FICLONE, src_fd)
    except BaseException:
        os.close(fd)
        os.unlink(dst)
        raise
    os.close(fd)


def _hardlink(src_fd: int, real_src: str, dst: Path) -> None:
    os.link(real_src, dst, follow_symlinks=False)
    # the name could have been swapped between the check and the link: it must be the opened inode
    a, b = os.fstat(src_fd), os.stat(dst, follow_symlinks=False)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
        os.unlink(dst)
        raise OSError(errno.ESTALE, "the source file changed while it was being linked")


def share_file(src: Path, dst: Path, *, root: Path, methods: tuple[str, ...] = LINK_METHODS) -> SharedFile:
    """Make ``dst`` (which must not exist) hold ``src``'s bytes without copying them.

    ``root``: the checkpoint ``src`` lies in (`reshard.safefs` refuses a file outside it or one
    that is not regular). ``methods``: the ways to try, in order (default: reflink, then hard
    link). Raises `LinkRefused` with every way's reason when none works; any other error
    (``dst`` exists, the source missing) as the `OSError` it is.
    """
    src, dst = Path(src), Path(dst)
    fd = safefs.open_read(src, root=root)
    try:
        size = os.fstat(fd).st_size
        reasons: dict[str, str] = {}
        for method in methods:
            try:
                if method == "reflink":
                    _reflink(fd, dst)
                elif method == "hardlink":
                    _hardlink(fd, os.path.realpath(src), dst)
                else:
                    raise ValueError(f"unknown link method {method!r} (known: {', '.join(LINK_METHODS)})")
            except FileExistsError:
                raise
            except OSError as exc:
                reasons[method] = _why(exc)
                continue
            got = os.stat(dst, follow_symlinks=False).st_size
            if got != size:  # cannot happen with a working clone or link: refuse to build on it
                os.unlink(dst)
                raise OSError(errno.EIO, f"{method} of {src.name} has {got} bytes, the source {size}")
            return SharedFile(src, dst, method, size)
        raise LinkRefused(src, dst, reasons)
    finally:
        os.close(fd)


def shares_inode(a: Path, b: Path) -> bool:
    """Whether two names are one inode (a hard link; a reflink is a separate inode)."""
    sa, sb = os.stat(a, follow_symlinks=False), os.stat(b, follow_symlinks=False)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)
