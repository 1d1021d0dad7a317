"""`reshard rehearse --trainer CMD` (issue 19): the rehearsal on the user's own trainer.

The trainer is examples/fsdp2_trainer.py (plain torch: FSDP2 fully_shard, get_state_dict /
set_state_dict, dcp.save / dcp.load, a global-cursor sampler), run as a child process
through the trainer contract (formats/trainer_contract.md), as a user's would be:

1. dp 4 -> 2, with the default (picked) recipe and the relaunch control:
   passes with exact coverage; the report, the Markdown and the figure name the trainer
   command and the checkpoint it produced.
2. dp 2 -> 3 and dp 2 -> 4 from one shared dp=2 baseline (``reuse_baseline``): pass with
   exact coverage and the documented tolerances.
3. ``--bug adam-reset`` (a fresh AdamW on resume) and ``--bug reshuffle`` (the data order
   seeded by the world size, run under torchrun itself): each fails and is named in the diagnosis.
4. The defaults make every pair of DP degrees 1..4 feasible (the recipe picker against the
   planner's own batch arithmetic; no training), and the contract refuses bad commands.

Runs are few and tiny (6 steps, 2-block MLP LM) and forked (``--nproc``: one import of torch
per run instead of one per rank) except the reshuffle case, which uses torchrun.
"""
from __future__ import annotations

import ast
import json
import time
import struct
from pathlib import Path

import pytest

from reshard.errors import BadInput
from reshard.rehearsal import TrainerCommand, pick_recipe, rehearse
from reshard.rehearsal.contract import RunSpec
from reshard.model.topology import parse_spec
from reshard.semantics.batch import Recipe, keep_global_batch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fsdp2_trainer.py"
ARGS = (" --layout {layout} --resume {ckpt_in} --save-at {save_at} --save {ckpt_out} --steps {steps} "
        "--step-log {log} --micro-batch {micro_batch} --grad-accum {grad_accum} --seed {seed} --dataset-len {dataset_len}")
FORKED = "{python} " + str(EXAMPLE) + " --nproc {world}" + ARGS
TORCHRUN = "{python} -m torch.distributed.run --nproc-per-node {world} " + str(EXAMPLE) + ARGS
RUN = dict(steps=6, switch_at=3, window=3)
# one dp=2 recipe that dp 3 and dp 4 (and 1) divide, so one baseline serves every dp=2 case
SHARED = dict(RUN, source_micro_batch=2, source_grad_accum=6, dataset_len=512, control="none")


def _passes(r: dict) -> None:
    assert r["exit_code"] == 0, (r["diverged"], r["errors"])
    assert r["diverged"] == [] and r["diagnosis"] == []
    cov = r["coverage"]["resumed"]
    assert (cov["repeated"], cov["skipped"], cov["exact"], cov["steps_with_other_ids"]) == (0, 0, True, [])
    assert r["loss"]["missing_steps"] == [] and r["loss"]["max_rel"] <= r["tolerances"]["loss_rtol"]
    assert r["grad_norm"]["max_rel"] <= r["tolerances"]["grad_norm_rtol"]
    assert r["moments"]["max_rel"] <= r["tolerances"]["moment_rtol"] and r["moments"]["step_counters_equal"]
    assert r["verify"]["equal"]
    assert r["setup"]["target_recipe"]["global_batch"] == r["setup"]["source_recipe"]["global_batch"]


