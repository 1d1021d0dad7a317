"""Benchmark (issue 45, part 3): a conversion from a store into a store, against the naive route.

Issue 45 asks that ``reshard convert s3://SRC s3://DST`` beat what a user does without it: download
the whole prefix, convert locally, upload the output (the naive route), by the overlap of fetching,
splicing, verifying and uploading, with the client's CPU close to a local conversion's. So each
round runs, every command in a fresh subprocess, rows interleaved (A, B, C, A, B, C, ...):

- **store to store**: ``python -m reshard convert s3://bucket/src s3://bucket/dst --to dp=N --json``
  (this tree: ``PYTHONPATH`` set to it);
- **store to store, base** (``--base-tree DIR``, optional): the same command run with another
  checkout's code (``PYTHONPATH=DIR``), e.g. ``/work/main`` before this change;
- **naive route**: a child that downloads the prefix with fsspec/s3fs (``fs.get(recursive=True)``,
  what ``aws s3 cp --recursive`` does), then ``reshard convert DIR OUT`` (this tree), then a child
  that uploads ``OUT`` with boto3's ``upload_file`` on 8 threads (multipart, concurrent): its three
  parts and their sum (wall and CPU summed);
- **local convert**: ``reshard convert LOCAL OUT`` of the checkpoint as built (the client-CPU anchor).

Wall is the child's; CPU is user + sys of the child alone (``os.wait4``): "client CPU". The server
runs in a child process of its own, and its CPU time while each command ran (``/proc/PID/stat``) is
reported separately as "server CPU". Two servers (``--server``):

- ``moto`` (default): moto's Python server (``bench_s3.Server``), about 11 s of its own CPU per GiB
  uploaded on the client's 2 CPUs, so the upload bounds the wall;
- ``s3rver``: s3rver 3.7.1, a Node.js S3 server that keeps objects as files (`S3rver`). Not a Python
  package: install it with ``npm install --prefix DIR s3rver@3.7.1`` and give
  ``--s3rver DIR/node_modules/.bin/s3rver`` (else ``$S3RVER_BIN``, else ``s3rver`` on ``PATH``).
  Before measuring, each S3 operation reshard uses is tried on it (`FEATURES_CODE`); s3rver 3.7.1
  lacks ListMultipartUploads, ListParts and AbortMultipartUpload (only ``--workers``' streamed
  uploads need the first two, to resume; the third is a best-effort clean-up after a failed upload)
  and gives a completed multipart upload the MD5 of the whole object as its ETag, not S3's
  ``md5(part md5s)-N`` (so reshard records such objects as not checked by ETag). When the binary is
  missing or an operation the measured route needs fails, the run falls back to moto and says so. The destination prefixes and the
local outputs are removed between runs (not timed). After the first round the objects the
store-to-store conversion committed (``.metadata`` and data) are compared byte for byte with the
local conversion's files.

The checkpoint: a real ``dcp.save`` on ``--ranks`` gloo ranks (``reshard.testing.synthetic.make_sharded``,
``Shard(0)`` as FSDP2), ``--tensors`` float32 tensors of ``--shape`` (default 8 ranks x 32 x
4096x2048: 1.0 GiB, 8 objects of 128 MiB), converted ``--to dp=<ranks/2>``.

What carries over to a real store and what does not: moto is a Python server sharing this machine's
2 CPUs with the client, so every byte it serves or takes costs CPU here that a real store spends
elsewhere; the wall-time ratio is this machine's. The client CPU is the client's wherever it runs.

Usage::

    PYTHONPATH=. .venv/bin/python scripts/bench_store.py --runs 3 --base-tree /work/main
    PYTHONPATH=. .venv/bin/python scripts/bench_store.py --quick      # 4 ranks x 4 x 1024x1024, 1 round
    PYTHONPATH=. .venv/bin/python scripts/bench_store.py --server s3rver --s3rver DIR/node_modules/.bin/s3rver
    PYTHONPATH=. .venv/bin/python scripts/bench_store.py --runs 2 --timeline   # where the wall goes

``--threads`` runs the store-to-store command once more per round with each thread's CPU sampled;
``--timeline`` once more with the client's and the server's CPU sampled every 0.25 s: how long the
client runs alone before the server has work (the head), how long the server is busy from then on
and how much of that the client waits for it (neither row is in the ratios).

Writes ``bench_store.md`` (also printed) and ``bench_store.json`` into ``--out``. Exit 2 if the
checkpoint could not be built or uploaded, a measured command failed or the outputs differ.
"""
from __future__ import annotations

