"""An export run: a DCP checkpoint written as one consolidated set of weights (safetensors or torch).

What is written under which name is decided before a byte is read (`reshard.planning.export`:
the plan, the shards, the header metadata); this module moves the bytes, reads them back and
commits the directory, which is why it is engine: `reshard export` calls `export`, and tests,
benchmarks and scripts call it with the options already parsed.

Streaming
---------
Tensors are written one global tensor at a time: each is assembled from its DCP chunks
with ``CheckpointIndex.read_tensor``, cast (``dtype``), written and dropped. For
safetensors the shard files are written directly in the safetensors layout (8-byte
little-endian header length, JSON header, raw little-endian tensor bytes): the header is
computed from shapes and dtypes before any tensor is read, so nothing is buffered and
**peak memory is bounded by the largest tensor (plus its cast copy)**, whatever
``max_shard_size``. The files load with ``safetensors.torch.load_file`` / ``safe_open``.

``fmt="torch"`` writes each shard with one ``torch.save`` of a flat dict, which needs the
whole shard in memory: **memory is bounded by one shard** (``max_shard_size``; pick e.g.
``256MB`` on a small machine).

Output (Hugging Face conventions)
---------------------------------
safetensors: ``model.safetensors`` when everything fits in one shard, otherwise
``model-0000k-of-0000N.safetensors`` plus ``model.safetensors.index.json``::

    {"metadata": {"total_size": <bytes of tensor data>,
                  "reshard": {<the essentials, JSON values>, "export_map": {...}}},
     "weight_map": {name: file, ...}}            # every exported name exactly once

torch: ``model.pt`` or ``model-0000k-of-0000N.pt``, plus ``model.pt.index.json`` (same shape)
in both cases (a torch file has no header for the metadata). Each safetensors shard's header
metadata and the names are `reshard.planning.export`'s.

``fmt="hf"`` (``--format hf``): the same safetensors layout under the Hugging Face names of the
model family's mapping, plus ``config.json`` (`reshard.planning.export.hf_plan`);
`reshard.verification.exports.compare_hf_export` is what ``reshard verify SRC HF_EXPORT`` runs.

The output directory appears atomically (`reshard.storage.files.atomic.atomic_directory`) and holds
``export-report.json``: every source key once with what happened to it. Every exported tensor
is read back and compared bitwise with the source before it is committed (`_verify_export`).
"""
from __future__ import annotations

import json
import os
import struct
import time as _time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where a tensor is cast or written, after the checks of the metadata path
    import torch

from reshard.engine.space import keep_remote_reads, preflight, space_errors
from reshard.errors import BadInput, Incomplete, Infeasible
from reshard.planning.export import (HF_CONFIG, ST_DTYPE_NAMES, ExportItem, ExportPlan, RenameRules, assign_shards,
                                     dtype_arg, export_essentials, export_identity, export_map, header_metadata,
                                     hf_plan, plan_export, source_report, tied_groups)
from reshard.storage.source import Source
from reshard.render.redaction import redact
from reshard.storage.checkpoints.safetensors_format import header_shape
from reshard.verification.exports import read_cast
from reshard.render.progress import describe_bytes, end_commit, phase_of, start_commit
from reshard.units import parse_size

REPORT = "export-report.json"
ST_INDEX = "model.safetensors.index.json"
PT_INDEX = "model.pt.index.json"
DEFAULT_MAX_SHARD = 5 * 10**9


