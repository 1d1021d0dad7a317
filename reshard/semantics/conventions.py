"""Give every checkpoint key a role, using the declarative conventions in `formats/conventions/`.

A trainer's state dict is a flat namespace; what a key *means* (a parameter, one of its Adam
moments, a per-rank RNG state, the data cursor) is a convention of the trainer that wrote it.
Conventions are data, not code, so a new trainer layout is a new TOML file. Keys no rule
covers get the role ``unknown`` and are always listed: an unknown key is never hidden.

Conventions compose. Real checkpoints mix namespaces: a `get_state_dict` model, a
torchtitan-style `lr_scheduler`, a user's `step`. One convention is chosen as the primary
(it explains the model and the optimizer); a key it leaves unknown is offered to the other
conventions' rules (except their catch-alls, which only a primary may use) and last to the
generic roles of `generic.toml` (scheduler, counters, config, blobs). Each key records the
convention that classified it, so the report can say who explained what.

A convention may say its optimizer state is keyed by position (``[optimizer] keyed_by =
"index"``, a raw ``Optimizer.state_dict()``); its moments are then mapped to their parameters
through the model's parameter order (`map_indexed_optimizer`), the keys left as written.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Sequence

from reshard.errors import BadInput
from reshard.paths import formats_root
from reshard.patterns import Pattern, PatternSet, compile_pattern
from reshard.safefs import loads_toml, read_small_toml

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
    "config",            # configuration objects saved beside the state (`config.*`, `args.*`)
    "blob",              # opaque user bytes (bytes, io.BytesIO): carried and compared by their bytes
    "other",             # recognised by a convention but carrying none of the above
    "unknown",           # no rule matched: reported, never hidden
)


@dataclass(frozen=True)
class Rule:
    pattern: Pattern
    role: str
    kind: str | None = None  # "tensor" | "object" | None (either)
    per_rank: bool = False
    catch_all: bool = False  # used only when its convention is the primary one (see the module doc)


@dataclass
class Convention:
    """One trainer's key layout."""

    name: str
    description: str
    priority: int
    markers: list[Pattern]
    rules: list[Rule]
    moment_names: tuple[str, ...] = ()
    counters: dict[str, tuple[str, ...]] = field(default_factory=dict)  # counter name -> keys, first present wins
    source: str = ""
    generic: bool = False  # generic roles: never the primary convention, always composed last
    fused: tuple["FusedEntry", ...] = ()  # optimizer entries of a fused parameter saved split in the model
    # False when the writer saves each replicated chunk from one replica only (Megatron's
    # replica_id 0): the chunks then say nothing of the data-parallel degree.
    stores_replicas: bool = True
    # The mesh order (innermost first) with which the save plans in `.metadata` give the layout
    # (Megatron's torch_dist: reshard.semantics.megatron); empty: the writer records no plans.
    save_plans_rank_order: tuple[str, ...] = ()
    buffer_names: tuple[str, ...] = ()  # leaf names of non-trainable state (running statistics)
    # How the writer keys its optimizer state (``[optimizer] keyed_by``): "name", the parameter's
    # fqn (get_optimizer_state_dict); or "index", its position as torch.optim.Optimizer.state_dict()
    # numbers them (a raw ``optimizer.state_dict()`` saved as it is: torchtune's DistributedCheckpointer).
    optimizer_keyed_by: str = "name"

    def __post_init__(self) -> None:
        # every rule tried on a key in one RE2 pass (the rules' patterns, compiled once more as a set)
        self._rule_set = PatternSet([r.pattern for r in self.rules])
        self._marker_set = PatternSet(list(self.markers), search=True)

    def markers_in(self, keys: Sequence[str]) -> int:
        """How many of this convention's markers some key holds (one RE2 pass per key, until all are seen)."""
        seen: set[int] = set()
        for k in keys:
            if len(seen) == len(self.markers):
                break
            seen.update(self._marker_set.matching(k))
        return len(seen)

    def first_rule(self, key: str, kind: str) -> "Rule | None":
        """The first rule (catch-alls included) whose pattern matches ``key`` of this kind."""
        for i in self._rule_set.matching(key):
            rule = self.rules[i]
            if rule.kind is None or rule.kind == kind:
                return rule
        return None

    def classify(self, key: str, kind: str, *, composed: bool = False) -> "KeyRole":
        """The first rule that matches; ``composed`` skips catch-all rules (this is not the primary)."""
        for i in self._rule_set.matching(key):
            rule = self.rules[i]
            if composed and rule.catch_all:
                continue
            if rule.kind is not None and rule.kind != kind:
                continue
            m = rule.pattern.match(key)
            if m is None:
                continue
            groups = m.groupdict()
            rank = groups.get("rank")
            return KeyRole(key, rule.role, param=groups.get("param"), name=groups.get("name"),
                           rank=int(rank) if rank is not None else None, per_rank=rule.per_rank,
                           convention=self.name, rank_text=rank)
        return KeyRole(key, "unknown")


