"""`reshard verify`: do two DCP checkpoints hold the same state, in global terms?

Two checkpoints are compared as what they *mean*, independent of how either is chunked or
which rank file holds which bytes: a 4-rank FSDP2 save and its conversion to 3 ranks are
equal when every global tensor has the same shape, dtype and values, every object is
the same value bit for bit, and the trainer semantics (step, tokens seen, data cursor) agree.

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
  Bitwise comparisons of two DCP checkpoints first go through `reshard.verification.compare`: the
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
* **Objects.** Loaded safely (``trust_pickle`` as for inspect) and compared bit for bit, by
  the rule tensors are (`reshard.verification.objects.object_difference`): types exactly
  (``1`` is not ``1.0``), floats by their bits (``-0.0 != 0.0``; NaNs equal only with the
  same payload), tensors by shape, dtype and bits, dicts, lists, tuples and sets by
  structure, recursively.
* **Semantics** (from each side's inspection): ``step``, ``tokens_seen`` and, when both
  have a manifest, ``data.cursor``. The experiment id is not compared (a warm-start
  conversion may give a new one).

Excused differences
-------------------
A difference is excused (listed under ``rewritten`` instead of ``differences``) only when
something other than the checkpoint under test says so:

* ``expected_rewrites = {key: reason}``: keys the *caller* changed on purpose (`reshard
  convert` passes the keys of the plan it has in hand; the rehearsal and the demo theirs).
  A difference on such a key (or on a key below it: ``"scheduler"`` covers
  ``"scheduler.last_epoch"``), including one present on one side only, is excused. The
  semantics names above may be used as keys.
* ``recompute=True`` (what `reshard verify` does): the verifier re-derives the changes
  itself, and nothing either checkpoint says about itself is evidence; a report inside a
  checkpoint (``reshard-report.json``, ``export-report.json``) is never read.

  - **A conversion** (`reshard.verification.evidence.conversion_evidence`): the output's
    ``manifest.json`` lineage ends with a transition recording its plan options and its
    source's fingerprint; the plan is recomputed from the other side with those options
    (``trust_pickle`` is this run's, never the lineage's) and must have that source
    fingerprint. Then a dropped key may be absent, a rewritten or added key must hold
    exactly (`identical`) the value the plan's state translators write
    (``plan.new_values``: reseeded RNG, remapped schedule, translated data state), a
    transformed, cast or tied-copy tensor must pass `check_transforms` against the source,
    and a moved ``data.cursor`` must be the plan's. A forged lineage can only name a plan;
    if B's values are not that plan's, they stay differences. ``strict=True``
    (``--strict``) excuses no conversion change at all. Only one conversion is re-derived
    (B made from A, or A from B), not a chain.
  - **An export** (`reshard.verification.evidence.export_evidence`, one side a safetensors
    export): the keys `reshard export` leaves out (trainer state, objects, optimizer state
    under ``--only model``, tied copies written once) are recomputed from the other side
    with `reshard.planning.export.key_actions` and the ``only`` the export's header
    records; they may be absent. ``step`` and ``tokens_seen`` may be unknown on the export
    side. A value that differs is a difference, ``strict`` or not.
  - **A Hugging Face export** (one side a directory with ``config.json``, as ``export --format hf``
    writes): compared through the family's declared names and transforms, re-derived from the
    checkpoint side (`reshard.verification.exports.compare_hf_export`).

Bad input (incomplete checkpoint, unreadable or invalid manifest, unsafe pickle) raises the
:class:`~reshard.errors.ReshardError` that says so (exit 2 at the CLI).

**Integrity.** When a side's manifest records item checksums (``integrity``, written by
`reshard convert`: crc32, or sha256 in older manifests; another algorithm is `BadInput`),
every item of that side is hashed and checked before any result is reported (B's items
while the fast path compares them, so they are read once; the rest by
`reshard.storage.files.integrity.check_items`); an item whose bytes do not match is *corrupt input*,
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
      "notes": [str],                    # tolerated dtype changes, lineages that could not be used, ...
      "evidence": str | None,            # where the excused changes were re-derived from (recompute)
      "slice": str | None,               # B is a slice of A (--layers/--experts), in words: equal only where kept
      "tolerance": {"rtol": float, "atol": float},
      "exit_code": 0 | 1                 # 0 equal, 1 different
    }

``progress``: an optional `reshard.render.progress.Progress`; the comparison is its phase
"comparing", advanced by the logical bytes of A's items as they are decided (`progress_bytes`
of A is the total), and the checksum pass its phase "checking checksums" (stored bytes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reshard.errors import BadInput
from reshard.model.checkpoint import Entry
from reshard.storage.checkpoints.index import CheckpointIndex
from reshard.model.inspection import Inspection
from reshard.storage.source import Source
from reshard.storage.files.integrity import check_algorithm
from reshard.render.progress import phase_of
from reshard.verification import arrays
from reshard.verification.evidence import Evidence, check_transforms, open_checkpoint, recomputed_evidence
from reshard.verification.objects import bits, element, object_difference, widened

if TYPE_CHECKING:  # tensors are decoded only where values must be compared (the byte comparison needs no torch)
    import torch

# the comparison's entry points; `check_transforms` is `reshard.verification.evidence`'s, named here too
__all__ = ["verify_checkpoints", "progress_bytes", "check_item_checksums", "check_transforms"]

PER_RANK_ROLES = ("rng", "data")


# ---------------------------------------------------------------------------------- item checksums
def _integrity_record(insp: Inspection) -> dict[str, Any] | None:
    """The manifest's item checksums of a DCP checkpoint, or None (none recorded, or another format)."""
    integrity = getattr(insp.manifest, "integrity", None)
    if not integrity or not isinstance(insp.index, CheckpointIndex):
        return None
    return integrity


