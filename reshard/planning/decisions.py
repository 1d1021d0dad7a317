"""What a plan keeps of the run and what it costs: the verdict, the kept state, reduced copies and memory.

Once every key has its action (`reshard.planning.keys`), these decide what the plan says
about the run: the verdict (continuation, continuation with changes, warm start,
infeasible) and its reasons, for each part of the training state whether it is carried,
rewritten, lost or absent (`kept`), what a reduced copy for testing drops or casts
(``--only``, ``--dtype``: `reduce`) and the bytes each target rank holds (`memory`).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from reshard.errors import BadInput
from reshard.model.dtypes import dtype_named
from reshard.model.plan import DTYPES, NOT_CAST, KeyAction, Options, TensorPlan
from reshard.model.layout import local_box, rank_sizes
from reshard.planning.keys import dtype_size
from reshard.semantics import batch as batch_mod
from reshard.semantics import data as data_mod
from reshard.semantics import rng as rng_mod
from reshard.semantics import schedule as schedule_mod
from reshard.model.topology import Topology
from reshard.model.inspection import OptimizerHealth
from reshard.model.plan_sections import KeptFacet, MemorySection, Verdict
from reshard.model.kinds import Action


def plan_verdict(optimizer: OptimizerHealth, bdec: batch_mod.BatchDecision, sdec: schedule_mod.ScheduleDecision | None,
                 ddec: data_mod.DataDecision, rdec: rng_mod.RngDecision, reasons: list[str], same_positions: bool,
                 numerics: list[str], reduced: list[str]) -> Verdict:
    """The verdict on the decisions, plus the placements' numeric changes; a reduced copy is a warm start."""
    verdict = _verdict(optimizer, bdec, sdec, ddec, rdec, reasons, same_positions)
    verdict["changes"].extend(numerics)
    if reduced and not reasons:
        verdict["warm_start_reasons"].extend(reduced)
        verdict["kind"] = "warm_start"
    return verdict


OPTIMIZER_ROLES = ("optimizer_moment", "optimizer_step", "param_group")


def reduce(options: Options, tensors: list[TensorPlan], actions: list[KeyAction], ix) -> list[str]:
    """Reduced copies for testing (`--only`, `--dtype`): what they drop or cast, said out loud.

    Such a copy is never the real continuation: the verdict becomes a warm start and the
    reasons list exactly what it keeps, so nobody mistakes it for the run itself.
    """
    reasons: list[str] = []
    if options.only not in (None, "model", "model+optim"):
        raise BadInput(f"unknown --only '{options.only}'", hint="Use model or model+optim.")
    if options.only == "model":
        dropped = 0
        for a in actions:
            if a.role in OPTIMIZER_ROLES and a.action != Action.DROPPED:
                a.action, a.reason, a.rank = Action.DROPPED, "--only model: a reduced copy without optimizer state", None
                a.renamed_from = a.renamed_to = None  # a slice's renumbered moment: dropped under either name
                dropped += 1
        tensors[:] = [t for t in tensors if t.role not in OPTIMIZER_ROLES]
        reasons.append(f"reduced copy: optimizer state dropped ({dropped} keys, --only model)")
    if options.dtype is not None:
        name = DTYPES.get(options.dtype)
        if name is None:
            raise BadInput(f"unknown --dtype '{options.dtype}'", hint="Use bf16, fp16 or fp32.")
        cast = 0
        by_key = {a.key: a for a in actions}
        for t in tensors:
            if t.role in ("parameter", "optimizer_moment") and dtype_named(t.dtype).is_floating_point \
                    and t.dtype != name and t.dtype not in NOT_CAST:
                a = by_key.get(t.key)
                t.dtype = name
                if a is not None:
                    a.reason += f"; cast to {name}"
                cast += 1
        if cast:
            reasons.append(f"reduced copy: {cast} parameter and moment tensors cast to {name} (--dtype {options.dtype})")
    return reasons


def memory(tensors: list[TensorPlan], ix, cls, target: Topology, *, same_storage: set[str] = frozenset(),
           extra_trainable: set[str] = frozenset(), renamed: dict[str, str] | None = None) -> MemorySection:
    """Bytes each target rank holds: parameters, gradients (trainable parameters), optimizer state.

    A tied copy that shares storage with its tie on the target is counted once. Computed per
    distinct (shape, placement, dtype, category) with numpy over all ranks at once
    (`reshard.model.layout.rank_sizes`), times the number of tensors that share it; "other"
    tensors count on the ranks that write them only. ``renamed``: target key -> source key of
    the keys a slice renumbered (their roles are the source keys').
    """
    renamed = renamed or {}
    trainable = {x.param for x in cls.roles.values() if x.role == "optimizer_moment"} | set(extra_trainable)
    world = target.world_size
    acc = {name: np.zeros(world, dtype=np.int64) for name in ("parameters", "gradients", "optimizer", "other")}
    groups: dict[tuple, int] = {}
    for t in tensors:
        if t.key in same_storage:
            continue
        if t.role == "parameter":
            role = cls.roles.get(renamed.get(t.key, t.key))
            cats: tuple[str, ...] = ("parameters", "gradients") if role is not None and role.param in trainable else ("parameters",)
        elif t.role in ("optimizer_moment", "optimizer_step"):
            cats = ("optimizer",)
        else:
            for rank in sorted({c[0] for c in t.chunks}):
                box = local_box(t.shape, t.placement, target, rank) if 0 <= rank < world else None
                if box is not None:
                    acc["other"][rank] += box.numel * dtype_size(t.dtype)
            continue
        k = (tuple(t.shape), t.placement, t.dtype, cats)
        groups[k] = groups.get(k, 0) + 1
    for (shape, placement, dtype, cats), count in groups.items():
        held, sizes = rank_sizes(shape, placement, target)
        nbytes = np.where(held, sizes.prod(axis=1) if shape else 1, 0) * dtype_size(dtype) * count
        for c in cats:
            acc[c] += nbytes
    total = sum(acc.values())
    per_rank = [{"rank": r, "parameters": p, "gradients": g, "optimizer": o, "other": x, "total": tt}
                for r, (p, g, o, x, tt) in enumerate(zip(*(a.tolist() for a in (*acc.values(), total))))]
    return {"per_rank": per_rank, "max": int(total.max()) if world else 0, "min": int(total.min()) if world else 0,
            "note": "gradients assume the parameter dtype; activations and communication buffers are not included"}


