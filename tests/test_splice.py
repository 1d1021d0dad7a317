"""`reshard.engine.splice`: re-cut tensors are copied as bytes, and the result is exactly the decoded path's.

Sources are real ``dcp.save`` checkpoints (spawned gloo ranks, `reshard.testing.synthetic.make_sharded`),
sharded along dim 0 (FSDP2) or dim 1. Each conversion is run twice: with byte splicing (the
default) and with every chunk decoded by torch and re-encoded (``IOOptions(splice=False)``);
the two output directories must be the same bytes, file for file, whatever the thread count
and buffer window. That pins the splice engine (kernel copies, CRCs composed from the
source's zip records, strided slabs) to the plain path, whose outputs the rest of the suite
loads with ``dcp.load``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.engine.conversion import convert
from reshard.engine.copy import IOOptions
from reshard.model.geometry import Box, contiguous_run
from reshard.storage.checkpoints.index import CheckpointIndex
from reshard.engine import bands, splice
from reshard.storage.checkpoints import dcp_writer
from reshard.storage.files import fileio
from reshard.storage.checkpoints.crcledger import CorruptItem
from reshard.model.plan import Options
from reshard.planning.plan import make_plan
from reshard.testing.synthetic import make_sharded

SHAPE = (96, 40)          # small, but not divisible by 3 or by the slab row counts used below
RULES = r"""
family = "test-synthetic"
description = "make_sharded's tensors, sharded along dim 1 under TP"

