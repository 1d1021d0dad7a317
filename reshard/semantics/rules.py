"""Per-parameter partition rules, read from `formats/models/*.toml` (or a user file).

A rule says how one parameter is laid out under tensor parallelism (replicated, sharded
along a dim, fused parts re-interleaved per TP rank, vocab padded per TP degree) and on
which pipeline stage it lives. There is no default placement: a parameter no rule covers
is an error that names it (DeepSpeed's silent "concatenate on dim 0" is the failure this
avoids, DeepSpeed #6503).
"""
from __future__ import annotations

import ast
import operator
import os
import stat
from dataclasses import dataclass, field
from functools import lru_cache
from math import ceil
from pathlib import Path
from typing import Any

from reshard.errors import BadInput
from reshard.paths import formats_root
from reshard.patterns import Pattern, compile_pattern
from reshard.safefs import loads_toml


@dataclass(frozen=True)
class Part:
    name: str
    size: str  # expression over the model config


@dataclass(frozen=True)
class Vocab:
    size: str
    multiple: str | None
    fill: float
    # A family that pads only when the run says so (torchtitan pads nothing; a run of the same
    # names that padded records it): the padding applies when this config name is known,
    # and the rows are carried as saved otherwise. None: the family always pads (Megatron).
    only_if: str | None = None


@dataclass(frozen=True)
class ParamRule:
    pattern: str
    tp: str  # "replicate" | "shard" | "fused"
    dim: int = 0
    parts: tuple[Part, ...] = ()
    divisible: tuple[str, ...] = ()
    vocab: Vocab | None = None


@dataclass(frozen=True)
class ConfigShape:
    """A model config value that is a tensor dimension: ``[config.NAME] from = REGEX, axis = N``.

    Read from the checkpoint's (global) shape of the parameters whose FQN matches ``from``,
    so the user never has to type a number the checkpoint already holds.
    """

    name: str
    source: Pattern
    axis: int


@dataclass
class Pipeline:
    layer: Pattern | None
    num_layers: str | None
    first: list[Pattern]
    last: list[Pattern]
    tied: list[tuple[str, str]]


@dataclass
class ModelRules:
    family: str
    description: str
    source: str
    params: list[tuple[Pattern, ParamRule]]
    pipeline: Pipeline
    match_params: list[Pattern] = field(default_factory=list)
    config_shapes: list[ConfigShape] = field(default_factory=list)

    def rule_for(self, fqn: str) -> ParamRule | None:
        for pat, rule in self.params:
            if pat.match(fqn):
                return rule
        return None


MAX_RULES_BYTES = 1 << 20  # a rules TOML is a few kB; anything far larger is not one


_FILE_HINT = "Pass a path to a partition rules TOML (formats/models/*.toml format)."


def _read(path: Path, way_out: str = _FILE_HINT) -> str:
    """A rules file's text; a missing path, a directory, a FIFO or device, or an unreadable file is a BadInput.

    Checked with stat before opening, so that a FIFO never blocks the run and an oversized
    file is never read whole.
    """
    try:
        st = path.stat()
    except OSError as exc:
        raise BadInput(f"the partition rules file cannot be opened ({exc.strerror or exc}).", where=str(path),
                       hint=way_out) from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise BadInput(f"the partition rules path is {kind}.", where=str(path), hint=way_out)
    if st.st_size > MAX_RULES_BYTES:
        raise BadInput(f"the partition rules file is {st.st_size} bytes, larger than {MAX_RULES_BYTES}: not a rules TOML.",
                       where=str(path), hint=way_out)
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise BadInput(f"the partition rules file cannot be read ({exc.strerror or exc}).", where=str(path),
                       hint=way_out) from None
    except UnicodeDecodeError:
        raise BadInput("the partition rules file is not UTF-8 text (TOML).", where=str(path), hint=way_out) from None


