"""Every source key's action and every tensor's chunks on the target: the per-key part of a plan.

`reshard.planning.plan.make_plan` decides the placements and the trainer state's policies;
this module turns them into what the executor does key by key (`Keys`: tensors to write
with their chunks and local shapes, one `KeyAction` per key, the values a decision rewrote,
the tied pairs to check), which the slice (`reshard.planning.slice`) and the reduced copies
(`reshard.planning.decisions`) then adjust. It reads no tensor bytes.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reshard.model.dtypes import dtype_named
from reshard.model.tensor_values import is_tensor_value
from reshard.model.kinds import Action
from reshard.model.plan import KeyAction, TensorPlan
from reshard.model.layout import Placement, rank_sizes, target_chunks_cached
from reshard.semantics import placement as placement_mod
from reshard.semantics import data as data_mod
from reshard.semantics import rng as rng_mod
from reshard.semantics import schedule as schedule_mod
from reshard.model.topology import Topology


@dataclass
class Keys:
    """What the executor does, key by key: tensors to write, one action per key, values to write, tie checks."""

    tensors: list[TensorPlan] = field(default_factory=list)
    actions: list[KeyAction] = field(default_factory=list)
    new_values: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, str] = field(default_factory=dict)


def key_actions(ix: Any, cls: Any, mdict: dict[str, Any], geo: placement_mod.Geometry, target: Topology,
                sdec: schedule_mod.ScheduleDecision | None, ddec: data_mod.DataDecision, rdec: rng_mod.RngDecision,
                reasons: list[str], chosen: dict[str, tuple[str, str]] | None = None) -> Keys:
    """Every source key's fate, in the source's key order, then the keys the target adds.

    ``chosen`` holds the user's decisions on unknown keys (``--keep``/``--drop``, `reshard.planning.plan`'s `_chosen_roles`).
    """
    keys = Keys()
    rewrites = _rewrites(ix, sdec, ddec, rdec)
    chosen = chosen or {}
    dropped = {**ddec.dropped, **rdec.dropped, **{k: why for k, (a, why) in chosen.items() if a == Action.DROPPED}}
    kept = {k: why for k, (a, why) in chosen.items() if a == Action.CARRIED}
    for key, e in ix.entries.items():
        _plan_source_key(key, e, keys, cls=cls, geo=geo, target=target, rewrites=rewrites, dropped=dropped,
                         reasons=reasons, kept=kept)
    _tied_checks(cls, mdict, geo, keys.checks)
    _add_tied_copies(ix, cls, geo, target, keys)
    _add_new_rank_state(ix, ddec, rdec, keys)
    fill_local_shapes(keys.tensors, target)
    return keys


def _rewrites(ix: Any, sdec: schedule_mod.ScheduleDecision | None, ddec: data_mod.DataDecision,
              rdec: rng_mod.RngDecision) -> dict[str, tuple[str, Any]]:
    """Source key -> (why, new value) for the schedule, data and RNG state the decisions rewrite."""
    rewrites: dict[str, tuple[str, Any]] = {}
    if sdec:
        for k, (_, new) in sdec.rewrites.items():
            rewrites[k] = (f"schedule position remapped (--schedule {sdec.policy})", new)
    for k, v in ddec.writes.items():
        if k in ix.entries:
            rewrites[k] = (ddec.rewritten.get(k, "data position rewritten"), v)
    for k, v in rdec.writes.items():
        if k in ix.entries:
            rewrites[k] = (rdec.rewritten.get(k, "RNG reseeded"), v)
    return rewrites


def _plan_source_key(key: str, e: Any, keys: Keys, *, cls: Any, geo: placement_mod.Geometry, target: Topology,
                     rewrites: dict[str, tuple[str, Any]], dropped: dict[str, str], reasons: list[str],
                     kept: dict[str, str] | None = None) -> None:
    """One source key: dropped by a decision, rewritten, refused (unknown), a dropped tied copy, resharded or carried.

    An unknown key is refused unless the user decided it (``--keep`` puts it in ``kept``, now
    role ``other``; ``--drop`` in ``dropped``): the error names every way to decide it.
    """
    role = cls.roles[key].role
    if key in dropped:
        keys.actions.append(KeyAction(key, role, Action.DROPPED, dropped[key]))
        return
    if key in rewrites:
        why, value = rewrites[key]
        keys.new_values[key] = value
        keys.actions.append(KeyAction(key, role, Action.REWRITTEN, why, rank=_owner_rank(key, cls, target)))
        if e.is_tensor:
            keys.tensors.append(_replicated(key, role, value, _owner_rank(key, cls, target)))
        return
    if role == "unknown":
        reasons.append(f"key '{key}' matches no rule of convention '{cls.convention.name}': reshard does not guess "
                       "what it means; give it a role with --convention FILE (a convention TOML whose rule matches "
                       f"it), carry it unchanged with --keep PATTERN, or leave it out with --drop PATTERN "
                       f"(e.g. --keep '^{re.escape(key)}$')")
        keys.actions.append(KeyAction(key, role, Action.DROPPED, "unknown key: refused"))
        return
    if key in geo.tied_actions and geo.tied_actions[key][0] == Action.DROPPED:
        _, why, equal_to = geo.tied_actions[key]
        keys.actions.append(KeyAction(key, role, Action.DROPPED, why))
        if equal_to:
            keys.checks[key] = equal_to
        return
    why_kept = (kept or {}).get(key)
    if e.is_tensor:
        tensor, action = _placed_tensor(key, role, e, geo.by_key[key], cls, target)
        if why_kept:
            action.reason = f"{why_kept} ({action.reason})"
        keys.tensors.append(tensor)
        keys.actions.append(action)
    else:
        keys.actions.append(KeyAction(key, role, Action.CARRIED, why_kept or "object, unchanged",
                                      rank=_owner_rank(key, cls, target)))


def _placed_tensor(key: str, role: str, e: Any, tg: placement_mod.TensorGeometry, cls: Any,
                   target: Topology) -> tuple[TensorPlan, KeyAction]:
    """A source tensor at its target placement: sharded ones are resharded, replicated ones carried to their owner."""
    placement = tg.placement
    owner = _owner_rank(key, cls, target)
    chunks = list(target_chunks_cached(tuple(tg.target_shape), placement, target))
    if placement.kind == "replicate" and owner:
        chunks = [(owner, o, z) for _rk, o, z in chunks]
    tensor = TensorPlan(key, role, tg.target_shape, e.dtype_name or "", placement, chunks, tg.transform)
    why = placement.describe()
    if tg.transform:
        why += "; " + _describe_transform(tg.transform)
    action = KeyAction(key, role, Action.RESHARDED if placement.kind == "shard" else Action.CARRIED,
                       why if placement.kind == "shard" or tg.transform else why + ", unchanged",
                       rank=None if placement.kind == "shard" else chunks[0][0] if chunks else owner)
    return tensor, action


def _tied_checks(cls: Any, mdict: dict[str, Any], geo: placement_mod.Geometry, checks: dict[str, str]) -> None:
    """Tied weights must be equal, or the conversion would pick one copy silently: convert checks each pair."""
    param_keys = {r_.param: k for k, r_ in cls.roles.items() if r_.role == "parameter" and r_.param}
    declared = [tuple(t) for t in ((mdict.get("model") or {}).get("tied") or []) if len(t) == 2]
    for a_key, b_key in geo.tied_params + [(param_keys[a], param_keys[b]) for a, b in declared
                                           if a in param_keys and b in param_keys]:
        checks[b_key] = a_key


def _add_tied_copies(ix: Any, cls: Any, geo: placement_mod.Geometry, target: Topology, keys: Keys) -> None:
    """Tied copies the target needs but the source did not save (e.g. the output head on the last stage)."""
    for key, (action, why, src_key) in geo.tied_actions.items():
        if action != Action.ADDED or src_key is None:
            continue
        se = ix.entries[src_key]
        role = cls.roles[src_key].role
        if not se.is_tensor:
            keys.new_values[key] = ix.read_object(src_key)
            keys.actions.append(KeyAction(key, role, Action.ADDED, why, rank=0))
            continue
        src_geo = geo.by_key[src_key]
        pl = Placement(dp_shard=src_geo.placement.dp_shard, tp_dim=src_geo.placement.tp_dim, stage=target.pp - 1)
        chunks = list(target_chunks_cached(tuple(src_geo.target_shape), pl, target))
        keys.tensors.append(TensorPlan(key, role, src_geo.target_shape, se.dtype_name or "", pl,
                                       chunks, src_geo.transform, copy_from=src_key))
        keys.actions.append(KeyAction(key, role, Action.ADDED, why))


def _add_new_rank_state(ix: Any, ddec: data_mod.DataDecision, rdec: rng_mod.RngDecision, keys: Keys) -> None:
    """Data and RNG state for target ranks the source did not have."""
    for k, v in list(ddec.writes.items()) + list(rdec.writes.items()):
        if k in ix.entries:
            continue
        role = "data" if k in ddec.writes else "rng"
        rank = _rank_from_key(k)
        why = (f"new rank {rank}: " if rank is not None else "") + ("data position " + ddec.policy if role == "data" else rdec.per_rank.get(rank, "RNG"))
        keys.new_values[k] = v
        keys.actions.append(KeyAction(k, role, Action.ADDED, why, rank=rank if rank is not None else 0))
        if is_tensor_value(v):  # a torch.Tensor or an ArrayTensor (reshard.model.tensor_values)
            keys.tensors.append(_replicated(k, role, v, rank or 0))


def fill_local_shapes(tensors: list[TensorPlan], target: Topology) -> None:
    """Each holding rank's local shape, so an uneven split is visible in the plan.

    One dict per distinct (shape, placement), shared by the tensors that have it (read-only):
    a model's thousands of tensors have a few dozen shapes, and a dict per tensor over 16,384
    ranks would be millions of entries.
    """
    shared: dict[tuple, dict[int, tuple[int, ...]]] = {}
    for t in tensors:
        k = (tuple(t.shape), t.placement)
        local = shared.get(k)
        if local is None:
            held, sizes = rank_sizes(tuple(t.shape), t.placement, target)
            ranks = np.flatnonzero(held)
            local = shared[k] = dict(zip(ranks.tolist(), map(tuple, sizes[ranks].tolist())))
        t.local = local


def _describe_transform(t: dict[str, Any]) -> str:
    if t["kind"] == "select":
        return f"rows {t['index']} of {t['from_rows']} along dim {t['dim']} kept (a slice of the experts)"
    if t["kind"] == "reinterleave":
        return f"fused parts {t['parts']} re-interleaved for tp {t['from_tp']} -> {t['to_tp']}"
    return f"vocab {t['vocab']} padded {t['from_rows']} -> {t['to_rows']} rows (fill {t['fill']})"


def per_rank_prefix(data_roles) -> str:
    for x in data_roles:
        if x.rank is not None:
            return x.key[: len(x.key) - len(str(x.rank))]
    return "data.rank_"


_RANK_IN_KEY = re.compile(r"(?:rank_|dp_rank_)(\d+)")


def _rank_from_key(key: str) -> int | None:
    if "rank_" not in key:  # the search below costs more than this test, on every key of a plan
        return None
    m = _RANK_IN_KEY.search(key)
    return int(m.group(1)) if m else None


def _owner_rank(key: str, cls, target: Topology) -> int:
    """Per-rank state lives in its rank's file (each rank reads only its own); the rest in rank 0's."""
    role = cls.roles.get(key)
    if role is not None and role.rank is not None and role.rank < target.world_size:
        if role.role == "data":  # dp rank k -> the first global rank with dp_shard index k
            from reshard.model.layout import rank_of

            return rank_of(target, dp_shard=role.rank % target.dp_shard, dp_replicate=role.rank // target.dp_shard)
        return role.rank
    r = _rank_from_key(key)
    if r is not None and r < target.world_size and (key.startswith("rng.") or key.startswith("dataloader.")):
        return r
    return 0


def _replicated(key: str, role: str, value: Any, rank: int) -> TensorPlan:
    """A new tensor value (a torch.Tensor or an ArrayTensor) held whole by one rank."""
    shape = tuple(value.shape)
    return TensorPlan(key, role, shape, str(value.dtype).removeprefix("torch."), Placement.replicated(),
                      [(rank, tuple(0 for _ in shape), shape)])


def dtype_size(name: str) -> int:
    """Bytes per element of the dtype torch names ``name`` (a plan's dtypes are names)."""
    return dtype_named(name).itemsize