[[param]]
match = '^(model\.)?layers\.\d+\.weight$'
tp = "shard"
dim = 1
"""


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_contiguous_run_agrees_with_numpy(data):
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)))
    offsets = tuple(data.draw(st.integers(0, s - 1)) for s in shape)
    sizes = tuple(data.draw(st.integers(1, s - o)) for s, o in zip(shape, offsets))
    a = np.arange(int(np.prod(shape))).reshape(shape)
    view = a[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
    flat = view.reshape(-1)
    run = contiguous_run(Box(offsets, sizes), shape)
    is_run = bool(np.all(np.diff(flat) == 1))
    assert (run is not None) == is_run
    if run is not None:
        assert run == int(flat[0])  # and the run is the box's numel elements long


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("splice")
    return {
        "dim0": make_sharded(root / "dim0", world_size=4, n_tensors=3, shape=SHAPE, seed=1),
        "dim1": make_sharded(root / "dim1", world_size=4, n_tensors=2, shape=SHAPE, shard_dim=1, seed=2),
        # 1 MiB source chunks: the read-back check maps its windows instead of reading them
        "big": make_sharded(root / "big", world_size=4, n_tensors=1, shape=(2048, 512), seed=3),
    }


def _files(d: Path) -> dict[str, bytes]:
    """Every file's bytes; the reports name their own destination, which is normalised, and
    say how many keys were checked while written (only the splice path does that)."""
    out = {p.name: p.read_bytes().replace(str(d.resolve()).encode(), b"<DST>")
           for p in sorted(d.iterdir()) if p.is_file()}
    rep = json.loads(out["reshard-report.json"])
    rep["verification"].pop("checked_while_writing")
    rep["verification"].pop("write_checks", None)
    out["reshard-report.json"] = json.dumps(rep, sort_keys=True).encode()
    out["reshard-report.md"] = b"\n".join(x for x in out["reshard-report.md"].split(b"\n")
                                          if not x.startswith(b"- items checked as they were written"))
    return out


def _run(src: Path, dst: Path, to: str, io: IOOptions, rules: Path | None = None, monkeypatch=None) -> dict:
    # the dim-1 source: every tensor cut along dim 1 by torch.chunk, one piece per writer, which FSDP2's
    # Shard(1) and TP both write (inspect calls it ambiguous): read as the TP layout it was made as
    opts = Options(to=to, rules=str(rules) if rules else None, from_spec="tp=4" if src.name == "dim1" else None)
    return convert(make_plan(src, opts), src, dst, io=io)


CASES = [
    ("dim0", "dp=2"),   # whole source storages per target chunk: kernel copies, CRCs composed
    ("dim0", "dp=3"),   # uneven: partial runs, read once to checksum
    ("dim0", "dp=1"),
    ("dim1", "dp=2"),   # source split along dim 1, target along dim 0: strided slabs
    ("dim0", "tp=4"),   # target split along dim 1 (rules): strided slabs
    ("big", "dp=1"),    # items of 4 MiB and more: mapped read-back windows
]


def _direct_io_here(tmp_path: Path) -> bool:
    probe = tmp_path / "probe"
    probe.write_bytes(b"")
    fd = fileio.open_direct(probe, os.O_RDONLY)
    if fd is not None:
        os.close(fd)
    return fd is not None


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("name,to", CASES)
def test_spliced_output_is_the_decoded_output(sources, tmp_path, monkeypatch, name, to, direct):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    # align every storage, not only those of 1 MiB and more, so these tiny tensors take the direct path too
    monkeypatch.setattr(dcp_writer, "ALIGN_FROM", 1)
    rules = tmp_path / "rules.toml"  # the dim-1 source is read as TP (--from tp=4); rules matter whenever tp > 1
    rules.write_text(RULES)
    calls = {"n": 0, "direct": 0, "band": 0}
    real, real_direct, real_band = splice.SpliceJob.run, splice._direct_runs, bands.BandJob.run

    def counting(self, *a, **k):
        calls["n"] += 1
        return real(self, *a, **k)

    def counting_direct(*a, **k):
        calls["direct"] += 1
        return real_direct(*a, **k)

    def counting_band(self, *a, **k):
        calls["band"] += 1
        return real_band(self, *a, **k)

    monkeypatch.setattr(splice.SpliceJob, "run", counting)
    monkeypatch.setattr(splice, "_direct_runs", counting_direct)
    monkeypatch.setattr(bands.BandJob, "run", counting_band)
    src = sources[name]
    plain = _run(src, tmp_path / "plain", to, IOOptions(splice=False), rules)
    assert calls["n"] == calls["band"] == 0
    fast = _run(src, tmp_path / "fast", to, IOOptions(threads=3, window=3 << 20, direct=direct), rules)
    assert calls["n"] + calls["band"] > 0, "the splice path was not taken"
    # a TP split of dim 1 from row shards goes source by source (`reshard.engine.bands`) when direct
    assert (calls["band"] > 0) == (direct and to.startswith("tp") and name == "dim0")
    fast_direct = calls["direct"] + calls["band"]
    merges = name != "dim1" and to in ("dp=2", "dp=1")  # every target chunk is whole source storages
    if direct and merges and _direct_io_here(tmp_path):
        assert calls["direct"] > 0, "no item was copied with direct I/O"
    if direct and to == "dp=3" and _direct_io_here(tmp_path):  # sources cut in two: checked by the ledger
        assert calls["direct"] > 0, "no item was copied with direct I/O"
    if not direct:
        assert calls["direct"] == 0
    tiny = _run(src, tmp_path / "tiny", to, IOOptions(threads=1, window=1, direct=direct), rules)  # one row per slab
    assert plain["verification"]["equal"] and fast["verification"]["equal"] and tiny["verification"]["equal"]
    # the spliced items were read back and compared with the source as they were written
    assert plain["verification"]["checked_while_writing"] == 0
    assert fast["verification"]["checked_while_writing"] > 0
    wc = fast["verification"]["write_checks"]
    if not direct:  # every buffered item is read back; direct ones are checked against the records where they can be
        assert wc["items_against_source_crc"] == 0 and wc["items_read_back"] > 0
    elif calls["band"]:  # every target item of a band-copied tensor is checked against the sources' records
        assert wc["items_against_source_crc"] > 0 and wc["items_read_back"] == 0
    else:  # every direct copy was checked against the records (at once, or by the ledger)
        assert wc["items_against_source_crc"] == fast_direct
        assert wc["items_compared_after_writing"] == 0
    ref = _files(tmp_path / "plain")
    assert _files(tmp_path / "fast") == ref
    assert _files(tmp_path / "tiny") == ref
    # and the values are the source's, in global terms
    a, b = CheckpointIndex.open(src), CheckpointIndex.open(tmp_path / "fast")
    for key, e in a.entries.items():
        if e.is_tensor:
            assert torch.equal(a.read_tensor(key), b.read_tensor(key)), key


def test_source_crc_of_zero_is_not_trusted(sources, tmp_path, monkeypatch):
    """torch can be told not to compute CRCs (it then writes 0): such a source's CRC is recomputed."""
    ix = CheckpointIndex.open(sources["dim0"])
    e = next(e for e in ix.entries.values() if e.is_tensor)
    chunks = splice.source_chunks(ix.root, e)
    assert chunks is not None and all(c.crc for c in chunks)
    monkeypatch.setattr(splice, "item_layout", lambda *a, **k: _zero_crc(a))
    assert all(c.crc is None for c in splice.source_chunks(ix.root, e))


