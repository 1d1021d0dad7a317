"""HF Accelerate (accelerate 1.15.0) FSDP folders, written and read back by accelerate's own functions (issue 15).

Under FSDP with SHARDED_STATE_DICT, `accelerator.save_state(dir)` writes two DCP checkpoints:
`dir/pytorch_model_fsdp_0/` (`{"model": ...}`) and `dir/optimizer_0/` (`{"optimizer": ...}`, an
optimizer-only checkpoint), plus `scheduler.bin` and `random_states_<rank>.pkl` beside them.
Each folder is converted on its own to dp=1 and dp=4 and loaded back by accelerate's
`load_fsdp_model` / `load_fsdp_optimizer` at that world size, bitwise equal to what was saved.

CPU substitutions (tests/writers/accelerate_run.py says more):
- accelerate 1.15.0 turns FSDP on only for device-backed distributed types; on CPU
  (`Accelerator(cpu=True)`, MULTI_CPU over gloo) it ignores the FSDP plugin and prepares DDP.
  So the model is sharded with torch's `fully_shard` (what accelerate's `fsdp2_prepare_model`
  calls) and the folders are written and read by the functions `save_state` / `load_state`
  call under FSDP: `accelerate.utils.fsdp_utils.save_fsdp_model` / `save_fsdp_optimizer` /
  `load_fsdp_model` / `load_fsdp_optimizer`, with a `FullyShardedDataParallelPlugin(fsdp_version=2,
  state_dict_type="SHARDED_STATE_DICT")`. The scheduler and RNG files come from accelerate's
  `save_accelerator_state`. The bytes of each folder are those functions' `dist_cp.save`,
  whatever device the tensors were trained on (they are gathered to CPU by the state dict).
- gloo instead of NCCL; processes started by `torch.distributed.run --standalone`.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import assert_bitwise_equal, require_packages, run_torchrun  # noqa: E402

require_packages("accelerate")  # found, not imported: see conftest

import torch  # noqa: E402

from conftest import cli, run_cli  # noqa: E402

WRITER = Path(__file__).parent / "writers" / "accelerate_run.py"
SOURCE_WORLD = 2
TARGET_WORLDS = (1, 4)
MODEL_DIR, OPTIM_DIR = "pytorch_model_fsdp_0", "optimizer_0"


def torchrun(nproc: int, *args: str | Path) -> None:
    run_torchrun(WRITER, nproc, *args)


@pytest.fixture(scope="module")
def accel_state(tmp_path_factory) -> tuple[Path, Path]:
    """(save_state directory, reference): written once by accelerate at 2 ranks."""
    root = tmp_path_factory.mktemp("accelerate")
    state, ref = root / "state", root / "reference.pt"
    torchrun(SOURCE_WORLD, "write", state, ref)
    return state, ref


@pytest.fixture(scope="module")
def converted(accel_state, tmp_path_factory) -> dict[tuple[str, int], tuple[int, str, str, Path]]:
    """(folder, world) -> (exit code, stdout, stderr, output) of `reshard convert FOLDER --to dp=<world>`."""
    state, _ = accel_state
    root = tmp_path_factory.mktemp("accelerate-out")
    out = {}
    for world in TARGET_WORLDS:
        for folder in (MODEL_DIR, OPTIM_DIR):
            dst = root / f"dp{world}" / folder
            dst.parent.mkdir(exist_ok=True)
            code, stdout, stderr = cli(["convert", state / folder, dst, "--to", f"dp={world}"])
            out[(folder, world)] = (code, stdout, stderr, dst)
    return out


def test_writer_made_accelerates_layout(accel_state):
    state, _ = accel_state
    names = sorted(p.name for p in state.iterdir())
    assert names == sorted([MODEL_DIR, OPTIM_DIR, "scheduler.bin", "random_states_0.pkl", "random_states_1.pkl"])
    for folder in (MODEL_DIR, OPTIM_DIR):
        assert (state / folder / ".metadata").is_file()


def test_inspect_model_folder(accel_state, capsys):
    state, _ = accel_state
    code, out, err = run_cli(["inspect", state / MODEL_DIR, "--json"], capsys)
    assert code == 0, (out, err)
    r = json.loads(out)
    assert {role: s["count"] for role, s in r["by_role"].items()} == {"parameter": 4}
    assert r["unknown_keys"] == []
    assert r["topology"]["dp_shard"] == SOURCE_WORLD and r["topology"]["world_size"] == SOURCE_WORLD
    assert r["sidecars"] == []


def test_inspect_optimizer_only_folder(accel_state, capsys):
    state, _ = accel_state
    code, out, err = run_cli(["inspect", state / OPTIM_DIR, "--json"], capsys)
    assert code == 0, (out, err)
    r = json.loads(out)
    # Same keys as Lightning Fabric's (formats/conventions/accelerate.toml): either name, the same roles.
    assert r["convention"]["name"] in ("hf-accelerate", "lightning")
    assert {role: s["count"] for role, s in r["by_role"].items()} == {
        "optimizer_moment": 8, "optimizer_step": 4, "param_group": 13}
    assert r["unknown_keys"] == []
    assert r["topology"]["dp_shard"] == SOURCE_WORLD and r["topology"]["world_size"] == SOURCE_WORLD
    assert r["step"] == 3
    assert r["sidecars"] == []


@pytest.mark.parametrize("folder", [MODEL_DIR, OPTIM_DIR])
@pytest.mark.parametrize("world", TARGET_WORLDS)
def test_plan_each_folder(accel_state, folder, world, capsys):
    state, _ = accel_state
    code, out, err = run_cli(["plan", state / folder, "--to", f"dp={world}", "--json"], capsys)
    assert code == 0, (out, err)
    assert json.loads(out)["feasible"]


@pytest.mark.parametrize("folder", [MODEL_DIR, OPTIM_DIR])
@pytest.mark.parametrize("world", TARGET_WORLDS)
def test_convert_each_folder(converted, folder, world, capsys):
    code, out, err, dst = converted[(folder, world)]
    assert code == 0, (out, err)
    code, out, err = run_cli(["inspect", dst, "--json"], capsys)
    assert code == 0, (out, err)
    assert json.loads(out)["topology"]["world_size"] == world


@pytest.mark.parametrize("world", TARGET_WORLDS)
def test_accelerate_loads_the_converted_folders_bitwise(accel_state, converted, world, tmp_path):
    _, ref = accel_state
    for folder in (MODEL_DIR, OPTIM_DIR):
        code, out, err, _ = converted[(folder, world)]
        assert code == 0, (folder, out, err)
    loaded = tmp_path / "loaded.pt"
    torchrun(world, "load", converted[(MODEL_DIR, world)][3], converted[(OPTIM_DIR, world)][3], loaded)
    assert_bitwise_equal(torch.load(ref, weights_only=False), torch.load(loaded, weights_only=False))


def test_accelerate_loads_its_own_folders_bitwise(accel_state, tmp_path):
    """The control: accelerate's loaders restore the source folders exactly at their own world size."""
    state, ref = accel_state
    loaded = tmp_path / "loaded.pt"
    torchrun(SOURCE_WORLD, "load", state / MODEL_DIR, state / OPTIM_DIR, loaded)
    assert_bitwise_equal(torch.load(ref, weights_only=False), torch.load(loaded, weights_only=False))
