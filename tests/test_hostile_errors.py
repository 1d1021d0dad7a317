"""One error contract everywhere (issue 13, finding 7), each test written as the attack.

Whatever goes wrong, and however the command runs (one process, ``--workers``), the
command prints one paragraph naming the file, exits with the code a single process gives
(2 bad input, 1 a difference), shows no traceback, and commits nothing:

- ``convert --workers 2`` of a source with a truncated data file, of a source whose
  declared tied weights differ (worker 0 fails, worker 1 relays), and with a worker killed
  outright;
- ``export`` into a destination that fills up (``RLIMIT_FSIZE``, and a tiny tmpfs where
  mounting is allowed), and into a read-only file system;
- ``demo --out`` a directory holding a user's file;
- a NUL byte in a storage path of ``.metadata``;
- a 100,000-deep ``[[[...]]]`` as ``manifest.json`` and as a ``--plan`` file.

Checkpoints are the session fixtures (real ``dcp.save`` in spawned gloo ranks); crafted
``.metadata`` is torch's own ``Metadata`` object, loaded and re-pickled by the test.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import re
import signal
import subprocess
from pathlib import Path

import pytest

import forked

from conftest import mounted_tmpfs, run_cli

EPOCH = "1700000000"
TIMEOUT = 300
DEEP = 100_000


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("RESHARD_DEBUG", raising=False)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESHARD_FAULT_") and k != "RESHARD_DEBUG"}
    env.update({"SOURCE_DATE_EPOCH": EPOCH, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def _reshard(args: list, file_size_limit: int | None = None, **env: str) -> subprocess.CompletedProcess:
    """A real process (forked, `tests/forked.py`): what the user sees of an uncaught error, a timeout as a hang guard."""
    return forked.run(args, env=_env(**env), timeout=TIMEOUT, file_size_limit=file_size_limit)


def _paragraph(err: str) -> str:
    """The one paragraph a failed command prints: ``error: ...`` on one line, nothing else."""
    text = err.strip()
    assert text.startswith("error: ") and "\n" not in text, err
    for word in ("Traceback", "torchrun", "ChildFailedError", "unexpected"):
        assert word not in err, err
    return text


def _nothing_beside(dst: Path) -> None:
    """Neither the destination nor a hidden temporary directory of it exists (a lock file may remain)."""
    assert not dst.exists()
    assert not [p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.reshard-tmp-")]


# ---------------------------------------------------------------------------- convert --workers

def test_workers_on_a_truncated_source_exit_2_with_the_single_process_paragraph(reference_ckpt, copy_of, tmp_path):
    src = copy_of(reference_ckpt)
    with open(src / "__2_0.distcp", "r+b") as f:
        f.truncate(1000)
    one = _reshard(["convert", src, tmp_path / "one", "--to", "dp=2"])
    two = _reshard(["convert", src, tmp_path / "two", "--to", "dp=2", "--workers", "2"])
    assert one.returncode == 2 and two.returncode == 2, two.stderr
    assert _paragraph(two.stderr) == _paragraph(one.stderr)
    assert "__2_0.distcp" in two.stderr and "incomplete" in two.stderr
    _nothing_beside(tmp_path / "one")
    _nothing_beside(tmp_path / "two")


def test_workers_on_differing_tied_weights_exit_1_with_the_single_process_paragraph(reference_ckpt, copy_of,
                                                                                   tmp_path):
    """A genuine difference (declared tied weights that differ) is found by worker 0 alone and relayed."""
    import json

    src = copy_of(reference_ckpt)
    m = json.loads((src / "manifest.json").read_text())
    m["model"]["tied"].append(["blocks.0.attn.wq.weight", "blocks.0.attn.wk.weight"])
    (src / "manifest.json").write_text(json.dumps(m, indent=2))
    one = _reshard(["convert", src, tmp_path / "one", "--to", "dp=2"])
    two = _reshard(["convert", src, tmp_path / "two", "--to", "dp=2", "--workers", "2"])
    assert one.returncode == 1 and two.returncode == 1, two.stderr
    assert _paragraph(two.stderr) == _paragraph(one.stderr)
    assert "tied copies" in two.stderr and "blocks.0.attn.wq.weight" in two.stderr
    _nothing_beside(tmp_path / "one")
    _nothing_beside(tmp_path / "two")


def test_workers_with_a_worker_killed_exit_2_naming_it(reference_ckpt, tmp_path):
    """Worker 1 is SIGKILLed after its first write: one paragraph names it, not torchrun's account of it."""
    dst = tmp_path / "out"
    p = _reshard(["convert", reference_ckpt, dst, "--to", "dp=2", "--workers", "2"],
                 RESHARD_FAULT_KILL_AT="1", RESHARD_FAULT_RANK="1")
    assert p.returncode == 2, p.stderr
    assert "worker 1 of 2 was killed by SIGKILL" in _paragraph(p.stderr)
    assert not dst.exists()


