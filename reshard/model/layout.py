"""Where each global tensor lives on a target topology: placements and per-rank boxes.

The mesh is ``(pp, dp_replicate, dp_shard, cp, tp)``, row-major (rank = index over that
order), as torchtitan builds it. A tensor is placed by three independent choices:

- pipeline ``stage``: only that stage's ranks hold it (``None``: not stage-bound);
- tensor parallel ``tp_dim``: cut into ``tp`` pieces along that dim (``None``: replicated);
- data parallel ``dp_shard``: FSDP2 cuts dim 0 of the TP-local piece into ``dp_shard``
  pieces with ``torch.chunk`` semantics (pieces of ``ceil(n / S)``, trailing ranks possibly
  empty). For a TP cut along dim 0 this is a sub-piece of the rank's TP block, as FSDP2
  lays out a 2-D (FSDP x TP) DTensor.

Replicas (``dp_replicate``, ``cp``, TP ranks of a replicated tensor) hold identical pieces;
the one with index 0 on those dims writes the bytes, as DCP's save-time dedup would.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from reshard.model.geometry import Box
from reshard.model.topology import DIMS, Topology


@dataclass(frozen=True)
class Placement:
    dp_shard: bool = True
    tp_dim: int | None = None
    stage: int | None = None

    @property
    def kind(self) -> str:
        return "shard" if self.dp_shard or self.tp_dim is not None else "replicate"

    def describe(self) -> str:
        parts = []
        if self.dp_shard:
            parts.append("FSDP Shard(0)")
        if self.tp_dim is not None:
            parts.append(f"TP Shard({self.tp_dim})")
        s = " x ".join(parts) or "Replicate()"
        if self.stage is not None:
            s += f" @stage {self.stage}"
        return s

    def to_dict(self) -> dict:
        return {"dp_shard": self.dp_shard, "tp_dim": self.tp_dim, "stage": self.stage}

    @classmethod
    def replicated(cls, stage: int | None = None) -> "Placement":
        return cls(dp_shard=False, tp_dim=None, stage=stage)


def mesh_coords(topo: Topology, rank: int) -> dict[str, int]:
    """Coordinates of a global rank on the mesh ``(pp, dp_replicate, dp_shard, cp, tp)``, row-major."""
    coords: dict[str, int] = {}
    rest = rank
    for d in reversed(DIMS):
        n = getattr(topo, d)
        coords[d] = rest % n
        rest //= n
    return coords


def rank_of(topo: Topology, **coords: int) -> int:
    r = 0
    for d in DIMS:
        r = r * getattr(topo, d) + coords.get(d, 0)
    return r


def chunk_bound(n: int, parts: int, i: int) -> tuple[int, int]:
    """``torch.chunk`` semantics: (start, size) of piece ``i`` of ``parts`` pieces of ``n`` (missing pieces
    are empty), in closed form.

    A rank's piece is asked for once per rank per tensor: computing all pieces to pick one
    made planning quadratic in the world size (16,384 ranks, a thousand tensors).
    """
    step = -(-n // parts) if n else 0
    start = min(i * step, n)
    return start, max(0, min(step, n - start))


def piece(shape: tuple[int, ...], placement: Placement, topo: Topology, *, tp: int, dp: int) -> Box:
    """The box held by TP index ``tp`` and dp_shard index ``dp`` (may be empty)."""
    offs = [0] * len(shape)
    sizes = list(shape)
    if not shape:
        return Box((), ())
    if placement.tp_dim is not None and topo.tp > 1:
        d = placement.tp_dim
        start, size = chunk_bound(shape[d], topo.tp, tp)
        offs[d], sizes[d] = start, size
    if placement.dp_shard and topo.dp_shard > 1:
        start, size = chunk_bound(sizes[0], topo.dp_shard, dp)
        offs[0], sizes[0] = offs[0] + start, size
    return Box(tuple(offs), tuple(sizes))


def holds(placement: Placement, topo: Topology, rank: int) -> bool:
    c = mesh_coords(topo, rank)
    return placement.stage is None or c["pp"] == placement.stage or topo.pp == 1


def target_chunks(shape: tuple[int, ...], placement: Placement, topo: Topology) -> list[tuple[int, Box]]:
    """(writer rank, box) for every non-empty piece of a tensor on ``topo``.

    Only writers are listed: replicas hold the same piece and read it from the writer's
    file (DCP resolves reads by global offsets, not by file).
    """
    stage = placement.stage if placement.stage is not None and placement.stage < topo.pp else 0
    tps = range(topo.tp) if placement.tp_dim is not None else [0]
    dps = range(topo.dp_shard) if placement.dp_shard else [0]
    out = []
    for t in tps:
        for d in dps:
            box = piece(tuple(shape), placement, topo, tp=t, dp=d)
            if shape and box.is_empty():
                continue
            out.append((rank_of(topo, pp=stage, dp_shard=d, tp=t), box))
    return out


def local_box(shape: tuple[int, ...], placement: Placement, topo: Topology, rank: int) -> Box | None:
    """What ``rank`` holds locally (possibly an empty box), or None when its stage does not hold the tensor."""
    if not holds(placement, topo, rank):
        return None
    c = mesh_coords(topo, rank)
    return piece(tuple(shape), placement, topo, tp=c["tp"], dp=c["dp_shard"])


@lru_cache(maxsize=4096)
def target_chunks_cached(shape: tuple[int, ...], placement: Placement, topo: Topology) -> tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]:
    """`target_chunks` as (rank, offsets, sizes) tuples, computed once per distinct (shape, placement, topology).

    A model has a few dozen distinct shapes and thousands of tensors (parameters and their
    moments): the pieces of one shape are the same for all of them.
    """
    return tuple((r, b.offsets, b.sizes) for r, b in target_chunks(shape, placement, topo))


def rank_sizes(shape: tuple[int, ...], placement: Placement, topo: Topology) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's local shape at once: (held, sizes), `rank_boxes` without the offsets."""
    held, _offsets, sizes = rank_boxes(shape, placement, topo)
    return held, sizes


