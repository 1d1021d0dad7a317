"""The rehearsal's judgement: its runs compared over the window, the tolerances, and the verdict.

`reshard.rehearsal.rehearse` runs the baseline, the converted resume and the naive control;
this module reads what they left (step logs, checkpoints) and says how the resumed run
compares with the baseline (losses, grad norms, Adam moments, sample coverage), within
which tolerances (the defaults, or a measured fp32 noise floor for a tp/pp change), what
diverged, whether the trajectory is bitwise or only within tolerance and why, what the
control shows, which trainer mistake the evidence points at, and the report that says it
all (rehearsal.json). The records of the runs (`reshard.rehearsal.rehearse`'s setup,
baseline and switch) are typed ``Any`` here: that module imports this one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reshard.errors import BadInput, Infeasible
from reshard.rehearsal import compare
from reshard.rehearsal.contract import CONTRACT_DOC, RunSpec, find_checkpoint, layout_spec

if TYPE_CHECKING:  # annotations only
    from reshard.semantics.batch import Recipe

DEFAULT_TOLERANCES = {"loss_rtol": 1e-4, "grad_norm_rtol": 1e-3, "moment_rtol": 1e-5}
FLOOR_FACTOR = 10.0      # tolerance = max(default, FLOOR_FACTOR x measured fp32 noise floor)
FALLBACK_FACTOR = 10.0   # no noise-floor run possible: defaults x this factor


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else ("inf" if x == math.inf else f"{x:.2e}")


def saved(spec: RunSpec, step: int) -> Path:
    """The checkpoint a finished run saved after ``step``; Infeasible, naming the contract, when absent."""
    got = find_checkpoint(spec.ckpt_out, step)
    if got is None:
        raise Infeasible(f"the {spec.name} run wrote no checkpoint for step {step}", where=str(spec.ckpt_out),
                         hint=f"The trainer must save after each step in {{save_at}} into a directory of {{ckpt_out}} "
                              f"whose name ends in the step (step_{step}) ({CONTRACT_DOC}).")
    return got


# ---------------------------------------------------------------------- 3. compare

@dataclass
class _Comparison:
    """The three runs' logs and what compare measured of them over the window."""

    base: dict[int, Any]
    res: dict[int, Any]
    ctl: dict[int, Any]
    loss: dict[str, Any]
    gnorm: dict[str, Any]
    mom: dict[str, Any] | None            # None: the resumed run wrote no step_{k+1} checkpoint
    cov: dict[str, Any]
    ctl_cov: dict[str, Any] | None
    ctl_loss: dict[str, Any] | None
    jump: dict[str, Any] | None           # the control's loss jump at the first resumed step
    ids_logged: bool                      # the baseline's records carry sample_ids (the contract asks for them)


def compare_runs(setup: Any, baseline: Any) -> _Comparison:
    """Losses, grad norms, moments after the first resumed step and sample coverage, each against the baseline."""
    out, k, window_steps = setup.out, setup.switch_at, setup.window_steps
    base = compare.read_log(baseline.log)
    res, ctl = (compare.read_log(out / f"{n}.jsonl") for n in ("resumed", "control"))
    res_next = find_checkpoint(out / "resumed", k + 1)
    mom = compare.moments(res_next, baseline.next_ckpt) if res_next is not None else None
    ids_logged = bool(base) and all(r.sample_ids is not None for r in base.values())
    cov_kw = dict(switch_at=k, window_steps=window_steps)
    return _Comparison(
        base=base, res=res, ctl=ctl,
        loss=compare.trajectory(res, base, window_steps, "loss"),
        gnorm=compare.trajectory(res, base, window_steps, "grad_norm"),
        mom=mom, cov=compare.coverage(base, res, **cov_kw),
        ctl_cov=compare.coverage(base, ctl, **cov_kw) if ctl else None,
        ctl_loss=compare.trajectory(ctl, base, window_steps, "loss") if ctl else None,
        jump=_first_step_jump(base, res, ctl, window_steps[0]), ids_logged=ids_logged)


