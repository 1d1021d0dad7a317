"""What an export writes, under which names, decided from the source's metadata before a tensor is read.

`reshard export` writes it (`reshard.engine.export`) and `reshard verify` re-derives it from
the source (`reshard.verification.exports`, and `key_actions` for `reshard.verification.checkpoints`):
both need the same answer to "which source key becomes which exported tensor, of which dtype
and shape, in which shard", so it is computed once, here, as plain data (`ExportPlan`, its
`ExportItem` list); the value of each item is derived by `reshard.verification.exports.read_cast`.

Names
-----
Parameters: their FQN (no ``model.`` checkpoint prefix), after the optional rename rules
(`RenameRules`, e.g. ``formats/renames/torchtitan-to-hf-llama.toml``). With
``only="model+optim"`` also ``optim.<name>.<moment>`` (``exp_avg``, ``exp_avg_sq``, ...) and
``optim.<name>.step`` (the per-parameter step counter when it is a tensor). Everything else
(param groups, scheduler, counters, RNG, data position) is not exported and is listed in
``export-report.json`` with the reason.

Tied weights are written once: the manifest's ``model.tied``, the profile's ``tie`` (both
checked bitwise equal), the ties `reshard inspect` proves (``found``: its ``optimizer.tied``
records whose copies are bitwise equal, among them a parameter without moments equal to one
with them, whatever its names; `tied_groups`), and the pairs of ``formats/models/ties.toml``
whose copies are bitwise equal. ``dtype`` casts floating-point
parameters and moments only (step counters keep their dtype, and so does float4_e2m1fn_x2,
which has no conversion). Every dtype a checkpoint holds is exported as stored: safetensors
names float8 (``F8_E4M3``, ``F8_E5M2``, the ``FNUZ`` variants, ``F8_E8M0``), ``F4`` (two
values per byte: the header's last dimension is twice torch's), ``U16``-``U64`` and ``C64``;
a dtype it has no name for (complex32, complex128, bits) is refused by key and dtype before
anything is written (`unstorable`), with ``--format torch`` as the way out.

Every safetensors shard's ``__metadata__`` header (string values, JSON-encoded where not a
plain string, `header_metadata`) holds: ``format`` = ``"pt"`` (transformers requires it),
``reshard_export`` (format version), ``experiment_id``, ``step``, ``tokens_seen``, ``topology``,
``source``, ``source_convention``, ``model_family``, ``dtype``, ``only``, ``rename``, ``tied`` (JSON
list of groups of exported names: the first is stored, the others are copies of it and not
stored), ``ties_given`` (only when the profile named ties: its groups, source names; an option
``verify`` re-derives the export with, checked against the source's bytes again) and ``export_map`` (JSON ``{exported name: source DCP key}`` for that shard's
tensors), which `reshard.storage.checkpoints.safetensors_format` uses to map names back for ``verify`` and
``import``.

``--format hf`` (`hf_plan`): the Hugging Face names of the model family's mapping
(``formats/hf/<family>.toml``, strict: an unmapped parameter is refused, naming it), each
weight transformed as the mapping declares (rotary row order, fused parts split, vocab
padding trimmed: `reshard.semantics.hf`), and the ``config.json`` made from the checkpoint's
shapes and the values it cannot hold (``--model-config``, the manifest's ``model.config``; all
missing ones asked for in one message).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from reshard.errors import BadInput
from reshard.patterns import Pattern, compile_pattern
from reshard.safefs import loads_toml
from reshard.model.dtypes import DTYPES as BY_NAME, DType
from reshard.model.kinds import ExportAction
from reshard.model.plan import NOT_CAST
from reshard.storage.source import Source
from reshard.storage.checkpoints.safetensors_format import PACKED, SAFETENSORS_NAMES

EXPORT_FORMAT_VERSION = "1"
HF_CONFIG = "config.json"

DTYPES: dict[str, DType] = {
    "bf16": BY_NAME["bfloat16"], "bfloat16": BY_NAME["bfloat16"],
    "fp16": BY_NAME["float16"], "float16": BY_NAME["float16"], "half": BY_NAME["float16"],
    "fp32": BY_NAME["float32"], "float32": BY_NAME["float32"], "float": BY_NAME["float32"],
}

ST_DTYPE_NAMES: dict[DType, str] = SAFETENSORS_NAMES
"""The safetensors name of every dtype the format stores (float8 e4m3fn/e5m2 and their fnuz
variants, F8_E8M0, F4, U16-U64, C64, ...); what is not here (complex32, complex128, the bits
dtypes) an export in safetensors refuses by key and dtype before writing (`unstorable`)."""
UNCASTABLE: frozenset[DType] = frozenset(BY_NAME[n] for n in NOT_CAST)
"""Floating dtypes ``--dtype`` leaves as they are (`reshard.model.plan.NOT_CAST`: float4_e2m1fn_x2)."""


# ===================================================================================== renaming
@dataclass(frozen=True)
class RenameRule:
    match: Pattern
    replace: str


@dataclass
class RenameRules:
    """Ordered regex -> replacement rules for parameter names; the first whose ``match`` matches wins."""

    name: str
    rules: list[RenameRule]
    strict: bool = False
    source: str = ""
    description: str = ""

    @classmethod
    def load(cls, path: str | Path) -> "RenameRules":
        p = Path(path)
        where = str(p)
        try:
            spec = loads_toml(p.read_text(encoding="utf-8"), where=where, what="rename rules file")
            rules = [RenameRule(compile_pattern(r["match"], where, what="[[rule]] match"), str(r["replace"]))
                     for r in spec.get("rule", [])]
            if not rules:
                raise ValueError("no [[rule]] entries")
            return cls(name=str(spec.get("name", p.stem)), rules=rules, strict=bool(spec.get("strict", False)),
                       source=str(p), description=str(spec.get("description", "")))
        except FileNotFoundError:
            raise BadInput("no such rename rules file", where=str(p)) from None
        except (KeyError, ValueError, TypeError, UnicodeDecodeError) as exc:
            raise BadInput(f"invalid rename rules file: {exc}", where=str(p),
                           hint="Each [[rule]] needs `match` (a regex) and `replace` (re.sub template).") from None

    def apply(self, name: str) -> str:
        for r in self.rules:
            if r.match.fullmatch(name):
                return r.match.sub(r.replace, name, count=1)
        if self.strict:
            raise BadInput(f"no rename rule matches '{name}'", where=self.source or self.name,
                           hint="Add a rule for it, or set strict = false to keep unmatched names unchanged.")
        return name

    def renames(self, name: str) -> bool:
        """Whether a rule matches ``name`` (a non-strict set keeps the others unchanged, with a warning)."""
        return any(r.match.fullmatch(name) for r in self.rules)

    def inverse(self) -> "RenameRules":
        """The rules read backwards (for import); each rule must be invertible (see the Llama file)."""
        return RenameRules(name=f"inverse of {self.name}", rules=[_invert(r, self.source) for r in self.rules],
                           strict=self.strict, source=self.source, description=self.description)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "file": self.source, "rules": len(self.rules)}


_GROUP = re.compile(r"\((?!\?)([^()]*)\)|\(\?P<(\w+)>([^()]*)\)")
_REF = re.compile(r"\\(\d+)|\\g<(\w+)>")


def _invert(rule: RenameRule, where: str) -> RenameRule:
    """``^lit(grp)lit$`` / ``lit\\1lit`` -> ``^lit(grp)lit$`` / ``lit\\1lit`` the other way round."""
    pat = rule.match.pattern
    body = pat[1:] if pat.startswith("^") else pat
    body = body[:-1] if body.endswith("$") and not body.endswith("\\$") else body
    literals: list[str] = []
    groups: list[tuple[str | None, str]] = []  # (name, sub-pattern) in order
    pos = 0
    for m in _GROUP.finditer(body):
        literals.append(body[pos:m.start()])
        groups.append((m.group(2), m.group(3)) if m.group(2) else (None, m.group(1)))
        pos = m.end()
    literals.append(body[pos:])
    unescaped = []
    for lit in literals:
        if re.search(r"\\[A-Za-z0-9]", lit) or any(ch in re.sub(r"\\.", "", lit) for ch in ".^$*+?{}[]|()\\"):
            raise BadInput(f"rename rule '{pat}' cannot be inverted (only escaped literal text and simple groups)",
                           where=where)
        unescaped.append(re.sub(r"\\(.)", r"\1", lit))
    # the replacement: literal text and group references, each group used exactly once
    rep = rule.replace
    out_pat, used, pos = "", [], 0
    for m in _REF.finditer(rep):
        ref = m.group(1) or m.group(2)
        idx = int(ref) - 1 if ref.isdigit() else next((i for i, (n, _) in enumerate(groups) if n == ref), -1)
        if not 0 <= idx < len(groups):
            raise BadInput(f"rename rule '{pat}': replacement refers to unknown group {ref!r}", where=where)
        out_pat += re.escape(rep[pos:m.start()]) + f"({groups[idx][1]})"
        used.append(idx)
        pos = m.end()
    out_pat += re.escape(rep[pos:])
    if sorted(used) != list(range(len(groups))):
        raise BadInput(f"rename rule '{pat}' cannot be inverted: its replacement must use every group exactly once",
                       where=where)
    # inverse replacement: the original literal text with group i -> reference to its position in `used`
    inv = unescaped[0].replace("\\", "\\\\")
    for i in range(len(groups)):
        inv += f"\\g<{used.index(i) + 1}>" + unescaped[i + 1].replace("\\", "\\\\")
    return RenameRule(compile_pattern("^" + out_pat + "$", where, what="inverse of rename rule"), inv)


# ===================================================================================== planning
@dataclass
class ExportItem:
    """One exported tensor: the source key it comes from, its name, dtype and shape, and its place in a shard."""

    key: str            # source key
    name: str           # exported name
    role: str
    shape: tuple[int, ...]
    src_dtype: DType
    dtype: DType
    file: str = ""
    offset: int = 0     # within the shard's data section
    src_shape: tuple[int, ...] | None = None        # the source's shape, when ``make`` changes it
    make: Any = None    # source tensor -> exported tensor (``--format hf``: rows trimmed, declared transform)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class ExportPlan:
    """What an export writes (``items``) and what it does with every source key (``keys``, the report's)."""

    items: list[ExportItem] = field(default_factory=list)
    keys: list[dict[str, Any]] = field(default_factory=list)
    tied: list[list[str]] = field(default_factory=list)   # exported names, first stored
    tied_fqns: list[list[str]] = field(default_factory=list)
    tied_by: list[str] = field(default_factory=list)      # per group: manifest, given, inspect or known pair
    copies: dict[str, tuple[str, str]] = field(default_factory=dict)  # copy name -> (source key, stored name)
    warnings: list[str] = field(default_factory=list)


def dtype_arg(dtype: str | None) -> DType | None:
    if dtype is None:
        return None
    dt = DTYPES.get(str(dtype).lower())
    if dt is None:
        raise BadInput(f"unknown dtype '{dtype}'", hint="Use bf16, fp16 or fp32.")
    return dt


def unstorable(items: list[ExportItem], fmt: str, *, where: str | None = None) -> BadInput | None:
    """The refusal of an export whose ``items`` hold a dtype ``fmt`` cannot store (None: it can).

    safetensors (and ``--format hf``, which writes it) names a fixed set of dtypes
    (`ST_DTYPE_NAMES`); ``torch.save`` (``--format torch``) stores every dtype a checkpoint can
    hold. Every offending key is named with its dtype, before a byte is written.
    """
    if fmt == "torch":
        return None
    bad = [(it.key, it.dtype) for it in items
           if it.dtype not in ST_DTYPE_NAMES or (it.dtype in PACKED and not it.shape)]  # F4 counts along a last dim
    if not bad:
        return None
    names = sorted({str(d).removeprefix("torch.") for _, d in bad})
    listed = ", ".join(f"'{k}' ({str(d).removeprefix('torch.')})" for k, d in bad[:8]) + (" ..." if len(bad) > 8 else "")
    optim = all(k.startswith("optim.") or ".state." in k for k, _ in bad)
    return BadInput(f"{len(bad)} tensor(s) have a dtype safetensors cannot store ({', '.join(names)}): {listed}",
                    where=where, keys=[k for k, _ in bad],
                    hint="Export with --format torch (torch.save stores every dtype)"
                         + (", or leave the optimizer state out with --only model" if optim else "")
                         + "; nothing was written.")


def tied_groups(report: dict[str, Any] | None) -> list[list[str]]:
    """The tied groups an inspection report proves: its ``optimizer.tied`` records whose saved copies
    were compared bitwise equal (``equal`` true), whatever their source (manifest, ``--tie``, a known
    pair, or equal bytes: a parameter without moments equal to one with them, under any names)."""
    records = ((report or {}).get("optimizer") or {}).get("tied") or []
    return [list(r["names"]) for r in records
            if isinstance(r, dict) and r.get("equal") is True and isinstance(r.get("names"), list)
            and len(r["names"]) >= 2 and all(isinstance(n, str) for n in r["names"])]


def plan_export(ix, cls, mdict: dict[str, Any], *, only: str, dtype: DType | None,
                rules: RenameRules | None, fmt: str = "safetensors", found: Sequence[Sequence[str]] = (),
                given: Sequence[Sequence[str]] = (), given_where: str | None = None) -> ExportPlan:
    """What an export of ``ix`` writes (see the module docstring); ``fmt``'s dtypes are checked
    (`unstorable`: a dtype safetensors has no name for is refused, every such key named).

    ``found``: the tied groups `reshard inspect` proved on this source (`tied_groups` of its report;
    their copies were compared there, so they are not read again). ``given``: the ties the user
    states (the profile's ``tie``, ``given_where`` naming it), checked here: copies that differ are
    refused, since the export would write one tensor where the source holds two.
    """
    from reshard.semantics.conventions import known_tied_pairs
    from reshard.storage.checkpoints.index import bitwise_equal

    p = ExportPlan()
    roles = cls.roles
    params = {r.param: k for k, r in roles.items() if r.role == "parameter" and r.param and ix.entries[k].is_tensor}

    # tied groups, in order: the manifest's (authoritative), the user's, inspect's proofs, known pairs;
    # a group whose saved members an earlier one already ties is not looked at again
    copy_of: dict[str, str] = {}  # fqn -> fqn stored instead
    declared = [list(g) for g in ((mdict.get("model") or {}).get("tied") or [])]
    groups: list[tuple[list[str], str]] = [(g, "manifest") for g in declared]
    groups += [(list(g), "given") for g in given  # a header's ties_given is input: only lists of names count
               if isinstance(g, (list, tuple)) and all(isinstance(n, str) for n in g)]
    groups += [(list(g), "inspect") for g in found]
    groups += [([a, b], "known pair") for a, b in known_tied_pairs()]
    for g, source in groups:
        present = list(dict.fromkeys(n for n in g if n in params))
        if source == "given" and len(present) < 2:
            p.warnings.append(f"the tie {' = '.join(g)} of {given_where or 'the profile'} names "
                              + ("one saved parameter: nothing to write once" if present else "no saved parameter"))
        if len(present) < 2 or any(n in t for n in present for t in p.tied_fqns):
            continue  # nothing to tie, or an earlier group already ties one of them
        first, rest = present[0], present[1:]
        same = rest if source == "inspect" else [n for n in rest if bitwise_equal(ix, params[first], params[n])]
        if source == "given" and len(same) != len(rest):
            differ = [n for n in rest if n not in same]
            raise BadInput(f"the tie {' = '.join(present)} of {given_where or 'the profile'} is not one tensor: "
                           f"'{params[first]}' and '{params[differ[0]]}' differ",
                           where=str(ix.root), keys=[params[first], *(params[n] for n in differ)],
                           hint=f"Drop this tie from {given_where or 'the profile'}: the source saves these "
                                "parameters as two different tensors.")
        if source == "manifest" and len(same) != len(rest):
            p.warnings.append(f"tied copies {present} are declared in the manifest but differ: all exported")
            continue
        if not same:
            continue
        for n in same:
            copy_of[n] = first
        p.tied_fqns.append([first, *same])
        p.tied_by.append(source)

    unrenamed: list[str] = []

    def rename(fqn: str) -> str:
        if rules is not None and not rules.renames(fqn) and fqn not in unrenamed:
            unrenamed.append(fqn)
        return rules.apply(fqn) if rules is not None else fqn

    seen: dict[str, str] = {}
    for key, e in ix.entries.items():
        r = roles[key]
        rec: dict[str, Any] = {"key": key, "role": r.role}
        name = None
        if not e.is_tensor:
            rec.update(action=ExportAction.DROPPED, reason=f"{r.role} object: trainer state is not exported")
        elif r.role == "parameter" and r.param:
            if r.param in copy_of:
                p.copies[rename(r.param)] = (key, rename(copy_of[r.param]))
                rec.update(action=ExportAction.TIED_COPY, name=rename(r.param), reason=_copy_reason(copy_of[r.param], rename))
            else:
                name = rename(r.param)
        elif r.role in ("optimizer_moment", "optimizer_step") and r.param:
            if only != "model+optim":
                rec.update(action=ExportAction.DROPPED, reason=f"{r.role.replace('_', ' ')} (--only model)")
            else:
                name = f"optim.{rename(r.param)}.{r.name or 'step'}"
        else:
            rec.update(action=ExportAction.DROPPED, reason=f"{r.role} tensor: trainer state is not exported")
        if name is not None:
            if name in seen:
                raise BadInput(f"'{key}' and '{seen[name]}' would both be exported as '{name}'",
                               where=rules.source if rules else None, hint="Fix the rename rules.")
            seen[name] = key
            out_dtype = e.dtype
            if dtype is not None and r.role in ("parameter", "optimizer_moment") and e.dtype.is_floating_point \
                    and e.dtype not in UNCASTABLE:
                out_dtype = dtype
            p.items.append(ExportItem(key, name, r.role, tuple(e.shape), e.dtype, out_dtype))
            rec.update(action=ExportAction.EXPORTED, name=name, dtype=str(e.dtype).removeprefix("torch."),
                       exported_dtype=str(out_dtype).removeprefix("torch."),
                       cast=out_dtype != e.dtype, shape=list(e.shape))
        p.keys.append(rec)
    p.tied = [[rename(n) for n in g] for g in p.tied_fqns]
    refusal = unstorable(p.items, fmt, where=str(ix.root))
    if refusal is not None:
        raise refusal
    if unrenamed:
        p.warnings.append(f"{len(unrenamed)} name(s) matched no rule of {rules.source or rules.name} and keep their own "
                          f"name: {', '.join(unrenamed[:10])}" + (" ..." if len(unrenamed) > 10 else ""))
    return p


def _copy_reason(stored: str, rename: Any = str) -> str:
    """What the report says of a tied copy: written once, under the stored member's exported name."""
    return f"tied copy of '{stored}' (bitwise equal): written once, under '{rename(stored)}'"


def _store_instead(plan: ExportPlan, params: dict[str, str], k: int, keep: str) -> None:
    """Tied group ``k`` stored under its member ``keep`` instead of its first, in place (no rename rules).

    The members' bytes are equal, so which source key feeds the stored tensor changes nothing in
    its value; it decides the name, which matters where the target class stores one name of the
    pair and makes the other from it (transformers' ``tie_word_embeddings`` keeps the input
    embedding and points ``lm_head`` at it).
    """
    group = plan.tied_fqns[k]
    old = group[0]
    for it in plan.items:
        if it.key == params[old]:
            it.key = params[keep]
    for n in group:
        plan.copies.pop(n, None)
        if n != keep:
            plan.copies[n] = (params[n], keep)
    recs = {rec["key"]: i for i, rec in enumerate(plan.keys)}
    was = plan.keys[recs[params[old]]]
    plan.keys[recs[params[keep]]] = {**was, "key": params[keep], "role": plan.keys[recs[params[keep]]]["role"]}
    plan.keys[recs[params[old]]] = {"key": params[old], "role": was["role"], "action": ExportAction.TIED_COPY, "name": old,
                                    "reason": _copy_reason(keep)}
    for n in group[1:]:
        if n != keep:
            plan.keys[recs[params[n]]]["reason"] = _copy_reason(keep)
    plan.tied_fqns[k] = [keep, *(n for n in group if n != keep)]


def _untie(plan: ExportPlan, params: dict[str, str], k: int) -> None:
    """Tied group ``k`` written as separate tensors after all, in place (no rename rules): each copy
    becomes an exported item like the stored member (same shape and dtype: their bytes are equal)."""
    group = plan.tied_fqns.pop(k)
    plan.tied_by.pop(k)
    stored = next(it for it in plan.items if it.key == params[group[0]])
    recs = {rec["key"]: i for i, rec in enumerate(plan.keys)}
    was = plan.keys[recs[params[group[0]]]]
    for n in group[1:]:
        plan.copies.pop(n, None)
        plan.items.append(ExportItem(params[n], n, stored.role, stored.shape, stored.src_dtype, stored.dtype))
        plan.keys[recs[params[n]]] = {**was, "key": params[n], "role": plan.keys[recs[params[n]]]["role"], "name": n}


def key_actions(ix, cls, mdict: dict[str, Any], *, only: str, found: Sequence[Sequence[str]] = (),
                given: Sequence[Sequence[str]] = ()) -> list[dict[str, Any]]:
    """What `export` does with every source key (``exported``, ``tied_copy`` or ``dropped``, with
    the reason), exactly as ``export-report.json`` lists them, computed from the source itself.

    Public for `reshard verify DCP EXPORT`, which re-derives what an export of the source
    leaves out instead of believing the report the export carries. Names and dtypes do not
    change what is left out, so no rename rules or cast are taken; the ties are the export's:
    ``found`` those inspect proves on the source (`tied_groups`), ``given`` the ones the export
    records as given (``ties_given``), checked against the source again.
    """
    return plan_export(ix, cls, mdict, only=only, dtype=None, rules=None, fmt="torch", found=found,
                       given=given, given_where="the export's recorded ties_given").keys  # every dtype: what is left out


def assign_shards(items: list[ExportItem], max_shard_size: int, ext: str) -> list[list[ExportItem]]:
    shards: list[list[ExportItem]] = []
    size = 0
    for it in items:
        if not shards or (size + it.nbytes > max_shard_size and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += it.nbytes
    if not shards:
        shards.append([])
    n = len(shards)
    for k, shard in enumerate(shards, 1):
        fname = f"model.{ext}" if n == 1 else f"model-{k:05d}-of-{n:05d}.{ext}"
        off = 0
        for it in shard:
            it.file, it.offset = fname, off
            off += it.nbytes
    return shards


def export_essentials(src: Source | Path, mdict: dict[str, Any], convention: str, *, dtype: DType | None, only: str,
                      rules: RenameRules | None, tied: list[list[str]], fmt: str) -> dict[str, Any]:
    return {
        "reshard_export": EXPORT_FORMAT_VERSION,
        "experiment_id": mdict.get("experiment_id"),
        "step": mdict.get("step"),
        "tokens_seen": mdict.get("tokens_seen"),
        "topology": mdict.get("topology"),
        "continuity": mdict.get("continuity"),
        "model_family": (mdict.get("model") or {}).get("family"),
        "model_config": (mdict.get("model") or {}).get("config"),
        "source": Source.of(src).name,  # a remote source by its URL
        "source_convention": convention,
        "dtype": str(dtype).removeprefix("torch.") if dtype is not None else "as stored",
        "only": only,
        "rename": rules.describe() if rules is not None else None,
        "tied": tied,
        "format": fmt,
    }


def export_map(items: list[ExportItem], copies: dict[str, tuple[str, str]]) -> dict[str, str]:
    """exported name -> source key, for ``items`` and the tied copies of them (not stored)."""
    out = {it.name: it.key for it in items}
    names = set(out)
    out.update({c: key for c, (key, stored) in copies.items() if stored in names})
    return out


def header_metadata(ess: dict[str, Any], shard: list[ExportItem], copies: dict[str, tuple[str, str]]) -> dict[str, str]:
    meta = {"format": "pt"}
    for k, v in ess.items():
        if k == "format":
            continue
        meta[k] = v if isinstance(v, str) else json.dumps(v)
    meta["export_map"] = json.dumps(export_map(shard, copies))
    return meta


def source_report(src: Source | Path) -> dict[str, Any]:
    """`reshard inspect`'s report of ``src`` as found (empty when it cannot describe it): the step,
    lineage and proven ties an export takes from it, so that the export and ``verify`` agree with inspect.
    ``src``: as its command opened it (a store read through its own handle), or a local path."""
    from reshard.planning.describe import inspect_checkpoint
    from reshard.errors import ReshardError

    try:
        return inspect_checkpoint(src).report
    except ReshardError:
        return {}


def export_identity(src: Source | Path, mdict: dict[str, Any], report: dict[str, Any] | None = None) -> dict[str, Any]:
    """Step and lineage as `reshard inspect` finds them (a checkpoint without a manifest still has a step).

    The step comes from inspect's rules (manifest, counter or optimizer step counters), so an
    export of a torchtitan checkpoint records ``train_state.step`` instead of null. ``report``:
    `source_report` of ``src`` when the caller has it (else it is made here).
    """
    r = source_report(src) if report is None else report
    if not r:
        return {"step_source": None, "lineage": mdict.get("lineage") or []}
    out: dict[str, Any] = {"step": r.get("step"), "step_source": r.get("step_source"),
                           "lineage": r.get("lineage") or mdict.get("lineage") or []}
    if out["step"] is None:
        out["step"] = mdict.get("step")
    if mdict.get("tokens_seen") is None and r.get("tokens_seen") is not None:
        out["tokens_seen"] = r.get("tokens_seen")
    return out


# ===================================================================================== --format hf
@dataclass
class HfPlan:
    """What ``--format hf`` adds to an export plan: the mapping, its values and the config.json they make."""

    mapping: Any                      # reshard.semantics.hf.HfMapping
    values: dict[str, Any]
    origin: dict[str, str]            # value -> where it came from
    config: dict[str, Any]
    transforms: dict[str, str]        # exported name -> the transform applied (only names with one)
    family: str = ""


def _hf_given(mdict: dict[str, Any], cli: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    given: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for k, v in ((mdict.get("model") or {}).get("config") or {}).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            given[k], origin[k] = v, "manifest model.config"
    for k, v in cli.items():
        given[k], origin[k] = v, "--model-config"
    return given, origin


def _source_tp(src: Path) -> int:
    """The TP degree the source was written at (a fused TP layout's global view depends on it), as inspect finds it."""
    from reshard.planning.describe import inspect_checkpoint

    topo = inspect_checkpoint(src).topology
    tp = topo.tp
    if not isinstance(tp, int) or tp < 1 or topo.ambiguous:
        raise BadInput("the source's TP degree is not known, and its fused tensors are laid out per TP rank",
                       where=str(src), hint="Record the topology in the manifest (reshard convert writes one).")
    return tp


def hf_plan(src: Path, ix, cls, mdict: dict[str, Any], plan: ExportPlan, model_config: dict[str, Any],
            dtype: DType | None) -> HfPlan:
    """Map ``plan`` (every parameter, ties written once) to the family's Hugging Face names and transforms, in place.

    Public for `reshard verify SRC HF_EXPORT`, which re-derives the export from the source the same way.
    Strict: a parameter the mapping does not name is refused, naming it; so is a tie the HF class
    cannot express. ``model_config``: the values given on the command line (they win over the manifest).
    """
    from reshard.semantics.hf import mapping_for
    from reshard.semantics.rules import select

    params = {r.param: k for k, r in cls.roles.items() if r.role == "parameter" and r.param and ix.entries[k].is_tensor}
    family = (mdict.get("model") or {}).get("family")
    rules = select(sorted(params), family=family if isinstance(family, str) else None)
    mapping = mapping_for(rules.family)
    for fqn in sorted(params):
        mapping.rule(fqn)  # strict: refuse the first unmapped parameter by name, before anything is read
    given, origin = _hf_given(mdict, model_config)
    shapes = {fqn: tuple(ix.entries[k].shape) for fqn, k in params.items()}
    values = mapping.values(shapes, given, where=str(src))
    for k in values:
        origin.setdefault(k, "checkpoint shapes" if k not in mapping.defaults and k not in mapping.derive
                          else ("default" if k in mapping.defaults else "derived"))
    tied = False
    for k in reversed(range(len(plan.tied_fqns))):  # reversed: an untied group leaves the list
        group = plan.tied_fqns[k]
        names = {mapping.hf_name(f) for f in group}
        if mapping.tie is None or names != set(mapping.tie):
            if plan.tied_by[k] == "inspect":  # equal bytes no one declared: both written, as the class keeps them
                _untie(plan, params, k)
                plan.warnings.append(f"{' and '.join(group)} are bitwise equal (inspect counts them one tensor), but "
                                     f"{mapping.architecture} cannot tie {sorted(names)}: each is written")
                continue
            raise BadInput(f"the tied parameters {group} map to {sorted(names)}, which {mapping.architecture} "
                           "cannot tie", where=str(src), hint=f"Declare `tie` in {mapping.source} if the class ties them.")
        if mapping.hf_name(group[0]) != mapping.tie[0]:  # the class stores tie[0] and makes tie[1] from it
            _store_instead(plan, params, k, next(f for f in group if mapping.hf_name(f) == mapping.tie[0]))
        tied = True
    seen: dict[str, str] = {}
    transforms: dict[str, str] = {}
    items: list[ExportItem] = []
    source_tp: int | None = None
    for it in plan.items:
        fqn = cls.roles[it.key].param
        rule, groups = mapping.rule(fqn)
        names = rule.hf_names(groups)
        for name in names:
            if name in seen:
                raise BadInput(f"'{seen[name]}' and '{it.key}' both map to '{name}'", where=mapping.source,
                               hint="The checkpoint holds two generations of one name; keep one.")
            seen[name] = it.key
        if rule.parts:  # one fused source tensor -> one exported tensor per part
            if rule.tp_layout and source_tp is None:
                source_tp = _source_tp(src)
            sizes = rule.part_sizes(values)
            for k, name in enumerate(names):
                shape = list(it.shape)
                shape[rule.dim] = sizes[k]
                items.append(ExportItem(it.key, name, it.role, tuple(shape), it.src_dtype, it.dtype, src_shape=it.shape,
                                   make=(lambda t, rule=rule, key=it.key, k=k, tp=source_tp or 1:
                                         rule.split_part(t, values, key, k, tp))))
                transforms[name] = f"split part {k + 1}/{len(names)} of dim {rule.dim}" + (
                    f" (TP layout of tp={source_tp})" if rule.tp_layout else "")
            continue
        it.name = names[0]
        it.src_shape = it.shape
        if it.shape:
            it.shape = (rule.out_rows(it.shape[0], values), *it.shape[1:])
        it.make = (lambda t, rule=rule, key=it.key: rule.to_hf(t, values, key))
        done = [d for d in ([f"rows[:{values[rule.rows]}]"] if rule.rows and it.src_shape[0] != it.shape[0] else [])
                + ([f"{rule.transform}({rule.heads}={values[rule.heads]})"] if rule.transform else [])]
        if done:
            transforms[it.name] = ", ".join(done)
        items.append(it)
    plan.items = items
    # before: copy fqn -> (source key, stored fqn) (no rename rules with --format hf)
    plan.copies = {mapping.hf_name(cls.roles[key].param): (key, mapping.hf_name(sname))
                   for key, sname in plan.copies.values()}
    plan.tied = [[mapping.hf_name(f) for f in g] for g in plan.tied_fqns]
    stored_of = {n: g[0] for g in plan.tied_fqns for n in g[1:]}
    for rec in plan.keys:
        r = cls.roles[rec["key"]]
        if rec.get("action") == ExportAction.TIED_COPY and r.param in stored_of:
            rec["reason"] = _copy_reason(stored_of[r.param], mapping.hf_name)
        if rec.get("name") and r.param:
            rec["name"] = mapping.hf_name(r.param)
            if rec["name"] in transforms:
                rec["transform"] = transforms[rec["name"]]
            if rec.get("action") == ExportAction.EXPORTED:
                rec["exported_shape"] = [list(i.shape) for i in plan.items if i.key == rec["key"]]
                if len(rec["exported_shape"]) == 1:
                    rec["exported_shape"] = rec["exported_shape"][0]
    out_dt = dtype if dtype is not None else next((it.dtype for it in plan.items if it.dtype.is_floating_point), None)
    config = mapping.config(values, tied=tied, dtype=str(out_dt).removeprefix("torch.") if out_dt else "float32")
    return HfPlan(mapping, values, origin, config, transforms, rules.family)
