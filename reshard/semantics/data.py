"""The data position across a world-size change.

A global cursor (samples consumed in the epoch, plus what defines the order) is
elastic: each rank's share is derived from it and the current world size, so it is carried
unchanged. Per-rank loader states are not: replaying rank k's local position on a new
world size skips (growing) or repeats (shrinking) samples, and states of vanished ranks are
silently lost (torchtitan #811). They are translated only through a known elastic form
(`formats/data_states.toml`) and only when the user asks (`--data-policy translate`), since
opening them means unpickling; otherwise the conversion is refused and the choices listed.

A trainer whose per-rank states cannot follow has to be told not to load them, or its own
load fails (torchtitan: DCP finds no `dataloader.dp_rank_<k>` for a new rank, or the loader
asserts the old dp degree). What to tell it comes from the convention that owns the keys
(`[data]` in formats/conventions/*.toml: the keys it covers, the setting, whether its
states have a known elastic form); every decision and refusal names that setting, and
`restart-epoch`/`translate` are not offered where the convention says the state has no form.
"""
from __future__ import annotations

import copy
import io
import pickle
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from reshard.errors import BadInput, UnsafeInput
from reshard.paths import formats_root
from reshard.patterns import Pattern, compile_pattern
from reshard.safefs import loads_toml

POLICIES = ("translate", "restart-epoch", "drop")


@dataclass
class DataDecision:
    kind: str  # "global_cursor" | "per_rank" | "none"
    policy: str  # "carry" | "translate" | "restart-epoch" | "drop" | "none"
    form: str | None = None
    cursor_before: int | None = None
    cursor_after: int | None = None
    repeated: int | None = 0
    skipped: int | None = 0
    continuity: bool = True
    note: str = ""
    # new per-rank states: target key -> value (bytes when the source was pickled bytes)
    writes: dict[str, Any] = field(default_factory=dict)
    rewritten: dict[str, str] = field(default_factory=dict)  # source key -> why
    dropped: dict[str, str] = field(default_factory=dict)    # source key -> why
    trainer_must: str = ""  # what the trainer must be told to load the output (empty: nothing)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "policy": self.policy, "form": self.form, "cursor_before": self.cursor_before,
                "cursor_after": self.cursor_after, "repeated": self.repeated, "skipped": self.skipped,
                "continuity": self.continuity, "note": self.note, "new_keys": sorted(self.writes),
                "trainer_must": self.trainer_must}


@dataclass(frozen=True)
class TrainerDataSetting:
    """A convention's word on its per-rank data states (`[data]` in formats/conventions/<name>.toml)."""

    convention: str
    trainer: str
    keys: Pattern
    exclude_setting: str       # what the trainer must be told when the states are not written
    elastic: bool              # False: no known elastic form, translate/restart-epoch are not offered
    why: str

    def instruction(self) -> str:
        return (f"tell {self.trainer} not to load data-loader state: {self.exclude_setting} "
                f"(its load of this checkpoint fails otherwise)")


@lru_cache(maxsize=1)
def trainer_data_settings() -> tuple[TrainerDataSetting, ...]:
    out = []
    for path in sorted((formats_root() / "conventions").glob("*.toml")):
        spec = loads_toml(path.read_text(encoding="utf-8"), where=str(path), what="convention file")
        d = spec.get("data")
        if not isinstance(d, dict) or "per_rank_keys" not in d:
            continue
        out.append(TrainerDataSetting(convention=str(spec.get("name", path.stem)), trainer=str(d.get("trainer", spec.get("name", path.stem))),
                                      keys=compile_pattern(d["per_rank_keys"], str(path), what="[data] per_rank_keys"), exclude_setting=str(d.get("exclude_setting", "")),
                                      elastic=bool(d.get("elastic", True)), why=str(d.get("why", ""))))
    return tuple(out)


def setting_for(keys: list[str]) -> TrainerDataSetting | None:
    """The convention whose `[data].per_rank_keys` covers every one of these per-rank keys."""
    for s in trainer_data_settings():
        if keys and all(s.keys.match(k) for k in keys):
            return s
    return None


class _BuiltinsOnly(pickle.Unpickler):
    """Per-rank loader states are usually pickled dicts of numbers: admit no global at all."""

    def __init__(self, data: bytes, where: str):
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        raise UnsafeInput(f"per-rank data state references '{module}.{name}'; refusing to unpickle it",
                          where=self.where, hint="Use --data-policy drop, or --trust-pickle if you wrote this checkpoint.")


