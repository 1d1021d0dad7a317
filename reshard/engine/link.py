"""``--data link``: a conversion that shares the source's data files with its output instead of copying them.

Whether a plan can be linked, and which files and items are shared, is decided on the plan
alone (`reshard.planning.linking.link_layout`); this module executes it: the source's data
files shared into the output by reflink or hard link (`reshard.storage.linkfs`), the linked
items declared where they lie, the keys the plan rewrites or adds written new, and the
output ended as a copy is (`reshard.engine.outcome`: verified, reported, refused when it
differs). The item checksums of the shared items are the source manifest's own records.
"""
from __future__ import annotations

import time as _time
from pathlib import Path
from typing import Any

from reshard.errors import BadInput, Infeasible
from reshard.model.dtypes import dtype_named, is_torch_tensor
from reshard.units import now_text
from reshard.storage.index import CheckpointIndex
from reshard.storage.integrity import record as integrity_record
from reshard.storage.dcp import check_loadable
from reshard.storage import dcp as dcp_io
from reshard.storage.atomic import atomic_directory, fault_point
from reshard.storage.replaceable import why_not_replaceable
from reshard.storage.dcp_writer import CHECKSUM_ALGORITHM, DcpWriter
from reshard.semantics.manifest import write_manifest
from reshard.planning import linking
from reshard.model.plan import Plan
from reshard.semantics.transition import output_manifest
from reshard.render.progress import phase_of
from reshard.engine.copy import writing_bytes
from reshard.engine.outcome import (build_report, carry_sidecars, refuse_if_different, source_manifest, verify_output,
                                    write_reports)


def convert_link(plan: Plan, src: Path, dst: Path, ix: CheckpointIndex, *, overwrite: bool = False,
                 progress: Any = None) -> dict[str, Any]:
    """``--data link``: the output's tensor items stay in the source's data files, shared into
    the output by reflink or hard link (`reshard.storage.linkfs`); ``.metadata``, the keys the
    plan rewrites or adds, the manifest and the reports are written new (`reshard.planning.linking`).

    Refused (`BadInput`, nothing written) when a tensor needs new bytes, or when the files
    cannot be shared with the destination (another file system, ...), each with its reason and
    ``--data copy`` as the way out. The output is built in the atomic temporary directory and
    verified against the source as a copy is (keys, shapes, dtypes, objects, rewritten state,
    semantics, the source's recorded checksums); the linked tensors' values are not read again:
    their items are the source's bytes at the source's offsets (one inode, or a clone the file
    system made), which the report and the lineage record.
    """
    started = _time.time()
    stamp = now_text()
    layout = linking.link_layout(plan, ix)
    if not layout.available:
        raise BadInput("--data link cannot be used for this conversion: " + "; ".join(layout.reasons),
                       where=str(src), hint="Use --data copy (the default), which writes every byte new.")
    with atomic_directory(dst, overwrite=overwrite, replaceable=why_not_replaceable) as tmp:
        for key, equal_to in plan.checks.items():
            from reshard.storage.index import bitwise_equal

            if not bitwise_equal(ix, key, equal_to):
                raise Infeasible(f"tied copies '{key}' and '{equal_to}' differ: the target would keep one of them silently",
                                 where=str(src), hint="Inspect the source: tied weights and their optimizer state must be equal.")
        shared = _share_files(src, dst, tmp, layout.files)
        names = {s.source.name: s.path.name for s in shared}
        w = DcpWriter(tmp, file_name=linking.new_file_namer(set(names.values())))
        try:
            with phase_of(progress, "linking", writing_bytes(plan, ix)) as bar:
                _link_items(plan, ix, w, names, bar)
            w.finish()
        finally:
            w.close()
        carried = carry_sidecars(plan, ix, src, tmp)
        src_manifest = source_manifest(src)
        manifest = output_manifest(plan, src_manifest, time=stamp)
        checksums, carried_records = _linked_checksums(w, src_manifest, names)
        manifest.integrity = integrity_record(checksums, algorithm=CHECKSUM_ALGORITHM) if checksums is not None else None
        data = _data_record(shared, names, layout, carried_records, w)
        manifest.lineage[-1].policies["data_files"] = {k: data[k] for k in ("mode", "method", "shared", "note")}
        write_manifest(tmp, manifest)
        fault_point("manifest")
        verification = verify_output(src, tmp, plan, checked=set(layout.linked_tensors), progress=progress)
        verification["linked_tensors_by_identity"] = len(layout.linked_tensors)
        verification["b"] = str(dst)
        report = build_report(plan, src, dst, tmp, verification, manifest.to_dict(), w.checksums(), _time.time() - started)
        report["files"] = {n: sz for n, sz in report["files"].items() if n not in set(names.values())}
        report["bytes_written"] = sum(report["files"].values())
        report["data"] = data
        report["sidecars"] = carried
        write_reports(tmp, report)
        refuse_if_different(verification, dst, "the linked checkpoint")
    return report


