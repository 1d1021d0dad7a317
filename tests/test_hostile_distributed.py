"""Issue 13 under ``--workers`` and ``torchrun``: one ``--trust-pickle`` warning, every read checked.

Real runs (``reshard convert --workers 2``, which starts torchrun itself, and a plain
``torchrun --nproc-per-node 2``), each written as the attack:

- a checkpoint with an object item that only ``--trust-pickle`` loads (an
  ``argparse.Namespace``, outside torch's safe set): every worker loads it, the command
  still prints exactly one warning line naming it;
- one payload byte flipped in a source storage that is split between the two workers
  (dp 4 -> 8 of the reference checkpoint: each source shard feeds one file of each worker;
  dp 1 -> 2 of a checkpoint whose 4 MiB storages the target aligns, so the copy takes the
  direct-I/O path and hands each half to its worker's ledger): no worker reads that storage
  whole, yet the run exits 2 with the single process's paragraph naming file and key, and
  commits nothing, both direct and ``--buffered``;
- a clean conversion is byte-identical to the single-process one, and its report says how
  many source storages were checked across workers.

`check_split_storages` itself (the workers' pieces combined, what no piece covered read
once) is also tested in-process.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
import zlib
from pathlib import Path

import pytest

import forked
import torch

from test_hostile_corruption import flip_payload_byte

EPOCH = "1700000000"
TIMEOUT = 300
WARNING = "warning: --trust-pickle"


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("RESHARD_DEBUG", raising=False)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESHARD_FAULT_") and k != "RESHARD_DEBUG"}
    env.update({"SOURCE_DATE_EPOCH": EPOCH, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    return env


def _reshard(args: list) -> subprocess.CompletedProcess:
    return forked.run(args, env=_env(), timeout=TIMEOUT)


def _torchrun(args: list) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "reshard",
           *map(str, args)]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)


def _paragraph(err: str) -> str:
    """The one paragraph a failed command prints: ``error: ...`` on one line, nothing else."""
    text = err.strip()
    assert text.startswith("error: ") and "\n" not in text, err
    for word in ("Traceback", "torchrun", "ChildFailedError", "SIGTERM"):
        assert word not in err, err
    return text


def _nothing_beside(dst: Path) -> None:
    assert not dst.exists()
    assert not [p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.reshard-tmp-")]


def _payload(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file() and not p.name.startswith("reshard-report")}


def _save(path: Path, sd: dict) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch.distributed.checkpoint as dcp

        dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    return path


@pytest.fixture(scope="module")
def aligned_ckpt(tmp_path_factory) -> Path:
    """One rank, 4 MiB storages: dp=2 cuts each in two 2 MiB halves, which the target aligns
    (so the copy is direct I/O, each half's CRC-32 going to its own worker's ledger)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1024, 1024, generator=g)
    return _save(tmp_path_factory.mktemp("aligned") / "ckpt", {
        "model": {"w": w, "b": torch.randn(1024, generator=g)},
        "optim": {"state": {"w": {"exp_avg": torch.randn(1024, 1024, generator=g),
                                  "exp_avg_sq": torch.rand(1024, 1024, generator=g), "step": torch.tensor(3.0)}}},
        "trainer": {"step": 3, "tokens_seen": 96}})


SPLITS = {"reference": "dp=8", "aligned": "dp=2"}  # each source storage cut between worker 0 and worker 1


@pytest.fixture(params=sorted(SPLITS))
def split_source(request, reference_ckpt, aligned_ckpt) -> tuple[Path, str]:
    return (reference_ckpt if request.param == "reference" else aligned_ckpt), SPLITS[request.param]


# ----------------------------------------------------------------------------- --trust-pickle
def test_workers_print_one_trust_pickle_warning(tmp_path):
    w = torch.arange(8.0).reshape(4, 2)
    ck = _save(tmp_path / "opaque", {
        "model": {"w": w},
        "optim": {"state": {"w": {"exp_avg": torch.zeros_like(w), "exp_avg_sq": torch.ones_like(w),
                                  "step": torch.tensor(3.0)}}},
        "trainer": {"step": 3, "tokens_seen": 96},
        "data": {"sampler": argparse.Namespace(cursor=24, seed=0, epoch=0)}})  # outside torch's safe set
    refused = _reshard(["convert", ck, tmp_path / "refused", "--to", "dp=2", "--workers", "2"])
    assert refused.returncode == 2 and "data.sampler" in _paragraph(refused.stderr)
    for how, run in (("--workers", lambda dst: _reshard(["convert", ck, dst, "--to", "dp=2", "--workers", "2",
                                                         "--trust-pickle"])),
                     ("torchrun", lambda dst: _torchrun(["convert", ck, dst, "--to", "dp=2", "--trust-pickle"]))):
        dst = tmp_path / how.strip("-")
        p = run(dst)
        assert p.returncode == 0, p.stderr[-3000:]
        lines = [ln for ln in (p.stdout + p.stderr).splitlines() if WARNING in ln]
        assert len(lines) == 1, (how, p.stderr[-3000:])
        assert lines[0].startswith(WARNING) and "unpickled 1 object item " in lines[0], lines[0]
        assert lines[0].count("'data.sampler'") == 1 and str(ck) in lines[0], lines[0]
        assert "'trainer.step'" not in lines[0]  # loaded too, but the safe set sufficed
        assert json.loads((dst / "manifest.json").read_text())["lineage"][-1]["policies"]["trust_pickle"] is True


