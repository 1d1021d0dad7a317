"""Benchmark (issue 33): the metadata path without torch, timed as a user starts it.

Issue 33 asks that ``inspect``, ``plan``, ``window``, option and path checks and ``convert --data
link`` import no torch, and sets three targets: an error about a missing path in under 0.3 s,
``convert --data link`` of a 4 GiB checkpoint in under 1 s of wall time past the interpreter's
start, and ``inspect``/``plan`` at 8B x 1,024 ranks next to torch's own ``read_metadata``. The
process start IS the point, so every command runs as a user runs it: ``.venv/bin/reshard ...`` (the
console script next to ``--python``) in a fresh subprocess, wall time from ``time.perf_counter``
around it, CPU time and peak RSS from ``os.wait4`` on that child alone. Sections:

1. **Interpreter start**: ``python -c pass`` and ``python -c "import reshard"``. "Past the
   interpreter's start" below always means minus the median of ``python -c pass``; the
   ``import reshard`` row also says whether torch came with it (``-X importtime``).
2. **Missing-path errors**: ``inspect``, ``plan --to dp=2``, ``convert ... --to dp=2`` and
   ``verify`` of ``/no/such``: wall time, exit code (must be 2: bad input) and the ``error:`` line;
   target: wall < 0.3 s.
3. **Metadata commands** on a small real checkpoint (``reshard.testing.synthetic.make_plain_fsdp2``:
   FSDP2 on 2 gloo ranks, ``dcp.save``): ``inspect``, ``plan --to dp=4``, and ``window`` on two
   step logs the script writes (``formats/step_log.md``; ``window`` reads no checkpoint). Each also
   runs once as ``python -X importtime -m reshard ...``: the cumulative import time of the ``torch``
   line, or "not imported".
4. **``convert --data link``** of a ``--link-gib`` checkpoint (default 4) written by a real
   multi-rank ``dcp.save`` (``reshard.testing.synthetic.make_sharded``: ``--world-size`` gloo ranks,
   ``--tensor-mib`` float32 tensors sharded ``Shard(0)`` as FSDP does, no object items). First
   ``reshard plan SRC --to dp=2 --json``, whose ``data_link`` section says whether link applies
   and how many keys a conversion writes new (0 for this source: nothing is rewritten). Then, in rounds, ``reshard
   convert SRC OUT --to dp=2 --data link --json`` (OUT deleted between runs) next to ``cp -r
   --reflink=auto SRC COPY`` and the same ``&& sync`` (a durable copy): medians, the link's wall
   past the interpreter's start (target < 1 s), and the ratio. One more, untimed, run with
   ``--progress json`` gives the convert's phases (each stderr line stamped on arrival).
5. **Frontier** (``--frontier-scale``, default ``8B@1024``; ``--skip-frontier`` skips it): the
   metadata-only checkpoint of ``scripts/bench_frontier.py`` (the same builder,
   ``reshard.testing.synthetic_metadata.make_llama_metadata_checkpoint``, and its floor program,
   ``bench_frontier.FLOOR_CODE``: torch's ``FileSystemReader(CKPT).read_metadata()``), then
   ``inspect --json --no-profile`` and ``plan --to dp_shard=<half> --json --no-profile``: medians
   of wall, CPU and peak RSS, the ratio to the floor, and whether torch was imported.

Every section runs ``--runs`` rounds (default 3; each round runs each command of the section once,
so a slow spell of this shared machine falls on all of them) and reports medians. The page cache is
left warm (the sources were just written; nothing here reads tensor bytes except ``cp``).

The checkpoints are built in child processes and this process never imports torch: on Linux a
child's ``ru_maxrss`` starts from its parent's high-water mark (``subprocess`` forks, exec keeps the
mark), so a parent holding torch would hide a child's small peak; the launcher's own peak is
reported as the floor of every peak RSS here.

Usage::

    .venv/bin/python scripts/bench_metadata_path.py                       # 4 GiB link source, 8B x 1,024
    .venv/bin/python scripts/bench_metadata_path.py --link-gib 0.5 --skip-frontier   # a quick check

Outputs (``--out``, default ``bench-results/``): ``bench_metadata_path.md`` (also printed) and
``bench_metadata_path.json`` (every run). Exit 2 if a checkpoint could not be built or a command
that must succeed failed, 0 otherwise (with ``--check``: 1 when a target is missed).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from importlib import metadata as pkg_metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ is not a package

from bench_convert_memory import GIB, MIB, tensor_shape  # noqa: E402  (stdlib-only module top)
from bench_frontier import FLOOR_CODE  # noqa: E402  torch's read_metadata, the floor of the frontier table

ERROR_TARGET_S = 0.3   # missing-path error, whole wall time
LINK_TARGET_S = 1.0    # convert --data link, wall past the interpreter's start
MISSING = "/no/such"

BUILD_FSDP2 = "import sys\nfrom reshard.testing.synthetic import make_plain_fsdp2\nmake_plain_fsdp2(sys.argv[1], 2)\n"
BUILD_SHARDED = ("import sys\nfrom reshard.testing.synthetic import make_sharded\n"
                 "make_sharded(sys.argv[1], world_size=int(sys.argv[2]), n_tensors=int(sys.argv[3]),"
                 " shape=(int(sys.argv[4]), int(sys.argv[5])), timeout=3600.0)\n")
BUILD_FRONTIER = ("import json, sys\nfrom reshard.testing.synthetic_metadata import make_llama_metadata_checkpoint\n"
                  "r = make_llama_metadata_checkpoint(sys.argv[1], sys.argv[2], ranks=int(sys.argv[3]))\n"
                  "print(json.dumps({'storage_entries': r.storage_entries, 'metadata_bytes': r.metadata_bytes,"
                  " 'data_bytes': r.data_bytes, 'keys': r.keys}))\n")


# ------------------------------------------------------------------------- running
def run(argv: list[str], *, cwd: Path, timeout: float, env: dict | None = None) -> dict:
    """Run argv in a fresh process: wall, CPU (user + sys) and peak RSS of that child alone, exit code, output."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(argv, stdout=out, stderr=err, cwd=cwd, env=env)
        killer = threading.Timer(timeout, p.kill)
        killer.start()
        try:
            _, status, ru = os.wait4(p.pid, 0)
        finally:
            killer.cancel()
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)  # so Popen does not wait again
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    return {"argv": argv, "exit": p.returncode, "timed_out": p.returncode < 0 and wall >= timeout,
            "wall_s": round(wall, 4), "cpu_s": round(ru.ru_utime + ru.ru_stime, 3),
            "peak_rss_mib": round(ru.ru_maxrss / 1024, 1), "stdout": stdout, "stderr": stderr}


