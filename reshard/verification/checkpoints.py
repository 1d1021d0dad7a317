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
  the rule tensors are (`object_difference`): types exactly (``1`` is not ``1.0``), floats
  by their bits (``-0.0 != 0.0``; NaNs equal only with the same payload), tensors by shape,
  dtype and bits, dicts, lists, tuples and sets by structure, recursively.
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

  - **A conversion** (`conversion_evidence`): the output's ``manifest.json`` lineage ends
    with a transition recording its plan options and its source's fingerprint; the plan
    is recomputed from the other side with those options (``trust_pickle`` is this run's,
    never the lineage's) and must have that source fingerprint. Then a dropped key may be
    absent, a rewritten or added key must hold exactly (`identical`) the value the plan's
    state translators write (``plan.new_values``: reseeded RNG, remapped schedule,
    translated data state), a transformed, cast or tied-copy tensor must pass
    `check_transforms` against the source, and a moved ``data.cursor``
    must be the plan's. A forged lineage can only name a plan; if B's values are not that
    plan's, they stay differences. ``strict=True`` (``--strict``) excuses no conversion
    change at all. Only one conversion is re-derived (B made from A, or A from B), not a
    chain.
  - **An export** (`export_evidence`, one side a safetensors export): the keys `reshard
    export` leaves out (trainer state, objects, optimizer state under ``--only model``,
    tied copies written once) are recomputed from the other side with
    `reshard.commands.export.key_actions` and the ``only`` the export's header records; they may
    be absent. ``step`` and ``tokens_seen`` may be unknown on the export side. A value that
    differs is a difference, ``strict`` or not.
  - **A Hugging Face export** (one side a directory with ``config.json``, as ``export --format hf``
    writes): compared through the family's declared names and transforms, re-derived from the
    checkpoint side (`reshard.commands.export.compare_hf_export`).

Bad input (incomplete checkpoint, unreadable or invalid manifest, unsafe pickle) raises the
:class:`~reshard.errors.ReshardError` that says so (exit 2 at the CLI).

**Integrity.** When a side's manifest records item checksums (``integrity``, written by
`reshard convert`: crc32, or sha256 in older manifests; another algorithm is `BadInput`),
every item of that side is hashed and checked before any result is reported (B's items
while the fast path compares them, so they are read once; the rest by
`reshard.storage.integrity.check_items`); an item whose bytes do not match is *corrupt input*,
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
      "tolerance": {"rtol": float, "atol": float},
      "exit_code": 0 | 1                 # 0 equal, 1 different
    }

