"""``python -m reshard.rehearsal --from dp=4 --to dp=2 --out DIR [--trainer CMD]``: run a rehearsal, print the verdict."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from reshard.errors import ReshardError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m reshard.rehearsal", description=__doc__)
    p.add_argument("--from", dest="from_spec", required=True)
    p.add_argument("--to", dest="to_spec", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--trainer", default=None, help="trainer command (formats/trainer_contract.md)")
    p.add_argument("--source-micro-batch", type=int)
    p.add_argument("--source-grad-accum", type=int)
    p.add_argument("--control", choices=["relaunch", "naive-state", "none"])
    p.add_argument("--dataset-len", type=int)
    p.add_argument("--reuse-baseline", type=Path)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--switch-at", type=int, default=4)
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--micro-batch", type=int)
    p.add_argument("--grad-accum", type=int)
    p.add_argument("--like", type=Path)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", action="append", default=[], metavar="NAME=VALUE",
                   help="override loss_rtol, grad_norm_rtol or moment_rtol")
    p.add_argument("--json", action="store_true", help="print rehearsal.json instead of rehearsal.md")
    a = p.parse_args(argv)
    from reshard.rehearsal import rehearse

    try:
        tol = {k: float(v) for k, _, v in (t.partition("=") for t in a.tolerance)}
        r = rehearse(from_spec=a.from_spec, to_spec=a.to_spec, trainer=a.trainer, control=a.control,
                     source_micro_batch=a.source_micro_batch, source_grad_accum=a.source_grad_accum,
                     dataset_len=a.dataset_len, reuse_baseline=a.reuse_baseline, steps=a.steps, switch_at=a.switch_at,
                     window=a.window, micro_batch=a.micro_batch, grad_accum=a.grad_accum, like=a.like, out=a.out,
                     tolerances=tol or None, seed=a.seed, dropout=a.dropout)
    except ReshardError as exc:
        print(f"reshard rehearse: {exc.render()}", file=sys.stderr)
        return exc.exit_code
    except ValueError as exc:
        print(f"reshard rehearse: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(r, indent=2, default=str) if a.json else (a.out / "rehearsal.md").read_text())
    return r["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
