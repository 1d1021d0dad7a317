"""The planner: a plan (`reshard.model.plan`) is a pure function of (source, options); plain data that says, for every source key, what
happens to it, for every tensor which boxes each target rank owns, and how trainer state
(batch recipe, schedule, data position, RNG) is rewritten, plus an honest verdict.

`reshard convert` executes exactly this plan. Reading no tensor bytes, planning costs
about as much as `inspect`; the few small objects it opens (counters, per-rank loader
states, scheduler position) are read through the safe reader.

`make_plan` takes its steps in order here (inspection, placements, batch recipe, schedule,
data position, RNG); what each source key becomes is `reshard.planning.keys`, the verdict,
kept state, reduced copies and memory `reshard.planning.decisions`, and a slice of the
model's layers or experts `reshard.planning.slice`.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from reshard.gc_pause import paused_gc
from reshard.errors import BadInput
from reshard.patterns import Pattern, compile_pattern
from reshard.model.inspection import Inspection, ManifestView
from reshard.model.kinds import Action
from reshard.model.json_types import JsonDict
from reshard.model.plan import Options, Plan
from reshard.model.plan_sections import AccumulationSection, SourceSummary
from reshard.model.reader import CheckpointReader
from reshard.planning import decisions
from reshard.planning.keys import key_actions, per_rank_prefix
from reshard.planning.options import from_origin, user_conventions
from reshard.planning.describe import inspect_checkpoint
from reshard.planning.experts import expert_map
from reshard.planning.slice import apply_slice, slice_verdict
from reshard.semantics import placement as placement_mod
from reshard.semantics import batch as batch_mod
from reshard.semantics import data as data_mod
from reshard.semantics import rng as rng_mod
from reshard.semantics import schedule as schedule_mod
from reshard.semantics import sizes
from reshard.semantics.conventions import Classification, KeyRole
from reshard.model.topology import Topology, parse_spec
from reshard.storage.checkpoints import sidecars
from reshard.storage.checkpoints.hf_dcp import export_refusal
from reshard.storage.checkpoints.safetensors_format import ExportIndex
from reshard.storage.source import Source


@paused_gc()  # the metadata path builds millions of small objects: reshard.gc_pause
def make_plan(source: Source | str | Path, options: Options, *, inspection: Inspection | None = None) -> Plan:
    """Build the plan, or raise BadInput when the user must choose a policy first.

    ``source``: the checkpoint as its command opened it (`reshard.storage.source.opened`), or a
    local checkpoint's path. Its inspection is kept on it and on the plan (not in the plan's JSON):
    the steps after planning read through the same reader (`plan_reader`).

    Each step decides one thing; those that make the plan infeasible add to ``reasons``, in
    this order, which is the order the plan lists them.
    """
    source = Source.of(source)
    src = source.root
    ins = _complete_inspection(source, options, inspection)
    ix = ins.index
    cls, chosen = _chosen_roles(ins.classification, options)  # --keep / --drop on the unknown keys
    mdict = _with_user_ties(ins.manifest.to_dict() if ins.manifest is not None else {}, options.ties)
    stated = sizes.stated_by_files(options)  # the sizes given (files, --model-config), against the tensors first
    if stated:
        sizes.check_against_checkpoint(stated, ix, cls, family=(mdict.get("model") or {}).get("family"),
                                       rules_file=options.rules).refuse(where=str(src), hint=sizes.HINT)
    source_topo, target = ins.topology, parse_spec(options.to)
    same_positions = source_topo.degrees() == target.degrees()
    reasons: list[str] = []

    geo = _placements(ix, cls, mdict, source_topo, target, options, reasons)
    acc_out = _accumulation(ins.accumulation, reasons)
    bdec = _batch_recipe(ins, source_topo, target, options, reasons)
    sdec = _schedule(ix, cls, mdict, ins, bdec, options)
    ddec = _data_position(ix, cls, mdict, source_topo, target, options)
    rdec = _rng(cls, mdict, ins, source_topo, target, options, same_positions)
    keys = key_actions(ix, cls, mdict, geo, target, sdec, ddec, rdec, reasons, chosen)
    sliced = apply_slice(ix, cls, mdict, options, keys, target)
    reduced = decisions.reduce(options, keys.tensors, keys.actions, ix)
    memory = decisions.memory(keys.tensors, ix, cls, target, same_storage=geo.same_storage,
                              extra_trainable=geo.extra_trainable, renamed=sliced.renamed if sliced else None)
    verdict = decisions.plan_verdict(ins.optimizer, bdec, sdec, ddec, rdec, reasons, same_positions, geo.numerics, reduced)
    verdict["kept"] = decisions.kept(ins.optimizer, cls, sdec, ddec, rdec, acc_out, reduced)
    verdict["warm_start_of"] = [facet for facet, v in verdict["kept"].items()
                                if v["status"] in ("lost", "absent") and facet in decisions.WARM_FACETS]
    if sliced is not None:
        slice_verdict(verdict, sliced, reasons)

    plan = Plan(_source_summary(source, ins, source_topo, cls), target.with_source("given"), options, not reasons, reasons,
                bdec, sdec, ddec, rdec, acc_out, memory, keys.tensors, keys.actions, verdict, keys.new_values,
                geo.stage_map, geo.rules.family if geo.rules else None, keys.checks)
    from reshard.planning.linking import link_summary  # `convert --data link`: whether it applies (not fingerprinted)

    plan.data_link = link_summary(plan, ix)
    if sliced is not None:
        plan.slice = sliced.summary
    experts = expert_map(ix, cls, mdict, options.rules, keys.tensors)  # MoE: which rank holds which experts
    plan.experts = experts.to_dict() | {"text": experts.describe()} if experts is not None else None
    plan.inspection = source.inspection = ins  # one inspection per run: convert and verify take it (`plan_reader`)
    return plan


def plan_reader(plan: Plan, source: Source) -> Any:
    """The reader a run reads ``source`` through after planning it: the plan's own (the inspection's,
    opened once) when ``source`` is what the plan was made from with the same ``trust_pickle``, else
    ``source``'s, opened now (a store's handed its `RemoteCheckpoint`, `Source.reader`)."""
    if source.inspection is None and plan.inspection is not None and Path(plan.inspection.index.root) == source.root:
        source.inspection = plan.inspection
    return source.reader(trust_pickle=plan.options.trust_pickle)


def source_inspection(plan: Plan, source: Source) -> Inspection | None:
    """This run's inspection of the source, when a comparison may take it as its own (the source read
    through the plan's own reader, `plan_reader`),
    else None: described from the checkpoint alone (`Inspection.as_found`), or with only the source
    layout stated (``--from``, a profile's ``from`` or a trainer config's degrees).

    The layout is what the plan was made with: a comparison that inferred the source's layout again
    would judge the per-rank state against another layout than the plan's (a pipeline stage read as
    a replica expects a data-loader state per stage). User conventions and ties classify keys
    differently from a fresh inspection of the output, so with them the source is inspected again.
    """
    ins = plan.inspection
    if ins is None or plan_reader(plan, source) is not ins.index:
        return None
    if ins.as_found or not (plan.options.conventions or plan.options.ties):
        return ins
    return None


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


def _key_choices(options: Options) -> tuple[list[tuple[str, Pattern]], list[tuple[str, Pattern]]]:
    """``--keep`` and ``--drop`` patterns compiled by RE2 (matched in time linear in the key); a pattern
    RE2 cannot compile is BadInput. A profile's patterns were checked when the profile was read, naming it."""
    out: list[list[tuple[str, Pattern]]] = []
    for flag, patterns in (("--keep", options.keep), ("--drop", options.drop)):
        out.append([(pat, compile_pattern(pat, flag, what=f"{flag} pattern")) for pat in patterns or []])
    return out[0], out[1]


