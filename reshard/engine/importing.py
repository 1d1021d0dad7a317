"""An import run: consolidated weights written as a DCP checkpoint for a layout, a warm start of a new run.

The sources are read by `reshard.engine.import_sources`; this module lays their tensors out
for the target, writes the chunks, the manifest and ``import-report.json``, reads everything
back and commits, which is why it is engine: `reshard import` calls `import_checkpoint`, and
tests and scripts call it with the options already parsed.

Layout
------
``to`` is a topology spec. Parameters and optimizer moments are placed FSDP ``Shard(0)``
over ``dp_shard`` exactly as reshard's data-parallel plans place them
(`reshard.model.layout.target_chunks`; 0-d tensors such as step counters are replicated, written
by rank 0). For the reshard convention ``tp > 1`` or ``pp > 1`` is refused for now: import at ``dp`` and
run ``reshard convert --to`` (with the model's partition rules) from there. A DeepSpeed import
(``fmt="deepspeed"``, `reshard.engine.deepspeed_import`) may have ``tp > 1``: its source gives each
tensor its placement, and its param groups are written as objects (``Source.objects``) beside them.

Hugging Face model directories (``fmt="torchtitan"`` or a family of ``formats/hf/``)
-------------------------------------------------------------------------------------
``reshard import HF_DIR DST --to SPEC --format torchtitan`` reads a directory transformers
writes through the family's mapping backwards (`reshard.engine.import_sources.hf_source`), and
the keys follow the trainer's convention (torchtitan: the model's FQNs at the top level,
0.3.0 names, as its CheckpointManager saves a model-only checkpoint). The layout may have
``tp > 1``: each parameter's TP dim comes from the family's partition rules
(``formats/models/``), FSDP's ``Shard(0)`` over ``dp_shard`` on top. The report's
``trainer_must`` says how the trainer starts from it (torchtitan: ``initial_load_path`` with
``initial_load_model_only`` and an empty checkpoint folder).

Semantics
---------
An import never continues a run: the output gets a new experiment id (``experiment_id`` or
a generated one), ``continuity: "warm_start"``, ``step`` / ``tokens_seen`` /
``samples_seen`` 0, and one lineage entry ``{"event": "import", "kind": "warm_start",
"reason": "weights only from <src>" ...}`` (with moments: "weights and optimizer moments
from <src> ..."; there is still no scheduler, data position or RNG). Without moments,
`reshard inspect` notes "no optimizer moments: resuming from this checkpoint is a warm start".

Resuming it: the reference trainer's `load_checkpoint` (reshard convention) asks DCP for
the full trainer state (optimizer, scheduler, counters, sampler) and fails on the first key
the import does not have; load only ``{"model": get_model_state_dict(model)}`` with
``dcp.load`` and ``set_model_state_dict`` (tests/test_export_import.py shows it).

The output appears atomically, holds ``manifest.json`` (with item checksums) and
``import-report.json`` (every source name, the key it became, its chunks), and is read back
and compared bitwise with the source before it is committed.
"""
from __future__ import annotations

import hashlib
import json
import os
import time as _time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from reshard.engine.deepspeed_import import deepspeed_source
from reshard.engine.import_sources import Source, SourceTensor, hf_source, native_mapping, open_source
from reshard.engine.space import space_errors
from reshard.errors import BadInput, Infeasible
from reshard.model.geometry import Box, whole
from reshard.model.topology import Topology
from reshard.render.progress import describe_bytes, end_commit, phase_of, start_commit
from reshard.storage.files.atomic import output_path

REPORT = "import-report.json"


def _placement(s: SourceTensor):
    from reshard.model.layout import Placement

    if s.placement is not None:
        return s.placement
    return Placement(dp_shard=bool(s.shape)) if s.shape else Placement.replicated()


def _new_id(src: Path, srcs: list[SourceTensor], to: str) -> str:
    if os.environ.get("SOURCE_DATE_EPOCH"):  # reproducible outputs: a deterministic id
        h = hashlib.sha256(json.dumps([str(src.resolve()), to, sorted((s.key, list(s.shape), str(s.dtype)) for s in srcs)])
                           .encode()).hexdigest()[:12]
        return f"import-{h}"
    return f"import-{uuid.uuid4()}"


@dataclass
class _Output:
    """What the output says of itself: a new experiment, a warm start, and why."""

    experiment_id: str
    reason: str
    stamp: str


