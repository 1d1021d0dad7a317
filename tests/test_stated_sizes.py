"""Issue 32 ("Trust III"): every size a file states is checked against the tensors that carry it
(`reshard.semantics.sizes`), and refused with exit 2 naming both the file's key and the tensor's shape,
before anything is written or allocated.

Sources: a Hugging Face directory written by transformers' own ``save_pretrained`` (a tiny
``LlamaForCausalLM`` from a ``LlamaConfig``, no hub; embedding 100 x 64), in one spawned process
per module so this process never imports transformers, and the reference trainer's 4-rank FSDP2
checkpoint (the session fixture ``reference_ckpt``: ``tok_emb.weight`` 64 x 32, 2 layers, with a
manifest). Each attack edits a copy of the file the way the issue describes; the CLI runs in-process.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import cli, require_packages

require_packages("transformers")

WRITE_HF = """
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32)
LlamaForCausalLM(cfg).save_pretrained(sys.argv[1])
"""


def one_paragraph_error(code: int, err: str) -> str:
    """Exit 2 with one rendered paragraph (never a traceback or the catch-all); the paragraph."""
    assert code == 2, err
    assert "unexpected" not in err and "Traceback" not in err, err
    assert err.strip().startswith("error:") and "\n" not in err.strip(), err
    return err.strip()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """transformers' own save_pretrained of a tiny Llama (config.json + model.safetensors)."""
    out = tmp_path_factory.mktemp("stated_sizes") / "hf"
    r = subprocess.run([sys.executable, "-c", WRITE_HF, str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _edited_hf(hf_dir: Path, where: Path, **values) -> Path:
    """A copy of the HF directory whose config.json states ``values`` (the weights untouched)."""
    dst = where / "hf_edited"
    shutil.copytree(hf_dir, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(values)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def _like(reference_ckpt: Path, where: Path, **config) -> Path:
    """A copy of the reference checkpoint whose manifest's model.config states ``config``."""
    dst = where / "like"
    shutil.copytree(reference_ckpt, dst)
    m = json.loads((dst / "manifest.json").read_text())
    m["model"]["config"].update(config)
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


# ------------------------------------------------------------------------ HF config.json on import

def test_hf_config_of_absurd_sizes_is_refused_naming_key_and_tensor(hf_dir, tmp_path):
    """hidden_size 2**40 and vocab_size 10**12 beside 100 x 64 weights: exit 2, both keys and the tensor's shape
    named, nothing written (today's behaviour was exit 0 with the values in the report)."""
    src = _edited_hf(hf_dir, tmp_path, hidden_size=2**40, vocab_size=10**12)
    before = sorted(p.name for p in tmp_path.iterdir())
    started = time.monotonic()
    code, out, err = cli(["import", src, tmp_path / "out", "--to", "dp=1", "--format", "torchtitan", "--quiet"])
    msg = one_paragraph_error(code, out + err)
    assert time.monotonic() - started < 10
    assert str(src / "config.json") in msg and "hidden_size = 1099511627776" in msg, msg
    assert "vocab_size = 1000000000000" in msg and "'model.embed_tokens.weight' has shape [100, 64]" in msg, msg
    assert "so dim is 64" in msg and "vocab_size is at most 100" in msg, msg
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no output, no hidden temporary left behind


@pytest.mark.parametrize("key,value", [("num_hidden_layers", 0), ("num_hidden_layers", 5), ("intermediate_size", "x"),
                                       ("num_attention_heads", -4), ("num_attention_heads", 3)])
def test_hf_config_size_of_no_sense_or_contradicted_is_refused(hf_dir, tmp_path, key, value):
    """Zero, a string, a negative count, a layer count the tensor names contradict and a head count that does not
    divide hidden_size: each exit 2, naming config.json and the key."""
    src = _edited_hf(hf_dir, tmp_path, **{key: value})
    code, out, err = cli(["import", src, tmp_path / "out", "--to", "dp=1", "--format", "torchtitan", "--quiet"])
    msg = one_paragraph_error(code, out + err)
    assert str(src / "config.json") in msg and f"{key} = {value!r}" in msg, msg
    if key == "num_hidden_layers" and value == 5:
        assert "2 distinct layer indices" in msg, msg
    if value == 3:
        assert "does not divide dim 64" in msg and "'model.embed_tokens.weight' has shape [100, 64]" in msg, msg
    assert not (tmp_path / "out").exists()


def test_unedited_hf_imports_and_reports_what_no_tensor_checks(hf_dir, tmp_path):
    """The folder as transformers wrote it imports (exit 0); the report keeps the values the tensors confirmed and
    names those no tensor carries (head counts, head_dim, positions) as unchecked rather than as facts."""
    code, out, err = cli(["import", hf_dir, tmp_path / "out", "--to", "dp=1", "--format", "torchtitan", "--quiet"])
    assert code == 0, out + err
    r = json.loads((tmp_path / "out" / "import-report.json").read_text())
    assert {k: r["hf"]["values"][k] for k in ("dim", "vocab_size", "n_layers", "ffn_hidden")} == \
        {"dim": 64, "vocab_size": 100, "n_layers": 2, "ffn_hidden": 128}
    assert set(r["hf"]["unchecked"]) >= {"n_heads", "n_kv_heads", "head_dim"}
    assert "dim" not in r["hf"]["unchecked"] and "vocab_size" not in r["hf"]["unchecked"]


# ------------------------------------------------------------------------ rehearse --like: the manifest's sizes

@pytest.mark.parametrize("config", [{"n_heads": 10**6}, {"n_heads": 0}, {"n_heads": "x"}, {"n_heads": -4},
                                    {"n_heads": 10**6, "dim": 4 * 10**6}])
def test_rehearse_like_refuses_manifest_sizes_before_building_a_model(reference_ckpt, tmp_path, config):
    """n_heads 10**6 (which once allocated for 87 s), 0, "x", -4, and 10**6 with a matching dim: exit 2, one
    paragraph naming manifest.json and model.config.n_heads, well under 10 s, and no run directory made."""
    like = _like(reference_ckpt, tmp_path, **config)
    started = time.monotonic()
    code, out, err = cli(["rehearse", "--from", "dp=2", "--to", "dp=1", "--like", like, "--out", tmp_path / "reh"])
    elapsed = time.monotonic() - started
    msg = one_paragraph_error(code, out + err)
    assert elapsed < 10, elapsed
    assert str(like / "manifest.json") in msg and ("model.config.n_heads" in msg or "model.config.dim" in msg), msg
    if "dim" in config:
        assert "'model.tok_emb.weight' has shape [64, 32]" in msg, msg
    assert not (tmp_path / "reh").exists()


# ------------------------------------------------------------------------ profile and trainer config

def test_profile_size_contradicting_the_checkpoint_is_refused_naming_both(reference_ckpt, tmp_path):
    """A profile's [model] dim = 48 on a checkpoint whose embedding is 64 x 32: plan and convert exit 2 naming the
    profile's key and the tensor's shape; convert writes nothing. The same profile with the right values plans."""
    prof = tmp_path / "reshard.toml"
    prof.write_text("[model]\ndim = 48\n")
    for args in (["plan", reference_ckpt, "--to", "dp=2"], ["convert", reference_ckpt, tmp_path / "out", "--to", "dp=2"]):
        code, out, err = cli([*args, "--profile", prof, "--quiet"])
        msg = one_paragraph_error(code, out + err)
        assert f"{prof} states [model] dim = 48" in msg and "'model.tok_emb.weight' has shape [64, 32]" in msg, msg
        assert "so dim is 32" in msg, msg
    assert not (tmp_path / "out").exists()
    prof.write_text("[model]\ndim = 32\nn_heads = 4\n")
    code, out, err = cli(["plan", reference_ckpt, "--to", "dp=2", "--profile", prof, "--json"])
    assert code == 0, out + err


@pytest.mark.parametrize("text,said", [('[model]\nname = "llama3"\nflavor = "8B"\n', "dim (implied by its model flavour) = 4096"),
                                       ("[model]\nn_heads = 5\n", "[model] n_heads = 5")])
def test_trainer_config_or_profile_size_refused(reference_ckpt, tmp_path, text, said):
    """A torchtitan job TOML whose flavour (llama3 8B) implies dim 4096 and 32 layers against the reference GPT's
    32 x 2 layers, and a profile head count that does not divide dim 32: exit 2, the file and key named."""
    flag = "--trainer-config" if "flavor" in text else "--profile"
    f = tmp_path / ("job.toml" if flag == "--trainer-config" else "reshard.toml")
    f.write_text(text)
    code, out, err = cli(["plan", reference_ckpt, "--to", "dp=2", flag, f])
    msg = one_paragraph_error(code, out + err)
    assert f"{f} states {said}" in msg and "model.tok_emb.weight" in msg, msg
    if flag == "--trainer-config":
        assert "n_layers (implied by its model flavour) = 32" in msg and "2 distinct layer indices" in msg, msg


# ------------------------------------------------------------------------ the rule itself

def test_an_absurd_model_is_refused_where_no_tensor_carries_the_size(reference_ckpt):
    """Sizes no carrier reads still describe a model: stated vocab 10**12 x dim 2**40 against the 4-rank reference
    checkpoint's real parameter count is refused as more than 10 times it."""
    from reshard.semantics import sizes
    from reshard.storage.checkpoints.index import CheckpointIndex

    ix = CheckpointIndex.open(reference_ckpt)
    shapes = {k[len("model."):]: tuple(e.shape) for k, e in ix.entries.items() if k.startswith("model.") and e.is_tensor}
    total = sum(int(torch_numel(s)) for s in shapes.values())
    stated = sizes.stated_from({"vocab_size": 10**12, "dim": 2**40, "rms_norm_eps": 1e-5}, "cfg.json")
    found = sizes.check(stated, shapes, [], parameters=total)
    assert len(found.problems) == 1 and "more than 10 times" in found.problems[0] and f"{total:,}" in found.problems[0]
    assert sizes.check(sizes.stated_from({"vocab_size": 64, "dim": 32}, "cfg.json"), shapes, [],
                       parameters=total).unchecked == ["vocab_size", "dim"]


def torch_numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
