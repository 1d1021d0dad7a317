"""`reshard verify`: do two DCP checkpoints hold the same state, in global terms?

Two checkpoints are compared as what they *mean*, independent of how either is chunked or
which rank file holds which bytes: a 4-rank FSDP2 save and its conversion to 3 ranks are
equal when every global tensor has the same shape, dtype and values, every object is
structurally equal, and the trainer semantics (step, tokens seen, data cursor) agree.

Rules
-----
* **Keys.** Keys of A missing in B are ``missing``; keys of B not in A are ``unexpected``.
  Per-rank state (roles ``rng``/``data`` carrying a rank, e.g. ``rng.rank_<r>.*``,
  ``dataloader.dp_rank_<k>``) legitimately changes with the world size, so it is judged
  per side: every rank ``0..N-1`` of that side's declared size (topology world size for
  rng, data-parallel width for data) must be present, and no rank beyond it (otherwise a
  ``per_rank`` difference). A per-rank key present on both sides is compared by value; one
  whose rank exists on one side only is not a key difference.
* **Tensors.** Shape, then dtype, then values, one stored chunk of A at a time (the same box
  is read from B whatever B's chunking), so memory is bounded by the largest chunk.
  Bitwise comparisons of two DCP checkpoints first go through `reshard.io.compare`: the
  stored bytes of every intersecting (chunk of A, chunk of B) pair are compared where they
  lie (``os.preadv`` into reusable buffers, ``mmap`` views for strided intersections, a
  small thread pool, memory flat), without decoding anything. Only a key whose bytes
  differ, or whose items that path does not handle (storage transforms, unusual archives,
  read errors), is decoded chunk by chunk as described here, so what is reported does not
  depend on the path taken (``fast=False`` skips the fast path).
  Values are compared bit for bit (NaN-safe; ``-0.0 != 0.0``) unless ``rtol`` or ``atol``
  is > 0, in which case both sides are cast to float64 (complex128) and compared with
  ``torch.isclose(rtol, atol, equal_nan=True)``; a dtype difference is then tolerated (and
  listed under ``notes``), otherwise it is a ``dtype`` difference.
* **Objects.** Loaded safely (``trust_pickle`` as for inspect) and compared structurally:
  dicts, lists and tuples recursively, types exactly, floats exactly (NaN equals NaN),
  tensors bit for bit.
* **Semantics** (from each side's inspection): ``step``, ``tokens_seen`` and, when both
  have a manifest, ``data.cursor``. The experiment id is not compared (a warm-start
  conversion may give a new one).
* **Expected rewrites.** ``expected_rewrites = {key: reason}`` names keys the caller changed
  on purpose. A difference on such a key (or on a key below it: ``"scheduler"`` covers
  ``"scheduler.last_epoch"``), including one present on one side only, is listed under
  ``rewritten`` instead of ``differences``. The semantics names above may be used as keys.

Bad input (incomplete checkpoint, unreadable or invalid manifest, unsafe pickle) raises the
:class:`~reshard.errors.ReshardError` that says so (exit 2 at the CLI).

**Integrity.** When a side's manifest records item checksums (``integrity``, written by
`reshard convert`: crc32, or sha256 in older manifests; another algorithm is `BadInput`),
every item of that side is hashed and checked before any result is reported (B's items
while the fast path compares them, so they are read once; the rest by
`reshard.integrity.check_items`); an item whose bytes do not match is *corrupt input*,
not a difference: `BadInput` (exit 2) naming the first corrupt item in (file, offset)
order, its key and file. Without this a
flipped payload byte shows up, at best, as a value difference of unknown origin.
Items and checksums that do not pair up (``.metadata`` changed after the manifest was
written) are listed under ``notes``. ``check_integrity=False`` skips the check.

Result (the ``--json`` shape)::

    {
      "equal": bool,                     # no differences (rewritten items do not count)
      "a": str, "b": str,                # the two paths
      "compared": {"tensors": n,         # tensor keys present on both sides
                   "objects": n,         # object keys present on both sides
                   "elements": n,        # tensor elements compared
                   "bytes": n},          # logical bytes of A's compared tensor elements
      "differences": [{"key": str,
                       "kind": "missing" | "unexpected" | "shape" | "dtype" | "value"
                               | "object" | "per_rank" | "semantics",
                       "detail": str,    # one line for people
                       ...}],            # kind-specific: value -> "index" (first differing
                                         # global index), "a", "b" (its values), "count"
                                         # (differing elements of the key), "numel";
                                         # shape/dtype/semantics -> "a", "b";
                                         # per_rank -> "side", "role", "ranks", "expected"
      "rewritten": [{"key": str, "reason": str, "kind": str, "detail": str}],
      "notes": [str],                    # tolerated dtype changes and the like
      "tolerance": {"rtol": float, "atol": float},
      "exit_code": 0 | 1                 # 0 equal, 1 different
    }

``progress``: an optional tqdm-like object; ``progress.update(1)`` is called once per item
of A (a tensor chunk or an object), so ``CheckpointIndex.open(a).item_count()`` is the total.
"""
from __future__ import annotations

