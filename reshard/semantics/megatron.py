"""The layout a Megatron-Core torch_dist checkpoint records: its save plans, read with Megatron's rank order.

Megatron saves each replicated chunk from its main replica only (``replica_id`` 0), so the
chunks and the data file names show the tensor-parallel (and pipeline) writers and nothing of
the data-parallel replicas. Its `.metadata` also carries every rank's save plan
(``all_local_plans``), and a replica's plan is empty: the plans say how many ranks saved
(the world size) and which of them wrote nothing. With Megatron's rank order (tp innermost,
then dp, then pp: ``initialize_model_parallel(order="tp-cp-ep-dp-pp")``, written in
``formats/conventions/megatron.toml``) exactly one (tp, dp, pp) factorisation of the world
makes the ranks at data-parallel index 0 the writers; the TP degree it gives must also be the
number of ranks that wrote pieces of one layer of one tensor. When both agree, the layout is
recorded by the checkpoint, and a ``--from`` that contradicts it is bad input naming both.

Nothing here reads bytes: the plans arrive as per-rank item counts already checked against the
stored items (`reshard.storage.checkpoints.save_plans`), the geometry as the index's chunk offsets and data file names.

The world the plans claim is as large as the `.metadata` makes it (a plan list of 720,720 ranks
fits in a few MB), so nothing here costs more than a pass over the ranks: the one factorisation
that can fit is computed, not searched for among the world's divisors (240 of them for 720,720,
each an O(world) pass: a minute), and rank lists in the evidence are abbreviated past
`MAX_LISTED`.
"""
from __future__ import annotations

from typing import Any, Sequence

from reshard.errors import BadInput
from reshard.model.checkpoint import Finding
from reshard.model.topology import Topology
from reshard.semantics.conventions import Convention

# Ranks that hold replicas only. Megatron's context-parallel ranks replicate the weights too
# (their replica_id is the data-parallel rank *with* context parallelism), so the replica
# degree the plans show is dp_replicate x cp; the checkpoint cannot tell the two apart.
REPLICA_NOTE = ("context-parallel ranks would hold replicas only as well: a run with cp states it with "
                "--from (cp x dp_replicate = the replicas shown)")


def recorded_layout(ix: Any, keys: Sequence[str], convention: Convention, findings: list[Finding]) -> Topology | None:
    """The layout the save plans record (source "checkpoint"), or None when they record none or do not fit.

    Only a convention with ``[topology] save_plans_rank_order`` reads plans (the mesh order,
    innermost first), from ``ix.save_plans`` (`reshard.storage.checkpoints.save_plans.SavePlans`: items per
    rank, or the ``problem`` that makes them no evidence, then a warning and the chunks alone
    decide as before). ``keys`` are the tensors whose chunks show the layout (the parameters).
    """
    rank_order = convention.save_plans_rank_order
    plans = getattr(ix, "save_plans", None)
    if not rank_order or plans is None:
        return None
    items_per_rank = plans.items_per_rank
    if plans.problem is not None or not items_per_rank:
        findings.append(Finding("warning", "save_plans_unused",
                                "the save plans in .metadata (all_local_plans) are not used as evidence: "
                                f"{plans.problem or 'they are empty'}", file=".metadata"))
        return None
    world = len(items_per_rank)
    writers = [r for r, n in enumerate(items_per_rank) if n]
    tp_seen = _writers_per_layer_piece(ix, keys)
    fit = _fit(rank_order, world, writers, tp_seen)
    if fit is None or (fit[1] == 1 and fit[2] > 1):
        # No idle rank and more writers than TP ranks: pipeline stages, or data-parallel ranks that
        # write shards of their own (the distributed optimizer); the plans do not say which.
        return None
    tp, dp, pp = fit
    idle = [r for r, n in enumerate(items_per_rank) if not n]
    evidence = [
        f"the save plans in .metadata (all_local_plans) record {world} ranks and agree item for item with the "
        f"stored chunks ({sum(items_per_rank)} items)",
        f"ranks {_ranks(writers)} planned {_counts([items_per_rank[r] for r in writers])} items"
        + (f"; ranks {_ranks(idle)} planned none: all they held were replicas another rank saved "
           "(Megatron saves replica_id 0 only)" if idle else ""),
        f"{tp_seen} ranks wrote the pieces of one layer of a tensor (tensor parallel {tp_seen})",
        f"with Megatron's rank order ({', '.join(rank_order)}, innermost first) the writers are the ranks at data-parallel "
        f"index 0 of tp={tp}, dp={dp}, pp={pp}, and of no other factorisation of {world} with tp={tp}",
    ]
    if dp > 1:
        evidence.append(REPLICA_NOTE)
    return Topology(pp=pp, dp_replicate=dp, tp=tp, source="checkpoint", evidence=tuple(evidence))


