"""Metadata-only DCP checkpoints at frontier scale: the `.metadata` torch writes, sparse data files.

A 16,384-rank checkpoint cannot be written by spawning 16,384 processes on a laptop, but
everything `reshard inspect` and `reshard plan` read of it is the `.metadata` file and the
sizes of the data files. This module writes exactly those: the `Metadata` object that
``torch.distributed.checkpoint.save`` (``DefaultSavePlanner`` + ``FileSystemWriter``, the
defaults) would pickle for an FSDP2 (optionally FSDP2 x TP) job saving
``{"model": model_sd, "optim": optim_sd}`` from ``get_state_dict(model, AdamW)``, and one
``__<rank>_0.distcp`` per rank, truncated (sparse: no byte written) to the length torch's
writer would have produced. What it reproduces, read from torch 2.13's own code:

* chunks: FSDP2 ``Shard(0)`` with the ``torch.chunk`` rule (pieces of ``ceil(n / dp)`` rows,
  the last one short; an empty piece has offset ``n``, as DTensor reports it, and since all
  empty pieces of a tensor share that offset they are one write item); with TP the boxes are
  DTensor's own (``_compute_local_shape_and_global_offset`` on the placements FSDP2 x TP give);
* deduplication (``_dedup_save_plans``, load-balanced): items saved by several ranks (the
  0-d ``step`` tensors, the ``param_groups`` objects, TP-replicated norms, empty pieces) go to
  the holder with the smallest planned size so far, sizes counted in global tensor bytes, in
  first-appearance order; ``state_dict_metadata`` keys in the order the deduplicated plans
  list them; chunk lists and their index hints in plan order;
* storage: one file per rank (``thread_count=1``), byte items first then tensors, each item
  ``torch.save``'d, so its length is the length of a real ``torch.save`` of a tensor of the
  chunk's shape and dtype (computed once per distinct shape) or of the object;
* the pickle: protocol 4 with the object sharing the gathered plans have (the file path
  string shared within a rank's results, fresh key strings per rank, ``planner_data`` keys
  from the last rank's plan and values from rank 0's, as ``ChainMap`` merges them).

The `.metadata` is streamed: a ``pickle._Pickler`` (the stdlib's own, so the opcodes are
pickle's) whose chunk lists and ``storage_data`` are emitted entry by entry, each entry's
opcodes written directly with the memo kept as a count, not as live objects. Memory is
then per distinct shape and per rank, not per chunk, and 405B x 16,384 ranks (56 M chunks)
can be written on a small machine. The byte stream (frames aside: a frame is cut at an entry
boundary rather than at the next object) equals ``pickle.dumps`` of the same ``Metadata``
built from torch's own classes (:func:`build_metadata` with ``materialize=True``);
``tests/test_synthetic_metadata.py`` checks both against a real multi-process ``dcp.save``.
"""
from __future__ import annotations

import io
import os
import pathlib
import pickle
import struct
import sys
import uuid
from dataclasses import dataclass, field
from math import prod
from typing import Any, Iterator, Sequence

import numpy as np
import torch

__all__ = [
    "LlamaConfig",
    "LLAMA3",
    "Entry",
    "BuildResult",
    "llama_entries",
    "build_metadata",
    "make_llama_metadata_checkpoint",
    "torch_save_length",
]

METADATA_NAME = ".metadata"
DCP_VERSION = "1.0.0"  # FileSystemWriter's CURRENT_DCP_VERSION in torch 2.6 .. 2.13
_BATCH = 1000  # pickle's _BATCHSIZE (SETITEMS / APPENDS batches)


# --------------------------------------------------------------------------------------
# What is saved
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaConfig:
    """A Llama-3 flavour's shapes (torchtitan's ``llama3_configs``, pre-0.3 parameter names)."""

    name: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab: int = 128256

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def model_config(self) -> dict[str, int]:
        """What a TP plan asks for (``--model-config``)."""
        return {"n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads, "vocab": self.vocab,
                "dim": self.dim, "n_layers": self.n_layers}


LLAMA3 = {
    # Llama-3.2-1B's shapes (untied here): the largest flavour whose 16,384-rank `.metadata` torch's own
    # read_metadata can open in 24 GiB (7.2 M storage entries)
    "1B": LlamaConfig("1B", dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192),
    "8B": LlamaConfig("8B", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336),
    "70B": LlamaConfig("70B", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672),
    "405B": LlamaConfig("405B", dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248),
}


@dataclass(frozen=True)
class Entry:
    """One flattened state-dict key as every rank holds it.

    ``kind``: ``"shard"`` (a DTensor: FSDP2 ``Shard(0)`` over dp, and over tp ``tp_dim``'s
    ``Shard``, or replicated over tp when ``tp_dim`` is None), ``"tensor"`` (a plain tensor
    every rank holds, e.g. AdamW's 0-d ``step``) or ``"bytes"`` (a picklable object every rank
    holds). ``path``: the key's path in the nested state dict (``flatten_state_dict``'s
    mapping, what ``planner_data`` records).
    """

    key: str
    kind: str
    path: tuple
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32
    tp_dim: int | None = None
    value: Any = None