``progress``: an optional `reshard.render.progress.Progress`; the comparison is its phase
"comparing", advanced by the logical bytes of A's items as they are decided (`progress_bytes`
of A is the total), and the checksum pass its phase "checking checksums" (stored bytes).
"""
from __future__ import annotations

import io
import math
import os
import reprlib
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from reshard.semantics import rules as rules_mod
from reshard.errors import BadInput, Incomplete, ReshardError
from reshard.model.checkpoint import Entry
from reshard.storage.index import CheckpointIndex
from reshard.model.inspection import Inspection
from reshard.planning.describe import inspect_checkpoint
from reshard.storage.integrity import check_algorithm
from reshard.model.plan import Options, Plan
from reshard.render.progress import phase_of

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
                         workers: int | None = None, digests: dict[str, str] | None = None,
                         progress: Any = None) -> None:
    """Hash every item of a checkpoint whose manifest records checksums; BadInput on the first
    mismatch (or on a checksum algorithm reshard does not know). ``digests``: checksums
    already computed for some items (see `reshard.storage.integrity.check_items`)."""
    from reshard.storage.integrity import check_items, describe, first_issue_message, item_bytes

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

    def add(self, box: Any, bad: torch.Tensor, ta: torch.Tensor, tb: torch.Tensor) -> None:
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
    for box in boxes:
        if not box.is_empty():
            ta = ia.read_box(key, box)
            tb = ib.read_box(key, box)
            bad = _differing(ta, tb, rtol, atol)
            stats["elements"] += box.numel
            stats["bytes"] += box.numel * ta.element_size()
            mismatch.add(box, bad, ta, tb)
            _advance(progress, box.numel * ta.element_size())
            del ta, tb, bad
    return mismatch


def _differing(ta: torch.Tensor, tb: torch.Tensor, rtol: float, atol: float) -> torch.Tensor:
    """A flat mask of the elements that differ: bit for bit, or (a tolerance given) beyond it, widened."""
    if rtol > 0 or atol > 0:
        wa, wb = _wide(ta), _wide(tb)
        bad = ~torch.isclose(wa, wb, rtol=rtol, atol=atol, equal_nan=True).reshape(-1)
        del wa, wb
        return bad
    return (_bits(ta) != _bits(tb)).any(dim=1)


def _value_difference(key: str, ea: Entry, m: _Mismatch, rtol: float, atol: float) -> dict[str, Any]:
    """The ``value`` difference of a key with differing elements."""
    how = "bitwise" if not (rtol > 0 or atol > 0) else f"beyond rtol={rtol}, atol={atol}"
    return {"key": key, "kind": "value",
            "detail": f"{m.count} of {ea.numel} elements differ ({how}); first at {m.index}: {m.a!r} in A, {m.b!r} in B",
            "index": m.index, "a": m.a, "b": m.b, "count": m.count, "numel": ea.numel}


# ---------------------------------------------------------------------------------- objects
MAX_OBJECT_DEPTH = 200  # nesting beyond this is bad input (a self-referencing pickle must not recurse forever)


def _float_bits(v: float | complex) -> bytes:
    """The IEEE bits of a float (both parts of a complex): -0.0 and 0.0 differ, NaN payloads count."""
    if isinstance(v, complex):
        return struct.pack("<dd", v.real, v.imag)
    return struct.pack("<d", v)


def _key_token(k: Any) -> Any:
    """A hashable stand-in for a dict key or set element that is equal only for identical values.

    Python's own equality would let ``{1: x}`` match ``{1.0: x}`` and ``{0.0: x}`` match
    ``{-0.0: x}``; the token carries the exact type and, for floats, the bits.
    """
    if isinstance(k, (float, complex)):
        return (type(k), _float_bits(k))
    if isinstance(k, (tuple, frozenset)):
        inner = tuple(_key_token(e) for e in k)
        return (type(k), inner if isinstance(k, tuple) else frozenset(inner))
    return (type(k), k)


def _tensor_same(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Same layout, shape, dtype and bits (the rule `verify` applies to tensor entries)."""
    if x.layout != y.layout or x.shape != y.shape or x.dtype != y.dtype:
        return False
    if x.layout != torch.strided:
        x, y = x.to_dense(), y.to_dense()
    x, y = x.resolve_conj().resolve_neg(), y.resolve_conj().resolve_neg()
    return bool(torch.equal(_bits(x), _bits(y)))


def blob_difference(x: io.BytesIO, y: io.BytesIO, where: str) -> str | None:
    """Two ``io.BytesIO`` blobs compared by their contents, then their position; None when the same."""
    import numpy as np

    bx, by = x.getvalue(), y.getvalue()
    if len(bx) != len(by):
        return f"{where}: BytesIO of {len(bx):,} bytes in A, {len(by):,} bytes in B"
    if bx != by:
        first = int(np.flatnonzero(np.frombuffer(bx, np.uint8) != np.frombuffer(by, np.uint8))[0])
        return f"{where}: BytesIO contents differ (first at byte {first:,})"
    if x.tell() != y.tell():
        return f"{where}: BytesIO position {x.tell()} in A, {y.tell()} in B"
    return None


