"""Issue 31, the inspect/plan judgement items: facts are not evidence against a checkpoint, and what the
user states is checked against the bytes.

Five sources are written once per module by tests/writers/open_world3.py, in one fork of gloo ranks
running FSDP2 ``fully_shard`` and the real ``torch.distributed.checkpoint.save`` (and, for the
Hugging Face folder, transformers' own ``save_pretrained``):

| source | what is saved | ranks | judged |
|---|---|---|---|
| ``muon`` | ``get_state_dict(model, [muon, adamw])``: Muon for the 2 matrices, AdamW for the 4 vectors | 2 | consistent, moment sets per parameter group; converted to dp=4 and loaded back bitwise |
| ``counters`` | ``get_state_dict`` model + Adam after 2 steps, beside the user's ``{"step": 7, "epoch": 1}`` | 2 | consistent, a note naming 7 and 2; the wrong ``--from dp=3`` (flag, profile, trainer config) refused naming both |
| ``bare`` | ``dcp.save(model.state_dict())``, no optimizer | 4 | convention ``plain-state-dict``, dp_shard=4 without ``--from``; converted to dp=2, loaded back strictly, bitwise |
| ``bare_small`` | the same, every tensor smaller than 4 rows (no tensor shows 4 pieces) | 4 | dp_shard=4 from the 4 writer ranks' files; converted to dp=2, loaded back strictly, bitwise |
| ``hf`` | ``LlamaForCausalLM.save_pretrained`` (``config.json`` + ``model.safetensors``) | 1 | named a Hugging Face model folder, ``reshard import`` the way out (exit 2); the import it names works |

Loaded back by the same script at the new world size (``dcp.load`` + ``set_state_dict``; the bare
state dicts ``dcp.load`` into ``model.state_dict()`` and ``load_state_dict(strict=True)``), and the full
state the live objects then hold compared bit for bit with the full state rank 0 gathered at write time
(torch's ``get_state_dict(full_state_dict=True)``). The real inconsistencies that must stay
(a missing moment within a group, a convention's own counter against the optimizer) are shown on
checkpoints ``dcp.save`` writes in this process.

CPU substitutions: gloo on CPU instead of NCCL, a ``"cpu"`` device mesh; DCP writes the same files
whatever the device. The ranks are forked from one parent that has imported torch (start-up only).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.fsdp")

from rank_jobs import free_port, result, spawn  # noqa: E402
from conftest import assert_bitwise_equal, cli, require_packages  # noqa: E402

require_packages("transformers")

import torch.distributed.checkpoint as dcp  # noqa: E402

WRITER = Path(__file__).parent / "writers" / "open_world3.py"
SOURCES = {"muon": 2, "counters": 2, "bare": 4, "bare_small": 4, "hf": 1}
CONVERTED = {"muon": 4, "bare": 2, "bare_small": 2}  # source -> the dp it is converted to and loaded at
RECIPE = ["--source-micro-batch", "8", "--source-grad-accum", "4"]  # the counters run: 8 x 4 x dp 2 = 64


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, Any]:
    """Every source and the reference full state saved with it."""
    root = tmp_path_factory.mktemp("open_world3")
    jobs = [{"variant": v, "dir": str(root / v), "world": w, "port": free_port(), "result": str(root / f"{v}.ref.pt")}
            for v, w in SOURCES.items()]
    spawn(WRITER, "write", jobs, root)
    out: dict[str, Any] = {"root": root}
    out.update({j["variant"]: {"dir": Path(j["dir"]), "reference": result(j["result"])} for j in jobs})
    return out


@pytest.fixture(scope="module")
def converted(written) -> dict[str, dict[str, Any]]:
    """``reshard convert`` of the muon and bare sources (no ``--from``), then one load of every output."""
    root: Path = written["root"]
    out: dict[str, dict[str, Any]] = {}
    jobs = []
    for v, dp in CONVERTED.items():
        dst = root / f"out_{v}"
        code, stdout, err = cli(["convert", written[v]["dir"], dst, "--to", f"dp={dp}", "--quiet"])
        out[v] = {"dst": dst, "code": code, "stdout": stdout, "stderr": err, "loaded": None}
        if code == 0:
            jobs.append({"variant": v, "dir": str(dst), "world": dp, "port": free_port(),
                         "result": str(root / f"{v}.loaded.pt")})
    if jobs:
        spawn(WRITER, "load", jobs, root)
        for j in jobs:
            out[j["variant"]]["loaded"] = result(j["result"])
    return out


def _inspect(path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    code, out, err = cli(["inspect", path, "--json", *extra])
    assert "Traceback" not in err, err
    return code, json.loads(out)


def _assert_loaded_bitwise(variant: str, written, converted) -> None:
    c = converted[variant]
    assert c["code"] == 0, c["stdout"] + c["stderr"]
    assert c["loaded"] is not None
    assert_bitwise_equal(c["loaded"], written[variant]["reference"], variant)


# ------------------------------------------------------------------------ item 1: mixed optimizers

def test_muon_adamw_moments_judged_per_parameter_group(written):
    """Muon's momentum_buffer and AdamW's exp_avg/exp_avg_sq are each complete for their own group: exit 0."""
    code, r = _inspect(written["muon"]["dir"])
    assert code == 0 and r["consistent"], r["problems"]
    opt = r["optimizer"]
    assert opt["missing_moments"] == [] and opt["with_moments"] == opt["parameters"] == 6
    assert opt["moment_sets"] == [{"moments": ["momentum_buffer"], "parameters": 2, "groups": ["0"]},
                                  {"moments": ["exp_avg", "exp_avg_sq"], "parameters": 4, "groups": ["1"]}]
    assert opt["step_counters"] == {"count": 4, "values": [2], "consistent": True}  # AdamW's; Muon keeps none
    assert any(n["code"] == "moment_sets" for n in r["notes"])
    code, text, _ = cli(["inspect", written["muon"]["dir"]])
    assert code == 0 and "momentum_buffer for 2 parameters (group 0); exp_avg, exp_avg_sq for 4 (group 1)" in text


def test_muon_adamw_converts_and_loads_bitwise(written, converted):
    """dp 2 -> 4; torch's ``dcp.load`` + ``set_state_dict(model, [muon, adamw])`` at 4 ranks holds every value."""
    _assert_loaded_bitwise("muon", written, converted)
    code, r = _inspect(converted["muon"]["dst"])
    assert code == 0 and r["topology"]["dp_shard"] == 4 and len(r["optimizer"]["moment_sets"]) == 2, r["problems"]