@dataclass
class _Planned:
    """One source tensor's place in the output: its state-dict path and the chunk each writer rank writes."""

    src: SourceTensor
    path: tuple[str, ...] | None
    chunks: list[tuple[int, Box]]


def import_checkpoint(src: str | Path, dst: str | Path, *, to: str, rename: str | Path | None = None,
                      overwrite: bool = False, experiment_id: str | None = None, progress: Any = None,
                      fmt: str = "reshard", force: bool = False) -> dict[str, Any]:
    """Write ``src`` (consolidated weights) as a DCP checkpoint for layout ``to`` into ``dst``; returns the report.

    ``fmt``: ``"reshard"`` (the reshard key convention, data-parallel layouts), or ``"torchtitan"`` /
    a family name with a Hugging Face mapping (``formats/hf/``): ``src`` is then a Hugging Face model
    directory, read back into the family's native names and key convention with the inverse of the
    declared transforms, laid out for ``to`` (dp and tp) by the family's partition rules.
    Nothing is committed unless the output reads back bitwise equal to the source.
    ``progress``: a `reshard.render.progress.Progress` (or None): the phases "writing" and
    "verifying", by the source's tensor bytes.
    ``force``: go ahead when the destination lacks the space for the output (estimated from
    the planned chunks, `import_preflight`); otherwise refused before anything is written.
    """
    if fmt not in ("reshard", "deepspeed"):
        return _import_native(Path(src), Path(dst), to=to, fmt=fmt, rename=rename, overwrite=overwrite,
                              experiment_id=experiment_id, progress=progress, force=force)
    from reshard.planning.export import RenameRules
    from reshard.semantics import manifest as mf
    from reshard.storage.files.atomic import atomic_directory, check_destination
    from reshard.storage.files.replaceable import why_not_replaceable
    from reshard.storage.checkpoints.dcp_writer import CHECKSUM_ALGORITHM
    from reshard.storage.files.integrity import record as integrity_record

    started = _time.time()
    src, dst = Path(src), Path(dst)
    topo = _target_topology(to, fmt)
    check_destination(src, dst)
    rules = RenameRules.load(rename).inverse() if rename is not None else None
    source = deepspeed_source(src, rename, topo) if fmt == "deepspeed" else Source(*open_source(src, rules))
    _check_keys(source.tensors, src)
    output = _output(src, source, to, experiment_id)
    planned = _plan_layout(source.tensors, topo)
    estimate = import_preflight(src, dst, planned, force=force, progress=progress)
    with space_errors(dst, estimate["needed_bytes"], "the import"), atomic_directory(dst, overwrite=overwrite, replaceable=why_not_replaceable) as tmp:
        checksums = _write_tensors(tmp, planned, progress, to, source.objects)
        manifest = _manifest(src, source, rules, topo, output)
        manifest.integrity = integrity_record(checksums, algorithm=CHECKSUM_ALGORITHM)
        mf.write_manifest(tmp, manifest)
        verification = _verify_import(source.tensors, tmp, progress, source.objects)
        report = _report(src, dst, tmp, topo, source, output, planned, verification, started, estimate)
        (tmp / REPORT).write_text(json.dumps(report, indent=2, default=str) + "\n")
        _refuse_unequal(verification, dst)
        commit = start_commit(progress, tmp)  # the fsync and rename as the block exits
    end_commit(progress, commit)
    return report


