"""`convert --output-format local`: one safetensors file per target rank, checked against real torch.

1. 4-rank FSDP2 reference checkpoint -> dp=2 local: each rank's file holds exactly the slices
   of the global tensors at the boxes the index names (replicas included), objects load with
   ``weights_only=True``, `reshard verify SRC DST` and `reshard inspect DST` accept it.
2. Those files equal what a real 2-rank FSDP2 job holds locally (``to_local()``) after
   ``dcp.load`` of the DCP output of the same conversion, bit for bit.
3. A fused TP=2 Llama -> tp=1,dp=2: the fused tensors' local slices are the canonical layout.
4. A corrupted index or a missing file is refused with exit 2 naming the file.
"""
from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import run_cli
from reshard.train.launch import start_ranks
from reshard.errors import BadInput
from reshard.model.geometry import Box
from reshard.storage.checkpoints.index import CheckpointIndex
from reshard.storage.checkpoints.local_format import INDEX_FILE, SHARED_OBJECTS, LocalIndex, open_any, open_local, rank_file
from reshard.model.layout import local_box
from reshard.model.plan import Options
from reshard.planning.plan import make_plan


class _Capture:
    """A capsys stand-in for module-scoped fixtures (`run_cli` only calls `readouterr`)."""

    def __init__(self) -> None:
        self.out, self.err = io.StringIO(), io.StringIO()

    def readouterr(self) -> tuple[str, str]:
        return self.out.getvalue(), self.err.getvalue()


def _cli(args: list) -> tuple[int, str, str]:
    cap = _Capture()
    with contextlib.redirect_stdout(cap.out), contextlib.redirect_stderr(cap.err):
        return run_cli(args, cap)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _box(d: dict) -> Box:
    return Box(tuple(d["offsets"]), tuple(d["sizes"]))


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def ref_out(reference_ckpt, tmp_path_factory) -> dict:
    """The reference checkpoint converted to dp=2, once as local files and once as DCP."""
    root = tmp_path_factory.mktemp("local")
    local, dcp_out = root / "local", root / "dcp"
    res_local = _cli(["convert", reference_ckpt, local, "--to", "dp=2", "--output-format", "local"])
    res_dcp = _cli(["convert", reference_ckpt, dcp_out, "--to", "dp=2", "--output-format", "dcp"])
    return {"root": root, "src": reference_ckpt, "local": local, "dcp": dcp_out, "res_local": res_local,
            "res_dcp": res_dcp, "plan": make_plan(reference_ckpt, Options(to="dp=2"))}


def _ok(res) -> None:
    code, out, err = res
    assert code == 0, f"exit {code}: {out}{err}"


# ------------------------------------------------------------------------------ 1. the files
def test_dp2_files_hold_each_ranks_slices(ref_out):
    _ok(ref_out["res_local"])
    _ok(ref_out["res_dcp"])
    local, plan = ref_out["local"], ref_out["plan"]
    index = json.loads((local / INDEX_FILE).read_text())
    assert index["format"] == "reshard-local" and index["format_version"] == 1 and index["world_size"] == 2
    assert index["topology"]["dp_shard"] == 2
    assert index["files"] == {"0": rank_file(0, 2), "1": rank_file(1, 2)}
    src, dcp_out = CheckpointIndex.open(ref_out["src"]), CheckpointIndex.open(ref_out["dcp"])
    rewritten = {a.key for a in plan.keys if a.action in ("rewritten", "added")}
    dropped = {a.key for a in plan.keys if a.action == "dropped"}
    files = {r: load_file(str(local / rank_file(r, 2))) for r in range(2)}
    for r in range(2):
        with safe_open(str(local / rank_file(r, 2)), framework="pt") as f:
            assert f.metadata() == {"reshard": "local", "rank": str(r), "world_size": "2"}
    checked = 0
    for t in plan.tensors:
        assert t.key in index["tensors"], t.key
        entry = index["tensors"][t.key]
        assert entry["global_shape"] == list(t.shape) and entry["dtype"] == t.dtype
        per_rank = t.role in ("rng", "data") and "rank_" in t.key
        for r in range(2):
            box = local_box(t.shape, t.placement, plan.target, r)
            holds = (r == next(a.rank for a in plan.keys if a.key == t.key)) if per_rank else \
                box is not None and not (t.shape and box.is_empty())
            assert (str(r) in entry["ranks"]) == holds, (t.key, r)
            assert (t.key in files[r]) == holds, (t.key, r)
            if not holds:
                continue
            b = _box(entry["ranks"][str(r)])
            if not per_rank:
                assert b == box, (t.key, r, b, box)
            got = files[r][t.key]
            # the same bytes as the DCP output of the same plan, and as the source unless rewritten
            assert _same_bits(got, dcp_out.read_box(t.key, b)), (t.key, r)
            if t.key not in rewritten:
                assert _same_bits(got, src.read_box(t.key, b)), (t.key, r)
            checked += 1
    assert checked > 200
    # nothing else in the files; dropped keys nowhere
    for r in range(2):
        assert set(files[r]) == {k for k, e in index["tensors"].items() if str(r) in e["ranks"]}
        assert not dropped & set(files[r])
    # replicated optimizer step counters: every rank has its own copy
    steps = [k for k in index["tensors"] if k.endswith(".step")]
    assert steps and all(k in files[0] and k in files[1] for k in steps)


