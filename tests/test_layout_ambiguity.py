"""Issue 43 items 2 and 5: a source layout the chunks leave open is called ambiguous, with both readings and the
flag that settles it, the reading the evidence supports first; converted with that flag and loaded back by the
writer's own loader, strict and bitwise.

Item 2, FSDP2 column-wise: tests/writers/fsdp2_shard1.py, torch 2.13's own ``fully_shard(...,
shard_placement_fn=Shard(1))`` of a small conv + MLP net on 2 gloo ranks, two Adam steps,
``get_state_dict`` + ``dcp.save``. Every parameter is cut along one dim (matrices dim 1, vectors
dim 0) into ``torch.chunk``'s pieces, which tensor parallelism could also have written: inspect
says AMBIGUOUS, dp_shard=2 first (FSDP2 cuts every parameter, TP only those its plan names), and
names ``--from dp_shard=2``; converted with it to dp=1 and dp=4 and loaded by ``dcp.load`` +
strict ``set_state_dict`` into the FSDP2 (Shard(1)) model at 1 and 4 ranks, bitwise.

Item 5, Megatron without its save plans: tests/writers/megatron_run.py ``--model-only`` (Megatron-Core
0.16.1's ``dist_checkpointing.save`` of the model's ShardedTensors, tp 2 x dp 2 on 4 gloo ranks), its
``.metadata`` rewritten by stock pickle without ``all_local_plans`` (what an older Megatron writes).
The Megatron key names alone now name the convention (``megatron-core``, not ``plain-state-dict``) and
the DP replicas (not stored) make the layout ambiguous; ``--from dp_replicate=2,tp=2`` plans and
converts to tp=2 (dp 1), which Megatron's own ``dist_checkpointing.load`` restores at world size 2
bitwise against what each rank held when it saved.

Measured cost: about 45-55 s on the 2-core machine (Megatron's save and load are most of it).
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import assert_bitwise_equal, cli, once_per_run, require_packages, writer_key  # noqa: E402
from rank_jobs import free_port, result, spawn  # noqa: E402

WRITERS = Path(__file__).parent / "writers"
SHARD1 = WRITERS / "fsdp2_shard1.py"
MEGATRON = WRITERS / "megatron_run.py"


def _json(args: list) -> tuple[int, dict, str]:
    code, out, err = cli([*args, "--json"])
    return code, (json.loads(out) if out.strip().startswith("{") else {}), err


# --------------------------------------------------------------------------- item 2: FSDP2 Shard(1)

@pytest.fixture(scope="module")
def shard1(tmp_path_factory) -> dict:
    """The Shard(1) checkpoint and the full state rank 0 gathered when it was saved."""

    def make(work: Path) -> dict:
        job = {"dir": str(work / "ckpt"), "world": 2, "port": free_port(), "result": str(work / "ref.pt")}
        spawn(SHARD1, "write", [job], work, python_flags=("-W", "ignore"))
        return {"dir": job["dir"], "ref": job["result"]}

    made = once_per_run(tmp_path_factory, writer_key(SHARD1, "torch"), make)
    return {"dir": Path(made["dir"]), "ref": result(made["ref"])}


@pytest.fixture(scope="module")
def shard1_converted(shard1, tmp_path_factory) -> dict:
    """``convert --from dp_shard=2 --to dp=N`` for N = 1, 4, then one load of both outputs by FSDP2 (Shard(1))."""
    root = tmp_path_factory.mktemp("shard1-out")
    runs, jobs = {}, []
    for dp in (1, 4):
        dst = root / f"dp{dp}"
        runs[dp] = cli(["convert", shard1["dir"], dst, "--from", "dp_shard=2", "--to", f"dp={dp}", "--quiet"])
        if runs[dp][0] == 0:
            jobs.append({"dir": str(dst), "world": dp, "port": free_port(), "result": str(root / f"dp{dp}.pt")})
    if jobs:
        spawn(SHARD1, "load", jobs, root, python_flags=("-W", "ignore"))
    return {dp: {"run": runs[dp], "dst": root / f"dp{dp}",
                 "loaded": result(root / f"dp{dp}.pt") if runs[dp][0] == 0 else None} for dp in (1, 4)}


def test_shard1_inspect_is_ambiguous_fsdp_first(shard1):
    """Not "complete and consistent, tp=2": AMBIGUOUS between dp_shard=2 (first: every parameter cut by
    torch.chunk along one dim, dim 1 for the matrices) and tp=2, and the warning names --from dp_shard=2."""
    code, rep, err = _json(["inspect", shard1["dir"]])
    assert code == 0, err
    topo = rep["topology"]
    assert topo["ambiguous"] and topo["alternatives"] == ["dp_shard=2", "tp=2"], topo
    assert (topo["dp_shard"], topo["tp"], topo["source"]) == (2, 1, "inferred"), topo
    why = " | ".join(topo["evidence"])
    assert "along dim 1" in why and "shard_placement_fn" in why and "model.conv.weight" in why, why
    warning = next(p for p in rep["problems"] if p["code"] == "topology_ambiguous")
    assert "--from dp_shard=2" in warning["message"], warning


def test_shard1_plan_without_from_asks_for_it(shard1):
    """plan refuses a guess (exit 2), naming both readings and --from dp_shard=2, not --rules."""
    code, out, err = cli(["plan", shard1["dir"], "--to", "dp=1"])
    assert code == 2, out
    assert "ambiguous" in err and "dp_shard=2, tp=2" in err and "--from dp_shard=2" in err, err
    assert "--rules" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("dp", [1, 4])
def test_shard1_converted_loads_in_fsdp2_bitwise(dp, shard1, shard1_converted):
    """``--from dp_shard=2``: convert exits 0, ``verify`` finds the output equal to the source, and FSDP2's
    ``dcp.load`` + strict ``set_state_dict`` at ``dp`` ranks holds every parameter and Adam moment bitwise."""
    c = shard1_converted[dp]
    code, out, err = c["run"]
    assert code == 0, err or out
    code, out, err = cli(["verify", shard1["dir"], c["dst"]])
    assert code == 0, err or out
    assert_bitwise_equal(shard1["ref"]["model"], c["loaded"]["model"], "model")
    assert_bitwise_equal(shard1["ref"]["optim"], c["loaded"]["optim"], "optim")
    assert shard1["ref"]["optim"]["state"], "the source holds Adam moments"


# --------------------------------------------------------------------------- item 5: Megatron without plans

def _megatron(mode: str, ckpt: Path, ref: Path, nproc: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", SOURCE_DATE_EPOCH="1700000000")
    cmd = [sys.executable, str(MEGATRON), mode, str(ckpt), str(ref), "--tp", "2", "--nproc", str(nproc), "--model-only"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def megatron_noplans(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint without all_local_plans, reference) of Megatron's weights-only save at tp 2 x dp 2."""
    require_packages("megatron")

    def make(work: Path) -> dict:
        r = _megatron("save", work / "ckpt", work / "ref", 4)
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        shutil.copytree(work / "ckpt", work / "noplans")
        with open(work / "noplans" / ".metadata", "rb") as f:
            md = pickle.load(f)  # noqa: S301 - written by Megatron just above
        assert md.all_local_plans, "Megatron wrote its save plans"
        del md.all_local_plans  # torch's Metadata without the field, as an older or stripped .metadata
        with open(work / "noplans" / ".metadata", "wb") as f:
            pickle.dump(md, f)
        return {"ckpt": str(work / "noplans"), "ref": str(work / "ref")}

    made = once_per_run(tmp_path_factory, writer_key(MEGATRON, "megatron-core") + "-model-only-noplans", make)
    return Path(made["ckpt"]), Path(made["ref"])


