"""A layer slice of a model: which keys belong to which layer, which survive, and their new names.

A slice is the most representative small copy of a real checkpoint: its embeddings, some
of its transformer layers (renumbered densely, so a model built with that many layers
loads it), its final norm and head, with those parameters' real optimizer state. What a
layer is comes from the model family's ``[pipeline]`` description in ``formats/models/``
(the same one pipeline stages are cut by): ``layer`` is a regular expression over
parameter FQNs whose named group ``layer`` is the index, ``num_layers`` the model config
name of the layer count. Optionally the experts of an MoE layer are sliced the same way,
from the family's ``[experts]`` table (``match`` with a named group ``expert``,
``num_experts`` its config name), or, where the experts are stacked in one tensor (torchtitan's
``GroupedExperts``: ``w1_EFD`` of shape (experts, hidden, dim)), along the expert axis of those
tensors (``stacked = [{ match, dim }]``): their rows of the kept experts, like a router's.

This module knows names only: it decides each key's fate (outside every layer, kept as
is, renamed, dropped) and rewrites lists of FQNs; the plan applies it to the keys and the
engine copies the bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from reshard.model.kinds import SliceFate
from reshard.errors import BadInput
from reshard.patterns import Pattern, compile_pattern
from reshard.safefs import loads_toml
from reshard.units import consecutive_runs
from reshard.semantics.rules import ModelRules, evaluate

# The roles whose keys name a parameter (model keys, their optimizer state and per-parameter
# hyper-parameters): only these are sliced; trainer state (RNG, data, counters) is not per layer.
LAYERED_ROLES = ("parameter", "optimizer_moment", "optimizer_step", "param_group")


@dataclass(frozen=True)
class Axis:
    """One dimension a slice cuts: layers, or the experts of each MoE layer."""

    what: str                     # "layer" | "expert"
    flag: str                     # the option that chose it: --layers / --experts
    pattern: Pattern      # over a parameter FQN; the named group ``what`` is the index
    count: int                    # how many the source has
    kept: tuple[int, ...]         # source indices kept, increasing
    config_name: str | None = None  # model config name of ``count`` (n_layers, n_experts)

    def new_index(self, index: int) -> int | None:
        """The index in the slice (dense, in the source's order); None: not in the slice."""
        try:
            return self.kept.index(index)
        except ValueError:
            return None

    def renumbered(self) -> dict[int, int]:
        return {old: new for new, old in enumerate(self.kept) if old != new}

    def describe(self) -> str:
        """``layers 0,3 of 4 (3 renumbered 1)``."""
        ren = self.renumbered()
        return (f"{self.what}s {_ranges(self.kept)} of {self.count}"
                + (f" ({', '.join(f'{a} renumbered {b}' for a, b in ren.items())})" if ren else ""))

    def to_dict(self) -> dict[str, Any]:
        return {"flag": self.flag, "source": self.count, "kept": list(self.kept), "count": len(self.kept),
                "renumbered": {str(a): b for a, b in self.renumbered().items()}, "config_name": self.config_name}


@dataclass(frozen=True)
class Fate:
    """What becomes of one key: ``outside`` (no layer: kept), ``kept`` (same name), ``renamed`` or ``dropped``."""

    kind: SliceFate
    new_key: str | None = None
    reason: str = ""


@dataclass(frozen=True)
class Slice:
    """The axes a slice cuts, and the family whose description it follows."""

    family: str
    rules_source: str
    axes: tuple[Axis, ...]
    first: tuple[Pattern, ...] = ()
    last: tuple[Pattern, ...] = ()
    notes: list[str] = field(default_factory=list, compare=False)
    # ``[experts] router``: parameters with one row (along ``dim``) per expert, e.g. the router's
    # gate: the slice keeps the rows of the kept experts, in order
    routers: tuple[tuple[Pattern, int], ...] = ()

    def rows_kept(self, param: str | None) -> tuple[int, tuple[int, ...]] | None:
        """(dim, source rows kept) of a router parameter; None: not one (or no expert slice)."""
        experts = next((a for a in self.axes if a.what == "expert"), None)
        if experts is None or not param:
            return None
        for pattern, dim in self.routers:
            if pattern.match(param):
                return dim, experts.kept
        return None

    def fate(self, key: str, param: str | None = None) -> Fate:
        """The fate of ``key`` (whose parameter FQN is ``param`` when its convention says it).

        The layer is found in the FQN: ``param`` when known, else the first place after a
        ``.`` of the key where the family's pattern matches (a per-parameter optimizer
        hyper-parameter ``optimizer.param_groups.<fqn>.lr`` names its parameter that way).
        """
        new_key, changes = key, []
        for axis in self.axes:
            found = _locate(new_key, param, axis)
            if found is None:
                continue
            index, start, end = found
            ni = axis.new_index(index)
            if ni is None:
                return Fate(SliceFate.DROPPED, reason=f"{axis.what} {index} not in the slice ({axis.flag})")
            if ni != index:
                new_key = new_key[:start] + str(ni) + new_key[end:]
                if param is not None:
                    param = _renamed_param(param, axis, ni)
                changes.append(f"{axis.what} {index} is {axis.what} {ni} of the slice")
        if not changes:
            return Fate(SliceFate.OUTSIDE if not any(_locate(key, param, a) for a in self.axes) else SliceFate.KEPT)
        return Fate(SliceFate.RENAMED, new_key, "; ".join(changes))

    def rename_fqns(self, fqns: list[Any]) -> tuple[list[Any], int, int] | None:
        """A list of parameter FQNs (an optimizer group's ``params``) for the slice: (new list, dropped, renamed).

        None when the list names no sliced parameter (nothing to rewrite) or holds anything
        but strings (integer parameter ids cannot be told apart by layer).
        """
        if not fqns or not all(isinstance(x, str) for x in fqns):
            return None
        out, dropped, renamed = [], 0, 0
        for fqn in fqns:
            f = self.fate(fqn, fqn)
            if f.kind == SliceFate.DROPPED:
                dropped += 1
            elif f.kind == SliceFate.RENAMED:
                renamed += 1
                out.append(f.new_key)
            else:
                out.append(fqn)
        return (out, dropped, renamed) if dropped or renamed else None

    def config_updates(self) -> dict[str, int]:
        """The model config values the slice changes (n_layers 4 -> 2)."""
        return {a.config_name: len(a.kept) for a in self.axes if a.config_name}

    def describe(self) -> str:
        return "; ".join(a.describe() for a in self.axes)

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.family, "rules": self.rules_source, "description": self.describe(),
                **{a.what + "s": a.to_dict() for a in self.axes}, "config": self.config_updates(),
                "notes": list(self.notes)}