def _raw_bytes(t: torch.Tensor) -> memoryview:
    import torch

    flat = t.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def _st_header(shard: list[ExportItem], metadata: dict[str, str]) -> bytes:
    h: dict[str, Any] = {"__metadata__": metadata}
    for it in shard:
        h[it.name] = {"dtype": ST_DTYPE_NAMES[it.dtype], "shape": header_shape(it.dtype, it.shape),  # F4: values, not bytes
                      "data_offsets": [it.offset, it.offset + it.nbytes]}
    raw = json.dumps(h, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def _write_safetensors_shard(ix, path: Path, shard: list[ExportItem], metadata: dict[str, str], progress: Any) -> None:
    with open(path, "xb") as f:
        f.write(_st_header(shard, metadata))
        for it in shard:
            t = read_cast(ix, it)
            f.write(_raw_bytes(t))
            del t
            if progress is not None:
                progress.update(it.nbytes)
        f.flush()


def _write_torch_shard(ix, path: Path, shard: list[ExportItem], progress: Any) -> None:
    import torch

    d: dict[str, torch.Tensor] = {}
    for it in shard:
        d[it.name] = read_cast(ix, it).clone()
        if progress is not None:
            progress.update(it.nbytes)
    with open(path, "xb") as f:
        torch.save(d, f)


def export(src: Source | str | Path, dst: str | Path, *, fmt: str = "safetensors", dtype: str | None = None,
           only: str = "model", max_shard_size: int | str = DEFAULT_MAX_SHARD, rename: str | Path | None = None,
           overwrite: bool = False, progress: Any = None, model_config: dict[str, Any] | None = None,
           profile: dict[str, Any] | None = None, force: bool = False,
           ties: list[list[str]] | None = None, publish_to: str | None = None) -> dict[str, Any]:
    """Write ``src`` (a DCP checkpoint) consolidated into ``dst``; returns the export report.

    ``fmt="hf"``: safetensors under the Hugging Face names of the model family's mapping
    (``formats/hf/<family>.toml``, strict), the weights transformed as it declares, and a
    ``config.json`` from the checkpoint's shapes plus ``model_config`` (``--model-config``) and the
    manifest's ``model.config`` for what the shapes cannot tell (asked for once when missing).
    ``profile``: the record of the profile that contributed values (file, sha256, what), kept in the report.
    ``ties``: parameter names that are one tensor (the profile's ``tie``), checked bitwise equal and
    written once, like the manifest's ``model.tied`` and the ties `reshard inspect` proves, which
    are always used (`reshard.planning.export.plan_export`); recorded as ``ties_given``.
    ``progress``: a `reshard.render.progress.Progress` (or None): the phases "writing" and
    "verifying", by the exported bytes.
    ``publish_to``: the store URL ``dst`` is uploaded to afterwards (`reshard.engine.publishing`):
    the report names it as the destination, and the preflight probes the upload.
    ``force``: go ahead when the destination lacks the space for the output, whose size is
    exact (tensor bytes and safetensors headers, `_estimate_bytes`); otherwise refused before
    anything is written (`reshard.engine.space.preflight`, the report's ``estimate``).
    """
    from reshard.semantics.conventions import classify, reshard_key
    from reshard.storage.files.atomic import atomic_directory, check_destination, output_path
    from reshard.storage.files.replaceable import why_not_replaceable
    from reshard.storage.checkpoints.local_format import open_any
    from reshard.semantics.manifest import read_manifest

    started = _time.time()
    source = Source.of(src)  # a store's reader is handed its own `RemoteCheckpoint`
    src, dst = source.root, Path(dst)
    if fmt not in ("safetensors", "torch", "hf"):
        raise BadInput(f"unknown export format '{fmt}'", hint="Use safetensors, torch or hf.")
    if only not in ("model", "model+optim"):
        raise BadInput(f"--only must be 'model' or 'model+optim', got '{only}'")
    if fmt == "hf" and only != "model":
        raise BadInput("--format hf exports model weights only (a transformers model has no optimizer state)",
                       hint="Drop --only, or use --format safetensors --only model+optim.")
    if fmt == "hf" and rename is not None:
        raise BadInput("--format hf names every parameter by the family's mapping (formats/hf/); --rename does not apply",
                       hint="Drop --rename, or use --format safetensors --rename FILE.")
    if fmt != "hf" and model_config:
        raise BadInput("--model-config is for --format hf (the values config.json needs)")
    out_dtype = dtype_arg(dtype)
    max_shard = parse_size(max_shard_size)
    rules = RenameRules.load(rename) if rename is not None else None
    check_destination(src, dst)

    ix = open_any(src, source_key=reshard_key, remote=source.remote)
    errors = [f for f in ix.findings if f.severity == "error"]
    if errors:
        raise Incomplete(f"the source checkpoint is incomplete: {errors[0].message}", where=str(src),
                         hint="Run `reshard inspect` for the full list; export only a complete checkpoint.")
    m = read_manifest(src)
    mdict = m.to_dict() if m is not None else {}
    cls = classify(((k, e.kind) for k, e in ix.entries.items()), prefer=mdict.get("key_convention"))
    inspected = source_report(source)  # the step, lineage and the ties inspect proves (equal bytes, known pairs)
    given = [list(t) for t in ties or []]
    plan = plan_export(ix, cls, mdict, only=only, dtype=out_dtype, rules=rules,
                       fmt="torch" if fmt == "torch" else "safetensors",  # a dtype the format cannot store: refused here
                       found=tied_groups(inspected), given=given,
                       given_where=f"the profile {profile['file']}" if profile and profile.get("file") else "the profile")
    if not plan.items:
        raise BadInput("the checkpoint holds no parameters to export", where=str(src))
    hf = hf_plan(src, ix, cls, mdict, plan, model_config or {}, out_dtype) if fmt == "hf" else None
    ext = "pt" if fmt == "torch" else "safetensors"
    shards = assign_shards(plan.items, max_shard, ext)
    ess = export_essentials(source, mdict, cls.convention.name, dtype=out_dtype, only=only, rules=rules, tied=plan.tied, fmt=fmt)
    if given:
        ess["ties_given"] = given  # an option, as --dtype: verify re-derives the export with it
    ess.update(export_identity(source, mdict, inspected))
    if hf is not None:
        ess.update(hf_mapping=hf.mapping.describe(), hf_values=hf.values)
    total = sum(it.nbytes for it in plan.items)
    if progress is not None:
        progress.say(f"exporting {describe_bytes(total, len(plan.items), 'tensor')} as {fmt} …")

    needed = _estimate_bytes(shards, "safetensors" if fmt == "hf" else fmt, lambda s: header_metadata(ess, s, plan.copies))
    kept = keep_remote_reads(source.remote, dst, needed)  # a source in a store: its verification reads what the export fetched, here
    estimate = preflight(dst, needed=needed, read_bytes=sum(ix.entries[it.key].nbytes for it in plan.items
                                                             if it.key in ix.entries) or total,
                         sources=[src], force=force, what="the export", progress=progress,
                         stores=[source.remote] if source.remote is not None else [], publish_to=publish_to)
    if kept is not None:
        estimate["read_cache_bytes"] = kept
    with space_errors(dst, needed, "the export"), atomic_directory(dst, overwrite=overwrite, replaceable=why_not_replaceable) as tmp:
        source_keys = [it.key for shard in shards for it in shard if it.key in ix.entries]
        with phase_of(progress, "writing", total) as bar, \
                ix.reading_ahead(source_keys, in_flight=8, memory=256 << 20, label="export"):  # a store: fetched ahead
            for shard in shards:
                if not shard:
                    continue
                path = tmp / shard[0].file
                if fmt == "torch":
                    _write_torch_shard(ix, path, shard, bar)
                else:
                    _write_safetensors_shard(ix, path, shard, header_metadata(ess, shard, plan.copies), bar)
        index = {"metadata": {"total_size": total,
                              "reshard": {**ess, "export_map": export_map(plan.items, plan.copies)}},
                 "weight_map": {it.name: it.file for it in plan.items}}
        index_name = None
        if fmt == "torch":
            index_name = PT_INDEX
        elif len(shards) > 1:
            index_name = ST_INDEX
        if index_name:
            (tmp / index_name).write_text(json.dumps(index, indent=2) + "\n")
        if hf is not None:
            (tmp / HF_CONFIG).write_text(json.dumps(hf.config, indent=2) + "\n")
        with phase_of(progress, "verifying", total) as bar:
            verification = _verify_export(ix, tmp, plan, "torch" if fmt == "torch" else "safetensors", bar)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        report = {
            "report_version": 1,
            "source": source.name,  # a remote source by its URL
            **({"source_store": source.store_reads()} if source.remote is not None else {}),
            "destination": publish_to or str(output_path(dst)),  # a symlink at dst was replaced, not followed
            "format": fmt,
            "dtype": ess["dtype"],
            "only": only,
            "rename": ess["rename"],
            "max_shard_size": max_shard,
            "memory_bound": ("one shard (torch.save needs the dict)" if fmt == "torch" else "largest tensor (streamed)"),
            "essentials": {k: v for k, v in ess.items() if k not in ("tied",)},
            "shards": [s[0].file for s in shards if s],
            "index": index_name,
            "total_size": total,
            "tensors_exported": len(plan.items),
            "tied": plan.tied,
            "warnings": plan.warnings,
            "keys": plan.keys,
            "verification": verification,
            "files": files,
            # no wall time under SOURCE_DATE_EPOCH: reproducible outputs, as convert and import
            "seconds": None if os.environ.get("SOURCE_DATE_EPOCH") else round(_time.time() - started, 3),
        }
        report["estimate"] = estimate
        if profile is not None:
            report["profile"] = profile
        if hf is not None:
            report["hf"] = {"mapping": hf.mapping.describe(), "config": HF_CONFIG, "values": hf.values,
                            "values_from": hf.origin, "transforms": hf.transforms}
        # no measured figure on disk under SOURCE_DATE_EPOCH (free space, probes), as no wall time
        on_disk = {**report, "estimate": None} if os.environ.get("SOURCE_DATE_EPOCH") else report
        (tmp / REPORT).write_text(redact(json.dumps(on_disk, indent=2, default=str)) + "\n")  # no credential, ever
        if not verification["equal"]:
            raise Infeasible("the export does not read back as the source: " + "; ".join(verification["differences"][:5]),
                             where=str(dst), hint="Nothing was committed. This is a bug in reshard; please report it.")
        source.check_unchanged()  # a source in a store: what was read is still what is listed
        commit = start_commit(progress, tmp)  # the fsync and rename as the block exits
    end_commit(progress, commit)
    return report


def _estimate_bytes(shards: list[list[ExportItem]], fmt: str, metadata: Any) -> int:
    """What the shards will hold: tensor bytes, plus each safetensors header (computed exactly, no tensor read)."""
    total = sum(it.nbytes for shard in shards for it in shard)
    if fmt == "safetensors":
        total += sum(len(_st_header(shard, metadata(shard))) for shard in shards if shard)
    return total


def _verify_export(ix, out: Path, plan: ExportPlan, fmt: str, progress: Any = None) -> dict[str, Any]:
    """Read every exported tensor back (one at a time) and compare it bitwise with the cast source."""
    import torch

    diffs: list[str] = []
    if fmt == "safetensors":
        from reshard.storage.checkpoints.safetensors_format import ExportIndex

        ex = ExportIndex(out, keys="stored")

        def back(it: ExportItem) -> torch.Tensor:
            return ex.read_tensor(it.name)
    else:
        loaded: dict[str, dict[str, torch.Tensor]] = {}

        def back(it: ExportItem) -> torch.Tensor:
            if it.file not in loaded:
                loaded.clear()
                loaded[it.file] = torch.load(out / it.file, map_location="cpu", weights_only=True, mmap=True)
            return loaded[it.file][it.name]
    for it in plan.items:
        a = read_cast(ix, it)
        b = back(it)
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(
                a.reshape(-1).view(torch.uint8) if a.dtype != torch.bool else a, 
                b.reshape(-1).view(torch.uint8) if b.dtype != torch.bool else b):
            diffs.append(f"{it.name} ({it.key})")
        del a, b
        if progress is not None:
            progress.update(it.nbytes)
    return {"equal": not diffs, "tensors": len(plan.items), "differences": diffs}
