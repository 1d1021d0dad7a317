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

from typing import Any

import torch

from reshard.model.geometry import Box


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


def select_rows(t: torch.Tensor, dim: int, index: list[int]) -> torch.Tensor:
    """The rows ``index`` of ``dim``, in that order (a slice of the experts keeps their router rows)."""
    return t.index_select(dim, torch.tensor(index, dtype=torch.long)).contiguous()


def write_transformed(ix: Any, w: Any, t: Any, source_key: str | None = None) -> None:
    """Tensors whose global layout depends on TP (fused, padded vocab): whole tensor, transformed, re-cut.

    ``ix`` is any index with ``read_tensor`` (the source), ``w`` any writer with ``write_chunk``
    (the DCP writer, or the local format's collector), ``t`` the tensor's plan entry.
    Memory: one global tensor, the bound the design accepts for these (they are per-layer).
    """
    full = ix.read_tensor(source_key or t.key)
    tr = t.transform
    if tr and tr["kind"] == "reinterleave":
        full = reinterleave(full, tr["dim"], tr["parts"], tr["from_tp"], tr["to_tp"])
    elif tr and tr["kind"] == "repad":
        full, _ = repad_rows(full, tr["dim"], tr["to_rows"], tr["fill"])
    elif tr and tr["kind"] == "select":  # a slice's router: the rows of the kept experts, in order
        full = select_rows(full, tr["dim"], tr["index"])
    full = full.to(getattr(torch, t.dtype))  # reduced copies (--dtype); a no-op otherwise
    for rank, offsets, sizes in t.chunks:
        box = Box(tuple(offsets), tuple(sizes))
        w.write_chunk(rank, t.key, box.offsets, full[box.slices()])