def test_a_moment_missing_within_its_group_stays_inconsistent(written, tmp_path):
    """The muon run's own full state, one AdamW parameter's exp_avg_sq left out, saved by dcp.save: exit 1 naming it."""
    ref = written["muon"]["reference"]
    state = {k: dict(v) for k, v in ref["optim"]["state"].items()}
    del state["0.bias"]["exp_avg_sq"]
    dcp.save({"model": ref["model"], "optim": {"state": state, "param_groups": ref["optim"]["param_groups"]}},
             checkpoint_id=str(tmp_path / "gap"), no_dist=True)
    code, r = _inspect(tmp_path / "gap")
    assert code == 1 and r["optimizer"]["missing_moments"] == ["0.bias (exp_avg_sq)"], r["optimizer"]
    problem = next(p for p in r["problems"] if p["code"] == "missing_moments")
    assert "parameter group" in problem["message"]


# ------------------------------------------------------------------------ item 2: the user's own counters

def test_user_counters_are_facts_not_evidence(written):
    """``step = 7`` beside an optimizer that took 2 steps: exit 0, the global step 2, a note naming both."""
    code, r = _inspect(written["counters"]["dir"])
    assert code == 0 and r["consistent"], r["problems"]
    assert (r["step"], r["step_source"]) == (2, "optimizer") and r["counters"] == {"step": 7, "epoch": 1}
    note = next(n for n in r["notes"] if n["code"] == "user_counter")
    assert "says 7" in note["message"] and "say 2" in note["message"] and note["keys"] == ["step"]
    code, text, _ = cli(["inspect", written["counters"]["dir"]])
    assert code == 0 and "complete and consistent" in text and "counter 'step' says 7" in text


def test_user_counters_carried_and_the_output_consistent(written, tmp_path):
    """Converted to dp=1, the manifest records the optimizer's step 2 and the counter 7 stays a fact (exit 0)."""
    dst = tmp_path / "dp1"
    code, out, err = cli(["convert", written["counters"]["dir"], dst, "--to", "dp=1", "--quiet", *RECIPE])
    assert code == 0, out + err
    assert json.loads((dst / "manifest.json").read_text())["step"] == 2
    code, r = _inspect(dst)
    assert code == 0 and r["counters"]["step"] == 7 and r["step"] == 2, r["problems"]
    assert any(n["code"] == "user_counter" and "manifest says 2" in n["message"] for n in r["notes"])


def test_a_conventions_own_counter_still_disagrees(written, tmp_path):
    """The reshard convention owns ``trainer.step``: 7 against the optimizer's 2 stays inconsistent (exit 1)."""
    ref = written["counters"]["reference"]
    dcp.save({"model": ref["model"], "optim": ref["optim"], "trainer": {"step": 7}},
             checkpoint_id=str(tmp_path / "own"), no_dist=True)
    code, r = _inspect(tmp_path / "own")
    assert r["convention"]["name"] == "reshard"
    assert code == 1 and [p["code"] for p in r["problems"]] == ["step_mismatch"], r["problems"]


