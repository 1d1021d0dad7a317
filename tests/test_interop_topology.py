"""Topology told honestly (issue 15): replicas are told apart from shards by who wrote each
piece, and where the chunks cannot tell, the candidates are listed and --from is asked for.

The checkpoints are real: tests/writers/replicated_dp.py saves a DDP-style replicated model
from 2 gloo ranks with torch's DefaultSavePlanner, once with its default deduplication
(replicated chunks spread over the ranks holding them) and once with
``dedup_save_to_lowest_rank=True`` (everything on rank 0, an empty file from rank 1).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_cli

WRITER = Path(__file__).resolve().parent / "writers" / "replicated_dp.py"


@pytest.fixture(scope="module")
def replicated(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("replicated")
    subprocess.run([sys.executable, str(WRITER), str(out)], check=True, timeout=300)
    return out


def test_replicas_spread_by_dcp_are_read_as_dp_replicate(replicated, tmp_path, capsys):
    code, out, err = run_cli(["inspect", replicated / "balanced", "--json"], capsys)
    rep = json.loads(out)
    assert code == 0, rep["problems"]
    topo = rep["topology"]
    assert (topo["dp_replicate"], topo["dp_shard"], topo["world_size"]) == (2, 1, 2), topo
    assert not topo.get("ambiguous") and any("replicas" in e for e in topo["evidence"])
    code, _, err = run_cli(["convert", replicated / "balanced", tmp_path / "out", "--to", "dp=2"], capsys)
    assert code == 0, err
    lineage = json.loads((tmp_path / "out" / "manifest.json").read_text())["lineage"][-1]
    assert lineage["from"]["dims"]["dp_replicate"] == 2  # the lineage records what the chunks showed


def test_replicas_on_the_lowest_rank_are_ambiguous_and_ask_for_from(replicated, tmp_path, capsys):
    src = replicated / "lowest"
    code, out, err = run_cli(["inspect", src, "--json"], capsys)
    rep = json.loads(out)
    assert code == 0, rep["problems"]  # ambiguous is not inconsistent
    topo = rep["topology"]
    assert topo["ambiguous"] and topo["alternatives"] == ["dp_replicate=2", "pp=2", "dp=1"], topo
    warning = next(p for p in rep["problems"] if p["code"] == "topology_ambiguous")
    assert "--from" in warning["message"]
    code, out, err = run_cli(["plan", src, "--to", "dp=2"], capsys)
    assert code == 2 and "ambiguous" in err and "--from dp_replicate=2" in err and "Traceback" not in err
    code, _, err = run_cli(["convert", src, tmp_path / "out", "--to", "dp=2"], capsys)
    assert code == 2 and not (tmp_path / "out").exists()
    code, _, err = run_cli(["convert", src, tmp_path / "out", "--from", "dp_replicate=2", "--to", "dp=2"], capsys)
    assert code == 0, err
    lineage = json.loads((tmp_path / "out" / "manifest.json").read_text())["lineage"][-1]
    assert lineage["from"]["dims"]["dp_replicate"] == 2
