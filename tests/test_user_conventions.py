"""A key no shipped convention explains has ways out on the command line (issue 16).

`--convention FILE` gives it a role with a convention TOML of the user's own (offered before
the shipped ones; recorded by name and sha256), `--keep PATTERN` carries it unchanged as role
``other``, `--drop PATTERN` leaves it out. Each choice is in the plan options (so the
fingerprint), the report and the lineage; `reshard verify` recomputes the plan with them, and
the output manifest, which may name the user's convention, converts again.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from conftest import run_cli
from reshard.storage.checkpoints.index import CheckpointIndex
from test_no_silent_loss import _every_role_state

MYSTERY = "mystery.ema_decay"

EMA_CONVENTION = """\
name = "my-ema"
description = "the EMA decay a user's trainer saves beside the model"

[[rule]]
match = '^mystery\\.(?P<name>.+)$'
role = "other"
"""


def _source(tmp_path: Path, **extra: object) -> Path:
    sd = _every_role_state()
    sd["mystery"] = {"ema_decay": torch.tensor([0.999, 0.9999])}
    sd.update(extra)
    path = tmp_path / "src"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    return path


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _key(report: dict, key: str) -> dict:
    return next(k for k in report["plan"]["keys"] if k["key"] == key)


def _last_options(dst: Path) -> dict:
    manifest = json.loads((dst / "manifest.json").read_text())
    return manifest["lineage"][-1]["policies"]["options"]


def test_unknown_key_error_names_the_ways_out(tmp_path, capsys):
    src = _source(tmp_path)
    code, out, err = run_cli(["plan", src, "--to", "dp=2", "--json"], capsys)
    assert code == 1
    reason = next(r for r in json.loads(out)["reasons"] if MYSTERY in r)
    for way in ("--convention FILE", "--keep PATTERN", "--drop PATTERN"):
        assert way in reason, reason
    assert "formats/conventions/" not in reason


def test_convention_file_gives_the_key_a_role_through_two_conversions_and_verify(tmp_path, capsys):
    src = _source(tmp_path)
    conv = _write(tmp_path, "ema.toml", EMA_CONVENTION)
    code, out, err = run_cli(["inspect", src, "--json", "--convention", conv], capsys)
    assert code == 0, err
    report = json.loads(out)
    assert not any(p["code"] == "unknown_keys" for p in report["problems"]), report["problems"]

    code, out, err = run_cli(["plan", src, "--to", "dp=2", "--json", "--convention", conv], capsys)
    assert code == 0, err
    plan = json.loads(out)
    recorded = plan["options"]["conventions"]
    assert [(c["name"], c["file"]) for c in recorded] == [("my-ema", str(conv.resolve()))]
    assert len(recorded[0]["sha256"]) == 64

    dst = tmp_path / "dst"
    code, out, err = run_cli(["convert", src, dst, "--to", "dp=2", "--convention", conv], capsys)
    assert code == 0, err
    rep = json.loads((dst / "reshard-report.json").read_text())
    assert _key(rep, MYSTERY)["action"] == "carried" and _key(rep, MYSTERY)["role"] == "other"
    assert torch.equal(CheckpointIndex.open(dst).read_tensor(MYSTERY), torch.tensor([0.999, 0.9999]))
    manifest = json.loads((dst / "manifest.json").read_text())
    assert manifest["key_convention"] == "reshard"  # the primary; my-ema explained one key
    assert _last_options(dst)["conventions"] == recorded

    # the output converts again with the same file, and verify recomputes both hops
    dst2 = tmp_path / "dst2"
    code, out, err = run_cli(["convert", dst, dst2, "--to", "dp=3", "--convention", conv], capsys)
    assert code == 0, err
    for a, b in ((src, dst), (src, dst2)):
        code, out, err = run_cli(["verify", a, b], capsys)
        assert code == 0, (a, b, out, err)

    # other bytes under the recorded path: the recomputed plan is refused, never read another way
    conv.write_text(EMA_CONVENTION.replace('role = "other"', 'role = "config"'))
    code, out, err = run_cli(["verify", src, dst], capsys)
    assert code != 0
    assert "my-ema" in out + err and "no longer holds" in out + err, (out, err)


def test_user_convention_as_primary_is_a_name_the_output_manifest_keeps(tmp_path, capsys):
    """A user's full convention (a copy of the shipped reshard one plus a rule) becomes the primary."""
    from reshard.paths import formats_root

    src = _source(tmp_path)
    text = (formats_root() / "conventions" / "reshard.toml").read_text().replace('name = "reshard"',
                                                                                 'name = "my-trainer"', 1)
    conv = _write(tmp_path, "mine.toml", text + '\n[[rule]]\nmatch = \'^mystery\\.\'\nrole = "other"\n')
    dst = tmp_path / "dst"
    code, out, err = run_cli(["convert", src, dst, "--to", "dp=2", "--convention", conv], capsys)
    assert code == 0, err
    assert json.loads((dst / "manifest.json").read_text())["key_convention"] == "my-trainer"
    code, out, err = run_cli(["inspect", dst, "--json", "--convention", conv], capsys)
    assert code == 0, err
    assert json.loads(out)["convention"]["name"] == "my-trainer"
    dst2 = tmp_path / "dst2"
    code, out, err = run_cli(["convert", dst, dst2, "--to", "dp=3", "--convention", conv], capsys)
    assert code == 0, err
    code, out, err = run_cli(["verify", src, dst2], capsys)
    assert code == 0, (out, err)
    # the same name with other bytes is refused: the lineage pins the name to the file it recorded
    other = _write(tmp_path, "other.toml", text + '\n[[rule]]\nmatch = \'^mystery\\.\'\nrole = "config"\n')
    code, out, err = run_cli(["plan", dst, "--to", "dp=3", "--convention", other], capsys)
    assert code == 2 and "my-trainer" in err and "other bytes" in err, err
    # without the file the manifest still reads; the key is unknown again and the error names the ways out
    code, out, err = run_cli(["plan", dst, "--to", "dp=3", "--json"], capsys)
    assert code == 1, err
    assert any(MYSTERY in r and "--convention FILE" in r for r in json.loads(out)["reasons"])


