"""Pipeline-parallel stages in the reference trainer, on real gloo processes.

Three spawns (process start-up dominates on a small CPU box):
  2 ranks: pp=2 dp=1 (dropout 0), saved at step 2, then resumed from it;
  1 rank:  pp=1 dp=1 (the same config: the loss curve must match), then a pp=1 resume of
           the pp=2 checkpoint (cross-pp load: per-parameter param groups, untied -> tied);
  4 ranks: pp=2 dp=2 (dropout on) saved + resumed exactly; pp=2 tp=2; pp=4 with 4 layers
           (middle stages that both receive and send).
"""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from reshard.semantics.manifest import read_manifest
from reshard.reference import TrainConfig, run_reference
from reshard.reference.model import stage_layers
from reshard.reference.pipeline import coords, global_rank


def read_log(path: Path) -> dict[int, dict]:
    return {rec["step"]: rec for rec in map(json.loads, path.read_text().splitlines())}


def metadata(ckpt: Path):
    return FileSystemReader(str(ckpt)).read_metadata()


def files_of(ckpt: Path) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for idx, info in metadata(ckpt).storage_data.items():
        out.setdefault(idx.fqn, set()).add(info.relative_path)
    return out


def load_tensors(ckpt: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    md = metadata(ckpt).state_dict_metadata
    sd = {}
    for k in keys:
        m = md[k]
        assert isinstance(m, TensorStorageMetadata), k
        sd[k] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(sd, checkpoint_id=str(ckpt), no_dist=True)
    return sd


def stage_of_fqn(fqn: str, n_layers: int, pp: int) -> int:
    m = re.match(r"blocks\.(\d+)\.", fqn)
    if m:
        i = int(m.group(1))
        return next(s for s, (lo, hi) in enumerate(stage_layers(n_layers, pp)) if lo <= i < hi)
    if fqn.startswith(("tok_emb.", "pos_emb.")):
        return 0
    assert fqn.startswith(("ln_f.", "lm_head.")), fqn
    return pp - 1


def fqn_of_key(key: str) -> str | None:
    """The parameter a model/optim key belongs to, or None for shared entries."""
    for prefix in ("model.", "optim.state.", "optim.param_groups."):
        if key.startswith(prefix):
            rest = key[len(prefix):]
            return rest if prefix == "model." else rest.rsplit(".", 1)[0]
    return None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp")
    # pp=2 x dp=1: full run to 4 (saved at 2), then resume from step 2 in the same processes
    pp2 = TrainConfig(pp=2, dp=1, steps=4, save_at=[2], dropout=0.0, out=str(root / "pp2"),
                      log=str(root / "pp2.jsonl"), experiment_id="exp-pp2")
    pp2_resume = TrainConfig(pp=2, dp=1, steps=4, dropout=0.0, resume=str(root / "pp2" / "step_2"),
                             log=str(root / "pp2_resume.jsonl"))
    run_reference([pp2, pp2_resume])
    # pp=1 x dp=1, same model/data/schedule; then a pp=1 resume of the pp=2 checkpoint
    pp1 = TrainConfig(pp=1, dp=1, steps=4, save_at=[2], dropout=0.0, out=str(root / "pp1"),
                      log=str(root / "pp1.jsonl"))
    pp1_from_pp2 = TrainConfig(pp=1, dp=1, steps=4, dropout=0.0, resume=str(root / "pp2" / "step_2"),
                               log=str(root / "pp1_from_pp2.jsonl"))
    run_reference([pp1, pp1_from_pp2])
    # 4 ranks: pp=2 x dp=2 with dropout (+ exact resume), pp=2 x tp=2, pp=4 (4 layers)
    dp2 = TrainConfig(pp=2, dp=2, steps=4, save_at=[2], out=str(root / "dp2"), log=str(root / "dp2.jsonl"))
    dp2_resume = TrainConfig(pp=2, dp=2, steps=4, resume=str(root / "dp2" / "step_2"),
                             log=str(root / "dp2_resume.jsonl"))
    tp2 = TrainConfig(pp=2, dp=1, tp=2, steps=2, save_at=[2], out=str(root / "tp2"), log=str(root / "tp2.jsonl"))
    pp4 = TrainConfig(pp=4, dp=1, n_layers=4, steps=2, save_at=[2], out=str(root / "pp4"),
                      log=str(root / "pp4.jsonl"))
    run_reference([dp2, dp2_resume, tp2, pp4])
    return root


def test_rank_order_is_row_major():
    pp, dp, tp = 2, 3, 2
    seen = []
    for s in range(pp):
        for d in range(dp):
            for t in range(tp):
                r = global_rank(s, d, t, dp, tp)
                assert (coords(r, dp, tp).stage, coords(r, dp, tp).dp_rank, coords(r, dp, tp).tp_rank) == (s, d, t)
                seen.append(r)
    assert seen == list(range(pp * dp * tp))


def test_config_validation():
    assert TrainConfig(pp=2, dp=2, tp=2).world_size == 8
    with pytest.raises(ValueError):
        TrainConfig(pp=3, n_layers=2).validate()
    with pytest.raises(ValueError):
        TrainConfig(pp=0).validate()
    from reshard.reference.__main__ import parse_args
    cfg, spawn = parse_args(["--spawn", "--pp", "2", "--dp", "1"])
    assert (cfg.pp, cfg.dp, cfg.world_size, spawn) == (2, 1, 2, True)


def test_pp2_matches_pp1_loss_curve(runs):
    pp1, pp2 = read_log(runs / "pp1.jsonl"), read_log(runs / "pp2.jsonl")
    assert sorted(pp1) == sorted(pp2) == [1, 2, 3, 4]
    for step in pp1:
        assert pp2[step]["loss"] == pytest.approx(pp1[step]["loss"], rel=1e-5)
        assert pp2[step]["grad_norm"] == pytest.approx(pp1[step]["grad_norm"], rel=1e-5)
        assert pp2[step]["lr"] == pp1[step]["lr"]
        assert pp2[step]["sample_ids"] == pp1[step]["sample_ids"]
        assert pp2[step]["world_size"] == 2


@pytest.mark.parametrize("name,pp,dp,tp,n_layers", [("pp2", 2, 1, 1, 2), ("dp2", 2, 2, 1, 2),
                                                    ("tp2", 2, 1, 2, 2), ("pp4", 4, 1, 1, 4)])
def test_pp_checkpoint_layout(runs, name, pp, dp, tp, n_layers):
    ckpt = runs / name / "step_2"
    keys = set(metadata(ckpt).state_dict_metadata)
    ref_keys = set(metadata(runs / "pp1" / "step_2").state_dict_metadata)
    model = {k for k in keys if k.startswith("model.")}
    if n_layers == 2:  # same model config as the pp=1 run: the same model keys, nothing more
        assert model == {k for k in ref_keys if k.startswith("model.")}
    else:
        assert {k for k in model if k.startswith("model.blocks.")} == {
            f"model.blocks.{i}.{rest}" for i in range(n_layers)
            for rest in ("ln1.weight", "ln1.bias", "attn.wq.weight", "attn.wq.bias", "attn.wk.weight",
                         "attn.wk.bias", "attn.wv.weight", "attn.wv.bias", "attn.wo.weight", "attn.wo.bias",
                         "ln2.weight", "ln2.bias", "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight",
                         "mlp.fc2.bias")}
    # per-parameter optimizer param groups (no stage-dependent "params" list), for every parameter
    assert not any(k.startswith("optim.param_groups.0.") for k in keys)
    for k in model:
        fqn = k[len("model."):]
        assert f"optim.param_groups.{fqn}.lr" in keys
        assert {f"optim.state.{fqn}.exp_avg", f"optim.state.{fqn}.exp_avg_sq", f"optim.state.{fqn}.step"} <= keys
    assert {"scheduler.last_epoch", "trainer.step", "data.sampler.cursor"} <= keys
    world = pp * dp * tp
    assert {f"rng.rank_{r}.torch" for r in range(world)} <= keys
    # each stage's keys live only in files written by that stage's ranks
    for key, files in files_of(ckpt).items():
        fqn = fqn_of_key(key)
        if fqn is None:
            continue
        s = stage_of_fqn(fqn, n_layers, pp)
        allowed = {f"__{r}_0.distcp" for r in range(s * dp * tp, (s + 1) * dp * tp)}
        assert files <= allowed, (key, files, s)
    m = read_manifest(ckpt)
    assert m.topology.dims["pp"] == pp and m.topology.dims["dp_shard"] == dp and m.topology.dims["tp"] == tp
    assert m.topology.world_size == world
    assert m.topology.mesh_order == ["pp", "dp_shard"] + (["tp"] if tp > 1 else [])
    assert m.model.tied == [["tok_emb.weight", "lm_head.weight"]]
    assert m.model.config["pp_stages"] == stage_layers(n_layers, pp)
    log = read_log(runs / f"{name}.jsonl")
    assert all(rec["world_size"] == world and rec["loss"] > 0 for rec in log.values())


@pytest.mark.parametrize("name", ["pp2", "dp2", "tp2", "pp4"])
def test_tied_copies_bitwise_equal(runs, name):
    names = ["exp_avg", "exp_avg_sq", "step"]
    sd = load_tensors(runs / name / "step_2",
                      ["model.tok_emb.weight", "model.lm_head.weight"]
                      + [f"optim.state.{p}.{n}" for p in ("tok_emb.weight", "lm_head.weight") for n in names])
    assert torch.equal(sd["model.tok_emb.weight"], sd["model.lm_head.weight"])
    for n in names:
        a, b = sd[f"optim.state.tok_emb.weight.{n}"], sd[f"optim.state.lm_head.weight.{n}"]
        assert torch.equal(a, b), n
    assert sd["optim.state.tok_emb.weight.exp_avg"].abs().sum() > 0
    assert float(sd["optim.state.tok_emb.weight.step"]) == 2.0


def test_pp1_checkpoint_unchanged(runs):
    keys = set(metadata(runs / "pp1" / "step_2").state_dict_metadata)
    assert "optim.param_groups.0.params" in keys and not any(k.startswith("optim.state.lm_head.") for k in keys)
    m = read_manifest(runs / "pp1" / "step_2")
    assert "pp_stages" not in m.model.config and m.topology.mesh_order == ["dp_shard"]


@pytest.mark.parametrize("full,resumed", [("pp2", "pp2_resume"), ("dp2", "dp2_resume")])
def test_resume_reproduces_uninterrupted_run_exactly(runs, full, resumed):
    a, b = read_log(runs / f"{full}.jsonl"), read_log(runs / f"{resumed}.jsonl")
    assert sorted(b) == [3, 4]
    for step in (3, 4):  # step 4 also depends on the restored optimizer state and LR
        for field in ("loss", "grad_norm", "lr", "sample_ids"):
            assert b[step][field] == a[step][field], (step, field)


def test_pp1_resume_of_a_pp2_checkpoint(runs):
    # another topology: per-parameter param groups load into the tied pp=1 model; dropout
    # is off so the trajectory is the same math, up to reduction order
    a, b = read_log(runs / "pp2.jsonl"), read_log(runs / "pp1_from_pp2.jsonl")
    assert sorted(b) == [3, 4]
    for step in (3, 4):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-5)
        assert b[step]["lr"] == a[step]["lr"]


def test_pp2_resume_of_a_pp1_checkpoint_is_refused(runs):
    import torch.multiprocessing as mp

    cfg = TrainConfig(pp=2, dp=1, steps=3, resume=str(runs / "pp1" / "step_2"))
    with pytest.raises(mp.ProcessRaisedException, match="nested optimizer param groups"):
        run_reference(cfg)
