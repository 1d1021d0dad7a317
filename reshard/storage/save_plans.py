"""The per-rank save plans a `.metadata` may carry (`all_local_plans`), as plain data checked against what was written.

Megatron-Core's torch_dist save stores every rank's DCP ``SavePlan`` in `.metadata` (so a later
save can reuse the global plan; megatron/core/dist_checkpointing/strategies/state_dict_saver.py:
``global_metadata.all_local_plans = all_local_plans``). They are the one place a checkpoint
records how many ranks took part in the save, including ranks that wrote nothing: Megatron
saves each replicated chunk from its main replica only (``replica_id`` 0), so a data-parallel
replica's plan is empty and it leaves no data file.

A plan says what a rank meant to write; ``storage_data`` says what was written. So the plans
count for something only when they agree with it item for item: every stored item is in the
plan of the rank whose data file (``__<rank>_<n>.distcp``) holds it, and every planned item
was stored. Plans that disagree, or are malformed, are reported with the reason and used for
nothing. Reading them is a walk over inert records (`safe_pickle`); nothing in them is called.

This module knows ranks, items and files, nothing of what a layout means: which degrees the
counts imply is the writer's convention (`reshard.semantics.megatron`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from reshard.storage.safe_pickle import Record

ItemId = tuple[str, "tuple[int, ...] | None"]  # (key, chunk offsets; None for an object), as storage_data names items


@dataclass(frozen=True)
class SavePlans:
    """What ``all_local_plans`` records about the save, or why it cannot be used.

    ``items_per_rank[r]`` is the number of items rank ``r`` planned to write; its length is the
    number of ranks that took part in the save. ``problem`` is set (and the counts are empty)
    when the plans are malformed or disagree with ``storage_data``: then they are no evidence.
    """

    items_per_rank: tuple[int, ...] = ()
    problem: str | None = None


def decode(plans: Any) -> list[list[ItemId]] | str | None:
    """The items each rank planned, from the unpickled ``all_local_plans``; a reason string if malformed.

    None when the metadata carries no plans (every writer but Megatron's torch_dist).
    """
    if plans is None:
        return None
    if not isinstance(plans, (list, tuple)) or not plans:
        return "all_local_plans is not a list of save plans"
    out: list[list[ItemId]] = []
    for rank, plan in enumerate(plans):
        items = plan.get("items") if isinstance(plan, Record) and type(plan).__name__ == "SavePlan" else None
        if not isinstance(items, (list, tuple)):
            return f"the save plan of rank {rank} is not a SavePlan with a list of items"
        ids: list[ItemId] = []
        for item in items:
            index = item.get("index") if isinstance(item, Record) and type(item).__name__ == "WriteItem" else None
            fqn = index.get("fqn") if isinstance(index, Record) else None
            offset = index.get("offset") if isinstance(index, Record) else None
            if not isinstance(fqn, str) or not (offset is None or (isinstance(offset, tuple)
                                                                   and all(type(o) is int for o in offset))):
                return f"an item of rank {rank}'s save plan has no key and offsets"
            ids.append((fqn, offset))
        out.append(ids)
    return out


def check(decoded: list[list[ItemId]] | str | None, stored: Mapping[ItemId, Any],
          writer_of: Callable[[str], int | None]) -> SavePlans | None:
    """The plans as evidence: each stored item planned by the rank whose data file holds it, each planned item stored.

    ``stored`` maps each item of ``storage_data`` to its location (``.file``); ``writer_of`` gives
    the rank a data file's name says wrote it. A rank may plan an item another rank stored (DCP
    writes a replicated item once); what no rank planned, or a rank stored without planning it,
    is a disagreement, and so is a planned item nobody stored.
    """
    if decoded is None:
        return None
    if isinstance(decoded, str):
        return SavePlans(problem=decoded)
    planned: set[ItemId] = set()
    for ids in decoded:
        planned.update(ids)
    by_rank = [set(ids) for ids in decoded]
    rank_of = {f: writer_of(f) for f in {loc.file for loc in stored.values()}}  # a few files, thousands of items
    for f, rank in sorted(rank_of.items()):
        if rank is None:
            return SavePlans(problem=f"data file '{f}' does not name the rank that wrote it")
        if rank >= len(by_rank):
            return SavePlans(problem=f"data file '{f}' was written by rank {rank} but the plans "
                                     f"record {len(by_rank)} rank(s)")
    for item, loc in stored.items():
        rank = rank_of[loc.file]
        if item not in by_rank[rank]:
            return SavePlans(problem=f"'{item[0]}' is stored in '{loc.file}' but rank {rank}'s plan does not hold it")
    missing = planned.difference(stored)
    if missing:
        key = sorted(missing, key=repr)[0][0]
        return SavePlans(problem=f"{len(missing)} planned items were never stored (first: '{key}')")
    return SavePlans(items_per_rank=tuple(len(ids) for ids in decoded))