import math
import reprlib
from pathlib import Path
from typing import Any

import torch

from reshard.errors import BadInput, Incomplete
from reshard.index import CheckpointIndex, Entry
from reshard.inspection import Inspection, inspect_checkpoint
from reshard.integrity import check_algorithm

PER_RANK_ROLES = ("rng", "data")
_INT_BY_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_repr = reprlib.Repr()
_repr.maxstring = 60
_repr.maxother = 60
_repr.maxlist = _repr.maxtuple = _repr.maxdict = 6


def short_repr(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor({str(x.dtype).removeprefix('torch.')}{list(x.shape)})"
    return _repr.repr(x)


# ---------------------------------------------------------------------------------- opening
def _open(path: Path, trust_pickle: bool) -> Inspection:
    insp = inspect_checkpoint(path, trust_pickle=trust_pickle)
    errors = [p for p in insp.report["problems"] if p["severity"] == "error"]
    if errors:
        first = errors[0]
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
        index_codes = {"missing_file", "truncated_file", "no_storage"}
        cls = Incomplete if first["code"] in index_codes or first["code"].startswith("chunk_") else BadInput
        where = str(path / first["file"]) if first.get("file") else str(path)
        raise cls(first["message"].rstrip(".") + more + ".", where=where,
                  hint="Run `reshard inspect` on it for the full list; verify needs two complete checkpoints.")
    return insp


def _integrity_record(insp: Inspection) -> dict[str, Any] | None:
    """The manifest's item checksums of a DCP checkpoint, or None (none recorded, or another format)."""
    integrity = getattr(insp.manifest, "integrity", None)
    if not integrity or not isinstance(insp.index, CheckpointIndex):
        return None
    return integrity


def check_item_checksums(insp: Inspection, path: Path, notes: list[str] | None = None, *,
                         workers: int | None = None, digests: dict[str, str] | None = None) -> None:
    """Hash every item of a checkpoint whose manifest records checksums; BadInput on the first
    mismatch (or on a checksum algorithm reshard does not know). ``digests``: checksums
    already computed for some items (see `reshard.integrity.check_items`)."""
    from reshard.integrity import check_items, describe, first_issue_message

    integrity = _integrity_record(insp)
    if integrity is None:
        return
    issues = check_items(insp.index, integrity, workers=workers, digests=digests)
    bad = [i for i in issues if i["kind"] == "mismatch"]
    if bad:
        raise BadInput(first_issue_message(bad), where=str(Path(path) / bad[0]["file"]),
                       hint="The checkpoint is corrupt (exit 2: bad input, not a difference). Restore it from a good "
                            "copy or convert again; `reshard inspect --deep` lists every corrupt item.")
    if notes is not None:
        notes.extend(f"{path}: {describe(i)}" for i in issues[:20])


# ---------------------------------------------------------------------------------- tensors
def _bits(t: torch.Tensor) -> torch.Tensor:
    """A 2-D integer view ``[numel, words]`` of the raw bytes of ``t`` (contiguous)."""
    flat = t.contiguous().reshape(-1)
    size = flat.element_size()
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8).reshape(-1, 1)
    if size in _INT_BY_SIZE:
        return flat.view(_INT_BY_SIZE[size]).reshape(-1, 1)
    return flat.view(torch.uint8).reshape(-1, size)


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.complex128 if t.is_complex() else torch.float64)


