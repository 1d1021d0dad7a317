"""Property tests for reshard.model.geometry: box arithmetic and exact-coverage checks.

Oracles: tilings built by construction (grids, FSDP2-style ceil-division grids with
trailing empty pieces, recursive guillotine splits) and a brute-force numpy count of how
many chunks cover each element, on small shapes.
"""
from __future__ import annotations

from math import prod

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from reshard.model.geometry import Box, coverage_problems, tiles_exactly_fast, whole

# local settings (a global profile would change other test files' hypothesis settings)
prop = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------- strategies

dims = st.integers(min_value=1, max_value=6)
shapes = st.lists(dims, min_size=1, max_size=4).map(tuple)


def _grid(pieces_per_dim: list[list[tuple[int, int]]]) -> list[Box]:
    """Cartesian product of per-dim intervals ``(start, size)``."""
    boxes = [((), ())]
    for pieces in pieces_per_dim:
        boxes = [(o + (s,), z + (n,)) for o, z in boxes for s, n in pieces]
    return [Box(o, z) for o, z in boxes]


@st.composite
def cuts(draw, n: int) -> list[tuple[int, int]]:
    """Split ``[0, n)`` into consecutive intervals at random cut points (repeats give empty pieces)."""
    points = sorted(draw(st.lists(st.integers(0, n), max_size=4)))
    bounds = [0] + points + [n]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:])]


def ceil_pieces(n: int, k: int) -> list[tuple[int, int]]:
    """FSDP2 / torch.chunk: ``k`` pieces of ``ceil(n / k)``, the last ones shorter or empty."""
    step = -(-n // k) if n else 0
    out = []
    for r in range(k):
        start = min(r * step, n)
        out.append((start, min(start + step, n) - start))
    return out


@st.composite
def grid_tilings(draw, shape_strategy=shapes):
    shape = draw(shape_strategy)
    chunks = _grid([draw(cuts(n)) for n in shape])
    return shape, draw(st.permutations(chunks))


@st.composite
def fsdp_tilings(draw):
    """Each dim split ``k`` ways with ceil division (k may exceed the dim: empty pieces)."""
    shape = draw(shapes)
    ks = [draw(st.integers(1, 5)) for _ in shape]
    return shape, _grid([ceil_pieces(n, k) for n, k in zip(shape, ks)])


@st.composite
def guillotine_tilings(draw):
    """Recursive binary splits: tilings that are not grids."""
    shape = draw(shapes)
    todo, done = [whole(shape)], []
    budget = draw(st.integers(0, 12))
    while todo:
        b = todo.pop()
        splittable = [d for d, s in enumerate(b.sizes) if s >= 2]
        if budget <= 0 or not splittable or not draw(st.booleans()):
            done.append(b)
            continue
        budget -= 1
        d = draw(st.sampled_from(splittable))
        cut = draw(st.integers(1, b.sizes[d] - 1))
        lo_sizes = b.sizes[:d] + (cut,) + b.sizes[d + 1:]
        hi_offsets = b.offsets[:d] + (b.offsets[d] + cut,) + b.offsets[d + 1:]
        hi_sizes = b.sizes[:d] + (b.sizes[d] - cut,) + b.sizes[d + 1:]
        todo += [Box(b.offsets, lo_sizes), Box(hi_offsets, hi_sizes)]
    return shape, draw(st.permutations(done))


any_tiling = st.one_of(grid_tilings(), fsdp_tilings(), guillotine_tilings())


@st.composite
def box_in(draw, shape, allow_empty=True):
    offs, sizes = [], []
    for n in shape:
        if allow_empty or n == 0:
            o = draw(st.integers(0, n))
            s = draw(st.integers(0, n - o))
        else:
            o = draw(st.integers(0, n - 1))
            s = draw(st.integers(1, n - o))
        offs.append(o)
        sizes.append(s)
    return Box(tuple(offs), tuple(sizes))


small_shapes = st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple)


def kinds(problems) -> list[str]:
    return [p.kind for p in problems]


def mask(shape, box: Box) -> np.ndarray:
    m = np.zeros(shape, dtype=bool)
    m[box.slices()] = True
    return m