def test_objects_load_safely_and_match_the_dcp_output(ref_out):
    _ok(ref_out["res_local"])
    local, plan = ref_out["local"], ref_out["plan"]
    index = json.loads((local / INDEX_FILE).read_text())
    dcp_out = CheckpointIndex.open(ref_out["dcp"])
    shared = torch.load(local / SHARED_OBJECTS, weights_only=True)
    per_rank = {r: torch.load(local / f"rank-{r:05d}-objects.pt", weights_only=True) for r in range(2)}
    tensor_keys = {t.key for t in plan.tensors}
    for a in plan.keys:
        if a.action == "dropped" or a.key in tensor_keys:
            assert a.key not in index["objects"]
            continue
        o = index["objects"][a.key]
        if a.key.startswith("rng.rank_"):
            assert o["rank"] == a.rank and o["ranks"] == [a.rank]
            value = per_rank[a.rank][a.key]
            assert all(a.key not in per_rank[r] for r in range(2) if r != a.rank)
        else:
            assert o == {"rank": "all", "file": SHARED_OBJECTS, "ranks": [0, 1]}
            value = shared[a.key]
        expect = dcp_out.read_object(a.key)
        assert type(value) is type(expect) and repr(value) == repr(expect), a.key


def test_verify_and_inspect_accept_the_local_output(ref_out, capsys):
    _ok(ref_out["res_local"])
    local = ref_out["local"]
    report = json.loads((local / "reshard-report.json").read_text())
    assert report["output_format"] == "local" and report["verification"]["equal"]
    rng_rewrites = [k["key"] for k in report["plan"]["keys"] if k["action"] == "rewritten" and k["key"].startswith("rng.")]
    assert rng_rewrites, "the conversion report names the RNG rewrites"
    code, out, err = run_cli(["verify", ref_out["src"], local], capsys)
    assert code == 0, out + err
    assert "verdict     equal" in out and "rng.rank_" in out
    # a DCP checkpoint and its local twin are the same state
    code, out, err = run_cli(["verify", ref_out["dcp"], local, "--strict"], capsys)
    assert code == 0, out + err
    code, out, err = run_cli(["inspect", local], capsys)
    assert code == 0, out + err
    ix = open_any(local)
    assert isinstance(ix, LocalIndex) and ix.complete and ix.writer_ranks() == [0, 1]
    assert isinstance(open_any(ref_out["dcp"]), CheckpointIndex)


# ------------------------------------------------------------------------------ 2. real DTensor shards
def test_files_equal_the_local_shards_of_a_real_fsdp2_job(ref_out):
    """2 gloo ranks build the reference model at dp=2, dcp.load the DCP output, compare to_local()."""
    import _dcp_load_worker
    from reshard.reference.trainer import free_port

    _ok(ref_out["res_local"])
    _ok(ref_out["res_dcp"])
    out_dir = ref_out["root"] / "loaded"
    out_dir.mkdir()
    job = {"tag": "dp2", "n": 2, "dst": str(ref_out["dcp"]), "port": free_port(),
           "cfg": {"dp": 2, "micro_batch": 2, "grad_accum": 4}}
    start_ranks(_dcp_load_worker.worker, ([job], str(out_dir)), 2)
    index = json.loads((ref_out["local"] / INDEX_FILE).read_text())
    moments = 0
    for r in range(2):
        got = torch.load(out_dir / f"dp2_rank{r}.pt", weights_only=False)
        assert got["error"] is None, got["error"]
        mine = load_file(str(ref_out["local"] / rank_file(r, 2)))
        for key, rec in got["tensors"].items():
            assert key in mine, f"rank {r}: {key} missing from its local file"
            assert _same_bits(mine[key], rec["local"]), (r, key)
            if rec["dtensor"]:
                assert tuple(index["tensors"][key]["ranks"][str(r)]["offsets"]) == rec["offsets"], (r, key)
            moments += key.endswith(".exp_avg") or key.endswith(".exp_avg_sq")
        # and nothing model/optimizer-shaped that the job does not hold
        extra = {k for k in mine if k.startswith(("model.", "optim.")) and k not in got["tensors"]}
        assert not extra, (r, sorted(extra)[:5])
    assert moments == 2 * 72


