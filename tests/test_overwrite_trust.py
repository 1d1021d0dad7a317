"""Trust III (issue 32): ``--overwrite`` replaces only checkpoints, a report names what was written, and a
self-referencing ``.metadata`` is bad input. Each test is written as the attack.

1. ``convert``/``export``/``import --overwrite`` into a folder of notes, or into a real checkpoint with a
   user's ``notes.txt`` beside its files, exits 2 with one paragraph naming what would be lost (first
   files and count) and the way out; nothing there is touched and nothing is left beside it. A file
   that appears while the output is written is caught right before the swap (a real process, paused
   by the fault hook). What *is* a checkpoint (real ``dcp.save``, reshard's own outputs, a
   ``torch.save`` file, Hugging Face safetensors written by ``safetensors``) is replaced.
2. ``--overwrite`` of a destination that is a symbolic link: the report (terminal JSON,
   ``reshard-report.json``, ``reshard-report.md``) names the path written, the link's place, and the
   old target directory is byte-identical afterwards.
3. A ``.metadata`` whose objects refer to themselves (torch's own ``Metadata`` re-pickled with a cycle;
   hand-assembled memo opcodes) exits 2 for ``inspect``, ``plan`` and ``verify`` with one paragraph
   naming the file.

Sources are the session's ``reference_ckpt`` (real ``dcp.save`` in spawned gloo ranks) and one
``export`` of it made once for the module; the CLI runs in-process except where the process is the point.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import time
from pathlib import Path

import pytest
import torch

import forked
from conftest import cli

BOUND = 60.0  # seconds any one refused or successful command here may take on 2 shared cores


def _snapshot(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (not following links) with its bytes' SHA-256 or what it is."""
    out: dict[str, str] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "link -> " + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _paragraph(err: str, *names: str) -> str:
    text = err.strip()
    assert text.startswith("error: ") and "\n" not in text, err
    for word in ("Traceback", "unexpected", "report it"):
        assert word not in text, text
    for n in names:
        assert n in text, (n, text)
    return text


def _timed(args: list) -> tuple[int, str, str]:
    t = time.monotonic()
    code, out, err = cli(args)
    assert time.monotonic() - t < BOUND, (args, time.monotonic() - t)
    return code, out, err


def _nothing_beside(dst: Path) -> None:
    assert not [p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.reshard-")
                and not p.name.endswith("-lock")]


@pytest.fixture(scope="module")
def exported(reference_ckpt, tmp_path_factory) -> Path:
    """A safetensors export of the reference checkpoint (an import source and an earlier reshard output)."""
    out = tmp_path_factory.mktemp("overwrite") / "export"
    code, _, err = cli(["export", reference_ckpt, out, "--format", "safetensors"])
    assert code == 0, err
    return out


def _notes(where: Path) -> Path:
    where.mkdir()
    (where / "notes.txt").write_text("my notes")
    (where / "todo.md").write_text("- buy GPUs")
    (where / "drafts").mkdir()
    (where / "drafts" / "idea.txt").write_text("idea")
    return where


# ---------------------------------------------------------------------------- 1. only checkpoints are replaced

def test_overwrite_refuses_a_folder_of_notes_for_convert_export_and_import(reference_ckpt, exported, tmp_path):
    dst = _notes(tmp_path / "notes")
    before = _snapshot(dst)
    for args in (["convert", reference_ckpt, dst, "--to", "dp=2", "--overwrite"],
                 ["export", reference_ckpt, dst, "--format", "safetensors", "--overwrite"],
                 ["import", exported, dst, "--to", "dp=2", "--overwrite"]):
        code, out, err = _timed(args)
        assert code == 2, (args, out, err)
        _paragraph(err, str(dst), "3 files", "notes.txt", "todo.md", "drafts/idea.txt", "move", "another output")
        assert _snapshot(dst) == before
        _nothing_beside(dst)