def rank_boxes(shape: tuple[int, ...], placement: Placement, topo: Topology) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every rank's local piece at once: (held, offsets, sizes) with ``held[r]`` whether rank
    ``r``'s stage holds the tensor and ``offsets[r]``, ``sizes[r]`` its box (``world x ndim``,
    int64), in closed form.

    Equal to `local_box` rank by rank (tests/test_layout_vectorised.py checks it on random
    shapes and degrees); numpy over all ranks, so per-rank totals over 16,384 ranks cost a few
    array operations per distinct shape instead of a Python call per rank per tensor.
    """
    world = topo.world_size
    ranks = np.arange(world, dtype=np.int64)
    coords: dict[str, np.ndarray] = {}
    rest = ranks
    for d in reversed(DIMS):
        n = getattr(topo, d)
        coords[d] = rest % n
        rest = rest // n
    held = np.ones(world, dtype=bool) if placement.stage is None or topo.pp == 1 else coords["pp"] == placement.stage
    nd = len(shape)
    offsets = np.zeros((world, nd), dtype=np.int64)
    sizes = np.tile(np.asarray(shape, dtype=np.int64), (world, 1)) if shape else np.zeros((world, 0), dtype=np.int64)
    if not shape:
        return held, offsets, sizes

    def chunk(n: np.ndarray | int, parts: int, i: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = np.asarray(n, dtype=np.int64)
        step = np.where(n > 0, -(-n // parts), 0)
        start = np.minimum(i * step, n)
        return start, np.maximum(0, np.minimum(step, n - start))

    if placement.tp_dim is not None and topo.tp > 1:
        d = placement.tp_dim
        offsets[:, d], sizes[:, d] = chunk(shape[d], topo.tp, coords["tp"])
    if placement.dp_shard and topo.dp_shard > 1:
        start, sizes[:, 0] = chunk(sizes[:, 0], topo.dp_shard, coords["dp_shard"])
        offsets[:, 0] += start
    return held, offsets, sizes