def check_item_checksums(insp: Inspection, path: Path, notes: list[str] | None = None, *,
                         workers: int | None = None, digests: dict[str, str] | None = None,
                         progress: Any = None) -> None:
    """Hash every item of a checkpoint whose manifest records checksums; BadInput on the first
    mismatch (or on a checksum algorithm reshard does not know). ``digests``: checksums
    already computed for some items (see `reshard.storage.files.integrity.check_items`)."""
    from reshard.storage.files.integrity import check_items, describe, first_issue_message, item_bytes

    integrity = _integrity_record(insp)
    if integrity is None:
        return
    with phase_of(progress, f"checking checksums of {Path(path).name}", item_bytes(insp.index)) as bar:
        issues = check_items(insp.index, integrity, workers=workers, digests=digests, progress=bar)
    bad = [i for i in issues if i["kind"] == "mismatch"]
    if bad:
        raise BadInput(first_issue_message(bad), where=str(Path(path) / bad[0]["file"]),
                       hint="The checkpoint is corrupt (exit 2: bad input, not a difference). Restore it from a good "
                            "copy or convert again; `reshard inspect --deep` lists every corrupt item.")
    if notes is not None:
        notes.extend(f"{path}: {describe(i)}" for i in issues[:20])


# ---------------------------------------------------------------------------------- tensors
def _item(t: "torch.Tensor", flat: int) -> Any:
    return element(t, flat)  # float8 as its number; float4 and bits dtypes as their hex bits


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
    """One tensor key on both sides: the fast path's ``"equal"`` verdict counted as is, else
    shape, dtype and values decoded box by box (the keys the fast path found different or
    left alone), so what is reported does not depend on the path taken."""
    if verdict is not None and verdict.status == "equal":  # decided by reshard.verification.compare
        _count_decided(ea, verdict, stats, progress)
        return None
    if verdict is not None and verdict.ticked and progress is not None:
        progress = _SkipTicks(progress, verdict.ticked)
    d = _shape_or_dtype_difference(key, ea, eb, rtol, atol, notes)
    if d is not None:
        _advance(progress, ea.nbytes)
        return d
    stats["tensors"] += 1
    mismatch = _decoded_mismatch(key, ia, ib, _decoded_boxes(ea, eb, b_files), rtol, atol, stats, progress)
    return _value_difference(key, ea, mismatch, rtol, atol) if mismatch.count else None


