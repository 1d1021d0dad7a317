"""`reshard export`: a DCP checkpoint as one consolidated set of weights (safetensors or torch).

Streaming
---------
Tensors are written one global tensor at a time: each is assembled from its DCP chunks
with ``CheckpointIndex.read_tensor``, cast (``dtype``), written and dropped. For
safetensors the shard files are written directly in the safetensors layout (8-byte
little-endian header length, JSON header, raw little-endian tensor bytes): the header is
computed from shapes and dtypes before any tensor is read, so nothing is buffered and
**peak memory is bounded by the largest tensor (plus its cast copy)**, whatever
``max_shard_size``. The files load with ``safetensors.torch.load_file`` / ``safe_open``.

``fmt="torch"`` writes each shard with one ``torch.save`` of a flat dict, which needs the
whole shard in memory: **memory is bounded by one shard** (``max_shard_size``; pick e.g.
``256MB`` on a small machine).

Output (Hugging Face conventions)
---------------------------------
safetensors: ``model.safetensors`` when everything fits in one shard, otherwise
``model-0000k-of-0000N.safetensors`` plus ``model.safetensors.index.json``::

    {"metadata": {"total_size": <bytes of tensor data>,
                  "reshard": {<the essentials below, JSON values>, "export_map": {...}}},
     "weight_map": {name: file, ...}}            # every exported name exactly once

torch: ``model.pt`` or ``model-0000k-of-0000N.pt``, plus ``model.pt.index.json`` (same shape)
in both cases (a torch file has no header for the metadata).

Every safetensors shard's ``__metadata__`` header (string values, JSON-encoded where not a
plain string) holds: ``format`` = ``"pt"`` (transformers requires it), ``reshard_export``
(format version), ``experiment_id``, ``step``, ``tokens_seen``, ``topology``, ``source``,
``source_convention``, ``model_family``, ``dtype``, ``only``, ``rename``, ``tied`` (JSON
list of groups of exported names: the first is stored, the others are copies of it and not
stored) and ``export_map`` (JSON ``{exported name: source DCP key}`` for that shard's
tensors), which `reshard.storage.safetensors_format` uses to map names back for ``verify`` and
``import``.

Names
-----
Parameters: their FQN (no ``model.`` checkpoint prefix), after the optional rename rules
(`RenameRules`, e.g. ``formats/renames/torchtitan-to-hf-llama.toml``). With
``only="model+optim"`` also ``optim.<name>.<moment>`` (``exp_avg``, ``exp_avg_sq``, ...) and
``optim.<name>.step`` (the per-parameter step counter when it is a tensor). Everything else
(param groups, scheduler, counters, RNG, data position) is not exported and is listed in
``export-report.json`` with the reason.

Tied weights (the manifest's ``model.tied``, or a pair from ``formats/models/ties.toml``
whose copies are bitwise equal) are written once. ``dtype`` casts floating-point
parameters and moments only (step counters keep their dtype).

``fmt="hf"`` (``--format hf``): the same safetensors layout under the Hugging Face names of the
model family's mapping (``formats/hf/<family>.toml``, strict: an unmapped parameter is
refused, naming it), each weight transformed as the mapping declares (rotary row order,
fused parts split, vocab padding trimmed: `reshard.semantics.hf`), plus ``config.json`` from
the checkpoint's shapes and the values it cannot hold (``--model-config``, the manifest's
``model.config``; all missing ones asked for in one message). `compare_hf_export` is what
``reshard verify SRC HF_EXPORT`` runs.

The output directory appears atomically (`reshard.storage.atomic.atomic_directory`) and holds
``export-report.json``: every source key once with what happened to it.
"""
from __future__ import annotations

import json
import os
import re
import struct
import time as _time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from reshard.engine.space import preflight, space_errors
from reshard.errors import BadInput, Incomplete, Infeasible
from reshard.render.progress import describe_bytes, end_commit, phase_of, start_commit

EXPORT_FORMAT_VERSION = "1"
REPORT = "export-report.json"
ST_INDEX = "model.safetensors.index.json"
PT_INDEX = "model.pt.index.json"
DEFAULT_MAX_SHARD = 5 * 10**9

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}

ST_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1,
          "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
          "p": 10**15, "pb": 10**15,
          "ki": 1 << 10, "kib": 1 << 10, "mi": 1 << 20, "mib": 1 << 20, "gi": 1 << 30, "gib": 1 << 30,
          "ti": 1 << 40, "tib": 1 << 40, "pi": 1 << 50, "pib": 1 << 50}


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"256MB"`` -> 256_000_000, ``"512MiB"`` -> 536_870_912, ``"1000"`` -> 1000.

    Decimal units (KB, MB, GB, TB) as Hugging Face's ``max_shard_size``; binary ones with ``i``.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        n = text
    else:
        m = _SIZE.match(str(text))
        if not m or (m.group(2) or "").lower() not in _UNITS:
            raise BadInput(f"bad size '{text}'", hint="Write e.g. 5GB, 256MB, 512MiB or a number of bytes.")
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    if n < 1:
        raise BadInput(f"size must be positive, got '{text}'")
    return n


# ===================================================================================== renaming
@dataclass(frozen=True)
class RenameRule:
    match: re.Pattern[str]
    replace: str


