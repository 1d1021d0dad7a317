"""Benchmark (issue 46, part 4): a conversion streamed into object storage by 1, 2 and 4 workers, against the naive route.

Issue 46 asks how the distributed conversion into a store scales and what each worker needs: its
throughput, its peak memory and its peak local disk (which must stay near ``--buffer-memory``, not
grow with the checkpoint), and how it compares with what a user does without it (convert locally,
then upload; from a store: download everything first). So each round runs, every command in a fresh
subprocess, rows interleaved (A, B, C, ..., A, B, C, ...):

- **local -> store, 1 worker**: ``reshard convert LOCAL s3://bucket/dst --to dp=N`` (the single-process
  store path: the whole output staged on local disk, then uploaded);
- **local -> store, 2 and 4 workers**: the same with ``--workers 2`` / ``--workers 4`` (torchrun inside the
  command; each worker streams its own files as multipart uploads from a spill folder);
- **store -> store, 1 worker**: ``reshard convert s3://bucket/src s3://bucket/dst --to dp=N``;
- **store -> store, 2 and 4 workers** (``--store-workers``, when the store source takes ``--workers``);
- **naive route**: ``reshard convert LOCAL OUT`` then a child that uploads ``OUT`` with boto3's
  ``upload_file`` on 8 threads (local -> store), and, for store -> store, a child that first downloads
  the source prefix with fsspec/s3fs (``fs.get(recursive=True)``, what ``aws s3 cp --recursive`` does):
  download + the same round's convert + upload.

How each figure is measured:

- wall: the child's, from start to exit; **client CPU**: user + sys of the command and every process
  it started and reaped (``os.wait4`` of the command: the kernel adds the reaped children's times, so
  torchrun's workers are counted);
- **per-worker peak RSS and CPU**: a thread polls the command's process tree every ``--poll`` seconds
  (``/proc/PID/task/*/children``); a process whose environment has torchrun's ``RANK`` is a worker;
  its ``VmHWM`` (the kernel's own peak RSS) and utime + stime (``/proc/PID/stat``) as last seen before it
  exited. For the 1-worker rows the command itself is the worker;
- **per-worker peak local disk**: the report's ``streamed.workers[i].peak_bytes`` (the worker's own
  measure) and this script's poll of the staging folder (``RESHARD_STAGING_DIR``; allocated blocks,
  ``st_blocks * 512``, of each ``spill-<rank>`` folder, or of the whole folder for the 1-worker path,
  which stages the output); for the naive route, the output's size on disk (and the download's). A store
  source is also staged per worker in ``$TMPDIR`` (its `.metadata` and a read cache of fetched ranges, kept
  for the verification): the commands run with ``TMPDIR`` set to a folder of their own, and each
  ``reshard-remote-*`` folder in it is polled the same way;
- **server CPU**: moto runs in a child process of its own (``bench_s3.Server``) on the same 2 CPUs;
  its utime + stime (``/proc/PID/stat``) while each command ran. A real store spends that elsewhere.
- the load average (1 min) before and after each command.

Every store output of the first round is compared object by object (sha256 of ``.metadata`` and the
``.distcp`` objects) with the local conversion's files.

The checkpoint: a real ``dcp.save`` on ``--ranks`` gloo ranks (``reshard.testing.synthetic.make_sharded``,
``Shard(0)`` as FSDP2), ``--tensors`` float32 tensors of ``--shape`` (default 8 ranks x 32 x
4096x2048: 1.0 GiB), built once into ``--work`` and reused by later runs; converted ``--to dp=<ranks/2>``
with ``--buffer-memory`` (default 256MiB).

Usage::

    PYTHONPATH=. .venv/bin/python scripts/bench_store_workers.py --runs 2
    PYTHONPATH=. .venv/bin/python scripts/bench_store_workers.py --quick      # 4 ranks x 4 x 1024x1024, 1 round

Writes ``bench_store_workers.md`` (also printed) and ``bench_store_workers.json`` into ``--out``. Exit 2
if the checkpoint could not be built or uploaded, a measured command failed or an output differs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ is not a package

from bench_metadata_path import clear, error_line, machine  # noqa: E402
from bench_s3 import (BUCKET, BUILD_SHARDED, DOWNLOAD_CODE, GIB, MIB, UPLOAD_CODE, Server, build, digest_outputs,  # noqa: E402
                      upload)
from bench_store import DIGEST_CODE, EMPTY_CODE, helper, report_head, write_results  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")

#: ``reshard-report.json`` of a store output, printed as JSON (the run's own measures of its workers).
REPORT_CODE = r"""
import sys
import boto3
bucket, prefix = sys.argv[1], sys.argv[2].strip("/")
c = boto3.client("s3", region_name="us-east-1")
print(c.get_object(Bucket=bucket, Key=prefix + "/reshard-report.json")["Body"].read().decode())
"""


# ------------------------------------------------------------------ the process tree and the disk, polled
def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for t in os.listdir(f"/proc/{pid}/task"):
            try:
                out += [int(x) for x in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]
            except OSError:
                pass
    except OSError:
        pass
    return out


def tree(pid: int) -> list[int]:
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += children(p)
    return seen


def proc_facts(pid: int) -> dict | None:
    """utime + stime, VmHWM and torchrun's RANK (None where the process is not a worker) of ``pid``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        status = Path(f"/proc/{pid}/status").read_text()
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    hwm = 0
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) * 1024
    rank = None
    for e in env:
        if e.startswith(b"RANK="):
            rank = int(e[5:])
    return {"cpu_s": (int(stat[11]) + int(stat[12])) / TICK, "peak_rss": hwm, "rank": rank}