def _item(t: torch.Tensor, flat: int) -> Any:
    v = t.reshape(-1)[flat]
    try:
        return v.item()
    except (RuntimeError, TypeError):  # exotic dtypes (float8, ...) have no .item()
        return float(v.to(torch.float64).item())


def _unravel(flat: int, sizes: tuple[int, ...]) -> list[int]:
    idx = []
    for s in reversed(sizes):
        idx.append(flat % s)
        flat //= s
    return idx[::-1]


class _SkipTicks:
    """Progress that drops the first ``skip`` ticks (already given by the fast path)."""

    def __init__(self, progress: Any, skip: int):
        self.progress, self.skip = progress, skip

    def update(self, n: int = 1) -> None:
        drop = min(self.skip, n)
        self.skip -= drop
        if n - drop:
            self.progress.update(n - drop)


class _Checked:
    """A verdict for a key whose values were compared while it was written (see ``values_checked``)."""

    status = "equal"
    ticked = 0

    def __init__(self, ea: Entry, eb: Entry, b_files: set[str] | None):
        boxes = [c.box for c in eb.chunks
                 if b_files is None or (c.location is not None and c.location.file in b_files)]
        self.elements = sum(b.numel for b in boxes if not b.is_empty())
        self.nbytes = self.elements * ea.dtype.itemsize


def _fast_candidates(ia: Any, ib: Any, rtol: float, atol: float) -> list[str]:
    """Keys the byte-level fast path may decide: tensors of the same shape and dtype on two DCP sides, bitwise."""
    if rtol > 0 or atol > 0 or not isinstance(ia, CheckpointIndex) or not isinstance(ib, CheckpointIndex):
        return []
    out = []
    for key in sorted(set(ia.entries) & set(ib.entries)):
        ea, eb = ia.entries[key], ib.entries[key]
        if ea.is_tensor and eb.is_tensor and ea.shape == eb.shape and ea.dtype == eb.dtype:
            out.append(key)
    return out


