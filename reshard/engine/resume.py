"""Resume: when a rerun may keep what an interrupted conversion already wrote.

A killed conversion leaves its hidden output directory and a journal of the items it wrote
and checked (`reshard.storage.journal`, which knows files and CRCs and nothing of plans). A
rerun keeps those items only when it would write the same bytes: the same plan (its
fingerprint), the same source files as they are on disk now, and the same writer (output
format, reshard and torch versions). That triple is the resume key, made here for the single
process (`reshard.engine.conversion`) and the torchrun workers (`reshard.engine.distributed`) alike.
"""
from __future__ import annotations

from pathlib import Path

import torch

from reshard.model.plan import Plan
from reshard.storage.journal import ResumeKey, source_identity


def resume_key(plan: Plan, src: Path, output_format: str = "dcp") -> ResumeKey:
    """What a rerun must share with an interrupted conversion to keep its bytes (`reshard.storage.journal`):
    the plan, the source files as they are on disk, and what else decides the bytes written."""
    from reshard import __version__

    return ResumeKey(plan=plan.fingerprint(), source=source_identity(src),
                     options={"output_format": output_format, "reshard": __version__, "torch": torch.__version__})
