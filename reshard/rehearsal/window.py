"""The verification window after a real topology transition judged from two step logs: the checks and the verdict.

Beside the rehearsal's judge (`reshard.rehearsal.judge`), which compares a rehearsal's runs
over its window, this module judges the window of a real switch from the logs a training job
wrote: `judge_window` takes the step records of the run before the switch and of the one after
(``formats/step_log.md``) and the manifest, if any, and returns the result; the command
(`reshard.commands.window`) reads the files, calls it and writes the outputs. It finds the switch step (the last "transition" event
of the manifest's lineage, else the first step of AFTER minus one) and checks:

loss continuity
    A straight line is fitted (least squares on step) to the last ``trend_steps`` losses
    before the switch and extrapolated. The first post-switch loss fails when it deviates
    from the prediction by more than ``max(LOSS_K * se, loss_rtol * |prediction|)``, where
    ``se`` is the fit's prediction standard error (residual std x sqrt(1 + 1/n + (x0-mean)^2/Sxx)).
    ``LOSS_K = 4``: about 1 in 16 000 for Gaussian noise. The residual std of a short window
    underestimates batch-to-batch noise (on the reference model a normal continued run's
    first step sits ~2% above the line, ~7 residual stds), hence the relative floor;
    ``loss_rtol=None`` means ``DEFAULT_LOSS_RTOL = 0.05``: a continued run passes, a +10% jump fails.
    Independently, a post-switch step whose loss *rises* over the previous step by more than
    ``JUMP_FACTOR = 2`` x the largest step-to-step change in the trend window fails.
grad norm
    A post-switch grad norm above ``gradnorm_factor`` x the median of the trend window fails.
throughput
    Median tokens/s after (without the first, cold step) over median before (trend window).
    A drop beyond ``throughput_drop`` is a *warning* only: a smaller world is expected to be
    slower; the per-rank ratio (normalised by world size) is reported too.
coverage
    From ``sample_ids``: the logs are walked in order and split into epochs by count (every
    epoch is ``dataset_len`` samples: the manifest's ``data.dataset_len`` or max id + 1); an id
    consumed twice in one epoch is *repeated*; when an epoch whose start the logs saw ends,
    the ids it never consumed are *skipped* (reported at the step that ended it: with a
    shuffled order a skip is only visible then). From ``cursor`` + ``epoch`` instead: the
    cursor must advance by the batch (the median advance of each log) on every step; less is
    a repeat, more a skip, reported at that step. Any repeat or skip fails.

Result: ``{"ok", "exit_code", "transition", "checks": [{"name", "ok", "severity", "detail",
"steps"}], "loss", "gradnorm", "coverage", "throughput", "figure", "report"}``; checks of
severity "warning" never fail the window (the command adds ``figure`` and ``report`` when it
writes them). Plain data and numpy: no torch, so ``reshard window`` runs without it.
"""

from __future__ import annotations

import math
from statistics import median
from typing import Any

import numpy as np

from reshard.errors import BadInput
from reshard.semantics import manifest as mf
from reshard.semantics.steplog import StepRecord
from reshard.units import consecutive_runs

LOSS_K = 4.0
DEFAULT_LOSS_RTOL = 0.05
JUMP_FACTOR = 2.0
PREDICT_STEPS = 5  # post-switch steps the trend line is extended over in the figure


# ----------------------------------------------------------------------------- the switch
def _transition(m: mf.Manifest | None, source: str | None, pre_ws, post_ws, first_after: int) -> dict:
    if m is None:
        return {"source": "logs", "manifest": None, "at_step": first_after - 1, "kind": None, "policies": {},
                "from": None, "to": None, "from_world_size": pre_ws, "to_world_size": post_ws}
    events = [e for e in m.lineage if e.event == "transition"]
    if not events:
        return {"source": "manifest (no transition event; its step)", "manifest": source, "at_step": m.step,
                "kind": m.continuity, "policies": {}, "from": None, "to": m.topology.to_dict(),
                "from_world_size": pre_ws, "to_world_size": m.topology.world_size}
    e = events[-1]
    at = e.at_step if e.at_step is not None else (m.step if m.step is not None else first_after - 1)
    return {"source": "manifest lineage", "manifest": source, "at_step": at, "kind": e.kind,
            "policies": dict(e.policies), "from": e.from_.to_dict() if e.from_ else None,
            "to": e.to.to_dict() if e.to else None,
            "from_world_size": e.from_.world_size if e.from_ else pre_ws,
            "to_world_size": e.to.world_size if e.to else post_ws}


