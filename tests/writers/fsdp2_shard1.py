"""Real torch writer (and loader) of an FSDP2 checkpoint sharded on dim 1 (``shard_placement_fn``), issue 43 item 2.

Run as a plain script: ``python tests/writers/fsdp2_shard1.py write|load JOBS.json`` (the ranks
forked by tests/writers/jobs.py). The model is a small non-LLM net (a conv layer and an MLP
head) under FSDP2 ``fully_shard(module, mesh=..., shard_placement_fn=lambda p: Shard(1))`` for
every parameter of at least two dims (vectors stay ``Shard(0)``, as FSDP2 requires a dim to
exist), a few real Adam steps, then torch's own ``get_state_dict`` + ``dcp.save``.

* ``write``: rank 0 ``torch.save``s to ``job["result"]`` the full state it just saved
  (``get_state_dict(full_state_dict=True)``).
* ``load``: the same model at ``world`` ranks with other values, ``dcp.load`` + strict
  ``set_state_dict``, then the full state the live modules hold, gathered the same way.
"""
from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

import jobs  # tests/writers is sys.path[0] when run as a script

STEPS = 2
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def placement(p: nn.Parameter) -> Shard:
    """Dim 1 where the parameter has one (a column-wise FSDP cut), else dim 0."""
    return Shard(1) if p.dim() >= 2 else Shard(0)


class Net(nn.Module):
    """A conv layer and a two-layer MLP head: no LLM names, no partition rules ship for it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 6, 3, padding=1)  # dim 1 even: FSDP2 refuses uneven sharding on a dim > 0
        self.fc1 = nn.Linear(6 * 4 * 4, 8)
        self.fc2 = nn.Linear(8, 4)  # every dim 1 divides by 4: FSDP2 at 4 ranks loads it too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x)).flatten(1)
        return self.fc2(torch.relu(self.fc1(h)))


def build(world: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    for m in (model.conv, model.fc1, model.fc2):
        fully_shard(m, mesh=mesh, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh, shard_placement_fn=placement)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(model: nn.Module, optim: torch.optim.Optimizer, rank: int) -> None:
    for s in range(STEPS):
        g = torch.Generator().manual_seed(100 * rank + s)
        loss = model(torch.randn(4, 4, 4, 4, generator=g)).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(model, optim, options=FULL)
    return {"model": msd, "optim": osd}


def write_job(rank: int, job: dict[str, Any]) -> dict[str, Any]:
    model, optim = build(job["world"], 0)
    train(model, optim, rank)
    jobs.save_state(model, optim, job["dir"])
    return full_state(model, optim)


def load_job(rank: int, job: dict[str, Any]) -> dict[str, Any]:
    model, optim = build(job["world"], 7)  # other values: the load must replace them
    train(model, optim, rank)  # Adam's state exists, as in a trainer that resumes
    jobs.load_state(model, optim, job["dir"])
    return full_state(model, optim)


if __name__ == "__main__":
    sys.exit(jobs.main(write_job, load_job))