# ---------------------------------------------------------------------------- export into a full destination



@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 48 KiB tmpfs (root only); skipped where mounting is not allowed."""
    with mounted_tmpfs(tmp_path / "mnt", "size=48k") as mnt:
        yield mnt


@pytest.fixture(scope="module")
def exported(reference_ckpt, tmp_path_factory) -> Path:
    """The same export with room to spare: what the full destination would have held."""
    out = tmp_path_factory.mktemp("exported") / "out"
    p = _reshard(["export", reference_ckpt, out])
    assert p.returncode == 0, p.stderr
    return out


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
@pytest.mark.parametrize("how", ["rlimit_fsize", "tmpfs"])
def test_export_to_a_full_destination_exit_2_naming_destination_and_bytes(reference_ckpt, exported, tmp_path, how,
                                                                           fmt, request):
    if how == "tmpfs":  # --force: past the check before the first byte (tests/test_preflight.py), into a full disk
        dst = request.getfixturevalue("tiny_tmpfs") / "out"
        p = _reshard(["export", reference_ckpt, dst, "--format", fmt, "--force"])
    else:
        dst = tmp_path / "out"
        p = _reshard(["export", reference_ckpt, dst, "--format", fmt], file_size_limit=50_000)
    assert p.returncode == 2, p.stderr
    err = _paragraph(p.stderr)
    assert err.startswith(f"error: {dst}: out of space writing the export")
    assert ("No space left on device" if how == "tmpfs" else "File too large") in err
    assert "Nothing was committed" in err
    needed = int(re.search(r"\((\d+) bytes\)", err).group(1))
    if fmt == "safetensors":  # the estimate is exact: tensor bytes plus the header
        assert needed == (exported / "model.safetensors").stat().st_size
    else:
        assert needed > 50_000
    _nothing_beside(dst)
    assert not [p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.")]  # lock released too


@pytest.fixture
def read_only_dir(tmp_path):
    """A read-only tmpfs (EROFS even for root); skipped where mounting is not allowed."""
    with mounted_tmpfs(tmp_path / "ro", "ro,size=64k") as mnt:
        yield mnt


@pytest.mark.parametrize("command", ["export", "convert"])
def test_a_read_only_destination_is_one_paragraph_naming_the_file(reference_ckpt, read_only_dir, command, capsys):
    """A read-only destination is one paragraph naming it and EROFS, exit 2, before anything is written (the
    check before the first byte asks the file system; it would otherwise report free space it never gives)."""
    dst = read_only_dir / "out"
    args = [command, reference_ckpt, dst] + (["--to", "dp=2"] if command == "convert" else [])
    code, _, err = run_cli(args, capsys)
    assert code == 2
    text = _paragraph(err)
    assert text.startswith(f"error: {read_only_dir}/") and "EROFS" in text
    assert not dst.exists()


# ---------------------------------------------------------------------------- demo --out

def test_demo_refuses_an_out_directory_holding_a_user_file(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    code, _, err = run_cli(["demo", "--out", out], capsys)
    assert code == 2
    text = _paragraph(err)
    assert str(out) in text and "thesis.tex" in text
    assert sorted(p.name for p in out.iterdir()) == ["thesis.tex"]
    assert (out / "thesis.tex").read_text() == "years of work"


def test_demo_refuses_an_out_that_is_a_file(tmp_path, capsys):
    out = tmp_path / "notes.txt"
    out.write_text("keep")
    code, _, err = run_cli(["demo", "--out", out], capsys)
    assert code == 2 and "not a directory" in _paragraph(err)
    assert out.read_text() == "keep"


def test_demo_reclaims_only_what_an_earlier_demo_wrote(tmp_path):
    """An earlier demo's output is deleted exactly; a file the user added, even inside it, stops the rerun."""
    from reshard.commands.demo import MARKER, claim_output
    from reshard.errors import BadInput

    names = ["run4", "run4.jsonl", "rehearsal"]
    out = tmp_path / "demo"
    claim_output(out, names)
    assert (out / MARKER).is_file()
    (out / "run4" / "step_3").mkdir(parents=True)
    (out / "run4" / "step_3" / ".metadata").write_bytes(b"x")
    (out / "run4.jsonl").write_text("{}\n")
    # what the demo records when it finishes: every file it wrote
    from reshard.commands import demo

    demo._write_marker(out, {"created": names, "files": ["run4", "run4.jsonl", "run4/step_3",
                                                         "run4/step_3/.metadata"]})
    (out / "run4" / "step_3" / "my-notes.txt").write_text("mine")
    with pytest.raises(BadInput, match="my-notes.txt"):
        claim_output(out, names)
    assert (out / "run4" / "step_3" / "my-notes.txt").read_text() == "mine"
    assert (out / "run4" / "step_3" / ".metadata").exists()  # nothing deleted on refusal

    (out / "run4" / "step_3" / "my-notes.txt").unlink()
    claim_output(out, names)  # only the demo's own files left: reclaimed
    assert sorted(p.name for p in out.iterdir()) == [MARKER]


