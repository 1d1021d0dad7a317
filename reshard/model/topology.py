"""Parallel layouts: parse `dp=32,tp=2,pp=4`, infer a writer's layout from chunk geometry, and check a
layout the user states against the same evidence (`contradictions`).

A topology is a named mesh. Dims are ordered outer to inner as torchtitan builds its
mesh (`pp, dp_replicate, dp_shard, cp, tp`); omitted dims are 1. `dp` is an alias for
`dp_shard`, the FSDP dimension.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from math import prod
from typing import Any, Iterable

import numpy as np

from reshard.errors import BadInput

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
ALIASES = {"dp": "dp_shard"}


@dataclass(frozen=True)
class Topology:
    """Degrees of each parallel dim; ``source`` says where we learned them."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    source: str = "given"  # "manifest" | "inferred" | "given"
    evidence: tuple[str, ...] = field(default=(), compare=False)
    # Inferred layouts the chunk geometry cannot tell apart (spec strings, this one first). A
    # non-empty tuple means "ambiguous": commands ask for --from rather than record a guess.
    alternatives: tuple[str, ...] = field(default=(), compare=False)

    @property
    def ambiguous(self) -> bool:
        return len(self.alternatives) > 1

    @property
    def world_size(self) -> int:
        return prod(self.degrees().values())

    @property
    def dp(self) -> int:
        """Data-parallel width: the number of distinct batches per micro-step."""
        return self.dp_replicate * self.dp_shard

    def degrees(self) -> dict[str, int]:
        return {d: getattr(self, d) for d in DIMS}

    def spec(self) -> str:
        parts = [f"{d}={n}" for d, n in self.degrees().items() if n != 1]
        return ",".join(parts) or "dp=1"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = dict(self.degrees())
        d["world_size"] = self.world_size
        d["source"] = self.source
        if self.evidence:
            d["evidence"] = list(self.evidence)
        if self.ambiguous:
            d["ambiguous"] = True
            d["alternatives"] = list(self.alternatives)
        return d

    def with_source(self, source: str, evidence: Iterable[str] = ()) -> "Topology":
        return Topology(**self.degrees(), source=source, evidence=tuple(evidence))


def parse_spec(spec: str, *, source: str = "given") -> Topology:
    """Parse ``dim=N,dim=N``; unknown dims, repeats and non-positive degrees are errors."""
    degrees: dict[str, int] = {}
    text = (spec or "").strip()
    if not text:
        raise BadInput("empty topology spec", hint="Write e.g. --to dp=32 or --to dp_shard=16,tp=2.")
    for part in text.split(","):
        part = part.strip()
        name, sep, value = part.partition("=")
        name = ALIASES.get(name.strip(), name.strip())
        if not sep or name not in DIMS:
            raise BadInput(f"bad topology term '{part}' in '{spec}'",
                           hint="Use comma-separated dim=N with dims dp, dp_shard, dp_replicate, tp, pp, cp.")
        if name in degrees:
            raise BadInput(f"dim '{name}' given twice in '{spec}'")
        try:
            n = int(value)
        except ValueError:
            n = 0
        if n < 1:
            raise BadInput(f"degree of '{name}' must be a positive integer, got '{value}'")
        degrees[name] = n
    return Topology(**degrees, source=source)


def from_manifest(topo: dict[str, Any]) -> Topology:
    dims = topo.get("dims", {}) if isinstance(topo, dict) else {}
    try:
        degrees = {d: int(dims.get(d, 1)) for d in DIMS}
    except (TypeError, ValueError):
        raise BadInput("manifest topology has non-integer degrees", where="manifest.json") from None
    return Topology(**degrees, source="manifest")


Chunk = tuple  # (offsets, sizes) or (offsets, sizes, writer rank or None)


