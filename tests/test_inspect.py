"""`reshard inspect` on real checkpoints: complete, consistent, and honest about what is wrong."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import run_cli
from reshard.errors import BadInput, Incomplete, UnsafeInput
from reshard.storage.checkpoints.index import CheckpointIndex


def test_reference_checkpoint_complete_and_consistent(reference_ckpt, capsys):
    code, out, err = run_cli(["inspect", reference_ckpt, "--json"], capsys)
    assert code == 0, err
    r = json.loads(out)
    assert r["complete"] is True and r["consistent"] is True and r["problems"] == []
    assert r["step"] == 3 and r["step_source"] == "manifest"
    assert r["experiment_id"] == "test-ref"
    t = r["topology"]
    assert (t["dp_shard"], t["tp"], t["pp"], t["world_size"], t["source"]) == (4, 1, 1, 4, "manifest")
    assert r["convention"]["name"] == "reshard"
    rng = r["per_rank_state"]["rng"]
    assert rng["keyed_per_rank"] is True and rng["ranks"] == [0, 1, 2, 3] and rng["missing_ranks"] == []
    opt = r["optimizer"]
    assert opt["moment_names"] == ["exp_avg", "exp_avg_sq"]
    assert opt["missing_moments"] == [] and opt["shape_mismatches"] == []
    # every parameter but the tied LM head (one tensor under two names) carries moments
    assert opt["with_moments"] == opt["parameters"] - 1
    assert opt["step_counters"]["consistent"] is True and opt["step_counters"]["values"] == [3]
    assert opt["tied"] == [{"names": ["tok_emb.weight", "lm_head.weight"], "source": "manifest", "equal": True}]
    assert r["entries"] > 0 and "unknown" not in r["by_role"]
    assert r["batch"]["global_batch"] == r["batch"]["micro_batch"] * r["batch"]["grad_accum"] * 4


def test_reference_checkpoint_text_report(reference_ckpt, capsys):
    code, out, _ = run_cli(["inspect", reference_ckpt], capsys)
    assert code == 0
    assert "complete and consistent" in out
    assert "dp_shard=4 (world size 4, manifest)" in out
    assert "rng: keyed per rank, ranks 0-3" in out
    assert "tok_emb.weight = lm_head.weight: bitwise equal" in out


def test_moments_have_parameter_global_shape(reference_ckpt):
    ix = CheckpointIndex.open(reference_ckpt)
    for key, e in ix.entries.items():
        if key.startswith("optim.state.") and key.endswith(".exp_avg"):
            fqn = key[len("optim.state."):-len(".exp_avg")]
            assert e.shape == ix.entries["model." + fqn].shape


def test_plain_fsdp2_topology_is_inferred(plain_fsdp2_ckpt, capsys):
    code, out, err = run_cli(["inspect", plain_fsdp2_ckpt, "--json"], capsys)
    r = json.loads(out)
    assert r["manifest"] is False
    assert r["topology"]["source"] == "inferred"
    assert r["topology"]["dp_shard"] == 4 and r["topology"]["world_size"] == 4
    assert r["convention"]["name"] == "torch-get-state-dict"
    assert r["complete"] is True
    assert code == 0, r["problems"]
    text_code, text, _ = run_cli(["inspect", plain_fsdp2_ckpt], capsys)
    assert "inferred" in text


def test_from_spec_contradicting_the_chunks_is_refused(plain_fsdp2_ckpt, capsys):
    """4 dim-0 pieces from 4 writers cannot be dp_shard=2 (issue 31): a stated layout is checked, not believed."""
    code, out, err = run_cli(["inspect", plain_fsdp2_ckpt, "--json", "--from", "dp_shard=2,dp_replicate=2"], capsys)
    said = json.loads(out)["error"]
    assert code == 2 and "Traceback" not in err
    assert "--from dp_shard=2,dp_replicate=2" in said and "dp_shard=4 (world size 4)" in said, said
    code, out, _ = run_cli(["inspect", plain_fsdp2_ckpt, "--json", "--from", "dp=4"], capsys)
    t = json.loads(out)["topology"]
    assert code == 0 and (t["dp_shard"], t["world_size"], t["source"]) == (4, 4, "given")


def test_torchtitan_layout_recognised(torchtitan_ckpt, capsys):
    code, out, err = run_cli(["inspect", torchtitan_ckpt, "--json"], capsys)
    r = json.loads(out)
    assert r["convention"]["name"] == "torchtitan"
    assert r["unknown_keys"] == []
    assert r["per_rank_state"]["data"]["ranks"] == [0, 1]
    assert r["step"] == 2 and r["step_source"] == "counter"
    assert r["optimizer"]["moment_names"] == ["exp_avg", "exp_avg_sq"]
    assert code == 0, r["problems"]


def test_missing_metadata_is_not_committed(reference_ckpt, copy_of, capsys):
    ck = copy_of(reference_ckpt)
    (ck / ".metadata").unlink()
    code, out, err = run_cli(["inspect", ck], capsys)
    assert code == 2
    assert "not committed" in err and str(ck) in err
    assert "Traceback" not in err


def test_truncated_data_file_names_file_and_keys(reference_ckpt, copy_of, capsys):
    ck = copy_of(reference_ckpt)
    victim = ck / "__2_0.distcp"
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        f.truncate(size // 2)
    code, out, err = run_cli(["inspect", ck, "--json"], capsys)
    assert code == 2
    r = json.loads(out)
    assert r["complete"] is False
    trunc = [p for p in r["problems"] if p["code"] == "truncated_file"]
    assert len(trunc) == 1 and trunc[0]["file"] == "__2_0.distcp"
    lost = set(trunc[0]["keys"])
    assert lost and all(k in CheckpointIndex.open(reference_ckpt).entries for k in lost)
    # exactly the keys whose byte ranges cross the cut
    ix = CheckpointIndex.open(ck)
    expect = set()
    for k, e in ix.entries.items():
        locs = [c.location for c in e.chunks] if e.is_tensor else [e.location]
        if any(l.file == "__2_0.distcp" and l.offset + l.length > size // 2 for l in locs):
            expect.add(k)
    assert lost == expect


def test_missing_data_file(reference_ckpt, copy_of, capsys):
    ck = copy_of(reference_ckpt)
    (ck / "__1_0.distcp").unlink()
    code, out, _ = run_cli(["inspect", ck, "--json"], capsys)
    assert code == 2
    probs = json.loads(out)["problems"]
    assert any(p["code"] == "missing_file" and p["file"] == "__1_0.distcp" and p["keys"] for p in probs)


@pytest.mark.parametrize("embed", [True, False])
def test_malicious_metadata_never_runs(reference_ckpt, copy_of, tmp_path, capsys, embed):
    from reshard.testing.synthetic import write_malicious_metadata

    ck = copy_of(reference_ckpt)
    marker = tmp_path / "pwned"
    write_malicious_metadata(ck, marker, embed=embed)
    code, out, err = run_cli(["inspect", ck], capsys)
    assert code == 2
    assert "refusing to unpickle" in err and ".metadata" in err
    assert "Traceback" not in err
    assert not marker.exists()
    with pytest.raises(UnsafeInput):
        CheckpointIndex.open(ck)
    assert not marker.exists()


def test_garbage_metadata_is_bad_input(reference_ckpt, copy_of, capsys):
    ck = copy_of(reference_ckpt)
    data = (ck / ".metadata").read_bytes()
    (ck / ".metadata").write_bytes(data[: len(data) // 3])
    code, _, err = run_cli(["inspect", ck], capsys)
    assert code == 2 and ".metadata" in err and "Traceback" not in err


def test_deep_finds_corrupt_item_bytes(reference_ckpt, copy_of, capsys):
    ck = copy_of(reference_ckpt)
    ix = CheckpointIndex.open(ck)
    key = next(k for k in ix.entries if k.endswith("fc1.weight.exp_avg"))
    e = ix.entries[key]
    loc = e.chunks[0].location
    with open(ck / loc.file, "r+b") as f:  # same length, scrambled bytes: only --deep can tell
        f.seek(loc.offset)
        f.write(b"\x00" * min(64, loc.length))
    assert run_cli(["inspect", ck], capsys)[0] == 0
    code, out, _ = run_cli(["inspect", ck, "--json", "--deep"], capsys)
    assert code == 2
    bad = [p for p in json.loads(out)["problems"] if p["code"] == "unreadable_item"]
    assert bad and bad[0]["keys"] == [key] and bad[0]["file"] == loc.file


def _save(sd, path: Path, **kw) -> Path:
    dcp.save(sd, checkpoint_id=str(path), no_dist=True, **kw)
    return path


def _adam_state(t: torch.Tensor, step: float) -> dict:
    return {"exp_avg": torch.zeros_like(t), "exp_avg_sq": torch.ones_like(t), "step": torch.tensor(step)}


def test_step_counters_disagree_exit_1(tmp_path, capsys):
    a, b = torch.randn(4, 2), torch.randn(3)
    ck = _save({"model": {"a": a, "b": b},
                "optim": {"state": {"a": _adam_state(a, 5.0), "b": _adam_state(b, 4.0)}}}, tmp_path / "ck")
    code, out, _ = run_cli(["inspect", ck, "--json"], capsys)
    r = json.loads(out)
    assert code == 1 and r["complete"] is True and r["consistent"] is False
    assert r["optimizer"]["step_counters"]["values"] == [4, 5]
    assert r["optimizer"]["step_counters"]["disagreements"] == {"4": ["b"], "5": ["a"]}


def test_missing_moments_and_untied_head_exit_1(tmp_path, capsys):
    emb, head, w = torch.randn(8, 4), torch.randn(8, 4), torch.randn(4, 4)
    ck = _save({"model": {"tok_emb.weight": emb, "lm_head.weight": head, "w": w},
                "optim": {"state": {"tok_emb.weight": _adam_state(emb, 2.0), "w": _adam_state(w, 2.0)}}},
               tmp_path / "ck")
    code, out, _ = run_cli(["inspect", ck, "--json"], capsys)
    r = json.loads(out)
    assert code == 1
    assert r["optimizer"]["tied"][0]["equal"] is False
    assert r["optimizer"]["missing_moments"] == ["lm_head.weight"]


def test_inferred_tie_when_copies_equal(tmp_path, capsys):
    emb, w = torch.randn(8, 4), torch.randn(4, 4)
    ck = _save({"model": {"tok_emb.weight": emb, "lm_head.weight": emb.clone(), "w": w},
                "optim": {"state": {"tok_emb.weight": _adam_state(emb, 2.0), "w": _adam_state(w, 2.0)}}},
               tmp_path / "ck")
    code, out, _ = run_cli(["inspect", ck, "--json"], capsys)
    r = json.loads(out)
    assert code == 0, r["problems"]
    assert r["optimizer"]["tied"] == [{"names": ["tok_emb.weight", "lm_head.weight"], "source": "inferred", "equal": True}]


def test_unknown_keys_are_listed_never_hidden(tmp_path, capsys):
    ck = _save({"model": {"w": torch.randn(2, 2)}, "mystery": {"thing": 3}, "other_tensor": torch.zeros(3)},
               tmp_path / "ck")
    code, out, _ = run_cli(["inspect", ck, "--json"], capsys)
    r = json.loads(out)
    assert r["unknown_keys"] == ["mystery.thing", "other_tensor"]
    assert any(p["code"] == "unknown_keys" for p in r["problems"])


def test_per_rank_rng_gap_is_inconsistent(tmp_path, capsys):
    """A checkpoint declaring 4 ranks but holding RNG for 3 of them has lost state."""
    sd = {"model": {"w": torch.randn(2, 2)}, "trainer": {"step": 1},
          "rng": {f"rank_{r}": {"torch": torch.get_rng_state()} for r in (0, 1, 3)}}
    ck = _save(sd, tmp_path / "ck")
    code, out, _ = run_cli(["inspect", ck, "--json", "--from", "dp=4"], capsys)
    r = json.loads(out)
    assert code == 1
    assert r["per_rank_state"]["rng"]["missing_ranks"] == [2]


def test_read_box_reads_only_what_it_needs(tmp_path):
    from reshard.model.geometry import Box
    from reshard.testing.synthetic import make_sharded, synthetic_value

    ck = make_sharded(tmp_path / "ck", world_size=2, n_tensors=2, shape=(6, 5), shard_dim=0)
    ix = CheckpointIndex.open(ck)
    key = "model.layers.1.weight"
    full = synthetic_value(1, (6, 5))
    assert torch.equal(ix.read_tensor(key), full)
    box = Box((1, 2), (4, 3))  # crosses the rank-0/rank-1 boundary at row 3
    assert torch.equal(ix.read_box(key, box), full[1:5, 2:5])
    # a box inside rank 1's rows needs rank 1's file only
    (ck / "__0_0.distcp").unlink()
    assert torch.equal(ix.read_box(key, Box((3, 0), (3, 5))), full[3:6])
    with pytest.raises(Incomplete):
        ix.read_box(key, Box((0, 0), (2, 5)))


def test_zstd_items_are_read(tmp_path):
    pytest.importorskip("zstandard")
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    t = torch.arange(100.0).reshape(10, 10)
    ck = tmp_path / "z"
    dcp.save({"model": {"w": t}}, storage_writer=FileSystemWriter(str(ck), _extensions=[ZStandard()]), no_dist=True)
    ix = CheckpointIndex.open(ck)
    assert ix.entries["model.w"].chunks[0].location.transforms == ("stream.zstd/1",)
    assert torch.equal(ix.read_tensor("model.w"), t)


def test_zstd_without_module_is_refused_clearly(tmp_path, monkeypatch, capsys):
    pytest.importorskip("zstandard")
    import sys

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    ck = tmp_path / "z"
    dcp.save({"model": {"w": torch.ones(3)}}, storage_writer=FileSystemWriter(str(ck), _extensions=[ZStandard()]), no_dist=True)
    monkeypatch.setitem(sys.modules, "zstandard", None)
    monkeypatch.setitem(sys.modules, "pyzstd", None)
    code, out, err = run_cli(["inspect", ck, "--deep"], capsys)
    assert code == 2
    assert "zstd" in out and "pip install" in out
    with pytest.raises(BadInput, match="pip install"):
        CheckpointIndex.open(ck).read_tensor("model.w")


def test_object_item_with_foreign_class_refused(tmp_path, capsys):
    """An object item that would unpickle an arbitrary class is refused, not executed."""
    import fractions

    ck = _save({"model": {"w": torch.ones(2)}, "data": {"sampler": fractions.Fraction(1, 3)}}, tmp_path / "ck")
    code, out, _ = run_cli(["inspect", ck, "--json", "--deep"], capsys)
    r = json.loads(out)
    assert code == 2
    assert any(p["code"] == "unsafe_item" and p["keys"] == ["data.sampler"] for p in r["problems"])
    code, out, _ = run_cli(["inspect", ck, "--json", "--deep", "--trust-pickle"], capsys)
    assert not any(p["code"] == "unsafe_item" for p in json.loads(out)["problems"])