@dataclass(frozen=True)
class FusedEntry:
    """An optimizer entry keyed by a fused parameter whose model copy is saved split.

    torchtitan 0.3.0's FusedQKVLinear trains one ``wqkv`` parameter but its state-dict hook
    saves ``wq``/``wk``/``wv``: the moments stay keyed ``wqkv``. ``parts`` are templates over
    the groups of ``optimizer``; their sizes along ``dim`` add up to the fused entry's.
    """

    optimizer: Pattern
    parts: tuple[str, ...]
    dim: int = 0
    layout: str = ""

    def parts_of(self, param: str) -> tuple[str, ...] | None:
        m = self.optimizer.match(param)
        if m is None:
            return None
        return tuple(t.format(**m.groupdict()) for t in self.parts)


@dataclass(frozen=True)
class KeyRole:
    key: str
    role: str
    param: str | None = None   # parameter fqn for parameters, moments and step counters
    name: str | None = None    # moment or counter name
    rank: int | None = None    # for per-rank state
    per_rank: bool = False
    convention: str | None = None  # the convention whose rule classified the key
    rank_text: str | None = None   # the rank as the key spells it ("001"): two spellings of one rank are aliases
    index: int | None = None       # an index-keyed optimizer entry's position; ``param`` is then the parameter it maps to


@dataclass
class Classification:
    convention: Convention  # the primary convention
    roles: dict[str, KeyRole]
    candidates: list[tuple[str, int]]  # (convention name, unknown count), best first
    composed: tuple[Convention, ...] = ()  # the others, in the order their rules were offered keys

    def by_role(self, role: str) -> list[KeyRole]:
        return [r for r in self.roles.values() if r.role == role]

    def ranked(self, role: str) -> dict[int, list[KeyRole]]:
        """The per-rank keys of ``role`` by the rank they name, refusing aliases.

        Why: a trainer loads rank k's state under one spelling of k (torchtitan:
        ``dataloader.dp_rank_{k}``); a second key whose rank parses equal (``dp_rank_001`` beside
        ``dp_rank_1``) is a state no trainer reads, and a translation proven against it would be
        proven against the wrong state. Two spellings of one rank are refused, naming both.
        """
        out: dict[int, list[KeyRole]] = {}
        spelled: dict[int, KeyRole] = {}
        for r in sorted(self.roles.values(), key=lambda r: r.key):
            if r.role != role or r.rank is None:
                continue
            first = spelled.setdefault(r.rank, r)
            if first.rank_text != r.rank_text:
                raise BadInput(f"two {role} keys name rank {r.rank}: '{first.key}' and '{r.key}' (the rank spelled "
                               f"'{first.rank_text}' and '{r.rank_text}'); a trainer loads one of them, and which one "
                               "this checkpoint means is not knowable", where=r.key,
                               hint="Say which key is not the trainer's state: a convention file (--convention FILE) "
                                    "whose [[rule]] matches that key exactly with role = \"other\" carries it unchanged "
                                    "as an opaque key; or remove it from a copy of the checkpoint.")
            out.setdefault(r.rank, []).append(r)
        return out

    def conventions_used(self) -> dict[str, int]:
        """Convention name -> how many keys it classified (the primary first)."""
        used: dict[str, int] = {}
        for r in self.roles.values():
            if r.convention:
                used[r.convention] = used.get(r.convention, 0) + 1
        order = [self.convention.name] + [c.name for c in self.composed]
        return {n: used[n] for n in order if n in used}

    def counter_keys(self, present: Iterable[str]) -> dict[str, str]:
        """Counter name -> the key holding it: the primary's counters, then the composed ones' for names still missing."""
        have = set(present)
        out: dict[str, str] = {}
        for conv in (self.convention, *self.composed):
            for name, keys in conv.counters.items():
                if name not in out:
                    hit = next((k for k in keys if k in have), None)
                    if hit is not None:
                        out[name] = hit
        return out

    def fused_parts(self, param: str) -> tuple[tuple[str, ...], "FusedEntry"] | None:
        """The model entries an optimizer entry ``param`` fuses, by the first convention that declares it."""
        for conv in (self.convention, *self.composed):
            for f in conv.fused:
                parts = f.parts_of(param)
                if parts is not None:
                    return parts, f
        return None

    def buffer_names(self) -> tuple[str, ...]:
        return tuple(n for c in (self.convention, *self.composed) for n in c.buffer_names)

    @property
    def unknown(self) -> list[str]:
        return sorted(r.key for r in self.roles.values() if r.role == "unknown")


