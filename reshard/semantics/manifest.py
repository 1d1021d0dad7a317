"""The checkpoint manifest: a JSON sidecar (``manifest.json``) beside DCP's ``.metadata``.

DCP records *where the bytes are*; it does not record *what the run meant* (global batch,
schedule position, data cursor, RNG policy, which topology produced the checkpoint, and
every topology change since). The manifest carries exactly that, so that ``reshard`` can
check a transition instead of guessing and a resumed job can tell a continuation from a
warm start.

The JSON shape is an interface (documented field by field in
``formats/manifest.schema.json``). Validation is done by hand here, without a jsonschema
dependency; ``tests/test_manifest.py`` keeps the dataclasses and the schema in sync.
"""
from __future__ import annotations

import datetime as _dt
import functools
import json
import os
import re
import sys
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from reshard import safefs
from reshard.errors import BadInput
from reshard.semantics.conventions import builtin_conventions

MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20  # a real manifest is a few KiB; its lineage grows by ~1 KiB per transition
FORMAT = "reshard-manifest"
FORMAT_VERSION = 1

DIM_NAMES = ("dp_replicate", "dp_shard", "cp", "tp", "pp")
def key_conventions(lineage: Any = None) -> tuple[str, ...]:
    """Names a manifest's ``key_convention`` may take: every primary convention in formats/conventions/.

    Read from the convention files, not listed here, so that a new convention file is a name a
    manifest (and reshard's own output manifest) can record. A user's convention file
    (``--convention FILE``) is a name too when the manifest's own ``lineage`` records it: a
    conversion records in its plan options each file's name and sha256, so the name is
    accepted exactly where a conversion used it, and reading the keys that way again needs the
    same file (reshard.planning.plan refuses other bytes under a recorded name).
    """
    shipped = {c.name for c in builtin_conventions() if not c.generic}
    return tuple(sorted(shipped | set(_recorded_user_conventions(lineage))))


def _recorded_user_conventions(lineage: Any) -> list[str]:
    """The user convention names a lineage's transitions record in their plan options (malformed entries: none)."""
    names: list[str] = []
    for event in lineage if isinstance(lineage, list) else []:
        policies = event.get("policies") if isinstance(event, dict) else None
        options = policies.get("options") if isinstance(policies, dict) else None
        recorded = options.get("conventions") if isinstance(options, dict) else None
        for c in recorded if isinstance(recorded, list) else []:
            if isinstance(c, dict) and isinstance(c.get("name"), str):
                names.append(c["name"])
    return names
RNG_POLICIES = ("per-rank", "offset", "none")
CONTINUITY = ("continuation", "warm_start")
LINEAGE_EVENTS = ("created", "transition", "import")
SCHEDULER_UNITS = ("steps", "tokens")


def now_iso() -> str:
    """UTC time as ISO-8601, the format every ``time`` field uses."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# --------------------------------------------------------------------------- validation
class _Ctx:
    """Where we are while validating, so errors name the file *and* the field."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, path: str, message: str) -> BadInput:
        return BadInput(
            f"invalid manifest field '{path}': {message}",
            where=self.source,
            hint="Fix or regenerate the manifest (see formats/manifest.schema.json), "
            "or remove it to treat the checkpoint as having no manifest.",
        )


def _get(d: Any, key: str, path: str, ctx: _Ctx, kind, *, choices=None, optional=False, nullable=False):
    """Fetch ``d[key]`` checking its JSON type (bool is never accepted as int)."""
    if not isinstance(d, dict):
        raise ctx.fail(path.rsplit(".", 1)[0] if "." in path else path, "expected an object")
    if key not in d:
        if optional:
            return None
        raise ctx.fail(path, "missing required field")
    value = d[key]
    if value is None and nullable:
        return None
    ok = isinstance(value, kind) and not (kind in (int, (int, float)) and isinstance(value, bool))
    if not ok:
        raise ctx.fail(path, f"expected {_kind_name(kind)}, got {type(value).__name__}")
    if choices is not None and value not in choices:
        raise ctx.fail(path, f"expected one of {list(choices)}, got {value!r}")
    if kind is int and value < 0:
        raise ctx.fail(path, f"expected a non-negative integer, got {value}")
    return value


