"""The Hugging Face round trip (issue 17): export -> transformers' from_pretrained -> the same logits as
the source model; import of that export -> torchtitan's own CheckpointManager at dp=2,tp=2 -> the
source weights bitwise; verify SRC EXPORT through the same declared transforms.

Sources:

- torchtitan 0.3.0, fused QKV and separate q/k/v: ``tests/writers/torchtitan_run.py`` write mode
  (torchtitan's own Llama3Model, parallelize_llama with FSDP2 at dp_shard=2, AdamW, 2 training
  steps, CheckpointManager.save), written once per run and shared with
  tests/test_interop_torchtitan.py (``conftest.torchtitan_sources``);
- the names before torchtitan 0.3 (``layers.N.attention.wq``, ``output.weight``):
  ``reshard.testing.synthetic_llama`` at tp=2 (vocab 100 padded to 112 rows, so the trim is exercised).
  No torchtitan before 0.3 is installed to run that model, so its source forward is torchtitan
  0.3.0's Llama3Model loaded with the same weights under the 0.3.0 names (the two generations
  differ in names only); its weights round trip bitwise besides.

The source forwards and torchtitan's loads run in ONE launch of ``tests/writers/torchtitan_hf.py``
(4 gloo processes on CPU): rank 0 computes each forward with torchtitan's model, then all ranks load
each import with ``CheckpointManager.load()`` through ``initial_load_path`` (model only) on a
dp_shard=2 x tp=2 mesh built by torchtitan's ``parallelize_llama``. Models are tiny (dim 64, 2 layers).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import require_packages  # noqa: E402

require_packages("torchtitan", "torchdata", "triton", "transformers")

import torch  # noqa: E402

from tests.conftest import cli  # noqa: E402

WRITERS = Path(__file__).parent / "writers"
TITAN = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab=256, hidden=128, theta=500000.0, scaling="llama")
LEGACY = dict(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab=100, hidden=96, theta=500000.0, scaling="llama")
ASKED = ["rms_norm_eps=1e-5", "rope_theta=500000", "rope_scaling_factor=8"]  # torchtitan's RMSNorm eps, llama3 RoPE
VARIANTS = ["fused", "unfused", "legacy"]


def _tokens() -> list[list[int]]:
    g = torch.Generator().manual_seed(17)
    return torch.randint(0, 100, (2, 16), generator=g).tolist()


def _torchrun(script: Path, nproc: int, *args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script),
           *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _to_03(name: str) -> str:
    """A pre-0.3 torchtitan name under 0.3.0's (only for building the reference model: the test's own map)."""
    for w in ("wq", "wk", "wv"):
        name = name.replace(f".attention.{w}.", f".attention.qkv_linear.{w}.")
    return "lm_head.weight" if name == "output.weight" else name


@pytest.fixture(scope="module")
def world(torchtitan_sources, tmp_path_factory) -> dict[str, Any]:
    """Sources, their exports and imports, and torchtitan's forwards and loads of them (one launch each)."""
    from reshard.testing.synthetic_llama import LlamaShape, load_global, make_llama_checkpoint

    work = tmp_path_factory.mktemp("hf")
    shape = LlamaShape(n_layers=2, dim=64, n_heads=8, n_kv_heads=2, ffn_hidden=96, vocab_size=100, vocab_multiple=8)
    legacy = make_llama_checkpoint(work / "legacy", shape=shape, tp=2, dp=1, fused=False)

    dumps = torchtitan_sources  # written once per run, shared with tests/test_interop_torchtitan.py
    src = {"fused": dumps["fused"] / "checkpoint" / "step-2", "unfused": dumps["unfused"] / "checkpoint" / "step-2",
           "legacy": legacy}
    out: dict[str, Any] = {"work": work, "src": src, "export": {}, "import": {}, "export_code": {}, "import_code": {},
                           "weights": {}, "model": {}}
    for v in VARIANTS:
        heads = [] if v == "legacy" else ["--model-config", "n_heads=4", "--model-config", "n_kv_heads=2"]
        args = ["export", src[v], work / f"{v}-hf", "--format", "hf", *heads,
                *[x for a in ASKED for x in ("--model-config", a)], "--json"]
        if v == "fused":
            args += ["--max-shard-size", "100KB"]  # sharded: model.safetensors.index.json
        out["export_code"][v] = cli(args)
        out["export"][v] = work / f"{v}-hf"
        out["import_code"][v] = cli(["import", work / f"{v}-hf", work / f"{v}-import", "--to", "dp=2,tp=2",
                                     "--format", "torchtitan", "--json"])
        out["import"][v] = work / f"{v}-import"
        if v == "legacy":
            full = load_global(legacy)
            weights = {_to_03(k[len("model."):]): t for k, t in full.items() if k.startswith("model.")}
            for k in ("tok_embeddings.weight", "lm_head.weight"):
                weights[k] = weights[k][:100].clone()  # the real vocabulary; rows 100..111 are TP padding
            out["model"][v] = dict(LEGACY, fuse_qkv=False)
        else:
            weights = torch.load(dumps[v] / "reference" / "state.pt", weights_only=False)["model"]
            out["model"][v] = dict(TITAN, fuse_qkv=v == "fused")
        out["weights"][v] = work / f"{v}-weights.pt"
        torch.save(weights, out["weights"][v])

    spec = []
    for v in VARIANTS:
        spec.append({"kind": "forward", "name": f"forward-{v}", "model": out["model"][v],
                     "weights": str(out["weights"][v]), "tokens": _tokens(), "out": str(work / f"{v}-logits.pt")})
    for v in VARIANTS:
        if out["import_code"][v][0] == 0:
            spec.append({"kind": "load", "name": f"load-{v}", "model": out["model"][v],
                         "checkpoint": str(out["import"][v]), "weights": str(out["weights"][v]), "tp": 2,
                         "work": str(work / f"{v}-run")})
    (work / "titan.json").write_text(json.dumps(spec))
    _torchrun(WRITERS / "torchtitan_hf.py", 4, str(work / "titan.json"), str(work / "titan-result.json"))
    out["titan"] = {j["name"]: j for j in json.loads((work / "titan-result.json").read_text())["jobs"]}
    return out


