"""Real torch writers (and loaders) for the matrix of torch checkpoint variations (issue 15).

Run as a plain script: ``python tests/writers/torch_variants.py write|load JOBS.json``.
``JOBS.json`` is a list of jobs ``{"variant", "dir", "world", "port", "result"}``; the script
spawns ``max(world)`` processes once (process start-up dominates on a small CPU box) and for
each job ranks ``0..world-1`` form a fresh gloo group of that size while the other ranks sit
the job out (the pattern of tests/_dcp_load_worker.py).

* ``write``: build the variant's tiny model under FSDP2 ``fully_shard`` (HSDP: a 2-D mesh
  ``(dp_replicate, dp_shard)``), train it for a few Adam steps on rank-dependent data, and
  save with the real ``torch.distributed.checkpoint.save`` exactly as a user of that recipe
  does. Rank 0 also ``torch.save``s the full (unsharded) state it just saved, gathered by
  torch's own ``get_state_dict(full_state_dict=True)``, to ``job["result"]``: the reference
  the loaded values are compared with.
* ``load``: build the same model and optimizer at ``world`` ranks, load ``dir`` the way that
  recipe loads (``dcp.load`` + ``set_state_dict``; the DCP recipe's ``AppState`` Stateful; the
  optimizer-only folder into an optimizer of a freshly built model), hand the scheduler its
  state, then gather the full state the live objects hold and ``torch.save`` it from rank 0
  to ``job["result"]``. The comparison is done by the test, in the main process.

Variants (``VARIANTS``): ``extras`` (get_state_dict model+optim, LambdaLR under
``scheduler``, OneCycleLR under ``lr_scheduler``, ``step``/``epoch`` ints, a nested
``config`` dict, ``extra.blob`` an ``io.BytesIO`` and ``extra.raw`` ``bytes``), ``appstate``
(the DCP tutorial's ``{"app": AppState(model, optimizer)}``), ``batchnorm`` (running
statistics and ``num_batches_tracked`` buffers), ``tied`` (``enc.table.weight`` tied to
``dec.proj.weight``), ``optim_only`` (``{"optim": get_optimizer_state_dict(...)}`` only),
``hsdp`` (a ``(2, 2)`` mesh, ``fully_shard(mesh=mesh2d)``; loaded back as plain FSDP2).
"""
from __future__ import annotations

import io
import json
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict, get_state_dict,
                                                     set_optimizer_state_dict, set_state_dict)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

VARIANTS = ("extras", "appstate", "batchnorm", "tied", "optim_only", "hsdp")
STEPS = 3
LR = 1e-2
CONFIG = {"model": {"dim": 12, "layers": 2, "act": "gelu"}, "optim": {"lr": LR, "betas": [0.9, 0.95]},
          "name": "tiny-variant", "seed": 1234}
BLOB = b"\x00opaque trainer blob\xff" * 3
RAW = bytes(range(256))
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class MLP(nn.Module):
    """Two linear layers; 10 output rows so 4 ranks shard unevenly (3, 3, 3, 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 12)
        self.out = nn.Linear(12, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x)))


class BNNet(nn.Module):
    """Linear -> BatchNorm1d -> Linear: running_mean/var and num_batches_tracked are buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 12)
        self.bn = nn.BatchNorm1d(12)
        self.out = nn.Linear(12, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.inp(x))))


class Enc(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(10, 6)
        self.mix = nn.Linear(6, 6)


class Dec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 10, bias=False)


class TiedNet(nn.Module):
    """``enc.table.weight`` and ``dec.proj.weight`` are one tensor (names not in formats/models/ties.toml)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = Enc()
        self.dec = Dec()
        self.dec.proj.weight = self.enc.table.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec.proj(torch.tanh(self.enc.mix(self.enc.table(x))))


class AppState(Stateful):
    """The Stateful of PyTorch's DCP tutorial ("Getting Started with Distributed Checkpoint")."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        model_state_dict, optimizer_state_dict = get_state_dict(self.model, self.optimizer)
        return {"model": model_state_dict, "optim": optimizer_state_dict}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def build(variant: str, world: int) -> tuple[nn.Module, torch.optim.Optimizer, list[Any]]:
    """The variant's model under FSDP2 at ``world`` ranks, its Adam, and its LR schedulers (extras only)."""
    torch.manual_seed(0)  # the same initial weights on every rank, as a trainer seeds them
    model: nn.Module = {"batchnorm": BNNet, "tied": TiedNet}.get(variant, MLP)()
    if variant == "hsdp" and world == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    if variant == "tied":
        fully_shard(model, mesh=mesh)  # tied parameters must share one FSDP group: the root
    else:
        for child in model.children():
            fully_shard(child, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=LR, betas=(0.9, 0.95))
    scheds: list[Any] = []
    if variant == "extras":
        scheds = [torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + s)),
                  torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=LR, total_steps=20)]
    return model, optim, scheds


