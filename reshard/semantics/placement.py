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
from reshard.model.kinds import Action
from reshard.model.layout import Placement
from reshard.semantics.rules import ConfigShape, ModelRules, evaluate, even_stages, names_in, nearest_degrees, padded_vocab, parse_stages, select, stage_of
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
    tied_actions: dict[str, tuple[Action, str, str | None]] = field(default_factory=dict)  # key -> (action, reason, copy-from key)
    tied_params: list[tuple[str, str]] = field(default_factory=list)  # declared tied model keys: must be equal
    same_storage: set[str] = field(default_factory=set)  # model keys that share storage with their tie on the target
    extra_trainable: set[str] = field(default_factory=set)  # params that become trainable copies on the target


def needs_rules(source: Topology, target: Topology) -> bool:
    return any(getattr(t, d) > 1 for t in (source, target) for d in ("tp", "pp"))


@dataclass
class _Stages:
    """The target's pipeline cut: ``pp`` stages over ``num_layers`` layers, evenly or as ``--pp-stages`` gives them."""

    pp: int
    num_layers: int | None
    explicit: list[tuple[int, int]] | None

    def of(self, fqn: str, rules: ModelRules) -> int | None:
        """The stage holding parameter ``fqn`` (None: no rule places it)."""
        return stage_of(fqn, rules, self.pp, self.num_layers or 1, self.explicit)


def decide(ix, cls, mdict: dict[str, Any], source: Topology, target: Topology, *,
           rules_file: str | None = None, model_config: dict[str, Any] | None = None,
           pp_stages: str | None = None, ties: list[list[str]] | None = None) -> Geometry:
    """Every tensor's target placement and shape, what makes the target infeasible, and what changes numerically.

    Checks run in the order a user fixes them: rule coverage, tp divisibility, pipeline stages,
    then each tensor (vocab padding); tied copies and numerics follow from the result.
    """
    params = _parameters(cls)
    if not needs_rules(source, target):
        return _data_parallel(ix, cls)
    model = mdict.get("model") or {}
    rules = select(sorted(params), family=model.get("family"), rules_file=rules_file)
    g = Geometry({}, rules)
    _check_coverage(rules, params)
    _check_rules_match_cuts(ix, rules, params, source)
    config = _config(ix, rules, params, model, model_config)
    _check_needed(ix, rules, params, config, source, target)
    g.reasons += _tp_reasons(rules, params, config, source, target)
    stages = _target_stages(rules, params, config, target, pp_stages)
    g.reasons += _pp_reasons(stages, bool(pp_stages))
    _check_staged(rules, params, stages)
    g.stage_map = _stage_map(rules, params, stages)
    for k, e in ix.entries.items():
        if e.is_tensor:
            g.by_key[k] = _tensor_geometry(k, e, cls.roles[k], rules, config, source, target, stages)
    _tie_copies(g, rules, cls, params, model.get("tied"), target, user=ties or [])
    g.numerics = _numerics(source, target, g.by_key) + _vocab_notes(rules, params, config, source, target)
    return g


def _parameters(cls) -> dict[str, str]:
    """Parameter FQN -> its model key."""
    return {r.param: k for k, r in cls.roles.items() if r.role == "parameter" and r.param}


def _data_parallel(ix, cls) -> Geometry:
    """Pure data-parallel changes need no rules: parameters and moments FSDP-sharded on dim 0, the rest replicated."""
    by_key = {}
    for k, e in ix.entries.items():
        if not e.is_tensor:
            continue
        role = cls.roles[k].role
        pl = Placement(dp_shard=bool(role in SHARDED_ROLES and e.shape))
        by_key[k] = TensorGeometry(pl if pl.dp_shard else Placement.replicated(), e.shape)
    return Geometry(by_key, None)


