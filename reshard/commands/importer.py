"""`reshard import`: consolidated weights (safetensors, torch.save, a Hugging Face model directory)
as a DCP checkpoint for a layout, a warm start of a new run.

The sources are read by `reshard.engine.import_sources` and the run that lays them out,
writes, reads back and commits is `reshard.engine.importing.import_checkpoint`; this command
is what the command line calls with its options parsed (``--format`` already checked against
the known names by `reshard.arguments.check_import`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from reshard.engine.importing import import_checkpoint


def import_(src: Path, dst: Path, *, to: str, rename: Path | None, fmt: str, experiment_id: str | None,
            overwrite: bool, force: bool, progress: Any = None) -> dict[str, Any]:
    """Import ``src`` into ``dst`` for the layout ``to``; returns the import report."""
    return import_checkpoint(src, dst, to=to, rename=rename, overwrite=overwrite, experiment_id=experiment_id, fmt=fmt,
                             progress=progress, force=force)