def _compare_tensor(key: str, ea: Entry, eb: Entry, ia: CheckpointIndex, ib: CheckpointIndex,
                    rtol: float, atol: float, stats: dict[str, int], notes: list[str],
                    progress: Any, verdict: Any = None, b_files: set[str] | None = None) -> dict[str, Any] | None:
    if verdict is not None and verdict.status == "equal":  # decided by reshard.io.compare
        stats["tensors"] += 1
        stats["elements"] += verdict.elements
        stats["bytes"] += verdict.nbytes
        if progress is not None and len(ea.chunks) > verdict.ticked:
            progress.update(len(ea.chunks) - verdict.ticked)
        return None
    if verdict is not None and verdict.ticked and progress is not None:
        progress = _SkipTicks(progress, verdict.ticked)

    def done(n: int) -> None:
        if progress is not None and n:
            progress.update(n)

    if ea.shape != eb.shape:
        done(len(ea.chunks))
        return {"key": key, "kind": "shape", "detail": f"shape {list(ea.shape)} in A, {list(eb.shape)} in B",
                "a": list(ea.shape), "b": list(eb.shape)}
    tolerant = rtol > 0 or atol > 0
    if ea.dtype != eb.dtype:
        if not tolerant:
            done(len(ea.chunks))
            return {"key": key, "kind": "dtype", "detail": f"dtype {ea.dtype_name} in A, {eb.dtype_name} in B",
                    "a": ea.dtype_name, "b": eb.dtype_name}
        notes.append(f"{key}: dtype {ea.dtype_name} in A, {eb.dtype_name} in B (compared within tolerance)")
    stats["tensors"] += 1
    count = 0
    first: tuple[list[int], Any, Any] | None = None
    # one box at a time: A's chunks, or (a distributed worker's part) B's chunks in its files
    boxes = ([c.box for c in ea.chunks] if b_files is None else
             [c.box for c in eb.chunks if c.location is not None and c.location.file in b_files])
    for box in boxes:
        if box.is_empty():
            done(1)
            continue
        ta = ia.read_box(key, box)
        tb = ib.read_box(key, box)
        if tolerant:
            wa, wb = _wide(ta), _wide(tb)
            bad = ~torch.isclose(wa, wb, rtol=rtol, atol=atol, equal_nan=True).reshape(-1)
            del wa, wb
        else:
            bad = (_bits(ta) != _bits(tb)).any(dim=1)
        n = int(bad.sum())
        stats["elements"] += box.numel
        stats["bytes"] += box.numel * ta.element_size()
        if n:
            count += n
            flat = int(bad.nonzero()[0, 0])
            idx = [o + i for o, i in zip(box.offsets, _unravel(flat, box.sizes))]
            # row-major order within a box is lexicographic, so the global first is the min
            if first is None or idx < first[0]:
                first = (idx, _item(ta, flat), _item(tb, flat))
        del ta, tb, bad
        done(1)
    if not count:
        return None
    assert first is not None
    idx, va, vb = first
    how = "bitwise" if not tolerant else f"beyond rtol={rtol}, atol={atol}"
    return {"key": key, "kind": "value",
            "detail": f"{count} of {ea.numel} elements differ ({how}); first at {idx}: {va!r} in A, {vb!r} in B",
            "index": idx, "a": va, "b": vb, "count": count, "numel": ea.numel}


# ---------------------------------------------------------------------------------- objects
def _same_float(x: float, y: float) -> bool:
    return x == y or (math.isnan(x) and math.isnan(y))


