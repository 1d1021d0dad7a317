"""`reshard verify`'s result for a terminal: the verdict first, then one line per difference.

The comparison itself is `reshard.verification.checkpoints` (its result is the ``--json``
shape); this module only writes it for people, like the other reports of `reshard.render`.
"""
from __future__ import annotations

from typing import Any


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
        out.append(f"rewritten   {len(r['rewritten'])} expected rewrite(s)")
        for w in r["rewritten"][:limit]:
            out.append(f"  {w['key']}: {w['reason']} ({w['detail']})")
        if r.get("evidence"):
            out.append(f"expected rewrites taken from {r['evidence']}, each re-derived (--strict excuses none)")
    for note in r.get("notes", [])[:limit]:
        out.append(f"note        {note}")
    return "\n".join(out)