def _kind_name(kind) -> str:
    names = {int: "integer", str: "string", bool: "boolean", dict: "object", list: "array"}
    if isinstance(kind, tuple):
        return " or ".join(names.get(k, k.__name__) for k in kind)
    return names.get(kind, kind.__name__)


def _pos(value: int, path: str, ctx: _Ctx) -> int:
    if value < 1:
        raise ctx.fail(path, f"expected a positive integer, got {value}")
    return value


# --------------------------------------------------------------------------- dataclasses
@dataclass
class Topology:
    """Mesh degrees and order of the job that produced (or will consume) the checkpoint.

    Recorded because the DCP bytes do not say how many ranks wrote them nor which mesh
    dim a rank index belongs to; both matter for per-rank state (RNG, dataloader keys).
    """

    dims: dict[str, int]
    """Degree of every parallel dim: dp_replicate, dp_shard, cp, tp, pp (1 = unused)."""
    mesh_order: list[str]
    """Device-mesh dim names, outermost first (rank = row-major index over this order)."""
    world_size: int
    """Total ranks; equals the product of ``dims``."""

    @classmethod
    def make(cls, *, dp_replicate: int = 1, dp_shard: int = 1, cp: int = 1, tp: int = 1, pp: int = 1,
             mesh_order: list[str] | None = None) -> "Topology":
        dims = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp, "tp": tp, "pp": pp}
        if mesh_order is None:
            mesh_order = [d for d in ("pp", "dp_replicate", "dp_shard", "cp", "tp") if dims[d] > 1] or ["dp_shard"]
        world = 1
        for v in dims.values():
            world *= v
        return cls(dims=dims, mesh_order=list(mesh_order), world_size=world)

    @property
    def dp(self) -> int:
        """Data-parallel degree (replicate x shard): the number of distinct data streams."""
        return self.dims["dp_replicate"] * self.dims["dp_shard"]

    def to_dict(self) -> dict:
        return {"dims": dict(self.dims), "mesh_order": list(self.mesh_order), "world_size": self.world_size}

    @classmethod
    def from_dict(cls, d: Any, path: str = "topology", ctx: _Ctx | None = None) -> "Topology":
        ctx = ctx or _Ctx("<manifest>")
        dims_d = _get(d, "dims", f"{path}.dims", ctx, dict)
        dims = {}
        for name in DIM_NAMES:
            dims[name] = _pos(_get(dims_d, name, f"{path}.dims.{name}", ctx, int), f"{path}.dims.{name}", ctx)
        extra = set(dims_d) - set(DIM_NAMES)
        if extra:
            raise ctx.fail(f"{path}.dims", f"unknown dims {sorted(extra)}; expected {list(DIM_NAMES)}")
        order = _get(d, "mesh_order", f"{path}.mesh_order", ctx, list)
        for i, name in enumerate(order):
            if name not in DIM_NAMES:
                raise ctx.fail(f"{path}.mesh_order[{i}]", f"expected one of {list(DIM_NAMES)}, got {name!r}")
        if len(set(order)) != len(order):
            raise ctx.fail(f"{path}.mesh_order", "dim names repeat")
        world = _pos(_get(d, "world_size", f"{path}.world_size", ctx, int), f"{path}.world_size", ctx)
        prod = 1
        for v in dims.values():
            prod *= v
        if prod != world:
            raise ctx.fail(f"{path}.world_size", f"{world} != product of dims {prod}")
        return cls(dims=dims, mesh_order=list(order), world_size=world)