def test_overwrite_refuses_a_checkpoint_with_a_user_file_beside_it_then_replaces_it_whole(reference_ckpt, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(reference_ckpt, dst)
    (dst / "notes.txt").write_text("mine")
    before = _snapshot(dst)
    code, _, err = _timed(["convert", reference_ckpt, dst, "--to", "dp=2", "--overwrite"])
    assert code == 2
    _paragraph(err, "1 file", "notes.txt")
    assert _snapshot(dst) == before
    (dst / "notes.txt").unlink()
    code, _, err = _timed(["convert", reference_ckpt, dst, "--to", "dp=2", "--overwrite"])
    assert code == 0, err
    assert sorted(p.name for p in dst.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # the 4-rank files went
    # reshard's own output is replaceable in turn, by export and by import
    exp = tmp_path / "exp"
    assert cli(["export", dst, exp, "--format", "safetensors"])[0] == 0
    code, _, err = _timed(["export", reference_ckpt, exp, "--format", "torch", "--overwrite"])
    assert code == 0, err
    assert (exp / "model.pt").is_file() and not list(exp.glob("*.safetensors"))
    code, _, err = _timed(["import", exp / "model.pt", dst, "--to", "dp=1", "--overwrite"])
    assert code == 0, err
    assert json.loads((dst / "import-report.json").read_text())["destination"] == str(dst.parent.resolve() / dst.name)
    _nothing_beside(dst)


def test_a_file_added_while_the_output_is_written_stops_the_swap(reference_ckpt, tmp_path):
    """The rule is checked again right before the swap: a real process, paused after its first write."""
    dst = tmp_path / "ckpt"
    shutil.copytree(reference_ckpt, dst)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESHARD_FAULT_")}
    p = forked.start(["convert", reference_ckpt, dst, "--to", "dp=2", "--overwrite"],
                     env={**env, "RESHARD_FAULT_SLEEP_AT": "1:3", "RESHARD_DEBUG": ""})
    deadline = time.monotonic() + BOUND
    while not [q for q in tmp_path.iterdir() if q.name.startswith(".ckpt.reshard-tmp-")]:
        assert p.poll() is None and time.monotonic() < deadline, p.output()
        time.sleep(0.05)
    (dst / "notes.txt").write_text("written meanwhile")
    before = _snapshot(dst)
    _, err = p.communicate(timeout=BOUND)
    assert p.returncode == 2, err
    _paragraph(err, "notes.txt")
    assert _snapshot(dst) == before
    _nothing_beside(dst)


def test_what_counts_as_a_checkpoint(reference_ckpt, tmp_path):
    """The rule on files real libraries wrote, and on what only looks like them."""
    from safetensors.torch import save_file

    from reshard.storage.files.replaceable import survey

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"w": torch.ones(2)}, str(hf / "model.safetensors"))
    (hf / "config.json").write_text('{"model_type": "llama"}')
    pt = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2)}, pt)
    lightning = tmp_path / "lightning"
    shutil.copytree(reference_ckpt, lightning)
    torch.save({"step": 3}, lightning / "meta.pt")  # a known trainer sidecar
    assert survey(reference_ckpt).anchor == ".metadata"
    for ok in (hf, pt, lightning):
        assert survey(ok).replaceable, (ok, survey(ok).describe())
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "model.pt").write_text("a note saved under a checkpoint's name")  # the name, not the bytes
    (fake / "manifest.json").write_text("{}")
    s = survey(fake)
    assert not s.replaceable and s.unrecognised == ["model.pt"] and s.count == 1
    only_config = tmp_path / "cfg"
    only_config.mkdir()
    (only_config / "config.json").write_text("{}")
    assert not survey(only_config).replaceable and "not a checkpoint" in survey(only_config).describe()
    many = _notes(tmp_path / "many")
    for i in range(9):
        (many / f"n{i}.txt").write_text("x")
    s = survey(many)
    assert s.count == 12 and len(s.unrecognised) == 5 and "and 7 more" in s.describe()
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    assert not survey(dangling).replaceable and "does not exist" in survey(dangling).describe()