def _import_native(src: Path, dst: Path, *, to: str, fmt: str, rename, overwrite: bool, experiment_id: str | None,
                   progress: Any, force: bool = False) -> dict[str, Any]:
    """``--format torchtitan`` (or a family): a Hugging Face directory -> the trainer's own DCP layout, a warm start."""
    from reshard.model.topology import parse_spec
    from reshard.semantics import manifest as mf
    from reshard.storage.files.atomic import atomic_directory, check_destination
    from reshard.storage.files.replaceable import why_not_replaceable
    from reshard.storage.checkpoints.dcp_writer import CHECKSUM_ALGORITHM
    from reshard.storage.files.integrity import record as integrity_record

    started = _time.time()
    if rename is not None:
        raise BadInput(f"--format {fmt} names every weight by the family's mapping (formats/hf/); --rename does not apply")
    mapping = native_mapping(fmt)
    topo = parse_spec(to)
    if topo.pp > 1 or topo.cp > 1:
        raise BadInput(f"import to pp={topo.pp}, cp={topo.cp} is not supported", hint="Import with pp=1 and cp=1.")
    check_destination(src, dst)
    source = Source("hf", *hf_source(src, mapping, topo))
    _check_keys(source.tensors, src)
    for s in source.tensors:
        if not s.dtype.is_floating_point:
            raise BadInput(f"parameter '{s.name}' has dtype {s.dtype}", where=str(src))
    output = _output(src, source, to, experiment_id)
    planned = _plan_layout(source.tensors, topo)
    estimate = import_preflight(src, dst, planned, force=force, progress=progress)
    with space_errors(dst, estimate["needed_bytes"], "the import"), atomic_directory(dst, overwrite=overwrite, replaceable=why_not_replaceable) as tmp:
        checksums = _write_tensors(tmp, planned, progress, to)
        manifest = _manifest(src, source, None, topo, output)
        manifest.key_convention = mapping.native_convention
        manifest.lineage[-1].policies.update(format=fmt, hf_mapping=mapping.source,
                                             trainer_must=_trainer_must(mapping.native_convention, dst))
        manifest.integrity = integrity_record(checksums, algorithm=CHECKSUM_ALGORITHM)
        mf.write_manifest(tmp, manifest)
        verification = _verify_import(source.tensors, tmp, progress)
        report = _report(src, dst, tmp, topo, source, output, planned, verification, started, estimate)
        report["format"] = fmt
        report["hf"] = {"mapping": mapping.describe(), "values": source.essentials.get("hf_values"),
                        # stated by config.json, no tensor carries them (checked for sense, not against a shape)
                        "unchecked": source.essentials.get("hf_values_unchecked"),
                        "native": mapping.native, "key_convention": mapping.native_convention}
        report["trainer_must"] = _trainer_must(mapping.native_convention, dst)
        (tmp / REPORT).write_text(json.dumps(report, indent=2, default=str) + "\n")
        _refuse_unequal(verification, dst)
        commit = start_commit(progress, tmp)  # the fsync and rename as the block exits
    end_commit(progress, commit)
    return report


def _trainer_must(convention: str, dst: Path) -> list[str]:
    """What the trainer is told so that it starts from the import (model only: no optimizer, schedule or data state)."""
    if convention == "torchtitan":
        return [f'checkpoint.initial_load_path = "{output_path(dst)}"', "checkpoint.initial_load_model_only = true",
                "checkpoint.folder: a new, empty folder (a step-N folder there is resumed instead)"]
    return []


def _target_topology(to: str, fmt: str = "reshard") -> Topology:
    """The target layout; only data-parallel targets are imported (tp/pp placements need the model's rules),
    and ``tp`` for a DeepSpeed import, whose source places each parameter by the shipped rules its names match."""
    from reshard.model.topology import parse_spec

    topo = parse_spec(to)
    if (topo.tp > 1 and fmt != "deepspeed") or topo.pp > 1:
        raise BadInput(f"import to tp={topo.tp}, pp={topo.pp} is not supported yet",
                       hint=f"Import to dp={topo.dp_shard} first, then `reshard convert DST OUT --to {to}` "
                            "(tensor/pipeline placements come from the model's partition rules).")
    if topo.cp > 1:
        raise BadInput("import to cp > 1 is not supported", hint="Import with cp=1.")
    return topo


def _check_keys(srcs: list[SourceTensor], src: Path) -> None:
    """Something to import, one source name per key, and parameters of a floating-point dtype."""
    if not srcs:
        raise BadInput("the source holds no tensors", where=str(src))
    seen: dict[str, str] = {}
    for s in srcs:
        if s.key in seen:
            raise BadInput(f"'{seen[s.key]}' and '{s.name}' would both be imported as '{s.key}'", where=str(src),
                           hint="Fix the rename rules.")
        seen[s.key] = s.name
        if s.dtype.name not in ("float32", "bfloat16", "float16", "float64") and s.key.startswith("model."):
            raise BadInput(f"parameter '{s.name}' has dtype {s.dtype}", where=str(src))


def _output(src: Path, source: Source, to: str, experiment_id: str | None) -> _Output:
    """An import never continues a run: a new experiment id, and the reason it is a warm start."""
    from reshard.units import now_text

    stamp = now_text()
    exp_id = experiment_id or _new_id(src, source.tensors, to)
    what = "weights and optimizer moments" if source.with_moments else "weights only"
    reason = f"{what} from {src.resolve()}" + (" (no scheduler, data position or RNG state)" if source.with_moments else "")
    return _Output(exp_id, reason, stamp)


