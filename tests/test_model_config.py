"""Ask once, ask only what is needed (issue 16): model config values on a TP change.

A TP change on a checkpoint without a manifest used to ask for `--model-config` one value
per run (six runs for a torchtitan Llama, though two of them are shapes it holds). Now the
values the rules declare tensor dimensions (`[config.NAME] from = ..., axis = N`) are read
from the checkpoint, a given value that contradicts the shape is refused naming both, and
whatever else the target really needs is asked for in one message. A TP degree that stays
needs nothing. The checkpoints are real TP x FSDP2 DCP checkpoints written by spawned gloo
ranks (reshard.testing.synthetic_llama), the manifest-less ones with their manifest removed.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import run_cli
from reshard.paths import formats_root
from reshard.testing.synthetic_llama import LlamaShape, make_llama_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TITAN_RULES = formats_root() / "models" / "llama-torchtitan.toml"
HEADS = ["--model-config", "n_heads=8", "--model-config", "n_kv_heads=2"]
VOCAB = ["--model-config", "vocab_size=100", "--model-config", "vocab_multiple=8"]


@pytest.fixture(scope="module")
def titan_tp2(tmp_path_factory) -> Path:
    """llama-torchtitan names, dp=2,tp=2 (4 ranks), with a manifest (family and model config)."""
    return make_llama_checkpoint(tmp_path_factory.mktemp("titan_tp2") / "ckpt", shape=LlamaShape(), tp=2, dp=2,
                                 fused=False, seed=7)


@pytest.fixture(scope="module")
def bare_titan(titan_tp2, tmp_path_factory) -> Path:
    """The same checkpoint without its manifest: no family, no model config, only the DCP files."""
    out = tmp_path_factory.mktemp("bare_titan") / "ckpt"
    shutil.copytree(titan_tp2, out)
    (out / "manifest.json").unlink()
    return out


@pytest.fixture(scope="module")
def bare_fused(tmp_path_factory) -> Path:
    """llama-fused names, dp=1,tp=2 (2 ranks), no manifest."""
    return make_llama_checkpoint(tmp_path_factory.mktemp("bare_fused") / "ckpt", shape=LlamaShape(), tp=2, dp=1,
                                 fused=True, seed=7, manifest=False)


def one_paragraph_error(code: int, err: str) -> str:
    """Exit 2 with a single rendered paragraph (never a traceback or the catch-all); the paragraph."""
    assert code == 2, err
    assert "unexpected" not in err and "Traceback" not in err, err
    assert err.strip().startswith("error:") and "\n" not in err.strip(), err
    return err.strip()


# ------------------------------------------------------------------------------ ask once

def test_the_six_question_case_is_answered_in_one_message(bare_titan, capsys):
    """tp=2 -> tp=4 without a manifest: every missing value in one message, none of the shapes it holds.

    The six questions were n_heads, n_kv_heads, ffn_hidden, dim, vocab_size, vocab_multiple:
    two are shapes (read), the vocabulary is not padded unless the run says so (torchtitan
    pads none: the verdict states the assumption), so two head counts remain, asked together.
    """
    code, _, err = run_cli(["plan", bare_titan, "--to", "dp=1,tp=4"], capsys)
    msg = one_paragraph_error(code, err)
    for name in ("n_heads", "n_kv_heads"):
        assert f"--model-config {name}=N" in msg, msg
    assert "vocab_size" not in msg and "vocab_multiple" not in msg, msg
    assert "--model-config n_heads=N --model-config n_kv_heads=N" in msg, msg
    assert "needs 2 model config values" in msg and "tp=4 must divide it" in msg, msg
    # dim and ffn_hidden are shapes in the checkpoint: read, reported, not asked for
    assert "dim=64, ffn_hidden=96" in msg, msg
    assert "ffn_hidden=N" not in msg and " dim=N" not in msg, msg


def test_the_values_asked_for_are_all_the_plan_needs(bare_titan, capsys):
    """Answering the one message once is enough: the next run plans (infeasible: tp=4 does not divide n_kv_heads = 2)."""
    code, out, err = run_cli(["plan", bare_titan, "--to", "dp=1,tp=4", *HEADS, *VOCAB, "--json"], capsys)
    assert code == 1, err
    plan = json.loads(out)
    assert not plan["feasible"]
    assert "tp=4 does not divide n_kv_heads = 2" in json.dumps(plan), out


def test_shapes_read_from_the_checkpoint_are_checked(bare_titan, capsys):
    """ffn_hidden = 96 was never given: it is read from feed_forward.w1's rows and enters tp's divisibility."""
    code, out, err = run_cli(["plan", bare_titan, "--to", "dp=1,tp=5", *HEADS, *VOCAB, "--json"], capsys)
    assert code == 1, err
    text = json.dumps(json.loads(out))
    assert "tp=5 does not divide" in text and "ffn_hidden = 96" in text, text


def test_fused_parts_ask_their_sizes_once(bare_fused, capsys):
    """Re-interleaving fused QKV to tp=1 needs the part sizes (heads, head_dim), asked together with the vocab."""
    code, _, err = run_cli(["plan", bare_fused, "--to", "tp=1"], capsys)
    msg = one_paragraph_error(code, err)
    for name in ("n_heads", "head_dim", "n_kv_heads", "vocab_size", "vocab_multiple"):
        assert f"--model-config {name}=N" in msg, msg
    assert "re-interleaving fused parts" in msg and "dim=64, ffn_hidden=96" in msg, msg


def test_fused_conversion_with_the_asked_values(bare_fused, tmp_path, capsys):
    """The values the message asks for are enough for a real conversion (re-interleave and re-pad)."""
    given = [*HEADS, "--model-config", "head_dim=8", *VOCAB]
    code, _, err = run_cli(["convert", bare_fused, tmp_path / "out", "--to", "tp=1", *given], capsys)
    assert code == 0, err


# ------------------------------------------------------------------------------ ask only what is needed

@pytest.mark.parametrize("to", ["dp=2,tp=2", "dp=1,tp=2", "dp=4,tp=2"])
def test_a_tp_degree_that_stays_needs_no_model_config(bare_titan, capsys, to):
    code, out, err = run_cli(["plan", bare_titan, "--to", to, "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["feasible"]


def test_tp1_target_needs_no_model_config(bare_titan, capsys):
    """tp=2 -> tp=1 checks no divisibility, and torchtitan's names pad no vocabulary unless the run says so."""
    code, out, err = run_cli(["plan", bare_titan, "--to", "dp=2,tp=1", "--json"], capsys)
    assert code == 0, err
    plan = json.loads(out)
    assert plan["feasible"]
    note = next(c for c in plan["verdict"]["changes"] if "vocabulary rows" in c)
    assert "carried as saved" in note and "vocab_multiple" in note, note
    emb = next(t for t in plan["tensors"] if t["key"] == "model.tok_embeddings.weight")
    assert "transform" not in emb  # rows as saved