# ---------------------------------------------------------------------------- 2. the report names what was written

def test_overwrite_of_a_symlink_destination_names_the_new_directory_and_leaves_the_target(reference_ckpt, tmp_path):
    target = tmp_path / "old-target"
    shutil.copytree(reference_ckpt, target)
    before = _snapshot(target)
    dst = tmp_path / "latest"
    dst.symlink_to(target)
    code, _, err = _timed(["convert", reference_ckpt, dst, "--to", "dp=2"])
    assert code == 2 and "--overwrite" in err
    code, out, err = _timed(["convert", reference_ckpt, dst, "--to", "dp=2", "--overwrite", "--json"])
    assert code == 0, err
    written = str(tmp_path.resolve() / "latest")
    assert json.loads(out)["destination"] == written
    assert json.loads((dst / "reshard-report.json").read_text())["destination"] == written
    assert f"`{written}`" in (dst / "reshard-report.md").read_text()
    assert dst.is_dir() and not dst.is_symlink()
    assert sorted(p.name for p in dst.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert _snapshot(target) == before  # the old link's target: not written, not deleted
    _nothing_beside(dst)


def test_a_symlink_to_a_folder_of_notes_is_refused_and_both_stay(reference_ckpt, tmp_path):
    notes = _notes(tmp_path / "notes")
    before = _snapshot(notes)
    dst = tmp_path / "out"
    dst.symlink_to(notes)
    code, _, err = _timed(["convert", reference_ckpt, dst, "--to", "dp=2", "--overwrite"])
    assert code == 2
    _paragraph(err, "notes.txt")
    assert dst.is_symlink() and os.readlink(dst) == str(notes) and _snapshot(notes) == before


# ---------------------------------------------------------------------------- 3. a self-referencing .metadata

def _hand_assembled_self_reference() -> bytes:
    """Opcodes no pickler writes for DCP: a ``Metadata`` record whose state holds the record itself (memo 0)."""
    def text(s: str) -> bytes:
        b = s.encode()
        return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE

    return (b"\x80\x04" + text("torch.distributed.checkpoint.metadata") + text("Metadata") + b"\x93"  # STACK_GLOBAL
            + b")\x81\x94"  # EMPTY_TUPLE NEWOBJ MEMOIZE (memo 0: the record)
            + b"}(" + text("state_dict_metadata") + b"h\x00" + text("storage_data") + b"}u"  # its state, memo 0 inside
            + b"b.")  # BUILD STOP


def _self_references(md) -> dict[str, bytes]:
    """torch's own Metadata (re-read from a real checkpoint) with a cycle, pickled by stock pickle."""
    out = {}
    tm = next(v for v in md.state_dict_metadata.values() if hasattr(v, "chunks"))
    saved = tm.chunks[0].offsets
    tm.chunks[0].offsets = md  # a chunk whose field points back to the metadata
    out["chunk-to-metadata"] = pickle.dumps(md)
    tm.chunks[0].offsets = saved
    loop: list = []
    loop.append(loop)  # a list that contains itself
    md.planner_data = loop
    out["list-in-itself"] = pickle.dumps(md)
    out["hand-assembled"] = _hand_assembled_self_reference()
    return out


def test_self_referencing_metadata_is_bad_input_for_inspect_plan_and_verify(reference_ckpt, tmp_path):
    with open(reference_ckpt / ".metadata", "rb") as f:
        md = pickle.load(f)  # the session's own checkpoint, written by dcp.save in this test run
    for name, data in _self_references(md).items():
        ck = tmp_path / name
        shutil.copytree(reference_ckpt, ck)
        (ck / ".metadata").write_bytes(data)
        for args in (["inspect", ck], ["plan", ck, "--to", "dp=2"], ["verify", ck, reference_ckpt],
                     ["verify", reference_ckpt, ck]):
            code, out, err = _timed(args)
            assert code == 2, (name, args, out, err)
            _paragraph(err, str(ck / ".metadata"), "contains itself", "restore it")
