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
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from reshard.errors import BadInput
from reshard.render.progress import waiting
from reshard.model.kinds import EXPECTED_DIFFERENCES

MARKER = ".reshard-demo.json"  # in --out: what the demo created there, so a rerun deletes that and nothing else


def _refuse(out: Path, what: str) -> BadInput:
    return BadInput(what, where=str(out),
                    hint="Choose a new or empty --out: the demo deletes only what an earlier demo wrote there.")


def _walk(out: Path, names: list[str]) -> list[str]:
    """Every file and directory under the demo's own names, relative to ``out`` (symlinks not followed)."""
    found = []
    for name in names:
        top = out / name
        if not os.path.lexists(top):
            continue
        found.append(name)
        if top.is_dir() and not top.is_symlink():
            for dirpath, dirnames, filenames in os.walk(top):
                for n in dirnames + filenames:
                    found.append(os.path.relpath(os.path.join(dirpath, n), out))
    return sorted(found)


def _ours(entry: str, names: list[str]) -> bool:
    """A name the demo made, or what an interrupted conversion into one of them leaves beside it."""
    return entry in names or any(entry.startswith(f".{n}.reshard-") for n in names)


def claim_output(out: Path, names: list[str]) -> None:
    """Make ``out`` the demo's directory for a run creating ``names``; refuse anything else.

    A new or empty directory is taken. A non-empty one is taken only when an earlier demo's
    marker (`MARKER`) accounts for every entry in it: then what that demo created, and only
    that, is deleted. When the earlier run finished, its marker lists every file it wrote,
    so a file the user put even inside the demo's own subdirectories is refused too (an
    interrupted run recorded its top-level names only). Anything unaccounted for is
    `BadInput` (exit 2) naming it, and nothing is deleted.
    """
    from reshard.safefs import read_json

    if os.path.lexists(out) and not out.is_dir():
        raise _refuse(out, "--out exists and is not a directory")
    if out.is_dir():
        entries = sorted(os.listdir(out))
        if entries:
            if MARKER not in entries:
                raise _refuse(out, "--out is not empty and was not written by the demo (it holds "
                                   + ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "") + ")")
            mark = read_json(out / MARKER, root=out, what="demo marker")
            before = [str(n) for n in (mark.get("created") or [])] if isinstance(mark, dict) else []
            files = mark.get("files") if isinstance(mark, dict) else None
            foreign = [e for e in entries if e != MARKER and not _ours(e, before)]
            if isinstance(files, list):
                foreign += sorted(set(_walk(out, before)) - {str(f) for f in files})
            if foreign:
                raise _refuse(out, "--out holds files the demo did not write ("
                                   + ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "") + ")")
            for e in entries:
                if e != MARKER:
                    p = out / e
                    shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    out.mkdir(parents=True, exist_ok=True)
    _write_marker(out, {"created": names})


def _write_marker(out: Path, record: dict) -> None:
    tmp = out / (MARKER + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, out / MARKER)


def _losses(log: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in (json.loads(x) for x in log.read_text().splitlines() if x.strip())}