@dataclass
class RenameRules:
    """Ordered regex -> replacement rules for parameter names; the first whose ``match`` matches wins."""

    name: str
    rules: list[RenameRule]
    strict: bool = False
    source: str = ""
    description: str = ""

    @classmethod
    def load(cls, path: str | Path) -> "RenameRules":
        p = Path(path)
        try:
            with open(p, "rb") as f:
                spec = tomllib.load(f)
            rules = [RenameRule(re.compile(r["match"]), str(r["replace"])) for r in spec.get("rule", [])]
            if not rules:
                raise ValueError("no [[rule]] entries")
            return cls(name=str(spec.get("name", p.stem)), rules=rules, strict=bool(spec.get("strict", False)),
                       source=str(p), description=str(spec.get("description", "")))
        except FileNotFoundError:
            raise BadInput("no such rename rules file", where=str(p)) from None
        except (KeyError, ValueError, TypeError, re.error, tomllib.TOMLDecodeError) as exc:
            raise BadInput(f"invalid rename rules file: {exc}", where=str(p),
                           hint="Each [[rule]] needs `match` (a regex) and `replace` (re.sub template).") from None

    def apply(self, name: str) -> str:
        for r in self.rules:
            if r.match.fullmatch(name):
                return r.match.sub(r.replace, name, count=1)
        if self.strict:
            raise BadInput(f"no rename rule matches '{name}'", where=self.source or self.name,
                           hint="Add a rule for it, or set strict = false to keep unmatched names unchanged.")
        return name

    def renames(self, name: str) -> bool:
        """Whether a rule matches ``name`` (a non-strict set keeps the others unchanged, with a warning)."""
        return any(r.match.fullmatch(name) for r in self.rules)

    def inverse(self) -> "RenameRules":
        """The rules read backwards (for import); each rule must be invertible (see the Llama file)."""
        return RenameRules(name=f"inverse of {self.name}", rules=[_invert(r, self.source) for r in self.rules],
                           strict=self.strict, source=self.source, description=self.description)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "file": self.source, "rules": len(self.rules)}


_GROUP = re.compile(r"\((?!\?)([^()]*)\)|\(\?P<(\w+)>([^()]*)\)")
_REF = re.compile(r"\\(\d+)|\\g<(\w+)>")


def _invert(rule: RenameRule, where: str) -> RenameRule:
    """``^lit(grp)lit$`` / ``lit\\1lit`` -> ``^lit(grp)lit$`` / ``lit\\1lit`` the other way round."""
    pat = rule.match.pattern
    body = pat[1:] if pat.startswith("^") else pat
    body = body[:-1] if body.endswith("$") and not body.endswith("\\$") else body
    literals: list[str] = []
    groups: list[tuple[str | None, str]] = []  # (name, sub-pattern) in order
    pos = 0
    for m in _GROUP.finditer(body):
        literals.append(body[pos:m.start()])
        groups.append((m.group(2), m.group(3)) if m.group(2) else (None, m.group(1)))
        pos = m.end()
    literals.append(body[pos:])
    unescaped = []
    for lit in literals:
        if re.search(r"\\[A-Za-z0-9]", lit) or any(ch in re.sub(r"\\.", "", lit) for ch in ".^$*+?{}[]|()\\"):
            raise BadInput(f"rename rule '{pat}' cannot be inverted (only escaped literal text and simple groups)",
                           where=where)
        unescaped.append(re.sub(r"\\(.)", r"\1", lit))
    # the replacement: literal text and group references, each group used exactly once
    rep = rule.replace
    out_pat, used, pos = "", [], 0
    for m in _REF.finditer(rep):
        ref = m.group(1) or m.group(2)
        idx = int(ref) - 1 if ref.isdigit() else next((i for i, (n, _) in enumerate(groups) if n == ref), -1)
        if not 0 <= idx < len(groups):
            raise BadInput(f"rename rule '{pat}': replacement refers to unknown group {ref!r}", where=where)
        out_pat += re.escape(rep[pos:m.start()]) + f"({groups[idx][1]})"
        used.append(idx)
        pos = m.end()
    out_pat += re.escape(rep[pos:])
    if sorted(used) != list(range(len(groups))):
        raise BadInput(f"rename rule '{pat}' cannot be inverted: its replacement must use every group exactly once",
                       where=where)
    # inverse replacement: the original literal text with group i -> reference to its position in `used`
    inv = unescaped[0].replace("\\", "\\\\")
    for i in range(len(groups)):
        inv += f"\\g<{used.index(i) + 1}>" + unescaped[i + 1].replace("\\", "\\\\")
    return RenameRule(re.compile("^" + out_pat + "$"), inv)


# ===================================================================================== planning
@dataclass
class _Item:
    key: str            # source key
    name: str           # exported name
    role: str
    shape: tuple[int, ...]
    src_dtype: torch.dtype
    dtype: torch.dtype
    file: str = ""
    offset: int = 0     # within the shard's data section
    src_shape: tuple[int, ...] | None = None        # the source's shape, when ``make`` changes it
    make: Any = None    # source tensor -> exported tensor (``--format hf``: rows trimmed, declared transform)

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class _Plan:
    items: list[_Item] = field(default_factory=list)
    keys: list[dict[str, Any]] = field(default_factory=list)
    tied: list[list[str]] = field(default_factory=list)   # exported names, first stored
    tied_fqns: list[list[str]] = field(default_factory=list)
    copies: dict[str, tuple[str, str]] = field(default_factory=dict)  # copy name -> (source key, stored name)
    warnings: list[str] = field(default_factory=list)


