"""Render command results for people (terminal text) and scripts (JSON).

Reports are plain dicts produced by the library; this module only formats them.
"""
from __future__ import annotations

import itertools
import json
import secrets
from json.encoder import encode_basestring_ascii
from typing import Any

from reshard.units import human_bytes
from reshard.model.kinds import Action
from reshard.render.verify import on_purpose


def to_json(report: dict[str, Any]) -> str:
    """``json.dumps(report, indent=2, default=str)``, its pieces joined a batch at a time, and its
    long lists of flat rows written by templates.

    Why not ``json.dumps``: with ``indent`` it encodes in Python and joins a list of every piece,
    at 180k keys 4 M small strings, 89 MiB at the plan's peak for an 18 MB text; here at most
    `_BATCH` pieces are held, then one string per batch. Same encoder, same pieces, same text.
    A top-level list of rows (dicts of strings, ints, booleans and None: the plan's ``keys``, one
    row per source key) is written by `_rows` instead, the same text a row at a time (180k keys:
    0.1 s where the encoder's pieces took 0.3 s); the encoder writes a placeholder there."""
    rows: dict[str, str] = {}
    if isinstance(report, dict):
        for name, value in report.items():
            if isinstance(value, list) and len(value) >= _ROWS_FROM:
                text = _rows(value)
                if text is not None:
                    rows[name] = text
    by_piece: dict[str, str] = {}
    if rows:  # each list a string the encoder writes as one piece (a token no report holds), then its rows' text
        token = secrets.token_hex(16)
        marks = {name: f"\x00reshard rows {token} {i}\x00" for i, name in enumerate(rows)}
        by_piece = {encode_basestring_ascii(marks[name]): text for name, text in rows.items()}
        report = {name: marks[name] if name in rows else value for name, value in report.items()}
    pieces = json.JSONEncoder(indent=2, sort_keys=False, default=str).iterencode(report)
    parts: list[str] = []
    while batch := list(itertools.islice(pieces, _BATCH)):
        if by_piece:
            batch = [by_piece.get(p, p) for p in batch]
        parts.append("".join(batch))
    return "".join(parts)


_ROWS_FROM = 256  # shorter lists: the encoder's pieces cost less than a pass over the rows
_ROW_OPEN, _ROW_FIELD, _ROW_CLOSE = "{\n      ", ",\n      ", "\n    }"  # a row at indent level 2, its fields at 3


def _rows(value: list[Any]) -> str | None:
    """The text ``json.dumps(..., indent=2)`` writes for ``value`` as the value of a top-level key,
    when every item is a dict of str keys to str, int, bool or None; else None (the encoder writes it)."""
    enc = encode_basestring_ascii
    out: list[str] = []
    for row in value:
        if row.__class__ is not dict:
            return None
        if not row:
            out.append("{}")
            continue
        fields = []
        for k, v in row.items():
            if not isinstance(k, str):
                return None
            if isinstance(v, str):
                t = enc(v)
            elif v is None:
                t = "null"
            elif v is True:
                t = "true"
            elif v is False:
                t = "false"
            elif isinstance(v, int):
                t = int.__repr__(v)
            else:
                return None
            fields.append(enc(k) + ": " + t)
        out.append(_ROW_OPEN + _ROW_FIELD.join(fields) + _ROW_CLOSE)
    return "[\n    " + ",\n    ".join(out) + "\n  ]" if out else "[]"


_BATCH = 65_536


def _topo_line(t: dict[str, Any]) -> str:
    dims = [f"{d}={t[d]}" for d in ("pp", "dp_replicate", "dp_shard", "cp", "tp") if t.get(d, 1) != 1] or ["dp=1"]
    line = f"{', '.join(dims)} (world size {t.get('world_size')}, {t.get('source')})"
    if t.get("ambiguous"):
        line = f"AMBIGUOUS: one of {' | '.join(t['alternatives'])}; pass --from (shown: {line})"
    return line


def sidecar_lines(entries: list[dict[str, Any]], *, verb: str) -> list[str]:
    """One line per file beside the DCP data (``verb``: what happened to it), so none goes unmentioned."""
    return [f"sidecar     {s['name']} ({s['size']:,} B, {s['format']}, {s['policy']}): {verb}; {s.get('writer') or 'unknown writer'}"
            for s in entries]