import argparse
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

from bench_metadata_path import clear, dir_bytes, machine  # noqa: E402
from bench_s3 import (BUCKET, BUILD_SHARDED, DOWNLOAD_CODE, UPLOAD_CODE, Server, build, child_env,  # noqa: E402
                      combine, digest_outputs, free_port, measured, say, slim, summary, upload)

#: How to get s3rver, said when it is asked for and not found.
S3RVER_INSTALL = ("s3rver is a Node.js package, not part of this project: npm install --prefix DIR s3rver@3.7.1, "
                  "then --s3rver DIR/node_modules/.bin/s3rver (or S3RVER_BIN=that path)")

#: Each S3 operation reshard uses, tried once on a server (credentials and endpoint from the environment):
#: prints ``{operation: "ok" | the error}``. What an answer must be is checked here, not only that it came.
FEATURES_CODE = r"""
import hashlib, json, os, sys
import boto3
b, pre = sys.argv[1], "reshard-feature-check/"
c = boto3.client("s3", region_name="us-east-1")
data = os.urandom(6 << 20)
md5 = hashlib.md5(data).hexdigest()
res, mpu = {}, {}
def t(name, fn):
    try:
        got = fn()
        res[name] = "ok" if got is True else f"unexpected answer: {got!r}"[:200]
    except Exception as e:
        res[name] = f"{type(e).__name__}: {e}"[:200]
t("PutObject", lambda: c.put_object(Bucket=b, Key=pre + "a", Body=data)["ETag"].strip('"') == md5)
t("HeadObject with ETag and size", lambda: (lambda h: h["ETag"].strip('"') == md5 and h["ContentLength"] == len(data))(
    c.head_object(Bucket=b, Key=pre + "a")))
t("ranged GET", lambda: c.get_object(Bucket=b, Key=pre + "a", Range="bytes=100-199")["Body"].read() == data[100:200])
t("GET whole object", lambda: c.get_object(Bucket=b, Key=pre + "a")["Body"].read() == data)
t("ListObjectsV2", lambda: [o["Key"] for o in c.list_objects_v2(Bucket=b, Prefix=pre)["Contents"]] == [pre + "a"])
t("CreateMultipartUpload", lambda: bool(mpu.setdefault("id", c.create_multipart_upload(Bucket=b, Key=pre + "m")["UploadId"])))
t("UploadPart", lambda: all(c.upload_part(Bucket=b, Key=pre + "m", UploadId=mpu["id"], PartNumber=i, Body=data)["ETag"]
                            .strip('"') == md5 for i in (1, 2)))
t("ListMultipartUploads", lambda: [u["UploadId"] for u in c.list_multipart_uploads(Bucket=b, Prefix=pre).get("Uploads", [])]
  == [mpu["id"]])
t("ListParts", lambda: [p["PartNumber"] for p in c.list_parts(Bucket=b, Key=pre + "m", UploadId=mpu["id"]).get("Parts", [])]
  == [1, 2])
def complete():
    c.complete_multipart_upload(Bucket=b, Key=pre + "m", UploadId=mpu["id"],
                                MultipartUpload={"Parts": [{"PartNumber": i, "ETag": f'"{md5}"'} for i in (1, 2)]})
    return c.get_object(Bucket=b, Key=pre + "m")["Body"].read() == data * 2
t("CompleteMultipartUpload", complete)
t("multipart ETag in S3's form (md5 of the parts' md5s, -N)", lambda: c.head_object(Bucket=b, Key=pre + "m")["ETag"]
  .strip('"') == hashlib.md5(bytes.fromhex(md5) * 2).hexdigest() + "-2")
def abort():
    u = c.create_multipart_upload(Bucket=b, Key=pre + "x")["UploadId"]
    c.upload_part(Bucket=b, Key=pre + "x", UploadId=u, PartNumber=1, Body=b"x")
    c.abort_multipart_upload(Bucket=b, Key=pre + "x", UploadId=u)
    return True
t("AbortMultipartUpload", abort)
def delete():
    c.delete_object(Bucket=b, Key=pre + "a")
    c.delete_objects(Bucket=b, Delete={"Objects": [{"Key": pre + "m"}]})
    return c.list_objects_v2(Bucket=b, Prefix=pre).get("KeyCount", 0) == 0
t("DeleteObject, DeleteObjects", delete)
print(json.dumps(res))
"""