def _first_step_jump(base: dict[int, Any], res: dict[int, Any], ctl: dict[int, Any],
                     first: int) -> dict[str, Any] | None:
    """The control's loss against the baseline's at the first resumed step: where a naive resume shows."""
    if not (ctl and first in ctl and first in base):
        return None
    return {"step": first, "control": ctl[first].loss, "baseline": base[first].loss,
            "resumed": res[first].loss if first in res else None,
            "abs": ctl[first].loss - base[first].loss, "rel": compare.rel(ctl[first].loss, base[first].loss)}


# ---------------------------------------------------------------------- 4. tolerances

def tolerances(setup: Any, baseline: Any, base: dict[int, Any],
               overrides: dict | None) -> tuple[dict[str, float], dict[str, Any]]:
    """(tolerances, derivation): the defaults for a dp-only change; for a tp/pp change, derived from
    the measured noise floor (or the defaults widened when none could be measured); then the
    caller's overrides."""
    derivation: dict[str, Any]
    if not setup.structural:
        tol = dict(DEFAULT_TOLERANCES)
        derivation = {"how": "defaults for a data-parallel-only change (loss_rtol 1e-4, grad_norm_rtol 1e-3, "
                             "moment_rtol 1e-5)"}
    elif baseline.floor_spec is not None:
        tol, derivation = _floor_tolerances(setup, baseline, baseline.floor_spec, base)
    else:
        tol = {n: v * FALLBACK_FACTOR for n, v in DEFAULT_TOLERANCES.items()}
        derivation = {"how": (f"tp/pp change and no accumulation split to measure a noise floor with (micro_batch "
                              f"and grad_accum both odd): defaults x {FALLBACK_FACTOR:g}"), "factor": FALLBACK_FACTOR}
    overridden = sorted(set(overrides or {}) & set(tol))
    bad = set(overrides or {}) - set(tol)
    if bad:
        raise BadInput(f"unknown tolerances {sorted(bad)}", hint=f"Known: {sorted(tol)}.")
    tol.update({n: float(overrides[n]) for n in overridden})
    if overridden:
        derivation["overridden"] = overridden
    return tol, derivation


def _floor_tolerances(setup: Any, baseline: Any, floor_cfg: RunSpec,
                      base: dict[int, Any]) -> tuple[dict[str, float], dict[str, Any]]:
    """max(default, FLOOR_FACTOR x how far the noise-floor run drifted from the baseline)."""
    k, window_steps, base_cfg = setup.switch_at, setup.window_steps, baseline.spec
    fl = compare.read_log(floor_cfg.log)
    f_loss = compare.trajectory(fl, base, window_steps, "loss")["max_rel"] or 0.0
    f_gn = compare.trajectory(fl, base, window_steps, "grad_norm")["max_rel"] or 0.0
    f_mom = compare.moments(saved(floor_cfg, k + 1), baseline.next_ckpt)["max_rel"] or 0.0
    d = DEFAULT_TOLERANCES
    tol = {"loss_rtol": max(d["loss_rtol"], FLOOR_FACTOR * f_loss),
           "grad_norm_rtol": max(d["grad_norm_rtol"], FLOOR_FACTOR * f_gn),
           "moment_rtol": max(d["moment_rtol"], FLOOR_FACTOR * f_mom)}
    derivation = {
        "how": (f"tp/pp change: fp32 noise floor measured from the baseline. A second run of the source "
                f"layout ({layout_spec(setup.src)}) from the same initial weights on the same samples, with only the "
                f"accumulation split changed (micro_batch {base_cfg.micro_batch}->{floor_cfg.micro_batch}, "
                f"grad_accum {base_cfg.grad_accum}->{floor_cfg.grad_accum}: the same sums in another order), "
                f"differs from the baseline by up to {_fmt(f_loss)} in loss, {_fmt(f_gn)} in grad norm "
                f"over the window and {_fmt(f_mom)} in moments after step {k + 1}; tolerance = "
                f"max(default, {FLOOR_FACTOR:g} x floor)"),
        "floor": {"loss_rel": f_loss, "grad_norm_rel": f_gn, "moment_rel": f_mom}, "factor": FLOOR_FACTOR}
    return tol, derivation


