"""`--rules NAME|FILE` (issue 16): a shipped family by name or a rules TOML by path, and a rule
that contradicts the checkpoint's own TP cut refused, on real TP x FSDP2 DCP checkpoints.

The checkpoints are written by spawned gloo ranks (reshard.testing.synthetic_llama): a torchtitan-named
Llama at dp=2,tp=2, whose row-parallel weights (attention.wo, feed_forward.w2) are stored cut
along dim 1 and every other TP weight along dim 0, and a fused (Megatron-named) Llama at tp=2.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import run_cli
from reshard.paths import formats_root
from reshard.semantics.rules import shipped_families
from reshard.testing.synthetic_llama import LlamaShape, make_llama_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TITAN_RULES = formats_root() / "models" / "llama-torchtitan.toml"
WO = "model.layers.0.attention.wo.weight"
WO_RULE = "match = '^layers\\.\\d+\\.attention\\.wo\\.weight$'\ntp = \"shard\"\ndim = 1\n"
W2_RULE = "match = '^layers\\.\\d+\\.feed_forward\\.w2\\.weight$'\ntp = \"shard\"\ndim = 1\n"


@pytest.fixture(scope="module")
def titan_tp2(tmp_path_factory) -> Path:
    """llama-torchtitan names, dp=2,tp=2 (4 ranks), with a manifest (family and model config)."""
    return make_llama_checkpoint(tmp_path_factory.mktemp("titan_tp2") / "ckpt", shape=LlamaShape(), tp=2, dp=2,
                                 fused=False, seed=7)


@pytest.fixture(scope="module")
def fused_tp2(tmp_path_factory) -> Path:
    """llama-fused names, dp=1,tp=2 (2 ranks)."""
    return make_llama_checkpoint(tmp_path_factory.mktemp("fused_tp2") / "ckpt", shape=LlamaShape(), tp=2, dp=1,
                                 fused=True, seed=7)


def edited_rules(tmp_path: Path, old: str, new: str) -> Path:
    """A copy of the shipped llama-torchtitan rules with one rule's text replaced."""
    text = TITAN_RULES.read_text()
    assert text.count(old) == 1, old
    out = tmp_path / "rules.toml"
    out.write_text(text.replace(old, new))
    return out


def assert_one_paragraph_error(code: int, err: str) -> None:
    """Exit 2 with a single rendered paragraph: never the catch-all 'unexpected ... report it' or a traceback."""
    assert code == 2, err
    assert "unexpected" not in err and "Traceback" not in err, err
    assert err.strip().startswith("error:") and "\n" not in err.strip(), err


# ------------------------------------------------------------------------------ --rules NAME

def test_the_shipped_families_are_the_model_files():
    names = sorted(p.stem for p in (formats_root() / "models").glob("*.toml") if p.name != "ties.toml")
    assert shipped_families() == names == ["llama-fused", "llama-torchtitan", "megatron-gpt", "qwen3-moe-torchtitan", "reference-gpt"]


@pytest.mark.parametrize("family", shipped_families())
def test_every_shipped_family_is_accepted_by_name(titan_tp2, capsys, family):
    """The name is resolved: the fitting family plans, the others stop at the coverage check naming themselves."""
    code, out, err = run_cli(["plan", titan_tp2, "--to", "dp=2,tp=1", "--rules", family, "--json"], capsys)
    if family == "llama-torchtitan":
        assert code == 0, err
        plan = json.loads(out)
        assert plan["feasible"] and plan["rules"] == family
    else:
        assert_one_paragraph_error(code, err)
        assert f"match no partition rule of '{family}'" in err and str(formats_root() / "models" / family) in err


@pytest.mark.parametrize("which,family,to", [("titan_tp2", "llama-torchtitan", "dp=1,tp=2"),
                                             ("fused_tp2", "llama-fused", "dp=1,tp=1"),
                                             ("reference_ckpt", "reference-gpt", "dp=2,tp=2")])
def test_a_family_name_plans_its_own_checkpoint(request, capsys, which, family, to):
    src = request.getfixturevalue(which)
    code, out, err = run_cli(["plan", src, "--to", to, "--rules", family, "--json"], capsys)
    assert code == 0, err
    plan = json.loads(out)
    assert plan["feasible"] and plan["rules"] == family and plan["options"]["rules"] == family


def test_a_name_and_the_path_of_its_file_plan_the_same(titan_tp2, capsys):
    plans = []
    for rules in ("llama-torchtitan", str(TITAN_RULES)):
        code, out, err = run_cli(["plan", titan_tp2, "--to", "dp=1,tp=2", "--rules", rules, "--json"], capsys)
        assert code == 0, err
        plans.append(json.loads(out))
    a, b = plans
    assert a["keys"] == b["keys"] and a["rules"] == b["rules"] == "llama-torchtitan"
    assert a["memory"] == b["memory"] and a["verdict"] == b["verdict"]


def test_convert_accepts_a_family_name(titan_tp2, tmp_path, capsys):
    dst = tmp_path / "tp1"
    code, out, err = run_cli(["convert", titan_tp2, dst, "--to", "dp=2,tp=1", "--rules", "llama-torchtitan"], capsys)
    assert code == 0, err
    report = json.loads((dst / "reshard-report.json").read_text())
    assert report["plan"]["rules"] == "llama-torchtitan"
    code, out, err = run_cli(["verify", titan_tp2, dst], capsys)  # the lineage names the family, not a file
    assert code == 0, out + err


