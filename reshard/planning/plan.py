"""The planner: a plan (`reshard.model.plan`) is a pure function of (source, options); plain data that says, for every source key, what
happens to it, for every tensor which boxes each target rank owns, and how trainer state
(batch recipe, schedule, data position, RNG) is rewritten, plus an honest verdict.

`reshard convert` executes exactly this plan. Reading no tensor bytes, planning costs
about as much as `inspect`; the few small objects it opens (counters, per-rank loader
states, scheduler position) are read through the safe reader.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from reshard.gc_pause import paused_gc
from reshard.errors import BadInput
from reshard.model.inspection import Inspection
from reshard.model.plan import DTYPES, KeyAction, Options, Plan, TensorPlan
from reshard.planning.options import user_conventions
from reshard.planning.describe import inspect_checkpoint
from reshard.model.layout import Placement, local_box, rank_sizes, target_chunks_cached
from reshard.semantics import placement as placement_mod
from reshard.semantics import batch as batch_mod
from reshard.semantics import data as data_mod
from reshard.semantics import rng as rng_mod
from reshard.semantics import schedule as schedule_mod
from reshard.semantics import slicing as slicing_mod
from reshard.semantics.rules import select as select_rules
from reshard.units import human_bytes
from reshard.semantics.conventions import Classification, KeyRole
from reshard.model.topology import Topology, parse_spec
from reshard.storage import sidecars


def _dtype_size(name: str) -> int:
    return torch.empty((), dtype=getattr(torch, name)).element_size()


@paused_gc()  # the metadata path builds millions of small objects: reshard.gc_pause
def make_plan(src: str | Path, options: Options, *, inspection: Inspection | None = None) -> Plan:
    """Build the plan, or raise BadInput when the user must choose a policy first.

    Each step decides one thing; those that make the plan infeasible add to ``reasons``, in
    this order, which is the order the plan lists them.
    """
    ins = _complete_inspection(src, options, inspection)
    r, ix = ins.report, ins.index
    cls, chosen = _chosen_roles(ins.classification, options)  # --keep / --drop on the unknown keys
    mdict = _with_user_ties(ins.manifest.to_dict() if ins.manifest is not None else {}, options.ties)
    source_topo, target = ins.topology, parse_spec(options.to)
    same_positions = source_topo.degrees() == target.degrees()
    reasons: list[str] = []

    geo = _placements(ix, cls, mdict, source_topo, target, options, reasons)
    acc_out = _accumulation(r, reasons)
    bdec = _batch_recipe(r, source_topo, target, options, reasons)
    sdec = _schedule(ix, cls, mdict, r, bdec, options)
    ddec = _data_position(ix, cls, mdict, source_topo, target, options)
    rdec = _rng(cls, mdict, r, source_topo, target, options, same_positions)
    keys = _key_actions(ix, cls, mdict, geo, target, sdec, ddec, rdec, reasons, chosen)
    sliced = _apply_slice(ix, cls, mdict, options, keys, target)
    reduced = _reduce(options, keys.tensors, keys.actions, ix)
    memory = _memory(keys.tensors, ix, cls, target, same_storage=geo.same_storage, extra_trainable=geo.extra_trainable,
                     renamed=sliced.renamed if sliced else None)
    verdict = _plan_verdict(r, bdec, sdec, ddec, rdec, reasons, same_positions, geo.numerics, reduced)
    verdict["kept"] = _kept(r, cls, sdec, ddec, rdec, acc_out, reduced)
    verdict["warm_start_of"] = [facet for facet, v in verdict["kept"].items()
                                if v["status"] in ("lost", "absent") and facet in WARM_FACETS]
    if sliced is not None:
        _slice_verdict(verdict, sliced, reasons)

    plan = Plan(_source_summary(src, r, source_topo, cls), target.with_source("given"), options, not reasons, reasons,
                bdec, sdec, ddec, rdec, acc_out, memory, keys.tensors, keys.actions, verdict, keys.new_values,
                geo.stage_map, geo.rules.family if geo.rules else None, keys.checks)
    from reshard.planning.linking import link_summary  # `convert --data link`: whether it applies (not fingerprinted)

    plan.data_link = link_summary(plan, ix)
    if sliced is not None:
        plan.slice = sliced.summary
    return plan


def _with_user_ties(mdict: dict[str, Any], ties: list[list[str]] | None) -> dict[str, Any]:
    """The manifest as the plan reads it: ``--tie`` pairs join its ``model.tied`` (checked the same way)."""
    if not ties:
        return mdict
    out = dict(mdict)
    model = dict(out.get("model") or {"family": "unknown", "config": {}, "tied": []})
    have = [list(t) for t in model.get("tied") or []]
    model["tied"] = have + [list(t) for t in ties if list(t) not in have and list(reversed(t)) not in have]
    out["model"] = model
    return out


def _key_choices(options: Options) -> tuple[list[tuple[str, re.Pattern[str]]], list[tuple[str, re.Pattern[str]]]]:
    """``--keep`` and ``--drop`` patterns compiled; a pattern that is not a regular expression is BadInput."""
    out: list[list[tuple[str, re.Pattern[str]]]] = []
    for flag, patterns in (("--keep", options.keep), ("--drop", options.drop)):
        compiled = []
        for pat in patterns or []:
            try:
                compiled.append((pat, re.compile(pat)))
            except (re.error, TypeError) as exc:
                raise BadInput(f"{flag} {pat!r} is not a regular expression ({exc})",
                               hint=f"{flag} takes a Python regular expression matched against the flat key, "
                                    "e.g. '^mystery$'.") from None
        out.append(compiled)
    return out[0], out[1]


def _chosen_roles(cls: Classification, options: Options) -> tuple[Classification, dict[str, tuple[str, str]]]:
    """Apply ``--keep``/``--drop`` to the keys no convention explains.

    They decide only unknown keys: a key a convention explains keeps the convention's role (a
    pattern cannot drop a parameter by accident). A kept key becomes role ``other`` (carried
    unchanged, replicated, in rank 0's file). Returns key -> (action, reason) for both.
    A key matched by both is BadInput: the two choices contradict each other.
    """
    keep, drop = _key_choices(options)
    if not keep and not drop:
        return cls, {}
    roles = dict(cls.roles)
    chosen: dict[str, tuple[str, str]] = {}
    for key in cls.unknown:
        k = next((p for p, rx in keep if rx.search(key)), None)
        d = next((p for p, rx in drop if rx.search(key)), None)
        if k is not None and d is not None:
            raise BadInput(f"key '{key}' matches both --keep {k!r} and --drop {d!r}",
                           hint="Narrow one of the patterns so each unknown key gets one decision.")
        why = options.key_reasons or {}
        if k is not None:
            roles[key] = KeyRole(key, "other")
            chosen[key] = ("carried", f"--keep {k}" + (f": {why[k]}" if why.get(k) else ""))
        elif d is not None:
            chosen[key] = ("dropped", f"--drop {d}" + (f": {why[d]}" if why.get(d) else ""))
    return dataclasses.replace(cls, roles=roles), chosen


def _check_recorded_conventions(manifest: Any, options: Options, src: str | Path) -> None:
    """A ``--convention`` whose name the source's lineage records must be the file recorded there.

    The manifest may name a user convention (`reshard.semantics.manifest.key_conventions`)
    because its lineage records the name with the file's sha256: the same name with other
    bytes would read the keys another way under the same name, so it is refused.
    """
    recorded: dict[str, str] = {}
    for event in getattr(manifest, "lineage", None) or []:
        opts = event.policies.get("options") if isinstance(event.policies, dict) else None
        given = opts.get("conventions") if isinstance(opts, dict) else None
        for c in given if isinstance(given, list) else []:
            if isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("sha256"), str):
                recorded[c["name"]] = c["sha256"]
    for rec in options.conventions or []:
        want = recorded.get(rec["name"])
        if want is not None and want != rec["sha256"]:
            raise BadInput(f"--convention {rec['file']} is named '{rec['name']}', but the source's lineage records "
                           f"a convention of that name with other bytes (sha256 {want[:16]}, given "
                           f"{rec['sha256'][:16]})", where=str(src),
                           hint="Give the convention file the earlier conversion used, or give yours another name.")


def _complete_inspection(src: str | Path, options: Options, inspection: Inspection | None) -> Inspection:
    """The source's inspection (given, or made now); a plan of an incomplete checkpoint would lose data.

    A given inspection classified the keys with the shipped conventions only: with
    ``--convention`` files the source is inspected again, so that their rules decide.
    """
    user = user_conventions(options)
    if user or options.ties:
        inspection = None
    ins = inspection or inspect_checkpoint(src, from_spec=options.from_spec, trust_pickle=options.trust_pickle,
                                           conventions=user, ties=options.ties)
    _check_recorded_conventions(ins.manifest, options, src)
    r = ins.report
    if not r["complete"]:
        first = next((p for p in r["problems"] if p["severity"] == "error"), {"message": "incomplete", "file": None})
        raise BadInput(f"the source checkpoint is incomplete: {first['message']}", where=str(src),
                       hint="Run `reshard inspect` for the full list; convert only a complete checkpoint.")
    if ins.topology.ambiguous:
        alts = ins.topology.alternatives
        raise BadInput("the source layout is ambiguous: its chunks fit " + ", ".join(alts)
                       + "; reshard does not record a guess as the run's layout", where=str(src),
                       hint=f"Pass --from with the layout the run used, e.g. --from {alts[0]}.")
    return ins


# ---------------------------------------------------------------------------- topology and placements

def _placements(ix: Any, cls: Any, mdict: dict[str, Any], source_topo: Topology, target: Topology, options: Options,
                reasons: list[str]) -> placement_mod.Geometry:
    """Where every tensor goes on the target, and the layout changes reshard cannot execute (context parallel)."""
    if source_topo.cp != target.cp:
        reasons.append(f"context-parallel changes are not supported (source cp={source_topo.cp}, target cp={target.cp})")
    geo = placement_mod.decide(ix, cls, mdict, source_topo, target, rules_file=options.rules,
                               model_config=options.model_config, pp_stages=options.pp_stages, ties=options.ties)
    reasons.extend(geo.reasons)
    return geo


# ---------------------------------------------------------------------------- trainer state

def _accumulation(r: dict[str, Any], reasons: list[str]) -> dict[str, Any]:
    """The accumulation phase: only a checkpoint taken at an optimizer-step boundary can be resharded."""
    acc = r.get("accumulation") or {}
    acc_out = {"micro_step": acc.get("micro_step", 0) if acc else None, "in_flight_grads": acc.get("in_flight_grads") if acc else None,
               "ok": True, "note": "at an optimizer-step boundary" if acc else "unknown (no manifest): assumed at a step boundary"}
    if acc and acc.get("micro_step"):
        acc_out["ok"] = False
        acc_out["note"] = (f"saved at micro-step {acc['micro_step']} of an accumulation: the gradients of the micro-steps "
                           "already taken are " + ("in the checkpoint but reshard cannot reshard gradients" if acc.get("in_flight_grads") else "not in the checkpoint")
                           + "; resume from the last checkpoint taken at a completed optimizer step")
        reasons.append("mid-accumulation checkpoint: " + acc_out["note"])
    return acc_out


def _batch_recipe(r: dict[str, Any], source_topo: Topology, target: Topology, options: Options,
                  reasons: list[str]) -> batch_mod.BatchDecision:
    """The target's micro-batch and accumulation, chosen to keep the global batch (when the source's is known).

    The source's recipe is the manifest's, or the `--source-*` flags' when no manifest says it
    (`_source_recipe`); with neither, the global batch cannot be checked.
    """
    before = None
    b = _source_recipe(r, options, dp=source_topo.dp)
    if b.get("micro_batch") and b.get("grad_accum"):
        before = batch_mod.Recipe(int(b["micro_batch"]), int(b["grad_accum"]), source_topo.dp)
    bdec = batch_mod.keep_global_batch(before, target.dp, micro_batch=options.micro_batch, grad_accum=options.grad_accum)
    recorded = r.get("batch") or {}
    filled = {origin: v for f, (v, origin) in _recipe_given(options).items() if recorded.get(f) is None}
    if before is not None and not bdec.note and filled:
        bdec.note = "source recipe from " + _origins(filled) + " (no manifest records it)"
    if not bdec.feasible:
        reasons.append("batch recipe: " + bdec.note)
    return bdec


_SOURCE_RECIPE_FLAGS = {"micro_batch": "--source-micro-batch", "grad_accum": "--source-grad-accum",
                        "seq_len": "--source-seq-len", "global_batch": "--source-global-batch"}


def _recipe_given(options: Options) -> dict[str, tuple[int, str]]:
    """The source recipe fields the user gave, by field: (value, where it came from).

    The origin is the flag, or the profile / trainer config file that contributed the value
    (`reshard.planning.options` records which option each file filled).
    """
    out: dict[str, tuple[int, str]] = {}
    for f, flag in _SOURCE_RECIPE_FLAGS.items():
        value = getattr(options, "source_" + f)
        if value is None:
            continue
        origin = flag
        for rec_name, label in (("profile", "profile"), ("trainer_config", "trainer config")):
            rec = getattr(options, rec_name)
            if isinstance(rec, dict) and "source_" + f in (rec.get("contributed") or []):
                origin = f"{label} {Path(str(rec.get('file'))).name} {f}"
        out[f] = (value, origin)
    return out


def _origins(filled: dict[str, int]) -> str:
    """``--source-micro-batch 8 --source-grad-accum 4`` / ``profile reshard.toml (micro_batch 8, grad_accum 4)``."""
    flags = [f"{o} {v}" for o, v in filled.items() if not _from_file(o)]
    files: dict[str, list[str]] = {}
    for o, v in filled.items():
        if _from_file(o):
            label, _, name = o.rpartition(" ")
            files.setdefault(label, []).append(f"{name} {v}")
    return ", ".join([" ".join(flags)] * bool(flags) + [f"{label} ({', '.join(vs)})" for label, vs in files.items()])


def _from_file(origin: str) -> bool:
    return not origin.startswith("--")


def _source_recipe(r: dict[str, Any], options: Options, *, dp: int | None = None) -> dict[str, Any]:
    """The source's batch recipe: the manifest's fields, completed by what the user gave.

    The flags say what a manifest would; they never overrule one. A flag that disagrees with
    the manifest is refused (one of them is wrong, and reshard cannot tell which); a profile
    or trainer config describes the run in general, so where the manifest of this checkpoint
    records a field (an output of an earlier conversion does) the manifest's value is used.
    Half a recipe is refused (a micro-batch without its accumulation cannot give the global
    batch). A global batch (a trainer config's) gives the accumulation with the source's dp
    degree: global = micro-batch x accumulation x dp.
    """
    recorded = dict(r.get("batch") or {})
    out = dict(recorded)
    given = _recipe_given(options)
    for f, (value, origin) in given.items():
        if value < 1:
            raise BadInput(f"{origin} must be a positive integer, got {value}")
        if recorded.get(f) is not None and int(recorded[f]) != value:
            if _from_file(origin):
                continue
            raise BadInput(f"{origin} {value} disagrees with the source manifest's batch.{f} {recorded[f]}",
                           where=str(Path(r["path"]) / "manifest.json"),
                           hint=f"Drop {origin} (the manifest's value is used), or correct the manifest if it is wrong.")
        if recorded.get(f) is None:
            out[f] = value
    if dp and out.get("global_batch") and out.get("micro_batch"):
        gb, mb = int(out["global_batch"]), int(out["micro_batch"])
        if gb % (mb * dp):
            raise BadInput(f"the source's global batch {gb} is not micro-batch {mb} x dp {dp} x a whole accumulation",
                           where=given.get("global_batch", (0, str(r["path"])))[1],
                           hint="Check the recipe: global batch = micro-batch x accumulation x dp.")
        ga = gb // (mb * dp)
        if out.get("grad_accum") is not None and int(out["grad_accum"]) != ga:
            raise BadInput(f"the source's accumulation {out['grad_accum']} disagrees with its global batch {gb} = "
                           f"micro-batch {mb} x dp {dp} x {ga}", where=str(r["path"]),
                           hint="Give the global batch or the accumulation, not two that disagree.")
        out["grad_accum"] = ga
    if given and bool(out.get("micro_batch")) != bool(out.get("grad_accum") or out.get("global_batch")):
        missing = "--source-grad-accum" if out.get("micro_batch") else "--source-micro-batch"
        raise BadInput(f"half a source batch recipe: {missing} is not given and the source does not record it",
                       where=str(r["path"]),
                       hint=f"Pass {missing} too: the global batch is micro-batch x accumulation x dp.")
    return out


def _schedule(ix: Any, cls: Any, mdict: dict[str, Any], r: dict[str, Any], bdec: batch_mod.BatchDecision,
              options: Options) -> schedule_mod.ScheduleDecision | None:
    """The LR scheduler's position on the target; undecided (None) when the batch recipe is infeasible."""
    sched_keys = {}
    for k, role in cls.roles.items():
        if role.role == "scheduler" and (k.endswith(".last_epoch") or k.endswith("._step_count")):
            sched_keys[k] = ix.read_object(k)
    if not bdec.feasible:
        return None
    samples_seen = mdict.get("samples_seen")
    seq_len = _source_recipe(r, options).get("seq_len")
    if samples_seen is None and r.get("tokens_seen") is not None and seq_len:
        samples_seen = int(r["tokens_seen"]) // int(seq_len)  # a token counter and --source-seq-len: samples
    return schedule_mod.decide(batch_kept=bdec.kept, policy=options.schedule, step=r.get("step"),
                               samples_seen=samples_seen,
                               new_global_batch=bdec.after.global_batch if bdec.after else None,
                               position_keys=sched_keys)


def _data_position(ix: Any, cls: Any, mdict: dict[str, Any], source_topo: Topology, target: Topology,
                   options: Options) -> data_mod.DataDecision:
    """Where each target rank's data loader resumes, from per-rank loader states or a shared cursor.

    Per-rank states are read only when the policy must translate them to a new dp degree.
    """
    per_rank_data: dict[int, tuple[str, Any]] = {}
    shared_data: dict[str, Any] = {}
    cursor = (mdict.get("data") or {}).get("cursor")
    data_roles = [x for x in cls.roles.values() if x.role == "data"]
    for x in data_roles:
        if x.rank is not None:
            per_rank_data[x.rank] = (x.key, None)
    if per_rank_data:
        for x in data_roles:
            if x.rank is None:
                shared_data[x.key] = ix.read_object(x.key)
        if source_topo.dp != target.dp and options.data_policy in ("translate", "restart-epoch"):
            per_rank_data = {rk: (k, ix.read_object(k)) for rk, (k, _) in per_rank_data.items()}
    elif data_roles and cursor is None:
        cur = [x.key for x in data_roles if x.key.endswith(".cursor")]
        if cur:
            cursor = int(ix.read_object(cur[0]))
    prefix = _per_rank_prefix(data_roles)
    return data_mod.decide(per_rank_data, shared_data, source_dp=source_topo.dp, target_dp=target.dp,
                           policy=options.data_policy, key_for_rank=lambda k: f"{prefix}{k}", cursor=cursor,
                           trust_pickle=options.trust_pickle)


def _rng(cls: Any, mdict: dict[str, Any], r: dict[str, Any], source_topo: Topology, target: Topology,
         options: Options, same_positions: bool) -> rng_mod.RngDecision:
    """Each target rank's RNG streams: kept where every rank keeps its position, else reseeded by policy."""
    rng_ranks: dict[int, list[str]] = {}
    for x in cls.roles.values():
        if x.role == "rng" and x.rank is not None:
            rng_ranks.setdefault(x.rank, []).append(x.key)
    seed = options.seed if options.seed is not None else int((mdict.get("rng") or {}).get("seed", 0))
    return rng_mod.decide(rng_ranks, source_world=source_topo.world_size, target_world=target.world_size,
                          same_positions=same_positions, policy=options.rng_policy, seed=seed,
                          step=int(r.get("step") or 0), prefix_for_rank=lambda k: f"rng.rank_{k}")


# ---------------------------------------------------------------------------- per-key actions

@dataclass
class _Keys:
    """What the executor does, key by key: tensors to write, one action per key, values to write, tie checks."""

    tensors: list[TensorPlan] = field(default_factory=list)
    actions: list[KeyAction] = field(default_factory=list)
    new_values: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, str] = field(default_factory=dict)