def train(variant: str, model: nn.Module, optim: torch.optim.Optimizer, scheds: list[Any], rank: int) -> None:
    """A few real optimizer steps on rank-dependent data (moments differ from their initial zeros)."""
    model.train()
    for s in range(STEPS):
        g = torch.Generator().manual_seed(100 * rank + s)
        if variant == "tied":
            x = torch.randint(0, 10, (8,), generator=g)
        else:
            x = torch.randn(8, 6, generator=g)
        loss = model(x).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        for sc in scheds:
            sc.step()
    # FSDP2 does not shard or synchronise buffers: each rank's BatchNorm statistics follow its own
    # data, and DCP keeps one copy of a replicated key. Trainers that care make them agree, as DDP's
    # broadcast_buffers does (rank 0's copy); then what is saved is one well-defined value.
    for buf in model.buffers():
        dist.broadcast(buf, src=0)


def extras_state(scheds: list[Any], step: int, epoch: int) -> dict[str, Any]:
    """Variant ``extras``'s non-model entries: schedulers, counters, config and blobs."""
    return {"scheduler": scheds[0].state_dict(), "lr_scheduler": scheds[1].state_dict(), "step": step,
            "epoch": epoch, "config": json.loads(json.dumps(CONFIG)),
            "extra": {"blob": io.BytesIO(BLOB), "raw": RAW}}


def save_state(variant: str, model: nn.Module, optim: torch.optim.Optimizer, scheds: list[Any]) -> dict[str, Any]:
    """Exactly what the variant's user hands to ``dcp.save``."""
    if variant == "appstate":
        return {"app": AppState(model, optim)}
    if variant == "optim_only":
        return {"optim": get_optimizer_state_dict(model, optim)}
    msd, osd = get_state_dict(model, optim)
    sd: dict[str, Any] = {"model": msd, "optim": osd}
    if variant == "extras":
        sd.update(extras_state(scheds, STEPS, 1))
    return sd


def full_state(variant: str, model: nn.Module, optim: torch.optim.Optimizer, scheds: list[Any],
               objects: dict[str, Any] | None) -> dict[str, Any]:
    """The full, unsharded state the live objects hold (collective; complete on rank 0)."""
    msd, osd = get_state_dict(model, optim, options=FULL)
    out: dict[str, Any] = {"optim": osd}
    if variant != "optim_only":
        out["model"] = msd
    if variant == "extras":
        out["scheduler"] = scheds[0].state_dict()
        out["lr_scheduler"] = scheds[1].state_dict()
        out["objects"] = objects
    return out


def plain_objects(sd: dict[str, Any]) -> dict[str, Any]:
    """The extras' counters, config and blobs as plain values (a BytesIO as its bytes)."""
    blob = sd["extra"]["blob"]
    return {"step": sd["step"], "epoch": sd["epoch"], "config": sd["config"],
            "blob_type": type(blob).__name__, "blob": blob.getvalue() if isinstance(blob, io.BytesIO) else blob,
            "raw_type": type(sd["extra"]["raw"]).__name__, "raw": sd["extra"]["raw"]}


def write_job(rank: int, job: dict[str, Any]) -> dict[str, Any] | None:
    variant, world = job["variant"], job["world"]
    model, optim, scheds = build(variant, world)
    train(variant, model, optim, scheds, rank)
    sd = save_state(variant, model, optim, scheds)
    dcp.save(sd, checkpoint_id=job["dir"])
    objects = plain_objects(sd) if variant == "extras" else None
    return full_state(variant, model, optim, scheds, objects)


def load_job(rank: int, job: dict[str, Any]) -> dict[str, Any] | None:
    variant, world = job["variant"], job["world"]
    model, optim, scheds = build(variant, world)
    if variant == "appstate":
        dcp.load({"app": AppState(model, optim)}, checkpoint_id=job["dir"])  # calls AppState.load_state_dict
        return full_state(variant, model, optim, scheds, None)
    if variant == "optim_only":
        sd = {"optim": get_optimizer_state_dict(model, optim)}
        dcp.load(sd, checkpoint_id=job["dir"])
        set_optimizer_state_dict(model, optim, sd["optim"])
        return full_state(variant, model, optim, scheds, None)
    msd, osd = get_state_dict(model, optim)
    sd = {"model": msd, "optim": osd}
    if variant == "extras":
        sd.update(extras_state(scheds, 0, 0))  # placeholders of the same structure; dcp.load replaces them
        sd["extra"] = {"blob": io.BytesIO(), "raw": b""}
    dcp.load(sd, checkpoint_id=job["dir"])
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    objects = None
    if variant == "extras":
        scheds[0].load_state_dict(sd["scheduler"])
        scheds[1].load_state_dict(sd["lr_scheduler"])
        objects = plain_objects(sd)
    return full_state(variant, model, optim, scheds, objects)


if __name__ == "__main__":
    import jobs  # tests/writers is sys.path[0] when run as a script

    sys.exit(jobs.main(write_job, load_job))