def object_difference(x: Any, y: Any, path: str = "", _depth: int = 0) -> str | None:
    """The first difference between two objects, bit for bit, as a short line; None when identical.

    Objects are compared by the rule tensors are (`verify` is bitwise unless told otherwise),
    applied to everything an object item can hold:

    * **types exactly**: ``1`` and ``1.0`` differ, ``True`` and ``1`` differ, a list is not a tuple;
    * **floats by their bits** (complex numbers: both parts): ``-0.0 != 0.0``, and two NaNs are
      equal only when their payloads are (``nan == nan`` bit for bit is the same value);
    * **tensors** by layout, shape, dtype and bits (NaN-safe, ``-0.0 != 0.0``); numpy arrays and
      scalars by dtype, shape and bytes (object arrays element by element);
    * **dicts** by their keys (each key by the same rule, so ``{0.0: v}`` is not ``{-0.0: v}``;
      insertion order is not compared) and then values recursively; **lists and tuples** by
      length and element; **sets** by their elements' exact forms;
    * ``str``, ``bytes``, ``int``, ``bool``, ``None`` by ``==`` once the types match;
    * **blobs** (``io.BytesIO``, which a trainer hands to DCP for opaque state) by their bytes
      (``getvalue()``) and then their read position: a BytesIO has no value equality of its
      own (``==`` is identity, so two loads of one item would always "differ");
    * anything else (the safe loader's inert stand-ins): ``==`` when it answers a bool, else
      the ``repr``.

    Nesting deeper than ``MAX_OBJECT_DEPTH`` is `BadInput` (exit 2) rather than a recursion error.
    """
    import numpy as np

    where = path or "value"
    if _depth > MAX_OBJECT_DEPTH:
        raise BadInput(f"an object is nested more than {MAX_OBJECT_DEPTH} levels deep at {where}",
                       hint="No trainer state nests this deep; the object item is malformed or self-referencing.")
    if type(x) is not type(y):
        return f"{where}: {type(x).__name__} {short_repr(x)} in A, {type(y).__name__} {short_repr(y)} in B"
    if isinstance(x, dict):
        tx, ty = {_key_token(k): k for k in x}, {_key_token(k): k for k in y}
        if set(tx) != set(ty):
            only_a = [k for t, k in tx.items() if t not in ty]
            only_b = [k for t, k in ty.items() if t not in tx]
            return f"{where}: keys only in A {short_repr(only_a)}, only in B {short_repr(only_b)}"
        for t, k in tx.items():
            d = object_difference(x[k], y[ty[t]], f"{path}[{k!r}]", _depth + 1)
            if d:
                return d
        return None
    if isinstance(x, (list, tuple)):
        if len(x) != len(y):
            return f"{where}: length {len(x)} in A, {len(y)} in B"
        for i, (u, v) in enumerate(zip(x, y)):
            d = object_difference(u, v, f"{path}[{i}]", _depth + 1)
            if d:
                return d
        return None
    if isinstance(x, (set, frozenset)):
        same = {_key_token(e) for e in x} == {_key_token(e) for e in y}
        return None if same else f"{where}: {short_repr(x)} in A, {short_repr(y)} in B"
    if isinstance(x, torch.Tensor):
        if x.layout != y.layout or x.shape != y.shape or x.dtype != y.dtype:
            return f"{where}: {short_repr(x)} in A, {short_repr(y)} in B"
        return None if _tensor_same(x, y) else f"{where}: tensor values differ (bitwise)"
    if isinstance(x, (float, complex)):
        return None if _float_bits(x) == _float_bits(y) else f"{where}: {x!r} in A, {y!r} in B"
    if isinstance(x, np.ndarray):
        if x.dtype != y.dtype or x.shape != y.shape:
            return f"{where}: array {x.dtype}{list(x.shape)} in A, {y.dtype}{list(y.shape)} in B"
        if x.dtype.hasobject:
            return object_difference(x.tolist(), y.tolist(), path, _depth + 1)
        return None if x.tobytes() == y.tobytes() else f"{where}: array values differ (bitwise)"
    if isinstance(x, np.generic):
        return None if (x.dtype, x.tobytes()) == (y.dtype, y.tobytes()) else f"{where}: {x!r} in A, {y!r} in B"
    if isinstance(x, io.BytesIO):
        return blob_difference(x, y, where)
    try:
        res = x == y
        same = res if isinstance(res, bool) else repr(x) == repr(y)
    except Exception:  # noqa: BLE001 - objects whose == misbehaves: compare their repr
        same = repr(x) == repr(y)
    return None if same else f"{where}: {short_repr(x)} in A, {short_repr(y)} in B"


def identical(x: Any, y: Any) -> bool:
    """True when ``x`` and ``y`` are the same value bit for bit (see `object_difference`)."""
    return object_difference(x, y) is None


# ---------------------------------------------------------------------------------- main
def _per_rank(insp: Inspection) -> dict[str, dict[int, set[str]]]:
    """role -> rank -> keys, for per-rank keys (roles rng/data with a rank)."""
    out: dict[str, dict[int, set[str]]] = {}
    for k, r in insp.classification.roles.items():
        if r.role in PER_RANK_ROLES and r.rank is not None:
            out.setdefault(r.role, {}).setdefault(r.rank, set()).add(k)
    return out


