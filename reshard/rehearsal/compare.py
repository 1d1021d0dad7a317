"""What the rehearsal measures: trajectories, optimizer moments, sample coverage."""
from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from reshard.storage.checkpoints.index import CheckpointIndex
from reshard.rehearsal.ckpt import MOMENT, STEP


def read_log(path: Path) -> dict[int, Any]:
    """step -> StepRecord (reshard.semantics.steplog); {} when the run wrote nothing."""
    from reshard.semantics.steplog import read_steplog

    if not Path(path).exists() or not Path(path).read_text().strip():
        return {}
    return {r.step: r for r in read_steplog(path)}


def rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / abs(b) if b != 0 else math.inf


def trajectory(run: dict[int, Any], base: dict[int, Any], steps: list[int], field: str) -> dict[str, Any]:
    """Per-step abs/rel differences of ``field`` (loss, grad_norm) over ``steps``."""
    per: list[dict[str, Any]] = []
    missing = [s for s in steps if s not in run or s not in base]
    for s in steps:
        if s in missing:
            continue
        a, b = getattr(run[s], field), getattr(base[s], field)
        if a is None or b is None:
            missing.append(s)
            continue
        per.append({"step": s, "run": a, "baseline": b, "abs": abs(a - b) if math.isfinite(a - b) else math.inf,
                    "rel": rel(a, b), "bitwise": a == b})
    worst = max(per, key=lambda p: p["rel"]) if per else None
    return {"max_abs": max((p["abs"] for p in per), default=None),
            "max_rel": worst["rel"] if worst else None, "worst_step": worst["step"] if worst else None,
            "bitwise": bool(per) and not missing and all(p["bitwise"] for p in per),
            "missing_steps": sorted(missing), "per_step": per}


def moments(run_ckpt: Path, base_ckpt: Path) -> dict[str, Any]:
    """Adam moments and step counters of two checkpoints, in global terms.

    For each moment kind (exp_avg, exp_avg_sq) the relative difference of parameter p is
    max|a_p - b_p| / max|b| with the denominator taken over ALL parameters (the moment's
    scale), so "max rel" over all parameters is max|a - b| / max|b| over the whole state.
    A parameter's own scale is not used: a parameter whose gradient is mathematically zero
    (the key bias: softmax ignores a per-query constant) holds moments of pure rounding
    noise, whose self-relative difference is ~1 and meaningless; it is reported as
    ``self_rel`` for information. Per parameter the worse of the two kinds is kept.
    """
    from reshard.semantics.manifest import read_manifest

    ia, ib = CheckpointIndex.open(run_ckpt), CheckpointIndex.open(base_ckpt)
    m = read_manifest(base_ckpt)  # tied copies (lm_head = tok_emb) may legitimately lack a copy of their state
    tied_copies = {t for group in (m.model.tied if m is not None else []) for t in group[1:]}
    diffs: dict[str, dict[str, float]] = {}
    self_rel: dict[str, dict[str, float]] = {}
    scale: dict[str, float] = {}
    only_base, only_run = [], []
    for key in sorted(set(ib.entries) | set(ia.entries)):
        m = MOMENT.match(key)
        if not m:
            continue
        if key not in ia.entries or key not in ib.entries:
            (only_base if key in ib.entries else only_run).append(key)
            continue
        p, name = m.group("param"), m.group("name")
        a, b = ia.read_tensor(key).double(), ib.read_tensor(key).double()
        bmax = b.abs().max().item() if b.numel() else 0.0
        scale[name] = max(scale.get(name, 0.0), bmax)
        if a.shape != b.shape:
            num = math.inf
        else:
            num = (a - b).abs().max().item() if b.numel() else 0.0
            if math.isnan(num):
                num = math.inf
        diffs.setdefault(p, {})[name] = num
        self_rel.setdefault(p, {})[name] = 0.0 if num == 0 else (num / bmax if bmax > 0 else math.inf)
    per_param: dict[str, dict[str, float]] = {}
    for p, d in diffs.items():
        per_param[p] = {n: (0.0 if x == 0 else (x / scale[n] if scale.get(n) else math.inf)) for n, x in sorted(d.items())}
    steps_equal, step_mismatch = True, []
    for key in sorted(set(ib.entries) & set(ia.entries)):
        if STEP.match(key):
            va, vb = float(ia.read_tensor(key)), float(ib.read_tensor(key))
            if va != vb:
                steps_equal = False
                step_mismatch.append({"key": key, "run": va, "baseline": vb})
    trainer = {}
    for key in ("trainer.step", "trainer.samples_seen", "data.sampler.cursor", "data.sampler.epoch"):
        if key in ia.entries and key in ib.entries:
            va, vb = ia.read_object(key), ib.read_object(key)
            trainer[key] = {"run": va, "baseline": vb, "equal": va == vb}
            if key == "trainer.step" and va != vb:
                steps_equal = False
    worst = max(per_param, key=lambda p: max(per_param[p].values())) if per_param else None
    missing = [k for k in only_base if MOMENT.match(k).group("param") not in tied_copies]
    return {"max_rel": max(per_param[worst].values()) if worst else None, "worst_param": worst,
            "relative_to": "each moment's max |value| over all parameters of the baseline",
            "scale": scale, "per_param": dict(sorted(per_param.items())),
            "self_rel": {p: dict(sorted(v.items())) for p, v in sorted(self_rel.items())},
            "step_counters_equal": steps_equal, "step_mismatch": step_mismatch, "counters": trainer,
            "only_in_baseline": only_base, "only_in_run": only_run, "missing": missing,
            "n_params": len(per_param)}