# ------------------------------------------------------------------------------ 3. fused TP layouts
def test_fused_tp2_to_tp1_dp2_slices_are_canonical(tmp_path, capsys):
    from reshard.testing.synthetic_llama import LlamaShape, make_llama_checkpoint
    from reshard.semantics.transforms import to_canonical

    src = make_llama_checkpoint(tmp_path / "tp2", shape=LlamaShape(), tp=2, dp=1, fused=True, seed=3)
    dst = tmp_path / "local"
    args = ["--to", "tp=1,dp=2", "--micro-batch", "1", "--grad-accum", "1", "--schedule", "steps"]
    code, out, err = run_cli(["convert", src, dst, *args, "--output-format", "local"], capsys)
    assert code == 0, out + err
    plan = make_plan(src, Options(to="tp=1,dp=2", micro_batch=1, grad_accum=1, schedule="steps"))
    ix, lix = CheckpointIndex.open(src), open_local(dst)
    files = {r: load_file(str(dst / rank_file(r, 2))) for r in range(2)}
    kinds = set()
    for t in plan.tensors:
        if t.key in plan.new_values:
            continue
        g = ix.read_tensor(t.copy_from or t.key)
        tr = t.transform
        if tr and tr["kind"] == "reinterleave":
            assert tr["from_tp"] == 2 and tr["to_tp"] == 1
            g = to_canonical(g, tr["dim"], tr["parts"], 2)
        elif tr and tr["kind"] == "repad":
            g = g.narrow(tr["dim"], 0, tr["to_rows"])
        if tr:
            kinds.add(tr["kind"])
        assert tuple(g.shape) == tuple(t.shape), t.key
        for r in range(2):
            box = lix.holders(t.key).get(r)
            assert box == local_box(t.shape, t.placement, plan.target, r), (t.key, r)
            assert _same_bits(files[r][t.key], g[box.slices()] if g.dim() else g), (t.key, r)
    assert kinds == {"reinterleave", "repad"}


# ------------------------------------------------------------------------------ 4. corruption
@pytest.fixture
def damaged(ref_out, tmp_path):
    _ok(ref_out["res_local"])
    dst = tmp_path / "damaged"
    shutil.copytree(ref_out["local"], dst)
    return dst


def _edit_index(d: Path, fn) -> None:
    index = json.loads((d / INDEX_FILE).read_text())
    fn(index)
    (d / INDEX_FILE).write_text(json.dumps(index))


def test_index_with_a_gap_is_refused(ref_out, damaged, capsys):
    _edit_index(damaged, lambda ix: ix["tensors"]["model.blocks.0.mlp.fc1.weight"].update(writers=[0]))
    for cmd in (["verify", ref_out["src"], damaged], ["inspect", damaged]):
        code, out, err = run_cli(cmd, capsys)
        assert code == 2, out + err
        assert INDEX_FILE in out + err and "model.blocks.0.mlp.fc1.weight" in out + err and "tile" in out + err
    with pytest.raises(BadInput, match="do not tile"):
        open_local(damaged)


def test_missing_rank_file_is_refused(ref_out, damaged, capsys):
    (damaged / rank_file(1, 2)).unlink()
    code, out, err = run_cli(["verify", ref_out["src"], damaged], capsys)
    assert code == 2, out + err
    assert rank_file(1, 2) in out + err


def test_header_disagreeing_with_the_index_is_refused(damaged):
    _edit_index(damaged, lambda ix: ix["tensors"]["model.ln_f.weight"].update(dtype="float64"))
    with pytest.raises(BadInput) as exc:
        open_local(damaged)
    assert rank_file(0, 2) in str(exc.value) and "model.ln_f.weight" in str(exc.value)


def test_missing_objects_file_is_refused(damaged, capsys):
    (damaged / SHARED_OBJECTS).unlink()
    code, out, err = run_cli(["inspect", damaged], capsys)
    assert code == 2 and SHARED_OBJECTS in out + err