# ---------------------------------------------------------------------------------- evidence
@dataclass
class Evidence:
    """Differences the verifier re-derived itself, each with what the output must hold there.

    Nothing in it is read from a report: it is built from a plan recomputed from the source
    (`conversion_evidence`; `plan_evidence` for a plan in hand) or from the selection
    `reshard export` makes, computed on the source (`export_evidence`). ``source`` is the
    side (``"a"`` or ``"b"``) the conversion or export started from; the other side is its
    output. A difference is excused only when `excuse` finds it here *and* the output's
    value is the one re-derived.
    """

    source: str
    what: str                                                            # one line: where it came from
    dropped: dict[str, str] = field(default_factory=dict)                # key -> reason: absent from the output
    values: dict[str, tuple[str, Any]] = field(default_factory=dict)     # key -> (reason, the value written)
    proven: dict[str, str] = field(default_factory=dict)                 # key -> reason: checked by check_transforms
    semantics: dict[str, tuple[str, Any]] = field(default_factory=dict)  # name -> (reason, the output's value)

    @property
    def output(self) -> str:
        return "b" if self.source == "a" else "a"

    def excuse(self, d: dict[str, Any], read: Any) -> str | None:
        """Why difference ``d`` is exactly what the conversion or export of the source produces, or None.

        ``read(side, key)`` reads the stored value of ``key`` on ``side`` (an object or a whole tensor).
        """
        key, kind = d["key"], d["kind"]
        absent_from_output = "missing" if self.output == "b" else "unexpected"
        only_in_output = "unexpected" if self.output == "b" else "missing"
        if kind == "semantics":
            if key in self.semantics and identical(d[self.output], self.semantics[key][1]):
                return self.semantics[key][0]
            return None
        if kind == absent_from_output:
            return self.dropped.get(key)
        if kind not in (only_in_output, "value", "object", "shape", "dtype"):
            return None  # per-rank completeness is never a conversion's doing
        if key in self.values:
            reason, want = self.values[key]
            return f"{reason} (value re-derived)" if identical(read(self.output, key), want) else None
        if key in self.proven and kind != "object":
            return self.proven[key]
        return None


def plan_evidence(plan: Plan, *, source: str, what: str, src: Path, out: Path, src_index: Any,
                  out_index: Any, transforms: bool = True) -> Evidence:
    """The differences ``plan`` produces between ``src`` and its output ``out``.

    Dropped keys may be absent; rewritten and added keys must hold exactly the values the
    plan's state translators wrote (``plan.new_values``: RNG reseeds, schedule remaps,
    translated data state); tensors the plan transforms, casts or copies from a tied key are
    excused only when `check_transforms` proves them from the source (and
    their shape and dtype are the planned ones); a cursor the plan moved must be the one it
    computed. ``transforms=False`` skips the tensors (a chain's hops: their layouts compose).
    """

    ev = Evidence(source, what)
    for a in plan.keys:
        if a.action == "dropped":
            ev.dropped[a.key] = f"dropped: {a.reason}"
        elif a.action in ("rewritten", "added") and a.key in plan.new_values:
            ev.values[a.key] = (f"{a.action}: {a.reason}", plan.new_values[a.key])
    candidates: dict[str, str] = {}
    for t in plan.tensors if transforms else ():
        se = src_index.entries.get(t.copy_from or t.key)
        if t.transform:
            why = "TP-dependent layout rewritten (checked in canonical form against the source)"
        elif t.copy_from:
            why = f"tied copy of '{t.copy_from}' (checked equal to it in the source)"
        elif se is not None and se.is_tensor and se.dtype_name != t.dtype:
            why = f"cast to {t.dtype} for a reduced copy (checked equal to the source cast)"
        else:
            continue
        oe = out_index.entries.get(t.key)
        if oe is not None and oe.is_tensor and tuple(oe.shape) == tuple(t.shape) and oe.dtype_name == t.dtype:
            candidates[t.key] = why
    if candidates:
        bad = set(check_transforms(src, out, plan))
        ev.proven = {k: why for k, why in candidates.items() if k not in bad}
    if plan.data is not None and plan.data.cursor_after is not None:
        ev.semantics["data.cursor"] = (f"data cursor moved by the plan ({plan.data.policy})", int(plan.data.cursor_after))
    return ev


