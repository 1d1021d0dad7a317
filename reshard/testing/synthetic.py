"""Makers of real Distributed Checkpoints (DCP) for tests and benchmarks.

Every checkpoint made here is written by ``torch.distributed.checkpoint.save`` itself
(never a hand-written ``.metadata``), so what reshard reads in tests is what a training
job writes in the wild:

* :func:`make_plain_fsdp2` - "a plain FSDP2 script": ``world_size`` gloo ranks train a
  tiny model under ``fully_shard`` for a few AdamW steps and save
  ``{"model": ..., "optim": ...}`` from ``get_state_dict``. No manifest.
* :func:`make_sharded` - ``n_tensors`` DTensors ``Shard(shard_dim)`` over a CPU mesh named
  ``model.layers.{i}.weight`` whose values are :func:`synthetic_value` ``(i, shape, dtype,
  seed)``, so a test can recompute every global tensor. Each rank generates only its own
  shard, so it scales to benchmark sizes.
* :func:`make_many_entries` - a single-process save with many tiny tensors (the
  "inspect of 10,000 entries" benchmark).

and corruption helpers for fault tests: :func:`truncate_file`, :func:`remove_metadata`,
:func:`write_malicious_metadata`, :func:`list_rank_files`.

The multi-rank makers start one fresh process per rank (``torch.multiprocessing``,
forkserver by default with torch preloaded, or ``start_method="spawn"``; a free
127.0.0.1 port, gloo, one thread each), return only after every process has exited, and
raise :class:`SyntheticCheckpointError` carrying the worker's traceback when a rank fails
or the job does not finish within ``timeout`` seconds. Callers need no
``if __name__ == "__main__":`` guard (the caller's main module is not re-imported).
Typical cost on 2 CPUs: 1-3 s per job, plus ~2 s once per process to start the server.
"""
from __future__ import annotations

import os
import pathlib
import pickle
import re
import socket
import time
import warnings
from datetime import timedelta
from math import prod
from typing import Any, Callable, Sequence

import torch

from reshard.train.launch import PRELOAD, start_ranks

__all__ = [
    "SyntheticCheckpointError",
    "make_plain_fsdp2",
    "make_sharded",
    "make_many_entries",
    "synthetic_value",
    "synthetic_block",
    "shard_box",
    "truncate_file",
    "remove_metadata",
    "write_malicious_metadata",
    "list_rank_files",
    "TinyModel",
]

METADATA_NAME = ".metadata"
_RANK_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


class SyntheticCheckpointError(RuntimeError):
    """A spawned rank failed (its traceback is in the message) or the job timed out."""


# --------------------------------------------------------------------------------------
# Deterministic values
# --------------------------------------------------------------------------------------

_MASK31 = (1 << 31) - 1
_BLOCK_ELEMS = 1 << 22  # generate at most ~4M elements at a time (bounded int64 temporaries)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A cheap integer hash on int64 tensors holding values in [0, 2**31)."""
    x = (x * 1103515245 + 12345) & _MASK31
    x = x ^ (x >> 13)
    x = (x * 1664525 + 1013904223) & _MASK31
    x = x ^ (x >> 16)
    return x


def _key(i: int, seed: int) -> int:
    return ((int(seed) * 1_000_003 + int(i) * 7_919 + 0x5BD1E995) * 2_654_435_761) & _MASK31


