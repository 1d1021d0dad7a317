"""`reshard export` (DCP -> consolidated safetensors / torch) and `reshard import` (back to DCP).

Real checkpoints: the session's 4-rank FSDP2 reference checkpoint and a synthetic Llama
with torchtitan names (2 gloo ranks). One spawned 2-rank job checks that an imported
checkpoint loads into the reference model at dp=2 and trains.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from reshard.errors import BadInput
from reshard.engine.export import export
from reshard.planning.export import RenameRules
from reshard.units import parse_size
from reshard.engine.importing import import_checkpoint
from reshard.storage.checkpoints.index import CheckpointIndex
from reshard.storage.checkpoints.safetensors_format import ExportIndex, is_export
from reshard.verification.checkpoints import verify_checkpoints

RENAME = Path(__file__).resolve().parent.parent / "formats" / "renames" / "torchtitan-to-hf-llama.toml"


def _model_keys(ix) -> list[str]:
    return sorted(k for k in ix.entries if k.startswith("model."))


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory) -> Path:
    from reshard.testing.synthetic_llama import make_llama_checkpoint

    return make_llama_checkpoint(tmp_path_factory.mktemp("llama") / "ckpt", tp=1, dp=2, fused=False)


# ------------------------------------------------------------------------------------ pure
def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("256MB") == 256 * 10**6
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1000") == 1000 and parse_size(7) == 7
    assert parse_size("1.5GiB") == 3 << 29
    for bad in ("", "5 parsecs", "0", "-1GB"):
        with pytest.raises(BadInput):
            parse_size(bad)


def test_rename_torchtitan_to_hf_llama_full_layer():
    rules = RenameRules.load(RENAME)
    expected = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    for n in (0, 7, 31):
        expected.update({
            f"layers.{n}.attention.wq.weight": f"model.layers.{n}.self_attn.q_proj.weight",
            f"layers.{n}.attention.wk.weight": f"model.layers.{n}.self_attn.k_proj.weight",
            f"layers.{n}.attention.wv.weight": f"model.layers.{n}.self_attn.v_proj.weight",
            f"layers.{n}.attention.wo.weight": f"model.layers.{n}.self_attn.o_proj.weight",
            f"layers.{n}.feed_forward.w1.weight": f"model.layers.{n}.mlp.gate_proj.weight",
            f"layers.{n}.feed_forward.w2.weight": f"model.layers.{n}.mlp.down_proj.weight",
            f"layers.{n}.feed_forward.w3.weight": f"model.layers.{n}.mlp.up_proj.weight",
            f"layers.{n}.attention_norm.weight": f"model.layers.{n}.input_layernorm.weight",
            f"layers.{n}.ffn_norm.weight": f"model.layers.{n}.post_attention_layernorm.weight",
        })
    assert {k: rules.apply(k) for k in expected} == expected
    inv = rules.inverse()
    assert {v: inv.apply(v) for v in expected.values()} == {v: k for k, v in expected.items()}
    assert rules.apply("rope.freqs") == "rope.freqs"  # unmatched names are kept (strict = false)


# ------------------------------------------------------------------------------------ safetensors round trip
def test_safetensors_round_trip_fp32_and_warm_start(reference_ckpt, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    from reshard.planning.describe import inspect_checkpoint
    from reshard.semantics.manifest import read_manifest

    exp = tmp_path / "export"
    rep = export(reference_ckpt, exp, fmt="safetensors")
    assert rep["shards"] == ["model.safetensors"] and rep["index"] is None
    assert rep["tied"] == [["tok_emb.weight", "lm_head.weight"]]
    assert json.loads((exp / "export-report.json").read_text())["keys"] == rep["keys"]
    src = CheckpointIndex.open(reference_ckpt)
    assert sorted(k["key"] for k in rep["keys"]) == sorted(src.entries)  # every source key reported once
    actions = {k["key"]: k["action"] for k in rep["keys"]}
    assert actions["model.lm_head.weight"] == "tied_copy"
    assert actions["optim.state.tok_emb.weight.exp_avg"] == "dropped" and actions["trainer.step"] == "dropped"

    d = load_file(exp / "model.safetensors")
    assert sorted(d) == sorted(k[len("model."):] for k in _model_keys(src) if k != "model.lm_head.weight")
    for name, t in d.items():
        assert _bitwise(t, src.read_tensor("model." + name)), name
    meta = safe_open(str(exp / "model.safetensors"), "pt").metadata()
    assert meta["format"] == "pt" and meta["experiment_id"] == "test-ref" and meta["step"] == "3"
    assert json.loads(meta["tied"]) == [["tok_emb.weight", "lm_head.weight"]]
    assert json.loads(meta["topology"])["dims"]["dp_shard"] == 4

    # verify DCP vs export: equal, the keys left out named as expected rewrites
    assert is_export(exp) and is_export(exp / "model.safetensors")
    r = verify_checkpoints(reference_ckpt, exp, recompute=True)  # left-out keys re-derived from the source
    assert r["equal"], r["differences"][:3]
    assert r["compared"]["tensors"] == len(_model_keys(src))  # the tied copy too

    # import back to dp=2: bitwise equal, a warm start
    dst = tmp_path / "imported"
    irep = import_checkpoint(exp, dst, to="dp=2", experiment_id="warm-1")
    assert irep["verification"]["equal"] and not irep["optimizer_moments"]
    out = CheckpointIndex.open(dst)
    assert _model_keys(out) == _model_keys(src) == sorted(out.entries)
    for k in _model_keys(src):
        assert _bitwise(out.read_tensor(k), src.read_tensor(k)), k
        assert len(out.entries[k].chunks) == min(2, out.entries[k].shape[0])  # FSDP Shard(0) over 2 ranks
    m = read_manifest(dst)
    assert m.continuity == "warm_start" and m.experiment_id == "warm-1" and m.topology.dims["dp_shard"] == 2
    assert [(e.event, e.kind) for e in m.lineage] == [("import", "warm_start")]
    assert m.lineage[0].reason.startswith("weights only from ")
    assert m.model.tied == [["tok_emb.weight", "lm_head.weight"]]
    ins = inspect_checkpoint(dst).report
    assert ins["exit_code"] == 0 and ins["continuity"] == "warm_start"
    assert any(n["code"] == "no_moments" for n in ins["notes"])
    assert ins["optimizer"]["moment_names"] == []


def test_multi_shard_model_and_optim(reference_ckpt, tmp_path):
    from safetensors.torch import load_file

    exp = tmp_path / "export"
    rep = export(reference_ckpt, exp, fmt="safetensors", only="model+optim", max_shard_size="40KB")
    n = len(rep["shards"])
    assert n > 2 and rep["shards"] == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    index = json.loads((exp / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    loaded = {}
    for f in rep["shards"]:
        part = load_file(exp / f)
        assert all(wm[k] == f for k in part)
        assert sum(t.numel() * t.element_size() for t in part.values()) <= 40_000 or len(part) == 1
        assert not set(part) & set(loaded)
        loaded.update(part)
    assert sorted(loaded) == sorted(wm)  # every key mapped exactly once, to the file that holds it
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in loaded.values())
    assert "optim.tok_emb.weight.exp_avg_sq" in wm and "optim.blocks.1.mlp.fc2.bias.step" in wm

    r = verify_checkpoints(reference_ckpt, exp, recompute=True)  # left-out keys re-derived from the source
    assert r["equal"], r["differences"][:3]

    dst = tmp_path / "imported"
    irep = import_checkpoint(exp, dst, to="dp=2")
    assert irep["optimizer_moments"] and "no scheduler" in irep["reason"]
    src, out = CheckpointIndex.open(reference_ckpt), CheckpointIndex.open(dst)
    tensors = [k for k, e in src.entries.items() if e.is_tensor and k.startswith(("model.", "optim.state."))]
    assert sorted(out.entries) == sorted(tensors)
    for k in tensors:
        assert _bitwise(out.read_tensor(k), src.read_tensor(k)), k


def test_bf16_export_verifies_within_tolerance_only(reference_ckpt, tmp_path):
    exp = tmp_path / "bf16"
    rep = export(reference_ckpt, exp, fmt="safetensors", dtype="bf16")
    assert rep["dtype"] == "bfloat16"
    ex = ExportIndex(exp)
    assert {e.dtype_name for e in ex.entries.values()} == {"bfloat16"}
    loose = verify_checkpoints(reference_ckpt, exp, rtol=1e-2, atol=1e-6, recompute=True)
    assert loose["equal"], loose["differences"][:3]
    strict = verify_checkpoints(reference_ckpt, exp, recompute=True)
    assert not strict["equal"] and {d["kind"] for d in strict["differences"]} == {"dtype"}


def test_torch_format_round_trip_and_refusals(reference_ckpt, tmp_path):
    exp = tmp_path / "pt"
    rep = export(reference_ckpt, exp, fmt="torch", max_shard_size="60KB")
    assert len(rep["shards"]) > 1 and (exp / "model.pt.index.json").is_file()
    src = CheckpointIndex.open(reference_ckpt)
    dst = tmp_path / "imported"
    import_checkpoint(exp, dst, to="dp=3")
    out = CheckpointIndex.open(dst)
    assert _model_keys(out) == _model_keys(src)
    for k in _model_keys(src):
        assert _bitwise(out.read_tensor(k), src.read_tensor(k)), k

    # tp/pp targets are refused with the way out
    with pytest.raises(BadInput, match="tp=2"):
        import_checkpoint(exp, tmp_path / "tp", to="dp=1,tp=2")
    # a pickle that needs more than weights_only is refused, not executed
    bad = tmp_path / "evil.pt"
    torch.save({"w": torch.zeros(2), "obj": Path("/x")}, bad)
    with pytest.raises(BadInput, match="weights_only"):
        import_checkpoint(bad, tmp_path / "evil", to="dp=1")
    with pytest.raises(BadInput, match="not a safetensors or torch.save file"):
        import_checkpoint(reference_ckpt / ".metadata", tmp_path / "meta", to="dp=1")
    assert not (tmp_path / "evil").exists() and not (tmp_path / "tp").exists()
    # an existing output is kept unless overwrite
    with pytest.raises(BadInput):
        export(reference_ckpt, exp, fmt="torch")
    export(reference_ckpt, exp, fmt="torch", overwrite=True)
    assert (exp / "model.pt").is_file() and (exp / "model.pt.index.json").is_file()


# ------------------------------------------------------------------------------------ torchtitan -> HF names
def test_llama_export_with_rename(llama_ckpt, tmp_path):
    from safetensors.torch import load_file, save_file

    from reshard.testing.synthetic_llama import LlamaShape, param_names

    exp = tmp_path / "hf"
    rep = export(llama_ckpt, exp, fmt="safetensors", rename=RENAME)
    rules = RenameRules.load(RENAME)
    titan = param_names(LlamaShape(), fused=False)
    d = load_file(exp / "model.safetensors")
    assert sorted(d) == sorted(rules.apply(n) for n in titan)
    assert "model.embed_tokens.weight" in d and "lm_head.weight" in d and "model.layers.1.mlp.down_proj.weight" in d
    assert rep["rename"]["name"] == "torchtitan-to-hf-llama"

    # verify against the source through the recorded export map
    r = verify_checkpoints(llama_ckpt, exp, recompute=True)
    assert r["equal"], r["differences"][:3]
    assert r["compared"]["tensors"] == len(titan)

    # import: the recorded map restores torchtitan names
    src = CheckpointIndex.open(llama_ckpt)
    back = tmp_path / "back"
    import_checkpoint(exp, back, to="dp=2")
    assert _model_keys(CheckpointIndex.open(back)) == sorted("model." + n for n in titan) == _model_keys(src)

    # a plain HF file (no reshard metadata): --rename read backwards gives the same names
    plain = tmp_path / "plain"
    plain.mkdir()
    save_file(d, plain / "model.safetensors", metadata={"format": "pt"})
    back2 = tmp_path / "back2"
    import_checkpoint(plain, back2, to="dp=1", rename=RENAME)
    out = CheckpointIndex.open(back2)
    assert _model_keys(out) == _model_keys(src)
    for k in _model_keys(src):
        assert _bitwise(out.read_tensor(k), src.read_tensor(k)), k
    # without rules the HF names are kept as FQNs
    back3 = tmp_path / "back3"
    import_checkpoint(plain, back3, to="dp=1")
    assert "model.model.embed_tokens.weight" in CheckpointIndex.open(back3).entries


# ------------------------------------------------------------------------------------ resume in the reference trainer
def test_imported_checkpoint_trains_in_the_reference_trainer_at_dp2(reference_ckpt, tmp_path, capsys):
    """`TrainConfig(resume=IMPORTED)`: weights loaded, fresh Adam, and it trains; inspect calls it a warm start."""
    import json

    from conftest import run_cli
    from reshard.reference import TrainConfig, run_reference

    exp, dst = tmp_path / "export", tmp_path / "imported"
    export(reference_ckpt, exp, fmt="safetensors")
    import_checkpoint(exp, dst, to="dp=2")
    code, out, _ = run_cli(["inspect", dst, "--json"], capsys)
    r = json.loads(out)
    assert code == 0 and r["continuity"] == "warm_start" and r["optimizer"]["moment_names"] == []
    assert any(n["code"] == "no_moments" for n in r["notes"])
    log = tmp_path / "log.jsonl"
    ckpts = run_reference(TrainConfig(dp=2, steps=2, save_at=[2], resume=str(dst), out=str(tmp_path / "run"),
                                      log=str(log)))
    steps = [json.loads(x) for x in log.read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and all(s["loss"] == s["loss"] for s in steps)
    saved = CheckpointIndex.open(ckpts[-1])
    assert any(k.startswith("optim.state.") for k in saved.entries)  # it trained: Adam state exists now
    m = json.loads((ckpts[-1] / "manifest.json").read_text())
    assert m["lineage"][0]["event"] == "import" and m["continuity"] == "warm_start"


def test_small_copy_for_testing_says_what_it_keeps(reference_ckpt, tmp_path, capsys):
    """`convert --to dp=1 --dtype bf16 --only model`: a copy that loads on one machine, never mistaken for the run."""
    import json

    from conftest import run_cli
    from reshard.reference import TrainConfig, run_reference

    dst = tmp_path / "small"
    code, out, err = run_cli(["convert", reference_ckpt, dst, "--to", "dp=1", "--dtype", "bf16", "--only", "model",
                              "--json"], capsys)
    assert code == 0, err
    r = json.loads(out)
    v = r["plan"]["verdict"]
    assert v["kind"] == "warm_start"
    assert any("optimizer state dropped" in x for x in v["warm_start_reasons"])
    assert any("cast to bfloat16" in x for x in v["warm_start_reasons"])
    assert all(k["action"] == "dropped" for k in r["plan"]["keys"] if k["key"].startswith("optim."))
    m = json.loads((dst / "manifest.json").read_text())
    assert m["continuity"] == "warm_start" and m["precision"]["param_dtype"] == "bfloat16"
    assert m["experiment_id"] != r["plan"]["source"]["experiment_id"]
    assert "reduced copy" in m["lineage"][-1]["reason"]
    ix, src = CheckpointIndex.open(dst), CheckpointIndex.open(reference_ckpt)
    assert {e.dtype_name for k, e in ix.entries.items() if k.startswith("model.")} == {"bfloat16"}
    assert torch.equal(ix.read_tensor("model.tok_emb.weight"), src.read_tensor("model.tok_emb.weight").bfloat16())
    md = (dst / "reshard-report.md").read_text()
    assert "optimizer state dropped" in md and "cast to bfloat16" in md
    # it loads on one machine and trains (a warm start in the reference trainer)
    log = tmp_path / "log.jsonl"
    run_reference(TrainConfig(dp=1, steps=1, resume=str(dst), log=str(log)))
    assert json.loads(log.read_text().splitlines()[0])["step"] == 1
