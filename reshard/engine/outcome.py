"""The helpers of a conversion's end: carry the sidecars, verify the output against the source,
build and write the reports, refuse a difference.

Every output kind ends the same way, inside the atomic temporary directory and before its
rename, in the order `reshard.engine.pipeline.run_conversion` alone decides: the same
verification (`verify_output`), the same report (`build_report`) written as JSON and Markdown
(`write_reports`, two write events of the fault hook, see `reshard.engine.conversion`), and the
same refusal when the output differs from the source (`refuse_if_different`: nothing is
committed). The helpers sit apart from the order so that an output kind may use one (a
distributed worker verifies its own files with `verify_output`) without importing the pipeline.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from reshard.errors import Infeasible
from reshard.units import reproducible
from reshard.planning.plan import plan_reader, source_inspection
from reshard.storage.checkpoints.index import CheckpointIndex
from reshard.render.redaction import redact
from reshard.storage.checkpoints import sidecars
from reshard.storage.files.atomic import fault_point, output_path
from reshard.storage.source import Source
from reshard.model.kinds import EXPECTED_DIFFERENCES
from reshard.model.plan import Plan
from reshard.render.conversion import conversion_markdown

REPORT_JSON = "reshard-report.json"
REPORT_MD = "reshard-report.md"


def refuse_if_different(verification: dict[str, Any], dst: Path) -> None:
    """Nothing is committed when the output differs from the source (exit 3 names the first differences)."""
    if not verification["equal"]:
        raise Infeasible("the converted checkpoint does not match the source: "
                         + "; ".join(f"{d['key']}: {d['detail']}" for d in verification["differences"][:5]),
                         where=str(dst), hint="Nothing was committed. This is a bug in reshard; please report it.")


def carry_sidecars(plan: Plan, ix: CheckpointIndex, src: Path, tmp: Path) -> list[dict[str, Any]]:
    """Every sidecar the plan listed, copied byte-identical into the output before it is committed.

    A trainer's own files beside the DCP part (Lightning's `meta.pt`, ...) are data: dropping
    them would leave an output the trainer cannot load (`reshard.storage.checkpoints.sidecars`).
    """
    return sidecars.carry_sidecars(src, tmp, sidecars.claimed_names(ix), plan.source.get("sidecars"), getattr(ix, "remote", None))


def write_reports(tmp: Path, report: dict[str, Any]) -> None:
    """Both reports, each a write event; under SOURCE_DATE_EPOCH with no wall time in them."""
    # no measured figure under SOURCE_DATE_EPOCH: neither the wall time nor the estimate (free space, probes)
    on_disk = {**{k: v for k, v in report.items() if k != "estimate"}, "seconds": None} if reproducible() else report
    if reproducible() and "resume" in report:
        on_disk = {**on_disk, "resume": None}  # a resumed run writes the reports an uninterrupted one does
    (tmp / REPORT_JSON).write_text(redact(json.dumps(on_disk, indent=2, default=str)) + "\n")  # no credential, ever
    fault_point("report.json")
    (tmp / REPORT_MD).write_text(redact(conversion_markdown(on_disk)))
    fault_point("report.md")


def source_manifest(src: Path) -> dict[str, Any] | None:
    from reshard.semantics.manifest import read_manifest

    m = read_manifest(src)
    return m.to_dict() if m is not None else None


def verify_output(source: Source, out: Path, plan: Plan, b_files: set[str] | None = None,
                  checked: set[str] | None = None, progress: Any = None,
                  write_checks: dict[str, int] | None = None) -> dict[str, Any]:
    """The post-write verification: the output against the source, in global terms.

    ``checked``: keys whose every written chunk was already checked against the source while
    the copy ran (`reshard.engine.splice`: CRC-32 against the source items' records, or read
    back and compared bitwise); their values are not compared a second time (keys, shapes,
    dtypes, objects and semantics still are). ``write_checks``: how many items each kind of
    check covered while writing (`reshard.engine.copy.WriteChecks.summary`), recorded as such.
    """
    from reshard.verification.checkpoints import check_transforms, verify_checkpoints

    expected = {a.key: f"{a.action}: {a.reason}" for a in plan.keys if a.action in EXPECTED_DIFFERENCES}
    src_ix = plan_reader(plan, source)
    src_dtypes = {k: e.dtype_name for k, e in src_ix.entries.items() if e.is_tensor}
    for t in plan.tensors:
        if t.transform:
            expected[t.key] = "TP-dependent layout rewritten (checked in canonical form)"
        elif src_dtypes.get(t.key) not in (None, t.dtype):
            expected[t.key] = f"cast to {t.dtype} for a reduced copy (checked equal to the source cast)"
    extra = {"b_files": b_files} if b_files is not None else {}
    # The output's item checksums were composed while writing (tests check them against a
    # full recomputation); here its bytes are compared with the source, and the source's own
    # checksums (if it records any) are checked.
    result = verify_checkpoints(source, out, expected_rewrites=expected, trust_pickle=plan.options.trust_pickle,
                                check_integrity="a", values_checked=checked, progress=progress,
                                a_inspection=source_inspection(plan, source), **extra)
    result["checked_while_writing"] = len(checked or ())
    if write_checks is not None:
        result["write_checks"] = write_checks
    bad = check_transforms(source, out, plan, b_files=b_files)
    result["transforms_checked"] = sum(1 for t in plan.tensors if t.transform or t.copy_from)
    for k in bad:
        result["differences"].append({"key": k, "kind": "value", "detail": "canonical form differs from the source"})
        result["equal"] = False
    return result


def build_report(plan: Plan, source: Source, dst: Path, tmp: Path, verification: dict[str, Any],
                 manifest: dict[str, Any], checksums: dict[str, str], seconds: float,
                 published: str | None = None) -> dict[str, Any]:
    """The fields every conversion report has; an output adds its own after them. ``published``:
    the store URL the output at ``dst`` is uploaded to, which the report names as its destination."""
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.name.endswith(".distcp")}
    return {
        "report_version": 1,
        "source": source.name,  # a remote source by its URL
        **({"source_store": source.store_reads()} if source.remote is not None else {}),  # what it fetched
        "destination": published or str(output_path(dst)),  # a symlink at dst was replaced, not followed
        "plan": plan.to_dict(tensors=False),
        "verification": verification,
        "manifest": {"experiment_id": manifest["experiment_id"], "continuity": manifest["continuity"],
                     "lineage_entry": manifest["lineage"][-1]},
        "files": files,
        "bytes_written": sum(files.values()),
        "item_checksums": len(checksums),
        "seconds": round(seconds, 3),
    }