def _share_files(src: Path, dst: Path, tmp: Path, files: list[str]) -> list:
    from reshard.storage.linkfs import LinkRefused, share_file

    out = []
    for name in files:
        try:
            out.append(share_file(src / name, tmp / linking.linked_name(name), root=src))
        except LinkRefused as exc:
            where = "the destination's file system" if exc.cross_device else "this file system"
            raise BadInput(f"--data link cannot share the source's data file '{name}' with the destination "
                           f"({'; '.join(f'{m}: {r}' for m, r in exc.reasons.items())})", where=str(dst),
                           hint=f"Nothing was written. Sharing needs reflinks or hard links on {where}: put DST on "
                                "the source's file system (the same mount), or use --data copy.") from None
    return out


def _link_items(plan: Plan, ix: CheckpointIndex, w: DcpWriter, names: dict[str, str], progress: Any) -> None:
    """Every key of the plan through the writer, in the source's order: linked items declared
    where they lie (their file renamed as shared), rewritten and added keys written new."""
    from dataclasses import replace

    planned = {t.key: t for t in plan.tensors}
    actions = {a.key: a for a in plan.keys}
    for key, e in ix.entries.items():
        a = actions[key]
        if a.action == "dropped":
            continue
        if e.is_tensor:
            t = planned[key]
            w.declare_tensor(key, t.shape, dtype_named(t.dtype), path=e.path or None)
            if a.action == "rewritten":
                w.write_chunk(t.chunks[0][0], key, t.chunks[0][1], plan.new_values[key])
            else:
                for c in e.chunks:
                    w.link_chunk(key, c.box.offsets, c.box.sizes, replace(c.location, file=names[c.location.file]))
        elif a.action == "rewritten":
            w.write_object(a.rank or 0, key, plan.new_values[key], path=e.path or None)
        else:  # checked as a copy checks it (CRC-32s of its zip, the safe loader), then shared as it is
            where = str(ix.root / e.location.file)
            raw = dcp_io.checked_item_bytes(ix.root, e.location, key=key)
            check_loadable(raw, key=key, where=where, trust_pickle=plan.options.trust_pickle)
            w.link_object(key, replace(e.location, file=names[e.location.file]), path=e.path or None)
        if progress is not None:  # by bytes (`writing_bytes` is the total)
            progress.update(e.nbytes)
    for a in plan.keys:
        if a.action != "added":
            continue
        v = plan.new_values[a.key]
        if is_torch_tensor(v):
            w.declare_tensor(a.key, tuple(v.shape), v.dtype)
            w.write_chunk(a.rank or 0, a.key, tuple(0 for _ in v.shape), v)
        else:
            w.write_object(a.rank or 0, a.key, v)


def _linked_checksums(w: DcpWriter, src_manifest: dict[str, Any] | None,
                      names: dict[str, str]) -> tuple[dict[str, str] | None, int | None]:
    """The output's item checksums, or None when some shared item has none.

    The writer's own items have theirs; a shared item's is the source manifest's record (the
    same bytes at the same offset, its file renamed) when the source records CRC-32s. When
    the source records none for a shared item, the output records none at all (as a
    checkpoint from `dcp.save` records none): a record covering only some items would read as
    ``.metadata`` changed after the manifest, and hashing the shared items would read every
    byte the link saved. Each item's own zip CRC-32s still cover its bytes (`inspect --deep`).
    Returns (checksums or None, how many were taken from the source, or None).
    """
    from reshard.storage.integrity import item_name

    rec = (src_manifest or {}).get("integrity") or {}
    recorded = dict(rec.get("items") or {}) if rec.get("algorithm") == CHECKSUM_ALGORITHM else {}
    back = {new: old for old, new in names.items()}
    out = w.checksums()
    n = 0
    for loc in w.locations().values():
        if loc.file not in back:
            continue
        digest = recorded.get(item_name(back[loc.file], loc.offset))
        if digest is None:
            return None, None
        out[item_name(loc.file, loc.offset)] = digest
        n += 1
    return out, n


def _data_record(shared: list, names: dict[str, str], layout: linking.LinkLayout, carried_records: int,
                 w: DcpWriter) -> dict[str, Any]:
    methods = sorted({s.method for s in shared})
    method = methods[0] if len(methods) == 1 else ("mixed: " + ", ".join(methods) if methods else "none")
    return {
        "mode": "link",
        "method": method,
        "shared": [{"file": s.path.name, "source_file": s.source.name, "bytes": s.size, "method": s.method}
                   for s in shared],
        "shared_bytes": sum(s.size for s in shared),
        "linked_tensors": len(layout.linked_tensors),
        "linked_objects": len(layout.linked_objects),
        "written_keys": len(layout.new),
        "written_files": sorted({loc.file for loc in w.locations().values() if loc.file not in set(names.values())}),
        "item_checksums": ("none recorded: the source records none for the shared items (each item's zip CRC-32s "
                           "still cover its bytes)" if carried_records is None else
                           f"{carried_records} shared items' checksums taken from the source's manifest, "
                           f"{len(w.checksums())} computed for the items written"),
        "note": linking.SHARED_NOTE + (". A rewritten or dropped key's old bytes stay in the shared files; the new "
                                       ".metadata does not point at them"),
    }