def _recorded_options(d: Any) -> Options | str:
    """The plan options a lineage entry records, type-checked field by field, or why they cannot be used."""
    import dataclasses
    import typing

    if not isinstance(d, dict):
        return "records no plan options (written by an older reshard), so its plan cannot be recomputed"
    hints = typing.get_type_hints(Options)
    unknown = sorted(str(k) for k in d if k not in hints)
    if unknown:
        return f"records plan options this reshard does not know ({unknown[:3]})"
    for name, v in d.items():
        allowed = tuple(typing.get_origin(t) or t for t in (typing.get_args(hints[name]) or (hints[name],)))
        if not isinstance(v, allowed) or (isinstance(v, bool) and bool not in allowed):
            return f"records plan option {name}={short_repr(v)}, which is not a {hints[name]}"
    missing = [f.name for f in dataclasses.fields(Options)
               if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in d]
    if missing:
        return f"records no plan option {missing[0]}"
    return Options(**d)


def _rules_file_problem(rules: str) -> str | None:
    """A rules file a lineage names is read only if it is a small regular file (no FIFO, device, ...).

    A shipped family's name (``--rules llama-torchtitan``) names no file: it is read from reshard's own data.
    """
    if "/" not in rules and os.sep not in rules and rules_mod.shipped(rules) is not None:
        return None
    try:
        st = os.stat(rules)
    except OSError as exc:
        return f"names the rules file {rules}, which cannot be opened here ({exc.strerror or exc})"
    if not stat.S_ISREG(st.st_mode):
        return f"names the rules file {rules}, which is not a regular file"
    if st.st_size > MAX_RULES_BYTES:
        return f"names the rules file {rules}, larger than {MAX_RULES_BYTES} bytes"
    return None


MAX_RULES_BYTES = 1 << 20
_RECOMPUTE_ERRORS = (ReshardError, ValueError, TypeError, KeyError, AttributeError, IndexError)


@dataclass
class _Hop:
    """One conversion of a chain: ``plan`` recomputed from ``src``, whose output is ``out``."""

    plan: Plan
    src: Path
    src_insp: Inspection
    out: Path
    out_insp: Inspection
    where: str  # the lineage entry that recorded it


MAX_HOPS = 8


def _recompute_hop(src: Path, si: Inspection, entry: Any, where: str, trust_pickle: bool) -> tuple[Plan | None, str]:
    """The plan a lineage ``entry`` records, recomputed from ``src``, if ``src`` is its source; else (None, why not)."""
    from reshard.planning.plan import make_plan

    options = _recorded_options(entry.policies.get("options"))
    fingerprint = entry.policies.get("source_fingerprint")
    if isinstance(options, str):
        return None, f"{where} {options}"
    if not isinstance(fingerprint, str):
        return None, f"{where} records no source fingerprint"
    if options.rules and (why := _rules_file_problem(options.rules)):
        return None, f"{where} {why}"
    options.trust_pickle = trust_pickle  # a lineage never decides what gets unpickled
    try:
        plan = make_plan(src, options, inspection=si if options.from_spec is None else None)
    except _RECOMPUTE_ERRORS as exc:
        why = exc.message if isinstance(exc, ReshardError) else f"{type(exc).__name__}: {exc}"
        return None, f"{where}: its plan cannot be recomputed from {src} ({why})"
    if plan.source_fingerprint() != fingerprint:
        return None, (f"{where} names a source with fingerprint {fingerprint}, not {src} "
                      f"({plan.source_fingerprint()})")
    if not plan.feasible:
        return None, f"{where}: its options give an infeasible plan from {src}"
    return plan, ""