# ------------------------------------------------------------------------ item 3: a bare FSDP2 state dict

@pytest.mark.parametrize("variant", ["bare", "bare_small"])
def test_bare_fsdp2_state_dict_layout_from_its_files(variant, written, converted):
    """No optimizer, no prefix: named a plain state dict, dp_shard=4 without --from, converted, loaded strictly bitwise."""
    code, r = _inspect(written[variant]["dir"])
    assert code == 0 and r["convention"]["name"] == "plain-state-dict", r["convention"]
    t = r["topology"]
    assert (t["dp_shard"], t["world_size"], t["source"]) == (4, 4, "inferred") and not t.get("ambiguous"), t
    assert r["unknown_keys"] == [] and r["by_role"]["parameter"]["count"] == len(written[variant]["reference"]["model"])
    if variant == "bare_small":  # no tensor shows 4 pieces: the 4 writer ranks' files say the world
        assert r["topology"]["evidence"] and any("torch.chunk's for 4 shards" in e for e in t["evidence"]), t
    _assert_loaded_bitwise(variant, written, converted)


# ------------------------------------------------------------------------ item 4: a Hugging Face model folder

def test_hf_model_folder_is_named_and_import_is_the_way(written, tmp_path):
    src = written["hf"]["dir"]
    assert (src / "config.json").exists() and (src / "model.safetensors").exists()
    for args in (["inspect", src], ["plan", src, "--to", "dp=2"], ["convert", src, tmp_path / "never", "--to", "dp=2"]):
        code, out, err = cli(args)
        said = out + err
        assert code == 2 and "Traceback" not in said, said
        assert "Hugging Face model folder (LlamaForCausalLM" in said and "not a DCP checkpoint" in said, said
        assert f"reshard import {src} DST --to SPEC --format torchtitan" in said, said
    assert not (tmp_path / "never").exists()
    # the way out it names: a DCP checkpoint that inspect reads, every weight the folder holds
    code, out, err = cli(["import", src, tmp_path / "imported", "--to", "dp=1", "--format", "torchtitan", "--quiet"])
    assert code == 0, out + err
    code, r = _inspect(tmp_path / "imported")
    assert code == 0 and r["by_role"]["parameter"]["count"] == len(written["hf"]["reference"]["model"]), r["by_role"]


# ------------------------------------------------------------------------ item 5: a stated layout is checked

def test_wrong_from_is_refused_naming_both(written, tmp_path):
    """2 ranks, every tensor in 2 dim-0 pieces: ``--from dp=3`` is exit 2 for inspect and plan, naming both."""
    src = written["counters"]["dir"]
    code, out, err = cli(["inspect", src, "--from", "dp=3"])
    assert code == 2 and "Traceback" not in err
    assert "--from dp=3 (command line)" in err and "dp_shard=3 (world size 3)" in err, err
    assert "dp_shard=2 (world size 2)" in err and "rows 0, 6" in err, err
    code, out, err = cli(["plan", src, "--from", "dp=3", "--to", "dp=1", *RECIPE])
    assert code == 2 and "96" not in out + err and "dp_shard=2 (world size 2)" in err, out + err
    # the bytes' own layout plans the run that was: 8 x 4 x 2 = 64, accumulation 8 at dp=1
    code, out, err = cli(["plan", src, "--to", "dp=1", "--json", *RECIPE])
    b = json.loads(out)["batch"]
    assert code == 0 and b["before"]["global_batch"] == 64 and b["after"]["grad_accum"] == 8, out + err
    # the same layout stated is accepted; a world of replicas the chunks cannot show is the user's word
    code, r = _inspect(src, "--from", "dp=2")
    assert code == 0 and r["topology"]["source"] == "given"
    # a profile's `from` and a trainer config's degrees are checked the same way, each named
    prof = tmp_path / "reshard.toml"
    prof.write_text('from = "dp=3"\n')
    code, out, err = cli(["plan", src, "--to", "dp=1", "--profile", prof, *RECIPE])
    assert code == 2 and f'from = "dp=3" in the profile {prof}' in err and "dp_shard=2" in err, err
    job = tmp_path / "job.toml"
    job.write_text('[model]\nname = "llama3"\nflavor = "debugmodel"\n[training]\nlocal_batch_size = 8\n'
                   'global_batch_size = 48\nseq_len = 16\n[parallelism]\ndata_parallel_shard_degree = 3\n')
    code, out, err = cli(["plan", src, "--to", "dp=1", "--trainer-config", job, "--no-profile"])
    assert code == 2 and f"trainer config {job} (dp_shard=3)" in err and "dp_shard=2" in err, err
