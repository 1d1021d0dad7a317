"""`reshard inspect`: is a checkpoint complete, what does it hold, and who wrote it.

The answer is a plain dict (the `--json` shape, documented in the README) built from the
index (bytes and geometry), the key classification (roles) and the manifest (intent).
Consistency checks read only the small items they need (step counters, counters) and, for
tied weights, compare the two copies chunk by chunk.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from reshard.model import topology as topo_mod
from reshard.semantics.conventions import Classification, classify, known_tied_pairs
from reshard.errors import ReshardError
from reshard.model.checkpoint import Finding
from reshard.storage.index import CheckpointIndex
from reshard.storage.local_format import open_any

JSON_VERSION = 1


@dataclass
class Inspection:
    index: CheckpointIndex
    classification: Classification
    manifest: Any  # reshard.semantics.manifest.Manifest | None
    topology: topo_mod.Topology
    report: dict[str, Any]

    @property
    def exit_code(self) -> int:
        return int(self.report["exit_code"])


def _load_manifest(root: Path) -> Any:
    from reshard.semantics.manifest import read_manifest

    return read_manifest(root)


def bitwise_equal(ix: CheckpointIndex, a: str, b: str) -> bool:
    """Compare two tensors bit for bit, one stored chunk of ``a`` at a time (bounded memory)."""
    ea, eb = ix.entries[a], ix.entries[b]
    if ea.shape != eb.shape or ea.dtype != eb.dtype:
        return False
    for c in ea.chunks:
        if c.box.is_empty():
            continue
        ta = ix.read_box(a, c.box)
        tb = ix.read_box(b, c.box)
        if not torch.equal(ta.reshape(-1).view(torch.uint8), tb.reshape(-1).view(torch.uint8)):
            return False
    return True


def _scalar(v: Any) -> Any:
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        x = v.item()
        return int(x) if float(x).is_integer() else x
    return v


def inspect_checkpoint(path: str | Path, *, deep: bool = False, from_spec: str | None = None,
                       trust_pickle: bool = False, progress: Any = None) -> Inspection:
    root = Path(path)
    ix = open_any(root, trust_pickle=trust_pickle)  # DCP, or reshard's local format (local-index.json)
    findings: list[Finding] = ix.findings
    manifest = None
    try:
        manifest = _load_manifest(root)
    except ReshardError as exc:
        findings.append(Finding("error", "bad_manifest", exc.message, file="manifest.json"))
    mdict: dict[str, Any] = manifest.to_dict() if manifest is not None else {}

    can_read = ix.complete  # byte ranges all present: small items can be read for the checks below
    if deep:
        integrity = getattr(manifest, "integrity", None)
        if integrity is not None and isinstance(ix, CheckpointIndex):
            ix.deep_check(progress=progress, integrity=integrity)  # also checks the recorded item checksums
        else:
            ix.deep_check(progress=progress)

    cls = classify(((k, e.kind) for k, e in ix.entries.items()), prefer=mdict.get("key_convention"))
    roles = cls.roles

    # ---------------------------------------------------------------- topology
    params = {r.param: k for k, r in roles.items() if r.role == "parameter" and r.param}
    if from_spec:
        topo = topo_mod.parse_spec(from_spec, source="given")
    elif mdict.get("topology"):
        topo = topo_mod.from_manifest(mdict["topology"])
    else:
        topo = topo_mod.infer(
            ((ix.entries[k].shape, [(c.box.offsets, c.box.sizes) for c in ix.entries[k].chunks]) for k in params.values()),
            ix.writer_ranks())
    writers = ix.writer_ranks()
    if writers and max(writers) >= topo.world_size and topo.source != "inferred":
        findings.append(Finding("inconsistent", "topology_mismatch",
                                f"data files were written by rank {max(writers)} but the {topo.source} topology has world size {topo.world_size}"))

    # ---------------------------------------------------------------- counts by role and dtype
    by_role: dict[str, dict[str, Any]] = {}
    for k, e in ix.entries.items():
        r = roles[k].role
        slot = by_role.setdefault(r, {"count": 0, "bytes": 0, "dtypes": {}})
        slot["count"] += 1
        slot["bytes"] += e.nbytes
        dt = e.dtype_name or "object"
        d = slot["dtypes"].setdefault(dt, {"count": 0, "bytes": 0})
        d["count"] += 1
        d["bytes"] += e.nbytes

    # ---------------------------------------------------------------- counters
    counters: dict[str, Any] = {}
    for name, key in cls.convention.counters.items():
        if key in ix.entries and can_read:
            try:
                counters[name] = _scalar(ix.read_object(key))
            except ReshardError as exc:
                findings.append(Finding("error", "unreadable_item", exc.message, keys=(key,)))

    # ---------------------------------------------------------------- optimizer health
    moments: dict[str, dict[str, str]] = defaultdict(dict)
    steps: dict[str, str] = {}
    for k, r in roles.items():
        if r.role == "optimizer_moment" and r.param:
            moments[r.param][r.name or "?"] = k
        elif r.role == "optimizer_step" and r.param:
            steps[r.param] = k
    moment_names = sorted({n for m in moments.values() for n in m})
    opt: dict[str, Any] = {"moment_names": moment_names, "parameters": len(params),
                           "with_moments": sum(1 for p in params if p in moments)}
    step_values: dict[str, Any] = {}
    if can_read:
        for p, k in steps.items():
            try:
                step_values[p] = _scalar(ix.read_object(k))
            except ReshardError as exc:
                findings.append(Finding("error", "unreadable_item", exc.message, keys=(k,)))
    distinct = sorted({v for v in step_values.values()}, key=lambda x: (str(type(x)), x))
    opt["step_counters"] = {"count": len(step_values), "values": distinct, "consistent": len(distinct) <= 1}
    if len(distinct) > 1:
        groups: dict[Any, list[str]] = defaultdict(list)
        for p, v in step_values.items():
            groups[v].append(p)
        opt["step_counters"]["disagreements"] = {str(v): sorted(ps)[:20] for v, ps in groups.items()}
        findings.append(Finding("inconsistent", "step_disagree",
                                f"optimizer step counters disagree: values {distinct}",
                                keys=tuple(sorted(steps.values())[:50])))

    # ---------------------------------------------------------------- tied weights
    tied: list[dict[str, Any]] = []
    tied_members: set[str] = set()
    declared = [tuple(t) for t in (mdict.get("model", {}) or {}).get("tied", []) or []]
    candidates = [(t, "manifest") for t in declared]
    for a, b in known_tied_pairs():
        if (a, b) in declared or (b, a) in declared:
            continue
        if a in params and b in params and moment_names and ((a in moments) != (b in moments)):
            candidates.append(((a, b), "inferred"))
    for names, source in candidates:
        present = [n for n in names if n in params]
        rec: dict[str, Any] = {"names": list(names), "source": source}
        if len(present) < 2:
            rec["equal"] = None
            rec["note"] = "only one copy is saved" if present else "not present"
            if present:
                tied_members.update(present)
        elif can_read:
            try:
                eq = all(bitwise_equal(ix, params[present[0]], params[n]) for n in present[1:])
            except ReshardError as exc:
                findings.append(Finding("error", "unreadable_item", exc.message, keys=tuple(params[n] for n in present)))
                eq = None
            rec["equal"] = eq
            if eq or source == "manifest":
                tied_members.update(present)
            if eq is False and source == "manifest":
                findings.append(Finding("inconsistent", "tied_differ",
                                        f"tied copies {' and '.join(present)} differ", keys=tuple(params[n] for n in present)))
        else:
            rec["equal"] = None
            rec["note"] = "not checked: the checkpoint is incomplete"
        tied.append(rec)
    opt["tied"] = tied

    # moments for every trainable parameter, with the parameter's global shape
    missing: list[str] = []
    shape_bad: list[str] = []
    if moment_names:
        for p, k in params.items():
            have = moments.get(p)
            if not have:
                # a tied copy carries no state of its own
                if p in tied_members and any(q in moments for t in tied for q in t["names"] if p in t["names"]):
                    continue
                missing.append(p)
                continue
            for n in moment_names:
                mk = have.get(n)
                if mk is None:
                    missing.append(f"{p} ({n})")
                elif ix.entries[mk].shape != ix.entries[k].shape:
                    shape_bad.append(f"{p}.{n}: {list(ix.entries[mk].shape)} vs parameter {list(ix.entries[k].shape)}")
        orphan = sorted(p for p in moments if p not in params)
        if orphan:
            findings.append(Finding("inconsistent", "moments_without_param",
                                    f"optimizer state for {len(orphan)} names that are not parameters",
                                    keys=tuple(orphan[:50])))
    if missing:
        findings.append(Finding("inconsistent", "missing_moments",
                                f"{len(missing)} trainable parameters have no optimizer moments", keys=tuple(missing[:50])))
    if shape_bad:
        findings.append(Finding("inconsistent", "moment_shape", "optimizer moments whose global shape differs from the parameter's",
                                keys=tuple(shape_bad[:50])))
    if not moment_names and params:
        findings.append(Finding("info", "no_moments", "no optimizer moments: resuming from this checkpoint is a warm start"))
    opt["missing_moments"] = missing
    opt["shape_mismatches"] = shape_bad

    # ---------------------------------------------------------------- per-rank state
    per_rank: dict[str, Any] = {}
    for role in ("rng", "data"):
        rs = [r for r in roles.values() if r.role == role]
        if not rs:
            continue
        ranked = sorted({r.rank for r in rs if r.rank is not None})
        shared = sorted(r.key for r in rs if r.rank is None)
        info: dict[str, Any] = {"keys": len(rs), "ranks": ranked, "keyed_per_rank": bool(ranked),
                                "shared_keys": shared[:20]}
        if ranked:
            expect = topo.world_size if role == "rng" else topo.dp
            gaps = sorted(set(range(expect)) - set(ranked))
            extra = sorted(r for r in ranked if r >= expect)
            info["missing_ranks"] = gaps
            if gaps or extra:
                findings.append(Finding("inconsistent", f"{role}_ranks",
                                        f"per-rank {role} state for ranks {ranked}, expected 0..{expect - 1} ({topo.source} topology)"
                                        + (f"; missing {gaps}" if gaps else "") + (f"; unexpected {extra}" if extra else "")))
        elif role == "rng" and topo.world_size > 1:
            findings.append(Finding("warning", "rng_shared_key",
                                    "RNG state is saved under keys shared by all ranks: DCP keeps one rank's copy only",
                                    keys=tuple(shared[:20])))
        per_rank[role] = info

    # ---------------------------------------------------------------- step, unknowns, verdict
    step = mdict.get("step")
    step_source = "manifest" if step is not None else None
    if step is None and "step" in counters:
        step, step_source = counters["step"], "counter"
    if step is None and len(distinct) == 1:
        step, step_source = distinct[0], "optimizer"
    if step is not None and len(distinct) == 1 and distinct[0] != step:
        findings.append(Finding("inconsistent", "step_mismatch",
                                f"global step {step} ({step_source}) but optimizer step counters say {distinct[0]}"))
    if "step" in counters and mdict.get("step") is not None and counters["step"] != mdict["step"]:
        findings.append(Finding("inconsistent", "step_mismatch",
                                f"manifest step {mdict['step']} but counter '{cls.convention.counters['step']}' says {counters['step']}"))
    acc = mdict.get("accumulation")
    if acc and acc.get("micro_step", 0) and not acc.get("in_flight_grads"):
        findings.append(Finding("warning", "mid_accumulation",
                                f"saved at micro-step {acc['micro_step']} of an accumulation without in-flight gradients"))
    unknown = cls.unknown
    if unknown:
        findings.append(Finding("warning", "unknown_keys", f"{len(unknown)} keys match no rule of convention '{cls.convention.name}'",
                                keys=tuple(unknown[:50])))

    complete = not any(f.severity == "error" for f in findings)
    consistent = not any(f.severity == "inconsistent" for f in findings)
    exit_code = 0 if complete and consistent else (2 if not complete else 1)
    report: dict[str, Any] = {
        "json_version": JSON_VERSION,
        "path": str(root),
        "complete": complete,
        "consistent": consistent,
        "exit_code": exit_code,
        "experiment_id": mdict.get("experiment_id"),
        "step": step,
        "step_source": step_source,
        "tokens_seen": mdict.get("tokens_seen", counters.get("tokens_seen")),
        "topology": topo.to_dict(),
        "writer_ranks": len(writers),
        "batch": mdict.get("batch"),
        "accumulation": acc,
        "continuity": mdict.get("continuity"),
        "lineage": mdict.get("lineage", []),
        "manifest": manifest is not None,
        "dcp_version": ix.version,
        "convention": {"name": cls.convention.name, "candidates": [{"name": n, "unknown": u} for n, u in cls.candidates]},
        "entries": len(ix.entries),
        "items": ix.item_count(),
        "files": len(ix.file_sizes),
        "bytes": sum(ix.file_sizes.values()),
        "by_role": by_role,
        "counters": counters,
        "optimizer": opt,
        "per_rank_state": per_rank,
        "unknown_keys": unknown,
        "deep": deep,
        "problems": [f.to_dict() for f in findings if f.severity != "info"],
        "notes": [f.to_dict() for f in findings if f.severity == "info"],
    }
    return Inspection(ix, cls, manifest, topo, report)
