"""`reshard import` on hostile sources: every index entry loaded from inside the source, every name accounted for.

Each test builds a sharded source with real ``torch.save`` (a ``pytorch_model.bin.index.json``
directory) or ``safetensors.torch.save_file`` (a ``model.safetensors.index.json`` directory),
then attacks it the way a hub download or a shared directory could: an index entry in a
subdirectory (fine), one leaving the source (``..``, absolute, a symlink out), an index that
lists a name its shard does not hold, a shard holding a tensor the index does not list, a
shard or an index that is a FIFO or a link to ``/dev/zero``. The safe outcome is exit 2 with
one paragraph naming the index (or the file), the name and the shard, no traceback, and
nothing at the destination; the valid sources import and `verify` against the source.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

import forked
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import run_cli

FORMATS = ("torch", "safetensors")
INDEX = {"torch": "pytorch_model.bin.index.json", "safetensors": "model.safetensors.index.json"}
SUFFIX = {"torch": ".bin", "safetensors": ".safetensors"}
HANG_GUARD = 300  # seconds: only so a regression fails instead of hanging the suite


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(13)
    return {"embed.weight": torch.randn(8, 4, generator=g), "layers.0.weight": torch.randn(4, 4, generator=g),
            "layers.0.bias": torch.randn(4, generator=g), "norm.weight": torch.randn(4, generator=g)}


def _save(path: Path, fmt: str, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "torch":
        torch.save(tensors, path)
    else:
        save_file(tensors, str(path))


def _shard(fmt: str, n: int, sub: str = "") -> str:
    return f"{sub}model-0000{n}-of-00002{SUFFIX[fmt]}"


def _source(root: Path, fmt: str, *, second: str | None = None, extra: dict[str, torch.Tensor] | None = None,
            weight_map: dict[str, str] | None = None) -> Path:
    """Two shards (embed + norm, then the layer) and their index; ``second`` names the layer's shard."""
    t = _tensors()
    first, second = _shard(fmt, 1), second or _shard(fmt, 2)
    layout = {first: ["embed.weight", "norm.weight"], second: ["layers.0.weight", "layers.0.bias"]}
    for f, names in layout.items():
        held = {n: t[n] for n in names}
        if f == second and extra:
            held.update(extra)
        _save(root / f, fmt, held)
    wm = weight_map if weight_map is not None else {n: f for f, names in layout.items() for n in names}
    (root / INDEX[fmt]).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": wm}, indent=2))
    return root


def _refused(code: int, err: str, out_dir: Path, *needles: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err and "unexpected" not in err, err
    for n in needles:
        assert n in err, (n, err)
    assert list(out_dir.iterdir()) == [], "nothing may be committed (or left) at the destination"


def _out(tmp_path: Path) -> tuple[Path, Path]:
    out = tmp_path / "out"
    out.mkdir()
    return out, out / "imported"


def _cli_subprocess(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return forked.run(args, env=env, timeout=HANG_GUARD)


def _imported_equals(dst: Path, tensors: dict[str, torch.Tensor]) -> None:
    from reshard.storage.checkpoints.index import CheckpointIndex

    ix = CheckpointIndex.open(dst)
    assert sorted(k for k in ix.entries if k.startswith("model.")) == sorted("model." + n for n in tensors)
    for n, t in tensors.items():
        got = ix.read_tensor("model." + n)
        assert got.dtype == t.dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8)), n


# ------------------------------------------------------------------------------------ valid sources
@pytest.mark.parametrize("fmt", FORMATS)
def test_entry_in_a_subdirectory_loads_and_verifies_against_the_source(fmt, tmp_path, capsys):
    src = _source(tmp_path / "src", fmt, second=_shard(fmt, 2, sub="layers/"))
    out, dst = _out(tmp_path)
    code, stdout, err = run_cli(["import", src, dst, "--to", "dp=2"], capsys)
    assert code == 0, err
    assert "4 keys accounted for" in stdout
    _imported_equals(dst, _tensors())
    # verify against the source: the safetensors source itself, or the same weights as safetensors for torch
    ref = src if fmt == "safetensors" else _source(tmp_path / "ref", "safetensors", second=_shard("safetensors", 2, "layers/"))
    code, stdout, err = run_cli(["verify", ref, dst], capsys)
    assert code == 0, stdout + err


