"""What the LR schedule position means after a batch-recipe change.

`LRScheduler.state_dict()` is its `__dict__`: `last_epoch` counts optimizer steps. With the
global batch kept, a step means the same amount of data and the position carries
unchanged. When it changes, the user chooses: `steps` keeps the position in optimizer
steps (the schedule now spans a different number of samples), `tokens` moves the position
so that the samples already consumed map to the same point of the schedule.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from reshard.errors import BadInput
from reshard.model.kinds import SCHEDULE_POLICIES


@dataclass
class ScheduleDecision:
    policy: str  # "unchanged" | "steps" | "tokens" | "unknown"
    position_before: int | None
    position_after: int | None
    rewrites: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # key -> (old, new)
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "position_before": self.position_before, "position_after": self.position_after,
                "rewrites": {k: {"old": o, "new": n} for k, (o, n) in self.rewrites.items()}, "note": self.note}


def decide(*, batch_kept: bool | None, policy: str | None, step: int | None, samples_seen: int | None,
           new_global_batch: int | None, position_keys: dict[str, Any]) -> ScheduleDecision:
    """``position_keys``: scheduler keys that hold the position (`last_epoch`, `_step_count`) and their values."""
    pos = None
    for k, v in position_keys.items():
        if k.endswith("last_epoch"):
            pos = int(v)
    if batch_kept is None and policy is None:
        return ScheduleDecision("unknown", pos, pos, note="the source's batch recipe is not recorded, so the schedule "
                                "position is kept as saved")
    if batch_kept:
        return ScheduleDecision("unchanged", pos, pos, note="global batch kept: the schedule position means the same")
    if policy is None:
        raise BadInput("the global batch changes, so the LR schedule position changes meaning",
                       hint="Choose --schedule steps (keep the step position) or --schedule tokens "
                       "(move the position so consumed data maps to the same point).")
    if policy not in SCHEDULE_POLICIES:
        raise BadInput(f"unknown --schedule '{policy}'", hint="Use steps or tokens.")
    if policy == "steps":
        return ScheduleDecision("steps", pos, pos, note="position kept in optimizer steps; each step now consumes a different number of samples")
    if samples_seen is None or not new_global_batch:
        raise BadInput("--schedule tokens needs the samples (or tokens) seen, which this checkpoint does not record",
                       hint="Use --schedule steps, pass --source-seq-len N when the checkpoint counts tokens_seen, or use a checkpoint with a manifest.")
    new_pos = samples_seen // new_global_batch
    rewrites = {}
    for k, v in position_keys.items():
        if k.endswith("last_epoch"):
            rewrites[k] = (v, new_pos)
        elif k.endswith("_step_count"):
            rewrites[k] = (v, new_pos + 1)
    return ScheduleDecision("tokens", pos, new_pos, rewrites,
                            note=f"{samples_seen} samples seen / new global batch {new_global_batch} = schedule position {new_pos}")
