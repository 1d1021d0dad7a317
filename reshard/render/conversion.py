"""The Markdown report `reshard convert` writes beside its output (`reshard-report.md`)."""
from __future__ import annotations

from typing import Any

from reshard.render.verify import on_purpose

__all__ = ["conversion_markdown"]


def conversion_markdown(r: dict[str, Any]) -> str:
    """`reshard-report.md`: the conversion report for people (the same facts as `reshard-report.json`)."""
    p = r["plan"]
    v = p["verdict"]
    lines = [
        "# reshard conversion report",
        "",
        f"- source: `{r['source']}` ({_spec(p['source']['topology'])}, step {p['source']['step']})",
        f"- destination: `{r['destination']}` ({_spec(p['target'])})",
        f"- verdict: **{v['kind']}**; experiment id `{r['manifest']['experiment_id']}` ({r['manifest']['continuity']})",
        f"- verification against the source: **{'equal' if r['verification']['equal'] else 'DIFFERENT'}**"
        f" ({r['verification']['compared']['tensors']} tensors, {r['verification']['compared']['objects']} objects compared; "
        f"{on_purpose(r['verification'].get('rewritten', []))})",
        *_write_check_lines(r["verification"]),
        *_resume_lines(r.get("resume")),
        f"- bytes written: {r['bytes_written']} in {len(r['files'])} files, "
        + (f"{r['seconds']} s" if r.get("seconds") is not None else "time not recorded (SOURCE_DATE_EPOCH is set)"),
        "",
    ]
    d = r.get("data") or {}
    if d.get("mode") == "link":
        lines += ["## Data files shared with the source (--data link)", "",
                  f"{d['note']}.", "", f"Item checksums: {d['item_checksums']}.", "",
                  "| file | source file | bytes | how |", "|---|---|---|---|"]
        lines += [f"| `{x['file']}` | `{x['source_file']}` | {x['bytes']} | {x['method']} |" for x in d["shared"]] + [""]
    if r.get("sidecars"):
        lines += ["## Files beside the data (sidecars)", "", "| file | bytes | format | policy | writer |", "|---|---|---|---|---|"]
        lines += [f"| `{s['name']}` | {s['size']} | {s['format']} | {s['policy']} | {s.get('writer') or '-'} |"
                  for s in r["sidecars"]] + [""]
    sl = p.get("slice")
    if sl:  # --layers / --experts: what the slice left out, counted with its bytes
        lines += ["## Slice of the model", "", f"{sl['description']}: {sl['kept']['tensors']} tensors, "
                  f"{sl['kept']['bytes']} bytes kept; {sl['renamed']['keys']} keys renumbered; "
                  f"{sl['dropped']['keys']} keys, {sl['dropped']['bytes']} bytes left out.", "",
                  "| left out | keys | bytes |", "|---|---|---|"]
        lines += [f"| {why} | {d['keys']} | {d['bytes']} |" for why, d in sl["dropped"]["by_reason"].items()] + [""]
    if v.get("kept"):
        lines += ["## What was kept", "", "| state | status | note |", "|---|---|---|"]
        lines += [f"| {facet.replace('_', ' ')} | {k['status']} | {k['note']} |" for facet, k in v["kept"].items()] + [""]
    if v["warm_start_reasons"] or v["changes"]:
        lines += ["## What changes", ""] + [f"- {c}" for c in v["warm_start_reasons"] + v["changes"]] + [""]
    b = p["batch"]
    if b["before"] and b["after"]:
        lines += ["## Batch recipe", "", "| | micro-batch | accumulation | dp | global batch |", "|---|---|---|---|---|",
                  f"| before | {b['before']['micro_batch']} | {b['before']['grad_accum']} | {b['before']['dp']} | {b['before']['global_batch']} |",
                  f"| after | {b['after']['micro_batch']} | {b['after']['grad_accum']} | {b['after']['dp']} | {b['after']['global_batch']} |", ""]
    lines += ["## Trainer state", ""]
    if p["schedule"]:
        lines.append(f"- LR schedule: {p['schedule']['policy']}: {p['schedule']['note']}")
    if p["data"]:
        lines.append(f"- data position: {p['data']['policy']}: {p['data']['note']}")
        for r in p["data"].get("resume") or []:  # a dataset position translated: where each new rank resumes
            lines.append(f"  - new rank {r['rank']}: stream position {r['position']}"
                         + (f" of shard {r['shard']}" if r["shard"] else "")
                         + f", reads examples {', '.join(map(str, r['first_examples']))}, ...; "
                         f"{r['buffered_tokens']} buffered tokens")
        if p["data"].get("proof"):
            pr = p["data"]["proof"]
            lines.append(f"  - proof: {pr['consumed_before']} examples read before, {pr['consumed_after']} read by no new rank, "
                         f"{pr['read_twice']} read twice; requires: {p['data']['requires']}")
    if p["rng"]:
        lines.append(f"- RNG: {p['rng']['policy']}: {p['rng']['note']}")
    lines += ["", "## Every source key", "", "| key | role | action | why |", "|---|---|---|---|"]
    for k in p["keys"]:
        moved = "".join(f" ({w} `{k[f]}`)" for w, f in (("from", "renamed_from"), ("to", "renamed_to")) if k.get(f))
        lines.append(f"| `{k['key']}` | {k['role']} | {k['action']} | {k['reason']}{moved} |")
    lines.append("")
    return "\n".join(lines)


def _write_check_lines(verification: dict[str, Any]) -> list[str]:
    wc = verification.get("write_checks")
    if not wc:
        return []
    return [f"- items checked as they were written: {wc['items_against_source_crc']} by CRC-32 against the "
            f"source items' records (direct copies), {wc['items_read_back']} read back and compared bitwise; "
            f"{wc.get('items_compared_after_writing', 0)} compared with the source after writing"]


def _resume_lines(resume: dict[str, Any] | None) -> list[str]:
    """What a resumed run kept: only items it compared, in this run, with what it writes from the source now."""
    if not resume or not resume.get("resumed"):
        return []
    return [f"- resumed an interrupted run: {resume['items_kept']} of {resume['items']} items kept, each compared in "
            f"this run with the bytes it writes from the source as it is now; "
            f"{resume.get('items_not_matching_source', 0)} no longer matched the source and "
            f"{resume.get('items_damaged', 0)} were damaged (both rewritten)"]


def _spec(t: dict[str, Any]) -> str:
    return ",".join(f"{d}={t[d]}" for d in ("pp", "dp_replicate", "dp_shard", "cp", "tp") if t.get(d, 1) != 1) or "dp=1"
