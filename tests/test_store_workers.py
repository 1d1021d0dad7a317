"""A distributed conversion streamed into object storage (issue 46), against a real S3 server.

moto's server on localhost (`tests/s3_server.py`), the workers real torchrun processes (``--workers``
starts torchrun inside the command; two torchrun agents with a c10d rendezvous stand for two nodes).

- `test_workers_stream_into_the_store_byte_identical_and_torch_loads_it`: ``--workers 2`` from a local
  folder and from the store into a
  prefix: every object byte-identical to a single process's local conversion, `.metadata` last and no
  marker left, torch's `FsspecReader` + `dcp.load` strict and bitwise, `verify` exit 0 against the
  source and against the local conversion, the report naming each worker's objects and disk; then
  ``--overwrite`` by dp=1 (worker 1 writes no file): the earlier output's second data file is deleted.
- `test_local_disk_stays_near_the_buffer_on_a_checkpoint_ten_times_larger`: a 160 MiB checkpoint
  (real `dcp.save` of DTensors) converted with ``--buffer-memory 16MiB``, from a local folder and from
  the store: each worker's local disk (its spill folder and, from the store, its read window), polled
  from outside every few milliseconds, never exceeds the buffer plus one part; from the store each worker
  fetched only its share of the source's bytes; verified.
- `test_two_nodes_a_lost_node_and_the_resume`: two torchrun agents (``--nnodes 2``, c10d rendezvous on
  localhost); the node of worker 1 is killed (its agent and worker) mid-upload: nothing is committed,
  the other node exits non-zero with one paragraph naming worker 1; the same two commands again
  resume, keep the parts worker 1 had sent (proven by their MD5) and commit the bytes a single
  process writes.
- `test_one_process_sends_each_file_behind_its_writer_and_a_killed_upload_continues` (issue 45): one
  process, no ``--workers``: the data files' parts go while the copy still writes, the rerun of a run
  killed mid-copy resumes its journal and continues its multipart uploads, keeping the proven parts.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import cli, once_per_run
from s3_server import s3_server

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def s3():
    with s3_server() as server:
        yield server


@pytest.fixture(autouse=True)
def staging(tmp_path_factory, monkeypatch) -> Path:
    folder = tmp_path_factory.mktemp("staging")
    monkeypatch.setenv("RESHARD_STAGING_DIR", str(folder))
    return folder


@pytest.fixture(scope="module")
def local_dp2(plain_fsdp2_ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sw") / "local_dp2"
    code, _out, err = cli(["convert", plain_fsdp2_ckpt, out, "--to", "dp=2", "--quiet"])
    assert code == 0, err
    return out


def _objects(s3, prefix: str) -> dict[str, bytes]:
    c = s3.client()
    return {k: c.get_object(Bucket=s3.bucket, Key=f"{prefix}/{k}")["Body"].read() for k in s3.keys(prefix)}


def _report(s3, prefix: str) -> dict:
    """The report the conversion committed beside its output (the workers print theirs themselves)."""
    return json.loads(s3.client().get_object(Bucket=s3.bucket, Key=f"{prefix}/reshard-report.json")["Body"].read())


def _same_as_local(s3, prefix: str, local: Path) -> None:
    got = _objects(s3, prefix)
    assert ".reshard-uploading" not in got, sorted(got)
    for p in sorted(local.iterdir()):
        if p.suffix == ".distcp" or p.name == ".metadata":
            assert got[p.name] == p.read_bytes(), p.name


def _load_with_fsspec_reader(url: str, like: Path) -> None:
    """Every tensor at ``url`` loaded strictly by torch's own `FsspecReader`, bitwise equal to ``like``'s."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(str(like)).read_metadata()
    shapes = {k: m for k, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    got = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in shapes.items()}
    want = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in shapes.items()}
    dcp.load(got, storage_reader=FsspecReader(url), planner=dcp.DefaultLoadPlanner(allow_partial_load=False))
    dcp.load(want, storage_reader=dcp.FileSystemReader(str(like)))
    assert got
    for k in want:
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8)), k


