"""The evidence that excuses an intended difference between two checkpoints, re-derived by the verifier.

Nothing a checkpoint says about itself is evidence: a conversion's changes are re-derived
by recomputing its plan from the source with the options its output's lineage records
(`conversion_evidence`, following a chain of conversions back through the checkpoints the
lineage names), an export's left-out keys from the selection `reshard export` makes of the
source (`export_evidence`), and a plan in hand gives its own (`plan_evidence`). Each
`Evidence` excuses a difference only where the output holds exactly the value re-derived;
transformed, cast or tied-copy tensors are proven against the source (`check_transforms`).
`reshard.verification.checkpoints` compares the keys and asks this module why a difference
is intended; the intermediate checkpoints of a chain are verified with the comparison it
passes in (``verify``).
"""
from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from reshard.semantics import rules as rules_mod
from reshard.errors import BadInput, Incomplete, ReshardError
from reshard.model.inspection import Inspection
from reshard.planning.describe import inspect_checkpoint
from reshard.planning.plan import plan_reader
from reshard.storage.source import Source
from reshard.model.plan import Options, Plan
from reshard.verification.objects import identical, short_repr
from reshard.model.kinds import ExportAction


# ---------------------------------------------------------------------------------- opening
def open_checkpoint(source: Source | Path, trust_pickle: bool, known: Inspection | None = None) -> Inspection:
    """A checkpoint opened for a comparison: its inspection, or the error that says why it cannot be compared.

    ``known``: this run's inspection of the same checkpoint (the plan's), taken instead of reading it again."""
    source = Source.of(source)
    path = source.root
    insp = known if known is not None else inspect_checkpoint(source, trust_pickle=trust_pickle)
    errors = insp.errors
    if errors:
        first = errors[0]
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
        index_codes = {"missing_file", "truncated_file", "no_storage"}
        cls = Incomplete if first.code in index_codes or first.code.startswith("chunk_") else BadInput
        where = str(path / first.file) if first.file else str(path)
        raise cls(first.message.rstrip(".") + more + ".", where=where,
                  hint="Run `reshard inspect` on it for the full list; verify needs two complete checkpoints.")
    return insp


# ---------------------------------------------------------------------------------- evidence
@dataclass
class Evidence:
    """Differences the verifier re-derived itself, each with what the output must hold there.

    Nothing in it is read from a report: it is built from a plan recomputed from the source
    (`conversion_evidence`; `plan_evidence` for a plan in hand) or from the selection
    `reshard export` makes, computed on the source (`export_evidence`). ``source`` is the
    side (``"a"`` or ``"b"``) the conversion or export started from; the other side is its
    output. A difference is excused only when `excuse` finds it here *and* the output's
    value is the one re-derived.
    """

    source: str
    what: str                                                            # one line: where it came from
    dropped: dict[str, str] = field(default_factory=dict)                # key -> reason: absent from the output
    values: dict[str, tuple[str, Any]] = field(default_factory=dict)     # key -> (reason, the value written)
    proven: dict[str, str] = field(default_factory=dict)                 # key -> reason: checked by check_transforms
    semantics: dict[str, tuple[str, Any]] = field(default_factory=dict)  # name -> (reason, the output's value)
    slice: str | None = None  # the output is a slice of the source (--layers / --experts): what it keeps, in words

    @property
    def output(self) -> str:
        return "b" if self.source == "a" else "a"

    def excuse(self, d: dict[str, Any], read: Any) -> str | None:
        """Why difference ``d`` is exactly what the conversion or export of the source produces, or None.

        ``read(side, key)`` reads the stored value of ``key`` on ``side`` (an object or a whole tensor).
        """
        key, kind = d["key"], d["kind"]
        absent_from_output = "missing" if self.output == "b" else "unexpected"
        only_in_output = "unexpected" if self.output == "b" else "missing"
        if kind == "semantics":
            if key in self.semantics and identical(d[self.output], self.semantics[key][1]):
                return self.semantics[key][0]
            return None
        if kind == absent_from_output:
            return self.dropped.get(key)
        if kind not in (only_in_output, "value", "object", "shape", "dtype"):
            return None  # per-rank completeness is never a conversion's doing
        if key in self.values:
            reason, want = self.values[key]
            return f"{reason} (value re-derived)" if identical(read(self.output, key), want) else None
        if key in self.proven and kind != "object":
            return self.proven[key]
        return None


