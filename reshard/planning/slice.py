"""A slice of the model (``--layers`` / ``--experts``) applied to a plan's key actions.

A slice is a smaller model of the same family (`reshard.semantics.slicing` says which key
belongs to which layer or expert, and the renumbering): here the actions every source key
already has (`reshard.planning.keys`) become the slice's (keys of the layers left out
dropped and counted, kept layers renamed (`Action.RENAMED`, from and to), optimizer groups' parameter lists rewritten, a
router's rows selected), with the summary the plan, its report and the lineage carry, and
the verdict's account of what of the source the slice keeps.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from reshard.errors import BadInput
from reshard.model.plan import KeyAction, Options, TensorPlan
from reshard.model.layout import target_chunks_cached
from reshard.planning.keys import Keys, dtype_size, fill_local_shapes
from reshard.semantics import slicing as slicing_mod
from reshard.semantics.rules import select as select_rules
from reshard.units import human_bytes
from reshard.model.topology import Topology
from reshard.model.kinds import Action, SliceFate


@dataclass
class _Sliced:
    """A slice applied to the key actions: its summary (plan JSON, report, lineage) and the renamed keys."""

    slice: slicing_mod.Slice
    summary: dict[str, Any]
    renamed: dict[str, str]  # target key -> source key
    moment_params: int       # parameters of the slice with optimizer moments


def apply_slice(ix: Any, cls: Any, mdict: dict[str, Any], options: Options, keys: Keys,
                target: Topology) -> _Sliced | None:
    """``--layers`` / ``--experts``: a smaller model of the same family, cut by the family's description.

    Every key that names a parameter of a layer left out (its model key, its optimizer state,
    its per-parameter hyper-parameters) is dropped with the reason "layer N not in the slice"
    and counted with its bytes. A kept layer is renumbered densely: its keys are written
    under their new names (the new key ``renamed`` from the source key, its tensor copied from
    it as a tied copy is; the source key ``renamed`` to the new one, nothing written under its
    old name), model and optimizer keys alike, and an
    optimizer group's list of parameter FQNs is rewritten to the slice's. Everything else
    (embeddings, final norm and head, counters, schedule, data position, RNG) is planned as
    for any transition.
    """
    if options.layers is None and options.experts is None:
        return None
    if target.pp > 1:
        raise BadInput(f"a slice (--layers/--experts) is laid out for pp=1, and --to {options.to} has pp={target.pp}",
                       hint="Make the slice at pp=1 (e.g. --to dp=2), then convert the slice to the pipeline "
                            "layout: its stages are cut over the slice's renumbered layers.")
    params = sorted({x.param for x in cls.roles.values() if x.role == "parameter" and x.param})
    model = mdict.get("model") or {}
    rules = select_rules(params, family=model.get("family"), rules_file=options.rules)
    config = {**(model.get("config") or {}), **(options.model_config or {})}
    shapes = {x.param: tuple(ix.entries[k].shape) for k, x in cls.roles.items()
              if x.role == "parameter" and x.param and k in ix.entries and ix.entries[k].is_tensor}
    sl = slicing_mod.plan_slice(rules, params, layers=options.layers, experts=options.experts, config=config,
                                shapes=shapes)
    planned = {t.key: t for t in keys.tensors}
    fates: dict[str, slicing_mod.Fate] = {}
    for a in keys.actions:
        role = cls.roles.get(a.key)
        if role is not None and role.role in slicing_mod.LAYERED_ROLES and a.action not in (Action.DROPPED, Action.ADDED):
            fates[a.key] = sl.fate(a.key, role.param)
    # target name -> the source key whose values it takes. A renumbered layer takes the names of
    # a source layer (layer 3 of the source is layer 1 of the slice): that source key's one
    # action becomes "renamed" (from the renamed key), its tensor copied from it (`TensorPlan.copy_from`).
    renamed = {f.new_key: k for k, f in fates.items() if f.kind == SliceFate.RENAMED and f.new_key}
    lists = {"rewritten": 0, "fqns_dropped": 0, "fqns_renamed": 0}
    dropped: dict[str, dict[str, int]] = {}
    tensors: dict[str, TensorPlan | None] = {}  # source key -> its tensor on the target (None: none)
    added: list[KeyAction] = []
    by_key = {a.key: a for a in keys.actions}
    for a in list(keys.actions):
        fate = fates.get(a.key)
        if fate is None:
            continue
        role = cls.roles[a.key].role
        if fate.kind in (SliceFate.DROPPED, SliceFate.RENAMED) and a.key not in renamed:
            if fate.kind == SliceFate.DROPPED:
                d = dropped.setdefault(fate.reason, {"keys": 0, "bytes": 0})
                d["keys"] += 1
                d["bytes"] += ix.entries[a.key].nbytes if ix.entries[a.key].is_tensor else 0
                a.action, a.reason = Action.DROPPED, fate.reason
            else:  # its values go under the slice's name (below); nothing is written under this one
                a.action, a.reason, a.renamed_to = Action.RENAMED, fate.reason, fate.new_key
            a.rank = None
            keys.new_values.pop(a.key, None)
            tensors[a.key] = None
        elif fate.kind in (SliceFate.KEPT, SliceFate.OUTSIDE):
            value = _sliced_fqn_list(ix, sl, a.key, role, keys, lists)
            if value is not None:
                keys.new_values[a.key] = value
                a.action = Action.REWRITTEN
                a.reason = "the slice's parameter list (FQNs of the parameters left out removed, kept ones renumbered)"
    for new, old in renamed.items():
        fate, src_action = fates[old], by_key[old]
        target_action = by_key.get(new)
        t = planned.get(old)
        if t is not None:
            t = dataclasses.replace(t, key=new, copy_from=None if old in keys.new_values else old)
        own = fates.get(new)
        why = fate.reason + (
            f" (the source's own values under this name: {own.reason if own.kind == SliceFate.DROPPED else 'renamed too'})"
            if own is not None and own.kind != SliceFate.KEPT else "")
        if old in keys.new_values:
            keys.new_values[new] = keys.new_values[old]
        elif t is not None:
            keys.new_values.pop(new, None)  # its values are the copy's, not a value of its own
        else:
            value = _sliced_fqn_list(ix, sl, old, cls.roles[old].role, keys, lists)
            keys.new_values[new] = value if value is not None else ix.read_object(old)
        if own is not None and own.kind == SliceFate.DROPPED:
            d = dropped.setdefault(own.reason, {"keys": 0, "bytes": 0})
            d["keys"] += 1
            d["bytes"] += ix.entries[new].nbytes if ix.entries[new].is_tensor else 0
        rank = src_action.rank if t is None or src_action.rank is not None else None
        if target_action is not None:  # a source key of that name: one action, now "renamed" (from ``old``)
            target_action.action, target_action.reason, target_action.rank = Action.RENAMED, why, rank
            target_action.renamed_from = old
        else:
            added.append(KeyAction(new, src_action.role, Action.RENAMED, why, rank=rank, renamed_from=old))
        tensors[new] = t
        src_action.renamed_to = new
        if old not in renamed:  # else ``old`` is also a new name (a chain of renumberings): written, from another
            src_action.action, src_action.reason, src_action.rank = Action.RENAMED, fate.reason, None
            tensors.setdefault(old, None)
    for old in renamed.values():
        if old not in renamed:
            keys.new_values.pop(old, None)
    keys.actions.extend(added)
    out = [tensors.get(t.key, t) if t.key in tensors else t for t in keys.tensors]
    have = {t.key for t in out if t is not None}
    out += [t for k, t in tensors.items() if t is not None and k not in have and k not in planned]
    keys.tensors[:] = [t for t in out if t is not None]
    _select_router_rows(sl, cls, keys, target)
    size = sum(int(np.prod(t.shape, dtype=np.int64)) * dtype_size(t.dtype) for t in keys.tensors if t.dtype)
    moments = {cls.roles[t.copy_from or t.key].param for t in keys.tensors
               if t.role == "optimizer_moment" and (t.copy_from or t.key) in cls.roles}
    outside = [p for p in params if sl.fate(p, p).kind == SliceFate.OUTSIDE]
    summary = {**sl.to_dict(),
               "kept": {"keys": sum(1 for a in keys.actions if not a.left_out), "tensors": len(keys.tensors),
                        "bytes": size, "outside_layers": outside},
               "renamed": {"keys": len(renamed), "from_to": [[v, k] for k, v in renamed.items()]},
               "dropped": {"keys": sum(d["keys"] for d in dropped.values()),
                           "bytes": sum(d["bytes"] for d in dropped.values()), "by_reason": dropped},
               "fqn_lists": lists}
    return _Sliced(sl, summary, renamed, len(moments))


def _select_router_rows(sl: slicing_mod.Slice, cls: Any, keys: Keys, target: Topology) -> None:
    """``--experts``: a router parameter, or experts stacked in one tensor (and their moments), keeps the rows
    of the kept experts along its expert axis (transform ``select``).

    The tensor is read whole, its rows picked and re-cut, like a TP-dependent layout
    (`reshard.semantics.transforms.write_transformed`); convert proves it against the source's rows.
    """
    by_key = {a.key: a for a in keys.actions if not a.left_out}
    changed = []
    for t in keys.tensors:
        src = t.copy_from or t.key
        role = cls.roles.get(src)
        if role is None or t.role not in ("parameter", "optimizer_moment"):
            continue
        rows = sl.rows_kept(role.param)
        if rows is None:
            continue
        dim, index = rows
        count = next(a.count for a in sl.axes if a.what == "expert")
        if t.transform or dim >= len(t.shape) or t.shape[dim] != count:
            raise BadInput(f"parameter '{src}' (one row per expert: [experts] router/stacked) cannot keep the rows "
                           f"of experts {list(index)}: "
                           + ("it is already rewritten for this target (" + t.transform["kind"] + ")" if t.transform
                              else f"its shape {list(t.shape)} has no dim {dim} of {count} experts"),
                           where=sl.rules_source,
                           hint="Check [experts] router in the rules (dim: the axis with one row per expert), "
                                "or slice the experts at the source's tensor-parallel degree.")
        shape = tuple(len(index) if d == dim else n for d, n in enumerate(t.shape))
        owner = t.chunks[0][0] if t.chunks and t.placement.kind == "replicate" else None
        t.shape, t.transform = shape, {"kind": "select", "dim": dim, "index": list(index), "from_rows": count,
                                       "to_rows": len(index)}
        t.chunks = [(owner if owner is not None else r, o, z) for r, o, z in target_chunks_cached(shape, t.placement, target)]
        a = by_key.get(t.key)
        if a is not None:
            a.reason += f"; the rows of experts {','.join(map(str, index))} of {count} kept (--experts)"
        changed.append(t)
    if changed:
        fill_local_shapes(changed, target)


def _sliced_fqn_list(ix: Any, sl: slicing_mod.Slice, key: str, role: str, keys: Keys,
                     lists: dict[str, int]) -> list[Any] | None:
    """An optimizer group's ``params`` (a list of parameter FQNs) for the slice; None: not such a list, or unchanged."""
    e = ix.entries[key]
    if role != "param_group" or e.is_tensor or key.rsplit(".", 1)[-1] != "params":
        return None
    value = keys.new_values.get(key) if key in keys.new_values else ix.read_object(key)
    got = sl.rename_fqns(value) if isinstance(value, list) else None
    if got is None:
        return None
    new, n_dropped, n_renamed = got
    lists["rewritten"] += 1
    lists["fqns_dropped"] += n_dropped
    lists["fqns_renamed"] += n_renamed
    return new