def _said_by(profile: dict[str, Any] | None, trainer: dict[str, Any] | None) -> list[str]:
    """One line per file that said what the checkpoint could not: which file, its hash, what it gave."""
    out = []
    for label, rec in (("profile", profile), ("trainer cfg", trainer)):
        if rec:
            gave = ", ".join(rec.get("contributed") or []) or "nothing the command line did not already say"
            out.append(f"{label:<12}{rec['file']} (sha256 {str(rec['sha256'])[:12]}): {gave}")
    return out


def render_inspect(r: dict[str, Any], *, verbose: bool = False) -> str:
    """``reshard inspect`` for a person; ``verbose`` adds how an inferred topology was read from the chunks."""
    out: list[str] = []
    verdict = "complete" if r["complete"] else "INCOMPLETE"
    if r["complete"] and not r["consistent"]:
        verdict = "complete but INCONSISTENT"
    elif r["complete"]:
        verdict = "complete and consistent"
    out.append(f"checkpoint  {r['path']}")
    out.extend(_said_by(r.get("profile"), None))
    out.append(f"verdict     {verdict}")
    out.append(f"experiment  {r.get('experiment_id') or '-'}   continuity: {r.get('continuity') or '-'}")
    out.append(f"step        {r.get('step') if r.get('step') is not None else '-'}"
               + (f" (from {r['step_source']})" if r.get("step_source") else "")
               + f"   tokens seen: {r.get('tokens_seen') if r.get('tokens_seen') is not None else '-'}")
    out.append(f"topology    {_topo_line(r['topology'])}; {r['writer_ranks']} writer rank(s)")
    if verbose or r["topology"].get("ambiguous"):  # the chunk counts behind an inference: detail, unless it is in doubt
        for ev in r["topology"].get("evidence", []):
            out.append(f"            - {ev}")
    b = r.get("batch")
    if b:
        out.append(f"batch       {_batch_words(b)}")
    acc = r.get("accumulation")
    if acc:
        phase = "at an optimizer-step boundary" if not acc.get("micro_step") else f"mid-accumulation (micro-step {acc['micro_step']})"
        out.append(f"accum phase {phase}")
    version = r.get("dcp_version") or "?"
    fmt = f"DCP {version}" if version[:1].isdigit() or version == "?" else version  # exports/local outputs name themselves
    out.append(f"convention  {r['convention']['name']}   manifest: {'yes' if r['manifest'] else 'no'}   format: {fmt}")
    out.append(f"contents    {r['entries']} entries, {r['items']} items in {r['files']} files, {human_bytes(r['bytes'])} on disk")
    out.append("")
    out.append(f"  {'role':<18}{'count':>8}{'bytes':>12}  dtypes")
    for role, s in sorted(r["by_role"].items(), key=lambda kv: -kv[1]["bytes"]):
        dts = ", ".join(f"{d} x{v['count']}" for d, v in s["dtypes"].items())
        out.append(f"  {role:<18}{s['count']:>8}{human_bytes(s['bytes']):>12}  {dts}")
    out.append("")
    o = r["optimizer"]
    sets = o.get("moment_sets") or []
    if o["moment_names"]:
        what = moment_sets_text(sets) if len(sets) > 1 else ", ".join(o["moment_names"])
        out.append(f"optimizer   moments {what} ({o['with_moments']} of {o['parameters']} parameters)" if len(sets) > 1 else
                   f"optimizer   moments {what} for {o['with_moments']} of {o['parameters']} parameters")
        out[-1] += ("; missing for " + ", ".join(o["missing_moments"][:5]) if o["missing_moments"]
                    else "; every trainable parameter covered")
    else:
        out.append("optimizer   no moments (a resume from here is a warm start)")
    sc = o["step_counters"]
    if sc["count"]:
        out.append(f"            step counters: {sc['count']}, " + (f"one value {sc['values'][0]}" if sc["consistent"] else f"DISAGREE {sc['values']}"))
    for t in o["tied"]:
        eq = {True: "bitwise equal", False: "DIFFER", None: t.get("note", "-")}[t.get("equal")]
        out.append(f"            tied ({t['source']}): {' = '.join(t['names'])}: {eq}")
    for role, info in r["per_rank_state"].items():
        if info["keyed_per_rank"]:
            miss = f"; missing ranks {info['missing_ranks']}" if info.get("missing_ranks") else ""
            out.append(f"per-rank    {role}: keyed per rank, ranks {_ranges(info['ranks'])}{miss}")
        else:
            out.append(f"per-rank    {role}: one shared copy ({info['keys']} keys)")
    out += sidecar_lines(r.get("sidecars") or [], verb="listed")
    fused = o.get("fused") or []
    if fused:
        out.append(f"fused       {len(fused)} optimizer entries of fused parameters mapped to their saved parts "
                   f"(e.g. {fused[0]['optimizer']} = {' + '.join(fused[0]['parts'])})")
    if o.get("buffers"):
        out.append(f"buffers     {len(o['buffers'])} entries expect no moments: "
                   + ", ".join(f"{b} ({why})" for b, why in list(o["buffers"].items())[:4]) + (" ..." if len(o["buffers"]) > 4 else ""))
    if r["unknown_keys"]:
        out.append(f"unknown     {len(r['unknown_keys'])} keys: " + ", ".join(r["unknown_keys"][:8]) + (" ..." if len(r["unknown_keys"]) > 8 else ""))
    if r["problems"]:
        out.append("")
        out.append("problems")
        for p in r["problems"]:
            where = f" [{p['file']}]" if p.get("file") else ""
            keys = p.get("keys") or []
            ks = (": " + ", ".join(keys[:6]) + (f" (+{len(keys) - 6} more)" if len(keys) > 6 else "")) if keys else ""
            out.append(f"  {p['severity']:<12} {p['message']}{where}{ks}")
    for n in r.get("notes", []):
        out.append(f"note        {n['message']}")
    return "\n".join(out)


