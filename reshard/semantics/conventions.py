"""Give every checkpoint key a role, using the declarative conventions in `formats/conventions/`.

A trainer's state dict is a flat namespace; what a key *means* (a parameter, one of its Adam
moments, a per-rank RNG state, the data cursor) is a convention of the trainer that wrote it.
Conventions are data, not code, so a new trainer layout is a new TOML file. Keys no rule
covers get the role ``unknown`` and are always listed: an unknown key is never hidden.
"""
from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Iterable

from reshard.errors import BadInput
from reshard.paths import formats_root

ROLES = (
    "parameter",         # model weights and buffers (`model.<fqn>`)
    "optimizer_moment",  # per-parameter optimizer tensors (exp_avg, exp_avg_sq, ...)
    "optimizer_step",    # per-parameter optimizer step counters
    "param_group",       # optimizer hyper-parameters (lr, betas, weight decay, ...)
    "scheduler",         # LR scheduler state
    "scaler",            # loss scaler state
    "rng",               # random number generator state
    "data",              # data position (sampler / dataloader state)
    "counter",           # trainer counters (global step, tokens seen, micro step)
    "other",             # recognised by a convention but carrying none of the above
    "unknown",           # no rule matched: reported, never hidden
)


@dataclass(frozen=True)
class Rule:
    pattern: re.Pattern[str]
    role: str
    kind: str | None = None  # "tensor" | "object" | None (either)
    per_rank: bool = False


@dataclass
class Convention:
    """One trainer's key layout."""

    name: str
    description: str
    priority: int
    markers: list[re.Pattern[str]]
    rules: list[Rule]
    moment_names: tuple[str, ...] = ()
    counters: dict[str, str] = field(default_factory=dict)
    source: str = ""

    def classify(self, key: str, kind: str) -> "KeyRole":
        for rule in self.rules:
            if rule.kind is not None and rule.kind != kind:
                continue
            m = rule.pattern.match(key)
            if m is None:
                continue
            groups = m.groupdict()
            rank = groups.get("rank")
            return KeyRole(key, rule.role, param=groups.get("param"), name=groups.get("name"),
                           rank=int(rank) if rank is not None else None, per_rank=rule.per_rank)
        return KeyRole(key, "unknown")


@dataclass(frozen=True)
class KeyRole:
    key: str
    role: str
    param: str | None = None   # parameter fqn for parameters, moments and step counters
    name: str | None = None    # moment or counter name
    rank: int | None = None    # for per-rank state
    per_rank: bool = False


@dataclass
class Classification:
    convention: Convention
    roles: dict[str, KeyRole]
    candidates: list[tuple[str, int]]  # (convention name, unknown count), best first

    def by_role(self, role: str) -> list[KeyRole]:
        return [r for r in self.roles.values() if r.role == role]

    @property
    def unknown(self) -> list[str]:
        return sorted(r.key for r in self.roles.values() if r.role == "unknown")


def _load(path: Path) -> Convention:
    try:
        with open(path, "rb") as f:
            spec = tomllib.load(f)
        rules = []
        for r in spec.get("rule", []):
            if r["role"] not in ROLES:
                raise ValueError(f"unknown role '{r['role']}'")
            rules.append(Rule(re.compile(r["match"]), r["role"], r.get("kind"), bool(r.get("per_rank", False))))
        return Convention(
            name=spec["name"], description=spec.get("description", ""), priority=int(spec.get("priority", 0)),
            markers=[re.compile(m) for m in spec.get("markers", [])], rules=rules,
            moment_names=tuple(spec.get("optimizer", {}).get("moment_names", ())),
            counters=dict(spec.get("counters", {})), source=str(path),
        )
    except (KeyError, ValueError, re.error, tomllib.TOMLDecodeError) as exc:
        raise BadInput(f"invalid convention file: {exc}", where=str(path)) from None


@lru_cache(maxsize=1)
def builtin_conventions() -> tuple[Convention, ...]:
    return tuple(_load(p) for p in sorted((formats_root() / "conventions").glob("*.toml")))


def get_convention(name: str) -> Convention:
    for c in builtin_conventions():
        if c.name == name:
            return c
    raise BadInput(f"no key convention named '{name}'",
                   hint="Known: " + ", ".join(c.name for c in builtin_conventions()) + ".")


def classify(keys: Iterable[tuple[str, str]], *, prefer: str | None = None) -> Classification:
    """Classify (key, kind) pairs with the convention that explains them best.

    Best = some marker present, then fewest unknown keys, then most markers, then priority. ``prefer``
    (from a manifest's ``key_convention``) wins outright when it names a known convention.
    """
    keys = list(keys)
    scored = []
    for conv in builtin_conventions():
        roles = {k: conv.classify(k, kind) for k, kind in keys}
        unknown = sum(1 for r in roles.values() if r.role == "unknown")
        markers = sum(1 for m in conv.markers if any(m.search(k) for k, _ in keys))
        # A convention whose markers appear at all beats one whose markers are absent:
        # torchtitan's catch-all "top-level tensor = parameter" must not claim foreign layouts.
        scored.append(((markers == 0, unknown, -markers, -conv.priority), conv, roles, unknown))
    scored.sort(key=lambda s: s[0])
    if prefer:
        for s in scored:
            if s[1].name == prefer:
                scored.remove(s)
                scored.insert(0, s)
                break
    _, conv, roles, _ = scored[0]
    return Classification(conv, roles, [(s[1].name, s[3]) for s in scored])


@lru_cache(maxsize=1)
def known_tied_pairs() -> tuple[tuple[str, str], ...]:
    with open(formats_root() / "models" / "ties.toml", "rb") as f:
        return tuple(tuple(p) for p in tomllib.load(f).get("pairs", []))  # type: ignore[misc]