def decode_state(value: Any, where: str, *, trust_pickle: bool = False) -> tuple[Any, bool]:
    """(state, was_pickled_bytes). With ``trust_pickle`` (the user wrote this checkpoint) any pickle is opened."""
    if isinstance(value, (bytes, bytearray)):
        if trust_pickle:
            try:
                return pickle.loads(bytes(value)), True
            except Exception as exc:
                raise BadInput(f"per-rank data state is not a readable pickle ({type(exc).__name__})", where=where) from None
        try:
            return _BuiltinsOnly(bytes(value), where).load(), True
        except UnsafeInput:
            raise
        except Exception as exc:
            raise BadInput(f"per-rank data state is not a readable pickle ({type(exc).__name__})", where=where) from None
    return value, False


def encode_state(state: Any, pickled: bool) -> Any:
    return pickle.dumps(state, protocol=4) if pickled else state


@lru_cache(maxsize=1)
def forms() -> tuple[dict[str, Any], ...]:
    path = formats_root() / "data_states.toml"
    return tuple(loads_toml(path.read_text(encoding="utf-8"), where=str(path), what="data-state forms file")["form"])


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple[tuple, Any]]:
    if isinstance(obj, dict):
        out = []
        for k, v in obj.items():
            out.extend(_paths(v, prefix + (k,)))
        return out
    return [(prefix, obj)]


def _set(obj: Any, path: tuple, value: Any) -> None:
    for p in path[:-1]:
        obj = obj[p]
    obj[path[-1]] = value


# Fields that hold a dataset's OWN position (torchdata's StatefulDataLoader over a Stateful
# IterableDataset keeps it in `dataset_state`, or `fetcher_state.dataset_iter_state`). The
# sampler counters beside them are then not the position: torchtitan's per-rank dataset
# (split by node) resumes from `dataset_state.sample_idx` whatever the counters say, so a
# form matched on the counters would claim continuity and repeat samples. No form describes
# such a state.
DATASET_POSITION_FIELDS = ("dataset_state", "dataset_iter_state")


def _holds_dataset_position(flat: dict[tuple, Any]) -> bool:
    return any(v is not None and any(p in DATASET_POSITION_FIELDS for p in path) for path, v in flat.items())


def _match_form(states: dict[int, Any]) -> tuple[dict[str, Any], dict[str, list[tuple]]] | None:
    """The first form whose masked fields explain every difference between ranks.

    None when a state holds its dataset's own position (DATASET_POSITION_FIELDS): no form can
    say what that position means on another world size.
    """
    ranks = sorted(states)
    flat = {r: dict(_paths(states[r])) for r in ranks}
    if any(_holds_dataset_position(flat[r]) for r in ranks):
        return None
    for form in forms():
        roles: dict[str, list[tuple]] = {"rank": [], "world": [], "cursor": [], "count": []}
        for path in flat[ranks[0]]:
            last = path[-1] if path else None
            for role in roles:
                if last in form.get(f"{role}_fields", []):
                    roles[role].append(path)
        if not roles["cursor"] and not roles["count"]:
            continue
        if any(set(flat[r]) != set(flat[ranks[0]]) for r in ranks):
            continue
        masked = set(roles["rank"]) | set(roles["world"])
        if form["name"] == "strided-count":
            counts = {r: tuple(flat[r][p] for p in roles["count"]) for r in ranks}
            if len(set(counts.values())) != 1 or not all(isinstance(c, int) for c in counts[ranks[0]]):
                continue
            masked |= set(roles["count"])
        same = all({p: v for p, v in flat[r].items() if p not in masked} ==
                   {p: v for p, v in flat[ranks[0]].items() if p not in masked} for r in ranks)
        if same:
            return form, roles
    return None