def disk_now(staging: Path, tmp: Path | None = None) -> dict[str, int]:
    """Allocated bytes now: each ``spill-<rank>`` folder under ``staging`` and ``all`` of ``staging``; under
    ``tmp`` (the commands' ``TMPDIR``) each ``reshard-remote-*`` folder (a store source's `.metadata` and its
    read cache, one per worker) and ``tmp`` (all of it)."""
    out: dict[str, int] = {"all": 0}
    for root, whole in ((staging, "all"), (tmp, "tmp")):
        if root is None or not root.exists():
            continue
        out[whole] = 0
        for p in root.rglob("*"):
            try:
                if p.is_file():
                    n = p.stat().st_blocks * 512
                    out[whole] += n
                    rel = p.relative_to(root).parts
                    if p.parent.name.startswith(("spill-", "reads-")):  # a worker's spill folder, its read window
                        out[p.parent.name] = out.get(p.parent.name, 0) + n
                        worker = "worker-" + p.parent.name.split("-", 1)[1]
                        out[worker] = out.get(worker, 0) + n
                    if whole == "tmp" and rel[0].startswith("reshard-remote-"):
                        out[rel[0]] = out.get(rel[0], 0) + n
            except (OSError, IndexError):
                pass
    return out


class Watch:
    """Polls a command's process tree and the staging folder until it exits (module docstring)."""

    def __init__(self, pid: int, staging: Path | None, every: float, tmp: Path | None = None):
        self.pid, self.staging, self.every, self.tmp = pid, staging, every, tmp
        self.procs: dict[int, dict] = {}
        self.disk: dict[str, int] = {}
        self.polls = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            for p in tree(self.pid):
                f = proc_facts(p)
                if f is not None:
                    old = self.procs.get(p, {})
                    self.procs[p] = {"cpu_s": max(f["cpu_s"], old.get("cpu_s", 0.0)),
                                     "peak_rss": max(f["peak_rss"], old.get("peak_rss", 0)),
                                     "rank": f["rank"] if f["rank"] is not None else old.get("rank")}
            if self.staging is not None and self.staging.exists():
                for k, n in disk_now(self.staging, self.tmp).items():
                    self.disk[k] = max(self.disk.get(k, 0), n)
            self.polls += 1
            self._stop.wait(self.every)

    def stop(self) -> None:
        self._stop.set()
        self._t.join()

    def workers(self) -> dict[int, dict]:
        """rank -> the worker's last-seen CPU and peak RSS; the command itself as rank 0 when no worker was seen."""
        got: dict[int, dict] = {}
        for p, f in self.procs.items():  # a worker's own children inherit its RANK: the largest process stands for it
            if f["rank"] is not None and p != self.pid and f["peak_rss"] >= got.get(f["rank"], {}).get("peak_rss", -1):
                got[f["rank"]] = f
        if not got and self.pid in self.procs:
            got = {0: self.procs[self.pid]}
        return dict(sorted(got.items()))