def counts(shape, boxes) -> np.ndarray:
    c = np.zeros(shape, dtype=np.int64)
    for b in boxes:
        c[b.slices()] += 1
    return c


# ----------------------------------------------------------------------------- tilings


@prop
@given(any_tiling)
def test_tilings_have_no_problems(tiling):
    shape, chunks = tiling
    assert sum(c.numel for c in chunks if not c.is_empty()) == prod(shape)  # sanity of the oracle
    assert coverage_problems(shape, chunks) == []


@prop
@given(any_tiling, st.data())
def test_removing_a_chunk_leaves_a_gap(tiling, data):
    shape, chunks = tiling
    nonempty = [i for i, c in enumerate(chunks) if not c.is_empty()]
    i = data.draw(st.sampled_from(nonempty))
    rest = chunks[:i] + chunks[i + 1:]
    assert kinds(coverage_problems(shape, rest)) == ["gap"]


@prop
@given(any_tiling, st.data())
def test_removing_an_empty_chunk_changes_nothing(tiling, data):
    shape, chunks = tiling
    empty = [i for i, c in enumerate(chunks) if c.is_empty()]
    assume(empty)
    i = data.draw(st.sampled_from(empty))
    assert coverage_problems(shape, chunks[:i] + chunks[i + 1:]) == []


@prop
@given(any_tiling, st.data())
def test_duplicating_a_chunk_is_an_overlap(tiling, data):
    shape, chunks = tiling
    nonempty = [c for c in chunks if not c.is_empty()]
    c = data.draw(st.sampled_from(nonempty))
    pos = data.draw(st.integers(0, len(chunks)))
    assert kinds(coverage_problems(shape, chunks[:pos] + [c] + chunks[pos:])) == ["overlap"]


@prop
@given(any_tiling, st.data())
def test_extending_a_chunk_into_its_neighbour_is_an_overlap(tiling, data):
    shape, chunks = tiling
    options = [
        (i, d)
        for i, c in enumerate(chunks)
        if not c.is_empty()
        for d in range(len(shape))
        if c.ends[d] < shape[d]
    ]
    assume(options)
    i, d = data.draw(st.sampled_from(options))
    c = chunks[i]
    grow = data.draw(st.integers(1, shape[d] - c.ends[d]))
    sizes = c.sizes[:d] + (c.sizes[d] + grow,) + c.sizes[d + 1:]
    # also possibly grow backwards, which keeps it in bounds
    if c.offsets[d] > 0 and data.draw(st.booleans()):
        back = data.draw(st.integers(1, c.offsets[d]))
        offsets = c.offsets[:d] + (c.offsets[d] - back,) + c.offsets[d + 1:]
        sizes = sizes[:d] + (sizes[d] + back,) + sizes[d + 1:]
    else:
        offsets = c.offsets
    grown = chunks[:i] + [Box(offsets, sizes)] + chunks[i + 1:]
    assert kinds(coverage_problems(shape, grown)) == ["overlap"]


@prop
@given(any_tiling, st.data())
def test_shrinking_a_chunk_leaves_a_gap(tiling, data):
    shape, chunks = tiling
    options = [(i, d) for i, c in enumerate(chunks) if not c.is_empty() for d in range(len(shape))]
    i, d = data.draw(st.sampled_from(options))
    c = chunks[i]
    cut = data.draw(st.integers(1, c.sizes[d]))
    from_front = data.draw(st.booleans())
    offsets = c.offsets[:d] + (c.offsets[d] + (cut if from_front else 0),) + c.offsets[d + 1:]
    sizes = c.sizes[:d] + (c.sizes[d] - cut,) + c.sizes[d + 1:]
    shrunk = chunks[:i] + [Box(offsets, sizes)] + chunks[i + 1:]
    assert kinds(coverage_problems(shape, shrunk)) == ["gap"]


