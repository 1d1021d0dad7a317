"""`reshard plan` and the trainer-state decisions it is made of, on real checkpoints."""
from __future__ import annotations

import json
import pickle
import shutil

import torch
import torch.distributed.checkpoint as dcp

from conftest import run_cli
from reshard.storage.checkpoints.index import CheckpointIndex
from reshard.semantics.batch import Recipe, keep_global_batch
from reshard.model.tensor_values import as_torch
from reshard.semantics import rng as rng_state


# ---------------------------------------------------------------- batch arithmetic

def test_canonical_64_to_32_keeps_global_batch_by_doubling_accumulation():
    d = keep_global_batch(Recipe(micro_batch=8, grad_accum=4, dp=64), 32)
    assert d.before.global_batch == 2048
    assert (d.after.micro_batch, d.after.grad_accum, d.after.dp, d.after.global_batch) == (8, 8, 32, 2048)
    assert d.kept is True and d.feasible is True


def test_indivisible_global_batch_lists_nearest_choices():
    d = keep_global_batch(Recipe(2, 2, 4), 3)  # 16 on 3 ranks
    assert d.feasible is False and d.after is None
    assert {a["global_batch"] for a in d.alternatives} == {12, 18}
    assert "not a multiple" in d.note


def test_explicit_recipe_changing_global_batch_is_recorded():
    d = keep_global_batch(Recipe(2, 2, 4), 3, micro_batch=2, grad_accum=3)
    assert d.feasible and d.kept is False and d.after.global_batch == 18


def test_micro_batch_change_keeps_global_batch():
    d = keep_global_batch(Recipe(2, 2, 4), 2, micro_batch=4)
    assert (d.after.micro_batch, d.after.grad_accum) == (4, 2) and d.kept


# ---------------------------------------------------------------- RNG policy

def test_reseed_is_deterministic_and_distinct_per_rank():
    a = rng_state.seeded_state(rng_state.derived_seed(0, 10, 1))
    b = rng_state.seeded_state(rng_state.derived_seed(0, 10, 1))
    c = rng_state.seeded_state(rng_state.derived_seed(0, 10, 2))
    assert bytes(a["torch"].data()) == bytes(b["torch"].data()) and bytes(a["torch"].data()) != bytes(c["torch"].data())


def test_reseeded_state_restores_with_the_trainer_helper():
    from reshard.train import rng as train_rng

    st = as_torch(rng_state.seeded_state(1234))  # its tensors are made without torch (ArrayTensor)
    train_rng.restore(st)
    x = torch.rand(3)
    train_rng.restore(st)
    assert torch.equal(x, torch.rand(3))


# ---------------------------------------------------------------- plan on the reference checkpoint

