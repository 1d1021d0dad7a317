"""Benchmark: what resuming a killed ``reshard convert`` saves, against starting over.

A conversion killed at ``--kill-at`` (default 50 %) of its items is run again two ways into
the same destination, each from the same killed state:

    python -m reshard convert SRC DST --to dp=2 --json              # resumes (the default)
    python -m reshard convert SRC DST --to dp=2 --json --restart    # starts over

Source: ``--size-gib`` (default 4) of float32 tensors of ``--tensor-mib`` MiB (default 16),
``Shard(0)`` over ``--world-size`` gloo ranks with a real ``dcp.save``
(`reshard.testing.synthetic.make_sharded`) and a minimal manifest (``scripts/bench_convert_memory.py``).
Every run is a fresh subprocess measured by ``os.wait4`` (wall, CPU, peak RSS), with
``SOURCE_DATE_EPOCH=0`` so outputs are comparable byte for byte; every run writes into the
same destination path (the reports name it). The kill is the conversion's own test hook
(``RESHARD_FAULT_KILL_AT=N``: SIGKILL right after write event N, `reshard.engine.conversion`);
``RESHARD_FAULT_COUNT`` counts the items each run writes. The page cache is warm throughout
(the source was just written), as for a rerun minutes after a kill.

Printed: a Markdown section (the one in docs/benchmarks.md); ``--json-out FILE`` keeps the
numbers. Checked and printed as yes/no: the resumed output is byte-identical to an
uninterrupted run's (every file, reports included), and so is the restarted one.
"""
from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_convert_memory import GIB, add_manifest, machine, measure, tensor_shape  # scripts/ is not a package

EPOCH = "0"


def files_equal(a: Path, b: Path) -> list[str]:
    """Names of the files that differ (or exist on one side only), compared in blocks: reading
    them whole would raise this process's RSS, which every run it starts inherits in its
    ``ru_maxrss`` (the kernel keeps the maximum across fork and exec)."""
    names = sorted({p.name for p in a.iterdir()} | {p.name for p in b.iterdir()})
    return [n for n in names if not ((a / n).is_file() and (b / n).is_file()
                                     and filecmp.cmp(a / n, b / n, shallow=False))]


def items(count_file: Path) -> int:
    if not count_file.exists():
        return 0
    return sum(1 for ln in count_file.read_text().splitlines() if ln.split(" ", 1)[1].startswith("item "))


def convert(py: str, src: Path, dst: Path, to: str, log: Path, name: str, *extra: str, timeout: float,
            **fault: str) -> dict:
    saved = dict(os.environ)
    os.environ.update({"SOURCE_DATE_EPOCH": EPOCH, **fault})
    try:
        r = measure([py, "-m", "reshard", "convert", str(src), str(dst), "--to", to, "--json", *extra],
                    timeout=timeout, sample_ms=200, log_dir=log, name=name)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    r.pop("samples", None)
    return r


def commit() -> str:
    import subprocess

    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parent)
    return r.stdout.strip() or "?"


