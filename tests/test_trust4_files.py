"""Issue 42, item 9: what a file claims is bounded by what it can hold, each test written as the attack.

- **Integers past int64 in torch's safetensors-backed DCP** (``HuggingFaceStorageWriter``): a real
  checkpoint written by torch (tests/writers/torch_hf_storage.py, FSDP2 on 2 gloo ranks), one
  header integer rewritten to 2**64 + 5 (or 10**30, or a sum just past 2**63) with the header's
  length field kept consistent. Every command that opens it (inspect, plan, convert, verify; import
  for the consolidated export) exits 2 with one paragraph naming the file and the tensor, where it
  used to reach the catch-all ("unexpected OverflowError", from the int64 chunk tables).
- **A Megatron save-plan list that claims a world its file does not hold**: a real Megatron-Core
  torch_dist checkpoint (tests/writers/megatron_run.py, tp 2 x dp 2 on 4 gloo ranks) whose
  `all_local_plans` repeats one empty plan by memo reference: 720,720 "ranks" in 3.6 MB, which was
  read as ``dp_replicate=360360`` after a search over the world's divisors (each an O(world)
  pass: 6.5 s here, 62 s in the issue). Now the plans are named as no evidence (720,720 claimed,
  5 distinct plans held) in one pass, and a large world of distinct plans (what torch would write)
  costs one pass and a report of bounded size.

The checkpoints are written once per run (`conftest.once_per_run`) and copied before a test
changes them. No timing is asserted.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

from conftest import cli, once_per_run, require_packages, writer_key

HF_WRITER = Path(__file__).parent / "writers" / "torch_hf_storage.py"
MEGATRON_WRITER = Path(__file__).parent / "writers" / "megatron_run.py"
SHARD_1 = "shard-00001-model-00001-of-00001.safetensors"
CONSOLIDATED = "model-00001-of-00001.safetensors"
BIG = 2**64 + 5
INT64_MAX = 2**63 - 1


# --------------------------------------------------------------------------- shared checkpoints

@pytest.fixture(scope="session")
def torch_hf_storage(tmp_path_factory) -> dict[str, Path]:
    """torch's own HuggingFaceStorageWriter output (the writer of tests/test_torch_hf_storage.py):
    ``sharded`` (per-rank shards with DCP_SHARDING_INFO) and ``consolidated`` (an export)."""
    pytest.importorskip("torch.distributed.fsdp")
    pytest.importorskip("safetensors")
    from rank_jobs import free_port, spawn

    def make(work: Path) -> dict[str, str]:
        job = {"kind": "write", "world": 2, "port": free_port(), "result": str(work / "reference.pt"),
               "sharded": str(work / "sharded"), "consolidated": str(work / "consolidated"),
               "with_optim": str(work / "with_optim")}
        spawn(HF_WRITER, "write", [job], work)
        return {"sharded": job["sharded"], "consolidated": job["consolidated"]}

    made = once_per_run(tmp_path_factory, writer_key(HF_WRITER, "torch"), make)
    return {k: Path(v) for k, v in made.items()}


@pytest.fixture(scope="session")
def megatron_source(tmp_path_factory) -> Path:
    """Megatron-Core's own torch_dist save at tp 2 x dp 2 on 4 gloo ranks (the writer and arguments
    of tests/test_interop_megatron.py): 4 save plans in `.metadata`, ranks 2 and 3 idle."""
    require_packages("megatron")

    def make(work: Path) -> str:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", SOURCE_DATE_EPOCH="1700000000")
        cmd = [sys.executable, str(MEGATRON_WRITER), "save", str(work / "ckpt"), str(work / "ref"), "--tp", "2",
               "--nproc", "4"]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        return str(work / "ckpt")

    return Path(once_per_run(tmp_path_factory, writer_key(MEGATRON_WRITER, "megatron-core"), make))


# --------------------------------------------------------------------------- helpers

def _rewrite_header(src: Path, dst: Path, fname: str, change: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` whose ``fname`` has its safetensors header changed by
    ``change``: the JSON re-serialised, padded to 8 bytes as safetensors pads, its 8-byte length field
    rewritten to match, the tensor bytes after it unchanged."""
    shutil.copytree(src, dst)
    path = dst / fname
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    change(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    return dst


def _sharding_info(change: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    """A header change that edits the DCP_SHARDING_INFO JSON string of ``__metadata__``."""
    def edit(header: dict[str, Any]) -> None:
        meta = header["__metadata__"]
        info = json.loads(meta["DCP_SHARDING_INFO"])
        change(info)
        meta["DCP_SHARDING_INFO"] = json.dumps(info)
    return edit


def _data_offsets_past_int64(h: dict[str, Any]) -> None:
    h["model.inp.bias"]["data_offsets"] = [BIG, BIG + 24]  # the span still 6 x F32: only the place is forged


def _empty_chunk_dim_past_int64(h: dict[str, Any]) -> None:
    # an empty chunk (no byte bounds its other dims), the bytes it held given to nobody: bias and weight
    # both empty, so no two tensors overlap and every other offset stays in the file
    h["model.inp.bias"].update(shape=[0], data_offsets=[0, 0])
    h["model.inp.weight"].update(shape=[0, BIG], data_offsets=[24, 24])


def _saved_offset_past_int64(info: dict[str, Any]) -> None:
    info["model.inp.weight"]["saved_offsets"] = [BIG, 0]


def _saved_offset_10_30(info: dict[str, Any]) -> None:
    info["model.out.weight"]["saved_offsets"] = [0, 10**30]


def _chunk_end_past_int64(info: dict[str, Any]) -> None:
    info["model.inp.weight"]["saved_offsets"] = [INT64_MAX - 2, 0]  # fits; + 6 rows does not


def _global_bytes_past_int64(info: dict[str, Any]) -> None:
    info["model.inp.weight"]["saved_offsets"] = [2**61, 0]  # 2**61 x 6 float32 > 2**63 bytes


HF_ATTACKS = {
    "data_offsets": (_data_offsets_past_int64, "model.inp.bias"),
    "empty-chunk-dim": (_empty_chunk_dim_past_int64, "model.inp.weight"),
    "saved_offsets-2**64+5": (_sharding_info(_saved_offset_past_int64), "model.inp.weight"),
    "saved_offsets-10**30": (_sharding_info(_saved_offset_10_30), "model.out.weight"),
    "offset+size": (_sharding_info(_chunk_end_past_int64), "model.inp.weight"),
    "global-bytes": (_sharding_info(_global_bytes_past_int64), "model.inp.weight"),
}


def _assert_named_refusal(code: int, err: str, file: Path, key: str, what: str) -> None:
    """Exit 2, one paragraph naming the file and the tensor, saying the value is past int64, with a hint."""
    assert code == 2, (what, err)
    assert "unexpected" not in err and "Traceback" not in err and "internal error" not in err, (what, err)
    assert str(file) in err and f"'{key}'" in err, (what, err)
    assert "int64" in err or "past what any file can hold" in err, (what, err)
    assert "No torch writer records such a value" in err, (what, err)


# --------------------------------------------------------------------------- HuggingFaceStorageWriter headers

@pytest.mark.parametrize("attack", list(HF_ATTACKS))
def test_hf_storage_header_integer_past_int64_is_bad_input(torch_hf_storage, tmp_path, attack):
    """One header integer of a real torch-written shard past 2**63 (its length field consistent):
    inspect, plan, convert and verify each exit 2 naming the shard and the tensor; convert writes nothing."""
    change, key = HF_ATTACKS[attack]
    bad = _rewrite_header(torch_hf_storage["sharded"], tmp_path / "bad", SHARD_1, change)
    out = tmp_path / "out"
    for args in (["inspect", bad], ["inspect", bad, "--json"], ["plan", bad, "--to", "dp=4"],
                 ["convert", bad, out, "--to", "dp=4"], ["verify", torch_hf_storage["sharded"], bad]):
        code, stdout, err = cli(args)
        if "--json" in args:  # the same paragraph, as the error object
            err = json.loads(stdout)["error"] if stdout.strip().startswith("{") else err
        _assert_named_refusal(code, err, bad / SHARD_1, key, f"{attack}: {args[0]}")
    assert not out.exists()


def test_hf_storage_consolidated_export_dim_past_int64_is_bad_input(torch_hf_storage, tmp_path):
    """torch's consolidated output (an export, read by `ExportIndex`) with an empty tensor whose other
    dimension is 2**64 + 5: inspect, import and verify exit 2 naming the file and the tensor."""
    def forge(h: dict[str, Any]) -> None:
        start = h["inp.bias"]["data_offsets"][0]
        h["inp.bias"].update(shape=[0, BIG], data_offsets=[start, start])

    bad = _rewrite_header(torch_hf_storage["consolidated"], tmp_path / "bad", CONSOLIDATED, forge)
    out = tmp_path / "imported"
    for args in (["inspect", bad], ["import", bad, out, "--to", "dp=2"],
                 ["verify", torch_hf_storage["consolidated"], bad]):
        code, _, err = cli(args)
        _assert_named_refusal(code, err, bad / CONSOLIDATED, "inp.bias", args[0])
    assert not out.exists()


# --------------------------------------------------------------------------- Megatron save plans

def _forge_plans(src: Path, dst: Path, world: int, *, shared: bool) -> Path:
    """A copy of Megatron checkpoint ``src`` whose `all_local_plans` is padded to ``world`` ranks with
    empty (idle) plans: one object repeated by memo reference (``shared``), or one per rank as a
    real save writes them. Stock pickle: the file was written by this module's own writer."""
    shutil.copytree(src, dst)
    with open(dst / ".metadata", "rb") as f:
        md = pickle.load(f)  # noqa: S301 - the checkpoint was written by the fixture's writer
    plan = type(md.all_local_plans[0])
    pad = world - len(md.all_local_plans)
    idle = [plan(items=[])] * pad if shared else [plan(items=[]) for _ in range(pad)]
    md.all_local_plans = md.all_local_plans + idle
    with open(dst / ".metadata", "wb") as f:
        pickle.dump(md, f)
    return dst


def test_megatron_plans_repeated_by_reference_are_no_world(megatron_source, tmp_path):
    """The issue's file: 720,720 plans in 3.6 MB, one empty plan repeated by reference. It was read as
    ``dp_replicate=360360`` (world 720,720, source "checkpoint"); a save pickles every rank's own plan,
    so the plans are named as no evidence, claimed world against the plans the file holds, and the
    chunks decide as for a checkpoint without plans (plan then asks for --from)."""
    forged = _forge_plans(megatron_source, tmp_path / "forged", 720_720, shared=True)
    assert (forged / ".metadata").stat().st_size < 4_000_000
    code, out, err = cli(["inspect", forged, "--json"])
    assert code == 0, err
    rep = json.loads(out)
    topo = rep["topology"]
    assert topo["source"] != "checkpoint" and topo["world_size"] != 720_720, topo
    unused = next(p for p in rep["problems"] if p["code"] == "save_plans_unused")
    assert unused["file"] == ".metadata", unused
    assert "claims 720720 ranks but holds 5 distinct save plan(s)" in unused["message"], unused
    assert "at most 5 ranks" in unused["message"], unused
    code, _, err = cli(["plan", forged, "--to", "tp=2"])
    assert code == 2 and "--from" in err and "unexpected" not in err and "Traceback" not in err, err


def test_megatron_large_world_of_distinct_plans_costs_one_pass(megatron_source, tmp_path):
    """Distinct idle plans, as a real save writes them, for 5,040 ranks (what a file of that size holds):
    the layout the plans record is taken (tp=2 x dp_replicate=2,520) in one pass over the ranks, and the
    evidence names the idle ranks as a run, not one by one, so the report does not grow with the world."""
    forged = _forge_plans(megatron_source, tmp_path / "wide", 5_040, shared=False)
    code, out, err = cli(["inspect", forged, "--json"])
    assert code == 0, err
    topo = json.loads(out)["topology"]
    assert (topo["tp"], topo["dp_replicate"], topo["world_size"], topo["source"]) == (2, 2520, 5040, "checkpoint"), topo
    evidence = " | ".join(topo["evidence"])
    assert "ranks 2-5039 (5038 ranks) planned none" in evidence, evidence
    assert len(out) < 20_000, len(out)