def _chosen_roles(cls: Classification, options: Options) -> tuple[Classification, dict[str, tuple[Action, str]]]:
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
    chosen: dict[str, tuple[Action, str]] = {}
    for key in cls.unknown:
        k = next((p for p, rx in keep if rx.search(key)), None)
        d = next((p for p, rx in drop if rx.search(key)), None)
        if k is not None and d is not None:
            raise BadInput(f"key '{key}' matches both --keep {k!r} and --drop {d!r}",
                           hint="Narrow one of the patterns so each unknown key gets one decision.")
        why = options.key_reasons or {}
        if k is not None:
            roles[key] = KeyRole(key, "other")
            chosen[key] = (Action.CARRIED, f"--keep {k}" + (f": {why[k]}" if why.get(k) else ""))
        elif d is not None:
            chosen[key] = (Action.DROPPED, f"--drop {d}" + (f": {why[d]}" if why.get(d) else ""))
    return dataclasses.replace(cls, roles=roles), chosen


def _check_recorded_conventions(manifest: ManifestView | None, options: Options, src: str | Path) -> None:
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


def _complete_inspection(source: Source, options: Options, inspection: Inspection | None) -> Inspection:
    """The source's inspection (given, or made now); a plan of an incomplete checkpoint would lose data.

    A given inspection classified the keys with the shipped conventions only: with
    ``--convention`` files the source is inspected again, so that their rules decide.
    """
    src = source.root
    user = user_conventions(options)
    if user or options.ties:
        inspection = None
    ins = inspection or inspect_checkpoint(source, from_spec=options.from_spec, trust_pickle=options.trust_pickle,
                                           conventions=user, ties=options.ties, from_origin=from_origin(options))
    if isinstance(ins.index, ExportIndex):  # full tensors: `reshard import` lays them out, plan and convert refuse alike
        raise export_refusal(src, options.to, source.url)
    _check_recorded_conventions(ins.manifest, options, src)
    if not ins.complete:
        first = ins.errors[0].message if ins.errors else "incomplete"
        raise BadInput(f"the source checkpoint is incomplete: {first}", where=str(src),
                       hint="Run `reshard inspect` for the full list; convert only a complete checkpoint.")
    if ins.topology.ambiguous:
        alts = ins.topology.alternatives
        raise BadInput("the source layout is ambiguous: its chunks fit " + ", ".join(alts)
                       + "; reshard does not record a guess as the run's layout", where=str(src),
                       hint=f"Pass --from with the layout the run used, e.g. --from {alts[0]}.")
    return ins