def _ranges(xs: Iterable[int]) -> str:
    """``0-1,5,7-9``."""
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in consecutive_runs(xs))


def _locate(key: str, param: str | None, axis: Axis) -> tuple[int, int, int] | None:
    """(index, start, end) of ``axis``'s index digits in ``key``; None: the key names no such index."""
    starts: list[int] = []
    if param:
        at = key.rfind(param)
        if at >= 0:
            starts.append(at)
    starts += [0] + [i + 1 for i, c in enumerate(key) if c == "."]
    for s in starts:
        m = axis.pattern.match(key[s:])
        if m is not None:
            return int(m.group(axis.what)), s + m.start(axis.what), s + m.end(axis.what)
    return None


def _renamed_param(param: str, axis: Axis, new: int) -> str:
    m = axis.pattern.match(param)
    if m is None:
        return param
    return param[:m.start(axis.what)] + str(new) + param[m.end(axis.what):]


def parse_indices(spec: str, count: int | None, *, flag: str, what: str) -> tuple[int, ...]:
    """``0-1`` / ``0,5,79`` / ``0-2,7``: inclusive ranges and single indices, increasing, within ``count``.

    ``count`` None checks the writing only (the command line does, before the source is read)."""
    runs: list[tuple[int, int]] = []
    try:
        for part in str(spec).split(","):
            a, dash, b = part.strip().partition("-")
            lo, hi = int(a), int(b) if dash else int(a)
            if hi < lo or lo < 0:
                raise ValueError
            runs.append((lo, hi))
    except ValueError:
        raise BadInput(f"{flag} '{spec}' is not a list of {what} indices",
                       hint=f"Write inclusive ranges or single {what}s, in increasing order, e.g. {flag} 0-1 "
                            f"or {flag} 0,2,5.") from None
    if any(b[0] <= a[1] for a, b in zip(runs, runs[1:])):
        raise BadInput(f"{flag} '{spec}' repeats a {what} or is not in increasing order",
                       hint=f"Give each {what} once, in the source's order: the slice keeps their order and "
                            "renumbers them densely.")
    if count is None:
        return ()
    if runs[-1][1] >= count:  # checked on the ranges, before they are spelled out
        bad = next(lo if lo >= count else count for lo, hi in runs if hi >= count)
        raise BadInput(f"{flag} '{spec}' names {what} {bad}, but the source has {count} {what}s "
                       f"(0-{count - 1})", hint=f"Choose {what}s between 0 and {count - 1}.")
    out = tuple(i for lo, hi in runs for i in range(lo, hi + 1))
    if len(out) == count:
        raise BadInput(f"{flag} '{spec}' keeps every {what} of the source: that is no slice",
                       hint=f"Drop {flag} to convert the whole model, or leave some {what}s out.")
    return out


