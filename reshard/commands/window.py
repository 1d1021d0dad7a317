"""`reshard window`: judge the verification window after a real topology transition, from two step logs.

``judge(before, after, manifest=...)`` reads the step log of the run before the switch and the
one after (``formats/step_log.md``) and the manifest, hands them to the window's judge
(`reshard.rehearsal.window.judge_window`, beside the rehearsal's judge: the switch step, the loss,
grad-norm, throughput and coverage checks and the verdict are its, the result's fields too) and,
with ``out``, writes ``window.json`` (the result plus ``plot``, the description of what the
figure draws), ``window.md`` and ``window.png``. This module only orchestrates.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from reshard.render.window import window_markdown, window_title
from reshard.rehearsal.window import judge_window
from reshard.semantics import manifest as mf
from reshard.errors import BadInput
from reshard.safefs import loads_json
from reshard.semantics.steplog import StepRecord, read_steplog


# ----------------------------------------------------------------------------- inputs
def _read_manifest(path: Path) -> mf.Manifest:
    path = Path(path)
    if path.is_dir():
        m = mf.read_manifest(path)
        if m is None:
            raise BadInput("no manifest.json in this checkpoint", where=str(path),
                           hint="Pass the converted checkpoint (or its manifest.json), or omit --manifest.")
        return m
    try:
        data = loads_json(path.read_bytes(), where=str(path), what="manifest")  # nesting bounded (exit 2)
    except OSError as exc:
        raise BadInput(f"cannot read manifest: {exc}", where=str(path)) from exc
    return mf.Manifest.from_dict(data, source=str(path))


# ----------------------------------------------------------------------------- judge
def judge(before: Path, after: Path, *, manifest: Path | None = None, out: Path | None = None,
          loss_rtol: float | None = None, gradnorm_factor: float = 3.0, throughput_drop: float = 0.5,
          trend_steps: int = 10) -> dict[str, Any]:
    """Judge the window after a transition (see the module docstring); exit_code 0 ok, 1 a check failed."""
    b_log, a_log = read_steplog(before), read_steplog(after)
    m = _read_manifest(Path(manifest)) if manifest is not None else None
    result, pre, post = judge_window(b_log, a_log, m, manifest_source=None if manifest is None else str(manifest),
                                     where=str(before), loss_rtol=loss_rtol, gradnorm_factor=gradnorm_factor,
                                     throughput_drop=throughput_drop, trend_steps=trend_steps)
    if out is not None:
        write_outputs(result, pre, post, Path(out))
    return result


# ----------------------------------------------------------------------------- outputs
def figure_panels(result: dict, pre: list[StepRecord], post: list[StepRecord]):
    from reshard.render.plot import Panel, Series

    at = result["transition"]["at_step"]
    label = f"switch {result['transition']['from_world_size'] or '?'}->{result['transition']['to_world_size'] or '?'}"
    vl = [(at + 0.5, label)]
    pick = lambda recs, f: ([float(r.step) for r in recs if f(r) is not None],  # noqa: E731
                            [float(f(r)) for r in recs if f(r) is not None])
    trend = result["loss"]["trend_line"]
    panels = [Panel("loss", [Series("before", *pick(pre, lambda r: r.loss)), Series("after", *pick(post, lambda r: r.loss)),
                             Series("trend", trend["steps"], trend["loss"])], vl),
              Panel("grad norm", [Series("before", *pick(pre, lambda r: r.grad_norm)),
                                  Series("after", *pick(post, lambda r: r.grad_norm))], vl),
              Panel("tokens/s", [Series("before", *pick(pre, lambda r: r.tokens_per_s)),
                                 Series("after", *pick(post, lambda r: r.tokens_per_s))], vl)]
    cov = result["coverage"]
    steps = [float(r.step) for r in pre + post]
    rep, skp = cov.get("repeated_per_step", {}), cov.get("skipped_per_step", {})
    panels.append(Panel("coverage: ids per step", [
        Series("repeated", steps, [float(rep.get(int(s), 0)) for s in steps], style="points"),
        Series("skipped", steps, [float(skp.get(int(s), 0)) for s in steps], style="points")], vl, integer_y=True,
        y_range=(-0.5, max([1.0] + [float(v) for v in list(rep.values()) + list(skp.values())]) * 1.1)))
    return panels


def write_outputs(result: dict, pre: list[StepRecord], post: list[StepRecord], out: Path) -> None:
    from reshard.render.plot import line_chart

    out.mkdir(parents=True, exist_ok=True)
    fig, md, js = out / "window.png", out / "window.md", out / "window.json"
    result["plot"] = line_chart(fig, figure_panels(result, pre, post), title=window_title(result))
    result["figure"], result["report"] = str(fig), str(md)
    md.write_text(window_markdown(result), encoding="utf-8")
    js.write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")


__all__ = ["judge", "figure_panels", "write_outputs"]