def _plan_layout(srcs: list[SourceTensor], topo: Topology) -> list[_Planned]:
    """Every tensor's state-dict path and target chunks, parameters first (then by key)."""
    from reshard.model.layout import target_chunks

    return [_Planned(s, _state_path(s.key), target_chunks(s.shape, _placement(s), topo))
            for s in sorted(srcs, key=lambda s: (not s.key.startswith("model."), s.key))]


def _state_path(key: str) -> tuple[str, ...] | None:
    """Where a key sits in the trainer's nested state dict (None: the writer's default for the key)."""
    if key.startswith("model."):
        return ("model", key[len("model."):])
    if key.startswith("optim.state."):
        fqn, _, name = key[len("optim.state."):].rpartition(".")
        return ("optim", "state", fqn, name)
    return None


def _write_tensors(tmp: Path, planned: list[_Planned], progress: Any, to: str,
                   objects: dict[str, tuple[tuple, Any]] | None = None) -> dict[str, str]:
    """Write every planned chunk, read box by box from the source, then the source's objects (an optimizer's
    param groups, written by rank 0 as DCP writes non-tensor values); returns the items' checksums."""
    from reshard.storage.checkpoints.dcp_writer import DcpWriter

    total = sum(_nbytes(p.src) for p in planned)
    if progress is not None:
        progress.say(f"importing {describe_bytes(total, len(planned), 'tensor')} for {to} …")
    w = DcpWriter(tmp)
    try:
        with phase_of(progress, "writing", total) as bar:
            for p in planned:
                s = p.src
                w.declare_tensor(s.key, s.shape, s.dtype, path=p.path)
                for rank, box in p.chunks:
                    w.write_chunk(rank, s.key, box.offsets, s.read(box))
                if bar is not None:
                    bar.update(_nbytes(s))
        for key, (path, value) in sorted((objects or {}).items()):
            w.write_object(0, key, value, path=path)
        w.finish()
    finally:
        w.close()
    return w.checksums()


def import_preflight(src: Path, dst: Path, planned: list[_Planned], *, force: bool = False,
                     progress: Any = None) -> dict[str, Any]:
    """`reshard.engine.space.preflight` for an import: the DCP output of the planned chunks
    (their bytes, `torch.save` framing, alignment, metadata) against ``dst``'s free space."""
    from reshard.engine.space import estimate_dcp_bytes, preflight

    chunks = [box.numel * p.src.dtype.itemsize for p in planned for _rank, box in p.chunks]
    return preflight(dst, needed=estimate_dcp_bytes(chunks, len(planned)),
                     read_bytes=sum(_nbytes(p.src) for p in planned), sources=[src], force=force, what="the import",
                     progress=progress)


def _nbytes(s: SourceTensor) -> int:
    """A source tensor's bytes (what the progress of an import counts)."""
    return whole(s.shape).numel * s.dtype.itemsize


def _manifest(src: Path, source: Source, rules, topo: Topology, output: _Output):
    """The output's manifest: step 0 of a new experiment, a warm start, the source recorded in its lineage."""
    from reshard.version import __version__
    from reshard.semantics import manifest as mf

    ess = source.essentials
    with_moments = source.with_moments
    mtopo = mf.Topology.make(dp_replicate=topo.dp_replicate, dp_shard=topo.dp_shard, cp=topo.cp, tp=topo.tp, pp=topo.pp)
    dtypes = sorted({str(s.dtype).removeprefix("torch.") for s in source.tensors if s.key.startswith("model.")})
    policies = {"source": str(src.resolve()), "format": source.format, "rename": rules.source if rules else None,
                "optimizer_moments": with_moments, "source_experiment_id": ess.get("experiment_id"),
                "source_step": ess.get("step"), "source_tokens_seen": ess.get("tokens_seen"),
                "source_topology": ess.get("topology")}
    return mf.Manifest(
        experiment_id=output.experiment_id, step=_source_step(source), tokens_seen=0, samples_seen=0, key_convention="reshard",
        topology=mtopo,
        batch=mf.Batch(micro_batch=None, grad_accum=None, seq_len=None, global_batch=None),
        accumulation=mf.Accumulation(micro_step=0, in_flight_grads=False),
        precision=mf.Precision(param_dtype=dtypes[0] if len(dtypes) == 1 else "mixed", reduce_dtype="unknown",
                               loss_scaler=None),
        model=mf.ModelInfo(family=str(ess.get("model_family") or "unknown"),
                           config=ess.get("model_config") if isinstance(ess.get("model_config"), dict) else {},
                           tied=source.tied_fqns()),
        optimizer=mf.OptimizerInfo(name=(str(ess.get("optimizer") or "unknown") if source.format == "deepspeed" else "unknown")
                                 if with_moments else "none", config={}),
        scheduler=mf.SchedulerInfo(name="none", config={}, unit="steps"),
        data=mf.DataPosition(sampler="none", seed=0, epoch=0, cursor=0, dataset_len=0,
                             order="none: imported weights carry no data position"),
        rng=mf.RngInfo(policy="none", keyed_by_rank=False, seed=0),
        continuity="warm_start",
        lineage=[mf.LineageEvent(event="import", from_=None, to=mtopo,
                                 at_step=ess.get("step") if isinstance(ess.get("step"), int) else None,
                                 policies=policies, tool=f"reshard {__version__}", time=output.stamp,
                                 kind="warm_start", reason=output.reason)],
        writer=mf.Writer(tool=f"reshard {__version__}", torch=str(torch.__version__), time=output.stamp),
    )