def _advance(progress: Any, nbytes: int) -> None:
    if progress is not None and nbytes > 0:
        progress.update(nbytes)


def _count_decided(ea: Entry, verdict: Any, stats: dict[str, int], progress: Any) -> None:
    """A key the fast path found equal: its counts, and the bytes of A's chunks it did not tick yet."""
    stats["tensors"] += 1
    stats["elements"] += verdict.elements
    stats["bytes"] += verdict.nbytes
    _advance(progress, ea.nbytes - verdict.ticked)


def _shape_or_dtype_difference(key: str, ea: Entry, eb: Entry, rtol: float, atol: float,
                               notes: list[str]) -> dict[str, Any] | None:
    """A shape difference, else a dtype difference unless a tolerance is given (then the
    dtype change is only noted: both sides are widened before comparing)."""
    if ea.shape != eb.shape:
        return {"key": key, "kind": "shape", "detail": f"shape {list(ea.shape)} in A, {list(eb.shape)} in B",
                "a": list(ea.shape), "b": list(eb.shape)}
    if ea.dtype != eb.dtype:
        if not (rtol > 0 or atol > 0):
            return {"key": key, "kind": "dtype", "detail": f"dtype {ea.dtype_name} in A, {eb.dtype_name} in B",
                    "a": ea.dtype_name, "b": eb.dtype_name}
        notes.append(f"{key}: dtype {ea.dtype_name} in A, {eb.dtype_name} in B (compared within tolerance)")
    return None


def _decoded_boxes(ea: Entry, eb: Entry, b_files: set[str] | None) -> list[Any]:
    """The boxes decoded one at a time: A's chunks, or (a distributed worker's part) B's chunks in its files."""
    return ([c.box for c in ea.chunks] if b_files is None else
            [c.box for c in eb.chunks if c.location is not None and c.location.file in b_files])


@dataclass
class _Mismatch:
    """A key's differing elements so far: how many, and the first in global row-major order with its values."""

    count: int = 0
    index: list[int] | None = None
    a: Any = None
    b: Any = None

    def add(self, box: Any, bad: "torch.Tensor", ta: "torch.Tensor", tb: "torch.Tensor") -> None:
        """The differing elements ``bad`` (a flat mask) of ``box``, read as ``ta`` and ``tb``."""
        n = int(bad.sum())
        if not n:
            return
        self.count += n
        flat = int(bad.nonzero()[0, 0])
        idx = [o + i for o, i in zip(box.offsets, _unravel(flat, box.sizes))]
        # row-major order within a box is lexicographic, so the global first is the min
        if self.index is None or idx < self.index:
            self.index, self.a, self.b = idx, _item(ta, flat), _item(tb, flat)


def _decoded_mismatch(key: str, ia: CheckpointIndex, ib: CheckpointIndex, boxes: list[Any], rtol: float,
                      atol: float, stats: dict[str, int], progress: Any) -> _Mismatch:
    """Decode ``boxes`` of ``key`` from both sides one at a time (memory bounded by the largest)
    and compare them; each box is counted in ``stats`` and ticked."""
    mismatch = _Mismatch()
    as_arrays = not (rtol > 0 or atol > 0) and arrays.readable(ia, key) and arrays.readable(ib, key) \
        and ia.entries[key].dtype == ib.entries[key].dtype
    for box in boxes:
        if not box.is_empty():
            if as_arrays and _array_mismatch(mismatch, key, ia, ib, box, stats, progress):
                continue
            ta = ia.read_box(key, box)
            tb = ib.read_box(key, box)
            bad = _differing(ta, tb, rtol, atol)
            stats["elements"] += box.numel
            stats["bytes"] += box.numel * ta.element_size()
            mismatch.add(box, bad, ta, tb)
            _advance(progress, box.numel * ta.element_size())
            del ta, tb, bad
    return mismatch


