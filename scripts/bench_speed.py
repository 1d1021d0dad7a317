"""Benchmark: how fast are ``reshard convert`` and ``reshard verify`` compared with ``cp -r``?

Resharding is I/O: the floor is copying the checkpoint. Speed is measured as a MARGINAL
cost: for checkpoints of two sizes (``--sizes``, GiB, default ``1,4``) built from the same
tensors (``--tensor-mib`` MiB float32, default 16, ``Shard(0)`` on ``--world-size`` ranks,
default 4; more of them for the larger size), each command's

    marginal cost = (time(large) - time(small)) / (GiB(large) - GiB(small))   [s/GiB]

so interpreter and torch start-up cancel. Per size, each in a fresh subprocess (wall time
and peak RSS from ``os.wait4``, as in ``scripts/bench_convert_memory.py``, whose helpers
this script imports):

    cp -r SRC COPY                                   # the floor
    cp -r SRC COPY && sync                           # the floor with the data on disk
    python -m reshard convert SRC DST --to dp=2 --json
    python -m reshard verify SRC DST --json
    python -c 'dcp_to_torch_save(SRC, F); torch_save_to_dcp(F, DST2)'   # the stock offline path

Targets (issue 6): convert's marginal cost <= 1.5x ``cp -r``'s and >= 10x below the stock
path's; verify's <= 1.5x ``cp -r``'s. The table gives each command's marginal cost and
its ratio to ``cp -r``'s.

Before every timed command the page cache is dropped (``sync; echo 3 >
/proc/sys/vm/drop_caches``) when this process may (root, writable /proc/sys); otherwise
the table says "warm cache". ``cp -r`` does not fsync; reshard's writer fsyncs the
``.metadata`` commit (and what ``atomic_directory`` requires), so ``cp -r && sync`` is
given as a second reference.

It also times ``reshard inspect --json`` on a 10-entry and a 10,000-entry checkpoint
(``scripts/bench_inspect.py``'s approach, by import).

Usage::

    .venv/bin/python scripts/bench_speed.py                        # writes bench-results/
    .venv/bin/python scripts/bench_speed.py --sizes 0.25,1 --no-stock

Outputs (in ``--out``): ``bench_speed.md`` (also printed) and ``bench_speed.json``.
Exit 2 if a command failed, 0 otherwise (with ``--check``: 1 when a target is missed).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_convert_memory import (  # noqa: E402  (scripts/ is not a package)
    GIB,
    MIB,
    add_manifest,
    checkpoint_facts,
    dir_bytes,
    machine,
    measure,
    tensor_shape,
)

ELEMENT_SIZE = 4
CONVERT_TARGET = 1.5   # x cp -r marginal cost
VERIFY_TARGET = 1.5
STOCK_FACTOR = 10.0    # convert must be this many times cheaper than the stock path

STOCK_SCRIPT = """
import sys, warnings
warnings.simplefilter("ignore")
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
src, tmpfile, dst = sys.argv[1:4]
dcp_to_torch_save(src, tmpfile)
torch_save_to_dcp(tmpfile, dst)
"""


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


def _run(name: str, cmd: list[str], args, log_dir: Path, cold: bool, problems: list[str]) -> dict:
    drop_caches(cold)
    r = measure(cmd, timeout=args.timeout, sample_ms=args.sample_ms, log_dir=log_dir, name=name)
    r.pop("samples", None)
    if r["exit_code"] != 0:
        problems.append(f"{name}: exit code {r['exit_code']}: {r['stderr_tail'][-600:] or r['stdout'][-300:]}")
    print(f"  {name}: {r['wall_s']:.2f} s, peak RSS {r['peak_rss_mib']:,.0f} MiB (exit {r['exit_code']})",
          file=sys.stderr, flush=True)
    return r


def run_case(args, size_gib: float, shape, tmp: Path, log_dir: Path, cold: bool) -> dict:
    from reshard.synthetic import make_sharded

    tensor_bytes = shape[0] * shape[1] * ELEMENT_SIZE
    n = max(1, round(size_gib * GIB / tensor_bytes))
    tag = f"{size_gib:g}gib"
    src = tmp / f"src-{tag}"
    case: dict = {"size_gib": size_gib, "n_tensors": n, "problems": [], "runs": {}}
    t0 = time.perf_counter()
    make_sharded(src, world_size=args.world_size, n_tensors=n, shape=shape, seed=0, timeout=args.timeout)
    case["build_s"] = round(time.perf_counter() - t0, 2)
    add_manifest(src, world_size=args.world_size)
    case["facts"] = checkpoint_facts(src)
    case["gib_on_disk"] = case["facts"]["bytes_on_disk"] / GIB
    print(f"[{tag}] built {n} tensors ({case['gib_on_disk']:.2f} GiB) in {case['build_s']:.1f} s", file=sys.stderr,
          flush=True)
    py, R, P = args.python, case["runs"], case["problems"]

    cp = shutil.which("cp") or "cp"
    for i in range(args.runs):
        d = tmp / f"cp-{tag}"
        shutil.rmtree(d, ignore_errors=True)
        R.setdefault("cp", []).append(_run(f"cp-{tag}-{i}", [cp, "-r", str(src), str(d)], args, log_dir, cold, P))
        shutil.rmtree(d, ignore_errors=True)
        R.setdefault("cp_sync", []).append(
            _run(f"cpsync-{tag}-{i}", ["sh", "-c", 'cp -r "$0" "$1" && sync', str(src), str(d)], args, log_dir, cold, P))
        shutil.rmtree(d, ignore_errors=True)

    dst = tmp / f"dst-{tag}"
    for i in range(args.runs):
        shutil.rmtree(dst, ignore_errors=True)
        r = _run(f"convert-{tag}-{i}", [py, "-m", "reshard", "convert", str(src), str(dst), "--to", args.to, "--json"],
                 args, log_dir, cold, P)
        if r["exit_code"] == 0:
            try:
                rep = json.loads(r["stdout"])
                r["bytes_written"] = rep.get("bytes_written")
                r["verified_equal"] = rep.get("verification", {}).get("equal")
                r["reported_seconds"] = rep.get("seconds")
            except json.JSONDecodeError as e:
                P.append(f"convert stdout is not JSON ({e})")
        r.pop("stdout", None)
        R.setdefault("convert", []).append(r)
    if dst.exists():
        for i in range(args.runs):
            r = _run(f"verify-{tag}-{i}", [py, "-m", "reshard", "verify", str(src), str(dst), "--json"],
                     args, log_dir, cold, P)
            r.pop("stdout", None)
            R.setdefault("verify", []).append(r)
    shutil.rmtree(dst, ignore_errors=True)

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


COMMANDS = [
    ("cp", "`cp -r`"),
    ("cp_sync", "`cp -r && sync`"),
    ("convert", "`reshard convert --to dp=2`"),
    ("verify", "`reshard verify SRC DST`"),
    ("stock", "stock `dcp_to_torch_save` + `torch_save_to_dcp`"),
]


def best(case: dict, cmd: str) -> dict | None:
    runs = [r for r in case["runs"].get(cmd, []) if r["exit_code"] == 0]
    if not runs or len(runs) != len(case["runs"].get(cmd, [])):
        return None
    return min(runs, key=lambda r: r["wall_s"])  # the least disturbed run


def summarise(cases: list[dict]) -> dict:
    small, large = cases[0], cases[-1]
    dgib = large["gib_on_disk"] - small["gib_on_disk"]
    out: dict = {}
    for cmd, _ in COMMANDS:
        a, b = best(small, cmd), best(large, cmd)
        if a is None or b is None:
            out[cmd] = None
            continue
        out[cmd] = {
            "small_wall_s": a["wall_s"], "large_wall_s": b["wall_s"],
            "small_rss_mib": a["peak_rss_mib"], "large_rss_mib": b["peak_rss_mib"],
            "marginal_s_per_gib": (b["wall_s"] - a["wall_s"]) / dgib,
            "marginal_cpu_s_per_gib": ((b["user_s"] + b["sys_s"]) - (a["user_s"] + a["sys_s"])) / dgib,
        }
    cpm = (out.get("cp") or {}).get("marginal_s_per_gib")
    for cmd, v in out.items():
        if v is not None and cpm:
            v["ratio_to_cp"] = v["marginal_s_per_gib"] / cpm
    targets, extra = {}, {}
    if out.get("convert") and out.get("cp"):
        targets["convert_le_1.5x_cp"] = out["convert"]["ratio_to_cp"] <= CONVERT_TARGET
    if out.get("verify") and out.get("cp"):
        targets["verify_le_1.5x_cp"] = out["verify"]["ratio_to_cp"] <= VERIFY_TARGET
    if out.get("convert") and out.get("stock"):
        f = out["stock"]["marginal_s_per_gib"] / out["convert"]["marginal_s_per_gib"]
        extra["stock_over_convert"] = f
        targets["convert_10x_below_stock"] = f >= STOCK_FACTOR
    return {"marginal": out, "targets": targets, "delta_gib": dgib, **extra}


def inspect_bench(args, tmp: Path) -> dict:
    from bench_inspect import time_inspect
    from reshard.synthetic import make_many_entries

    res = {}
    for n in (10, 10_000):
        ck = make_many_entries(tmp / f"many-{n}", n)
        res[n] = time_inspect(args.python, ck, 3, 1, args.timeout)
        print(f"  inspect {n} entries: median {res[n]['median_s']}", file=sys.stderr, flush=True)
        shutil.rmtree(ck, ignore_errors=True)
    ok = all(r["ok"] for r in res.values())
    return {"small": res[10], "large": res[10_000],
            "difference_s": (res[10_000]["median_s"] - res[10]["median_s"]) if ok else None}


def _f(x, fmt="{:.2f}") -> str:
    return fmt.format(x) if x is not None else "-"


def render_markdown(result: dict) -> str:
    cases, s = result["cases"], result["summary"]
    small, large = cases[0], cases[-1]
    cache = "cold cache (page cache dropped before every command)" if result["cold_cache"] else "**warm cache**"
    m = result["machine"]
    lines = [
        "# reshard convert / verify: speed vs `cp -r`",
        "",
        f"Sources: `make_sharded` on {result['world_size']} ranks, float32 tensors of {result['tensor_mib']:g} MiB "
        f"({result['shape'][0]} x {result['shape'][1]}, Shard(0)); {small['n_tensors']} tensors "
        f"({small['gib_on_disk']:.2f} GiB) and {large['n_tensors']} tensors ({large['gib_on_disk']:.2f} GiB). "
        f"Each command in a fresh process, {cache}; wall time is the best of {result['runs']} run(s) "
        f"(stock path: {result['stock_runs']}). Marginal cost = (t(large) - t(small)) / "
        f"{s['delta_gib']:.2f} GiB.",
        "",
        f"| command | wall {small['size_gib']:g} GiB (s) | wall {large['size_gib']:g} GiB (s) "
        f"| peak RSS {small['size_gib']:g} GiB (MiB) | peak RSS {large['size_gib']:g} GiB (MiB) "
        "| marginal (s/GiB) | marginal CPU (s/GiB) | x `cp -r` |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for cmd, label in COMMANDS:
        v = s["marginal"].get(cmd)
        if v is None:
            if cmd == "stock" and result["no_stock"]:
                continue
            lines.append(f"| {label} | failed | | | | | | |")
            continue
        lines.append(f"| {label} | {v['small_wall_s']:.2f} | {v['large_wall_s']:.2f} | {v['small_rss_mib']:,.0f} "
                     f"| {v['large_rss_mib']:,.0f} | {v['marginal_s_per_gib']:.2f} | {v['marginal_cpu_s_per_gib']:.2f} "
                     f"| {_f(v.get('ratio_to_cp'))} |")
    lines.append("")
    t = s["targets"]
    if "convert_le_1.5x_cp" in t:
        lines.append(f"- convert marginal <= {CONVERT_TARGET}x `cp -r`: **{'PASS' if t['convert_le_1.5x_cp'] else 'FAIL'}** "
                     f"({s['marginal']['convert']['ratio_to_cp']:.2f}x)")
    if "convert_10x_below_stock" in t:
        lines.append(f"- convert >= {STOCK_FACTOR:g}x below the stock path: "
                     f"**{'PASS' if t['convert_10x_below_stock'] else 'FAIL'}** ({s['stock_over_convert']:.2f}x)")
    if "verify_le_1.5x_cp" in t:
        lines.append(f"- verify marginal <= {VERIFY_TARGET}x `cp -r`: **{'PASS' if t['verify_le_1.5x_cp'] else 'FAIL'}** "
                     f"({s['marginal']['verify']['ratio_to_cp']:.2f}x)")
    ins = result.get("inspect")
    if ins:
        lines.append(f"- `reshard inspect --json`: 10 entries {_f(ins['small']['median_s'])} s, 10,000 entries "
                     f"{_f(ins['large']['median_s'])} s (median of 3, warm cache), difference "
                     f"{_f(ins['difference_s'])} s")
    lines.append("- peak RSS is `ru_maxrss` of the child; for `cp` it includes the forked parent's pages before exec "
                 "(Linux keeps the high-water mark across exec), so only differences between sizes mean anything there.")
    lines += ["", f"Machine: {m['nproc']} CPUs, {m.get('mem_total_gib', '?')} GiB RAM, {m['platform']}, "
                  f"Python {m['python']}, torch {m['torch']}. Checkpoint builds: "
                  + ", ".join(f"{c['size_gib']:g} GiB {c['build_s']:.0f} s" for c in cases) + "."]
    problems = [p for c in cases for p in c["problems"]]
    if problems:
        lines += ["", "Problems:", ""] + [f"- `{p.strip().splitlines()[-1] if p.strip() else p}`" for p in problems]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-results", help="directory for bench_speed.{md,json} (default bench-results/)")
    ap.add_argument("--sizes", default="1,4", help="two checkpoint sizes in GiB (default 1,4)")
    ap.add_argument("--tensor-mib", type=float, default=16.0)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--to", default="dp=2")
    ap.add_argument("--runs", type=int, default=1, help="runs per command and size; the best is used (default 1)")
    ap.add_argument("--stock-runs", type=int, default=1)
    ap.add_argument("--no-stock", action="store_true", help="skip the stock format_utils path")
    ap.add_argument("--no-inspect", action="store_true", help="skip the inspect 10 vs 10,000 entries timing")
    ap.add_argument("--sample-ms", type=float, default=100.0)
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--tmp", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    sizes = sorted(float(x) for x in args.sizes.split(",") if x.strip())
    if len(sizes) != 2 or sizes[0] <= 0:
        ap.error("--sizes needs exactly two positive sizes")
    shape = tensor_shape(args.tensor_mib)
    cold = can_drop_caches()
    tmp = Path(tempfile.mkdtemp(prefix="bench-speed-", dir=args.tmp))
    log_dir = tmp / "logs"
    log_dir.mkdir()
    cases, ins = [], None
    try:
        for size in sizes:
            cases.append(run_case(args, size, shape, tmp, log_dir, cold))
        if not args.no_inspect:
            ins = inspect_bench(args, tmp)
    finally:
        if args.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    summary = summarise(cases)
    result = {
        "benchmark": "speed",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "sizes_gib": sizes, "tensor_mib": args.tensor_mib, "shape": list(shape), "world_size": args.world_size,
        "to": args.to, "runs": args.runs, "stock_runs": args.stock_runs, "no_stock": args.no_stock,
        "cold_cache": cold,
        "ok": not any(c["problems"] for c in cases) and (ins is None or ins["difference_s"] is not None),
        "summary": summary, "inspect": ins, "machine": machine(), "cases": cases,
    }
    md = render_markdown(result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_speed.md").write_text(md)
    (out / "bench_speed.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(md)
    if not result["ok"]:
        return 2
    if args.check and not all(summary["targets"].values()):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