def _chain(src: Path, out: Path, si: Inspection, so: Inspection, trust_pickle: bool) -> tuple[list[_Hop], str | None]:
    """The conversions from ``src`` to ``out``, oldest first, each recomputed; ([], why not) otherwise.

    Walks back from ``out``: the last lineage entry of each checkpoint must be a transition
    whose plan, recomputed from ``src`` (or else from the checkpoint the entry's
    ``source_path`` names, only a place to look), has the recorded source fingerprint.
    """
    hops: list[_Hop] = []
    cur, ci = Path(out), so
    visited = {Path(out).resolve()}
    while len(hops) < MAX_HOPS:
        lineage = list(ci.manifest.lineage) if ci.manifest is not None else []
        if not lineage or lineage[-1].event != "transition":
            return [], None if not hops else f"{cur} (between {src} and {out}) was not made by a conversion"
        entry = lineage[-1]
        where = f"{cur / 'manifest.json'} (lineage entry {len(lineage)})"
        plan, why = _recompute_hop(Path(src), si, entry, where, trust_pickle)
        if plan is not None:
            hops.append(_Hop(plan, Path(src), si, cur, ci, where))
            return hops[::-1], None
        named = entry.policies.get("source_path")
        if not isinstance(named, str) or not named or Path(named).resolve() in visited:
            return [], why
        prev = Path(named)
        try:
            pi = _open(prev, trust_pickle)
        except ReshardError as exc:
            return [], f"{why}; the source it names, {prev}, cannot be opened ({exc.message})"
        plan, why2 = _recompute_hop(prev, pi, entry, where, trust_pickle)
        if plan is None:
            return [], f"{why}; {why2}"
        hops.append(_Hop(plan, prev, pi, cur, ci, where))
        visited.add(prev.resolve())
        cur, ci = prev, pi
    return [], f"{out} is more than {MAX_HOPS} conversions away from {src}"


def _compose(hops: list[_Hop], source: str, what: str) -> Evidence:
    """One `Evidence` for a chain, oldest hop first: for each key the last conversion that dropped or wrote it decides."""
    ev = Evidence(source, what)
    for h in hops:
        e = plan_evidence(h.plan, source="a", what="", src=h.src, out=h.out, src_index=h.src_insp.index,
                          out_index=h.out_insp.index, transforms=len(hops) == 1)
        for k, why in e.dropped.items():
            ev.values.pop(k, None)
            ev.proven.pop(k, None)
            ev.dropped[k] = why
        for k, v in e.values.items():
            ev.dropped.pop(k, None)
            ev.proven.pop(k, None)
            ev.values[k] = v
        ev.proven.update(e.proven)
        ev.semantics.update(e.semantics)
    return ev


def conversion_evidence(a: Path, b: Path, sa: Inspection, sb: Inspection, *,
                        trust_pickle: bool = False) -> tuple[Evidence | None, list[str]]:
    """Re-derive the changes the conversions between A and B made, from the source side itself.

    One side (the output) must carry a manifest whose last lineage entry is a transition
    recording its plan options and its source's fingerprint (`reshard.semantics.transition`). The
    plan is recomputed from the other side with those options (and this run's
    ``trust_pickle``: a lineage never decides what gets unpickled); it must be feasible and
    have the recorded source fingerprint, i.e. the other side is that conversion's source.
    The returned `Evidence` then excuses exactly what that plan produces (`plan_evidence`).

    A chain (A -> X -> ... -> B) is followed back through the checkpoints the lineage
    entries' ``source_path`` name, each only a place to look: every hop's plan is recomputed
    from the checkpoint found there and must have its recorded fingerprint, and every
    intermediate checkpoint is itself verified against its source with that hop's evidence
    (a full comparison: each intermediate is read once more), because later hops' rewrites
    are computed from its values. Then the last hop that dropped or wrote a key decides
    what B must hold there. Transformed or cast tensors are excused for a single
    conversion only. Reports inside any checkpoint are never read. Returns (evidence or
    None, notes saying why a lineage found could not be used).
    """
    notes: list[str] = []
    for source, (src, out, si, so) in (("a", (a, b, sa, sb)), ("b", (b, a, sb, sa))):
        hops, why = _chain(src, out, si, so, trust_pickle)
        if not hops:
            if why:
                notes.append(f"{why}: its changes count as differences")
            continue
        for h in hops[:-1]:  # the intermediates later plans read; the last output is what this verify checks
            ev = plan_evidence(h.plan, source="a", what=h.where, src=h.src, out=h.out, src_index=h.src_insp.index,
                               out_index=h.out_insp.index)
            try:
                r = verify_checkpoints(h.src, h.out, trust_pickle=trust_pickle, evidence=ev)
            except ReshardError as exc:
                r = {"equal": False, "differences": [{"key": str(h.out), "detail": exc.message}]}
            if not r["equal"]:
                d = r["differences"][0]
                notes.append(f"{h.out} is not what the plan its lineage records makes of {h.src} "
                             f"({d['key']}: {d['detail']}): the changes of the chain count as differences")
                hops = []
                break
        if not hops:
            continue
        last = hops[-1]
        via = "" if len(hops) == 1 else f", through {len(hops) - 1} intermediate checkpoint(s), each verified"
        what = (f"the plan recomputed from {src} with the options {last.where} records "
                f"(fingerprint {last.plan.fingerprint()}){via}")
        return _compose(hops, source, what), notes
    return None, notes