def torch_import_s(stderr: str) -> float | None:
    """Cumulative import time of the top-level ``torch`` line of ``-X importtime`` output, None if absent."""
    for line in stderr.splitlines():
        if line.startswith("import time:"):
            parts = line.split("|")
            if len(parts) == 3 and parts[2].strip() == "torch" and parts[1].strip().isdigit():
                return int(parts[1]) / 1e6
    return None


def error_line(stderr: str) -> str:
    lines = [x.strip(" \t\u2502\u256d\u256e\u2570\u256f\u2500") for x in stderr.splitlines()]
    lines = [x for x in lines if x and not x.startswith("import time:")]
    hit = next((x for x in lines if x.startswith("error:")), None)
    return (hit or " | ".join(lines[-3:]))[:400]


def med(runs: list[dict], field: str = "wall_s") -> float | None:
    vals = [r[field] for r in runs if r.get(field) is not None]
    return statistics.median(vals) if vals else None


def summary(runs: list[dict], ok: tuple[int, ...] | None = None) -> dict:
    """Medians over the runs whose exit code is in ``ok`` (all runs when ``ok`` is None or none is):
    a run that failed measures the failure, not the command; ``n_ok`` says how many counted."""
    good = [r for r in runs if ok is None or r["exit"] in ok] or runs
    return {"median_wall_s": med(good), "min_wall_s": min(r["wall_s"] for r in good),
            "max_wall_s": max(r["wall_s"] for r in good), "median_cpu_s": med(good, "cpu_s"),
            "median_peak_rss_mib": med(good, "peak_rss_mib"), "exits": [r["exit"] for r in runs],
            "n_ok": len([r for r in runs if ok is None or r["exit"] in ok])}


