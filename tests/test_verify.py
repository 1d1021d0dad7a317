"""`reshard verify` on real checkpoints: equal in global terms whatever the chunking, and
precise about what differs (key, element index, values) when something does."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from reshard.errors import Incomplete, ReshardError
from reshard.storage.checkpoints.index import CheckpointIndex
from reshard.testing.synthetic import list_rank_files, make_sharded, synthetic_value, truncate_file
from reshard.render.verify import render_verify
from reshard.verification.checkpoints import progress_bytes, verify_checkpoints
from reshard.verification.objects import object_difference
from reshard.render.progress import Progress

SHAPE = (10, 7)  # 10 rows over 3 ranks -> 4, 4, 2; 7 columns over 3 ranks -> 3, 3, 1
N = 3


def _save(path: Path, sd: dict, manifest: dict | None = None) -> Path:
    """A single-process DCP save (real dcp.save, one writer file), optionally with a manifest."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    if manifest is not None:
        (path / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    return path


def _globals(dtype=torch.float32) -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.weight": synthetic_value(i, SHAPE, dtype) for i in range(N)}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> dict[str, Path]:
    """The same global state saved by real multi-rank jobs with three different chunkings."""
    root = tmp_path_factory.mktemp("verify_sharded")
    return {
        "ws2_dim0": make_sharded(root / "ws2_dim0", world_size=2, n_tensors=N, shape=SHAPE, shard_dim=0),
        "ws3_dim0": make_sharded(root / "ws3_dim0", world_size=3, n_tensors=N, shape=SHAPE, shard_dim=0),
        "ws3_dim1": make_sharded(root / "ws3_dim1", world_size=3, n_tensors=N, shape=SHAPE, shard_dim=1),
    }


# ------------------------------------------------------------------------------- tensors
@pytest.mark.parametrize("a,b", [("ws2_dim0", "ws3_dim0"), ("ws2_dim0", "ws3_dim1"), ("ws3_dim1", "ws3_dim0")])
def test_same_state_differently_chunked_is_equal(sharded, a, b):
    boxes = [[c.box for c in CheckpointIndex.open(sharded[k]).entries["model.layers.0.weight"].chunks] for k in (a, b)]
    assert boxes[0] != boxes[1]  # the chunkings really differ
    r = verify_checkpoints(sharded[a], sharded[b])
    assert r["equal"] is True and r["exit_code"] == 0 and r["differences"] == [], r["differences"]
    assert r["compared"] == {"tensors": N, "objects": 0, "elements": N * 70, "bytes": N * 70 * 4}
    assert r["tolerance"] == {"rtol": 0.0, "atol": 0.0}
    json.dumps(r)  # the --json shape serialises as is
    assert render_verify(r).splitlines()[0].split() == ["verdict", "equal"]


def test_single_chunk_save_equals_sharded_save(sharded, tmp_path):
    whole = _save(tmp_path / "whole", _globals())
    for name in ("ws2_dim0", "ws3_dim1"):
        assert verify_checkpoints(sharded[name], whole)["equal"] is True
        assert verify_checkpoints(whole, sharded[name])["equal"] is True


def test_one_element_changed_is_named_with_its_index(sharded, tmp_path):
    sd = _globals()
    key = "model.layers.1.weight"
    before = float(sd[key][7, 3])
    sd[key][7, 3] = 42.0
    changed = _save(tmp_path / "changed", sd)
    for a in ("ws2_dim0", "ws3_dim0", "ws3_dim1"):  # the answer does not depend on A's chunking
        r = verify_checkpoints(sharded[a], changed)
        assert r["equal"] is False and r["exit_code"] == 1
        assert len(r["differences"]) == 1, r["differences"]
        d = r["differences"][0]
        assert (d["key"], d["kind"], d["index"], d["count"], d["numel"]) == (key, "value", [7, 3], 1, 70)
        assert d["a"] == before and d["b"] == 42.0
        assert "[7, 3]" in d["detail"]
    text = render_verify(r)
    assert text.splitlines()[0].startswith("verdict     DIFFERENT (1 difference)")
    assert any(key in line and "[7, 3]" in line for line in text.splitlines())


def test_first_difference_is_global_first_and_all_are_counted(sharded, tmp_path):
    sd = _globals()
    key = "model.layers.0.weight"
    sd[key][7, 3] += 1.0  # in A's (ws3_dim1) second column chunk, visited first
    sd[key][2, 5] += 1.0  # in A's third column chunk, but earlier in row-major order
    sd[key][9, 6] += 1.0
    changed = _save(tmp_path / "changed", sd)
    r = verify_checkpoints(sharded["ws3_dim1"], changed)
    (d,) = r["differences"]
    assert d["index"] == [2, 5] and d["count"] == 3


def test_dtype_change_is_a_difference_unless_tolerances_given(sharded, tmp_path):
    bf16 = _save(tmp_path / "bf16", {k: v.to(torch.bfloat16) for k, v in _globals().items()})
    r = verify_checkpoints(sharded["ws3_dim1"], bf16)
    assert r["equal"] is False and r["exit_code"] == 1
    assert sorted(d["key"] for d in r["differences"]) == sorted(_globals())
    assert {d["kind"] for d in r["differences"]} == {"dtype"}
    assert {(d["a"], d["b"]) for d in r["differences"]} == {("float32", "bfloat16")}

    for tol in ({"atol": 1e-2}, {"rtol": 1e-2, "atol": 1e-6}):
        r = verify_checkpoints(sharded["ws3_dim1"], bf16, **tol)
        assert r["equal"] is True, r["differences"]
        assert r["compared"]["tensors"] == N and len(r["notes"]) == N  # the cast is noted, not hidden

    # a tolerance is not a blank cheque: an element off by more than atol is still found
    sd = {k: v.to(torch.bfloat16) for k, v in _globals().items()}
    sd["model.layers.2.weight"][0, 0] += 0.5
    off = _save(tmp_path / "off", sd)
    r = verify_checkpoints(sharded["ws2_dim0"], off, atol=1e-2)
    (d,) = r["differences"]
    assert (d["key"], d["kind"], d["index"], d["count"]) == ("model.layers.2.weight", "value", [0, 0], 1)


def test_missing_unexpected_and_shape(sharded, tmp_path):
    sd = _globals()
    del sd["model.layers.2.weight"]
    sd["model.extra.bias"] = torch.zeros(3)
    sd["model.layers.0.weight"] = torch.zeros(7, 10)
    other = _save(tmp_path / "other", sd)
    r = verify_checkpoints(sharded["ws2_dim0"], other)
    kinds = {d["key"]: d["kind"] for d in r["differences"]}
    assert kinds == {"model.layers.2.weight": "missing", "model.extra.bias": "unexpected",
                     "model.layers.0.weight": "shape"}
    shape = next(d for d in r["differences"] if d["kind"] == "shape")
    assert (shape["a"], shape["b"]) == ([10, 7], [7, 10])
    assert r["compared"]["tensors"] == 1  # only layers.1 reached the value comparison


def test_bitwise_is_nan_safe_and_exact(tmp_path):
    t = torch.tensor([1.0, float("nan"), 0.0, 3.0])
    sd = {"model.w": t, "model.n": torch.arange(5), "model.s": torch.tensor(2.5), "model.m": torch.tensor([True, False])}
    a = _save(tmp_path / "a", sd)
    b = _save(tmp_path / "b", {k: v.clone() for k, v in sd.items()})
    assert verify_checkpoints(a, b)["equal"] is True  # NaN == NaN when the bits are the same
    neg = {k: v.clone() for k, v in sd.items()}
    neg["model.w"][2] = -0.0
    neg["model.s"] = torch.tensor(2.0)
    c = _save(tmp_path / "c", neg)
    r = verify_checkpoints(a, c)
    got = {d["key"]: d for d in r["differences"]}
    assert set(got) == {"model.w", "model.s"}
    assert got["model.w"]["index"] == [2]  # -0.0 and 0.0 differ bit for bit
    assert got["model.s"]["index"] == [] and (got["model.s"]["a"], got["model.s"]["b"]) == (2.5, 2.0)
    r = verify_checkpoints(a, c, atol=0.6)
    assert r["equal"] is True, r["differences"]


# ------------------------------------------------------------------------------- objects and rewrites
def _with_objects(**changes) -> dict:
    sd = {"model.w": torch.ones(4),
          "scheduler.last_epoch": 3,
          "scheduler.base_lrs": [0.1, 0.2],
          "optim.param_groups.0.betas": (0.9, 0.95),
          # DCP flattens dicts (and lists of dicts) but stores a tuple whole: one structured object
          "optim.param_groups.0.extra": ({"name": "adamw", "nested": {"k": [1, 2, 3]}, "t": torch.arange(3)},)}
    sd.update(changes)
    return sd


def test_object_differences_and_expected_rewrites(tmp_path):
    a = _save(tmp_path / "a", _with_objects())
    same = _save(tmp_path / "same", _with_objects())
    r = verify_checkpoints(a, same)
    assert r["equal"] is True and r["compared"]["objects"] >= 4

    changed = _save(tmp_path / "changed", _with_objects(**{
        "scheduler.base_lrs": [0.1, 0.25],
        "optim.param_groups.0.extra": ({"name": "adamw", "nested": {"k": [1, 2, 4]}, "t": torch.arange(3)},),
        "scheduler.new_field": 1,
    }))
    r = verify_checkpoints(a, changed)
    got = {d["key"]: d for d in r["differences"]}
    assert set(got) == {"scheduler.base_lrs", "optim.param_groups.0.extra", "scheduler.new_field"}
    assert got["scheduler.base_lrs"]["kind"] == "object" and "0.25" in got["scheduler.base_lrs"]["detail"]
    assert "[0]['nested']['k'][2]" in got["optim.param_groups.0.extra"]["detail"]
    assert got["scheduler.new_field"]["kind"] == "unexpected"

    # the caller rewrote the scheduler on purpose: its keys move to `rewritten`
    r = verify_checkpoints(a, changed, expected_rewrites={"scheduler": "schedule remapped to the new batch size"})
    assert [d["key"] for d in r["differences"]] == ["optim.param_groups.0.extra"]
    assert {w["key"]: w["reason"] for w in r["rewritten"]} == {
        "scheduler.base_lrs": "schedule remapped to the new batch size",
        "scheduler.new_field": "schedule remapped to the new batch size"}
    r = verify_checkpoints(a, changed, expected_rewrites={
        "scheduler.base_lrs": "remapped", "scheduler.new_field": "added", "optim.param_groups.0.extra": "x",
        "scheduler.last_epoch": "listed but unchanged"})
    assert r["equal"] is True and r["exit_code"] == 0
    assert sorted(w["key"] for w in r["rewritten"]) == ["optim.param_groups.0.extra", "scheduler.base_lrs",
                                                       "scheduler.new_field"]


def test_object_difference_rules():
    assert object_difference({"a": [1, 2.0, (3, None)]}, {"a": [1, 2.0, (3, None)]}) is None
    assert object_difference(float("nan"), float("nan")) is None
    assert object_difference(3, 3.0) is not None  # types must match
    assert object_difference([1, 2], [1, 2, 3]) == "value: length 2 in A, 3 in B"
    assert object_difference({"a": 1}, {"b": 1}).startswith("value: keys only in A")
    assert object_difference(torch.tensor([float("nan")]), torch.tensor([float("nan")])) is None
    assert object_difference(b"ab", b"ac") is not None


# ------------------------------------------------------------------------------- per-rank state and semantics
def _manifest(reference: Path, world: int, **changes) -> dict:
    m = json.loads((reference / "manifest.json").read_text())
    dims = {d: 1 for d in m["topology"]["dims"]}
    dims["dp_shard"] = world
    m["topology"] = {"dims": dims, "mesh_order": ["dp_shard"], "world_size": world}
    m["model"]["tied"] = []
    for k, v in changes.items():
        if "." in k:
            outer, inner = k.split(".")
            m[outer][inner] = v
        else:
            m[k] = v
    return m


def _rank_state(ranks, *, bump: int | None = None) -> dict:
    sd = {"model.w": torch.arange(12, dtype=torch.float32).view(3, 4), "data.sampler.cursor": 48}
    for r in ranks:
        g = torch.Generator().manual_seed(100 + r)
        sd[f"rng.rank_{r}.torch"] = g.get_state()
        sd[f"rng.rank_{r}.python.gauss_next"] = None
        sd[f"rng.rank_{r}.numpy.pos"] = 624 + (1 if r == bump else 0)
    return sd


def test_per_rank_state_follows_each_sides_world_size(reference_ckpt, tmp_path):
    four = _save(tmp_path / "four", _rank_state(range(4)), _manifest(reference_ckpt, 4))
    two = _save(tmp_path / "two", _rank_state(range(2)), _manifest(reference_ckpt, 2))
    # ranks 2 and 3 exist only at world size 4: not missing from a world-size-2 checkpoint
    for a, b in ((four, two), (two, four)):
        r = verify_checkpoints(a, b)
        assert r["equal"] is True, r["differences"]
        assert r["compared"]["tensors"] == 1 + 2  # model.w and the rng tensors of ranks 0, 1

    three_of_four = _save(tmp_path / "three", _rank_state(range(3)), _manifest(reference_ckpt, 4))
    r = verify_checkpoints(four, three_of_four)
    assert r["equal"] is False and r["exit_code"] == 1
    (d,) = r["differences"]
    assert (d["kind"], d["key"], d["side"], d["expected"], d["ranks"]) == ("per_rank", "rng", "B", 4, [0, 1, 2])
    assert "missing ranks [3]" in d["detail"]

    # a rank present on both sides is compared by value
    bumped = _save(tmp_path / "bumped", _rank_state(range(2), bump=1), _manifest(reference_ckpt, 2))
    r = verify_checkpoints(four, bumped)
    assert [(d["key"], d["kind"]) for d in r["differences"]] == [("rng.rank_1.numpy.pos", "object")]


def test_semantics_compared_but_not_experiment_id(reference_ckpt, tmp_path):
    base = _save(tmp_path / "base", _rank_state(range(2)), _manifest(reference_ckpt, 2))
    renamed = _save(tmp_path / "renamed", _rank_state(range(2)),
                    _manifest(reference_ckpt, 2, experiment_id="warm-start-2"))
    assert verify_checkpoints(base, renamed)["equal"] is True

    moved = _save(tmp_path / "moved", _rank_state(range(2)),
                  _manifest(reference_ckpt, 2, step=4, **{"data.cursor": 7}))
    r = verify_checkpoints(base, moved)
    got = {d["key"]: d for d in r["differences"]}
    assert set(got) == {"step", "data.cursor"} and {d["kind"] for d in got.values()} == {"semantics"}
    assert (got["step"]["a"], got["step"]["b"]) == (3, 4)
    r = verify_checkpoints(base, moved, expected_rewrites={"data.cursor": "cursor rounded to the new global batch"})
    assert [d["key"] for d in r["differences"]] == ["step"]
    assert r["rewritten"][0]["key"] == "data.cursor"


# ------------------------------------------------------------------------------- reference checkpoint
def test_reference_checkpoint_equals_its_copy(reference_ckpt, copy_of):
    copy = copy_of(reference_ckpt)

    bar = Progress()  # shows nothing; counts each phase's bytes
    r = verify_checkpoints(reference_ckpt, copy, progress=bar)
    assert r["equal"] is True and r["exit_code"] == 0, r["differences"]
    assert r["compared"]["tensors"] > 0 and r["compared"]["objects"] > 0
    (comparing,) = [ph for ph in bar.phases if ph.name == "comparing"]
    assert comparing.done == comparing.total == progress_bytes(CheckpointIndex.open(reference_ckpt))
    json.dumps(r)

    truncate_file(list_rank_files(copy)[-1], 10)
    with pytest.raises(Incomplete) as exc:
        verify_checkpoints(reference_ckpt, copy)
    assert isinstance(exc.value, ReshardError) and exc.value.exit_code == 2
    assert list_rank_files(copy)[-1].name in str(exc.value)
