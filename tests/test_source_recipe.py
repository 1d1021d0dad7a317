"""The source batch recipe on the command line (issue 16): `--source-micro-batch`,
`--source-grad-accum`, `--source-seq-len` say what a manifest's `batch` would, for the
checkpoints that carry no manifest. Real checkpoints (the session fixtures), the real CLI.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import cli, run_cli

SEED_FLAGS = ["--source-micro-batch", "8", "--source-grad-accum", "4"]


def _plan(args: list, capsys) -> tuple[int, dict, str]:
    code, out, err = run_cli(["plan", *args, "--json"], capsys)
    return code, (json.loads(out) if out.strip() else {}), err


@pytest.fixture(scope="module")
def converted(plain_fsdp2_ckpt: Path, tmp_path_factory) -> Path:
    """plain FSDP2 (4 ranks, no manifest) -> dp=2, its recipe from the flags: 8 x 4 x 4 = 128."""
    dst = tmp_path_factory.mktemp("source_recipe") / "out"
    code, out, err = cli(["convert", plain_fsdp2_ckpt, dst, "--to", "dp=2", *SEED_FLAGS, "--source-seq-len", "16"])
    assert code == 0, out + err
    return dst


def test_seed_case_64_to_32_keeps_2048_without_a_manifest(seed64_ckpt, capsys):
    """The seed's case: 64 x 8 x 4 = 2,048 on 32 ranks needs accumulation 8; plan reads no tensor bytes."""
    code, p, err = _plan([seed64_ckpt, "--from", "dp=64", "--to", "dp=32"], capsys)
    assert code == 0, err
    assert p["batch"]["before"] is None and p["batch"]["kept"] is None
    assert "batch recipe unknown: global batch not checked" in p["verdict"]["changes"]

    code, p, err = _plan([seed64_ckpt, "--from", "dp=64", "--to", "dp=32", *SEED_FLAGS], capsys)
    assert code == 0, err
    b = p["batch"]
    assert b["before"] == {"micro_batch": 8, "grad_accum": 4, "dp": 64, "global_batch": 2048}
    assert b["after"] == {"micro_batch": 8, "grad_accum": 8, "dp": 32, "global_batch": 2048}
    assert b["kept"] is True and b["feasible"] is True
    assert "--source-micro-batch 8 --source-grad-accum 4" in b["note"]
    assert not any("not checked" in c for c in p["verdict"]["changes"])
    assert "accumulation 4 -> 8 (global batch kept; reduction order differs)" in p["verdict"]["changes"]
    assert p["schedule"]["policy"] == "unchanged"
    # the plain script saved no data position: a warm start of that only, the batch is not the cause
    assert p["verdict"]["kind"] == "warm_start" and p["verdict"]["warm_start_of"] == ["data_position"]
    assert p["options"]["source_micro_batch"] == 8 and p["options"]["source_grad_accum"] == 4

    code, out, _ = run_cli(["plan", seed64_ckpt, "--from", "dp=64", "--to", "dp=32", *SEED_FLAGS], capsys)
    assert code == 0
    assert "before: micro-batch 8 x accumulation 4 x dp 64 = 2048" in out
    assert "after:  micro-batch 8 x accumulation 8 x dp 32 = 2048  (global batch kept)" in out


def test_converted_output_records_the_target_recipe_and_verifies(plain_fsdp2_ckpt, converted, capsys):
    m = json.loads((converted / "manifest.json").read_text())
    assert m["batch"] == {"micro_batch": 8, "grad_accum": 8, "seq_len": 16, "global_batch": 128}
    options = m["lineage"][-1]["policies"]["options"]
    assert (options["source_micro_batch"], options["source_grad_accum"], options["source_seq_len"]) == (8, 4, 16)
    assert m["lineage"][-1]["policies"]["batch"]["kept"] is True

    code, out, err = run_cli(["verify", plain_fsdp2_ckpt, converted], capsys)
    assert code == 0, out + err

    # a second conversion of the output needs no flags: its manifest says the recipe
    code, p, err = _plan([converted, "--to", "dp=4"], capsys)
    assert code == 0, err
    assert p["batch"]["before"] == {"micro_batch": 8, "grad_accum": 8, "dp": 2, "global_batch": 128}
    assert p["batch"]["after"] == {"micro_batch": 8, "grad_accum": 4, "dp": 4, "global_batch": 128}
    assert p["batch"]["kept"] is True and p["batch"]["note"] == ""
    assert not any("not checked" in c for c in p["verdict"]["changes"])


