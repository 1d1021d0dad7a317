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
    if figures.get("seconds") is not None:
        line += f"; {_about(figures['seconds'])} to copy (measured: {_rates(figures)})"
    return line


def estimate_lines(figures: dict[str, Any]) -> list[str]:
    """The estimate as `reshard plan` prints it (text): size, free space, time and its basis."""
    out = [f"estimate: writes about {human_bytes(figures['needed_bytes'])} ({figures['needed_bytes']} bytes), "
           f"reads {human_bytes(figures['read_bytes'])}"]
    if figures.get("free_bytes") is not None:
        out.append(f"  destination {figures['destination']}: {human_bytes(figures['free_bytes'])} free "
                   f"({figures['free_from']}, at {figures['checked']}): "
                   + ("enough" if figures["enough"] else "NOT enough, convert refuses without --force"))
    if figures.get("seconds") is not None:
        out.append(f"  time: {_about(figures['seconds'])} to copy ({_rates(figures)})")
    elif figures.get("basis"):
        out.append(f"  time: not estimated ({figures['basis']})")
    return out


def _about(seconds: float) -> str:
    text = duration(seconds)
    return text if text.startswith("under") else f"about {text}"


def _rates(figures: dict[str, Any]) -> str:
    out = []
    for side in ("read", "write", "upload"):
        if side == "upload" and "upload" not in figures:
            continue  # only an output bound for object storage is uploaded
        r = figures.get(side) or {}
        if r.get("error") is None and r.get("bytes"):
            out.append(f"{side} {human_bytes(r['bytes'] / max(r['seconds'], 1e-6))}/s")
        else:
            out.append(f"{side} not measured ({r.get('error')})")
    return ", ".join(out)


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