def rounds(cmds: dict[str, list[str]], n: int, *, cwd: Path, timeout: float, before=None) -> dict:
    """Run every command once per round, ``n`` rounds; ``before(name)`` runs untimed before each run."""
    out: dict[str, list[dict]] = {k: [] for k in cmds}
    for i in range(n):
        for name, argv in cmds.items():
            if before:
                before(name)
            r = run(argv, cwd=cwd, timeout=timeout)
            out[name].append(r)
            print(f"  [{i + 1}/{n}] {name}: {r['wall_s']:.3f} s, exit {r['exit']}, "
                  f"rss {r['peak_rss_mib']:.0f} MiB", file=sys.stderr, flush=True)
    return out


def build(code: str, args: list[str], *, py: str, cwd: Path, what: str, problems: list[str]) -> dict | None:
    """Build a checkpoint in a child process (this process never imports torch)."""
    print(f"building {what} ...", file=sys.stderr, flush=True)
    r = run([py, "-c", code, *args], cwd=cwd, timeout=7200.0)
    if r["exit"] != 0:
        problems.append(f"building {what}: exit {r['exit']}: {error_line(r['stderr'])}")
        return None
    print(f"  built in {r['wall_s']:.1f} s", file=sys.stderr, flush=True)
    return r


def strip(runs: dict[str, list[dict]]) -> None:
    """Keep the JSON small: no outputs of timed runs past their first lines."""
    for rs in runs.values():
        for r in rs:
            r["stdout"] = r["stdout"][:300]
            r["stderr"] = error_line(r["stderr"]) if r["stderr"] else ""


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def clear(path: Path) -> None:
    """Remove ``path`` and whatever a failed conversion left beside it (``.NAME*`` temporaries)."""
    shutil.rmtree(path, ignore_errors=True)
    for p in path.parent.glob(f".{path.name}*"):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


# ------------------------------------------------------------------------- sections
def section_start(a, cwd: Path) -> dict:
    py = a.python
    cmds = {"python -c pass": [py, "-c", "pass"], "python -c 'import reshard'": [py, "-c", "import reshard"]}
    rs = rounds(cmds, a.runs, cwd=cwd, timeout=a.timeout)
    it = run([py, "-X", "importtime", "-c", "import reshard"], cwd=cwd, timeout=a.timeout)
    strip(rs)
    res = {k: summary(v) | {"runs": v} for k, v in rs.items()}
    res["python -c 'import reshard'"]["torch_import_s"] = torch_import_s(it["stderr"])
    return res


def section_errors(a, cwd: Path, small: Path | None) -> dict:
    rsh = a.reshard
    other = str(small) if small else MISSING + "-b"  # verify: the other side exists, so the error is about A
    cmds = {"inspect": [rsh, "inspect", MISSING],
            "plan --to dp=2": [rsh, "plan", MISSING, "--to", "dp=2"],
            "convert --to dp=2": [rsh, "convert", MISSING, str(cwd / "err-out"), "--to", "dp=2"],
            "verify": [rsh, "verify", MISSING, other]}
    rs = rounds(cmds, a.runs, cwd=cwd, timeout=a.timeout)
    out = {}
    for k, v in rs.items():
        line = error_line(v[0]["stderr"])
        it = run([a.python, "-X", "importtime", "-m", "reshard", *cmds[k][1:]], cwd=cwd, timeout=a.timeout)
        strip({k: v})
        out[k] = summary(v) | {"error": line, "torch_import_s": torch_import_s(it["stderr"]), "runs": v}
    return out


def write_step_logs(d: Path) -> tuple[Path, Path]:
    """Two step logs (``formats/step_log.md``): 8 steps on 4 ranks, then 6 on 2, one smooth loss curve."""
    def rec(step: int, ws: int) -> str:
        return json.dumps({"step": step, "loss": round(4.0 * 0.97 ** step, 6), "grad_norm": 1.0, "lr": 1e-3,
                           "tokens_per_s": 1000.0, "world_size": ws}) + "\n"
    before, after = d / "before.jsonl", d / "after.jsonl"
    before.write_text("".join(rec(s, 4) for s in range(1, 9)))
    after.write_text("".join(rec(s, 2) for s in range(9, 15)))
    return before, after