def _llama_params(cfg: LlamaConfig) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(fqn, shape, TP dim) in module registration order (torchtitan's Transformer)."""
    kv = cfg.n_kv_heads * cfg.head_dim
    out = [("tok_embeddings.weight", (cfg.vocab, cfg.dim), 0)]
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        out += [(p + "attention.wq.weight", (cfg.n_heads * cfg.head_dim, cfg.dim), 0),
                (p + "attention.wk.weight", (kv, cfg.dim), 0),
                (p + "attention.wv.weight", (kv, cfg.dim), 0),
                (p + "attention.wo.weight", (cfg.dim, cfg.n_heads * cfg.head_dim), 1),
                (p + "feed_forward.w1.weight", (cfg.ffn_dim, cfg.dim), 0),
                (p + "feed_forward.w2.weight", (cfg.dim, cfg.ffn_dim), 1),
                (p + "feed_forward.w3.weight", (cfg.ffn_dim, cfg.dim), 0),
                (p + "attention_norm.weight", (cfg.dim,), None),
                (p + "ffn_norm.weight", (cfg.dim,), None)]
    out += [("norm.weight", (cfg.dim,), None), ("output.weight", (cfg.vocab, cfg.dim), 0)]
    return out


def adamw_param_group(fqns: list[str], **hyper: Any) -> dict[str, Any]:
    """The param group ``get_state_dict`` saves for torch's AdamW (``params`` as fqns, last).

    Built by torch itself (an AdamW on a dummy parameter, its ``state_dict()``), so the
    hyper-parameter names and their order are those of the installed torch.
    """
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], **hyper)
    group = dict(opt.state_dict()["param_groups"][0])
    group["params"] = list(fqns)
    return group


def model_entries(params: Sequence[tuple[str, tuple[int, ...], int | None]], *, dtype: torch.dtype = torch.float32,
                  optimizer: bool = True, hyper: dict[str, Any] | None = None, step: int = 1000) -> list[Entry]:
    """The flattened ``{"model": ..., "optim": ...}`` of ``get_state_dict(model, AdamW)``.

    ``model.<fqn>`` for every parameter, then per parameter ``optim.state.<fqn>.step`` (a 0-d
    float32 tensor on every rank), ``.exp_avg`` and ``.exp_avg_sq`` (DTensors like the
    parameter), then ``optim.param_groups.0.<name>`` (objects).
    """
    out = [Entry(f"model.{f}", "shard", ("model", f), tuple(s), dtype, td) for f, s, td in params]
    if not optimizer:
        return out
    for f, s, td in params:
        out.append(Entry(f"optim.state.{f}.step", "tensor", ("optim", "state", f, "step"), (), torch.float32,
                         value=torch.tensor(float(step))))
        for role in ("exp_avg", "exp_avg_sq"):
            out.append(Entry(f"optim.state.{f}.{role}", "shard", ("optim", "state", f, role), tuple(s), dtype, td))
    for name, value in adamw_param_group([f for f, _, _ in params], **(hyper or {"lr": 3e-4})).items():
        out.append(Entry(f"optim.param_groups.0.{name}", "bytes", ("optim", "param_groups", 0, name), value=value))
    return out


def llama_entries(cfg: LlamaConfig | str, *, optimizer: bool = True, dtype: torch.dtype = torch.float32) -> list[Entry]:
    """A Llama-3 flavour's state-dict entries (fp32 parameters and moments, as FSDP2 keeps them)."""
    cfg = LLAMA3[cfg] if isinstance(cfg, str) else cfg
    return model_entries(_llama_params(cfg), dtype=dtype, optimizer=optimizer)


# --------------------------------------------------------------------------------------
# Lengths torch.save gives
# --------------------------------------------------------------------------------------

_LEN_CACHE: dict[tuple, int] = {}


class _CountingSink(io.RawIOBase):
    """A write-only stream that keeps only a count (torch.save of a big chunk writes nothing)."""

    def __init__(self) -> None:
        self.n = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        k = memoryview(b).nbytes
        self.n += k
        return k

    def tell(self) -> int:
        return self.n

    def seekable(self) -> bool:
        return False