def test_tp1_conversion_without_and_with_the_vocab(bare_titan, tmp_path, capsys):
    """Without values the rows are carried; with vocab_size/vocab_multiple the padding is re-cut for tp=1."""
    from reshard.storage.checkpoints.index import CheckpointIndex

    rows = CheckpointIndex.open(bare_titan).entries["model.tok_embeddings.weight"].shape[0]
    code, _, err = run_cli(["convert", bare_titan, tmp_path / "as-saved", "--to", "dp=2,tp=1"], capsys)
    assert code == 0, err
    assert CheckpointIndex.open(tmp_path / "as-saved").entries["model.tok_embeddings.weight"].shape[0] == rows
    code, _, err = run_cli(["convert", bare_titan, tmp_path / "repadded", "--to", "dp=2,tp=1", *VOCAB], capsys)
    assert code == 0, err
    assert CheckpointIndex.open(tmp_path / "repadded").entries["model.tok_embeddings.weight"].shape[0] == 104


def test_tp1_target_of_unpadded_rules_needs_no_model_config(bare_titan, tmp_path, capsys):
    """Rules without vocab padding (torchtitan itself pads nothing): tp=2 -> tp=1 asks for no value at all."""
    text = TITAN_RULES.read_text()
    pad = 'vocab = { size = "vocab_size", multiple = "vocab_multiple", fill = 0.0, only_if = "vocab_multiple" }\n'
    assert text.count(pad) == 2
    rules = tmp_path / "unpadded.toml"
    rules.write_text(text.replace(pad, ""))
    code, out, err = run_cli(["plan", bare_titan, "--to", "dp=2,tp=1", "--rules", rules, "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["feasible"]


# ------------------------------------------------------------------------------ given values against shapes

def test_a_given_value_that_contradicts_the_shape_is_refused(bare_titan, capsys):
    code, _, err = run_cli(["plan", bare_titan, "--to", "dp=1,tp=4", "--model-config", "ffn_hidden=100"], capsys)
    msg = one_paragraph_error(code, err)
    assert "--model-config ffn_hidden=100" in msg and "model.layers.0.feed_forward.w1.weight" in msg, msg
    assert "[96, 64]" in msg and "is 96" in msg, msg


def test_a_given_value_that_agrees_with_the_shape_is_accepted(bare_titan, capsys):
    code, out, err = run_cli(["plan", bare_titan, "--to", "dp=2,tp=1", "--model-config", "dim=64",
                              "--model-config", "ffn_hidden=96", *VOCAB, "--json"], capsys)
    assert code == 0, err


def test_a_manifest_value_that_contradicts_the_shape_is_refused(titan_tp2, tmp_path, capsys):
    src = tmp_path / "ckpt"
    shutil.copytree(titan_tp2, src)
    m = json.loads((src / "manifest.json").read_text())
    m["model"]["config"]["dim"] = 32
    (src / "manifest.json").write_text(json.dumps(m))
    code, _, err = run_cli(["plan", src, "--to", "dp=2,tp=1"], capsys)
    msg = one_paragraph_error(code, err)
    assert "the manifest's model.config dim = 32" in msg and "model.tok_embeddings.weight" in msg, msg
    assert "is 64" in msg, msg


def test_a_config_table_beyond_the_tensor_rank_is_refused(bare_titan, tmp_path, capsys):
    text = TITAN_RULES.read_text()
    old = "[config.dim]\nfrom = '^tok_embeddings\\.weight$'\naxis = 1\n"
    assert text.count(old) == 1
    rules = tmp_path / "rules.toml"
    rules.write_text(text.replace(old, old.replace("axis = 1", "axis = 2")))
    code, _, err = run_cli(["plan", bare_titan, "--to", "dp=2,tp=1", "--rules", rules], capsys)
    msg = one_paragraph_error(code, err)
    assert "[config.dim] reads dim 2" in msg and "model.tok_embeddings.weight" in msg, msg


def test_a_malformed_config_table_is_refused(bare_titan, tmp_path, capsys):
    text = TITAN_RULES.read_text()
    rules = tmp_path / "rules.toml"
    rules.write_text(text.replace("[config.dim]\nfrom = '^tok_embeddings\\.weight$'\naxis = 1\n",
                                  "[config.dim]\nfrom = '^tok_embeddings\\.weight$'\naxis = \"1\"\n"))
    code, _, err = run_cli(["plan", bare_titan, "--to", "dp=2,tp=1", "--rules", rules], capsys)
    msg = one_paragraph_error(code, err)
    assert "invalid partition rules" in msg and "[config.dim]" in msg, msg