# ---------------------------------------------------------------------------- topology and placements

def _placements(ix: CheckpointReader, cls: Classification, mdict: dict[str, Any], source_topo: Topology,
                target: Topology, options: Options, reasons: list[str]) -> placement_mod.Geometry:
    """Where every tensor goes on the target, and the layout changes reshard cannot execute (context parallel)."""
    if source_topo.cp != target.cp:
        reasons.append(f"context-parallel changes are not supported (source cp={source_topo.cp}, target cp={target.cp})")
    geo = placement_mod.decide(ix, cls, mdict, source_topo, target, rules_file=options.rules,
                               model_config=options.model_config, pp_stages=options.pp_stages, ties=options.ties)
    reasons.extend(geo.reasons)
    return geo


# ---------------------------------------------------------------------------- trainer state

def _accumulation(recorded: JsonDict | None, reasons: list[str]) -> AccumulationSection:
    """The accumulation phase (the manifest's ``accumulation``): only a checkpoint taken at an
    optimizer-step boundary can be resharded."""
    acc = recorded or {}
    acc_out: AccumulationSection = {"micro_step": acc.get("micro_step", 0) if acc else None, "in_flight_grads": acc.get("in_flight_grads") if acc else None,
               "ok": True, "note": "at an optimizer-step boundary" if acc else "unknown (no manifest): assumed to be at an optimizer-step boundary"}
    if acc and acc.get("micro_step"):
        acc_out["ok"] = False
        acc_out["note"] = (f"saved at micro-step {acc['micro_step']} of an accumulation: the gradients of the micro-steps "
                           "already taken are " + ("in the checkpoint but reshard cannot reshard gradients" if acc.get("in_flight_grads") else "not in the checkpoint")
                           + "; resume from the last checkpoint taken at a completed optimizer step")
        reasons.append("mid-accumulation checkpoint: " + acc_out["note"])
    return acc_out