def slice_verdict(verdict: dict[str, Any], sliced: _Sliced, reasons: list[str]) -> None:
    """A slice is a warm start of a different model: the verdict says exactly what of the source it keeps."""
    s = sliced.summary
    ends = s["kept"]["outside_layers"]
    kept = (f"{sliced.slice.describe()}; kept outside the layers: {', '.join(ends[:6])}"
            + (f" (+{len(ends) - 6})" if len(ends) > 6 else "")
            + f"; {s['kept']['tensors']} tensors, {human_bytes(s['kept']['bytes'])}"
            + f"; dropped {s['dropped']['keys']} keys ({human_bytes(s['dropped']['bytes'])}) of the "
              f"{' and '.join(a.what + 's' for a in sliced.slice.axes)} left out")
    verdict["kept"] = {"model": {"status": "sliced", "note": kept}, **verdict["kept"]}
    opt = verdict["kept"].get("optimizer_state")
    if opt and opt["status"] == "carried":
        opt["note"] = (opt["note"].split(" for ")[0] + f" for the {sliced.moment_params} parameters of the slice, "
                       "bitwise (those of the parameters left out are dropped with them)")
    verdict["warm_start_reasons"].insert(0, "a different model: a slice of the source (" + kept + ")")
    verdict["warm_start_of"] = ["model"] + [f for f in verdict["warm_start_of"] if f != "model"]
    if not reasons:
        verdict["kind"] = "warm_start"
