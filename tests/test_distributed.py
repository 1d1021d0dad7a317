"""Distributed conversion on torch.distributed: the output is the single-process output, byte for byte.

Real processes: ``torchrun --standalone --nproc-per-node 2 -m reshard convert`` and
``reshard convert --workers 2`` (which starts torchrun itself), on the session's 4-rank
FSDP2 reference checkpoint (parameters, Adam moments, step counters, scheduler, RNG,
data position). ``SOURCE_DATE_EPOCH`` makes manifests and reports reproducible; the
reports differ only in saying how many workers wrote the output and which files each one
wrote and verified.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EPOCH = "1700000000"
TIMEOUT = 300


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"SOURCE_DATE_EPOCH": EPOCH, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    for k in list(env):
        if k.startswith("RESHARD_FAULT_"):
            del env[k]
    env.update(extra)
    return env


def _torchrun(args: list[str], nproc: int = 2, **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "reshard", *args]
    return subprocess.run(cmd, env=_env(**env), capture_output=True, text=True, timeout=TIMEOUT)


def _single(args: list[str]) -> subprocess.CompletedProcess:
    """One process (forked from a server that imported reshard once, `tests/forked.py`); torchrun keeps its own."""
    import forked

    return forked.run(args, env=_env(), timeout=TIMEOUT)


def _payload(d: Path) -> dict[str, bytes]:
    """Every file but the two reports (compared separately)."""
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file() and not p.name.startswith("reshard-report")}


def _report(d: Path) -> dict:
    r = json.loads((d / "reshard-report.json").read_text())
    r["destination"] = "<DST>"
    r["verification"]["b"] = "<DST>"
    return r


@pytest.fixture(scope="module")
def runs(reference_ckpt, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("dist")
    out: dict = {}
    for to in ("dp=2", "dp=1"):
        tag = to.replace("=", "")
        single, dist, workers = root / f"single-{tag}", root / f"torchrun-{tag}", root / f"workers-{tag}"
        out[to] = {
            "single": (_single(["convert", str(reference_ckpt), str(single), "--to", to, "--json"]), single),
            "torchrun": (_torchrun(["convert", str(reference_ckpt), str(dist), "--to", to, "--json"]), dist),
        }
        if to == "dp=2":
            out[to]["workers"] = (_single(["convert", str(reference_ckpt), str(workers), "--to", to, "--workers", "2",
                                           "--json"]), workers)
    return out


@pytest.mark.parametrize("to", ["dp=2", "dp=1"])
def test_torchrun_output_is_byte_identical_to_single_process(runs, to):
    (ps, single), (pd, dist) = runs[to]["single"], runs[to]["torchrun"]
    assert ps.returncode == 0, ps.stderr[-2000:]
    assert pd.returncode == 0, pd.stderr[-2000:]
    a, b = _payload(single), _payload(dist)
    assert sorted(a) == sorted(b)
    assert any(n.endswith(".distcp") for n in a) and ".metadata" in a and "manifest.json" in a
    for name in a:
        assert a[name] == b[name], f"{name} differs between the single-process and the torchrun conversion"


def test_reports_say_how_the_work_was_shared(runs):
    for to, expected in (("dp=2", [["__0_0.distcp"], ["__1_0.distcp"]]),
                         ("dp=1", [["__0_0.distcp"], []])):  # worker 1 has no file of its own
        (_, single), (pd, dist) = runs[to]["single"], runs[to]["torchrun"]
        rs, rd = _report(single), _report(dist)
        assert rd.pop("workers") == 2 and "workers" not in rs
        shares = rd["verification"].pop("workers")
        # the file of target rank r goes to worker r mod 2
        assert shares == [{"worker": i, "files": f} for i, f in enumerate(expected)]
        rs.pop("seconds"), rd.pop("seconds")
        assert rs == rd
        # worker 0 alone prints the report
        printed = json.loads(pd.stdout)
        assert printed["workers"] == 2 and printed["verification"]["equal"] is True


def test_workers_flag_runs_torchrun_itself(runs):
    (_, single), (pw, workers) = runs["dp=2"]["single"], runs["dp=2"]["workers"]
    assert pw.returncode == 0, pw.stderr[-2000:]
    assert _payload(workers) == _payload(single)
    assert json.loads(pw.stdout)["workers"] == 2


def test_distributed_output_verifies_and_inspects(runs, reference_ckpt):
    (_, dist) = runs["dp=2"]["torchrun"]
    v = _single(["verify", str(reference_ckpt), str(dist), "--json"])
    assert v.returncode == 0, v.stdout[-2000:] + v.stderr[-2000:]
    i = _single(["inspect", str(dist), "--deep", "--json"])
    assert i.returncode == 0, i.stdout[-2000:]


def test_a_killed_worker_commits_nothing(reference_ckpt, tmp_path):
    """Worker 1 is SIGKILLed after its first write: the run fails and nothing appears at DST."""
    dst = tmp_path / "out"
    p = _torchrun(["convert", str(reference_ckpt), str(dst), "--to", "dp=2"],
                  RESHARD_FAULT_KILL_AT="1", RESHARD_FAULT_RANK="1")
    assert p.returncode != 0
    assert not dst.exists()
    # a rerun into the same destination succeeds (and cleans the hidden leftovers)
    again = _torchrun(["convert", str(reference_ckpt), str(dst), "--to", "dp=2"])
    assert again.returncode == 0, again.stderr[-2000:]
    assert not [p.name for p in tmp_path.iterdir() if ".reshard-tmp-" in p.name]


def test_a_failing_worker_stops_every_worker_with_its_reason(reference_ckpt, tmp_path):
    """A destination that exists and is not empty: worker 0 refuses, every worker exits, nothing written."""
    dst = tmp_path / "busy"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    p = _torchrun(["convert", str(reference_ckpt), str(dst), "--to", "dp=2"])
    assert p.returncode != 0
    assert "not empty" in (p.stderr + p.stdout) or "exists" in (p.stderr + p.stdout)
    assert sorted(x.name for x in dst.iterdir()) == ["keep.txt"]


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_killing_the_command_stops_its_workers(reference_ckpt, tmp_path):
    """``convert --workers 2`` SIGKILLed with its process group (as a timeout, an OOM kill or a scheduler's
    kill does) while its workers pause after their first write: the workers, which torchrun starts in
    sessions of their own, die with the command, and nothing is ever committed."""
    import signal
    import time

    dst = tmp_path / "out"
    cmd = [sys.executable, "-m", "reshard", "convert", str(reference_ckpt), str(dst), "--to", "dp=2", "--workers", "2"]
    p = subprocess.Popen(cmd, env=_env(RESHARD_FAULT_SLEEP_AT="1:60"), start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + TIMEOUT
        workers: list[int] = []
        while time.monotonic() < deadline:  # both workers made their first write and now sleep
            workers = _children(p.pid)
            written = [f for t in tmp_path.glob(".out.reshard-tmp-*") for f in t.iterdir()]
            if len(workers) == 2 and written:
                break
            assert p.poll() is None, "the command ended before its workers wrote"
            time.sleep(0.2)
        assert len(workers) == 2, workers
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        end = time.monotonic() + 30
        while any(_alive(w) for w in workers) and time.monotonic() < end:
            time.sleep(0.1)
        assert not any(_alive(w) for w in workers), "a worker outlived the command that started it"
        assert not dst.exists()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
