"""Benchmark: does the peak memory of ``reshard convert`` grow with the checkpoint?

Acceptance criterion: converting checkpoints of 0.5 GiB and 2 GiB whose largest tensor is
the same must differ by less than 64 MiB of peak RSS.

For each size in ``--sizes`` (GiB, default ``0.5,2``) the script builds a real DCP
checkpoint with :func:`reshard.testing.synthetic.make_sharded` on ``--world-size`` ranks (default
4): float32 tensors ``model.layers.{i}.weight`` of ``--tensor-mib`` MiB each (default 16,
i.e. 2048 x 2048, sharded on dim 0), as many as make up the size (0.5 GiB = 32 tensors,
2 GiB = 128), so the largest tensor (and the largest chunk) is the same in every case.
Then, each in a fresh subprocess exactly as a user runs it::

    python -m reshard convert SRC DST --to dp=2 --json
    python -m reshard verify SRC DST --json
    cp -r SRC COPY                                  # reference: the cost of moving the bytes

(convert ``--runs`` times, default 3, medians reported: the peak RSS of identical runs
varies by some +-20 MiB with allocator and scheduling noise; verify and cp once). It
records the wall time and the peak resident set size of that process alone (the
``ru_maxrss`` of ``os.wait4`` on its pid: the kernel's high-water mark of RSS, which does
not count the page cache), plus the bytes written. While a command runs, its ``VmRSS`` is
also sampled from ``/proc/PID/status`` (every ``--sample-ms``, default 50) so the JSON
says *when* the peak happened (which phase holds memory). A baseline process that only
imports torch and reshard is measured too: the part of the peak that is interpreter and
libraries, whatever the checkpoint.

The synthetic checkpoints have no ``manifest.json`` (a plain FSDP2-style save). By default
the script adds a minimal valid one to each source before converting (``--no-manifest``
to convert the bare save): at the time of writing, ``reshard convert`` of a manifest-less
source without step counters refuses to commit, because its own post-write verification
finds ``step``/``tokens_seen`` unknown in the source but 0 in the output manifest that
``reshard/commands/transition.py`` writes. The manifest is ~2 KiB and
does not change what is measured. Without optimizer state the plan's verdict is "warm start",
which is irrelevant to memory.

Usage::

    .venv/bin/python scripts/bench_convert_memory.py                    # writes bench-results/
    .venv/bin/python scripts/bench_convert_memory.py --sizes 0.25,1 --check
    .venv/bin/python scripts/bench_convert_memory.py --keep --tmp /big/disk

Outputs (in ``--out``, default ``bench-results/``): ``bench_convert_memory.md`` (a
Markdown table, also printed) and ``bench_convert_memory.json`` (every measurement, the RSS
samples, the machine). Exit 2 if a command fails (the files are still written with
``"ok": false`` and the command's stderr tail); otherwise 0, or with ``--check`` 1 when
the peak-RSS difference between the smallest and the largest size is not under 64 MiB.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

TARGET_DIFF_MIB = 64.0
MIB = 1 << 20
GIB = 1 << 30
ELEMENT_SIZE = 4  # float32


def machine() -> dict:
    info = {
        "nproc": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "python_executable": sys.executable,
    }
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    info["mem_total_gib"] = round(int(line.split()[1]) * 1024 / GIB, 1)
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
    except Exception as e:  # pragma: no cover - torch is a dependency
        info["torch"] = f"unavailable: {e}"
    try:
        import reshard

        info["reshard"] = getattr(reshard, "__version__", "unknown")
    except Exception as e:  # pragma: no cover
        info["reshard"] = f"unavailable: {e}"
    try:
        info["loadavg"] = list(os.getloadavg())
    except OSError:
        pass
    return info


# ------------------------------------------------------------------------- measuring
def _vmrss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def measure(cmd: list[str], *, timeout: float, sample_ms: float, log_dir: Path, name: str) -> dict:
    """Run ``cmd``; its wall time, exit code and peak RSS (``ru_maxrss`` of this child only).

    stdout/stderr go to files (no pipes to drain while we wait on the pid). ``VmRSS`` is
    sampled from /proc while it runs: ``samples`` is ``[[seconds, MiB], ...]``.
    """
    out_path, err_path = log_dir / f"{name}.stdout", log_dir / f"{name}.stderr"
    samples: list[list[float]] = []
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=err)
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                kib = _vmrss_kib(p.pid)
                if kib is not None:
                    samples.append([round(time.perf_counter() - t0, 3), round(kib / 1024, 1)])
                done.wait(sample_ms / 1000)

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        killer = threading.Timer(timeout, p.kill)
        killer.start()
        try:
            _, status, usage = os.wait4(p.pid, 0)
        finally:
            killer.cancel()
            done.set()
        wall = time.perf_counter() - t0
        th.join()
    p.returncode = os.waitstatus_to_exitcode(status)  # so Popen does not wait again
    timed_out = p.returncode < 0 and wall >= timeout
    peak_kib = usage.ru_maxrss  # KiB on Linux
    stdout = out_path.read_text(errors="replace")
    stderr = err_path.read_text(errors="replace")
    peak_at = max(samples, key=lambda s: s[1])[0] if samples else None
    return {
        "command": cmd,
        "exit_code": p.returncode,
        "timed_out": timed_out,
        "wall_s": round(wall, 3),
        "peak_rss_mib": round(peak_kib / 1024, 1),
        "peak_sampled_at_s": peak_at,
        "user_s": round(usage.ru_utime, 3),
        "sys_s": round(usage.ru_stime, 3),
        "major_faults": usage.ru_majflt,
        "samples": _thin(samples, 400),
        "stdout": stdout,
        "stderr_tail": stderr.strip()[-1500:],
    }


def _thin(samples: list, n: int) -> list:
    if len(samples) <= n:
        return samples
    step = len(samples) / n
    keep = {int(i * step) for i in range(n)} | {max(range(len(samples)), key=lambda i: samples[i][1]), len(samples) - 1}
    return [samples[i] for i in sorted(keep)]


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ------------------------------------------------------------------------- the checkpoints
def tensor_shape(tensor_mib: float) -> tuple[int, int]:
    """A 2-D float32 shape of ``tensor_mib`` MiB, rows a multiple of 8 (even shards on 4 or 8 ranks)."""
    numel = int(round(tensor_mib * MIB / ELEMENT_SIZE))
    cols = 2048
    rows = max(8, round(numel / cols / 8) * 8)
    return rows, cols


def add_manifest(ckpt: Path, *, world_size: int) -> None:
    """A minimal valid manifest (plain dp_shard=world_size run, no optimizer state)."""
    from reshard.testing.synthetic import minimal_manifest

    minimal_manifest(ckpt, world_size=world_size, tool="scripts/bench_convert_memory.py",
                     experiment_id="bench-convert-memory")


def checkpoint_facts(ckpt: Path) -> dict:
    from reshard.storage.checkpoints.index import CheckpointIndex

    ix = CheckpointIndex.open(ckpt)
    tensors = [e for e in ix.entries.values() if e.is_tensor]
    chunk_bytes = [c.location.length for e in tensors for c in e.chunks if c.location is not None]
    return {
        "bytes_on_disk": dir_bytes(ckpt),
        "tensors": len(tensors),
        "tensor_bytes": sum(e.nbytes for e in tensors),
        "largest_tensor_bytes": max((e.nbytes for e in tensors), default=0),
        "largest_chunk_bytes": max(chunk_bytes, default=0),
        "items": ix.item_count(),
    }


# ------------------------------------------------------------------------- report
def _mib(b) -> str:
    return f"{b / MIB:,.0f}" if b is not None else "-"


def _num(x, fmt="{:.2f}") -> str:
    return fmt.format(x) if x is not None else "failed"


def _range(cv: dict, field: str = "runs_peak_rss_mib", fmt: str = "{:,.0f}") -> str:
    runs = cv.get(field) or []
    if len(runs) < 2 or cv.get("exit_code") != 0:
        return ""
    return f" ({fmt.format(min(runs))}-{fmt.format(max(runs))})"


def render_markdown(result: dict) -> str:
    m = result["machine"]
    lines = [
        "# reshard convert: peak memory vs checkpoint size",
        "",
        f"`python -m reshard convert SRC DST --to {result['to']}` and `python -m reshard verify SRC DST`, "
        f"one fresh process each; peak RSS is that process's `ru_maxrss` (page cache not included). "
        f"Convert: median of {result['runs']} runs (min-max in brackets); verify and `cp -r`: one run. "
        f"Sources: `make_sharded` on {result['world_size']} ranks, float32 tensors of "
        f"{result['tensor_mib']:g} MiB ({result['shape'][0]} x {result['shape'][1]}, Shard(0)).",
        "",
        "| checkpoint | tensors | bytes on disk (MiB) | largest tensor (MiB) | largest chunk (MiB) "
        "| convert wall (s) | convert peak RSS (MiB) | written (MiB) | verify wall (s) | verify peak RSS (MiB) "
        "| `cp -r` wall (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in result["cases"]:
        f, cv, vf, cp = c.get("facts") or {}, c.get("convert") or {}, c.get("verify") or {}, c.get("cp") or {}
        lines.append(
            f"| {c['size_gib']:g} GiB | {f.get('tensors', '-')} | {_mib(f.get('bytes_on_disk'))} "
            f"| {_mib(f.get('largest_tensor_bytes'))} | {_mib(f.get('largest_chunk_bytes'))} "
            f"| {_num(cv.get('wall_s') if cv.get('exit_code') == 0 else None)}{_range(cv, 'runs_wall_s', '{:.1f}')} "
            f"| {_num(cv.get('peak_rss_mib') if cv.get('exit_code') == 0 else None, '{:,.0f}')}{_range(cv)} "
            f"| {_mib(c.get('bytes_written'))} "
            f"| {_num(vf.get('wall_s') if vf.get('exit_code') == 0 else None)} "
            f"| {_num(vf.get('peak_rss_mib') if vf.get('exit_code') == 0 else None, '{:,.0f}')} "
            f"| {_num(cp.get('wall_s') if cp.get('exit_code') == 0 else None)} |")
    b = result.get("baseline") or {}
    lines += [""]
    d = result["convert_rss_difference_mib"]
    if d is None:
        lines.append("Convert peak-RSS difference (largest - smallest): n/a (a command failed; see problems below)")
    else:
        lines.append(f"Convert peak-RSS difference ({result['cases'][-1]['size_gib']:g} GiB - "
                     f"{result['cases'][0]['size_gib']:g} GiB): **{d:+.1f} MiB** -> "
                     f"**{'PASS' if result['meets_target'] else 'FAIL'}** (target < {result['target_mib']:g} MiB).")
    vd = result.get("verify_rss_difference_mib")
    if vd is not None:
        lines.append(f"Verify peak-RSS difference: {vd:+.1f} MiB.")
    if b.get("exit_code") == 0:
        lines.append(f"Baseline (a process that only imports torch and reshard): {b['peak_rss_mib']:,.0f} MiB peak RSS, "
                     f"{b['wall_s']:.2f} s.")
    lines += [
        "",
        f"Machine: {m['nproc']} CPUs, {m.get('mem_total_gib', '?')} GiB RAM, {m['platform']}, Python {m['python']}, "
        f"torch {m['torch']}, reshard {m['reshard']}"
        + (f", load average {m['loadavg'][0]:.2f}" if m.get("loadavg") else "") + ".",
        "Checkpoint build (make_sharded): "
        + ", ".join(f"{c['size_gib']:g} GiB {c['build_s']:.1f} s" for c in result["cases"] if c.get("build_s") is not None)
        + (". Sources given a minimal manifest.json (see the script's docstring)." if result["manifest_added"] else "."),
    ]
    problems = [(c["size_gib"], p) for c in result["cases"] for p in c.get("problems", [])]
    if problems:
        lines += ["", "Problems:", ""] + [f"- {s:g} GiB: `{p.strip().splitlines()[-1] if p.strip() else p}`"
                                          for s, p in problems]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------- main
def run_case(args, size_gib: float, shape, tmp: Path, log_dir: Path) -> dict:
    from reshard.testing.synthetic import make_sharded

    tensor_bytes = shape[0] * shape[1] * ELEMENT_SIZE
    n = max(1, round(size_gib * GIB / tensor_bytes))
    tag = f"{size_gib:g}gib"
    src, dst, cp_dst = tmp / f"src-{tag}", tmp / f"dst-{tag}", tmp / f"cp-{tag}"
    case: dict = {"size_gib": size_gib, "n_tensors": n, "problems": []}
    t0 = time.perf_counter()
    make_sharded(src, world_size=args.world_size, n_tensors=n, shape=shape, seed=0, timeout=args.timeout)
    case["build_s"] = round(time.perf_counter() - t0, 2)
    if not args.no_manifest:
        add_manifest(src, world_size=args.world_size)
    case["facts"] = checkpoint_facts(src)
    print(f"[{tag}] built {n} tensors, {case['facts']['bytes_on_disk'] / MIB:,.0f} MiB in {case['build_s']:.1f} s; "
          "converting ...", file=sys.stderr, flush=True)

    py = args.python
    runs = []
    for i in range(args.runs):
        shutil.rmtree(dst, ignore_errors=True)  # each run writes a fresh destination; the last one is kept
        r = measure([py, "-m", "reshard", "convert", str(src), str(dst), "--to", args.to, "--json"],
                    timeout=args.timeout, sample_ms=args.sample_ms, log_dir=log_dir, name=f"convert-{tag}-{i}")
        runs.append(r)
        print(f"[{tag}] convert run {i + 1}/{args.runs}: {r['wall_s']:.1f} s, peak RSS {r['peak_rss_mib']:,.0f} MiB "
              f"(exit {r['exit_code']})", file=sys.stderr, flush=True)
        if r["exit_code"] != 0:
            break
    cv = dict(runs[-1])
    if all(r["exit_code"] == 0 for r in runs):
        # the figures of the case: medians over the runs (peak RSS is noisy by ~+-20 MiB from run to run)
        cv["wall_s"] = statistics.median(r["wall_s"] for r in runs)
        cv["peak_rss_mib"] = statistics.median(r["peak_rss_mib"] for r in runs)
    cv["runs_peak_rss_mib"] = [r["peak_rss_mib"] for r in runs]
    cv["runs_wall_s"] = [r["wall_s"] for r in runs]
    cv["runs_peak_sampled_at_s"] = [r["peak_sampled_at_s"] for r in runs]
    for r in runs[:-1]:
        r.pop("stdout", None)
    cv["run_samples"] = [r.pop("samples") for r in runs]
    cv.pop("samples", None)
    case["convert"] = cv
    report = None
    if cv["exit_code"] == 0:
        try:
            report = json.loads(cv["stdout"])
        except json.JSONDecodeError as e:
            case["problems"].append(f"convert stdout is not JSON ({e})")
    else:
        case["problems"].append(f"convert exit code {cv['exit_code']}: {cv['stderr_tail'] or cv['stdout'][-500:]}")
    cv.pop("stdout")
    if report is not None:
        case["bytes_written"] = report.get("bytes_written")
        case["convert_report"] = {k: report.get(k) for k in ("bytes_written", "seconds", "files")}
        case["convert_report"]["verified_equal"] = report.get("verification", {}).get("equal")
        case["convert_report"]["verdict"] = report.get("plan", {}).get("verdict", {}).get("kind")
        case["dst_bytes_on_disk"] = dir_bytes(dst)
    print(f"[{tag}] convert median {cv['wall_s']:.1f} s, peak RSS {cv['peak_rss_mib']:,.0f} MiB; verifying ...",
          file=sys.stderr, flush=True)

    if dst.exists():
        case["verify"] = vf = measure([py, "-m", "reshard", "verify", str(src), str(dst), "--json"],
                                      timeout=args.timeout, sample_ms=args.sample_ms, log_dir=log_dir, name=f"verify-{tag}")
        if vf["exit_code"] != 0:
            case["problems"].append(f"verify exit code {vf['exit_code']}: {vf['stderr_tail'] or vf['stdout'][-500:]}")
        else:
            try:
                case["verify_equal"] = json.loads(vf["stdout"]).get("equal")
            except json.JSONDecodeError as e:
                case["problems"].append(f"verify stdout is not JSON ({e})")
        vf.pop("stdout")
        print(f"[{tag}] verify {vf['wall_s']:.1f} s, peak RSS {vf['peak_rss_mib']:,.0f} MiB (exit {vf['exit_code']})",
              file=sys.stderr, flush=True)

    cp = shutil.which("cp")
    if cp:
        case["cp"] = c = measure([cp, "-r", str(src), str(cp_dst)], timeout=args.timeout, sample_ms=args.sample_ms,
                                 log_dir=log_dir, name=f"cp-{tag}")
        c.pop("stdout")
        if c["exit_code"] != 0:
            case["problems"].append(f"cp -r exit code {c['exit_code']}: {c['stderr_tail']}")
    if not args.keep:
        for p in (dst, cp_dst, src):
            shutil.rmtree(p, ignore_errors=True)
    else:
        case["paths"] = {"src": str(src), "dst": str(dst), "cp": str(cp_dst)}
    return case


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-results", help="directory for bench_convert_memory.{md,json} (default: bench-results/)")
    ap.add_argument("--sizes", default="0.5,2", help="checkpoint sizes in GiB, comma-separated (default 0.5,2)")
    ap.add_argument("--tensor-mib", type=float, default=16.0, help="MiB per float32 tensor, the same in every size (default 16)")
    ap.add_argument("--world-size", type=int, default=4, help="ranks that write the source (default 4)")
    ap.add_argument("--to", default="dp=2", help="target layout (default dp=2)")
    ap.add_argument("--no-manifest", action="store_true", help="convert the bare make_sharded save (no manifest.json added)")
    ap.add_argument("--runs", type=int, default=3, help="convert runs per size; medians are reported (default 3)")
    ap.add_argument("--sample-ms", type=float, default=50.0, help="VmRSS sampling period (default 50 ms)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per command before giving up")
    ap.add_argument("--python", default=sys.executable, help="interpreter that runs the CLI (default: this one)")
    ap.add_argument("--tmp", default=None, help="parent of the temporary directory (default: the system's, /tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints (printed path) instead of deleting them")
    ap.add_argument("--check", action="store_true", help=f"exit 1 when the convert peak-RSS difference is not under {TARGET_DIFF_MIB:g} MiB")
    args = ap.parse_args(argv)
    try:
        sizes = sorted(float(s) for s in args.sizes.split(",") if s.strip())
    except ValueError:
        ap.error("--sizes must be comma-separated numbers (GiB)")
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    if len(sizes) < 2 or sizes[0] <= 0:
        ap.error("--sizes needs at least two positive sizes")
    shape = tensor_shape(args.tensor_mib)

    tmp = Path(tempfile.mkdtemp(prefix="bench-convert-memory-", dir=args.tmp))
    log_dir = tmp / "logs"
    log_dir.mkdir()
    cases = []
    try:
        baseline = measure([args.python, "-c", "import torch, reshard.cli, reshard.engine.conversion, reshard.verification.checkpoints"],
                           timeout=args.timeout, sample_ms=args.sample_ms, log_dir=log_dir, name="baseline")
        baseline.pop("stdout")
        for size in sizes:
            cases.append(run_case(args, size, shape, tmp, log_dir))
    finally:
        if args.keep:
            print(f"checkpoints kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    def ok(c, step):
        return (c.get(step) or {}).get("exit_code") == 0

    conv_ok = all(ok(c, "convert") for c in cases)
    ver_ok = all(ok(c, "verify") for c in cases)
    diff = cases[-1]["convert"]["peak_rss_mib"] - cases[0]["convert"]["peak_rss_mib"] if conv_ok else None
    vdiff = cases[-1]["verify"]["peak_rss_mib"] - cases[0]["verify"]["peak_rss_mib"] if ver_ok else None
    result = {
        "benchmark": "convert_memory",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "target_mib": TARGET_DIFF_MIB,
        "to": args.to,
        "runs": args.runs,
        "world_size": args.world_size,
        "tensor_mib": args.tensor_mib,
        "shape": list(shape),
        "manifest_added": not args.no_manifest,
        "ok": conv_ok and ver_ok and not any(c["problems"] for c in cases),
        "convert_rss_difference_mib": round(diff, 1) if diff is not None else None,
        "verify_rss_difference_mib": round(vdiff, 1) if vdiff is not None else None,
        "meets_target": (diff < TARGET_DIFF_MIB) if diff is not None else None,
        "baseline": baseline,
        "machine": machine(),
        "cases": cases,
    }
    md = render_markdown(result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_convert_memory.md").write_text(md)
    (out / "bench_convert_memory.json").write_text(json.dumps(result, indent=2) + "\n")
    print(md)
    print(f"wrote {out / 'bench_convert_memory.md'} and {out / 'bench_convert_memory.json'}", file=sys.stderr)
    if not result["ok"]:
        return 2
    if args.check and not result["meets_target"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