# ---------------------------------------------------------------------------- NUL byte in a storage path

def test_a_nul_byte_in_a_storage_path_is_named_by_every_command(plain_fsdp2_ckpt, copy_of, tmp_path, capsys):
    from torch.distributed.checkpoint.metadata import Metadata  # noqa: F401 - the class the pickle names

    ck = copy_of(plain_fsdp2_ckpt)
    with open(ck / ".metadata", "rb") as f:  # the test's own checkpoint: trusted, loaded with pickle
        md = pickle.load(f)
    idx = next(iter(md.storage_data))
    info = md.storage_data[idx]
    md.storage_data[idx] = dataclasses.replace(info, relative_path=info.relative_path + "\x00/../../etc/passwd")
    with open(ck / ".metadata", "wb") as f:
        pickle.dump(md, f)
    dst = tmp_path / "out"
    for args in (["inspect", ck], ["inspect", "--deep", ck], ["plan", ck, "--to", "dp=2"],
                 ["convert", ck, dst, "--to", "dp=2"], ["export", ck, dst], ["verify", plain_fsdp2_ckpt, ck]):
        code, out, err = run_cli(args, capsys)
        assert code == 2, (args, out, err)
        text = _paragraph(err)
        assert f"{ck / '.metadata'}" in text and "NUL" in text, (args, text)
        assert not dst.exists()


# ---------------------------------------------------------------------------- deeply nested JSON

def _deep() -> str:
    return "[" * DEEP + "]" * DEEP


def test_a_deeply_nested_manifest_exits_2_naming_it(reference_ckpt, copy_of, tmp_path, capsys):
    ck = copy_of(reference_ckpt)
    (ck / "manifest.json").write_text(_deep())
    dst = tmp_path / "out"
    for args in (["inspect", ck], ["plan", ck, "--to", "dp=2"], ["convert", ck, dst, "--to", "dp=2"],
                 ["export", ck, dst], ["verify", reference_ckpt, ck]):
        code, out, err = run_cli(args, capsys)
        assert code == 2, (args, out, err)
        assert "unexpected" not in err and "Traceback" not in err, (args, err)
        assert "manifest" in (out + err) and "nests deeper" in (out + err), (args, out, err)
        if err.strip():
            _paragraph(err)
        assert not dst.exists()


def test_a_deeply_nested_plan_file_exits_2_naming_it(reference_ckpt, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text(_deep())
    dst = tmp_path / "out"
    code, _, err = run_cli(["convert", reference_ckpt, dst, "--plan", plan], capsys)
    assert code == 2
    assert _paragraph(err).startswith(f"error: {plan}: the plan file nests deeper")
    assert not dst.exists()


def test_a_plan_file_that_is_missing_or_not_json_exits_2_naming_it(reference_ckpt, tmp_path, capsys):
    dst = tmp_path / "out"
    code, _, err = run_cli(["convert", reference_ckpt, dst, "--plan", tmp_path / "absent.json"], capsys)
    assert code == 2 and _paragraph(err).startswith(f"error: {tmp_path / 'absent.json'}: no such plan file")
    (tmp_path / "bad.json").write_text("{not json")
    code, _, err = run_cli(["convert", reference_ckpt, dst, "--plan", tmp_path / "bad.json"], capsys)
    assert code == 2 and _paragraph(err).startswith(f"error: {tmp_path / 'bad.json'}: the plan file is not valid JSON")
    assert not dst.exists()


def test_the_run_error_is_the_cause_not_its_echoes():
    """How `launch_workers` picks the run's error from what the workers left and how they ended."""
    from reshard.engine.distributed import WorkerFailed, raise_run_error

    own = {"rank": 1, "exit_code": 2, "paragraph": "src: incomplete", "relayed": False, "time": 2.0}
    echo = {"rank": 0, "exit_code": 2, "paragraph": "src: incomplete", "relayed": True, "time": 1.0}
    lost = {"rank": 0, "exit_code": 2, "paragraph": "one of the 2 workers stopped", "relayed": True, "time": 1.0}
    with pytest.raises(WorkerFailed) as e:  # a worker's own error, even when its echo came first
        raise_run_error([echo, own], {0: 2, 1: 2}, 2)
    assert (e.value.worker, e.value.exit_code, e.value.render()) == (1, 2, "src: incomplete")
    with pytest.raises(WorkerFailed, match="worker 1 of 2 was killed by SIGKILL"):  # not torchrun's SIGTERM
        raise_run_error([lost], {0: -signal.SIGTERM, 1: -signal.SIGKILL}, 2)
    with pytest.raises(WorkerFailed, match="one of the 2 workers stopped"):
        raise_run_error([lost], {0: 2}, 2)
    raise_run_error([], {0: 1}, 2)  # nothing reported: the caller exits with the worker's own code
