"""Benchmark: does the peak memory of ``reshard export`` grow with the checkpoint?

Acceptance criterion: exporting checkpoints of 1 GiB and 4 GiB whose largest tensor is the
same, with ``--max-shard-size 256MB``, must differ by less than 64 MiB of peak RSS.

For each size in ``--sizes`` (GiB, default ``1,4``) a real DCP checkpoint is built with
:func:`reshard.testing.synthetic.make_sharded` on ``--world-size`` ranks (default 4): float32
tensors ``model.layers.{i}.weight`` of ``--tensor-mib`` MiB (default 16), as many as make
up the size. Then, in a fresh subprocess (peak RSS = ``ru_maxrss`` of ``os.wait4`` on that
pid, with ``VmRSS`` sampled to say when; the helpers are ``scripts/bench_convert_memory.py``'s)::

    python -c "from reshard.engine.export import export; export(SRC, DST, fmt=..., max_shard_size=...)"

or, with ``--cli``, ``python -m reshard export SRC DST --format F --max-shard-size S``.
The export reads every tensor back and compares it with the source before committing,
so the measured run includes that verification pass. A baseline process that only imports
torch and reshard.engine.export is measured too.

The safetensors export streams tensor by tensor (peak memory ~ largest tensor, whatever the
shard size); ``--format torch`` holds one shard (``torch.save`` needs the dict), so its
peak grows with ``--max-shard-size`` but not with the checkpoint.

Usage::

    .venv/bin/python scripts/bench_export_memory.py                       # writes bench-results/
    .venv/bin/python scripts/bench_export_memory.py --sizes 0.25,1 --check
    .venv/bin/python scripts/bench_export_memory.py --format torch --dtype bf16

Outputs (``--out``, default ``bench-results/``): ``bench_export_memory.md`` (also printed)
and ``bench_export_memory.json``. Exit 2 if a command fails; with ``--check`` 1 when the
peak-RSS difference between the smallest and largest size is not under 64 MiB.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_convert_memory import GIB, MIB, TARGET_DIFF_MIB, checkpoint_facts, dir_bytes, machine, measure, tensor_shape  # noqa: E402


def export_cmd(args, src: Path, dst: Path) -> list[str]:
    if args.cli:
        cmd = [args.python, "-m", "reshard", "export", str(src), str(dst), "--format", args.format,
               "--max-shard-size", args.max_shard_size]
        return cmd + (["--dtype", args.dtype] if args.dtype else [])
    code = ("import sys; from reshard.engine.export import export; "
            "r = export(sys.argv[1], sys.argv[2], fmt=sys.argv[3], max_shard_size=sys.argv[4], "
            "dtype=(sys.argv[5] or None)); print(len(r['shards']), r['verification']['equal'])")
    return [args.python, "-c", code, str(src), str(dst), args.format, args.max_shard_size, args.dtype or ""]


def run_case(args, size_gib: float, shape, tmp: Path, log_dir: Path) -> dict:
    from reshard.testing.synthetic import make_sharded

    n = max(1, round(size_gib * GIB / (shape[0] * shape[1] * 4)))
    tag = f"{size_gib:g}gib"
    src, dst = tmp / f"src-{tag}", tmp / f"dst-{tag}"
    case: dict = {"size_gib": size_gib, "n_tensors": n, "problems": []}
    t0 = time.perf_counter()
    make_sharded(src, world_size=args.world_size, n_tensors=n, shape=shape, seed=0, timeout=args.timeout)
    case["build_s"] = round(time.perf_counter() - t0, 2)
    case["facts"] = checkpoint_facts(src)
    print(f"[{tag}] built {n} tensors in {case['build_s']:.1f} s; exporting ...", file=sys.stderr, flush=True)
    runs = []
    for i in range(args.runs):
        shutil.rmtree(dst, ignore_errors=True)
        r = measure(export_cmd(args, src, dst), timeout=args.timeout, sample_ms=args.sample_ms, log_dir=log_dir,
                    name=f"export-{tag}-{i}")
        runs.append(r)
        print(f"[{tag}] export run {i + 1}/{args.runs}: {r['wall_s']:.1f} s, peak RSS {r['peak_rss_mib']:,.0f} MiB "
              f"(exit {r['exit_code']})", file=sys.stderr, flush=True)
        if r["exit_code"] != 0:
            case["problems"].append(f"export exit code {r['exit_code']}: {r['stderr_tail'][-800:]}")
            break
    ex = dict(runs[-1])
    ok = all(r["exit_code"] == 0 for r in runs)
    if ok:
        ex["wall_s"] = statistics.median(r["wall_s"] for r in runs)
        ex["peak_rss_mib"] = statistics.median(r["peak_rss_mib"] for r in runs)
        case["bytes_written"] = dir_bytes(dst)
        case["shards"] = len([p for p in dst.iterdir() if p.suffix in (".safetensors", ".pt")])
    ex["runs_peak_rss_mib"] = [r["peak_rss_mib"] for r in runs]
    ex["runs_wall_s"] = [r["wall_s"] for r in runs]
    ex["run_samples"] = [r.pop("samples") for r in runs]
    ex.pop("samples", None)
    case["export"] = ex
    if not args.keep:
        shutil.rmtree(dst, ignore_errors=True)
        shutil.rmtree(src, ignore_errors=True)
    return case


def render_markdown(result: dict) -> str:
    m = result["machine"]
    lines = [
        "# reshard export: peak memory vs checkpoint size", "",
        f"Export to {result['format']} (`--max-shard-size {result['max_shard_size']}`"
        + (f", `--dtype {result['dtype']}`" if result["dtype"] else "") + "), one fresh process per run, "
        f"median of {result['runs']} runs; peak RSS = `ru_maxrss` of that process. Sources: `make_sharded` on "
        f"{result['world_size']} ranks, float32 tensors of {result['tensor_mib']:g} MiB.", "",
        "| checkpoint | tensors | bytes on disk (MiB) | largest tensor (MiB) | shards written | export wall (s) "
        "| export peak RSS (MiB) | runs (MiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in result["cases"]:
        f, ex = c.get("facts") or {}, c.get("export") or {}
        okc = ex.get("exit_code") == 0
        wall = f"{ex['wall_s']:.1f}" if okc else "failed"
        peak = f"{ex['peak_rss_mib']:,.0f}" if okc else "failed"
        lines.append(f"| {c['size_gib']:g} GiB | {f.get('tensors', '-')} | {f.get('bytes_on_disk', 0) / MIB:,.0f} "
                     f"| {f.get('largest_tensor_bytes', 0) / MIB:,.0f} | {c.get('shards', '-')} "
                     f"| {wall} | {peak} "
                     f"| {', '.join(f'{x:,.0f}' for x in ex.get('runs_peak_rss_mib', []))} |")
    d = result["rss_difference_mib"]
    lines.append("")
    lines.append("Peak-RSS difference: n/a (a run failed)" if d is None else
                 f"Peak-RSS difference ({result['cases'][-1]['size_gib']:g} GiB - {result['cases'][0]['size_gib']:g} GiB): "
                 f"**{d:+.1f} MiB** -> **{'PASS' if result['meets_target'] else 'FAIL'}** (target < {TARGET_DIFF_MIB:g} MiB).")
    b = result.get("baseline") or {}
    if b.get("exit_code") == 0:
        lines.append(f"Baseline (imports only): {b['peak_rss_mib']:,.0f} MiB peak RSS.")
    lines.append(f"Machine: {m['nproc']} CPUs, {m.get('mem_total_gib', '?')} GiB RAM, Python {m['python']}, "
                 f"torch {m['torch']}.")
    for c in result["cases"]:
        for p in c["problems"]:
            lines.append(f"- {c['size_gib']:g} GiB: `{p.strip().splitlines()[-1] if p.strip() else p}`")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--sizes", default="1,4", help="checkpoint sizes in GiB (default 1,4)")
    ap.add_argument("--tensor-mib", type=float, default=16.0)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--format", default="safetensors", choices=("safetensors", "torch"))
    ap.add_argument("--dtype", default=None, help="bf16 | fp16 | fp32 (default: as stored)")
    ap.add_argument("--max-shard-size", default="256MB")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--sample-ms", type=float, default=50.0)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--cli", action="store_true", help="run `python -m reshard export` instead of the Python API")
    ap.add_argument("--tmp", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    sizes = sorted(float(s) for s in args.sizes.split(",") if s.strip())
    if len(sizes) < 2:
        ap.error("--sizes needs at least two sizes")
    shape = tensor_shape(args.tensor_mib)
    tmp = Path(tempfile.mkdtemp(prefix="bench-export-memory-", dir=args.tmp))
    log_dir = tmp / "logs"
    log_dir.mkdir()
    try:
        baseline = measure([args.python, "-c", "import torch, reshard.engine.export, reshard.storage.checkpoints.safetensors_format"],
                           timeout=args.timeout, sample_ms=args.sample_ms, log_dir=log_dir, name="baseline")
        baseline.pop("stdout")
        cases = [run_case(args, s, shape, tmp, log_dir) for s in sizes]
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    ok = all((c.get("export") or {}).get("exit_code") == 0 for c in cases)
    diff = cases[-1]["export"]["peak_rss_mib"] - cases[0]["export"]["peak_rss_mib"] if ok else None
    result = {
        "benchmark": "export_memory", "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "format": args.format, "dtype": args.dtype, "max_shard_size": args.max_shard_size, "runs": args.runs,
        "world_size": args.world_size, "tensor_mib": args.tensor_mib, "shape": list(shape),
        "target_mib": TARGET_DIFF_MIB, "ok": ok, "rss_difference_mib": round(diff, 1) if diff is not None else None,
        "meets_target": (diff < TARGET_DIFF_MIB) if diff is not None else None,
        "baseline": baseline, "machine": machine(), "cases": cases,
    }
    md = render_markdown(result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_export_memory.md").write_text(md)
    (out / "bench_export_memory.json").write_text(json.dumps(result, indent=2) + "\n")
    print(md)
    if not ok:
        return 2
    return 1 if args.check and not result["meets_target"] else 0


if __name__ == "__main__":
    sys.exit(main())
