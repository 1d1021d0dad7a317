"""A plan as plain data: what happens to every source key, which boxes every target rank owns, and
the decisions on trainer state, with a fingerprint of everything the executor acts on.

The planner (`reshard.planning.plan`) makes one; `reshard plan` prints it, the engine executes
it, `verify` recomputes it from a lineage entry. It lives here, at the bottom, because every
layer above passes it around. The decisions on trainer state (batch, schedule, data, RNG) are
`reshard.semantics` objects, typed by the Protocols of `reshard.model.plan_sections` (the model
may not import the layer that makes them); the JSON sections are `TypedDict`s there, or `JsonDict`
where a section's keys are open.
"""
from __future__ import annotations

import hashlib
import json
from json.encoder import encode_basestring_ascii
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reshard.version import __version__
from reshard.model.inspection import Inspection
from reshard.model.json_types import JsonDict
from reshard.model.kinds import Action
from reshard.model.plan_sections import (AccumulationSection, BatchSection, DataSection, MemorySection, NewValues,
                                         RngSection, ScheduleSection, SourceSummary, Verdict)
from reshard.model.layout import Placement
from reshard.model.topology import Topology


PLAN_VERSION = 1


SHARDED_ROLES = ("parameter", "optimizer_moment")


@dataclass
class Options:
    """Everything the user chose; a plan is a pure function of (source, options)."""

    to: str
    from_spec: str | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    # The source's batch recipe, for a source whose manifest does not say it (`_source_recipe`).
    source_micro_batch: int | None = None
    source_grad_accum: int | None = None
    source_seq_len: int | None = None
    schedule: str | None = None
    data_policy: str | None = None
    rng_policy: str | None = None
    seed: int | None = None
    trust_pickle: bool = False
    rules: str | None = None
    model_config: JsonDict | None = None
    pp_stages: str | None = None
    dtype: str | None = None  # reduced copies: cast floating tensors (bf16, fp16, fp32)
    only: str | None = None   # reduced copies: "model" or "model+optim" (default: everything)
    # --convention FILE: the user's key conventions, each {"file", "name", "sha256"} (the hash pins
    # the bytes the plan read the keys with, so a recomputed plan reads them the same way or is refused)
    conventions: list[dict[str, str]] | None = None
    keep: list[str] | None = None  # --keep PATTERN: unknown keys carried unchanged (role "other")
    drop: list[str] | None = None  # --drop PATTERN: unknown keys left out of the output
    key_reasons: dict[str, str] | None = None  # keep/drop pattern -> the user's reason (`--drop P=WHY`, a profile)
    source_global_batch: int | None = None  # a trainer config's global batch: the accumulation follows from the dp degree
    ties: list[list[str]] | None = None  # --tie A=B: two parameter names of one tensor (like a manifest's model.tied)
    # What a profile / a trainer config contributed: {"file", "sha256", "contributed": [option names], ...}
    profile: JsonDict | None = None
    trainer_config: JsonDict | None = None
    # A slice of the model (`reshard.semantics.slicing`): --layers 0-1 / 0,5,79, --experts RANGE
    layers: str | None = None
    experts: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The options as recorded (plan JSON, fingerprint, lineage); a slice option only when given,
        so the plans of whole-model conversions keep the fingerprints they had."""
        d = dict(self.__dict__)
        for name in SLICE_OPTIONS:
            if d.get(name) is None:
                d.pop(name, None)
        return d


SLICE_OPTIONS = ("layers", "experts")


@dataclass
class KeyAction:
    key: str
    role: str
    action: Action
    reason: str = ""
    rank: int | None = None  # target file for carried/rewritten/added objects
    # Action.RENAMED (a slice's renumbered layer): the source key whose values this key takes, and
    # the key this source key's values are written under; a key of a chain of renumberings has both
    renamed_from: str | None = None
    renamed_to: str | None = None

    @property
    def left_out(self) -> bool:
        """Nothing is written under this key: dropped, or renamed away with nothing renamed to it."""
        return self.action == Action.DROPPED or (self.action == Action.RENAMED and self.renamed_from is None)

    @property
    def new_value(self) -> bool:
        """This key is written with a value the plan made or takes from another key (``Plan.new_values``,
        ``TensorPlan.copy_from``), not its own source bytes: rewritten, added, or renamed to it."""
        return self.action in (Action.REWRITTEN, Action.ADDED) or (
            self.action == Action.RENAMED and self.renamed_from is not None)

    def to_dict(self) -> dict[str, Any]:
        d = {"key": self.key, "role": self.role, "action": self.action, "reason": self.reason}
        if self.rank is not None:
            d["rank"] = self.rank
        if self.renamed_from is not None:
            d["renamed_from"] = self.renamed_from
        if self.renamed_to is not None:
            d["renamed_to"] = self.renamed_to
        return d


@dataclass
class TensorPlan:
    key: str
    role: str
    shape: tuple[int, ...]  # target global shape
    dtype: str
    placement: Placement
    chunks: list[tuple[int, tuple[int, ...], tuple[int, ...]]]  # (writer rank, offsets, sizes)
    transform: JsonDict | None = None  # reinterleave / repad (TP-dependent global layouts)
    copy_from: str | None = None  # tied copies: the source key whose values this key takes
    local: dict[int, tuple[int, ...]] = field(default_factory=dict)  # every holding rank -> its local shape

    def to_dict(self, *, local: bool = True) -> dict[str, Any]:
        """The row of the plan's tensor table; ``local=False`` leaves out the per-rank local shapes
        (they follow from shape, placement and target, which the row and the plan hold)."""
        d = {"key": self.key, "role": self.role, "shape": list(self.shape), "dtype": self.dtype,
             "placement": self.placement.describe(),
             "chunks": [{"rank": r, "offsets": list(o), "sizes": list(s)} for r, o, s in self.chunks]}
        if self.transform:
            d["transform"] = self.transform
        if self.copy_from:
            d["copy_from"] = self.copy_from
        if self.local and local:
            d["local_shapes"] = {str(r): list(v) for r, v in self.local.items()}
            d["uneven"] = len({v for v in self.local.values()}) > 1
        return d


@dataclass
class Plan:
    source: SourceSummary
    target: Topology
    options: Options
    feasible: bool
    reasons: list[str]
    batch: BatchSection  # reshard.semantics.batch.BatchDecision
    schedule: ScheduleSection | None  # reshard.semantics.schedule.ScheduleDecision
    data: DataSection | None  # reshard.semantics.data.DataDecision
    rng: RngSection | None  # reshard.semantics.rng.RngDecision
    accumulation: AccumulationSection
    memory: MemorySection
    tensors: list[TensorPlan]
    keys: list[KeyAction]
    verdict: Verdict
    new_values: NewValues = field(default_factory=dict)  # key -> value written by a rewrite (not in JSON)
    stage_map: JsonDict | None = None
    rules: str | None = None
    checks: dict[str, str] = field(default_factory=dict)  # key -> equal-to key, checked on convert (tied copies)
    data_link: JsonDict | None = None  # convert --data link: available or why not, what each rank reads (commands.linking)
    slice: JsonDict | None = None  # --layers / --experts: what the slice keeps, renames and drops (`reshard.planning.slice`)
    experts: JsonDict | None = None  # MoE experts stacked in one tensor: which ranks hold which (`reshard.planning.experts`)
    inspection: Inspection | None = field(default=None, repr=False, compare=False)  # the source's Inspection this run made (not in JSON)
    tensors_file: JsonDict | None = field(default=None, compare=False)  # plan --tensors-out: the file every tensor was written to, and how many (not in to_dict)
    space: JsonDict | None = field(default=None, compare=False)  # plan --dst: `reshard.engine.space.space_check`'s figures for that destination (not in to_dict)

    def to_dict(self, *, tensors: bool | str = True) -> dict[str, Any]:
        """The plan as JSON data; ``tensors``: True (every tensor with its chunks), False, or
        ``"auto"``: the full table up to `FULL_TABLE_ROWS` chunk rows, else `tensor_summary`
        (one row per distinct shape and placement: a 16,384-rank plan would otherwise print
        gigabytes; ``plan --tensors-out FILE`` writes the full table, streamed)."""
        keys = key_rows(self.keys)  # once, for the JSON and the fingerprint
        d = {
            "plan_version": PLAN_VERSION,
            "tool": f"reshard {__version__}",
            "source": self.source,
            "target": self.target.to_dict(),
            "options": self.options.to_dict(),
            "feasible": self.feasible,
            "reasons": self.reasons,
            "batch": self.batch.to_dict(),
            "schedule": self.schedule.to_dict() if self.schedule else None,
            "data": self.data.to_dict() if self.data else None,
            "rng": self.rng.to_dict() if self.rng else None,
            "accumulation": self.accumulation,
            "memory": self.memory,
            "stage_map": self.stage_map,
            "rules": self.rules,
            "verdict": self.verdict,
            "keys": keys,
            "summary": _summary(self.keys),
            "fingerprint": self._fingerprint(keys),
            "data_link": self.data_link,
        }
        if self.slice is not None:
            d["slice"] = self.slice
        if self.experts is not None:
            d["experts"] = self.experts
        rows = sum(len(t.chunks) for t in self.tensors)
        if tensors == "auto" and rows > FULL_TABLE_ROWS:
            d["tensor_summary"] = tensor_summary(self.tensors)
            d["tensors_omitted"] = {"tensors": len(self.tensors), "chunk_rows": rows,
                                    "why": f"more than {FULL_TABLE_ROWS} chunk rows",
                                    "how": "reshard plan ... --tensors-out FILE writes every tensor (JSON lines)"}
        elif tensors:
            d["tensors"] = [t.to_dict() for t in self.tensors]
        return d

    def write_tensors(self, path: str | Path) -> int:
        """Every tensor's plan row as JSON lines, streamed to ``path`` (written beside it, then renamed)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "w") as f:
            for t in self.tensors:
                f.write(json.dumps(t.to_dict()) + "\n")
        tmp.replace(path)
        return len(self.tensors)

    def fingerprint(self) -> str:
        """Hash of everything the executor acts on: two equal fingerprints write the same checkpoint.

        Streamed, one tensor at a time, each as a compact row (its chunks as lists of ints): a
        16,384-rank plan has millions of chunk rows, which one JSON document of dicts would
        hold in memory at once.
        """
        return self._fingerprint(key_rows(self.keys))

    def _fingerprint(self, keys: list[dict[str, Any]]) -> str:
        """`fingerprint` given the keys' rows (`KeyAction.to_dict`), which `to_dict` has made already.

        One encoder for every row: ``json.dumps`` with options builds a `json.JSONEncoder` per
        call (102k calls at 180k keys); its ``encode`` writes the same text."""
        h = hashlib.sha256()
        encode = json.JSONEncoder(sort_keys=True, default=str).encode
        head = {"source": self.source, "target": self.target.degrees(), "keys": keys,
                "options": self.options.to_dict(), "new": sorted(self.new_values)}
        h.update(encode(head).encode())
        tails: dict[tuple, str] = {}
        text = encode_basestring_ascii  # what ``encode`` writes of a str, without its method call per key
        batch: list[str] = []  # rows hashed a few thousand at a time: one update of their joined text
        for t in self.tensors:
            # the row [key, role, shape, dtype, placement, chunks, transform, copy_from] as encode writes it:
            # a list is its items' texts joined by ", ", so the part after key and role is written once per
            # tensors placed alike (the layout's chunk tuples are shared: their ids, alive in the plan, say so)
            alike = (tuple(t.shape), t.dtype, t.placement, tuple(map(id, t.chunks)), id(t.transform), t.copy_from)
            tail = tails.get(alike)
            if tail is None:
                if len(tails) >= 4096:  # bounded: a plan whose tensors share no chunk tuples holds no table of them
                    tails.clear()
                tail = tails[alike] = encode([list(t.shape), t.dtype, t.placement.describe(), t.chunks, t.transform,
                                              t.copy_from])[1:]
            batch.append(f"[{text(t.key) if isinstance(t.key, str) else encode(t.key)}, "
                         f"{text(t.role) if isinstance(t.role, str) else encode(t.role)}, {tail}")
            if len(batch) >= 4096:
                h.update("".join(batch).encode())
                batch.clear()
        h.update("".join(batch).encode())
        return h.hexdigest()[:16]

    def source_fingerprint(self) -> str:
        """Hash of what the plan read from its source, without where the source lies.

        Recorded in the lineage entry of a conversion (`reshard.semantics.transition`) so that
        `reshard verify A B` can tell, by recomputing the plan from A, whether B claims to
        come from this A (moved or not); the claim only selects which plan to recompute, it
        excuses nothing by itself (`reshard.verification.checkpoints`).
        """
        body = {k: v for k, v in self.source.items() if k != "path"}
        return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