def moment_sets_text(sets: list[dict[str, Any]]) -> str:
    """The optimizer's moment sets in words: ``momentum_buffer for 2 parameters (group 0); exp_avg, exp_avg_sq
    for 4 (group 1)`` (one optimizer per group: Muon for the matrices, AdamW for the rest)."""
    parts = []
    for i, r in enumerate(sets):
        groups = r.get("groups") or []
        where = f" ({'group' if len(groups) == 1 else 'groups'} {', '.join(groups)})" if groups else ""
        parts.append(f"{', '.join(r['moments'])} for {r['parameters']}{' parameters' if i == 0 else ''}{where}")
    return "; ".join(parts)


def _ranges(xs: list[int]) -> str:
    if not xs:
        return "-"
    parts, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:  # type: ignore[list-item]
        if x is not None and x == prev + 1:
            prev = x
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(parts)


def _spec(t: dict[str, Any]) -> str:
    return ",".join(f"{d}={t[d]}" for d in ("pp", "dp_replicate", "dp_shard", "cp", "tp") if t.get(d, 1) != 1) or "dp=1"


# A decision's policy name (the JSON's) where the text needs other words: "unknown" for a schedule
# kept as saved would read as if its state were lost.
_SCHEDULE_WORDS = {"unknown": "unchecked"}


