"""Read and validate a step log: JSON lines, one record per optimizer step.

The format is documented field by field in ``formats/step_log.md``. The reference trainer
(``reshard.reference.trainer``) writes it; any trainer can, as long as each line carries at
least ``step`` and ``loss``. Errors are ``BadInput`` naming the file and the line.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.errors import BadInput
from reshard.safefs import check_depth, too_deep

HINT = "See formats/step_log.md for the step-log format (one JSON object per line, steps increasing)."


@dataclass
class StepRecord:
    """One optimizer step. ``step`` counts completed optimizer steps (1 after the first)."""

    step: int
    loss: float
    grad_norm: float | None = None
    lr: float | None = None
    tokens_per_s: float | None = None
    sample_ids: list[int] | None = None
    """Global sample ids consumed by this step (sorted, may repeat)."""
    cursor: int | None = None
    """Global samples consumed so far in ``epoch``, after this step (when ids are not logged)."""
    epoch: int | None = None
    world_size: int | None = None
    line: int = 0
    """1-based line number in the file (for messages)."""


def _number(rec: dict, key: str, where: str, *, required: bool = False, finite: bool = True) -> float | None:
    if key not in rec or rec[key] is None:
        if required:
            raise BadInput(f"missing required field '{key}'", where=where, hint=HINT)
        return None
    v = rec[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadInput(f"field '{key}' must be a number, got {type(v).__name__}", where=where, hint=HINT)
    if finite and not math.isfinite(v):
        raise BadInput(f"field '{key}' must be finite, got {v}", where=where, hint=HINT)
    return float(v)


def _int(rec: dict, key: str, where: str, *, required: bool = False, minimum: int = 0) -> int | None:
    if key not in rec or rec[key] is None:
        if required:
            raise BadInput(f"missing required field '{key}'", where=where, hint=HINT)
        return None
    v = rec[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise BadInput(f"field '{key}' must be an integer >= {minimum}, got {v!r}", where=where, hint=HINT)
    return v


def parse_record(rec: Any, where: str, line: int = 0) -> StepRecord:
    """Validate one decoded JSON line. ``loss`` may be NaN/inf (a diverged step is data)."""
    if not isinstance(rec, dict):
        raise BadInput(f"expected a JSON object, got {type(rec).__name__}", where=where, hint=HINT)
    ids = rec.get("sample_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                for i in ids):
            raise BadInput("field 'sample_ids' must be a list of non-negative integers", where=where, hint=HINT)
    cursor = _int(rec, "cursor", where)
    epoch = _int(rec, "epoch", where)
    if cursor is not None and epoch is None:
        raise BadInput("field 'cursor' needs 'epoch' beside it", where=where, hint=HINT)
    return StepRecord(
        step=_int(rec, "step", where, required=True),  # type: ignore[arg-type]
        loss=_number(rec, "loss", where, required=True, finite=False),  # type: ignore[arg-type]
        grad_norm=_number(rec, "grad_norm", where, finite=False), lr=_number(rec, "lr", where),
        tokens_per_s=_number(rec, "tokens_per_s", where),
        sample_ids=None if ids is None else sorted(ids), cursor=cursor, epoch=epoch,
        world_size=_int(rec, "world_size", where, minimum=1), line=line)


def read_steplog(path: str | Path) -> list[StepRecord]:
    """Read a step log; BadInput on unreadable files, bad JSON, missing/mistyped fields,
    non-increasing steps or an empty log. Blank lines are ignored."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"cannot read step log: {exc}", where=str(path), hint=HINT) from exc
    out: list[StepRecord] = []
    for n, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        where = f"{path}:{n}"
        try:
            rec = check_depth(json.loads(raw), where=where, what="step log line")  # bounded: exit 2, not a crash
        except RecursionError:
            raise too_deep(where, "step log line") from None
        except json.JSONDecodeError as exc:
            raise BadInput(f"not valid JSON ({exc.msg} at column {exc.colno})", where=where,
                           hint="A truncated last line usually means the job was killed mid-write; "
                                "delete that line. " + HINT) from exc
        r = parse_record(rec, where, n)
        if out and r.step <= out[-1].step:
            raise BadInput(f"step {r.step} does not increase (line {out[-1].line} has step {out[-1].step})",
                           where=where, hint="Several runs appended to one log? Split it per run. " + HINT)
        out.append(r)
    if not out:
        raise BadInput("the step log holds no records", where=str(path), hint=HINT)
    return out


__all__ = ["StepRecord", "read_steplog", "parse_record"]
