"""Benchmark: is the preflight's time estimate honest? Its range against the conversion's actual time.

``reshard convert`` prints its estimate before the first byte (``checking space: ...; 6-14 s to
convert``): the time from that line to the end of the command, as a range (``low_s``, ``high_s``
in the report's ``estimate``). This script converts real ``dcp.save`` checkpoints and compares
the range with what the conversion then took, in the same run:

* ``ref-1mb``: the reference trainer's 4-rank FSDP2 checkpoint with Adam moments (about 1 MB in
  a few hundred small items: the per-item work and the start-up are all of its time);
* ``1mib``, ``1gib``, ``4gib``: `reshard.testing.synthetic.make_sharded` on 4 gloo ranks, float32
  tensors ``Shard(0)`` (16 of 256x64; 64 and 256 of 1024x4096, 16 MiB each);
* ``1gib-tp`` (``--no-tp`` skips it): the 1 GiB checkpoint to ``dp=2,tp=2`` under a rules file
  that shards every tensor along dim 1, so every target chunk gathers column blocks source by
  source (`reshard.engine.bands`).

Each conversion is its own process (``python -m reshard convert SRC DST --to SPEC --json
--progress json``), run as the user runs it; its stderr lines are timestamped as they arrive. The
**actual** is the time from the ``checking space`` line (the estimate, printed before the copy)
to the process's exit, which is what the estimate predicts (its parts: the bytes at the probed
rate, the per-item work, the torch import, the end). The process's whole wall time and its CPU
seconds (user + sys, ``os.wait4``) are recorded beside it. Rounds are interleaved (every case
once per round, in the same order), so a busy spell of this shared machine falls on all cases;
``os.getloadavg()`` is recorded before each conversion. The page cache is not dropped (other
engineers share the machine); the copy's reads and writes use direct I/O anyway.

Per run: inside the range (``low <= actual <= high``), within 2x (``low/2 <= actual <= 2 * high``,
the target), and the ratios actual/low and actual/high. ``--base DIR`` (a tree of an earlier
revision, e.g. ``git worktree add /tmp/base main``) also converts each case once per round with
that revision, whose single ``seconds`` (the old estimate) is compared with the same actual.

Usage::

    .venv/bin/python scripts/bench_estimate.py --work /tmp/est --rounds 3          # writes bench-results/
    .venv/bin/python scripts/bench_estimate.py --work /tmp/est --cases ref-1mb,1gib --rounds 1
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GIB = 1 << 30
SHAPES = {"1mib": (16, (256, 64)), "1gib": (64, (1024, 4096)), "4gib": (256, (1024, 4096))}
RULES_TOML = """\
# Written by scripts/bench_estimate.py: partition rules for make_sharded's synthetic tensors.
family = "bench-synthetic"
description = "make_sharded's model.layers.{i}.weight, every one sharded along dim 1 under TP"

