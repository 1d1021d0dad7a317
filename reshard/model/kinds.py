"""The vocabularies every layer shares, declared once: what a plan does with a key, and the
choices a user may name on the command line.

They sit at the bottom, in the base layer of docs/architecture.md although the file lives
under ``model/`` (no torch, no other module of reshard, so the renderers may compare too) so that the argument checks,
which run before any heavy import, the planner, the engine and the renderers all compare
against the same values: a kind is a member here, never a string spelled again elsewhere
(`tests/test_typed_seams.py` reads the code for string comparisons of an action). Each enum
is a `StrEnum`, so its members are the strings that plans, reports and lineages have always
written: JSON, fingerprints and reports are unchanged.
"""
from __future__ import annotations

from enum import StrEnum
from typing import Literal, get_args


class Action(StrEnum):
    """What a plan does with one source key (`reshard.model.plan.KeyAction.action`)."""

    RESHARDED = "resharded"  # a tensor re-cut into the target's chunks
    CARRIED = "carried"      # written unchanged (an object, a replicated tensor, a per-rank state)
    REWRITTEN = "rewritten"  # a new value written in its place (a reseeded RNG, a translated loader state)
    DROPPED = "dropped"      # left out of the output, by a named policy
    ADDED = "added"          # a key the source lacks, written by the plan
    # a slice's renumbered layer (`reshard.planning.slice`): the source key's values leave its name for
    # the slice's (``KeyAction.renamed_to``), and the slice's key takes them (``renamed_from``); one word
    # for both sides of the one fact, in the plan's JSON as in its text, the report and verify
    RENAMED = "renamed"


EXPECTED_DIFFERENCES = (Action.REWRITTEN, Action.DROPPED, Action.ADDED, Action.RENAMED)
"""The actions whose key differs from the source on purpose: verification excuses exactly these."""

NEW_VALUE_ACTIONS = (Action.REWRITTEN, Action.ADDED)
"""The actions that write a value the plan made (``Plan.new_values``), not the source's bytes."""


class ExportAction(StrEnum):
    """What `export` does with one source key (`reshard.planning.export.key_actions`)."""

    EXPORTED = "exported"    # written under its exported name
    TIED_COPY = "tied_copy"  # a tied copy of a parameter already exported: not written twice
    DROPPED = "dropped"      # trainer state or, with ``--only model``, the optimizer: not exported


Severity = Literal["error", "inconsistent", "warning", "info"]
"""How bad a finding is (`reshard.model.checkpoint.Finding`): an error makes a checkpoint incomplete
(exit 2), an inconsistency inconsistent (exit 1); a warning and a note change no exit code."""

EntryKind = Literal["tensor", "object"]
"""What one flat key of a checkpoint holds (`reshard.model.checkpoint.Entry.kind`)."""


class SliceFate(StrEnum):
    """What a slice of layers or experts does with one key (`reshard.semantics.slicing.Fate.kind`)."""

    OUTSIDE = "outside"  # the key belongs to no sliced layer or expert: kept as it is
    KEPT = "kept"        # inside the slice, under the same name
    RENAMED = "renamed"  # inside the slice, renumbered
    DROPPED = "dropped"  # outside the slice: left out of the output


class OutputFormat(StrEnum):
    """``convert --output-format``: a DCP checkpoint, or one safetensors file per target rank."""

    DCP = "dcp"
    LOCAL = "local"


class DataMode(StrEnum):
    """``convert --data``: write every byte new, or share the source's data files."""

    COPY = "copy"
    LINK = "link"


SchedulePolicy = Literal["steps", "tokens"]
SCHEDULE_POLICIES: tuple[str, ...] = get_args(SchedulePolicy)  # the one spelling is the Literal's
"""``--schedule``: what the LR schedule counts when the global batch changes (`reshard.semantics.schedule`)."""

DataPolicy = Literal["translate", "restart-epoch", "drop"]
DATA_POLICIES: tuple[str, ...] = get_args(DataPolicy)  # the one spelling is the Literal's
"""``--data-policy``: what becomes of per-rank data-loader state (`reshard.semantics.data`)."""

RngPolicy = Literal["carry", "reseed", "drop"]
RNG_POLICIES: tuple[str, ...] = get_args(RngPolicy)  # the one spelling is the Literal's
"""``--rng-policy``: RNG state carried, reseeded per rank, or dropped (`reshard.semantics.rng`)."""

DTypeName = Literal["bf16", "fp16", "fp32", "bfloat16", "float16", "float32"]
DTYPES: tuple[str, ...] = get_args(DTypeName)
"""``--dtype``: the floating types a reduced copy may be cast to."""

Only = Literal["model", "model+optim"]
ONLY: tuple[str, ...] = get_args(Only)
"""``--only``: what a reduced copy keeps."""

ExportFormat = Literal["safetensors", "torch", "hf"]
EXPORT_FORMATS: tuple[str, ...] = get_args(ExportFormat)
"""``export --format``."""

Control = Literal["relaunch", "naive-state", "none"]
CONTROLS: tuple[str, ...] = get_args(Control)
"""``rehearse --control``: the run a rehearsal's converted run is compared with."""

ProgressMode = Literal["auto", "json", "none"]
PROGRESS_MODES: tuple[str, ...] = get_args(ProgressMode)
"""``--progress``."""