@prop
@given(any_tiling, st.data())
def test_a_chunk_out_of_bounds_is_reported(tiling, data):
    shape, chunks = tiling
    i = data.draw(st.integers(0, len(chunks) - 1))
    c = chunks[i]
    d = data.draw(st.integers(0, len(shape) - 1))
    how = data.draw(st.sampled_from(["past_end", "negative_offset", "negative_size", "too_big"]))
    offsets, sizes = list(c.offsets), list(c.sizes)
    if how == "past_end":
        offsets[d] = shape[d] - sizes[d] + data.draw(st.integers(1, 3))
    elif how == "negative_offset":
        offsets[d] = -data.draw(st.integers(1, 3))
    elif how == "negative_size":
        sizes[d] = -data.draw(st.integers(1, 3))
    else:
        offsets[d], sizes[d] = 0, shape[d] + data.draw(st.integers(1, 3))
    bad = chunks[:i] + [Box(tuple(offsets), tuple(sizes))] + chunks[i + 1:]
    assert kinds(coverage_problems(shape, bad)) == ["out_of_bounds"]


@prop
@given(any_tiling, st.data())
def test_a_chunk_of_the_wrong_rank_is_reported(tiling, data):
    shape, chunks = tiling
    i = data.draw(st.integers(0, len(chunks) - 1))
    c = chunks[i]
    wrong = Box(c.offsets + (0,), c.sizes + (1,)) if data.draw(st.booleans()) else Box(c.offsets[1:], c.sizes[1:])
    assert "rank_mismatch" in kinds(coverage_problems(shape, chunks[:i] + [wrong] + chunks[i + 1:]))


@pytest.mark.parametrize(
    "shape,k",
    [((50, 16), 4), ((2, 3), 4), ((1,), 8), ((7,), 3), ((0, 4), 2), ((13, 5, 3), 6)],
)
def test_fsdp2_uneven_sharding_examples(shape, k):
    """Dim-0 ceil-division shards, trailing pieces shorter or empty; DCP keeps one copy of
    identical empty chunks, so both with and without duplicates must pass."""
    chunks = _grid([ceil_pieces(shape[0], k)] + [[(0, n)] for n in shape[1:]])
    assert coverage_problems(shape, chunks) == []
    deduped = list(dict.fromkeys(chunks))
    assert coverage_problems(shape, deduped) == []
    if shape[0] and shape[1:].count(0) == 0:
        assert kinds(coverage_problems(shape, chunks[1:])) == ["gap"]  # rank 0's piece lost


def test_zero_sized_tensor_needs_no_chunks():
    assert coverage_problems((0, 3), []) == []
    assert coverage_problems((4, 0), [Box((0, 0), (4, 0))]) == []


def test_scalar_tensor():
    s = Box((), ())
    assert s.numel == 1 and not s.is_empty()
    assert coverage_problems((), [s]) == []
    assert kinds(coverage_problems((), [])) == ["gap"]
    assert kinds(coverage_problems((), [s, s])) == ["overlap"]
    assert kinds(coverage_problems((), [Box((0,), (1,))])) == ["rank_mismatch"]
    assert s.intersect(s) == s
    assert s.contains(s)
    assert s.relative_to(s) == s


# ----------------------------------------------------------------------------- brute force


@st.composite
def shape_and_boxes(draw, max_boxes=6):
    shape = draw(small_shapes)
    boxes = draw(st.lists(box_in(shape), max_size=max_boxes))
    return shape, boxes


@prop
@given(shape_and_boxes())
def test_coverage_matches_brute_force(sb):
    shape, boxes = sb
    c = counts(shape, boxes)
    expected = ["overlap"] if (c > 1).any() else ["gap"] if (c == 0).any() else []
    assert kinds(coverage_problems(shape, boxes)) == expected


@prop
@given(any_tiling)
def test_coverage_of_tilings_matches_brute_force(tiling):
    shape, chunks = tiling
    assume(prod(shape) <= 4096)
    assert (counts(shape, chunks) == 1).all()


# ----------------------------------------------------------------------------- Box


@st.composite
def two_boxes(draw, allow_empty=True):
    shape = draw(small_shapes)
    return shape, draw(box_in(shape, allow_empty)), draw(box_in(shape, allow_empty))


@prop
@given(two_boxes())
def test_intersect_is_commutative(sab):
    _, a, b = sab
    assert a.intersect(b) == b.intersect(a)


