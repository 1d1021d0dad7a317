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


def render_png(path: Path, r: dict[str, Any]) -> dict:
    """Three panels: loss, grad norm (baseline, resumed, control) with the switch marked, and
    the control's cumulative repeated/skipped sample ids. Returns what line_chart drew."""
    from reshard.render.plot import Panel, Series, line_chart

    s = r["series"]
    k = r["switch_at"]
    frm, to = r["from"].replace(",", " "), r["to"].replace(",", " ")  # the chart font has no comma
    mark = [(k + 0.5, f"switch at step {k}: {frm} -> {to}")]
    colors = {"baseline": (31, 119, 180), "resumed": (44, 160, 44), "control": (214, 39, 40),
              "repeated": (214, 39, 40), "skipped": (148, 103, 189)}

    def panel(name: str, title: str, y_label: str, style: str = "line") -> Panel:
        return Panel(title, [Series(label, d["xs"], d["ys"], color=colors.get(label),
                                    style="points" if label == "resumed" else style)
                             for label, d in s[name].items()], vlines=mark, y_label=y_label)

    panels = [panel("loss", "loss: baseline (uninterrupted) / resumed (reshard) / control (naive resume)", "loss"),
              panel("grad_norm", "grad norm", "L2 norm before clipping"),
              panel("control_coverage", "control: sample ids repeated / skipped so far (cumulative)", "ids",
                    style="points")]
    verdict = "PASS" if r["exit_code"] == 0 else "FAIL"
    drawn = line_chart(path, panels, title=f"rehearsal {frm} -> {to}: {verdict}")
    tr = r["trainer"]
    caption = [f"trainer: {tr['command']}", f"checkpoint (step {k}): {tr['checkpoint']}"]
    return _add_caption(path, drawn, caption)


_PLAIN = str.maketrans({",": " ", "{": "(", "}": ")", "[": "(", "]": ")", "'": "", '"': "", "`": ""})


def _add_caption(path: Path, drawn: dict, caption: list[str]) -> dict:
    """Append ``caption`` under the chart, wrapped to its width (the chart font has no comma or
    braces: they are drawn as spaces and parentheses). Returns ``drawn`` with the new height and
    the caption as written (the report checks the figure against it)."""
    import numpy as np

    from reshard.render.plot import draw_text, read_png, text_width, write_png

    img = read_png(path)
    width = img.shape[1]
    per_line = max(20, (width - 16) // text_width("x"))
    rows: list[str] = []
    for text in caption:
        text = text.translate(_PLAIN)
        while text:
            rows.append(text[:per_line])
            text = text[per_line:]
    footer = np.full((12 * len(rows) + 8, width, 3), 255, dtype=np.uint8)
    for i, row in enumerate(rows):
        draw_text(footer, 8, 4 + 12 * i, row)
    out = np.concatenate([img, footer], axis=0)
    write_png(path, out)
    return {**drawn, "height": int(out.shape[0]), "caption": rows}


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
    if st.get("like"):
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
