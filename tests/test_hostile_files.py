"""Hostile files inside a checkpoint (issue 13, findings 1 and 6/7's file parts), written as the attacks.

Every file a source names is opened through `reshard.safefs`: a symlink that leaves
the checkpoint, a device, a FIFO or a socket is refused by name (exit 2, one paragraph,
nothing committed); a symlink inside the checkpoint pointing inside it is followed; a root
that is itself a symlink (``latest -> step_3``) is fine. A planted lock symlink beside a
destination is refused, not followed. A `.metadata` declaring far more bytes than its
items hold is refused from metadata alone, before anything allocates them.
"""
from __future__ import annotations

import os
import pickle
import shutil
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import forked
import torch
import torch.distributed.checkpoint as dcp

from conftest import run_cli

PY = sys.executable


def _one_paragraph(err: str, *names: str) -> str:
    text = err.strip()
    assert text.startswith("error:"), err
    assert "\n\n" not in text and "Traceback" not in err and "unexpected" not in text, err
    for n in names:
        assert n in text, (n, text)
    return text


def _cli_subprocess(args: list, timeout: float = 120) -> subprocess.CompletedProcess:
    """The CLI in its own process, with a timeout: a FIFO must not be able to hang the suite."""
    return forked.run(args, timeout=timeout, env={**os.environ, "RESHARD_DEBUG": ""})


def _rank_files(ck: Path) -> list[Path]:
    return sorted(ck.glob("*.distcp"))


@pytest.fixture
def private_and_public(reference_ckpt, tmp_path):
    """A private checkpoint and a public directory whose files are symlinks into it."""
    private = tmp_path / "private"
    shutil.copytree(reference_ckpt, private)
    public = tmp_path / "public"
    public.mkdir()
    for p in private.iterdir():
        (public / p.name).symlink_to(p)
    return private, public


# ---------------------------------------------------------------- finding 1: data leak through symlinks

@pytest.mark.parametrize("command", ["inspect", "inspect --deep", "export", "convert", "verify"])
def test_checkpoint_of_symlinks_into_another_is_refused_by_every_command(private_and_public, reference_ckpt, tmp_path,
                                                                         capsys, command):
    _, public = private_and_public
    dst = tmp_path / "out"
    args = {"inspect": ["inspect", public], "inspect --deep": ["inspect", "--deep", public],
            "export": ["export", public, dst, "--format", "safetensors"],
            "convert": ["convert", public, dst, "--to", "dp=2"],
            "verify": ["verify", reference_ckpt, public]}[command]
    code, out, err = run_cli(args, capsys)
    assert code == 2, (out, err)
    _one_paragraph(err, "symbolic link", "outside the checkpoint")
    assert not dst.exists()
    assert not any(p.name.startswith(".out") for p in tmp_path.iterdir())


def test_only_the_data_files_symlinked_out_is_refused_naming_the_file(reference_ckpt, tmp_path, capsys):
    ck = tmp_path / "ck"
    shutil.copytree(reference_ckpt, ck)
    victim = _rank_files(ck)[1]
    elsewhere = tmp_path / "elsewhere.distcp"
    victim.rename(elsewhere)
    victim.symlink_to(elsewhere)
    code, _, err = run_cli(["inspect", ck], capsys)
    assert code == 2
    _one_paragraph(err, victim.name)


def test_symlinks_inside_the_checkpoint_and_a_symlinked_root_are_followed(reference_ckpt, tmp_path, capsys):
    ck = tmp_path / "step_3"
    shutil.copytree(reference_ckpt, ck)
    (ck / "real").mkdir()
    f = _rank_files(ck)[0]
    f.rename(ck / "real" / f.name)
    f.symlink_to(Path("real") / f.name)  # relative, inside the checkpoint
    latest = tmp_path / "latest"
    latest.symlink_to(ck)
    code, out, err = run_cli(["inspect", "--deep", latest], capsys)
    assert code == 0, (out, err)
    code, out, err = run_cli(["verify", reference_ckpt, latest], capsys)
    assert code == 0, (out, err)


def test_local_format_files_symlinked_out_are_refused(reference_ckpt, tmp_path, capsys):
    local = tmp_path / "local"
    code, out, err = run_cli(["convert", reference_ckpt, local, "--to", "dp=2", "--output-format", "local"], capsys)
    assert code == 0, (out, err)
    shard = next(local.glob("*.safetensors"))
    outside = tmp_path / shard.name
    shard.rename(outside)
    shard.symlink_to(outside)
    code, _, err = run_cli(["verify", reference_ckpt, local], capsys)
    assert code == 2
    _one_paragraph(err, shard.name, "outside the checkpoint")


# ---------------------------------------------------------------- finding 6: special files as inputs

def _replace_with(path: Path, kind: str) -> None:
    path.unlink()
    if kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "socket"])
