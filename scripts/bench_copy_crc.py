"""The two per-byte costs of the direct copy that part 2 of issue 45 cut, measured alone (issue 45).

    python scripts/bench_copy_crc.py [--file BIG_FILE] [--rounds 3] [--out bench-results]

* **the stage copy and the CRC-32**: a direct read of a source storage that does not start on a block
  boundary lands in an aligned stage and is copied to its place in the slab; the copy checksums it.
  Measured on buffers that are not in the caches (64 pairs of 8 MiB, each used once per pass, as a
  direct read leaves them): ``dst[:] = src`` then ``crc32(dst)`` (before), against
  ``fastcrc.copy_crc(dst, src)`` (one pass: `reshard.storage.files.fileio.copy_crc`), and each of the
  two alone. Thread CPU seconds per GiB; the results are checked equal to zlib's.
* **the buffers of direct I/O**: ``O_DIRECT`` reads of ``--file`` (1 GiB of it, 8 MiB requests, page
  cache dropped first when root) into a buffer from ``mmap.mmap(-1, n)`` (shared anonymous memory:
  no transparent huge pages) against one from `reshard.storage.files.fileio.aligned_buffer` (private,
  in huge pages where the kernel gives them). System CPU seconds per GiB, and the huge pages the
  process held.

Rounds alternate the variants; medians are reported, every round is kept in the JSON.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import statistics
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from reshard.storage.files import fileio  # noqa: E402 - after the path

GIB = 1 << 30
SLAB = 8 << 20


def copy_variants(pairs: int) -> dict:
    """Thread CPU per GiB of each way to copy and checksum cold buffers (one pass over ``pairs`` pairs)."""
    from reshard.storage.files import fastcrc

    stages = [memoryview(mmap.mmap(-1, SLAB + 8192)) for _ in range(pairs)]
    slabs = [fileio.aligned_buffer(SLAB) for _ in range(pairs)]
    for s in stages:
        s[:] = os.urandom(len(s))
    for s in slabs:
        s[:] = bytes(len(s))
    lead = 1234  # a storage 1,234 bytes past a block boundary
    src = [s[lead:lead + SLAB] for s in stages]
    ways = {
        "copy_then_crc": lambda i: fastcrc.crc32(_copy(slabs[i], src[i])),
        "copy_crc": lambda i: fastcrc.copy_crc(slabs[i], src[i]),
        "copy_alone": lambda i: _copy(slabs[i], src[i]),
        "crc_alone": lambda i: fastcrc.crc32(src[i]),
    }
    a, b = bytearray(os.urandom(1 << 20)), bytearray(1 << 20)  # the values, on buffers of their own
    assert fastcrc.copy_crc(memoryview(b)[:(1 << 20) - 7], memoryview(a)[7:]) == zlib.crc32(a[7:]) and b[:-7] == a[7:]
    out = {}
    for name, fn in ways.items():
        t = time.thread_time()
        for i in range(pairs):
            fn(i)
        out[name] = round((time.thread_time() - t) / (pairs * SLAB) * GIB, 4)
    return out


def _copy(dst: memoryview, src: memoryview) -> memoryview:
    dst[:] = src
    return dst


def direct_reads(path: Path, nbytes: int, huge: bool, drop: bool) -> dict:
    """System CPU per GiB of ``O_DIRECT`` reads of ``path`` into one 8 MiB buffer, and its huge pages."""
    buf = fileio.aligned_buffer(SLAB) if huge else memoryview(mmap.mmap(-1, SLAB))
    buf[:] = bytes(SLAB)  # fault it in before the clock starts
    if drop:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        end = min(os.fstat(fd).st_size, nbytes) // SLAB * SLAB
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        for pos in range(0, end, SLAB):
            os.preadv(fd, [buf], pos)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        os.close(fd)
    anon_huge = next((int(line.split()[1]) for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages:")), 0)
    del buf
    return {"sys_s_per_gib": round((r1.ru_stime - r0.ru_stime) / end * GIB, 4),
            "user_s_per_gib": round((r1.ru_utime - r0.ru_utime) / end * GIB, 4), "anon_huge_kib": anon_huge}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", default=None, help="a file of 1 GiB or more on a file system with O_DIRECT (default: none: "
                                                 "the buffers' part is skipped)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=64, help="8 MiB buffer pairs (default 64: 1 GiB, past the caches)")
    ap.add_argument("--out", default="bench-results")
    args = ap.parse_args(argv)
    drop = os.geteuid() == 0
    rounds: dict[str, list] = {"copy": [], "direct_shared": [], "direct_private_huge": []}
    for i in range(args.rounds):
        rounds["copy"].append(copy_variants(args.pairs))
        if args.file:
            rounds["direct_shared"].append(direct_reads(Path(args.file), GIB, False, drop))
            rounds["direct_private_huge"].append(direct_reads(Path(args.file), GIB, True, drop))
        print(f"round {i + 1}: {json.dumps({k: v[-1] for k, v in rounds.items() if v})}", file=sys.stderr, flush=True)
    summary = {"copy (thread CPU s/GiB)": {k: round(statistics.median(r[k] for r in rounds["copy"]), 4)
                                          for k in rounds["copy"][0]}}
    for k in ("direct_shared", "direct_private_huge"):
        if rounds[k]:
            summary[f"{k} (s/GiB)"] = {f: statistics.median(r[f] for r in rounds[k]) for f in rounds[k][0]}
    result = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_average": os.getloadavg(),
              "native": fileio.copy_crc is not fileio.copy_then_crc, "summary": summary, "rounds": rounds}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_copy_crc.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({"summary": summary, "load_average": result["load_average"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