def measured(argv: list[str], *, srv: Server, env: dict, cwd: Path, timeout: float, staging: Path | None,
             every: float) -> dict:
    """Run ``argv``: wall, client CPU (``os.wait4``: the command and its reaped descendants), server CPU,
    the load average, and the process-tree/staging poll."""
    load0 = os.getloadavg()[0]
    c0 = srv.cpu_s()
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    w = Watch(p.pid, staging, every, tmp=Path(env["TMPDIR"]) if staging is not None and "TMPDIR" in env else None)
    out_err: dict[str, bytes] = {}

    def drain(name: str, stream) -> None:
        out_err[name] = stream.read()

    readers = [threading.Thread(target=drain, args=(n, s), daemon=True) for n, s in (("out", p.stdout), ("err", p.stderr))]
    for r in readers:
        r.start()
    timer = threading.Timer(timeout, p.kill)
    timer.start()
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    timer.cancel()
    w.stop()
    for r in readers:
        r.join()
    p.returncode = os.waitstatus_to_exitcode(status)
    res = {"argv": [str(x) for x in argv[1:]], "exit": p.returncode, "wall_s": round(wall, 3),
           "cpu_s": round(ru.ru_utime + ru.ru_stime, 3), "server_cpu_s": round(srv.cpu_s() - c0, 3),
           "load_before": round(load0, 2), "load_after": round(os.getloadavg()[0], 2),
           "workers": {str(k): {"cpu_s": round(v["cpu_s"], 2), "peak_rss_mib": round(v["peak_rss"] / MIB, 1)}
                       for k, v in w.workers().items()},
           "staging_peak_bytes": dict(w.disk), "polls": w.polls,
           "stdout": out_err.get("out", b"").decode(errors="replace")}
    if p.returncode != 0:
        res["error"] = error_line(out_err.get("err", b"").decode(errors="replace"))
    return res


def du(path: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file()) if path.exists() else 0