def section_metadata(a, cwd: Path, small: Path, problems: list[str]) -> dict:
    before, after = write_step_logs(cwd)
    argvs = {"inspect": ["inspect", str(small), "--no-profile"],
             "plan --to dp=4": ["plan", str(small), "--to", "dp=4", "--no-profile"],
             "window": ["window", str(before), str(after), "--out", str(cwd / "window-out")]}
    rs = rounds({k: [a.reshard, *v] for k, v in argvs.items()}, a.runs, cwd=cwd, timeout=a.timeout)
    out = {}
    for k, v in argvs.items():
        it = run([a.python, "-X", "importtime", "-m", "reshard", *v], cwd=cwd, timeout=a.timeout)
        line = error_line(rs[k][0]["stderr"]) if rs[k][0]["exit"] not in (0, 1) else ""
        if line:
            problems.append(f"reshard {k}: exit {rs[k][0]['exit']}: {line}")
        strip({k: rs[k]})
        out[k] = summary(rs[k], (0, 1)) | {"torch_import_s": torch_import_s(it["stderr"]), "importtime_exit": it["exit"],
                                   "error": line, "runs": rs[k]}
    shutil.rmtree(cwd / "window-out", ignore_errors=True)
    return out


def section_link(a, cwd: Path, problems: list[str]) -> dict | None:
    rows, cols = tensor_shape(a.tensor_mib)
    n = max(1, round(a.link_gib * GIB / (rows * cols * 4)))
    src = cwd / "link-src"
    b = build(BUILD_SHARDED, [str(src), str(a.world_size), str(n), str(rows), str(cols)], py=a.python, cwd=cwd,
              what=f"the link source: {n} float32 tensors of {rows}x{cols} on {a.world_size} ranks", problems=problems)
    if b is None:
        return None
    res: dict = {"n_tensors": n, "shape": [rows, cols], "world_size": a.world_size, "build_s": b["wall_s"],
                 "bytes_on_disk": dir_bytes(src), "files": len([p for p in src.iterdir() if p.is_file()])}
    # plan has no --data option: its JSON always carries the data_link section (available or why not)
    p = run([a.reshard, "plan", str(src), "--to", "dp=2", "--json", "--no-profile"], cwd=cwd, timeout=a.timeout)
    try:
        dl = json.loads(p["stdout"]).get("data_link") if p["exit"] == 0 else None
    except json.JSONDecodeError:
        dl = None
    if dl is None:
        res["plan"] = {"available": None, "error": error_line(p["stderr"])}
        problems.append(f"plan SRC --to dp=2 --json: exit {p['exit']}: {error_line(p['stderr'])}")
    else:
        res["plan"] = {k: dl.get(k) for k in ("available", "reasons", "shared_files", "shared_bytes", "linked_keys",
                                              "new_keys")}
    out, copy = cwd / "link-out", cwd / "link-copy"
    cmds = {"convert --data link": [a.reshard, "convert", str(src), str(out), "--to", "dp=2", "--data", "link",
                                    "--json", "--no-profile"],
            "cp -r --reflink=auto": ["cp", "-r", "--reflink=auto", str(src), str(copy)],
            "cp -r --reflink=auto && sync": ["sh", "-c", 'cp -r --reflink=auto "$0" "$1" && sync', str(src), str(copy)]}

    def before(name: str) -> None:
        clear(out)
        clear(copy)
        os.sync()  # the previous copy's dirty pages are not this run's cost

    rs = rounds(cmds, a.runs, cwd=cwd, timeout=a.timeout, before=before)
    reports = []
    for i, r in enumerate(rs["convert --data link"]):
        try:
            rep = json.loads(r["stdout"]) if r["exit"] == 0 else None
        except json.JSONDecodeError:
            rep = None
        if rep is None:
            problems.append(f"convert --data link, run {i + 1}: exit {r['exit']}: {error_line(r['stderr'])}")
            continue
        d = rep.get("data") or {}
        reports.append({"seconds": rep.get("seconds"), "bytes_written": rep.get("bytes_written"),
                        "method": d.get("method"), "written_keys": d.get("written_keys"),
                        "linked_tensors": d.get("linked_tensors"), "linked_objects": d.get("linked_objects"),
                        "verified_equal": (rep.get("verification") or {}).get("equal")})
    strip(rs)
    res["runs"] = {k: summary(v, (0,)) | {"runs": v} for k, v in rs.items()}
    res["convert_reports"] = reports
    clear(out)
    clear(copy)
    res["timeline"] = timeline(a, src, out, cwd)
    it = run([a.python, "-X", "importtime", "-m", "reshard", *cmds["convert --data link"][1:]], cwd=cwd,
             timeout=a.timeout)
    res["torch_import_s"] = torch_import_s(it["stderr"])
    clear(out)
    if not a.keep:
        shutil.rmtree(src, ignore_errors=True)
    return res