def _count(axis_what: str, pattern: Pattern, params: list[str], config: dict[str, Any],
           config_name: str | None, rules: ModelRules) -> int:
    """How many layers (experts) the source has: from the parameter names, checked against the config."""
    seen = set()
    for p in params:
        m = pattern.match(p)
        if m is not None:
            seen.add(int(m.group(axis_what)))
    if not seen:
        raise BadInput(f"no parameter of this checkpoint matches the {axis_what} pattern of family "
                       f"'{rules.family}' ({pattern.pattern})", where=rules.source,
                       hint="Check that the family matches the checkpoint (--rules NAME|FILE).")
    n = max(seen) + 1
    if config_name and config_name in config:
        declared = evaluate(config_name, config)
        if declared != n:
            raise BadInput(f"the model config says {config_name} = {declared}, but the checkpoint's parameters "
                           f"name {axis_what}s 0-{n - 1}", where=rules.source,
                           hint=f"Correct --model-config {config_name}=... (or the manifest's model.config).")
    missing = sorted(set(range(n)) - seen)
    if missing:
        raise BadInput(f"the checkpoint has no parameter of {axis_what} {missing[0]} (of 0-{n - 1}): "
                       f"not a complete model to slice", where=rules.source)
    return n


def declared_experts(rules: ModelRules) -> dict[str, Any]:
    """The family's ``[experts]`` table (empty: none), read from its rules file (already read once as rules)."""
    from pathlib import Path

    try:
        text = Path(rules.source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return {}
    spec = loads_toml(text, where=rules.source, what="partition rules file")
    table = spec.get("experts")
    return table if isinstance(table, dict) else {}


def plan_slice(rules: ModelRules, params: Iterable[str], *, layers: str | None, experts: str | None = None,
               config: dict[str, Any] | None = None, experts_table: dict[str, Any] | None = None,
               shapes: dict[str, tuple[int, ...]] | None = None) -> Slice:
    """The slice ``--layers`` / ``--experts`` ask for, from the family's ``[pipeline]`` (and ``[experts]``).

    A family that declares no per-layer names is refused: reshard does not guess which
    parameters make a layer. ``experts_table`` is the family's ``[experts]`` table
    (``match``, ``num_experts``, ``router``, ``stacked``); by default it is read from the rules file.
    ``shapes``: each parameter's global shape, from which stacked experts are counted.
    """
    params = sorted(params)
    config = dict(config or {})
    pl = rules.pipeline
    axes: list[Axis] = []
    routers: tuple[tuple[Pattern, int], ...] = ()
    if layers is not None:
        if pl.layer is None or "layer" not in pl.layer.groupindex:
            why = ("declares no [pipeline] table" if not (pl.first or pl.last or pl.layer) else
                   "has a [pipeline] table without a per-layer name pattern (`layer`: its layers are not named "
                   "one by one, e.g. stacked in one tensor)")
            raise BadInput(f"--layers needs to know which parameters make each layer, and model family "
                           f"'{rules.family}' {why}", where=rules.source,
                           hint="Pass --rules FILE with a [pipeline] table whose `layer` is a regular expression "
                                "over parameter names with a named group (?P<layer>\\d+), e.g. "
                                "layer = '^layers\\.(?P<layer>\\d+)\\.' (see formats/models/*.toml).")
        n = _count("layer", pl.layer, params, config, pl.num_layers, rules)
        axes.append(Axis("layer", "--layers", pl.layer, n, parse_indices(layers, n, flag="--layers", what="layer"),
                         pl.num_layers))
    if experts is not None:
        table = experts_table if experts_table is not None else declared_experts(rules)
        stacked = _routers(table.get("stacked", []), rules, what="stacked")
        if stacked and not isinstance(table.get("match"), str):
            axes.append(_stacked_axis(stacked, params, shapes or {}, config, table, experts, rules))
            routers = _routers(table.get("router", []), rules) + stacked
        elif not isinstance(table.get("match"), str):
            raise BadInput(f"--experts needs the experts of each MoE layer, and model family '{rules.family}' "
                           "declares no [experts] table", where=rules.source,
                           hint="Only families that declare their expert dimension can slice experts: pass "
                                "--rules FILE with [experts] match = '<regex with (?P<expert>\\d+)>' and "
                                "num_experts = '<config name>' (or stacked = [{ match = '<parameter regex>', "
                                "dim = <expert axis> }] for experts stacked in one tensor), or drop --experts.")
        else:
            pattern = compile_pattern(table["match"], rules.source, what="[experts] match")
            if "expert" not in pattern.groupindex:
                raise BadInput("[experts] match has no named group (?P<expert>\\d+)", where=rules.source)
            name = table.get("num_experts") if isinstance(table.get("num_experts"), str) else None
            n = _count("expert", pattern, params, config, name, rules)
            axes.append(Axis("expert", "--experts", pattern, n,
                             parse_indices(experts, n, flag="--experts", what="expert"), name))
            routers = _routers(table.get("router", []), rules) + stacked
    notes = []
    outside = [p for p in params if all(_locate(p, p, a) is None for a in axes)]
    unplaced = [p for p in outside if not any(x.match(p) for x in (*pl.first, *pl.last))]
    if unplaced and layers is not None:
        notes.append(f"{len(unplaced)} parameters belong to no layer and to neither end of the model "
                     f"(e.g. {unplaced[0]}): kept")
    return Slice(rules.family, rules.source, tuple(axes), tuple(pl.first), tuple(pl.last), notes, routers)


def _routers(tables: Any, rules: ModelRules, what: str = "router") -> tuple[tuple[Pattern, int], ...]:
    """``router`` / ``stacked = [{ match = REGEX, dim = N }]``: the parameters with a row per expert along ``dim``."""
    out = []
    for t in tables if isinstance(tables, list) else [tables]:
        if not isinstance(t, dict) or not isinstance(t.get("match"), str) or not isinstance(t.get("dim", 0), int):
            raise BadInput(f"[experts] {what} must be a list of {{ match = '<parameter regex>', dim = <int> }}",
                           where=rules.source)
        out.append((compile_pattern(t["match"], rules.source, what=f"[experts] {what} match"), int(t.get("dim", 0))))
    return tuple(out)


# No parameter name carries an expert index when the experts are stacked: the axis's pattern
# matches nothing (RE2: an empty character class), so no key is dropped or renamed by name, and
# the stacked tensors (and routers) keep the rows of the kept experts instead.
_NO_NAME = r"(?P<expert>[^\s\S])"


def _stacked_axis(stacked: tuple[tuple[Pattern, int], ...], params: list[str], shapes: dict[str, tuple[int, ...]],
                  config: dict[str, Any], table: dict[str, Any], experts: str, rules: ModelRules) -> Axis:
    """The expert axis of experts stacked in one tensor: counted from those tensors' expert dimension.

    Every stacked parameter must have the same count along its ``dim``, and a ``num_experts``
    value the config gives must agree; a family whose ``stacked`` matches nothing is refused."""
    counts = {p: shapes[p][dim] for p in params for pattern, dim in stacked
              if pattern.match(p) and p in shapes and dim < len(shapes[p])}
    if not counts:
        raise BadInput(f"no parameter of this checkpoint matches the [experts] stacked patterns of family "
                       f"'{rules.family}' ({', '.join(p.pattern for p, _ in stacked)})", where=rules.source,
                       hint="Check that the family matches the checkpoint (--rules NAME|FILE).")
    if len(set(counts.values())) != 1:
        (a, na), (b, nb) = next(iter(counts.items())), next((k, v) for k, v in counts.items()
                                                             if v != next(iter(counts.values())))
        raise BadInput(f"stacked expert tensors disagree on the number of experts: '{a}' has {na}, '{b}' has {nb}",
                       where=rules.source, hint="Check [experts] stacked dim (the expert axis of each tensor).")
    n = next(iter(counts.values()))
    name = table.get("num_experts") if isinstance(table.get("num_experts"), str) else None
    if name and name in config and evaluate(name, config) != n:
        raise BadInput(f"the model config says {name} = {evaluate(name, config)}, but the stacked expert tensors "
                       f"hold {n} experts (e.g. {next(iter(counts))})", where=rules.source,
                       hint=f"Correct --model-config {name}=... (or the manifest's model.config).")
    return Axis("expert", "--experts", compile_pattern(_NO_NAME, rules.source, what="[experts] stacked"), n,
                parse_indices(experts, n, flag="--experts", what="expert"), name)