def _check(name: str, ok: bool, detail: str, steps: list[int] | None = None, severity: str = "error") -> dict:
    return {"name": name, "ok": bool(ok), "severity": severity, "detail": detail,
            "steps": None if not steps else [min(steps), max(steps)]}


def _finite(v) -> float | None:
    return float(v) if v is not None and math.isfinite(v) else None


def _ranges(values: list[int]) -> str:
    """[1, 2, 3, 7] -> '1..3, 7' (sorted, deduplicated)."""
    out = [str(a) if a == b else f"{a}..{b}" for a, b in consecutive_runs(sorted(set(values)))]
    return ", ".join(out if len(out) <= 8 else out[:8] + [f"... ({len(set(values))} in all)"])


def _steps_text(steps: list[int]) -> str:
    lo, hi = min(steps), max(steps)
    return f"step {lo}" if lo == hi else f"steps {lo}-{hi}"


# ----------------------------------------------------------------------------- checks
def _loss(pre: list[StepRecord], post: list[StepRecord], trend_steps: int, rtol: float) -> tuple[dict, list[dict]]:
    tail = [r for r in pre[-trend_steps:] if math.isfinite(r.loss)]
    xs, ys = np.array([r.step for r in tail], float), np.array([r.loss for r in tail], float)
    n = len(tail)
    if n >= 3:
        slope, icpt = np.polyfit(xs, ys, 1)
        sigma = float(np.sqrt(((ys - (slope * xs + icpt)) ** 2).sum() / (n - 2)))
        sxx = float(((xs - xs.mean()) ** 2).sum())
    else:  # too short for a line: flat at the last loss, no noise estimate
        slope, icpt, sigma, sxx = 0.0, float(ys[-1]) if n else float("nan"), 0.0, 1.0
    predict = lambda s: float(slope * s + icpt)  # noqa: E731
    se = lambda s: sigma * math.sqrt(1 + 1 / max(n, 1) + ((s - xs.mean()) ** 2 / sxx if n else 0))  # noqa: E731
    first = post[0]
    pred = predict(first.step)
    tol = max(LOSS_K * se(first.step), rtol * abs(pred))
    dev = first.loss - pred
    ok = math.isfinite(first.loss) and abs(dev) <= tol
    checks = [_check("loss continuity", ok,
                     f"first loss after the switch {first.loss:.6g} at step {first.step}, trend of the last {n} "
                     f"steps predicts {pred:.6g} (deviation {dev:+.4g}, tolerance {tol:.4g} = max({LOSS_K:g} x "
                     f"{se(first.step):.3g} prediction s.e., {rtol:g} x |prediction|))",
                     None if ok else [first.step])]
    diffs = np.abs(np.diff(ys)) if n >= 2 else np.array([])
    max_change = float(diffs.max()) if diffs.size else 0.0
    jump_tol = JUMP_FACTOR * max_change if max_change > 0 else rtol * abs(pred)
    jumps, prev = [], pre[-1].loss
    for r in post:
        if not math.isfinite(r.loss) or (math.isfinite(prev) and r.loss - prev > jump_tol):
            jumps.append(r)
        prev = r.loss
    checks.append(_check(
        "loss jumps", not jumps,
        (f"no post-switch step raises the loss by more than {jump_tol:.4g} ({JUMP_FACTOR:g} x the largest "
         f"step-to-step change {max_change:.4g} before the switch)") if not jumps else
        "loss jumps at " + ", ".join(f"step {r.step} ({r.loss:.6g})" for r in jumps[:6])
        + f" exceed {jump_tol:.4g} ({JUMP_FACTOR:g} x the largest step-to-step change {max_change:.4g} before "
          f"the switch) -- " + _steps_text([r.step for r in jumps]), [r.step for r in jumps]))
    horizon = [r.step for r in post[:PREDICT_STEPS]]
    info = {"trend_steps": [int(xs[0]), int(xs[-1])] if n else None, "slope": float(slope), "intercept": float(icpt),
            "residual_std": sigma, "k": LOSS_K, "rtol": rtol, "first_step": first.step,
            "first_loss": _finite(first.loss), "predicted": _finite(pred), "deviation": _finite(dev),
            "tolerance": _finite(tol), "max_step_change_before": max_change, "jump_tolerance": jump_tol,
            "jump_factor": JUMP_FACTOR, "jumps": [r.step for r in jumps],
            "trend_line": {"steps": [float(s) for s in list(xs) + horizon],
                           "loss": [predict(s) for s in list(xs) + horizon]}}
    return info, checks


