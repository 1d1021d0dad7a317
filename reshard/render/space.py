"""The space and time estimate in words: the line convert, export and import say before writing,
and the lines `reshard plan --dst` prints (the figures come from `reshard.engine.space`)."""
from __future__ import annotations

from typing import Any

from reshard.units import human_bytes


def space_line(figures: dict[str, Any]) -> str:
    """``checking space: …``: the preflight's figures in one line (the first lines of convert, export, import)."""
    line = (f"checking space: writes about {human_bytes(figures['needed_bytes'])}, {human_bytes(figures['free_bytes'])} "
            f"free at {figures['checked']}" + ("" if figures["free_from"] == "the file system"
                                               else f" ({figures['free_from']})"))
    if figures.get("warning"):
        line += " — NOT ENOUGH, going ahead (--force)"
    if figures.get("high_s") is not None:
        line += f"; {time_range(figures['low_s'], figures['high_s'])} to convert ({_rates(figures)})"
    return line


def estimate_lines(figures: dict[str, Any]) -> list[str]:
    """The estimate as `reshard plan` prints it (text): size, free space, time and its basis."""
    out = [f"estimate: writes about {human_bytes(figures['needed_bytes'])} ({figures['needed_bytes']} bytes), "
           f"reads {human_bytes(figures['read_bytes'])}"]
    if figures.get("free_bytes") is not None:
        out.append(f"  destination {figures['destination']}: {human_bytes(figures['free_bytes'])} free "
                   f"({figures['free_from']}, at {figures['checked']}): "
                   + ("enough" if figures["enough"] else "NOT enough, convert refuses without --force"))
    if figures.get("high_s") is not None:
        out.append(f"  time: {time_range(figures['low_s'], figures['high_s'])} to convert ({_rates(figures)})")
        parts = figures.get("parts") or {}
        if parts:
            out.append("  parts: " + ", ".join(f"{k} {time_range(lo, hi)}" for k, (lo, hi) in parts.items()))
    elif figures.get("basis"):
        out.append(f"  time: not estimated ({figures['basis']})")
    return out


def time_range(low: float, high: float) -> str:
    """``12-25 s``, ``1 min 10 s to 2 min 05 s``, ``up to 3 s``, ``under 1 s``: an estimate's range in words."""
    if high < 1:
        return "under 1 s"
    lo, hi = duration(low), duration(high)
    if low < 1:
        return f"up to {hi}"
    if lo == hi:
        return f"about {hi}"
    if "min" not in hi and " h " not in hi:
        return f"{lo[:-2]}-{hi}"
    return f"{lo} to {hi}"


def _rates(figures: dict[str, Any]) -> str:
    """What bounds the estimate and the rates measured, or why nothing was measured."""
    probe = figures.get("probe") or {}
    if probe.get("skipped"):
        return f"not probed: {probe['skipped']}"
    out = []
    if figures.get("bound"):
        out.append(f"bound by {_BOUND.get(figures['bound'], figures['bound'])}")
    for side in ("read", "crc", "write", "upload"):
        r = figures.get(side)
        if r is None:
            continue  # crc: a store's path; upload: only an output bound for object storage
        if r.get("error") is None and r.get("bytes"):
            out.append(f"{side} {human_bytes(r['bytes'] / max(r['seconds'], 1e-6))}/s")
        else:
            out.append(f"{side} not measured ({r.get('error')})")
    return "; ".join(out[:1]) + (": " if len(out) > 1 and figures.get("bound") else "") + ", ".join(
        out[1:] if figures.get("bound") else out)


_BOUND = {"read": "the read", "write": "the write", "crc": "CPU (CRC-32)", "store": "the store's reads",
          "upload": "the upload", "copy": "the copy"}


def duration(seconds: float | None) -> str:
    """``4 s``, ``3 min 20 s``, ``2 h 05 min``: a time in words for estimates and ETAs."""
    if seconds is None:
        return "?"
    if seconds < 1:
        return "under 1 s"
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {(s % 3600) // 60:02d} min"
