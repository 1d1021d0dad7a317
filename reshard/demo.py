"""The demo behind the README's first command: a real run, a real checkpoint, inspected.

Kept tiny on purpose (4 CPU ranks, a few steps, seconds of work) so it runs anywhere.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import typer


def run_demo(out: Path, *, steps: int = 6) -> int:
    from reshard.inspection import inspect_checkpoint
    from reshard.reference import TrainConfig, run_reference
    from reshard.report import render_inspect

    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cfg = TrainConfig(dp=4, tp=1, steps=steps, save_at=[steps], out=str(out / "run"),
                      log=str(out / "run" / "steps.jsonl"), experiment_id="demo")
    typer.echo(f"[1/2] training the reference GPT on 4 CPU ranks (FSDP2 over gloo) for {steps} steps ...", err=True)
    ckpts = run_reference(cfg)
    ckpt = ckpts[-1]
    typer.echo(f"[2/2] reshard inspect {ckpt}\n", err=True)
    result = inspect_checkpoint(ckpt)
    typer.echo(render_inspect(result.report))
    return result.exit_code
