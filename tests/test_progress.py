"""Progress on a terminal, by bytes, from the first moment; nothing on a pipe, with --json or --quiet.

Every long command (inspect --deep, convert, convert --workers, verify, export, import) runs
as a real process with its stderr on a pseudo-terminal (the `pty` module), on a real
checkpoint the reference trainer wrote with `dcp.save` on 4 gloo ranks. What is checked:

* the first line ("reading CKPT …") is printed before torch is imported: the process runs
  under ``python -X importtime``, which writes a line to the same stderr as each module
  finishes importing, so the first line must come before any ``torch`` line. That is what
  keeps the first line within a second on any machine (torch's import is the 2-3 s); the
  seconds measured are printed (``pytest -s``), not asserted;
* the bars count bytes: tqdm's byte rate (``B/s``) and the phase names appear;
* with stderr a pipe, under ``--json`` and with ``--quiet`` (stderr still a terminal)
  nothing at all is written to stderr.

The byte totals themselves (each phase counts to what the index says) are checked in
process with a `Progress` that shows nothing but counts.
"""
from __future__ import annotations

import os
import pty
import re
from pathlib import Path

import pytest

from conftest import cli
from terminal import TORCH_IMPORT, first_line_seconds, run_on_terminal as _run
from reshard.render.progress import Progress


@pytest.fixture(scope="module")
def sides(reference_ckpt, tmp_path_factory) -> dict[str, Path]:
    """The reference checkpoint, its conversion to dp=2 and its safetensors export (inputs of verify and import)."""
    base = tmp_path_factory.mktemp("progress")
    code, out, err = cli(["convert", reference_ckpt, base / "dp2", "--to", "dp=2"])
    assert code == 0, out + err
    code, out, err = cli(["export", reference_ckpt, base / "st"])
    assert code == 0, out + err
    return {"ckpt": reference_ckpt, "converted": base / "dp2", "exported": base / "st"}


def _commands(s: dict[str, Path], out: Path) -> dict[str, list[str]]:
    return {
        "inspect --deep": ["inspect", "--deep", str(s["ckpt"])],
        "convert": ["convert", str(s["ckpt"]), str(out / "c"), "--to", "dp=2"],
        "verify": ["verify", str(s["ckpt"]), str(s["converted"])],
        "export": ["export", str(s["ckpt"]), str(out / "e")],
        "import": ["import", str(s["exported"]), str(out / "i"), "--to", "dp=2"],
    }


PHASES = {"inspect --deep": "checking items", "convert": "writing", "verify": "comparing", "export": "writing",
          "import": "writing"}


@pytest.mark.parametrize("name", list(PHASES))
def test_first_line_before_torch_then_bytes(name, sides, tmp_path):
    args = _commands(sides, tmp_path)[name]
    r = _run(args, terminal=True, importtime=True)
    assert r["code"] == 0, r["out"] + r["err"][-3000:]
    text = r["err"].replace("\r\n", "\n").replace("\r", "\n")  # a redrawn row (bar, waiting seconds): a line each
    first = re.search(r"^reading .* …$", text, re.M)
    assert first, text[-3000:]
    torch_line = TORCH_IMPORT.search(text)
    if name in ("convert", "verify"):  # a byte copy and its verification import no torch at all (issue 45)
        assert torch_line is None, "convert and verify of a re-cut checkpoint must not import torch"
    else:
        assert torch_line, "the command imported torch (it reads tensors)"
        assert first.start() < torch_line.start(), "the first line must come before torch is imported"
    assert "B/s" in text and PHASES[name] in text, text[-3000:]  # a bar in bytes, named by its phase
    if name in ("convert", "export", "import"):  # the preflight's figures before the first byte, then a commit bar
        assert re.search(r"^checking space: writes about .* free at .*to convert \(", text, re.M), text[-3000:]
        assert "commit" in text, text[-3000:]
    if name == "convert":
        assert re.search(r"^planning the conversion to dp=2 …$", text, re.M), text[-3000:]
    print(f"\n{name}: first line after {first_line_seconds(r, first.group(0)):.2f} s "
          f"(under -X importtime; exit after {r['pieces'][-1][0]:.2f} s)")


def test_workers_show_one_progress(sides, tmp_path):
    """`convert --workers 2`: the launcher says the first line, worker 0 alone shows the bars."""
    r = _run(["convert", str(sides["ckpt"]), str(tmp_path / "w"), "--to", "dp=2", "--workers", "2"], terminal=True)
    assert r["code"] == 0, r["out"] + r["err"][-3000:]
    text = r["err"].replace("\r\n", "\n").replace("\r", "\n")  # a redrawn row (bar, waiting seconds): a line each
    assert len(re.findall(r"^reading .* …$", text, re.M)) == 1, text[-3000:]
    assert len(re.findall(r"converting .* to dp=2 …", text)) == 1, text[-3000:]
    assert len(re.findall(r"^checking space: ", text, re.M)) == 1, text[-3000:]  # checked once, by worker 0
    assert "B/s" in text and "writing" in text, text[-3000:]