def _key_actions(ix: Any, cls: Any, mdict: dict[str, Any], geo: placement_mod.Geometry, target: Topology,
                 sdec: schedule_mod.ScheduleDecision | None, ddec: data_mod.DataDecision, rdec: rng_mod.RngDecision,
                 reasons: list[str], chosen: dict[str, tuple[str, str]] | None = None) -> _Keys:
    """Every source key's fate, in the source's key order, then the keys the target adds.

    ``chosen`` holds the user's decisions on unknown keys (``--keep``/``--drop``, `_chosen_roles`).
    """
    keys = _Keys()
    rewrites = _rewrites(ix, sdec, ddec, rdec)
    chosen = chosen or {}
    dropped = {**ddec.dropped, **rdec.dropped, **{k: why for k, (a, why) in chosen.items() if a == "dropped"}}
    kept = {k: why for k, (a, why) in chosen.items() if a == "carried"}
    for key, e in ix.entries.items():
        _plan_source_key(key, e, keys, cls=cls, geo=geo, target=target, rewrites=rewrites, dropped=dropped,
                         reasons=reasons, kept=kept)
    _tied_checks(cls, mdict, geo, keys.checks)
    _add_tied_copies(ix, cls, geo, target, keys)
    _add_new_rank_state(ix, ddec, rdec, keys)
    _fill_local_shapes(keys.tensors, target)
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