def _load(path: Path, way_out: str = _FILE_HINT) -> ModelRules:
    path = Path(path)
    text = _read(path, way_out)
    where = str(path)
    spec = loads_toml(text, where=where, what="partition rules file")  # nesting bounded (exit 2 naming the file)
    try:
        if not isinstance(spec.get("family"), str) or not spec["family"]:
            raise ValueError("'family' must be a non-empty string naming the model family")
        params = []
        for p in spec.get("param", []):
            if p["tp"] not in ("replicate", "shard", "fused"):
                raise ValueError(f"tp must be replicate, shard or fused, got {p['tp']!r}")
            vocab = p.get("vocab")
            rule = ParamRule(
                pattern=p["match"], tp=p["tp"], dim=int(p.get("dim", 0)),
                parts=tuple(Part(x["name"], str(x["size"])) for x in p.get("parts", [])),
                divisible=tuple(str(x) for x in p.get("divisible", [])),
                vocab=Vocab(str(vocab["size"]), str(vocab["multiple"]) if vocab.get("multiple") else None,
                            float(vocab.get("fill", 0.0)),
                            str(vocab["only_if"]) if vocab.get("only_if") else None) if vocab else None,
            )
            if rule.tp == "fused" and len(rule.parts) < 2:
                raise ValueError(f"fused rule {p['match']!r} needs at least two parts")
            params.append((compile_pattern(p["match"], where, what="[[param]] match"), rule))
        pl = spec.get("pipeline", {})
        pipeline = Pipeline(
            layer=compile_pattern(pl["layer"], where, what="[pipeline] layer") if pl.get("layer") else None,
            num_layers=pl.get("num_layers"),
            first=[compile_pattern(x, where, what="[pipeline] first pattern") for x in pl.get("first", [])],
            last=[compile_pattern(x, where, what="[pipeline] last pattern") for x in pl.get("last", [])],
            tied=[tuple(t) for t in pl.get("tied", [])],  # type: ignore[misc]
        )
        return ModelRules(spec["family"], spec.get("description", ""), str(path), params, pipeline,
                          [compile_pattern(x, where, what="match_params pattern") for x in spec.get("match_params", [])],
                          _config_shapes(spec.get("config", {}), where))
    except (KeyError, ValueError, TypeError) as exc:
        raise BadInput(f"invalid partition rules: {exc}", where=str(path)) from None


def _config_shapes(tables: Any, where: str) -> list[ConfigShape]:
    """The ``[config.NAME]`` tables: each names the parameters (``from``, a regex) and the ``axis`` that is NAME."""
    if not isinstance(tables, dict):
        raise ValueError("[config] must be a table of [config.NAME] tables")
    out = []
    for name, t in tables.items():
        if not isinstance(t, dict) or not isinstance(t.get("from"), str) or not isinstance(t.get("axis"), int) \
                or isinstance(t.get("axis"), bool) or t["axis"] < 0:
            raise ValueError(f"[config.{name}] needs from = '<parameter regex>' and axis = <dim >= 0>")
        out.append(ConfigShape(name, compile_pattern(t["from"], where, what=f"[config.{name}] from"), t["axis"]))
    return out


@lru_cache(maxsize=1)
def builtin_rules() -> tuple[ModelRules, ...]:
    return tuple(_load(p) for p in sorted((formats_root() / "models").glob("*.toml")) if p.name != "ties.toml")


def shipped_families() -> list[str]:
    """The family names of the rules shipped in formats/models/ (what ``--rules NAME`` accepts)."""
    return sorted(r.family for r in builtin_rules())


def shipped(family: str) -> ModelRules | None:
    """The shipped rules of ``family`` (None: no shipped family has that name)."""
    return next((r for r in builtin_rules() if r.family == family), None)


def load_rules(name_or_path: str | Path) -> ModelRules:
    """``--rules NAME|FILE``: a shipped family by name, else a rules TOML at that path.

    A bare name (no path separator) equal to a shipped family is that family even if a file
    of the same name sits in the working directory (write ``./NAME`` for the file): the
    same option then means the same rules wherever the command runs. A value that is
    neither a family nor an existing path is an error listing the families, since a user
    who types ``--rules llama`` most likely meant one of them.
    """
    text = str(name_or_path)
    bare = not any(sep and sep in text for sep in (os.sep, os.altsep))
    if bare:
        found = shipped(text)
        if found is not None:
            return found
    families = shipped_families()
    way_out = (f"Pass a shipped family name ({', '.join(families)}) or a path to a partition rules TOML "
               "(formats/models/*.toml format).")
    path = Path(text)
    if not os.path.lexists(path):
        if not bare or text.endswith(".toml"):
            raise BadInput("no partition rules file at this path.", where=text, hint=way_out)
        close = [f for f in families if text in f or f in text]
        raise BadInput(f"--rules '{text}' is neither a shipped model family nor an existing file; the shipped "
                       f"families are {', '.join(families)}" + (f" (did you mean {' or '.join(close)}?)" if close else "")
                       + ".", hint="Pass one of those names, or a path to a partition rules TOML (formats/models/*.toml format).")
    return _load(path, way_out)


