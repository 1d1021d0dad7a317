"""rehearsal.md and rehearsal.png from the rehearsal report."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def _f(x: Any, spec: str = ".2e") -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return format(x, spec)


def rehearsal_panels(r: dict[str, Any]) -> tuple[list, str, list[str]]:
    """The rehearsal figure's panels, title and caption from the report: loss and grad norm
    (baseline, resumed, control) with the switch marked and a note when the resumed curve hides
    under the baseline, and the control's cumulative repeated/skipped sample ids, annotated
    where they explain the control's curve (a naive resume that re-reads samples it already
    trained on can look better for the wrong reason)."""
    from reshard.render.plot import Annotation, Panel, Series, overlap_note

    s, k = r["series"], r["switch_at"]
    frm, to = r["from"], r["to"]
    mark = [(k + 0.5, f"switch after step {k}")]  # the layouts are in the title
    ctl_cov = (r.get("coverage") or {}).get("control") or {}
    n_rep, n_skip = int(ctl_cov.get("repeated") or 0), int(ctl_cov.get("skipped") or 0)

    def panel(name: str, title: str, y_label: str, quantity: str) -> Panel:
        series = [Series(label, d["xs"], d["ys"], style="line+points" if label == "resumed" else "line")
                  for label, d in s[name].items()]
        by = {x.label: x for x in series}
        note = overlap_note(by["resumed"], by["baseline"], quantity) if {"resumed", "baseline"} <= set(by) else None
        p = Panel(title, series, vlines=mark, y_label=y_label, notes=[note] if note else [])
        ctl = by.get("control")
        if name == "loss" and ctl is not None and ctl.xs and (n_rep or n_skip):
            at = _first_coverage_step(ctl_cov) or ctl.xs[0]
            y = dict(zip(ctl.xs, ctl.ys)).get(float(at), ctl.ys[0])
            what = " and ".join(x for x in (f"repeats {n_rep} samples it already trained on" if n_rep else "",
                                            f"skips {n_skip} sample ids" if n_skip else "") if x)
            p.annotations.append(Annotation(float(at), float(y), f"control (naive resume) {what}:\n"
                                            "its loss is not comparable to the baseline's"))
        return p

    cov = s["control_coverage"]
    cov_panel = Panel("control (naive resume): sample ids repeated / skipped so far (cumulative)",
                      [Series(label, d["xs"], d["ys"], style="points") for label, d in cov.items()],
                      vlines=mark, y_label="sample ids", integer_y=True)
    rep = cov.get("repeated") or {"xs": [], "ys": []}
    if rep["xs"] and n_rep:
        cov_panel.annotations.append(Annotation(rep["xs"][-1], rep["ys"][-1], f"{n_rep} sample ids read twice"))
    if not any(d["xs"] for d in cov.values()):
        cov_panel.notes.append("no control run: nothing to count")
    panels = [panel("loss", "loss: baseline (uninterrupted), resumed (converted by reshard), control (naive resume)",
                    "loss", "loss"),
              panel("grad_norm", "grad norm", "L2 norm before clipping", "grad norm"),
              cov_panel]
    verdict = "PASS" if r["exit_code"] == 0 else "FAIL"
    tol, worst = r["tolerances"]["loss_rtol"], r["loss"]["max_rel"]
    title = (f"rehearsal {frm} \u2192 {to}: {verdict} (loss max rel diff {_f(worst)}, "
             f"tolerance {_f(tol)})")
    tr = r["trainer"]
    caption = [f"trainer: {tr['command']}", f"checkpoint (step {k}): {tr['checkpoint']}"]
    return panels, title, caption


def _first_coverage_step(cov: dict[str, Any]) -> float | None:
    """The first step at which the control had repeated or skipped an id (where to point)."""
    per = cov.get("per_step") or {}
    for st, a, b in zip(per.get("steps", []), per.get("repeated", []), per.get("skipped", [])):
        if a or b:
            return float(st)
    return None


def rehearsal_figure(r: dict[str, Any]):
    """The matplotlib Figure of the rehearsal (what ``render_png`` saves)."""
    from reshard.render.plot import build_figure

    panels, title, caption = rehearsal_panels(r)
    return build_figure(panels, title=title, caption=caption)


def render_png(path: Path, r: dict[str, Any]) -> dict:
    """Save the rehearsal figure at ``path`` (atomically); return what it drew (the report
    carries it, so the figure can be checked against the report's series)."""
    from reshard.render.plot import line_chart

    panels, title, caption = rehearsal_panels(r)
    return line_chart(path, panels, title=title, caption=caption)


def render_markdown(r: dict[str, Any]) -> str:
    k, w = r["switch_at"], r["window"]
    lines = [f"# Rehearsal {r['from']} -> {r['to']}: {'PASS' if r['exit_code'] == 0 else 'FAIL'} "
             f"(exit {r['exit_code']})", ""]
    if r["diverged"]:
        lines += ["## Diverged", ""] + [f"- {d}" for d in r["diverged"]] + [""]
    if r.get("diagnosis"):
        lines += ["## Diagnosis", ""] + [f"- {d}" for d in r["diagnosis"]] + [""]
    st, tr = r["setup"], r["trainer"]
    model = st["model"]
    what = (f"reference GPT ({model['n_layers']} layers, {model['n_heads']} heads, dim {model['dim']}) on CPU gloo ranks"
            if tr["builtin_reference"] else "the trainer's own model")
    lines += ["## Trainer", "",
              f"- command ({'built-in reference trainer; ' if tr['builtin_reference'] else ''}contract: "
              f"{tr['contract']}): `{tr['command']}`",
              f"- checkpoint it produced at step {k} (converted by reshard): `{tr['checkpoint']}`",
              f"- baseline run: `{tr['baseline_command']}`"
              + (f" (reused from {tr['baseline_reused_from']})" if tr["baseline_reused_from"] else "")]
    lines += [f"- {name} run: `{x['command']}` ({x['seconds']} s, exit {x['returncode']})"
              for name, x in tr["runs"].items() if name != "baseline"]
    lines += ["", "## Setup", "",
              f"- {what}; {r['steps']} steps, switch at step {k}, compared over steps {k + 1}..{k + w}",
              f"- batch: source {st['source_recipe']['micro_batch']} x {st['source_recipe']['grad_accum']} x dp "
              f"{st['source_recipe']['dp']} = {st['source_recipe']['global_batch']}; target (plan) "
              f"{st['target_recipe']['micro_batch']} x {st['target_recipe']['grad_accum']} x dp "
              f"{st['target_recipe']['dp']} = {st['target_recipe']['global_batch']}",
              f"- recipe: {st['recipe_choice']['note']}",
              f"- randomness: {st['randomness']}",
              f"- data: {st['epoch_boundary']}"]
    if st.get("like") and st["like"].get("slice_start"):  # your trainer resumed a slice of the real checkpoint
        ss = st["like"]["slice_start"]
        lines.append(f"- started from a slice of the real checkpoint, {ss['from']} ({ss['slice']['description']}, "
                     f"step {ss['step']}): {ss['how']}")
    elif st.get("like"):
        lines.append(f"- copied from the real checkpoint {st['like']['from']}: "
                     + "; ".join(f"{n}: {st['like'][n]}" for n in ("model", "batch", "schedule", "data")
                                 if st["like"].get(n)))
    lines += ["", "## Exactness", "", r["exactness"]["statement"], "",
              "## Results", "",
              "| check | value | tolerance |", "|---|---|---|",
              f"| loss, max rel diff (step {r['loss']['worst_step']}) | {_f(r['loss']['max_rel'])} "
              f"(abs {_f(r['loss']['max_abs'])}) | {_f(r['tolerances']['loss_rtol'])} |",
              f"| grad norm, max rel diff (step {r['grad_norm']['worst_step']}) | {_f(r['grad_norm']['max_rel'])} "
              f"| {_f(r['tolerances']['grad_norm_rtol'])} |"]
    m = r["moments"]
    if m:
        lines.append(f"| Adam moments after step {k + 1}, max rel diff ({m['worst_param']}) | {_f(m['max_rel'])} "
                     f"| {_f(r['tolerances']['moment_rtol'])} |")
        lines.append(f"| optimizer step counters equal | {m['step_counters_equal']} | equal |")
    c = r["coverage"]["resumed"]
    lines += [f"| coverage (resumed): repeated / skipped ids | {c['repeated']} / {c['skipped']} | 0 / 0 |",
              f"| converted state equals source (verify) | {r['verify']['equal']} | equal |",
              f"| median tokens/s baseline / resumed | {_f(r['throughput']['baseline_median_tokens_per_s'], '.0f')} / "
              f"{_f(r['throughput']['resumed_median_tokens_per_s'], '.0f')} | (informative) |", "",
              f"Tolerances: {r['tolerance_derivation']['how']}.", ""]
    ctl = r["control"]
    lines += ["## Control (naive resume)", "", ctl["how"] + ".", ""]
    if ctl.get("summary"):
        lines += [ctl["summary"] + ".", ""]
    if ctl.get("error"):
        lines += [f"control run error: {ctl['error']}", ""]
    lines += ["## Per step (window)", "", "| step | baseline loss | resumed loss | rel diff | bitwise |",
              "|---|---|---|---|---|"]
    for p in r["per_step"]["loss"]:
        lines.append(f"| {p['step']} | {p['baseline']:.7f} | {p['run']:.7f} | {_f(p['rel'])} | {p['bitwise']} |")
    lines += ["", f"Chart: rehearsal.png ({r['plot']['width']}x{r['plot']['height']}).", ""]
    return "\n".join(lines)


def render_rehearsal(r: dict[str, Any]) -> str:
    """A terminal summary; the full story is in rehearsal.md next to the figure."""
    k, w = r["switch_at"], r["window"]
    c = r["coverage"]["resumed"]
    lines = [f"rehearsal   {r['from']} -> {r['to']}: {'PASS' if r['exit_code'] == 0 else 'FAIL'}",
             f"trainer     {r['trainer']['command']}",
             f"checkpoint  {r['trainer']['checkpoint']} (step {k}, converted by reshard)",
             f"recipe      {r['setup']['recipe_choice']['note']}",
             f"window      steps {k + 1}..{k + w}",
             f"loss        max rel diff {_f(r['loss']['max_rel'])} (tolerance {_f(r['tolerances']['loss_rtol'])})",
             f"grad norm   max rel diff {_f(r['grad_norm']['max_rel'])} (tolerance {_f(r['tolerances']['grad_norm_rtol'])})"]
    if r.get("moments"):
        lines.append(f"moments     max rel diff {_f(r['moments']['max_rel'])} after step {k + 1} "
                     f"(tolerance {_f(r['tolerances']['moment_rtol'])})")
    lines.append(f"coverage    {c['repeated']} repeated, {c['skipped']} skipped")
    lines.append(f"exactness   {r['exactness']['statement']}")
    if r["control"].get("summary"):
        lines.append(f"control     {r['control']['summary']}")
    for d in r["diverged"]:
        lines.append(f"DIVERGED    {d}")
    for d in r.get("diagnosis") or []:
        lines.append(f"DIAGNOSIS   {d}")
    out = r.get("out")
    if out:
        lines.append(f"report      {out}/rehearsal.md, figure {out}/rehearsal.png")
    return "\n".join(lines)