def export_evidence(a: Path, b: Path, sa: Inspection, sb: Inspection) -> tuple[Evidence | None, list[str]]:
    """What an export of one side leaves out, re-derived from that side (never from ``export-report.json``).

    When exactly one side is a safetensors export, the keys its export of the other side
    drops (trainer state, objects, optimizer state under ``--only model``, tied copies
    written once) are recomputed from the other side with `reshard.commands.export.key_actions` and
    the ``only`` the export records in its header; they may be absent from the export. The
    semantics ``step`` and ``tokens_seen`` may be unknown on the export side (the format has
    no trainer counters). Nothing else is excused: a value that differs is a difference.
    """
    from reshard.commands.export import key_actions
    from reshard.storage.safetensors_format import ExportIndex

    kinds = (isinstance(sa.index, ExportIndex), isinstance(sb.index, ExportIndex))
    if kinds not in ((False, True), (True, False)):
        return None, []
    source, src, si, so = ("a", a, sa, sb) if kinds[1] else ("b", b, sb, sa)
    counters = "an export carries no trainer counters"
    ev = Evidence(source, f"what an export of {src} leaves out, recomputed from {src}",
                  semantics={"step": (counters, None), "tokens_seen": (counters, None)})
    meta = so.index.metadata
    only = meta.get("only")
    if meta.get("reshard_export") is None:
        return ev, [f"{so.index.path} was not written by `reshard export`: every key it lacks counts as a difference"]
    if only not in ("model", "model+optim"):
        return ev, [f"{so.index.path} records --only {short_repr(only)}, which `reshard export` never writes: "
                    "every key it lacks counts as a difference"]
    mdict = si.manifest.to_dict() if si.manifest is not None else {}
    for rec in key_actions(si.index, si.classification, mdict, only=only):
        if rec.get("action") in ("dropped", "tied_copy"):
            ev.dropped[rec["key"]] = f"not exported (--only {only}): {rec.get('reason', '')}"
    ev.what += f" (--only {only})"
    return ev, []


def verify_checkpoints(a: Path, b: Path, *, rtol: float = 0.0, atol: float = 0.0,
                       expected_rewrites: dict[str, str] | None = None, trust_pickle: bool = False,
                       progress: Any = None, check_integrity: bool | str = True, fast: bool = True,
                       workers: int | None = None, b_files: set[str] | None = None,
                       values_checked: set[str] | None = None, direct: bool = True,
                       recompute: bool = False, strict: bool = False,
                       evidence: Evidence | None = None) -> dict[str, Any]:
    """Compare two DCP checkpoints in global terms; see the module docstring for the result.

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
    cache (`reshard.storage.fileio`); False reads through it.
    """
    a, b = Path(a), Path(b)
    _check_tolerances(rtol, atol)
    from reshard.commands.export import compare_hf_export, hf_export_sides

    hf_sides = hf_export_sides(a, b)  # a checkpoint and its Hugging Face export: through the declared transforms
    if hf_sides is not None:
        return compare_hf_export(*hf_sides, a=a, b=b, rtol=rtol, atol=atol)
    rewrites = dict(expected_rewrites or {})
    sa, sb = _open(a, trust_pickle), _open(b, trust_pickle)
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
        evidence, why_not = _recomputed_evidence(a, b, sa, sb, trust_pickle=trust_pickle, strict=strict)
        notes.extend(why_not)
    differences, rewritten = _sort_excused(found, rewrites, evidence, sa.index, sb.index)
    return _result(a, b, stats, differences, rewritten, notes, evidence, rtol, atol)


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
    d = object_difference(kc.ia.read_object(key), kc.ib.read_object(key))
    kc.tick(kc.ia.entries[key].nbytes)
    return {"key": key, "kind": "object", "detail": d} if d else None