@dataclass
class Batch:
    """The batch recipe. ``global_batch`` (sequences per optimizer step) is what the LR
    schedule and the data cursor are defined against; it must survive a topology change."""

    micro_batch: int | None
    """Sequences per rank per forward/backward (null: unknown, e.g. converted from a source without a manifest)."""
    grad_accum: int | None
    """Micro-steps per optimizer step (null: unknown)."""
    seq_len: int | None
    """Tokens per sequence (null: unknown)."""
    global_batch: int | None
    """micro_batch * grad_accum * dp_replicate * dp_shard, in sequences (null: unknown)."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any, path: str = "batch", ctx: _Ctx | None = None) -> "Batch":
        ctx = ctx or _Ctx("<manifest>")
        kw = {}
        for f in fields(cls):
            v = _get(d, f.name, f"{path}.{f.name}", ctx, int, nullable=True)
            kw[f.name] = None if v is None else _pos(v, f"{path}.{f.name}", ctx)
        return cls(**kw)


@dataclass
class Accumulation:
    """Gradient-accumulation phase: a checkpoint between optimizer steps needs the
    in-flight gradients or a deliberate rollback, so we record which it is."""

    micro_step: int = 0
    """Micro-steps already done in the current optimizer step (0 = at a step boundary)."""
    in_flight_grads: bool = False
    """Whether partially accumulated gradients are stored in the checkpoint."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any, path: str = "accumulation", ctx: _Ctx | None = None) -> "Accumulation":
        ctx = ctx or _Ctx("<manifest>")
        return cls(micro_step=_get(d, "micro_step", f"{path}.micro_step", ctx, int),
                   in_flight_grads=_get(d, "in_flight_grads", f"{path}.in_flight_grads", ctx, bool))


@dataclass
class Precision:
    """Numeric recipe; the loss scaler's state is global and must be carried as-is."""

    param_dtype: str = "float32"
    reduce_dtype: str = "float32"
    loss_scaler: dict | None = None
    """null, or {"kind": "dynamic" | "static" | ...} plus scaler-specific fields."""

    def to_dict(self) -> dict:
        return {"param_dtype": self.param_dtype, "reduce_dtype": self.reduce_dtype,
                "loss_scaler": None if self.loss_scaler is None else dict(self.loss_scaler)}

    @classmethod
    def from_dict(cls, d: Any, path: str = "precision", ctx: _Ctx | None = None) -> "Precision":
        ctx = ctx or _Ctx("<manifest>")
        scaler = _get(d, "loss_scaler", f"{path}.loss_scaler", ctx, dict, nullable=True)
        if scaler is not None:
            _get(scaler, "kind", f"{path}.loss_scaler.kind", ctx, str)
        return cls(param_dtype=_get(d, "param_dtype", f"{path}.param_dtype", ctx, str),
                   reduce_dtype=_get(d, "reduce_dtype", f"{path}.reduce_dtype", ctx, str),
                   loss_scaler=scaler)


@dataclass
class ModelInfo:
    """Which model this is and which parameters are tied (tied copies must stay equal)."""

    family: str
    config: dict = field(default_factory=dict)
    tied: list[list[str]] = field(default_factory=list)
    """Groups of module-level parameter names sharing one tensor, e.g. [["tok_emb.weight", "lm_head.weight"]]."""

    def to_dict(self) -> dict:
        return {"family": self.family, "config": dict(self.config), "tied": [list(g) for g in self.tied]}

    @classmethod
    def from_dict(cls, d: Any, path: str = "model", ctx: _Ctx | None = None) -> "ModelInfo":
        ctx = ctx or _Ctx("<manifest>")
        tied = _get(d, "tied", f"{path}.tied", ctx, list)
        for i, group in enumerate(tied):
            if not isinstance(group, list) or len(group) < 2 or not all(isinstance(x, str) for x in group):
                raise ctx.fail(f"{path}.tied[{i}]", "expected an array of at least two parameter names")
        return cls(family=_get(d, "family", f"{path}.family", ctx, str),
                   config=_get(d, "config", f"{path}.config", ctx, dict), tied=[list(g) for g in tied])