@pytest.mark.parametrize("from_store", [False, True], ids=["local-to-store", "store-to-store"])
def test_workers_stream_into_the_store_byte_identical_and_torch_loads_it(s3, plain_fsdp2_ckpt, local_dp2, from_store):
    prefix = f"w2/dp2-{int(from_store)}"
    dst = s3.url(prefix)
    src = s3.upload(plain_fsdp2_ckpt, "w2/src") if from_store else plain_fsdp2_ckpt
    code, _out, err = cli(["convert", src, dst, "--to", "dp=2", "--workers", "2", "--quiet"])
    assert code == 0, err
    report = _report(s3, prefix)
    assert report["destination"] == dst and report["workers"] == 2
    assert report["verification"]["equal"] is True
    sent = report["verification"]["sent"]
    assert sent["objects"] == 2 and sent["objects_checked_by_etag"] == 2 and sent["items_checked_as_sent"] > 0
    assert [w["worker"] for w in report["streamed"]["workers"]] == [0, 1]
    _same_as_local(s3, prefix, local_dp2)
    _load_with_fsspec_reader(dst, local_dp2)
    for a in (src, local_dp2):
        code, _o, err = cli(["verify", a, dst])
        assert code == 0, err
    if not from_store:  # --overwrite by a layout with fewer files: the earlier output's other objects go
        code, _o, err = cli(["convert", src, dst, "--to", "dp=1", "--workers", "2", "--overwrite", "--quiet"])
        assert code == 0, err
        keys = s3.keys(prefix)
        assert "__0_0.distcp" in keys and "__1_0.distcp" not in keys and ".reshard-uploading" not in keys, keys
        code, _o, err = cli(["verify", src, dst])
        assert code == 0, err


@pytest.fixture(scope="module")
def big_ckpt(tmp_path_factory) -> Path:
    """160 MiB of DTensors saved by `dcp.save` on 2 gloo ranks: ten times the buffer the test gives."""
    import torch

    from reshard.testing.synthetic import make_sharded

    return Path(once_per_run(tmp_path_factory, "store-workers-big", lambda w: str(make_sharded(
        w / "ckpt", world_size=2, n_tensors=10, shape=(1024, 4096), dtype=torch.float32))))


def _disk_by_worker(folder: Path) -> dict[str, int]:
    """Bytes each worker's local folders hold on disk now (allocated blocks): its spill folder and, from a
    store source, its read window (``reads-<rank>``), by worker."""
    out: dict[str, int] = {}
    for pattern in ("spill-*/*", "reads-*/*"):
        try:
            found = list(folder.rglob(pattern))
        except OSError:  # a folder removed while listed (the run ending): the next poll sees the rest
            continue
        for p in found:
            worker = "worker-" + p.parent.name.rsplit("-", 1)[-1]
            try:
                out[worker] = out.get(worker, 0) + p.stat().st_blocks * 512
            except OSError:
                pass
    return out


@pytest.mark.parametrize("from_store", [False, True], ids=["local-source", "store-source"])
def test_local_disk_stays_near_the_buffer_on_a_checkpoint_ten_times_larger(s3, big_ckpt, staging, tmp_path, from_store):
    from reshard.storage.objectstore.stream import MIN_PART

    buffer = 16 << 20
    size = sum(p.stat().st_size for p in big_ckpt.glob("*.distcp"))
    assert size >= 10 * buffer
    peak: dict[str, int] = {}
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            for worker, n in _disk_by_worker(staging).items():
                peak[worker] = max(peak.get(worker, 0), n)
            time.sleep(0.003)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    tag = "store" if from_store else "local"
    src = s3.upload(big_ckpt, f"w2/src-{tag}") if from_store else big_ckpt
    dst = s3.url(f"w2/big-{tag}")
    try:
        code, _out, err = cli(["convert", src, dst, "--to", "dp=4", "--workers", "2", "--buffer-memory", "16MiB",
                               "--quiet"])
    finally:
        stop.set()
        watcher.join()
    assert code == 0, err
    report = _report(s3, f"w2/big-{tag}")
    assert report["verification"]["equal"] is True
    assert report["bytes_written"] >= 10 * buffer
    assert sorted(peak) == ["worker-0", "worker-1"], peak
    assert all(0 < n <= buffer + MIN_PART + (1 << 20) for n in peak.values()), (peak, report["streamed"])
    for w in report["streamed"]["workers"]:  # each worker's own measure agrees
        reads = w["reads"]
        assert (reads is not None) == from_store, w
        assert w["peak_bytes"] + (reads["peak_bytes"] if reads else 0) <= buffer + MIN_PART + (1 << 20), w
        if from_store:  # only its share's rows were fetched (half the source each), not whole objects
            assert reads["fetched_bytes"] < 0.6 * size, w
    code, _o, err = cli(["verify", src, dst])
    assert code == 0, err


