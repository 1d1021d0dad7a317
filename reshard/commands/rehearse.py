"""`reshard rehearse`: a topology transition rehearsed for real, on your trainer or the reference one.

The rehearsal itself is `reshard.rehearsal` (the runs: `reshard.rehearsal.rehearse`; their
comparison and verdict: `reshard.rehearsal.judge`). This command hands it the values the
command line parsed and a line per phase and per optimizer step for the terminal, and
returns its report (what ``rehearsal.json`` holds), whose ``exit_code`` is the command's.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from reshard.rehearsal import rehearse as run_rehearsal
from reshard.render.progress import waiting


def rehearse(*, from_spec: str, to: str, trainer: str | None, steps: int, switch_at: int, window: int,
             micro_batch: int | None, grad_accum: int | None, source_micro_batch: int | None,
             source_grad_accum: int | None, control: str | None, dataset_len: int | None, seed: int,
             reuse_baseline: Path | None, like: Path | None, out: Path, timeout: float | None,
             progress: Any = None) -> dict[str, Any]:
    """Rehearse ``from_spec -> to`` into ``out`` (`reshard.rehearsal.rehearse.rehearse`) and return the report.

    ``progress``: a `reshard.render.progress.Progress` (or None); when it is shown, the
    rehearsal's progress lines go to it, else nowhere.
    """
    say = progress.say if progress is not None and progress.enabled else None
    with waiting(progress):  # between step lines (a run's start, the conversion), seconds on a terminal's waiting row
        return run_rehearsal(from_spec=from_spec, to_spec=to, trainer=trainer, steps=steps, switch_at=switch_at,
                             window=window, micro_batch=micro_batch, grad_accum=grad_accum,
                             source_micro_batch=source_micro_batch, source_grad_accum=source_grad_accum,
                             control=control, dataset_len=dataset_len, seed=seed, reuse_baseline=reuse_baseline,
                             like=like, out=out, timeout=timeout, say=say)
