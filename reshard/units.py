"""Numbers in words people read: byte counts (KiB, MiB, GiB), runs of integers (0-3,7) and the
time an output records (``SOURCE_DATE_EPOCH`` when set), one spelling for every message, report and manifest."""
from __future__ import annotations

import datetime as _dt
import os

__all__ = ["consecutive_runs", "human_bytes", "now_text", "reproducible"]


def human_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def consecutive_runs(values) -> list[tuple[int, int]]:
    """``[1, 2, 3, 7]`` -> ``[(1, 3), (7, 7)]``: the runs of consecutive integers, in the order given
    (sort first for sets); how a list of layers, steps or sample ids is written short."""
    xs = list(values)
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append((xs[i], xs[j]))
        i = j + 1
    return out


def reproducible() -> bool:
    """Outputs must not depend on when they were made (``SOURCE_DATE_EPOCH`` is set): no measured figure is recorded."""
    return bool(os.environ.get("SOURCE_DATE_EPOCH"))


def now_text() -> str:
    """UTC now, or SOURCE_DATE_EPOCH when set (reproducible outputs)."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    t = _dt.datetime.fromtimestamp(int(epoch), _dt.timezone.utc) if epoch else _dt.datetime.now(_dt.timezone.utc)
    return t.isoformat(timespec="seconds")
