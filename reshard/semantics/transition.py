"""The output manifest of a conversion: the source's intent, the target's layout, and one
more lineage entry saying what was done and whether the run is still the same run.
"""
from __future__ import annotations

import hashlib
from typing import Any

from reshard.version import __version__
from reshard.semantics import manifest as mf
from reshard.semantics.rules import shipped
from reshard.model.plan import Plan


def _topo(t: dict[str, Any]) -> mf.Topology:
    return mf.Topology.make(dp_replicate=t["dp_replicate"], dp_shard=t["dp_shard"], cp=t["cp"], tp=t["tp"], pp=t["pp"])


def new_experiment_id(old: str | None, plan: Plan) -> str:
    """Deterministic, so that re-running the same conversion writes the same bytes."""
    h = hashlib.sha256(f"{old}:{plan.fingerprint()}".encode()).hexdigest()[:8]
    what = {"model": "slice", "optimizer_state": "optim", "data_position": "data"}
    scope = "-".join(what[f] for f in plan.verdict.get("warm_start_of", ()) if f in what)
    return f"{old or 'run'}-warm-{scope + '-' if scope else ''}{h}"  # e.g. run-warm-data-1a2b3c4d: only the data order is new


def output_manifest(plan: Plan, src: dict[str, Any] | None, *, time: str) -> mf.Manifest:
    src = dict(src or {})
    target = plan.target.to_dict()
    kind = "warm_start" if plan.verdict["kind"] == "warm_start" else "continuation"
    old_id = src.get("experiment_id")
    exp_id = new_experiment_id(old_id, plan) if kind == "warm_start" or old_id is None else old_id
    batch = _batch(plan, src)
    data = dict(src.get("data") or {"sampler": "unknown", "seed": 0, "epoch": 0, "cursor": 0, "dataset_len": 0,
                                    "order": "unknown (source had no manifest)"})
    if plan.data is not None and plan.data.cursor_after is not None:
        data["cursor"] = int(plan.data.cursor_after)
    sched = dict(src.get("scheduler") or {"name": "unknown", "config": {}, "unit": "steps"})
    if plan.schedule is not None and plan.schedule.policy == "tokens":
        sched["unit"] = "tokens"
    rng = dict(src.get("rng") or {"policy": "per-rank" if plan.rng and plan.rng.policy != "none" else "none",
                                  "keyed_by_rank": True, "seed": plan.rng.seed if plan.rng and plan.rng.seed is not None else 0})
    if plan.rng is not None and plan.rng.policy == "drop":
        rng["policy"] = "none"
    reason = "; ".join(plan.verdict["warm_start_reasons"] + plan.verdict["changes"]) or "all state and batch semantics kept"
    if not src:
        reason = "source had no manifest (unknown fields recorded as null, 0 or 'unknown'); " + reason
    policies = {
        "batch": plan.batch.to_dict(), "schedule": plan.schedule.policy if plan.schedule else None,
        "data": plan.data.policy if plan.data else None, "rng": plan.rng.policy if plan.rng else None,
        "rng_seed": plan.rng.seed if plan.rng else None, "verdict": plan.verdict["kind"],
        "previous_experiment_id": old_id, "plan_fingerprint": plan.fingerprint(),
        "trust_pickle": plan.options.trust_pickle,
        # what `reshard verify` needs to recompute this plan from the source (reshard.verification.checkpoints)
        "options": plan.options.to_dict(), "source_fingerprint": plan.source_fingerprint(),
        "source_path": plan.source["path"],  # where to look for it (a chain A -> X -> B); never evidence
    }
    if plan.slice is not None:  # a slice of the source's model (`reshard.semantics.slicing`): which, and how large
        policies["slice"] = {k: plan.slice[k] for k in ("description", "family", "layers", "experts", "config")
                             if k in plan.slice}
    lineage = list(src.get("lineage") or [])
    lineage.append({"event": "transition", "from": _topo(plan.source["topology"]).to_dict(), "to": _topo(target).to_dict(),
                    "at_step": _int_or_none(plan.source.get("step")), "policies": policies, "tool": f"reshard {__version__}",
                    "time": time, "kind": kind, "reason": reason})
    d = {
        "format": mf.FORMAT, "format_version": mf.FORMAT_VERSION,
        "experiment_id": exp_id,
        "step": _int_or_none(src.get("step", plan.source.get("step"))),
        "tokens_seen": _int_or_none(src.get("tokens_seen", plan.source.get("tokens_seen"))),
        "samples_seen": _int_or_none(src.get("samples_seen")),
        "key_convention": src.get("key_convention") or plan.source["convention"],
        "topology": _topo(target).to_dict(),
        "batch": batch,
        "accumulation": src.get("accumulation") or {"micro_step": 0, "in_flight_grads": False},
        "precision": _precision(src, plan),
        "model": _model(plan, src),
        "optimizer": src.get("optimizer") or {"name": "unknown", "config": {}},
        "scheduler": sched,
        "data": data,
        "rng": rng,
        "continuity": "warm_start" if kind == "warm_start" or src.get("continuity") == "warm_start" else "continuation",
        "lineage": lineage,
        "writer": {"tool": f"reshard {__version__}", "torch": mf.torch_version(), "time": time},
    }
    return mf.Manifest.from_dict(d, source="<output manifest>")