def render_plan(p: dict[str, Any], *, verbose: bool = False) -> str:
    """``reshard plan`` for a person: the verdict, what is carried or dropped and where bytes go;
    ``verbose`` adds per-tensor placements, per-rank memory and how ``--data link`` would read."""
    out: list[str] = []
    s, t = p["source"], p["target"]
    out.append(f"source      {s['path']}")
    out.append(f"            {_spec(s['topology'])} (world size {s['topology']['world_size']}, {s['topology']['source']}), "
               f"step {s['step']}, convention {s['convention']}")
    out.append(f"target      {_spec(t)} (world size {t['world_size']})")
    out.extend(_said_by(p["options"].get("profile"), p["options"].get("trainer_config")))
    b = p["batch"]
    if b["before"]:
        bb = b["before"]
        out.append(f"batch       before: micro-batch {bb['micro_batch']} x accumulation {bb['grad_accum']} x dp {bb['dp']} = {bb['global_batch']}")
    if b["after"]:
        ba = b["after"]
        out.append(f"            after:  micro-batch {ba['micro_batch']} x accumulation {ba['grad_accum']} x dp {ba['dp']} = {ba['global_batch']}"
                   + ("  (global batch kept)" if b["kept"] else ""))
    if b["note"]:
        out.append(f"            {b['note']}")
    for a in b["alternatives"]:
        out.append(f"            choice: micro-batch {a['micro_batch']} x accumulation {a['grad_accum']} x dp {a['dp']} = {a['global_batch']}")
    if p["schedule"]:
        sc = p["schedule"]
        out.append(f"schedule    {_SCHEDULE_WORDS.get(sc['policy'], sc['policy'])}: {sc['note']}")
        for k, v in sc["rewrites"].items():
            out.append(f"            {k}: {v['old']} -> {v['new']}")
    if p["data"]:
        d = p["data"]
        extra = ""
        if d["repeated"] is not None:
            extra = f" (repeated: {d['repeated']}, skipped: {d['skipped']})"
        out.append(f"data        {d['policy']}: {d['note']}{extra}")
        out += _resume_lines(d)
    if p["rng"]:
        r = p["rng"]
        out.append(f"rng         {r['policy']}: {r['note']}")
    acc = p["accumulation"]
    out.append(f"accum phase {acc['note']}")
    if p.get("slice"):  # --layers / --experts: the slice's size before anything is written
        sl = p["slice"]
        out.append(f"slice       {sl['description']}: {sl['kept']['tensors']} tensors, {human_bytes(sl['kept']['bytes'])} "
                   f"(source {human_bytes(s['bytes'])}); left out {sl['dropped']['keys']} keys, "
                   f"{human_bytes(sl['dropped']['bytes'])}; {sl['renamed']['keys']} keys renumbered")
    if p.get("experts"):  # MoE: which ranks hold which stacked experts, before and after
        out.append(f"experts     {p['experts']['text']}")
        out.append(f"            {p['experts']['note']}")
    m = p["memory"]
    out.append(f"memory      per rank max {human_bytes(m['max'])}, min {human_bytes(m['min'])} "
               "(parameters + gradients + optimizer state)")
    if verbose:
        for row in m["per_rank"]:
            out.append(f"            rank {row['rank']}: params {human_bytes(row['parameters'])}, grads {human_bytes(row['gradients'])}, "
                       f"optimizer {human_bytes(row['optimizer'])}, other {human_bytes(row['other'])}")
    out += data_link_lines(p.get("data_link"), verbose=verbose)
    # a slice's renumbered keys: "renamed" on both sides of each rename (the key the values leave, with
    # `renamed_to`, and the key they arrive at, with `renamed_from`), counted once per rename
    renames = sum(1 for k in p["keys"] if k.get("renamed_to"))
    summ = ", ".join(f"{renames} renamed ({n} keys, old and new names)" if a == Action.RENAMED else f"{n} {a}"
                     for a, n in sorted(p["summary"].items()) if n)
    out.append(f"keys        {summ}")
    groups: dict[tuple[str, str], list[str]] = {}
    for k in p["keys"]:
        if k["action"] == Action.RENAMED and (k.get("renamed_to") or verbose):  # listed by the name it leaves
            groups.setdefault(("renamed", k["reason"]), []).append(k["key"])
        elif k["action"] in (Action.DROPPED, Action.ADDED) or (verbose and k["action"] == Action.REWRITTEN):
            groups.setdefault((k["action"], k["reason"]), []).append(k["key"])
    for (action, reason), keys in groups.items():
        more = f" (+{len(keys) - 1} keys)" if len(keys) > 1 else ""
        out.append(f"            {action:<9} {keys[0]}{more}: {reason}")
    if verbose and "tensors" in p:
        out.append("")
        out.append(f"  {'tensor':<52}{'global shape':<16}{'placement':<36}writer rank: local shape")
        for tp in p["tensors"]:
            locs = ", ".join(f"r{c['rank']}:{c['sizes']}" for c in tp["chunks"])
            flag = "  (uneven)" if tp.get("uneven") else ""
            out.append(f"  {tp['key']:<52}{str(tp['shape']):<16}{tp['placement']:<36}{locs}{flag}")
    v = p["verdict"]
    out.append("")
    kind = v['kind'].replace('_', ' ').upper()
    if v.get("warm_start_of") and v["kind"] == "warm_start" and "model" in v["warm_start_of"]:
        kind += " of a different model (a slice of the source)"
    elif v.get("warm_start_of") and v["kind"] == "warm_start":
        kind += " of the " + " and ".join(f.replace("_", " ") for f in v["warm_start_of"]) + " only"
    out.append(f"verdict     {kind}")
    for facet, k in (v.get("kept") or {}).items():
        out.append(f"  {facet.replace('_', ' '):<19}{k['status']:<10}{k['note']}")
    for r_ in p["reasons"]:
        out.append(f"  infeasible: {r_}")
    for w in v["warm_start_reasons"]:
        out.append(f"  warm start: {w}")
    for c in v["changes"]:
        out.append(f"  change: {c}")
    out += sidecar_lines(p["source"].get("sidecars") or [], verb="carried byte-identical")
    out.append(f"fingerprint {p['fingerprint']}")
    return "\n".join(out)