@dataclass
class OptimizerInfo:
    """Optimizer name and hyper-parameters, to check moments against parameters."""

    name: str
    config: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"name": self.name, "config": dict(self.config)}

    @classmethod
    def from_dict(cls, d: Any, path: str = "optimizer", ctx: _Ctx | None = None) -> "OptimizerInfo":
        ctx = ctx or _Ctx("<manifest>")
        return cls(name=_get(d, "name", f"{path}.name", ctx, str), config=_get(d, "config", f"{path}.config", ctx, dict))


@dataclass
class SchedulerInfo:
    """LR schedule and the unit its position is counted in; a schedule in steps only keeps
    its meaning if the global batch is kept."""

    name: str
    config: dict = field(default_factory=dict)
    unit: str = "steps"
    """"steps" (optimizer steps) or "tokens"."""

    def to_dict(self) -> dict:
        return {"name": self.name, "config": dict(self.config), "unit": self.unit}

    @classmethod
    def from_dict(cls, d: Any, path: str = "scheduler", ctx: _Ctx | None = None) -> "SchedulerInfo":
        ctx = ctx or _Ctx("<manifest>")
        return cls(name=_get(d, "name", f"{path}.name", ctx, str), config=_get(d, "config", f"{path}.config", ctx, dict),
                   unit=_get(d, "unit", f"{path}.unit", ctx, str, choices=SCHEDULER_UNITS))