def plan_evidence(plan: Plan, *, source: str, what: str, src: Source | Path, out: Path, src_index: Any,
                  out_index: Any, transforms: bool = True) -> Evidence:
    """The differences ``plan`` produces between ``src`` and its output ``out``.

    Dropped keys may be absent; rewritten and added keys must hold exactly the values the
    plan's state translators wrote (``plan.new_values``: RNG reseeds, schedule remaps,
    translated data state); tensors the plan transforms, casts or copies from a tied key are
    excused only when `check_transforms` proves them from the source (and
    their shape and dtype are the planned ones); a cursor the plan moved must be the one it
    computed. ``transforms=False`` skips the tensors (a chain's hops: their layouts compose).
    """

    ev = Evidence(source, what, slice=(plan.slice or {}).get("description"))
    # a slice's renumbered keys (source -> output name, `Action.RENAMED`): moved, not dropped; copied, not tied
    moved = {a.key: a.renamed_to for a in plan.keys if a.renamed_to is not None}
    for a in plan.keys:
        if a.left_out and a.renamed_to is not None:
            ev.dropped[a.key] = f"renamed to '{a.renamed_to}' ({a.reason})"
        elif a.left_out:
            ev.dropped[a.key] = f"dropped: {a.reason}"
        elif a.new_value and a.key in plan.new_values:
            ev.values[a.key] = (f"{a.action}: {a.reason}", plan.new_values[a.key])
    candidates: dict[str, str] = {}
    for t in plan.tensors if transforms else ():
        se = src_index.entries.get(t.copy_from or t.key)
        if t.transform:
            why = "TP-dependent layout rewritten (checked in canonical form against the source)"
        elif t.copy_from and moved.get(t.copy_from) == t.key:
            why = f"renamed from '{t.copy_from}' (checked equal to it in the source)"
        elif t.copy_from:
            why = f"tied copy of '{t.copy_from}' (checked equal to it in the source)"
        elif se is not None and se.is_tensor and se.dtype_name != t.dtype:
            why = f"cast to {t.dtype} for a reduced copy (checked equal to the source cast)"
        else:
            continue
        oe = out_index.entries.get(t.key)
        if oe is not None and oe.is_tensor and tuple(oe.shape) == tuple(t.shape) and oe.dtype_name == t.dtype:
            candidates[t.key] = why
    if candidates:
        bad = set(check_transforms(src, out, plan))
        ev.proven = {k: why for k, why in candidates.items() if k not in bad}
    if plan.data is not None and plan.data.cursor_after is not None:
        ev.semantics["data.cursor"] = (f"data cursor moved by the plan ({plan.data.policy})", int(plan.data.cursor_after))
    return ev


def _recorded_options(d: Any) -> Options | str:
    """The plan options a lineage entry records, type-checked field by field, or why they cannot be used."""
    import dataclasses
    import typing

    if not isinstance(d, dict):
        return "records no plan options (written by an older reshard), so its plan cannot be recomputed"
    hints = typing.get_type_hints(Options)
    unknown = sorted(str(k) for k in d if k not in hints)
    if unknown:
        return f"records plan options this reshard does not know ({unknown[:3]})"
    for name, v in d.items():
        allowed = tuple(typing.get_origin(t) or t for t in (typing.get_args(hints[name]) or (hints[name],)))
        if not isinstance(v, allowed) or (isinstance(v, bool) and bool not in allowed):
            return f"records plan option {name}={short_repr(v)}, which is not a {hints[name]}"
    missing = [f.name for f in dataclasses.fields(Options)
               if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in d]
    if missing:
        return f"records no plan option {missing[0]}"
    return Options(**d)


def _rules_file_problem(rules: str) -> str | None:
    """A rules file a lineage names is read only if it is a small regular file (no FIFO, device, ...).

    A shipped family's name (``--rules llama-torchtitan``) names no file: it is read from reshard's own data.
    """
    if "/" not in rules and os.sep not in rules and rules_mod.shipped(rules) is not None:
        return None
    try:
        st = os.stat(rules)
    except OSError as exc:
        return f"names the rules file {rules}, which cannot be opened here ({exc.strerror or exc})"
    if not stat.S_ISREG(st.st_mode):
        return f"names the rules file {rules}, which is not a regular file"
    if st.st_size > MAX_RULES_BYTES:
        return f"names the rules file {rules}, larger than {MAX_RULES_BYTES} bytes"
    return None


