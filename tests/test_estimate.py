"""The preflight's time estimate (issue 45): a range, low to high, from a probe of the copy's own path.

What is checked, with no timing asserted (how close the range comes to the actual time is measured by
`scripts/bench_estimate.py`, docs/benchmarks.md):

* a small checkpoint is not probed at all (no probe file, no read), and its range says so;
* the range is rendered (text and JSON) with its bounds positive and ordered, the same in `plan --dst`
  and the report;
* forced on a small checkpoint, the probe moves real bytes through direct reads, CRC-32 and direct
  writes, bounded in bytes, names what bounds it, and leaves no file behind.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import cli
from reshard.engine import space
from reshard.render.space import estimate_lines, space_line, time_range


def _check_range(fig: dict) -> None:
    assert fig["low_s"] > 0 and fig["high_s"] > 0, fig
    assert fig["low_s"] <= fig["seconds"] <= fig["high_s"], fig
    lows, highs = zip(*fig["parts"].values())
    assert all(0 <= lo <= hi for lo, hi in fig["parts"].values()), fig["parts"]
    assert sum(lows) == pytest.approx(fig["low_s"], abs=0.01) and sum(highs) == pytest.approx(fig["high_s"], abs=0.01)
    assert 1 <= fig["cpu_slowdown"][0] <= fig["cpu_slowdown"][1], fig


def test_a_tiny_checkpoint_is_not_probed_and_its_range_is_rendered(reference_ckpt, tmp_path, monkeypatch):
    def no_probe(*a, **k):  # pragma: no cover - called only if the skip is broken
        raise AssertionError("the copy probe ran for a tiny checkpoint")

    monkeypatch.setattr(space, "path_probe", no_probe)
    code, out, err = cli(["plan", reference_ckpt, "--to", "dp=2", "--dst", tmp_path / "out", "--json"])
    assert code == 0, out + err
    fig = json.loads(out)["space"]
    _check_range(fig)
    assert fig["probe"] == {"skipped": "under 64.0 MiB to move"} and fig["read"] is None and fig["write"] is None
    assert fig["bound"] is None and "not probed" in fig["basis"] and "items" in fig["parts"], fig
    assert os.listdir(tmp_path) == [], "nothing written for the estimate"
    code, text, err = cli(["plan", reference_ckpt, "--to", "dp=2", "--dst", tmp_path / "out"])
    assert code == 0, text + err
    assert "to convert (not probed: under 64.0 MiB to move)" in text and "  parts: bytes " in text, text


def test_forced_probe_moves_bytes_on_the_copy_path_and_leaves_nothing(reference_ckpt, tmp_path, monkeypatch):
    monkeypatch.setattr(space, "PROBE_FROM", 0)
    code, out, err = cli(["convert", reference_ckpt, tmp_path / "out", "--to", "dp=2", "--json"])
    assert code == 0, out + err
    fig = json.loads(out)["estimate"]
    _check_range(fig)
    probe = fig["probe"]
    assert probe["error"] is None and probe["streams"] >= 1 and probe["bytes"] > 0, probe
    assert probe["bytes"] <= space.PROBE_CAP + probe["streams"] * space.PROBE_BLOCK, probe
    assert fig["bound"] in ("read", "write", "crc") and probe["bound"] == fig["bound"], fig
    for side in ("read", "crc", "write"):
        assert fig[side]["bytes"] == probe["bytes"] and fig[side]["seconds"] > 0 and fig[side]["error"] is None, fig
    assert str(reference_ckpt) in fig["read"]["file"] and str(tmp_path) in fig["write"]["file"]
    assert sorted(os.listdir(tmp_path)) == ["out"], "the probe's files are removed"
    line = space_line(fig)
    assert "to convert (bound by " in line and "read " in line and "crc " in line and "write " in line, line


def test_path_probe_is_bounded_and_removes_its_files(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.distcp").write_bytes(os.urandom(3 << 20))
    (src / "b.distcp").write_bytes(os.urandom(1 << 20))
    out = tmp_path / "out"
    out.mkdir()
    files = space.data_files([src])
    assert [f.name for f in files] == ["a.distcp", "b.distcp"], "largest first"
    p = space.path_probe(files, out, streams=3, seconds=10.0, cap=6 << 20)
    assert p.error is None and p.nbytes > 0 and p.streams == 3
    assert p.nbytes <= (6 << 20) + 3 * space.PROBE_BLOCK
    assert p.bound in ("read", "crc", "write") and os.listdir(out) == []
    w = space.path_probe([], out, streams=2, seconds=10.0, cap=1 << 20)  # write only (a source in a store)
    assert w.error is None and w.nbytes > 0 and w.read_s == 0 and w.part("read").error == "not probed here"
    assert os.listdir(out) == []


def test_time_range_words():
    assert time_range(0.1, 0.6) == "under 1 s"
    assert time_range(12.2, 25) == "12-25 s"
    assert time_range(0.4, 3) == "up to 3 s"
    assert time_range(70, 130) == "1 min 10 s to 2 min 10 s"
    assert time_range(5.1, 4.9) == "about 5 s"
    fig = {"needed_bytes": 10, "read_bytes": 10, "free_bytes": None, "low_s": 1.0, "high_s": 2.0,
           "parts": {"bytes": [1.0, 2.0]}, "probe": {"skipped": "under 64.0 MiB to move"}}
    assert estimate_lines(fig)[1:] == ["  time: 1-2 s to convert (not probed: under 64.0 MiB to move)",
                                       "  parts: bytes 1-2 s"]