def torch_save_length(sizes: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes ``torch.save`` writes for a contiguous tensor of ``sizes`` and ``dtype`` (cached).

    FileSystemWriter's default serialization writes every item with ``torch.save`` into the
    rank's file, so an item's length is this, not ``numel * itemsize``. Measured with torch
    itself on an uninitialised tensor (the length does not depend on the values).
    """
    key = (tuple(int(s) for s in sizes), dtype)
    n = _LEN_CACHE.get(key)
    if n is None:
        sink = _CountingSink()
        torch.save(torch.empty(key[0], dtype=dtype), sink)
        n = _LEN_CACHE[key] = sink.n
    return n


def _object_length(value: Any) -> int:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.tell()


# --------------------------------------------------------------------------------------
# Geometry and deduplication
# --------------------------------------------------------------------------------------


@dataclass
class _Geom:
    """Per-rank chunk boxes of one (shape, TP dim) class and their write-item groups."""

    offsets: np.ndarray  # (N, ndim) int64
    sizes: np.ndarray  # (N, ndim) int64
    group: np.ndarray  # (N,) group id: ranks with equal offsets (one write item after dedup)
    count: np.ndarray  # (G,) ranks per group
    first: np.ndarray  # (G,) lowest rank of each group
    lengths: np.ndarray  # (N,) torch.save length of the rank's chunk


def _fsdp_boxes(shape: tuple[int, ...], dp: int) -> tuple[np.ndarray, np.ndarray]:
    n = shape[0]
    d = np.arange(dp, dtype=np.int64)
    step = -(-n // dp)
    start = np.minimum(d * step, n)
    size = np.minimum(start + step, n) - start
    offs = np.zeros((dp, len(shape)), dtype=np.int64)
    sizes = np.tile(np.asarray(shape, dtype=np.int64), (dp, 1))
    offs[:, 0], sizes[:, 0] = start, size
    return offs, sizes


def _tp_boxes(shape: tuple[int, ...], dp: int, tp: int, tp_dim: int | None) -> tuple[np.ndarray, np.ndarray]:
    """DTensor's own boxes for FSDP2 x TP placements on a (dp, tp) mesh (rank = d * tp + t)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    if tp_dim is None:
        placements = [Shard(0), Replicate()]
    elif tp_dim == 0:
        placements = [_StridedShard(0, split_factor=tp), Shard(0)]  # FSDP's cut inside each TP block
    else:
        placements = [Shard(0), Shard(tp_dim)]
    n = dp * tp
    offs = np.zeros((n, len(shape)), dtype=np.int64)
    sizes = np.zeros((n, len(shape)), dtype=np.int64)
    for r in range(n):
        s, o = _compute_local_shape_and_global_offset(shape, (dp, tp), list(divmod(r, tp)), placements)
        offs[r], sizes[r] = o, s
    return offs, sizes


def _geometry(shape: tuple[int, ...], dtype: torch.dtype, dp: int, tp: int, tp_dim: int | None) -> _Geom:
    if not shape:
        raise ValueError("a sharded entry needs at least one dimension")
    if tp == 1:
        offs, sizes = _fsdp_boxes(shape, dp)
    else:
        offs, sizes = _tp_boxes(shape, dp, tp, tp_dim)
    _, first_idx, group, count = np.unique(offs, axis=0, return_index=True, return_inverse=True, return_counts=True)
    group = group.reshape(-1)
    uniq_sizes, inv = np.unique(sizes, axis=0, return_inverse=True)
    lens = np.array([torch_save_length(tuple(s), dtype) for s in uniq_sizes], dtype=np.int64)[inv.reshape(-1)]
    return _Geom(offs, sizes, group.astype(np.int64), count.astype(np.int64), first_idx.astype(np.int64), lens)


@dataclass
class _Plan:
    """The global save plan in arrays: who writes what, in which order, at which offsets."""

    entries: list[Entry]
    n_ranks: int
    classes: list[_Geom]  # distinct (shape, dtype, TP dim) geometries
    class_of: np.ndarray  # per entry: its class, -1 for plain tensors and objects
    gsize: np.ndarray  # per entry: dedup cost of one item (global bytes, or 1 for objects)
    lengths: np.ndarray  # per entry: length of a non-shard entry's item (0 for shards)
    owner: dict[tuple[int, int], int]  # (entry, group) of a multi-holder item -> writer rank
    owned: dict[int, list[int]]  # rank -> entries of multi-holder items it writes
    md_order: list[int]  # entries in state_dict_metadata order
    first_plan: np.ndarray  # per entry: first plan (after dedup) listing it
    file_sizes: np.ndarray  # (N,) bytes of each rank's file
    _pos_cache: dict = field(default_factory=dict)
    _owners_cache: dict = field(default_factory=dict)
    singles: np.ndarray | None = None  # (classes, N): rank holds its class's chunk alone

    def shared_owners(self, e: int) -> tuple[tuple[int, int], ...]:
        """(group, writer) of entry ``e``'s multi-holder chunks: with its class, what fixes its chunk list."""
        hit = self._owners_cache.get(e)
        if hit is None:
            g = self.classes[self.class_of[e]]
            hit = self._owners_cache[e] = tuple((int(grp), self.owner[(e, int(grp))])
                                                for grp in np.flatnonzero(g.count > 1))
        return hit

    def chunk_ranks(self, e: int) -> np.ndarray:
        """Ranks whose item of entry ``e`` survives, in plan order (the chunk list's order)."""
        return self._ranks_pos(e)[0]

    def hint(self, e: int) -> np.ndarray:
        """rank -> position of its chunk in entry ``e``'s chunk list (-1: it writes none)."""
        return self._ranks_pos(e)[1]

    def _ranks_pos(self, e: int):
        c = int(self.class_of[e])
        if c < 0:
            w = self.owner[(e, 0)]
            pos = np.full(self.n_ranks, -1, dtype=np.int64)
            pos[w] = 0
            return np.array([w], dtype=np.int64), pos
        k = (c, self.shared_owners(e))
        hit = self._pos_cache.get(k)
        if hit is None:
            g = self.classes[c]
            keep = g.count[g.group] == 1
            for _, w in k[1]:
                keep[w] = True
            ranks = np.flatnonzero(keep)
            pos = np.full(self.n_ranks, -1, dtype=np.int64)
            pos[ranks] = np.arange(ranks.size)
            hit = self._pos_cache[k] = (ranks, pos)
        return hit

    def rank_items(self, r: int) -> np.ndarray:
        """Entries rank ``r`` writes, in the order its file holds them (objects first)."""
        shard = self._shard_idx
        mine = shard[self._single[self.class_of[shard], r]]
        extra = self.owned.get(r, [])
        if extra:
            obj = sorted(e for e in extra if self.entries[e].kind == "bytes")
            rest = np.sort(np.concatenate([mine, np.array([e for e in extra if self.entries[e].kind != "bytes"],
                                                           dtype=np.int64)]))
            return np.concatenate([np.array(obj, dtype=np.int64), rest])
        return mine

    @property
    def _shard_idx(self) -> np.ndarray:
        return np.flatnonzero(self.class_of >= 0)

    @property
    def _single(self) -> np.ndarray:
        return self.singles

    def storage_entries(self) -> int:
        return int(sum(int((self.class_of == c).sum()) * int(self.singles[c].sum()) for c in range(len(self.classes)))
                   + sum(len(v) for v in self.owned.values()))


def _plan(entries: list[Entry], dp: int, tp: int) -> _Plan:
    n = dp * tp
    index: dict[tuple, int] = {}
    classes: list[_Geom] = []
    class_of = np.full(len(entries), -1, dtype=np.int64)
    gsize = np.zeros(len(entries), dtype=np.int64)
    lengths = np.zeros(len(entries), dtype=np.int64)
    for e, ent in enumerate(entries):
        if ent.kind == "shard":
            k = (ent.shape, ent.dtype, ent.tp_dim if tp > 1 else None)
            if k not in index:
                index[k] = len(classes)
                classes.append(_geometry(ent.shape, ent.dtype, dp, tp, k[2]))
            class_of[e] = index[k]
            gsize[e] = prod(ent.shape) * ent.dtype.itemsize
        elif ent.kind == "tensor":
            gsize[e] = (prod(ent.shape) * ent.dtype.itemsize) or 1
            lengths[e] = torch_save_length(ent.shape, ent.dtype)
        elif ent.kind == "bytes":
            gsize[e] = 1
            lengths[e] = _object_length(ent.value)
        else:
            raise ValueError(f"unknown entry kind {ent.kind!r} for {ent.key}")
    singles = np.stack([g.count[g.group] == 1 for g in classes]) if classes else np.zeros((0, n), bool)

    # multi-holder items by the plan where they first appear: rank -> [(entry, group, holders)]
    shared_at: dict[int, list[tuple[int, int, np.ndarray]]] = {}
    all_ranks = np.arange(n, dtype=np.int64)
    for e in range(len(entries)):
        c = int(class_of[e])
        if c < 0:
            shared_at.setdefault(0, []).append((e, 0, all_ranks))
            continue
        g = classes[c]
        for grp in np.flatnonzero(g.count > 1):
            holders = np.flatnonzero(g.group == grp)
            shared_at.setdefault(int(holders[0]), []).append((e, int(grp), holders))

    # _dedup_save_plans, load-balanced: items in first-appearance order (plan by plan, item by
    # item); a single-holder item adds its cost to its plan, a multi-holder item goes to the
    # holder with the smallest size so far (the lowest rank on ties, as min() over the set).
    plan_size = np.zeros(n, dtype=np.int64)
    owner: dict[tuple[int, int], int] = {}
    owned: dict[int, list[int]] = {}
    shard = np.flatnonzero(class_of >= 0)
    # a rank's single-holder cost: per class, gsize summed over its entries, where single
    class_cost = np.zeros((len(classes), n), dtype=np.int64)
    for e in shard:
        class_cost[class_of[e]] += gsize[e]
    own_total = (class_cost * singles).sum(axis=0) if classes else np.zeros(n, dtype=np.int64)
    for r in range(n):
        items = shared_at.get(r)
        if items:
            own = np.zeros(len(entries), dtype=np.int64)
            own[shard] = np.where(singles[class_of[shard], r], gsize[shard], 0)
            prefix = np.concatenate([[0], np.cumsum(own)])  # single-holder cost before position e
            for e, grp, holders in sorted(items, key=lambda t: t[0]):
                sizes = plan_size[holders]
                sizes[0] += prefix[e]  # holders[0] == r: its own items before e
                w = int(holders[int(np.argmin(sizes))])
                owner[(e, grp)] = w
                owned.setdefault(w, []).append(e)
                plan_size[w] += gsize[e]
        plan_size[r] += own_total[r]

    # lengths of each rank's file
    file_sizes = np.zeros(n, dtype=np.int64)
    for c, g in enumerate(classes):
        file_sizes += int((class_of == c).sum()) * np.where(singles[c], g.lengths, 0)
    for w, es in owned.items():
        for e in es:
            c = int(class_of[e])
            file_sizes[w] += int(lengths[e]) if c < 0 else int(classes[c].lengths[w])

    # first plan listing each entry (after dedup), and the state_dict_metadata order
    first_plan = np.zeros(len(entries), dtype=np.int64)
    for e in range(len(entries)):
        c = int(class_of[e])
        if c < 0:
            first_plan[e] = owner[(e, 0)]
            continue
        g = classes[c]
        cand = [owner[(e, int(grp))] for grp in np.flatnonzero(g.count > 1)]
        if singles[c].any():
            cand.append(int(np.argmax(singles[c])))
        first_plan[e] = min(cand)
    md_order = sorted(range(len(entries)), key=lambda e: (int(first_plan[e]), e))
    plan = _Plan(entries, n, classes, class_of, gsize, lengths, owner, owned, md_order, first_plan, file_sizes)
    plan.singles = singles
    return plan


def _item_length(plan: _Plan, e: int, r: int) -> int:
    c = int(plan.class_of[e])
    return int(plan.classes[c].lengths[r]) if c >= 0 else int(plan.lengths[e])


# --------------------------------------------------------------------------------------
# Pickling: the Metadata object, materialised or streamed
# --------------------------------------------------------------------------------------


def _fresh(s: str) -> str:
    """An equal string that is a distinct object (as a string from another rank's message is)."""
    return (s + "\0")[:-1]


class _Namespace:
    """Strings of one rank's message: equal strings of one role are one object, as on the sender."""

    def __init__(self) -> None:
        self._d: dict[tuple[str, str], str] = {}

    def get(self, role: str, s: str) -> str:
        k = (role, s)
        v = self._d.get(k)
        if v is None:
            v = self._d[k] = _fresh(s)
        return v


def _path(ns: _Namespace, path: tuple) -> tuple:
    """A planner_data value as rank 0's mapping holds it: the top-level name, the optimizer's
    fixed names and the fqn inside ``optim.state`` are shared; a model fqn is its own string."""
    role = "model" if path and path[0] == "model" else "optim"
    return tuple(ns.get(role, p) if isinstance(p, str) else p for p in path)


class _LazyChunks:
    """Stands in for a TensorStorageMetadata's chunk list while pickling (streamed)."""

    def __init__(self, plan: _Plan, e: int) -> None:
        self.plan, self.e = plan, e


class _LazyStorage:
    """Stands in for ``storage_data`` while pickling (streamed)."""

    def __init__(self, plan: _Plan, names: list[str]) -> None:
        self.plan, self.names = plan, names


def _props(dtype: torch.dtype):
    from torch.distributed.checkpoint.metadata import TensorProperties

    return TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False,
                            memory_format=torch.contiguous_format, pin_memory=False)