def check_given(given: Topology, recorded: Topology, where: str, origin: str = "--from") -> None:
    """A stated layout (``--from``, a profile's ``from``: ``origin``) that contradicts the recorded one is bad
    input naming both.

    Context-parallel and data-parallel replicas look the same in the checkpoint, so a stated
    layout fits when its ``dp_replicate x cp`` is the replica degree recorded.
    """
    said = [("world size", given.world_size, recorded.world_size), ("tp", given.tp, recorded.tp),
            ("pp", given.pp, recorded.pp), ("dp_shard", given.dp_shard, recorded.dp_shard),
            ("dp_replicate x cp", given.dp_replicate * given.cp, recorded.dp_replicate * recorded.cp)]
    wrong = [f"{name} {g} where the checkpoint shows {r}" for name, g, r in said if g != r]
    if not wrong:
        return
    raise BadInput(f"{origin} says the source layout is {given.spec()}, but the checkpoint records {recorded.spec()} "
                   f"(world size {recorded.world_size}): " + "; ".join(wrong) + ". Evidence: "
                   + "; ".join(recorded.evidence[:2]),
                   where=where,
                   hint=(f"Leave --from out (the recorded layout {recorded.spec()} is used) or pass --from {recorded.spec()}."
                         if origin.startswith("--from") else
                         f"Correct {origin}: remove it (the recorded layout {recorded.spec()} is used) or make it "
                         f"{recorded.spec()}; --from on the command line wins over it."))


def _fit(order: Sequence[str], world: int, writers: Sequence[int], tp: int) -> tuple[int, int, int] | None:
    """The (tp, dp, pp) of ``world`` with TP degree ``tp`` whose ranks at data-parallel index 0 (on the
    mesh ``order``, innermost first) are exactly ``writers`` (distinct ranks below ``world``), or None.

    Whatever the order, ``world / dp`` ranks sit at dp index 0, so the number of writers fixes dp
    (and pp = writers / tp): there is at most one candidate, and it fits when every writer is at dp
    index 0 (as many ranks as there are writers are, so then they are exactly the writers). Cost:
    one pass over the writers, whatever the world the plans claim.
    """
    n = len(writers)
    if n == 0 or tp < 1 or n % tp or world % n:
        return None
    degrees = {"tp": tp, "dp": world // n, "pp": n // tp}
    stride = 1
    for dim in order:
        if dim == "dp":
            break
        stride *= degrees[dim]
    dp = degrees["dp"]
    if any((r // stride) % dp for r in writers):
        return None
    return tp, dp, degrees["pp"]


def _writers_per_layer_piece(ix: Any, keys: Sequence[str]) -> int:
    """The most ranks that wrote chunks of one tensor at one dim-0 offset (one stacked layer, one vocab piece).

    Megatron stacks its transformer layers along dim 0 (a layer index, each layer held whole by one
    pipeline stage); the ranks that wrote pieces of one layer are its tensor-parallel ranks. The
    writer of a chunk is the rank its data file names (checked against the plans by storage).
    """
    writer_of: dict[str, int | None] = {}  # a few files, each named by thousands of chunks
    most = 1
    for k in keys:
        by_offset: dict[int, set[int]] = {}
        for c in ix.entries[k].chunks:
            if c.location is None or not c.box.offsets or not all(c.box.sizes):
                continue
            f = c.location.file
            w = writer_of[f] if f in writer_of else writer_of.setdefault(f, ix.writer_of(f))
            if w is not None:
                by_offset.setdefault(c.box.offsets[0], set()).add(w)
        most = max([most] + [len(ws) for ws in by_offset.values()])
    return most


MAX_LISTED = 16
"""Rank lists in the evidence name at most this many ranks (or runs of ranks): a forged plan list
claims as many idle ranks as its file has room for, and the report should not grow with them."""


def _ranks(values: Sequence[int]) -> str:
    """Ascending ranks as text: each one up to `MAX_LISTED`, else runs ``a-b``, the first `MAX_LISTED` of them."""
    if len(values) <= MAX_LISTED:
        return ", ".join(str(v) for v in values)
    runs: list[str] = []
    start = prev = values[0]
    for v in [*values[1:], None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if len(runs) > MAX_LISTED or v is None:
            break
        start = prev = v
    more = len(runs) > MAX_LISTED
    return ", ".join(runs[:MAX_LISTED]) + (", ..." if more else "") + f" ({len(values)} ranks)"


def _counts(values: Sequence[int]) -> str:
    """Item counts, one per rank: each up to `MAX_LISTED`, else the first ones and the total."""
    if len(values) <= MAX_LISTED:
        return ", ".join(str(v) for v in values)
    return ", ".join(str(v) for v in values[:MAX_LISTED]) + f", ... ({sum(values)} in all)"