def _load(path: Path) -> Convention:
    return _parse(loads_toml(path.read_text(encoding="utf-8"), where=str(path), what="convention file"), str(path))


def _parse(spec: dict[str, Any], source: str) -> Convention:
    """One convention from its TOML table (a whole convention file, or a profile's ``[convention]``)."""
    try:
        rules = []
        for r in spec.get("rule", []):
            if r["role"] not in ROLES:
                raise ValueError(f"unknown role '{r['role']}'")
            rules.append(Rule(compile_pattern(r["match"], source, what="[[rule]] match"), r["role"], r.get("kind"), bool(r.get("per_rank", False)),
                              bool(r.get("catch_all", False))))
        counters = {n: (v,) if isinstance(v, str) else tuple(str(x) for x in v)
                    for n, v in spec.get("counters", {}).items()}
        return Convention(
            name=spec["name"], description=spec.get("description", ""), priority=int(spec.get("priority", 0)),
            markers=[compile_pattern(m, source, what="marker") for m in spec.get("markers", [])], rules=rules,
            moment_names=tuple(spec.get("optimizer", {}).get("moment_names", ())),
            counters=counters, source=source, generic=bool(spec.get("generic", False)),
            buffer_names=tuple(spec.get("buffers", {}).get("names", ())),
            stores_replicas=bool(spec.get("topology", {}).get("stores_replicas", True)),
            save_plans_rank_order=_rank_order(spec.get("topology", {}).get("save_plans_rank_order", [])),
            optimizer_keyed_by=_keyed_by(spec.get("optimizer", {}).get("keyed_by", "name")),
            fused=tuple(FusedEntry(compile_pattern(f["optimizer"], source, what="[[fused]] optimizer pattern"), tuple(f["parts"]), int(f.get("dim", 0)),
                                   str(f.get("layout", ""))) for f in spec.get("fused", [])),
        )
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise BadInput(f"invalid convention: {type(exc).__name__} {exc}", where=source,
                       hint="See formats/conventions/*.toml for the format: name, [[rule]] match/role.") from None


def _keyed_by(value: Any) -> str:
    """``[optimizer] keyed_by``: "name" (the default) or "index"."""
    if value not in ("name", "index"):
        raise ValueError(f"[optimizer] keyed_by must be \"name\" or \"index\", got {value!r}")
    return str(value)


def _rank_order(order: Any) -> tuple[str, ...]:
    """``[topology] save_plans_rank_order``: tp, dp and pp each at most once, dp among them (or empty)."""
    dims = tuple(str(d) for d in order)
    if dims and (len(set(dims)) != len(dims) or not set(dims) <= {"tp", "dp", "pp"} or "dp" not in dims):
        raise ValueError(f"save_plans_rank_order must list tp, dp, pp (dp required) once each, got {list(dims)}")
    return dims


@lru_cache(maxsize=1)
def builtin_conventions() -> tuple[Convention, ...]:
    return tuple(_load(p) for p in sorted((formats_root() / "conventions").glob("*.toml")))


MAX_USER_CONVENTION_BYTES = 1 << 20  # a convention is a few KiB of rules


@dataclass(frozen=True)
class UserConvention:
    """A convention file given on the command line (``--convention FILE``) and the hash of its bytes.

    The hash is recorded with the plan options (and so in the lineage): a later run that names
    the same file with other bytes is refused instead of reading the keys another way. A
    profile's own ``[convention]`` table is one too, recorded with ``table``.
    """

    convention: Convention
    path: str
    sha256: str
    table: str | None = None

    def record(self) -> dict[str, str]:
        rec = {"file": self.path, "name": self.convention.name, "sha256": self.sha256}
        if self.table:
            rec["table"] = self.table
        return rec


