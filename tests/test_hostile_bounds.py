"""Bounded resources on hostile input (issue 13, finding 6), each test written as the attack.

- an amplifying `.metadata` (allow-listed globals only, one memoised chunk list shared by
  every tensor: K + M records in the file, K * M chunks to a naive decoder);
- `.metadata` a symlink to /dev/zero;
- a tensor declared 128 GiB long in 32 KiB of items;
- a staircase of 20,000 chunks (quadratic for a pairwise coverage check).

Memory is measured on a real `python -m reshard` child (its own peak RSS from wait4, under an
address-space cap so an unbounded reader fails instead of exhausting the machine), against a
benign inspect measured the same way in the same test. No timing is asserted.
The builders are those of scripts/fuzz_inputs.py and scripts/bench_hostile.py.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from conftest import run_cli

_SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _load(name: str, file: str):
    spec = importlib.util.spec_from_file_location(name, _SCRIPTS / file)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


bench = _load("reshard_bench_hostile", "bench_hostile.py")
fz = bench.fz

CAP = 8 << 30                  # address space of each child
BYTES_PER_INPUT_BYTE = 64      # generous: the stated bound is a small multiple of the input
SLACK = 64 << 20               # allocator noise between two runs of the same CLI


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("RESHARD_DEBUG", raising=False)


@pytest.fixture(scope="module")
def one_tensor(tmp_path_factory) -> Path:
    """A real dcp.save (single process) of one float32 tensor of 2,048 x 4."""
    return bench.one_tensor_checkpoint(tmp_path_factory.mktemp("one") / "ckpt")


@pytest.fixture(scope="module")
def baseline_rss(one_tensor) -> int:
    r = bench.run_measured(bench.inspect_cmd(sys.executable, one_tensor), cap_bytes=CAP)
    assert r.code == 0, r.err_tail
    return r.rss_bytes


def _refused(r, file: str) -> None:
    assert not r.timed_out, "the child was killed at its timeout"
    assert r.code == 2, f"exit {r.code}: {r.err_tail}"
    assert "Traceback" not in r.err_tail and "error: unexpected" not in r.err_tail, r.err_tail
    assert r.err_tail.startswith("error:") and "\n\n" not in r.err_tail, r.err_tail
    assert file in r.err_tail, r.err_tail


def test_amplifying_metadata_costs_a_bounded_multiple_of_its_size(tmp_path, baseline_rss):
    """The attack: 1.5 MB of `.metadata` whose 14,000 tensors share one memoised list of 14,000
    chunks (2 x 10^8 chunks decoded naively, tens of GB). Refused naming `.metadata`, at a peak
    within a fixed multiple of the file's size above a benign inspect."""
    fz.amplifying_metadata(tmp_path / "amp", 1_500_000)
    size = (tmp_path / "amp" / ".metadata").stat().st_size
    r = bench.run_measured(bench.inspect_cmd(sys.executable, tmp_path / "amp"), cap_bytes=CAP)
    _refused(r, ".metadata")
    assert r.rss_bytes <= baseline_rss + BYTES_PER_INPUT_BYTE * size + SLACK, (
        f"peak {r.rss_bytes >> 20} MiB for a {size:,}-byte .metadata (benign inspect: {baseline_rss >> 20} MiB)")


def test_dev_zero_metadata_is_refused_before_it_is_read(tmp_path, baseline_rss):
    ck = tmp_path / "zero"
    ck.mkdir()
    os.symlink("/dev/zero", ck / ".metadata")
    r = bench.run_measured(bench.inspect_cmd(sys.executable, ck), cap_bytes=CAP)
    _refused(r, ".metadata")
    assert r.rss_bytes <= baseline_rss + SLACK


def test_128_gib_declared_in_32_kib_of_items(one_tensor, tmp_path, copy_of, baseline_rss):
    """The attack: `.metadata` declares 128 GiB for a tensor whose items hold 32 KiB. Inspect
    refuses it from metadata alone; convert refuses it too, commits nothing and never
    allocates the declared size."""
    ck = copy_of(one_tensor)
    s = fz.forge_item_lengths(ck, 1 << 22)
    r = bench.run_measured(bench.inspect_cmd(sys.executable, ck), cap_bytes=CAP)
    assert r.code == 2 and not r.timed_out, r.err_tail
    assert r.rss_bytes <= baseline_rss + SLACK
    out = tmp_path / "out"
    out.mkdir()
    r = bench.run_measured([sys.executable, "-m", "reshard", "convert", str(ck), str(out / "dst"), "--to", "dp=2"],
                           cap_bytes=CAP)
    assert r.code == 2 and not r.timed_out, r.err_tail
    assert "Traceback" not in r.err_tail and "error: unexpected" not in r.err_tail, r.err_tail
    assert s.key in r.err_tail or ".metadata" in r.err_tail, r.err_tail
    assert not [p for p in out.rglob("*") if p.name in (".metadata", "manifest.json")]
    assert r.rss_bytes <= baseline_rss + 4 * SLACK


def test_staircase_of_20000_chunks(tmp_path, capsys):
    """The attack: a `.metadata` declaring a staircase of 20,000 chunks (quadratic for the old
    pairwise sweep: 8,000 took minutes). A tiling passes the coverage check; a gap planted in
    it is named with its key."""
    fz.forge_staircase(tmp_path / "stair", 10_000)
    code, out, err = run_cli(["inspect", tmp_path / "stair", "--json"], capsys)
    report = json.loads(out)
    assert not [p for p in report["problems"] if str(p.get("code", p)).startswith("chunk_")], report["problems"]
    assert report["entries"] == 1

    fz.forge_staircase(tmp_path / "gap", 10_000, damage="gap")
    code, out, err = run_cli(["inspect", tmp_path / "gap"], capsys)
    assert code == 2, err
    assert fz.STAIR_KEY in out and "chunks cover" in out and ".metadata" in out, out
    assert "Traceback" not in out + err
