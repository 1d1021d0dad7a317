"""The Hugging Face export keeps the tie inspect proves (issue 43 item 4): torchtitan 0.3.0's tied
Llama (its Llama 3.2 1B/3B flavours' ``enable_weight_tying``) exported with ``--format hf`` writes
the embedding once and ``"tie_word_embeddings": true``, and transformers' ``LlamaForCausalLM``
gives torchtitan's logits.

Source: ``tests/writers/torchtitan_tied.py``, one 2-rank gloo launch, written once per run: the
model config assembled as torchtitan's 1B/3B flavours are (``enable_weight_tying=True``, the
embedding's init skipped), ``parallelize_llama`` (FSDP2 at dp_shard=2, which puts embedding, norm
and head in one unit for a tied model), AdamW, 2 training steps, ``CheckpointManager.save``
(``step-2``: the full training state); one more step and torchtitan's last save with its default
``last_save_model_only = True`` (``step-3``: the model only). torchtitan's ``model.state_dict()``
holds the one parameter under both names, so DCP stores ``tok_embeddings.weight`` and
``lm_head.weight`` with equal bytes; the optimizer keeps moments under ``tok_embeddings.weight``
only. The writer also saves torchtitan's forward of each saved state (its tied ``Decoder``, the
full weights loaded strictly): the reference logits. The CPU substitutions are
``tests/writers/torchtitan_run.py``'s (documented there; none changes what is saved). dim 64,
2 layers, 4 heads, 2 kv heads, vocab 256, fused QKV (what the flavours use).

What is exported:

- ``step-2`` with no profile: the tie is the one inspect proves by equal bytes (no list names
  torchtitan 0.3.0's pair ``tok_embeddings.weight`` / ``lm_head.weight``);
- ``step-3`` (model only, no moments, so no proof from the bytes' roles): tied only by the
  profile's ``tie`` (given in the order ``lm_head`` first, so the export must still store the
  embedding, the name transformers keeps); without the profile both tensors are written;
- ``step-2`` as plain safetensors: the tied copy written once there too; ``verify`` agrees;
- a profile ``tie`` naming two different tensors is refused (exit 2), nothing written.

Before this change every export here wrote ``"tie_word_embeddings": false`` and both tensors
(the export used only the manifest's ties and ``formats/models/ties.toml``'s pairs).

Measured cost: about 12 s on this project's 2-core machine while other jobs ran (10.3 s in pytest:
the writer's 2-rank launch about 5.5 s, the exports, transformers' loads and verifies the rest).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from conftest import require_packages  # noqa: E402

require_packages("torchtitan", "torchdata", "triton", "transformers")

import torch  # noqa: E402

from tests.conftest import cli, once_per_run, run_torchrun, writer_key  # noqa: E402

WRITER = Path(__file__).parent / "writers" / "torchtitan_tied.py"
MODEL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab=256, hidden=128, theta=500000.0, scaling="llama",
             fuse_qkv=True)
ASKED = ["n_heads=4", "n_kv_heads=2", "rms_norm_eps=1e-5", "rope_theta=500000", "rope_scaling_factor=8"]
HF_ARGS = ["--format", "hf", *[x for a in ASKED for x in ("--model-config", a)]]
TIE = ["model.embed_tokens.weight", "lm_head.weight"]


def _tokens() -> list[list[int]]:
    g = torch.Generator().manual_seed(43)
    return torch.randint(0, MODEL["vocab"], (2, 16), generator=g).tolist()


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """torchtitan's tied run: ``checkpoint/step-2`` (full state), ``checkpoint/step-3`` (model only), ``reference/``."""

    def make(work: Path) -> str:
        spec = [{"dump": str(work / "tied"), "model": MODEL, "steps": 2, "tokens": _tokens()}]
        (work / "write.json").write_text(json.dumps(spec))
        run_torchrun(WRITER, 2, work / "write.json")
        return str(work / "tied")

    return Path(once_per_run(tmp_path_factory, writer_key(WRITER, "torchtitan"), make))


