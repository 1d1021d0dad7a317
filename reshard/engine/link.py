"""``--data link``: a conversion that shares the source's data files with its output instead of copying them.

Whether a plan can be linked, and which files and items are shared, is decided on the plan
alone (`reshard.planning.linking.link_layout`); this module executes it: the source's data
files shared into the output by reflink or hard link (`reshard.storage.files.linkfs`), the linked
items declared where they lie, the keys the plan rewrites or adds written new: a `LinkOutput`,
whose steps `reshard.engine.pipeline.run_conversion` runs in the order every output follows
(verified, reported, refused when it differs, committed). The item checksums of the shared items are the source manifest's own records.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from reshard.errors import BadInput
from reshard.storage.checkpoints.index import CheckpointIndex
from reshard.storage.checkpoints.dcp_writer import CHECKSUM_ALGORITHM, DcpWriter
from reshard.planning import linking
from reshard.model.plan import Plan
from reshard.render.progress import phase_of
from reshard.engine.copy import checked_object, kept_items, write_added
from reshard.engine.pipeline import Output, Run, writing_bytes

if TYPE_CHECKING:
    from reshard.semantics.manifest import Manifest


@dataclass
class LinkOutput(Output):
    """``--data link``: the output's tensor items stay in the source's data files, shared into
    the output by reflink or hard link (`reshard.storage.files.linkfs`); ``.metadata``, the keys the
    plan rewrites or adds, the manifest and the reports are written new (`reshard.planning.linking`).

    Refused (`BadInput`, nothing written) when a tensor needs new bytes, or when the files
    cannot be shared with the destination (another file system, ...), each with its reason and
    ``--data copy`` as the way out. The output is verified against the source as a copy is
    (keys, shapes, dtypes, objects, rewritten state, semantics, the source's recorded
    checksums); the linked tensors' values are not read again: their items are the source's
    bytes at the source's offsets (one inode, or a clone the file system made), which the
    report and the lineage record.
    """

    phase = "linking"
    _layout: Optional[linking.LinkLayout] = field(default=None, init=False, repr=False)
    _names: dict[str, str] = field(default_factory=dict, init=False, repr=False)  # source file -> shared file
    _shared: list = field(default_factory=list, init=False, repr=False)
    _writer: Optional[DcpWriter] = field(default=None, init=False, repr=False)
    _data: dict[str, Any] = field(default_factory=dict, init=False, repr=False)

    def preflight(self, run: Run) -> None:
        """No space check (the output is metadata and the keys that change): whether it can be linked at all."""
        self._layout = linking.link_layout(run.plan, run.ix)
        if not self._layout.available:
            raise BadInput("--data link cannot be used for this conversion: " + "; ".join(self._layout.reasons),
                           where=str(run.source.root),
                           hint="Use --data copy (the default), which writes every byte new.")
        return None

    def write(self, run: Run) -> None:
        self._shared = _share_files(run.source.root, self.dst, run.tmp, self._layout.files)
        self._names = {s.source.name: s.path.name for s in self._shared}
        self._writer = w = DcpWriter(run.tmp, file_name=linking.new_file_namer(set(self._names.values())))
        try:
            with phase_of(run.progress, self.phase, writing_bytes(run.plan, run.ix)) as bar:
                _link_items(run.plan, run.ix, w, self._names, bar)
            w.finish()
        finally:
            w.close()

    def manifest(self, run: Run, manifest: Manifest) -> None:
        """The shared items' checksums are the source manifest's; the lineage says how the files are shared."""
        from reshard.engine.outcome import source_manifest
        from reshard.storage.files.integrity import record

        checksums, carried_records = _linked_checksums(self._writer, source_manifest(run.source.root), self._names)
        manifest.integrity = record(checksums, algorithm=CHECKSUM_ALGORITHM) if checksums is not None else None
        self._data = _data_record(self._shared, self._names, self._layout, carried_records, self._writer)
        manifest.lineage[-1].policies["data_files"] = {k: self._data[k] for k in ("mode", "method", "shared", "note")}

    def verify(self, run: Run) -> dict[str, Any]:
        from reshard.engine.outcome import verify_output

        verification = verify_output(run.source, run.tmp, run.plan, checked=set(self._layout.linked_tensors),
                                     progress=run.progress)
        verification["linked_tensors_by_identity"] = len(self._layout.linked_tensors)
        return verification

    def checksums(self, run: Run) -> dict[str, str]:
        return self._writer.checksums()

    def describe(self, run: Run, report: dict[str, Any]) -> None:
        """The files the output wrote (not the shared ones) and how the shared ones are shared."""
        shared = set(self._names.values())
        report["files"] = {n: sz for n, sz in report["files"].items() if n not in shared}
        report["bytes_written"] = sum(report["files"].values())
        report["data"] = self._data


def _share_files(src: Path, dst: Path, tmp: Path, files: list[str]) -> list:
    from reshard.storage.files.linkfs import LinkRefused, share_file

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
    """Every key of the plan through the writer, in the source's order (`reshard.engine.copy.kept_items`):
    linked items declared where they lie (their file renamed as shared), rewritten and added keys written new."""
    from dataclasses import replace

    for e, _a, t in kept_items(plan, ix, w, progress):
        if t is not None:
            for c in e.chunks:
                w.link_chunk(e.key, c.box.offsets, c.box.sizes, replace(c.location, file=names[c.location.file]))
        else:  # checked as a copy checks it (CRC-32s of its zip, the safe loader), then shared as it is
            checked_object(plan, ix, e)
            w.link_object(e.key, replace(e.location, file=names[e.location.file]), path=e.path or None)
    write_added(plan, ix, w)


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
    from reshard.storage.files.integrity import item_name

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