def _config(ix, rules: ModelRules, params: dict[str, str], model: dict[str, Any],
            model_config: dict[str, Any] | None) -> dict[str, Any]:
    """The manifest's model configuration, overridden by the command line's, completed from the checkpoint's shapes.

    A value the rules declare a tensor dimension (``[config.NAME] from = ..., axis = N``) is
    read from the checkpoint when neither gives it, so nobody types a number the checkpoint
    already holds. A given value that contradicts the shape is refused naming both: every
    size computed from it (divisibility, fused parts) would be wrong, and silently.
    """
    cli = dict(model_config or {})
    given = dict(model.get("config") or {})
    given.update(cli)
    config = dict(given)
    for cs in rules.config_shapes:
        read = _shape_value(ix, rules, params, cs)
        if read is None:
            continue
        value, key, shape = read
        if cs.name not in given:
            config[cs.name] = value
        elif given[cs.name] != value:
            origin = f"--model-config {cs.name}={given[cs.name]}" if cs.name in cli \
                else f"the manifest's model.config {cs.name} = {given[cs.name]}"
            raise BadInput(f"{origin} contradicts the checkpoint: '{key}' has shape {list(shape)}, so "
                           f"{cs.name} (its dim {cs.axis}, per the rules of '{rules.family}') is {value}.",
                           where=str(getattr(ix, "root", "")) or rules.source,
                           hint=f"Drop the value (it is read from the checkpoint) or pass --model-config "
                                f"{cs.name}={value}; if the checkpoint is right and the rules are wrong, fix "
                                f"[config.{cs.name}] in {rules.source}.")
    return config


def _shape_value(ix, rules: ModelRules, params: dict[str, str], cs: ConfigShape) -> tuple[int, str, tuple] | None:
    """(value, key, shape) of ``cs`` from the first parameter it names; None when the checkpoint has none.

    Every matching parameter must agree (the layers of one model have one width); an axis
    beyond a tensor's rank is a wrong rule, refused naming both.
    """
    found: tuple[int, str, tuple] | None = None
    for fqn in sorted(params):
        e = ix.entries.get(params[fqn]) if cs.source.match(fqn) else None
        if e is None or not e.is_tensor or not e.shape:
            continue
        shape = tuple(e.shape)
        if cs.axis >= len(shape):
            raise BadInput(f"[config.{cs.name}] reads dim {cs.axis} of '{params[fqn]}', which has shape {list(shape)}.",
                           where=rules.source, hint=f"Fix [config.{cs.name}] axis (0..{len(shape) - 1}) or pass "
                                                    f"--model-config {cs.name}=N.")
        if found is None:
            found = (int(shape[cs.axis]), params[fqn], shape)
        elif found[0] != shape[cs.axis]:
            raise BadInput(f"[config.{cs.name}] reads dim {cs.axis}, but '{found[1]}' has {found[0]} there and "
                           f"'{params[fqn]}' has {shape[cs.axis]}.", where=rules.source,
                           hint=f"Narrow [config.{cs.name}] from to one tensor or pass --model-config {cs.name}=N.")
    return found


def _check_needed(ix, rules: ModelRules, params: dict[str, str], config: dict[str, Any], source: Topology,
                  target: Topology) -> None:
    """Every config value this change needs and nobody gave, asked for in one message.

    Needed are only the values a check or a transform of this target evaluates: the
    ``divisible`` sizes when the TP degree changes to one > 1, a fused rule's part sizes
    (re-interleaving) and a vocab rule's size and multiple (re-padding) whenever it
    changes. A TP degree that stays (``tp=2 -> tp=2``) needs none: the source already
    divides whatever the rules name, and nothing is re-cut.
    """
    if source.tp == target.tp:
        return
    why: dict[str, list[str]] = {}

    def need(exprs, reason: str) -> None:
        for expr in exprs:
            for n in names_in(expr):
                if n not in config and reason not in why.setdefault(n, []):
                    why[n].append(reason)

    used = {id(rules.rule_for(p)) for p in params}
    for rule in (r for _, r in rules.params if id(r) in used):  # in the rules' order: the message reads like the file
        if target.tp > 1:
            need(rule.divisible, f"tp={target.tp} must divide it")
        if rule.tp == "fused":
            need([x.size for x in rule.parts], "re-interleaving fused parts")
        if rule.vocab is not None and pads(rule.vocab, config):
            need([rule.vocab.size] + ([rule.vocab.multiple] if rule.vocab.multiple else []),
                 f"re-padding the vocabulary from tp={source.tp} to tp={target.tp}")
    if not why:
        return
    read = [cs.name for cs in rules.config_shapes if cs.name in config]
    listed = "; ".join(f"{n} ({', '.join(r)})" for n, r in why.items())
    example = " ".join(f"--model-config {n}=N" for n in why)
    raise BadInput(f"tp={source.tp} -> tp={target.tp} needs {len(why)} model config value"
                   f"{'s' if len(why) > 1 else ''} the checkpoint does not hold and nobody gave: {listed}"
                   + (f" (read from the checkpoint's shapes: {', '.join(f'{n}={config[n]}' for n in read)})" if read else "")
                   + ".", where=str(getattr(ix, "root", "")) or rules.source,
                   hint=f"Pass them all at once: {example} (or record them in the manifest's model.config).")