@dataclass
class DataPosition:
    """One *global* data cursor (elastic: each rank's share is derived on load), and what
    defines the order, so a resume on another world size neither repeats nor skips."""

    sampler: str
    seed: int
    epoch: int
    cursor: int
    """Global samples consumed in this epoch."""
    dataset_len: int
    order: str
    """Human description of what defines the order (e.g. randperm(dataset_len, seed+epoch))."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any, path: str = "data", ctx: _Ctx | None = None) -> "DataPosition":
        ctx = ctx or _Ctx("<manifest>")
        kw = {}
        for f in fields(cls):
            kind = str if f.name in ("sampler", "order") else int
            kw[f.name] = _get(d, f.name, f"{path}.{f.name}", ctx, kind)
        return cls(**kw)


@dataclass
class RngInfo:
    """How RNG state is stored: per-rank streams (keyed by rank, topology-bound), a single
    seed + offset (topology-free), or none."""

    policy: str = "per-rank"
    keyed_by_rank: bool = True
    """Whether the checkpoint stores state under ``rng.rank_<r>`` keys."""
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any, path: str = "rng", ctx: _Ctx | None = None) -> "RngInfo":
        ctx = ctx or _Ctx("<manifest>")
        return cls(policy=_get(d, "policy", f"{path}.policy", ctx, str, choices=RNG_POLICIES),
                   keyed_by_rank=_get(d, "keyed_by_rank", f"{path}.keyed_by_rank", ctx, bool),
                   seed=_get(d, "seed", f"{path}.seed", ctx, int))


@dataclass
class LineageEvent:
    """One entry of the run's history: creation, a topology transition, or an import.

    ``from``/``to`` are Python keywords, hence ``from_``/``to`` attributes; JSON uses
    ``"from"``/``"to"``.
    """

    event: str
    from_: Topology | None
    to: Topology | None
    at_step: int | None
    policies: dict = field(default_factory=dict)
    tool: str = ""
    time: str = field(default_factory=now_iso)
    kind: str = "continuation"
    reason: str = ""

    def to_dict(self) -> dict:
        return {"event": self.event,
                "from": None if self.from_ is None else self.from_.to_dict(),
                "to": None if self.to is None else self.to.to_dict(),
                "at_step": self.at_step, "policies": dict(self.policies), "tool": self.tool,
                "time": self.time, "kind": self.kind, "reason": self.reason}

    @classmethod
    def from_dict(cls, d: Any, path: str = "lineage[0]", ctx: _Ctx | None = None) -> "LineageEvent":
        ctx = ctx or _Ctx("<manifest>")
        frm = _get(d, "from", f"{path}.from", ctx, dict, nullable=True)
        to = _get(d, "to", f"{path}.to", ctx, dict, nullable=True)
        return cls(event=_get(d, "event", f"{path}.event", ctx, str, choices=LINEAGE_EVENTS),
                   from_=None if frm is None else Topology.from_dict(frm, f"{path}.from", ctx),
                   to=None if to is None else Topology.from_dict(to, f"{path}.to", ctx),
                   at_step=_get(d, "at_step", f"{path}.at_step", ctx, int, nullable=True),
                   policies=_get(d, "policies", f"{path}.policies", ctx, dict),
                   tool=_get(d, "tool", f"{path}.tool", ctx, str),
                   time=_get(d, "time", f"{path}.time", ctx, str),
                   kind=_get(d, "kind", f"{path}.kind", ctx, str, choices=CONTINUITY),
                   reason=_get(d, "reason", f"{path}.reason", ctx, str))


@dataclass
class Writer:
    """Who wrote this manifest (tool and version, torch version, when)."""

    tool: str
    torch: str
    time: str = field(default_factory=now_iso)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any, path: str = "writer", ctx: _Ctx | None = None) -> "Writer":
        ctx = ctx or _Ctx("<manifest>")
        return cls(**{f.name: _get(d, f.name, f"{path}.{f.name}", ctx, str) for f in fields(cls)})

    @classmethod
    def current(cls, tool: str | None = None) -> "Writer":
        from reshard.version import __version__
        return cls(tool=tool or f"reshard {__version__}", torch=torch_version())


@functools.lru_cache(maxsize=None)
def torch_version() -> str:
    """The installed torch's version as ``torch.__version__`` says it, from its package metadata: a
    manifest names the torch that can load the checkpoint, and stating it needs no torch import.

    Read from the ``METADATA`` of the first ``torch-*.dist-info`` on ``sys.path`` (`dist_info_version`),
    which is the distribution ``importlib.metadata.version`` answers with, without importing
    ``importlib.metadata``: that import (and the e-mail parser it reads ``METADATA`` with) cost about
    0.03 s of CPU in every conversion, which asks twice (the resume key, the manifest). Where no
    such directory is found (an egg, a zipped path entry), ``importlib.metadata`` answers.
    """
    found = dist_info_version("torch")
    if found is not None:
        return found
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:  # pragma: no cover - torch is a dependency
        return "unknown"


def dist_info_version(name: str) -> str | None:
    """The ``Version`` of the first installed ``NAME-*.dist-info`` on ``sys.path``, searched in the order
    ``importlib.metadata`` searches (path entries in order, each directory as listed), names compared
    normalized as it compares them; None when there is none (or its ``METADATA`` has no version)."""
    want = re.sub(r"[-_.]+", "-", name).lower().replace("-", "_")
    for entry in sys.path:
        try:
            children = os.listdir(entry or ".")
        except OSError:  # not a directory (a zip), or gone
            continue
        for child in children:
            low = child.lower()
            if not low.endswith(".dist-info"):
                continue
            stem = low.rpartition(".")[0].partition("-")[0]
            if re.sub(r"[-_.]+", "-", stem).lower().replace("-", "_") != want:
                continue
            try:
                with open(os.path.join(entry or ".", child, "METADATA"), encoding="utf-8") as f:
                    for line in f:
                        if not line.strip():
                            break  # the headers end at the first empty line
                        if line.startswith("Version:"):
                            return line[len("Version:"):].strip()
            except OSError:
                continue
            return None
    return None


@dataclass
class Manifest:
    """Everything a checkpoint must let you check beyond the tensors (see BACKGROUND.md)."""

    experiment_id: str
    step: int | None
    """Completed optimizer steps (null: unknown, e.g. converted from a source that does not record it)."""
    tokens_seen: int | None
    samples_seen: int | None
    key_convention: str
    """How state-dict keys are laid out: the name of a convention in formats/conventions/."""
    topology: Topology
    batch: Batch
    accumulation: Accumulation
    precision: Precision
    model: ModelInfo
    optimizer: OptimizerInfo
    scheduler: SchedulerInfo
    data: DataPosition
    rng: RngInfo
    continuity: str
    """"continuation" (same optimizer trajectory) or "warm_start" (new experiment identity)."""
    lineage: list[LineageEvent]
    writer: Writer
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    integrity: dict | None = None
    """Optional: {"algorithm": "crc32" | "sha256", "items": {"<file>:<offset>": hex}}, a checksum of every
    stored item as written (see reshard/storage/files/integrity.py). Absent in older manifests; omitted
    from the JSON when None."""

    def to_dict(self) -> dict:
        return {
            "format": self.format, "format_version": self.format_version,
            "experiment_id": self.experiment_id, "step": self.step,
            "tokens_seen": self.tokens_seen, "samples_seen": self.samples_seen,
            "key_convention": self.key_convention,
            "topology": self.topology.to_dict(), "batch": self.batch.to_dict(),
            "accumulation": self.accumulation.to_dict(), "precision": self.precision.to_dict(),
            "model": self.model.to_dict(), "optimizer": self.optimizer.to_dict(),
            "scheduler": self.scheduler.to_dict(), "data": self.data.to_dict(), "rng": self.rng.to_dict(),
            "continuity": self.continuity, "lineage": [e.to_dict() for e in self.lineage],
            "writer": self.writer.to_dict(),
            **({} if self.integrity is None else {"integrity": _integrity_copy(self.integrity)}),
        }

    @classmethod
    def from_dict(cls, d: Any, source: str = "<manifest>") -> "Manifest":
        """Validate and build; raises BadInput naming ``source`` and the offending field."""
        ctx = _Ctx(source)
        if not isinstance(d, dict):
            raise ctx.fail("$", "expected a JSON object at the top level")
        fmt = _get(d, "format", "format", ctx, str)
        if fmt != FORMAT:
            raise ctx.fail("format", f"expected {FORMAT!r}, got {fmt!r}")
        version = _get(d, "format_version", "format_version", ctx, int)
        if version != FORMAT_VERSION:
            raise ctx.fail("format_version", f"this reshard reads version {FORMAT_VERSION}, got {version}")
        lineage = _get(d, "lineage", "lineage", ctx, list)
        return cls(
            experiment_id=_get(d, "experiment_id", "experiment_id", ctx, str),
            step=_get(d, "step", "step", ctx, int, nullable=True),
            tokens_seen=_get(d, "tokens_seen", "tokens_seen", ctx, int, nullable=True),
            samples_seen=_get(d, "samples_seen", "samples_seen", ctx, int, nullable=True),
            key_convention=_get(d, "key_convention", "key_convention", ctx, str, choices=key_conventions(lineage)),
            topology=Topology.from_dict(_get(d, "topology", "topology", ctx, dict), "topology", ctx),
            batch=Batch.from_dict(_get(d, "batch", "batch", ctx, dict), "batch", ctx),
            accumulation=Accumulation.from_dict(_get(d, "accumulation", "accumulation", ctx, dict), "accumulation", ctx),
            precision=Precision.from_dict(_get(d, "precision", "precision", ctx, dict), "precision", ctx),
            model=ModelInfo.from_dict(_get(d, "model", "model", ctx, dict), "model", ctx),
            optimizer=OptimizerInfo.from_dict(_get(d, "optimizer", "optimizer", ctx, dict), "optimizer", ctx),
            scheduler=SchedulerInfo.from_dict(_get(d, "scheduler", "scheduler", ctx, dict), "scheduler", ctx),
            data=DataPosition.from_dict(_get(d, "data", "data", ctx, dict), "data", ctx),
            rng=RngInfo.from_dict(_get(d, "rng", "rng", ctx, dict), "rng", ctx),
            continuity=_get(d, "continuity", "continuity", ctx, str, choices=CONTINUITY),
            lineage=[LineageEvent.from_dict(e, f"lineage[{i}]", ctx) for i, e in enumerate(lineage)],
            writer=Writer.from_dict(_get(d, "writer", "writer", ctx, dict), "writer", ctx),
            format=fmt, format_version=version,
            integrity=_integrity_from(d, ctx),
        )


_HEX = frozenset("0123456789abcdef")
_DIGEST_HEX = {"crc32": 8, "sha256": 64}  # integrity algorithm -> hex digits per item


def _integrity_copy(v: dict) -> dict:
    return {"algorithm": v.get("algorithm"), "items": dict(v.get("items") or {})}


def _integrity_from(d: dict, ctx: _Ctx) -> dict | None:
    """The optional ``integrity`` field: a checksum per stored item, keyed "file:offset".

    crc32 (8 hex digits, what convert writes) or sha256 (64 hex digits, older manifests)."""
    v = _get(d, "integrity", "integrity", ctx, dict, optional=True)
    if v is None:
        return None
    algorithm = _get(v, "algorithm", "integrity.algorithm", ctx, str, choices=tuple(_DIGEST_HEX))
    width = _DIGEST_HEX[algorithm]
    items = _get(v, "items", "integrity.items", ctx, dict)
    for name, h in items.items():
        file, sep, off = name.rpartition(":")
        if not sep or not file or not off.isdigit():
            raise ctx.fail(f"integrity.items[{name!r}]", "expected a name '<file>:<offset>'")
        if not isinstance(h, str) or len(h) != width or not set(h) <= _HEX:
            raise ctx.fail(f"integrity.items[{name!r}]", f"expected a {algorithm} as {width} lowercase hex digits")
    extra = set(v) - {"algorithm", "items"}
    if extra:
        raise ctx.fail("integrity", f"unknown fields {sorted(extra)}")
    return _integrity_copy(v)


# --------------------------------------------------------------------------- file I/O
def manifest_path(ckpt_dir: str | os.PathLike) -> Path:
    return Path(ckpt_dir) / MANIFEST_NAME


def read_manifest(ckpt_dir: str | os.PathLike) -> Manifest | None:
    """Read ``<ckpt_dir>/manifest.json``; None when absent, BadInput when unreadable/invalid."""
    path = manifest_path(ckpt_dir)
    if not os.path.lexists(path):
        return None
    try:
        data = safefs.read_json(path, root=ckpt_dir, what="manifest", limit=MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise BadInput("manifest.json is a symbolic link to a file that does not exist", where=str(path)) from None
    except OSError as exc:
        raise BadInput(f"cannot read manifest: {exc}", where=str(path),
                       hint="Check the file's permissions.") from exc
    return Manifest.from_dict(data, source=str(path))


def write_manifest(ckpt_dir: str | os.PathLike, manifest: Manifest) -> Path:
    """Write ``<ckpt_dir>/manifest.json`` atomically (tmp file + fsync + os.replace).

    A reader therefore sees the old manifest or the new one, never a torn file.
    """
    ckpt_dir = Path(ckpt_dir)
    path = manifest_path(ckpt_dir)
    text = json.dumps(manifest.to_dict(), indent=2, sort_keys=False) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=".manifest.", suffix=".tmp", dir=ckpt_dir)
    try:
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a manifest is meant to be read by others
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:  # make the rename durable too
        dfd = os.open(ckpt_dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass
    return path


__all__ = [
    "MANIFEST_NAME", "Manifest", "Topology", "Batch", "Accumulation", "Precision", "ModelInfo",
    "OptimizerInfo", "SchedulerInfo", "DataPosition", "RngInfo", "LineageEvent", "Writer",
    "read_manifest", "write_manifest", "manifest_path", "now_iso",
]