def _skeleton(plan: _Plan, *, checkpoint_id: Any, save_id: str, materialize: bool):
    """The Metadata object, with the bulk (chunk lists, storage_data) real or lazy."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorStorageMetadata,
    )

    entries, n = plan.entries, plan.n_ranks
    last, zero = _Namespace(), _Namespace()
    last_keys = [last.get("key", ent.key) for ent in entries]
    sdm: dict[str, Any] = {}
    for e in plan.md_order:
        ent = entries[e]
        key = last_keys[e] if int(plan.first_plan[e]) == n - 1 else _fresh(ent.key)
        if ent.kind == "bytes":
            sdm[key] = BytesStorageMetadata()
            continue
        if materialize:
            chunks: Any = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in _chunks(plan, e)]
        else:
            chunks = _LazyChunks(plan, e)
        sdm[key] = TensorStorageMetadata(properties=_props(ent.dtype), size=torch.Size(ent.shape), chunks=chunks)
    planner_data = {last_keys[e]: _path(zero, ent.path) for e, ent in enumerate(entries)}
    names = [f"__{r}_0.distcp" for r in range(n)]
    if materialize:
        storage: Any = {}
        for r in range(n):
            rel = _fresh(names[r])
            for e, off, length, hint, offs in _rank_entries(plan, r):
                ent = entries[e]
                idx = MetadataIndex(_fresh(ent.key), None if offs is None else offs, hint)
                storage[idx] = _StorageInfo(rel, off, length)
    else:
        storage = _LazyStorage(plan, names)
    return Metadata(state_dict_metadata=sdm, planner_data=planner_data, storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id), version=DCP_VERSION)


def _chunks(plan: _Plan, e: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    c = int(plan.class_of[e])
    if c < 0:
        yield (), tuple(plan.entries[e].shape)
        return
    g = plan.classes[c]
    for r in plan.chunk_ranks(e):
        yield tuple(int(x) for x in g.offsets[r]), tuple(int(x) for x in g.sizes[r])


def _rank_entries(plan: _Plan, r: int):
    """(entry, file offset, length, index hint, chunk offsets or None) for rank r's items, in file order."""
    items = plan.rank_items(r).tolist()
    cls = plan.class_of[items].tolist() if items else []
    offs_of = {c: tuple(int(x) for x in g.offsets[r]) for c, g in enumerate(plan.classes)}
    len_of = {c: int(g.lengths[r]) for c, g in enumerate(plan.classes)}
    off = 0
    for e, c in zip(items, cls):
        if c >= 0:
            length = len_of[c]
            yield e, off, length, int(plan.hint(e)[r]), offs_of[c]
        else:
            ent = plan.entries[e]
            length = int(plan.lengths[e])
            if ent.kind == "bytes":
                yield e, off, length, None, None
            else:
                yield e, off, length, 0, (0,) * len(ent.shape)
        off += length


