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
import re
from array import array
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

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

    Why it is built as it is: a mixture-of-experts checkpoint has hundreds of thousands of keys
    and every candidate primary combines the same per-convention answers in another order. So
    every convention's rules are compiled into one RE2 set (`Matcher`) that each key meets once,
    each convention's answer is a column of rule numbers, the candidates are scored over those
    columns with numpy, and a `KeyRole` is made only for the winner's answers (keys, not keys x
    conventions). `tests/test_conventions_matcher.py` checks it against the rules one by one.
    """
    keys = list(keys)
    shipped = [c for c in builtin_conventions() if not c.generic]
    convs = list(user) + shipped
    generic = [c for c in builtin_conventions() if c.generic]
    m = Matcher.of(tuple(convs + generic))
    ans = m.answers(keys)
    nc = len(convs)
    params = _ParamColumn(m, keys)
    known_comp = (ans.comp >= 0).sum(axis=0)  # how many conventions explain each key without their catch-alls
    markers_seen = m.markers_seen(k for k, _ in keys)
    scored = []
    for p, conv in enumerate(convs):
        first = [u for u in range(len(user)) if u != p]
        order = [(u, False) for u in first] + [(p, True)] + \
            [(o, False) for o in range(len(user), nc + len(generic)) if o != p]
        chosen = ans.chosen(order)
        role = m.rule_role[chosen]  # index -1: the "unknown" sentinel at the end of the table
        unknown = int((chosen < 0).sum())
        pid = params.of(chosen)
        orphans = _orphans(m, role, pid, m.rule_conv[chosen], chosen >= 0, params)
        markers = int(sum(markers_seen[g] for g in m.markers_of[p]))
        lent = int(((chosen >= 0) & (m.conv_name_id[m.rule_conv[chosen]] != m.conv_name_id[p])).sum())
        full = ans.full[p]
        stolen = int(((full >= 0) & m.rule_catch[full] & ((known_comp - (ans.comp[p] >= 0)) > 0)).sum())
        scored.append(((markers == 0, unknown, stolen, orphans, lent, -markers, -conv.priority), p, unknown, order))
    scored.sort(key=lambda s: s[0])
    if prefer:
        for s in scored:
            if convs[s[1]].name == prefer:
                scored.remove(s)
                scored.insert(0, s)
                break
    _, p, _, order = scored[0]
    conv = convs[p]
    others = tuple((convs + generic)[o] for o, _ in order if o != p)
    roles = m.roles(keys, ans.chosen(order))
    roles = map_indexed_optimizer(roles, (conv, *others))
    return Classification(conv, roles, [(convs[s[1]].name, s[2]) for s in scored], others)


@dataclass
class Answers:
    """Each convention's answer for each key, as global rule numbers (-1: no rule).

    ``full[c]``: the first rule of convention ``c`` that matches the key and its kind, catch-alls
    included (what `Convention.classify` answers as the primary); ``comp[c]``: the same without
    catch-alls (``composed=True``). Rows follow the conventions of the `Matcher`, columns the keys.
    """

    full: np.ndarray
    comp: np.ndarray

    def chosen(self, order: Sequence[tuple[int, bool]]) -> np.ndarray:
        """Per key, the rule of the first convention in ``order`` that explains it (``True``: with its catch-alls)."""
        out = np.full(self.full.shape[1], -1, dtype=np.int32)
        for c, with_catch_all in order:
            col = self.full[c] if with_catch_all else self.comp[c]
            np.copyto(out, col, where=out < 0)
        return out


@dataclass
class Matcher:
    """Every rule of several conventions compiled into one RE2 set, and the tables that read its answers.

    Why: classifying asked each convention for each key in turn (a set pass, a match and a
    `KeyRole` per key per convention); one pass of one set tells, for a key, every rule of every
    convention that matches, from which each convention's first rule follows. Rules are numbered
    convention by convention in their order, so the lowest matching number of a convention is its
    first rule. The tables end with one extra entry, read at index -1 for "no rule".
    """

    conventions: tuple[Convention, ...]
    rules: list[Rule]
    rule_conv: np.ndarray      # rule -> its convention (the sentinel: -1 -> the extra convention slot)
    rule_role: np.ndarray      # rule -> index in ROLES ("unknown" for the sentinel)
    rule_catch: np.ndarray     # rule -> catch-all
    rule_kind: list[str | None]
    conv_name_id: np.ndarray   # convention -> an id of its name (the sentinel: -1)
    markers_of: list[list[int]]  # convention -> its markers' numbers in the marker set
    rule_set: PatternSet
    marker_set: PatternSet

    @classmethod
    def of(cls, conventions: tuple[Convention, ...]) -> "Matcher":
        """The matcher of these conventions, compiled once while they live (the shipped ones: once a process)."""
        ids = tuple(id(c) for c in conventions)
        m = _MATCHERS.get(ids)
        if m is None:
            if len(_MATCHERS) >= 8:
                _MATCHERS.pop(next(iter(_MATCHERS)))
            m = _MATCHERS[ids] = _matcher(conventions)  # it holds the conventions: their ids stay theirs
        return m

    def answers(self, keys: Sequence[tuple[str, str]]) -> Answers:
        """One RE2 pass per key: every convention's first rule, with and without catch-alls.

        What a key's answers are depends only on its kind and the rules that match it, and the keys
        of a model fall into few such classes (an MoE's 100k keys: a few dozen), so each class is
        worked out once (`_answer_class`) and the keys take its column."""
        nconv = len(self.conventions)
        classes: dict[tuple[str, tuple[int, ...]], int] = {}
        of_key = array("q")  # 8 bytes a key, not a Python int
        matching = self.rule_set.matching
        for key, kind in keys:
            cl = (kind, tuple(matching(key)))
            c = classes.get(cl)
            if c is None:
                c = classes[cl] = len(classes)
            of_key.append(c)
        full = np.full((nconv, len(classes)), -1, dtype=np.int32)
        comp = np.full((nconv, len(classes)), -1, dtype=np.int32)
        for (kind, gs), c in classes.items():
            self._answer_class(kind, gs, full[:, c], comp[:, c])
        idx = np.frombuffer(of_key, dtype=np.int64) if len(of_key) else np.zeros(0, dtype=np.int64)
        return Answers(np.ascontiguousarray(full[:, idx]), np.ascontiguousarray(comp[:, idx]))

    def _answer_class(self, kind: str, matched: tuple[int, ...], full: np.ndarray, comp: np.ndarray) -> None:
        """Each convention's first rule among ``matched`` (rule numbers, ascending) for a key of ``kind``,
        into ``full`` (catch-alls included) and ``comp`` (without): -1 where none."""
        conv_of, catch, kinds = self.rule_conv, self.rule_catch, self.rule_kind
        for g in matched:
            if kinds[g] is not None and kinds[g] != kind:
                continue
            c = int(conv_of[g])
            if full[c] < 0:
                full[c] = g
            if not catch[g] and comp[c] < 0:
                comp[c] = g

    def markers_seen(self, keys: Iterable[str]) -> list[bool]:
        """Whether each marker (of every convention) is found in some key; stops once all are."""
        seen: set[int] = set()
        total = len(self.marker_set.patterns)
        for k in keys:
            if len(seen) == total:
                break
            seen.update(self.marker_set.matching(k))
        return [g in seen for g in range(total)]

    def roles(self, keys: Sequence[tuple[str, str]], chosen: np.ndarray) -> dict[str, KeyRole]:
        """A `KeyRole` per key from the rule chosen for it (what `Convention.classify` answers for that rule)."""
        out: dict[str, KeyRole] = {}
        conv_names = [self.conventions[c].name for c in self.rule_conv[:-1].tolist()]
        for (key, _kind), g in zip(keys, chosen.tolist()):
            if g < 0:
                out[key] = KeyRole(key, "unknown")
                continue
            rule = self.rules[g]
            sliced = groups_by_shape(rule.pattern.pattern)
            param, name, rank = (sliced(key) if sliced is not None else
                                 rule.pattern.match_groups(key, _GROUPS) or (None, None, None))
            out[key] = KeyRole(key, rule.role, param=param, name=name, rank=int(rank) if rank is not None else None,
                               per_rank=rule.per_rank, convention=conv_names[g], rank_text=rank)
        return out


_MATCHERS: dict[tuple[int, ...], Matcher] = {}


def _matcher(conventions: tuple[Convention, ...]) -> Matcher:
    rules = [r for c in conventions for r in c.rules]
    conv = [i for i, c in enumerate(conventions) for _ in c.rules]
    names = {n: i for i, n in enumerate(dict.fromkeys(c.name for c in conventions))}
    markers = [mk for c in conventions for mk in c.markers]
    starts = np.cumsum([0] + [len(c.markers) for c in conventions]).tolist()
    return Matcher(
        conventions, rules,
        rule_conv=np.array(conv + [len(conventions)], dtype=np.int32),
        rule_role=np.array([ROLES.index(r.role) for r in rules] + [ROLES.index("unknown")], dtype=np.int8),
        rule_catch=np.array([r.catch_all for r in rules] + [False], dtype=bool),
        rule_kind=[r.kind for r in rules],
        conv_name_id=np.array([names[c.name] for c in conventions] + [-1, -1], dtype=np.int32),
        markers_of=[list(range(starts[i], starts[i + 1])) for i in range(len(conventions))],
        rule_set=PatternSet([r.pattern for r in rules]),
        marker_set=PatternSet(markers, search=True))


_LITERAL = r"(?:\\\.|[A-Za-z0-9_])*"  # a run of letters, digits, _ and escaped dots: matches only itself
_SHAPES = (  # (pattern text shape, how the groups follow from a key the pattern is known to match)
    (re.compile(rf"\^({_LITERAL})\(\?P<param>\.\+\)({_LITERAL})\$"), "affix"),
    (re.compile(rf"\^({_LITERAL})\(\?P<param>\.\+\)\\\.\(\?P<name>\[A-Za-z_\]\[A-Za-z0-9_\]\*\)\$"), "moment"),
    (re.compile(r"\^\(\?P<param>(?:\[\^\.\]\+\(\\\.\[\^\.\]\+\)\*|\[\^\./\]\[\^/\]\*)\)\$"), "whole"),
)


@lru_cache(maxsize=None)
def groups_by_shape(text: str) -> Any:
    """For a rule pattern of one of a few shapes, a function from a key *the pattern matches* to its
    (param, name, rank) groups, by slicing; None for any other pattern (its groups come from RE2).

    Why: the groups of 100k keys were a Python call into RE2 each, several per key (each candidate
    primary convention reads the params its rules extract). The shipped conventions' params are
    mostly ``^P(?P<param>.+)S$`` (P, S literal: greedy ``.+`` then the literal S at the end, so the
    param is what lies between P and S), ``^P(?P<param>.+)\\.(?P<name>IDENT)$`` (a name holds no dot:
    the param ends at the key's last dot) and whole-key catch-alls. Only a key the pattern matched
    (the rule set said so) is sliced; `tests/test_conventions_matcher.py` holds the result to the
    rules matched one by one."""
    for shape, how in _SHAPES:
        m = shape.fullmatch(text)
        if m is None:
            continue
        if how == "whole":
            return lambda key: (key, None, None)
        prefix = len(m.group(1).replace("\\", ""))
        if how == "moment":
            return lambda key: (key[prefix:key.rindex(".")], key[key.rindex(".") + 1:], None)
        suffix = len(m.group(2).replace("\\", ""))
        return lambda key: (key[prefix:len(key) - suffix], None, None)
    return None


_GROUPS = ("param", "name", "rank")  # the groups a rule's match gives a KeyRole
_PARAM = ("param",)
_PARAMETER, _MOMENT, _STEP = (ROLES.index(r) for r in ("parameter", "optimizer_moment", "optimizer_step"))


class _ParamColumn:
    """The ``param`` a rule extracts from a key, as an id per (key, rule), extracted once per
    (key, pattern text) asked for: rules of several conventions share their patterns
    (``^model\\.(?P<param>.+)$``), and a candidate primary needs only the params of its own answers."""

    def __init__(self, m: Matcher, keys: Sequence[tuple[str, str]]):
        self.m, self.keys = m, keys
        texts = {t: i for i, t in enumerate(dict.fromkeys(r.pattern.pattern for r in m.rules))}
        self.pattern_of = np.array([texts[r.pattern.pattern] for r in m.rules] + [-1], dtype=np.int64)
        self.has_param = np.array(["param" in r.pattern.groupindex for r in m.rules] + [False], dtype=bool)
        self.ids: dict[str, int] = {}     # param text -> id
        self.texts: list[str] = []
        self.codes = np.zeros(0, dtype=np.int64)  # key * patterns + pattern, sorted, for every pair extracted ...
        self.values = np.zeros(0, dtype=np.int64)  # ... and its param id (-1: None)
        self.npat = max(1, len(texts))

    def of(self, chosen: np.ndarray) -> np.ndarray:
        """Per key, the id of the param its chosen rule extracts (-1: none); pairs not met before are extracted now."""
        want = (chosen >= 0) & self.has_param[chosen]
        idx = np.flatnonzero(want)
        codes = idx.astype(np.int64) * self.npat + self.pattern_of[chosen[idx]]
        at = np.searchsorted(self.codes, codes)
        new = np.ones(len(codes), dtype=bool)
        inside = at < len(self.codes)
        new[inside] = self.codes[at[inside]] != codes[inside]
        if new.any():
            ids, texts, keys, rules = self.ids, self.texts, self.keys, self.m.rules
            found = []
            sliced = [groups_by_shape(r.pattern.pattern) for r in rules]
            for i, g in zip(idx[new].tolist(), chosen[idx[new]].tolist()):
                cut = sliced[g]
                got = cut(keys[i][0]) if cut is not None else rules[g].pattern.match_groups(keys[i][0], _PARAM)
                text = got[0] if got is not None else None
                if text is None:
                    found.append(-1)
                    continue
                j = ids.get(text)
                if j is None:
                    j = ids[text] = len(texts)
                    texts.append(text)
                found.append(j)
            allc = np.concatenate([self.codes, codes[new]])
            allv = np.concatenate([self.values, np.array(found, dtype=np.int64)])
            o = np.argsort(allc, kind="stable")
            self.codes, self.values = allc[o], allv[o]
        out = np.full(len(chosen), -1, dtype=np.int64)
        out[idx] = self.values[np.searchsorted(self.codes, codes)]
        return out


def _orphans(m: Matcher, role: np.ndarray, pid: np.ndarray, conv: np.ndarray, known: np.ndarray,
             params: _ParamColumn) -> int:
    """Optimizer entries whose parameter is not among the parameters (`classify`'s ``orphans``), index-keyed
    entries first mapped to their parameters as `map_indexed_optimizer` maps them."""
    is_param = role == _PARAMETER
    if not is_param.any():
        return 0
    opt = (role == _MOMENT) | (role == _STEP)
    keyed = np.array([c.optimizer_keyed_by == "index" for c in m.conventions] + [False], dtype=bool)
    texts = params.texts
    decimal = np.array([t.isdecimal() for t in texts] + [False], dtype=bool)  # index -1: None
    indexed = np.flatnonzero(opt & known & keyed[conv] & decimal[pid])
    if len(indexed):
        pid = pid.copy()
        buffers = {n for c in m.conventions for n in c.buffer_names}
        usable = np.array([bool(t) and t.rsplit(".", 1)[-1] not in buffers for t in texts] + [False], dtype=bool)
        cand = np.flatnonzero(is_param & usable[pid])
        _, first = np.unique(pid[cand], return_index=True)
        order = pid[cand][np.sort(first)]
        at = np.array([int(texts[j]) for j in pid[indexed].tolist()], dtype=np.int64)
        ok = at < len(order)
        pid[indexed[ok]] = order[at[ok]]
    have = np.unique(pid[is_param])
    return int((opt & ~np.isin(pid, have)).sum())


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


@lru_cache(maxsize=1)
def known_tied_pairs() -> tuple[tuple[str, str], ...]:
    path = formats_root() / "models" / "ties.toml"
    spec = loads_toml(path.read_text(encoding="utf-8"), where=str(path), what="tied pairs file")
    return tuple(tuple(p) for p in spec.get("pairs", []))  # type: ignore[misc]