[[param]]
match = '^(model\\.)?layers\\.\\d+\\.weight$'
tp = "shard"
dim = 1
"""


def build(work: Path, name: str) -> Path:
    """The source of case ``name`` under ``work`` (kept: a second run reuses it)."""
    base = "1gib" if name == "1gib-tp" else name
    src = work / f"src-{base}"
    if (src / ".metadata").exists():
        return src
    t = time.perf_counter()
    if base == "ref-1mb":
        from reshard.reference import TrainConfig, run_reference

        out = work / "ref-run"
        cfg = TrainConfig(dp=4, tp=1, steps=3, save_at=[3], out=str(out), log=str(out / "steps.jsonl"),
                          experiment_id="bench-estimate")
        shutil.copytree(run_reference(cfg)[-1], src)
    else:
        from reshard.testing.synthetic import make_sharded

        n, shape = SHAPES[base]
        make_sharded(src, world_size=4, n_tensors=n, shape=shape, seed=0, timeout=1800)
    print(f"built {src} in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    return src


def convert(python: str, tree: Path, src: Path, dst: Path, to: str, extra: list[str]) -> dict:
    """One conversion in its own process; the estimate and the times around it."""
    shutil.rmtree(dst, ignore_errors=True)
    env = dict(os.environ, PYTHONPATH=str(tree))
    env.pop("SOURCE_DATE_EPOCH", None)  # the report then holds the estimate
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    p = subprocess.Popen([python, "-m", "reshard", "convert", str(src), str(dst), "--to", to, "--json",
                          "--progress", "json", *extra], cwd=str(tree), env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(p.stdout.read()), daemon=True)
    reader.start()
    t_est = None
    tail: list[str] = []
    marks: dict[str, float] = {}  # when the copy started, moved its first byte, ended; when the commit ended
    for line in p.stderr:
        now = time.perf_counter() - t0
        tail = (tail + [line])[-20:]
        if t_est is None and '"checking space: ' in line:
            t_est = now
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("phase") == "copy" and e.get("event") == "start":
            marks.setdefault("copy_start", now)
        if e.get("phase") == "copy" and e.get("bytes_done") and "first_byte" not in marks:
            marks["first_byte"] = now
        if e.get("event") == "end" and e.get("phase") in ("copy", "commit"):
            marks[f"{e['phase']}_end"] = now
    _pid, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    reader.join()
    p.returncode = os.waitstatus_to_exitcode(status)
    row = {"load": round(load, 2), "wall_s": round(wall, 3), "cpu_s": round(ru.ru_utime + ru.ru_stime, 3),
           "exit": p.returncode}
    if p.returncode != 0:
        row["error"] = "".join(tail)[-2000:]
        return row
    report = json.loads(out[0])
    est = report.get("estimate") or {}
    row.update(actual_s=round(wall - t_est, 3) if t_est is not None else None, report_s=report.get("seconds"),
               low_s=est.get("low_s"), high_s=est.get("high_s"), seconds=est.get("seconds"), bound=est.get("bound"),
               parts=est.get("parts"), probe=est.get("probe"), estimate_load=est.get("load"),
               bytes_written=report.get("bytes_written"), cpu_slowdown=est.get("cpu_slowdown"),
               marks={k: round(v - (t_est or 0.0), 3) for k, v in marks.items()})
    shutil.rmtree(dst, ignore_errors=True)
    return row


def judge(row: dict) -> dict:
    """Inside the range, within 2x of it, and the ratios to its bounds (the old estimate: one figure)."""
    a = row.get("actual_s")
    lo = row.get("low_s") if row.get("low_s") is not None else row.get("seconds")
    hi = row.get("high_s") if row.get("high_s") is not None else row.get("seconds")
    if a is None or lo is None or hi is None:
        return {}
    return {"inside": lo <= a <= hi, "within_2x": lo / 2 <= a <= 2 * hi,
            "actual_over_low": round(a / max(lo, 1e-3), 2), "actual_over_high": round(a / max(hi, 1e-3), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="folder for the checkpoints (kept) and outputs")
    ap.add_argument("--cases", default="ref-1mb,1mib,1gib,4gib,1gib-tp")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--base", type=Path, default=None, help="a tree of an earlier revision, converted beside")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--out", type=Path, default=ROOT / "bench-results" / "estimate.json")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    cases = [c for c in args.cases.split(",") if c]
    rules = args.work / "rules-tp.toml"
    rules.write_text(RULES_TOML)
    sources = {c: build(args.work, c) for c in cases}
    runs: dict[str, list[dict]] = {c: [] for c in cases}
    base_runs: dict[str, list[dict]] = {c: [] for c in cases}
    for r in range(args.rounds):
        for c in cases:
            to, extra = ("dp=2,tp=2", ["--rules", str(rules)]) if c.endswith("-tp") else ("dp=2", [])
            trees = [(ROOT, runs)] + ([(args.base, base_runs)] if args.base else [])
            for tree, into in (trees if r % 2 == 0 else trees[::-1]):  # A,B then B,A
                row = convert(args.python, tree, sources[c], args.work / f"dst-{c}", to, extra)
                row.update(judge(row), round=r)
                into[c].append(row)
                print(f"[round {r}] {c} {'base' if tree != ROOT else 'this'}: " + json.dumps(
                    {k: row.get(k) for k in ("load", "actual_s", "low_s", "high_s", "seconds", "bound", "inside",
                                             "within_2x", "wall_s", "cpu_s", "exit")}), file=sys.stderr, flush=True)
    result = {"cases": cases, "rounds": args.rounds, "runs": runs, "base_runs": base_runs if args.base else None,
              "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}, "when": time.strftime(
                  "%Y-%m-%d %H:%M UTC", time.gmtime())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(render(result))


def _med(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def render(result: dict) -> str:
    """The Markdown table of docs/benchmarks.md: per case, every run's range and actual, and the medians."""
    out = ["| checkpoint | run | load | estimate (s) | bound | actual (s) | actual / low, / high | inside | within 2x "
           "| process wall / CPU (s) |", "|---|---:|---:|---:|---|---:|---:|---|---|---:|"]
    for c in result["cases"]:
        for row in result["runs"][c]:
            if row.get("exit") != 0:
                out.append(f"| {c} | {row['round']} | {row['load']} | failed: exit {row['exit']} | | | | | | |")
                continue
            out.append(f"| {c} | {row['round']} | {row['load']:.1f} | {row['low_s']:.1f}-{row['high_s']:.1f} | "
                       f"{row['bound'] or 'not probed'} | {row['actual_s']:.1f} | {row['actual_over_low']:.2f} / "
                       f"{row['actual_over_high']:.2f} | {'yes' if row['inside'] else 'no'} | "
                       f"{'yes' if row['within_2x'] else 'NO'} | {row['wall_s']:.1f} / {row['cpu_s']:.1f} |")
    if result.get("base_runs"):
        out += ["", "| checkpoint | run | load | old estimate (s) | actual (s) | actual / estimate | within 2x |",
                "|---|---:|---:|---:|---:|---:|---|"]
        for c in result["cases"]:
            for row in result["base_runs"][c]:
                if row.get("exit") != 0 or row.get("seconds") is None:
                    continue
                out.append(f"| {c} | {row['round']} | {row['load']:.1f} | {row['seconds']:.2f} | {row['actual_s']:.1f} | "
                           f"{row['actual_over_high']:.2f} | {'yes' if row['within_2x'] else 'NO'} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