# ---------------------------------------------------------------------- 5. verdict

def diverged(setup: Any, switch: Any, cmp: _Comparison, tol: dict[str, float],
             res_err: str | None) -> list[str]:
    """Everything that diverged, named; empty means exit 0."""
    diverged: list[str] = []
    if res_err:
        diverged.append(f"resumed run: {res_err}")
    if not cmp.ids_logged:
        diverged.append("coverage: the baseline's step log carries no sample_ids, so coverage cannot be judged "
                        "(the trainer contract asks for them: formats/step_log.md)")
    diverged += _trajectory_divergences(cmp.loss, cmp.gnorm, tol)
    diverged += _moment_divergences(cmp.mom, tol, setup.switch_at)
    diverged += _coverage_divergences(cmp.cov)
    v = switch.verified
    if not v["equal"]:
        diverged.append("converted state: differs from the source beyond the planned rewrites: "
                        + ", ".join(sorted({d["key"] for d in v["differences"]})[:5]))
    return diverged


def _trajectory_divergences(loss: dict[str, Any], gnorm: dict[str, Any], tol: dict[str, float]) -> list[str]:
    """Missing loss steps, and loss or grad norm beyond tolerance (the worst step named)."""
    diverged = []
    if loss["missing_steps"]:
        diverged.append(f"loss: resumed run logged no loss for steps {loss['missing_steps'][:5]}")
    if loss["max_rel"] is not None and loss["max_rel"] > tol["loss_rtol"]:
        diverged.append(f"loss: max rel diff {_fmt(loss['max_rel'])} at step {loss['worst_step']} "
                        f"> loss_rtol {_fmt(tol['loss_rtol'])}")
    if gnorm["max_rel"] is not None and gnorm["max_rel"] > tol["grad_norm_rtol"]:
        diverged.append(f"grad norm: max rel diff {_fmt(gnorm['max_rel'])} at step {gnorm['worst_step']} "
                        f"> grad_norm_rtol {_fmt(tol['grad_norm_rtol'])}")
    return diverged


def _moment_divergences(mom: dict[str, Any] | None, tol: dict[str, float], k: int) -> list[str]:
    """Each parameter whose Adam moments differ beyond tolerance, missing moments, and step counters."""
    if mom is None:
        return [f"moments: the resumed run wrote no step_{k + 1} checkpoint to compare"]
    diverged = []
    for p, d in mom["per_param"].items():
        bad_m = {n: r for n, r in d.items() if r > tol["moment_rtol"]}
        if bad_m:
            diverged.append(f"moments of {p}: " + ", ".join(f"{n} rel {_fmt(r)}" for n, r in bad_m.items())
                            + f" > moment_rtol {_fmt(tol['moment_rtol'])}")
    for key in mom["missing"]:
        diverged.append(f"moments: {key} missing from the resumed checkpoint")
    if not mom["step_counters_equal"]:
        diverged.append("optimizer step counters: " + ", ".join(
            f"{x['key']} {x['run']} != {x['baseline']}" for x in mom["step_mismatch"][:3])
            + ("; trainer.step differs" if not mom["counters"].get("trainer.step", {}).get("equal", True) else ""))
    return diverged


def _coverage_divergences(cov: dict[str, Any]) -> list[str]:
    """Repeated or skipped samples, steps that took other ids, steps not run."""
    if cov["exact"]:
        return []
    return [f"coverage: {cov['repeated']} sample ids repeated, {cov['skipped']} skipped within the epoch"
            + (f", steps {cov['steps_with_other_ids'][:5]} took other ids than the baseline"
               if cov["steps_with_other_ids"] else "")
            + (f", steps {cov['missing_steps'][:5]} not run" if cov["missing_steps"] else "")]