@pytest.mark.parametrize("fmt", FORMATS)
def test_symlink_to_a_shard_inside_the_source_is_followed(fmt, tmp_path, capsys):
    src = _source(tmp_path / "src", fmt, second=_shard(fmt, 2, sub="blobs/"))
    (src / _shard(fmt, 2)).symlink_to(Path("blobs") / _shard(fmt, 2))
    ix = json.loads((src / INDEX[fmt]).read_text())
    ix["weight_map"] = {n: Path(f).name for n, f in ix["weight_map"].items()}
    (src / INDEX[fmt]).write_text(json.dumps(ix))
    out, dst = _out(tmp_path)
    code, _, err = run_cli(["import", src, dst], capsys)
    assert code == 0, err
    _imported_equals(dst, _tensors())


# ------------------------------------------------------------------------------------ entries leaving the source
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_entry_leaving_the_source_is_refused_by_name(fmt, how, tmp_path, capsys):
    private = tmp_path / "private"  # another (private) checkpoint's shard, with the same tensor names
    secret = {n: torch.full_like(t, 123.0) for n, t in _tensors().items() if n.startswith("layers.")}
    _save(private / _shard(fmt, 2), fmt, secret)
    src = tmp_path / "src"
    if how == "symlink":
        _source(src, fmt)
        (src / _shard(fmt, 2)).unlink()
        (src / _shard(fmt, 2)).symlink_to(private / _shard(fmt, 2))
        needles = (_shard(fmt, 2), "outside")
    else:
        target = f"../private/{_shard(fmt, 2)}" if how == "dotdot" else str(private / _shard(fmt, 2))
        wm = {"embed.weight": _shard(fmt, 1), "norm.weight": _shard(fmt, 1),
              "layers.0.weight": target, "layers.0.bias": target}
        _source(src, fmt, weight_map=wm)
        needles = (INDEX[fmt], "index entry 'layers.0.", target, "outside the source")
    out, dst = _out(tmp_path)
    code, _, err = run_cli(["import", src, dst], capsys)
    _refused(code, err, out, *needles)


# ------------------------------------------------------------------------------------ names not accounted for
@pytest.mark.parametrize("fmt", FORMATS)
def test_index_listing_a_name_its_shard_does_not_hold_is_refused(fmt, tmp_path, capsys):
    t = _tensors()
    wm = {"embed.weight": _shard(fmt, 1), "norm.weight": _shard(fmt, 1), "ghost.weight": _shard(fmt, 1),
          "layers.0.weight": _shard(fmt, 2), "layers.0.bias": _shard(fmt, 2)}
    src = _source(tmp_path / "src", fmt, weight_map=wm)
    assert "ghost.weight" not in t
    out, dst = _out(tmp_path)
    code, _, err = run_cli(["import", src, dst], capsys)
    _refused(code, err, out, INDEX[fmt], "'ghost.weight'", _shard(fmt, 1), "does not hold it", "regenerate the index")


@pytest.mark.parametrize("fmt", FORMATS)
def test_shard_holding_a_tensor_the_index_does_not_list_is_refused(fmt, tmp_path, capsys):
    src = _source(tmp_path / "src", fmt, extra={"stowaway.weight": torch.ones(3)})
    out, dst = _out(tmp_path)
    code, _, err = run_cli(["import", src, dst], capsys)
    _refused(code, err, out, INDEX[fmt], "'stowaway.weight'", _shard(fmt, 2), "does not list it", "regenerate the index")


@pytest.mark.parametrize("fmt", FORMATS)
def test_tensor_stored_in_another_shard_than_the_index_says_is_refused(fmt, tmp_path, capsys):
    wm = {"embed.weight": _shard(fmt, 1), "norm.weight": _shard(fmt, 1),
          "layers.0.weight": _shard(fmt, 2), "layers.0.bias": _shard(fmt, 1)}
    src = _source(tmp_path / "src", fmt, weight_map=wm)
    out, dst = _out(tmp_path)
    code, _, err = run_cli(["import", src, dst], capsys)
    _refused(code, err, out, INDEX[fmt], "'layers.0.bias'", _shard(fmt, 1), _shard(fmt, 2))


