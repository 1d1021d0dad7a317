"""Issue 20: options checked up front (before torch is imported), errors as one paragraph or a JSON object.

Each class of mistake runs the real CLI in a subprocess under ``python -X importtime``: it must
exit 2 with one paragraph, and the import log must show that torch was never imported (the
check ran before any heavy import). The wall time is printed for the record, never asserted.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]


def reshard(*argv: str | Path, cwd: Path | None = None) -> tuple[int, str, str, bool]:
    """Run ``python -X importtime -m reshard.cli ARGV``: (exit code, stdout, stderr without the import log, torch imported)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "250"}  # help in full lines
    env.pop("RESHARD_DEBUG", None)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "reshard.cli", *map(str, argv)],
                       capture_output=True, text=True, env=env, cwd=cwd or ROOT, timeout=120)
    elapsed = time.perf_counter() - t0
    log = [ln for ln in p.stderr.splitlines() if ln.startswith("import time:")]
    err = "\n".join(ln for ln in p.stderr.splitlines() if not ln.startswith("import time:"))
    torch = any(ln.rsplit("|", 1)[-1].strip() == "torch" for ln in log)
    print(f"reshard {' '.join(map(str, argv))}: exit {p.returncode} in {elapsed:.2f} s, torch imported: {torch}")
    return p.returncode, p.stdout, err, torch


def one_paragraph(err: str) -> str:
    """The error is one paragraph (one line), starting "error:", and every part of it ends as a sentence."""
    text = err.strip()
    assert text.startswith("error: "), err
    assert "\n" not in text, err
    assert text.endswith((".", "?")), err
    return text


# one case per class of mistake: (argv, words the paragraph must contain)
MISTAKES = {
    "range: --grad-accum -1": (["plan", "ckpt", "--to", "dp=2", "--grad-accum", "-1"], ["--grad-accum"]),
    "range: --grad-accum 0": (["plan", "ckpt", "--to", "dp=2", "--grad-accum", "0"], ["--grad-accum"]),
    "range: --micro-batch 0": (["convert", "ckpt", "out", "--to", "dp=2", "--micro-batch", "0"], ["--micro-batch"]),
    "range: --workers 0": (["convert", "ckpt", "out", "--to", "dp=2", "--workers", "0"], ["--workers"]),
    "range: --rtol -1": (["verify", "a", "b", "--rtol", "-1"], ["--rtol"]),
    "range: --steps 0 (rehearse)": (["rehearse", "--from", "dp=4", "--to", "dp=2", "--steps", "0"], ["--steps"]),
    "choice: --schedule step": (["plan", "ckpt", "--to", "dp=2", "--schedule", "step"], ["--schedule", "steps, tokens"]),
    "choice: --data-policy translat": (["plan", "ckpt", "--to", "dp=2", "--data-policy", "translat"],
                                       ["--data-policy", "translate"]),
    "choice: --rng-policy": (["plan", "ckpt", "--to", "dp=2", "--rng-policy", "keep"], ["--rng-policy", "reseed"]),
    "choice: --only": (["convert", "ckpt", "out", "--to", "dp=2", "--only", "weights"], ["--only", "model+optim"]),
    "choice: --dtype": (["export", "ckpt", "out", "--dtype", "fp8"], ["--dtype", "bf16"]),
    "choice: --output-format": (["convert", "ckpt", "out", "--to", "dp=2", "--output-format", "hf"], ["--output-format"]),
    "choice: --data": (["convert", "ckpt", "out", "--to", "dp=2", "--data", "symlink"], ["--data", "link"]),
    "choice: --control": (["rehearse", "--from", "dp=4", "--to", "dp=2", "--control", "naive"], ["--control"]),
    "combination: --pp-stages with pp=1": (["plan", "ckpt", "--to", "dp=2", "--pp-stages", "0-9"],
                                           ["--pp-stages", "one pipeline stage"]),
    "combination: --pp-stages not one per stage": (["plan", "ckpt", "--to", "dp=2,pp=2", "--pp-stages", "0-9"],
                                                   ["--pp-stages", "pp=2"]),
    "combination: --grad-accum beside --plan": (["convert", "ckpt", "out", "--plan", "P.json", "--grad-accum", "8"],
                                                ["--grad-accum", "no effect beside --plan"]),
    "combination: --switch-at past --steps": (["rehearse", "--from", "dp=4", "--to", "dp=2", "--steps", "4",
                                               "--switch-at", "6"], ["--switch-at"]),
    "combination: --model-config without --format hf": (["export", "ckpt", "out", "--model-config", "n_heads=8"],
                                                        ["--model-config", "--format hf"]),
    "value: --to dp=0": (["plan", "ckpt", "--to", "dp=0"], ["positive integer"]),
    "value: --buffer-memory size": (["convert", "ckpt", "out", "--to", "dp=2", "--buffer-memory", "lots"], ["--buffer-memory", "size"]),
    "renamed: convert --window": (["convert", "ckpt", "out", "--to", "dp=2", "--window", "1GiB"], ["--buffer-memory", "steps"]),
    "unknown option": (["plan", "ckpt", "--to", "dp=2", "--grad-acum", "2"], ["--grad-acum"]),
    "value: --layers": (["plan", "ckpt", "--to", "dp=2", "--layers", "0-x"], ["--layers '0-x'", "layer indices"]),
    "value: --layers order": (["convert", "ckpt", "out", "--to", "dp=2", "--layers", "3,1"], ["increasing order"]),
    "combination: --restart with --data link": (["convert", "ckpt", "out", "--to", "dp=2", "--data", "link",
                                                 "--restart"], ["--restart has no effect", "--data link"]),
    "choice: import --format": (["import", "ckpt", "out", "--format", "torchtitn"],
                                ["unknown import format 'torchtitn'", "torchtitan", "llama-fused"]),
    # a path that does not exist: said before torch is imported, in the reader's own words
    "path: inspect": (["inspect", "ckpt"], ["ckpt: no such checkpoint directory", "Check the path"]),
    "path: plan": (["plan", "ckpt", "--to", "dp=2"], ["ckpt: no such checkpoint directory"]),
    "path: convert": (["convert", "ckpt", "out", "--to", "dp=2"], ["ckpt: no such checkpoint directory"]),
    "path: verify": (["verify", ".", "ckpt"], ["ckpt: no such checkpoint directory"]),
    "path: export": (["export", "ckpt", "out"], ["ckpt: no such checkpoint directory"]),
}