def coverage(base: dict[int, Any], run: dict[int, Any], *, switch_at: int, window_steps: list[int]) -> dict[str, Any]:
    """Sample ids across the transition: the uninterrupted baseline's steps 1..switch_at,
    then this run's window steps, against the order the baseline itself read them in.

    The stream is the baseline's steps in order (any trainer's sampler, no knowledge of it
    needed); an id the baseline never read is placed after its stream, in the order first
    read. repeated: reads of an id already read before in the span; skipped: stream
    positions behind the furthest one read that were never read (lost for this epoch).
    Cumulative per-step series of both, the position reached against the baseline's, and
    whether each step took exactly the baseline's ids.
    """
    pos: dict[int, int] = {}
    for s in sorted(base):
        for i in base[s].sample_ids or []:
            pos.setdefault(i, len(pos))

    def where(i: int) -> int:
        return pos.setdefault(i, len(pos))

    seen: set[int] = set()
    read: set[int] = set()
    repeated = 0
    for s in range(1, switch_at + 1):
        for i in (base[s].sample_ids or []) if s in base else []:
            repeated += i in seen
            seen.add(i)
            read.add(where(i))
    per_rep, per_skip, mismatched, missing = [], [], [], []
    for s in window_steps:
        if s not in run or run[s].sample_ids is None:
            missing.append(s)
            continue
        for i in run[s].sample_ids:
            repeated += i in seen
            seen.add(i)
            read.add(where(i))
        front = max(read) + 1 if read else 0
        per_rep.append((s, repeated))
        per_skip.append((s, front - len(read)))
        if s in base and base[s].sample_ids != run[s].sample_ids:
            mismatched.append(s)
    base_front = None
    last = window_steps[-1] if window_steps else switch_at
    if all(s in base for s in range(1, last + 1)):
        base_front = len({pos[i] for s in range(1, last + 1) for i in base[s].sample_ids or []})
    front = max(read) + 1 if read else 0
    skipped = per_skip[-1][1] if per_skip else 0
    return {"repeated": repeated, "skipped": skipped, "exact": repeated == 0 and skipped == 0 and not mismatched
            and not missing, "steps_with_other_ids": mismatched, "missing_steps": missing,
            "position": front, "baseline_position": base_front,
            "offset": None if base_front is None else front - base_front,
            "per_step": {"steps": [s for s, _ in per_rep], "repeated": [r for _, r in per_rep],
                         "skipped": [k for _, k in per_skip]}}


def median_throughput(run: dict[int, Any], steps: list[int]) -> float | None:
    v = [run[s].tokens_per_s for s in steps if s in run and run[s].tokens_per_s]
    return statistics.median(v) if v else None