def _gradnorm(pre, post, trend_steps: int, factor: float) -> tuple[dict, list[dict]]:
    base = [r.grad_norm for r in pre[-trend_steps:] if r.grad_norm is not None and math.isfinite(r.grad_norm)]
    after = [r for r in post if r.grad_norm is not None]
    if not base or not after:
        return {"median_before": None}, [_check("grad norm", True, "grad_norm not logged on both sides; not checked")]
    med = median(base)
    bad = [r for r in after if not math.isfinite(r.grad_norm) or r.grad_norm > factor * med]
    detail = (f"max after the switch {max(r.grad_norm for r in after):.4g} <= {factor:g} x median before {med:.4g}"
              if not bad else f"grad norm above {factor:g} x median before ({med:.4g}) at "
              + ", ".join(f"step {r.step} ({r.grad_norm:.4g})" for r in bad[:6]) + f" -- {_steps_text([r.step for r in bad])}")
    return ({"median_before": med, "limit": factor * med, "max_after": _finite(max(r.grad_norm for r in after)),
             "flagged": [r.step for r in bad]}, [_check("grad norm", not bad, detail, [r.step for r in bad])])


def _throughput(pre, post, trend_steps: int, drop: float, ws_before, ws_after) -> tuple[dict, list[dict]]:
    b = [r.tokens_per_s for r in pre[-trend_steps:] if r.tokens_per_s is not None]
    a_recs = post[1:] if len(post) > 2 else post  # the first step after a restart is cold
    a = [r.tokens_per_s for r in a_recs if r.tokens_per_s is not None]
    if not b or not a:
        return {"ratio": None}, [_check("throughput", True, "tokens_per_s not logged on both sides; not checked",
                                        severity="warning")]
    mb, ma = median(b), median(a)
    ratio = ma / mb if mb > 0 else None
    per_rank = ratio * ws_before / ws_after if ratio is not None and ws_before and ws_after else None
    ok = ratio is None or ratio >= 1 - drop
    detail = (f"median tokens/s {ma:.4g} after vs {mb:.4g} before: ratio {ratio:.3g}" if ratio is not None else
              "median tokens/s before is 0") + (f", per rank {per_rank:.3g} (world {ws_before} -> {ws_after})"
                                                if per_rank is not None else "")
    if not ok:
        detail += f"; dropped by more than {drop:g} (a warning: a smaller world is expected to be slower)"
    return ({"median_before": mb, "median_after": ma, "ratio": ratio, "per_rank_ratio": per_rank,
             "world_size_before": ws_before, "world_size_after": ws_after, "drop_limit": drop},
            [_check("throughput", ok, detail, None if ok else [a_recs[0].step, a_recs[-1].step], "warning")])


