"""An example trainer that passes `reshard rehearse`, written against plain torch only.

Run it the way `reshard rehearse --trainer` does (formats/trainer_contract.md)::

    reshard rehearse --from dp=4 --to dp=2 --trainer \\
      'torchrun --nproc-per-node {world} examples/fsdp2_trainer.py --layout {layout} --resume {ckpt_in}
       --save-at {save_at} --save {ckpt_out} --steps {steps} --step-log {log} --micro-batch {micro_batch}
       --grad-accum {grad_accum} --seed {seed} --dataset-len {dataset_len}'

(``--nproc {world}`` instead of torchrun forks the ranks from one process: one import of
torch per run, which is what tests/test_rehearse_trainer.py uses on a 2-core machine.)

It imports nothing from reshard: the contract is the command line, the DCP checkpoint and
the step log. What a trainer of your own needs so its state survives a change of world size
(each point is marked ``# CONTRACT`` below):

1. Model and optimizer through ``get_state_dict`` / ``set_state_dict`` and ``dcp.save`` /
   ``dcp.load``: DCP stores global tensors, so FSDP2 shards of any width load them.
2. The data position as ONE global cursor (samples consumed this epoch), identical on every
   rank, from which each rank derives its share; never a per-rank count, which means
   something else on another world size (``GlobalCursorSampler``).
3. The batch recipe from the command line (``--micro-batch``, ``--grad-accum``): reshard keeps
   the global batch by changing the accumulation, and the trainer must take what it is given.
4. The step counter, scheduler and sampler saved beside the weights, under the keys of
   reshard's ``reshard`` convention (formats/conventions/reshard.toml): ``model.*``,
   ``optim.*``, ``scheduler.*``, ``trainer.step``, ``data.sampler.{seed,epoch,cursor,dataset_len}``.
   (Other layouts work with a ``--convention`` file; these need none.)
5. One JSON line per optimizer step on rank 0 (formats/step_log.md): loss, grad norm,
   tokens/s and the global sample ids the step consumed.

``--bug adam-reset`` (a fresh AdamW on resume) and ``--bug reshuffle`` (the data order
seeded by the world size) emulate two common mistakes; the rehearsal names both.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

BUGS = ("adam-reset", "reshuffle")


# ----------------------------------------------------------------------------- model and data
class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class TinyLM(nn.Module):
    """A next-token model small enough that a CPU rank trains a step in milliseconds."""

    def __init__(self, vocab: int = 64, dim: int = 32, n_layers: int = 2, seq_len: int = 16):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        for b in self.blocks:
            h = b(h)
        return F.cross_entropy(self.head(self.ln_f(h)).flatten(0, 1), y.flatten())


def sample(i: int, seed: int, seq_len: int = 16, vocab: int = 64) -> torch.Tensor:
    """Sample ``i`` depends on (seed, i) only: an arithmetic progression mod vocab, learnable."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + i)
    start, stride = int(torch.randint(vocab, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
    return (start + stride * torch.arange(seq_len + 1)) % vocab


# CONTRACT 2: one global cursor; a step's samples depend on (seed, epoch, cursor, global batch) only.
class GlobalCursorSampler:
    """Epoch e is randperm(dataset_len) seeded with seed + e; a step takes the window
    [cursor, cursor + global_batch); micro-step m takes its m-th 1/A and dp rank r of W the
    r-th 1/W of that. The union over ranks is the window, whatever W."""

    def __init__(self, dataset_len: int, seed: int, order_seed: int | None = None):
        self.dataset_len, self.seed, self.epoch, self.cursor = dataset_len, seed, 0, 0
        self.order_seed = seed if order_seed is None else order_seed

    def _perm(self) -> torch.Tensor:
        return torch.randperm(self.dataset_len, generator=torch.Generator().manual_seed(self.order_seed + self.epoch))

    def local_ids(self, global_batch: int, world: int, rank: int, micro: int, grad_accum: int) -> list[int]:
        mb = global_batch // (grad_accum * world)
        start = self.cursor + micro * (global_batch // grad_accum) + rank * mb
        if start + mb > self.dataset_len:
            raise RuntimeError("this example does not cross epochs; pass a larger --dataset-len")
        return self._perm()[start:start + mb].tolist()

    def advance(self, global_batch: int) -> None:
        self.cursor += global_batch
        if self.cursor >= self.dataset_len:
            self.epoch, self.cursor = self.epoch + 1, self.cursor - self.dataset_len

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "cursor": self.cursor, "dataset_len": self.dataset_len}

    def load_state_dict(self, s: dict) -> None:
        self.epoch, self.cursor = int(s["epoch"]), int(s["cursor"])


def lr_at(step: int, warmup: int, horizon: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, horizon - warmup))))