@pytest.fixture(scope="module")
def dp4to2(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("trainer_dp4to2")
    return rehearse(from_spec="dp=4", to_spec="dp=2", trainer=FORKED, out=out, **RUN) | {"_out": out}


@pytest.fixture(scope="module")
def dp2to3(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("trainer_dp2to3")
    return rehearse(from_spec="dp=2", to_spec="dp=3", trainer=FORKED, out=out, **SHARED) | {"_out": out}


def test_dp4_to_dp2_passes_and_names_trainer_and_checkpoint(dp4to2):
    r, out = dp4to2, dp4to2["_out"]
    _passes(r)
    choice = r["setup"]["recipe_choice"]
    assert choice["picked"] and "picked global batch 16" in choice["note"]
    assert r["tolerance_derivation"]["how"].startswith("defaults")
    tr = r["trainer"]
    assert tr["command"] == FORKED and not tr["builtin_reference"]
    assert tr["checkpoint"] == str(out / "baseline" / "step_3")
    assert "--nproc 4" in tr["runs"]["baseline"]["command"]
    assert "--resume" not in tr["runs"]["baseline"]["command"]  # no {ckpt_in} in the baseline: word and flag dropped
    assert f"--resume {out / 'converted'}" in tr["runs"]["resumed"]["command"]
    assert "--grad-accum 4" in tr["runs"]["resumed"]["command"]  # the plan's recipe: 2 x 4 x dp 2 = 16
    # the relaunch control: the unconverted checkpoint, the source's per-rank recipe on 2 ranks
    ctl = r["control"]
    assert ctl["kind"] == "relaunch" and ctl["checkpoint"] == str(out / "baseline" / "step_3")
    assert "takes 8 samples per step instead of 16" in ctl["summary"]
    assert ctl["coverage"]["steps_with_other_ids"]
    md = (out / "rehearsal.md").read_text()
    assert FORKED in md and str(out / "baseline" / "step_3") in md and "PASS" in md
    saved = json.loads((out / "rehearsal.json").read_text())
    png = (out / "rehearsal.png").read_bytes()
    assert struct.unpack(">II", png[16:24]) == (saved["plot"]["width"], saved["plot"]["height"])
    caption = "".join(saved["plot"]["caption"])
    assert "fsdp2_trainer.py" in caption and "step_3" in caption and "trainer:" in caption


def test_dp2_to_dp3_passes(dp2to3):
    r = dp2to3
    _passes(r)
    assert r["setup"]["target_recipe"] == {"micro_batch": 2, "grad_accum": 4, "dp": 3, "global_batch": 24}
    assert not r["setup"]["recipe_choice"]["picked"]


def test_dp2_to_dp4_on_the_shared_baseline_passes(dp2to3, tmp_path):
    r = rehearse(from_spec="dp=2", to_spec="dp=4", trainer=FORKED, out=tmp_path, reuse_baseline=dp2to3["_out"],
                 **SHARED)
    _passes(r)
    assert r["trainer"]["baseline_reused_from"] == str(dp2to3["_out"]) and "baseline" not in r["trainer"]["runs"]
    assert r["setup"]["target_recipe"]["grad_accum"] == 3


def test_adam_reset_on_resume_is_caught_and_named(dp2to3, tmp_path):
    r = rehearse(from_spec="dp=2", to_spec="dp=4", trainer=FORKED + " --bug adam-reset", out=tmp_path,
                 reuse_baseline=dp2to3["_out"], **SHARED)
    assert r["exit_code"] == 1
    assert r["verify"]["equal"]  # reshard carried the moments; the trainer dropped them
    assert any(d.startswith("moments of") for d in r["diverged"]), r["diverged"]
    assert any(d.startswith("optimizer step counters") for d in r["diverged"]), r["diverged"]
    named = [d for d in r["diagnosis"] if d.startswith("optimizer state not restored on resume")]
    assert named and "re-initialises its optimizer (Adam moments)" in named[0], r["diagnosis"]
    assert r["coverage"]["resumed"]["exact"]  # only the optimizer is wrong
    md = (tmp_path / "rehearsal.md").read_text()
    assert "## Diagnosis" in md and "optimizer state not restored" in md and "--bug adam-reset" in md


def test_sampler_reshuffled_by_world_size_is_caught_and_named_under_torchrun(tmp_path):
    r = rehearse(from_spec="dp=2", to_spec="dp=1", trainer=TORCHRUN + " --bug reshuffle", out=tmp_path, **SHARED)
    assert "--nproc-per-node 2" in r["trainer"]["runs"]["baseline"]["command"]
    assert r["exit_code"] == 1
    cov = r["coverage"]["resumed"]
    assert not cov["exact"] and cov["steps_with_other_ids"] == [4, 5, 6]
    assert any(d.startswith("coverage:") for d in r["diverged"]), r["diverged"]
    named = [d for d in r["diagnosis"] if d.startswith("data order changed with the world size")]
    assert named and "reshuffles by world size" in named[0], r["diagnosis"]
    assert not any(d.startswith("optimizer state") for d in r["diagnosis"])


@pytest.mark.parametrize("src", [1, 2, 3, 4])
def test_defaults_make_every_dp_pair_feasible(src):
    for tgt in (1, 2, 3, 4):
        choice = pick_recipe(src, tgt)
        assert choice.picked and choice.source.dp == src
        assert choice.source.grad_accum >= 2
        decision = keep_global_batch(choice.source, tgt)  # what the planner decides
        assert decision.feasible and decision.kept, (src, tgt, decision.note)
        assert decision.after == choice.target == Recipe(2, choice.source.global_batch // (2 * tgt), tgt)
        assert f"picked global batch {choice.source.global_batch}" in choice.note


def test_the_issue_pair_is_feasible_by_default():
    choice = pick_recipe(2, 3)
    assert (choice.source.global_batch, choice.source.grad_accum, choice.target.grad_accum) == (12, 3, 2)
    assert pick_recipe(4, 2).source == Recipe(2, 2, 4)  # the old default where it was feasible
    with pytest.raises(BadInput, match="cannot be kept on dp 3"):
        pick_recipe(2, 3, source_micro_batch=2, source_grad_accum=2)


def test_contract_refuses_bad_commands_and_drops_an_absent_resume():
    with pytest.raises(BadInput, match=r"unknown placeholders \{wrld\}"):
        TrainerCommand("train.py {wrld}" + ARGS)
    with pytest.raises(BadInput, match=r"lacks placeholders \{ckpt_in\}"):
        TrainerCommand("train.py --world {world} --save {ckpt_out} --save-at {save_at} --log {log} --steps {steps} "
                       "--micro-batch {micro_batch} --grad-accum {grad_accum}")
    cmd = TrainerCommand("OMP_NUM_THREADS=1 torchrun --nproc-per-node {world}" + ARGS + " --tag {{x}}")
    spec = RunSpec(name="baseline", layout=parse_spec("dp=2,tp=2"), micro_batch=2, grad_accum=3, steps=6,
                   total_steps=6, save_at=[4, 3], ckpt_out=Path("/o"), log=Path("/l.jsonl"), seed=0, dataset_len=64)
    argv, env = cmd.render(spec)
    assert env == {"OMP_NUM_THREADS": "1"}
    assert argv[:3] == ["torchrun", "--nproc-per-node", "4"] and "--resume" not in argv
    assert argv[argv.index("--layout") + 1] == "dp=2,tp=2" and argv[argv.index("--save-at") + 1] == "3,4"
    assert argv[-2:] == ["--tag", "{x}"]
    argv, _ = cmd.render(RunSpec(**{**spec.__dict__, "ckpt_in": Path("/in")}))
    assert argv[argv.index("--resume") + 1] == "/in"


def test_reuse_of_another_experiments_baseline_is_refused(dp2to3, tmp_path):
    with pytest.raises(BadInput, match="seed 0 there, 1 here"):
        rehearse(from_spec="dp=2", to_spec="dp=4", trainer=FORKED, out=tmp_path, reuse_baseline=dp2to3["_out"],
                 **{**SHARED, "seed": 1})
    with pytest.raises(BadInput, match="--like takes a slice of the real checkpoint"):
        rehearse(from_spec="dp=2", to_spec="dp=4", trainer=FORKED, out=tmp_path, like=tmp_path, **RUN)


def test_example_trainer_imports_nothing_of_reshard():
    tree = ast.parse(EXAMPLE.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert names and not any(x.split(".")[0] == "reshard" for x in names), names


def test_a_hung_run_is_stopped_with_its_children(tmp_path):
    """--timeout: the run's whole process group goes (torchrun's workers too), and the report says so."""
    from reshard.rehearsal.contract import run

    pidfile = tmp_path / "child.pid"
    cmd = TrainerCommand(f"sh -c 'sleep 60 & echo $! > {pidfile}; wait' {{world}} {{ckpt_in}} {{ckpt_out}} "
                         "{save_at} {log} {steps} {micro_batch} {grad_accum}")
    spec = RunSpec(name="baseline", layout=parse_spec("dp=1"), micro_batch=1, grad_accum=1, steps=1, total_steps=1,
                   save_at=[1], ckpt_out=tmp_path / "o", log=tmp_path / "l.jsonl", seed=0, dataset_len=8)
    r = run(cmd, spec, out_dir=tmp_path, timeout=1, retries=0)
    assert r.returncode == -1 and "exited on timeout" in r.error and str(tmp_path / "baseline.out") in r.error
    status = Path(f"/proc/{int(pidfile.read_text())}/status")

    def gone() -> bool:
        try:
            return "State:\tZ" in status.read_text()
        except OSError:  # reaped
            return True

    # the grandchild was killed too: SIGKILL is delivered when it is next scheduled, which on a busy
    # machine (the suite runs on every core) may be a moment after the group was signalled; a
    # `sleep 60` that was not signalled would still be running after these 10 s
    deadline = time.monotonic() + 10
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(), status.read_text()