# ---------------------------------------------------------------------- exactness statement

def exactness(setup: Any, switch: Any, cmp: _Comparison, tol: dict[str, float]) -> dict[str, Any]:
    """{"kind", "statement", "reasons"}: bitwise, within tolerance (and why not bitwise), or neither."""
    loss, gnorm, mom, v = cmp.loss, cmp.gnorm, cmp.mom, switch.verified
    reasons = _inexact_reasons(setup, switch.after)
    state_line = ("the state is bit-exact at the switch (verify: the converted checkpoint equals the source except "
                  f"the {len(switch.planned)} planned rewrites)" if v["equal"] else
                  "the converted state is NOT equal to the source beyond the planned rewrites")
    mom_line = f"moments after the first resumed step within {_fmt(mom['max_rel'])} rel" if mom else "moments not compared"
    if loss["bitwise"] and gnorm["bitwise"]:
        kind = "bitwise"
        statement = (f"resumed losses and grad norms are bitwise equal to the baseline at every step of the window; "
                     f"{state_line}; {mom_line}.")
    elif loss["max_rel"] is not None and not loss["missing_steps"] and loss["max_rel"] <= tol["loss_rtol"]:
        kind = "within_tolerance"
        statement = (f"the trajectory is not bitwise identical (max rel loss diff {_fmt(loss['max_rel'])} at step "
                     f"{loss['worst_step']}; {sum(p['bitwise'] for p in loss['per_step'])} of {len(loss['per_step'])} "
                     f"steps bitwise equal) because " + ("; and ".join(reasons) or "of fp32 reduction order")
                     + f". A bit-exact trajectory across topologies is not expected; {state_line}; {mom_line}; "
                     f"trajectory within {_fmt(loss['max_rel'])} (tolerance {_fmt(tol['loss_rtol'])}).")
    else:
        kind = "neither"
        statement = (f"the resumed trajectory is neither bitwise equal nor within tolerance (max rel loss diff "
                     f"{_fmt(loss['max_rel'])} > {_fmt(tol['loss_rtol'])}"
                     + (f", steps missing: {loss['missing_steps'][:5]}" if loss["missing_steps"] else "")
                     + f"); {state_line}; {mom_line}.")
    return {"kind": kind, "statement": statement, "reasons": reasons}


def _inexact_reasons(setup: Any, after: Recipe) -> list[str]:
    """Why this transition cannot be expected to reproduce the trajectory bit for bit."""
    src, tgt, kw, dropout = setup.src, setup.tgt, setup.recipe.source, setup.dropout
    reasons = []
    if src.dp != tgt.dp or after.grad_accum != kw.grad_accum or after.micro_batch != kw.micro_batch:
        reasons.append(f"the data-parallel width changes {src.dp} -> {tgt.dp} and the recipe micro_batch x grad_accum "
                       f"{kw.micro_batch}x{kw.grad_accum} -> {after.micro_batch}x{after.grad_accum}: "
                       "each step's gradient is the same sum over the same samples, but fp32 addition is not "
                       "associative and the sum is taken in another order (micro-batch sums, then a sum across "
                       "another number of ranks)")
    if src.tp != tgt.tp:
        reasons.append(f"tensor parallelism changes {src.tp} -> {tgt.tp}: row-parallel matmuls add partial "
                       "products across TP ranks, so activations, gradients and the grad norm "
                       "are accumulated in another order")
    if src.pp != tgt.pp:
        reasons.append(f"pipeline parallelism changes {src.pp} -> {tgt.pp}: the tied embedding's gradient is summed "
                       "across stages and the grad norm across stage groups")
    if dropout > 0:
        reasons.append(f"dropout {dropout} draws masks from per-dp-rank RNG streams, which a new topology reseeds")
    return reasons


# ---------------------------------------------------------------------- control, series, report

