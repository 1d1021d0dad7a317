"""Lightning Fabric (lightning-fabric 2.6.6) checkpoints, written and read back by Fabric itself (issue 15).

The writer (tests/writers/lightning_run.py) is a Fabric user's script: `ModelParallelStrategy`
with a parallelize function applying FSDP2 `fully_shard` over the data-parallel mesh, Adam, a
LambdaLR scheduler, and `fabric.save(path, {"model", "optimizer", "step", "epoch",
"scheduler": sched.state_dict()})`. Fabric writes the model and optimizer with DCP and
everything else to the `meta.pt` sidecar. The checkpoint is converted to dp=1 and dp=4 and
`fabric.load` at that world size must restore exactly what was saved, `meta.pt` included.

CPU substitutions (none changes the bytes on disk):
- `accelerator="cpu"` and `process_group_backend="gloo"` instead of CUDA/NCCL: Fabric's save
  path (`_save_checkpoint` -> `get_model_state_dict`/`get_optimizer_state_dict` with
  `cpu_offload=True` -> `torch.distributed.checkpoint.save`, `torch.save(meta.pt)` on rank 0)
  is the same code on every device; the state is offloaded to CPU before it is written anyway.
- The processes are started by `python -m torch.distributed.run --standalone` (Fabric detects
  torchelastic and does not spawn its own), as a multi-GPU Fabric job is started with torchrun.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import assert_bitwise_equal, require_packages, run_torchrun  # noqa: E402

require_packages("lightning_fabric")  # found, not imported: see conftest

import torch  # noqa: E402

from conftest import cli, run_cli  # noqa: E402

WRITER = Path(__file__).parent / "writers" / "lightning_run.py"
SOURCE_WORLD = 2
TARGET_WORLDS = (1, 4)


def torchrun(nproc: int, *args: str | Path) -> None:
    run_torchrun(WRITER, nproc, *args)


@pytest.fixture(scope="module")
def fabric_ckpt(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, reference): written once by Fabric at 2 ranks."""
    root = tmp_path_factory.mktemp("lightning")
    ckpt, ref = root / "fabric-ckpt", root / "reference.pt"
    torchrun(SOURCE_WORLD, "write", ckpt, ref)
    return ckpt, ref


@pytest.fixture(scope="module")
def converted(fabric_ckpt, tmp_path_factory) -> dict[int, tuple[int, str, str, Path]]:
    """world -> (exit code, stdout, stderr, output dir) of `reshard convert --to dp=<world>`."""
    ckpt, _ = fabric_ckpt
    root = tmp_path_factory.mktemp("lightning-out")
    out = {}
    for world in TARGET_WORLDS:
        dst = root / f"dp{world}"
        code, stdout, stderr = cli(["convert", ckpt, dst, "--to", f"dp={world}"])
        out[world] = (code, stdout, stderr, dst)
    return out


def test_inspect_lightning_roles_topology_and_meta_pt(fabric_ckpt, capsys):
    ckpt, _ = fabric_ckpt
    code, out, err = run_cli(["inspect", ckpt, "--json"], capsys)
    assert code == 0, (out, err)
    r = json.loads(out)
    assert r["convention"]["name"] == "lightning"
    assert r["unknown_keys"] == []
    assert {role: s["count"] for role, s in r["by_role"].items()} == {
        "parameter": 5, "optimizer_moment": 10, "optimizer_step": 5, "param_group": 13}
    assert r["topology"]["dp_shard"] == SOURCE_WORLD and r["topology"]["world_size"] == SOURCE_WORLD
    assert r["optimizer"]["with_moments"] == r["optimizer"]["parameters"] == 5
    assert r["step"] == 3
    (meta,) = [s for s in r["sidecars"] if s["name"] == "meta.pt"]
    assert meta["format"] == "torch-weights-only" and meta["policy"] == "carry"
    assert meta["size"] == (ckpt / "meta.pt").stat().st_size
    assert meta["read"] is True
    assert meta["content"]["step"] == 3 and meta["content"]["epoch"] == 2
    assert meta["content"]["scheduler"]["last_epoch"] == 3
    assert [s["name"] for s in r["sidecars"]] == ["meta.pt"]


def test_inspect_text_names_meta_pt(fabric_ckpt, capsys):
    ckpt, _ = fabric_ckpt
    code, out, err = run_cli(["inspect", ckpt], capsys)
    assert code == 0, (out, err)
    assert "meta.pt" in out, out


@pytest.mark.parametrize("world", TARGET_WORLDS)
def test_plan_lists_meta_pt(fabric_ckpt, world, capsys):
    ckpt, _ = fabric_ckpt
    code, out, err = run_cli(["plan", ckpt, "--to", f"dp={world}", "--json"], capsys)
    assert code == 0, (out, err)
    p = json.loads(out)
    assert p["feasible"], p["reasons"]
    assert [s["name"] for s in p["source"]["sidecars"]] == ["meta.pt"]
    assert p["source"]["sidecars"][0]["policy"] == "carry"


@pytest.mark.parametrize("world", TARGET_WORLDS)
def test_convert_carries_meta_pt_byte_identical(fabric_ckpt, converted, world, capsys):
    ckpt, _ = fabric_ckpt
    code, out, err, dst = converted[world]
    assert code == 0, (out, err)
    assert (dst / "meta.pt").read_bytes() == (ckpt / "meta.pt").read_bytes()
    report = json.loads((dst / "reshard-report.json").read_text())
    assert [(s["name"], s["carried"], s["policy"]) for s in report["sidecars"]] == [("meta.pt", True, "carry")]
    code, out, err = run_cli(["inspect", dst, "--json"], capsys)
    assert code == 0, (out, err)
    assert json.loads(out)["topology"]["world_size"] == world


@pytest.mark.parametrize("world", TARGET_WORLDS)
def test_fabric_loads_the_converted_checkpoint_bitwise(fabric_ckpt, converted, world, tmp_path, capsys):
    _, ref = fabric_ckpt
    code, out, err, dst = converted[world]
    assert code == 0, (out, err)
    loaded = tmp_path / "loaded.pt"
    torchrun(world, "load", dst, loaded)
    got = torch.load(loaded, weights_only=False)
    want = torch.load(ref, weights_only=False)
    assert got.pop("remainder") == []  # nothing in meta.pt that the state did not ask for
    assert_bitwise_equal(want, got)


def test_fabric_loads_its_own_checkpoint_bitwise(fabric_ckpt, tmp_path, capsys):
    """The control: the loader restores the source itself exactly (at its own world size)."""
    ckpt, ref = fabric_ckpt
    loaded = tmp_path / "loaded.pt"
    torchrun(SOURCE_WORLD, "load", ckpt, loaded)
    got = torch.load(loaded, weights_only=False)
    got.pop("remainder")
    assert_bitwise_equal(torch.load(ref, weights_only=False), got)
