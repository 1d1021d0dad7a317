"""Lightning Fabric writer and loader (issue 15): checkpoints as a Fabric user writes and reads them.

Run under torchrun, one process per rank (Fabric detects torchelastic and does not spawn):

    python -m torch.distributed.run --nproc-per-node N tests/writers/lightning_run.py write CKPT REF
    python -m torch.distributed.run --nproc-per-node N tests/writers/lightning_run.py load CKPT OUT

* ``write``: ``Fabric(accelerator="cpu", devices=N, strategy=ModelParallelStrategy(parallelize,
  data_parallel_size=N, tensor_parallel_size=1))``; ``parallelize`` applies FSDP2
  ``fully_shard`` over the mesh's data-parallel dimension (each layer, then the root), as in
  Lightning's own FSDP2 examples. A few Adam steps on rank-dependent data with a LambdaLR
  scheduler, then ``fabric.save(CKPT, {"model", "optimizer", "step", "epoch", "scheduler"})``:
  Fabric's ``ModelParallelStrategy.save_checkpoint`` writes the model and optimizer with
  ``torch.distributed.checkpoint.save`` and everything else to ``CKPT/meta.pt`` with
  ``torch.save`` from rank 0. Rank 0 also saves REF: the full state just saved, gathered by
  torch's ``get_model_state_dict``/``get_optimizer_state_dict(full_state_dict=True)``, plus the
  metadata values.
* ``load``: a fresh model and optimizer set up through Fabric at N ranks, ``fabric.load(CKPT,
  state)`` (Fabric's own loader: DCP load of model then optimizer, then ``meta.pt`` with
  ``weights_only``), the scheduler given its state back; rank 0 saves OUT, the same full state
  gathered from the live objects, for the test to compare bitwise with REF.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard

from lightning_fabric import Fabric
from lightning_fabric.strategies import ModelParallelStrategy

STEPS = 3
EPOCH = 2
LR = 1e-2
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class Net(nn.Module):
    """Embedding -> two linear layers; 10 output rows so 4 ranks shard unevenly (3, 3, 3, 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.hidden = nn.Linear(8, 12)
        self.head = nn.Linear(12, 10)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(self.embed(idx))))


def parallelize(model: nn.Module, device_mesh: Any) -> nn.Module:
    """FSDP2 over the data-parallel mesh dimension, layer by layer then the root."""
    mesh = device_mesh["data_parallel"]
    for layer in (model.embed, model.hidden, model.head):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def make_fabric(world: int) -> Fabric:
    strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=world, tensor_parallel_size=1,
                                     process_group_backend="gloo")
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    return fabric


def build(fabric: Fabric) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    torch.manual_seed(0)
    with fabric.init_module(empty_init=False):
        model = Net()
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=LR))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lambda s: 1.0 / (1 + s))
    return model, optimizer, scheduler


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The unsharded state the live objects hold, gathered by torch (every rank must call it)."""
    return {"model": get_model_state_dict(model, options=FULL),
            "optimizer": get_optimizer_state_dict(model, optimizer, options=FULL)}


def write(ckpt: Path, ref: Path) -> None:
    fabric = make_fabric(fabric_world())
    model, optimizer, scheduler = build(fabric)
    gen = torch.Generator().manual_seed(100 + fabric.global_rank)
    for _ in range(STEPS):
        idx = torch.randint(0, 16, (4,), generator=gen)
        loss = model(idx).pow(2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    state = {"model": model, "optimizer": optimizer, "step": STEPS, "epoch": EPOCH,
             "scheduler": scheduler.state_dict()}
    fabric.save(ckpt, state)
    reference = full_state(model, optimizer)
    if fabric.global_rank == 0:
        reference.update(step=STEPS, epoch=EPOCH, scheduler=scheduler.state_dict())
        torch.save(reference, ref)
    fabric.barrier()


def load(ckpt: Path, out: Path) -> None:
    fabric = make_fabric(fabric_world())
    model, optimizer, scheduler = build(fabric)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0, "epoch": 0, "scheduler": {}}
    remainder = fabric.load(ckpt, state)
    scheduler.load_state_dict(state["scheduler"])
    loaded = full_state(model, optimizer)
    if fabric.global_rank == 0:
        loaded.update(step=state["step"], epoch=state["epoch"], scheduler=scheduler.state_dict(),
                      remainder=sorted(remainder))
        torch.save(loaded, out)
    fabric.barrier()


def fabric_world() -> int:
    import os
    return int(os.environ["WORLD_SIZE"])


def main() -> None:
    mode, ckpt, result = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    if mode == "write":
        write(ckpt, result)
    elif mode == "load":
        load(ckpt, result)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    import os

    main()
    # Fabric leaves its gloo group alive; torn down by the interpreter, a gloo thread can abort
    # the rank ("terminate called without an active exception", SIGABRT) after its work is done.
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