def _batch_recipe(ins: Inspection, source_topo: Topology, target: Topology, options: Options,
                  reasons: list[str]) -> batch_mod.BatchDecision:
    """The target's micro-batch and accumulation, chosen to keep the global batch (when the source's is known).

    The source's recipe is the manifest's, or the `--source-*` flags' when no manifest says it
    (`_source_recipe`); with neither, the global batch cannot be checked.
    """
    before = None
    b = _source_recipe(ins, options, dp=source_topo.dp)
    if b.get("micro_batch") and b.get("grad_accum"):
        before = batch_mod.Recipe(int(b["micro_batch"]), int(b["grad_accum"]), source_topo.dp)
    bdec = batch_mod.keep_global_batch(before, target.dp, micro_batch=options.micro_batch, grad_accum=options.grad_accum)
    recorded = ins.batch or {}
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


def _source_recipe(ins: Inspection, options: Options, *, dp: int | None = None) -> dict[str, Any]:
    """The source's batch recipe: the manifest's fields, completed by what the user gave.

    The flags say what a manifest would; they never overrule one. A flag that disagrees with
    the manifest is refused (one of them is wrong, and reshard cannot tell which); a profile
    or trainer config describes the run in general, so where the manifest of this checkpoint
    records a field (an output of an earlier conversion does) the manifest's value is used.
    Half a recipe is refused (a micro-batch without its accumulation cannot give the global
    batch). A global batch (a trainer config's) gives the accumulation with the source's dp
    degree: global = micro-batch x accumulation x dp.
    """
    recorded = dict(ins.batch or {})
    out = dict(recorded)
    given = _recipe_given(options)
    for f, (value, origin) in given.items():
        if value < 1:
            raise BadInput(f"{origin} must be a positive integer, got {value}")
        if recorded.get(f) is not None and int(recorded[f]) != value:
            if _from_file(origin):
                continue
            raise BadInput(f"{origin} {value} disagrees with the source manifest's batch.{f} {recorded[f]}",
                           where=str(Path(ins.path) / "manifest.json"),
                           hint=f"Drop {origin} (the manifest's value is used), or correct the manifest if it is wrong.")
        if recorded.get(f) is None:
            out[f] = value
    if dp and out.get("global_batch") and out.get("micro_batch"):
        gb, mb = int(out["global_batch"]), int(out["micro_batch"])
        if gb % (mb * dp):
            raise BadInput(f"the source's global batch {gb} is not micro-batch {mb} x dp {dp} x a whole accumulation",
                           where=given.get("global_batch", (0, ins.path))[1],
                           hint="Check the recipe: global batch = micro-batch x accumulation x dp.")
        ga = gb // (mb * dp)
        if out.get("grad_accum") is not None and int(out["grad_accum"]) != ga:
            raise BadInput(f"the source's accumulation {out['grad_accum']} disagrees with its global batch {gb} = "
                           f"micro-batch {mb} x dp {dp} x {ga}", where=ins.path,
                           hint="Give the global batch or the accumulation, not two that disagree.")
        out["grad_accum"] = ga
    if given and bool(out.get("micro_batch")) != bool(out.get("grad_accum") or out.get("global_batch")):
        missing = "--source-grad-accum" if out.get("micro_batch") else "--source-micro-batch"
        raise BadInput(f"half a source batch recipe: {missing} is not given and the source does not record it",
                       where=ins.path,
                       hint=f"Pass {missing} too: the global batch is micro-batch x accumulation x dp.")
    return out


