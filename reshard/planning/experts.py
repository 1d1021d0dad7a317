"""How the experts of an MoE model map to ranks, before and after a conversion (issue 43 item 6).

Why a plan says it: experts stacked in one tensor (torchtitan's ``GroupedExperts``: ``w1_EFD`` of
shape (experts, hidden, dim)) are cut along the expert axis by expert parallelism, and by FSDP2's
dim-0 shard as well, so the chunks alone do not say which of the two wrote them (torchtitan's EP
borrows its ranks from ``dp_shard``: at EP = dp_shard the pieces are the same). What the chunks do
say is which experts each rank holds, and that is what a user moving an MoE run wants to see:
which rank held experts 0-1 before, and which holds them after. The target side is the plan's own
chunks of the same tensor (reshard writes the experts FSDP2-cut along dim 0 for the target's
``dp_shard``); the trainer cuts them over its own ``ep`` when it loads, from DCP's global tensor.

Only families that declare ``[experts] stacked`` (formats/models/*.toml) are read; names and
chunk boxes only, no tensor byte.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from reshard.errors import BadInput
from reshard.model.checkpoint import ChunkTable
from reshard.model.plan import TensorPlan
from reshard.semantics import slicing as slicing_mod
from reshard.patterns import compile_pattern
from reshard.planning.describe import chunk_writers
from reshard.semantics.rules import select as select_rules


@dataclass(frozen=True)
class Holding:
    """One run of experts ``first..last`` (inclusive) along the expert axis, and the ranks that hold it."""

    first: int
    last: int
    ranks: tuple[int, ...]

    def text(self) -> str:
        span = f"expert {self.first}" if self.first == self.last else f"experts {self.first}-{self.last}"
        who = ("rank " if len(self.ranks) == 1 else "ranks ") + ",".join(map(str, self.ranks)) if self.ranks else "no rank"
        return f"{span} on {who}"


@dataclass(frozen=True)
class ExpertMap:
    """Experts per MoE layer, the stacked tensors they live in, and who holds which, source and target."""

    experts: int
    target_experts: int            # after an --experts slice, fewer (renumbered from 0)
    stacked: int                   # stacked expert tensors in the model (parameters)
    example: str                   # the parameter the holdings are read from
    source: tuple[Holding, ...]
    target: tuple[Holding, ...]
    uniform: bool                  # every stacked tensor cut the same way as the example, source and target

    def to_dict(self) -> dict[str, Any]:
        def rows(hs: Sequence[Holding]) -> list[dict[str, Any]]:
            return [{"experts": [h.first, h.last], "ranks": list(h.ranks)} for h in hs]

        return {"experts": self.experts, "target_experts": self.target_experts, "stacked_tensors": self.stacked, "example": self.example,
                "source": rows(self.source), "target": rows(self.target), "uniform": self.uniform,
                "note": self.note()}

    def note(self) -> str:
        return ("the stacked experts are stored as global tensors: the trainer cuts them over its own "
                "expert-parallel degree when it loads (expert parallelism and FSDP's dim-0 shard make the "
                "same pieces, so the source's EP degree is not in the chunks)")

    def describe(self) -> str:
        src = "; ".join(h.text() for h in self.source)
        dst = "; ".join(h.text() for h in self.target)
        odd = "" if self.uniform else " (not every stacked tensor is cut like it)"
        sliced = f" ({self.target_experts} experts after the slice, renumbered from 0)" if self.target_experts != self.experts else ""
        return (f"{self.experts} per MoE layer, stacked along the expert axis of {self.stacked} tensors "
                f"(e.g. {self.example}{odd}): source {src}; target{sliced} {dst}")


def _holdings(boxes: Sequence[tuple[int, int, int]]) -> tuple[Holding, ...]:
    """(first expert, count, rank) per piece -> the runs of experts with the ranks holding each."""
    by_run: dict[tuple[int, int], set[int]] = {}
    for first, count, rank in boxes:
        if count > 0:
            by_run.setdefault((first, first + count - 1), set()).add(rank)
    return tuple(Holding(a, b, tuple(sorted(r for r in ranks if r >= 0))) for (a, b), ranks in sorted(by_run.items()))


def _source_boxes(ix: Any, key: str, dim: int) -> list[tuple[int, int, int]]:
    """(first expert, count, writer rank) of each stored piece of ``key`` along the expert axis ``dim``."""
    e = ix.entries[key]
    t = ChunkTable.of(e.chunks, len(e.shape))
    return [(int(t.offsets[i][dim]), int(t.sizes[i][dim]), w) for i, w in enumerate(chunk_writers(ix, key))]


def expert_map(ix: Any, cls: Any, mdict: dict[str, Any], rules_file: str | None,
               tensors: Sequence[TensorPlan]) -> ExpertMap | None:
    """The experts' placement for a plan, or None when no family with ``[experts] stacked`` describes the model."""
    params = {x.param: k for k, x in cls.roles.items()
              if x.role == "parameter" and x.param and k in ix.entries and ix.entries[k].is_tensor}
    try:
        rules = select_rules(sorted(params), family=(mdict.get("model") or {}).get("family"), rules_file=rules_file)
    except BadInput:
        return None
    stacked = slicing_mod.declared_experts(rules).get("stacked") or []
    patterns = [(compile_pattern(s["match"], rules.source, what="[experts] stacked match"), int(s.get("dim", 0)))
                for s in stacked if isinstance(s, dict) and isinstance(s.get("match"), str)]
    found = [(p, params[p], dim) for p in sorted(params) for pat, dim in patterns if pat.match(p)]
    if not found:
        return None
    planned = {t.key: t for t in tensors}
    maps = []
    for _param, key, dim in found:
        src = _holdings(_source_boxes(ix, key, dim))
        t = planned.get(key)
        dst = _holdings([(off[dim], size[dim], rank) for rank, off, size in t.chunks]) if t is not None else ()
        maps.append((src, dst))
    param, key, dim = found[0]
    experts = int(np.asarray(ix.entries[key].shape)[dim])
    after = planned[key].shape[dim] if key in planned else experts
    return ExpertMap(experts, int(after), len(found), param, maps[0][0], maps[0][1], all(m == maps[0] for m in maps))