def load_user_convention(path: str | Path, table: str | None = None) -> UserConvention:
    """Read a user's convention TOML (the format of formats/conventions/*.toml), or one table of a file.

    Its name must not be a shipped convention's, or a manifest naming it would not say which
    of the two it means. ``table`` names the table holding the convention (a profile's
    ``convention``); the hash is of the whole file either way.
    """
    where = str(path)
    spec, data = read_small_toml(path, "convention file", limit=MAX_USER_CONVENTION_BYTES,
                                 hint="Give --convention the path of a convention TOML (see formats/conventions/).")
    if table is not None:
        spec = spec.get(table)
        if not isinstance(spec, dict):
            raise BadInput(f"the file has no [{table}] table", where=where)
        where = f"{where} [{table}]"
    conv = _parse(spec, where)
    if conv.generic:
        raise BadInput("a --convention file cannot be generic (generic = true is reserved for generic.toml)",
                       where=where, hint="Remove `generic = true`; its rules are offered to every key anyway.")
    if any(c.name == conv.name for c in builtin_conventions()):
        raise BadInput(f"the convention file is named '{conv.name}', the name of a shipped convention", where=where,
                       hint="Give it a name of its own (`name = \"...\"`): a manifest records conventions by name.")
    # the absolute path: the lineage records it, and verify may recompute from another directory
    return UserConvention(conv, str(Path(path).resolve()), hashlib.sha256(data).hexdigest(), table)


def reshard_key(convention: str, key: str) -> str:
    """The name a tensor key of ``convention`` reads under in reshard's own convention: a parameter
    as ``model.<fqn>``, an optimizer state as ``optim.state.<fqn>.<name>``, anything else as it is.
    Passed to the storage readers of a safetensors export (`reshard.storage.checkpoints.safetensors_format`)."""
    r = get_convention(convention).classify(key, "tensor")
    if r.role == "parameter" and r.param:
        return "model." + r.param
    if r.role in ("optimizer_moment", "optimizer_step") and r.param:
        return f"optim.state.{r.param}.{r.name or 'step'}"
    return key


def get_convention(name: str) -> Convention:
    for c in builtin_conventions():
        if c.name == name:
            return c
    raise BadInput(f"no key convention named '{name}'",
                   hint="Known: " + ", ".join(c.name for c in builtin_conventions()) + ".")


def classify(keys: Iterable[tuple[str, str]], *, prefer: str | None = None,
             user: Sequence[Convention] = ()) -> Classification:
    """Classify (key, kind) pairs: the primary convention that explains them best, composed with the rest.

    Best primary = some marker present, then fewest keys unknown after composition, then fewest
    optimizer entries naming no parameter (a convention that reads the model under the wrong
    prefix leaves every moment an orphan) and fewest keys its catch-all claims from another
    convention's own rules, then fewest keys lent by other conventions, then most markers,
    then priority. ``prefer`` (from a
    manifest's ``key_convention``) wins outright when it names a known convention.

    ``user`` conventions (``--convention FILE``) are candidates for the primary like the shipped
    ones, and their rules are offered every key *before* the primary's: a user who wrote a rule
    for a key means that rule. Their catch-alls count only when one of them is the primary.
    """
    keys = list(keys)
    shipped = [c for c in builtin_conventions() if not c.generic]
    convs = list(user) + shipped
    generic = [c for c in builtin_conventions() if c.generic]
    # Each convention's answer for each key, with and without its catch-alls, asked once: the
    # candidates below combine the same answers in different orders (keys x conventions, not x conventions^2).
    full = {id(c): [c.classify(k, kind) for k, kind in keys] for c in convs}
    comp = {id(c): [c.classify(k, kind, composed=True) for k, kind in keys] for c in convs + generic}
    scored = []
    for conv in convs:
        first = tuple(c for c in user if c is not conv)
        others = first + tuple(c for c in shipped if c is not conv) + tuple(generic)
        roles = {k: _classify_key(i, conv, others, len(first), full, comp) for i, (k, _kind) in enumerate(keys)}
        roles = map_indexed_optimizer(roles, (conv, *others))
        unknown = sum(1 for r in roles.values() if r.role == "unknown")
        params = {r.param for r in roles.values() if r.role == "parameter"}
        orphans = sum(1 for r in roles.values() if r.role in ("optimizer_moment", "optimizer_step")
                      and params and r.param not in params)
        markers = conv.markers_in([k for k, _ in keys])
        lent = sum(1 for r in roles.values() if r.convention not in (None, conv.name))
        stolen = sum(1 for i, (k, kind) in enumerate(keys) if _caught_by_catch_all(conv, k, kind)
                     and any(comp[id(o)][i].role != "unknown" for o in others))
        # A convention whose markers appear at all beats one whose markers are absent, and one
        # whose catch-all claims keys another convention's own rules explain loses: torchtitan's
        # "top-level tensor = parameter" must not claim a get_state_dict model and its moments.
        # Among the rest, the one that explains most keys by its own rules is the primary.
        scored.append(((markers == 0, unknown, stolen, orphans, lent, -markers, -conv.priority),
                       conv, roles, unknown, others))
    scored.sort(key=lambda s: s[0])
    if prefer:
        for s in scored:
            if s[1].name == prefer:
                scored.remove(s)
                scored.insert(0, s)
                break
    _, conv, roles, _, others = scored[0]
    return Classification(conv, roles, [(s[1].name, s[3]) for s in scored], others)