@pytest.mark.parametrize("name,mode", [(n, "pipe") for n in PHASES] + [
    ("inspect --deep", "json"), ("convert", "json"), ("verify", "json"), ("export", "quiet"), ("import", "quiet")])
def test_nothing_on_stderr(name, mode, sides, tmp_path):
    """Every command is silent on a pipe; on a terminal each is silenced by --json or --quiet (one each, to share time)."""
    args = _commands(sides, tmp_path)[name] + {"pipe": [], "json": ["--json"], "quiet": ["--quiet"]}[mode]
    r = _run(args, terminal=mode != "pipe")
    assert r["code"] == 0, r["out"] + r["err"][-3000:]
    assert r["err"] == "", r["err"][-3000:]
    assert r["out"]  # the result itself still goes to stdout


# ---------------------------------------------------------------------------------- the byte totals
def test_phases_count_to_the_index_bytes(sides, tmp_path):
    """Each phase ends at its total, and the totals are the bytes the index declares."""
    from reshard.engine.conversion import convert
    from reshard.engine.copy import writing_bytes
    from reshard.engine.export import export
    from reshard.engine.importing import import_checkpoint
    from reshard.model.plan import Options
    from reshard.planning.plan import make_plan
    from reshard.verification.checkpoints import progress_bytes, verify_checkpoints
    from reshard.storage.checkpoints.index import CheckpointIndex

    ckpt = sides["ckpt"]
    ix = CheckpointIndex.open(ckpt)
    logical = sum(e.nbytes for e in ix.entries.values())

    p = Progress()
    r = verify_checkpoints(ckpt, sides["converted"], progress=p, recompute=True)
    assert r["equal"]
    comparing = [ph for ph in p.phases if ph.name == "comparing"]
    assert len(comparing) == 1 and comparing[0].total == progress_bytes(ix) == logical
    assert comparing[0].done == comparing[0].total
    checks = [ph for ph in p.phases if ph.name.startswith("checking checksums")]
    assert checks and all(ph.done == ph.total > 0 for ph in checks)  # the reference manifest records checksums

    p = Progress()
    plan = make_plan(ckpt, Options(to="dp=2"))
    convert(plan, ckpt, tmp_path / "c", progress=p)
    names = [ph.name for ph in p.phases]
    assert names[0] == "writing" and "comparing" in names and names[-1] == "commit"
    assert [ph.stage for ph in p.phases][::len(names) - 1] == ["copy", "commit"]
    kept = sum(ix.entries[a.key].nbytes for a in plan.keys if a.action != "dropped" and a.key in ix.entries)
    assert p.phases[0].total == writing_bytes(plan, ix) == kept and all(ph.done == ph.total for ph in p.phases)

    p = Progress()
    rep = export(ckpt, tmp_path / "e", progress=p)
    assert [ph.name for ph in p.phases] == ["writing", "verifying", "commit"]
    assert all(ph.total == rep["total_size"] == ph.done for ph in p.phases[:2])
    assert p.phases[2].total == p.phases[2].done == _files_bytes(tmp_path / "e")  # the commit: every file synced

    p = Progress()
    import_checkpoint(sides["exported"], tmp_path / "i", to="dp=2", progress=p)
    assert [ph.name for ph in p.phases] == ["writing", "verifying", "commit"]
    written = sum(e.nbytes for e in CheckpointIndex.open(tmp_path / "i").entries.values() if e.is_tensor)
    assert all(ph.total == written == ph.done for ph in p.phases[:2])
    assert p.phases[2].total == p.phases[2].done == _files_bytes(tmp_path / "i")

    p = Progress()
    with p.phase("checking items", logical) as bar:
        assert not ix.deep_check(progress=bar)
    assert p.phases[0].done == logical


def _files_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def test_progress_is_quiet_off_a_terminal(tmp_path):
    """`Progress.for_terminal`: a file is no terminal; --json and --quiet silence even a terminal."""
    with open(tmp_path / "err.txt", "w") as f:
        p = Progress.for_terminal(stream=f)
        p.say("reading x …")
        with p.phase("writing", 10) as bar:
            bar.update(10)
    assert (tmp_path / "err.txt").read_text() == "" and p.phases[0].done == 10
    master, slave = pty.openpty()
    with os.fdopen(slave, "w") as tty:
        assert Progress.for_terminal(stream=tty).enabled
        assert not Progress.for_terminal(stream=tty, json_out=True).enabled
        assert not Progress.for_terminal(stream=tty, quiet=True).enabled
    os.close(master)