def _array_mismatch(mismatch: _Mismatch, key: str, ia: CheckpointIndex, ib: CheckpointIndex, box: Any,
                    stats: dict[str, int], progress: Any) -> bool:
    """One box of an integer tensor compared bit for bit as numpy arrays (`reshard.verification.arrays`:
    no torch), counted and ticked as `_decoded_mismatch` does; False when a side needs torch to read."""
    ta = arrays.read_box_array(ia, key, box)
    tb = arrays.read_box_array(ib, key, box) if ta is not None else None
    if ta is None or tb is None:
        return False
    dtype = ia.entries[key].dtype
    count, flat, a, b = arrays.first_difference(ta, tb, dtype)
    stats["elements"] += box.numel
    stats["bytes"] += box.numel * dtype.itemsize
    if count:
        mismatch.count += count
        idx = [o + i for o, i in zip(box.offsets, _unravel(flat, box.sizes))]
        if mismatch.index is None or idx < mismatch.index:
            mismatch.index, mismatch.a, mismatch.b = idx, a, b
    _advance(progress, box.numel * dtype.itemsize)
    return True


def _differing(ta: "torch.Tensor", tb: "torch.Tensor", rtol: float, atol: float) -> "torch.Tensor":
    """A flat mask of the elements that differ: bit for bit, or (a tolerance given) beyond it, widened."""
    import torch

    if (rtol > 0 or atol > 0) and not ta.dtype == tb.dtype == torch.bool:  # two bools: their bytes, whatever the tolerance
        wa, wb = widened(ta), widened(tb)
        if wa is not None and wb is not None:
            bad = ~torch.isclose(wa, wb, rtol=rtol, atol=atol, equal_nan=True).reshape(-1)
            del wa, wb
            return bad
        if ta.dtype != tb.dtype:  # a dtype without arithmetic (float4, bits) against another: no element agrees
            return torch.ones(ta.numel(), dtype=torch.bool)
    return (bits(ta) != bits(tb)).any(dim=1)  # bit for bit (and a dtype without arithmetic within a tolerance)


def _value_difference(key: str, ea: Entry, m: _Mismatch, rtol: float, atol: float) -> dict[str, Any]:
    """The ``value`` difference of a key with differing elements."""
    how = "bitwise" if not (rtol > 0 or atol > 0) else f"beyond rtol={rtol}, atol={atol}"
    if how != "bitwise":
        import torch  # a tolerance: torch decoded the values already

    if how != "bitwise" and widened(torch.empty(1, dtype=ea.dtype.torch)) is None:  # one element: an empty one converts
        how = f"bitwise: {ea.dtype_name} has no arithmetic for a tolerance"
    return {"key": key, "kind": "value",
            "detail": f"{m.count} of {ea.numel} elements differ ({how}); first at {m.index}: {m.a!r} in A, {m.b!r} in B",
            "index": m.index, "a": m.a, "b": m.b, "count": m.count, "numel": ea.numel}


# ---------------------------------------------------------------------------------- main
def _per_rank(insp: Inspection) -> dict[str, dict[int, set[str]]]:
    """role -> rank -> keys, for per-rank keys (roles rng/data with a rank)."""
    out: dict[str, dict[int, set[str]]] = {}
    for k, r in insp.classification.roles.items():
        if r.role in PER_RANK_ROLES and r.rank is not None:
            out.setdefault(r.role, {}).setdefault(r.rank, set()).add(k)
    return out


