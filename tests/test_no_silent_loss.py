"""Silent loss is impossible: every source key is accounted for, and a key nobody explains blocks.

A conversion's report lists each source key exactly once with what happened to it
(resharded, carried, rewritten, dropped: the last two with a reason); keys the target gains
are listed as added. A key no convention rule covers makes the conversion fail, naming the
key, before anything is committed.
"""
from __future__ import annotations

import io
import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import run_cli
from reshard.semantics.conventions import ROLES, classify
from reshard.storage.checkpoints.index import CheckpointIndex
from reshard.train import rng as train_rng

SOURCE_ACTIONS = {"resharded", "carried", "rewritten", "dropped"}


def _every_role_state() -> dict:
    w, b = torch.arange(24.0).reshape(6, 4), torch.arange(4.0)
    adam = lambda t: {"exp_avg": t * 0.1, "exp_avg_sq": t * t, "step": torch.tensor(7.0)}  # noqa: E731
    return {
        "model": {"w": w, "b": b},                                                   # parameter
        "optim": {"state": {"w": adam(w), "b": adam(b)},                             # optimizer_moment, optimizer_step
                  "param_groups": {"w": {"lr": 0.01, "betas": (0.9, 0.95), "weight_decay": 0.1}}},  # param_group
        "scheduler": {"last_epoch": 7, "_step_count": 8, "base_lrs": [0.01]},      # scheduler
        "scaler": {"scale": 65536.0, "growth_tracker": 3},                           # scaler
        "rng": {"rank_0": train_rng.capture()},                                      # rng (per rank)
        "data": {"sampler": {"cursor": 56, "seed": 0, "epoch": 0}},                  # data (global cursor)
        "trainer": {"step": 7, "tokens_seen": 448, "samples_seen": 56, "micro_step": 0},  # counter
        "config": {"lr": 0.01, "model": {"dim": 4, "name": "tiny"}},               # config (generic role)
        "extra": {"blob": io.BytesIO(b"user bytes"), "raw": b"\x00\x01"},          # blob (generic role)
    }


def _save(sd: dict, path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    return path


@pytest.fixture
def every_role_ckpt(tmp_path) -> Path:
    return _save(_every_role_state(), tmp_path / "src")


def test_checkpoint_covers_every_role(every_role_ckpt):
    """Enumerates ROLES: a role added to reshard.semantics.conventions must get a key here."""
    ix = CheckpointIndex.open(every_role_ckpt)
    cls = classify([(k, "tensor" if e.is_tensor else "object") for k, e in ix.entries.items()])
    assert cls.convention.name == "reshard"
    present = {r.role for r in cls.roles.values()}
    needed = set(ROLES) - {"unknown", "other"}
    assert needed <= present, f"roles without a key in this test's checkpoint: {sorted(needed - present)}"
    assert "unknown" not in present, cls.unknown


@pytest.mark.parametrize("to", ["dp=2", "dp=3"])
def test_report_accounts_for_every_source_key_once(every_role_ckpt, tmp_path, capsys, to):
    dst = tmp_path / f"dst-{to}"
    code, out, err = run_cli(["convert", every_role_ckpt, dst, "--to", to], capsys)
    assert code == 0, err
    report = json.loads((dst / "reshard-report.json").read_text())
    keys = report["plan"]["keys"]
    source = set(CheckpointIndex.open(every_role_ckpt).entries)
    listed = [k["key"] for k in keys if k["key"] in source]
    assert sorted(listed) == sorted(source), "every source key exactly once"
    roles_seen = set()
    for k in keys:
        if k["key"] in source:
            assert k["action"] in SOURCE_ACTIONS, k
            roles_seen.add(k["role"])
        else:
            assert k["action"] == "added", k  # only new keys may appear beyond the source's
        if k["action"] in ("dropped", "rewritten", "added"):
            assert isinstance(k.get("reason"), str) and k["reason"].strip(), k
    assert set(ROLES) - {"unknown", "other"} <= roles_seen
    # what the report says was kept is in the output; what it says was dropped is not
    out_keys = set(CheckpointIndex.open(dst).entries)
    for k in keys:
        if k["action"] == "dropped":
            assert k["key"] not in out_keys, k
        else:
            assert k["key"] in out_keys, k
    # the per-rank RNG of the new rank is there, and the one source rank was not silently copied
    assert {"rng.rank_1.torch"} <= out_keys


def test_unknown_key_blocks_the_conversion_and_nothing_is_committed(tmp_path, capsys):
    sd = _every_role_state()
    sd["mystery"] = {"ema_decay": torch.tensor([0.999, 0.9999])}
    src = _save(sd, tmp_path / "src")
    code, out, err = run_cli(["plan", src, "--to", "dp=2", "--json"], capsys)
    assert code == 1
    plan = json.loads(out)
    assert plan["feasible"] is False and any("mystery.ema_decay" in r for r in plan["reasons"])
    dst = tmp_path / "dst"
    code, out, err = run_cli(["convert", src, dst, "--to", "dp=2"], capsys)
    assert code == 1, (out, err)
    assert "mystery.ema_decay" in err and "Traceback" not in err
    assert err.strip().startswith("error:") and "\n\n" not in err.strip()
    assert not dst.exists()
    left = [p for p in tmp_path.rglob("*") if p.name in (".metadata", "manifest.json") and src not in p.parents]
    assert left == [], left