def decide(per_rank: dict[int, tuple[str, Any]], shared: dict[str, Any], *, source_dp: int, target_dp: int,
           policy: str | None, key_for_rank: Any, cursor: int | None = None,
           trust_pickle: bool = False) -> DataDecision:
    """Decide what happens to the data position.

    ``per_rank``: dp rank -> (source key, raw value); ``shared``: shared data keys -> value
    (world-size fields among them are rewritten); ``key_for_rank(k)`` names the key of new
    rank k; ``cursor`` is the global cursor when the checkpoint has one.
    """
    if not per_rank:
        if not shared and cursor is None:
            return DataDecision("none", "none", continuity=False, repeated=None, skipped=None,
                                note="no data position in the checkpoint: the resumed run cannot know which samples it has seen")
        return DataDecision("global_cursor", "carry", cursor_before=cursor, cursor_after=cursor,
                            note="global cursor carried unchanged; each rank derives its share from the new world size")
    keys = sorted(k for k, _ in per_rank.values())
    if source_dp == target_dp and policy in (None, "translate"):
        return DataDecision("per_rank", "carry", note="data-parallel width unchanged: per-rank states carried to the same ranks")
    setting = setting_for(keys)
    what = f"per-rank data-loader state ({', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''})"
    if policy is None:
        if setting is not None and not setting.elastic:
            raise BadInput(
                f"{what} cannot follow a change of data-parallel width {source_dp} -> {target_dp}: {setting.why}",
                hint=f"Choose --data-policy drop (no data position: a warm start for data), then {setting.instruction()}. "
                "translate and restart-epoch are not offered: they need a state of a known elastic form "
                "(formats/data_states.toml), which this trainer's own loader state is not.")
        raise BadInput(
            f"{what} cannot follow a change of "
            f"data-parallel width {source_dp} -> {target_dp} as is: replaying local positions skips or repeats samples, and "
            "states of vanished ranks would be lost",
            hint="Choose --data-policy translate (use a known elastic form of the state), restart-epoch (start the epoch "
            "over: samples already seen this epoch are seen again) or drop (no data position: a warm start for data).")
    if policy not in POLICIES:
        raise BadInput(f"unknown --data-policy '{policy}'", hint="Use translate, restart-epoch or drop.")
    world_keys = {k: v for k, v in shared.items()}
    if policy == "drop":
        must = setting.instruction() if setting is not None and setting.exclude_setting else ""
        d = DataDecision("per_rank", "drop", continuity=False, repeated=None, skipped=None, trainer_must=must,
                         note="data position dropped: " + (must if must else "the trainer must not load data-loader state")
                         + "; which samples repeat or are skipped is unknown")
        for _, (k, _) in per_rank.items():
            d.dropped[k] = "--data-policy drop"
        for k in world_keys:
            d.dropped[k] = "--data-policy drop"
        return d
    states = {}
    pickled = False
    for r, (k, v) in per_rank.items():
        states[r], pickled = decode_state(v, where=k, trust_pickle=trust_pickle)
    missing = sorted(set(range(source_dp)) - set(states))
    if missing:
        raise BadInput(f"per-rank data state missing for dp ranks {missing}", where=keys[0],
                       hint="The checkpoint lost state (was per-rank state saved under a shared key?); use --data-policy drop.")
    matched = _match_form(states)
    if matched is None and setting is not None and not setting.elastic:
        raise BadInput(f"--data-policy {policy} is not available for {what}: {setting.why}", where=keys[0],
                       hint=f"Use --data-policy drop, then {setting.instruction()}.")
    if matched is None:
        raise BadInput("per-rank data states match no known elastic form (formats/data_states.toml)", where=keys[0],
                       hint="Use --data-policy restart-epoch or drop, or describe the form in formats/data_states.toml.")
    form, roles = matched
    template = states[0]
    if form["name"] == "strided-count":
        local = _get(template, roles["count"][0])
        global_before = local * source_dp
        new_local = global_before // target_dp
        global_after = new_local * target_dp
    else:
        global_before = _get(template, roles["cursor"][0])
        new_local = None
        global_after = global_before
    if policy == "restart-epoch":
        global_after, new_local = 0, 0
    d = DataDecision("per_rank", policy, form=form["name"], cursor_before=global_before, cursor_after=global_after,
                     repeated=max(0, global_before - global_after), skipped=max(0, global_after - global_before),
                     continuity=(global_after == global_before))
    for k in range(target_dp):
        st = copy.deepcopy(template)
        for p in roles["rank"]:
            _set(st, p, k)
        for p in roles["world"]:
            _set(st, p, target_dp)
        for p in roles["cursor"]:
            if policy == "restart-epoch":
                _set(st, p, 0)
        for p in roles["count"]:
            _set(st, p, new_local)
        d.writes[key_for_rank(k)] = encode_state(st, pickled)
    for r, (k, _) in per_rank.items():
        if key_for_rank(r) in d.writes:
            d.rewritten[k] = f"{policy} ({form['name']}): rank {r} of {target_dp}"
        else:
            d.dropped[k] = f"{policy} ({form['name']}): dp rank {r} does not exist on {target_dp} ranks; its position is in the global cursor"
    for k, v in world_keys.items():
        if isinstance(v, int) and not isinstance(v, bool):
            d.writes[k] = target_dp
            d.rewritten[k] = f"world size {v} -> {target_dp}"
        else:
            raise BadInput(f"shared data key holds {type(v).__name__}, expected a world size", where=k,
                           hint="Use --data-policy drop.")
    what = {"translate": "translated", "restart-epoch": "restarted"}[policy]
    d.note = (f"per-rank states {what} through form '{form['name']}': global position {global_before} -> {global_after}"
              + (f"; {d.repeated} samples will be seen again" if d.repeated else "")
              + (f"; {d.skipped} samples will be skipped" if d.skipped else ""))
    return d


def _get(obj: Any, path: tuple) -> Any:
    for p in path:
        obj = obj[p]
    return obj
