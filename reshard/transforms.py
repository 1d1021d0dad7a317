"""Tensor transforms whose result depends on the tensor-parallel degree.

Most parameters have a TP-independent global view: DCP stores the global tensor and any
degree can cut it. Two layouts do not:

- **fused** tensors (QKV with grouped-query heads, SwiGLU gate/up): each TP rank holds
  ``[part0_r; part1_r; ...]`` along one dim, so the concatenation of the local shards
  interleaves the parts by rank. The canonical (TP = 1) layout is ``[part0; part1; ...]``;
  a change of degree goes through it.
- **padded vocab**: the padded row count is a multiple of ``multiple x tp``; rows past the
  original vocabulary are padding. Learned padding rows are kept when the padding grows,
  new rows get the rule's fill value, and rows cut when it shrinks are reported.
"""
from __future__ import annotations

import torch


def reinterleave(t: torch.Tensor, dim: int, parts: list[int], from_tp: int, to_tp: int) -> torch.Tensor:
    """Re-lay a fused tensor written at ``from_tp`` for ``to_tp``; ``parts`` are full part sizes along ``dim``."""
    if from_tp == to_tp:
        return t
    canon = to_canonical(t, dim, parts, from_tp)
    return from_canonical(canon, dim, parts, to_tp)


def _check(t: torch.Tensor, dim: int, parts: list[int], tp: int) -> None:
    if t.shape[dim] != sum(parts):
        raise ValueError(f"fused tensor has {t.shape[dim]} rows along dim {dim}, parts add up to {sum(parts)}")
    bad = [p for p in parts if p % tp]
    if bad:
        raise ValueError(f"tp={tp} does not divide fused part sizes {bad}")


def to_canonical(t: torch.Tensor, dim: int, parts: list[int], tp: int) -> torch.Tensor:
    """``[p0_0; p1_0; ...; p0_1; p1_1; ...]`` (TP layout) -> ``[p0; p1; ...]``."""
    _check(t, dim, parts, tp)
    if tp == 1:
        return t
    local = [p // tp for p in parts]
    blocks = torch.split(t, sum(local), dim=dim)
    pieces = [torch.split(b, local, dim=dim) for b in blocks]
    return torch.cat([torch.cat([pieces[r][k] for r in range(tp)], dim=dim) for k in range(len(parts))], dim=dim)


def from_canonical(t: torch.Tensor, dim: int, parts: list[int], tp: int) -> torch.Tensor:
    """``[p0; p1; ...]`` -> the layout whose rank-r block is ``[p0_r; p1_r; ...]``."""
    _check(t, dim, parts, tp)
    if tp == 1:
        return t
    full = torch.split(t, parts, dim=dim)
    split = [torch.split(f, f.shape[dim] // tp, dim=dim) for f in full]
    return torch.cat([torch.cat([split[k][r] for k in range(len(parts))], dim=dim) for r in range(tp)], dim=dim)


def repad_rows(t: torch.Tensor, dim: int, rows: int, fill: float) -> tuple[torch.Tensor, int]:
    """Grow or cut ``dim`` to ``rows``; returns (tensor, number of cut elements that differed from ``fill``)."""
    have = t.shape[dim]
    if rows == have:
        return t, 0
    if rows > have:
        shape = list(t.shape)
        shape[dim] = rows - have
        pad = torch.full(shape, fill, dtype=t.dtype)
        return torch.cat([t, pad], dim=dim), 0
    cut = t.narrow(dim, rows, have - rows)
    lost = int((cut != fill).sum().item())
    return t.narrow(dim, 0, rows).contiguous(), lost
