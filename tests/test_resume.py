"""Resuming a killed conversion (`reshard.storage.files.journal`): the rerun keeps what its journal vouches for.

Real ``reshard convert`` processes (forked from a server that imported reshard and torch
once, `tests/forked.py`: a real process, a real SIGKILL, no torch import per run; and
``--workers 2``, which runs torchrun) on a
private copy of the session's reference checkpoint, killed with SIGKILL at write events
(``RESHARD_FAULT_KILL_AT``, the test hook of `reshard.engine.conversion`), then run again with
the same command. ``SOURCE_DATE_EPOCH`` makes the reports reproducible, so "byte-identical to
an uninterrupted run" covers every file of the output, the reports included. The bytes a
rerun writes are counted by its write events (``RESHARD_FAULT_COUNT``: one per item written)
and by its report (``resume``).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

import forked
from reshard.storage.files.atomic import journal_dir, stale_temporaries

EPOCH = "1700000000"
TIMEOUT = 300


# ---------------------------------------------------------------------------- helpers
def env(**extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("RESHARD_FAULT_")}
    out.update({"SOURCE_DATE_EPOCH": EPOCH, "OMP_NUM_THREADS": "1"})
    out.update(extra)
    return out


def command(src: Path, dst: Path, *extra: str) -> list[str]:
    return ["convert", str(src), str(dst), "--to", "dp=2", "--json", *extra]


def start(src: Path, dst: Path, *extra: str, **fault: str) -> forked.ForkedCLI:
    return forked.start(command(src, dst, *extra), env=env(**fault))


def finish(p: forked.ForkedCLI) -> subprocess.CompletedProcess:
    out, err = p.communicate(timeout=TIMEOUT)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def run(src: Path, dst: Path, *extra: str, **fault: str) -> subprocess.CompletedProcess:
    return finish(start(src, dst, *extra, **fault))


def events(count_file: Path) -> list[str]:
    return [ln.split(" ", 1)[1] for ln in count_file.read_text().splitlines()] if count_file.exists() else []


def items_written(count_file: Path) -> int:
    return sum(1 for lab in events(count_file) if lab.startswith("item "))


def contents(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def assert_identical(out: Path, reference: Path) -> None:
    a, b = contents(out), contents(reference)
    assert sorted(a) == sorted(b)
    assert not [n for n in a if a[n] != b[n]], [n for n in a if a[n] != b[n]]


def snapshot(d: Path) -> dict[str, tuple[str, int]]:
    return {str(p.relative_to(d)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(d.rglob("*")) if p.is_file()}


def assert_clean(dst: Path) -> None:
    """Nothing of the interrupted run is left beside the committed output: no temporary directory, no journal."""
    assert stale_temporaries(dst.parent, dst.name) == []
    assert not [p for p in dst.parent.iterdir() if p.name.endswith(".journal")]


def the_temporary(dst: Path) -> Path:
    temps = stale_temporaries(dst.parent, dst.name)
    assert len(temps) == 1, temps
    return temps[0]


@pytest.fixture(scope="module")
def src(reference_ckpt, tmp_path_factory) -> Path:
    """A private copy of the reference checkpoint (4 ranks, ~1.3 MB), so a test may touch its files."""
    d = tmp_path_factory.mktemp("resume") / "src"
    shutil.copytree(reference_ckpt, d)
    return d


@pytest.fixture(scope="module")
def uninterrupted(src, tmp_path_factory) -> dict:
    """An uninterrupted run's output (made at ``lane/dst``, then renamed) and its write events, per lane."""
    root = tmp_path_factory.mktemp("lanes")
    lanes = [root / f"lane{i}" for i in range(2)]
    procs = []
    for lane in lanes:
        lane.mkdir()
        procs.append(start(src, lane / "dst", RESHARD_FAULT_COUNT=str(lane / "events")))
    for p in procs:
        r = finish(p)
        assert r.returncode == 0, r.stderr
    labels = events(lanes[0] / "events")
    for lane in lanes:
        (lane / "dst").rename(lane / "reference")
    return {"lanes": lanes, "labels": labels, "items": sum(1 for lab in labels if lab.startswith("item "))}