# ------------------------------------------------------------------ the rounds
def rows_of(a, srv: Server, work: Path, problems: list[str]) -> dict | None:
    local = work / "src"
    rows_, cols_ = a.shape
    if (local / ".metadata").exists():
        facts = {"cached": str(local)}
    else:
        clear(local)
        facts = build(BUILD_SHARDED, [str(local), str(a.ranks), str(a.tensors), str(rows_), str(cols_)], a=a, cwd=work,
                      what=f"the dcp.save checkpoint ({a.ranks} ranks, {a.tensors} x {rows_}x{cols_} float32)",
                      problems=problems)
        if facts is None:
            return None
    data_bytes = sum(p.stat().st_size for p in local.glob("*.distcp"))
    up = upload(a, srv, local, "src", work, problems)
    if up is None:
        return None
    src, dst, to = f"s3://{BUCKET}/src", f"s3://{BUCKET}/dst", f"dp={max(1, a.ranks // 2)}"
    conv = ["--to", to, "--buffer-memory", a.buffer_memory, "--no-profile", "--json", "--quiet"]
    staging = work / "staging"
    tmp = work / "tmp"  # the commands' TMPDIR: a store source's staged `.metadata` and read cache land here
    env = dict(srv.env, PYTHONPATH=str(ROOT), RESHARD_STAGING_DIR=str(staging), TMPDIR=str(tmp))
    rsh = [a.python, "-m", "reshard", "convert"]
    store_rows = {"l2s_1": [*rsh, str(local), dst, *conv],
                  "l2s_2": [*rsh, str(local), dst, *conv, "--workers", "2"],
                  "l2s_4": [*rsh, str(local), dst, *conv, "--workers", "4"],
                  "s2s_1": [*rsh, src, dst, *conv]}
    if a.store_workers:
        store_rows["s2s_2"] = [*rsh, src, dst, *conv, "--workers", "2"]
        store_rows["s2s_4"] = [*rsh, src, dst, *conv, "--workers", "4"]
    if a.rows:  # only these rows of the store commands (the naive route always runs: it is the anchor)
        store_rows = {k: v for k, v in store_rows.items() if k in a.rows.split(",")}
    rows: dict[str, list[dict]] = {k: [] for k in [*store_rows, "naive_convert", "naive_upload", "naive_download",
                                                     "naive_l2s", "naive_s2s"]}
    digests: dict[str, dict] = {}
    out, dl = work / "out", work / "download"

    # Commands run from a folder beside the checkpoint, not above it: `--workers` into a store refuses a
    # source under its working directory (reported with the benchmark: the streamed output's ``dst`` is ".").
    cwd = work / "cwd"
    cwd.mkdir(exist_ok=True)

    def timed(name: str, argv: list[str], i: int, watch: Path | None) -> dict:
        r = measured(argv, srv=srv, env=env, cwd=cwd, timeout=a.timeout, staging=watch, every=a.poll)
        print(f"  {name} round {i + 1}/{a.runs}: exit {r['exit']}, {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s client "
              f"CPU, {r['server_cpu_s']:.1f} s server CPU, load {r['load_before']}", file=sys.stderr, flush=True)
        return r

    for i in range(a.runs):
        for name, argv in store_rows.items():  # interleaved: each round runs every row once
            helper(a, srv, EMPTY_CODE, BUCKET, "dst")
            clear(staging)
            staging.mkdir(parents=True)
            clear(tmp)
            tmp.mkdir(parents=True)
            r = timed(name, argv, i, staging)
            doc = None
            if r["exit"] == 0:
                try:
                    doc = json.loads(helper(a, srv, REPORT_CODE, BUCKET, "dst"))
                except (RuntimeError, ValueError) as e:
                    problems.append(f"{name}: no reshard-report.json in the store ({e})")
                if name not in digests:
                    digests[name] = json.loads(helper(a, srv, DIGEST_CODE, BUCKET, "dst"))
            streamed = (doc or {}).get("streamed") or {}
            r["report_workers"] = [{k: w.get(k) for k in ("worker", "peak_bytes", "part_bytes", "budget_bytes",
                                                          "most_unsent_bytes", "kept_bytes", "reads")}
                                   for w in streamed.get("workers", [])]
            r["report_seconds"] = (doc or {}).get("seconds")
            src_store = (doc or {}).get("source_store") or {}
            r["source_requests"] = {k: src_store.get(k) for k in ("requests", "bytes_requested", "bytes_stored")
                                    if k in src_store}
            r.pop("stdout", None)
            rows[name].append(r)
        helper(a, srv, EMPTY_CODE, BUCKET, "dst")
        clear(dl)
        clear(out)
        d = timed("naive_download", [a.python, "-c", DOWNLOAD_CODE, src, str(dl)], i, None)
        d["local_disk_bytes"] = du(dl)
        c = timed("naive_convert", [*rsh, str(local), str(out), *conv], i, None)
        c["local_disk_bytes"] = du(out)
        if "local" not in digests and c["exit"] == 0:
            digests["local"] = digest_outputs(out)
        u = timed("naive_upload", [a.python, "-c", UPLOAD_CODE, str(out), BUCKET, "dst"], i, None)
        for name, parts in (("naive_l2s", [c, u]), ("naive_s2s", [d, c, u])):
            rows[name].append({"exit": max((p["exit"] for p in parts), key=abs),
                               "wall_s": round(sum(p["wall_s"] for p in parts), 3),
                               "cpu_s": round(sum(p["cpu_s"] for p in parts), 3),
                               "server_cpu_s": round(sum(p["server_cpu_s"] for p in parts), 3),
                               "workers": {"0": {"cpu_s": round(sum(p["cpu_s"] for p in parts), 2),
                                                 "peak_rss_mib": max(w["peak_rss_mib"] for p in parts
                                                                     for w in p["workers"].values())}},
                               "local_disk_bytes": sum(p.get("local_disk_bytes", 0) for p in parts),
                               "load_before": parts[0]["load_before"]})
        for r in (d, c, u):
            r.pop("stdout", None)
        rows["naive_download"].append(d)
        rows["naive_convert"].append(c)
        rows["naive_upload"].append(u)
        helper(a, srv, EMPTY_CODE, BUCKET, "dst")
        clear(dl)
        clear(out)
    for k, v in rows.items():
        for r in v:
            if r["exit"] != 0:
                problems.append(f"{k}: exit {r['exit']}: {r.get('error', '')}")
    ident = {k: (v == digests.get("local")) for k, v in digests.items() if k != "local"}
    if "local" not in digests or not ident or not all(ident.values()):
        problems.append(f"store outputs not all shown byte-identical to the local conversion's: {ident}")
    return {"ranks": a.ranks, "tensors": a.tensors, "shape": [rows_, cols_], "to": to, "buffer_memory": a.buffer_memory,
            "build": facts, "upload": up, "data_bytes": data_bytes,
            "identical_to_local": {"files": len(digests.get("local", {})), "by_row": ident}, "rows": rows}