@pytest.fixture(scope="module")
def world(source, tmp_path_factory) -> dict[str, Any]:
    """Every export of the module, made once: name -> (exit code, stdout, stderr) and its directory."""
    work = tmp_path_factory.mktemp("tie")
    ck = source / "checkpoint"
    given = work / "given.toml"  # the profile's tie, lm_head first: the export still stores the embedding
    given.write_text('tie = [["lm_head.weight", "tok_embeddings.weight"]]\n')
    wrong = work / "wrong.toml"
    wrong.write_text('tie = [["layers.0.attention.wo.weight", "layers.1.attention.wo.weight"]]\n')
    runs = {
        "found": [ck / "step-2", *HF_ARGS, "--no-profile"],
        "given": [ck / "step-3", *HF_ARGS, "--profile", given],
        "unproven": [ck / "step-3", *HF_ARGS, "--no-profile"],
        "safetensors": [ck / "step-2", "--format", "safetensors", "--no-profile"],
        "wrong": [ck / "step-2", "--format", "safetensors", "--profile", wrong],
    }
    out: dict[str, Any] = {"dir": {}, "code": {}, "step": {"found": 2, "given": 3, "unproven": 3}, "src": {}}
    for name, args in runs.items():
        out["dir"][name] = work / name
        out["src"][name] = args[0]
        out["code"][name] = cli(["export", args[0], work / name, *args[1:], "--json"])
    return out


def _ok(code: tuple[int, str, str]) -> dict[str, Any]:
    assert code[0] == 0, code[1] + code[2]
    return json.loads(code[1])


