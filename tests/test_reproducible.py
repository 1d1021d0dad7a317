"""Outputs are byte-reproducible with SOURCE_DATE_EPOCH set: the same command twice gives the same files.

Each run is its own interpreter (`subprocess`, not a forked child: the process is the point),
with its own hash seed (PYTHONHASHSEED 1, then 2) and library state, which is what once let a
safetensors header's metadata order and an export's wall time vary.
"""
from __future__ import annotations

import filecmp
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _run(args: list, cwd: Path, seed: int) -> None:
    env = {**os.environ, "SOURCE_DATE_EPOCH": "1700000000", "PYTHONHASHSEED": str(seed)}
    r = subprocess.run([sys.executable, "-m", "reshard", *map(str, args)], capture_output=True, text=True, env=env,
                       cwd=str(cwd))
    assert r.returncode == 0, r.stderr


def _files(d: Path) -> list[Path]:
    return sorted(p.relative_to(d) for p in d.rglob("*") if p.is_file())


@pytest.mark.parametrize("command", [["export", "--format", "safetensors"], ["export", "--format", "torch"],
                                     ["convert", "--to", "dp=2", "--output-format", "local"]])
def test_the_same_command_twice_writes_the_same_bytes(reference_ckpt, tmp_path, command):
    outs = []
    for i in range(2):  # the same destination path each time (the reports name it)
        _run([command[0], reference_ckpt, tmp_path / "out", *command[1:]], tmp_path, seed=i + 1)
        outs.append((tmp_path / "out").rename(tmp_path / f"run{i}"))
    assert _files(outs[0]) == _files(outs[1])
    differ = [str(f) for f in _files(outs[0]) if not filecmp.cmp(outs[0] / f, outs[1] / f, shallow=False)]
    assert not differ, differ
