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

The number of plans is the world the file claims, and a pickle can claim far more ranks than it
holds plans: a memo reference repeats one plan object for 5 bytes (720,720 "ranks" in 3.6 MB).
No save writes that: each rank's plan reaches the coordinator through ``gather_object``, unpickled
on its own, so the list Megatron pickles holds one distinct object per rank, and torch's pickler
writes each in full (about 38 bytes for an idle rank's empty plan). A list that repeats a plan
object is therefore malformed (the world it claims is more than the plans the file holds), said
so before any plan is walked, and everything else costs one pass over the plans and their items,
which the pickle's cost bound (`safe_pickle.pickle_cost`) keeps proportional to the file's bytes.

This module knows ranks, items and files, nothing of what a layout means: which degrees the
counts imply is the writer's convention (`reshard.semantics.megatron`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from reshard.storage.pickles.safe_pickle import Record

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
    shared = _shared_plan(plans)
    if shared is not None:
        return shared
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


def _shared_plan(plans: list[Any] | tuple[Any, ...]) -> str | None:
    """Why ``plans`` cannot be one plan per rank when two ranks' entries are one object (see the module
    docstring: a save pickles every rank's plan on its own), else None.

    By identity, as a sorted uint64 array of the objects' ids: 8 bytes per rank, where a dict or
    set of Python ints costs some 100 bytes per rank (70 MB for a claimed world of 720,720)."""
    ids = np.fromiter(map(id, plans), dtype=np.uint64, count=len(plans))
    ids.sort()
    distinct = int(np.count_nonzero(ids[1:] != ids[:-1])) + 1
    if distinct == len(plans):
        return None
    first: dict[int, int] = {}  # a forged list only: which two ranks share an object
    seen, rank = next((s, r) for r, plan in enumerate(plans) if (s := first.setdefault(id(plan), r)) != r)
    return (f"all_local_plans claims {len(plans)} ranks but holds {distinct} distinct save plan(s): the entries of "
            f"ranks {seen} and {rank} are one object, repeated by reference, where a save pickles every rank's own "
            f"plan, so the file records the plans of at most {distinct} ranks")


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
    by_rank = {rank: set(ids) for rank, ids in enumerate(decoded) if ids}  # idle ranks (most of a world): no set
    rank_of = {f: writer_of(f) for f in {loc.file for loc in stored.values()}}  # a few files, thousands of items
    for f, rank in sorted(rank_of.items()):
        if rank is None:
            return SavePlans(problem=f"data file '{f}' does not name the rank that wrote it")
        if rank >= len(decoded):
            return SavePlans(problem=f"data file '{f}' was written by rank {rank} but the plans "
                                     f"record {len(decoded)} rank(s)")
    for item, loc in stored.items():
        rank = rank_of[loc.file]
        if item not in by_rank.get(rank, ()):
            return SavePlans(problem=f"'{item[0]}' is stored in '{loc.file}' but rank {rank}'s plan does not hold it")
    missing = planned.difference(stored)
    if missing:
        key = sorted(missing, key=repr)[0][0]
        return SavePlans(problem=f"{len(missing)} planned items were never stored (first: '{key}')")
    return SavePlans(items_per_rank=tuple(len(ids) for ids in decoded))