def _check_coverage(rules: ModelRules, params: dict[str, str]) -> None:
    """No default placement: every parameter must match a rule."""
    uncovered = sorted(p for p in params if rules.rule_for(p) is None)
    if uncovered:
        raise BadInput(f"{len(uncovered)} parameters match no partition rule of '{rules.family}': "
                       + ", ".join(uncovered[:10]) + (" ..." if len(uncovered) > 10 else ""),
                       where=rules.source, hint="Add a rule for each (formats/models/*.toml format) and pass --rules FILE.")


def _check_rules_match_cuts(ix, rules: ModelRules, params: dict[str, str], source: Topology) -> None:
    """A rule that contradicts the checkpoint's own cut is an error naming the tensor and both dims.

    The source's chunk boxes show where its TP cut lies: with ``tp > 1``, a parameter whose
    chunks start at more than one offset along a dim >= 1 is cut along that dim (dim 0 is
    also FSDP's cut, so it says nothing about TP; a stacked layer axis is dim 0 too). A rule
    that shards along another dim, or replicates the tensor, would place every value on the
    wrong rank and the conversion would write a checkpoint that loads and is wrong. A rule
    dim outside the tensor's rank is refused for the same reason, whatever the tp. A
    parameter stored whole (one chunk, e.g. saved Replicate) is consistent with any rule.
    """
    for fqn, key in sorted(params.items()):
        rule, e = rules.rule_for(fqn), ix.entries.get(key)
        if rule is None or e is None or not e.is_tensor or not e.shape:
            continue
        ndim = len(e.shape)
        where = f"{rules.source}, rule '{rule.pattern}'"
        if rule.tp != "replicate" and not 0 <= rule.dim < ndim:
            raise BadInput(f"the partition rule of '{key}' cuts dim {rule.dim}, but the tensor has {ndim} dims "
                           f"(shape {list(e.shape)}).", where=where,
                           hint="Fix the rule's dim (column-parallel: the output dim, row-parallel: the input dim) "
                                "or pass --rules with the right family.")
        if source.tp <= 1:
            continue
        cut = [d for d in range(1, ndim) if len({c.box.offsets[d] for c in e.chunks}) > 1]
        if not cut or (rule.tp != "replicate" and cut == [rule.dim]):
            continue
        said = "replicate (no cut)" if rule.tp == "replicate" else f"{rule.tp} along dim {rule.dim}"
        stored = " and ".join(f"dim {d}" for d in cut)
        raise BadInput(f"the partition rule of '{key}' says {said}, but the checkpoint's own chunks cut it along "
                       f"{stored} (tp={source.tp}): converting with this rule would put its values on the wrong ranks.",
                       where=where, hint=f"Fix the rule (tp = \"shard\", dim = {cut[0]}) or pass --rules with the "
                                         "family that wrote this checkpoint.")


