"""The plan's text made faster (issue 45 follow-up) is the text it was: `to_json` (its pieces to a buffer) against
``json.dumps(indent=2, default=str)`` on random nested reports, and `Plan.fingerprint` against the
per-row ``json.dumps`` it replaced (kept here as the reference) on plans of a real ``dcp.save``
checkpoint to several targets. Cost: about 2 s with the session's FSDP2 checkpoint made."""
from __future__ import annotations

import enum
import hashlib
import json
import random
from pathlib import Path

import pytest

from reshard.model.plan import Options, Plan
from reshard.planning.plan import make_plan
from reshard.render.report import to_json
from reshard.storage.source import Source


class _Role(str, enum.Enum):
    CARRIED = "carried"


class _Rank(enum.IntEnum):
    THREE = 3


def _scalar(rng: random.Random) -> object:
    return rng.choice(["", 'a"b', "é✓\n", 0, -5, 2**70, 1.5, float("nan"), float("inf"), -0.0, True, False, None,
                       _Role.CARRIED, _Rank.THREE, Path("/x")])


def _value(rng: random.Random, depth: int) -> object:
    r = rng.random()
    if depth > 3 or r < 0.5:
        return _scalar(rng)
    if r < 0.7:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if r < 0.8:
        return tuple(_value(rng, depth + 1) for _ in range(rng.randint(0, 3)))
    return {rng.choice(["k", "x", "é", 1, 2.5, True, None, _Role.CARRIED]): _value(rng, depth + 1)
            for _ in range(rng.randint(0, 4))}


def test_to_json_writes_what_json_dumps_writes() -> None:
    rng = random.Random(45)
    for _ in range(3_000):
        report = {"a": _value(rng, 0), "b": _value(rng, 0)}
        assert to_json(report) == json.dumps(report, indent=2, default=str), repr(report)


def _reference_fingerprint(p: Plan) -> str:
    """The fingerprint as it was computed before: one ``json.dumps`` per row."""
    h = hashlib.sha256()
    head = {"source": p.source, "target": p.target.degrees(), "keys": [k.to_dict() for k in p.keys],
            "options": p.options.to_dict(), "new": sorted(p.new_values)}
    h.update(json.dumps(head, sort_keys=True, default=str).encode())
    for t in p.tensors:
        row = [t.key, t.role, list(t.shape), t.dtype, t.placement.describe(), t.chunks, t.transform, t.copy_from]
        h.update(json.dumps(row, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("to", ["dp=2", "dp=3", "dp=1", "dp=8"])
def test_fingerprint_as_before(plain_fsdp2_ckpt: Path, to: str) -> None:
    p = make_plan(Source.of(plain_fsdp2_ckpt), Options(to=to))
    assert p.fingerprint() == _reference_fingerprint(p)
    assert p.to_dict()["fingerprint"] == p.fingerprint()
