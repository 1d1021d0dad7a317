"""Real DCP checkpoints of Llama-style models laid out as a TP x FSDP2 job saves them.

No model forward is run: every weight is a deterministic function of ``(seed, name)``
(see :func:`canonical_weights`); the point is the on-disk layout, which is what a
torchtitan- or Megatron-style job on a ``("dp_shard", "tp")`` CPU mesh writes with
``dcp.save``:

* the per-parameter tensor-parallel layout comes from the model's partition rules
  (``formats/models/llama-torchtitan.toml`` / ``llama-fused.toml``): column-parallel
  weights are cut on dim 0, row-parallel ones on dim 1, norms are replicated; fused
  tensors (``linear_qkv``, ``linear_fc1``) hold ``[part0_t; part1_t; ...]`` on TP rank
  ``t`` (so their global DCP view depends on the TP degree); vocab tensors are padded to
  a multiple of ``vocab_multiple * tp`` (padding rows 0.0) and then cut on dim 0;
* FSDP2 then cuts each TP-local tensor on dim 0 over ``dp`` (``torch.chunk`` rule:
  pieces of ``ceil(n / dp)`` rows), as ``fully_shard`` does;
* the tensors are saved as DTensors on the 2-D mesh with the placements FSDP2 + TP give
  them: ``[_StridedShard(0, split_factor=tp), Shard(0)]`` for dim-0 TP shards (FSDP's cut
  lies *inside* each TP block), ``[Shard(0), Shard(1)]`` for dim-1 TP shards and
  ``[Shard(0), Replicate()]`` for replicated tensors. Each rank checks that the box DCP
  will record for it (``compute_local_shape_and_global_offset``) is the box it computed
  itself, and fails loudly otherwise.

Keys follow the ``reshard`` convention: ``model.<name>``, ``optim.state.<name>.{exp_avg,
exp_avg_sq,step}``, ``optim.param_groups.0.lr``, ``trainer.step``; a ``manifest.json``
describes the run.
"""
from __future__ import annotations

import os
import pathlib
import uuid
import zlib
from dataclasses import asdict, dataclass
from math import ceil
from typing import Any

import torch

from reshard.semantics import transforms
from reshard.testing.synthetic import (
    SyntheticCheckpointError,
    contiguous_stride,
    finish_worker,
    init_worker,
    prepare_out_dir,
    spawn_ranks,
    synthetic_block,
)

__all__ = [
    "LlamaShape",
    "canonical_weights",
    "canonical_tensor",
    "param_names",
    "tp_layout",
    "rank_box",
    "make_llama_checkpoint",
    "load_global",
    "family_for",
    "SyntheticCheckpointError",
]

FUSED_FAMILY = "llama-fused"
TITAN_FAMILY = "llama-torchtitan"
STEP = 10
LR = 1e-3
SEQ_LEN = 16


@dataclass(frozen=True)
class LlamaShape:
    n_layers: int = 2
    dim: int = 64
    n_heads: int = 8
    n_kv_heads: int = 2
    ffn_hidden: int = 96
    vocab_size: int = 100
    vocab_multiple: int = 8

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def padded_vocab(self, tp: int) -> int:
        unit = self.vocab_multiple * tp
        return int(ceil(self.vocab_size / unit) * unit)

    def config(self) -> dict[str, int]:
        """The manifest's ``model.config`` (every name the partition rules refer to)."""
        d = asdict(self)
        d["head_dim"] = self.head_dim
        return d


def family_for(fused: bool) -> str:
    return FUSED_FAMILY if fused else TITAN_FAMILY


# --------------------------------------------------------------------------------------
# Canonical (TP = 1) values
# --------------------------------------------------------------------------------------