def test_megatron_without_plans_is_ambiguous_megatron_core(megatron_noplans):
    """The Megatron key names alone: convention megatron-core (not plain-state-dict), the replicas unseen, so the
    layout is ambiguous (tp=2 or dp_replicate=N,tp=2) and --from is asked for, not a confident dp_shard reading."""
    code, rep, err = _json(["inspect", megatron_noplans[0]])
    assert code == 0, err
    assert rep["convention"]["name"] == "megatron-core", rep["convention"]
    assert rep["unknown_keys"] == []
    topo = rep["topology"]
    assert topo["ambiguous"] and topo["alternatives"] == ["tp=2", "dp_replicate=N,tp=2"], topo
    assert topo["dp_shard"] == 1 and topo["tp"] == 2, topo
    assert any("replicas leave no trace" in e for e in topo["evidence"]), topo["evidence"]
    assert any(p["code"] == "topology_ambiguous" and "--from" in p["message"] for p in rep["problems"]), rep["problems"]
    code, _, err = cli(["plan", megatron_noplans[0], "--to", "tp=2"])
    assert code == 2 and "ambiguous" in err and "--from" in err, err


@pytest.fixture(scope="module")
def megatron_converted(megatron_noplans, tmp_path_factory) -> tuple[Path, tuple[int, str, str]]:
    out = tmp_path_factory.mktemp("megatron-noplans") / "tp2"
    return out, cli(["convert", megatron_noplans[0], out, "--from", "dp_replicate=2,tp=2", "--to", "tp=2", "--quiet"])


def test_megatron_without_plans_plans_with_from(megatron_noplans):
    """``--from dp_replicate=2,tp=2``: the megatron-gpt rules cover every parameter (linear_qkv.layer_norm_weight
    and the rest), the plan is feasible, nothing dropped."""
    code, plan, err = _json(["plan", megatron_noplans[0], "--from", "dp_replicate=2,tp=2", "--to", "tp=2"])
    assert code == 0, err
    assert plan["feasible"], plan["reasons"]
    actions = {k["key"]: k["action"] for k in plan["keys"]}
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in actions
    assert not [k for k, a in actions.items() if a.startswith("drop")], actions
    assert plan["target"]["world_size"] == 2


def test_megatron_without_plans_converted_loads_bitwise(megatron_noplans, megatron_converted):
    """Megatron's own ``dist_checkpointing.load`` at world size 2 (tp 2, dp 1): every tensor bitwise equal."""
    out, (code, stdout, err) = megatron_converted
    assert code == 0, err or stdout
    code, o, e = cli(["verify", megatron_noplans[0], out])
    assert code == 0, e or o
    r = _megatron("load", out, megatron_noplans[1], 2)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert r.stdout.count("bitwise equal") == 2, r.stdout
