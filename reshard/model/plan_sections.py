"""The sections of a `reshard.model.plan.Plan`, typed: what each holds, without the model importing the
layers that decide them.

Why Protocols for the decisions: the batch recipe, schedule, data position and RNG are decided
by `reshard.semantics` (`batch.BatchDecision`, `schedule.ScheduleDecision`, `data.DataDecision`,
`rng.RngDecision`), a layer above the model, which the model may not import even for its types
(`tests/test_architecture.py` counts every import). The Protocols below name exactly what the
layers that read a plan use of each decision, and the semantics dataclasses satisfy them as
they are. The JSON sections whose keys are known are `TypedDict`s: a dict at run time, so
``Plan.to_dict()`` and the fingerprint are unchanged byte for byte.
"""
from __future__ import annotations

from typing import Literal, NotRequired, Protocol, TypedDict

from reshard.model.json_types import Json, JsonDict


# ---------------------------------------------------------------------------- decisions (semantics)

class RecipeView(Protocol):
    """A batch recipe (`reshard.semantics.batch.Recipe`)."""

    micro_batch: int
    grad_accum: int
    dp: int

    @property
    def global_batch(self) -> int: ...


class BatchSection(Protocol):
    """The batch decision (`reshard.semantics.batch.BatchDecision`)."""

    before: RecipeView | None
    after: RecipeView | None
    kept: bool | None
    feasible: bool
    note: str

    def to_dict(self) -> JsonDict: ...


class ScheduleSection(Protocol):
    """The LR schedule's position on the target (`reshard.semantics.schedule.ScheduleDecision`)."""

    policy: str
    position_before: int | None
    position_after: int | None
    note: str

    def to_dict(self) -> JsonDict: ...


class DataSection(Protocol):
    """Where each target rank's data loader resumes (`reshard.semantics.data.DataDecision`)."""

    kind: str
    policy: str
    cursor_before: int | None
    cursor_after: int | None
    continuity: bool
    note: str
    rewritten: dict[str, str]
    dropped: dict[str, str]

    def to_dict(self) -> JsonDict: ...


class RngSection(Protocol):
    """Each target rank's RNG streams (`reshard.semantics.rng.RngDecision`)."""

    policy: str
    seed: int | None
    note: str
    rewritten: dict[str, str]
    dropped: dict[str, str]

    @property
    def streams_kept(self) -> bool: ...

    def to_dict(self) -> JsonDict: ...


# ---------------------------------------------------------------------------- JSON sections

class SourceSummary(TypedDict):
    """``plan.source``: what the plan read from its source (fingerprinted, so its content must not drift)."""

    path: str
    topology: JsonDict
    step: int | float | None
    tokens_seen: int | float | None
    experiment_id: str | None
    convention: str
    entries: int
    bytes: int
    manifest: bool
    sidecars: NotRequired[list[JsonDict]]  # only when there are sidecars: other plans keep their fingerprints


class AccumulationSection(TypedDict):
    """``plan.accumulation``: whether the source was saved at an optimizer-step boundary."""

    micro_step: int | None
    in_flight_grads: bool | None
    ok: bool
    note: str


class RankMemory(TypedDict):
    """Bytes one target rank holds, by what they are."""

    rank: int
    parameters: int
    gradients: int
    optimizer: int
    other: int
    total: int


class MemorySection(TypedDict):
    """``plan.memory``: bytes each target rank holds (`reshard.planning.decisions.memory`)."""

    per_rank: list[RankMemory]
    max: int
    min: int
    note: str


class KeptFacet(TypedDict):
    """One part of the training state in the verdict: carried, rewritten, lost, absent (or sliced), and why."""

    status: str
    note: str


VerdictKind = Literal["continuation", "continuation_with_changes", "warm_start", "infeasible"]


class Verdict(TypedDict):
    """``plan.verdict`` (`reshard.planning.decisions.plan_verdict`)."""

    kind: VerdictKind
    warm_start_reasons: list[str]
    changes: list[str]
    kept: NotRequired[dict[str, KeptFacet]]
    warm_start_of: NotRequired[list[str]]


NewValues = dict[str, object]
"""Key -> the value a rewrite writes (an object, a tensor, a plain value): not JSON, not in the plan's JSON."""

__all__ = ["AccumulationSection", "BatchSection", "DataSection", "Json", "JsonDict", "KeptFacet", "MemorySection",
           "NewValues", "RankMemory", "RecipeView", "RngSection", "ScheduleSection", "SourceSummary", "Verdict",
           "VerdictKind"]
