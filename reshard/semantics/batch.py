"""Batch recipe arithmetic: keep the global batch when the data-parallel width changes.

global batch = micro-batch x accumulation x dp (dp = dp_replicate x dp_shard). Keeping it
keeps what one optimizer step means; 64 x 8 x 4 = 2,048 on 64 ranks needs accumulation 8
on 32 ranks.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Recipe:
    micro_batch: int
    grad_accum: int
    dp: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp

    def to_dict(self) -> dict[str, int]:
        d = asdict(self)
        d["global_batch"] = self.global_batch
        return d


@dataclass
class BatchDecision:
    before: Recipe | None
    after: Recipe | None
    kept: bool | None  # None: unknown (no source recipe)
    feasible: bool
    alternatives: list[dict[str, int]] = field(default_factory=list)
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"before": self.before.to_dict() if self.before else None,
                "after": self.after.to_dict() if self.after else None,
                "kept": self.kept, "feasible": self.feasible, "alternatives": self.alternatives, "note": self.note}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def keep_global_batch(before: Recipe | None, target_dp: int, *, micro_batch: int | None = None,
                      grad_accum: int | None = None) -> BatchDecision:
    """The target recipe: the user's choices where given, otherwise what keeps the global batch."""
    if before is None:
        if micro_batch and grad_accum:
            return BatchDecision(None, Recipe(micro_batch, grad_accum, target_dp), None, True,
                                 note="source batch recipe unknown (no manifest): the global batch cannot be checked")
        return BatchDecision(None, None, None, True,
                             note="source batch recipe unknown (no manifest); pass --micro-batch and --grad-accum to record the target recipe")
    G = before.global_batch
    if micro_batch and grad_accum:
        after = Recipe(micro_batch, grad_accum, target_dp)
        kept = after.global_batch == G
        return BatchDecision(before, after, kept, True,
                             note="" if kept else f"global batch changes {G} -> {after.global_batch} (chosen explicitly)")
    m = micro_batch or before.micro_batch
    if grad_accum and not micro_batch:
        if G % (grad_accum * target_dp) == 0:
            return BatchDecision(before, Recipe(G // (grad_accum * target_dp), grad_accum, target_dp), True, True)
        m = before.micro_batch
        after = Recipe(m, grad_accum, target_dp)
        return BatchDecision(before, after, False, True,
                             note=f"global batch changes {G} -> {after.global_batch} (accumulation {grad_accum} chosen explicitly)")
    if G % (m * target_dp) == 0:
        return BatchDecision(before, Recipe(m, G // (m * target_dp), target_dp), True, True)
    # Cannot keep it with this micro-batch: list what can be done.
    alts: list[dict[str, int]] = []
    if G % target_dp == 0:
        per_rank = G // target_dp
        for mb in _divisors(per_rank):
            alts.append(Recipe(mb, per_rank // mb, target_dp).to_dict())
        alts.sort(key=lambda a: abs(a["micro_batch"] - m))
        alts = alts[:4]
    lo = max(1, G // (m * target_dp))
    for a in sorted({lo, lo + 1}):
        alts.append(Recipe(m, a, target_dp).to_dict())
    return BatchDecision(before, None, False, False, alts,
                         note=f"global batch {G} is not a multiple of micro-batch {m} x dp {target_dp}"
                         + ("" if G % target_dp == 0 else f" (nor of dp {target_dp} alone)")
                         + ": choose --micro-batch/--grad-accum (and --schedule if the global batch changes)")
