"""What `inspect` found in a checkpoint, as plain data passed from describing to planning and verifying.

Made by `reshard.planning.describe.inspect_checkpoint`; the planner and `verify` take it
instead of reading the source twice. The planner reads the typed fields (``complete``,
``findings``, ``step``, ``optimizer``, ``sidecars``, ...) and the manifest object, never the
``report`` dict: the report is what `inspect` prints, and a key renamed there for the reader's
sake must not change a plan. The opened reader, the key classification and the manifest are
typed by Protocols (`reshard.model.reader.CheckpointReader`, `KeyClassification`, `ManifestView`)
because the classes that make them live in the layers above, which the model may not import.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence, TypedDict

from reshard.model import topology as topo_mod
from reshard.model.checkpoint import Finding
from reshard.model.json_types import Json, JsonDict
from reshard.model.reader import CheckpointReader


JSON_VERSION = 1


class KeyRoleView(Protocol):
    """One key's role (`reshard.semantics.conventions.KeyRole`)."""

    key: str
    role: str
    param: str | None
    rank: int | None


class ConventionView(Protocol):
    """A key convention (`reshard.semantics.conventions.Convention`), as far as a plan reads it."""

    name: str

    @property
    def stores_replicas(self) -> bool: ...


class KeyClassification(Protocol):
    """Every key's role (`reshard.semantics.conventions.Classification`)."""

    convention: ConventionView
    roles: Mapping[str, KeyRoleView]

    @property
    def unknown(self) -> list[str]: ...

    def ranked(self, role: str) -> Mapping[int, Sequence[KeyRoleView]]: ...


class ManifestView(Protocol):
    """The manifest beside ``.metadata`` (`reshard.semantics.manifest.Manifest`)."""

    step: int | None
    tokens_seen: int | None
    integrity: dict | None

    @property
    def lineage(self) -> Sequence[object]: ...

    def to_dict(self) -> JsonDict: ...


class OptimizerHealth(TypedDict):
    """The report's ``optimizer`` section: which moments the optimizer keeps, for how many parameters."""

    moment_names: list[str]
    parameters: int
    with_moments: int
    step_counters: Json
    fused: list[JsonDict]
    tied: list[JsonDict]
    buffers: JsonDict
    moment_sets: list[JsonDict]
    missing_moments: list[str]
    shape_mismatches: list[str]


def _no_optimizer() -> OptimizerHealth:
    return {"moment_names": [], "parameters": 0, "with_moments": 0, "step_counters": None, "fused": [], "tied": [],
            "buffers": {}, "moment_sets": [], "missing_moments": [], "shape_mismatches": []}


@dataclass
class Inspection:
    index: CheckpointReader  # the opened source (DCP, torch's safetensors DCP, an export, reshard's local format)
    classification: KeyClassification  # every key's role
    manifest: ManifestView | None
    topology: topo_mod.Topology
    report: JsonDict  # what `inspect` prints (`--json`): for people and tools, not read back by the planner
    as_found: bool = False
    """Described from the checkpoint alone (no ``--from``, ``--convention``, ``--tie``, ``--deep``):
    any later step of the same run that would inspect the same source takes this one instead."""
    # What the planner reads, typed (the same values the report prints):
    path: str = ""  # where the checkpoint is, as shown (a store URL for a remote one)
    complete: bool = True  # every byte range present: no finding is an error
    findings: list[Finding] = field(default_factory=list)  # every problem and note, in the report's order
    step: int | float | None = None  # the global step, from the manifest, a counter, the folder or the optimizer
    tokens_seen: int | float | None = None
    experiment_id: str | None = None
    batch: JsonDict | None = None  # the manifest's batch recipe
    accumulation: JsonDict | None = None  # the manifest's accumulation phase
    entries: int = 0  # flat keys
    bytes: int = 0  # bytes of the data files
    has_manifest: bool = False
    optimizer: OptimizerHealth = field(default_factory=_no_optimizer)
    sidecars: list[JsonDict] = field(default_factory=list)  # the other files of the directory (`reshard.storage.checkpoints.sidecars`)

    @property
    def errors(self) -> list[Finding]:
        """The findings that make the checkpoint incomplete."""
        return [f for f in self.findings if f.severity == "error"]

    @property
    def exit_code(self) -> int:
        return int(self.report["exit_code"])