def _values_from_hash(h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return (h & 1).bool()
    if dtype.is_floating_point or dtype.is_complex:
        # uniform-ish in [-1, 1), float64 first so float32/bf16/fp16 round from one value
        return (h.to(torch.float64) * (2.0 / (1 << 31)) - 1.0).to(dtype)
    # integers: keep within int8/uint8 range so every integer dtype is exact
    return (h % 127).to(dtype)


def synthetic_block(
    i: int,
    shape: Sequence[int],
    dtype: torch.dtype,
    seed: int,
    offsets: Sequence[int],
    sizes: Sequence[int],
) -> torch.Tensor:
    """The box ``[offsets, offsets + sizes)`` of ``synthetic_value(i, shape, dtype, seed)``.

    Computed from global coordinates only, so any shard can be generated without the
    rest of the tensor; ``synthetic_block(..., zeros, shape)`` equals the whole tensor.
    """
    shape = tuple(int(s) for s in shape)
    offsets = tuple(int(o) for o in offsets)
    sizes = tuple(int(s) for s in sizes)
    if not (len(shape) == len(offsets) == len(sizes)):
        raise ValueError(f"rank mismatch: shape {shape}, offsets {offsets}, sizes {sizes}")
    for o, s, d in zip(offsets, sizes, shape):
        if o < 0 or s < 0 or o + s > d:
            raise ValueError(f"box {list(offsets)}+{list(sizes)} lies outside {list(shape)}")
    key = _key(i, seed)
    out = torch.empty(sizes, dtype=dtype)
    if out.numel() == 0:
        return out
    if not shape:  # scalar
        return _values_from_hash(_mix(torch.tensor(key, dtype=torch.int64)), dtype).reshape(())
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    # flat global index of the box's trailing dims (all but dim 0), broadcast
    tail = torch.zeros((1,) * (len(shape) - 1), dtype=torch.int64)
    for d in range(1, len(shape)):
        view = [1] * (len(shape) - 1)
        view[d - 1] = sizes[d]
        tail = tail + (torch.arange(offsets[d], offsets[d] + sizes[d], dtype=torch.int64) * strides[d]).view(view)
    row_elems = max(1, prod(sizes[1:]))
    rows_per_block = max(1, _BLOCK_ELEMS // row_elems)
    for r0 in range(0, sizes[0], rows_per_block):
        r1 = min(sizes[0], r0 + rows_per_block)
        rows = torch.arange(offsets[0] + r0, offsets[0] + r1, dtype=torch.int64) * strides[0]
        flat = rows.view((-1,) + (1,) * (len(shape) - 1)) + tail
        h = _mix((flat + key) & _MASK31)
        out[r0:r1] = _values_from_hash(h, dtype)
    return out


def synthetic_value(i: int, shape: Sequence[int], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """The global value of tensor ``model.layers.{i}.weight`` written by :func:`make_sharded`."""
    shape = tuple(int(s) for s in shape)
    return synthetic_block(i, shape, dtype, seed, (0,) * len(shape), shape)


def shard_box(shape: Sequence[int], shard_dim: int, rank: int, world_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, sizes)`` of rank ``rank``'s piece under ``Shard(shard_dim)``.

    DTensor's rule (that of ``torch.chunk``): pieces of ``ceil(n / world_size)`` rows, so
    the last ranks may get a shorter or an empty piece (FSDP2's uneven sharding).
    """
    shape = tuple(int(s) for s in shape)
    n = shape[shard_dim]
    step = -(-n // world_size) if n else 0
    start = min(rank * step, n)
    stop = min(start + step, n)
    offsets = tuple(start if d == shard_dim else 0 for d in range(len(shape)))
    sizes = tuple(stop - start if d == shard_dim else s for d, s in enumerate(shape))
    return offsets, sizes


# --------------------------------------------------------------------------------------
# Spawning
# --------------------------------------------------------------------------------------


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        stride[d] = stride[d + 1] * max(1, int(shape[d + 1]))
    return tuple(stride)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_worker(rank: int, world_size: int, port: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))


def finish_worker() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


_PRELOAD = (*PRELOAD, "reshard.testing.synthetic")


def spawn_ranks(fn: Callable[..., None], world_size: int, args: tuple, timeout: float, start_method: str | None = None) -> None:
    """Run ``fn(rank, world_size, port, *args)`` on ``world_size`` fresh processes.

    The default start method is ``forkserver`` with torch and this module preloaded in the
    server: every rank is a fresh process (forked from a server that imported torch but
    never ran it, so fork-safe), and only the first job of a process pays for importing
    torch. ``"spawn"`` works too but costs a full torch import per rank per job (about
    7 s for 4 ranks on 2 cores). The caller's main module is not re-imported in the
    children (see :func:`reshard.train.launch.main_not_reimported`), so callers need no main guard.
    """
    import torch.multiprocessing as mp

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    port = _free_port()
    ctx = start_ranks(fn, (world_size, port) + tuple(args), world_size, join=False, start_method=start_method,
                      preload=_PRELOAD)
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=0.1):
            if time.monotonic() > deadline:
                raise SyntheticCheckpointError(f"{fn.__name__}: {world_size} ranks did not finish within {timeout:.0f} s")
    except mp.ProcessRaisedException as e:
        raise SyntheticCheckpointError(f"{fn.__name__} failed on a rank:\n{e}") from e
    except mp.ProcessExitedException as e:
        raise SyntheticCheckpointError(f"{fn.__name__}: a rank exited abnormally: {e}") from e
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
        for p in ctx.processes:
            p.join(5)


def prepare_out_dir(out_dir: str | os.PathLike) -> pathlib.Path:
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out


# --------------------------------------------------------------------------------------
# A plain FSDP2 script
# --------------------------------------------------------------------------------------

VOCAB = 50  # 50 rows over 4 ranks -> 13, 13, 13, 11: FSDP2's uneven sharding
DIM = 16
HIDDEN = 40


class TinyModel(torch.nn.Module):
    """Embedding + 2 Linear + LayerNorm (2,168 parameters)."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, hidden: int = HIDDEN):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.up = torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim)
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))
        return self.norm(h)


def _fsdp2_worker(rank: int, world_size: int, port: int, out_dir: str, steps: int, seed: int) -> None:
    init_worker(rank, world_size, port)
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(seed)  # same initial weights on every rank
        mesh = init_device_mesh("cpu", (world_size,))
        model = TinyModel()
        for sub in (model.up, model.down):
            fully_shard(sub, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(seed * 1009 + rank)  # each rank its own data
        for _ in range(steps):
            tokens = torch.randint(0, VOCAB, (32,), generator=gen)
            target = torch.randn(32, DIM, generator=gen)
            loss = torch.nn.functional.mse_loss(model(tokens), target)
            loss.backward()
            optim.step()
            optim.zero_grad()
        model_sd, optim_sd = get_state_dict(model, optim)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=out_dir)
    finally:
        finish_worker()


def make_plain_fsdp2(
    out_dir: str | os.PathLike,
    world_size: int = 4,
    *,
    steps: int = 2,
    seed: int = 0,
    timeout: float = 120.0,
    start_method: str | None = None,
) -> pathlib.Path:
    """Train :class:`TinyModel` under FSDP2 on ``world_size`` gloo ranks; save with DCP.

    Keys follow ``get_state_dict`` nesting: ``model.<fqn>``,
    ``optim.state.<fqn>.{exp_avg,exp_avg_sq,step}`` (``step`` a 0-d tensor saved once),
    ``optim.param_groups.0.<hyper>`` (objects, incl. ``params``: the list of fqns). The
    embedding has 50 rows, so on 4 ranks it is sharded unevenly (13, 13, 13, 11).
    ``start_method``: ``None`` (forkserver where available) or ``"spawn"``.
    """
    out = prepare_out_dir(out_dir)
    spawn_ranks(_fsdp2_worker, world_size, (str(out), int(steps), int(seed)), timeout, start_method)
    return out


# --------------------------------------------------------------------------------------
# Sharded DTensors with known values
# --------------------------------------------------------------------------------------


def _sharded_worker(rank: int, world_size: int, port: int, out_dir: str, n_tensors: int,
                    shape: tuple[int, ...], dtype: torch.dtype, shard_dim: int, seed: int) -> None:
    init_worker(rank, world_size, port)
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh("cpu", (world_size,))
        stride = contiguous_stride(shape)
        offsets, sizes = shard_box(shape, shard_dim, rank, world_size)
        sd: dict[str, Any] = {}
        for i in range(n_tensors):
            local = synthetic_block(i, shape, dtype, seed, offsets, sizes)
            sd[f"model.layers.{i}.weight"] = DTensor.from_local(
                local, mesh, [Shard(shard_dim)], run_check=False, shape=torch.Size(shape), stride=stride
            )
        dcp.save(sd, checkpoint_id=out_dir)
    finally:
        finish_worker()


def make_sharded(
    out_dir: str | os.PathLike,
    *,
    world_size: int,
    n_tensors: int,
    shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    shard_dim: int = 0,
    seed: int = 0,
    timeout: float = 300.0,
    start_method: str | None = None,
) -> pathlib.Path:
    """Save ``n_tensors`` DTensors ``Shard(shard_dim)`` over ``world_size`` gloo ranks.

    Tensor ``model.layers.{i}.weight`` has global shape ``shape`` and the value
    ``synthetic_value(i, shape, dtype, seed)``. The layout is exactly what
    ``distribute_tensor(value, mesh, [Shard(shard_dim)])`` gives (see :func:`shard_box`),
    but each rank only ever materialises its own piece.
    """
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise ValueError("make_sharded needs a tensor of rank >= 1")
    if not -len(shape) <= shard_dim < len(shape):
        raise ValueError(f"shard_dim {shard_dim} out of range for shape {list(shape)}")
    shard_dim %= len(shape)
    out = prepare_out_dir(out_dir)
    spawn_ranks(_sharded_worker, world_size, (str(out), int(n_tensors), shape, dtype, shard_dim, int(seed)), timeout, start_method)
    return out


# --------------------------------------------------------------------------------------
# Many tiny entries, one process
# --------------------------------------------------------------------------------------


def many_entries_key(i: int) -> str:
    return f"model.blocks.{i}.weight"


def make_many_entries(out_dir: str | os.PathLike, n_entries: int, *, numel: int = 4) -> pathlib.Path:
    """Single-process ``dcp.save(no_dist=True)`` of ``n_entries`` float32 tensors of ``numel``.

    Entry ``model.blocks.{i}.weight`` holds ``arange(numel) + i * numel``.
    """
    import torch.distributed.checkpoint as dcp

    out = prepare_out_dir(out_dir)
    base = torch.arange(n_entries * numel, dtype=torch.float32).view(n_entries, numel)
    sd = {many_entries_key(i): base[i].clone() for i in range(n_entries)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.save(sd, checkpoint_id=str(out), no_dist=True)
    return out


# --------------------------------------------------------------------------------------
# Corruption helpers
# --------------------------------------------------------------------------------------


def list_rank_files(ckpt: str | os.PathLike) -> list[pathlib.Path]:
    """The ``__{rank}_{n}.distcp`` data files of ``ckpt``, ordered by (rank, n)."""
    found = []
    for p in pathlib.Path(ckpt).iterdir():
        m = _RANK_FILE.match(p.name)
        if m and p.is_file():
            found.append(((int(m.group(1)), int(m.group(2))), p))
    return [p for _, p in sorted(found)]


def truncate_file(path: str | os.PathLike, keep_bytes: int) -> pathlib.Path:
    """Cut ``path`` down to its first ``keep_bytes`` bytes (a torn write)."""
    p = pathlib.Path(path)
    size = p.stat().st_size
    if not 0 <= keep_bytes <= size:
        raise ValueError(f"keep_bytes={keep_bytes} not in [0, {size}] for {p}")
    with open(p, "r+b") as f:
        f.truncate(keep_bytes)
    return p


def remove_metadata(ckpt: str | os.PathLike) -> pathlib.Path:
    """Delete ``.metadata`` (a checkpoint whose save never committed)."""
    p = pathlib.Path(ckpt) / METADATA_NAME
    p.unlink()
    return p


class _TouchOnUnpickle:
    """Pickles to a call of ``pathlib.Path.touch(marker)``: stock ``pickle.load`` runs it."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def write_malicious_metadata(ckpt: str | os.PathLike, marker_path: str | os.PathLike, *, embed: bool = True) -> pathlib.Path:
    """Overwrite ``ckpt/.metadata`` with a pickle that creates ``marker_path`` when loaded.

    With ``embed=True`` (default) the payload hides inside an otherwise well-formed,
    empty DCP ``Metadata`` (in ``planner_data``), so a loader that only checks the
    top-level type is fooled; with ``embed=False`` the payload is the whole pickle.
    Nothing here loads the old ``.metadata``. Tests assert ``marker_path`` never appears.
    """
    marker = pathlib.Path(marker_path).absolute()
    payload: Any = _TouchOnUnpickle(marker)
    if embed:
        from torch.distributed.checkpoint.metadata import Metadata

        payload = Metadata(state_dict_metadata={}, planner_data={"payload": payload}, storage_data={})
    p = pathlib.Path(ckpt) / METADATA_NAME
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "wb") as f:
        pickle.dump(payload, f)
    return p


def minimal_manifest(ckpt: pathlib.Path, *, world_size: int, tool: str, experiment_id: str = "synthetic",
                     integrity: dict | None = None) -> None:
    """Write a minimal valid ``manifest.json`` beside a synthetic checkpoint: a plain
    ``dp_shard=world_size`` run at step 0 with no optimizer, scheduler, data or RNG state,
    and optionally an ``integrity`` record. Benchmarks and tests use it so the checkpoint
    reads as one with a declared topology (what `reshard convert` records lineage against)."""
    from reshard.semantics import manifest as mf

    topo = mf.Topology.make(dp_shard=world_size)
    m = mf.Manifest(
        experiment_id=experiment_id, step=0, tokens_seen=0, samples_seen=0,
        key_convention="torch-get-state-dict", topology=topo,
        batch=mf.Batch(micro_batch=1, grad_accum=1, seq_len=1, global_batch=world_size),
        accumulation=mf.Accumulation(micro_step=0, in_flight_grads=False),
        precision=mf.Precision(param_dtype="float32", reduce_dtype="float32", loss_scaler=None),
        model=mf.ModelInfo(family="synthetic", config={}, tied=[]),
        optimizer=mf.OptimizerInfo(name="none", config={}),
        scheduler=mf.SchedulerInfo(name="none", config={}, unit="steps"),
        data=mf.DataPosition(sampler="none", seed=0, epoch=0, cursor=0, dataset_len=1, order="none"),
        rng=mf.RngInfo(policy="none", keyed_by_rank=False, seed=0),
        continuity="continuation",
        lineage=[mf.LineageEvent(event="created", from_=None, to=topo, at_step=0, tool=tool, time=mf.now_iso())],
        writer=mf.Writer.current(tool),
    )
    m.integrity = integrity
    mf.write_manifest(ckpt, m)