def _coverage_ids(seq: list[StepRecord], n: int, start: int) -> dict:
    """Walk ``seq`` (sample_ids on every record); ``start`` = samples consumed before seq[0]."""
    epoch, c, seen, observed = start // n, start % n, set(), start % n == 0
    rep: dict[int, list[int]] = {}   # step -> repeated ids
    skip: dict[int, list[int]] = {}  # step that ended the epoch -> ids never consumed
    for r in seq:
        ids = list(r.sample_ids or [])
        if c + len(ids) > n:  # the step crosses the epoch end: the unseen fill it, the rest is the next epoch
            unseen = sorted(set(ids) - seen)[: n - c]
            rest = list(ids)
            for i in unseen:
                rest.remove(i)
            seen.update(unseen)
            head, c = [], n
        else:
            head, rest = ids, []
        for i in head:
            if i in seen:
                rep.setdefault(r.step, []).append(i)
            seen.add(i)
        c += len(head)
        if c >= n:
            if observed and len(seen) < n:
                skip[r.step] = sorted(set(range(n)) - seen)
            epoch, c, seen, observed = epoch + 1, 0, set(), True
            for i in rest:
                if i in seen:
                    rep.setdefault(r.step, []).append(i)
                seen.add(i)
            c = len(rest)
    return _coverage_result("ids", rep, skip, n, "samples")


def _coverage_cursor(pre, post, n: int | None) -> dict:
    def batch(recs):  # median advance between consecutive steps of one epoch
        d = [b.cursor - a.cursor for a, b in zip(recs, recs[1:]) if b.step == a.step + 1 and b.epoch == a.epoch]
        return int(round(median(d))) if d else None

    b_pre, b_post = batch(pre), batch(post)
    b_pre, b_post = b_pre or b_post, b_post or b_pre
    if n is None and len({r.epoch for r in pre + post}) > 1:  # infer the epoch length at a crossing
        for recs, b in ((pre, b_pre), (post, b_post)):
            crossing = [(a, c) for a, c in zip(recs, recs[1:]) if c.step == a.step + 1 and c.epoch == a.epoch + 1]
            if crossing and b:
                n = crossing[0][0].cursor + b - crossing[0][1].cursor
                break
        else:
            raise BadInput("the cursors span several epochs but the dataset length is unknown",
                           hint="Pass --manifest (its data.dataset_len).")

    def pos(r):
        return r.epoch * (n or 0) + r.cursor

    rep: dict[int, list[int]] = {}
    skip: dict[int, list[int]] = {}
    if b_pre:
        seq = [(r, b_pre) for r in pre] + [(r, b_post) for r in post]
        for (a, _), (r, b) in zip(seq, seq[1:]):
            expect = pos(a) + (r.step - a.step) * b
            got, should = pos(r), expect - b  # this step took [got - b, got), it should have started at ``should``
            if got < expect:
                rep[r.step] = list(range(got - b, min(should, got)))
            elif got > expect:
                skip[r.step] = list(range(should, got - b))
    return _coverage_result("cursor", rep, skip, n, "stream positions")


def _coverage_result(mode, rep, skip, n, what) -> dict:
    ranges = [{"kind": "repeated", "steps": [s, s], "ids": _ranges(v), "count": len(v)} for s, v in sorted(rep.items())]
    ranges += [{"kind": "skipped", "steps": [s, s], "ids": _ranges(v), "count": len(v)} for s, v in sorted(skip.items())]
    return {"mode": mode, "dataset_len": n, "unit": what, "repeated": sum(len(v) for v in rep.values()),
            "skipped": sum(len(v) for v in skip.values()), "ranges": ranges,
            "repeated_per_step": {s: len(v) for s, v in rep.items()},
            "skipped_per_step": {s: len(v) for s, v in skip.items()}, "_rep": rep, "_skip": skip}


