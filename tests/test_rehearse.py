"""`reshard.rehearsal.rehearse`: real restore rehearsals on CPU gloo ranks.

The reference trainer runs through the trainer contract (its default command), like a user's.

1. dp=4 -> dp=2 (accumulation doubled by the plan), 20-step window: exit 0, coverage exact,
   losses within 1e-4, moments after the first resumed step within 1e-5, the naive control
   repeats samples and the report says so; the PNG is what line_chart drew.
2. dp=2,tp=2 -> dp=2: exit 0 with a tolerance derived from a noise-floor run; the report
   says the trajectory is not bitwise identical and why (or that it is bitwise).
3. Hooks that break the converted checkpoint: a zeroed exp_avg is named as that
   parameter's moments; a rewritten data cursor is named as coverage. Exit 1.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from reshard.errors import BadInput
from reshard.rehearsal import rehearse, rewrite_checkpoint

PANELS = ("loss", "grad_norm", "control_coverage")


@pytest.fixture(scope="module")
def dp4to2(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("rehearse_dp4to2")
    return rehearse(from_spec="dp=4", to_spec="dp=2", steps=24, switch_at=4, window=20, out=out) | {"_out": out}


def test_dp4_to_dp2_passes(dp4to2):
    r = dp4to2
    assert r["exit_code"] == 0, r["diverged"]
    assert r["diverged"] == []
    assert r["setup"]["target_recipe"]["grad_accum"] == 2 * r["setup"]["source_recipe"]["grad_accum"]
    assert r["setup"]["target_recipe"]["global_batch"] == r["setup"]["source_recipe"]["global_batch"]
    assert r["window_steps"] == [5, 24] and len(r["per_step"]["loss"]) == 20
    assert r["loss"]["max_rel"] <= 1e-4 and r["loss"]["missing_steps"] == []
    cov = r["coverage"]["resumed"]
    assert (cov["repeated"], cov["skipped"], cov["exact"]) == (0, 0, True)
    m = r["moments"]
    assert m["max_rel"] <= 1e-5 and m["n_params"] > 20 and m["step_counters_equal"] and m["missing"] == []
    assert r["verify"]["equal"]
    assert r["throughput"]["baseline_median_tokens_per_s"] > 0 and r["throughput"]["resumed_median_tokens_per_s"] > 0
    assert r["exactness"]["kind"] in ("bitwise", "within_tolerance")
    assert "dropout 0" in r["setup"]["randomness"]


def test_the_reference_runs_through_the_trainer_contract(dp4to2):
    """One engine: the reference trainer is the default command of the contract, named in the report."""
    tr = dp4to2["trainer"]
    assert tr["builtin_reference"] and tr["command"].startswith("{python} -m reshard.reference --spawn --layout {layout}")
    assert set(tr["runs"]) == {"baseline", "resumed", "control"}
    assert "--layout dp=4" in tr["runs"]["baseline"]["command"] and "--resume" not in tr["runs"]["baseline"]["command"]
    assert tr["checkpoint"] == str(dp4to2["_out"] / "baseline" / "step_4")
    assert dp4to2["setup"]["recipe_choice"]["picked"] and dp4to2["control"]["kind"] == "naive-state"


def test_dp4_to_dp2_control_repeats_samples(dp4to2):
    r = dp4to2
    ctl = r["control"]["coverage"]
    assert ctl["repeated"] + ctl["skipped"] > 0
    assert ctl["repeated"] == 32  # cursor 64 on 4 ranks = 16 local; replayed on 2 ranks -> 32
    assert r["control"]["cursor_before"] == 64 and r["control"]["cursor_after"] == 32
    assert r["control"]["first_step_loss_jump"]["step"] == 5
    md = (r["_out"] / "rehearsal.md").read_text()
    assert "the naive resume repeats 32 sample ids" in md
    assert "PASS" in md


def test_dp4_to_dp2_outputs(dp4to2):
    out = dp4to2["_out"]
    saved = json.loads((out / "rehearsal.json").read_text())
    assert saved["exit_code"] == 0 and saved["series"] == dp4to2["series"]
    png = (out / "rehearsal.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    w, h = struct.unpack(">II", png[16:24])
    assert (w, h) == (saved["plot"]["width"], saved["plot"]["height"])
    panels = saved["plot"]["panels"]
    assert len(panels) == len(PANELS)
    for name, panel in zip(PANELS, panels):
        drawn = {s["label"]: {"xs": s["xs"], "ys": s["ys"]} for s in panel["series"]}
        assert drawn == saved["series"][name], name
        assert panel["vlines"] and panel["vlines"][0][0] == 4.5
    assert saved["series"]["loss"]["resumed"]["xs"] == [float(s) for s in range(5, 25)]
    assert saved["series"]["control_coverage"]["repeated"]["ys"][-1] == 32.0


def test_tp2_to_tp1_derived_tolerance(tmp_path):
    r = rehearse(from_spec="dp=2,tp=2", to_spec="dp=2", steps=8, switch_at=3, window=5, out=tmp_path)
    assert r["exit_code"] == 0, r["diverged"]
    d = r["tolerance_derivation"]
    assert "noise floor" in d["how"] and set(d["floor"]) == {"loss_rel", "grad_norm_rel", "moment_rel"}
    assert r["tolerances"]["loss_rtol"] == max(1e-4, 10 * d["floor"]["loss_rel"])
    assert r["tolerances"]["moment_rtol"] == max(1e-5, 10 * d["floor"]["moment_rel"])
    assert r["moments"]["max_rel"] <= r["tolerances"]["moment_rtol"]
    ex = r["exactness"]
    if r["loss"]["bitwise"] and r["grad_norm"]["bitwise"]:
        assert ex["kind"] == "bitwise" and "bitwise equal" in ex["statement"]
    else:
        assert ex["kind"] == "within_tolerance"
        assert "not bitwise identical" in ex["statement"] and "tensor parallelism changes 2 -> 1" in ex["statement"]
        assert "not expected" in ex["statement"]
    assert ex["statement"] in (tmp_path / "rehearsal.md").read_text()


PARAM = "blocks.0.mlp.fc1.weight"


@pytest.fixture(scope="module")
def zeroed(tmp_path_factory) -> dict:
    """dp=2 -> dp=1 with one parameter's exp_avg zeroed after the conversion (its baseline reused below)."""
    key = f"optim.state.{PARAM}.exp_avg"

    def zero_one(dst: Path) -> Path:
        return rewrite_checkpoint(dst, dst.parent / "broken", tensor_fn=lambda k: torch.zeros_like if k == key else None)

    out = tmp_path_factory.mktemp("rehearse_zeroed")
    r = rehearse(from_spec="dp=2", to_spec="dp=1", steps=5, switch_at=2, window=3, out=out,
                 hooks={"after_convert": zero_one})
    return r | {"_out": out, "_key": key}