# ---- the streaming pickler -------------------------------------------------------------

_pack_B, _pack_H, _pack_i, _pack_I = (struct.Struct(f).pack for f in ("<B", "<H", "<i", "<I"))
MEMO = pickle.MEMOIZE


def _int(v: int) -> bytes:
    """pickle's save_long for protocol >= 2."""
    if 0 <= v <= 0xFF:
        return pickle.BININT1 + _pack_B(v)
    if 0 <= v <= 0xFFFF:
        return pickle.BININT2 + _pack_H(v)
    if -0x80000000 <= v <= 0x7FFFFFFF:
        return pickle.BININT + _pack_i(v)
    b = pickle.encode_long(v)
    if len(b) < 256:
        return pickle.LONG1 + _pack_B(len(b)) + b
    return pickle.LONG4 + _pack_i(len(b)) + b


def _get(i: int) -> bytes:
    return pickle.BINGET + _pack_B(i) if i < 256 else pickle.LONG_BINGET + _pack_I(i)


def _str(s: str) -> bytes:
    b = s.encode("utf-8")
    if len(b) <= 0xFF:
        return pickle.SHORT_BINUNICODE + _pack_B(len(b)) + b
    return pickle.BINUNICODE + _pack_I(len(b)) + b


_TUPLE = {1: pickle.TUPLE1, 2: pickle.TUPLE2, 3: pickle.TUPLE3}


