"""Pipeline stages read from what a checkpoint holds: which writer ranks saved which model units.

A pipeline-parallel run (torchtitan's ``pipeline_llm``, 1F1B or any single-stage schedule) gives
each rank group a contiguous run of the model: the first stage ``tok_embeddings`` and the first
layers, the last the last layers, ``norm`` and ``lm_head``. Each stage saves only its own
parameters and their optimizer moments (torchtitan's ``ModelWrapper`` merges the stages' state
dicts on each rank; ``OptimizersContainer`` flattens by parameter name), so the stages' keys are
disjoint. The chunks alone look like data-parallel replicas (every tensor whole, written by one
rank: DCP's deduplication of a replicated tensor also leaves one writer), which is why this
module reads the names too.

What tells stages from replicas: DCP spreads a replicated tensor over the ranks that hold it by
load (a layer's parameters and a parameter's moments end up on different ranks), while a stage
holds whole layers. So the writers are read as ``pp`` stages when, with ranks ordered as
torchtitan's mesh orders them (``pp`` outermost: stage ``s`` is ranks ``s*W .. s*W+W-1`` for the
``W = dp_shard x tp`` ranks of a stage), every model unit (``layers.<N>``, or a top-level module
such as ``tok_embeddings``) lies in exactly one stage, every moment in its parameter's stage,
every stage holds a unit, and the layer indices rise with the stage. Anything else is not a
pipeline, and the caller keeps its reading. Names and writer ranks only: no tensor byte.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from reshard.model.topology import Topology

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def unit_of(fqn: str) -> str:
    """The model unit a parameter belongs to: ``layers.<N>`` (its transformer block) or its top-level module."""
    m = LAYER.search(fqn)
    return f"layers.{m.group(1)}" if m else fqn.split(".", 1)[0]


@dataclass(frozen=True)
class StageReading:
    """The stages the writers show: per stage (in order) its ranks and the model units it holds."""

    pp: int
    ranks_per_stage: int
    units: tuple[tuple[str, ...], ...]
    evidence: tuple[str, ...] = field(default=())

    def describe(self) -> str:
        parts = []
        for s, units in enumerate(self.units):
            lo = s * self.ranks_per_stage
            ranks = f"rank {lo}" if self.ranks_per_stage == 1 else f"ranks {lo}-{lo + self.ranks_per_stage - 1}"
            parts.append(f"stage {s} ({ranks}): {_units_text(units)}")
        return "; ".join(parts)


def _units_text(units: tuple[str, ...]) -> str:
    layers = sorted(int(u.split(".")[1]) for u in units if u.startswith("layers."))
    others = [u for u in units if not u.startswith("layers.")]
    span = ([f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}"] if layers else [])
    return ", ".join(others[:1] + span + others[1:])


def read_stages(params: Mapping[str, Iterable[int]], moments: Mapping[str, Iterable[int]], *, world: int,
                ranks_per_stage: int) -> StageReading | None:
    """The pipeline stages shown by who wrote which parameter (``params``: name -> writer ranks of its
    chunks) and which moment (``moments``: parameter name -> writer ranks of its moments' chunks), or
    None when they do not show stages (see the module docstring).

    ``world``: the writer ranks; ``ranks_per_stage``: the shards a stage's tensors show (dp_shard x tp).
    """
    if ranks_per_stage < 1 or world % ranks_per_stage or world // ranks_per_stage < 2:
        return None
    pp = world // ranks_per_stage
    stage_of_unit: dict[str, int] = {}
    stage_of_param: dict[str, int] = {}
    for name, writers in params.items():
        stages = {w // ranks_per_stage for w in writers if w >= 0}
        if len(stages) != 1:
            return None  # written by ranks of two stages, or by no known rank: not a stage's own tensor
        s = stages.pop()
        unit = unit_of(name)
        if stage_of_unit.setdefault(unit, s) != s:
            return None  # one layer over two stages: DCP's load balancing of replicas, not a pipeline
        stage_of_param[name] = s
    for name, writers in moments.items():
        stages = {w // ranks_per_stage for w in writers if w >= 0}
        expect = stage_of_param.get(name, stage_of_unit.get(unit_of(name)))
        if len(stages) != 1 or expect is None or stages.pop() != expect:
            return None  # a moment away from its parameter's stage
    held = [sorted(u for u, s in stage_of_unit.items() if s == stage) for stage in range(pp)]
    if any(not units for units in held):
        return None
    layer_ranges = [[int(u.split(".")[1]) for u in units if u.startswith("layers.")] for units in held]
    previous = -1
    for indices in layer_ranges:
        if not indices:
            continue
        if min(indices) <= previous:
            return None  # layers do not rise with the stage
        previous = max(indices)
    if not any(layer_ranges):
        return None
    reading = StageReading(pp, ranks_per_stage, tuple(tuple(u) for u in held))
    return StageReading(pp, ranks_per_stage, reading.units, (
        f"{len(params)} parameters and their optimizer moments fall into {pp} disjoint stages of "
        f"{ranks_per_stage} rank(s), whole layers each, in layer order (pipeline parallel, not replicas): "
        + reading.describe(),))


def as_topology(reading: StageReading, inferred: Topology) -> Topology:
    """The inferred layout with its extra writers read as the stages (``pp``) instead of replicas."""
    dp_shard = inferred.dp_shard if inferred.dp_shard * inferred.tp == reading.ranks_per_stage else \
        max(1, reading.ranks_per_stage // max(1, inferred.tp))
    kept = tuple(e for e in inferred.evidence if "replicas" not in e)
    return Topology(pp=reading.pp, dp_shard=dp_shard, tp=inferred.tp, source="inferred",
                    evidence=kept + reading.evidence)