# ---------------------------------------------------------------------------------- excuses and result
def _recomputed_evidence(a: Path, b: Path, sa: Inspection, sb: Inspection, *, trust_pickle: bool,
                         strict: bool) -> tuple[Evidence | None, list[str]]:
    """The changes re-derived from the source side: an export's (``strict`` or not: an export
    cannot hold what it leaves out), else a conversion's unless ``strict``; with notes on
    lineages that could not be used."""
    evidence, why_not = export_evidence(a, b, sa, sb)
    if evidence is None and not strict:
        evidence, why_not = conversion_evidence(a, b, sa, sb, trust_pickle=trust_pickle)
    return evidence, why_not


def _sort_excused(found: list[dict[str, Any]], rewrites: dict[str, str], evidence: Evidence | None,
                  ia: Any, ib: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(differences, rewritten)``, in the order found: a difference is rewritten when the
    caller's ``rewrites`` name its key (or a key above it) or ``evidence`` excuses it."""
    indexes = {"a": ia, "b": ib}

    def read(side: str, key: str) -> Any:
        ix = indexes[side]
        return ix.read_tensor(key) if ix.entries[key].is_tensor else ix.read_object(key)

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


def _result(a: Path, b: Path, stats: dict[str, int], differences: list[dict[str, Any]],
            rewritten: list[dict[str, Any]], notes: list[str], evidence: Evidence | None,
            rtol: float, atol: float) -> dict[str, Any]:
    """The result dict (the ``--json`` shape of the module docstring)."""
    equal = not differences
    return {
        "equal": equal,
        "a": str(a),
        "b": str(b),
        "compared": stats,
        "differences": differences,
        "rewritten": rewritten,
        "notes": notes,
        "evidence": evidence.what if evidence is not None else None,
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
    from reshard.units import human_bytes

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
        if r.get("evidence"):
            out.append(f"expected rewrites taken from {r['evidence']}, each re-derived (--strict excuses none)")
    for note in r.get("notes", [])[:limit]:
        out.append(f"note        {note}")
    return "\n".join(out)


def check_transforms(src: Path, out: Path, plan: Plan, b_files: set[str] | None = None) -> list[str]:
    """Prove each TP-dependent rewrite: same canonical (TP = 1) tensor on both sides.

    ``b_files``: only tensors with a chunk in these files of ``out`` (a distributed worker's part).
    """
    from reshard.semantics import transforms
    from reshard.storage.local_format import open_any
    from reshard.semantics.conventions import reshard_key

    a, b = CheckpointIndex.open(src), open_any(out, source_key=reshard_key)
    problems = []
    def mine(key: str) -> bool:
        return b_files is None or any(c.location is not None and c.location.file in b_files
                                      for c in b.entries[key].chunks)

    for t in plan.tensors:
        tr = t.transform
        if not tr or t.key not in b.entries or not mine(t.key):
            continue
        x, y = a.read_tensor(t.copy_from or t.key), b.read_tensor(t.key)
        if tr["kind"] == "reinterleave":
            ok = torch.equal(transforms.to_canonical(x, tr["dim"], tr["parts"], tr["from_tp"]),
                             transforms.to_canonical(y, tr["dim"], tr["parts"], tr["to_tp"]))
        elif tr["kind"] == "select":  # a slice's router rows: exactly the kept experts' rows of the source
            ok = torch.equal(transforms.select_rows(x, tr["dim"], tr["index"]).to(y.dtype), y)
        else:
            n = min(tr["from_rows"], tr["to_rows"])
            ok = torch.equal(x.narrow(tr["dim"], 0, n), y.narrow(tr["dim"], 0, n))
        if not ok:
            problems.append(t.key)
    for t in plan.tensors:
        if t.transform or t.key not in b.entries or not mine(t.key):
            continue
        src_key = t.copy_from or t.key
        if src_key not in a.entries:
            continue  # a new key (e.g. a new rank's reseeded RNG): nothing in the source to compare with
        if not t.copy_from and a.entries[src_key].dtype_name == t.dtype:
            continue  # a plain copy: the global comparison in verify covers it, no second read
        x = a.read_tensor(src_key)
        if not torch.equal(x.to(getattr(torch, t.dtype)), b.read_tensor(t.key)):
            problems.append(t.key)
    return problems