def _batch(plan: Plan, src: dict[str, Any]) -> dict[str, Any]:
    """The target recipe, so that a second conversion of the output knows it without flags.

    A source without a manifest had its recipe from `--source-*` (the plan refused flags that
    disagree with a manifest): the sequence length does not change with the layout, so it is
    the source's; micro-batch, accumulation and global batch are the plan's target recipe.
    """
    batch = dict(src.get("batch") or {"micro_batch": None, "grad_accum": None, "seq_len": None, "global_batch": None})
    if batch.get("seq_len") is None and plan.options.source_seq_len is not None:
        batch["seq_len"] = plan.options.source_seq_len
    after = plan.batch.after
    if after is not None:
        batch.update(micro_batch=after.micro_batch, grad_accum=after.grad_accum, global_batch=after.global_batch)
    return batch


def _model(plan: Plan, src: dict[str, Any]) -> dict[str, Any]:
    """The source's model section, with what the user said of the model (``--tie``, model config, rules).

    Recorded so that a second conversion of the output needs neither the flags nor the
    profile: the output's manifest says it. A manifest's own values stay; the user's fill in.
    """
    model = dict(src.get("model") or {"family": "unknown", "config": {}, "tied": []})
    chosen = plan.rules or (plan.slice or {}).get("family")  # a slice names the rules it was cut by
    if model.get("family") in (None, "unknown") and chosen and shipped(chosen) is not None:
        model["family"] = chosen  # a shipped family: a later plan selects the same rules by name
    config = dict(model.get("config") or {})
    for k, v in (plan.options.model_config or {}).items():
        config.setdefault(k, v)
    if plan.slice is not None:  # the slice is a smaller model: n_layers (n_experts) as the slice has them
        config.update(plan.slice.get("config") or {})
    model["config"] = config
    tied = [list(t) for t in model.get("tied") or []]
    for t in plan.options.ties or []:
        if list(t) not in tied and list(reversed(t)) not in tied:
            tied.append(list(t))
    model["tied"] = tied
    return model


def _int_or_none(v: object) -> int | None:
    return None if v is None else int(v)  # type: ignore[call-overload]


def _precision(src: dict[str, Any], plan: Plan) -> dict[str, Any]:
    p = dict(src.get("precision") or {"param_dtype": "unknown", "reduce_dtype": "unknown", "loss_scaler": None})
    if plan.options.dtype is not None:
        from reshard.model.plan import DTYPES

        p["param_dtype"] = DTYPES.get(plan.options.dtype, p["param_dtype"])
    return p