def output_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.iterdir() if p.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--tensor-mib", type=float, default=16.0)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--to", default="dp=2")
    ap.add_argument("--kill-at", type=float, default=0.5, help="fraction of the items written before the SIGKILL")
    ap.add_argument("--workdir", type=Path, default=None, help="where the checkpoints go (default: a temporary directory)")
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--timeout", type=float, default=3600.0)
    args = ap.parse_args(argv)
    py = sys.executable
    from reshard.testing.synthetic import make_sharded

    root = Path(tempfile.mkdtemp(prefix="bench-resume-", dir=args.workdir))
    log = root / "logs"
    log.mkdir()
    try:
        shape = tensor_shape(args.tensor_mib)
        n = max(1, round(args.size_gib * GIB / (shape[0] * shape[1] * 4)))
        src = root / "src"
        t0 = time.perf_counter()
        make_sharded(src, world_size=args.world_size, n_tensors=n, shape=shape, seed=0, timeout=args.timeout)
        add_manifest(src, world_size=args.world_size)
        build_s = time.perf_counter() - t0
        src_bytes = sum(p.stat().st_size for p in src.iterdir() if p.is_file())
        print(f"built {n} tensors ({src_bytes / GIB:.2f} GiB) in {build_s:.1f} s", file=sys.stderr, flush=True)
        dst, ref = root / "dst", root / "reference"
        runs: dict = {}
        runs["uninterrupted"] = convert(py, src, dst, args.to, log, "uninterrupted", timeout=args.timeout,
                                        RESHARD_FAULT_COUNT=str(log / "uninterrupted.events"))
        assert runs["uninterrupted"]["exit_code"] == 0, runs["uninterrupted"]["stderr_tail"]
        total = items(log / "uninterrupted.events")
        written_full = output_bytes(dst)
        dst.rename(ref)
        kill_at = max(1, round(total * args.kill_at))
        result: dict = {"machine": machine(), "size_gib": src_bytes / GIB, "n_tensors": n, "items": total,
                        "kill_after_items": kill_at, "output_bytes": written_full, "build_s": round(build_s, 1),
                        "load_start": round(os.getloadavg()[0], 2), "commit": commit()}
        for how, extra in (("resume", ()), ("restart", ("--restart",))):
            k = convert(py, src, dst, args.to, log, f"killed-{how}", timeout=args.timeout,
                        RESHARD_FAULT_KILL_AT=str(kill_at))
            assert k["exit_code"] == -9, k["stderr_tail"]
            runs[f"killed-{how}"] = k
            r = convert(py, src, dst, args.to, log, how, *extra, timeout=args.timeout,
                        RESHARD_FAULT_COUNT=str(log / f"{how}.events"))
            assert r["exit_code"] == 0, r["stderr_tail"]
            rep = json.loads(r["stdout"])
            r["resume"] = rep.get("resume")
            r["items_written"] = items(log / f"{how}.events")
            r["differ"] = files_equal(dst, ref)
            r.pop("stdout")
            runs[how] = r
            shutil.rmtree(dst)
        result["runs"] = runs
        result["load_end"] = round(os.getloadavg()[0], 2)
        print(render(result))
        if args.json_out:
            args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def render(res: dict) -> str:
    R = res["runs"]
    u, a, b = R["uninterrupted"], R["resume"], R["restart"]
    kept = a["resume"] or {}
    gib = 1 << 30
    saved_s = b["wall_s"] - a["wall_s"]
    lines = [
        f"Source: {res['n_tensors']} float32 tensors, {res['size_gib']:.2f} GiB, {res['items']} target items "
        f"({res['output_bytes'] / gib:.2f} GiB of output); SIGKILL after item {res['kill_after_items']} "
        f"({100 * res['kill_after_items'] / res['items']:.0f} %). {res['machine'].get('nproc', '?')} CPUs, "
        f"{res['machine'].get('mem_total_gib', '?')} GiB, load average {res['load_start']} at the start and "
        f"{res['load_end']} at the end (the machine is shared); warm page cache; commit `{res['commit']}`.",
        "",
        "| run | wall s | CPU s | peak RSS MiB | items written | bytes not rewritten | byte-identical to uninterrupted |",
        "|---|---:|---:|---:|---:|---:|---|",
        f"| uninterrupted | {u['wall_s']:.2f} | {u['user_s'] + u['sys_s']:.2f} | {u['peak_rss_mib']:.0f} | {res['items']} "
        "| - | (reference) |",
    ]
    for name, r in (("killed at 50 %", R["killed-resume"]),):
        lines.append(f"| {name} (until the kill) | {r['wall_s']:.2f} | {r['user_s'] + r['sys_s']:.2f} | "
                     f"{r['peak_rss_mib']:.0f} | {res['kill_after_items']} | - | - |")
    for name, r in (("rerun, resumed (default)", a), ("rerun, --restart", b)):
        nr = (r["resume"] or {}).get("bytes_not_rewritten", 0)
        lines.append(f"| {name} | {r['wall_s']:.2f} | {r['user_s'] + r['sys_s']:.2f} | {r['peak_rss_mib']:.0f} | "
                     f"{r['items_written']} | {nr / gib:.2f} GiB | {'yes' if not r['differ'] else 'no: ' + ', '.join(r['differ'])} |")
    lines += ["", f"Resuming saved {saved_s:.2f} s of {b['wall_s']:.2f} s ({100 * saved_s / b['wall_s']:.0f} %) and "
                  f"{kept.get('bytes_not_rewritten', 0) / gib:.2f} GiB of writes against starting over "
                  f"({kept.get('items_kept', 0)} of {kept.get('items', 0)} items kept, each read back and compared "
                  "with the bytes the rerun writes from the source as it is now)."]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