def test_convert_from_a_plan_file_carries_the_flags(plain_fsdp2_ckpt, tmp_path, capsys):
    """`convert --plan` rebuilds Options from the plan JSON: the source recipe is among them."""
    code, out, err = run_cli(["plan", plain_fsdp2_ckpt, "--to", "dp=2", *SEED_FLAGS, "--json"], capsys)
    assert code == 0, err
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(out)
    code, out, err = run_cli(["convert", plain_fsdp2_ckpt, tmp_path / "out", "--plan", plan_file], capsys)
    assert code == 0, out + err
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["batch"] == {"micro_batch": 8, "grad_accum": 8, "seq_len": None, "global_batch": 128}


def test_flags_that_disagree_with_the_manifest_are_refused(converted, capsys):
    code, _, err = run_cli(["plan", converted, "--to", "dp=4", "--source-grad-accum", "4"], capsys)
    assert code == 2
    assert "--source-grad-accum 4 disagrees with the source manifest's batch.grad_accum 8" in err
    assert "manifest.json" in err and "Drop --source-grad-accum" in err

    code, _, err = run_cli(["plan", converted, "--to", "dp=4", "--source-seq-len", "32"], capsys)
    assert code == 2 and "--source-seq-len 32 disagrees with the source manifest's batch.seq_len 16" in err

    # flags that say what the manifest says change nothing
    code, p, err = _plan([converted, "--to", "dp=4", "--source-micro-batch", "8", "--source-grad-accum", "8"], capsys)
    assert code == 0, err
    assert p["batch"]["after"] == {"micro_batch": 8, "grad_accum": 4, "dp": 4, "global_batch": 128}
    assert p["batch"]["note"] == ""  # the recipe is the manifest's; the flags filled nothing


def test_half_a_recipe_and_a_non_positive_value_are_refused(plain_fsdp2_ckpt, capsys):
    code, _, err = run_cli(["plan", plain_fsdp2_ckpt, "--to", "dp=2", "--source-micro-batch", "8"], capsys)
    assert code == 2
    assert "--source-grad-accum is not given and the source does not record it" in err
    code, _, err = run_cli(["plan", plain_fsdp2_ckpt, "--to", "dp=2", "--source-micro-batch", "0",
                            "--source-grad-accum", "4"], capsys)
    # refused by the command line's own range check, before the checkpoint is read
    assert code == 2 and "'--source-micro-batch'" in err and "greater than or equal to 1" in err


def test_source_seq_len_maps_a_token_counter_for_a_tokens_schedule(torchtitan_ckpt, tmp_path, capsys):
    """torchtitan's layout, no manifest: 2 steps x global batch 8 x 16 tokens = 256 tokens counted.

    With the source recipe and its sequence length, `--schedule tokens` knows the 16 samples
    seen; on a global batch of 4 the schedule position is 4. `verify` recomputes the plan from
    the options the lineage records (the flags among them) to accept the rewrites.
    """
    base = [torchtitan_ckpt, "--to", "dp=1", "--micro-batch", "2", "--grad-accum", "2",
            "--source-micro-batch", "2", "--source-grad-accum", "2", "--schedule", "tokens",
            "--data-policy", "restart-epoch"]
    code, _, err = run_cli(["plan", *base], capsys)
    assert code == 2 and "--schedule tokens needs the samples" in err

    code, p, err = _plan([*base, "--source-seq-len", "16"], capsys)
    assert code == 0, err
    assert p["source"]["tokens_seen"] == 256
    assert p["batch"]["before"]["global_batch"] == 8 and p["batch"]["after"]["global_batch"] == 4
    assert p["batch"]["kept"] is False
    s = p["schedule"]
    assert (s["policy"], s["position_before"], s["position_after"]) == ("tokens", 2, 4)
    assert s["rewrites"]["lr_scheduler.last_epoch"] == {"old": 2, "new": 4}

    dst = tmp_path / "out"
    code, out, err = run_cli(["convert", *base[:1], dst, *base[1:], "--source-seq-len", "16"], capsys)
    assert code == 0, out + err
    m = json.loads((dst / "manifest.json").read_text())
    assert m["batch"] == {"micro_batch": 2, "grad_accum": 2, "seq_len": 16, "global_batch": 4}
    code, out, err = run_cli(["verify", torchtitan_ckpt, dst], capsys)
    assert code == 0, out + err
    assert "lr_scheduler.last_epoch: rewritten: schedule position remapped (--schedule tokens)" in out
