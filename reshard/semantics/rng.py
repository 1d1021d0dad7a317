"""RNG policy across a topology change.

Per-rank RNG states belong to rank positions. When every rank keeps its position they are
carried. Otherwise a state must come from somewhere explicit: `reseed` derives each new
rank's state from (seed, step, rank), deterministically and recorded; `carry` keeps the
states of ranks that still exist and reseeds the new ones; `drop` removes them. Rank 0's
state is never handed to other ranks: identical dropout masks on every rank would be a
silent change of the training distribution.
"""
from __future__ import annotations

import hashlib
import random
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reshard.errors import BadInput
from reshard.model.dtypes import dtype_named
from reshard.model.kinds import RNG_POLICIES
from reshard.model.tensor_values import ArrayTensor

INT64 = dtype_named("int64")
UINT8 = dtype_named("uint8")


@dataclass
class RngDecision:
    policy: str  # "carry" | "reseed" | "drop" | "none" | "shared"
    seed: int | None = None
    step: int | None = None
    per_rank: dict[int, str] = field(default_factory=dict)  # new rank -> "carried from rank r" | "reseeded(...)"
    note: str = ""
    writes: dict[str, Any] = field(default_factory=dict)    # flat key -> value (new per-rank states)
    rewritten: dict[str, str] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    carried_to: dict[str, int] = field(default_factory=dict)  # source key -> target rank whose file holds it

    @property
    def streams_kept(self) -> bool:
        return self.policy in ("carry", "none", "shared") and all(v.startswith("carried") for v in self.per_rank.values())

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "seed": self.seed, "step": self.step,
                "per_rank": {str(k): v for k, v in sorted(self.per_rank.items())}, "note": self.note}


def derived_seed(seed: int, step: int, rank: int) -> int:
    """A 63-bit seed from (seed, step, rank); stable across Python versions and machines."""
    h = hashlib.sha256(f"reshard-rng:{seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(h[:8], "little") >> 1


def seeded_state(seed: int) -> dict[str, Any]:
    """A fresh state in the shape `reshard.train.rng.capture()` returns, without touching this process's RNGs.

    Its tensors are `reshard.model.tensor_values.ArrayTensor` values, made without torch: a
    conversion that reseeds ranks imports no torch for them (1.7 s of CPU, more on a loaded
    machine), and the writer writes each as the item ``torch.save`` writes for the tensor
    ``capture()`` would hold, byte for byte (``tests/test_torchfree_convert.py`` checks
    `torch_generator_state` against ``torch.Generator`` for many seeds)."""
    py_version, py_state, py_gauss = random.Random(seed).getstate()
    _, np_keys, np_pos, np_has_gauss, np_cached = np.random.RandomState(seed % (2**32)).get_state(legacy=True)
    return {
        "python": {"version": int(py_version), "state": ArrayTensor(INT64, np.asarray(py_state, dtype="<i8")),
                   "gauss_next": [] if py_gauss is None else [float(py_gauss)]},
        "numpy": {"keys": ArrayTensor(INT64, np.asarray(np_keys, dtype="<i8")), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_cached)},
        "torch": ArrayTensor(UINT8, torch_generator_state(seed)),
    }


MT_N = 624
"""Words of an mt19937 state."""

_TORCH_STATE = struct.Struct(f"<QiiQ{MT_N}Q")
"""The head of torch's ``CPUGeneratorImplState`` (``aten/src/ATen/CPUGeneratorImpl.h``), as its
``get_state`` lays it out on a 64-bit little-endian machine: ``the_initial_seed`` (u64), ``left`` and
``seeded`` (int), ``next`` (u64), the mt19937 ``state`` (624 words, each a u64); then ``normal_x``,
``normal_y``, ``normal_rho`` (double), ``normal_is_valid`` (int), padding, the float normal sample and
its validity flag, padding: 5,056 bytes in all, zero after the state in a freshly seeded generator."""

