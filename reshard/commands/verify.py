"""`reshard verify A B`: compare two checkpoints in global terms, whatever their chunking.

Nothing either checkpoint says about itself excuses a difference: a difference a conversion
meant (a rewritten counter, a reseeded RNG, a dropped key) is excused only where the plan
recomputed from A and B's lineage predicts exactly it (`reshard.verification.evidence`), and
``--strict`` excuses nothing. The comparison itself is `reshard.verification.checkpoints`, the
same one `convert` runs on its output before committing.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from reshard.storage.source import Source
from reshard.verification.checkpoints import verify_checkpoints


def verify(a: Source | Path, b: Path | Source, *, rtol: float = 0.0, atol: float = 0.0, trust_pickle: bool = False,
           strict: bool = False, buffered: bool = False, progress: Any = None) -> tuple[dict[str, Any], int]:
    """The comparison (what `reshard.render.verify.render_verify` prints) and the exit code: 0 equal, 1 different.
    ``a``, ``b``: as `reshard.storage.source.opened` made them (a store read through its own handle)."""
    r = verify_checkpoints(a, b, rtol=rtol, atol=atol, trust_pickle=trust_pickle, recompute=True, strict=strict,
                           direct=not buffered, progress=progress)
    return r, 0 if r["equal"] else 1
