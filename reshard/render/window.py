"""The verification window's verdict for the terminal and `window.md`."""
from __future__ import annotations

from pathlib import Path

__all__ = ["render_window", "window_markdown", "window_title"]


def render_window(result: dict) -> str:
    t = result["transition"]
    lines = [f"window      {'OK' if result['ok'] else 'FAILED'} (exit {result['exit_code']})",
             f"transition  after step {t['at_step']}: world {t['from_world_size']} -> {t['to_world_size']}"
             f" ({t['kind'] or 'kind unknown'}; from {t['source']})",
             f"steps       before {result['steps']['before'][0]}-{result['steps']['before'][1]}, "
             f"after {result['steps']['after'][0]}-{result['steps']['after'][1]}"]
    for ch in result["checks"]:
        mark = "ok  " if ch["ok"] else ("WARN" if ch["severity"] == "warning" else "FAIL")
        lines.append(f"  [{mark}] {ch['name']}: {ch['detail']}")
    if result.get("figure"):
        lines.append(f"figure      {result['figure']}")
    if result.get("report"):
        lines.append(f"report      {result['report']}")
    return "\n".join(lines)


def window_title(result: dict) -> str:
    """window.png's title: the transition and the verdict, naming the checks that failed (the
    figure read on its own says whether the switch was clean)."""
    t = result["transition"]
    failed = [ch["name"] for ch in result["checks"] if not ch["ok"] and ch["severity"] != "warning"]
    verdict = "OK" if result["ok"] else "FAILED: " + ", ".join(failed)
    return (f"verification window after step {t['at_step']} (world {t['from_world_size'] or '?'} \u2192 "
            f"{t['to_world_size'] or '?'}): {verdict}")


def window_markdown(result: dict) -> str:
    t = result["transition"]
    out = [f"# Verification window: {'OK' if result['ok'] else 'FAILED'}", "",
           f"Transition after step {t['at_step']}: world size {t['from_world_size']} -> {t['to_world_size']} "
           f"(kind: {t['kind'] or 'unknown'}; source: {t['source']}).", "",
           "| check | result | steps | detail |", "|---|---|---|---|"]
    for ch in result["checks"]:
        res = "ok" if ch["ok"] else ("warning" if ch["severity"] == "warning" else "**FAIL**")
        steps = "" if not ch["steps"] else f"{ch['steps'][0]}-{ch['steps'][1]}"
        out.append(f"| {ch['name']} | {res} | {steps} | {ch['detail'].replace('|', '/')} |")
    cov = result["coverage"]
    out += ["", f"Coverage: {cov['repeated']} repeated, {cov['skipped']} skipped.", "",
            f"![window]({Path(result['figure']).name})" if result.get("figure") else ""]
    return "\n".join(out) + "\n"