def test_an_unknown_name_lists_the_shipped_families(titan_tp2, tmp_path, capsys):
    for cmd in (["plan", titan_tp2], ["convert", titan_tp2, tmp_path / "out"]):
        code, out, err = run_cli([*cmd, "--to", "dp=2,tp=1", "--rules", "llama"], capsys)
        assert_one_paragraph_error(code, err)
        assert "--rules 'llama' is neither a shipped model family nor an existing file" in err
        assert all(f in err for f in shipped_families()), err
        assert "did you mean llama-fused or llama-torchtitan?" in err and "path to a partition rules TOML" in err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ --rules FILE that is not one

def _bad_path(tmp_path: Path, kind: str) -> tuple[Path, str]:
    if kind == "missing":
        return tmp_path / "nowhere" / "rules.toml", "no partition rules file at this path"
    if kind == "directory":
        return tmp_path, "the partition rules path is a directory"
    if kind == "fifo":
        os.mkfifo(tmp_path / "fifo")  # reading it would block forever: it must be refused before it is opened
        return tmp_path / "fifo", "the partition rules path is not a regular file"
    if kind == "unreadable":
        p = tmp_path / "rules.toml"
        p.write_text(TITAN_RULES.read_text())
        p.chmod(0)
        if os.access(p, os.R_OK):
            pytest.skip("running as root: a mode-0 file is still readable")
        return p, "the partition rules file cannot be read"
    if kind == "binary":
        p = tmp_path / "rules.toml"
        p.write_bytes(b"\xff\xfe\x00family")
        return p, "not UTF-8 text"
    if kind == "huge":
        p = tmp_path / "rules.toml"
        with open(p, "wb") as f:
            f.truncate(2 << 20)
        return p, "larger than"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["missing", "directory", "fifo", "unreadable", "binary", "huge"])
def test_a_rules_path_that_is_not_a_rules_file_is_bad_input(titan_tp2, tmp_path, capsys, kind):
    path, says = _bad_path(tmp_path, kind)
    code, out, err = run_cli(["plan", titan_tp2, "--to", "dp=2,tp=1", "--rules", path], capsys)
    assert_one_paragraph_error(code, err)
    assert says in err and str(path) in err and "llama-torchtitan" in err, err


def test_a_rules_file_without_a_family_is_bad_input(titan_tp2, tmp_path, capsys):
    rules = edited_rules(tmp_path, 'family = "llama-torchtitan"\n', "")
    code, out, err = run_cli(["plan", titan_tp2, "--to", "dp=2,tp=1", "--rules", rules], capsys)
    assert_one_paragraph_error(code, err)
    assert "invalid partition rules" in err and "'family'" in err


# ------------------------------------------------------------------------------ a rule against the stored cut

def test_an_unchanged_copy_of_the_rules_is_accepted(titan_tp2, tmp_path, capsys):
    """The control for the refusals below: a copy at another path is fine, only the edited dim is not."""
    rules = edited_rules(tmp_path, WO_RULE, WO_RULE)
    code, out, err = run_cli(["plan", titan_tp2, "--to", "dp=2,tp=1", "--rules", rules], capsys)
    assert code == 0, err


@pytest.mark.parametrize("to", ["dp=2,tp=1", "dp=2,tp=2", "dp=1,tp=4", "dp=1,tp=2"])
def test_a_row_parallel_weight_declared_dim_0_is_refused(titan_tp2, tmp_path, capsys, to):
    rules = edited_rules(tmp_path, WO_RULE, WO_RULE.replace("dim = 1", "dim = 0"))
    for cmd in (["plan", titan_tp2], ["convert", titan_tp2, tmp_path / "out"]):
        code, out, err = run_cli([*cmd, "--to", to, "--rules", rules], capsys)
        assert_one_paragraph_error(code, err)
        assert f"'{WO}' says shard along dim 0" in err and "own chunks cut it along dim 1 (tp=2)" in err, err
        assert str(rules) in err and 'dim = 1' in err
    assert not (tmp_path / "out").exists()


def test_a_row_parallel_weight_declared_replicated_is_refused(titan_tp2, tmp_path, capsys):
    rules = edited_rules(tmp_path, W2_RULE, W2_RULE.replace('tp = "shard"\ndim = 1\n', 'tp = "replicate"\n'))
    code, out, err = run_cli(["plan", titan_tp2, "--to", "dp=2,tp=1", "--rules", rules], capsys)
    assert_one_paragraph_error(code, err)
    assert "'model.layers.0.feed_forward.w2.weight' says replicate (no cut)" in err and "along dim 1" in err, err


def test_a_rule_dim_beyond_the_tensors_rank_is_refused(titan_tp2, tmp_path, capsys):
    rules = edited_rules(tmp_path, W2_RULE, W2_RULE.replace("dim = 1", "dim = 2"))
    code, out, err = run_cli(["plan", titan_tp2, "--to", "dp=2,tp=1", "--rules", rules], capsys)
    assert_one_paragraph_error(code, err)
    assert "'model.layers.0.feed_forward.w2.weight' cuts dim 2, but the tensor has 2 dims" in err, err
