"""Checked before the first byte, and progress an operator trusts.

`convert`, `export` and `import` estimate what they write and refuse (exit 2, both figures
named, nothing written: no temporary directory, no lock, no probe file) when the
destination's file system has less free space; ``--force`` goes ahead. What is checked:

* on a real small tmpfs (mounted here when allowed, else skipped with the reason), every
  command is refused before anything is written, and ``--force`` goes ahead (until the disk
  is full: exit 2, out of space, nothing committed);
* with the free space reported by ``RESHARD_FREE_BYTES``, the terabyte-scale case of a
  metadata-faithful Llama-3-8B checkpoint (90 GB of sparse files) is refused with the
  figures ``reshard plan --dst`` shows; ``--force`` completes a conversion the override says
  cannot fit, single-process and under ``--workers 2`` (checked once, by worker 0);
* the size and time figures of ``plan --dst`` and of the conversion report are the same
  figures (sizes equal, the time a range with its basis; a checkpoint this small is not probed), and
  nothing is left beside the output;
* ``--progress json``: one JSON object per line on stderr, per phase (copy, verify,
  commit) by bytes from 0 to the total, with rate and ETA, for convert, export, import and
  verify, also beside ``--json``.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

import forked

from conftest import cli, mounted_tmpfs
from reshard.render.progress import Progress

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RESHARD_DEBUG", "WORLD_SIZE", "RANK", "RESHARD_FREE_BYTES")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _run(args: list, **env: str) -> subprocess.CompletedProcess:
    """A real process (forked, `tests/forked.py`): the command's own exit status and streams."""
    return forked.run(args, env=_env(**env), timeout=600, cwd=ROOT)