MAX_RULES_BYTES = 1 << 20
_RECOMPUTE_ERRORS = (ReshardError, ValueError, TypeError, KeyError, AttributeError, IndexError)


@dataclass
class _Hop:
    """One conversion of a chain: ``plan`` recomputed from ``src``, whose output is ``out``."""

    plan: Plan
    src: Source
    src_insp: Inspection
    out: Source
    out_insp: Inspection
    where: str  # the lineage entry that recorded it


MAX_HOPS = 8


def _recompute_hop(src: Source, si: Inspection, entry: Any, where: str, trust_pickle: bool) -> tuple[Plan | None, str]:
    """The plan a lineage ``entry`` records, recomputed from ``src``, if ``src`` is its source; else (None, why not)."""
    from reshard.planning.plan import make_plan

    options = _recorded_options(entry.policies.get("options"))
    fingerprint = entry.policies.get("source_fingerprint")
    if isinstance(options, str):
        return None, f"{where} {options}"
    if not isinstance(fingerprint, str):
        return None, f"{where} records no source fingerprint"
    if options.rules and (why := _rules_file_problem(options.rules)):
        return None, f"{where} {why}"
    options.trust_pickle = trust_pickle  # a lineage never decides what gets unpickled
    try:
        plan = make_plan(src, options, inspection=si if options.from_spec is None else None)
    except _RECOMPUTE_ERRORS as exc:
        why = exc.message if isinstance(exc, ReshardError) else f"{type(exc).__name__}: {exc}"
        return None, f"{where}: its plan cannot be recomputed from {src} ({why})"
    if plan.source_fingerprint() != fingerprint:
        return None, (f"{where} names a source with fingerprint {fingerprint}, not {src} "
                      f"({plan.source_fingerprint()})")
    if not plan.feasible:
        return None, f"{where}: its options give an infeasible plan from {src}"
    return plan, ""


def _chain(src: Source, out: Source, si: Inspection, so: Inspection, trust_pickle: bool) -> tuple[list[_Hop], str | None]:
    """The conversions from ``src`` to ``out``, oldest first, each recomputed; ([], why not) otherwise.

    Walks back from ``out``: the last lineage entry of each checkpoint must be a transition
    whose plan, recomputed from ``src`` (or else from the checkpoint the entry's
    ``source_path`` names, only a place to look), has the recorded source fingerprint.
    """
    hops: list[_Hop] = []
    cur, ci = out, so
    visited = {out.root.resolve()}
    while len(hops) < MAX_HOPS:
        lineage = list(ci.manifest.lineage) if ci.manifest is not None else []
        if not lineage or lineage[-1].event != "transition":
            return [], None if not hops else f"{cur} (between {src} and {out}) was not made by a conversion"
        entry = lineage[-1]
        where = f"{cur.root / 'manifest.json'} (lineage entry {len(lineage)})"
        plan, why = _recompute_hop(src, si, entry, where, trust_pickle)
        if plan is not None:
            hops.append(_Hop(plan, src, si, cur, ci, where))
            return hops[::-1], None
        named = entry.policies.get("source_path")
        if not isinstance(named, str) or not named or Path(named).resolve() in visited:
            return [], why
        prev = Source.local(named)  # a place to look on this machine
        try:
            pi = open_checkpoint(prev, trust_pickle)
        except ReshardError as exc:
            return [], f"{why}; the source it names, {prev}, cannot be opened ({exc.message})"
        plan, why2 = _recompute_hop(prev, pi, entry, where, trust_pickle)
        if plan is None:
            return [], f"{why}; {why2}"
        hops.append(_Hop(plan, prev, pi, cur, ci, where))
        visited.add(prev.root.resolve())
        cur, ci = prev, pi
    return [], f"{out} is more than {MAX_HOPS} conversions away from {src}"


def _compose(hops: list[_Hop], source: str, what: str) -> Evidence:
    """One `Evidence` for a chain, oldest hop first: for each key the last conversion that dropped or wrote it decides."""
    ev = Evidence(source, what)
    for h in hops:
        e = plan_evidence(h.plan, source="a", what="", src=h.src, out=h.out, src_index=h.src_insp.index,
                          out_index=h.out_insp.index, transforms=len(hops) == 1)
        for k, why in e.dropped.items():
            ev.values.pop(k, None)
            ev.proven.pop(k, None)
            ev.dropped[k] = why
        for k, v in e.values.items():
            ev.dropped.pop(k, None)
            ev.proven.pop(k, None)
            ev.values[k] = v
        ev.proven.update(e.proven)
        ev.semantics.update(e.semantics)
        ev.slice = "; then ".join(x for x in (ev.slice, e.slice) if x) or None  # a slice anywhere in the chain
    return ev