def _size_ops(get_size: bytes, values: Sequence[int]) -> tuple[bytes, int]:
    """torch.Size(values) as pickle writes it (its __reduce__): (opcodes, memo entries)."""
    if not values:
        return get_size + pickle.EMPTY_TUPLE + pickle.TUPLE1 + MEMO + pickle.REDUCE + MEMO, 2
    ints = b"".join(_int(int(v)) for v in values)
    if len(values) <= 3:
        inner = ints + _TUPLE[len(values)] + MEMO
    else:
        inner = pickle.MARK + ints + pickle.TUPLE + MEMO
    return get_size + inner + pickle.TUPLE1 + MEMO + pickle.REDUCE + MEMO, 3


class _Memo(dict):
    """The pickler's memo where streamed entries count without being kept alive."""

    extra = 0

    def __len__(self) -> int:
        return dict.__len__(self) + self.extra


class _StreamPickler(pickle._Pickler):  # the stdlib's pure-Python pickler: same opcodes as C
    def __init__(self, file, skeleton_types) -> None:
        super().__init__(file, protocol=4)
        self.memo = _Memo()
        self._mi, self._si, self._csm = skeleton_types
        self._chunk_ix = None
        self._chunk_cache: dict = {}

    def _idx(self, obj) -> int | None:
        x = self.memo.get(id(obj))
        return None if x is None else x[0]

    def save(self, obj, save_persistent_id=True):
        t = type(obj)
        if t is _LazyChunks:
            self.framer.commit_frame()
            return self._save_chunks(obj)
        if t is _LazyStorage:
            self.framer.commit_frame()
            return self._save_storage(obj)
        return super().save(obj, save_persistent_id)

    def _ready(self, *objs) -> list[int] | None:
        out = []
        for o in objs:
            i = self._idx(o)
            if i is None:
                return None
            out.append(i)
        return out

    def _chunk_bytes(self, plan: _Plan, c: int, r: int) -> tuple[bytes, int]:
        """One chunk of class ``c`` at rank ``r`` (identical for every entry of the class)."""
        cache = self._chunk_cache.setdefault((id(plan), c), {})
        hit = cache.get(r)
        if hit is None:
            cls_i, k_off, k_siz, size_i = self._chunk_ix
            g = plan.classes[c]
            a, na = _size_ops(_get(size_i), [int(x) for x in g.offsets[r]])
            b, nb = _size_ops(_get(size_i), [int(x) for x in g.sizes[r]])
            hit = cache[r] = (b"".join((_get(cls_i), pickle.EMPTY_TUPLE, pickle.NEWOBJ, MEMO, pickle.EMPTY_DICT, MEMO,
                                        pickle.MARK, _get(k_off), a, _get(k_siz), b, pickle.SETITEMS, pickle.BUILD)),
                              2 + na + nb)
        return hit

    def _save_chunks(self, lazy: _LazyChunks) -> None:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        self.write(pickle.EMPTY_LIST)
        self.memoize(lazy)
        plan, e = lazy.plan, lazy.e
        c = int(plan.class_of[e])
        ranks = plan.chunk_ranks(e) if c >= 0 else np.zeros(1, dtype=np.int64)
        first = self._chunk_ix is None
        for start in range(0, len(ranks), _BATCH):
            batch = ranks[start:start + _BATCH]
            if len(batch) > 1:
                self.write(pickle.MARK)
            i0 = 0
            if self._chunk_ix is None or c < 0:  # the file's first chunk (pickle emits the globals) or a plain tensor
                offs, sizes = next(iter(_chunks(plan, e)))
                self.framer.commit_frame()
                super().save(ChunkStorageMetadata(offsets=torch.Size(offs), sizes=torch.Size(sizes)))
                self._chunk_ix = self._ready(self._csm, sys.intern("offsets"), sys.intern("sizes"), torch.Size)
                i0 = 1
            for r in batch[i0:].tolist():
                self.framer.commit_frame()
                b, k = self._chunk_bytes(plan, c, r)
                self.write(b)
                self.memo.extra += k
            self.write(pickle.APPENDS if len(batch) > 1 else pickle.APPEND)
        del first

    def _save_storage(self, lazy: _LazyStorage) -> None:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import MetadataIndex

        self.write(pickle.EMPTY_DICT)
        self.memoize(lazy)
        plan = lazy.plan
        names = [sys.intern(x) for x in ("fqn", "index", "offset", "relative_path", "length")]
        keys = [_str(ent.key) + MEMO for ent in plan.entries]
        head = pickle.EMPTY_TUPLE + pickle.NEWOBJ + MEMO + pickle.EMPTY_DICT + MEMO + pickle.MARK
        tail = pickle.SETITEMS + pickle.BUILD
        skey = [plan.shared_owners(e) if c >= 0 else None for e, c in enumerate(plan.class_of.tolist())]
        ix = None
        count = 0  # items emitted (for SETITEMS batches)
        total = plan.storage_entries()
        for r in range(plan.n_ranks):
            path_ref = None  # this rank's relative_path: memoised at its first use
            frag: dict = {}
            items = list(_rank_entries(plan, r))
            for e, off, length, hint, offs in items:
                if count % _BATCH == 0:
                    left = total - count
                    if left > 1:
                        self.write(pickle.MARK)
                self.framer.commit_frame()
                if ix is None:  # the first entry: pickle emits the globals and key names
                    rel = _fresh(lazy.names[r])
                    super().save(MetadataIndex(_fresh(plan.entries[e].key), offs, hint))
                    super().save(_StorageInfo(rel, off, length))
                    path_ref = _get(self._idx(rel))
                    ix = self._ready(self._mi, self._si, torch.Size, *names)
                    mi, si, size_i, k_fqn, k_index, k_offset, k_rel, k_len = ix
                    pre = _get(mi) + head + _get(k_fqn)
                    mid_si = tail + _get(si) + head + _get(k_rel)
                    g_off, g_len = _get(k_offset), _get(k_len)
                else:
                    c = int(plan.class_of[e])
                    fk = (c, skey[e]) if c >= 0 else (c, plan.entries[e].kind, len(plan.entries[e].shape))
                    f = frag.get(fk)
                    if f is None:
                        n_memo = 3 + 2  # MetadataIndex, its dict, fqn; _StorageInfo, its dict
                        if offs is None:
                            mid = _get(k_index) + pickle.NONE
                        else:
                            so, ns = _size_ops(_get(size_i), offs)
                            mid = _get(k_index) + _int(hint) + g_off + so
                            n_memo += ns
                        f = frag[fk] = (mid, n_memo)
                    mid, n_memo = f
                    if path_ref is None:
                        path_ref = _get(len(self.memo) + n_memo)  # the slot the string is about to take
                        pref = _str(lazy.names[r]) + MEMO
                        n_memo += 1
                    else:
                        pref = path_ref
                    self.write(b"".join((pre, keys[e], mid, mid_si, pref, g_off, _int(off), g_len, _int(length), tail)))
                    self.memo.extra += n_memo
                count += 1
                if count % _BATCH == 0 or count == total:
                    n_batch = count % _BATCH or _BATCH
                    self.write(pickle.SETITEMS if n_batch > 1 else pickle.SETITEM)