def _tp_reasons(rules: ModelRules, params: dict[str, str], config: dict[str, Any],
                source: Topology, target: Topology) -> list[str]:
    """Why the target's tp does not divide the sizes the rules name; a source tp that does not is an error.

    A TP degree that stays checks nothing (the source divides them). A size whose values
    nobody gave is not checked: `_check_needed` has asked for every one the target needs,
    so what is left is only the source's sanity check, not worth a question.
    """
    if source.tp == target.tp:
        return []
    checks: dict[str, int] = {}
    for p in params:
        rule = rules.rule_for(p)
        for expr in list(rule.divisible) + [part.size for part in rule.parts]:  # type: ignore[union-attr]
            if all(n in config for n in names_in(expr)):
                checks[expr] = evaluate(expr, config)
    reasons = []
    bad = {e: v for e, v in checks.items() if v % target.tp}
    if bad:
        reasons.append(f"tp={target.tp} does not divide " + ", ".join(f"{e} = {v}" for e, v in bad.items())
                       + f"; nearest feasible tp: {nearest_degrees(list(checks.values()), target.tp)}")
    bad_src = {e: v for e, v in checks.items() if v % source.tp}
    if bad_src:
        raise BadInput(f"the source tp={source.tp} does not divide " + ", ".join(f"{e} = {v}" for e, v in bad_src.items()),
                       hint="The source topology or the model configuration is wrong; check the manifest or pass --from.")
    return reasons


def _num_layers(rules: ModelRules, params: dict[str, str], config: dict[str, Any]) -> int | None:
    """The model's layer count: the configuration's if the rules name it (and it is an int), else counted from names."""
    if rules.pipeline.layer is None:
        return None
    layers = [int(m.group("layer")) for p in params if (m := rules.pipeline.layer.match(p))]
    counted = max(layers) + 1 if layers else 0
    num_layers = config.get(rules.pipeline.num_layers or "", counted) if rules.pipeline.num_layers else counted
    return num_layers if isinstance(num_layers, int) else counted


def _target_stages(rules: ModelRules, params: dict[str, str], config: dict[str, Any], target: Topology,
                   pp_stages: str | None) -> _Stages:
    """The target's pipeline cut; an explicit ``--pp-stages`` is parsed (and checked) only when pp > 1."""
    num_layers = _num_layers(rules, params, config)
    explicit = parse_stages(pp_stages, num_layers or 0, target.pp) if target.pp > 1 and pp_stages else None
    return _Stages(target.pp, num_layers, explicit)


def _pp_reasons(stages: _Stages, explicit: bool) -> list[str]:
    """Why an even cut cannot work: pp does not divide the layers (an explicit cut was checked when parsed)."""
    if stages.pp <= 1 or explicit or (stages.num_layers and not stages.num_layers % stages.pp):
        return []
    return [f"pp={stages.pp} does not divide the {stages.num_layers} layers; nearest feasible pp: "
            f"{nearest_degrees([stages.num_layers or 1], stages.pp)} (or give an explicit --pp-stages)"]


def _check_staged(rules: ModelRules, params: dict[str, str], stages: _Stages) -> None:
    """With pp > 1 every parameter needs a stage: no default placement."""
    if stages.pp <= 1:
        return
    unstaged = sorted(p for p in params if stages.of(p, rules) is None)
    if unstaged:
        raise BadInput(f"{len(unstaged)} parameters have no pipeline stage rule: " + ", ".join(unstaged[:10]),
                       where=rules.source, hint="Add them to [pipeline] first/last or the layer pattern.")


def _stage_map(rules: ModelRules, params: dict[str, str], stages: _Stages) -> dict[str, Any] | None:
    """For the plan's report: each stage's layers and the non-layer parameters it holds (None: no layers known)."""
    if not stages.num_layers:
        return None
    split = stages.explicit or even_stages(stages.num_layers, stages.pp)
    return {"num_layers": stages.num_layers, "split": "explicit" if stages.explicit else "even", "stages": [
        {"stage": s, "layers": list(split[s]),
         "holds": [p for p in sorted(params) if (stages.of(p, rules) == s
                                                and not (rules.pipeline.layer and rules.pipeline.layer.match(p)))]}
        for s in range(stages.pp)]}