def _zero_crc(args):
    from dataclasses import replace

    from reshard.storage.checkpoints.fastread import item_layout

    lay = item_layout(*args)
    return replace(lay, storage_crc=0)


def test_a_spliced_item_that_differs_from_the_source_is_caught(sources, tmp_path, monkeypatch):
    """The read-back check (page-cache copies) is independent of the copy: a copy that puts
    one byte wrong is caught before anything is committed."""
    real = splice.SpliceJob.run

    def corrupting(self, fd, at, *a, **k):
        crc = real(self, fd, at, *a, **k)
        pos = at + self.framing.storage_offset + 5
        b = os.pread(fd, 1, pos)
        os.pwrite(fd, bytes([b[0] ^ 0x10]), pos)
        return crc

    monkeypatch.setattr(splice.SpliceJob, "run", corrupting)
    for name in ("dim0", "big"):  # buffered and mapped read-back
        with pytest.raises(splice.SpliceMismatch, match="differs from the source"):
            _run(sources[name], tmp_path / f"out-{name}", "dp=2", IOOptions(direct=False))
        assert not (tmp_path / f"out-{name}").exists()


def _flip_storage_byte(src: Path, copy: Path) -> str:
    """Copy ``src`` to ``copy`` and flip one byte inside the first chunk's tensor data (not its
    zip records): the kind of change a disk or a stray writer makes. Returns the key."""
    import shutil

    shutil.copytree(src, copy)
    ix = CheckpointIndex.open(copy)
    e = next(e for e in ix.entries.values() if e.is_tensor)
    c = splice.source_chunks(ix.root, e)[0]
    with open(c.path, "r+b") as f:
        f.seek(c.storage_at + 7)
        b = f.read(1)
        f.seek(c.storage_at + 7)
        f.write(bytes([b[0] ^ 0x01]))
    return e.key