@pytest.mark.parametrize("which", [".metadata", "data", "manifest.json"])
def test_special_file_as_input_is_refused_without_reading_it(reference_ckpt, tmp_path, kind, which):
    ck = tmp_path / "ck"
    shutil.copytree(reference_ckpt, ck)
    target = _rank_files(ck)[0] if which == "data" else ck / which
    _replace_with(target, kind)
    r = _cli_subprocess(["inspect", ck], timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    if r.stderr.strip():  # refused outright
        _one_paragraph(r.stderr, target.name)
    else:  # or reported among inspect's problems, which name the file
        assert "Traceback" not in r.stdout and "error" in r.stdout and target.name in r.stdout, r.stdout


def test_fifo_report_inside_the_checked_checkpoint_does_not_hang_verify(reference_ckpt, tmp_path):
    out = tmp_path / "out"
    r = _cli_subprocess(["convert", reference_ckpt, out, "--to", "dp=2"])
    assert r.returncode == 0, r.stderr
    (out / "reshard-report.json").unlink()
    os.mkfifo(out / "reshard-report.json")
    r = _cli_subprocess(["verify", reference_ckpt, out], timeout=120)
    assert r.returncode in (0, 2), (r.stdout, r.stderr)  # never evidence, never a hang
    if r.returncode == 2:
        _one_paragraph(r.stderr, "reshard-report.json")


def test_metadata_declaring_128_gib_in_8_kib_items_is_refused_before_allocating(tmp_path, capsys):
    ck = tmp_path / "ck"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(2048, dtype=torch.float32)}, checkpoint_id=str(ck), no_dist=True)
    with open(ck / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own file, written just now by dcp.save
    big = 1 << 35  # 128 GiB of float32
    tm = md.state_dict_metadata["w"]
    tm.size = torch.Size([big])
    tm.chunks[0].sizes = torch.Size([big])
    with open(ck / ".metadata", "wb") as f:
        pickle.dump(md, f)
    dst = tmp_path / "out"
    for args in (["inspect", ck], ["plan", ck, "--to", "dp=2"], ["convert", ck, dst, "--to", "dp=2"],
                 ["export", ck, dst, "--format", "safetensors"]):
        code, out, err = run_cli(args, capsys)
        assert code == 2, (args, out, err)
        if args[0] == "inspect":
            assert "item" in out and "'w'" in out, out
        else:
            _one_paragraph(err)
        assert not dst.exists()


# ---------------------------------------------------------------- finding 7: the planted lock symlink

def test_planted_lock_symlink_is_refused_not_followed(reference_ckpt, tmp_path, capsys):
    dst = tmp_path / "out"
    victim = tmp_path / "victim-file"
    (tmp_path / ".out.reshard-lock").symlink_to(victim)
    code, _, err = run_cli(["convert", reference_ckpt, dst, "--to", "dp=2"], capsys)
    assert code == 2
    _one_paragraph(err, ".out.reshard-lock")
    assert not victim.exists() and not dst.exists()


# ---------------------------------------------------------------- finding 6: a compression bomb in a tensor item

def test_zstd_tensor_item_that_inflates_past_its_chunk_is_refused(tmp_path, capsys):
    zstandard = pytest.importorskip("zstandard")
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    ck = tmp_path / "ck"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(256)}, storage_writer=FileSystemWriter(str(ck), _extensions=[ZStandard()]),
                 no_dist=True)
    with open(ck / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own file, written just now by dcp.save
    (index, info), = [(k, v) for k, v in md.storage_data.items() if k.fqn == "w"]
    data_file = ck / info.relative_path
    comp = zstandard.ZstdCompressor(level=1).compressobj()
    bomb = bytearray()
    zeros = bytes(16 << 20)
    for _ in range(16):  # 256 MiB of zeros, about 8 KiB compressed
        bomb += comp.compress(zeros)
    bomb += comp.flush()
    with open(data_file, "ab") as f:
        start = f.tell()
        f.write(bomb)
    info.offset, info.length = start, len(bomb)
    with open(ck / ".metadata", "wb") as f:
        pickle.dump(md, f)
    dst = tmp_path / "out"
    code, out, _ = run_cli(["inspect", "--deep", ck], capsys)
    assert code == 2 and "inflates to more than" in out, out
    code, _, err = run_cli(["export", ck, dst, "--format", "safetensors"], capsys)
    assert code == 2
    _one_paragraph(err, "'w'", "inflates to more than")
    assert not dst.exists()


def test_metadata_cap_follows_the_data_it_describes(tmp_path, capsys, monkeypatch):
    """No constant cap refuses a frontier checkpoint's 9 GB `.metadata`; one larger than all its data is refused."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from conftest import run_cli
    from reshard.storage.checkpoints import dcp as dcp_mod

    src = tmp_path / "ck"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.arange(4096.0)}}, checkpoint_id=str(src), no_dist=True)
    monkeypatch.setattr(dcp_mod, "MIN_METADATA_CAP", 64)
    meta = src / ".metadata"
    data = sum(p.stat().st_size for p in src.iterdir() if p.name != ".metadata")
    assert meta.stat().st_size < data
    code, out, err = run_cli(["inspect", src, "--json", "--no-profile"], capsys)
    assert code == 0, err
    with open(meta, "ab") as f:  # bytes after the pickle's STOP: larger than the data it describes
        f.write(b"\0" * data)
    code, out, err = run_cli(["inspect", src, "--json", "--no-profile"], capsys)
    assert code == 2 and ".metadata" in err and "more than the" in err, err
