"""``python -m reshard.reference``: run the reference trainer.

Two launch modes:
  torchrun --nproc-per-node 4 -m reshard.reference --dp 4 --steps 6 --save-at 3 --out ckpts --log-file log.jsonl
  python -m reshard.reference --spawn --dp 4 --steps 6 --save-at 3 --out ckpts
  python -m reshard.reference --spawn --pp 2 --dp 2 --steps 6 --save-at 3 --out ckpts   # 4 ranks, 2 stages
  python -m reshard.reference --spawn --layout dp=2,tp=2 ...    # the layout as one spec (the trainer contract's {layout})

`reshard rehearse` runs it through the trainer contract (formats/trainer_contract.md) like any
user's trainer: see ``reshard.rehearsal.contract.reference_command``.
"""
from __future__ import annotations

import argparse
import os
import sys

from reshard.reference.trainer import TrainConfig, run_in_process_group, run_reference


def _int_list(values: list[str] | None) -> list[int]:
    out: list[int] = []
    for v in values or []:
        out.extend(int(x) for x in v.split(",") if x.strip())
    return out


def parse_args(argv: list[str] | None = None) -> tuple[TrainConfig, bool]:
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="python -m reshard.reference", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spawn", action="store_true", help="spawn pp*dp*tp local gloo processes (else expect torchrun)")
    p.add_argument("--layout", default=None, metavar="SPEC",
                   help="dp=N[,tp=N][,pp=N] in one spec (instead of --dp/--tp/--pp)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel (FSDP) degree; default WORLD_SIZE/(pp*tp) or 2")
    p.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel degree")
    p.add_argument("--pp", type=int, default=d.pp,
                   help="pipeline-parallel degree (stages; must divide the number of layers)")
    p.add_argument("--steps", type=int, default=d.steps, help="stop after this (absolute) optimizer step")
    p.add_argument("--total-steps", type=int, default=None, help="LR schedule horizon (default: --steps)")
    p.add_argument("--save-at", action="append", default=None, metavar="K[,K...]",
                   help="save a checkpoint to OUT/step_K after step K (repeatable)")
    p.add_argument("--out", default=None, help="directory receiving step_K checkpoints")
    p.add_argument("--micro-batch", type=int, default=d.micro_batch)
    p.add_argument("--grad-accum", type=int, default=d.grad_accum)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--dataset-len", type=int, default=d.dataset_len)
    p.add_argument("--dropout", type=float, default=d.dropout)
    p.add_argument("--convention", choices=["reshard", "torchtitan"], default=d.convention)
    p.add_argument("--manifest", action=argparse.BooleanOptionalAction, default=None,
                   help="write manifest.json (default: yes for reshard, no for torchtitan)")
    p.add_argument("--log", "--log-file", dest="log", default=None,
                   help="append one JSON line per optimizer step (rank 0); under torchrun spell it --log-file "
                        "(torchrun itself rejects --log as an ambiguous abbreviation)")
    p.add_argument("--resume", default=None, metavar="DIR", help="resume from a DCP checkpoint directory")
    p.add_argument("--experiment-id", default=None)
    for name in ("n_heads", "n_layers", "dim", "vocab_size"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name), help="model shape")
    a = p.parse_args(argv)
    if a.layout:
        from reshard.model.topology import parse_spec

        t = parse_spec(a.layout)
        if t.dp_replicate != 1 or t.cp != 1:
            p.error(f"--layout {a.layout}: the reference trainer has no dp_replicate or cp dimension")
        a.dp, a.tp, a.pp = t.dp_shard, t.tp, t.pp
    dp = a.dp
    if dp is None:
        world = int(os.environ.get("WORLD_SIZE", "0"))
        dp = world // (a.tp * a.pp) if world and not a.spawn else 2
    cfg = TrainConfig(dp=dp, tp=a.tp, pp=a.pp, steps=a.steps, total_steps=a.total_steps, save_at=_int_list(a.save_at),
                      out=a.out, micro_batch=a.micro_batch, grad_accum=a.grad_accum, seq_len=a.seq_len, lr=a.lr,
                      warmup=a.warmup, seed=a.seed, dataset_len=a.dataset_len, dropout=a.dropout,
                      convention=a.convention, manifest=a.manifest, log=a.log, resume=a.resume,
                      experiment_id=a.experiment_id, n_heads=a.n_heads, n_layers=a.n_layers, dim=a.dim,
                      vocab_size=a.vocab_size)
    return cfg, a.spawn


def main(argv: list[str] | None = None) -> int:
    cfg, spawn = parse_args(argv)
    try:
        cfg.validate()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if spawn:
        # A fresh interpreter that has run no torch op: forking it starts the ranks without
        # importing torch again in each (the rehearsal runs this once per run).
        for path in run_reference(cfg, start_method="fork"):
            print(path)
        return 0
    if "RANK" not in os.environ:
        print("error: not under torchrun (no RANK in the environment); pass --spawn to start processes",
              file=sys.stderr)
        return 2
    if cfg.out:
        os.makedirs(cfg.out, exist_ok=True)
    run_in_process_group(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