#: ``python -m reshard ARGS`` in this process, each Python thread's CPU (user, sys) sampled from
#: /proc/self/task every 20 ms by a thread of its own and written, by thread name, to the file named by
#: ``$BENCH_THREADS_OUT`` at exit: where the client's CPU goes, by role (``fsspecIO`` is the event loop
#: every request and response of the store goes through). The sampler costs CPU itself (its own row).
THREADS_CODE = r"""
import atexit, collections, json, os, runpy, sys, threading, time
tck, last, stop = os.sysconf("SC_CLK_TCK"), {}, []
def read(t):
    try:
        f = open(f"/proc/self/task/{t.native_id}/stat").read().rsplit(")", 1)[1].split()
        last[(t.name, t.native_id)] = (int(f[11]) / tck, int(f[12]) / tck)
    except (OSError, TypeError):
        pass
def sample():
    while not stop:
        for t in threading.enumerate():
            read(t)
        time.sleep(0.02)
threading.Thread(target=sample, name="bench-sampler", daemon=True).start()
def dump():
    stop.append(1)
    for t in threading.enumerate():
        read(t)
    by = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for (name, _tid), (u, s) in last.items():
        k = name.split(" (")[0].rstrip("0123456789_")
        by[k][0] += u; by[k][1] += s; by[k][2] += 1
    with open(os.environ["BENCH_THREADS_OUT"], "w") as f:
        json.dump({k: {"user_s": round(u, 2), "sys_s": round(s, 2), "threads": n} for k, (u, s, n) in by.items()}, f)
atexit.register(dump)
sys.argv = ["reshard", *sys.argv[1:]]
runpy.run_module("reshard", run_name="__main__", alter_sys=True)
"""

#: What the measured single-process route (`reshard convert s3://SRC s3://DST`, the naive route's
#: download and boto3 upload) cannot do without; the other operations serve ``--workers``' streamed
#: uploads (resume: ListMultipartUploads, ListParts), a failed upload's clean-up (AbortMultipartUpload)
#: or reshard's ETag check (the multipart form: without it those objects are recorded as not checked).
NEEDED = ("PutObject", "HeadObject with ETag and size", "ranged GET", "GET whole object", "ListObjectsV2",
          "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload", "DeleteObject, DeleteObjects")


