"""A durable multi-stream direct-I/O copy of a folder: the device's own "copy these bytes" anchor.

    python scripts/directcopy.py SRC DST [--streams 4] [--block-mib 8] [--json]

Why it exists: a conversion reads every byte of its source once and writes it once, durably
(fsynced before the commit). The fairest floor to compare it with is the same bytes copied
durably at the device's best speed, with no page cache on either side (``cp -r && sync`` pays
the kernel's page-cache work, which on this virtual machine costs more than the copy). This
tool is that floor: every regular file of SRC (recursively) is cut into ``--block-mib``
pieces, ``--streams`` threads each read a piece with ``O_DIRECT`` into an aligned buffer and
write it with ``O_DIRECT`` at the same offset of the copy; a file's last partial block is
written whole and the file truncated to its size; every file and directory is fsynced at the
end. Python runs once per block (8 MiB), so the CPU it takes is the kernel's and the disk's.

Prints the wall time, the CPU seconds of this process (user + sys) and the throughput; ``--json``
prints them as one JSON object. DST must not exist. A file system without ``O_DIRECT`` (tmpfs) is
refused rather than silently measured through the page cache.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import queue
import resource
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ALIGN = 4096


@dataclass(frozen=True)
class Piece:
    """One block of one file: read at ``offset`` of ``src``, written at the same offset of ``dst``."""

    src: int
    dst: int
    offset: int
    nbytes: int  # the bytes the file holds there (the last block may be short)


def _worker(pieces: "queue.Queue[Piece | None]", block: int, errors: list[BaseException]) -> None:
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    view = memoryview(buf)
    try:
        while (p := pieces.get()) is not None:
            padded = (p.nbytes + ALIGN - 1) // ALIGN * ALIGN
            got = 0
            while got < p.nbytes:
                n = os.preadv(p.src, [view[got:padded]], p.offset + got)
                if n <= 0:
                    raise OSError(f"short read at offset {p.offset + got}")
                got += n
            done = 0
            while done < padded:
                done += os.pwritev(p.dst, [view[done:padded]], p.offset + done)
    except BaseException as exc:  # noqa: BLE001 - reported by the main thread
        errors.append(exc)
        while pieces.get() is not None:  # drain so the producer never blocks
            pass
    finally:
        view.release()
        buf.close()


def direct_copy(src: Path, dst: Path, streams: int = 4, block: int = 8 << 20) -> int:
    """Copy the folder ``src`` to ``dst`` (new) durably with direct I/O; returns the bytes copied."""
    if block % ALIGN:
        raise ValueError(f"the block size must be a multiple of {ALIGN}")
    files = sorted(p for p in src.rglob("*") if p.is_file())
    dst.mkdir(parents=True)
    opened: list[tuple[int, int, int]] = []
    total = 0
    pieces: queue.Queue[Piece | None] = queue.Queue(maxsize=4 * streams)
    errors: list[BaseException] = []
    threads = [threading.Thread(target=_worker, args=(pieces, block, errors), daemon=True) for _ in range(streams)]
    for t in threads:
        t.start()
    try:
        for f in files:
            out = dst / f.relative_to(src)
            out.parent.mkdir(parents=True, exist_ok=True)
            size = f.stat().st_size
            try:
                sfd = os.open(f, os.O_RDONLY | os.O_DIRECT)
                dfd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
            except OSError as exc:
                raise SystemExit(f"directcopy: cannot open {f} or {out} with O_DIRECT ({exc}); "
                                 "this tool measures direct I/O only") from exc
            opened.append((sfd, dfd, size))
            total += size
            for off in range(0, size, block):
                if errors:
                    break
                pieces.put(Piece(sfd, dfd, off, min(block, size - off)))
    finally:
        for _ in threads:
            pieces.put(None)
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    for sfd, dfd, size in opened:
        os.ftruncate(dfd, size)  # the last block was written whole (direct writes are aligned)
        os.fsync(dfd)
        os.close(dfd)
        os.close(sfd)
    for d in sorted({p.parent for p in dst.rglob("*")} | {dst}):
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--streams", type=int, default=4, help="parallel reader/writer threads (default 4)")
    ap.add_argument("--block-mib", type=int, default=8, help="bytes per request, MiB (default 8)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if args.dst.exists():
        ap.error(f"{args.dst} exists; give a new folder")
    t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    n = direct_copy(args.src, args.dst, streams=max(1, args.streams), block=args.block_mib << 20)
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    out = {"bytes": n, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
           "gib_per_s": round(n / (1 << 30) / wall, 3) if wall else None, "streams": args.streams,
           "block_mib": args.block_mib}
    print(json.dumps(out) if args.json else
          f"{n} bytes in {wall:.2f} s ({out['gib_per_s']} GiB/s), CPU {cpu:.2f} s, {args.streams} streams")
    return 0


if __name__ == "__main__":
    sys.exit(main())
