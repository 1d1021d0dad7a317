"""Input that would make reshard run for ever or crash is bounded (issue 32, "Trust III").

Two attacks, each through the files and flags a user really passes:

- a keep/drop pattern that backtracks catastrophically in Python's `re` (``^(a|aa)+$``
  against a 41-character key costs ~fib(41) steps: `plan` was still running after 45 s), from
  a ``reshard.toml`` beside the run's checkpoints (read without a flag) or from ``--keep``.
  Every pattern from a file or a flag is compiled by RE2 (`reshard.patterns`): `plan` finishes
  in well under a second and decides exactly what the equivalent ``^a+$`` decides. A pattern
  RE2 cannot match in linear time (a backreference, a lookaround) is refused when it is read:
  exit 2, one paragraph naming the flag or file and the pattern.
- 10^5-deep nesting in a TOML or JSON file (a profile, a convention, partition rules, a trainer
  config, a manifest, an HF ``config.json``) reached the CLI's "unexpected RecursionError"
  catch-all; now it is exit 2, one paragraph naming the file, and nothing is written.

The checkpoint is torch's own `dcp.save`, written once for the module (no process group).
"""
from __future__ import annotations

import contextlib
import json
import shutil
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import cli
from test_no_silent_loss import _every_role_state

EVIL = "^(a|aa)+$"          # exponential in Python's re against a's followed by anything else
BENIGN = "^a+$"             # the same language, no nested choice
A41 = "a" * 41              # the key of the issue: matched by both
A40B = "a" * 40 + "b"       # 41 characters on which EVIL fails: ~fib(41) backtracking steps in `re`
DEEP = 100_000


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A run folder holding one real DCP checkpoint (``step-1``) with the two keys of a's beside every role."""
    root = tmp_path_factory.mktemp("bounded") / "run"
    sd = _every_role_state()
    sd[A41] = torch.arange(3, dtype=torch.float32)
    sd[A40B] = torch.arange(2, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(root / "step-1"), no_dist=True)
    return root


@contextlib.contextmanager
def profile(run: Path, text: str):
    """``reshard.toml`` beside the checkpoint for the duration of a test (found without a flag)."""
    path = run / "reshard.toml"
    path.write_text(text)
    try:
        yield path
    finally:
        path.unlink()


def _files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))}


def _paragraph(err: str) -> str:
    """The one paragraph a refused command prints: ``error: ...`` on one line, no traceback."""
    text = err.strip()
    assert text.startswith("error: ") and "\n" not in text, err
    for word in ("Traceback", "unexpected", "RecursionError", "report it"):
        assert word not in err, err
    return text


def _timed_plan(args: list) -> tuple[int, dict, str, float]:
    t0 = time.monotonic()
    code, out, err = cli(["plan", *args, "--to", "dp=2", "--json"])
    took = time.monotonic() - t0
    return code, (json.loads(out) if out.strip().startswith("{") else {}), err, took


def _actions(plan: dict) -> dict[str, str]:
    return {k["key"]: k["action"] for k in plan["keys"] if k["key"] in (A41, A40B)}


# ------------------------------------------------------------------------------------ patterns


def test_backtracking_keep_pattern_on_the_command_line_finishes_and_decides_as_the_benign_one(run):
    """``--keep '^(a|aa)+$'``: plan exits as with ``^a+$``, the same keys kept and dropped, in bounded time."""
    src = run / "step-1"
    code, plan, err, took = _timed_plan([src, "--keep", EVIL, "--drop", "b$"])
    bcode, bplan, berr, _ = _timed_plan([src, "--keep", BENIGN, "--drop", "b$"])
    assert took < 10, f"plan took {took:.1f} s"
    assert code == bcode == 0, (err, berr)
    assert _actions(plan) == _actions(bplan) and _actions(plan)[A40B] == "dropped", _actions(plan)
    assert _actions(plan)[A41] != "dropped"


def test_backtracking_pattern_in_the_run_folder_profile_finishes(run):
    """The same pattern in ``reshard.toml`` beside ``step-1`` (read without a flag): plan finishes, same verdict."""
    src = run / "step-1"
    keep = f"[[keep]]\npattern = '{EVIL}'\nreason = \"ema\"\n[[drop]]\npattern = 'b$'\nreason = \"scratch\"\n"
    with profile(run, keep):
        code, plan, err, took = _timed_plan([src])
    with profile(run, keep.replace(EVIL, BENIGN)):
        bcode, bplan, berr, _ = _timed_plan([src])
    assert took < 10, f"plan took {took:.1f} s"
    assert code == bcode == 0, (err, berr)
    assert _actions(plan) == _actions(bplan) and _actions(plan)[A40B] == "dropped", _actions(plan)


BACKREF = r"^(?P<x>a)(?P=x)"
LOOKAROUND = r"^a(?=a)"


def _convention(tmp_path: Path, pattern: str) -> Path:
    p = tmp_path / "mine.toml"
    p.write_text(f"name = \"mine\"\n[[rule]]\nmatch = '{pattern}'\nrole = \"other\"\n")
    return p