# ----------------------------------------------------------------------------- checkpoint
def state(model, optim, sched, sampler, counters: dict) -> dict:
    """CONTRACT 1 + 4: the nested dict dcp.save flattens to model.*, optim.*, scheduler.*, trainer.*, data.sampler.*"""
    model_sd, optim_sd = get_state_dict(model, optim)
    sched_sd = {k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"}
    return {"model": model_sd, "optim": optim_sd, "scheduler": sched_sd, "trainer": dict(counters),
            "data": {"sampler": sampler.state_dict()}}


def load(path: str, model, optim, sched, sampler, counters: dict, bug: str | None) -> None:
    sd = state(model, optim, sched, sampler, counters)
    dcp.load(sd, checkpoint_id=path)  # DCP reshards the saved global tensors onto this world size
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    if bug == "adam-reset":  # BUG: the optimizer starts afresh on resume (moments and step counters 0)
        optim.state.clear()
    sched.load_state_dict({**sd["scheduler"], "lr_lambdas": [None] * len(sched.lr_lambdas)})
    sampler.load_state_dict(sd["data"]["sampler"])
    counters.update({k: int(v) for k, v in sd["trainer"].items()})


# ----------------------------------------------------------------------------- the loop
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layout", default=None, help="dp=N (this example shards over data parallelism only)")
    p.add_argument("--steps", type=int, required=True, help="stop after this absolute optimizer step")
    p.add_argument("--total-steps", type=int, default=None, help="LR horizon (default --steps)")
    p.add_argument("--save-at", default="", help="comma-separated steps after which to save")
    p.add_argument("--save", default=None, help="directory receiving step_<k> checkpoints")
    p.add_argument("--resume", default=None, help="DCP checkpoint to resume from")
    p.add_argument("--step-log", dest="log", default=None,
                   help="step log (JSON lines, rank 0); not --log, which torchrun takes for its own --log-dir")
    p.add_argument("--micro-batch", type=int, default=2)  # CONTRACT 3
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset-len", type=int, default=4096)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--nproc", type=int, default=None,
                   help="start this many local ranks itself (forked, no torchrun: quicker on a laptop or in CI)")
    p.add_argument("--bug", choices=BUGS, default=None, help="emulate a mistake the rehearsal must catch")
    return p.parse_args(argv)


def launch(a: argparse.Namespace) -> int:
    """``--nproc N`` without torchrun: fork N ranks of :func:`train` on a free local port."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(a.nproc))
    try:
        mp.start_processes(_forked, args=(a,), nprocs=a.nproc, start_method="fork")
    except Exception as exc:  # a rank failed: its traceback is above
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _forked(rank: int, a: argparse.Namespace) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    code = train(a)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.nproc and "RANK" not in os.environ:
        return launch(a)
    return train(a)


def train(a: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.layout and a.layout.replace(" ", "") != f"dp={world}":
        if rank == 0:
            print(f"error: layout {a.layout!r}: this example runs dp={world} only (FSDP2 over all ranks)",
                  file=sys.stderr)
        dist.destroy_process_group()
        return 2
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    torch.manual_seed(a.seed)  # the same initial weights on every rank
    model = TinyLM()
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    horizon = a.total_steps or a.steps
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: lr_at(s, a.warmup, horizon))
    # BUG reshuffle: the order depends on the world size (like a per-world DistributedSampler shuffle)
    sampler = GlobalCursorSampler(a.dataset_len, a.seed, order_seed=a.seed + 1000 * world if a.bug == "reshuffle" else None)
    counters = {"step": 0, "samples_seen": 0, "tokens_seen": 0, "micro_step": 0}
    if a.resume:
        load(a.resume, model, optim, sched, sampler, counters, a.bug)
    save_at = {int(x) for x in a.save_at.split(",") if x.strip()}
    G = a.micro_batch * a.grad_accum * world
    log = open(a.log, "a", encoding="utf-8") if a.log and rank == 0 else None
    while counters["step"] < a.steps:
        t0 = time.perf_counter()
        ids, loss_sum = [], torch.zeros(())
        for m in range(a.grad_accum):
            mine = sampler.local_ids(G, world, rank, m, a.grad_accum)
            ids += mine
            seq = torch.stack([sample(i, a.seed) for i in mine])
            loss = model(seq[:, :-1], seq[:, 1:]) / a.grad_accum
            loss.backward()
            loss_sum += loss.detach()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        grad_norm = float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn)
        lr = optim.param_groups[0]["lr"]
        optim.step()
        sched.step()
        optim.zero_grad(set_to_none=True)
        sampler.advance(G)
        counters["step"] += 1
        counters["samples_seen"] += G
        counters["tokens_seen"] += G * 16
        dist.all_reduce(loss_sum)
        every: list = [None] * world
        dist.all_gather_object(every, ids)
        if log is not None:  # CONTRACT 5: the step log
            log.write(json.dumps({"step": counters["step"], "loss": loss_sum.item() / world, "grad_norm": grad_norm,
                                  "lr": lr, "tokens_per_s": G * 16 / (time.perf_counter() - t0),
                                  "sample_ids": sorted(i for r in every for i in r), "world_size": world}) + "\n")
            log.flush()
        if counters["step"] in save_at:
            path = Path(a.save) / f"step_{counters['step']}"
            dcp.save(state(model, optim, sched, sampler, counters), checkpoint_id=str(path))
            dist.barrier()
    if log is not None:
        log.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: a gloo thread can abort it on small machines