TORCH_STATE_BYTES = 5056


def torch_generator_state(seed: int) -> np.ndarray:
    """The bytes of ``torch.Generator().manual_seed(seed).get_state()`` (a uint8 tensor) as a uint8 array.

    torch seeds its mt19937 with ``init_genrand`` of the seed's low 32 bits, as numpy's legacy
    ``RandomState(seed32)`` does, so numpy's state words are torch's; a fresh generator has
    ``left = 1``, ``seeded = 1``, ``next = 0`` and no cached normal sample."""
    seed = int(seed) % (2**64)  # torch takes the seed as a uint64
    words = np.random.RandomState(seed % (2**32)).get_state(legacy=True)[1]
    out = bytearray(TORCH_STATE_BYTES)
    _TORCH_STATE.pack_into(out, 0, seed, 1, 1, 0, *words.tolist())
    return np.frombuffer(bytes(out), dtype=np.uint8)


def flatten(obj: Any, prefix: str) -> dict[str, Any]:
    """Flatten nested dicts as DCP does (dict levels joined with '.'; other values are leaves)."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}.{k}"))
        return out
    return {prefix: obj}


def decide(per_rank: dict[int, list[str]], *, source_world: int, target_world: int, same_positions: bool,
           policy: str | None, seed: int, step: int, prefix_for_rank: Any) -> RngDecision:
    """``per_rank``: source rank -> its flat keys; ``prefix_for_rank(r)`` -> e.g. ``rng.rank_<r>``."""
    if not per_rank:
        return RngDecision("none", note="no per-rank RNG state in the checkpoint")
    if policy is None:
        policy = "carry" if same_positions else "reseed"
        auto = True
    else:
        auto = False
    if policy not in RNG_POLICIES:
        raise BadInput(f"unknown --rng-policy '{policy}'", hint="Use carry, reseed or drop.")
    d = RngDecision(policy, seed=seed, step=step)
    if policy == "drop":
        for keys in per_rank.values():
            for k in keys:
                d.dropped[k] = "--rng-policy drop"
        d.note = "per-rank RNG dropped: the trainer seeds itself; random streams differ from the source run"
        return d
    template_rank = min(per_rank)
    tpl_prefix = prefix_for_rank(template_rank)
    suffixes = sorted(k[len(tpl_prefix):] for k in per_rank[template_rank])
    for r in range(target_world):
        if policy == "carry" and r in per_rank:
            d.per_rank[r] = f"carried from rank {r}"
            for k in per_rank[r]:
                d.carried_to[k] = r
            continue
        s = derived_seed(seed, step, r)
        fresh = flatten(seeded_state(s), prefix_for_rank(r))
        got = sorted(k[len(prefix_for_rank(r)):] for k in fresh)
        if got != suffixes:
            raise BadInput(f"per-rank RNG state has a structure reshard cannot regenerate (keys {suffixes[:6]})",
                           where=tpl_prefix, hint="Use --rng-policy drop (the trainer then seeds itself) or keep the world size.")
        d.per_rank[r] = f"reseeded from (seed={seed}, step={step}, rank={r})"
        d.writes.update(fresh)
    for r, keys in per_rank.items():
        for k in keys:
            if k in d.carried_to:
                continue
            if r < target_world:
                d.rewritten[k] = f"rank {r} reseeded (--rng-policy {policy})"
            else:
                d.dropped[k] = f"rank {r} does not exist on {target_world} ranks (--rng-policy {policy})"
    if policy == "carry" and d.writes:
        d.note = "states of ranks that keep their position carried; new ranks reseeded from (seed, step, rank)"
    elif policy == "carry":
        d.note = "every rank keeps its position: per-rank RNG carried"
    else:
        d.note = ("ranks change position: " if auto else "") + "every rank's RNG reseeded from (seed, step, rank); random streams (dropout) differ from the source run"
    return d
