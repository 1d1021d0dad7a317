"""The keys axis's fast paths (issue 45) give what the plain paths give.

`plan` at 180k keys was made faster by paths that stand in for general ones: a tensor's chunk
table as a range of the index's columns (`ColumnChunks`), the groups of rule patterns of a few
literal shapes sliced from the keys (`conventions.groups_by_shape`), and `to_json` writing a
top-level list of flat rows by templates. Each is held here to the general path it replaces, on a
real ``dcp.save`` checkpoint (the session's plain FSDP2 one) and on crafted edge cases; the
byte-identical plans at 10k-1M keys are `scripts/bench_keys.py`'s (`docs/benchmarks.md`).

Cost: under 2 s beyond the session checkpoint (no process of its own).
"""
from __future__ import annotations

import json
import pickle
from enum import Enum
from pathlib import Path

from reshard.model.checkpoint import ChunkTable
from reshard.render.report import to_json
from reshard.semantics.conventions import builtin_conventions, groups_by_shape
from reshard.storage.checkpoints.index import CheckpointIndex, ColumnChunks


class _Kind(str, Enum):
    DONE = "done"


def _reference(report: object) -> str:
    return json.dumps(report, indent=2, default=str)


def test_column_tables_answer_as_the_chunks_they_stand_for(plain_fsdp2_ckpt: Path) -> None:
    """Every `ColumnChunks` equals its chunks; its ends, sole location and pickle agree with them."""
    ix = CheckpointIndex.open(plain_fsdp2_ckpt)
    tables = [(e, e.chunks) for e in ix.tensors() if isinstance(e.chunks, ColumnChunks)]
    assert len(tables) > 10
    for e, tab in tables:
        chunks = list(tab)
        assert len(tab) == len(chunks) == len(tab.offsets) == len(tab.file)
        back = pickle.loads(pickle.dumps(tab))
        assert type(back) is ChunkTable and back == chunks
        first, last = chunks[0], chunks[-1]
        assert tab.ends() == (
            bytes(ChunkTable.of([first], len(e.shape)).offsets), bytes(ChunkTable.of([first], len(e.shape)).sizes),
            bytes(ChunkTable.of([last], len(e.shape)).offsets), bytes(ChunkTable.of([last], len(e.shape)).sizes),
            (first.location.file, first.location.length), (last.location.file, last.location.length))
        sole = chunks[0].location if len(chunks) == 1 and chunks[0].box.sizes == tuple(e.shape) else None
        assert tab.sole_location(e.shape) == sole
        assert {ix.entries[e.key].chunks.files[f] for f in set(tab.file.tolist())} == e.files()


def test_sliced_groups_are_the_groups_re2_reads(plain_fsdp2_ckpt: Path) -> None:
    """For every shipped rule whose pattern has a sliceable shape, on every key it matches."""
    keys = list(CheckpointIndex.open(plain_fsdp2_ckpt).entries) + [
        "model.a", "model.\u00e9.b", "optim.state.x.y.exp_avg", "optim.state.x.step", "optim.state..step.step",
        "optimizer.state.a.b.c_1", "app.model.q", "a", "a.b", "x/y", ".a", "model.a.b\nc"]
    pairs = 0
    for conv in builtin_conventions():
        for rule in conv.rules:
            cut = groups_by_shape(rule.pattern.pattern)
            if cut is None:
                continue
            for key in keys:
                want = rule.pattern.match_groups(key, ("param", "name", "rank"))
                if want is not None:
                    pairs += 1
                    assert cut(key) == want, (rule.pattern.pattern, key)
    assert pairs > 50
    assert groups_by_shape(r"^optimizer\.state\.(?P<param>\d+)\.step$") is None  # a class, not a literal: RE2's
    assert groups_by_shape(r"^(model|state_dict)\.(?P<param>.+)$") is None


def test_rows_written_by_templates_are_the_encoders_text(plain_fsdp2_ckpt: Path) -> None:
    """`to_json` is ``json.dumps(indent=2, default=str)``, with and without rows it writes itself."""
    import reshard

    rows = [{"key": f"k{i}", "role": "p\u00e9 \"q\"\n", "action": _Kind.DONE, "rank": i, "on": i % 2 == 0,
             "none": None} for i in range(300)] + [{}]
    report = {"a": 1, "keys": rows, "other": [{"x": 1}] * 300, "short": rows[:3], "nested": {"keys": rows}}
    assert to_json(report) == _reference(report)
    odd = dict(report, keys=rows + [{"x": 1.5}])  # a float: not a row the templates write
    assert to_json(odd) == _reference(odd)
    deep = dict(report, keys=rows + [{"x": [1]}])
    assert to_json(deep) == _reference(deep)
    assert to_json({"keys": []}) == _reference({"keys": []})
    plan = reshard.plan(plain_fsdp2_ckpt, to="dp=2").to_dict(tensors="auto")
    assert to_json(plan) == _reference(plan)