def verify_checkpoints(a: Source | Path, b: Source | Path, *, rtol: float = 0.0, atol: float = 0.0,
                       expected_rewrites: dict[str, str] | None = None, trust_pickle: bool = False,
                       progress: Any = None, check_integrity: bool | str = True, fast: bool = True,
                       workers: int | None = None, b_files: set[str] | None = None,
                       values_checked: set[str] | None = None, direct: bool = True,
                       recompute: bool = False, strict: bool = False,
                       evidence: Evidence | None = None, a_inspection: Inspection | None = None) -> dict[str, Any]:
    """Compare two DCP checkpoints in global terms; see the module docstring for the result.

    ``a``, ``b``: each as its command opened it (`reshard.storage.source.opened`: a store's reader
    is handed its `RemoteCheckpoint`), or a local checkpoint's path.

    ``a_inspection``: this run's inspection of ``a`` (a conversion's source, made when it was
    planned), taken instead of inspecting ``a`` again.

    ``expected_rewrites``: keys the *caller* changed on purpose (`reshard convert` passes its
    own plan's); never read from either checkpoint.
    ``recompute``: excuse the differences a conversion or export between the two sides made,
    re-derived from the source side (`conversion_evidence`, `export_evidence`): what `reshard
    verify` does. ``strict`` (with ``recompute``): excuse no conversion change at all (an
    export's left-out keys still are: an export cannot hold them).
    ``evidence``: differences the caller re-derived itself (`plan_evidence`), excused only
    where the output holds exactly what it says.

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
    cache (`reshard.storage.files.fileio`); False reads through it.
    """
    source_a, source_b = Source.of(a), Source.of(b)
    a, b = source_a.root, source_b.root
    _check_tolerances(rtol, atol)
    from reshard.verification.exports import compare_hf_export, hf_export_sides

    hf_sides = hf_export_sides(a, b)  # a checkpoint and its Hugging Face export: through the declared transforms
    if hf_sides is not None:
        src = source_a if hf_sides[0] == a else source_b  # the checkpoint side, as its command opened it
        return compare_hf_export(src, hf_sides[1], a=a, b=b, rtol=rtol, atol=atol)
    rewrites = dict(expected_rewrites or {})
    sa, sb = open_checkpoint(source_a, trust_pickle, a_inspection), open_checkpoint(source_b, trust_pickle)
    sides = _integrity_sides(check_integrity)
    records = _checksum_records(sides, (a, sa), (b, sb))
    with phase_of(progress, "comparing", progress_bytes(sa.index)) as bar:
        verdicts, digests = ({}, {}) if not fast else _fast_verdicts(
            sa.index, sb.index, rtol=rtol, atol=atol, values_checked=values_checked, record_b=records["b"],
            progress=bar, workers=workers, b_files=b_files, direct=direct)
        notes: list[str] = []
        # corrupt input is bad input, not a difference: every recorded checksum is checked before
        # any result (B's items the comparison above already read whole are not read again)
        _check_checksums(sides, (a, sa), (b, sb), notes, workers=workers, digests=digests, progress=progress)
        stats = {"tensors": 0, "objects": 0, "elements": 0, "bytes": 0}
        ranks = _PerRank.of(sa, sb)
        found = _semantic_differences(sa, sb)
        found += _per_rank_differences(ranks, sa, sb)
        found += _key_differences(_KeyComparison(sa.index, sb.index, ranks, rtol, atol, verdicts, b_files, bar,
                                                 stats, notes))
    if recompute and found and evidence is None:
        evidence, why_not = recomputed_evidence(source_a, source_b, sa, sb, trust_pickle=trust_pickle, strict=strict,
                                                verify=verify_checkpoints)
        notes.extend(why_not)
    differences, rewritten = _sort_excused(found, rewrites, evidence, sa.index, sb.index)
    return _result(source_a, source_b, stats, differences, rewritten, notes, evidence, rtol, atol)


def progress_bytes(index: Any) -> int:
    """What the "comparing" phase counts to: the logical bytes of every entry of A (`Entry.nbytes`)."""
    return sum(e.nbytes for e in index.entries.values())


