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
`restart-epoch`/`translate` are not offered where the convention says the state has no form,
unless the state is one of the dataset forms below, which `translate` rewrites exactly.

A dataset's own position (torchtitan's HuggingFaceTextDataset over Hugging Face `datasets`)
------------------------------------------------------------------------------------------
torchtitan 0.3.0 keeps, per dp rank, ``pickle(StatefulDataLoader.state_dict())`` whose
``dataset_state`` is ``HuggingFaceTextDataset.state_dict()``: the token buffers
(``inputs_buffer``, ``labels_buffer``, ``positions_buffer``: tokens of examples already read,
not yet emitted as a full sequence) and the position, which depends on how
``datasets.split_dataset_by_node`` split the dataset (datasets 4.7):

* map-style ``Dataset``: ``dataset.shard(W, r, contiguous=True)``, rank r of W owns the block
  ``[r*(N//W) + min(r, N%W), ...)``; the state is ``sample_idx`` (examples read from the block)
  and resuming is ``_data.skip(sample_idx)``. After s examples per rank the examples read are
  W runs, one at the start of each block; a new rank can only skip a prefix of its own new
  block, which covers one run and part of the next's gap, so no state of another world size
  reads exactly the rest (and N, which the bounds depend on, is not recorded): refused.
* ``IterableDataset`` whose shard count n is a multiple of W: each rank reads whole shards
  (n/W of them) in Arrow batches; its position is in its own shards, of lengths the checkpoint
  does not record: refused.
* ``IterableDataset`` otherwise (the modulo mode, e.g. one data file and W > 1):
  ``StepExamplesIterable(step=W, offset=r)`` pulls groups of W examples from the one
  stream of all shards and yields the r-th of each, so rank r reads stream examples
  r, r+W, r+2W, ... Its state is the inner stream's position ``(shard_idx,
  shard_example_idx)`` after the last group it pulled: ``p_r = W*s_r`` in the stream after it
  has read s_r examples (the group is pulled whole before its r-th example is yielded).

The modulo mode is exact to translate. Write positions relative to the start of the shard j
the positions lie in (all of them must lie in one, else their distance is unknown), x for a
stream example and idx_r for rank r's position. Every idx_r is congruent to -start(j) mod W,
so rank r's examples are the x with x = r + idx_r (mod W), its unread ones start at
``b_r = idx_r + r``, and example x belongs to rank ``r(x) = (x - idx_0) mod W``. The consumed
set is therefore C = {x : x < b_r(x)} (every example of earlier shards, every x < min b).
When every rank read the same number of examples (all idx_r = P), C is the prefix [0, P).

A new world of W' ranks, again in the modulo mode (see ``requires`` in the form: n must not be
a multiple of W'), resumed at stream position p'_k, has rank k read p'_k + k, p'_k + k + W',
... (groups of W' from p'_k). The union over k reads exactly the complement of C, once each,
iff (1) the starts p'_k + k are pairwise distinct mod W' (one rank per residue class: no
overlap, and every example from the largest start on is read once) and (2) within each
residue class c mod W', C is a prefix: the unread examples of class c are exactly those from
a_c on, a_c the first unread example of class c; the rank serving class c then starts at a_c.
With m = min b_r (the first unread example) rank k serves class (m + k) mod W' and resumes at
p'_k = a_((m+k) mod W') - k, which is m plus a multiple of W', so p'_k >= m >= 0 (inside shard
j). The position written must also be one the shard is known to have: p'_k <= max idx_r
(a position past every recorded one may lie beyond the shard's end). When all idx_r = P,
m = P, a_c = P + ((c - P) mod W') and every p'_k = P: each new rank keeps the one position
and reads P + k, P + k + W', ... `translate_stream` derives p'_k this way, refuses where (2)
fails (ranks that read different numbers of examples, which packing documents of different
lengths into sequences causes) or a position would pass max idx_r, and proves the result
independently (`stream_proof`): on a window from the lowest start to past the largest
position, the examples left unread by the new reads equal C, and no example is read twice;
beyond the window both sides are periodic and (1) covers it.

Which split the new world gets depends on the dataset's shard count, which no checkpoint
records: the modulo mode needs n not a multiple of W'. It is proven when W' is a multiple of W
(the source's modulo mode says n is not a multiple of W, so not of W'); otherwise it is the
form's `requires`, said in the plan. Where it fails, the new ranks read whole shards in Arrow
batches, starting from the wrapper's ``previous_state``; the state written puts the position
there under one more key (`guard_key`), which the modulo mode never reads and on which
datasets' load fails in the shard mode, so the run stops at its first batch with that key's
text instead of reading its shards again. One new rank (W' = 1) is always the shard mode:
refused.

The token buffers are part of the position: they are the tails of examples already counted
as read. Old rank r's buffers go, in rank order, to new rank r mod W' (concatenated), each
part's leading positions renumbered from 0 as torchtitan's ``_normalize_positions`` does for
a document tail that starts a sequence, so every buffered token is emitted exactly once and
no document boundary is lost. The epoch must be equal on every rank (it is kept); a shuffle
buffer, shuffled shards, interleaved sources, maps and filters are refused with their reason
(``refused_types`` in the form).
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
from reshard.model.kinds import DATA_POLICIES



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
    # a dataset form (`translate_stream`): per new rank where it resumes and what it reads first,
    # the proof that the examples read before are exactly those no new rank reads, and what the
    # translation assumes that the checkpoint cannot show
    resume: list[dict[str, Any]] = field(default_factory=list)
    proof: dict[str, Any] = field(default_factory=dict)
    requires: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = {"kind": self.kind, "policy": self.policy, "form": self.form, "cursor_before": self.cursor_before,
             "cursor_after": self.cursor_after, "repeated": self.repeated, "skipped": self.skipped,
             "continuity": self.continuity, "note": self.note, "new_keys": sorted(self.writes),
             "trainer_must": self.trainer_must}
        if self.resume:  # only a dataset form has these: every other plan's JSON stays as it was
            d.update(resume=self.resume, proof=self.proof, requires=self.requires)
        return d


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
# form matched on the counters would claim continuity and repeat samples. No counter form
# describes such a state; the dataset forms (`split` in data_states.toml, `_match_split_form`)
# read the dataset's own position and are tried first.
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
                "(formats/data_states.toml), which this trainer's own loader state is not"
                + _split_forms_named(setting.trainer) + ".")
        raise BadInput(
            f"{what} cannot follow a change of "
            f"data-parallel width {source_dp} -> {target_dp} as is: replaying local positions skips or repeats samples, and "
            "states of vanished ranks would be lost",
            hint="Choose --data-policy translate (use a known elastic form of the state), restart-epoch (start the epoch "
            "over: samples already seen this epoch are seen again) or drop (no data position: a warm start for data).")
    if policy not in DATA_POLICIES:
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
    split = _match_split_form(states)
    if split is not None:  # a dataset's own position (torchtitan over Hugging Face datasets): its split's arithmetic
        return _decide_split(split, states, per_rank, world_keys, source_dp=source_dp, target_dp=target_dp,
                             policy=policy, key_for_rank=key_for_rank, pickled=pickled, what=what)
    matched = _match_form(states)
    if matched is None and setting is not None and not setting.elastic:
        raise BadInput(f"--data-policy {policy} is not available for {what}: {setting.why}"
                       + _split_forms_named(setting.trainer), where=keys[0],
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


# ---------------------------------------------------------------------------- a dataset's own position

class NotExact(ValueError):
    """Why no state on the new world size makes its ranks read exactly the examples not yet read."""


# Examples a translation may sweep (the spread of the ranks' positions): beyond it, refused.
MAX_SWEEP = 20_000_000


def split_forms() -> tuple[dict[str, Any], ...]:
    """The forms of a dataset's own position (`split` in formats/data_states.toml)."""
    return tuple(f for f in forms() if "split" in f)


def _split_forms_named(trainer: str) -> str:
    known = [f"{f.get('short', f['name'])} (form '{f['name']}')" for f in split_forms()
             if f.get("trainer") == trainer and "refused" not in f]
    return (f"; translate is offered only for {'; '.join(known)} in formats/data_states.toml"
            if known else "")


def _match_split_form(states: dict[int, Any]) -> dict[str, Any] | None:
    """The dataset form every rank's state has (its dataset state holds the position and the token buffers)."""
    for form in split_forms():
        def fits(st: Any) -> bool:
            ds = st.get(form["state_field"]) if isinstance(st, dict) else None
            return isinstance(ds, dict) and form["position_field"] in ds and all(b in ds for b in form["buffer_fields"])
        if states and all(fits(st) for st in states.values()):
            return form
    return None


def _types_in(obj: Any) -> list[str]:
    """Every examples iterable named in a `datasets` state (its nested ``type`` fields)."""
    out: list[str] = []
    if isinstance(obj, dict):
        if isinstance(obj.get("type"), str):
            out.append(obj["type"])
        for v in obj.values():
            out.extend(_types_in(v))
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            out.extend(_types_in(v))
    return out


def stream_position(form: dict[str, Any], state: dict[str, Any], where: str) -> tuple[int, int, Any]:
    """(shard_idx, shard_example_idx, epoch) of one rank's modulo-split stream, or BadInput saying why it is not one."""
    data = state[form["state_field"]][form["position_field"]]
    if not isinstance(data, dict):
        raise BadInput(f"the dataset position is {type(data).__name__}, not a datasets IterableDataset state", where=where,
                       hint="Use --data-policy drop.")
    for t in _types_in(data):
        if t in form.get("refused_types", {}):
            raise BadInput(f"--data-policy translate cannot carry this dataset position ({t}): {form['refused_types'][t]}",
                           where=where, hint="Use --data-policy drop (no data position: a warm start for data).")
    outer = data.get("examples_iterable")
    if not isinstance(outer, dict) or outer.get("type") != form["stream_wrapper"]:
        raise BadInput(f"the dataset position is not a stream of form '{form['name']}' "
                       f"(outer examples iterable {outer.get('type') if isinstance(outer, dict) else outer!r})",
                       where=where, hint="Use --data-policy drop.")
    for name, want in form["wrapper_idle"].items():
        got = outer.get(name)
        if want == "none" and isinstance(got, dict) and form.get("guard_key") in got:
            continue  # written by an earlier translation (`guard_key`), never read in the split by example
        if got != (None if want == "none" else want):
            raise BadInput("the dataset was split into whole shards per rank (datasets' split_dataset_by_node when the shard "
                           "count is a multiple of the dp degree; its position is an Arrow-batched one within the rank's own "
                           "shards): which examples those are depends on the shards' lengths, which the checkpoint does not record",
                           where=where, hint="Use --data-policy drop.")
    inner = outer.get("examples_iterable")
    if isinstance(inner, dict) and inner.get("type") == form["stream_wrapper"] and form.get("nested_wrapper"):
        raise BadInput(f"--data-policy translate cannot carry this dataset position: {form['nested_wrapper']}", where=where,
                       hint="Use --data-policy drop (no data position: a warm start for data).")
    if not isinstance(inner, dict) or inner.get("type") not in form["stream_types"]:
        raise BadInput(f"the dataset stream is read through {inner.get('type') if isinstance(inner, dict) else inner!r}, "
                       "whose state is not a known stream position", where=where, hint="Use --data-policy drop.")
    shard, idx = inner.get("shard_idx"), inner.get("shard_example_idx")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (shard, idx)):
        raise BadInput(f"the stream position ({shard!r}, {idx!r}) is not a pair of counts", where=where, hint="Use --data-policy drop.")
    return shard, idx, data.get("epoch", 0)


def _stream_owner(idx: list[int], x: int) -> int:
    return (x - idx[0]) % len(idx)


def stream_consumed(idx: list[int], x: int) -> bool:
    """Whether stream example x (relative to the positions' shard) was read by the old ranks at positions ``idx``."""
    r = _stream_owner(idx, x)
    return x < idx[r] + r


def translate_stream(idx: list[int], new_world: int) -> list[int]:
    """The stream position p'_k of each of ``new_world`` ranks so that they read exactly the unread examples.

    ``idx[r]`` is old rank r's position (relative to the shard they share); the derivation is
    in the module docstring. Raises NotExact with the reason where no such positions exist.
    """
    world = len(idx)
    if new_world < 1 or world < 1:
        raise NotExact(f"a world of {new_world} ranks")
    if any((i - idx[0]) % world for i in idx):
        raise NotExact(f"the positions {idx[:8]} are not congruent modulo {world}: these ranks did not split one stream "
                       f"in groups of {world} (datasets' modulo mode)")
    b = [i + r for r, i in enumerate(idx)]  # each old rank's first unread example
    m, top = min(b), max(b)
    if top + new_world - m > MAX_SWEEP:
        raise NotExact(f"the ranks' positions are {top - m} examples apart (more than {MAX_SWEEP} to check)")
    first: list[int | None] = [None] * new_world  # a_c: the first unread example of class c mod W'
    for x in range(m, top + new_world):
        c = x % new_world
        if x < b[_stream_owner(idx, x)]:
            if first[c] is not None:
                raise NotExact(
                    f"the old ranks read different numbers of examples (positions {idx[:8]}{' ...' if world > 8 else ''}): "
                    f"example {x} was read but example {first[c]}, before it in the same class modulo {new_world}, was not, "
                    f"so no set of {new_world} ranks each reading one example in {new_world} can take up exactly the unread ones")
        elif first[c] is None:
            first[c] = x
    # Rank k may serve class c when its position a_c - k is one the shard is known to have (0 .. max idx):
    # an interval of ranks per class; the classes taken by the earliest end of their interval, each given the
    # lowest free rank in it, find an assignment whenever one exists (intervals on a line). With every rank at
    # one position P this gives rank k the class of P + k: every new rank resumes at P.
    top_idx = max(idx)
    spans = sorted((min(new_world - 1, a), max(0, a - top_idx), a) for a in first if a is not None)
    free = list(range(new_world))
    pos = [0] * new_world
    for end, start, a in spans:
        k = next((k for k in free if start <= k <= end), None)
        if k is None:
            raise NotExact(f"the unread examples of some class modulo {new_world} start past every position recorded "
                           f"(the furthest is {top_idx}), where the shard may already have ended: no new rank can be "
                           "sent there with a position the shard is known to have")
        free.remove(k)
        pos[k] = a - k
    return pos


def stream_proof(idx: list[int], new_pos: list[int]) -> dict[str, Any]:
    """Recount, independently of `translate_stream`: the examples the old ranks read are exactly those no new rank reads.

    New rank k at position p'_k reads p'_k + k + i*W'. On the window from the lowest first
    unread example (every example below it read before, and no new rank starts below it) to
    W' past the largest first read (beyond it both sides are periodic: nothing read before,
    and, the starts being distinct modulo W', every example read once), count the examples
    read before, those no new rank reads, and those read twice. Counts are of the positions'
    shard from its start (with shard 0, of the whole stream: the example ids of an unshuffled one).
    """
    world, new_world = len(idx), len(new_pos)
    starts = [p + k for k, p in enumerate(new_pos)]
    lo = min(min(i + r for r, i in enumerate(idx)), min(starts))
    hi = max(max(i + r for r, i in enumerate(idx)), max(starts)) + new_world
    reads = bytearray(hi - lo)
    for st in starts:
        for x in range(st, hi, new_world):
            reads[x - lo] = min(reads[x - lo] + 1, 2)
    before = sum(1 for x in range(lo, hi) if stream_consumed(idx, x))
    after = reads.count(0)
    differ = sum(1 for x in range(lo, hi) if stream_consumed(idx, x) != (reads[x - lo] == 0))
    return {"window": [lo, hi], "consumed_before": lo + before, "consumed_after": lo + after, "differ": differ,
            "read_twice": reads.count(2), "starts_distinct": len({s % new_world for s in starts}) == new_world,
            "old_world": world, "new_world": new_world,
            "exact": differ == 0 and reads.count(2) == 0 and len({s % new_world for s in starts}) == new_world}


def _normalized(positions: list[int]) -> list[int]:
    """torchtitan's ``_normalize_positions``: a leading document tail renumbered from 0 (up to the next 0)."""
    out = list(positions)
    if out and out[0] > 0:
        offset = out[0]
        for i, p in enumerate(out):
            if p == 0:
                break
            out[i] = p - offset
    return out


def combine_buffers(old: dict[int, dict[str, list]], new_world: int, fields: list[str],
                    positions_field: str) -> dict[int, dict[str, list]]:
    """Old rank r's token buffers, in rank order, appended to new rank r mod W'; every token kept once.

    Each appended part's leading positions are renumbered from 0, as torchtitan does for a
    document tail that starts a sequence, so that no part continues the previous part's document.
    """
    new = {k: {f: [] for f in fields} for k in range(new_world)}
    for r in sorted(old):
        dest = new[r % new_world]
        for f in fields:
            part = list(old[r][f])
            dest[f].extend(_normalized(part) if f == positions_field else part)
    return new


def _decide_split(form: dict[str, Any], states: dict[int, Any], per_rank: dict[int, tuple[str, Any]],
                  world_keys: dict[str, Any], *, source_dp: int, target_dp: int, policy: str, key_for_rank: Any,
                  pickled: bool, what: str) -> DataDecision:
    """`translate` of a dataset's own position (a form with `split`), or BadInput saying why it is not exact."""
    where = per_rank[min(per_rank)][0]
    if "refused" in form:
        raise BadInput(f"--data-policy {policy} cannot carry {what} across data-parallel width {source_dp} -> {target_dp} "
                       f"(form '{form['name']}'): {form['refused']}", where=where,
                       hint="Use --data-policy drop (no data position: a warm start for data).")
    if policy != "translate":
        raise BadInput(f"--data-policy {policy} is not offered for {what} (form '{form['name']}')", where=where,
                       hint="Use --data-policy translate (every example not yet read, read once on the new ranks), or "
                       "--data-policy drop (no data position: a warm start for data).")
    ranks = sorted(states)
    found = {r: stream_position(form, states[r], per_rank[r][0]) for r in ranks}
    shards = sorted({f[0] for f in found.values()})
    epochs = {repr(f[2]) for f in found.values()}
    if len(epochs) != 1:
        raise BadInput(f"the dp ranks' streams are in different epochs ({sorted(epochs)})", where=where,
                       hint="Use --data-policy drop.")
    if len(shards) != 1:
        raise BadInput(f"the dp ranks' stream positions lie in different shards ({shards}): how far apart they are depends "
                       "on the shards' lengths, which the checkpoint does not record", where=where, hint="Use --data-policy drop.")
    if target_dp == 1:
        raise BadInput("one rank cannot resume this stream: datasets never splits by example for a world of 1 (every shard "
                       "count is a multiple of 1), it reads the whole stream in Arrow batches, whose position this form "
                       "does not write", where=where, hint="Use --data-policy drop, or convert to 2 or more data-parallel ranks.")
    idx = [found[r][1] for r in ranks]
    try:
        new_pos = translate_stream(idx, target_dp)
    except NotExact as exc:
        raise BadInput(f"--data-policy translate is not exact for {what} ({form['name']}) on {target_dp} ranks: {exc}",
                       where=where, hint="Use --data-policy drop (no data position: a warm start for data).") from None
    proof = stream_proof(idx, new_pos)
    if not proof["exact"]:  # the derivation and the recount disagree: a bug, never a silent repeat or skip
        raise BadInput(f"the translated stream positions fail their proof ({proof})", where=where,
                       hint="Use --data-policy drop, and report this.")
    shard = shards[0]
    fields = list(form["buffer_fields"])
    old_buffers = {r: {f: states[r][form["state_field"]][f] for f in fields} for r in ranks}
    for r, buf in old_buffers.items():
        if not all(isinstance(v, list) for v in buf.values()) or len({len(v) for v in buf.values()}) != 1:
            raise BadInput(f"dp rank {r}'s token buffers are not lists of one length ({ {f: type(v).__name__ for f, v in buf.items()} })",
                           where=per_rank[r][0], hint="Use --data-policy drop.")
    buffers = combine_buffers(old_buffers, target_dp, fields, form["positions_buffer"])
    proven = target_dp % source_dp == 0
    requires = (f"met: the source was split by example over {source_dp} ranks, so its shard count is not a multiple of "
                f"{source_dp}, nor then of {target_dp}" if proven else form["requires"])
    d = DataDecision("per_rank", "translate", form=form["name"], repeated=0, skipped=0, continuity=True, requires=requires,
                     proof={**proof, "shard": shard, "buffered_tokens_before": sum(len(b[fields[0]]) for b in old_buffers.values()),
                            "buffered_tokens_after": sum(len(b[fields[0]]) for b in buffers.values())})
    template = states[ranks[0]]
    for k in range(target_dp):
        st = copy.deepcopy(template)
        ds = st[form["state_field"]]
        outer = ds[form["position_field"]]["examples_iterable"]
        inner = outer["examples_iterable"]
        inner["shard_idx"], inner["shard_example_idx"] = shard, new_pos[k]
        if form.get("guard_key"):  # read in Arrow batches (whole shards per rank), datasets fails on this key
            outer["previous_state"] = {form["guard_key"]: True, **inner}
        for f in fields:
            ds[f] = buffers[k][f]
        d.writes[key_for_rank(k)] = encode_state(st, pickled)
        d.resume.append({"rank": k, "shard": shard, "position": new_pos[k],
                         "first_examples": [new_pos[k] + k + i * target_dp for i in range(4)],
                         "buffered_tokens": len(buffers[k][fields[0]])})
    for r, (k, _) in per_rank.items():
        if key_for_rank(r) in d.writes:
            d.rewritten[k] = f"translate ({form['name']}): rank {r} of {target_dp}"
        else:
            d.dropped[k] = (f"translate ({form['name']}): dp rank {r} does not exist on {target_dp} ranks; its unread examples "
                            "are read by the new ranks and its buffered tokens carried to one of them")
    for k, v in world_keys.items():
        if isinstance(v, int) and not isinstance(v, bool):
            d.writes[k] = target_dp
            d.rewritten[k] = f"world size {v} -> {target_dp}"
        else:
            raise BadInput(f"shared data key holds {type(v).__name__}, expected a world size", where=k, hint="Use --data-policy drop.")
    at = f"shard {shard}, " if shard else ""
    at = f" of shard {shard}" if shard else ""
    d.note = (f"per-rank dataset positions translated through form '{form['name']}': {proof['consumed_before']} stream examples{at} "
              f"read on {source_dp} ranks; the {target_dp} new ranks resume at stream position{'s' if len(set(new_pos)) > 1 else ''} "
              f"{', '.join(map(str, sorted(set(new_pos))))} and read every example not yet read, once (proof: the examples "
              f"read before are exactly those no new rank reads, none twice); {d.proof['buffered_tokens_before']} buffered tokens carried"
              + ("" if proven else f"; requires: {requires}"))
    return d
