"""`reshard verify`'s result for a terminal: the verdict first, then one line per difference.

The comparison itself is `reshard.verification.checkpoints` (its result is the ``--json``
shape); this module only writes it for people, like the other reports of `reshard.render`.
"""
from __future__ import annotations

from typing import Any


def on_purpose(rewritten: list[dict[str, Any]]) -> str:
    """``63 keys renamed on purpose``, ``36 keys renamed and 2 rewritten on purpose``: the keys that differ
    from the source as the plan said, in the plan's own words (a slice's renumbered keys are renamed)."""
    renamed = sum(1 for w in rewritten if str(w.get("reason", "")).startswith("renamed"))
    other = len(rewritten) - renamed
    if not renamed:
        return f"{other} key{'' if other == 1 else 's'} rewritten on purpose"
    return (f"{renamed} key{'' if renamed == 1 else 's'} renamed" + (f" and {other} rewritten" if other else "")
            + " on purpose")


def _n(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def render_verify(r: dict[str, Any], *, limit: int = 50) -> str:
    """A few lines for a terminal: the verdict first, then one line per difference."""
    from reshard.units import human_bytes

    c = r["compared"]
    tol = r["tolerance"]
    how = "bitwise" if not (tol["rtol"] or tol["atol"]) else f"rtol={tol['rtol']:g}, atol={tol['atol']:g}"
    n = len(r["differences"])
    verdict = "equal" if r["equal"] else f"DIFFERENT ({n} difference{'s' if n != 1 else ''})"
    if r["equal"] and r.get("slice"):  # B holds a part of A: equal where it holds it, not equal
        verdict = f"equal where kept: a slice of A ({r['slice']}), the rest left out on purpose"
    out = [f"verdict     {verdict}",
           f"A           {r['a']}",
           f"B           {r['b']}",
           f"compared    {_n(c['tensors'], 'tensor')} ({_n(c['elements'], 'element')}, {human_bytes(c['bytes'])}, {how}), "
           f"{_n(c['objects'], 'object')}"]
    for d in r["differences"][:limit]:
        out.append(f"  {d['kind']:<10} {d['key']}: {d['detail']}")
    if n > limit:
        out.append(f"  ... and {n - limit} more (use --json for all)")
    if r["rewritten"]:
        out.append(f"expected    {on_purpose(r['rewritten'])}")
        for w in r["rewritten"][:limit]:
            out.append(f"  {w['key']}: {w['reason']} ({w['detail']})")
        if r.get("evidence"):
            out.append(f"expected rewrites taken from {r['evidence']}, each re-derived (--strict excuses none)")
    for note in r.get("notes", [])[:limit]:
        out.append(f"note        {note}")
    return "\n".join(out)
