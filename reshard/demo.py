"""The demo behind the README's first command: the canonical transition, in miniature.

A run on 4 CPU ranks (FSDP2 over gloo) checkpoints at step K; reshard inspects it, plans
the move to 2 ranks (keeping the global batch by doubling accumulation), converts,
verifies, and the reference trainer resumes on 2 ranks. The 4-rank run also continues
uninterrupted, so the demo compares the two loss curves step by step, and ends with a
rehearsal of the same transition (baseline, converted resume and a naive control) and
its figure.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import typer


def _losses(log: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in (json.loads(x) for x in log.read_text().splitlines() if x.strip())}


def run_demo(out: Path, *, steps: int = 6) -> int:
    from reshard.execute import convert
    from reshard.inspection import inspect_checkpoint
    from reshard.plan import Options, make_plan
    from reshard.reference import TrainConfig, run_reference
    from reshard.report import render_convert, render_inspect, render_plan
    from reshard.verify import render_verify, verify_checkpoints

    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    k = max(1, steps // 2)
    say = lambda msg: typer.echo(f"\n=== {msg}", err=True)  # noqa: E731

    say(f"[1/6] reference GPT on 4 CPU ranks (FSDP2 over gloo), {steps} steps, checkpoint at step {k}")
    base = TrainConfig(dp=4, steps=steps, total_steps=steps, save_at=[k], micro_batch=2, grad_accum=2, dropout=0.0,
                       out=str(out / "run4"), log=str(out / "run4.jsonl"), experiment_id="demo")
    ckpt = run_reference(base)[-1]

    say(f"[2/6] reshard inspect {ckpt}")
    typer.echo(render_inspect(inspect_checkpoint(ckpt).report))

    say("[3/6] reshard plan --to dp=2 (dry run)")
    plan = make_plan(ckpt, Options(to="dp=2"))
    typer.echo(render_plan(plan.to_dict(tensors=False)))
    if not plan.feasible:
        return 1

    dst = out / f"step_{k}-dp2"
    say(f"[4/6] reshard convert -> {dst}, then reshard verify")
    report = convert(plan, ckpt, dst)
    typer.echo(render_convert(report))
    v = verify_checkpoints(ckpt, dst, expected_rewrites={a.key: a.action for a in plan.keys
                                                         if a.action in ("rewritten", "dropped", "added")})
    typer.echo(render_verify(v))

    say(f"[5/6] resume on 2 ranks with accumulation {plan.batch.after.grad_accum} to step {steps}")
    resumed = TrainConfig(dp=2, steps=steps, total_steps=steps, micro_batch=plan.batch.after.micro_batch,
                          grad_accum=plan.batch.after.grad_accum, dropout=0.0, resume=str(dst),
                          log=str(out / "run2.jsonl"), experiment_id="demo")
    run_reference(resumed)
    a, b = _losses(out / "run4.jsonl"), _losses(out / "run2.jsonl")
    typer.echo(f"\n{'step':>5} {'loss on 4 ranks':>16} {'loss on 2 ranks':>16} {'rel. diff':>10}")
    worst = 0.0
    for s in sorted(b):
        rel = abs(b[s] - a[s]) / abs(a[s])
        worst = max(worst, rel)
        typer.echo(f"{s:>5} {a[s]:>16.6f} {b[s]:>16.6f} {rel:>10.2e}")
    typer.echo(f"\nmax relative loss difference after the transition: {worst:.2e}")
    typer.echo(f"conversion report: {dst / 'reshard-report.md'}")

    say("[6/6] reshard rehearse --from dp=4 --to dp=2: baseline vs converted resume vs naive control")
    from reshard.rehearsal import rehearse, render_rehearsal

    reh = rehearse(from_spec="dp=4", to_spec="dp=2", steps=12, switch_at=4, window=8, out=out / "rehearsal")
    typer.echo(render_rehearsal(reh))
    typer.echo(f"figure: {out / 'rehearsal' / 'rehearsal.png'} (loss and grad norm of baseline, resumed run and "
               "control with the switch marked; the control's repeated samples)")
    return 0 if v["equal"] and reh["exit_code"] == 0 else 1
