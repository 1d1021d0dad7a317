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
    under the baseline (in the title's metric: one metric per figure), and the control's
    cumulative repeated/skipped sample ids, annotated where they explain the control's curve
    (a naive resume that re-reads samples it already trained on can look better for the wrong
    reason); the arrow points where the control is apart from the others, not into the knot
    the three curves can make at the switch."""
    from reshard.render.plot import Annotation, Panel, Series, max_rel_diff, overlaps

    s, k = r["series"], r["switch_at"]
    frm, to = r["from"], r["to"]
    mark = [(k + 0.5, f"switch after step {k}")]  # the layouts are in the title
    ctl_cov = (r.get("coverage") or {}).get("control") or {}
    n_rep, n_skip = int(ctl_cov.get("repeated") or 0), int(ctl_cov.get("skipped") or 0)

    def panel(name: str, title: str, y_label: str, quantity: str) -> Panel:
        series = [Series(label, d["xs"], d["ys"], style="line+points" if label == "resumed" else "line")
                  for label, d in s[name].items()]
        by = {x.label: x for x in series}
        notes = []
        if {"resumed", "baseline"} <= set(by) and overlaps(by["resumed"], by["baseline"]):
            # in the title's metric (the one the verdict compares with its tolerance), not an absolute gap
            gap = _max_rel(r.get(name) or {}) or max_rel_diff(by["resumed"], by["baseline"])
            if gap is not None:
                notes.append(f"resumed overlaps baseline: {quantity} max rel diff {_f(gap[0])} (step {gap[1]})")
        p = Panel(title, series, vlines=mark, y_label=y_label, notes=notes)
        ctl = by.get("control")
        if name == "loss" and ctl is not None and ctl.xs and (n_rep or n_skip):
            at = _where_apart(ctl, [by[n] for n in ("baseline", "resumed") if n in by],
                              _first_coverage_step(ctl_cov) or ctl.xs[0])
            y = dict(zip(ctl.xs, ctl.ys)).get(float(at), ctl.ys[0])
            what = " and ".join(x for x in (f"repeats {n_rep} samples it already trained on" if n_rep else "",
                                            f"skips {n_skip} sample ids" if n_skip else "") if x)
            p.annotations.append(Annotation(float(at), float(y), f"control (naive resume)\n{what}:\n"
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
    caption = _caption(r)
    return panels, title, caption


SEPARATE_FRAC = 0.08  # the control is "apart" where it is this fraction of the panel's y span off the others


def _max_rel(section: dict[str, Any]) -> tuple[float, int] | None:
    """(max_rel, worst_step) as the judge reported them (the title's figure), when it did."""
    if section.get("max_rel") is None or section.get("worst_step") is None:
        return None
    return float(section["max_rel"]), int(section["worst_step"])


def _where_apart(ctl: Any, others: list[Any], start: float) -> float:
    """The step the control's annotation points at: the first from ``start`` on where the control
    is visibly apart from every other curve (``SEPARATE_FRAC`` of the y span), else where it is
    furthest from them. Right at the switch the three curves can sit on each other, and an
    arrow into that knot shows nothing."""
    ys = [float(y) for c in [ctl, *others] for y in c.ys if math.isfinite(y)]
    span = (max(ys) - min(ys)) if ys else 0.0
    rows = [dict(zip(map(float, c.xs), map(float, c.ys))) for c in others]
    gaps = [(min((abs(float(y) - o[float(x)]) for o in rows if float(x) in o), default=math.inf), float(x))
            for x, y in zip(ctl.xs, ctl.ys) if float(x) >= start and math.isfinite(y)]
    if not gaps:
        return start
    apart = [x for g, x in gaps if g >= SEPARATE_FRAC * span]
    return apart[0] if apart else max(gaps)[1]


def _caption(r: dict[str, Any]) -> list[str]:
    """The footer: the resumed run's command as it ran (placeholders filled; the interpreter by
    its name and paths relative to the rehearsal's directory, named once), the checkpoint it
    resumed, and what the title's metric is. The report's ``trainer.command`` is the template
    with ``{placeholders}``, which is not a command anyone can run."""
    import os
    import shlex

    tr, k = r["trainer"], r["switch_at"]
    log = ((r.get("paths") or {}).get("logs") or {}).get("resumed")
    out = os.path.dirname(log) if log else None
    run = (tr.get("runs") or {}).get("resumed") or {}
    label, command = "resumed run", run.get("command")
    if not command and tr.get("baseline_command"):
        label, command = "baseline run", tr["baseline_command"]
    if not command:  # an old report without run records: the template is all there is, and it is named so
        return [f"trainer command template: {tr['command']}", f"checkpoint (step {k}): {tr['checkpoint']}"]
    try:
        words = shlex.split(command)
    except ValueError:
        words = []
    if words:
        i = next((j for j, w in enumerate(words) if "=" not in w.split("/", 1)[0]), 0)  # after VAR=value words
        if "/" in words[i] and os.path.basename(words[i]).startswith("python"):
            words[i] = os.path.basename(words[i])
        if out:
            words = [_relative(w, out) for w in words]
        command = shlex.join(words)
    ckpt = _relative(str(tr["checkpoint"]), out) if out else tr["checkpoint"]
    conv = (r.get("paths") or {}).get("converted")
    into = f", converted by reshard into {_relative(str(conv), out) if out else conv}" if conv else ""
    where = f", in {out}" if out else ""
    return [f"trainer: {command}", f"({label}{where}); checkpoint (step {k}): {ckpt}{into}",
            "rel diff: |resumed - baseline| / |baseline| at a step; the verdict compares its maximum over "
            "the window with the tolerance"]


def _relative(word: str, out: str) -> str:
    """``word`` with a leading ``out/`` (or ``--flag=out/``) dropped."""
    pre, sep, path = word.rpartition("=") if word.startswith("-") and "=" in word else ("", "", word)
    if path == out:
        path = "."
    elif path.startswith(out.rstrip("/") + "/"):
        path = path[len(out.rstrip("/")) + 1:]
    return pre + sep + path


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
