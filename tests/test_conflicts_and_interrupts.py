"""Issue 35: flags that contradict each other are refused, and Ctrl-C says what it left.

Conflicts run through the in-process CLI (one real subprocess shows the check runs before
torch is imported). Interrupts are real processes (forked from a server that imported
reshard once, `tests/forked.py`) converting the session's real DCP checkpoint
(`reference_ckpt`, read only), held at a chosen write event by the test hook
``RESHARD_FAULT_SLEEP_AT`` (`reshard.storage.files.atomic.fault_point`) and sent SIGINT there, as a
terminal's Ctrl-C would: before the commit (a DCP copy, resumable, and a ``--data link`` run,
not resumable) and right after the rename into place.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import forked
from conftest import cli
from reshard.storage.files.atomic import journal_dir, stale_temporaries

ROOT = Path(__file__).resolve().parents[1]

# each pair that contradicts, on a command that takes both: (argv, the two flags the paragraph names)
CONFLICTS = {
    "inspect --profile --no-profile": (["inspect", "ckpt", "--profile", "p.toml", "--no-profile"],
                                       ("--profile p.toml", "--no-profile")),
    "plan --profile --no-profile": (["plan", "ckpt", "--to", "dp=2", "--profile", "p.toml", "--no-profile"],
                                    ("--profile p.toml", "--no-profile")),
    "convert --profile --no-profile": (["convert", "ckpt", "out", "--to", "dp=2", "--no-profile", "--profile", "p.toml"],
                                       ("--profile p.toml", "--no-profile")),
    "export --profile --no-profile": (["export", "ckpt", "out", "--profile", "p.toml", "--no-profile"],
                                      ("--profile p.toml", "--no-profile")),
    "convert --quiet --progress json": (["convert", "ckpt", "out", "--to", "dp=2", "--quiet", "--progress", "json"],
                                        ("--quiet", "--progress json")),
    "verify -q --progress json": (["verify", "a", "b", "-q", "--progress", "json"], ("--quiet", "--progress json")),
    "export --quiet --progress json": (["export", "ckpt", "out", "--progress", "json", "--quiet"],
                                       ("--quiet", "--progress json")),
    "import --quiet --progress json": (["import", "w.safetensors", "out", "--quiet", "--progress", "json"],
                                       ("--quiet", "--progress json")),
    "convert --buffered --data link": (["convert", "ckpt", "out", "--to", "dp=2", "--buffered", "--data", "link"],
                                       ("--buffered", "--data link")),
}


@pytest.mark.parametrize("name", list(CONFLICTS))
def test_conflicting_flags_are_refused_naming_both(name, tmp_path, monkeypatch):
    """Exit 2, one paragraph naming both flags and a way out, before the source is even looked
    at (its path does not exist: the conflict is what is reported)."""
    monkeypatch.chdir(tmp_path)
    argv, flags = CONFLICTS[name]
    code, out, err = cli(argv)
    assert code == 2, out + err
    text = err.strip()
    assert text.startswith("error: ") and "\n" not in text, err
    assert all(flag in text for flag in flags), text
    assert "contradict each other" in text and "Drop " in text, text
    assert "no such checkpoint" not in text, text
    assert not (tmp_path / "out").exists()


def test_the_conflict_check_runs_before_torch_is_imported():
    """A real process under ``-X importtime``: the refusal comes without importing torch."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RESHARD_DEBUG", None)
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "reshard.cli", "convert", "ckpt", "out", "--to", "dp=2",
                        "--profile", "p.toml", "--no-profile"], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=120)
    log = [ln for ln in p.stderr.splitlines() if ln.startswith("import time:")]
    err = "\n".join(ln for ln in p.stderr.splitlines() if not ln.startswith("import time:"))
    assert p.returncode == 2 and "--no-profile" in err, err
    assert not any(ln.rsplit("|", 1)[-1].strip() == "torch" for ln in log)


def test_agreeing_flags_are_accepted(reference_ckpt):
    """``--quiet`` with ``--progress none`` (or the default auto) says the same thing twice: accepted,
    and silent on stderr."""
    for progress in ("none", "auto"):
        code, out, err = cli(["verify", reference_ckpt, reference_ckpt, "--quiet", "--progress", progress])
        assert code == 0 and err == "", out + err


# ---------------------------------------------------------------------------- Ctrl-C
def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESHARD_FAULT_")}
    env.pop("RESHARD_DEBUG", None)
    env.update(extra)
    return env