def timeline(a, src: Path, out: Path, cwd: Path) -> list[dict]:
    """One untimed ``convert --data link --progress json``: each stderr line stamped when it arrives."""
    argv = [a.reshard, "convert", str(src), str(out), "--to", "dp=2", "--data", "link", "--progress", "json",
            "--no-profile"]
    events = []
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=cwd, text=True)
    for line in p.stderr:
        t = time.perf_counter() - t0
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            ev = {"event": "text", "text": line.strip()[:200]}
        label = ev.get("text") or f"{ev.get('event')} {ev.get('phase')} ({ev.get('step')})"
        events.append({"at_s": round(t, 3), "event": label, "elapsed_s": ev.get("elapsed_s")})
    code = p.wait()
    events.append({"at_s": round(time.perf_counter() - t0, 3), "event": f"exit {code}", "elapsed_s": None})
    return events


def section_frontier(a, cwd: Path, problems: list[str]) -> dict | None:
    model, ranks = a.frontier_scale.split("@")
    ranks = int(ranks)
    ckpt = cwd / f"frontier-{model}-{ranks}"
    b = build(BUILD_FRONTIER, [str(ckpt), model, str(ranks)], py=a.python, cwd=cwd,
              what=f"the {model} x {ranks:,} metadata-only checkpoint", problems=problems)
    if b is None:
        return None
    res: dict = {"model": model, "ranks": ranks, "build_s": b["wall_s"]}
    try:
        res.update(json.loads(b["stdout"].strip().splitlines()[-1]))
    except (json.JSONDecodeError, IndexError):
        pass
    half = max(1, ranks // 2)
    argvs = {"torch read_metadata (floor)": None,
             "inspect --json": ["inspect", str(ckpt), "--json", "--no-profile"],
             f"plan --to dp_shard={half} --json": ["plan", str(ckpt), "--to", f"dp_shard={half}", "--json",
                                                   "--no-profile"]}
    cmds = {k: ([a.python, "-c", FLOOR_CODE, str(ckpt)] if v is None else [a.reshard, *v]) for k, v in argvs.items()}
    rs = rounds(cmds, a.runs, cwd=cwd, timeout=a.timeout)
    for k, v in rs.items():
        if any(r["exit"] != 0 for r in v):
            problems.append(f"frontier {k}: exits {[r['exit'] for r in v]}: {error_line(v[0]['stderr'])}")
    strip(rs)
    res["runs"] = {k: summary(v, (0,)) | {"runs": v} for k, v in rs.items()}
    for k, v in argvs.items():
        if v is not None and not a.no_importtime_frontier:
            it = run([a.python, "-X", "importtime", "-m", "reshard", *v], cwd=cwd, timeout=a.timeout)
            res["runs"][k]["torch_import_s"] = torch_import_s(it["stderr"])
    if not a.keep:
        shutil.rmtree(ckpt, ignore_errors=True)
    return res


# ------------------------------------------------------------------------- report
def machine(cwd: Path) -> dict:
    def version(name: str) -> str:
        try:
            return pkg_metadata.version(name)
        except pkg_metadata.PackageNotFoundError:
            return "not installed"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    fs = subprocess.run(["stat", "-f", "-c", "%T", str(cwd)], capture_output=True, text=True).stdout.strip()
    return {"commit": commit + ("+uncommitted changes" if dirty else ""), "nproc": os.cpu_count(),
            "ram_gib": round(mem / GIB, 1), "platform": platform.platform(), "python": platform.python_version(),
            "torch": version("torch"), "reshard": version("reshard"), "workdir_fs": fs or "?"}


def fmt(x: float | None, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def torch_cell(s: float | None) -> str:
    return "not imported" if s is None else f"imported ({s:.2f} s cumulative)"


def pf(ok: bool | None) -> str:
    return "not judged" if ok is None else ("**PASS**" if ok else "**FAIL**")


def judge(rep: dict) -> dict:
    t: dict = {}
    errs = rep.get("errors") or {}
    if errs:
        t["errors_exit_2"] = all(all(x == 2 for x in v["exits"]) for v in errs.values())
        t["errors_lt_0.3s"] = all(v["median_wall_s"] < ERROR_TARGET_S for v in errs.values())
    link = rep.get("link")
    if link and "runs" in link:
        r = link["runs"]["convert --data link"]
        ok = all(x == 0 for x in r["exits"])  # a failed run is not judged: it measured the failure
        t["link_lt_1s_past_start"] = (r["median_wall_s"] - rep["start_s"] < LINK_TARGET_S) if ok else None
    return t


def markdown(rep: dict) -> str:
    m, s0 = rep["machine"], rep["start_s"]
    L = [f"Measured {rep['when']} on {m['nproc']} CPUs, {m['ram_gib']} GiB RAM, {m['platform']}, Python {m['python']}, "
         f"torch {m['torch']}, commit `{m['commit']}`; load average {rep['loadavg_start']:.2f} at the start, "
         f"{rep['loadavg_end']:.2f} at the end"
         + (" (above the CPU count: other work competed, the timings are noisy)"
            if max(rep["loadavg_start"], rep["loadavg_end"]) > m["nproc"] else "") + ".",
         f"Command: `{rep['command']}`. Medians of {rep['runs']} runs in rounds; warm page cache; work directory on "
         f"{m['workdir_fs']}. Peak RSS is `ru_maxrss` of the child (at least the launcher's {rep['launcher_rss_mib']:.0f} MiB).",
         "", "**Interpreter start**", "", "| command | median wall (s) | min-max (s) | peak RSS (MiB) | torch |",
         "|---|---:|---:|---:|---|"]
    for k, v in rep["start"].items():
        torch = torch_cell(v.get("torch_import_s")) if "torch_import_s" in v else "-"
        L.append(f"| `{k}` | {fmt(v['median_wall_s'])} | {fmt(v['min_wall_s'])}-{fmt(v['max_wall_s'])} | "
                 f"{v['median_peak_rss_mib']:.0f} | {torch} |")
    L += ["", f"\"Past start\" below: minus the median of `python -c pass` ({s0:.3f} s).", "",
          f"**Missing path** (`{MISSING}`; target: wall < {ERROR_TARGET_S} s, exit 2)", "",
          "| command | exit codes | median wall (s) | past start (s) | peak RSS (MiB) | torch | error line |",
          "|---|---|---:|---:|---:|---|---|"]
    for k, v in rep["errors"].items():
        L.append(f"| `reshard {k}` | {', '.join(map(str, v['exits']))} | {fmt(v['median_wall_s'])} | "
                 f"{fmt(v['median_wall_s'] - s0)} | {v['median_peak_rss_mib']:.0f} | {torch_cell(v['torch_import_s'])} | "
                 f"{v['error'].replace('|', '/')} |")
    md = rep.get("metadata")
    if md:
        L += ["", "**Metadata commands** (`make_plain_fsdp2`: FSDP2 on 2 gloo ranks, `dcp.save`; `window` on two "
              "step logs of 8 + 6 steps)", "",
              "| command | exit codes | median wall (s) | past start (s) | peak RSS (MiB) | torch (`-X importtime`) |",
              "|---|---|---:|---:|---:|---|"]
        for k, v in md.items():
            L.append(f"| `reshard {k}` | {', '.join(map(str, v['exits']))} | {fmt(v['median_wall_s'])} | "
                     f"{fmt(v['median_wall_s'] - s0)} | {v['median_peak_rss_mib']:.0f} | {torch_cell(v['torch_import_s'])} |")
    lk = rep.get("link")
    if lk and "runs" in lk:
        pl = lk.get("plan") or {}
        L += ["", f"**`convert --data link`** of {lk['bytes_on_disk'] / GIB:.2f} GiB ({lk['n_tensors']} float32 tensors "
              f"{lk['shape'][0]}x{lk['shape'][1]}, `Shard(0)` on {lk['world_size']} ranks, {lk['files']} files; "
              f"built in {lk['build_s']:.0f} s); plan: link available {pl.get('available')}, "
              f"{pl.get('linked_keys')} keys linked, {pl.get('new_keys')} written new"
              + (f" ({'; '.join(pl.get('reasons') or [])})" if pl.get("reasons") else "")
              + ". Medians and min-max over the runs that exited 0; `x link`: median wall over the link's.", "",
              "| command | exit codes | median wall (s) | min-max (s) | past start (s) | peak RSS (MiB) | x link |",
              "|---|---|---:|---:|---:|---:|---:|"]
        lm = lk["runs"]["convert --data link"]["median_wall_s"]
        for k, v in lk["runs"].items():
            L.append(f"| `{'reshard ' if k.startswith('convert') else ''}{k}` | {', '.join(map(str, v['exits']))} | "
                     f"{fmt(v['median_wall_s'])} | {fmt(v['min_wall_s'])}-{fmt(v['max_wall_s'])} | "
                     f"{fmt(v['median_wall_s'] - s0)} | {v['median_peak_rss_mib']:.0f} | "
                     f"{v['median_wall_s'] / lm:.2f} |")
        reps = lk.get("convert_reports") or []
        if reps:
            r0 = reps[0]
            secs = [r["seconds"] for r in reps if r["seconds"] is not None]
            L += ["", f"The convert's own report: `seconds` (after the plan, up to the commit) median "
                  f"{fmt(statistics.median(secs) if secs else None)}; shared by {r0['method']}, "
                  f"{r0['linked_tensors']} tensors and {r0['linked_objects']} objects linked, {r0['written_keys']} keys "
                  f"written, {r0['bytes_written']} bytes of items written, verified equal: "
                  f"{all(r['verified_equal'] for r in reps)}; torch: {torch_cell(lk.get('torch_import_s'))}."]
        tl = lk.get("timeline") or []
        if tl:
            L += ["", "Phases of one more run (`--progress json`, each stderr line stamped on arrival; "
                  "`elapsed_s` as the tool reports it):", "", "| at (s) | event | elapsed_s |", "|---:|---|---:|"]
            L += [f"| {e['at_s']:.3f} | {e['event']} | {fmt(e['elapsed_s'])} |" for e in tl]
    fr = rep.get("frontier")
    if fr and "runs" in fr:
        floor = fr["runs"]["torch read_metadata (floor)"]
        L += ["", f"**Frontier**: Llama-3-{fr['model']} x {fr['ranks']:,} ranks, metadata only "
              f"({fr.get('storage_entries', 0):,} storage entries, `.metadata` {fr.get('metadata_bytes', 0) / MIB:.0f} MiB, "
              f"built in {fr['build_s']:.0f} s)", "",
              "| command | exit codes | median wall (s) | median CPU (s) | median peak RSS (MiB) | x floor (CPU, RSS) | torch |",
              "|---|---|---:|---:|---:|---|---|"]
        for k, v in fr["runs"].items():
            ratio = "-" if v is floor else (f"{v['median_cpu_s'] / floor['median_cpu_s']:.2f}x, "
                                            f"{v['median_peak_rss_mib'] / floor['median_peak_rss_mib']:.2f}x")
            torch = "imported (it is torch's reader)" if v is floor else (
                torch_cell(v["torch_import_s"]) if "torch_import_s" in v else "not checked")
            name = "torch `FileSystemReader(CKPT).read_metadata()` (floor)" if v is floor else f"`reshard {k}`"
            L.append(f"| {name} | {', '.join(map(str, v['exits']))} | "
                     f"{fmt(v['median_wall_s'], 2)} | {fmt(v['median_cpu_s'], 2)} | {v['median_peak_rss_mib']:,.0f} | "
                     f"{ratio} | {torch} |")
    t = rep["targets"]
    L += ["", "Targets:", ""]
    if "errors_exit_2" in t:
        L.append(f"- every missing-path error exits 2: {pf(t['errors_exit_2'])}")
        worst = max(v["median_wall_s"] for v in rep["errors"].values())
        L.append(f"- every missing-path error < {ERROR_TARGET_S} s wall: {pf(t['errors_lt_0.3s'])} (slowest median {worst:.3f} s)")
    if "link_lt_1s_past_start" in t:
        lm = lk["runs"]["convert --data link"]["median_wall_s"]
        cs = lk["runs"]["cp -r --reflink=auto && sync"]["median_wall_s"]
        n, n_ok = len(lk["runs"]["convert --data link"]["exits"]), lk["runs"]["convert --data link"]["n_ok"]
        L.append(f"- `convert --data link` of {lk['bytes_on_disk'] / GIB:.2f} GiB < {LINK_TARGET_S:g} s past the "
                 f"interpreter's start: {pf(t['link_lt_1s_past_start'])} ({lm:.3f} - {s0:.3f} = {lm - s0:.3f} s"
                 + (f" over the {n_ok} of {n} runs that succeeded" if n_ok < n else "")
                 + f"; a durable `cp -r --reflink=auto && sync` took {cs:.3f} s, {cs / lm:.2f}x the link's wall)")
    if rep["problems"]:
        L += ["", "Problems:", ""] + [f"- {p}" for p in rep["problems"]]
    return "\n".join(L) + "\n"


# ------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench-results"))
    ap.add_argument("--runs", type=int, default=3, help="rounds per section; medians (default 3)")
    ap.add_argument("--link-gib", type=float, default=4.0, help="size of the --data link source (default 4)")
    ap.add_argument("--tensor-mib", type=float, default=256.0, help="float32 tensors of the link source (default 256)")
    ap.add_argument("--world-size", type=int, default=4, help="ranks that write the link source (default 4)")
    ap.add_argument("--frontier-scale", default="8B@1024", help="MODEL@RANKS of bench_frontier.py (default 8B@1024)")
    ap.add_argument("--skip-frontier", action="store_true")
    ap.add_argument("--skip-link", action="store_true")
    ap.add_argument("--no-importtime-frontier", action="store_true",
                    help="skip the extra -X importtime run of inspect and plan at frontier scale")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--reshard", default=None, help="the console script (default: `reshard` beside --python)")
    ap.add_argument("--tmp", default=None, help="parent of the work directory (default: the system's temp dir)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="per command")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    a = ap.parse_args(argv)
    if a.runs < 1 or a.link_gib <= 0:
        ap.error("--runs must be >= 1 and --link-gib > 0")
    if not re.fullmatch(r"\w+@\d+", a.frontier_scale):
        ap.error("--frontier-scale is MODEL@RANKS, e.g. 8B@1024")
    a.reshard = a.reshard or str(Path(a.python).with_name("reshard"))
    if not os.access(a.reshard, os.X_OK):
        ap.error(f"no reshard console script at {a.reshard} (pip install -e . into that environment, or --reshard PATH)")
    load_start = os.getloadavg()[0]
    t_all = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench-metadata-path-", dir=a.tmp))
    problems: list[str] = []
    rep: dict = {"benchmark": "metadata_path", "when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 "command": " ".join(["python", "scripts/bench_metadata_path.py"] + (argv if argv is not None else sys.argv[1:])),
                 "runs": a.runs, "machine": machine(work), "loadavg_start": load_start, "problems": problems}
    try:
        print("interpreter start ...", file=sys.stderr, flush=True)
        rep["start"] = section_start(a, work)
        rep["start_s"] = rep["start"]["python -c pass"]["median_wall_s"]
        small = work / "fsdp2-2"
        have_small = build(BUILD_FSDP2, [str(small)], py=a.python, cwd=work, what="the FSDP2 checkpoint (2 ranks)",
                           problems=problems) is not None
        print("missing-path errors ...", file=sys.stderr, flush=True)
        rep["errors"] = section_errors(a, work, small if have_small else None)
        if have_small:
            print("metadata commands ...", file=sys.stderr, flush=True)
            rep["metadata"] = section_metadata(a, work, small, problems)
        if not a.skip_link:
            rep["link"] = section_link(a, work, problems)
        if not a.skip_frontier:
            rep["frontier"] = section_frontier(a, work, problems)
    finally:
        if a.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    import resource

    rep["launcher_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rep["loadavg_end"] = os.getloadavg()[0]
    rep["total_s"] = round(time.perf_counter() - t_all, 1)
    rep["targets"] = judge(rep)
    md = markdown(rep) + f"\nWhole benchmark: {rep['total_s']:.0f} s.\n"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_metadata_path.md").write_text(md)
    (out / "bench_metadata_path.json").write_text(json.dumps(rep, indent=2, default=str) + "\n")
    print(md)
    print(f"wrote {out / 'bench_metadata_path.md'} and {out / 'bench_metadata_path.json'}", file=sys.stderr)
    if problems:
        return 2
    return 1 if a.check and not all(rep["targets"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
