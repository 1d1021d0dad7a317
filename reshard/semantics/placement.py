"""Decide each tensor's placement on the target, from partition rules when TP or PP is involved.

Pure data-parallel changes need no rules: FSDP2 cuts dim 0 of every parameter the same way.
As soon as either side has ``tp > 1`` or ``pp > 1``, every parameter (and its optimizer
moments) must be covered by a rule in `formats/models/` (or ``--rules FILE``); there is no
default placement.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from reshard.errors import BadInput
from reshard.model.layout import Placement
from reshard.semantics.rules import ModelRules, evaluate, even_stages, nearest_degrees, padded_vocab, parse_stages, select, stage_of
from reshard.model.topology import Topology

SHARDED_ROLES = ("parameter", "optimizer_moment")


@dataclass
class TensorGeometry:
    placement: Placement
    target_shape: tuple[int, ...]
    transform: dict[str, Any] | None = None  # {"kind": "reinterleave"|"repad", ...}


@dataclass
class Geometry:
    by_key: dict[str, TensorGeometry]
    rules: ModelRules | None
    reasons: list[str] = field(default_factory=list)        # infeasible
    numerics: list[str] = field(default_factory=list)       # what changes numerically
    stage_map: dict[str, Any] | None = None
    tied_actions: dict[str, tuple[str, str, str | None]] = field(default_factory=dict)  # key -> (action, reason, copy-from key)
    tied_params: list[tuple[str, str]] = field(default_factory=list)  # declared tied model keys: must be equal
    same_storage: set[str] = field(default_factory=set)  # model keys that share storage with their tie on the target
    extra_trainable: set[str] = field(default_factory=set)  # params that become trainable copies on the target


def needs_rules(source: Topology, target: Topology) -> bool:
    return any(getattr(t, d) > 1 for t in (source, target) for d in ("tp", "pp"))


def decide(ix, cls, mdict: dict[str, Any], source: Topology, target: Topology, *,
           rules_file: str | None = None, model_config: dict[str, Any] | None = None,
           pp_stages: str | None = None) -> Geometry:
    params = {r.param: k for k, r in cls.roles.items() if r.role == "parameter" and r.param}
    if not needs_rules(source, target):
        by_key = {}
        for k, e in ix.entries.items():
            if not e.is_tensor:
                continue
            role = cls.roles[k].role
            pl = Placement(dp_shard=bool(role in SHARDED_ROLES and e.shape))
            by_key[k] = TensorGeometry(pl if pl.dp_shard else Placement.replicated(), e.shape)
        return Geometry(by_key, None)

    model = mdict.get("model") or {}
    rules = select(sorted(params), family=model.get("family"), rules_file=rules_file)
    config = dict(model.get("config") or {})
    config.update(model_config or {})
    g = Geometry({}, rules)

    # ------------------------------------------------------------- coverage: no default placement
    uncovered = sorted(p for p in params if rules.rule_for(p) is None)
    if uncovered:
        raise BadInput(f"{len(uncovered)} parameters match no partition rule of '{rules.family}': "
                       + ", ".join(uncovered[:10]) + (" ..." if len(uncovered) > 10 else ""),
                       where=rules.source, hint="Add a rule for each (formats/models/*.toml format) and pass --rules FILE.")

    # ------------------------------------------------------------- divisibility on the target
    checks: dict[str, int] = {}
    for p in params:
        for expr in rules.rule_for(p).divisible:  # type: ignore[union-attr]
            checks[expr] = evaluate(expr, config)
        rule = rules.rule_for(p)
        for part in rule.parts:  # type: ignore[union-attr]
            checks[part.size] = evaluate(part.size, config)
    bad = {e: v for e, v in checks.items() if v % target.tp}
    if bad:
        g.reasons.append(f"tp={target.tp} does not divide " + ", ".join(f"{e} = {v}" for e, v in bad.items())
                         + f"; nearest feasible tp: {nearest_degrees(list(checks.values()), target.tp)}")
    bad_src = {e: v for e, v in checks.items() if v % source.tp}
    if bad_src:
        raise BadInput(f"the source tp={source.tp} does not divide " + ", ".join(f"{e} = {v}" for e, v in bad_src.items()),
                       hint="The source topology or the model configuration is wrong; check the manifest or pass --from.")

    # ------------------------------------------------------------- pipeline stages
    num_layers = None
    if rules.pipeline.layer is not None:
        layers = [int(m.group("layer")) for p in params if (m := rules.pipeline.layer.match(p))]
        counted = max(layers) + 1 if layers else 0
        num_layers = config.get(rules.pipeline.num_layers or "", counted) if rules.pipeline.num_layers else counted
        if not isinstance(num_layers, int):
            num_layers = counted
    stages: list[tuple[int, int]] | None = None
    if target.pp > 1:
        if pp_stages:
            stages = parse_stages(pp_stages, num_layers or 0, target.pp)
        elif not num_layers or num_layers % target.pp:
            g.reasons.append(f"pp={target.pp} does not divide the {num_layers} layers; nearest feasible pp: "
                             f"{nearest_degrees([num_layers or 1], target.pp)} (or give an explicit --pp-stages)")
        unstaged = sorted(p for p in params if stage_of(p, rules, target.pp, num_layers or 1, stages) is None)
        if unstaged:
            raise BadInput(f"{len(unstaged)} parameters have no pipeline stage rule: " + ", ".join(unstaged[:10]),
                           where=rules.source, hint="Add them to [pipeline] first/last or the layer pattern.")
    if num_layers:
        split = stages or even_stages(num_layers, target.pp)
        g.stage_map = {"num_layers": num_layers, "split": "explicit" if stages else "even", "stages": [
            {"stage": s, "layers": list(split[s]),
             "holds": [p for p in sorted(params) if (stage_of(p, rules, target.pp, num_layers, stages) == s
                                                    and not (rules.pipeline.layer and rules.pipeline.layer.match(p)))]}
            for s in range(target.pp)]}

    # ------------------------------------------------------------- per tensor
    moments_of: dict[str, list[str]] = {}
    for k, r in cls.roles.items():
        if r.role in ("optimizer_moment", "optimizer_step") and r.param:
            moments_of.setdefault(r.param, []).append(k)
    for k, e in ix.entries.items():
        if not e.is_tensor:
            continue
        r = cls.roles[k]
        fqn = r.param if r.role in ("parameter", "optimizer_moment", "optimizer_step") else None
        rule = rules.rule_for(fqn) if fqn else None
        stage = stage_of(fqn, rules, target.pp, num_layers or 1, stages) if (fqn and target.pp > 1) else None
        if rule is None or r.role == "optimizer_step" or not e.shape:
            g.by_key[k] = TensorGeometry(Placement.replicated(stage), e.shape)
            continue
        tp_dim = rule.dim if rule.tp in ("shard", "fused") else None
        shape = tuple(e.shape)
        transform = None
        if rule.tp == "fused" and source.tp != target.tp:
            parts = [evaluate(p.size, config) for p in rule.parts]
            transform = {"kind": "reinterleave", "dim": rule.dim, "parts": parts, "from_tp": source.tp, "to_tp": target.tp}
        if rule.vocab is not None:
            size, src_rows = padded_vocab(rule.vocab, config, source.tp)
            _, dst_rows = padded_vocab(rule.vocab, config, target.tp)
            if shape[rule.dim] != src_rows:
                raise BadInput(f"'{k}' has {shape[rule.dim]} rows, the rules expect vocab {size} padded to {src_rows} at tp={source.tp}",
                               where=k, hint="Check vocab_size / vocab_multiple in the model configuration.")
            if dst_rows != src_rows:
                fill = rule.vocab.fill if r.role == "parameter" else 0.0
                transform = {"kind": "repad", "dim": rule.dim, "vocab": size, "from_rows": src_rows, "to_rows": dst_rows, "fill": fill}
                s_ = list(shape)
                s_[rule.dim] = dst_rows
                shape = tuple(s_)
        g.by_key[k] = TensorGeometry(Placement(dp_shard=True, tp_dim=tp_dim, stage=stage), shape, transform)

    # ------------------------------------------------------------- tied copies across stages
    declared = {tuple(t) for t in (model.get("tied") or [])}
    for a, b in rules.pipeline.tied:
        # The rules say which copies a model family may tie; the manifest says whether this model does.
        if a not in params or b not in params or ((a, b) not in declared and (b, a) not in declared):
            continue
        g.tied_params.append((params[a], params[b]))
        if target.pp == 1:
            g.same_storage.add(params[b])
        elif moments_of.get(a):
            g.extra_trainable.add(b)
        ma, mb = sorted(moments_of.get(a, [])), sorted(moments_of.get(b, []))
        # Flattened per-parameter param groups (`...param_groups.<fqn>.<hyper>`) follow the state.
        ga = sorted(k for k, r in cls.roles.items() if r.role == "param_group" and f".{a}." in k)
        gb = sorted(k for k, r in cls.roles.items() if r.role == "param_group" and f".{b}." in k)
        if target.pp > 1 and ma and not mb:
            for key in ma:
                new = key.replace(a, b, 1)
                g.tied_actions[new] = ("added", f"tied copy of {a} on the last stage: its optimizer state is a copy of {a}'s", key)
            if not gb:
                for key in ga:
                    g.tied_actions[key.replace(f".{a}.", f".{b}.", 1)] = (
                        "added", f"tied copy of {a} on the last stage: its param group is a copy of {a}'s", key)
        elif target.pp == 1 and ma and mb:
            for key in mb:
                g.tied_actions[key] = ("dropped", f"tied copy of {a}: one tensor on a single stage, its state equals {a}'s (checked on convert)",
                                       key.replace(b, a, 1))
            for key in gb:
                g.tied_actions[key] = ("dropped", f"tied copy of {a}: one tensor on a single stage, one param group", None)

    # ------------------------------------------------------------- numerics
    if source.tp != target.tp:
        g.numerics.append(f"tensor parallel {source.tp} -> {target.tp}: matmul partial sums and all-reduce order change; "
                          "outputs match to fp rounding, not bitwise")
        if any(t.transform and t.transform["kind"] == "repad" for t in g.by_key.values()):
            g.numerics.append("padded vocabulary rows change: the softmax sums over a different number of padding logits")
    if source.pp != target.pp:
        g.numerics.append(f"pipeline {source.pp} -> {target.pp} stages: micro-batch execution order changes (same math)")
    return g