def conversion_evidence(a: Source, b: Source, sa: Inspection, sb: Inspection, *, trust_pickle: bool = False,
                        verify: Callable[..., dict[str, Any]]) -> tuple[Evidence | None, list[str]]:
    """Re-derive the changes the conversions between A and B made, from the source side itself.

    One side (the output) must carry a manifest whose last lineage entry is a transition
    recording its plan options and its source's fingerprint (`reshard.semantics.transition`). The
    plan is recomputed from the other side with those options (and this run's
    ``trust_pickle``: a lineage never decides what gets unpickled); it must be feasible and
    have the recorded source fingerprint, i.e. the other side is that conversion's source.
    The returned `Evidence` then excuses exactly what that plan produces (`plan_evidence`).

    A chain (A -> X -> ... -> B) is followed back through the checkpoints the lineage
    entries' ``source_path`` name, each only a place to look: every hop's plan is recomputed
    from the checkpoint found there and must have its recorded fingerprint, and every
    intermediate checkpoint is itself verified against its source with that hop's evidence
    (a full comparison: each intermediate is read once more), because later hops' rewrites
    are computed from its values. Then the last hop that dropped or wrote a key decides
    what B must hold there. Transformed or cast tensors are excused for a single
    conversion only. Reports inside any checkpoint are never read. Returns (evidence or
    None, notes saying why a lineage found could not be used).

    ``verify``: the comparison an intermediate checkpoint goes through
    (`reshard.verification.checkpoints.verify_checkpoints`, passed in: that module imports this one).
    """
    notes: list[str] = []
    for source, (src, out, si, so) in (("a", (a, b, sa, sb)), ("b", (b, a, sb, sa))):
        hops, why = _chain(src, out, si, so, trust_pickle)
        if not hops:
            if why:
                notes.append(f"{why}: its changes count as differences")
            continue
        for h in hops[:-1]:  # the intermediates later plans read; the last output is what this verify checks
            ev = plan_evidence(h.plan, source="a", what=h.where, src=h.src, out=h.out, src_index=h.src_insp.index,
                               out_index=h.out_insp.index)
            try:
                r = verify(h.src, h.out, trust_pickle=trust_pickle, evidence=ev)
            except ReshardError as exc:
                r = {"equal": False, "differences": [{"key": str(h.out), "detail": exc.message}]}
            if not r["equal"]:
                d = r["differences"][0]
                notes.append(f"{h.out} is not what the plan its lineage records makes of {h.src} "
                             f"({d['key']}: {d['detail']}): the changes of the chain count as differences")
                hops = []
                break
        if not hops:
            continue
        last = hops[-1]
        via = "" if len(hops) == 1 else f", through {len(hops) - 1} intermediate checkpoint(s), each verified"
        what = (f"the plan recomputed from {src} with the options {last.where} records "
                f"(fingerprint {last.plan.fingerprint()}){via}")
        return _compose(hops, source, what), notes
    return None, notes


def export_evidence(a: Source, b: Source, sa: Inspection, sb: Inspection) -> tuple[Evidence | None, list[str]]:
    """What an export of one side leaves out, re-derived from that side (never from ``export-report.json``).

    When exactly one side is a safetensors export, the keys its export of the other side
    drops (trainer state, objects, optimizer state under ``--only model``, tied copies
    written once) are recomputed from the other side with `reshard.planning.export.key_actions` and
    the ``only`` the export records in its header; they may be absent from the export. The
    semantics ``step`` and ``tokens_seen`` may be unknown on the export side (the format has
    no trainer counters). Nothing else is excused: a value that differs is a difference.
    """
    from reshard.planning.export import key_actions, tied_groups
    from reshard.storage.checkpoints.safetensors_format import ExportIndex

    kinds = (isinstance(sa.index, ExportIndex), isinstance(sb.index, ExportIndex))
    if kinds not in ((False, True), (True, False)):
        return None, []
    source, src, si, so = ("a", a, sa, sb) if kinds[1] else ("b", b, sb, sa)
    counters = "an export carries no trainer counters"
    named = src.display  # a checkpoint in object storage by its URL, never its private staged folder
    ev = Evidence(source, f"what an export of {named} leaves out, recomputed from {named}",
                  semantics={"step": (counters, None), "tokens_seen": (counters, None)})
    meta = so.index.metadata
    only = meta.get("only")
    if meta.get("reshard_export") is None:
        return ev, [f"{so.index.path} was not written by `reshard export`: every key it lacks counts as a difference"]
    if only not in ("model", "model+optim"):
        return ev, [f"{so.index.path} records --only {short_repr(only)}, which `reshard export` never writes: "
                    "every key it lacks counts as a difference"]
    mdict = si.manifest.to_dict() if si.manifest is not None else {}
    given = so.index.source_essentials().get("ties_given")  # the export's option (a profile's tie), checked again
    for rec in key_actions(si.index, si.classification, mdict, only=only, found=tied_groups(si.report),
                           given=given if isinstance(given, list) else []):
        if rec.get("action") in (ExportAction.DROPPED, ExportAction.TIED_COPY):
            ev.dropped[rec["key"]] = f"not exported (--only {only}): {rec.get('reason', '')}"
    ev.what += f" (--only {only})"
    return ev, []


