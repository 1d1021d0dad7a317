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
stored items (`reshard.storage.save_plans`), the geometry as the index's chunk offsets and data file names.
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
    innermost first), from ``ix.save_plans`` (`reshard.storage.save_plans.SavePlans`: items per
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
    writers = frozenset(r for r, n in enumerate(items_per_rank) if n)
    tp_seen = _writers_per_layer_piece(ix, keys)
    fits = [(t, d, p) for t, d, p in _factorisations(world)
            if t == tp_seen and _writers_at_dp0(rank_order, {"tp": t, "dp": d, "pp": p}, world) == writers]
    if len(fits) != 1 or (fits[0][1] == 1 and fits[0][2] > 1):
        # No idle rank and more writers than TP ranks: pipeline stages, or data-parallel ranks that
        # write shards of their own (the distributed optimizer); the plans do not say which.
        return None
    tp, dp, pp = fits[0]
    idle = sorted(set(range(world)) - writers)
    evidence = [
        f"the save plans in .metadata (all_local_plans) record {world} ranks and agree item for item with the "
        f"stored chunks ({sum(items_per_rank)} items)",
        f"ranks {_ranks(sorted(writers))} planned {_ranks([items_per_rank[r] for r in sorted(writers)])} items"
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


def _factorisations(world: int) -> list[tuple[int, int, int]]:
    """Every (tp, dp, pp) whose product is ``world``."""
    divisors = [n for n in range(1, world + 1) if world % n == 0]
    return [(t, d, world // (t * d)) for t in divisors for d in divisors if (world // t) % d == 0]


def _writers_at_dp0(order: Sequence[str], degrees: dict[str, int], world: int) -> frozenset[int]:
    """Ranks whose data-parallel coordinate is 0 on the mesh ``order`` (innermost first)."""
    stride = 1
    for dim in order:
        if dim == "dp":
            break
        stride *= degrees.get(dim, 1)
    dp = degrees.get("dp", 1)
    return frozenset(r for r in range(world) if (r // stride) % dp == 0)


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


def _ranks(values: Sequence[int]) -> str:
    return ", ".join(str(v) for v in values)