def _source_step(source: Source) -> int:
    """The output's step: 0 for weights, the optimizer step a DeepSpeed import carries with its Adam state
    (its step counters say it, and inspect checks the manifest against them)."""
    step = source.essentials.get("step")
    return step if source.format == "deepspeed" and isinstance(step, int) and source.with_moments else 0


def _key_report(p: _Planned) -> dict[str, Any]:
    """The report's line for one source name: the key it became and its chunks."""
    s = p.src
    return {"name": s.name, "key": s.key, "shape": list(s.shape), "dtype": str(s.dtype).removeprefix("torch."),
            "placement": _placement(s).describe(),
            "chunks": [{"rank": r, "offsets": list(b.offsets), "sizes": list(b.sizes)} for r, b in p.chunks]}


def _report(src: Path, dst: Path, tmp: Path, topo: Topology, source: Source, output: _Output, planned: list[_Planned],
            verification: dict[str, Any], started: float, estimate: dict[str, Any] | None = None) -> dict[str, Any]:
    """``import-report.json``: every source name, the key it became, its chunks, and what was not imported."""
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.name.endswith(".distcp")}
    return {
        "report_version": 1,
        "source": str(src.resolve()),
        "destination": str(output_path(dst)),  # a symlink at dst was replaced, not followed
        "format": source.format,
        "target": topo.to_dict(),
        "experiment_id": output.experiment_id,
        "continuity": "warm_start",
        "reason": output.reason,
        "optimizer_moments": source.with_moments,
        "moments_without_parameter": source.orphans(),
        "tied": source.tied_fqns(),
        "keys": [_key_report(p) for p in planned],
        "not_imported": source.skipped,
        "verification": verification,
        "files": files,
        "bytes_written": sum(files.values()),
        "seconds": None if os.environ.get("SOURCE_DATE_EPOCH") else round(_time.time() - started, 3),
        # measured figures (free space, probes) vary from run to run: none under SOURCE_DATE_EPOCH either
        "estimate": None if os.environ.get("SOURCE_DATE_EPOCH") else estimate,
    }


def _refuse_unequal(verification: dict[str, Any], dst: Path) -> None:
    """Raised inside the atomic directory, so an output that does not read back as its source is never committed."""
    if not verification["equal"]:
        raise Infeasible("the imported checkpoint does not read back as the source: "
                         + "; ".join(verification["differences"][:5]), where=str(dst),
                         hint="Nothing was committed. This is a bug in reshard; please report it.")


def _verify_import(srcs: list[SourceTensor], out: Path, progress: Any = None,
                   objects: dict[str, tuple[tuple, Any]] | None = None) -> dict[str, Any]:
    """Every written tensor read back through the DCP index (one at a time), bitwise against the source;
    every object read back equal to its value."""
    from reshard.storage.checkpoints.index import CheckpointIndex

    ix = CheckpointIndex.open(out)
    diffs = [f.message for f in ix.findings if f.severity == "error"]
    with phase_of(progress, "verifying", sum(_nbytes(s) for s in srcs)) as bar:
        for s in srcs:
            a = s.read(whole(s.shape))
            b = ix.read_tensor(s.key)
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.reshape(-1).view(torch.uint8),
                                                                           b.reshape(-1).view(torch.uint8)):
                diffs.append(s.key)
            del a, b
            if bar is not None:
                bar.update(_nbytes(s))
    for key, (_path, value) in sorted((objects or {}).items()):
        if ix.read_object(key) != value:
            diffs.append(key)
    return {"equal": not diffs, "tensors": len(srcs), "objects": len(objects or {}), "differences": diffs}