def _stored(d: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return sorted(f.keys())


def test_torchtitan_stores_both_names_and_inspect_proves_the_tie(source):
    """What the writer leaves: both names in the DCP metadata; inspect's proof is equal bytes (moments on one)."""
    code, out, err = cli(["inspect", source / "checkpoint" / "step-2", "--json", "--no-profile"])
    assert code == 0, out + err
    r = json.loads(out)
    tied = r["optimizer"]["tied"]
    assert [(t["names"], t["source"], t["equal"]) for t in tied] == \
        [(["tok_embeddings.weight", "lm_head.weight"], "equal bytes", True)], tied
    ref = torch.load(source / "reference" / "step-2.pt", weights_only=True)
    assert torch.equal(ref["tok_embeddings.weight"], ref["lm_head.weight"])  # one parameter under two names


@pytest.mark.parametrize("name", ["found", "given"])
def test_hf_export_writes_the_tie_once(world, name):
    """One tensor, ``tie_word_embeddings: true``, the copy listed as such in the report."""
    r = _ok(world["code"][name])
    d = world["dir"][name]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True
    stored = _stored(d)
    assert "model.embed_tokens.weight" in stored and "lm_head.weight" not in stored, stored
    assert r["tied"] == [TIE]
    actions = {k["key"]: k for k in r["keys"]}
    assert actions["lm_head.weight"]["action"] == "tied_copy", actions["lm_head.weight"]
    assert "model.embed_tokens.weight" in actions["lm_head.weight"]["reason"]
    assert actions["tok_embeddings.weight"]["action"] == "exported"
    if name == "given":
        assert r["profile"]["contributed"] == ["tie"]
        assert r["essentials"]["ties_given"] == [["lm_head.weight", "tok_embeddings.weight"]]


@pytest.mark.parametrize("name", ["found", "given"])
def test_from_pretrained_ties_and_gives_torchtitans_logits(world, source, name):
    """transformers ties lm_head to the embedding it loads, finds no weight missing, and gives torchtitan's logits."""
    import transformers

    model, info = transformers.LlamaForCausalLM.from_pretrained(str(world["dir"][name]), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        hf = model.eval()(torch.tensor(_tokens())).logits.float()
    ref = torch.load(source / "reference" / f"logits-{world['step'][name]}.pt", weights_only=True)
    assert hf.shape == ref.shape
    diff = (hf - ref).abs().max().item()
    assert diff <= 1e-5, (name, diff)
    assert ref.abs().max().item() > 0.1  # not a comparison of near-zero logits


@pytest.mark.parametrize("name", ["found", "given"])
def test_verify_rederives_the_tie(world, name, tmp_path):
    """verify SRC EXPORT: 0; an export claiming no tie (config.json edited, lm_head still absent) is a difference."""
    code, out, err = cli(["verify", world["src"][name], world["dir"][name], "--json"])
    assert code == 0, out + err
    bad = tmp_path / "bad"
    shutil.copytree(world["dir"][name], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (bad / "config.json").write_text(json.dumps(cfg))
    code, out, err = cli(["verify", world["src"][name], bad, "--json"])
    assert code == 1, out + err
    assert [d["key"] for d in json.loads(out)["differences"]] == ["config.json:tie_word_embeddings"]


def test_without_proof_or_profile_both_are_written(world):
    """The model-only save holds no moments, so nothing shows the tie but the bytes: no guess, both tensors."""
    r = _ok(world["code"]["unproven"])
    assert json.loads((world["dir"]["unproven"] / "config.json").read_text())["tie_word_embeddings"] is False
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(_stored(world["dir"]["unproven"]))
    assert r["tied"] == []


def test_safetensors_export_writes_the_proven_tie_once(world):
    """The tie inspect proves holds for the plain safetensors export too, and verify re-derives it."""
    r = _ok(world["code"]["safetensors"])
    stored = _stored(world["dir"]["safetensors"])
    assert "tok_embeddings.weight" in stored and "lm_head.weight" not in stored, stored
    assert r["tied"] == [["tok_embeddings.weight", "lm_head.weight"]]
    code, out, err = cli(["verify", world["src"]["safetensors"], world["dir"]["safetensors"]])
    assert code == 0, out + err


def test_a_profile_tie_of_different_tensors_is_refused(world):
    """Two different tensors cannot be written once: exit 2 naming the profile and both keys, nothing written."""
    code, out, err = world["code"]["wrong"]
    assert code == 2, out + err
    text = out + err
    assert "wrong.toml" in text and "layers.0.attention.wo.weight" in text and "layers.1.attention.wo.weight" in text
    assert not world["dir"]["wrong"].exists()


def test_equal_bytes_the_class_cannot_tie_are_written_apart(source):
    """A tie inspect would count from equal bytes between names the HF class cannot tie is not refused:
    both are written (their values are the source's either way) with a warning. No torchtitan run
    leaves such a coincidence, so the proof is handed to the planner directly (``found``), on the
    real step-2 checkpoint (a tie the manifest or the profile declares there is still refused, as before)."""
    from reshard.planning.export import hf_plan, plan_export
    from reshard.semantics.conventions import classify, reshard_key
    from reshard.storage.checkpoints.local_format import open_any

    src = source / "checkpoint" / "step-2"
    ix = open_any(src, source_key=reshard_key)
    cls = classify((k, e.kind) for k, e in ix.entries.items())
    norms = ["layers.0.attention_norm.weight", "layers.1.attention_norm.weight"]
    values = {k: float(v) if "." in v or "e" in v else int(v) for k, v in (a.split("=") for a in ASKED)}
    plan = plan_export(ix, cls, {}, only="model", dtype=None, rules=None,
                       found=[["tok_embeddings.weight", "lm_head.weight"], norms])
    assert plan.tied_fqns == [["tok_embeddings.weight", "lm_head.weight"], norms]
    hf = hf_plan(src, ix, cls, {}, plan, values, None)
    names = {it.name for it in plan.items}
    assert {"model.layers.0.input_layernorm.weight", "model.layers.1.input_layernorm.weight"} <= names
    assert "lm_head.weight" not in names and hf.config["tie_word_embeddings"] is True
    assert plan.tied == [TIE] and any("cannot tie" in w for w in plan.warnings), plan.warnings
    assert {r["key"]: r["action"] for r in plan.keys}["layers.1.attention_norm.weight"] == "exported"
