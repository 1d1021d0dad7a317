"""A profile: what one trainer's (or one run's) checkpoints mean, written once by the user.

Most checkpoints carry no manifest, so the facts a plan needs and the bytes cannot tell (the
source batch recipe, head counts, what a custom key is, which weights are tied) come from the
user. Typing them as flags on every command is error-prone; a profile says them once:

    # reshard.toml, beside the run's step-N folders (or in the working directory)
    name = "my-run"
    rules = "llama-torchtitan"          # a shipped family, or a rules TOML path
    tie = [["tok_embeddings.weight", "output.weight"]]
    [recipe]                            # the source run's batch recipe
    micro_batch = 8
    grad_accum = 4
    [model]                             # model config values the shapes cannot say
    n_heads = 16
    n_kv_heads = 4
    [[keep]]
    pattern = '^ema\\.'
    reason = "EMA copy of the weights: carried, never resharded"

A profile is found as ``reshard.toml`` in the working directory, else beside the checkpoint
(in its parent directory: one profile serves every ``step-N`` folder of a run), or given with
``--profile FILE``; never inside the checkpoint (a file a checkpoint carries is not evidence).
The command line wins over it field by field (`merge`), and what it contributed is recorded,
with its sha256, in the plan options and so in every report and lineage entry.

This module only reads and validates the file; `reshard.cli` merges it into the options.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reshard.errors import BadInput
from reshard.patterns import compile_pattern
from reshard.safefs import read_small_toml
from reshard.semantics.conventions import load_user_convention

PROFILE_NAME = "reshard.toml"
MAX_PROFILE_BYTES = 1 << 20

# The source recipe fields a profile may give, and the plan option each fills.
RECIPE_FIELDS = {"micro_batch": "source_micro_batch", "grad_accum": "source_grad_accum",
                 "seq_len": "source_seq_len", "global_batch": "source_global_batch"}
_TOP_LEVEL = {"name", "description", "rules", "from", "conventions", "tie", "keep", "drop", "recipe", "model",
              "convention", "trainer_config"}


@dataclass(frozen=True)
class KeyChoice:
    """A ``keep`` or ``drop`` pattern for keys no convention explains, and why the user chose it."""

    pattern: str
    reason: str = ""


@dataclass
class Profile:
    """A parsed profile; every path in it is resolved against the profile's own directory."""

    file: str
    sha256: str
    name: str | None = None
    rules: str | None = None
    from_spec: str | None = None
    conventions: list[str] = field(default_factory=list)  # convention files
    inline_convention: bool = False  # a [convention] table of the profile's own
    ties: list[list[str]] = field(default_factory=list)
    keep: list[KeyChoice] = field(default_factory=list)
    drop: list[KeyChoice] = field(default_factory=list)
    recipe: dict[str, int] = field(default_factory=dict)
    model_config: dict[str, int | float] = field(default_factory=dict)
    trainer_config: str | None = None

    def convention_records(self) -> list[dict[str, str]]:
        """The profile's conventions as the plan options record them (file, name, sha256[, table])."""
        recs = [load_user_convention(p).record() for p in self.conventions]
        if self.inline_convention:
            recs.append(load_user_convention(self.file, "convention").record())
        return recs


def find_profile(ckpt: str | Path | None, explicit: str | Path | None, *, enabled: bool = True) -> Path | None:
    """The profile a command reads: ``--profile FILE``, else ./reshard.toml, else one beside the checkpoint."""
    if explicit is not None:
        return Path(explicit)
    if not enabled:
        return None
    candidates = [Path.cwd() / PROFILE_NAME]
    if ckpt is not None:
        candidates.append(Path(ckpt).resolve().parent / PROFILE_NAME)
    return next((p for p in candidates if p.is_file()), None)


def load_profile(path: str | Path) -> Profile:
    """Read and check a profile; every malformed field is BadInput naming the file and the field."""
    where = str(path)
    spec, data = read_small_toml(path, "profile", limit=MAX_PROFILE_BYTES,
                                 hint="Give --profile the path of a profile TOML (see the README's quickstart).")
    unknown = sorted(set(spec) - _TOP_LEVEL)
    if unknown:
        raise BadInput(f"unknown profile field(s) {', '.join(unknown)}", where=where,
                       hint="A profile holds: " + ", ".join(sorted(_TOP_LEVEL)) + ".")
    base = Path(path).resolve().parent
    prof = Profile(file=str(Path(path).resolve()), sha256=hashlib.sha256(data).hexdigest())
    prof.name = _opt_str(spec, "name", where)
    rules = _opt_str(spec, "rules", where)
    if rules is not None:  # a bare name is a shipped family; anything with a separator is a path beside the profile
        prof.rules = rules if "/" not in rules else str((base / rules).resolve())
    prof.from_spec = _opt_str(spec, "from", where)
    tc = _opt_str(spec, "trainer_config", where)
    prof.trainer_config = str((base / tc).resolve()) if tc is not None else None
    prof.conventions = [str((base / c).resolve()) for c in _str_list(spec, "conventions", where)]
    prof.inline_convention = "convention" in spec
    if prof.inline_convention:
        load_user_convention(path, "convention")  # checked now: a bad table is reported as the profile's
    prof.ties = _ties(spec.get("tie", []), where)
    prof.keep = _choices(spec, "keep", where)
    prof.drop = _choices(spec, "drop", where)
    prof.recipe = _int_table(spec, "recipe", where, allowed=set(RECIPE_FIELDS))
    prof.model_config = _int_table(spec, "model", where, allowed=None)
    return prof