# --------------------------------------------------------------------------------------
# The checkpoint
# --------------------------------------------------------------------------------------


@dataclass
class BuildResult:
    """What was written: where, how many ranks and entries, and the plan's totals."""

    path: pathlib.Path
    ranks: int
    dp: int
    tp: int
    keys: int
    storage_entries: int
    metadata_bytes: int
    data_bytes: int
    files: int = 0
    extra: dict = field(default_factory=dict)


def build_metadata(entries: list[Entry], *, dp: int, tp: int = 1, checkpoint_id: Any = None,
                   save_id: str | None = None, materialize: bool = False):
    """The ``Metadata`` object torch's save would write for ``entries`` on ``dp * tp`` ranks.

    ``materialize=True`` builds every chunk and storage entry as torch's own objects (memory
    per chunk: small cases and tests); otherwise the bulk is lazy and only
    :func:`write_metadata` can serialise it. Returns ``(metadata, plan)``.
    """
    plan = _plan(entries, int(dp), int(tp))
    md = _skeleton(plan, checkpoint_id=checkpoint_id, save_id=save_id or str(uuid.uuid4()), materialize=materialize)
    return md, plan


def write_metadata(md, path: str | os.PathLike) -> int:
    """Pickle ``md`` (from :func:`build_metadata`) to ``path`` as protocol 4, streaming its bulk."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    tmp = pathlib.Path(str(path) + ".tmp")
    with open(tmp, "wb", buffering=1 << 20) as f:
        _StreamPickler(f, (MetadataIndex, _StorageInfo, ChunkStorageMetadata)).dump(md)
        n = f.tell()
    os.replace(tmp, path)
    return n


def make_checkpoint(out_dir: str | os.PathLike, entries: list[Entry], *, dp: int, tp: int = 1,
                    checkpoint_id: Any = None, save_id: str | None = None) -> BuildResult:
    """Write ``.metadata`` and the sparse ``__<rank>_0.distcp`` files for ``entries`` on dp x tp ranks.

    ``checkpoint_id`` is what ``StorageMeta`` records (torch: ``Path(checkpoint_id)`` as given
    to ``dcp.save``); default ``Path(out_dir)``. Data files are truncated to their length and
    hold no tensor chunk bytes (reads return zeros, so only metadata-level tools can use
    them); the small items, objects and plain tensors (``step``), are written for real (the
    ``torch.save`` bytes torch writes), so that the counters a tool reads are there.
    """
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md, plan = build_metadata(entries, dp=dp, tp=tp, checkpoint_id=pathlib.Path(checkpoint_id or out),
                              save_id=save_id)
    small: dict[int, bytes] = {}
    for e, ent in enumerate(entries):
        if ent.kind == "bytes" or (ent.kind == "tensor" and ent.value is not None):
            buf = io.BytesIO()
            torch.save(ent.value, buf)
            small[e] = buf.getvalue()
    for r in range(plan.n_ranks):
        p = out / f"__{r}_0.distcp"
        with open(p, "wb") as f:
            for e, off, length, _, _ in _rank_entries(plan, r) if plan.owned.get(r) else ():
                data = small.get(e)
                if data is not None:
                    if len(data) != length:
                        raise ValueError(f"{entries[e].key}: torch.save gave {len(data)} bytes, planned {length}")
                    f.seek(off)
                    f.write(data)
        os.truncate(p, int(plan.file_sizes[r]))
    n = write_metadata(md, out / METADATA_NAME)
    storage_entries = plan.storage_entries()
    return BuildResult(out, plan.n_ranks, int(dp), int(tp), len(entries), storage_entries, n,
                       int(plan.file_sizes.sum()), plan.n_ranks)


def make_llama_metadata_checkpoint(out_dir: str | os.PathLike, model: str | LlamaConfig = "8B", *, ranks: int,
                                   tp: int = 1, optimizer: bool = True, checkpoint_id: Any = None,
                                   save_id: str | None = None) -> BuildResult:
    """A metadata-only checkpoint of a Llama-3 flavour (``"8B"``, ``"70B"``, ``"405B"``) saved
    from ``ranks`` ranks with FSDP2 (``tp=1``) or FSDP2 x TP (``ranks = dp * tp``)."""
    cfg = LLAMA3[model] if isinstance(model, str) else model
    if ranks % tp:
        raise ValueError(f"ranks ({ranks}) must be a multiple of tp ({tp})")
    res = make_checkpoint(out_dir, llama_entries(cfg, optimizer=optimizer), dp=ranks // tp, tp=tp,
                          checkpoint_id=checkpoint_id, save_id=save_id)
    res.extra["model"] = cfg.name
    res.extra["model_config"] = cfg.model_config()
    return res