def map_indexed_optimizer(roles: dict[str, KeyRole], conventions: Sequence[Convention]) -> dict[str, KeyRole]:
    """Index-keyed optimizer entries mapped to the parameters they belong to (``KeyRole.param``; the key is unchanged).

    Why: ``torch.optim.Optimizer.state_dict()`` keys its state by position, numbering the
    parameters of its groups in order (group 0's in its order, then group 1's, ...); a writer
    that saves it as it is (torchtune's DistributedCheckpointer: ``optimizer.state.0.exp_avg``)
    names no parameter, and read by name every moment is an orphan and every parameter lacks
    moments. The optimizer was built over ``model.parameters()``, whose order is the module
    registration order that ``model.state_dict()`` also follows and DCP keeps in ``.metadata``
    (reshard's conversions write the keys in the same order). So position i is the i-th
    parameter entry in key order, non-trainable buffers (the conventions' ``buffer_names``)
    left out. Only the classification changes: the keys stay as the writer wrote them, so its
    own loader reads the converted checkpoint. An index with no parameter at its position
    stays an orphan, and a moment whose shape differs from the parameter it maps to is reported
    (describe's shape check): an order that is not the optimizer's (parameter groups that do not
    follow the model's order, a tied parameter saved under two names, which ``model.parameters()``
    yields once) shows there, unless the parameters it confuses have the same shapes.
    """
    keyed = {c.name for c in conventions if c.optimizer_keyed_by == "index"}
    if not keyed:
        return roles
    indexed = [k for k, r in roles.items() if r.convention in keyed and r.role in ("optimizer_moment", "optimizer_step")
               and r.param is not None and r.param.isdecimal()]
    if not indexed:
        return roles
    buffers = {n for c in conventions for n in c.buffer_names}
    order = list(dict.fromkeys(r.param for r in roles.values()
                               if r.role == "parameter" and r.param and r.param.rsplit(".", 1)[-1] not in buffers))
    out = dict(roles)
    for k in indexed:
        r = roles[k]
        i = int(r.param or 0)
        if i < len(order):
            out[k] = replace(r, param=order[i], index=i)
    return out


def _caught_by_catch_all(conv: Convention, key: str, kind: str) -> bool:
    """Whether ``conv`` explains ``key`` only by a catch-all rule."""
    rule = conv.first_rule(key, kind)
    return rule is not None and rule.catch_all


def _classify_key(i: int, primary: Convention, others: tuple[Convention, ...], first: int,
                  full: dict[int, list[KeyRole]], comp: dict[int, list[KeyRole]]) -> KeyRole:
    """Key ``i``: the first ``first`` others (user conventions), the primary's rules (catch-alls included), then the rest.

    Every convention but the primary is asked without its catch-alls; ``full`` and ``comp`` hold
    each convention's answers with and without them.
    """
    for conv in others[:first]:
        r = comp[id(conv)][i]
        if r.role != "unknown":
            return r
    r = full[id(primary)][i]
    for conv in others[first:]:
        if r.role != "unknown":
            break
        r = comp[id(conv)][i]
    return r


@lru_cache(maxsize=1)
def known_tied_pairs() -> tuple[tuple[str, str], ...]:
    path = formats_root() / "models" / "ties.toml"
    spec = loads_toml(path.read_text(encoding="utf-8"), where=str(path), what="tied pairs file")
    return tuple(tuple(p) for p in spec.get("pairs", []))  # type: ignore[misc]