def _tensor_geometry(k: str, e, r, rules: ModelRules, config: dict[str, Any], source: Topology, target: Topology,
                     stages: _Stages) -> TensorGeometry:
    """One tensor's placement, target shape and transform, from the rule of the parameter it belongs to."""
    fqn = r.param if r.role in ("parameter", "optimizer_moment", "optimizer_step") else None
    rule = rules.rule_for(fqn) if fqn else None
    stage = stages.of(fqn, rules) if (fqn and target.pp > 1) else None
    if rule is None or r.role == "optimizer_step" or not e.shape:
        return TensorGeometry(Placement.replicated(stage), e.shape)
    tp_dim = rule.dim if rule.tp in ("shard", "fused") else None
    shape = tuple(e.shape)
    transform = _reinterleave(rule, config, source, target)
    if rule.vocab is not None and pads(rule.vocab, config):
        repad = _repad(k, shape, rule, r.role, config, source, target)
        if repad is not None:
            transform = repad
            s_ = list(shape)
            s_[rule.dim] = repad["to_rows"]
            shape = tuple(s_)
    return TensorGeometry(Placement(dp_shard=True, tp_dim=tp_dim, stage=stage), shape, transform)


def pads(vocab, config: dict[str, Any]) -> bool:
    """Whether this run pads its vocabulary: always for a family that pads, else when the run says how.

    A rule with ``only_if = NAME`` (torchtitan's names: torchtitan pads nothing) re-pads only
    when NAME is in the model config (the manifest's, a flag's, a profile's); otherwise the
    rows are carried as saved and the plan says so (`vocab_notes`).
    """
    return vocab.only_if is None or vocab.only_if in config


def _reinterleave(rule, config: dict[str, Any], source: Topology, target: Topology) -> dict[str, Any] | None:
    """A fused tensor (e.g. QKV) whose parts are interleaved per tp rank must be re-interleaved when tp changes."""
    if rule.tp != "fused" or source.tp == target.tp:
        return None
    parts = [evaluate(p.size, config) for p in rule.parts]
    return {"kind": "reinterleave", "dim": rule.dim, "parts": parts, "from_tp": source.tp, "to_tp": target.tp}


def _repad(k: str, shape: tuple[int, ...], rule, role: str, config: dict[str, Any], source: Topology,
           target: Topology) -> dict[str, Any] | None:
    """A vocabulary padded to a multiple of tp gets other padding rows on the target (None: the same rows).

    At an unchanged TP degree the rows stay; their sanity check runs only if the values are known.
    """
    if source.tp == target.tp and not all(n in config for n in names_in(rule.vocab.size)
                                          + names_in(rule.vocab.multiple or "")):
        return None
    size, src_rows = padded_vocab(rule.vocab, config, source.tp)
    _, dst_rows = padded_vocab(rule.vocab, config, target.tp)
    if shape[rule.dim] != src_rows:
        raise BadInput(f"'{k}' has {shape[rule.dim]} rows, the rules expect vocab {size} padded to {src_rows} at tp={source.tp}",
                       where=k, hint="Check vocab_size / vocab_multiple in the model configuration.")
    if dst_rows == src_rows:
        return None
    fill = rule.vocab.fill if role == "parameter" else 0.0
    return {"kind": "repad", "dim": rule.dim, "vocab": size, "from_rows": src_rows, "to_rows": dst_rows, "fill": fill}


def _moments_of(cls) -> dict[str, list[str]]:
    """Parameter FQN -> the keys of its optimizer state (moments and step)."""
    moments_of: dict[str, list[str]] = {}
    for k, r in cls.roles.items():
        if r.role in ("optimizer_moment", "optimizer_step") and r.param:
            moments_of.setdefault(r.param, []).append(k)
    return moments_of