def _value(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Deterministic float32 values of tensor ``name`` (a torchtitan-style logical name)."""
    i = zlib.crc32(name.encode()) & 0x7FFFFFFF
    return synthetic_block(i, shape, torch.float32, seed, (0,) * len(shape), shape)


_VOCAB_NAMES = ("tok_embeddings.weight", "output.weight")


def _titan_shapes(shape: LlamaShape) -> dict[str, tuple[int, ...]]:
    """torchtitan name -> canonical shape (vocab tensors: unpadded rows)."""
    hd, D, F = shape.head_dim, shape.dim, shape.ffn_hidden
    out: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (shape.vocab_size, D)}
    for n in range(shape.n_layers):
        p = f"layers.{n}."
        out[p + "attention.wq.weight"] = (shape.n_heads * hd, D)
        out[p + "attention.wk.weight"] = (shape.n_kv_heads * hd, D)
        out[p + "attention.wv.weight"] = (shape.n_kv_heads * hd, D)
        out[p + "attention.wo.weight"] = (D, shape.n_heads * hd)
        out[p + "feed_forward.w1.weight"] = (F, D)
        out[p + "feed_forward.w2.weight"] = (D, F)
        out[p + "feed_forward.w3.weight"] = (F, D)
        out[p + "attention_norm.weight"] = (D,)
        out[p + "ffn_norm.weight"] = (D,)
    out["norm.weight"] = (D,)
    out["output.weight"] = (shape.vocab_size, D)
    return out


def _sources(shape: LlamaShape, fused: bool) -> dict[str, tuple[str, ...]]:
    """Checkpoint parameter name -> the torchtitan tensors it holds (concatenated on dim 0)."""
    if not fused:
        return {k: (k,) for k in _titan_shapes(shape)}
    out: dict[str, tuple[str, ...]] = {"embedding.word_embeddings.weight": ("tok_embeddings.weight",)}
    for n in range(shape.n_layers):
        s, d = f"layers.{n}.", f"decoder.layers.{n}."
        out[d + "self_attention.linear_qkv.weight"] = tuple(s + f"attention.{w}.weight" for w in ("wq", "wk", "wv"))
        out[d + "self_attention.linear_proj.weight"] = (s + "attention.wo.weight",)
        out[d + "mlp.linear_fc1.weight"] = (s + "feed_forward.w1.weight", s + "feed_forward.w3.weight")
        out[d + "mlp.linear_fc2.weight"] = (s + "feed_forward.w2.weight",)
        out[d + "input_layernorm.weight"] = (s + "attention_norm.weight",)
        out[d + "pre_mlp_layernorm.weight"] = (s + "ffn_norm.weight",)
    out["decoder.final_layernorm.weight"] = ("norm.weight",)
    out["output_layer.weight"] = ("output.weight",)
    return out


def param_names(shape: LlamaShape = LlamaShape(), *, fused: bool) -> list[str]:
    """The parameter names of the model (without the ``model.`` prefix), in save order."""
    return list(_sources(shape, fused))


def canonical_tensor(name: str, shape: LlamaShape = LlamaShape(), *, fused: bool, seed: int = 0,
                     role: str = "param") -> torch.Tensor:
    """One canonical (TP = 1) tensor: ``role`` "param", "exp_avg" or "exp_avg_sq" (>= 0).

    Vocab tensors are padded for tp = 1 with 0.0 rows; fused tensors are the dim-0
    concatenation of their torchtitan parts (identical values for the same seed).
    """
    if role not in ("param", "exp_avg", "exp_avg_sq"):
        raise ValueError(f"role must be param, exp_avg or exp_avg_sq, got {role!r}")
    tag = "" if role == "param" else "." + role
    shapes = _titan_shapes(shape)
    pieces = []
    for src in _sources(shape, fused)[name]:
        v = _value(src + tag, shapes[src], seed)
        if role == "exp_avg_sq":
            v = v.abs()
        if src in _VOCAB_NAMES:
            padded = torch.zeros((shape.padded_vocab(1),) + shapes[src][1:])
            padded[: shape.vocab_size] = v
            v = padded
        pieces.append(v)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)


def canonical_weights(shape: LlamaShape = LlamaShape(), *, fused: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """The TP = 1 global parameters (vocab padded for tp = 1, padding rows 0.0).

    ``fused=True`` uses Megatron names; its Q/K/V (gate/up) blocks hold exactly the values
    of ``wq``/``wk``/``wv`` (``w1``/``w3``) of the unfused model with the same seed.
    """
    return {n: canonical_tensor(n, shape, fused=fused, seed=seed) for n in param_names(shape, fused=fused)}


# --------------------------------------------------------------------------------------
# TP layout and chunk boxes
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TPLayout:
    """How one parameter is laid out at a TP degree."""

    kind: str  # "replicate" | "shard" | "fused"
    dim: int = 0
    parts: tuple[int, ...] = ()
    padded_rows: int | None = None  # vocab tensors: rows after padding for this tp


def tp_layout(name: str, shape: LlamaShape, *, fused: bool, tp: int) -> TPLayout:
    """The partition rule for ``name`` from the family's TOML, evaluated for ``shape`` and ``tp``."""
    from reshard.semantics import rules as R

    mr = R.select([name], family=family_for(fused))
    rule = mr.rule_for(name)
    if rule is None:
        raise ValueError(f"no partition rule in {family_for(fused)} covers '{name}'")
    cfg = shape.config()
    for d in rule.divisible:
        if R.evaluate(d, cfg) % tp:
            raise ValueError(f"tp={tp} does not divide {d}={R.evaluate(d, cfg)} (needed by '{name}')")
    if rule.tp == "fused":
        return TPLayout("fused", rule.dim, tuple(R.evaluate(p.size, cfg) for p in rule.parts))
    padded = R.padded_vocab(rule.vocab, cfg, tp)[1] if rule.vocab is not None else None
    return TPLayout(rule.tp, rule.dim, (), padded)


def tp_global(t: torch.Tensor, lay: TPLayout, tp: int) -> torch.Tensor:
    """The canonical tensor as the global DCP view of a job at degree ``tp``."""
    if lay.kind == "fused":
        return transforms.from_canonical(t, lay.dim, list(lay.parts), tp)
    if lay.padded_rows is not None:
        have = t.shape[lay.dim]
        if lay.padded_rows < have:  # canonical is padded for tp=1: the tp padding is never smaller
            raise ValueError(f"padded rows {lay.padded_rows} < {have}")
        t, _ = transforms.repad_rows(t, lay.dim, lay.padded_rows, 0.0)  # padding rows are created as 0.0
    return t


def _cut(n: int, parts: int, i: int) -> tuple[int, int]:
    """(start, size) of piece ``i`` of ``n`` under the torch.chunk / DTensor Shard rule."""
    step = -(-n // parts) if n else 0
    start = min(i * step, n)
    return start, min(start + step, n) - start


def rank_box(global_shape: tuple[int, ...], lay: TPLayout, *, tp: int, dp: int, t: int, d: int
             ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) in the TP-layout global tensor held by the rank at mesh coordinate (d, t).

    TP cuts ``lay.dim`` (unless replicated) into ``tp`` blocks; FSDP2 then cuts dim 0 of
    the TP-local block into ``dp`` pieces.
    """
    offs, sizes = [0] * len(global_shape), list(global_shape)
    if lay.kind != "replicate" and tp > 1:
        s, n = _cut(global_shape[lay.dim], tp, t)
        offs[lay.dim], sizes[lay.dim] = s, n
    if global_shape:
        s, n = _cut(sizes[0], dp, d)
        offs[0], sizes[0] = offs[0] + s, n
    return tuple(offs), tuple(sizes)


# --------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------


def _placements(lay: TPLayout, tp: int):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if lay.kind == "replicate" or tp == 1:
        return [Shard(0), Replicate()]
    if lay.dim == 0:
        # FSDP2 on a dim-0 TP shard: its dim-0 cut is inside each TP block
        return [_StridedShard(0, split_factor=tp), Shard(0)]
    return [Shard(0), Shard(lay.dim)]


def _llama_worker(rank: int, world_size: int, port: int, out_dir: str, shape: LlamaShape, tp: int, dp: int,
                  fused: bool, seed: int, with_optimizer: bool) -> None:
    init_worker(rank, world_size, port)
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp_shard", "tp"))
        d, t = divmod(rank, tp)
        if list(mesh.get_coordinate() or ()) != [d, t]:
            raise SyntheticCheckpointError(f"rank {rank}: mesh coordinate {mesh.get_coordinate()} != {[d, t]}")
        roles = ("param", "exp_avg", "exp_avg_sq") if with_optimizer else ("param",)
        sd: dict[str, Any] = {}
        for name in param_names(shape, fused=fused):
            lay = tp_layout(name, shape, fused=fused, tp=tp)
            placements = _placements(lay, tp)
            for role in roles:
                g = tp_global(canonical_tensor(name, shape, fused=fused, seed=seed, role=role), lay, tp)
                gshape = tuple(g.shape)
                offs, sizes = rank_box(gshape, lay, tp=tp, dp=dp, t=t, d=d)
                local = g[tuple(slice(o, o + s) for o, s in zip(offs, sizes))].contiguous()
                dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(gshape),
                                        stride=contiguous_stride(gshape))
                got_sizes, got_offs = compute_local_shape_and_global_offset(dt.shape, mesh, placements)
                if (tuple(got_offs), tuple(got_sizes)) != (offs, sizes):
                    raise SyntheticCheckpointError(
                        f"{name} ({role}) on rank {rank}: DTensor box {list(got_offs)}+{list(got_sizes)} "
                        f"!= TP x FSDP2 box {list(offs)}+{list(sizes)} for placements {placements}")
                key = f"model.{name}" if role == "param" else f"optim.state.{name}.{role}"
                sd[key] = dt
            if with_optimizer:
                sd[f"optim.state.{name}.step"] = torch.tensor(float(STEP))
        if with_optimizer:
            sd["optim.param_groups.0.lr"] = LR
        sd["trainer.step"] = STEP
        dcp.save(sd, checkpoint_id=out_dir)
    finally:
        finish_worker()


def _manifest(shape: LlamaShape, *, tp: int, dp: int, fused: bool, seed: int, experiment_id: str | None):
    from reshard.semantics import manifest as mf

    order = ["dp_shard"] + (["tp"] if tp > 1 else [])
    topo = mf.Topology.make(dp_shard=dp, tp=tp, mesh_order=order)
    global_batch = dp  # micro 1 x accum 1 x dp
    samples = STEP * global_batch
    writer = mf.Writer.current("reshard.testing.synthetic_llama")
    return mf.Manifest(
        experiment_id=experiment_id or f"synthetic-llama-{uuid.uuid4()}", step=STEP,
        tokens_seen=samples * SEQ_LEN, samples_seen=samples, key_convention="reshard", topology=topo,
        batch=mf.Batch(micro_batch=1, grad_accum=1, seq_len=SEQ_LEN, global_batch=global_batch),
        accumulation=mf.Accumulation(micro_step=0, in_flight_grads=False),
        precision=mf.Precision(param_dtype="float32", reduce_dtype="float32", loss_scaler=None),
        model=mf.ModelInfo(family=family_for(fused), config=shape.config(), tied=[]),
        optimizer=mf.OptimizerInfo(name="AdamW", config={"lr": LR, "betas": [0.9, 0.95], "eps": 1e-8,
                                                         "weight_decay": 0.0}),
        scheduler=mf.SchedulerInfo(name="constant", unit="steps", config={"base_lr": LR}),
        # one epoch of exactly `samples` sequences consumed: cursor back at 0
        data=mf.DataPosition(sampler="synthetic", seed=seed, epoch=1, cursor=0, dataset_len=samples,
                             order=f"synthetic: arange(dataset_len), seed={seed}"),
        rng=mf.RngInfo(policy="none", keyed_by_rank=False, seed=seed),
        continuity="continuation",
        lineage=[mf.LineageEvent(event="created", from_=None, to=topo, at_step=STEP, policies={},
                                 tool=writer.tool, kind="continuation", reason="synthetic Llama checkpoint")],
        writer=writer,
    )


def make_llama_checkpoint(
    out_dir: str | os.PathLike,
    *,
    shape: LlamaShape = LlamaShape(),
    tp: int,
    dp: int,
    fused: bool,
    seed: int = 0,
    with_optimizer: bool = True,
    manifest: bool = True,
    experiment_id: str | None = None,
    timeout: float = 180.0,
    start_method: str | None = None,
) -> pathlib.Path:
    """Save a Llama checkpoint from ``tp * dp`` gloo ranks (rank = d * tp + t) with ``dcp.save``.

    Global DCP shapes are those of the TP-``tp`` job: fused tensors have their canonical
    shape but TP-interleaved contents (``from_canonical(canonical, tp)``), vocab tensors
    ``shape.padded_vocab(tp)`` rows. Returns ``out_dir``.
    """
    tp, dp = int(tp), int(dp)
    if tp < 1 or dp < 1:
        raise ValueError(f"tp and dp must be >= 1, got tp={tp}, dp={dp}")
    # fail in the parent (with a clear message) on a tp the rules do not allow
    for name in param_names(shape, fused=fused):
        tp_layout(name, shape, fused=fused, tp=tp)
    out = prepare_out_dir(out_dir)
    spawn_ranks(_llama_worker, tp * dp, (str(out), shape, tp, dp, bool(fused), int(seed), bool(with_optimizer)),
           timeout, start_method)
    if manifest:
        from reshard.semantics import manifest as mf

        mf.write_manifest(out, _manifest(shape, tp=tp, dp=dp, fused=fused, seed=seed, experiment_id=experiment_id))
    return out


def load_global(ckpt: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor key of ``ckpt`` as its global tensor (the TP layout it was saved in)."""
    from reshard.storage.checkpoints.index import CheckpointIndex

    idx = CheckpointIndex.open(ckpt)
    return {e.key: idx.read_tensor(e.key) for e in idx.tensors()}