def test_keep_and_drop_decide_unknown_keys_and_are_recorded(tmp_path, capsys):
    src = _source(tmp_path, scratch={"note": "remember to delete"})
    flags = ["--keep", r"^mystery\.", "--drop", r"^scratch\."]
    code, out, err = run_cli(["plan", src, "--to", "dp=2", "--json", *flags], capsys)
    assert code == 0, err
    plan = json.loads(out)
    assert plan["options"]["keep"] == [r"^mystery\."] and plan["options"]["drop"] == [r"^scratch\."]
    code, out, err = run_cli(["plan", src, "--to", "dp=2", "--json", "--keep", r"^(mystery|scratch)\."], capsys)
    assert code == 0, err
    assert json.loads(out)["fingerprint"] != plan["fingerprint"]

    dst = tmp_path / "dst"
    code, out, err = run_cli(["convert", src, dst, "--to", "dp=2", *flags], capsys)
    assert code == 0, err
    rep = json.loads((dst / "reshard-report.json").read_text())
    kept, dropped = _key(rep, MYSTERY), _key(rep, "scratch.note")
    assert kept["action"] == "carried" and kept["role"] == "other" and r"--keep ^mystery\." in kept["reason"]
    assert dropped["action"] == "dropped" and dropped["reason"] == r"--drop ^scratch\."
    out_keys = set(CheckpointIndex.open(dst).entries)
    assert MYSTERY in out_keys and "scratch.note" not in out_keys
    assert _last_options(dst)["keep"] == [r"^mystery\."] and _last_options(dst)["drop"] == [r"^scratch\."]
    code, out, err = run_cli(["verify", src, dst], capsys)
    assert code == 0, (out, err)

    # a second conversion of the output: the kept key is still one no convention explains, so the
    # same --keep carries it again; each hop's lineage entry records its own choice
    dst2 = tmp_path / "dst2"
    code, out, err = run_cli(["convert", dst, dst2, "--to", "dp=3", "--keep", r"^mystery\."], capsys)
    assert code == 0, err
    assert torch.equal(CheckpointIndex.open(dst2).read_tensor(MYSTERY), torch.tensor([0.999, 0.9999]))
    lineage = json.loads((dst2 / "manifest.json").read_text())["lineage"]
    assert [e["policies"]["options"]["keep"] for e in lineage] == [[r"^mystery\."], [r"^mystery\."]]
    assert lineage[0]["policies"]["options"]["drop"] == [r"^scratch\."]
    code, out, err = run_cli(["verify", src, dst2], capsys)
    assert code == 0, (out, err)


def test_bad_choices_are_bad_input(tmp_path, capsys):
    src = _source(tmp_path)
    cases = [
        ["--keep", "("],                                            # not a regular expression
        ["--keep", "^mystery", "--drop", "ema"],                     # both decide the same key
        ["--convention", str(tmp_path / "absent.toml")],             # no such file
        ["--convention", str(tmp_path)],                             # a directory
        ["--convention", str(_write(tmp_path, "shadow.toml", 'name = "reshard"\n'))],  # a shipped name
    ]
    for extra in cases:
        code, out, err = run_cli(["plan", src, "--to", "dp=2", *extra], capsys)
        assert code == 2, (extra, out, err)
        assert err.strip().startswith("error:") and "Traceback" not in err, (extra, err)