def _dtype_arg(dtype: str | None) -> torch.dtype | None:
    if dtype is None:
        return None
    dt = DTYPES.get(str(dtype).lower())
    if dt is None:
        raise BadInput(f"unknown dtype '{dtype}'", hint="Use bf16, fp16 or fp32.")
    return dt


def _plan(ix, cls, mdict: dict[str, Any], *, only: str, dtype: torch.dtype | None,
          rules: RenameRules | None) -> _Plan:
    from reshard.semantics.conventions import known_tied_pairs
    from reshard.storage.index import bitwise_equal

    p = _Plan()
    roles = cls.roles
    params = {r.param: k for k, r in roles.items() if r.role == "parameter" and r.param and ix.entries[k].is_tensor}

    # tied groups: the manifest's (authoritative) and known pairs whose copies are bitwise equal
    copy_of: dict[str, str] = {}  # fqn -> fqn stored instead
    declared = [list(g) for g in ((mdict.get("model") or {}).get("tied") or [])]
    groups = [(g, "manifest") for g in declared]
    for a, b in known_tied_pairs():
        if not any(a in g and b in g for g in declared):
            groups.append(([a, b], "known pair"))
    for g, source in groups:
        present = [n for n in g if n in params]
        if len(present) < 2:
            continue
        first = present[0]
        same = [n for n in present[1:] if bitwise_equal(ix, params[first], params[n])]
        if source == "manifest" and len(same) != len(present) - 1:
            p.warnings.append(f"tied copies {present} are declared in the manifest but differ: all exported")
            continue
        if not same:
            continue
        for n in same:
            copy_of[n] = first
        p.tied_fqns.append([first, *same])

    unrenamed: list[str] = []

    def rename(fqn: str) -> str:
        if rules is not None and not rules.renames(fqn) and fqn not in unrenamed:
            unrenamed.append(fqn)
        return rules.apply(fqn) if rules is not None else fqn

    seen: dict[str, str] = {}
    for key, e in ix.entries.items():
        r = roles[key]
        rec: dict[str, Any] = {"key": key, "role": r.role}
        name = None
        if not e.is_tensor:
            rec.update(action="dropped", reason=f"{r.role} object: trainer state is not exported")
        elif r.role == "parameter" and r.param:
            if r.param in copy_of:
                p.copies[rename(r.param)] = (key, rename(copy_of[r.param]))
                rec.update(action="tied_copy", name=rename(r.param),
                           reason=f"tied copy of '{copy_of[r.param]}' (bitwise equal): written once, under '{rename(copy_of[r.param])}'")
            else:
                name = rename(r.param)
        elif r.role in ("optimizer_moment", "optimizer_step") and r.param:
            if only != "model+optim":
                rec.update(action="dropped", reason=f"{r.role.replace('_', ' ')} (--only model)")
            else:
                name = f"optim.{rename(r.param)}.{r.name or 'step'}"
        else:
            rec.update(action="dropped", reason=f"{r.role} tensor: trainer state is not exported")
        if name is not None:
            if name in seen:
                raise BadInput(f"'{key}' and '{seen[name]}' would both be exported as '{name}'",
                               where=rules.source if rules else None, hint="Fix the rename rules.")
            seen[name] = key
            out_dtype = e.dtype
            if dtype is not None and r.role in ("parameter", "optimizer_moment") and e.dtype.is_floating_point:
                out_dtype = dtype
            if out_dtype not in ST_DTYPE_NAMES:
                raise BadInput(f"'{key}' has dtype {e.dtype}, which safetensors cannot store")
            p.items.append(_Item(key, name, r.role, tuple(e.shape), e.dtype, out_dtype))
            rec.update(action="exported", name=name, dtype=str(e.dtype).removeprefix("torch."),
                       exported_dtype=str(out_dtype).removeprefix("torch."),
                       cast=out_dtype != e.dtype, shape=list(e.shape))
        p.keys.append(rec)
    p.tied = [[rename(n) for n in g] for g in p.tied_fqns]
    if unrenamed:
        p.warnings.append(f"{len(unrenamed)} name(s) matched no rule of {rules.source or rules.name} and keep their own "
                          f"name: {', '.join(unrenamed[:10])}" + (" ..." if len(unrenamed) > 10 else ""))
    return p


def key_actions(ix, cls, mdict: dict[str, Any], *, only: str) -> list[dict[str, Any]]:
    """What `export` does with every source key (``exported``, ``tied_copy`` or ``dropped``, with
    the reason), exactly as ``export-report.json`` lists them, computed from the source itself.

    Public for `reshard verify DCP EXPORT`, which re-derives what an export of the source
    leaves out instead of believing the report the export carries. Names and dtypes do not
    change what is left out, so no rename rules or cast are taken.
    """
    return _plan(ix, cls, mdict, only=only, dtype=None, rules=None).keys


