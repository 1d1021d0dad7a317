"""Describing a checkpoint (what `reshard inspect` prints): is it complete, what does it hold, and who wrote it.

The answer is a plain dict (the `--json` shape, documented in the README) built from the
index (bytes and geometry), the key classification (roles) and the manifest (intent).
Consistency checks read only the small items they need (step counters, counters) and, for
tied weights, compare the two copies chunk by chunk.
"""
from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from reshard.gc_pause import paused_gc
from reshard.render.report import moment_sets_text
from reshard.model import topology as topo_mod
from reshard.semantics import megatron, pipeline
from reshard.semantics.conventions import Classification, Convention, KeyRole, classify, known_tied_pairs, reshard_key
from reshard.semantics.trainer_config import step_from_folder
from reshard.errors import BadInput, ReshardError
from reshard.model.checkpoint import ChunkTable, Finding
from reshard.model.dtypes import is_torch_tensor
from reshard.model.inspection import JSON_VERSION, Inspection
from reshard.storage.checkpoints.index import CheckpointIndex, bitwise_equal
from reshard import safefs
from reshard.storage.checkpoints import sidecars
from reshard.storage.pickles.plain_items import PlainTensor
from reshard.storage.checkpoints.local_format import open_any
from reshard.storage.source import Source


def _load_manifest(root: Path) -> Any:
    from reshard.semantics.manifest import read_manifest

    return read_manifest(root)


def _scalar(v: Any) -> Any:
    if (is_torch_tensor(v) and v.numel() == 1) or (isinstance(v, PlainTensor) and v.numel == 1):
        x = v.item()
        return int(x) if float(x).is_integer() else x
    return v


@paused_gc()  # the metadata path builds millions of small objects: reshard.gc_pause
def inspect_checkpoint(source: Source | str | Path, *, deep: bool = False, from_spec: str | None = None,
                       trust_pickle: bool = False, progress: Any = None,
                       conventions: Sequence[Convention] = (), ties: Sequence[Sequence[str]] | None = None,
                       from_origin: str = "--from") -> Inspection:
    """Describe a checkpoint: each step below does one job and adds its problems to ``findings``.

    ``conventions`` are the user's (``--convention FILE``), offered to classify before the shipped ones;
    ``ties`` the user's ``--tie A=B`` pairs, checked like a manifest's ``model.tied``; ``from_origin``
    where ``from_spec`` was stated (`reshard.planning.options.from_origin`), for the message that
    refuses a stated layout the checkpoint contradicts.

    ``source``: the checkpoint as its command opened it (`reshard.storage.source.opened`: a store's
    reader is handed its `RemoteCheckpoint`), or a local checkpoint's path.

    The order of the steps is the order of the problems in the report, so it stays fixed.
    """
    source = Source.of(source)
    root = source.root
    hf_folder = _hf_model_folder(root)
    if hf_folder is not None and hf_folder[1].startswith("pytorch_model") \
            and not any(f.suffix in (".safetensors", ".distcp") for f in root.iterdir()):
        raise _not_dcp(root, hf_folder)  # torch.save weights beside config.json: nothing here reads them as a checkpoint
    ix = open_any(root, trust_pickle=trust_pickle, source_key=reshard_key, remote=source.remote)  # DCP, or reshard's local format (local-index.json)
    if hf_folder is not None and str(ix.version or "").startswith("safetensors-export") and not _exported_by_reshard(ix):
        raise _not_dcp(root, hf_folder)  # read as a consolidated export, but save_pretrained wrote it, not reshard
    findings: list[Finding] = ix.findings  # the index's own findings come first, then ours
    manifest = _manifest_or_finding(root, findings)
    mdict: dict[str, Any] = manifest.to_dict() if manifest is not None else {}
    can_read = ix.complete  # byte ranges all present: small items can be read for the checks below
    if deep:
        _deep_check(ix, manifest, progress)

    cls = classify(((k, e.kind) for k, e in ix.entries.items()),
                   prefer=mdict.get("key_convention") or _export_convention(ix), user=tuple(conventions))
    params = _parameters(cls.roles)
    topo = _topology(ix, mdict, _geometry_keys(cls.roles, params), from_spec, findings, cls, from_origin)
    by_role = _contents_by_role(ix, cls.roles)
    counter_keys = _present_counters(ix, cls)
    counters = _read_scalars(ix, counter_keys if can_read else {}, findings)
    side = sidecars.inspect_section(ix)  # every other file of the directory (reshard.storage.checkpoints.sidecars)
    for name, (where, value) in sidecars.counters_from(side).items():
        if name not in counters:  # a trainer that keeps its step beside the DCP data (Megatron's common.pt)
            counters[name], counter_keys[name] = value, where
    opt, step_values = _optimizer_health(ix, cls, params, mdict, can_read, findings, user_ties=ties or ())
    per_rank = _per_rank_state(cls.roles, topo, findings)
    step, step_source = _global_step(mdict, counters, step_values, counter_keys, findings, folder_step=step_from_folder(root),
                                     owned=_owned_counter_keys(cls, counter_keys, ix))
    _check_accumulation(mdict.get("accumulation"), findings)
    _check_unknown_keys(cls, findings)

    complete, _, _ = _exit_code(findings)
    ins = Inspection(ix, cls, manifest, topo, {}, as_found=from_spec is None and not conventions and not ties and not deep,
                     path=source.display, complete=complete, findings=findings, step=step,
                     tokens_seen=mdict.get("tokens_seen", counters.get("tokens_seen")),
                     experiment_id=mdict.get("experiment_id"), batch=mdict.get("batch"),
                     accumulation=mdict.get("accumulation"), entries=len(ix.entries),
                     bytes=sum(ix.file_sizes.values()), has_manifest=manifest is not None, optimizer=opt, sidecars=side)
    # the report prints the typed fields: the planner reads them, and both say the same by construction
    ins.report = _report(source, ins, mdict, deep=deep, step_source=step_source, by_role=by_role, counters=counters,
                         per_rank=per_rank)
    ins.report["sidecars"] = side
    return ins