def _check_tolerances(rtol: float, atol: float) -> None:
    """Negative or NaN tolerances are bad input before anything is opened."""
    if rtol < 0 or atol < 0 or math.isnan(rtol) or math.isnan(atol):
        raise BadInput(f"tolerances must be >= 0, got rtol={rtol}, atol={atol}")


# ---------------------------------------------------------------------------------- integrity
def _integrity_sides(check_integrity: bool | str) -> set[str]:
    """The sides whose recorded item checksums are checked (see ``check_integrity``)."""
    return {"a", "b"} if check_integrity is True else ({"a"} if check_integrity == "a" else set())


def _checksum_records(sides: set[str], a: tuple[Path, Inspection], b: tuple[Path, Inspection]) -> dict[str, Any]:
    """Each checked side's manifest record of item checksums (None: not checked, or none
    recorded), its algorithm known: an unknown one is bad input before any work."""
    records = {side: _integrity_record(insp) if side in sides else None for side, (_, insp) in (("a", a), ("b", b))}
    for side, (path, _) in (("a", a), ("b", b)):
        if records[side] is not None:
            check_algorithm(records[side], where=Path(path) / "manifest.json")
    return records


def _check_checksums(sides: set[str], a: tuple[Path, Inspection], b: tuple[Path, Inspection], notes: list[str], *,
                     workers: int | None, digests: dict[str, str], progress: Any = None) -> None:
    """Every recorded checksum of the checked sides, A's first; B's items the byte comparison
    already hashed (``digests``) are not read again."""
    if "a" in sides:
        check_item_checksums(a[1], a[0], notes, workers=workers, progress=progress)
    if "b" in sides:
        check_item_checksums(b[1], b[0], notes, workers=workers, digests=digests, progress=progress)