def control_section(setup: Any, control_info: dict[str, Any] | None, ctl_err: str | None,
                    cmp: _Comparison) -> dict[str, Any]:
    """The naive control: how it was made, its coverage and loss jump, and a one-line summary."""
    if control_info is None:
        return {"kind": "none", "how": "no control run (--control none)", "cursor_before": None,
                "cursor_after": None, "error": None, "coverage": None, "first_step_loss_jump": None, "loss": None}
    ctl_cov, ctl_loss, jump = cmp.ctl_cov, cmp.ctl_loss, cmp.jump
    control = {
        "kind": control_info["kind"], "how": control_info["how"], "checkpoint": str(control_info["ckpt"]),
        "recipe": {"micro_batch": control_info["micro_batch"], "grad_accum": control_info["grad_accum"],
                   "global_batch": control_info["global_batch"]},
        "cursor_before": control_info["cursor_before"], "cursor_after": control_info["cursor_after"],
        "error": ctl_err, "coverage": ctl_cov, "first_step_loss_jump": jump,
        "loss": {x: ctl_loss[x] for x in ("max_abs", "max_rel", "worst_step")} if ctl_loss else None,
    }
    if ctl_cov is not None:
        what = []
        if ctl_cov["repeated"]:
            what.append(f"repeats {ctl_cov['repeated']} sample ids")
        if ctl_cov["skipped"]:
            what.append(f"skips {ctl_cov['skipped']} sample ids")
        if control_info["global_batch"] != setup.g_src:
            what.append(f"takes {control_info['global_batch']} samples per step instead of {setup.g_src}")
        control["summary"] = ("the naive resume " + " and ".join(what) if what else
                              "the naive resume neither repeats nor skips samples (dp unchanged)") + (
            f"; its loss at step {jump['step']} is {jump['control']:.6f} vs {jump['baseline']:.6f} "
            f"(rel jump {_fmt(jump['rel'])}), max rel loss diff over the window {_fmt(ctl_loss['max_rel'])}"
            if jump else "")
    return control


def diagnosis(setup: Any, switch: Any, cmp: _Comparison, tol: dict[str, float]) -> list[str]:
    """The trainer mistakes the evidence points at, named. The converted checkpoint is checked
    against the source first: when it holds the state, a resumed run that lost it lost it in the
    trainer's own resume code, and the report should say where to look."""
    found: list[str] = []
    state_ok = switch.verified["equal"]
    k = setup.switch_at
    mom = cmp.mom
    if mom is not None and state_ok:
        bad = [p for p, d in mom["per_param"].items() if max(d.values(), default=0.0) > tol["moment_rtol"]]
        reset = [x for x in mom["step_mismatch"] if x["run"] < x["baseline"]]
        # Moments that differ on the same samples point at the optimizer; on other samples they
        # differ anyway (other gradients), and only reset step counters still point at it.
        if reset or (mom["n_params"] and len(bad) * 2 >= mom["n_params"] and cmp.cov["exact"]):
            counters = (f"its optimizer step counters read {reset[0]['run']:g} after step {k + 1} where the baseline's "
                        f"read {reset[0]['baseline']:g}" if reset else "")
            found.append("optimizer state not restored on resume: the converted checkpoint holds the source's Adam "
                         f"moments (verify: equal), yet after step {k + 1} the resumed run's moments differ for "
                         f"{len(bad)} of {mom['n_params']} parameters" + (f" and {counters}" if counters else "")
                         + ": the trainer re-initialises its optimizer (Adam moments) when it resumes; load the "
                         "optimizer state with set_state_dict(..., optim_state_dict=...) after dcp.load")
    cov = cmp.cov
    data = switch.plan.data
    carried = data is not None and getattr(data, "policy", None) == "carry"
    if state_ok and cov["steps_with_other_ids"] and cov["steps_with_other_ids"][0] == setup.window_steps[0] \
            and not cov["missing_steps"]:
        found.append(f"data order changed with the world size: from step {k + 1}, the first on {layout_spec(setup.tgt)}, "
                     f"the resumed run takes other sample ids than the baseline ({cov['repeated']} repeated, "
                     f"{cov['skipped']} skipped within the span)"
                     + (" although the checkpoint carried the global data cursor unchanged" if carried else "")
                     + ": the trainer's sampler reshuffles by world size or keeps a per-rank position; derive each "
                     "rank's share from one global cursor and an order that depends on the seed and epoch only")
    return found