def parse_tie(text: str) -> list[str]:
    """``--tie A=B``: parameter A and parameter B are one tensor saved under two names."""
    a, sep, b = text.partition("=")
    if not sep or not a.strip() or not b.strip() or a.strip() == b.strip():
        raise BadInput(f"--tie expects two parameter names A=B, got '{text}'",
                       hint="E.g. --tie tok_embeddings.weight=output.weight (the model's FQNs, no 'model.' prefix).")
    return [a.strip(), b.strip()]


def parse_choice(text: str, flag: str) -> KeyChoice:
    """``--keep/--drop PATTERN[=REASON]``: the reason follows the first ``=`` whose left side is a regex.

    A ``=`` inside a group (``(?=...)``, ``(?P=name)``) leaves an unbalanced left side, so it
    stays part of the pattern; a literal ``=`` in a pattern is written ``\\=``.
    """
    for i, ch in enumerate(text):
        if ch != "=":
            continue
        left = text[:i]
        try:
            re.compile(left)
        except re.error:
            continue
        if left and not left.endswith("\\"):
            return KeyChoice(left, text[i + 1:].strip())
    return KeyChoice(text, "")


def _opt_str(spec: dict[str, Any], name: str, where: str) -> str | None:
    v = spec.get(name)
    if v is not None and not isinstance(v, str):
        raise BadInput(f"profile field '{name}' must be a string, got {v!r}", where=where)
    return v


def _str_list(spec: dict[str, Any], name: str, where: str) -> list[str]:
    v = spec.get(name, [])
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise BadInput(f"profile field '{name}' must be a list of strings, got {v!r}", where=where)
    return list(v)


def _ties(v: Any, where: str) -> list[list[str]]:
    if not isinstance(v, list) or not all(isinstance(t, list) and len(t) == 2 and all(isinstance(x, str) for x in t)
                                          and t[0] != t[1] for t in v):
        raise BadInput(f"profile field 'tie' must be a list of [A, B] name pairs, got {v!r}", where=where,
                       hint='E.g. tie = [["tok_embeddings.weight", "output.weight"]].')
    return [list(t) for t in v]


def _choices(spec: dict[str, Any], name: str, where: str) -> list[KeyChoice]:
    out = []
    for item in spec.get(name, []) if isinstance(spec.get(name, []), list) else [None]:
        if isinstance(item, str):
            item = {"pattern": item}
        if not isinstance(item, dict) or not isinstance(item.get("pattern"), str) \
                or not isinstance(item.get("reason", ""), str) or set(item) - {"pattern", "reason"}:
            raise BadInput(f"profile field '{name}' must be a list of {{pattern, reason}} tables, got {item!r}",
                           where=where, hint=f"E.g. [[{name}]] pattern = '^ema\\.' reason = \"...\".")
        compile_pattern(item["pattern"], where, what=f"profile {name} pattern")  # RE2: refused here, not matched slowly
        out.append(KeyChoice(item["pattern"], item.get("reason", "")))
    return out


def _int_table(spec: dict[str, Any], name: str, where: str, *, allowed: set[str] | None) -> dict[str, Any]:
    v = spec.get(name, {})
    if not isinstance(v, dict):
        raise BadInput(f"profile field '{name}' must be a table, got {v!r}", where=where)
    out: dict[str, Any] = {}
    for k, x in v.items():
        if allowed is not None and k not in allowed:
            raise BadInput(f"unknown profile field '{name}.{k}'", where=where,
                           hint=f"[{name}] holds: " + ", ".join(sorted(allowed)) + ".")
        numeric = isinstance(x, int) or (allowed is None and isinstance(x, float))
        if isinstance(x, bool) or not numeric or (isinstance(x, int) and x < (1 if allowed else 0)):
            raise BadInput(f"profile field '{name}.{k}' must be a positive integer, got {x!r}", where=where)
        out[k] = x
    return out