def _node(node: int, port: int, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """One torchrun agent standing for node ``node`` of two, rendezvous (c10d) on localhost:``port``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
           "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", f"reshard-{port}", "--max-restarts", "0", "-m", "reshard", *argv]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _two_nodes(argv: list[str], env: dict[str, str], tmp: Path, tag: str, *, kill_rank: int | None = None,
               when: Path | None = None, pause_at: str = "") -> tuple[list[int], list[str]]:
    """Both nodes run ``argv``; with ``kill_rank``, the node whose worker has that RANK is killed whole
    (agent and worker, SIGKILL) once ``when`` (the fault log) shows that worker paused."""
    import psutil

    from s3_server import free_port

    port = free_port()
    logs = [tmp / f"{tag}-node{n}.log" for n in (0, 1)]
    agents = [_node(0, port, argv, env, logs[0])]
    _listening(port)  # node 0's agent hosts the rendezvous: node 1 starts once it does (under load, >1 s)
    agents.append(_node(1, port, argv, env, logs[1]))
    if kill_rank is not None:
        deadline = time.time() + 240
        while time.time() < deadline and not (when.exists() and pause_at in when.read_text()):
            time.sleep(0.1)
        assert when.exists(), [p.read_text()[-2000:] for p in logs]
        victim = None
        for a in agents:
            for child in psutil.Process(a.pid).children(recursive=True):
                try:
                    if child.environ().get("RANK") == str(kill_rank):
                        victim = a
                except psutil.Error:
                    pass
        assert victim is not None
        for p in [*psutil.Process(victim.pid).children(recursive=True), psutil.Process(victim.pid)]:
            with_suppressed(lambda p=p: p.send_signal(signal.SIGKILL))
    codes = [a.wait(timeout=300) for a in agents]
    return codes, [p.read_text() for p in logs]


def _listening(port: int, timeout: float = 120.0) -> None:
    """Until something accepts connections on localhost:``port``."""
    import socket

    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"nothing listens on port {port} after {timeout} s")


def with_suppressed(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - already gone
        pass


def test_two_nodes_a_lost_node_and_the_resume(s3, big_ckpt, staging, tmp_path):
    big_local = tmp_path / "local"
    code, _o, err = cli(["convert", big_ckpt, big_local, "--to", "dp=4", "--quiet"])
    assert code == 0, err
    dst = s3.url("nodes/dp4")
    src = s3.upload(big_ckpt, "nodes/src")  # store to store, two nodes
    argv = ["convert", src, dst, "--to", "dp=4", "--buffer-memory", "16MiB", "--quiet"]
    env = dict(os.environ, PYTHONPATH=str(REPO), RESHARD_STAGING_DIR=str(staging))
    faults = tmp_path / "faults"
    killed_env = dict(env, RESHARD_FAULT_RANK="1", RESHARD_FAULT_COUNT=str(faults),
                      RESHARD_FAULT_SLEEP_AT="part __1_0.distcp 3:120")
    codes, logs = _two_nodes(argv, killed_env, tmp_path, "first", kill_rank=1, when=faults,
                             pause_at="part __1_0.distcp 3")
    assert sorted(codes) != [0, 0], logs
    assert ".metadata" not in s3.keys("nodes/dp4")  # nothing committed
    survivor = next(log for log in logs if "worker 1" in log)
    assert "worker 1 (node" in survivor and "Nothing was committed" in survivor, survivor[-3000:]

    codes, logs = _two_nodes(argv, env, tmp_path, "again")
    assert codes == [0, 0], logs
    report = _report(s3, "nodes/dp4")
    assert report["verification"]["equal"] is True
    assert report["streamed"]["parts_kept_from_an_interrupted_upload"] >= 2, report["streamed"]
    _same_as_local(s3, "nodes/dp4", big_local)
    _load_with_fsspec_reader(dst, big_local)
    code, _o, err = cli(["verify", src, dst])
    assert code == 0, err


def test_the_read_window_shares_rows_and_admits_a_unit_larger_than_its_budget(s3, tmp_path):
    """`RangeWindow` against the real server: a unit larger than the budget is admitted alone (no
    deadlock), bytes two units hold stay until both release them, one merged GET for contiguous
    blocks, every block punched at the end; the bytes are the object's."""
    from reshard.storage.objectstore.remote import open_remote
    from reshard.storage.objectstore.window import BLOCK, LOCATING, RangeWindow

    folder = tmp_path / "obj"
    folder.mkdir()
    data = os.urandom(4 * BLOCK)
    (folder / "__0_0.distcp").write_bytes(data)
    rc = open_remote(s3.upload(folder, "window/src"))
    window = RangeWindow(rc, tmp_path / "reads", LOCATING + BLOCK)  # room for one block of units
    local = tmp_path / "reads" / "__0_0.distcp"
    try:
        big = window.need([("__0_0.distcp", 10, 3 * BLOCK - 20)])  # three blocks: over the budget, admitted alone
        window.wait(big)
        assert local.read_bytes()[: 3 * BLOCK] == data[: 3 * BLOCK]
        shared = window.need([("__0_0.distcp", BLOCK + 5, 100)])  # inside a block `big` holds: nothing new
        window.wait(shared)
        window.release(big)
        with open(local, "rb") as f:
            assert f.read(BLOCK) == bytes(BLOCK)  # punched: zeros
            f.seek(BLOCK)
            assert f.read(BLOCK) == data[BLOCK:2 * BLOCK]  # still held by `shared`
        window.release(shared)
        assert local.stat().st_blocks == 0
        stats = window.stats()
        assert stats["peak_bytes"] == 3 * BLOCK and stats["fetched_bytes"] == 3 * BLOCK, stats
        assert stats["requests"] == 1, stats  # the three blocks by one ranged GET
    finally:
        window.close()
    assert not (tmp_path / "reads").exists()


def test_a_corrupt_source_item_in_the_store_is_named_there_and_nothing_is_committed(s3, big_ckpt, tmp_path):
    """A storage byte flipped in one source object: the worker that fetched the item (whole, with its tensor)
    fails with exit 2, the paragraph names the object in the store (not its local read window), the run ends
    (threads waiting for tensors the copy never reached stop) and nothing is committed."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(big_ckpt, bad)
    f = bad / "__1_0.distcp"
    data = bytearray(f.read_bytes())
    data[len(data) // 2 + (3 << 20)] ^= 0xFF  # inside an item's storage (items of 8 MiB, ten per file)
    f.write_bytes(bytes(data))
    src = s3.upload(bad, "w2/corrupt")
    code, _out, err = cli(["convert", src, s3.url("w2/corrupt-out"), "--to", "dp=1", "--workers", "2", "--quiet"])
    assert code == 2, err
    assert f"{src}/__1_0.distcp" in err and "fails its CRC-32" in err, err
    assert "reads-" not in err, err
    assert ".metadata" not in s3.keys("w2/corrupt-out")


def test_one_process_sends_each_file_behind_its_writer_and_a_killed_upload_continues(s3, big_ckpt, staging, tmp_path,
                                                                                    monkeypatch):
    """`convert LOCAL s3://...` in one process (issue 45): each data file's parts go while the copy is
    still writing (paused after 12 of its 20 items, a part lands before the last item is written), every
    item checked as sent, the objects the local conversion's bytes, checked by ETag. SIGKILLed mid-copy
    once its first part is in the store, the same command resumes the copy from its journal (items
    kept, each proven) and continues that multipart upload: the part is kept (its MD5 equals that of
    the bytes it would send), the rest sent, the result again the local conversion's bytes, and no
    multipart upload is left unfinished; an object someone else puts under the prefix once the upload has
    begun is left as it is (never deleted). Killed so again and run with ``--restart``, it keeps nothing:
    the unfinished upload is aborted and every part sent again."""
    import forked

    local, seen = tmp_path / "local", tmp_path / "local-events"
    monkeypatch.setenv("RESHARD_FAULT_COUNT", str(seen))
    code, _o, err = cli(["convert", big_ckpt, local, "--to", "dp=2", "--quiet"])
    assert code == 0, err
    twelfth = [x for x in (ln.split(" ", 1)[1] for ln in seen.read_text().splitlines()) if x.startswith("item ")][11]
    events = tmp_path / "events"
    monkeypatch.setenv("RESHARD_FAULT_COUNT", str(events))
    monkeypatch.setenv("RESHARD_FAULT_SLEEP_AT", f"{twelfth}:2")  # the copy paused after 12 of its 20 items
    c, put_at = s3.client(), []

    def second_writer() -> None:  # someone else's object under the prefix once the upload has begun
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if events.is_file() and " part " in events.read_text():
                c.put_object(Bucket=s3.bucket, Key="one/a/notes.txt", Body=b"someone else's")
                put_at.append(time.monotonic())
                return
            time.sleep(0.02)

    writer = threading.Thread(target=second_writer)
    writer.start()
    code, out, err = cli(["convert", big_ckpt, s3.url("one/a"), "--to", "dp=2", "--quiet", "--json"])
    returned = time.monotonic()
    writer.join()
    assert code == 0, err
    assert put_at and put_at[0] < returned  # during the run
    assert c.get_object(Bucket=s3.bucket, Key="one/a/notes.txt")["Body"].read() == b"someone else's"  # not ours: kept
    monkeypatch.delenv("RESHARD_FAULT_COUNT")
    monkeypatch.delenv("RESHARD_FAULT_SLEEP_AT")
    up = json.loads(out)["uploaded"]
    streamed = up["streamed"]
    assert streamed["objects"] == 2 and streamed["parts_sent"] >= 4 and streamed["items_checked_as_sent"] >= 10, up
    assert up["checked_by_etag"] == up["objects"] and up["not_checked"] == 0, up
    labels = [ln.split(" ", 1)[1] for ln in events.read_text().splitlines()]
    items = [i for i, x in enumerate(labels) if x.startswith("item ")]
    parts = [i for i, x in enumerate(labels) if x.startswith("part ")]
    assert parts and items and parts[0] < items[-1], labels  # sent while the copy still wrote
    _same_as_local(s3, "one/a", local)

    argv = ["convert", big_ckpt, s3.url("one/b"), "--to", "dp=2", "--quiet"]
    r = forked.run(argv, env={**os.environ, "RESHARD_FAULT_SLEEP_AT": f"{twelfth}:2",  # killed mid-copy
                              "RESHARD_FAULT_KILL_AT": "part __0_0.distcp 1"})
    assert r.returncode == -9, r.stderr
    assert ".metadata" not in s3.keys("one/b")
    code, out, err = cli([*argv, "--json"])
    assert code == 0, err
    report = json.loads(out)
    assert report["uploaded"]["streamed"]["parts_kept"] >= 1, report["uploaded"]
    from reshard.render.report import store_lines

    said = [ln for ln in store_lines(report) if ln.startswith("streamed")]
    assert said and "kept from the interrupted upload" in said[0], store_lines(report)
    assert report["resume"]["resumed"] and report["resume"]["items_kept"] >= 1, report["resume"]  # the journal's
    _same_as_local(s3, "one/b", local)
    assert not s3.client().list_multipart_uploads(Bucket=s3.bucket, Prefix="one/").get("Uploads")

    # --restart keeps nothing of the killed run: its unfinished uploads aborted, every part sent again
    argv = ["convert", big_ckpt, s3.url("one/c"), "--to", "dp=2", "--quiet"]
    r = forked.run(argv, env={**os.environ, "RESHARD_FAULT_SLEEP_AT": f"{twelfth}:2",
                              "RESHARD_FAULT_KILL_AT": "part __0_0.distcp 1"})
    assert r.returncode == -9, r.stderr
    assert s3.client().list_multipart_uploads(Bucket=s3.bucket, Prefix="one/c/").get("Uploads")
    code, out, err = cli([*argv, "--restart", "--json"])
    assert code == 0, err
    report = json.loads(out)
    assert report["uploaded"]["streamed"]["parts_kept"] == 0 and not report["resume"]["resumed"], report["uploaded"]
    _same_as_local(s3, "one/c", local)
    assert not s3.client().list_multipart_uploads(Bucket=s3.bucket, Prefix="one/").get("Uploads")