def chunk_starts(rows: int, parts: int) -> tuple[int, ...]:
    """Where ``torch.chunk`` cuts ``rows`` rows into ``parts`` pieces: the starts of the non-empty pieces.

    FSDP2's ``fully_shard`` and DTensor's ``Shard(0)`` both cut this way (pieces of
    ``ceil(rows / parts)`` rows, the trailing ranks possibly empty), so the cut positions a
    checkpoint shows say which shard degrees could have written it.
    """
    step = -(-rows // parts) if rows and parts else 0
    return tuple(range(0, rows, step)) if step else ()


@dataclass
class ChunkEvidence:
    """What a checkpoint's chunks and data file names show of the layout that wrote it.

    ``cuts`` keeps one example tensor per distinct (rows, cut starts) of the tensors cut along
    dim 0 only, each piece written by another rank (a writer that saves several chunks of one
    tensor, as Megatron's stacked layers, says nothing of the shard degree): a key, its rows,
    the starts and their writers. Collected in one pass over the chunks; the same evidence
    infers a layout (`infer_from`) and checks one the user states (`contradictions`).
    """

    tensors: int = 0
    dim0: Counter = field(default_factory=Counter)     # dim-0 pieces per tensor whole in the other dims -> count
    tp_cuts: Counter = field(default_factory=Counter)  # pieces along a dim >= 1 -> count
    piece_writers: list[np.ndarray] = field(default_factory=list)  # per tensor cut along dim 0 only: (piece, writer) pairs
    cuts: dict[tuple[int, tuple[int, ...]], tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    writer_ranks: list[int] = field(default_factory=list)
    whole_rows: int = 0  # the most rows of a tensor saved in one piece (not cut along dim 0)
    # FSDP2's reading of cuts along a dim >= 1 (``shard_placement_fn`` returning ``Shard(d)``): tensors
    # cut along exactly one dim into ``torch.chunk``'s pieces for one per writer rank, each piece
    # from its own writer; per cut dim, the count and an example key. ``not_chunked`` is the first
    # tensor (key) that is not so cut (whole, or cut otherwise): tensor parallelism leaves some whole.
    chunked_dims: Counter = field(default_factory=Counter)
    chunked_example: dict[int, str] = field(default_factory=dict)
    not_chunked: str | None = None

    @property
    def collective(self) -> bool:
        """Some tensor's pieces were written by different ranks: every rank of the save took part
        (torch's writer then leaves a data file per rank, even an empty one)."""
        return any(len(set(w)) > 1 for _key, w in self.cuts.values())

    @property
    def contiguous_writers(self) -> bool:
        return bool(self.writer_ranks) and self.writer_ranks == list(range(len(self.writer_ranks)))


def collect(param_chunks: Iterable[tuple[Any, tuple[int, ...], np.ndarray, np.ndarray, np.ndarray]],
            writer_ranks: list[int]) -> ChunkEvidence:
    """One pass over ``(key, shape, offsets, sizes, writers)``, a tensor's chunks as int64 arrays
    (``(n, ndim)``, ``(n, ndim)``, ``(n,)``; a writer of -1 is unknown): the pieces, cuts and
    writers `ChunkEvidence` keeps. In numpy per distinct chunking: at 405B x 16,384 ranks there
    are 18 M parameter chunks, and tensors cut alike (FSDP2 cuts every tensor of a shape the same
    way: 180k keys hold a few dozen chunkings) are read once (`TensorCuts.of`), then counted."""
    ev = ChunkEvidence(writer_ranks=sorted(writer_ranks))
    world = len(ev.writer_ranks)
    seen: dict[tuple, TensorCuts] = {}
    for key, shape, offs, sizes, writers in param_chunks:
        ev.tensors += 1
        if not shape:
            continue
        alike = (tuple(shape), offs.dtype.str, offs.tobytes(), sizes.dtype.str, sizes.tobytes(), writers.dtype.str,
                 writers.tobytes())
        cuts = seen.get(alike)
        if cuts is None:
            cuts = seen[alike] = TensorCuts.of(tuple(shape), offs, sizes, writers, world)
        cuts.count(ev, key, shape)
    return ev


@dataclass(frozen=True)
class TensorCuts:
    """What one tensor's chunks show, apart from its key: its pieces per dim and, cut along dim 0
    only, which writer wrote which piece, the cut (positions, writers in order) when each piece
    has its own writer, and the dim it is cut along as FSDP2 cuts a parameter (`chunked_dim`)."""

    pieces: tuple[int, ...]
    piece_writers: np.ndarray | None  # (piece, writer) pairs, dim-0 cuts only
    cut: tuple[int, tuple[int, ...]] | None
    cut_writers: tuple[int, ...]
    chunked_dim: int | None

    @classmethod
    def of(cls, shape: tuple[int, ...], offs: np.ndarray, sizes: np.ndarray, writers: np.ndarray,
           world: int) -> "TensorCuts":
        full = (sizes > 0).all(axis=1) if len(sizes) else np.zeros(0, dtype=bool)
        offs, writers = offs[full], writers[full]
        starts = [np.unique(offs[:, d]) for d in range(len(shape))]
        pieces = tuple(len(x) for x in starts)
        piece_writers, cut, cut_writers = None, None, ()
        if all(p == 1 for p in pieces[1:]):
            position = np.searchsorted(starts[0], offs[:, 0])
            known = writers >= 0
            codes = np.unique(position[known].astype(np.int64) << 32 | writers[known])  # (piece, writer), once each
            piece_writers = np.stack([codes >> 32, codes & 0xFFFFFFFF], axis=1)
            if pieces[0] > 1 and known.all() and len(np.unique(writers)) == len(writers) == pieces[0]:
                cut = (shape[0], tuple(starts[0].tolist()))
                cut_writers = tuple(writers[np.argsort(offs[:, 0], kind="stable")].tolist())
        return cls(pieces, piece_writers, cut, cut_writers, _chunked_dim(shape, starts, writers, world))

    def count(self, ev: ChunkEvidence, key: Any, shape: tuple[int, ...]) -> None:
        """Add one tensor (``key``) cut so to ``ev``: the first key of each cut and of each way is the example."""
        if self.piece_writers is not None:
            ev.dim0[self.pieces[0]] += 1
            ev.piece_writers.append(self.piece_writers)
            if self.pieces[0] == 1:
                ev.whole_rows = max(ev.whole_rows, shape[0])
            if self.cut is not None and self.cut not in ev.cuts:
                ev.cuts[self.cut] = (str(key), self.cut_writers)
        for p in self.pieces[1:]:
            if p > 1:
                ev.tp_cuts[p] += 1
        if self.chunked_dim is not None:
            ev.chunked_dims[self.chunked_dim] += 1
            ev.chunked_example.setdefault(self.chunked_dim, str(key))
        elif ev.not_chunked is None:
            ev.not_chunked = str(key)


def _chunked_dim(shape: tuple[int, ...], starts: list[np.ndarray], writers: np.ndarray, world: int) -> int | None:
    """The dim one tensor is cut along as FSDP2 cuts every parameter: along one dim, at ``torch.chunk``'s
    starts for one piece per writer rank, each piece written by its own rank (`ChunkEvidence.chunked_dims`);
    None when it is not so cut."""
    cut = [d for d in range(len(shape)) if len(starts[d]) > 1]
    ok = (world > 1 and len(cut) == 1 and (writers >= 0).all() and len(np.unique(writers)) == len(writers)
          == len(starts[cut[0]]) and chunk_starts(shape[cut[0]], world) == tuple(starts[cut[0]].tolist()))
    return cut[0] if ok else None


def infer_from(ev: ChunkEvidence) -> Topology:
    """Infer a layout from how parameter tensors were cut, and by whom.

    FSDP2 cuts dim 0 into ``dp_shard`` pieces; tensor parallelism adds cuts along the dim a
    layer is parallel in. We count distinct cut positions per dim over all parameters: the
    largest number of dim-0 pieces of a tensor whose other dims are whole is the FSDP
    degree; cuts along dim >= 1 indicate TP. The number of writer files bounds the world.

    When there are more writers than distinct shards, the rest are replicas (dp_replicate,
    HSDP) or pipeline stages, or shards too small to fill every rank. The writers tell them
    apart: DCP writes each replicated chunk once, spread over the ranks that hold it, so a
    dim-0 piece ``i`` written by ranks ``i, i + S, i + 2S ...`` (S = dp_shard) shows replica
    groups; torch's writer leaves a data file on every rank, so cuts that are exactly
    ``torch.chunk``'s for one shard per writer show that. If the replicas left no such trace
    (DCP may put every replicated chunk on the lowest rank), the layout is ambiguous: the
    candidates are listed and none is presented as fact.
    """
    dim0, tp_cuts = ev.dim0, ev.tp_cuts
    tp = max(tp_cuts) if tp_cuts else 1
    shard = max(dim0) if dim0 else 1
    world = len(ev.writer_ranks) or 1
    evidence = [f"{ev.tensors} tensors examined", f"{world} writer rank(s) from data file names"]
    if dim0:
        evidence.append(f"dim-0 pieces per tensor: {dict(sorted(dim0.items()))}")
    if tp_cuts:
        evidence.append(f"tensors cut along dim>=1 into {dict(sorted(tp_cuts.items()))} pieces (tensor parallel)")
    if tp > 1 and tp == world and ev.not_chunked is None and any(d >= 1 for d in ev.chunked_dims):
        return _fsdp_or_tp(ev, world, evidence)
    if tp > 1 and world % tp == 0 and shard * tp != world:
        # With 2-D (FSDP x TP) the dim-0 pieces seen on column-parallel weights are dp*tp.
        shard = max(1, world // tp)
    if shard * tp >= world:
        return Topology(dp_shard=shard, tp=tp, source="inferred", evidence=tuple(evidence))
    return _more_writers_than_shards(shard, tp, world, ev, evidence)


def _fsdp_or_tp(ev: ChunkEvidence, world: int, evidence: list[str]) -> Topology:
    """Cuts along a dim >= 1 that FSDP2 with ``shard_placement_fn`` (``Shard(1)``) makes as well as TP: ambiguous.

    Every tensor is cut along one dim into ``torch.chunk``'s pieces for one per writer, each from
    its own rank: FSDP2 cuts every parameter of a group so (``Shard(d)`` per parameter), while a
    tensor-parallel plan cuts only the parameters it names and leaves norms and row-parallel
    biases whole. So FSDP (``dp_shard = world``) is the reading the evidence supports and comes
    first; TP stays a candidate (a plan that names every parameter cuts them all too).
    """
    dims = ", ".join(f"{n} along dim {d} (e.g. '{ev.chunked_example[d]}')" for d, n in sorted(ev.chunked_dims.items()))
    evidence.append(f"every one of {sum(ev.chunked_dims.values())} tensors is cut along one dim into torch.chunk's "
                    f"pieces for {world} ranks, one piece per writer: {dims}. FSDP2 with shard_placement_fn "
                    f"(Shard(1)) cuts every parameter so; tensor parallelism cuts only the parameters its plan names "
                    f"and leaves the rest whole, and none is whole here")
    fsdp, tp = Topology(dp_shard=world), Topology(tp=world)
    return Topology(dp_shard=world, source="inferred", evidence=tuple(evidence),
                    alternatives=(fsdp.spec(), tp.spec()))


def _every_writer_a_shard(ev: ChunkEvidence, tp: int, world: int) -> bool:
    """Whether one ``torch.chunk`` shard per writer explains every cut: the tensors are too small to give
    every rank rows (FSDP2 leaves the trailing ranks empty), and torch's writer still wrote a file on each."""
    return (tp == 1 and ev.collective and ev.contiguous_writers and len(chunk_starts(ev.whole_rows, world)) <= 1
            and all(chunk_starts(rows, world) == starts for rows, starts in ev.cuts))


def replicas_not_stored(topo: Topology, writer: str) -> Topology:
    """An inferred layout from a writer that saves one replica only: its dp degree is unknown, so it is ambiguous.

    The shards and TP cuts seen are kept; the candidates say that any ``dp_replicate`` fits.
    """
    if topo.dp_replicate > 1 or topo.source != "inferred":
        return topo
    spec = topo.spec()
    return Topology(**topo.degrees(), source="inferred",
                    evidence=topo.evidence + (f"{writer} saves each replicated chunk from one replica only: "
                                              "the data-parallel replicas leave no trace in the checkpoint",),
                    alternatives=(spec, f"dp_replicate=N,{spec}" if spec != "dp=1" else "dp_replicate=N"))


def _more_writers_than_shards(shard: int, tp: int, world: int, ev: ChunkEvidence, evidence: list[str]) -> Topology:
    """Replicas shown by who wrote which piece, one small shard per writer, or an ambiguous answer listing the layouts that fit."""
    extra = world // (shard * tp) if world % (shard * tp) == 0 else 0
    pairs = np.concatenate(ev.piece_writers) if ev.piece_writers else np.zeros((0, 2), dtype=np.int64)
    replica_trace = (tp == 1 and extra > 1 and bool((pairs[:, 1] >= shard).any())
                     and bool((pairs[:, 1] % shard == pairs[:, 0]).all()))
    if replica_trace:
        evidence.append(f"each dim-0 piece i is written by ranks congruent to i mod {shard}, some beyond the first "
                        f"{shard}: {extra} replicas of {shard} shards (HSDP / DDP)")
        return Topology(dp_replicate=extra, dp_shard=shard, source="inferred", evidence=tuple(evidence))
    small = _every_writer_a_shard(ev, tp, world)
    if small and extra <= 1:
        evidence.append(f"{world} writer ranks each wrote a data file (torch's writer does, even an empty one) and "
                        f"every cut is torch.chunk's for {world} shards: tensors of fewer rows leave the last ranks "
                        f"empty, so no tensor shows {world} pieces")
        return Topology(dp_shard=world, source="inferred", evidence=tuple(evidence))
    evidence.append(f"{world} writers but only {shard * tp} distinct shards: the rest are replicas (dp_replicate) "
                    "or pipeline stages, which the chunks do not tell apart")
    base = Topology(dp_shard=shard, tp=tp)
    alternatives = [base.spec()]
    if extra > 1:
        alternatives = [Topology(dp_replicate=extra, dp_shard=shard, tp=tp).spec(),
                        Topology(pp=extra, dp_shard=shard, tp=tp).spec(), base.spec()]
    if small:
        alternatives.append(Topology(dp_shard=world).spec())
    if len(alternatives) == 1:
        return Topology(dp_shard=shard, tp=tp, source="inferred", evidence=tuple(evidence))
    # Degrees of the first candidate (its world size matches the writers), flagged ambiguous.
    first = parse_spec(alternatives[0])
    return Topology(**first.degrees(), source="inferred", evidence=tuple(evidence), alternatives=tuple(alternatives))


# ---------------------------------------------------------------------------- a stated layout against the bytes

def contradictions(stated: Topology, ev: ChunkEvidence, *, stores_replicas: bool = True) -> list[str]:
    """What the chunks and data files show that ``stated`` cannot have written, one sentence each.

    Only what holds for every writer is used, so an empty list means "not contradicted", not
    "confirmed": a rank number beyond the stated world; a tensor cut into more dim-0 pieces
    than the stated degrees cut it (each piece from its own writer); and, with no TP or CP
    stated, cut positions that are not ``torch.chunk``'s for the stated ``dp_shard``, for a
    writer that stores every shard under its own rank (``stores_replicas``; not Megatron's,
    whose cuts are its own). A world larger than the ranks that left data files is no
    contradiction: Megatron's writer and reshard's own skip a rank with nothing to write, and
    a rank-0 ``no_dist`` save of a replicated model leaves one file whatever the world.
    """
    out: list[str] = []
    world = stated.world_size
    if ev.writer_ranks and ev.writer_ranks[-1] >= world:
        r = ev.writer_ranks[-1]
        out.append(f"rank {r} wrote a data file (__{r}_*.distcp) but world size {world} has ranks 0..{world - 1} only")
    spread = stated.dp_shard * stated.cp * stated.tp
    for (rows, starts), (key, writers) in ev.cuts.items():
        if len(starts) > spread:
            out.append(f"'{key}' ({rows} rows) is cut into {len(starts)} dim-0 pieces by {len(set(writers))} writer "
                       f"ranks, more than dp_shard x cp x tp = {spread} ranks hold")
            break
    if stores_replicas and stated.tp == 1 and stated.cp == 1:
        for (rows, starts), (key, writers) in ev.cuts.items():
            expect = chunk_starts(rows, stated.dp_shard)
            if expect != starts and len(starts) <= spread:
                out.append(f"'{key}' ({rows} rows) is cut at rows {_rows(starts)} ({len(starts)} pieces, written by "
                           f"ranks {_rows(writers)}); dp_shard={stated.dp_shard} cuts it at rows {_rows(expect)}")
                break
    return out


def _rows(xs: Iterable[Any]) -> str:
    xs = list(xs)
    return ", ".join(str(x) for x in xs[:8]) + (f", ... ({len(xs)} in all)" if len(xs) > 8 else "")