def _coverage(pre, post, m: mf.Manifest | None, at_step: int) -> tuple[dict, list[dict]]:
    seq = pre + post
    n = m.data.dataset_len if m is not None else None
    if all(r.sample_ids is not None for r in seq):
        n = n or max((max(r.sample_ids) for r in seq if r.sample_ids), default=-1) + 1  # type: ignore[arg-type]
        if m is not None:  # anchor on the manifest's cursor at the switch
            start = m.data.epoch * n + m.data.cursor - sum(len(r.sample_ids or []) for r in pre)
        else:
            start = (pre[0].step - 1) * len(pre[0].sample_ids or [])
        cov = _coverage_ids(seq, max(n, 1), max(start, 0))
    elif all(r.cursor is not None for r in seq):
        cov = _coverage_cursor(pre, post, n)
    else:
        return ({"mode": None, "repeated": 0, "skipped": 0, "ranges": []},
                [_check("coverage", True, "neither sample_ids nor cursor on every step; not checked", severity="warning")])
    rep, skip = cov.pop("_rep"), cov.pop("_skip")
    if not rep and not skip:
        return cov, [_check("coverage", True, f"no {cov['unit']} repeated or skipped across {len(seq)} steps "
                            f"(dataset length {n}, {cov['mode']})")]
    parts = [f"{cov['unit']} {_ranges(v)} repeated at step {s}" for s, v in sorted(rep.items())]
    parts += [f"{cov['unit']} {_ranges(v)} skipped (never consumed before the epoch ended at step {s})"
              for s, v in sorted(skip.items())]
    steps = sorted(set(rep) | set(skip))
    detail = (f"{cov['repeated']} repeated, {cov['skipped']} skipped at {_steps_text(steps)}: " + "; ".join(parts))
    return cov, [_check("coverage", False, detail, steps)]


# ----------------------------------------------------------------------------- the verdict
def judge_window(b_log: list[StepRecord], a_log: list[StepRecord], m: mf.Manifest | None, *,
                 manifest_source: str | None = None, where: str | None = None, loss_rtol: float | None = None,
                 gradnorm_factor: float = 3.0, throughput_drop: float = 0.5,
                 trend_steps: int = 10) -> tuple[dict[str, Any], list[StepRecord], list[StepRecord]]:
    """The window judged (see the module docstring): the result (exit_code 0 ok, 1 a check failed, ``figure``
    and ``report`` None) and the records before and after the switch that it judged. ``manifest_source``
    names the manifest in the result, ``where`` the before-log in a refusal."""
    pre_ws, post_ws = b_log[-1].world_size, a_log[0].world_size
    tr = _transition(m, manifest_source, pre_ws, post_ws, a_log[0].step)
    at = tr["at_step"]
    pre = [r for r in b_log if r.step <= at]
    post = [r for r in a_log if r.step > at]
    if not pre or not post:
        raise BadInput(f"the logs do not surround the switch at step {at}: before has steps {b_log[0].step}-"
                       f"{b_log[-1].step}, after {a_log[0].step}-{a_log[-1].step}", where=where,
                       hint="Pass the logs of the runs before and after this transition.")
    checks = []
    meet = pre[-1].step == at and post[0].step == at + 1
    ignored = [r.step for r in b_log if r.step > at]
    checks.append(_check("logs meet at the switch", meet,
                         f"before ends at step {pre[-1].step}, after starts at step {post[0].step}, switch after step {at}"
                         + (f"; before-log steps {ignored[0]}-{ignored[-1]} (after the checkpoint) ignored" if ignored else ""),
                         None if meet else [pre[-1].step, post[0].step]))
    rtol = DEFAULT_LOSS_RTOL if loss_rtol is None else loss_rtol
    loss, c = _loss(pre, post, trend_steps, rtol)
    checks += c
    grad, c = _gradnorm(pre, post, trend_steps, gradnorm_factor)
    checks += c
    ws_b = pre[-1].world_size or tr["from_world_size"]
    ws_a = post[0].world_size or tr["to_world_size"]
    thr, c = _throughput(pre, post, trend_steps, throughput_drop, ws_b, ws_a)
    checks += c
    cov, c = _coverage(pre, post, m, at)
    checks += c
    ok = all(ch["ok"] for ch in checks if ch["severity"] == "error")
    result: dict[str, Any] = {
        "ok": ok, "exit_code": 0 if ok else 1, "transition": tr, "checks": checks, "loss": loss, "gradnorm": grad,
        "coverage": cov, "throughput": thr,
        "steps": {"before": [pre[0].step, pre[-1].step], "after": [post[0].step, post[-1].step]},
        "figure": None, "report": None,
    }
    return result, pre, post


__all__ = ["judge_window", "LOSS_K", "DEFAULT_LOSS_RTOL", "JUMP_FACTOR", "PREDICT_STEPS"]