# ---------------------------------------------------------------------------------- fast path
def _fast_verdicts(ia: Any, ib: Any, *, rtol: float, atol: float, values_checked: set[str] | None,
                   record_b: dict[str, Any] | None, progress: Any, workers: int | None, b_files: set[str] | None,
                   direct: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """Verdicts of the keys decided without decoding, and the checksums of B's items read on
    the way: keys the caller already checked (`_Checked`), the rest of the candidates
    compared byte for byte by `reshard.verification.compare` (hashing B's recorded items as it reads them)."""
    from reshard.verification.compare import compare_tensors

    cand = _fast_candidates(ia, ib, rtol, atol)
    pre = set(values_checked or ()) & set(cand)
    verdicts: dict[str, Any] = {key: _Checked(ia.entries[key], ib.entries[key], b_files) for key in pre}
    cand = [k for k in cand if k not in pre]
    if not cand:
        return verdicts, {}
    res = compare_tensors(ia, ib, cand, progress=progress if b_files is None else None, workers=workers,
                          hash_b=record_b["algorithm"] if record_b else None,
                          hash_names=(record_b or {}).get("items") or (), b_files=b_files, direct=direct)
    verdicts.update(res.verdicts)
    return verdicts, res.digests


# ---------------------------------------------------------------------------------- semantics
def _semantic_differences(sa: Inspection, sb: Inspection) -> list[dict[str, Any]]:
    """``step``, ``tokens_seen`` and (both sides with a manifest) ``data.cursor`` that differ."""
    ra, rb = sa.report, sb.report
    sem = [("step", ra.get("step"), rb.get("step")),
           ("tokens_seen", ra.get("tokens_seen"), rb.get("tokens_seen"))]
    if sa.manifest is not None and sb.manifest is not None:
        sem.append(("data.cursor", sa.manifest.data.cursor, sb.manifest.data.cursor))
    return [{"key": name, "kind": "semantics", "detail": f"{name} {_known(va)} in A, {_known(vb)} in B",
             "a": va, "b": vb} for name, va, vb in sem if va != vb]


def _known(v: Any) -> str:
    return "unknown" if v is None else repr(v)


# ---------------------------------------------------------------------------------- per-rank state
@dataclass
class _PerRank:
    """Both sides' per-rank keys (role -> rank -> keys), and each such key's (role, rank)."""

    a: dict[str, dict[int, set[str]]]
    b: dict[str, dict[int, set[str]]]
    rank_of: dict[str, tuple[str, int]]

    @classmethod
    def of(cls, sa: Inspection, sb: Inspection) -> _PerRank:
        pra, prb = _per_rank(sa), _per_rank(sb)
        rank_of: dict[str, tuple[str, int]] = {}
        for pr in (pra, prb):
            for role, ranks in pr.items():
                for r, keys in ranks.items():
                    for k in keys:
                        rank_of[k] = (role, r)
        return cls(pra, prb, rank_of)

    def rank_elsewhere(self, key: str, other: dict[str, dict[int, set[str]]]) -> bool:
        """A per-rank key whose rank the other side does not have at all (not a key difference)."""
        if key not in self.rank_of:
            return False
        role, r = self.rank_of[key]
        return r not in other.get(role, {})


def _per_rank_differences(ranks: _PerRank, sa: Inspection, sb: Inspection) -> list[dict[str, Any]]:
    """Per side, each per-rank role whose ranks are not exactly ``0..N-1`` of that side's declared size."""
    found = []
    for side, insp, pr in (("A", sa, ranks.a), ("B", sb, ranks.b)):
        for role, present in sorted(pr.items()):
            d = _rank_gap(side, insp, role, present)
            if d:
                found.append(d)
    return found


def _rank_gap(side: str, insp: Inspection, role: str, ranks: dict[int, set[str]]) -> dict[str, Any] | None:
    """The ``per_rank`` difference of one role on one side: ranks missing below the declared
    size (world size for rng, data-parallel width for data) or present beyond it; else None."""
    expect = insp.topology.world_size if role == "rng" else insp.topology.dp
    what = "world size" if role == "rng" else "data-parallel width"
    missing = sorted(set(range(expect)) - set(ranks))
    extra = sorted(r for r in ranks if r >= expect)
    if not (missing or extra):
        return None
    parts = []
    if missing:
        parts.append(f"missing ranks {missing}")
    if extra:
        parts.append(f"ranks {extra} beyond it")
    return {"key": role, "kind": "per_rank", "side": side, "role": role,
            "ranks": sorted(ranks), "expected": expect,
            "detail": f"{side}: per-rank {role} state for {what} {expect} "
                      f"({insp.topology.source} topology): {'; '.join(parts)}"}


# ---------------------------------------------------------------------------------- keys
@dataclass
class _KeyComparison:
    """What comparing the keys of A and B reads (both indexes, per-rank keys, tolerances, the
    fast path's verdicts, a worker's ``b_files``, progress) and adds to (the ``compared``
    counts and the notes of the result)."""

    ia: Any
    ib: Any
    ranks: _PerRank
    rtol: float
    atol: float
    verdicts: dict[str, Any]
    b_files: set[str] | None
    progress: Any
    stats: dict[str, int]
    notes: list[str]

    def tick(self, nbytes: int) -> None:
        _advance(self.progress, nbytes)


def _key_differences(kc: _KeyComparison) -> list[dict[str, Any]]:
    """Every key of either side, in sorted order: its difference, if any."""
    found = []
    for key in sorted(set(kc.ia.entries) | set(kc.ib.entries)):
        d = _key_difference(kc, key)
        if d:
            found.append(d)
    return found


def _key_difference(kc: _KeyComparison, key: str) -> dict[str, Any] | None:
    """One key: present on one side only (unless its rank exists on that side only), a tensor
    on one side and an object on the other, else its tensor or object comparison."""
    ea, eb = kc.ia.entries.get(key), kc.ib.entries.get(key)
    if eb is None:
        kc.tick(ea.nbytes)
        if kc.ranks.rank_elsewhere(key, kc.ranks.b):
            return None
        return {"key": key, "kind": "missing", "detail": f"{_describe(ea)} in A, missing in B"}
    if ea is None:
        if kc.ranks.rank_elsewhere(key, kc.ranks.a):
            return None
        return {"key": key, "kind": "unexpected", "detail": f"not in A, {_describe(eb)} in B"}
    if ea.is_tensor != eb.is_tensor:
        kc.tick(ea.nbytes)
        return {"key": key, "kind": "object", "detail": f"{_describe(ea)} in A, {_describe(eb)} in B"}
    if ea.is_tensor:
        return _tensor_key_difference(kc, key, ea, eb)
    return _object_key_difference(kc, key)


def _tensor_key_difference(kc: _KeyComparison, key: str, ea: Entry, eb: Entry) -> dict[str, Any] | None:
    """A tensor key on both sides (`_compare_tensor`, with the fast path's verdict if any); a
    worker's part ticks A's chunks once the key is done, whatever part of them it compared."""
    d = _compare_tensor(key, ea, eb, kc.ia, kc.ib, kc.rtol, kc.atol, kc.stats, kc.notes,
                        kc.progress if kc.b_files is None else None, kc.verdicts.get(key), kc.b_files)
    if kc.b_files is not None:
        kc.tick(ea.nbytes)
    return d


def _object_key_difference(kc: _KeyComparison, key: str) -> dict[str, Any] | None:
    """An object key on both sides, compared bit for bit (`object_difference`)."""
    kc.stats["objects"] += 1
    same = getattr(kc.ia, "same_object_bytes", None)
    if same is not None and same(kc.ib, key):  # the same bytes, proven loadable: the same value, nothing decoded twice
        kc.tick(kc.ia.entries[key].nbytes)
        return None
    d = object_difference(kc.ia.read_object(key), kc.ib.read_object(key))
    kc.tick(kc.ia.entries[key].nbytes)
    return {"key": key, "kind": "object", "detail": d} if d else None


# ---------------------------------------------------------------------------------- excuses and result
def _sort_excused(found: list[dict[str, Any]], rewrites: dict[str, str], evidence: Evidence | None,
                  ia: Any, ib: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(differences, rewritten)``, in the order found: a difference is rewritten when the
    caller's ``rewrites`` name its key (or a key above it) or ``evidence`` excuses it."""
    indexes = {"a": ia, "b": ib}

    def read(side: str, key: str) -> Any:
        ix = indexes[side]
        if not ix.entries[key].is_tensor:
            return ix.read_object(key)
        value = arrays.read_value(ix, key)  # an integer tensor (a reseeded RNG state) without torch
        return value if value is not None else ix.read_tensor(key)

    differences: list[dict[str, Any]] = []
    rewritten: list[dict[str, Any]] = []
    for d in found:
        reason = _rewrite_reason(d["key"], rewrites)
        if reason is None and evidence is not None:
            reason = evidence.excuse(d, read)
        if reason is None:
            differences.append(d)
        else:
            rewritten.append({"key": d["key"], "reason": reason, "kind": d["kind"], "detail": d["detail"]})
    return differences, rewritten


def _result(a: Source, b: Source, stats: dict[str, int], differences: list[dict[str, Any]],
            rewritten: list[dict[str, Any]], notes: list[str], evidence: Evidence | None,
            rtol: float, atol: float) -> dict[str, Any]:
    """The result dict (the ``--json`` shape of the module docstring)."""
    equal = not differences
    return {
        "equal": equal,
        "a": a.display,  # a remote checkpoint by its URL (reshard.storage.source)
        "b": b.display,
        "compared": stats,
        "differences": differences,
        "rewritten": rewritten,
        "notes": notes,
        "evidence": evidence.what if evidence is not None else None,
        "slice": evidence.slice if evidence is not None else None,
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