# ------------------------------------------------------------------------------------ special files
@pytest.mark.parametrize("fmt", FORMATS)
def test_shard_that_is_a_fifo_is_refused_without_hanging(fmt, tmp_path):
    src = _source(tmp_path / "src", fmt)
    (src / _shard(fmt, 2)).unlink()
    os.mkfifo(src / _shard(fmt, 2))  # nobody ever writes to it: a reader that opens it blocks forever
    out, dst = _out(tmp_path)
    r = _cli_subprocess(["import", src, dst, "--to", "dp=1"])
    _refused(r.returncode, r.stderr, out, _shard(fmt, 2), "FIFO")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_index_that_is_a_fifo_or_dev_zero_is_refused_not_skipped(fmt, kind, tmp_path):
    src = _source(tmp_path / "src", fmt)
    (src / INDEX[fmt]).unlink()
    if kind == "fifo":
        os.mkfifo(src / INDEX[fmt])
    else:
        (src / INDEX[fmt]).symlink_to("/dev/zero")
    out, dst = _out(tmp_path)
    r = _cli_subprocess(["import", src, dst])
    _refused(r.returncode, r.stderr, out, INDEX[fmt])


@pytest.mark.parametrize("fmt", FORMATS)
def test_shard_named_by_the_index_but_missing_is_refused_naming_its_tensors(fmt, tmp_path, capsys):
    src = _source(tmp_path / "src", fmt)
    (src / _shard(fmt, 2)).unlink()
    out, dst = _out(tmp_path)
    code, _, err = run_cli(["import", src, dst], capsys)
    _refused(code, err, out, INDEX[fmt], _shard(fmt, 2), "missing", "layers.0.bias")


# ------------------------------------------------------------------------------------ property: nothing silently lost
_NAMES = ["a.weight", "b.weight", "c.bias", "d.weight", "e.scale"]


@st.composite
def _indexed_sources(draw):
    """A sharded source (shards possibly in subdirectories) and one damage to its index, or none."""
    fmt = draw(st.sampled_from(FORMATS))
    shards = draw(st.lists(st.sampled_from(["", "sub/", "deep/er/"]), min_size=1, max_size=3))
    files = [f"{sub}part-{i}{SUFFIX[fmt]}" for i, sub in enumerate(shards)]
    layout = {n: draw(st.sampled_from(files)) for n in _NAMES}
    damage = draw(st.sampled_from(["none", "ghost", "unlisted", "moved", "outside"]))
    victim = draw(st.sampled_from(_NAMES))
    return fmt, files, layout, damage, victim


@given(_indexed_sources())
@settings(max_examples=16, deadline=None, derandomize=True, database=None)
def test_property_an_import_takes_exactly_what_the_index_lists_or_refuses(case):
    from reshard.errors import BadInput
    from reshard.engine.importing import import_checkpoint

    fmt, files, layout, damage, victim = case
    g = torch.Generator().manual_seed(len(files))
    tensors = {n: torch.randn(2 + i, 3, generator=g) for i, n in enumerate(_NAMES)}
    with tempfile.TemporaryDirectory() as td:
        src, out = Path(td) / "src", Path(td) / "out"
        out.mkdir()
        for f in files:
            held = {n: tensors[n] for n in _NAMES if layout[n] == f}
            if damage == "unlisted" and f == layout[victim]:
                held["stowaway"] = torch.ones(2)
            if held:
                _save(src / f, fmt, held)
        wm = {n: f for n, f in layout.items()}
        if damage == "ghost":
            wm["ghost." + victim] = layout[victim]
        elif damage == "moved":
            others = [f for f in files if f != layout[victim] and (src / f).exists()]
            if not others:
                damage = "ghost"
                wm["ghost." + victim] = layout[victim]
            else:
                wm[victim] = others[0]
        elif damage == "outside":
            wm[victim] = "../" + Path(layout[victim]).name
        src.mkdir(parents=True, exist_ok=True)
        (src / INDEX[fmt]).write_text(json.dumps({"weight_map": wm}))
        dst = out / "imported"
        if damage == "none":
            rep = import_checkpoint(src, dst, to="dp=2")
            assert sorted(k["name"] for k in rep["keys"]) == sorted(_NAMES)
            _imported_equals(dst, tensors)
        else:
            with pytest.raises(BadInput) as exc:
                import_checkpoint(src, dst, to="dp=2")
            assert INDEX[fmt] in exc.value.render()
            assert list(out.iterdir()) == []