@prop
@given(two_boxes())
def test_intersect_matches_brute_force(sab):
    shape, a, b = sab
    both = mask(shape, a) & mask(shape, b)
    got = a.intersect(b)
    if not both.any():
        assert got is None
    else:
        assert got is not None and not got.is_empty()
        assert np.array_equal(mask(shape, got), both)
        assert a.contains(got) and b.contains(got)
        assert got.numel == int(both.sum())


@prop
@given(two_boxes())
def test_intersect_with_self_and_whole(sab):
    shape, a, _ = sab
    expected = None if a.is_empty() else a
    assert a.intersect(a) == expected
    assert a.intersect(whole(shape)) == expected
    assert whole(shape).contains(a)


def test_intersect_rejects_different_ranks():
    with pytest.raises(ValueError):
        Box((0,), (2,)).intersect(Box((0, 0), (2, 2)))


def test_touching_boxes_do_not_intersect():
    assert Box((0, 0), (2, 3)).intersect(Box((2, 0), (2, 3))) is None
    assert Box((0, 0), (2, 3)).intersect(Box((1, 3), (2, 3))) is None


@prop
@given(two_boxes(allow_empty=False))
def test_contains_matches_brute_force(sab):
    shape, a, b = sab
    ma, mb = mask(shape, a), mask(shape, b)
    assert a.contains(b) == bool((mb <= ma).all())


@prop
@given(two_boxes(allow_empty=False), st.data())
def test_relative_to_addresses_the_same_elements(sab, data):
    shape, outer, _ = sab
    inner = data.draw(box_in(outer.sizes, allow_empty=True))
    inner = Box(tuple(o + p for o, p in zip(inner.offsets, outer.offsets)), inner.sizes)
    assert outer.contains(inner)
    rel = inner.relative_to(outer)
    arr = np.arange(prod(shape)).reshape(shape)
    assert np.array_equal(arr[outer.slices()][rel.slices()], arr[inner.slices()])
    assert rel.sizes == inner.sizes
    assert all(0 <= o and o + s <= n for o, s, n in zip(rel.offsets, rel.sizes, outer.sizes))
    # and back
    assert Box(tuple(o + p for o, p in zip(rel.offsets, outer.offsets)), rel.sizes) == inner


@prop
@given(shapes)
def test_whole_and_numel(shape):
    w = whole(shape)
    assert w.offsets == (0,) * len(shape) and w.sizes == shape
    assert w.numel == prod(shape) and w.ends == shape
    assert coverage_problems(shape, [w]) == []


# ----------------------------------------------------------------------------- regressions
# Both were found by these tests and fixed in geometry.py.


def test_contains_rejects_different_ranks():
    with pytest.raises(ValueError):
        Box((0,), (5,)).contains(Box((0, 0), (1, 100)))


def test_overlap_check_is_not_quadratic_when_sharded_along_dim_1(monkeypatch):
    """A weight sharded along dim 1 (e.g. TP row-parallel over many ranks): every chunk
    spans all of dim 0, so every chunk stays 'active' in the dim-0 sweep and is compared
    with every other one. 1,000 chunks take seconds, 4,000 take ~25 s."""
    n = 300
    calls = 0
    real = Box.intersect

    def counting(self, other):
        nonlocal calls
        calls += 1
        return real(self, other)

    monkeypatch.setattr(Box, "intersect", counting)
    chunks = [Box((0, i), (10, 1)) for i in range(n)]
    assert coverage_problems((10, n), chunks) == []
    assert calls <= 4 * n, f"{calls} box comparisons for {n} chunks"


# ----------------------------------------------------------------------------- O(n log n) coverage
# coverage_problems was a pairwise sweep, quadratic on a staircase (issue 13: 8,000 chunks took
# minutes). The quadratic version is kept here as the reference the fast one must agree with,
# problem for problem (kinds and details), on small layouts of every kind.

from reshard.model import geometry  # noqa: E402
from reshard.model.geometry import CoverageProblem  # noqa: E402


def reference_coverage_problems(shape, chunks) -> list[CoverageProblem]:
    """The pairwise sweep coverage_problems used before issue 13 (quadratic, exact)."""
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