class S3rver(Server):
    """s3rver (Node.js) in a child process, objects kept as files in ``data``: `bench_s3.Server`'s face
    (``env``, ``endpoint``, its ``cpu_s`` and ``rss_mib`` of the child; its own start and ``stop``), so every row runs
    unchanged against either. s3rver knows one account (``S3RVER``/``S3RVER``) and checks each
    request's signature with it, so the children are given those credentials."""

    def __init__(self, binary: str, data: Path):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.env = child_env(self.endpoint)
        self.env.update({"AWS_ACCESS_KEY_ID": "S3RVER", "AWS_SECRET_ACCESS_KEY": "S3RVER"})
        data.mkdir(parents=True, exist_ok=True)
        self.log = data.with_name(data.name + ".log")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([binary, "-d", str(data), "-a", "127.0.0.1", "-p", str(self.port), "-s",
                                          "--configure-bucket", BUCKET], stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30.0
        while True:  # up once it takes a connection (it prints nothing when silent)
            if self.proc.poll() is not None:
                raise RuntimeError(f"s3rver did not start (exit {self.proc.returncode}): "
                                   f"{self.log.read_text(errors='replace').strip()[-300:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1.0).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("s3rver took no connection within 30 s") from None
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def find_s3rver(given: str | None) -> str | None:
    """The s3rver binary: ``--s3rver``, else ``$S3RVER_BIN``, else ``s3rver`` on ``PATH``; None if none is there."""
    for cand in (given, os.environ.get("S3RVER_BIN"), shutil.which("s3rver")):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def features(a, srv) -> dict[str, str]:
    """`FEATURES_CODE` run against ``srv``: each operation's verdict."""
    r = subprocess.run([a.python, "-c", FEATURES_CODE, BUCKET], env=srv.env, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        return {"feature check": (r.stderr.strip().splitlines() or ["no output"])[-1][:200]}
    return json.loads(r.stdout)


def start_server(a, work: Path, notes: list[str]) -> tuple[object, str, dict[str, str]]:
    """The server ``--server`` asks for, its name and its feature check; moto in s3rver's place (said in
    ``notes``) when s3rver is not there, does not start, or fails an operation of `NEEDED`."""
    if a.server == "s3rver":
        binary = find_s3rver(a.s3rver)
        if binary is None:
            notes.append(f"s3rver not found ({S3RVER_INSTALL}): fell back to moto")
        else:
            try:
                srv = S3rver(binary, work / "s3rver-data")
            except RuntimeError as exc:
                notes.append(f"{exc}: fell back to moto")
            else:
                got = features(a, srv)
                missing = [k for k in NEEDED if got.get(k) != "ok"]
                if not missing:
                    return srv, "s3rver", got
                srv.stop()
                notes.append("s3rver lacks what the measured route needs (" + "; ".join(f"{k}: {got.get(k)}" for k in missing)
                             + "): fell back to moto")
    srv = Server(a.python)
    return srv, "moto", features(a, srv)

#: Removes every object under a prefix (between runs; not timed).
EMPTY_CODE = r"""
import sys
import boto3
bucket, prefix = sys.argv[1], sys.argv[2].strip("/") + "/"
c = boto3.client("s3", region_name="us-east-1")
for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
    keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
    if keys:
        c.delete_objects(Bucket=bucket, Delete={"Objects": keys})
"""

#: sha256 of `.metadata` and the data objects under a prefix (what `digest_outputs` gives for a folder).
DIGEST_CODE = r"""
import hashlib, json, sys
import boto3
bucket, prefix = sys.argv[1], sys.argv[2].strip("/") + "/"
c = boto3.client("s3", region_name="us-east-1")
out = {}
for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
    for o in page.get("Contents", []):
        name = o["Key"][len(prefix):]
        if name == ".metadata" or name.endswith(".distcp"):
            out[name] = hashlib.sha256(c.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()).hexdigest()
print(json.dumps(out))
"""


def helper(a, srv: Server, code: str, *args: str) -> str:
    r = subprocess.run([a.python, "-c", code, *args], env=srv.env, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"helper failed: {r.stderr.strip().splitlines()[-1:]}")
    return r.stdout


def timeline(argv: list[str], env: dict, srv: Server, cwd: Path, timeout: float, every: float = 0.25) -> dict:
    """``argv`` run once more, the client's and the server's CPU sampled every ``every`` s (`/proc/PID/stat`):
    how long the client ran alone before the server had work (``head_s``: until the server first used a
    fifth of a CPU), how long the server ran alone after the client's last busy sample (``tail_s``), and
    the series (seconds from the start, client and server CPUs used in the interval)."""
    tck = os.sysconf("SC_CLK_TCK")

    def cpu(pid: int) -> float | None:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / tck

    t0, s0 = time.monotonic(), srv.cpu_s()
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    series, last = [], (0.0, 0.0, s0)
    while proc.poll() is None and time.monotonic() - t0 < timeout:
        time.sleep(every)
        t, c, sv = time.monotonic() - t0, cpu(proc.pid), srv.cpu_s()
        if c is None:
            break
        dt = t - last[0]
        series.append((round(t, 2), round((c - last[1]) / dt, 2), round((sv - last[2]) / dt, 2)))
        last = (t, c, sv)
    code = proc.wait()
    return dict(spans(series), exit=code, wall_s=round(time.monotonic() - t0, 2), server_cpu_s=round(srv.cpu_s() - s0, 2),
                series=series)


def spans(series: list) -> dict:
    """Of a `timeline` series ``(t, client CPUs, server CPUs)``: the head (the client alone until the server
    first used a fifth of a CPU), the server's busy span (from then to its last such sample) and the
    time within it the client was idle (under a fifth of a CPU) while the server worked; the server's CPU
    as sampled."""
    used = round(sum(sv * (t - (series[i - 1][0] if i else 0.0)) for i, (t, _c, sv) in enumerate(series)), 2)
    busy = [i for i, (_t, _c, sv) in enumerate(series) if sv >= 0.2]
    if not busy:
        return {"head_s": None, "server_busy_s": None, "server_alone_s": None, "server_cpu_s": used}
    first, last = busy[0], busy[-1]
    start = series[first - 1][0] if first else 0.0
    alone = sum(series[i][0] - (series[i - 1][0] if i else 0.0)
                for i in range(first, last + 1) if series[i][1] < 0.2 and series[i][2] >= 0.2)
    return {"head_s": round(start, 2), "server_busy_s": round(series[last][0] - start, 2), "server_alone_s": round(alone, 2),
            "server_cpu_s": used}


def rows_of(a, srv: Server, work: Path, problems: list[str]) -> dict | None:
    local = work / "src"
    rows_, cols_ = a.shape
    facts = build(BUILD_SHARDED, [str(local), str(a.ranks), str(a.tensors), str(rows_), str(cols_)], a=a, cwd=work,
                  what=f"the dcp.save checkpoint ({a.ranks} ranks, {a.tensors} x {rows_}x{cols_} float32)",
                  problems=problems)
    if facts is None:
        return None
    up = upload(a, srv, local, "src", work, problems)
    if up is None:
        return None
    src, to = f"s3://{BUCKET}/src", f"dp={max(1, a.ranks // 2)}"
    conv = ["--to", to, "--no-profile", "--json", "--quiet"]
    env_tree = dict(srv.env, PYTHONPATH=str(ROOT), RESHARD_STAGING_DIR=str(work / "staging"))
    trees = {"s2s": env_tree}
    if a.base_tree:
        trees["s2s_base"] = dict(srv.env, PYTHONPATH=str(a.base_tree), RESHARD_STAGING_DIR=str(work / "staging"))
    rsh = [a.python, "-m", "reshard", "convert"]
    names = ["s2s", "naive_download", "naive_convert", "naive_upload", "naive_total", "local"] + (["s2s_threads"] if a.threads else [])
    if a.base_tree:
        names.insert(1, "s2s_base")
    rows: dict[str, list[dict]] = {k: [] for k in names}
    identical = None
    timelines: list[dict] = []
    out, dl = work / "out", work / "download"

    def timed(name: str, argv: list[str], env: dict, i: int) -> dict:
        srv.env, saved = env, srv.env
        try:
            r = slim(measured(argv, srv=srv, cwd=work, timeout=a.timeout))
        finally:
            srv.env = saved
        rows[name].append(r)
        say(name, i, a.runs, r)
        return r

    for i in range(a.runs):
        for tree, env in trees.items():  # interleaved: each round runs every row once
            helper(a, srv, EMPTY_CODE, BUCKET, "dst")
            r = timed(tree, [*rsh, src, f"s3://{BUCKET}/dst", *conv], env, i)
            if i == 0 and tree == "s2s" and r["exit"] == 0:
                identical = {"store": json.loads(helper(a, srv, DIGEST_CODE, BUCKET, "dst"))}
        helper(a, srv, EMPTY_CODE, BUCKET, "dst")
        clear(dl)
        clear(out)
        d = timed("naive_download", [a.python, "-c", DOWNLOAD_CODE, src, str(dl)], srv.env, i)
        c = timed("naive_convert", [*rsh, str(dl), str(out), *conv], env_tree, i)
        u = timed("naive_upload", [a.python, "-c", UPLOAD_CODE, str(out), BUCKET, "dst"], srv.env, i)
        rows["naive_total"].append(combine([d, c, u]))
        helper(a, srv, EMPTY_CODE, BUCKET, "dst")
        clear(dl)
        clear(out)
        lo = timed("local", [*rsh, str(local), str(out), *conv], env_tree, i)
        if a.threads:  # apart from the rows above: the same store-to-store command, its threads sampled
            helper(a, srv, EMPTY_CODE, BUCKET, "dst")
            said = work / "threads.json"
            r = timed("s2s_threads", [a.python, "-c", THREADS_CODE, "convert", src, f"s3://{BUCKET}/dst", *conv],
                      dict(env_tree, BENCH_THREADS_OUT=str(said)), i)
            r["threads"] = json.loads(said.read_text()) if r["exit"] == 0 and said.is_file() else None
        if a.timeline:  # apart from the rows above: the same command, client and server CPU sampled over time
            helper(a, srv, EMPTY_CODE, BUCKET, "dst")
            tl = timeline([*rsh, src, f"s3://{BUCKET}/dst", *conv], env_tree, srv, work, a.timeout)
            timelines.append(tl)
            print(f"  [{i + 1}/{a.runs}] timeline: {tl['wall_s']} s, client alone at the start {tl['head_s']} s, "
                  f"server busy {tl['server_busy_s']} s, {tl['server_alone_s']} s of it alone, exit {tl['exit']}",
                  file=sys.stderr, flush=True)
        if identical is not None and "local" not in identical and lo["exit"] == 0:
            identical["local"] = digest_outputs(out)
            identical["equal"] = identical["store"] == identical["local"]
            identical["files"] = len(identical["local"])
        clear(out)
    for k, v in rows.items():
        for r in v:
            if r["exit"] != 0:
                problems.append(f"{k}: exit {r['exit']}: {r.get('error', '')}")
    if identical is None or not identical.get("equal"):
        problems.append("the store-to-store output was not shown byte-identical to the local conversion's")
    return {"ranks": a.ranks, "tensors": a.tensors, "shape": [rows_, cols_], "to": to, "build": facts, "upload": up,
            "bytes_on_disk": dir_bytes(local), "identical_to_local": identical, "timelines": timelines,
            "rows": {k: summary(v) for k, v in rows.items()}}


def f(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def markdown(rep: dict) -> str:
    b = rep["result"]
    rows = b["rows"]
    gib = b["bytes_on_disk"] / (1 << 30)
    labels = {"s2s": "`reshard convert s3://src s3://dst` (this tree)",
              "s2s_base": f"`reshard convert s3://src s3://dst` (base: `{rep['base_tree']}`)",
              "naive_download": "naive: download (`fs.get`)", "naive_convert": "naive: `reshard convert DIR OUT`",
              "naive_upload": "naive: upload (boto3, 8 threads)", "naive_total": "**naive route, total**",
              "local": "`reshard convert LOCAL OUT` (client-CPU anchor)",
              "s2s_threads": "store to store again, its threads' CPU sampled (`--threads`; not in the ratios)"}
    lines = [f"Measured {rep['when']} on {rep['machine']}; server: {rep['server']}; load average {rep['load_start']} at "
             f"the start, {rep['load_end']} at the end. Checkpoint: `dcp.save` on {b['ranks']} gloo ranks, {b['tensors']} float32 "
             f"tensors {b['shape'][0]}x{b['shape'][1]} `Shard(0)` ({gib:.2f} GiB, {b['ranks']} objects), "
             f"`--to {b['to']}`; {rep['runs']} interleaved rounds, medians.", "",
             "| command | exits | median wall (s) | min-max wall (s) | median client CPU (s) | median peak RSS (MiB) | median server CPU (s) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for note in rep.get("notes", []):
        lines.insert(1, f"Note: {note}.")
    for k, v in rows.items():
        lines.append(f"| {labels[k]} | {', '.join(map(str, v['exits']))} | {f(v['median_wall_s'])} | "
                     f"{f(v['min_wall_s'])}-{f(v['max_wall_s'])} | {f(v['median_cpu_s'])} | "
                     f"{f(v['median_peak_rss_mib'], 0)} | {f(v['median_server_cpu_s'])} |")
    s2s, naive, local = rows["s2s"], rows["naive_total"], rows["local"]
    ratios = [(r["wall_s"] / n["wall_s"]) for r, n in zip(s2s["runs"], naive["runs"])]
    cpu = [(r["cpu_s"] / lo["cpu_s"]) for r, lo in zip(s2s["runs"], local["runs"])]
    lines += ["", f"Store to store against the naive route, wall: **{statistics.median(ratios):.2f}x** (median of the "
              f"per-round ratios {', '.join(f'{x:.2f}' for x in ratios)}); client CPU against a local convert: "
              f"**{statistics.median(cpu):.2f}x** (per round {', '.join(f'{x:.2f}' for x in cpu)})."]
    if "s2s_base" in rows:
        base = [(r["wall_s"] / n["wall_s"]) for r, n in zip(rows["s2s_base"]["runs"], naive["runs"])]
        bcpu = [(r["cpu_s"] / lo["cpu_s"]) for r, lo in zip(rows["s2s_base"]["runs"], local["runs"])]
        lines.append(f"Base, same rounds: {statistics.median(base):.2f}x the naive route's wall, "
                     f"{statistics.median(bcpu):.2f}x a local convert's client CPU.")
    sampled = [r["threads"] for r in rows.get("s2s_threads", {}).get("runs", []) if r.get("threads")]
    if sampled:
        lines += ["", "Client CPU of the store-to-store command by thread (`--threads`; user + sys, s, per round):", "",
                  "| thread (by name) | " + " | ".join(f"round {i + 1}" for i in range(len(sampled))) + " |",
                  "|---|" + "---:|" * len(sampled)]
        for k in sorted({k for t in sampled for k in t}, key=lambda k: -max(t.get(k, {}).get("user_s", 0) + t.get(k, {}).get("sys_s", 0) for t in sampled)):
            cells = [(f"{t[k]['user_s'] + t[k]['sys_s']:.2f} ({t[k]['user_s']:.2f} + {t[k]['sys_s']:.2f})" if k in t else "-")
                     for t in sampled]
            lines.append(f"| `{k}` x{max(t.get(k, {}).get('threads', 0) for t in sampled)} | " + " | ".join(cells) + " |")
    tls = [dict(spans(t["series"]), **t) for t in b.get("timelines", []) if t["exit"] == 0]
    if tls:
        lines += ["", "Timeline of the store-to-store command (`--timeline`, client and server CPU sampled every 0.25 s), per "
                  "round: its wall; the client alone before the server first used a fifth of a CPU (head); the span the "
                  "server was busy from then on, and the part of it the client was idle; the server's CPU in the run; "
                  "0.7x the naive route's wall in the same round:", "",
                  "| round | wall (s) | head (s) | server busy (s) | of it, the client idle (s) | server CPU, sampled (s) | 0.7x naive route (s) |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for i, t in enumerate(tls):
            n = naive["runs"][i]["wall_s"] if i < len(naive["runs"]) else None
            lines.append(f"| {i + 1} | {t['wall_s']:.2f} | {f(t['head_s'])} | {f(t['server_busy_s'])} | "
                         f"{f(t['server_alone_s'])} | {f(t.get('server_cpu_s'))} | {f(0.7 * n if n is not None else None)} |")
    ident = b["identical_to_local"] or {}
    lines.append(f"Objects committed by the store-to-store conversion against the local conversion's files "
                 f"(`.metadata` and data, {ident.get('files', 0)} files): "
                 f"{'byte-identical' if ident.get('equal') else 'NOT shown identical'}.")
    feats = rep.get("features", {})
    lacking = [f"{k} ({v})" for k, v in feats.items() if v != "ok"]
    lines.append(f"The server's feature check ({len(feats)} operations): "
                 + ("all as S3 answers." if not lacking else "differs from S3 in " + "; ".join(lacking) + "."))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench-results"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--tensors", type=int, default=32)
    ap.add_argument("--shape", default="4096x2048")
    ap.add_argument("--base-tree", default=None, help="another checkout whose store-to-store run is a row too")
    ap.add_argument("--server", choices=("moto", "s3rver"), default="moto", help="the S3 server measured against")
    ap.add_argument("--s3rver", default=None, help="path of the s3rver binary (" + S3RVER_INSTALL + ")")
    ap.add_argument("--threads", action="store_true", help="after each round, the store-to-store command again with "
                    "each thread's CPU sampled (a row of its own, not in the ratios)")
    ap.add_argument("--timeline", action="store_true", help="after each round, the store-to-store command again with "
                    "the client's and the server's CPU sampled over time (not in the ratios)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--tmp", default=None)
    ap.add_argument("--timeout", type=float, default=1800.0)
    a = ap.parse_args(argv)
    if a.quick:
        a.ranks, a.tensors, a.shape, a.runs = 4, 4, "1024x1024", 1
    a.shape = tuple(int(x) for x in a.shape.lower().split("x"))
    problems: list[str] = []
    work = Path(tempfile.mkdtemp(prefix="bench-store-", dir=a.tmp))
    notes: list[str] = []
    srv, server, feats = start_server(a, work, notes)
    for note in notes:
        print(note, file=sys.stderr, flush=True)
    m = machine(work)
    load_start = round(os.getloadavg()[0], 2)
    t0 = time.time()
    try:
        result = rows_of(a, srv, work, problems)
    finally:
        srv.stop()
        clear(work)
    if result is None:
        print("\n".join(problems), file=sys.stderr)
        return 2
    rep = report_head(m, load_start, a.runs, t0)
    rep.update({"server": server, "features": feats, "notes": notes, "base_tree": a.base_tree, "result": result,
                "problems": problems})
    return write_results(Path(a.out), "bench_store", rep, markdown(rep), problems)


def report_head(m: dict, load_start: float, runs: int, t0: float) -> dict:
    """The fields every store benchmark's record opens with: when, on what machine, the load, how long."""
    said = f"{m['nproc']} CPUs, {m['ram_gib']} GiB RAM, {m['platform']}, Python {m['python']}, commit `{m['commit']}`"
    return {"when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": said,
            "load_start": load_start, "load_end": round(os.getloadavg()[0], 2), "runs": runs,
            "seconds": round(time.time() - t0)}


def write_results(out: Path, stem: str, rep: dict, md: str, problems: list[str]) -> int:
    """``stem``.json and .md in ``out``, the markdown printed, the problems on stderr; the exit code."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in ((f"{stem}.json", json.dumps(rep, indent=1)), (f"{stem}.md", md)):
        (out / name).write_text(text)
    print(md)
    if problems:
        print("\n".join(problems), file=sys.stderr)
    return 2 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
