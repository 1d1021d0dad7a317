"""Facts about a run read from the trainer's own config file (`--trainer-config FILE`).

A checkpoint without a manifest cannot say its batch recipe or its head counts, but the
trainer's config file, which the user has anyway, does. This module reads such a file into
the fields a profile has (micro-batch, global batch, accumulation, sequence length, the
parallel degrees, model config values) and nothing else: it never opens a checkpoint byte.

Which path of which file gives which fact is data, `formats/trainers/<trainer>.toml`; this
module only walks it. Two torchtitan kinds are known (see that file): the resolved
`Trainer.Config` that torchtitan 0.3 json-dumps (every value present, the model spelled out
layer by layer) and the job TOML of torchtitan up to 0.2 (the model named by a flavour,
whose meaning is the shipped flavour table).

What a file states is taken as stated, and only that: a field the file leaves out gets no
trainer default (a job TOML is often run with command-line overrides the file does not
show), except the accumulation, which is 1 when no global batch size is stated (torchtitan:
global = local x dp). Command-line options and the profile win over it; the caller records
`contributed()` in its reports.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from reshard.errors import BadInput
from reshard.paths import formats_root
from reshard.patterns import Pattern, compile_pattern
from reshard.safefs import check_depth, check_toml_nesting, loads_toml, read_small_text, too_deep

MAX_TRAINER_CONFIG_BYTES = 16 << 20  # torchtitan 0.3's dump of a 126-layer model is under 1 MiB
DEGREES = ("dp_shard", "dp_replicate", "tp", "pp", "cp")
_HINT = "Give --trainer-config the job config torchtitan read (a job TOML) or wrote (debug.save_config_file JSON)."


@dataclass(frozen=True)
class KindSpec:
    """One kind of trainer config file: how it is recognised and which paths give which fact."""

    name: str
    format: str                                  # "json" | "toml"
    requires: tuple[str, ...]                    # every path present
    requires_any: tuple[str, ...]                # at least one path present
    facts: dict[str, tuple[str, ...]]
    degrees: dict[str, tuple[str, ...]]
    model_config: dict[str, tuple[str, ...]]
    flavor_implies: tuple[str, ...]              # model config names a flavour gives


@dataclass(frozen=True)
class TrainerFormat:
    """formats/trainers/<trainer>.toml, parsed."""

    trainer: str
    file: str
    step_folder: Pattern
    kinds: tuple[KindSpec, ...]
    flavors: dict[str, dict[str, dict[str, Any]]]   # model name -> flavour -> values
    aliases: dict[str, dict[str, str]]               # model name -> alias -> flavour


@dataclass
class TrainerConfig:
    """What one trainer config file says about the run; None/absent = the file does not say."""

    trainer: str
    kind: str
    file: str
    sha256: str
    micro_batch: int | None
    global_batch: int | None
    grad_accum: int | None
    seq_len: int | None
    degrees: dict[str, int]
    model_config: dict[str, int]
    flavor: str | None
    model: str | None = None
    steps: int | None = None
    origins: dict[str, str] = field(default_factory=dict)   # fact -> the path (or flavour) it came from
    notes: list[str] = field(default_factory=list)         # what the file could not be used for, and why

    def accumulation(self, dp: int) -> int | None:
        """The accumulation at batch degree ``dp`` (dp_replicate x dp_shard), when the file fixes it."""
        if self.grad_accum is not None:
            return self.grad_accum
        if self.global_batch is not None and self.micro_batch is not None:
            return grad_accum_for(self.global_batch, self.micro_batch, dp)
        return None

    def layout_spec(self) -> str | None:
        """The source layout the file states (``dp_shard=64``), or None when it leaves the FSDP degree open.

        torchtitan's ``data_parallel_shard_degree = -1`` means "the rest of the world", a number
        the file does not state: then the layout is the checkpoint's alone. The stated layout is
        checked against the checkpoint's chunks like ``--from`` (`reshard.planning.describe`).
        """
        if "dp_shard" not in self.degrees:
            return None
        spec = ",".join(f"{d}={n}" for d, n in self.degrees.items() if n != 1)
        return spec or "dp=1"

    def contributed(self) -> dict[str, Any]:
        """A plain, JSON-ready dict of what this file provides, for reports and lineage."""
        out: dict[str, Any] = {"trainer": self.trainer, "kind": self.kind, "file": self.file, "sha256": self.sha256}
        for name in ("model", "flavor", "micro_batch", "global_batch", "grad_accum", "seq_len", "steps"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.degrees:
            out["degrees"] = dict(self.degrees)
        if self.model_config:
            out["model_config"] = dict(self.model_config)
        if self.origins:
            out["from"] = dict(self.origins)
        if self.notes:
            out["notes"] = list(self.notes)
        return out


# ---------------------------------------------------------------------------- formats


def _strings(value: Any, where: str, what: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadInput(f"'{what}' must be a list of strings", where=where)
    return tuple(value)


def _table(spec: dict[str, Any], name: str, where: str) -> dict[str, tuple[str, ...]]:
    table = spec.get(name, {})
    if not isinstance(table, dict):
        raise BadInput(f"'{name}' must be a table", where=where)
    return {k: _strings(v, where, f"{name}.{k}") for k, v in table.items()}


def _load_format(path: Path) -> TrainerFormat:
    where = str(path)
    try:
        doc = loads_toml(path.read_text(encoding="utf-8"), where=where, what="trainer format file")
        kinds = []
        for spec in doc["kind"]:
            implies = spec.get("flavor_implies", {}).get("names", [])
            kinds.append(KindSpec(
                name=str(spec["name"]), format=str(spec["format"]),
                requires=_strings(spec.get("requires", []), where, "requires"),
                requires_any=_strings(spec.get("requires_any", []), where, "requires_any"),
                facts=_table(spec, "facts", where), degrees=_table(spec, "degrees", where),
                model_config=_table(spec, "model_config", where),
                flavor_implies=_strings(implies, where, "flavor_implies.names")))
        return TrainerFormat(trainer=str(doc["trainer"]), file=where, step_folder=compile_pattern(doc["step_folder"], where, what="step_folder pattern"),
                             kinds=tuple(kinds), flavors=dict(doc.get("flavors", {})),
                             aliases=dict(doc.get("flavor_aliases", {})))
    except (OSError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise BadInput(f"invalid trainer format file: {exc!r}", where=where) from None


@lru_cache(maxsize=1)
def trainer_formats() -> tuple[TrainerFormat, ...]:
    """Every shipped `formats/trainers/*.toml`, by file name."""
    return tuple(_load_format(p) for p in sorted((formats_root() / "trainers").glob("*.toml")))


# ---------------------------------------------------------------------------- paths


_ABSENT = object()
_LEN = re.compile(r"^len\((.+)\)$")


def _walk(node: Any, parts: list[str]) -> list[Any]:
    """Every value at the dotted path ``parts`` below ``node`` (one per element a `[*]` runs
    over); an absent key or a None (torchtitan's "not set") yields nothing."""
    if node is None:
        return []
    if not parts:
        return [node]
    head, rest = parts[0], parts[1:]
    each = head.endswith("[*]")
    key = head[:-3] if each else head
    if not isinstance(node, dict) or key not in node:
        return []
    child = node[key]
    if not each:
        return _walk(child, rest)
    if not isinstance(child, list):
        return []
    return [v for item in child for v in _walk(item, rest)]


def _lookup(doc: dict[str, Any], path: str, file: str) -> Any:
    """The one value ``path`` gives in ``doc`` (`_ABSENT` if none). A `[*]` path whose elements
    disagree is refused: partition rules take one number for the whole model."""
    m = _LEN.match(path)
    if m:
        found = _walk(doc, m.group(1).split("."))
        if not found:
            return _ABSENT
        if not isinstance(found[0], list):
            raise BadInput(f"{m.group(1)} is not a list", where=file, hint=_HINT)
        return len(found[0])
    found = _walk(doc, path.split("."))
    if not found:
        return _ABSENT
    if "[*]" in path:
        distinct = {json.dumps(v, sort_keys=True) for v in found}
        if len(distinct) > 1:
            said = ", ".join(sorted(distinct, key=lambda s: (len(s), s)))
            raise BadInput(f"{path} is not one value: the elements say {said}", where=file,
                           hint="Give the value this model needs with --model-config (or in the profile).")
    return found[0]


def _first(doc: dict[str, Any], paths: tuple[str, ...], file: str) -> tuple[Any, str | None]:
    for p in paths:
        value = _lookup(doc, p, file)
        if value is not _ABSENT:
            return value, p
    return _ABSENT, None


def _int(value: Any, path: str, file: str, *, minimum: int = 1) -> int:
    if type(value) is not int or value < minimum:
        want = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise BadInput(f"{path} must be {want} (got {value!r})", where=file, hint=_HINT)
    return value


# ---------------------------------------------------------------------------- reading


def _read_small_text(path: str | Path) -> tuple[str, bytes]:
    data = read_small_text(path, "trainer config", limit=MAX_TRAINER_CONFIG_BYTES, hint=_HINT)
    return data.decode("utf-8"), data


def _parse(text: str, file: str) -> tuple[str, dict[str, Any]]:
    """("json" | "toml", document), told apart by content: a JSON config is one object."""
    if text.lstrip().startswith("{"):
        try:
            doc = json.loads(text)
        except RecursionError:
            raise too_deep(file, "trainer config") from None
        except json.JSONDecodeError as exc:
            raise BadInput(f"the trainer config is not valid JSON ({exc})", where=file, hint=_HINT) from None
        return "json", check_depth(doc, where=file, what="trainer config")  # nesting bounded (exit 2, not a crash)
    check_toml_nesting(text, where=file, what="trainer config")  # before tomllib: a long dotted key is O(n^2) there
    try:
        doc = tomllib.loads(text)
    except RecursionError:
        raise too_deep(file, "trainer config") from None
    except tomllib.TOMLDecodeError as exc:
        raise BadInput(f"the trainer config is neither a JSON object nor valid TOML ({exc})", where=file,
                       hint=_HINT) from None
    return "toml", check_depth(doc, where=file, what="trainer config")


def _matches(kind: KindSpec, fmt: str, doc: dict[str, Any], file: str) -> bool:
    if kind.format != fmt:
        return False
    present = lambda p: _lookup(doc, p, file) is not _ABSENT  # noqa: E731
    return all(present(p) for p in kind.requires) and (not kind.requires_any or any(present(p) for p in kind.requires_any))


def read_trainer_config(path: str | Path) -> TrainerConfig:
    """Read a trainer's config file (a small regular UTF-8 file) into profile facts.

    Refused (BadInput naming the file, and the field when one is wrong): unreadable, not a
    regular file, too large, not UTF-8, not JSON/TOML, of no known kind, or a value of the
    wrong type or range (torchtitan's own limits: a positive local batch, a global batch
    that is -1 or positive, dp_shard -1 or positive, the other degrees positive), or a
    global batch the file's own degrees cannot divide.
    """
    file = str(Path(path).resolve())
    text, data = _read_small_text(path)
    fmt, doc = _parse(text, file)
    if not isinstance(doc, dict):
        raise BadInput("the trainer config is not a table of settings", where=file, hint=_HINT)
    for tf in trainer_formats():
        for kind in tf.kinds:
            if _matches(kind, fmt, doc, file):
                return _read_kind(tf, kind, doc, file, hashlib.sha256(data).hexdigest())
    known = ", ".join(k.name for tf in trainer_formats() for k in tf.kinds)
    raise BadInput(f"the trainer config is of no known kind (known: {known}): a {fmt.upper()} file without the "
                   "sections they have", where=file, hint=_HINT)


def _read_kind(tf: TrainerFormat, kind: KindSpec, doc: dict[str, Any], file: str, sha: str) -> TrainerConfig:
    origins: dict[str, str] = {}
    notes: list[str] = []

    def fact(name: str) -> tuple[Any, str | None]:
        value, p = _first(doc, kind.facts.get(name, ()), file)
        return (None, None) if value is _ABSENT else (value, p)

    micro, p_micro = fact("micro_batch")
    if p_micro:
        micro = _int(micro, p_micro, file)
        origins["micro_batch"] = p_micro
    glob, p_glob = fact("global_batch")
    if p_glob:
        if type(glob) is not int or glob == 0 or glob < -1:
            raise BadInput(f"{p_glob} must be -1 (local x dp) or a positive integer (got {glob!r})", where=file, hint=_HINT)
        origins["global_batch"] = p_glob
        glob = glob if glob > 0 else None
    grad_accum = 1 if glob is None else None
    if grad_accum is not None:
        origins["grad_accum"] = f"{p_glob} = -1" if p_glob else f"no {' / '.join(kind.facts.get('global_batch', ()))}"
    seq, p_seq = fact("seq_len")
    if p_seq:
        seq = _int(seq, p_seq, file)
        origins["seq_len"] = p_seq
    steps, p_steps = fact("steps")
    if p_steps:
        steps = _int(steps, p_steps, file, minimum=0)
    names: dict[str, str | None] = {}
    for name in ("model", "flavor"):
        value, p = fact(name)
        if p and not isinstance(value, str):
            raise BadInput(f"{p} must be a string (got {value!r})", where=file, hint=_HINT)
        names[name] = value

    degrees: dict[str, int] = {}
    for name, paths in kind.degrees.items():
        value, p = _first(doc, paths, file)
        if value is _ABSENT:
            continue
        if name == "dp_shard" and value == -1:   # torchtitan: "the rest of the world", not a number the file states
            continue
        value = _int(value, p, file)
        if name in DEGREES:
            degrees[name] = value
            origins[f"degrees.{name}"] = p
        elif value > 1:
            notes.append(f"{p} = {value}: reshard has no '{name}' axis; the layout is read from the checkpoint")

    model_config: dict[str, int] = {}
    for name, paths in kind.model_config.items():
        value, p = _first(doc, paths, file)
        if value is not _ABSENT:
            model_config[name] = _int(value, p, file)
            origins[f"model_config.{name}"] = p
    if kind.flavor_implies:
        model_config.update(_flavor_values(tf, kind, names["model"], names["flavor"], origins, notes))

    if glob is not None and micro is not None and "dp_shard" in degrees:
        dp = degrees["dp_shard"] * degrees.get("dp_replicate", 1)
        try:
            grad_accum_for(glob, micro, dp)
        except BadInput as exc:
            raise BadInput(f"{p_glob}: {exc.message} (the file's own degrees)", where=file, hint=_HINT) from None

    return TrainerConfig(trainer=tf.trainer, kind=kind.name, file=file, sha256=sha, micro_batch=micro,
                         global_batch=glob, grad_accum=grad_accum, seq_len=seq, degrees=degrees,
                         model_config=model_config, flavor=names["flavor"], model=names["model"], steps=steps,
                         origins=origins, notes=notes)


def stated_at(kind_name: str, name: str) -> str:
    """The key (path) of a trainer config of kind ``kind_name`` that states the model value ``name``, for a
    message naming it (the paths of ``formats/trainers/*.toml``; "its flavour" where only a flavour implies it)."""
    for tf in trainer_formats():
        for kind in tf.kinds:
            if kind.name == kind_name:
                paths = " or ".join(kind.model_config.get(name, ()))
                flavour = f"{name} (implied by its model flavour)" if name in kind.flavor_implies else ""
                return " or ".join(p for p in (paths, flavour) if p) or name
    return name


def llama_ffn_hidden(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Llama's SwiGLU hidden size, as torchtitan sizes it: 2/3 of 4*dim, times the multiplier,
    rounded up to a multiple of ``multiple_of``."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def _flavor_values(tf: TrainerFormat, kind: KindSpec, model: str | None, flavor: str | None,
                   origins: dict[str, str], notes: list[str]) -> dict[str, int]:
    """The model config a (model name, flavour) pair implies, from the shipped flavour table."""
    if flavor is None:
        if model is not None:
            notes.append(f"model '{model}' without a flavour: no model config implied")
        return {}
    if model is None:
        notes.append(f"flavour '{flavor}' without a model name: no model config implied")
        return {}
    table = tf.flavors.get(model, {})
    real = tf.aliases.get(model, {}).get(flavor, flavor)
    values = table.get(real)
    if values is None:
        notes.append(f"flavour '{flavor}' of model '{model}' is not in {Path(tf.file).name}: no model config implied "
                     "(give the head counts with --model-config or in the profile)")
        return {}
    derived = dict(values)
    if "ffn_hidden" not in derived and "dim" in derived and "multiple_of" in derived:
        derived["ffn_hidden"] = llama_ffn_hidden(derived["dim"], derived["multiple_of"], derived.get("ffn_dim_multiplier"))
    out = {}
    for name in kind.flavor_implies:
        if name in derived:
            out[name] = int(derived[name])
            origins[f"model_config.{name}"] = f"flavour {model}/{real}"
    return out


# ---------------------------------------------------------------------------- step and recipe


def step_from_folder(path: str | os.PathLike[str]) -> int | None:
    """The step a checkpoint folder's NAME states (torchtitan's ``step-N``), or None.

    Only the name is read, never a byte inside: a trainer that names its folders by step
    says the step there when the checkpoint itself keeps no counter.
    """
    name = Path(os.fspath(path)).name
    for tf in trainer_formats():
        m = tf.step_folder.match(name)
        if m and len(m.group(1)) <= 18:   # a name of thousands of digits states no step
            return int(m.group(1))
    return None


def grad_accum_for(global_batch: int, micro_batch: int, dp: int) -> int:
    """The accumulation that makes ``micro_batch x dp x accumulation == global_batch``.

    torchtitan's rule (trainer.py): global must be a multiple of local x batch degree.
    """
    for name, value in (("global batch", global_batch), ("micro-batch", micro_batch), ("data-parallel degree", dp)):
        if type(value) is not int or value < 1:
            raise BadInput(f"the {name} must be a positive integer (got {value!r})")
    per_step = micro_batch * dp
    if global_batch % per_step:
        raise BadInput(f"global batch {global_batch} is not a multiple of micro-batch {micro_batch} x "
                       f"data-parallel degree {dp} = {per_step}",
                       hint="Check the micro-batch and the degrees, or give the accumulation explicitly.")
    return global_batch // per_step