@st.composite
def loose_box(draw, shape):
    """A box that may stick out, have a negative or zero size, or (rarely) the wrong rank."""
    rank = len(shape) if draw(st.integers(0, 19)) else draw(st.integers(0, 5))
    dims = list(shape) + [3] * max(0, rank - len(shape))
    offs = tuple(draw(st.integers(-1, n + 1)) if draw(st.integers(0, 9)) == 0 else draw(st.integers(0, n)) for n in dims[:rank])
    sizes = tuple(draw(st.integers(-1, n + 1)) if draw(st.integers(0, 9)) == 0 else draw(st.integers(0, n - o if n > o else 0))
                  for n, o in zip(dims[:rank], offs))
    return Box(offs, sizes)


@st.composite
def random_layouts(draw):
    """Any boxes at all, 0-D to 4-D: overlaps, gaps, out-of-bounds and zero-size chunks."""
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=4)))
    return shape, draw(st.lists(loose_box(shape), max_size=8))


@st.composite
def damaged_tilings(draw):
    """A real tiling with pieces removed, duplicated, grown, shrunk or added at random."""
    shape, chunks = draw(any_tiling)
    chunks = list(chunks)
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["drop", "dup", "add", "resize"]))
        if how == "drop" and chunks:
            chunks.pop(draw(st.integers(0, len(chunks) - 1)))
        elif how == "dup" and chunks:
            chunks.insert(draw(st.integers(0, len(chunks))), draw(st.sampled_from(chunks)))
        elif how == "add":
            chunks.insert(draw(st.integers(0, len(chunks))), draw(box_in(shape)))
        elif chunks:
            i = draw(st.integers(0, len(chunks) - 1))
            c, d = chunks[i], draw(st.integers(0, len(shape) - 1))
            size = draw(st.integers(0, shape[d] - c.offsets[d]))
            chunks[i] = Box(c.offsets, c.sizes[:d] + (size,) + c.sizes[d + 1:])
    return shape, chunks


def _brute_kinds(shape, boxes) -> list[str] | None:
    """Kinds by counting every element (None when a chunk is out of bounds or of another rank)."""
    if any(len(b.offsets) != len(shape) or len(b.sizes) != len(shape)
           or any(o < 0 or s < 0 or o + s > n for o, s, n in zip(b.offsets, b.sizes, shape)) for b in boxes):
        return None
    c = counts(shape, boxes) if shape else np.array(sum(1 for _ in boxes))
    return ["overlap"] if (c > 1).any() else ["gap"] if (c == 0).any() else []


@prop
@given(st.one_of(random_layouts(), damaged_tilings(), any_tiling))
def test_fast_coverage_equals_the_pairwise_reference(layout):
    shape, boxes = layout
    got = coverage_problems(shape, boxes)
    assert got == reference_coverage_problems(shape, boxes)
    brute = _brute_kinds(shape, boxes)
    if brute is not None:
        assert kinds(got) == brute


def staircase(n: int, transpose: bool = False) -> tuple[tuple[int, int], list[Box]]:
    """``2n`` chunks tiling an ``(n + 1, n)`` tensor: column ``i`` cut after row ``i``.

    The ``n`` upper chunks all start at row 0 and stay active along the whole dim-0 sweep, so
    comparing each new chunk with every active one is quadratic (issue 13)."""
    boxes = []
    for i in range(n):
        boxes += [Box((0, i), (i + 1, 1)), Box((i + 1, i), (n - i, 1))]
    if transpose:
        return (n, n + 1), [Box(b.offsets[::-1], b.sizes[::-1]) for b in boxes]
    return (n + 1, n), boxes


@pytest.fixture
def count_intersections(monkeypatch):
    calls = [0]
    real = Box.intersect

    def counting(self, other):
        calls[0] += 1
        return real(self, other)

    monkeypatch.setattr(Box, "intersect", counting)
    return calls


