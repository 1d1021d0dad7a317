"""Box arithmetic in global tensor coordinates.

DCP stores every tensor as chunks ``(offsets, sizes)`` inside its global shape. Everything
reshard does with tensors (completeness, reading a box, resharding) reduces to a few
questions about such boxes, answered here exactly and without touching bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Iterable, Sequence


@dataclass(frozen=True)
class Box:
    """An axis-aligned box ``[offsets, offsets + sizes)`` in a tensor's global coordinates."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return prod(self.sizes) if self.sizes else 1

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    def is_empty(self) -> bool:
        return any(s == 0 for s in self.sizes)

    def intersect(self, other: "Box") -> "Box | None":
        """The common box, or None when the two do not overlap (empty boxes never overlap)."""
        if len(self.offsets) != len(other.offsets):
            raise ValueError("boxes of different rank")
        offs, sizes = [], []
        for a0, a1, b0, b1 in zip(self.offsets, self.ends, other.offsets, other.ends):
            lo, hi = max(a0, b0), min(a1, b1)
            if hi <= lo:
                return None
            offs.append(lo)
            sizes.append(hi - lo)
        if not self.offsets and (self.is_empty() or other.is_empty()):
            return None
        return Box(tuple(offs), tuple(sizes))

    def relative_to(self, outer: "Box") -> "Box":
        """This box expressed in the local coordinates of ``outer`` (which must contain it)."""
        return Box(tuple(o - p for o, p in zip(self.offsets, outer.offsets)), self.sizes)

    def contains(self, other: "Box") -> bool:
        if len(self.offsets) != len(other.offsets):
            raise ValueError("boxes of different rank")
        return all(
            a0 <= b0 and b1 <= a1
            for a0, a1, b0, b1 in zip(self.offsets, self.ends, other.offsets, other.ends)
        )

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))


def contiguous_run(rel: Box, sizes: Sequence[int]) -> int | None:
    """The flat element index where ``rel`` (a box in the local coordinates of a C-contiguous
    array of shape ``sizes``) starts, when its elements are one contiguous run; else None.

    Contiguous exactly when every dim after the last non-full one is full (true by
    definition) and every dim before it has size 1. The run holds ``rel.numel`` elements.
    Byte splicing (`reshard.io.splice`) and byte comparison (`reshard.io.compare`) both
    decide with it whether a box can be moved or compared as one range.
    """
    n = len(sizes)
    k = n - 1
    while k >= 0 and rel.sizes[k] == sizes[k]:
        k -= 1
    if any(rel.sizes[j] != 1 for j in range(k)):
        return None
    flat = 0
    for o, s in zip(rel.offsets, sizes):
        flat = flat * s + o
    return flat


def whole(shape: Sequence[int]) -> Box:
    return Box(tuple(0 for _ in shape), tuple(int(s) for s in shape))


@dataclass(frozen=True)
class CoverageProblem:
    """Why a set of chunks does not tile a global shape exactly once."""

    kind: str  # "out_of_bounds" | "overlap" | "gap" | "rank_mismatch"
    detail: str


def coverage_problems(shape: Sequence[int], chunks: Iterable[Box]) -> list[CoverageProblem]:
    """Check that ``chunks`` tile ``shape`` exactly: no chunk outside, no overlap, no gap.

    Exact and linear in the number of chunks for the common case: every chunk is checked
    against the bounds, pairwise overlaps are found with a sweep along dim 0, and a gap
    exists exactly when the (non-overlapping, in-bounds) volumes do not add up to the
    global volume.
    """
    shape = tuple(int(s) for s in shape)
    total = prod(shape) if shape else 1
    problems: list[CoverageProblem] = []
    boxes = []
    for c in chunks:
        if len(c.offsets) != len(shape) or len(c.sizes) != len(shape):
            problems.append(CoverageProblem("rank_mismatch", f"chunk {c.offsets}+{c.sizes} has rank {len(c.sizes)}, tensor rank {len(shape)}"))
            continue
        if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(c.offsets, c.sizes, shape)):
            problems.append(CoverageProblem("out_of_bounds", f"chunk at {list(c.offsets)} size {list(c.sizes)} lies outside {list(shape)}"))
            continue
        if c.numel == 0:
            continue
        boxes.append(c)
    if problems:
        return problems
    if not shape:
        if len(boxes) > 1:
            problems.append(CoverageProblem("overlap", f"{len(boxes)} chunks for a scalar"))
        elif not boxes:
            problems.append(CoverageProblem("gap", "scalar tensor has no chunk"))
        return problems
    # Sweep along the dim with the most distinct cut positions (dim 0 for FSDP, dim 1 for
    # row-parallel TP): only boxes whose ranges along it overlap can overlap.
    sweep = max(range(len(shape)), key=lambda d: len({b.offsets[d] for b in boxes}))
    boxes.sort(key=lambda b: (b.offsets[sweep], b.offsets))
    active: list[Box] = []
    for b in boxes:
        active = [a for a in active if a.ends[sweep] > b.offsets[sweep]]
        for a in active:
            if a.intersect(b) is not None:
                problems.append(CoverageProblem(
                    "overlap",
                    f"chunks at {list(a.offsets)} size {list(a.sizes)} and at {list(b.offsets)} size {list(b.sizes)} overlap",
                ))
                return problems
        active.append(b)
    covered = sum(b.numel for b in boxes)
    if covered != total:
        problems.append(CoverageProblem("gap", f"chunks cover {covered} of {total} elements of {list(shape)}"))
    return problems
