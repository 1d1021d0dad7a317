"""The rehearsal's batch recipe: one that both layouts divide, unless the user chose one.

Why: the planner keeps the global batch across a change of data-parallel width, so the
source's global batch must be a multiple of micro-batch x dp on the target as well. A
fixed default (2 x 2 on dp 2 = 8) makes ``--from dp=2 --to dp=3`` infeasible before a
single step runs. Without recipe options the rehearsal therefore picks the smallest global
batch that is a multiple of micro-batch x dp on both sides (and at least two micro-steps
per rank on the source, so accumulation is exercised), and says which it picked.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from reshard.errors import BadInput
from reshard.semantics.batch import Recipe

DEFAULT_MICRO_BATCH = 2
MIN_SOURCE_ACCUM = 2


@dataclass(frozen=True)
class RecipeChoice:
    """The source recipe the rehearsal trains with, the target recipe it expects the plan to
    keep (the plan decides; the rehearsal checks), and how the source recipe was chosen."""

    source: Recipe
    target: Recipe
    picked: bool          # True: reshard picked it (no recipe options given)
    note: str

    def to_dict(self) -> dict[str, object]:
        return {"source": self.source.to_dict(), "target": self.target.to_dict(), "picked": self.picked,
                "note": self.note}


def _lcm(a: int, b: int) -> int:
    return a * b // math.gcd(a, b)


def pick_recipe(source_dp: int, target_dp: int, *, source_micro_batch: int | None = None,
                source_grad_accum: int | None = None, micro_batch: int | None = None,
                grad_accum: int | None = None) -> RecipeChoice:
    """The recipe of a rehearsal ``source_dp -> target_dp``.

    ``source_micro_batch`` / ``source_grad_accum``: the source run's recipe (both given: used
    as is). ``micro_batch`` / ``grad_accum``: the target overrides handed to the planner.
    Otherwise the source micro-batch m (default 2) is kept and the global batch is the
    smallest multiple of lcm(m x source_dp, m_t x target_dp) holding at least two
    micro-steps per source rank, m_t being the target micro-batch (the override, or m).
    """
    for name, v in (("source micro-batch", source_micro_batch), ("source grad-accum", source_grad_accum),
                    ("micro-batch", micro_batch), ("grad-accum", grad_accum)):
        if v is not None and v < 1:
            raise BadInput(f"{name} must be a positive integer, got {v}")
    if source_dp < 1 or target_dp < 1:
        raise BadInput(f"dp degrees must be >= 1, got {source_dp} -> {target_dp}")
    m = source_micro_batch or DEFAULT_MICRO_BATCH
    if source_grad_accum:
        src = Recipe(m, source_grad_accum, source_dp)
        picked = False
        note = (f"source recipe given: {m} x {source_grad_accum} x dp {source_dp} = global batch {src.global_batch}")
    else:
        m_t = micro_batch or m
        unit = _lcm(m * source_dp, m_t * target_dp)
        floor = MIN_SOURCE_ACCUM * m * source_dp
        g = unit * -(-floor // unit)
        src = Recipe(m, g // (m * source_dp), source_dp)
        picked = True
        note = (f"picked global batch {g}: the smallest multiple of micro-batch {m} x dp {source_dp} and of "
                f"micro-batch {m_t} x dp {target_dp} with at least {MIN_SOURCE_ACCUM} micro-steps per source rank "
                f"(source {m} x {src.grad_accum} x dp {source_dp}); pass --source-micro-batch/--source-grad-accum "
                "to choose another")
    if micro_batch and grad_accum:
        tgt = Recipe(micro_batch, grad_accum, target_dp)
    else:
        m_t = micro_batch or m
        if grad_accum and src.global_batch % (grad_accum * target_dp) == 0:
            tgt = Recipe(src.global_batch // (grad_accum * target_dp), grad_accum, target_dp)
        elif src.global_batch % (m_t * target_dp) == 0 and not grad_accum:
            tgt = Recipe(m_t, src.global_batch // (m_t * target_dp), target_dp)
        else:
            raise BadInput(f"the source's global batch {src.global_batch} ({src.micro_batch} x {src.grad_accum} x dp "
                           f"{source_dp}) cannot be kept on dp {target_dp} with "
                           + (f"grad-accum {grad_accum}" if grad_accum else f"micro-batch {m_t}"),
                           hint="Leave the source recipe to the rehearsal (it picks one both layouts divide), "
                                "or pass both --micro-batch and --grad-accum for the target.")
    if tgt.global_batch == src.global_batch:
        note += f"; target {tgt.micro_batch} x {tgt.grad_accum} x dp {target_dp} keeps it"
    else:
        note += (f"; target {tgt.micro_batch} x {tgt.grad_accum} x dp {target_dp} = {tgt.global_batch} "
                 "changes the global batch (chosen explicitly)")
    return RecipeChoice(source=src, target=tgt, picked=picked, note=note)


__all__ = ["RecipeChoice", "pick_recipe", "DEFAULT_MICRO_BATCH"]
