"""Benchmark (issue 34): checkpoints in object storage, read by byte range against downloading first.

Issue 34's acceptance asks for ``inspect`` of a 1,024-rank metadata-only checkpoint on the server
against downloading it first, and ``convert`` from the server against local disk, with the bytes
requested next to the bytes in the checkpoint. The point of reading ``s3://`` by range is the
bytes (and so the time) a download of the whole prefix costs, so every figure here comes with the
bytes the command asked the store for: the ``store`` object of ``inspect --json`` and the
``source_store`` of a convert report (``requests``, ``bytes_requested``, ``listings``,
``bytes_stored``, ``objects_stored``; ``docs/cli.md``).

The server is moto's ``ThreadedMotoServer`` (the S3 wire protocol, real HTTP on 127.0.0.1, a free
port), started by this script in a child process of its own: on Linux a child's ``ru_maxrss``
starts from its parent's high-water mark (``subprocess`` forks, exec keeps the mark), so a server
holding the checkpoints in this process would show up as every measured command's peak RSS. This
process imports neither moto, boto3 nor torch. The credentials and the endpoint go to every child
the standard way, as environment variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_ENDPOINT_URL_S3``: the chain botocore reads, as ``tests/s3_server.py`` does; this script
does not import the tests). Checkpoints are uploaded with boto3 from a child (8 threads), timed but
not measured. The server's own CPU time during each measured command is read from
``/proc/<pid>/stat`` and reported beside the command's.

Part A, **inspect** (``--ranks``, default 1,024): a metadata-only checkpoint from
``reshard.testing.synthetic_metadata.make_llama_metadata_checkpoint`` (the ``.metadata`` ``dcp.save``
writes for FSDP2 + AdamW, sparse data files of the right sizes; the step counters are real bytes)
of a small Llama config with Llama-3-8B's 32 layers (``--inspect-model``: ``small``, the default,
or ``entries8b``, whose ``.metadata`` has 8B x 1,024's entry count; see ``MODELS``): a real 8B x
1,024 checkpoint holds about 97 GB of data objects, which moto (objects in memory) cannot hold.
Rows, each in a fresh subprocess, ``--runs`` rounds (default 3), medians:

- ``reshard inspect s3://bucket/a --json --no-profile`` (what it requested: its ``store`` object);
- download first: a child that copies the whole prefix with fsspec/s3fs
  (``fs.get(prefix, dir, recursive=True)``: what ``aws s3 cp --recursive`` does), then
  ``reshard inspect DIR --json --no-profile``: each part and their sum (wall and CPU summed, peak
  RSS the larger); the download directory is removed between rounds;
- ``reshard inspect LOCAL --json --no-profile`` of the checkpoint as built (reference).

Part B, **convert** (``--convert-ranks`` x ``--convert-tensors`` float32 tensors of
``--convert-shape``, default 8 ranks x 12 x 4096x2048 = 384 MiB): real bytes, written by
``reshard.testing.synthetic.make_sharded`` (a genuine ``dcp.save`` from gloo ranks, ``Shard(0)`` as
FSDP2 does) plus a minimal ``manifest.json`` (``minimal_manifest``, as ``bench_convert_memory.py``).
Rows, fresh subprocesses, rounds, medians, ``--to dp=<ranks/2>``, destination removed between runs:

- ``reshard convert s3://bucket/b DST --to dp=N --no-profile --json`` (its report's ``source_store``);
- ``reshard convert LOCAL DST ...`` from the local copy;
- download first (``fs.get`` as above), then ``reshard convert DIR DST ...``: parts and sum.

After the first round the data files and ``.metadata`` of the conversion from the store are
compared byte for byte with the local conversion's (the reports differ: they name the source).

What is portable and what is not: moto is a Python server in one process on localhost, sharing
this machine's 2 CPUs with the commands it serves; each ranged GET re-reads the whole object on
the server (``key.value[begin:end]``), so its throughput and the server CPU are nothing like a real
store's. The bytes requested against the bytes stored (and the request count) are what carries
over to a real store; the times show the shape on this machine only.

Usage::

    .venv/bin/python scripts/bench_s3.py --out bench-results        # 1,024 ranks; 384 MiB convert
    .venv/bin/python scripts/bench_s3.py --quick                    # 64 ranks, 4 x 4 x 1024x1024, 1 round

Outputs (``--out``, default ``bench-results/``): ``bench_s3.md`` (also printed) and ``bench_s3.json``
(every run). Exit 2 if a checkpoint could not be built or uploaded, the server did not start, or a
measured command failed; 0 otherwise.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ is not a package

from bench_metadata_path import clear, dir_bytes, error_line, machine, run  # noqa: E402  (stdlib-only tops)

MIB = 1 << 20
GIB = 1 << 30
BUCKET = "reshard-bench"

#: Part A's model (``--inspect-model``): Llama-3-8B's 32 layers, small widths, so the data objects
#: hold hundreds of MB instead of 97 GB. ``entries8b``: every dim-0 >= 1,024, so at 1,024 ranks
#: every tensor has 1,024 chunks and the ``.metadata`` has as many storage entries as 8B x 1,024
#: (894,255 against 894,225; 146 MiB), but its data objects hold 4.0 GiB (float32), too much for
#: moto on this machine.
MODELS = {
    "small": dict(dim=256, n_layers=32, n_heads=8, n_kv_heads=2, ffn_dim=512, vocab=4096),
    "entries8b": dict(dim=1024, n_layers=32, n_heads=8, n_kv_heads=8, ffn_dim=1024, vocab=1024),
}

# Children. Credentials and endpoint come from the environment (`child_env`).
SERVER_CODE = r"""
import logging, sys
import boto3
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
port, bucket = int(sys.argv[1]), sys.argv[2]
server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
server.start()
boto3.client("s3", region_name="us-east-1").create_bucket(Bucket=bucket)
print("ready", flush=True)
sys.stdin.read()  # until the benchmark closes this pipe
server.stop()
"""

UPLOAD_CODE = r"""
import json, sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import boto3
local, bucket, prefix = Path(sys.argv[1]), sys.argv[2], sys.argv[3].strip("/")
client = boto3.client("s3", region_name="us-east-1")
files = [p for p in sorted(local.rglob("*")) if p.is_file()]
def put(p):
    client.upload_file(str(p), bucket, f"{prefix}/{p.relative_to(local).as_posix()}")
    return p.stat().st_size
