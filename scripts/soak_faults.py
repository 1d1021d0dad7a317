#!/usr/bin/env python3
"""Soak test for `reshard convert` under faults: a kill at EVERY write event, and random byte mutations.

Kill loop: one uninterrupted ``python -m reshard convert SRC DST --to SPEC`` (with
``SOURCE_DATE_EPOCH``) counts the write events (``RESHARD_FAULT_COUNT``) and is kept as
the reference; then for every event N (or every ``--stride``-th) the same command runs with
``RESHARD_FAULT_KILL_AT=N`` and must die by SIGKILL leaving DST absent (or, after the final
rename, complete and identical), no held lock and at most one hidden temporary directory
that is either uncommitted or complete; then the same command again must exit 0 with every
file byte-identical to the reference and nothing left beside DST. The source must be
unchanged (sha256, mtime, size of every file) after every run.

Mutations: for ``--mutations`` random (seeded) single-byte changes inside the reference
output's data files, ``reshard inspect --deep`` must exit 2 naming the item whose byte
range holds the changed byte (checksums in manifest.json), and ``reshard verify SRC OUT``
must exit 2 naming the same key.

Prints tried/failed counts per part; exit 1 if anything failed.

    python scripts/soak_faults.py                      # builds a bigger reference checkpoint
    python scripts/soak_faults.py --src CKPT --jobs 2 --stride 1 --mutations 200
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

EPOCH = "1700000000"


def snapshot(d: Path) -> dict[str, tuple[str, int, int]]:
    out = {}
    for p in sorted(Path(d).rglob("*")):
        if p.is_file():
            st = p.stat()
            out[str(p.relative_to(d))] = (hashlib.sha256(p.read_bytes()).hexdigest(), st.st_mtime_ns, st.st_size)
    return out


def contents(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(d).iterdir())}


def env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("RESHARD_FAULT_")}
    e["SOURCE_DATE_EPOCH"] = EPOCH
    e.update(extra)
    return e


def reshard(*args: str, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "reshard", *map(str, args)], env=env(**extra),
                          capture_output=True, text=True, timeout=1800)


def build_source(where: Path) -> Path:
    """A bigger reference checkpoint than the tests' (dim 64, 4 layers, 4 ranks)."""
    from reshard.reference import TrainConfig, run_reference

    cfg = TrainConfig(dp=4, tp=1, steps=2, save_at=[2], out=str(where), dim=64, n_layers=4, n_heads=4,
                      experiment_id="soak")
    return run_reference(cfg)[-1]


class Lane:
    """One destination directory (parent of its own), with its own reference output."""

    def __init__(self, root: Path, src: Path, to: str):
        self.root, self.src, self.to = root, src, to
        root.mkdir(parents=True, exist_ok=True)
        self.dst = root / "dst"
        self.reference = root / "reference"

    def convert(self, *extra: str, **env_extra: str) -> subprocess.CompletedProcess:
        return reshard("convert", self.src, self.dst, "--to", self.to, *extra, **env_extra)

    def temporaries(self) -> list[Path]:
        from reshard.storage.files.atomic import stale_temporaries

        return stale_temporaries(self.root, "dst")

    def lock_held(self) -> bool:
        lp = self.root / ".dst.reshard-lock"
        if not lp.exists():
            return False
        fd = os.open(lp, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)


def kill_once(lane: Lane, n: int, total: int, before: dict) -> str | None:
    """Kill at event n, check, rerun, check. None if fine, else what went wrong."""
    from reshard.storage.checkpoints.index import CheckpointIndex

    r = lane.convert(RESHARD_FAULT_KILL_AT=str(n))
    if r.returncode != -signal.SIGKILL:
        return f"not killed (exit {r.returncode}): {r.stderr.strip()[:300]}"
    if n < total:
        if lane.dst.exists():
            return "dst exists after a kill before the rename"
        temps = lane.temporaries()
        if len(temps) > 1:
            return f"{len(temps)} temporary directories"
        for t in temps:
            if (t / ".metadata").exists() and not CheckpointIndex.open(t).complete:
                return f"{t.name} is committed but incomplete"
        i = reshard("inspect", lane.dst)
        if i.returncode != 2:
            return f"inspect dst exit {i.returncode}"
    elif contents(lane.dst) != contents(lane.reference):
        return "killed after the rename but dst differs from the reference"
    if lane.lock_held():
        return "lock still held after the process died"
    extra = ("--overwrite",) if n >= total else ()
    r = lane.convert(*extra)
    if r.returncode != 0:
        return f"rerun exit {r.returncode}: {r.stderr.strip()[:300]}"
    a, b = contents(lane.dst), contents(lane.reference)
    if a != b:
        return "rerun differs from the reference: " + ", ".join(sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k)))
    if lane.temporaries() or (lane.root / ".dst.reshard-lock").exists():
        return "left a temporary directory or lock file after success"
    shutil.rmtree(lane.dst)
    if snapshot(lane.src) != before:
        return "the source changed"
    return None