HF_CONFIG = "config.json"
HF_WEIGHTS = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json", "pytorch_model.bin")


def _hf_model_folder(root: Path) -> tuple[str, str] | None:
    """(architecture, weights file) of a Hugging Face model folder, or None.

    What transformers' ``save_pretrained`` writes: ``config.json`` beside ``model.safetensors``
    (or its sharded index, or the older ``pytorch_model.bin``), and no DCP ``.metadata`` or
    reshard ``local-index.json``. Its keys are a model's names without a trainer's prefix, so a
    convention would only guess (it read as Lightning's ``model.*``); it is named for what it is.
    The architecture is read from ``config.json`` for the message only (capped JSON, never code).
    """
    if not root.is_dir() or (root / ".metadata").exists() or (root / "local-index.json").exists():
        return None
    if not os.path.lexists(root / HF_CONFIG):
        return None
    weights = next((w for w in HF_WEIGHTS if os.path.lexists(root / w)), None)
    if weights is None:
        return None
    arch = "model"
    try:
        cfg = safefs.read_json(root / HF_CONFIG, root=root, what="Hugging Face config.json")
        archs = cfg.get("architectures") if isinstance(cfg, dict) else None
        if isinstance(archs, list) and archs and isinstance(archs[0], str):
            arch = archs[0]
        elif isinstance(cfg, dict) and isinstance(cfg.get("model_type"), str):
            arch = f"model_type {cfg['model_type']}"
    except (ReshardError, OSError):
        arch = "model (config.json unreadable)"
    return arch, weights