# Facets whose loss makes the resumed run a warm start (RNG and the schedule are rewritten or
# rebuilt by the trainer; losing them changes the run's noise, not what it has learned or seen).
WARM_FACETS = ("optimizer_state", "data_position")


def kept(optimizer: OptimizerHealth, cls: Any, sdec: schedule_mod.ScheduleDecision | None, ddec: data_mod.DataDecision,
         rdec: rng_mod.RngDecision, acc_out: dict[str, Any], reduced: list[str]) -> dict[str, KeptFacet]:
    """For each part of the training state: carried, rewritten, lost, or absent from the source, and why.

    This is the verdict's detail: "warm start" alone does not say that every Adam moment was
    carried bitwise and only the data order is new, and that difference matters to the user.
    """
    def rec(status: str, note: str) -> KeptFacet:
        return {"status": status, "note": note}

    opt = optimizer
    if reduced and any("optim" in x for x in reduced):
        optimizer = rec("lost", "; ".join(reduced))
    elif opt["moment_names"]:
        optimizer = rec("carried", f"{', '.join(opt['moment_names'])} for {opt['with_moments']} parameters, bitwise")
    else:
        optimizer = rec("absent", "no optimizer moments in the source: the optimizer starts fresh")
    sched_keys = [x.key for x in cls.roles.values() if x.role == "scheduler"]
    if sdec is not None and sdec.policy in ("steps", "tokens"):
        schedule = rec("rewritten", sdec.note)
    elif sched_keys:
        schedule = rec("carried", f"{len(sched_keys)} scheduler keys unchanged" + (f"; {sdec.note}" if sdec and sdec.note else ""))
    else:
        schedule = rec("absent", "no scheduler state in the source: the trainer rebuilds its schedule from the step")
    if ddec.kind == "none":
        data = rec("absent", ddec.note)
    elif not ddec.continuity:
        data = rec("lost", ddec.note)
    else:
        data = rec("rewritten" if ddec.writes or ddec.rewritten or ddec.policy == "translate" else "carried", ddec.note)
    if rdec is None or rdec.policy == "none":
        rng = rec("absent", (rdec.note if rdec is not None else "") or "no RNG state in the source")
    elif rdec.policy == "drop":
        rng = rec("lost", rdec.note)
    else:
        rng = rec("carried" if rdec.streams_kept else "rewritten", rdec.note)
    # no manifest records the phase: a step boundary is assumed, not carried (one word in plan, report and JSON)
    accumulation = rec(("carried" if acc_out.get("micro_step") is not None else "assumed") if acc_out.get("ok")
                       else "lost", acc_out.get("note", ""))
    return {"optimizer_state": optimizer, "lr_schedule": schedule, "data_position": data, "rng": rng,
            "accumulation_phase": accumulation}


# The start of the change a new world size always brings (numerics, not meaning): the verdict
# tells it apart from changes that make a continuation "with changes".
SUM_ORDER = "gradients are summed in another order"


def _verdict(optimizer: OptimizerHealth, bdec, sdec, ddec, rdec, reasons, same_positions) -> Verdict:
    warm: list[str] = []
    changes: list[str] = []
    if not optimizer["moment_names"]:
        warm.append("no optimizer moments in the source: fresh Adam state")
    if ddec is not None and not ddec.continuity:
        warm.append("data continuity lost: " + ddec.note)
    if bdec.kept is False and bdec.feasible:
        changes.append(bdec.note)
    elif bdec.kept is None:
        changes.append("batch recipe unknown: global batch not checked")
    if bdec.before and bdec.after and bdec.after.grad_accum != bdec.before.grad_accum:
        changes.append(f"accumulation {bdec.before.grad_accum} -> {bdec.after.grad_accum} (global batch kept; reduction order differs)")
    if bdec.before and bdec.after and bdec.after.micro_batch != bdec.before.micro_batch:
        changes.append(f"micro-batch {bdec.before.micro_batch} -> {bdec.after.micro_batch} per rank "
                       f"(activation memory per rank x{bdec.after.micro_batch / bdec.before.micro_batch:g})")
    if sdec is not None and sdec.policy in ("steps", "tokens"):
        changes.append("LR schedule: " + sdec.note)
    if rdec is not None and not rdec.streams_kept:
        changes.append("RNG: " + rdec.note)
    if not same_positions:
        changes.append(f"{SUM_ORDER} over a different number of ranks: losses match to rounding, not bitwise")
    if reasons:
        kind = "infeasible"
    elif warm:
        kind = "warm_start"
    elif any(not c.startswith((SUM_ORDER, "accumulation", "micro-batch")) for c in changes):
        kind = "continuation_with_changes"
    else:
        kind = "continuation"
    return {"kind": kind, "warm_start_reasons": warm, "changes": changes}