def key_rows(keys: list[KeyAction]) -> list[dict[str, Any]]:
    """``[k.to_dict() for k in keys]``, the same dicts, those of keys neither renamed from nor to
    another built in the comprehension itself (a call per key less: 102k keys at 180k storage entries)."""
    return [k.to_dict() if k.renamed_from is not None or k.renamed_to is not None else
            {"key": k.key, "role": k.role, "action": k.action, "reason": k.reason} if k.rank is None else
            {"key": k.key, "role": k.role, "action": k.action, "reason": k.reason, "rank": k.rank} for k in keys]


FULL_TABLE_ROWS = 50_000
"""Chunk rows up to which ``plan --json`` prints every tensor's chunks (about 4 MB of compact JSON)."""


def tensor_summary(tensors: list[TensorPlan]) -> list[dict[str, Any]]:
    """One row per distinct (shape, dtype, placement, transform): how many tensors, chunks per tensor, examples."""
    groups: dict[tuple, dict[str, Any]] = {}
    for t in tensors:
        k = (tuple(t.shape), t.dtype, t.placement.describe(), json.dumps(t.transform, sort_keys=True) if t.transform else "")
        g = groups.get(k)
        if g is None:
            g = groups[k] = {"shape": list(t.shape), "dtype": t.dtype, "placement": t.placement.describe(),
                             "transform": t.transform, "tensors": 0, "chunks_per_tensor": len(t.chunks), "examples": []}
        g["tensors"] += 1
        if len(g["examples"]) < 3:
            g["examples"].append(t.key)
    return list(groups.values())


def _summary(keys: list[KeyAction]) -> dict[str, int]:
    out: dict[str, int] = {}
    for k in keys:
        out[k.action] = out.get(k.action, 0) + 1
    return out


DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "bfloat16": "bfloat16", "float16": "float16",
          "float32": "float32"}
NOT_CAST = frozenset({"float4_e2m1fn_x2"})
"""Floating dtypes ``--dtype`` leaves as they are: a float4_e2m1fn_x2 element is two packed 4-bit
values and torch has no conversion for it (float8 has one, and is cast like any float)."""
