"""`reshard inspect`: is a checkpoint complete, what does it hold, and which topology wrote it.

The description itself is `reshard.planning.describe` (the planner and `verify` start from
the same `Inspection`); this command adds what only the command line asks for: ``--deep``
reads every item under a progress bar, and the profile that completed the options is named
in the report.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from reshard.model.inspection import Inspection
from reshard.model.plan import Options
from reshard.planning.describe import inspect_checkpoint
from reshard.planning.options import from_origin, user_conventions
from reshard.render.progress import waiting
from reshard.storage.source import Source


def inspect(source: Source | Path, opts: Options, *, deep: bool = False, progress: Any = None) -> Inspection:
    """The inspection of ``ckpt`` under the user's options (conventions, ties, ``--from``); its
    ``report`` is what `reshard.render.report.render_inspect` prints and its ``exit_code`` the command's.
    ``source``: as `reshard.storage.source.opened` made it (a store read through its own handle)."""
    source = Source.of(source)
    with contextlib.ExitStack() as stack:
        stack.enter_context(waiting(progress))  # the index, the object items: seconds with no bytes to count
        bar = None
        if deep and progress is not None:
            from reshard.storage.checkpoints.local_format import open_any  # whichever format inspect reads

            bar = stack.enter_context(progress.phase(
                "checking items", sum(e.nbytes for e in open_any(source.root, remote=source.remote).entries.values())))
        result = inspect_checkpoint(source, deep=deep, from_spec=opts.from_spec, trust_pickle=opts.trust_pickle,
                                    progress=bar, conventions=user_conventions(opts), ties=opts.ties,
                                    from_origin=from_origin(opts))
    if opts.profile is not None:
        result.report["profile"] = opts.profile
    return result
