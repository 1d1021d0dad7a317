"""Real torch writers (and loaders) for torch's safetensors-backed DCP (issue 31).

Run as a plain script: ``python tests/writers/torch_hf_storage.py write|load JOBS.json``.
``JOBS.json`` is a list of jobs ``{"kind", "world", "port", "result", ...}``; the script forks
``max(world)`` processes once and for each job ranks ``0..world-1`` form a fresh gloo group
of that size while the other ranks sit the job out (as tests/writers/torch_variants.py does).

* ``write`` (kind ``write``, 2 ranks): a small net (Linear 6->11, LayerNorm(11), Linear 11->10:
  11 rows shard unevenly; two buffers, a running mean of 11 values and a 0-d scale, plain
  tensors replicated on every rank) under FSDP2 ``fully_shard``, trained a few Adam steps on
  rank-dependent data, then saved three times by torch's own ``HuggingFaceStorageWriter``:

  - ``job["sharded"]``: ``{"model": get_model_state_dict(model)}`` with ``save_distributed=True``
    (per-rank ``shard-0000r-model-00001-of-00001.safetensors`` carrying ``DCP_SHARDING_INFO``);
  - ``job["consolidated"]``: the flat ``get_model_state_dict(model)`` (names as a Hugging Face
    checkpoint has them) with ``save_distributed=True, enable_consolidation=True`` (full tensors
    in ``model-00001-of-00001.safetensors`` + ``model.safetensors.index.json``, the per-rank
    shards kept in ``sharded/``);
  - ``job["with_optim"]``: ``{"model": ..., "optim": get_optimizer_state_dict(...)}`` with
    ``save_distributed=True``: what the writer makes of non-tensor values (param_groups).

  Every value is floating point: torch's consolidation sizes elements with ``torch.finfo`` and
  fails on an integer tensor (a BatchNorm's ``num_batches_tracked``).

  Rank 0 ``torch.save``s the full model state (torch's ``get_model_state_dict(full_state_dict=True)``)
  to ``job["result"]``: the reference every load is compared with.
* ``load``: build the same net at ``world`` ranks, ``dcp.load`` ``job["dir"]`` into its sharded
  state dict (``nest``: ``"model"`` for ``{"model": sd}``, ``""`` for the flat dict) with the
  default ``FileSystemReader`` (``reader == "dcp"``) or torch's ``HuggingFaceStorageReader``
  (``"hf"``), ``set_model_state_dict`` (strict), then gather the full state on rank 0 and
  ``torch.save`` it with the checkpoint's keys as that reader lists them.
"""
from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

STEPS = 3
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 11)
        self.norm = nn.LayerNorm(11)
        self.out = nn.Linear(11, 10)
        self.register_buffer("running_mean", torch.zeros(11))
        self.register_buffer("scale", torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.inp(x)))
        if self.training:
            with torch.no_grad():
                self.running_mean.mul_(0.9).add_(h.mean(0), alpha=0.1)
                self.scale.mul_(0.75)
        return self.out(h) * self.scale


def build(world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    for child in model.children():
        fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def write_job(rank: int, job: dict[str, Any]) -> dict[str, Any]:
    model, optim = build(job["world"])
    model.train()
    for s in range(STEPS):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(100 * rank + s))
        model(x).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    for buf in model.buffers():  # one well-defined value of the replicated statistics (rank 0's), as DDP keeps them
        dist.broadcast(buf, src=0)
    msd = get_model_state_dict(model)
    dcp.save({"model": msd}, storage_writer=HuggingFaceStorageWriter(job["sharded"], save_distributed=True))
    dcp.save(msd, storage_writer=HuggingFaceStorageWriter(job["consolidated"], save_distributed=True,
                                                          enable_consolidation=True))
    dcp.save({"model": msd, "optim": get_optimizer_state_dict(model, optim)},
             storage_writer=HuggingFaceStorageWriter(job["with_optim"], save_distributed=True))
    return {"full": get_model_state_dict(model, options=FULL)}


def load_job(rank: int, job: dict[str, Any]) -> dict[str, Any]:
    model, _ = build(job["world"])
    msd = get_model_state_dict(model)
    sd = {job["nest"]: msd} if job["nest"] else msd
    reader = HuggingFaceStorageReader(job["dir"]) if job["reader"] == "hf" else FileSystemReader(job["dir"])
    dcp.load(sd, storage_reader=reader)
    set_model_state_dict(model, msd)  # strict: every key of the model
    keys = sorted((HuggingFaceStorageReader if job["reader"] == "hf" else FileSystemReader)(job["dir"])
                  .read_metadata().state_dict_metadata)
    return {"full": get_model_state_dict(model, options=FULL), "checkpoint_keys": keys}


if __name__ == "__main__":
    import jobs  # tests/writers is sys.path[0] when run as a script

    sys.exit(jobs.main(write_job, load_job))
