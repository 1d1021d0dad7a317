"""Benchmark: how much slower is ``reshard inspect`` on 10,000 entries than on 10?

Builds two real DCP checkpoints with :func:`reshard.testing.synthetic.make_many_entries` (a
single-process ``dcp.save``; by default 10 and 10,000 float32 tensors of 4 elements) in a
temporary directory, then times the CLI exactly as a user runs it::

    python -m reshard inspect CKPT --json

in a fresh subprocess (so interpreter start-up and imports are included), once untimed as
a warm-up and then ``--runs`` times (default 3) per checkpoint, and reports the median
wall time of each and their difference. The target is a difference under 1 s: inspecting
must scale with the metadata, not with a per-entry cost that dominates start-up.

Usage::

    .venv/bin/python scripts/bench_inspect.py                 # writes bench-results/
    .venv/bin/python scripts/bench_inspect.py --out /tmp/b --runs 5
    .venv/bin/python scripts/bench_inspect.py --large 50000 --check   # exit 1 if over target

Outputs (in ``--out``, default ``bench-results/``): ``bench_inspect.md`` (a Markdown
table, also printed) and ``bench_inspect.json`` (every run's wall time, exit code, the
medians, the difference, the target and the machine: nproc, platform, python, torch and
reshard versions).

If the ``inspect`` command is missing or fails (exit code other than 0 or 1, or output
that is not JSON), the script still writes both files with ``"ok": false`` and the tail of
the CLI's stderr for each size, and exits 2. Exit 0 otherwise (with ``--check``: 1 when
the difference misses the target).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_convert_memory import machine  # noqa: E402  (one description of the machine for every benchmark)

TARGET_DIFF_S = 1.0
OK_EXIT_CODES = (0, 1)  # 0 complete and consistent, 1 readable but inconsistent


def time_inspect(python: str, ckpt: Path, runs: int, warmup: int, timeout: float) -> dict:
    """Run ``python -m reshard inspect CKPT --json`` ``warmup + runs`` times; time the last ``runs``."""
    cmd = [python, "-m", "reshard", "inspect", str(ckpt), "--json"]
    times, codes, problems = [], [], []
    entries = None
    for i in range(warmup + runs):
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            problems.append(f"timed out after {timeout:.0f} s")
            break
        dt = time.perf_counter() - t0
        if p.returncode not in OK_EXIT_CODES:
            problems.append(f"exit code {p.returncode}: " + (p.stderr.strip()[-800:] or p.stdout.strip()[-800:]))
            break
        try:
            report = json.loads(p.stdout)
        except json.JSONDecodeError as e:
            problems.append(f"stdout is not JSON ({e}): {p.stdout[:200]!r}")
            break
        if entries is None and isinstance(report, dict):
            entries = _count_entries(report)
        if i >= warmup:
            times.append(dt)
            codes.append(p.returncode)
    ok = not problems and len(times) == runs
    return {
        "command": cmd,
        "ok": ok,
        "times_s": times,
        "median_s": statistics.median(times) if ok else None,
        "exit_codes": codes,
        "entries_reported": entries,
        "problems": problems,
    }


def _count_entries(report: dict):
    """Best effort: how many entries the JSON report says it saw (shape not fixed here)."""
    for key in ("n_entries", "entries", "keys", "items"):
        v = report.get(key)
        if isinstance(v, int):
            return v
        if isinstance(v, (list, dict)):
            return len(v)
    return None


def render_markdown(result: dict) -> str:
    m = result["machine"]
    lines = [
        "# reshard inspect: 10 vs 10,000 entries",
        "",
        f"`python -m reshard inspect CKPT --json`, fresh process each run, median of {result['runs']} "
        f"(after {result['warmup']} warm-up).",
        "",
        "| checkpoint | entries | size on disk | median wall (s) | runs (s) | exit |",
        "|---|---:|---:|---:|---|---|",
    ]
    for c in result["cases"]:
        t = c["timing"]
        med = f"{t['median_s']:.3f}" if t["median_s"] is not None else "failed"
        runs = ", ".join(f"{x:.3f}" for x in t["times_s"]) or "-"
        codes = ",".join(str(x) for x in sorted(set(t["exit_codes"]))) or "-"
        lines.append(f"| {c['name']} | {c['entries']:,} | {c['bytes'] / 1024:.0f} KiB | {med} | {runs} | {codes} |")
    diff = result["difference_s"]
    if diff is None:
        verdict = "n/a (inspect did not run; see problems below)"
    else:
        verdict = f"**{diff:.3f} s** ({'meets' if result['meets_target'] else 'MISSES'} the < {result['target_s']:.1f} s target)"
    lines += [
        "",
        f"Difference (large - small): {verdict}",
        "",
        f"Machine: {m['nproc']} CPUs, {m['platform']}, Python {m['python']}, torch {m['torch']}, "
        f"reshard {m['reshard']}" + (f", load average {m['loadavg'][0]:.2f}" if m.get("loadavg") else "") + ".",
        "Checkpoint build (make_many_entries): "
        + ", ".join(f"{c['name']} {c['build_s']:.2f} s" for c in result["cases"]) + ".",
    ]
    problems = [(c["name"], p) for c in result["cases"] for p in c["timing"]["problems"]]
    if problems:
        lines += ["", "Problems:", ""] + [f"- {name}: `{p.splitlines()[-1] if p else p}`" for name, p in problems]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-results", help="directory for bench_inspect.{md,json} (default: bench-results/)")
    ap.add_argument("--small", type=int, default=10, help="entries in the small checkpoint (default 10)")
    ap.add_argument("--large", type=int, default=10_000, help="entries in the large checkpoint (default 10000)")
    ap.add_argument("--numel", type=int, default=4, help="elements per entry (default 4)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per checkpoint; the median is reported (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per CLI run before giving up")
    ap.add_argument("--python", default=sys.executable, help="interpreter that runs the CLI (default: this one)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints (printed path) instead of deleting them")
    ap.add_argument("--check", action="store_true", help=f"exit 1 when the difference is not under {TARGET_DIFF_S} s")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be >= 1")

    from reshard.testing.synthetic import make_many_entries

    tmp = tempfile.mkdtemp(prefix="bench-inspect-")
    cases = []
    try:
        for name, n in (("small", args.small), ("large", args.large)):
            ckpt = Path(tmp) / f"entries_{n}"
            t0 = time.perf_counter()
            make_many_entries(ckpt, n, numel=args.numel)
            build = time.perf_counter() - t0
            size = sum(p.stat().st_size for p in ckpt.iterdir() if p.is_file())
            print(f"built {n:,} entries in {build:.2f} s ({size / 1024:.0f} KiB); timing inspect ...", file=sys.stderr, flush=True)
            timing = time_inspect(args.python, ckpt, args.runs, args.warmup, args.timeout)
            cases.append({"name": name, "entries": n, "numel": args.numel, "bytes": size, "build_s": build,
                          "path": str(ckpt) if args.keep else None, "timing": timing})
    finally:
        if args.keep:
            print(f"checkpoints kept in {tmp}", file=sys.stderr)
        else:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)

    small, large = cases[0]["timing"], cases[1]["timing"]
    ok = small["ok"] and large["ok"]
    diff = large["median_s"] - small["median_s"] if ok else None
    result = {
        "benchmark": "inspect_entries",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "runs": args.runs,
        "warmup": args.warmup,
        "target_s": TARGET_DIFF_S,
        "ok": ok,
        "difference_s": diff,
        "meets_target": (diff < TARGET_DIFF_S) if diff is not None else None,
        "machine": machine(),
        "cases": cases,
    }
    md = render_markdown(result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_inspect.md").write_text(md)
    (out / "bench_inspect.json").write_text(json.dumps(result, indent=2) + "\n")
    print(md)
    print(f"wrote {out / 'bench_inspect.md'} and {out / 'bench_inspect.json'}", file=sys.stderr)
    if not ok:
        return 2
    if args.check and not result["meets_target"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
