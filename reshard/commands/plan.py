"""`reshard plan`: the dry run. What a conversion to ``--to`` would do, and whether the run stays the same run.

The plan is `reshard.planning.plan.make_plan` (the same function `convert` executes and
`verify` recomputes); this command adds what only the dry run shows: the full tensor table
streamed to a file (``--tensors-out``) and, given the destination, whether the output fits
there and how long it would take (`reshard.engine.space.space_check`, the figures `convert`
checks again before writing).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from reshard.gc_pause import paused_gc
from reshard.model.plan import Options, Plan
from reshard.planning.plan import make_plan, plan_reader
from reshard.render.progress import waiting
from reshard.storage.source import Source


def plan(source: Source | Path, opts: Options, *, dst: Path | str | None = None, tensors_out: Path | str | None = None,
         progress: Any = None) -> Plan:
    """The plan, with what only the dry run adds: every tensor's placement written to
    ``tensors_out`` (``Plan.tensors_file``) and the space and time figures for ``dst``
    (``Plan.space``). ``progress``: its waiting row ticks on a terminal while the plan is made.
    ``source``: as `reshard.storage.source.opened` made it; the space check reads through the plan's reader.
    The returned plan holds no inspection (``Plan.inspection`` is None): see the end of the body."""
    source = Source.of(source)
    with waiting(progress):
        p = make_plan(source, opts)
    if tensors_out is not None:
        p.tensors_file = {"path": str(tensors_out), "tensors": p.write_tensors(Path(tensors_out))}
    if dst is not None:
        from reshard.engine.space import space_check

        p.space = space_check(p, dst, index=plan_reader(p, source), probe=True)  # the figures convert checks and reports (size, free, time)
    # The dry run ends here: nothing reads through the inspection after it (a conversion plans its
    # source again), and its index is most of the plan's memory (180k keys: ~190 MiB of 230), so it is
    # let go before the plan is rendered rather than held through the rendering's dict and text.
    p.inspection = source.inspection = None
    return p


@paused_gc()  # a dict per key (102k at 180k storage entries), none in a cycle: reshard.gc_pause
def report(p: Plan, *, verbose: bool = False, json_out: bool = False) -> dict[str, Any]:
    """What ``reshard plan`` prints of a plan: every tensor when ``verbose``, under ``--json`` the
    full table up to `reshard.model.plan.FULL_TABLE_ROWS` rows, else none (`Plan.to_dict`), then
    the tensors file and the space figures where the plan has them."""
    d = p.to_dict(tensors=True if verbose else "auto" if json_out else False)
    if p.tensors_file is not None:
        d["tensors_file"] = p.tensors_file
    if p.space is not None:
        d["space"] = p.space
    return d