# ---------------------------------------------------------------------------- 1. single process
def test_killed_at_many_points_the_rerun_resumes_writes_less_and_is_byte_identical(src, uninterrupted):
    """SIGKILL after eight write events (items first, a third, two thirds and last; the .metadata commit,
    the manifest, both reports); each rerun of the same command keeps exactly the items written
    before the kill (its report and its stderr line say how many, and how many bytes), writes
    only the others (counted), and ends byte-identical to the uninterrupted run, reports included."""
    before = snapshot(src)
    labels, total_items = uninterrupted["labels"], uninterrupted["items"]
    assert labels[total_items:] == ["metadata", "manifest", "report.json", "report.md", "rename"]
    points = sorted({1, total_items // 3, 2 * total_items // 3, total_items,
                     *range(total_items + 1, len(labels))})  # every event but the rename (a committed output)
    assert len(points) == 8
    lanes = uninterrupted["lanes"]
    pending = list(points)
    while pending:
        batch = [(lane, pending.pop(0)) for lane in lanes if pending]
        kills = [(lane, n, start(src, lane / "dst", RESHARD_FAULT_KILL_AT=str(n))) for lane, n in batch]
        for lane, n, p in kills:
            r = finish(p)
            assert r.returncode == -signal.SIGKILL, f"event {n}: exit {r.returncode}: {r.stderr}"
            assert not (lane / "dst").exists()
            assert journal_dir(the_temporary(lane / "dst")).is_dir()
        reruns = []
        for lane, n, _ in kills:
            (lane / "events").unlink(missing_ok=True)
            reruns.append((lane, n, start(src, lane / "dst", RESHARD_FAULT_COUNT=str(lane / "events"))))
        for lane, n, p in reruns:
            r = finish(p)
            assert r.returncode == 0, f"rerun after a kill at event {n} ({labels[n - 1]}): {r.stderr}"
            kept = min(n, total_items)  # every item event comes after the item's journal line
            resume = json.loads(r.stdout)["resume"]
            assert resume["resumed"] and resume["items_kept"] == kept and resume["items"] == total_items
            assert resume["items_damaged"] == 0 and resume["bytes_not_rewritten"] > 0
            assert items_written(lane / "events") == total_items - kept  # fewer bytes written: only the rest
            assert f"resumed: {kept:,} of {total_items:,} items kept" in r.stderr
            assert_identical(lane / "dst", lane / "reference")
            assert_clean(lane / "dst")
            shutil.rmtree(lane / "dst")
    assert snapshot(src) == before