def _tie_copies(g: Geometry, rules: ModelRules, cls, params: dict[str, str], tied: list | None, target: Topology,
                user: list[list[str]] = ()) -> None:
    """Record the model's declared ties the rules allow, and what happens to the tied copy's state on the target.

    A ``--tie A=B`` of the user's counts as allowed too: the user says this model ties them.
    """
    moments_of = _moments_of(cls)
    declared = {tuple(t) for t in (tied or [])} | {tuple(t) for t in user}
    for a, b in list(rules.pipeline.tied) + [tuple(t) for t in user if tuple(t) not in rules.pipeline.tied]:
        # The rules say which copies a model family may tie; the manifest says whether this model does.
        if a not in params or b not in params or ((a, b) not in declared and (b, a) not in declared):
            continue
        g.tied_params.append((params[a], params[b]))
        if target.pp == 1:
            g.same_storage.add(params[b])
        elif moments_of.get(a):
            g.extra_trainable.add(b)
        g.tied_actions.update(_tied_actions(a, b, cls, moments_of, target.pp))


def _tied_actions(a: str, b: str, cls, moments_of: dict[str, list[str]], pp: int) -> dict[str, tuple[Action, str, str | None]]:
    """The copy ``b`` of ``a``: on separate stages its state is added (a copy of ``a``'s), on one stage dropped."""
    actions: dict[str, tuple[Action, str, str | None]] = {}
    ma, mb = sorted(moments_of.get(a, [])), sorted(moments_of.get(b, []))
    # Flattened per-parameter param groups (`...param_groups.<fqn>.<hyper>`) follow the state.
    ga = sorted(k for k, r in cls.roles.items() if r.role == "param_group" and f".{a}." in k)
    gb = sorted(k for k, r in cls.roles.items() if r.role == "param_group" and f".{b}." in k)
    if pp > 1 and ma and not mb:
        for key in ma:
            new = key.replace(a, b, 1)
            actions[new] = (Action.ADDED, f"tied copy of {a} on the last stage: its optimizer state is a copy of {a}'s", key)
        if not gb:
            for key in ga:
                actions[key.replace(f".{a}.", f".{b}.", 1)] = (
                    Action.ADDED, f"tied copy of {a} on the last stage: its param group is a copy of {a}'s", key)
    elif pp == 1 and ma and mb:
        for key in mb:
            actions[key] = (Action.DROPPED, f"tied copy of {a}: one tensor on a single stage, its state equals {a}'s (checked on convert)",
                            key.replace(b, a, 1))
        for key in gb:
            actions[key] = (Action.DROPPED, f"tied copy of {a}: one tensor on a single stage, one param group", None)
    return actions


def _vocab_notes(rules: ModelRules, params: dict[str, str], config: dict[str, Any], source: Topology,
                 target: Topology) -> list[str]:
    """The assumption a TP change makes about a vocabulary nobody said is padded, stated in the verdict."""
    if source.tp == target.tp:
        return []
    unsaid = sorted({p for p in params if (r := rules.rule_for(p)) is not None and r.vocab is not None
                     and not pads(r.vocab, config)})
    if not unsaid:
        return []
    name = rules.rule_for(unsaid[0]).vocab.only_if
    return [f"vocabulary rows of {', '.join(unsaid)} carried as saved: no padding assumed ({rules.family} pads none "
            f"unless {name} is given; pass --model-config vocab_size=N --model-config {name}=M if the run padded)"]


def _numerics(source: Topology, target: Topology, by_key: dict[str, TensorGeometry]) -> list[str]:
    """What changes numerically (not what breaks): partial-sum order, padding logits, micro-batch order."""
    numerics = []
    if source.tp != target.tp:
        numerics.append(f"tensor parallel {source.tp} -> {target.tp}: layer outputs are summed from the ranks' partial "
                        "results in another order: outputs match to rounding, not bitwise")
        if any(t.transform and t.transform["kind"] == "repad" for t in by_key.values()):
            numerics.append("padded vocabulary rows change: the softmax sums over a different number of padding logits")
    if source.pp != target.pp:
        numerics.append(f"pipeline {source.pp} -> {target.pp} stages: micro-batch execution order changes (same math)")
    return numerics