def select(params: list[str], *, family: str | None = None, rules_file: str | Path | None = None) -> ModelRules:
    """The rules for a checkpoint: ``--rules`` (a family name or a file), the manifest's family, or the family whose markers match."""
    if rules_file:
        return load_rules(rules_file)
    known = builtin_rules()
    if family:
        for r in known:
            if r.family == family:
                return r
    scored = sorted(known, key=lambda r: -sum(1 for m in r.match_params if any(m.match(p) for p in params)))
    if scored and any(m.match(p) for m in scored[0].match_params for p in params):
        return scored[0]
    raise BadInput("no partition rules match this model's parameter names",
                   hint="Pass --rules NAME (a shipped family: " + ", ".join(shipped_families()) + ") or --rules FILE (see formats/models/*.toml for the format).")


# ------------------------------------------------------------------ config expressions

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Div: operator.floordiv, ast.Mod: operator.mod}


def evaluate(expr: str, config: dict[str, Any]) -> int:
    """Integer arithmetic over config names; nothing else is evaluated."""
    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in config:
                raise BadInput(f"model configuration has no '{node.id}' (needed by '{expr}')",
                               hint=f"Pass --model-config {node.id}=N or record it in the manifest's model.config.")
            v = config[node.id]
            if not isinstance(v, int) or isinstance(v, bool):
                raise BadInput(f"model configuration '{node.id}' is not an integer ({v!r})")
            return v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise BadInput(f"unsupported expression '{expr}' in partition rules")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        raise BadInput(f"bad expression '{expr}' in partition rules") from None
    return ev(tree)


def names_in(expr: str) -> list[str]:
    """The config names an expression refers to, in order of appearance (a bad expression names none)."""
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        return []
    seen: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id not in seen:
            seen.append(node.id)
    return seen


def padded_vocab(vocab: Vocab, config: dict[str, Any], tp: int) -> tuple[int, int]:
    """(original, padded) rows: Megatron pads to a multiple of `multiple x tp`."""
    size = evaluate(vocab.size, config)
    mult = evaluate(vocab.multiple, config) if vocab.multiple else 1
    unit = mult * tp
    return size, int(ceil(size / unit) * unit)


def nearest_degrees(values: list[int], want: int, limit: int = 64) -> list[int]:
    ok = [d for d in range(1, limit + 1) if all(v % d == 0 for v in values)]
    return sorted(ok, key=lambda d: (abs(d - want), d))[:3]


def even_stages(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """[start, end) layer ranges of an even split (the first stages take the remainder)."""
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        out.append((start, start + n))
        start += n
    return out


def parse_stages(spec: str, num_layers: int, pp: int) -> list[tuple[int, int]]:
    """``"0-2,3-5"`` (inclusive ranges, one per stage, contiguous and covering every layer)."""
    try:
        ranges = []
        for part in spec.split(","):
            a, _, b = part.strip().partition("-")
            ranges.append((int(a), int(b or a) + 1))
    except ValueError:
        raise BadInput(f"bad --pp-stages '{spec}'", hint="Write inclusive layer ranges per stage, e.g. 0-2,3-5.") from None
    if len(ranges) != pp:
        raise BadInput(f"--pp-stages gives {len(ranges)} stages for pp={pp}")
    if ranges[0][0] != 0 or ranges[-1][1] != num_layers or any(x[1] != y[0] for x, y in zip(ranges, ranges[1:])) \
            or any(b <= a for a, b in ranges):
        raise BadInput(f"--pp-stages '{spec}' must cover layers 0..{num_layers - 1} contiguously, each stage non-empty")
    return ranges


def stage_of(fqn: str, rules: ModelRules, pp: int, num_layers: int,
             stages: list[tuple[int, int]] | None = None) -> int | None:
    """Pipeline stage holding ``fqn`` (even split unless ``stages`` is given); None when no pipeline rule places it."""
    pl = rules.pipeline
    if pl.layer is not None:
        m = pl.layer.match(fqn)
        if m:
            layer = int(m.group("layer"))
            for s, (a, b) in enumerate(stages or even_stages(num_layers, pp)):
                if a <= layer < b:
                    return s
            return pp - 1
    if any(p.match(fqn) for p in pl.first) and any(p.match(fqn) for p in pl.last):
        return 0
    if any(p.match(fqn) for p in pl.first):
        return 0
    if any(p.match(fqn) for p in pl.last):
        return pp - 1
    return None