def _ok(code: tuple[int, str, str]) -> dict[str, Any]:
    assert code[0] == 0, code[1] + code[2]
    return json.loads(code[1])


# ---------------------------------------------------------------------------- the export

@pytest.mark.parametrize("variant", VARIANTS)
def test_export_is_a_transformers_directory(world, variant):
    """config.json from the shapes and the values given; every parameter under its HF name; step and lineage."""
    from safetensors import safe_open

    r = _ok(world["export_code"][variant])
    out = world["export"][variant]
    cfg = json.loads((out / "config.json").read_text())
    m = world["model"][variant]
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == \
        (m["dim"], m["hidden"], m["n_layers"], m["vocab"])
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]) == \
        (m["n_heads"], m["n_kv_heads"], 1e-5)
    assert cfg["rope_parameters"]["rope_theta"] == 500000 and cfg["rope_parameters"]["factor"] == 8
    assert cfg["tie_word_embeddings"] is False and cfg["dtype"] == "float32"
    assert r["warnings"] == []
    names = set()
    for f in r["shards"]:
        with safe_open(str(out / f), "pt") as fh:
            names |= set(fh.keys())
            meta = fh.metadata()
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} | {
        f"model.layers.{n}.{p}.weight" for n in range(2) for p in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")}
    assert names == expected
    step = 10 if variant == "legacy" else 2  # what `reshard inspect` finds (synthetic: manifest; torchtitan: train_state)
    code, text, _ = cli(["inspect", world["src"][variant], "--json"])
    assert json.loads(text)["step"] == step
    assert json.loads(meta["step"]) == step and r["essentials"]["step"] == step
    assert isinstance(json.loads(meta["lineage"]), list)
    if variant == "fused":
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == expected and len(r["shards"]) > 1
    transforms = r["hf"]["transforms"]
    assert transforms["model.layers.0.self_attn.q_proj.weight"] == f"rotary_half(n_heads={m['n_heads']})"
    assert transforms["model.layers.1.self_attn.k_proj.weight"] == f"rotary_half(n_kv_heads={m['n_kv_heads']})"
    if variant == "legacy":
        assert transforms["model.embed_tokens.weight"] == "rows[:100]" and transforms["lm_head.weight"] == "rows[:100]"


@pytest.mark.parametrize("variant", VARIANTS)
def test_from_pretrained_logits_equal_the_source_forward(world, variant):
    """transformers' LlamaForCausalLM on the export gives torchtitan's logits within 1e-5 (fp32)."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(str(world["export"][variant])).eval()
    with torch.no_grad():
        hf = model(torch.tensor(_tokens())).logits.float()
    ref = torch.load(world["work"] / f"{variant}-logits.pt", weights_only=True)
    assert hf.shape == ref.shape
    diff = (hf - ref).abs().max().item()
    assert diff <= 1e-5, (variant, diff, ref.abs().max().item())
    assert ref.abs().max().item() > 0.1  # not a vacuous comparison of near-zero logits


@pytest.mark.parametrize("variant", ["unfused", "legacy"])
def test_without_the_permutation_the_logits_differ(world, variant):
    """The rotary permutation is what makes the logits equal: the same export with q/k rows put back differs
    by far more than the tolerance (on the barely trained torchtitan model too)."""
    import transformers
    from reshard.semantics.hf import rotary_from_half

    m = world["model"][variant]
    model = transformers.LlamaForCausalLM.from_pretrained(str(world["export"][variant])).eval()
    sd = model.state_dict()
    with torch.no_grad():
        for n in range(2):
            for p, h in (("q_proj", m["n_heads"]), ("k_proj", m["n_kv_heads"])):
                w = sd[f"model.layers.{n}.self_attn.{p}.weight"]
                w.copy_(rotary_from_half(w.clone(), h))
        hf = model(torch.tensor(_tokens())).logits.float()
    ref = torch.load(world["work"] / f"{variant}-logits.pt", weights_only=True)
    assert (hf - ref).abs().max().item() > 1e-4


def test_values_the_checkpoint_cannot_hold_are_asked_once(world, tmp_path):
    """No --model-config: exit 2, one message naming every missing value with an example; nothing written."""
    code, out, err = cli(["export", world["src"]["unfused"], tmp_path / "out", "--format", "hf"])
    assert code == 2
    for name in ("n_heads", "n_kv_heads", "rms_norm_eps", "rope_theta", "rope_scaling_factor"):
        assert f"--model-config {name}=" in err, err
    assert "dim=64" in err and "ffn_hidden=128" in err  # what was read from the shapes is said, not asked
    assert not (tmp_path / "out").exists()


def test_a_contradicting_value_is_refused(world, tmp_path):
    code, out, err = cli(["export", world["src"]["unfused"], tmp_path / "out", "--format", "hf",
                          "--model-config", "dim=32", "--model-config", "n_heads=4", "--model-config", "n_kv_heads=2",
                          *[x for a in ASKED for x in ("--model-config", a)]])
    assert code == 2 and "dim=32" in err and "64" in err


def test_an_unmapped_parameter_is_refused_by_name(tmp_path):
    """A parameter the mapping does not name: exit 2 naming it, and no output (an HF load would randomise it)."""
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    sd = {"tok_embeddings.weight": torch.randn(32, 16, generator=g),
          "layers.0.attention.wq.weight": torch.randn(16, 16, generator=g),
          "layers.0.attention.rotary_gate.weight": torch.randn(16, 16, generator=g),
          "norm.weight": torch.ones(16), "output.weight": torch.randn(32, 16, generator=g)}
    dcp.save(sd, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    code, out, err = cli(["export", tmp_path / "ckpt", tmp_path / "out", "--format", "hf", "--model-config",
                          "n_heads=2", "--model-config", "n_kv_heads=2", *[x for a in ASKED for x in ("--model-config", a)]])
    assert code == 2, out + err
    assert "layers.0.attention.rotary_gate.weight" in err and "formats/hf/llama-torchtitan.toml" in err
    assert not (tmp_path / "out").exists()


def test_reference_gpt_is_refused_saying_why(reference_ckpt, tmp_path):
    code, out, err = cli(["export", reference_ckpt, tmp_path / "out", "--format", "hf"])
    assert code == 2 and "GPT2LMHeadModel" in err and "Conv1D" in err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- verify

@pytest.mark.parametrize("variant", ["fused", "legacy"])
def test_verify_source_against_its_export(world, variant, tmp_path):
    """verify SRC EXPORT: 0 through the declared transforms; 1 once a byte of a weight changed."""
    import shutil

    src, exp = world["src"][variant], world["export"][variant]
    code, out, err = cli(["verify", src, exp])
    assert code == 0, out + err
    bad = tmp_path / "bad"
    shutil.copytree(exp, bad)
    shard = sorted(bad.glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x40
    shard.write_bytes(bytes(data))
    code, out, err = cli(["verify", src, bad, "--json"])
    assert code == 1, out + err
    r = json.loads(out)
    assert [d["kind"] for d in r["differences"]] == ["value"]


def test_verify_catches_a_wrong_head_count(world, tmp_path):
    """config.json's head count is what the permutation is checked under: a different one is a difference."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(world["export"]["unfused"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["num_attention_heads"] = 2
    cfg["head_dim"] = 32
    (bad / "config.json").write_text(json.dumps(cfg))
    code, out, err = cli(["verify", world["src"]["unfused"], bad, "--json"])
    assert code == 1, out + err
    keys = {d["key"] for d in json.loads(out)["differences"]}
    assert "model.layers.0.self_attn.q_proj.weight" in keys


# ---------------------------------------------------------------------------- the import

@pytest.mark.parametrize("variant", VARIANTS)
def test_import_loads_in_torchtitan_at_dp2_tp2_bitwise(world, variant):
    """torchtitan's CheckpointManager (initial_load_path, model only) loads the import on a dp=2 x tp=2 mesh."""
    r = _ok(world["import_code"][variant])
    assert r["verification"]["equal"] is True and r["format"] == "torchtitan"
    job = world["titan"][f"load-{variant}"]
    assert job["loaded"] is True and job["error"] is None, job
    assert job["differences"] == [], job["differences"]
    assert job["compared"] == 21 and job["mesh"] == {"dp_shard": 2, "tp": 2}
    # torchtitan's own TP plan cut them: wo row-parallel, w1 column-parallel (FSDP on top)
    assert job["placements"]["layers.0.attention.wo.weight"][-1] == "S(1)"
    assert job["placements"]["layers.0.feed_forward.w1.weight"][-1] == "S(0)"


@pytest.mark.parametrize("variant", ["fused", "legacy"])
def test_import_is_a_documented_warm_start_in_torchtitan_keys(world, variant):
    from torch.distributed.checkpoint import FileSystemReader

    r = _ok(world["import_code"][variant])
    out = world["import"][variant]
    man = json.loads((out / "manifest.json").read_text())
    assert man["continuity"] == "warm_start" and man["step"] == 0 and man["key_convention"] == "torchtitan"
    assert man["experiment_id"].startswith("import-")
    assert man["lineage"][-1]["kind"] == "warm_start"
    assert any("initial_load_path" in x for x in r["trainer_must"])
    md = FileSystemReader(str(out)).read_metadata().state_dict_metadata
    assert "layers.1.attention.qkv_linear.wq.weight" in md and "lm_head.weight" in md
    assert not any(k.startswith(("optimizer.", "lr_scheduler", "train_state", "dataloader")) for k in md)
    # dp=2 x tp=2 as torchtitan lays it out: wo (row-parallel) in two column blocks, each cut in two by FSDP
    chunks = md["layers.0.attention.wo.weight"].chunks
    assert sorted((c.offsets[0], c.offsets[1]) for c in chunks) == [(0, 0), (0, 32), (32, 0), (32, 32)]


# ---------------------------------------------------------------------------- the Megatron-style fused family

@pytest.fixture(scope="module")
def fused_family(world) -> dict[str, Any]:
    """llama-fused (linear_qkv, linear_fc1 in the per-TP-rank layout) at tp=2, same shape and seed as 'legacy'."""
    from reshard.testing.synthetic_llama import LlamaShape, make_llama_checkpoint

    shape = LlamaShape(n_layers=2, dim=64, n_heads=8, n_kv_heads=2, ffn_hidden=96, vocab_size=100, vocab_multiple=8)
    ckpt = make_llama_checkpoint(world["work"] / "megatron", shape=shape, tp=2, dp=1, fused=True)
    out = world["work"] / "megatron-hf"
    code = cli(["export", ckpt, out, "--format", "hf", *[x for a in ASKED for x in ("--model-config", a)], "--json"])
    return {"src": ckpt, "export": out, "code": code}


def test_fused_qkv_and_gate_up_are_split(world, fused_family):
    """linear_qkv -> q/k/v_proj and linear_fc1 -> gate/up_proj, canonical order recovered from the tp=2 layout:
    the parts equal the separate tensors of the unfused model with the same seed (no rotary permutation:
    Megatron-Core rotates halves, as HF does); from_pretrained finds every weight and no other."""
    import transformers
    from safetensors.torch import load_file
    from reshard.testing.synthetic_llama import load_global

    r = _ok(fused_family["code"])
    assert r["hf"]["transforms"]["model.layers.0.self_attn.k_proj.weight"] == "split part 2/3 of dim 0 (TP layout of tp=2)"
    got = load_file(str(fused_family["export"] / "model.safetensors"))
    sep = {k[len("model."):]: t for k, t in load_global(world["src"]["legacy"]).items() if k.startswith("model.")}
    for n in range(2):
        for hf, tt in (("self_attn.q_proj", "attention.wq"), ("self_attn.k_proj", "attention.wk"),
                       ("self_attn.v_proj", "attention.wv"), ("mlp.gate_proj", "feed_forward.w1"),
                       ("mlp.up_proj", "feed_forward.w3")):
            assert torch.equal(got[f"model.layers.{n}.{hf}.weight"], sep[f"layers.{n}.{tt}.weight"]), (n, hf)
    assert torch.equal(got["lm_head.weight"], sep["output.weight"][:100])
    model, info = transformers.LlamaForCausalLM.from_pretrained(str(fused_family["export"]), output_loading_info=True)
    assert info["missing_keys"] in (set(), []) and info["unexpected_keys"] in (set(), []), info
    code, out, err = cli(["verify", fused_family["src"], fused_family["export"]])
    assert code == 0, out + err


def test_fused_parts_are_not_fused_back_on_import(world, fused_family, tmp_path):
    code, out, err = cli(["import", fused_family["export"], tmp_path / "out", "--format", "llama-fused"])
    assert code == 2 and "does not fuse parts back" in err
    # the way out it names: torchtitan's unfused names
    code, out, err = cli(["import", fused_family["export"], tmp_path / "tt", "--format", "torchtitan", "--to", "dp=2"])
    assert code == 0, out + err


def test_rename_covers_torchtitan_03_and_warns_on_the_rest(world, tmp_path):
    """--rename (names only, no transforms) now renames 0.3.0's names too; a name it leaves is a warning, not silence."""
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open

    rename = Path(__file__).resolve().parent.parent / "formats" / "renames" / "torchtitan-to-hf-llama.toml"
    r = _ok(cli(["export", world["src"]["unfused"], tmp_path / "renamed", "--rename", rename, "--json"]))
    assert r["warnings"] == []
    with safe_open(str(tmp_path / "renamed" / "model.safetensors"), "pt") as fh:
        names = set(fh.keys())
    assert "model.layers.1.self_attn.k_proj.weight" in names and "lm_head.weight" in names
    assert not any("qkv_linear" in n for n in names)
    sd = {"tok_embeddings.weight": torch.zeros(8, 4), "layers.0.attention.rotary_gate.weight": torch.ones(4, 4)}
    dcp.save(sd, checkpoint_id=str(tmp_path / "odd"), no_dist=True)
    r = _ok(cli(["export", tmp_path / "odd", tmp_path / "odd-out", "--rename", rename, "--json"]))
    assert len(r["warnings"]) == 1 and "layers.0.attention.rotary_gate.weight" in r["warnings"][0]


def test_export_cast_to_bf16(world, tmp_path):
    """--dtype bf16: tensors and config.json's dtype are bfloat16; transformers loads it; verify compares the cast."""
    import transformers

    out = tmp_path / "bf16"
    r = _ok(cli(["export", world["src"]["legacy"], out, "--format", "hf", "--dtype", "bf16",
                 *[x for a in ASKED for x in ("--model-config", a)], "--json"]))
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert {k["exported_dtype"] for k in r["keys"] if k.get("action") == "exported"} == {"bfloat16"}
    model = transformers.LlamaForCausalLM.from_pretrained(str(out))
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    code, text, err = cli(["verify", world["src"]["legacy"], out])
    assert code == 0, text + err