def _resume_lines(d: dict[str, Any]) -> list[str]:
    """A dataset position translated to new ranks: where each resumes, what it reads first, and the proof."""
    if not d.get("resume"):
        return []
    out = []
    for r in d["resume"]:
        shard = f" of shard {r['shard']}" if r["shard"] else ""
        n = r["buffered_tokens"]
        buffered = f"; first the {n} buffered token{'s' if n > 1 else ''} it takes over" if n else ""
        out.append(f"            new rank {r['rank']}: resumes at stream position {r['position']}{shard}, reads examples "
                   f"{', '.join(map(str, r['first_examples']))}, ...{buffered}")
    pr = d["proof"]
    out.append(f"            proof: {pr['consumed_before']} examples read before, {pr['consumed_after']} read by no new rank, "
               f"{pr['read_twice']} read twice (counted on examples {pr['window'][0]}-{pr['window'][1] - 1}; periodic beyond); "
               f"buffered tokens {pr['buffered_tokens_before']} -> {pr['buffered_tokens_after']}")
    if d["requires"] not in d["note"]:
        out.append(f"            requires: {d['requires']}")
    return out


# How `--data link` shared a file, in words (the JSON keeps the method's name).
_SHARED_BY = {"hardlink": "hard link", "reflink": "file clone (no bytes copied)"}




def _verified_words(v: dict[str, Any], sliced: dict[str, Any] | None) -> str:
    """What the verification found, in the verify command's words (a slice is equal only where it keeps)."""
    if not v["equal"]:
        return "DIFFERENT"
    if sliced:
        return f"equal to the source in global terms where kept (a slice: {sliced.get('description')})"
    return "equal to the source in global terms"

def _batch_words(b: dict[str, Any]) -> str:
    """The batch recipe in words, each figure only where it is known (never a printed None)."""
    parts = []
    if b.get("micro_batch") is not None and b.get("grad_accum") is not None:
        parts.append(f"micro-batch {b['micro_batch']} x accumulation {b['grad_accum']} x dp =")
    unknown = [w for w, k in (("micro-batch", "micro_batch"), ("accumulation", "grad_accum")) if b.get(k) is None]
    if b.get("global_batch") is not None:
        parts.append(f"global batch {b['global_batch']}")
    else:
        unknown.append("global batch")
    if b.get("seq_len") is not None:
        parts.append(f"(seq len {b['seq_len']})")
    else:
        unknown.append("seq len")
    if unknown:
        parts.append(f"({', '.join(unknown)} not recorded)")
    return " ".join(parts)

def render_convert(r: dict[str, Any], *, verbose: bool = False) -> str:
    """``reshard convert``'s result for a person; ``verbose`` adds the full note on shared data files."""
    v = r["verification"]
    lines = [
        f"converted   {r['source']} -> {r['destination']}",
        f"verdict     {r['plan']['verdict']['kind'].replace('_', ' ')}; experiment {r['manifest']['experiment_id']} ({r['manifest']['continuity']})",
        f"verified    {_verified_words(v, r['plan'].get('slice'))} "
        f"({v['compared']['tensors']} tensors, {v['compared']['objects']} objects; {on_purpose(v.get('rewritten', []))})",
        f"written     {human_bytes(r['bytes_written'])} in {len(r['files'])} files in {r['seconds']} s",
        f"report      {r['destination']}/reshard-report.md (and .json)",
    ]
    lines[4:4] = store_lines(r)
    if r.get("taken_again"):  # the verification is the interrupted run's: say so, and what this run checked
        lines[2] += (f"; by the interrupted run that made it, its {r['taken_again']['items_checked_now']} items "
                     "checked against their CRC-32 now")
    d = r.get("data") or {}
    if d.get("mode") == "link":
        methods = sorted({x["method"] for x in d["shared"]})
        how = " and ".join(_SHARED_BY.get(m, m) for m in methods) or "-"
        lines.insert(4, f"shared      {human_bytes(d['shared_bytes'])} in {len(d['shared'])} source data files by {how} "
                        f"({d['linked_tensors']} tensors, {d['linked_objects']} objects), {d['written_keys']} keys written new")
        lines.insert(5, f"            {d['note'] if verbose else _shared_warning(methods)}")
    return "\n".join(lines + sidecar_lines(r.get("sidecars") or [], verb="carried byte-identical"))