def _snapshot(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def exported(reference_ckpt, tmp_path_factory) -> Path:
    """The reference checkpoint's safetensors export (the source of an import)."""
    out = tmp_path_factory.mktemp("preflight") / "st"
    code, o, e = cli(["export", reference_ckpt, out])
    assert code == 0, o + e
    return out


def _commands(ckpt: Path, st: Path, out: Path) -> dict[str, list]:
    return {"convert": ["convert", ckpt, out, "--to", "dp=2"], "export": ["export", ckpt, out],
            "import": ["import", st, out, "--to", "dp=2"]}


# ---------------------------------------------------------------------------------- a real small disk
@pytest.mark.parametrize("name", ["convert", "export", "import"])
def test_refused_on_a_small_tmpfs_before_anything_is_written_force_goes_ahead(name, reference_ckpt, exported, tmp_path):
    with mounted_tmpfs(tmp_path / "mnt", "size=64k") as mnt:
        dst = mnt / "out"
        before = _snapshot(Path(reference_ckpt))
        free = shutil.disk_usage(mnt).free
        r = _run(_commands(reference_ckpt, exported, dst)[name])
        assert r.returncode == 2, r.stdout + r.stderr
        err = r.stderr.strip()
        assert err.startswith(f"error: destination {dst} has ") and "\n" not in err, err
        assert f"({free} bytes, from the file system at {mnt})" in err, err
        assert f"the {dict(convert='conversion').get(name, name)} writes about " in err and "Nothing was written" in err and "--force" in err, err
        assert os.listdir(mnt) == [], "nothing at all is written: no temporary directory, lock or probe"

        r = _run(_commands(reference_ckpt, exported, dst)[name] + ["--force"])
        assert r.returncode == 2, r.stdout + r.stderr  # it went ahead, and the disk filled up
        assert f"error: {dst}: out of space" in r.stderr and "Nothing was committed" in r.stderr, r.stderr
        assert not dst.exists()
        assert _snapshot(Path(reference_ckpt)) == before


# ---------------------------------------------------------------------------------- terabyte scale
@pytest.fixture(scope="module")
def llama8b(tmp_path_factory) -> Path:
    """Llama-3-8B with AdamW saved from 8 ranks: metadata-faithful, 90 GB of sparse data files."""
    from reshard.testing.synthetic_metadata import make_llama_metadata_checkpoint

    return make_llama_metadata_checkpoint(tmp_path_factory.mktemp("llama8b") / "ckpt", "8B", ranks=8).path


def test_free_space_override_refuses_a_90_gb_conversion_with_the_figures_plan_shows(llama8b, tmp_path):
    dst = tmp_path / "out"
    env = {"RESHARD_FREE_BYTES": "60GiB"}
    p = _run(["plan", llama8b, "--to", "dp=4", "--dst", dst, "--json"], **env)
    assert p.returncode == 0, p.stderr
    space = json.loads(p.stdout)["space"]
    need = space["needed_bytes"]
    assert space["free_bytes"] == 60 << 30 and space["free_from"] == "RESHARD_FREE_BYTES=60GiB" and not space["enough"]
    assert 85 << 30 < need < 95 << 30, need  # 8B parameters and two fp32 moments: about 90 GB
    assert "warning: " in p.stderr and f"({need} bytes)" in p.stderr

    r = _run(["convert", llama8b, dst, "--to", "dp=4"], **env)
    assert r.returncode == 2, r.stdout + r.stderr
    err = r.stderr.strip()
    assert (f"error: destination {dst} has 60.0 GiB free ({60 << 30} bytes, from RESHARD_FREE_BYTES=60GiB at "
            f"{tmp_path}), the conversion writes about ") in err, err
    assert f"({need} bytes)" in err and "--force" in err, err
    assert os.listdir(tmp_path) == [], "refused before the temporary directory (or anything) is created"


@pytest.mark.parametrize("workers", [None, 2])
def test_force_goes_ahead_where_the_override_says_it_cannot_fit(reference_ckpt, tmp_path, workers):
    extra = ["--workers", str(workers)] if workers else []
    dst = tmp_path / "out"
    r = _run(["convert", reference_ckpt, dst, "--to", "dp=2", *extra], RESHARD_FREE_BYTES="1")
    assert r.returncode == 2 and "has 1 B free (1 bytes, from RESHARD_FREE_BYTES=1" in r.stderr, r.stderr
    assert r.stderr.count("error: ") == 1, r.stderr  # under --workers: checked once, one paragraph
    assert os.listdir(tmp_path) == []
    r = _run(["convert", reference_ckpt, dst, "--to", "dp=2", "--force", "--json", *extra], RESHARD_FREE_BYTES="1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["verification"]["equal"] is True
    if not workers:  # the distributed report does not carry the estimate (yet)
        est = json.loads(r.stdout)["estimate"]
        assert est["forced"] and not est["enough"] and "going ahead (--force)" in est["warning"]


# ---------------------------------------------------------------------------------- the same figures
def test_plan_and_the_report_give_the_same_size_and_time_figures(reference_ckpt, tmp_path):
    dst = tmp_path / "out"
    code, out, err = cli(["plan", reference_ckpt, "--to", "dp=2", "--dst", dst, "--json"])
    assert code == 0, out + err
    planned = json.loads(out)["space"]
    code, out, err = cli(["convert", reference_ckpt, dst, "--to", "dp=2", "--json"])
    assert code == 0, out + err
    est = json.loads(out)["estimate"]
    on_disk = json.loads((dst / "reshard-report.json").read_text())["estimate"]
    assert on_disk == est
    for k in ("destination", "needed_bytes", "read_bytes"):
        assert planned[k] == est[k], k
    for fig in (planned, est):  # a range; the probe skipped for so small a checkpoint (tests/test_estimate.py forces it)
        assert fig["enough"] and 0 < fig["low_s"] <= fig["seconds"] <= fig["high_s"] and "not probed" in fig["basis"]
        assert fig["probe"]["skipped"] and fig["read"] is None and fig["write"] is None
    written = sum(p.stat().st_size for p in dst.iterdir())
    assert written <= est["needed_bytes"] <= 1.25 * written
    assert not [p for p in tmp_path.iterdir() if "probe" in p.name], "the write probe is removed"
    code, text, _ = cli(["plan", reference_ckpt, "--to", "dp=2", "--dst", tmp_path / "other"])
    assert code == 0 and "estimate: writes about" in text and "to convert (not probed: " in text, text


def test_reproducible_reports_record_no_measured_figure(reference_ckpt, tmp_path, monkeypatch):
    """Under SOURCE_DATE_EPOCH the reports on disk hold no free space, probe or time (they differ every run)."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    code, out, err = cli(["convert", reference_ckpt, tmp_path / "c", "--to", "dp=2", "--json"])
    assert code == 0, out + err
    assert "estimate" not in json.loads((tmp_path / "c" / "reshard-report.json").read_text())
    assert json.loads(out)["estimate"]["needed_bytes"] > 0  # the command still prints them


# ---------------------------------------------------------------------------------- --progress json
def _events(err: str) -> list[dict]:
    lines = [line for line in err.splitlines() if line.strip()]
    events = [json.loads(line) for line in lines]  # every line is one JSON object
    assert events and all(isinstance(e, dict) and "event" in e for e in events), err[-2000:]
    return events


def _check_phases(events: list[dict]) -> list[str]:
    """Every phase starts at 0 and ends at its total, its counts never go back; returns the phases in order."""
    order, open_ = [], {}
    for e in events:
        if e["event"] == "message":
            continue
        assert {"phase", "step", "bytes_done", "bytes_total", "rate", "eta_s", "eta_from", "elapsed_s"} <= set(e), e
        assert e["eta_from"] in (None, "probe", "bytes") and (e["rate"] is None) == (e["eta_from"] != "bytes") or \
            e["event"] == "end", e
        key = (e["phase"], e["step"])
        if e["event"] == "start":
            assert e["bytes_done"] == 0 and key not in open_, e
            open_[key] = e
            order.append(e["phase"])
        else:
            assert key in open_ and e["bytes_done"] >= open_[key]["bytes_done"], e
            assert e["bytes_total"] == open_[key]["bytes_total"]
            open_[key] = e
            if e["event"] == "end":
                assert e["bytes_done"] == e["bytes_total"] and e["eta_s"] == 0.0, e
                del open_[key]
    assert not open_, f"phases never ended: {open_}"
    return order


@pytest.mark.parametrize("name", ["convert", "export", "import", "verify"])
def test_progress_json_events_on_stderr(name, reference_ckpt, exported, tmp_path):
    out = tmp_path / "out"
    args = {**_commands(reference_ckpt, exported, out), "verify": ["verify", reference_ckpt, reference_ckpt]}[name]
    code, stdout, err = cli(args + ["--progress", "json", "--json"])
    assert code == 0, stdout + err
    json.loads(stdout)  # the report itself, on stdout
    events = _events(err)
    assert events[0]["event"] == "message" and events[0]["text"].startswith(f"reading {args[1]}")
    stages = _check_phases(events)
    expected = {"convert": ["copy", "verify", "commit"], "export": ["copy", "verify", "commit"],
                "import": ["copy", "verify", "commit"], "verify": ["verify"]}[name]
    assert [s for i, s in enumerate(stages) if s not in stages[:i]] == expected, stages
    if name != "verify":
        assert any(e.get("text", "").startswith("checking space: writes about ") for e in events), events
        # an ETA from the first second: before the copy's first byte, from the preflight's probes
        start = next(e for e in events if e["event"] == "start" and e["phase"] == "copy")
        assert start["eta_from"] == "probe" and start["eta_s"] is not None and start["rate"] is None, start


def test_quiet_and_none_silence_the_events(reference_ckpt):
    for flags in (["--progress", "none"], ["--progress", "none", "--quiet"]):
        code, out, err = cli(["verify", reference_ckpt, reference_ckpt, *flags])
        assert code == 0 and err == "", err
    code, out, err = cli(["verify", reference_ckpt, reference_ckpt, "--progress", "json", "--quiet"])
    assert code == 2 and "--quiet" in err and "--progress json" in err, err  # a contradiction, refused (issue 35)


def test_phase_rate_and_eta_are_from_bytes():
    """The event's ETA is the bytes left at the phase's rate; an open phase is refreshed with no bytes moving."""
    stream = io.StringIO()
    p = Progress(stream=stream, json=True)
    with p.phase("writing", 1000) as ph:
        time.sleep(0.05)  # a measurable time since the phase began (before it, rate and ETA are unknown: null)
        ph.update(250)
        e = ph.event("progress")
        assert e["phase"] == "copy" and e["bytes_done"] == 250 and e["bytes_total"] == 1000
        assert e["rate"] > 0 and e["eta_s"] == pytest.approx((1000 - 250) / e["rate"], rel=0.05, abs=0.1)
        time.sleep(2.6)  # no bytes: the ticker still writes the phase's state (a stalled count, not silence)
        ph.update(750)
    events = [json.loads(line) for line in stream.getvalue().splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "end" and "progress" in kinds, kinds
    assert events[-1]["bytes_done"] == 1000 and events[-1]["eta_s"] == 0.0
    stalled = [e for e in events if e["event"] == "progress" and e["bytes_done"] == 250]
    assert stalled and stalled[0]["eta_s"] is not None