def _export_metadata(ix: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A consolidated export's two metadata records: its safetensors file's and its sharded index's
    (each empty where there is none, or where the reader is not an export's)."""
    meta = getattr(ix, "metadata", None)
    index = getattr(ix, "index", None)
    index_meta = index.get("metadata") if isinstance(index, dict) else None
    return (meta if isinstance(meta, dict) else {}), (index_meta if isinstance(index_meta, dict) else {})


def _exported_by_reshard(ix: Any) -> bool:
    """An `export --format hf` output: reshard recorded its export map in the safetensors metadata
    (`verify` compares such an export with its source, so inspect keeps reading it)."""
    meta, index_meta = _export_metadata(ix)
    return "export_map" in meta or bool(index_meta.get("reshard"))


def _export_convention(ix: Any) -> str | None:
    """The key convention a reshard export records of its source (``source_convention``): its index
    names the source's keys (the export map), which another convention's markers may also match
    (Lightning's ``model.``: issue 47 found reshard's own HF export called "lightning"). Like a
    manifest's ``key_convention`` it only breaks a tie; a name no convention has is ignored."""
    for m in _export_metadata(ix):
        if isinstance(m.get("source_convention"), str):
            return m["source_convention"]
    return None


def _not_dcp(root: Path, hf_folder: tuple[str, str]) -> BadInput:
    """The refusal of a Hugging Face model folder, with `reshard import` as the way to a DCP checkpoint.

    ``--format`` is the trainer naming a shipped mapping of the architecture gives
    (``formats/hf/``: LlamaForCausalLM -> torchtitan), else ``reshard`` (the names as stored).
    """
    arch, weights = hf_folder
    from reshard.semantics.hf import mapping_for, shipped_families

    natives = sorted({m.native_convention for m in (mapping_for(f) for f in shipped_families())
                      if m.architecture == arch and m.native_convention != "reshard"})
    fmt, why = ((natives[0], f"the {arch} mapping of formats/hf/ gives {natives[0]}'s names") if natives else
                ("reshard", f"no mapping of {arch} ships in formats/hf/: the names as stored, under model."))
    return BadInput(f"a Hugging Face model folder ({arch}: {HF_CONFIG} beside {weights}, as save_pretrained writes it), "
                    "not a DCP checkpoint: inspect, plan and convert read sharded DCP checkpoints", where=str(root),
                    hint=f"Make a DCP checkpoint of it first: `reshard import {root} DST --to SPEC --format {fmt}` "
                         f"({why}), then inspect or convert DST.")


def _manifest_or_finding(root: Path, findings: list[Finding]) -> Any:
    """The manifest, or None: a missing one is normal, an unreadable one is an error worth naming."""
    try:
        return _load_manifest(root)
    except ReshardError as exc:
        findings.append(Finding("error", "bad_manifest", exc.message, file="manifest.json"))
        return None


def _deep_check(ix: Any, manifest: Any, progress: Any) -> None:
    """`--deep`: read every item; a DCP index also checks the item checksums the manifest recorded."""
    integrity = getattr(manifest, "integrity", None)
    if integrity is not None and isinstance(ix, CheckpointIndex):
        ix.deep_check(progress=progress, integrity=integrity)
    else:
        ix.deep_check(progress=progress)


def _parameters(roles: dict[str, KeyRole]) -> dict[str, str]:
    """Parameter name -> its key: the names every optimizer and tied-weight check speaks in."""
    return {r.param: k for k, r in roles.items() if r.role == "parameter" and r.param}


# ---------------------------------------------------------------------------- topology

def _geometry_keys(roles: dict[str, KeyRole], params: dict[str, str]) -> list[str]:
    """The keys whose chunks show the layout: the parameters, else (optimizer-only) the moments.

    An optimizer moment is cut exactly like its parameter, so a checkpoint that holds only the
    optimizer (HF Accelerate writes model and optimizer to separate folders) shows the same layout.
    """
    if params:
        return list(params.values())
    return [k for k, r in roles.items() if r.role == "optimizer_moment"]


def _topology(ix: Any, mdict: dict[str, Any], keys: list[str], from_spec: str | None,
              findings: list[Finding], cls: Classification, from_origin: str = "--from") -> topo_mod.Topology:
    """The source layout: given by the user, else recorded in the manifest, else inferred from the chunks.

    A layout the user states (``--from``, a profile's ``from``, a trainer config's degrees:
    ``from_origin`` says which) is checked against what the chunks and data files show
    (`reshard.model.topology.contradictions`): a contradiction is bad input naming both, and
    only a layout the chunks leave open is settled by the user's word. A recorded layout is
    checked against the ranks that wrote data files, since a wrong world size would misplace
    every per-rank state. An inferred layout the chunks cannot pin down is a warning that lists
    the candidates and asks for ``--from``.
    """
    # The layout the writer's save plans record (Megatron's torch_dist), checked against what was stored
    recorded = megatron.recorded_layout(ix, keys, cls.convention, findings) if from_spec or not mdict.get("topology") else None
    if from_spec and recorded is not None:
        megatron.check_given(topo_mod.parse_spec(from_spec), recorded, where=str(Path(ix.root) / ".metadata"),
                             origin=from_origin)
    if from_spec:
        stated = topo_mod.parse_spec(from_spec, source="given")
        ev = _chunk_evidence(ix, keys)
        wrong = topo_mod.contradictions(stated, ev, stores_replicas=cls.convention.stores_replicas)
        if wrong:
            shown = topo_mod.infer_from(ev)
            if not cls.convention.stores_replicas:
                shown = topo_mod.replicas_not_stored(shown, cls.convention.name)
            raise BadInput(
                f"the source layout stated by {from_origin} is {stated.spec()} (world size {stated.world_size}), but "
                f"the checkpoint shows otherwise: " + "; ".join(wrong) + f". From its chunks and {len(ev.writer_ranks)} "
                f"writer rank(s) the layout is " + (" or ".join(shown.alternatives) if shown.ambiguous else
                                                    f"{shown.spec()} (world size {shown.world_size})"),
                where=str(getattr(ix, "root", "")),
                hint=(f"Drop or correct the stated layout ({from_origin}): the checkpoint's own is read from its chunks, and "
                      "--from is asked for only when they leave it open." if not shown.ambiguous else
                      f"State one of the layouts the chunks allow instead ({from_origin}), e.g. --from "
                      f"{shown.alternatives[0]}."))
        topo = stated.with_source("given", evidence=[f"stated by {from_origin}; checked against {ev.tensors} tensors' "
                                                     f"chunks and {len(ev.writer_ranks)} writer rank(s): no contradiction"])
    elif mdict.get("topology"):
        topo = topo_mod.from_manifest(mdict["topology"])
    elif recorded is not None:
        topo = recorded
    else:
        topo = _pipeline_or(topo_mod.infer_from(_chunk_evidence(ix, keys)), ix, cls)
        if not cls.convention.stores_replicas:
            topo = topo_mod.replicas_not_stored(topo, cls.convention.name)
        if topo.ambiguous:
            findings.append(Finding("warning", "topology_ambiguous",
                                    "the chunks admit several source layouts: " + ", ".join(topo.alternatives)
                                    + "; pass --from with the one the run used (e.g. --from " + topo.alternatives[0] + ")"))
    writers = ix.writer_ranks()
    if writers and max(writers) >= topo.world_size and topo.source == "manifest":
        findings.append(Finding("inconsistent", "topology_mismatch",
                                f"data files were written by rank {max(writers)} but the {topo.source} topology has world size {topo.world_size}"))
    return topo


def chunk_writers(ix: Any, key: str) -> list[int]:
    """The writer rank of each chunk of tensor ``key``, in chunk order (-1: no storage, or a file named
    by no rank), from the data file names (``ix.writer_of``); every chunk -1 for an index without them."""
    e = ix.entries[key]
    t = ChunkTable.of(e.chunks, len(e.shape))
    writer_of = getattr(ix, "writer_of", lambda _f: None)
    by_file = {i: (w if 0 <= i < len(t.files) and (w := writer_of(t.files[i])) is not None else -1)
               for i in np.unique(t.file).tolist()}
    return [by_file[int(i)] for i in t.file]


def _pipeline_or(topo: topo_mod.Topology, ix: Any, cls: Classification) -> topo_mod.Topology:
    """An inferred layout whose extra writers may be replicas or pipeline stages, read as stages where
    the parameters' and moments' writers show them (`reshard.semantics.pipeline`), else unchanged."""
    candidates = [topo_mod.parse_spec(a) for a in topo.alternatives if a.startswith("pp=")]
    if topo.dp_replicate > 1 and topo.cp == topo.pp == 1:
        candidates.insert(0, topo_mod.Topology(pp=topo.dp_replicate, dp_shard=topo.dp_shard, tp=topo.tp))
    if not candidates or getattr(ix, "writer_of", None) is None:
        return topo
    writers_of: dict[tuple[str, str], set[int]] = {}
    for key, role in cls.roles.items():
        if role.param and role.role in ("parameter", "optimizer_moment") and ix.entries[key].is_tensor:
            writers_of.setdefault((role.role, role.param), set()).update(chunk_writers(ix, key))
    params = {name: w for (r, name), w in writers_of.items() if r == "parameter"}
    moments = {name: w for (r, name), w in writers_of.items() if r == "optimizer_moment"}
    for cand in candidates:
        reading = pipeline.read_stages(params, moments, world=cand.world_size, ranks_per_stage=cand.world_size // cand.pp)
        if reading is not None:
            return pipeline.as_topology(reading, topo)
    return topo


def _chunk_evidence(ix: Any, keys: list[str]) -> topo_mod.ChunkEvidence:
    """What the chunks of ``keys`` and the data file names show (`reshard.model.topology.collect`)."""
    writer_of_file = getattr(ix, "writer_of", lambda _f: None)
    writers_by_file: dict[str, int | None] = {}  # a few files, each named by thousands of chunks

    def writer_of(name: str) -> int | None:
        w = writers_by_file.get(name, -1)
        if w == -1:
            w = writers_by_file[name] = writer_of_file(name)
        return w

    by_files: dict[int, tuple[Any, np.ndarray]] = {}  # id of a file-name list -> (the list, its writers)

    def arrays(key: str) -> tuple:
        e = ix.entries[key]
        t = ChunkTable.of(e.chunks, len(e.shape))
        known = by_files.get(id(t.files))
        if known is None:  # the index's tables share one list of file names: look its writers up once
            known = by_files[id(t.files)] = (t.files, np.array(
                [w if (w := writer_of(f)) is not None and w < 1 << 31 else -1 for f in t.files] + [-1], dtype=np.int64))
        return key, e.shape, t.offsets, t.sizes, known[1][t.file]  # file -1 (no location): the last, unknown

    return topo_mod.collect((arrays(k) for k in keys), ix.writer_ranks())


# ---------------------------------------------------------------------------- contents

def _contents_by_role(ix: Any, roles: dict[str, KeyRole]) -> dict[str, dict[str, Any]]:
    """Count and bytes per role, and per dtype inside each role (objects count as dtype "object")."""
    by_role: dict[str, dict[str, Any]] = {}
    names: dict[int, str] = {}  # a DType's name, once per dtype object (compared by identity)
    for k, e in ix.entries.items():
        slot = by_role.setdefault(roles[k].role, {"count": 0, "bytes": 0, "dtypes": {}})
        nbytes = e.nbytes
        slot["count"] += 1
        slot["bytes"] += nbytes
        name = names.get(id(e.dtype))
        if name is None:
            name = names[id(e.dtype)] = e.dtype_name or "object"
        d = slot["dtypes"].setdefault(name, {"count": 0, "bytes": 0})
        d["count"] += 1
        d["bytes"] += nbytes
    return by_role


def _present_counters(ix: Any, cls: Classification) -> dict[str, str]:
    """The convention's counters (step, tokens seen, ...) that this checkpoint actually saved."""
    return cls.counter_keys(ix.entries)


def _read_scalars(ix: Any, keys: dict[str, str], findings: list[Finding]) -> dict[str, Any]:
    """Read small items as Python scalars, by name; an unreadable one is an error finding, not a crash."""
    values: dict[str, Any] = {}
    many = getattr(ix, "read_plains", None)  # a DCP index reads many alike items at once (a step counter per parameter)
    with ix.reading_ahead(keys.values()):  # a checkpoint in object storage: fetched in parallel, not one round trip each
        if many is not None:
            read = many(keys.values())
        else:
            read = []
            for key in keys.values():
                try:
                    read.append((key, ix.read_plain(key), None))
                except ReshardError as exc:
                    read.append((key, None, exc))
        for name, (key, value, exc) in zip(keys, read):
            if exc is not None:
                findings.append(Finding("error", "unreadable_item", exc.message, keys=(key,)))
            else:
                values[name] = _scalar(value)
    return values


# ---------------------------------------------------------------------------- optimizer health

def _optimizer_health(ix: Any, cls: Classification, params: dict[str, str], mdict: dict[str, Any],
                      can_read: bool, findings: list[Finding],
                      user_ties: Sequence[Sequence[str]] = ()) -> tuple[dict[str, Any], list[Any]]:
    """The report's "optimizer" section, and the distinct step counter values (the step check needs them)."""
    roles = cls.roles
    moments, steps = _optimizer_keys(roles)
    moment_names = sorted({n for m in moments.values() for n in m})
    buffer_names = cls.buffer_names()
    opt: dict[str, Any] = {"moment_names": moment_names, "parameters": len(params),
                           "with_moments": sum(1 for p in params if p in moments)}
    opt["step_counters"], distinct = _step_counters(ix, steps, can_read, findings)
    opt["fused"] = _fused_entries(ix, cls, params, moments)
    covered = {q for r in opt["fused"] for q in r["parts"]}  # model entries whose moments a fused entry holds
    fused_names = {r["optimizer"] for r in opt["fused"]}
    opt["with_moments"] += len(covered)
    unfused = {p: k for p, k in params.items() if p not in covered}
    tied, tied_members = _tied_weights(ix, params, moments, moment_names, mdict, can_read, findings, user_ties)
    groups = _param_groups(ix, roles, can_read, findings) if moment_names else None
    listed = {n for members in groups.values() for n in members} if groups else None
    # A tie is checked before the param-groups fact: the optimizer lists a tied tensor under one name only.
    by_kind = _buffers(ix, unfused, moments, buffer_names, None) if moment_names else {}
    tied += _ties_by_equality(ix, unfused, moments, by_kind, tied_members, can_read, findings) if moment_names else []
    opt["tied"] = tied
    buffers = _buffers(ix, {p: k for p, k in unfused.items() if p not in tied_members}, moments, buffer_names,
                       listed) if moment_names else {}
    opt["buffers"] = {p: buffers[p] for p in sorted(buffers)}
    trainable = {p: k for p, k in unfused.items() if p not in buffers}
    expected = _expected_moments(groups, moments, moment_names)
    opt["moment_sets"] = _moment_sets(trainable, moments, groups)
    if len(opt["moment_sets"]) > 1 and groups:
        findings.append(Finding("info", "moment_sets",
                                "the optimizer keeps different state per parameter group: " + moment_sets_text(opt["moment_sets"])
                                + "; each parameter is checked against the state of its own group"))
    if not params and moments:
        findings.append(Finding("info", "optimizer_only",
                                f"optimizer-only checkpoint: moments for {len(moments)} parameters and no model entries; "
                                "the layout is read from the moments' geometry"))
        missing, shape_bad = [], []
    else:
        missing, shape_bad = _moment_coverage(ix, trainable, {p: m for p, m in moments.items() if p not in fused_names},
                                              moment_names, tied, tied_members, findings, expected, groups is not None)
    opt["missing_moments"] = missing
    opt["shape_mismatches"] = shape_bad
    return opt, distinct


def _fused_entries(ix: Any, cls: Classification, params: dict[str, str],
                   moments: dict[str, dict[str, str]]) -> list[dict[str, Any]]:
    """Optimizer entries of a fused parameter whose model copy is saved split, checked by geometry.

    The parts' sizes along the fused dim must add up to the optimizer entry's, the other dims
    equal; then the parts count as carrying the entry's moments and the entry is not an orphan. The moments are carried as they are: a DP change reshards them
    along their own dim 0, as the fused parameter is.
    """
    records: list[dict[str, Any]] = []
    for p in sorted(moments):
        if p in params:
            continue
        hit = cls.fused_parts(p)
        if hit is None:
            continue
        parts, f = hit
        if not all(q in params for q in parts):
            continue
        some = ix.entries[next(iter(moments[p].values()))]
        shapes = [ix.entries[params[q]].shape or () for q in parts]
        ok = some.shape is not None and all(len(sh) == len(some.shape) for sh in shapes) \
            and sum(sh[f.dim] for sh in shapes) == some.shape[f.dim] \
            and all(sh[d] == some.shape[d] for sh in shapes for d in range(len(sh)) if d != f.dim)
        if not ok:
            continue
        records.append({"optimizer": p, "parts": list(parts), "dim": f.dim, "layout": f.layout,
                        "evidence": f"{' + '.join(str(list(sh)) for sh in shapes)} along dim {f.dim} = {list(some.shape)}"})
    return records


def _buffers(ix: Any, params: dict[str, str], moments: dict[str, dict[str, str]],
             buffer_names: tuple[str, ...], listed: set[str] | None) -> dict[str, str]:
    """Model entries that are not trainable, each with the fact that shows it; they expect no moments.

    Facts, in order: the entry holds optimizer moments (then it is trainable, whatever its name);
    an integer dtype (no optimizer steps integers); the optimizer's param groups list parameter
    names (``listed``, None when they list none or were not read) and this one is not among them;
    a running statistic by name (BatchNorm's running_mean).
    """
    out: dict[str, str] = {}
    for p, k in params.items():
        if p in moments:
            continue
        e = ix.entries[k]
        if e.dtype is not None and not (e.dtype.is_floating_point or e.dtype.is_complex):
            out[p] = f"integer dtype {e.dtype_name}"
        elif listed is not None and p not in listed:
            out[p] = "not listed in the optimizer's param groups"
        elif p.rsplit(".", 1)[-1] in buffer_names:
            out[p] = "running statistic (buffer)"
    return out


def _param_groups(ix: Any, roles: dict[str, KeyRole], can_read: bool,
                  findings: list[Finding]) -> dict[str, list[str]] | None:
    """The optimizer's parameter groups as group -> the parameter names it lists (get_state_dict writes
    names: ``optim.param_groups.<i>.params``, or one ``param_groups`` object holding the list), or None
    when they list none. With several optimizers (``get_state_dict(model, [muon, adamw])``) their groups
    follow each other, so a group is where one optimizer's kind of state is expected."""
    keys = sorted(k for k, r in roles.items() if r.role == "param_group" and ix.entries[k].kind == "object")
    if not can_read or not keys:
        return None
    groups: dict[str, list[str]] = {}
    for k in keys:
        if not (k.endswith(".params") or k.endswith("param_groups") or ".params." in k):
            continue
        try:
            value = ix.read_plain(k)
        except ReshardError as exc:
            findings.append(Finding("error", "unreadable_item", exc.message, keys=(k,)))
            return None
        if k.endswith("param_groups") and isinstance(value, (list, tuple)):
            parts = {f"{k}[{i}]": g for i, g in enumerate(value)}  # one object holding every group
        else:
            parts = {k.removesuffix(".params").split(".params.")[0]: value}
        for gid, g in parts.items():
            names: set[str] = set()
            _collect_param_names(g, names, under_params=k.endswith(".params") or ".params." in k)
            if names:
                groups.setdefault(gid, []).extend(sorted(names))
    return groups or None


def _group_label(gid: str) -> str:
    """``optim.param_groups.1`` -> ``1``; ``optim.param_groups[1]`` -> ``1``: the group's number as a report says it."""
    tail = gid.rsplit(".", 1)[-1]
    return tail.rsplit("[", 1)[-1].rstrip("]") if "[" in tail else tail


def _expected_moments(groups: dict[str, list[str]] | None, moments: dict[str, dict[str, str]],
                      moment_names: list[str]) -> dict[str, list[str]]:
    """Parameter name -> the moments it must hold: those its parameter group's parameters hold.

    One optimizer keeps one kind of state for every parameter it steps (Adam exp_avg and
    exp_avg_sq, Muon or SGD a momentum_buffer), so a missing moment is one its group's other
    parameters hold and it does not. A parameter no group lists (or no groups saved) is held to
    every moment any parameter holds, as before groups were read.
    """
    expected: dict[str, list[str]] = {}
    for members in (groups or {}).values():
        names = sorted({n for p in members for n in moments.get(p, {})})
        for p in members:
            expected[p] = sorted(set(expected.get(p, [])) | set(names))
    return {p: names or moment_names for p, names in expected.items()}


def _moment_sets(trainable: dict[str, str], moments: dict[str, dict[str, str]],
                 groups: dict[str, list[str]] | None) -> list[dict[str, Any]]:
    """The trainable parameters grouped by the moments they hold, each set with its count and groups,
    in the order of the groups (the first optimizer's first)."""
    group_of = {p: _group_label(gid) for gid, members in (groups or {}).items() for p in members}
    sets: dict[tuple[str, ...], dict[str, Any]] = {}
    for p in trainable:
        names = tuple(sorted(moments.get(p, {})))
        if not names:
            continue
        rec = sets.setdefault(names, {"moments": list(names), "parameters": 0, "groups": []})
        rec["parameters"] += 1
        g = group_of.get(p)
        if g is not None and g not in rec["groups"]:
            rec["groups"].append(g)
    order = {_group_label(gid): i for i, gid in enumerate(groups or {})}
    return sorted(sets.values(), key=lambda r: (min((order.get(g, 1 << 30) for g in r["groups"]), default=1 << 30),
                                                r["moments"]))


def _collect_param_names(value: Any, out: set[str], *, under_params: bool) -> None:
    """Strings found under a ``params`` list (of one param group, or of all of them)."""
    if isinstance(value, dict):
        for key, v in value.items():
            _collect_param_names(v, out, under_params=under_params or key == "params")
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect_param_names(v, out, under_params=under_params)
    elif under_params and isinstance(value, str):
        out.add(value)


def _ties_by_equality(ix: Any, params: dict[str, str], moments: dict[str, dict[str, str]], buffers: dict[str, str],
                      tied_members: set[str], can_read: bool, findings: list[Finding]) -> list[dict[str, Any]]:
    """Ties shown by the bytes: a trainable entry without moments, bitwise equal to one with moments.

    Tied weights are one tensor saved under two names, and the optimizer keeps its moments under
    one of them; equal shape, dtype and bytes is the evidence, listed in the record.
    """
    if not can_read:
        return []
    records: list[dict[str, Any]] = []
    with_moments = [p for p in params if p in moments]
    for p, k in params.items():
        if p in moments or p in buffers or p in tied_members:
            continue
        e = ix.entries[k]
        for q in with_moments:
            eq_ = ix.entries[params[q]]
            if eq_.shape != e.shape or eq_.dtype != e.dtype:
                continue
            try:
                equal = bitwise_equal(ix, k, params[q])
            except ReshardError as exc:
                findings.append(Finding("error", "unreadable_item", exc.message, keys=(k, params[q])))
                return records
            if equal:
                records.append({"names": [q, p], "source": "equal bytes", "equal": True,
                                "evidence": f"'{p}' has no optimizer moments and is bitwise equal to '{q}' "
                                            f"(shape {list(e.shape or ())}, {e.dtype_name}), which carries them"})
                tied_members.update((p, q))
                break
    return records


def _optimizer_keys(roles: dict[str, KeyRole]) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """Parameter name -> {moment name -> key}, and parameter name -> its step counter key."""
    moments: dict[str, dict[str, str]] = defaultdict(dict)
    steps: dict[str, str] = {}
    for k, r in roles.items():
        if r.role == "optimizer_moment" and r.param:
            moments[r.param][r.name or "?"] = k
        elif r.role == "optimizer_step" and r.param:
            steps[r.param] = k
    return moments, steps


def _step_counters(ix: Any, steps: dict[str, str], can_read: bool,
                   findings: list[Finding]) -> tuple[dict[str, Any], list[Any]]:
    """Per-parameter step counters must agree: disagreeing ones mean state from different steps."""
    step_values = _read_scalars(ix, steps if can_read else {}, findings)
    distinct = sorted({v for v in step_values.values()}, key=lambda x: (str(type(x)), x))
    summary: dict[str, Any] = {"count": len(step_values), "values": distinct, "consistent": len(distinct) <= 1}
    if len(distinct) > 1:
        groups: dict[Any, list[str]] = defaultdict(list)
        for p, v in step_values.items():
            groups[v].append(p)
        summary["disagreements"] = {str(v): sorted(ps)[:20] for v, ps in groups.items()}
        findings.append(Finding("inconsistent", "step_disagree",
                                f"optimizer step counters disagree: values {distinct}",
                                keys=tuple(sorted(steps.values())[:50])))
    return summary, distinct


def _tied_candidates(params: dict[str, str], moments: dict[str, dict[str, str]], moment_names: list[str],
                     mdict: dict[str, Any], user_ties: Sequence[Sequence[str]] = ()) -> list[tuple[tuple[str, ...], str]]:
    """Tied groups declared by the manifest or the user (``--tie``), then known pairs where only one copy has state."""
    declared = [tuple(t) for t in (mdict.get("model", {}) or {}).get("tied", []) or []]
    candidates = [(t, "manifest") for t in declared]
    for t in user_ties:
        if tuple(t) not in declared and tuple(reversed(t)) not in declared:
            declared.append(tuple(t))
            candidates.append((tuple(t), "user"))
    for a, b in known_tied_pairs():
        if (a, b) in declared or (b, a) in declared:
            continue
        if a in params and b in params and moment_names and ((a in moments) != (b in moments)):
            candidates.append(((a, b), "inferred"))
    return candidates


def _tied_weights(ix: Any, params: dict[str, str], moments: dict[str, dict[str, str]], moment_names: list[str],
                  mdict: dict[str, Any], can_read: bool, findings: list[Finding],
                  user_ties: Sequence[Sequence[str]] = ()) -> tuple[list[dict[str, Any]], set[str]]:
    """One record per tied group (are the saved copies bitwise equal?), and the parameters known to be tied.

    Copies declared tied by the manifest must be equal; an inferred tie counts only once seen equal.
    """
    tied: list[dict[str, Any]] = []
    tied_members: set[str] = set()
    for names, source in _tied_candidates(params, moments, moment_names, mdict, user_ties):
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
            if eq or source in ("manifest", "user"):
                tied_members.update(present)
            if eq is False and source in ("manifest", "user"):
                findings.append(Finding("inconsistent", "tied_differ",
                                        f"tied copies {' and '.join(present)} differ", keys=tuple(params[n] for n in present)))
        else:
            rec["equal"] = None
            rec["note"] = "not checked: the checkpoint is incomplete"
        tied.append(rec)
    return tied, tied_members


def _moment_coverage(ix: Any, params: dict[str, str], moments: dict[str, dict[str, str]], moment_names: list[str],
                     tied: list[dict[str, Any]], tied_members: set[str], findings: list[Finding],
                     expected: dict[str, list[str]] | None = None, grouped: bool = False) -> tuple[list[str], list[str]]:
    """Every trainable parameter has every moment of its parameter group (``expected``; every moment
    any parameter has when the groups are unknown), with the parameter's global shape; no moment
    lacks a parameter.

    Returns the missing moments and the shape mismatches, as the report lists them.
    """
    missing: list[str] = []
    shape_bad: list[str] = []
    if moment_names:
        missing, shape_bad = _missing_and_misshapen(ix, params, moments, moment_names, tied, tied_members, expected or {})
        orphan = sorted(p for p in moments if p not in params)
        if orphan:
            findings.append(Finding("inconsistent", "moments_without_param",
                                    f"optimizer state for {len(orphan)} names that are not parameters",
                                    keys=tuple(orphan[:50])))
    if missing:
        findings.append(Finding("inconsistent", "missing_moments",
                                f"{len(missing)} trainable parameters have no optimizer moments"
                                + (" their parameter group's other parameters hold" if grouped else ""),
                                keys=tuple(missing[:50])))
    if shape_bad:
        findings.append(Finding("inconsistent", "moment_shape", "optimizer moments whose global shape differs from the parameter's",
                                keys=tuple(shape_bad[:50])))
    if not moment_names and params:
        findings.append(Finding("info", "no_moments", "no optimizer moments: resuming from this checkpoint is a warm start"))
    return missing, shape_bad


def _missing_and_misshapen(ix: Any, params: dict[str, str], moments: dict[str, dict[str, str]], moment_names: list[str],
                           tied: list[dict[str, Any]], tied_members: set[str],
                           expected: dict[str, list[str]]) -> tuple[list[str], list[str]]:
    """Parameters (or parameter moments) without state, and moments shaped unlike their parameter.

    A tied copy carries no state of its own when another member of its tie does. A parameter
    is held to ``expected[p]`` (its group's moments), else to every moment name.
    """
    missing: list[str] = []
    shape_bad: list[str] = []
    for p, k in params.items():
        have = moments.get(p)
        if not have:
            if p in tied_members and any(q in moments for t in tied for q in t["names"] if p in t["names"]):
                continue
            missing.append(p)
            continue
        for n in expected.get(p, moment_names):
            mk = have.get(n)
            if mk is None:
                missing.append(f"{p} ({n})")
            elif ix.entries[mk].shape != ix.entries[k].shape:
                shape_bad.append(f"{p}.{n}: {list(ix.entries[mk].shape)} vs parameter {list(ix.entries[k].shape)}")
    return missing, shape_bad


# ---------------------------------------------------------------------------- per-rank state

def _per_rank_state(roles: dict[str, KeyRole], topo: topo_mod.Topology, findings: list[Finding]) -> dict[str, Any]:
    """RNG and data-loader state, one record per role: which ranks saved it, and which are missing.

    RNG state is expected for every rank, data state for every data-parallel rank; state under
    a key shared by all ranks keeps one rank's copy only, so it is a warning on several ranks.
    """
    per_rank: dict[str, Any] = {}
    for role in ("rng", "data"):
        rs = [r for r in roles.values() if r.role == role]
        if not rs:
            continue
        ranked = sorted({r.rank for r in rs if r.rank is not None})
        shared = sorted(r.key for r in rs if r.rank is None)
        info: dict[str, Any] = {"keys": len(rs), "ranks": ranked, "keyed_per_rank": bool(ranked),
                                "shared_keys": shared[:20]}
        spelled: dict[int, KeyRole] = {}
        for r in sorted((r for r in rs if r.rank is not None), key=lambda r: r.key):
            first = spelled.setdefault(r.rank, r)
            if first.rank_text != r.rank_text:  # plan refuses them (`Classification.ranked`); inspect says so first
                findings.append(Finding("inconsistent", f"{role}_rank_alias",
                                        f"two {role} keys name rank {r.rank} (a trainer loads one of them)", keys=(first.key, r.key)))
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
    return per_rank


# ---------------------------------------------------------------------------- identity and problems

def _global_step(mdict: dict[str, Any], counters: dict[str, Any], distinct: list[Any], counter_keys: dict[str, str],
                 findings: list[Finding], folder_step: int | None = None, owned: frozenset[str] = frozenset(),
                 ) -> tuple[Any, str | None]:
    """The global step and where it came from: the manifest, else a counter, else the folder's name
    (torchtitan's ``step-N``, `reshard.semantics.trainer_config.step_from_folder`), else the optimizer's step.

    Every other stored source that disagrees with the chosen one is an inconsistency; a folder
    name that disagrees is a warning only (a folder can be renamed; its name is no evidence).
    A ``step`` counter no convention owns (``owned``: the primary convention's counters, a
    user convention's, a known sidecar's) is the user's own count, a fact and not evidence: a
    trainer counting micro-steps or accumulation passes saves ``step = 7`` beside an optimizer
    that took 2 steps, and the checkpoint is exactly what it saved. It is the global step only
    when nothing else says one; otherwise a note names both values.
    """
    step = mdict.get("step")
    step_source = "manifest" if step is not None else None
    counter = counters.get("step")
    own = "step" in counters and counter_keys.get("step") in owned
    user_counter_differs = ("step" in counters and not own and len(distinct) == 1 and distinct[0] != counter)
    if step is None and "step" in counters and not user_counter_differs:
        step, step_source = counter, "counter"
    if folder_step is not None:
        stored = step if step is not None else (distinct[0] if len(distinct) == 1 else None)
        if stored is None:
            step, step_source = folder_step, "folder name"
        elif stored != folder_step:
            findings.append(Finding("warning", "step_folder_mismatch",
                                    f"the folder's name says step {folder_step} but the "
                                    f"{step_source or 'optimizer'} says {stored}; the stored value is used"))
    if step is None and len(distinct) == 1:
        step, step_source = distinct[0], "optimizer"
    if step is not None and len(distinct) == 1 and distinct[0] != step:
        findings.append(Finding("inconsistent", "step_mismatch",
                                f"global step {step} ({step_source}) but optimizer step counters say {distinct[0]}"))
    if "step" in counters and step is not None and step_source != "counter" and counter != step:
        if own and mdict.get("step") is not None:
            findings.append(Finding("inconsistent", "step_mismatch",
                                    f"manifest step {mdict['step']} but counter '{counter_keys['step']}' says {counter}"))
        elif not own:
            findings.append(Finding("info", "user_counter",
                                    f"counter '{counter_keys['step']}' says {counter} and the {step_source}"
                                    + (" step counters say" if step_source == "optimizer" else " says") + f" {step}: "
                                    "no convention defines that counter, so it is the trainer's own count (micro-steps "
                                    "or accumulation passes count differently) and is carried as saved; the global "
                                    f"step is {step}, from the {step_source}", keys=(counter_keys["step"],)))
    return step, step_source


def _owned_counter_keys(cls: Classification, counter_keys: dict[str, str], ix: Any) -> frozenset[str]:
    """The counter keys a convention defines as the trainer's own (evidence a disagreement is judged by):
    the primary convention's ``[counters]``, a user convention's, and a counter read from a known sidecar
    (Megatron's common.pt). A key only generic.toml's list names is the user's own count, a fact."""
    from reshard.semantics.conventions import builtin_conventions

    shipped = {id(c) for c in builtin_conventions()}
    convs = [cls.convention] + [c for c in cls.composed if id(c) not in shipped]
    owned = {k for c in convs for keys in c.counters.values() for k in keys}
    owned |= {k for k in counter_keys.values() if k not in ix.entries}  # a sidecar's, not a DCP key
    return frozenset(owned)


def _check_accumulation(acc: dict[str, Any] | None, findings: list[Finding]) -> None:
    """A save in the middle of an accumulation, without its gradients, cannot be resumed exactly."""
    if acc and acc.get("micro_step", 0) and not acc.get("in_flight_grads"):
        findings.append(Finding("warning", "mid_accumulation",
                                f"saved at micro-step {acc['micro_step']} of an accumulation without in-flight gradients"))


def _check_unknown_keys(cls: Classification, findings: list[Finding]) -> None:
    """Keys no rule of the convention explains: reshard will not guess what they mean."""
    unknown = cls.unknown
    if unknown:
        findings.append(Finding("warning", "unknown_keys", f"{len(unknown)} keys match no rule of convention '{cls.convention.name}'",
                                keys=tuple(unknown[:50])))


def _exit_code(findings: list[Finding]) -> tuple[bool, bool, int]:
    """Complete (no errors), consistent (no inconsistencies), and the exit code: 2 incomplete, 1 inconsistent."""
    complete = not any(f.severity == "error" for f in findings)
    consistent = not any(f.severity == "inconsistent" for f in findings)
    return complete, consistent, 0 if complete and consistent else (2 if not complete else 1)


def _report(source: Source, ins: Inspection, mdict: dict[str, Any], *, deep: bool, step_source: str | None,
            by_role: dict[str, Any], counters: dict[str, Any], per_rank: dict[str, Any]) -> dict[str, Any]:
    """The `--json` shape (documented in the README): its key order is what the JSON prints."""
    ix, cls, topo, findings = ins.index, ins.classification, ins.topology, ins.findings
    complete, consistent, exit_code = _exit_code(findings)
    store = source.store_reads()
    return {
        "json_version": JSON_VERSION,
        **({"store": store} if store is not None else {}),  # a remote checkpoint: what describing it fetched
        "path": ins.path,  # the URL of a remote checkpoint (reshard.storage.objectstore.remote)
        "complete": ins.complete,
        "consistent": consistent,
        "exit_code": exit_code,
        "experiment_id": ins.experiment_id,
        "step": ins.step,
        "step_source": step_source,
        "tokens_seen": ins.tokens_seen,
        "topology": topo.to_dict(),
        "writer_ranks": len(ix.writer_ranks()),
        "batch": ins.batch,
        "accumulation": ins.accumulation,
        "continuity": mdict.get("continuity"),
        "lineage": mdict.get("lineage", []),
        "manifest": ins.has_manifest,
        "dcp_version": ix.version,
        "convention": {"name": cls.convention.name, "composed": cls.conventions_used(),
                       "candidates": [{"name": n, "unknown": u} for n, u in cls.candidates]},
        "entries": ins.entries,
        "items": ix.item_count(),
        "files": len(ix.file_sizes),
        "bytes": ins.bytes,
        "by_role": by_role,
        "counters": counters,
        "optimizer": ins.optimizer,
        "per_rank_state": per_rank,
        "unknown_keys": cls.unknown,
        "deep": deep,
        "problems": [f.to_dict() for f in findings if f.severity != "info"],
        "notes": [f.to_dict() for f in findings if f.severity == "info"],
    }