def _schedule(ix: CheckpointReader, cls: Classification, mdict: dict[str, Any], ins: Inspection, bdec: batch_mod.BatchDecision,
              options: Options) -> schedule_mod.ScheduleDecision | None:
    """The LR scheduler's position on the target; undecided (None) when the batch recipe is infeasible."""
    sched_keys = {}
    for k, role in cls.roles.items():
        if role.role == "scheduler" and (k.endswith(".last_epoch") or k.endswith("._step_count")):
            sched_keys[k] = ix.read_plain(k)  # an int, or a one-element tensor: decoded without torch
    if not bdec.feasible:
        return None
    samples_seen = mdict.get("samples_seen")
    seq_len = _source_recipe(ins, options).get("seq_len")
    if samples_seen is None and ins.tokens_seen is not None and seq_len:
        samples_seen = int(ins.tokens_seen) // int(seq_len)  # a token counter and --source-seq-len: samples
    return schedule_mod.decide(batch_kept=bdec.kept, policy=options.schedule, step=ins.step,
                               samples_seen=samples_seen,
                               new_global_batch=bdec.after.global_batch if bdec.after else None,
                               position_keys=sched_keys)


def _data_position(ix: CheckpointReader, cls: Classification, mdict: dict[str, Any], source_topo: Topology,
                   target: Topology, options: Options) -> data_mod.DataDecision:
    """Where each target rank's data loader resumes, from per-rank loader states or a shared cursor.

    Per-rank states are read only when the policy must translate them to a new dp degree.
    """
    per_rank_data: dict[int, tuple[str, Any]] = {}
    shared_data: dict[str, Any] = {}
    cursor = (mdict.get("data") or {}).get("cursor")
    data_roles = [x for x in cls.roles.values() if x.role == "data"]
    for rank, held in cls.ranked("data").items():  # two spellings of one rank: refused, naming both
        per_rank_data[rank] = (held[0].key, None)
    if per_rank_data:
        for x in data_roles:
            if x.rank is None:
                shared_data[x.key] = ix.read_object(x.key)
        if source_topo.dp != target.dp and options.data_policy in ("translate", "restart-epoch"):
            per_rank_data = {rk: (k, ix.read_object(k)) for rk, (k, _) in per_rank_data.items()}
    elif data_roles and cursor is None:
        cur = [x.key for x in data_roles if x.key.endswith(".cursor")]
        if cur:
            cursor = int(ix.read_plain(cur[0]))
    prefix = per_rank_prefix(data_roles)
    return data_mod.decide(per_rank_data, shared_data, source_dp=source_topo.dp, target_dp=target.dp,
                           policy=options.data_policy, key_for_rank=lambda k: f"{prefix}{k}", cursor=cursor,
                           trust_pickle=options.trust_pickle)


def _rng(cls: Classification, mdict: dict[str, Any], ins: Inspection, source_topo: Topology, target: Topology,
         options: Options, same_positions: bool) -> rng_mod.RngDecision:
    """Each target rank's RNG streams: kept where every rank keeps its position, else reseeded by policy."""
    rng_ranks = {rank: [x.key for x in held] for rank, held in cls.ranked("rng").items()}
    seed = options.seed if options.seed is not None else int((mdict.get("rng") or {}).get("seed", 0))
    return rng_mod.decide(rng_ranks, source_world=source_topo.world_size, target_world=target.world_size,
                          same_positions=same_positions, policy=options.rng_policy, seed=seed,
                          step=int(ins.step or 0), prefix_for_rank=lambda k: f"rng.rank_{k}")


# ---------------------------------------------------------------------------- source

def _source_summary(source: Source, ins: Inspection, source_topo: Topology, cls: Classification) -> SourceSummary:
    """What the plan read from its source; part of the fingerprint, so its content must not drift."""
    out: SourceSummary = {"path": source.name, "topology": source_topo.to_dict(), "step": ins.step,
                          "tokens_seen": ins.tokens_seen,
                          "experiment_id": ins.experiment_id, "convention": cls.convention.name,
                          "entries": ins.entries, "bytes": ins.bytes, "manifest": ins.has_manifest}
    carried = sidecars.plan_entries(ins.sidecars)  # the files carried beside the DCP part (reshard.storage.checkpoints.sidecars)
    if carried:  # only when there are any, so plans of checkpoints without sidecars keep their fingerprints
        out["sidecars"] = carried
    return out
