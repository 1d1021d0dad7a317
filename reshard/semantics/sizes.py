"""Every size a file states, checked against the tensors that carry it, in one place.

A number in a file (an HF ``config.json``, a manifest's ``model.config``, a profile's
``[model]``, a trainer config) is a claim; the tensors' shapes are what the checkpoint is.
A claim is used (written into an output's manifest, or used to build a model) only when it
survives this check:

* it is a positive integer (not a bool, a float or a string);
* a tensor that carries it agrees: ``dim`` is dim 1 of the embedding, ``n_layers`` the
  number of distinct layer indices, a vocabulary at most the embedding's rows (padding only
  adds rows). Which tensor carries which size is data, not code: a family's partition rules
  (``[config.NAME]``, ``[pipeline] layer``, a ``vocab`` rule) or its Hugging Face mapping
  (``[shape.*]``, ``[count.*]``);
* the architecture's divisions hold (``dim % n_heads``, ``n_heads % n_kv_heads``);
* the model it describes is not absurd: its smallest parameter count (embedding plus two
  ``dim x dim`` matrices per layer) is at most ``LIMIT_FACTOR`` times the parameters the
  checkpoint actually holds, so a value is refused before anything is sized by it.

Each contradiction names both sides: the file and key that state the value, and the tensor
and shape that contradict it. A stated size no tensor carries is returned as ``unchecked``
(recorded as stated, never as a fact). Knows names and shapes only, never a tensor byte.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from reshard.errors import BadInput

# the model config names that are sizes or counts (others, e.g. rms_norm_eps or rope_theta, are not checked here)
SIZE_NAMES = frozenset({"dim", "n_heads", "n_kv_heads", "n_layers", "vocab_size", "vocab_rows", "ffn_hidden",
                        "head_dim", "n_experts", "max_seq_len", "max_position_embeddings"})
LIMIT_FACTOR = 10
COMMAND_LINE = "--model-config"  # the `Stated.file` of a value typed on the command line
HINT = ("Fix the value where it is stated (the file named, or the --model-config typed), or leave it out: "
        "sizes the tensors carry are read from them.")


@dataclass(frozen=True)
class Stated:
    """One value a file states: its model-config name, the value, and the file and key that state it."""

    name: str
    value: Any
    file: str
    key: str

    def says(self) -> str:
        if self.file == COMMAND_LINE:  # the words the user typed, as typed
            return f"{COMMAND_LINE} {self.key}={self.value!r}"
        return f"{self.file} states {self.key} = {self.value!r}"


@dataclass(frozen=True)
class Carrier:
    """Where the tensors carry a size: dim ``axis`` of every parameter ``pattern`` matches, or (``axis`` None)
    the number of distinct values of its first group (a layer index). ``at_least``: the tensor may be
    larger than the size (a vocabulary padded to a TP multiple)."""

    name: str
    pattern: re.Pattern[str]
    axis: int | None = None
    at_least: bool = False


@dataclass
class SizeCheck:
    """What the check found: contradictions (one sentence each), sizes a tensor confirmed, sizes none carries."""

    problems: list[str] = field(default_factory=list)
    confirmed: dict[str, str] = field(default_factory=dict)   # name -> the tensor (or count) that carries it
    unchecked: list[str] = field(default_factory=list)        # stated names no tensor carries

    def refuse(self, *, where: str | None = None, hint: str = HINT) -> None:
        """BadInput (exit 2) naming every contradiction, in one paragraph; nothing when there is none."""
        if self.problems:
            n = len(self.problems)
            raise BadInput(f"{n} stated size{'s' if n > 1 else ''} refused (checked against the checkpoint's tensors): "
                           + "; ".join(self.problems), where=where, hint=hint)


def stated_from(values: Mapping[str, Any], file: str, key_prefix: str = "", *,
                keys: Mapping[str, str] | None = None) -> list[Stated]:
    """The size-valued entries of ``values`` as `Stated` (``keys``: name -> the file's own key, when it differs)."""
    out = []
    for name, v in values.items():
        if name in SIZE_NAMES:
            out.append(Stated(name, v, file, (keys or {}).get(name, key_prefix + name)))
    return out


def carriers_from_rules(rules: Any) -> list[Carrier]:
    """The sizes a family's partition rules (`reshard.semantics.rules.ModelRules`) say the tensors carry."""
    out = [Carrier(cs.name, cs.source, cs.axis) for cs in rules.config_shapes]
    pipe = rules.pipeline
    if pipe.layer is not None and pipe.num_layers and pipe.num_layers.isidentifier():
        out.append(Carrier(pipe.num_layers, pipe.layer, None))
    for pattern, rule in rules.params:
        if rule.vocab is not None and rule.vocab.size.isidentifier():
            out.append(Carrier(rule.vocab.size, pattern, rule.dim, at_least=True))
    return out


def carriers_from_hf(mapping: Any) -> list[Carrier]:
    """The sizes a Hugging Face mapping (`reshard.semantics.hf.HfMapping`) reads from native shapes and counts."""
    out = [Carrier(name, pat, axis) for name, (pat, axis) in mapping.shapes.items()]
    out += [Carrier(name, pat, None) for name, pat in mapping.counts.items()]
    if "vocab_rows" in mapping.shapes and "vocab_size" not in mapping.shapes:
        pat, axis = mapping.shapes["vocab_rows"]
        out.append(Carrier("vocab_size", pat, axis, at_least=True))
    return out


def positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _read(c: Carrier, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, str, tuple[int, ...] | None] | None:
    """(value, tensor or count description, shape) the tensors give for ``c``; None when none carries it."""
    if c.axis is None:
        found: set[str] = set()
        for name in shapes:
            m = c.pattern.match(name)
            if m and m.groups():
                found.add(m.group("layer") if "layer" in m.groupdict() else m.group(1))
        if not found:
            return None
        return len(found), f"{len(found)} distinct layer indices in the tensor names ({c.pattern.pattern})", None
    for name in sorted(shapes):
        shape = tuple(shapes[name])
        if c.pattern.match(name) and len(shape) > c.axis:
            return int(shape[c.axis]), name, shape
    return None


def check(stated: Iterable[Stated], shapes: Mapping[str, tuple[int, ...]], carriers: Iterable[Carrier], *,
          parameters: int | None = None, names: Mapping[str, str] | None = None) -> SizeCheck:
    """Every stated size against the tensors (``shapes``: parameter name -> global shape; ``parameters``: the
    number of parameters the checkpoint holds, for the absurd-model bound; ``names``: how a message names a
    tensor, when the file stores it under another name than the carriers match). See the module docstring."""
    out = SizeCheck()
    good: dict[str, Stated] = {}
    for s in stated:
        if s.name not in SIZE_NAMES:
            continue
        if not positive_int(s.value):
            out.problems.append(f"{s.says()}, which is not a positive integer")
        elif s.name not in good:
            good[s.name] = s
    read: dict[str, tuple[int, str, tuple[int, ...] | None]] = {}
    at_least: set[str] = set()
    for c in carriers:
        if c.name in read:
            continue
        r = _read(c, shapes)
        if r is not None:
            r = (r[0], (names or {}).get(r[1], r[1]), r[2])
            read[c.name] = r
            if c.at_least:
                at_least.add(c.name)
    for name, s in good.items():
        if name not in read:
            out.unchecked.append(name)
            continue
        v, where, shape = read[name]
        bad = s.value > v if name in at_least else s.value != v
        if bad:
            carried = f"tensor '{where}' has shape {list(shape)}" if shape is not None else f"the checkpoint has {where}"
            out.problems.append(f"{s.says()}, but {carried}, so {name} is {'at most ' if name in at_least else ''}{v}")
        else:
            out.confirmed[name] = where
    value = {n: read[n][0] for n in read if n not in at_least}
    value.update({n: s.value for n, s in good.items()})

    def origin(name: str) -> str:
        if name in good and name not in out.confirmed:
            return good[name].says()
        v, where, shape = read[name]
        return f"tensor '{where}' has shape {list(shape)}" if shape is not None else where

    for a, b in (("dim", "n_heads"), ("n_heads", "n_kv_heads")):
        if a in value and b in value and (b in good or a in good) and value[a] % value[b]:
            out.problems.append(f"{origin(b)}, which does not divide {a} {value[a]} ({origin(a)})")
    if not out.problems and parameters is not None and any(n in good for n in ("dim", "vocab_size", "n_layers", "ffn_hidden")):
        dim = value.get("dim")
        if dim is not None:
            least = value.get("vocab_size", 0) * dim + value.get("n_layers", 0) * (2 * dim * dim
                                                                                 + 2 * dim * value.get("ffn_hidden", 0))
            if least > LIMIT_FACTOR * max(parameters, 1):
                named = ", ".join(good[n].says() for n in ("vocab_size", "dim", "n_layers", "ffn_hidden") if n in good)
                out.problems.append(f"{named}: a model of at least {least:,} parameters, more than {LIMIT_FACTOR} times "
                                    f"the {parameters:,} the checkpoint holds")
    return out


def stated_by_files(options: Any) -> list[Stated]:
    """The model sizes a profile (``[model]``) or a trainer config contributed to the plan ``options``
    (`reshard.model.plan.Options`), each named by its file and the file's own key, and those typed as
    ``--model-config`` (named as typed). A typed value is checked like a file's: a value no tensor carries
    (``n_heads``) is still held to the divisions with the values the tensors give (``dim``), so an
    impossible model is refused before any feasibility is computed from it."""
    from reshard.semantics.trainer_config import stated_at

    config = options.model_config or {}
    out: list[Stated] = []
    prof, tc = options.profile or {}, options.trainer_config or {}
    for name, v in config.items():
        if f"model_config.{name}" in (prof.get("contributed") or []):
            out += stated_from({name: v}, str(prof.get("file")), keys={name: f"[model] {name}"})
        elif f"model_config.{name}" in (tc.get("contributed") or []):
            out += stated_from({name: v}, str(tc.get("file")), keys={name: stated_at(str(tc.get("kind")), name)})
        else:
            out += stated_from({name: v}, COMMAND_LINE)
    return out


def check_against_checkpoint(stated: list[Stated], ix: Any, cls: Any, *, family: str | None = None,
                             rules_file: str | None = None) -> SizeCheck:
    """``stated`` against a checkpoint's parameters (``ix``: its index, ``cls``: the key roles), with the
    carriers of the partition rules its parameters select. When no rules match, the file may describe
    another model than this checkpoint's (a trainer config read for its batch recipe): every size is then
    ``unchecked`` and only its sense (a positive integer) is checked."""
    import math

    from reshard.semantics.rules import select

    params = {r.param: k for k, r in cls.roles.items() if r.role == "parameter" and r.param}
    shapes = {fqn: tuple(ix.entries[k].shape) for fqn, k in params.items()
              if k in ix.entries and ix.entries[k].is_tensor}
    try:
        carriers = carriers_from_rules(select(sorted(params), family=family, rules_file=rules_file))
    except BadInput:  # no rules describe this model: its sizes are not this file's to judge, only their sense
        carriers = []
    total = sum(math.prod(s) for s in shapes.values()) if carriers else None
    return check(stated, shapes, carriers, parameters=total, names=params)
