"""Make an output directory appear all at once, or not at all.

`atomic_directory(dst)` hands out a fresh temporary directory next to ``dst`` (same parent,
so the same filesystem) and, when the block finishes without an exception, makes it
durable and renames it into place. A reader looking at ``dst`` therefore sees either
nothing (or what was there before) or the complete new output, never a half-written one.
When the block raises, the temporary directory is deleted and ``dst`` is left untouched.

Two runs into the same ``dst`` exclude each other with an ``flock`` on a lock file
``.{dst.name}.reshard-lock`` in the parent directory; the second run fails at once with
`BadInput` instead of waiting.

``overwrite=True`` replaces only what the caller's overwrite policy (``replaceable=``, an
`OverwritePolicy`) lets it: every command passes `reshard.storage.files.replaceable.why_not_replaceable`
(a checkpoint or an earlier reshard output, by ``formats/replaceable.toml``), so a folder holding
anything else is refused naming what would be lost and ``--overwrite`` never deletes a user's
files without a word. This module applies the policy it is given and imports none: what may be
replaced is a rule about a user's files, a directory appearing atomically is a mechanism. Replacing a non-empty ``dst`` first tries the Linux
``renameat2(RENAME_EXCHANGE)`` system call, which swaps the two directories in one atomic
step. Where that is unavailable (other kernels/filesystems, e.g. NFS) it falls back to two
renames: old ``dst`` to a trash name, then the new directory to ``dst``. In that fallback
there is a tiny window between the two renames in which ``dst`` does not exist at all; at
no moment is a mix of old and new files visible under ``dst``. The trash is deleted after
the new output is in place.

A run killed outright (SIGKILL, power loss) leaves at most a temporary directory
``.{dst.name}.reshard-tmp-<hex>`` and the lock file beside ``dst``; ``dst`` itself is
untouched. The kernel releases a dead process's ``flock``, so the lock file does not block
the next run, and the next run that takes the lock deletes the stale temporary
directories of the same ``dst`` (holding the lock, no live run can be using them).

Resuming (`reshard.storage.files.journal`): with ``reuse``, the lock holder may hand the block an
interrupted run's temporary directory instead of a new one; the resumable conversion's journal
lies beside it (`journal_dir`: ``.{dst.name}.reshard-tmp-<hex>.journal``), never inside the
output, and goes with it (deleted at the commit, or with a stale temporary directory). A
resumable block interrupted by Ctrl-C (``KeyboardInterrupt``) keeps both for the next run.

Interrupted (Ctrl-C) after the commit: the rename has happened, so ``dst`` is complete.
`committed` says whether this process renamed an output into place at ``dst`` since
`forget_commits` (the command line asks it to word its last line, `what_is_left`), so a
finished output is never reported as a failed run.

`fault_point` is a test hook (see `reshard.engine.conversion`): every write event of a conversion
calls it, and the ``RESHARD_FAULT_*`` environment variables make the process SIGKILL or
pause itself right after a chosen event.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import secrets
import shutil
import signal
import stat
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from reshard.errors import BadInput

__all__ = ["atomic_directory", "OverwritePolicy", "check_destination", "output_path", "fsync_dir", "fsync_file", "fsync_tree", "fault_point", "journal_dir",
           "reclaimable_bytes", "stale_temporaries", "committed", "forget_commits", "identity", "what_is_left"]

#: What ``--overwrite`` may replace: called with an occupied destination, it returns None when the
#: destination may be deleted and replaced, else the words saying why not (the refusal quotes them).
OverwritePolicy = Callable[[Path], str | None]

_TMP_TAG = ".reshard-tmp-"
_TRASH_TAG = ".reshard-trash-"
_LOCK_TAG = ".reshard-lock"
_JOURNAL_SUFFIX = ".journal"


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so the names created, renamed or removed in it are durable.

    Filesystems that cannot fsync a directory (EINVAL/ENOTSUP) are tolerated silently.
    """
    _fsync(os.fspath(path), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def fsync_file(path: str | os.PathLike) -> None:
    """fsync one regular file by path (what `fsync_tree` does to each file)."""
    _fsync(os.fspath(path), os.O_RDONLY)


def _fsync(path: str, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every regular file and directory under ``root`` (children before parents)."""
    for dirpath, _dirnames, filenames in os.walk(os.fspath(root), topdown=False):
        for name in filenames:
            p = os.path.join(dirpath, name)
            if os.path.isfile(p) and not os.path.islink(p):
                fsync_file(p)
        fsync_dir(dirpath)


# ---------------------------------------------------------------------------- fault injection (test hook)

FAULT_KILL_ENV = "RESHARD_FAULT_KILL_AT"    # N: SIGKILL this process right after write event N
FAULT_RANK_ENV = "RESHARD_FAULT_RANK"        # R: only the worker with RANK=R counts events
FAULT_SLEEP_ENV = "RESHARD_FAULT_SLEEP_AT"  # N:SECONDS or LABEL:SECONDS: sleep that long right after that write event
FAULT_COUNT_ENV = "RESHARD_FAULT_COUNT"     # PATH: append "N LABEL" for every write event
_fault_events = 0


def fault_point(label: str) -> int:
    """Count one write event of this process; returns its number (1, 2, ...).

    A test hook with no effect unless one of the ``RESHARD_FAULT_*`` variables is set:
    ``RESHARD_FAULT_COUNT=PATH`` appends ``"N LABEL"`` per event (the last line gives the
    total of an uninterrupted run), ``RESHARD_FAULT_SLEEP_AT=N:SECONDS`` pauses after event
    N (or after the first event called LABEL, ``RESHARD_FAULT_SLEEP_AT=rename:30``: right after the
    commit), ``RESHARD_FAULT_KILL_AT=N`` SIGKILLs the process after event N, or after the first event
    called LABEL (``upload .metadata``: an upload to object storage; no cleanup of any
    kind runs: what is left on disk is what a power cut or the OOM killer leaves).
    ``RESHARD_FAULT_RANK=R`` limits all of this to the worker whose ``RANK`` is R (a
    distributed conversion; every other worker counts nothing).
    """
    global _fault_events
    env = os.environ
    only = env.get(FAULT_RANK_ENV)
    if only is not None and only.strip() != env.get("RANK", "0"):
        return 0  # a distributed run: faults act on one worker only
    _fault_events += 1
    n = _fault_events
    count = env.get(FAULT_COUNT_ENV)
    if count:
        with open(count, "a") as f:
            f.write(f"{n} {label}\n")
    pause = env.get(FAULT_SLEEP_ENV)
    if pause:
        at, _, secs = pause.rpartition(":")  # a label may hold colons (item FILE:OFFSET)
        if at.strip() in (str(n), label):
            time.sleep(float(secs or 1))
    kill = env.get(FAULT_KILL_ENV)
    if kill and kill.strip() in (str(n), label):
        os.kill(os.getpid(), signal.SIGKILL)
    return n


# ---------------------------------------------------------------------------- state of dst

def _state(dst: Path) -> str:
    """'absent' | 'empty_dir' | 'occupied' (non-empty directory, file, or symlink)."""
    if not os.path.lexists(dst):
        return "absent"
    if dst.is_dir() and not dst.is_symlink():
        with os.scandir(dst) as it:
            return "occupied" if any(True for _ in it) else "empty_dir"
    return "occupied"


def _refuse(dst: Path) -> BadInput:
    return BadInput(
        "the output already exists and is not empty",
        where=str(dst),
        hint="Choose another output path, or pass --overwrite to replace it entirely.",
    )


def check_vacant(dst: Path, *, overwrite: bool) -> None:
    """The refusal of an occupied destination without ``--overwrite``, made by the commands before any
    work (`reshard.arguments.check_destination`: no torch import, no plan, no probe) and again by
    `atomic_directory` under its lock, where it decides."""
    if not overwrite and _state(dst) == "occupied":
        raise _refuse(dst)


def _mount_of(path: Path) -> tuple[str, str, bool] | None:
    """(mount point, file-system type, read-only) of the mount that holds ``path``, from
    ``/proc/self/mounts`` (None where there is no such table): the reason a directory takes no file."""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            rows = [line.split() for line in f]
    except OSError:
        return None
    real, best = os.path.realpath(path), None
    for row in rows:
        if len(row) < 4:
            continue
        mnt = row[1].replace("\\040", " ")
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and (best is None or len(mnt) >= len(best[0])):
            best = (mnt, row[2], "ro" in row[3].split(","))
    return best


def check_writable(dst: Path) -> None:
    """`BadInput` when no file can be created where ``dst`` would go, found by creating (and removing)
    one empty file of our own in the nearest existing directory above it. Asked before the space
    check: an unwritable place (``/proc``, a read-only mount, a directory without permission) reports
    no free space, and the advice to pass ``--force`` would then fail on the lock file."""
    place = dst.parent
    while not os.path.lexists(place) and place != place.parent:
        place = place.parent
    probe = place / f".reshard-probe-{secrets.token_hex(6)}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError as exc:
        mount = _mount_of(place)
        why = f"{exc.strerror}, {errno.errorcode.get(exc.errno or 0, exc.errno)}"
        if mount is not None:
            why += f"; {place} is on a '{mount[1]}' file system mounted at {mount[0]}{' read-only' if mount[2] else ''}"
        raise BadInput(f"the destination cannot be written: creating a file in {place} failed ({why})",
                       where=str(dst), hint="Choose a destination in a directory you can write to.") from None
    os.close(fd)
    os.unlink(probe)


def _check_replaceable(dst: Path, replaceable: OverwritePolicy | None) -> None:
    """`BadInput` unless the caller's overwrite policy lets ``--overwrite`` delete what is at ``dst``
    (the commands': a checkpoint or an earlier reshard output), quoting the policy's reason."""
    if replaceable is None:  # a programming error, not a user's: --overwrite without a rule deletes nothing
        raise TypeError("atomic_directory(overwrite=True) needs replaceable=, the policy of what --overwrite may "
                        "replace (reshard.storage.files.replaceable.why_not_replaceable)")
    why = replaceable(dst)
    if why is None:
        return
    raise BadInput(
        f"--overwrite will not replace this output: {why}",
        where=str(dst),
        hint="--overwrite replaces only a checkpoint or an earlier reshard output (formats/replaceable.toml); "
             "move the other files out of it, or choose another output path.",
    )


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


# ---------------------------------------------------------------------------- locking

def _acquire_lock(lock_path: Path, dst: Path) -> int:
    """Exclusive, non-blocking flock on ``lock_path``; returns the open fd.

    The holder unlinks the lock file when done, so after locking we check that the file
    we locked is still the one at ``lock_path`` (else a finished run unlinked it under us
    and a third run could lock a fresh file): retry in that case.
    """
    for _ in range(100):
        try:  # never follow a planted symlink (it would create or lock a file where it points)
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
                         | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                raise BadInput(f"the lock file '{lock_path.name}' beside the destination is not a regular file "
                               f"({'a symbolic link' if lock_path.is_symlink() else 'a special file'})",
                               where=str(lock_path), hint="Remove it (no reshard run makes one) and run again.") from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise BadInput(f"the lock file '{lock_path.name}' beside the destination is not a regular file",
                           where=str(lock_path), hint="Remove it (no reshard run makes one) and run again.")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise BadInput(
                f"another reshard run is writing {dst}",
                where=str(dst),
                hint=f"Wait for it to finish. If no run is active, remove '{lock_path}'.",
            ) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.fstat(fd).st_ino == os.stat(lock_path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # locked a file that was unlinked meanwhile; try again
    raise BadInput(f"could not take the lock for {dst}", where=str(lock_path))  # pragma: no cover


def _release_lock(fd: int, lock_path: Path) -> None:
    try:
        try:
            lock_path.unlink()  # while still holding the lock (see _acquire_lock)
        except FileNotFoundError:
            pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- swapping

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with renameat2(RENAME_EXCHANGE); False when unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _replace_occupied(tmp: Path, dst: Path, *, use_exchange: bool = True) -> None:
    """Put ``tmp`` at ``dst`` and delete the old ``dst``; never show a mix of both."""
    if use_exchange and _exchange(tmp, dst):
        fsync_dir(dst.parent)
        _remove(tmp)  # tmp now holds the old output
        return
    trash = dst.parent / f".{dst.name}{_TRASH_TAG}{secrets.token_hex(6)}"
    os.rename(dst, trash)
    try:
        os.rename(tmp, dst)  # dst is absent only between these two renames
    except BaseException:
        os.rename(trash, dst)  # put the old output back
        raise
    fsync_dir(dst.parent)
    _remove(trash)


# ---------------------------------------------------------------------------- the context

def _make_tmp(parent: Path, name: str) -> Path:
    # os.mkdir (not tempfile.mkdtemp, which forces mode 0700) so the final output gets the
    # same permissions as a directory created with mkdir under the user's umask.
    for _ in range(100):
        tmp = parent / f".{name}{_TMP_TAG}{secrets.token_hex(6)}"
        try:
            os.mkdir(tmp)
            return tmp
        except FileExistsError:
            continue
    raise BadInput("could not create a temporary directory", where=str(parent))  # pragma: no cover



def stale_temporaries(parent: Path, name: str) -> list[Path]:
    """Temporary directories of earlier runs into ``parent / name`` (``.{name}.reshard-tmp-<hex>``)."""
    pat = re.compile(r"^\." + re.escape(name) + re.escape(_TMP_TAG) + r"[0-9a-f]{12}$")
    try:
        with os.scandir(parent) as it:
            return sorted(Path(e.path) for e in it if pat.match(e.name))
    except FileNotFoundError:
        return []


def reclaimable_bytes(dst: str | os.PathLike) -> int:
    """Disk space that killed runs into ``dst`` hold (their temporary directories and journals):
    the next run into ``dst`` either resumes into it or deletes it before writing, so a space
    check counts it as free. Allocated blocks of regular files, symlinks not followed."""
    dst = Path(os.path.abspath(os.fspath(dst)))
    total = 0
    for tmp in stale_temporaries(dst.parent, dst.name):
        for top in (tmp, journal_dir(tmp)):
            for dirpath, _dirs, files in os.walk(top):
                for name in files:
                    try:
                        st = os.lstat(os.path.join(dirpath, name))
                    except OSError:
                        continue
                    if stat.S_ISREG(st.st_mode):
                        total += st.st_blocks * 512
    return total


def journal_dir(tmp: Path) -> Path:
    """Where a resumable run into the temporary directory ``tmp`` keeps its journal: beside it, not in it."""
    return tmp.parent / (tmp.name + _JOURNAL_SUFFIX)


def _clean_stale(parent: Path, name: str, keep: Path | None = None) -> None:
    """Delete what killed runs into the same output left behind, but ``keep`` (resumed) and its journal
    (call only holding the lock)."""
    for p in stale_temporaries(parent, name):
        if p != keep:
            shutil.rmtree(p, ignore_errors=True)
    pat = re.compile(r"^\." + re.escape(name) + re.escape(_TMP_TAG) + r"[0-9a-f]{12}" + re.escape(_JOURNAL_SUFFIX) + "$")
    with os.scandir(parent) as it:
        journals = [Path(e.path) for e in it if pat.match(e.name)]
    for j in journals:
        if keep is None or j != journal_dir(keep):
            shutil.rmtree(j, ignore_errors=True)


@contextmanager
def atomic_directory(dst: str | os.PathLike, *, overwrite: bool = False,
                     reuse: Callable[[list[Path]], Path | None] | None = None,
                     keep: Callable[[BaseException], bool] | None = None,
                     replaceable: OverwritePolicy | None = None) -> Iterator[Path]:
    """Yield an empty temporary directory that becomes ``dst`` when the block succeeds.

    - ``dst`` absent or an empty directory: the temporary directory is renamed onto it.
    - ``dst`` non-empty (or a file/symlink): `BadInput` before anything is created, unless
      ``overwrite`` — then the old ``dst`` is replaced as a whole (see module docstring), but
      only when the policy ``replaceable(dst)`` returns None (its reason otherwise, quoted in
      the refusal; the commands pass `reshard.storage.files.replaceable.why_not_replaceable`, and
      ``overwrite`` without a policy is a `TypeError`). Checked before anything is created, under the lock, and again
      right before the swap. A ``dst`` that is a symbolic link is replaced as a link: its
      target is never touched, and the new directory stands at ``dst`` itself.
    - An exception in the block deletes the temporary directory and propagates; ``dst``
      is untouched.
    - A concurrent run into the same ``dst`` raises `BadInput` ("another reshard run is
      writing ...") instead of proceeding.
    - Temporary directories left by killed runs into the same ``dst`` are deleted once the
      lock is held; a stale lock file is simply reused.

    - ``reuse`` (a resumable conversion, `reshard.storage.files.journal.Journal.choose`): called under
      the lock with the stale temporary directories; the one it returns is yielded as it is
      (the others are deleted). The journal beside the yielded directory (`journal_dir`) is
      deleted at the commit or with the directory; a ``KeyboardInterrupt`` keeps both, and so
      does any exception ``keep`` accepts (a distributed run whose worker was killed).

    Missing parent directories of ``dst`` are created (after the checks above pass). Whether
    ``dst`` overlaps the input is the caller's concern.
    """
    dst = Path(os.path.abspath(os.fspath(dst)))
    if not dst.name:
        raise BadInput("the output path has no name", where=str(dst))
    if _state(dst) == "occupied":
        if not overwrite:
            raise _refuse(dst)
        _check_replaceable(dst, replaceable)
    parent = dst.parent
    parent.mkdir(parents=True, exist_ok=True)
    lock_path = parent / f".{dst.name}{_LOCK_TAG}"
    lock_fd = _acquire_lock(lock_path, dst)
    try:
        # Re-check under the lock: another run may have finished since the first look.
        if _state(dst) == "occupied":
            if not overwrite:
                raise _refuse(dst)
            _check_replaceable(dst, replaceable)
        chosen = reuse(stale_temporaries(parent, dst.name)) if reuse is not None else None
        _clean_stale(parent, dst.name, keep=chosen)
        tmp = chosen if chosen is not None else _make_tmp(parent, dst.name)
        done = False
        try:
            yield tmp
            fsync_tree(tmp)
            state = _state(dst)
            if state == "occupied":
                if not overwrite:
                    raise _refuse(dst)
                _check_replaceable(dst, replaceable)  # files may have been added while the output was written
                _replace_occupied(tmp, dst)
            else:
                # rename(2) replaces an empty directory atomically.
                os.rename(tmp, dst)
            done = True  # the new output stands at dst: from here on an interrupt leaves it complete
            _COMMITTED.add(dst)
            if state != "occupied":
                fsync_dir(parent)
            shutil.rmtree(journal_dir(tmp), ignore_errors=True)
            fault_point("rename")
        except BaseException as exc:
            if reuse is not None and (isinstance(exc, KeyboardInterrupt) or (keep is not None and keep(exc))) \
                    and not done and os.path.isdir(tmp):
                raise  # interrupted on purpose: the next run into dst resumes from what is there
            if os.path.lexists(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(journal_dir(tmp), ignore_errors=True)
            raise
    finally:
        _release_lock(lock_fd, lock_path)


_COMMITTED: set[Path] = set()  # outputs this process renamed into place since forget_commits()


def committed(dst: str | os.PathLike) -> bool:
    """Whether this process renamed a new output into place at ``dst`` (since `forget_commits`)."""
    return Path(os.path.abspath(os.fspath(dst))) in _COMMITTED


def forget_commits() -> None:
    """Start a new command's record of commits (the command line runs many commands in one test process)."""
    _COMMITTED.clear()


def identity(path: str | os.PathLike) -> tuple[int, int]:
    """(device, inode) of what stands at ``path`` (not followed), (0, 0) when nothing does. A commit
    puts a new directory there (rename or exchange), so a changed identity is how a process that
    did not commit itself (the `--workers` launcher) tells that its worker 0 did."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0, 0
    return st.st_dev, st.st_ino


def what_is_left(dst: str | os.PathLike, *, before: tuple[int, int] | None = None) -> str:
    """What an interrupted run into ``dst`` left: ``"committed"`` (the new output is in place:
    this process committed it, or ``before``, the `identity` of ``dst`` when the command began, is
    given and differs from now), ``"resumable"`` (a temporary directory and its journal wait beside
    ``dst`` for the next run, `journal_dir`) or ``"nothing"`` (``dst`` unchanged, nothing kept)."""
    dst = Path(os.path.abspath(os.fspath(dst)))
    if committed(dst) or (before is not None and identity(dst) != before):
        return "committed"
    if any(journal_dir(tmp).is_dir() for tmp in stale_temporaries(dst.parent, dst.name)):
        return "resumable"
    return "nothing"


def output_path(dst: str | os.PathLike) -> Path:
    """The path the committed output stands at, for reports: ``dst`` absolute, its parent resolved, its own
    name kept. Not ``dst.resolve()``: a ``dst`` that is a symbolic link is replaced by the new directory
    (`atomic_directory`), so resolving it would name the old link's target, which nothing wrote."""
    dst = Path(os.path.abspath(os.fspath(dst)))
    return dst.parent.resolve() / dst.name


def check_destination(src: Path, dst: Path) -> None:
    """An output must not overlap its source: the source is never modified, and an atomic
    rename over or inside it would be."""
    s, d = src.resolve(), dst.resolve()
    if d == s or s in d.parents or d in s.parents:
        raise BadInput("the destination overlaps the source", where=str(dst),
                       hint="Write the converted checkpoint to a separate directory; the source is never modified.")
