"""Benchmark (issue 18): the metadata path at frontier scale, against torch's own read_metadata.

For each scale (a Llama-3 flavour at a rank count), builds a metadata-only checkpoint with
:func:`reshard.testing.synthetic_metadata.make_llama_metadata_checkpoint` (the `.metadata` that
``dcp.save`` writes for FSDP2 + AdamW from ``get_state_dict``, checked against real jobs in
``tests/test_synthetic_metadata.py``; sparse data files of the right sizes) in a temporary
directory, then runs, each in a fresh subprocess:

* ``floor``: ``torch.distributed.checkpoint.FileSystemReader(CKPT).read_metadata()`` (what
  any DCP tool must at least pay: the unpickle of `.metadata`);
* ``inspect``: ``reshard inspect CKPT --json --no-profile``;
* ``plan_dp``: ``reshard plan CKPT --to dp_shard=<half> --json --no-profile``;
* ``plan_tp``: ``reshard plan CKPT --to dp_shard=<half>,tp=2 --json --no-profile
  --rules llama-torchtitan --model-config n_heads=.. --model-config n_kv_heads=..``.

Each child's CPU time (user + sys) and peak RSS come from ``os.wait4`` on that child alone
(whole process: interpreter start-up and the torch import included); wall time, exit code
and the size of its stdout (the JSON) are recorded. Ratios are to the floor of the same
scale; the growth law compares each command's CPU time between scales of one model whose
rank counts differ by 4x (a ratio of 4 is linear in the entries).

At a scale whose predicted floor memory (about 2.3 KiB per storage entry, its measured growth
law) exceeds ``--mem-budget`` (default: 85 % of this machine's RAM) the floor is not run and
reshard's commands are compared with its predicted peak; ``--reuse`` keeps each checkpoint in
``--workdir`` and reuses it (a 405B x 16,384 `.metadata` takes minutes to write);
``--max-seconds`` stops a command that runs too long (reported as a timeout) and
``--total-seconds`` stops the benchmark between commands. Should reshard refuse a
`.metadata` (its cap, ``metadata_cap`` in ``reshard/storage/checkpoints/dcp.py``, is the size of the data
it describes; before, a constant 2 GiB), the refusal is reported with reshard's own message, not hidden.

Usage::

    .venv/bin/python scripts/bench_frontier.py                      # the default scales
    .venv/bin/python scripts/bench_frontier.py --scales 8B@64,8B@256,8B@1024,70B@1024 --out bench-results

Outputs (``--out``, default ``bench-results/``): ``bench_frontier.md`` (also printed) and
``bench_frontier.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_SCALES = "8B@64,8B@256,8B@1024,70B@1024,405B@8192,405B@16384,1B@16384"
BYTES_PER_ENTRY = 2.3 * 1024  # torch read_metadata peak RSS per storage entry (70B@1024: 5.0 GB / 2.2 M)
FLOOR_CODE = ("import sys\nfrom torch.distributed.checkpoint import FileSystemReader\n"
              "md = FileSystemReader(sys.argv[1]).read_metadata()\n"
              "print(len(md.state_dict_metadata), len(md.storage_data))\n")
COMMANDS = ("floor", "inspect", "plan_dp", "plan_tp")


def _machine() -> dict:
    import torch

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    return {"commit": commit, "nproc": os.cpu_count(), "ram_gib": round(mem / 2**30, 1), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "loadavg": os.getloadavg()}


def _run(argv: list[str], timeout: float) -> dict:
    """Run argv in a fresh process; CPU, peak RSS (wait4 on it alone), wall, exit code, stdout size."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, cwd=ROOT, start_new_session=True)
        timed_out = False
        while True:
            pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - t0 > timeout:
                os.killpg(proc.pid, signal.SIGKILL)
                pid, status, ru = os.wait4(proc.pid, 0)
                timed_out = True
                break
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - t0
        out.seek(0)
        stdout = out.read()
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    return {"argv": argv, "exit": None if timed_out else proc.returncode, "timeout": timed_out,
            "cpu_s": round(ru.ru_utime + ru.ru_stime, 2), "wall_s": round(wall, 2),
            "peak_rss_mib": round(ru.ru_maxrss / 1024, 1), "stdout_bytes": len(stdout),
            "stdout_head": stdout[:200].decode(errors="replace"), "stderr_tail": stderr[-1500:]}