def recomputed_evidence(a: Source, b: Source, sa: Inspection, sb: Inspection, *, trust_pickle: bool,
                        strict: bool, verify: Callable[..., dict[str, Any]]) -> tuple[Evidence | None, list[str]]:
    """The changes re-derived from the source side: an export's (``strict`` or not: an export
    cannot hold what it leaves out), else a conversion's unless ``strict``; with notes on
    lineages that could not be used. ``verify``: as for `conversion_evidence`."""
    evidence, why_not = export_evidence(a, b, sa, sb)
    if evidence is None and not strict:
        evidence, why_not = conversion_evidence(a, b, sa, sb, trust_pickle=trust_pickle, verify=verify)
    return evidence, why_not


def check_transforms(src: Source | Path, out: Source | Path, plan: Plan, b_files: set[str] | None = None) -> list[str]:
    """Prove each TP-dependent rewrite: same canonical (TP = 1) tensor on both sides.

    ``b_files``: only tensors with a chunk in these files of ``out`` (a distributed worker's part).
    """
    if plan.options.dtype is None and not any(t.transform or t.copy_from for t in plan.tensors):
        return []  # nothing rewritten, renamed or cast: the global comparison covers every tensor
    import torch

    from reshard.semantics import transforms
    from reshard.storage.checkpoints.local_format import open_any
    from reshard.semantics.conventions import reshard_key

    src, out = Source.of(src), Source.of(out)
    a = plan_reader(plan, src)  # the run's own, when it has one
    b = open_any(out.root, source_key=reshard_key, remote=out.remote)  # a DCP source, or torch's safetensors DCP
    problems = []
    def mine(key: str) -> bool:
        return b_files is None or any(c.location is not None and c.location.file in b_files
                                      for c in b.entries[key].chunks)

    for t in plan.tensors:
        tr = t.transform
        if not tr or t.key not in b.entries or not mine(t.key):
            continue
        x, y = a.read_tensor(t.copy_from or t.key), b.read_tensor(t.key)
        if tr["kind"] == "reinterleave":
            ok = identical(transforms.to_canonical(x, tr["dim"], tr["parts"], tr["from_tp"]),
                             transforms.to_canonical(y, tr["dim"], tr["parts"], tr["to_tp"]))
        elif tr["kind"] == "select":  # a slice's router rows: exactly the kept experts' rows of the source
            ok = identical(transforms.select_rows(x, tr["dim"], tr["index"]).to(y.dtype), y)
        else:
            n = min(tr["from_rows"], tr["to_rows"])
            ok = identical(x.narrow(tr["dim"], 0, n), y.narrow(tr["dim"], 0, n))
        if not ok:
            problems.append(t.key)
    for t in plan.tensors:
        if t.transform or t.key not in b.entries or not mine(t.key):
            continue
        src_key = t.copy_from or t.key
        if src_key not in a.entries:
            continue  # a new key (e.g. a new rank's reseeded RNG): nothing in the source to compare with
        if not t.copy_from and a.entries[src_key].dtype_name == t.dtype:
            continue  # a plain copy: the global comparison in verify covers it, no second read
        x = a.read_tensor(src_key)
        # bit for bit (`identical`): NaNs of a cast agree, and float8 has no torch.equal on CPU
        if not identical(x.to(getattr(torch, t.dtype)), b.read_tensor(t.key)):
            problems.append(t.key)
    return problems