def test_plan_reference_4_to_2(reference_ckpt, capsys):
    code, out, err = run_cli(["plan", reference_ckpt, "--to", "dp=2", "--json"], capsys)
    assert code == 0, err
    p = json.loads(out)
    assert p["feasible"] is True
    assert p["batch"]["kept"] is True
    assert p["batch"]["after"]["grad_accum"] == 2 * p["batch"]["before"]["grad_accum"]
    assert p["schedule"]["policy"] == "unchanged"
    assert p["data"]["policy"] == "carry" and p["data"]["kind"] == "global_cursor"
    assert p["data"]["repeated"] == 0 and p["data"]["skipped"] == 0
    assert p["rng"]["policy"] == "reseed" and set(p["rng"]["per_rank"]) == {"0", "1"}
    assert p["verdict"]["kind"] == "continuation_with_changes"
    # every source key exactly once, with an action
    keys = [k["key"] for k in p["keys"] if k["action"] != "added"]
    assert sorted(keys) == sorted(CheckpointIndex.open(reference_ckpt).entries)
    assert {k["action"] for k in p["keys"]} <= {"resharded", "carried", "rewritten", "dropped", "added"}
    dropped = [k for k in p["keys"] if k["action"] == "dropped"]
    assert dropped and all(k["key"].startswith(("rng.rank_2.", "rng.rank_3.")) and k["reason"] for k in dropped)
    # per-tensor placement: dim-0 torch.chunk pieces on ranks 0 and 1
    t = next(t for t in p["tensors"] if t["key"] == "model.tok_emb.weight")
    rows = t["shape"][0]
    assert t["placement"] == "FSDP Shard(0)"
    assert [(c["rank"], c["offsets"][0], c["sizes"][0]) for c in t["chunks"]] == [(0, 0, (rows + 1) // 2), (1, (rows + 1) // 2, rows // 2)]
    mem = p["memory"]
    assert len(mem["per_rank"]) == 2 and mem["max"] >= mem["min"] > 0
    assert all(r["optimizer"] > r["parameters"] > 0 for r in mem["per_rank"])


def test_plan_text_and_verbose_table(reference_ckpt, capsys):
    code, out, _ = run_cli(["plan", reference_ckpt, "--to", "dp=2", "--verbose"], capsys)
    assert code == 0
    assert "global batch kept" in out and "CONTINUATION WITH CHANGES" in out
    assert "model.tok_emb.weight" in out and "Shard(0)" in out


def test_plan_indivisible_is_infeasible_exit_1(reference_ckpt, capsys):
    # reference global batch: micro 2 x accum 2 x dp 4 = 16, not divisible by 3 x 2
    code, out, _ = run_cli(["plan", reference_ckpt, "--to", "dp=3", "--json"], capsys)
    p = json.loads(out)
    assert code == 1 and p["feasible"] is False
    assert p["batch"]["alternatives"] and any("batch recipe" in r for r in p["reasons"])
    # choosing a recipe that changes the global batch needs a schedule policy ...
    code, _, err = run_cli(["plan", reference_ckpt, "--to", "dp=3", "--micro-batch", "2", "--grad-accum", "3"], capsys)
    assert code == 2 and "--schedule" in err
    # ... and with one the plan says how the scheduler state is rewritten
    code, out, _ = run_cli(["plan", reference_ckpt, "--to", "dp=3", "--micro-batch", "2", "--grad-accum", "3",
                            "--schedule", "tokens", "--json"], capsys)
    p = json.loads(out)
    assert code == 0 and p["schedule"]["policy"] == "tokens"
    assert p["schedule"]["rewrites"]["scheduler.last_epoch"]["new"] == p["schedule"]["position_after"]
    assert p["verdict"]["kind"] == "continuation_with_changes"


def test_plan_tp_degree_must_divide_heads(reference_ckpt, capsys):
    """The reference model has 2 heads: tp=4 is refused with the nearest feasible degrees."""
    code, out, _ = run_cli(["plan", reference_ckpt, "--to", "dp=1,tp=4", "--json"], capsys)
    p = json.loads(out)
    assert code == 1 and p["rules"] == "reference-gpt"
    assert any("tp=4 does not divide n_heads = 2" in r and "nearest feasible tp: [2, 1]" in r for r in p["reasons"])
    code, out, _ = run_cli(["plan", reference_ckpt, "--to", "dp=2,tp=2", "--json"], capsys)
    p = json.loads(out)
    assert code == 0, p["reasons"]
    wo = next(t for t in p["tensors"] if t["key"] == "model.blocks.0.attn.wo.weight")
    assert wo["placement"] == "FSDP Shard(0) x TP Shard(1)"
    assert any("tensor parallel 1 -> 2" in c for c in p["verdict"]["changes"])


def test_plan_bad_spec_exit_2(reference_ckpt, capsys):
    code, _, err = run_cli(["plan", reference_ckpt, "--to", "dq=2"], capsys)
    assert code == 2 and "bad topology term" in err


def test_mid_accumulation_checkpoint_refused(reference_ckpt, copy_of, capsys):
    ck = copy_of(reference_ckpt)
    m = json.loads((ck / "manifest.json").read_text())
    m["accumulation"] = {"micro_step": 1, "in_flight_grads": False}
    (ck / "manifest.json").write_text(json.dumps(m))
    code, out, _ = run_cli(["plan", ck, "--to", "dp=2", "--json"], capsys)
    p = json.loads(out)
    assert code == 1 and p["feasible"] is False
    assert any("mid-accumulation" in r and "completed optimizer step" in r for r in p["reasons"])
    code, _, err = run_cli(["convert", ck, ck.parent / "out", "--to", "dp=2"], capsys)
    assert code == 1 and "mid-accumulation" in err
    assert not (ck.parent / "out").exists()


# ---------------------------------------------------------------- torchtitan per-rank data

def test_torchtitan_per_rank_data_refused_by_default(torchtitan_ckpt, tmp_path, capsys):
    code, _, err = run_cli(["convert", torchtitan_ckpt, tmp_path / "out", "--to", "dp=4"], capsys)
    assert code == 2
    assert "dataloader.dp_rank_0" in err and "--data-policy" in err
    for policy in ("translate", "restart-epoch", "drop"):
        assert policy in err
    assert not (tmp_path / "out").exists()


def test_torchtitan_translate_policy_converts_and_reports(torchtitan_ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, err = run_cli(["convert", torchtitan_ckpt, out, "--to", "dp=4", "--data-policy", "translate",
                                 "--micro-batch", "1", "--json"], capsys)
    assert code == 0, err
    r = json.loads(stdout)
    assert r["verification"]["equal"] is True
    data = r["plan"]["data"]
    assert data["policy"] == "translate" and data["form"] == "replicated-cursor"
    assert data["repeated"] == 0 and data["skipped"] == 0 and data["continuity"] is True
    ix = CheckpointIndex.open(out)
    states = {k: pickle.loads(ix.read_object(f"dataloader.dp_rank_{k}")) for k in range(4)}
    assert [s["dp_rank"] for s in states.values()] == [0, 1, 2, 3]
    assert all(s["world_size"] == 4 for s in states.values())
    assert len({json.dumps(s["sampler"], sort_keys=True) for s in states.values()}) == 1
    assert ix.read_object("dataloader.world_size") == 4
    # each new rank's state lives in that rank's own file
    assert {k: ix.entries[f"dataloader.dp_rank_{k}"].location.file for k in range(4)} == {
        k: f"__{k}_0.distcp" for k in range(4)}
    m = json.loads((out / "manifest.json").read_text())
    last = m["lineage"][-1]
    assert last["event"] == "transition" and last["policies"]["data"] == "translate"
    assert last["policies"]["verdict"] == r["plan"]["verdict"]["kind"]
    md = (out / "reshard-report.md").read_text()
    assert "dataloader.dp_rank_0" in md and "translate" in md


def test_torchtitan_drop_policy_is_a_warm_start(torchtitan_ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, err = run_cli(["convert", torchtitan_ckpt, out, "--to", "dp=4", "--data-policy", "drop",
                                 "--micro-batch", "1", "--json"], capsys)
    assert code == 0, err
    r = json.loads(stdout)
    assert r["plan"]["verdict"]["kind"] == "warm_start"
    m = json.loads((out / "manifest.json").read_text())
    assert m["continuity"] == "warm_start" and m["experiment_id"] != r["plan"]["source"]["experiment_id"]
    assert m["lineage"][-1]["kind"] == "warm_start" and "data continuity lost" in m["lineage"][-1]["reason"]
    ix = CheckpointIndex.open(out)
    assert not any(k.startswith("dataloader.") for k in ix.entries)
    dropped = [k for k in r["plan"]["keys"] if k["action"] == "dropped"]
    assert {k["key"] for k in dropped} == {"dataloader.dp_rank_0", "dataloader.dp_rank_1", "dataloader.world_size"}


def test_unknown_keys_block_conversion(tmp_path, capsys):
    ck = tmp_path / "ck"
    dcp.save({"model": {"w": torch.randn(4, 2)}, "mystery": 3}, checkpoint_id=str(ck), no_dist=True)
    code, out, _ = run_cli(["plan", ck, "--to", "dp=2", "--json"], capsys)
    p = json.loads(out)
    assert code == 1 and any("mystery" in r for r in p["reasons"])


def _reference_like(tmp_path, reference_ckpt, n_layers: int):
    """The reference model's keys for ``n_layers`` layers (global values, one process) with a manifest."""
    ix = CheckpointIndex.open(reference_ckpt)
    model = {}
    for k, e in ix.entries.items():
        if not k.startswith("model.") or not e.is_tensor:
            continue
        name = k[len("model."):]
        if name.startswith("blocks.0."):
            for layer in range(n_layers):
                model[name.replace("blocks.0.", f"blocks.{layer}.", 1)] = torch.zeros(e.shape, dtype=e.dtype.torch)
        elif not name.startswith("blocks."):
            model[name] = torch.zeros(e.shape, dtype=e.dtype.torch)
    ck = tmp_path / "ck"
    dcp.save({"model": model, "trainer": {"step": 3}}, checkpoint_id=str(ck), no_dist=True)
    m = json.loads((reference_ckpt / "manifest.json").read_text())
    m["model"]["config"]["n_layers"] = n_layers
    m["topology"] = {"dims": {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1}, "mesh_order": ["dp_shard"], "world_size": 1}
    m["batch"]["global_batch"] = m["batch"]["micro_batch"] * m["batch"]["grad_accum"]
    (ck / "manifest.json").write_text(json.dumps(m))
    return ck


def test_explicit_pipeline_stage_list(reference_ckpt, tmp_path, capsys):
    ck = _reference_like(tmp_path, reference_ckpt, 4)
    code, out, err = run_cli(["plan", ck, "--to", "pp=2", "--pp-stages", "0-0,1-3", "--json"], capsys)
    assert code == 0, err
    p = json.loads(out)
    sm = p["stage_map"]
    assert sm["split"] == "explicit" and [s["layers"] for s in sm["stages"]] == [[0, 1], [1, 4]]
    assert "tok_emb.weight" in sm["stages"][0]["holds"] and "lm_head.weight" in sm["stages"][1]["holds"]
    where = {t["key"]: t["chunks"][0]["rank"] for t in p["tensors"]}
    assert where["model.blocks.0.attn.wq.weight"] == 0 and where["model.blocks.3.attn.wq.weight"] == 1
    mem = {r["rank"]: r["parameters"] for r in p["memory"]["per_rank"]}
    assert mem[1] > mem[0]  # three layers and the head against one layer and the embeddings
    code, out, _ = run_cli(["plan", ck, "--to", "pp=2", "--json"], capsys)
    assert [s["layers"] for s in json.loads(out)["stage_map"]["stages"]] == [[0, 2], [2, 4]]
    code, _, err = run_cli(["plan", ck, "--to", "pp=2", "--pp-stages", "0-1,3-3"], capsys)
    assert code == 2 and "contiguously" in err


def test_convert_executes_exactly_the_reviewed_plan(reference_ckpt, tmp_path, capsys):
    code, out, _ = run_cli(["plan", reference_ckpt, "--to", "dp=2", "--json"], capsys)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(out)
    dst = tmp_path / "out"
    code, out, err = run_cli(["convert", reference_ckpt, dst, "--plan", plan_file, "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["plan"]["fingerprint"] == json.loads(plan_file.read_text())["fingerprint"]
    # a plan whose options no longer match what it says is refused
    doctored = json.loads(plan_file.read_text())
    doctored["options"]["rng_policy"] = "drop"
    plan_file.write_text(json.dumps(doctored))
    code, _, err = run_cli(["convert", reference_ckpt, tmp_path / "out2", "--plan", plan_file], capsys)
    assert code == 2 and "does not match" in err and not (tmp_path / "out2").exists()


def test_existing_destination_refused_then_replaced_whole_with_overwrite(reference_ckpt, tmp_path, capsys):
    """A non-empty DST is refused; --overwrite replaces a checkpoint there as a whole (none of its old
    files survive), but not while it holds a file no checkpoint has: that one is named, nothing is touched."""
    dst = tmp_path / "out"
    shutil.copytree(reference_ckpt, dst)  # a real 4-rank checkpoint stands at DST
    code, _, err = run_cli(["convert", reference_ckpt, dst, "--to", "dp=2"], capsys)
    assert code == 2 and "--overwrite" in err and (dst / "__3_0.distcp").exists()
    (dst / "notes.txt").write_text("mine")
    code, _, err = run_cli(["convert", reference_ckpt, dst, "--to", "dp=2", "--overwrite"], capsys)
    assert code == 2 and "notes.txt" in err and "move" in err, err
    assert (dst / "notes.txt").read_text() == "mine" and (dst / "__3_0.distcp").exists()
    (dst / "notes.txt").unlink()
    code, _, err = run_cli(["convert", reference_ckpt, dst, "--to", "dp=2", "--overwrite"], capsys)
    assert code == 0, err
    assert not (dst / "__3_0.distcp").exists() and not (dst / "__2_0.distcp").exists()  # the old files went with it
    assert (dst / ".metadata").exists() and (dst / "reshard-report.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.reshard-tmp")]


def test_plan_json_summarises_a_large_tensor_table_and_writes_the_full_one_on_request(reference_ckpt, tmp_path,
                                                                                      capsys, monkeypatch):
    """Past FULL_TABLE_ROWS chunk rows (a 16,384-rank plan has millions) --json gives one row per distinct
    shape and placement; --tensors-out writes every tensor, as JSON lines, equal to the full table."""
    from reshard.model import plan as plan_mod

    code, out, err = run_cli(["plan", reference_ckpt, "--to", "dp=2", "--json"], capsys)
    assert code == 0, err
    full = json.loads(out)["tensors"]
    monkeypatch.setattr(plan_mod, "FULL_TABLE_ROWS", 1)
    rows = tmp_path / "tensors.jsonl"
    code, out, err = run_cli(["plan", reference_ckpt, "--to", "dp=2", "--json", "--tensors-out", rows], capsys)
    assert code == 0, err
    p = json.loads(out)
    assert "tensors" not in p and p["tensors_omitted"]["tensors"] == len(full)
    assert sum(g["tensors"] for g in p["tensor_summary"]) == len(full)
    assert len(p["tensor_summary"]) < len(full)
    assert {(tuple(g["shape"]), g["placement"]) for g in p["tensor_summary"]} == \
        {(tuple(t["shape"]), t["placement"]) for t in full}
    assert [json.loads(line) for line in rows.read_text().splitlines()] == full
    assert p["tensors_file"] == {"path": str(rows), "tensors": len(full)}