def _xy(run: dict, steps: list[int], field: str) -> dict[str, list]:
    """One plotted line: the steps of ``steps`` the run logged ``field`` for."""
    pts = [(s, getattr(run[s], field)) for s in steps if s in run and getattr(run[s], field) is not None]
    return {"xs": [float(s) for s, _ in pts], "ys": [float(y) for _, y in pts]}


def _series(setup: Any, cmp: _Comparison) -> dict[str, Any]:
    """The figure's data (the report carries it, so the plot can be checked against it)."""
    base, res, ctl, cov, ctl_cov = cmp.base, cmp.res, cmp.ctl, cmp.cov, cmp.ctl_cov
    window_steps = setup.window_steps
    all_base = list(range(1, setup.switch_at + setup.window + 1))
    return {
        "loss": {"baseline": _xy(base, all_base, "loss"), "resumed": _xy(res, window_steps, "loss"),
                 "control": _xy(ctl, window_steps, "loss")},
        "grad_norm": {"baseline": _xy(base, all_base, "grad_norm"), "resumed": _xy(res, window_steps, "grad_norm"),
                      "control": _xy(ctl, window_steps, "grad_norm")},
        "control_coverage": {
            "repeated": {"xs": [float(s) for s in (ctl_cov or cov)["per_step"]["steps"]] if ctl_cov else [],
                         "ys": [float(x) for x in ctl_cov["per_step"]["repeated"]] if ctl_cov else []},
            "skipped": {"xs": [float(s) for s in ctl_cov["per_step"]["steps"]] if ctl_cov else [],
                        "ys": [float(x) for x in ctl_cov["per_step"]["skipped"]] if ctl_cov else []},
        },
    }


def _setup_section(setup: Any, switch: Any) -> dict[str, Any]:
    """The report's ``setup``: model, both recipes, data, randomness, and what --like copied."""
    kw, dropout, dataset_len, src_r = setup.model_kw, setup.dropout, setup.dataset_len, setup.recipe.source
    if setup.command.reference:
        model = {"n_heads": kw.get("n_heads", 2), "n_layers": kw.get("n_layers", 2), "dim": kw.get("dim", 32),
                 "vocab_size": kw.get("vocab_size", 64), "family": "reshard-reference-gpt"}
        randomness = (("dropout 0: no randomness depends on the topology (the data order comes from the "
                       "elastic sampler's global cursor, the weights from one seed)") if dropout == 0 else
                      (f"dropout {dropout}: masks come from per-dp-rank RNG streams that a new topology reseeds; "
                       "the trajectory cannot match beyond the first step"))
    else:
        model = {"family": "the trainer's own model (see trainer.command)"}
        randomness = ("the trainer's own: the rehearsal expects the same trajectory from the same seed, so "
                      "dropout and other per-rank randomness should be off (or keyed by sample, not by rank)")
    return {
        "model": model,
        "source_recipe": {"micro_batch": src_r.micro_batch, "grad_accum": src_r.grad_accum,
                          "dp": setup.src.dp, "global_batch": src_r.global_batch},
        "target_recipe": switch.after.to_dict(), "batch_kept": switch.plan.batch.kept,
        "recipe_choice": setup.recipe.to_dict(),
        "dataset_len": dataset_len, "seed": setup.seed, "warmup": setup.warmup, "total_steps": setup.steps,
        "dropout": dropout, "randomness": randomness,
        "epoch_boundary": f"dataset_len {dataset_len}: no run crosses an epoch boundary",
        "like": setup.copied,
    }


