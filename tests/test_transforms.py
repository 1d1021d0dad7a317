"""Properties of the TP-dependent tensor transforms (fused re-interleave, vocab re-padding)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.semantics.transforms import from_canonical, reinterleave, repad_rows, to_canonical

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def fused_case(draw):
    """(tensor, dim, parts, tp_a, tp_b): every part divisible by both degrees."""
    tp_a = draw(st.sampled_from([1, 2, 3, 4]))
    tp_b = draw(st.sampled_from([1, 2, 3, 4]))
    unit = tp_a * tp_b
    parts = draw(st.lists(st.integers(1, 3).map(lambda k: k * unit), min_size=1, max_size=4))
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(0, ndim - 1))
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    shape[dim] = sum(parts)
    n = 1
    for s in shape:
        n *= s
    t = torch.arange(n, dtype=torch.float32).reshape(shape)  # every element distinct
    return t, dim, parts, tp_a, tp_b


@SETTINGS
@given(fused_case())
def test_reinterleave_round_trip(case):
    t, dim, parts, a, b = case
    there = reinterleave(t, dim, parts, a, b)
    assert there.shape == t.shape
    assert torch.equal(reinterleave(there, dim, parts, b, a), t)
    # a permutation: the same multiset of elements
    assert torch.equal(there.flatten().sort().values, t.flatten().sort().values)


@SETTINGS
@given(fused_case())
def test_from_canonical_inverts_to_canonical(case):
    t, dim, parts, tp, _ = case
    assert torch.equal(from_canonical(to_canonical(t, dim, parts, tp), dim, parts, tp), t)
    assert torch.equal(to_canonical(from_canonical(t, dim, parts, tp), dim, parts, tp), t)


@SETTINGS
@given(fused_case())
def test_reinterleave_goes_through_canonical(case):
    t, dim, parts, a, b = case
    assert torch.equal(reinterleave(t, dim, parts, a, b),
                       from_canonical(to_canonical(t, dim, parts, a), dim, parts, b))


@pytest.mark.parametrize("tp", [1, 2])
def test_gqa_blocks_per_rank(tp):
    """8 query heads, 2 KV heads, head_dim 4: TP rank r holds [Q_r; K_r; V_r]."""
    hd, dim = 4, 6
    q = torch.randn(8 * hd, dim, generator=torch.Generator().manual_seed(1))
    k = torch.randn(2 * hd, dim, generator=torch.Generator().manual_seed(2))
    v = torch.randn(2 * hd, dim, generator=torch.Generator().manual_seed(3))
    parts = [8 * hd, 2 * hd, 2 * hd]
    laid = from_canonical(torch.cat([q, k, v]), 0, parts, tp)
    blocks = torch.chunk(laid, tp, dim=0)
    assert len(blocks) == tp
    for r, block in enumerate(blocks):
        want = torch.cat([torch.chunk(x, tp, dim=0)[r] for x in (q, k, v)])
        assert torch.equal(block, want)
    assert torch.equal(to_canonical(laid, 0, parts, tp), torch.cat([q, k, v]))


def test_gqa_tp2_moves_k_ahead_of_second_q_half():
    q, k, v = torch.full((4, 1), 0.0), torch.full((2, 1), 1.0), torch.full((2, 1), 2.0)
    laid = from_canonical(torch.cat([q, k, v]), 0, [4, 2, 2], 2)
    assert laid.flatten().tolist() == [0, 0, 1, 2, 0, 0, 1, 2]


@pytest.mark.parametrize("fn", [to_canonical, from_canonical])
def test_tp_not_dividing_a_part_is_rejected(fn):
    t = torch.zeros(8 + 2 + 2, 3)
    with pytest.raises(ValueError, match="does not divide"):
        fn(t, 0, [8, 2, 2], 4)  # 2 KV rows cannot be cut 4 ways
    with pytest.raises(ValueError, match="does not divide"):
        reinterleave(t, 0, [8, 2, 2], 2, 4)


def test_part_sizes_must_add_up():
    with pytest.raises(ValueError, match="add up"):
        to_canonical(torch.zeros(10, 2), 0, [4, 4], 2)


@SETTINGS
@given(rows=st.integers(1, 12), grow=st.integers(1, 8), cols=st.integers(1, 4), dim=st.integers(0, 1),
       fill=st.sampled_from([0.0, -1.0, 0.5]))
def test_repad_grow_keeps_rows_and_fills(rows, grow, cols, dim, fill):
    shape = [rows, cols] if dim == 0 else [cols, rows]
    t = torch.arange(rows * cols, dtype=torch.float32).reshape(shape) + 10.0
    out, lost = repad_rows(t, dim, rows + grow, fill)
    assert lost == 0
    assert out.shape[dim] == rows + grow
    assert torch.equal(out.narrow(dim, 0, rows), t)
    assert bool((out.narrow(dim, rows, grow) == fill).all())


@SETTINGS
@given(keep=st.integers(0, 10), cut=st.integers(1, 8), cols=st.integers(1, 4), data=st.data())
def test_repad_cut_reports_non_fill_elements(keep, cut, cols, data):
    fill = 0.0
    mask = data.draw(st.lists(st.booleans(), min_size=cut * cols, max_size=cut * cols))
    tail = torch.tensor(mask, dtype=torch.float32).reshape(cut, cols) * 7.0  # 7.0 where True, else fill
    head = torch.arange(keep * cols, dtype=torch.float32).reshape(keep, cols)
    t = torch.cat([head, tail])
    out, lost = repad_rows(t, 0, keep, fill)
    assert torch.equal(out, head)
    assert lost == sum(mask)


def test_repad_same_size_is_identity():
    t = torch.ones(4, 2)
    out, lost = repad_rows(t, 0, 4, 0.0)
    assert out is t and lost == 0
