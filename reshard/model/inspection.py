"""What `inspect` found in a checkpoint, as plain data passed from describing to planning and verifying.

Made by `reshard.planning.describe.inspect_checkpoint`; the planner and `verify` take it
instead of reading the source twice.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from reshard.model import topology as topo_mod


JSON_VERSION = 1


@dataclass
class Inspection:
    index: Any  # reshard.storage.index.CheckpointIndex: the opened source
    classification: Any  # reshard.semantics.conventions.Classification: every key's role
    manifest: Any  # reshard.semantics.manifest.Manifest | None
    topology: topo_mod.Topology
    report: dict[str, Any]
    as_found: bool = False
    """Described from the checkpoint alone (no ``--from``, ``--convention``, ``--tie``, ``--deep``):
    any later step of the same run that would inspect the same source takes this one instead."""

    @property
    def exit_code(self) -> int:
        return int(self.report["exit_code"])