def _trainer_section(setup: Any, baseline: Any) -> dict[str, Any]:
    """The report's ``trainer``: the command template, each run's command line, and the checkpoint
    the trainer produced at the switch (what reshard converted)."""
    return {
        "command": setup.command.template, "builtin_reference": setup.command.reference, "contract": CONTRACT_DOC,
        "runs": {n: r.to_dict() for n, r in setup.runs.items()},
        "baseline_command": baseline.command,
        "baseline_reused_from": str(baseline.reused_from) if baseline.reused_from else None,
        "checkpoint": str(baseline.src_ckpt), "checkpoint_next": str(baseline.next_ckpt),
    }


def report(setup: Any, baseline: Any, switch: Any, cmp: _Comparison, *, tol: dict[str, float],
           derivation: dict[str, Any], diverged: list[str], exactness: dict[str, Any], control: dict[str, Any],
           errors: dict[str, str | None], diagnosis: list[str]) -> dict[str, Any]:
    """The report (rehearsal.json), in the order its readers expect; ``plot`` and ``timings_s`` come last."""
    plan, v, loss, gnorm, out = switch.plan, switch.verified, cmp.loss, cmp.gnorm, setup.out
    window_steps = setup.window_steps
    exit_code = 0 if not diverged else 1
    trajectory_fields = ("max_abs", "max_rel", "worst_step", "bitwise", "missing_steps")
    return {
        "rehearsal_version": 2,
        "from": layout_spec(setup.src), "to": layout_spec(setup.tgt), "steps": setup.steps,
        "switch_at": setup.switch_at, "window": setup.window, "window_steps": [window_steps[0], window_steps[-1]],
        "exit_code": exit_code, "verdict": "pass" if exit_code == 0 else "fail", "diverged": diverged,
        "diagnosis": diagnosis,
        "trainer": _trainer_section(setup, baseline),
        "exactness": exactness,
        "tolerances": tol, "tolerance_derivation": derivation,
        "setup": _setup_section(setup, switch),
        "plan": {"fingerprint": plan.fingerprint(), "batch": plan.batch.to_dict(),
                 "data": plan.data.to_dict() if plan.data else None,
                 "schedule": plan.schedule.to_dict() if plan.schedule else None,
                 "rng": plan.rng.to_dict() if plan.rng else None, "planned_rewrites": switch.planned},
        "verify": {"equal": v["equal"], "differences": [{"key": d["key"], "kind": d.get("kind")} for d in v["differences"]][:20],
                   "resumed_from": str(switch.resume_from), "hook": switch.hooked},
        "loss": {x: loss[x] for x in trajectory_fields},
        "grad_norm": {x: gnorm[x] for x in trajectory_fields},
        "throughput": {"baseline_median_tokens_per_s": compare.median_throughput(cmp.base, window_steps),
                       "resumed_median_tokens_per_s": compare.median_throughput(cmp.res, window_steps),
                       "control_median_tokens_per_s": compare.median_throughput(cmp.ctl, window_steps),
                       "note": "CPU gloo ranks on a shared machine: indicative only"},
        "coverage": {"resumed": cmp.cov, "control": cmp.ctl_cov},
        "moments": cmp.mom, "control": control,
        "per_step": {"loss": loss["per_step"], "grad_norm": gnorm["per_step"]},
        "series": _series(setup, cmp),
        "errors": errors,
        "paths": {"baseline": str(baseline.spec.ckpt_out if baseline.reused_from is None else baseline.src_ckpt.parent),
                  "checkpoint": str(baseline.src_ckpt), "converted": str(switch.dst),
                  "resumed": str(out / "resumed"), "control_checkpoint": control.get("checkpoint"),
                  "logs": {"baseline": str(baseline.log),
                           **{n: str(out / f"{n}.jsonl") for n in ("resumed", "control")}}},
    }
