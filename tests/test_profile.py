"""A profile says once what a trainer's checkpoints mean (issue 16): `reshard.toml` in the
working directory or beside the checkpoint, or `--profile FILE`.

Each test writes real DCP checkpoints (`dcp.save`, and the session's plain FSDP2 fixture) and
runs the real CLI. What a profile contributes must reach the plan options (with its sha256),
the report, the output manifest's lineage, `verify` (which recomputes the plan from the
lineage, without the profile), and a second conversion of the output; the command line wins.
"""
from __future__ import annotations

import hashlib
import shutil
import json
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from conftest import run_cli
from reshard.storage.checkpoints.index import CheckpointIndex
from test_no_silent_loss import _every_role_state

PROFILE = """\
# what my trainer's checkpoints mean
name = "my-run"
tie = [["emb.weight", "head.weight"]]

[recipe]
micro_batch = 8
grad_accum = 4

[[keep]]
pattern = '^ema\\.'
reason = "EMA copy of the weights, carried unchanged"

[[drop]]
pattern = '^scratch\\.'
reason = "debug notes, rebuilt at start"

[convention]
name = "my-run-keys"
[[convention.rule]]
match = '^mystery\\.(?P<name>.+)$'
role = "config"
"""


def _tied_state(*, equal: bool = True) -> dict:
    """A model whose head is tied to its embedding: saved twice, optimizer state for one name only."""
    sd = _every_role_state()
    emb = torch.arange(12.0).reshape(3, 4)
    sd["model"].update({"emb": {"weight": emb}, "head": {"weight": emb.clone() if equal else emb + 1}})
    sd["optim"]["state"]["emb"] = {"weight": {"exp_avg": emb * 0.1, "exp_avg_sq": emb * emb, "step": torch.tensor(7.0)}}
    return sd