def _argv(cmd: str, ckpt: Path, ranks: int, cfg) -> list[str]:
    py = sys.executable
    half = max(1, ranks // 2)
    if cmd == "floor":
        return [py, "-c", FLOOR_CODE, str(ckpt)]
    if cmd == "inspect":
        return [py, "-m", "reshard", "inspect", str(ckpt), "--json", "--no-profile"]
    if cmd == "plan_dp":
        return [py, "-m", "reshard", "plan", str(ckpt), "--to", f"dp_shard={half}", "--json", "--no-profile"]
    if cmd == "plan_tp":
        return [py, "-m", "reshard", "plan", str(ckpt), "--to", f"dp_shard={half},tp=2", "--json", "--no-profile",
                "--rules", "llama-torchtitan", "--model-config", f"n_heads={cfg.n_heads}",
                "--model-config", f"n_kv_heads={cfg.n_kv_heads}"]
    raise ValueError(cmd)


def _entries(cfg, ranks: int) -> int:
    """Storage entries of the FSDP2 checkpoint: per sharded tensor its non-empty dim-0 pieces
    (torch.chunk: a tensor of fewer rows than ranks has fewer chunks), plus one per other item."""
    n = 0
    from reshard.testing import synthetic_metadata as sm

    for e in sm.llama_entries(cfg):
        if e.kind == "shard" and e.shape:
            rows = e.shape[0]
            step = -(-rows // ranks)
            n += -(-rows // step)
        else:
            n += 1
    return n


def _fmt_cpu(r: dict | None, floor: dict | None, predicted_gib: float | None = None) -> str:
    if r is None:
        return "-"
    if r.get("skipped"):
        return f"skipped ({r['skipped']})"
    if r["timeout"]:
        return f"timeout > {r['wall_s']:.0f} s"
    s = f"{r['cpu_s']:.1f} s, {r['peak_rss_mib'] / 1024:.2f} GiB"
    if floor and not floor.get("skipped") and floor.get("exit") == 0 and floor["cpu_s"] > 0 and r is not floor:
        s += f" ({r['cpu_s'] / floor['cpu_s']:.2f}x, mem {r['peak_rss_mib'] / floor['peak_rss_mib']:.2f}x)"
    elif floor and floor.get("skipped") and predicted_gib:
        s += f" (mem {r['peak_rss_mib'] / 1024 / predicted_gib:.2f}x the floor's predicted {predicted_gib:.0f} GiB)"
    if r["exit"] != 0:
        s += f", exit {r['exit']}"
    if r is not floor and r["exit"] == 0:
        b = r["stdout_bytes"]
        s += f", {b / 2**20:.1f} MiB JSON" if b >= 2**20 else f", {b / 1024:.0f} KiB JSON"
    return s


def _refusal(r: dict) -> str:
    for line in r.get("stderr_tail", "").splitlines():
        if "metadata" in line.lower() and ("larger" in line.lower() or "refus" in line.lower() or "limit" in line.lower()):
            return line.strip()
    return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scales", default=DEFAULT_SCALES, help="comma-separated MODEL@RANKS (MODEL: 1B, 8B, 70B, 405B)")
    ap.add_argument("--commands", default=",".join(COMMANDS), help=f"subset of {','.join(COMMANDS)}")
    ap.add_argument("--out", default=str(ROOT / "bench-results"))
    ap.add_argument("--workdir", default=None, help="where checkpoints are built (default: a temp dir, removed)")
    ap.add_argument("--mem-budget-gib", type=float, default=None, help="skip scales predicted above (default 85%% of RAM)")
    ap.add_argument("--max-seconds", type=float, default=1200.0, help="per command")
    ap.add_argument("--total-seconds", type=float, default=3600.0, help="stop starting commands after this")
    ap.add_argument("--reuse", action="store_true", help="keep each checkpoint in --workdir and reuse it when present")
    args = ap.parse_args(argv)

    from reshard.testing import synthetic_metadata as sm

    machine = _machine()
    budget = (args.mem_budget_gib or machine["ram_gib"] * 0.85) * 2**30
    commands = [c for c in args.commands.split(",") if c]
    scales = []
    for s in args.scales.split(","):
        model, ranks = s.strip().split("@")
        scales.append((model, int(ranks)))
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-frontier-"))
    t_start = time.monotonic()
    results = []
    try:
        for model, ranks in scales:
            cfg = sm.LLAMA3[model]
            row = {"model": model, "ranks": ranks, "entries_predicted": _entries(cfg, ranks), "runs": {}}
            results.append(row)
            predicted = _entries(cfg, ranks) * BYTES_PER_ENTRY
            row["floor_mem_predicted_gib"] = round(predicted / 2**30, 1)
            floor_skip = None
            if predicted > budget:  # the floor cannot run here; reshard's commands still do (issue 33)
                floor_skip = f"predicted floor peak {predicted / 2**30:.0f} GiB > budget {budget / 2**30:.0f} GiB"
                print(f"{model}@{ranks}: floor not run, {floor_skip}", flush=True)
            if time.monotonic() - t_start > args.total_seconds:
                row["skipped"] = "total time budget used"
                continue
            ckpt = work / f"{model}-{ranks}"
            built = work / f"{model}-{ranks}.build.json"  # beside the checkpoint, not in it
            if args.reuse and built.is_file():  # a 9 GB `.metadata` takes minutes to write: build it once
                row.update(json.loads(built.read_text()), reused=True)
                print(f"{model}@{ranks}: reusing {ckpt}", flush=True)
            else:
                t0 = time.monotonic()
                res = sm.make_llama_metadata_checkpoint(ckpt, model, ranks=ranks)
                facts = dict(build_s=round(time.monotonic() - t0, 1), storage_entries=res.storage_entries,
                             metadata_bytes=res.metadata_bytes, data_bytes=res.data_bytes, keys=res.keys)
                row.update(facts)
                if args.reuse:
                    built.write_text(json.dumps(facts))
            print(f"{model}@{ranks}: {row['storage_entries']:,} entries, .metadata {row['metadata_bytes'] / 2**20:.0f} MiB "
                  f"(built in {row['build_s']} s)", flush=True)
            for cmd in commands:
                if cmd == "floor" and floor_skip:
                    row["runs"][cmd] = {"skipped": floor_skip}
                    continue
                if time.monotonic() - t_start > args.total_seconds:
                    row["runs"][cmd] = {"skipped": "total time budget used"}
                    continue
                r = _run(_argv(cmd, ckpt, ranks, cfg), args.max_seconds)
                why = _refusal(r)
                if why:
                    r["refusal"] = why
                row["runs"][cmd] = r
                print(f"  {cmd:8s} exit {r['exit']} cpu {r['cpu_s']} s wall {r['wall_s']} s "
                      f"rss {r['peak_rss_mib']:.0f} MiB out {r['stdout_bytes']:,} B {why}", flush=True)
            if not args.reuse:
                shutil.rmtree(ckpt, ignore_errors=True)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)

    growth = _growth(results, commands)
    report = {"when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine,
              "command": " ".join([Path(sys.executable).name, "scripts/bench_frontier.py"] + (argv or sys.argv[1:])),
              "scales": results, "growth": growth}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_frontier.json").write_text(json.dumps(report, indent=2, default=str))
    md = _markdown(report, commands)
    (out / "bench_frontier.md").write_text(md)
    print(md)
    return 0


def _growth(results: list[dict], commands: list[str]) -> list[dict]:
    out = []
    ok = {(r["model"], r["ranks"]): r for r in results if not r.get("skipped")}
    for (model, ranks), r in ok.items():
        nxt = ok.get((model, ranks * 4))
        if not nxt:
            continue
        g = {"model": model, "from": ranks, "to": ranks * 4,
             "entries_ratio": round(nxt["storage_entries"] / r["storage_entries"], 2)}
        for c in commands:
            a, b = r["runs"].get(c), nxt["runs"].get(c)
            if a and b and a.get("exit") == 0 and b.get("exit") == 0:
                g[c] = round(b["cpu_s"] / a["cpu_s"], 2)
        out.append(g)
    return out


def _markdown(rep: dict, commands: list[str]) -> str:
    m = rep["machine"]
    lines = [f"Measured {rep['when']} on {m['nproc']} CPUs, {m['ram_gib']} GiB RAM, {m['platform']}, "
             f"Python {m['python']}, torch {m['torch']}, commit `{m.get('commit') or '?'}` at start "
             f"(load average at start {m['loadavg'][0]:.1f}).",
             f"Command: `{rep['command']}`.", "",
             "CPU seconds (user + sys) and peak RSS of each whole process (interpreter start-up and the torch "
             "import included), each in a fresh subprocess; in brackets the ratio to the floor of the same row.", "",
             "| model, ranks | storage entries | `.metadata` | build | " + " | ".join(
                 {"floor": "torch `read_metadata` (floor)", "inspect": "`reshard inspect --json`",
                  "plan_dp": "`reshard plan --to dp_shard=half --json`",
                  "plan_tp": "`plan --to dp_shard=half,tp=2`"}[c] for c in commands) + " |",
             "|---|---:|---:|---:|" + "---|" * len(commands)]
    notes = []
    for r in rep["scales"]:
        name = f"Llama-3-{r['model']}, {r['ranks']:,}"
        if r.get("skipped"):
            lines.append(f"| {name} | {r['entries_predicted'] / 1e6:.1f} M | - | - | " +
                         " | ".join(f"skipped: {r['skipped']}" if i == 0 else "-" for i, _ in enumerate(commands)) + " |")
            continue
        floor = r["runs"].get("floor")
        cells = [_fmt_cpu(r["runs"].get(c), floor, r.get("floor_mem_predicted_gib")) for c in commands]
        lines.append(f"| {name} | {r['storage_entries'] / 1e6:.2f} M | {r['metadata_bytes'] / 2**20:.0f} MiB | "
                     f"{r['build_s']:.0f} s | " + " | ".join(cells) + " |")
        for c in commands:
            run = r["runs"].get(c) or {}
            if run.get("refusal"):
                notes.append(f"- {name}, {c}: refused: {run['refusal']}")
            elif run.get("exit") not in (0, None) or run.get("timeout"):
                tail = (run.get("stderr_tail") or "").strip().splitlines()[-1:] or [""]
                notes.append(f"- {name}, {c}: exit {run.get('exit')}{' (timeout)' if run.get('timeout') else ''}: {tail[0][:300]}")
    if rep["growth"]:
        lines += ["", "Growth (CPU time ratio for 4x the ranks; 4.0 is linear in the entries):", ""]
        for g in rep["growth"]:
            parts = ", ".join(f"{c} {g[c]}x" for c in commands if c in g)
            lines.append(f"- {g['model']} {g['from']:,} -> {g['to']:,} ranks (entries x{g['entries_ratio']}): {parts}")
    if notes:
        lines += ["", "Failures and refusals:", ""] + notes
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