def test_hook_zeroed_exp_avg_is_named(zeroed):
    r, key, tmp_path = zeroed, zeroed["_key"], zeroed["_out"]
    assert r["exit_code"] == 1
    assert any(d.startswith(f"moments of {PARAM}: exp_avg") for d in r["diverged"]), r["diverged"]
    assert not any(d.startswith("moments of") and PARAM not in d for d in r["diverged"]), r["diverged"]
    assert r["coverage"]["resumed"]["exact"]
    assert any(key in d for d in r["diverged"] if d.startswith("converted state"))
    assert f"moments of {PARAM}" in (tmp_path / "rehearsal.md").read_text()


def test_hook_rewritten_cursor_is_named(zeroed, tmp_path):
    """The same transition (its baseline, the same layout, recipe, steps and seed, reused: the hook acts after it)."""
    def rewind(dst: Path) -> Path:
        return rewrite_checkpoint(dst, dst.parent / "broken", objects={"data.sampler.cursor": 0})

    r = rehearse(from_spec="dp=2", to_spec="dp=1", steps=5, switch_at=2, window=3, out=tmp_path,
                 hooks={"after_convert": rewind}, reuse_baseline=zeroed["_out"])
    assert r["trainer"]["baseline_reused_from"] == str(zeroed["_out"])
    assert r["exit_code"] == 1
    cov = [d for d in r["diverged"] if d.startswith("coverage")]
    assert cov and r["coverage"]["resumed"]["repeated"] > 0, r["diverged"]
    assert "FAIL" in (tmp_path / "rehearsal.md").read_text()


def test_bad_inputs(tmp_path):
    with pytest.raises(BadInput):
        rehearse(from_spec="dp=2", to_spec="dp=1", steps=4, switch_at=2, window=3, out=tmp_path)
    with pytest.raises(BadInput):
        rehearse(from_spec="dp=2,cp=2", to_spec="dp=1", out=tmp_path)
    with pytest.raises(BadInput):
        rehearse(from_spec="dp=1,tp=4", to_spec="dp=1", out=tmp_path)  # 2 heads


def test_like_copies_from_a_reference_checkpoint_and_refuses_other_families(dp4to2, tmp_path):
    from reshard.rehearsal.rehearse import _from_like
    from reshard.model.topology import parse_spec

    real = dp4to2["_out"] / "baseline" / "step_4"
    got = _from_like(real, parse_spec("dp=4"))
    assert got["copied"]["rules_family"] == "reference-gpt"
    assert got["train"]["n_heads"] == 2 and got["train"]["micro_batch"] == 2 and got["train"]["grad_accum"] == 2
    assert got["copied"]["schedule"]["warmup_fraction"] == 2 / 24
    other = tmp_path / "llama"
    other.mkdir()
    m = json.loads((real / "manifest.json").read_text())
    m["model"]["family"] = "llama-torchtitan"
    (other / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BadInput, match="reference trainer cannot build that family yet"):
        rehearse(from_spec="dp=2", to_spec="dp=1", like=other, out=tmp_path / "out")