# ----------------------------------------------------------------------------- every read checked
@pytest.mark.parametrize("buffered", [False, True], ids=["direct", "buffered"])
def test_a_corrupt_storage_split_between_workers_stops_the_run(split_source, copy_of, tmp_path, buffered):
    src, to = split_source
    bad = copy_of(src)
    key, file = flip_payload_byte(bad)
    extra = ["--buffered"] if buffered else []
    one = _reshard(["convert", bad, tmp_path / "one", "--to", to, *extra])
    two = _reshard(["convert", bad, tmp_path / "two", "--to", to, "--workers", "2", *extra])
    assert one.returncode == 2 and two.returncode == 2, two.stderr[-3000:]
    text = _paragraph(two.stderr)
    assert text == _paragraph(one.stderr)
    assert f"'{key}'" in text and file in text and "fails its CRC-32" in text, text
    _nothing_beside(tmp_path / "one")
    _nothing_beside(tmp_path / "two")


def test_plain_torchrun_stops_on_a_corrupt_split_storage(aligned_ckpt, copy_of, tmp_path):
    """Started by torchrun directly: the worker that found it prints it, nothing is committed."""
    bad = copy_of(aligned_ckpt)
    key, file = flip_payload_byte(bad)
    p = _torchrun(["convert", bad, tmp_path / "out", "--to", "dp=2"])
    assert p.returncode != 0
    said = [ln for ln in p.stderr.splitlines() if ln.startswith("error: ")]
    assert len(said) == 1 and f"'{key}'" in said[0] and file in said[0] and "fails its CRC-32" in said[0], p.stderr
    _nothing_beside(tmp_path / "out")


@pytest.mark.parametrize("buffered", [False, True], ids=["direct", "buffered"])
def test_a_clean_split_conversion_is_byte_identical_and_counts_the_checks(split_source, tmp_path, buffered):
    src, to = split_source
    extra = ["--buffered"] if buffered else []
    one = _reshard(["convert", src, tmp_path / "one", "--to", to, "--json", *extra])
    two = _reshard(["convert", src, tmp_path / "two", "--to", to, "--workers", "2", "--json", *extra])
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    assert _payload(tmp_path / "one") == _payload(tmp_path / "two")
    rs, rd = json.loads(one.stdout), json.loads(two.stdout)
    assert "storages_checked_across_workers" not in rs["verification"]
    across = rd["verification"].pop("storages_checked_across_workers")
    if src.name == "ckpt":  # the aligned checkpoint: w, b, exp_avg and exp_avg_sq are each cut in two
        assert across == 4
    else:
        assert across > 0
    # how each item was checked depends on who copied what (a split item is compared after
    # writing by the direct path); every item is checked one way or another either way
    counts = [sum(r["verification"].pop("write_checks").values()) for r in (rs, rd)]
    assert counts[0] == counts[1] > 0
    for r in (rs, rd):
        r.pop("seconds"), r.pop("destination"), r["verification"].pop("b"), r["verification"].pop("checked_while_writing")
        assert r.pop("estimate")["enough"]  # size and time figures before the first byte (measured: they differ)
    rd.pop("workers"), rd["verification"].pop("workers")
    rewritten = [sorted(map(json.dumps, r["verification"].pop("rewritten"))) for r in (rs, rd)]  # workers' order
    assert rewritten[0] == rewritten[1]
    assert rs == rd


# ----------------------------------------------------------------------------- the check itself
def _storage_file(tmp_path: Path, data: bytes, at: int = 100) -> Path:
    p = tmp_path / "__0_0.distcp"
    p.write_bytes(b"\0" * at + data + b"\0" * 50)
    return p


def test_check_split_storages_combines_the_workers_pieces(tmp_path):
    from reshard.engine.distributed import check_split_storages
    from reshard.storage.checkpoints.crcledger import CorruptItem, StorageRecord

    data = bytes(range(256)) * 40
    path = _storage_file(tmp_path, data)
    rec = StorageRecord(str(path), "model.w", 100, len(data), zlib.crc32(data))
    half = len(data) // 2

    def piece(off: int, n: int, payload: bytes = data) -> tuple[int, int, int]:
        return (off, n, zlib.crc32(payload[off:off + n]))

    # two workers, one half each: combined without reading a byte (the file is not even there)
    path.unlink()
    assert check_split_storages([[(rec, [piece(0, half)])], [(rec, [piece(half, len(data) - half)])]]) == 1
    _storage_file(tmp_path, data)
    # a part no worker reported (copied by a path without pieces): read once, then checked
    assert check_split_storages([[(rec, [piece(0, 1000)])], []]) == 1
    assert check_split_storages([[(rec, [piece(0, 3000), piece(2000, 3000)])]]) == 1  # overlapping, no chain
    assert check_split_storages([[], []]) == 0
    # a half whose bytes contradict the record: the single process's CorruptItem
    bad = bytearray(data)
    bad[half + 7] ^= 0x01
    with pytest.raises(CorruptItem, match=r"item 'model.w' in __0_0.distcp fails its CRC-32") as info:
        check_split_storages([[(rec, [piece(0, half)])], [(rec, [piece(half, len(data) - half, bytes(bad))])]])
    assert info.value.exit_code == 2 and info.value.where == str(path)
    # the same for the part read from the file
    _storage_file(tmp_path, bytes(bad))
    with pytest.raises(CorruptItem, match="fails its CRC-32"):
        check_split_storages([[(rec, [piece(0, half)])], []])