@pytest.mark.parametrize("transpose", [False, True], ids=["rows", "columns"])
def test_a_staircase_of_20000_chunks_is_checked(transpose, count_intersections):
    """The attack: a staircase of 20,000 chunks. A tiling is accepted, and a gap and an
    overlap planted in it are found, each with at most a linear number of box comparisons
    (the quadratic sweep made ~10^8)."""
    shape, boxes = staircase(10_000, transpose)
    assert len(boxes) == 20_000
    assert coverage_problems(shape, boxes) == []
    assert count_intersections[0] == 0

    gap = boxes[:7_000] + boxes[7_001:]
    assert coverage_problems(shape, gap) == [CoverageProblem(
        "gap", f"chunks cover {prod(shape) - boxes[7_000].numel} of {prod(shape)} elements of {list(shape)}")]

    extra = Box((0, 9_999), (2, 1)) if not transpose else Box((9_999, 0), (1, 2))
    probs = coverage_problems(shape, boxes[:12_345] + [extra] + boxes[12_345:])
    assert kinds(probs) == ["overlap"] and str(list(extra.offsets)) in probs[0].detail
    assert count_intersections[0] <= 2 * len(boxes) + 2


def test_staircase_with_an_overlap_reports_what_the_pairwise_sweep_reported():
    shape, boxes = staircase(300)
    bad = boxes[:100] + [Box((5, 40), (3, 30))] + boxes[100:]
    assert coverage_problems(shape, bad) == reference_coverage_problems(shape, bad)


def test_grid_of_three_sharded_dims_is_accepted_without_comparisons(count_intersections):
    """EP x FSDP x TP on a 3-D expert weight: every dim varies; the corner identity accepts it."""
    shape = (8, 64, 48)
    chunks = _grid([ceil_pieces(8, 8), ceil_pieces(64, 16), ceil_pieces(48, 12)])
    assert len(chunks) == 8 * 16 * 12
    assert coverage_problems(shape, chunks) == []
    assert count_intersections[0] == 0
    assert kinds(coverage_problems(shape, chunks[:-1])) == ["gap"]


@pytest.mark.parametrize("damage", ["gap", "overlap", "gap_and_overlap"])
def test_three_varying_dims_past_the_pairwise_budget_still_fail(damage, monkeypatch):
    """A failing layout with three varying dims whose pairwise search would run long: past
    the budget the verdict is still exact (not a tiling) and names a problem that exists."""
    monkeypatch.setattr(geometry, "PAIRWISE_BUDGET", 50)
    shape = (6, 6, 6)
    chunks = _grid([[(i, 1) for i in range(6)]] * 3)
    if damage == "gap":
        chunks = chunks[:100] + chunks[101:]
    elif damage == "overlap":
        chunks = chunks + [chunks[150]]
    else:
        chunks = chunks[:100] + chunks[102:] + [Box((0, 0, 0), (1, 1, 2))]
    got = kinds(coverage_problems(shape, chunks))
    brute = counts(shape, chunks)
    assert len(got) == 1
    assert (got == ["overlap"] and (brute > 1).any()) or (got == ["gap"] and (brute == 0).any())


@given(st.integers(0, 5000), st.integers(1, 300))
@settings(max_examples=300, deadline=None)
def test_chunk_bound_is_torch_chunk_in_closed_form(n, parts):
    """The closed form a rank's piece uses equals torch.chunk (pieces of ceil(n/parts), trailing ones empty)."""
    import torch

    from reshard.model.layout import chunk_bound

    pieces = torch.arange(n).chunk(parts) if n else ()
    want = [(int(p[0]), len(p)) for p in pieces if len(p)]
    got = [chunk_bound(n, parts, i) for i in range(parts)]
    assert [b for b in got if b[1]] == want
    assert sum(size for _, size in got) == n


@prop
@given(shape_and_boxes())
def test_the_numpy_fast_path_accepts_only_tilings(sb):
    """`tiles_exactly_fast` (numpy, issue 18) says True only where brute force finds every element once."""
    shape, boxes = sb
    if tiles_exactly_fast(shape, boxes):
        assert (counts(shape, boxes) == 1).all()


@prop
@given(any_tiling)
def test_the_numpy_fast_path_accepts_every_tiling(tiling):
    """...and it accepts the tilings themselves, so the exact Python path runs only on problems."""
    shape, chunks = tiling
    assert tiles_exactly_fast(shape, chunks) or not shape