def test_damaged_item_is_rewritten_and_the_rest_kept(src, uninterrupted):
    """A kept file's journal is never trusted alone: a byte flipped in a journaled item (after the
    kill) makes the rerun rewrite that item, keep the others, and still match the uninterrupted run."""
    lane = uninterrupted["lanes"][0]
    n = uninterrupted["items"] // 2
    assert run(src, lane / "dst", RESHARD_FAULT_KILL_AT=str(n)).returncode == -signal.SIGKILL
    tmp = the_temporary(lane / "dst")
    first = json.loads((journal_dir(tmp) / "__0_0.distcp.jsonl").read_text().splitlines()[0])
    with open(tmp / "__0_0.distcp", "r+b") as f:
        f.seek(first["o"] + first["n"] // 2)
        b = f.read(1)
        f.seek(first["o"] + first["n"] // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    r = run(src, lane / "dst", RESHARD_FAULT_COUNT=str(lane / "damaged-events"))
    assert r.returncode == 0, r.stderr
    resume = json.loads(r.stdout)["resume"]
    assert resume["items_damaged"] == 1 and resume["items_kept"] == n - 1
    assert "1 journaled items no longer had their recorded CRC-32 (file damaged) and were rewritten" in r.stderr
    assert items_written(lane / "damaged-events") == uninterrupted["items"] - n + 1
    assert_identical(lane / "dst", lane / "reference")
    shutil.rmtree(lane / "dst")


# ---------------------------------------------------------------------------- 2. what discards the work
def test_a_source_changed_between_the_runs_makes_the_rerun_start_over_and_say_so(src, uninterrupted):
    """A source file touched after the kill (same bytes, another mtime): the rerun keeps nothing,
    names the file, writes every item again and still gives the uninterrupted run's bytes."""
    lane = uninterrupted["lanes"][1]
    assert run(src, lane / "dst", RESHARD_FAULT_KILL_AT=str(uninterrupted["items"] // 2)).returncode == -signal.SIGKILL
    data = src / "__1_0.distcp"
    st = data.stat()
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    try:
        r = run(src, lane / "dst", RESHARD_FAULT_COUNT=str(lane / "changed-events"))
    finally:
        os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert r.returncode == 0, r.stderr
    assert ("starting over: the source changed since the interrupted run (__1_0.distcp: modified since "
            "(same size, another mtime)); its partial output is discarded") in r.stderr
    resume = json.loads(r.stdout)["resume"]
    assert not resume["resumed"] and resume["items_kept"] == 0
    assert items_written(lane / "changed-events") == uninterrupted["items"]
    assert_identical(lane / "dst", lane / "reference")
    assert_clean(lane / "dst")
    shutil.rmtree(lane / "dst")


def test_restart_and_a_changed_plan_discard_the_work_with_their_reason(src, uninterrupted, tmp_path):
    """``--restart`` starts over on purpose; another plan into the same destination (dp=1
    instead of dp=2) starts over naming the plan's fingerprints. Neither keeps an item."""
    dst = tmp_path / "dst"
    assert run(src, dst, RESHARD_FAULT_KILL_AT="40").returncode == -signal.SIGKILL
    r = run(src, dst, "--restart", RESHARD_FAULT_KILL_AT="40")
    assert r.returncode == -signal.SIGKILL  # killed again, after 40 items of a new journal: nothing was kept
    jd = journal_dir(the_temporary(dst))
    assert sum(len(p.read_text().splitlines()) for p in jd.glob("*.jsonl")) == 40
    r = forked.run(["convert", src, dst, "--to", "dp=1", "--json"], env=env(), timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr
    assert "starting over: the plan changed since the interrupted run (fingerprint " in r.stderr
    assert json.loads(r.stdout)["resume"]["items_kept"] == 0
    assert_clean(dst)


def test_restart_says_it_discards():
    """The decision itself (`Journal.choose`), on directories an interrupted run left."""
    import tempfile

    from reshard.storage.files.journal import Journal, ResumeKey

    key = ResumeKey("abc", {"__0_0.distcp": [10, 1]}, {"reshard": "1"})
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d) / ".out.reshard-tmp-0123456789ab"
        tmp.mkdir()
        journal_dir(tmp).mkdir()
        assert Journal(key).choose([tmp]) is None  # no key: a run killed before its first byte, nothing said
        (journal_dir(tmp) / "key.json").write_text(json.dumps(key.to_dict()))
        j = Journal(key)
        assert j.choose([tmp]) == tmp and j.resumed and j.message is None
        j = Journal(key, restart=True)
        assert j.choose([tmp]) is None and "--restart" in j.message
        j = Journal(ResumeKey("abc", key.source, {"reshard": "2"}))
        assert j.choose([tmp]) is None and "an option that changes the bytes changed" in j.message
        assert "(reshard: 1, now 2)" in j.message
        (journal_dir(tmp) / "key.json").write_text("{not json")
        j = Journal(key)
        assert j.choose([tmp]) is None and "unreadable" in j.message


def test_ctrl_c_keeps_the_work_for_the_next_run(src, uninterrupted):
    """Ctrl-C (SIGINT) stops a conversion without committing; unlike another error it keeps the
    temporary directory and its journal, and the next run resumes from them."""
    lane = uninterrupted["lanes"][0]
    n = uninterrupted["items"] // 3
    p = start(src, lane / "dst", RESHARD_FAULT_SLEEP_AT=f"{n}:30", RESHARD_FAULT_COUNT=str(lane / "int-events"))
    deadline = time.monotonic() + 120
    while len(events(lane / "int-events")) < n and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    r = finish(p)
    assert r.returncode != 0 and not (lane / "dst").exists()
    assert journal_dir(the_temporary(lane / "dst")).is_dir()
    r = run(src, lane / "dst")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["resume"]["items_kept"] == n
    assert_identical(lane / "dst", lane / "reference")
    shutil.rmtree(lane / "dst")


# ---------------------------------------------------------------------------- 3. --workers 2
def test_workers_2_killed_worker_rerun_resumes_and_is_byte_identical(src, tmp_path):
    """Under ``--workers 2`` worker 1 is SIGKILLed after its 30th item (torchrun stops worker 0);
    worker 0 keeps the temporary directory for the next run, which decides to resume once and
    for both workers: each keeps its own journaled items and writes the rest, and the output
    equals an uninterrupted ``--workers 2`` run, reports included."""
    reference = tmp_path / "reference"
    dst = tmp_path / "dst"
    r = run(src, dst, "--workers", "2")
    assert r.returncode == 0, r.stderr
    dst.rename(reference)
    # worker 1 pauses after its first item, so that worker 0 (which checks the space first) has
    # journaled items of its own when worker 1 is killed, however the two start under load
    r = run(src, dst, "--workers", "2", RESHARD_FAULT_RANK="1", RESHARD_FAULT_KILL_AT="30",
            RESHARD_FAULT_SLEEP_AT="1:5")
    assert r.returncode == 2 and "worker 1 of 2 was killed by SIGKILL" in r.stderr, r.stderr
    assert "resumes" in r.stderr
    assert not dst.exists()
    tmp = the_temporary(dst)
    journaled = {f: len((journal_dir(tmp) / f"{f}.jsonl").read_text().splitlines())
                 for f in ("__0_0.distcp", "__1_0.distcp")}
    assert journaled["__1_0.distcp"] == 30 and journaled["__0_0.distcp"] > 0
    r = run(src, dst, "--workers", "2")
    assert r.returncode == 0, r.stderr
    resume = json.loads(r.stdout)["resume"]
    assert resume["resumed"] and resume["items_kept"] == sum(journaled.values()) and resume["files_kept"] == 2
    assert f"resumed: {resume['items_kept']:,} of {resume['items']:,} items kept" in r.stderr
    assert_identical(dst, reference)
    assert_clean(dst)


def test_the_space_check_counts_what_the_interrupted_run_holds(src, uninterrupted, tmp_path):
    """Killed at half, the partial output holds disk space the rerun reuses: the check before the
    first byte counts it as free, so a disk that holds the output only with it still resumes,
    while the same free space refuses a fresh destination."""
    from reshard.storage.files.atomic import reclaimable_bytes

    dst = tmp_path / "dst"
    assert run(src, dst, RESHARD_FAULT_KILL_AT=str(uninterrupted["items"] // 2)).returncode == -signal.SIGKILL
    held = reclaimable_bytes(dst)
    assert held > 0
    plan = forked.run(["plan", src, "--to", "dp=2", "--dst", dst, "--json"], env=env(), timeout=TIMEOUT)
    assert plan.returncode == 0, plan.stderr
    needed = json.loads(plan.stdout)["space"]["needed_bytes"]
    free = str(max(0, needed - held // 2))  # short of the output by half of what the killed run holds

    fresh = run(src, tmp_path / "fresh", RESHARD_FREE_BYTES=free)
    assert fresh.returncode == 2 and "Nothing was written" in fresh.stderr, fresh.stderr
    assert not (tmp_path / "fresh").exists()

    r = run(src, dst, RESHARD_FREE_BYTES=free)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["resume"]["resumed"] and report["resume"]["items_kept"] > 0
    assert report["estimate"]["enough"] and "held by an interrupted run" in report["estimate"]["free_from"]