def run_demo(out: Path, *, steps: int = 6, progress: Any = None) -> int:
    """The demo into ``out``, which must be new, empty or an earlier demo's (`claim_output`).

    The transcript (each stage's heading and report) goes to stdout. ``progress`` (the command
    line's, `reshard.render.progress.Progress`) shows on a terminal a line per training step
    and, between lines, the seconds since the last one (`Progress.waiting`: starting 4 ranks
    takes seconds before the first step), so a terminal never stays still for more than a
    second or two; on a pipe it shows nothing."""
    out = Path(out)
    k = max(1, steps // 2)
    names = ["run4", "run4.jsonl", "run2.jsonl", f"step_{k}-dp2", "rehearsal"]
    claim_output(out, names)
    shown = progress is not None and progress.enabled
    try:
        return _run(out, steps, k, progress.say if shown else None, progress if shown else None)
    finally:  # what the demo wrote, file by file: a rerun deletes exactly that
        _write_marker(out, {"created": names, "files": _walk(out, names)})


def _run(out: Path, steps: int, k: int, say: Callable[[str], None] | None, progress: Any) -> int:
    """The six stages. Each stretch with nothing on stdout runs inside ``waiting(progress)``, and
    none prints on stdout inside it (the waiting row is cleared first, at the block's end)."""
    def stage(msg: str) -> None:  # before the heavy imports below: the first stage shows at once
        typer.echo(f"\n=== {msg}")

    stage(f"[1/6] reference GPT on 4 CPU ranks (FSDP2 over gloo), {steps} steps, checkpoint at step {k}")
    if say is not None:  # the imports below and the ranks' start take seconds before the first step line
        say("  4 ranks   starting (torch, the process group, the model) …")
    with waiting(progress):
        from reshard.engine.conversion import convert
        from reshard.rehearsal.follow import follow_steps
        from reshard.planning.describe import inspect_checkpoint
        from reshard.model.plan import Options
        from reshard.planning.plan import make_plan
        from reshard.reference import TrainConfig, run_reference
        from reshard.render.report import render_convert, render_inspect, render_plan
        from reshard.render.verify import render_verify
        from reshard.verification.checkpoints import verify_checkpoints

    base = TrainConfig(dp=4, steps=steps, total_steps=steps, save_at=[k], micro_batch=2, grad_accum=2, dropout=0.0,
                       out=str(out / "run4"), log=str(out / "run4.jsonl"), experiment_id="demo")
    with waiting(progress), follow_steps(out / "run4.jsonl", "4 ranks", steps, say):
        ckpt = run_reference(base)[-1]

    stage(f"[2/6] reshard inspect {ckpt}")
    with waiting(progress):
        inspected = inspect_checkpoint(ckpt).report
    typer.echo(render_inspect(inspected))

    stage("[3/6] reshard plan --to dp=2 (dry run)")
    with waiting(progress):
        plan = make_plan(ckpt, Options(to="dp=2"))
    typer.echo(render_plan(plan.to_dict(tensors=False)))
    if not plan.feasible:
        return 1

    dst = out / f"step_{k}-dp2"
    stage(f"[4/6] reshard convert -> {dst}, then reshard verify")
    with waiting(progress):
        report = convert(plan, ckpt, dst)
    typer.echo(render_convert(report))
    with waiting(progress):
        v = verify_checkpoints(ckpt, dst, expected_rewrites={a.key: a.action for a in plan.keys
                                                             if a.action in EXPECTED_DIFFERENCES})
    typer.echo(render_verify(v))

    stage(f"[5/6] resume on 2 ranks with accumulation {plan.batch.after.grad_accum} to step {steps}")
    resumed = TrainConfig(dp=2, steps=steps, total_steps=steps, micro_batch=plan.batch.after.micro_batch,
                          grad_accum=plan.batch.after.grad_accum, dropout=0.0, resume=str(dst),
                          log=str(out / "run2.jsonl"), experiment_id="demo")
    if say is not None:
        say("  2 ranks   starting …")
    with waiting(progress), follow_steps(out / "run2.jsonl", "2 ranks", steps, say):
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

    stage("[6/6] reshard rehearse --from dp=4 --to dp=2: baseline vs converted resume vs naive control")
    from reshard.rehearsal import rehearse, render_rehearsal

    with waiting(progress):
        reh = rehearse(from_spec="dp=4", to_spec="dp=2", steps=12, switch_at=4, window=8, out=out / "rehearsal",
                       say=say)
    typer.echo(render_rehearsal(reh))
    typer.echo(f"figure: {out / 'rehearsal' / 'rehearsal.png'} (loss and grad norm of baseline, resumed run and "
               "control with the switch marked; the control's repeated samples)")
    return 0 if v["equal"] and reh["exit_code"] == 0 else 1