def _save(sd: dict, path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    return path


def _source(root: Path, **extra: object) -> Path:
    sd = _tied_state()
    sd["ema"] = {"w": torch.full((6, 4), 0.5)}
    sd["scratch"] = {"note": "delete me"}
    sd["mystery"] = {"decay": 0.999}
    sd.update(extra)
    return _save(sd, root / "step-7")


def _json(args: list, capsys) -> tuple[int, dict, str]:
    code, out, err = run_cli([*args, "--json"], capsys)
    return code, (json.loads(out) if out.strip() else {}), err


def _key(keys: list, key: str) -> dict:
    return next(k for k in keys if k["key"] == key)


def test_profile_beside_the_checkpoint_through_plan_convert_verify_and_a_second_conversion(tmp_path, capsys):
    src = _source(tmp_path)
    prof = tmp_path / "reshard.toml"  # beside step-7: one profile for every step folder of the run
    prof.write_text(PROFILE)
    sha = hashlib.sha256(prof.read_bytes()).hexdigest()

    # without it, the keys are unknown and the tie is not known: the plan is infeasible
    code, p, err = _json(["plan", src, "--to", "dp=2", "--no-profile"], capsys)
    assert code == 1 and any("mystery.decay" in r for r in p["reasons"]), (p.get("reasons"), err)

    code, r, err = _json(["inspect", src], capsys)
    assert code == 0, (r.get("problems"), err)
    assert r["profile"]["file"] == str(prof.resolve()) and r["profile"]["sha256"] == sha
    assert {"ties", "conventions"} <= set(r["profile"]["contributed"])
    tie = next(t for t in r["optimizer"]["tied"] if t["names"] == ["emb.weight", "head.weight"])
    assert tie["source"] == "user" and tie["equal"] is True

    code, p, err = _json(["plan", src, "--to", "dp=2"], capsys)
    assert code == 0, (p.get("reasons"), err)
    rec = p["options"]["profile"]
    assert rec["sha256"] == sha and rec["name"] == "my-run"
    assert set(rec["contributed"]) == {"conventions", "drop", "keep", "source_grad_accum", "source_micro_batch", "ties"}
    assert p["batch"]["before"] == {"micro_batch": 8, "grad_accum": 4, "dp": 1, "global_batch": 32}
    assert p["batch"]["after"]["global_batch"] == 32 and p["batch"]["after"]["grad_accum"] == 2
    assert "profile reshard.toml (micro_batch 8, grad_accum 4)" in p["batch"]["note"]
    assert _key(p["keys"], "scratch.note")["reason"] == r"--drop ^scratch\.: debug notes, rebuilt at start"
    assert _key(p["keys"], "ema.w")["action"] == "carried"
    assert _key(p["keys"], "mystery.decay")["role"] == "config"
    assert p["options"]["conventions"][0]["table"] == "convention"

    dst = tmp_path / "out-dp2"
    code, out, err = run_cli(["convert", src, dst, "--to", "dp=2"], capsys)
    assert code == 0, out + err
    rep = json.loads((dst / "reshard-report.json").read_text())
    assert _key(rep["plan"]["keys"], "ema.w")["reason"].startswith(r"--keep ^ema\.: EMA copy")
    manifest = json.loads((dst / "manifest.json").read_text())
    assert manifest["lineage"][-1]["policies"]["options"]["profile"]["sha256"] == sha
    assert ["emb.weight", "head.weight"] in manifest["model"]["tied"]
    assert manifest["batch"]["grad_accum"] == 2 and manifest["batch"]["global_batch"] == 32
    ix = CheckpointIndex.open(dst)
    assert "scratch.note" not in ix.entries and torch.equal(ix.read_tensor("ema.w"), torch.full((6, 4), 0.5))

    # verify recomputes the plan from the lineage's options: it needs no profile
    code, out, err = run_cli(["verify", src, dst], capsys)
    assert code == 0, out + err

    # a second conversion of the output: the manifest now records the recipe (8 x 2 x 2), and the
    # profile's (8 x 4, the run's first layout) yields to it; the tie is in the manifest
    dst2 = tmp_path / "out-dp4"
    code, out, err = run_cli(["convert", dst, dst2, "--to", "dp=4"], capsys)
    assert code == 0, out + err
    m2 = json.loads((dst2 / "manifest.json").read_text())
    assert m2["batch"]["grad_accum"] == 1 and m2["batch"]["global_batch"] == 32
    code, out, err = run_cli(["verify", src, dst2], capsys)
    assert code == 0, out + err


def test_command_line_wins_over_the_profile_and_the_working_directory_profile_is_found(tmp_path, capsys, monkeypatch):
    src = _source(tmp_path / "run")
    work = tmp_path / "work"
    work.mkdir()
    (work / "reshard.toml").write_text(PROFILE)
    monkeypatch.chdir(work)
    code, p, err = _json(["plan", src, "--to", "dp=2", "--source-grad-accum", "2"], capsys)
    assert code == 0, err
    assert p["options"]["profile"]["file"] == str((work / "reshard.toml").resolve())
    assert p["batch"]["before"]["grad_accum"] == 2  # the flag, not the profile's 4
    assert "source_grad_accum" not in p["options"]["profile"]["contributed"]
    assert "source_micro_batch" in p["options"]["profile"]["contributed"]
    # an explicit --profile wins over the one found; --no-profile reads none
    other = tmp_path / "other.toml"
    other.write_text(PROFILE.replace("grad_accum = 4", "grad_accum = 6"))
    code, p, err = _json(["plan", src, "--to", "dp=2", "--profile", other], capsys)
    assert code == 0, err
    assert p["options"]["profile"]["file"] == str(other.resolve()) and p["batch"]["before"]["grad_accum"] == 6
    code, p, err = _json(["plan", src, "--to", "dp=2", "--no-profile", "--keep", "^(ema|scratch|mystery)\\.",
                          "--tie", "emb.weight=head.weight"], capsys)
    assert code == 0, err
    assert p["options"]["profile"] is None and p["options"]["ties"] == [["emb.weight", "head.weight"]]


def test_tie_flag_explains_a_copy_without_optimizer_state_and_refuses_copies_that_differ(tmp_path, capsys):
    src = _save(_tied_state(), tmp_path / "tied")
    code, r, err = _json(["inspect", src, "--no-profile"], capsys)  # equal copies: inspect infers the tie
    assert code == 0 and [t["source"] for t in r["optimizer"]["tied"]] != ["user"], r["problems"]
    code, r, err = _json(["inspect", src, "--no-profile", "--tie", "emb.weight=head.weight"], capsys)
    assert code == 0, r["problems"]
    assert [(t["names"], t["source"], t["equal"]) for t in r["optimizer"]["tied"]] == \
        [(["emb.weight", "head.weight"], "user", True)]
    dst = tmp_path / "out"
    code, out, err = run_cli(["convert", src, dst, "--to", "dp=2", "--no-profile", "--tie", "emb.weight=head.weight"],
                             capsys)
    assert code == 0, out + err
    assert ["emb.weight", "head.weight"] in json.loads((dst / "manifest.json").read_text())["model"]["tied"]
    code, out, err = run_cli(["inspect", dst, "--no-profile"], capsys)  # the output's manifest says it now
    assert code == 0, out + err

    # copies that differ: without the tie a parameter lacks its moments; with it, the tie is broken
    differ = _save(_tied_state(equal=False), tmp_path / "differ")
    code, r, err = _json(["inspect", differ, "--no-profile"], capsys)
    assert code == 1 and {p["code"] for p in r["problems"]} >= {"missing_moments"}, r["problems"]
    code, r, err = _json(["inspect", differ, "--no-profile", "--tie", "emb.weight=head.weight"], capsys)
    assert code == 1 and "tied_differ" in {p["code"] for p in r["problems"]}, r["problems"]
    assert "missing_moments" not in {p["code"] for p in r["problems"]}
    code, out, err = run_cli(["convert", differ, tmp_path / "never", "--to", "dp=2", "--no-profile",
                              "--tie", "emb.weight=head.weight"], capsys)
    assert code == 1 and "tied copies" in err and not (tmp_path / "never").exists(), out + err


def test_seed_recipe_from_a_profile_without_a_manifest(seed64_ckpt, tmp_path, capsys):
    """The seed's case, 64 x 8 x 4 = 2,048 -> 32 ranks, from a profile of three lines."""
    prof = tmp_path / "seed.toml"
    prof.write_text("[recipe]\nmicro_batch = 8\ngrad_accum = 4\n")
    code, p, err = _json(["plan", seed64_ckpt, "--from", "dp=64", "--to", "dp=32", "--profile", prof], capsys)
    assert code == 0, err
    assert p["batch"]["before"]["global_batch"] == 2048
    assert p["batch"]["after"] == {"micro_batch": 8, "grad_accum": 8, "dp": 32, "global_batch": 2048}
    assert p["batch"]["kept"] is True
    # a global batch instead of the accumulation: the accumulation follows from the source's dp
    prof.write_text("[recipe]\nmicro_batch = 8\nglobal_batch = 2048\n")
    code, p, err = _json(["plan", seed64_ckpt, "--from", "dp=64", "--to", "dp=32", "--profile", prof], capsys)
    assert code == 0, err
    assert p["batch"]["before"]["grad_accum"] == 4 and p["batch"]["after"]["grad_accum"] == 8
    prof.write_text("[recipe]\nmicro_batch = 8\nglobal_batch = 2000\n")
    code, out, err = run_cli(["plan", seed64_ckpt, "--from", "dp=64", "--to", "dp=32", "--profile", prof], capsys)
    assert code == 2 and "2000" in err and "micro-batch 8" in err, err


def test_bad_profiles_are_bad_input_naming_file_and_field(tmp_path, capsys):
    src = _source(tmp_path / "run")
    cases = {
        "unknown field": ("recipes = {}\n", "recipes"),
        "recipe field": ("[recipe]\nmicro_batches = 8\n", "recipe.micro_batches"),
        "not positive": ("[recipe]\nmicro_batch = 0\n", "recipe.micro_batch"),
        "tie shape": ('tie = ["a"]\n', "tie"),
        "bad regex": ("[[keep]]\npattern = '('\n", "keep"),
        "bad convention": ("[convention]\nname = \"x\"\n[[convention.rule]]\nmatch = 'a'\nrole = \"nonsense\"\n",
                           "nonsense"),
        "not toml": ("this is = = not toml\n", "invalid profile"),
    }
    for what, (text, needle) in cases.items():
        prof = tmp_path / f"{what.replace(' ', '_')}.toml"
        prof.write_text(text)
        code, out, err = run_cli(["plan", src, "--to", "dp=2", "--profile", prof], capsys)
        assert code == 2, (what, out, err)
        assert str(prof) in err and needle in err and "Traceback" not in err, (what, err)
    code, out, err = run_cli(["plan", src, "--to", "dp=2", "--profile", tmp_path / "absent.toml"], capsys)
    assert code == 2 and "absent.toml" in err, err
    code, out, err = run_cli(["plan", src, "--to", "dp=2", "--no-profile", "--tie", "emb.weight"], capsys)
    assert code == 2 and "--tie expects" in err, err


def test_drop_reason_on_the_command_line(tmp_path, capsys):
    src = _source(tmp_path / "run")
    code, p, err = _json(["plan", src, "--to", "dp=2", "--no-profile", "--tie", "emb.weight=head.weight",
                          "--keep", r"^(ema|mystery)\.", "--drop", r"^scratch\.=notes of a debugging session"], capsys)
    assert code == 0, err
    assert p["options"]["drop"] == [r"^scratch\."]
    assert _key(p["keys"], "scratch.note")["reason"] == r"--drop ^scratch\.: notes of a debugging session"
    # a '=' inside a bracket stays part of the pattern (lookarounds, '(?=', are refused: RE2, issue 32)
    code, p, err = _json(["plan", src, "--to", "dp=2", "--no-profile", "--tie", "emb.weight=head.weight",
                          "--keep", r"^(ema|mystery)[=.]", "--drop", r"^scratch\."], capsys)
    assert code == 0, err
    assert p["options"]["keep"] == [r"^(ema|mystery)[=.]"]


def test_the_profile_inside_a_checkpoint_is_not_read(tmp_path, capsys):
    """A file a checkpoint carries is not evidence: a reshard.toml inside it changes nothing."""
    src = _source(tmp_path / "run")
    (src / "reshard.toml").write_text(PROFILE)
    code, p, err = _json(["plan", src, "--to", "dp=2"], capsys)
    assert code == 1 and p["options"]["profile"] is None, err


def test_step_from_a_step_folder_name_only_when_nothing_stored_says_it(tmp_path, capsys):
    """torchtitan names its folders step-N: the name gives the step of a checkpoint with no counter."""
    sd = {"model": {"w": torch.arange(8.0).reshape(2, 4)}}
    src = _save(sd, tmp_path / "step-80000")
    code, r, err = _json(["inspect", src, "--no-profile"], capsys)
    assert code == 0, r["problems"]
    assert (r["step"], r["step_source"]) == (80000, "folder name")
    # a stored step wins; a folder name that disagrees is a warning, never an inconsistency
    stored = _save(_every_role_state(), tmp_path / "step-9")
    code, r, err = _json(["inspect", stored, "--no-profile"], capsys)
    assert code == 0 and (r["step"], r["step_source"]) == (7, "counter"), r["problems"]
    assert any(p["code"] == "step_folder_mismatch" and p["severity"] == "warning" for p in r["problems"])
    other = _save(sd, tmp_path / "checkpoint-5")
    code, r, err = _json(["inspect", other, "--no-profile"], capsys)
    assert r["step"] is None


def test_the_readme_quickstart_runs_as_written(plain_fsdp2_ckpt, tmp_path, capsys):
    """The README's quickstart: its profile, its three commands, its batch lines (a real FSDP2 run, 4 ranks)."""
    import re

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## Quickstart: your own checkpoint, no manifest", 1)[1].split("\n## ", 1)[0]
    profile = re.search(r"```toml\n(.*?)```", section, re.S).group(1)
    run = tmp_path / "run"
    shutil.copytree(plain_fsdp2_ckpt, run / "step-2")
    (run / "reshard.toml").write_text(profile)
    code, out, err = run_cli(["inspect", run / "step-2"], capsys)
    assert code == 0 and "complete and consistent" in out and "source_micro_batch" in out, out + err
    code, out, err = run_cli(["plan", run / "step-2", "--to", "dp=2"], capsys)
    assert code == 0, err
    for line in ("before: micro-batch 8 x accumulation 4 x dp 4 = 128",
                 "after:  micro-batch 8 x accumulation 8 x dp 2 = 128  (global batch kept)"):
        assert line in out and line in section, line
    code, out, err = run_cli(["convert", run / "step-2", tmp_path / "run-dp2", "--to", "dp=2"], capsys)
    assert code == 0 and "verified    equal to the source" in out, out + err
    code, out, err = run_cli(["plan", tmp_path / "run-dp2", "--to", "dp=4", "--no-profile", "--json"], capsys)
    assert code == 0 and json.loads(out)["batch"]["after"]["global_batch"] == 128, err


def test_export_hf_takes_the_values_config_json_needs_from_the_profile(tmp_path, capsys):
    """A Hugging Face export asks for what the shapes cannot say; a profile's [model] says it once."""
    from reshard.testing.synthetic_llama import LlamaShape, make_llama_checkpoint

    src = make_llama_checkpoint(tmp_path / "run" / "step-3", shape=LlamaShape(), tp=1, dp=2, fused=False, seed=7,
                                manifest=False)
    code, out, err = run_cli(["export", src, tmp_path / "never", "--format", "hf", "--no-profile"], capsys)
    assert code == 2 and "n_heads" in err and "rope_theta" in err, err
    (tmp_path / "run" / "reshard.toml").write_text(
        "[model]\nn_heads = 8\nn_kv_heads = 2\nrms_norm_eps = 1e-5\nrope_theta = 500000.0\nrope_scaling_factor = 1.0\n")
    code, out, err = run_cli(["export", src, tmp_path / "hf", "--format", "hf", "--json"], capsys)
    assert code == 0, err
    rec = json.loads(out)["profile"]
    assert rec["file"] == str((tmp_path / "run" / "reshard.toml").resolve())
    assert "model_config.n_heads" in rec["contributed"]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (8, 2)
    code, out, err = run_cli(["verify", src, tmp_path / "hf"], capsys)
    assert code == 0, out + err
