"""Benchmark: how fast are ``reshard convert``, ``reshard verify`` and ``reshard inspect`` compared with ``cp -r``?

Resharding is I/O: the floor is copying the checkpoint. Speed is measured as a MARGINAL
cost: for checkpoints of two sizes (``--sizes``, GiB, default ``1,4``) built with a real
multi-rank ``dcp.save`` (:func:`reshard.testing.synthetic.make_sharded`, gloo, ``--world-size``
ranks, default 4) from the same tensors (``--tensor-mib`` MiB float32, default 16,
``Shard(0)``; more of them for the larger size), each command's

    marginal cost = (time(large) - time(small)) / (GiB(large) - GiB(small))   [s/GiB]

so interpreter and torch start-up cancel. Each source gets a minimal ``manifest.json``
(``add_manifest`` of ``scripts/bench_convert_memory.py``, whose helpers this script
imports). Per size, each command in a fresh subprocess (wall time, CPU time and peak RSS
from ``os.wait4``), every conversion with ``SOURCE_DATE_EPOCH=0`` in its environment (so
its output is reproducible byte for byte)::

    cp -r SRC COPY                                   # the floor
    cp -r SRC COPY && sync                           # the floor with the data on disk
    python -m reshard convert SRC DST --to dp=2 --json
    python -m reshard verify SRC DST --json
    python -m reshard convert SRC DST_L --to dp=2 --data link --json                  # shares the tensor files
    python -m reshard convert SRC DST_W --to dp=2 --workers 2 --json                  # distributed
    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m reshard convert SRC DST_T --to dp=2 --json                                   # distributed
    python -m reshard convert SRC DST_TP --to dp=2,tp=2 --rules RULES --json         # a TP change
    python -c 'dcp_to_torch_save(SRC, F); torch_save_to_dcp(F, DST2)'   # the stock offline path

The synthetic tensors ``model.layers.{i}.weight`` belong to no known model family, so the
TP conversion is given a rules file written into the temporary directory: one rule,
``tp = "shard"`` along ``--tp-dim`` (default 1, i.e. every target chunk gathers a column
block from every row-sharded source chunk). Before timing it, ``reshard plan SRC --to
TP --rules RULES`` is run once; if it refuses, the TP row says "not measured: <reason>".

``--data link`` (issue 18) shares the source's data files with the output (reflink, else
hard link; DST beside the source) and writes only ``.metadata``, the rewritten keys and the
manifest, so its time should not grow with the checkpoint: its row sits next to copy mode's,
with the bytes each wrote (``--no-link`` skips it).

The distributed outputs (``--workers N`` and torchrun with ``--nproc-per-node N``,
``--dist-workers``, default 2) are compared byte for byte with the single-process output of
the same size, every file except ``reshard-report.json``/``reshard-report.md`` (their
timings differ): "byte-identical: yes/no (files that differ)". Speedup = wall(single) /
wall(distributed) per size, and marginal(single) / marginal(distributed). A command that
fails (e.g. a flag not implemented yet) is recorded with its exit code and stderr (its
``error:`` line, or the tail) under Problems, and the run goes on.

Targets (issue 6), printed as PASS/FAIL with the numbers:

* convert ``--to dp=2``'s marginal cost <= 1.5x ``cp -r``'s, and >= 10x below the stock
  path's;
* convert's peak RSS at the large size minus at the small size < 64 MiB, while the stock
  path's grows (by more than those 64 MiB);
* verify's marginal cost <= 1.5x ``cp -r``'s;
* ``reshard inspect --json`` of a 10,000-entry checkpoint < 1 s more than of a 10-entry
  one (``scripts/bench_inspect.py``'s approach, by import; median of 3, warm cache);
* torchrun's output byte-identical to the single-process one (its speedup is reported).

Table columns: wall time at each size, GB/s at the large size (source bytes on disk /
wall, 1 GB = 1e9 bytes), peak RSS at each size, marginal s/GiB, marginal CPU s/GiB (user +
sys, including waited-for child processes: the workers of ``--workers`` and torchrun), and
the marginal cost as a multiple of ``cp -r``'s. Peak RSS is ``ru_maxrss``: for a command
with child processes it is the largest single process of the tree, not their sum.

Before every timed command the page cache is dropped (``sync; echo 3 >
/proc/sys/vm/drop_caches``) when this process may (root, writable /proc/sys); otherwise
the table says "warm cache". ``cp -r`` does not fsync, and a small copy ends with its
bytes still in the page cache; reshard convert makes every byte durable before its atomic
commit, so ``cp -r && sync`` is given as a second reference.

Runs (``--runs``, default 3) are taken in rounds: each round runs every command once, in the
same order, so a slow spell of the machine falls on all commands alike. The table uses each
command's best run (the least disturbed); the medians and every run's wall time are in the
JSON, and the three speed targets are judged on the medians too (one line, reported apart).

Usage::

    .venv/bin/python scripts/bench_speed.py                        # writes bench-results/
    .venv/bin/python scripts/bench_speed.py --sizes 0.125,0.25 --runs 1 --no-stock
    .venv/bin/python scripts/bench_speed.py --no-tp --no-distributed --check

Outputs (in ``--out``): ``bench_speed.md`` (also printed) and ``bench_speed.json`` (every
run, the summary, the comparisons, the machine). A marginal cost <= 0 (run-to-run noise
larger than the size difference, e.g. on a loaded machine or with tiny ``--sizes``) leaves
the targets it enters "not judged". Exit 2 if a command failed, 0 otherwise (with
``--check``: 1 when a target is missed or not judged).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_convert_memory import (  # scripts/ is not a package: found through sys.path above
    GIB,
    MIB,
    add_manifest,
    checkpoint_facts,
    machine,
    measure,
    tensor_shape,
)

ELEMENT_SIZE = 4
CONVERT_TARGET = 1.5   # x cp -r marginal cost
VERIFY_TARGET = 1.5
STOCK_FACTOR = 10.0    # convert must be this many times cheaper than the stock path
RSS_TARGET_MIB = 64.0  # convert peak RSS, large minus small
INSPECT_TARGET_S = 1.0
REPORT_FILES = {"reshard-report.json", "reshard-report.md"}  # their "seconds" differ between runs
EPOCH = "0"  # SOURCE_DATE_EPOCH of every conversion

STOCK_SCRIPT = """
import sys, warnings
warnings.simplefilter("ignore")
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
src, tmpfile, dst = sys.argv[1:4]
dcp_to_torch_save(src, tmpfile)
torch_save_to_dcp(tmpfile, dst)
"""

RULES_TOML = """\
# Written by scripts/bench_speed.py: partition rules for make_sharded's synthetic tensors.
family = "bench-synthetic"
description = "make_sharded's model.layers.{{i}}.weight, every one sharded along dim {dim} under TP"

