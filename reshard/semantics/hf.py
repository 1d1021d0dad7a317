"""What a model family means in Hugging Face terms: names, weight transforms and ``config.json``.

Read from ``formats/hf/<family>.toml`` (the family of ``formats/models/``). Nothing here
reads or writes a byte: the exporter and the importer (`reshard.planning.export`,
`reshard.engine.import_sources`) read tensors and hand them to :meth:`ParamMap.to_hf` /
:meth:`ParamMap.from_hf`, which only reorder or trim rows.

Why the mapping is data: the two families differ in more than names (the rotary row order,
a padded vocabulary), and the difference has to be declared once where it can be read and
checked, not rediscovered per model in code. Why it is strict: a name left unmapped is a
weight `from_pretrained` initialises at random and reports only as a warning; refusing it
here, naming it, is the only place it is cheap to notice.

Transforms (``transform = NAME`` in a ``[[param]]``):

``rotary_half`` (``heads = NAME``)
    torchtitan's RoPE (``ComplexRoPE``) rotates each head's rows in adjacent pairs
    (2j, 2j+1); HF Llama's ``rotate_half`` rotates row j against row j + head_dim/2. The
    same attention is obtained when, within each head, row ``2j + p`` of the torchtitan
    weight becomes row ``p * head_dim/2 + j`` of the HF weight (p in {0, 1}); q and k get
    the same reordering, so q.k is unchanged. The inverse puts the rows back.

``split`` (``dim``, ``parts = [{hf, size}, ...]``, ``tp_layout``)
    One fused source tensor (Q/K/V, gate/up) is several HF tensors: the parts, in order,
    along ``dim``, of the sizes given (expressions over the values). With ``tp_layout = true``
    the source's global view holds ``[p0_r; p1_r; ...]`` per TP rank r (formats/models/
    llama-fused.toml's ``fused`` layout), so it is first put in the canonical order
    ``[p0; p1; ...]`` for the source's TP degree (`reshard.semantics.transforms.to_canonical`).
    An import does not fuse parts back (refused, naming the name).

``rows = NAME`` (any param)
    Keep the first NAME rows on export (a vocabulary padded to a TP multiple is trimmed to
    the real one); the import writes what it reads.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the mapping and its checks run on the metadata path, without torch
    import torch

from reshard.errors import BadInput
from reshard.paths import formats_root
from reshard.patterns import Pattern, compile_pattern
from reshard.safefs import loads_toml

TRANSFORMS = ("rotary_half", "split")
_FIELD = re.compile(r"\{(\w+)\}")


# ------------------------------------------------------------------ transforms (tensor math only)

def _heads_view(t: torch.Tensor, heads: int, name: str) -> tuple[int, int]:
    rows = t.shape[0]
    if heads < 1 or rows % heads or (rows // heads) % 2:
        raise BadInput(f"'{name}' has {rows} rows, which {heads} heads of even size cannot cover",
                       hint="Check the head count given (--model-config n_heads=... / n_kv_heads=...).")
    return rows // heads, int(math.prod(t.shape[1:]))


def rotary_to_half(t: torch.Tensor, heads: int, name: str = "tensor") -> torch.Tensor:
    """Adjacent-pair rotary row order (torchtitan) -> half-split order (HF Llama), per head."""
    hd, cols = _heads_view(t, heads, name)
    return t.reshape(heads, hd // 2, 2, cols).transpose(1, 2).reshape(t.shape).contiguous()


def rotary_from_half(t: torch.Tensor, heads: int, name: str = "tensor") -> torch.Tensor:
    """The inverse of :func:`rotary_to_half`."""
    hd, cols = _heads_view(t, heads, name)
    return t.reshape(heads, 2, hd // 2, cols).transpose(1, 2).reshape(t.shape).contiguous()


# ------------------------------------------------------------------ the mapping

@dataclass(frozen=True)
class ParamMap:
    """One ``[[param]]``: a source FQN pattern, its HF and native names, and its transform."""

    match: Pattern
    hf: str
    native: str
    transform: str | None = None
    heads: str | None = None
    rows: str | None = None
    dim: int = 0
    parts: tuple[tuple[str, str], ...] = ()     # split: (hf name template, size expression)
    tp_layout: bool = False

    def hf_pattern(self) -> re.Pattern[str]:
        return _template_pattern(self.hf)

    def hf_names(self, groups: dict[str, str]) -> list[str]:
        """The exported name(s): one, or one per part of a split."""
        return [h.format(**groups) for h, _ in self.parts] if self.parts else [self.hf.format(**groups)]

    def part_sizes(self, values: dict[str, Any]) -> list[int]:
        from reshard.semantics.rules import evaluate

        return [evaluate(size, values) for _, size in self.parts]

    def split_part(self, t: torch.Tensor, values: dict[str, Any], name: str, k: int, source_tp: int) -> torch.Tensor:
        """Part ``k`` of a fused tensor written at TP degree ``source_tp``."""
        from reshard.semantics.transforms import to_canonical

        sizes = self.part_sizes(values)
        if sum(sizes) != t.shape[self.dim]:
            raise BadInput(f"'{name}' has {t.shape[self.dim]} rows along dim {self.dim}, its parts add up to {sum(sizes)} "
                           f"({', '.join(s for _, s in self.parts)})",
                           hint="Check the head counts given (--model-config n_heads=... / n_kv_heads=...).")
        if self.tp_layout:
            try:
                t = to_canonical(t, self.dim, sizes, source_tp)
            except ValueError as exc:
                raise BadInput(f"'{name}': {exc}") from None
        start = sum(sizes[:k])
        return t.narrow(self.dim, start, sizes[k]).contiguous()

    def to_hf(self, t: torch.Tensor, values: dict[str, Any], name: str) -> torch.Tensor:
        """The exported tensor: rows trimmed, then transformed."""
        if self.rows is not None:
            n = int(values[self.rows])
            if n > t.shape[0]:
                raise BadInput(f"'{name}' has {t.shape[0]} rows, fewer than {self.rows} = {n}",
                               hint=f"Pass --model-config {self.rows}=N with N <= {t.shape[0]}.")
            t = t[:n]
        if self.transform == "rotary_half":
            t = rotary_to_half(t, int(values[self.heads]), name)
        return t.contiguous()

    def from_hf(self, t: torch.Tensor, values: dict[str, Any], name: str) -> torch.Tensor:
        """The native tensor of an HF one (the inverse transform; trimmed rows are not re-padded)."""
        if self.transform == "rotary_half":
            t = rotary_from_half(t, int(values[self.heads]), name)
        return t.contiguous()

    def out_rows(self, rows: int, values: dict[str, Any]) -> int:
        return int(values[self.rows]) if self.rows is not None else rows


def _template_pattern(template: str) -> re.Pattern[str]:
    out, pos = "", 0
    for m in _FIELD.finditer(template):
        out += re.escape(template[pos:m.start()]) + f"(?P<{m.group(1)}>\\d+)"
        pos = m.end()
    return re.compile("^" + out + re.escape(template[pos:]) + "$")


@dataclass(frozen=True)
class Ask:
    name: str
    type: str
    example: str
    why: str


@dataclass
class HfMapping:
    """A family's Hugging Face mapping (``formats/hf/<family>.toml``)."""

    family: str
    source: str
    architecture: str
    native: str
    native_convention: str
    params: list[ParamMap]
    shapes: dict[str, tuple[Pattern, int]]
    counts: dict[str, Pattern]
    asks: list[Ask]
    defaults: dict[str, Any]
    derive: dict[str, str]
    config_json: dict[str, Any]
    config_from: dict[str, str]
    tie: tuple[str, str] | None = None
    warnings: list[str] = field(default_factory=list)

    # ---------------------------------------------------------------- names
    def rule(self, fqn: str) -> tuple[ParamMap, dict[str, str]]:
        """The rule of a source parameter and its groups; an unmapped parameter is refused, naming it."""
        for p in self.params:
            m = p.match.match(fqn)
            if m:
                return p, {k: v for k, v in m.groupdict().items() if v is not None}
        raise BadInput(f"parameter '{fqn}' has no Hugging Face name in the mapping of '{self.family}'",
                       where=self.source,
                       hint=f"Add a [[param]] for it to {self.source} (or a copy of it); the export maps every "
                            "parameter or none, since an unmapped weight would be initialised at random by from_pretrained.")

    def hf_name(self, fqn: str) -> str:
        p, g = self.rule(fqn)
        return ", ".join(p.hf_names(g))

    def from_hf_name(self, name: str) -> tuple[ParamMap, str]:
        """(rule, native name) of an HF parameter name; an unknown name is refused, naming it."""
        for p in self.params:
            if p.parts and any(_template_pattern(h).match(name) for h, _ in p.parts):
                raise BadInput(f"'{name}' is one part of a fused '{self.family}' tensor ({p.native}); an import does "
                               "not fuse parts back", where=self.source,
                               hint="Import to a family whose native names are unfused (e.g. --format torchtitan).")
            m = p.hf_pattern().match(name)
            if m:
                return p, p.native.format(**m.groupdict())
        raise BadInput(f"'{name}' is not a {self.architecture} parameter name the mapping of '{self.family}' knows",
                       where=self.source, hint=f"Add a [[param]] for it to {self.source}.")

    # ---------------------------------------------------------------- values and config.json
    def values(self, shapes: dict[str, tuple[int, ...]], given: dict[str, Any], *, where: str) -> dict[str, Any]:
        """Every value the mapping needs: given, read from the shapes, defaulted or derived; missing ones asked once.

        ``shapes``: parameter FQN -> global shape. A given value that contradicts a shape is refused
        naming both.
        """
        read: dict[str, tuple[int, str]] = {}
        for name, (pat, axis) in self.shapes.items():
            for fqn in sorted(shapes):
                if pat.match(fqn) and len(shapes[fqn]) > axis:
                    v = int(shapes[fqn][axis])
                    if name in read and read[name][0] != v:
                        raise BadInput(f"'{read[name][1]}' and '{fqn}' disagree on {name} ({read[name][0]} vs {v})",
                                       where=where)
                    read.setdefault(name, (v, fqn))
        for name, pat in self.counts.items():
            found = {m.group(1) for fqn in shapes for m in [pat.match(fqn)] if m}
            if found:
                read[name] = (len(found), f"{len(found)} distinct {pat.pattern}")
        out: dict[str, Any] = {}
        for name, (v, fqn) in read.items():
            if name in given and given[name] != v:
                raise BadInput(f"the value {name}={given[name]} contradicts the checkpoint: {fqn} gives {v}",
                               where=where, hint=f"Drop {name} (it is read from the checkpoint) or fix it to {v}.")
            out[name] = v
        for k, v in given.items():
            out.setdefault(k, v)
        missing = [a for a in self.asks if a.name not in out]
        if missing:
            listed = "; ".join(f"{a.name} ({a.type}: {a.why})" for a in missing)
            example = " ".join(f"--model-config {a.name}={a.example}" for a in missing)
            known = ", ".join(f"{k}={v}" for k, v in sorted(read.items()) for v in [v[0]])
            raise BadInput(f"the Hugging Face config of '{self.family}' needs {len(missing)} value"
                           f"{'s' if len(missing) > 1 else ''} the checkpoint does not hold: {listed}"
                           + (f" (read from the checkpoint: {known})" if known else "") + ".", where=where,
                           hint=f"Pass them all at once, e.g. {example} (or record them in the manifest's model.config).")
        for a in self.asks:
            v = out[a.name]
            ok = (isinstance(v, int) and not isinstance(v, bool)) if a.type == "int" else isinstance(v, (int, float)) \
                and not isinstance(v, bool)
            if not ok:
                raise BadInput(f"{a.name} must be {'an integer' if a.type == 'int' else 'a number'}, got {v!r}",
                               hint=f"e.g. --model-config {a.name}={a.example}")
        for k, v in self.defaults.items():
            if k not in out:
                out[k] = out[v] if isinstance(v, str) else v
        from reshard.semantics.rules import evaluate

        for k, expr in self.derive.items():
            if k not in out:
                out[k] = evaluate(expr, out)
        return out

    def config(self, values: dict[str, Any], *, tied: bool, dtype: str) -> dict[str, Any]:
        """``config.json``: the literal fields and those taken from ``values`` (dotted names nest)."""
        cfg: dict[str, Any] = {"architectures": [self.architecture]}
        for k, v in self.config_json.items():
            _put(cfg, k, v)
        for k, name in self.config_from.items():
            _put(cfg, k, values[name])
        cfg["tie_word_embeddings"] = bool(tied)
        cfg["dtype"] = dtype
        return cfg

    def values_from_config(self, cfg: dict[str, Any], *, where: str) -> dict[str, Any]:
        """The values an import needs, read back from an HF ``config.json`` (the inverse of :meth:`config`)."""
        out: dict[str, Any] = {}
        for k, name in self.config_from.items():
            v: Any = cfg
            for part in k.split("."):
                v = v.get(part) if isinstance(v, dict) else None
            if v is not None:
                out[name] = v
        for name in {p.heads for p in self.params if p.heads}:
            v = out.get(name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise BadInput(f"config.json gives no usable {name} ({v!r}), which the inverse rotary permutation needs",
                               where=where, hint="Fix config.json (num_attention_heads / num_key_value_heads).")
        return out

    def describe(self) -> dict[str, Any]:
        return {"family": self.family, "file": self.source, "architecture": self.architecture}


def _put(cfg: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    d = cfg
    for p in parts[:-1]:
        d = d.setdefault(p, {})
    d[parts[-1]] = value


def _load(path: Path) -> HfMapping:
    where = str(path)
    try:
        spec = loads_toml(path.read_text(encoding="utf-8"), where=where, what="Hugging Face mapping")
        params = []
        for p in spec.get("param", []):
            tr = p.get("transform")
            if tr is not None and tr not in TRANSFORMS:
                raise ValueError(f"unknown transform {tr!r} (known: {', '.join(TRANSFORMS)})")
            if tr == "rotary_half" and not p.get("heads"):
                raise ValueError(f"transform rotary_half of {p['match']!r} needs heads = NAME")
            parts = tuple((str(x["hf"]), str(x["size"])) for x in p.get("parts", []))
            if (tr == "split") != bool(parts) or (parts and len(parts) < 2):
                raise ValueError(f"{p['match']!r}: transform split and parts = [{{hf, size}}, ...] (two or more) go together")
            params.append(ParamMap(compile_pattern(p["match"], where, what="[[param]] match"), str(p.get("hf", parts[0][0] if parts else "")),
                                   str(p["native"]), tr, p.get("heads"), p.get("rows"), int(p.get("dim", 0)), parts,
                                   bool(p.get("tp_layout", False))))
        if not params:
            raise ValueError("no [[param]] entries")
        tie = spec.get("tie")
        return HfMapping(
            family=str(spec["family"]), source=str(path), architecture=str(spec["architecture"]),
            native=str(spec.get("native", "")), native_convention=str(spec.get("native_convention", "reshard")),
            params=params,
            shapes={k: (compile_pattern(v["from"], where, what=f"[shape.{k}] from"), int(v["axis"])) for k, v in spec.get("shape", {}).items()},
            counts={k: compile_pattern(v["from"], where, what=f"[count.{k}] from") for k, v in spec.get("count", {}).items()},
            asks=[Ask(k, str(v.get("type", "int")), str(v.get("example", "N")), str(v.get("why", "")))
                  for k, v in spec.get("ask", {}).items()],
            defaults=dict(spec.get("default", {})), derive={k: str(v) for k, v in spec.get("derive", {}).items()},
            config_json=dict(spec.get("config_json", {})), config_from={k: str(v) for k, v in spec.get("config_from", {}).items()},
            tie=(str(tie[0]), str(tie[1])) if tie else None,
        )
    except (KeyError, ValueError, TypeError, IndexError, OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"invalid Hugging Face mapping: {exc}", where=str(path)) from None


@lru_cache(maxsize=None)
def _shipped() -> dict[str, HfMapping]:
    return {m.family: m for m in (_load(p) for p in sorted((formats_root() / "hf").glob("*.toml")))}


# Families reshard ships partition rules for but no Hugging Face class matches; said plainly instead of
# "no mapping", so nobody writes one that cannot load.
NOT_MAPPED = {
    "reference-gpt": "reshard's reference GPT is not exported to a transformers class: the nearest, GPT2LMHeadModel, "
                     "stores its projections as Conv1D (transposed) with q/k/v fused in one c_attn, and no "
                     "mapping of those is shipped; export it with --format safetensors (reshard's own names)",
}


def shipped_families() -> list[str]:
    return sorted(_shipped())


def mapping_for(family: str) -> HfMapping:
    """The shipped mapping of ``family``; a family without one is refused, saying why."""
    m = _shipped().get(family)
    if m is not None:
        return m
    if family in NOT_MAPPED:
        raise BadInput(NOT_MAPPED[family] + ".", hint="Use --format safetensors for reshard's own names.")
    raise BadInput(f"no Hugging Face mapping is shipped for the model family '{family}' (mapped: "
                   f"{', '.join(shipped_families())})",
                   hint="Write formats/hf/<family>.toml (see formats/hf/llama-torchtitan.toml), or export with "
                        "--format safetensors.")


def parse_values(items: list[str] | None) -> dict[str, Any]:
    """``--model-config name=value`` (repeatable): an integer where it reads as one, else a float."""
    out: dict[str, Any] = {}
    for item in items or []:
        name, sep, text = str(item).partition("=")
        name, text = name.strip(), text.strip()
        if not sep or not name.isidentifier() or not text:
            raise BadInput(f"--model-config expects name=value, got '{item}'", hint="e.g. --model-config rms_norm_eps=1e-5")
        try:
            out[name] = int(text)
        except ValueError:
            try:
                v = float(text)
            except ValueError:
                raise BadInput(f"--model-config {name}: '{text}' is not a number", hint="Give an integer or a float.") from None
            if not math.isfinite(v):
                raise BadInput(f"--model-config {name}: '{text}' is not a finite number")
            out[name] = v
    return out