@pytest.mark.parametrize("source", ["flag", "profile", "convention"])
def test_pattern_that_needs_backtracking_is_refused_naming_its_source(run, tmp_path, source):
    """A backreference or lookaround cannot be matched in linear time: exit 2, one paragraph, source and way out."""
    src = run / "step-1"
    with contextlib.ExitStack() as stack:
        if source == "flag":
            args, named, pattern = ["--keep", r"(a)\1=why", "--drop", "b$"], "--keep", r"(a)\1"
        elif source == "profile":
            path = stack.enter_context(profile(run, f"[[keep]]\npattern = '{LOOKAROUND}'\n"))
            args, named, pattern = ["--drop", "b$"], str(path), LOOKAROUND
        else:
            path = _convention(tmp_path, BACKREF)
            args, named, pattern = ["--convention", path], str(path), BACKREF
        code, out, err = cli(["plan", src, "--to", "dp=2", *args])
    text = _paragraph(err)
    assert code == 2, (out, err)
    assert named in text and repr(pattern) in text, text
    assert "without backreferences" in text and "lookarounds" in text, text


def test_every_shipped_pattern_compiles_under_re2():
    """Every convention, rules, HF mapping, rename and trainer-format file shipped loads through RE2."""
    from reshard.paths import formats_root
    from reshard.planning.export import RenameRules
    from reshard.semantics import conventions, data, hf, rules, trainer_config

    assert len(conventions.builtin_conventions()) == len(list((formats_root() / "conventions").glob("*.toml")))
    assert len(rules.builtin_rules()) == len(list((formats_root() / "models").glob("*.toml"))) - 1  # ties.toml
    assert len(trainer_config.trainer_formats()) == len(list((formats_root() / "trainers").glob("*.toml")))
    assert data.trainer_data_settings() and conventions.known_tied_pairs() and data.forms()
    hf_files = sorted((formats_root() / "hf").glob("*.toml"))
    assert hf_files and sorted(hf.shipped_families()) == sorted(p.stem for p in hf_files)
    assert all(hf.mapping_for(f).params for f in hf.shipped_families())
    for path in (formats_root() / "renames").glob("*.toml"):
        r = RenameRules.load(path)
        assert r.rules and r.inverse().rules
    names = [p for c in conventions.builtin_conventions() for p in c.rules]
    assert names and all(type(r.pattern).__module__ == "reshard.patterns" for r in names)


# ------------------------------------------------------------------------------------ nesting


def _deep_toml(form: str) -> str:
    if form == "arrays":        # tomllib recurses once per level
        return "x = " + "[" * DEEP + "]" * DEEP + "\n"
    return "a" + ".a" * DEEP + " = 1\n"   # dotted keys nest without recursing: measured after parsing


def _deep_json() -> str:
    return '{"x": ' + "[" * DEEP + "]" * DEEP + "}"


@pytest.mark.parametrize("kind", ["profile-arrays", "profile-dotted", "convention", "rules", "trainer-config-json",
                                  "trainer-config-toml"])
def test_deep_nesting_in_a_file_plan_reads_is_bad_input(run, tmp_path, kind):
    """10^5 levels in each file `plan` reads: exit 2, one paragraph naming the file, nothing written."""
    src = run / "step-1"
    before = _files(run)
    with contextlib.ExitStack() as stack:
        if kind.startswith("profile"):
            path = stack.enter_context(profile(run, _deep_toml(kind.split("-")[1])))
            args = []
        else:
            path = tmp_path / {"convention": "deep.toml", "rules": "rules.toml", "trainer-config-json": "job.json",
                               "trainer-config-toml": "job.toml"}[kind]
            path.write_text(_deep_json() if kind.endswith("json") else _deep_toml("arrays"))
            args = [{"convention": "--convention", "rules": "--rules"}.get(kind, "--trainer-config"), path]
        t0 = time.monotonic()
        to = "tp=2" if kind == "rules" else "dp=2"   # partition rules are read where tensors are split
        code, out, err = cli(["plan", src, "--to", to, "--keep", "^a+$", "--drop", "b$", *args])
        took = time.monotonic() - t0
        if kind.startswith("profile"):
            before["reshard.toml"] = path.stat().st_mtime_ns
    text = _paragraph(err)
    assert code == 2, (out, err)
    assert str(path) in text and "nests deeper than 64 levels" in text, text
    assert took < 10, took
    before.pop("reshard.toml", None)
    assert _files(run) == before


def test_deep_manifest_is_bad_input(run, tmp_path):
    """A checkpoint whose manifest.json nests 10^5 deep: plan exits 2 naming the checkpoint and its manifest."""
    src = tmp_path / "step-1"
    shutil.copytree(run / "step-1", src)
    (src / "manifest.json").write_text(_deep_json())
    before = _files(tmp_path)
    code, out, err = cli(["plan", src, "--to", "dp=2"])
    text = _paragraph(err)
    assert code == 2 and text.startswith(f"error: {src}:") and "the manifest nests deeper" in text, text
    assert _files(tmp_path) == before


def test_deep_hf_config_json_on_import_is_bad_input_and_writes_nothing(tmp_path):
    """``import --format torchtitan`` of an HF folder whose config.json nests 10^5 deep: exit 2, no DST."""
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(8, 4)}, str(hf / "model.safetensors"))
    (hf / "config.json").write_text(_deep_json())
    dst = tmp_path / "dst"
    before = _files(tmp_path)
    code, out, err = cli(["import", hf, dst, "--to", "dp=1", "--format", "torchtitan"])
    text = _paragraph(err)
    assert code == 2 and str(hf / "config.json") in text and "nests deeper" in text, text
    assert not dst.exists() and _files(tmp_path) == before
