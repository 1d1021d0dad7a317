"""Real DCP saves of a replicated (DDP-style) model, written two ways (issue 15: topology told honestly).

Run as ``python tests/writers/replicated_dp.py OUT``: 2 gloo ranks each hold the whole model
and its Adam state (plain data parallelism, every tensor replicated) and save
``{"model", "optim"}`` from ``get_state_dict`` twice with torch's own ``DefaultSavePlanner``:

* ``OUT/balanced``: the default deduplication spreads the replicated chunks over the ranks
  that hold them, so rank 1 writes some: the replicas leave a trace.
* ``OUT/lowest``: ``dedup_save_to_lowest_rank=True`` puts every chunk on rank 0 and rank 1
  writes an empty file: replicas and pipeline stages look the same.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict

from reshard.testing.synthetic import finish_worker, init_worker, spawn_ranks


def worker(rank: int, world: int, port: int, out: str) -> None:
    init_worker(rank, world, port)
    torch.manual_seed(0)  # every rank the same model and the same batch: replicas stay equal
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    for name, lowest in (("lowest", True), ("balanced", False)):
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{out}/{name}",
                 planner=DefaultSavePlanner(dedup_save_to_lowest_rank=lowest))
    finish_worker()


if __name__ == "__main__":
    spawn_ranks(worker, 2, (sys.argv[1],), timeout=120)