def mutate_once(src: Path, ref: Path, work: Path, rng: random.Random, before: dict) -> str | None:
    from reshard.storage.checkpoints.index import CheckpointIndex

    ix = CheckpointIndex.open(ref)
    spans = []  # (file, start, end, key)
    for e in ix.entries.values():
        for loc in ([c.location for c in e.chunks] if e.is_tensor else [e.location]):
            spans.append((loc.file, loc.offset, loc.offset + loc.length, e.key))
    file, start, end, key = rng.choice(spans)
    pos = rng.randrange(start, end)
    out = work / "mutated"
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(ref, out)
    with open(out / file, "r+b") as f:
        f.seek(pos)
        b = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([b ^ (1 << rng.randrange(8))]))
    what = f"{file}@{pos} ('{key}')"
    i = reshard("inspect", "--deep", out)
    if i.returncode != 2 or f"item '{key}'" not in i.stdout + i.stderr:
        return f"{what}: inspect --deep exit {i.returncode}, key not named"
    v = reshard("verify", src, out)
    if v.returncode != 2 or f"item '{key}'" not in v.stderr:
        return f"{what}: verify exit {v.returncode}: {(v.stdout + v.stderr).strip()[:200]}"
    if snapshot(src) != before:
        return "the source changed"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", type=Path, help="source checkpoint (default: build a bigger reference checkpoint)")
    ap.add_argument("--to", default="dp=2")
    ap.add_argument("--work", type=Path, help="scratch directory (default: a temporary one, removed)")
    ap.add_argument("--jobs", type=int, default=2, help="kills run in parallel, one lane (dst) each")
    ap.add_argument("--stride", type=int, default=1, help="kill at every STRIDE-th event (1: all)")
    ap.add_argument("--mutations", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    work = args.work or Path(tempfile.mkdtemp(prefix="reshard-soak-"))
    t0 = time.time()
    try:
        src = args.src.resolve() if args.src else build_source(work / "source")
        before = snapshot(src)
        lanes = [Lane(work / f"lane{i}", src, args.to) for i in range(max(1, args.jobs))]
        with ThreadPoolExecutor(len(lanes)) as pool:
            refs = list(pool.map(lambda ln: ln.convert(RESHARD_FAULT_COUNT=str(ln.root / "events")), lanes))
        for lane, r in zip(lanes, refs):
            if r.returncode != 0:
                print(f"reference conversion failed: {r.stderr}", file=sys.stderr)
                return 1
            lane.dst.rename(lane.reference)
        labels = [ln.split(" ", 1)[1] for ln in (lanes[0].root / "events").read_text().splitlines()]
        total = len(labels)
        points = list(range(1, total + 1, max(1, args.stride)))
        if total not in points:
            points.append(total)
        print(f"source {src}: {total} write events; killing at {len(points)} of them on {len(lanes)} lanes", flush=True)

        failures: list[str] = []
        queue = list(points)

        def lane_worker(lane: Lane) -> None:
            while queue:
                try:
                    n = queue.pop(0)
                except IndexError:
                    return
                err = kill_once(lane, n, total, before)
                if err:
                    failures.append(f"kill at event {n} ({labels[n - 1]}): {err}")
                    print(f"FAIL kill {n}: {err}", flush=True)
                    if lane.dst.exists():
                        shutil.rmtree(lane.dst)

        with ThreadPoolExecutor(len(lanes)) as pool:
            list(pool.map(lane_worker, lanes))
        print(f"kills      tried {len(points)}  failed {len(failures)}  ({time.time() - t0:.0f} s)", flush=True)

        rng = random.Random(args.seed)
        mfail: list[str] = []
        for _ in range(args.mutations):
            err = mutate_once(src, lanes[0].reference, work, rng, before)
            if err:
                mfail.append(err)
                print(f"FAIL mutation: {err}", flush=True)
        print(f"mutations  tried {args.mutations}  failed {len(mfail)}  ({time.time() - t0:.0f} s)", flush=True)
        for f in failures + mfail:
            print("  " + f)
        return 1 if failures or mfail else 0
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