@pytest.mark.parametrize("case", sorted(MISTAKES))
def test_each_class_of_mistake_is_refused_before_torch_in_one_paragraph(case, tmp_path):
    argv, words = MISTAKES[case]
    code, out, err, torch = reshard(*argv, cwd=tmp_path)
    assert code == 2, (case, out, err)
    text = one_paragraph(err)
    for w in words:
        assert w in text, (case, text)
    assert not torch, f"{case}: torch was imported before the check"
    assert not (tmp_path / "out").exists()


def test_choices_and_ranges_are_listed_in_help():
    code, out, _, torch = reshard("plan", "-h")
    assert code == 0 and not torch
    flat = " ".join(out.split())
    for listed in ("[steps|tokens]", "[translate|restart-epoch|drop]", "[carry|reseed|drop]", "x>=1"):
        assert listed in flat, listed
    code, out, _, _ = reshard("convert", "--help")
    flat = " ".join(out.split())
    for listed in ("[dcp|local]", "[copy|link]", "[model|model+optim]"):
        assert listed in flat, listed


@pytest.mark.parametrize("command", ["inspect", "plan", "convert", "verify", "export", "import", "rehearse",
                                     "window", "demo"])
def test_exit_codes_in_every_commands_help(command):
    from typer.testing import CliRunner

    from reshard.cli import app

    r = CliRunner().invoke(app, [command, "--help"], terminal_width=200)
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "Exit 0" in text and re.search(r"\b2:? (bad input|incomplete)", text), text


def test_version_and_short_help():
    from reshard import __version__

    code, out, _, torch = reshard("--version")
    assert code == 0 and out.strip() == f"reshard {__version__}" and not torch
    code, out, _, _ = reshard("-h")
    assert code == 0 and "inspect" in out and "convert" in out
    code, out, _, _ = reshard("inspect", "-h")
    assert code == 0 and "Exit 0" in out