def _tensor_same(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    return bool(torch.equal(x, y)) or bool(torch.equal(_bits(x), _bits(y)))


def object_difference(x: Any, y: Any, path: str = "") -> str | None:
    """The first structural difference between ``x`` and ``y`` as a short line, or None."""
    where = path or "value"
    if type(x) is not type(y):
        return f"{where}: {type(x).__name__} {short_repr(x)} in A, {type(y).__name__} {short_repr(y)} in B"
    if isinstance(x, dict):
        if set(x) != set(y):
            only_a = [k for k in x if k not in y]
            only_b = [k for k in y if k not in x]
            return f"{where}: keys only in A {short_repr(only_a)}, only in B {short_repr(only_b)}"
        for k in x:
            d = object_difference(x[k], y[k], f"{path}[{k!r}]")
            if d:
                return d
        return None
    if isinstance(x, (list, tuple)):
        if len(x) != len(y):
            return f"{where}: length {len(x)} in A, {len(y)} in B"
        for i, (u, v) in enumerate(zip(x, y)):
            d = object_difference(u, v, f"{path}[{i}]")
            if d:
                return d
        return None
    if isinstance(x, torch.Tensor):
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"{where}: {short_repr(x)} in A, {short_repr(y)} in B"
        return None if _tensor_same(x, y) else f"{where}: tensor values differ"
    if isinstance(x, float):
        return None if _same_float(x, y) else f"{where}: {x!r} in A, {y!r} in B"
    try:
        res = x == y
        same = res if isinstance(res, bool) else bool(res.all() if hasattr(res, "all") else res)
    except Exception:  # noqa: BLE001 - objects whose == misbehaves: compare their repr
        same = repr(x) == repr(y)
    return None if same else f"{where}: {short_repr(x)} in A, {short_repr(y)} in B"


# ---------------------------------------------------------------------------------- main
def _per_rank(insp: Inspection) -> dict[str, dict[int, set[str]]]:
    """role -> rank -> keys, for per-rank keys (roles rng/data with a rank)."""
    out: dict[str, dict[int, set[str]]] = {}
    for k, r in insp.classification.roles.items():
        if r.role in PER_RANK_ROLES and r.rank is not None:
            out.setdefault(r.role, {}).setdefault(r.rank, set()).add(k)
    return out


def rewrites_from_reports(a: Path, b: Path, *, max_hops: int = 16) -> tuple[dict[str, str], str | None]:
    """Keys the conversion reports between A and B say were rewritten, dropped or added on purpose.

    `reshard convert` writes `reshard-report.json` into its output naming every key it
    changed deliberately (reseeded RNG, translated data state, remapped schedule). When one
    side was produced from the other by a chain of conversions (A -> X -> ... -> B), the
    reports along the chain are followed back to the other side; they are only trusted
    when the chain really ends there.
    """
    import json

    for src, out in ((a, b), (b, a)):
        keys: dict[str, str] = {}
        first: str | None = None
        cur = Path(out)
        for _ in range(max_hops):
            rp = cur / "reshard-report.json"
            try:
                rep = json.loads(rp.read_text())
                prev = Path(rep["source"])
                for k in rep["plan"]["keys"]:
                    if k["action"] in ("rewritten", "dropped", "added"):
                        keys.setdefault(k["key"], f"{k['action']} by the conversion {prev.name} -> {cur.name} ({k['reason']})")
            except (OSError, ValueError, KeyError, TypeError):
                break
            first = first or str(rp)
            if prev.resolve() == Path(src).resolve():
                return keys, first
            cur = prev
    return {}, None


def verify_checkpoints(a: Path, b: Path, *, rtol: float = 0.0, atol: float = 0.0,
                       expected_rewrites: dict[str, str] | None = None, trust_pickle: bool = False,
                       progress: Any = None, check_integrity: bool | str = True, fast: bool = True,
                       workers: int | None = None, b_files: set[str] | None = None,
                       values_checked: set[str] | None = None, direct: bool = True) -> dict[str, Any]:
    """Compare two DCP checkpoints in global terms; see the module docstring for the result.

    ``check_integrity``: True checks both sides' recorded item checksums, False neither,
    ``"a"`` only A's (what `reshard convert` uses on its own fresh output, whose checksums
    it composed while writing: the byte comparison with the source is the check there).

    ``fast=False`` decodes every tensor chunk (the reference path; same result, slower);
    ``workers`` sizes the thread pools of the integrity check and the byte comparison.
    ``b_files`` (a distributed worker's part): tensor values are compared only over B's
    chunks stored in these data files of B (``compared.elements``/``bytes`` count those, so
    the workers' parts add up to the whole); keys, shapes, dtypes, objects and semantics
    are compared in full by every worker (the same findings in each part); progress still
    totals A's items.
    ``values_checked``: tensor keys whose values the caller already checked against A
    (`reshard convert` checks each item as it writes it); when their shape and dtype match
    they count as compared without a second read.
    ``direct``: the byte comparison reads large pieces with direct I/O, bypassing the page
    cache (`reshard.io.fileio`); False reads through it.
    """
    a, b = Path(a), Path(b)
    if rtol < 0 or atol < 0 or math.isnan(rtol) or math.isnan(atol):
        raise BadInput(f"tolerances must be >= 0, got rtol={rtol}, atol={atol}")
    rewrites = dict(expected_rewrites or {})
    sa, sb = _open(a, trust_pickle), _open(b, trust_pickle)
    ia, ib = sa.index, sb.index

    found: list[dict[str, Any]] = []
    notes: list[str] = []
    sides = {"a", "b"} if check_integrity is True else ({"a"} if check_integrity == "a" else set())
    records = {side: _integrity_record(insp) if side in sides else None for side, insp in (("a", sa), ("b", sb))}
    for side, path in (("a", a), ("b", b)):
        if records[side] is not None:  # an unknown algorithm is bad input before any work
            check_algorithm(records[side], where=Path(path) / "manifest.json")
    stats = {"tensors": 0, "objects": 0, "elements": 0, "bytes": 0}
    verdicts: dict[str, Any] = {}
    digests: dict[str, str] = {}
    if fast:
        from reshard.io.compare import compare_tensors

        cand = _fast_candidates(ia, ib, rtol, atol)
        pre = set(values_checked or ()) & set(cand)
        for key in pre:
            verdicts[key] = _Checked(ia.entries[key], ib.entries[key], b_files)
        cand = [k for k in cand if k not in pre]
        if cand:
            rb = records["b"]
            res = compare_tensors(ia, ib, cand, progress=progress if b_files is None else None, workers=workers,
                                  hash_b=rb["algorithm"] if rb else None, hash_names=(rb or {}).get("items") or (),
                                  b_files=b_files, direct=direct)
            verdicts.update(res.verdicts)
            digests = res.digests
    # corrupt input is bad input, not a difference: every recorded checksum is checked before
    # any result (B's items the comparison above already read whole are not read again)
    if "a" in sides:
        check_item_checksums(sa, a, notes, workers=workers)
    if "b" in sides:
        check_item_checksums(sb, b, notes, workers=workers, digests=digests)

    def tick(n: int = 1) -> None:
        if progress is not None and n:
            progress.update(n)

    # ---------------------------------------------------------------- semantics
    ra, rb = sa.report, sb.report
    sem = [("step", ra.get("step"), rb.get("step")),
           ("tokens_seen", ra.get("tokens_seen"), rb.get("tokens_seen"))]
    if sa.manifest is not None and sb.manifest is not None:
        sem.append(("data.cursor", sa.manifest.data.cursor, sb.manifest.data.cursor))
    for name, va, vb in sem:
        if va != vb:
            fmt = lambda v: "unknown" if v is None else repr(v)  # noqa: E731
            found.append({"key": name, "kind": "semantics", "detail": f"{name} {fmt(va)} in A, {fmt(vb)} in B",
                          "a": va, "b": vb})

    # ---------------------------------------------------------------- per-rank completeness
    pra, prb = _per_rank(sa), _per_rank(sb)
    for side, insp, pr in (("A", sa, pra), ("B", sb, prb)):
        for role, ranks in sorted(pr.items()):
            expect = insp.topology.world_size if role == "rng" else insp.topology.dp
            what = "world size" if role == "rng" else "data-parallel width"
            missing = sorted(set(range(expect)) - set(ranks))
            extra = sorted(r for r in ranks if r >= expect)
            if missing or extra:
                parts = []
                if missing:
                    parts.append(f"missing ranks {missing}")
                if extra:
                    parts.append(f"ranks {extra} beyond it")
                found.append({"key": role, "kind": "per_rank", "side": side, "role": role,
                              "ranks": sorted(ranks), "expected": expect,
                              "detail": f"{side}: per-rank {role} state for {what} {expect} "
                                        f"({insp.topology.source} topology): {'; '.join(parts)}"})
    rank_of: dict[str, tuple[str, int]] = {}
    for pr in (pra, prb):
        for role, ranks in pr.items():
            for r, keys in ranks.items():
                for k in keys:
                    rank_of[k] = (role, r)

    def rank_elsewhere(key: str, other: dict[str, dict[int, set[str]]]) -> bool:
        """A per-rank key whose rank the other side does not have at all (not a key difference)."""
        if key not in rank_of:
            return False
        role, r = rank_of[key]
        return r not in other.get(role, {})

    # ---------------------------------------------------------------- keys
    for key in sorted(set(ia.entries) | set(ib.entries)):
        ea, eb = ia.entries.get(key), ib.entries.get(key)
        if eb is None:
            tick(len(ea.chunks) if ea.is_tensor else 1)
            if not rank_elsewhere(key, prb):
                found.append({"key": key, "kind": "missing", "detail": f"{_describe(ea)} in A, missing in B"})
            continue
        if ea is None:
            if not rank_elsewhere(key, pra):
                found.append({"key": key, "kind": "unexpected", "detail": f"not in A, {_describe(eb)} in B"})
            continue
        if ea.is_tensor != eb.is_tensor:
            tick(len(ea.chunks) if ea.is_tensor else 1)
            found.append({"key": key, "kind": "object", "detail": f"{_describe(ea)} in A, {_describe(eb)} in B"})
            continue
        if ea.is_tensor:
            d = _compare_tensor(key, ea, eb, ia, ib, rtol, atol, stats, notes, progress if b_files is None else None,
                                verdicts.get(key), b_files)
            if b_files is not None:
                tick(len(ea.chunks))
            if d:
                found.append(d)
            continue
        stats["objects"] += 1
        d = object_difference(ia.read_object(key), ib.read_object(key))
        tick(1)
        if d:
            found.append({"key": key, "kind": "object", "detail": d})

    # ---------------------------------------------------------------- expected rewrites
    differences: list[dict[str, Any]] = []
    rewritten: list[dict[str, Any]] = []
    for d in found:
        reason = _rewrite_reason(d["key"], rewrites)
        if reason is None:
            differences.append(d)
        else:
            rewritten.append({"key": d["key"], "reason": reason, "kind": d["kind"], "detail": d["detail"]})

    equal = not differences
    return {
        "equal": equal,
        "a": str(a),
        "b": str(b),
        "compared": stats,
        "differences": differences,
        "rewritten": rewritten,
        "notes": notes,
        "tolerance": {"rtol": float(rtol), "atol": float(atol)},
        "exit_code": 0 if equal else 1,
    }


def _describe(e: Entry) -> str:
    return f"tensor {e.dtype_name}{list(e.shape)}" if e.is_tensor else "object"


def _rewrite_reason(key: str, rewrites: dict[str, str]) -> str | None:
    if key in rewrites:
        return rewrites[key]
    best = None
    for k, reason in rewrites.items():
        if key.startswith(k + ".") and (best is None or len(k) > len(best[0])):
            best = (k, reason)
    return best[1] if best else None


# ---------------------------------------------------------------------------------- rendering
def _n(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def render_verify(r: dict[str, Any], *, limit: int = 50) -> str:
    """A few lines for a terminal: the verdict first, then one line per difference."""
    from reshard.report import human_bytes

    c = r["compared"]
    tol = r["tolerance"]
    how = "bitwise" if not (tol["rtol"] or tol["atol"]) else f"rtol={tol['rtol']:g}, atol={tol['atol']:g}"
    n = len(r["differences"])
    verdict = "equal" if r["equal"] else f"DIFFERENT ({n} difference{'s' if n != 1 else ''})"
    out = [f"verdict     {verdict}",
           f"A           {r['a']}",
           f"B           {r['b']}",
           f"compared    {_n(c['tensors'], 'tensor')} ({_n(c['elements'], 'element')}, {human_bytes(c['bytes'])}, {how}), "
           f"{_n(c['objects'], 'object')}"]
    for d in r["differences"][:limit]:
        out.append(f"  {d['kind']:<10} {d['key']}: {d['detail']}")
    if n > limit:
        out.append(f"  ... and {n - limit} more (use --json for all)")
    if r["rewritten"]:
        out.append(f"rewritten   {len(r['rewritten'])} expected rewrite(s)")
        for w in r["rewritten"][:limit]:
            out.append(f"  {w['key']}: {w['reason']} ({w['detail']})")
    for note in r.get("notes", [])[:limit]:
        out.append(f"note        {note}")
    return "\n".join(out)
