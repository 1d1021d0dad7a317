"""Numbers in words people read: byte counts (KiB, MiB, GiB), runs of integers (0-3,7) and the
time an output records (``SOURCE_DATE_EPOCH`` when set), one spelling for every message, report and manifest;
and sizes people write (``5GB``, ``512MiB``: `parse_size`), read one way by every option that takes one."""
from __future__ import annotations

import datetime as _dt
import os
import re

from reshard.errors import BadInput

__all__ = ["consecutive_runs", "human_bytes", "now_text", "parse_size", "reproducible"]


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


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1,
          "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
          "p": 10**15, "pb": 10**15,
          "ki": 1 << 10, "kib": 1 << 10, "mi": 1 << 20, "mib": 1 << 20, "gi": 1 << 30, "gib": 1 << 30,
          "ti": 1 << 40, "tib": 1 << 40, "pi": 1 << 50, "pib": 1 << 50}


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"256MB"`` -> 256_000_000, ``"512MiB"`` -> 536_870_912, ``"1000"`` -> 1000.

    Decimal units (KB, MB, GB, TB) as Hugging Face's ``max_shard_size``; binary ones with ``i``.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        n = text
    else:
        m = _SIZE.match(str(text))
        if not m or (m.group(2) or "").lower() not in _UNITS:
            raise BadInput(f"bad size '{text}'", hint="Write e.g. 5GB, 256MB, 512MiB or a number of bytes.")
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    if n < 1:
        raise BadInput(f"size must be positive, got '{text}'")
    return n