def _plan_source_key(key: str, e: Any, keys: _Keys, *, cls: Any, geo: placement_mod.Geometry, target: Topology,
                     rewrites: dict[str, tuple[str, Any]], dropped: dict[str, str], reasons: list[str],
                     kept: dict[str, str] | None = None) -> None:
    """One source key: dropped by a decision, rewritten, refused (unknown), a dropped tied copy, resharded or carried.

    An unknown key is refused unless the user decided it (``--keep`` puts it in ``kept``, now
    role ``other``; ``--drop`` in ``dropped``): the error names every way to decide it.
    """
    role = cls.roles[key].role
    if key in dropped:
        keys.actions.append(KeyAction(key, role, "dropped", dropped[key]))
        return
    if key in rewrites:
        why, value = rewrites[key]
        keys.new_values[key] = value
        keys.actions.append(KeyAction(key, role, "rewritten", why, rank=_owner_rank(key, cls, target)))
        if e.is_tensor:
            keys.tensors.append(_replicated(key, role, value, _owner_rank(key, cls, target)))
        return
    if role == "unknown":
        reasons.append(f"key '{key}' matches no rule of convention '{cls.convention.name}': reshard does not guess "
                       "what it means; give it a role with --convention FILE (a convention TOML whose rule matches "
                       f"it), carry it unchanged with --keep PATTERN, or leave it out with --drop PATTERN "
                       f"(e.g. --keep '^{re.escape(key)}$')")
        keys.actions.append(KeyAction(key, role, "dropped", "unknown key: refused"))
        return
    if key in geo.tied_actions and geo.tied_actions[key][0] == "dropped":
        _, why, equal_to = geo.tied_actions[key]
        keys.actions.append(KeyAction(key, role, "dropped", why))
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
        keys.actions.append(KeyAction(key, role, "carried", why_kept or "object, unchanged",
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
    action = KeyAction(key, role, "resharded" if placement.kind == "shard" else "carried",
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


def _add_tied_copies(ix: Any, cls: Any, geo: placement_mod.Geometry, target: Topology, keys: _Keys) -> None:
    """Tied copies the target needs but the source did not save (e.g. the output head on the last stage)."""
    for key, (action, why, src_key) in geo.tied_actions.items():
        if action != "added" or src_key is None:
            continue
        se = ix.entries[src_key]
        role = cls.roles[src_key].role
        if not se.is_tensor:
            keys.new_values[key] = ix.read_object(src_key)
            keys.actions.append(KeyAction(key, role, "added", why, rank=0))
            continue
        src_geo = geo.by_key[src_key]
        pl = Placement(dp_shard=src_geo.placement.dp_shard, tp_dim=src_geo.placement.tp_dim, stage=target.pp - 1)
        chunks = list(target_chunks_cached(tuple(src_geo.target_shape), pl, target))
        keys.tensors.append(TensorPlan(key, role, src_geo.target_shape, se.dtype_name or "", pl,
                                       chunks, src_geo.transform, copy_from=src_key))
        keys.actions.append(KeyAction(key, role, "added", why))


def _add_new_rank_state(ix: Any, ddec: data_mod.DataDecision, rdec: rng_mod.RngDecision, keys: _Keys) -> None:
    """Data and RNG state for target ranks the source did not have."""
    for k, v in list(ddec.writes.items()) + list(rdec.writes.items()):
        if k in ix.entries:
            continue
        role = "data" if k in ddec.writes else "rng"
        rank = _rank_from_key(k)
        why = (f"new rank {rank}: " if rank is not None else "") + ("data position " + ddec.policy if role == "data" else rdec.per_rank.get(rank, "RNG"))
        keys.new_values[k] = v
        keys.actions.append(KeyAction(k, role, "added", why, rank=rank if rank is not None else 0))
        if isinstance(v, torch.Tensor):
            keys.tensors.append(_replicated(k, role, v, rank or 0))


def _fill_local_shapes(tensors: list[TensorPlan], target: Topology) -> None:
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


# ---------------------------------------------------------------------------- a slice of the model

@dataclass
class _Sliced:
    """A slice applied to the key actions: its summary (plan JSON, report, lineage) and the renamed keys."""

    slice: slicing_mod.Slice
    summary: dict[str, Any]
    renamed: dict[str, str]  # target key -> source key
    moment_params: int       # parameters of the slice with optimizer moments


def _apply_slice(ix: Any, cls: Any, mdict: dict[str, Any], options: Options, keys: _Keys,
                 target: Topology) -> _Sliced | None:
    """``--layers`` / ``--experts``: a smaller model of the same family, cut by the family's description.

    Every key that names a parameter of a layer left out (its model key, its optimizer state,
    its per-parameter hyper-parameters) is dropped with the reason "layer N not in the slice"
    and counted with its bytes. A kept layer is renumbered densely: its keys are written
    under their new names (an added key copied from the source key, as a tied copy is, the
    source key left out under its old name), model and optimizer keys alike, and an
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
    sl = slicing_mod.plan_slice(rules, params, layers=options.layers, experts=options.experts, config=config)
    planned = {t.key: t for t in keys.tensors}
    fates: dict[str, slicing_mod.Fate] = {}
    for a in keys.actions:
        role = cls.roles.get(a.key)
        if role is not None and role.role in slicing_mod.LAYERED_ROLES and a.action not in ("dropped", "added"):
            fates[a.key] = sl.fate(a.key, role.param)
    # target name -> the source key whose values it takes. A renumbered layer takes the names of
    # a source layer (layer 3 of the source is layer 1 of the slice): that source key's one
    # action becomes "rewritten", its tensor copied from the renamed key (`TensorPlan.copy_from`).
    renamed = {f.new_key: k for k, f in fates.items() if f.kind == "renamed" and f.new_key}
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
        if fate.kind in ("dropped", "renamed") and a.key not in renamed:
            if fate.kind == "dropped":
                d = dropped.setdefault(fate.reason, {"keys": 0, "bytes": 0})
                d["keys"] += 1
                d["bytes"] += ix.entries[a.key].nbytes if ix.entries[a.key].is_tensor else 0
            a.action, a.rank = "dropped", None
            a.reason = fate.reason if fate.kind == "dropped" else f"renamed: {fate.reason}"
            keys.new_values.pop(a.key, None)
            tensors[a.key] = None
        elif fate.kind in ("kept", "outside"):
            value = _sliced_fqn_list(ix, sl, a.key, role, keys, lists)
            if value is not None:
                keys.new_values[a.key] = value
                a.action = "rewritten"
                a.reason = "the slice's parameter list (FQNs of the parameters left out removed, kept ones renumbered)"
    for new, old in renamed.items():
        fate, src_action = fates[old], by_key[old]
        target_action = by_key.get(new)
        t = planned.get(old)
        if t is not None:
            t = dataclasses.replace(t, key=new, copy_from=None if old in keys.new_values else old)
        own = fates.get(new)
        why = f"renamed: {fate.reason}" + (
            f" (the source's own values under this name: {own.reason if own.kind == 'dropped' else 'renamed too'})"
            if own is not None and own.kind != "kept" else "")
        if old in keys.new_values:
            keys.new_values[new] = keys.new_values[old]
        elif t is not None:
            keys.new_values.pop(new, None)  # its values are the copy's, not a value of its own
        else:
            value = _sliced_fqn_list(ix, sl, old, cls.roles[old].role, keys, lists)
            keys.new_values[new] = value if value is not None else ix.read_object(old)
        if own is not None and own.kind == "dropped":
            d = dropped.setdefault(own.reason, {"keys": 0, "bytes": 0})
            d["keys"] += 1
            d["bytes"] += ix.entries[new].nbytes if ix.entries[new].is_tensor else 0
        if target_action is not None:  # a source key of that name: one action, now "rewritten"
            target_action.action, target_action.reason = "rewritten", why
            target_action.rank = src_action.rank if t is None or src_action.rank is not None else None
        else:
            added.append(KeyAction(new, src_action.role, "added", why,
                                   rank=src_action.rank if t is None or src_action.rank is not None else None))
        tensors[new] = t
        if old not in renamed:
            src_action.action, src_action.reason, src_action.rank = "dropped", f"renamed: {fate.reason}", None
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
    size = sum(int(np.prod(t.shape, dtype=np.int64)) * _dtype_size(t.dtype) for t in keys.tensors if t.dtype)
    moments = {cls.roles[t.copy_from or t.key].param for t in keys.tensors
               if t.role == "optimizer_moment" and (t.copy_from or t.key) in cls.roles}
    outside = [p for p in params if sl.fate(p, p).kind == "outside"]
    summary = {**sl.to_dict(),
               "kept": {"keys": sum(1 for a in keys.actions if a.action != "dropped"), "tensors": len(keys.tensors),
                        "bytes": size, "outside_layers": outside},
               "renamed": {"keys": len(renamed), "from_to": [[v, k] for k, v in renamed.items()]},
               "dropped": {"keys": sum(d["keys"] for d in dropped.values()),
                           "bytes": sum(d["bytes"] for d in dropped.values()), "by_reason": dropped},
               "fqn_lists": lists}
    return _Sliced(sl, summary, renamed, len(moments))


def _select_router_rows(sl: slicing_mod.Slice, cls: Any, keys: _Keys, target: Topology) -> None:
    """``--experts``: a router parameter (and its moments) keeps the rows of the kept experts (transform ``select``).

    The tensor is read whole, its rows picked and re-cut, like a TP-dependent layout
    (`reshard.semantics.transforms.write_transformed`); convert proves it against the source's rows.
    """
    by_key = {a.key: a for a in keys.actions if a.action != "dropped"}
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
            raise BadInput(f"router parameter '{src}' cannot keep the rows of experts {list(index)}: "
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
        _fill_local_shapes(changed, target)


def _sliced_fqn_list(ix: Any, sl: slicing_mod.Slice, key: str, role: str, keys: _Keys,
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


def _slice_verdict(verdict: dict[str, Any], sliced: _Sliced, reasons: list[str]) -> None:
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


# ---------------------------------------------------------------------------- verdict and source

def _plan_verdict(r: dict[str, Any], bdec: batch_mod.BatchDecision, sdec: schedule_mod.ScheduleDecision | None,
                  ddec: data_mod.DataDecision, rdec: rng_mod.RngDecision, reasons: list[str], same_positions: bool,
                  numerics: list[str], reduced: list[str]) -> dict[str, Any]:
    """The verdict on the decisions, plus the placements' numeric changes; a reduced copy is a warm start."""
    verdict = _verdict(r, bdec, sdec, ddec, rdec, reasons, same_positions)
    verdict["changes"].extend(numerics)
    if reduced and not reasons:
        verdict["warm_start_reasons"].extend(reduced)
        verdict["kind"] = "warm_start"
    return verdict


def _source_summary(src: str | Path, r: dict[str, Any], source_topo: Topology, cls: Any) -> dict[str, Any]:
    """What the plan read from its source; part of the fingerprint, so its content must not drift."""
    return {"path": str(Path(src).resolve()), "topology": source_topo.to_dict(), "step": r.get("step"),
            "tokens_seen": r.get("tokens_seen"),
            "experiment_id": r.get("experiment_id"), "convention": cls.convention.name,
            "entries": r["entries"], "bytes": r["bytes"], "manifest": r["manifest"],
            **sidecars.plan_source(r)}  # the files carried beside the DCP part (reshard.storage.sidecars)


OPTIMIZER_ROLES = ("optimizer_moment", "optimizer_step", "param_group")


def _reduce(options: Options, tensors: list[TensorPlan], actions: list[KeyAction], ix) -> list[str]:
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
            if a.role in OPTIMIZER_ROLES and a.action != "dropped":
                a.action, a.reason, a.rank = "dropped", "--only model: a reduced copy without optimizer state", None
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
            if t.role in ("parameter", "optimizer_moment") and getattr(torch, t.dtype).is_floating_point and t.dtype != name:
                a = by_key.get(t.key)
                t.dtype = name
                if a is not None:
                    a.reason += f"; cast to {name}"
                cast += 1
        if cast:
            reasons.append(f"reduced copy: {cast} parameter and moment tensors cast to {name} (--dtype {options.dtype})")
    return reasons


def _describe_transform(t: dict[str, Any]) -> str:
    if t["kind"] == "select":
        return f"rows {t['index']} of {t['from_rows']} along dim {t['dim']} kept (a slice of the experts)"
    if t["kind"] == "reinterleave":
        return f"fused parts {t['parts']} re-interleaved for tp {t['from_tp']} -> {t['to_tp']}"
    return f"vocab {t['vocab']} padded {t['from_rows']} -> {t['to_rows']} rows (fill {t['fill']})"


def _per_rank_prefix(data_roles) -> str:
    for x in data_roles:
        if x.rank is not None:
            return x.key[: len(x.key) - len(str(x.rank))]
    return "data.rank_"


def _rank_from_key(key: str) -> int | None:
    import re

    m = re.search(r"(?:rank_|dp_rank_)(\d+)", key)
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


def _replicated(key: str, role: str, value: torch.Tensor, rank: int) -> TensorPlan:
    shape = tuple(value.shape)
    return TensorPlan(key, role, shape, str(value.dtype).removeprefix("torch."), Placement.replicated(),
                      [(rank, tuple(0 for _ in shape), shape)])


def _memory(tensors: list[TensorPlan], ix, cls, target: Topology, *, same_storage: set[str] = frozenset(),
            extra_trainable: set[str] = frozenset(), renamed: dict[str, str] | None = None) -> dict[str, Any]:
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
                    acc["other"][rank] += box.numel * _dtype_size(t.dtype)
            continue
        k = (tuple(t.shape), t.placement, t.dtype, cats)
        groups[k] = groups.get(k, 0) + 1
    for (shape, placement, dtype, cats), count in groups.items():
        held, sizes = rank_sizes(shape, placement, target)
        nbytes = np.where(held, sizes.prod(axis=1) if shape else 1, 0) * _dtype_size(dtype) * count
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


def _kept(r: dict[str, Any], cls: Any, sdec: schedule_mod.ScheduleDecision | None, ddec: data_mod.DataDecision,
          rdec: rng_mod.RngDecision, acc_out: dict[str, Any], reduced: list[str]) -> dict[str, dict[str, str]]:
    """For each part of the training state: carried, rewritten, lost, or absent from the source, and why.

    This is the verdict's detail: "warm start" alone does not say that every Adam moment was
    carried bitwise and only the data order is new, and that difference matters to the user.
    """
    def rec(status: str, note: str) -> dict[str, str]:
        return {"status": status, "note": note}

    opt = r["optimizer"]
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
    accumulation = rec("carried" if acc_out.get("ok") else "lost", acc_out.get("note", ""))
    return {"optimizer_state": optimizer, "lr_schedule": schedule, "data_position": data, "rng": rng,
            "accumulation_phase": accumulation}


def _verdict(r, bdec, sdec, ddec, rdec, reasons, same_positions) -> dict[str, Any]:
    warm: list[str] = []
    changes: list[str] = []
    if not r["optimizer"]["moment_names"]:
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
        changes.append("collective reduction order differs on a new world size: losses match to rounding, not bitwise")
    if reasons:
        kind = "infeasible"
    elif warm:
        kind = "warm_start"
    elif any(not c.startswith(("collective", "accumulation", "micro-batch")) for c in changes):
        kind = "continuation_with_changes"
    else:
        kind = "continuation"
    return {"kind": kind, "warm_start_reasons": warm, "changes": changes}