def interrupted_at(point: str, argv: list, events: Path, *, group: bool = False, **env: str) -> subprocess.CompletedProcess:
    """`reshard ARGV` held right after its write event ``point`` (a number or a label), sent SIGINT
    there (``group``: to its whole process group, as a terminal's Ctrl-C reaches torchrun's
    workers too); the finished process's exit code and streams."""
    p = forked.start(argv, start_new_session=group,
                     env=_env(RESHARD_FAULT_SLEEP_AT=f"{point}:60", RESHARD_FAULT_COUNT=str(events), **env))
    deadline = time.monotonic() + 120
    while p.poll() is None and time.monotonic() < deadline:
        lines = events.read_text().splitlines() if events.exists() else []
        if any(point in ln.split(" ", 1) for ln in lines):  # "N LABEL"
            break
        time.sleep(0.05)
    assert p.poll() is None, p.output()
    time.sleep(0.2)  # the event is counted just before its sleep begins
    if group:
        os.killpg(p.pid, signal.SIGINT)
    else:
        p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def test_ctrl_c_before_the_commit_says_nothing_was_committed_and_the_rerun_resumes(reference_ckpt, tmp_path):
    """SIGINT after the first item written: exit 130, one line saying DST is unchanged and that
    the same command resumes; no DST. The rerun does resume (it says what it kept) and its output
    equals the source (`verify` exit 0)."""
    dst = tmp_path / "dst"
    argv = ["convert", reference_ckpt, dst, "--to", "dp=2"]
    r = interrupted_at("1", argv, tmp_path / "events")
    assert r.returncode == 130, r.stderr
    assert f"interrupted: nothing committed; {dst} is unchanged" in r.stderr, r.stderr
    assert "the same command run again resumes" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "converted" not in r.stdout, r.stdout + r.stderr
    assert not dst.exists()
    assert [journal_dir(t).is_dir() for t in stale_temporaries(tmp_path, "dst")] == [True]
    code, out, err = cli(argv)
    assert code == 0 and "resumed:" in err, out + err
    code, out, err = cli(["verify", reference_ckpt, dst])
    assert code == 0, out + err


def test_ctrl_c_before_a_link_commit_keeps_nothing_and_says_so(reference_ckpt, tmp_path):
    """``--data link`` is not resumable: interrupted after its manifest, it leaves no DST and no
    temporary directory, and its line promises no resume."""
    dst = tmp_path / "dst"
    r = interrupted_at("manifest", ["convert", reference_ckpt, dst, "--to", "dp=2", "--data", "link"],
                       tmp_path / "events")
    assert r.returncode == 130, r.stderr
    assert f"interrupted: nothing committed; {dst} is unchanged" in r.stderr, r.stderr
    assert "resumes" not in r.stderr, r.stderr
    assert not dst.exists() and stale_temporaries(tmp_path, "dst") == []


def test_ctrl_c_after_the_commit_exits_0_over_a_complete_output(reference_ckpt, tmp_path):
    """SIGINT right after the rename into place: the output was verified before it, so the run
    finished: exit 0 with "interrupted after the commit", and `verify SRC DST` finds them equal."""
    dst = tmp_path / "dst"
    r = interrupted_at("rename", ["convert", reference_ckpt, dst, "--to", "dp=2"], tmp_path / "events")
    assert r.returncode == 0, r.stderr
    assert f"interrupted after the commit: {dst} is complete" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert stale_temporaries(tmp_path, "dst") == []
    code, out, err = cli(["verify", reference_ckpt, dst])
    assert code == 0, out + err


@pytest.mark.parametrize("point", ["1", "rename"])
def test_ctrl_c_under_workers_says_what_worker_0_left(point, reference_ckpt, tmp_path):
    """``--workers 2``: worker 0 commits in another process, so the launcher tells by what stands
    at DST. Ctrl-C goes to the whole process group (as a terminal sends it), held on worker 0's
    first item (nothing committed, exit 130, resumable) or right after its rename (complete,
    exit 0, `verify` equal). One line from the launcher; the workers leave the word to it."""
    dst = tmp_path / "dst"
    r = interrupted_at(point, ["convert", reference_ckpt, dst, "--to", "dp=2", "--workers", "2"], tmp_path / "events",
                       group=True, RESHARD_FAULT_RANK="0")
    err = r.stderr
    said = [ln for ln in err.splitlines() if ln.startswith("interrupted")]
    if point == "1":
        assert r.returncode == 130, err
        assert said == [f"interrupted: nothing committed; {dst} is unchanged; the same command run again resumes "
                        "from the items already written (--restart starts over)"], err
        assert not dst.exists()
    else:
        assert r.returncode == 0, err
        assert said == [f"interrupted after the commit: {dst} is complete"], err
        code, out, err = cli(["verify", reference_ckpt, dst])
        assert code == 0, out + err


def test_a_signal_torchrun_masks_with_its_own_error_is_still_ctrl_c(monkeypatch):
    """torchrun's metrics wrapper (``elastic.metrics.api.prof``) reads ``start`` in a ``finally``:
    a Ctrl-C landing before ``start`` is bound leaves ``UnboundLocalError`` with the signal as its
    context (seen once in CI). `launch_workers` must still say "interrupted" (KeyboardInterrupt,
    exit 130), not "unexpected UnboundLocalError"; any other error passes through unchanged."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from reshard.engine import distributed

    def masked(_args):
        try:
            raise SignalException("Process 1 got signal: 2", sigval=signal.SIGINT)
        finally:
            raise UnboundLocalError("cannot access local variable 'start' where it is not associated with a value")
    monkeypatch.setattr(torchrun, "run", masked)
    with pytest.raises(KeyboardInterrupt):
        distributed.launch_workers(2, ["convert", "a", "b", "--to", "dp=2"])

    def broken(_args):
        raise RuntimeError("not a signal")
    monkeypatch.setattr(torchrun, "run", broken)
    with pytest.raises(RuntimeError, match="not a signal"):
        distributed.launch_workers(2, ["convert", "a", "b", "--to", "dp=2"])