# ------------------------------------------------------------------ summaries and the markdown
def med(vals: list) -> float | None:
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def f(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def mib(n: float | None) -> str:
    return f(n / MIB if n else None, 1)


def per_worker(runs: list[dict]) -> dict:
    """Medians over rounds of the largest per-worker figure (the worker that needed most) and their sum."""
    rss = [max((w["peak_rss_mib"] for w in r["workers"].values()), default=None) for r in runs]
    cpu = [max((w["cpu_s"] for w in r["workers"].values()), default=None) for r in runs]
    rep = [max((w["peak_bytes"] or 0 for w in r.get("report_workers", [])), default=None) for r in runs]
    spill = [max((n for k, n in r.get("staging_peak_bytes", {}).items() if k.startswith("spill-")), default=None)
             for r in runs]
    whole = [r.get("staging_peak_bytes", {}).get("all") or r.get("local_disk_bytes") for r in runs]
    remote = [max((n for k, n in r.get("staging_peak_bytes", {}).items() if k.startswith("reshard-remote-")),
                  default=None) for r in runs]
    tmpall = [r.get("staging_peak_bytes", {}).get("tmp") for r in runs]
    reads = [max((n for k, n in r.get("staging_peak_bytes", {}).items() if k.startswith("reads-")), default=None)
             for r in runs]
    both = [max((n for k, n in r.get("staging_peak_bytes", {}).items() if k.startswith("worker-")), default=None)
            for r in runs]
    rep_reads = [max(((w.get("reads") or {}).get("peak_bytes") or 0 for w in r.get("report_workers", [])), default=None)
                 for r in runs]
    fetched = [sum((w.get("reads") or {}).get("fetched_bytes") or 0 for w in r.get("report_workers", [])) or None
               for r in runs]
    requests = [sum((w.get("reads") or {}).get("requests") or 0 for w in r.get("report_workers", [])) or None
                for r in runs]
    budget = [max((w["budget_bytes"] or 0 for w in r.get("report_workers", [])), default=None) for r in runs]
    part = [max((w["part_bytes"] or 0 for w in r.get("report_workers", [])), default=None) for r in runs]
    return {"max_worker_rss_mib": med(rss), "max_worker_cpu_s": med(cpu), "report_peak_bytes": med(rep),
            "polled_spill_peak_bytes": med(spill), "polled_local_disk_bytes": med(whole), "budget_bytes": med(budget),
            "part_bytes": med(part), "remote_folder_peak_bytes": med(remote), "tmp_peak_bytes": med(tmpall),
            "workers_seen": med([len(r["workers"]) for r in runs]),
            "polled_reads_peak_bytes": med(reads), "polled_worker_peak_bytes": med(both),
            "report_reads_peak_bytes": med(rep_reads), "reads_fetched_bytes": med(fetched),
            "reads_requests": med(requests)}


def summarize(result: dict) -> dict:
    gib = result["data_bytes"] / GIB
    out = {}
    for k, runs in result["rows"].items():
        ok = [r for r in runs if r["exit"] == 0] or runs
        wall, cpu, srv = med([r["wall_s"] for r in ok]), med([r["cpu_s"] for r in ok]), med([r["server_cpu_s"] for r in ok])
        out[k] = {"exits": [r["exit"] for r in runs], "median_wall_s": wall,
                  "walls": [r["wall_s"] for r in runs], "median_cpu_s": cpu, "median_server_cpu_s": srv,
                  "gib_per_s": (gib / wall) if wall else None, "cpu_s_per_gib": (cpu / gib) if cpu else None,
                  "server_cpu_s_per_gib": (srv / gib) if srv else None,
                  "loads": [r.get("load_before") for r in runs], **per_worker(ok)}
    return out


LABELS = {"l2s_1": "local -> store, 1 worker (`convert LOCAL s3://...`)",
          "l2s_2": "local -> store, `--workers 2`", "l2s_4": "local -> store, `--workers 4`",
          "s2s_1": "store -> store, 1 worker (`convert s3://... s3://...`)",
          "s2s_2": "store -> store, `--workers 2`", "s2s_4": "store -> store, `--workers 4`",
          "naive_convert": "naive: `convert LOCAL OUT`", "naive_upload": "naive: upload (boto3, 8 threads)",
          "naive_download": "naive: download (`fs.get`)",
          "naive_l2s": "**naive local -> store** (convert + upload)",
          "naive_s2s": "**naive store -> store** (download + convert + upload)"}


def markdown(rep: dict) -> str:
    b = rep["result"]
    s = rep["summary"]
    gib = b["data_bytes"] / GIB
    lines = [f"Measured {rep['when']} on {rep['machine']}; load average (1 min) {rep['load_start']} at the start, "
             f"{rep['load_end']} at the end (other agents' work shares the 2 CPUs: CPU seconds are the robust figures). "
             f"Checkpoint: `dcp.save` on {b['ranks']} gloo ranks, {b['tensors']} float32 tensors "
             f"{b['shape'][0]}x{b['shape'][1]} `Shard(0)` ({gib:.2f} GiB of data), `--to {b['to']}`, "
             f"`--buffer-memory {b['buffer_memory']}`; moto's S3 server in its own process on the same machine; "
             f"{rep['runs']} interleaved rounds, medians.", "",
             "| command | exits | median wall (s) | walls (s) | GiB/s | client CPU (s) | client CPU s/GiB | server CPU (s) | "
             "load at start |",
             "|---|---|---:|---|---:|---:|---:|---:|---|"]
    for k, v in s.items():
        lines.append(f"| {LABELS[k]} | {', '.join(map(str, v['exits']))} | {f(v['median_wall_s'], 1)} | "
                     f"{', '.join(f(x, 1) for x in v['walls'])} | {f(v['gib_per_s'], 3)} | {f(v['median_cpu_s'], 1)} | "
                     f"{f(v['cpu_s_per_gib'], 1)} | {f(v['median_server_cpu_s'], 1)} | "
                     f"{', '.join(f(x, 1) for x in v['loads'])} |")
    lines += ["", "Per worker (the worker that needed most; medians over rounds):", "",
              "| command | workers seen | peak RSS (MiB) | CPU (s) | peak local disk, report (MiB) | "
              "peak local disk, polled (MiB) | read window, polled / report (MiB) | spill + reads, polled (MiB) | "
              "source bytes fetched, all workers (MiB) / ranged GETs | "
              "`$TMPDIR` per worker / all (MiB) | budget (MiB) | part (MiB) |",
              "|---|---:|---:|---:|---:|---:|---|---:|---|---|---:|---:|"]
    for k, v in s.items():
        if k in ("naive_upload", "naive_download", "naive_convert"):
            continue
        polled = v["polled_spill_peak_bytes"] if v["polled_spill_peak_bytes"] is not None else v["polled_local_disk_bytes"]
        lines.append(f"| {LABELS[k]} | {f(v['workers_seen'], 0)} | {f(v['max_worker_rss_mib'], 0)} | "
                     f"{f(v['max_worker_cpu_s'], 1)} | "
                     f"{f(v['report_peak_bytes'] / MIB if v['report_peak_bytes'] else None, 0)} | "
                     f"{f(polled / MIB if polled else None, 0)} | "
                     f"{mib(v['polled_reads_peak_bytes'])} / {mib(v['report_reads_peak_bytes'])} | "
                     f"{mib(v['polled_worker_peak_bytes'])} | "
                     f"{mib(v['reads_fetched_bytes'])} / {f(v['reads_requests'], 0)} | "
                     f"{f(v['remote_folder_peak_bytes'] / MIB if v['remote_folder_peak_bytes'] else None, 0)} / "
                     f"{f(v['tmp_peak_bytes'] / MIB if v['tmp_peak_bytes'] else None, 0)} | "
                     f"{f(v['budget_bytes'] / MIB if v['budget_bytes'] else None, 0)} | "
                     f"{f(v['part_bytes'] / MIB if v['part_bytes'] else None, 0)} |")
    ident = b["identical_to_local"]
    lines += ["", f"Store outputs of the first round against the local conversion's files (`.metadata` and data, "
              f"{ident['files']} files): " + ", ".join(f"{k} {'identical' if v else 'DIFFERENT'}"
                                                         for k, v in ident["by_row"].items()) + "."]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ the written scaling model (docs/benchmarks.md)
#: Every figure the model of a Llama-3-405B x 16,384-rank conversion rests on (docs/benchmarks.md, issue 46).
MODEL = {
    "params": 405e9,
    "bytes_per_param": 14,             # bf16 weights 2 + fp32 master 4 + Adam m 4 + Adam v 4
    "storage_entries": 41.95e6,        # measured, 405B x 16,384 ranks (bench_frontier.py, issue 33)
    "metadata_bytes": 6946 * MIB,      # the same checkpoint's .metadata (issue 33)
    "target_files": 8192,              # --to dp_shard=8192
    "workers_per_node": 8,
    "cores_per_node": 32,              # cores the conversion may use on a node (assumed)
    "nic_gbit": (100, 400),            # per node, each direction (assumed)
    "nic_efficiency": 0.8,
    "gets_per_item": 1,                # engine/shares.py: an item a worker needs whole (here every one: each
                                       # target takes 2 source shards whole) is fetched whole, one ranged GET;
                                       # 3 (head, tail, rows) for an item over 256 KiB a worker needs in part
    "get_per_s": 5500,                 # S3, per partitioned prefix
    "put_per_s": 3500,
    "partitions": (1, 16),             # a fresh prefix; one S3 has split (or been asked to) 16 ways
    "store_gbyte_s": (50, 200),        # aggregate store bandwidth, read + write (assumed, a store without request caps)
    "plan_cpu_s": 159.4,               # `reshard plan` at 405B x 16,384, median of three (issue 33); every worker plans
    "buffer_memory": 1 << 30,          # --buffer-memory 1GiB
    "metadata_piece": 64 * MIB,        # remote.PIECE: .metadata fetched in ranges of this size
}


def part_size(budget: int, files: int, largest: int) -> int:
    """`reshard.storage.objectstore.stream.part_size_for`, restated (this script imports nothing of reshard)."""
    want = max(5 * MIB, budget // max(1, files + 4), -(-largest // 9000))
    return -(-want // MIB) * MIB


def scaling_model(cpu_s_per_gib: float, nodes: tuple[int, ...] = (8, 32, 128)) -> list[dict]:
    """Seconds each resource needs for the whole conversion, per node count (docs/benchmarks.md, issue 46):
    the pipeline overlaps fetching, copying and sending, so the expected time is the fixed start (each
    worker plans) plus the largest of them."""
    m = MODEL
    data = m["params"] * m["bytes_per_param"]
    out = []
    for n in nodes:
        w = n * m["workers_per_node"]
        per_node = data / n
        cpu = per_node / GIB * cpu_s_per_gib / m["cores_per_node"]
        meta_in = m["workers_per_node"] * m["metadata_bytes"]  # every worker fetches .metadata
        net = {g: (per_node + meta_in) / (g * 1e9 / 8 * m["nic_efficiency"]) for g in m["nic_gbit"]}
        files = m["target_files"] / w
        part = part_size(m["buffer_memory"] // 2, int(max(1, files)), int(data / m["target_files"]))
        puts = data / part + m["target_files"]  # parts, plus a create/complete per object
        gets = m["storage_entries"] * m["gets_per_item"] + w * -(-m["metadata_bytes"] // m["metadata_piece"])
        store_req = {p: max(gets / (m["get_per_s"] * p), puts / (m["put_per_s"] * p)) for p in m["partitions"]}
        store_bw = {s: (2 * data + w * m["metadata_bytes"]) / (s * 1e9) for s in m["store_gbyte_s"]}
        fixed = m["plan_cpu_s"] + net[m["nic_gbit"][0]] * meta_in / (per_node + meta_in)
        out.append({"nodes": n, "workers": w, "per_node_gib": per_node / GIB, "cpu_s": cpu, "net_s": net,
                    "gets": gets, "puts": puts, "part_mib": part / MIB, "store_req_s": store_req,
                    "store_bw_s": store_bw, "metadata_fetched_tib": w * m["metadata_bytes"] / (1 << 40),
                    "fixed_s": fixed})
    return out


def model_markdown(cpu_s_per_gib: float) -> str:
    rows = scaling_model(cpu_s_per_gib)
    m = MODEL
    lines = ["| nodes (workers) | per node | CPU | network 100 / 400 Gb/s | GETs, PUTs (part) | S3 requests, 1 / 16 "
             "partitions | store bandwidth 50 / 200 GB/s | `.metadata` fetched | S3, 1 partition | S3, 16 partitions | "
             "200 GB/s store, 400 Gb/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]

    def mins(x: float) -> str:
        return f"{x / 60:.1f} min" if x < 3600 else f"{x / 3600:.2f} h"

    for r in rows:
        lo, hi = m["nic_gbit"]
        p1, p16 = m["partitions"]
        s50, s200 = m["store_gbyte_s"]
        cases = []
        for name, parts in (("S3-1", {"store requests": r["store_req_s"][p1], "network": r["net_s"][lo]}),
                            ("S3-16", {"store requests": r["store_req_s"][p16], "network": r["net_s"][lo]}),
                            ("bw", {"store bandwidth": r["store_bw_s"][s200], "network": r["net_s"][hi]})):
            parts = dict(parts, CPU=r["cpu_s"])
            bound = max(parts, key=parts.get)
            cases.append(f"{bound}: {mins(r['fixed_s'] + parts[bound])}")
        lines.append(f"| {r['nodes']} ({r['workers']}) | {r['per_node_gib']:.0f} GiB | {mins(r['cpu_s'])} | "
                     f"{mins(r['net_s'][lo])} / {mins(r['net_s'][hi])} | {r['gets'] / 1e6:.1f} M, "
                     f"{r['puts'] / 1e3:.0f} k ({r['part_mib']:.0f} MiB) | {mins(r['store_req_s'][p1])} / "
                     f"{mins(r['store_req_s'][p16])} | {mins(r['store_bw_s'][s50])} / {mins(r['store_bw_s'][s200])} | "
                     f"{r['metadata_fetched_tib']:.2f} TiB | {' | '.join(cases)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench-results"))
    ap.add_argument("--work", default="/tmp/bench-store-workers", help="where the checkpoint is built once and kept")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--tensors", type=int, default=32)
    ap.add_argument("--shape", default="4096x2048")
    ap.add_argument("--buffer-memory", default="256MiB")
    ap.add_argument("--store-workers", action="store_true", help="also store -> store with --workers 2 and 4")
    ap.add_argument("--rows", default="", help="comma-separated store rows to run (l2s_1,l2s_2,l2s_4,s2s_1,s2s_2,s2s_4)")
    ap.add_argument("--poll", type=float, default=0.05, help="seconds between polls of the process tree and disk")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", type=float, default=None, metavar="CPU_S_PER_GIB",
                    help="print the 405B x 16,384-rank scaling model for this client CPU per GiB and exit")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--timeout", type=float, default=1800.0)
    a = ap.parse_args(argv)
    if a.model is not None:
        print(model_markdown(a.model))
        return 0
    if a.quick:
        a.ranks, a.tensors, a.shape, a.runs = 4, 4, "1024x1024", 1
        a.work = a.work.rstrip("/") + "-quick"
    a.shape = tuple(int(x) for x in a.shape.lower().split("x"))
    problems: list[str] = []
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    srv = Server(a.python)
    m = machine(work)
    load_start = round(os.getloadavg()[0], 2)
    t0 = time.time()
    try:
        result = rows_of(a, srv, work, problems)
    finally:
        srv.stop()
        for p in ("out", "download", "staging"):
            clear(work / p)
    if result is None:
        print("\n".join(problems), file=sys.stderr)
        return 2
    rep = report_head(m, load_start, a.runs, t0)
    rep.update({"summary": summarize(result), "result": result, "problems": problems})
    return write_results(Path(a.out), "bench_store_workers", rep, markdown(rep), problems)


if __name__ == "__main__":
    sys.exit(main())