[[param]]
match = '^(model\\.)?layers\\.\\d+\\.weight$'
tp = "shard"
dim = {dim}
"""


# ------------------------------------------------------------------------- running
def can_drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def drop_caches(enabled: bool) -> None:
    if enabled:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")


def _error_line(log_dir: Path, name: str, r: dict) -> str:
    """The CLI's ``error:`` line from the full stderr (torchrun buries it under its own traceback), else the last
    exception line, else the tail (box-drawing of typer's usage errors stripped)."""
    try:
        err = (log_dir / f"{name}.stderr").read_text(errors="replace")
    except OSError:
        err = r.get("stderr_tail", "")
    lines = [x.strip(" \t\u2502\u256d\u256e\u2570\u256f\u2500") for x in err.splitlines()]
    lines = [x for x in lines if x]
    hit = next((x for x in lines if x.startswith("error:")), None) or next(
        (x for x in reversed(lines) if re.match(r"^[A-Za-z_][\w.]*(Error|Exception): \S", x)), None)
    if hit:
        return hit[:600]
    return " | ".join(lines[-4:])[-600:] or (r.get("stdout") or "")[-300:]


def _run(name: str, cmd: list[str], args, log_dir: Path, cold: bool, problems: list[str]) -> dict:
    drop_caches(cold)
    r = measure(cmd, timeout=args.timeout, sample_ms=args.sample_ms, log_dir=log_dir, name=name)
    r.pop("samples", None)
    if r["exit_code"] != 0:
        r["error"] = _error_line(log_dir, name, r)
        problems.append(f"{name}: exit code {r['exit_code']}{' (timed out)' if r['timed_out'] else ''}: {r['error']}")
    print(f"  {name}: {r['wall_s']:.2f} s, peak RSS {r['peak_rss_mib']:,.0f} MiB (exit {r['exit_code']})",
          file=sys.stderr, flush=True)
    return r


def _clear(dst: Path) -> None:
    """Remove ``dst`` and whatever a failed run left beside it (``.NAME*`` temporaries and locks)."""
    shutil.rmtree(dst, ignore_errors=True)
    for p in dst.parent.glob(f".{dst.name}*"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _parse_report(r: dict, name: str, problems: list[str]) -> None:
    """Keep the interesting fields of convert's JSON report (the first JSON value on stdout)."""
    out = r.pop("stdout", None) or ""
    if r["exit_code"] != 0:
        return
    try:
        rep, _ = json.JSONDecoder().raw_decode(out.lstrip())
    except json.JSONDecodeError as e:
        problems.append(f"{name}: stdout is not JSON ({e})")
        return
    if isinstance(rep, dict):
        r["bytes_written"] = rep.get("bytes_written")
        r["verified_equal"] = (rep.get("verification") or {}).get("equal")
        r["reported_seconds"] = rep.get("seconds")


def _same_file(a: Path, b: Path, block: int = 16 * MIB) -> bool:
    if a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(block), fb.read(block)
            if x != y:
                return False
            if not x:
                return True


def compare_dirs(single: Path, other: Path) -> dict:
    """Byte-for-byte comparison of two conversion outputs, except the two report files."""
    def files(d: Path) -> set[str]:
        return {p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()} - REPORT_FILES

    fa, fb = files(single), files(other)
    common = sorted(fa & fb)
    differ = [f for f in common if not _same_file(single / f, other / f)]
    only_a, only_b = sorted(fa - fb), sorted(fb - fa)
    return {"identical": not (differ or only_a or only_b), "files_compared": len(common), "differ": differ,
            "only_in_single": only_a, "only_in_other": only_b}


def _describe_compare(c: dict | None) -> str:
    if c is None:
        return "not compared"
    if c.get("not_compared"):
        return f"not compared ({c['not_compared']})"
    if c["identical"]:
        return f"yes ({c['files_compared']} files)"
    bits = []
    if c["differ"]:
        bits.append("differ: " + ", ".join(c["differ"][:8]) + (" ..." if len(c["differ"]) > 8 else ""))
    if c["only_in_single"]:
        bits.append("only in single-process output: " + ", ".join(c["only_in_single"][:8]))
    if c["only_in_other"]:
        bits.append("only in distributed output: " + ", ".join(c["only_in_other"][:8]))
    return "no (" + "; ".join(bits) + ")"


def tp_preflight(args, src: Path, rules: Path) -> str | None:
    """None when ``reshard plan SRC --to TP --rules RULES`` accepts the TP target; else why not."""
    cmd = [args.python, "-m", "reshard", "plan", str(src), "--to", args.tp_to, "--rules", str(rules)]
    try:
        p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return f"`reshard plan --to {args.tp_to}` timed out"
    if p.returncode == 0:
        return None
    lines = [x.strip() for x in (p.stderr + "\n" + p.stdout).splitlines() if x.strip()]
    why = next((x for x in lines if x.startswith("error:")), " | ".join(lines[-3:]))
    return f"`reshard plan --to {args.tp_to} --rules FILE` exits {p.returncode}: {why[:400]}"


# ------------------------------------------------------------------------- one size
def run_case(args, size_gib: float, shape, tmp: Path, log_dir: Path, cold: bool, state: dict) -> dict:
    from reshard.testing.synthetic import make_sharded

    tensor_bytes = shape[0] * shape[1] * ELEMENT_SIZE
    n = max(1, round(size_gib * GIB / tensor_bytes))
    tag = f"{size_gib:g}gib"
    src = tmp / f"src-{tag}"
    case: dict = {"size_gib": size_gib, "n_tensors": n, "problems": [], "runs": {}, "compare": {}}
    t0 = time.perf_counter()
    make_sharded(src, world_size=args.world_size, n_tensors=n, shape=shape, seed=0, timeout=args.timeout)
    case["build_s"] = round(time.perf_counter() - t0, 2)
    add_manifest(src, world_size=args.world_size)
    case["facts"] = checkpoint_facts(src)
    case["gib_on_disk"] = case["facts"]["bytes_on_disk"] / GIB
    print(f"[{tag}] built {n} tensors ({case['gib_on_disk']:.3f} GiB) in {case['build_s']:.1f} s", file=sys.stderr,
          flush=True)
    py, R, P, C = args.python, case["runs"], case["problems"], case["compare"]

    cp = shutil.which("cp") or "cp"
    dst = tmp / f"dst-{tag}"
    nw = str(args.dist_workers)
    dists = [] if args.no_distributed else [
        ("convert_workers", [py, "-m", "reshard", "convert", str(src), "{dst}", "--to", args.to, "--workers", nw, "--json"]),
        ("convert_torchrun", [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", nw,
                              "-m", "reshard", "convert", str(src), "{dst}", "--to", args.to, "--json"]),
    ]
    if not args.no_tp and "tp_checked" not in state:
        state["tp_checked"] = True
        state["tp_not_measured"] = tp_preflight(args, src, state["rules"])
        if state["tp_not_measured"]:
            print(f"  convert_tp: not measured: {state['tp_not_measured']}", file=sys.stderr, flush=True)
    do_tp = not args.no_tp and state.get("tp_not_measured") is None

    def convert(key: str, out: Path, cmd: list[str], i: int) -> dict:
        _clear(out)
        name = f"{key}-{tag}-{i}"
        r = _run(name, cmd, args, log_dir, cold, P)
        _parse_report(r, name, P)
        if r["exit_code"] == 0 and r.get("verified_equal") is False:
            P.append(f"{name}: convert reports verification.equal = false")
        R.setdefault(key, []).append(r)
        return r

    # Rounds: every command once per round, in the same order, so a slow spell of this
    # machine (they last minutes here) lands on all of them instead of on one command's runs.
    for i in range(args.runs):
        d = tmp / f"cp-{tag}"
        _clear(d)
        R.setdefault("cp", []).append(_run(f"cp-{tag}-{i}", [cp, "-r", str(src), str(d)], args, log_dir, cold, P))
        _clear(d)
        R.setdefault("cp_sync", []).append(
            _run(f"cpsync-{tag}-{i}", ["sh", "-c", 'cp -r "$0" "$1" && sync', str(src), str(d)], args, log_dir, cold, P))
        _clear(d)
        # single process: its output is verified, then kept as the reference of the distributed runs
        convert("convert", dst, [py, "-m", "reshard", "convert", str(src), str(dst), "--to", args.to, "--json"], i)
        single_ok = dst.exists() and R["convert"][-1]["exit_code"] == 0
        if dst.exists():
            r = _run(f"verify-{tag}-{i}", [py, "-m", "reshard", "verify", str(src), str(dst), "--json"],
                     args, log_dir, cold, P)
            r.pop("stdout", None)
            R.setdefault("verify", []).append(r)
        if not args.no_link:
            ldst = tmp / f"dst-link-{tag}"
            convert("convert_link", ldst, [py, "-m", "reshard", "convert", str(src), str(ldst), "--to", args.to,
                                           "--data", "link", "--json"], i)
            _clear(ldst)
        for key, tmpl in dists:
            ddst = tmp / f"{key}-{tag}"
            r = convert(key, ddst, [str(ddst) if x == "{dst}" else x for x in tmpl], i)
            if r["exit_code"] != 0 or not ddst.exists():
                C[key] = {"not_compared": f"{key.split('_')[1]} run failed"}
            elif not single_ok:
                C[key] = {"not_compared": "the single-process run failed"}
            elif C.get(key, {}).get("identical", True) is not False:  # one differing round is enough
                C[key] = compare_dirs(dst, ddst)
            print(f"  {key} output byte-identical to single-process: {_describe_compare(C[key])}",
                  file=sys.stderr, flush=True)
            _clear(ddst)
        if do_tp:
            tdst = tmp / f"dst-tp-{tag}"
            convert("convert_tp", tdst, [py, "-m", "reshard", "convert", str(src), str(tdst), "--to", args.tp_to,
                                         "--rules", str(state["rules"]), "--json"], i)
            _clear(tdst)
    _clear(dst)

    if not args.no_stock:
        sfile, sdst = tmp / f"stock-{tag}.pt", tmp / f"stock-{tag}"
        for i in range(args.stock_runs):
            sfile.unlink(missing_ok=True)
            shutil.rmtree(sdst, ignore_errors=True)
            r = _run(f"stock-{tag}-{i}", [py, "-c", STOCK_SCRIPT, str(src), str(sfile), str(sdst)], args, log_dir, cold, P)
            r.pop("stdout", None)
            R.setdefault("stock", []).append(r)
        sfile.unlink(missing_ok=True)
        shutil.rmtree(sdst, ignore_errors=True)
    for rs in R.values():
        for r in rs:
            r.pop("stdout", None)
    if not args.keep:
        shutil.rmtree(src, ignore_errors=True)
    return case


# ------------------------------------------------------------------------- summary
def commands(result: dict) -> list[tuple[str, str]]:
    to, tp, w = result["to"], result["tp_to"], result["dist_workers"]
    return [
        ("cp", "`cp -r`"),
        ("cp_sync", "`cp -r && sync`"),
        ("convert", f"`reshard convert --to {to}`"),
        ("convert_link", f"`reshard convert --to {to} --data link`"),
        ("convert_workers", f"`reshard convert --to {to} --workers {w}`"),
        ("convert_torchrun", f"`torchrun --nproc-per-node {w} -m reshard convert --to {to}`"),
        ("convert_tp", f"`reshard convert --to {tp} --rules` (TP shard dim {result['tp_dim']})"),
        ("verify", "`reshard verify SRC DST`"),
        ("stock", "stock `dcp_to_torch_save` + `torch_save_to_dcp`"),
    ]


def best(case: dict, cmd: str) -> dict | None:
    runs = [r for r in case["runs"].get(cmd, []) if r["exit_code"] == 0]
    if not runs or len(runs) != len(case["runs"].get(cmd, [])):
        return None
    return min(runs, key=lambda r: r["wall_s"])  # the least disturbed run


def _status(case: dict, cmd: str) -> str:
    runs = case["runs"].get(cmd)
    if not runs:
        return "not run"
    bad = [r for r in runs if r["exit_code"] != 0]
    return f"failed (exit {bad[0]['exit_code']})" if bad else "ok"


def summarise(cases: list[dict], result: dict) -> dict:
    small, large = cases[0], cases[-1]
    dgib = large["gib_on_disk"] - small["gib_on_disk"]
    out: dict = {}
    for cmd, _ in commands(result):
        a, b = best(small, cmd), best(large, cmd)
        if not small["runs"].get(cmd) and not large["runs"].get(cmd):
            continue
        v: dict = {"small_status": _status(small, cmd), "large_status": _status(large, cmd),
                   "small_wall_s": a and a["wall_s"], "large_wall_s": b and b["wall_s"],
                   "small_rss_mib": a and a["peak_rss_mib"], "large_rss_mib": b and b["peak_rss_mib"],
                   "large_gb_per_s": (large["facts"]["bytes_on_disk"] / 1e9 / b["wall_s"]) if b else None}
        if a and b:
            v["rss_diff_mib"] = b["peak_rss_mib"] - a["peak_rss_mib"]
            v["marginal_s_per_gib"] = (b["wall_s"] - a["wall_s"]) / dgib
            v["small_walls_s"] = [r["wall_s"] for r in small["runs"][cmd]]
            v["large_walls_s"] = [r["wall_s"] for r in large["runs"][cmd]]
            v["median_marginal_s_per_gib"] = (statistics.median(v["large_walls_s"])
                                              - statistics.median(v["small_walls_s"])) / dgib
            v["marginal_cpu_s_per_gib"] = ((b["user_s"] + b["sys_s"]) - (a["user_s"] + a["sys_s"])) / dgib
        out[cmd] = v
    cpm = (out.get("cp") or {}).get("marginal_s_per_gib")
    cpmed = (out.get("cp") or {}).get("median_marginal_s_per_gib")
    for v in out.values():
        if v.get("marginal_s_per_gib") is not None and cpm and cpm > 0:
            v["ratio_to_cp"] = v["marginal_s_per_gib"] / cpm
        if v.get("median_marginal_s_per_gib") is not None and cpmed and cpmed > 0:
            v["median_ratio_to_cp"] = v["median_marginal_s_per_gib"] / cpmed

    def m(cmd, field="marginal_s_per_gib"):
        return (out.get(cmd) or {}).get(field)

    # a marginal cost <= 0 means run-to-run noise exceeded the size difference: no ratio involving it is judged
    targets, extra, unjudged = {}, {}, {}

    def judge(name: str, needs: tuple[str, ...], ok) -> None:
        vals = [m(c) for c in needs]
        if any(v is None for v in vals):
            return  # a run failed (listed under Problems) or the command was skipped
        bad = [c for c, v in zip(needs, vals) if v <= 0]
        if bad:
            unjudged[name] = "non-positive marginal cost of " + ", ".join(bad) + " (noise larger than the size difference)"
            return
        targets[name] = ok()

    judge("convert_le_1.5x_cp", ("cp", "convert"), lambda: out["convert"]["ratio_to_cp"] <= CONVERT_TARGET)
    if m("convert") is not None and m("stock") is not None and m("convert") > 0:
        extra["stock_over_convert"] = m("stock") / m("convert")
    judge("convert_10x_below_stock", ("convert", "stock"), lambda: extra["stock_over_convert"] >= STOCK_FACTOR)
    if m("convert", "rss_diff_mib") is not None:
        targets["convert_rss_flat"] = m("convert", "rss_diff_mib") < RSS_TARGET_MIB
    if m("stock", "rss_diff_mib") is not None:
        targets["stock_rss_grows"] = m("stock", "rss_diff_mib") > RSS_TARGET_MIB
    judge("verify_le_1.5x_cp", ("cp", "verify"), lambda: out["verify"]["ratio_to_cp"] <= VERIFY_TARGET)

    # the same three speed targets on the medians of the runs (the best run is the least
    # disturbed one; the median says whether that was luck): reported, judged separately
    med = {}
    mm = lambda c: m(c, "median_marginal_s_per_gib")  # noqa: E731
    if mm("cp") and mm("convert") and mm("cp") > 0 and mm("convert") > 0:
        med["convert_le_1.5x_cp"] = mm("convert") / mm("cp") <= CONVERT_TARGET
        if mm("stock"):
            med["convert_10x_below_stock"] = mm("stock") / mm("convert") >= STOCK_FACTOR
    if mm("cp") and mm("verify") and mm("cp") > 0 and mm("verify") > 0:
        med["verify_le_1.5x_cp"] = mm("verify") / mm("cp") <= VERIFY_TARGET
    extra["median_targets"] = med

    dist: dict = {}
    for key in ("convert_workers", "convert_torchrun"):
        if key not in out:
            continue
        d: dict = {"compare": {f"{c['size_gib']:g}": c["compare"].get(key) for c in cases}}
        for which, c in (("small", small), ("large", large)):
            s1, s2 = out["convert"].get(f"{which}_wall_s") if "convert" in out else None, out[key][f"{which}_wall_s"]
            d[f"{which}_speedup"] = (s1 / s2) if s1 and s2 else None
        d["marginal_speedup"] = (m("convert") / m(key)) if m("convert") and m(key) else None
        cmps = [x for x in d["compare"].values() if x is not None]
        d["byte_identical"] = (all(x.get("identical") for x in cmps)
                               if cmps and not any(x.get("not_compared") for x in cmps) else None)
        dist[key] = d
    if (dist.get("convert_torchrun") or {}).get("byte_identical") is not None:
        targets["torchrun_byte_identical"] = dist["convert_torchrun"]["byte_identical"]
    return {"marginal": out, "targets": targets, "unjudged": unjudged, "delta_gib": dgib, "distributed": dist,
            **extra}


def inspect_bench(args, tmp: Path) -> dict:
    from bench_inspect import time_inspect

    from reshard.testing.synthetic import make_many_entries

    res = {}
    for n in (10, 10_000):
        ck = make_many_entries(tmp / f"many-{n}", n)
        res[n] = time_inspect(args.python, ck, 3, 1, args.timeout)
        print(f"  inspect {n} entries: median {res[n]['median_s']}", file=sys.stderr, flush=True)
        shutil.rmtree(ck, ignore_errors=True)
    ok = all(r["ok"] for r in res.values())
    diff = (res[10_000]["median_s"] - res[10]["median_s"]) if ok else None
    return {"small": res[10], "large": res[10_000], "difference_s": diff, "target_s": INSPECT_TARGET_S,
            "meets_target": (diff < INSPECT_TARGET_S) if diff is not None else None}


# ------------------------------------------------------------------------- report
def _f(x, fmt="{:.2f}") -> str:
    return fmt.format(x) if x is not None else "-"


def _pf(ok: bool) -> str:
    return "**PASS**" if ok else "**FAIL**"


def _link_lines(result: dict) -> list[str]:
    """``--data link`` next to copy mode at each size: wall time, the ratio, the bytes each wrote."""
    out = []
    for case in result["cases"]:
        c, k = best(case, "convert"), best(case, "convert_link")
        if not c or not k:
            continue
        inner = (f" (the conversion itself, as each report says: {k['reported_seconds']:.2f} s vs {c['reported_seconds']:.2f} s)"
                 if k.get("reported_seconds") is not None and c.get("reported_seconds") is not None else "")
        out.append(f"- `--data link` at {case['size_gib']:g} GiB: {k['wall_s']:.2f} s vs copy {c['wall_s']:.2f} s "
                   f"({c['wall_s'] / k['wall_s']:.1f}x faster){inner}, wrote {k.get('bytes_written') or 0:,} bytes vs "
                   f"{c.get('bytes_written') or 0:,}; peak RSS {k['peak_rss_mib']:,.0f} vs {c['peak_rss_mib']:,.0f} MiB")
    return out + [""] if out else []


def render_markdown(result: dict) -> str:
    cases, s = result["cases"], result["summary"]
    small, large = cases[0], cases[-1]
    sg, lg = f"{small['size_gib']:g} GiB", f"{large['size_gib']:g} GiB"
    cache = "cold cache (page cache dropped before every command)" if result["cold_cache"] else "**warm cache**"
    m = result["machine"]
    lines = [
        "# reshard convert / verify / inspect: speed vs `cp -r`",
        "",
        (f"Sources: `make_sharded` (real `dcp.save`, gloo) on {result['world_size']} ranks, float32 tensors of "
        f"{result['tensor_mib']:g} MiB ({result['shape'][0]} x {result['shape'][1]}, Shard(0)), plus a minimal "
        f"manifest; {small['n_tensors']} tensors ({small['gib_on_disk']:.3f} GiB) and {large['n_tensors']} tensors "
        f"({large['gib_on_disk']:.3f} GiB). Each command in a fresh process, {cache}, conversions with "
        f"`SOURCE_DATE_EPOCH={EPOCH}`; wall time is the best of {result['runs']} run(s) (stock path: "
        f"{result['stock_runs']}). Marginal cost = (t({lg}) - t({sg})) / {s['delta_gib']:.3f} GiB. "
        f"GB/s = source bytes on disk / wall at {lg} (1 GB = 10^9 bytes)."),
        "",
        (f"| command | wall {sg} (s) | wall {lg} (s) | GB/s at {lg} | peak RSS {sg} (MiB) | peak RSS {lg} (MiB) "
         "| marginal (s/GiB) | marginal CPU (s/GiB) | x `cp -r` |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    skipped = {"stock": result["no_stock"], "convert_tp": result["no_tp"], "convert_link": result.get("no_link", False),
               "convert_workers": result["no_distributed"], "convert_torchrun": result["no_distributed"]}
    for cmd, label in commands(result):
        if skipped.get(cmd):
            continue
        v = s["marginal"].get(cmd)
        if cmd == "convert_tp" and result.get("tp_not_measured"):
            lines.append(f"| {label} | not measured: {result['tp_not_measured'].replace('|', '/')} | | | | | | | |")
            continue
        if v is None:
            why = " (no convert output to verify)" if cmd == "verify" else ""
            lines.append(f"| {label} | not run{why} | | | | | | | |")
            continue

        def cell(which, field, fmt, v=v):
            return _f(v[f"{which}_{field}"], fmt) if v[f"{which}_status"] == "ok" else v[f"{which}_status"]

        lines.append(f"| {label} | {cell('small', 'wall_s', '{:.2f}')} | {cell('large', 'wall_s', '{:.2f}')} "
                     f"| {_f(v['large_gb_per_s'])} | {cell('small', 'rss_mib', '{:,.0f}')} "
                     f"| {cell('large', 'rss_mib', '{:,.0f}')} | {_f(v.get('marginal_s_per_gib'))} "
                     f"| {_f(v.get('marginal_cpu_s_per_gib'))} | {_f(v.get('ratio_to_cp'))} |")
    lines.append("")
    lines += _link_lines(result)
    t, M = s["targets"], s["marginal"]

    def mg(cmd, field="marginal_s_per_gib"):
        return (M.get(cmd) or {}).get(field)

    lines.append("Targets:")
    lines.append("")
    U = s.get("unjudged", {})

    def missing(name: str, what: str) -> None:
        lines.append(f"- {what}: not judged: " + (U.get(name) or "a run failed (see Problems)"))

    if "convert_le_1.5x_cp" in t:
        lines.append(f"- convert marginal <= {CONVERT_TARGET}x `cp -r`: {_pf(t['convert_le_1.5x_cp'])} "
                     f"({mg('convert'):.2f} vs {mg('cp'):.2f} s/GiB: {mg('convert', 'ratio_to_cp'):.2f}x)")
    else:
        missing("convert_le_1.5x_cp", f"convert marginal <= {CONVERT_TARGET}x `cp -r`")
    if "convert_10x_below_stock" in t:
        lines.append(f"- convert >= {STOCK_FACTOR:g}x below the stock path: {_pf(t['convert_10x_below_stock'])} "
                     f"({mg('stock'):.2f} vs {mg('convert'):.2f} s/GiB: {s['stock_over_convert']:.2f}x)")
    elif not result["no_stock"]:
        missing("convert_10x_below_stock", f"convert >= {STOCK_FACTOR:g}x below the stock path")
    if "convert_rss_flat" in t:
        lines.append(f"- convert peak RSS {lg} - {sg} within {RSS_TARGET_MIB:g} MiB: {_pf(t['convert_rss_flat'])} "
                     f"({mg('convert', 'large_rss_mib'):,.0f} - {mg('convert', 'small_rss_mib'):,.0f} = "
                     f"{mg('convert', 'rss_diff_mib'):+.1f} MiB)")
    else:
        missing("convert_rss_flat", f"convert peak RSS {lg} - {sg} within {RSS_TARGET_MIB:g} MiB")
    if "stock_rss_grows" in t:
        d = mg("stock", "rss_diff_mib")
        lines.append(f"- stock peak RSS grows ({lg} - {sg} > {RSS_TARGET_MIB:g} MiB): {_pf(t['stock_rss_grows'])} "
                     f"({mg('stock', 'large_rss_mib'):,.0f} - {mg('stock', 'small_rss_mib'):,.0f} = {d:+.1f} MiB, "
                     f"{d / s['delta_gib']:,.0f} MiB per GiB of checkpoint)")
    elif not result["no_stock"]:
        missing("stock_rss_grows", "stock peak RSS grows")
    if "verify_le_1.5x_cp" in t:
        lines.append(f"- verify marginal <= {VERIFY_TARGET}x `cp -r`: {_pf(t['verify_le_1.5x_cp'])} "
                     f"({mg('verify'):.2f} vs {mg('cp'):.2f} s/GiB: {mg('verify', 'ratio_to_cp'):.2f}x)")
    else:
        missing("verify_le_1.5x_cp", f"verify marginal <= {VERIFY_TARGET}x `cp -r`")
    med = s.get("median_targets") or {}
    if med:
        def medline(cmd: str) -> str:
            return f"{mg(cmd, 'median_marginal_s_per_gib'):.2f}"

        bits = []
        if "convert_le_1.5x_cp" in med:
            bits.append(f"convert {medline('convert')} vs `cp -r` {medline('cp')} s/GiB "
                        f"({mg('convert', 'median_ratio_to_cp'):.2f}x): {_pf(med['convert_le_1.5x_cp'])}")
        if "convert_10x_below_stock" in med:
            bits.append(f"stock {medline('stock')} s/GiB, "
                        f"{mg('stock', 'median_marginal_s_per_gib') / mg('convert', 'median_marginal_s_per_gib'):.2f}x "
                        f"convert: {_pf(med['convert_10x_below_stock'])}")
        if "verify_le_1.5x_cp" in med:
            bits.append(f"verify {medline('verify')} s/GiB ({mg('verify', 'median_ratio_to_cp'):.2f}x `cp -r`): "
                        f"{_pf(med['verify_le_1.5x_cp'])}")
        lines.append(f"- the same speed targets on the median of the {result.get('runs', '?')} runs instead of the "
                     "best: " + "; ".join(bits))
    ins = result.get("inspect")
    if ins:
        if ins["difference_s"] is not None:
            lines.append(f"- `reshard inspect --json` of 10,000 entries < {INSPECT_TARGET_S:g} s more than 10: "
                         f"{_pf(ins['meets_target'])} ({ins['large']['median_s']:.2f} s vs {ins['small']['median_s']:.2f} s, "
                         f"{ins['difference_s']:+.2f} s; median of 3, warm cache)")
        else:
            lines.append("- `reshard inspect --json` 10,000 vs 10 entries: not judged (inspect failed)")
    dist = s.get("distributed") or {}
    for key, what in (("convert_torchrun", f"`torchrun --nproc-per-node {result['dist_workers']}`"),
                      ("convert_workers", f"`--workers {result['dist_workers']}`")):
        d = dist.get(key)
        if d is None:
            continue
        verdict = ("" if key != "convert_torchrun" or d["byte_identical"] is None else _pf(d["byte_identical"]) + " ")
        lines.append(f"- {what} output byte-identical to the single-process run: {verdict}"
                     + "; ".join(f"{size} GiB: {_describe_compare(c)}" for size, c in d["compare"].items()))
        lines.append(f"- {what} speedup, wall(single) / wall({key.split('_')[1]}): {sg} {_f(d['small_speedup'])}x, "
                     f"{lg} {_f(d['large_speedup'])}x; marginal {_f(d['marginal_speedup'])}x")
    others = [(c, lbl) for c, lbl in (("convert_workers", "`--workers`"), ("convert_torchrun", "torchrun"),
                                      ("convert_tp", f"TP `--to {result['tp_to']}`"), ("verify", "verify"))
              if mg(c, "rss_diff_mib") is not None]
    if others:
        lines.append(f"- peak RSS {lg} - {sg} of the other commands (no target; convert's bound would be "
                     f"{RSS_TARGET_MIB:g} MiB): " + ", ".join(f"{lbl} {mg(c, 'rss_diff_mib'):+.1f} MiB" for c, lbl in others))
    if result.get("tp_not_measured") and not result["no_tp"]:
        lines.append(f"- TP conversion not measured: {result['tp_not_measured']}")
    lines += ["", "Notes:", ""]
    lines.append("- peak RSS is `ru_maxrss` of the child: for a command with child processes (`--workers`, torchrun) "
                 "it is the largest single process of the tree, not the sum; marginal CPU includes waited-for "
                 "children. For `cp` it includes the forked parent's pages before exec (Linux keeps the high-water "
                 "mark across exec), so only differences between sizes mean anything there.")
    if not result["no_tp"]:
        lines.append(f"- the TP conversion uses a rules file written by the script (one rule: every "
                     f"`model.layers.{{i}}.weight` `tp = \"shard\"`, dim {result['tp_dim']}); the synthetic tensors "
                     "belong to no built-in model family.")
    lines += ["", f"Machine: {m['nproc']} CPUs, {m.get('mem_total_gib', '?')} GiB RAM, {m['platform']}, "
                  f"Python {m['python']}, torch {m['torch']}"
                  + (f"; load average {result['loadavg_start']:.2f} at the start, {m['loadavg'][0]:.2f} at the end"
                     + (" (above the CPU count: other work competed for the CPUs, the timings are noisy)"
                        if max(result["loadavg_start"], m["loadavg"][0]) > m["nproc"] else "")
                     if m.get("loadavg") else "")
                  + ". Checkpoint builds: "
                  + ", ".join(f"{c['size_gib']:g} GiB {c['build_s']:.0f} s" for c in cases) + "."]
    problems = [p for c in cases for p in c["problems"]] + result.get("problems", [])
    if problems:
        lines += ["", "Problems:", ""] + [f"- `{' '.join(p.split())[:700]}`" for p in problems]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-results", help="directory for bench_speed.{md,json} (default bench-results/)")
    ap.add_argument("--sizes", default="1,4", help="two checkpoint sizes in GiB (default 1,4)")
    ap.add_argument("--tensor-mib", type=float, default=16.0)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--to", default="dp=2", help="target of the DP conversion (default dp=2)")
    ap.add_argument("--tp-to", default="dp=2,tp=2", help="target of the TP conversion (default dp=2,tp=2)")
    ap.add_argument("--tp-dim", type=int, default=1, help="dim the rules file shards the tensors along under TP (default 1)")
    ap.add_argument("--dist-workers", type=int, default=2,
                    help="--workers N and torchrun --nproc-per-node N of the distributed runs (default 2)")
    ap.add_argument("--runs", type=int, default=3, help="rounds of runs per size; the table uses the best, medians are reported too (default 3)")
    ap.add_argument("--stock-runs", type=int, default=1)
    ap.add_argument("--no-stock", action="store_true", help="skip the stock format_utils path")
    ap.add_argument("--no-tp", action="store_true", help="skip the TP conversion")
    ap.add_argument("--no-distributed", action="store_true", help="skip the --workers and torchrun conversions")
    ap.add_argument("--no-link", action="store_true", help="skip the --data link conversion")
    ap.add_argument("--no-inspect", action="store_true", help="skip the inspect 10 vs 10,000 entries timing")
    ap.add_argument("--sample-ms", type=float, default=100.0)
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--tmp", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = ap.parse_args(argv)
    try:
        sizes = sorted(float(x) for x in args.sizes.split(",") if x.strip())
    except ValueError:
        ap.error("--sizes must be two comma-separated numbers (GiB)")
    if len(sizes) != 2 or sizes[0] <= 0 or sizes[0] == sizes[1]:
        ap.error("--sizes needs exactly two different positive sizes")
    if args.runs < 1 or args.stock_runs < 1:
        ap.error("--runs and --stock-runs must be >= 1")
    load_start = os.getloadavg()[0]
    os.environ["SOURCE_DATE_EPOCH"] = EPOCH  # inherited by every command: reproducible conversion outputs
    shape = tensor_shape(args.tensor_mib)
    cold = can_drop_caches()
    tmp = Path(tempfile.mkdtemp(prefix="bench-speed-", dir=args.tmp))
    log_dir = tmp / "logs"
    log_dir.mkdir()
    rules = tmp / "bench-rules.toml"
    rules.write_text(RULES_TOML.format(dim=args.tp_dim))
    state: dict = {"rules": rules}
    cases, ins, problems = [], None, []
    try:
        for size in sizes:
            cases.append(run_case(args, size, shape, tmp, log_dir, cold, state))
        if not args.no_inspect:
            ins = inspect_bench(args, tmp)
            for n, r in (("10", ins["small"]), ("10,000", ins["large"])):
                problems += [f"inspect {n} entries: {p}" for p in r["problems"]]
    finally:
        if args.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "benchmark": "speed",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "sizes_gib": sizes, "tensor_mib": args.tensor_mib, "shape": list(shape), "world_size": args.world_size,
        "to": args.to, "tp_to": args.tp_to, "tp_dim": args.tp_dim, "dist_workers": args.dist_workers,
        "runs": args.runs, "stock_runs": args.stock_runs,
        "no_stock": args.no_stock, "no_tp": args.no_tp, "no_distributed": args.no_distributed, "no_link": args.no_link,
        "source_date_epoch": EPOCH, "cold_cache": cold, "loadavg_start": load_start,
        "rules_toml": RULES_TOML.format(dim=args.tp_dim) if not args.no_tp else None,
        "tp_not_measured": state.get("tp_not_measured"),
        "targets_def": {"convert_x_cp": CONVERT_TARGET, "verify_x_cp": VERIFY_TARGET, "stock_factor": STOCK_FACTOR,
                        "rss_mib": RSS_TARGET_MIB, "inspect_s": INSPECT_TARGET_S},
        "problems": problems,
    }
    summary = summarise(cases, result)
    result.update({
        "ok": not any(c["problems"] for c in cases) and not problems
              and (ins is None or ins["difference_s"] is not None),
        "summary": summary, "inspect": ins, "machine": machine(), "cases": cases,
    })
    md = render_markdown(result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_speed.md").write_text(md)
    (out / "bench_speed.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(md)
    print(f"wrote {out / 'bench_speed.md'} and {out / 'bench_speed.json'}", file=sys.stderr)
    if not result["ok"]:
        return 2
    targets = dict(summary["targets"])
    if ins is not None:
        targets["inspect_lt_1s"] = ins["meets_target"]
    if args.check and (not all(targets.values()) or summary["unjudged"]):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