@pytest.mark.parametrize("name,to", [
    ("big", "dp=2"),   # shards merged: each source storage checked at once
    ("dim0", "dp=3"),  # shards cut in two: checked by the ledger
    ("dim0", "tp=4"),  # columns of rows: each source read once (bands)
], ids=["merged", "cut-in-two", "columns"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_a_copy_catches_a_source_that_changed_after_it_was_written(sources, tmp_path, monkeypatch, name, to, direct):
    """Direct copies are checked against the CRC-32 each source item's writer recorded: a
    source byte that changed on disk stops the conversion (exit 2) with nothing committed,
    whether a target item is whole source storages or parts of them (`splice.SourceLedger`
    combines the parts' CRC-32s per source storage). Buffered copies are read back, and the
    source rows they read go to the same ledger: a corrupt source is bad input, named by
    file and key, on either path."""
    if direct and not _direct_io_here(tmp_path):
        pytest.skip("no direct I/O on this file system")
    monkeypatch.setattr(dcp_writer, "ALIGN_FROM", 1)
    bad = tmp_path / "changed"
    key = _flip_storage_byte(sources[name], bad)
    rules = tmp_path / "rules.toml"
    rules.write_text(RULES)
    with pytest.raises(CorruptItem, match=f"item '{key}' in __.*distcp fails its CRC-32") as info:
        _run(bad, tmp_path / "out", to, IOOptions(direct=direct), rules)
    assert info.value.exit_code == 2
    assert not (tmp_path / "out").exists()


def test_ledger_checks_a_source_once_its_parts_tile_it():
    import zlib

    data = bytes(range(200))
    src = splice.SourceChunk("f", 0, Box((0,), (200,)), zlib.crc32(data), "k")
    ok = splice.SourceLedger()
    ok.add(src.record(1), 120, 80, zlib.crc32(data[120:]))
    assert not ok.verified(src)
    ok.add(src.record(1), 0, 120, zlib.crc32(data[:120]))
    assert ok.verified(src)
    twice = splice.SourceLedger()  # overlapping parts (rows read twice) are fine once a chain of them tiles it
    twice.add(src.record(1), 0, 120, zlib.crc32(data[:120]))
    twice.add(src.record(1), 100, 100, zlib.crc32(data[100:]))
    assert not twice.verified(src)
    twice.add(src.record(1), 120, 80, zlib.crc32(data[120:]))
    assert twice.verified(src)
    wrong = splice.SourceLedger()
    wrong.add(src.record(1), 0, 100, zlib.crc32(data[:100]))
    with pytest.raises(CorruptItem, match="item 'k' in f fails its CRC-32"):
        wrong.add(src.record(1), 100, 100, zlib.crc32(data[100:][::-1]))


def test_direct_output_loads_with_dcp_and_equals_the_source(sources, tmp_path):
    """The direct path's output (storages 4 KiB-aligned, holes between items) is read by
    torch's own ``dcp.load``, and every value equals the source's."""
    import torch.distributed.checkpoint as dcp

    src = sources["big"]  # 1 MiB chunks: aligned by the default policy
    report = _run(src, tmp_path / "out", "dp=2", IOOptions(direct=True))
    assert report["verification"]["equal"]
    ix = CheckpointIndex.open(src)
    keys = [k for k, e in ix.entries.items() if e.is_tensor]

    def load(path: Path) -> dict[str, torch.Tensor]:
        sd = {k: torch.empty(tuple(ix.entries[k].shape), dtype=ix.entries[k].dtype.torch) for k in keys}
        dcp.load(sd, checkpoint_id=str(path))
        return sd

    a, b = load(src), load(tmp_path / "out")
    for k in keys:
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


def test_unusual_items_fall_back_to_decoding(sources):
    """A chunk whose item the byte reader does not parse (here: a storage transform) is decoded instead."""
    from dataclasses import replace

    ix = CheckpointIndex.open(sources["dim0"])
    e = next(e for e in ix.entries.values() if e.is_tensor)
    assert splice.source_chunks(ix.root, e) is not None
    c0 = e.chunks[0]
    e2 = replace(e, chunks=[replace(c0, location=replace(c0.location, transforms=("zstd",)))] + list(e.chunks[1:]))
    assert splice.source_chunks(ix.root, e2) is None


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_bits_equal_is_bytewise_equality_of_any_box(data):
    """The read-back check's comparison: wide-integer views decide exactly what bytes decide."""
    isz = data.draw(st.sampled_from([1, 2, 4, 8, 16]))
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    n = int(np.prod(shape)) * isz
    raw = np.frombuffer(data.draw(st.binary(min_size=n, max_size=n)), dtype=np.uint8).reshape(shape + (isz,))
    other = raw.copy()
    offsets = tuple(data.draw(st.integers(0, s - 1)) for s in shape)
    sizes = tuple(data.draw(st.integers(1, s - o)) for s, o in zip(shape, offsets))
    box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
    assert splice.bits_equal(raw[box], other[box])
    flip = tuple(data.draw(st.integers(o, o + s - 1)) for o, s in zip(offsets, sizes)) + (data.draw(st.integers(0, isz - 1)),)
    other[flip] ^= 0x01
    assert not splice.bits_equal(raw[box], other[box])


@pytest.mark.parametrize("how", ["no O_DIRECT", "reads refused"])
def test_without_direct_io_the_same_files_are_written(sources, tmp_path, monkeypatch, how):
    """A file system without direct I/O (tmpfs: the open fails), or a device that refuses an
    alignment (EINVAL on the read), falls back to the page cache and writes the same bytes."""
    import errno as _errno

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    monkeypatch.setattr(dcp_writer, "ALIGN_FROM", 1)
    ref = _run(sources["dim0"], tmp_path / "ref", "dp=2", IOOptions(direct=True))
    if how == "no O_DIRECT":
        monkeypatch.setattr(fileio, "open_direct", lambda *a, **k: None)
        monkeypatch.setattr(dcp_writer, "open_direct", lambda *a, **k: None)
    else:
        def refuse(*a, **k):
            raise OSError(_errno.EINVAL, "Invalid argument")

        monkeypatch.setattr(fileio, "read_direct", refuse)
    out = _run(sources["dim0"], tmp_path / "out", "dp=2", IOOptions(direct=True))
    assert ref["verification"]["equal"] and out["verification"]["equal"]
    assert _files(tmp_path / "out") == _files(tmp_path / "ref")


def test_items_whose_sources_the_ledger_could_not_complete_are_compared_after_writing():
    """A distributed worker that copied only part of a source storage cannot check it: its
    key leaves the checked set, so the post-write verification compares it."""
    import zlib

    from reshard.engine.copy import WriteChecks

    data = bytes(range(100))
    src = splice.SourceChunk("f", 0, Box((0,), (100,)), zlib.crc32(data))
    wc = WriteChecks()
    wc.update({"whole", "half"})
    wc.ledger.add(src.record(1), 0, 50, zlib.crc32(data[:50]))  # the other half is another worker's
    wc.defer("half", [src])
    wc.finalize()
    assert "half" not in wc and "whole" in wc
    assert wc.summary() == {"items_against_source_crc": 0, "items_read_back": 0, "items_compared_after_writing": 1}