def _assign_shards(items: list[_Item], max_shard_size: int, ext: str) -> list[list[_Item]]:
    shards: list[list[_Item]] = []
    size = 0
    for it in items:
        if not shards or (size + it.nbytes > max_shard_size and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += it.nbytes
    if not shards:
        shards.append([])
    n = len(shards)
    for k, shard in enumerate(shards, 1):
        fname = f"model.{ext}" if n == 1 else f"model-{k:05d}-of-{n:05d}.{ext}"
        off = 0
        for it in shard:
            it.file, it.offset = fname, off
            off += it.nbytes
    return shards


# ===================================================================================== writing
def _read_cast(ix, it: _Item) -> torch.Tensor:
    t = ix.read_tensor(it.key)
    src_shape = it.src_shape if it.src_shape is not None else it.shape
    if t.dtype != it.src_dtype or tuple(t.shape) != src_shape:
        raise Infeasible(f"'{it.key}' reads as {t.dtype}{tuple(t.shape)}, expected {it.src_dtype}{list(src_shape)}",
                         where=str(ix.root), hint="The checkpoint is corrupt.")
    if it.make is not None:
        t = it.make(t)
    if t.dtype != it.dtype:
        t = t.to(it.dtype)
    return t.contiguous()


def _raw_bytes(t: torch.Tensor) -> memoryview:
    flat = t.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def _st_header(shard: list[_Item], metadata: dict[str, str]) -> bytes:
    h: dict[str, Any] = {"__metadata__": metadata}
    for it in shard:
        h[it.name] = {"dtype": ST_DTYPE_NAMES[it.dtype], "shape": list(it.shape),
                      "data_offsets": [it.offset, it.offset + it.nbytes]}
    raw = json.dumps(h, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def _write_safetensors_shard(ix, path: Path, shard: list[_Item], metadata: dict[str, str], progress: Any) -> None:
    with open(path, "xb") as f:
        f.write(_st_header(shard, metadata))
        for it in shard:
            t = _read_cast(ix, it)
            f.write(_raw_bytes(t))
            del t
            if progress is not None:
                progress.update(it.nbytes)
        f.flush()


def _write_torch_shard(ix, path: Path, shard: list[_Item], progress: Any) -> None:
    d: dict[str, torch.Tensor] = {}
    for it in shard:
        d[it.name] = _read_cast(ix, it).clone()
        if progress is not None:
            progress.update(it.nbytes)
    with open(path, "xb") as f:
        torch.save(d, f)


def _essentials(src: Path, mdict: dict[str, Any], convention: str, *, dtype: torch.dtype | None, only: str,
                rules: RenameRules | None, tied: list[list[str]], fmt: str) -> dict[str, Any]:
    return {
        "reshard_export": EXPORT_FORMAT_VERSION,
        "experiment_id": mdict.get("experiment_id"),
        "step": mdict.get("step"),
        "tokens_seen": mdict.get("tokens_seen"),
        "topology": mdict.get("topology"),
        "continuity": mdict.get("continuity"),
        "model_family": (mdict.get("model") or {}).get("family"),
        "model_config": (mdict.get("model") or {}).get("config"),
        "source": str(src.resolve()),
        "source_convention": convention,
        "dtype": str(dtype).removeprefix("torch.") if dtype is not None else "as stored",
        "only": only,
        "rename": rules.describe() if rules is not None else None,
        "tied": tied,
        "format": fmt,
    }


def _export_map(items: list[_Item], copies: dict[str, tuple[str, str]]) -> dict[str, str]:
    """exported name -> source key, for ``items`` and the tied copies of them (not stored)."""
    out = {it.name: it.key for it in items}
    names = set(out)
    out.update({c: key for c, (key, stored) in copies.items() if stored in names})
    return out


def _header_metadata(ess: dict[str, Any], shard: list[_Item], copies: dict[str, tuple[str, str]]) -> dict[str, str]:
    meta = {"format": "pt"}
    for k, v in ess.items():
        if k == "format":
            continue
        meta[k] = v if isinstance(v, str) else json.dumps(v)
    meta["export_map"] = json.dumps(_export_map(shard, copies))
    return meta


def export(src: str | Path, dst: str | Path, *, fmt: str = "safetensors", dtype: str | None = None,
           only: str = "model", max_shard_size: int | str = DEFAULT_MAX_SHARD, rename: str | Path | None = None,
           overwrite: bool = False, progress: Any = None, model_config: dict[str, Any] | None = None,
           profile: dict[str, Any] | None = None, force: bool = False) -> dict[str, Any]:
    """Write ``src`` (a DCP checkpoint) consolidated into ``dst``; returns the export report.

    ``fmt="hf"``: safetensors under the Hugging Face names of the model family's mapping
    (``formats/hf/<family>.toml``, strict), the weights transformed as it declares, and a
    ``config.json`` from the checkpoint's shapes plus ``model_config`` (``--model-config``) and the
    manifest's ``model.config`` for what the shapes cannot tell (asked for once when missing).
       ``profile``: the record of the profile that contributed values (file, sha256, what), kept in the report.
    ``progress``: a `reshard.render.progress.Progress` (or None): the phases "writing" and
    "verifying", by the exported bytes.
    ``force``: go ahead when the destination lacks the space for the output, whose size is
    exact (tensor bytes and safetensors headers, `_estimate_bytes`); otherwise refused before
    anything is written (`reshard.engine.space.preflight`, the report's ``estimate``).
    """
    from reshard.semantics.conventions import classify, reshard_key
    from reshard.storage.atomic import atomic_directory, check_destination
    from reshard.storage.local_format import open_any
    from reshard.semantics.manifest import read_manifest

    started = _time.time()
    src, dst = Path(src), Path(dst)
    if fmt not in ("safetensors", "torch", "hf"):
        raise BadInput(f"unknown export format '{fmt}'", hint="Use safetensors, torch or hf.")
    if only not in ("model", "model+optim"):
        raise BadInput(f"--only must be 'model' or 'model+optim', got '{only}'")
    if fmt == "hf" and only != "model":
        raise BadInput("--format hf exports model weights only (a transformers model has no optimizer state)",
                       hint="Drop --only, or use --format safetensors --only model+optim.")
    if fmt == "hf" and rename is not None:
        raise BadInput("--format hf names every parameter by the family's mapping (formats/hf/); --rename does not apply",
                       hint="Drop --rename, or use --format safetensors --rename FILE.")
    if fmt != "hf" and model_config:
        raise BadInput("--model-config is for --format hf (the values config.json needs)")
    out_dtype = _dtype_arg(dtype)
    max_shard = parse_size(max_shard_size)
    rules = RenameRules.load(rename) if rename is not None else None
    check_destination(src, dst)

    ix = open_any(src, source_key=reshard_key)
    errors = [f for f in ix.findings if f.severity == "error"]
    if errors:
        raise Incomplete(f"the source checkpoint is incomplete: {errors[0].message}", where=str(src),
                         hint="Run `reshard inspect` for the full list; export only a complete checkpoint.")
    m = read_manifest(src)
    mdict = m.to_dict() if m is not None else {}
    cls = classify(((k, e.kind) for k, e in ix.entries.items()), prefer=mdict.get("key_convention"))
    plan = _plan(ix, cls, mdict, only=only, dtype=out_dtype, rules=rules)
    if not plan.items:
        raise BadInput("the checkpoint holds no parameters to export", where=str(src))
    hf = hf_plan(src, ix, cls, mdict, plan, model_config or {}, out_dtype) if fmt == "hf" else None
    ext = "pt" if fmt == "torch" else "safetensors"
    shards = _assign_shards(plan.items, max_shard, ext)
    ess = _essentials(src, mdict, cls.convention.name, dtype=out_dtype, only=only, rules=rules, tied=plan.tied, fmt=fmt)
    ess.update(_identity(src, mdict))
    if hf is not None:
        ess.update(hf_mapping=hf.mapping.describe(), hf_values=hf.values)
    total = sum(it.nbytes for it in plan.items)
    if progress is not None:
        progress.say(f"exporting {describe_bytes(total, len(plan.items), 'tensor')} as {fmt} …")

    needed = _estimate_bytes(shards, "safetensors" if fmt == "hf" else fmt, lambda s: _header_metadata(ess, s, plan.copies))
    estimate = preflight(dst, needed=needed, read_bytes=sum(ix.entries[it.key].nbytes for it in plan.items
                                                             if it.key in ix.entries) or total,
                         sources=[src], force=force, what="the export", progress=progress)
    with space_errors(dst, needed, "the export"), atomic_directory(dst, overwrite=overwrite) as tmp:
        with phase_of(progress, "writing", total) as bar:
            for shard in shards:
                if not shard:
                    continue
                path = tmp / shard[0].file
                if fmt == "torch":
                    _write_torch_shard(ix, path, shard, bar)
                else:
                    _write_safetensors_shard(ix, path, shard, _header_metadata(ess, shard, plan.copies), bar)
        index = {"metadata": {"total_size": total,
                              "reshard": {**ess, "export_map": _export_map(plan.items, plan.copies)}},
                 "weight_map": {it.name: it.file for it in plan.items}}
        index_name = None
        if fmt == "torch":
            index_name = PT_INDEX
        elif len(shards) > 1:
            index_name = ST_INDEX
        if index_name:
            (tmp / index_name).write_text(json.dumps(index, indent=2) + "\n")
        if hf is not None:
            (tmp / HF_CONFIG).write_text(json.dumps(hf.config, indent=2) + "\n")
        with phase_of(progress, "verifying", total) as bar:
            verification = _verify_export(ix, tmp, plan, "torch" if fmt == "torch" else "safetensors", bar)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        report = {
            "report_version": 1,
            "source": str(src.resolve()),
            "destination": str(dst.resolve()),
            "format": fmt,
            "dtype": ess["dtype"],
            "only": only,
            "rename": ess["rename"],
            "max_shard_size": max_shard,
            "memory_bound": ("one shard (torch.save needs the dict)" if fmt == "torch" else "largest tensor (streamed)"),
            "essentials": {k: v for k, v in ess.items() if k not in ("tied",)},
            "shards": [s[0].file for s in shards if s],
            "index": index_name,
            "total_size": total,
            "tensors_exported": len(plan.items),
            "tied": plan.tied,
            "warnings": plan.warnings,
            "keys": plan.keys,
            "verification": verification,
            "files": files,
            # no wall time under SOURCE_DATE_EPOCH: reproducible outputs, as convert and import
            "seconds": None if os.environ.get("SOURCE_DATE_EPOCH") else round(_time.time() - started, 3),
        }
        report["estimate"] = estimate
        if profile is not None:
            report["profile"] = profile
        if hf is not None:
            report["hf"] = {"mapping": hf.mapping.describe(), "config": HF_CONFIG, "values": hf.values,
                            "values_from": hf.origin, "transforms": hf.transforms}
        # no measured figure on disk under SOURCE_DATE_EPOCH (free space, probes), as no wall time
        on_disk = {**report, "estimate": None} if os.environ.get("SOURCE_DATE_EPOCH") else report
        (tmp / REPORT).write_text(json.dumps(on_disk, indent=2, default=str) + "\n")
        if not verification["equal"]:
            raise Infeasible("the export does not read back as the source: " + "; ".join(verification["differences"][:5]),
                             where=str(dst), hint="Nothing was committed. This is a bug in reshard; please report it.")
        commit = start_commit(progress, tmp)  # the fsync and rename as the block exits
    end_commit(progress, commit)
    return report


def _identity(src: Path, mdict: dict[str, Any]) -> dict[str, Any]:
    """Step and lineage as `reshard inspect` finds them (a checkpoint without a manifest still has a step).

    The step comes from inspect's rules (manifest, counter or optimizer step counters), so an
    export of a torchtitan checkpoint records ``train_state.step`` instead of null.
    """
    from reshard.planning.describe import inspect_checkpoint
    from reshard.errors import ReshardError

    try:
        r = inspect_checkpoint(src).report
    except ReshardError:
        return {"step_source": None, "lineage": mdict.get("lineage") or []}
    out: dict[str, Any] = {"step": r.get("step"), "step_source": r.get("step_source"),
                           "lineage": r.get("lineage") or mdict.get("lineage") or []}
    if out["step"] is None:
        out["step"] = mdict.get("step")
    if mdict.get("tokens_seen") is None and r.get("tokens_seen") is not None:
        out["tokens_seen"] = r.get("tokens_seen")
    return out


# ===================================================================================== --format hf
HF_CONFIG = "config.json"


@dataclass
class HfPlan:
    """What ``--format hf`` adds to an export plan: the mapping, its values and the config.json they make."""

    mapping: Any                      # reshard.semantics.hf.HfMapping
    values: dict[str, Any]
    origin: dict[str, str]            # value -> where it came from
    config: dict[str, Any]
    transforms: dict[str, str]        # exported name -> the transform applied (only names with one)
    family: str = ""


def _hf_given(mdict: dict[str, Any], cli: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    given: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for k, v in ((mdict.get("model") or {}).get("config") or {}).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            given[k], origin[k] = v, "manifest model.config"
    for k, v in cli.items():
        given[k], origin[k] = v, "--model-config"
    return given, origin


def _source_tp(src: Path) -> int:
    """The TP degree the source was written at (a fused TP layout's global view depends on it), as inspect finds it."""
    from reshard.planning.describe import inspect_checkpoint

    topo = inspect_checkpoint(src).report.get("topology") or {}
    tp = topo.get("tp")
    if not isinstance(tp, int) or tp < 1 or topo.get("ambiguous"):
        raise BadInput("the source's TP degree is not known, and its fused tensors are laid out per TP rank",
                       where=str(src), hint="Record the topology in the manifest (reshard convert writes one).")
    return tp


def hf_plan(src: Path, ix, cls, mdict: dict[str, Any], plan: _Plan, model_config: dict[str, Any],
            dtype: torch.dtype | None) -> HfPlan:
    """Map ``plan`` (every parameter, ties written once) to the family's Hugging Face names and transforms, in place.

    Public for `reshard verify SRC HF_EXPORT`, which re-derives the export from the source the same way.
    Strict: a parameter the mapping does not name is refused, naming it; so is a tie the HF class
    cannot express. ``model_config``: the values given on the command line (they win over the manifest).
    """
    from reshard.semantics.hf import mapping_for
    from reshard.semantics.rules import select

    params = {r.param: k for k, r in cls.roles.items() if r.role == "parameter" and r.param and ix.entries[k].is_tensor}
    family = (mdict.get("model") or {}).get("family")
    rules = select(sorted(params), family=family if isinstance(family, str) else None)
    mapping = mapping_for(rules.family)
    for fqn in sorted(params):
        mapping.rule(fqn)  # strict: refuse the first unmapped parameter by name, before anything is read
    given, origin = _hf_given(mdict, model_config)
    shapes = {fqn: tuple(ix.entries[k].shape) for fqn, k in params.items()}
    values = mapping.values(shapes, given, where=str(src))
    for k in values:
        origin.setdefault(k, "checkpoint shapes" if k not in mapping.defaults and k not in mapping.derive
                          else ("default" if k in mapping.defaults else "derived"))
    tied = False
    for group in plan.tied_fqns:
        names = {mapping.hf_name(f) for f in group}
        if mapping.tie is None or names != set(mapping.tie):
            raise BadInput(f"the tied parameters {group} map to {sorted(names)}, which {mapping.architecture} "
                           "cannot tie", where=str(src), hint=f"Declare `tie` in {mapping.source} if the class ties them.")
        tied = True
    seen: dict[str, str] = {}
    transforms: dict[str, str] = {}
    items: list[_Item] = []
    source_tp: int | None = None
    for it in plan.items:
        fqn = cls.roles[it.key].param
        rule, groups = mapping.rule(fqn)
        names = rule.hf_names(groups)
        for name in names:
            if name in seen:
                raise BadInput(f"'{seen[name]}' and '{it.key}' both map to '{name}'", where=mapping.source,
                               hint="The checkpoint holds two generations of one name; keep one.")
            seen[name] = it.key
        if rule.parts:  # one fused source tensor -> one exported tensor per part
            if rule.tp_layout and source_tp is None:
                source_tp = _source_tp(src)
            sizes = rule.part_sizes(values)
            for k, name in enumerate(names):
                shape = list(it.shape)
                shape[rule.dim] = sizes[k]
                items.append(_Item(it.key, name, it.role, tuple(shape), it.src_dtype, it.dtype, src_shape=it.shape,
                                   make=(lambda t, rule=rule, key=it.key, k=k, tp=source_tp or 1:
                                         rule.split_part(t, values, key, k, tp))))
                transforms[name] = f"split part {k + 1}/{len(names)} of dim {rule.dim}" + (
                    f" (TP layout of tp={source_tp})" if rule.tp_layout else "")
            continue
        it.name = names[0]
        it.src_shape = it.shape
        if it.shape:
            it.shape = (rule.out_rows(it.shape[0], values), *it.shape[1:])
        it.make = (lambda t, rule=rule, key=it.key: rule.to_hf(t, values, key))
        done = [d for d in ([f"rows[:{values[rule.rows]}]"] if rule.rows and it.src_shape[0] != it.shape[0] else [])
                + ([f"{rule.transform}({rule.heads}={values[rule.heads]})"] if rule.transform else [])]
        if done:
            transforms[it.name] = ", ".join(done)
        items.append(it)
    plan.items = items
    # before: copy fqn -> (source key, stored fqn) (no rename rules with --format hf)
    plan.copies = {mapping.hf_name(cls.roles[key].param): (key, mapping.hf_name(sname))
                   for key, sname in plan.copies.values()}
    plan.tied = [[mapping.hf_name(f) for f in g] for g in plan.tied_fqns]
    for rec in plan.keys:
        r = cls.roles[rec["key"]]
        if rec.get("name") and r.param:
            rec["name"] = mapping.hf_name(r.param)
            if rec["name"] in transforms:
                rec["transform"] = transforms[rec["name"]]
            if rec.get("action") == "exported":
                rec["exported_shape"] = [list(i.shape) for i in plan.items if i.key == rec["key"]]
                if len(rec["exported_shape"]) == 1:
                    rec["exported_shape"] = rec["exported_shape"][0]
    out_dt = dtype if dtype is not None else next((it.dtype for it in plan.items if it.dtype.is_floating_point), None)
    config = mapping.config(values, tied=tied, dtype=str(out_dt).removeprefix("torch.") if out_dt else "float32")
    return HfPlan(mapping, values, origin, config, transforms, rules.family)


def _estimate_bytes(shards: list[list[_Item]], fmt: str, metadata: Any) -> int:
    """What the shards will hold: tensor bytes, plus each safetensors header (computed exactly, no tensor read)."""
    total = sum(it.nbytes for shard in shards for it in shard)
    if fmt == "safetensors":
        total += sum(len(_st_header(shard, metadata(shard))) for shard in shards if shard)
    return total


def _verify_export(ix, out: Path, plan: _Plan, fmt: str, progress: Any = None) -> dict[str, Any]:
    """Read every exported tensor back (one at a time) and compare it bitwise with the cast source."""
    diffs: list[str] = []
    if fmt == "safetensors":
        from reshard.storage.safetensors_format import ExportIndex

        ex = ExportIndex(out, keys="stored")

        def back(it: _Item) -> torch.Tensor:
            return ex.read_tensor(it.name)
    else:
        loaded: dict[str, dict[str, torch.Tensor]] = {}

        def back(it: _Item) -> torch.Tensor:
            if it.file not in loaded:
                loaded.clear()
                loaded[it.file] = torch.load(out / it.file, map_location="cpu", weights_only=True, mmap=True)
            return loaded[it.file][it.name]
    for it in plan.items:
        a = _read_cast(ix, it)
        b = back(it)
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(
                a.reshape(-1).view(torch.uint8) if a.dtype != torch.bool else a, 
                b.reshape(-1).view(torch.uint8) if b.dtype != torch.bool else b):
            diffs.append(f"{it.name} ({it.key})")
        del a, b
        if progress is not None:
            progress.update(it.nbytes)
    return {"equal": not diffs, "tensors": len(plan.items), "differences": diffs}


# ===================================================================================== verify SRC HF_EXPORT
def hf_export_sides(a: Path, b: Path) -> tuple[Path, Path] | None:
    """(source, export) when exactly one side is a Hugging Face model directory and the other a checkpoint.

    A Hugging Face directory is safetensors weights with a ``config.json`` beside them (what
    ``--format hf`` writes and ``from_pretrained`` reads); a plain safetensors export has none
    and is compared by `reshard.verification.checkpoints` as before.
    """
    from reshard.storage.safetensors_format import is_export

    def hf(p: Path) -> bool:
        return p.is_dir() and is_export(p) and os.path.lexists(p / HF_CONFIG)

    ha, hb = hf(Path(a)), hf(Path(b))
    if ha == hb:
        return None
    return (Path(b), Path(a)) if ha else (Path(a), Path(b))


def compare_hf_export(src: Path, exp: Path, *, a: Path, b: Path, rtol: float = 0.0, atol: float = 0.0) -> dict[str, Any]:
    """`reshard verify SRC HF_EXPORT`: the export re-derived from SRC through the same declared transforms.

    Nothing the export says about itself is evidence of what it should hold: the names, the
    transforms, the trimmed rows and the tied copies are recomputed from the source with the
    family's mapping (`hf_plan`, exactly as `export` does). What the source cannot know (head
    counts, norm epsilon, RoPE values) is taken from the export's ``config.json``, the values the
    weights are then checked under, and listed in ``notes``; the recomputed ``config.json``
    fields must equal the export's. The dtype is the export's recorded ``--dtype`` (an option,
    like a conversion's plan options), else the source's. Then every tensor is compared bit for
    bit (or within ``rtol``/``atol``). The result has `reshard.verification.checkpoints`'s shape.
    """
    from reshard import safefs
    from reshard.semantics.conventions import classify, reshard_key
    from reshard.semantics.hf import mapping_for
    from reshard.semantics.manifest import read_manifest
    from reshard.semantics.rules import select
    from reshard.storage.local_format import open_any
    from reshard.storage.safetensors_format import ExportIndex

    diffs: list[dict[str, Any]] = []
    notes: list[str] = []
    ix = open_any(src, source_key=reshard_key)
    errors = [f for f in ix.findings if f.severity == "error"]
    if errors:
        raise Incomplete(f"the checkpoint is incomplete: {errors[0].message}", where=str(src))
    m = read_manifest(src)
    mdict = m.to_dict() if m is not None else {}
    cls = classify(((k, e.kind) for k, e in ix.entries.items()), prefer=mdict.get("key_convention"))
    ex = ExportIndex(exp, keys="stored")
    root = safefs.resolve_root(exp)
    cfg = safefs.read_json(root / HF_CONFIG, root=root, what="Hugging Face config.json")
    if not isinstance(cfg, dict):
        raise BadInput(f"{HF_CONFIG} is not a JSON object", where=str(exp / HF_CONFIG))
    params = sorted(r.param for k, r in cls.roles.items() if r.role == "parameter" and r.param and ix.entries[k].is_tensor)
    family = (mdict.get("model") or {}).get("family")
    mapping = mapping_for(select(params, family=family if isinstance(family, str) else None).family)
    from_config = mapping.values_from_config(cfg, where=str(exp / HF_CONFIG))
    asked = {a.name: from_config[a.name] for a in mapping.asks if a.name in from_config}
    notes.append("checked under the export's config.json values the checkpoint cannot hold: "
                 + ", ".join(f"{k}={v}" for k, v in sorted(asked.items())))
    recorded = ex.source_essentials().get("dtype")
    dtype = _dtype_arg(recorded) if isinstance(recorded, str) and recorded.lower() in DTYPES else None
    plan = _plan(ix, cls, mdict, only="model", dtype=dtype, rules=None)
    hf = hf_plan(src, ix, cls, mdict, plan, asked, dtype)
    for k in sorted(set(hf.config) | set(cfg)):
        if k == "dtype":
            continue
        if hf.config.get(k) != cfg.get(k):
            diffs.append({"key": f"{HF_CONFIG}:{k}", "kind": "config",
                          "detail": f"recomputed from the source {hf.config.get(k)!r}, export has {cfg.get(k)!r}",
                          "a": hf.config.get(k), "b": cfg.get(k)})
    expected = {it.name: it for it in plan.items}
    elements = nbytes = 0
    for name, it in expected.items():
        if name not in ex.entries:
            diffs.append({"key": name, "kind": "missing", "detail": f"the export of '{it.key}' is not in the export"})
            continue
        want = _read_cast(ix, it)
        got = ex.read_tensor(name)
        if tuple(got.shape) != tuple(want.shape):
            diffs.append({"key": name, "kind": "shape", "detail": f"{list(want.shape)} expected, {list(got.shape)} stored",
                          "a": list(want.shape), "b": list(got.shape)})
        elif got.dtype != want.dtype and not (rtol or atol):
            diffs.append({"key": name, "kind": "dtype", "detail": f"{want.dtype} expected, {got.dtype} stored",
                          "a": str(want.dtype), "b": str(got.dtype)})
        else:
            if rtol or atol:
                close = torch.isclose(want.double(), got.double(), rtol=rtol, atol=atol, equal_nan=True)
            else:
                close = want.reshape(-1).view(torch.uint8).reshape(want.numel(), -1) == \
                    got.reshape(-1).view(torch.uint8).reshape(got.numel(), -1)
                close = close.all(dim=-1).reshape(want.shape) if want.numel() else close
            bad = int((~close).sum()) if want.numel() else 0
            if bad:
                first = tuple(int(i) for i in (~close).nonzero()[0])
                diffs.append({"key": name, "kind": "value", "detail": f"{bad} of {want.numel()} elements differ "
                              f"(first at {list(first)}: {want[first].item()!r} expected, {got[first].item()!r} stored)",
                              "index": list(first), "a": want[first].item(), "b": got[first].item(), "count": bad,
                              "numel": want.numel()})
            elements += want.numel()
            nbytes += want.numel() * want.element_size()
        del want, got
    for name in sorted(set(ex.entries) - set(expected)):
        if name in plan.copies:
            notes.append(f"{name}: a tied copy, stored although the export writes it once")
            continue
        diffs.append({"key": name, "kind": "unexpected", "detail": "stored in the export, not an export of any source parameter"})
    return {
        "equal": not diffs, "a": str(a), "b": str(b),
        "compared": {"tensors": len(expected), "objects": 0, "elements": elements, "bytes": nbytes},
        "differences": diffs, "rewritten": [], "notes": notes,
        "evidence": f"the export of {src} re-derived with {mapping.source} (names, transforms, config.json)",
        "tolerance": {"rtol": rtol, "atol": atol}, "exit_code": 0 if not diffs else 1,
    }