def test_json_error_is_an_object_wherever_json_is_given(tmp_path):
    for argv in (["plan", tmp_path / "nope", "--to", "dp=2", "--json"],
                 ["--json", "plan", tmp_path / "nope", "--to", "dp=2"]):
        code, out, err, _ = reshard(*argv)
        assert code == 2, err
        obj = json.loads(out)
        assert set(obj) == {"error", "code", "exit_code", "file", "keys"}
        assert obj["exit_code"] == 2 and obj["code"] == "bad_input" and obj["file"] == str(tmp_path / "nope")
        assert "no such checkpoint directory." in obj["error"] and obj["keys"] == []
        assert err.strip() == f"error: {obj['error']}"  # the person watching still reads the paragraph
    code, out, _, torch = reshard("plan", "ckpt", "--to", "dp=2", "--schedule", "step", "--json")
    obj = json.loads(out)
    assert code == 2 and obj["code"] == "usage" and "--schedule" in obj["error"] and not torch


def test_debug_after_the_subcommand_shows_the_traceback(tmp_path):
    code, _, err, _ = reshard("inspect", tmp_path / "nope", "--debug")
    assert code == 2
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("error: ")
    code, _, err, _ = reshard("inspect", tmp_path / "nope")
    assert "Traceback" not in err


@pytest.mark.parametrize("layout", ["empty", "notes", "run"])
def test_inspect_of_a_non_checkpoint_says_so_and_names_the_checkpoint_below(layout, tmp_path, reference_ckpt):
    d = tmp_path / layout
    d.mkdir()
    if layout == "notes":
        (d / "notes.md").write_text("loss looked fine\n")
        (d / "sub").mkdir()
    if layout == "run":
        import shutil

        shutil.copytree(reference_ckpt, d / "checkpoints" / "step_3")
        (d / "steps.jsonl").write_text("")
    code, out, err, _ = reshard("inspect", d)
    assert code == 2, out
    text = one_paragraph(err)
    assert "not a DCP checkpoint" in text and "not committed" not in text
    if layout == "run":
        assert f"did you mean {d / 'checkpoints' / 'step_3'}?".lower() in text.lower()  # the path's own case kept
    else:
        assert "did you mean" not in text.lower()


def test_a_directory_with_data_files_but_no_metadata_is_still_not_committed(tmp_path, reference_ckpt):
    import shutil

    d = tmp_path / "torn"
    shutil.copytree(reference_ckpt, d)
    (d / ".metadata").unlink()
    code, _, err, _ = reshard("inspect", d)
    assert code == 2 and "not committed" in one_paragraph(err)


def test_a_flag_with_no_effect_is_a_warning_where_it_may_not_matter(reference_ckpt, capsys):
    code, _, err = run_cli(["plan", reference_ckpt, "--to", "dp=2", "--rng-policy", "carry", "--seed", "3"], capsys)
    assert "warning: --seed has no effect with --rng-policy carry" in err


def test_a_micro_batch_the_plan_changes_is_in_the_change_list(reference_ckpt, capsys):
    code, out, err = run_cli(["plan", reference_ckpt, "--to", "dp=2", "--json"], capsys)
    before = json.loads(out)["batch"]["before"]
    code, out, err = run_cli(["plan", reference_ckpt, "--to", "dp=2", "--grad-accum", str(before["grad_accum"]),
                              "--json"], capsys)
    assert code == 0, err
    p = json.loads(out)
    assert p["batch"]["after"]["micro_batch"] == 2 * before["micro_batch"] and p["batch"]["kept"]
    said = [c for c in p["verdict"]["changes"] if c.startswith("micro-batch")]
    assert said == [f"micro-batch {before['micro_batch']} -> {2 * before['micro_batch']} per rank "
                    "(activation memory per rank x2)"], p["verdict"]["changes"]


def test_import_format_names_agree_with_the_importer():
    """The early check reads formats/hf/ itself (no torch): every name it admits is one the importer maps."""
    from reshard.arguments import import_formats
    from reshard.engine.import_sources import native_mapping
    from reshard.semantics import hf

    names = set(import_formats()) - {"reshard"}
    assert set(hf.shipped_families()) <= names
    for name in names:
        assert native_mapping(name).family in hf.shipped_families()
