"""Real torch writer (and loader) of an FSDP2 checkpoint holding every dtype DCP can save (issue 31).

Run as a plain script: ``python tests/writers/dtypes_run.py write|load JOBS.json``. ``JOBS.json``
is a list of jobs ``{"dir", "world", "port", "result", "dtypes"}``; the script forks ``max(world)``
processes once and for each job ranks ``0..world-1`` form a fresh gloo group of that size
while the other ranks sit the job out (the pattern of tests/writers/torch_variants.py).

The model (``Net``) is what FP8 training keeps beside its weights: ``lin``, an ordinary
``nn.Linear`` trained for a few Adam steps, and ``odd``, which holds for every dtype the job
names (``job["dtypes"]``, default `DTYPES`) a frozen parameter ``w_<dtype>`` of 10 rows (sharded by FSDP2 ``fully_shard`` on
dim 0, unevenly on 4 ranks: 3, 3, 3, 1) and a buffer ``s_<dtype>`` (replicated; the scales
and amax histories of FP8 recipes are buffers). Their values are random bytes viewed as the
dtype, NaN and subnormal patterns included, so only a bitwise comparison can pass.

* ``write``: build, train, ``dcp.save({"model": msd, "optim": osd})`` with torch's own
  ``get_state_dict``; rank 0 ``torch.save``s to ``job["result"]`` the full state it just
  saved: every model entry as ``(dtype name, shape, raw bytes)`` assembled from the ranks'
  local shards at the offsets torch computes, and the optimizer state gathered by torch's
  ``get_optimizer_state_dict(full_state_dict=True)``. The model is gathered by hand because
  gloo has no collective for float8, float4, bits or uint16-64 tensors (``full_tensor()``
  fails); every shard is sent as its bytes with ``all_gather_object``.
* ``load``: build the same model at ``world`` ranks with other values (so a load that does
  nothing cannot pass), ``dcp.load`` + ``set_state_dict`` (strict), then gather and save the
  state the live modules hold exactly as ``write`` does.
"""
from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

# every dtype torch 2.13's dcp.save can write that is not an ordinary float/int/bool. Not here:
# bits8/bits16/bits1x8/bits2x4/bits4x2 (dcp.save itself fails on them: its planner sizes every
# item with torch._utils._element_size, which raises "torch.iinfo() requires an integer input
# type"; tests/test_dtypes.py checks that it still does), sub-byte int1-7/uint1-7 (names
# without a storage: torch.save refuses them) and quantized dtypes (they need a quantizer).
DTYPES = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2",
          "uint16", "uint32", "uint64", "complex32", "complex64", "complex128")
ROWS, COLS, HISTORY = 10, 4, 16
STEPS = 3
LR = 1e-2
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def random_bytes(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (every bit pattern, NaNs included; no arithmetic on the dtype)."""
    n = 1
    for s in shape:
        n *= s
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


class Odd(nn.Module):
    """A frozen parameter and a buffer of every dtype in ``dtypes`` (never run forward)."""

    def __init__(self, seed: int, dtypes: tuple[str, ...]) -> None:
        super().__init__()
        for i, name in enumerate(dtypes):
            dtype = getattr(torch, name)
            w = nn.Parameter(random_bytes(dtype, (ROWS, COLS), seed + 2 * i), requires_grad=False)
            self.register_parameter(f"w_{name}", w)
            self.register_buffer(f"s_{name}", random_bytes(dtype, (HISTORY,), seed + 2 * i + 1))


class Net(nn.Module):
    """An ordinary trained layer beside the state in unusual dtypes."""

    def __init__(self, seed: int, dtypes: tuple[str, ...]) -> None:
        super().__init__()
        self.lin = nn.Linear(6, ROWS)
        self.odd = Odd(seed, dtypes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def build(world: int, seed: int, dtypes: tuple[str, ...]) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``Net`` under FSDP2 at ``world`` ranks and an Adam over its trainable parameters."""
    torch.manual_seed(seed)
    model = Net(1000 + seed, dtypes)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    fully_shard(model.lin, mesh=mesh)
    fully_shard(model.odd, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=LR, betas=(0.9, 0.95))
    return model, optim


def train(model: nn.Module, optim: torch.optim.Optimizer, rank: int) -> None:
    """A few real Adam steps on rank-dependent data (the moments are not zeros)."""
    for s in range(STEPS):
        g = torch.Generator().manual_seed(100 * rank + s)
        loss = model(torch.randn(8, 6, generator=g)).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()


def model_bytes(model: nn.Module) -> dict[str, tuple[str, tuple[int, ...], bytes]] | None:
    """Every model entry as (dtype name, global shape, raw bytes), complete on rank 0 (collective)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    pieces: dict[str, Any] = {}
    for key, v in model.state_dict().items():
        if isinstance(v, DTensor):
            _, offset = compute_local_shape_and_global_offset(v.shape, v.device_mesh, v.placements)
            local = v.to_local().detach().contiguous().cpu()
        else:
            offset, local = (0,) * v.dim(), v.detach().contiguous().cpu()
        raw = local.reshape(-1).view(torch.uint8).numpy().tobytes() if local.numel() else b""
        pieces[key] = (str(v.dtype).removeprefix("torch."), tuple(v.shape), tuple(offset), tuple(local.shape), raw)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, pieces)
    if dist.get_rank() != 0:
        return None
    out = {}
    for key, (dtype, shape, _, _, _) in pieces.items():
        itemsize = getattr(torch, dtype).itemsize
        full = torch.zeros(shape + (itemsize,), dtype=torch.uint8)
        for rank_pieces in gathered:
            _, _, offset, lshape, raw = rank_pieces[key]
            if 0 in lshape:
                continue
            part = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(lshape + (itemsize,))
            full[tuple(slice(o, o + n) for o, n in zip(offset, lshape))] = part
        out[key] = (dtype, shape, full.numpy().tobytes())
    return out


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The full state the live objects hold (collective; complete on rank 0)."""
    return {"model": model_bytes(model), "optim": get_optimizer_state_dict(model, optim, options=FULL)}


def write_job(rank: int, job: dict[str, Any]) -> dict[str, Any]:
    model, optim = build(job["world"], 0, tuple(job.get("dtypes", DTYPES)))
    train(model, optim, rank)
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=job["dir"])
    return full_state(model, optim)


def load_job(rank: int, job: dict[str, Any]) -> dict[str, Any]:
    model, optim = build(job["world"], 7, tuple(job.get("dtypes", DTYPES)))  # other values: the load must replace them
    train(model, optim, rank)  # Adam's state exists, as in a trainer that resumes
    msd, osd = get_state_dict(model, optim)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=job["dir"])
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return full_state(model, optim)


if __name__ == "__main__":
    import jobs  # tests/writers is sys.path[0] when run as a script

    sys.exit(jobs.main(write_job, load_job))
