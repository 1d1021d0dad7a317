"""Where each global tensor lives on a target topology: placements and per-rank boxes.

A placement says how a tensor is cut; `target_chunks` turns it into the exact boxes each
rank owns. Data-parallel sharding follows FSDP2: dim 0 is cut with ``torch.chunk``
semantics (pieces of ``ceil(n / S)`` rows, the last one shorter, trailing ranks possibly
empty), and replicas along ``dp_replicate`` hold identical pieces, of which the first
replica (``dp_replicate`` index 0) writes the bytes, as DCP's save-time dedup would.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import ceil

from reshard.geometry import Box
from reshard.topology import DIMS, Topology


@dataclass(frozen=True)
class Placement:
    """How one tensor is laid out: ``shard`` along ``dim`` over the dp_shard mesh dim, or ``replicate``."""

    kind: str  # "shard" | "replicate"
    dim: int = 0

    def describe(self) -> str:
        return f"Shard({self.dim})" if self.kind == "shard" else "Replicate()"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "dim": self.dim}

    @classmethod
    def from_dict(cls, d: dict) -> "Placement":
        return cls(str(d["kind"]), int(d.get("dim", 0)))


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


def chunk_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """``torch.chunk`` semantics: (start, size) of each of ``parts`` pieces of ``n``; missing pieces are empty."""
    step = ceil(n / parts) if n else 0
    out = []
    for i in range(parts):
        start = min(i * step, n)
        out.append((start, max(0, min(step, n - start))))
    return out


def target_chunks(shape: tuple[int, ...], placement: Placement, topo: Topology) -> list[tuple[int, Box]]:
    """(writer rank, box) for every non-empty piece of a tensor on ``topo``.

    Only writers are listed: replicas hold the same piece and read it from the writer's
    file (DCP resolves reads by global offsets, not by file).
    """
    if placement.kind == "replicate" or not shape:
        return [(0, Box(tuple(0 for _ in shape), tuple(shape)))]
    dim = placement.dim
    pieces = chunk_bounds(shape[dim], topo.dp_shard)
    out = []
    for i, (start, size) in enumerate(pieces):
        if size == 0:
            continue
        offs = [0] * len(shape)
        sizes = list(shape)
        offs[dim], sizes[dim] = start, size
        out.append((rank_of(topo, dp_shard=i), Box(tuple(offs), tuple(sizes))))
    return out


def local_shape(shape: tuple[int, ...], placement: Placement, topo: Topology, shard_index: int) -> tuple[int, ...]:
    """What rank with ``dp_shard`` index ``shard_index`` holds locally (empty pieces included)."""
    if placement.kind == "replicate" or not shape:
        return tuple(shape)
    start, size = chunk_bounds(shape[placement.dim], topo.dp_shard)[shard_index]
    s = list(shape)
    s[placement.dim] = size
    return tuple(s)
