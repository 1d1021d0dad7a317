"""Chunks held as arrays (issue 33): `ChunkTable` answers as the list of `Chunk` it stands for,
and the index built from the native decoder's columns equals the index built from the safe
unpickler's records, on real `dcp.save` checkpoints, damaged ones, and a `.metadata` whose
storage entries are not in the chunks' order.

Cost: about 3 s beyond the session checkpoints (no process of its own)."""
from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest

from reshard.model.checkpoint import Chunk, ChunkTable, ItemLocation
from reshard.model.geometry import Box
from reshard.storage.checkpoints import dcp
from reshard.storage.pickles import metadata_columns
from reshard.storage.checkpoints.index import CheckpointIndex


def safe_index(root: Path) -> CheckpointIndex:
    """The index as the safe unpickler's records give it (the reference)."""
    raw = dcp.read_raw_metadata(root)
    return CheckpointIndex(root, metadata_columns.from_raw(raw, str(root / dcp.METADATA_FILE)))


def native_index(root: Path) -> CheckpointIndex:
    if metadata_columns.native is None:
        pytest.skip("reshard.storage.pickles.metadecode is not built (no C compiler at install)")
    ix = CheckpointIndex.open(root)
    assert ix.decoder == "native", "the native decoder declined a checkpoint torch wrote"
    return ix


def assert_same_index(a: CheckpointIndex, b: CheckpointIndex) -> None:
    assert list(a.entries) == list(b.entries)
    for key, ea in a.entries.items():
        eb = b.entries[key]
        assert (ea.kind, ea.shape, ea.dtype, ea.location, ea.path) == (eb.kind, eb.shape, eb.dtype, eb.location, eb.path), key
        assert list(ea.chunks) == list(eb.chunks), key
        assert ea.files() == eb.files(), key
    assert a.findings == b.findings
    assert a.file_sizes == b.file_sizes
    assert a.version == b.version


@pytest.fixture(scope="module")
def sources(plain_fsdp2_ckpt, seed64_ckpt, reference_ckpt, torchtitan_ckpt) -> dict[str, Path]:
    return {"fsdp2": plain_fsdp2_ckpt, "seed64": seed64_ckpt, "reference": reference_ckpt, "titan": torchtitan_ckpt}


@pytest.mark.parametrize("name", ["fsdp2", "seed64", "reference", "titan"])
def test_native_index_equals_the_safe_one(sources, name):
    root = sources[name]
    assert_same_index(native_index(root), safe_index(root))


def test_damaged_checkpoints_give_the_same_findings(plain_fsdp2_ckpt, tmp_path):
    """A missing and a truncated data file: the same findings, keys and files, either way."""
    root = tmp_path / "ckpt"
    shutil.copytree(plain_fsdp2_ckpt, root)
    files = sorted(p for p in root.iterdir() if p.suffix == ".distcp")
    files[0].unlink()
    with open(files[1], "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)
    a, b = native_index(root), safe_index(root)
    assert_same_index(a, b)
    assert {f.code for f in a.findings} >= {"missing_file", "truncated_file"}


def test_storage_out_of_chunk_order_pairs_by_offsets(plain_fsdp2_ckpt, tmp_path):
    """Storage entries in reverse order (torch never writes this; a merged `.metadata` might): each
    chunk still gets the item stored under its own offsets."""
    root = tmp_path / "ckpt"
    shutil.copytree(plain_fsdp2_ckpt, root)
    with open(root / dcp.METADATA_FILE, "rb") as f:
        md = pickle.load(f)  # noqa: S301 - a file this test's own fixture wrote with dcp.save
    md.storage_data = dict(reversed(list(md.storage_data.items())))
    with open(root / dcp.METADATA_FILE, "wb") as f:
        pickle.dump(md, f)
    a, b = native_index(root), safe_index(root)
    assert_same_index(a, b)
    assert_same_index(a, native_index(plain_fsdp2_ckpt))  # the same pairing as in the original order
    assert not a.findings


def test_chunk_table_is_the_list_it_stands_for(plain_fsdp2_ckpt):
    ix = native_index(plain_fsdp2_ckpt)
    e = max(ix.tensors(), key=lambda e: len(e.chunks))
    table = e.chunks
    assert isinstance(table, ChunkTable) and len(table) > 1
    chunks = list(table)
    assert all(isinstance(c, Chunk) and isinstance(c.location, ItemLocation) for c in chunks)
    assert table[0] == chunks[0] and table[-1] == chunks[-1] and table[1:] == chunks[1:]
    assert table == chunks and table == ChunkTable.of(chunks, len(e.shape))
    with pytest.raises(IndexError):
        table[len(chunks)]
    assert table.located_files() == {c.location.file for c in chunks}
    again = ChunkTable.of(chunks, len(e.shape))
    assert (again.offsets == table.offsets).all() and (again.sizes == table.sizes).all()
    assert (again.length == table.length).all() and (again.start == table.start).all()


def test_chunk_table_of_a_list_keeps_what_arrays_cannot_show():
    """A chunk without a location and a transformed item survive the round trip."""
    chunks = [Chunk(Box((0, 0), (2, 3)), ItemLocation("a.distcp", 0, 10, ("stream.zstd/1",))),
              Chunk(Box((2, 0), (2, 3)), None)]
    table = ChunkTable.of(chunks, 2)
    assert list(table) == chunks
    assert table.file.tolist() == [0, -1] and table.transform.tolist() == [0, -1]
    assert ChunkTable.of([], 2).offsets.shape == (0, 2)