def store_lines(r: dict[str, Any]) -> list[str]:
    """What a run from or into object storage fetched and sent (`reshard.storage.objectstore.remote`), in words."""
    out = []
    st = r.get("source_store")
    if st:
        out.append(f"fetched     {human_bytes(st['bytes_requested'])} in {st['requests']} ranged requests "
                   f"({human_bytes(st['bytes_stored'])} stored under the source prefix)")
    up = r.get("uploaded")
    if up:
        kept = up["kept_from_an_interrupted_upload"]
        checked = ("each one's ETag the MD5 of the bytes sent" if not up.get("not_checked")
                   else f"{up['not_checked']} not checked: the store's ETag is not an MD5 of their bytes")
        out.append(f"uploaded    {human_bytes(up['bytes'])} in {up['objects']} objects ({checked})"
                   + (f"; {kept['objects']} objects ({human_bytes(kept['bytes'])}) already there from the interrupted "
                      "upload, kept" if kept["objects"] else ""))
        streamed = up.get("streamed")
        if streamed:
            out.append(f"streamed    {streamed['parts_sent']} parts of {streamed['objects']} data files sent while the copy "
                       f"wrote, {streamed['items_checked_as_sent']} items checked as sent against their CRC-32"
                       + (f"; {streamed['parts_kept']} parts ({human_bytes(streamed['bytes_kept'])}) kept from the "
                          "interrupted upload (their MD5 the same)" if streamed["parts_kept"] else ""))
    return out


def _shared_warning(methods: list[str]) -> str:
    """What a person must do about files shared with the source, in one line."""
    if "hardlink" in methods:
        return ("the output uses the source's own data files: never modify the source in place "
                "(deleting or renaming it is safe); --verbose says more")
    return "the output's data files are clones of the source's (no bytes copied): changing one leaves the other as it is"


# Above this, a linked output's load reads notably more than each rank keeps (whole saved pieces
# are read): worth a line without --verbose.
_READS_WORTH_SAYING = 1.1


def data_link_lines(d: dict[str, Any] | None, *, verbose: bool = False) -> list[str]:
    """The plan's `convert --data link` line: available (and, when notable or ``verbose``, what each
    target rank's load would read) or why not."""
    if not d:
        return []
    if not d["available"]:
        first = d["reasons"][0] if d["reasons"] else "-"
        more = f" (+{len(d['reasons']) - 1} more)" if len(d["reasons"]) > 1 else ""
        return [f"data link   not available: {first}{more}"]
    rd = d.get("reads") or {}
    out = [f"data link   available: --data link would share {d['shared_files']} source files "
           f"({human_bytes(d['shared_bytes'])}) and write {d['new_keys']} keys new; DST must be on the source's file system"]
    if verbose:
        out.append(f"            how: {d['how']}")
    amp = rd.get("amplification") if rd else None
    if rd and not verbose and amp and amp > _READS_WORTH_SAYING:
        out.append(f"            loading it, a target rank reads at most {human_bytes(rd['max_bytes'])}, "
                   f"{amp:.1f} times what it keeps (the source's pieces are read whole)")
    if rd and verbose:
        amp_text = f", {amp}x what the ranks keep" if amp else ""
        out.append(f"            each target rank's load reads at most {human_bytes(rd['max_bytes'])} from "
                   f"{rd['max_files']} files (rank {rd['max_rank']}){amp_text}")
        out += [f"            rank {x['rank']}: {x['items']} items from {x['files']} files, {human_bytes(x['bytes'])} "
                f"read, {human_bytes(x['keeps'])} kept" for x in rd["per_rank"]]
    return out
