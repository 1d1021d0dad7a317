"""Plain default output (issue 35): what a person reads says the verdict, what is carried or
dropped and where bytes go, in plain words; the mechanism (reflinks, read amplification, how a
topology was read from the chunks) is behind ``--verbose``, and ``--json`` keeps all of it.

Run on real checkpoints: ``plain_fsdp2_ckpt`` (a plain FSDP2 script's ``get_state_dict`` +
``dcp.save`` on 4 gloo ranks, no manifest: the recipe, schedule and accumulation phase are
unknown) and ``reference_ckpt`` (the reference trainer, with a manifest, for a TP change).
Each command is run once per module, in-process, and every test reads those outputs:

- the default text of inspect, plan (a DP and a TP change), convert (``--data copy`` and
  ``--data link``) and verify holds no word of ``JARGON`` and no line that says "carried" and
  "unknown" at once (the accumulation phase no manifest records is "assumed", not "carried");
- ``--verbose`` shows what the default leaves out, in its own words;
- ``--json`` still holds every figure the text leaves out, under the keys it had.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import cli

# Words a person new to distributed training should not meet without asking for detail.
JARGON = ("reduce-scatter", "all-reduce", "all-gather", "reflink", "what the ranks keep", "inode",
          "copy-on-write", "collective", "matmul", "dim-0", "amplification")


def _run(args: list) -> str:
    code, out, err = cli([str(a) for a in args] + ["--quiet"])
    assert code == 0, (args, out, err)
    return out


@pytest.fixture(scope="module")
def outputs(plain_fsdp2_ckpt: Path, reference_ckpt: Path, tmp_path_factory) -> dict[str, str]:
    """Every command's output, default and verbose, each run once for the module."""
    work = tmp_path_factory.mktemp("plain")  # on the fixtures' file system, as --data link needs
    src = plain_fsdp2_ckpt
    link = ["convert", src, work / "link", "--to", "dp=2", "--data", "link"]
    return {
        "inspect": _run(["inspect", src]),
        "inspect -v": _run(["inspect", src, "--verbose"]),
        "inspect json": _run(["inspect", src, "--json"]),
        "plan": _run(["plan", src, "--to", "dp=3"]),
        "plan -v": _run(["plan", src, "--to", "dp=3", "--verbose"]),
        "plan json": _run(["plan", src, "--to", "dp=3", "--json"]),
        "plan tp": _run(["plan", reference_ckpt, "--to", "dp=2,tp=2"]),
        "convert": _run(["convert", src, work / "copy", "--to", "dp=2"]),
        "verify": _run(["verify", src, work / "copy"]),
        "convert link": _run(link),
        "convert link -v": _run(link + ["--overwrite", "--verbose"]),
        "convert link json": _run(link + ["--overwrite", "--json"]),
    }


DEFAULTS = ("inspect", "plan", "plan tp", "convert", "convert link", "verify")


@pytest.mark.parametrize("name", DEFAULTS)
def test_default_output_has_no_jargon(outputs, name):
    text = outputs[name].lower()
    found = [w for w in JARGON if w in text]
    assert not found, f"{name}: {found} in\n{outputs[name]}"
    assert not re.search(r"\d(\.\d+)?x what", text), outputs[name]


@pytest.mark.parametrize("name", DEFAULTS)
def test_no_line_says_carried_and_unknown(outputs, name):
    both = [line for line in outputs[name].splitlines() if "carried" in line and "unknown" in line]
    assert not both, f"{name}: {both}"


def test_plan_without_manifest_says_what_it_assumes(outputs):
    """The phase nobody recorded is an assumption, the schedule nobody checked is said so, and the
    verdict, the kept state and where the bytes could go (--data link) are all still there."""
    text = outputs["plan"]
    assert "accum phase unknown (no manifest): assumed to be at an optimizer-step boundary" in text
    assert re.search(r"^  accumulation phase assumed +unknown \(no manifest\)", text, re.M), text
    assert "schedule    unchecked: the source's batch recipe is not recorded" in text
    assert "verdict     WARM START of the data position only" in text
    assert re.search(r"^  optimizer state +carried +exp_avg, exp_avg_sq", text, re.M), text
    assert "data link   available: --data link would share 4 source files" in text
    # 4 -> 3 ranks: a rank's load reads whole saved pieces, more than it keeps; said in words
    assert re.search(r"a target rank reads at most [\d.]+ KiB, [\d.]+ times what it keeps", text), text
    assert "gradients are summed in another order over a different number of ranks" in text
    assert "tensor parallel 1 -> 2: layer outputs are summed from the ranks' partial results" in outputs["plan tp"]


def test_plan_verbose_shows_the_detail(outputs):
    text, default = outputs["plan -v"], outputs["plan"]
    assert "how: reflink where the file system can, else hard links" in text
    assert re.search(r"each target rank's load reads at most .* files \(rank \d\), [\d.]+x what the ranks keep", text)
    assert len(re.findall(r"^            rank \d: \d+ items from \d+ files", text, re.M)) == 3
    assert "global shape" in text and "global shape" not in default  # the per-tensor placement table
    assert re.search(r"^            rank 0: params", text, re.M) and not re.search(r"rank 0: params", default)


def test_plan_json_keeps_everything(outputs):
    """The text is plainer; the JSON still carries every figure and the facet statuses it had."""
    p = json.loads(outputs["plan json"])
    d = p["data_link"]
    assert d["available"] and "reflink" in d["how"] and "inode" in d["note"]
    assert d["reads"]["amplification"] > 1.0 and len(d["reads"]["per_rank"]) == 3
    assert p["accumulation"] == {"micro_step": None, "in_flight_grads": None, "ok": True,
                                 "note": "unknown (no manifest): assumed to be at an optimizer-step boundary"}
    # issue 47: the phase no manifest records is "assumed" in the JSON too, as the text and the report say
    assert p["verdict"]["kept"]["accumulation_phase"]["status"] == "assumed"
    assert p["schedule"]["policy"] == "unknown"
    assert p["verdict"]["kind"] == "warm_start"


def test_inspect_topology_evidence_behind_verbose(outputs):
    evidence = json.loads(outputs["inspect json"])["topology"]["evidence"]
    assert evidence and any("dim-0" in e for e in evidence)
    assert "topology    dp_shard=4 (world size 4, inferred)" in outputs["inspect"]
    for e in evidence:
        assert f"            - {e}" in outputs["inspect -v"]
        assert e not in outputs["inspect"]


def test_convert_link_says_where_the_bytes_are(outputs):
    """Default: which files are shared, how (in words) and what not to do; --verbose: the whole note."""
    report = json.loads(outputs["convert link json"])["data"]
    method = report["method"]
    text, verbose = outputs["convert link"], outputs["convert link -v"]
    words = {"hardlink": "hard link", "reflink": "file clone"}[method]
    assert re.search(rf"^shared      [\d.]+ KiB in 4 source data files by {words}", text, re.M), text
    if method == "hardlink":
        assert "never modify the source in place (deleting or renaming it is safe)" in text
    else:
        assert "clones of the source's (no bytes copied)" in text
    assert report["note"] in verbose and report["note"] not in text
    assert "inode" in verbose