with ThreadPoolExecutor(8) as ex:
    n = sum(ex.map(put, files))
print(json.dumps({"objects": len(files), "bytes": n}))
"""

#: What `aws s3 cp --recursive s3://bucket/prefix DIR` does, through the same fsspec/s3fs reshard uses.
DOWNLOAD_CODE = r"""
import sys
import fsspec
fs = fsspec.filesystem("s3")
src, dst = sys.argv[1], sys.argv[2]
fs.get(src.rstrip("/") + "/", dst.rstrip("/") + "/", recursive=True)
"""

BUILD_METADATA = r"""
import json, sys
from reshard.testing.synthetic_metadata import LlamaConfig, make_llama_metadata_checkpoint
cfg = LlamaConfig("bench", **json.loads(sys.argv[2]))
r = make_llama_metadata_checkpoint(sys.argv[1], cfg, ranks=int(sys.argv[3]))
print(json.dumps({"storage_entries": r.storage_entries, "metadata_bytes": r.metadata_bytes,
                  "data_bytes": r.data_bytes, "keys": r.keys, "files": r.files}))
"""

BUILD_SHARDED = r"""
import sys
from pathlib import Path
from reshard.testing.synthetic import make_sharded, minimal_manifest
out, ws, n, rows, cols = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
make_sharded(out, world_size=ws, n_tensors=n, shape=(rows, cols), timeout=3600.0)
minimal_manifest(Path(out), world_size=ws, tool="scripts/bench_s3.py", experiment_id="bench-s3")
"""

ACCESS_KEY = "AKIARESHARDBENCHKEY1"
SECRET_KEY = "reshard-bench-secret-0a1b2c3d"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(endpoint: str) -> dict:
    env = dict(os.environ)
    env.update({
        "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_CONFIG_FILE": os.devnull,  # nothing of the machine's chain
        "AWS_EC2_METADATA_DISABLED": "true", "AWS_ENDPOINT_URL_S3": endpoint,
    })
    return env


class Server:
    """moto's S3 server in a child process; its CPU time read from /proc."""

    def __init__(self, py: str):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.env = child_env(self.endpoint)
        self.proc = subprocess.Popen([py, "-c", SERVER_CODE, str(self.port), BUCKET], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=self.env)
        line = self.proc.stdout.readline().decode().strip()
        if line != "ready":
            self.stop()
            raise RuntimeError(f"the moto server did not start (said {line!r}, exit {self.proc.poll()})")

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (all threads)

    def rss_mib(self) -> tuple[float, float]:
        """(current, peak) RSS of the server process."""
        got = {}
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                got[k] = int(v.split()[0]) / 1024
        return got.get("VmRSS", 0.0), got.get("VmHWM", 0.0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except Exception:  # noqa: BLE001
                self.proc.kill()
                self.proc.wait()


def measured(argv: list[str], *, srv: Server, cwd: Path, timeout: float) -> dict:
    """`run` (wall, CPU and peak RSS of the child by os.wait4), plus the server's CPU meanwhile."""
    c0 = srv.cpu_s()
    r = run(argv, cwd=cwd, timeout=timeout, env=srv.env)
    r["server_cpu_s"] = round(srv.cpu_s() - c0, 3)
    return r


def parse_json(stdout: str) -> dict | None:
    try:
        return json.loads(stdout)
    except ValueError:
        i = stdout.find("{")
        try:
            return json.loads(stdout[i:]) if i >= 0 else None
        except ValueError:
            return None


def slim(r: dict, *, store_field: str | None = None) -> dict:
    """Keep the figures of a run, the store counters if asked, and only the error line of its output."""
    out = {k: r[k] for k in ("argv", "exit", "timed_out", "wall_s", "cpu_s", "peak_rss_mib", "server_cpu_s") if k in r}
    if store_field:
        doc = parse_json(r["stdout"]) or {}
        out["store"] = doc.get(store_field)
    if r["exit"] != 0:
        out["error"] = error_line(r["stderr"])
    return out


def combine(parts: list[dict]) -> dict:
    """A download and the command after it, as one: wall and CPU summed, peak RSS the larger, the worst exit."""
    return {"exit": max((p["exit"] for p in parts), key=abs), "wall_s": round(sum(p["wall_s"] for p in parts), 4),
            "cpu_s": round(sum(p["cpu_s"] for p in parts), 3), "peak_rss_mib": max(p["peak_rss_mib"] for p in parts),
            "server_cpu_s": round(sum(p.get("server_cpu_s", 0.0) for p in parts), 3)}


def med(runs: list[dict], field: str) -> float | None:
    vals = [r[field] for r in runs if r.get(field) is not None]
    return statistics.median(vals) if vals else None


def summary(runs: list[dict]) -> dict:
    return {"exits": [r["exit"] for r in runs], "median_wall_s": med(runs, "wall_s"),
            "min_wall_s": min(r["wall_s"] for r in runs), "max_wall_s": max(r["wall_s"] for r in runs),
            "median_cpu_s": med(runs, "cpu_s"), "median_peak_rss_mib": med(runs, "peak_rss_mib"),
            "median_server_cpu_s": med(runs, "server_cpu_s"), "runs": runs}


def upload(a, srv: Server, local: Path, prefix: str, cwd: Path, problems: list[str]) -> dict | None:
    print(f"uploading {local.name} to s3://{BUCKET}/{prefix} ...", file=sys.stderr, flush=True)
    r = measured([a.python, "-c", UPLOAD_CODE, str(local), BUCKET, prefix], srv=srv, cwd=cwd, timeout=7200.0)
    if r["exit"] != 0:
        problems.append(f"upload of {local.name}: exit {r['exit']}: {error_line(r['stderr'])}")
        return None
    got = parse_json(r["stdout"]) or {}
    print(f"  {got.get('objects')} objects, {got.get('bytes', 0) / MIB:.0f} MiB in {r['wall_s']:.1f} s", file=sys.stderr)
    return {"wall_s": r["wall_s"], "server_cpu_s": r["server_cpu_s"], **got}


def build(code: str, args: list[str], *, a, cwd: Path, what: str, problems: list[str]) -> dict | None:
    print(f"building {what} ...", file=sys.stderr, flush=True)
    r = run([a.python, "-c", code, *args], cwd=cwd, timeout=7200.0)
    if r["exit"] != 0:
        problems.append(f"building {what}: exit {r['exit']}: {error_line(r['stderr'])}")
        return None
    print(f"  built in {r['wall_s']:.1f} s", file=sys.stderr, flush=True)
    return {"wall_s": r["wall_s"], **(parse_json(r["stdout"]) or {})}


def say(name: str, i: int, n: int, r: dict) -> None:
    print(f"  [{i + 1}/{n}] {name}: {r['wall_s']:.2f} s, CPU {r['cpu_s']:.2f} s, exit {r['exit']}, "
          f"rss {r['peak_rss_mib']:.0f} MiB, server CPU {r.get('server_cpu_s', 0):.2f} s", file=sys.stderr, flush=True)


def check_runs(name: str, runs: list[dict], problems: list[str]) -> None:
    for r in runs:
        if r["exit"] != 0:
            problems.append(f"{name}: exit {r['exit']}: {r.get('error', '')}")


# ------------------------------------------------------------------------- part A: inspect
def part_inspect(a, srv: Server, work: Path, problems: list[str]) -> dict | None:
    local = work / "a-local"
    cfg = MODELS[a.inspect_model]
    facts = build(BUILD_METADATA, [str(local), json.dumps(cfg), str(a.ranks)], a=a, cwd=work,
                  what=f"the metadata-only checkpoint ({a.inspect_model}, {a.ranks} ranks)", problems=problems)
    if facts is None:
        return None
    up = upload(a, srv, local, "a", work, problems)
    if up is None:
        return None
    url = f"s3://{BUCKET}/a"
    dl = work / "a-download"
    rsh = a.reshard
    rows: dict[str, list[dict]] = {"remote": [], "download": [], "download_inspect": [], "download_total": [], "local": []}
    for i in range(a.runs):
        r = slim(measured([rsh, "inspect", url, "--json", "--no-profile"], srv=srv, cwd=work, timeout=a.timeout),
                 store_field="store")
        rows["remote"].append(r)
        say("inspect s3://", i, a.runs, r)
        clear(dl)
        d = slim(measured([a.python, "-c", DOWNLOAD_CODE, url, str(dl)], srv=srv, cwd=work, timeout=a.timeout))
        d["bytes_downloaded"] = dir_bytes(dl) if dl.exists() else 0
        rows["download"].append(d)
        say("download (fs.get)", i, a.runs, d)
        li = slim(measured([rsh, "inspect", str(dl), "--json", "--no-profile"], srv=srv, cwd=work, timeout=a.timeout))
        rows["download_inspect"].append(li)
        say("inspect of the download", i, a.runs, li)
        rows["download_total"].append(combine([d, li]))
        clear(dl)
        lo = slim(measured([rsh, "inspect", str(local), "--json", "--no-profile"], srv=srv, cwd=work, timeout=a.timeout))
        rows["local"].append(lo)
        say("inspect LOCAL", i, a.runs, lo)
    for k, v in rows.items():
        check_runs(f"part A {k}", v, problems)
    return {"model": a.inspect_model, "config": cfg, "ranks": a.ranks, "build": facts, "upload": up,
            "bytes_on_disk": dir_bytes(local), "rows": {k: summary(v) for k, v in rows.items()}}


# ------------------------------------------------------------------------- part B: convert
def digest_outputs(ckpt: Path) -> dict[str, str]:
    """sha256 of `.metadata` and every data file (the reports name the source, so they differ)."""
    out = {}
    for p in sorted(ckpt.iterdir()):
        if p.name == ".metadata" or p.suffix == ".distcp":
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for block in iter(lambda: f.read(8 << 20), b""):
                    h.update(block)
            out[p.name] = h.hexdigest()
    return out


def part_convert(a, srv: Server, work: Path, problems: list[str]) -> dict | None:
    local = work / "b-local"
    rows_, cols_ = a.convert_shape
    facts = build(BUILD_SHARDED, [str(local), str(a.convert_ranks), str(a.convert_tensors), str(rows_), str(cols_)],
                  a=a, cwd=work, what=f"the dcp.save checkpoint ({a.convert_ranks} ranks, {a.convert_tensors} x "
                  f"{rows_}x{cols_} float32)", problems=problems)
    if facts is None:
        return None
    up = upload(a, srv, local, "b", work, problems)
    if up is None:
        return None
    url = f"s3://{BUCKET}/b"
    to = f"dp={max(1, a.convert_ranks // 2)}"
    dst, dl = work / "b-dst", work / "b-download"
    rsh = a.reshard
    conv = ["--to", to, "--no-profile", "--json"]
    rows: dict[str, list[dict]] = {"remote": [], "local": [], "download": [], "download_convert": [], "download_total": []}
    identical = None
    for i in range(a.runs):
        clear(dst)
        r = slim(measured([rsh, "convert", url, str(dst), *conv], srv=srv, cwd=work, timeout=a.timeout),
                 store_field="source_store")
        rows["remote"].append(r)
        say("convert s3://", i, a.runs, r)
        remote_digest = digest_outputs(dst) if i == 0 and r["exit"] == 0 else None
        clear(dst)
        lo = slim(measured([rsh, "convert", str(local), str(dst), *conv], srv=srv, cwd=work, timeout=a.timeout))
        rows["local"].append(lo)
        say("convert LOCAL", i, a.runs, lo)
        if remote_digest is not None and lo["exit"] == 0:
            local_digest = digest_outputs(dst)
            identical = {"files": len(local_digest), "equal": remote_digest == local_digest}
        clear(dst)
        clear(dl)
        d = slim(measured([a.python, "-c", DOWNLOAD_CODE, url, str(dl)], srv=srv, cwd=work, timeout=a.timeout))
        d["bytes_downloaded"] = dir_bytes(dl) if dl.exists() else 0
        rows["download"].append(d)
        say("download (fs.get)", i, a.runs, d)
        dc = slim(measured([rsh, "convert", str(dl), str(dst), *conv], srv=srv, cwd=work, timeout=a.timeout))
        rows["download_convert"].append(dc)
        say("convert of the download", i, a.runs, dc)
        rows["download_total"].append(combine([d, dc]))
        clear(dst)
        clear(dl)
    for k, v in rows.items():
        check_runs(f"part B {k}", v, problems)
    if identical is not None and not identical["equal"]:
        problems.append("part B: the conversion from the store differs from the local conversion")
    return {"ranks": a.convert_ranks, "tensors": a.convert_tensors, "shape": [rows_, cols_], "to": to,
            "build": facts, "upload": up, "bytes_on_disk": dir_bytes(local),
            "identical_to_local": identical, "rows": {k: summary(v) for k, v in rows.items()}}


# ------------------------------------------------------------------------- report
def f(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MIB:,.1f}"


def store_median(rows: dict, field: str) -> float | None:
    vals = [r["store"][field] for r in rows["runs"] if r.get("store")]
    return statistics.median(vals) if vals else None


def table(rows: list[tuple[str, dict, str]]) -> list[str]:
    L = ["| command | exit codes | median wall (s) | min-max wall (s) | median CPU (s) | median peak RSS (MiB) "
         "| server CPU (s) | bytes requested / downloaded (MiB) |",
         "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, s, req in rows:
        L.append(f"| {name} | {', '.join(str(e) for e in s['exits'])} | {f(s['median_wall_s'])} | "
                 f"{f(s['min_wall_s'])}-{f(s['max_wall_s'])} | {f(s['median_cpu_s'])} | {f(s['median_peak_rss_mib'], 0)} | "
                 f"{f(s['median_server_cpu_s'])} | {req} |")
    return L


def markdown(rep: dict) -> str:
    m = rep["machine"]
    L = [f"Measured {rep['when']} on {m['nproc']} CPUs, {m['ram_gib']} GiB RAM, {m['platform']}, Python {m['python']}, "
         f"torch {m['torch']}, moto {rep['versions']['moto']}, s3fs {rep['versions']['s3fs']}, commit `{m['commit']}`; "
         f"load average {rep['loadavg_start']:.2f} at the start, {rep['loadavg_end']:.2f} at the end.",
         f"Command: `{rep['command']}`. Every command in a fresh subprocess, {rep['runs']} round(s), medians; CPU = "
         "user + sys of that process (`os.wait4`), peak RSS its `ru_maxrss`; server CPU = the moto process's CPU "
         "time while the command ran; warm page cache.", ""]
    A = rep.get("inspect")
    if A:
        b = A["build"]
        rw = A["rows"]
        stored = store_median(rw["remote"], "bytes_stored")
        req = store_median(rw["remote"], "bytes_requested")
        nreq = store_median(rw["remote"], "requests")
        objs = store_median(rw["remote"], "objects_stored")
        c = A["config"]
        dlb = med(rw["download"]["runs"], "bytes_downloaded")
        L += [f"#### Inspect: metadata-only checkpoint, {A['ranks']:,} ranks ({b.get('storage_entries', 0):,} storage "
              f"entries, `.metadata` {mib(b.get('metadata_bytes'))} MiB, data objects {mib(b.get('data_bytes'))} MiB; "
              f"Llama config dim {c['dim']}, {c['n_layers']} layers, {c['n_heads']} heads, {c['n_kv_heads']} KV heads, "
              f"FFN {c['ffn_dim']}, vocabulary {c['vocab']}, float32, AdamW; upload {A['upload']['wall_s']:.1f} s, "
              "not measured)", ""]
        L += table([
            ("`reshard inspect s3://… --json`", rw["remote"], f"{mib(req)} requested ({f(nreq, 0)} requests)"),
            ("download first: `fs.get(recursive=True)`", rw["download"], f"{mib(dlb)} downloaded"),
            ("... then `reshard inspect DIR --json`", rw["download_inspect"], "-"),
            ("**download first, total**", rw["download_total"], f"{mib(dlb)} downloaded"),
            ("`reshard inspect LOCAL --json` (reference)", rw["local"], "-"),
        ])
        if req and stored:
            rt = rw["download_total"]["median_wall_s"] / rw["remote"]["median_wall_s"]
            L += ["", f"Bytes requested by `inspect s3://`: {req:,.0f} of {stored:,.0f} stored in {f(objs, 0)} objects "
                  f"(**{100 * req / stored:.2f} %**; the `.metadata` alone is {b.get('metadata_bytes', 0):,} bytes). "
                  f"Download first took **{rt:.2f}x** the wall time of inspecting on the server."]
    B = rep.get("convert")
    if B:
        rw = B["rows"]
        stored = store_median(rw["remote"], "bytes_stored")
        req = store_median(rw["remote"], "bytes_requested")
        nreq = store_median(rw["remote"], "requests")
        dlb = med(rw["download"]["runs"], "bytes_downloaded")
        r0, c0 = B["shape"]
        L += ["", f"#### Convert `--to {B['to']}`: `dcp.save` on {B['ranks']} gloo ranks, {B['tensors']} float32 tensors "
              f"{r0}x{c0} `Shard(0)` ({mib(B['bytes_on_disk'])} MiB on disk, {B['upload']['objects']} objects; build "
              f"{B['build']['wall_s']:.0f} s, upload {B['upload']['wall_s']:.1f} s, not measured)", ""]
        L += table([
            ("`reshard convert s3://… DST`", rw["remote"], f"{mib(req)} requested ({f(nreq, 0)} requests)"),
            ("`reshard convert LOCAL DST`", rw["local"], "-"),
            ("download first: `fs.get(recursive=True)`", rw["download"], f"{mib(dlb)} downloaded"),
            ("... then `reshard convert DIR DST`", rw["download_convert"], "-"),
            ("**download first, total**", rw["download_total"], f"{mib(dlb)} downloaded"),
        ])
        ident = B.get("identical_to_local")
        if req and stored:
            rt = rw["download_total"]["median_wall_s"] / rw["remote"]["median_wall_s"]
            rl = rw["remote"]["median_wall_s"] / rw["local"]["median_wall_s"]
            L += ["", f"Bytes requested by `convert s3://`: {req:,.0f} of {stored:,.0f} stored (**{req / stored:.3f}x** "
                  f"the checkpoint). Download first + local convert took **{rt:.2f}x** the wall time of converting "
                  f"from the server; converting from the server took {rl:.2f}x the wall time of converting from local disk."
                  + (f" Output of the conversion from the store against the local one ({ident['files']} files, "
                     f"`.metadata` and data): {'byte-identical' if ident['equal'] else '**different**'}." if ident else "")]
    srv = rep.get("server_rss_mib")
    if srv:
        L += ["", f"moto server process: {srv[0]:,.0f} MiB RSS at the end, peak {srv[1]:,.0f} MiB."]
    if rep["problems"]:
        L += ["", "Problems:", ""] + [f"- {p}" for p in rep["problems"]]
    return "\n".join(L) + "\n"


# ------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench-results"))
    ap.add_argument("--runs", type=int, default=3, help="rounds; medians (default 3)")
    ap.add_argument("--ranks", type=int, default=1024, help="ranks of part A's metadata-only checkpoint (default 1024)")
    ap.add_argument("--inspect-model", choices=sorted(MODELS), default="small",
                    help="part A's Llama config (default small: see MODELS)")
    ap.add_argument("--convert-ranks", type=int, default=8, help="ranks that write part B's checkpoint (default 8)")
    ap.add_argument("--convert-tensors", type=int, default=12, help="float32 tensors of part B (default 12)")
    ap.add_argument("--convert-shape", default="4096x2048", help="ROWSxCOLS of each tensor (default 4096x2048: 32 MiB)")
    ap.add_argument("--skip-inspect", action="store_true")
    ap.add_argument("--skip-convert", action="store_true")
    ap.add_argument("--quick", action="store_true", help="64 ranks, 4 ranks x 4 tensors 1024x1024, 1 round")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--reshard", default=None, help="the console script (default: `reshard` beside --python)")
    ap.add_argument("--tmp", default=None, help="parent of the work directory (default: the system's temp dir)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="per command")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    a = ap.parse_args(argv)
    if a.quick:
        a.ranks, a.convert_ranks, a.convert_tensors, a.convert_shape, a.runs = 64, 4, 4, "1024x1024", 1
    try:
        a.convert_shape = tuple(int(x) for x in a.convert_shape.lower().split("x"))
        assert len(a.convert_shape) == 2
    except (ValueError, AssertionError):
        ap.error("--convert-shape is ROWSxCOLS, e.g. 4096x2048")
    a.reshard = a.reshard or str(Path(a.python).with_name("reshard"))
    if not os.access(a.reshard, os.X_OK):
        ap.error(f"no reshard console script at {a.reshard}")
    load_start = os.getloadavg()[0]
    t_all = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench-s3-", dir=a.tmp))
    problems: list[str] = []
    from importlib import metadata as pkg_metadata

    versions = {}
    for name in ("moto", "s3fs", "fsspec", "boto3"):
        try:
            versions[name] = pkg_metadata.version(name)
        except pkg_metadata.PackageNotFoundError:
            versions[name] = "not installed"
    rep: dict = {"benchmark": "s3", "when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 "command": " ".join(["python", "scripts/bench_s3.py"] + (argv if argv is not None else sys.argv[1:])),
                 "runs": a.runs, "machine": machine(work), "versions": versions, "loadavg_start": load_start,
                 "problems": problems}
    srv = None
    try:
        srv = Server(a.python)
        rep["endpoint"] = srv.endpoint
        if not a.skip_inspect:
            rep["inspect"] = part_inspect(a, srv, work, problems)
            rep["loadavg_after_inspect"] = os.getloadavg()[0]
        if not a.skip_convert:
            rep["convert"] = part_convert(a, srv, work, problems)
        rep["server_rss_mib"] = srv.rss_mib()
        rep["server_cpu_total_s"] = srv.cpu_s()
    except RuntimeError as exc:
        problems.append(str(exc))
    finally:
        if srv is not None:
            srv.stop()
        if a.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    import resource

    rep["launcher_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rep["loadavg_end"] = os.getloadavg()[0]
    rep["total_s"] = round(time.perf_counter() - t_all, 1)
    md = markdown(rep) + f"\nWhole benchmark: {rep['total_s']:.0f} s.\n"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_s3.md").write_text(md)
    (out / "bench_s3.json").write_text(json.dumps(rep, indent=2, default=str) + "\n")
    print(md)
    print(f"wrote {out / 'bench_s3.md'} and {out / 'bench_s3.json'}", file=sys.stderr)
    return 2 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
