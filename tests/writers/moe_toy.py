"""A tiny mixture-of-experts LM under FSDP2, for the expert-slice test: write a checkpoint, or load a slice.

Run under ``python -m torch.distributed.run --standalone --nproc-per-node N`` (gloo, CPU):

    moe_toy.py write DIR LAYERS EXPERTS
        trains 2 AdamW steps of a model with LAYERS blocks of EXPERTS experts each (every
        block and the model ``fully_shard``-ed over all ranks), saves ``{"model", "optim"}``
        from ``get_state_dict`` with ``dcp.save`` to DIR/ckpt, and the full values (rank 0)
        to DIR/reference.pt.
    moe_toy.py load CKPT LAYERS EXPERTS RESULT
        builds the model with LAYERS blocks of EXPERTS experts at this world size, ``dcp.load``s
        CKPT with torch's DefaultLoadPlanner (every key it asks for must be there), hands it
        to the live modules with ``set_state_dict``, and writes the full values read back with
        ``get_state_dict`` (rank 0) to RESULT, with the keys each rank's plan read.

The model: token embedding, per block a LayerNorm and an MoE (a router ``Linear(dim,
experts)`` whose softmax weighs every expert's output, so every expert trains), a final
norm and a head. Its parameter names are the per-expert layout
``layers.<l>.moe.experts.<e>.{w1,w2}.weight`` and ``layers.<l>.moe.router.weight``.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

DIM, HIDDEN, VOCAB, SEQ = 8, 16, 32, 6


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))


class MoE(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, experts, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(self.router(x), dim=-1)
        return sum(p[..., e:e + 1] * ex(x) for e, ex in enumerate(self.experts))


class Block(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.moe = MoE(experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class ToyMoE(nn.Module):
    def __init__(self, layers: int, experts: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(experts) for _ in range(layers))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for b in self.layers:
            x = b(x)
        return self.head(self.norm(x))


def build(layers: int, experts: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = ToyMoE(layers, experts)
    for b in model.layers:
        fully_shard(b)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def full(v):
    from torch.distributed.tensor import DTensor

    if isinstance(v, DTensor):
        return v.full_tensor().detach().clone()
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def flat_full(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    msd, osd = get_state_dict(model, optim)
    out = {f"model.{k}": full(v) for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for name, v in st.items():
            out[f"optim.state.{fqn}.{name}"] = full(v)
    out["param_groups"] = osd["param_groups"]
    return out


def write(where: str, layers: int, experts: int) -> None:
    model, optim = build(layers, experts)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    for _ in range(2):
        tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
        loss = nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        optim.zero_grad()
        loss.backward()
        optim.step()
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{where}/ckpt")
    ref = flat_full(model, optim)
    if dist.get_rank() == 0:
        torch.save(ref, f"{where}/reference.pt")


def load(ckpt: str, layers: int, experts: int, result: str) -> None:
    model, optim = build(layers, experts)
    for p in model.parameters():  # the optimizer's state exists before a load fills it (as after a first step)
        p.grad = torch.zeros_like(p)
    optim.step()
    msd, osd = get_state_dict(model, optim)
    sd = {"model": msd, "optim": osd}

    class Recording(DefaultLoadPlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            self.requested = sorted({i.dest_index.fqn for i in plan.items})
            return plan

    planner = Recording()
    dcp.load(sd, checkpoint_id=ckpt, planner=planner)
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    got = flat_full(model, optim)
    requested: list = [None] * dist.get_world_size()
    dist.all_gather_object(requested, planner.requested)
    if dist.get_rank() == 0:
        torch.save({"values": got, "requested": requested}, result)


def main(argv: list[str]) -> int:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if argv[0] == "write":
        write(argv[1], int(argv[2]), int(argv[3]))
    else:
        load(argv[1], int(argv[2]), int(argv[3]), argv[4])
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # a gloo thread can abort interpreter teardown ("terminate called without an active exception")
